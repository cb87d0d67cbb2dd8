//! The step taken unit by unit (as a model's backward hands each unit over once its gradients are
//! reduced) against the whole-model step: bit for bit equal without skipped steps (weights, states and
//! their scales, FP8 codes and weight scales, counters), on thread ranks, for F32 and low-precision
//! states and F32 and BF16 gradient shards; transient gradient shards hold one unit at a time; a unit
//! with a non-finite gradient skips alone and the step counts as skipped; what cannot step in the
//! backward is refused.

mod common;

use common::*;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_optim::{
    AdamOptions, FsdpAdamW, OptimError, Optimizer, ShardedAdam, SharedOptimizer, StatePrecision,
    StepReport,
};
use fsdp_shard::{
    FsdpConfig, GradDtype, ParamGroup, ScalingRegistry, ShardedModel, ShardedState, StateShard,
    WrapPolicy,
};
use std::sync::Arc;

/// FP8 matrices and plain vectors (which do not decay), one unit each, plus a small root unit.
const SHAPES: &[(usize, usize, bool)] = &[
    (24, 16, true),
    (24, 1, false),
    (16, 40, true),
    (9, 7, false),
    (40, 1, false),
    (8, 24, true),
];

fn options(precision: StatePrecision) -> AdamOptions {
    AdamOptions {
        lr: 3e-3,
        weight_decay: 0.05,
        state_precision: precision,
        ..AdamOptions::adamw()
    }
}

/// Writes this rank's shard of `grads` (full values per parameter) into unit `u`'s gradient shards,
/// allocating transient ones first.
fn set_unit_grads(
    model: &mut ShardedModel,
    grads: &[Vec<f32>],
    u: usize,
) -> Result<(), OptimError> {
    let (rank, ws) = (model.comm().rank(), model.comm().world_size());
    let layout = model.layout().clone();
    model.ensure_grad_shards(u)?;
    let bf16 = model.config().grad_dtype == GradDtype::Bf16;
    for g in ParamGroup::ALL {
        let gl = layout.units[u].group(g);
        let mut full = vec![0f32; gl.padded_len(ws)];
        for slot in &gl.slots {
            full[slot.offset..slot.offset + slot.numel].copy_from_slice(&grads[slot.param]);
        }
        let r = gl.shard_range(rank, ws);
        let s = model.unit_mut(u)?;
        if bf16 {
            let h: Vec<half::bf16> = full[r].iter().map(|&x| half::bf16::from_f32(x)).collect();
            s.grads_bf16[g as usize].copy_from_host(&h)?;
        } else {
            s.grads[g as usize].copy_from_host(&full[r])?;
        }
    }
    Ok(())
}

/// What a rank holds after a run: shards, metas and reports, the states' checkpoint shards and scalars,
/// and the gradient-shard bytes (held at the end, most held at once).
#[derive(Debug, Clone)]
struct Outcome {
    result: RankResult,
    states: Vec<StateShard>,
    scalars: Vec<(String, String)>,
    grad_bytes: (usize, usize),
}

/// `steps` steps of `problem` on `ws` ranks, whole-model (`in_backward` false) or unit by unit in the
/// order a backward hands units over (last unit first); `poison(step, rank, unit)` may make a gradient
/// value NaN.
fn run_steps(
    problem: &Problem,
    ws: usize,
    o: AdamOptions,
    grad_dtype: GradDtype,
    steps: usize,
    in_backward: bool,
    poison: &(dyn Fn(usize, usize, usize) -> bool + Sync),
) -> Vec<Outcome> {
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let init = |p: usize| problem.init[p].clone();
        let config = FsdpConfig {
            grad_dtype,
            ..FsdpConfig::default()
        };
        let (mut model, masters) = ShardedModel::new(problem.layout.clone(), comm, config, &init)?;
        let mut opt = FsdpAdamW::new(&model, masters, o)?;
        let mut scaling = ScalingRegistry::new(model.device())?;
        if in_backward {
            model.set_transient_grads(true)?;
        }
        let mut reports: Vec<StepReport> = Vec::new();
        for t in 0..steps {
            let mut grads = problem.grads[t].clone();
            for u in 0..model.num_units() {
                if poison(t, rank, u) {
                    let p = problem.layout.units[u].group(ParamGroup::Fp8).slots[0].param;
                    // The weight's last element: in the last rank's shard.
                    if let Some(x) = grads[p].last_mut() {
                        *x = f32::NAN;
                    }
                }
            }
            if in_backward {
                for u in (0..model.num_units()).rev() {
                    set_unit_grads(&mut model, &grads, u)?;
                    Optimizer::step_unit(&mut *opt, &mut model, u)?;
                }
                let r = Optimizer::finish_step_in_backward(&mut *opt, &mut model, &mut scaling)?;
                reports.push(r.read()?);
            } else {
                for u in 0..model.num_units() {
                    set_unit_grads(&mut model, &grads, u)?;
                }
                reports.push(opt.step_with_report(&mut model)?);
            }
        }
        let mut result = collect(&model, &opt)?;
        result.reports = reports;
        let m = model.memory()?;
        Ok::<_, OptimError>(Outcome {
            result,
            states: opt.export_state()?,
            scalars: opt.scalar_state(),
            grad_bytes: (m.grad_shards, m.peak_grad_shards),
        })
    })
    .unwrap()
}

/// The reports without the gradient norm, which the step in the backward sums from the units' f32
/// sums of squares (a different rounding).
fn counters(r: &[StepReport]) -> Vec<(u64, bool, u64, u64)> {
    r.iter()
        .map(|x| (x.step, x.skipped, x.skipped_total, x.nonfinite))
        .collect()
}

#[test]
fn the_step_in_the_backward_equals_the_whole_model_step_bit_for_bit() {
    let steps = 5;
    let p = random_problem(17, SHAPES, WrapPolicy::PerModule, 0.4, 0.05, steps);
    for ws in [1, 2] {
        for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
            for dtype in [GradDtype::F32, GradDtype::Bf16] {
                let what = format!("{ws} rank(s), {precision:?} states, {dtype:?} gradient shards");
                let o = options(precision);
                let whole = run_steps(&p, ws, o, dtype, steps, false, &|_, _, _| false);
                let unit = run_steps(&p, ws, o, dtype, steps, true, &|_, _, _| false);
                for (w, u) in whole.iter().zip(&unit) {
                    assert_eq!(w.result.shards, u.result.shards, "{what}: shards");
                    assert_eq!(w.result.metas, u.result.metas, "{what}: state metas");
                    assert!(w.states == u.states, "{what}: optimizer states");
                    assert_eq!(w.scalars, u.scalars, "{what}: counters and amaxes");
                    assert_eq!(
                        counters(&w.result.reports),
                        counters(&u.result.reports),
                        "{what}"
                    );
                    for (a, b) in w.result.reports.iter().zip(&u.result.reports) {
                        let rel = (a.grad_norm - b.grad_norm).abs() / a.grad_norm;
                        assert!(
                            rel < 1e-6,
                            "{what}: gradient norm {} vs {}",
                            a.grad_norm,
                            b.grad_norm
                        );
                    }
                    // Persistent shards stay allocated; transient ones are gone after the step, and at
                    // most one unit's existed at once.
                    let bytes = dtype.size_bytes();
                    let total: usize = (0..p.layout.units.len())
                        .map(|k| {
                            ParamGroup::ALL
                                .iter()
                                .map(|&g| p.layout.units[k].group(g).shard_len(ws) * bytes)
                                .sum::<usize>()
                        })
                        .collect::<Vec<_>>()
                        .iter()
                        .sum();
                    let largest = (0..p.layout.units.len())
                        .map(|k| {
                            ParamGroup::ALL
                                .iter()
                                .map(|&g| p.layout.units[k].group(g).shard_len(ws) * bytes)
                                .sum::<usize>()
                        })
                        .max()
                        .unwrap_or(0);
                    assert_eq!(w.grad_bytes, (total, total), "{what}");
                    assert_eq!(u.grad_bytes, (0, largest), "{what}");
                    assert!(largest < total);
                }
            }
        }
    }
}

#[test]
fn a_unit_with_a_non_finite_gradient_skips_alone_and_the_step_counts_as_skipped() {
    let steps = 4;
    let p = random_problem(29, SHAPES, WrapPolicy::PerModule, 0.4, 0.05, steps);
    let fp8_unit = (0..p.layout.units.len())
        .find(|&u| !p.layout.units[u].group(ParamGroup::Fp8).slots.is_empty())
        .unwrap();
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        let o = options(precision);
        // Rank 1 alone sees a NaN in one unit's gradient at step 2.
        let poison = |t: usize, rank: usize, u: usize| t == 2 && rank == 1 && u == fp8_unit;
        let whole = run_steps(&p, 2, o, GradDtype::F32, steps, false, &poison);
        let unit = run_steps(&p, 2, o, GradDtype::F32, steps, true, &poison);
        for (w, u) in whole.iter().zip(&unit) {
            // The same counters: step 2 skipped on every rank, Adam's step count 3 at the end.
            assert_eq!(counters(&w.result.reports), counters(&u.result.reports));
            let skipped: Vec<bool> = u.result.reports.iter().map(|r| r.skipped).collect();
            assert_eq!(skipped, [false, false, true, false], "{precision:?}");
            assert_eq!(u.result.reports[2].nonfinite, 1);
            assert_eq!(u.result.reports[3].step, 3);
        }
        // Up to step 2 both agree; step 2 updated the other units (a partial step) and not the poisoned
        // one: compare after 3 steps.
        let whole3 = run_steps(&p, 2, o, GradDtype::F32, 3, false, &poison);
        let unit3 = run_steps(&p, 2, o, GradDtype::F32, 3, true, &poison);
        for (w, u) in whole3.iter().zip(&unit3) {
            for k in 0..p.layout.units.len() {
                if k == fp8_unit {
                    assert_eq!(w.result.shards[k], u.result.shards[k], "unit {k} skipped");
                } else {
                    assert_ne!(w.result.shards[k], u.result.shards[k], "unit {k} stepped");
                }
            }
        }
    }
}

#[test]
fn clipping_is_refused_and_misuse_is_an_error() {
    let p = random_problem(31, SHAPES, WrapPolicy::PerModule, 0.4, 0.05, 2);
    let out = run_ranks(1, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| p.init[i].clone();
        let (mut model, masters) =
            ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
        let clip = AdamOptions {
            max_grad_norm: Some(1.0),
            ..options(StatePrecision::LowPrecision)
        };
        let mut opt = FsdpAdamW::new(&model, masters, clip)?;
        let mut errors = vec![opt.step_unit(&mut model, 0).unwrap_err().to_string()];
        let shared = SharedOptimizer::new(Box::new(opt));
        errors.push(shared.err().map(|e| e.to_string()).unwrap_or_default());
        // Without clipping: a unit twice, a finish without a step, a whole-model step or a save in the
        // middle of a step.
        let (mut model, masters) = ShardedModel::new(
            p.layout.clone(),
            model.comm().clone(),
            FsdpConfig::default(),
            &init,
        )?;
        let mut opt = FsdpAdamW::new(&model, masters, options(StatePrecision::F32))?;
        let mut scaling = ScalingRegistry::new(model.device())?;
        errors.push(
            ShardedAdam::finish_step_in_backward(&mut opt, &mut model, Some(&mut scaling))
                .unwrap_err()
                .to_string(),
        );
        opt.step_unit(&mut model, 1)?;
        errors.push(opt.step_unit(&mut model, 1).unwrap_err().to_string());
        errors.push(
            ShardedAdam::step(&mut opt, &mut model)
                .unwrap_err()
                .to_string(),
        );
        errors.push(opt.export_state().unwrap_err().to_string());
        let pending = opt.step_in_backward_pending();
        ShardedAdam::finish_step_in_backward(&mut opt, &mut model, Some(&mut scaling))?;
        Ok::<_, OptimError>((errors, pending, opt.step_in_backward_pending()))
    })
    .unwrap();
    let (e, pending, after) = &out[0];
    assert!(
        e[0].contains("max_grad_norm") && e[0].contains("clipping"),
        "{}",
        e[0]
    );
    assert!(e[1].contains("max_grad_norm"), "{}", e[1]);
    assert!(e[2].contains("no step was begun"), "{}", e[2]);
    assert!(e[3].contains("unit 1 was already stepped"), "{}", e[3]);
    assert!(e[4].contains("not finished"), "{}", e[4]);
    assert!(e[5].contains("middle of a step"), "{}", e[5]);
    assert!(*pending && !*after);
}

#[test]
fn a_non_finite_loss_skips_every_unit() {
    let p = random_problem(37, SHAPES, WrapPolicy::PerModule, 0.4, 0.05, 2);
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        let out = run_ranks(2, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let rank = comm.rank();
            let init = |i: usize| p.init[i].clone();
            let (mut model, masters) =
                ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
            model.set_transient_grads(true)?;
            let mut opt = FsdpAdamW::new(&model, masters, options(precision))?;
            let mut scaling = ScalingRegistry::new(model.device())?;
            let mut reports = Vec::new();
            let mut before = None;
            for (t, loss) in [1.5f32, f32::NAN].into_iter().enumerate() {
                // Rank 1 alone sees the NaN loss; every gradient is finite.
                let loss = if rank == 1 { loss } else { 2.0 };
                let loss = model.device().upload(&[loss, 7.0])?;
                before = Some((collect(&model, &opt)?, opt.export_state()?));
                Optimizer::begin_step_in_backward(&mut *opt, &model, Some(&loss))?;
                for u in (0..model.num_units()).rev() {
                    set_unit_grads(&mut model, &p.grads[t], u)?;
                    Optimizer::step_unit(&mut *opt, &mut model, u)?;
                }
                let r = Optimizer::finish_step_in_backward(&mut *opt, &mut model, &mut scaling)?;
                reports.push(r.read()?);
            }
            let after = (collect(&model, &opt)?, opt.export_state()?);
            Ok::<_, OptimError>((reports, before == Some(after)))
        })
        .unwrap();
        for (reports, unchanged) in out {
            assert_eq!(
                counters(&reports),
                [(1, false, 0, 0), (1, true, 1, p.layout.units.len() as u64)],
                "{precision:?}"
            );
            assert!(
                unchanged,
                "{precision:?}: a unit moved on a non-finite loss"
            );
        }
    }
}
