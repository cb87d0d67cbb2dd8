//! Checkpoint round trips at equal and different world sizes, and corrupted checkpoints.

mod common;

use common::*;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::checkpoint::{
    load_sharded, read_commit, read_full, save_full, save_sharded, FullWeights,
};
use fsdp_shard::{FsdpConfig, ShardError, ShardedModel, WrapPolicy};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "fsdp-ckpt-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Trains 2 steps on `ws` ranks and saves; returns the snapshot and the masters gathered to full length.
fn train_and_save(dir: &Path, ws: usize) -> Snapshot {
    let layout = layout(true, WrapPolicy::MinParams(100));
    let out = run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let (mut model, masters) =
            ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
        let mut sgd = Sgd { lr: 0.05, masters };
        for step in 0..2 {
            let (x, t) = batch(step, 24);
            let r = local_rows(rank, ws, 24);
            forward_backward_rows(&mut model, (&x, &t), r, 24)?;
            sgd.step(&mut model)?;
        }
        let mut extra = BTreeMap::new();
        extra.insert("step".to_string(), "2".to_string());
        extra.insert("rng".to_string(), format!("rank-{rank}-state"));
        save_sharded(dir, &model, Some(&sgd), &extra)?;
        snapshot(&mut model)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// Parameters right after loading and after one more step.
type BeforeAfter = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Loads at `ws` ranks, checks the metadata, trains one more step; returns the snapshot before and after.
fn load_and_continue(dir: &Path, ws: usize) -> Result<Vec<BeforeAfter>, ShardError> {
    let layout = layout(true, WrapPolicy::MinParams(100));
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        // Different initial values: everything must come from the checkpoint.
        let other = |p: usize| init(p).into_iter().map(|v| v * -3.0).collect();
        let (mut model, masters) =
            ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &other)?;
        let mut sgd = Sgd { lr: 0.05, masters };
        let loaded = load_sharded(dir, &mut model, Some(&mut sgd))?;
        assert_eq!(loaded.extra["step"], "2");
        if loaded.saved_world_size == ws {
            assert_eq!(loaded.extra["rng"], format!("rank-{rank}-state"));
        }
        let before = snapshot(&mut model)?.0;
        let (x, t) = batch(2, 24);
        let r = local_rows(rank, ws, 24);
        forward_backward_rows(&mut model, (&x, &t), r, 24)?;
        sgd.step(&mut model)?;
        Ok((before, snapshot(&mut model)?.0))
    })
}

#[test]
fn round_trip_at_equal_and_different_world_sizes() {
    for (n, m) in [(2, 2), (2, 3), (4, 1), (3, 8), (1, 4)] {
        let dir = temp_dir(&format!("rt{n}{m}"));
        let (saved, _) = train_and_save(&dir, n);
        let runs = load_and_continue(&dir, m).unwrap();
        assert_eq!(runs[0].0, saved, "{n} -> {m}: loaded parameters differ");
        for r in &runs {
            assert_eq!(r.1, runs[0].1, "{n} -> {m}: ranks disagree after a step");
        }
        // Continuing after the load matches continuing on the original world size without a checkpoint.
        let cont = load_and_continue(&dir, n).unwrap();
        let d = rel_diff(&runs[0].1, &cont[0].1);
        assert!(d < 2e-3, "{n} -> {m}: continued training differs by {d:e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn full_checkpoint_holds_every_parameter() {
    let layout = layout(true, WrapPolicy::PerModule);
    let dir = temp_dir("full");
    for weights in [FullWeights::F32, FullWeights::Fp8WithScaleInv] {
        let path = dir.join(format!("{weights:?}.safetensors"));
        let snaps = run_ranks(3, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let (mut model, _) =
                ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
            save_full(&path, &mut model, weights, &BTreeMap::new())?;
            snapshot(&mut model)
        })
        .unwrap();
        let full = read_full(&path).unwrap();
        for (i, name) in ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
            .iter()
            .enumerate()
        {
            assert_eq!(full[*name].1, snaps[0].0[i], "{weights:?} {name}");
        }
        assert_eq!(full["l1.weight"].0, vec![HID, IN]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn expect_load_error(dir: &Path, ws: usize) -> String {
    match load_and_continue(dir, ws) {
        Ok(_) => panic!("a bad checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn incomplete_foreign_and_mismatched_checkpoints_are_errors() {
    let dir = temp_dir("bad");
    train_and_save(&dir, 2);
    // Missing rank file.
    let commit = read_commit(&dir).unwrap();
    let f1 = commit.shard_file(1);
    let bytes = std::fs::read(&f1).unwrap();
    std::fs::remove_file(&f1).unwrap();
    assert!(expect_load_error(&dir, 2).contains("rank-00001-of-00002"));
    std::fs::write(&f1, &bytes).unwrap();
    // A rank file swapped with another rank's.
    let f0 = commit.shard_file(0);
    let b0 = std::fs::read(&f0).unwrap();
    std::fs::write(&f0, &bytes).unwrap();
    assert!(expect_load_error(&dir, 2).contains("rank 1 of 2"));
    std::fs::write(&f0, &b0).unwrap();
    // A checkpoint of a different model.
    let other = temp_dir("other");
    let params = vec![fsdp_shard::ParamSpec::new(
        "z",
        "w",
        &[3, 3],
        fsdp_shard::ParamKind::Plain,
    )];
    let l = Arc::new(fsdp_shard::ModelLayout::new(params, &WrapPolicy::Single).unwrap());
    run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (model, _) =
            ShardedModel::new(l.clone(), comm, FsdpConfig::default(), &|_| vec![1.0; 9])?;
        save_sharded(&other, &model, None, &BTreeMap::new())
    })
    .unwrap();
    assert!(expect_load_error(&other, 2).contains("different model"));
    // No index: an incomplete save.
    std::fs::remove_file(other.join("index.json")).unwrap();
    assert!(expect_load_error(&other, 2).contains("index.json"));
    std::fs::remove_dir_all(&other).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn corrupted_rank_files_are_errors(cut_frac in 0.0f64..1.0, flip_frac in 0.0f64..1.0, bit in 0u8..8) {
        let dir = temp_dir("prop");
        train_and_save(&dir, 2);
        let f = read_commit(&dir).unwrap().shard_file(1);
        let good = std::fs::read(&f).unwrap();
        // Truncation anywhere.
        let cut = ((good.len() as f64) * cut_frac) as usize;
        std::fs::write(&f, &good[..cut]).unwrap();
        prop_assert!(load_and_continue(&dir, 2).is_err());
        // One flipped bit anywhere: the header's JSON breaks, or the header's or a tensor's checksum
        // fails. Every byte is covered, metadata (step, data position, random state) included.
        let mut bad = good.clone();
        let pos = ((good.len() - 1) as f64 * flip_frac) as usize;
        bad[pos] ^= 1 << bit;
        std::fs::write(&f, &bad).unwrap();
        let r = load_and_continue(&dir, 3);
        prop_assert!(r.is_err(), "a flip of bit {} at byte {} was accepted", bit, pos);
        let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
        prop_assert!(msg.contains("rank-00001-of-00002"), "{}", msg);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
