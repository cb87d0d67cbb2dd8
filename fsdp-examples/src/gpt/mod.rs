//! The GPT-2 family decoder language model (nanoGPT's, as the PyTorch peer `shared/bench/peer_gpt.py`
//! builds it): its configuration and presets ([`GptConfig`]), the model ([`Gpt`]: its layers and their
//! order), and the peer's FLOP count ([`GptConfig::flops_per_token`]).
//!
//! The model: `wte [vocab, d]` and `wpe [seq_len, d]` embeddings, blocks `h.N` (pre-norm
//! `x + attn_proj(attention(c_attn(ln_1(x))))`, then `x + mlp_proj(gelu(c_fc(ln_2(x))))`), `ln_f`, and the
//! LM head tied to `wte`, with the mean cross-entropy over the batch's tokens. LayerNorms have a weight
//! only (eps 1e-5); linears have no bias. Parameter names are the peer's `named_parameters()`. The
//! residual stream is in the activation type (`bf16` for training, as PyTorch's BF16 mixed precision;
//! `f32` for checks), the linears FP8 (delayed scaling of activations and gradients), BF16 or F32 per
//! layer ([`Fp8Layers`]). Wrap it with [`wrap_policy`] (one FSDP unit per block, the embeddings, `ln_f`
//! and the tied head in the root unit). See `docs/transformer-layers.md`.
//!
//! A training step and an evaluation of a small model on one rank (on a GPU the same code runs with
//! `fsdp_comm::NcclComm`):
//!
//! ```
//! use fsdp_comm::{Communicator, ThreadGroup};
//! use fsdp_examples::gpt::{wrap_policy, Gpt, GptConfig, Sampling};
//! use fsdp_optim::{step_model, AdamOptions, FsdpAdamW};
//! use fsdp_shard::{FsdpConfig, FsdpModel, Mode};
//! use half::bf16;
//! use std::sync::Arc;
//!
//! let comm: Arc<dyn Communicator> =
//!     Arc::new(ThreadGroup::new(1, std::time::Duration::from_secs(60))?.remove(0));
//! // d 64 in 2 heads of 32, 1 block, a vocabulary of 256, sequences of up to 16 (FP8 linears).
//! let config = GptConfig { vocab: 256, ..GptConfig::new(64, 1, 2, 16) };
//! let flops_per_token = config.flops_per_token();
//! let mut model = FsdpModel::new(Gpt::<bf16>::new(config)?, comm, wrap_policy(), FsdpConfig::default())?;
//! let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
//! let dev = model.device().clone();
//! let ids: Vec<i32> = (0..33).map(|i| (i * 7) % 256).collect();
//! // Two sequences of 16 tokens, each target the next id; checked and grouped when the batch is made.
//! let batch = model.module().batch(&dev, &ids[..32], &ids[1..], 2, 16)?;
//! model.forward(Mode::Train, |m, ctx| m.forward(ctx, &batch))?;
//! let loss = model.module().loss()?.mean()?; // the only read from the device
//! model.backward(|m, ctx| m.backward(ctx, &batch, 1.0))?;
//! step_model(&mut opt, &mut model)?;
//! model.forward(Mode::Eval, |m, ctx| m.forward(ctx, &batch))?;
//! assert!(model.module().loss()?.mean()? < loss);
//! let new = model.forward(Mode::Eval, |m, ctx| m.generate(ctx, &ids[..4], &Sampling::greedy(4)))?;
//! assert_eq!(new.len(), 4);
//! assert!(flops_per_token > 0.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod crossover;
mod model;
mod run;
mod speed;
mod train;

pub use model::{Gpt, Sampling};
pub use run::{
    build_model, build_optimizer, peer_adamw_options, peer_schedule, GptModelChoice, GptPrecision,
    GptRunError,
};
pub use speed::{speed, SpeedConfig, SpeedReport};
pub use train::{train, EvalPoint, GptTrainConfig, GptTrainReport, SAMPLE_PROMPT};

use fp8_kernels::attention::AttentionConfig;
use fp8_kernels::layer_norm::NormKind;
use fp8_kernels::DType;
use fsdp_nn::{Activation, LinearPrecision, NnError, DEFAULT_HEAD_CHUNK};
use fsdp_shard::WrapPolicy;

/// The GPT-2 vocabulary (50257) padded to a multiple of 64, as nanoGPT and the peer do.
pub const GPT2_PADDED_VOCAB: usize = 50304;

/// The peer's presets: `(name, d_model, layers, heads)`.
pub const PRESETS: [(&str, usize, usize, usize); 6] = [
    ("tiny", 128, 2, 4),
    ("gpt2", 768, 12, 12),
    ("gpt2-medium", 1024, 24, 16),
    ("gpt2-large", 1280, 36, 20),
    ("gpt2-xl", 1600, 48, 25),
    ("gpt-3b", 2560, 32, 20),
];

/// The default crossover of [`Fp8Layers::Auto`]: a linear `in -> out` runs in FP8 when
/// `k = in * out / (in + out) >= 1200`. `k` is the GEMM's flops per element of the two activation casts
/// FP8 adds (`2 tokens in out` flops against `tokens (in + out)` cast elements), so it says whether the
/// faster GEMM pays for the casts. The value is measured: `linear_crossover` on the H200 (2026-12-03,
/// `docs/results/transformer-h200-2/`) timed one training step (forward, backward, AdamW with the FP8
/// weight re-quantization) of each block linear of the five GPT widths at 4096, 8192 and 16384 tokens;
/// with `c_attn` and `c_fc` fed by their LayerNorm as in the model, FP8 was faster for every linear with
/// `k >= 1200` at every token count (and at `k >= 800` from 8192 tokens). So gpt2 .. gpt2-large stay BF16,
/// gpt2-xl (d = 1600) has FP8 `c_attn`, `c_fc`, `mlp_proj` and a BF16 `attn_proj`, gpt-3b is all FP8.
/// `gpt_fsdp --fp8-auto-threshold` takes another value.
pub const DEFAULT_FP8_AUTO_THRESHOLD: usize = 1200;

/// The quantity [`Fp8Layers::Auto`] compares with its threshold for a linear `inf -> outf`:
/// `inf * outf / (inf + outf)` in integers (rounded down; 0 when both are 0).
pub fn fp8_auto_ratio(inf: usize, outf: usize) -> usize {
    (inf * outf).checked_div(inf + outf).unwrap_or(0)
}

/// Which linears run in FP8; the others run in BF16 (or F32 with `f32` activations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Layers {
    /// Every linear of every block (the head is always BF16/F32, as in the peer).
    #[default]
    All,
    /// None.
    None,
    /// A linear whose GEMM is large enough for FP8 to pay ([`GptConfig::fp8_auto_threshold`]).
    Auto,
}

/// What can go wrong building or running the model.
#[derive(Debug, thiserror::Error)]
pub enum GptError {
    /// A layer failed.
    #[error(transparent)]
    Nn(#[from] NnError),
    /// Sharding, gathering or reduction failed.
    #[error(transparent)]
    Shard(#[from] fsdp_shard::ShardError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] fp8_kernels::KernelError),
    /// A configuration that cannot be built.
    #[error("{0}")]
    Config(String),
}

/// How the model is built.
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    /// Model width `d`.
    pub d_model: usize,
    /// Blocks `L`.
    pub layers: usize,
    /// Attention heads (`d / heads` must be 32, 64 or 128 for the CUDA kernels).
    pub heads: usize,
    /// Rows of `wte` (default [`GPT2_PADDED_VOCAB`]).
    pub vocab: usize,
    /// Rows of `wpe`: the longest sequence.
    pub seq_len: usize,
    /// Which linears run in FP8.
    pub fp8: Fp8Layers,
    /// The crossover of [`Fp8Layers::Auto`] (see [`DEFAULT_FP8_AUTO_THRESHOLD`]).
    pub fp8_auto_threshold: usize,
    /// LayerNorm (GPT-2) or RMSNorm.
    pub norm: NormKind,
    /// Tokens per chunk of the LM head.
    pub head_chunk: usize,
    /// Seed of the initial weights (each parameter its own stream).
    pub seed: u64,
    /// The attention kernels' configuration (deterministic backward by default).
    pub attention: AttentionConfig,
    /// Norms write their FP8 linear's input directly (bit-identical; on by default).
    pub fuse_norm_fp8: bool,
    /// The head uses `wte` (GPT-2). Off: a separate `lm_head.weight`, initialised as `wte` (for checks).
    pub tie_embeddings: bool,
    /// Recompute each block's forward in its backward instead of keeping its activations.
    pub recompute_blocks: bool,
}

impl GptConfig {
    /// A model of width `d`, `layers` blocks, `heads` heads, sequences up to `seq_len`, the padded GPT-2
    /// vocabulary, FP8 linears, seed 1.
    pub fn new(d_model: usize, layers: usize, heads: usize, seq_len: usize) -> Self {
        GptConfig {
            d_model,
            layers,
            heads,
            vocab: GPT2_PADDED_VOCAB,
            seq_len,
            fp8: Fp8Layers::All,
            fp8_auto_threshold: DEFAULT_FP8_AUTO_THRESHOLD,
            norm: NormKind::LayerNorm,
            head_chunk: DEFAULT_HEAD_CHUNK,
            seed: 1,
            attention: AttentionConfig::default(),
            fuse_norm_fp8: true,
            tie_embeddings: true,
            recompute_blocks: false,
        }
    }

    /// One of [`PRESETS`] with sequences up to `seq_len`.
    pub fn preset(name: &str, seq_len: usize) -> Result<Self, GptError> {
        PRESETS
            .iter()
            .find(|p| p.0 == name)
            .map(|&(_, d, l, h)| Self::new(d, l, h, seq_len))
            .ok_or_else(|| {
                GptError::Config(format!(
                    "unknown preset {name:?} (one of {})",
                    PRESETS.map(|p| p.0).join(", ")
                ))
            })
    }

    /// Checks the shape.
    pub fn validate(&self) -> Result<(), GptError> {
        let c = self;
        if c.d_model == 0 || c.layers == 0 || c.heads == 0 || c.vocab == 0 || c.seq_len == 0 {
            return Err(GptError::Config(format!(
                "d {}, layers {}, heads {}, vocab {}, seq_len {}: all must be positive",
                c.d_model, c.layers, c.heads, c.vocab, c.seq_len
            )));
        }
        if c.d_model % c.heads != 0 {
            return Err(GptError::Config(format!(
                "d {} does not split into {} heads",
                c.d_model, c.heads
            )));
        }
        if c.head_chunk == 0 {
            return Err(GptError::Config("head chunks of 0 tokens".into()));
        }
        Ok(())
    }

    /// The precision of a linear `inf -> outf` with activations `T`.
    pub fn linear_precision<T: Activation>(&self, inf: usize, outf: usize) -> LinearPrecision {
        let float = if T::DTYPE == DType::F32 {
            LinearPrecision::F32
        } else {
            LinearPrecision::Bf16
        };
        match self.fp8 {
            Fp8Layers::All => LinearPrecision::Fp8,
            Fp8Layers::None => float,
            Fp8Layers::Auto if fp8_auto_ratio(inf, outf) >= self.fp8_auto_threshold => {
                LinearPrecision::Fp8
            }
            Fp8Layers::Auto => float,
        }
    }

    /// Parameters, the tied matrix once (the peer's `sum(p.numel() for p in model.parameters())`):
    /// `V d + T d + L (12 d^2 + 2 d) + d`, plus `V d` when untied.
    pub fn num_params(&self) -> usize {
        let (d, l) = (self.d_model, self.layers);
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * d
        };
        self.vocab * d + self.seq_len * d + l * (12 * d * d + 2 * d) + d + head
    }

    /// Model FLOPs per token of a training step, the peer's (nanoGPT's `estimate_mfu`) formula:
    /// `6 (N - T d) + 6 L T d` with `N` = [`GptConfig::num_params`] and `T` = `seq_len` (the position
    /// table is not a matmul; the attention's `12 L H hd T / 2` for a causal mask).
    pub fn flops_per_token(&self) -> f64 {
        let (n, t, d, l) = (
            self.num_params() as f64,
            self.seq_len as f64,
            self.d_model as f64,
            self.layers as f64,
        );
        6.0 * (n - t * d) + 6.0 * l * t * d
    }
}

/// One FSDP unit per block (`h.0`, `h.1`, ...); the embeddings, `ln_f` and the tied head share the root
/// unit, so the table's two gradients add up before the reduction.
pub fn wrap_policy() -> WrapPolicy {
    WrapPolicy::ChildrenOf("h".into())
}
