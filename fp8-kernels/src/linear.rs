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
use crate::{Buffer, DType, Device, DeviceScalingMeta, FloatElement, KernelError};
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

/// `y[t, :] = bias` for every row (rank-1 GEMM `ones[tokens, 1] * bias[1, out]`, exact).
fn broadcast_bias<O: GemmOutput>(
    bias: &Buffer<O>,
    tokens: usize,
    y: &mut Buffer<O>,
    parallelism: CpuParallelism,
) -> Result<(), KernelError> {
    let dev = y.device();
    let ones = dev.upload(&vec![O::from_f32(1.0); tokens])?;
    let spec = GemmSpec::new(tokens, bias.len(), 1).parallelism(parallelism);
    if O::DTYPE == DType::F32 || O::DTYPE == DType::BF16 {
        gemm(&spec, &ones, bias, y)
    } else {
        Err(bad("linear bias", format!("{} bias", O::DTYPE)))
    }
}

/// `db (+)= sum over rows of dy` (GEMM `dy^T [out, tokens] * ones[tokens, 1]`), f32.
fn bias_grad<T: LinearElement>(
    dy: &Buffer<T>,
    tokens: usize,
    out: usize,
    db: &mut Buffer<f32>,
    accumulate: bool,
    parallelism: CpuParallelism,
) -> Result<(), KernelError> {
    crate::check_len("linear bias gradient", out, db.len())?;
    let ones = dy.device().upload(&vec![T::from_f32(1.0); tokens])?;
    let spec = GemmSpec::new(out, 1, tokens)
        .transposes(Transpose::Yes, Transpose::No)
        .scalars(1.0, if accumulate { 1.0 } else { 0.0 })
        .parallelism(parallelism);
    gemm(&spec, dy, &ones, db)
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
    pub fn forward<T: LinearElement, O: GemmOutput>(
        &mut self,
        x: &Buffer<T>,
        weight: &Buffer<u8>,
        weight_scale_inv: Option<DeviceScalar<'_>>,
        bias: Option<&Buffer<O>>,
        y: &mut Buffer<O>,
    ) -> Result<Fp8LinearSaved, KernelError> {
        const WHAT: &str = "Fp8Linear::forward";
        let (inf, outf) = (self.in_features, self.out_features);
        let tokens = rows_of(WHAT, x.len(), inf)?;
        self.check_weight(WHAT, weight)?;
        crate::check_len(WHAT, tokens * outf, y.len())?;
        if let Some(b) = bias {
            crate::check_len(WHAT, outf, b.len())?;
        }
        let dev = &self.device;
        let mut x_q = dev.zeros::<u8>(tokens * inf)?;
        let mut x_t = dev.zeros::<u8>(tokens * inf)?;
        self.input
            .cast_transpose(x, [tokens, inf], &mut x_t, Some(&mut x_q))?;
        // Keep the scale x was cast with: the meta may be updated before the backward runs.
        let x_scale_inv = self.input.scale_inv().to_device(dev)?;
        let mut spec = GemmSpec::new(tokens, outf, inf)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(self.parallelism);
        if let Some(b) = bias {
            broadcast_bias(b, tokens, y, self.parallelism)?;
            spec.beta = 1.0;
        }
        let a = Fp8Matrix {
            data: &x_q,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar {
                buffer: &x_scale_inv,
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
        gemm_fp8(&spec, a, w, y)?;
        Ok(Fp8LinearSaved {
            tokens,
            x_t,
            x_scale_inv,
        })
    }

    /// Backward: casts `dy [tokens, out]` to E5M2 (recording its amax), then
    /// `dx = dy W` (when `dx` is given) and `dW (+)= dy^T x` (`accumulate`: add to `dw`), and the bias
    /// gradient `db (+)= sum_rows dy` when `dbias` is given. `weight` and `weight_scale_inv` are the
    /// forward's; `weight_t` (`W^T`, E4M3 `[in, out]`, same scale) saves a transpose on CUDA when
    /// available.
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
        const WHAT: &str = "Fp8Linear::backward";
        let (inf, outf, tokens) = (self.in_features, self.out_features, saved.tokens);
        crate::check_len(WHAT, tokens * outf, dy.len())?;
        crate::check_len(WHAT, tokens * inf, saved.x_t.len())?;
        self.check_weight(WHAT, weight)?;
        crate::check_len(WHAT, inf * outf, dw.len())?;
        if let Some(wt) = weight_t {
            crate::check_len(WHAT, inf * outf, wt.len())?;
        }
        let dev = &self.device;
        let mut dy_q = dev.zeros::<u8>(tokens * outf)?;
        let mut dy_t = dev.zeros::<u8>(tokens * outf)?;
        self.grad_output
            .cast_transpose(dy, [tokens, outf], &mut dy_t, Some(&mut dy_q))?;
        let g_scale = DeviceScalar {
            buffer: self.grad_output.scale_inv(),
            index: 0,
        };
        if let Some(dx) = dx {
            crate::check_len(WHAT, tokens * inf, dx.len())?;
            // dx [tokens, in] = dy [tokens, out] * W [out, in].
            let a = Fp8Matrix {
                data: &dy_q,
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
            data: &dy_t,
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
        gemm_fp8(&spec, a, b, dw)?;
        if let Some(db) = dbias {
            bias_grad(dy, tokens, outf, db, accumulate, self.parallelism)?;
        }
        Ok(())
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
            broadcast_bias(b, tokens, y, self.parallelism)?;
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
            bias_grad(dy, tokens, outf, db, accumulate, self.parallelism)?;
        }
        Ok(())
    }
}
