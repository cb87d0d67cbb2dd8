//! Adam's policy: what a step of [`crate::ShardedAdam`] decides from the statistics the kernels compute.
//! The kernels of `fp8_kernels::adam` carry out these rules on the device (no host round trip); this
//! module holds the choices and the host-side reasoning behind them, and hands the kernels their
//! parameters ([`control_params`]).
//!
//! - **Skip.** Any non-finite gradient value on any rank (counted before any FP8 cast, which would
//!   saturate infinities, and in the reduced shards), or a non-finite global norm, skips the step on every
//!   rank: weights, states and Adam's step count stay as they were.
//! - **Clipping.** `torch.nn.utils.clip_grad_norm_`'s factor `min(1, max_grad_norm / (norm + CLIP_EPS))`
//!   by the global L2 norm over every shard of every rank, folded into the update's gradient factor.
//! - **Bias correction.** PyTorch's (`lr / (1 - beta1^t)`, `sqrt(1 - beta2^t)`), with `t` counting the
//!   steps taken, not the skipped ones.
//! - **Scales of the low-precision states**, below.
//!
//! # Scales of the low-precision states
//!
//! The fused kernel stores each new value as `encode(x * write_scale)` in the same pass that computes
//! `x`, so the write scale of step `t` must be known before the amax of step `t` is. It is derived from
//! quantities every rank already agrees on, as an upper bound of the new values' amax:
//! - the agreed amaxes of master, first and second moment after step `t - 1` (from the previous step's
//!   single all-reduce),
//! - the global amax of this step's gradient per weight (from this step's all-reduce SUM, where every
//!   rank writes its local amax into its own row of zeros, so the sum is the exact maximum).
//!
//! For an effective gradient `g` with `|g| <= G` (clipping and L2 folded in):
//! `|m_t| <= beta1 |m_{t-1}| + (1 - beta1) G` and `|v_t| <= beta2 |v_{t-1}| + (1 - beta2) G^2` exactly,
//! and `|w_t| <= |w_{t-1}| max(1, decay) + step_size |m_t / denom|`, where `|m_t / denom|` is at most
//! `bound(m_t) / eps` and, by Cauchy-Schwarz over Adam's sums, about
//! `sqrt(1 - beta2^t) (1 - beta1) / sqrt(1 - beta2) sqrt(sum_{j<t} (beta1^2 / beta2)^j)`; the smaller
//! is used, doubled ([`RATIO_FACTOR`]) for the rounding of stored states; every bound gets 1 %
//! ([`BOUND_SLACK`]) for the rounding of the arithmetic. Scales are powers of two with margins: E4M3 first
//! moment 0 (the bound is tight), F16 second moment 1, F16 master 4 bits (F16 has 40 binades; the master
//! bound is the least rigorous). A value above its bound would saturate, never become infinite.

use crate::config::AdamOptions;
use fp8_kernels::adam::control::{self, AdamControlParams, StateScaleRule};
use fp8_kernels::adam::{AdamCoefficients, AdamConfig, F16_MAX};
use fp8_kernels::WeightDecay;

/// Margin (binades of headroom) of the F16 master's write scale.
pub const MASTER_MARGIN: i32 = 4;
/// Margin of the E4M3 first moment's write scale.
pub const M_MARGIN: i32 = 0;
/// Margin of the F16 second moment's write scale.
pub const V_MARGIN: i32 = 1;
/// Every state bound is multiplied by this: room for the rounding of the arithmetic.
pub const BOUND_SLACK: f64 = 1.01;
/// The Cauchy-Schwarz bound of the update ratio is multiplied by this: room for the rounding of the
/// stored states the ratio is computed from.
pub const RATIO_FACTOR: f64 = 2.0;
/// Added to the global norm in the clipping factor (PyTorch's `clip_grad_norm_`).
pub const CLIP_EPS: f64 = 1e-6;

/// The state-scale rule of low-precision states.
pub const STATE_SCALE_RULE: StateScaleRule = StateScaleRule {
    margins: [MASTER_MARGIN, M_MARGIN, V_MARGIN],
    slack: BOUND_SLACK,
    ratio_factor: RATIO_FACTOR,
};

/// The parameters of the device-side step control for a step with learning rate `lr`: the options'
/// hyperparameters and clipping, and the state-scale rule when the states are low precision.
pub fn control_params(
    options: &AdamOptions,
    lr: f64,
    decay_mode: WeightDecay,
    low_precision: bool,
    slots: usize,
    world_size: usize,
) -> AdamControlParams {
    AdamControlParams {
        adam: AdamConfig {
            lr,
            beta1: options.betas.0,
            beta2: options.betas.1,
            eps: options.eps,
            weight_decay: options.weight_decay,
            decay_mode,
            maximize: options.maximize,
        },
        max_grad_norm: options.max_grad_norm,
        clip_eps: CLIP_EPS,
        state_scales: low_precision.then_some(STATE_SCALE_RULE),
        slots,
        world_size,
    }
}

/// Agreed amaxes of one FP8 weight's states: master, first moment, second moment.
pub type StateAmaxes = [f32; 3];
/// Scales of one FP8 weight's states (stored values are `x * scale`): master, first moment, second moment.
pub type StateScales = [f32; 3];

/// The hyperparameters the bounds need besides the per-step coefficients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundParams {
    /// `beta1`.
    pub beta1: f64,
    /// `beta2`.
    pub beta2: f64,
    /// `eps`.
    pub eps: f64,
    /// Adam's step `t` (1-based).
    pub step: u64,
}

/// Upper bounds of the new master, first and second moment of one weight after this step: the rule the
/// device-side step control applies with [`STATE_SCALE_RULE`] (`fp8_kernels::adam::control::state_bounds`).
pub fn state_bounds(
    c: &AdamCoefficients,
    p: &BoundParams,
    prev: StateAmaxes,
    grad_amax: f32,
) -> [f64; 3] {
    let t = p.step.min(i32::MAX as u64) as i32;
    let ratio = control::update_ratio_bound(p.beta1, p.beta2, t);
    let adam = AdamConfig {
        beta1: p.beta1,
        beta2: p.beta2,
        eps: p.eps,
        ..AdamConfig::default()
    };
    control::state_bounds(c, &adam, &STATE_SCALE_RULE, ratio, prev, grad_amax)
}

/// Write scales of master (F16), first moment (E4M3) and second moment (F16) for this step. A zero bound
/// keeps the previous scale (nothing to store but zeros).
pub fn write_scales(
    c: &AdamCoefficients,
    p: &BoundParams,
    prev_amax: StateAmaxes,
    grad_amax: f32,
    prev_scales: StateScales,
) -> StateScales {
    let bounds = state_bounds(c, p, prev_amax, grad_amax);
    control::state_write_scales(bounds, prev_scales, &STATE_SCALE_RULE)
}

/// The F16 master's initial scale for initial values whose amax is at most `amax_bound`.
pub fn initial_master_scale(amax_bound: f32) -> f32 {
    control::scale_from_bound(amax_bound as f64, F16_MAX, MASTER_MARGIN, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fp8_kernels::adam::adam_element;
    use fp8_kernels::{AdamConfig, WeightDecay};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Exact (f32) Adam on random gradient sequences never exceeds the predicted bounds.
        #[test]
        fn bounds_hold_for_exact_adam(
            seed in any::<u64>(), steps in 1usize..40, n in 1usize..40,
            b1 in 0.0f64..0.99, b2 in 0.5f64..0.9999, l2 in any::<bool>(), wd in 0.0f64..0.2,
            lr in 1e-5f64..1e-1, gscale in -3.0f64..3.0, clip in 0.1f32..1.0,
        ) {
            let cfg = AdamConfig {
                lr, beta1: b1, beta2: b2, eps: 1e-8, weight_decay: wd,
                decay_mode: if l2 { WeightDecay::L2 } else { WeightDecay::Decoupled },
                maximize: false,
            };
            let mut s = seed | 1;
            let mut rnd = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0 };
            let mut w: Vec<f32> = (0..n).map(|_| rnd() as f32).collect();
            let mut m = vec![0f32; n];
            let mut v = vec![0f32; n];
            let mut prev = [w.iter().fold(0f32, |a, x| a.max(x.abs())), 0.0, 0.0];
            for t in 1..=steps as u64 {
                let mag = 10f64.powf(gscale);
                let g: Vec<f32> = (0..n).map(|_| (rnd() * mag) as f32).collect();
                let gmax = g.iter().fold(0f32, |a, x| a.max(x.abs()));
                let c = cfg.coefficients(t, clip).unwrap();
                let p = BoundParams { beta1: b1, beta2: b2, eps: 1e-8, step: t };
                let b = state_bounds(&c, &p, prev, gmax);
                let mut now = [0f32; 3];
                for i in 0..n {
                    let (nw, nm, nv) = adam_element(&c, g[i], w[i], m[i], v[i]);
                    w[i] = nw; m[i] = nm; v[i] = nv;
                    now = [now[0].max(nw.abs()), now[1].max(nm.abs()), now[2].max(nv.abs())];
                }
                for k in 0..3 {
                    prop_assert!(now[k] as f64 <= b[k], "step {t} state {k}: {} > bound {}", now[k], b[k]);
                }
                let sc = write_scales(&c, &p, prev, gmax, [1.0; 3]);
                prop_assert!(now[1] * sc[1] <= 448.0, "first moment would saturate");
                prop_assert!(now[2] * sc[2] <= F16_MAX && now[0] * sc[0] <= F16_MAX);
                prev = now;
            }
        }
    }

    #[test]
    fn scales_are_powers_of_two_and_keep_previous_on_zero() {
        let c = AdamConfig::default().coefficients(1, 1.0).unwrap();
        let p = BoundParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            step: 1,
        };
        let s = write_scales(&c, &p, [0.0; 3], 0.0, [2.0, 4.0, 8.0]);
        // The master bound is 0 + step * 0 = 0: everything keeps its previous scale.
        assert_eq!(s, [2.0, 4.0, 8.0]);
        let s = write_scales(&c, &p, [0.5, 0.0, 0.0], 1.0, [1.0; 3]);
        for x in s {
            assert_eq!(x.to_bits() & 0x007F_FFFF, 0, "{x} is a power of two");
        }
        // m bound = 0.1 * 1.0 * 1.01: 448 / 0.101 = 4435.6 -> 4096.
        assert_eq!(s[1], 4096.0);
    }
}
