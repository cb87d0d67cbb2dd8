//! 2-D max pooling.

use crate::layer::{module_without_state, take_saved, InputGrad, Layer};
use crate::{NnError, Shape, Tensor};
use fp8_kernels::pool::{self, Pool2dGeometry};
use fp8_kernels::Buffer;
use fsdp_shard::Ctx;

/// Max pooling over `kernel x kernel` windows with the given stride (NCHW), no padding. The backward
/// routes each gradient to the argmax of its window (the first maximum in window order, as PyTorch).
#[derive(Debug)]
pub struct MaxPool2d {
    kernel: usize,
    stride: usize,
    geom: Option<Pool2dGeometry>,
    indices: Option<Buffer<u32>>,
}

impl MaxPool2d {
    /// A pooling layer.
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
            indices: None,
        })
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

    /// Output shape for an NCHW input shape.
    pub fn output_shape(&self, shape: [usize; 4]) -> Result<[usize; 4], NnError> {
        let g = self.geometry(shape)?;
        Ok([shape[0], shape[1], g.out_h(), g.out_w()])
    }
}

module_without_state!(MaxPool2d);

impl Layer for MaxPool2d {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor) -> Result<Tensor, NnError> {
        let s = x.shape().nchw("MaxPool2d")?;
        let g = self.geometry(s)?;
        let dev = ctx.device().clone();
        let mut y = Tensor::uninit(&dev, Shape::new(&[s[0], s[1], g.out_h(), g.out_w()])?)?;
        let mut idx = dev.uninit::<u32>(g.output_len())?;
        pool::max_pool2d_forward(x.data(), &g, y.data_mut(), &mut idx)?;
        self.geom = Some(g);
        self.indices = ctx.is_training().then_some(idx);
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor, need_dx: bool) -> InputGrad {
        let g = self
            .geom
            .ok_or_else(|| NnError::usage("MaxPool2d", "backward before forward"))?;
        let idx = take_saved(&mut self.indices, "MaxPool2d")?;
        if !need_dx {
            return Ok(None);
        }
        let mut dx = Tensor::uninit(
            ctx.device(),
            Shape::new(&[g.batch, g.channels, g.height, g.width])?,
        )?;
        pool::max_pool2d_backward(dy.data(), &idx, dx.data_mut())?;
        Ok(Some(dx))
    }
}
