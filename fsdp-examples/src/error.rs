//! [`ModelError`]: what can stop the models of this crate (their layers, data and configuration); the
//! Trainer wraps it as its task error.

use crate::data::DataError;
use crate::sampler::SamplerError;
use fsdp_train::TrainError;

/// Everything that can fail in a model's own code: one type for the MNIST net, the GPT family and the
/// MLP benchmark, which fail in the same places.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The FSDP stack under the model failed: a layer, sharding or a checkpoint, a collective, a kernel
    /// or the optimizer (the Trainer's error, which already names each of them).
    #[error(transparent)]
    Stack(#[from] TrainError),
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

/// `?` on the errors of the crates under the model goes through [`TrainError`]'s own conversions.
macro_rules! via_train_error {
    ($($source:ty),* $(,)?) => {
        $(impl From<$source> for ModelError {
            fn from(e: $source) -> Self {
                ModelError::Stack(TrainError::from(e))
            }
        })*
    };
}

via_train_error!(
    fsdp_nn::NnError,
    fsdp_shard::ShardError,
    fsdp_comm::CommError,
    fp8_kernels::KernelError,
    fsdp_optim::OptimError,
);
