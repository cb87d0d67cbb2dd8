//! Launches of the SwiGLU kernels (`swiglu_cast.cu`). `mod.rs` validated every argument.

use super::SwigluCodes;
use crate::cast::format_name;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::SWIGLU_CAST_MODULE;
use crate::launch::{cast_transpose_launch, grid, kernel_name, launch, optional_ptr_mut};
use crate::{Buffer, CudaDevice, FloatElement, KernelError};

/// `swiglu_fwd_<T>` (`dh` None) or `swiglu_bwd_<T>`: the element-wise outputs in `T`.
pub(super) fn values<T: FloatElement>(
    dev: &CudaDevice,
    what: &'static str,
    gu: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    [rows, f]: [usize; 2],
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    let (r, c) = (rows as u64, f as u64);
    let (gs, os) = (cs(gu, what)?, cs_mut(out, what)?);
    match dh {
        None => launch!(
            dev,
            &SWIGLU_CAST_MODULE,
            kernel_name!("swiglu_fwd_", T::NAME),
            grid(dev, r * c),
            "swiglu_fwd_<T>(const T* gu, T* h, u64 rows, u64 f)",
            [gs, os, &r, &c]
        ),
        Some(dh) => {
            let ds = cs(dh, what)?;
            launch!(
                dev,
                &SWIGLU_CAST_MODULE,
                kernel_name!("swiglu_bwd_", T::NAME),
                grid(dev, 2 * r * c),
                "swiglu_bwd_<T>(const T* gu, const T* dh, T* dgu, u64 rows, u64 f)",
                [gs, ds, os, &r, &c]
            )
        }
    }
}

/// `swiglu_cast_transpose_<T>_<fmt>` (`dh` None) or `swiglu_bwd_cast_transpose_<T>_<fmt>`.
pub(super) fn swiglu_cast<T: FloatElement>(
    dev: &CudaDevice,
    what: &'static str,
    gu: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    [rows, f]: [usize; 2],
    out: SwigluCodes<'_, '_>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let cols = if dh.is_some() { 2 * f } else { f };
    let cfg = cast_transpose_launch(dev.sm_count(), rows, cols);
    let (r, fi) = (rows as i32, f as i32);
    let SwigluCodes {
        format,
        scale,
        codes,
        codes_t,
        amax,
    } = out;
    let slot = amax.as_ref().map_or(0, |a| a.slot as i32);
    let fmt = format_name(format);
    let (gs, ss) = (cs(gu, what)?, cs(scale, what)?);
    let ys = codes.map(|q| cs_mut(q, what)).transpose()?;
    let yt = codes_t.map(|q| cs_mut(q, what)).transpose()?;
    let (ys, yt) = (
        optional_ptr_mut(ys, dev.stream()),
        optional_ptr_mut(yt, dev.stream()),
    );
    let amax = amax.map(|a| cs_mut(a.buffer, what)).transpose()?;
    let amax = optional_ptr_mut(amax, dev.stream());
    match dh {
        None => launch!(
            dev,
            &SWIGLU_CAST_MODULE,
            kernel_name!("swiglu_cast_transpose_", T::NAME, "_", fmt),
            cfg,
            "swiglu_cast_transpose_<T>_<fmt>(const T* gu, u8* y, u8* yt, const float* scale, float* amax, \
             int slot, int rows, int f)",
            [gs, &ys.ptr, &yt.ptr, ss, &amax.ptr, &slot, &r, &fi]
        ),
        Some(dh) => {
            let ds = cs(dh, what)?;
            launch!(
                dev,
                &SWIGLU_CAST_MODULE,
                kernel_name!("swiglu_bwd_cast_transpose_", T::NAME, "_", fmt),
                cfg,
                "swiglu_bwd_cast_transpose_<T>_<fmt>(const T* gu, const T* dh, u8* y, u8* yt, \
                 const float* scale, float* amax, int slot, int rows, int f)",
                [gs, ds, &ys.ptr, &yt.ptr, ss, &amax.ptr, &slot, &r, &fi]
            )
        }
    }
}
