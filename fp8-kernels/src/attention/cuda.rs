//! Launches of the attention kernels (`attention.cu`, `attention_separate.cu`) on a buffer's GPU, on its
//! compute stream; each tensor-core kernel from its own module ([`kernel_module`]).
//!
//! The public functions in `mod.rs` validate shapes, lengths and devices before anything here runs; this
//! file turns a validated call into grids, shared-memory sizes and kernel arguments.

use super::{
    attention_module, kernel_entry, kernel_module, kv_ws_stages, AttentionKernel, AttentionShape,
    BackwardKernels, DqAccumulation, KernelFamily, KeyTiles, LayoutProbe, QueryTiles,
    ResolvedConfig, TensorKernel, WgmmaBackwardTiles, WgmmaProbe, WgmmaTiles,
    ATTENTION_WGMMA_MODULE, WS_STAGES,
};
use crate::launch::{kernel_name, launch, Kernel};
use crate::{CudaDevice, KernelError};
use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};
use half::bf16;

/// Key rows per block of the fused backward.
pub(super) const KEY_BLOCK: usize = 64;
/// Threads of the simple kernels and of the fused backward.
const THREADS: u32 = 128;
/// Most blocks of a grid-stride launch of the simple kernels.
const MAX_ROW_BLOCKS: usize = 1 << 20;

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// Bytes of dynamic shared memory of a forward kernel: Q [BM][hd+8], K and V [2][BN][hd+8] bf16.
pub(super) fn forward_smem_bytes(head_dim: usize, t: &QueryTiles) -> usize {
    (t.block_rows() + 4 * t.key_rows) * (head_dim + 8) * 2
}

/// Bytes of dynamic shared memory of a wgmma forward kernel: Q [BM][hd], K [`key_buffers`][BN][hd] and V
/// [`value_buffers`][BN][hd] bf16 in 128-byte-swizzled tiles; the warp-specialised kernel's mbarriers
/// (full_q, and full and empty per stage for K and V, 8 bytes each); 1024 bytes for the kernel to align
/// the tiles to 1024 bytes.
pub(super) fn wgmma_forward_smem_bytes(head_dim: usize, t: &WgmmaTiles) -> usize {
    let barriers = if t.specialized {
        (1 + 4 * WS_STAGES) * 8
    } else {
        0
    };
    (t.block_rows() + (t.key_buffers() + t.value_buffers()) * t.key_rows) * head_dim * 2
        + barriers
        + 1024
}

/// A TMA tensor map (the driver's `CUtensorMap`, 128 opaque bytes), passed by value as a kernel
/// parameter (`const __grid_constant__ AttTmaMap` in attention_wgmma.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct TensorMap(sys::CUtensorMap);

// SAFETY: plain bytes the driver encoded, read by the kernel as its 128-byte, 64-byte aligned parameter
// (cudarc's CUtensorMap is at least that aligned); no pointers the host must keep alive besides the
// buffer it describes, which the launch also passes as an ordinary argument.
unsafe impl DeviceRepr for TensorMap {}

/// The tensor map of `buf` as `[B][T][heads][hd]` bf16 (qkv: `heads` = H + 2 KV; dout: H; coordinates
/// column, head, token, batch) whose box is 64 columns of one head over `box_rows` tokens, 128-byte
/// swizzled: one column block of the kernels' SW128 tiles (attention_wgmma.cu, (1)); rows past T read as
/// zeros.
fn rows_tensor_map(
    buf: &CudaSlice<bf16>,
    shape: &AttentionShape,
    heads: usize,
    box_rows: usize,
) -> Result<TensorMap, KernelError> {
    use sys::{
        CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
        CUtensorMapL2promotion, CUtensorMapSwizzle,
    };
    let heads = heads as u64;
    let hd = shape.head_dim as u64;
    let (t, b) = (shape.seq_len as u64, shape.batch as u64);
    let dims = [hd, heads, t, b];
    let strides = [hd * 2, heads * hd * 2, t * heads * hd * 2];
    let boxes = [64u32, 1, box_rows as u32, 1];
    let steps = [1u32; 4];
    let stream = buf.stream().clone();
    let (ptr, _order) = buf.device_ptr(&stream);
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: `map` is writable storage for one CUtensorMap; the dimension, stride, box and step arrays
    // hold the rank's (4, 3, 4, 4) entries; `ptr` is the live allocation of buf (B*T*heads*hd bf16,
    // checked by the caller), 256-byte aligned as every cudarc allocation; the driver validates the rest
    // (stride alignment, box limits) and reports an error instead of encoding.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
    }
    // SAFETY: the driver wrote the whole map (the call succeeded).
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// Bytes of dynamic shared memory of the wgmma probes (`ATT_WG_PROBE_SMEM`): two 64 x 128 tiles and the
/// alignment.
const WGMMA_PROBE_SMEM: usize = 2 * 64 * 128 * 2 + 1024;

/// Bytes of dynamic shared memory of the fused backward with `rows` query rows per iteration.
pub(super) fn fused_smem_bytes(head_dim: usize, rows: usize) -> usize {
    (2 * KEY_BLOCK + 4 * rows) * (head_dim + 8) * 2 + KEY_BLOCK * (rows + 8) * 2 + 4 * rows * 4
}

/// Bytes of dynamic shared memory of the wgmma fused backward and dK/dV kernels (`ATT_WG_BWD_SMEM`): K, V
/// [64 * warpgroups][hd]; Q, dO [2][64][hd]; with `dq` (the fused kernel) dS^T [64][64] bf16, all in
/// 128-byte-swizzled tiles; lse, D [2][64] f32; and 1024 bytes for the kernel to align the tiles.
pub(super) fn wgmma_backward_smem_bytes(head_dim: usize, warpgroups: usize, dq: bool) -> usize {
    let ds = if dq { 64 * 64 * 2 } else { 0 };
    (2 * 64 * warpgroups + 4 * 64) * head_dim * 2 + ds + 4 * 64 * 4 + 1024
}

/// Bytes of dynamic shared memory of the warp-specialised wgmma dK/dV kernel (`ATT_WG_KV_WS_SMEM`): K, V
/// [64 * warpgroups][hd]; Q, dO [stages][64][hd]; lse, D [stages][64] f32; 1 + 2 stages mbarriers; the
/// alignment ([`kv_ws_stages`]).
pub(super) fn wgmma_kv_ws_smem_bytes(head_dim: usize, warpgroups: usize) -> usize {
    let stages = kv_ws_stages(head_dim);
    (2 * 64 * warpgroups + 2 * stages * 64) * head_dim * 2
        + 2 * stages * 64 * 4
        + (1 + 2 * stages) * 8
        + 1024
}

/// Bytes of dynamic shared memory of the fused ordered wgmma backward (`ATT_WG_ORDERED_SMEM`): K, V
/// [128][hd]; Q, dO [stages][64][hd]; dS^T [128][64] bf16; 3 (hd 64) or 2 dQ tiles [64][hd] f32; lse,
/// D [stages][64] f32; 1 + 3 per dQ tile + 2 stages mbarriers; the alignment ([`kv_ws_stages`]).
pub(super) fn wgmma_ordered_smem_bytes(head_dim: usize) -> usize {
    let stages = kv_ws_stages(head_dim);
    // `ATT_WG_ORDERED_DQS`: the dQ tiles, each with its writer warp.
    let dq_tiles = if head_dim == 64 { 3 } else { 2 };
    (2 * 128 + 2 * stages * 64) * head_dim * 2
        + 128 * 64 * 2
        + dq_tiles * 64 * head_dim * 4
        + 2 * stages * 64 * 4
        + (1 + 3 * dq_tiles + 2 * stages) * 8
        + 1024
}

/// F32 workspace elements of the fused ordered wgmma backward: the dQ accumulator, a 64 x hd tile per
/// (batch, query head, 64-row query tile), then one 32-bit turn counter per tile.
pub(super) fn ordered_workspace_len(shape: &AttentionShape) -> usize {
    let (tiles, acc_len) = ordered_accumulator(shape);
    acc_len + tiles
}

/// The fused ordered backward's dQ tiles, one per (batch, query head, 64-row query tile), and the f32
/// elements of their accumulator.
fn ordered_accumulator(shape: &AttentionShape) -> (usize, usize) {
    let tiles = shape.batch * shape.heads * shape.seq_len.div_ceil(64);
    (tiles, tiles * 64 * shape.head_dim)
}

/// Bytes of dynamic shared memory of the wgmma dQ kernel (`ATT_WG_DQ_SMEM`): Q, dO [64 * warpgroups][hd];
/// K [2, 3 pipelined, or the stages when specialised][key_rows][hd]; V [2 or the stages][key_rows][hd];
/// the specialised kernel's mbarriers; the alignment.
pub(super) fn wgmma_dq_smem_bytes(head_dim: usize, t: &WgmmaTiles) -> usize {
    let (key_buffers, value_buffers, barriers) = if t.specialized {
        (WS_STAGES, WS_STAGES, (1 + 4 * WS_STAGES) * 8)
    } else if t.pipelined {
        (3, 2, 0)
    } else {
        (2, 2, 0)
    };
    (2 * t.block_rows() + (key_buffers + value_buffers) * t.key_rows) * head_dim * 2
        + barriers
        + 1024
}

/// Bytes of dynamic shared memory of the dK/dV kernel: K, V [BN][hd+8]; Q, dO [2][BM][hd+8] bf16; lse,
/// D [2][BM] f32; with warp pairs, P^T [pairs][32 keys][BM] f32.
pub(super) fn dkdv_smem_bytes(head_dim: usize, t: &KeyTiles) -> usize {
    let exchange = if t.paired {
        t.block_keys() * t.query_rows * 4
    } else {
        0
    };
    (2 * t.block_keys() + 4 * t.query_rows) * (head_dim + 8) * 2 + 4 * t.query_rows * 4 + exchange
}

/// Bytes of dynamic shared memory of the dQ kernel: Q, dO [BM][hd+8]; K, V [2][BN][hd+8] bf16 (as the
/// forward plus one more [BM] tile).
pub(super) fn dq_smem_bytes(head_dim: usize, t: &QueryTiles) -> usize {
    (2 * t.block_rows() + 4 * t.key_rows) * (head_dim + 8) * 2
}

/// Raises the kernel's dynamic shared-memory limit to `bytes` (needed above 48 KiB), after checking
/// that the GPU allows that much per block.
fn allow_dynamic_smem(
    dev: &CudaDevice,
    kernel: &Kernel,
    bytes: usize,
    what: &'static str,
) -> Result<(), KernelError> {
    let limit = dev.shared_memory_per_block_optin();
    if bytes > limit {
        return Err(bad(
            what,
            format!(
                "the tiles need {bytes} bytes of shared memory per block; this GPU allows {limit} \
                 (use smaller tiles or AttentionKernel::Simple)"
            ),
        ));
    }
    kernel.allow_dynamic_smem(bytes)
}

/// The wgmma kernels are built for sm_90a, which only compute capability 9.0 runs.
fn require_sm90(dev: &CudaDevice, what: &'static str) -> Result<(), KernelError> {
    let (major, minor) = dev.compute_capability();
    if (major, minor) != (9, 0) {
        return Err(bad(
            what,
            format!(
                "the wgmma kernels need compute capability 9.0 (Hopper, sm_90a); this GPU is \
                 {major}.{minor}; use AttentionKernel::Mma"
            ),
        ));
    }
    Ok(())
}

fn require_tensor_cores(dev: &CudaDevice, what: &'static str) -> Result<(), KernelError> {
    let (major, minor) = dev.compute_capability();
    if major < 8 {
        return Err(bad(
            what,
            format!(
                "the tensor-core kernels need compute capability 8.0 or newer (this GPU is \
                 {major}.{minor}); use AttentionKernel::Simple"
            ),
        ));
    }
    Ok(())
}

/// Launch parameters shared by every kernel: `(B, T, H, KV)` as the kernels' `int`s (validated to fit).
fn dims(shape: &AttentionShape) -> (i32, i32, i32, i32) {
    (
        shape.batch as i32,
        shape.seq_len as i32,
        shape.heads as i32,
        shape.kv_heads as i32,
    )
}

/// A grid-stride launch of the simple kernels over `B * heads * T` rows (`heads`: query heads, or
/// key/value heads for the dK/dV kernel).
fn row_grid(shape: &AttentionShape, heads: usize) -> LaunchConfig {
    let rows = shape.batch * heads * shape.seq_len;
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Forward on the GPU. Buffers were checked to have the shape's lengths and to live on `dev`.
pub(super) fn forward(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    qkv: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "attention_forward";
    let (b, t, h, kv) = dims(shape);
    let hd = shape.head_dim;
    match cfg.kernel {
        AttentionKernel::Simple => {
            // qkv of B*T*(H+2*KV)*HD, out of B*T*H*HD and lse of B*H*T elements (checked by the
            // caller; KV divides H); bf16 is a 16-bit word on both sides; grid-stride over the B*H*T
            // rows.
            launch!(
                dev,
                attention_module(hd, KernelFamily::Simple),
                kernel_name!("attn_fwd_simple_hd", hd),
                row_grid(shape, shape.heads),
                "attn_fwd_simple_hd<HD>(const u16* qkv, u16* out, float* lse, int B, int T, int H, \
                 int KV, float scale)",
                [qkv, out, lse, &b, &t, &h, &kv, &cfg.scale]
            )?;
        }
        AttentionKernel::Auto
            if cfg.wgmma_forward.is_some() && dev.compute_capability() == (9, 0) =>
        {
            forward_wgmma(dev, shape, cfg, qkv, out, lse)?
        }
        AttentionKernel::Auto | AttentionKernel::Mma => {
            require_tensor_cores(dev, WHAT)?;
            let tiles = cfg.forward;
            // BM = 16 * MT * NW query rows per block of 32 * NW threads (the tiles' warps).
            launch_forward(
                dev,
                shape,
                cfg,
                TensorKernel::Forward(tiles),
                forward_smem_bytes(hd, &tiles),
                32 * tiles.warps,
                tiles.block_rows(),
                (qkv, out, lse),
            )?;
        }
        AttentionKernel::Wgmma => forward_wgmma(dev, shape, cfg, qkv, out, lse)?,
    }
    Ok(())
}

/// The forward on warpgroup MMA (sm_90a), with the tiles `cfg` resolved.
fn forward_wgmma(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    qkv: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    require_sm90(dev, "attention_forward")?;
    let tiles = cfg
        .wgmma_forward
        .ok_or_else(|| KernelError::Internal("wgmma forward without resolved tiles".into()))?;
    // BM = 64 * NWG query rows per block of 128 * NWG threads (the tiles' warpgroups; and a producer
    // warp when specialised); the shared memory includes the tiles' 1024-byte alignment.
    let smem = wgmma_forward_smem_bytes(shape.head_dim, &tiles);
    if !tiles.specialized {
        return launch_forward(
            dev,
            shape,
            cfg,
            TensorKernel::WgmmaForward(tiles),
            smem,
            tiles.threads(),
            tiles.block_rows(),
            (qkv, out, lse),
        );
    }
    const WHAT: &str = "attention_forward";
    let slots = shape.heads + 2 * shape.kv_heads;
    let tmq = rows_tensor_map(qkv, shape, slots, tiles.block_rows())?;
    let tmkv = rows_tensor_map(qkv, shape, slots, tiles.key_rows)?;
    let (_, t, h, kv) = dims(shape);
    let (module, entry) = kernel_entry(shape.head_dim, TensorKernel::WgmmaForward(tiles));
    let kernel = Kernel::new(dev, module, entry)?;
    allow_dynamic_smem(dev, &kernel, smem, WHAT)?;
    let launch = LaunchConfig {
        grid_dim: (
            (shape.batch * shape.heads) as u32,
            shape.seq_len.div_ceil(tiles.block_rows()) as u32,
            1,
        ),
        block_dim: (tiles.threads() as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let scale_log2 = cfg.scale * std::f32::consts::LOG2_E;
    // As launch_forward, with the tensor maps of qkv (its whole extent, boxes of BM and BN rows) the
    // kernel reads it through; qkv itself orders the buffer on the stream.
    launch!(
        kernel: &kernel,
        launch,
        "attn_fwd_wgmma_g<NWG>n<BN>w_hd<HD>(const u16* qkv, u16* out, float* lse, int T, int H, int KV, \
         float scale_log2, AttTmaMap tmq, AttTmaMap tmkv)",
        [qkv, out, lse, &t, &h, &kv, &scale_log2, &tmq, &tmkv]
    )?;
    Ok(())
}

/// Launches a tensor-core forward `kernel` (mma.sync or wgmma: the same arguments) on the grid
/// (B*H, ceil(T / `rows`)) of `threads` threads with `smem` bytes of dynamic shared memory.
#[allow(clippy::too_many_arguments)]
fn launch_forward(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    kernel: TensorKernel,
    smem: usize,
    threads: usize,
    rows: usize,
    (qkv, out, lse): (&CudaSlice<bf16>, &mut CudaSlice<bf16>, &mut CudaSlice<f32>),
) -> Result<(), KernelError> {
    const WHAT: &str = "attention_forward";
    let (_, t, h, kv) = dims(shape);
    let (module, entry) = kernel_entry(shape.head_dim, kernel);
    let kernel = Kernel::new(dev, module, entry)?;
    allow_dynamic_smem(dev, &kernel, smem, WHAT)?;
    let launch = LaunchConfig {
        grid_dim: (
            (shape.batch * shape.heads) as u32,
            shape.seq_len.div_ceil(rows) as u32,
            1,
        ),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let scale_log2 = cfg.scale * std::f32::consts::LOG2_E;
    // Grid (B*H, ceil(T / rows)) of the kernel's threads with the dynamic shared memory its tiles need
    // (limit raised above); qkv of B*T*(H+2*KV)*HD, out of B*T*H*HD and lse of B*H*T elements (checked
    // by the caller; KV divides H); every global access is bounded by T.
    launch!(
        kernel: &kernel,
        launch,
        "attn_fwd_{w<NW>m<MT>n<BN>,wgmma_g<NWG>n<BN>[p]}_hd<HD>(const u16* qkv, u16* out, float* lse, \
         int T, int H, int KV, float scale_log2)",
        [qkv, out, lse, &t, &h, &kv, &scale_log2]
    )?;
    Ok(())
}

/// How the fused tensor-core backward is launched for a call.
pub(super) struct BackwardPlan {
    /// Blocks per (batch, key/value head) pair (grid.y).
    pub splits: usize,
    /// dQ accumulator buffers of `B*T*H*hd` F32 each.
    pub buffers: usize,
    kernel: Kernel,
    smem: usize,
}

/// Most dQ accumulator bytes the deterministic backward's automatic split choice may use.
const MAX_AUTO_DQ_BYTES: usize = 256 << 20;
/// Most blocks per (batch, head) pair the automatic split choice considers.
const MAX_AUTO_SPLITS: usize = 8;

/// The split count for the deterministic backward: the smallest that fills the GPU's block slots to at
/// least 90 % in its last wave (blocks of one launch are about equal under the snake order, so a partial
/// last wave idles the rest of the GPU), else the best fill, within the buffer and split caps.
fn auto_splits(pairs: usize, slots: usize, key_blocks: usize, dq_bytes: usize) -> usize {
    let cap = (MAX_AUTO_DQ_BYTES / dq_bytes.max(1))
        .clamp(1, MAX_AUTO_SPLITS)
        .min(key_blocks.max(1));
    let fill = |s: usize| {
        let waves = (pairs * s) as f64 / slots.max(1) as f64;
        waves / waves.ceil().max(1.0)
    };
    (1..=cap)
        .find(|&s| fill(s) >= 0.9)
        .unwrap_or_else(|| (1..=cap).fold(1, |best, s| if fill(s) > fill(best) { s } else { best }))
}

/// The tensor-core backward a call runs.
#[derive(Debug, Clone, Copy)]
pub(super) enum BackwardRun {
    /// One kernel with the fused contract (grid (B*KV, splits), 64 keys per block, dQ accumulated in F32
    /// buffers): an mma.sync fused variant, or the wgmma fused kernel (the atomic wgmma backward).
    Fused(TensorKernel),
    /// The mma.sync dK/dV and dQ kernels.
    Separate { dkdv: KeyTiles, dq: QueryTiles },
    /// The wgmma dK/dV and dQ kernels (the deterministic wgmma backward).
    WgmmaSeparate(WgmmaBackwardTiles),
    /// The fused ordered wgmma kernel (deterministic; [`WgmmaBackwardTiles::ORDERED`]), with dQ's
    /// columns split between its warpgroups ([`WgmmaBackwardTiles::ORDERED_COLUMNS`]) or its keys.
    WgmmaOrdered { dq_columns: bool },
}

/// Which tensor-core backward this call runs: the wgmma one where the config asks for it and the GPU
/// has it (compute capability 9.0; [`AttentionKernel::Wgmma`] on another GPU is an error), else the
/// `mma.sync` organisation of `cfg.backward`.
pub(super) fn backward_run(
    dev: &CudaDevice,
    cfg: &ResolvedConfig,
) -> Result<BackwardRun, KernelError> {
    if let Some(tiles) = cfg.wgmma_backward {
        if cfg.kernel == AttentionKernel::Wgmma {
            require_sm90(dev, "attention_backward")?;
        }
        if dev.compute_capability() == (9, 0) {
            return Ok(match cfg.dq_accumulation {
                DqAccumulation::Atomic => BackwardRun::Fused(TensorKernel::WgmmaFused),
                DqAccumulation::Deterministic if tiles.ordered => BackwardRun::WgmmaOrdered {
                    dq_columns: tiles.dq_columns,
                },
                DqAccumulation::Deterministic => BackwardRun::WgmmaSeparate(tiles),
            });
        }
    }
    Ok(match cfg.backward {
        BackwardKernels::Fused { query_rows } => {
            BackwardRun::Fused(TensorKernel::Fused { query_rows })
        }
        BackwardKernels::Separate { dkdv, dq } => BackwardRun::Separate { dkdv, dq },
    })
}

/// The launch plan of `kernel` (of a [`BackwardRun::Fused`]) for this call.
pub(super) fn fused_plan(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    kernel: TensorKernel,
) -> Result<BackwardPlan, KernelError> {
    const WHAT: &str = "attention_backward";
    require_tensor_cores(dev, WHAT)?;
    let hd = shape.head_dim;
    let smem = match kernel {
        TensorKernel::Fused { query_rows } => fused_smem_bytes(hd, query_rows),
        TensorKernel::WgmmaFused => wgmma_backward_smem_bytes(hd, 1, true),
        other => {
            return Err(KernelError::Internal(format!(
                "{other:?} is not a fused backward kernel"
            )))
        }
    };
    let (module, entry) = kernel_entry(hd, kernel);
    let kernel = Kernel::new(dev, module, entry)?;
    allow_dynamic_smem(dev, &kernel, smem, WHAT)?;
    let key_blocks = shape.seq_len.div_ceil(KEY_BLOCK).max(1);
    let (splits, buffers) = match cfg.dq_accumulation {
        DqAccumulation::Atomic => (key_blocks, 1),
        DqAccumulation::Deterministic => {
            let s = match cfg.backward_splits {
                Some(s) => s.clamp(1, key_blocks),
                None => {
                    let per_sm = kernel
                        .function()
                        .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)?
                        .max(1) as usize;
                    let slots = per_sm * dev.sm_count() as usize;
                    auto_splits(
                        shape.batch * shape.kv_heads,
                        slots,
                        key_blocks,
                        4 * shape.out_len(),
                    )
                }
            };
            (s, s)
        }
    };
    Ok(BackwardPlan {
        splits,
        buffers,
        kernel,
        smem,
    })
}

/// The backward's workspace needs: `(D elements, dQ accumulator elements)`.
pub(super) fn workspace_lens(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
) -> Result<(usize, usize), KernelError> {
    let dq = match cfg.kernel {
        AttentionKernel::Simple => 0,
        AttentionKernel::Auto | AttentionKernel::Mma | AttentionKernel::Wgmma => {
            match backward_run(dev, cfg)? {
                BackwardRun::Fused(kernel) => {
                    fused_plan(dev, shape, cfg, kernel)?.buffers * shape.out_len()
                }
                BackwardRun::WgmmaOrdered { .. } => ordered_workspace_len(shape),
                BackwardRun::Separate { .. } | BackwardRun::WgmmaSeparate(_) => 0,
            }
        }
    };
    Ok((shape.lse_len(), dq))
}

/// Backward on the GPU: `D`, then dQ/dK/dV. `d_ws` holds at least `B*H*T` and `dq_ws` (needed by the
/// fused backward only) at least the accumulator elements of [`workspace_lens`].
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    qkv: &CudaSlice<bf16>,
    out: &CudaSlice<bf16>,
    d_out: &CudaSlice<bf16>,
    lse: &CudaSlice<f32>,
    d_qkv: &mut CudaSlice<bf16>,
    d_ws: &mut CudaSlice<f32>,
    dq_ws: Option<&mut CudaSlice<f32>>,
) -> Result<(), KernelError> {
    let (b, t, h, kv) = dims(shape);
    let hd = shape.head_dim;
    let hd_i = hd as i32;

    // The module of (the first) kernel this call launches, which also holds D's and the dQ conversion.
    let run = match cfg.kernel {
        AttentionKernel::Simple => None,
        _ => Some(backward_run(dev, cfg)?),
    };
    let module = match run {
        None => attention_module(hd, KernelFamily::Simple),
        Some(BackwardRun::Fused(kernel)) => kernel_module(hd, kernel),
        Some(BackwardRun::Separate { dkdv, .. }) => kernel_module(hd, TensorKernel::DkDv(dkdv)),
        Some(BackwardRun::WgmmaSeparate(t)) => kernel_module(
            hd,
            TensorKernel::WgmmaDkDv {
                warpgroups: t.kv_warpgroups,
                specialized: t.kv_specialized,
            },
        ),
        Some(BackwardRun::WgmmaOrdered { dq_columns }) => {
            kernel_module(hd, TensorKernel::WgmmaOrdered { dq_columns })
        }
    };

    // D = rowsum(dO * O), one warp per row.
    {
        let rows = shape.batch * shape.seq_len * shape.heads;
        let cap = dev.sm_count() as usize * 32;
        let launch = LaunchConfig {
            grid_dim: (rows.div_ceil(8).clamp(1, cap) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let ds = &mut *d_ws;
        // out and dout hold B*T*H*HD elements, D at least B*H*T (checked by the caller); rows are
        // visited by a grid-stride loop bounded by B*T*H.
        launch!(
            dev,
            module,
            "attn_bwd_dot_rows",
            launch,
            "attn_bwd_dot_rows(const u16* out, const u16* dout, float* D, int B, int T, int H, int HD)",
            [out, d_out, ds, &b, &t, &h, &hd_i]
        )?;
    }

    match cfg.kernel {
        AttentionKernel::Simple => {
            for (name, heads) in [
                ("attn_bwd_simple_dq", shape.heads),
                ("attn_bwd_simple_dkdv", shape.kv_heads),
            ] {
                let (ds, dq) = (&*d_ws, &mut *d_qkv);
                // qkv and dqkv hold B*T*(H+2*KV)*HD elements, dout B*T*H*HD, lse and D at least B*H*T
                // (checked by the caller; KV divides H); grid-stride over the B*H*T query rows (dQ) or
                // the B*KV*T key rows (dK/dV). The two kernels write disjoint slots of dqkv.
                launch!(
                    dev,
                    module,
                    kernel_name!(name, "_hd", hd),
                    row_grid(shape, heads),
                    "attn_bwd_simple_{dq,dkdv}_hd<HD>(const u16* qkv, const u16* dout, const float* lse, \
                     const float* D, u16* dqkv, int B, int T, int H, int KV, float scale)",
                    [qkv, d_out, lse, ds, dq, &b, &t, &h, &kv, &cfg.scale]
                )?;
            }
        }
        AttentionKernel::Auto | AttentionKernel::Mma | AttentionKernel::Wgmma => {
            match run {
                None => {
                    return Err(KernelError::Internal(
                        "a tensor-core backward without its kernels".into(),
                    ))
                }
                Some(BackwardRun::Separate { dkdv, dq }) => {
                    let kernels = [
                        SeparateKernel {
                            kernel: TensorKernel::DkDv(dkdv),
                            smem: dkdv_smem_bytes(hd, &dkdv),
                            threads: 32 * dkdv.warps,
                            pairs: shape.batch * shape.kv_heads,
                            rows: dkdv.block_keys(),
                        },
                        SeparateKernel {
                            kernel: TensorKernel::Dq(dq),
                            smem: dq_smem_bytes(hd, &dq),
                            threads: 32 * dq.warps,
                            pairs: shape.batch * shape.heads,
                            rows: dq.block_rows(),
                        },
                    ];
                    separate_backward(dev, shape, cfg, kernels, qkv, d_out, lse, d_qkv, d_ws)?
                }
                Some(BackwardRun::WgmmaSeparate(t)) => {
                    let kernels = [
                        SeparateKernel {
                            kernel: TensorKernel::WgmmaDkDv {
                                warpgroups: t.kv_warpgroups,
                                specialized: t.kv_specialized,
                            },
                            smem: if t.kv_specialized {
                                wgmma_kv_ws_smem_bytes(hd, t.kv_warpgroups)
                            } else {
                                wgmma_backward_smem_bytes(hd, t.kv_warpgroups, false)
                            },
                            threads: t.kv_threads(),
                            pairs: shape.batch * shape.kv_heads,
                            rows: 64 * t.kv_warpgroups,
                        },
                        SeparateKernel {
                            kernel: TensorKernel::WgmmaDq(t.dq),
                            smem: wgmma_dq_smem_bytes(hd, &t.dq),
                            threads: t.dq.threads(),
                            pairs: shape.batch * shape.heads,
                            rows: t.dq.block_rows(),
                        },
                    ];
                    separate_backward(dev, shape, cfg, kernels, qkv, d_out, lse, d_qkv, d_ws)?
                }
                Some(BackwardRun::WgmmaOrdered { dq_columns }) => {
                    let dq_ws = dq_ws.ok_or_else(|| {
                        KernelError::Internal("attention backward without a dQ workspace".into())
                    })?;
                    let kernel = TensorKernel::WgmmaOrdered { dq_columns };
                    ordered_backward(
                        dev, shape, cfg, kernel, module, qkv, d_out, lse, d_qkv, d_ws, dq_ws,
                    )?
                }
                Some(BackwardRun::Fused(kernel)) => {
                    let dq_ws = dq_ws.ok_or_else(|| {
                        KernelError::Internal("attention backward without a dQ workspace".into())
                    })?;
                    let plan = fused_plan(dev, shape, cfg, kernel)?;
                    let nbuf = plan.buffers;
                    let n = shape.out_len();
                    let acc_len = nbuf * n;
                    if dq_ws.len() < acc_len {
                        return Err(KernelError::Internal(format!(
                            "dQ workspace of {} elements, {acc_len} needed",
                            dq_ws.len()
                        )));
                    }
                    {
                        let mut view = dq_ws.slice_mut(0..acc_len);
                        dev.stream().memset_zeros(&mut view)?;
                    }
                    let stride: u64 = if nbuf > 1 { n as u64 } else { 0 };
                    let launch = LaunchConfig {
                        grid_dim: ((shape.batch * shape.kv_heads) as u32, plan.splits as u32, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: plan.smem as u32,
                    };
                    let scale_log2 = cfg.scale * std::f32::consts::LOG2_E;
                    {
                        let (ds, acc, dq) = (&*d_ws, &mut *dq_ws, &mut *d_qkv);
                        // Grid (B*KV, splits) of 128 threads with the shared memory its tiles need (limit
                        // raised by fused_plan; the wgmma backward has the same grid and arguments); dq_acc holds nbuf * B*T*H*HD >= (splits if stride > 0 else
                        // 1) buffers (checked above), the other lengths as in the simple path (checked by the
                        // caller); every global access is bounded by T.
                        launch!(
                            kernel: &plan.kernel,
                            launch,
                            "attn_bwd_{fused_q<rows>,wgmma}_hd<HD>(const u16* qkv, const u16* dout, const float* lse, \
                             const float* D, float* dq_acc, u64 dq_split_stride, u16* dqkv, int T, int H, \
                             int KV, float scale, float scale_log2)",
                            [qkv, d_out, lse, ds, acc, &stride, dq, &t, &h, &kv, &cfg.scale, &scale_log2]
                        )?;
                    }
                    let cap = dev.sm_count() as u64 * 16;
                    let launch = LaunchConfig {
                        grid_dim: ((n as u64).div_ceil(256).clamp(1, cap) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let (nbuf_i, n_u, nbuf_stride) = (nbuf as i32, n as u64, n as u64);
                    let (acc, dq) = (&*dq_ws, &mut *d_qkv);
                    // acc holds nbuf buffers of n = B*T*H*HD elements (checked above), dqkv
                    // B*T*(H+2*KV)*HD; grid-stride over n.
                    launch!(
                    dev,
                    module,
                    "attn_bwd_dq_convert",
                    launch,
                    "attn_bwd_dq_convert(const float* acc, int nbuf, u64 stride, u16* dqkv, u64 n, int H, \
                     int KV, int HD, float scale)",
                    [acc, &nbuf_i, &nbuf_stride, dq, &n_u, &h, &kv, &hd_i, &cfg.scale]
                )?;
                }
            }
        }
    }
    Ok(())
}

/// The fused ordered wgmma backward (`D` already in `d_ws`): clears the turn counters in `dq_ws` (the
/// accumulator tiles before them are stored by key block 0 first), runs
/// `attn_bwd_wgmma_ordered_hd<hd>` (grid (B*KV, ceil(T / 128)), 384 threads) and converts the
/// accumulator into the q slot of `d_qkv` with `attn_bwd_dq_tiles_convert` of `rows_module`.
#[allow(clippy::too_many_arguments)]
fn ordered_backward(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    kernel: TensorKernel,
    rows_module: &'static crate::kernel_source::KernelModule,
    qkv: &CudaSlice<bf16>,
    d_out: &CudaSlice<bf16>,
    lse: &CudaSlice<f32>,
    d_qkv: &mut CudaSlice<bf16>,
    d_ws: &CudaSlice<f32>,
    dq_ws: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "attention_backward";
    require_sm90(dev, WHAT)?;
    let hd = shape.head_dim;
    let (b, t, h, kv) = dims(shape);
    let (_, acc_len) = ordered_accumulator(shape);
    let need = ordered_workspace_len(shape);
    if dq_ws.len() < need {
        return Err(KernelError::Internal(format!(
            "dQ workspace of {} elements, {need} needed",
            dq_ws.len()
        )));
    }
    {
        // The turn counters start at zero; the accumulator needs no clearing (key block 0 stores first).
        let mut view = dq_ws.slice_mut(acc_len..need);
        dev.stream().memset_zeros(&mut view)?;
    }
    let (module_k, entry) = kernel_entry(hd, kernel);
    let kernel = Kernel::new(dev, module_k, entry)?;
    let smem = wgmma_ordered_smem_bytes(hd);
    allow_dynamic_smem(dev, &kernel, smem, WHAT)?;
    let slots = shape.heads + 2 * shape.kv_heads;
    let tkv = rows_tensor_map(qkv, shape, slots, 128)?;
    let tq = rows_tensor_map(qkv, shape, slots, 64)?;
    let tdo = rows_tensor_map(d_out, shape, shape.heads, 64)?;
    let launch = LaunchConfig {
        grid_dim: (
            (shape.batch * shape.kv_heads) as u32,
            shape.seq_len.div_ceil(128) as u32,
            1,
        ),
        block_dim: (384, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let scale_log2 = cfg.scale * std::f32::consts::LOG2_E;
    {
        let (mut acc, mut turn) = dq_ws.split_at_mut(acc_len);
        let dq = &mut *d_qkv;
        // Grid (B*KV, ceil(T / 128)) of 384 threads with the shared memory above (limit raised); dq_acc
        // holds a 64 x hd tile per (b, h, 64-row query tile) and dq_turn one zeroed counter per tile
        // after it (checked and cleared above; the kernel reads the f32 slots as u32; key block 0
        // stores every tile before any other block adds to it); the other lengths
        // as in the separate backward (checked by the caller); every global access is bounded by T and
        // the tile count.
        launch!(
            kernel: &kernel,
            launch,
            "attn_bwd_wgmma_ordered_hd<HD>(const u16* qkv, const u16* dout, const float* lse, \
             const float* D, float* dq_acc, u32* dq_turn, u16* dqkv, int T, int H, int KV, float scale, \
             float scale_log2, AttTmaMap tkv, AttTmaMap tq, AttTmaMap tdo)",
            [qkv, d_out, lse, d_ws, &mut acc, &mut turn, dq, &t, &h, &kv, &cfg.scale, &scale_log2, &tkv, &tq, &tdo]
        )?;
    }
    let pairs = (acc_len / 2) as u64;
    let cap = dev.sm_count() as u64 * 16;
    let launch = LaunchConfig {
        grid_dim: (pairs.div_ceil(256).clamp(1, cap) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let hd_i = hd as i32;
    let (acc, dq) = (&dq_ws.slice(0..acc_len), &mut *d_qkv);
    // acc holds the tiles of B*H*ceil(T/64) x 64 x hd elements (checked above), dqkv
    // B*T*(H+2*KV)*HD; grid-stride over the element pairs, rows >= T skipped.
    launch!(
        dev,
        rows_module,
        "attn_bwd_dq_tiles_convert",
        launch,
        "attn_bwd_dq_tiles_convert(const float* acc, u16* dqkv, int B, int T, int H, int KV, int HD, \
         float scale)",
        [acc, dq, &b, &t, &h, &kv, &hd_i, &cfg.scale]
    )?;
    Ok(())
}

/// One kernel of a separate backward: grid (`pairs`, ceil(T / `rows`)) of `threads` threads.
struct SeparateKernel {
    kernel: TensorKernel,
    smem: usize,
    threads: usize,
    pairs: usize,
    rows: usize,
}

/// The separate backward (mma.sync or wgmma): the dK/dV kernel over key blocks, then the dQ kernel over
/// query blocks (`D` already in `d_ws`). They write disjoint slots of `d_qkv`; no workspace beyond `D`.
#[allow(clippy::too_many_arguments)]
fn separate_backward(
    dev: &CudaDevice,
    shape: &AttentionShape,
    cfg: &ResolvedConfig,
    kernels: [SeparateKernel; 2],
    qkv: &CudaSlice<bf16>,
    d_out: &CudaSlice<bf16>,
    lse: &CudaSlice<f32>,
    d_qkv: &mut CudaSlice<bf16>,
    d_ws: &CudaSlice<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "attention_backward";
    require_tensor_cores(dev, WHAT)?;
    let hd = shape.head_dim;
    let (_, t, h, kv) = dims(shape);
    let scale_log2 = cfg.scale * std::f32::consts::LOG2_E;
    for k in kernels {
        let (module, entry) = kernel_entry(hd, k.kernel);
        let kernel = Kernel::new(dev, module, entry)?;
        allow_dynamic_smem(dev, &kernel, k.smem, WHAT)?;
        let launch = LaunchConfig {
            grid_dim: (k.pairs as u32, shape.seq_len.div_ceil(k.rows) as u32, 1),
            block_dim: (k.threads as u32, 1, 1),
            shared_mem_bytes: k.smem as u32,
        };
        let dq = &mut *d_qkv;
        if let TensorKernel::WgmmaDkDv {
            warpgroups,
            specialized: true,
        } = k.kernel
        {
            let slots = shape.heads + 2 * shape.kv_heads;
            let tkv = rows_tensor_map(qkv, shape, slots, 64 * warpgroups)?;
            let tq = rows_tensor_map(qkv, shape, slots, 64)?;
            let tdo = rows_tensor_map(d_out, shape, shape.heads, 64)?;
            // As below, with the tensor maps of K/V, Q and dO the kernel reads them through (over the
            // buffers' whole extents; lse and D it reads itself); qkv and dout order the buffers.
            launch!(
                kernel: &kernel,
                launch,
                "attn_bwd_wgmma_kv_g<NWG>w_hd<HD>(const u16* qkv, const u16* dout, const float* lse, \
                 const float* D, u16* dqkv, int T, int H, int KV, float scale, float scale_log2, \
                 AttTmaMap tkv, AttTmaMap tq, AttTmaMap tdo)",
                [qkv, d_out, lse, d_ws, dq, &t, &h, &kv, &cfg.scale, &scale_log2, &tkv, &tq, &tdo]
            )?;
            continue;
        }
        if let TensorKernel::WgmmaDq(tiles) = k.kernel {
            if tiles.specialized {
                let slots = shape.heads + 2 * shape.kv_heads;
                let tq = rows_tensor_map(qkv, shape, slots, tiles.block_rows())?;
                let tdo = rows_tensor_map(d_out, shape, shape.heads, tiles.block_rows())?;
                let tkv = rows_tensor_map(qkv, shape, slots, tiles.key_rows)?;
                // As below, with the tensor maps of Q, dO and K/V the kernel reads them through (over
                // the buffers' whole extents); qkv and dout themselves order the buffers on the stream.
                launch!(
                    kernel: &kernel,
                    launch,
                    "attn_bwd_wgmma_q_g<NWG>n<BN>w_hd<HD>(const u16* qkv, const u16* dout, \
                     const float* lse, const float* D, u16* dqkv, int T, int H, int KV, float scale, \
                     float scale_log2, AttTmaMap tq, AttTmaMap tdo, AttTmaMap tkv)",
                    [qkv, d_out, lse, d_ws, dq, &t, &h, &kv, &cfg.scale, &scale_log2, &tq, &tdo, &tkv]
                )?;
                continue;
            }
        }
        // Grid (B*KV for dK/dV or B*H for dQ, ceil(T / rows per block)) of the kernel's threads with
        // the dynamic shared memory its tiles need (limit raised above); qkv and dqkv hold
        // B*T*(H+2*KV)*HD elements, dout B*T*H*HD, lse and D at least B*H*T (checked by the caller; KV
        // divides H); every global access is bounded by T. The dK/dV kernel writes the k and v slots of
        // dqkv, the dQ kernel the q slot.
        launch!(
            kernel: &kernel,
            launch,
            "attn_bwd_{dkdv,dq,wgmma_kv,wgmma_q}_<tiles>_hd<HD>(const u16* qkv, const u16* dout, \
             const float* lse, const float* D, u16* dqkv, int T, int H, int KV, float scale, \
             float scale_log2)",
            [qkv, d_out, lse, d_ws, dq, &t, &h, &kv, &cfg.scale, &scale_log2]
        )?;
    }
    Ok(())
}

/// Runs one layout probe on 64 x 64 tiles (see `LayoutProbe`).
pub(super) fn layout_probe(
    dev: &CudaDevice,
    probe: LayoutProbe,
    a: &[f32],
    b: &[bf16],
) -> Result<Vec<f32>, KernelError> {
    const WHAT: &str = "attention layout probe";
    require_tensor_cores(dev, WHAT)?;
    let name = match probe {
        LayoutProbe::ABt => "attn_probe_abt",
        LayoutProbe::PB => "attn_probe_pb",
        LayoutProbe::AtB => "attn_probe_atb",
    };
    let kernel = Kernel::new(dev, attention_module(64, KernelFamily::Probes), name)?;
    let smem = 4 * 64 * 72 * 2;
    allow_dynamic_smem(dev, &kernel, smem, WHAT)?;
    let stream = dev.stream();
    let b_dev = stream.clone_htod(b)?;
    let mut out = stream.alloc_zeros::<f32>(64 * 64)?;
    let launch = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (bs, os) = (&b_dev, &mut out);
    // Each operand 64 x 64 (the caller checked the host lengths), one block of 128 threads with the
    // shared memory above.
    match probe {
        LayoutProbe::PB => {
            let a_dev = stream.clone_htod(a)?;
            launch!(
                kernel: &kernel,
                launch,
                "attn_probe_pb(const float* p, const u16* b, float* out)",
                [&a_dev, bs, os]
            )?;
        }
        LayoutProbe::ABt | LayoutProbe::AtB => {
            let a16: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
            let a_dev = stream.clone_htod(&a16)?;
            launch!(
                kernel: &kernel,
                launch,
                "attn_probe_{abt,atb}(const u16* a, const u16* b, float* out)",
                [&a_dev, bs, os]
            )?;
        }
    }
    Ok(stream.clone_dtoh(&out)?)
}

/// Runs one wgmma probe (see `WgmmaProbe`; lengths checked by the caller).
pub(super) fn wgmma_probe(
    dev: &CudaDevice,
    probe: WgmmaProbe,
    head_dim: usize,
    a: &[f32],
    b: &[bf16],
) -> Result<Vec<f32>, KernelError> {
    const WHAT: &str = "attention wgmma probe";
    require_sm90(dev, WHAT)?;
    // V's descriptor strides of the P V probes: the kernel's, or those asked for.
    let (lbo, sbo) = match probe {
        WgmmaProbe::PvStrides { lbo, sbo } => (lbo, sbo),
        _ => (64 * 128, 1024),
    };
    let (name, out_cols) = match (probe, head_dim) {
        (WgmmaProbe::Abt16, _) => ("attn_wg_probe_abt16", 64),
        (WgmmaProbe::Abt, 64) => ("attn_wg_probe_abt_hd64", 64),
        (WgmmaProbe::Abt, _) => ("attn_wg_probe_abt_hd128", 64),
        (WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. }, 64) => ("attn_wg_probe_pv_hd64", 64),
        (WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. }, _) => ("attn_wg_probe_pv_hd128", 128),
    };
    let kernel = Kernel::new(dev, &ATTENTION_WGMMA_MODULE, name)?;
    allow_dynamic_smem(dev, &kernel, WGMMA_PROBE_SMEM, WHAT)?;
    let stream = dev.stream();
    let b_dev = stream.clone_htod(b)?;
    let mut out = stream.alloc_zeros::<f32>(64 * out_cols)?;
    let launch = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: WGMMA_PROBE_SMEM as u32,
    };
    let (bs, os) = (&b_dev, &mut out);
    // One warpgroup (128 threads) with the probes' shared memory; a is 64 x 64 (abt16, pv) or 64 x hd
    // (abt), b 64 x hd, out 64 x 64 or 64 x hd (pv), as the caller checked and the names above say; the
    // strides only change which shared-memory bytes of the one 64 x hd tile the wgmma reads (the
    // emulator checks nothing past the shared memory is read; a wrong stride reads the wrong tile bytes
    // or faults, which the test reports).
    match probe {
        WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. } => {
            let a_dev = stream.clone_htod(a)?;
            launch!(
                kernel: &kernel,
                launch,
                "attn_wg_probe_pv_hd<HD>(const float* p, const u16* v, float* out, u32 v_lbo, u32 v_sbo)",
                [&a_dev, bs, os, &lbo, &sbo]
            )?;
        }
        WgmmaProbe::Abt16 | WgmmaProbe::Abt => {
            let a16: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
            let a_dev = stream.clone_htod(&a16)?;
            launch!(
                kernel: &kernel,
                launch,
                "attn_wg_probe_abt{16,_hd<HD>}(const u16* a, const u16* b, float* out)",
                [&a_dev, bs, os]
            )?;
        }
    }
    Ok(stream.clone_dtoh(&out)?)
}

#[cfg(test)]
mod tests {
    use super::auto_splits;

    #[test]
    fn auto_splits_fill_the_last_wave() {
        // The peer shapes on 132 SMs with 2 blocks each (264 slots).
        assert_eq!(auto_splits(192, 264, 16, 16 * 1024 * 768 * 4), 4); // 768 blocks: 2.9 waves
        assert_eq!(auto_splits(80, 264, 32, 4 * 2048 * 2560 * 4), 3); // 240 blocks: 0.91 of a wave
        assert_eq!(auto_splits(32, 264, 16, 8 * 1024 * 128 * 4), 8); // 256 blocks
                                                                     // Capped by the key blocks and by the buffer bytes.
        assert_eq!(auto_splits(1, 264, 3, 1024), 3);
        assert_eq!(auto_splits(100, 264, 64, 200 << 20), 1);
        // Many pairs: one split already fills the waves.
        assert_eq!(auto_splits(5000, 264, 16, 1 << 20), 1);
    }
}
