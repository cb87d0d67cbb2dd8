//! The Llama model: its layers and their order.

use super::LlamaConfig;
use crate::decoder::{DecoderStack, Sampling};
use crate::ModelError;
use fp8_kernels::Device;
use fsdp_nn::init::stream_seed;
use fsdp_nn::{
    Activation, BlockConfig, Embedding, KvCache, LmHead, LossStats, Norm, Rope, Tensor, TokenBatch,
    TransformerBlock,
};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};
use half::bf16;

/// The stream the embedding draws from (see [`stream_seed`]).
const EMBED_STREAM: u64 = 1;
/// The stream an untied head draws from: its own, as the peer initialises it independently.
const HEAD_STREAM: u64 = 2;

/// `model.embed_tokens`, `model.layers` and `model.norm` (Hugging Face's `LlamaModel`).
struct Body<'a, T: Activation> {
    embed_tokens: &'a mut Embedding,
    stack: &'a mut DecoderStack<T>,
}

impl<T: Activation> Module for Body<'_, T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("embed_tokens", self.embed_tokens)?;
        v.child("layers", &mut self.stack.blocks)?;
        v.child("norm", &mut self.stack.norm)
    }
}

/// The Llama 3 family model (see the module docs of [`crate::llama`]) over activations `T` (`bf16` to
/// train, `f32` for checks).
pub struct Llama<T: Activation = bf16> {
    config: LlamaConfig,
    embed_tokens: Embedding,
    /// `model.layers.N`, `model.norm` and the head.
    stack: DecoderStack<T>,
}

impl<T: Activation> std::fmt::Debug for Llama<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<T: Activation> Llama<T> {
    /// The model `config` describes: every matrix `N(0, 0.02^2)` except `o_proj` and `down_proj`,
    /// `N(0, (0.02 / sqrt(2 L))^2)`; norm weights 1; each drawn from its own seed (the sharded model's
    /// seed and the parameter's name), the embedding and an untied head from `config.seed`.
    pub fn new(config: LlamaConfig) -> Result<Self, ModelError> {
        config.validate()?;
        let c = &config;
        let d = c.d_model;
        let s = |k: u64| stream_seed(c.seed, k);
        let rope = Rope {
            theta: c.rope_theta,
            scaling: c.rope_scaling,
            max_positions: c.seq_len,
        };
        let block = BlockConfig {
            attention: c.attention,
            fuse_norm_fp8: c.fuse_norm_fp8,
            norm_eps: c.norm_eps,
            ..BlockConfig::llama(d, c.heads, c.kv_heads, c.ffn, c.layers, rope)
        };
        let norm =
            |d| -> Result<Norm<T>, ModelError> { Ok(Norm::rms_norm(d)?.with_eps(c.norm_eps)) };
        let layers = (0..c.layers)
            .map(|i| {
                Ok(TransformerBlock::<T>::new(&block)?.recompute_mlp_up(i < c.recompute_mlp_up))
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let head = if c.tie_embeddings {
            LmHead::tied(d, c.vocab)?
        } else {
            LmHead::new(d, c.vocab)?.with_seed(s(HEAD_STREAM))
        }
        .with_chunk(c.head_chunk)?;
        Ok(Llama {
            // Untied, the table is read by the lookup only: dropped after it in a training forward.
            embed_tokens: Embedding::new(c.vocab, d)?
                .with_seed(s(EMBED_STREAM))
                .with_sole_reader(!c.tie_embeddings),
            stack: DecoderStack::new(
                layers,
                c.recompute_blocks,
                norm(d)?,
                head,
                d,
                c.vocab,
                c.seq_len,
                "RoPE tables",
            ),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// A batch for this model: `batch` sequences of `seq <= seq_len` ids and their targets, checked
    /// against the model's vocabulary and uploaded to `device` (see [`TokenBatch::new`]).
    pub fn batch(
        &self,
        device: &Device,
        inputs: &[i32],
        targets: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<TokenBatch, ModelError> {
        self.stack.batch(device, inputs, targets, batch, seq)
    }

    /// The embedding, the layers and the final norm: the head's input.
    fn trunk(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<Tensor<T>, ModelError> {
        self.stack.check(batch)?;
        let x = self.embed_tokens.forward::<T>(ctx, batch, None)?;
        self.stack.trunk(ctx, x)
    }

    /// The forward up to the loss (a training forward keeps what the backward needs; an evaluation
    /// forward keeps nothing). The mean loss is then on the device in [`Llama::loss`].
    pub fn forward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), ModelError> {
        let y = self.trunk(ctx, batch)?;
        self.stack.head_forward(ctx, y, batch.targets(), false)
    }

    /// A training forward that also computes the LM head's gradients (the backward then does not
    /// recompute the logits).
    pub fn forward_with_grad(
        &mut self,
        ctx: &mut Ctx<'_>,
        batch: &TokenBatch,
    ) -> Result<(), ModelError> {
        let y = self.trunk(ctx, batch)?;
        self.stack.head_forward(ctx, y, batch.targets(), true)
    }

    /// The backward of the batch's mean loss, after a training forward of the same batch.
    pub fn backward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), ModelError> {
        self.stack.check(batch)?;
        let dx = self.stack.backward(ctx, batch.targets())?;
        self.embed_tokens.backward(ctx, &dx, batch, None)?;
        Ok(())
    }

    /// Bytes held for the backward after a training forward: the blocks' activations (a recomputed
    /// block's input), the final norm's input and the head's.
    pub fn held_bytes(&self) -> usize {
        self.stack.held_bytes()
    }

    /// The loss of the last forward.
    pub fn loss(&self) -> Result<&LossStats, ModelError> {
        self.stack.loss()
    }

    /// Frees everything the last training forward kept.
    pub fn forget_saved(&mut self) {
        self.stack.forget_saved();
    }

    /// The logits (f32, `vocab` of them) at every position of one sequence `ids` from a full evaluation
    /// forward, `[ids.len(), vocab]` row-major (for comparisons with a reference implementation).
    pub fn logits(&mut self, ctx: &mut Ctx<'_>, ids: &[i32]) -> Result<Vec<f32>, ModelError> {
        if ctx.is_training() {
            return Err(ModelError::Config("logits is for evaluation passes".into()));
        }
        let dev = ctx.device().clone();
        let batch = self.batch(&dev, ids, ids, 1, ids.len())?;
        let y = self.trunk(ctx, &batch)?;
        self.stack.logits(ctx, &y)
    }

    /// Continues `prompt` (one sequence) by `sampling.max_new_tokens` tokens with a key/value cache per
    /// layer (RoPE at each token's position). Run it in an evaluation pass; see
    /// [`crate::gpt::Gpt::generate`].
    pub fn generate(
        &mut self,
        ctx: &mut Ctx<'_>,
        prompt: &[i32],
        sampling: &Sampling,
    ) -> Result<Vec<i32>, ModelError> {
        let c = &self.config;
        let (heads, kv_heads, hd) = (c.heads, c.kv_heads, c.d_model / c.heads);
        let vocab = c.vocab;
        let embed = &self.embed_tokens;
        self.stack.generate(
            ctx,
            prompt,
            sampling,
            c.seq_len,
            || KvCache::grouped(heads, kv_heads, hd),
            |ctx, token, _position| {
                let dev = ctx.device().clone();
                let one = TokenBatch::new(&dev, &[token], &[token], 1, 1, vocab)?;
                Ok(embed.forward::<T>(ctx, &one, None)?)
            },
        )
    }
}

impl<T: Activation> Module for Llama<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        // Hugging Face's `named_parameters()` order: model.embed_tokens, model.layers.N.*, model.norm,
        // lm_head (absent when tied).
        let mut body = Body {
            embed_tokens: &mut self.embed_tokens,
            stack: &mut self.stack,
        };
        v.child("model", &mut body)?;
        if self.config.tie_embeddings {
            // The registration visit has just assigned the table's id.
            self.stack.head.set_table(self.embed_tokens.weight_id());
        }
        // Tied, the head declares nothing; it is visited anyway so that model-wide passes reach it
        // (`fsdp_nn::convert_lm_heads_to_fp8`).
        v.child("lm_head", &mut self.stack.head)
    }
}
