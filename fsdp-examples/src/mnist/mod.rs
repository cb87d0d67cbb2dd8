//! The reference MNIST example trained with FSDP: the network ([`MnistNet`], its layers and their order)
//! and the training loop ([`train`]) that the `mnist_fsdp` binary runs.
//!
//! The net is the one of PyTorch's FSDP MNIST tutorial: Conv2d(1, 32, 3) - ReLU - Conv2d(32, 64, 3) -
//! ReLU - MaxPool(2) - Dropout(0.25) - Flatten - Linear(9216, 128) - ReLU - Dropout(0.5) -
//! Linear(128, 10) - log-softmax, with both linears in FP8 by default. FSDP units follow a minimum of
//! 20000 parameters per unit (`fc1` alone, the rest in the root unit). On the CPU, ranks are threads
//! ([`fsdp_comm::run_ranks`]); on CUDA, one process per GPU over NCCL.
//!
//! See `docs/mnist.md` for usage, hyperparameters and measured results.

mod batches;
mod net;
mod train;

pub use net::{wrap_policy, MnistNet, NetConfig, MIN_UNIT_PARAMS};
pub use train::{
    data_fingerprint, train, DeviceChoice, Phase, PhaseTiming, StepProfile, TrainConfig,
    TrainReport, PROFILE_WARMUP_STEPS,
};

use crate::data::DataError;
use crate::metrics::MetricsError;
use crate::sampler::SamplerError;
use fsdp_nn::NnError;

/// Everything that can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum MnistError {
    /// A layer failed.
    #[error(transparent)]
    Nn(#[from] NnError),
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
    /// The metrics file could not be written.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The sampler refused its arguments.
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// Saving a checkpoint failed.
    #[error(transparent)]
    Training(#[from] crate::training::TrainingError),
    /// A checkpoint does not fit this run.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A configuration that cannot run.
    #[error("{0}")]
    Config(String),
    /// An output path or the launcher setup refused before training.
    #[error(transparent)]
    Setup(#[from] crate::run_setup::SetupError),
}
