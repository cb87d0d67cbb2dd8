//! The data movement around a convolution computed as a GEMM: im2col (image patches to the rows of a
//! matrix) and its adjoint col2im, and the batched transpose between a GEMM's `[N, pixels, channels]`
//! output and NCHW. f32 images (NCHW) for im2col/col2im; f32 or bf16 for the transpose.
//!
//! All three are exact (copies, and col2im's sums in a fixed order), so CPU (`cpu.rs`) and CUDA
//! (`cuda.rs`, `conv.cu`) agree bit for bit.

mod cpu;
mod cuda;

use crate::device::{dispatch, shape_len};
use crate::{check_len, Buffer, FloatElement, KernelError};

/// Shape of a 2-D convolution's input and window, for [`im2col`] and [`col2im`] (NCHW).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dGeometry {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub channels: usize,
    /// Input height.
    pub height: usize,
    /// Input width.
    pub width: usize,
    /// Window height.
    pub kernel_h: usize,
    /// Window width.
    pub kernel_w: usize,
    /// Step between windows (both directions).
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
}

impl Conv2dGeometry {
    /// Output height.
    pub fn out_h(&self) -> usize {
        (self.height + 2 * self.padding - self.kernel_h) / self.stride + 1
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.width + 2 * self.padding - self.kernel_w) / self.stride + 1
    }

    /// Elements of the input `[batch, channels, height, width]`.
    pub fn input_len(&self) -> usize {
        self.batch * self.channels * self.height * self.width
    }

    /// Rows of the column matrix: one per output pixel, `batch * out_h * out_w`.
    pub fn patches(&self) -> usize {
        self.batch * self.out_h() * self.out_w()
    }

    /// Columns of the column matrix: `channels * kernel_h * kernel_w`.
    pub fn patch_len(&self) -> usize {
        self.channels * self.kernel_h * self.kernel_w
    }

    fn validate(&self, what: &'static str) -> Result<(), KernelError> {
        let bad = |detail: String| Err(KernelError::InvalidArgument { what, detail });
        if self.stride == 0 || self.kernel_h == 0 || self.kernel_w == 0 {
            return bad(format!("kernel and stride must be positive: {self:?}"));
        }
        if self.kernel_h > self.height + 2 * self.padding
            || self.kernel_w > self.width + 2 * self.padding
        {
            return bad(format!("window larger than the padded input: {self:?}"));
        }
        let big = [
            self.batch,
            self.channels,
            self.height,
            self.width,
            self.padding,
            self.patches(),
            self.patch_len(),
        ]
        .iter()
        .any(|&v| v > i32::MAX as usize);
        let total = self
            .patches()
            .checked_mul(self.patch_len())
            .and_then(|t| t.checked_mul(4));
        if big || total.is_none() {
            return bad(format!("geometry too large: {self:?}"));
        }
        Ok(())
    }
}

/// im2col: `cols` is row-major `[patches, patch_len]`, one row per output pixel `(n, oy, ox)` and one
/// column per `(c, ky, kx)`, zero where the window overlaps the padding. A convolution is then
/// `cols x W^T` with `W` of shape `[out_channels, patch_len]` (the layout of a linear layer).
pub fn im2col(
    x: &Buffer<f32>,
    geom: &Conv2dGeometry,
    cols: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "im2col";
    geom.validate(WHAT)?;
    check_len(WHAT, geom.input_len(), x.len())?;
    check_len(WHAT, geom.patches() * geom.patch_len(), cols.len())?;
    dispatch!(WHAT, [x, cols],
        cpu: {
            let (xs, out) = (x.host(WHAT)?, cols.host_mut(WHAT)?);
            if geom.padding == 0 {
                cpu::im2col_unpadded(xs, geom, out);
            } else {
                cpu::im2col_generic(xs, geom, out);
            }
        },
        cuda(dev): cuda::im2col(&dev, x.cuda(WHAT)?, geom, cols.cuda_mut(WHAT)?))
}

/// col2im, the adjoint of [`im2col`]: `dx[n, c, y, x]` = the sum of every `cols` entry that im2col read
/// from that pixel, summed with `ky` then `kx` ascending (identical on both devices). `dx` is overwritten.
pub fn col2im(
    cols: &Buffer<f32>,
    geom: &Conv2dGeometry,
    dx: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "col2im";
    geom.validate(WHAT)?;
    check_len(WHAT, geom.patches() * geom.patch_len(), cols.len())?;
    check_len(WHAT, geom.input_len(), dx.len())?;
    dispatch!(WHAT, [cols, dx],
        cpu: {
            let (cs_, out) = (cols.host(WHAT)?, dx.host_mut(WHAT)?);
            if geom.padding == 0 && geom.stride == 1 {
                cpu::col2im_stride1_unpadded(cs_, geom, out);
            } else {
                cpu::col2im_generic(cs_, geom, out);
            }
        },
        cuda(dev): cuda::col2im(&dev, cols.cuda(WHAT)?, geom, dx.cuda_mut(WHAT)?))
}

/// Batched transpose: `y[b, c, r] = x[b, r, c]` for `shape = [batch, rows, cols]` (e.g. a convolution's
/// `[N, pixels, channels]` GEMM output to NCHW, and back for the gradient).
pub fn transpose_batched<T: FloatElement>(
    x: &Buffer<T>,
    shape: [usize; 3],
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "transpose_batched";
    let total = shape_len(WHAT, &shape)?;
    check_len(WHAT, total, x.len())?;
    check_len(WHAT, total, y.len())?;
    dispatch!(WHAT, [x, y],
        cpu: {
            if shape[1] != 0 && shape[2] != 0 {
                cpu::transpose_batched(x.host(WHAT)?, shape, y.host_mut(WHAT)?);
            }
        },
        cuda(dev): cuda::transpose_batched(&dev, x.cuda(WHAT)?, shape, y.cuda_mut(WHAT)?))
}
