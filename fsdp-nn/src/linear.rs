//! Fully connected layer `y = x W^T (+ b)` in FP8 (per-tensor or block-scaled), BF16 or F32.
//!
//! One file (over 800 lines) on purpose: the three precisions share the layer's state and saved
//! tensors, and each forward sits beside its backward so the pair can be read together.
//!
//! # FP8 recipe (E4M3 forward, E5M2 gradients, f32 accumulation)
//! - forward: `x` is cast to E4M3 with the input meta's scale (delayed scaling by default: the scale
//!   comes from the amax history; the cast records this step's amax in the meta's pending slot), which
//!   also writes `x^T` in E4M3, all the backward keeps of `x` (one byte per element). The weight arrives
//!   from the all-gather in E4M3 with its scale (current scaling, set by the optimizer). `y = x_q W_q^T`
//!   is one FP8 GEMM reading both inverse scales from device pointers.
//! - backward: `dy` is cast to E5M2 (both layouts) with the output-gradient meta; `dx = dy_q W_q` and
//!   `dW = dy_q^T x_q`, f32 accumulation; `dW` is written in BF16 when the model keeps BF16 gradient
//!   shards (the shard rounds to BF16 anyway), else in f32.
//! - the metas are the model's ([`fsdp_shard::ScalingRegistry`]): once per optimizer step their pending
//!   amaxes are agreed across ranks in the optimizer's single all-reduce and the scales recomputed.
//!
//! Bias: `y` is set to the broadcast bias, then the GEMM accumulates into it (`beta = 1`); the bias
//! gradient is the column sum of `dy` in a fixed order (`reduce::sum_over_rows`).
//!
//! A fused producer (LayerNorm or GELU fused with the E4M3 cast) can write the layer's FP8 input itself:
//! [`Linear::fp8_input`] hands out the buffers and [`Linear::forward_fp8_codes`] runs the GEMM.
//!
//! # Block-scaled FP8 (DeepSeek-V3's recipe, `Fp8Recipe::block_scaled`)
//! With a recipe whose [`Fp8Recipe::blocks`] are 1x128 tiles for activations and gradients and 128x128
//! blocks for weights ([`BlockScaling`]), an FP8 layer scales every tile by its own amax as it casts, so
//! no scale is agreed across ranks and no meta exists (the layer declares none: it adds nothing to the
//! optimizer's amax all-reduce). The weight is a [`ParamKind::Fp8BlockWeight`]: the sharded model
//! quantizes it per 128x128 block (power-of-two scales) and all-gathers codes and block scales. The
//! three products, each one `fp8_kernels::gemm::gemm_fp8_block` with f32 accumulation (every cast by
//! `block_quantize`, scales in `ScaleOrder::Gemm`):
//!
//! | product | A | B |
//! | --- | --- | --- |
//! | `y = x W^T` | `x`, 1x128 tiles (`Rows1x128`, input format) | `W` as gathered, 128x128, `trans_b = Yes` |
//! | `dx = dy W` | `dy`, 1x128 tiles (`Rows1x128`, gradient format) | `W` as gathered, read transposed (`trans_b = No`) |
//! | `dW = dy^T x` | `dy^T`, 128x1 tiles of `dy` (`Columns128x1Transposed`) | `x^T`, 128x1 tiles of `x` (`Columns128x1Transposed`) |
//!
//! The formats are the recipe's ([`fp8_core::Fp8Formats`]): E4M3 for everything in DeepSeek-V3's. The
//! forward casts `x` twice: in 1x128 tiles for its GEMM, and, when training, in 128x1 tiles transposed,
//! which is all the backward keeps of `x` ([`BlockFp8Saved`]: one byte per element and one f32 per 128,
//! against two or four bytes for keeping `x`). The backward casts `dy` both ways (the 1x128 cast only
//! when `dx` is wanted). `dW` is written in BF16 when the model keeps BF16 gradient shards, else f32;
//! the bias as above. The token count is padded to a multiple of 16 with zero rows (exact: they add
//! nothing); the feature sides must be multiples of 16 ([`block_scalable`]; `crate::convert_to_fp8`
//! leaves other linears in float precision). Fused producers do not feed a block-scaled layer
//! ([`Linear::takes_fp8_codes`] is false): they write their float output and the layer casts it; fusing
//! the 1x128 cast into the norm, GELU and SwiGLU kernels is later work.

use crate::init::{kaiming_uniform, normal, uniform_fan_in};
use crate::layer::{rows_of_width, Activation, InputGrad, Layer};
use crate::plain_param::{plain_in, plain_param};
use crate::retype::buffer_converted;
use crate::{NnError, Shape, Tensor};
use fp8_core::{Fp8Format, Fp8Recipe, QType, ScaleRounding, ScalingRecipe};
use fp8_kernels::block_quantize::BlockCastInput;
use fp8_kernels::gemm::{gemm, gemm_at, gemm_fp8, gemm_fp8_at};
use fp8_kernels::{
    cast_to_fp8, cast_transpose_to_fp8, Buffer, DType, Device, DeviceScalar, Fp8Matrix, GemmOutput,
    GemmSpec, Transpose,
};
use fp8_kernels::{elementwise, reduce};
use fsdp_shard::{
    Ctx, GatheredParam, Module, ParamDecl, ParamId, ParamKind, PlainParam, ScalingDecl, ScalingId,
    ShardError, Visitor,
};
use half::bf16;

mod block_fp8;

/// The arithmetic of a [`Linear`] layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LinearPrecision {
    /// FP8: input and weight E4M3, output gradient E5M2, f32 accumulation. The weight is an FP8 parameter
    /// of the sharded model (gathered as E4M3 with the scale the optimizer set).
    #[default]
    Fp8,
    /// BF16 operands (weight and activations rounded to bf16), f32 accumulation.
    Bf16,
    /// F32 throughout.
    F32,
}

impl LinearPrecision {
    /// The float precision of activations `T`: F32 for `f32`, BF16 otherwise.
    pub fn float_for<T: Activation>() -> Self {
        if T::DTYPE == DType::F32 {
            LinearPrecision::F32
        } else {
            LinearPrecision::Bf16
        }
    }

    /// The kind of the weight parameter of a per-tensor layer: FP8 weights travel as E4M3, the others
    /// as F32 (a block-scaled FP8 layer's weight is [`ParamKind::Fp8BlockWeight`]:
    /// [`Linear::weight_kind`] says which a layer declares).
    pub fn weight_kind(self) -> ParamKind {
        match self {
            LinearPrecision::Fp8 => ParamKind::Fp8Weight,
            LinearPrecision::Bf16 | LinearPrecision::F32 => ParamKind::Plain,
        }
    }

    /// `"fp8"`, `"bf16"` or `"f32"`.
    pub fn name(self) -> &'static str {
        match self {
            LinearPrecision::Fp8 => "fp8",
            LinearPrecision::Bf16 => "bf16",
            LinearPrecision::F32 => "f32",
        }
    }
}

/// How a layer's weight starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightInit {
    /// PyTorch's default for `nn.Linear`/`nn.Conv2d`: `kaiming_uniform_(a = sqrt(5))`, bias uniform in
    /// `±1/sqrt(fan_in)`.
    PyTorchDefault,
    /// `N(0, std^2)` (GPT-2's initialisation); a bias starts at zero.
    Normal(f64),
}

/// What the FP8 forward keeps for the backward: `x^T` in E4M3 and the inverse scale it was cast with.
#[derive(Debug)]
pub struct Fp8Saved {
    /// Rows of `x`.
    pub tokens: usize,
    /// `x^T`, E4M3 codes `[in, tokens]`.
    pub x_t: Buffer<u8>,
    /// The inverse scale `x` was cast with (one element; the meta may change before the backward).
    pub x_scale_inv: Buffer<f32>,
}

/// What a per-tensor FP8 forward that keeps no `x^T` remembers in order to cast it again for the
/// backward ([`Linear::set_keep_fp8_input`]): the rows, the format and the scale it cast `x` with.
#[derive(Debug)]
struct Fp8Recast {
    tokens: usize,
    format: Fp8Format,
    x_scale: Buffer<f32>,
    x_scale_inv: Buffer<f32>,
}

/// How a block-scaled FP8 linear quantizes its operands, from an [`Fp8Recipe`] whose
/// [`Fp8Recipe::blocks`] are DeepSeek-V3's ([`fp8_core::BlockRecipe::deepseek_v3`]: 1x128 tiles of the
/// input and output gradient, 128x128 blocks of the weight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockScaling {
    /// Rounding of the tile scales (power of two or exact; the weight's block scales are the sharded
    /// model's, power of two).
    pub rounding: ScaleRounding,
    /// Format of the input codes ([`fp8_core::Fp8Formats::forward`]: E4M3).
    pub input_format: Fp8Format,
    /// Format of the output-gradient codes ([`fp8_core::Fp8Formats::backward`]: E4M3 in DeepSeek-V3's
    /// recipe, E5M2 with the hybrid formats).
    pub grad_format: Fp8Format,
}

impl BlockScaling {
    /// The block scaling `recipe` asks for: `None` for a per-tensor recipe, an error for a recipe that
    /// is invalid or block-scales only some operands (the block-scaled GEMM multiplies block-scaled
    /// operands only: a linear is per tensor or block-scaled throughout).
    pub fn of_recipe(recipe: &Fp8Recipe) -> Result<Option<Self>, NnError> {
        recipe
            .validate()
            .map_err(|e| NnError::usage("Linear", e.to_string()))?;
        let b = recipe.blocks;
        if b.is_per_tensor() {
            return Ok(None);
        }
        if b != fp8_core::BlockRecipe::deepseek_v3(b.rounding) {
            return Err(NnError::usage(
                "Linear",
                format!(
                    "an FP8 linear is per tensor or block-scaled throughout (1x128 input and \
                     gradient tiles, 128x128 weight blocks), not activations {}, gradients {}, \
                     weights {}",
                    b.activations, b.gradients, b.weights
                ),
            ));
        }
        Ok(Some(BlockScaling {
            rounding: b.rounding,
            input_format: recipe.formats.forward(),
            grad_format: recipe.formats.backward(),
        }))
    }
}

/// Whether a linear `in_features -> out_features` can compute block-scaled: both sides multiples of
/// 16, the block-scaled GEMM's rule ([`fp8_kernels::gemm::FP8_DIM_MULTIPLE`]; the token count is padded
/// by the layer).
pub fn block_scalable(in_features: usize, out_features: usize) -> bool {
    let m = fp8_kernels::gemm::FP8_DIM_MULTIPLE;
    in_features > 0 && out_features > 0 && in_features % m == 0 && out_features % m == 0
}

/// What the block-scaled FP8 forward keeps for the backward: `x^T` cast in 1x128 tiles of the transpose
/// (128 tokens x 1 feature of `x`: `BlockQuantLayout::Columns128x1Transposed`), the weight-gradient
/// GEMM's operand, one byte per element plus one f32 per 128 (`x` itself is not kept).
#[derive(Debug)]
pub struct BlockFp8Saved {
    /// Rows of `x`.
    pub tokens: usize,
    /// Rows the GEMMs ran on: `tokens` rounded up to a multiple of 16 with zero rows.
    pub padded_tokens: usize,
    /// `x^T` codes `[in, padded_tokens]` (the input format of the recipe).
    pub x_t: Buffer<u8>,
    /// Their inverse scales: one per 1x128 tile of `[in, padded_tokens]`, in `ScaleOrder::Gemm`.
    pub x_t_scale_inv: Buffer<f32>,
}

/// `y = x W^T (+ b)` with `x [tokens, in]` (any leading shape), `W [out, in]` (`<path>.weight`),
/// `b [out]` (`<path>.bias`, F32), `y [tokens, out]` in the activation type `T`.
#[derive(Debug)]
pub struct Linear<T: Activation = f32> {
    name: String,
    in_features: usize,
    out_features: usize,
    precision: LinearPrecision,
    has_bias: bool,
    /// An explicit seed; `None`: each parameter's own seed.
    seed: Option<u64>,
    init: WeightInit,
    input_recipe: ScalingRecipe,
    grad_recipe: ScalingRecipe,
    weight: ParamId,
    bias: ParamId,
    input_meta: ScalingId,
    grad_meta: ScalingId,
    /// The recipe's block scaling (used when the precision is FP8).
    block: Option<BlockScaling>,
    /// FP8: the saved `x^T` codes.
    fp8_saved: Option<Fp8Saved>,
    /// FP8: whether a training forward keeps `x^T` (true), or only what casting it again takes
    /// ([`Linear::set_keep_fp8_input`]).
    keep_fp8_input: bool,
    /// FP8 without a kept `x^T`: the scale to cast the input handed back with.
    fp8_recast: Option<Fp8Recast>,
    /// Block-scaled FP8: the saved `x^T` codes and tile scales.
    block_saved: Option<BlockFp8Saved>,
    /// Block-scaled FP8: whether a training forward casts and keeps `x^T` itself (true), or the caller
    /// hands it over before the backward ([`Linear::save_block_input`]).
    keep_block_input: bool,
    /// Block-scaled FP8: the last training forward kept no `x^T` (`keep_block_input` off) and the
    /// backward waits for [`Linear::save_block_input`].
    block_awaited: bool,
    /// F32: the input, kept for the weight gradient.
    x_saved: Option<Tensor<T>>,
    /// BF16: the input rounded to bf16, kept for the weight gradient.
    x_bf16: Option<Buffer<bf16>>,
    /// Shape of the last training input.
    in_shape: Option<Shape>,
    /// The bias in `T` when `T` is not f32.
    bias_t: Option<Buffer<T>>,
}

impl<T: Activation> Linear<T> {
    /// A layer `in_features -> out_features` with a bias, in the activations' float precision (F32 for
    /// `f32` activations, BF16 for `bf16`; [`crate::convert_to_fp8`] turns chosen linears of a built
    /// model into FP8), PyTorch's default initialisation drawn from the parameters' seeds (the model's
    /// seed and each parameter's name; [`Linear::with_seed`] fixes one instead), and the default FP8
    /// recipe ([`Fp8Recipe::default`]) should it compute in FP8.
    pub fn new(in_features: usize, out_features: usize) -> Result<Self, NnError> {
        if in_features == 0 || out_features == 0 {
            return Err(NnError::usage(
                "Linear",
                format!("features must be positive ({in_features} -> {out_features})"),
            ));
        }
        let recipe = Fp8Recipe::default();
        Ok(Linear {
            name: "Linear".into(),
            in_features,
            out_features,
            precision: LinearPrecision::float_for::<T>(),
            has_bias: true,
            seed: None,
            init: WeightInit::PyTorchDefault,
            input_recipe: recipe.activations,
            grad_recipe: recipe.gradients,
            weight: ParamId::UNSET,
            bias: ParamId::UNSET,
            input_meta: ScalingId::UNSET,
            grad_meta: ScalingId::UNSET,
            block: None,
            fp8_saved: None,
            keep_fp8_input: true,
            fp8_recast: None,
            block_saved: None,
            keep_block_input: true,
            block_awaited: false,
            x_saved: None,
            x_bf16: None,
            in_shape: None,
            bias_t: None,
        })
    }

    /// In another precision (an F32 linear needs `f32` activations).
    pub fn with_precision(mut self, precision: LinearPrecision) -> Result<Self, NnError> {
        self.set_precision(precision)?;
        Ok(self)
    }

    /// Changes the precision of a layer not yet wrapped by a sharded model (the FP8 conversion pass,
    /// [`crate::convert_to_fp8`]): the precision decides how the weight is stored and gathered, which is
    /// fixed once the model is wrapped.
    pub fn set_precision(&mut self, precision: LinearPrecision) -> Result<(), NnError> {
        if precision == LinearPrecision::F32 && T::DTYPE != DType::F32 {
            return Err(NnError::usage(
                &self.name,
                "an F32 linear needs f32 activations (use BF16 or FP8 with bf16 activations)",
            ));
        }
        if self.weight != ParamId::UNSET && precision != self.precision {
            return Err(NnError::usage(
                &self.name,
                "the precision of a linear is chosen before the model is wrapped (FsdpModel::new)",
            ));
        }
        self.precision = precision;
        Ok(())
    }

    /// With initial values drawn from `seed` (the weight from `seed`, the bias from a stream derived from
    /// it) instead of the parameters' own seeds.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Without a bias.
    pub fn without_bias(mut self) -> Self {
        self.has_bias = false;
        self
    }

    /// With another weight initialisation.
    pub fn with_init(mut self, init: WeightInit) -> Self {
        self.init = init;
        self
    }

    /// With the FP8 scaling of `recipe` (see [`Linear::set_fp8_recipe`]).
    pub fn with_fp8_recipe(mut self, recipe: &Fp8Recipe) -> Result<Self, NnError> {
        self.set_fp8_recipe(recipe)?;
        Ok(self)
    }

    /// Sets the FP8 scaling from `recipe` (before the model is wrapped): per tensor, the scaling of the
    /// input and output gradient (`recipe.activations`, `recipe.gradients`); with DeepSeek-V3's blocks
    /// (`Fp8Recipe::block_scaled`), block scaling ([`BlockScaling`]): the layer, once FP8, declares a
    /// block-scaled weight and no scaling metas (its sides must then be multiples of 16,
    /// [`block_scalable`]: checked when the model is wrapped). Errors for an invalid recipe, one that
    /// block-scales only some operands, and a change between per-tensor and block scaling after the
    /// model was wrapped (it decides how the weight is stored).
    pub fn set_fp8_recipe(&mut self, recipe: &Fp8Recipe) -> Result<(), NnError> {
        let block = BlockScaling::of_recipe(recipe).map_err(|e| self.renamed(e))?;
        if self.weight != ParamId::UNSET && block.is_some() != self.block.is_some() {
            return Err(NnError::usage(
                &self.name,
                "per-tensor or block scaling is chosen before the model is wrapped (FsdpModel::new)",
            ));
        }
        self.input_recipe = recipe.activations;
        self.grad_recipe = recipe.gradients;
        self.block = block;
        Ok(())
    }

    /// A usage error of the recipe check, named after this layer.
    fn renamed(&self, e: NnError) -> NnError {
        match e {
            NnError::Usage { detail, .. } => NnError::usage(&self.name, detail),
            other => other,
        }
    }

    /// With other scaling recipes for the FP8 input and output gradient (e.g. current scaling) of a
    /// per-tensor layer (a block-scaled layer scales each tile currently and has no use for them).
    pub fn with_recipes(mut self, input: ScalingRecipe, grad_output: ScalingRecipe) -> Self {
        self.input_recipe = input;
        self.grad_recipe = grad_output;
        self
    }

    /// The precision.
    pub fn precision(&self) -> LinearPrecision {
        self.precision
    }

    /// The block scaling of an FP8 layer with a block-scaled recipe; `None` for a per-tensor FP8 layer
    /// and a float one.
    pub fn block_scaling(&self) -> Option<BlockScaling> {
        self.block
            .filter(|_| self.precision == LinearPrecision::Fp8)
    }

    /// Whether the layer computes in block-scaled FP8.
    pub fn is_block_scaled(&self) -> bool {
        self.block_scaling().is_some()
    }

    /// Whether a fused producer may write this layer's input as per-tensor E4M3 codes
    /// ([`Linear::fp8_input`], [`Linear::forward_fp8_codes`]) and its output gradient's codes
    /// ([`Linear::backward_fp8_codes`]): a per-tensor FP8 layer. A block-scaled layer quantizes its
    /// float input itself, tile by tile, so producers hand it their float output.
    pub fn takes_fp8_codes(&self) -> bool {
        self.precision == LinearPrecision::Fp8 && self.block.is_none()
    }

    /// The kind of the weight parameter this layer declares: [`ParamKind::Fp8BlockWeight`] when
    /// block-scaled, else [`LinearPrecision::weight_kind`].
    pub fn weight_kind(&self) -> ParamKind {
        if self.is_block_scaled() {
            ParamKind::Fp8BlockWeight
        } else {
            self.precision.weight_kind()
        }
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The weight's id.
    pub fn weight_id(&self) -> ParamId {
        self.weight
    }

    /// The FP8 input's scaling meta (for a fused producer of the input codes; unset for a
    /// block-scaled layer, which has none).
    pub fn input_meta(&self) -> ScalingId {
        self.input_meta
    }

    /// The FP8 output gradient's scaling meta (for a fused producer of the gradient codes; unset for a
    /// block-scaled layer).
    pub fn grad_meta(&self) -> ScalingId {
        self.grad_meta
    }

    /// The recipes of the FP8 input and output gradient.
    pub fn recipes(&self) -> (ScalingRecipe, ScalingRecipe) {
        (self.input_recipe, self.grad_recipe)
    }

    /// Bytes kept for the backward.
    pub fn saved_bytes(&self) -> usize {
        self.fp8_saved
            .as_ref()
            .map_or(0, |s| s.x_t.num_bytes() + s.x_scale_inv.num_bytes())
            + self
                .block_saved
                .as_ref()
                .map_or(0, |s| s.x_t.num_bytes() + s.x_t_scale_inv.num_bytes())
            + self.x_saved.as_ref().map_or(0, |t| t.data().num_bytes())
            + self.x_bf16.as_ref().map_or(0, Buffer::num_bytes)
            + self
                .fp8_recast
                .as_ref()
                .map_or(0, |r| r.x_scale.num_bytes() + r.x_scale_inv.num_bytes())
    }

    /// Forgets what the forward kept (e.g. when a block recomputes its forward in the backward).
    pub fn drop_saved(&mut self) {
        self.fp8_saved = None;
        self.fp8_recast = None;
        self.block_saved = None;
        self.block_awaited = false;
        self.x_saved = None;
        self.x_bf16 = None;
    }

    /// Per-tensor FP8: whether a training forward keeps the E4M3 `x^T` its weight gradient needs (`true`,
    /// the default), or only the scale it cast `x` with, for a caller that keeps `x` itself (the
    /// attention keeps its output for its own backward) and hands it back with
    /// [`Linear::restore_fp8_input`] before the backward. The codes are cast again from the same values
    /// with the same scale and the same kernel: the same bits, and one byte per input element less held
    /// between the passes.
    pub fn set_keep_fp8_input(&mut self, keep: bool) {
        self.keep_fp8_input = keep;
    }

    /// Whether a training forward keeps the E4M3 `x^T` ([`Linear::set_keep_fp8_input`]).
    pub fn keeps_fp8_input(&self) -> bool {
        self.keep_fp8_input
    }

    /// Whether the last training forward kept no `x^T` and waits for [`Linear::restore_fp8_input`].
    pub fn awaits_fp8_input(&self) -> bool {
        self.fp8_recast.is_some()
    }

    /// Casts `x` (the values of the last training forward's input, in any float type) into the `x^T`
    /// the backward needs, with the scale that forward used, without recording an amax (the forward
    /// did). Errors if the forward kept `x^T` itself or `x` has another length.
    pub fn restore_fp8_input<E: fp8_kernels::FloatElement>(
        &mut self,
        x: &Buffer<E>,
    ) -> Result<(), NnError> {
        let shape = [
            self.fp8_recast.as_ref().map_or(0, |r| r.tokens),
            self.in_features,
        ];
        if self.fp8_recast.is_some() && x.len() != shape[0] * shape[1] {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "restore_fp8_input got {} elements for {} rows of {}",
                    x.len(),
                    shape[0],
                    shape[1]
                ),
            ));
        }
        self.restore_fp8_input_with(|format, scale, x_t| {
            Ok(cast_transpose_to_fp8(
                x, shape, format, scale, x_t, None, None,
            )?)
        })
    }

    /// [`Linear::restore_fp8_input`] for a fused producer that writes `x^T` itself (a norm that
    /// recomputes its output): `write(format, scale, x_t)` must fill the E4M3 codes of `x^T`
    /// (`[in, tokens]`) cast with `scale` and record no amax.
    pub fn restore_fp8_input_with(
        &mut self,
        write: impl FnOnce(Fp8Format, &Buffer<f32>, &mut Buffer<u8>) -> Result<(), NnError>,
    ) -> Result<(), NnError> {
        let r = self.fp8_recast.take().ok_or_else(|| {
            NnError::usage(
                &self.name,
                "restoring the FP8 input without a training forward that kept none",
            )
        })?;
        let mut x_t = r
            .x_scale
            .device()
            .uninit::<u8>(r.tokens * self.in_features)?;
        if let Err(e) = write(r.format, &r.x_scale, &mut x_t) {
            self.fp8_recast = Some(r);
            return Err(e);
        }
        self.fp8_saved = Some(Fp8Saved {
            tokens: r.tokens,
            x_t,
            x_scale_inv: r.x_scale_inv,
        });
        Ok(())
    }

    /// After a training forward that cast its input with `format` and `scale` (the input meta's): when
    /// the layer keeps no FP8 input ([`Linear::set_keep_fp8_input`]), frees `x^T` and keeps the scale
    /// to cast it again with. Nothing otherwise.
    pub(crate) fn release_fp8_input(
        &mut self,
        format: Fp8Format,
        scale: &Buffer<f32>,
    ) -> Result<(), NnError> {
        if self.keep_fp8_input {
            return Ok(());
        }
        if let Some(s) = self.fp8_saved.take() {
            let mut x_scale = scale.device().zeros::<f32>(1)?;
            x_scale.copy_from(scale)?;
            self.fp8_recast = Some(Fp8Recast {
                tokens: s.tokens,
                format,
                x_scale,
                x_scale_inv: s.x_scale_inv,
            });
        }
        Ok(())
    }

    /// Block-scaled FP8: whether a training forward keeps what the backward needs of its input
    /// (`true`, the default), or leaves it to the caller, who recomputes the input and hands it over
    /// with [`Linear::save_block_input`] before the backward (an MLP's down linear, whose input is
    /// cheap to recompute from the activation's own saved input: one byte per element less).
    pub fn set_keep_block_input(&mut self, keep: bool) {
        self.keep_block_input = keep;
    }

    /// Block-scaled FP8: whether the last training forward kept nothing of its input
    /// ([`Linear::set_keep_block_input`] off) and the backward waits for [`Linear::save_block_input`].
    pub fn awaits_block_input(&self) -> bool {
        self.block_awaited
    }

    /// Block-scaled FP8: [`Linear::save_block_input`] from the input's values held in another float
    /// type (e.g. the attention's BF16 output kept for its own backward, which an F32 model's projection
    /// read converted: the same values, so the same codes). `x` holds the `shape` the forward saw.
    pub fn save_block_input_values<E: fp8_kernels::FloatElement>(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Buffer<E>,
        shape: Shape,
    ) -> Result<(), NnError> {
        self.save_block_input_impl(ctx, BlockCastInput::Values(x), shape)
    }

    /// Block-scaled FP8: casts `x` (the input of the last training forward, recomputed) into what the
    /// backward needs and keeps it, the same codes the forward would have kept (the cast is a function
    /// of `x` alone). An error for a linear that is not block-scaled.
    pub fn save_block_input(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<T>) -> Result<(), NnError> {
        self.save_block_input_impl(ctx, BlockCastInput::Values(x.data()), x.shape())
    }

    /// Block-scaled FP8: [`Linear::save_block_input`] of the values `input` computes for an input of
    /// shape `shape` (an activation of its saved input, cast without being written).
    pub fn save_block_input_from(
        &mut self,
        ctx: &mut Ctx<'_>,
        input: BlockCastInput<'_, T>,
        shape: Shape,
    ) -> Result<(), NnError> {
        self.save_block_input_impl(ctx, input, shape)
    }

    /// Block-scaled FP8: the forward of the values `input` computes for an input of shape `shape`, e.g.
    /// `gelu(u)` or SwiGLU of the up linear's output: the activation goes straight into the block casts
    /// (`fp8_kernels::block_quantize_tiles`) and is never written, bit for bit the forward of the
    /// activation's output. An error for a linear that is not block-scaled.
    pub fn forward_from(
        &mut self,
        ctx: &mut Ctx<'_>,
        input: BlockCastInput<'_, T>,
        shape: Shape,
    ) -> Result<Tensor<T>, NnError> {
        self.in_shape = Some(shape);
        self.forward_block_input(ctx, input, shape)
    }

    /// Block-scaled FP8: the backward from the output gradient `dy` computes (`dy_numel` elements), e.g.
    /// GELU's or SwiGLU's input gradient from the next linear's `dx`, cast without being written; bit for
    /// bit the backward of that gradient. An error for a linear that is not block-scaled.
    pub fn backward_from(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: BlockCastInput<'_, T>,
        dy_numel: usize,
        need_dx: bool,
    ) -> InputGrad<T> {
        let in_shape = self
            .in_shape
            .ok_or_else(|| NnError::usage(&self.name, "backward before forward"))?;
        self.backward_block_input(ctx, dy, dy_numel, in_shape, need_dx)
    }

    /// What the block-scaled forward kept for the backward (the quantized `x^T`), if anything.
    pub fn block_saved(&self) -> Option<&BlockFp8Saved> {
        self.block_saved.as_ref()
    }

    fn tokens_of(&self, shape: Shape) -> Result<usize, NnError> {
        rows_of_width(&self.name, shape, self.in_features)
    }

    fn need_fp8(&self, what: &str) -> Result<(), NnError> {
        if self.is_block_scaled() {
            Err(NnError::usage(
                &self.name,
                format!(
                    "{what} takes per-tensor FP8 codes; this layer is block-scaled and quantizes \
                     its float input itself (check Linear::takes_fp8_codes)"
                ),
            ))
        } else if self.precision == LinearPrecision::Fp8 {
            Ok(())
        } else {
            Err(NnError::usage(
                &self.name,
                format!(
                    "{what} needs an FP8 layer, this one is {}",
                    self.precision.name()
                ),
            ))
        }
    }

    /// The buffers a fused producer writes the layer's FP8 input into: `x^T` codes `[in, tokens]` and
    /// the saved inverse scale (the producer copies the input meta's `scale_inv` there). Cast with the
    /// meta [`Linear::input_meta`] from the context. Then [`Linear::forward_fp8_codes`] with the row-major
    /// codes.
    pub fn fp8_input(&mut self, device: &Device, tokens: usize) -> Result<&mut Fp8Saved, NnError> {
        self.fp8_input_for(device, tokens, true)
    }

    /// [`Linear::fp8_input`] for a producer that writes `x^T` only when `transpose` (a forward that
    /// keeps no FP8 input, or an evaluation forward, needs none): without it `x_t` is empty and only the
    /// inverse scale is prepared.
    pub fn fp8_input_for(
        &mut self,
        device: &Device,
        tokens: usize,
        transpose: bool,
    ) -> Result<&mut Fp8Saved, NnError> {
        self.need_fp8("fp8_input")?;
        self.fp8_recast = None;
        let n = if transpose {
            tokens
                .checked_mul(self.in_features)
                .ok_or_else(|| NnError::usage(&self.name, format!("{tokens} rows overflow")))?
        } else {
            0
        };
        let fits = self
            .fp8_saved
            .as_ref()
            .is_some_and(|s| s.x_t.len() == n && s.x_t.device() == *device);
        if !fits {
            self.fp8_saved = Some(Fp8Saved {
                tokens,
                x_t: device.uninit(n)?,
                x_scale_inv: device.zeros(1)?,
            });
        }
        let s = self
            .fp8_saved
            .as_mut()
            .ok_or_else(|| NnError::usage("Linear", "saved input missing"))?;
        s.tokens = tokens;
        Ok(s)
    }

    /// The FP8 forward GEMM `y = x_q W^T (+ b)` from row-major E4M3 codes `x_q [tokens, in]` cast with the
    /// inverse scale saved by [`Linear::fp8_input`]. `out_shape` is the output's shape (`[..., out]`).
    pub fn forward_fp8_codes(
        &mut self,
        ctx: &mut Ctx<'_>,
        x_q: &Buffer<u8>,
        out_shape: Shape,
    ) -> Result<Tensor<T>, NnError> {
        self.need_fp8("forward_fp8_codes")?;
        let saved = self
            .fp8_saved
            .as_ref()
            .ok_or_else(|| NnError::usage(&self.name, "no FP8 input was prepared"))?;
        let (inf, outf, tokens) = (self.in_features, self.out_features, saved.tokens);
        if x_q.len() != tokens * inf
            || out_shape.numel() != tokens * outf
            || out_shape.last() != outf
        {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "{} input codes and output shape {out_shape:?} for {tokens} rows",
                    x_q.len()
                ),
            ));
        }
        // The backward checks its output gradient against the input shape (a fused producer's
        // forward does not pass through `forward`).
        self.in_shape = Some(out_shape.with_last(inf)?);
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let mut y = Tensor::<T>::uninit(&dev, out_shape)?;
        let mut spec = GemmSpec::new(tokens, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(par);
        let (codes, scales, bias) = if self.has_bias {
            let [w, b] = ctx.params([self.weight, self.bias])?;
            (w, Some(b), ())
        } else {
            let [w] = ctx.params([self.weight])?;
            (w, None, ())
        }
        .into_fp8(&self.name)?;
        if let Some(b) = bias {
            let b = plain_in::<T>(b, &mut self.bias_t)?;
            broadcast_bias(b, tokens, y.data_mut())?;
            spec.beta = 1.0;
        }
        let a = Fp8Matrix {
            data: x_q,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar {
                buffer: &saved.x_scale_inv,
                index: 0,
            },
        };
        let w = Fp8Matrix {
            data: codes,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar {
                buffer: scales,
                index: 1,
            },
        };
        gemm_fp8(&spec, a, w, y.data_mut())?;
        Ok(y)
    }

    /// The FP8 backward GEMMs from the output gradient's E5M2 codes `dy_q [tokens, out]` and
    /// `dy_t [out, tokens]` (cast with [`Linear::grad_meta`]): adds `dW` to the model and returns `dx`
    /// (shape `in_shape`) when `need_dx`. The bias gradient is not computed here (see
    /// [`Layer::backward`]).
    pub fn backward_fp8_codes(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy_q: &Buffer<u8>,
        dy_t: &Buffer<u8>,
        in_shape: Shape,
        need_dx: bool,
    ) -> InputGrad<T> {
        self.need_fp8("backward_fp8_codes")?;
        if self.fp8_recast.is_some() {
            return Err(NnError::usage(
                &self.name,
                "the forward kept no FP8 input: restore_fp8_input before the backward",
            ));
        }
        let saved = self
            .fp8_saved
            .as_ref()
            .ok_or_else(|| NnError::usage(&self.name, "backward before forward"))?;
        let (inf, outf, tokens) = (self.in_features, self.out_features, saved.tokens);
        if dy_q.len() != tokens * outf || dy_t.len() != tokens * outf {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "{} gradient codes for a forward of {tokens} rows of {outf}",
                    dy_q.len()
                ),
            ));
        }
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let dx = if need_dx {
            let ((codes, scales), gmeta) =
                ctx.fp8_weight_and_scaling(self.weight, self.grad_meta)?;
            let weight = Fp8Matrix {
                data: codes,
                format: Fp8Format::E4M3,
                scale_inv: DeviceScalar {
                    buffer: scales,
                    index: 1,
                },
            };
            // dx [tokens, in] = dy [tokens, out] * W [out, in].
            let mut dx = Tensor::<T>::uninit(&dev, in_shape)?;
            let a = Fp8Matrix {
                data: dy_q,
                format: Fp8Format::E5M2,
                scale_inv: DeviceScalar {
                    buffer: gmeta.scale_inv(),
                    index: 0,
                },
            };
            let spec = GemmSpec::new(tokens, inf, outf).parallelism(par);
            gemm_fp8(&spec, a, weight, dx.data_mut())?;
            Some(dx)
        } else {
            None
        };
        // dW [out, in] += dy^T [out, tokens] * x [tokens, in], both operands held K-major, accumulated
        // in F32 straight into the weight's range of the unit's flat gradient: no dW buffer of the
        // weight's size and no pass that adds it (whatever the shards' type; they round at the reduction).
        let ((flat, at), gmeta) = ctx.grad_slot_and_scaling(self.weight, self.grad_meta)?;
        let a = Fp8Matrix {
            data: dy_t,
            format: Fp8Format::E5M2,
            scale_inv: DeviceScalar {
                buffer: gmeta.scale_inv(),
                index: 0,
            },
        };
        let b = Fp8Matrix {
            data: &saved.x_t,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar {
                buffer: &saved.x_scale_inv,
                index: 0,
            },
        };
        let spec = GemmSpec::new(outf, inf, tokens)
            .transposes(Transpose::No, Transpose::Yes)
            .scalars(1.0, 1.0)
            .parallelism(par);
        gemm_fp8_at(&spec, a, b, flat, at)?;
        // The saved input is spent: free it now rather than hold it through the optimizer step.
        self.fp8_saved = None;
        Ok(dx)
    }

    /// The forward from a borrowed input (the caller keeps `x`, e.g. for a residual add). An FP8 layer
    /// keeps only the FP8 `x^T` for its backward; a float layer keeps a copy of `x`.
    pub fn forward_ref(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<T>) -> Result<Tensor<T>, NnError> {
        self.in_shape = Some(x.shape());
        match self.precision {
            LinearPrecision::Fp8 if self.block.is_some() => self.forward_block(ctx, x),
            LinearPrecision::Fp8 => self.forward_fp8(ctx, x),
            LinearPrecision::Bf16 | LinearPrecision::F32 => {
                let copy = Tensor::new(x.data().to_device(ctx.device())?, x.shape())?;
                self.forward_float(ctx, copy)
            }
        }
    }

    /// The backward from a borrowed output gradient (see [`Layer::backward`]).
    pub fn backward_ref(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: &Tensor<T>,
        need_dx: bool,
    ) -> InputGrad<T> {
        let in_shape = self.checked_in_shape(dy)?;
        match self.precision {
            LinearPrecision::Fp8 if self.block.is_some() => {
                self.backward_block(ctx, dy, in_shape, need_dx)
            }
            LinearPrecision::Fp8 => self.backward_fp8(ctx, dy, in_shape, need_dx),
            LinearPrecision::Bf16 | LinearPrecision::F32 => {
                let copy = Tensor::new(dy.data().to_device(ctx.device())?, dy.shape())?;
                self.backward_float(ctx, copy, in_shape, need_dx)
            }
        }
    }

    fn checked_in_shape(&self, dy: &Tensor<T>) -> Result<Shape, NnError> {
        let in_shape = self
            .in_shape
            .ok_or_else(|| NnError::usage(&self.name, "backward before forward"))?;
        let tokens = in_shape.rows();
        if dy.shape().numel() != tokens * self.out_features {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "output gradient of shape {:?} for a forward of {tokens} rows",
                    dy.shape()
                ),
            ));
        }
        Ok(in_shape)
    }

    fn forward_fp8(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<T>) -> Result<Tensor<T>, NnError> {
        let shape = x.shape();
        let tokens = self.tokens_of(shape)?;
        let inf = self.in_features;
        let dev = ctx.device().clone();
        let mut x_q = dev.uninit::<u8>(tokens * inf)?;
        let meta = self.input_meta;
        // x^T only for a backward that reads it as written now (not recast later, not evaluation).
        let transpose = ctx.is_training() && self.keep_fp8_input;
        let saved = self.fp8_input_for(&dev, tokens, transpose)?;
        {
            let s = ctx.scaling(meta)?;
            if transpose {
                cast_transpose_to_fp8(
                    x.data(),
                    [tokens, inf],
                    s.state.format()?,
                    s.state.scale(),
                    &mut saved.x_t,
                    Some(&mut x_q),
                    s.amax,
                )?;
            } else {
                cast_to_fp8(
                    x.data(),
                    s.state.format()?,
                    s.state.scale(),
                    &mut x_q,
                    s.amax,
                )?;
            }
            saved.x_scale_inv.copy_from(s.state.scale_inv())?;
        }
        let y = self.forward_fp8_codes(ctx, &x_q, shape.with_last(self.out_features)?)?;
        if ctx.is_training() {
            let s = ctx.scaling(meta)?;
            self.release_fp8_input(s.state.format()?, s.state.scale())?;
        }
        Ok(y)
    }

    fn backward_fp8(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: &Tensor<T>,
        in_shape: Shape,
        need_dx: bool,
    ) -> InputGrad<T> {
        let outf = self.out_features;
        let tokens = dy.shape().rows();
        let dev = ctx.device().clone();
        let (mut dy_q, mut dy_t) = (
            dev.uninit::<u8>(tokens * outf)?,
            dev.uninit::<u8>(tokens * outf)?,
        );
        {
            let s = ctx.scaling(self.grad_meta)?;
            cast_transpose_to_fp8(
                dy.data(),
                [tokens, outf],
                s.state.format()?,
                s.state.scale(),
                &mut dy_t,
                Some(&mut dy_q),
                s.amax,
            )?;
        }
        let db = self.bias_grad(&dev, dy, tokens)?;
        let dx = self.backward_fp8_codes(ctx, &dy_q, &dy_t, in_shape, need_dx)?;
        if let Some(db) = db {
            ctx.add_grad(self.bias, &db)?;
        }
        Ok(dx)
    }

    fn bias_grad<G: Activation>(
        &self,
        dev: &Device,
        dy: &Tensor<G>,
        tokens: usize,
    ) -> Result<Option<Buffer<f32>>, NnError> {
        if !self.has_bias {
            return Ok(None);
        }
        let mut db = dev.uninit::<f32>(self.out_features)?;
        reduce::sum_over_rows(dy.data(), tokens, self.out_features, &mut db)?;
        Ok(Some(db))
    }

    fn forward_float(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let shape = x.shape();
        let tokens = self.tokens_of(shape)?;
        let (inf, outf) = (self.in_features, self.out_features);
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let training = ctx.is_training();
        let mut spec = GemmSpec::new(tokens, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(par);
        let (w, b) = if self.has_bias {
            let [w, b] = ctx.params([self.weight, self.bias])?;
            (
                plain_param(w, &self.name)?,
                Some(plain_param(b, &self.name)?),
            )
        } else {
            let [w] = ctx.params([self.weight])?;
            (plain_param(w, &self.name)?, None)
        };
        let mut w32_scratch: Option<Buffer<f32>> = None;
        let mut w16_scratch: Option<Buffer<bf16>> = None;
        let mut b_scratch: Option<Buffer<f32>> = None;
        let out_shape = shape.with_last(outf)?;
        match self.precision {
            LinearPrecision::F32 => {
                let mut y = Tensor::<f32>::uninit(&dev, out_shape)?;
                if let Some(b) = b {
                    broadcast_bias(plain_in::<f32>(b, &mut b_scratch)?, tokens, y.data_mut())?;
                    spec.beta = 1.0;
                }
                let x32 = as_f32(&x)?;
                let w = plain_in::<f32>(w, &mut w32_scratch)?;
                gemm(&spec, x32, w, y.data_mut())?;
                self.x_saved = training.then_some(x);
                retype(y)
            }
            LinearPrecision::Bf16 => {
                let x16: Buffer<bf16> = buffer_converted(x.into_data())?;
                let w16 = plain_in::<bf16>(w, &mut w16_scratch)?;
                let mut y = Tensor::<T>::uninit(&dev, out_shape)?;
                if let Some(b) = b {
                    let b = plain_in::<T>(b, &mut self.bias_t)?;
                    broadcast_bias(b, tokens, y.data_mut())?;
                    spec.beta = 1.0;
                }
                gemm(&spec, &x16, w16, y.data_mut())?;
                self.x_bf16 = training.then_some(x16);
                Ok(y)
            }
            LinearPrecision::Fp8 => Err(NnError::usage(&self.name, "not a float layer")),
        }
    }

    fn backward_float(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: Tensor<T>,
        in_shape: Shape,
        need_dx: bool,
    ) -> InputGrad<T> {
        let (inf, outf) = (self.in_features, self.out_features);
        let tokens = dy.shape().rows();
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let dx_spec = GemmSpec::new(tokens, inf, outf).parallelism(par);
        // dW accumulates in the weight's range of the unit's flat gradient (no buffer of its own).
        let dw_spec = GemmSpec::new(outf, inf, tokens)
            .transposes(Transpose::Yes, Transpose::No)
            .scalars(1.0, 1.0)
            .parallelism(par);
        let (dx, db) = match self.precision {
            LinearPrecision::F32 => {
                let x = self
                    .x_saved
                    .take()
                    .ok_or_else(|| NnError::usage(&self.name, "backward before forward"))?;
                let mut w_scratch = None;
                let w = plain_in::<f32>(
                    plain_param(ctx.params([self.weight])?[0], &self.name)?,
                    &mut w_scratch,
                )?;
                let dy32 = as_f32(&dy)?;
                let dx = if need_dx {
                    let mut dx = Tensor::<f32>::uninit(&dev, in_shape)?;
                    gemm(&dx_spec, dy32, w, dx.data_mut())?;
                    Some(retype(dx)?)
                } else {
                    None
                };
                let (flat, at) = ctx.grad_slot(self.weight)?;
                gemm_at(&dw_spec, dy32, as_f32(&x)?, flat, at)?;
                (dx, self.bias_grad(&dev, &dy, tokens)?)
            }
            LinearPrecision::Bf16 => {
                let x16 = self
                    .x_bf16
                    .take()
                    .ok_or_else(|| NnError::usage(&self.name, "backward before forward"))?;
                let dy16: Buffer<bf16> = buffer_converted(dy.into_data())?;
                // The weight again in bf16 from the unit gathered for the backward (ZeRO-3 keeps no
                // copy between the passes).
                let mut w_scratch = None;
                let w16 = plain_in::<bf16>(
                    plain_param(ctx.params([self.weight])?[0], &self.name)?,
                    &mut w_scratch,
                )?;
                let dx = if need_dx {
                    let mut dx = Tensor::<T>::uninit(&dev, in_shape)?;
                    gemm(&dx_spec, &dy16, w16, dx.data_mut())?;
                    Some(dx)
                } else {
                    None
                };
                let (flat, at) = ctx.grad_slot(self.weight)?;
                gemm_at(&dw_spec, &dy16, &x16, flat, at)?;
                let db = if self.has_bias {
                    let mut db = dev.uninit::<f32>(outf)?;
                    reduce::sum_over_rows(&dy16, tokens, outf, &mut db)?;
                    Some(db)
                } else {
                    None
                };
                (dx, db)
            }
            LinearPrecision::Fp8 => return Err(NnError::usage(&self.name, "not a float layer")),
        };
        if let Some(db) = db {
            ctx.add_grad(self.bias, &db)?;
        }
        Ok(dx)
    }
}

/// Splits gathered `(weight, bias?)` into FP8 codes, scales and the plain bias.
trait IntoFp8<'a> {
    #[allow(clippy::type_complexity)]
    fn into_fp8(
        self,
        layer: &str,
    ) -> Result<(&'a Buffer<u8>, &'a Buffer<f32>, Option<PlainParam<'a>>), NnError>;
}

impl<'a> IntoFp8<'a> for (&'a GatheredParam, Option<&'a GatheredParam>, ()) {
    fn into_fp8(
        self,
        layer: &str,
    ) -> Result<(&'a Buffer<u8>, &'a Buffer<f32>, Option<PlainParam<'a>>), NnError> {
        let (w, b, ()) = self;
        let (codes, scales) = match w {
            GatheredParam::Fp8 { codes, scales } => (codes, scales),
            GatheredParam::Plain(_)
            | GatheredParam::PlainBf16(_)
            | GatheredParam::Fp8Block { .. } => {
                return Err(NnError::usage(
                    layer,
                    "the weight is not a per-tensor FP8 parameter",
                ))
            }
        };
        let bias = b.map(|b| plain_param(b, layer)).transpose()?;
        Ok((codes, scales, bias))
    }
}

/// `y[t, :] = bias` for every row: zero, then the bias added (exact).
fn broadcast_bias<O: GemmOutput>(
    bias: &Buffer<O>,
    tokens: usize,
    y: &mut Buffer<O>,
) -> Result<(), NnError> {
    y.fill_zero()?;
    elementwise::bias_add(y, bias, tokens, bias.len())?;
    Ok(())
}

/// The f32 buffer of an f32 tensor (an F32 layer's activations are f32: checked at construction).
fn as_f32<T: Activation>(t: &Tensor<T>) -> Result<&Buffer<f32>, NnError> {
    let any: &dyn std::any::Any = t.data();
    any.downcast_ref::<Buffer<f32>>()
        .ok_or_else(|| NnError::usage("Linear", "an F32 layer got non-f32 activations"))
}

/// An f32 tensor as `Tensor<T>` when `T` is f32.
fn retype<T: Activation>(t: Tensor<f32>) -> Result<Tensor<T>, NnError> {
    let boxed: Box<dyn std::any::Any> = Box::new(t);
    boxed
        .downcast::<Tensor<T>>()
        .map(|b| *b)
        .map_err(|_| NnError::usage("Linear", "an F32 layer produces f32 activations"))
}

impl<T: Activation> Module for Linear<T> {
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        self.name = v.path().module();
        let (inf, outf, fixed, init) = (self.in_features, self.out_features, self.seed, self.init);
        let weight_init = move |own: u64| {
            let seed = fixed.unwrap_or(own);
            match init {
                WeightInit::PyTorchDefault => kaiming_uniform(outf * inf, inf, 5f64.sqrt(), seed),
                WeightInit::Normal(std) => normal(outf * inf, std, seed),
            }
        };
        let shape = [outf, inf];
        if self.is_block_scaled() && !block_scalable(inf, outf) {
            return Err(ShardError::InvalidModel(format!(
                "{}: {inf} -> {outf} features: a block-scaled FP8 linear needs both sides multiples \
                 of {} (the block-scaled GEMM's rule; leave it in float precision, as \
                 convert_to_fp8 does)",
                self.name,
                fp8_kernels::gemm::FP8_DIM_MULTIPLE
            )));
        }
        v.param(
            "weight",
            &ParamDecl::seeded(&shape, self.weight_kind(), &weight_init),
            &mut self.weight,
        )?;
        if self.has_bias {
            // An explicit seed derives the bias's stream from it (as before seeds came from names).
            let bias_init = move |own: u64| match init {
                WeightInit::PyTorchDefault => {
                    uniform_fan_in(outf, inf, fixed.map_or(own, |s| s ^ 0xB1A5))
                }
                WeightInit::Normal(_) => vec![0.0; outf],
            };
            v.param(
                "bias",
                &ParamDecl::seeded(&[outf], ParamKind::Plain, &bias_init),
                &mut self.bias,
            )?;
        }
        // A block-scaled layer scales every tile from its own amax as it casts: no meta, nothing for
        // the optimizer's amax all-reduce.
        if self.takes_fp8_codes() {
            v.scaling(
                "input",
                ScalingDecl {
                    qtype: QType::E4M3,
                    recipe: self.input_recipe,
                },
                &mut self.input_meta,
            )?;
            v.scaling(
                "grad_output",
                ScalingDecl {
                    qtype: QType::E5M2,
                    recipe: self.grad_recipe,
                },
                &mut self.grad_meta,
            )?;
        }
        Ok(())
    }
}

impl<T: Activation> Layer<T> for Linear<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        self.in_shape = Some(x.shape());
        match self.precision {
            LinearPrecision::Fp8 if self.block.is_some() => self.forward_block(ctx, &x),
            LinearPrecision::Fp8 => self.forward_fp8(ctx, &x),
            LinearPrecision::Bf16 | LinearPrecision::F32 => self.forward_float(ctx, x),
        }
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let in_shape = self.checked_in_shape(&dy)?;
        match self.precision {
            LinearPrecision::Fp8 if self.block.is_some() => {
                self.backward_block(ctx, &dy, in_shape, need_dx)
            }
            LinearPrecision::Fp8 => self.backward_fp8(ctx, &dy, in_shape, need_dx),
            LinearPrecision::Bf16 | LinearPrecision::F32 => {
                self.backward_float(ctx, dy, in_shape, need_dx)
            }
        }
    }

    fn forget_saved(&mut self) {
        self.drop_saved();
    }
}
