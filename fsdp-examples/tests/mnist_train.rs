//! End-to-end training on the committed MNIST subset (4000 training, 1000 test digits): accuracy on 1 and
//! 2 thread ranks in FP8 and F32, and bitwise-exact resumption from a sharded checkpoint.

use fsdp_examples::data::committed_subset_dir;
use fsdp_examples::mnist::{train, DeviceChoice, MnistError, TrainConfig, TrainReport};
use fsdp_examples::progress::ProgressMode;
use fsdp_nn::LinearPrecision;

fn subset_config(world_size: usize, precision: LinearPrecision) -> TrainConfig {
    TrainConfig {
        epochs: 1,
        // Small batches: more steps from the 4000 digits of the subset.
        batch_size: 32 / world_size,
        test_batch_size: 250,
        precision,
        world_size,
        device: DeviceChoice::Cpu,
        data_dir: committed_subset_dir(),
        progress: ProgressMode::Hidden,
        print: false,
        threads_per_rank: Some(1),
        ..TrainConfig::default()
    }
}

fn accuracy(r: &TrainReport) -> f64 {
    r.epochs.last().map_or(0.0, |e| e.test_accuracy)
}

fn check_accuracy(world_size: usize, precision: LinearPrecision) {
    let r = train(&subset_config(world_size, precision)).unwrap();
    assert_eq!(r.epochs.len(), 1);
    let e = &r.epochs[0];
    eprintln!(
        "{world_size} rank(s) {precision:?}: {:.2}% test accuracy, train loss {:.4}",
        e.test_accuracy, e.train_loss
    );
    assert_eq!(e.test_total, 1000, "every test digit counted once");
    assert!(e.train_loss.is_finite() && e.train_loss > 0.0);
    assert!(
        accuracy(&r) >= 90.0,
        "{world_size} rank(s) {precision:?}: {:.2}% after one epoch",
        accuracy(&r)
    );
    // Memory is reported for every rank and the shards split the model.
    assert_eq!(r.memory.len(), world_size);
    assert!(r.memory.iter().all(|m| m.optimizer_states > 0));
}

#[test]
fn subset_one_rank_fp8_reaches_90_percent() {
    check_accuracy(1, LinearPrecision::Fp8);
}

#[test]
fn subset_two_ranks_fp8_reaches_90_percent() {
    check_accuracy(2, LinearPrecision::Fp8);
}

#[test]
fn subset_one_rank_f32_reaches_90_percent() {
    check_accuracy(1, LinearPrecision::F32);
}

#[test]
fn subset_two_ranks_f32_reaches_90_percent() {
    check_accuracy(2, LinearPrecision::F32);
}

fn bits(params: &[(String, Vec<f32>)]) -> Vec<(String, Vec<u32>)> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// An interrupted run (stopped mid-epoch 2, after a checkpoint) resumed from its checkpoint ends with
/// exactly the weights and epoch metrics of the uninterrupted run: same data position, dropout streams,
/// optimizer state and FP8 scaling histories. Two ranks, FP8, with gradient accumulation.
#[test]
fn resumed_run_matches_uninterrupted_run_bitwise() {
    let dir = std::env::temp_dir().join(format!("mnist-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = TrainConfig {
        epochs: 2,
        limit_batches: Some(8),
        grad_accum: 2,
        ..subset_config(2, LinearPrecision::Fp8)
    };
    let whole = train(&base).unwrap();
    assert_eq!(whole.steps, 8, "2 epochs of 8 micro-batches, 2 per step");

    let interrupted = train(&TrainConfig {
        save: Some(dir.clone()),
        stop_after_steps: Some(6),
        ..base.clone()
    })
    .unwrap();
    assert!(interrupted.stopped_early);
    assert_eq!(interrupted.epochs.len(), 1, "stopped during epoch 2");
    assert_ne!(
        bits(&interrupted.params),
        bits(&whole.params),
        "the interruption happened before the end"
    );

    let resumed = train(&TrainConfig {
        resume: Some(dir.clone()),
        ..base.clone()
    })
    .unwrap();
    assert_eq!(resumed.steps, 8);
    assert_eq!(bits(&resumed.params), bits(&whole.params));
    let (a, b) = (&resumed.epochs[0], &whole.epochs[1]);
    assert_eq!(a.epoch, 2);
    assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits());
    assert_eq!(a.test_loss.to_bits(), b.test_loss.to_bits());
    assert_eq!(a.test_correct, b.test_correct);

    // Resuming with other settings is refused with a message naming the difference.
    let err = train(&TrainConfig {
        resume: Some(dir.clone()),
        seed: 2,
        ..base.clone()
    })
    .unwrap_err();
    assert!(
        matches!(&err, MnistError::Checkpoint(m) if m.contains("seed")),
        "{err}"
    );
    let err = train(&TrainConfig {
        resume: Some(dir.clone()),
        world_size: 1,
        batch_size: 16,
        ..base
    })
    .unwrap_err();
    assert!(err.to_string().contains("world size"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_configuration_and_missing_data_are_errors() {
    let c = subset_config(1, LinearPrecision::Fp8);
    assert!(matches!(
        train(&TrainConfig {
            batch_size: 0,
            ..c.clone()
        }),
        Err(MnistError::Config(_))
    ));
    assert!(matches!(
        train(&TrainConfig {
            grad_accum: 0,
            ..c.clone()
        }),
        Err(MnistError::Config(_))
    ));
    let err = train(&TrainConfig {
        data_dir: std::env::temp_dir().join("no-mnist-here"),
        ..c
    })
    .unwrap_err();
    assert!(err.to_string().contains("fetch-mnist.sh"), "{err}");
}

/// GPU check for the H200 (`cargo test --release -p fsdp-examples --test mnist_train -- --ignored`, or
/// the built test binary with `--ignored`): the same subset run on CUDA (world size 1, NCCL) reaches the
/// accuracy bar and lands within 2 points of the CPU run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_subset_run_matches_cpu() {
    if let Err(why) = fp8_kernels::Device::cuda(0) {
        panic!("no usable GPU ({why})");
    }
    let cpu = train(&subset_config(1, LinearPrecision::Fp8)).unwrap();
    let gpu = train(&TrainConfig {
        device: DeviceChoice::Cuda,
        ..subset_config(1, LinearPrecision::Fp8)
    })
    .unwrap();
    eprintln!(
        "CPU {:.2}%, CUDA {:.2}% ({:.2} s per epoch on CUDA)",
        accuracy(&cpu),
        accuracy(&gpu),
        gpu.seconds_per_epoch()
    );
    assert!(accuracy(&gpu) >= 90.0);
    assert!((accuracy(&gpu) - accuracy(&cpu)).abs() <= 2.0);
}
