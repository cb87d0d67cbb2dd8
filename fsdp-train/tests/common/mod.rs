//! The small classifier both Trainer test tasks train: its model, its data stream and the forward,
//! loss and backward a task hands the Trainer.
#![allow(dead_code)]

use fp8_kernels::Buffer;
use fsdp_nn::{Layer, Linear, LogSoftmaxNll, Relu, Sequential, Shape, Tensor};
use fsdp_shard::{FsdpModel, Mode, Module, ShardError, Visitor};
use fsdp_train::{LossKind, LossValue, TrainError};

pub struct Net {
    pub body: Sequential,
    pub loss: LogSoftmaxNll,
}

impl Module for Net {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        self.body.visit(v)
    }
}

pub const FEATURES: usize = 16;

/// A batch: inputs `[n, FEATURES]` and labels.
pub type Batch = (Buffer<f32>, Buffer<i32>);

/// `FEATURES -> 32 -> relu -> 4` with a log-softmax NLL loss.
pub fn build_net() -> Result<Net, TrainError> {
    let body = Sequential::new()
        .push("fc1", Linear::new(FEATURES, 32)?)
        .push("relu", Relu::new())
        .push("fc2", Linear::new(32, 4)?);
    Ok(Net {
        body,
        loss: LogSoftmaxNll::new(4)?,
    })
}

/// Points `first..first + n` of a fixed stream, labelled by which of the first four features is
/// largest: the global batch does not depend on the ranks.
pub fn points(first: usize, n: usize) -> (Vec<f32>, Vec<i32>) {
    let x: Vec<f32> = (first * FEATURES..(first + n) * FEATURES)
        .map(|i| ((i * 104_729 + 17) % 997) as f32 / 499.0 - 1.0)
        .collect();
    let y = x
        .chunks(FEATURES)
        .map(|r| (0..4).fold(0, |b, j| if r[j] > r[b] { j } else { b }) as i32)
        .collect();
    (x, y)
}

pub fn forward(m: &mut FsdpModel<Net>, (x, y): &Batch) -> Result<(), TrainError> {
    let x = Tensor::new(x.to_device(m.device())?, Shape::matrix(y.len(), FEATURES)?)?;
    Ok(m.forward(Mode::Train, |net, ctx| {
        let logits = net.body.forward(ctx, x)?;
        net.loss.forward(ctx, logits, y).map(drop)
    })?)
}

pub fn loss(m: &FsdpModel<Net>) -> Result<LossValue<'_>, TrainError> {
    Ok(LossValue {
        values: m.module().loss.stats()?,
        kind: LossKind::Mean,
    })
}

pub fn backward(m: &mut FsdpModel<Net>, (_, y): &Batch) -> Result<(), TrainError> {
    Ok(m.backward(|net, ctx| {
        let d = net.loss.backward(ctx, y, 1.0)?;
        net.body.backward_params(ctx, d)
    })?)
}
