//! GELU fused with the FP8 cast of its result (the input of an FP8 GEMM that follows a GELU): one pass
//! over the activations instead of two in each direction.
//!
//! - forward, [`gelu_cast_fp8`]: `h = gelu(u)` is cast with a device-resident scale into row-major codes
//!   and the codes of `h^T` (the operands of the FP8 forward GEMM and of the weight-gradient GEMM), and the
//!   amax of `h` accumulates into a device slot; `h` itself is never written.
//! - backward, [`gelu_backward_cast_fp8`]: `du = gelu'(u) * dh` is cast the same way (E5M2 for the
//!   output gradient; both layouts, as the two backward GEMMs consume them).
//!
//! Bit-identity: each value is computed with [`crate::elementwise::gelu_scalar`] /
//! [`crate::elementwise::gelu_grad_scalar`] (the CUDA kernels with `gelu.cuh`, the element-wise family's
//! arithmetic), rounded to the element type `T` as the unfused [`crate::elementwise::gelu_forward`] /
//! [`crate::elementwise::gelu_backward`] store it, and then amax'ed and encoded as
//! [`crate::cast_transpose_to_fp8`] does. So the codes, transposed codes and amax equal those of the two
//! unfused kernels on the same device, bit for bit.

mod cpu;
mod cuda;

use crate::cast::{check_code_layouts, check_nonempty};
use crate::cpu_kernel::codes_or_scratch;
use crate::device::{device_of, shape_len};
use crate::elementwise::GeluApprox;
use crate::{check_len, AmaxSlot, Buffer, FloatElement, KernelError};
use fp8_core::Fp8Format;

#[allow(clippy::too_many_arguments)]
fn run_fused<T: FloatElement>(
    what: &'static str,
    u: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    shape: [usize; 2],
    approx: GeluApprox,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: Option<&mut Buffer<u8>>,
    out_t: Option<&mut Buffer<u8>>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    let [rows, cols] = shape;
    let n = shape_len(what, &shape)?;
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("shape {rows}x{cols} exceeds the 32-bit index range"),
        });
    }
    check_len(what, n, u.len())?;
    if let Some(g) = dh {
        check_len(what, n, g.len())?;
    }
    check_code_layouts(what, n, out.as_deref(), out_t.as_deref())?;
    check_nonempty(scale, what)?;
    if let Some(a) = &amax {
        a.check(what)?;
    }
    let dev = device_of(what, &[u, &dh, scale, &out, &out_t, &amax])?;
    match dev {
        None => {
            let s = scale.host(what)?[0];
            let value = match dh {
                Some(g) => cpu::Value::Backward(g.host(what)?),
                None => cpu::Value::Forward,
            };
            let mut scratch = Vec::new();
            let codes = out.map(|q| q.host_mut(what)).transpose()?;
            let codes = codes_or_scratch(codes, n, &mut scratch);
            let a = cpu::values_cast(u.host(what)?, value, approx, format, s, codes);
            if let Some(qt) = out_t {
                cpu::transpose_codes(codes, rows, cols, qt.host_mut(what)?);
            }
            match amax {
                Some(slot) => slot.accumulate_host(what, a),
                None => Ok(()),
            }
        }
        Some(dev) => {
            let codes = cuda::Codes {
                format,
                scale,
                out,
                out_t,
                amax,
            };
            cuda::gelu_cast(&dev, what, u, dh, shape, approx, codes)
        }
    }
}

/// Forward: `h = gelu(u)` for row-major `u [rows, cols]`, rounded to `T`, cast to `format` with
/// `scale[0]` (read on the device) into `out` (`[rows, cols]`) and `out_t` (`h^T`, `[cols, rows]`), each
/// when given (at least one: a forward whose down linear recasts its input later needs no `out_t`); the
/// amax of `h` accumulates into `amax` when given. Equal bit for bit to
/// [`crate::elementwise::gelu_forward`] into a `T` buffer followed by [`crate::cast_transpose_to_fp8`] of
/// it.
#[allow(clippy::too_many_arguments)]
pub fn gelu_cast_fp8<T: FloatElement>(
    u: &Buffer<T>,
    shape: [usize; 2],
    approx: GeluApprox,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: Option<&mut Buffer<u8>>,
    out_t: Option<&mut Buffer<u8>>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    run_fused(
        "gelu_cast_fp8",
        u,
        None,
        shape,
        approx,
        format,
        scale,
        out,
        out_t,
        amax,
    )
}

/// Backward: `du = gelu'(u) * dh` (row-major `[rows, cols]`), rounded to `T`, cast to `format` with
/// `scale[0]` into `out` and `out_t` (`du^T`); the amax of `du` accumulates into `amax` when given.
/// Equal bit for bit to [`crate::elementwise::gelu_backward`] into a `T` buffer followed by
/// [`crate::cast_transpose_to_fp8`] of it.
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward_cast_fp8<T: FloatElement>(
    u: &Buffer<T>,
    dh: &Buffer<T>,
    shape: [usize; 2],
    approx: GeluApprox,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: Option<&mut Buffer<u8>>,
    out_t: Option<&mut Buffer<u8>>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    run_fused(
        "gelu_backward_cast_fp8",
        u,
        Some(dh),
        shape,
        approx,
        format,
        scale,
        out,
        out_t,
        amax,
    )
}
