//! [`TrainConfig`]: what a run is asked to do (the library form of the shared flags,
//! [`crate::TrainArgs`]).

use crate::progress::ProgressMode;
use crate::setup::DeviceChoice;
use crate::TrainError;
use fp8_core::{Fp8Format, Fp8Recipe};
use fsdp_nn::Fp8Filter;
use fsdp_optim::{ExportDtype, StatePrecision};
use fsdp_shard::{GatherDtype, GradDtype, GradReduction};
use std::path::PathBuf;
use std::time::Duration;

/// How long a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunLength {
    /// Optimizer steps in all.
    Steps(u64),
    /// Epochs in all (the task's data says how many steps an epoch has).
    Epochs(u32),
}

/// The arithmetic of the run's linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// The linears the [`TrainConfig::fp8_layers`] filter selects in FP8, the others in the float
    /// precision of the activations.
    #[default]
    Fp8,
    /// BF16 linears.
    Bf16,
    /// F32 linears (the model must have `f32` activations).
    Fp32,
}

impl Precision {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp8 => "fp8",
            Precision::Bf16 => "bf16",
            Precision::Fp32 => "fp32",
        }
    }
}

/// The default limit of consecutive skipped steps ([`TrainConfig::max_skipped_steps`]).
pub const DEFAULT_MAX_SKIPPED_STEPS: u64 = 16;

/// Threads per CPU rank beyond this many times the machine's cores are refused (they would only
/// oversubscribe the CPU).
pub const THREADS_PER_CORE_LIMIT: usize = 4;

/// A run.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// How long.
    pub length: RunLength,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Base learning rate.
    pub lr: f64,
    /// Seed of the initial weights (each parameter draws from this seed and its name) and of the data.
    pub seed: u64,
    /// Arithmetic of the linears.
    pub precision: Precision,
    /// With [`Precision::Fp8`]: which linears (`all`, `none`, `auto`, a custom rule).
    pub fp8_layers: Fp8Filter,
    /// With [`Precision::Fp8`]: scaling and formats, model-wide.
    pub fp8_recipe: Fp8Recipe,
    /// With [`Precision::Fp8`]: the language-model heads' GEMMs in FP8 too
    /// ([`fsdp_nn::convert_lm_heads_to_fp8`]; `--fp8-head`). Off by default: no filter choice of
    /// `fp8_layers` reaches the head.
    pub fp8_head: bool,
    /// How the FP8 weights' gradients travel between ranks (F32 by default).
    pub fp8_grad_comm: Fp8GradComm,
    /// Storage of the reduced gradient shards.
    pub grad_shards: GradDtype,
    /// The type plain parameters (norm weights, biases, embeddings, the LM head) are gathered in for
    /// compute (`fsdp_shard::FsdpConfig::plain_gather_dtype`; `--plain-gather`): F32 by default, BF16
    /// halves their gathered bytes.
    pub plain_gather: GatherDtype,
    /// Storage of the FP8 weights' optimizer states.
    pub optimizer_states: StatePrecision,
    /// Ranks: threads on the CPU; on CUDA the launcher's process count.
    pub world_size: usize,
    /// Where.
    pub device: DeviceChoice,
    /// CPU threads per rank (default: the cores divided by the ranks).
    pub threads_per_rank: Option<usize>,
    /// Evaluate every this many steps (default: at each epoch's end for runs in epochs, else every
    /// tenth of the run) and at the end.
    pub eval_every: Option<u64>,
    /// Save a sharded checkpoint here (at the end, at every epoch's end, every `save_every` steps, and
    /// when stopped by a signal).
    pub save: Option<PathBuf>,
    /// Also save every this many steps.
    pub save_every: Option<u64>,
    /// Replace a committed checkpoint in `save` that this run does not resume from.
    pub overwrite: bool,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Stop after this many steps in total, saving first (an interruption, for tests).
    pub stop_after_steps: Option<u64>,
    /// One JSON line per evaluation here (rank 0).
    pub metrics: Option<PathBuf>,
    /// Write the master weights here at the end (safetensors, by parameter name).
    pub export: Option<PathBuf>,
    /// Element type of the export.
    pub export_dtype: ExportDtype,
    /// Load the weights of such a file (by name) before training.
    pub init_from: Option<PathBuf>,
    /// Progress bar on rank 0.
    pub progress: ProgressMode,
    /// Print lines on rank 0.
    pub print: bool,
    /// Also print a line every this many steps (rank 0; reads the loss, so on a GPU it waits for the
    /// device at those steps).
    pub log_every: Option<u64>,
    /// Time the phases of this many steps after the warm-up steps and print a table.
    pub profile_steps: Option<usize>,
    /// With `profile_steps` on a GPU: wait for the device at every phase boundary.
    pub profile_sync: bool,
    /// Stop with an error after this many consecutive steps skipped for non-finite gradients.
    pub max_skipped_steps: u64,
    /// Step the optimizer inside the backward (`--optimizer-in-backward`): each FSDP unit as soon as its
    /// gradients are reduce-scattered, its gradient shards freed at once (transient), so no gradient
    /// shards persist across the step. The same numbers as the step after the backward when no step is
    /// skipped; a non-finite loss skips every unit, a non-finite gradient of a finite loss the units
    /// that saw one, and either step counts as skipped (docs/optimizers.md). Needs one micro-batch per step and an optimizer without
    /// gradient clipping.
    pub optimizer_in_backward: bool,
    /// Stop cleanly on SIGINT / SIGTERM (the binary installs the handler, see [`crate::signal`]).
    pub stop_on_signal: bool,
    /// Gather every parameter into the report at the end (tests; costs a full gather).
    pub collect_params: bool,
    /// How long a collective waits for the other ranks.
    pub timeout: Duration,
}

impl TrainConfig {
    /// A run of `length` with the defaults: one micro-batch per step, lr 1e-3, seed 1, FP8 on every
    /// linear with the default recipe, F32 gradient reduction and shards, low-precision optimizer states,
    /// one rank, the device decided at launch, no outputs, nothing printed.
    pub fn new(length: RunLength) -> Self {
        TrainConfig {
            length,
            grad_accum: 1,
            lr: 1e-3,
            seed: 1,
            precision: Precision::Fp8,
            fp8_layers: Fp8Filter::All,
            fp8_recipe: Fp8Recipe::default(),
            fp8_head: false,
            fp8_grad_comm: Fp8GradComm::Off,
            grad_shards: GradDtype::F32,
            plain_gather: GatherDtype::F32,
            optimizer_states: StatePrecision::default(),
            world_size: 1,
            device: DeviceChoice::Auto,
            threads_per_rank: None,
            eval_every: None,
            save: None,
            save_every: None,
            overwrite: false,
            resume: None,
            stop_after_steps: None,
            metrics: None,
            export: None,
            export_dtype: ExportDtype::F32,
            init_from: None,
            progress: ProgressMode::Hidden,
            print: false,
            log_every: None,
            profile_steps: None,
            profile_sync: false,
            max_skipped_steps: DEFAULT_MAX_SKIPPED_STEPS,
            optimizer_in_backward: false,
            stop_on_signal: false,
            collect_params: false,
            timeout: Duration::from_secs(1800),
        }
    }

    /// Refuses settings that would do nothing, could not apply, or exceed the machine, naming the flag.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        let zero = |flag: &str| {
            Err(TrainError::Config(format!(
                "{flag} must be at least 1 (0 would silently do nothing)"
            )))
        };
        match self.length {
            RunLength::Steps(0) => return zero("--steps"),
            RunLength::Epochs(0) => return zero("--epochs"),
            _ => {}
        }
        for (flag, v) in [
            ("--grad-accum", Some(self.grad_accum as u64)),
            ("--world-size", Some(self.world_size as u64)),
            ("--save-every", self.save_every),
            ("--eval-every", self.eval_every),
            ("--stop-after-steps", self.stop_after_steps),
            ("--log-every", self.log_every),
            ("--profile-steps", self.profile_steps.map(|v| v as u64)),
            (
                "--threads-per-rank",
                self.threads_per_rank.map(|v| v as u64),
            ),
            ("--max-skipped-steps", Some(self.max_skipped_steps)),
        ] {
            if v == Some(0) {
                return zero(flag);
            }
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("--lr {} must be finite and >= 0", self.lr));
        }
        if self.save_every.is_some() && self.save.is_none() {
            return bad("--save-every needs --save".into());
        }
        if self.overwrite && self.save.is_none() {
            return bad(
                "--overwrite needs --save (it allows replacing the checkpoint there)".into(),
            );
        }
        if self.fp8_grad_comm.is_on() && self.precision != Precision::Fp8 {
            return bad(format!(
                "--fp8-grad-comm reduces the gradients of FP8 weights; with --precision {} there are \
                 none (drop the flag or use --precision fp8)",
                self.precision.name()
            ));
        }
        if self.fp8_head && self.precision != Precision::Fp8 {
            return bad(format!(
                "--fp8-head runs the LM head's GEMMs in FP8; with --precision {} nothing is (drop the \
                 flag or use --precision fp8)",
                self.precision.name()
            ));
        }
        if self.precision != Precision::Fp8 && !matches!(self.fp8_layers, fsdp_nn::Fp8Filter::All) {
            return bad(format!(
                "--fp8-layers chooses linears for FP8; with --precision {} none are (drop the flag or \
                 use --precision fp8)",
                self.precision.name()
            ));
        }
        if self.optimizer_in_backward && self.grad_accum > 1 {
            return bad(format!(
                "--optimizer-in-backward steps each unit as soon as its gradients of one backward are \
                 reduced, so they cannot accumulate over micro-batches: --grad-accum {} needs the step \
                 after the backward (drop one of the two flags)",
                self.grad_accum
            ));
        }
        self.fp8_recipe
            .validate()
            .map_err(|e| TrainError::Config(format!("the FP8 recipe: {e}")))?;
        if let Some(t) = self.threads_per_rank {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let cap = cores.saturating_mul(THREADS_PER_CORE_LIMIT);
            if t > cap {
                return bad(format!(
                    "--threads-per-rank {t} exceeds the limit of {cap} ({THREADS_PER_CORE_LIMIT} per \
                     core on the {cores} core(s) of this machine); more would only oversubscribe it"
                ));
            }
        }
        if self.world_size > 1 && self.device != DeviceChoice::Cuda {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let cap = cores.saturating_mul(THREADS_PER_CORE_LIMIT).max(8);
            if self.world_size > cap && self.device == DeviceChoice::Cpu {
                return bad(format!(
                    "--world-size {} exceeds the limit of {cap} thread ranks on this machine's {cores} \
                     core(s)",
                    self.world_size
                ));
            }
        }
        if let (Some(stop), RunLength::Steps(steps)) = (self.stop_after_steps, self.length) {
            if stop >= steps {
                return bad(format!(
                    "--stop-after-steps {stop} is not before the end of the run (--steps {steps})"
                ));
            }
        }
        Ok(())
    }
}

/// How the gradients of the FP8 weights travel between ranks (`--fp8-grad-comm`); every other gradient
/// is reduced exactly in F32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8GradComm {
    /// An exact F32 reduce-scatter.
    #[default]
    Off,
    /// A per-tensor FP8 (E5M2) reduce-scatter: one amax all-reduce for a shared scale, then FP8 codes
    /// summed by the collective.
    Tensor,
    /// The block-scaled exchange: each rank casts its gradient in 1x128 tiles with its own scales, one
    /// all-to-all of codes and scales, a dequantized F32 sum in rank order on the receiver
    /// (`fsdp_shard::GradReduction::Fp8Block`; about 1.03 bytes per element on the wire).
    Block(Fp8Format),
}

impl Fp8GradComm {
    /// Whether the gradients travel in FP8.
    pub fn is_on(self) -> bool {
        self != Fp8GradComm::Off
    }

    /// The FP8 weights' gradient reduction of the sharded model.
    pub fn reduction(self) -> GradReduction {
        match self {
            Fp8GradComm::Off => GradReduction::F32,
            Fp8GradComm::Tensor => GradReduction::Fp8(Fp8Format::E5M2),
            Fp8GradComm::Block(f) => GradReduction::Fp8Block(f),
        }
    }

    /// The value checkpoints record (`false` and `true` for the first two, as before the block
    /// exchange existed, so older checkpoints resume).
    pub fn setting(self) -> &'static str {
        match self {
            Fp8GradComm::Off => "false",
            Fp8GradComm::Tensor => "true",
            Fp8GradComm::Block(Fp8Format::E4M3) => "block-e4m3",
            Fp8GradComm::Block(Fp8Format::E5M2) => "block-e5m2",
        }
    }

    /// The reduction in words, for the run's recipe line.
    pub fn describe(self) -> &'static str {
        match self {
            Fp8GradComm::Off => "F32 gradient reduce-scatter",
            Fp8GradComm::Tensor => "FP8 E5M2 gradient reduce-scatter of the FP8 weights",
            Fp8GradComm::Block(Fp8Format::E4M3) => {
                "block-scaled FP8 E4M3 gradient exchange of the FP8 weights (1x128 tiles, all-to-all)"
            }
            Fp8GradComm::Block(Fp8Format::E5M2) => {
                "block-scaled FP8 E5M2 gradient exchange of the FP8 weights (1x128 tiles, all-to-all)"
            }
        }
    }
}
