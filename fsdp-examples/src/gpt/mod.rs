//! The GPT-2 family decoder language model (nanoGPT's, as the PyTorch peer `bench/peers/peer_gpt.py`
//! builds it): its configuration and presets ([`GptConfig`]), the model ([`Gpt`]: its layers and their
//! order), and the peer's FLOP count ([`GptConfig::flops_per_token`]).
//!
//! The model: `wte [vocab, d]` and `wpe [seq_len, d]` embeddings, blocks `h.N` (pre-norm
//! `x + attn_proj(attention(c_attn(ln_1(x))))`, then `x + mlp_proj(gelu(c_fc(ln_2(x))))`), `ln_f`, and the
//! LM head tied to `wte`, with the mean cross-entropy over the batch's tokens. LayerNorms have a weight
//! only (eps 1e-5); linears have no bias. Parameter names are the peer's `named_parameters()`. The
//! residual stream is in the activation type (`bf16` for training, as PyTorch's BF16 mixed precision;
//! `f32` for checks), the linears in that precision until a run converts chosen ones to FP8
//! ([`fsdp_nn::convert_to_fp8`]). Wrap it with [`wrap_policy`] (one FSDP unit per block, the embeddings, `ln_f`
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
//! // d 64 in 2 heads of 32, 1 block, a vocabulary of 256, sequences of up to 16, every linear in FP8.
//! let config = GptConfig { vocab: 256, ..GptConfig::new(64, 1, 2, 16) };
//! let flops_per_token = config.flops_per_token();
//! let mut gpt = Gpt::<bf16>::new(config)?;
//! fsdp_nn::convert_to_fp8(&mut gpt, &fsdp_nn::Fp8Filter::All, &fp8_core::Fp8Recipe::default())?;
//! let mut model = FsdpModel::new(gpt, comm, wrap_policy(), FsdpConfig::default())?;
//! let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
//! let dev = model.device().clone();
//! let ids: Vec<i32> = (0..33).map(|i| (i * 7) % 256).collect();
//! // Two sequences of 16 tokens, each target the next id; checked and grouped when the batch is made.
//! let batch = model.module().batch(&dev, &ids[..32], &ids[1..], 2, 16)?;
//! model.forward(Mode::Train, |m, ctx| m.forward(ctx, &batch))?;
//! let loss = model.module().loss()?.mean()?; // the only read from the device
//! model.backward(|m, ctx| m.backward(ctx, &batch))?;
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

pub use crate::decoder::Sampling;
pub use model::Gpt;

use fp8_kernels::attention::AttentionConfig;
use fp8_kernels::layer_norm::NormKind;
use fsdp_nn::DEFAULT_HEAD_CHUNK;
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

/// What can go wrong building or running the model.
pub type GptError = crate::ModelError;

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
    /// LayerNorm (GPT-2) or RMSNorm.
    pub norm: NormKind,
    /// Tokens per chunk of the LM head.
    pub head_chunk: usize,
    /// Seed of `wte` and of an untied head (both drawn from it, so they start equal); the other
    /// parameters draw from the sharded model's seed and their names.
    pub seed: u64,
    /// The attention kernels' configuration (deterministic backward by default).
    pub attention: AttentionConfig,
    /// Norms write their FP8 linear's input directly (bit-identical; on by default).
    pub fuse_norm_fp8: bool,
    /// The head uses `wte` (GPT-2). Off: a separate `lm_head.weight`, initialised as `wte` (for checks).
    pub tie_embeddings: bool,
    /// Recompute each block's forward in its backward instead of keeping its activations.
    pub recompute_blocks: bool,
    /// The first this many blocks recompute their MLP's up output in the backward instead of keeping
    /// it (`TransformerBlock::recompute_mlp_up`: bit-identical, one FP8 GEMM more per block).
    pub recompute_mlp_up: usize,
}

impl GptConfig {
    /// A model of width `d`, `layers` blocks, `heads` heads, sequences up to `seq_len`, the padded GPT-2
    /// vocabulary, seed 1 (its linears in the activations' float precision: a run converts them).
    pub fn new(d_model: usize, layers: usize, heads: usize, seq_len: usize) -> Self {
        GptConfig {
            d_model,
            layers,
            heads,
            vocab: GPT2_PADDED_VOCAB,
            seq_len,
            norm: NormKind::LayerNorm,
            head_chunk: DEFAULT_HEAD_CHUNK,
            seed: 1,
            attention: AttentionConfig::default(),
            fuse_norm_fp8: true,
            tie_embeddings: true,
            recompute_blocks: false,
            recompute_mlp_up: 0,
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
