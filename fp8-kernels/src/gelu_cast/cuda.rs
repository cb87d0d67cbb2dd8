//! Launches of the fused GELU casts (`gelu_cast.cu`). `mod.rs` validated every argument.

use crate::cast::format_name;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::elementwise::GeluApprox;
use crate::kernel_source::GELU_CAST_MODULE;
use crate::launch::{cast_transpose_launch, kernel_name, launch, optional_ptr_mut};
use crate::{AmaxSlot, Buffer, CudaDevice, FloatElement, KernelError};
use fp8_core::Fp8Format;

/// The output of one fused cast: row-major codes, transposed codes, scale and amax slot.
pub(super) struct Codes<'a, 'b> {
    pub(super) format: Fp8Format,
    pub(super) scale: &'a Buffer<f32>,
    pub(super) out: Option<&'a mut Buffer<u8>>,
    pub(super) out_t: Option<&'a mut Buffer<u8>>,
    pub(super) amax: Option<AmaxSlot<'b>>,
}

/// `gelu_cast_transpose_<T>_<fmt>` (forward, `dh` None) or `gelu_bwd_cast_transpose_<T>_<fmt>`.
pub(super) fn gelu_cast<T: FloatElement>(
    dev: &CudaDevice,
    what: &'static str,
    u: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    [rows, cols]: [usize; 2],
    approx: GeluApprox,
    codes: Codes<'_, '_>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let cfg = cast_transpose_launch(dev.sm_count(), rows, cols);
    let (r, c) = (rows as i32, cols as i32);
    let exact = (approx == GeluApprox::Erf) as i32;
    let Codes {
        format,
        scale,
        out,
        out_t,
        amax,
    } = codes;
    let slot = amax.as_ref().map_or(0, |a| a.slot as i32);
    let fmt = format_name(format);
    let (us, ss) = (cs(u, what)?, cs(scale, what)?);
    let ys = out.map(|q| cs_mut(q, what)).transpose()?;
    let yt = out_t.map(|q| cs_mut(q, what)).transpose()?;
    let (ys, yt) = (
        optional_ptr_mut(ys, dev.stream()),
        optional_ptr_mut(yt, dev.stream()),
    );
    let amax = amax.map(|a| cs_mut(a.buffer, what)).transpose()?;
    let amax = optional_ptr_mut(amax, dev.stream());
    match dh {
        None => launch!(
            dev,
            &GELU_CAST_MODULE,
            kernel_name!("gelu_cast_transpose_", T::NAME, "_", fmt),
            cfg,
            "gelu_cast_transpose_<T>_<fmt>(const T* x, u8* y, u8* yt, const float* scale, float* amax, \
             int slot, int rows, int cols, int exact)",
            [us, &ys.ptr, &yt.ptr, ss, &amax.ptr, &slot, &r, &c, &exact]
        ),
        Some(dh) => {
            let gs = cs(dh, what)?;
            launch!(
                dev,
                &GELU_CAST_MODULE,
                kernel_name!("gelu_bwd_cast_transpose_", T::NAME, "_", fmt),
                cfg,
                "gelu_bwd_cast_transpose_<T>_<fmt>(const T* x, const T* dy, u8* y, u8* yt, \
                 const float* scale, float* amax, int slot, int rows, int cols, int exact)",
                [us, gs, &ys.ptr, &yt.ptr, ss, &amax.ptr, &slot, &r, &c, &exact]
            )
        }
    }
}
