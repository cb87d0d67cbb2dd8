//! What every decoder language model here shares below its embedding: the stack of pre-norm blocks
//! (each kept or recomputed in the backward), the final norm, the chunked LM head with its loss, and
//! token-by-token generation with a key/value cache per block ([`Sampling`]). A model ([`crate::gpt::Gpt`],
//! [`crate::llama::Llama`]) adds its embedding, its parameter names and its configuration.

use crate::ModelError;
use fp8_kernels::rng::SplitMix64;
use fsdp_nn::{
    Activation, KvCache, Layer, LmHead, LossStats, NnError, Norm, Recompute, Shape, Tensor,
    TokenBatch, TransformerBlock,
};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};

/// A block, kept or recomputed in the backward.
pub(crate) enum Block<T: Activation> {
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

/// How [`DecoderStack::generate`] picks each next token.
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

/// The blocks, the final norm and the head of a decoder (see the module docs), with the final norm's
/// input kept for its backward.
pub(crate) struct DecoderStack<T: Activation> {
    pub(crate) blocks: Vec<Block<T>>,
    pub(crate) norm: Norm<T>,
    pub(crate) head: LmHead<T>,
    d: usize,
    /// Rows of the embedding (and the head).
    vocab: usize,
    /// The longest sequence (position table or RoPE tables).
    seq_len: usize,
    /// What bounds the sequence length, for messages ("position table", "RoPE tables").
    positions: &'static str,
    last_x: Option<Tensor<T>>,
}

impl<T: Activation> DecoderStack<T> {
    /// Bytes the blocks, the final norm's input and the head hold for the backward (after a training
    /// forward): each kept block's activations ([`TransformerBlock::saved_bytes`]) or a recomputed
    /// block's input, and the head's.
    pub(crate) fn held_bytes(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| match b {
                Block::Keep(b) => b.saved_bytes(),
                Block::Recompute(r) => r.saved_input_bytes::<T>(),
            })
            .sum();
        blocks + self.head.saved_bytes() + self.last_x.as_ref().map_or(0, |x| x.data().num_bytes())
    }

    /// The stack of `blocks` (wrapped in [`Recompute`] when `recompute`), `norm` and `head` of width `d`,
    /// for `vocab` ids and sequences of up to `seq_len` tokens (bounded by the model's `positions`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        blocks: Vec<TransformerBlock<T>>,
        recompute: bool,
        norm: Norm<T>,
        head: LmHead<T>,
        d: usize,
        vocab: usize,
        seq_len: usize,
        positions: &'static str,
    ) -> Self {
        let blocks = blocks
            .into_iter()
            .map(|b| {
                if recompute {
                    Block::Recompute(Recompute::new(b))
                } else {
                    Block::Keep(b)
                }
            })
            .collect();
        DecoderStack {
            blocks,
            norm,
            head,
            d,
            vocab,
            seq_len,
            positions,
            last_x: None,
        }
    }

    /// A batch for the model: `batch` sequences of `seq <= seq_len` ids and their targets, checked
    /// against the vocabulary and uploaded to `device` (see [`TokenBatch::new`]).
    pub(crate) fn batch(
        &self,
        device: &fp8_kernels::Device,
        inputs: &[i32],
        targets: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<TokenBatch, ModelError> {
        if seq > self.seq_len {
            return Err(ModelError::Config(format!(
                "sequences of {seq} tokens; the model takes up to {} (its {})",
                self.seq_len, self.positions
            )));
        }
        Ok(TokenBatch::new(
            device, inputs, targets, batch, seq, self.vocab,
        )?)
    }

    /// Refuses a batch made for another vocabulary or longer sequences.
    pub(crate) fn check(&self, batch: &TokenBatch) -> Result<(), ModelError> {
        if batch.vocab() != self.vocab || batch.seq() > self.seq_len {
            return Err(ModelError::Config(format!(
                "a batch of sequences of {} checked against {} ids; the model takes up to {} tokens of {}",
                batch.seq(),
                batch.vocab(),
                self.seq_len,
                self.vocab
            )));
        }
        Ok(())
    }

    /// The head and its loss on the trunk's output `y`; with `with_grad` (a training forward) the head's
    /// gradients too, so the backward does not recompute the logits.
    pub(crate) fn head_forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        y: Tensor<T>,
        targets: &fp8_kernels::Buffer<i32>,
        with_grad: bool,
    ) -> Result<(), ModelError> {
        if with_grad {
            self.head.forward_with_grad(ctx, y, targets, 1.0)?;
        } else {
            self.head.forward(ctx, y, targets)?;
        }
        Ok(())
    }

    /// Blocks and the final norm on the embedded input `x`: the head's input. A training pass keeps the
    /// norm's input for the backward.
    pub(crate) fn trunk(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: Tensor<T>,
    ) -> Result<Tensor<T>, ModelError> {
        let mut x = x;
        for block in &mut self.blocks {
            x = block.layer().forward(ctx, x)?;
        }
        let y = self.norm.forward_ref(ctx, &x)?;
        self.last_x = ctx.is_training().then_some(x);
        Ok(y)
    }

    /// The backward from the loss through the head, the final norm and the blocks: the gradient of the
    /// embedded input, after a training forward.
    pub(crate) fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        targets: &fp8_kernels::Buffer<i32>,
    ) -> Result<Tensor<T>, ModelError> {
        let dy = self.head.backward(ctx, targets, 1.0)?;
        let x = self
            .last_x
            .take()
            .ok_or_else(|| ModelError::Config("backward without a training forward".into()))?;
        let mut dx = self
            .norm
            .backward_ref(ctx, &x, &dy, None)?
            .ok_or_else(|| ModelError::Config("no gradient from the final norm".into()))?;
        drop((x, dy));
        for block in self.blocks.iter_mut().rev() {
            dx = block.layer().backward(ctx, dx)?;
        }
        Ok(dx)
    }

    /// The loss of the last forward.
    pub(crate) fn loss(&self) -> Result<&LossStats, ModelError> {
        Ok(self.head.loss()?)
    }

    /// Frees everything the last training forward kept.
    pub(crate) fn forget_saved(&mut self) {
        self.last_x = None;
        for b in &mut self.blocks {
            b.layer().forget_saved();
        }
        self.norm.forget_saved();
        self.head.drop_saved();
    }

    /// The f32 logits of every row of the head's input `y` (`[.., d]`), `[rows, vocab]` row-major: one
    /// head GEMM and one read back.
    pub(crate) fn logits(
        &mut self,
        ctx: &mut Ctx<'_>,
        y: &Tensor<T>,
    ) -> Result<Vec<f32>, ModelError> {
        let logits = self.head.logits(ctx, y)?;
        Ok(logits
            .data()
            .to_vec()
            .map_err(NnError::from)?
            .iter()
            .map(|v| v.to_f32())
            .collect())
    }

    /// The f32 logits of row `row` of the head's input `y` (`[.., d]`).
    pub(crate) fn logits_at(
        &mut self,
        ctx: &mut Ctx<'_>,
        y: &Tensor<T>,
        row: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let d = self.d;
        let mut last = ctx.device().uninit::<T>(d)?;
        last.copy_range_from(0, y.data(), row * d, d)
            .map_err(NnError::from)?;
        self.logits(ctx, &Tensor::new(last, Shape::matrix(1, d)?)?)
    }

    /// Continues `prompt` (one sequence) by `sampling.max_new_tokens` tokens, feeding each token once
    /// through the blocks with one key/value cache per block (`new_cache` makes them; the attention of
    /// each new token is computed on the host, the linears and norms where the model lives). `embed`
    /// embeds a token at a position (`[1, 1, d]`); `limit` is the longest sequence the model takes.
    /// Run it in an evaluation pass; with several ranks every rank must call it.
    pub(crate) fn generate(
        &mut self,
        ctx: &mut Ctx<'_>,
        prompt: &[i32],
        sampling: &Sampling,
        limit: usize,
        new_cache: impl Fn() -> KvCache,
        mut embed: impl FnMut(&mut Ctx<'_>, i32, usize) -> Result<Tensor<T>, ModelError>,
    ) -> Result<Vec<i32>, ModelError> {
        if ctx.is_training() {
            return Err(ModelError::Config(
                "generate is for evaluation passes".into(),
            ));
        }
        let total = prompt.len() + sampling.max_new_tokens;
        if prompt.is_empty() || total > limit {
            return Err(ModelError::Config(format!(
                "a prompt of {} tokens and {} new ones; the model takes up to {limit} positions",
                prompt.len(),
                sampling.max_new_tokens,
            )));
        }
        if !(sampling.temperature >= 0.0 && sampling.temperature.is_finite()) {
            return Err(ModelError::Config(format!(
                "temperature {} (finite, >= 0)",
                sampling.temperature
            )));
        }
        if sampling.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let mut caches: Vec<KvCache> = (0..self.blocks.len()).map(|_| new_cache()).collect();
        let mut rng = SplitMix64::new(sampling.seed);
        let mut out = Vec::with_capacity(sampling.max_new_tokens);
        let mut next = prompt[0];
        for position in 0..total - 1 {
            let mut x = embed(ctx, next, position)?;
            for (block, cache) in self.blocks.iter_mut().zip(&mut caches) {
                x = block.block().decode(ctx, x, cache)?;
            }
            next = if position + 1 < prompt.len() {
                prompt[position + 1]
            } else {
                let y = self.norm.forward_ref(ctx, &x)?;
                let logits = self.logits(ctx, &y)?;
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
