//! The [`Optimizer`] interface every training loop uses, and [`step_model`], a step on a wrapped model.

use crate::adam::{PendingStepReport, ShardedAdam};
use crate::{AdamOptions, FsdpAdam, FsdpAdamW, LrSchedule, OptimError};
use fsdp_shard::{FsdpModel, MemoryReport, Module, ScalingRegistry, ShardedModel, ShardedState};

/// An optimizer over one rank's shards of a sharded model.
///
/// A step is collective (every rank calls it) and does everything a training step needs after the
/// backward passes: the update of every parameter from the reduced gradient shards, the new FP8 weight
/// shards and scales, the agreement of the model's FP8 activation and output-gradient scales (one
/// all-reduce for all of them), zeroed gradients. Its state is checkpointable ([`ShardedState`]).
pub trait Optimizer: ShardedState {
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
