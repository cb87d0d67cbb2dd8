//! The block-scaled FP8 path of [`Linear`] (DeepSeek-V3's recipe; see the module docs of `linear.rs`):
//! the three products of `fp8_kernels::gemm::gemm_fp8_block`'s table, each operand cast by
//! `block_quantize` with its scales in the GEMM's order, no scaling meta.
//!
//! The token count is padded to a multiple of 16 (the GEMM's rule) with zero rows, which change
//! nothing: a zero row is its own 1x128 tiles (scale 1, codes 0), adds nothing to the amax of a 128x1
//! tile, contributes exact zeros to the weight gradient's sum over tokens, and its output rows are cut
//! off. The feature sides are checked when the model is wrapped ([`super::block_scalable`]).

use super::{broadcast_bias, plain, BlockFp8Saved, Linear};
use crate::layer::{Activation, InputGrad};
use crate::{NnError, Shape, Tensor};
use fp8_core::{BlockLayout, Fp8Format, ScaleRounding, ScalingGranularity};
use fp8_kernels::block_quantize::{
    block_quantize, block_quantize_both, BlockQuantLayout, BlockQuantOutput, BlockQuantSpec,
    ScaleOrder,
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

impl Quantized {
    /// `x [rows, cols]` cast in `layout`'s tiles (the scales themselves are not kept).
    fn new<X: FloatElement>(
        dev: &Device,
        x: &Buffer<X>,
        [rows, cols]: [usize; 2],
        layout: BlockQuantLayout,
        format: Fp8Format,
        rounding: ScaleRounding,
    ) -> Result<Self, NnError> {
        let spec = BlockQuantSpec {
            layout,
            format,
            rounding,
            scale_order: ScaleOrder::Gemm,
        };
        let out = layout.output_layout(rows, cols)?;
        let n = ScaleOrder::Gemm.strides(&out)?.len;
        let mut codes = dev.uninit::<u8>(out.numel())?;
        let mut scale = dev.uninit::<f32>(n)?;
        // Zeros: the padding entries of the GEMM's order are never written.
        let mut scale_inv = dev.zeros::<f32>(n)?;
        block_quantize(
            x,
            [rows, cols],
            spec,
            &mut codes,
            &mut scale,
            &mut scale_inv,
        )?;
        Ok(Quantized {
            codes,
            scale_inv,
            layout: out,
            format,
        })
    }

    /// `x [rows, cols]` cast in both 1x128 layouts at once (`Rows1x128`, `Columns128x1Transposed`): the
    /// same codes and scales as two [`Quantized::new`] calls, one read of `x` on CUDA.
    fn both<X: FloatElement>(
        dev: &Device,
        x: &Buffer<X>,
        [rows, cols]: [usize; 2],
        format: Fp8Format,
        rounding: ScaleRounding,
    ) -> Result<[Self; 2], NnError> {
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
        let (rl, mut q, mut s, mut si) = buffers(BlockQuantLayout::Rows1x128)?;
        let (cl, mut qt, mut st, mut sit) = buffers(BlockQuantLayout::Columns128x1Transposed)?;
        block_quantize_both(
            x,
            [rows, cols],
            format,
            rounding,
            ScaleOrder::Gemm,
            BlockQuantOutput {
                codes: &mut q,
                scale: &mut s,
                scale_inv: &mut si,
            },
            BlockQuantOutput {
                codes: &mut qt,
                scale: &mut st,
                scale_inv: &mut sit,
            },
        )?;
        let made = |codes, scale_inv, layout| Quantized {
            codes,
            scale_inv,
            layout,
            format,
        };
        Ok([made(q, si, rl), made(qt, sit, cl)])
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

/// `x [rows, cols]` with zero rows appended up to `padded_rows`; `None` when no row is missing.
fn padded<X: Element>(
    x: &Buffer<X>,
    rows: usize,
    padded_rows: usize,
    cols: usize,
) -> Result<Option<Buffer<X>>, NnError> {
    if rows == padded_rows {
        return Ok(None);
    }
    let mut p = x.device().zeros::<X>(padded_rows * cols)?;
    p.copy_range_from(0, x, 0, rows * cols)?;
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
        GatheredParam::Fp8 { .. } | GatheredParam::Plain(_) => Err(NnError::usage(
            layer,
            "the weight is not a block-scaled FP8 parameter",
        )),
    }
}

impl<T: Activation> Linear<T> {
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
        let bs = self
            .block_scaling()
            .ok_or_else(|| NnError::usage(&self.name, "not a block-scaled layer"))?;
        let shape = x.shape();
        let tokens = self.tokens_of(shape)?;
        let (inf, outf) = (self.in_features, self.out_features);
        let rows = self.block_rows(tokens)?;
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let x_pad = padded(x.data(), tokens, rows, inf)?;
        let xs = x_pad.as_ref().unwrap_or(x.data());
        // The weight-gradient operand is cast now (with the forward's, from one read of `x`), so the
        // backward keeps one byte per element instead of `x` (two or four); the same `x` gives the same
        // codes whenever it is cast.
        let (x_q, saved) = if ctx.is_training() && self.keep_block_input {
            let [x_q, x_t] = Quantized::both(&dev, xs, [rows, inf], bs.input_format, bs.rounding)?;
            let saved = BlockFp8Saved {
                tokens,
                padded_tokens: rows,
                x_t: x_t.codes,
                x_t_scale_inv: x_t.scale_inv,
            };
            (x_q, Some(saved))
        } else {
            let x_q = Quantized::new(
                &dev,
                xs,
                [rows, inf],
                BlockQuantLayout::Rows1x128,
                bs.input_format,
                bs.rounding,
            )?;
            (x_q, None)
        };
        self.block_saved = saved;
        drop(x_pad);
        let mut y = dev.uninit::<T>(rows * outf)?;
        let mut spec = GemmSpec::new(rows, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(par);
        let (w, b) = if self.has_bias {
            let [w, b] = ctx.params([self.weight, self.bias])?;
            (w, Some(plain(b, &self.name)?))
        } else {
            let [w] = ctx.params([self.weight])?;
            (w, None)
        };
        let w = block_weight(w, [outf, inf], &self.name)?;
        if let Some(b) = b {
            let b = T::from_f32_buffer(b, &mut self.bias_t)?;
            broadcast_bias(b, rows, &mut y)?;
            spec.beta = 1.0;
        }
        gemm_fp8_block(&spec, x_q.matrix(), w, &mut y)?;
        Tensor::new(unpadded(y, tokens, outf)?, shape.with_last(outf)?)
    }

    /// [`Linear::save_block_input`]: the weight-gradient operand cast from `x`, kept.
    pub(super) fn save_block_input_impl(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
    ) -> Result<(), NnError> {
        let bs = self
            .block_scaling()
            .ok_or_else(|| NnError::usage(&self.name, "not a block-scaled layer"))?;
        let tokens = self.tokens_of(x.shape())?;
        let inf = self.in_features;
        let rows = self.block_rows(tokens)?;
        let dev = ctx.device().clone();
        let x_pad = padded(x.data(), tokens, rows, inf)?;
        let xs = x_pad.as_ref().unwrap_or(x.data());
        let x_t = Quantized::new(
            &dev,
            xs,
            [rows, inf],
            BlockQuantLayout::Columns128x1Transposed,
            bs.input_format,
            bs.rounding,
        )?;
        self.block_saved = Some(BlockFp8Saved {
            tokens,
            padded_tokens: rows,
            x_t: x_t.codes,
            x_t_scale_inv: x_t.scale_inv,
        });
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
        let bs = self
            .block_scaling()
            .ok_or_else(|| NnError::usage(&self.name, "not a block-scaled layer"))?;
        let saved = self
            .block_saved
            .take()
            .ok_or_else(|| NnError::usage(&self.name, "backward before a training forward"))?;
        let (inf, outf) = (self.in_features, self.out_features);
        let (tokens, rows) = (saved.tokens, saved.padded_tokens);
        if dy.shape().numel() != tokens * outf || in_shape.numel() != tokens * inf {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "output gradient of shape {:?} for a training forward of {tokens} rows",
                    dy.shape()
                ),
            ));
        }
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let db = self.bias_grad(&dev, dy, tokens)?;
        let dy_pad = padded(dy.data(), tokens, rows, outf)?;
        let dys = dy_pad.as_ref().unwrap_or(dy.data());
        let (dy_q, dy_t) = if need_dx {
            let [q, t] = Quantized::both(&dev, dys, [rows, outf], bs.grad_format, bs.rounding)?;
            (Some(q), t)
        } else {
            let t = Quantized::new(
                &dev,
                dys,
                [rows, outf],
                BlockQuantLayout::Columns128x1Transposed,
                bs.grad_format,
                bs.rounding,
            )?;
            (None, t)
        };
        drop(dy_pad);
        let dx = match &dy_q {
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
        drop(dy_q);
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
