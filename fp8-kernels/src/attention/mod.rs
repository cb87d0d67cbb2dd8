//! Causal self-attention: a fused flash-attention forward and backward in BF16 with F32 accumulation.
//!
//! The QKV linear writes `qkv [B, T, 3, H, hd]` (row-major BF16: a `[B*T, 3d]` matrix with q in columns
//! `h*hd..`, k in `d + h*hd..`, v in `2d + h*hd..`, `d = H*hd`), so no transpose is needed around the
//! kernels:
//!
//! - [`attention_forward`] reads `qkv` and writes `out [B, T, H, hd]` BF16 (the `[B*T, d]` input of the
//!   output projection) and `lse [B, H, T]` F32, the natural-log log-sum-exp of each row's scaled scores.
//!   No `T x T` matrix is ever stored: only `out` and `lse` are kept for the backward.
//! - [`attention_backward`] reads `qkv`, `out`, the output gradient `d_out [B, T, H, hd]` and `lse`, and
//!   writes `d_qkv [B, T, 3, H, hd]` BF16, the gradient of the QKV linear's output, using an
//!   [`AttentionWorkspace`] (F32 `D = rowsum(d_out * out)` per row and dQ accumulators).
//!
//! Scores are `scale * q . k` with `scale = 1/sqrt(hd)` unless [`AttentionConfig::softmax_scale`] says
//! otherwise; key `k` is visible to query `t` when `k <= t`. Head dims 32, 64 and 128; any `T >= 1`.
//!
//! Where it runs: the CPU ([`cpu`], the reference: plain attention in F32 from the BF16 inputs) or the
//! buffers' GPU, with one of two kernel families ([`AttentionKernel`]): tensor-core flash-attention
//! kernels (`Mma`, the default) or simple per-row kernels without tensor cores (`Simple`, a slow fallback
//! that tells a fragment-layout bug in the fast kernels from a problem elsewhere). The GPU backward is
//! deterministic by default (the same bits on every run, [`DqAccumulation`]). See `docs/attention.md`.

pub mod cpu;
mod cuda;

use crate::kernel_source::KernelModule;
use crate::{check_len, Buffer, Device, KernelError};
use half::bf16;
use rayon::prelude::*;

/// The CUDA module of the attention kernels for every head dim: `common.cuh` followed by `attention.cu`
/// (compile checks; the launches use [`attention_module`]).
pub const ATTENTION_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_attention",
    files: &["common.cuh", "attention.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("attention.cu")
    ),
};

macro_rules! attention_module_hd {
    ($hd:literal) => {
        KernelModule {
            name: concat!("fp8_kernels_attention_hd", $hd),
            files: &["common.cuh", "attention.cu"],
            source: concat!(
                "#define ATT_HD ",
                $hd,
                "\n",
                include_str!("../../cuda/common.cuh"),
                include_str!("attention.cu")
            ),
        }
    };
}

/// One module per head dim, each with that head dim's kernels only (and the shared `D`, dQ-convert and
/// probe kernels): a model compiles the one it uses, in a third of the time of [`ATTENTION_MODULE`].
pub const ATTENTION_MODULES_BY_HEAD_DIM: [KernelModule; 3] = [
    attention_module_hd!(32),
    attention_module_hd!(64),
    attention_module_hd!(128),
];

/// The module holding the kernels of `head_dim` (one of [`HEAD_DIMS`]; others get the full module).
pub fn attention_module(head_dim: usize) -> &'static KernelModule {
    match HEAD_DIMS.iter().position(|&h| h == head_dim) {
        Some(i) => &ATTENTION_MODULES_BY_HEAD_DIM[i],
        None => &ATTENTION_MODULE,
    }
}

/// The head dims the kernels are built for.
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Longest sequence accepted (the kernels index rows with 32-bit integers and grids with 16 bits of
/// query blocks; this is far inside both).
pub const MAX_SEQ_LEN: usize = 1 << 21;

/// The dimensions of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences in the batch, `B`.
    pub batch: usize,
    /// Attention heads, `H`.
    pub heads: usize,
    /// Tokens per sequence, `T`.
    pub seq_len: usize,
    /// Features per head, `hd` (32, 64 or 128).
    pub head_dim: usize,
}

impl AttentionShape {
    /// A shape `[B, T, H, hd]`.
    pub fn new(batch: usize, heads: usize, seq_len: usize, head_dim: usize) -> Self {
        AttentionShape {
            batch,
            heads,
            seq_len,
            head_dim,
        }
    }

    /// `d = H * hd`.
    pub fn model_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Elements of `qkv` and `d_qkv`: `B * T * 3 * H * hd`.
    pub fn qkv_len(&self) -> usize {
        3 * self.out_len()
    }

    /// Elements of `out` and `d_out`: `B * T * H * hd`.
    pub fn out_len(&self) -> usize {
        self.batch * self.seq_len * self.heads * self.head_dim
    }

    /// Elements of `lse`: `B * H * T`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.seq_len
    }

    /// Whether there is nothing to compute (a zero batch, head count or length).
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.heads == 0 || self.seq_len == 0
    }

    /// Floating-point operations of forward + backward as PyTorch's attention benchmarks count them for a
    /// causal mask: `3.5 * 4 * B * H * T^2 * hd / 2` (forward 2 matmuls, backward 2.5 times that, half the
    /// matrix under the mask).
    pub fn causal_flops_fwd_bwd(&self) -> f64 {
        3.5 * 4.0
            * (self.batch * self.heads) as f64
            * (self.seq_len as f64).powi(2)
            * self.head_dim as f64
            / 2.0
    }

    fn validate(&self, what: &'static str) -> Result<(), KernelError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(bad(
                what,
                format!("head dim {} is not one of {HEAD_DIMS:?}", self.head_dim),
            ));
        }
        if self.seq_len > MAX_SEQ_LEN {
            return Err(bad(
                what,
                format!("sequence length {} exceeds {MAX_SEQ_LEN}", self.seq_len),
            ));
        }
        let pairs = self.batch.checked_mul(self.heads);
        if pairs.is_none_or(|p| p > i32::MAX as usize) {
            return Err(bad(
                what,
                format!(
                    "batch {} x heads {} exceeds the 31-bit grid",
                    self.batch, self.heads
                ),
            ));
        }
        let total = self
            .batch
            .checked_mul(self.seq_len)
            .and_then(|v| v.checked_mul(3 * self.heads))
            .and_then(|v| v.checked_mul(self.head_dim))
            .and_then(|v| v.checked_mul(4));
        if total.is_none_or(|v| v > i64::MAX as usize) {
            return Err(bad(
                what,
                format!("shape {self:?} overflows the element count"),
            ));
        }
        Ok(())
    }
}

/// Which GPU kernels run (the CPU has one implementation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// FlashAttention-2 style tiles on tensor cores (`mma.sync` BF16, compute capability 8.0+).
    #[default]
    Mma,
    /// One block per row, F32 dot products, no tensor cores: slow, and simple enough to be obviously
    /// right. The diagnostic fallback.
    Simple,
}

/// How the tensor-core backward sums dQ over key blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DqAccumulation {
    /// Each block adds into its own F32 buffer in a fixed order; the buffers are summed in a fixed order.
    /// The same bits on every run.
    #[default]
    Deterministic,
    /// All key blocks of a head add into one F32 buffer with atomics, in whatever order they arrive:
    /// less workspace and memory traffic, results vary in the last bits from run to run.
    Atomic,
}

/// Tile choices of the tensor-core kernels (`None`: the default). Exposed so benchmarks can compare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionTiles {
    /// Query rows per forward block, 64 (4 warps) or 128 (8 warps). Default 64.
    pub forward_rows: Option<usize>,
    /// Query rows per backward iteration, 32 or 64. Default 64.
    pub backward_rows: Option<usize>,
    /// Deterministic backward: blocks per `(batch, head)` pair, each with its own dQ buffer (capped by
    /// the number of 64-key blocks). Default: the fewest (at most 8) whose last wave of blocks fills at
    /// least 90 % of the GPU's block slots, within 256 MiB of buffers.
    pub backward_splits: Option<usize>,
}

/// Options of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionConfig {
    /// The factor of `q . k` before the softmax; `None` is `1/sqrt(head_dim)`. Must be finite and > 0.
    pub softmax_scale: Option<f32>,
    /// GPU kernel family.
    pub kernel: AttentionKernel,
    /// GPU backward's dQ summation.
    pub dq_accumulation: DqAccumulation,
    /// Tensor-core tile choices.
    pub tiles: AttentionTiles,
}

/// A config with every default resolved and checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ResolvedConfig {
    pub scale: f32,
    pub kernel: AttentionKernel,
    pub dq_accumulation: DqAccumulation,
    pub forward_rows: usize,
    pub backward_rows: usize,
    pub backward_splits: Option<usize>,
}

impl AttentionConfig {
    /// The softmax scale used for `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    fn resolve(
        &self,
        shape: &AttentionShape,
        what: &'static str,
    ) -> Result<ResolvedConfig, KernelError> {
        let scale = self.scale_for(shape.head_dim);
        if !(scale.is_finite() && scale > 0.0) {
            return Err(bad(
                what,
                format!("softmax scale {scale} must be finite and positive"),
            ));
        }
        let forward_rows = self.tiles.forward_rows.unwrap_or(64);
        if forward_rows != 64 && forward_rows != 128 {
            return Err(bad(
                what,
                format!("forward_rows {forward_rows} is not 64 or 128"),
            ));
        }
        let backward_rows = self.tiles.backward_rows.unwrap_or(64);
        if backward_rows != 32 && backward_rows != 64 {
            return Err(bad(
                what,
                format!("backward_rows {backward_rows} is not 32 or 64"),
            ));
        }
        if self.tiles.backward_splits == Some(0) {
            return Err(bad(what, "backward_splits must be at least 1".into()));
        }
        if shape.seq_len.div_ceil(forward_rows.min(backward_rows)) > 65535 {
            return Err(bad(
                what,
                format!(
                    "sequence length {} needs more than 65535 query blocks",
                    shape.seq_len
                ),
            ));
        }
        Ok(ResolvedConfig {
            scale,
            kernel: self.kernel,
            dq_accumulation: self.dq_accumulation,
            forward_rows,
            backward_rows,
            backward_splits: self.tiles.backward_splits,
        })
    }
}

/// Reusable F32 scratch memory of [`attention_backward`] on one device; it grows to what a call needs
/// and is reallocated when used with buffers on another device.
#[derive(Debug, Default)]
pub struct AttentionWorkspace {
    d: Option<Buffer<f32>>,
    dq: Option<Buffer<f32>>,
}

impl AttentionWorkspace {
    /// An empty workspace (allocates on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.d.as_ref().map_or(0, Buffer::num_bytes) + self.dq.as_ref().map_or(0, Buffer::num_bytes)
    }

    fn ensure(
        slot: &mut Option<Buffer<f32>>,
        device: &Device,
        len: usize,
    ) -> Result<(), KernelError> {
        let fits = slot
            .as_ref()
            .is_some_and(|b| b.len() >= len && b.device() == *device);
        if !fits {
            *slot = None; // free first: the old buffer may be large
            *slot = Some(device.zeros::<f32>(len.max(1))?);
        }
        Ok(())
    }
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

fn same_device<T: crate::Element>(
    what: &'static str,
    device: &Device,
    b: &Buffer<T>,
) -> Result<(), KernelError> {
    if b.device() == *device {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.par_iter().map(|x| x.to_f32()).collect()
}

fn store_bf16(dst: &mut [bf16], src: &[f32]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .for_each(|(d, &s)| *d = bf16::from_f32(s));
}

/// Forward attention: `out = softmax(scale * q k^T, causal) v` per head, and `lse` (see the module doc for
/// the layouts). Runs where the buffers live; errors on lengths that do not match `shape`, buffers on
/// different devices, an unsupported head dim or tile choice, or a bad scale.
pub fn attention_forward(
    shape: &AttentionShape,
    config: &AttentionConfig,
    qkv: &Buffer<bf16>,
    out: &mut Buffer<bf16>,
    lse: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "attention_forward";
    shape.validate(WHAT)?;
    let cfg = config.resolve(shape, WHAT)?;
    check_len(WHAT, shape.qkv_len(), qkv.len())?;
    check_len(WHAT, shape.out_len(), out.len())?;
    check_len(WHAT, shape.lse_len(), lse.len())?;
    let device = qkv.device();
    same_device(WHAT, &device, out)?;
    same_device(WHAT, &device, lse)?;
    if shape.is_empty() {
        return Ok(());
    }
    match &device {
        Device::Cpu => {
            let x = to_f32(qkv.host(WHAT)?);
            let mut o = vec![0.0f32; shape.out_len()];
            cpu::forward(shape, cfg.scale, &x, &mut o, lse.host_mut(WHAT)?);
            store_bf16(out.host_mut(WHAT)?, &o);
            Ok(())
        }
        Device::Cuda(dev) => {
            let q = qkv.as_cuda().ok_or(KernelError::WrongDevice(WHAT))?.0;
            let o = out.as_cuda_mut().ok_or(KernelError::WrongDevice(WHAT))?.0;
            let l = lse.as_cuda_mut().ok_or(KernelError::WrongDevice(WHAT))?.0;
            cuda::forward(dev, shape, &cfg, q, o, l)
        }
    }
}

/// Backward attention: `d_qkv` (dq, dk, dv in the slots of q, k, v) from `qkv`, the forward's `out` and
/// `lse`, and the output gradient `d_out`. `workspace` grows to what the call needs on the buffers'
/// device. Errors as [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    shape: &AttentionShape,
    config: &AttentionConfig,
    qkv: &Buffer<bf16>,
    out: &Buffer<bf16>,
    d_out: &Buffer<bf16>,
    lse: &Buffer<f32>,
    d_qkv: &mut Buffer<bf16>,
    workspace: &mut AttentionWorkspace,
) -> Result<(), KernelError> {
    const WHAT: &str = "attention_backward";
    shape.validate(WHAT)?;
    let cfg = config.resolve(shape, WHAT)?;
    check_len(WHAT, shape.qkv_len(), qkv.len())?;
    check_len(WHAT, shape.out_len(), out.len())?;
    check_len(WHAT, shape.out_len(), d_out.len())?;
    check_len(WHAT, shape.lse_len(), lse.len())?;
    check_len(WHAT, shape.qkv_len(), d_qkv.len())?;
    let device = qkv.device();
    for b in [out, d_out] {
        same_device(WHAT, &device, b)?;
    }
    same_device(WHAT, &device, lse)?;
    same_device(WHAT, &device, d_qkv)?;
    if shape.is_empty() {
        return Ok(());
    }
    match &device {
        Device::Cpu => {
            let x = to_f32(qkv.host(WHAT)?);
            let dy = to_f32(d_out.host(WHAT)?);
            let mut dx = vec![0.0f32; shape.qkv_len()];
            cpu::backward(shape, cfg.scale, &x, &dy, &mut dx);
            store_bf16(d_qkv.host_mut(WHAT)?, &dx);
            Ok(())
        }
        Device::Cuda(dev) => {
            let (d_len, dq_len) = cuda::workspace_lens(dev, shape, &cfg)?;
            AttentionWorkspace::ensure(&mut workspace.d, &device, d_len)?;
            if dq_len > 0 {
                AttentionWorkspace::ensure(&mut workspace.dq, &device, dq_len)?;
            }
            let wrong = || KernelError::WrongDevice(WHAT);
            let d_ws = workspace
                .d
                .as_mut()
                .and_then(|b| b.as_cuda_mut())
                .ok_or_else(wrong)?
                .0;
            let dq_ws = match dq_len {
                0 => None,
                _ => Some(
                    workspace
                        .dq
                        .as_mut()
                        .and_then(|b| b.as_cuda_mut())
                        .ok_or_else(wrong)?
                        .0,
                ),
            };
            cuda::backward(
                dev,
                shape,
                &cfg,
                qkv.as_cuda().ok_or_else(wrong)?.0,
                out.as_cuda().ok_or_else(wrong)?.0,
                d_out.as_cuda().ok_or_else(wrong)?.0,
                lse.as_cuda().ok_or_else(wrong)?.0,
                d_qkv.as_cuda_mut().ok_or_else(wrong)?.0,
                d_ws,
                dq_ws,
            )
        }
    }
}

/// `(blocks per (batch, head) pair, dQ buffers)` the tensor-core backward would use for this call on
/// `device` (for benchmarks and docs; `(0, 0)` on the CPU or with the simple kernels).
pub fn backward_splits(
    device: &Device,
    shape: &AttentionShape,
    config: &AttentionConfig,
) -> Result<(usize, usize), KernelError> {
    const WHAT: &str = "attention backward_splits";
    shape.validate(WHAT)?;
    let cfg = config.resolve(shape, WHAT)?;
    match (device, cfg.kernel) {
        (Device::Cuda(dev), AttentionKernel::Mma) => {
            let plan = cuda::backward_plan(dev, shape, &cfg)?;
            Ok((plan.splits, plan.buffers))
        }
        _ => Ok((0, 0)),
    }
}

/// The building blocks of the tensor-core kernels, each run alone on one 64 x 64 tile by
/// [`run_layout_probe`] (a diagnostic for the GPU tests: a wrong fragment mapping shows up here as a
/// wrong small matrix product instead of a wrong attention output).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutProbe {
    /// `a b^T`: `ldmatrix` A fragments, non-transposed B fragments, `mma`, the C layout (Q K^T).
    ABt,
    /// `bf16(p) b` with `p` entering as C fragments: C-to-A reuse and `ldmatrix.trans` B fragments (P V).
    PB,
    /// `a^T b`: a C fragment stored to shared memory as BF16, `ldmatrix.trans` A fragments of its
    /// transpose, and `ldmatrix.trans` B fragments in two 32-column halves (dQ = dS K).
    AtB,
}

/// Runs `probe` on the GPU with row-major 64 x 64 inputs `a` (F32; rounded to BF16 except for
/// [`LayoutProbe::PB`], where the kernel rounds it as the attention kernels round P) and `b` (BF16), and
/// returns the 64 x 64 F32 result.
pub fn run_layout_probe(
    device: &Device,
    probe: LayoutProbe,
    a: &[f32],
    b: &[bf16],
) -> Result<Vec<f32>, KernelError> {
    const WHAT: &str = "run_layout_probe";
    check_len(WHAT, 64 * 64, a.len())?;
    check_len(WHAT, 64 * 64, b.len())?;
    cuda::layout_probe(device.as_cuda(WHAT)?, probe, a, b)
}
