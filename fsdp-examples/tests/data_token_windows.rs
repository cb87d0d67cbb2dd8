//! Training and validation windows against the peer's definitions (transcribed from `peer_gpt.py` below),
//! the sampler's reproducibility and resumption, and the unigram statistics against hand-computed cases.

use std::collections::HashMap;

use fsdp_examples::data::tokens::{
    fill_windows, unigram_cross_entropy_nats, unigram_entropy_nats, TrainWindowSampler,
    ValidationWindows,
};
use proptest::prelude::*;

/// A stream whose every token says where it is (modulo 50000), so a window's contents show its start.
fn positional(n: usize) -> Vec<u16> {
    (0..n).map(|i| (i % 50_000) as u16).collect()
}

/// The peer's validation, transcribed:
/// `nw = (len(va) - 1) // T; for s0 in range(0, nw, B): idx = range(s0, min(nw, s0 + B));`
/// `w = stack([va[i*T : i*T+T+1] for i in idx]); x, y = w[:, :-1], w[:, 1:]`.
fn peer_validation_batches(va: &[u16], t: usize, b: usize) -> Vec<(Vec<i32>, Vec<i32>)> {
    let nw = (va.len() - 1) / t;
    let mut batches = Vec::new();
    let mut s0 = 0;
    while s0 < nw {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for i in s0..nw.min(s0 + b) {
            let w = &va[i * t..i * t + t + 1];
            x.extend(w[..t].iter().map(|&v| i32::from(v)));
            y.extend(w[1..].iter().map(|&v| i32::from(v)));
        }
        batches.push((x, y));
        s0 += b;
    }
    batches
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn validation_batches_are_the_peers(n in 2usize..400, t in 1usize..40, b in 1usize..7, salt in 0u16..1000) {
        prop_assume!(n > t);
        let tokens: Vec<u16> = (0..n).map(|i| (i as u16).wrapping_mul(31).wrapping_add(salt) % 50257).collect();
        let windows = ValidationWindows::new(n, t, b).unwrap();
        let peer = peer_validation_batches(&tokens, t, b);
        prop_assert_eq!(windows.window_count(), (n - 1) / t);
        prop_assert_eq!(windows.batch_count(), peer.len());
        let mut x = vec![-1i32; b * t];
        let mut y = vec![-1i32; b * t];
        for (k, (px, py)) in peer.iter().enumerate() {
            let count = windows.fill_batch(&tokens, k, &mut x, &mut y).unwrap();
            prop_assert_eq!(count * t, px.len());
            prop_assert_eq!(&x[..px.len()], &px[..]);
            prop_assert_eq!(&y[..py.len()], &py[..]);
        }
        // The mean over windows, as the peer sums batch_mean * len(idx) / nw.
        let means: Vec<f64> = (0..peer.len()).map(|k| 1.0 + k as f64 * 0.25).collect();
        let peer_mean = peer.iter().zip(&means).map(|((px, _), m)| m * (px.len() / t) as f64).sum::<f64>()
            / windows.window_count() as f64;
        prop_assert_eq!(windows.combine_batch_means(&means).unwrap(), peer_mean);
    }

    #[test]
    fn sampled_windows_are_in_range_and_hold_the_next_tokens(
        n in 3usize..2000, t in 1usize..64, b in 1usize..9, seed in any::<u64>(), rank in 0u64..8
    ) {
        prop_assume!(n >= t + 2);
        let tokens = positional(n);
        let mut sampler = TrainWindowSampler::new(n, t, b, seed, rank).unwrap();
        let (mut x, mut y) = (vec![0i32; b * t], vec![0i32; b * t]);
        for _ in 0..3 {
            let starts = sampler.fill_next(&tokens, &mut x, &mut y).unwrap();
            prop_assert_eq!(starts.len(), b);
            for (k, &s) in starts.iter().enumerate() {
                // torch.randint(0, n - T - 1): the upper end excluded.
                prop_assert!(s < n - t - 1);
                for j in 0..t {
                    prop_assert_eq!(x[k * t + j], i32::from(tokens[s + j]));
                    prop_assert_eq!(y[k * t + j], i32::from(tokens[s + j + 1]));
                }
            }
        }
    }

    #[test]
    fn entropy_matches_a_direct_computation(tokens in prop::collection::vec(0u16..40, 1..500)) {
        let mut counts: HashMap<u16, usize> = HashMap::new();
        for &t in &tokens {
            *counts.entry(t).or_default() += 1;
        }
        let n = tokens.len() as f64;
        let direct: f64 = counts.values().map(|&c| (c as f64 / n) * (n / c as f64).ln()).sum();
        let h = unigram_entropy_nats(&tokens).unwrap();
        prop_assert!((h - direct).abs() <= 1e-12 * direct.max(1.0), "{} vs {}", h, direct);
        prop_assert!(h >= 0.0 && h <= (counts.len() as f64).ln() + 1e-12);
        // A permutation of the stream has the same entropy.
        let mut reversed = tokens.clone();
        reversed.reverse();
        prop_assert!((unigram_entropy_nats(&reversed).unwrap() - h).abs() <= 1e-12);
    }
}

#[test]
fn validation_window_counts_at_the_edges() {
    // n = T + 1: one window; n = k*T + 1: k windows; n = k*T: k - 1 (the last target is missing).
    assert_eq!(ValidationWindows::new(9, 8, 4).unwrap().window_count(), 1);
    assert_eq!(ValidationWindows::new(33, 8, 4).unwrap().window_count(), 4);
    assert_eq!(ValidationWindows::new(32, 8, 4).unwrap().window_count(), 3);
    assert!(ValidationWindows::new(8, 8, 4).is_err());
    assert!(ValidationWindows::new(100, 0, 4).is_err());
    assert!(ValidationWindows::new(100, 8, 0).is_err());
    let v = ValidationWindows::new(100, 8, 5).unwrap();
    assert_eq!(v.batch_windows(0), 0..5);
    assert_eq!(v.batch_windows(2), 10..12);
    assert_eq!(v.batch_windows(3), 12..12);
    let (mut x, mut y) = (vec![0; 40], vec![0; 40]);
    assert!(v.fill_batch(&positional(100), 3, &mut x, &mut y).is_err());
    assert!(v.fill_batch(&positional(99), 0, &mut x, &mut y).is_err());
    assert!(v.combine_batch_means(&[1.0, 2.0]).is_err());
}

/// The generator as documented, written independently: draw i = mix64(key + (i+1) * GAMMA),
/// key = mix64(seed ^ mix64(rank ^ TAG)); start = the high 64 bits of draw * bound, redrawn while the low
/// 64 bits fall below 2^64 mod bound.
fn documented_starts(seed: u64, rank: u64, bound: u64, count: usize) -> Vec<usize> {
    fn mix64(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    let key = mix64(seed ^ mix64(rank ^ 0xD1B54A32D192ED03));
    let mut i: u64 = 0;
    let mut draw = || {
        i += 1;
        mix64(key.wrapping_add(i.wrapping_mul(0x9E3779B97F4A7C15)))
    };
    let reject_below = ((1u128 << 64) % u128::from(bound)) as u64;
    (0..count)
        .map(|_| loop {
            let m = u128::from(draw()) * u128::from(bound);
            if (m as u64) >= reject_below {
                break (m >> 64) as usize;
            }
        })
        .collect()
}

#[test]
fn the_sampler_is_the_documented_generator() {
    for (n, t, b, seed, rank) in [
        (1000usize, 16usize, 4usize, 1u64, 0u64),
        (1_409_400, 1024, 8, 1, 3),
        (20, 3, 5, u64::MAX, 7),
    ] {
        let mut s = TrainWindowSampler::new(n, t, b, seed, rank).unwrap();
        let got: Vec<usize> = (0..5).flat_map(|_| s.next_starts()).collect();
        assert_eq!(
            got,
            documented_starts(seed, rank, (n - t - 1) as u64, 5 * b)
        );
        assert_eq!(s.position(), 5 * b as u64);
    }
}

#[test]
fn the_sampler_reproduces_and_resumes_from_its_position() {
    let n = 50_000;
    let make = |seed, rank| TrainWindowSampler::new(n, 64, 8, seed, rank).unwrap();
    let run = |s: &mut TrainWindowSampler, steps: usize| -> Vec<Vec<usize>> {
        (0..steps).map(|_| s.next_starts()).collect()
    };
    let mut a = make(1, 0);
    let full = run(&mut a, 10);
    assert_eq!(
        run(&mut make(1, 0), 10),
        full,
        "same seed and rank, same windows"
    );
    assert_ne!(
        run(&mut make(1, 1), 10),
        full,
        "another rank draws other windows"
    );
    assert_ne!(
        run(&mut make(2, 0), 10),
        full,
        "another seed draws other windows"
    );
    assert_ne!(run(&mut make(0, 1), 10), run(&mut make(1, 0), 10));

    // Checkpoint after 6 steps: a fresh sampler set to the saved position continues identically.
    let mut b = make(1, 0);
    run(&mut b, 6);
    let saved = b.position();
    let mut resumed = make(1, 0);
    resumed.set_position(saved);
    assert_eq!(run(&mut resumed, 4), full[6..]);
    assert_eq!(resumed.position(), a.position());

    // A failed fill (wrong buffer size) does not advance the sampler.
    let tokens = positional(n);
    let mut c = make(1, 0);
    let (mut x, mut y) = (vec![0; 10], vec![0; 10]);
    assert!(c.fill_next(&tokens, &mut x, &mut y).is_err());
    assert!(c.fill_next(&tokens[..n - 1], &mut x, &mut y).is_err());
    assert_eq!(c.position(), 0);
    let (mut x, mut y) = (vec![0; 8 * 64], vec![0; 8 * 64]);
    assert_eq!(c.fill_next(&tokens, &mut x, &mut y).unwrap(), full[0]);
}

#[test]
fn sampled_starts_cover_the_range_evenly() {
    // 9 possible starts (n - T - 1), 18,000 draws: each start expected 2000 times. A chi-square statistic
    // with 8 degrees of freedom above 40 has probability below 1e-5 for a uniform generator.
    let mut s = TrainWindowSampler::new(12, 2, 10, 42, 0).unwrap();
    let mut counts = [0usize; 9];
    for _ in 0..1800 {
        for start in s.next_starts() {
            counts[start] += 1;
        }
    }
    let expected = 2000.0;
    let chi2: f64 = counts
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    assert!(chi2 < 40.0, "counts {counts:?}, chi2 {chi2}");
    // The smallest stream: one start.
    let mut one = TrainWindowSampler::new(6, 4, 3, 0, 0).unwrap();
    assert_eq!(one.start_count(), 1);
    assert_eq!(one.next_starts(), [0, 0, 0]);
    assert!(TrainWindowSampler::new(5, 4, 3, 0, 0).is_err());
    assert!(TrainWindowSampler::new(100, 0, 3, 0, 0).is_err());
    assert!(TrainWindowSampler::new(100, 4, 0, 0, 0).is_err());
}

#[test]
fn fill_windows_checks_buffers_and_bounds() {
    let tokens = positional(10);
    let (mut x, mut y) = (vec![0; 6], vec![0; 6]);
    fill_windows(&tokens, &[0, 6], 3, &mut x, &mut y).unwrap();
    assert_eq!(x, [0, 1, 2, 6, 7, 8]);
    assert_eq!(y, [1, 2, 3, 7, 8, 9]);
    // The window at 7 needs tokens 7..=10: one past the end.
    assert!(fill_windows(&tokens, &[0, 7], 3, &mut x, &mut y).is_err());
    assert!(fill_windows(&tokens, &[usize::MAX, 0], 3, &mut x, &mut y).is_err());
    assert!(fill_windows(&tokens, &[0], 3, &mut x, &mut y).is_err());
}

#[test]
fn entropy_of_hand_computed_streams() {
    // p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2.
    let h = unigram_entropy_nats(&[5, 5, 9, 50256]).unwrap();
    assert!((h - 1.5 * 2f64.ln()).abs() < 1e-15, "{h}");
    // Uniform over 4 ids: ln 4; one id: 0.
    assert!((unigram_entropy_nats(&[0, 1, 2, 3, 3, 2, 1, 0]).unwrap() - 4f64.ln()).abs() < 1e-15);
    assert_eq!(unigram_entropy_nats(&[7; 10]).unwrap(), 0.0);
    assert!(unigram_entropy_nats(&[]).is_err());
}

#[test]
fn smoothed_cross_entropy_of_a_hand_computed_case() {
    // Fit [0, 0, 1] over 4 ids with add-one smoothing: p = (3, 2, 1, 1) / 7.
    // Evaluate [0, 2]: -(ln 3/7 + ln 1/7) / 2.
    let ce = unigram_cross_entropy_nats(&[0, 0, 1], &[0, 2], 4).unwrap();
    let want = -((3f64 / 7.0).ln() + (1f64 / 7.0).ln()) / 2.0;
    assert!((ce - want).abs() < 1e-15, "{ce} vs {want}");
    // Never below the evaluation stream's own entropy (Gibbs' inequality).
    let fit: Vec<u16> = (0..300).map(|i| (i * i % 17) as u16).collect();
    let eval: Vec<u16> = (0..200).map(|i| (i * 7 % 13) as u16).collect();
    assert!(
        unigram_cross_entropy_nats(&fit, &eval, 17).unwrap()
            >= unigram_entropy_nats(&eval).unwrap()
    );
    assert!(unigram_cross_entropy_nats(&fit, &[17], 17).is_err());
    assert!(unigram_cross_entropy_nats(&fit, &[], 17).is_err());
}
