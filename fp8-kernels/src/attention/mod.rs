//! Causal self-attention: a fused flash-attention forward and backward in BF16 with F32 accumulation.
//!
//! The QKV linear writes `qkv [B, T, (H + 2*KV) * hd]` (row-major BF16: a `[B*T, (H + 2*KV)*hd]` matrix
//! with query head `h` in columns `h*hd..`, key head `j` in `H*hd + j*hd..`, value head `j` in
//! `(H + KV)*hd + j*hd..`), so no transpose is needed around the kernels. `KV` key/value heads serve `H`
//! query heads (grouped-query attention, [`AttentionShape::gqa`]): query head `h` reads key/value head
//! `h / (H / KV)`. With `KV = H` (multi-head attention, [`AttentionShape::new`]) the layout is
//! `[B, T, 3, H, hd]`.
//!
//! - [`attention_forward`] reads `qkv` and writes `out [B, T, H, hd]` BF16 (the `[B*T, d]` input of the
//!   output projection) and `lse [B, H, T]` F32, the natural-log log-sum-exp of each row's scaled scores.
//!   No `T x T` matrix is ever stored: only `out` and `lse` are kept for the backward.
//! - [`attention_backward`] reads `qkv`, `out`, the output gradient `d_out [B, T, H, hd]` and `lse`, and
//!   writes `d_qkv` (the layout of `qkv`) BF16, the gradient of the QKV linear's output, using an
//!   [`AttentionWorkspace`] (F32 `D = rowsum(d_out * out)` per row and dQ accumulators). dK and dV of a
//!   key/value head sum over the query heads of its group, in a fixed order (deterministic).
//!
//! Scores are `scale * q . k` with `scale = 1/sqrt(hd)` unless [`AttentionConfig::softmax_scale`] says
//! otherwise; key `k` is visible to query `t` when `k <= t`. Head dims 32, 64 and 128; any `T >= 1`.
//!
//! Where it runs: the CPU ([`cpu`], the reference: plain attention in F32 from the BF16 inputs) or the
//! buffers' GPU, with one of the kernel families of [`AttentionKernel`]: tensor-core flash-attention
//! kernels on `mma.sync` (`Mma`), the forward and backward on Hopper's warpgroup MMA (`Wgmma`, sm_90a
//! only, head dims 64 and 128), `Auto` (the default: `Wgmma` where the GPU and head dim allow, else
//! `Mma`), or simple per-row kernels without tensor cores (`Simple`, a slow fallback that tells a
//! fragment-layout bug in the fast kernels from a problem elsewhere). The GPU backward is deterministic by
//! default (the same bits on every run, [`DqAccumulation`]). See `docs/attention.md`.

pub mod cpu;
mod cuda;
mod tiles;

pub use tiles::{
    backward_variants, default_tiles, default_wgmma_backward_tiles, default_wgmma_tiles,
    dkdv_variants, dq_variants, forward_variants, is_backward_variant, kv_ws_stages,
    wgmma_backward_variants, wgmma_dq_variants, wgmma_forward_variants, wgmma_kv_variants,
    BackwardKernels, KeyTiles, QueryTiles, TileDefaults, WgmmaBackwardTiles, WgmmaTiles,
    DEFAULT_TILES, FUSED_QUERY_ROWS, WGMMA_HEAD_DIMS, WS_STAGES,
};

use crate::device::device_of;
use crate::kernel_source::{KernelModule, ModuleArch};
use crate::{check_len, Buffer, Device, KernelError};
use half::bf16;
use rayon::prelude::*;

macro_rules! attention_source {
    ($($prefix:expr),*) => {
        concat!(
            $($prefix,)*
            include_str!("../../cuda/common.cuh"),
            include_str!("attention_mma.cuh"),
            include_str!("attention_rows.cu"),
            include_str!("attention.cu"),
            include_str!("attention_separate.cu")
        )
    };
}

/// The CUDA module of every attention kernel, all head dims and families: `common.cuh`,
/// `attention_mma.cuh`, `attention.cu` and `attention_separate.cu` (compile checks; the launches use
/// [`kernel_module`] and [`attention_module`]).
pub const ATTENTION_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_attention",
    files: &[
        "common.cuh",
        "attention_mma.cuh",
        "attention_rows.cu",
        "attention.cu",
        "attention_separate.cu",
    ],
    source: attention_source!(),
    arch: ModuleArch::Portable,
};

/// The module of the forward on Hopper's warpgroup MMA ([`AttentionKernel::Wgmma`]): every
/// [`wgmma_forward_variants`] kernel of both head dims and the wgmma layout probes
/// ([`run_wgmma_probe`]), built for `sm_90a` only (`common.cuh`, `attention_mma.cuh`,
/// `attention_wgmma.cu`). The launches of the forward use single-kernel modules ([`kernel_module`]).
pub const ATTENTION_WGMMA_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_attention_wgmma",
    files: &[
        "common.cuh",
        "attention_mma.cuh",
        "attention_rows.cu",
        "attention_wgmma.cu",
    ],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("attention_mma.cuh"),
        include_str!("attention_rows.cu"),
        include_str!("attention_wgmma.cu")
    ),
    arch: ModuleArch::Sm90a,
};

/// A group of attention kernels compiled together: one NVRTC module per head dim and family (the simple
/// kernels and the probes are launched from these; the tensor-core kernels from single-kernel modules,
/// [`kernel_module`], and the family modules serve compile checks). Every backward family also holds the
/// small `D` and dQ-conversion kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFamily {
    /// The tensor-core forward kernels (every [`QueryTiles`] variant of [`forward_variants`]).
    Forward,
    /// The fused tensor-core backward ([`BackwardKernels::Fused`]).
    FusedBackward,
    /// The separate dK/dV and dQ kernels ([`BackwardKernels::Separate`]).
    SeparateBackward,
    /// The simple kernels ([`AttentionKernel::Simple`]).
    Simple,
    /// The layout probes ([`run_layout_probe`]; head dim 64, one module for every head dim).
    Probes,
}

impl KernelFamily {
    /// Every family.
    pub const ALL: [KernelFamily; 5] = [
        KernelFamily::Forward,
        KernelFamily::FusedBackward,
        KernelFamily::SeparateBackward,
        KernelFamily::Simple,
        KernelFamily::Probes,
    ];

    fn index(self) -> usize {
        match self {
            KernelFamily::Forward => 0,
            KernelFamily::FusedBackward => 1,
            KernelFamily::SeparateBackward => 2,
            KernelFamily::Simple => 3,
            KernelFamily::Probes => 4,
        }
    }
}

// `ATT_FAMILY` numbers as in attention.cu (ATT_FAM_*).
macro_rules! attention_module_of {
    ($hd:literal, $fam:literal, $name:literal) => {
        KernelModule {
            name: concat!("fp8_kernels_attention_hd", $hd, "_", $name),
            files: ATTENTION_MODULE.files,
            source: attention_source!("#define ATT_HD ", $hd, "\n#define ATT_FAMILY ", $fam, "\n"),
            arch: ModuleArch::Portable,
        }
    };
}

macro_rules! attention_modules_hd {
    ($hd:literal) => {
        [
            attention_module_of!($hd, 1, "forward"),
            attention_module_of!($hd, 2, "fused_backward"),
            attention_module_of!($hd, 3, "separate_backward"),
            attention_module_of!($hd, 4, "simple"),
        ]
    };
}

/// The per-head-dim modules, `[head dim index][family]` (families in the order of [`KernelFamily::ALL`],
/// without the probes).
const ATTENTION_MODULES: [[KernelModule; 4]; 3] = [
    attention_modules_hd!(32),
    attention_modules_hd!(64),
    attention_modules_hd!(128),
];

/// The module of the layout probes.
const PROBE_MODULE: KernelModule = attention_module_of!(64, 5, "probes");

/// The module holding `family`'s kernels for `head_dim` (one of [`HEAD_DIMS`]; others get the module of
/// every kernel, [`ATTENTION_MODULE`]).
pub fn attention_module(head_dim: usize, family: KernelFamily) -> &'static KernelModule {
    if family == KernelFamily::Probes {
        return &PROBE_MODULE;
    }
    match HEAD_DIMS.iter().position(|&h| h == head_dim) {
        Some(i) => &ATTENTION_MODULES[i][family.index()],
        None => &ATTENTION_MODULE,
    }
}

/// One tensor-core kernel: a forward (mma.sync or wgmma), fused backward, dK/dV or dQ variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKernel {
    /// A forward variant.
    Forward(QueryTiles),
    /// The fused backward with `query_rows` query rows per block.
    Fused {
        /// 32 or 64.
        query_rows: usize,
    },
    /// A dK/dV kernel of the separate backward.
    DkDv(KeyTiles),
    /// A dQ kernel of the separate backward.
    Dq(QueryTiles),
    /// A forward variant on Hopper's warpgroup MMA (its module is built for sm_90a).
    WgmmaForward(WgmmaTiles),
    /// The fused backward on Hopper's warpgroup MMA (sm_90a; the fused backward's contract and
    /// workspace; the atomic wgmma backward).
    WgmmaFused,
    /// The dK/dV kernel of the deterministic wgmma backward, with this many warpgroups of 64 keys.
    WgmmaDkDv {
        /// 1 or 2.
        warpgroups: usize,
        /// Warp-specialised (a producer warpgroup loading by TMA; 2 warpgroups).
        specialized: bool,
    },
    /// The dQ kernel of the deterministic wgmma backward.
    WgmmaDq(WgmmaTiles),
    /// The fused deterministic wgmma backward ([`WgmmaBackwardTiles::ORDERED`]): dK, dV and dQ in one
    /// kernel, dQ reduced tile by tile in key-block order; with `dq_columns` each consumer warpgroup
    /// computes half of dQ's columns over all the block's keys ([`WgmmaBackwardTiles::ORDERED_COLUMNS`],
    /// head dim 128), else its keys' part of every column.
    WgmmaOrdered {
        /// dQ's columns split between the consumer warpgroups.
        dq_columns: bool,
    },
}

impl TensorKernel {
    /// The kernel's entry point for `head_dim` (`attn_fwd_w4m2n64_hd64`, ...).
    pub fn name(&self, head_dim: usize) -> String {
        match self {
            TensorKernel::Forward(t) => format!("attn_fwd_{t}_hd{head_dim}"),
            TensorKernel::Fused { query_rows } => {
                format!("attn_bwd_fused_q{query_rows}_hd{head_dim}")
            }
            TensorKernel::DkDv(t) => format!("attn_bwd_dkdv_{t}_hd{head_dim}"),
            TensorKernel::Dq(t) => format!("attn_bwd_dq_{t}_hd{head_dim}"),
            TensorKernel::WgmmaForward(t) => format!("attn_fwd_wgmma_{t}_hd{head_dim}"),
            TensorKernel::WgmmaFused => format!("attn_bwd_wgmma_fused_hd{head_dim}"),
            TensorKernel::WgmmaDkDv {
                warpgroups,
                specialized,
            } => {
                let w = if *specialized { "w" } else { "" };
                format!("attn_bwd_wgmma_kv_g{warpgroups}{w}_hd{head_dim}")
            }
            TensorKernel::WgmmaDq(t) => format!("attn_bwd_wgmma_q_{t}_hd{head_dim}"),
            TensorKernel::WgmmaOrdered { dq_columns } => {
                let cols = if *dq_columns { "_cols" } else { "" };
                format!("attn_bwd_wgmma_ordered{cols}_hd{head_dim}")
            }
        }
    }

    /// `ATT_ONLY_KIND`, `_A`, `_B`, `_C` of attention.cu (kind 6: attention_wgmma.cu).
    fn selector(&self) -> [usize; 4] {
        match *self {
            TensorKernel::Forward(t) => [1, t.warps, t.row_tiles, t.key_rows],
            TensorKernel::Fused { query_rows } => [2, query_rows, 0, 0],
            TensorKernel::DkDv(t) if t.paired => [4, t.warps / 2, t.query_rows, 0],
            TensorKernel::DkDv(t) => [3, t.warps, t.key_tiles, t.query_rows],
            TensorKernel::Dq(t) => [5, t.warps, t.row_tiles, t.key_rows],
            TensorKernel::WgmmaForward(t) => [6, t.warpgroups, t.key_rows, t.schedule_selector()],
            TensorKernel::WgmmaFused => [7, 0, 0, 0],
            TensorKernel::WgmmaDkDv {
                warpgroups,
                specialized,
            } => [8, warpgroups, 0, if specialized { 2 } else { 0 }],
            TensorKernel::WgmmaDq(t) => [9, t.warpgroups, t.key_rows, t.schedule_selector()],
            TensorKernel::WgmmaOrdered { dq_columns } => [10, usize::from(dq_columns), 0, 0],
        }
    }
}

/// The module holding `kernel` for `head_dim` alone (and the small `D` and dQ-conversion kernels), built
/// from the full source with `ATT_HD` and `ATT_ONLY_*` defined: NVRTC then instantiates that one kernel,
/// about a second of start-up where a module of every variant of a family takes several. Made on the
/// first request and kept for the process (a few per process; the caller checks that `kernel` is a
/// compiled variant for `head_dim`). A module of a wgmma kernel (`TensorKernel::Wgmma*`) is built from
/// [`ATTENTION_WGMMA_MODULE`]'s source, for sm_90a, and holds that kernel only (and the `D` and
/// dQ-conversion kernels).
pub fn kernel_module(head_dim: usize, kernel: TensorKernel) -> &'static KernelModule {
    &single_kernel_module(head_dim, kernel).module
}

/// [`kernel_module`] and the kernel's entry-point name ([`TensorKernel::name`]), both built once per
/// process, so a launch builds no string.
pub(crate) fn kernel_entry(
    head_dim: usize,
    kernel: TensorKernel,
) -> (&'static KernelModule, &'static str) {
    let m = single_kernel_module(head_dim, kernel);
    (&m.module, m.entry)
}

/// A module of one tensor-core kernel and that kernel's entry point.
struct SingleKernelModule {
    module: KernelModule,
    entry: &'static str,
}

fn single_kernel_module(head_dim: usize, kernel: TensorKernel) -> &'static SingleKernelModule {
    use std::collections::HashMap;
    use std::sync::{OnceLock, PoisonError, RwLock};
    type Modules = RwLock<HashMap<(usize, TensorKernel), &'static SingleKernelModule>>;
    static MODULES: OnceLock<Modules> = OnceLock::new();
    let modules = MODULES.get_or_init(Default::default);
    // The map is valid after any panic elsewhere (an insert either happened or not).
    if let Some(m) = modules
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&(head_dim, kernel))
    {
        return m;
    }
    let mut map = modules.write().unwrap_or_else(PoisonError::into_inner);
    map.entry((head_dim, kernel)).or_insert_with(|| {
        let [kind, a, b, c] = kernel.selector();
        let base = match kernel {
            TensorKernel::WgmmaForward(_)
            | TensorKernel::WgmmaFused
            | TensorKernel::WgmmaDkDv { .. }
            | TensorKernel::WgmmaDq(_)
            | TensorKernel::WgmmaOrdered { .. } => &ATTENTION_WGMMA_MODULE,
            _ => &ATTENTION_MODULE,
        };
        let entry: &'static str = Box::leak(kernel.name(head_dim).into_boxed_str());
        let name: &'static str = Box::leak(format!("fp8_kernels_{entry}").into_boxed_str());
        let source: &'static str = Box::leak(
            format!(
                "#define ATT_HD {head_dim}\n#define ATT_ONLY_KIND {kind}\n#define ATT_ONLY_A {a}\n\
                 #define ATT_ONLY_B {b}\n#define ATT_ONLY_C {c}\n{}",
                base.source
            )
            .into_boxed_str(),
        );
        Box::leak(Box::new(SingleKernelModule {
            module: KernelModule {
                name,
                files: base.files,
                source,
                arch: base.arch,
            },
            entry,
        }))
    })
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
    /// Attention (query) heads, `H`.
    pub heads: usize,
    /// Key/value heads, `KV` (divides `H`; `KV = H` is multi-head attention, fewer is grouped-query
    /// attention: query head `h` reads key/value head `h / (H / KV)`).
    pub kv_heads: usize,
    /// Tokens per sequence, `T`.
    pub seq_len: usize,
    /// Features per head, `hd` (32, 64 or 128).
    pub head_dim: usize,
}

impl AttentionShape {
    /// A multi-head shape `[B, T, H, hd]` (`kv_heads = heads`).
    pub fn new(batch: usize, heads: usize, seq_len: usize, head_dim: usize) -> Self {
        Self::gqa(batch, heads, heads, seq_len, head_dim)
    }

    /// A grouped-query shape: `heads` query heads sharing `kv_heads` key/value heads (`kv_heads` must
    /// divide `heads`; checked by the kernels' validation).
    pub fn gqa(
        batch: usize,
        heads: usize,
        kv_heads: usize,
        seq_len: usize,
        head_dim: usize,
    ) -> Self {
        AttentionShape {
            batch,
            heads,
            kv_heads,
            seq_len,
            head_dim,
        }
    }

    /// Query heads per key/value head, `H / KV` (1 for multi-head attention; 0 for an invalid
    /// `kv_heads` of 0).
    pub fn group(&self) -> usize {
        self.heads.checked_div(self.kv_heads).unwrap_or(0)
    }

    /// Columns of one token's row of `qkv`: `(H + 2 * KV) * hd`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// `d = H * hd`.
    pub fn model_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Elements of `qkv` and `d_qkv`: `B * T * (H + 2 * KV) * hd`.
    pub fn qkv_len(&self) -> usize {
        self.batch * self.seq_len * self.qkv_width()
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
        // A shape without heads (MHA with H = KV = 0) is empty, as before grouped-query attention.
        let no_heads = self.heads == 0 && self.kv_heads == 0;
        if !no_heads && (self.kv_heads == 0 || self.heads % self.kv_heads != 0) {
            return Err(bad(
                what,
                format!(
                    "kv_heads {} must be at least 1 and divide heads {}",
                    self.kv_heads, self.heads
                ),
            ));
        }
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
            .and_then(|v| v.checked_mul(self.heads + 2 * self.kv_heads))
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
    /// The default: on compute capability 9.0 (H100, H200) with head dim 64 or 128, the kernels of
    /// [`AttentionKernel::Wgmma`] (the forward where the forward tiles are the default, the backward
    /// where [`AttentionTiles::backward`] is `None`); otherwise `Mma`'s.
    #[default]
    Auto,
    /// FlashAttention-2 style tiles on tensor cores (`mma.sync` BF16, compute capability 8.0+).
    Mma,
    /// One block per row, F32 dot products, no tensor cores: slow, and simple enough to be obviously
    /// right. The diagnostic fallback.
    Simple,
    /// Hopper's warpgroup MMA (`wgmma.mma_async`, FlashAttention-3's instruction; kernels built for
    /// sm_90a, so compute capability 9.0 only: H100, H200); head dims 64 and 128. The forward with tiles
    /// from [`AttentionTiles::wgmma_forward`]; the backward (one warpgroup per 64 keys, the fused
    /// backward's dQ accumulation in either [`DqAccumulation`] mode) unless [`AttentionTiles::backward`]
    /// names an `Mma` backward. Checked against the CPU (`attention_cuda`'s `wgmma_*` tests); what
    /// [`AttentionKernel::Auto`] runs on Hopper.
    Wgmma,
}

/// How the tensor-core backward sums dQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DqAccumulation {
    /// The same bits on every run: the separate dK/dV and dQ kernels (each output element written once
    /// by one thread; on `mma.sync`, or the wgmma pair of [`AttentionTiles::wgmma_backward`] on Hopper),
    /// or the `mma.sync` fused kernel with one F32 dQ buffer per split, each added in a fixed order and
    /// the buffers summed in a fixed order ([`BackwardKernels`], per head dim [`DEFAULT_TILES`]).
    #[default]
    Deterministic,
    /// A fused kernel (`mma.sync`, or the wgmma one on Hopper), all key blocks of a head adding into one
    /// F32 buffer with atomics in whatever order they arrive (FlashAttention-2's default): results vary
    /// in the last bits from run to run. Selects the fused kernel unless [`AttentionTiles::backward`]
    /// names the separate ones (which are deterministic anyway).
    Atomic,
}

/// Tile choices of the tensor-core kernels; `None` takes the head dim's entry of [`DEFAULT_TILES`].
/// Exposed so benchmarks can compare the compiled variants ([`forward_variants`],
/// [`backward_variants`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionTiles {
    /// Forward tiles: one of [`forward_variants`] for the head dim.
    pub forward: Option<QueryTiles>,
    /// Backward kernels and tiles: one of [`backward_variants`] for the head dim. `None`: the default
    /// of the [`DqAccumulation`] mode, or the wgmma backward where [`AttentionKernel::Wgmma`] or
    /// [`AttentionKernel::Auto`] on Hopper runs it.
    pub backward: Option<BackwardKernels>,
    /// Fused deterministic backward only: blocks per `(batch, head)` pair, each with its own dQ buffer
    /// (capped by the number of 64-key blocks). Default: the fewest (at most 8) whose last wave of
    /// blocks fills at least 90 % of the GPU's block slots, within 256 MiB of buffers.
    pub backward_splits: Option<usize>,
    /// Forward tiles of [`AttentionKernel::Wgmma`]: one of [`wgmma_forward_variants`] for the head dim;
    /// `None` is [`default_wgmma_tiles`]. Ignored by the other kernel families.
    pub wgmma_forward: Option<WgmmaTiles>,
    /// Kernels of the deterministic wgmma backward: one of [`wgmma_backward_variants`] for the head dim;
    /// `None` is [`default_wgmma_backward_tiles`]. Ignored by the other kernel families and by the
    /// atomic wgmma backward (one fused kernel).
    pub wgmma_backward: Option<WgmmaBackwardTiles>,
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
    pub forward: QueryTiles,
    pub backward: BackwardKernels,
    pub backward_splits: Option<usize>,
    /// The wgmma forward's tiles, with [`AttentionKernel::Wgmma`], and with [`AttentionKernel::Auto`]
    /// where it may take the wgmma forward (the GPU decides: compute capability 9.0).
    pub wgmma_forward: Option<WgmmaTiles>,
    /// The deterministic wgmma backward's kernels where the backward is the wgmma one (with
    /// [`AttentionKernel::Auto`]: where the GPU has compute capability 9.0; the atomic mode runs the
    /// fused wgmma kernel instead).
    pub wgmma_backward: Option<WgmmaBackwardTiles>,
}

impl AttentionConfig {
    /// The softmax scale used for `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    /// The forward tiles and backward kernels this config runs with for `head_dim` (the defaults
    /// resolved), or an error if a choice is not compiled for that head dim.
    pub fn kernels_for(
        &self,
        head_dim: usize,
    ) -> Result<(QueryTiles, BackwardKernels), KernelError> {
        const WHAT: &str = "AttentionConfig::kernels_for";
        let defaults = default_tiles(head_dim).ok_or_else(|| {
            bad(
                WHAT,
                format!("head dim {head_dim} is not one of {HEAD_DIMS:?}"),
            )
        })?;
        let forward = self.tiles.forward.unwrap_or(defaults.forward);
        if !forward_variants(head_dim).contains(&forward) {
            return Err(bad(
                WHAT,
                format!(
                    "forward tiles {forward} are not compiled for head dim {head_dim} (compiled: {})",
                    list(forward_variants(head_dim))
                ),
            ));
        }
        let backward = self.tiles.backward.unwrap_or(match self.dq_accumulation {
            DqAccumulation::Deterministic => defaults.deterministic,
            DqAccumulation::Atomic => BackwardKernels::Fused {
                query_rows: defaults.atomic_query_rows,
            },
        });
        if !is_backward_variant(head_dim, &backward) {
            return Err(bad(
                WHAT,
                format!(
                    "backward {backward} is not compiled for head dim {head_dim} (fused query rows \
                     {FUSED_QUERY_ROWS:?}; dK/dV tiles {}; dQ tiles {})",
                    list(dkdv_variants(head_dim)),
                    list(dq_variants(head_dim))
                ),
            ));
        }
        Ok((forward, backward))
    }

    /// The wgmma forward tiles this config runs with for `head_dim` under [`AttentionKernel::Wgmma`]
    /// (the default resolved), or an error for a head dim or tiles the wgmma forward is not compiled for.
    pub fn wgmma_tiles_for(&self, head_dim: usize) -> Result<WgmmaTiles, KernelError> {
        const WHAT: &str = "AttentionConfig::wgmma_tiles_for";
        let tiles = self
            .tiles
            .wgmma_forward
            .or_else(|| default_wgmma_tiles(head_dim))
            .ok_or_else(|| {
                bad(
                    WHAT,
                    format!(
                        "the wgmma forward supports head dims {WGMMA_HEAD_DIMS:?}, not {head_dim}"
                    ),
                )
            })?;
        if !wgmma_forward_variants(head_dim).contains(&tiles) {
            return Err(bad(
                WHAT,
                format!(
                    "wgmma forward tiles {tiles} are not compiled for head dim {head_dim} (compiled: {})",
                    list(wgmma_forward_variants(head_dim))
                ),
            ));
        }
        Ok(tiles)
    }

    /// The deterministic wgmma backward's kernels this config runs with for `head_dim` (the default
    /// resolved), or an error for a head dim or tiles the wgmma backward is not compiled for.
    pub fn wgmma_backward_tiles_for(
        &self,
        head_dim: usize,
    ) -> Result<WgmmaBackwardTiles, KernelError> {
        const WHAT: &str = "AttentionConfig::wgmma_backward_tiles_for";
        let tiles = self
            .tiles
            .wgmma_backward
            .or_else(|| default_wgmma_backward_tiles(head_dim))
            .ok_or_else(|| {
                bad(
                    WHAT,
                    format!(
                        "the wgmma backward supports head dims {WGMMA_HEAD_DIMS:?}, not {head_dim}"
                    ),
                )
            })?;
        if !wgmma_backward_variants(head_dim).contains(&tiles) {
            return Err(bad(
                WHAT,
                format!(
                    "wgmma backward tiles {tiles} are not compiled for head dim {head_dim} \
                     (compiled: {})",
                    list(&wgmma_backward_variants(head_dim))
                ),
            ));
        }
        Ok(tiles)
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
        let (forward, backward) = self.kernels_for(shape.head_dim).map_err(|e| match e {
            KernelError::InvalidArgument { detail, .. } => bad(what, detail),
            other => other,
        })?;
        let wgmma_forward = match self.kernel {
            AttentionKernel::Wgmma => {
                Some(self.wgmma_tiles_for(shape.head_dim).map_err(|e| match e {
                    KernelError::InvalidArgument { detail, .. } => bad(what, detail),
                    other => other,
                })?)
            }
            // Default forward tiles and a head dim the wgmma forward has: Hopper takes it.
            AttentionKernel::Auto if self.tiles.forward.is_none() => self
                .tiles
                .wgmma_forward
                .or_else(|| default_wgmma_tiles(shape.head_dim))
                .filter(|t| wgmma_forward_variants(shape.head_dim).contains(t)),
            AttentionKernel::Auto | AttentionKernel::Mma | AttentionKernel::Simple => None,
        };
        let wgmma_backward = match self.kernel {
            AttentionKernel::Wgmma | AttentionKernel::Auto if self.tiles.backward.is_none() => {
                match self.wgmma_backward_tiles_for(shape.head_dim) {
                    Ok(t) => Some(t),
                    // Auto falls back to the mma.sync backward where the wgmma one does not exist.
                    Err(_)
                        if self.kernel == AttentionKernel::Auto
                            && !WGMMA_HEAD_DIMS.contains(&shape.head_dim) =>
                    {
                        None
                    }
                    Err(KernelError::InvalidArgument { detail, .. }) => {
                        return Err(bad(what, detail))
                    }
                    Err(other) => return Err(other),
                }
            }
            AttentionKernel::Wgmma
            | AttentionKernel::Auto
            | AttentionKernel::Mma
            | AttentionKernel::Simple => None,
        };
        if self.tiles.backward_splits == Some(0) {
            return Err(bad(what, "backward_splits must be at least 1".into()));
        }
        // Every grid's y dimension counts blocks of at least 64 rows (forward, dQ, dK/dV) or splits of
        // 64-key blocks (fused): far inside 65535 for MAX_SEQ_LEN, checked in case either changes.
        if shape.seq_len.div_ceil(64) > 65535 {
            return Err(bad(
                what,
                format!(
                    "sequence length {} needs more than 65535 blocks of 64 rows",
                    shape.seq_len
                ),
            ));
        }
        Ok(ResolvedConfig {
            scale,
            kernel: self.kernel,
            dq_accumulation: self.dq_accumulation,
            forward,
            backward,
            backward_splits: self.tiles.backward_splits,
            wgmma_forward,
            wgmma_backward,
        })
    }
}

fn list<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ")
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
    device_of(WHAT, &[qkv, out, lse])?;
    let device = qkv.device();
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
    device_of(WHAT, &[qkv, out, d_out, lse, d_qkv])?;
    let device = qkv.device();
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

/// `(blocks per (batch, head) pair, dQ buffers)` the fused tensor-core backward (or the wgmma backward)
/// would use for this call on `device` (for benchmarks and docs; `(0, 0)` on the CPU, with the simple
/// kernels, with the separate backward or with the ordered wgmma kernel, which have neither splits nor
/// per-split buffers).
pub fn backward_splits(
    device: &Device,
    shape: &AttentionShape,
    config: &AttentionConfig,
) -> Result<(usize, usize), KernelError> {
    const WHAT: &str = "attention backward_splits";
    shape.validate(WHAT)?;
    let cfg = config.resolve(shape, WHAT)?;
    match (device, cfg.kernel) {
        (
            Device::Cuda(dev),
            AttentionKernel::Auto | AttentionKernel::Mma | AttentionKernel::Wgmma,
        ) => match cuda::backward_run(dev, &cfg)? {
            cuda::BackwardRun::Fused(kernel) => {
                let plan = cuda::fused_plan(dev, shape, &cfg, kernel)?;
                Ok((plan.splits, plan.buffers))
            }
            cuda::BackwardRun::Separate { .. }
            | cuda::BackwardRun::WgmmaSeparate(_)
            | cuda::BackwardRun::WgmmaOrdered { .. } => Ok((0, 0)),
        },
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

/// The building blocks of the wgmma forward (`attention_wgmma.cu`), each run alone by
/// [`run_wgmma_probe`] on one warpgroup: a wrong shared-memory layout, descriptor field or fragment map
/// shows up as a wrong small matrix product instead of a wrong attention output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaProbe {
    /// `a[:, 0..16] b[:, 0..16]^T` for 64 x 64 inputs: ONE `wgmma.m64n64k16` with both operands K-major
    /// in 128-byte-swizzled shared memory (head dim 64 only).
    Abt16,
    /// `a b^T` for 64 x hd inputs: the `S = Q K^T` step (hd / 16 wgmma, descriptors stepping through the
    /// swizzled rows and, at hd 128, the two column blocks).
    Abt,
    /// `bf16(p) v` for `p` 64 x 64 (F32, entering as accumulator fragments) and `v` 64 x hd: the
    /// `O += P V` step (A from registers, V MN-major through the transpose bit).
    Pv,
    /// [`WgmmaProbe::Pv`] with the given leading and stride byte offsets in V's descriptor instead of
    /// the kernel's (`lbo` 64 * 128, the second 64-column block of the probe's 64-key tile; `sbo` 1024,
    /// the next 8 keys): where `Pv` fails, the encoding the GPU does read.
    PvStrides {
        /// Leading byte offset (a multiple of 16).
        lbo: u32,
        /// Stride byte offset (a multiple of 16).
        sbo: u32,
    },
}

/// Runs `probe` for head dim `head_dim` (64 or 128) on the GPU (compute capability 9.0) with row-major
/// inputs: `a` (F32, rounded to BF16 by the host except for [`WgmmaProbe::Pv`] and `PvStrides`, where the
/// kernel rounds it as it rounds P) of 64 x hd (64 x 64 for `Pv`, `PvStrides` and `Abt16`) and `b` (BF16)
/// of 64 x hd (64 x 64 for `Abt16`). Returns the F32 result: 64 x 64, or 64 x hd for `Pv` and
/// `PvStrides`.
pub fn run_wgmma_probe(
    device: &Device,
    probe: WgmmaProbe,
    head_dim: usize,
    a: &[f32],
    b: &[bf16],
) -> Result<Vec<f32>, KernelError> {
    const WHAT: &str = "run_wgmma_probe";
    let hd_ok = match probe {
        WgmmaProbe::Abt16 => head_dim == 64,
        WgmmaProbe::Abt | WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. } => {
            WGMMA_HEAD_DIMS.contains(&head_dim)
        }
    };
    if !hd_ok {
        return Err(bad(
            WHAT,
            format!("probe {probe:?} does not exist for head dim {head_dim}"),
        ));
    }
    if let WgmmaProbe::PvStrides { lbo, sbo } = probe {
        // Every byte such a descriptor can reach lies in the probe's shared memory (32 KiB from the
        // aligned start; V's steps reach 6 KiB + LBO + SBO + 1 KiB).
        if lbo % 16 != 0 || sbo % 16 != 0 || lbo > 8192 || sbo > 8192 {
            return Err(bad(
                WHAT,
                format!("strides {lbo}, {sbo}: multiples of 16 up to 8192 only"),
            ));
        }
    }
    let a_cols = if probe == WgmmaProbe::Abt {
        head_dim
    } else {
        64
    };
    check_len(WHAT, 64 * a_cols, a.len())?;
    check_len(WHAT, 64 * head_dim, b.len())?;
    cuda::wgmma_probe(device.as_cuda(WHAT)?, probe, head_dim, a, b)
}
