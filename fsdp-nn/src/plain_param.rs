//! Gathered plain parameters in the type a kernel takes. The model gathers plain parameters in F32 or
//! in BF16 (`fsdp_shard::FsdpConfig::plain_gather_dtype`); a layer borrows one when the types agree and
//! converts it otherwise (rounding to nearest even, or widening exactly).

use crate::retype::{buffer_converted, buffer_ref};
use crate::NnError;
use fp8_kernels::{convert, Buffer, Device, FloatElement, KernelError};
use fsdp_shard::{GatheredParam, PlainParam};

/// The plain parameter `p` of `layer` (an error naming the layer for an FP8 weight).
pub(crate) fn plain_param<'a>(
    p: &'a GatheredParam,
    layer: &str,
) -> Result<PlainParam<'a>, NnError> {
    p.as_plain()
        .ok_or_else(|| NnError::usage(layer, "expected a plain parameter"))
}

/// `b` converted into `slot`'s buffer, which is reused when its length fits (a layer keeps its scratch
/// between calls) and made otherwise.
fn convert_into<'a, S: FloatElement, T: FloatElement>(
    b: &Buffer<S>,
    slot: &'a mut Option<Buffer<T>>,
) -> Result<&'a mut Buffer<T>, NnError> {
    if slot.as_ref().is_none_or(|o| o.len() != b.len()) {
        *slot = Some(b.device().uninit::<T>(b.len())?);
    }
    let out = slot
        .as_mut()
        .ok_or(KernelError::Internal("conversion buffer missing".into()))?;
    convert(b, out)?;
    Ok(out)
}

/// `p` as a `Buffer<T>`: itself when gathered in `T`, else converted into `scratch`.
pub(crate) fn plain_in<'a, T: FloatElement>(
    p: PlainParam<'a>,
    scratch: &'a mut Option<Buffer<T>>,
) -> Result<&'a Buffer<T>, NnError> {
    fn borrow_or_convert<'a, S: FloatElement, T: FloatElement>(
        b: &'a Buffer<S>,
        scratch: &'a mut Option<Buffer<T>>,
    ) -> Result<&'a Buffer<T>, NnError> {
        match buffer_ref::<S, T>(b) {
            Some(same) => Ok(same),
            None => Ok(convert_into(b, scratch)?),
        }
    }
    match p {
        PlainParam::F32(b) => borrow_or_convert(b, scratch),
        PlainParam::Bf16(b) => borrow_or_convert(b, scratch),
    }
}

/// An owned copy of `p` in `T` on `dev` (a copy when gathered in `T`, else converted).
pub(crate) fn plain_owned<T: FloatElement>(
    dev: &Device,
    p: PlainParam<'_>,
) -> Result<Buffer<T>, NnError> {
    fn owned<S: FloatElement, T: FloatElement>(
        dev: &Device,
        b: &Buffer<S>,
    ) -> Result<Buffer<T>, NnError> {
        if let Some(same) = buffer_ref::<S, T>(b) {
            return Ok(same.to_device(dev)?);
        }
        let mut out = None;
        convert_into(b, &mut out)?;
        out.ok_or_else(|| KernelError::Internal("conversion buffer missing".into()).into())
    }
    match p {
        PlainParam::F32(b) => owned(dev, b),
        PlainParam::Bf16(b) => owned(dev, b),
    }
}

/// The plain parameter `p`, taken out of its unit, as a `Buffer<T>`: moved when gathered in `T`, else
/// converted (an error naming `layer` for an FP8 weight).
pub(crate) fn plain_into<T: FloatElement>(
    p: GatheredParam,
    layer: &str,
) -> Result<Buffer<T>, NnError> {
    match p {
        GatheredParam::Plain(b) => buffer_converted::<f32, T>(b),
        GatheredParam::PlainBf16(b) => buffer_converted::<half::bf16, T>(b),
        GatheredParam::Fp8 { .. } | GatheredParam::Fp8Block { .. } => {
            Err(NnError::usage(layer, "expected a plain parameter"))
        }
    }
}
