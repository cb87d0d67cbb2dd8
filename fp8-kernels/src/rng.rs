//! SplitMix64: the workspace's one seeded pseudo-random generator for test data, check binaries and
//! example inputs.
//!
//! SplitMix64 (Steele, Lea and Flood 2014, in Vigna's reference form) is a counter stepped by
//! [`SplitMix64::GAMMA`] and a finaliser ([`SplitMix64::mix`]). It is small, portable and easy to
//! reproduce, so data seeded here can be regenerated anywhere. It is the same finaliser the dropout
//! mask uses ([`crate::elementwise::dropout_bits`]), there counter-based so every GPU thread computes its
//! own bits.
//!
//! ```
//! use fp8_kernels::rng::SplitMix64;
//!
//! let a = SplitMix64::new(7).uniform_vec(4);
//! assert_eq!(a, SplitMix64::new(7).uniform_vec(4));
//! assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
//! ```

/// A SplitMix64 generator: 64 bits of state, one 64-bit output per step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The counter step, `2^64 / phi` rounded to odd.
    pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// A generator whose first output is `mix(seed + GAMMA)`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The SplitMix64 finaliser: a bijection on `u64` that scrambles a counter into random bits.
    pub fn mix(z: u64) -> u64 {
        let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(Self::GAMMA);
        Self::mix(self.state)
    }

    /// A uniform value in `[0, 1)` on the grid `k / 2^24` (the top 24 bits of one draw, exact in f32).
    pub fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A uniform value in `[-1, 1)`: `2 * unit_f32() - 1` (exact in f32).
    pub fn uniform_f32(&mut self) -> f32 {
        self.unit_f32() * 2.0 - 1.0
    }

    /// Fills `out` with [`SplitMix64::uniform_f32`] draws, in order.
    pub fn fill_uniform(&mut self, out: &mut [f32]) {
        for v in out {
            *v = self.uniform_f32();
        }
    }

    /// `n` [`SplitMix64::uniform_f32`] draws, in order.
    pub fn uniform_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform_f32()).collect()
    }

    /// A uniform integer in `0..bound` (unbiased: draws below `2^64 mod bound` are rejected and
    /// redrawn, then the draw is reduced modulo `bound`). Returns 0 when `bound` is 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let x = self.next_u64();
            if x >= threshold {
                return x % bound;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Vigna's reference `splitmix64.c`, written out step by step.
    fn reference(seed: u64, n: usize) -> Vec<u64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = x;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            })
            .collect()
    }

    #[test]
    fn first_output_of_seed_zero_matches_published_value() {
        // The first output of splitmix64 seeded with 0 in the reference implementation.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn matches_reference(seed in any::<u64>(), n in 0usize..64) {
            let mut g = SplitMix64::new(seed);
            let got: Vec<u64> = (0..n).map(|_| g.next_u64()).collect();
            prop_assert_eq!(got, reference(seed, n));
        }

        #[test]
        fn floats_are_in_range_and_follow_the_bits(seed in any::<u64>(), n in 0usize..64) {
            let bits = reference(seed, n);
            let v = SplitMix64::new(seed).uniform_vec(n);
            let mut filled = vec![0.0f32; n];
            SplitMix64::new(seed).fill_uniform(&mut filled);
            prop_assert_eq!(&v, &filled);
            for (x, b) in v.iter().zip(&bits) {
                prop_assert!((-1.0..1.0).contains(x));
                prop_assert_eq!(*x as f64, (b >> 40) as f64 / 2f64.powi(23) - 1.0);
            }
        }

        #[test]
        fn below_stays_below(seed in any::<u64>(), bound in 0u64..1000) {
            let mut g = SplitMix64::new(seed);
            for _ in 0..16 {
                let x = g.below(bound);
                prop_assert!(x < bound.max(1));
            }
        }
    }
}
