//! Sharded training on N thread ranks against the same training on one rank with the whole batch.

mod common;

use common::*;
use fp8_core::Fp8Format;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::{
    FsdpConfig, GradReduction, ParamGroup, ShardError, ShardedModel, WrapPolicy, ALIGN,
};
use std::sync::Arc;

const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];

#[test]
fn gather_returns_the_original_parameters() {
    for fp8 in [false, true] {
        for policy in [
            WrapPolicy::PerModule,
            WrapPolicy::Single,
            WrapPolicy::MinParams(100),
        ] {
            let layout = layout(fp8, policy.clone());
            for ws in WORLD_SIZES {
                let out = run_ranks(ws, |comm: ThreadComm| {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let (mut model, _) =
                        ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
                    let mut all = Vec::new();
                    for u in 0..model.num_units() {
                        model.gather(u)?;
                        let shards = model.unit(u)?;
                        // Equal shards on every rank, starting aligned.
                        assert_eq!(shards.fp8.len() % ALIGN, 0);
                        assert_eq!(shards.plain.len() % ALIGN, 0);
                    }
                    for name in ["l1.weight", "l1.bias", "l2.weight", "l2.bias"] {
                        all.push(param_f32(&model, name));
                    }
                    Ok::<_, ShardError>(all)
                })
                .unwrap();
                for (p, got) in out[0].iter().enumerate() {
                    let want = init(p);
                    if fp8 && (p == 0 || p == 2) {
                        // The FP8 weight is the E4M3 rounding of the initial values at their own scale.
                        let amax = fp8_core::amax_f32(&want);
                        let s = fp8_core::compute_scale(amax, 448.0, 0, Default::default(), 1.0);
                        for (g, w) in got.iter().zip(&want) {
                            assert_eq!(
                                *g,
                                Fp8Format::E4M3.decode(Fp8Format::E4M3.encode(w * s)) / s
                            );
                        }
                    } else {
                        assert_eq!(got, &want, "param {p} ws {ws} policy {policy:?}");
                    }
                }
                for r in &out {
                    assert_eq!(r, &out[0], "every rank gathers the same values");
                }
            }
        }
    }
}

#[test]
fn tiny_parameters_and_empty_shards() {
    // A model whose only FP8 weight is smaller than the world size: most ranks hold only padding.
    let params = vec![
        fsdp_shard::ParamSpec::new("t", "weight", &[1, 3], fsdp_shard::ParamKind::Fp8Weight),
        fsdp_shard::ParamSpec::new("t", "bias", &[1], fsdp_shard::ParamKind::Plain),
    ];
    let layout = Arc::new(fsdp_shard::ModelLayout::new(params, &WrapPolicy::Single).unwrap());
    let out = run_ranks(8, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let init = |p: usize| {
            if p == 0 {
                vec![0.5, -1.0, 2.0]
            } else {
                vec![3.0]
            }
        };
        let (mut model, masters) =
            ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
        let segments = model.fp8_segments(0)?;
        model.gather(0)?;
        let w = param_f32(&model, "t.weight");
        let b = param_f32(&model, "t.bias");
        Ok::<_, ShardError>((segments.len(), masters[0].len(), w, b))
    })
    .unwrap();
    assert_eq!(out[0].0, 1, "rank 0 holds the weight");
    assert!(
        out[1..].iter().all(|o| o.0 == 0),
        "the others hold only padding"
    );
    for o in &out {
        assert_eq!(
            o.1, 16,
            "shard length: padded to 16 * 8 elements, 16 per rank"
        );
        assert_eq!(o.2, vec![0.5, -1.0, 2.0]);
        assert_eq!(o.3, vec![3.0]);
    }
}

#[test]
fn f32_step_on_n_ranks_matches_one_rank() {
    let reference = train(1, false, FsdpConfig::default(), 3, 48, 1);
    for ws in [2, 3, 4, 8] {
        let batch = 48; // divisible by every world size used
        let got = train(ws, false, FsdpConfig::default(), 3, batch, 1);
        let d = rel_diff(&got[0].0, &reference[0].0);
        assert!(d < 1e-5, "ws {ws}: relative difference {d:e}");
        // Bitwise reproducible at equal world size.
        let again = train(ws, false, FsdpConfig::default(), 3, batch, 1);
        assert_eq!(again[0].0, got[0].0, "ws {ws}: not bitwise reproducible");
    }
}

#[test]
fn fp8_step_on_n_ranks_matches_one_rank_and_metas_agree() {
    let reference = train(1, true, FsdpConfig::default(), 3, 48, 1);
    for ws in [2, 3, 4, 8] {
        let got = train(ws, true, FsdpConfig::default(), 3, 48, 1);
        for r in &got {
            assert_eq!(r.1, got[0].1, "ws {ws}: weight scales differ between ranks");
            assert_eq!(r.0, got[0].0, "ws {ws}: FP8 weights differ between ranks");
        }
        // Masters differ only by F32 summation order; an FP8 code can flip at a rounding boundary, so the
        // bound is a fraction of one E4M3 step (2^-4 relative) rather than F32 precision.
        let d = rel_diff(&got[0].0, &reference[0].0);
        assert!(d < 2e-3, "ws {ws}: relative difference {d:e}");
    }
}

#[test]
fn fp8_gradient_reduction_is_close_to_exact() {
    let exact = train(4, true, FsdpConfig::default(), 2, 48, 1);
    let mut report = Vec::new();
    for format in Fp8Format::ALL {
        let cfg = FsdpConfig {
            grad_reduction: GradReduction::Fp8(format),
            ..FsdpConfig::default()
        };
        let got = train(4, true, cfg, 2, 48, 1);
        for r in &got {
            assert_eq!(r.0, got[0].0, "{format}: ranks disagree");
        }
        let d = rel_diff(&got[0].0, &exact[0].0);
        report.push((format, d));
        assert!(d > 0.0, "{format}: FP8 reduction cannot be exact here");
        assert!(d < 0.05, "{format}: relative difference {d:e}");
    }
    for format in Fp8Format::ALL {
        let cfg = FsdpConfig {
            grad_reduction: GradReduction::Fp8Block(format),
            ..FsdpConfig::default()
        };
        let got = train(4, true, cfg, 2, 48, 1);
        for r in &got {
            assert_eq!(r.0, got[0].0, "block {format}: ranks disagree");
        }
        let d = rel_diff(&got[0].0, &exact[0].0);
        report.push((format, d));
        assert!(d > 0.0, "block {format}: FP8 exchange cannot be exact here");
        assert!(d < 0.05, "block {format}: relative difference {d:e}");
    }
    let bf16 = FsdpConfig {
        grad_reduction: GradReduction::Bf16,
        ..FsdpConfig::default()
    };
    let got = train(4, true, bf16, 2, 48, 1);
    let d = rel_diff(&got[0].0, &exact[0].0);
    assert!(d < 1e-2, "bf16: relative difference {d:e}");
    // Per-tensor E4M3, E5M2, then block E4M3, E5M2.
    println!("weights after 2 steps vs exact reduction: {report:?}, bf16 {d:e}");
}

#[test]
fn accumulation_matches_the_big_batch() {
    for fp8 in [false, true] {
        let big = train(2, fp8, FsdpConfig::default(), 2, 48, 1);
        let acc = train(2, fp8, FsdpConfig::default(), 2, 48, 4);
        let d = rel_diff(&acc[0].0, &big[0].0);
        let bound = if fp8 { 2e-3 } else { 1e-5 };
        assert!(d < bound, "fp8 {fp8}: accumulation differs by {d:e}");
    }
}

#[test]
fn no_sync_accumulation_matches_reduce_every_micro_batch() {
    let layout = layout(false, WrapPolicy::PerModule);
    let out = run_ranks(3, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let mut results = Vec::new();
        for no_sync in [false, true] {
            let (mut model, masters) =
                ShardedModel::new(layout.clone(), comm.clone(), FsdpConfig::default(), &init)?;
            let mut sgd = Sgd { lr: 0.1, masters };
            let (x, t) = batch(0, 48);
            let rows = local_rows(rank, 3, 48);
            for mb in 0..4 {
                let r = rows.start + mb * 4..rows.start + (mb + 1) * 4;
                model.set_grad_sync(!no_sync || mb == 3);
                forward_backward_rows(&mut model, (&x, &t), r, 48)?;
                if no_sync && mb < 3 {
                    // Nothing was communicated yet: the shards are still zero.
                    let g = model.unit(0)?.grads[ParamGroup::Plain as usize].to_vec()?;
                    assert!(g.iter().all(|v| *v == 0.0));
                }
            }
            sgd.step(&mut model)?;
            results.push(snapshot(&mut model)?.0);
        }
        Ok::<_, ShardError>(results)
    })
    .unwrap();
    let d = rel_diff(&out[0][1], &out[0][0]);
    assert!(d < 1e-6, "no-sync vs per-micro-batch reduction: {d:e}");
}

#[test]
fn memory_report_counts_shards() {
    let layout = layout(true, WrapPolicy::PerModule);
    let reports = run_ranks(4, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (mut model, _) = ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
        let before = model.memory()?;
        model.gather(0)?;
        let during = model.memory()?;
        model.release(0)?;
        Ok::<_, ShardError>((before, during, model.memory()?))
    })
    .unwrap();
    let (before, during, after) = &reports[0];
    // FP8 weights: one byte per element of a quarter of the padded group, plus 2 f32 scales per weight.
    let l1 = layout.units[0].group(ParamGroup::Fp8).shard_len(4);
    let l2 = layout.units[1].group(ParamGroup::Fp8).shard_len(4);
    assert_eq!(before.fp8_weight_shards, l1 + l2 + 2 * 2 * 4);
    assert_eq!(before.gathered, 0);
    assert!(during.gathered > 0);
    assert_eq!(after.gathered, 0);
    // The peak includes the flat buffers that exist while parameters are cut out of them: both while
    // the FP8 group is cut, the plain group's alone after (each flat buffer is freed after its cut).
    let (g8, gp) = (
        layout.units[0].group(ParamGroup::Fp8),
        layout.units[0].group(ParamGroup::Plain),
    );
    let (flat8, flatp) = (g8.padded_len(4), 4 * gp.padded_len(4));
    let cut8 = g8.slots[0].numel + 2 * 4;
    let cutp = 4 * gp.slots[0].numel;
    assert_eq!(during.gathered, cut8 + cutp);
    assert_eq!(
        after.peak_gathered,
        (flat8 + flatp + cut8).max(flatp + cut8 + cutp)
    );
}

#[test]
fn one_rank_gradients_go_straight_into_the_shards() {
    let names = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"];
    let grads: Vec<Vec<f32>> = (0..names.len())
        .map(|p| values(100 + p as u64, init(p).len()))
        .collect();
    // One rank with FP8 weights reduced in FP8: only the plain group may skip its full buffer.
    let fp8_wire = FsdpConfig {
        grad_reduction: GradReduction::Fp8(Fp8Format::E5M2),
        ..FsdpConfig::default()
    };
    for (ws, fp8, config, divisor) in [
        (1, false, FsdpConfig::default(), 1.0),
        (1, true, FsdpConfig::default(), 1.0),
        (1, true, FsdpConfig::default(), 2.0),
        (1, true, fp8_wire, 1.0),
        (2, false, FsdpConfig::default(), 1.0),
    ] {
        let layout = layout(fp8, WrapPolicy::PerModule);
        let (grads, names) = (&grads, &names);
        let out = run_ranks(ws, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let (mut model, _) = ShardedModel::new(layout.clone(), comm, config.clone(), &init)?;
            model.set_grad_divisor(divisor)?;
            let dev = model.device().clone();
            let direct = [ParamGroup::Fp8, ParamGroup::Plain].map(|g| model.grads_go_to_shards(g));
            for (name, g) in names.iter().zip(grads) {
                model.add_grad(name, &dev.upload(g)?)?;
            }
            let full = model.memory()?.full_grads;
            // A divisor change would divide what is already in the shards or not: refused until the
            // gradients are reduced.
            let refused = model.set_grad_divisor(divisor * 2.0).is_err();
            model.set_grad_divisor(divisor)?;
            let mut shards = Vec::new();
            for u in 0..model.num_units() {
                model.reduce_grads(u)?;
                let s = model.unit(u)?;
                shards.push([s.grads[0].to_vec()?, s.grads[1].to_vec()?]);
            }
            model.set_grad_divisor(divisor * 2.0)?;
            Ok::<_, ShardError>((direct, full, refused, shards))
        })
        .unwrap();
        let (direct, full, refused, shards) = &out[0];
        let want_direct = [
            ws == 1 && divisor == 1.0 && config.grad_reduction == GradReduction::F32,
            ws == 1 && divisor == 1.0,
        ];
        assert_eq!(*direct, want_direct, "ws {ws} fp8 {fp8} divisor {divisor}");
        // The full buffers held: none for the groups that go to the shards; on one rank with an F32
        // reduction one per parameter (no padding); else the group's flat buffer.
        let f32_wire =
            |g: ParamGroup| g == ParamGroup::Plain || config.grad_reduction == GradReduction::F32;
        let want_full: usize = layout
            .units
            .iter()
            .flat_map(|u| {
                [ParamGroup::Fp8, ParamGroup::Plain]
                    .into_iter()
                    .filter(|g| !direct[*g as usize] && !u.group(*g).is_empty())
                    .map(|g| match ws == 1 && f32_wire(g) {
                        true => 4 * u.group(g).slots.iter().map(|s| s.numel).sum::<usize>(),
                        false => 4 * u.group(g).padded_len(ws),
                    })
            })
            .sum();
        assert_eq!(*full, want_full, "ws {ws} fp8 {fp8} divisor {divisor}");
        assert_eq!(*refused, direct.contains(&true), "divisor change refused");
        if ws == 1 {
            // Every parameter's gradient, divided, at its offset in its group's shard, whichever buffer
            // it went through (a power-of-two divisor divides exactly; the FP8 wire rounds).
            for (p, g) in grads.iter().enumerate() {
                let (u, grp, slot) = layout.locate(p).unwrap();
                let got = &shards[u][grp as usize][slot.offset..slot.offset + slot.numel];
                let want: Vec<f32> = g.iter().map(|v| v / divisor).collect();
                if grp == ParamGroup::Fp8 && config.grad_reduction != GradReduction::F32 {
                    let d = rel_diff(&[got.to_vec()], &[want]);
                    assert!(
                        d > 0.0 && d < 0.1,
                        "{}: FP8-wire gradient off by {d:e}",
                        names[p]
                    );
                } else {
                    assert_eq!(got, &want[..], "{}", names[p]);
                }
            }
        }
    }
}

#[test]
fn one_rank_full_gradients_are_made_per_parameter_on_first_use() {
    // One rank with BF16 shards (which a GEMM cannot accumulate into): each parameter's full gradient
    // is made when its first gradient comes, so a parameter without a gradient yet holds nothing; the
    // reduction adds each into the shard with the divisor, as the flat path does.
    let layout = layout(false, WrapPolicy::Single);
    let config = FsdpConfig {
        grad_dtype: fsdp_shard::GradDtype::Bf16,
        ..FsdpConfig::default()
    };
    let out = run_ranks(1, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (mut model, _) = ShardedModel::new(layout.clone(), comm, config.clone(), &init)?;
        model.set_grad_divisor(4.0)?;
        let dev = model.device().clone();
        let mut held = Vec::new();
        for (name, n) in [("l2.bias", OUT), ("l2.weight", OUT * HID)] {
            model.add_grad(name, &dev.upload(&vec![2.0f32; n])?)?;
            held.push(model.memory()?.full_grads);
        }
        model.add_grad("l2.bias", &dev.upload(&[1.0f32; OUT])?)?;
        held.push(model.memory()?.full_grads);
        model.reduce_grads(0)?;
        held.push(model.memory()?.full_grads);
        let g = model.unit(0)?.grad(ParamGroup::Plain).to_f32_vec()?;
        Ok::<_, ShardError>((held, g))
    })
    .unwrap();
    let (held, g) = &out[0];
    assert_eq!(
        *held,
        [4 * OUT, 4 * OUT + 4 * OUT * HID, 4 * OUT + 4 * OUT * HID, 0]
    );
    let (_, _, bias) = layout
        .locate(layout.param_index("l2.bias").unwrap())
        .unwrap();
    let (_, _, weight) = layout
        .locate(layout.param_index("l2.weight").unwrap())
        .unwrap();
    // (2 + 1) / 4 and 2 / 4, exact in BF16; the parameters without a gradient stay zero.
    assert!(g[bias.offset..bias.offset + OUT].iter().all(|&v| v == 0.75));
    assert!(g[weight.offset..weight.offset + OUT * HID]
        .iter()
        .all(|&v| v == 0.5));
    let nonzero = g.iter().filter(|&&v| v != 0.0).count();
    assert_eq!(nonzero, OUT + OUT * HID);
}
