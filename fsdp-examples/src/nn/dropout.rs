//! Dropout with a counter-based generator (reproducible, checkpointable).

use super::{held, held_mut, reuse_buffer, NnError};
use fp8_kernels::ops;
use fp8_kernels::Buffer;

/// Inverted dropout: in training, each element is zeroed with probability `p` and the rest are scaled by
/// `1 / (1 - p)`; in evaluation it is the identity.
///
/// The mask of element `i` of a call is a pure function of `(seed, offset + i)`
/// ([`fp8_kernels::ops::dropout_bits`]), and `offset` advances by the element count after every training
/// call. So the whole random state is `(seed, offset)`: saving [`Dropout::offset`] in a checkpoint and
/// restoring it with [`Dropout::set_offset`] reproduces the masks of an uninterrupted run exactly, on the
/// CPU and on CUDA alike.
#[derive(Debug)]
pub struct Dropout {
    p: f32,
    seed: u64,
    offset: u64,
    last: Option<ops::Dropout>,
    y: Option<Buffer<f32>>,
    mask: Option<Buffer<u8>>,
    dx: Option<Buffer<f32>>,
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1)` and generator `seed`.
    pub fn new(p: f32, seed: u64) -> Result<Self, NnError> {
        if !(0.0..1.0).contains(&p) {
            return Err(NnError::usage(
                "Dropout",
                format!("drop probability {p} is outside [0, 1)"),
            ));
        }
        Ok(Dropout {
            p,
            seed,
            offset: 0,
            last: None,
            y: None,
            mask: None,
            dx: None,
        })
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// The generator counter of the next training call.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Sets the generator counter (when resuming from a checkpoint).
    pub fn set_offset(&mut self, offset: u64) {
        self.offset = offset;
    }

    /// Training: masks `x` and returns the result; evaluation (`training == false`): returns `x` itself.
    pub fn forward<'a>(
        &'a mut self,
        x: &'a Buffer<f32>,
        training: bool,
    ) -> Result<&'a Buffer<f32>, NnError> {
        if !training {
            self.last = None;
            return Ok(x);
        }
        let params = ops::Dropout {
            p: self.p,
            seed: self.seed,
            offset: self.offset,
        };
        let dev = x.device();
        reuse_buffer(&mut self.y, &dev, x.len())?;
        reuse_buffer(&mut self.mask, &dev, x.len())?;
        let mask = self
            .mask
            .as_mut()
            .ok_or_else(|| NnError::usage("Dropout", "mask"))?;
        let y = held_mut(&mut self.y, "Dropout", "output")?;
        ops::dropout_forward(x, params, y, mask)?;
        self.offset = self.offset.wrapping_add(x.len() as u64);
        self.last = Some(params);
        Ok(y)
    }

    /// `dx = dy / (1 - p)` where the last training forward kept the element, else 0.
    pub fn backward(&mut self, dy: &Buffer<f32>) -> Result<&Buffer<f32>, NnError> {
        let params = self
            .last
            .ok_or_else(|| NnError::usage("Dropout", "backward without a training forward"))?;
        let mask = held(&self.mask, "Dropout", "mask")?;
        reuse_buffer(&mut self.dx, &dy.device(), dy.len())?;
        let dx = held_mut(&mut self.dx, "Dropout", "input gradient")?;
        ops::dropout_backward(dy, mask, params, dx)?;
        Ok(dx)
    }
}
