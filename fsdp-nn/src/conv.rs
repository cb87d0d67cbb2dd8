//! 2-D convolution as im2col + GEMM.

use crate::init::{kaiming_uniform, uniform_fan_in};
use crate::layer::{take_saved, InputGrad, Layer};
use crate::plain_param::{plain_in, plain_param};
use crate::{NnError, Shape, Tensor};
use fp8_kernels::conv::{self, Conv2dGeometry};
use fp8_kernels::gemm::gemm_f32;
use fp8_kernels::{elementwise, reduce};
use fp8_kernels::{Buffer, GemmSpec, Transpose};
use fsdp_shard::{Ctx, Module, ParamDecl, ParamId, ParamKind, ShardError, Visitor};

/// A 2-D convolution (NCHW, square kernel, stride 1 and no padding by default) with bias, over F32
/// parameters `<path>.weight [out, in, k, k]` and `<path>.bias [out]`, initialised as PyTorch does.
///
/// Forward: `cols = im2col(x)` (`[N*OH*OW, in*k*k]`, kept for the backward), `Y = cols x W^T` as one
/// GEMM against a transposed copy of the (small) weight so that neither GEMM operand is read transposed,
/// bias added, then a batched transpose to NCHW. Backward: `dY` back to pixel-major, `dW = dY^T cols`,
/// `db = column sums of dY`, `dcols = dY W`, `dx = col2im(dcols)`.
#[derive(Debug)]
pub struct Conv2d {
    name: String,
    in_channels: usize,
    out_channels: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    /// An explicit seed; `None`: each parameter's own seed.
    seed: Option<u64>,
    weight: ParamId,
    bias: ParamId,
    geom: Option<Conv2dGeometry>,
    cols: Option<Buffer<f32>>,
}

impl Conv2d {
    /// A convolution `in_channels -> out_channels` with a `kernel x kernel` window, stride 1, no padding,
    /// PyTorch's default initialisation drawn from the parameters' seeds.
    pub fn new(in_channels: usize, out_channels: usize, kernel: usize) -> Result<Self, NnError> {
        if in_channels == 0 || out_channels == 0 || kernel == 0 {
            return Err(NnError::usage(
                "Conv2d",
                format!(
                    "channels {in_channels} -> {out_channels} and kernel {kernel} must be positive"
                ),
            ));
        }
        Ok(Conv2d {
            name: "Conv2d".into(),
            in_channels,
            out_channels,
            kernel,
            stride: 1,
            padding: 0,
            seed: None,
            weight: ParamId::UNSET,
            bias: ParamId::UNSET,
            geom: None,
            cols: None,
        })
    }

    /// With initial values drawn from `seed` (the weight from `seed`, the bias from a stream derived
    /// from it) instead of the parameters' own seeds.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Sets stride and zero padding (both directions).
    pub fn with_stride_padding(mut self, stride: usize, padding: usize) -> Result<Self, NnError> {
        if stride == 0 {
            return Err(NnError::usage(&self.name, "stride must be positive"));
        }
        self.stride = stride;
        self.padding = padding;
        Ok(self)
    }

    fn patch_len(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    fn geometry(&self, [n, c, h, w]: [usize; 4]) -> Result<Conv2dGeometry, NnError> {
        if c != self.in_channels {
            return Err(NnError::usage(
                &self.name,
                format!("input has {c} channels, the layer {}", self.in_channels),
            ));
        }
        if self.kernel > h + 2 * self.padding || self.kernel > w + 2 * self.padding {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "kernel {} larger than the padded {h}x{w} input",
                    self.kernel
                ),
            ));
        }
        Ok(Conv2dGeometry {
            batch: n,
            channels: c,
            height: h,
            width: w,
            kernel_h: self.kernel,
            kernel_w: self.kernel,
            stride: self.stride,
            padding: self.padding,
        })
    }

    /// Output shape for an NCHW input shape.
    pub fn output_shape(&self, shape: [usize; 4]) -> Result<[usize; 4], NnError> {
        let g = self.geometry(shape)?;
        Ok([shape[0], self.out_channels, g.out_h(), g.out_w()])
    }
}

impl Module for Conv2d {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        self.name = v.path().module();
        let (oc, k, fan_in, seed) = (self.out_channels, self.kernel, self.patch_len(), self.seed);
        let w_init =
            move |own: u64| kaiming_uniform(oc * fan_in, fan_in, 5f64.sqrt(), seed.unwrap_or(own));
        let b_init = move |own: u64| uniform_fan_in(oc, fan_in, seed.map_or(own, |s| s ^ 0xB1A5));
        let shape = [oc, self.in_channels, k, k];
        v.param(
            "weight",
            &ParamDecl::seeded(&shape, ParamKind::Plain, &w_init),
            &mut self.weight,
        )?;
        v.param(
            "bias",
            &ParamDecl::seeded(&[oc], ParamKind::Plain, &b_init),
            &mut self.bias,
        )
    }
}

impl Layer for Conv2d {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor) -> Result<Tensor, NnError> {
        let g = self.geometry(x.shape().nchw(&self.name)?)?;
        let (oc, pl, patches) = (self.out_channels, g.patch_len(), g.patches());
        let pixels = g.out_h() * g.out_w();
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let mut cols = dev.uninit::<f32>(patches * pl)?;
        let mut w_t = dev.uninit::<f32>(pl * oc)?;
        let mut y_pix = dev.uninit::<f32>(patches * oc)?;
        let mut y = Tensor::uninit(&dev, Shape::new(&[g.batch, oc, g.out_h(), g.out_w()])?)?;
        conv::im2col(x.data(), &g, &mut cols)?;
        drop(x);
        let [w, b] = ctx.params([self.weight, self.bias])?;
        // The convolution runs in F32: a parameter gathered in BF16 is widened.
        let (mut ws, mut bs) = (None, None);
        let w = plain_in::<f32>(plain_param(w, &self.name)?, &mut ws)?;
        let b = plain_in::<f32>(plain_param(b, &self.name)?, &mut bs)?;
        conv::transpose_batched(w, [1, oc, pl], &mut w_t)?;
        let spec = GemmSpec::new(patches, oc, pl).parallelism(par);
        gemm_f32(&spec, &cols, &w_t, &mut y_pix)?;
        elementwise::bias_add(&mut y_pix, b, patches, oc)?;
        conv::transpose_batched(&y_pix, [g.batch, pixels, oc], y.data_mut())?;
        self.geom = Some(g);
        self.cols = ctx.is_training().then_some(cols);
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor, need_dx: bool) -> InputGrad {
        let g = self
            .geom
            .ok_or_else(|| NnError::usage(&self.name, "backward before forward"))?;
        let cols = take_saved(&mut self.cols, &self.name)?;
        let (oc, pl, patches) = (self.out_channels, g.patch_len(), g.patches());
        let pixels = g.out_h() * g.out_w();
        if dy.shape().numel() != patches * oc {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "output gradient of shape {:?}, expected {} elements",
                    dy.shape(),
                    patches * oc
                ),
            ));
        }
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let mut dy_pix = dev.uninit::<f32>(patches * oc)?;
        conv::transpose_batched(dy.data(), [g.batch, oc, pixels], &mut dy_pix)?;
        drop(dy);
        let mut db = dev.uninit::<f32>(oc)?;
        reduce::sum_over_rows(&dy_pix, patches, oc, &mut db)?;
        // dW [oc, pl] = dY^T [oc, patches] x cols [patches, pl].
        let mut dw = dev.uninit::<f32>(oc * pl)?;
        let spec = GemmSpec::new(oc, pl, patches)
            .transposes(Transpose::Yes, Transpose::No)
            .parallelism(par);
        gemm_f32(&spec, &dy_pix, &cols, &mut dw)?;
        drop(cols);
        let dx = if need_dx {
            let mut ws = None;
            let w = plain_in::<f32>(
                plain_param(ctx.params([self.weight])?[0], &self.name)?,
                &mut ws,
            )?;
            let mut dcols = dev.uninit::<f32>(patches * pl)?;
            // dcols [patches, pl] = dY [patches, oc] x W [oc, pl].
            let spec = GemmSpec::new(patches, pl, oc).parallelism(par);
            gemm_f32(&spec, &dy_pix, w, &mut dcols)?;
            let mut dx =
                Tensor::uninit(&dev, Shape::new(&[g.batch, g.channels, g.height, g.width])?)?;
            conv::col2im(&dcols, &g, dx.data_mut())?;
            Some(dx)
        } else {
            None
        };
        ctx.add_grad(self.weight, &dw)?;
        ctx.add_grad(self.bias, &db)?;
        Ok(dx)
    }
}
