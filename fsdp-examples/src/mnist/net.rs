//! The reference MNIST network: its layers and their order.

use super::MnistError;
use crate::data::{MNIST_CLASSES, MNIST_COLS, MNIST_ROWS};
use fp8_kernels::Buffer;
use fsdp_nn::init::stream_seed;
use fsdp_nn::{
    Conv2d, Dropout, Flatten, Layer, Linear, LogSoftmaxNll, MaxPool2d, Relu, Sequential, Shape,
    Tensor,
};
use fsdp_shard::{Ctx, Module, ShardError, Visitor, WrapPolicy};

/// Parameters a module needs to get its own FSDP unit (PyTorch's `size_based_auto_wrap_policy` with
/// `min_num_params=20000`, as in the reference): `fc1` gets one, the rest share the root unit.
pub const MIN_UNIT_PARAMS: usize = 20_000;

/// The reference wrapping: [`MIN_UNIT_PARAMS`].
pub fn wrap_policy() -> WrapPolicy {
    WrapPolicy::MinParams(MIN_UNIT_PARAMS)
}

/// How the network is built (in F32: a run converts its linears to FP8 or BF16).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// Seed of the initial parameters and of the dropout generators.
    pub seed: u64,
    /// This rank (dropout masks differ per rank, as they do in PyTorch's data parallelism).
    pub rank: usize,
}

/// The reference net: Conv2d(1, 32, 3) - ReLU - Conv2d(32, 64, 3) - ReLU - MaxPool(2) - Dropout(0.25) -
/// Flatten - Linear(9216, 128) - ReLU - Dropout(0.5) - Linear(128, 10), then log-softmax + NLL.
/// Parameters are named as PyTorch names the reference's (`conv1.weight`, ..., `fc2.bias`).
#[derive(Debug)]
pub struct MnistNet {
    body: Sequential,
    loss: LogSoftmaxNll,
}

impl MnistNet {
    /// The layers, initialised from `config.seed` (each layer its own stream).
    pub fn new(config: NetConfig) -> Result<Self, MnistError> {
        let s = |i: u64| stream_seed(config.seed, i);
        let drop_seed =
            |layer: u64| stream_seed(config.seed, 1000 + layer * 64 + config.rank as u64);
        let body = Sequential::new()
            .push("conv1", Conv2d::new(1, 32, 3)?.with_seed(s(1)))
            .push("relu1", Relu::new())
            .push("conv2", Conv2d::new(32, 64, 3)?.with_seed(s(2)))
            .push("relu2", Relu::new())
            .push("pool", MaxPool2d::new(2, 2)?)
            .push("drop1", Dropout::new(0.25, drop_seed(1))?)
            .push("flatten", Flatten::new())
            .push("fc1", Linear::new(9216, 128)?.with_seed(s(3)))
            .push("relu3", Relu::new())
            .push("drop2", Dropout::new(0.5, drop_seed(2))?)
            .push("fc2", Linear::new(128, MNIST_CLASSES)?.with_seed(s(4)));
        Ok(MnistNet {
            body,
            loss: LogSoftmaxNll::new(MNIST_CLASSES)?,
        })
    }

    /// Forward of NCHW `images [B, 1, 28, 28]` with `labels [B]` up to the loss; its statistics
    /// (`fp8_kernels::softmax::nll_stat`) are then in [`MnistNet::loss_stats`].
    pub fn forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        images: Buffer<f32>,
        labels: &Buffer<i32>,
    ) -> Result<(), MnistError> {
        let b = labels.len();
        let x = Tensor::new(images, Shape::new(&[b, 1, MNIST_ROWS, MNIST_COLS])?)?;
        let logits = self.body.forward(ctx, x)?;
        self.loss.forward(ctx, logits, labels)?;
        Ok(())
    }

    /// Backward after a training forward; the loss gradient is scaled by `grad_scale` (the MNIST task
    /// passes `1 / (world_size * micro_batches)` for the mean over the global batch).
    pub fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        labels: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<(), MnistError> {
        let d = self.loss.backward(ctx, labels, grad_scale)?;
        self.body.backward_params(ctx, d)?;
        Ok(())
    }

    /// The loss statistics of the last forward.
    pub fn loss_stats(&self) -> Result<&Buffer<f32>, MnistError> {
        Ok(self.loss.stats()?)
    }
}

impl Module for MnistNet {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        // The layers are the model's top-level names (`conv1.weight`), as in the reference.
        self.body.visit(v)?;
        self.loss.visit(v)
    }
}
