//! Optimizer states in resharding checkpoints, and training a small regression problem end to end.

mod common;

use common::*;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_optim::{
    AdamOptions, CosineWithWarmup, FsdpAdamW, OptimError, ShardedAdam, StatePrecision, StepLr,
};
use fsdp_shard::checkpoint::{load_sharded, read_commit, save_sharded, shard_file_bytes};
use fsdp_shard::{FsdpConfig, ModelLayout, ParamKind, ParamSpec, ShardedModel, WrapPolicy};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-optim-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn options(precision: StatePrecision) -> AdamOptions {
    AdamOptions {
        lr: 5e-3,
        state_precision: precision,
        ..AdamOptions::adamw()
    }
}

/// Trains `steps` steps from scratch (or from `load`) on `ws` ranks, optionally saving at the end.
fn train(
    p: &Problem,
    ws: usize,
    precision: StatePrecision,
    range: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Result<Vec<RankResult>, OptimError> {
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| p.init[i].iter().map(|v| v * -2.0).collect();
        let init_true = |i: usize| p.init[i].clone();
        let init: &dyn Fn(usize) -> Vec<f32> = if load.is_some() { &init } else { &init_true };
        let (mut model, masters) =
            ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), init)?;
        let mut opt = FsdpAdamW::new(&model, masters, options(precision))?;
        opt.set_schedule(Box::new(StepLr::new(2, 0.5)?));
        if let Some(dir) = load {
            load_sharded(dir, &mut model, Some(&mut *opt))?;
        }
        for t in range.clone() {
            set_grads(&mut model, &p.grads[t])?;
            opt.step(&mut model)?;
            opt.advance_schedule();
        }
        if let Some(dir) = save {
            save_sharded(dir, &model, Some(&*opt), &BTreeMap::new())?;
        }
        collect(&model, &opt)
    })
}

#[test]
fn resume_after_resharding_matches_uninterrupted_training() {
    let p = random_problem(31, SHAPES, WrapPolicy::MinParams(200), 0.4, 0.05, 5);
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        for (n, m) in [(2, 3), (4, 1), (3, 8), (1, 2)] {
            let dir = temp_dir(&format!("{n}{m}{precision:?}"));
            let whole = train(&p, n, precision, 0..5, None, None).unwrap();
            train(&p, n, precision, 0..3, None, Some(&dir)).unwrap();
            let resumed = train(&p, m, precision, 3..5, Some(&dir), None).unwrap();
            // Nothing depends on the world size without clipping: the resumed run is bitwise the same.
            assert_eq!(
                merge(&p.layout, &resumed),
                merge(&p.layout, &whole),
                "{precision:?} {n} -> {m}"
            );
            for r in &resumed {
                assert_eq!(r.metas, whole[0].metas, "{precision:?} {n} -> {m}: metas");
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

#[test]
fn checkpoints_of_another_configuration_are_refused() {
    let p = random_problem(32, SHAPES, WrapPolicy::Single, 0.4, 0.05, 2);
    let dir = temp_dir("refuse");
    train(&p, 2, StatePrecision::LowPrecision, 0..2, None, Some(&dir)).unwrap();
    let e = train(&p, 2, StatePrecision::F32, 0..0, Some(&dir), None);
    assert!(e.is_err(), "F32 optimizer loaded low-precision states");
    // Another schedule is refused too.
    let other = run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| p.init[i].clone();
        let (mut model, masters) =
            ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
        let mut opt = FsdpAdamW::new(&model, masters, options(StatePrecision::LowPrecision))?;
        opt.set_schedule(Box::new(CosineWithWarmup::new(1, 10, 0.0)?));
        load_sharded(&dir, &mut model, Some(&mut *opt))?;
        Ok::<_, OptimError>(())
    });
    assert!(other.is_err(), "a different schedule was accepted");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_checkpoint_size_estimate_bounds_each_rank_file_closely() {
    // Large enough that the shards and the optimizer states dwarf the header allowances: an estimate
    // that left out either would fall below the file.
    let shapes = [
        (256, 192, true),
        (256, 1, false),
        (64, 256, true),
        (300, 40, false),
    ];
    let p = random_problem(34, &shapes, WrapPolicy::MinParams(10_000), 0.4, 0.05, 2);
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        for ws in [1, 3] {
            let dir = temp_dir(&format!("estimate{ws}{precision:?}"));
            let estimates = run_ranks(ws, |comm: ThreadComm| {
                let comm: Arc<dyn Communicator> = Arc::new(comm);
                let init = |i: usize| p.init[i].clone();
                let (mut model, masters) =
                    ShardedModel::new(p.layout.clone(), comm, FsdpConfig::default(), &init)?;
                let mut opt = FsdpAdamW::new(&model, masters, options(precision))?;
                for g in &p.grads {
                    set_grads(&mut model, g)?;
                    opt.step(&mut model)?;
                }
                let extra: BTreeMap<String, String> =
                    [("step".to_string(), "2".to_string())].into();
                let estimate = shard_file_bytes(&model, Some(&*opt), &extra)?;
                save_sharded(&dir, &model, Some(&*opt), &extra)?;
                Ok::<_, OptimError>(estimate)
            })
            .unwrap();
            let commit = read_commit(&dir).unwrap();
            for (r, &estimate) in estimates.iter().enumerate() {
                let actual = std::fs::metadata(commit.shard_file(r)).unwrap().len();
                assert!(
                    actual <= estimate && estimate - actual <= 64 << 10,
                    "{precision:?} rank {r} of {ws}: file {actual} bytes, estimate {estimate}"
                );
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

// ---- A small regression problem trained end to end (FP8 forward, gradient reduction, optimizer). ----

const IN: usize = 16;
const OUT: usize = 8;
const BATCH: usize = 64;

fn regression_layout() -> Arc<ModelLayout> {
    Arc::new(
        ModelLayout::new(
            vec![
                ParamSpec::new("fc", "weight", &[OUT, IN], ParamKind::Fp8Weight),
                ParamSpec::new("fc", "bias", &[OUT], ParamKind::Plain),
            ],
            &WrapPolicy::Single,
        )
        .unwrap(),
    )
}

/// Teacher weights, inputs of step `t`, and targets.
fn data(t: usize) -> (Vec<f32>, Vec<f32>) {
    let teacher = values(77, OUT * IN);
    let bias = values(78, OUT);
    let x = values(1000 + t as u64, BATCH * IN);
    let mut y = vec![0f32; BATCH * OUT];
    for r in 0..BATCH {
        for o in 0..OUT {
            y[r * OUT + o] = bias[o]
                + (0..IN)
                    .map(|i| teacher[o * IN + i] * x[r * IN + i])
                    .sum::<f32>();
        }
    }
    (x, y)
}

fn param_f32(model: &ShardedModel, name: &str) -> Vec<f32> {
    model
        .param(model.index(name).unwrap())
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

/// One forward/backward of this rank's rows with the gathered FP8 weight; returns the global-batch loss
/// contribution of those rows (mean squared error over the global batch).
fn forward_backward(model: &mut ShardedModel, t: usize) -> Result<f32, OptimError> {
    let (rank, ws) = (model.comm().rank(), model.comm().world_size());
    let (x, y) = data(t);
    model.gather(0)?;
    let w = param_f32(model, "fc.weight");
    let b = param_f32(model, "fc.bias");
    let rows = rank * BATCH / ws..(rank + 1) * BATCH / ws;
    let mut dw = vec![0f32; OUT * IN];
    let mut db = vec![0f32; OUT];
    let mut loss = 0f32;
    let n = (BATCH * OUT) as f32;
    for r in rows {
        for o in 0..OUT {
            let pred = b[o] + (0..IN).map(|i| w[o * IN + i] * x[r * IN + i]).sum::<f32>();
            let d = pred - y[r * OUT + o];
            loss += d * d / n;
            let g = 2.0 * d / n;
            db[o] += g;
            for i in 0..IN {
                dw[o * IN + i] += g * x[r * IN + i];
            }
        }
    }
    let dev = model.device().clone();
    model.add_grad("fc.weight", &dev.upload(&dw)?)?;
    model.add_grad("fc.bias", &dev.upload(&db)?)?;
    model.reduce_grads(0)?;
    model.release(0)?;
    Ok(loss)
}

fn train_regression(ws: usize, precision: StatePrecision, steps: usize) -> Vec<f32> {
    let layout = regression_layout();
    let out = run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |i: usize| {
            values(5 + i as u64, [OUT * IN, OUT][i])
                .into_iter()
                .map(|v| v * 0.1)
                .collect()
        };
        let (mut model, masters) =
            ShardedModel::new(layout.clone(), comm.clone(), FsdpConfig::default(), &init)?;
        let mut opt: ShardedAdam = ShardedAdam::new(
            &model,
            masters,
            AdamOptions {
                lr: 2e-2,
                weight_decay: 0.0,
                max_grad_norm: Some(5.0),
                state_precision: precision,
                ..AdamOptions::adamw()
            },
            fp8_kernels::WeightDecay::Decoupled,
        )?;
        let mut losses = Vec::new();
        for t in 0..steps {
            let mut l = [forward_backward(&mut model, t)?];
            comm.all_reduce_host_f32(&mut l, fsdp_comm::ReduceOp::Sum)?;
            losses.push(l[0]);
            opt.step(&mut model)?;
        }
        Ok::<_, OptimError>(losses)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// Mean of the last `k` losses.
fn tail_mean(l: &[f32], k: usize) -> f32 {
    l[l.len() - k..].iter().sum::<f32>() / k as f32
}

#[test]
fn regression_trains_to_the_same_loss_with_low_precision_states() {
    let steps = 300;
    let f32_states = train_regression(2, StatePrecision::F32, steps);
    let low = train_regression(2, StatePrecision::LowPrecision, steps);
    let low_4 = train_regression(4, StatePrecision::LowPrecision, steps);
    let (a, b, c) = (
        tail_mean(&f32_states, 20),
        tail_mean(&low, 20),
        tail_mean(&low_4, 20),
    );
    eprintln!(
        "initial {} final: f32 {a}, low {b}, low on 4 ranks {c}",
        f32_states[0]
    );
    // Both learn the teacher: the loss falls by more than 100x.
    assert!(a < f32_states[0] / 100.0 && b < low[0] / 100.0, "{a} {b}");
    // The stated tolerance: the low-precision loss is within 10 % of the F32-state loss (the floor of both
    // is the FP8 weight's quantization error, which the states do not change).
    assert!(
        (b - a).abs() <= 0.10 * a,
        "f32 states {a}, low-precision states {b}"
    );
    assert!((c - b).abs() <= 0.10 * b, "2 ranks {b}, 4 ranks {c}");
}
