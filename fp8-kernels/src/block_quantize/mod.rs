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
//! For exchanging block-scaled data between ranks, [`block_quantize_packed`] writes the `Rows1x128`
//! cast of `[rows, cols]` as one record per row, its codes followed by its inverse scales
//! ([`PackedRows1x128`]), so that row `r` is one contiguous chunk of an all-to-all; and
//! [`block_dequantize_sum`] dequantizes the rows of such a buffer and adds their F32 sum, taken in row
//! order, to an F32/BF16/F16 buffer (the receiving side of a block-scaled FP8 gradient exchange).
//! Where each block's scale is stored is a [`ScaleOrder`]: row-major over the grid (the table above, the
//! default), or [`ScaleOrder::Gemm`], the order cuBLASLt's block-scaled FP8 GEMMs read (1x128 scales
//! column-major, 128x128 scales row-major, leading dimensions padded to multiples of 4), so that
//! [`crate::gemm::gemm_fp8_block`] takes the cast's output as it is, with no re-layout pass.
//! [`ScaleOrder::strides`] gives the index of every block's scale and the buffer length.
//!
//! The CPU implementation (`cpu.rs`, rayon over bands of block rows) is the reference; `cuda.rs` and
//! `block_quantize.cu` launch one warp per 1x128 tile (packed or not), one block of threads per 128 x 128
//! region for the transposed tiles (with the 1x128 tiles too for [`block_quantize_both`], which writes
//! both layouts from one read), one block of threads per 128x128 block, and one thread per 8 elements of
//! the dequantized sum. The 128x128 cast (`blocks128.cuh` on CUDA, templated on where its
//! values come from, and `cpu.rs`'s loop) is also the Adam step's cast of block-scaled weights from their
//! masters, [`cast_weight_blocks`](crate::adam::control::cast_weight_blocks).

mod cpu;
mod cuda;

use crate::device::{device_of, dispatch, Placed};
use crate::elementwise::{gelu_backward, gelu_forward, GeluApprox};
use crate::kernel_source::{KernelModule, ModuleArch};
use crate::layer_norm::{norm_forward, NormSpec, NormStats};
use crate::swiglu_cast::{swiglu_backward, swiglu_forward};
use crate::{check_len, Buffer, FloatElement, KernelError};
use fp8_core::{BlockLayout, Fp8Format, ScaleRounding, ScalingGranularity, BLOCK_SIZE};

/// Leading dimensions of scales in [`ScaleOrder::Gemm`] are multiples of this (16 bytes of f32, the
/// alignment cuBLASLt wants of every column of scales).
pub const GEMM_SCALE_ALIGN: usize = 4;

/// Where the scale of each block of a [`BlockLayout`] is stored in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScaleOrder {
    /// Row-major over the grid, no padding: block `(i, j)` at `i * grid_cols + j` (as
    /// [`BlockLayout::block_of`] numbers blocks).
    #[default]
    RowMajor,
    /// The order cuBLASLt's block-scaled FP8 GEMMs read (`VEC128_32F`, `BLK128x128_32F`): blocks one row
    /// high (1x128 tiles) column-major over the grid, block `(i, j)` at `j * round_up(grid_rows, 4) + i`
    /// (the reduction dimension's blocks outermost, the rows contiguous); other blocks (128x128) row-major
    /// with each row of the grid padded, `(i, j)` at `i * round_up(grid_cols, 4) + j`. The padding
    /// entries are never written nor read.
    Gemm,
}

/// Where the scales of a layout live in their buffer: block `(i, j)` of the grid at
/// `i * row + j * col`, in a buffer of `len` values (padding included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScaleStrides {
    /// Stride between block rows of the grid.
    pub row: usize,
    /// Stride between block columns of the grid.
    pub col: usize,
    /// Length of the scale buffer.
    pub len: usize,
}

impl ScaleStrides {
    /// The buffer index of block `(i, j)`'s scale (no bounds check: `i`, `j` inside the grid).
    pub fn index(&self, i: usize, j: usize) -> usize {
        i * self.row + j * self.col
    }
}

impl ScaleOrder {
    /// The strides and buffer length of `layout`'s scales stored in this order. Errors when the padded
    /// length overflows.
    pub fn strides(self, layout: &BlockLayout) -> Result<ScaleStrides, KernelError> {
        let [gr, gc] = layout.grid();
        let pad = |n: usize| {
            n.checked_next_multiple_of(GEMM_SCALE_ALIGN).ok_or_else(|| {
                KernelError::InvalidArgument {
                    what: "block scales",
                    detail: format!("{n} blocks overflow when padded"),
                }
            })
        };
        let mul = |a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| KernelError::InvalidArgument {
                    what: "block scales",
                    detail: format!("{a} x {b} scales overflow usize"),
                })
        };
        Ok(match self {
            ScaleOrder::RowMajor => ScaleStrides {
                row: gc,
                col: 1,
                len: gr * gc,
            },
            ScaleOrder::Gemm if layout.block_shape()[0] == 1 => {
                let ld = pad(gr)?;
                ScaleStrides {
                    row: 1,
                    col: ld,
                    len: mul(ld, gc)?,
                }
            }
            ScaleOrder::Gemm => {
                let ld = pad(gc)?;
                ScaleStrides {
                    row: ld,
                    col: 1,
                    len: mul(gr, ld)?,
                }
            }
        })
    }
}

/// The CUDA module of the casts: `cuda/common.cuh`, `src/block_quantize/blocks128.cuh` (the 128x128-block
/// cast, shared with the Adam step's [`cast_weight_blocks`](crate::adam::control::cast_weight_blocks)),
/// `src/block_quantize/block_tiles.cuh` (the 1x128 + 128x1 tile cast), then
/// `src/block_quantize/block_quantize.cu`.
pub const BLOCK_QUANTIZE_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_block_quantize",
    files: &[
        "cuda/common.cuh",
        "src/block_quantize/blocks128.cuh",
        "src/block_quantize/block_tiles.cuh",
        "src/block_quantize/block_quantize.cu",
    ],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("blocks128.cuh"),
        include_str!("block_tiles.cuh"),
        include_str!("block_quantize.cu")
    ),
    arch: ModuleArch::Portable,
};

/// The CUDA module of the activations cast inside the tile cast ([`BlockCastInput`], BF16): the
/// activations' arithmetic (`src/elementwise/gelu.cuh`, `src/swiglu_cast/swiglu.cuh`: the same values as
/// the activation kernels), `blocks128.cuh`, `block_tiles.cuh`, then
/// `src/block_quantize/block_activation.cu`. A module of its own: only block-scaled MLPs compile it.
pub const BLOCK_ACTIVATION_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_block_activation",
    files: &[
        "cuda/common.cuh",
        "src/elementwise/gelu.cuh",
        "src/swiglu_cast/swiglu.cuh",
        "src/block_quantize/blocks128.cuh",
        "src/block_quantize/block_tiles.cuh",
        "src/block_quantize/block_activation.cu",
    ],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("../elementwise/gelu.cuh"),
        include_str!("../swiglu_cast/swiglu.cuh"),
        include_str!("blocks128.cuh"),
        include_str!("block_tiles.cuh"),
        include_str!("block_activation.cu")
    ),
    arch: ModuleArch::Portable,
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

/// What [`block_quantize`] does: the tiles and output layout, the FP8 format, the scales' rounding and
/// where they are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockQuantSpec {
    /// Tiles and output layout.
    pub layout: BlockQuantLayout,
    /// Target format.
    pub format: Fp8Format,
    /// Power-of-two or exact block scales ([`fp8_core::block_scale`]).
    pub rounding: ScaleRounding,
    /// How the scales and inverse scales are stored ([`ScaleOrder::Gemm`] for the block-scaled GEMM).
    pub scale_order: ScaleOrder,
}

impl BlockQuantSpec {
    /// `layout` to `format` with power-of-two scales stored row-major.
    pub const fn new(layout: BlockQuantLayout, format: Fp8Format) -> Self {
        BlockQuantSpec {
            layout,
            format,
            rounding: ScaleRounding::PowerOfTwo,
            scale_order: ScaleOrder::RowMajor,
        }
    }

    /// The same cast with its scales stored in `order`.
    pub const fn with_scale_order(mut self, order: ScaleOrder) -> Self {
        self.scale_order = order;
        self
    }
}

/// The largest side the CUDA kernels index with 32-bit integers; checked on both devices so a shape
/// that works on the CPU works on CUDA too.
const MAX_SIDE: usize = i32::MAX as usize;

pub(crate) fn check_sides(what: &'static str, sides: &[usize]) -> Result<(), KernelError> {
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
/// `spec.layout.output_layout(rows, cols)`, at the indices of `spec.scale_order`; both buffers hold
/// `spec.scale_order.strides(&layout)?.len` values, padding entries untouched). Every buffer on one
/// device; on CUDA the cast runs on the compute stream, asynchronously, with no host round trip.
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
    let strides = spec.scale_order.strides(&out)?;
    check_sides(WHAT, &[rows, cols, strides.len])?;
    check_len(WHAT, out.numel(), x.len())?;
    check_len(WHAT, out.numel(), codes.len())?;
    check_len(WHAT, strides.len, scale.len())?;
    check_len(WHAT, strides.len, scale_inv.len())?;
    dispatch!(WHAT, [x, codes, scale, scale_inv],
    cpu: {
        let (xs, q) = (x.host(WHAT)?, codes.host_mut(WHAT)?);
        let (s, si) = (scale.host_mut(WHAT)?, scale_inv.host_mut(WHAT)?);
        let scales = cpu::ScaleOut { scale: Some(s), scale_inv: si, strides };
        match spec.layout {
            BlockQuantLayout::Columns128x1Transposed => {
                let xt = cpu::transpose(xs, rows, cols);
                cpu::quantize(&xt, &out, spec.format, spec.rounding, q, scales);
            }
            _ => cpu::quantize(xs, &out, spec.format, spec.rounding, q, scales),
        }
    },
    cuda(dev): {
        if out.numel() == 0 {
            return Ok(());
        }
        let (xs, q) = (x.cuda(WHAT)?, codes.cuda_mut(WHAT)?);
        let (s, si) = (scale.cuda_mut(WHAT)?, scale_inv.cuda_mut(WHAT)?);
        cuda::quantize(&dev, xs, shape, spec, strides, q, s, si)
    })
}

/// Where one layout of [`block_quantize_both`] goes: its codes, scales and inverse scales (lengths as
/// [`block_quantize`] wants them for that layout).
#[derive(Debug)]
pub struct BlockQuantOutput<'a> {
    /// FP8 codes.
    pub codes: &'a mut Buffer<u8>,
    /// One scale per tile.
    pub scale: &'a mut Buffer<f32>,
    /// One inverse scale per tile.
    pub scale_inv: &'a mut Buffer<f32>,
}

/// What [`block_quantize_tiles`] casts: a tensor, or an activation computed on the fly from its inputs and
/// rounded to the element type, exactly as the activation's own kernel writes it (so a fused activation +
/// cast equals that kernel into a buffer followed by the cast, bit for bit, and the activation's output is
/// never written).
#[derive(Debug, Clone, Copy)]
pub enum BlockCastInput<'a, T: FloatElement> {
    /// The values of `x [rows, cols]`.
    Values(&'a Buffer<T>),
    /// `gelu(u)` ([`crate::elementwise::gelu_forward`]), `u [rows, cols]`.
    Gelu {
        /// GELU's input.
        u: &'a Buffer<T>,
        /// GELU's formula.
        approx: GeluApprox,
    },
    /// `gelu'(u) * dy` ([`crate::elementwise::gelu_backward`]), `u` and `dy` `[rows, cols]`.
    GeluGrad {
        /// GELU's input.
        u: &'a Buffer<T>,
        /// GELU's output gradient.
        dy: &'a Buffer<T>,
        /// GELU's formula.
        approx: GeluApprox,
    },
    /// `silu(gate) * up` ([`crate::swiglu_cast::swiglu_forward`]) from a fused gate/up output
    /// `gu [rows, 2 cols]`.
    SwiGlu {
        /// `[gate | up]` per row.
        gu: &'a Buffer<T>,
    },
    /// `[dgate | dup]` ([`crate::swiglu_cast::swiglu_backward`]), `[rows, cols]`, from `gu [rows, cols]`
    /// and `dh [rows, cols / 2]` (`cols` even).
    SwiGluGrad {
        /// `[gate | up]` per row.
        gu: &'a Buffer<T>,
        /// The gradient of SwiGLU's output.
        dh: &'a Buffer<T>,
    },
    /// The output of the LayerNorm / RMSNorm `spec` ([`crate::layer_norm::norm_forward`]) of
    /// `x [rows, cols]` (`spec.rows` x `spec.d`), computed from the row statistics `stats` that
    /// [`crate::layer_norm::norm_forward_stats`] (or the forward itself) wrote for this `x`: the same
    /// operations as the forward's, so the same values, and the norm's output is never written.
    Norm {
        /// The norm's input.
        x: &'a Buffer<T>,
        /// Its weight `[cols]`.
        weight: &'a Buffer<T>,
        /// Its bias `[cols]`, if any.
        bias: Option<&'a Buffer<T>>,
        /// The forward's row statistics of `x`.
        stats: &'a NormStats,
        /// The normalisation.
        spec: NormSpec,
    },
}

impl<T: FloatElement> BlockCastInput<'_, T> {
    /// Checks the input buffers against the cast's `[rows, cols]`.
    fn check(&self, what: &'static str, [rows, cols]: [usize; 2]) -> Result<(), KernelError> {
        let n = rows * cols;
        match *self {
            BlockCastInput::Values(x) | BlockCastInput::Gelu { u: x, .. } => {
                check_len(what, n, x.len())
            }
            BlockCastInput::GeluGrad { u, dy, .. } => {
                check_len(what, n, u.len())?;
                check_len(what, n, dy.len())
            }
            BlockCastInput::SwiGlu { gu } => check_len(what, 2 * n, gu.len()),
            BlockCastInput::Norm {
                x,
                weight,
                bias,
                stats,
                spec,
            } => {
                if [spec.rows, spec.d] != [rows, cols] {
                    return Err(KernelError::InvalidArgument {
                        what,
                        detail: format!(
                            "a norm of {} x {} cast as {rows} x {cols}",
                            spec.rows, spec.d
                        ),
                    });
                }
                crate::layer_norm::check_forward(what, &spec, x, weight, bias, stats).map(|_| ())
            }
            BlockCastInput::SwiGluGrad { gu, dh } => {
                if cols % 2 != 0 {
                    return Err(KernelError::InvalidArgument {
                        what,
                        detail: format!("SwiGLU's gradient has an even width, not {cols}"),
                    });
                }
                check_len(what, n, gu.len())?;
                check_len(what, n / 2, dh.len())
            }
        }
    }

    /// The input buffers (for the device check).
    fn buffers(&self) -> Vec<&dyn Placed> {
        match *self {
            BlockCastInput::Values(x) | BlockCastInput::Gelu { u: x, .. } => vec![x],
            BlockCastInput::SwiGlu { gu } => vec![gu],
            BlockCastInput::GeluGrad { u: a, dy: b, .. }
            | BlockCastInput::SwiGluGrad { gu: a, dh: b } => vec![a, b],
            BlockCastInput::Norm {
                x,
                weight,
                ref bias,
                stats,
                ..
            } => vec![x, weight, bias, &stats.mean, &stats.rstd],
        }
    }

    /// The activation's `[rows, cols]` values computed by its element-wise kernel into a new buffer on
    /// `dev` (what the fused cast reads without writing; `None` for [`BlockCastInput::Values`]).
    pub fn values_on(
        &self,
        dev: &crate::Device,
        [rows, cols]: [usize; 2],
    ) -> Result<Option<Buffer<T>>, KernelError> {
        let mut out = dev.uninit::<T>(rows * cols)?;
        match *self {
            BlockCastInput::Values(_) => return Ok(None),
            BlockCastInput::Gelu { u, approx } => gelu_forward(u, &mut out, approx)?,
            BlockCastInput::GeluGrad { u, dy, approx } => gelu_backward(u, dy, &mut out, approx)?,
            BlockCastInput::SwiGlu { gu } => swiglu_forward(gu, [rows, cols], &mut out)?,
            BlockCastInput::SwiGluGrad { gu, dh } => {
                swiglu_backward(gu, dh, [rows, cols / 2], &mut out)?
            }
            BlockCastInput::Norm {
                x,
                weight,
                bias,
                stats,
                spec,
            } => match dev {
                // From the given statistics, as the fused kernel computes it.
                crate::Device::Cpu => {
                    const WHAT: &str = "block_quantize_tiles";
                    let b = bias.map(|b| b.host(WHAT)).transpose()?;
                    crate::layer_norm::forward_with_stats(
                        cols,
                        x.host(WHAT)?,
                        weight.host(WHAT)?,
                        b,
                        stats.mean.host(WHAT)?,
                        stats.rstd.host(WHAT)?,
                        out.host_mut(WHAT)?,
                    );
                }
                // The forward again: the same statistics for the same x, so the same values.
                crate::Device::Cuda(_) => {
                    let mut scratch = NormStats::new(dev, rows)?;
                    norm_forward(&spec, x, weight, bias, &mut scratch, &mut out)?
                }
            },
        }
        Ok(Some(out))
    }

    /// The values on the host (the CPU reference: the activation's element-wise kernel, then the cast).
    fn host_values(&self, shape: [usize; 2]) -> Result<Vec<T>, KernelError> {
        const WHAT: &str = "block_quantize_tiles";
        match (self.values_on(&crate::Device::Cpu, shape)?, *self) {
            (Some(v), _) => Ok(v.host(WHAT)?.to_vec()),
            (None, BlockCastInput::Values(x)) => Ok(x.host(WHAT)?.to_vec()),
            (None, _) => Err(KernelError::Internal("an activation without values".into())),
        }
    }
}

/// The `Rows1x128` cast of `input`'s `[rows, cols]` values into `rows_out` and/or its
/// `Columns128x1Transposed` cast into `cols_out` (at least one), both with `format`, `rounding` and scales
/// in `order`: bit for bit what [`block_quantize`] writes of those values, with one read of the inputs on
/// CUDA (one block of threads per 128 x 128 region computes the row and the column tiles' amaxes from the
/// same registers) and, for an activation, without writing it. The linear layers need both layouts: the
/// forward's input for `y = x W^T` and the weight gradient, the backward's `dy` for `dx` and the weight
/// gradient.
#[allow(clippy::too_many_arguments)]
pub fn block_quantize_tiles<T: FloatElement>(
    input: BlockCastInput<'_, T>,
    shape: [usize; 2],
    format: Fp8Format,
    rounding: ScaleRounding,
    order: ScaleOrder,
    rows_out: Option<BlockQuantOutput<'_>>,
    cols_out: Option<BlockQuantOutput<'_>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_quantize_tiles";
    let [rows, cols] = shape;
    if rows_out.is_none() && cols_out.is_none() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "neither the 1x128 nor the 128x1 output was asked for".into(),
        });
    }
    let rl = BlockQuantLayout::Rows1x128.output_layout(rows, cols)?;
    let cl = BlockQuantLayout::Columns128x1Transposed.output_layout(rows, cols)?;
    let (rs, cs) = (order.strides(&rl)?, order.strides(&cl)?);
    check_sides(WHAT, &[rows, cols, 2 * cols, rs.len, cs.len])?;
    input.check(WHAT, shape)?;
    for (out, strides) in [(&rows_out, rs), (&cols_out, cs)] {
        if let Some(out) = out {
            check_len(WHAT, rl.numel(), out.codes.len())?;
            check_len(WHAT, strides.len, out.scale.len())?;
            check_len(WHAT, strides.len, out.scale_inv.len())?;
        }
    }
    let mut outs = [rows_out, cols_out];
    let device = {
        let mut all = input.buffers();
        for o in outs.iter().flatten() {
            all.extend([&*o.codes as &dyn Placed, &*o.scale, &*o.scale_inv]);
        }
        device_of(WHAT, &all)?
    };
    let [rows_out, cols_out] = &mut outs;
    match device {
        None => {
            let values = input.host_values(shape)?;
            if let Some(o) = rows_out {
                let scales = cpu::ScaleOut {
                    scale: Some(o.scale.host_mut(WHAT)?),
                    scale_inv: o.scale_inv.host_mut(WHAT)?,
                    strides: rs,
                };
                cpu::quantize(
                    &values,
                    &rl,
                    format,
                    rounding,
                    o.codes.host_mut(WHAT)?,
                    scales,
                );
            }
            if let Some(o) = cols_out {
                let xt = cpu::transpose(&values, rows, cols);
                let scales = cpu::ScaleOut {
                    scale: Some(o.scale.host_mut(WHAT)?),
                    scale_inv: o.scale_inv.host_mut(WHAT)?,
                    strides: cs,
                };
                cpu::quantize(&xt, &cl, format, rounding, o.codes.host_mut(WHAT)?, scales);
            }
            Ok(())
        }
        Some(dev) => {
            if rl.numel() == 0 {
                return Ok(());
            }
            // The fused activation kernels are BF16 only: other types compute the activation first.
            let values = if T::DTYPE == crate::DType::BF16 {
                None
            } else {
                input.values_on(&crate::Device::Cuda(dev.clone()), shape)?
            };
            let input = values.as_ref().map_or(input, BlockCastInput::Values);
            cuda::quantize_tiles(
                &dev,
                input,
                shape,
                format,
                rounding,
                (rs, cs),
                rows_out.as_mut(),
                cols_out.as_mut(),
            )
        }
    }
}

/// [`block_quantize_tiles`] of the values of `x` into both layouts.
pub fn block_quantize_both<T: FloatElement>(
    x: &Buffer<T>,
    shape: [usize; 2],
    format: Fp8Format,
    rounding: ScaleRounding,
    order: ScaleOrder,
    rows_out: BlockQuantOutput<'_>,
    cols_out: BlockQuantOutput<'_>,
) -> Result<(), KernelError> {
    block_quantize_tiles(
        BlockCastInput::Values(x),
        shape,
        format,
        rounding,
        order,
        Some(rows_out),
        Some(cols_out),
    )
}

/// The `Blocks128x128` E4M3 cast with power-of-two scales of row-major `x [rows, cols]` on the host (the
/// CPU side of [`cast_weight_blocks`](crate::adam::control::cast_weight_blocks)): the codes go to `codes`
/// and block `(i, j)`'s inverse scale to `scale_inv[i * ld + j]`, bit for bit what [`block_quantize`]
/// writes (the same code). The caller checked the lengths: `x` and `codes` hold `rows * cols` values and
/// `scale_inv` every block's index, `ld >= ceil(cols / 128)`.
pub(crate) fn blocks128_e4m3_host(
    x: &[f32],
    [rows, cols]: [usize; 2],
    codes: &mut [u8],
    scale_inv: &mut [f32],
    ld: usize,
) -> Result<(), KernelError> {
    let layout = BlockQuantLayout::Blocks128x128.output_layout(rows, cols)?;
    let strides = ScaleStrides {
        row: ld,
        col: 1,
        len: scale_inv.len(),
    };
    let out = cpu::ScaleOut {
        scale: None,
        scale_inv,
        strides,
    };
    cpu::quantize(
        x,
        &layout,
        Fp8Format::E4M3,
        ScaleRounding::PowerOfTwo,
        codes,
        out,
    );
    Ok(())
}

pub(crate) use cuda::blocks128_launch;

/// Dequantizes block-scaled codes: `out[i] = T(decode(codes[i]) * scale_inv[b])` where `b` is the index,
/// in `order`, of the block of element `i` in `layout` (the layout of the codes, e.g. from
/// [`BlockQuantLayout::output_layout`]; any block shape, per tensor included).
pub fn block_dequantize<T: FloatElement>(
    codes: &Buffer<u8>,
    layout: &BlockLayout,
    order: ScaleOrder,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_dequantize";
    let [br, bc] = layout.block_shape();
    let strides = order.strides(layout)?;
    check_sides(WHAT, &[layout.rows(), layout.cols(), br, bc, strides.len])?;
    check_len(WHAT, layout.numel(), codes.len())?;
    check_len(WHAT, layout.numel(), out.len())?;
    check_len(WHAT, strides.len, scale_inv.len())?;
    dispatch!(WHAT, [codes, scale_inv, out],
    cpu: {
        let si = cpu::gather_row_major(scale_inv.host(WHAT)?, layout, &strides);
        cpu::dequantize(codes.host(WHAT)?, layout, format, &si, out.host_mut(WHAT)?)
    },
    cuda(dev): {
        if layout.numel() == 0 {
            return Ok(());
        }
        let (q, si) = (codes.cuda(WHAT)?, scale_inv.cuda(WHAT)?);
        cuda::dequantize(&dev, q, layout, &strides, format, si, out.cuda_mut(WHAT)?)
    })
}

/// Bytes each packed row's parts are aligned to (codes, then inverse scales, then the next row).
const PACK_ALIGN: usize = 16;

/// The byte layout [`block_quantize_packed`] writes and [`block_dequantize_sum`] reads: `rows` rows of
/// `cols` elements cast in 1x128 tiles (the `Rows1x128` layout of `[rows, cols]`), each row stored as
/// one contiguous record
///
/// ```text
/// [ codes: cols bytes | pad to 16 | scale_inv: ceil(cols/128) f32, little-endian | pad to 16 ]
/// ```
///
/// so row `r` alone (its codes and the inverse scales that decode them) is bytes
/// `r * row_bytes() .. (r + 1) * row_bytes()`: one chunk of an all-to-all per destination rank, codes
/// and scales in one collective. Tiles never cross a row boundary (a row whose length is not a multiple
/// of 128 ends in a partial tile of its real elements), so a row can be decoded by whoever receives it.
///
/// Bytes per element on the wire: `row_bytes() / cols`, that is `1 + 4/128 = 1.03125` plus at most 30
/// bytes of padding per row (F32 takes 4, BF16 2, per-tensor FP8 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedRows1x128 {
    rows: usize,
    cols: usize,
}

impl PackedRows1x128 {
    /// `rows` records of `cols` elements. Errors when a side exceeds the kernels' 32-bit indices or the
    /// byte count overflows.
    pub fn new(rows: usize, cols: usize) -> Result<Self, KernelError> {
        const WHAT: &str = "PackedRows1x128";
        check_sides(WHAT, &[rows, cols])?;
        let p = PackedRows1x128 { rows, cols };
        let overflow = || KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("{rows} rows of {cols} elements overflow the byte count"),
        };
        cols.checked_next_multiple_of(PACK_ALIGN)
            .and_then(|c| c.checked_add((4 * p.blocks_per_row()).next_multiple_of(PACK_ALIGN)))
            .and_then(|r| r.checked_mul(rows))
            .ok_or_else(overflow)?;
        Ok(p)
    }

    /// Rows (records).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// 1x128 tiles (inverse scales) per row: `ceil(cols / 128)`.
    pub fn blocks_per_row(&self) -> usize {
        self.cols.div_ceil(BLOCK_SIZE)
    }

    /// Offset of a row's inverse scales in its record: `cols` rounded up to 16.
    pub fn scales_offset(&self) -> usize {
        self.cols.next_multiple_of(PACK_ALIGN)
    }

    /// Bytes per row record (a multiple of 16).
    pub fn row_bytes(&self) -> usize {
        self.scales_offset() + (4 * self.blocks_per_row()).next_multiple_of(PACK_ALIGN)
    }

    /// Bytes of all records.
    pub fn num_bytes(&self) -> usize {
        self.rows * self.row_bytes()
    }

    /// The 1x128 [`BlockLayout`] of the `[rows, cols]` matrix the records hold.
    pub fn layout(&self) -> Result<BlockLayout, KernelError> {
        Ok(BlockLayout::new(
            self.rows,
            self.cols,
            ScalingGranularity::Block1x128,
        )?)
    }
}

/// [`block_quantize`] of row-major `x [rows, cols]` in the `Rows1x128` layout, written packed (see
/// [`PackedRows1x128`]): row `r`'s codes and inverse scales form record `r` of `packed`. Codes and
/// inverse scales are bit for bit those of [`block_quantize`] (the scales themselves are not kept);
/// padding bytes are left as they are. On CUDA the cast runs on the compute stream, asynchronously.
pub fn block_quantize_packed<T: FloatElement>(
    x: &Buffer<T>,
    packing: PackedRows1x128,
    format: Fp8Format,
    rounding: ScaleRounding,
    packed: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_quantize_packed";
    check_len(WHAT, packing.rows * packing.cols, x.len())?;
    check_len(WHAT, packing.num_bytes(), packed.len())?;
    dispatch!(WHAT, [x, packed],
    cpu: cpu::quantize_packed(x.host(WHAT)?, &packing, format, rounding, packed.host_mut(WHAT)?),
    cuda(dev): {
        if packing.rows * packing.cols == 0 {
            return Ok(());
        }
        cuda::quantize_packed(&dev, x.cuda(WHAT)?, &packing, format, rounding, packed.cuda_mut(WHAT)?)
    })
}

/// Dequantizes the `rows` pieces of `packed` (see [`PackedRows1x128`]) and adds their sum to `out`
/// (`cols` elements): with `d_r[i] = decode(code_r[i]) * scale_inv_r[i / 128]` (one f32 multiply),
///
/// `out[i] = D(f32(out[i]) + alpha * (((d_0[i] + d_1[i]) + d_2[i]) + ... + d_{rows-1}[i]))`,
///
/// every operation one f32 rounding, the sum in row (rank) order from row 0, and one rounding to `D` at
/// the end (exact for f32, nearest even for bf16 and f16). The order is fixed, so the result is the same
/// on every rank and device, bit for bit. This is the receiving half of a block-scaled FP8 gradient
/// exchange: row `r` is the piece of this rank's shard that rank `r` quantized. `rows` must be at least 1.
pub fn block_dequantize_sum<D: FloatElement>(
    packed: &Buffer<u8>,
    packing: PackedRows1x128,
    format: Fp8Format,
    alpha: f32,
    out: &mut Buffer<D>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_dequantize_sum";
    if packing.rows == 0 {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "no pieces to sum (0 rows)".into(),
        });
    }
    check_len(WHAT, packing.num_bytes(), packed.len())?;
    check_len(WHAT, packing.cols, out.len())?;
    dispatch!(WHAT, [packed, out],
    cpu: cpu::dequantize_sum(packed.host(WHAT)?, &packing, format, alpha, out.host_mut(WHAT)?),
    cuda(dev): {
        if packing.cols == 0 {
            return Ok(());
        }
        cuda::dequantize_sum(&dev, packed.cuda(WHAT)?, &packing, format, alpha, out.cuda_mut(WHAT)?)
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
        let e = block_dequantize(
            &q,
            &layout,
            ScaleOrder::RowMajor,
            Fp8Format::E4M3,
            &si,
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
        // In the GEMM's order the 3 rows of 1x128 tiles are padded to 4: 8 scales.
        let gemm = spec.with_scale_order(ScaleOrder::Gemm);
        let e = block_quantize(&x, [3, 130], gemm, &mut q, &mut s, &mut si).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::LengthMismatch {
                    expected: 8,
                    actual: 6,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn scale_strides_of_both_orders() {
        let row = BlockLayout::new(6, 300, ScalingGranularity::Block1x128).unwrap();
        assert_eq!(
            ScaleOrder::RowMajor.strides(&row).unwrap(),
            ScaleStrides {
                row: 3,
                col: 1,
                len: 18
            }
        );
        // 1x128 tiles: the reduction dimension's 3 blocks outermost, 6 rows padded to 8.
        let g = ScaleOrder::Gemm.strides(&row).unwrap();
        assert_eq!(
            g,
            ScaleStrides {
                row: 1,
                col: 8,
                len: 24
            }
        );
        assert_eq!(g.index(5, 2), 21);
        // 128x128 blocks: row-major, 3 block columns padded to 4.
        let w = BlockLayout::new(300, 300, ScalingGranularity::Block128x128).unwrap();
        assert_eq!(
            ScaleOrder::Gemm.strides(&w).unwrap(),
            ScaleStrides {
                row: 4,
                col: 1,
                len: 12
            }
        );
        let empty = BlockLayout::new(0, 300, ScalingGranularity::Block1x128).unwrap();
        assert_eq!(ScaleOrder::Gemm.strides(&empty).unwrap().len, 0);
    }
}
