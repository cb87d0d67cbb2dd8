//! Initial values as PyTorch makes them (`kaiming_uniform_`, the uniform bias, `normal_`), seeded and
//! reproducible: element `i` of a tensor is a function of the seed and `i` alone (a SplitMix64 stream),
//! so large tensors are made in parallel with the same values as sequentially.

use fp8_kernels::rng::SplitMix64;
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 1 << 16;

/// The `i`-th output of the SplitMix64 stream seeded with `seed` (the stream's state advances by the
/// golden gamma per draw, so draw `i` needs no earlier draw).
fn draw(seed: u64, i: u64) -> u64 {
    SplitMix64::mix(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(SplitMix64::GAMMA)))
}

/// A value in `[0, 1)` with 24 random bits from draw `i`.
fn unit(seed: u64, i: u64) -> f64 {
    (draw(seed, i) >> 40) as f64 / (1u64 << 24) as f64
}

fn fill(n: usize, f: impl Fn(u64) -> f32 + Sync) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        for (k, o) in out.iter_mut().enumerate() {
            *o = f((c * CHUNK + k) as u64);
        }
    });
    v
}

/// Uniform values in `[-bound, bound)`.
pub fn uniform(n: usize, bound: f64, seed: u64) -> Vec<f32> {
    fill(n, |i| ((2.0 * unit(seed, i) - 1.0) * bound) as f32)
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

/// `n` values from `N(0, std^2)` (Box-Muller over two draws per value).
pub fn normal(n: usize, std: f64, seed: u64) -> Vec<f32> {
    fill(n, |i| {
        // (0, 1] so the logarithm is finite.
        let u1 = 1.0 - unit(seed, 2 * i);
        let u2 = unit(seed, 2 * i + 1);
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * std) as f32
    })
}

/// A seed for stream `stream` of a model seeded with `seed` (the SplitMix64 finaliser of their mix), so
/// every layer draws its own values.
pub fn stream_seed(seed: u64, stream: u64) -> u64 {
    SplitMix64::mix(seed ^ stream.wrapping_mul(SplitMix64::GAMMA))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_equal_the_sequential_stream() {
        // Element i is the i-th draw of the sequential generator: parallel filling changes nothing.
        let mut rng = SplitMix64::new(42);
        for i in 0..1000 {
            assert_eq!(draw(42, i), rng.next_u64(), "draw {i}");
        }
    }

    #[test]
    fn bounds_and_spread() {
        let fan_in = 288;
        let w = kaiming_uniform(200_000, fan_in, 5f64.sqrt(), 7);
        let b = 1.0 / (fan_in as f64).sqrt();
        assert!(w.iter().all(|&v| (v as f64).abs() <= b));
        let var = w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64;
        assert!((var / (b * b / 3.0) - 1.0).abs() < 0.02, "variance {var}");
        assert_eq!(w, kaiming_uniform(200_000, fan_in, 5f64.sqrt(), 7));
        assert_ne!(w, kaiming_uniform(200_000, fan_in, 5f64.sqrt(), 8));
        let bias = uniform_fan_in(1000, 9, 1);
        assert!(bias.iter().all(|&v| v.abs() <= 1.0 / 3.0));
        assert!(bias.iter().any(|&v| v.abs() > 0.3));
    }

    #[test]
    fn normal_has_the_asked_moments() {
        let v = normal(400_000, 0.02, 3);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 1e-4, "mean {mean}");
        assert!((var.sqrt() / 0.02 - 1.0).abs() < 0.01, "std {}", var.sqrt());
        // About 4.55 % of a normal sample lies beyond two standard deviations.
        let tail = v.iter().filter(|&&x| (x as f64).abs() > 0.04).count() as f64 / n;
        assert!((tail - 0.0455).abs() < 0.003, "tail {tail}");
        assert!(v.iter().all(|x| x.is_finite()));
    }
}
