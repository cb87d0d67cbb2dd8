//! Dropout with a counter-based generator.

use crate::layer::{take_saved, InputGrad, Layer};
use crate::{NnError, Tensor};
use fp8_kernels::elementwise;
use fp8_kernels::Buffer;
use fsdp_shard::{Ctx, Module, ShardError, Visitor};

/// Zeroes each element with probability `p` in training and scales the rest by `1 / (1 - p)`; the
/// identity in evaluation. The mask of element `i` of a step is a function of `(seed, offset + i)`, and
/// the offset advances by the number of elements per training forward, so the masks are reproducible
/// and the offset (a module counter, saved in checkpoints) is the generator's whole state.
#[derive(Debug)]
pub struct Dropout {
    p: f32,
    seed: u64,
    offset: u64,
    last: Option<elementwise::Dropout>,
    mask: Option<Buffer<u8>>,
}

impl Dropout {
    /// Dropout with probability `p` in `[0, 1)` and generator seed `seed` (give each rank and layer its
    /// own seed: masks must differ between them).
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
            mask: None,
        })
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// The generator's position.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Module for Dropout {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.counter("offset", &mut self.offset)
    }
}

impl Layer for Dropout {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor) -> Result<Tensor, NnError> {
        if !ctx.is_training() {
            self.last = None;
            return Ok(x);
        }
        let params = elementwise::Dropout {
            p: self.p,
            seed: self.seed,
            offset: self.offset,
        };
        let dev = ctx.device().clone();
        let n = x.shape().numel();
        let mut y = Tensor::uninit(&dev, x.shape())?;
        let mut mask = dev.uninit::<u8>(n)?;
        elementwise::dropout_forward(x.data(), params, y.data_mut(), &mut mask)?;
        self.offset = self.offset.wrapping_add(n as u64);
        self.last = Some(params);
        self.mask = Some(mask);
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor, need_dx: bool) -> InputGrad {
        let params = take_saved(&mut self.last, "Dropout")?;
        let mask = self
            .mask
            .take()
            .ok_or_else(|| NnError::usage("Dropout", "mask missing"))?;
        if !need_dx {
            return Ok(None);
        }
        let mut dx = Tensor::uninit(ctx.device(), dy.shape())?;
        elementwise::dropout_backward(dy.data(), &mask, params, dx.data_mut())?;
        Ok(Some(dx))
    }
}
