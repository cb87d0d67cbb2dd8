//! The reference MNIST example trained with FSDP: the network ([`MnistNet`], its layers and their order)
//! and the task ([`MnistTask`]: its data, loss and test) that `fsdp_train::Trainer` trains in the
//! `mnist_fsdp` binary.
//!
//! The net is the one of PyTorch's FSDP MNIST tutorial: Conv2d(1, 32, 3) - ReLU - Conv2d(32, 64, 3) -
//! ReLU - MaxPool(2) - Dropout(0.25) - Flatten - Linear(9216, 128) - ReLU - Dropout(0.5) -
//! Linear(128, 10) - log-softmax, written in F32; a run converts both linears to FP8 by default. FSDP units follow a minimum of
//! 20000 parameters per unit (`fc1` alone, the rest in the root unit). On the CPU, ranks are threads
//! ([`fsdp_comm::run_ranks`]); on CUDA, one process per GPU over NCCL.
//!
//! See `docs/mnist.md` for usage, hyperparameters and measured results.

mod batches;
mod net;
mod task;

pub use net::{wrap_policy, MnistNet, NetConfig, MIN_UNIT_PARAMS};
pub use task::{data_fingerprint, MnistBatch, MnistData, MnistOptions, MnistTask};

/// Everything that can stop a training run of the MNIST net.
pub type MnistError = crate::ModelError;
