//! Shared by the GPT tests: one-rank models on the CPU and parameter access by id.
#![allow(dead_code)]

use fp8_core::Fp8Recipe;
use fp8_kernels::rng::SplitMix64;
use fsdp_comm::{Communicator, ThreadGroup};
use fsdp_examples::gpt::{wrap_policy, Gpt, GptConfig};
use fsdp_nn::{convert_to_fp8, Activation, Fp8Filter};
use fsdp_shard::{FsdpConfig, FsdpModel};
use std::sync::Arc;
use std::time::Duration;

// Parameter access by id and the directional finite-difference check of fsdp-nn's transformer tests.
#[path = "../../../fsdp-nn/tests/transformer_common/mod.rs"]
mod transformer_common;
#[allow(unused_imports)] // each test binary uses some of them
pub use transformer_common::{directional, grad, set_values, values};

/// A one-rank model on the CPU in its float precision, wrapped as the GPT example wraps it (one unit per
/// block).
pub fn one_rank<T: Activation>(config: GptConfig) -> FsdpModel<Gpt<T>> {
    one_rank_with::<T>(config, &Fp8Filter::None)
}

/// [`one_rank`] with the linears `filter` selects converted to FP8.
pub fn one_rank_with<T: Activation>(config: GptConfig, filter: &Fp8Filter) -> FsdpModel<Gpt<T>> {
    let comm: Arc<dyn Communicator> = Arc::new(
        ThreadGroup::new(1, Duration::from_secs(300))
            .unwrap()
            .pop()
            .unwrap(),
    );
    let mut gpt = Gpt::<T>::new(config).unwrap();
    convert_to_fp8(&mut gpt, filter, &Fp8Recipe::default()).unwrap();
    FsdpModel::new(gpt, comm, wrap_policy(), FsdpConfig::default()).unwrap()
}

/// `n` values uniform in `[lo, hi)` from `seed`.
pub fn uniform(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| lo + (hi - lo) * r.uniform_f32()).collect()
}

/// `n` ids in `0..vocab` from `seed`.
pub fn ids(n: usize, vocab: usize, seed: u64) -> Vec<i32> {
    let mut r = SplitMix64::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as i32)
        .collect()
}
