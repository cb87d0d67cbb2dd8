//! The reference MNIST example trained with FP8 FSDP on the Trainer: thread ranks on the CPU, or one
//! process per GPU.
//!
//! `cargo run --release -p fsdp-examples --bin mnist_fsdp` trains one epoch on 2 CPU thread ranks when no
//! GPU is present (fetching MNIST first when `data/mnist` is empty), or 14 epochs on a GPU. See
//! `docs/mnist.md`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::Parser;
use fsdp_examples::data::{
    check_mnist_files, committed_subset_dir, DEFAULT_MNIST_DIR, FETCH_COMMAND,
};
use fsdp_examples::mnist::{MnistOptions, MnistTask};
use fsdp_train::{run_main, DeviceChoice, PlotKind, PlotStyle, RunLength, TaskDefaults, TrainArgs};

#[derive(Parser, Debug)]
#[command(about = "Train the reference MNIST CNN with FP8 fully sharded data parallelism")]
struct Args {
    /// Training batch size per rank (per micro-batch).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Test batch size per rank.
    #[arg(long, default_value_t = 1000)]
    test_batch_size: usize,
    /// Learning-rate factor per epoch (StepLR).
    #[arg(long, default_value_t = 0.7)]
    gamma: f64,
    /// Directory of the MNIST IDX files (the default one is filled by scripts/fetch-mnist.sh on demand).
    #[arg(long, default_value = DEFAULT_MNIST_DIR)]
    data_dir: PathBuf,
    /// Use the small MNIST subset committed with the sources (4000 training, 1000 test digits).
    #[arg(long, conflicts_with = "data_dir")]
    subset: bool,
    /// Train at most N batches per epoch and rank (smoke runs).
    #[arg(long)]
    limit_batches: Option<usize>,
    #[command(flatten)]
    train: TrainArgs,
}

/// Runs the fetch script for the default data directory.
fn fetch(dir: &Path) -> Result<(), String> {
    let local = PathBuf::from(FETCH_COMMAND);
    let script = if local.exists() {
        local
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(FETCH_COMMAND)
    };
    eprintln!(
        "MNIST not found in {}: running {}",
        dir.display(),
        script.display()
    );
    let status = Command::new("bash")
        .arg(&script)
        .arg(dir)
        .status()
        .map_err(|e| format!("could not run {}: {e}", script.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} failed ({status}); run `{FETCH_COMMAND} {}` by hand to see why",
            script.display(),
            dir.display()
        ))
    }
}

fn task(args: &Args) -> Result<MnistTask, String> {
    let data_dir = if args.subset {
        committed_subset_dir()
    } else {
        args.data_dir.clone()
    };
    if !args.subset {
        if let Err(e) = check_mnist_files(&data_dir) {
            if e.is_missing() && data_dir == Path::new(DEFAULT_MNIST_DIR) {
                fetch(&data_dir)?;
            } else {
                return Err(format!(
                    "{e} (fetch MNIST with `{FETCH_COMMAND} {}`)",
                    data_dir.display()
                ));
            }
        }
    }
    MnistTask::new(MnistOptions {
        data_dir,
        batch_size: args.batch_size,
        test_batch_size: args.test_batch_size,
        gamma: args.gamma,
        limit_batches: args.limit_batches,
        seed: args.train.seed,
    })
    .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let mut args = Args::parse();
    let on_cpu = args.train.resolved_device() == DeviceChoice::Cpu;
    if on_cpu {
        args.train.device = fsdp_train::DeviceArg::Cpu;
    }
    let task = match task(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("mnist_fsdp: {e}");
            return ExitCode::FAILURE;
        }
    };
    // One epoch on 2 thread ranks on the CPU; the reference's 14 on a GPU. Adam at 1e-3 (PyTorch
    // reaches 99.23 % with it against 99.00 % with the reference's 3e-4).
    let defaults = TaskDefaults {
        world_size: if on_cpu { 2 } else { 1 },
        ..TaskDefaults::new(RunLength::Epochs(if on_cpu { 1 } else { 14 }), 1e-3)
    };
    let plot = PlotStyle {
        kind: PlotKind::Classifier,
        title: "MNIST: train loss and test accuracy per epoch".into(),
    };
    run_main(&task, &args.train, &defaults, &plot)
}
