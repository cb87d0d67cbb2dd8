//! Bit-exact regression of the MNIST training numerics: the per-micro-batch losses of 50 steps on the
//! committed subset, 2 thread ranks, FP8 and F32, must equal the bit patterns recorded in
//! `testdata/golden/mnist_step_losses.txt`. The file was written by the code before the architecture
//! change (`FSDP_WRITE_GOLDEN=1 cargo test --release -p fsdp-examples --test mnist_golden`); any change
//! to an order of operations, a rounding or a data order shows up here as a different bit pattern.

use fsdp_examples::data::committed_subset_dir;
use fsdp_examples::mnist::{MnistOptions, MnistTask};
use fsdp_train::{DeviceChoice, Precision, RunLength, TrainConfig, Trainer};
use std::fmt::Write as _;
use std::path::PathBuf;

const STEPS: u64 = 50;
const WORLD_SIZE: usize = 2;

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/golden/mnist_step_losses.txt")
}

/// `precision rank step bits` lines of one run.
fn run(precision: Precision, name: &str) -> String {
    let task = MnistTask::new(MnistOptions {
        batch_size: 16,
        test_batch_size: 250,
        data_dir: committed_subset_dir(),
        ..MnistOptions::default()
    })
    .expect("the committed subset");
    let mut config = TrainConfig::new(RunLength::Epochs(1));
    config.precision = precision;
    config.world_size = WORLD_SIZE;
    config.device = DeviceChoice::Cpu;
    config.threads_per_rank = Some(1);
    config.stop_after_steps = Some(STEPS);
    let report = Trainer::new(config)
        .run(&task)
        .expect("training on the committed subset");
    assert_eq!(report.steps, STEPS);
    assert_eq!(report.step_losses.len(), WORLD_SIZE);
    let mut out = String::new();
    for (rank, losses) in report.step_losses.iter().enumerate() {
        assert_eq!(losses.len() as u64, STEPS, "one loss per micro-batch");
        for (step, l) in losses.iter().enumerate() {
            assert!(l.is_finite());
            writeln!(out, "{name} {rank} {step} {:08x}", l.to_bits()).expect("string write");
        }
    }
    out
}

#[test]
fn fifty_steps_reproduce_the_recorded_losses_bit_for_bit() {
    let mut now = run(Precision::Fp8, "fp8");
    now.push_str(&run(Precision::Fp32, "f32"));
    let path = golden_path();
    if std::env::var_os("FSDP_WRITE_GOLDEN").is_some() {
        std::fs::write(&path, &now).expect("write the golden file");
        eprintln!("wrote {}", path.display());
        return;
    }
    let golden = std::fs::read_to_string(&path).expect("golden file is committed");
    let mut mismatches = Vec::new();
    for (g, n) in golden.lines().zip(now.lines()) {
        if g != n {
            let decode = |line: &str| {
                line.rsplit(' ')
                    .next()
                    .and_then(|h| u32::from_str_radix(h, 16).ok())
                    .map(f32::from_bits)
            };
            mismatches.push(format!(
                "recorded {g} ({:?}), now {n} ({:?})",
                decode(g),
                decode(n)
            ));
        }
    }
    assert_eq!(
        golden.lines().count(),
        now.lines().count(),
        "number of losses"
    );
    assert!(
        mismatches.is_empty(),
        "{} of {} losses differ; first: {:?}",
        mismatches.len(),
        now.lines().count(),
        &mismatches[..mismatches.len().min(5)]
    );
}
