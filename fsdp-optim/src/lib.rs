//! Optimizers over FSDP shards.
//!
//! Planned: `FsdpAdam` and `FsdpAdamW` with F32 or low-precision states (F16 master, FP8 first moment, F16
//! second moment), one amax all-reduce per step, global-norm clipping and learning-rate schedules.
//!
//! ```
//! assert_eq!(fsdp_optim::CRATE_NAME, "fsdp-optim");
//! ```
#![warn(missing_docs)]

/// The crate name, until the optimizers land.
pub const CRATE_NAME: &str = "fsdp-optim";
