//! [`Norm`]: LayerNorm or RMSNorm over the last dimension (`fp8_kernels::layer_norm`), with a weight,
//! an optional bias and `eps` (PyTorch's 1e-5 by default).
//!
//! Three ways to run it:
//! - [`Norm::forward_ref`]: the normalised tensor, in the activation type (the statistics are kept for
//!   the backward; the caller keeps the input, e.g. a pre-norm block's residual stream);
//! - [`Norm::forward_linear`]: the norm followed by a [`Linear`]. When the linear is FP8 the norm writes
//!   the linear's E4M3 input directly (Transformer Engine's LayerNormLinear): one pass over `x` writes the
//!   row-major codes, the transposed codes the linear keeps for its weight gradient, and the amax into the
//!   linear's input meta, cast with that meta's scale; the normalised tensor never exists. Bit-identical to
//!   [`Norm::forward_ref`] followed by the linear's own cast (the norm's output is rounded to the
//!   activation type before the cast either way). When the linear is block-scaled the norm computes its
//!   row statistics only and the linear's 1x128 / 128x1 casts apply them as they read `x`
//!   (`BlockCastInput::Norm`), again without writing the normalised tensor, bit for bit the unfused
//!   path; a recast in the backward ([`Norm::restore_linear_input`]) applies the kept statistics the
//!   same way;
//! - as a [`Layer`] (keeps its own input).
//!
//! The backward takes the output gradient and the forward's input, and either returns `dx` or adds it
//! into a given gradient with one rounding ([`Norm::backward_ref`] with `accumulate`): the residual
//! stream's gradient of a pre-norm block, without a separate add.

use crate::layer::{rows_of_width, take_saved, Activation, InputGrad, Layer};
use crate::plain_param::{plain_owned, plain_param};
use crate::{Linear, NnError, Shape, Tensor};
use fp8_kernels::block_quantize::BlockCastInput;
use fp8_kernels::layer_norm::{
    norm_backward, norm_forward, norm_forward_fp8, norm_forward_stats, Fp8NormOutput, GradMode,
    NormGrads, NormKind, NormSpec, NormStats, DEFAULT_EPS,
};
use fp8_kernels::Buffer;
use fsdp_shard::{Ctx, Module, ParamDecl, ParamId, ParamKind, ShardError, Visitor};

/// LayerNorm or RMSNorm over vectors of `d` (parameters `<path>.weight`, and `<path>.bias` when it has
/// one; weight initialised to 1, bias to 0).
#[derive(Debug)]
pub struct Norm<T: Activation = f32> {
    name: String,
    kind: NormKind,
    d: usize,
    eps: f32,
    has_bias: bool,
    fuse_fp8: bool,
    weight: ParamId,
    bias: ParamId,
    /// Statistics of the last training forward.
    stats: Option<NormStats>,
    /// The input, when used as a [`Layer`].
    x: Option<Tensor<T>>,
}

impl<T: Activation> Norm<T> {
    fn new(kind: NormKind, d: usize) -> Result<Self, NnError> {
        if d == 0 {
            return Err(NnError::usage("Norm", "d must be positive"));
        }
        Ok(Norm {
            name: "Norm".into(),
            kind,
            d,
            eps: DEFAULT_EPS,
            has_bias: false,
            fuse_fp8: true,
            weight: ParamId::UNSET,
            bias: ParamId::UNSET,
            stats: None,
            x: None,
        })
    }

    /// LayerNorm over `d` features, weight only (GPT-2 as nanoGPT builds it with `bias=False`), eps 1e-5.
    pub fn layer_norm(d: usize) -> Result<Self, NnError> {
        Self::new(NormKind::LayerNorm, d)
    }

    /// RMSNorm over `d` features, weight only, eps 1e-5.
    pub fn rms_norm(d: usize) -> Result<Self, NnError> {
        Self::new(NormKind::RmsNorm, d)
    }

    /// A norm of `kind` over `d` features.
    pub fn of_kind(kind: NormKind, d: usize) -> Result<Self, NnError> {
        Self::new(kind, d)
    }

    /// With a bias (LayerNorm's `bias=True`).
    pub fn with_bias(mut self) -> Self {
        self.has_bias = true;
        self
    }

    /// With another eps (finite, `>= 0`).
    pub fn with_eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// Whether [`Norm::forward_linear`] writes an FP8 linear's input directly (default on). Off: the
    /// normalised tensor, then the linear's own cast (the same bits; for comparisons).
    pub fn fused_fp8(mut self, on: bool) -> Self {
        self.fuse_fp8 = on;
        self
    }

    /// LayerNorm or RMSNorm.
    pub fn kind(&self) -> NormKind {
        self.kind
    }

    /// Features.
    pub fn dim(&self) -> usize {
        self.d
    }

    /// The weight's id.
    pub fn weight_id(&self) -> ParamId {
        self.weight
    }

    fn spec(&self, x_shape: Shape) -> Result<NormSpec, NnError> {
        let rows = rows_of_width(&self.name, x_shape, self.d)?;
        let spec = match self.kind {
            NormKind::LayerNorm => NormSpec::layer_norm(rows, self.d),
            NormKind::RmsNorm => NormSpec::rms_norm(rows, self.d),
        };
        Ok(spec.with_eps(self.eps))
    }

    /// An error unless a gradient (`what`, of `shape`) has as many values as the input (of `x_shape`).
    fn check_size(&self, what: &str, shape: Shape, x_shape: Shape) -> Result<(), NnError> {
        if shape.numel() != x_shape.numel() {
            return Err(NnError::usage(
                &self.name,
                format!("{what} of shape {shape:?} for an input of shape {x_shape:?}"),
            ));
        }
        Ok(())
    }

    /// The weight (and bias) in the activation type, gathered from the model.
    fn params_in(&self, ctx: &mut Ctx<'_>) -> Result<(Buffer<T>, Option<Buffer<T>>), NnError> {
        let dev = ctx.device().clone();
        if self.has_bias {
            let [w, b] = ctx.params([self.weight, self.bias])?;
            Ok((
                plain_owned(&dev, plain_param(w, &self.name)?)?,
                Some(plain_owned(&dev, plain_param(b, &self.name)?)?),
            ))
        } else {
            let [w] = ctx.params([self.weight])?;
            Ok((plain_owned(&dev, plain_param(w, &self.name)?)?, None))
        }
    }

    /// The normalised `x` (same shape); keeps the row statistics when training.
    pub fn forward_ref(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<T>) -> Result<Tensor<T>, NnError> {
        let (y, stats) = self.normalized(ctx, x)?;
        self.stats = ctx.is_training().then_some(stats);
        Ok(y)
    }

    /// `norm(x)` and its row statistics.
    fn normalized(
        &self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
    ) -> Result<(Tensor<T>, NormStats), NnError> {
        let spec = self.spec(x.shape())?;
        let (w, b) = self.params_in(ctx)?;
        let dev = ctx.device().clone();
        let mut stats = NormStats::new(&dev, spec.rows)?;
        let mut y = Tensor::<T>::uninit(&dev, x.shape())?;
        norm_forward(&spec, x.data(), &w, b.as_ref(), &mut stats, y.data_mut())?;
        Ok((y, stats))
    }

    /// `linear(norm(x))`. With an FP8 linear (and fusion on) the norm writes the linear's E4M3 input
    /// codes, its saved transposed codes and the input meta's amax in one pass; otherwise the normalised
    /// tensor goes through [`Layer::forward`] of the linear. The linear's backward then runs as usual and
    /// returns the gradient of `norm(x)`, which [`Norm::backward_ref`] takes.
    pub fn forward_linear(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
        linear: &mut Linear<T>,
    ) -> Result<Tensor<T>, NnError> {
        // A block-scaled linear casts tile by tile itself: with fusion on it applies this norm's
        // statistics as it reads x (forward_block_linear), else it takes the norm's output.
        if !(self.fuse_fp8 && linear.takes_fp8_codes()) {
            // Block-scaled, the cast is a function of this norm's output alone: a caller that asked
            // for no kept input (Linear::set_keep_fp8_input off) gets it recast from the recomputed
            // output in restore_linear_input, the same codes, one byte per element less held.
            let recast_block = linear.is_block_scaled() && !linear.keeps_fp8_input();
            linear.set_keep_block_input(!recast_block);
            // Unfused per-tensor, the linear casts the bf16-rounded output itself: it keeps its input,
            // as restore_linear_input could not recreate those codes from this norm's fused kernel.
            linear.set_keep_fp8_input(true);
            if self.fuse_fp8 && linear.is_block_scaled() {
                return self.forward_block_linear(ctx, x, linear);
            }
            let h = self.forward_ref(ctx, x)?;
            let y = linear.forward(ctx, h)?;
            if !ctx.is_training() {
                linear.drop_saved();
            }
            return Ok(y);
        }
        let spec = self.spec(x.shape())?;
        if linear.in_features() != self.d {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "a norm over {} features feeding a linear of {} inputs",
                    self.d,
                    linear.in_features()
                ),
            ));
        }
        let (w, b) = self.params_in(ctx)?;
        let dev = ctx.device().clone();
        let mut stats = NormStats::new(&dev, spec.rows)?;
        let mut x_q = dev.uninit::<u8>(spec.rows * spec.d)?;
        let meta = linear.input_meta();
        // x^T only for a backward that reads it as written now (not recast later, not evaluation).
        let transpose = ctx.is_training() && linear.keeps_fp8_input();
        let saved = linear.fp8_input_for(&dev, spec.rows, transpose)?;
        {
            let s = ctx.scaling(meta)?;
            norm_forward_fp8(
                &spec,
                x.data(),
                &w,
                b.as_ref(),
                &mut stats,
                Fp8NormOutput {
                    format: s.state.format()?,
                    scale: s.state.scale(),
                    codes: Some(&mut x_q),
                    codes_t: transpose.then_some(&mut saved.x_t),
                    amax: s.amax,
                },
            )?;
            saved.x_scale_inv.copy_from(s.state.scale_inv())?;
        }
        let training = ctx.is_training();
        self.stats = training.then_some(stats);
        let y = linear.forward_fp8_codes(ctx, &x_q, x.shape().with_last(linear.out_features())?)?;
        if training {
            let s = ctx.scaling(meta)?;
            linear.release_fp8_input(s.state.format()?, s.state.scale())?;
        } else {
            linear.drop_saved();
        }
        Ok(y)
    }

    /// `linear(norm(x))` for a block-scaled linear: this norm computes its row statistics only, and the
    /// linear's 1x128 / 128x1 casts compute the normalised values from them as they read `x`
    /// (`BlockCastInput::Norm`: the same values as [`Norm::forward_ref`]'s, which are never written).
    fn forward_block_linear(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
        linear: &mut Linear<T>,
    ) -> Result<Tensor<T>, NnError> {
        let spec = self.spec(x.shape())?;
        let (w, b) = self.params_in(ctx)?;
        let mut stats = NormStats::new(ctx.device(), spec.rows)?;
        norm_forward_stats(&spec, x.data(), &w, b.as_ref(), &mut stats)?;
        let input = BlockCastInput::Norm {
            x: x.data(),
            weight: &w,
            bias: b.as_ref(),
            stats: &stats,
            spec,
        };
        let y = linear.forward_from(ctx, input, x.shape())?;
        if ctx.is_training() {
            self.stats = Some(stats);
        } else {
            self.stats = None;
            linear.drop_saved();
        }
        Ok(y)
    }

    /// Writes `linear`'s E4M3 `x^T` again from `x`, the input of the last training
    /// [`Norm::forward_linear`], when the linear kept none ([`Linear::set_keep_fp8_input`]): this norm's
    /// fused forward once more at the forward's scale, recording no amax, its statistics discarded. The
    /// same kernel on the same values and weights: the same codes. With `row_major`, also writes and
    /// returns the row-major codes (`[tokens, d]`) for a caller that recomputes the linear's output
    /// from them ([`crate::Mlp::restore_up_output`]); `None` without, or, doing nothing, when the linear
    /// kept its input.
    pub fn restore_linear_input(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
        linear: &mut Linear<T>,
        row_major: bool,
    ) -> Result<Option<Buffer<u8>>, NnError> {
        if linear.awaits_block_input() {
            match (self.fuse_fp8, self.stats.as_ref()) {
                // The kept statistics applied inside the linear's cast, as in the forward.
                (true, Some(stats)) => {
                    let spec = self.spec(x.shape())?;
                    let (w, b) = self.params_in(ctx)?;
                    let input = BlockCastInput::Norm {
                        x: x.data(),
                        weight: &w,
                        bias: b.as_ref(),
                        stats,
                        spec,
                    };
                    linear.save_block_input_from(ctx, input, x.shape())?;
                }
                // This norm's output once more (its statistics discarded), cast by the linear.
                _ => {
                    let (h, _) = self.normalized(ctx, x)?;
                    linear.save_block_input(ctx, &h)?;
                }
            }
            return Ok(None);
        }
        if !linear.awaits_fp8_input() {
            return Ok(None);
        }
        let spec = self.spec(x.shape())?;
        let (w, b) = self.params_in(ctx)?;
        let dev = ctx.device().clone();
        let mut stats = NormStats::new(&dev, spec.rows)?;
        let mut x_q = if row_major {
            Some(dev.uninit::<u8>(spec.rows * spec.d)?)
        } else {
            None
        };
        linear.restore_fp8_input_with(|format, scale, x_t| {
            norm_forward_fp8(
                &spec,
                x.data(),
                &w,
                b.as_ref(),
                &mut stats,
                Fp8NormOutput {
                    format,
                    scale,
                    codes: x_q.as_mut(),
                    codes_t: Some(x_t),
                    amax: None,
                },
            )?;
            Ok(())
        })?;
        Ok(x_q)
    }

    /// The backward after a training forward of input `x`: adds the weight (and bias) gradient to the
    /// model; with `accumulate`, adds `dx` into it (one rounding) and returns `None`, else returns `dx`.
    pub fn backward_ref(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
        dy: &Tensor<T>,
        accumulate: Option<&mut Tensor<T>>,
    ) -> InputGrad<T> {
        let spec = self.spec(x.shape())?;
        self.check_size("output gradient", dy.shape(), x.shape())?;
        let stats = take_saved(&mut self.stats, &self.name)?;
        let (w, _) = self.params_in(ctx)?;
        let dev = ctx.device().clone();
        let mut dw = dev.uninit::<f32>(self.d)?;
        let mut db = if self.has_bias {
            Some(dev.uninit::<f32>(self.d)?)
        } else {
            None
        };
        let mut fresh = None;
        let (dx, dx_mode) = match accumulate {
            Some(acc) => {
                self.check_size("accumulating into a gradient", acc.shape(), x.shape())?;
                (acc.data_mut(), GradMode::Accumulate)
            }
            None => (
                fresh
                    .insert(Tensor::<T>::uninit(&dev, x.shape())?)
                    .data_mut(),
                GradMode::Overwrite,
            ),
        };
        norm_backward(
            &spec,
            x.data(),
            &w,
            &stats,
            dy.data(),
            NormGrads {
                dx,
                dx_mode,
                dweight: &mut dw,
                dbias: db.as_mut(),
                param_mode: GradMode::Overwrite,
            },
        )?;
        ctx.add_grad(self.weight, &dw)?;
        if let Some(db) = db {
            ctx.add_grad(self.bias, &db)?;
        }
        Ok(fresh)
    }
}

impl<T: Activation> Module for Norm<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        self.name = v.path().module();
        let d = self.d;
        let ones = move || vec![1.0f32; d];
        v.param(
            "weight",
            &ParamDecl::new(&[d], ParamKind::Plain, &ones),
            &mut self.weight,
        )?;
        if self.has_bias {
            let zeros = move || vec![0.0f32; d];
            v.param(
                "bias",
                &ParamDecl::new(&[d], ParamKind::Plain, &zeros),
                &mut self.bias,
            )?;
        }
        Ok(())
    }
}

impl<T: Activation> Layer<T> for Norm<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let y = self.forward_ref(ctx, &x)?;
        self.x = ctx.is_training().then_some(x);
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let x = take_saved(&mut self.x, &self.name)?;
        let dx = self.backward_ref(ctx, &x, &dy, None)?;
        Ok(if need_dx { dx } else { None })
    }

    fn forget_saved(&mut self) {
        self.stats = None;
        self.x = None;
    }
}
