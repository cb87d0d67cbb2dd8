//! Launches of the cast kernels (`cast.cu`). `mod.rs` validated every argument: lengths, slots, devices.

use super::{format_name, CurrentScaling};
use crate::kernel_source::CAST_MODULE;
use crate::launch::{cast_transpose_launch, grid, kernel_name, launch, optional_ptr_mut};
use crate::{CudaDevice, FloatElement, KernelError};
use cudarc::driver::{CudaSlice, LaunchConfig};
use fp8_core::{Fp8Format, ScaleRounding};

/// A grid-stride launch over `n` elements taken `per_thread` at a time.
fn vec_launch(dev: &CudaDevice, n: usize, per_thread: usize) -> Result<LaunchConfig, KernelError> {
    let items = (n / per_thread) as u64 + 1;
    Ok(grid(dev, items))
}

/// `amax[slot] = max(amax[slot], max |x|)`.
pub(super) fn amax<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    amax: &mut CudaSlice<f32>,
    slot: usize,
) -> Result<(), KernelError> {
    let cfg = vec_launch(dev, x.len(), 16)?;
    let (slot, n) = (slot as i32, x.len() as u64);
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("amax_", T::NAME),
        cfg,
        "amax_<T>(const T* x, float* amax, int slot, u64 n)",
        [x, amax, &slot, &n]
    )
}

/// `out = encode(x * scale[0])`, the amax of `x` into `amax.0[amax.1]` when given.
pub(super) fn cast<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    format: Fp8Format,
    scale: &CudaSlice<f32>,
    out: &mut CudaSlice<u8>,
    amax: Option<(&mut CudaSlice<f32>, usize)>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let cfg = vec_launch(dev, x.len(), 16)?;
    let n = x.len() as u64;
    let slot = amax.as_ref().map_or(0, |(_, s)| *s as i32);
    let amax = optional_ptr_mut(amax.map(|(b, _)| b), dev.stream());
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("cast_fp8_", T::NAME, "_", format_name(format)),
        cfg,
        "cast_fp8_<T>_<fmt>(const T* x, u8* y, const float* scale, float* amax, int slot, u64 n)",
        [x, out, scale, &amax.ptr, &slot, &n]
    )
}

/// The current-scaling cast: amax into `amax[0]` (zeroed first), the scale computed on the device from
/// it and the previous `scale[0]`, `scale`/`scale_inv` written, `x` cast with it.
pub(super) fn cast_current<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    spec: CurrentScaling,
    scale: &mut CudaSlice<f32>,
    scale_inv: &mut CudaSlice<f32>,
    amax: &mut CudaSlice<f32>,
    out: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    {
        let mut first = amax.slice_mut(0..1);
        dev.stream().memset_zeros(&mut first)?;
    }
    self::amax(dev, x, amax, 0)?;
    let cfg = vec_launch(dev, x.len(), 16)?;
    let (n, margin, fmax) = (x.len() as u64, spec.margin, spec.format.max());
    let exact = matches!(spec.rounding, ScaleRounding::Exact) as i32;
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("cast_fp8_current_", T::NAME, "_", format_name(spec.format)),
        cfg,
        "cast_fp8_current_<T>_<fmt>(const T* x, u8* y, float* scale, float* scale_inv, const float* amax, \
         float fmax, int margin, int exact, u64 n)",
        [x, out, scale, scale_inv, amax, &fmax, &margin, &exact, &n]
    )
}

/// `out = T(decode(q) * scale_inv[0])`.
pub(super) fn dequantize<T: FloatElement>(
    dev: &CudaDevice,
    q: &CudaSlice<u8>,
    format: Fp8Format,
    scale_inv: &CudaSlice<f32>,
    out: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let cfg = vec_launch(dev, q.len(), 16)?;
    let n = q.len() as u64;
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("dequant_", format_name(format), "_", T::NAME),
        cfg,
        "dequant_<fmt>_<T>(const u8* q, T* y, const float* scale_inv, u64 n)",
        [q, out, scale_inv, &n]
    )
}

/// `dst = D(dst + decode(q) * scale_inv[0])` for an f32 or bf16 destination.
pub(super) fn add_decoded<D: FloatElement>(
    dev: &CudaDevice,
    dst: &mut CudaSlice<D>,
    q: &CudaSlice<u8>,
    format: Fp8Format,
    scale_inv: &CudaSlice<f32>,
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
    launch!(
        dev,
        &CAST_MODULE,
        name,
        cfg,
        "add_decoded_<fmt>[_to_bf16](D* dst, const u8* q, const float* scale_inv, u64 n)",
        [dst, q, scale_inv, &n]
    )
}

/// Cast + transpose of row-major `x [rows, cols]` into `out_t` (and `out`), amax into `amax` when given.
#[allow(clippy::too_many_arguments)]
pub(super) fn cast_transpose<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    [rows, cols]: [usize; 2],
    format: Fp8Format,
    scale: &CudaSlice<f32>,
    out_t: &mut CudaSlice<u8>,
    out: Option<&mut CudaSlice<u8>>,
    amax: Option<(&mut CudaSlice<f32>, usize)>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let cfg = cast_transpose_launch(dev.sm_count(), rows, cols);
    let (r, c) = (rows as i32, cols as i32);
    let slot = amax.as_ref().map_or(0, |(_, s)| *s as i32);
    let out = optional_ptr_mut(out, dev.stream());
    let amax = optional_ptr_mut(amax.map(|(b, _)| b), dev.stream());
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("cast_transpose_", T::NAME, "_", format_name(format)),
        cfg,
        "cast_transpose_<T>_<fmt>(const T* x, u8* y, u8* out_t, const float* scale, float* amax, int slot, \
         int rows, int cols)",
        [x, &out.ptr, out_t, scale, &amax.ptr, &slot, &r, &c]
    )
}

/// `out = D(x)`, round to nearest even.
pub(super) fn convert<S: FloatElement, D: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<S>,
    out: &mut CudaSlice<D>,
) -> Result<(), KernelError> {
    let cfg = vec_launch(dev, x.len(), 8)?;
    let n = x.len() as u64;
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("convert_", S::NAME, "_", D::NAME),
        cfg,
        "convert_<S>_<D>(const S* x, D* y, u64 n)",
        [x, out, &n]
    )
}

/// `out[i]` = the FP8 code of the f32 with bit pattern `start + i`, at scale 1.
pub(super) fn encode_bit_patterns(
    dev: &CudaDevice,
    start: u32,
    format: Fp8Format,
    canonical_nan: bool,
    out: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let cfg = vec_launch(dev, out.len(), 1)?;
    let (n, flag) = (out.len() as u64, canonical_nan as i32);
    launch!(
        dev,
        &CAST_MODULE,
        kernel_name!("fp8_bits_", format_name(format)),
        cfg,
        "fp8_bits_<fmt>(u8* y, u32 start, u64 n, int canonical_nan)",
        [out, &start, &n, &flag]
    )
}
