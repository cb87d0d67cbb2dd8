//! Launches of the LayerNorm / RMSNorm kernels (`layer_norm.cu`, and `layer_norm_legacy.cu` when
//! [`NormLaunch::legacy_forward`](super::NormLaunch) asks). Arguments were validated by `mod.rs`.

use super::{
    backward_module, forward_module, param_order, Fp8NormOutput, NormGrads, NormKind, NormSpec,
    NormStats, BACKWARD_PREFETCH_VECTORS, BACKWARD_VECTORS_PER_LANE, FORWARD_VECTORS_PER_LANE,
    LAYER_NORM_LEGACY_MODULE, TILE_CHUNKS,
};
use crate::cast::{format_name, FloatElement};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::launch::{kernel_name, launch, optional_ptr, optional_ptr_mut, Kernel};
use crate::{Buffer, CudaDevice, DType, Device, KernelError};
use cudarc::driver::LaunchConfig;

/// Threads per block of the plain forward and of the legacy kernels (8 warps).
const THREADS: u32 = 256;
/// Most threads per block of the FP8 forward (16 warps; the kernels are built for it).
const MAX_FP8_THREADS: usize = 512;
/// Shared memory the default FP8 tile may use for its codes: the largest default tile height whose codes
/// fit (an opt-in above 48 KiB on sm_90). A named `tile_rows` may use up to the device's limit.
const TILE_BYTES_MAX: usize = 96 * 1024;
/// Bytes of padding per tile row (`LN_TILE_PAD` in the kernel).
const TILE_PAD: usize = 16;
/// Dynamic shared memory the backward's running sums may use per block (above 48 KiB is an opt-in on
/// sm_90); wider rows keep them in a global scratch instead.
const ACC_BYTES_MAX: usize = 200 * 1024;
/// Largest global scratch for the backward's running sums (rows too wide for shared memory): the grid is
/// cut so that its blocks' slices fit.
const GLOBAL_ACC_BYTES_MAX: usize = 256 << 20;
/// Blocks per SM the grid-stride forward grids are capped at (more than can be resident: blocks take
/// one tile or group of rows each, and the GPU starts the next as one finishes).
const GRID_BLOCKS_PER_SM: u64 = 32;

/// Vectors of 8 per lane a row of `d` needs to be held in registers.
fn needed_vectors(d: usize) -> usize {
    d.div_ceil(8).div_ceil(32)
}

/// The register bound of the row kernels out of `bounds` (kernels exist for these; 0 re-reads rows):
/// register-held variants exist for bf16 rows whose length is a multiple of 8 (`all_bf16`), everything
/// else uses 0. The smallest bound that holds the row (0 when none does), unless the launch names one (a
/// named bound too small for the row, or one without a kernel, falls back to 0). Results do not depend on
/// it.
fn vectors_per_lane(spec: &NormSpec, all_bf16: bool, bounds: &[u32]) -> u32 {
    if !all_bf16 || spec.d % 8 != 0 {
        return 0;
    }
    let need = needed_vectors(spec.d);
    match spec.launch.vectors_per_lane {
        Some(nv) if nv > 0 && bounds.contains(&nv) && nv as usize >= need => nv,
        Some(_) => 0,
        None => bounds
            .iter()
            .copied()
            .find(|&nv| nv > 0 && nv as usize >= need)
            .unwrap_or(0),
    }
}

/// Rows per warp the forward kernels of register bound `nv` exist for (`layer_norm.cu`'s entries: the
/// rows' vectors stay within 16 per lane).
fn rows_per_warp_built(nv: u32) -> &'static [u32] {
    match nv {
        0 | 2 | 3 | 4 => &[1, 2, 4],
        6 | 8 => &[1, 2],
        _ => &[1],
    }
}

/// A forward launch: the kernel variant (register bound, rows per warp) and the block shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ForwardPlan {
    /// Vectors per lane held in registers (0: re-read).
    nv: u32,
    /// Rows a warp holds at once.
    rows_per_warp: u32,
    /// Warps per block.
    warps: u32,
    /// Rows per tile of the FP8 forward (`warps * rows_per_warp`); for the plain forward the rows of a
    /// block's group.
    tile_rows: usize,
}

/// The plain forward's launch: 8 warps, each holding `rows_per_warp` rows (default 2 for rows of up to
/// 1024 features, else 1).
fn forward_plan(spec: &NormSpec, all_bf16: bool) -> Result<ForwardPlan, KernelError> {
    let nv = vectors_per_lane(spec, all_bf16, &FORWARD_VECTORS_PER_LANE);
    let (nv, rpw) = rows_per_warp(spec, nv)?;
    Ok(ForwardPlan {
        nv,
        rows_per_warp: rpw,
        warps: THREADS / 32,
        tile_rows: (THREADS / 32 * rpw) as usize,
    })
}

/// Rows per warp: named, or 2 for register bounds up to 4 (d <= 1024) and 1 otherwise; a count without a
/// kernel at bound `nv` re-reads the rows (bound 0, which has all).
fn rows_per_warp(spec: &NormSpec, nv: u32) -> Result<(u32, u32), KernelError> {
    let rpw = spec
        .launch
        .rows_per_warp
        .unwrap_or(if (1..=4).contains(&nv) { 2 } else { 1 });
    if !rows_per_warp_built(0).contains(&rpw) {
        return Err(KernelError::InvalidArgument {
            what: "norm launch",
            detail: format!("{rpw} rows per warp (1, 2 or 4)"),
        });
    }
    Ok(if rows_per_warp_built(nv).contains(&rpw) {
        (nv, rpw)
    } else {
        (0, rpw)
    })
}

/// The FP8 forward's launch. Tile height: named (a power of two up to 64), or by default 16 rows when
/// the transposed codes are written (halved while the tile's codes exceed 96 KiB), and when only the
/// row-major codes are, 16 rows up to width 1024 and 8 beyond. Measured on an H100
/// (2026-12-07, `layer_kernel_bench --sweep`): with the transposed codes 16-row tiles beat 8-row ones by
/// 19-28 % at widths 2560-4096, and without them 8-row tiles beat 16-row ones by 6-14 % at 2048-4096.
/// A warp holds `rows_per_warp` rows (see [`forward_plan`]), fewer when the tile is lower, more when the
/// tile would need more than 16 warps. The shared memory bound applies only to the transposed codes'
/// tile.
fn fp8_forward_plan(
    spec: &NormSpec,
    all_bf16: bool,
    transposed: bool,
    smem_limit: usize,
) -> Result<ForwardPlan, KernelError> {
    const WHAT: &str = "norm_forward_fp8";
    let nv = vectors_per_lane(spec, all_bf16, &FORWARD_VECTORS_PER_LANE);
    let (nv, rpw) = rows_per_warp(spec, nv)?;
    let tile = match spec.launch.tile_rows {
        Some(t) if t.is_power_of_two() && t <= 64 => t,
        Some(t) => {
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("tile of {t} rows (a power of two up to 64)"),
            })
        }
        None if transposed => {
            let mut t = 16;
            while t > 1 && t * (spec.d + TILE_PAD) > TILE_BYTES_MAX {
                t /= 2;
            }
            t
        }
        None if spec.d <= 1024 => 16,
        None => 8,
    };
    // 1 KiB kept for the kernel's static shared memory (the block amax).
    if transposed && tile * (spec.d + TILE_PAD) > smem_limit.saturating_sub(1024) {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!(
                "a tile of {tile} rows of {} codes exceeds the shared memory of a block",
                spec.d
            ),
        });
    }
    // Powers of two: rpw divides tile or exceeds it.
    let rpw = (rpw as usize)
        .min(tile)
        .max(tile.div_ceil(MAX_FP8_THREADS / 32));
    let nv = if rows_per_warp_built(nv).contains(&(rpw as u32)) {
        nv
    } else {
        0
    };
    Ok(ForwardPlan {
        nv,
        rows_per_warp: rpw as u32,
        warps: (tile / rpw) as u32,
        tile_rows: tile,
    })
}

/// Blocks resident per SM as bounded by `smem` bytes of dynamic shared memory each (about 220 KiB usable
/// per SM, 1 KiB reserved per block), between 1 and 8 (the legacy kernels' grids).
fn blocks_per_sm(smem: usize) -> usize {
    ((220 * 1024) / (smem + 1024)).clamp(1, 8)
}

fn rms_flag(spec: &NormSpec) -> i32 {
    (spec.kind == NormKind::RmsNorm) as i32
}

/// The kernel-name suffix of the norm kind.
fn kind_name(spec: &NormSpec) -> &'static str {
    match spec.kind {
        NormKind::LayerNorm => "ln",
        NormKind::RmsNorm => "rms",
    }
}

/// A grid-stride grid of `items` blocks' worth of work, at most [`GRID_BLOCKS_PER_SM`] blocks per SM.
fn capped_grid(dev: &CudaDevice, items: usize) -> u32 {
    let cap = dev.sm_count() as u64 * GRID_BLOCKS_PER_SM;
    (items.max(1) as u64).min(cap) as u32
}

pub(super) fn forward<T: FloatElement>(
    dev: &CudaDevice,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    y: Option<&mut Buffer<T>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward";
    if spec.rows == 0 {
        return Ok(());
    }
    // The legacy kernels always write y; the statistics alone come from the current ones.
    let y = match y {
        Some(y) if spec.launch.legacy_forward => {
            return legacy_forward(dev, spec, x, weight, bias, stats, y)
        }
        y => y,
    };
    let plan = forward_plan(spec, T::DTYPE == DType::BF16)?;
    let cfg = LaunchConfig {
        grid_dim: (capped_grid(dev, spec.rows.div_ceil(plan.tile_rows)), 1, 1),
        block_dim: (32 * plan.warps, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, d, eps) = (spec.rows as i32, spec.d as i32, spec.eps);
    let NormStats { mean, rstd } = stats;
    let (xs, ws) = (cs(x, WHAT)?, cs(weight, WHAT)?);
    let (ms, rs) = (cs_mut(mean, WHAT)?, cs_mut(rstd, WHAT)?);
    let bias = optional_ptr(bias.map(|b| cs(b, WHAT)).transpose()?, dev.stream());
    let (nv, rpw, kind) = (plan.nv, plan.rows_per_warp, kind_name(spec));
    // 256 threads; x and y hold rows*d elements, w and b d, mean and rstd rows (checked by the caller).
    match y {
        Some(y) => {
            let ys = cs_mut(y, WHAT)?;
            launch!(
                dev,
                forward_module(nv),
                kernel_name!("ln_fwd_", T::NAME, "_nv", nv, "_r", rpw, "_", kind),
                cfg,
                "ln_fwd_<T>_nv<NV>_r<RPW>_<kind>(const T* x, const T* w, const T* b, float* mean, \
                 float* rstd, T* y, int rows, int d, float eps)",
                [xs, ws, &bias.ptr, ms, rs, ys, &rows, &d, &eps]
            )
        }
        // The statistics alone: the same kernel without its output.
        None => launch!(
            dev,
            forward_module(nv),
            kernel_name!("ln_stats_", T::NAME, "_nv", nv, "_r", rpw, "_", kind),
            cfg,
            "ln_stats_<T>_nv<NV>_r<RPW>_<kind>(const T* x, const T* w, const T* b, float* mean, \
             float* rstd, int rows, int d, float eps)",
            [xs, ws, &bias.ptr, ms, rs, &rows, &d, &eps]
        ),
    }
}

pub(super) fn forward_fp8<T: FloatElement>(
    dev: &CudaDevice,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    out: Fp8NormOutput<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward_fp8";
    if spec.rows == 0 {
        return Ok(());
    }
    if spec.launch.legacy_forward {
        return legacy_forward_fp8(dev, spec, x, weight, bias, stats, out);
    }
    let plan = fp8_forward_plan(
        spec,
        T::DTYPE == DType::BF16,
        out.codes_t.is_some(),
        dev.shared_memory_per_block_optin(),
    )?;
    let kernel = Kernel::new(
        dev,
        forward_module(plan.nv),
        kernel_name!(
            "ln_fwd_fp8_",
            T::NAME,
            "_",
            format_name(out.format),
            "_nv",
            plan.nv,
            "_r",
            plan.rows_per_warp,
            "_",
            kind_name(spec)
        ),
    )?;
    // The tile of codes in shared memory is only the transposed write's.
    let smem = if out.codes_t.is_some() {
        plan.tile_rows * (spec.d + TILE_PAD)
    } else {
        0
    };
    if smem > 48 * 1024 {
        kernel.allow_dynamic_smem(smem)?;
    }
    let cfg = LaunchConfig {
        grid_dim: (capped_grid(dev, spec.rows.div_ceil(plan.tile_rows)), 1, 1),
        block_dim: (32 * plan.warps, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (rows, d, eps, tile) = (
        spec.rows as i32,
        spec.d as i32,
        spec.eps,
        plan.tile_rows as i32,
    );
    let NormStats { mean, rstd } = stats;
    let stream = dev.stream();
    let (xs, ws, ss) = (cs(x, WHAT)?, cs(weight, WHAT)?, cs(out.scale, WHAT)?);
    let (ms, rs) = (cs_mut(mean, WHAT)?, cs_mut(rstd, WHAT)?);
    let q = out.codes.map(|q| cs_mut(q, WHAT)).transpose()?;
    let qt = out.codes_t.map(|q| cs_mut(q, WHAT)).transpose()?;
    let (q, qt) = (optional_ptr_mut(q, stream), optional_ptr_mut(qt, stream));
    let bias = optional_ptr(bias.map(|b| cs(b, WHAT)).transpose()?, stream);
    let slot = out.amax.as_ref().map_or(0, |a| a.slot as i32);
    let amax = out.amax.map(|a| cs_mut(a.buffer, WHAT)).transpose()?;
    let amax = optional_ptr_mut(amax, stream);
    // warps * 32 threads (at most 512, tile_rows = warps * rows_per_warp) and, when qt is written,
    // tile_rows * (d + 16) bytes of dynamic shared memory (allowed above); x and the non-null of q and qt
    // (at least one, checked by the caller) hold rows*d elements, w and b d, mean and rstd rows, scale at
    // least one, the amax slot is in bounds (checked by the caller).
    launch!(
        kernel: &kernel,
        cfg,
        "ln_fwd_fp8_<T>_<fmt>_nv<NV>_r<RPW>_<kind>(const T* x, const T* w, const T* b, float* mean, \
         float* rstd, u8* q, u8* qt, const float* scale, float* amax, int slot, int rows, int d, float eps, \
         int tile_rows)",
        [xs, ws, &bias.ptr, ms, rs, &q.ptr, &qt.ptr, ss, &amax.ptr, &slot, &rows, &d, &eps, &tile]
    )
}

/// A backward launch: the kernel variant and where the running sums live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BackwardPlan {
    /// Vectors per lane held in registers (0: re-read).
    nv: u32,
    /// The next row is loaded while the current one is computed.
    prefetch: bool,
    /// Blocks (tiles at most).
    grid: usize,
    /// Bytes of running sums per block: dynamic shared memory, or (`global`) a slice of a scratch buffer.
    acc_bytes: usize,
    /// The running sums live in global memory.
    global: bool,
}

fn backward_plan(
    spec: &NormSpec,
    all_bf16: bool,
    has_bias: bool,
    smem_limit: usize,
) -> BackwardPlan {
    let nv = vectors_per_lane(spec, all_bf16, &BACKWARD_VECTORS_PER_LANE);
    let prefetch = spec.launch.prefetch.unwrap_or(true) && BACKWARD_PREFETCH_VECTORS.contains(&nv);
    let tiles = param_order(spec.rows).tiles;
    // Per warp and plane: nvec vectors of 8 floats.
    let planes = if has_bias { 2 } else { 1 };
    let acc_bytes = TILE_CHUNKS * planes * spec.d.div_ceil(8) * 8 * 4;
    if acc_bytes <= ACC_BYTES_MAX.min(smem_limit) {
        BackwardPlan {
            nv,
            prefetch,
            grid: tiles,
            acc_bytes,
            global: false,
        }
    } else {
        BackwardPlan {
            nv,
            prefetch,
            grid: tiles.min((GLOBAL_ACC_BYTES_MAX / acc_bytes).max(1)),
            acc_bytes,
            global: true,
        }
    }
}

pub(super) fn backward<T: FloatElement, G: FloatElement>(
    dev: &CudaDevice,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    stats: &NormStats,
    dy: &Buffer<G>,
    grads: NormGrads<'_, G>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_backward";
    let all_bf16 = T::DTYPE == DType::BF16 && G::DTYPE == DType::BF16;
    let has_bias = grads.dbias.is_some();
    let plan = backward_plan(
        spec,
        all_bf16,
        has_bias,
        dev.shared_memory_per_block_optin(),
    );
    let module = backward_module(plan.nv);
    let kernel = Kernel::new(
        dev,
        module,
        kernel_name!(
            "ln_bwd_",
            T::NAME,
            "_",
            G::NAME,
            "_nv",
            plan.nv,
            "_",
            kind_name(spec),
            "_pf",
            plan.prefetch as u32
        ),
    )?;
    let order = param_order(spec.rows);
    let stream = dev.stream();
    let smem = if plan.global { 0 } else { plan.acc_bytes };
    if smem > 48 * 1024 {
        kernel.allow_dynamic_smem(smem)?;
    }
    // SAFETY: each block's warps zero the running sums of their vectors before adding into them, and
    // the block reads them only after the barrier that follows (the slice is per block).
    let mut gacc = if plan.global {
        Some(unsafe { stream.alloc::<f32>(plan.grid * plan.acc_bytes / 4) }?)
    } else {
        None
    };
    let cfg = LaunchConfig {
        grid_dim: (plan.grid as u32, 1, 1),
        block_dim: ((32 * TILE_CHUNKS) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (rows, d) = (spec.rows as i32, spec.d as i32);
    let (chunk_rows, chunks) = (order.chunk_rows as i32, order.chunks as i32);
    let acc_dx = grads.dx_mode.flag() as i32;
    let acc_param = grads.param_mode.flag() as i32;
    // With more than one tile the kernel writes tile partials, combined by `ln_param_reduce`.
    let partials = order.tiles > 1;
    // SAFETY: every element of the partial buffers is written by the backward kernel below (one value per
    // tile and column) before `ln_param_reduce` reads it, in stream order.
    let mut pw = if partials {
        Some(unsafe { stream.alloc::<f32>(order.tiles * spec.d) }?)
    } else {
        None
    };
    // SAFETY: as above (allocated only when there is a bias gradient).
    let mut pb = if partials && has_bias {
        Some(unsafe { stream.alloc::<f32>(order.tiles * spec.d) }?)
    } else {
        None
    };
    let NormGrads {
        dx,
        dweight,
        mut dbias,
        ..
    } = grads;
    {
        let (xs, ws, gs) = (cs(x, WHAT)?, cs(weight, WHAT)?, cs(dy, WHAT)?);
        let (ms, rs, dxs) = (
            cs(&stats.mean, WHAT)?,
            cs(&stats.rstd, WHAT)?,
            cs_mut(dx, WHAT)?,
        );
        let dw = match pw.as_mut() {
            Some(p) => p,
            None => cs_mut(dweight, WHAT)?,
        };
        let db = match (pb.as_mut(), dbias.as_deref_mut()) {
            (Some(p), _) => Some(p),
            (None, Some(db)) => Some(cs_mut(db, WHAT)?),
            (None, None) => None,
        };
        let db = optional_ptr_mut(db, stream);
        let gacc = optional_ptr_mut(gacc.as_mut(), stream);
        // 256 threads (TILE_CHUNKS warps) and TILE_CHUNKS * planes * nvec * 32 bytes of dynamic shared
        // memory (allowed above), or that much per block in `gacc` (allocated for the grid); x, dy and dx
        // hold rows*d elements, w d, mean and rstd rows (checked by the caller); dw and db hold d
        // elements, or tiles * d when they are the partials; chunk_rows and chunks are param_order's.
        launch!(
            kernel: &kernel,
            cfg,
            "ln_bwd_<T>_<G>_nv<NV>_<kind>_pf<P>(const T* x, const T* w, const G* dy, const float* mean, \
             const float* rstd, G* dx, float* dw, float* db, float* gacc, int rows, int d, int chunk_rows, \
             int chunks, int acc_dx, int acc_param)",
            [
                xs,
                ws,
                gs,
                ms,
                rs,
                dxs,
                dw,
                &db.ptr,
                &gacc.ptr,
                &rows,
                &d,
                &chunk_rows,
                &chunks,
                &acc_dx,
                &acc_param
            ]
        )?;
    }
    let Some(pw) = pw else {
        return Ok(());
    };
    let cfg = LaunchConfig {
        grid_dim: (spec.d.div_ceil(32) as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let (tiles, run) = (order.tiles as i32, order.run as i32);
    let pb = optional_ptr(pb.as_ref(), stream);
    let dw = cs_mut(dweight, WHAT)?;
    let db = optional_ptr_mut(dbias.map(|db| cs_mut(db, WHAT)).transpose()?, stream);
    // 1024 threads and one block per 32 columns; the partials hold tiles * d elements, dw and db d;
    // run * 32 >= tiles (param_order).
    launch!(
        dev,
        module,
        "ln_param_reduce",
        cfg,
        "ln_param_reduce(const float* pw, const float* pb, float* dw, float* db, int tiles, int d, \
         int run, int accumulate)",
        [&pw, &pb.ptr, dw, &db.ptr, &tiles, &d, &run, &acc_param]
    )
}

// ---- the previous forward kernels (NormLaunch::legacy_forward) ----

/// The legacy kernels' register bound: 4 vectors per lane up to d = 1024, else re-read (or as named,
/// among 4, 8, 12, 16).
fn legacy_vectors_per_lane(spec: &NormSpec, all_bf16: bool) -> u32 {
    if !all_bf16 || spec.d % 8 != 0 {
        return 0;
    }
    let need = needed_vectors(spec.d);
    let chosen = spec
        .launch
        .vectors_per_lane
        .unwrap_or(if need <= 4 { 4 } else { 0 });
    match chosen {
        4 | 8 | 12 | 16 if chosen as usize >= need => chosen,
        _ => 0,
    }
}

/// The legacy kernels' launch: one warp per row, grid-stride over rows.
fn legacy_row_launch(dev: &CudaDevice, rows: usize) -> LaunchConfig {
    let warps_per_block = (THREADS / 32) as usize;
    let blocks = rows.div_ceil(warps_per_block).max(1) as u64;
    let cap = dev.sm_count() as u64 * 8;
    LaunchConfig {
        grid_dim: (blocks.min(cap) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn legacy_forward<T: FloatElement>(
    dev: &CudaDevice,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward";
    let nv = legacy_vectors_per_lane(spec, T::DTYPE == DType::BF16);
    let cfg = legacy_row_launch(dev, spec.rows);
    let (rows, d, eps, rms) = (spec.rows as i32, spec.d as i32, spec.eps, rms_flag(spec));
    let NormStats { mean, rstd } = stats;
    let (xs, ws) = (cs(x, WHAT)?, cs(weight, WHAT)?);
    let (ms, rs, ys) = (cs_mut(mean, WHAT)?, cs_mut(rstd, WHAT)?, cs_mut(y, WHAT)?);
    let bias = optional_ptr(bias.map(|b| cs(b, WHAT)).transpose()?, dev.stream());
    // 256 threads; x and y hold rows*d elements, w and b d, mean and rstd rows (checked by the caller).
    launch!(
        dev,
        &LAYER_NORM_LEGACY_MODULE,
        kernel_name!("ln_legacy_fwd_", T::NAME, "_nv", nv),
        cfg,
        "ln_legacy_fwd_<T>_nv<NV>(const T* x, const T* w, const T* b, float* mean, float* rstd, T* y, \
         int rows, int d, float eps, int rms)",
        [xs, ws, &bias.ptr, ms, rs, ys, &rows, &d, &eps, &rms]
    )
}

fn legacy_forward_fp8<T: FloatElement>(
    dev: &CudaDevice,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    out: Fp8NormOutput<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward_fp8";
    let nv = legacy_vectors_per_lane(spec, T::DTYPE == DType::BF16);
    let kernel = Kernel::new(
        dev,
        &LAYER_NORM_LEGACY_MODULE,
        kernel_name!(
            "ln_legacy_fwd_fp8_",
            T::NAME,
            "_",
            format_name(out.format),
            "_nv",
            nv
        ),
    )?;
    // Tiles of 16 rows (or as named, up to 32), halved while the codes exceed 96 KiB.
    let tr = match spec.launch.tile_rows {
        Some(t) if t.is_power_of_two() && t <= 32 => t,
        Some(t) => {
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("tile of {t} rows (a power of two up to 32 for the legacy kernel)"),
            })
        }
        None => {
            let mut t = 16;
            while t > 1 && t * (spec.d + TILE_PAD) > TILE_BYTES_MAX {
                t /= 2;
            }
            t
        }
    };
    let smem = tr * (spec.d + TILE_PAD);
    if smem > TILE_BYTES_MAX {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("a row of {} codes exceeds the shared-memory tile", spec.d),
        });
    }
    if smem > 48 * 1024 {
        kernel.allow_dynamic_smem(smem)?;
    }
    let tiles = spec.rows.div_ceil(tr) as u64;
    let per_sm = blocks_per_sm(smem) as u64;
    let cfg = LaunchConfig {
        grid_dim: (tiles.min(dev.sm_count() as u64 * per_sm) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (rows, d, eps, rms, tile) = (
        spec.rows as i32,
        spec.d as i32,
        spec.eps,
        rms_flag(spec),
        tr as i32,
    );
    let NormStats { mean, rstd } = stats;
    let stream = dev.stream();
    let (xs, ws, ss) = (cs(x, WHAT)?, cs(weight, WHAT)?, cs(out.scale, WHAT)?);
    let (ms, rs) = (cs_mut(mean, WHAT)?, cs_mut(rstd, WHAT)?);
    // The legacy kernel writes both layouts: a layout not asked for goes to scratch.
    let n = spec.rows * spec.d;
    let (mut q_scratch, mut qt_scratch) = (None, None);
    let q = match out.codes {
        Some(q) => q,
        None => q_scratch.insert(Device::Cuda(dev.clone()).uninit::<u8>(n)?),
    };
    let qt = match out.codes_t {
        Some(q) => q,
        None => qt_scratch.insert(Device::Cuda(dev.clone()).uninit::<u8>(n)?),
    };
    let (qs, qts) = (cs_mut(q, WHAT)?, cs_mut(qt, WHAT)?);
    let bias = optional_ptr(bias.map(|b| cs(b, WHAT)).transpose()?, stream);
    let slot = out.amax.as_ref().map_or(0, |a| a.slot as i32);
    let amax = out.amax.map(|a| cs_mut(a.buffer, WHAT)).transpose()?;
    let amax = optional_ptr_mut(amax, stream);
    // 256 threads and tile_rows * (d + 16) bytes of dynamic shared memory (allowed above); x, q and qt
    // hold rows*d elements, w and b d, mean and rstd rows, scale at least one, the amax slot is in
    // bounds (checked by the caller).
    launch!(
        kernel: &kernel,
        cfg,
        "ln_legacy_fwd_fp8_<T>_<fmt>_nv<NV>(const T* x, const T* w, const T* b, float* mean, float* rstd, \
         u8* q, u8* qt, const float* scale, float* amax, int slot, int rows, int d, float eps, int rms, \
         int tile_rows)",
        [xs, ws, &bias.ptr, ms, rs, qs, qts, ss, &amax.ptr, &slot, &rows, &d, &eps, &rms, &tile]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer_norm::NormLaunch;

    fn spec(rows: usize, d: usize, launch: NormLaunch) -> NormSpec {
        NormSpec::layer_norm(rows, d).with_launch(launch)
    }

    #[test]
    fn register_bounds_hold_the_row_or_re_read() {
        let auto = NormLaunch::default();
        let fwd = &FORWARD_VECTORS_PER_LANE[..];
        assert_eq!(vectors_per_lane(&spec(8, 768, auto), true, fwd), 3);
        assert_eq!(vectors_per_lane(&spec(8, 2048, auto), true, fwd), 8);
        assert_eq!(vectors_per_lane(&spec(8, 2560, auto), true, fwd), 10);
        assert_eq!(vectors_per_lane(&spec(8, 3584, auto), true, fwd), 16);
        assert_eq!(vectors_per_lane(&spec(8, 4104, auto), true, fwd), 0);
        assert_eq!(vectors_per_lane(&spec(8, 100, auto), true, fwd), 0);
        assert_eq!(vectors_per_lane(&spec(8, 768, auto), false, fwd), 0);
        let bwd = &BACKWARD_VECTORS_PER_LANE[..];
        assert_eq!(vectors_per_lane(&spec(8, 2048, auto), true, bwd), 8);
        assert_eq!(vectors_per_lane(&spec(8, 2560, auto), true, bwd), 0);
        let named = |nv| NormLaunch {
            vectors_per_lane: Some(nv),
            ..auto
        };
        // Too small, or without a kernel: re-read.
        assert_eq!(vectors_per_lane(&spec(8, 768, named(2)), true, fwd), 0);
        assert_eq!(vectors_per_lane(&spec(8, 768, named(5)), true, fwd), 0);
        assert_eq!(vectors_per_lane(&spec(8, 768, named(8)), true, fwd), 8);
    }

    #[test]
    fn fp8_tiles_and_warps_follow_the_width() {
        let limit = 227 * 1024;
        let auto = NormLaunch::default();
        let plan = |d, launch| fp8_forward_plan(&spec(64, d, launch), true, true, limit).unwrap();
        let row_major =
            |d, launch| fp8_forward_plan(&spec(64, d, launch), true, false, limit).unwrap();
        let shape = |p: ForwardPlan| (p.nv, p.rows_per_warp, p.warps, p.tile_rows);
        // With the transposed codes: 16-row tiles at every width that fits.
        assert_eq!(shape(plan(768, auto)), (3, 2, 8, 16));
        assert_eq!(shape(plan(2048, auto)), (8, 1, 16, 16));
        assert_eq!(shape(plan(4096, auto)), (16, 1, 16, 16));
        // Wide rows: the tile shrinks to fit 96 KiB.
        assert_eq!(shape(plan(65_536, auto)), (0, 1, 1, 1));
        // Row-major codes only: 8-row tiles beyond width 1024, and no shared-memory bound.
        assert_eq!(shape(row_major(768, auto)), (3, 2, 8, 16));
        assert_eq!(shape(row_major(2048, auto)), (8, 1, 8, 8));
        assert_eq!(shape(row_major(4096, auto)), (16, 1, 8, 8));
        assert_eq!(shape(row_major(65_536, auto)), (0, 1, 8, 8));
        // A tall tile takes more rows per warp (at most 16 warps), re-reading where no kernel holds them.
        let tall = NormLaunch {
            tile_rows: Some(64),
            ..auto
        };
        let p = plan(768, tall);
        assert_eq!((p.nv, p.rows_per_warp, p.warps), (3, 4, 16));
        let p = plan(2560, tall);
        assert_eq!((p.nv, p.rows_per_warp, p.warps), (0, 4, 16));
        let low = NormLaunch {
            tile_rows: Some(2),
            rows_per_warp: Some(4),
            ..auto
        };
        let p = plan(768, low);
        assert_eq!((p.nv, p.rows_per_warp, p.warps, p.tile_rows), (3, 2, 1, 2));
        for bad in [
            NormLaunch {
                tile_rows: Some(24),
                ..auto
            },
            NormLaunch {
                tile_rows: Some(128),
                ..auto
            },
            NormLaunch {
                rows_per_warp: Some(3),
                ..auto
            },
        ] {
            assert!(fp8_forward_plan(&spec(64, 768, bad), true, true, limit).is_err());
        }
        // A named tile beyond the block's shared memory.
        let big = NormLaunch {
            tile_rows: Some(64),
            ..auto
        };
        assert!(fp8_forward_plan(&spec(64, 8192, big), true, true, limit).is_err());
        assert_eq!(row_major(8192, big).tile_rows, 64);
    }

    #[test]
    fn backward_sums_in_shared_memory_unless_too_wide() {
        let limit = 227 * 1024;
        let auto = NormLaunch::default();
        let p = backward_plan(&spec(16_384, 768, auto), true, false, limit);
        assert_eq!((p.nv, p.prefetch, p.grid, p.global), (3, true, 256, false));
        assert_eq!(p.acc_bytes, 8 * 768 * 4);
        let p = backward_plan(&spec(16_384, 2048, auto), true, false, limit);
        assert_eq!((p.nv, p.prefetch, p.grid, p.global), (8, false, 256, false));
        let off = NormLaunch {
            prefetch: Some(false),
            ..auto
        };
        assert!(!backward_plan(&spec(16_384, 768, off), true, false, limit).prefetch);
        // Running sums of d = 4096 with a bias need 256 KiB: a global scratch.
        let p = backward_plan(&spec(8192, 4096, auto), true, true, limit);
        assert!(p.global);
        assert_eq!(p.grid, 256);
        let p = backward_plan(&spec(3, 70_000, auto), false, true, limit);
        assert_eq!((p.nv, p.grid, p.global), (0, 1, true));
    }
}
