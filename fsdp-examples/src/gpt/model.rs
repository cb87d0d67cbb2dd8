//! The GPT model: its layers and their order.

use super::{GptConfig, GptError};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::Device;
use fsdp_nn::init::stream_seed;
use fsdp_nn::{
    Activation, BlockConfig, Embedding, KvCache, Layer, LmHead, LossStats, NnError, Norm,
    Recompute, Tensor, TokenBatch, TransformerBlock,
};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};
use half::bf16;

/// The stream an untied head and `wte` both draw from (see [`stream_seed`]), so they start equal.
const WTE_STREAM: u64 = 1;

/// A block, kept or recomputed in the backward.
enum Block<T: Activation> {
    Keep(TransformerBlock<T>),
    Recompute(Recompute<TransformerBlock<T>>),
}

impl<T: Activation> Block<T> {
    fn layer(&mut self) -> &mut dyn Layer<T> {
        match self {
            Block::Keep(b) => b,
            Block::Recompute(b) => b,
        }
    }

    fn block(&mut self) -> &mut TransformerBlock<T> {
        match self {
            Block::Keep(b) => b,
            Block::Recompute(b) => b.inner_mut(),
        }
    }
}

impl<T: Activation> Module for Block<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        match self {
            Block::Keep(b) => b.visit(v),
            Block::Recompute(b) => b.visit(v),
        }
    }
}

/// How [`Gpt::generate`] picks each next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// `0`: the most likely token (greedy); otherwise sample from `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Seed of the sampling.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding of `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Sampling {
            max_new_tokens,
            temperature: 0.0,
            top_k: None,
            seed: 0,
        }
    }
}

/// The GPT-2 family model (see the module docs of [`crate::gpt`]): `wte`, `wpe`, blocks `h.N`, `ln_f`
/// and the LM head with its loss, over activations `T` (`bf16` to train, `f32` for checks).
pub struct Gpt<T: Activation = bf16> {
    config: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Block<T>>,
    ln_f: Norm<T>,
    head: LmHead<T>,
    /// `ln_f`'s input, kept for its backward.
    last_x: Option<Tensor<T>>,
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
        let mut h = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            let block = BlockConfig {
                norm: c.norm,
                attention: c.attention,
                fuse_norm_fp8: c.fuse_norm_fp8,
                ..BlockConfig::gpt2(d, c.heads, c.layers)
            };
            let b = TransformerBlock::<T>::new(&block)?;
            h.push(if c.recompute_blocks {
                Block::Recompute(Recompute::new(b))
            } else {
                Block::Keep(b)
            });
        }
        let head = if c.tie_embeddings {
            LmHead::tied(d, c.vocab)?
        } else {
            LmHead::new(d, c.vocab)?.with_seed(s(WTE_STREAM))
        }
        .with_chunk(c.head_chunk)?;
        Ok(Gpt {
            wte: Embedding::new(c.vocab, d)?.with_seed(s(WTE_STREAM)),
            wpe: Embedding::new(c.seq_len, d)?,
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
            x = block.layer().forward(ctx, x)?;
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

    /// A training forward that also computes the LM head's gradients: the backward then does not
    /// recompute the head's logits (one GEMM of `2 tokens d vocab` flops fewer per step).
    pub fn forward_with_grad(
        &mut self,
        ctx: &mut Ctx<'_>,
        batch: &TokenBatch,
    ) -> Result<(), GptError> {
        let y = self.trunk(ctx, batch)?;
        self.head.forward_with_grad(ctx, y, batch.targets(), 1.0)?;
        Ok(())
    }

    /// The backward of the batch's mean loss, after a training forward of the same batch (the sharded
    /// model's reduction averages over ranks and micro-batches).
    pub fn backward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        self.check(batch)?;
        let dy = self.head.backward(ctx, batch.targets(), 1.0)?;
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
            dx = block.layer().backward(ctx, dx)?;
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
            b.layer().forget_saved();
        }
        self.ln_f.forget_saved();
        self.head.drop_saved();
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
        let d = self.config.d_model;
        let mut last = dev.uninit::<T>(d)?;
        last.copy_range_from(0, y.data(), (ids.len() - 1) * d, d)
            .map_err(NnError::from)?;
        let last = Tensor::new(last, fsdp_nn::Shape::matrix(1, d)?)?;
        let logits = self.head.logits(ctx, &last)?;
        Ok(logits
            .data()
            .to_vec()
            .map_err(NnError::from)?
            .iter()
            .map(|v| v.to_f32())
            .collect())
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
        if ctx.is_training() {
            return Err(GptError::Config("generate is for evaluation passes".into()));
        }
        let total = prompt.len() + sampling.max_new_tokens;
        if prompt.is_empty() || total > self.config.seq_len {
            return Err(GptError::Config(format!(
                "a prompt of {} tokens and {} new ones; the position table has {}",
                prompt.len(),
                sampling.max_new_tokens,
                self.config.seq_len
            )));
        }
        if !(sampling.temperature >= 0.0 && sampling.temperature.is_finite()) {
            return Err(GptError::Config(format!(
                "temperature {} (finite, >= 0)",
                sampling.temperature
            )));
        }
        if sampling.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let (heads, hd) = (self.config.heads, self.config.d_model / self.config.heads);
        let mut caches: Vec<KvCache> = (0..self.h.len()).map(|_| KvCache::new(heads, hd)).collect();
        let mut rng = SplitMix64::new(sampling.seed);
        let mut out = Vec::with_capacity(sampling.max_new_tokens);
        let mut next = prompt[0];
        for position in 0..total - 1 {
            let mut x = self.wte.forward_at::<T>(ctx, next, position, &self.wpe)?;
            for (block, cache) in self.h.iter_mut().zip(&mut caches) {
                x = block.block().decode(ctx, x, cache)?;
            }
            next = if position + 1 < prompt.len() {
                prompt[position + 1]
            } else {
                let y = self.ln_f.forward_ref(ctx, &x)?;
                let y = y.reshape(fsdp_nn::Shape::matrix(1, self.config.d_model)?)?;
                let logits: Vec<f32> = self
                    .head
                    .logits(ctx, &y)?
                    .data()
                    .to_vec()
                    .map_err(NnError::from)?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect();
                let t = pick(&logits, sampling, &mut rng);
                out.push(t);
                t
            };
        }
        Ok(out)
    }
}

/// The next token from `logits`: the first maximum when greedy, else a draw from the softmax of the
/// (top-k) logits divided by the temperature.
fn pick(logits: &[f32], sampling: &Sampling, rng: &mut SplitMix64) -> i32 {
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0;
    if sampling.temperature == 0.0 {
        return argmax as i32;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if let Some(k) = sampling.top_k {
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        order.truncate(k.max(1));
    }
    let m = logits[argmax] as f64;
    let t = sampling.temperature as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - m) / t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform_f32() as f64 * total;
    for (&i, &w) in order.iter().zip(&weights) {
        if u < w {
            return i as i32;
        }
        u -= w;
    }
    order[order.len() - 1] as i32
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
