//! The [`Optimizer`] interface every training loop uses, [`step_model`], a step on a wrapped model, and
//! the step inside the backward: [`SharedOptimizer`] (the optimizer shared by a training loop and the
//! model's hook on reduced gradients) and [`finish_step_model`].

use crate::adam::{unit_step_error, PendingStepReport, ShardedAdam};
use crate::{AdamOptions, FsdpAdam, FsdpAdamW, LrSchedule, OptimError};
use fp8_kernels::Buffer;
use fsdp_shard::{
    FsdpModel, MemoryReport, Module, ScalingRegistry, ShardError, ShardedModel, ShardedState,
    StateShard, UnitGradsReady,
};
use std::sync::{Arc, Mutex, MutexGuard};

/// An optimizer over one rank's shards of a sharded model.
///
/// A step is collective (every rank calls it) and does everything a training step needs after the
/// backward passes: the update of every parameter from the reduced gradient shards, the new FP8 weight
/// shards and scales, the agreement of the model's FP8 activation and output-gradient scales (one
/// all-reduce for all of them), zeroed gradients. Its state is checkpointable ([`ShardedState`]).
///
/// An optimizer may also step inside the backward, unit by unit as each unit's gradients are reduced
/// ([`Optimizer::step_unit`], then [`Optimizer::finish_step_in_backward`]; see [`SharedOptimizer`]):
/// the default methods refuse it.
pub trait Optimizer: ShardedState + Send {
    /// One step; `scaling` holds the model's activation metas (their pending amaxes are agreed and the
    /// scales updated). Queued on the device: the returned report is read on demand.
    fn step(
        &mut self,
        model: &mut ShardedModel,
        scaling: &mut ScalingRegistry,
    ) -> Result<PendingStepReport, OptimError>;
    /// The learning rate of the next step (from the schedule when one is set).
    fn current_lr(&self) -> f64;
    /// Sets the base learning rate.
    fn set_lr(&mut self, lr: f64) -> Result<(), OptimError>;
    /// Sets the learning-rate schedule (its position starts at 0, or where a checkpoint left it).
    fn set_schedule(&mut self, schedule: Box<dyn LrSchedule>);
    /// Moves the schedule one step (an epoch for StepLR, a step for warm-up + cosine).
    fn advance_schedule(&mut self);
    /// The schedule's position.
    fn schedule_position(&self) -> u64;
    /// Sets the schedule's position (e.g. the epoch a run resumes in).
    fn set_schedule_position(&mut self, position: u64);
    /// The model's memory with this optimizer's states.
    fn memory(&self, model: &ShardedModel) -> Result<MemoryReport, OptimError>;
    /// A short description for logs.
    fn describe(&self) -> String;
    /// This rank's F32 master shard of unit `u`'s FP8 weights (in the FP8 group's shard layout; a
    /// low-precision master is decoded with its scale): the weights an export writes.
    fn fp8_master_shard(&self, u: usize) -> Result<Vec<f32>, OptimError>;
    /// The optimizer as its checkpointable state.
    fn as_state(&self) -> &dyn ShardedState;
    /// The optimizer as its checkpointable state, mutable.
    fn as_state_mut(&mut self) -> &mut dyn ShardedState;
    /// Whether this optimizer can step inside the backward: an error saying what prevents it.
    fn check_step_in_backward(&self) -> Result<(), OptimError> {
        Err(OptimError::Unsupported(format!(
            "{} cannot step inside the backward",
            self.describe()
        )))
    }
    /// Begins a step inside the backward; `loss` (this rank's loss of the forward whose backward
    /// follows), when given and not finite on some rank, makes every unit skip.
    fn begin_step_in_backward(
        &mut self,
        _model: &ShardedModel,
        _loss: Option<&Buffer<f32>>,
    ) -> Result<(), OptimError> {
        self.check_step_in_backward()
    }
    /// Steps unit `u` from its reduced gradients (inside the backward), then clears them; begins a step
    /// when none is (collective).
    fn step_unit(&mut self, _model: &mut ShardedModel, _u: usize) -> Result<(), OptimError> {
        self.check_step_in_backward()
    }
    /// Finishes a step taken unit by unit in the backward: the units not stepped, the activation metas'
    /// agreement, the step counters (collective).
    fn finish_step_in_backward(
        &mut self,
        _model: &mut ShardedModel,
        _scaling: &mut ScalingRegistry,
    ) -> Result<PendingStepReport, OptimError> {
        Err(OptimError::Unsupported(format!(
            "{} cannot step inside the backward",
            self.describe()
        )))
    }
}

/// One optimizer step on a wrapped model (its shards and its scaling metas).
pub fn step_model<M: Module>(
    optimizer: &mut dyn Optimizer,
    model: &mut FsdpModel<M>,
) -> Result<PendingStepReport, OptimError> {
    model.release_all()?;
    let (sharded, scaling) = model.parts_mut();
    optimizer.step(sharded, scaling)
}

/// Finishes the step a wrapped model's backward took unit by unit ([`SharedOptimizer`]): every unit
/// released, then [`Optimizer::finish_step_in_backward`] with the model's scaling metas. Where
/// [`step_model`] follows the backward in a training step, this does.
pub fn finish_step_model<M: Module>(
    optimizer: &mut dyn Optimizer,
    model: &mut FsdpModel<M>,
) -> Result<PendingStepReport, OptimError> {
    model.release_all()?;
    let (sharded, scaling) = model.parts_mut();
    optimizer.finish_step_in_backward(sharded, scaling)
}

/// An optimizer shared by a training loop and a model's backward, for the step inside the backward
/// ("optimizer in backward"): register one clone as the model's hook on reduced gradients
/// ([`FsdpModel::set_grads_hook`]) and drive the other as the loop's [`Optimizer`]. Each backward then
/// steps every unit as soon as its gradients are reduce-scattered ([`Optimizer::step_unit`]), and
/// [`finish_step_model`] takes the place of [`step_model`]. With the model's transient gradient shards
/// (`ShardedModel::set_transient_grads`) no gradient shard outlives its unit's step.
///
/// The two handles take turns (a lock): the loop never calls the optimizer while the model's backward
/// runs. [`SharedOptimizer::install`] does the set-up.
#[derive(Clone)]
pub struct SharedOptimizer {
    inner: Arc<Mutex<Box<dyn Optimizer>>>,
}

impl std::fmt::Debug for SharedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedOptimizer")
            .field("optimizer", &self.lock().describe())
            .finish()
    }
}

impl SharedOptimizer {
    /// Shares `optimizer` (checked: it must be able to step in the backward).
    pub fn new(optimizer: Box<dyn Optimizer>) -> Result<Self, OptimError> {
        optimizer.check_step_in_backward()?;
        Ok(SharedOptimizer {
            inner: Arc::new(Mutex::new(optimizer)),
        })
    }

    /// Sets `model` up for the step in the backward with `optimizer`: transient gradient shards, a clone
    /// as the model's hook on reduced gradients; returns the handle the training loop drives. Call it
    /// between steps (the gradient shards' values are discarded).
    pub fn install<M: Module>(
        optimizer: Box<dyn Optimizer>,
        model: &mut FsdpModel<M>,
    ) -> Result<Self, OptimError> {
        let shared = Self::new(optimizer)?;
        model.sharded_mut().set_transient_grads(true)?;
        model.set_grads_hook(Some(Box::new(shared.clone())));
        Ok(shared)
    }

    fn lock(&self) -> MutexGuard<'_, Box<dyn Optimizer>> {
        // A panic while the lock was held leaves the optimizer as that call left it: no invariant of the
        // lock itself is broken, so the guard is taken back.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl UnitGradsReady for SharedOptimizer {
    fn unit_ready(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), ShardError> {
        self.lock()
            .step_unit(model, u)
            .map_err(|e| unit_step_error(u, e))
    }
}

impl ShardedState for SharedOptimizer {
    fn export_state(&self) -> Result<Vec<StateShard>, ShardError> {
        self.lock().as_state().export_state()
    }
    fn import_state(&mut self, shards: Vec<StateShard>) -> Result<(), ShardError> {
        self.lock().as_state_mut().import_state(shards)
    }
    fn state_bytes(&self) -> usize {
        self.lock().as_state().state_bytes()
    }
    fn scalar_state(&self) -> Vec<(String, String)> {
        self.lock().as_state().scalar_state()
    }
    fn load_scalar_state(&mut self, values: &[(String, String)]) -> Result<(), ShardError> {
        self.lock().as_state_mut().load_scalar_state(values)
    }
}

impl Optimizer for SharedOptimizer {
    fn step(
        &mut self,
        model: &mut ShardedModel,
        scaling: &mut ScalingRegistry,
    ) -> Result<PendingStepReport, OptimError> {
        self.lock().step(model, scaling)
    }
    fn current_lr(&self) -> f64 {
        self.lock().current_lr()
    }
    fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        self.lock().set_lr(lr)
    }
    fn set_schedule(&mut self, schedule: Box<dyn LrSchedule>) {
        self.lock().set_schedule(schedule)
    }
    fn advance_schedule(&mut self) {
        self.lock().advance_schedule()
    }
    fn schedule_position(&self) -> u64 {
        self.lock().schedule_position()
    }
    fn set_schedule_position(&mut self, position: u64) {
        self.lock().set_schedule_position(position)
    }
    fn memory(&self, model: &ShardedModel) -> Result<MemoryReport, OptimError> {
        self.lock().memory(model)
    }
    /// The shared optimizer's description, saying that it steps in the backward.
    fn describe(&self) -> String {
        format!(
            "{}, stepped per unit in the backward",
            self.lock().describe()
        )
    }
    fn fp8_master_shard(&self, u: usize) -> Result<Vec<f32>, OptimError> {
        self.lock().fp8_master_shard(u)
    }
    fn as_state(&self) -> &dyn ShardedState {
        self
    }
    fn as_state_mut(&mut self) -> &mut dyn ShardedState {
        self
    }
    fn check_step_in_backward(&self) -> Result<(), OptimError> {
        self.lock().check_step_in_backward()
    }
    fn begin_step_in_backward(
        &mut self,
        model: &ShardedModel,
        loss: Option<&Buffer<f32>>,
    ) -> Result<(), OptimError> {
        self.lock().begin_step_in_backward(model, loss)
    }
    fn step_unit(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), OptimError> {
        self.lock().step_unit(model, u)
    }
    fn finish_step_in_backward(
        &mut self,
        model: &mut ShardedModel,
        scaling: &mut ScalingRegistry,
    ) -> Result<PendingStepReport, OptimError> {
        self.lock().finish_step_in_backward(model, scaling)
    }
}

impl Optimizer for ShardedAdam {
    fn step(
        &mut self,
        model: &mut ShardedModel,
        scaling: &mut ScalingRegistry,
    ) -> Result<PendingStepReport, OptimError> {
        self.step_agreeing(model, Some(scaling))
    }
    fn current_lr(&self) -> f64 {
        ShardedAdam::current_lr(self)
    }
    fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        ShardedAdam::set_lr(self, lr)
    }
    fn set_schedule(&mut self, schedule: Box<dyn LrSchedule>) {
        ShardedAdam::set_schedule(self, schedule)
    }
    fn advance_schedule(&mut self) {
        ShardedAdam::advance_schedule(self)
    }
    fn schedule_position(&self) -> u64 {
        ShardedAdam::schedule_position(self)
    }
    fn set_schedule_position(&mut self, position: u64) {
        ShardedAdam::set_schedule_position(self, position)
    }
    fn memory(&self, model: &ShardedModel) -> Result<MemoryReport, OptimError> {
        ShardedAdam::memory(self, model)
    }
    fn describe(&self) -> String {
        ShardedAdam::describe(self)
    }
    fn fp8_master_shard(&self, u: usize) -> Result<Vec<f32>, OptimError> {
        ShardedAdam::fp8_master_shard(self, u)
    }
    fn as_state(&self) -> &dyn ShardedState {
        self
    }
    fn as_state_mut(&mut self) -> &mut dyn ShardedState {
        self
    }
    fn check_step_in_backward(&self) -> Result<(), OptimError> {
        ShardedAdam::check_step_in_backward(self)
    }
    fn begin_step_in_backward(
        &mut self,
        model: &ShardedModel,
        loss: Option<&Buffer<f32>>,
    ) -> Result<(), OptimError> {
        ShardedAdam::begin_step_in_backward(self, model, loss)
    }
    fn step_unit(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), OptimError> {
        ShardedAdam::step_unit(self, model, u)
    }
    fn finish_step_in_backward(
        &mut self,
        model: &mut ShardedModel,
        scaling: &mut ScalingRegistry,
    ) -> Result<PendingStepReport, OptimError> {
        ShardedAdam::finish_step_in_backward(self, model, Some(scaling))
    }
}

macro_rules! delegate_optimizer {
    ($name:ident) => {
        impl Optimizer for $name {
            fn step(
                &mut self,
                model: &mut ShardedModel,
                scaling: &mut ScalingRegistry,
            ) -> Result<PendingStepReport, OptimError> {
                Optimizer::step(&mut **self, model, scaling)
            }
            fn current_lr(&self) -> f64 {
                Optimizer::current_lr(&**self)
            }
            fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
                Optimizer::set_lr(&mut **self, lr)
            }
            fn set_schedule(&mut self, schedule: Box<dyn LrSchedule>) {
                Optimizer::set_schedule(&mut **self, schedule)
            }
            fn advance_schedule(&mut self) {
                Optimizer::advance_schedule(&mut **self)
            }
            fn schedule_position(&self) -> u64 {
                Optimizer::schedule_position(&**self)
            }
            fn set_schedule_position(&mut self, position: u64) {
                Optimizer::set_schedule_position(&mut **self, position)
            }
            fn memory(&self, model: &ShardedModel) -> Result<MemoryReport, OptimError> {
                Optimizer::memory(&**self, model)
            }
            fn describe(&self) -> String {
                Optimizer::describe(&**self)
            }
            fn fp8_master_shard(&self, u: usize) -> Result<Vec<f32>, OptimError> {
                Optimizer::fp8_master_shard(&**self, u)
            }
            fn as_state(&self) -> &dyn ShardedState {
                self
            }
            fn as_state_mut(&mut self) -> &mut dyn ShardedState {
                self
            }
            fn check_step_in_backward(&self) -> Result<(), OptimError> {
                Optimizer::check_step_in_backward(&**self)
            }
            fn begin_step_in_backward(
                &mut self,
                model: &ShardedModel,
                loss: Option<&Buffer<f32>>,
            ) -> Result<(), OptimError> {
                Optimizer::begin_step_in_backward(&mut **self, model, loss)
            }
            fn step_unit(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), OptimError> {
                Optimizer::step_unit(&mut **self, model, u)
            }
            fn finish_step_in_backward(
                &mut self,
                model: &mut ShardedModel,
                scaling: &mut ScalingRegistry,
            ) -> Result<PendingStepReport, OptimError> {
                Optimizer::finish_step_in_backward(&mut **self, model, scaling)
            }
        }

        impl $name {
            /// The optimizer of a wrapped model: takes the FP8 master shards the model made at
            /// construction (the optimizer owns them from now on), and the parameter groups (weight
            /// decay on the parameters declared to decay: matrices by default).
            pub fn for_model<M: Module>(
                model: &mut FsdpModel<M>,
                options: AdamOptions,
            ) -> Result<Self, OptimError> {
                let masters = model.take_initial_masters().ok_or_else(|| {
                    OptimError::Mismatch(
                        "the model's FP8 master shards were already taken by another optimizer"
                            .into(),
                    )
                })?;
                Self::new(model.sharded(), masters, options)
            }
        }
    };
}

delegate_optimizer!(FsdpAdam);
delegate_optimizer!(FsdpAdamW);
