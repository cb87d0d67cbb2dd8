//! Learning-rate schedules: the learning rate as a function of the base value and a position.
//!
//! The optimizer holds the schedule and its position ([`crate::ShardedAdam::advance_schedule`]); the
//! caller decides what a position is (an epoch for [`StepLr`] as in the MNIST example, an optimizer step
//! for the warm-up schedules). The position goes into checkpoints with the optimizer's scalar state.

use crate::OptimError;
use std::f64::consts::PI;
use std::fmt::Debug;

/// A learning-rate schedule.
pub trait LrSchedule: Debug + Send + Sync {
    /// The learning rate at `position` (0-based) for base learning rate `base_lr`.
    fn lr_at(&self, base_lr: f64, position: u64) -> f64;
    /// A description of the schedule's parameters; a checkpoint stores it so that resuming with another
    /// schedule is reported instead of silently changing the learning rate.
    fn describe(&self) -> String;
}

fn bad(m: String) -> OptimError {
    OptimError::InvalidHyperparameter(m)
}

/// A constant learning rate.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ConstantLr;

impl LrSchedule for ConstantLr {
    fn lr_at(&self, base_lr: f64, _position: u64) -> f64 {
        base_lr
    }
    fn describe(&self) -> String {
        "constant".into()
    }
}

/// `torch.optim.lr_scheduler.StepLR`: `base_lr * gamma^(position / step_size)` (integer division).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLr {
    step_size: u64,
    gamma: f64,
}

impl StepLr {
    /// Multiplies the learning rate by `gamma` every `step_size` positions (`step_size >= 1`,
    /// `gamma` finite and `>= 0`).
    pub fn new(step_size: u64, gamma: f64) -> Result<Self, OptimError> {
        if step_size == 0 {
            return Err(bad("StepLr: step_size must be >= 1".into()));
        }
        if !(gamma.is_finite() && gamma >= 0.0) {
            return Err(bad(format!(
                "StepLr: gamma must be finite and >= 0, got {gamma}"
            )));
        }
        Ok(StepLr { step_size, gamma })
    }
}

impl LrSchedule for StepLr {
    fn lr_at(&self, base_lr: f64, position: u64) -> f64 {
        let k = position / self.step_size;
        base_lr * self.gamma.powf(k as f64)
    }
    fn describe(&self) -> String {
        format!("step(step_size={}, gamma={})", self.step_size, self.gamma)
    }
}

/// The warm-up and decay positions of the warm-up schedules and the learning rate's final ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
struct WarmupSpan {
    warmup_steps: u64,
    total_steps: u64,
    ratio: f64,
}

impl WarmupSpan {
    /// Checks the span for schedule `name` (`warmup <= total`, `total >= 1`, `ratio` in `[0, 1]`).
    fn new(name: &str, warmup: u64, total: u64, ratio: f64) -> Result<Self, OptimError> {
        if total == 0 || warmup > total {
            return Err(bad(format!(
                "{name}: need 0 <= warmup_steps <= total_steps and total_steps >= 1, got {warmup} and {total}"
            )));
        }
        if !(0.0..=1.0).contains(&ratio) {
            return Err(bad(format!(
                "{name}: the final ratio must be in [0, 1], got {ratio}"
            )));
        }
        Ok(WarmupSpan {
            warmup_steps: warmup,
            total_steps: total,
            ratio,
        })
    }

    /// The linear warm-up `base_lr * position / warmup` (`position + 1` with `count_current`), or `None`
    /// after it.
    fn warmup(&self, base_lr: f64, position: u64, count_current: bool) -> Option<f64> {
        (position < self.warmup_steps).then(|| {
            let done = if count_current {
                position + 1
            } else {
                position
            };
            base_lr * done as f64 / self.warmup_steps as f64
        })
    }

    /// How far `position` (after the warm-up) is through the decay, in `[0, 1]`.
    fn progress(&self, position: u64) -> f64 {
        let span = (self.total_steps - self.warmup_steps).max(1) as f64;
        ((position - self.warmup_steps) as f64 / span).min(1.0)
    }

    /// The cosine decay from `base_lr` after the warm-up to `ratio * base_lr` at the end.
    fn cosine(&self, base_lr: f64, position: u64) -> f64 {
        let cos = 0.5 * (1.0 + (PI * self.progress(position)).cos());
        base_lr * (self.ratio + (1.0 - self.ratio) * cos)
    }
}

/// Linear warm-up from 0 to the base learning rate over `warmup_steps` positions, then a cosine decay to
/// `min_ratio * base_lr` at `total_steps` (held there afterwards), as `transformers`'
/// `get_cosine_schedule_with_warmup` with a floor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineWithWarmup(WarmupSpan);

impl CosineWithWarmup {
    /// A cosine schedule (`warmup_steps <= total_steps`, `total_steps >= 1`, `min_ratio` in `[0, 1]`).
    pub fn new(warmup_steps: u64, total_steps: u64, min_ratio: f64) -> Result<Self, OptimError> {
        WarmupSpan::new("CosineWithWarmup", warmup_steps, total_steps, min_ratio).map(Self)
    }
}

impl LrSchedule for CosineWithWarmup {
    fn lr_at(&self, base_lr: f64, position: u64) -> f64 {
        self.0
            .warmup(base_lr, position, false)
            .unwrap_or_else(|| self.0.cosine(base_lr, position))
    }
    fn describe(&self) -> String {
        let s = &self.0;
        format!(
            "cosine(warmup={}, total={}, min_ratio={})",
            s.warmup_steps, s.total_steps, s.ratio
        )
    }
}

/// nanoGPT's schedule (and `peer_gpt.py`'s): warm-up `lr * (it + 1) / w` for positions `it < w`, then a
/// cosine from `lr` down to `min_ratio * lr` at `total_steps`:
/// `lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * (it - w) / (total - w))))`, held at the floor
/// afterwards. It differs from [`CosineWithWarmup`] only in counting the current step in the warm-up (the
/// first step trains with `lr / w`, not 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine(WarmupSpan);

impl WarmupCosine {
    /// The schedule (`warmup_steps <= total_steps`, `total_steps >= 1`, `min_ratio` in `[0, 1]`).
    pub fn new(warmup_steps: u64, total_steps: u64, min_ratio: f64) -> Result<Self, OptimError> {
        WarmupSpan::new("WarmupCosine", warmup_steps, total_steps, min_ratio).map(Self)
    }
}

impl LrSchedule for WarmupCosine {
    fn lr_at(&self, base_lr: f64, position: u64) -> f64 {
        self.0
            .warmup(base_lr, position, true)
            .unwrap_or_else(|| self.0.cosine(base_lr, position))
    }
    fn describe(&self) -> String {
        let s = &self.0;
        format!(
            "warm-up (it+1)/{} then cosine to {} x lr at {}",
            s.warmup_steps, s.ratio, s.total_steps
        )
    }
}

/// Linear warm-up from 0 to the base learning rate over `warmup_steps` positions, then a linear decay to
/// `final_ratio * base_lr` at `total_steps` (held there afterwards), as `transformers`'
/// `get_linear_schedule_with_warmup` with a floor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearWarmupDecay(WarmupSpan);

impl LinearWarmupDecay {
    /// A linear schedule (`warmup_steps <= total_steps`, `total_steps >= 1`, `final_ratio` in `[0, 1]`).
    pub fn new(warmup_steps: u64, total_steps: u64, final_ratio: f64) -> Result<Self, OptimError> {
        WarmupSpan::new("LinearWarmupDecay", warmup_steps, total_steps, final_ratio).map(Self)
    }
}

impl LrSchedule for LinearWarmupDecay {
    fn lr_at(&self, base_lr: f64, position: u64) -> f64 {
        let s = &self.0;
        s.warmup(base_lr, position, false)
            .unwrap_or_else(|| base_lr * (1.0 - (1.0 - s.ratio) * s.progress(position)))
    }
    fn describe(&self) -> String {
        let s = &self.0;
        format!(
            "linear(warmup={}, total={}, final_ratio={})",
            s.warmup_steps, s.total_steps, s.ratio
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn step_lr_matches_the_mnist_example() {
        let s = StepLr::new(1, 0.7).unwrap();
        for epoch in 0..14u64 {
            let want = 1e-3 * 0.7f64.powi(epoch as i32);
            assert!((s.lr_at(1e-3, epoch) - want).abs() <= 1e-15);
        }
        let s = StepLr::new(3, 0.5).unwrap();
        assert_eq!(s.lr_at(1.0, 2), 1.0);
        assert_eq!(s.lr_at(1.0, 3), 0.5);
        assert_eq!(s.lr_at(1.0, 8), 0.25);
    }

    #[test]
    fn bad_schedules_are_errors() {
        assert!(StepLr::new(0, 0.5).is_err());
        assert!(StepLr::new(1, -0.5).is_err());
        assert!(StepLr::new(1, f64::NAN).is_err());
        assert!(CosineWithWarmup::new(10, 5, 0.0).is_err());
        assert!(CosineWithWarmup::new(0, 0, 0.0).is_err());
        assert!(LinearWarmupDecay::new(1, 5, 1.5).is_err());
    }

    fn reference_cosine(w: u64, t: u64, r: f64, p: u64) -> f64 {
        // transformers' formula, floored.
        if p < w {
            return p as f64 / w.max(1) as f64;
        }
        let progress = (p - w) as f64 / (t - w).max(1) as f64;
        let c = (0.5 * (1.0 + (PI * progress).cos())).max(0.0);
        if p >= t {
            r
        } else {
            r + (1.0 - r) * c
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn warmup_schedules_follow_their_formulas(
            w in 0u64..50, extra in 1u64..200, r in 0.0f64..1.0, p in 0u64..400, base in 1e-6f64..1.0
        ) {
            let t = w + extra;
            let cos = CosineWithWarmup::new(w, t, r).unwrap();
            let got = cos.lr_at(base, p);
            let want = base * reference_cosine(w, t, r, p);
            prop_assert!((got - want).abs() <= 1e-12 * base, "cosine {got} vs {want}");
            let lin = LinearWarmupDecay::new(w, t, r).unwrap();
            let got = lin.lr_at(base, p);
            let want = if p < w {
                base * p as f64 / w as f64
            } else if p >= t {
                base * r
            } else {
                base * (r + (1.0 - r) * (t - p) as f64 / (t - w) as f64)
            };
            prop_assert!((got - want).abs() <= 1e-12 * base, "linear {got} vs {want}");
            // Warm-up rises, decay falls, and the rate stays within [floor, base].
            prop_assert!(got <= base * (1.0 + 1e-12));
            if p >= w {
                prop_assert!(cos.lr_at(base, p) >= base * r * (1.0 - 1e-12));
                prop_assert!(cos.lr_at(base, p + 1) <= cos.lr_at(base, p) * (1.0 + 1e-12));
            }
        }
    }
}

#[cfg(test)]
mod warmup_cosine_tests {
    use super::*;

    /// The peer's `get_lr` written out in f64, step by step.
    fn peer(lr: f64, it: u64, w: u64, steps: u64) -> f64 {
        if it < w {
            return lr * (it + 1) as f64 / w as f64;
        }
        let min = lr / 10.0;
        min + 0.5 * (lr - min) * (1.0 + (PI * (it - w) as f64 / (steps - w) as f64).cos())
    }

    #[test]
    fn matches_the_peer_schedule_at_every_step() {
        let (lr, steps) = (6e-4, 600u64);
        let w = steps / 20;
        let s = WarmupCosine::new(w, steps, 0.1).unwrap();
        for it in 0..steps {
            let (a, b) = (s.lr_at(lr, it), peer(lr, it, w, steps));
            assert!((a - b).abs() <= 1e-15 * lr, "step {it}: {a} vs {b}");
        }
        assert!((s.lr_at(lr, 0) - lr / w as f64).abs() < 1e-18);
        assert!(WarmupCosine::new(10, 5, 0.1).is_err());
    }
}
