//! Language models on the Trainer: [`LmTask`] trains any [`LanguageModel`] (today the GPT-2 family,
//! [`crate::gpt::Gpt`]) on a token stream in llm.c's format with the PyTorch peer's run: each optimizer
//! step draws `batch_size x world_size` windows of `train.bin` per micro-batch from one seeded stream (rank
//! 0's stream, its position saved in checkpoints) and gives each rank its share, so the data does not
//! depend on the world size; AdamW with betas (0.9, 0.95) and weight decay 0.1 on matrices; warm-up then
//! cosine to a tenth; validation on every non-overlapping window of `val.bin`, the batches split over the
//! ranks. `lm_fsdp` is its binary.

mod task;

pub use task::{peer_adamw_options, peer_schedule, LmOptions, LmTask, SAMPLE_PROMPT};

use crate::gpt::{Gpt, GptConfig, GptError, Sampling, GPT2_PADDED_VOCAB, PRESETS};
use fsdp_nn::{Activation, LossStats, TokenBatch};
use fsdp_shard::{Ctx, Module, WrapPolicy};

/// What the LM task needs of a model.
pub trait LanguageModel: Module + Sized {
    /// Builds the model of `spec`.
    fn build(spec: &LmSpec) -> Result<Self, GptError>;
    /// How its parameters are grouped into FSDP units.
    fn wrap_policy() -> WrapPolicy;
    /// The forward up to the loss (training or evaluation, as the pass is).
    fn forward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError>;
    /// A training forward that may compute the head's gradients early.
    fn forward_train(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError>;
    /// The backward of the batch's mean loss.
    fn backward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError>;
    /// The loss of the last forward.
    fn loss(&self) -> Result<&LossStats, GptError>;
    /// Continues `prompt` (an evaluation pass).
    fn generate(
        &mut self,
        ctx: &mut Ctx<'_>,
        prompt: &[i32],
        sampling: &Sampling,
    ) -> Result<Vec<i32>, GptError>;
}

/// A model's shape: a preset with overrides, the vocabulary and the sequence length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmSpec {
    /// The preset's name.
    pub preset: String,
    /// Width.
    pub d_model: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Vocabulary rows.
    pub vocab: usize,
    /// Sequence length (the position table's rows).
    pub seq_len: usize,
    /// Recompute each block in the backward.
    pub recompute_blocks: bool,
    /// Seed of the embedding table (the other parameters draw from the run's seed and their names).
    pub seed: u64,
}

impl LmSpec {
    /// The preset `name` with optional overrides, checked (the messages name the flags).
    pub fn from_preset(
        name: &str,
        d_model: Option<usize>,
        layers: Option<usize>,
        heads: Option<usize>,
        seq_len: usize,
    ) -> Result<Self, GptError> {
        let &(_, d, l, h) = PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
            GptError::Config(format!(
                "--preset {name:?} is not a preset (one of {})",
                PRESETS.map(|p| p.0).join(", ")
            ))
        })?;
        let spec = LmSpec {
            preset: name.to_string(),
            d_model: d_model.unwrap_or(d),
            layers: layers.unwrap_or(l),
            heads: heads.unwrap_or(h),
            vocab: GPT2_PADDED_VOCAB,
            seq_len,
            recompute_blocks: false,
            seed: 1,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Refuses shapes the kernels do not support, before any work, naming the flags.
    pub fn validate(&self) -> Result<(), GptError> {
        let bad = |m: String| Err(GptError::Config(m));
        for (flag, v) in [
            ("--d-model", self.d_model),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--seq-len", self.seq_len),
        ] {
            if v == 0 {
                return bad(format!("{flag} must be at least 1"));
            }
        }
        if self.d_model % self.heads != 0 {
            return bad(format!(
                "--heads {} does not divide the width {} (--d-model)",
                self.heads, self.d_model
            ));
        }
        let hd = self.d_model / self.heads;
        if !fp8_kernels::attention::HEAD_DIMS.contains(&hd) {
            return bad(format!(
                "--d-model {} / --heads {} gives a head dim of {hd}; the attention kernels support head \
                 dims {:?}",
                self.d_model,
                self.heads,
                fp8_kernels::attention::HEAD_DIMS
            ));
        }
        Ok(())
    }

    /// The GPT configuration of this shape.
    pub fn gpt_config(&self) -> GptConfig {
        GptConfig {
            vocab: self.vocab,
            recompute_blocks: self.recompute_blocks,
            seed: self.seed,
            ..GptConfig::new(self.d_model, self.layers, self.heads, self.seq_len)
        }
    }
}

impl<T: Activation> LanguageModel for Gpt<T> {
    fn build(spec: &LmSpec) -> Result<Self, GptError> {
        Gpt::new(spec.gpt_config())
    }
    fn wrap_policy() -> WrapPolicy {
        crate::gpt::wrap_policy()
    }
    fn forward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        Gpt::forward(self, ctx, batch)
    }
    fn forward_train(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        self.forward_with_grad(ctx, batch)
    }
    fn backward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
        Gpt::backward(self, ctx, batch)
    }
    fn loss(&self) -> Result<&LossStats, GptError> {
        Gpt::loss(self)
    }
    fn generate(
        &mut self,
        ctx: &mut Ctx<'_>,
        prompt: &[i32],
        sampling: &Sampling,
    ) -> Result<Vec<i32>, GptError> {
        Gpt::generate(self, ctx, prompt, sampling)
    }
}
