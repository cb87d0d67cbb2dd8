//! The error type of `fsdp-nn`.

use fp8_kernels::KernelError;
use fsdp_shard::ShardError;

/// What can go wrong in a layer.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A kernel failed (shapes, devices, CUDA).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The sharded model refused (parameter not gathered, unknown id, wrong gradient size).
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A layer was used wrongly: wrong input shape, backward before forward, bad options.
    #[error("{layer}: {detail}")]
    Usage {
        /// The layer.
        layer: String,
        /// What was wrong.
        detail: String,
    },
}

impl NnError {
    /// A usage error of `layer`.
    pub fn usage(layer: &str, detail: impl Into<String>) -> Self {
        NnError::Usage {
            layer: layer.to_string(),
            detail: detail.into(),
        }
    }
}
