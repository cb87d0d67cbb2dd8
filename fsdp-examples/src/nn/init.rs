//! PyTorch's default initialisation of convolution and linear layers, seeded.

use crate::sampler::SplitMix64;

/// Uniform values in `[-bound, bound)` from a SplitMix64 stream: 24 random bits per value.
fn uniform(n: usize, bound: f64, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let u = (rng.next_u64() >> 40) as f64 / (1u64 << 24) as f64; // [0, 1)
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect()
}

/// `n` weights from PyTorch's `kaiming_uniform_(w, a)` with leaky-ReLU gain: uniform in
/// `[-b, b)` with `b = sqrt(2 / (1 + a^2)) * sqrt(3 / fan_in)`. PyTorch initialises `Conv2d` and `Linear`
/// weights with `a = sqrt(5)`, which gives `b = 1 / sqrt(fan_in)`.
pub fn kaiming_uniform(n: usize, fan_in: usize, a: f64, seed: u64) -> Vec<f32> {
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    let bound = gain * (3.0 / fan_in.max(1) as f64).sqrt();
    uniform(n, bound, seed)
}

/// `n` values uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in))`: PyTorch's bias initialisation.
pub fn uniform_fan_in(n: usize, fan_in: usize, seed: u64) -> Vec<f32> {
    uniform(n, 1.0 / (fan_in.max(1) as f64).sqrt(), seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_spread() {
        let fan_in = 288;
        let w = kaiming_uniform(20000, fan_in, 5f64.sqrt(), 7);
        let b = 1.0 / (fan_in as f64).sqrt();
        assert!(w.iter().all(|&v| (v as f64).abs() <= b));
        // Uniform on [-b, b): variance b^2 / 3.
        let var = w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64;
        assert!((var / (b * b / 3.0) - 1.0).abs() < 0.05, "variance {var}");
        // Seeded: same seed same values, other seed other values.
        assert_eq!(w, kaiming_uniform(20000, fan_in, 5f64.sqrt(), 7));
        assert_ne!(w, kaiming_uniform(20000, fan_in, 5f64.sqrt(), 8));
        let bias = uniform_fan_in(1000, 9, 1);
        assert!(bias.iter().all(|&v| v.abs() <= 1.0 / 3.0));
        assert!(bias.iter().any(|&v| v.abs() > 0.3));
    }
}
