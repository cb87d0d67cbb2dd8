//! The reusable [`Trainer`] of fp8-fsdp: one training loop for every model.
//!
//! A model brings a [`TrainTask`] — its layers ([`TrainTask::build_model`], written in its float
//! precision), its data, its forward and backward up to the loss, and its evaluation — and the Trainer
//! does the rest, the same way for every model (torchtitan's one `Trainer` and burn's `Learner` are the
//! models):
//!
//! - ranks and devices: CPU thread ranks or one process per GPU over NCCL ([`setup::launch_ranks`]);
//! - the model-wide FP8 conversion ([`fsdp_nn::convert_to_fp8`] with the run's filter and recipe) and
//!   the sharding ([`fsdp_shard::FsdpModel`]) with the run's gradient reduction and shards;
//! - the micro-batch loop with gradient accumulation and sync control, gradients averaged by the
//!   reduction itself (no `1 / (ranks * micro-batches)` in a model), the optimizer step and the
//!   learning-rate schedule;
//! - evaluation every N steps or at each epoch's end, JSON-lines metrics, a progress bar;
//! - checkpoints (every N steps, each epoch's end, at the end, and on SIGINT / SIGTERM, agreed over the
//!   ranks), resume with the settings check naming the flag, no silent overwrite of a checkpoint,
//!   export of the master weights, non-finite steps watched, sizes checked before any allocation and
//!   room on disk for the outputs before the first step;
//! - the step profiler (`--profile`) and the speed mode (`--speed`, [`SpeedReport`]);
//! - the flags every program shares, declared once ([`TrainArgs`]), and the binary's `main`
//!   ([`run_main`]).
//!
//! A classifier on synthetic data, trained for 8 steps on two CPU thread ranks with no loop of its own:
//!
//! ```
//! use fp8_kernels::Buffer;
//! use fsdp_nn::{Layer, Linear, LogSoftmaxNll, Relu, Sequential, Shape, Tensor};
//! use fsdp_optim::{AdamOptions, FsdpAdam, Optimizer};
//! use fsdp_shard::{FsdpModel, Module, ShardError, Visitor, WrapPolicy};
//! use fsdp_train::*;
//!
//! struct Net { body: Sequential, loss: LogSoftmaxNll }
//! impl Module for Net {
//!     fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> { self.body.visit(v) }
//! }
//!
//! /// Points of 16 features labelled by which of their first 4 is largest.
//! struct Task;
//! impl TrainTask for Task {
//!     type Model = Net;
//!     type Data = ();
//!     type Batch = (Buffer<f32>, Buffer<i32>);
//!     type Error = TrainError;
//!     fn name(&self) -> &str { "doc" }
//!     fn build_model(&self, _: &RankEnv) -> Result<Net, Self::Error> {
//!         let body = Sequential::new().push("fc1", Linear::new(16, 32)?).push("relu", Relu::new())
//!             .push("fc2", Linear::new(32, 4)?);
//!         Ok(Net { body, loss: LogSoftmaxNll::new(4)? })
//!     }
//!     fn wrap_policy(&self) -> WrapPolicy { WrapPolicy::Single }
//!     fn optimizer(&self, m: &mut FsdpModel<Net>, c: &OptimizerChoice)
//!         -> Result<Box<dyn Optimizer>, Self::Error> {
//!         Ok(Box::new(FsdpAdam::for_model(m, AdamOptions { lr: c.lr, ..AdamOptions::adam() })?))
//!     }
//!     fn data(&self, _: &RankEnv) -> Result<(), Self::Error> { Ok(()) }
//!     fn epoch_batches(&self, _: &mut (), _: &RankEnv, _: u32) -> Result<Option<u64>, Self::Error> {
//!         Ok(None)
//!     }
//!     fn batch(&self, _: &mut (), env: &RankEnv, at: BatchIndex) -> Result<Self::Batch, Self::Error> {
//!         let x: Vec<f32> = (0..32 * 16)
//!             .map(|i| ((i as u64 + 977 * (at.index * 2 + env.rank as u64)) % 17) as f32 / 8.0 - 1.0)
//!             .collect();
//!         let y: Vec<i32> = x.chunks(16)
//!             .map(|r| (0..4).fold(0, |b, j| if r[j] > r[b] { j } else { b }) as i32).collect();
//!         Ok((env.device.upload(&x)?, env.device.upload(&y)?))
//!     }
//!     fn batch_weight(&self, b: &Self::Batch) -> u64 { b.1.len() as u64 }
//!     fn forward(&self, m: &mut FsdpModel<Net>, (x, y): &Self::Batch) -> Result<(), Self::Error> {
//!         let x = Tensor::new(x.to_device(m.device())?, Shape::matrix(y.len(), 16)?)?;
//!         m.forward(fsdp_shard::Mode::Train, |n, ctx| -> Result<(), fsdp_nn::NnError> {
//!             let logits = n.body.forward(ctx, x)?;
//!             n.loss.forward(ctx, logits, y).map(drop)
//!         })?;
//!         Ok(())
//!     }
//!     fn loss<'m>(&self, m: &'m FsdpModel<Net>) -> Result<LossValue<'m>, Self::Error> {
//!         Ok(LossValue { values: m.module().loss.stats()?, kind: LossKind::Mean })
//!     }
//!     fn backward(&self, m: &mut FsdpModel<Net>, (_, y): &Self::Batch) -> Result<(), Self::Error> {
//!         m.backward(|n, ctx| -> Result<(), fsdp_nn::NnError> {
//!             let d = n.loss.backward(ctx, y, 1.0)?;
//!             n.body.backward_params(ctx, d)
//!         })?;
//!         Ok(())
//!     }
//!     fn evaluate(&self, _: &mut FsdpModel<Net>, _: &mut (), _: &RankEnv)
//!         -> Result<Evaluation, Self::Error> {
//!         Ok(Evaluation::default())
//!     }
//! }
//!
//! let mut config = TrainConfig::new(RunLength::Steps(8));
//! config.world_size = 2;
//! config.device = DeviceChoice::Cpu;
//! config.lr = 1e-2;
//! let report = Trainer::new(config).run(&Task)?;
//! assert_eq!(report.steps, 8);
//! assert_eq!(report.fp8_linears(), ["fc1", "fc2"]); // converted model-wide
//! let losses = &report.step_losses[0];
//! assert!(losses[7] < losses[0], "{losses:?}");
//! # Ok::<(), TrainError>(())
//! ```
#![warn(missing_docs)]

mod args;
mod cli;
mod config;
mod error;
pub mod metrics;
pub mod profile;
pub mod progress;
pub mod settings;
pub mod setup;
pub mod signal;
mod space;
mod speed;
mod task;
mod trainer;
pub mod weights;

pub use args::{
    DeviceArg, ExportArg, Fp8GradCommArg, Fp8LayersArg, Fp8ScalingArg, GradShardsArg, PrecisionArg,
    RecipeArg, StatesArg, TaskDefaults, TrainArgs,
};
pub use cli::{run, run_main, PlotStyle};
pub use config::{
    Fp8GradComm, Precision, RunLength, TrainConfig, DEFAULT_MAX_SKIPPED_STEPS,
    THREADS_PER_CORE_LIMIT,
};
pub use error::TrainError;
pub use metrics::{MetricsRecord, PlotKind};
pub use settings::RunSetting;
pub use setup::DeviceChoice;
pub use speed::{model_state_json, peak_memory, reset_peak_memory, SpeedOptions, SpeedReport};
pub use task::{
    BatchIndex, Evaluation, LossKind, LossValue, MemoryEstimate, MemoryPart, MemoryPlan,
    MemoryRemedy, OptimizerChoice, RankEnv, ScheduleClock, SchedulePlan, TrainTask,
};
pub use trainer::{
    available_bytes, eval_forward, evaluate_sums, memory_verdict, StopReason, TrainReport, Trainer,
    PROFILE_WARMUP_STEPS,
};

// The guide `docs/your-model.md` is compiled and run as a doctest of this crate.
#[doc = include_str!("../../docs/your-model.md")]
#[cfg(doctest)]
pub struct YourModelGuide;
