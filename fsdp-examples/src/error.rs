//! [`ModelError`]: what can stop the models of this crate (their layers, data and configuration); the
//! Trainer wraps it as its task error.

use crate::data::DataError;
use crate::sampler::SamplerError;

/// Everything that can fail in a model's own code: one type for the MNIST net, the GPT family and the
/// MLP benchmark, which fail in the same places.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A layer failed.
    #[error(transparent)]
    Nn(#[from] fsdp_nn::NnError),
    /// Sharding, gathering, reduction or a checkpoint failed.
    #[error(transparent)]
    Shard(#[from] fsdp_shard::ShardError),
    /// A collective failed (timeout, another rank failed).
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] fp8_kernels::KernelError),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] fsdp_optim::OptimError),
    /// An fp8-core error (scaling metas).
    #[error(transparent)]
    Core(#[from] fp8_core::Fp8Error),
    /// The data could not be read.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The sampler refused its arguments.
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// A configuration that cannot run.
    #[error("{0}")]
    Config(String),
}
