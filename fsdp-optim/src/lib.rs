//! Adam and AdamW over FSDP shards, with FP8/FP16 optimizer states and one scale synchronisation per
//! step.
//!
//! [`FsdpAdam`] (L2 penalty) and [`FsdpAdamW`] (decoupled weight decay) update this rank's shards of a
//! [`fsdp_shard::ShardedModel`] with the fused kernels of `fp8_kernels::adam`, PyTorch's formulas and
//! defaults. FP8 weights keep their master copy here, once: in F32 ([`StatePrecision::F32`]) or, by
//! default, as MS-AMP does: F16 master, FP8 E4M3 first moment and F16 second moment, each with a scale
//! per parameter ([`StatePrecision::LowPrecision`]). Plain parameters keep F32 moments.
//!
//! A step ([`ShardedAdam::step`]) is collective and does, on every rank alike:
//! 1. one all-reduce SUM of `[non-finite gradient count, sum of squared gradients, per-rank gradient
//!    amaxes]`: the global norm, the skip decision (a non-finite gradient anywhere skips the step
//!    everywhere, leaving weights and states untouched) and the bounds of the new states' scales;
//! 2. clipping by the global norm, folded into the kernel's gradient factor;
//! 3. the fused update per FP8 weight segment of the shard, writing the amaxes of the new values;
//! 4. one all-reduce MAX of all those amaxes, new weight scales
//!    ([`fsdp_shard::ShardedModel::set_fp8_weight_scales`]), each FP8 weight segment cast in place from
//!    its master (`fp8_kernels::adam::control::cast_weight_source`: no F32 copy of the shards) and
//!    agreed state metas.
//!
//! Gradient shards may be F32 or BF16 (`fsdp_shard::GradDtype`): BF16 values are widened exactly.
//! Gradients are used as the model holds them: averaging over ranks and micro-batches is the caller's
//! (make the loss a mean over the global batch). See `docs/optimizers.md`.
//!
//! ```
//! use fsdp_comm::{run_ranks, Communicator, ThreadComm};
//! use fsdp_optim::{AdamOptions, FsdpAdamW, OptimError};
//! use fsdp_shard::{FsdpConfig, ModelLayout, ParamKind, ParamSpec, ShardedModel, WrapPolicy};
//! use std::sync::Arc;
//!
//! let layout = Arc::new(ModelLayout::new(
//!     vec![
//!         ParamSpec::new("fc", "weight", &[4, 8], ParamKind::Fp8Weight),
//!         ParamSpec::new("fc", "bias", &[4], ParamKind::Plain),
//!     ],
//!     &WrapPolicy::Single,
//! )?);
//! let reports = run_ranks(2, |comm: ThreadComm| {
//!     let comm: Arc<dyn Communicator> = Arc::new(comm);
//!     let init = |p: usize| if p == 0 { vec![0.25; 32] } else { vec![0.0; 4] };
//!     let (mut model, masters) =
//!         ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
//!     let mut opt = FsdpAdamW::new(&model, masters, AdamOptions::adamw())?;
//!     // A backward pass would produce these; each rank adds its part, then they are reduced.
//!     let dev = model.device().clone();
//!     model.add_grad("fc.weight", &dev.upload(&[0.5f32; 32])?)?;
//!     model.add_grad("fc.bias", &dev.upload(&[-1.0f32; 4])?)?;
//!     model.reduce_grads(0)?;
//!     Ok::<_, OptimError>(opt.step_with_report(&mut model)?)
//! })?;
//! // Both ranks agree: one step; the reduced gradients are the two ranks' sums (1.0 and -2.0), so the
//! // global norm is sqrt(32 * 1 + 4 * 4).
//! assert_eq!(reports[0], reports[1]);
//! assert_eq!(reports[0].step, 1);
//! assert!((reports[0].grad_norm - 48f64.sqrt()).abs() < 1e-5);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

mod adam;
mod config;
mod error;
mod export;
mod optimizer;
pub mod policy;
pub mod schedule;

pub use adam::{
    BytesPerParam, FsdpAdam, FsdpAdamW, PendingStepReport, ShardedAdam, StateMeta, StepReport,
};
pub use config::{AdamOptions, StatePrecision};
pub use error::OptimError;
pub use export::{export_full, export_with, write_safetensors, ExportDtype};
pub use optimizer::{finish_step_model, step_model, Optimizer, SharedOptimizer};
pub use schedule::{
    ConstantLr, CosineWithWarmup, LinearWarmupDecay, LrSchedule, StepLr, WarmupCosine,
};
