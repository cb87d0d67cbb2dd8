//! BF16 gradient shards against F32 shards: the same reduction rounded once per reduction to BF16.

mod common;

use common::*;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::{FsdpConfig, GradDtype, GradReduction, ParamGroup, ShardedModel, WrapPolicy};
use half::bf16;
use proptest::prelude::*;
use std::sync::Arc;

/// One rank's gradient shards (both groups of every unit, widened to f32) after each reduction.
type ShardsPerReduction = Vec<Vec<f32>>;

/// Per rank and reduction: the F32 shards (both groups, concatenated) after each of `micro` synchronised
/// micro-batches, and the BF16 shards after the same reductions.
fn shards_after(
    ws: usize,
    fp8: bool,
    micro: usize,
    seed: u64,
) -> Vec<(ShardsPerReduction, ShardsPerReduction)> {
    let layout = layout(fp8, WrapPolicy::PerModule);
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let mut out = Vec::new();
        for dtype in [GradDtype::F32, GradDtype::Bf16] {
            let cfg = FsdpConfig {
                grad_dtype: dtype,
                ..FsdpConfig::default()
            };
            let (mut model, _) = ShardedModel::new(layout.clone(), comm.clone(), cfg, &init)?;
            let mut after = Vec::new();
            for mb in 0..micro {
                add_random_grads(&mut model, seed + 97 * mb as u64 + 13 * rank as u64)?;
                for u in 0..model.num_units() {
                    model.reduce_grads(u)?;
                }
                after.push(all_shards(&model)?);
            }
            out.push(after);
        }
        let bf = out.pop().unwrap_or_default();
        let f = out.pop().unwrap_or_default();
        Ok::<_, fsdp_shard::ShardError>((f, bf))
    })
    .unwrap()
}

fn add_random_grads(model: &mut ShardedModel, seed: u64) -> Result<(), fsdp_shard::ShardError> {
    let dev = model.device().clone();
    for (k, name) in ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
        .iter()
        .enumerate()
    {
        let n = [HID * IN, HID, OUT * HID, OUT][k];
        // Magnitudes over several binades, so BF16 rounding is exercised at different exponents.
        let g: Vec<f32> = values(seed * 7 + k as u64, n)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i % 9) as i32 - 4))
            .collect();
        model.add_grad(name, &dev.upload(&g)?)?;
    }
    Ok(())
}

fn all_shards(model: &ShardedModel) -> Result<Vec<f32>, fsdp_shard::ShardError> {
    let mut v = Vec::new();
    for u in 0..model.num_units() {
        for g in ParamGroup::ALL {
            v.extend(model.unit(u)?.grad(g).to_f32_vec()?);
        }
    }
    Ok(v)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// One reduction: the BF16 shard is exactly the F32 shard rounded to nearest even. Several
    /// (synchronised micro-batches): BF16 shard = bf16(bf16 shard + F32 chunk) each time, so it stays
    /// within one BF16 half-ulp per reduction of the F32 prefix sums.
    #[test]
    fn bf16_shards_round_the_f32_sums(ws in 1usize..4, fp8 in any::<bool>(), micro in 1usize..4, seed in any::<u64>()) {
        for (f, b) in shards_after(ws, fp8, micro, seed % 1000) {
            let first: Vec<f32> = f[0].iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            prop_assert_eq!(&b[0], &first);
            for i in 0..f[micro - 1].len() {
                let bound: f32 = (0..micro).map(|k| f[k][i].abs().max(b[k][i].abs()) * 2f32.powi(-8)).sum();
                let d = (b[micro - 1][i] - f[micro - 1][i]).abs();
                prop_assert!(d <= bound * 1.0001 + 1e-30, "element {}: |{} - {}| > {}", i, b[micro - 1][i], f[micro - 1][i], bound);
            }
        }
    }
}

/// The gradient category of the memory report holds the real bytes: half with BF16 shards.
#[test]
fn memory_report_counts_bf16_shards() {
    let layout = layout(true, WrapPolicy::PerModule);
    let bytes = run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut r = Vec::new();
        for dtype in [GradDtype::F32, GradDtype::Bf16] {
            let cfg = FsdpConfig {
                grad_dtype: dtype,
                grad_reduction: GradReduction::Bf16,
                ..FsdpConfig::default()
            };
            let (model, _) = ShardedModel::new(layout.clone(), comm.clone(), cfg, &init)?;
            r.push(model.memory()?.grad_shards);
        }
        Ok::<_, fsdp_shard::ShardError>(r)
    })
    .unwrap();
    for r in bytes {
        assert!(r[0] > 0);
        assert_eq!(r[1] * 2, r[0]);
    }
}
