//! Views of a buffer of a generic activation type `T` as its concrete type (`f32` or `bf16`), for the
//! kernels that exist for one type only (flash attention is BF16; the CPU attention reference is F32).

use crate::NnError;
use fp8_kernels::{convert, Buffer, Element, FloatElement};
use std::any::Any;

/// `b` as a `Buffer<U>` when `T` is `U`.
pub(crate) fn buffer_ref<T: Element, U: Element>(b: &Buffer<T>) -> Option<&Buffer<U>> {
    let any: &dyn Any = b;
    any.downcast_ref::<Buffer<U>>()
}

/// `b` as a mutable `Buffer<U>` when `T` is `U`.
pub(crate) fn buffer_mut<T: Element, U: Element>(b: &mut Buffer<T>) -> Option<&mut Buffer<U>> {
    let any: &mut dyn Any = b;
    any.downcast_mut::<Buffer<U>>()
}

/// `b` moved into a `Buffer<U>` when `T` is `U`, else an error naming `layer`.
pub(crate) fn buffer_into<T: Element, U: Element>(
    b: Buffer<T>,
    layer: &str,
) -> Result<Buffer<U>, NnError> {
    let boxed: Box<dyn Any> = Box::new(b);
    boxed.downcast::<Buffer<U>>().map(|b| *b).map_err(|_| {
        NnError::usage(
            layer,
            format!("expected {} activations, got {}", U::DTYPE, T::DTYPE),
        )
    })
}

/// `b` as a `Buffer<U>`: moved when `T` is `U`, else converted (round to nearest even) on its device.
pub(crate) fn buffer_converted<T: FloatElement, U: FloatElement>(
    b: Buffer<T>,
) -> Result<Buffer<U>, NnError> {
    if T::DTYPE == U::DTYPE {
        return buffer_into(b, "convert");
    }
    let mut out = b.device().uninit::<U>(b.len())?;
    convert(&b, &mut out)?;
    Ok(out)
}
