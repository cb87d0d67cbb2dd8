//! Max pooling over NCHW f32 images (square window, no padding): the forward keeps the flat input index
//! of each maximum, the backward scatters the gradient to them. CPU (`cpu.rs`) and CUDA (`cuda.rs`,
//! `pool.cu`) agree bit for bit when the windows do not overlap (stride >= kernel).

mod cpu;
mod cuda;

use crate::device::dispatch;
use crate::{check_len, Buffer, KernelError};

/// Shape of a max-pooling (NCHW, square window, no padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool2dGeometry {
    /// Images in the batch.
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Input height.
    pub height: usize,
    /// Input width.
    pub width: usize,
    /// Window side (2 for the usual 2x2 pooling).
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

impl Pool2dGeometry {
    /// 2x2 windows with stride 2.
    pub fn two_by_two(batch: usize, channels: usize, height: usize, width: usize) -> Self {
        Pool2dGeometry {
            batch,
            channels,
            height,
            width,
            kernel: 2,
            stride: 2,
        }
    }

    /// Output height.
    pub fn out_h(&self) -> usize {
        (self.height - self.kernel) / self.stride + 1
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.width - self.kernel) / self.stride + 1
    }

    /// Elements of the input.
    pub fn input_len(&self) -> usize {
        self.batch * self.channels * self.height * self.width
    }

    /// Elements of the output.
    pub fn output_len(&self) -> usize {
        self.batch * self.channels * self.out_h() * self.out_w()
    }

    fn validate(&self, what: &'static str) -> Result<(), KernelError> {
        let bad = |detail: String| Err(KernelError::InvalidArgument { what, detail });
        if self.kernel == 0 || self.stride == 0 {
            return bad(format!("kernel and stride must be positive: {self:?}"));
        }
        if self.kernel > self.height || self.kernel > self.width {
            return bad(format!("window larger than the input: {self:?}"));
        }
        let len = self
            .batch
            .checked_mul(self.channels)
            .and_then(|v| v.checked_mul(self.height))
            .and_then(|v| v.checked_mul(self.width));
        match len {
            Some(l) if l <= u32::MAX as usize && self.height <= i32::MAX as usize => Ok(()),
            _ => bad(format!("input too large for 32-bit indices: {self:?}")),
        }
    }
}

/// Max-pool forward: `y` is the window maxima, `indices` the flat index into `x` of each (the first
/// maximum in row-major window order; a NaN wins, as in PyTorch).
pub fn max_pool2d_forward(
    x: &Buffer<f32>,
    geom: &Pool2dGeometry,
    y: &mut Buffer<f32>,
    indices: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "max_pool2d_forward";
    geom.validate(WHAT)?;
    check_len(WHAT, geom.input_len(), x.len())?;
    check_len(WHAT, geom.output_len(), y.len())?;
    check_len(WHAT, geom.output_len(), indices.len())?;
    dispatch!(WHAT, [x, y, indices],
    cpu: {
        cpu::max_pool2d_forward(
            x.host(WHAT)?,
            geom,
            y.host_mut(WHAT)?,
            indices.host_mut(WHAT)?,
        );
    },
    cuda(dev): {
        let (ys, is) = (y.cuda_mut(WHAT)?, indices.cuda_mut(WHAT)?);
        cuda::max_pool2d_forward(&dev, x.cuda(WHAT)?, geom, ys, is)
    })
}

/// Max-pool backward: `dx` is overwritten with zeros, then `dx[indices[i]] += dy[i]`. With windows that do
/// not overlap (stride >= kernel) every input receives at most one value, so the result is exact on both
/// devices. Indices must come from [`max_pool2d_forward`] with an input of `dx.len()` elements.
pub fn max_pool2d_backward(
    dy: &Buffer<f32>,
    indices: &Buffer<u32>,
    dx: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "max_pool2d_backward";
    check_len(WHAT, dy.len(), indices.len())?;
    dispatch!(WHAT, [dy, indices, dx],
    cpu: {
        let (gs, is) = (dy.host(WHAT)?, indices.host(WHAT)?);
        let ds = dx.host_mut(WHAT)?;
        // Validate all indices first so the scatter neither branches on errors nor builds messages.
        let len = ds.len();
        if let Some(&i) = is.iter().find(|&&i| i as usize >= len) {
            ds.fill(0.0);
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("index {i} outside an input of {len} elements"),
            });
        }
        cpu::max_pool2d_backward(gs, is, ds);
    },
    cuda(dev): {
        let (gs, is) = (dy.cuda(WHAT)?, indices.cuda(WHAT)?);
        cuda::max_pool2d_backward(&dev, gs, is, dx.cuda_mut(WHAT)?)
    })
}
