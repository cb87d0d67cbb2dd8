//! The checks a training run makes before and around its work (issue: reliability): settings that decide
//! the numerics must match on resume (the error names the flag), changed hyperparameters are accepted and
//! recorded, zero values of count flags are refused, a second writer of a checkpoint directory is refused,
//! a crash between an epoch's checkpoint and its metrics line leaves neither a gap nor a duplicate, and a
//! CPU run started by a multi-process launcher refuses to run duplicate jobs.

use fsdp_examples::data::committed_subset_dir;
use fsdp_examples::mnist::{MnistOptions, MnistTask};
use fsdp_shard::checkpoint::CheckpointLock;
use fsdp_train::metrics::read_metrics;
use fsdp_train::{
    DeviceChoice, Precision, RunLength, TrainConfig, TrainError, TrainReport, Trainer,
};
use std::path::PathBuf;

fn train(config: &TrainConfig) -> Result<TrainReport, TrainError> {
    let task = MnistTask::new(MnistOptions {
        batch_size: 8,
        test_batch_size: 500,
        data_dir: committed_subset_dir(),
        limit_batches: Some(3),
        ..MnistOptions::default()
    })
    .map_err(TrainError::task)?;
    Trainer::new(config.clone()).run(&task)
}

fn epochs(c: &TrainConfig, n: u32) -> TrainConfig {
    let mut c = c.clone();
    c.length = RunLength::Epochs(n);
    c
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mnist-run-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small(dir: &std::path::Path) -> TrainConfig {
    let mut c = TrainConfig::new(RunLength::Epochs(1));
    c.world_size = 2;
    c.device = DeviceChoice::Cpu;
    c.threads_per_rank = Some(1);
    c.save = Some(dir.join("ckpt"));
    c.metrics = Some(dir.join("metrics.jsonl"));
    c
}

#[test]
fn a_resume_with_other_numerics_names_the_flag_and_a_changed_lr_is_recorded() {
    let dir = tmp("resume");
    let base = small(&dir);
    train(&base).unwrap();
    let ckpt = base.save.clone();
    let mut other = epochs(&base, 2);
    other.precision = Precision::Fp32;
    other.resume = ckpt.clone();
    other.save = None;
    other.metrics = None;
    let e = train(&other).unwrap_err().to_string();
    assert!(
        e.contains("--precision") && e.contains("fp8") && e.contains("fp32"),
        "{e}"
    );
    let mut other = epochs(&base, 2);
    other.seed = 7;
    other.resume = ckpt.clone();
    other.save = None;
    other.metrics = None;
    let e = train(&other).unwrap_err().to_string();
    assert!(e.contains("--seed 1") && e.contains("--seed 7"), "{e}");
    // A learning rate may change: accepted, and the next epoch's record says so.
    let mut other = epochs(&base, 2);
    other.lr = 5e-4;
    other.resume = ckpt;
    train(&other).unwrap();
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
    let with = |f: &dyn Fn(&mut TrainConfig)| {
        let mut c = base.clone();
        f(&mut c);
        c
    };
    for (config, flag) in [
        (
            with(&|c| c.threads_per_rank = Some(0)),
            "--threads-per-rank",
        ),
        (
            with(&|c| c.stop_after_steps = Some(0)),
            "--stop-after-steps",
        ),
        (with(&|c| c.save_every = Some(0)), "--save-every"),
        (with(&|c| c.length = RunLength::Epochs(0)), "--epochs"),
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
    assert!(matches!(e, TrainError::Setup(_)), "{e}");
    assert!(e.to_string().contains("in use"), "{e}");
    assert!(started.elapsed().as_secs() < 5, "refused only after work");
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_crash_between_checkpoint_and_metrics_line_leaves_one_line_per_epoch() {
    let dir = tmp("metrics");
    let base = epochs(&small(&dir), 2);
    let path = dir.join("metrics.jsonl");
    train(&base).unwrap();
    let full = read_metrics(&path).unwrap();
    assert_eq!(full.len(), 2);
    // The crash: epoch 2's checkpoint is committed, its metrics line never written.
    let text = std::fs::read_to_string(&path).unwrap();
    let first = text.lines().next().unwrap().to_string() + "\n";
    std::fs::write(&path, first).unwrap();
    let mut more = epochs(&base, 3);
    more.resume = base.save.clone();
    train(&more).unwrap();
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

#[test]
fn a_batch_larger_than_memory_is_refused_naming_the_flag() {
    use fsdp_optim::StatePrecision;
    use fsdp_shard::GradDtype;
    use fsdp_train::{memory_verdict, MemoryPlan, TrainTask};
    let task = MnistTask::new(MnistOptions {
        batch_size: usize::MAX,
        data_dir: committed_subset_dir(),
        ..MnistOptions::default()
    })
    .unwrap();
    let plan = |ranks| MemoryPlan {
        world_size: ranks,
        cuda: false,
        fp8_linears: true,
        optimizer_states: StatePrecision::LowPrecision,
        grad_shards: GradDtype::F32,
        optimizer_in_backward: false,
    };
    // A batch beyond the data holds the rank's share of it: 4000 images on one rank, 2000 on two.
    let one = task.memory_estimate(&plan(1)).unwrap().unwrap();
    let two = task.memory_estimate(&plan(2)).unwrap().unwrap();
    assert!(one.parts[1].what.contains("4000 images"), "{one:?}");
    assert!(two.parts[1].what.contains("2000 images"), "{two:?}");
    assert!(one.total() > 4000 * (1 << 20), "{one:?}");
    let e = memory_verdict(&one, false, 1, 4 << 30)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--batch-size") && e.contains("GiB"), "{e}");
    memory_verdict(&one, false, 1, 64 << 30).unwrap();
}
