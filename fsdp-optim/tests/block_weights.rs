//! Adam over block-scaled FP8 weights (thread ranks): each rank quantizes its own block rows from its
//! master after the step, so the codes and block scales every rank holds equal a local 128x128
//! quantization of the full master bit for bit, at every world size, with F32 and low-precision states,
//! and on skipped steps nothing changes.

mod common;

use common::{set_grads, values};
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_optim::{AdamOptions, OptimError, ShardedAdam, StatePrecision};
use fsdp_shard::{
    quantize_block_rows, FsdpConfig, ModelLayout, ParamGroup, ParamKind, ParamSpec, ShardedModel,
    WrapPolicy,
};
use std::sync::Arc;

fn layout() -> Arc<ModelLayout> {
    let k = ParamKind::Fp8BlockWeight;
    let params = vec![
        ParamSpec::new("a", "weight", &[300, 144], k),
        ParamSpec::new("a", "bias", &[300], ParamKind::Plain),
        ParamSpec::new("b", "weight", &[256, 96], k),
        ParamSpec::new("c", "weight", &[16, 272], k),
    ];
    Arc::new(ModelLayout::new(params, &WrapPolicy::PerModule).unwrap())
}

/// Per unit: the master, codes and block scales of every rank's real rows, concatenated in rank order.
type Full = Vec<(Vec<f32>, Vec<u8>, Vec<f32>)>;

fn run(ws: usize, precision: StatePrecision, steps: usize, poison_step: Option<usize>) -> Full {
    let layout = layout();
    let ranks = run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let init = |p: usize| {
            let n = layout.params[p].numel();
            values(11 + p as u64, n)
                .into_iter()
                .map(|v| v * 0.05)
                .collect()
        };
        let (mut model, masters) =
            ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
        let options = AdamOptions {
            lr: 1e-2,
            state_precision: precision,
            ..AdamOptions::adamw()
        };
        let mut opt = ShardedAdam::new(
            &model,
            masters,
            options,
            fp8_kernels::WeightDecay::Decoupled,
        )?;
        for t in 0..steps {
            let grads: Vec<Vec<f32>> = (0..layout.params.len())
                .map(|p| {
                    let n = layout.params[p].numel();
                    let mut g = values(1000 * t as u64 + p as u64, n);
                    if poison_step == Some(t) && p == 2 && rank == 0 {
                        g[5] = f32::NAN;
                    }
                    g
                })
                .collect();
            set_grads(&mut model, &grads)?;
            opt.step_with_report(&mut model)?;
        }
        let mut out = Vec::new();
        for u in 0..model.num_units() {
            let g = layout.units[u].group(ParamGroup::Fp8);
            let n = g.shard_range(rank, ws).len();
            let ns = g.scale_range(rank, ws).len();
            let s = model.unit(u)?;
            let master = opt.fp8_master_shard(u)?;
            out.push((
                master[..n].to_vec(),
                s.fp8.to_vec()?[..n].to_vec(),
                s.block_scales.to_vec()?[..ns].to_vec(),
            ));
        }
        Ok::<_, OptimError>(out)
    })
    .unwrap();
    (0..layout.units.len())
        .map(|u| {
            let mut full = (Vec::new(), Vec::new(), Vec::new());
            for r in &ranks {
                full.0.extend_from_slice(&r[u].0);
                full.1.extend_from_slice(&r[u].1);
                full.2.extend_from_slice(&r[u].2);
            }
            full
        })
        .collect()
}

/// The codes and scales of each unit's block weights from its full master, quantized locally.
fn check_local_quantization(full: &Full, what: &str) {
    let layout = layout();
    for (u, (master, codes, scales)) in full.iter().enumerate() {
        let g = layout.units[u].group(ParamGroup::Fp8);
        for (slot, b) in g.slots.iter().zip(g.block_scales()) {
            let m = &master[slot.offset..slot.offset + slot.numel];
            let (want_codes, want_scales) = quantize_block_rows(m, slot.cols).unwrap();
            assert_eq!(
                &codes[slot.offset..slot.offset + slot.numel],
                &want_codes[..],
                "{what}: codes of unit {u}"
            );
            assert_eq!(
                &scales[b.offset..b.offset + b.len()],
                &want_scales[..],
                "{what}: block scales of unit {u}"
            );
        }
    }
}

#[test]
fn block_weights_are_the_local_quantization_of_the_master_at_every_world_size() {
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        let one = run(1, precision, 3, None);
        check_local_quantization(&one, &format!("{precision:?} world size 1"));
        for ws in [2, 3, 4] {
            let many = run(ws, precision, 3, None);
            check_local_quantization(&many, &format!("{precision:?} world size {ws}"));
            // Adam is element-wise and the gradients are set directly: the same bits at every size.
            assert_eq!(many, one, "{precision:?}: world size {ws} against 1");
        }
    }
}

#[test]
fn a_skipped_step_leaves_block_weights_unchanged() {
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        let before = run(2, precision, 2, None);
        let skipped = run(2, precision, 3, Some(2));
        assert_eq!(skipped, before, "{precision:?}");
        check_local_quantization(&skipped, "skipped");
    }
}
