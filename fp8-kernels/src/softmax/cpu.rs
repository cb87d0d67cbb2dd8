//! The CPU implementations of the softmax family, the reference of the CUDA kernels (row sums in the
//! warp order of [`crate::reduce::warp_order_sum`]).

use crate::reduce::warp_order_sum;
use crate::KernelError;
use rayon::prelude::*;

/// Below this many elements the work stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 15;

/// `lp = x - max - log(sum exp(x - max))` over rows of `classes` (> 0) values.
pub(super) fn log_softmax(x: &[f32], classes: usize, lp: &mut [f32]) {
    let run = |(r, o): (usize, &mut [f32])| {
        let row = &x[r * classes..(r + 1) * classes];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s = warp_order_sum(row.iter().map(|&v| (v - m).exp()));
        let lse = m + s.ln();
        for (d, &v) in o.iter_mut().zip(row) {
            *d = v - lse;
        }
    };
    if lp.len() < PAR_THRESHOLD {
        lp.chunks_mut(classes).enumerate().for_each(run);
    } else {
        lp.par_chunks_mut(classes).enumerate().for_each(run);
    }
}

/// `[mean loss, correct argmax]` of log-probabilities; an invalid label is an error.
pub(super) fn nll_stats(
    what: &'static str,
    lp: &[f32],
    labels: &[i32],
    classes: usize,
) -> Result<[f32; 2], KernelError> {
    let rows = labels.len();
    let mut loss = 0.0f64;
    let mut correct = 0u64;
    for (r, &label) in labels.iter().enumerate() {
        if label < 0 || label as usize >= classes {
            return Err(KernelError::InvalidArgument {
                what,
                detail: format!("label {label} of row {r} is outside 0..{classes}"),
            });
        }
        let row = &lp[r * classes..(r + 1) * classes];
        loss -= row[label as usize] as f64;
        let mut best = 0;
        for c in 1..classes {
            if row[c] > row[best] {
                best = c;
            }
        }
        correct += (best == label as usize) as u64;
    }
    let mean = if rows > 0 {
        (loss / rows as f64) as f32
    } else {
        0.0
    };
    Ok([mean, correct as f32])
}

/// `dlogits = (exp(lp) - onehot(label)) * g` over rows of `classes` (> 0) values.
pub(super) fn log_softmax_nll_backward(
    lp: &[f32],
    labels: &[i32],
    classes: usize,
    g: f32,
    dlogits: &mut [f32],
) {
    let run = |(r, o): (usize, &mut [f32])| {
        let label = labels[r];
        for (c, d) in o.iter_mut().enumerate() {
            let p = lp[r * classes + c].exp();
            let v = if label >= 0 && label as usize == c {
                p - 1.0
            } else {
                p
            };
            *d = v * g;
        }
    };
    dlogits.par_chunks_mut(classes).enumerate().for_each(run);
}
