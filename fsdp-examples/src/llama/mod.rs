//! The Llama 3 family decoder language model, with Hugging Face `LlamaForCausalLM`'s names and
//! conventions (as the PyTorch peer `peer_llama.py` builds it): its configuration and presets
//! ([`LlamaConfig`]), the model ([`Llama`]) and the peer's FLOP count ([`LlamaConfig::flops_per_token`]).
//!
//! The model: `model.embed_tokens [V, d]`, decoder layers `model.layers.N` (pre-norm
//! `x + o_proj(attention(rope(qkv_proj(input_layernorm(x)))))`, then
//! `x + down_proj(silu(gate) * up)` with `[gate | up] = gate_up_proj(post_attention_layernorm(x))`),
//! `model.norm`, and `lm_head` (tied to the embedding where the preset says so), with the mean
//! cross-entropy over the batch's tokens. RMSNorm eps 1e-5 with a weight only; no biases; grouped-query
//! attention (query head `h` reads key/value head `h / (H / KV)`); rotate-half RoPE with base 500000
//! (and Llama 3.1's frequency scaling when a checkpoint's config asks for it). The two fused projections
//! are split into Hugging Face's `q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj` on export
//! ([`crate::hf`]). Wrap it with [`wrap_policy`] (one FSDP unit per layer).
//!
//! A training step of a small model on one rank:
//!
//! ```
//! use fsdp_comm::{Communicator, ThreadGroup};
//! use fsdp_examples::llama::{wrap_policy, Llama, LlamaConfig};
//! use fsdp_optim::{step_model, AdamOptions, FsdpAdamW};
//! use fsdp_shard::{FsdpConfig, FsdpModel, Mode};
//! use std::sync::Arc;
//!
//! let comm: Arc<dyn Communicator> =
//!     Arc::new(ThreadGroup::new(1, std::time::Duration::from_secs(60))?.remove(0));
//! // d 64: 2 query heads of 32 over 1 key/value head, 1 layer, SwiGLU of 96, a vocabulary of 256.
//! let config = LlamaConfig { vocab: 256, ..LlamaConfig::new(64, 1, 2, 1, 96, 16) };
//! let mut llama = Llama::<f32>::new(config)?;
//! let mut model = FsdpModel::new(llama, comm, wrap_policy(), FsdpConfig::default())?;
//! let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
//! let dev = model.device().clone();
//! let ids: Vec<i32> = (0..33).map(|i| (i * 7) % 256).collect();
//! let batch = model.module().batch(&dev, &ids[..32], &ids[1..], 2, 16)?;
//! model.forward(Mode::Train, |m, ctx| m.forward(ctx, &batch))?;
//! let loss = model.module().loss()?.mean()?;
//! model.backward(|m, ctx| m.backward(ctx, &batch))?;
//! step_model(&mut opt, &mut model)?;
//! model.forward(Mode::Eval, |m, ctx| m.forward(ctx, &batch))?;
//! assert!(model.module().loss()?.mean()? < loss);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod model;

pub use model::Llama;

use crate::hf::LlamaHfConfig;
use crate::ModelError;
use fp8_kernels::attention::AttentionConfig;
use fp8_kernels::rope::Llama3RopeScaling;
use fsdp_nn::DEFAULT_HEAD_CHUNK;
use fsdp_shard::WrapPolicy;

/// Llama 3's vocabulary (the `speed` mode's, as the peer's).
pub const LLAMA3_VOCAB: usize = 128256;

/// Llama 3's RoPE base.
pub const LLAMA3_ROPE_THETA: f64 = 500000.0;

/// One preset's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaPreset {
    /// The name (`llama-1b`).
    pub name: &'static str,
    /// Width `d`.
    pub d_model: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// SwiGLU hidden width (`intermediate_size`).
    pub ffn: usize,
    /// The head shares the embedding.
    pub tied: bool,
}

const fn preset(
    name: &'static str,
    d_model: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    tied: bool,
) -> LlamaPreset {
    LlamaPreset {
        name,
        d_model,
        layers,
        heads,
        kv_heads,
        ffn,
        tied,
    }
}

/// The peer's presets: the shapes of Llama 3.2 1B and 3B and Llama 3.1 8B, and two small ones.
pub const PRESETS: [LlamaPreset; 5] = [
    preset("llama-tiny", 128, 2, 4, 2, 384, true),
    preset("llama-small", 768, 12, 12, 4, 2048, true),
    preset("llama-1b", 2048, 16, 32, 8, 8192, true),
    preset("llama-3b", 3072, 28, 24, 8, 8192, true),
    preset("llama-8b", 4096, 32, 32, 8, 14336, false),
];

/// How the model is built.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Width `d` (`hidden_size`).
    pub d_model: usize,
    /// Decoder layers `L`.
    pub layers: usize,
    /// Query heads `H` (`d / H` must be 32, 64 or 128 for the CUDA kernels).
    pub heads: usize,
    /// Key/value heads (dividing `H`).
    pub kv_heads: usize,
    /// SwiGLU hidden width.
    pub ffn: usize,
    /// Rows of the embedding.
    pub vocab: usize,
    /// The longest sequence (rows of the RoPE tables).
    pub seq_len: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama 3.1's RoPE frequency scaling.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// The head uses the embedding's weight.
    pub tie_embeddings: bool,
    /// Tokens per chunk of the LM head.
    pub head_chunk: usize,
    /// Seed of the embedding and of an untied head (both drawn from it); the other parameters draw from
    /// the sharded model's seed and their names.
    pub seed: u64,
    /// The attention kernels' configuration (deterministic backward by default).
    pub attention: AttentionConfig,
    /// Norms write their FP8 linear's input directly (bit-identical; on by default).
    pub fuse_norm_fp8: bool,
    /// Recompute each layer's forward in its backward instead of keeping its activations.
    pub recompute_blocks: bool,
    /// The first this many layers recompute their MLP's `[gate | up]` in the backward instead of
    /// keeping it (`TransformerBlock::recompute_mlp_up`: bit-identical, one FP8 GEMM more per layer).
    pub recompute_mlp_up: usize,
}

impl LlamaConfig {
    /// A tied model of width `d`, `layers` layers, `heads` query heads over `kv_heads` key/value heads,
    /// SwiGLU width `ffn`, sequences up to `seq_len`, Llama 3's vocabulary, RoPE base and eps, seed 1.
    pub fn new(
        d_model: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        ffn: usize,
        seq_len: usize,
    ) -> Self {
        LlamaConfig {
            d_model,
            layers,
            heads,
            kv_heads,
            ffn,
            vocab: LLAMA3_VOCAB,
            seq_len,
            rope_theta: LLAMA3_ROPE_THETA,
            rope_scaling: None,
            norm_eps: 1e-5,
            tie_embeddings: true,
            head_chunk: DEFAULT_HEAD_CHUNK,
            seed: 1,
            attention: AttentionConfig::default(),
            fuse_norm_fp8: true,
            recompute_blocks: false,
            recompute_mlp_up: 0,
        }
    }

    /// One of [`PRESETS`] with sequences up to `seq_len`.
    pub fn preset(name: &str, seq_len: usize) -> Result<Self, ModelError> {
        let p = find_preset(name)?;
        Ok(LlamaConfig {
            tie_embeddings: p.tied,
            ..Self::new(p.d_model, p.layers, p.heads, p.kv_heads, p.ffn, seq_len)
        })
    }

    /// The model a Hugging Face `config.json` describes, for sequences up to `seq_len` (refuses a
    /// `head_dim` other than `hidden_size / num_attention_heads`, which the fused layout assumes).
    pub fn from_hf(hf: &LlamaHfConfig, seq_len: usize) -> Result<Self, ModelError> {
        if hf.num_attention_heads == 0 || hf.head_dim * hf.num_attention_heads != hf.hidden_size {
            return Err(ModelError::Config(format!(
                "head_dim {} x {} heads is not hidden_size {}: such models are not supported",
                hf.head_dim, hf.num_attention_heads, hf.hidden_size
            )));
        }
        let c = LlamaConfig {
            vocab: hf.vocab_size,
            rope_theta: hf.rope_theta,
            rope_scaling: hf.rope_scaling,
            norm_eps: hf.rms_norm_eps as f32,
            tie_embeddings: hf.tie_word_embeddings,
            ..Self::new(
                hf.hidden_size,
                hf.num_hidden_layers,
                hf.num_attention_heads,
                hf.num_key_value_heads,
                hf.intermediate_size,
                seq_len,
            )
        };
        c.validate()?;
        Ok(c)
    }

    /// The Hugging Face `config.json` of this model (F32 or BF16 tensors as `dtype` names them).
    pub fn to_hf(&self, torch_dtype: &str) -> Result<LlamaHfConfig, ModelError> {
        let mut hf = LlamaHfConfig::llama3(
            self.d_model,
            self.layers,
            self.heads,
            self.kv_heads,
            self.ffn,
            self.vocab,
        )
        .map_err(|e| ModelError::Config(e.to_string()))?;
        hf.rope_theta = self.rope_theta;
        hf.rope_scaling = self.rope_scaling;
        hf.rms_norm_eps = f64::from(self.norm_eps);
        hf.tie_word_embeddings = self.tie_embeddings;
        hf.max_position_embeddings = self.seq_len.max(hf.max_position_embeddings);
        hf.torch_dtype = Some(torch_dtype.to_string());
        Ok(hf)
    }

    /// Checks the shape.
    pub fn validate(&self) -> Result<(), ModelError> {
        let c = self;
        if [
            c.d_model, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq_len,
        ]
        .contains(&0)
        {
            return Err(ModelError::Config(format!(
                "d {}, layers {}, heads {}, kv heads {}, ffn {}, vocab {}, seq_len {}: all must be \
                 positive",
                c.d_model, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq_len
            )));
        }
        if c.d_model % c.heads != 0 || c.heads % c.kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "d {} in {} query heads over {} key/value heads: the heads must divide d and the \
                 key/value heads the heads",
                c.d_model, c.heads, c.kv_heads
            )));
        }
        if c.head_chunk == 0 {
            return Err(ModelError::Config("head chunks of 0 tokens".into()));
        }
        Ok(())
    }

    fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Parameters of the linears in one layer: `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`.
    fn layer_matmul_params(&self) -> usize {
        let (d, hd) = (self.d_model, self.head_dim());
        d * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * d + 3 * d * self.ffn
    }

    /// Parameters, a tied matrix once (the peer's `sum(p.numel() for p in model.parameters())`):
    /// `V d (x2 untied) + L (matmuls + 2 d) + d`.
    pub fn num_params(&self) -> usize {
        let (d, v) = (self.d_model, self.vocab);
        let head = if self.tie_embeddings { 0 } else { v * d };
        v * d + head + self.layers * (self.layer_matmul_params() + 2 * d) + d
    }

    /// Model FLOPs per token of a training step, the peer's formula: `6 N_matmul + 6 L T d`, with
    /// `N_matmul` the weights of every linear, the head included even when tied (`T` = `seq_len`).
    pub fn flops_per_token(&self) -> f64 {
        let n_matmul = self.layers * self.layer_matmul_params() + self.vocab * self.d_model;
        6.0 * n_matmul as f64 + 6.0 * (self.layers * self.seq_len * self.d_model) as f64
    }
}

/// The preset called `name`.
pub fn find_preset(name: &str) -> Result<LlamaPreset, ModelError> {
    PRESETS
        .iter()
        .find(|p| p.name == name)
        .copied()
        .ok_or_else(|| {
            ModelError::Config(format!(
                "unknown preset {name:?} (one of {})",
                PRESETS.map(|p| p.name).join(", ")
            ))
        })
}

/// One FSDP unit per decoder layer (`model.layers.N`); the embedding, the final norm and the head
/// (tied or not) share the root unit.
pub fn wrap_policy() -> WrapPolicy {
    WrapPolicy::ChildrenOf("model.layers".into())
}
