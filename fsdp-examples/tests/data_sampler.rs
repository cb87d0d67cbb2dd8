//! Distributed sampler: the generator, the shuffle, and the sharding rules.

use std::collections::{BTreeSet, HashMap};

use fsdp_examples::sampler::{
    epoch_permutation, DistributedSampler, Remainder, SamplerError, SplitMix64,
};
use proptest::prelude::*;

fn all_ranks(len: usize, world: usize, seed: u64, rem: Remainder) -> Vec<DistributedSampler> {
    (0..world)
        .map(|r| DistributedSampler::new(len, world, r, seed, rem).unwrap())
        .collect()
}

fn remainder() -> impl Strategy<Value = Remainder> {
    prop_oneof![Just(Remainder::DropLast), Just(Remainder::Pad)]
}

#[test]
fn splitmix64_matches_the_reference_implementation() {
    // Outputs of Vigna's splitmix64.c for seed 1234567.
    let mut rng = SplitMix64::new(1_234_567);
    let got: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
    assert_eq!(
        got,
        [
            6457827717110365317,
            3203168211198807973,
            9817491932198370423,
            4593380528125082431,
            16408922859458223821
        ]
    );
}

#[test]
fn permutation_matches_the_documented_python_version() {
    // Produced by the Python snippet in docs/mnist-data.md: the order is reproducible outside Rust.
    assert_eq!(epoch_permutation(10, 1, 0), [4, 2, 1, 3, 7, 9, 5, 0, 6, 8]);
    assert_eq!(epoch_permutation(10, 1, 1), [3, 8, 0, 1, 7, 2, 4, 9, 5, 6]);
    assert_eq!(
        epoch_permutation(12, 42, 3),
        [9, 3, 5, 6, 11, 8, 1, 7, 0, 10, 4, 2]
    );
}

#[test]
fn shuffle_is_uniform_over_permutations_of_three() {
    // A Fisher-Yates off-by-one (e.g. Sattolo's variant) would never produce some orders.
    let draws = 60_000u64;
    let mut counts: HashMap<Vec<usize>, u64> = HashMap::new();
    for epoch in 0..draws {
        *counts.entry(epoch_permutation(3, 7, epoch)).or_default() += 1;
    }
    assert_eq!(counts.len(), 6);
    let expected = draws as f64 / 6.0;
    let sigma = (draws as f64 * (1.0 / 6.0) * (5.0 / 6.0)).sqrt();
    for (perm, &c) in &counts {
        assert!(
            (c as f64 - expected).abs() < 5.0 * sigma,
            "{perm:?} drawn {c} times, expected about {expected}"
        );
    }
}

#[test]
fn below_is_uniform_for_a_non_power_of_two() {
    let mut rng = SplitMix64::new(99);
    let mut counts = [0u64; 7];
    let n = 70_000;
    for _ in 0..n {
        counts[rng.below(7) as usize] += 1;
    }
    let expected = n as f64 / 7.0;
    let sigma = (n as f64 * (1.0 / 7.0) * (6.0 / 7.0)).sqrt();
    assert!(
        counts
            .iter()
            .all(|&c| (c as f64 - expected).abs() < 5.0 * sigma),
        "{counts:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn permutation_is_a_permutation(len in 0usize..300, seed in any::<u64>(), epoch in 0u64..1000) {
        let mut p = epoch_permutation(len, seed, epoch);
        p.sort_unstable();
        prop_assert_eq!(p, (0..len).collect::<Vec<_>>());
    }

    #[test]
    fn deterministic_per_seed_and_epoch_and_epochs_differ(
        len in 20usize..500, seed in any::<u64>(), epoch in 0u64..1000,
        world in 1usize..9, rem in remainder(),
    ) {
        let a = DistributedSampler::new(len, world, world - 1, seed, rem).unwrap();
        let b = DistributedSampler::new(len, world, world - 1, seed, rem).unwrap();
        prop_assert_eq!(a.indices(epoch), b.indices(epoch));
        // 20! orders: two epochs (or two seeds) agreeing would mean the seed is ignored.
        prop_assert_ne!(a.epoch_order(epoch), a.epoch_order(epoch + 1));
        let c = DistributedSampler::new(len, world, 0, seed.wrapping_add(1), rem).unwrap();
        prop_assert_ne!(a.epoch_order(epoch), c.epoch_order(epoch));
    }

    #[test]
    fn shards_are_disjoint_with_drop_last(
        len in 1usize..400, world in 1usize..9, seed in any::<u64>(), epoch in 0u64..100,
    ) {
        prop_assume!(len >= world);
        let ranks = all_ranks(len, world, seed, Remainder::DropLast);
        let mut seen = BTreeSet::new();
        for s in &ranks {
            let idx = s.indices(epoch);
            prop_assert_eq!(idx.len(), len / world);
            prop_assert_eq!(s.num_real_samples(), idx.len());
            for i in idx {
                prop_assert!(i < len);
                prop_assert!(seen.insert(i), "index {} on two ranks", i);
            }
        }
        // Exactly the dropped remainder is missing, and it is the tail of the epoch order.
        prop_assert_eq!(seen.len(), len - len % world);
        let order = ranks[0].epoch_order(epoch);
        let dropped: BTreeSet<usize> = order[len - len % world..].iter().copied().collect();
        prop_assert!(dropped.is_disjoint(&seen));
    }

    #[test]
    fn pad_covers_everything_and_real_samples_exactly_once(
        len in 1usize..400, world in 1usize..9, seed in any::<u64>(), epoch in 0u64..100,
    ) {
        let ranks = all_ranks(len, world, seed, Remainder::Pad);
        let per_rank = len.div_ceil(world);
        let mut real = Vec::new();
        let mut everything = BTreeSet::new();
        for s in &ranks {
            let idx = s.indices(epoch);
            prop_assert_eq!(idx.len(), per_rank);
            prop_assert!(idx.len() - s.num_real_samples() <= 1);
            real.extend_from_slice(&idx[..s.num_real_samples()]);
            everything.extend(idx);
        }
        real.sort_unstable();
        prop_assert_eq!(real, (0..len).collect::<Vec<_>>());
        prop_assert_eq!(everything.len(), len);
    }

    #[test]
    fn global_order_is_the_same_for_any_world_size(
        len in 1usize..300, seed in any::<u64>(), epoch in 0u64..100,
        w1 in 1usize..9, w2 in 1usize..9, rem in remainder(),
    ) {
        prop_assume!(rem == Remainder::Pad || len >= w1.max(w2));
        let reference = epoch_permutation(len, seed, epoch);
        for world in [w1, w2] {
            let ranks = all_ranks(len, world, seed, rem);
            let per_rank: Vec<Vec<usize>> = ranks.iter().map(|s| s.indices(epoch)).collect();
            // Interleave the ranks back: rank r's i-th sample is global position i * world + r.
            let total = ranks[0].total_size();
            let rebuilt: Vec<usize> = (0..total).map(|p| per_rank[p % world][p / world]).collect();
            prop_assert_eq!(&rebuilt, &ranks[0].global_order(epoch));
            // ... and that order is the epoch permutation, cut or wrapped, whatever the world size.
            for (p, &i) in rebuilt.iter().enumerate() {
                prop_assert_eq!(i, reference[p % len]);
            }
        }
    }

    #[test]
    fn global_batches_are_the_same_sets_for_any_world_size(
        len in 8usize..400, seed in any::<u64>(), epoch in 0u64..50,
        global_batch_pow in 0u32..5, world_pow in 0u32..4, rem in remainder(),
    ) {
        // Global batch G = B * N with N | G: step k of all ranks together covers exactly positions
        // [k*G, (k+1)*G) of the epoch order (cut at the end), for every world size N.
        let g = 8usize << global_batch_pow;
        let world = 1usize << world_pow;
        let b = g / world;
        let ranks = all_ranks(len, world, seed, rem);
        let order = ranks[0].global_order(epoch);
        let total = ranks[0].total_size();
        let batches: Vec<Vec<Vec<usize>>> =
            ranks.iter().map(|s| s.batches(epoch, b).unwrap()).collect();
        let n = ranks[0].num_batches(b).unwrap();
        prop_assert!(batches.iter().all(|r| r.len() == n));
        for k in 0..n {
            let mut step: Vec<usize> = batches.iter().flat_map(|r| r[k].iter().copied()).collect();
            let mut want = order[k * g..((k + 1) * g).min(total)].to_vec();
            step.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(step, want, "step {}", k);
        }
        // The epoch order itself is independent of the world size (see the test above), so these
        // steps are the same sets for every world size up to where the remainder rule cuts.
        let single = DistributedSampler::new(len, 1, 0, seed, rem).unwrap().global_order(epoch);
        let common = total.min(single.len());
        prop_assert_eq!(&order[..common], &single[..common]);
    }

    #[test]
    fn batches_partition_the_rank_indices(
        len in 1usize..300, world in 1usize..5, batch in 1usize..40, seed in any::<u64>(),
    ) {
        let s = DistributedSampler::new(len, world, world - 1, seed, Remainder::Pad).unwrap();
        let batches = s.batches(3, batch).unwrap();
        prop_assert_eq!(batches.len(), s.num_batches(batch).unwrap());
        prop_assert!(batches.iter().rev().skip(1).all(|b| b.len() == batch));
        prop_assert_eq!(batches.concat(), s.indices(3));
    }
}

#[test]
fn unshuffled_order_is_the_identity() {
    let s = DistributedSampler::new(10, 3, 1, 5, Remainder::Pad)
        .unwrap()
        .with_shuffle(false);
    assert_eq!(s.indices(0), [1, 4, 7, 0]);
    assert_eq!(s.indices(9), s.indices(0));
    assert_eq!(s.num_real_samples(), 3);
    let s = s.for_rank(2).unwrap();
    assert_eq!(s.indices(0), [2, 5, 8, 1]);
}

#[test]
fn bad_arguments_are_errors() {
    use Remainder::*;
    // (len, world size, rank, remainder): the error.
    let cases = [
        ((10, 0, 0, Pad), SamplerError::ZeroWorldSize),
        (
            (10, 2, 2, Pad),
            SamplerError::RankOutOfRange {
                rank: 2,
                world_size: 2,
            },
        ),
        ((0, 1, 0, Pad), SamplerError::EmptyDataset),
        (
            (3, 4, 0, DropLast),
            SamplerError::TooFewSamples {
                len: 3,
                world_size: 4,
            },
        ),
    ];
    for ((len, ws, rank, rem), err) in cases {
        assert_eq!(DistributedSampler::new(len, ws, rank, 1, rem), Err(err));
    }
    let s = DistributedSampler::new(3, 4, 3, 1, Pad).unwrap();
    assert_eq!((s.indices(0).len(), s.num_real_samples()), (1, 0));
    assert_eq!(s.batches(0, 0), Err(SamplerError::ZeroBatchSize));
    assert!(s.for_rank(4).is_err());
}
