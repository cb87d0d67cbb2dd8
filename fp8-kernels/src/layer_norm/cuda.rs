//! Launches of the LayerNorm / RMSNorm kernels (`layer_norm.cu`). Arguments were validated by `mod.rs`.

use super::{
    param_order, Fp8NormOutput, NormGrads, NormKind, NormSpec, NormStats,
    LAYER_NORM_BACKWARD_MODULE, LAYER_NORM_FORWARD_MODULE,
};
use crate::cast::{format_name, FloatElement};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::launch::{kernel_name, launch, optional_ptr, optional_ptr_mut, Kernel};
use crate::{Buffer, CudaDevice, DType, KernelError};
use cudarc::driver::LaunchConfig;

/// Threads per block of the forward kernels (they assume it: 8 warps), and the most for the backward.
const THREADS: u32 = 256;
/// Dynamic shared memory per block the fused backward stages in (above 48 KiB is an opt-in on sm_90);
/// about half an SM's, so two blocks fit.
const STAGE_BYTES_MAX: usize = 110 * 1024;
/// Shared memory the FP8 kernel may use for its code tile (an opt-in above 48 KiB on sm_90).
const TILE_BYTES_MAX: usize = 96 * 1024;
/// Bytes of padding per tile row (`LN_TILE_PAD` in the kernel).
const TILE_PAD: usize = 16;

/// The register bound of the row kernels: vectors of 8 elements per lane kept in registers (4, 8, 12 or
/// 16), or 0 to re-read rows from memory. Register-held variants exist for bf16 rows whose length is a
/// multiple of 8 (`all_bf16`); everything else uses 0. The smallest bound that holds the row, unless the
/// launch names one (a named bound too small for the row, or one without a kernel, falls back to 0).
/// Results do not depend on it.
fn vectors_per_lane(spec: &NormSpec, all_bf16: bool) -> u32 {
    if !all_bf16 || spec.d % 8 != 0 {
        return 0;
    }
    let need = spec.d.div_ceil(8).div_ceil(32);
    // Measured on the H200 (layer_kernel_bench --sweep, docs/kernels-transformer.md): holding 4 vectors
    // per lane is as fast as re-reading at d = 768; beyond that the registers cost more resident warps than
    // the re-reads (served by L1/L2) cost, e.g. the backward at d = 2560 takes 93 µs re-reading, 106 µs
    // holding 12 vectors.
    let chosen = spec
        .launch
        .vectors_per_lane
        .unwrap_or(if need <= 4 { 4 } else { 0 });
    match chosen {
        4 | 8 | 12 | 16 if chosen as usize >= need => chosen,
        _ => 0,
    }
}

/// Blocks resident per SM as bounded by `smem` bytes of dynamic shared memory each (about 220 KiB usable
/// per SM, 1 KiB reserved per block), between 1 and 8: the grid size of the shared-memory kernels.
fn blocks_per_sm(smem: usize) -> usize {
    ((220 * 1024) / (smem + 1024)).clamp(1, 8)
}

/// One warp per row, grid-stride over rows.
fn row_launch(dev: &CudaDevice, rows: usize) -> LaunchConfig {
    let warps_per_block = (THREADS / 32) as usize;
    let blocks = rows.div_ceil(warps_per_block).max(1) as u64;
    let cap = dev.sm_count() as u64 * 8;
    LaunchConfig {
        grid_dim: (blocks.min(cap) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rms_flag(spec: &NormSpec) -> i32 {
    (spec.kind == NormKind::RmsNorm) as i32
}

pub(super) fn forward<T: FloatElement>(
    dev: &CudaDevice,
    spec: &NormSpec,
    x: &Buffer<T>,
    weight: &Buffer<T>,
    bias: Option<&Buffer<T>>,
    stats: &mut NormStats,
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_forward";
    if spec.rows == 0 {
        return Ok(());
    }
    let nv = vectors_per_lane(spec, T::DTYPE == DType::BF16);
    let cfg = row_launch(dev, spec.rows);
    let (rows, d, eps, rms) = (spec.rows as i32, spec.d as i32, spec.eps, rms_flag(spec));
    let NormStats { mean, rstd } = stats;
    let (xs, ws) = (cs(x, WHAT)?, cs(weight, WHAT)?);
    let (ms, rs, ys) = (cs_mut(mean, WHAT)?, cs_mut(rstd, WHAT)?, cs_mut(y, WHAT)?);
    let bias = optional_ptr(bias.map(|b| cs(b, WHAT)).transpose()?, dev.stream());
    // 256 threads; x and y hold rows*d elements, w and b d, mean and rstd rows (checked by the caller).
    launch!(
        dev,
        &LAYER_NORM_FORWARD_MODULE,
        kernel_name!("ln_fwd_", T::NAME, "_nv", nv),
        cfg,
        "ln_fwd_<T>_nv<NV>(const T* x, const T* w, const T* b, float* mean, float* rstd, T* y, int rows, \
         int d, float eps, int rms)",
        [xs, ws, &bias.ptr, ms, rs, ys, &rows, &d, &eps, &rms]
    )
}

/// Rows per tile of the FP8 kernel: the largest power of two up to 16 whose code tile fits the budget.
/// 16 rather than 32: more resident blocks per SM outweigh the longer transposed stores (measured on the
/// H200: 68.7 against 89.1 µs at [8192, 2560], 41.2 against 43.2 µs at [16384, 768]).
fn tile_rows(d: usize) -> usize {
    let mut tr = 16;
    while tr > 1 && tr * (d + TILE_PAD) > TILE_BYTES_MAX {
        tr /= 2;
    }
    tr
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
    let nv = vectors_per_lane(spec, T::DTYPE == DType::BF16);
    let kernel = Kernel::new(
        dev,
        &LAYER_NORM_FORWARD_MODULE,
        kernel_name!(
            "ln_fwd_fp8_",
            T::NAME,
            "_",
            format_name(out.format),
            "_nv",
            nv
        ),
    )?;
    let tr = match spec.launch.tile_rows {
        Some(t) if t.is_power_of_two() && t <= 32 => t,
        Some(t) => {
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("tile of {t} rows (a power of two up to 32)"),
            })
        }
        None => tile_rows(spec.d),
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
    let (qs, qts) = (cs_mut(out.codes, WHAT)?, cs_mut(out.codes_t, WHAT)?);
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
        "ln_fwd_fp8_<T>_<fmt>_nv<NV>(const T* x, const T* w, const T* b, float* mean, float* rstd, \
         u8* q, u8* qt, const float* scale, float* amax, int slot, int rows, int d, float eps, int rms, \
         int tile_rows)",
        [xs, ws, &bias.ptr, ms, rs, qs, qts, ss, &amax.ptr, &slot, &rows, &d, &eps, &rms, &tile]
    )
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
    let (rows, d, rms) = (spec.rows as i32, spec.d as i32, rms_flag(spec));
    let all_bf16 = T::DTYPE == DType::BF16 && G::DTYPE == DType::BF16;
    let nv = vectors_per_lane(spec, all_bf16);
    let kernel = Kernel::new(
        dev,
        &LAYER_NORM_BACKWARD_MODULE,
        kernel_name!("ln_bwd_", T::NAME, "_", G::NAME, "_nv", nv),
    )?;
    let order = param_order(spec.rows);
    let has_bias = grads.dbias.is_some();
    let planes = if has_bias { 2 } else { 1 };
    // Staging of `warps` rows plus the running sums, per block: (warps + 1) * planes * d floats.
    let stage_bytes = |warps: usize| (warps + 1) * planes * spec.d * 4;
    let warps = [8usize, 4, 2, 1]
        .into_iter()
        .find(|&w| stage_bytes(w) <= STAGE_BYTES_MAX);
    let sms = dev.sm_count() as usize;
    let stream = dev.stream();
    // Rows too wide for shared memory stage in global memory, one warp per block, two blocks per SM.
    let (warps, grid, smem, mut gstage) = match warps {
        Some(w) => {
            let per_sm = blocks_per_sm(stage_bytes(w));
            (w, order.chunks.min(sms * per_sm), stage_bytes(w), None)
        }
        None => {
            let grid = order.chunks.min(sms * 2);
            // SAFETY: the kernel writes every staged element before reading it (the running sums are
            // reset per chunk, a staged row is written by its warp before the barrier that precedes
            // the reads).
            let g = unsafe { stream.alloc::<f32>(grid * stage_bytes(1) / 4) }?;
            (1, grid, 0, Some(g))
        }
    };
    if smem > 48 * 1024 {
        kernel.allow_dynamic_smem(smem)?;
    }
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let acc_dx = grads.dx_mode.flag() as i32;
    let acc_param = grads.param_mode.flag() as i32;
    // With more than one chunk the kernel writes chunk partials, combined by `ln_param_reduce`.
    let partials = order.chunks > 1;
    // SAFETY: every element of the partial buffers is written by the backward kernel below (one value per
    // chunk and column) before `ln_param_reduce` reads it, in stream order.
    let mut pw = if partials {
        Some(unsafe { stream.alloc::<f32>(order.chunks * spec.d) }?)
    } else {
        None
    };
    // SAFETY: as above (allocated only when there is a bias gradient).
    let mut pb = if partials && has_bias {
        Some(unsafe { stream.alloc::<f32>(order.chunks * spec.d) }?)
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
        let gstage = optional_ptr_mut(gstage.as_mut(), stream);
        // 32 * warps threads (at most 256) and (warps + 1) * planes * d floats of dynamic shared memory
        // (allowed above), or that much per block in `gstage` (allocated for the grid); x, dy and dx hold
        // rows*d elements, w d, mean and rstd rows (checked by the caller); dw and db hold d elements, or
        // chunks * d when they are the partials.
        launch!(
            kernel: &kernel,
            cfg,
            "ln_bwd_<T>_<G>_nv<NV>(const T* x, const T* w, const G* dy, const float* mean, \
             const float* rstd, G* dx, float* dw, float* db, float* gstage, int rows, int d, int rms, \
             int acc_dx, int acc_param)",
            [xs, ws, gs, ms, rs, dxs, dw, &db.ptr, &gstage.ptr, &rows, &d, &rms, &acc_dx, &acc_param]
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
    let (chunks, group) = (order.chunks as i32, order.group as i32);
    let pb = optional_ptr(pb.as_ref(), stream);
    let dw = cs_mut(dweight, WHAT)?;
    let db = optional_ptr_mut(dbias.map(|db| cs_mut(db, WHAT)).transpose()?, stream);
    // 1024 threads and one block per 32 columns; the partials hold chunks * d elements, dw and db d;
    // group * 32 >= chunks (param_order).
    launch!(
        dev,
        &LAYER_NORM_BACKWARD_MODULE,
        "ln_param_reduce",
        cfg,
        "ln_param_reduce(const float* pw, const float* pb, float* dw, float* db, int chunks, int d, \
         int group, int accumulate)",
        [&pw, &pb.ptr, dw, &db.ptr, &chunks, &d, &group, &acc_param]
    )
}
