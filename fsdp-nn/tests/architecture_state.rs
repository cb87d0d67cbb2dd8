//! Module state in checkpoints without code per model: the tiny tied model (FP8 blocks, dropout) saves
//! its FP8 scaling metas and dropout offsets (`FsdpModel::export_module_state`) with a sharded checkpoint,
//! trains on, loads them back bit for bit, and resumes exactly as the uninterrupted run; the checkpoint
//! reshards 2 -> 1 ranks with the same module state; the full checkpoint holds every parameter by name
//! (the tied one once).

mod common;

use common::tiny_lm::{train_pass, wrap, Batch, TinyConfig, TinyLm};
use common::{bits, on_ranks, TestResult};
use fsdp_nn::LinearPrecision;
use fsdp_optim::{step_model, AdamOptions, FsdpAdamW, Optimizer};
use fsdp_shard::checkpoint::{load_sharded, read_full, save_full, save_sharded, FullWeights};
use fsdp_shard::{FsdpConfig, FsdpModel};
use std::collections::BTreeMap;
use std::path::PathBuf;

const VOCAB: usize = 24;
const D: usize = 16;
const SAVE_AT: usize = 3;
const STEPS: usize = 5;

fn config() -> TinyConfig {
    TinyConfig {
        precision: LinearPrecision::Fp8,
        dropout: Some(0.25),
        ..TinyConfig::new(VOCAB, D, 3)
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "fsdp-nn-{tag}-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    ));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn step(
    model: &mut FsdpModel<TinyLm>,
    opt: &mut FsdpAdamW,
    rank: usize,
    ranks: usize,
    s: usize,
) -> TestResult<u32> {
    let b = Batch::new(VOCAB, 8, 31 * s as u64 + 1000 * rank as u64);
    let (_, stats) = train_pass(model, &b, 1.0 / ranks as f32)?;
    step_model(opt, model)?;
    Ok(stats[0].to_bits())
}

type Params = Vec<(String, Vec<u32>)>;

fn params(model: &mut FsdpModel<TinyLm>) -> TestResult<Params> {
    Ok(model
        .gathered_params()?
        .into_iter()
        .map(|(n, v)| (n, bits(&v)))
        .collect())
}

struct Uninterrupted {
    losses: Vec<u32>,
    state: BTreeMap<String, String>,
    params: Params,
}

struct Resumed {
    changed: bool,
    state: BTreeMap<String, String>,
    params: Params,
    losses: Vec<u32>,
}

#[test]
fn module_state_round_trips_through_checkpoints() {
    let c = config();
    let dir = temp_dir("module-state");
    let full = dir.join("full.safetensors");
    let full_fp8 = dir.join("full-fp8.safetensors");
    let uninterrupted = on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
        let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
        let mut out = Uninterrupted {
            losses: Vec::new(),
            state: BTreeMap::new(),
            params: Vec::new(),
        };
        for s in 0..STEPS {
            if s == SAVE_AT {
                out.state = model.export_module_state()?;
                out.params = params(&mut model)?;
            }
            out.losses.push(step(&mut model, &mut opt, rank, 2, s)?);
        }
        Ok(out)
    });
    let resumed = on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut model = wrap(TinyConfig { rank, ..c }, comm, FsdpConfig::default())?;
        let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
        for s in 0..SAVE_AT {
            step(&mut model, &mut opt, rank, 2, s)?;
        }
        let saved = model.export_module_state()?;
        let mut extra = saved.clone();
        extra.insert("step".into(), SAVE_AT.to_string());
        save_sharded(&dir, model.sharded(), Some(opt.as_state()), &extra)?;
        save_full(&full, model.sharded_mut(), FullWeights::F32, &extra)?;
        save_full(
            &full_fp8,
            model.sharded_mut(),
            FullWeights::Fp8WithScaleInv,
            &extra,
        )?;
        // Train on: the metas and offsets move away from the saved ones.
        for s in SAVE_AT..STEPS {
            step(&mut model, &mut opt, rank, 2, s)?;
        }
        let changed = model.export_module_state()? != saved;
        let loaded = load_sharded(&dir, model.sharded_mut(), Some(opt.as_state_mut()))?;
        assert_eq!(loaded.extra.get("step").map(String::as_str), Some("3"));
        model.import_module_state(&loaded.extra)?;
        let mut out = Resumed {
            changed,
            state: model.export_module_state()?,
            params: params(&mut model)?,
            losses: Vec::new(),
        };
        for s in SAVE_AT..STEPS {
            out.losses.push(step(&mut model, &mut opt, rank, 2, s)?);
        }
        Ok(out)
    });
    for r in 0..2 {
        let (u, v) = (&uninterrupted[r], &resumed[r]);
        assert!(v.changed, "rank {r}: training on changed the module state");
        assert_eq!(v.state, u.state, "rank {r}: module state after loading");
        assert_eq!(v.params, u.params, "rank {r}: parameters after loading");
        assert_eq!(
            v.losses,
            u.losses[SAVE_AT..],
            "rank {r}: the resumed run continues exactly"
        );
    }
    // The state is what the model holds, named by module path: every block's two metas (moved off
    // scale 1) and its dropout's offset (advanced by the elements of three training forwards).
    let state = &uninterrupted[0].state;
    for b in 0..3 {
        for meta in ["input", "grad_output"] {
            let v = &state[&format!("scaling.h.{b}.fc.{meta}")];
            assert!(!v.starts_with("3f800000;"), "h.{b}.fc.{meta} = {v}");
        }
        let offset = &state[&format!("counter.h.{b}.drop.offset")];
        assert_eq!(offset, &(SAVE_AT * 8 * D).to_string());
    }
    assert_eq!(state.len(), 3 * 3, "two metas and one counter per block");
    // Resharding 2 -> 1: rank 0's module state and every parameter come back.
    let one = on_ranks(1, |comm| {
        let mut model = wrap(c, comm, FsdpConfig::default())?;
        let mut opt = FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
        let loaded = load_sharded(&dir, model.sharded_mut(), Some(opt.as_state_mut()))?;
        assert_eq!(loaded.saved_world_size, 2);
        model.import_module_state(&loaded.extra)?;
        let out = (model.export_module_state()?, params(&mut model)?);
        step(&mut model, &mut opt, 0, 1, SAVE_AT)?;
        Ok(out)
    })
    .remove(0);
    assert_eq!(&one.0, state, "module state resharded to one rank");
    assert_eq!(
        one.1, uninterrupted[0].params,
        "parameters resharded to one rank"
    );
    // The full checkpoints: every parameter by name (the tied matrix once, as `wte.weight`).
    let want: BTreeMap<&str, &Vec<u32>> = uninterrupted[0]
        .params
        .iter()
        .map(|(n, v)| (n.as_str(), v))
        .collect();
    for path in [&full, &full_fp8] {
        let got = read_full(path).expect("full checkpoint");
        let names: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(names, want.keys().copied().collect::<Vec<_>>());
        assert!(!got.contains_key("head.weight"));
        for (name, (_, values)) in &got {
            assert_eq!(
                &bits(values),
                want[name.as_str()],
                "{}: {name}",
                path.display()
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn module_state_of_another_model_is_refused() {
    // An FP8 model cannot take the state of an F32 one (it has no metas to give), naming what is
    // missing; a counter missing from the state is refused the same way.
    let c = config();
    let f32_state = on_ranks(1, |comm| {
        let cfg = TinyConfig {
            precision: LinearPrecision::F32,
            ..c
        };
        let mut model = wrap(cfg, comm, FsdpConfig::default())?;
        Ok(model.export_module_state()?)
    })
    .remove(0);
    assert!(f32_state.keys().all(|k| k.starts_with("counter.")));
    on_ranks(1, |comm| {
        let mut model = wrap(c, comm, FsdpConfig::default())?;
        let e = model
            .import_module_state(&f32_state)
            .unwrap_err()
            .to_string();
        assert!(e.contains("scaling.h.0.fc.input"), "{e}");
        let mut state = model.export_module_state()?;
        state.remove("counter.h.2.drop.offset");
        let e = model.import_module_state(&state).unwrap_err().to_string();
        assert!(e.contains("counter.h.2.drop.offset"), "{e}");
        let mut state = model.export_module_state()?;
        state.insert("counter.h.1.drop.offset".into(), "twelve".into());
        assert!(model.import_module_state(&state).is_err());
        Ok(())
    });
}
