//! The linear operation `y = x W^T (+ bias)`, the functional core of a `Linear` layer, in FP8
//! ([`Fp8Linear`]) and in BF16/F32 ([`FloatLinear`]), with the same shapes: `x [tokens, in]`,
//! `W [out, in]` (PyTorch layout), `y [tokens, out]`, all row-major.
//!
//! # FP8 recipe
//! - forward: `x` is cast to E4M3 with the input meta's (delayed) scale, recording its amax; the cast also
//!   writes `x^T` in FP8, which is all the backward pass keeps of `x` (1 byte per element). The weight
//!   arrives in E4M3 with its `scale_inv` (from the FSDP all-gather); `y = x_q W_q^T` is one FP8 GEMM
//!   (f32 accumulation, both scales applied from device pointers), output f32 or bf16.
//! - backward: `dy` is cast to E5M2 with the output-gradient meta's scale (recording its amax), in both
//!   layouts; `dx = dy_q W_q` (E5M2 x E4M3) and `dW = dy_q^T x_q` (E5M2 x E4M3), f32 accumulation, `dW`
//!   optionally accumulated (`beta = 1`).
//! - metas: input and output gradient use delayed scaling by default (window 16): casts accumulate the
//!   step's amax into the meta's pending slot and [`Fp8Linear::update_scales`] (once per step, after any
//!   cross-rank amax reduction) moves it into the history and recomputes the scale. The weight meta uses
//!   current scaling ([`Fp8Linear::cast_weight`]) unless the weight arrives with its own scale.
//!
//! The CPU path runs the same casts (bit-identical to the CUDA casts) and dequantizes for its f32 GEMMs,
//! so CPU and GPU results differ only by GEMM accumulation order.
//!
//! Bias: `y` is first set to the broadcast bias (a rank-1 GEMM with a ones vector, exact), then the main
//! GEMM accumulates into it (`beta = 1`); the bias gradient is `dy^T * ones`, also a GEMM.

use crate::gemm::{
    gemm, gemm_fp8, CpuParallelism, DeviceScalar, Fp8Matrix, GemmOutput, GemmSpec, Transpose,
};
use crate::{Buffer, Device, DeviceScalingMeta, FloatElement, KernelError};
use fp8_core::{Fp8Format, QType, ScalingRecipe};

/// Input element types of the linear operations: f32 or bf16.
pub trait LinearElement: GemmOutput {}
impl LinearElement for f32 {}
impl LinearElement for half::bf16 {}

/// Scaling recipes and CPU threading of an [`Fp8Linear`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8LinearConfig {
    /// Recipe of the input (E4M3) meta. Default: delayed, window 16.
    pub input_recipe: ScalingRecipe,
    /// Recipe of the weight (E4M3) meta. Default: current scaling.
    pub weight_recipe: ScalingRecipe,
    /// Recipe of the output-gradient (E5M2) meta. Default: delayed, window 16.
    pub grad_output_recipe: ScalingRecipe,
    /// Threading of the CPU GEMMs (use `Single` when ranks run as threads).
    pub parallelism: CpuParallelism,
}

impl Default for Fp8LinearConfig {
    fn default() -> Self {
        Fp8LinearConfig {
            input_recipe: ScalingRecipe::delayed_default(),
            weight_recipe: ScalingRecipe::current_default(),
            grad_output_recipe: ScalingRecipe::delayed_default(),
            parallelism: CpuParallelism::default(),
        }
    }
}

/// What the FP8 forward keeps for the backward: `x^T` in E4M3 and the scale it was cast with.
#[derive(Debug)]
pub struct Fp8LinearSaved {
    tokens: usize,
    x_t: Buffer<u8>,
    x_scale_inv: Buffer<f32>,
}

impl Fp8LinearSaved {
    /// Zeroed buffers for the saved input of `tokens` rows of `in_features` (for
    /// [`Fp8Linear::forward_into`], which fills them; allocate once and reuse every step).
    pub fn zeros(device: &Device, tokens: usize, in_features: usize) -> Result<Self, KernelError> {
        let n = tokens.checked_mul(in_features).ok_or_else(|| {
            bad(
                "Fp8LinearSaved::zeros",
                format!("{tokens} x {in_features} overflows"),
            )
        })?;
        Ok(Fp8LinearSaved {
            tokens,
            x_t: device.zeros(n)?,
            x_scale_inv: device.zeros(1)?,
        })
    }

    /// Number of rows of `x`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// `x^T` as E4M3 codes, row-major `[in, tokens]`.
    pub fn x_t(&self) -> &Buffer<u8> {
        &self.x_t
    }

    /// The inverse scale `x` was cast with (one element).
    pub fn x_scale_inv(&self) -> &Buffer<f32> {
        &self.x_scale_inv
    }

    /// Bytes held (for memory accounting).
    pub fn num_bytes(&self) -> usize {
        self.x_t.num_bytes() + self.x_scale_inv.num_bytes()
    }

    /// `x^T`, the scale-inverse slot and the row count, for kernels of this crate that quantize an input
    /// themselves (the fused GELU + cast of `crate::fused`).
    pub(crate) fn parts_mut(&mut self) -> (&mut Buffer<u8>, &mut Buffer<f32>, &mut usize) {
        (&mut self.x_t, &mut self.x_scale_inv, &mut self.tokens)
    }
}

/// The FP8 linear operation with its three scaling metas (input, weight, output gradient).
#[derive(Debug)]
pub struct Fp8Linear {
    in_features: usize,
    out_features: usize,
    device: Device,
    input: DeviceScalingMeta,
    weight: DeviceScalingMeta,
    grad_output: DeviceScalingMeta,
    parallelism: CpuParallelism,
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// Rows of a row-major `[rows, cols]` buffer of `len` elements, or an error.
fn rows_of(what: &'static str, len: usize, cols: usize) -> Result<usize, KernelError> {
    if cols == 0 || len % cols != 0 {
        return Err(bad(
            what,
            format!("{len} elements are not a whole number of rows of {cols}"),
        ));
    }
    Ok(len / cols)
}

/// `y[t, :] = bias` for every row: zero, then [`crate::ops::bias_add`] (exact; no per-call upload, one
/// memset and one elementwise launch on CUDA).
fn broadcast_bias<O: GemmOutput>(
    bias: &Buffer<O>,
    tokens: usize,
    y: &mut Buffer<O>,
) -> Result<(), KernelError> {
    y.fill_zero()?;
    crate::ops::bias_add(y, bias, tokens, bias.len())
}

/// `db (+)= sum over rows of dy`, in f32: the column sums of [`crate::ops::sum_over_rows`] (a fixed
/// order, identical on CPU and CUDA, and no per-call upload), added to `db` when `accumulate`.
fn bias_grad<T: LinearElement>(
    dy: &Buffer<T>,
    tokens: usize,
    out: usize,
    db: &mut Buffer<f32>,
    accumulate: bool,
) -> Result<(), KernelError> {
    crate::check_len("linear bias gradient", out, db.len())?;
    if !accumulate {
        return crate::ops::sum_over_rows(dy, tokens, out, db);
    }
    let mut sums = db.device().zeros::<f32>(out)?;
    crate::ops::sum_over_rows(dy, tokens, out, &mut sums)?;
    crate::ops::axpy(1.0, &sums, db)
}

impl Fp8Linear {
    /// A linear operation of `in_features -> out_features` on `device` with fresh metas.
    pub fn new(
        device: &Device,
        in_features: usize,
        out_features: usize,
        config: Fp8LinearConfig,
    ) -> Result<Self, KernelError> {
        if in_features == 0 || out_features == 0 {
            return Err(bad(
                "Fp8Linear",
                format!("features must be positive ({in_features} -> {out_features})"),
            ));
        }
        if let Device::Cuda(d) = device {
            d.require_fp8()?;
        }
        Ok(Fp8Linear {
            in_features,
            out_features,
            device: device.clone(),
            input: DeviceScalingMeta::fresh(device, QType::E4M3, config.input_recipe)?,
            weight: DeviceScalingMeta::fresh(device, QType::E4M3, config.weight_recipe)?,
            grad_output: DeviceScalingMeta::fresh(device, QType::E5M2, config.grad_output_recipe)?,
            parallelism: config.parallelism,
        })
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The input (E4M3) meta.
    pub fn input_meta(&self) -> &DeviceScalingMeta {
        &self.input
    }

    /// The input meta, mutable (e.g. to all-reduce its pending amax).
    pub fn input_meta_mut(&mut self) -> &mut DeviceScalingMeta {
        &mut self.input
    }

    /// The weight (E4M3) meta.
    pub fn weight_meta(&self) -> &DeviceScalingMeta {
        &self.weight
    }

    /// The weight meta, mutable.
    pub fn weight_meta_mut(&mut self) -> &mut DeviceScalingMeta {
        &mut self.weight
    }

    /// The output-gradient (E5M2) meta.
    pub fn grad_output_meta(&self) -> &DeviceScalingMeta {
        &self.grad_output
    }

    /// The output-gradient meta, mutable.
    pub fn grad_output_meta_mut(&mut self) -> &mut DeviceScalingMeta {
        &mut self.grad_output
    }

    /// Casts a high-precision weight `[out, in]` to E4M3 with the weight meta (current scaling: amax,
    /// scale, cast; the meta's scale then belongs to `out`).
    pub fn cast_weight<T: FloatElement>(
        &mut self,
        w: &Buffer<T>,
        out: &mut Buffer<u8>,
    ) -> Result<(), KernelError> {
        let n = self.in_features * self.out_features;
        crate::check_len("Fp8Linear::cast_weight", n, w.len())?;
        self.weight.cast_current(w, out)
    }

    /// The weight operand built from E4M3 codes cast with this op's weight meta.
    pub fn weight_operand<'a>(&'a self, codes: &'a Buffer<u8>) -> Fp8Matrix<'a> {
        Fp8Matrix {
            data: codes,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar {
                buffer: self.weight.scale_inv(),
                index: 0,
            },
        }
    }

    fn check_weight(&self, what: &'static str, w: &Buffer<u8>) -> Result<(), KernelError> {
        crate::check_len(what, self.in_features * self.out_features, w.len())
    }

    /// Forward: `y = x W^T (+ bias)`; returns what the backward needs. `x` is `[tokens, in]`, `y` is
    /// `[tokens, out]`, `bias` `[out]`. `weight` holds E4M3 codes `[out, in]`; their inverse scale is
    /// `weight_scale_inv`, or this op's weight meta when `None`.
    ///
    /// Allocates its FP8 operands on every call; [`Fp8Linear::forward_into`] takes them from the caller.
    pub fn forward<T: LinearElement, O: GemmOutput>(
        &mut self,
        x: &Buffer<T>,
        weight: &Buffer<u8>,
        weight_scale_inv: Option<DeviceScalar<'_>>,
        bias: Option<&Buffer<O>>,
        y: &mut Buffer<O>,
    ) -> Result<Fp8LinearSaved, KernelError> {
        let tokens = rows_of("Fp8Linear::forward", x.len(), self.in_features)?;
        let mut saved = Fp8LinearSaved::zeros(&self.device, tokens, self.in_features)?;
        let mut x_q = self.device.zeros::<u8>(tokens * self.in_features)?;
        self.forward_into(x, weight, weight_scale_inv, bias, y, &mut x_q, &mut saved)?;
        Ok(saved)
    }

    /// [`Fp8Linear::forward`] into caller-provided buffers (no allocation on CUDA but the bias path):
    /// `x_q` (E4M3 codes of `x`, `[tokens, in]`, scratch) and `saved` (from
    /// [`Fp8LinearSaved::zeros`] with the same `tokens`), which receives what the backward needs.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into<T: LinearElement, O: GemmOutput>(
        &mut self,
        x: &Buffer<T>,
        weight: &Buffer<u8>,
        weight_scale_inv: Option<DeviceScalar<'_>>,
        bias: Option<&Buffer<O>>,
        y: &mut Buffer<O>,
        x_q: &mut Buffer<u8>,
        saved: &mut Fp8LinearSaved,
    ) -> Result<(), KernelError> {
        self.quantize_input(x, x_q, saved)?;
        self.forward_quantized(x_q, saved, weight, weight_scale_inv, bias, y)
    }

    /// First half of the forward: casts `x [tokens, in]` to E4M3 with the input meta (recording its amax)
    /// into `x_q` and `saved`'s `x^T`, and keeps the scale used in `saved` (the meta may change before
    /// the backward runs).
    pub fn quantize_input<T: LinearElement>(
        &mut self,
        x: &Buffer<T>,
        x_q: &mut Buffer<u8>,
        saved: &mut Fp8LinearSaved,
    ) -> Result<(), KernelError> {
        const WHAT: &str = "Fp8Linear::quantize_input";
        let inf = self.in_features;
        let tokens = rows_of(WHAT, x.len(), inf)?;
        crate::check_len(WHAT, tokens * inf, x_q.len())?;
        crate::check_len(WHAT, tokens * inf, saved.x_t.len())?;
        crate::check_len(WHAT, 1, saved.x_scale_inv.len())?;
        self.input
            .cast_transpose(x, [tokens, inf], &mut saved.x_t, Some(x_q))?;
        saved.x_scale_inv.copy_from(self.input.scale_inv())?;
        saved.tokens = tokens;
        Ok(())
    }

    /// Second half of the forward: the FP8 GEMM `y = x_q W^T (+ bias)` from the codes and scale that
    /// [`Fp8Linear::quantize_input`] wrote (or a fused kernel that writes the same).
    pub fn forward_quantized<O: GemmOutput>(
        &self,
        x_q: &Buffer<u8>,
        saved: &Fp8LinearSaved,
        weight: &Buffer<u8>,
        weight_scale_inv: Option<DeviceScalar<'_>>,
        bias: Option<&Buffer<O>>,
        y: &mut Buffer<O>,
    ) -> Result<(), KernelError> {
        const WHAT: &str = "Fp8Linear::forward_quantized";
        let (inf, outf, tokens) = (self.in_features, self.out_features, saved.tokens);
        crate::check_len(WHAT, tokens * inf, x_q.len())?;
        self.check_weight(WHAT, weight)?;
        crate::check_len(WHAT, tokens * outf, y.len())?;
        if let Some(b) = bias {
            crate::check_len(WHAT, outf, b.len())?;
        }
        let mut spec = GemmSpec::new(tokens, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(self.parallelism);
        if let Some(b) = bias {
            broadcast_bias(b, tokens, y)?;
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
            data: weight,
            format: Fp8Format::E4M3,
            scale_inv: weight_scale_inv.unwrap_or(DeviceScalar {
                buffer: self.weight.scale_inv(),
                index: 0,
            }),
        };
        gemm_fp8(&spec, a, w, y)
    }

    /// Backward: casts `dy [tokens, out]` to E5M2 (recording its amax), then
    /// `dx = dy W` (when `dx` is given) and `dW (+)= dy^T x` (`accumulate`: add to `dw`), and the bias
    /// gradient `db (+)= sum_rows dy` when `dbias` is given. `weight` and `weight_scale_inv` are the
    /// forward's; `weight_t` (`W^T`, E4M3 `[in, out]`, same scale) saves a transpose on CUDA when
    /// available.
    ///
    /// Allocates its FP8 operands on every call; [`Fp8Linear::quantize_grad_output`] +
    /// [`Fp8Linear::backward_quantized`] take them from the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: LinearElement, O: GemmOutput, W: GemmOutput>(
        &mut self,
        saved: &Fp8LinearSaved,
        dy: &Buffer<T>,
        weight: &Buffer<u8>,
        weight_scale_inv: Option<DeviceScalar<'_>>,
        weight_t: Option<&Buffer<u8>>,
        dx: Option<&mut Buffer<O>>,
        dw: &mut Buffer<W>,
        accumulate: bool,
        dbias: Option<&mut Buffer<f32>>,
    ) -> Result<(), KernelError> {
        let n = saved.tokens * self.out_features;
        crate::check_len("Fp8Linear::backward", n, dy.len())?;
        let mut dy_q = self.device.zeros::<u8>(n)?;
        let mut dy_t = self.device.zeros::<u8>(n)?;
        self.quantize_grad_output(dy, &mut dy_q, &mut dy_t)?;
        self.backward_quantized(
            saved,
            &dy_q,
            &dy_t,
            weight,
            weight_scale_inv,
            weight_t,
            dx,
            dw,
            accumulate,
        )?;
        if let Some(db) = dbias {
            bias_grad(dy, saved.tokens, self.out_features, db, accumulate)?;
        }
        Ok(())
    }

    /// First half of the backward: casts `dy [tokens, out]` to E5M2 with the output-gradient meta
    /// (recording its amax) into `dy_q` (`[tokens, out]`) and `dy_t` (`[out, tokens]`).
    pub fn quantize_grad_output<T: LinearElement>(
        &mut self,
        dy: &Buffer<T>,
        dy_q: &mut Buffer<u8>,
        dy_t: &mut Buffer<u8>,
    ) -> Result<(), KernelError> {
        const WHAT: &str = "Fp8Linear::quantize_grad_output";
        let outf = self.out_features;
        let tokens = rows_of(WHAT, dy.len(), outf)?;
        crate::check_len(WHAT, tokens * outf, dy_q.len())?;
        self.grad_output
            .cast_transpose(dy, [tokens, outf], dy_t, Some(dy_q))
    }

    /// Second half of the backward: `dx = dy_q W` (when `dx` is given) and `dW (+)= dy_q^T x` from the
    /// codes [`Fp8Linear::quantize_grad_output`] wrote (scale: the output-gradient meta's).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_quantized<O: GemmOutput, W: GemmOutput>(
        &self,
        saved: &Fp8LinearSaved,
        dy_q: &Buffer<u8>,
        dy_t: &Buffer<u8>,
        weight: &Buffer<u8>,
        weight_scale_inv: Option<DeviceScalar<'_>>,
        weight_t: Option<&Buffer<u8>>,
        dx: Option<&mut Buffer<O>>,
        dw: &mut Buffer<W>,
        accumulate: bool,
    ) -> Result<(), KernelError> {
        const WHAT: &str = "Fp8Linear::backward";
        let (inf, outf, tokens) = (self.in_features, self.out_features, saved.tokens);
        crate::check_len(WHAT, tokens * outf, dy_q.len())?;
        crate::check_len(WHAT, tokens * outf, dy_t.len())?;
        crate::check_len(WHAT, tokens * inf, saved.x_t.len())?;
        self.check_weight(WHAT, weight)?;
        crate::check_len(WHAT, inf * outf, dw.len())?;
        if let Some(wt) = weight_t {
            crate::check_len(WHAT, inf * outf, wt.len())?;
        }
        let g_scale = DeviceScalar {
            buffer: self.grad_output.scale_inv(),
            index: 0,
        };
        if let Some(dx) = dx {
            crate::check_len(WHAT, tokens * inf, dx.len())?;
            // dx [tokens, in] = dy [tokens, out] * W [out, in].
            let a = Fp8Matrix {
                data: dy_q,
                format: Fp8Format::E5M2,
                scale_inv: g_scale,
            };
            let spec = GemmSpec::new(tokens, inf, outf).parallelism(self.parallelism);
            let weight = Fp8Matrix {
                data: weight,
                format: Fp8Format::E4M3,
                scale_inv: weight_scale_inv.unwrap_or(DeviceScalar {
                    buffer: self.weight.scale_inv(),
                    index: 0,
                }),
            };
            match weight_t {
                Some(wt) => {
                    let b = Fp8Matrix { data: wt, ..weight };
                    gemm_fp8(&spec.transposes(Transpose::No, Transpose::Yes), a, b, dx)?;
                }
                None => gemm_fp8(&spec, a, weight, dx)?,
            }
        }
        // dW [out, in] = dy^T [out, tokens] * x [tokens, in]; both operands held K-major (transposed).
        let a = Fp8Matrix {
            data: dy_t,
            format: Fp8Format::E5M2,
            scale_inv: g_scale,
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
            .scalars(1.0, if accumulate { 1.0 } else { 0.0 })
            .parallelism(self.parallelism);
        gemm_fp8(&spec, a, b, dw)
    }

    /// The step-end update of the delayed metas (input and output gradient): each pending amax enters
    /// its history and the scale is recomputed. Call once per step, after reducing amaxes across ranks.
    pub fn update_scales(&mut self) -> Result<(), KernelError> {
        self.input.update_from_pending()?;
        self.grad_output.update_from_pending()
    }
}

/// The linear operation in BF16 or F32 (same shapes as [`Fp8Linear`]): for small GEMMs where FP8 does not
/// pay. Inputs `T` (f32 or bf16), f32 accumulation, outputs f32 or bf16 (f32 inputs: f32 outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloatLinear {
    in_features: usize,
    out_features: usize,
    parallelism: CpuParallelism,
}

impl FloatLinear {
    /// A linear operation of `in_features -> out_features`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        parallelism: CpuParallelism,
    ) -> Result<Self, KernelError> {
        if in_features == 0 || out_features == 0 {
            return Err(bad(
                "FloatLinear",
                format!("features must be positive ({in_features} -> {out_features})"),
            ));
        }
        Ok(FloatLinear {
            in_features,
            out_features,
            parallelism,
        })
    }

    /// Forward: `y = x W^T (+ bias)`.
    pub fn forward<T: LinearElement, O: GemmOutput>(
        &self,
        x: &Buffer<T>,
        weight: &Buffer<T>,
        bias: Option<&Buffer<O>>,
        y: &mut Buffer<O>,
    ) -> Result<(), KernelError> {
        const WHAT: &str = "FloatLinear::forward";
        let (inf, outf) = (self.in_features, self.out_features);
        let tokens = rows_of(WHAT, x.len(), inf)?;
        crate::check_len(WHAT, inf * outf, weight.len())?;
        crate::check_len(WHAT, tokens * outf, y.len())?;
        let mut spec = GemmSpec::new(tokens, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(self.parallelism);
        if let Some(b) = bias {
            crate::check_len(WHAT, outf, b.len())?;
            broadcast_bias(b, tokens, y)?;
            spec.beta = 1.0;
        }
        gemm(&spec, x, weight, y)
    }

    /// Backward: `dx = dy W` (when given), `dW (+)= dy^T x`, `db (+)= sum_rows dy` (when given).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: LinearElement, O: GemmOutput, W: GemmOutput>(
        &self,
        x: &Buffer<T>,
        dy: &Buffer<T>,
        weight: &Buffer<T>,
        dx: Option<&mut Buffer<O>>,
        dw: &mut Buffer<W>,
        accumulate: bool,
        dbias: Option<&mut Buffer<f32>>,
    ) -> Result<(), KernelError> {
        const WHAT: &str = "FloatLinear::backward";
        let (inf, outf) = (self.in_features, self.out_features);
        let tokens = rows_of(WHAT, x.len(), inf)?;
        crate::check_len(WHAT, tokens * outf, dy.len())?;
        crate::check_len(WHAT, inf * outf, weight.len())?;
        if let Some(dx) = dx {
            let spec = GemmSpec::new(tokens, inf, outf).parallelism(self.parallelism);
            gemm(&spec, dy, weight, dx)?;
        }
        let spec = GemmSpec::new(outf, inf, tokens)
            .transposes(Transpose::Yes, Transpose::No)
            .scalars(1.0, if accumulate { 1.0 } else { 0.0 })
            .parallelism(self.parallelism);
        gemm(&spec, dy, x, dw)?;
        if let Some(db) = dbias {
            bias_grad(dy, tokens, outf, db, accumulate)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codes(seed: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                (v as f32 / (1u32 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// The split entry points with reused caller buffers give bit-identical results to the allocating
    /// `forward`/`backward`, also on a second call whose input differs (stale buffers must not leak).
    #[test]
    fn caller_buffers_match_allocating_calls() {
        let dev = Device::cpu();
        let (t, inf, outf) = (24, 16, 8);
        let cfg = Fp8LinearConfig {
            parallelism: CpuParallelism::Single,
            ..Fp8LinearConfig::default()
        };
        let mut a = Fp8Linear::new(&dev, inf, outf, cfg).unwrap();
        let mut b = Fp8Linear::new(&dev, inf, outf, cfg).unwrap();
        let w32 = dev.upload(&codes(7, inf * outf)).unwrap();
        let mut wa = dev.zeros::<u8>(inf * outf).unwrap();
        let mut wb = dev.zeros::<u8>(inf * outf).unwrap();
        a.cast_weight(&w32, &mut wa).unwrap();
        b.cast_weight(&w32, &mut wb).unwrap();
        let mut x_q = dev.zeros::<u8>(t * inf).unwrap();
        let mut saved = Fp8LinearSaved::zeros(&dev, t, inf).unwrap();
        let (mut dy_q, mut dy_t) = (
            dev.zeros::<u8>(t * outf).unwrap(),
            dev.zeros::<u8>(t * outf).unwrap(),
        );
        for step in 0..2u32 {
            let x = dev.upload(&codes(100 + step, t * inf)).unwrap();
            let dy = dev.upload(&codes(200 + step, t * outf)).unwrap();
            let mut ya = dev.zeros::<f32>(t * outf).unwrap();
            let mut yb = dev.zeros::<f32>(t * outf).unwrap();
            let sa = a.forward::<f32, f32>(&x, &wa, None, None, &mut ya).unwrap();
            b.forward_into::<f32, f32>(&x, &wb, None, None, &mut yb, &mut x_q, &mut saved)
                .unwrap();
            assert_eq!(ya.to_vec().unwrap(), yb.to_vec().unwrap());
            assert_eq!(sa.x_t().to_vec().unwrap(), saved.x_t().to_vec().unwrap());
            let (mut dxa, mut dxb) = (
                dev.zeros::<f32>(t * inf).unwrap(),
                dev.zeros::<f32>(t * inf).unwrap(),
            );
            let (mut dwa, mut dwb) = (
                dev.zeros::<f32>(inf * outf).unwrap(),
                dev.zeros::<f32>(inf * outf).unwrap(),
            );
            a.backward::<f32, f32, f32>(
                &sa,
                &dy,
                &wa,
                None,
                None,
                Some(&mut dxa),
                &mut dwa,
                false,
                None,
            )
            .unwrap();
            b.quantize_grad_output(&dy, &mut dy_q, &mut dy_t).unwrap();
            b.backward_quantized::<f32, f32>(
                &saved,
                &dy_q,
                &dy_t,
                &wb,
                None,
                None,
                Some(&mut dxb),
                &mut dwb,
                false,
            )
            .unwrap();
            assert_eq!(dxa.to_vec().unwrap(), dxb.to_vec().unwrap());
            assert_eq!(dwa.to_vec().unwrap(), dwb.to_vec().unwrap());
            assert!(dwa.to_vec().unwrap().iter().any(|v| *v != 0.0));
            a.update_scales().unwrap();
            b.update_scales().unwrap();
        }
        // A saved buffer of the wrong size is refused, not overrun.
        let mut small = Fp8LinearSaved::zeros(&dev, t - 1, inf).unwrap();
        let x = dev.upload(&codes(1, t * inf)).unwrap();
        let mut y = dev.zeros::<f32>(t * outf).unwrap();
        assert!(b
            .forward_into::<f32, f32>(&x, &wb, None, None, &mut y, &mut x_q, &mut small)
            .is_err());
    }
}
