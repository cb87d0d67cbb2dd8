//! Launches of the cast kernels (`cast.cu`). `mod.rs` validated every argument: lengths, slots, devices.

use super::{format_name, CurrentScaling};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::CAST_MODULE;
use crate::launch::{cast_transpose_launch, grid, kernel_name, launch, optional_ptr_mut};
use crate::{Buffer, CudaDevice, FloatElement, KernelError};
use cudarc::driver::LaunchConfig;
use fp8_core::{Fp8Format, ScaleRounding};

/// A grid-stride launch over `n` elements taken `per_thread` at a time.
fn vec_launch(dev: &CudaDevice, n: usize, per_thread: usize) -> Result<LaunchConfig, KernelError> {
    let items = (n / per_thread) as u64 + 1;
    Ok(grid(dev, items))
}

/// `amax[slot] = max(amax[slot], max |x|)`.
pub(super) fn amax<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    amax: &mut Buffer<f32>,
    slot: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "amax";
    let cfg = vec_launch(dev, x.len(), 16)?;
    let (slot, n) = (slot as i32, x.len() as u64);
    let (xs, a) = (cs(x, WHAT)?, cs_mut(amax, WHAT)?);
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("amax_", T::NAME),
        cfg,
        "amax_<T>(const T* x, float* amax, int slot, u64 n)",
        [xs, a, &slot, &n]
    )
}

/// `out = encode(x * scale[0])`, the amax of `x` into `amax.0[amax.1]` when given.
pub(super) fn cast<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: &mut Buffer<u8>,
    amax: Option<(&mut Buffer<f32>, usize)>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cast_to_fp8";
    dev.require_fp8()?;
    let cfg = vec_launch(dev, x.len(), 16)?;
    let n = x.len() as u64;
    let slot = amax.as_ref().map_or(0, |(_, s)| *s as i32);
    let (xs, ss, ys) = (cs(x, WHAT)?, cs(scale, WHAT)?, cs_mut(out, WHAT)?);
    let amax = amax.map(|(b, _)| cs_mut(b, WHAT)).transpose()?;
    let amax = optional_ptr_mut(amax, dev.stream());
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("cast_fp8_", T::NAME, "_", format_name(format)),
        cfg,
        "cast_fp8_<T>_<fmt>(const T* x, u8* y, const float* scale, float* amax, int slot, u64 n)",
        [xs, ys, ss, &amax.ptr, &slot, &n]
    )
}

/// The current-scaling cast: amax into `amax[0]` (zeroed first), the scale computed on the device from
/// it and the previous `scale[0]`, `scale`/`scale_inv` written, `x` cast with it.
pub(super) fn cast_current<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    spec: CurrentScaling,
    scale: &mut Buffer<f32>,
    scale_inv: &mut Buffer<f32>,
    amax: &mut Buffer<f32>,
    out: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cast_to_fp8_current";
    dev.require_fp8()?;
    {
        let mut first = cs_mut(amax, WHAT)?.slice_mut(0..1);
        dev.stream().memset_zeros(&mut first)?;
    }
    self::amax(dev, x, amax, 0)?;
    let cfg = vec_launch(dev, x.len(), 16)?;
    let (n, margin, fmax) = (x.len() as u64, spec.margin, spec.format.max());
    let exact = matches!(spec.rounding, ScaleRounding::Exact) as i32;
    let (xs, ys) = (cs(x, WHAT)?, cs_mut(out, WHAT)?);
    let (ss, si, am) = (
        cs_mut(scale, WHAT)?,
        cs_mut(scale_inv, WHAT)?,
        cs(amax, WHAT)?,
    );
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("cast_fp8_current_", T::NAME, "_", format_name(spec.format)),
        cfg,
        "cast_fp8_current_<T>_<fmt>(const T* x, u8* y, float* scale, float* scale_inv, const float* amax, \
         float fmax, int margin, int exact, u64 n)",
        [xs, ys, ss, si, am, &fmax, &margin, &exact, &n]
    )
}

/// `out = T(decode(q) * scale_inv[0])`.
pub(super) fn dequantize<T: FloatElement>(
    dev: &CudaDevice,
    q: &Buffer<u8>,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "dequantize_fp8";
    dev.require_fp8()?;
    let cfg = vec_launch(dev, q.len(), 16)?;
    let n = q.len() as u64;
    let (qs, si, ys) = (cs(q, WHAT)?, cs(scale_inv, WHAT)?, cs_mut(out, WHAT)?);
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("dequant_", format_name(format), "_", T::NAME),
        cfg,
        "dequant_<fmt>_<T>(const u8* q, T* y, const float* scale_inv, u64 n)",
        [qs, ys, si, &n]
    )
}

/// `dst = D(dst + decode(q) * scale_inv[0])` for an f32 or bf16 destination.
pub(super) fn add_decoded<D: FloatElement>(
    dev: &CudaDevice,
    dst: &mut Buffer<D>,
    q: &Buffer<u8>,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add_decoded_fp8";
    let name = match D::NAME {
        "f32" => kernel_name!("add_decoded_", format_name(format)),
        "bf16" => kernel_name!("add_decoded_", format_name(format), "_to_bf16"),
        other => {
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("{other} destinations are not supported"),
            })
        }
    };
    let n = q.len() as u64;
    let cfg = grid(dev, n);
    let (qs, si, d) = (cs(q, WHAT)?, cs(scale_inv, WHAT)?, cs_mut(dst, WHAT)?);
    launch!(
        dev,
        &CAST_MODULE,
        name,
        cfg,
        "add_decoded_<fmt>[_to_bf16](D* dst, const u8* q, const float* scale_inv, u64 n)",
        [d, qs, si, &n]
    )
}

/// Cast + transpose of row-major `x [rows, cols]` into `out_t` (and `out`), amax into `amax` when given.
#[allow(clippy::too_many_arguments)]
pub(super) fn cast_transpose<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    [rows, cols]: [usize; 2],
    format: Fp8Format,
    scale: &Buffer<f32>,
    out_t: &mut Buffer<u8>,
    out: Option<&mut Buffer<u8>>,
    amax: Option<(&mut Buffer<f32>, usize)>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cast_transpose_to_fp8";
    dev.require_fp8()?;
    let cfg = cast_transpose_launch(dev.sm_count(), rows, cols);
    let (r, c) = (rows as i32, cols as i32);
    let slot = amax.as_ref().map_or(0, |(_, s)| *s as i32);
    let (xs, ss, yt) = (cs(x, WHAT)?, cs(scale, WHAT)?, cs_mut(out_t, WHAT)?);
    let out = out.map(|o| cs_mut(o, WHAT)).transpose()?;
    let out = optional_ptr_mut(out, dev.stream());
    let amax = amax.map(|(b, _)| cs_mut(b, WHAT)).transpose()?;
    let amax = optional_ptr_mut(amax, dev.stream());
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("cast_transpose_", T::NAME, "_", format_name(format)),
        cfg,
        "cast_transpose_<T>_<fmt>(const T* x, u8* y, u8* yt, const float* scale, float* amax, int slot, \
         int rows, int cols)",
        [xs, &out.ptr, yt, ss, &amax.ptr, &slot, &r, &c]
    )
}

/// `out = D(x)`, round to nearest even.
pub(super) fn convert<S: FloatElement, D: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<S>,
    out: &mut Buffer<D>,
) -> Result<(), KernelError> {
    const WHAT: &str = "convert";
    let cfg = vec_launch(dev, x.len(), 8)?;
    let n = x.len() as u64;
    let (xs, ys) = (cs(x, WHAT)?, cs_mut(out, WHAT)?);
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("convert_", S::NAME, "_", D::NAME),
        cfg,
        "convert_<S>_<D>(const S* x, D* y, u64 n)",
        [xs, ys, &n]
    )
}

/// `out[i]` = the FP8 code of the f32 with bit pattern `start + i`, at scale 1.
pub(super) fn encode_bit_patterns(
    dev: &CudaDevice,
    start: u32,
    format: Fp8Format,
    canonical_nan: bool,
    out: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "fp8_encode_bit_patterns";
    dev.require_fp8()?;
    let cfg = vec_launch(dev, out.len(), 1)?;
    let (n, flag) = (out.len() as u64, canonical_nan as i32);
    let ys = cs_mut(out, WHAT)?;
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("fp8_bits_", format_name(format)),
        cfg,
        "fp8_bits_<fmt>(u8* y, u32 start, u64 n, int canonical_nan)",
        [ys, &start, &n, &flag]
    )
}
