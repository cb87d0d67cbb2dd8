//! The CPU implementation of SwiGLU: the scalar functions of `mod.rs` per element (rayon over chunks),
//! and the fused casts through the cast family's encoding and transpose.

use super::{swiglu_grad_scalars, swiglu_scalar};
use crate::cpu_kernel::{cast_values, transpose_copy};
use crate::FloatElement;
use fp8_core::Fp8Format;
use rayon::prelude::*;

/// Side of the square bands of the transpose.
const TILE: usize = 32;
/// Elements per rayon task of the element-wise outputs.
const CHUNK: usize = 1 << 14;

/// Which output: `h [rows, F]`, or `[dgate | dup] [rows, 2F]` from `dh [rows, F]`.
#[derive(Clone, Copy)]
pub(super) enum Value<'a, T> {
    Forward,
    Backward(&'a [T]),
}

/// The f32 value (before rounding to `T`) of output element `i` from `gu [rows, 2F]`.
#[inline]
fn value_at<T: FloatElement>(gu: &[T], value: Value<'_, T>, f: usize, i: usize) -> f32 {
    match value {
        Value::Forward => {
            let (r, c) = (i / f, i % f);
            swiglu_scalar(gu[2 * f * r + c].to_f32(), gu[2 * f * r + f + c].to_f32())
        }
        Value::Backward(dh) => {
            let (r, c) = (i / (2 * f), i % (2 * f));
            let k = c % f;
            let (g, u) = (gu[2 * f * r + k].to_f32(), gu[2 * f * r + f + k].to_f32());
            let (dgate, dup) = swiglu_grad_scalars(g, u, dh[f * r + k].to_f32());
            if c < f {
                dgate
            } else {
                dup
            }
        }
    }
}

/// `out[i] = T(value i)` over the whole output.
pub(super) fn values<T: FloatElement>(gu: &[T], value: Value<'_, T>, f: usize, out: &mut [T]) {
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, d)| {
        for (k, o) in d.iter_mut().enumerate() {
            *o = T::from_f32(value_at(gu, value, f, c * CHUNK + k));
        }
    });
}

/// Row-major codes of the values rounded to `T` (as [`values`] stores them) and their amax.
pub(super) fn values_cast<T: FloatElement>(
    gu: &[T],
    value: Value<'_, T>,
    f: usize,
    format: Fp8Format,
    scale: f32,
    out: &mut [u8],
) -> f32 {
    cast_values(out, format, scale, |i| {
        T::from_f32(value_at(gu, value, f, i)).to_f32()
    })
}

/// `yt [cols, rows] = y^T` for row-major `y [rows, cols]` bytes, in bands of `TILE` output rows.
pub(super) fn transpose_codes(y: &[u8], rows: usize, cols: usize, yt: &mut [u8]) {
    transpose_copy(y, rows, cols, TILE, yt);
}
