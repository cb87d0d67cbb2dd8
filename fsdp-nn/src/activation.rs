//! Element-wise activations: [`Relu`], [`Gelu`].

use crate::layer::{Activation, Layer};
use crate::{NnError, Tensor};
use fp8_kernels::elementwise::{self, GeluApprox};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};

/// `y = max(x, 0)`; keeps its input for the backward (`dx = dy` where `x > 0`).
#[derive(Debug, Default)]
pub struct Relu<T: Activation = f32> {
    x: Option<Tensor<T>>,
}

impl<T: Activation> Relu<T> {
    /// A ReLU.
    pub fn new() -> Self {
        Relu { x: None }
    }
}

impl<T: Activation> Module for Relu<T> {
    fn visit(&mut self, _v: &mut dyn Visitor) -> Result<(), ShardError> {
        Ok(())
    }
}

impl<T: Activation> Layer<T> for Relu<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let mut y = Tensor::uninit(ctx.device(), x.shape())?;
        elementwise::relu_forward(x.data(), y.data_mut())?;
        self.x = ctx.is_training().then_some(x);
        Ok(y)
    }

    fn backward_step(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: Tensor<T>,
        need_dx: bool,
    ) -> Result<Option<Tensor<T>>, NnError> {
        let x = self
            .x
            .take()
            .ok_or_else(|| NnError::usage("Relu", "backward without a training forward"))?;
        if !need_dx {
            return Ok(None);
        }
        let mut dx = Tensor::uninit(ctx.device(), dy.shape())?;
        elementwise::relu_backward(x.data(), dy.data(), dx.data_mut())?;
        Ok(Some(dx))
    }

    fn forget_saved(&mut self) {
        self.x = None;
    }
}

/// GELU (`nn.GELU()`: the exact erf form by default, or the tanh approximation); keeps its input.
#[derive(Debug)]
pub struct Gelu<T: Activation = f32> {
    approx: GeluApprox,
    x: Option<Tensor<T>>,
}

impl<T: Activation> Gelu<T> {
    /// The exact (erf) GELU.
    pub fn new() -> Self {
        Self::with_approx(GeluApprox::Erf)
    }

    /// A GELU of the given form.
    pub fn with_approx(approx: GeluApprox) -> Self {
        Gelu { approx, x: None }
    }
}

impl<T: Activation> Default for Gelu<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Activation> Module for Gelu<T> {
    fn visit(&mut self, _v: &mut dyn Visitor) -> Result<(), ShardError> {
        Ok(())
    }
}

impl<T: Activation> Layer<T> for Gelu<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let mut y = Tensor::uninit(ctx.device(), x.shape())?;
        elementwise::gelu_forward(x.data(), y.data_mut(), self.approx)?;
        self.x = ctx.is_training().then_some(x);
        Ok(y)
    }

    fn backward_step(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: Tensor<T>,
        need_dx: bool,
    ) -> Result<Option<Tensor<T>>, NnError> {
        let x = self
            .x
            .take()
            .ok_or_else(|| NnError::usage("Gelu", "backward without a training forward"))?;
        if !need_dx {
            return Ok(None);
        }
        let mut dx = Tensor::uninit(ctx.device(), dy.shape())?;
        elementwise::gelu_backward(x.data(), dy.data(), dx.data_mut(), self.approx)?;
        Ok(Some(dx))
    }

    fn forget_saved(&mut self) {
        self.x = None;
    }
}
