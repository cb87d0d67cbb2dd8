//! LayerNorm and RMSNorm over the rows of a row-major `[rows, d]` tensor: forward (output in the input's
//! element type, or fused with the FP8 cast + transpose and the amax of the output), and backward (dx,
//! optionally accumulated into an existing gradient; dweight and dbias in a fixed four-level order).
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
//! - Backward: `g = dy * w`, `xhat = (x - mean) * rstd` (RMSNorm: `xhat = x * rstd`, the mean is not
//!   read), `c1 = sum(g * xhat) / d` and, for LayerNorm, `c2 = sum(g) / d` (warp order; `c2 = 0` for
//!   RMSNorm); `dx = (g - c2 - xhat * c1) * rstd`, or with [`GradMode::Accumulate`]
//!   `dx = G(dx_old + that)` (one rounding to the gradient type `G`).
//! - `dweight[c] = sum_r dy * xhat`, `dbias[c] = sum_r dy` in four fixed levels ([`ParamOrder`], a function
//!   of `rows` only): rows in chunks of `ceil(rows / 2048)` rows ([`MAX_PARAM_CHUNKS`]; at least 1), each
//!   chunk summed in row order from zero; chunk sums in tiles of [`TILE_CHUNKS`] consecutive chunks, each
//!   tile summed in chunk order from its first; tile sums in runs of `run` consecutive tiles (at most 32
//!   runs), each summed in tile order from its first; run sums added in run order from the first. The totals
//!   overwrite or are added to the f32 outputs. (On the GPU a warp walks a chunk keeping its columns'
//!   running sums, a block of [`TILE_CHUNKS`] warps adds its tile's chunk sums, and a small kernel adds the
//!   tile sums: x and dy are read once, and at most 256 tiles of partial sums go through memory.)
//!
//! CPU (rayon) and CUDA perform exactly these operations in this order, so all outputs agree bit for bit,
//! whatever the [`NormLaunch`] choices. Element types: `T` (x, weight, bias, y) and `G` (dy, dx) are each
//! f32 or bf16.

mod cpu;
mod cuda;

use crate::cast::{check_code_layouts, AmaxSlot};
use crate::device::device_of;
use crate::kernel_source::{KernelModule, ModuleArch};
use crate::FloatElement;
use crate::{check_len, Buffer, DType, Device, KernelError};
use fp8_core::Fp8Format;

/// Every forward kernel: `cuda/common.cuh`, then `src/layer_norm/layer_norm.cu` built with
/// `LN_BUILD_FORWARD` (paths relative to the crate). Compile checks; launches load the module of their
/// width class ([`forward_module`]), so a process compiles only the variants it runs. Forward and backward
/// are separate NVRTC programs for the same reason.
pub const LAYER_NORM_FORWARD_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_layer_norm_forward",
    files: &["cuda/common.cuh", "src/layer_norm/layer_norm.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        "#define LN_BUILD_FORWARD 1\n",
        include_str!("layer_norm.cu")
    ),
    arch: ModuleArch::Portable,
};

/// Every backward kernel: `cuda/common.cuh`, then `src/layer_norm/layer_norm.cu` built with
/// `LN_BUILD_BACKWARD` (compile checks; launches use [`backward_module`]).
pub const LAYER_NORM_BACKWARD_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_layer_norm_backward",
    files: &["cuda/common.cuh", "src/layer_norm/layer_norm.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        "#define LN_BUILD_BACKWARD 1\n",
        include_str!("layer_norm.cu")
    ),
    arch: ModuleArch::Portable,
};

/// The previous forward kernels (`src/layer_norm/layer_norm_legacy.cu`), run when
/// [`NormLaunch::legacy_forward`] asks for them.
pub const LAYER_NORM_LEGACY_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_layer_norm_legacy",
    files: &["cuda/common.cuh", "src/layer_norm/layer_norm_legacy.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("layer_norm_legacy.cu")
    ),
    arch: ModuleArch::Portable,
};

/// The forward module of one register bound `NV` (`LN_NV_ONLY`), or the backward one.
macro_rules! norm_module {
    (forward, $nv:literal) => {
        KernelModule {
            name: concat!("fp8_kernels_layer_norm_forward_nv", $nv),
            files: LAYER_NORM_FORWARD_MODULE.files,
            source: concat!(
                include_str!("../../cuda/common.cuh"),
                "#define LN_BUILD_FORWARD 1\n#define LN_NV_ONLY ",
                $nv,
                "\n",
                include_str!("layer_norm.cu")
            ),
            arch: ModuleArch::Portable,
        }
    };
    (backward, $nv:literal) => {
        KernelModule {
            name: concat!("fp8_kernels_layer_norm_backward_nv", $nv),
            files: LAYER_NORM_BACKWARD_MODULE.files,
            source: concat!(
                include_str!("../../cuda/common.cuh"),
                "#define LN_BUILD_BACKWARD 1\n#define LN_NV_ONLY ",
                $nv,
                "\n",
                include_str!("layer_norm.cu")
            ),
            arch: ModuleArch::Portable,
        }
    };
}

/// Register bounds (vectors of 8 per lane) of the forward kernels, 0 being the re-reading variants.
pub const FORWARD_VECTORS_PER_LANE: [u32; 9] = [0, 2, 3, 4, 6, 8, 10, 12, 16];

/// Register bounds of the backward kernels (wider rows re-read: two rows of x and dy would not fit).
pub const BACKWARD_VECTORS_PER_LANE: [u32; 6] = [0, 2, 3, 4, 6, 8];

/// Register bounds whose backward kernels also exist with the next row loaded ahead
/// ([`NormLaunch::prefetch`]).
pub const BACKWARD_PREFETCH_VECTORS: [u32; 3] = [2, 3, 4];

const FORWARD_MODULES: [KernelModule; 9] = [
    norm_module!(forward, 0),
    norm_module!(forward, 2),
    norm_module!(forward, 3),
    norm_module!(forward, 4),
    norm_module!(forward, 6),
    norm_module!(forward, 8),
    norm_module!(forward, 10),
    norm_module!(forward, 12),
    norm_module!(forward, 16),
];

const BACKWARD_MODULES: [KernelModule; 6] = [
    norm_module!(backward, 0),
    norm_module!(backward, 2),
    norm_module!(backward, 3),
    norm_module!(backward, 4),
    norm_module!(backward, 6),
    norm_module!(backward, 8),
];

/// The module holding the forward kernels of register bound `nv` (one of [`FORWARD_VECTORS_PER_LANE`];
/// any other gets the module of every forward kernel).
pub fn forward_module(nv: u32) -> &'static KernelModule {
    match FORWARD_VECTORS_PER_LANE.iter().position(|&v| v == nv) {
        Some(i) => &FORWARD_MODULES[i],
        None => &LAYER_NORM_FORWARD_MODULE,
    }
}

/// The module holding the backward kernels of register bound `nv` (one of [`BACKWARD_VECTORS_PER_LANE`];
/// any other gets the module of every backward kernel) and the parameter reduction.
pub fn backward_module(nv: u32) -> &'static KernelModule {
    match BACKWARD_VECTORS_PER_LANE.iter().position(|&v| v == nv) {
        Some(i) => &BACKWARD_MODULES[i],
        None => &LAYER_NORM_BACKWARD_MODULE,
    }
}

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
    /// Row-major codes `[rows, d]` (the forward GEMM's operand), if wanted.
    pub codes: Option<&'a mut Buffer<u8>>,
    /// Codes of the transpose `[d, rows]` (the operand of the FP8 weight-gradient GEMM), if wanted. A
    /// forward whose linear casts its input again in the backward needs only `codes`, the backward's
    /// recast only this: each layout left out is a pass of writes saved (the transposed one through
    /// shared memory).
    pub codes_t: Option<&'a mut Buffer<u8>>,
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

/// Chunks of rows per tile of the parameter-gradient sums (`LN_TILE_CHUNKS` in the kernel: the warps of a
/// backward block).
pub const TILE_CHUNKS: usize = 8;

/// Most chunks of rows of the parameter-gradient sums: rows are cut into at most this many chunks, so at
/// most 256 tiles.
pub const MAX_PARAM_CHUNKS: usize = 2048;

/// The order of the parameter-gradient column sums for a given number of rows: `chunks` chunks of
/// `chunk_rows` rows (the last may be shorter), in `tiles` tiles of [`TILE_CHUNKS`] chunks (the last may be
/// shorter), in `runs` runs of `run` tiles (the last may be shorter; at most 32 runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamOrder {
    /// Rows per chunk (at least 1).
    pub chunk_rows: usize,
    /// Chunks of rows (at least 1, at most [`MAX_PARAM_CHUNKS`]).
    pub chunks: usize,
    /// Tiles of [`TILE_CHUNKS`] chunks (at most 256).
    pub tiles: usize,
    /// Tiles per run.
    pub run: usize,
    /// Runs (at most 32).
    pub runs: usize,
}

/// The [`ParamOrder`] of `rows` rows.
pub fn param_order(rows: usize) -> ParamOrder {
    let chunk_rows = rows.div_ceil(MAX_PARAM_CHUNKS).max(1);
    let chunks = rows.div_ceil(chunk_rows).max(1);
    let tiles = chunks.div_ceil(TILE_CHUNKS);
    let run = tiles.div_ceil(32);
    ParamOrder {
        chunk_rows,
        chunks,
        tiles,
        run,
        runs: tiles.div_ceil(run),
    }
}

/// How the CUDA kernels are launched: a choice of speed only, results are the same bit for bit (tested).
/// `None` fields are chosen from the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NormLaunch {
    /// Vectors of 8 elements per lane held in registers by the row kernels: one of
    /// [`FORWARD_VECTORS_PER_LANE`] (forward) or [`BACKWARD_VECTORS_PER_LANE`] (backward) at least
    /// `ceil(d / 256)`, or 0 to re-read the row; bf16 rows of a multiple of 8 only, others always re-read.
    /// A bound that is too small or has no kernel falls back to 0. More registers per thread, fewer
    /// resident warps.
    pub vectors_per_lane: Option<u32>,
    /// Rows per block tile of the FP8 forward (a power of two up to 64; its codes stay in shared memory
    /// until the block writes them transposed).
    pub tile_rows: Option<usize>,
    /// Rows a warp of the forward holds at once (1, 2 or 4; 4 and 2 only with at most 4 and 8 vectors
    /// per lane, else the rows are re-read). A block of the FP8 forward has `tile_rows / rows_per_warp`
    /// warps (at most 16: more rows per warp are taken when the tile needs it).
    pub rows_per_warp: Option<u32>,
    /// Backward: load the next row of a chunk while computing the current one (kernels of
    /// [`BACKWARD_PREFETCH_VECTORS`] only).
    pub prefetch: Option<bool>,
    /// Run the previous forward kernels (`layer_norm_legacy.cu`), for comparison.
    pub legacy_forward: bool,
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

/// Checks the inputs shared by the forward calls (and the block-scaled cast of a norm's output) and
/// returns `rows * d`.
pub(crate) fn check_forward<T: FloatElement>(
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
        Some(dev) => cuda::forward(&dev, spec, x, weight, bias, stats, Some(y)),
    }
}

/// `y = T((x - mean) * rstd * w (+ b))` of host slices from given row statistics (the CPU side of the
/// block-scaled cast of a norm's output).
pub(crate) use cpu::forward_with_stats;

/// The row statistics of [`norm_forward`] alone, for a consumer that applies them itself: the
/// block-scaled cast of the norm's output (`crate::BlockCastInput::Norm`), which computes each output
/// value as [`norm_forward`] does and never writes them. One read of `x`; `weight` and `bias` are
/// checked as [`norm_forward`] checks them (the CUDA kernel is the forward's, without its output).
pub fn norm_forward_stats<T: FloatElement>(
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward_stats";
    check_forward(WHAT, spec, x, weight, bias, stats)?;
    match device_of(WHAT, &[x])? {
        None => {
            let NormStats { mean, rstd } = stats;
            cpu::statistics(
                spec,
                x.host(WHAT)?,
                mean.host_mut(WHAT)?,
                rstd.host_mut(WHAT)?,
            );
            Ok(())
        }
        Some(dev) => cuda::forward(&dev, spec, x, weight, bias, stats, None),
    }
}

/// Forward fused with the FP8 cast (one pass over `x`): writes the codes of `h = T(y)` row-major and
/// transposed (either or both: at least one), accumulates the amax of `h` into `out.amax`, and writes the
/// row statistics. Bit-identical to [`norm_forward`] into a `T` buffer followed by
/// [`crate::cast_transpose_to_fp8`] of it.
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
    check_code_layouts(WHAT, n, out.codes.as_deref(), out.codes_t.as_deref())?;
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
    let dev = device_of(WHAT, &[x, out.scale, &out.codes, &out.codes_t, &out.amax])?;
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
                out.codes.map(|q| q.host_mut(WHAT)).transpose()?,
                out.codes_t.map(|q| q.host_mut(WHAT)).transpose()?,
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
