//! Matrix multiplication: F32, BF16 and FP8 GEMMs on the CPU (the `gemm` crate) and on CUDA (cuBLASLt).
//!
//! # Semantics (row-major at the API level)
//!
//! Every GEMM computes `C = alpha * op(A) * op(B) + beta * C` where `C` is `[m, n]` row-major and
//! `op(A)` is `[m, k]`, `op(B)` is `[k, n]`. All buffers are dense row-major (the leading dimension is
//! the number of columns as stored):
//!
//! | operand | [`Transpose::No`] stored as | [`Transpose::Yes`] stored as |
//! | --- | --- | --- |
//! | A | `[m, k]` | `[k, m]` |
//! | B | `[k, n]` | `[n, k]` |
//!
//! So `y = x W^T` for a PyTorch-layout weight `W [out, in]` is `trans_b = Yes` with `A = x`, `B = W`.
//! When `beta == 0`, `C` is not read (it may hold anything, even NaN); with `beta == 1` the product is
//! accumulated into `C` (gradient accumulation).
//!
//! # Precision
//! - F32: exact f32 products and f32 accumulation (no TF32 unless [`GemmSpec::allow_tf32`]).
//! - BF16: on the CPU the inputs are widened to f32 (exact) and multiplied in f32; on CUDA the tensor cores
//!   multiply exactly and accumulate in f32. The output (f32 or bf16) is rounded once at the end.
//! - FP8: operands carry a format and a `scale_inv` held in a device buffer ([`DeviceScalar`]), so the GPU
//!   never waits for the host. Mathematically `op(A) = decode(a) * scale_inv_a`. The CPU dequantizes
//!   (`decode * scale_inv`, in f32) and runs the f32 GEMM; cuBLASLt multiplies the FP8 codes exactly,
//!   accumulates in f32 and applies both scales at the end. With power-of-two scales both compute the
//!   same exact products, so CPU and GPU differ only in accumulation order.
//!
//! # CUDA layout rules
//! cuBLASLt FP8 needs the "TN" layout (in row-major terms: `trans_a = No`, `trans_b = Yes`, both operands
//! K-major), 16-byte-aligned pointers, dimensions that are multiples of 16, and no E5M2 x E5M2. Calls
//! that do not fit are never refused: transposed operands are re-laid out into temporary K-major copies,
//! odd dimensions are zero-padded to multiples of 16 (zeros add nothing to the sums) and the result is
//! copied out of a padded f32 temporary, and E5M2 x E5M2 runs as a BF16 GEMM on dequantized operands.
//! See `docs/kernels-gemm-adam.md`.
//!
//! # Block-scaled FP8
//! [`gemm_fp8_block`] multiplies operands with one scale per 1x128 tile or 128x128 block (DeepSeek-V3's
//! recipe, [`crate::block_quantize`](mod@crate::block_quantize)'s casts) through cuBLASLt's block scale modes; its rules are in
//! `block.rs` ([`BlockFp8Matrix`]).
//!
//! Files: `mod.rs` (API, validation, dispatch), `cpu.rs` (the `gemm` crate), `cuda.rs` (the row-major to
//! column-major mapping and the layout kernels of `layout.cu`), `blaslt.rs` (the cuBLASLt handle, plans
//! and workspace, which knows nothing of the types here), `block.rs` / `block_cpu.rs` / `block_cuda.rs`
//! (the block-scaled GEMM: API and checks, CPU reference, cuBLASLt).

mod blaslt;
mod block;
mod block_cpu;
mod block_cuda;
mod cpu;
mod cuda;

pub use block::{gemm_fp8_block, gemm_fp8_block_at, transpose_block_fp8, BlockFp8Matrix};

pub use crate::cast::dequantize_fp8_host;
pub use cpu::gemm_f32_host;

use crate::{Buffer, DType, Device, FloatElement, KernelError};
use fp8_core::Fp8Format;
use half::bf16;

/// cuBLASLt FP8 wants every dimension to be a multiple of this.
pub const FP8_DIM_MULTIPLE: usize = 16;

/// Whether an operand is used as stored or transposed (see the module docs for the stored shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Transpose {
    /// Use the operand as stored.
    #[default]
    No,
    /// Use the transpose of the stored operand.
    Yes,
}

impl Transpose {
    /// Whether this is [`Transpose::Yes`].
    pub const fn is_yes(self) -> bool {
        matches!(self, Transpose::Yes)
    }
}

/// Threading of a CPU GEMM. Callers that already run one rank per thread want [`CpuParallelism::Single`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuParallelism {
    /// Run on the calling thread.
    Single,
    /// Split over rayon; `0` means all of rayon's threads.
    Rayon(usize),
}

impl Default for CpuParallelism {
    fn default() -> Self {
        CpuParallelism::Rayon(0)
    }
}

/// The shape and scalars of one GEMM: `C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmSpec {
    /// Rows of `C` and of `op(A)`.
    pub m: usize,
    /// Columns of `C` and of `op(B)`.
    pub n: usize,
    /// The reduced dimension.
    pub k: usize,
    /// Transpose of A.
    pub trans_a: Transpose,
    /// Transpose of B.
    pub trans_b: Transpose,
    /// Multiplies the product.
    pub alpha: f32,
    /// Multiplies the old `C` (0: `C` is not read).
    pub beta: f32,
    /// Threading on the CPU (ignored on CUDA).
    pub parallelism: CpuParallelism,
    /// Allow TF32 tensor cores for F32 GEMMs on CUDA (faster, 10-bit mantissa products). Off by default so
    /// the F32 GEMM is an exact-precision reference.
    pub allow_tf32: bool,
    /// FP8 on CUDA only: cuBLASLt's fast accumulation (partial sums are not promoted to full f32
    /// precision at intervals; faster, less accurate). Off by default, as in `torch._scaled_mm`.
    pub fp8_fast_accum: bool,
}

impl GemmSpec {
    /// `C = A * B` with `A [m, k]`, `B [k, n]`, alpha 1, beta 0, rayon on the CPU.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        GemmSpec {
            m,
            n,
            k,
            trans_a: Transpose::No,
            trans_b: Transpose::No,
            alpha: 1.0,
            beta: 0.0,
            parallelism: CpuParallelism::default(),
            allow_tf32: false,
            fp8_fast_accum: false,
        }
    }

    /// Sets the transposes of A and B.
    pub fn transposes(mut self, trans_a: Transpose, trans_b: Transpose) -> Self {
        self.trans_a = trans_a;
        self.trans_b = trans_b;
        self
    }

    /// Sets alpha and beta.
    pub fn scalars(mut self, alpha: f32, beta: f32) -> Self {
        self.alpha = alpha;
        self.beta = beta;
        self
    }

    /// Sets the CPU threading.
    pub fn parallelism(mut self, parallelism: CpuParallelism) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Elements of A, B and C.
    pub fn lens(&self) -> Result<(usize, usize, usize), KernelError> {
        let mul = |x: usize, y: usize| {
            x.checked_mul(y)
                .ok_or_else(|| KernelError::InvalidArgument {
                    what: "gemm",
                    detail: format!("shape {}x{}x{} overflows usize", self.m, self.n, self.k),
                })
        };
        Ok((
            mul(self.m, self.k)?,
            mul(self.k, self.n)?,
            mul(self.m, self.n)?,
        ))
    }

    /// Checks the buffer lengths against the shape.
    pub fn check(&self, a_len: usize, b_len: usize, c_len: usize) -> Result<(), KernelError> {
        let (a, b, c) = self.lens()?;
        crate::check_len("gemm: A", a, a_len)?;
        crate::check_len("gemm: B", b, b_len)?;
        crate::check_len("gemm: C", c, c_len)?;
        if !self.alpha.is_finite() || !self.beta.is_finite() {
            return Err(KernelError::InvalidArgument {
                what: "gemm",
                detail: format!("alpha {} and beta {} must be finite", self.alpha, self.beta),
            });
        }
        Ok(())
    }

    /// Floating-point operations of the GEMM (`2 m n k`).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// One f32 element of a device buffer, read by kernels on the device (scales live on the device so that a
/// GPU step never waits for the host).
#[derive(Debug, Clone, Copy)]
pub struct DeviceScalar<'a> {
    /// The buffer holding the value.
    pub buffer: &'a Buffer<f32>,
    /// Index of the value in the buffer.
    pub index: usize,
}

impl<'a> DeviceScalar<'a> {
    /// Element `index` of `buffer`.
    pub fn new(buffer: &'a Buffer<f32>, index: usize) -> Result<Self, KernelError> {
        if index >= buffer.len() {
            return Err(KernelError::InvalidArgument {
                what: "DeviceScalar",
                detail: format!("index {index} out of a buffer of {}", buffer.len()),
            });
        }
        Ok(DeviceScalar { buffer, index })
    }

    /// The value, for CPU buffers (CPU code paths).
    pub fn host_value(&self, what: &'static str) -> Result<f32, KernelError> {
        let h = self.buffer.host(what)?;
        h.get(self.index)
            .copied()
            .ok_or_else(|| KernelError::InvalidArgument {
                what,
                detail: format!("scalar index {} out of {}", self.index, h.len()),
            })
    }

    /// Reads the value back to the host (waits for queued work on CUDA). For tests and tools.
    pub fn read(&self) -> Result<f32, KernelError> {
        let v = self.buffer.to_vec()?;
        v.get(self.index)
            .copied()
            .ok_or_else(|| KernelError::InvalidArgument {
                what: "DeviceScalar::read",
                detail: format!("index {} out of {}", self.index, v.len()),
            })
    }
}

/// An FP8 matrix operand: codes, their format and the inverse scale that maps decoded codes back to values.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Matrix<'a> {
    /// FP8 codes, row-major.
    pub data: &'a Buffer<u8>,
    /// Format of the codes.
    pub format: Fp8Format,
    /// `value = decode(code) * scale_inv`.
    pub scale_inv: DeviceScalar<'a>,
}

/// Element types GEMMs read and write besides FP8: f32 or bf16 (conversions from [`FloatElement`]).
pub trait GemmOutput: FloatElement {}

impl GemmOutput for f32 {}
impl GemmOutput for bf16 {}

/// F32 GEMM on the buffers' device (see module docs for layout and precision).
pub fn gemm_f32(
    spec: &GemmSpec,
    a: &Buffer<f32>,
    b: &Buffer<f32>,
    c: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    spec.check(a.len(), b.len(), c.len())?;
    match c.device() {
        Device::Cpu => {
            let what = "gemm_f32";
            cpu::gemm_f32_host(spec, a.host(what)?, b.host(what)?, c.host_mut(what)?)
        }
        Device::Cuda(dev) => cuda::gemm_float(&dev, spec, a, b, c),
    }
}

/// BF16 x BF16 GEMM with f32 accumulation into an f32 or bf16 output.
pub fn gemm_bf16<O: GemmOutput>(
    spec: &GemmSpec,
    a: &Buffer<bf16>,
    b: &Buffer<bf16>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    spec.check(a.len(), b.len(), c.len())?;
    match c.device() {
        Device::Cpu => {
            let what = "gemm_bf16";
            let (a32, b32) = (cpu::widen(a.host(what)?), cpu::widen(b.host(what)?));
            cpu::gemm_into_host(spec, &a32, &b32, c.host_mut(what)?)
        }
        Device::Cuda(dev) => cuda::gemm_float(&dev, spec, a, b, c),
    }
}

/// GEMM on f32 or bf16 inputs `T` into an f32 or bf16 output `O`, f32 accumulation: [`gemm_f32`] or
/// [`gemm_bf16`] chosen by type. F32 inputs need an f32 output (cuBLASLt has no f32 x f32 -> bf16).
pub fn gemm<T: GemmOutput, O: GemmOutput>(
    spec: &GemmSpec,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    spec.check(a.len(), b.len(), c.len())?;
    check_float_output::<T, O>()?;
    match c.device() {
        Device::Cpu => float_gemm_host(spec, a, b, c.host_mut("gemm")?),
        Device::Cuda(dev) => cuda::gemm_float(&dev, spec, a, b, c),
    }
}

/// F32 inputs need an f32 output (cuBLASLt has no f32 x f32 -> bf16).
fn check_float_output<T: GemmOutput, O: GemmOutput>() -> Result<(), KernelError> {
    if T::DTYPE == DType::F32 && O::DTYPE != DType::F32 {
        return Err(KernelError::InvalidArgument {
            what: "gemm",
            detail: format!("f32 inputs need an f32 output, not {}", O::DTYPE),
        });
    }
    Ok(())
}

/// [`gemm`] of CPU buffers into `out` (the `m x n` elements of `C`).
fn float_gemm_host<T: GemmOutput, O: GemmOutput>(
    spec: &GemmSpec,
    a: &Buffer<T>,
    b: &Buffer<T>,
    out: &mut [O],
) -> Result<(), KernelError> {
    let what = "gemm";
    let (ah, bh) = (a.host(what)?, b.host(what)?);
    if T::DTYPE == DType::F32 {
        let (a32, b32): (&[f32], &[f32]) = (bytemuck::cast_slice(ah), bytemuck::cast_slice(bh));
        cpu::gemm_into_host(spec, a32, b32, out)
    } else {
        cpu::gemm_into_host(spec, &cpu::widen(ah), &cpu::widen(bh), out)
    }
}

/// [`gemm_fp8`] of CPU buffers into `out` (the `m x n` elements of `C`): the operands decoded to f32.
fn fp8_gemm_host<O: GemmOutput>(
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    out: &mut [O],
) -> Result<(), KernelError> {
    let what = "gemm_fp8";
    let a32 = dequantize_fp8_host(a.data.host(what)?, a.format, a.scale_inv.host_value(what)?);
    let b32 = dequantize_fp8_host(b.data.host(what)?, b.format, b.scale_inv.host_value(what)?);
    cpu::gemm_into_host(spec, &a32, &b32, out)
}

/// FP8 x FP8 GEMM with f32 accumulation into an f32 or bf16 output; the scales come from device buffers.
///
/// Any transpose combination and shape is accepted; on CUDA, shapes outside cuBLASLt's FP8 rules are
/// re-laid out or padded (see module docs), and E5M2 x E5M2 runs in BF16.
pub fn gemm_fp8<O: GemmOutput>(
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    spec.check(a.data.len(), b.data.len(), c.len())?;
    match c.device() {
        Device::Cpu => fp8_gemm_host(spec, a, b, c.host_mut("gemm_fp8")?),
        Device::Cuda(dev) => cuda::gemm_fp8(&dev, spec, a, b, c),
    }
}

/// [`gemm`] into the `m x n` consecutive elements of `c` from element `offset` (row-major; e.g. one
/// parameter's gradient inside a flat gradient buffer, accumulated with `beta = 1`); the rest of `c` is
/// left alone. On CUDA the product goes straight there when that address is 256-byte aligned and `k > 0`,
/// else through a temporary of `m x n` (copied in when `beta != 0`, copied back out).
pub fn gemm_at<T: GemmOutput, O: GemmOutput>(
    spec: &GemmSpec,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<O>,
    offset: usize,
) -> Result<(), KernelError> {
    let mn = output_range(spec, c.len(), offset)?;
    spec.check(a.len(), b.len(), mn)?;
    check_float_output::<T, O>()?;
    match c.device() {
        Device::Cpu => {
            float_gemm_host(spec, a, b, &mut c.host_mut("gemm_at")?[offset..offset + mn])
        }
        Device::Cuda(dev) => cuda_into_range(&dev, spec, c, offset, mn, spec.k > 0, |c, at| {
            cuda::gemm_float_at(&dev, spec, a, b, c, at)
        }),
    }
}

/// [`gemm_fp8`] into the `m x n` consecutive elements of `c` from element `offset` (see [`gemm_at`]). On
/// CUDA the product goes straight there when m, n and k are multiples of 16 and that address is 256-byte
/// aligned, else through a temporary.
pub fn gemm_fp8_at<O: GemmOutput>(
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
    offset: usize,
) -> Result<(), KernelError> {
    let mn = output_range(spec, c.len(), offset)?;
    spec.check(a.data.len(), b.data.len(), mn)?;
    match c.device() {
        Device::Cpu => fp8_gemm_host(
            spec,
            a,
            b,
            &mut c.host_mut("gemm_fp8_at")?[offset..offset + mn],
        ),
        Device::Cuda(dev) => {
            let fits = [spec.m, spec.n, spec.k]
                .iter()
                .all(|&d| d > 0 && d % FP8_DIM_MULTIPLE == 0);
            cuda_into_range(&dev, spec, c, offset, mn, fits, |c, at| {
                cuda::gemm_fp8_at(&dev, spec, a, b, c, at)
            })
        }
    }
}

/// Elements of `C`, after checking that they fit in `c_len` from `offset`.
fn output_range(spec: &GemmSpec, c_len: usize, offset: usize) -> Result<usize, KernelError> {
    let (_, _, mn) = spec.lens()?;
    match offset.checked_add(mn) {
        Some(end) if end <= c_len => Ok(mn),
        _ => Err(KernelError::InvalidArgument {
            what: "gemm",
            detail: format!(
                "C of {} x {} at offset {offset} does not fit a buffer of {c_len}",
                spec.m, spec.n
            ),
        }),
    }
}

/// A GEMM `run(c, at)` on CUDA into `C`'s `mn` elements from element `offset` of `c`: straight there when
/// `direct` (the GEMM can write a range) and that address has cuBLASLt's alignment, else into a temporary
/// of `mn` at 0 (copied in when `beta != 0`, copied back out).
fn cuda_into_range<O: GemmOutput>(
    dev: &crate::CudaDevice,
    spec: &GemmSpec,
    c: &mut Buffer<O>,
    offset: usize,
    mn: usize,
    direct: bool,
    run: impl Fn(&mut Buffer<O>, usize) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    if direct && cuda::output_aligned(dev, c, offset)? {
        return run(c, offset);
    }
    let mut t = c.device().uninit::<O>(mn)?;
    if spec.beta != 0.0 {
        t.copy_range_from(0, c, offset, mn)?;
    }
    run(&mut t, 0)?;
    c.copy_range_from(offset, &t, 0, mn)
}

/// Whether FP8 GEMMs of this row-major shape and transposes run on cuBLASLt directly (no re-layout, no
/// padding): `trans_a = No`, `trans_b = Yes`, and m, n, k multiples of 16.
pub fn fp8_runs_directly(spec: &GemmSpec) -> bool {
    !spec.trans_a.is_yes()
        && spec.trans_b == Transpose::Yes
        && [spec.m, spec.n, spec.k]
            .iter()
            .all(|&d| d > 0 && d % FP8_DIM_MULTIPLE == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(spec: &GemmSpec, a: &[f32], b: &[f32], c: &[f32]) -> Vec<f64> {
        let (m, n, k) = (spec.m, spec.n, spec.k);
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    let av = if spec.trans_a.is_yes() {
                        a[p * m + i]
                    } else {
                        a[i * k + p]
                    };
                    let bv = if spec.trans_b.is_yes() {
                        b[j * k + p]
                    } else {
                        b[p * n + j]
                    };
                    s += av as f64 * bv as f64;
                }
                let old = if spec.beta != 0.0 {
                    spec.beta as f64 * c[i * n + j] as f64
                } else {
                    0.0
                };
                out[i * n + j] = spec.alpha as f64 * s + old;
            }
        }
        out
    }

    #[test]
    fn direct_fp8_rule() {
        let s = GemmSpec::new(32, 48, 64).transposes(Transpose::No, Transpose::Yes);
        assert!(fp8_runs_directly(&s));
        assert!(!fp8_runs_directly(&GemmSpec::new(32, 48, 64)));
        assert!(!fp8_runs_directly(
            &GemmSpec::new(32, 40, 64).transposes(Transpose::No, Transpose::Yes)
        ));
        assert!(!fp8_runs_directly(
            &GemmSpec::new(0, 48, 64).transposes(Transpose::No, Transpose::Yes)
        ));
    }

    #[test]
    fn small_product_all_transposes() {
        // A = [[1,2,3],[4,5,6]] (2x3), B = [[1,0],[0,1],[1,1]] (3x2): A B = [[4,5],[10,11]].
        let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0];
        let at = [1.0f32, 4.0, 2.0, 5.0, 3.0, 6.0];
        let bt = [1.0f32, 0.0, 1.0, 0.0, 1.0, 1.0];
        for (ta, tb) in [
            (Transpose::No, Transpose::No),
            (Transpose::Yes, Transpose::No),
            (Transpose::No, Transpose::Yes),
            (Transpose::Yes, Transpose::Yes),
        ] {
            let spec = GemmSpec::new(2, 2, 3).transposes(ta, tb);
            let aa = if ta.is_yes() { &at } else { &a };
            let bb = if tb.is_yes() { &bt } else { &b };
            let mut c = [f32::NAN; 4]; // beta = 0 must not read C
            gemm_f32_host(&spec, aa, bb, &mut c).unwrap();
            assert_eq!(c, [4.0, 5.0, 10.0, 11.0], "{ta:?} {tb:?}");
        }
    }

    #[test]
    fn alpha_beta_and_empty_k() {
        let spec = GemmSpec::new(1, 2, 1).scalars(2.0, 1.0);
        let mut c = [1.0f32, -1.0];
        gemm_f32_host(&spec, &[3.0], &[1.0, 2.0], &mut c).unwrap();
        assert_eq!(c, [7.0, 11.0]);
        let spec = GemmSpec::new(1, 2, 0).scalars(2.0, 0.5);
        gemm_f32_host(&spec, &[], &[], &mut c).unwrap();
        assert_eq!(c, [3.5, 5.5]);
        let spec = GemmSpec::new(1, 2, 0);
        gemm_f32_host(&spec, &[], &[], &mut c).unwrap();
        assert_eq!(c, [0.0, 0.0]);
    }

    #[test]
    fn length_and_scalar_errors() {
        let spec = GemmSpec::new(2, 3, 4);
        let mut c = vec![0.0f32; 6];
        assert!(matches!(
            gemm_f32_host(&spec, &[0.0; 7], &[0.0; 12], &mut c),
            Err(KernelError::LengthMismatch {
                expected: 8,
                actual: 7,
                ..
            })
        ));
        assert!(gemm_f32_host(&spec, &[0.0; 8], &[0.0; 11], &mut c).is_err());
        assert!(gemm_f32_host(&spec, &[0.0; 8], &[0.0; 12], &mut c[..5]).is_err());
        let bad = spec.scalars(f32::NAN, 0.0);
        assert!(gemm_f32_host(&bad, &[0.0; 8], &[0.0; 12], &mut c).is_err());
        let huge = GemmSpec::new(usize::MAX, 2, 2);
        assert!(huge.lens().is_err());
    }

    #[test]
    fn fp8_cpu_gemm_is_dequantize_then_f32() {
        let dev = Device::cpu();
        let (m, n, k) = (3, 5, 7);
        let a_codes: Vec<u8> = (0..m * k).map(|i| (i * 37 % 250) as u8).collect();
        let b_codes: Vec<u8> = (0..n * k).map(|i| (i * 91 % 250) as u8).collect();
        let a_codes: Vec<u8> = a_codes
            .into_iter()
            .map(|c| if Fp8Format::E4M3.is_nan(c) { 0 } else { c })
            .collect();
        let b_codes: Vec<u8> = b_codes
            .into_iter()
            .map(|c| {
                if Fp8Format::E5M2.is_nan(c) || Fp8Format::E5M2.is_infinite(c) {
                    1
                } else {
                    c
                }
            })
            .collect();
        let scales = dev.upload(&[0.25f32, 2.0]).unwrap();
        let ab = dev.upload(&a_codes).unwrap();
        let bb = dev.upload(&b_codes).unwrap();
        let a = Fp8Matrix {
            data: &ab,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar::new(&scales, 0).unwrap(),
        };
        let b = Fp8Matrix {
            data: &bb,
            format: Fp8Format::E5M2,
            scale_inv: DeviceScalar::new(&scales, 1).unwrap(),
        };
        let spec = GemmSpec::new(m, n, k).transposes(Transpose::No, Transpose::Yes);
        let mut c = dev.zeros::<f32>(m * n).unwrap();
        gemm_fp8(&spec, a, b, &mut c).unwrap();
        let a32 = dequantize_fp8_host(&a_codes, Fp8Format::E4M3, 0.25);
        let b32 = dequantize_fp8_host(&b_codes, Fp8Format::E5M2, 2.0);
        let want = naive(&spec, &a32, &b32, &[0.0; 15]);
        for (g, w) in c.to_vec().unwrap().iter().zip(&want) {
            assert!(
                (*g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{g} vs {w}"
            );
        }
        assert!(DeviceScalar::new(&scales, 2).is_err());
    }
}
