//! The CPU implementations of the element-wise family (rayon over chunks), the reference of the CUDA
//! kernels: each element computed in f32 with one rounding per operation, stored as `T`.

use super::{dropout_bits, gelu_grad_scalar, gelu_scalar, Dropout, GeluApprox};
use crate::FloatElement;
use rayon::prelude::*;

/// Elements per rayon task.
pub(super) const CHUNK: usize = 1 << 14;
/// Below this many elements the work stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;

/// Applies `f` to aligned chunks of two slices, in parallel when they are large.
fn zip_chunks<A: Sync, B: Send>(a: &[A], b: &mut [B], f: impl Fn(&[A], &mut [B]) + Sync + Send) {
    crate::cpu_kernel::zip_chunks(a, b, CHUNK, PAR_THRESHOLD, f);
}

/// Elementwise `out[i] = f(a[i], b[i])` in f32, stored as `T`.
fn map2<T: FloatElement>(
    a: &[T],
    b: &[T],
    out: &mut [T],
    f: impl Fn(f32, f32) -> f32 + Sync + Send,
) {
    let run = |(i0, o): (usize, &mut [T])| {
        for (k, y) in o.iter_mut().enumerate() {
            *y = T::from_f32(f(a[i0 + k].to_f32(), b[i0 + k].to_f32()));
        }
    };
    if out.len() < PAR_THRESHOLD {
        run((0, out));
    } else {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, o)| run((c * CHUNK, o)));
    }
}

/// `x[r, c] += bias[c]` over rows of `cols` elements.
pub(super) fn bias_add<T: FloatElement>(x: &mut [T], bias: &[T], cols: usize) {
    if cols == 0 {
        return;
    }
    let run = |chunk: &mut [T]| {
        for row in chunk.chunks_exact_mut(cols) {
            for (v, &bb) in row.iter_mut().zip(bias) {
                *v = T::from_f32(v.to_f32() + bb.to_f32());
            }
        }
    };
    let rows_per_task = (CHUNK / cols).max(1);
    if x.len() < PAR_THRESHOLD {
        run(x);
    } else {
        x.par_chunks_mut(rows_per_task * cols).for_each(run);
    }
}

/// `y = max(x, 0)`, NaN propagating.
pub(super) fn relu_forward<T: FloatElement>(x: &[T], y: &mut [T]) {
    zip_chunks(x, y, |a, o| {
        for (d, &s) in o.iter_mut().zip(a) {
            let v = s.to_f32();
            *d = T::from_f32(if v > 0.0 || v.is_nan() { v } else { 0.0 });
        }
    });
}

/// `dx = dy` where `x > 0`, else 0.
pub(super) fn relu_backward<T: FloatElement>(x: &[T], dy: &[T], dx: &mut [T]) {
    map2(x, dy, dx, |v, g| if v > 0.0 { g } else { 0.0 });
}

/// `y = gelu(x)`.
pub(super) fn gelu_forward<T: FloatElement>(x: &[T], y: &mut [T], approx: GeluApprox) {
    zip_chunks(x, y, |a, o| {
        for (d, &s) in o.iter_mut().zip(a) {
            *d = T::from_f32(gelu_scalar(s.to_f32(), approx));
        }
    });
}

/// `dx = gelu'(x) * dy`.
pub(super) fn gelu_backward<T: FloatElement>(x: &[T], dy: &[T], dx: &mut [T], approx: GeluApprox) {
    map2(x, dy, dx, |v, g| gelu_grad_scalar(v, approx) * g);
}

/// Dropout forward: the mask of element `i` from the counter `offset + i`.
pub(super) fn dropout_forward<T: FloatElement>(
    x: &[T],
    params: Dropout,
    y: &mut [T],
    mask: &mut [u8],
) {
    let (thr, scale) = (params.threshold(), params.keep_scale());
    let run = |(c, (yo, mo)): (usize, (&mut [T], &mut [u8]))| {
        let i0 = c * CHUNK;
        for (k, (yv, mv)) in yo.iter_mut().zip(mo.iter_mut()).enumerate() {
            let i = i0 + k;
            let keep = dropout_bits(params.seed, params.offset.wrapping_add(i as u64)) >= thr;
            *mv = keep as u8;
            *yv = T::from_f32(if keep { x[i].to_f32() * scale } else { 0.0 });
        }
    };
    y.par_chunks_mut(CHUNK)
        .zip(mask.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(run);
}

/// Dropout backward: `dx = dy * keep_scale` where the mask is 1, else 0.
pub(super) fn dropout_backward<T: FloatElement>(dy: &[T], mask: &[u8], scale: f32, dx: &mut [T]) {
    dx.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
        let i0 = c * CHUNK;
        for (k, d) in o.iter_mut().enumerate() {
            let i = i0 + k;
            *d = T::from_f32(if mask[i] != 0 {
                dy[i].to_f32() * scale
            } else {
                0.0
            });
        }
    });
}

/// `x *= a`.
pub(super) fn scale<T: FloatElement>(x: &mut [T], a: f32) {
    let run = |o: &mut [T]| {
        for v in o {
            *v = T::from_f32(v.to_f32() * a);
        }
    };
    if x.len() < PAR_THRESHOLD {
        run(x);
    } else {
        x.par_chunks_mut(CHUNK).for_each(run);
    }
}

/// `y += a * x` (two roundings).
pub(super) fn axpy<T: FloatElement>(a: f32, x: &[T], y: &mut [T]) {
    zip_chunks(x, y, |s, o| {
        for (d, &v) in o.iter_mut().zip(s) {
            *d = T::from_f32(d.to_f32() + a * v.to_f32());
        }
    });
}

/// `out = a + b`.
pub(super) fn add<T: FloatElement>(a: &[T], b: &[T], out: &mut [T]) {
    map2(a, b, out, |u, v| u + v);
}

/// `dst += src` with both widened to f32 and the sum rounded to `D`.
pub(super) fn add_at<D: FloatElement, S: FloatElement>(dst: &mut [D], src: &[S]) {
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            for (o, v) in d.iter_mut().zip(s) {
                *o = D::from_f32(o.to_f32() + v.to_f32());
            }
        });
}
