//! The checks a training run makes before and around its work (issue: reliability): settings that decide
//! the numerics must match on resume (the error names the flag), changed hyperparameters are accepted and
//! recorded, zero values of count flags are refused, a second writer of a checkpoint directory is refused,
//! a crash between an epoch's checkpoint and its metrics line leaves neither a gap nor a duplicate, and a
//! CPU run started by a multi-process launcher refuses to run duplicate jobs.

use fsdp_examples::data::committed_subset_dir;
use fsdp_examples::metrics::read_metrics;
use fsdp_examples::mnist::{train, DeviceChoice, MnistError, TrainConfig};
use fsdp_examples::progress::ProgressMode;
use fsdp_nn::LinearPrecision;
use fsdp_shard::checkpoint::CheckpointLock;
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mnist-run-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small(dir: &std::path::Path) -> TrainConfig {
    TrainConfig {
        epochs: 1,
        batch_size: 8,
        test_batch_size: 500,
        world_size: 2,
        device: DeviceChoice::Cpu,
        data_dir: committed_subset_dir(),
        progress: ProgressMode::Hidden,
        print: false,
        threads_per_rank: Some(1),
        limit_batches: Some(3),
        save: Some(dir.join("ckpt")),
        metrics: Some(dir.join("metrics.jsonl")),
        ..TrainConfig::default()
    }
}

#[test]
fn a_resume_with_other_numerics_names_the_flag_and_a_changed_lr_is_recorded() {
    let dir = tmp("resume");
    let base = small(&dir);
    train(&base).unwrap();
    let ckpt = base.save.clone();
    let e = train(&TrainConfig {
        precision: LinearPrecision::F32,
        resume: ckpt.clone(),
        save: None,
        metrics: None,
        epochs: 2,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--precision") && e.contains("Fp8") && e.contains("F32"),
        "{e}"
    );
    let e = train(&TrainConfig {
        seed: 7,
        resume: ckpt.clone(),
        save: None,
        metrics: None,
        epochs: 2,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("--seed 1") && e.contains("--seed 7"), "{e}");
    // A learning rate may change: accepted, and the next epoch's record says so.
    train(&TrainConfig {
        lr: 5e-4,
        resume: ckpt,
        epochs: 2,
        ..base.clone()
    })
    .unwrap();
    let m = read_metrics(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(m.iter().map(|r| r.epoch).collect::<Vec<_>>(), [1, 2]);
    let note = m[1].extra.get("resumed_changes").map(|v| v.to_string());
    assert!(
        note.as_deref().is_some_and(|n| n.contains("--lr")),
        "{note:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn zero_counts_are_refused_naming_the_flag() {
    let dir = tmp("zeros");
    let base = small(&dir);
    for (config, flag) in [
        (
            TrainConfig {
                threads_per_rank: Some(0),
                ..base.clone()
            },
            "--threads-per-rank",
        ),
        (
            TrainConfig {
                stop_after_steps: Some(0),
                ..base.clone()
            },
            "--stop-after-steps",
        ),
        (
            TrainConfig {
                save_every_steps: Some(0),
                ..base.clone()
            },
            "--save-every",
        ),
    ] {
        let e = train(&config).unwrap_err().to_string();
        assert!(e.contains(flag), "{flag}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_second_writer_is_refused_before_training() {
    let dir = tmp("lock");
    let base = small(&dir);
    let save = base.save.clone().unwrap();
    let held = CheckpointLock::acquire(&save).unwrap();
    let started = std::time::Instant::now();
    let e = train(&base).unwrap_err();
    assert!(matches!(e, MnistError::Setup(_)), "{e}");
    assert!(e.to_string().contains("in use"), "{e}");
    assert!(started.elapsed().as_secs() < 5, "refused only after work");
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_crash_between_checkpoint_and_metrics_line_leaves_one_line_per_epoch() {
    let dir = tmp("metrics");
    let base = TrainConfig {
        epochs: 2,
        ..small(&dir)
    };
    let path = dir.join("metrics.jsonl");
    train(&base).unwrap();
    let full = read_metrics(&path).unwrap();
    assert_eq!(full.len(), 2);
    // The crash: epoch 2's checkpoint is committed, its metrics line never written.
    let text = std::fs::read_to_string(&path).unwrap();
    let first = text.lines().next().unwrap().to_string() + "\n";
    std::fs::write(&path, first).unwrap();
    train(&TrainConfig {
        epochs: 3,
        resume: base.save.clone(),
        ..base.clone()
    })
    .unwrap();
    let after = read_metrics(&path).unwrap();
    assert_eq!(after.iter().map(|r| r.epoch).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(
        after[1], full[1],
        "epoch 2's line is the one the run computed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cpu_run_under_a_multi_process_launcher_refuses() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mnist_fsdp"))
        .args(["--subset", "--device", "cpu", "--limit-batches", "1"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--world-size") && err.contains("RANK=1"),
        "{err}"
    );
}
