//! The error type of `fsdp-shard`.

use std::path::PathBuf;

/// Everything that can go wrong while sharding, gathering, reducing or checkpointing.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The model's parameter declarations are inconsistent.
    #[error("invalid model: {0}")]
    InvalidModel(String),
    /// A value given to an operation does not fit (wrong size, unknown name, bad option).
    #[error("{0}")]
    InvalidArgument(String),
    /// An operation was called in the wrong state (e.g. views of a unit that is not gathered).
    #[error("{0}")]
    State(String),
    /// A checkpoint is missing, truncated, corrupt, foreign or does not match the model.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A file system error.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A collective failed (timeout, a failed rank, mismatched sizes).
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] fp8_kernels::KernelError),
    /// An fp8-core error (formats, scaling metas).
    #[error(transparent)]
    Core(#[from] fp8_core::Fp8Error),
}
