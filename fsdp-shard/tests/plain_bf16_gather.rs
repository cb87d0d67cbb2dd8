//! Plain parameters gathered in BF16 (`FsdpConfig::plain_gather_dtype`): on 1 to 3 thread ranks every
//! gathered plain parameter is its full F32 value rounded to BF16 (nearest even), the gathered bytes of
//! the plain group halve, FP8 weights are untouched, and the exact readers (`gather_exact`, the
//! consolidated checkpoint) see the F32 masters.

mod common;

use common::*;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::checkpoint::{read_full, save_full, FullWeights};
use fsdp_shard::{
    FsdpConfig, GatherDtype, GatheredParam, PlainParam, ShardError, ShardedModel, WrapPolicy,
};
use half::bf16;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Per rank, per parameter: (name, gathered values widened to f32, whether gathered in BF16), and the
/// gathered bytes held with every unit gathered, for a model gathered with `dtype`; with `exact`, gathered by `gather_exact`.
type Gathered = (Vec<(String, Vec<f32>, bool)>, usize);

fn gathered(ws: usize, fp8: bool, dtype: GatherDtype, exact: bool) -> Vec<Gathered> {
    let layout = layout(fp8, WrapPolicy::PerModule);
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let cfg = FsdpConfig {
            plain_gather_dtype: dtype,
            ..FsdpConfig::default()
        };
        let (mut model, _) = ShardedModel::new(layout.clone(), comm, cfg, &init)?;
        let mut out = Vec::new();
        for u in 0..model.num_units() {
            if exact {
                // Gathered the configured way first, so the exact gather has to replace it.
                model.gather(u)?;
                model.gather_exact(u)?;
            } else {
                model.gather(u)?;
            }
        }
        for (p, spec) in layout.params.iter().enumerate() {
            let g = model.param(p)?;
            let bf = matches!(g.as_plain(), Some(PlainParam::Bf16(_)));
            out.push((spec.name.clone(), g.to_f32_vec()?, bf));
        }
        Ok::<_, ShardError>((out, model.memory()?.gathered))
    })
    .unwrap()
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

#[test]
fn plain_parameters_gather_as_their_bf16_rounding_on_every_rank() {
    for ws in 1..=3 {
        for fp8 in [false, true] {
            let f32_runs = gathered(ws, fp8, GatherDtype::F32, false);
            let bf_runs = gathered(ws, fp8, GatherDtype::Bf16, false);
            for (rank, ((f, f_peak), (b, b_peak))) in f32_runs.iter().zip(&bf_runs).enumerate() {
                for (p, ((name, fv, f_bf), (_, bv, b_bf))) in f.iter().zip(b).enumerate() {
                    assert!(!f_bf, "{name}: gathered in BF16 under the F32 setting");
                    let plain = !fp8 || name.ends_with("bias");
                    if plain {
                        // The F32 gather is the initial value itself; the BF16 one its rounding.
                        assert_eq!(fv, &init(p), "ws {ws} rank {rank} {name}: F32 gather");
                        assert!(b_bf, "ws {ws} rank {rank} {name}: not gathered in BF16");
                        assert_eq!(
                            bv,
                            &bf16_round(fv),
                            "ws {ws} rank {rank} {name}: BF16 gather"
                        );
                    } else {
                        assert!(!b_bf, "{name}: an FP8 weight reported as plain");
                        assert_eq!(fv, bv, "ws {ws} rank {rank} {name}: FP8 weight changed");
                    }
                }
                assert!(
                    b_peak < f_peak,
                    "ws {ws} rank {rank}: gathered bytes {b_peak} in BF16 against {f_peak} in F32"
                );
            }
        }
    }
}

#[test]
fn exact_gathers_replace_bf16_ones_with_the_f32_masters() {
    for ws in [1, 2] {
        let exact = gathered(ws, true, GatherDtype::Bf16, true);
        let reference = gathered(ws, true, GatherDtype::F32, false);
        for ((e, _), (r, _)) in exact.iter().zip(&reference) {
            for ((name, ev, e_bf), (_, rv, _)) in e.iter().zip(r) {
                assert!(!e_bf, "{name}: still BF16 after gather_exact");
                assert_eq!(ev, rv, "ws {ws} {name}");
            }
        }
    }
}

#[test]
fn a_consolidated_checkpoint_holds_the_f32_masters_under_bf16_gathers() {
    let layout = layout(false, WrapPolicy::PerModule);
    let dir = std::env::temp_dir().join(format!("plain-bf16-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("full.safetensors");
    let saved = run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let cfg = FsdpConfig {
            plain_gather_dtype: GatherDtype::Bf16,
            ..FsdpConfig::default()
        };
        let (mut model, _) = ShardedModel::new(layout.clone(), comm, cfg, &init)?;
        // A unit left gathered in BF16 (as compute leaves it) must not leak into the file.
        model.gather(0)?;
        let plain_bf16 = matches!(model.param(0)?, GatheredParam::PlainBf16(_));
        save_full(&path, &mut model, FullWeights::F32, &BTreeMap::new())?;
        Ok::<_, ShardError>(plain_bf16)
    })
    .unwrap();
    assert!(
        saved.iter().all(|&b| b),
        "unit 0 was not gathered in BF16 before the save"
    );
    let full = read_full(&path).unwrap();
    for (p, spec) in layout.params.iter().enumerate() {
        assert_eq!(full[&spec.name].1, init(p), "{}", spec.name);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
