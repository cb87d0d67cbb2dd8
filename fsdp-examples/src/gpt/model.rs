//! The GPT model: its layers and their order.

use super::{GptConfig, GptError};
use crate::decoder::{DecoderStack, Sampling};
use fp8_kernels::Device;
use fsdp_nn::init::stream_seed;
use fsdp_nn::{
    Activation, BlockConfig, Embedding, KvCache, LmHead, LossStats, Norm, Tensor, TokenBatch,
    TransformerBlock,
};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};
use half::bf16;

/// The stream an untied head and `wte` both draw from (see [`stream_seed`]), so they start equal.
const WTE_STREAM: u64 = 1;

/// The GPT-2 family model (see the module docs of [`crate::gpt`]): `wte`, `wpe`, blocks `h.N`, `ln_f`
/// and the LM head with its loss, over activations `T` (`bf16` to train, `f32` for checks).
pub struct Gpt<T: Activation = bf16> {
    config: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    /// Blocks `h.N`, `ln_f` and the head.
    stack: DecoderStack<T>,
}

impl<T: Activation> std::fmt::Debug for Gpt<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<T: Activation> Gpt<T> {
    /// The model `config` describes: every 2-D parameter `N(0, 0.02^2)` except `attn_proj` and
    /// `mlp_proj`, `N(0, (0.02 / sqrt(2 L))^2)`; norm weights 1; each drawn from its own seed (the sharded
    /// model's seed and the parameter's name), but `wte` and an untied head from `config.seed` (so a tied
    /// and an untied model start equal).
    pub fn new(config: GptConfig) -> Result<Self, GptError> {
        config.validate()?;
        let c = &config;
        let d = c.d_model;
        let s = |k: u64| stream_seed(c.seed, k);
        let block = BlockConfig {
            norm: c.norm,
            attention: c.attention,
            fuse_norm_fp8: c.fuse_norm_fp8,
            ..BlockConfig::gpt2(d, c.heads, c.layers)
        };
        let h = (0..c.layers)
            .map(|i| {
                Ok(TransformerBlock::<T>::new(&block)?.recompute_mlp_up(i < c.recompute_mlp_up))
            })
            .collect::<Result<Vec<_>, GptError>>()?;
        let head = if c.tie_embeddings {
            LmHead::tied(d, c.vocab)?
        } else {
            LmHead::new(d, c.vocab)?.with_seed(s(WTE_STREAM))
        }
        .with_chunk(c.head_chunk)?;
        Ok(Gpt {
            wte: Embedding::new(c.vocab, d)?.with_seed(s(WTE_STREAM)),
            wpe: Embedding::new(c.seq_len, d)?,
            stack: DecoderStack::new(
                h,
                c.recompute_blocks,
                Norm::of_kind(c.norm, d)?,
                head,
                d,
                c.vocab,
                c.seq_len,
                "position table",
            ),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
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
    ) -> Result<TokenBatch, GptError> {
        self.stack.batch(device, inputs, targets, batch, seq)
    }

    /// Embeddings, blocks and `ln_f`: the head's input.
    fn trunk(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<Tensor<T>, GptError> {
        self.stack.check(batch)?;
        let x = self.wte.forward::<T>(ctx, batch, Some(&self.wpe))?;
        self.stack.trunk(ctx, x)
    }

    /// The forward up to the loss (a training forward keeps what the backward needs; an evaluation
    /// forward, `Mode::Eval`, keeps nothing). The mean loss over the batch's tokens is then on the device
    /// in [`Gpt::loss`]; nothing is read back.
    pub fn forward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        let y = self.trunk(ctx, batch)?;
        self.stack.head_forward(ctx, y, batch.targets(), false)
    }

    /// A training forward that also computes the LM head's gradients: the backward then does not
    /// recompute the head's logits (one GEMM of `2 tokens d vocab` flops fewer per step).
    pub fn forward_with_grad(
        &mut self,
        ctx: &mut Ctx<'_>,
        batch: &TokenBatch,
    ) -> Result<(), GptError> {
        let y = self.trunk(ctx, batch)?;
        self.stack.head_forward(ctx, y, batch.targets(), true)
    }

    /// The backward of the batch's mean loss, after a training forward of the same batch (the sharded
    /// model's reduction averages over ranks and micro-batches).
    pub fn backward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        self.stack.check(batch)?;
        let dx = self.stack.backward(ctx, batch.targets())?;
        self.wte.backward(ctx, &dx, batch, Some(&self.wpe))?;
        Ok(())
    }

    /// Bytes held for the backward after a training forward: the blocks' activations (a recomputed
    /// block's input), the final norm's input and the head's.
    pub fn held_bytes(&self) -> usize {
        self.stack.held_bytes()
    }

    /// The loss of the last forward (device buffers: sum, per-token losses; [`LossStats::mean`] reads
    /// the mean back).
    pub fn loss(&self) -> Result<&LossStats, GptError> {
        self.stack.loss()
    }

    /// Frees everything the last training forward kept (e.g. after a forward that will not be followed
    /// by a backward).
    pub fn forget_saved(&mut self) {
        self.stack.forget_saved();
    }
}

impl<T: Activation> Gpt<T> {
    /// The logits (f32, `vocab` of them) at the last position of one sequence `ids`, from a full
    /// evaluation forward (no cache): the reference of [`Gpt::generate`].
    pub fn last_logits(&mut self, ctx: &mut Ctx<'_>, ids: &[i32]) -> Result<Vec<f32>, GptError> {
        if ctx.is_training() {
            return Err(GptError::Config(
                "last_logits is for evaluation passes".into(),
            ));
        }
        let dev = ctx.device().clone();
        let batch = self.batch(&dev, ids, ids, 1, ids.len())?;
        let y = self.trunk(ctx, &batch)?;
        self.stack.logits_at(ctx, &y, ids.len() - 1)
    }

    /// Continues `prompt` (one sequence) by `sampling.max_new_tokens` tokens, feeding each token once
    /// through the blocks with a key/value cache per block ([`KvCache`], host memory; the attention of
    /// each new token is computed on the host, the linears and norms where the model lives). Run it in an
    /// evaluation pass (`model.forward(Mode::Eval, |m, ctx| m.generate(ctx, ...))`; with several ranks
    /// every rank must call it, and `FsdpModel::gather_all` first saves a gather per token and unit).
    /// Returns the new tokens. The prompt plus the new tokens must fit the position table.
    pub fn generate(
        &mut self,
        ctx: &mut Ctx<'_>,
        prompt: &[i32],
        sampling: &Sampling,
    ) -> Result<Vec<i32>, GptError> {
        let (heads, hd) = (self.config.heads, self.config.d_model / self.config.heads);
        let (wte, wpe) = (&self.wte, &self.wpe);
        self.stack.generate(
            ctx,
            prompt,
            sampling,
            self.config.seq_len,
            || KvCache::new(heads, hd),
            |ctx, token, position| Ok(wte.forward_at::<T>(ctx, token, position, wpe)?),
        )
    }
}

impl<T: Activation> Module for Gpt<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        // The peer's `named_parameters()` order: wte, wpe, h.N.*, ln_f (the tied head adds nothing).
        v.child("wte", &mut self.wte)?;
        v.child("wpe", &mut self.wpe)?;
        v.child("h", &mut self.stack.blocks)?;
        v.child("ln_f", &mut self.stack.norm)?;
        if self.config.tie_embeddings {
            // The registration visit has just assigned the table's id.
            self.stack.head.set_table(self.wte.weight_id());
        }
        // Tied, the head declares nothing; it is visited anyway so that model-wide passes reach it
        // (`fsdp_nn::convert_lm_heads_to_fp8`).
        v.child("lm_head", &mut self.stack.head)
    }
}
