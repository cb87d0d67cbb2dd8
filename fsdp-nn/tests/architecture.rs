//! The module architecture on a tiny tied model (`common::tiny_lm`) on thread ranks: a
//! parameter used by two modules has one gradient, summed in the root unit; one unit per block `h.N`
//! with the root for the rest, gathered one block at a time; weight decay on matrices only (checked
//! against a hand computation of the step); a forward without gradients leaves the model's state alone
//! and gives the training forward's output; recompute per module trains bit-identically; misuse is an
//! error, never a wrong answer. Module state in checkpoints, accumulation and FP8 gradient reduction are
//! in `architecture_state.rs` and `architecture_grads.rs`.

mod common;

use common::tiny_lm::{eval_pass, reference_grads, train_pass, wrap, Batch, TinyConfig, TinyLm};
use common::{bits, grad_shards, on_ranks, rel_diff, TestResult};
use fsdp_nn::{LinearPrecision, Shape, Tensor};
use fsdp_optim::{step_model, AdamOptions, FsdpAdam, FsdpAdamW, Optimizer, StatePrecision};
use fsdp_shard::{
    FsdpConfig, FsdpModel, Mode, ModelLayout, Module, ParamGroup, ParamKind, ShardedModel,
};
use std::collections::BTreeMap;
use std::sync::Arc;

const VOCAB: usize = 24;
const D: usize = 16;
const ROWS: usize = 12;

/// Every parameter by name (gathered; collective).
fn params_by_name<M: Module>(model: &mut FsdpModel<M>) -> TestResult<BTreeMap<String, Vec<f32>>> {
    Ok(model.gathered_params()?.into_iter().collect())
}

/// Every parameter's reduced gradient by name, from every rank's shards.
fn grads_by_name(
    layout: &ModelLayout,
    per_rank: &[Vec<[Vec<f32>; 2]>],
) -> BTreeMap<String, Vec<f32>> {
    layout
        .params
        .iter()
        .map(|p| (p.name.clone(), common::full_grad(layout, per_rank, &p.name)))
        .collect()
}

/// Rank `rank`'s batch.
fn batch(rank: usize, seed: u64) -> Batch {
    Batch::new(VOCAB, ROWS, seed ^ (rank as u64 * 7919))
}

struct GradRun {
    params: BTreeMap<String, Vec<f32>>,
    grads: Vec<[Vec<f32>; 2]>,
    layout: Arc<ModelLayout>,
    gathered_after: Vec<bool>,
}

/// One forward and backward on each rank (the loss a mean over the global batch).
fn grad_run(c: TinyConfig, ranks: usize) -> Vec<GradRun> {
    on_ranks(ranks, |comm| {
        let rank = comm.rank();
        let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
        let params = params_by_name(&mut model)?;
        train_pass(&mut model, &batch(rank, 1), 1.0 / ranks as f32)?;
        let gathered_after = (0..model.sharded().num_units())
            .map(|u| model.sharded().is_gathered(u))
            .collect();
        Ok(GradRun {
            params,
            grads: grad_shards(model.sharded())?,
            layout: model.layout().clone(),
            gathered_after,
        })
    })
}

#[test]
fn tied_parameter_has_one_gradient_summed_in_the_root_unit() {
    let blocks = 2;
    for ranks in [1, 2] {
        let tied = TinyConfig::new(VOCAB, D, blocks);
        let untied = TinyConfig {
            tied: false,
            ..tied
        };
        let t = grad_run(tied, ranks);
        let u = grad_run(untied, ranks);
        let layout = &t[0].layout;
        // The layout: the embedding (and the head's bias) in the root unit, placed first; one unit per
        // block; the tied matrix counted once.
        let names: Vec<&str> = layout.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["root", "h.0", "h.1"]);
        let unit_of = |l: &ModelLayout, n: &str| {
            l.location(l.param_index(n).expect("param"))
                .expect("located")
                .unit
        };
        assert_eq!(unit_of(layout, "wte.weight"), 0);
        assert_eq!(unit_of(layout, "head.bias"), 0);
        for b in 0..blocks {
            assert_eq!(unit_of(layout, &format!("h.{b}.fc.weight")), b + 1);
            assert_eq!(unit_of(layout, &format!("h.{b}.fc.bias")), b + 1);
        }
        assert!(layout.param_index("head.weight").is_none());
        assert_eq!(
            u[0].layout.numel(),
            layout.numel() + VOCAB * D,
            "the tied matrix is one parameter"
        );
        assert!(
            t[0].gathered_after.iter().all(|g| !g),
            "every unit released after the backward"
        );
        // One gradient, the sum of both uses: the untied model's two gradients, added.
        let tg = grads_by_name(
            layout,
            &t.iter().map(|r| r.grads.clone()).collect::<Vec<_>>(),
        );
        let ug = grads_by_name(
            &u[0].layout,
            &u.iter().map(|r| r.grads.clone()).collect::<Vec<_>>(),
        );
        let sum: Vec<f32> = ug["head.weight"]
            .iter()
            .zip(&ug["wte.weight"])
            .map(|(h, e)| h + e)
            .collect();
        if ranks == 1 {
            // The head's gradient arrives first, then the embedding's is added into it: the same f32
            // sum, bit for bit.
            assert_eq!(
                bits(&tg["wte.weight"]),
                bits(&sum),
                "tied = head + embedding"
            );
        } else {
            // Summed before the reduction instead of after it: f32 rounding only.
            let d = rel_diff(&tg["wte.weight"], &sum);
            assert!(d < 1e-6, "tied vs head + embedding: {d:e}");
        }
        for name in ["head.bias", "h.0.fc.weight", "h.1.fc.bias"] {
            let d = rel_diff(&tg[name], &ug[name]);
            assert!(d < 1e-6, "{name}: tied vs untied {d:e}");
        }
        // Against the f64 reference of the whole model over every rank's batch.
        let batches: Vec<(Batch, f32)> = (0..ranks)
            .map(|r| (batch(r, 1), 1.0 / ranks as f32))
            .collect();
        let want = reference_grads(&tied, &t[0].params, &batches);
        assert_eq!(want.len(), tg.len());
        for (name, w) in &want {
            let w32: Vec<f32> = w.iter().map(|&v| v as f32).collect();
            let d = rel_diff(&tg[name], &w32);
            assert!(
                d < 1e-4,
                "{ranks} rank(s), {name}: {d:e} from the f64 reference"
            );
        }
        let untied_want = reference_grads(&untied, &u[0].params, &batches);
        for name in ["head.weight", "wte.weight"] {
            let w32: Vec<f32> = untied_want[name].iter().map(|&v| v as f32).collect();
            let d = rel_diff(&ug[name], &w32);
            assert!(d < 1e-4, "untied {name}: {d:e} from the f64 reference");
        }
    }
}

/// Bytes of unit `u` gathered: `(flat buffers, parameters cut out of them)`. A gathered unit keeps the
/// cut parameters; the flat buffers live while a gather is in flight and during the cut.
fn gathered_bytes(layout: &ModelLayout, u: usize, ws: usize) -> (usize, usize) {
    let unit = &layout.units[u];
    let g8 = unit.group(ParamGroup::Fp8);
    let gp = unit.group(ParamGroup::Plain);
    (
        g8.padded_len(ws) + 4 * gp.padded_len(ws),
        g8.slots.iter().map(|s| s.numel + 8).sum::<usize>()
            + gp.slots.iter().map(|s| 4 * s.numel).sum::<usize>(),
    )
}

#[test]
fn one_unit_per_block_is_gathered_at_a_time() {
    // Four blocks, each larger than the root: at most the root, the block computing and the next
    // one (prefetched) are gathered at any time.
    let c = TinyConfig {
        precision: LinearPrecision::Fp8,
        ..TinyConfig::new(8, 64, 4)
    };
    for ranks in [1, 2] {
        let out = on_ranks(ranks, |comm| {
            let rank = comm.rank();
            let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
            let b = Batch::new(8, 6, rank as u64);
            let dev = model.device().clone();
            let x = Tensor::new(dev.upload(&b.x)?, Shape::matrix(6, 8)?)?;
            let labels = dev.upload(&b.labels)?;
            model.forward(Mode::Train, |m, ctx| m.forward(ctx, x, &labels))?;
            let after_forward: Vec<bool> = (0..5).map(|u| model.sharded().is_gathered(u)).collect();
            model.backward(|m, ctx| m.backward(ctx, &labels, 1.0))?;
            let after_backward: Vec<bool> =
                (0..5).map(|u| model.sharded().is_gathered(u)).collect();
            let peak = model.sharded().memory()?.peak_gathered;
            Ok((after_forward, after_backward, peak, model.layout().clone()))
        });
        let (after_forward, after_backward, peak, layout) = &out[0];
        assert!(model_is_root_first(layout));
        // After a training forward the root stays gathered for the backward; the blocks are released
        // (the last one may be prefetched for the backward, which is not a gathered unit yet).
        assert_eq!(after_forward, &[true, false, false, false, false]);
        assert_eq!(after_backward, &[false; 5]);
        let (_, root) = gathered_bytes(layout, 0, ranks);
        let (flat, cut) = (1..5)
            .map(|u| gathered_bytes(layout, u, ranks))
            .max()
            .unwrap_or((0, 0));
        // The root's parameters, one block's, and either that block's flat buffers (during its cut) or
        // the next block's (its prefetch in flight). Every block at once would be `root + 4 cut`.
        assert!(
            *peak <= root + cut + flat,
            "{ranks} rank(s): peak gathered {peak} B over root {root} B + one block ({cut} B) + one \
             block's flat buffers ({flat} B)"
        );
        assert!(root < cut, "the test needs blocks larger than the root");
    }
}

fn model_is_root_first(layout: &ModelLayout) -> bool {
    layout.root_unit() == Some(0)
        && layout.units[1..]
            .iter()
            .enumerate()
            .all(|(b, u)| u.name == format!("h.{b}"))
}

/// One step's hand computation: Adam's first step moves every element by `lr * g / (|g| + eps)`
/// (bias correction makes `m / (1 - beta1) = g` and `sqrt(v / (1 - beta2)) = |g|`); decoupled decay
/// multiplies by `1 - lr * wd` first, L2 decay adds `wd * w` to the gradient.
fn first_step(w: f32, g: f32, lr: f64, wd: f64, eps: f64, decoupled: bool, decay: bool) -> f64 {
    let (w, g) = (w as f64, g as f64);
    let wd = if decay { wd } else { 0.0 };
    if decoupled {
        w * (1.0 - lr * wd) - lr * g / (g.abs() + eps)
    } else {
        let g = g + wd * w;
        w - lr * g / (g.abs() + eps)
    }
}

/// The FP8 weights' F32 masters of every unit (this rank's shards).
fn master_shards(opt: &fsdp_optim::ShardedAdam, model: &ShardedModel) -> TestResult<Vec<Vec<f32>>> {
    (0..model.num_units())
        .map(|u| Ok(opt.fp8_master_shard(u)?))
        .collect()
}

/// A parameter's values from every rank's shards of group `g` (masters or gradients).
fn from_shards(layout: &ModelLayout, per_rank: &[Vec<Vec<f32>>], name: &str) -> Vec<f32> {
    let (u, _, slot) = layout
        .locate(layout.param_index(name).expect("param"))
        .expect("located");
    let flat: Vec<f32> = per_rank.iter().flat_map(|r| r[u].iter().copied()).collect();
    flat[slot.offset..slot.offset + slot.numel].to_vec()
}

#[test]
fn weight_decay_applies_to_matrices_only() {
    let (lr, wd) = (0.1, 0.5);
    // (AdamW or Adam, the embedding's decay override, ranks)
    for (decoupled, embed_decay, ranks) in [
        (true, None, 1),
        (true, None, 2),
        (true, Some(false), 2),
        (false, None, 2),
    ] {
        let c = TinyConfig {
            precision: LinearPrecision::Fp8,
            embed_decay,
            ..TinyConfig::new(VOCAB, D, 2)
        };
        let out = on_ranks(ranks, |comm| {
            let rank = comm.rank();
            let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
            let options = AdamOptions {
                lr,
                weight_decay: wd,
                state_precision: StatePrecision::F32,
                ..AdamOptions::adam()
            };
            let b = batch(rank, 3);
            if decoupled {
                let mut opt = FsdpAdamW::for_model(&mut model, options)?;
                decay_step(&mut model, &mut opt, &b, ranks)
            } else {
                let mut opt = FsdpAdam::for_model(&mut model, options)?;
                decay_step(&mut model, &mut opt, &b, ranks)
            }
        });
        let layout = out[0].5.clone();
        let grads: Vec<_> = out.iter().map(|r| r.1.clone()).collect();
        let m_before: Vec<_> = out.iter().map(|r| r.2.clone()).collect();
        let m_after: Vec<_> = out.iter().map(|r| r.3.clone()).collect();
        let what = format!("AdamW {decoupled}, embedding decay {embed_decay:?}, {ranks} rank(s)");
        let eps = AdamOptions::adam().eps;
        let mut decayed = 0;
        for spec in &layout.params {
            let name = &spec.name;
            let matrix = spec.shape.len() >= 2;
            let want_decay = if name == "wte.weight" {
                embed_decay.unwrap_or(matrix)
            } else {
                matrix
            };
            assert_eq!(spec.decay, want_decay, "{what}: {name}'s group");
            let g = common::full_grad(&layout, &grads, name);
            // FP8 weights step on their F32 masters; plain parameters are their own masters.
            let (w0, w1) = if spec.kind == ParamKind::Fp8Weight {
                (
                    from_shards(&layout, &m_before, name),
                    from_shards(&layout, &m_after, name),
                )
            } else {
                (out[0].0[name].clone(), out[0].4[name].clone())
            };
            let mut apart = false;
            for i in 0..w0.len() {
                let want = first_step(w0[i], g[i], lr, wd, eps, decoupled, want_decay);
                let other = first_step(w0[i], g[i], lr, wd, eps, decoupled, !want_decay);
                let tol = 2e-6 * (w0[i] as f64).abs() + 4e-6 * lr + 1e-12;
                assert!(
                    (w1[i] as f64 - want).abs() <= tol,
                    "{what}: {name}[{i}] = {} after the step, hand computation {want} (w {}, g {})",
                    w1[i],
                    w0[i],
                    g[i]
                );
                apart |= (other - want).abs() > 10.0 * tol;
            }
            assert!(
                apart,
                "{what}: {name}: decay and no decay are distinguishable"
            );
            decayed += usize::from(want_decay);
        }
        assert_eq!(
            decayed,
            if embed_decay == Some(false) { 2 } else { 3 },
            "{what}: the matrices"
        );
    }
}

/// What a rank saw around one optimizer step: parameters before, gradients, FP8 masters before and
/// after, parameters after, the layout.
type DecayStep = (
    BTreeMap<String, Vec<f32>>,
    Vec<[Vec<f32>; 2]>,
    Vec<Vec<f32>>,
    Vec<Vec<f32>>,
    BTreeMap<String, Vec<f32>>,
    Arc<ModelLayout>,
);

fn decay_step<O>(
    model: &mut FsdpModel<TinyLm>,
    opt: &mut O,
    b: &Batch,
    ranks: usize,
) -> TestResult<DecayStep>
where
    O: Optimizer + std::ops::Deref<Target = fsdp_optim::ShardedAdam>,
{
    let before = params_by_name(model)?;
    train_pass(model, b, 1.0 / ranks as f32)?;
    let grads = grad_shards(model.sharded())?;
    let masters_before = master_shards(opt, model.sharded())?;
    step_model(opt, model)?;
    let masters_after = master_shards(opt, model.sharded())?;
    let after = params_by_name(model)?;
    Ok((
        before,
        grads,
        masters_before,
        masters_after,
        after,
        model.layout().clone(),
    ))
}

#[test]
fn evaluation_forward_leaves_the_state_alone_and_matches_training() {
    // Dropout with p = 0 keeps every element in training, so the outputs of both modes are comparable
    // while its generator still runs.
    let c = TinyConfig {
        precision: LinearPrecision::Fp8,
        dropout: Some(0.0),
        ..TinyConfig::new(VOCAB, D, 2)
    };
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
        let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
        for step in 0..2 {
            train_pass(&mut model, &batch(rank, 10 + step), 0.5)?;
            step_model(&mut opt, &mut model)?;
        }
        let state = model.export_module_state()?;
        assert!(
            state.values().any(|v| !v.starts_with("3f800000;")),
            "the scales moved off 1"
        );
        let probe = batch(rank, 99);
        let (logits_eval, stats_eval) = eval_pass(&mut model, &probe)?;
        assert_eq!(
            model.export_module_state()?,
            state,
            "metas and counters unchanged"
        );
        assert!(
            model
                .scaling()
                .pending()
                .to_vec()?
                .iter()
                .all(|&a| a == 0.0),
            "no amax recorded"
        );
        for u in 1..model.sharded().num_units() {
            assert!(!model.sharded().is_gathered(u), "unit {u} released");
        }
        // A backward needs a training forward.
        let dev = model.device().clone();
        let labels = dev.upload(&probe.labels)?;
        let e = model
            .backward(|m, ctx| m.backward(ctx, &labels, 1.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("training forward"), "{e}");
        // The training forward of the same batch: the same logits and loss, and it records amaxes and
        // advances the dropout generators.
        let (logits_train, stats_train) = train_pass(&mut model, &probe, 0.5)?;
        assert_eq!(bits(&logits_eval), bits(&logits_train));
        assert_eq!(bits(&stats_eval), bits(&stats_train));
        assert_ne!(model.export_module_state()?, state);
        assert!(model.scaling().pending().to_vec()?.iter().any(|&a| a > 0.0));
        Ok(())
    });
}

#[test]
fn evaluation_loops_of_different_lengths_need_no_collective() {
    // Under gather_all, ranks may run different numbers of evaluation forwards (a validation set that
    // does not divide evenly) without deadlocking, and every pass gives the same output.
    let c = TinyConfig {
        precision: LinearPrecision::Fp8,
        ..TinyConfig::new(VOCAB, D, 2)
    };
    let out = on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
        let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
        train_pass(&mut model, &batch(rank, 1), 0.5)?;
        step_model(&mut opt, &mut model)?;
        model.gather_all()?;
        let probe = batch(0, 5);
        let mut outs = Vec::new();
        for _ in 0..1 + 2 * rank {
            outs.push(bits(&eval_pass(&mut model, &probe)?.0));
        }
        model.release_all()?;
        // Training goes on after the loop.
        train_pass(&mut model, &batch(rank, 2), 0.5)?;
        step_model(&mut opt, &mut model)?;
        Ok(outs)
    });
    assert_eq!(out[0].len(), 1);
    assert_eq!(out[1].len(), 3);
    assert!(
        out.iter().flatten().all(|o| *o == out[0][0]),
        "same weights, same output"
    );
}

#[test]
fn recompute_per_module_trains_bit_identically() {
    // FP8 blocks with dropout: the recomputed forward must see the same scales and draw the same masks.
    let c = TinyConfig {
        precision: LinearPrecision::Fp8,
        dropout: Some(0.25),
        ..TinyConfig::new(VOCAB, D, 3)
    };
    let run = |recompute: bool| {
        on_ranks(2, |comm| {
            let rank = comm.rank();
            let cfg = TinyConfig {
                rank,
                recompute,
                ..c
            };
            let mut model = wrap(cfg, comm, FsdpConfig::default())?;
            let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
            let mut trace = Vec::new();
            for step in 0..3 {
                let (logits, stats) = train_pass(&mut model, &batch(rank, 20 + step), 0.5)?;
                step_model(&mut opt, &mut model)?;
                let params: Vec<(String, Vec<u32>)> = model
                    .gathered_params()?
                    .into_iter()
                    .map(|(n, v)| (n, bits(&v)))
                    .collect();
                trace.push((
                    bits(&logits),
                    bits(&stats),
                    params,
                    model.export_module_state()?,
                ));
            }
            Ok(trace)
        })
    };
    let kept = run(false);
    let recomputed = run(true);
    for (r, (a, b)) in kept.iter().zip(&recomputed).enumerate() {
        for (s, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(x.0, y.0, "rank {r} step {s}: logits");
            assert_eq!(x.1, y.1, "rank {r} step {s}: loss");
            assert_eq!(x.2, y.2, "rank {r} step {s}: weights");
            assert_eq!(x.3, y.3, "rank {r} step {s}: metas and dropout offsets");
        }
    }
    assert_ne!(kept[0][0].0, kept[0][2].0, "the model trains");
}
