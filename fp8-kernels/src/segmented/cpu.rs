//! The CPU parts of the segmented family that are more than a loop over segments.

use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// Largest `|x|` over a slice, NaN ignored (as `fp8_core::amax_f32`).
pub(super) fn amax(x: &[f32]) -> f32 {
    if x.len() < CHUNK * 4 {
        x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
    } else {
        x.par_chunks(CHUNK)
            .map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.abs())))
            .reduce(|| 0.0, f32::max)
    }
}
