//! The error type of `fsdp-optim`.

/// Everything that can go wrong while building or stepping an optimizer.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A hyperparameter is outside its valid range (negative lr or eps, betas outside `[0, 1)`, ...).
    #[error("invalid hyperparameter: {0}")]
    InvalidHyperparameter(String),
    /// An option this optimizer does not implement (e.g. `amsgrad`).
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The optimizer and the model (or a checkpoint) do not fit together.
    #[error("{0}")]
    Mismatch(String),
    /// A sharded-model operation failed.
    #[error(transparent)]
    Shard(#[from] fsdp_shard::ShardError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] fp8_kernels::KernelError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
}

impl From<OptimError> for fsdp_shard::ShardError {
    fn from(e: OptimError) -> Self {
        match e {
            OptimError::Shard(s) => s,
            OptimError::Kernel(k) => fsdp_shard::ShardError::Kernel(k),
            OptimError::Comm(c) => fsdp_shard::ShardError::Comm(c),
            other => fsdp_shard::ShardError::Checkpoint(format!("optimizer state: {other}")),
        }
    }
}
