//! The CPU implementation of the fused GELU casts: the values exactly as the element-wise GELU stores
//! them, then encoded and transposed as the cast family's cast + transpose does.

use crate::cpu_kernel::{cast_values, transpose_copy};
use crate::elementwise::{gelu_grad_scalar, gelu_scalar, GeluApprox};
use crate::FloatElement;
use fp8_core::Fp8Format;

/// Side of the square bands of the transpose.
const TILE: usize = 32;

/// What is cast: `gelu(u)` or `gelu'(u) * dh`.
#[derive(Clone, Copy)]
pub(super) enum Value<'a, T> {
    Forward,
    Backward(&'a [T]),
}

/// Row-major codes of the values and their amax (NaN never raises it, as in the cast family).
pub(super) fn values_cast<T: FloatElement>(
    u: &[T],
    value: Value<'_, T>,
    approx: GeluApprox,
    format: Fp8Format,
    scale: f32,
    out: &mut [u8],
) -> f32 {
    cast_values(out, format, scale, |i| {
        let v = u[i].to_f32();
        match value {
            Value::Forward => T::from_f32(gelu_scalar(v, approx)),
            Value::Backward(dh) => T::from_f32(gelu_grad_scalar(v, approx) * dh[i].to_f32()),
        }
        .to_f32()
    })
}

/// `yt [cols, rows] = y^T` for row-major `y [rows, cols]` bytes, in bands of `TILE` output rows.
pub(super) fn transpose_codes(y: &[u8], rows: usize, cols: usize, yt: &mut [u8]) {
    transpose_copy(y, rows, cols, TILE, yt);
}
