//! Slow, obviously-correct reference conversions, independent of the fast paths in [`crate::format`].
//!
//! The reference builds every representable value from the definition (sign, exponent, mantissa with
//! `powi`), sorts the finite non-negative ones, and rounds by comparing distances in f64, breaking ties
//! towards the code with an even mantissa. Tests compare the fast paths with it over all 2^32 f32 inputs.

use crate::Fp8Format;

/// Value of a code from the format's definition (NaN for NaN codes, infinities for E5M2's).
pub fn reference_decode(format: Fp8Format, code: u8) -> f64 {
    let e_bits = format.exponent_bits();
    let m_bits = format.mantissa_bits();
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> m_bits) & ((1 << e_bits) - 1)) as i32;
    let m = (code & ((1 << m_bits) - 1)) as i32;
    let e_max = (1 << e_bits) - 1;
    match format {
        Fp8Format::E4M3 if e == e_max && m == (1 << m_bits) - 1 => return f64::NAN,
        Fp8Format::E5M2 if e == e_max => {
            return if m == 0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            };
        }
        _ => {}
    }
    let frac = m as f64 / (1 << m_bits) as f64;
    if e == 0 {
        sign * frac * 2f64.powi(1 - format.bias())
    } else {
        sign * (1.0 + frac) * 2f64.powi(e - format.bias())
    }
}

/// A format's finite non-negative values with their codes, in increasing order.
pub struct ReferenceEncoder {
    format: Fp8Format,
    values: Vec<(f64, u8)>,
}

impl ReferenceEncoder {
    /// Builds the table of finite non-negative codes of `format`.
    pub fn new(format: Fp8Format) -> Self {
        let mut values: Vec<(f64, u8)> = (0u8..0x80)
            .map(|c| (reference_decode(format, c), c))
            .filter(|(v, _)| v.is_finite())
            .collect();
        values.sort_by(|a, b| a.0.total_cmp(&b.0));
        ReferenceEncoder { format, values }
    }

    /// Round-to-nearest-even with saturation; NaN to `0x7F`.
    pub fn encode(&self, x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = (x as f64).abs();
        // Index of the first value >= a.
        let idx = self.values.partition_point(|(v, _)| *v < a);
        let code = if idx == self.values.len() {
            self.values[idx - 1].1 // beyond the largest finite value: saturate
        } else if idx == 0 || self.values[idx].0 == a {
            self.values[idx].1
        } else {
            let (lo, lo_code) = self.values[idx - 1];
            let (hi, hi_code) = self.values[idx];
            let (dlo, dhi) = (a - lo, hi - a);
            if dlo < dhi {
                lo_code
            } else if dhi < dlo {
                hi_code
            } else if lo_code & 1 == 0 {
                lo_code
            } else {
                hi_code
            }
        };
        debug_assert!(code & 0x80 == 0, "{:?}", self.format);
        sign | code
    }
}
