//! The flags every training program shares, declared once ([`TrainArgs`], flattened into a binary's
//! own arguments with `#[command(flatten)]`), their value enums (one clap [`ValueEnum`] per choice, each
//! with its conversion to the library type it selects), and [`TrainArgs::config`], which turns them into
//! a [`TrainConfig`] with the program's defaults.
//!
//! The value names (`fp8`, `bf16`, `low`, …) and the variants' doc comments are what `--help` shows.
//! Enums whose variants have no doc comment keep clap's one-line `[possible values: …]` list in the
//! help: a variant doc comment would turn it into a described list.
//!
//! ```
//! use clap::{Parser, ValueEnum};
//! use fsdp_train::{ExportArg, RunLength, StatesArg, TaskDefaults, TrainArgs};
//!
//! let states = StatesArg::from_str("f32", false)?;
//! assert_eq!(fsdp_optim::StatePrecision::from(states), fsdp_optim::StatePrecision::F32);
//! assert_eq!(ExportArg::Bf16.to_possible_value().map(|v| v.get_name().to_owned()), Some("bf16".into()));
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     train: TrainArgs,
//! }
//! let args = Args::try_parse_from(["prog", "--steps", "30", "--fp8-layers", "auto"]).map_err(|e| e.to_string())?;
//! let config = args.train.config(&TaskDefaults::new(RunLength::Steps(100), 6e-4)).map_err(|e| e.to_string())?;
//! assert_eq!(config.length, RunLength::Steps(30));
//! assert_eq!(config.lr, 6e-4);
//! # Ok::<(), String>(())
//! ```

use clap::{Args, ValueEnum};
use fp8_core::{Fp8Format, Fp8Recipe, ScalingRecipe};
use fp8_kernels::{Device, KernelError};
use fsdp_nn::{Fp8Filter, LinearPrecision, DEFAULT_FP8_AUTO_THRESHOLD};
use fsdp_optim::{ExportDtype, StatePrecision};
use fsdp_shard::{GatherDtype, GradDtype};
use std::path::PathBuf;

use crate::config::{Fp8GradComm, Precision, RunLength, TrainConfig, DEFAULT_MAX_SKIPPED_STEPS};
use crate::progress::ProgressMode;
use crate::setup::DeviceChoice;
use crate::TrainError;

/// What a program chooses when a shared flag is not given.
#[derive(Debug, Clone)]
pub struct TaskDefaults {
    /// The run's length without `--steps`/`--epochs`.
    pub length: RunLength,
    /// The learning rate without `--lr`.
    pub lr: f64,
    /// Which run lengths the program accepts: steps, epochs or both.
    pub lengths: (bool, bool),
    /// The linears in FP8 without `--fp8-layers`.
    pub fp8_layers: Fp8Filter,
    /// Ranks without `--world-size`.
    pub world_size: usize,
}

impl TaskDefaults {
    /// Defaults of a run of `length` at learning rate `lr`, every linear in FP8, the length in the
    /// same unit only.
    pub fn new(length: RunLength, lr: f64) -> Self {
        TaskDefaults {
            lengths: (
                matches!(length, RunLength::Steps(_)),
                matches!(length, RunLength::Epochs(_)),
            ),
            length,
            lr,
            fp8_layers: Fp8Filter::All,
            world_size: 1,
        }
    }
}

/// `--fp8-layers`: which linears run in FP8 with `--precision fp8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8LayersArg {
    /// Every linear.
    All,
    /// Those large enough for FP8 to pay (`--fp8-auto-threshold`).
    Auto,
    /// None.
    None,
}

/// `--fp8-scaling`: how FP8 activations and gradients are scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8ScalingArg {
    /// From a window of past amaxes (`--fp8-amax-history`); no extra pass over the data.
    Delayed,
    /// From the tensor's own amax (one extra pass).
    Current,
}

/// `--recipe`: the scale granularity of FP8 linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RecipeArg {
    /// One scale per tensor: delayed or current scaling of activations and gradients agreed across
    /// ranks, weights scaled currently by the optimizer.
    Tensor,
    /// DeepSeek-V3's block scaling: E4M3 everywhere, one scale per 1x128 tile of activations and
    /// gradients and per 128x128 block of weights (power-of-two scales); no scale agreement between
    /// ranks, weight shards end on 128-row block rows.
    Block,
}

/// The flags every training program shares.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Optimizer steps of the run [default: the program's].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,
    /// Epochs of the run, for programs whose data has epochs [default: the program's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub epochs: Option<u32>,
    /// Micro-batches per optimizer step (gradients accumulate; the reduction averages them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub grad_accum: u64,
    /// Base learning rate [default: the program's].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Seed of the initial weights (each parameter draws from it and its name) and of the data order.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Arithmetic of the linears: FP8 (those --fp8-layers selects), BF16, or F32.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Fp8)]
    pub precision: PrecisionArg,
    /// With --precision fp8: which linears run in FP8 [default: the program's].
    #[arg(long, value_enum)]
    pub fp8_layers: Option<Fp8LayersArg>,
    /// With --precision fp8: the language-model head's three GEMMs in FP8 too (E4M3 input and weight at
    /// current scales, E5M2 logits gradient); off by default, whatever --fp8-layers says.
    #[arg(long)]
    pub fp8_head: bool,
    /// With --fp8-layers auto: a linear in -> out runs in FP8 when in*out/(in+out) >= N [default: 1200,
    /// measured by the linear_crossover example].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub fp8_auto_threshold: Option<u64>,
    /// With --precision fp8: one scale per tensor, or per 1x128 tile / 128x128 weight block
    /// (DeepSeek-V3's recipe) [default: tensor].
    #[arg(long, value_enum)]
    pub recipe: Option<RecipeArg>,
    /// With --precision fp8: scaling of activations and output gradients [default: delayed].
    #[arg(long, value_enum)]
    pub fp8_scaling: Option<Fp8ScalingArg>,
    /// With delayed scaling: the amax history window [default: 16].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub fp8_amax_history: Option<u64>,
    /// With --precision fp8: scales are divided by 2^margin (head-room), for activations, gradients and
    /// weights [default: 0].
    #[arg(long, value_parser = clap::value_parser!(i64).range(0..=fp8_core::MAX_MARGIN as i64))]
    pub fp8_margin: Option<i64>,
    /// The FP8 weights' gradients travel in FP8 instead of F32: `tensor` (the value when none is given)
    /// a per-tensor E5M2 reduce-scatter; `block` (E4M3) or `block-e5m2` the block-scaled exchange
    /// (1x128 tiles with their own scales, one all-to-all, F32 sum on the receiver).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "tensor", require_equals = false)]
    pub fp8_grad_comm: Option<Fp8GradCommArg>,
    /// Storage of the reduced gradient shards (bf16: half the bytes, one rounding per reduction).
    #[arg(long, value_enum, default_value_t = GradShardsArg::F32)]
    pub grad_shards: GradShardsArg,
    /// The type plain parameters (norms, biases, embeddings, the LM head) are gathered in for compute
    /// (bf16: half their gathered bytes; the masters, gradients and checkpoints stay F32).
    #[arg(long, value_enum, default_value_t = GradShardsArg::F32)]
    pub plain_gather: GradShardsArg,
    /// Optimizer states of the FP8 weights (other parameters keep F32 states) [default: low].
    #[arg(long, value_enum)]
    pub optimizer_states: Option<StatesArg>,
    /// Ranks: threads on the CPU; on CUDA the launcher's process count [default: the program's].
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// CPU threads per rank [default: cores / ranks; at most 4 per core].
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Evaluate every N steps [default: each epoch's end, or a tenth of a run in steps] and at the end.
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Save a sharded checkpoint here (at the end, each epoch's end, with --save-every, and on SIGINT /
    /// SIGTERM).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also save every N steps.
    #[arg(long, requires = "save")]
    pub save_every: Option<u64>,
    /// Replace a checkpoint already in --save instead of refusing (without --resume from it).
    #[arg(long, requires = "save")]
    pub overwrite: bool,
    /// Resume from a checkpoint directory (same world size and settings).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop after N steps in total (saving first with --save): simulates an interruption.
    #[arg(long)]
    pub stop_after_steps: Option<u64>,
    /// Write one JSON line per evaluation here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write an SVG of the losses per evaluation (needs --metrics; overlays --compare).
    #[arg(long, requires = "metrics")]
    pub plot: Option<PathBuf>,
    /// Further metrics files to overlay in the plot.
    #[arg(long, requires = "plot")]
    pub compare: Vec<PathBuf>,
    /// After training, write the master weights to this safetensors file (by parameter name).
    #[arg(long)]
    pub export: Option<PathBuf>,
    /// Element type of --export.
    #[arg(long, value_enum, default_value_t = ExportArg::F32, requires = "export")]
    pub export_dtype: ExportArg,
    /// Load the weights of a safetensors file (by name, e.g. an --export) before training.
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Also print the loss every N steps.
    #[arg(long)]
    pub log_every: Option<u64>,
    /// Time the phases (data, forward, backward, optimizer) of N steps [N: 20] after 20 warm-up steps
    /// (with --speed: of the timed steps) and print a table.
    #[arg(long, num_args = 0..=1, default_missing_value = "20")]
    pub profile: Option<usize>,
    /// With --profile on a GPU: wait for the device at every phase boundary (each phase's GPU time is
    /// its own kernels').
    #[arg(long, requires = "profile")]
    pub profile_sync: bool,
    /// Stop with an error after N consecutive steps skipped for non-finite gradients.
    #[arg(long, default_value_t = DEFAULT_MAX_SKIPPED_STEPS)]
    pub max_skipped_steps: u64,
    /// Step the optimizer inside the backward, each FSDP unit as soon as its gradients are reduced,
    /// and free its gradient shard at once: no gradient shards persist across the step (less peak
    /// memory; the same numbers). Not with --grad-accum > 1 or gradient clipping.
    #[arg(long)]
    pub optimizer_in_backward: bool,
    /// Time 20 steps after 5 warm-up steps on one batch and print a table and a JSON line (no training).
    #[arg(long)]
    pub speed: bool,
    /// Timed steps of --speed.
    #[arg(long, default_value_t = 20, requires = "speed")]
    pub speed_steps: usize,
    /// Never draw the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl TrainArgs {
    /// The run these flags ask for, with the program's defaults for what they leave out. Refuses
    /// combinations that cannot apply, naming the flags.
    pub fn config(&self, defaults: &TaskDefaults) -> Result<TrainConfig, TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        let length = match (self.steps, self.epochs) {
            (Some(_), Some(_)) => return bad("give --steps or --epochs, not both".into()),
            (Some(s), None) if defaults.lengths.0 => RunLength::Steps(s),
            (Some(_), None) => {
                return bad("this program counts its runs in epochs: give --epochs".into())
            }
            (None, Some(e)) if defaults.lengths.1 => RunLength::Epochs(e),
            (None, Some(_)) => {
                return bad(
                    "this program's data has no epochs (it is endless): give --steps".into(),
                )
            }
            (None, None) => defaults.length,
        };
        let precision = Precision::from(self.precision);
        // A flag that cannot apply is refused rather than accepted and ignored, so the summary never
        // names a setting the run does not use.
        let no_fp8 = if precision != Precision::Fp8 {
            Some(format!(
                "with --precision {} there are none",
                precision.name()
            ))
        } else if self.fp8_layers == Some(Fp8LayersArg::None) {
            Some("with --fp8-layers none there are none".to_string())
        } else {
            None
        };
        if let Some(why) = no_fp8 {
            for (given, flag) in [
                (
                    self.fp8_layers.is_some() && precision != Precision::Fp8,
                    "--fp8-layers",
                ),
                (self.fp8_auto_threshold.is_some(), "--fp8-auto-threshold"),
                (self.recipe.is_some(), "--recipe"),
                (self.fp8_grad_comm.is_some(), "--fp8-grad-comm"),
                (self.fp8_scaling.is_some(), "--fp8-scaling"),
                (self.fp8_amax_history.is_some(), "--fp8-amax-history"),
                (self.fp8_margin.is_some(), "--fp8-margin"),
                (self.optimizer_states.is_some(), "--optimizer-states"),
            ] {
                if given {
                    return bad(format!(
                        "{flag} applies to FP8 linears; {why} (drop the flag, or use --precision fp8 \
                         and an --fp8-layers choice that selects some)"
                    ));
                }
            }
        }
        if self.recipe == Some(RecipeArg::Block) {
            for (given, flag) in [
                (self.fp8_scaling.is_some(), "--fp8-scaling"),
                (self.fp8_amax_history.is_some(), "--fp8-amax-history"),
                (self.fp8_margin.is_some(), "--fp8-margin"),
            ] {
                if given {
                    return bad(format!(
                        "{flag} sets per-tensor scaling; --recipe block scales every 1x128 tile and \
                         128x128 weight block by its own amax (drop one of them)"
                    ));
                }
            }
        }
        if self.fp8_amax_history.is_some() && self.fp8_scaling == Some(Fp8ScalingArg::Current) {
            return bad(
                "--fp8-amax-history sets the window of delayed scaling; --fp8-scaling current \
                 keeps no history (drop one of them)"
                    .into(),
            );
        }
        if self.fp8_auto_threshold.is_some() && self.fp8_layers != Some(Fp8LayersArg::Auto) {
            return bad("--fp8-auto-threshold decides nothing without --fp8-layers auto".into());
        }
        let fp8_layers = match self.fp8_layers {
            None if precision == Precision::Fp8 => defaults.fp8_layers.clone(),
            None => Fp8Filter::All,
            Some(Fp8LayersArg::All) => Fp8Filter::All,
            Some(Fp8LayersArg::None) => Fp8Filter::None,
            Some(Fp8LayersArg::Auto) => Fp8Filter::Auto {
                threshold: match self.fp8_auto_threshold {
                    None => DEFAULT_FP8_AUTO_THRESHOLD,
                    Some(n) => usize::try_from(n).map_err(|_| {
                        TrainError::Config(format!(
                            "--fp8-auto-threshold {n} does not fit this machine's usize"
                        ))
                    })?,
                },
            },
        };
        let margin_arg = self.fp8_margin.unwrap_or(0);
        let margin = i32::try_from(margin_arg)
            .map_err(|_| TrainError::Config(format!("--fp8-margin {margin_arg}")))?;
        let history = self.fp8_amax_history.unwrap_or(16);
        let scaling = match self.fp8_scaling.unwrap_or(Fp8ScalingArg::Delayed) {
            Fp8ScalingArg::Delayed => ScalingRecipe::Delayed {
                history_len: usize::try_from(history).map_err(|_| {
                    TrainError::Config(format!("--fp8-amax-history {history} does not fit a usize"))
                })?,
                amax_compute: fp8_core::AmaxCompute::Max,
                margin,
                rounding: fp8_core::ScaleRounding::PowerOfTwo,
            },
            Fp8ScalingArg::Current => ScalingRecipe::Current {
                margin,
                rounding: fp8_core::ScaleRounding::PowerOfTwo,
            },
        };
        let lr = self.lr.unwrap_or(defaults.lr);
        let mut c = TrainConfig::new(length);
        c.grad_accum = usize::try_from(self.grad_accum).unwrap_or(usize::MAX);
        c.lr = lr;
        c.seed = self.seed;
        c.precision = precision;
        c.fp8_layers = fp8_layers;
        c.fp8_head = self.fp8_head;
        c.fp8_recipe = match self.recipe.unwrap_or(RecipeArg::Tensor) {
            RecipeArg::Tensor => Fp8Recipe {
                activations: scaling,
                gradients: scaling,
                weight_margin: margin,
                ..Fp8Recipe::default()
            },
            RecipeArg::Block => Fp8Recipe::block_scaled(fp8_core::ScaleRounding::PowerOfTwo),
        };
        c.fp8_grad_comm = self
            .fp8_grad_comm
            .map_or(Fp8GradComm::Off, Fp8GradComm::from);
        c.grad_shards = self.grad_shards.into();
        c.plain_gather = self.plain_gather.into();
        c.optimizer_states = self.optimizer_states.unwrap_or(StatesArg::Low).into();
        c.world_size = self.world_size.unwrap_or(defaults.world_size);
        c.device = self.device.into();
        c.threads_per_rank = self.threads_per_rank;
        c.eval_every = self.eval_every;
        c.save = self.save.clone();
        c.save_every = self.save_every;
        c.overwrite = self.overwrite;
        c.resume = self.resume.clone();
        c.stop_after_steps = self.stop_after_steps;
        c.metrics = self.metrics.clone();
        c.export = self.export.clone();
        c.export_dtype = self.export_dtype.into();
        c.init_from = self.init_from.clone();
        c.progress = if self.no_progress {
            ProgressMode::Hidden
        } else {
            ProgressMode::Auto
        };
        c.print = true;
        c.log_every = self.log_every;
        c.profile_steps = if self.speed { None } else { self.profile };
        c.profile_sync = self.profile_sync;
        c.max_skipped_steps = self.max_skipped_steps;
        c.optimizer_in_backward = self.optimizer_in_backward;
        c.stop_on_signal = true;
        // Input files of the plot are checked before training, not after it.
        // (read whole: an unreadable or empty file would otherwise fail, or plot nothing, after training)
        for f in &self.compare {
            let records = crate::metrics::read_metrics(f)
                .map_err(|e| TrainError::Config(format!("--compare {}: {e}", f.display())))?;
            if records.is_empty() {
                return bad(format!(
                    "--compare {}: holds no metrics records (a --metrics file of another run)",
                    f.display()
                ));
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// The device with `auto` decided now, printing why CUDA is not used when it is not.
    pub fn resolved_device(&self) -> DeviceChoice {
        let (device, why) = self.device.resolve();
        if let Some(why) = why {
            eprintln!("no usable GPU ({why}); running on the CPU");
        }
        device
    }
}

impl From<PrecisionArg> for Precision {
    fn from(arg: PrecisionArg) -> Self {
        match arg {
            PrecisionArg::Fp8 => Precision::Fp8,
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Fp32 => Precision::Fp32,
        }
    }
}

/// `--device`: where to run.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Auto,
    Cpu,
    Cuda,
}

impl DeviceArg {
    /// The device with `auto` decided now: CUDA when a GPU and its libraries are usable, else the CPU
    /// together with why CUDA is not usable (for the binary to report in its own words).
    pub fn resolve(self) -> (DeviceChoice, Option<KernelError>) {
        match self {
            DeviceArg::Cpu => (DeviceChoice::Cpu, None),
            DeviceArg::Cuda => (DeviceChoice::Cuda, None),
            DeviceArg::Auto => {
                let (d, why) = Device::auto();
                let choice = if d.is_cuda() {
                    DeviceChoice::Cuda
                } else {
                    DeviceChoice::Cpu
                };
                (choice, why)
            }
        }
    }
}

impl From<DeviceArg> for DeviceChoice {
    /// `auto` stays [`DeviceChoice::Auto`], decided at launch; see [`DeviceArg::resolve`] to decide now.
    fn from(arg: DeviceArg) -> Self {
        match arg {
            DeviceArg::Auto => DeviceChoice::Auto,
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
        }
    }
}

/// `--precision`: the arithmetic of the linear layers (FP8, BF16 or F32).
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    Fp8,
    Bf16,
    Fp32,
}

impl From<PrecisionArg> for LinearPrecision {
    fn from(arg: PrecisionArg) -> Self {
        match arg {
            PrecisionArg::Fp8 => LinearPrecision::Fp8,
            PrecisionArg::Bf16 => LinearPrecision::Bf16,
            PrecisionArg::Fp32 => LinearPrecision::F32,
        }
    }
}

/// `--optimizer-states`: the optimizer states of the FP8 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatesArg {
    /// F16 master, FP8 E4M3 first moment, F16 second moment (MS-AMP's recipe).
    Low,
    /// F32 master and moments.
    F32,
}

impl From<StatesArg> for StatePrecision {
    fn from(arg: StatesArg) -> Self {
        match arg {
            StatesArg::Low => StatePrecision::LowPrecision,
            StatesArg::F32 => StatePrecision::F32,
        }
    }
}

/// `--export-dtype`: the element type of an exported safetensors file.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportArg {
    F32,
    Bf16,
}

impl From<ExportArg> for ExportDtype {
    fn from(arg: ExportArg) -> Self {
        match arg {
            ExportArg::F32 => ExportDtype::F32,
            ExportArg::Bf16 => ExportDtype::Bf16,
        }
    }
}

/// `--fp8-grad-comm`: how the FP8 weights' gradients travel.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8GradCommArg {
    Tensor,
    Block,
    BlockE5m2,
}

impl From<Fp8GradCommArg> for Fp8GradComm {
    fn from(arg: Fp8GradCommArg) -> Self {
        match arg {
            Fp8GradCommArg::Tensor => Fp8GradComm::Tensor,
            Fp8GradCommArg::Block => Fp8GradComm::Block(Fp8Format::E4M3),
            Fp8GradCommArg::BlockE5m2 => Fp8GradComm::Block(Fp8Format::E5M2),
        }
    }
}

/// `--grad-shards`: the storage of the reduced gradient shards.
#[allow(missing_docs)] // the values name themselves; docs here would change `--help` (see the module)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GradShardsArg {
    F32,
    Bf16,
}

impl From<GradShardsArg> for GatherDtype {
    fn from(arg: GradShardsArg) -> Self {
        match arg {
            GradShardsArg::F32 => GatherDtype::F32,
            GradShardsArg::Bf16 => GatherDtype::Bf16,
        }
    }
}

impl From<GradShardsArg> for GradDtype {
    fn from(arg: GradShardsArg) -> Self {
        match arg {
            GradShardsArg::F32 => GradDtype::F32,
            GradShardsArg::Bf16 => GradDtype::Bf16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The accepted values, in the order `--help` lists them: the binaries' flags must not change.
    fn names<T: ValueEnum>() -> Vec<String> {
        T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|p| p.get_name().to_owned())
            .collect()
    }

    #[test]
    fn value_names_are_the_flags_values() {
        assert_eq!(names::<DeviceArg>(), ["auto", "cpu", "cuda"]);
        assert_eq!(names::<PrecisionArg>(), ["fp8", "bf16", "fp32"]);
        assert_eq!(names::<StatesArg>(), ["low", "f32"]);
        assert_eq!(names::<ExportArg>(), ["f32", "bf16"]);
        assert_eq!(names::<GradShardsArg>(), ["f32", "bf16"]);
    }

    #[test]
    fn conversions_select_the_named_library_value() {
        assert_eq!(DeviceChoice::from(DeviceArg::Auto), DeviceChoice::Auto);
        assert_eq!(DeviceChoice::from(DeviceArg::Cpu), DeviceChoice::Cpu);
        assert_eq!(DeviceChoice::from(DeviceArg::Cuda), DeviceChoice::Cuda);
        assert_eq!(DeviceArg::Cpu.resolve().0, DeviceChoice::Cpu);
        assert_eq!(DeviceArg::Cuda.resolve().0, DeviceChoice::Cuda);
        assert_ne!(DeviceArg::Auto.resolve().0, DeviceChoice::Auto);
        assert_eq!(
            LinearPrecision::from(PrecisionArg::Fp8),
            LinearPrecision::Fp8
        );
        assert_eq!(
            LinearPrecision::from(PrecisionArg::Bf16),
            LinearPrecision::Bf16
        );
        assert_eq!(
            LinearPrecision::from(PrecisionArg::Fp32),
            LinearPrecision::F32
        );
        assert_eq!(Precision::from(PrecisionArg::Fp8), Precision::Fp8);
        assert_eq!(Precision::from(PrecisionArg::Bf16), Precision::Bf16);
        assert_eq!(Precision::from(PrecisionArg::Fp32), Precision::Fp32);
        assert_eq!(
            StatePrecision::from(StatesArg::Low),
            StatePrecision::LowPrecision
        );
        assert_eq!(StatePrecision::from(StatesArg::F32), StatePrecision::F32);
        assert_eq!(ExportDtype::from(ExportArg::F32), ExportDtype::F32);
        assert_eq!(ExportDtype::from(ExportArg::Bf16), ExportDtype::Bf16);
        assert_eq!(GradDtype::from(GradShardsArg::F32), GradDtype::F32);
        assert_eq!(GradDtype::from(GradShardsArg::Bf16), GradDtype::Bf16);
    }
}
