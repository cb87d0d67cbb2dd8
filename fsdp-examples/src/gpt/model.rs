//! The GPT model: its layers and their order.

use super::{GptConfig, GptError};
use fp8_kernels::Device;
use fsdp_nn::init::stream_seed;
use fsdp_nn::{
    Activation, BlockConfig, BlockPrecisions, Embedding, Layer, LmHead, LossStats, Norm, Recompute,
    Tensor, TokenBatch, TransformerBlock,
};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};
use half::bf16;

/// Streams of the initial weights (see [`stream_seed`]); an untied head draws `wte`'s values.
const WTE_STREAM: u64 = 1;
const WPE_STREAM: u64 = 2;
const BLOCK_STREAM: u64 = 100;

/// The GPT-2 family model (see the module docs of [`crate::gpt`]): `wte`, `wpe`, blocks `h.N`, `ln_f`
/// and the LM head with its loss, over activations `T` (`bf16` to train, `f32` for checks).
pub struct Gpt<T: Activation = bf16> {
    config: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Box<dyn Layer<T>>>,
    ln_f: Norm<T>,
    head: LmHead<T>,
    /// `ln_f`'s input, kept for its backward.
    last_x: Option<Tensor<T>>,
}

impl<T: Activation> std::fmt::Debug for Gpt<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt").field("config", &self.config).finish()
    }
}

impl<T: Activation> Gpt<T> {
    /// The model `config` describes, initialised from `config.seed`: every 2-D parameter `N(0, 0.02^2)`
    /// except `attn_proj` and `mlp_proj`, `N(0, (0.02 / sqrt(2 L))^2)`; norm weights 1.
    pub fn new(config: GptConfig) -> Result<Self, GptError> {
        config.validate()?;
        let c = &config;
        let d = c.d_model;
        let s = |k: u64| stream_seed(c.seed, k);
        let mut h: Vec<Box<dyn Layer<T>>> = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let block = BlockConfig {
                precisions: BlockPrecisions {
                    c_attn: c.linear_precision::<T>(d, 3 * d),
                    attn_proj: c.linear_precision::<T>(d, d),
                    c_fc: c.linear_precision::<T>(d, 4 * d),
                    mlp_proj: c.linear_precision::<T>(4 * d, d),
                },
                norm: c.norm,
                seed: s(BLOCK_STREAM + i as u64),
                attention: c.attention,
                fuse_norm_fp8: c.fuse_norm_fp8,
                ..BlockConfig::gpt2(d, c.heads, c.layers, fsdp_nn::LinearPrecision::Fp8)
            };
            let b = TransformerBlock::<T>::new(&block)?;
            if c.recompute_blocks {
                h.push(Box::new(Recompute::new(b)));
            } else {
                h.push(Box::new(b));
            }
        }
        let head = if c.tie_embeddings {
            LmHead::tied(d, c.vocab)?
        } else {
            LmHead::new(d, c.vocab, s(WTE_STREAM))?
        }
        .with_chunk(c.head_chunk)?;
        Ok(Gpt {
            wte: Embedding::new(c.vocab, d, s(WTE_STREAM))?,
            wpe: Embedding::new(c.seq_len, d, s(WPE_STREAM))?,
            h,
            ln_f: Norm::of_kind(c.norm, d)?,
            head,
            last_x: None,
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
        if seq > self.config.seq_len {
            return Err(GptError::Config(format!(
                "sequences of {seq} tokens; the model's position table has {}",
                self.config.seq_len
            )));
        }
        Ok(TokenBatch::new(
            device,
            inputs,
            targets,
            batch,
            seq,
            self.config.vocab,
        )?)
    }

    fn check(&self, batch: &TokenBatch) -> Result<(), GptError> {
        if batch.vocab() != self.config.vocab || batch.seq() > self.config.seq_len {
            return Err(GptError::Config(format!(
                "a batch of sequences of {} checked against {} ids; the model takes up to {} tokens of {}",
                batch.seq(),
                batch.vocab(),
                self.config.seq_len,
                self.config.vocab
            )));
        }
        Ok(())
    }

    /// Embeddings, blocks and `ln_f`: the head's input.
    fn trunk(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<Tensor<T>, GptError> {
        self.check(batch)?;
        let mut x = self.wte.forward::<T>(ctx, batch, Some(&self.wpe))?;
        for block in &mut self.h {
            x = block.forward(ctx, x)?;
        }
        let y = self.ln_f.forward_ref(ctx, &x)?;
        self.last_x = ctx.is_training().then_some(x);
        Ok(y)
    }

    /// The forward up to the loss (a training forward keeps what the backward needs; an evaluation
    /// forward, `Mode::Eval`, keeps nothing). The mean loss over the batch's tokens is then on the device
    /// in [`Gpt::loss`]; nothing is read back.
    pub fn forward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        let y = self.trunk(ctx, batch)?;
        self.head.forward(ctx, y, batch.targets())?;
        Ok(())
    }

    /// A training forward that also computes the LM head's gradients, for a backward with the same
    /// `grad_scale`: the backward then does not recompute the head's logits (one GEMM of
    /// `2 tokens d vocab` flops fewer per step).
    pub fn forward_with_grad(
        &mut self,
        ctx: &mut Ctx<'_>,
        batch: &TokenBatch,
        grad_scale: f32,
    ) -> Result<(), GptError> {
        let y = self.trunk(ctx, batch)?;
        self.head
            .forward_with_grad(ctx, y, batch.targets(), grad_scale)?;
        Ok(())
    }

    /// The backward of `grad_scale` times the batch's mean loss, after a training forward of the same
    /// batch. For the mean over a global batch of `world_size` ranks times `micro_batches` equal batches
    /// pass `1 / (world_size * micro_batches)`.
    pub fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        batch: &TokenBatch,
        grad_scale: f32,
    ) -> Result<(), GptError> {
        self.check(batch)?;
        let dy = self.head.backward(ctx, batch.targets(), grad_scale)?;
        let x = self
            .last_x
            .take()
            .ok_or_else(|| GptError::Config("backward without a training forward".into()))?;
        let mut dx = self
            .ln_f
            .backward_ref(ctx, &x, &dy, None)?
            .ok_or_else(|| GptError::Config("no gradient from ln_f".into()))?;
        drop((x, dy));
        for block in self.h.iter_mut().rev() {
            dx = block
                .backward(ctx, dx, true)?
                .ok_or_else(|| GptError::Config("no gradient from a block".into()))?;
        }
        self.wte.backward(ctx, &dx, batch, Some(&self.wpe))?;
        Ok(())
    }

    /// The loss of the last forward (device buffers: sum, per-token losses; [`LossStats::mean`] reads
    /// the mean back).
    pub fn loss(&self) -> Result<&LossStats, GptError> {
        Ok(self.head.loss()?)
    }

    /// Frees everything the last training forward kept (e.g. after a forward that will not be followed
    /// by a backward).
    pub fn forget_saved(&mut self) {
        self.last_x = None;
        for b in &mut self.h {
            b.forget_saved();
        }
        self.ln_f.forget_saved();
        self.head.drop_saved();
    }
}

impl<T: Activation> Module for Gpt<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        // The peer's `named_parameters()` order: wte, wpe, h.N.*, ln_f (the tied head adds nothing).
        v.child("wte", &mut self.wte)?;
        v.child("wpe", &mut self.wpe)?;
        v.child("h", &mut self.h)?;
        v.child("ln_f", &mut self.ln_f)?;
        if self.config.tie_embeddings {
            // The registration visit has just assigned the table's id.
            self.head.set_table(self.wte.weight_id());
            Ok(())
        } else {
            v.child("lm_head", &mut self.head)
        }
    }
}
