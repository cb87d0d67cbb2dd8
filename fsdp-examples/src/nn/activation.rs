//! ReLU.

use super::{held, reuse_buffer, NnError};
use fp8_kernels::{ops, Buffer};

/// `y = max(x, 0)`. Backward passes the gradient where the output is positive.
#[derive(Debug, Default)]
pub struct Relu {
    y: Option<Buffer<f32>>,
    dx: Option<Buffer<f32>>,
}

impl Relu {
    /// A ReLU with no buffers yet.
    pub fn new() -> Self {
        Relu::default()
    }

    /// `y = max(x, 0)`; keeps `y` for the backward pass.
    pub fn forward(&mut self, x: &Buffer<f32>) -> Result<&Buffer<f32>, NnError> {
        reuse_buffer(&mut self.y, &x.device(), x.len())?;
        let y = super::held_mut(&mut self.y, "Relu", "output")?;
        ops::relu_forward(x, y)?;
        Ok(y)
    }

    /// `dx = dy` where the forward output was positive, else 0.
    pub fn backward(&mut self, dy: &Buffer<f32>) -> Result<&Buffer<f32>, NnError> {
        let y = held(&self.y, "Relu", "forward output")?;
        reuse_buffer(&mut self.dx, &dy.device(), dy.len())?;
        let dx = super::held_mut(&mut self.dx, "Relu", "input gradient")?;
        ops::relu_backward(y, dy, dx)?;
        Ok(dx)
    }
}
