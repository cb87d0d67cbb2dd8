//! What the `gpt_fsdp` runs (training and `--speed`) share: the model choice, the wrapped model and its
//! optimizer (the peer's AdamW), the recipe in words, and the run's error type.

use super::{wrap_policy, Fp8Layers, Gpt, GptConfig, GptError};
use crate::data::tokens::TokenDataError;
use crate::metrics::MetricsError;
use crate::run_setup::SetupError;
use crate::training::TrainingError;
use fp8_core::Fp8Format;
use fp8_kernels::CpuParallelism;
use fsdp_comm::Communicator;
use fsdp_nn::{Activation, LinearPrecision};
use fsdp_optim::{AdamOptions, FsdpAdamW, StatePrecision, WarmupCosine};
use fsdp_shard::{FsdpConfig, FsdpModel, GradDtype, GradReduction};
use std::sync::Arc;

/// Everything that can stop a `gpt_fsdp` run.
#[derive(Debug, thiserror::Error)]
pub enum GptRunError {
    /// The model failed.
    #[error(transparent)]
    Gpt(#[from] GptError),
    /// A layer failed.
    #[error(transparent)]
    Nn(#[from] fsdp_nn::NnError),
    /// Sharding, gathering, reduction or a checkpoint failed.
    #[error(transparent)]
    Shard(#[from] fsdp_shard::ShardError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] fp8_kernels::KernelError),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] fsdp_optim::OptimError),
    /// The token data could not be read.
    #[error(transparent)]
    Data(#[from] TokenDataError),
    /// The metrics file could not be written.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// Saving a checkpoint failed.
    #[error(transparent)]
    Training(#[from] TrainingError),
    /// An output path or the launcher setup refused before training.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// A checkpoint does not fit this run.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A configuration that cannot run (the message names the flag).
    #[error("{0}")]
    Config(String),
}

/// Arithmetic of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GptPrecision {
    /// BF16 activations; the linears [`GptModelChoice::fp8_layers`] selects in FP8, the others BF16.
    #[default]
    Fp8,
    /// BF16 activations and linears (PyTorch's BF16 mixed precision).
    Bf16,
    /// F32 activations and linears (`Gpt::<f32>`).
    Fp32,
}

impl GptPrecision {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            GptPrecision::Fp8 => "fp8",
            GptPrecision::Bf16 => "bf16",
            GptPrecision::Fp32 => "fp32",
        }
    }
}

/// The model of a run: a preset with optional overrides, its precision and the gradient reduction.
#[derive(Debug, Clone, PartialEq)]
pub struct GptModelChoice {
    /// One of [`super::PRESETS`].
    pub preset: String,
    /// Overrides of the preset's width, blocks and heads (small models for tests).
    pub d_model: Option<usize>,
    /// See `d_model`.
    pub layers: Option<usize>,
    /// See `d_model`.
    pub heads: Option<usize>,
    /// Rows of the position table: the sequence length.
    pub seq_len: usize,
    /// Arithmetic.
    pub precision: GptPrecision,
    /// Which linears run in FP8 with [`GptPrecision::Fp8`].
    pub fp8_layers: Fp8Layers,
    /// The crossover of [`Fp8Layers::Auto`] ([`super::DEFAULT_FP8_AUTO_THRESHOLD`] by default).
    pub fp8_auto_threshold: usize,
    /// Reduce-scatter the FP8 weights' gradients in FP8 (E5M2) instead of F32.
    pub fp8_grad_comm: bool,
    /// Storage of the reduced gradient shards: F32 (exact, the peer's) or BF16 (half the bytes; one
    /// rounding per reduction, see [`GradDtype`]).
    pub grad_shards: GradDtype,
    /// Seed of the initial weights.
    pub seed: u64,
}

impl GptModelChoice {
    /// The model's configuration with `vocab` rows of `wte`.
    pub fn config(&self, vocab: usize) -> Result<GptConfig, GptRunError> {
        let mut c = GptConfig::preset(&self.preset, self.seq_len)
            .map_err(|e| GptRunError::Config(format!("--preset: {e}")))?;
        c.d_model = self.d_model.unwrap_or(c.d_model);
        c.layers = self.layers.unwrap_or(c.layers);
        c.heads = self.heads.unwrap_or(c.heads);
        c.vocab = vocab;
        c.seed = self.seed;
        c.fp8_auto_threshold = self.fp8_auto_threshold;
        c.fp8 = match self.precision {
            GptPrecision::Fp8 => self.fp8_layers,
            GptPrecision::Bf16 | GptPrecision::Fp32 => Fp8Layers::None,
        };
        if c.d_model == 0 || c.layers == 0 || c.heads == 0 {
            return Err(GptRunError::Config(format!(
                "--d-model {}, --layers {}, --heads {}: all must be at least 1",
                c.d_model, c.layers, c.heads
            )));
        }
        if c.d_model % c.heads != 0 {
            return Err(GptRunError::Config(format!(
                "--heads {} does not divide the width {} (--d-model)",
                c.heads, c.d_model
            )));
        }
        if self.seq_len == 0 {
            return Err(GptRunError::Config("--seq-len must be at least 1".into()));
        }
        c.validate()?;
        Ok(c)
    }

    /// The block linears by precision: `(name, FP8 / BF16 / F32)` in block order.
    pub fn linear_precisions(&self, config: &GptConfig) -> Vec<(&'static str, LinearPrecision)> {
        let d = config.d_model;
        let p = |i, o| match self.precision {
            GptPrecision::Fp32 => config.linear_precision::<f32>(i, o),
            _ => config.linear_precision::<half::bf16>(i, o),
        };
        vec![
            ("c_attn", p(d, 3 * d)),
            ("attn_proj", p(d, d)),
            ("c_fc", p(d, 4 * d)),
            ("mlp_proj", p(4 * d, d)),
        ]
    }

    /// The block linears that run in FP8.
    pub fn fp8_linears(&self, config: &GptConfig) -> Vec<&'static str> {
        self.linear_precisions(config)
            .into_iter()
            .filter(|(_, p)| *p == LinearPrecision::Fp8)
            .map(|(n, _)| n)
            .collect()
    }

    /// The scaling recipe in words (named in every output).
    pub fn recipe(&self, config: &GptConfig) -> String {
        let comm = if self.fp8_grad_comm {
            "FP8 E5M2 gradient reduce-scatter of the FP8 weights"
        } else {
            "F32 gradient reduce-scatter"
        };
        let comm = format!(
            "{comm}, {} gradient shards",
            self.grad_shards.name().to_uppercase()
        );
        match self.precision {
            GptPrecision::Fp32 => format!("F32 linears, F32 activations; {comm}"),
            GptPrecision::Bf16 => format!("BF16 linears, BF16 activations; {comm}"),
            GptPrecision::Fp8 if self.fp8_linears(config).is_empty() => {
                format!("no linear in FP8 (all BF16), BF16 activations; {comm}")
            }
            GptPrecision::Fp8 => format!(
                "FP8 linears: E4M3 inputs and weights, E5M2 output gradients; delayed scaling of \
                 activations and gradients (amax window 16), current scaling of the weights; FP8 \
                 weight all-gather; other linears and the head BF16; {comm}"
            ),
        }
    }

    /// FSDP settings: the gradient reduction.
    pub fn fsdp_config(&self) -> FsdpConfig {
        FsdpConfig {
            grad_reduction: if self.fp8_grad_comm {
                GradReduction::Fp8(Fp8Format::E5M2)
            } else {
                GradReduction::F32
            },
            grad_dtype: self.grad_shards,
            ..FsdpConfig::default()
        }
    }
}

/// The peer's AdamW: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every matrix (embeddings
/// included), none on the norm weights, no clipping; `states` stores the FP8 weights' master and
/// moments (F32 as the peer, or the low-precision recipe).
pub fn peer_adamw_options(lr: f64, states: StatePrecision) -> AdamOptions {
    AdamOptions {
        lr,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
        state_precision: states,
        ..AdamOptions::adamw()
    }
}

/// The peer's schedule for `steps` steps: warm-up `lr (it + 1) / w` with `w = max(1, steps / 20)`, then
/// a cosine to `lr / 10` at `steps`.
pub fn peer_schedule(steps: u64) -> Result<WarmupCosine, GptRunError> {
    Ok(WarmupCosine::new((steps / 20).max(1), steps.max(1), 0.1)?)
}

/// The wrapped model and its optimizer on this rank.
pub fn build_model<T: Activation>(
    comm: Arc<dyn Communicator>,
    config: GptConfig,
    choice: &GptModelChoice,
    parallelism: CpuParallelism,
) -> Result<FsdpModel<Gpt<T>>, GptRunError> {
    let mut model = FsdpModel::new(
        Gpt::<T>::new(config)?,
        comm,
        wrap_policy(),
        choice.fsdp_config(),
    )?;
    model.set_cpu_parallelism(parallelism);
    Ok(model)
}

/// The optimizer of a built model (after any `import_full`).
pub fn build_optimizer<T: Activation>(
    model: &mut FsdpModel<Gpt<T>>,
    lr: f64,
    states: StatePrecision,
) -> Result<FsdpAdamW, GptRunError> {
    Ok(FsdpAdamW::for_model(model, peer_adamw_options(lr, states))?)
}
