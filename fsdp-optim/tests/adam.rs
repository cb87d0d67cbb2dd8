//! Adam/AdamW against a plain f64 reference, across world sizes, and its failure cases.

mod common;

use common::*;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_optim::{
    AdamOptions, BytesPerParam, FsdpAdam, FsdpAdamW, OptimError, StatePrecision, StepLr,
};
use fsdp_shard::{FsdpConfig, ShardedModel, ShardedState, WrapPolicy};
use proptest::prelude::*;
use std::sync::Arc;

const PRECISIONS: [StatePrecision; 2] = [StatePrecision::F32, StatePrecision::LowPrecision];

fn opts(precision: StatePrecision) -> AdamOptions {
    AdamOptions {
        lr: 1e-2,
        state_precision: precision,
        ..AdamOptions::adamw()
    }
}

/// Low-precision states against the f64 reference (stated in docs/optimizers.md): the error is at most
/// this fraction of the weights' norm, and of how far the reference moved them.
const LP_REL_BOUND: f64 = 3e-2;
const LP_MOTION_BOUND: f64 = 0.1;

/// The relative bound against the F64 reference for a run whose sum order differs from it.
fn rel_bound(precision: StatePrecision) -> f64 {
    match precision {
        StatePrecision::F32 => 1e-5,
        StatePrecision::LowPrecision => LP_REL_BOUND,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn states_match_the_f64_reference(
        seed in 0u64..1_000_000,
        ws in 1usize..4,
        decoupled in any::<bool>(),
        maximize in any::<bool>(),
        clip in prop::option::of(0.05f64..2.0),
        wd in 0.0f64..0.1,
        lr in 1e-4f64..2e-2,
        g_mag in prop::sample::select(vec![1e-3f32, 0.1, 10.0]),
        rows in 1usize..40,
    ) {
        let steps = 40;
        let shapes = [(rows, 9, true), (rows, 1, false), (7, rows, true)];
        let p = random_problem(seed, &shapes, WrapPolicy::Single, 0.3, g_mag, steps);
        for precision in PRECISIONS {
            let o = AdamOptions {
                lr, weight_decay: wd, maximize, max_grad_norm: clip, state_precision: precision,
                ..AdamOptions::adam()
            };
            let want = reference(&p, &o, decoupled, steps);
            let got = run(&p, ws, o, decoupled, steps);
            let (params, _) = merge(&p.layout, &got);
            let d = rel_diff(&params, &want);
            match precision {
                StatePrecision::F32 => prop_assert!(d < 1e-5, "F32 states: {d:e}"),
                StatePrecision::LowPrecision => {
                    let mv = rel_to_motion(&params, &want, &p.init);
                    prop_assert!(
                        d < LP_REL_BOUND || mv < LP_MOTION_BOUND,
                        "low-precision states: {d:e} of the weights, {mv:e} of the motion"
                    );
                }
            }
            for r in &got {
                prop_assert_eq!(&r.metas, &got[0].metas, "metas differ between ranks");
                prop_assert_eq!(r.reports.last().map(|x| x.step), Some(steps as u64));
            }
        }
    }
}

#[test]
fn long_run_error_stays_within_the_stated_bounds() {
    let steps = 200;
    let p = random_problem(3, SHAPES, WrapPolicy::PerModule, 0.5, 0.1, steps);
    for decoupled in [true, false] {
        let o = opts(StatePrecision::LowPrecision);
        let want = reference(&p, &o, decoupled, steps);
        let (params, dequant) = merge(&p.layout, &run(&p, 2, o, decoupled, steps));
        let d = rel_diff(&params, &want);
        let mv = rel_to_motion(&params, &want, &p.init);
        assert!(d < LP_REL_BOUND && mv < LP_MOTION_BOUND, "{d:e} {mv:e}");
        // The FP8 weights are the E4M3 rounding of the masters (relative error <= 2^-4 per element).
        for (i, (m, q)) in params.iter().zip(&dequant).enumerate() {
            for (a, b) in m.iter().zip(q) {
                if !q.is_empty() {
                    assert!(
                        (a - b).abs() <= a.abs() / 16.0 + 1e-6,
                        "param {i}: {a} vs {b}"
                    );
                }
            }
        }
        let o = opts(StatePrecision::F32);
        let (params, _) = merge(&p.layout, &run(&p, 2, o, decoupled, steps));
        let d = rel_diff(&params, &reference(&p, &o, decoupled, steps));
        assert!(d < 1e-5, "F32 after {steps} steps: {d:e}");
    }
}

#[test]
fn world_sizes_agree() {
    let steps = 8;
    let p = random_problem(11, SHAPES, WrapPolicy::MinParams(100), 0.4, 0.05, steps);
    for precision in PRECISIONS {
        for clip in [None, Some(0.2)] {
            let o = AdamOptions {
                max_grad_norm: clip,
                ..opts(precision)
            };
            let one = run(&p, 1, o, true, steps);
            let (base, base_q) = merge(&p.layout, &one);
            for ws in [2, 3, 4, 8] {
                let got = run(&p, ws, o, true, steps);
                let (params, q) = merge(&p.layout, &got);
                for r in &got {
                    assert_eq!(r.metas, got[0].metas, "ws {ws}: metas differ between ranks");
                    for (u, s) in r.shards.iter().enumerate() {
                        assert_eq!(s.3, got[0].shards[u].3, "ws {ws}: weight scales differ");
                    }
                    assert_eq!(r.reports, got[0].reports, "ws {ws}: reports differ");
                }
                if clip.is_none() {
                    // Without clipping nothing depends on the sharding: bitwise equal.
                    assert_eq!(params, base, "ws {ws} {precision:?}");
                    assert_eq!(q, base_q, "ws {ws} {precision:?}");
                    assert_eq!(got[0].metas, one[0].metas, "ws {ws} {precision:?}");
                } else {
                    // The global norm's sum order differs with the world size.
                    let d = rel_diff(&params, &as_f64(&base));
                    assert!(d < rel_bound(precision), "ws {ws} {precision:?}: {d:e}");
                }
            }
        }
    }
}

#[test]
fn nonfinite_gradients_skip_the_step_on_every_rank() {
    let steps = 5;
    let p = random_problem(5, SHAPES, WrapPolicy::PerModule, 0.4, 0.05, steps);
    for precision in PRECISIONS {
        for bad in [f32::NAN, f32::INFINITY] {
            let o = opts(precision);
            // Rank 1 alone sees a bad value at step 2 (in an FP8 weight's gradient), rank 2 at step 3 (plain).
            let poisoned = run_with(&p, 3, o, true, steps, &|t, rank, model| {
                let g = match (t, rank) {
                    (2, 1) => 0,
                    (3, 2) => 1,
                    _ => return,
                };
                let u = (0..model.num_units())
                    .find(|&u| !model.unit(u).unwrap().grads[g].is_empty())
                    .unwrap();
                let mut v = model.unit(u).unwrap().grads[g].to_vec().unwrap();
                v[0] = bad;
                model.unit_mut(u).unwrap().grads[g]
                    .copy_from_host(&v)
                    .unwrap();
            });
            for r in &poisoned {
                let skipped: Vec<bool> = r.reports.iter().map(|x| x.skipped).collect();
                assert_eq!(skipped, [false, false, true, true, false]);
                assert_eq!(r.reports[4].skipped_total, 2);
                assert_eq!(r.reports[4].step, 3);
                assert_eq!(r.reports[2].nonfinite, 1);
                assert_eq!(r.metas, poisoned[0].metas);
            }
            // Skipping steps 2 and 3 equals training on steps 0, 1, 4 only.
            let mut clean = p.clone();
            clean.grads = vec![p.grads[0].clone(), p.grads[1].clone(), p.grads[4].clone()];
            let want = run(&clean, 3, o, true, 3);
            assert_eq!(
                merge(&p.layout, &poisoned),
                merge(&p.layout, &want),
                "{precision:?} {bad}"
            );
        }
    }
}

#[test]
fn a_skipped_step_leaves_everything_untouched() {
    let p = random_problem(8, SHAPES, WrapPolicy::Single, 0.4, 0.05, 2);
    let out = run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| p.init[i].clone();
        let (mut model, masters) =
            ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
        let mut opt = FsdpAdamW::with_defaults(&model, masters)?;
        set_grads(&mut model, &p.grads[0])?;
        opt.step(&mut model)?;
        let before = (opt.export_state()?, collect(&model, &opt)?);
        set_grads(&mut model, &p.grads[1])?;
        let mut g = model.unit(0)?.grads[0].to_vec()?;
        g[1] = f32::NAN;
        if model.comm().rank() == 0 {
            model.unit_mut(0)?.grads[0].copy_from_host(&g)?;
        }
        let rep = opt.step_with_report(&mut model)?;
        let after = (opt.export_state()?, collect(&model, &opt)?);
        let grads_zeroed = model.unit(0)?.grads[0].to_vec()?.iter().all(|x| *x == 0.0);
        Ok::<_, OptimError>((before == after, rep.skipped, grads_zeroed))
    })
    .unwrap();
    for o in out {
        assert_eq!(o, (true, true, true));
    }
}

#[test]
fn empty_shards_and_tiny_parameters() {
    // Every parameter is smaller than the world size: most ranks hold only padding.
    let shapes = [(1, 3, true), (1, 1, false), (2, 2, true)];
    let steps = 6;
    let p = random_problem(21, &shapes, WrapPolicy::Single, 0.5, 0.1, steps);
    for precision in PRECISIONS {
        let o = opts(precision);
        let (want, _) = merge(&p.layout, &run(&p, 1, o, true, steps));
        let got = run(&p, 8, o, true, steps);
        assert_eq!(merge(&p.layout, &got).0, want, "{precision:?}");
        let d = rel_diff(&want, &reference(&p, &o, true, steps));
        assert!(d < rel_bound(precision), "{precision:?}: {d:e}");
    }
}

#[test]
fn zero_learning_rate_keeps_the_weights() {
    let steps = 4;
    let p = random_problem(2, SHAPES, WrapPolicy::PerModule, 0.4, 0.5, steps);
    for precision in PRECISIONS {
        for decoupled in [true, false] {
            let o = AdamOptions {
                lr: 0.0,
                weight_decay: 0.1,
                ..opts(precision)
            };
            let start = merge(&p.layout, &run(&p, 2, o, decoupled, 0));
            let end_ranks = run(&p, 2, o, decoupled, steps);
            let end = merge(&p.layout, &end_ranks);
            assert_eq!(end.0, start.0, "{precision:?}: masters moved");
            if precision == StatePrecision::F32 {
                assert_eq!(end.1, start.1, "FP8 weights moved");
            } else {
                // Cast from the F16 master, the FP8 weights may differ from the initial cast (from F32) by a
                // double rounding: at most one E4M3 step.
                for (a, b) in end.1.iter().flatten().zip(start.1.iter().flatten()) {
                    assert!((a - b).abs() <= b.abs() / 8.0, "{a} vs {b}");
                }
            }
            let end = end_ranks;
            assert_eq!(end[0].reports[steps - 1].step, steps as u64);
        }
    }
}

#[test]
fn bad_hyperparameters_are_errors() {
    let p = random_problem(1, SHAPES, WrapPolicy::Single, 0.4, 0.5, 1);
    let base = AdamOptions::adamw();
    let bad = [
        AdamOptions { lr: -1e-3, ..base },
        AdamOptions {
            lr: f64::NAN,
            ..base
        },
        AdamOptions { eps: -1e-8, ..base },
        AdamOptions { eps: 0.0, ..base },
        AdamOptions {
            betas: (1.0, 0.999),
            ..base
        },
        AdamOptions {
            betas: (0.9, -0.1),
            ..base
        },
        AdamOptions {
            betas: (0.9, 1.5),
            ..base
        },
        AdamOptions {
            weight_decay: -0.1,
            ..base
        },
        AdamOptions {
            max_grad_norm: Some(0.0),
            ..base
        },
        AdamOptions {
            max_grad_norm: Some(f64::INFINITY),
            ..base
        },
    ];
    for o in bad {
        assert!(
            matches!(o.validate(), Err(OptimError::InvalidHyperparameter(_))),
            "{o:?}"
        );
    }
    assert!(matches!(
        AdamOptions {
            amsgrad: true,
            ..base
        }
        .validate(),
        Err(OptimError::Unsupported(_))
    ));
    run_ranks(1, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| p.init[i].clone();
        let (model, masters) =
            ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
        let e = FsdpAdam::new(&model, masters.clone(), AdamOptions { lr: -1.0, ..base });
        assert!(matches!(e, Err(OptimError::InvalidHyperparameter(_))));
        let e = FsdpAdam::new(&model, masters[1..].to_vec(), base);
        assert!(matches!(e, Err(OptimError::Mismatch(_))));
        let mut opt = FsdpAdam::new(&model, masters, base)?;
        assert!(opt.set_lr(-0.5).is_err());
        assert_eq!(opt.options().lr, base.lr, "a rejected lr changes nothing");
        Ok::<_, OptimError>(())
    })
    .unwrap();
}

#[test]
fn defaults_follow_pytorch() {
    let a = AdamOptions::adam();
    assert_eq!(
        (a.lr, a.betas, a.eps, a.weight_decay),
        (1e-3, (0.9, 0.999), 1e-8, 0.0)
    );
    assert_eq!(AdamOptions::adamw().weight_decay, 1e-2);
    assert_eq!(a.state_precision, StatePrecision::LowPrecision);
    assert!(!a.maximize && !a.amsgrad && a.max_grad_norm.is_none());
}

#[test]
fn schedule_sets_the_learning_rate() {
    let p = random_problem(4, SHAPES, WrapPolicy::Single, 0.4, 0.5, 3);
    let lrs = run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| p.init[i].clone();
        let (mut model, masters) =
            ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
        let mut opt = FsdpAdamW::with_defaults(&model, masters)?;
        opt.set_schedule(Box::new(StepLr::new(1, 0.7)?));
        let mut lrs = Vec::new();
        for t in 0..3 {
            set_grads(&mut model, &p.grads[t])?;
            lrs.push(opt.step_with_report(&mut model)?.lr);
            opt.advance_schedule();
        }
        Ok::<_, OptimError>(lrs)
    })
    .unwrap();
    assert_eq!(lrs[0], vec![1e-3, 1e-3 * 0.7, 1e-3 * 0.7 * 0.7]);
}

#[test]
fn memory_per_parameter() {
    assert_eq!(
        BytesPerParam::fp8_weight(StatePrecision::LowPrecision).total(),
        10
    );
    assert_eq!(BytesPerParam::fp8_weight(StatePrecision::F32).total(), 17);
    assert_eq!(BytesPerParam::bf16_mixed_precision().total(), 16);
    assert_eq!(BytesPerParam::plain().total(), 16);
    // Measured on a model of one large FP8 weight and a bias, on 4 ranks.
    let shapes = [(256, 256, true), (256, 1, false)];
    let p = random_problem(9, &shapes, WrapPolicy::Single, 0.1, 0.1, 0);
    for (precision, lo, hi) in [
        (StatePrecision::LowPrecision, 10.0, 10.2),
        (StatePrecision::F32, 16.9, 17.2),
    ] {
        let got = run_ranks(4, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let init = |i: usize| p.init[i].clone();
            let (model, masters) =
                ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
            let opt = FsdpAdamW::new(&model, masters, opts(precision))?;
            opt.bytes_per_param(&model)
        })
        .unwrap();
        for b in got {
            eprintln!("{precision:?}: {b:.3} bytes per parameter");
            assert!(
                (lo..hi).contains(&b),
                "{precision:?}: {b} bytes per parameter"
            );
        }
    }
}
