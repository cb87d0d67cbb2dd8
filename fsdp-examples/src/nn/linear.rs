//! Fully connected layer in FP8, BF16 or F32.

use super::{held, held_mut, reuse_buffer, NnError};
use fp8_core::{ScalingMeta, ScalingRecipe};
use fp8_kernels::{
    convert, Buffer, CpuParallelism, Device, DeviceScalar, DeviceScalingMeta, FloatLinear,
    Fp8Linear, Fp8LinearConfig, Fp8LinearSaved,
};
use fsdp_shard::{ParamKind, ParamSpec, ShardedModel};
use half::bf16;

/// The arithmetic of a [`Linear`] layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LinearPrecision {
    /// FP8: input and weight E4M3, output gradient E5M2, f32 accumulation. The weight is an FP8 parameter
    /// of the sharded model (gathered as E4M3 with the scale the optimizer set); input and output-gradient
    /// scales are delayed (amax history of 16 steps).
    #[default]
    Fp8,
    /// BF16 operands (weight and activations rounded to bf16), f32 accumulation and f32 outputs.
    Bf16,
    /// F32 throughout.
    F32,
}

impl LinearPrecision {
    /// The kind of the weight parameter: FP8 weights travel as E4M3, the others as F32.
    pub fn weight_kind(self) -> ParamKind {
        match self {
            LinearPrecision::Fp8 => ParamKind::Fp8Weight,
            LinearPrecision::Bf16 | LinearPrecision::F32 => ParamKind::Plain,
        }
    }
}

#[derive(Debug)]
enum LinearOp {
    Fp8(Box<Fp8Linear>),
    Float(FloatLinear),
}

/// `y = x W^T + b` with `x [tokens, in]`, `W [out, in]` (`<module>.weight`), `b [out]` (`<module>.bias`,
/// F32), `y [tokens, out]` (f32).
///
/// In FP8 the layer owns the input and output-gradient scaling metas (delayed scaling, window 16): casts
/// record each step's amax in the metas' pending slots; once per optimizer step the caller reduces those
/// amaxes across ranks (all-reduce MAX, so every rank casts with the same scales) and calls
/// [`Linear::update_scales_from`]. The weight's scale comes with the gathered weight (the optimizer sets
/// it from the master weights with current scaling). Odd sizes (e.g. 10 classes) are padded to the
/// multiples of 16 cuBLASLt needs inside the GEMM, not here.
#[derive(Debug)]
pub struct Linear {
    module: String,
    weight: String,
    bias: String,
    in_features: usize,
    out_features: usize,
    precision: LinearPrecision,
    op: LinearOp,
    fp8_saved: Option<Fp8LinearSaved>,
    x_saved: Option<Buffer<f32>>,
    x_bf16: Option<Buffer<bf16>>,
    w_bf16: Option<Buffer<bf16>>,
    dy_bf16: Option<Buffer<bf16>>,
    y: Option<Buffer<f32>>,
    dx: Option<Buffer<f32>>,
    dw: Option<Buffer<f32>>,
    db: Option<Buffer<f32>>,
}

fn delayed_recipe() -> ScalingRecipe {
    ScalingRecipe::delayed_default()
}

impl Linear {
    /// A layer `in_features -> out_features` on `device` whose parameters are `<module>.weight` and
    /// `<module>.bias`. `parallelism` is the threading of its CPU GEMMs.
    pub fn new(
        module: &str,
        in_features: usize,
        out_features: usize,
        precision: LinearPrecision,
        device: &Device,
        parallelism: CpuParallelism,
    ) -> Result<Self, NnError> {
        let op = match precision {
            LinearPrecision::Fp8 => {
                let config = Fp8LinearConfig {
                    input_recipe: delayed_recipe(),
                    grad_output_recipe: delayed_recipe(),
                    parallelism,
                    ..Fp8LinearConfig::default()
                };
                LinearOp::Fp8(Box::new(Fp8Linear::new(
                    device,
                    in_features,
                    out_features,
                    config,
                )?))
            }
            LinearPrecision::Bf16 | LinearPrecision::F32 => {
                LinearOp::Float(FloatLinear::new(in_features, out_features, parallelism)?)
            }
        };
        Ok(Linear {
            module: module.to_string(),
            weight: format!("{module}.weight"),
            bias: format!("{module}.bias"),
            in_features,
            out_features,
            precision,
            op,
            fp8_saved: None,
            x_saved: None,
            x_bf16: None,
            w_bf16: None,
            dy_bf16: None,
            y: None,
            dx: None,
            dw: None,
            db: None,
        })
    }

    /// The precision.
    pub fn precision(&self) -> LinearPrecision {
        self.precision
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The parameters: weight `[out, in]` (FP8 or plain per precision) and bias `[out]` (plain).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new(
                &self.module,
                "weight",
                &[self.out_features, self.in_features],
                self.precision.weight_kind(),
            ),
            ParamSpec::new(&self.module, "bias", &[self.out_features], ParamKind::Plain),
        ]
    }

    /// PyTorch's default initial values `(weight, bias)`, seeded (see [`super::kaiming_uniform`]).
    pub fn init_values(&self, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let fan_in = self.in_features;
        (
            super::kaiming_uniform(self.out_features * fan_in, fan_in, 5f64.sqrt(), seed),
            super::uniform_fan_in(self.out_features, fan_in, seed ^ 0xB1A5),
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

    fn tokens(&self, len: usize) -> Result<usize, NnError> {
        if len % self.in_features != 0 {
            return Err(NnError::usage(
                &self.module,
                format!(
                    "input of {len} elements is not rows of {}",
                    self.in_features
                ),
            ));
        }
        Ok(len / self.in_features)
    }

    /// `y = x W^T + b`; the layer's unit must be gathered. `x` is `[tokens, in]`.
    pub fn forward(
        &mut self,
        model: &ShardedModel,
        x: &Buffer<f32>,
    ) -> Result<&Buffer<f32>, NnError> {
        let tokens = self.tokens(x.len())?;
        let dev = x.device();
        reuse_buffer(&mut self.y, &dev, tokens * self.out_features)?;
        let bias = model.plain(&self.bias)?;
        let y = held_mut(&mut self.y, &self.module, "output")?;
        match &mut self.op {
            LinearOp::Fp8(op) => {
                let (codes, scales) = model.fp8_weight(&self.weight)?;
                let scale_inv = DeviceScalar::new(scales, 1)?;
                self.fp8_saved = Some(op.forward(x, codes, Some(scale_inv), Some(bias), y)?);
            }
            LinearOp::Float(op) => {
                let w = model.plain(&self.weight)?;
                if self.precision == LinearPrecision::Bf16 {
                    reuse_buffer(&mut self.x_bf16, &dev, x.len())?;
                    reuse_buffer(&mut self.w_bf16, &dev, w.len())?;
                    let xb = held_mut(&mut self.x_bf16, &self.module, "bf16 input")?;
                    convert(x, xb)?;
                    let wb = held_mut(&mut self.w_bf16, &self.module, "bf16 weight")?;
                    convert(w, wb)?;
                    let (xb, wb) = (
                        held(&self.x_bf16, &self.module, "bf16 input")?,
                        held(&self.w_bf16, &self.module, "bf16 weight")?,
                    );
                    op.forward(xb, wb, Some(bias), y)?;
                } else {
                    reuse_buffer(&mut self.x_saved, &dev, x.len())?;
                    held_mut(&mut self.x_saved, &self.module, "saved input")?.copy_from(x)?;
                    op.forward(x, w, Some(bias), y)?;
                }
            }
        }
        Ok(y)
    }

    /// Backward for `dy [tokens, out]`: adds `dW` and `db` to the model, returns `dx` when `need_dx`. The
    /// unit must be gathered (the same weights as in the forward pass).
    pub fn backward(
        &mut self,
        model: &mut ShardedModel,
        dy: &Buffer<f32>,
        need_dx: bool,
    ) -> Result<Option<&Buffer<f32>>, NnError> {
        let dev = dy.device();
        let (inf, outf) = (self.in_features, self.out_features);
        if dy.len() % outf != 0 {
            return Err(NnError::usage(
                &self.module,
                format!(
                    "output gradient of {} elements is not rows of {outf}",
                    dy.len()
                ),
            ));
        }
        let tokens = dy.len() / outf;
        reuse_buffer(&mut self.dw, &dev, inf * outf)?;
        reuse_buffer(&mut self.db, &dev, outf)?;
        if need_dx {
            reuse_buffer(&mut self.dx, &dev, tokens * inf)?;
        }
        let dw = self
            .dw
            .as_mut()
            .ok_or_else(|| NnError::usage(&self.module, "dw"))?;
        let db = self
            .db
            .as_mut()
            .ok_or_else(|| NnError::usage(&self.module, "db"))?;
        let dx = if need_dx { self.dx.as_mut() } else { None };
        match &mut self.op {
            LinearOp::Fp8(op) => {
                let saved = self
                    .fp8_saved
                    .as_ref()
                    .ok_or_else(|| NnError::usage(&self.module, "backward before forward"))?;
                if saved.tokens() != tokens {
                    return Err(NnError::usage(
                        &self.module,
                        format!("{tokens} gradient rows for a forward of {}", saved.tokens()),
                    ));
                }
                let (codes, scales) = model.fp8_weight(&self.weight)?;
                let scale_inv = DeviceScalar::new(scales, 1)?;
                op.backward(
                    saved,
                    dy,
                    codes,
                    Some(scale_inv),
                    None,
                    dx,
                    dw,
                    false,
                    Some(db),
                )?;
            }
            LinearOp::Float(op) => {
                if self.precision == LinearPrecision::Bf16 {
                    reuse_buffer(&mut self.dy_bf16, &dev, dy.len())?;
                    let dyb = held_mut(&mut self.dy_bf16, &self.module, "bf16 gradient")?;
                    convert(dy, dyb)?;
                    let xb = held(&self.x_bf16, &self.module, "bf16 input")?;
                    let wb = held(&self.w_bf16, &self.module, "bf16 weight")?;
                    let dyb = held(&self.dy_bf16, &self.module, "bf16 gradient")?;
                    op.backward(xb, dyb, wb, dx, dw, false, Some(db))?;
                } else {
                    let x = held(&self.x_saved, &self.module, "saved input")?;
                    let w = model.plain(&self.weight)?;
                    op.backward(x, dy, w, dx, dw, false, Some(db))?;
                }
            }
        }
        model.add_grad(
            &self.weight,
            held(&self.dw, &self.module, "weight gradient")?,
        )?;
        model.add_grad(&self.bias, held(&self.db, &self.module, "bias gradient")?)?;
        Ok(if need_dx { self.dx.as_ref() } else { None })
    }

    /// FP8 only: the pending amaxes `[input, output gradient]` recorded by casts since the last update
    /// (one-element device buffers), to be reduced across ranks. `None` for BF16/F32 layers.
    pub fn pending_amaxes(&self) -> Option<[&Buffer<f32>; 2]> {
        match &self.op {
            LinearOp::Fp8(op) => Some([
                op.input_meta().pending_amax(),
                op.grad_output_meta().pending_amax(),
            ]),
            LinearOp::Float(_) => None,
        }
    }

    /// FP8 only: the step-end update of the delayed metas from `amaxes[base]` (input) and
    /// `amaxes[base + 1]` (output gradient), e.g. after an all-reduce MAX; then clears the pending amaxes.
    /// A no-op for BF16/F32 layers.
    pub fn update_scales_from(&mut self, amaxes: &Buffer<f32>, base: usize) -> Result<(), NnError> {
        if let LinearOp::Fp8(op) = &mut self.op {
            op.input_meta_mut().update_from_amax(amaxes, base)?;
            op.grad_output_meta_mut()
                .update_from_amax(amaxes, base + 1)?;
            self.clear_pending_amaxes()?;
        }
        Ok(())
    }

    /// FP8 only: forgets the amaxes recorded since the last update (e.g. after an evaluation pass, which
    /// must not influence the training scales).
    pub fn clear_pending_amaxes(&mut self) -> Result<(), NnError> {
        if let LinearOp::Fp8(op) = &mut self.op {
            op.input_meta_mut().pending_amax_mut().fill_zero()?;
            op.grad_output_meta_mut().pending_amax_mut().fill_zero()?;
        }
        Ok(())
    }

    /// FP8 only: the input and output-gradient metas as host values (scale, amax history, count), for
    /// checkpoints. `None` for BF16/F32 layers.
    pub fn scaling_metas(&self) -> Result<Option<[ScalingMeta; 2]>, NnError> {
        match &self.op {
            LinearOp::Fp8(op) => Ok(Some([
                op.input_meta().to_meta()?,
                op.grad_output_meta().to_meta()?,
            ])),
            LinearOp::Float(_) => Ok(None),
        }
    }

    /// FP8 only: restores the metas saved with [`Linear::scaling_metas`] (pending amaxes cleared).
    pub fn set_scaling_metas(&mut self, metas: &[ScalingMeta; 2]) -> Result<(), NnError> {
        match &mut self.op {
            LinearOp::Fp8(op) => {
                let dev = op.input_meta().device();
                *op.input_meta_mut() = DeviceScalingMeta::new(&dev, &metas[0])?;
                *op.grad_output_meta_mut() = DeviceScalingMeta::new(&dev, &metas[1])?;
                Ok(())
            }
            LinearOp::Float(_) => Err(NnError::usage(
                &self.module,
                "scaling metas given to a layer that is not FP8",
            )),
        }
    }
}
