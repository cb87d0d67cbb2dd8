//! Element-wise activations: [`Relu`], [`Gelu`].

use crate::layer::{module_without_state, take_saved, Activation, InputGrad, Layer};
use crate::{NnError, Tensor};
use fp8_kernels::elementwise::{self, GeluApprox};
use fp8_kernels::{Buffer, KernelError};
use fsdp_shard::Ctx;

/// `y = kernel(x)` element-wise; keeps `x` in `saved` for the backward when training.
fn pointwise_forward<T: Activation>(
    ctx: &Ctx<'_>,
    x: Tensor<T>,
    saved: &mut Option<Tensor<T>>,
    kernel: impl FnOnce(&Buffer<T>, &mut Buffer<T>) -> Result<(), KernelError>,
) -> Result<Tensor<T>, NnError> {
    let mut y = Tensor::uninit(ctx.device(), x.shape())?;
    kernel(x.data(), y.data_mut())?;
    *saved = ctx.is_training().then_some(x);
    Ok(y)
}

/// `dx = kernel(x, dy)` from the input `x` kept by [`pointwise_forward`] (taken out of `saved` either way,
/// so `layer` names a backward without a training forward), when `need_dx`.
fn pointwise_backward<T: Activation>(
    ctx: &Ctx<'_>,
    dy: Tensor<T>,
    need_dx: bool,
    (saved, layer): (&mut Option<Tensor<T>>, &str),
    kernel: impl FnOnce(&Buffer<T>, &Buffer<T>, &mut Buffer<T>) -> Result<(), KernelError>,
) -> InputGrad<T> {
    let x = take_saved(saved, layer)?;
    if !need_dx {
        return Ok(None);
    }
    let mut dx = Tensor::uninit(ctx.device(), dy.shape())?;
    kernel(x.data(), dy.data(), dx.data_mut())?;
    Ok(Some(dx))
}

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
        pointwise_forward(ctx, x, &mut self.x, elementwise::relu_forward)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        pointwise_backward(
            ctx,
            dy,
            need_dx,
            (&mut self.x, "Relu"),
            elementwise::relu_backward,
        )
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

impl<T: Activation> Gelu<T> {
    /// The input the last training forward kept for the backward, if any.
    pub fn saved_input(&self) -> Option<&Tensor<T>> {
        self.x.as_ref()
    }

    /// Its form (exact or tanh).
    pub fn approx(&self) -> GeluApprox {
        self.approx
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
        let approx = self.approx;
        pointwise_forward(ctx, x, &mut self.x, |x, y| {
            elementwise::gelu_forward(x, y, approx)
        })
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let approx = self.approx;
        pointwise_backward(ctx, dy, need_dx, (&mut self.x, "Gelu"), |x, dy, dx| {
            elementwise::gelu_backward(x, dy, dx, approx)
        })
    }

    fn forget_saved(&mut self) {
        self.x = None;
    }
}
