//! [`Trainer`]: the one training loop. See the crate documentation for what it owns.

use crate::config::{Precision, RunLength, TrainConfig};
use crate::metrics::{MetricsRecord, MetricsWriter};
use crate::profile::{finish_profiled_step, mark, Phase, StepProfile, StepProfiler};
use crate::progress::{EpochProgress, ProgressMode};
use crate::settings::{check_resume, resume_metrics, saved_record, RunSetting, RunSettings};
use crate::setup::{launch_ranks, RankLaunch, RunOutputs};
use crate::task::{
    BatchIndex, LossKind, MemoryEstimate, MemoryPlan, OptimizerChoice, RankEnv, ScheduleClock,
    SchedulePlan, TrainTask,
};
use crate::{signal, space, TrainError};
use fp8_kernels::{elementwise, Buffer, CpuParallelism, Device};
use fsdp_comm::{Communicator, ReduceOp};
use fsdp_nn::{
    convert_lm_heads_to_fp8, convert_to_fp8, linear_precisions, set_linear_precision,
    LinearPrecision,
};
use fsdp_optim::{
    export_with, finish_step_model, step_model, ExportDtype, LrSchedule, Optimizer,
    PendingStepReport, SharedOptimizer,
};
use fsdp_shard::checkpoint::{read_index, shard_file_bytes};
use fsdp_shard::{FsdpConfig, FsdpModel, MemoryReport, Mode, ShardError};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Steps run before a profiled window opens (NVRTC compilation, cuBLASLt plans, pool growth).
pub use crate::profile::PROFILE_WARMUP_STEPS;

/// A wrapped model with its linears' paths and precisions.
type Built<M> = (FsdpModel<M>, Vec<(String, LinearPrecision)>);

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// Every step of the run was taken.
    Completed,
    /// `stop_after_steps` was reached (a saved interruption).
    StopAfter,
    /// A signal asked for a stop (its number); the checkpoint was saved when `save` was given.
    Signal(i32),
    /// The resumed checkpoint was already at or past the run's end: nothing was trained.
    AlreadyDone,
}

/// What a run produced (rank 0's view, with every rank's memory and CPU losses).
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// One record per evaluation point of this invocation.
    pub records: Vec<MetricsRecord>,
    /// Optimizer steps taken in total (including those before a resume).
    pub steps: u64,
    /// How the run ended.
    pub stop: StopReason,
    /// Model state per rank by category (optimizer states included).
    pub memory: Vec<MemoryReport>,
    /// Every parameter gathered as F32 by name (with [`TrainConfig::collect_params`]).
    pub params: Vec<(String, Vec<f32>)>,
    /// The device in words.
    pub device: String,
    /// Ranks.
    pub world_size: usize,
    /// The optimizer in words.
    pub optimizer: String,
    /// The linears and their precision, in visit order (`h.0.c_attn: fp8`).
    pub linears: Vec<(String, LinearPrecision)>,
    /// The arithmetic in words (named in every output and checkpoint).
    pub recipe: String,
    /// Parameters of the model.
    pub num_params: usize,
    /// Phase timings (with [`TrainConfig::profile_steps`]).
    pub profile: Option<StepProfile>,
    /// Per rank, the loss of every training micro-batch of this invocation as the loss kernel produced
    /// it (its mean over the micro-batch). Read on the CPU only, where it costs no device wait.
    pub step_losses: Vec<Vec<f32>>,
    /// Lines the task printed after training (rank 0).
    pub after: Vec<String>,
}

impl TrainReport {
    /// The linears in FP8, by path.
    pub fn fp8_linears(&self) -> Vec<&str> {
        self.linears
            .iter()
            .filter(|(_, p)| *p == LinearPrecision::Fp8)
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// The last evaluation point.
    pub fn last(&self) -> Option<&MetricsRecord> {
        self.records.last()
    }

    /// The run summary line.
    pub fn summary(&self, program: &str) -> String {
        let fp8 = self.fp8_linears().len();
        format!(
            "Summary: {program}, {} params on {}, {} steps; {fp8} of {} linears in FP8; {}; recipe: {}",
            self.num_params,
            self.device,
            self.steps,
            self.linears.len(),
            self.optimizer,
            self.recipe
        )
    }
}

/// One rank's outcome.
struct RankOutcome {
    records: Vec<MetricsRecord>,
    steps: u64,
    stop: StopReason,
    memory: MemoryReport,
    params: Vec<(String, Vec<f32>)>,
    optimizer: String,
    linears: Vec<(String, LinearPrecision)>,
    recipe: String,
    num_params: usize,
    profile: Option<StepProfile>,
    step_losses: Vec<f32>,
    after: Vec<String>,
}

/// Where training stands: the next micro-batch of an epoch, the steps taken, and the training loss
/// accumulated since the last evaluation point (as the device holds it: an f32 sum).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Position {
    epoch: u32,
    batch: u64,
    step: u64,
    loss_sum: f32,
    loss_weight: u64,
}

const POSITION_KEYS: [&str; 5] = [
    "train.epoch",
    "train.batch",
    "train.step",
    "train.loss_sum",
    "train.loss_weight",
];

impl Position {
    fn start() -> Self {
        Position {
            epoch: 1,
            batch: 0,
            step: 0,
            loss_sum: 0.0,
            loss_weight: 0,
        }
    }

    fn to_extra(self) -> BTreeMap<String, String> {
        let vals = [
            self.epoch.to_string(),
            self.batch.to_string(),
            self.step.to_string(),
            format!("{:08x}", self.loss_sum.to_bits()),
            self.loss_weight.to_string(),
        ];
        POSITION_KEYS
            .iter()
            .zip(vals)
            .map(|(k, v)| ((*k).to_string(), v))
            .collect()
    }

    fn from_extra(extra: &BTreeMap<String, String>) -> Result<Self, TrainError> {
        let get = |k: &str| {
            extra
                .get(k)
                .ok_or_else(|| TrainError::Checkpoint(format!("no {k} in the checkpoint")))
        };
        let num = |k: &str| -> Result<u64, TrainError> {
            get(k)?
                .parse()
                .map_err(|e| TrainError::Checkpoint(format!("{k}: {e}")))
        };
        let bits = u32::from_str_radix(get("train.loss_sum")?, 16)
            .map_err(|e| TrainError::Checkpoint(format!("train.loss_sum: {e}")))?;
        Ok(Position {
            epoch: u32::try_from(num("train.epoch")?)
                .map_err(|e| TrainError::Checkpoint(format!("train.epoch: {e}")))?,
            batch: num("train.batch")?,
            step: num("train.step")?,
            loss_sum: f32::from_bits(bits),
            loss_weight: num("train.loss_weight")?,
        })
    }
}

/// Checkpoint keys of the schedule a checkpoint was saved under (a resume loads under it first).
const PLAN_STEPS_KEY: &str = "plan.total_steps";
const PLAN_EPOCHS_KEY: &str = "plan.epochs";
/// The program that wrote a checkpoint.
const PROGRAM_KEY: &str = "run.program";

/// Bytes allowed, in each checkpoint file and in its index, for the metrics record a save adds (a line
/// of about 1 KiB) when the room for a checkpoint is checked before training.
const RECORD_ALLOWANCE: u64 = 16 << 10;
/// Header bytes allowed per tensor of an export (its name not counted: that is added).
const EXPORT_TENSOR_HEADER: u64 = 512;
/// Bytes allowed for an export's fixed parts (the header's metadata, a format's small files).
const EXPORT_MARGIN: u64 = 64 << 10;
/// Bytes allowed for a metrics file (a line of about 1 KiB per evaluation point).
const METRICS_ALLOWANCE: u64 = 1 << 20;

/// The one training loop for every model (see the crate documentation).
#[derive(Debug, Clone)]
pub struct Trainer {
    config: TrainConfig,
}

impl Trainer {
    /// A trainer for runs as `config` says.
    pub fn new(config: TrainConfig) -> Self {
        Trainer { config }
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The arithmetic of the run in words.
    pub fn recipe_name(&self) -> String {
        let c = &self.config;
        let comm = c.fp8_grad_comm.describe();
        let comm = format!(
            "{comm}, {} gradient shards{}",
            c.grad_shards.name().to_uppercase(),
            if c.plain_gather == fsdp_shard::GatherDtype::Bf16 {
                ", BF16 plain-parameter gather"
            } else {
                ""
            }
        );
        match c.precision {
            Precision::Fp8 => format!(
                "FP8 linears ({}): {}; FP8 weight all-gather; {comm}{}",
                c.fp8_layers.name(),
                c.fp8_recipe.name(),
                if c.fp8_head {
                    "; FP8 LM head (E4M3 input and weight at current scales, E5M2 logits gradient)"
                } else {
                    ""
                }
            ),
            Precision::Bf16 => format!("BF16 linears; {comm}"),
            Precision::Fp32 => format!("F32 linears; {comm}"),
        }
    }

    /// The settings a checkpoint records: the Trainer's and the task's.
    fn settings<T: TrainTask>(&self, task: &T) -> RunSettings {
        let c = &self.config;
        let mut identity = vec![
            RunSetting::new(PROGRAM_KEY, "the program", task.name()),
            RunSetting::new("seed", "--seed", c.seed),
            RunSetting::new("precision", "--precision", c.precision.name()),
            RunSetting::new("grad_accum", "--grad-accum", c.grad_accum),
            RunSetting::new("grad_shards", "--grad-shards", c.grad_shards.name()),
            RunSetting::new(
                "optimizer_states",
                "--optimizer-states",
                c.optimizer_states.name(),
            ),
            RunSetting::new("world_size", "--world-size", c.world_size),
        ];
        if c.precision == Precision::Fp8 {
            identity.push(RunSetting::new(
                "fp8_layers",
                "--fp8-layers",
                c.fp8_layers.name(),
            ));
            identity.push(RunSetting::new(
                "fp8_recipe",
                "FP8 recipe (--recipe, --fp8-scaling, --fp8-margin)",
                c.fp8_recipe.name(),
            ));
            if c.fp8_head {
                // Only when on: checkpoints of runs before the flag existed resume without it.
                identity.push(RunSetting::new("fp8_head", "--fp8-head", "on"));
            }
            identity.push(RunSetting::new(
                "fp8_grad_comm",
                "--fp8-grad-comm",
                c.fp8_grad_comm.setting(),
            ));
        }
        identity.extend(task.identity());
        let length = match c.length {
            RunLength::Steps(s) => RunSetting::new("hyper.steps", "--steps", s),
            RunLength::Epochs(e) => RunSetting::new("hyper.epochs", "--epochs", e),
        };
        // The step in the backward computes the same numbers: a resume may switch it.
        let mut hyperparameters = vec![
            RunSetting::new("hyper.lr", "--lr", c.lr),
            length,
            RunSetting::new(
                "optimizer_in_backward",
                "--optimizer-in-backward",
                c.optimizer_in_backward,
            ),
        ];
        hyperparameters.extend(task.hyperparameters());
        RunSettings {
            binary: task.name().to_string(),
            identity,
            hyperparameters,
        }
    }

    /// Trains `task` as the configuration says; prints on rank 0 when asked.
    pub fn run<T: TrainTask>(&self, task: &T) -> Result<TrainReport, TrainError> {
        let c = &self.config;
        c.validate()?;
        self.check_inputs(task)?;
        // Outputs are checked (and the checkpoint directory locked) before any work.
        let files: Vec<(&str, &Path)> = c
            .metrics
            .iter()
            .map(|m| ("--metrics", m.as_path()))
            .collect();
        if let Some(path) = &c.export {
            task.weights_format()
                .check_output(path)
                .map_err(|e| TrainError::Config(format!("--export {}: {e}", path.display())))?;
        }
        let _outputs = RunOutputs::prepare(c.save.as_deref().map(|d| ("--save", d)), &files)?;
        self.check_no_overwrite()?;
        let (outcomes, device) = self.launch(task, |env| self.run_rank(task, env))?;
        let memory = outcomes.iter().map(|o| o.memory.clone()).collect();
        let step_losses = outcomes.iter().map(|o| o.step_losses.clone()).collect();
        let first = outcomes
            .into_iter()
            .next()
            .ok_or_else(|| TrainError::Config("no rank ran".into()))?;
        Ok(TrainReport {
            records: first.records,
            steps: first.steps,
            stop: first.stop,
            memory,
            params: first.params,
            device,
            world_size: c.world_size,
            optimizer: first.optimizer,
            linears: first.linears,
            recipe: first.recipe,
            num_params: first.num_params,
            profile: first.profile,
            step_losses,
            after: first.after,
        })
    }

    /// Input files named by flags exist and can be read before any work.
    fn check_inputs<T: TrainTask>(&self, _task: &T) -> Result<(), TrainError> {
        let c = &self.config;
        if let Some(p) = &c.init_from {
            std::fs::metadata(p)
                .map_err(|e| TrainError::Config(format!("--init-from {}: {e}", p.display())))?;
        }
        if let Some(dir) = &c.resume {
            read_index(dir)
                .map_err(|e| TrainError::Checkpoint(format!("--resume {}: {e}", dir.display())))?;
        }
        Ok(())
    }

    /// A committed checkpoint in `--save` is replaced only by a run that resumes from it, or with
    /// `--overwrite`.
    fn check_no_overwrite(&self) -> Result<(), TrainError> {
        let c = &self.config;
        let Some(save) = &c.save else {
            return Ok(());
        };
        let Ok((_, extra)) = read_index(save) else {
            return Ok(());
        };
        let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => a == b,
        };
        if c.overwrite || c.resume.as_deref().is_some_and(|r| same(r, save)) {
            return Ok(());
        }
        let step = extra
            .get("train.step")
            .map_or_else(|| "an unknown step".to_string(), |s| format!("step {s}"));
        Err(TrainError::Config(format!(
            "--save {}: it holds a checkpoint at {step}; this run would replace it. Continue it with \
             --resume {0}, or pass --overwrite to start afresh over it",
            save.display()
        )))
    }

    /// Total optimizer steps of the run and micro-batches per epoch (cached).
    fn total_steps<T: TrainTask>(
        &self,
        task: &T,
        data: &mut T::Data,
        env: &RankEnv,
    ) -> Result<u64, TrainError> {
        let accum = self.config.grad_accum as u64;
        match self.config.length {
            RunLength::Steps(s) => Ok(s),
            RunLength::Epochs(e) => {
                let mut total = 0u64;
                for epoch in 1..=e {
                    let n = task
                        .epoch_batches(data, env, epoch)
                        .map_err(TrainError::task)?
                        .ok_or_else(|| {
                            TrainError::Config(format!(
                                "{} has no epochs (its data is endless): give --steps, not --epochs",
                                task.name()
                            ))
                        })?;
                    if n == 0 {
                        return Err(TrainError::Config(format!(
                            "epoch {epoch} has no batches (too little data for the batch size)"
                        )));
                    }
                    total = total.saturating_add(n.div_ceil(accum));
                }
                Ok(total)
            }
        }
    }

    fn plan(&self, total_steps: u64) -> SchedulePlan {
        SchedulePlan {
            total_steps,
            epochs: match self.config.length {
                RunLength::Epochs(e) => Some(e),
                RunLength::Steps(_) => None,
            },
        }
    }

    fn set_schedule<T: TrainTask>(
        task: &T,
        opt: &mut dyn Optimizer,
        plan: &SchedulePlan,
    ) -> Result<(), TrainError> {
        let schedule: Box<dyn LrSchedule> = match task.schedule(plan).map_err(TrainError::task)? {
            Some(s) => s,
            None => Box::new(fsdp_optim::ConstantLr),
        };
        opt.set_schedule(schedule);
        Ok(())
    }

    /// The wrapped model: built by the task, converted to the run's precision, sharded.
    fn build<T: TrainTask>(&self, task: &T, env: &RankEnv) -> Result<Built<T::Model>, TrainError> {
        let c = &self.config;
        let mut module = task.build_model(env).map_err(TrainError::task)?;
        match c.precision {
            Precision::Fp8 => {
                convert_to_fp8(&mut module, &c.fp8_layers, &c.fp8_recipe)?;
                if c.fp8_head && convert_lm_heads_to_fp8(&mut module)?.is_empty() {
                    return Err(TrainError::Config(
                        "--fp8-head: the model has no LM head (fsdp_nn::LmHead)".into(),
                    ));
                }
            }
            Precision::Bf16 => set_linear_precision(&mut module, LinearPrecision::Bf16)?,
            Precision::Fp32 => set_linear_precision(&mut module, LinearPrecision::F32)?,
        }
        let linears = linear_precisions(&mut module)?
            .into_iter()
            .map(|(n, _, _, p)| (n, p))
            .collect();
        let fsdp = FsdpConfig {
            grad_reduction: c.fp8_grad_comm.reduction(),
            grad_dtype: c.grad_shards,
            plain_gather_dtype: c.plain_gather,
            weight_margin: c.fp8_recipe.weight_margin,
            init_seed: c.seed,
            ..FsdpConfig::default()
        };
        let mut model = FsdpModel::new(module, env.comm.clone(), task.wrap_policy(), fsdp)?;
        model.set_cpu_parallelism(env.parallelism);
        Ok((model, linears))
    }

    /// [`Trainer::build`] after the memory check (the speed mode's model).
    pub(crate) fn build_for_speed<T: TrainTask>(
        &self,
        task: &T,
        env: &RankEnv,
    ) -> Result<Built<T::Model>, TrainError> {
        self.check_memory(task, env)?;
        self.build(task, env)
    }

    /// Runs `rank` on every rank of the configured device and world (see [`launch_ranks`]); returns each
    /// rank's result and the device's description.
    pub(crate) fn launch<T: TrainTask, R: Send>(
        &self,
        task: &T,
        rank: impl Fn(&RankEnv) -> Result<R, TrainError> + Sync,
    ) -> Result<(Vec<R>, String), TrainError> {
        let c = &self.config;
        let launch = RankLaunch {
            binary: task.name(),
            device: c.device,
            world_size: c.world_size,
            threads_per_rank: c.threads_per_rank,
            timeout: c.timeout,
        };
        launch_ranks(&launch, |comm, par| rank(&rank_env(comm, par)))
    }

    /// The task's optimizer at the run's learning rate and state precision.
    pub(crate) fn optimizer<T: TrainTask>(
        &self,
        task: &T,
        model: &mut FsdpModel<T::Model>,
    ) -> Result<Box<dyn Optimizer>, TrainError> {
        let choice = OptimizerChoice {
            lr: self.config.lr,
            states: self.config.optimizer_states,
        };
        let opt = task.optimizer(model, &choice).map_err(TrainError::task)?;
        if !self.config.optimizer_in_backward {
            return Ok(opt);
        }
        // The optimizer is shared with the model's backward, which steps each unit as soon as its
        // gradients are reduced; the loop then only finishes the step (`finish_step`).
        match SharedOptimizer::install(opt, model) {
            Ok(shared) => Ok(Box::new(shared)),
            Err(e) => Err(TrainError::Config(format!("--optimizer-in-backward: {e}"))),
        }
    }

    /// With the step in the backward, begins it before the backward with the loss of the forward: a
    /// non-finite loss on any rank then skips every unit (no unit updated from the gradients of a
    /// diverged loss). A no-op otherwise.
    pub(crate) fn begin_step<T: TrainTask>(
        &self,
        task: &T,
        opt: &mut dyn Optimizer,
        model: &FsdpModel<T::Model>,
    ) -> Result<(), TrainError> {
        if !self.config.optimizer_in_backward {
            return Ok(());
        }
        let loss = task.loss(model).map_err(TrainError::task)?;
        // Element 0 is the loss; further elements are the task's own sums.
        let first = if loss.values.is_empty() {
            None
        } else {
            let mut b = model.device().zeros::<f32>(1)?;
            b.copy_range_from(0, loss.values, 0, 1)?;
            Some(b)
        };
        opt.begin_step_in_backward(model.sharded(), first.as_ref())?;
        Ok(())
    }

    /// The optimizer step after a training step's backward passes: the whole step, or with the step
    /// in the backward only its end (the units were stepped by the backward).
    pub(crate) fn finish_step<M: fsdp_shard::Module>(
        &self,
        opt: &mut dyn Optimizer,
        model: &mut FsdpModel<M>,
    ) -> Result<PendingStepReport, TrainError> {
        Ok(if self.config.optimizer_in_backward {
            finish_step_model(opt, model)?
        } else {
            step_model(opt, model)?
        })
    }

    /// The [`MemoryPlan`] of this run on `env`.
    fn memory_plan(&self, env: &RankEnv) -> MemoryPlan {
        let c = &self.config;
        MemoryPlan {
            world_size: env.world_size,
            cuda: env.device.is_cuda(),
            fp8_linears: c.precision == Precision::Fp8
                && !matches!(c.fp8_layers, fsdp_nn::Fp8Filter::None),
            optimizer_states: c.optimizer_states,
            grad_shards: c.grad_shards,
            optimizer_in_backward: c.optimizer_in_backward,
        }
    }

    fn check_memory<T: TrainTask>(&self, task: &T, env: &RankEnv) -> Result<(), TrainError> {
        let Some(estimate) = task
            .memory_estimate(&self.memory_plan(env))
            .map_err(TrainError::task)?
        else {
            return Ok(());
        };
        let Some(have) = available_bytes(&env.device)? else {
            return Ok(());
        };
        memory_verdict(&estimate, env.device.is_cuda(), env.world_size, have)
    }

    /// Refuses a run whose outputs would not fit on their filesystems, before the first step (see
    /// `space.rs` and step 1 in docs/architecture.md). What each output takes:
    ///
    /// - `--save`: one checkpoint generation, the sum over ranks of each rank's file
    ///   ([`fsdp_shard::checkpoint::shard_file_bytes`]: the shards, the optimizer's states and the
    ///   headers, from above) plus [`RECORD_ALLOWANCE`] per file for the metrics record a save adds,
    ///   plus `index.json` (the same key/values). A save writes the new generation beside the committed
    ///   one and removes the old after the commit, so a run that saves more than once needs two
    ///   generations at the second save, less what the directory holds now (removed at the first).
    /// - `--export`: every parameter in the export's element type, plus [`EXPORT_TENSOR_HEADER`] per
    ///   tensor and [`EXPORT_MARGIN`] (the header, a format's small files).
    /// - `--metrics`: [`METRICS_ALLOWANCE`].
    ///
    /// Outputs on one filesystem (the same device) add up. Every rank checks `--save` (each writes its
    /// file there), rank 0 also the files only it writes; the ranks then agree, so none fails alone and
    /// leaves the others waiting in a collective.
    #[allow(clippy::too_many_arguments)]
    fn check_room<T: TrainTask>(
        &self,
        task: &T,
        env: &RankEnv,
        model: &mut FsdpModel<T::Model>,
        opt: &dyn Optimizer,
        data: &mut T::Data,
        (settings, pos): (&RunSettings, Position),
        total_steps: u64,
    ) -> Result<(), TrainError> {
        let c = &self.config;
        if c.save.is_none() && c.export.is_none() && c.metrics.is_none() {
            return Ok(());
        }
        let (rank, ws) = (env.rank, env.world_size);
        let mut outputs = Vec::new();
        if let Some(dir) = &c.save {
            // The key/values of a save (all but the last metrics record, allowed for).
            let mut extra = pos.to_extra();
            extra.extend(settings.to_extra());
            extra.extend(task.data_state(data));
            extra.insert(PLAN_STEPS_KEY.into(), total_steps.to_string());
            if let RunLength::Epochs(e) = c.length {
                extra.insert(PLAN_EPOCHS_KEY.into(), e.to_string());
            }
            extra.extend(model.export_module_state()?);
            let own =
                shard_file_bytes(model.sharded(), Some(opt.as_state()), &extra)? + RECORD_ALLOWANCE;
            // Summed over ranks in 4 KiB blocks: exact in an f32 up to 64 GiB, within 1e-7 beyond.
            let mut blocks = [own.div_ceil(4096) as f32];
            if ws > 1 {
                env.comm.all_reduce_host_f32(&mut blocks, ReduceOp::Sum)?;
            }
            let index = serde_json::to_string(&extra)
                .map_or(0, |t| t.len() as u64)
                .saturating_add(RECORD_ALLOWANCE);
            let generation = (blocks[0] as u64).saturating_mul(4096) + index;
            let (what, bytes) = if self.saves_more_than_once(task, data, env, &pos, total_steps)? {
                let held = space::bytes_under(dir);
                (
                    format!(
                        "this run's checkpoints (each save writes one of about {} beside the \
                         previous until it commits)",
                        space::size_text(generation)
                    ),
                    generation.max(generation.saturating_mul(2).saturating_sub(held)),
                )
            } else {
                ("a checkpoint of this run".to_string(), generation)
            };
            outputs.push(space::Output {
                flag: "--save",
                path: dir.clone(),
                what,
                bytes,
            });
        }
        if rank == 0 {
            if let Some(path) = &c.export {
                let layout = model.sharded().layout();
                let (element, dtype) = match c.export_dtype {
                    ExportDtype::F32 => (4, "F32"),
                    ExportDtype::Bf16 => (2, "BF16"),
                };
                let headers: u64 = layout
                    .params
                    .iter()
                    .map(|p| p.name.len() as u64 + EXPORT_TENSOR_HEADER)
                    .sum();
                outputs.push(space::Output {
                    flag: "--export",
                    path: path.clone(),
                    what: format!("the exported weights in {dtype}"),
                    bytes: (layout.numel() as u64 * element) + headers + EXPORT_MARGIN,
                });
            }
            if let Some(path) = &c.metrics {
                outputs.push(space::Output {
                    flag: "--metrics",
                    path: path.clone(),
                    what: "the metrics".to_string(),
                    bytes: METRICS_ALLOWANCE,
                });
            }
        }
        // A filesystem that cannot be measured is not a refusal: the writability checks passed, and a
        // write that fails says why.
        let measured: Vec<_> = outputs
            .into_iter()
            .filter_map(|o| space::filesystem_of(&o.path).ok().map(|fs| (o, fs)))
            .collect();
        let own = space::check_room(&measured).err();
        if ws > 1 {
            let mut failed = vec![0f32; ws];
            failed[rank] = if own.is_some() { 1.0 } else { 0.0 };
            env.comm.all_reduce_host_f32(&mut failed, ReduceOp::Max)?;
            if own.is_none() {
                if let Some(r) = failed.iter().position(|f| *f != 0.0) {
                    env.comm.note_failure_caused_by_peer();
                    return Err(TrainError::Config(format!(
                        "rank {r} found too little free disk space for this run's outputs (its error \
                         says why)"
                    )));
                }
            }
        }
        own.map_or(Ok(()), |e| Err(TrainError::Config(e)))
    }

    /// Whether the rest of the run saves more than once (a periodic save, or an epoch's end, before its
    /// last step): then two checkpoint generations are on disk at once while the second commits.
    fn saves_more_than_once<T: TrainTask>(
        &self,
        task: &T,
        data: &mut T::Data,
        env: &RankEnv,
        pos: &Position,
        total_steps: u64,
    ) -> Result<bool, TrainError> {
        let c = &self.config;
        let end = c
            .stop_after_steps
            .map_or(total_steps, |s| s.min(total_steps));
        if c.save_every
            .is_some_and(|k| k > 0 && (pos.step / k + 1).saturating_mul(k) < end)
        {
            return Ok(true);
        }
        match c.length {
            RunLength::Epochs(e) => Ok(pos.epoch < e),
            RunLength::Steps(_) => {
                // Finite data saves at each epoch's end too.
                let Some(n) = task
                    .epoch_batches(data, env, pos.epoch)
                    .map_err(TrainError::task)?
                else {
                    return Ok(false);
                };
                let to_epoch_end = n.saturating_sub(pos.batch).div_ceil(c.grad_accum as u64);
                Ok(pos.step.saturating_add(to_epoch_end) < end)
            }
        }
    }

    fn run_rank<T: TrainTask>(&self, task: &T, env: &RankEnv) -> Result<RankOutcome, TrainError> {
        let c = &self.config;
        let device = env.device.clone();
        if let Device::Cuda(cu) = &device {
            // Keep freed pool memory cached across host reads instead of unmapping it.
            cu.set_pool_release_threshold(u64::MAX)?;
        }
        let (rank, ws) = (env.rank, env.world_size);
        let lead = rank == 0 && c.print;
        self.check_memory(task, env)?;
        let settings = self.settings(task);
        let (mut model, linears) = self.build(task, env)?;
        if let Some(path) = &c.init_from {
            let init =
                |e: ShardError| TrainError::Config(format!("--init-from {}: {e}", path.display()));
            let source = task.weights_format().read(path).map_err(init)?;
            model.import_from(source.as_ref(), false).map_err(init)?;
        }
        let mut opt = self.optimizer(task, &mut model)?;
        let mut data = task.data(env).map_err(TrainError::task)?;
        let total_steps = self.total_steps(task, &mut data, env)?;
        Self::set_schedule(task, opt.as_mut(), &self.plan(total_steps))?;
        let mut pos = Position::start();
        let mut changes = Vec::new();
        let mut carried = None;
        if let Some(dir) = &c.resume {
            let (_, saved) = read_index(dir)?;
            if let Some(p) = saved.get(PROGRAM_KEY).filter(|p| *p != task.name()) {
                return Err(TrainError::Checkpoint(format!(
                    "--resume {}: the checkpoint was written by {p}; this is {}",
                    dir.display(),
                    task.name()
                )));
            }
            changes = check_resume(&saved, &settings).map_err(TrainError::Checkpoint)?;
            if lead {
                for ch in &changes {
                    println!("resuming with a changed setting: {ch}");
                }
            }
            // The optimizer checks the schedule it loads against its own: load under the saved one.
            let saved_plan = SchedulePlan {
                total_steps: saved
                    .get(PLAN_STEPS_KEY)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(total_steps),
                epochs: saved.get(PLAN_EPOCHS_KEY).and_then(|v| v.parse().ok()),
            };
            Self::set_schedule(task, opt.as_mut(), &saved_plan)?;
            let loaded = model.load_checkpoint(dir, Some(opt.as_state_mut()))?;
            if loaded.saved_world_size != ws {
                return Err(TrainError::Checkpoint(format!(
                    "saved by {} rank(s); resume with --world-size {} (the data order and each rank's \
                     share of a batch depend on it)",
                    loaded.saved_world_size, loaded.saved_world_size
                )));
            }
            pos = Position::from_extra(&loaded.extra)?;
            task.load_data_state(&mut data, &loaded.extra)
                .map_err(TrainError::task)?;
            carried = saved_record(&loaded.extra)?;
            let at = opt.schedule_position();
            Self::set_schedule(task, opt.as_mut(), &self.plan(total_steps))?;
            opt.set_schedule_position(at);
            opt.set_lr(c.lr)?;
        }
        let done = match c.length {
            RunLength::Steps(s) => pos.step >= s,
            RunLength::Epochs(e) => pos.epoch > e,
        };
        if !done {
            // Before the metrics file is rewritten and before any step: the outputs fit.
            self.check_room(
                task,
                env,
                &mut model,
                opt.as_ref(),
                &mut data,
                (&settings, pos),
                total_steps,
            )?;
        }
        let mut writer = match (&c.metrics, rank == 0) {
            (Some(path), true) if c.resume.is_some() => {
                let through = pos.step;
                let has_carried = carried.is_some();
                Some(resume_metrics(
                    path,
                    |r| {
                        let s = r.step.unwrap_or(0);
                        s < through || (!has_carried && s == through)
                    },
                    carried.as_ref(),
                )?)
            }
            (Some(path), true) => Some(MetricsWriter::create(path).map_err(metrics_flag)?),
            _ => None,
        };
        let recipe = self.recipe_name();
        let num_params = model.num_params();
        if done {
            if lead {
                println!(
                    "nothing to train: the checkpoint is at step {} and this run ends at step \
                     {total_steps} ({}); raise --steps or --epochs to train on",
                    pos.step,
                    match c.length {
                        RunLength::Steps(s) => format!("--steps {s}"),
                        RunLength::Epochs(e) => format!("--epochs {e}"),
                    }
                );
            }
            let memory = opt.memory(model.sharded())?;
            return Ok(RankOutcome {
                records: Vec::new(),
                steps: pos.step,
                stop: StopReason::AlreadyDone,
                memory,
                params: Vec::new(),
                optimizer: opt.describe(),
                linears,
                recipe,
                num_params,
                profile: None,
                step_losses: Vec::new(),
                after: Vec::new(),
            });
        }
        let mut state = LoopState {
            acc: None,
            acc_start: pos.loss_sum,
            step_losses: Vec::new(),
            records: Vec::new(),
            profile: None,
            profiler: c
                .profile_steps
                .map(|n| StepProfiler::new(&device, n, PROFILE_WARMUP_STEPS, c.profile_sync)),
            steps_run: 0,
            skipped: SkipWatch::default(),
            changes,
        };
        let stop = self.train_loop(
            task,
            env,
            &mut model,
            opt.as_mut(),
            &mut data,
            &mut pos,
            total_steps,
            &settings,
            writer.as_mut(),
            &mut state,
        )?;
        let mut after = Vec::new();
        if stop == StopReason::Completed {
            if let Some(path) = &c.export {
                let format = task.weights_format();
                export_with(&mut model, opt.as_ref(), |tensors| {
                    format.write(path, tensors, c.export_dtype)
                })
                .map_err(|e| {
                    TrainError::Config(format!(
                        "--export {}: {e}{}",
                        path.display(),
                        if c.save.is_some() {
                            " (the trained weights are in the --save checkpoint)"
                        } else {
                            ""
                        }
                    ))
                })?;
                if lead {
                    println!("master weights written to {}", path.display());
                }
            }
            after = task
                .after_training(&mut model, &mut data, env)
                .map_err(TrainError::task)?;
        }
        let params = if c.collect_params {
            model.gathered_params()?
        } else {
            Vec::new()
        };
        let memory = opt.memory(model.sharded())?;
        Ok(RankOutcome {
            records: state.records,
            steps: pos.step,
            stop,
            memory,
            params,
            optimizer: opt.describe(),
            linears,
            recipe,
            num_params,
            profile: state.profile,
            step_losses: state.step_losses,
            after,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn train_loop<T: TrainTask>(
        &self,
        task: &T,
        env: &RankEnv,
        model: &mut FsdpModel<T::Model>,
        opt: &mut dyn Optimizer,
        data: &mut T::Data,
        pos: &mut Position,
        total_steps: u64,
        settings: &RunSettings,
        mut writer: Option<&mut MetricsWriter>,
        st: &mut LoopState,
    ) -> Result<StopReason, TrainError> {
        let c = &self.config;
        let device = env.device.clone();
        let (rank, ws) = (env.rank, env.world_size);
        let lead = rank == 0 && c.print;
        let accum = c.grad_accum as u64;
        let clock = task.schedule_clock();
        let eval_every = c.eval_every.or(match c.length {
            RunLength::Steps(s) => Some((s / 10).max(1)),
            RunLength::Epochs(_) => None,
        });
        let mode = if rank == 0 {
            c.progress
        } else {
            ProgressMode::Hidden
        };
        // Reading the loss waits for the device: on CUDA only where something shows it. The optimizer's
        // report (non-finite steps) is read at the same steps on every rank.
        let cuda = device.is_cuda();
        let check_every: u64 = if cuda { 10 } else { 1 };
        let mut since_point = (Instant::now(), 0u64, 0.0f64);
        loop {
            let epoch = pos.epoch;
            let n = task
                .epoch_batches(data, env, epoch)
                .map_err(TrainError::task)?;
            if clock == ScheduleClock::Epoch {
                opt.set_schedule_position(u64::from(epoch.saturating_sub(1)));
            }
            let remaining_units = match n {
                Some(n) => n.saturating_sub(pos.batch),
                None => total_steps.saturating_sub(pos.step).saturating_mul(accum),
            };
            let label = match n {
                Some(_) => format!("epoch {epoch}"),
                None => "train".to_string(),
            };
            // The bar's total is only its scale; the weight of a batch is known once it is made.
            let mut progress =
                EpochProgress::new(epoch, remaining_units, mode).with_labels(&label, "batches");
            let show_every = if progress.is_visible() {
                check_every
            } else {
                u64::MAX
            };
            let mut shown = f64::NAN;
            loop {
                let in_epoch = match n {
                    Some(n) => pos.batch < n,
                    None => pos.step < total_steps,
                };
                if !in_epoch {
                    break;
                }
                let micro_count = match n {
                    Some(n) => accum.min(n - pos.batch),
                    None => accum,
                };
                let s = pos.step + 1;
                let log_now = c.log_every.is_some_and(|k| s % k == 0);
                let read = !cuda || log_now || s % show_every == 0;
                let mut prof = match st.profiler.as_mut() {
                    Some(p) if st.steps_run >= PROFILE_WARMUP_STEPS => p.begin()?,
                    _ => None,
                };
                model.set_grad_divisor(if task.averages_in_loss() {
                    1.0
                } else {
                    (ws as u64 * micro_count) as f32
                })?;
                let (mut step_sum, mut step_weight) = (0.0f64, 0u64);
                for micro in 0..micro_count {
                    let batch = task
                        .batch(
                            data,
                            env,
                            BatchIndex {
                                epoch,
                                index: pos.batch + micro,
                                step_micro_batches: micro_count,
                            },
                        )
                        .map_err(TrainError::task)?;
                    mark(&mut prof, Phase::Data)?;
                    model.set_grad_sync(micro + 1 == micro_count);
                    task.forward(model, &batch).map_err(TrainError::task)?;
                    let weight = task.batch_weight(&batch);
                    {
                        let loss = task.loss(model).map_err(TrainError::task)?;
                        let a = match loss.kind {
                            LossKind::Mean => weight as f32,
                            LossKind::Sum => 1.0,
                        };
                        let acc = match st.acc.as_mut() {
                            Some(b) if b.len() == loss.values.len() => b,
                            _ => {
                                let mut init = vec![0f32; loss.values.len()];
                                if let Some(v) = init.first_mut() {
                                    *v = st.acc_start;
                                }
                                st.acc.insert(device.upload(&init)?)
                            }
                        };
                        elementwise::axpy(a, loss.values, acc)?;
                        if read {
                            let v = loss.values.to_vec()?.first().copied().unwrap_or(f32::NAN);
                            if !cuda {
                                st.step_losses.push(match loss.kind {
                                    LossKind::Mean => v,
                                    LossKind::Sum => v / weight.max(1) as f32,
                                });
                            }
                            step_sum += match loss.kind {
                                LossKind::Mean => f64::from(v) * weight as f64,
                                LossKind::Sum => f64::from(v),
                            };
                        }
                    }
                    step_weight += weight;
                    mark(&mut prof, Phase::Forward)?;
                    self.begin_step(task, opt, model)?;
                    task.backward(model, &batch).map_err(TrainError::task)?;
                    mark(&mut prof, Phase::Backward)?;
                }
                let report = self.finish_step(opt, model)?;
                mark(&mut prof, Phase::Optimizer)?;
                finish_profiled_step(&mut st.profiler, prof, &mut st.profile, lead)?;
                st.steps_run += 1;
                if clock == ScheduleClock::Step {
                    opt.advance_schedule();
                }
                pos.step = s;
                pos.batch += micro_count;
                pos.loss_weight += step_weight;
                since_point.1 += step_weight * ws as u64;
                if read {
                    shown = step_sum / step_weight.max(1) as f64;
                }
                progress.advance(micro_count, shown);
                if log_now {
                    let mut l = [step_sum as f32, step_weight as f32];
                    env.comm.all_reduce_host_f32(&mut l, ReduceOp::Sum)?;
                    if lead {
                        progress.println(&format!(
                            "step {s}: loss {:.4}, lr {:.3e}",
                            f64::from(l[0]) / f64::from(l[1]).max(1.0),
                            opt.current_lr()
                        ));
                    }
                }
                let epoch_end = n.is_some_and(|n| pos.batch >= n);
                let run_end = match c.length {
                    RunLength::Steps(total) => s >= total,
                    RunLength::Epochs(e) => epoch_end && epoch >= e,
                };
                let eval_now = run_end
                    || eval_every.map_or(epoch_end, |k| s % k == 0)
                    || (eval_every.is_none() && epoch_end);
                if s % check_every == 0 || eval_now || run_end {
                    let r = report.read()?;
                    st.skipped.observe(s, r.skipped, r.skipped_total);
                    if st.skipped.consecutive >= c.max_skipped_steps {
                        return Err(TrainError::Diverged {
                            steps: st.skipped.consecutive,
                            limit: c.max_skipped_steps,
                            at: s,
                        });
                    }
                }
                let signal = self.agree_signal(env, s)?;
                let stop_after = c.stop_after_steps == Some(s);
                if epoch_end {
                    // The checkpoint of an epoch's end continues with the next epoch.
                    pos.epoch += 1;
                    pos.batch = 0;
                }
                let mut record = None;
                if eval_now {
                    let lr = opt.current_lr();
                    let train_secs = since_point.0.elapsed().as_secs_f64();
                    let r = self.evaluation_point(
                        task,
                        env,
                        model,
                        data,
                        st,
                        pos,
                        epoch,
                        s,
                        lr,
                        train_secs,
                        since_point.1,
                    )?;
                    if lead {
                        for line in task.report_lines(&r) {
                            progress.println(&line);
                        }
                    }
                    record = Some(r);
                    since_point = (Instant::now(), 0, 0.0);
                }
                let periodic = c.save_every.is_some_and(|k| s % k == 0);
                let stopping = stop_after || signal.is_some();
                if let (Some(dir), true) = (
                    &c.save,
                    periodic || stopping || run_end || (epoch_end && n.is_some()),
                ) {
                    let data_state = task.data_state(data);
                    self.save(
                        dir,
                        model,
                        opt,
                        pos,
                        st,
                        (settings, data_state),
                        total_steps,
                        record.as_ref(),
                    )?;
                }
                if let (Some(w), Some(r)) = (writer.as_deref_mut(), &record) {
                    w.write(r).map_err(metrics_flag)?;
                }
                if let Some(r) = record {
                    st.records.push(r);
                }
                if let Some(sig) = signal {
                    progress.finish();
                    if lead {
                        println!(
                            "stopped by {} after step {s}{}",
                            signal::name(sig),
                            c.save.as_ref().map_or_else(
                                || " (no --save: nothing was saved)".to_string(),
                                |d| format!(
                                    "; checkpoint saved in {0} (continue with --resume {0})",
                                    d.display()
                                )
                            )
                        );
                    }
                    return Ok(StopReason::Signal(sig));
                }
                if stop_after && !run_end {
                    progress.finish();
                    if lead {
                        println!("stopped after {s} steps as asked");
                    }
                    return Ok(StopReason::StopAfter);
                }
                if run_end {
                    progress.finish();
                    return Ok(StopReason::Completed);
                }
                if epoch_end {
                    break;
                }
            }
            progress.finish();
        }
    }

    /// The stop signal agreed by every rank after step `s` (a collective on several ranks: no rank may
    /// stop alone and leave the others waiting). Multi-process GPU runs agree every 10 steps.
    fn agree_signal(&self, env: &RankEnv, s: u64) -> Result<Option<i32>, TrainError> {
        if !self.config.stop_on_signal {
            return Ok(None);
        }
        let local = signal::requested().unwrap_or(0);
        if env.world_size == 1 {
            return Ok((local != 0).then_some(local));
        }
        if env.device.is_cuda() && s % 10 != 0 {
            return Ok(None);
        }
        let mut v = [local as f32];
        env.comm.all_reduce_host_f32(&mut v, ReduceOp::Max)?;
        let sig = v[0] as i32;
        Ok((sig != 0).then_some(sig))
    }

    /// Evaluates and builds the metrics record of a point (resets the training-loss accumulator).
    #[allow(clippy::too_many_arguments)]
    fn evaluation_point<T: TrainTask>(
        &self,
        task: &T,
        env: &RankEnv,
        model: &mut FsdpModel<T::Model>,
        data: &mut T::Data,
        st: &mut LoopState,
        pos: &mut Position,
        epoch: u32,
        step: u64,
        lr: f64,
        train_secs: f64,
        trained_units: u64,
    ) -> Result<MetricsRecord, TrainError> {
        let c = &self.config;
        let ws = env.world_size;
        // Training loss: the weighted mean since the last point, over every rank.
        let local = match &st.acc {
            Some(a) => a.to_vec()?.first().copied().unwrap_or(0.0),
            None => st.acc_start,
        };
        let mut sums = [local];
        env.comm.all_reduce_host_f32(&mut sums, ReduceOp::Sum)?;
        let global_weight = pos.loss_weight.saturating_mul(ws as u64);
        let train_loss = if global_weight > 0 {
            f64::from(sums[0]) / global_weight as f64
        } else {
            f64::NAN
        };
        if let Some(a) = st.acc.as_mut() {
            a.fill_zero()?;
        }
        st.acc_start = 0.0;
        pos.loss_sum = 0.0;
        pos.loss_weight = 0;
        let started = Instant::now();
        let eval = task.evaluate(model, data, env).map_err(TrainError::task)?;
        // Evaluation batches are larger than training ones: their CPU buffers, kept for reuse across the
        // evaluation's batches, would otherwise sit idle until the next evaluation.
        fp8_kernels::device::clear_host_buffer_cache();
        let seconds = train_secs + started.elapsed().as_secs_f64();
        let (correct, total) = eval.correct.unwrap_or((0, 0));
        let mut r = MetricsRecord::new(
            epoch,
            train_loss,
            eval.loss,
            correct,
            total,
            seconds,
            trained_units as f64 / train_secs.max(1e-9),
        );
        r.step = Some(step);
        r.lr = Some(lr);
        let extra = [
            ("precision", serde_json::json!(c.precision.name())),
            ("world_size", serde_json::json!(ws)),
            (
                "device",
                serde_json::json!(if env.device.is_cuda() { "cuda" } else { "cpu" }),
            ),
            ("train_seconds", serde_json::json!(train_secs)),
            ("unit", serde_json::json!(task.unit())),
            ("recipe", serde_json::json!(self.recipe_name())),
            ("seed", serde_json::json!(c.seed)),
        ];
        for (k, v) in extra {
            r.extra.insert(k.to_string(), v);
        }
        if c.optimizer_in_backward {
            r.extra
                .insert("optimizer_in_backward".into(), serde_json::json!(true));
        }
        for (k, v) in eval.extra {
            r.extra.insert(k, v);
        }
        for (k, v) in task.describe() {
            r.extra.entry(k).or_insert(v);
        }
        if !st.changes.is_empty() {
            r.extra
                .insert("resumed_changes".into(), st.changes.join("; ").into());
            st.changes.clear();
        }
        Ok(r)
    }

    /// Saves the run's checkpoint (collective).
    #[allow(clippy::too_many_arguments)]
    fn save<M: fsdp_shard::Module>(
        &self,
        dir: &Path,
        model: &mut FsdpModel<M>,
        opt: &dyn Optimizer,
        pos: &mut Position,
        st: &LoopState,
        (settings, data_state): (&RunSettings, BTreeMap<String, String>),
        total_steps: u64,
        record: Option<&MetricsRecord>,
    ) -> Result<(), TrainError> {
        // The accumulated loss as the device holds it (bit for bit across the resume).
        pos.loss_sum = match &st.acc {
            Some(a) => a.to_vec()?.first().copied().unwrap_or(0.0),
            None => st.acc_start,
        };
        let mut extra = pos.to_extra();
        if let Some(r) = record {
            extra.insert(crate::settings::LAST_RECORD_KEY.into(), r.to_json_line()?);
        }
        extra.extend(settings.to_extra());
        extra.extend(data_state);
        extra.insert(PLAN_STEPS_KEY.into(), total_steps.to_string());
        if let RunLength::Epochs(e) = self.config.length {
            extra.insert(PLAN_EPOCHS_KEY.into(), e.to_string());
        }
        model.save_checkpoint(dir, Some(opt.as_state()), &extra)?;
        Ok(())
    }
}

/// Consecutive steps skipped for non-finite gradients, from the optimizer's reports.
#[derive(Debug, Default)]
struct SkipWatch {
    last_step: u64,
    last_total: u64,
    consecutive: u64,
}

impl SkipWatch {
    /// A report read after step `step`: whether that step was skipped and the skips so far.
    fn observe(&mut self, step: u64, skipped: bool, total: u64) {
        let steps = step.saturating_sub(self.last_step);
        let skips = total.saturating_sub(self.last_total);
        self.consecutive = if !skipped {
            0
        } else if skips >= steps {
            // Every step since the last read was skipped.
            self.consecutive + steps
        } else {
            1
        };
        self.last_step = step;
        self.last_total = total;
    }
}

/// What the loop carries between steps.
struct LoopState {
    /// The training loss accumulated on the device since the last point (element 0).
    acc: Option<Buffer<f32>>,
    /// Element 0 of `acc` when it is first made (a resumed run's saved sum).
    acc_start: f32,
    step_losses: Vec<f32>,
    records: Vec<MetricsRecord>,
    profile: Option<StepProfile>,
    profiler: Option<StepProfiler>,
    steps_run: usize,
    skipped: SkipWatch,
    /// Settings a resume changed, recorded in the first metrics line after it.
    changes: Vec<String>,
}

/// A rank's environment from its communicator.
pub(crate) fn rank_env(comm: Arc<dyn Communicator>, parallelism: CpuParallelism) -> RankEnv {
    RankEnv {
        device: comm.device().clone(),
        rank: comm.rank(),
        world_size: comm.world_size(),
        comm,
        parallelism,
    }
}

/// Bytes the device can still give: the GPU's free memory, or the host's `MemAvailable`.
pub fn available_bytes(device: &Device) -> Result<Option<u64>, TrainError> {
    if let Device::Cuda(c) = device {
        let (free, _) = c
            .context()
            .mem_get_info()
            .map_err(fp8_kernels::KernelError::from)?;
        return Ok(Some(free as u64));
    }
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return Ok(None);
    };
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024))
}

/// A metrics file's error, naming the flag (the error itself names the path and the cause).
fn metrics_flag(e: crate::metrics::MetricsError) -> TrainError {
    TrainError::Config(format!("--metrics {e}"))
}

/// Refuses a run whose estimated peak exceeds the `have` bytes free (thread ranks share the host:
/// each needs its share; a GPU rank needs its own), naming every part and what sizes it.
pub fn memory_verdict(
    estimate: &MemoryEstimate,
    cuda: bool,
    world_size: usize,
    have: u64,
) -> Result<(), TrainError> {
    let ranks = if cuda { 1 } else { world_size.max(1) as u64 };
    let need = estimate.total().saturating_mul(ranks);
    if need <= have {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let parts = estimate
        .parts
        .iter()
        .map(|p| format!("{}: {:.2} GiB", p.what, gib(p.bytes)))
        .collect::<Vec<_>>()
        .join("; ");
    let (whose, each, per_rank) = match (cuda, ranks) {
        (true, _) => ("of GPU memory per rank", "", ""),
        (false, 1) => ("of host memory", "", ""),
        (false, _) => ("of host memory for its thread ranks", "each: ", " per rank"),
    };
    // The task's own settings first, each with the count that closes the gap (per rank: thread ranks
    // each save what one saves).
    let gap_per_rank = (need - have).div_ceil(ranks);
    let advice: Vec<String> = estimate
        .remedies
        .iter()
        .filter_map(|r| r.advice(gap_per_rank))
        .map(|(setting, saves)| format!("{setting} (about {:.2} GiB less{per_rank})", gib(saves)))
        .collect();
    let fixes = if advice.is_empty() {
        String::new()
    } else {
        format!("{}; or ", advice.join(", or "))
    };
    Err(TrainError::Config(format!(
        "this run needs at least about {:.2} GiB {whose} ({each}{parts}) but {:.2} GiB are free: {fixes}use \
         a smaller model, --batch-size or --seq-len, more ranks, or a device with more memory",
        gib(need),
        gib(have)
    )))
}

/// An evaluation loop's sums over every rank: gathers every unit once for the pass (so ranks with
/// fewer batches take part in the same collectives), runs `batch(model, i)` for this rank's batches
/// `i` (each returning its `N` sums in f32, added in order), releases the units and all-reduces the
/// sums. A task's [`TrainTask::evaluate`] is this plus its batches and the division.
pub fn evaluate_sums<M: fsdp_shard::Module, E, const N: usize>(
    model: &mut FsdpModel<M>,
    batches: impl IntoIterator<Item = usize>,
    mut batch: impl FnMut(&mut FsdpModel<M>, usize) -> Result<[f32; N], E>,
) -> Result<[f32; N], E>
where
    E: From<fsdp_shard::ShardError> + From<fsdp_comm::CommError>,
{
    model.gather_all()?;
    let mut sums = [0f32; N];
    for i in batches {
        let s = batch(model, i)?;
        for (a, b) in sums.iter_mut().zip(s) {
            *a += b;
        }
    }
    model.release_all()?;
    let comm = model.comm().clone();
    comm.all_reduce_host_f32(&mut sums, ReduceOp::Sum)?;
    Ok(sums)
}

/// Runs an evaluation forward of `f` (a convenience for [`TrainTask::evaluate`]).
pub fn eval_forward<M, R, E: From<fsdp_shard::ShardError>>(
    model: &mut FsdpModel<M>,
    f: impl FnOnce(&mut M, &mut fsdp_shard::Ctx<'_>) -> Result<R, E>,
) -> Result<R, E>
where
    M: fsdp_shard::Module,
{
    model.forward(Mode::Eval, f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryRemedy;

    #[test]
    fn the_memory_verdict_counts_thread_ranks_and_names_the_parts() {
        let e = MemoryEstimate::default()
            .part("model state (--preset x)", 6 << 30)
            .part("activations (--batch-size 8)", 4 << 30);
        assert!(memory_verdict(&e, false, 1, 10 << 30).is_ok());
        // Two thread ranks on one host need twice; a GPU rank needs its own only.
        let m = memory_verdict(&e, false, 2, 19 << 30)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("20.00 GiB") && m.contains("19.00 GiB") && m.contains("thread ranks"),
            "{m}"
        );
        assert!(m.contains("model state (--preset x): 6.00 GiB"), "{m}");
        assert!(m.contains("activations (--batch-size 8): 4.00 GiB"), "{m}");
        assert!(memory_verdict(&e, true, 2, 10 << 30).is_ok());
        let m = memory_verdict(&e, true, 1, 9 << 30)
            .unwrap_err()
            .to_string();
        assert!(m.contains("GPU memory per rank"), "{m}");
        assert!(!m.contains("less"), "no remedy was given: {m}");
    }

    #[test]
    fn the_memory_verdict_names_the_smallest_count_that_fits() {
        let e = MemoryEstimate::default()
            .part("model state", 6 << 30)
            .part("activations", 4 << 30)
            .remedy(MemoryRemedy::count(
                "--recompute-mlp-up {n}",
                1 << 28,
                2,
                12,
            ))
            .remedy(MemoryRemedy::switch("--recompute", 3 << 30));
        // 1.1 GiB over: five more quarter-GiB blocks (1.25 GiB), seven in all; the switch saves enough.
        let have = (10 << 30) - (11 << 30) / 10;
        let m = memory_verdict(&e, true, 1, have).unwrap_err().to_string();
        assert!(
            m.contains("--recompute-mlp-up 7 (about 1.25 GiB less)"),
            "{m}"
        );
        assert!(m.contains("--recompute (about 3.00 GiB less)"), "{m}");
        // 3.5 GiB over: the count would pass its maximum and the switch saves too little.
        let m = memory_verdict(&e, true, 1, (13 << 30) / 2)
            .unwrap_err()
            .to_string();
        assert!(!m.contains("--recompute"), "{m}");
        // Two thread ranks on a host: each closes its half of the gap (1.1 GiB each -> 5 more blocks).
        let m = memory_verdict(&e, false, 2, 2 * have)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("--recompute-mlp-up 7 (about 1.25 GiB less per rank)"),
            "{m}"
        );
        // A count already at its maximum, or a zero saving, gives no advice.
        assert_eq!(MemoryRemedy::count("--x {n}", 1, 12, 12).advice(1), None);
        assert_eq!(MemoryRemedy::count("--x {n}", 0, 0, 12).advice(1), None);
        assert_eq!(
            MemoryRemedy::count("--x {n}", 10, 0, 12).advice(25),
            Some(("--x 3".to_string(), 30))
        );
    }
}
