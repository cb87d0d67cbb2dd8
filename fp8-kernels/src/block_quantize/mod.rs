//! Block-scaled FP8 casts (DeepSeek-V3's recipe; see [`fp8_core::block`]): one F32 scale per 1x128 tile
//! or 128x128 block instead of one per tensor, and the dequantization back.
//!
//! [`block_quantize`] casts a row-major `[rows, cols]` input (f32, bf16 or f16) to E4M3 or E5M2 codes in
//! one of three layouts ([`BlockQuantLayout`]):
//!
//! | layout | tiles of the input | codes | scales (row-major) |
//! | --- | --- | --- | --- |
//! | `Rows1x128` | 1 x 128, along the last dimension | `[rows, cols]` | `[rows, ceil(cols/128)]` |
//! | `Columns128x1Transposed` | 128 x 1, along the first dimension | `[cols, rows]` (transposed) | `[cols, ceil(rows/128)]` |
//! | `Blocks128x128` | 128 x 128 | `[rows, cols]` | `[ceil(rows/128), ceil(cols/128)]` |
//!
//! `Columns128x1Transposed` is the operand of the weight-gradient GEMM (it reduces over the rows, the
//! tokens): its codes and scales are exactly those of `Rows1x128` applied to the transposed input, so
//! the output is described by the 1x128 [`BlockLayout`] of `[cols, rows]`
//! ([`BlockQuantLayout::output_layout`] gives it for every layout).
//!
//! Rules (both devices, bit for bit): a block's amax is the largest `|x|` of its real elements (NaN
//! ignored; shapes that are not multiples of 128 end in a partial block of only the real elements, no
//! padding); its scale is [`fp8_core::block_scale`] (`fmax / amax` rounded down, to a power of two when
//! asked, margin 0; scale 1 for an all-zero block or one holding an infinity); each code is
//! `encode(x * scale)` with one f32 multiply (round to nearest even, saturating, NaN to `0x7F`); and
//! `scale_inv = 1 / scale` (one f32 division). [`block_dequantize`] computes
//! `decode(q) * scale_inv[block]` rounded to the output type, for any [`BlockLayout`].
//!
//! The CPU implementation (`cpu.rs`, rayon over bands of block rows) is the reference; `cuda.rs` and
//! `block_quantize.cu` launch one warp per 1x128 tile, one 128 x 32 slab per block of threads for the
//! transposed tiles, and one block of threads per 128x128 block.

mod cpu;
mod cuda;

use crate::device::dispatch;
use crate::kernel_source::KernelModule;
use crate::{check_len, Buffer, FloatElement, KernelError};
use fp8_core::{BlockLayout, Fp8Format, ScaleRounding, ScalingGranularity};

/// The CUDA module: `cuda/common.cuh`, then `src/block_quantize/block_quantize.cu`.
pub const BLOCK_QUANTIZE_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_block_quantize",
    files: &["cuda/common.cuh", "src/block_quantize/block_quantize.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("block_quantize.cu")
    ),
};

/// Which tiles [`block_quantize`] scales and how it lays out its output (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockQuantLayout {
    /// 1x128 tiles along the last dimension (activations and gradients as the forward and data-gradient
    /// GEMMs read them).
    Rows1x128,
    /// 128x1 tiles along the first dimension, codes written transposed (`[cols, rows]`): the operand of
    /// the weight-gradient GEMM.
    Columns128x1Transposed,
    /// 128x128 blocks (weights).
    Blocks128x128,
}

impl BlockQuantLayout {
    /// The layout of the codes and scales written for a `[rows, cols]` input: the 1x128 layout of
    /// `[rows, cols]`, the 1x128 layout of the transpose `[cols, rows]`, or the 128x128 layout of
    /// `[rows, cols]`. Errors when `rows * cols` overflows.
    pub fn output_layout(self, rows: usize, cols: usize) -> Result<BlockLayout, KernelError> {
        Ok(match self {
            BlockQuantLayout::Rows1x128 => {
                BlockLayout::new(rows, cols, ScalingGranularity::Block1x128)?
            }
            BlockQuantLayout::Columns128x1Transposed => {
                BlockLayout::new(cols, rows, ScalingGranularity::Block1x128)?
            }
            BlockQuantLayout::Blocks128x128 => {
                BlockLayout::new(rows, cols, ScalingGranularity::Block128x128)?
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            BlockQuantLayout::Rows1x128 => "1x128",
            BlockQuantLayout::Columns128x1Transposed => "128x1t",
            BlockQuantLayout::Blocks128x128 => "128x128",
        }
    }
}

/// What [`block_quantize`] does: the tiles and output layout, the FP8 format, the scales' rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockQuantSpec {
    /// Tiles and output layout.
    pub layout: BlockQuantLayout,
    /// Target format.
    pub format: Fp8Format,
    /// Power-of-two or exact block scales ([`fp8_core::block_scale`]).
    pub rounding: ScaleRounding,
}

impl BlockQuantSpec {
    /// `layout` to `format` with power-of-two scales.
    pub const fn new(layout: BlockQuantLayout, format: Fp8Format) -> Self {
        BlockQuantSpec {
            layout,
            format,
            rounding: ScaleRounding::PowerOfTwo,
        }
    }
}

/// The largest side the CUDA kernels index with 32-bit integers; checked on both devices so a shape
/// that works on the CPU works on CUDA too.
const MAX_SIDE: usize = i32::MAX as usize;

fn check_sides(what: &'static str, sides: &[usize]) -> Result<(), KernelError> {
    match sides.iter().find(|&&s| s > MAX_SIDE) {
        Some(s) => Err(KernelError::InvalidArgument {
            what,
            detail: format!("size {s} exceeds the 32-bit index range of the kernels"),
        }),
        None => Ok(()),
    }
}

/// Block-scaled cast of row-major `x [rows, cols]` (`shape`) as `spec` says: writes the codes into
/// `codes` (`rows * cols`, transposed for [`BlockQuantLayout::Columns128x1Transposed`]) and each block's
/// scale and inverse into `scale` and `scale_inv` (one per block of
/// `spec.layout.output_layout(rows, cols)`, row-major over its grid). Every buffer on one device; on
/// CUDA the cast runs on the compute stream, asynchronously, with no host round trip.
pub fn block_quantize<T: FloatElement>(
    x: &Buffer<T>,
    shape: [usize; 2],
    spec: BlockQuantSpec,
    codes: &mut Buffer<u8>,
    scale: &mut Buffer<f32>,
    scale_inv: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_quantize";
    let [rows, cols] = shape;
    let out = spec.layout.output_layout(rows, cols)?;
    check_sides(WHAT, &[rows, cols])?;
    check_len(WHAT, out.numel(), x.len())?;
    check_len(WHAT, out.numel(), codes.len())?;
    check_len(WHAT, out.num_blocks(), scale.len())?;
    check_len(WHAT, out.num_blocks(), scale_inv.len())?;
    dispatch!(WHAT, [x, codes, scale, scale_inv],
    cpu: {
        let (xs, q) = (x.host(WHAT)?, codes.host_mut(WHAT)?);
        let (s, si) = (scale.host_mut(WHAT)?, scale_inv.host_mut(WHAT)?);
        match spec.layout {
            BlockQuantLayout::Columns128x1Transposed => {
                let xt = cpu::transpose(xs, rows, cols);
                cpu::quantize(&xt, &out, spec.format, spec.rounding, q, s, si);
            }
            _ => cpu::quantize(xs, &out, spec.format, spec.rounding, q, s, si),
        }
    },
    cuda(dev): {
        if out.numel() == 0 {
            return Ok(());
        }
        let (xs, q) = (x.cuda(WHAT)?, codes.cuda_mut(WHAT)?);
        let (s, si) = (scale.cuda_mut(WHAT)?, scale_inv.cuda_mut(WHAT)?);
        cuda::quantize(&dev, xs, shape, spec, q, s, si)
    })
}

/// Dequantizes block-scaled codes: `out[i] = T(decode(codes[i]) * scale_inv[b])` where `b` is the block
/// of element `i` in `layout` (the layout of the codes, e.g. from [`BlockQuantLayout::output_layout`];
/// any block shape, per tensor included).
pub fn block_dequantize<T: FloatElement>(
    codes: &Buffer<u8>,
    layout: &BlockLayout,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_dequantize";
    let [br, bc] = layout.block_shape();
    check_sides(
        WHAT,
        &[layout.rows(), layout.cols(), br, bc, layout.grid()[1]],
    )?;
    check_len(WHAT, layout.numel(), codes.len())?;
    check_len(WHAT, layout.numel(), out.len())?;
    check_len(WHAT, layout.num_blocks(), scale_inv.len())?;
    dispatch!(WHAT, [codes, scale_inv, out],
    cpu: cpu::dequantize(codes.host(WHAT)?, layout, format, scale_inv.host(WHAT)?, out.host_mut(WHAT)?),
    cuda(dev): {
        if layout.numel() == 0 {
            return Ok(());
        }
        let (q, si) = (codes.cuda(WHAT)?, scale_inv.cuda(WHAT)?);
        cuda::dequantize(&dev, q, layout, format, si, out.cuda_mut(WHAT)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    #[test]
    fn output_layouts() {
        let l = BlockQuantLayout::Columns128x1Transposed
            .output_layout(300, 5)
            .unwrap();
        assert_eq!((l.rows(), l.cols(), l.grid()), (5, 300, [5, 3]));
        let b = BlockQuantLayout::Blocks128x128
            .output_layout(129, 128)
            .unwrap();
        assert_eq!(b.grid(), [2, 1]);
        assert_eq!(BlockQuantLayout::Rows1x128.name(), "1x128");
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let dev = Device::cpu();
        let x: Buffer<f32> = dev.zeros(130 * 3).unwrap();
        let mut q: Buffer<u8> = dev.zeros(130 * 3).unwrap();
        let spec = BlockQuantSpec::new(BlockQuantLayout::Rows1x128, Fp8Format::E4M3);
        // 3 rows of 2 tiles need 6 scales.
        let (mut s, mut si): (Buffer<f32>, Buffer<f32>) =
            (dev.zeros(6).unwrap(), dev.zeros(5).unwrap());
        let e = block_quantize(&x, [3, 130], spec, &mut q, &mut s, &mut si).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::LengthMismatch {
                    expected: 6,
                    actual: 5,
                    ..
                }
            ),
            "{e}"
        );
        let mut si: Buffer<f32> = dev.zeros(6).unwrap();
        block_quantize(&x, [3, 130], spec, &mut q, &mut s, &mut si).unwrap();
        let e = block_quantize(&x, [3, 131], spec, &mut q, &mut s, &mut si).unwrap_err();
        assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
        let e = block_quantize(&x, [usize::MAX, 2], spec, &mut q, &mut s, &mut si).unwrap_err();
        assert!(matches!(e, KernelError::Core(_)), "{e}");
        let layout = spec.layout.output_layout(3, 130).unwrap();
        let mut out: Buffer<f32> = dev.zeros(130 * 3 - 1).unwrap();
        let e = block_dequantize(&q, &layout, Fp8Format::E4M3, &si, &mut out).unwrap_err();
        assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
    }
}
