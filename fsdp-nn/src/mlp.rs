//! The transformer MLP `Linear(d -> 4d) -> GELU -> Linear(4d -> d)` without biases ([`Mlp`]), its
//! SwiGLU variant (Llama's `down(silu(gate(x)) * up(x))`, the gate and up projections fused into one
//! `d -> 2 hidden` linear, [`MlpActivation::SwiGlu`]), and the residual block `x + Mlp(x)` ([`MlpBlock`]).
//!
//! SwiGLU in FP8 is fused the same way as the GELU (`fp8_kernels::swiglu_cast`): the forward writes the
//! down linear's E4M3 input from `[gate | up]`, the backward the fused linear's E5M2 output gradient
//! `[dgate | dup]` from `[gate | up]` and the down linear's input gradient.
//!
//! In FP8 the GELU is fused with the FP8 casts around it (`fp8_kernels::fused`): the forward writes the
//! down linear's E4M3 input codes (and their transpose) straight from the pre-activation `u`, and the
//! backward writes the up linear's E5M2 output-gradient codes straight from `u` and the down linear's
//! input gradient; the GELU output and its gradient never exist. Bit-identical to the unfused path.
//! With [`Mlp::recompute_gelu`] (the default) the down linear's E4M3 input is not kept between the
//! passes: the backward recasts it from the kept `u` with the same scale (the metas change only at the
//! step end), so the codes and the training are identical, for one GELU + cast pass instead of
//! `tokens * 4d` bytes per block.

use crate::activation::Gelu;
use crate::layer::{take_saved, Activation, InputGrad, Layer};
use crate::linear::{Linear, LinearPrecision, WeightInit};
use crate::{NnError, Tensor};
use fp8_kernels::block_quantize::BlockCastInput;
use fp8_kernels::elementwise::{self, GeluApprox};
use fp8_kernels::gelu_cast::{gelu_backward_cast_fp8, gelu_cast_fp8};
use fp8_kernels::swiglu_cast::{
    swiglu_backward, swiglu_backward_cast_fp8, swiglu_cast_fp8, swiglu_forward, SwigluCodes,
};
use fp8_kernels::Buffer;
use fsdp_shard::{Ctx, Module, ShardError, Visitor};

/// The MLP's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlpActivation {
    /// `down(gelu(up(x)))` (GPT-2; the erf GELU), `up: d -> hidden`.
    #[default]
    Gelu,
    /// `down(silu(gate) * up)` with `[gate | up] = gate_up(x)`, `gate_up: d -> 2 hidden` (Llama).
    SwiGlu,
}

/// `down(gelu(up(x)))`, `up: d -> hidden`, `down: hidden -> d`, no biases; parameters `c_fc.weight` and
/// `c_proj.weight` under the module's path (names chosen by [`Mlp::with_names`]).
#[derive(Debug)]
pub struct Mlp<T: Activation = f32> {
    activation: MlpActivation,
    hidden: usize,
    up: Linear<T>,
    down: Linear<T>,
    names: [String; 2],
    gelu: Gelu<T>,
    /// Fuse the GELU with the FP8 casts when both linears are FP8.
    fuse_gelu: bool,
    /// Recast the down linear's input in the backward when fused.
    recompute_gelu: bool,
    /// The pre-activation `up(x)`, kept for the backward.
    u: Option<Tensor<T>>,
    /// Keep `u` after a fused training forward (the default); off, the backward waits for
    /// [`Mlp::restore_up_output`].
    keep_up_output: bool,
    /// The shape of the `u` a fused training forward dropped, until it is restored.
    dropped_u: Option<crate::Shape>,
}

impl<T: Activation> Mlp<T> {
    /// An MLP `d -> hidden -> d` in the activations' float precision (see [`crate::convert_to_fp8`];
    /// in FP8 the GELU is fused with the casts and recomputed by default), weights initialised by
    /// PyTorch's default (unless [`Mlp::with_init`]) from their own seeds.
    pub fn new(d: usize, hidden: usize) -> Result<Self, NnError> {
        Self::with_activation(d, hidden, MlpActivation::Gelu)
    }

    /// An MLP `d -> hidden -> d` with `activation` (SwiGLU: the fused gate/up linear is `d -> 2 hidden`,
    /// default names `gate_up_proj` and `down_proj`).
    pub fn with_activation(
        d: usize,
        hidden: usize,
        activation: MlpActivation,
    ) -> Result<Self, NnError> {
        let (up_out, names) = match activation {
            MlpActivation::Gelu => (hidden, ["c_fc", "c_proj"]),
            MlpActivation::SwiGlu => (
                hidden
                    .checked_mul(2)
                    .ok_or_else(|| NnError::usage("Mlp", "hidden width overflows"))?,
                ["gate_up_proj", "down_proj"],
            ),
        };
        Ok(Mlp {
            activation,
            hidden,
            up: Linear::new(d, up_out)?.without_bias(),
            down: Linear::new(hidden, d)?.without_bias(),
            names: names.map(String::from),
            gelu: Gelu::with_approx(GeluApprox::Erf),
            fuse_gelu: true,
            recompute_gelu: true,
            u: None,
            keep_up_output: true,
            dropped_u: None,
        })
    }

    /// Both linears in `precision`.
    pub fn with_precision(self, precision: LinearPrecision) -> Result<Self, NnError> {
        self.with_precisions([precision; 2])
    }

    /// The up and down linears in their own precisions (e.g. only the larger GEMM in FP8). The GELU is
    /// fused with the FP8 casts only when both are FP8.
    pub fn with_precisions(mut self, precisions: [LinearPrecision; 2]) -> Result<Self, NnError> {
        self.up.set_precision(precisions[0])?;
        self.down.set_precision(precisions[1])?;
        Ok(self)
    }

    /// With weights drawn from `seed` (up) and a stream derived from it (down) instead of their own
    /// seeds.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.up = self.up.with_seed(seed);
        self.down = self.down.with_seed(seed ^ 0xD0);
        self
    }

    /// The nonlinearity.
    pub fn activation(&self) -> MlpActivation {
        self.activation
    }

    /// The two linears' names (default `c_fc`, `c_proj`; SwiGLU `gate_up_proj`, `down_proj`).
    pub fn with_names(mut self, up: &str, down: &str) -> Self {
        self.names = [up.to_string(), down.to_string()];
        self
    }

    /// Initialisations of the up and down weights.
    pub fn with_init(mut self, up: WeightInit, down: WeightInit) -> Self {
        self.up = self.up.with_init(up);
        self.down = self.down.with_init(down);
        self
    }

    /// FP8 only: GELU fused with the casts (default on). Off: GELU, then the linears' own casts.
    pub fn fused(mut self, on: bool) -> Self {
        self.fuse_gelu = on;
        self
    }

    /// FP8 only: recast the down linear's input in the backward instead of keeping it (default on).
    pub fn recompute_gelu(mut self, on: bool) -> Self {
        self.recompute_gelu = on;
        self
    }

    /// Whether a fused training forward keeps the up linear's output `u` (`[gate | up]` for SwiGLU) for
    /// the backward (`true`, the default). Off, the forward drops it and the backward needs
    /// [`Mlp::restore_up_output`] first: the up GEMM once more from the up linear's E4M3 input codes, the
    /// same product of the same codes, weights and scales, so the same `u` bit for bit. For a caller
    /// that can write those codes again without keeping them (a [`crate::TransformerBlock`] whose norm
    /// writes them, [`crate::Norm::restore_linear_input`]): it trades one FP8 GEMM of `2 tokens d
    /// up_out` flops in the backward for `tokens * up_out` activations held between the passes. Only
    /// the fused path drops `u` (both linears per-tensor FP8, fusion on).
    pub fn set_keep_up_output(&mut self, keep: bool) {
        self.keep_up_output = keep;
    }

    /// Whether the last training forward dropped `u` and the backward waits for
    /// [`Mlp::restore_up_output`].
    pub fn awaits_up_output(&self) -> bool {
        self.dropped_u.is_some()
    }

    /// Recomputes the `u` a fused training forward dropped ([`Mlp::set_keep_up_output`]) from `x_q`,
    /// the up linear's E4M3 input codes (`[tokens, d]`, the forward's, at the forward's scale, which
    /// the up linear's restored input holds: [`Linear::restore_fp8_input_with`]). Errors when nothing
    /// was dropped.
    pub fn restore_up_output(
        &mut self,
        ctx: &mut Ctx<'_>,
        x_q: &Buffer<u8>,
    ) -> Result<(), NnError> {
        let shape = self.dropped_u.ok_or_else(|| {
            NnError::usage(
                "Mlp",
                "restoring the up output without a training forward that dropped it",
            )
        })?;
        let u = self.up.forward_fp8_codes(ctx, x_q, shape)?;
        self.dropped_u = None;
        self.u = Some(u);
        Ok(())
    }

    /// Whether the activation runs fused with the per-tensor FP8 casts: both linears per-tensor FP8
    /// (decided when the model was converted) and fusion on. Block-scaled linears fuse it into their
    /// block casts instead ([`Mlp::fuses_block_casts`]).
    fn is_fused(&self) -> bool {
        self.fuse_gelu && self.up.takes_fp8_codes() && self.down.takes_fp8_codes()
    }

    /// Whether the activation runs inside a block-scaled down linear's casts (and its gradient inside a
    /// block-scaled up linear's): fusion on and the down linear block-scaled. Bit for bit the unfused
    /// path, which writes the activation and its gradient and casts them.
    fn fuses_block_casts(&self) -> bool {
        self.fuse_gelu && self.down.is_block_scaled()
    }

    /// Whether a fused forward recasts the down linear's input in the backward.
    fn recomputes(&self) -> bool {
        self.recompute_gelu && self.is_fused()
    }

    /// Whether the unfused path with a block-scaled down linear recomputes the activation in the
    /// backward and casts the down linear's weight-gradient operand from it there, instead of the
    /// linear keeping it from the forward (one byte per hidden element less per block, for one
    /// activation pass and one cast; the same codes, since the cast is a function of its input).
    fn recomputes_block_input(&self) -> bool {
        self.recompute_gelu && !self.is_fused() && self.down.is_block_scaled()
    }

    /// The up linear.
    pub fn up(&self) -> &Linear<T> {
        &self.up
    }

    /// The down linear.
    pub fn down(&self) -> &Linear<T> {
        &self.down
    }

    /// The up linear, mutable: a producer of its input (a norm writing its FP8 input,
    /// `Norm::forward_linear`) runs it, then [`Mlp::forward_after_up`] finishes the branch.
    pub fn up_mut(&mut self) -> &mut Linear<T> {
        &mut self.up
    }

    /// Bytes kept for the backward.
    pub fn saved_bytes(&self) -> usize {
        self.up.saved_bytes()
            + self.down.saved_bytes()
            + self.u.as_ref().map_or(0, |u| u.data().num_bytes())
            + self.gelu.saved_input().map_or(0, |u| u.data().num_bytes())
    }

    /// Writes the down linear's E4M3 input, `act(u)` cast with its input meta: its `x^T` into the down
    /// linear's saved input when `transposed`, and returns the row-major codes when `row_major` (the
    /// forward needs the codes, and `x^T` only when the backward does not recast it; the recast needs
    /// `x^T` alone).
    fn cast_down_input(
        &mut self,
        ctx: &mut Ctx<'_>,
        u: &Tensor<T>,
        row_major: bool,
        transposed: bool,
    ) -> Result<Option<fp8_kernels::Buffer<u8>>, NnError> {
        let dev = ctx.device().clone();
        let tokens = u.shape().rows();
        let hidden = self.down.in_features();
        let activation = self.activation;
        let mut x_q = if row_major {
            Some(dev.uninit::<u8>(tokens * hidden)?)
        } else {
            None
        };
        let meta = self.down.input_meta();
        let saved = self.down.fp8_input_for(&dev, tokens, transposed)?;
        let s = ctx.scaling(meta)?;
        match activation {
            MlpActivation::Gelu => gelu_cast_fp8(
                u.data(),
                [tokens, hidden],
                GeluApprox::Erf,
                s.state.format()?,
                s.state.scale(),
                x_q.as_mut(),
                transposed.then_some(&mut saved.x_t),
                s.amax,
            )?,
            MlpActivation::SwiGlu => swiglu_cast_fp8(
                u.data(),
                [tokens, hidden],
                SwigluCodes {
                    format: s.state.format()?,
                    scale: s.state.scale(),
                    codes: x_q.as_mut(),
                    codes_t: transposed.then_some(&mut saved.x_t),
                    amax: s.amax,
                },
            )?,
        }
        saved.x_scale_inv.copy_from(s.state.scale_inv())?;
        Ok(x_q)
    }

    /// The activation of `u` as the input of a block-scaled cast (computed inside the cast).
    fn activation_input<'a>(&self, u: &'a Tensor<T>) -> BlockCastInput<'a, T> {
        match self.activation {
            MlpActivation::Gelu => BlockCastInput::Gelu {
                u: u.data(),
                approx: self.gelu.approx(),
            },
            MlpActivation::SwiGlu => BlockCastInput::SwiGlu { gu: u.data() },
        }
    }

    /// The backward of a block-scaled down linear, whose forward cast the activation of the saved `u`
    /// without writing it: the down linear's weight-gradient operand recast from `u` when the forward
    /// left it, then the activation's gradient straight into a block-scaled up linear's casts (or
    /// written, for an up linear of another kind).
    fn backward_block(&mut self, ctx: &mut Ctx<'_>, dy: &Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let u = take_saved(&mut self.u, "Mlp")?;
        let h_shape = u.shape().with_last(self.hidden)?;
        if self.recomputes_block_input() {
            self.down
                .save_block_input_from(ctx, self.activation_input(&u), h_shape)?;
        }
        let da = self
            .down
            .backward_ref(ctx, dy, true)?
            .ok_or_else(|| NnError::usage("Mlp", "the down linear returned no input gradient"))?;
        let grad = match self.activation {
            MlpActivation::Gelu => BlockCastInput::GeluGrad {
                u: u.data(),
                dy: da.data(),
                approx: self.gelu.approx(),
            },
            MlpActivation::SwiGlu => BlockCastInput::SwiGluGrad {
                gu: u.data(),
                dh: da.data(),
            },
        };
        if self.up.is_block_scaled() {
            return self.up.backward_from(ctx, grad, u.shape().numel(), need_dx);
        }
        let du = grad
            .values_on(ctx.device(), [u.shape().rows(), u.shape().last()])?
            .ok_or_else(|| NnError::usage("Mlp", "the activation's gradient has no values"))?;
        self.up
            .backward_step(ctx, Tensor::new(du, u.shape())?, need_dx)
    }

    /// `silu(gate) * up` from `u = [gate | up]`, in the activation type.
    fn swiglu(&self, ctx: &Ctx<'_>, u: &Tensor<T>) -> Result<Tensor<T>, NnError> {
        let tokens = u.shape().rows();
        let mut h = Tensor::<T>::uninit(ctx.device(), u.shape().with_last(self.hidden)?)?;
        swiglu_forward(u.data(), [tokens, self.hidden], h.data_mut())?;
        Ok(h)
    }

    /// The branch `down(act(up(x)))` from a borrowed `x`.
    pub fn forward_ref(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<T>) -> Result<Tensor<T>, NnError> {
        let u = self.up.forward_ref(ctx, x)?;
        self.forward_after_up(ctx, u)
    }

    /// The rest of the branch, `down(gelu(u))`, from the up linear's output `u` (after the up linear ran
    /// its forward, e.g. fed by [`Mlp::up_mut`]'s producer).
    pub fn forward_after_up(
        &mut self,
        ctx: &mut Ctx<'_>,
        u: Tensor<T>,
    ) -> Result<Tensor<T>, NnError> {
        self.dropped_u = None;
        let y = if self.is_fused() {
            // x^T only for a backward that reads it as written now.
            let transposed = ctx.is_training() && !self.recomputes();
            let x_q = self
                .cast_down_input(ctx, &u, true, transposed)?
                .ok_or_else(|| {
                    NnError::usage("Mlp", "the down linear's input codes are missing")
                })?;
            let out = u.shape().with_last(self.down.out_features())?;
            let y = self.down.forward_fp8_codes(ctx, &x_q, out)?;
            if self.recomputes() || !ctx.is_training() {
                self.down.drop_saved();
            }
            if ctx.is_training() && !self.keep_up_output {
                self.dropped_u = Some(u.shape());
                return Ok(y);
            }
            y
        } else if self.fuses_block_casts() {
            // The activation goes straight into the down linear's block casts: never written (bit
            // for bit the casts of its output); u stays for the backward.
            let h_shape = u.shape().with_last(self.hidden)?;
            self.down
                .set_keep_block_input(!self.recomputes_block_input());
            let y = self
                .down
                .forward_from(ctx, self.activation_input(&u), h_shape)?;
            if !ctx.is_training() {
                self.down.drop_saved();
                self.up.drop_saved();
            }
            self.u = ctx.is_training().then_some(u);
            return Ok(y);
        } else if self.activation == MlpActivation::SwiGlu {
            let h = self.swiglu(ctx, &u)?;
            self.down
                .set_keep_block_input(!self.recomputes_block_input());
            let y = self.down.forward(ctx, h)?;
            if !ctx.is_training() {
                self.down.drop_saved();
                self.up.drop_saved();
            }
            self.u = ctx.is_training().then_some(u);
            return Ok(y);
        } else {
            // The GELU keeps its input (u) for the backward itself.
            let a = self.gelu.forward(ctx, u)?;
            self.down
                .set_keep_block_input(!self.recomputes_block_input());
            let y = self.down.forward(ctx, a)?;
            if !ctx.is_training() {
                self.down.drop_saved();
                self.up.drop_saved();
            }
            return Ok(y);
        };
        if !ctx.is_training() {
            self.up.drop_saved();
        }
        self.u = ctx.is_training().then_some(u);
        Ok(y)
    }

    /// The branch's input gradient from a borrowed output gradient; adds the weights' gradients.
    pub fn backward_ref(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: &Tensor<T>,
        need_dx: bool,
    ) -> InputGrad<T> {
        if self.fuses_block_casts() {
            return self.backward_block(ctx, dy, need_dx);
        }
        if !self.is_fused() {
            if self.recomputes_block_input() {
                let h = match self.activation {
                    MlpActivation::Gelu => {
                        let u = self.gelu.saved_input().ok_or_else(|| {
                            NnError::usage("Mlp", "backward before a training forward")
                        })?;
                        let mut a = Tensor::<T>::uninit(ctx.device(), u.shape())?;
                        elementwise::gelu_forward(u.data(), a.data_mut(), self.gelu.approx())?;
                        a
                    }
                    MlpActivation::SwiGlu => {
                        let u = self.u.as_ref().ok_or_else(|| {
                            NnError::usage("Mlp", "backward before a training forward")
                        })?;
                        self.swiglu(ctx, u)?
                    }
                };
                self.down.save_block_input(ctx, &h)?;
            }
            // From the borrowed `dy`: an FP8 down linear casts it without a copy.
            let da = self.down.backward_ref(ctx, dy, true)?.ok_or_else(|| {
                NnError::usage("Mlp", "the down linear returned no input gradient")
            })?;
            let du = match self.activation {
                MlpActivation::Gelu => self.gelu.backward(ctx, da)?,
                MlpActivation::SwiGlu => {
                    let u = take_saved(&mut self.u, "Mlp")?;
                    let mut du = Tensor::<T>::uninit(ctx.device(), u.shape())?;
                    swiglu_backward(
                        u.data(),
                        da.data(),
                        [u.shape().rows(), self.hidden],
                        du.data_mut(),
                    )?;
                    du
                }
            };
            return self.up.backward_step(ctx, du, need_dx);
        }
        if self.dropped_u.is_some() {
            return Err(NnError::usage(
                "Mlp",
                "the forward dropped the up output: restore_up_output comes before the backward",
            ));
        }
        let u = take_saved(&mut self.u, "Mlp")?;
        if self.recomputes() {
            // The same scale as in the forward (metas change at the step end): the same codes.
            self.cast_down_input(ctx, &u, false, true)?;
        }
        let da = self
            .down
            .backward_ref(ctx, dy, true)?
            .ok_or_else(|| NnError::usage("Mlp", "no gradient from the down linear"))?;
        let dev = ctx.device().clone();
        let tokens = u.shape().rows();
        let up_out = self.up.out_features();
        let (mut dq, mut dt): (Buffer<u8>, Buffer<u8>) = (
            dev.uninit::<u8>(tokens * up_out)?,
            dev.uninit::<u8>(tokens * up_out)?,
        );
        {
            let s = ctx.scaling(self.up.grad_meta())?;
            match self.activation {
                MlpActivation::Gelu => gelu_backward_cast_fp8(
                    u.data(),
                    da.data(),
                    [tokens, up_out],
                    GeluApprox::Erf,
                    s.state.format()?,
                    s.state.scale(),
                    Some(&mut dq),
                    Some(&mut dt),
                    s.amax,
                )?,
                MlpActivation::SwiGlu => swiglu_backward_cast_fp8(
                    u.data(),
                    da.data(),
                    [tokens, self.hidden],
                    SwigluCodes {
                        format: s.state.format()?,
                        scale: s.state.scale(),
                        codes: Some(&mut dq),
                        codes_t: Some(&mut dt),
                        amax: s.amax,
                    },
                )?,
            }
        }
        drop(da);
        let in_shape = u.shape().with_last(self.up.in_features())?;
        drop(u);
        if self.recomputes() {
            self.down.drop_saved();
        }
        self.up.backward_fp8_codes(ctx, &dq, &dt, in_shape, need_dx)
    }
}

impl<T: Activation> Module for Mlp<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child(&self.names[0], &mut self.up)?;
        v.child(&self.names[1], &mut self.down)
    }
}

impl<T: Activation> Layer<T> for Mlp<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        self.forward_ref(ctx, &x)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        self.backward_ref(ctx, &dy, need_dx)
    }

    fn forget_saved(&mut self) {
        self.u = None;
        self.dropped_u = None;
        self.up.drop_saved();
        self.down.drop_saved();
        self.gelu.forget_saved();
    }
}

/// The residual MLP block `x + Mlp(x)`; its parameters are the MLP's under `mlp`.
#[derive(Debug)]
pub struct MlpBlock<T: Activation = f32> {
    mlp: Mlp<T>,
}

impl<T: Activation> MlpBlock<T> {
    /// A block around `mlp`.
    pub fn new(mlp: Mlp<T>) -> Self {
        MlpBlock { mlp }
    }

    /// The MLP.
    pub fn mlp(&self) -> &Mlp<T> {
        &self.mlp
    }
}

impl<T: Activation> Module for MlpBlock<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("mlp", &mut self.mlp)
    }
}

impl<T: Activation> Layer<T> for MlpBlock<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let mut y = self.mlp.forward_ref(ctx, &x)?;
        // y = branch + x, in place (one rounding, as x + branch).
        elementwise::axpy(1.0, x.data(), y.data_mut())?;
        Ok(y)
    }

    fn backward_step(
        &mut self,
        ctx: &mut Ctx<'_>,
        mut dy: Tensor<T>,
        need_dx: bool,
    ) -> InputGrad<T> {
        let branch = self.mlp.backward_ref(ctx, &dy, need_dx)?;
        if !need_dx {
            return Ok(None);
        }
        let branch =
            branch.ok_or_else(|| NnError::usage("MlpBlock", "no gradient from the MLP"))?;
        // dx = dy + d(branch)/dx, in place.
        elementwise::axpy(1.0, branch.data(), dy.data_mut())?;
        Ok(Some(dy))
    }

    fn forget_saved(&mut self) {
        self.mlp.forget_saved();
    }
}
