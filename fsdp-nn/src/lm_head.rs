//! [`LmHead`]: a language-model head with its cross-entropy loss, run in chunks of tokens so the
//! `[tokens, vocab]` logits never exist at once.
//!
//! Per chunk of at most `chunk` tokens (default [`DEFAULT_HEAD_CHUNK`]): `logits = x_c W^T` (a GEMM in
//! the activation type: BF16 operands with F32 accumulation into BF16 logits, or F32), the in-place
//! cross-entropy kernel (`fp8_kernels::cross_entropy`: per-row log-sum-exp and loss, the chunk's loss sum
//! added into a device accumulator, and with a gradient scale the logits overwritten by their gradient),
//! then `dx_c = dlogits W` and `dW += dlogits^T x_c` (F32). The loss is the mean over the batch's tokens
//! of `lse - logit[target]`, computed in F32 from the logits; every vocabulary column counts (a padded
//! vocabulary's extra columns are not masked, as in the PyTorch peer).
//!
//! `W [vocab, d]` is either the head's own parameter (`<path>.weight`) or a table held by another module
//! ([`LmHead::tied`], GPT-2's head tied to the token embedding): the head then declares nothing and uses
//! the table's [`ParamId`], so the parameter has one gradient, the sum of both uses.
//!
//! In FP8 ([`LmHead::with_fp8`], `lm_fsdp --fp8-head`) the three GEMMs of a chunk run on FP8 codes with
//! current per-tensor scaling: `x` and `W` in E4M3 at power-of-two scales from their amaxes (`W` and
//! `W^T` cast once per pass, `x` per chunk with the scale of the whole input), the logits gradient in
//! E5M2 at a static power-of-two scale: every entry of `grad_scale / tokens * (softmax - onehot)` lies
//! within `|grad_scale| / tokens`, so that bound replaces an amax pass (the largest entry of a chunk, a
//! badly predicted target, sits within a binade of it). The cross-entropy itself stays in F32 on the
//! logits the FP8 GEMM writes in the activation type and writes the gradient's E5M2 codes in the same pass
//! (`fp8_kernels::cross_entropy::cross_entropy_to_fp8`); the weight-gradient GEMM reads them transposed.
//! [`LmHead::logits`] (sampling) stays in float.
//!
//! Two ways to get the gradients:
//! - [`LmHead::forward`] keeps its input; [`LmHead::backward`] recomputes each chunk's logits (one more
//!   GEMM of `2 tokens d vocab` flops) and produces the gradients;
//! - [`LmHead::forward_with_grad`] knows the gradient scale already and produces the gradients during
//!   the forward (no recomputation); [`LmHead::backward`] then hands them over.

use crate::init::normal;
use crate::layer::Activation;
use crate::layer::{rows_of_width, take_saved};
use crate::plain_param::{plain_in, plain_into, plain_owned};
use crate::{NnError, Tensor};
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use fp8_kernels::cast::{amax, cast_to_fp8, cast_transpose_to_fp8, AmaxSlot};
use fp8_kernels::cross_entropy::{
    cross_entropy, cross_entropy_to_fp8, CrossEntropyFp8Grad, CrossEntropyOutputs, CrossEntropySpec,
};
use fp8_kernels::gemm::{gemm, gemm_at, gemm_fp8, gemm_fp8_at, DeviceScalar, Fp8Matrix};
use fp8_kernels::scaling::scale_from_amax;
use fp8_kernels::{Buffer, CpuParallelism, Device, FloatElement, GemmSpec, Transpose};
use fsdp_shard::{Ctx, Module, ParamDecl, ParamId, ParamKind, PlainParam, ShardError, Visitor};

/// Tokens per chunk of the head by default (4096 tokens of a 50304-word vocabulary: 412 MB of BF16
/// logits).
pub const DEFAULT_HEAD_CHUNK: usize = 4096;

/// The loss of the last forward, on the device (nothing is read back unless asked).
#[derive(Debug)]
pub struct LossStats {
    /// `[1]`: the sum of the per-token losses.
    pub sum: Buffer<f32>,
    /// `[1]`: targets outside the vocabulary (0 for a checked [`crate::TokenBatch`]).
    pub invalid_targets: Buffer<u32>,
    /// `[tokens]`: each token's loss.
    pub per_token: Buffer<f32>,
    /// `[tokens]`: each token's log-sum-exp of the logits.
    pub lse: Buffer<f32>,
    /// Tokens of the forward.
    pub tokens: usize,
}

impl LossStats {
    /// The mean loss over the tokens (reads the device).
    pub fn mean(&self) -> Result<f64, NnError> {
        let s = self.sum.to_vec()?;
        Ok(s.first().copied().unwrap_or(f32::NAN) as f64 / self.tokens.max(1) as f64)
    }
}

/// Gradients computed during the forward ([`LmHead::forward_with_grad`]).
#[derive(Debug)]
struct EarlyGrads<T: Activation> {
    grad_scale: f32,
    dx: Tensor<T>,
}

/// The sizes of one chunk's products: `c` tokens of width `d` against `vocab` rows of `W`.
struct HeadChunk {
    c: usize,
    d: usize,
    vocab: usize,
    par: CpuParallelism,
}

/// The chunk's GEMMs: in the activation type on `W` owned by the pass (so that the weight's gradient can
/// be accumulated in the model's gradient while it is in use): the gathered table taken out of its unit
/// when the pass computes gradients (moved when gathered in the activation type, else converted once),
/// else a copy; or on FP8 codes.
enum HeadGemms<'w, T: Activation> {
    Float(Buffer<T>),
    Fp8(Box<Fp8HeadOperands<'w>>),
}

impl<T: Activation> HeadGemms<'_, T> {
    /// `logits = x_c W^T`; in FP8 with `training` also returns `x_c^T`'s codes for the weight gradient.
    fn logits(
        &self,
        dev: &Device,
        s: &HeadChunk,
        xc: &Buffer<T>,
        training: bool,
        logits: &mut Buffer<T>,
    ) -> Result<Option<Buffer<u8>>, NnError> {
        let spec = GemmSpec::new(s.c, s.vocab, s.d)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(s.par);
        match self {
            HeadGemms::Float(w) => {
                gemm(&spec, xc, w, logits)?;
                Ok(None)
            }
            HeadGemms::Fp8(ops) => {
                let (xq, xq_t) = ops.cast_input(dev, xc, [s.c, s.d], training)?;
                gemm_fp8(&spec, ops.x_matrix(&xq)?, ops.w_matrix()?, logits)?;
                Ok(xq_t)
            }
        }
    }

    /// The chunk's cross-entropy (loss and log-sum-exp into `out`); with `spec.grad_scale` also the logits
    /// gradient: in the activation type over the logits (float), or as E5M2 codes at the static gradient
    /// scale written by the same pass, the logits freed at once (FP8).
    fn cross_entropy(
        &self,
        dev: &Device,
        spec: &CrossEntropySpec,
        mut logits: Buffer<T>,
        targets: &Buffer<i32>,
        out: CrossEntropyOutputs<'_>,
    ) -> Result<Option<ChunkGrad<T>>, NnError> {
        match (self, spec.grad_scale) {
            (HeadGemms::Fp8(ops), Some(_)) => {
                let gs = ops
                    .grad_scale
                    .ok_or_else(|| NnError::usage("LmHead", "no gradient scale"))?;
                let mut codes = dev.uninit::<u8>(logits.len())?;
                let sink = CrossEntropyFp8Grad {
                    codes: &mut codes,
                    format: Fp8Format::E5M2,
                    scale: DeviceScalar::new(gs, 0)?,
                };
                cross_entropy_to_fp8(spec, &logits, targets, out, sink)?;
                Ok(Some(ChunkGrad::Fp8(codes)))
            }
            (_, grad) => {
                cross_entropy(spec, &mut logits, targets, out)?;
                Ok(grad.map(|_| ChunkGrad::Float(logits)))
            }
        }
    }

    /// From the chunk's logits gradient `G`: `dx_c = G W` into `dx` and `dW += G^T x_c` into the
    /// weight's gradient, the range `dw.1..` of the flat gradient `dw.0`.
    fn gradients(
        &self,
        s: &HeadChunk,
        g: ChunkGrad<T>,
        (xc, xq_t): (&Buffer<T>, Option<Buffer<u8>>),
        dx: &mut Buffer<T>,
        (dw, at): (&mut Buffer<f32>, usize),
    ) -> Result<(), NnError> {
        let dx_spec = GemmSpec::new(s.c, s.d, s.vocab).parallelism(s.par);
        let dw_spec = GemmSpec::new(s.vocab, s.d, s.c)
            .scalars(1.0, 1.0)
            .parallelism(s.par);
        match (self, g) {
            (HeadGemms::Float(w), ChunkGrad::Float(g)) => {
                gemm(&dx_spec, &g, w, dx)?;
                let dw_spec = dw_spec.transposes(Transpose::Yes, Transpose::No);
                gemm_at(&dw_spec, &g, xc, dw, at)?;
            }
            (HeadGemms::Fp8(ops), ChunkGrad::Fp8(gq)) => {
                let xq_t = xq_t.ok_or_else(|| NnError::usage("LmHead", "no x^T codes kept"))?;
                let gs = ops
                    .grad_scale
                    .ok_or_else(|| NnError::usage("LmHead", "no gradient scale"))?;
                let codes = |data| -> Result<Fp8Matrix<'_>, NnError> {
                    Ok(Fp8Matrix {
                        data,
                        format: Fp8Format::E5M2,
                        scale_inv: DeviceScalar::new(gs, 1)?,
                    })
                };
                let dx_spec = dx_spec.transposes(Transpose::No, Transpose::Yes);
                gemm_fp8(&dx_spec, codes(&gq)?, ops.w_t_matrix()?, dx)?;
                // `G^T` as the GEMM's transposed operand: it lays the codes out K-major itself (one
                // pass over a byte per entry), where a transposed copy made beside the row-major one
                // would hold both at once.
                let dw_spec = dw_spec.transposes(Transpose::Yes, Transpose::Yes);
                gemm_fp8_at(&dw_spec, codes(&gq)?, ops.x_matrix(&xq_t)?, dw, at)?;
            }
            _ => {
                return Err(NnError::usage(
                    "LmHead",
                    "a logits gradient of the other head kind",
                ))
            }
        }
        Ok(())
    }
}

/// A chunk's logits gradient: in the activation type, or as E5M2 codes (FP8 head).
enum ChunkGrad<T: Activation> {
    Float(Buffer<T>),
    Fp8(Buffer<u8>),
}

/// The FP8 operands of a head pass: `W` (and `W^T` when training) in E4M3, cast once; the scale of `x`
/// from the amax of the whole input; each at the power-of-two scale of its amax; and when training the
/// static scale of the E5M2 logits gradient.
struct Fp8HeadOperands<'s> {
    w: Buffer<u8>,
    w_t: Option<Buffer<u8>>,
    w_scale_inv: Buffer<f32>,
    x_scale: Buffer<f32>,
    x_scale_inv: Buffer<f32>,
    /// `[scale, scale_inv]` of the logits gradient (training only; [`LmHead::gradient_scale`]).
    grad_scale: Option<&'s Buffer<f32>>,
}

impl<'s> Fp8HeadOperands<'s> {
    /// With `grad_scale` when training (then `W^T` is cast too).
    fn new<S: FloatElement, T: FloatElement>(
        dev: &Device,
        w: &Buffer<S>,
        x: &Buffer<T>,
        [vocab, d]: [usize; 2],
        grad_scale: Option<&'s Buffer<f32>>,
    ) -> Result<Self, NnError> {
        let e4m3 = Fp8Format::E4M3;
        let scales = |src_amax: &Buffer<f32>| -> Result<(Buffer<f32>, Buffer<f32>), NnError> {
            let (mut s, mut si) = (dev.zeros::<f32>(1)?, dev.zeros::<f32>(1)?);
            scale_from_amax(src_amax, e4m3, 0, &mut s, &mut si)?;
            Ok((s, si))
        };
        let mut w_amax = dev.zeros::<f32>(1)?;
        amax(w, AmaxSlot::first(&mut w_amax))?;
        let (w_scale, w_scale_inv) = scales(&w_amax)?;
        let mut wq = dev.uninit::<u8>(vocab * d)?;
        let w_t = if grad_scale.is_some() {
            let mut t = dev.uninit::<u8>(vocab * d)?;
            cast_transpose_to_fp8(w, [vocab, d], e4m3, &w_scale, &mut t, Some(&mut wq), None)?;
            Some(t)
        } else {
            cast_to_fp8(w, e4m3, &w_scale, &mut wq, None)?;
            None
        };
        let mut x_amax = dev.zeros::<f32>(1)?;
        amax(x, AmaxSlot::first(&mut x_amax))?;
        let (x_scale, x_scale_inv) = scales(&x_amax)?;
        Ok(Fp8HeadOperands {
            w: wq,
            w_t,
            w_scale_inv,
            x_scale,
            x_scale_inv,
            grad_scale,
        })
    }

    /// The E4M3 codes of a chunk `x_c [rows, d]`, and with `transposed` also of `x_c^T`.
    fn cast_input<T: FloatElement>(
        &self,
        dev: &Device,
        xc: &Buffer<T>,
        shape: [usize; 2],
        transposed: bool,
    ) -> Result<(Buffer<u8>, Option<Buffer<u8>>), NnError> {
        let mut q = dev.uninit::<u8>(xc.len())?;
        if transposed {
            let mut t = dev.uninit::<u8>(xc.len())?;
            let e4m3 = Fp8Format::E4M3;
            cast_transpose_to_fp8(xc, shape, e4m3, &self.x_scale, &mut t, Some(&mut q), None)?;
            Ok((q, Some(t)))
        } else {
            cast_to_fp8(xc, Fp8Format::E4M3, &self.x_scale, &mut q, None)?;
            Ok((q, None))
        }
    }

    fn matrix<'a>(
        data: &'a Buffer<u8>,
        scale_inv: &'a Buffer<f32>,
    ) -> Result<Fp8Matrix<'a>, NnError> {
        Ok(Fp8Matrix {
            data,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar::new(scale_inv, 0)?,
        })
    }

    fn x_matrix<'a>(&'a self, codes: &'a Buffer<u8>) -> Result<Fp8Matrix<'a>, NnError> {
        Self::matrix(codes, &self.x_scale_inv)
    }

    fn w_matrix(&self) -> Result<Fp8Matrix<'_>, NnError> {
        Self::matrix(&self.w, &self.w_scale_inv)
    }

    fn w_t_matrix(&self) -> Result<Fp8Matrix<'_>, NnError> {
        let data = self
            .w_t
            .as_ref()
            .ok_or_else(|| NnError::usage("LmHead", "W^T codes of an evaluation pass"))?;
        Self::matrix(data, &self.w_scale_inv)
    }
}

/// The LM head `logits = x W^T` with the mean cross-entropy against targets; `W [vocab, d]`.
#[derive(Debug)]
pub struct LmHead<T: Activation = f32> {
    name: String,
    d: usize,
    vocab: usize,
    chunk: usize,
    owns_weight: bool,
    std: f64,
    /// An explicit seed of its own weight; `None`: the weight's own seed.
    seed: Option<u64>,
    weight: ParamId,
    /// The GEMMs run on FP8 codes (see the module docs).
    fp8: bool,
    /// The FP8 logits gradient's `[scale, scale_inv]` on the device and the row scale it is for: uploaded
    /// once, not every step (an upload from pageable memory may wait for the stream).
    fp8_grad_scale: Option<(u32, Buffer<f32>)>,
    stats: Option<LossStats>,
    x: Option<Tensor<T>>,
    early: Option<EarlyGrads<T>>,
}

impl<T: Activation> LmHead<T> {
    fn make(d: usize, vocab: usize, owns_weight: bool) -> Result<Self, NnError> {
        if d == 0 || vocab == 0 {
            return Err(NnError::usage("LmHead", format!("d {d}, vocab {vocab}")));
        }
        Ok(LmHead {
            name: "LmHead".into(),
            d,
            vocab,
            chunk: DEFAULT_HEAD_CHUNK,
            owns_weight,
            std: 0.02,
            seed: None,
            weight: ParamId::UNSET,
            fp8: false,
            fp8_grad_scale: None,
            stats: None,
            x: None,
            early: None,
        })
    }

    /// A head with its own weight `[vocab, d]` (`<path>.weight`), `N(0, 0.02^2)` drawn from its seed.
    pub fn new(d: usize, vocab: usize) -> Result<Self, NnError> {
        Self::make(d, vocab, true)
    }

    /// With its own weight drawn from `seed` instead of the weight's own seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// A head using another module's `[vocab, d]` table (set by [`LmHead::set_table`] after the owner's
    /// visit assigned its id).
    pub fn tied(d: usize, vocab: usize) -> Result<Self, NnError> {
        Self::make(d, vocab, false)
    }

    /// With another initial standard deviation of its own weight.
    pub fn with_std(mut self, std: f64) -> Self {
        self.std = std;
        self
    }

    /// With chunks of at most `tokens` tokens (`>= 1`).
    pub fn with_chunk(mut self, tokens: usize) -> Result<Self, NnError> {
        if tokens == 0 {
            return Err(NnError::usage("LmHead", "chunks of 0 tokens"));
        }
        self.chunk = tokens;
        Ok(self)
    }

    /// With the GEMMs in FP8 (`true`) or in the activation type (see the module docs).
    pub fn with_fp8(mut self, on: bool) -> Self {
        self.fp8 = on;
        self
    }

    /// Sets whether the GEMMs run in FP8 (the model-wide conversion, [`crate::convert_lm_heads_to_fp8`]).
    pub fn set_fp8(&mut self, on: bool) {
        self.fp8 = on;
    }

    /// Whether the GEMMs run in FP8.
    pub fn is_fp8(&self) -> bool {
        self.fp8
    }

    /// Tokens per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Uses the table `id` (a tied head).
    pub fn set_table(&mut self, id: ParamId) {
        self.weight = id;
    }

    /// The weight's id (the table's when tied).
    pub fn weight_id(&self) -> ParamId {
        self.weight
    }

    /// The loss of the last forward.
    pub fn loss(&self) -> Result<&LossStats, NnError> {
        self.stats
            .as_ref()
            .ok_or_else(|| NnError::usage(&self.name, "no forward yet"))
    }

    /// Bytes kept for the backward.
    pub fn saved_bytes(&self) -> usize {
        self.x.as_ref().map_or(0, |x| x.data().num_bytes())
            + self.early.as_ref().map_or(0, |e| e.dx.data().num_bytes())
    }

    /// The loss of `x [..., d]` against `targets` (one per row of `x`); in training keeps `x` for
    /// [`LmHead::backward`].
    pub fn forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: Tensor<T>,
        targets: &Buffer<i32>,
    ) -> Result<(), NnError> {
        self.early = None;
        self.run(ctx, &x, targets, None)?;
        self.x = ctx.is_training().then_some(x);
        Ok(())
    }

    /// A training forward that also computes the gradients of `grad_scale` times the mean loss (the same
    /// scale must then be given to [`LmHead::backward`]): `dW` goes into the model's gradient at once
    /// (accumulated chunk by chunk in the flat gradient, [`Ctx::grad_slot`]), `dx` (`x`'s shape) is kept
    /// instead of `x` for the backward to return.
    pub fn forward_with_grad(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: Tensor<T>,
        targets: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<(), NnError> {
        if !ctx.is_training() {
            return Err(NnError::usage(
                &self.name,
                "forward_with_grad in an evaluation pass",
            ));
        }
        self.x = None;
        self.early = None;
        let dx = self
            .run(ctx, &x, targets, Some(grad_scale))?
            .ok_or_else(|| NnError::usage("LmHead", "no gradient computed"))?;
        self.early = Some(EarlyGrads { grad_scale, dx });
        Ok(())
    }

    /// The backward: adds `dW` of `grad_scale` times the mean loss of the last training forward to the
    /// model (unless [`LmHead::forward_with_grad`] did) and returns `dx`.
    pub fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        targets: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<Tensor<T>, NnError> {
        let dx = if let Some(e) = self.early.take() {
            if e.grad_scale.to_bits() != grad_scale.to_bits() {
                return Err(NnError::usage(
                    &self.name,
                    format!(
                        "the forward computed the gradients with scale {}, the backward asks {grad_scale}",
                        e.grad_scale
                    ),
                ));
            }
            e.dx
        } else {
            let x = take_saved(&mut self.x, &self.name)?;
            // The loss statistics of the forward stay; the recomputation's go to scratch accumulators.
            let kept = self.stats.take();
            let r = self.run(ctx, &x, targets, Some(grad_scale));
            self.stats = kept;
            r?.ok_or_else(|| NnError::usage("LmHead", "no gradient computed"))?
        };
        Ok(dx)
    }

    /// The chunked loop: loss into fresh statistics; with a gradient scale also `dW`, accumulated into
    /// the model's gradient in place, and the returned `dx`.
    fn run(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<T>,
        targets: &Buffer<i32>,
        grad_scale: Option<f32>,
    ) -> Result<Option<Tensor<T>>, NnError> {
        let (d, vocab) = (self.d, self.vocab);
        let tokens = rows_of_width(&self.name, x.shape(), d)?;
        if targets.len() != tokens || tokens == 0 {
            return Err(NnError::usage(
                &self.name,
                format!("{} targets for {tokens} rows", targets.len()),
            ));
        }
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let mut stats = LossStats {
            sum: dev.zeros(1)?,
            invalid_targets: dev.zeros(1)?,
            per_token: dev.uninit(tokens)?,
            lse: dev.uninit(tokens)?,
            tokens,
        };
        let mut dx = match grad_scale {
            Some(_) => Some(Tensor::<T>::uninit(&dev, x.shape())?),
            None => None,
        };
        // Gradient of `grad_scale * mean`: each row's `(softmax - onehot)` times `grad_scale / tokens`.
        let row_scale = grad_scale.map(|g| g / tokens as f32);
        let weight = self.weight;
        // A pass that computes the gradients reads the table once (to cast it to E4M3, or as the float
        // GEMMs' own copy) and never again in this step: it takes the gathered copy out of its unit, so
        // the table's memory goes before the chunk loop instead of when the unit is released (for a
        // table in the root unit, after the backward).
        let taken = match row_scale {
            Some(_) => Some(ctx.take_param(weight)?),
            None => None,
        };
        let w = match &taken {
            Some(t) => t
                .as_plain()
                .ok_or_else(|| NnError::usage(&self.name, "the table is an FP8 weight"))?,
            None => ctx.plain_param(weight)?,
        };
        if w.len() != vocab * d {
            return Err(NnError::usage(
                &self.name,
                format!("a table of {} elements for {vocab} x {d}", w.len()),
            ));
        }
        let gemms = if self.fp8 {
            let grad_scale = match row_scale {
                Some(r) => Some(Self::gradient_scale(&mut self.fp8_grad_scale, &dev, r)?),
                None => None,
            };
            // The E4M3 codes straight from the table as gathered (F32, or BF16 without a widened copy).
            let ops = match w {
                PlainParam::F32(w) => {
                    Fp8HeadOperands::new(&dev, w, x.data(), [vocab, d], grad_scale)?
                }
                PlainParam::Bf16(w) => {
                    Fp8HeadOperands::new(&dev, w, x.data(), [vocab, d], grad_scale)?
                }
            };
            drop(taken);
            HeadGemms::Fp8(Box::new(ops))
        } else {
            match taken {
                // Moved when gathered in `T`: no copy beside the gathered one.
                Some(t) => HeadGemms::Float(plain_into::<T>(t, &self.name)?),
                None => HeadGemms::Float(plain_owned::<T>(&dev, w)?),
            }
        };
        let chunk = self.chunk.min(tokens);
        for a in (0..tokens).step_by(chunk) {
            let c = chunk.min(tokens - a);
            let whole = c == tokens;
            let copied;
            let xc = if whole {
                x.data()
            } else {
                let mut b = dev.uninit::<T>(c * d)?;
                b.copy_range_from(0, x.data(), a * d, c * d)?;
                copied = b;
                &copied
            };
            let mut logits = dev.uninit::<T>(c * vocab)?;
            let shape = HeadChunk { c, d, vocab, par };
            let xq_t = gemms.logits(&dev, &shape, xc, dx.is_some(), &mut logits)?;
            let spec = CrossEntropySpec {
                rows: c,
                vocab,
                row_offset: a,
                ignore_index: None,
                grad_scale: row_scale,
            };
            let outputs = CrossEntropyOutputs {
                lse: &mut stats.lse,
                loss: &mut stats.per_token,
                loss_sum: &mut stats.sum,
                invalid_targets: &mut stats.invalid_targets,
            };
            let g = gemms.cross_entropy(&dev, &spec, logits, targets, outputs)?;
            if let (Some(dx), Some(g)) = (dx.as_mut(), g) {
                let inputs = (xc, xq_t);
                // `dW` straight into the weight's range of the flat gradient: no F32 copy of the table
                // beside it, no pass that adds one.
                let dw = ctx.grad_slot(weight)?;
                if whole {
                    gemms.gradients(&shape, g, inputs, dx.data_mut(), dw)?;
                } else {
                    let mut dxc = dev.uninit::<T>(c * d)?;
                    gemms.gradients(&shape, g, inputs, &mut dxc, dw)?;
                    dx.data_mut().copy_range_from(a * d, &dxc, 0, c * d)?;
                }
            }
        }
        drop(gemms);
        self.stats = Some(stats);
        Ok(dx)
    }

    /// `[scale, scale_inv]` of the E5M2 logits gradient for rows scaled by `row_scale`: the power-of-two
    /// scale of the bound `|row_scale|` (every entry of the gradient lies within it; see the module docs),
    /// kept in `cache` while the row scale stays.
    fn gradient_scale<'c>(
        cache: &'c mut Option<(u32, Buffer<f32>)>,
        dev: &Device,
        row_scale: f32,
    ) -> Result<&'c Buffer<f32>, NnError> {
        let bits = row_scale.to_bits();
        if let Some(kept) = cache.take().filter(|(b, _)| *b == bits) {
            return Ok(&cache.insert(kept).1);
        }
        let s = compute_scale(
            row_scale.abs(),
            Fp8Format::E5M2.max(),
            0,
            ScaleRounding::PowerOfTwo,
            1.0,
        );
        Ok(&cache.insert((bits, dev.upload(&[s, 1.0 / s])?)).1)
    }

    /// The logits `x W^T` (`[rows, vocab]`, in the activation type) of a few rows, e.g. the last position
    /// when sampling; no loss, nothing kept.
    pub fn logits(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<T>) -> Result<Tensor<T>, NnError> {
        let (d, vocab) = (self.d, self.vocab);
        let rows = rows_of_width(&self.name, x.shape(), d)?;
        let dev = ctx.device().clone();
        let par = ctx.cpu_parallelism();
        let mut out = Tensor::<T>::uninit(&dev, crate::Shape::matrix(rows, vocab)?)?;
        let mut scratch = None;
        let w = plain_in::<T>(ctx.plain_param(self.weight)?, &mut scratch)?;
        let spec = GemmSpec::new(rows, vocab, d)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(par);
        gemm(&spec, x.data(), w, out.data_mut())?;
        Ok(out)
    }

    /// Frees what the last forward kept.
    pub fn drop_saved(&mut self) {
        self.x = None;
        self.early = None;
    }
}

impl<T: Activation> Module for LmHead<T> {
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        self.name = v.path().module();
        if !self.owns_weight {
            return Ok(());
        }
        let (n, std, seed) = (self.vocab * self.d, self.std, self.seed);
        let init = move |own: u64| normal(n, std, seed.unwrap_or(own));
        v.param(
            "weight",
            &ParamDecl::seeded(&[self.vocab, self.d], ParamKind::Plain, &init),
            &mut self.weight,
        )
    }
}
