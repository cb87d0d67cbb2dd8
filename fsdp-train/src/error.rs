//! [`TrainError`]: everything that can stop a run, one type for every program on the Trainer.

use crate::metrics::MetricsError;
use crate::setup::SetupError;

/// Why a run stopped with an error. Messages name the flag or file at fault where there is one.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting that cannot run (the message names the flag).
    #[error("{0}")]
    Config(String),
    /// A checkpoint that does not fit this run (the message names the flag and both values).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The model's own code (its data, layers or evaluation) failed.
    #[error(transparent)]
    Task(Box<dyn std::error::Error + Send + Sync>),
    /// A layer failed.
    #[error(transparent)]
    Nn(#[from] fsdp_nn::NnError),
    /// Sharding, gathering, reduction or a checkpoint failed.
    #[error(transparent)]
    Shard(#[from] fsdp_shard::ShardError),
    /// A collective failed (a timeout, another rank failed).
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] fp8_kernels::KernelError),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] fsdp_optim::OptimError),
    /// The metrics file could not be written or read.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// An output path or the launcher setup refused before training.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The loss stayed non-finite: every one of the last steps was skipped.
    #[error(
        "{steps} consecutive steps had non-finite gradients and were skipped (the limit is \
         --max-skipped-steps {limit}); the run stopped at step {at}: lower --lr, check the data, or \
         resume from an earlier checkpoint"
    )]
    Diverged {
        /// Consecutive skipped steps seen.
        steps: u64,
        /// The limit.
        limit: u64,
        /// The step the run stopped at.
        at: u64,
    },
}

impl TrainError {
    /// Wraps a task's error.
    pub fn task(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        TrainError::Task(Box::new(e))
    }
}
