//! Element-wise activations: [`Relu`], [`Gelu`].

use crate::layer::{module_without_state, take_saved, Activation, InputGrad, Layer};
use crate::{NnError, Tensor};
use fp8_kernels::elementwise::{self, GeluApprox};
use fsdp_shard::Ctx;

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

module_without_state!(Relu<T: Activation>);

impl<T: Activation> Layer<T> for Relu<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let mut y = Tensor::uninit(ctx.device(), x.shape())?;
        elementwise::relu_forward(x.data(), y.data_mut())?;
        self.x = ctx.is_training().then_some(x);
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let x = take_saved(&mut self.x, "Relu")?;
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

module_without_state!(Gelu<T: Activation>);

impl<T: Activation> Layer<T> for Gelu<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let mut y = Tensor::uninit(ctx.device(), x.shape())?;
        elementwise::gelu_forward(x.data(), y.data_mut(), self.approx)?;
        self.x = ctx.is_training().then_some(x);
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let x = take_saved(&mut self.x, "Gelu")?;
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
