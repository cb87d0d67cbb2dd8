//! Max pooling.

use super::{held, held_mut, reuse_buffer, NnError};
use fp8_kernels::ops::{self, Pool2dGeometry};
use fp8_kernels::Buffer;

/// Max pooling over square windows (no padding), NCHW. Keeps the argmax of every window for backward.
#[derive(Debug)]
pub struct MaxPool2d {
    kernel: usize,
    stride: usize,
    geom: Option<Pool2dGeometry>,
    y: Option<Buffer<f32>>,
    indices: Option<Buffer<u32>>,
    dx: Option<Buffer<f32>>,
}

impl MaxPool2d {
    /// Windows of `kernel x kernel` moved by `stride` (PyTorch's `max_pool2d(x, k)` has `stride = k`).
    pub fn new(kernel: usize, stride: usize) -> Result<Self, NnError> {
        if kernel == 0 || stride == 0 {
            return Err(NnError::usage(
                "MaxPool2d",
                format!("kernel {kernel} and stride {stride} must be positive"),
            ));
        }
        Ok(MaxPool2d {
            kernel,
            stride,
            geom: None,
            y: None,
            indices: None,
            dx: None,
        })
    }

    /// Output shape for an NCHW input shape.
    pub fn output_shape(&self, shape: [usize; 4]) -> Result<[usize; 4], NnError> {
        let g = self.geometry(shape)?;
        Ok([shape[0], shape[1], g.out_h(), g.out_w()])
    }

    fn geometry(&self, [n, c, h, w]: [usize; 4]) -> Result<Pool2dGeometry, NnError> {
        if self.kernel > h || self.kernel > w {
            return Err(NnError::usage(
                "MaxPool2d",
                format!("window {} larger than the {h}x{w} input", self.kernel),
            ));
        }
        Ok(Pool2dGeometry {
            batch: n,
            channels: c,
            height: h,
            width: w,
            kernel: self.kernel,
            stride: self.stride,
        })
    }

    /// Window maxima of `x` (NCHW with `shape`); returns the output and its shape.
    pub fn forward(
        &mut self,
        x: &Buffer<f32>,
        shape: [usize; 4],
    ) -> Result<(&Buffer<f32>, [usize; 4]), NnError> {
        let g = self.geometry(shape)?;
        let dev = x.device();
        reuse_buffer(&mut self.y, &dev, g.output_len())?;
        reuse_buffer(&mut self.indices, &dev, g.output_len())?;
        let y = held_mut(&mut self.y, "MaxPool2d", "output")?;
        let idx = self
            .indices
            .as_mut()
            .ok_or_else(|| NnError::usage("MaxPool2d", "indices"))?;
        ops::max_pool2d_forward(x, &g, y, idx)?;
        self.geom = Some(g);
        Ok((y, [shape[0], shape[1], g.out_h(), g.out_w()]))
    }

    /// Routes each output gradient to the input that was its window's maximum.
    pub fn backward(&mut self, dy: &Buffer<f32>) -> Result<&Buffer<f32>, NnError> {
        let g = self
            .geom
            .ok_or_else(|| NnError::usage("MaxPool2d", "backward before forward"))?;
        let idx = held(&self.indices, "MaxPool2d", "argmax indices")?;
        reuse_buffer(&mut self.dx, &dy.device(), g.input_len())?;
        let dx = held_mut(&mut self.dx, "MaxPool2d", "input gradient")?;
        ops::max_pool2d_backward(dy, idx, dx)?;
        Ok(dx)
    }
}
