//! The optimizer on BF16 gradient shards: bitwise the F32-shard step fed the same BF16-rounded
//! gradients, and within the BF16 rounding bound of the step on the exact gradients.

mod common;

use common::*;
use fsdp_optim::{AdamOptions, StatePrecision};
use fsdp_shard::{FsdpConfig, GradDtype, WrapPolicy};
use proptest::prelude::*;

fn bf16_round(p: &Problem) -> Problem {
    let mut q = p.clone();
    for step in &mut q.grads {
        for g in step.iter_mut() {
            for x in g.iter_mut() {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        }
    }
    q
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn bf16_shards_step_as_f32_shards_on_rounded_gradients(
        seed in 0u64..10_000, ws in 1usize..4, low in any::<bool>(), clip in any::<bool>(), steps in 1usize..4,
    ) {
        let shapes = [(24, 16, true), (24, 1, false), (8, 24, true), (8, 1, false)];
        let p = random_problem(seed, &shapes, WrapPolicy::PerModule, 0.5, 0.02, steps);
        let options = AdamOptions {
            lr: 1e-3,
            max_grad_norm: clip.then_some(0.05),
            state_precision: if low { StatePrecision::LowPrecision } else { StatePrecision::F32 },
            ..AdamOptions::adamw()
        };
        let bf16_cfg = FsdpConfig { grad_dtype: GradDtype::Bf16, ..FsdpConfig::default() };
        let a = run_config(&p, ws, options, true, steps, bf16_cfg, &|_, _, _| {});
        let b = run(&bf16_round(&p), ws, options, true, steps);
        // Bitwise: masters, codes, scales, state metas, step reports.
        prop_assert_eq!(&a, &b);
        // Against the exact gradients: Adam's update m / sqrt(v) is scale-free, so a relative gradient
        // error of 2^-9 moves each step's update by about 2 * 2^-9 of lr. Low-precision states may round
        // the other way: the E4M3 first moment by one step of its 2^-3 relative spacing (that much of
        // lr), the F16 master by one ulp (2^-10 relative), per step.
        let c = run(&p, ws, options, true, steps);
        let (pa, _) = merge(&p.layout, &a);
        let (pc, _) = merge(&p.layout, &c);
        for (x, y) in pa.iter().flatten().zip(pc.iter().flatten()) {
            let lp = if low { 1e-3 * 2f32.powi(-3) + 2f32.powi(-10) * y.abs().max(x.abs()) } else { 0.0 };
            let bound = steps as f32 * (1e-3 * 2f32.powi(-6) + lp) + 1e-7 * y.abs();
            prop_assert!((x - y).abs() <= bound, "{} vs {} (bound {})", x, y, bound);
        }
    }
}
