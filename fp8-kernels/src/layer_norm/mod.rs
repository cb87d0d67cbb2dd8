//! LayerNorm and RMSNorm over the rows of a row-major `[rows, d]` tensor: forward (output in the input's
//! element type, or fused with the FP8 cast + transpose and the amax of the output), and backward (dx,
//! optionally accumulated into an existing gradient; dweight and dbias in a fixed two-level order).
//!
//! # Definitions (both devices, f32 arithmetic, one rounding per operation)
//! Row sums use the *warp order*: element `e` goes to lane `(e / 8) % 32`, each lane adds its elements in
//! increasing order starting from zero, and the 32 lane sums are combined by a butterfly (lane `l` adds
//! lane `l ^ off` for off = 16, 8, 4, 2, 1).
//! - LayerNorm: `mean = sum(x) / d`, `var = sum((x - mean)^2) / d`; RMSNorm: `mean = 0`,
//!   `var = sum(x^2) / d`. Both: `rstd = 1 / sqrt(var + eps)` (IEEE sqrt and division).
//! - `y = (x - mean) * rstd * w (+ b)`, evaluated left to right, rounded to the element type `T`.
//! - FP8 output: `h = T(y)` (so the codes equal [`norm_forward`] into a `T` buffer followed by
//!   [`crate::cast_transpose_to_fp8`], bit for bit), `code = encode(h * scale)` (saturating, round to
//!   nearest even, NaN to `0x7F` as [`fp8_core::Fp8Format::encode_scaled`]); the amax of `h` (NaN ignored)
//!   accumulates into the slot: `slot = max(slot, amax)`.
//! - Backward: `g = dy * w`, `xhat = (x - mean) * rstd`, `c1 = sum(g * xhat) / d` and, for LayerNorm,
//!   `c2 = sum(g) / d` (warp order; `c2 = 0` for RMSNorm); `dx = (g - c2 - xhat * c1) * rstd`, or with
//!   [`GradMode::Accumulate`] `dx = G(dx_old + that)` (one rounding to the gradient type `G`).
//! - `dweight[c] = sum_r dy * xhat`, `dbias[c] = sum_r dy` in three fixed levels ([`ParamOrder`]): rows in
//!   chunks of [`PARAM_CHUNK_ROWS`], each chunk summed in row order from zero; chunk sums in groups of
//!   `group` consecutive chunks, each group summed in chunk order from its first; group sums added in group
//!   order from the first. The totals overwrite or are added to the f32 outputs. (Short chunks give the
//!   GPU one chunk per block with x and dy read once; at most 32 groups keep the last two levels short.)
//!
//! CPU (rayon) and CUDA perform exactly these operations in this order, so all outputs agree bit for bit.
//! Element types: `T` (x, weight, bias, y) and `G` (dy, dx) are each f32 or bf16.

mod cpu;
mod cuda;

use crate::cast::AmaxSlot;
use crate::device::device_of;
use crate::kernel_source::KernelModule;
use crate::FloatElement;
use crate::{check_len, Buffer, DType, Device, KernelError};
use fp8_core::Fp8Format;

/// The forward kernels: `cuda/common.cuh`, then `src/layer_norm/layer_norm.cu` built with
/// `LN_BUILD_FORWARD` (paths relative to the crate). Forward and backward are separate NVRTC programs so a
/// process compiles only what it runs.
pub const LAYER_NORM_FORWARD_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_layer_norm_forward",
    files: &["cuda/common.cuh", "src/layer_norm/layer_norm.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        "#define LN_BUILD_FORWARD 1\n",
        include_str!("layer_norm.cu")
    ),
};

/// The backward kernels: `cuda/common.cuh`, then `src/layer_norm/layer_norm.cu` built with
/// `LN_BUILD_BACKWARD`.
pub const LAYER_NORM_BACKWARD_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_layer_norm_backward",
    files: &["cuda/common.cuh", "src/layer_norm/layer_norm.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        "#define LN_BUILD_BACKWARD 1\n",
        include_str!("layer_norm.cu")
    ),
};

/// PyTorch's default `eps` of `F.layer_norm`.
pub const DEFAULT_EPS: f32 = 1e-5;

/// Widest row of the FP8 output (its CUDA kernel keeps a tile of codes of at least one row in shared
/// memory); the same limit applies on the CPU so both devices accept the same calls.
pub const MAX_FP8_ROW: usize = 65_536;

/// Which normalisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Subtract the mean, divide by the standard deviation.
    LayerNorm,
    /// Divide by the root mean square (no centring).
    RmsNorm,
}

/// Shape and constants of one normalisation: `rows` rows of `d` features.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormSpec {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Rows (tokens).
    pub rows: usize,
    /// Features per row (> 0).
    pub d: usize,
    /// Added to the variance (finite, >= 0).
    pub eps: f32,
    /// CUDA launch choices (speed only; the CPU ignores them).
    pub launch: NormLaunch,
}

impl NormSpec {
    /// LayerNorm of `rows` rows of `d`, eps [`DEFAULT_EPS`].
    pub fn layer_norm(rows: usize, d: usize) -> Self {
        NormSpec {
            kind: NormKind::LayerNorm,
            rows,
            d,
            eps: DEFAULT_EPS,
            launch: NormLaunch::default(),
        }
    }

    /// RMSNorm of `rows` rows of `d`, eps [`DEFAULT_EPS`].
    pub fn rms_norm(rows: usize, d: usize) -> Self {
        NormSpec {
            kind: NormKind::RmsNorm,
            ..Self::layer_norm(rows, d)
        }
    }

    /// The same with another eps.
    pub fn with_eps(self, eps: f32) -> Self {
        NormSpec { eps, ..self }
    }

    /// The same with other CUDA launch choices (results unchanged).
    pub fn with_launch(self, launch: NormLaunch) -> Self {
        NormSpec { launch, ..self }
    }

    /// Checks the constants and returns `rows * d`.
    fn elements(&self, what: &'static str) -> Result<usize, KernelError> {
        if self.d == 0 {
            return Err(bad(what, "d must be positive".into()));
        }
        if self.rows > i32::MAX as usize || self.d > i32::MAX as usize {
            return Err(bad(
                what,
                format!(
                    "shape {}x{} exceeds the 32-bit index range",
                    self.rows, self.d
                ),
            ));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(bad(
                what,
                format!("eps {} must be finite and >= 0", self.eps),
            ));
        }
        self.rows
            .checked_mul(self.d)
            .ok_or_else(|| bad(what, format!("{}x{} overflows", self.rows, self.d)))
    }
}

/// Per-row statistics the forward writes and the backward reads: `mean` (0 for RMSNorm) and
/// `rstd = 1 / sqrt(var + eps)`, f32, `rows` each.
#[derive(Debug)]
pub struct NormStats {
    /// Row means.
    pub mean: Buffer<f32>,
    /// Row reciprocal standard deviations.
    pub rstd: Buffer<f32>,
}

impl NormStats {
    /// Zeroed statistics for `rows` rows on `device`.
    pub fn new(device: &Device, rows: usize) -> Result<Self, KernelError> {
        Ok(NormStats {
            mean: device.zeros(rows)?,
            rstd: device.zeros(rows)?,
        })
    }
}

/// The FP8 outputs of [`norm_forward_fp8`].
#[derive(Debug)]
pub struct Fp8NormOutput<'a> {
    /// The FP8 format: E4M3 (the activation format; E5M2 is refused).
    pub format: Fp8Format,
    /// `scale[0]`, read on the device.
    pub scale: &'a Buffer<f32>,
    /// Row-major codes `[rows, d]`.
    pub codes: &'a mut Buffer<u8>,
    /// Codes of the transpose `[d, rows]` (the operand of the FP8 weight-gradient GEMM).
    pub codes_t: &'a mut Buffer<u8>,
    /// Where the amax of the unscaled output accumulates, if anywhere.
    pub amax: Option<AmaxSlot<'a>>,
}

/// Whether a gradient output is overwritten or added to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradMode {
    /// `out = grad`.
    Overwrite,
    /// `out = out + grad` (one rounding to the output type).
    Accumulate,
}

impl GradMode {
    fn flag(self) -> bool {
        self == GradMode::Accumulate
    }
}

/// The outputs of [`norm_backward`].
#[derive(Debug)]
pub struct NormGrads<'a, G: FloatElement> {
    /// `[rows, d]` input gradient, in the type of `dy`.
    pub dx: &'a mut Buffer<G>,
    /// Overwrite `dx`, or add to it (e.g. the residual stream's gradient of a pre-norm block).
    pub dx_mode: GradMode,
    /// `[d]` weight gradient (f32).
    pub dweight: &'a mut Buffer<f32>,
    /// `[d]` bias gradient (f32), when the norm has a bias.
    pub dbias: Option<&'a mut Buffer<f32>>,
    /// Overwrite the parameter gradients, or add to them.
    pub param_mode: GradMode,
}

/// Rows per chunk of the parameter-gradient sums (`LN_PARAM_CHUNK` in the kernel).
pub const PARAM_CHUNK_ROWS: usize = 16;

/// The order of the parameter-gradient column sums for a given number of rows: `chunks` chunks of
/// [`PARAM_CHUNK_ROWS`] rows (the last may be shorter), in `groups` groups of `group` chunks (the last may
/// be shorter). `group` is at least 32 and large enough that there are at most 32 groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamOrder {
    /// Chunks of rows (at least 1).
    pub chunks: usize,
    /// Chunks per group.
    pub group: usize,
    /// Groups (at most 32).
    pub groups: usize,
}

/// The [`ParamOrder`] of `rows` rows.
pub fn param_order(rows: usize) -> ParamOrder {
    let chunks = rows.div_ceil(PARAM_CHUNK_ROWS).max(1);
    let group = chunks.div_ceil(32).max(32);
    ParamOrder {
        chunks,
        group,
        groups: chunks.div_ceil(group),
    }
}

/// How the CUDA kernels are launched: a choice of speed only, results are the same bit for bit (tested).
/// `None` fields are chosen from the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NormLaunch {
    /// Vectors of 8 elements per lane held in registers by the row kernels (0, 4, 8, 12 or 16; bf16 rows
    /// of a multiple of 8 only, others always re-read): more registers per thread, fewer resident warps.
    pub vectors_per_lane: Option<u32>,
    /// Rows per block tile of the FP8 forward (a power of two up to 32).
    pub tile_rows: Option<usize>,
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// f32 or bf16, else an error (the kernels exist for those two).
fn check_type<T: FloatElement>(what: &'static str) -> Result<(), KernelError> {
    match T::DTYPE {
        DType::F32 | DType::BF16 => Ok(()),
        other => Err(bad(
            what,
            format!("element type {other} (f32 or bf16 only)"),
        )),
    }
}

/// Checks the inputs shared by the forward calls and returns `rows * d`.
fn check_forward<T: FloatElement>(
    what: &'static str,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &NormStats,
) -> Result<usize, KernelError> {
    check_type::<T>(what)?;
    let n = spec.elements(what)?;
    check_len(what, n, x.len())?;
    check_len(what, spec.d, weight.len())?;
    if let Some(b) = bias {
        check_len(what, spec.d, b.len())?;
    }
    check_len(what, spec.rows, stats.mean.len())?;
    check_len(what, spec.rows, stats.rstd.len())?;
    device_of(what, &[x, weight, &bias, &stats.mean, &stats.rstd])?;
    Ok(n)
}

/// Forward into `y` (`[rows, d]`, type `T`); writes the row statistics into `stats`.
pub fn norm_forward<T: FloatElement>(
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward";
    let n = check_forward(WHAT, spec, x, weight, bias, stats)?;
    check_len(WHAT, n, y.len())?;
    let dev = device_of(WHAT, &[x, y])?;
    match dev {
        None => {
            let b = match bias {
                Some(b) => Some(b.host(WHAT)?),
                None => None,
            };
            let NormStats { mean, rstd } = stats;
            cpu::forward(
                spec,
                x.host(WHAT)?,
                weight.host(WHAT)?,
                b,
                mean.host_mut(WHAT)?,
                rstd.host_mut(WHAT)?,
                y.host_mut(WHAT)?,
            );
            Ok(())
        }
        Some(dev) => cuda::forward(&dev, spec, x, weight, bias, stats, y),
    }
}

/// Forward fused with the FP8 cast (one pass over `x`): writes the codes of `h = T(y)` row-major and
/// transposed, accumulates the amax of `h` into `out.amax`, and writes the row statistics. Bit-identical to
/// [`norm_forward`] into a `T` buffer followed by [`crate::cast_transpose_to_fp8`] of it.
pub fn norm_forward_fp8<T: FloatElement>(
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    out: Fp8NormOutput<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward_fp8";
    let n = check_forward(WHAT, spec, x, weight, bias, stats)?;
    if spec.d > MAX_FP8_ROW {
        return Err(bad(WHAT, format!("d = {} exceeds {MAX_FP8_ROW}", spec.d)));
    }
    if out.format != Fp8Format::E4M3 {
        return Err(bad(
            WHAT,
            format!(
                "{:?} output (normalised activations are cast to E4M3)",
                out.format
            ),
        ));
    }
    check_len(WHAT, n, out.codes.len())?;
    check_len(WHAT, n, out.codes_t.len())?;
    if out.scale.is_empty() {
        return Err(bad(WHAT, "scale buffer is empty".into()));
    }
    if let Some(a) = &out.amax {
        if a.slot >= a.buffer.len() {
            return Err(bad(
                WHAT,
                format!(
                    "amax slot {} outside a buffer of {}",
                    a.slot,
                    a.buffer.len()
                ),
            ));
        }
    }
    let dev = device_of(WHAT, &[x, out.scale, out.codes, out.codes_t, &out.amax])?;
    match dev {
        None => {
            let b = match bias {
                Some(b) => Some(b.host(WHAT)?),
                None => None,
            };
            let s = out.scale.host(WHAT)?[0];
            let NormStats { mean, rstd } = stats;
            let a = cpu::forward_fp8(
                spec,
                x.host(WHAT)?,
                weight.host(WHAT)?,
                b,
                mean.host_mut(WHAT)?,
                rstd.host_mut(WHAT)?,
                out.format,
                s,
                out.codes.host_mut(WHAT)?,
                out.codes_t.host_mut(WHAT)?,
            );
            if let Some(slot) = out.amax {
                let v = &mut slot.buffer.host_mut(WHAT)?[slot.slot];
                *v = v.max(a);
            }
            Ok(())
        }
        Some(dev) => {
            dev.require_fp8()?;
            cuda::forward_fp8(&dev, spec, x, weight, bias, stats, out)
        }
    }
}

/// Backward: `dx` (overwritten or accumulated), `dweight` and `dbias` (overwritten or accumulated) from
/// the forward's input `x`, `weight`, statistics and the output gradient `dy` (`[rows, d]`, type `G`).
pub fn norm_backward<T: FloatElement, G: FloatElement>(
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    stats: &NormStats,
    dy: &Buffer<G>,
    grads: NormGrads<'_, G>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_backward";
    check_type::<T>(WHAT)?;
    check_type::<G>(WHAT)?;
    let n = spec.elements(WHAT)?;
    check_len(WHAT, n, x.len())?;
    check_len(WHAT, spec.d, weight.len())?;
    check_len(WHAT, spec.rows, stats.mean.len())?;
    check_len(WHAT, spec.rows, stats.rstd.len())?;
    check_len(WHAT, n, dy.len())?;
    check_len(WHAT, n, grads.dx.len())?;
    check_len(WHAT, spec.d, grads.dweight.len())?;
    if let Some(b) = &grads.dbias {
        check_len(WHAT, spec.d, b.len())?;
    }
    let dev = device_of(
        WHAT,
        &[
            x,
            weight,
            &stats.mean,
            &stats.rstd,
            dy,
            grads.dx,
            grads.dweight,
            &grads.dbias,
        ],
    )?;
    match dev {
        None => {
            let (xs, ws) = (x.host(WHAT)?, weight.host(WHAT)?);
            let (mean, rstd) = (stats.mean.host(WHAT)?, stats.rstd.host(WHAT)?);
            let dys = dy.host(WHAT)?;
            cpu::backward_dx(
                spec,
                xs,
                ws,
                mean,
                rstd,
                dys,
                grads.dx.host_mut(WHAT)?,
                grads.dx_mode.flag(),
            );
            let db = match grads.dbias {
                Some(b) => Some(b.host_mut(WHAT)?),
                None => None,
            };
            cpu::backward_params(
                spec,
                xs,
                mean,
                rstd,
                dys,
                grads.dweight.host_mut(WHAT)?,
                db,
                grads.param_mode.flag(),
            );
            Ok(())
        }
        Some(dev) => cuda::backward(&dev, spec, x, weight, stats, dy, grads),
    }
}

/// The row statistics of one row as the kernels compute them (`(mean, rstd)`, warp-order sums), for
/// references and tests.
pub fn row_stats<T: FloatElement>(row: &[T], kind: NormKind, eps: f32) -> (f32, f32) {
    cpu::row_stats(row, kind, eps)
}

/// The warp-order sum of `d` terms (see the module docs), for references and tests.
pub fn warp_vector_sum(d: usize, term: impl FnMut(usize) -> f32) -> f32 {
    cpu::warp_vector_sum(d, term)
}
