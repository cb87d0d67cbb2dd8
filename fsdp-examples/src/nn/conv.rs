//! 2-D convolution as im2col + GEMM.

use super::{held, held_mut, reuse_buffer, NnError};
use fp8_kernels::gemm::gemm_f32;
use fp8_kernels::ops::{self, Conv2dGeometry};
use fp8_kernels::{Buffer, CpuParallelism, GemmSpec, Transpose};
use fsdp_shard::{ParamKind, ParamSpec, ShardedModel};

/// A 2-D convolution (NCHW, square kernel, stride 1 by default, no padding by default) with bias, over
/// F32 parameters `<module>.weight [out, in, k, k]` and `<module>.bias [out]` of a sharded model.
///
/// Forward: `cols = im2col(x)` (`[N*OH*OW, in*k*k]`), `Y = cols x W^T` as one GEMM against a transposed
/// copy of the (small) weight so that neither GEMM operand is read transposed, bias added, then a batched
/// transpose to NCHW. Backward: `dY` back to pixel-major, `dW = dY^T cols`, `db = column sums of dY`,
/// `dcols = dY W`, `dx = col2im(dcols)`.
#[derive(Debug)]
pub struct Conv2d {
    module: String,
    weight: String,
    bias: String,
    in_channels: usize,
    out_channels: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    parallelism: CpuParallelism,
    geom: Option<Conv2dGeometry>,
    cols: Option<Buffer<f32>>,
    w_t: Option<Buffer<f32>>,
    y_pix: Option<Buffer<f32>>,
    y: Option<Buffer<f32>>,
    dy_pix: Option<Buffer<f32>>,
    dcols: Option<Buffer<f32>>,
    dx: Option<Buffer<f32>>,
    dw: Option<Buffer<f32>>,
    db: Option<Buffer<f32>>,
}

impl Conv2d {
    /// A convolution `in_channels -> out_channels` with a `kernel x kernel` window, stride 1, no padding,
    /// whose parameters are named `<module>.weight` and `<module>.bias`. `parallelism` is the threading of
    /// its CPU GEMMs (`Single` when ranks run as threads, one per core).
    pub fn new(
        module: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        parallelism: CpuParallelism,
    ) -> Result<Self, NnError> {
        if in_channels == 0 || out_channels == 0 || kernel == 0 {
            return Err(NnError::usage(
                module,
                format!(
                    "channels {in_channels} -> {out_channels} and kernel {kernel} must be positive"
                ),
            ));
        }
        Ok(Conv2d {
            module: module.to_string(),
            weight: format!("{module}.weight"),
            bias: format!("{module}.bias"),
            in_channels,
            out_channels,
            kernel,
            stride: 1,
            padding: 0,
            parallelism,
            geom: None,
            cols: None,
            w_t: None,
            y_pix: None,
            y: None,
            dy_pix: None,
            dcols: None,
            dx: None,
            dw: None,
            db: None,
        })
    }

    /// Sets stride and zero padding (both directions).
    pub fn with_stride_padding(mut self, stride: usize, padding: usize) -> Result<Self, NnError> {
        if stride == 0 {
            return Err(NnError::usage(&self.module, "stride must be positive"));
        }
        self.stride = stride;
        self.padding = padding;
        Ok(self)
    }

    /// The parameters: weight `[out, in, k, k]` and bias `[out]`, both plain F32.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let k = self.kernel;
        vec![
            ParamSpec::new(
                &self.module,
                "weight",
                &[self.out_channels, self.in_channels, k, k],
                ParamKind::Plain,
            ),
            ParamSpec::new(&self.module, "bias", &[self.out_channels], ParamKind::Plain),
        ]
    }

    /// PyTorch's default initial values `(weight, bias)`: kaiming-uniform with `a = sqrt(5)` and
    /// uniform bias, both within `1/sqrt(fan_in)`, from two seeded streams.
    pub fn init_values(&self, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let fan_in = self.patch_len();
        (
            super::kaiming_uniform(self.out_channels * fan_in, fan_in, 5f64.sqrt(), seed),
            super::uniform_fan_in(self.out_channels, fan_in, seed ^ 0xB1A5),
        )
    }

    /// The weight's name in the sharded model.
    pub fn weight_name(&self) -> &str {
        &self.weight
    }

    /// The bias's name in the sharded model.
    pub fn bias_name(&self) -> &str {
        &self.bias
    }

    fn patch_len(&self) -> usize {
        self.in_channels * self.kernel * self.kernel
    }

    fn geometry(&self, [n, c, h, w]: [usize; 4]) -> Result<Conv2dGeometry, NnError> {
        if c != self.in_channels {
            return Err(NnError::usage(
                &self.module,
                format!("input has {c} channels, the layer {}", self.in_channels),
            ));
        }
        if self.kernel > h + 2 * self.padding || self.kernel > w + 2 * self.padding {
            return Err(NnError::usage(
                &self.module,
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

    /// `y = conv(x, W) + b` for NCHW `x` of `shape`; the layer's unit must be gathered. Returns the output
    /// and its shape.
    pub fn forward(
        &mut self,
        model: &ShardedModel,
        x: &Buffer<f32>,
        shape: [usize; 4],
    ) -> Result<(&Buffer<f32>, [usize; 4]), NnError> {
        let g = self.geometry(shape)?;
        if x.len() != g.input_len() {
            return Err(NnError::usage(
                &self.module,
                format!("input of {} elements for shape {shape:?}", x.len()),
            ));
        }
        let (oc, pl, patches) = (self.out_channels, g.patch_len(), g.patches());
        let pixels = g.out_h() * g.out_w();
        let dev = x.device();
        reuse_buffer(&mut self.cols, &dev, patches * pl)?;
        reuse_buffer(&mut self.w_t, &dev, pl * oc)?;
        reuse_buffer(&mut self.y_pix, &dev, patches * oc)?;
        reuse_buffer(&mut self.y, &dev, patches * oc)?;
        let (w, b) = (model.plain(&self.weight)?, model.plain(&self.bias)?);
        let cols = held_mut(&mut self.cols, &self.module, "columns")?;
        ops::im2col(x, &g, cols)?;
        let w_t = held_mut(&mut self.w_t, &self.module, "transposed weight")?;
        ops::transpose_batched(w, [1, oc, pl], w_t)?;
        let y_pix = held_mut(&mut self.y_pix, &self.module, "pixel-major output")?;
        let spec = GemmSpec::new(patches, oc, pl).parallelism(self.parallelism);
        gemm_f32(&spec, cols, w_t, y_pix)?;
        ops::bias_add(y_pix, b, patches, oc)?;
        let y = held_mut(&mut self.y, &self.module, "output")?;
        ops::transpose_batched(y_pix, [g.batch, pixels, oc], y)?;
        self.geom = Some(g);
        Ok((y, [g.batch, oc, g.out_h(), g.out_w()]))
    }

    /// Backward for output gradient `dy` (NCHW): adds `dW` and `db` to the model and returns `dx` when
    /// `need_dx` (the first layer of a network does not need it). The unit must be gathered.
    pub fn backward(
        &mut self,
        model: &mut ShardedModel,
        dy: &Buffer<f32>,
        need_dx: bool,
    ) -> Result<Option<&Buffer<f32>>, NnError> {
        let g = self
            .geom
            .ok_or_else(|| NnError::usage(&self.module, "backward before forward"))?;
        let (oc, pl, patches) = (self.out_channels, g.patch_len(), g.patches());
        let pixels = g.out_h() * g.out_w();
        if dy.len() != patches * oc {
            return Err(NnError::usage(
                &self.module,
                format!(
                    "output gradient of {} elements, expected {}",
                    dy.len(),
                    patches * oc
                ),
            ));
        }
        let dev = dy.device();
        reuse_buffer(&mut self.dy_pix, &dev, patches * oc)?;
        reuse_buffer(&mut self.dw, &dev, oc * pl)?;
        reuse_buffer(&mut self.db, &dev, oc)?;
        let dy_pix = held_mut(&mut self.dy_pix, &self.module, "pixel-major gradient")?;
        ops::transpose_batched(dy, [g.batch, oc, pixels], dy_pix)?;
        let dy_pix = held(&self.dy_pix, &self.module, "pixel-major gradient")?;
        let cols = held(&self.cols, &self.module, "columns")?;
        let db = held_mut(&mut self.db, &self.module, "bias gradient")?;
        ops::bias_grad(dy_pix, patches, oc, db)?;
        // dW [oc, pl] = dY^T [oc, patches] x cols [patches, pl].
        let dw = held_mut(&mut self.dw, &self.module, "weight gradient")?;
        let spec = GemmSpec::new(oc, pl, patches)
            .transposes(Transpose::Yes, Transpose::No)
            .parallelism(self.parallelism);
        gemm_f32(&spec, dy_pix, cols, dw)?;
        if need_dx {
            reuse_buffer(&mut self.dcols, &dev, patches * pl)?;
            reuse_buffer(&mut self.dx, &dev, g.input_len())?;
            let w = model.plain(&self.weight)?;
            let dcols = held_mut(&mut self.dcols, &self.module, "column gradient")?;
            // dcols [patches, pl] = dY [patches, oc] x W [oc, pl].
            let spec = GemmSpec::new(patches, pl, oc).parallelism(self.parallelism);
            gemm_f32(&spec, dy_pix, w, dcols)?;
            let dx = held_mut(&mut self.dx, &self.module, "input gradient")?;
            ops::col2im(dcols, &g, dx)?;
        }
        model.add_grad(
            &self.weight,
            held(&self.dw, &self.module, "weight gradient")?,
        )?;
        model.add_grad(&self.bias, held(&self.db, &self.module, "bias gradient")?)?;
        Ok(if need_dx { self.dx.as_ref() } else { None })
    }
}
