//! [`TrainTask`]: what a model brings to the [`crate::Trainer`] — its layers, its data, its loss and its
//! evaluation — and the small types they exchange. Everything else (ranks, FP8 conversion, sharding,
//! resume, accumulation, the optimizer step and schedule, metrics, checkpoints, export, profiling,
//! signals) is the Trainer's.

use crate::metrics::MetricsRecord;
use crate::settings::RunSetting;
use crate::TrainError;
use fp8_kernels::{Buffer, CpuParallelism, Device};
use fsdp_comm::Communicator;
use fsdp_optim::{AdamOptions, FsdpAdamW, LrSchedule, Optimizer, StatePrecision};
use fsdp_shard::{FsdpModel, GradDtype, Module, WrapPolicy};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One rank as a task sees it.
#[derive(Clone)]
pub struct RankEnv {
    /// The rank's communicator (thread ranks on the CPU, NCCL on GPUs).
    pub comm: Arc<dyn Communicator>,
    /// Where the rank computes.
    pub device: Device,
    /// This rank.
    pub rank: usize,
    /// Ranks in all.
    pub world_size: usize,
    /// Threads of this rank's CPU kernels.
    pub parallelism: CpuParallelism,
}

impl std::fmt::Debug for RankEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankEnv")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device.is_cuda())
            .finish()
    }
}

/// How the loss buffer a task hands over is to be read: element 0 is the micro-batch's mean loss or its
/// sum (over the [`TrainTask::batch_weight`] samples or tokens of this rank's micro-batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossKind {
    /// Element 0 is the mean.
    Mean,
    /// Element 0 is the sum.
    Sum,
}

/// The loss of the last training forward, on the device (read only when the Trainer chooses to).
#[derive(Debug, Clone, Copy)]
pub struct LossValue<'a> {
    /// Element 0 holds the loss (further elements are accumulated alongside and ignored).
    pub values: &'a Buffer<f32>,
    /// Whether element 0 is a mean or a sum.
    pub kind: LossKind,
}

/// Which micro-batch the Trainer asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchIndex {
    /// The epoch (1-based; always 1 for a run counted in steps over endless data).
    pub epoch: u32,
    /// The micro-batch of this rank within the epoch (0-based; with endless data, since the start).
    pub index: u64,
    /// Micro-batches in the optimizer step this one belongs to (fewer than `--grad-accum` at the end of
    /// an epoch).
    pub step_micro_batches: u64,
}

/// The optimizer a run asks for (the task builds its own kind, e.g. AdamW with its betas).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerChoice {
    /// Base learning rate.
    pub lr: f64,
    /// Storage of the FP8 weights' master and moments.
    pub states: StatePrecision,
}

/// What a learning-rate schedule may depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulePlan {
    /// Optimizer steps of the whole run (for a run counted in epochs: the epochs' steps).
    pub total_steps: u64,
    /// Epochs of the run, when it is counted in epochs.
    pub epochs: Option<u32>,
}

/// When the Trainer moves the learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScheduleClock {
    /// One position per optimizer step (warm-up + cosine).
    #[default]
    Step,
    /// One position per epoch (PyTorch's `StepLR` stepped per epoch).
    Epoch,
}

/// An evaluation's result, already agreed over all ranks (see [`crate::evaluate_sums`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Evaluation {
    /// Mean evaluation loss.
    pub loss: f64,
    /// `(correct, total)` for a classifier.
    pub correct: Option<(u64, u64)>,
    /// Further values for the metrics line.
    pub extra: Vec<(String, serde_json::Value)>,
}

/// A model trained by the [`crate::Trainer`].
///
/// A task is shared by the ranks (`Sync`); what a rank holds of its own (loaders, samplers, device
/// buffers) is its [`TrainTask::Data`], made once per rank. The Trainer builds the model with
/// [`TrainTask::build_model`] in its float precision and converts the linears the run chooses to FP8
/// itself; the task's backward needs no gradient averaging (the reduction divides by the ranks and
/// micro-batches).
pub trait TrainTask: Sync {
    /// The module tree.
    type Model: Module;
    /// A rank's data state.
    type Data;
    /// One micro-batch of one rank, ready for the forward.
    type Batch;
    /// The task's error ([`TrainError`] itself serves: it takes every library error and a task's own
    /// through [`TrainError::task`]).
    type Error: std::error::Error + Send + Sync + From<TrainError> + 'static;

    /// The program's name: it names the run in messages and is recorded in checkpoints.
    fn name(&self) -> &str;

    /// What [`TrainTask::batch_weight`] counts (`samples`, `tokens`).
    fn unit(&self) -> &'static str {
        "samples"
    }

    /// Settings a resume must share beyond the Trainer's own (model shape, batch size, data): each a
    /// checkpoint key, the flag that sets it and its value.
    fn identity(&self) -> Vec<RunSetting> {
        Vec::new()
    }

    /// Settings a resume may change beyond the Trainer's own (reported when they do).
    fn hyperparameters(&self) -> Vec<RunSetting> {
        Vec::new()
    }

    /// Builds this rank's module tree (the same on every rank but for rank-dependent state such as
    /// dropout streams), in the activations' float precision.
    fn build_model(&self, env: &RankEnv) -> Result<Self::Model, Self::Error>;

    /// How parameters are grouped into FSDP units (default: one unit per module that declares
    /// parameters of its own).
    fn wrap_policy(&self) -> WrapPolicy {
        WrapPolicy::PerModule
    }

    /// The optimizer of the wrapped model (default: AdamW with PyTorch's defaults at the run's learning
    /// rate and state precision).
    fn optimizer(
        &self,
        model: &mut FsdpModel<Self::Model>,
        choice: &OptimizerChoice,
    ) -> Result<Box<dyn Optimizer>, Self::Error> {
        let options = AdamOptions {
            lr: choice.lr,
            state_precision: choice.states,
            ..AdamOptions::adamw()
        };
        match FsdpAdamW::for_model(model, options) {
            Ok(opt) => Ok(Box::new(opt)),
            Err(e) => Err(TrainError::from(e).into()),
        }
    }

    /// The learning-rate schedule of a run (`None`: constant).
    fn schedule(&self, _plan: &SchedulePlan) -> Result<Option<Box<dyn LrSchedule>>, Self::Error> {
        Ok(None)
    }

    /// When the schedule moves.
    fn schedule_clock(&self) -> ScheduleClock {
        ScheduleClock::Step
    }

    /// What one rank will hold at its peak for this run (model state, activations, workspaces), by
    /// part, when the task can estimate it: the Trainer refuses a run that cannot fit before it
    /// allocates, naming the parts and the flags that size them. [`MemoryPlan::model_state`] prices the
    /// parameters for the run's precision, optimizer states, gradient shards and ranks.
    fn memory_estimate(&self, _plan: &MemoryPlan) -> Result<Option<MemoryEstimate>, Self::Error> {
        Ok(None)
    }

    /// This rank's data.
    fn data(&self, env: &RankEnv) -> Result<Self::Data, Self::Error>;

    /// The data's own state a checkpoint keeps (e.g. a sampler's position), as key/values (keys
    /// starting with `data.`); the default keeps nothing (batches are a function of their index).
    fn data_state(&self, _data: &Self::Data) -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    /// Restores what [`TrainTask::data_state`] saved.
    fn load_data_state(
        &self,
        _data: &mut Self::Data,
        _saved: &BTreeMap<String, String>,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Micro-batches of this rank in `epoch` (default `None`: endless data, for runs counted in steps).
    fn epoch_batches(
        &self,
        _data: &mut Self::Data,
        _env: &RankEnv,
        _epoch: u32,
    ) -> Result<Option<u64>, Self::Error> {
        Ok(None)
    }

    /// The micro-batch `at` of this rank. The Trainer asks for them in order, from where a resumed
    /// checkpoint left off.
    fn batch(
        &self,
        data: &mut Self::Data,
        env: &RankEnv,
        at: BatchIndex,
    ) -> Result<Self::Batch, Self::Error>;

    /// Whether the task averages over ranks and micro-batches itself, scaling its loss gradient by
    /// `1 / (world_size * step_micro_batches)` (then the reduction only sums). The default, `false`,
    /// leaves the averaging to the reduction, which divides the summed gradients: a model's backward
    /// then has no factor of its own. (The MNIST example scales its loss, which keeps its recorded
    /// numerics bit for bit: with delayed FP8 scaling the first steps' E5M2 gradient casts round
    /// differently when the values are halved.)
    fn averages_in_loss(&self) -> bool {
        false
    }

    /// The samples (or tokens) the micro-batch counts; equal on every rank.
    fn batch_weight(&self, batch: &Self::Batch) -> u64;

    /// The training forward up to the loss.
    fn forward(
        &self,
        model: &mut FsdpModel<Self::Model>,
        batch: &Self::Batch,
    ) -> Result<(), Self::Error>;

    /// The loss of the last forward.
    fn loss<'m>(&self, model: &'m FsdpModel<Self::Model>) -> Result<LossValue<'m>, Self::Error>;

    /// The backward of the micro-batch's loss (its mean over the micro-batch: the Trainer's reduction
    /// averages over ranks and micro-batches).
    fn backward(
        &self,
        model: &mut FsdpModel<Self::Model>,
        batch: &Self::Batch,
    ) -> Result<(), Self::Error>;

    /// Evaluates the model (collective: every rank calls it; see [`crate::evaluate_sums`]). The default
    /// has no evaluation set: its loss is NaN.
    fn evaluate(
        &self,
        _model: &mut FsdpModel<Self::Model>,
        _data: &mut Self::Data,
        _env: &RankEnv,
    ) -> Result<Evaluation, Self::Error> {
        Ok(Evaluation {
            loss: f64::NAN,
            ..Evaluation::default()
        })
    }

    /// The lines printed at an evaluation point (rank 0); the default names the step, the losses,
    /// the learning rate and the rate.
    fn report_lines(&self, record: &MetricsRecord) -> Vec<String> {
        let mut line = format!(
            "step {}: train loss {:.4}, eval loss {:.4}",
            record.step.unwrap_or(0),
            record.train_loss,
            record.test_loss
        );
        if record.test_total > 0 {
            line.push_str(&format!(", accuracy {:.2} %", record.test_accuracy));
        }
        if let Some(lr) = record.lr {
            line.push_str(&format!(", lr {lr:.3e}"));
        }
        line.push_str(&format!(
            ", {:.0} {}/s",
            record.samples_per_sec,
            self.unit()
        ));
        vec![line]
    }

    /// Work after the last step on every rank (e.g. sampling text); returns lines printed on rank 0.
    fn after_training(
        &self,
        _model: &mut FsdpModel<Self::Model>,
        _data: &mut Self::Data,
        _env: &RankEnv,
    ) -> Result<Vec<String>, Self::Error> {
        Ok(Vec::new())
    }

    /// The batch `--speed` times (default: the first training batch).
    fn speed_batch(
        &self,
        data: &mut Self::Data,
        env: &RankEnv,
    ) -> Result<Self::Batch, Self::Error> {
        self.batch(
            data,
            env,
            BatchIndex {
                epoch: 1,
                index: 0,
                step_micro_batches: 1,
            },
        )
    }

    /// Model FLOPs of a training step per [`TrainTask::unit`] (for the speed line's model TFLOP/s).
    fn flops_per_unit(&self) -> Option<f64> {
        None
    }

    /// Bytes the model holds for the backward after a training forward (the activations its layers
    /// keep), when it can count them: the speed line reports them beside the peak and the model state.
    fn held_bytes(&self, _model: &FsdpModel<Self::Model>) -> Option<u64> {
        None
    }

    /// Facts about the run for the summary and the speed line (`preset`, model shape, ...).
    fn describe(&self) -> Vec<(String, serde_json::Value)> {
        Vec::new()
    }

    /// The format `--export` writes and `--init-from` reads (default: one safetensors file under the
    /// model's parameter names, [`crate::weights::SafetensorsFormat`]).
    fn weights_format(&self) -> Box<dyn crate::weights::WeightsFormat + '_> {
        Box::new(crate::weights::SafetensorsFormat)
    }
}

/// What the memory of a run depends on that the Trainer decides, for [`TrainTask::memory_estimate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Ranks the parameters are sharded over.
    pub world_size: usize,
    /// Whether the ranks are CUDA GPUs (activations in BF16) or CPU threads of one host.
    pub cuda: bool,
    /// Whether linears may run in FP8 (`--precision fp8` with a filter that selects some).
    pub fp8_linears: bool,
    /// Storage of the FP8 weights' optimizer states.
    pub optimizer_states: StatePrecision,
    /// Storage of the gradient shards.
    pub grad_shards: GradDtype,
    /// The optimizer steps inside the backward (`--optimizer-in-backward`): gradient shards are
    /// transient, one unit's at a time ([`MemoryPlan::transient_grad_shards`]), not model state.
    pub optimizer_in_backward: bool,
}

impl MemoryPlan {
    /// One rank's share of the model state: the sharded weights, gradients and optimizer states of
    /// `linear_weights` linear weight elements (FP8 when the run has FP8 linears: 1-byte weights,
    /// 5 or 12 bytes of master and moments) and `other` parameters (F32 weights and moments), as the
    /// optimizer's memory report counts them; `None` on overflow. With the optimizer in the backward
    /// the gradient shards are not in it: add [`MemoryPlan::transient_grad_shards`].
    pub fn model_state(&self, linear_weights: u64, other: u64) -> Option<u64> {
        let grad = if self.optimizer_in_backward {
            0
        } else {
            self.grad_shards.size_bytes() as u64
        };
        let (fp8, plain) = if self.fp8_linears {
            (linear_weights, other)
        } else {
            (0, linear_weights.checked_add(other)?)
        };
        let states = match self.optimizer_states {
            StatePrecision::LowPrecision => 5,
            StatePrecision::F32 => 12,
        };
        let total = fp8
            .checked_mul(1 + grad + states)?
            .checked_add(plain.checked_mul(4 + grad + 8)?)?;
        Some(total.div_ceil(self.world_size.max(1) as u64))
    }
}

impl MemoryPlan {
    /// With the optimizer in the backward, one rank's gradient shard of the largest unit
    /// (`largest_unit` parameters), the one that lives during its step; 0 otherwise (the shards are in
    /// [`MemoryPlan::model_state`]). `None` on overflow.
    pub fn transient_grad_shards(&self, largest_unit: u64) -> Option<u64> {
        if !self.optimizer_in_backward {
            return Some(0);
        }
        let bytes = largest_unit.checked_mul(self.grad_shards.size_bytes() as u64)?;
        Some(bytes.div_ceil(self.world_size.max(1) as u64))
    }
}

/// One part of a rank's peak memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPart {
    /// What it is and what sizes it, for the message (`"activations (--batch-size 8 x --seq-len
    /// 1024 x 12 blocks)"`).
    pub what: String,
    /// Bytes.
    pub bytes: u64,
}

/// A setting of the task that lowers its estimate, which a refusal names with the count that would make
/// the run fit (`--recompute-mlp-up 15`) instead of only advising a smaller run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryRemedy {
    /// The setting, with `{n}` where its count goes (`"--recompute-mlp-up {n}"`); a switch has none.
    pub setting: String,
    /// Bytes one more unit of the count saves (a switch: what it saves).
    pub saves_per_unit: u64,
    /// The count the run has now (0 for a switch that is off); the advice names this plus the units
    /// needed.
    pub current: u64,
    /// The largest count the setting takes (1 for a switch).
    pub max: u64,
}

impl MemoryRemedy {
    /// A count: `setting` with `{n}`, `saves_per_unit` bytes per unit, from `current` up to `max`.
    pub fn count(setting: impl Into<String>, saves_per_unit: u64, current: u64, max: u64) -> Self {
        MemoryRemedy {
            setting: setting.into(),
            saves_per_unit,
            current,
            max,
        }
    }

    /// A switch that is off and would save `saves` bytes.
    pub fn switch(setting: impl Into<String>, saves: u64) -> Self {
        MemoryRemedy::count(setting, saves, 0, 1)
    }

    /// The setting that saves at least `gap` bytes and what it saves, if one does: the smallest count
    /// above `current`.
    pub fn advice(&self, gap: u64) -> Option<(String, u64)> {
        if self.saves_per_unit == 0 || self.current >= self.max {
            return None;
        }
        let units = gap.div_ceil(self.saves_per_unit).max(1);
        let n = self.current.checked_add(units).filter(|&n| n <= self.max)?;
        let setting = self.setting.replace("{n}", &n.to_string());
        Some((setting, units.saturating_mul(self.saves_per_unit)))
    }
}

/// One rank's estimated peak memory, by part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The parts.
    pub parts: Vec<MemoryPart>,
    /// Settings that would lower it, for the refusal's advice.
    pub remedies: Vec<MemoryRemedy>,
}

impl MemoryEstimate {
    /// Adds a part.
    pub fn part(mut self, what: impl Into<String>, bytes: u64) -> Self {
        self.parts.push(MemoryPart {
            what: what.into(),
            bytes,
        });
        self
    }

    /// Adds a setting that would lower the estimate.
    pub fn remedy(mut self, remedy: MemoryRemedy) -> Self {
        self.remedies.push(remedy);
        self
    }

    /// The sum of the parts (saturating: an estimate beyond 2^64 bytes fits nowhere).
    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .fold(0u64, |a, p| a.saturating_add(p.bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(fp8: bool, states: StatePrecision, grads: GradDtype, ranks: usize) -> MemoryPlan {
        MemoryPlan {
            world_size: ranks,
            cuda: false,
            fp8_linears: fp8,
            optimizer_states: states,
            grad_shards: grads,
            optimizer_in_backward: false,
        }
    }

    #[test]
    fn model_state_prices_each_kind_of_parameter() {
        use GradDtype::{Bf16, F32};
        use StatePrecision::{LowPrecision as Low, F32 as S32};
        // FP8 weight 1 + F32 grad 4 + F16 master, E4M3 m, F16 v 5; plain F32 weight, grad, m, v 16.
        assert_eq!(
            plan(true, Low, F32, 1).model_state(1000, 10),
            Some(10_000 + 160)
        );
        assert_eq!(
            plan(true, S32, F32, 1).model_state(1000, 10),
            Some(17_000 + 160)
        );
        assert_eq!(
            plan(true, Low, Bf16, 1).model_state(1000, 10),
            Some(8_000 + 140)
        );
        // Without FP8 linears every parameter is plain.
        assert_eq!(plan(false, Low, F32, 1).model_state(1000, 10), Some(16_160));
        // Sharded over ranks, rounded up.
        assert_eq!(plan(true, Low, F32, 3).model_state(1000, 10), Some(3_387));
        assert_eq!(plan(true, Low, F32, 1).model_state(u64::MAX / 2, 0), None);
        // With the optimizer in the backward the gradient shards leave the model state; the largest
        // unit's comes back as a transient.
        let mut p = plan(true, Low, Bf16, 2);
        assert_eq!(p.transient_grad_shards(1000), Some(0));
        p.optimizer_in_backward = true;
        assert_eq!(p.model_state(1000, 10), Some((6_000 + 120) / 2));
        assert_eq!(p.transient_grad_shards(1001), Some(1_001));
        assert_eq!(p.transient_grad_shards(u64::MAX), None);
    }

    #[test]
    fn an_estimate_sums_its_parts_saturating() {
        let e = MemoryEstimate::default().part("a", 5).part("b", 7);
        assert_eq!(e.total(), 12);
        assert_eq!(e.part("c", u64::MAX).total(), u64::MAX);
    }
}
