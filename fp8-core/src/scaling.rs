//! Per-tensor scaling: how a scale is computed from an amax, the delayed and current recipes, and
//! [`ScalingMeta`], the state one FP8 tensor carries from step to step.
//!
//! A tensor `x` is stored as `q = encode(x * scale)` and read back as `decode(q) * scale_inv`.
//! The scale maps the tensor's absolute maximum (amax) near the top of the format's range:
//! `scale = 2^(floor(log2(fmax / amax)) - margin)` by default. A power of two makes scaling exact (only
//! the FP8 rounding loses information) and keeps `scale * scale_inv == 1` exactly.

use crate::{Fp8Error, QType};

/// The largest margin accepted; larger ones push any useful scale out of the f32 range.
pub const MAX_MARGIN: i32 = 64;
/// Scales are kept within `2^-SCALE_EXP_LIMIT ..= 2^SCALE_EXP_LIMIT` so that both the scale and its
/// inverse are normal f32 values.
pub const SCALE_EXP_LIMIT: i32 = 125;

/// How a scale is derived from `fmax / amax`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScaleRounding {
    /// The largest power of two not above `fmax / amax` (then divided by `2^margin`). Exact scaling.
    #[default]
    PowerOfTwo,
    /// `fmax / amax / 2^margin` itself, rounded down if needed so that `amax * scale <= fmax` holds in f32.
    Exact,
}

/// Which amax of the history window a delayed recipe uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AmaxCompute {
    /// The largest amax in the window (robust to a quiet step; the Transformer Engine default).
    #[default]
    Max,
    /// The amax of the newest entry only.
    MostRecent,
}

/// A scaling recipe: where the amax that sets the scale comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScalingRecipe {
    /// Delayed scaling: the scale used at step `t` comes from amaxes recorded at steps before `t`.
    /// The cast that uses the scale records the tensor's amax in the same pass, so no extra pass over
    /// the data is needed.
    Delayed {
        /// Length of the amax history window (at least 1).
        history_len: usize,
        /// Which amax of the window sets the scale.
        amax_compute: AmaxCompute,
        /// The scale is divided by `2^margin` (head-room against growth between steps).
        margin: i32,
        /// Power-of-two or exact scale.
        rounding: ScaleRounding,
    },
    /// Current scaling: the scale comes from the amax of the tensor about to be cast (one extra pass).
    Current {
        /// The scale is divided by `2^margin`.
        margin: i32,
        /// Power-of-two or exact scale.
        rounding: ScaleRounding,
    },
}

impl ScalingRecipe {
    /// Delayed scaling with a window of 16, max over the window, margin 0, power-of-two scales.
    pub const fn delayed_default() -> Self {
        ScalingRecipe::Delayed {
            history_len: 16,
            amax_compute: AmaxCompute::Max,
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        }
    }

    /// Current scaling with margin 0 and power-of-two scales.
    pub const fn current_default() -> Self {
        ScalingRecipe::Current {
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        }
    }

    /// The margin of the recipe.
    pub const fn margin(&self) -> i32 {
        match *self {
            ScalingRecipe::Delayed { margin, .. } | ScalingRecipe::Current { margin, .. } => margin,
        }
    }

    /// The scale rounding of the recipe.
    pub const fn rounding(&self) -> ScaleRounding {
        match *self {
            ScalingRecipe::Delayed { rounding, .. } | ScalingRecipe::Current { rounding, .. } => {
                rounding
            }
        }
    }

    /// Length of the amax window the recipe keeps (1 for current scaling).
    pub const fn history_len(&self) -> usize {
        match *self {
            ScalingRecipe::Delayed { history_len, .. } => history_len,
            ScalingRecipe::Current { .. } => 1,
        }
    }

    /// Checks the margin (0 to [`MAX_MARGIN`]) and the history window (at least 1).
    pub fn validate(&self) -> Result<(), Fp8Error> {
        let margin = self.margin();
        if !(0..=MAX_MARGIN).contains(&margin) {
            return Err(Fp8Error::InvalidMargin(margin));
        }
        if self.history_len() == 0 {
            return Err(Fp8Error::EmptyHistory);
        }
        Ok(())
    }
}

impl Default for ScalingRecipe {
    fn default() -> Self {
        Self::delayed_default()
    }
}

/// The scale for a tensor with absolute maximum `amax` stored in a type whose largest value is `fmax`.
///
/// Returns `previous` when `amax` is zero or not finite (nothing to learn from such a step). The result is
/// a positive normal f32 with a normal inverse, and `amax * scale <= fmax` holds in f32 arithmetic.
pub fn compute_scale(
    amax: f32,
    fmax: f32,
    margin: i32,
    rounding: ScaleRounding,
    previous: f32,
) -> f32 {
    if !(amax.is_finite() && amax > 0.0) {
        return previous;
    }
    let ratio = fmax as f64 / amax as f64;
    // The f64 exponent field gives floor(log2(ratio)) exactly; the ratio is never subnormal in f64.
    let floor_log2 = ((ratio.to_bits() >> 52) & 0x7FF) as i32 - 1023;
    match rounding {
        ScaleRounding::PowerOfTwo => {
            let e = (floor_log2 - margin).clamp(-SCALE_EXP_LIMIT, SCALE_EXP_LIMIT);
            pow2(e)
        }
        ScaleRounding::Exact => {
            let e = floor_log2 - margin;
            if !(-SCALE_EXP_LIMIT..=SCALE_EXP_LIMIT).contains(&e) {
                return pow2(e.clamp(-SCALE_EXP_LIMIT, SCALE_EXP_LIMIT));
            }
            let mut s = (ratio / 2f64.powi(margin)) as f32;
            // f64 -> f32 rounding may land one ulp high; step down until the guarantee holds.
            while amax * s > fmax {
                s = f32::from_bits(s.to_bits() - 1);
            }
            s
        }
    }
}

/// `2^e` for `e` within the normal f32 exponent range.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The scaling state of one tensor: its storage type, current scale and inverse, and amax history.
///
/// Every rank must hold identical metas for the same gathered weight; the updates here are
/// deterministic functions of the recorded amaxes, so agreeing on the amaxes is enough.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalingMeta {
    qtype: QType,
    recipe: ScalingRecipe,
    scale: f32,
    scale_inv: f32,
    /// Ring buffer of recorded amaxes; `history[next]` is the oldest entry.
    history: Vec<f32>,
    next: usize,
    /// Number of amaxes recorded so far (saturates at the window length for ring purposes).
    recorded: u64,
}

impl ScalingMeta {
    /// A meta with scale 1 and an empty (all-zero) history.
    pub fn new(qtype: QType, recipe: ScalingRecipe) -> Result<Self, Fp8Error> {
        recipe.validate()?;
        Ok(ScalingMeta {
            qtype,
            recipe,
            scale: 1.0,
            scale_inv: 1.0,
            history: vec![0.0; recipe.history_len()],
            next: 0,
            recorded: 0,
        })
    }

    /// Rebuilds a meta from saved parts (checkpoints). `history` is given oldest first.
    pub fn from_parts(
        qtype: QType,
        recipe: ScalingRecipe,
        scale: f32,
        history: &[f32],
        recorded: u64,
    ) -> Result<Self, Fp8Error> {
        recipe.validate()?;
        check_scale(scale)?;
        if history.len() != recipe.history_len() {
            return Err(Fp8Error::LengthMismatch {
                expected: recipe.history_len(),
                actual: history.len(),
            });
        }
        Ok(ScalingMeta {
            qtype,
            recipe,
            scale,
            scale_inv: 1.0 / scale,
            history: history.to_vec(),
            next: 0,
            recorded,
        })
    }

    /// Storage type.
    pub fn qtype(&self) -> QType {
        self.qtype
    }

    /// Recipe.
    pub fn recipe(&self) -> &ScalingRecipe {
        &self.recipe
    }

    /// Multiply by this before encoding.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Multiply by this after decoding (`1 / scale`).
    pub fn scale_inv(&self) -> f32 {
        self.scale_inv
    }

    /// Number of amaxes recorded since creation.
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    /// The amax history, oldest first.
    pub fn history(&self) -> Vec<f32> {
        let (newer, older) = self.history.split_at(self.next);
        older.iter().chain(newer).copied().collect()
    }

    /// The most recently recorded amax (0 before any).
    pub fn latest_amax(&self) -> f32 {
        let len = self.history.len();
        self.history[(self.next + len - 1) % len]
    }

    /// Sets the scale directly (for a scale agreed elsewhere, e.g. broadcast from rank 0).
    pub fn set_scale(&mut self, scale: f32) -> Result<(), Fp8Error> {
        check_scale(scale)?;
        self.scale = scale;
        self.scale_inv = 1.0 / scale;
        Ok(())
    }

    /// Appends an amax to the history window, dropping the oldest. Does not change the scale.
    ///
    /// A non-finite amax is recorded as is, so the caller can see it; [`ScalingMeta::window_amax`]
    /// ignores such entries.
    pub fn record_amax(&mut self, amax: f32) {
        let len = self.history.len();
        self.history[self.next] = amax.abs();
        self.next = (self.next + 1) % len;
        self.recorded += 1;
    }

    /// The amax the recipe uses: the window's maximum or its newest entry. Non-finite entries are skipped.
    pub fn window_amax(&self) -> f32 {
        match self.recipe {
            ScalingRecipe::Delayed {
                amax_compute: AmaxCompute::Max,
                ..
            } => self
                .history
                .iter()
                .copied()
                .filter(|a| a.is_finite())
                .fold(0.0, f32::max),
            _ => {
                let a = self.latest_amax();
                if a.is_finite() {
                    a
                } else {
                    0.0
                }
            }
        }
    }

    /// Recomputes the scale from the window per the recipe; keeps the previous scale when the amax is 0
    /// or not finite. Returns the new scale.
    pub fn update_scale(&mut self) -> f32 {
        let amax = self.window_amax();
        self.apply_amax(amax)
    }

    /// Records `amax` and recomputes the scale from the window: the step-end update of delayed scaling,
    /// and the whole update of current scaling (whose window is the one amax).
    pub fn update_from_amax(&mut self, amax: f32) -> f32 {
        self.record_amax(amax);
        self.update_scale()
    }

    /// The scale this meta would take for `amax` (without changing anything).
    pub fn scale_for(&self, amax: f32) -> f32 {
        compute_scale(
            amax,
            self.qtype.max_finite(),
            self.recipe.margin(),
            self.recipe.rounding(),
            self.scale,
        )
    }

    fn apply_amax(&mut self, amax: f32) -> f32 {
        let s = self.scale_for(amax);
        self.scale = s;
        self.scale_inv = 1.0 / s;
        s
    }
}

fn check_scale(scale: f32) -> Result<(), Fp8Error> {
    if scale.is_normal() && scale > 0.0 && (1.0 / scale).is_normal() {
        Ok(())
    } else {
        Err(Fp8Error::InvalidScale(scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_of_two_scale() {
        // (amax, margin, previous scale, expected): 448 / 3 = 149.3 -> 128 (-> 32 with margin 2); amax
        // exactly fmax -> 1, slightly above -> 0.5.
        for (amax, margin, previous, want) in [
            (3.0, 0, 1.0, 128.0),
            (3.0, 2, 1.0, 32.0),
            (448.0, 0, 7.0, 1.0),
            (448.5, 0, 7.0, 0.5),
        ] {
            assert_eq!(
                compute_scale(amax, 448.0, margin, ScaleRounding::PowerOfTwo, previous),
                want,
                "amax {amax}, margin {margin}"
            );
        }
        // zero / NaN / inf keep the previous scale
        for a in [0.0, f32::NAN, f32::INFINITY] {
            assert_eq!(
                compute_scale(a, 448.0, 0, ScaleRounding::PowerOfTwo, 4.0),
                4.0
            );
        }
        // tiny amax clamps to a normal scale with a normal inverse
        let s = compute_scale(1e-44, 448.0, 0, ScaleRounding::PowerOfTwo, 1.0);
        assert!(s.is_normal() && (1.0 / s).is_normal());
    }

    #[test]
    fn exact_scale_never_overflows() {
        for amax in [3.0f32, 0.1, 7.77, 1e-3, 1234.5] {
            let s = compute_scale(amax, 448.0, 0, ScaleRounding::Exact, 1.0);
            assert!(amax * s <= 448.0);
            assert!(amax * s > 447.0, "{amax} {s}");
        }
    }

    #[test]
    fn delayed_window_max_and_most_recent() {
        let recipe = ScalingRecipe::Delayed {
            history_len: 3,
            amax_compute: AmaxCompute::Max,
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        };
        let mut m = ScalingMeta::new(QType::E4M3, recipe).unwrap();
        assert_eq!(m.update_from_amax(10.0), 32.0);
        assert_eq!(m.update_from_amax(1.0), 32.0); // window max still 10
        assert_eq!(m.update_from_amax(1.0), 32.0);
        assert_eq!(m.update_from_amax(1.0), 256.0); // 10 dropped out of the window
        assert_eq!(m.history(), vec![1.0, 1.0, 1.0]);
        assert_eq!(m.recorded(), 4);
        assert_eq!(m.scale_inv(), 1.0 / 256.0);

        let recent = ScalingRecipe::Delayed {
            history_len: 3,
            amax_compute: AmaxCompute::MostRecent,
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        };
        let mut m = ScalingMeta::new(QType::E4M3, recent).unwrap();
        m.update_from_amax(10.0);
        assert_eq!(m.update_from_amax(1.0), 256.0);
        // NaN amax keeps the scale
        assert_eq!(m.update_from_amax(f32::NAN), 256.0);
    }

    #[test]
    fn history_order_is_oldest_first_and_round_trips() {
        let mut m = ScalingMeta::new(QType::E5M2, ScalingRecipe::delayed_default()).unwrap();
        for i in 0..20 {
            m.update_from_amax(i as f32);
        }
        let h = m.history();
        assert_eq!(h.len(), 16);
        assert_eq!(h[0], 4.0);
        assert_eq!(h[15], 19.0);
        let r =
            ScalingMeta::from_parts(QType::E5M2, *m.recipe(), m.scale(), &h, m.recorded()).unwrap();
        assert_eq!(r.history(), h);
        assert_eq!(r.window_amax(), m.window_amax());
        assert_eq!(r.latest_amax(), 19.0);
    }

    #[test]
    fn bad_configuration_is_an_error() {
        let r = ScalingRecipe::Delayed {
            history_len: 0,
            amax_compute: AmaxCompute::Max,
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        };
        assert_eq!(
            ScalingMeta::new(QType::E4M3, r),
            Err(Fp8Error::EmptyHistory)
        );
        let r = ScalingRecipe::Current {
            margin: -1,
            rounding: ScaleRounding::PowerOfTwo,
        };
        assert!(ScalingMeta::new(QType::E4M3, r).is_err());
        let mut m = ScalingMeta::new(QType::E4M3, ScalingRecipe::current_default()).unwrap();
        for s in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-40] {
            assert!(m.set_scale(s).is_err(), "{s}");
        }
    }
}
