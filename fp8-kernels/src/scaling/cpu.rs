//! The CPU implementations of the scaling family, the reference of the CUDA kernels.

use crate::KernelError;
use fp8_core::{compute_scale, ScaleRounding};

/// What one scaling-meta update computes with: the recipe's amax choice and scale rule.
pub(super) struct MetaRule {
    /// Maximum over the history window (else the most recent entry).
    pub(super) window_max: bool,
    /// The format's largest finite value.
    pub(super) fmax: f32,
    /// Binades of headroom.
    pub(super) margin: i32,
    /// Power-of-two or exact scale.
    pub(super) rounding: ScaleRounding,
}

/// Records `|amax|` in the history ring (`state = [position, records low, records high]`) and
/// recomputes `scale`/`scale_inv` from the window.
pub(super) fn update_meta(
    what: &'static str,
    rule: &MetaRule,
    amax: f32,
    scale: &mut f32,
    scale_inv: &mut f32,
    history: &mut [f32],
    state: &mut [u32],
) -> Result<(), KernelError> {
    let len = history.len();
    let mut pos = state[0] as usize;
    if pos >= len {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("ring position {pos} outside a history of {len}"),
        });
    }
    history[pos] = amax.abs();
    pos = (pos + 1) % len;
    state[0] = pos as u32;
    let rec = (((state[2] as u64) << 32) | state[1] as u64) + 1;
    state[1] = rec as u32;
    state[2] = (rec >> 32) as u32;
    let w = if rule.window_max {
        history
            .iter()
            .copied()
            .filter(|h| h.is_finite())
            .fold(0.0, f32::max)
    } else {
        let h = history[(pos + len - 1) % len];
        if h.is_finite() {
            h
        } else {
            0.0
        }
    };
    let s = compute_scale(w, rule.fmax, rule.margin, rule.rounding, *scale);
    *scale = s;
    *scale_inv = 1.0 / s;
    Ok(())
}

/// `(scale, 1 / scale)` from one amax, the previous scale taken as 1 (power of two).
pub(super) fn scale_from_amax(amax: f32, fmax: f32, margin: i32) -> (f32, f32) {
    let s = compute_scale(amax, fmax, margin, ScaleRounding::PowerOfTwo, 1.0);
    (s, 1.0 / s)
}
