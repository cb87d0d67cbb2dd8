//! The block-scaled FP8 path of [`Linear`] (DeepSeek-V3's recipe; see the module docs of `linear.rs`):
//! the three products of `fp8_kernels::gemm::gemm_fp8_block`'s table, each operand cast by
//! `block_quantize` with its scales in the GEMM's order, no scaling meta.
//!
//! The token count is padded to a multiple of 16 (the GEMM's rule) with zero rows, which change
//! nothing: a zero row is its own 1x128 tiles (scale 1, codes 0), adds nothing to the amax of a 128x1
//! tile, contributes exact zeros to the weight gradient's sum over tokens, and its output rows are cut
//! off. The feature sides are checked when the model is wrapped ([`super::block_scalable`]).

use super::{broadcast_bias, BlockFp8Saved, BlockScaling, Linear};
use crate::layer::{Activation, InputGrad};
use crate::plain_param::{plain_in, plain_param};
use crate::{NnError, Shape, Tensor};
use fp8_core::{BlockLayout, Fp8Format, ScaleRounding, ScalingGranularity};
use fp8_kernels::block_quantize::{
    block_quantize_tiles, BlockCastInput, BlockQuantLayout, BlockQuantOutput, ScaleOrder,
};
use fp8_kernels::gemm::{gemm_fp8_block, gemm_fp8_block_at, FP8_DIM_MULTIPLE};
use fp8_kernels::{BlockFp8Matrix, Buffer, Device, Element, FloatElement, GemmSpec, Transpose};
use fsdp_shard::{Ctx, GatheredParam};

/// One block-scaled cast: codes, inverse scales in the GEMM's order, and their layout.
struct Quantized {
    codes: Buffer<u8>,
    scale_inv: Buffer<f32>,
    layout: BlockLayout,
    format: Fp8Format,
}

/// The casts of one input that a product needs: the 1x128 tiles, the 128x1 tiles written transposed,
/// or both from one read ([`block_quantize_tiles`]).
struct Casts {
    rows: Option<Quantized>,
    cols: Option<Quantized>,
}

/// One layout's layout, codes, scales and inverse scales while being cast.
type CastBuffers = (BlockLayout, Buffer<u8>, Buffer<f32>, Buffer<f32>);

fn output_of(b: &mut Option<CastBuffers>) -> Option<BlockQuantOutput<'_>> {
    b.as_mut().map(|(_, q, s, si)| BlockQuantOutput {
        codes: q,
        scale: s,
        scale_inv: si,
    })
}

impl Quantized {
    /// `input`'s `[rows, cols]` values cast in the layouts asked for (at least one), scales in the
    /// GEMM's order.
    fn tiles<X: FloatElement>(
        dev: &Device,
        input: BlockCastInput<'_, X>,
        [rows, cols]: [usize; 2],
        (format, rounding): (Fp8Format, ScaleRounding),
        (want_rows, want_cols): (bool, bool),
    ) -> Result<Casts, NnError> {
        let buffers = |layout: BlockQuantLayout| -> Result<_, NnError> {
            let out = layout.output_layout(rows, cols)?;
            let n = ScaleOrder::Gemm.strides(&out)?.len;
            // Zero inverse scales: the padding entries of the GEMM's order are never written.
            Ok((
                out,
                dev.uninit::<u8>(out.numel())?,
                dev.uninit::<f32>(n)?,
                dev.zeros::<f32>(n)?,
            ))
        };
        let mut r = want_rows
            .then(|| buffers(BlockQuantLayout::Rows1x128))
            .transpose()?;
        let mut c = want_cols
            .then(|| buffers(BlockQuantLayout::Columns128x1Transposed))
            .transpose()?;
        block_quantize_tiles(
            input,
            [rows, cols],
            format,
            rounding,
            ScaleOrder::Gemm,
            output_of(&mut r),
            output_of(&mut c),
        )?;
        let made = |b: Option<CastBuffers>| {
            b.map(|(layout, codes, _, scale_inv)| Quantized {
                codes,
                scale_inv,
                layout,
                format,
            })
        };
        Ok(Casts {
            rows: made(r),
            cols: made(c),
        })
    }

    fn matrix(&self) -> BlockFp8Matrix<'_> {
        BlockFp8Matrix {
            data: &self.codes,
            format: self.format,
            layout: self.layout,
            scale_inv: &self.scale_inv,
            scale_order: ScaleOrder::Gemm,
        }
    }
}

/// `input`'s `[tokens, cols]` values with zero rows appended up to `rows`, as a buffer of their own;
/// `None` when no row is missing (the input is cast as it is). An activation is computed by its own
/// kernel first (the rare case of a token count that is not a multiple of 16).
fn padded_input<X: FloatElement>(
    dev: &Device,
    input: BlockCastInput<'_, X>,
    tokens: usize,
    rows: usize,
    cols: usize,
) -> Result<Option<Buffer<X>>, NnError> {
    if rows == tokens {
        return Ok(None);
    }
    let values = input.values_on(dev, [tokens, cols])?;
    let x = match (&values, input) {
        (Some(v), _) => v,
        (None, BlockCastInput::Values(x)) => x,
        (None, _) => return Err(NnError::usage("block cast", "an activation without values")),
    };
    let mut p = dev.zeros::<X>(rows * cols)?;
    p.copy_range_from(0, x, 0, tokens * cols)?;
    Ok(Some(p))
}

/// The first `rows` rows of `y [padded rows, cols]`.
fn unpadded<X: Element>(y: Buffer<X>, rows: usize, cols: usize) -> Result<Buffer<X>, NnError> {
    if y.len() == rows * cols {
        return Ok(y);
    }
    let mut out = y.device().uninit::<X>(rows * cols)?;
    out.copy_range_from(0, &y, 0, rows * cols)?;
    Ok(out)
}

/// The gathered block-scaled weight `[out, in]` as the GEMM's operand.
fn block_weight<'a>(
    p: &'a GatheredParam,
    [outf, inf]: [usize; 2],
    layer: &str,
) -> Result<BlockFp8Matrix<'a>, NnError> {
    match p {
        GatheredParam::Fp8Block {
            codes, scale_inv, ..
        } => Ok(BlockFp8Matrix {
            data: codes,
            format: Fp8Format::E4M3,
            layout: BlockLayout::new(outf, inf, ScalingGranularity::Block128x128)
                .map_err(fp8_kernels::KernelError::from)?,
            scale_inv,
            scale_order: ScaleOrder::Gemm,
        }),
        GatheredParam::Fp8 { .. } | GatheredParam::Plain(_) | GatheredParam::PlainBf16(_) => Err(
            NnError::usage(layer, "the weight is not a block-scaled FP8 parameter"),
        ),
    }
}

impl<T: Activation> Linear<T> {
    /// The block recipe of a block-scaled layer; an error for any other.
    fn required_block_scaling(&self) -> Result<BlockScaling, NnError> {
        self.block_scaling()
            .ok_or_else(|| NnError::usage(&self.name, "not a block-scaled layer"))
    }

    /// Rows of the GEMMs for `tokens` rows of input: the next multiple of 16.
    fn block_rows(&self, tokens: usize) -> Result<usize, NnError> {
        tokens
            .checked_next_multiple_of(FP8_DIM_MULTIPLE)
            .ok_or_else(|| NnError::usage(&self.name, format!("{tokens} rows overflow")))
    }

    /// `y = x_q W_q^T (+ b)`: `x` cast in 1x128 tiles, the weight as gathered (128x128 blocks). When
    /// training, also casts `x` in 128x1 tiles, transposed, for the weight gradient, and keeps only that.
    pub(super) fn forward_block(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
    ) -> Result<Tensor<T>, NnError> {
        self.forward_block_input(ctx, BlockCastInput::Values(x.data()), x.shape())
    }

    /// [`Linear::forward_block`] of the values `input` gives for an input of shape `shape` (e.g. GELU of
    /// the up linear's output, cast without being written: [`Linear::forward_from`]).
    pub(super) fn forward_block_input(
        &mut self,
        ctx: &mut Ctx<'_>,
        input: BlockCastInput<'_, T>,
        shape: Shape,
    ) -> Result<Tensor<T>, NnError> {
        let bs = self.required_block_scaling()?;
        let tokens = self.tokens_of(shape)?;
        let (inf, outf) = (self.in_features, self.out_features);
        let rows = self.block_rows(tokens)?;
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let x_pad = padded_input(&dev, input, tokens, rows, inf)?;
        let input = x_pad.as_ref().map_or(input, BlockCastInput::Values);
        // The weight-gradient operand is cast now (with the forward's, from one read of `x`), so the
        // backward keeps one byte per element instead of `x` (two or four); the same `x` gives the same
        // codes whenever it is cast.
        let keep = ctx.is_training() && self.keep_block_input;
        self.block_awaited = ctx.is_training() && !self.keep_block_input;
        let casts = Quantized::tiles(
            &dev,
            input,
            [rows, inf],
            (bs.input_format, bs.rounding),
            (true, keep),
        )?;
        drop(x_pad);
        self.block_saved = casts.cols.map(|x_t| BlockFp8Saved {
            tokens,
            padded_tokens: rows,
            x_t: x_t.codes,
            x_t_scale_inv: x_t.scale_inv,
        });
        let x_q = casts
            .rows
            .ok_or_else(|| NnError::usage(&self.name, "the 1x128 cast is missing"))?;
        let mut y = dev.uninit::<T>(rows * outf)?;
        let mut spec = GemmSpec::new(rows, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(par);
        let (w, b) = if self.has_bias {
            let [w, b] = ctx.params([self.weight, self.bias])?;
            (w, Some(plain_param(b, &self.name)?))
        } else {
            let [w] = ctx.params([self.weight])?;
            (w, None)
        };
        let w = block_weight(w, [outf, inf], &self.name)?;
        if let Some(b) = b {
            let b = plain_in::<T>(b, &mut self.bias_t)?;
            broadcast_bias(b, rows, &mut y)?;
            spec.beta = 1.0;
        }
        gemm_fp8_block(&spec, x_q.matrix(), w, &mut y)?;
        Tensor::new(unpadded(y, tokens, outf)?, shape.with_last(outf)?)
    }

    /// [`Linear::save_block_input`]: the weight-gradient operand cast from the values `input` gives for an
    /// input of shape `shape`, kept.
    pub(super) fn save_block_input_impl<E: FloatElement>(
        &mut self,
        ctx: &mut Ctx<'_>,
        input: BlockCastInput<'_, E>,
        shape: Shape,
    ) -> Result<(), NnError> {
        let bs = self.required_block_scaling()?;
        let tokens = self.tokens_of(shape)?;
        let inf = self.in_features;
        let rows = self.block_rows(tokens)?;
        let dev = ctx.device().clone();
        let x_pad = padded_input(&dev, input, tokens, rows, inf)?;
        let input = x_pad.as_ref().map_or(input, BlockCastInput::Values);
        let casts = Quantized::tiles(
            &dev,
            input,
            [rows, inf],
            (bs.input_format, bs.rounding),
            (false, true),
        )?;
        let x_t = casts
            .cols
            .ok_or_else(|| NnError::usage(&self.name, "the 128x1 cast is missing"))?;
        self.block_saved = Some(BlockFp8Saved {
            tokens,
            padded_tokens: rows,
            x_t: x_t.codes,
            x_t_scale_inv: x_t.scale_inv,
        });
        self.block_awaited = false;
        Ok(())
    }

    /// `dx = dy_q W_q` (`dy` in 1x128 tiles, the weight read transposed: its 128x128 blocks transpose
    /// exactly) and `dW = dy_q^T x_q` (both in 128x1 tiles, transposed: K-major over the tokens),
    /// accumulated in F32 straight into the weight's range of the unit's flat gradient
    /// ([`Ctx::grad_slot`]: no buffer of the weight's size, no pass that adds it); `db` the column sum
    /// of `dy`.
    pub(super) fn backward_block(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: &Tensor<T>,
        in_shape: Shape,
        need_dx: bool,
    ) -> InputGrad<T> {
        let tokens = self.tokens_of(in_shape)?;
        let db = self.bias_grad(ctx.device(), dy, tokens)?;
        let input = BlockCastInput::Values(dy.data());
        self.backward_block_cast(ctx, input, dy.shape().numel(), in_shape, need_dx, db)
    }

    /// [`Linear::backward_block`] of the output gradient `dy` gives (`dy_numel` elements; e.g. GELU's
    /// input gradient `gelu'(u) da`, cast without being written: [`Linear::backward_from`]). A layer with
    /// a bias needs `dy` itself for the bias gradient: an activation's gradient is then computed first.
    pub(super) fn backward_block_input(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: BlockCastInput<'_, T>,
        dy_numel: usize,
        in_shape: Shape,
        need_dx: bool,
    ) -> InputGrad<T> {
        if self.has_bias {
            let tokens = self.tokens_of(in_shape)?;
            let values = match dy {
                BlockCastInput::Values(d) => d.to_device(ctx.device())?,
                _ => dy
                    .values_on(ctx.device(), [tokens, self.out_features])?
                    .ok_or_else(|| NnError::usage(&self.name, "an activation without values"))?,
            };
            let dy = Tensor::new(values, in_shape.with_last(self.out_features)?)?;
            return self.backward_block(ctx, &dy, in_shape, need_dx);
        }
        self.backward_block_cast(ctx, dy, dy_numel, in_shape, need_dx, None)
    }

    /// The products of the backward from `dy`'s casts; `db` added as given.
    fn backward_block_cast(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: BlockCastInput<'_, T>,
        dy_numel: usize,
        in_shape: Shape,
        need_dx: bool,
        db: Option<Buffer<f32>>,
    ) -> InputGrad<T> {
        let bs = self.required_block_scaling()?;
        let saved = self
            .block_saved
            .take()
            .ok_or_else(|| NnError::usage(&self.name, "backward before a training forward"))?;
        let (inf, outf) = (self.in_features, self.out_features);
        let (tokens, rows) = (saved.tokens, saved.padded_tokens);
        if dy_numel != tokens * outf || in_shape.numel() != tokens * inf {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "output gradient of {dy_numel} elements for a training forward of {tokens} rows"
                ),
            ));
        }
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let dy_pad = padded_input(&dev, dy, tokens, rows, outf)?;
        let dy = dy_pad.as_ref().map_or(dy, BlockCastInput::Values);
        let casts = Quantized::tiles(
            &dev,
            dy,
            [rows, outf],
            (bs.grad_format, bs.rounding),
            (need_dx, true),
        )?;
        drop(dy_pad);
        let dy_t = casts
            .cols
            .ok_or_else(|| NnError::usage(&self.name, "the 128x1 cast is missing"))?;
        let dx = match &casts.rows {
            Some(q) => {
                let [w] = ctx.params([self.weight])?;
                let w = block_weight(w, [outf, inf], &self.name)?;
                // dx [rows, in] = dy [rows, out] * W [out, in], W stored [k, n].
                let spec = GemmSpec::new(rows, inf, outf).parallelism(par);
                let mut dx = dev.uninit::<T>(rows * inf)?;
                gemm_fp8_block(&spec, q.matrix(), w, &mut dx)?;
                Some(Tensor::new(unpadded(dx, tokens, inf)?, in_shape)?)
            }
            None => None,
        };
        drop(casts.rows);
        let x_t = BlockFp8Matrix {
            data: &saved.x_t,
            format: bs.input_format,
            layout: BlockQuantLayout::Columns128x1Transposed.output_layout(rows, inf)?,
            scale_inv: &saved.x_t_scale_inv,
            scale_order: ScaleOrder::Gemm,
        };
        // dW [out, in] += dy^T [out, rows] * x [rows, in]; both operands held K-major.
        let spec = GemmSpec::new(outf, inf, rows)
            .transposes(Transpose::No, Transpose::Yes)
            .scalars(1.0, 1.0)
            .parallelism(par);
        let (flat, at) = ctx.grad_slot(self.weight)?;
        gemm_fp8_block_at(&spec, dy_t.matrix(), x_t, flat, at)?;
        if let Some(db) = db {
            ctx.add_grad(self.bias, &db)?;
        }
        Ok(dx)
    }
}
