//! Language models on the Trainer: [`LmTask`] trains any [`LanguageModel`] (the GPT-2 family,
//! [`crate::gpt::Gpt`], and the Llama 3 family, [`crate::llama::Llama`]) on a token stream in llm.c's format with the PyTorch peer's run: each optimizer
//! step draws `batch_size x world_size` windows of `train.bin` per micro-batch from one seeded stream (rank
//! 0's stream, its position saved in checkpoints) and gives each rank its share, so the data does not
//! depend on the world size; AdamW with betas (0.9, 0.95) and weight decay 0.1 on matrices; warm-up then
//! cosine to a tenth; validation on every non-overlapping window of `val.bin`, the batches split over the
//! ranks. `lm_fsdp` is its binary.

mod task;

pub use task::{peer_adamw_options, peer_schedule, LmOptions, LmTask, SAMPLE_PROMPT};

use crate::gpt::{Gpt, GptConfig, GptError, Sampling, GPT2_PADDED_VOCAB, PRESETS};
use crate::hf::{HfLlamaFormat, LlamaHfConfig};
use crate::llama::{self, Llama, LlamaConfig, LLAMA3_VOCAB};
use fsdp_nn::{Activation, LossStats, TokenBatch, DEFAULT_HEAD_CHUNK};
use fsdp_shard::{Ctx, Module, WrapPolicy};
use fsdp_train::{MemoryEstimate, MemoryPlan, MemoryRemedy};

/// A model family: its presets, its layers and its names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LmFamily {
    /// GPT-2 ([`crate::gpt`]).
    Gpt2,
    /// Llama 3 ([`crate::llama`]).
    Llama3,
}

impl LmFamily {
    /// The family of preset `name`, if it is one.
    pub fn of_preset(name: &str) -> Option<LmFamily> {
        if PRESETS.iter().any(|p| p.0 == name) {
            Some(LmFamily::Gpt2)
        } else if llama::PRESETS.iter().any(|p| p.name == name) {
            Some(LmFamily::Llama3)
        } else {
            None
        }
    }

    /// Every preset name, GPT-2's then Llama's.
    pub fn preset_names() -> Vec<&'static str> {
        PRESETS
            .iter()
            .map(|p| p.0)
            .chain(llama::PRESETS.iter().map(|p| p.name))
            .collect()
    }

    /// The vocabulary of the speed mode (the peer's: GPT-2's padded one, Llama 3's).
    pub fn speed_vocab(self) -> usize {
        match self {
            LmFamily::Gpt2 => GPT2_PADDED_VOCAB,
            LmFamily::Llama3 => LLAMA3_VOCAB,
        }
    }
}

/// What the LM task needs of a model.
pub trait LanguageModel: Module + Sized {
    /// The family this model type builds.
    const FAMILY: LmFamily;
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
    /// Bytes held for the backward after a training forward (the blocks' activations and the head's
    /// input).
    fn held_bytes(&self) -> usize;
    /// Continues `prompt` (an evaluation pass).
    fn generate(
        &mut self,
        ctx: &mut Ctx<'_>,
        prompt: &[i32],
        sampling: &Sampling,
    ) -> Result<Vec<i32>, GptError>;
}

/// A model's shape: a preset with overrides (or a Hugging Face `config.json`), the vocabulary and the
/// sequence length.
#[derive(Debug, Clone, PartialEq)]
pub struct LmSpec {
    /// The preset's name.
    pub preset: String,
    /// The family.
    pub family: LmFamily,
    /// Width.
    pub d_model: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads (GPT-2: as many as heads).
    pub kv_heads: usize,
    /// MLP hidden width (GPT-2: `4 d`; Llama: the SwiGLU width).
    pub ffn: usize,
    /// The head shares the embedding.
    pub tied: bool,
    /// Vocabulary rows.
    pub vocab: usize,
    /// Sequence length (the position table's rows).
    pub seq_len: usize,
    /// Recompute each block in the backward.
    pub recompute_blocks: bool,
    /// The first this many blocks recompute their MLP's up output in the backward
    /// (`TransformerBlock::recompute_mlp_up`).
    pub recompute_mlp_up: usize,
    /// Seed of the embedding table (the other parameters draw from the run's seed and their names).
    pub seed: u64,
    /// The Hugging Face config the model was read from (`--init-from` a Llama checkpoint): its RoPE
    /// base and scaling, norm eps and other keys are kept.
    pub hf_config: Option<LlamaHfConfig>,
}

/// Overrides of a preset's shape (the shape flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShapeOverrides {
    /// `--d-model`.
    pub d_model: Option<usize>,
    /// `--layers`.
    pub layers: Option<usize>,
    /// `--heads`.
    pub heads: Option<usize>,
    /// `--kv-heads`.
    pub kv_heads: Option<usize>,
    /// `--ffn`.
    pub ffn: Option<usize>,
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
        let o = ShapeOverrides {
            d_model,
            layers,
            heads,
            ..ShapeOverrides::default()
        };
        Self::with_overrides(name, o, seq_len)
    }

    /// The preset `name` with the shape flags' overrides, checked.
    pub fn with_overrides(name: &str, o: ShapeOverrides, seq_len: usize) -> Result<Self, GptError> {
        let family = LmFamily::of_preset(name).ok_or_else(|| {
            GptError::Config(format!(
                "--preset {name:?} is not a preset (one of {})",
                LmFamily::preset_names().join(", ")
            ))
        })?;
        let spec = match family {
            LmFamily::Gpt2 => {
                if o.kv_heads.is_some() || o.ffn.is_some() {
                    return Err(GptError::Config(format!(
                        "--kv-heads and --ffn apply to the Llama presets; {name} is a GPT-2 preset"
                    )));
                }
                let &(_, d, l, h) = PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
                    GptError::Config(format!("--preset {name:?} is not a GPT-2 preset"))
                })?;
                let (d, h) = (o.d_model.unwrap_or(d), o.heads.unwrap_or(h));
                let ffn = d.checked_mul(4).ok_or_else(|| {
                    GptError::Config(format!(
                        "--d-model {d} is too large (the MLP width 4 x d overflows)"
                    ))
                })?;
                LmSpec {
                    preset: name.to_string(),
                    family,
                    d_model: d,
                    layers: o.layers.unwrap_or(l),
                    heads: h,
                    kv_heads: h,
                    ffn,
                    tied: true,
                    vocab: GPT2_PADDED_VOCAB,
                    seq_len,
                    recompute_blocks: false,
                    recompute_mlp_up: 0,
                    seed: 1,
                    hf_config: None,
                }
            }
            LmFamily::Llama3 => {
                let p = llama::find_preset(name)?;
                LmSpec {
                    preset: name.to_string(),
                    family,
                    d_model: o.d_model.unwrap_or(p.d_model),
                    layers: o.layers.unwrap_or(p.layers),
                    heads: o.heads.unwrap_or(p.heads),
                    kv_heads: o.kv_heads.unwrap_or(p.kv_heads),
                    ffn: o.ffn.unwrap_or(p.ffn),
                    tied: p.tied,
                    // The Shakespeare data's GPT-2 ids (the peer's `train`); `--init-from` a Hugging
                    // Face checkpoint takes its vocabulary.
                    vocab: GPT2_PADDED_VOCAB,
                    seq_len,
                    recompute_blocks: false,
                    recompute_mlp_up: 0,
                    seed: 1,
                    hf_config: None,
                }
            }
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The shape of a Hugging Face Llama `config.json` (the model `--init-from` names), for sequences
    /// of `seq_len`.
    pub fn from_hf(hf: LlamaHfConfig, seq_len: usize) -> Result<Self, GptError> {
        let c = LlamaConfig::from_hf(&hf, seq_len)?;
        let spec = LmSpec {
            preset: "hf".into(),
            family: LmFamily::Llama3,
            d_model: c.d_model,
            layers: c.layers,
            heads: c.heads,
            kv_heads: c.kv_heads,
            ffn: c.ffn,
            tied: c.tie_embeddings,
            vocab: c.vocab,
            seq_len,
            recompute_blocks: false,
            recompute_mlp_up: 0,
            seed: 1,
            hf_config: Some(hf),
        };
        spec.validate()?;
        Ok(spec)
    }

    /// A lower bound of one rank's peak, by part (the Trainer refuses a run that cannot fit):
    /// - model state: the shape's parameters priced by the run's plan (the same bytes the optimizer's
    ///   memory report counts);
    /// - two blocks' weights gathered in F32 (the one computing and the prefetched next);
    /// - the activations the blocks keep: per token and block `k x (d + m x ffn / 2)` bytes, `m` the
    ///   MLP's matrices (2 GELU, 3 SwiGLU), `k` = 4 on CUDA and 12 on the CPU, below every run
    ///   measured (H200, `bench/run.sh`: gpt2, gpt-3b, gpt-6.7b, llama-1b, llama-3b and llama-8b held 4.6
    ///   to 6.2 beyond their model state and head chunk; the CPU at d 256: 14.6 and 19.4; a test checks
    ///   the H200 runs); with `--recompute` one block's worth plus each block's input; with
    ///   `--recompute-mlp-up N` one byte per element of the up output less in N blocks;
    /// - one chunk of head logits in F32;
    /// - with the optimizer in the backward, the largest unit's gradient shard (a block's, or the
    ///   embeddings' and head's), which the model state then leaves out.
    ///
    /// Without `--recompute` it names two remedies for a refusal: `--recompute-mlp-up N` (the up output's
    /// byte per element in each more block) and `--recompute` (what the activations above save).
    pub fn memory_estimate(&self, b: usize, plan: &MemoryPlan) -> Result<MemoryEstimate, GptError> {
        let s = self;
        let over = |what: &str| {
            GptError::Config(format!(
                "{what} of --batch-size {b} x --seq-len {} x --d-model {} x --layers {} (--heads {}, \
                 --kv-heads {}, --ffn {}) overflows a 64-bit byte count",
                s.seq_len, s.d_model, s.layers, s.heads, s.kv_heads, s.ffn
            ))
        };
        let (d, l, v, ffn) = (
            s.d_model as u64,
            s.layers as u64,
            s.vocab as u64,
            s.ffn as u64,
        );
        let hd = d / (s.heads as u64).max(1);
        let mats = match s.family {
            LmFamily::Gpt2 => 2,
            LmFamily::Llama3 => 3,
        };
        // Per block: the attention's (H + 2 KV) hd x d and d x d, the MLP's m x d x ffn.
        let block = (s.kv_heads as u64)
            .checked_mul(2)
            .and_then(|kv| kv.checked_add(s.heads as u64))
            .and_then(|h| h.checked_mul(hd))
            .and_then(|x| x.checked_mul(d))
            .and_then(|x| x.checked_add(d.checked_mul(d)?))
            .and_then(|x| x.checked_add(d.checked_mul(ffn)?.checked_mul(mats)?))
            .ok_or_else(|| over("the parameters"))?;
        let linear = block.checked_mul(l).ok_or_else(|| over("the parameters"))?;
        // Embeddings (and an untied head, and GPT-2's position table); norms and biases are small.
        let tables = if s.tied { 1 } else { 2 };
        let positions = match s.family {
            LmFamily::Gpt2 => s.seq_len as u64,
            LmFamily::Llama3 => 0,
        };
        let other = v
            .checked_mul(tables)
            .and_then(|x| x.checked_add(positions))
            .and_then(|x| x.checked_mul(d))
            .ok_or_else(|| over("the parameters"))?;
        let state = plan
            .model_state(linear, other)
            .ok_or_else(|| over("the model state"))?;
        let tokens = (b as u64)
            .checked_mul(s.seq_len as u64)
            .ok_or_else(|| over("the tokens"))?;
        let k = if plan.cuda { 4 } else { 12 };
        let per_block = d
            .checked_add(
                ffn.checked_mul(mats)
                    .ok_or_else(|| over("the activations"))?
                    / 2,
            )
            .and_then(|x| x.checked_mul(k))
            .and_then(|x| x.checked_mul(tokens))
            .ok_or_else(|| over("the activations"))?;
        // With --recompute: each block's input (BF16 on CUDA, F32 on the CPU) and one block recomputed.
        let recomputed = tokens
            .checked_mul(d)
            .and_then(|x| x.checked_mul(if plan.cuda { 2 } else { 4 }))
            .and_then(|x| x.checked_mul(l))
            .and_then(|x| x.checked_add(per_block))
            .ok_or_else(|| over("the activations"))?;
        // A block that recomputes its MLP's up output (`(m - 1) ffn` wide) holds at least one byte per
        // element of it less (two in BF16; one keeps the bound below the runs).
        let up_per_block = ffn
            .checked_mul(mats - 1)
            .and_then(|x| x.checked_mul(tokens))
            .ok_or_else(|| over("the activations"))?;
        let acts = if s.recompute_blocks {
            recomputed
        } else {
            per_block
                .checked_mul(l)
                .zip(up_per_block.checked_mul(s.recompute_mlp_up as u64))
                .map(|(a, u)| a.saturating_sub(u))
                .ok_or_else(|| over("the activations"))?
        };
        let gathered = block.checked_mul(8).ok_or_else(|| over("the parameters"))?;
        let head = tokens
            .min(DEFAULT_HEAD_CHUNK as u64)
            .checked_mul(v)
            .and_then(|x| x.checked_mul(4))
            .ok_or_else(|| over("the head"))?;
        let params = linear.saturating_add(other);
        // With the optimizer in the backward one unit's gradient shard lives at a time: a block, or the
        // root (embeddings and head), whichever is larger.
        let transient = plan
            .transient_grad_shards(block.max(other))
            .ok_or_else(|| over("the gradient shards"))?;
        let estimate = MemoryEstimate::default()
            .part(
                format!(
                    "model state of {} parameters (--preset {}) over {} rank(s)",
                    count_text(params),
                    s.preset,
                    plan.world_size
                ),
                state,
            )
            .part("two blocks gathered", gathered)
            .part(
                format!(
                    "activations of --batch-size {b} x --seq-len {} tokens in {} blocks{}",
                    s.seq_len,
                    s.layers,
                    if s.recompute_blocks {
                        " (--recompute)".to_string()
                    } else if s.recompute_mlp_up > 0 {
                        format!(" (--recompute-mlp-up {})", s.recompute_mlp_up)
                    } else {
                        String::new()
                    }
                ),
                acts,
            )
            .part("a chunk of head logits", head);
        // The settings a refusal can name: more blocks recomputing their MLP's up output, or every
        // block recomputed.
        let estimate = if s.recompute_blocks {
            estimate
        } else {
            estimate
                .remedy(MemoryRemedy::count(
                    "--recompute-mlp-up {n}",
                    up_per_block,
                    s.recompute_mlp_up as u64,
                    l,
                ))
                .remedy(MemoryRemedy::switch(
                    "--recompute",
                    acts.saturating_sub(recomputed),
                ))
        };
        Ok(if transient > 0 {
            estimate.part(
                "the largest unit's gradient shard, stepped in the backward (--optimizer-in-backward)",
                transient,
            )
        } else {
            estimate
        })
    }

    /// Refuses shapes the kernels do not support, before any work, naming the flags.
    pub fn validate(&self) -> Result<(), GptError> {
        let bad = |m: String| Err(GptError::Config(m));
        for (flag, v) in [
            ("--d-model", self.d_model),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--ffn", self.ffn),
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
        if self.heads % self.kv_heads != 0 {
            return bad(format!(
                "--kv-heads {} does not divide the {} query heads (--heads)",
                self.kv_heads, self.heads
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
            recompute_mlp_up: self.recompute_mlp_up,
            seed: self.seed,
            ..GptConfig::new(self.d_model, self.layers, self.heads, self.seq_len)
        }
    }

    /// The Llama configuration of this shape (RoPE and eps from the Hugging Face config when read from
    /// one).
    pub fn llama_config(&self) -> Result<LlamaConfig, GptError> {
        let base = match &self.hf_config {
            Some(hf) => LlamaConfig::from_hf(hf, self.seq_len)?,
            None => LlamaConfig::new(
                self.d_model,
                self.layers,
                self.heads,
                self.kv_heads,
                self.ffn,
                self.seq_len,
            ),
        };
        Ok(LlamaConfig {
            d_model: self.d_model,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn: self.ffn,
            vocab: self.vocab,
            tie_embeddings: self.tied,
            recompute_blocks: self.recompute_blocks,
            recompute_mlp_up: self.recompute_mlp_up,
            seed: self.seed,
            ..base
        })
    }

    /// Parameters of the model (the tied matrix once).
    pub fn num_params(&self) -> usize {
        match self.family {
            LmFamily::Gpt2 => self.gpt_config().num_params(),
            LmFamily::Llama3 => self.llama_config().map_or(0, |c| c.num_params()),
        }
    }

    /// Model FLOPs per token of a training step (the peer's formula of the family).
    pub fn flops_per_token(&self) -> f64 {
        match self.family {
            LmFamily::Gpt2 => self.gpt_config().flops_per_token(),
            LmFamily::Llama3 => self.llama_config().map_or(0.0, |c| c.flops_per_token()),
        }
    }

    /// The Hugging Face format of `--export` and `--init-from` for a Llama model (`None` for GPT-2,
    /// whose exports are one safetensors file by our names).
    pub fn hf_format(&self) -> Result<Option<HfLlamaFormat>, GptError> {
        match self.family {
            LmFamily::Gpt2 => Ok(None),
            LmFamily::Llama3 => {
                let hf = match &self.hf_config {
                    // The read config (the model was built from it), keeping its other keys.
                    Some(hf) => hf.clone(),
                    None => self.llama_config()?.to_hf("float32")?,
                };
                Ok(Some(HfLlamaFormat::new(hf)))
            }
        }
    }
}

/// The trait for a model type whose inherent methods have the trait's names and signatures.
macro_rules! language_model {
    ($model:ident, $family:expr, $build:expr, $wrap:path) => {
        impl<T: Activation> LanguageModel for $model<T> {
            const FAMILY: LmFamily = $family;
            fn build(spec: &LmSpec) -> Result<Self, GptError> {
                let build: fn(&LmSpec) -> Result<Self, GptError> = $build;
                build(spec)
            }
            fn wrap_policy() -> WrapPolicy {
                $wrap()
            }
            fn forward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
                $model::forward(self, ctx, batch)
            }
            fn forward_train(
                &mut self,
                ctx: &mut Ctx<'_>,
                batch: &TokenBatch,
            ) -> Result<(), GptError> {
                self.forward_with_grad(ctx, batch)
            }
            fn backward(&mut self, ctx: &mut Ctx<'_>, batch: &TokenBatch) -> Result<(), GptError> {
                $model::backward(self, ctx, batch)
            }
            fn loss(&self) -> Result<&LossStats, GptError> {
                $model::loss(self)
            }
            fn held_bytes(&self) -> usize {
                $model::held_bytes(self)
            }
            fn generate(
                &mut self,
                ctx: &mut Ctx<'_>,
                prompt: &[i32],
                sampling: &Sampling,
            ) -> Result<Vec<i32>, GptError> {
                $model::generate(self, ctx, prompt, sampling)
            }
        }
    };
}

language_model!(
    Gpt,
    LmFamily::Gpt2,
    |spec| Gpt::new(spec.gpt_config()),
    crate::gpt::wrap_policy
);
language_model!(
    Llama,
    LmFamily::Llama3,
    |spec| Llama::new(spec.llama_config()?),
    llama::wrap_policy
);

/// A count for messages: `1.20M`, `7.39B`.
fn count_text(n: u64) -> String {
    let x = n as f64;
    match n {
        0..1_000_000 => n.to_string(),
        1_000_000..1_000_000_000 => format!("{:.2}M", x * 1e-6),
        _ => format!("{:.2}B", x * 1e-9),
    }
}
