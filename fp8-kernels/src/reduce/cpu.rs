//! The CPU implementations of the reductions, in the summation orders the CUDA kernels use (except the
//! f64 sum of squares of [`norm_stats`], whose GPU order is not fixed).

use super::warp_order_sum;
use crate::FloatElement;
use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;
/// Below this many elements the work stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;

/// Column sums of `x [rows, cols]` in two levels: chunks of `chunk` rows summed in row order from zero,
/// then the chunk sums added in chunk order.
pub(super) fn sum_over_rows<T: FloatElement>(
    x: &[T],
    rows: usize,
    cols: usize,
    chunk: usize,
    out: &mut [f32],
) {
    let chunks = rows.div_ceil(chunk).max(1);
    // Tasks own column bands; within a band, contiguous row reads in the device's order.
    let band = 256usize;
    let run = |(bi, ob): (usize, &mut [f32])| {
        let c0 = bi * band;
        let mut part = vec![0.0f32; ob.len()];
        for k in 0..chunks {
            part.fill(0.0);
            for r in k * chunk..((k + 1) * chunk).min(rows) {
                let row = &x[r * cols + c0..r * cols + c0 + ob.len()];
                for (s, &v) in part.iter_mut().zip(row) {
                    *s += v.to_f32();
                }
            }
            if k == 0 {
                ob.copy_from_slice(&part);
            } else {
                for (s, p) in ob.iter_mut().zip(&part) {
                    *s += *p;
                }
            }
        }
    };
    if x.len() < PAR_THRESHOLD {
        out.chunks_mut(band).enumerate().for_each(run);
    } else {
        out.par_chunks_mut(band).enumerate().for_each(run);
    }
}

/// Row sums of `x [rows, cols]` in the warp order.
pub(super) fn sum_over_cols<T: FloatElement>(x: &[T], cols: usize, out: &mut [f32]) {
    let run = |(r, s): (usize, &mut f32)| {
        *s = warp_order_sum(x[r * cols..(r + 1) * cols].iter().map(|v| v.to_f32()));
    };
    if x.len() < PAR_THRESHOLD {
        out.iter_mut().enumerate().for_each(run);
    } else {
        out.par_iter_mut().enumerate().for_each(run);
    }
}

/// The largest finite `|x|` and the number of NaN or infinite values.
pub(super) fn finite_amax_count(x: &[f32]) -> (f32, u64) {
    x.par_chunks(CHUNK)
        .map(|s| {
            s.iter().fold((0.0f32, 0u64), |(a, c), v| {
                if v.is_finite() {
                    (a.max(v.abs()), c)
                } else {
                    (a, c + 1)
                }
            })
        })
        .reduce(|| (0.0, 0), |x, y| (x.0.max(y.0), x.1 + y.1))
}

/// Sum of squares (f64, in order) and amax of the finite values, and the count of the others.
pub(super) fn norm_stats<T: FloatElement>(x: &[T]) -> (f64, u32, f32) {
    let mut sq = 0f64;
    let mut nf = 0u32;
    let mut am = 0f32;
    for v in x.iter().map(|v| v.to_f32()) {
        if v.is_finite() {
            sq += (v as f64) * (v as f64);
            am = am.max(v.abs());
        } else {
            nf = nf.saturating_add(1);
        }
    }
    (sq, nf, am)
}
