//! SwiGLU, the gated MLP activation of Llama (`down(silu(gate(x)) * up(x))`), on the output of a fused
//! gate/up projection: per token `[gate: F | up: F]`, row-major `gu [rows, 2F]`.
//!
//! - [`swiglu_forward`]: `h = silu(gate) * up` into a `[rows, F]` buffer of the input's element type.
//! - [`swiglu_cast_fp8`]: the same `h` (rounded to `T`) cast with a device-resident scale into row-major
//!   codes and the codes of `h^T` (the operands of the FP8 down-projection and of its weight-gradient
//!   GEMM), the amax of `h` accumulating into a device slot, as [`crate::gelu_cast::gelu_cast_fp8`];
//!   `h` itself is never written. The backward recomputes what it needs from `gu`, so nothing else is
//!   saved.
//! - [`swiglu_backward`]: from `dh [rows, F]` and the saved `gu`, `dgu = [dgate | dup] [rows, 2F]`, the
//!   gradient of the fused projection's output, in `T`.
//! - [`swiglu_backward_cast_fp8`]: the same `dgu` cast (E5M2 for gradients) into codes `[rows, 2F]` and
//!   transposed codes `[2F, rows]`, as [`crate::gelu_cast::gelu_backward_cast_fp8`].
//!
//! # Definitions (both devices, f32, one rounding per operation)
//! With `e = exp_fixed(-g)` ([`crate::cross_entropy::exp_fixed`]: a fixed polynomial that both devices
//! evaluate identically, about 1 ulp from `exp`), `den = 1 + e`:
//! - `silu = g / den`, `h = silu * u`;
//! - `s = 1 / den`, `dsilu = s * (1 + g * (1 - s))`, `dgate = (dh * u) * dsilu`, `dup = dh * silu`;
//! - each output rounded once to `T`; the casts encode `T(value) * scale` (saturating, round to nearest
//!   even) and take the amax of `T(value)`, NaN ignored.
//!
//! So CPU and CUDA agree bit for bit, and the fused casts equal the element-wise kernel into a `T` buffer
//! followed by [`crate::cast_transpose_to_fp8`] of it, bit for bit. For `g` below about -88, `e`
//! overflows to infinity and `silu` is `-0` (the true value is below 1e-36 in magnitude).

mod cpu;
mod cuda;

use crate::cast::{check_code_layouts, check_nonempty};
use crate::cpu_kernel::codes_or_scratch;
use crate::cross_entropy::exp_fixed;
use crate::device::{device_of, shape_len};
use crate::{check_len, AmaxSlot, Buffer, FloatElement, KernelError};
use fp8_core::Fp8Format;

/// `silu(g) * u` in f32, as the kernels compute it (before the rounding to the element type).
#[inline]
pub fn swiglu_scalar(g: f32, u: f32) -> f32 {
    let silu = g / (1.0 + exp_fixed(-g));
    silu * u
}

/// `(dgate, dup) = ((dh * u) * silu'(g), dh * silu(g))` in f32, as the kernels compute them.
#[inline]
pub fn swiglu_grad_scalars(g: f32, u: f32, dh: f32) -> (f32, f32) {
    let den = 1.0 + exp_fixed(-g);
    let silu = g / den;
    let s = 1.0 / den;
    let dsilu = s * (1.0 + g * (1.0 - s));
    ((dh * u) * dsilu, dh * silu)
}

/// Checks `[rows, f]` (both within the kernels' 32-bit range, `2f` included) and the lengths of `gu`
/// (`rows * 2f`) and `dh` (`rows * f`); returns `rows * f`.
fn check_shape<T: FloatElement>(
    what: &'static str,
    [rows, f]: [usize; 2],
    gu: &Buffer<T>,
    dh: Option<&Buffer<T>>,
) -> Result<usize, KernelError> {
    let n = shape_len(what, &[rows, f, 2])?;
    if rows > i32::MAX as usize || f > (i32::MAX / 2) as usize {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("shape {rows}x{f} exceeds the 32-bit index range"),
        });
    }
    check_len(what, n, gu.len())?;
    if let Some(d) = dh {
        check_len(what, n / 2, d.len())?;
    }
    Ok(n / 2)
}

fn run_values<T: FloatElement>(
    what: &'static str,
    gu: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    shape: [usize; 2],
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    let n = check_shape(what, shape, gu, dh)?;
    check_len(what, if dh.is_some() { 2 * n } else { n }, out.len())?;
    match device_of(what, &[gu, &dh, out])? {
        None => {
            let value = match dh {
                Some(d) => cpu::Value::Backward(d.host(what)?),
                None => cpu::Value::Forward,
            };
            cpu::values(gu.host(what)?, value, shape[1], out.host_mut(what)?);
            Ok(())
        }
        Some(dev) => cuda::values(&dev, what, gu, dh, shape, out),
    }
}

/// Forward: `h [rows, F] = T(silu(gate) * up)` from `gu [rows, 2F]` (`shape = [rows, F]`).
pub fn swiglu_forward<T: FloatElement>(
    gu: &Buffer<T>,
    shape: [usize; 2],
    h: &mut Buffer<T>,
) -> Result<(), KernelError> {
    run_values("swiglu_forward", gu, None, shape, h)
}

/// Backward: `dgu [rows, 2F] = [dgate | dup]` from `gu [rows, 2F]` and `dh [rows, F]`.
pub fn swiglu_backward<T: FloatElement>(
    gu: &Buffer<T>,
    dh: &Buffer<T>,
    shape: [usize; 2],
    dgu: &mut Buffer<T>,
) -> Result<(), KernelError> {
    run_values("swiglu_backward", gu, Some(dh), shape, dgu)
}

/// The FP8 outputs of [`swiglu_cast_fp8`] and [`swiglu_backward_cast_fp8`].
#[derive(Debug)]
pub struct SwigluCodes<'a, 'b> {
    /// The FP8 format (E4M3 for activations, E5M2 for gradients).
    pub format: Fp8Format,
    /// `scale[0]`, read on the device.
    pub scale: &'a Buffer<f32>,
    /// Row-major codes of the output, if wanted (at least one layout).
    pub codes: Option<&'a mut Buffer<u8>>,
    /// Codes of its transpose, if wanted: a forward whose down linear casts its input again in the
    /// backward needs none (and that recast needs no row-major codes).
    pub codes_t: Option<&'a mut Buffer<u8>>,
    /// Where the amax of the (unscaled, `T`-rounded) output accumulates, if anywhere.
    pub amax: Option<AmaxSlot<'b>>,
}

fn run_fused<T: FloatElement>(
    what: &'static str,
    gu: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    shape: [usize; 2],
    out: SwigluCodes<'_, '_>,
) -> Result<(), KernelError> {
    check_shape(what, shape, gu, dh)?;
    // The forward casts `h [rows, F]`, the backward `[dgate | dup] [rows, 2F]` (in range: checked above).
    let (rows, cols) = (shape[0], if dh.is_some() { 2 * shape[1] } else { shape[1] });
    check_code_layouts(
        what,
        rows * cols,
        out.codes.as_deref(),
        out.codes_t.as_deref(),
    )?;
    check_nonempty(out.scale, what)?;
    if let Some(a) = &out.amax {
        a.check(what)?;
    }
    match device_of(
        what,
        &[gu, &dh, out.scale, &out.codes, &out.codes_t, &out.amax],
    )? {
        None => {
            let s = out.scale.host(what)?[0];
            let value = match dh {
                Some(d) => cpu::Value::Backward(d.host(what)?),
                None => cpu::Value::Forward,
            };
            let mut scratch = Vec::new();
            let codes = out.codes.map(|q| q.host_mut(what)).transpose()?;
            let codes = codes_or_scratch(codes, rows * cols, &mut scratch);
            let a = cpu::values_cast(gu.host(what)?, value, shape[1], out.format, s, codes);
            if let Some(qt) = out.codes_t {
                cpu::transpose_codes(codes, rows, cols, qt.host_mut(what)?);
            }
            match out.amax {
                Some(slot) => slot.accumulate_host(what, a),
                None => Ok(()),
            }
        }
        Some(dev) => cuda::swiglu_cast(&dev, what, gu, dh, shape, out),
    }
}

/// Forward fused with the FP8 cast: the codes of `h = T(silu(gate) * up)` (`[rows, F]`, `shape = [rows,
/// F]`) row-major into `out.codes` and transposed (`[F, rows]`) into `out.codes_t`, scaled by
/// `out.scale[0]`; the amax of `h` accumulates into `out.amax`. Equal bit for bit to [`swiglu_forward`]
/// followed by [`crate::cast_transpose_to_fp8`].
pub fn swiglu_cast_fp8<T: FloatElement>(
    gu: &Buffer<T>,
    shape: [usize; 2],
    out: SwigluCodes<'_, '_>,
) -> Result<(), KernelError> {
    run_fused("swiglu_cast_fp8", gu, None, shape, out)
}

/// Backward fused with the FP8 cast: the codes of `dgu = [dgate | dup]` (`[rows, 2F]`) row-major and
/// transposed (`[2F, rows]`); the amax of `dgu` accumulates into `out.amax`. Equal bit for bit to
/// [`swiglu_backward`] followed by [`crate::cast_transpose_to_fp8`].
pub fn swiglu_backward_cast_fp8<T: FloatElement>(
    gu: &Buffer<T>,
    dh: &Buffer<T>,
    shape: [usize; 2],
    out: SwigluCodes<'_, '_>,
) -> Result<(), KernelError> {
    run_fused("swiglu_backward_cast_fp8", gu, Some(dh), shape, out)
}
