//! The CPU implementations of the cast family (rayon over chunks), the reference of the CUDA kernels.

use crate::cpu_kernel::{transpose_bands, zip_chunks};
use crate::FloatElement;
use fp8_core::Fp8Format;
use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;
/// Below this many elements the work stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 16;
/// Side of the square tiles of the cast + transpose.
const TRANSPOSE_TILE: usize = 32;

/// `max(acc, |v|)` ignoring NaN (f32::max returns the non-NaN operand).
#[inline]
fn amax_fold(acc: f32, v: f32) -> f32 {
    acc.max(v.abs())
}

/// The largest `|x|`, NaN ignored.
pub(super) fn amax<T: FloatElement>(x: &[T]) -> f32 {
    let run = |s: &[T]| s.iter().fold(0.0f32, |a, &v| amax_fold(a, v.to_f32()));
    if x.len() < PAR_THRESHOLD {
        run(x)
    } else {
        x.par_chunks(CHUNK).map(run).reduce(|| 0.0, f32::max)
    }
}

/// Casts `x` into `y` (`encode(x * scale)`) and returns the amax of `x`.
pub(super) fn cast<T: FloatElement>(x: &[T], format: Fp8Format, scale: f32, y: &mut [u8]) -> f32 {
    let run = |s: &[T], d: &mut [u8]| {
        let mut a = 0.0f32;
        for (o, &v) in d.iter_mut().zip(s) {
            let v = v.to_f32();
            a = amax_fold(a, v);
            *o = format.encode(v * scale);
        }
        a
    };
    if x.len() < PAR_THRESHOLD {
        run(x, y)
    } else {
        x.par_chunks(CHUNK)
            .zip(y.par_chunks_mut(CHUNK))
            .map(|(s, d)| run(s, d))
            .reduce(|| 0.0, f32::max)
    }
}

/// `y[i] = T::from_f32(decode(q[i]) * scale_inv)`.
pub(super) fn dequantize<T: FloatElement>(
    q: &[u8],
    format: Fp8Format,
    scale_inv: f32,
    y: &mut [T],
) {
    let table = format.decode_table();
    zip_chunks(q, y, CHUNK, PAR_THRESHOLD, |s, d| {
        for (o, &c) in d.iter_mut().zip(s) {
            *o = T::from_f32(table[c as usize] * scale_inv);
        }
    });
}

/// Dequantizes FP8 codes: `decode(code) * scale_inv` in f32 (the CPU side of the FP8 GEMM).
pub fn dequantize_fp8_host(codes: &[u8], format: Fp8Format, scale_inv: f32) -> Vec<f32> {
    let table = format.decode_table();
    if codes.len() >= PAR_THRESHOLD {
        codes
            .par_iter()
            .map(|&c| table[c as usize] * scale_inv)
            .collect()
    } else {
        codes
            .iter()
            .map(|&c| table[c as usize] * scale_inv)
            .collect()
    }
}

/// `dst[i] = D::from_f32(dst[i] + decode(q[i]) * scale_inv)`: the product rounded to f32, one f32 sum.
pub(super) fn add_decoded<D: FloatElement>(
    dst: &mut [D],
    q: &[u8],
    format: Fp8Format,
    scale_inv: f32,
) {
    let table = format.decode_table();
    dst.par_chunks_mut(CHUNK)
        .zip(q.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            for (o, &c) in d.iter_mut().zip(s) {
                *o = D::from_f32(o.to_f32() + table[c as usize] * scale_inv);
            }
        });
}

/// `yt` = the codes of the transpose of row-major `x [rows, cols]`, `[cols, rows]`.
pub(super) fn cast_transpose<T: FloatElement>(
    x: &[T],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    scale: f32,
    yt: &mut [u8],
) {
    // Each task owns a band of TRANSPOSE_TILE output rows (= input columns) and walks it in square tiles,
    // so reads and writes both stay within a few cache lines per row.
    transpose_bands(yt, rows, TRANSPOSE_TILE, |c0, cw, out| {
        for r0 in (0..rows).step_by(TRANSPOSE_TILE) {
            let rh = TRANSPOSE_TILE.min(rows - r0);
            for r in r0..r0 + rh {
                let row = &x[r * cols + c0..r * cols + c0 + cw];
                for (dc, &v) in row.iter().enumerate() {
                    out[dc * rows + r] = format.encode(v.to_f32() * scale);
                }
            }
        }
    });
}

/// `y[i] = D::from_f32(x[i].to_f32())`.
pub(super) fn convert<S: FloatElement, D: FloatElement>(x: &[S], y: &mut [D]) {
    zip_chunks(x, y, CHUNK, PAR_THRESHOLD, |s, d| {
        for (o, &v) in d.iter_mut().zip(s) {
            *o = D::from_f32(v.to_f32());
        }
    });
}
