//! Converts MNIST CSV files (label, then 784 pixels per line) into the standard IDX files, checks the
//! counts, reads the files back and prints what was written. Used by `scripts/fetch-mnist.sh`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fsdp_examples::data::{read_mnist_csv, MnistDataset, MnistSplit, MNIST_COLS, MNIST_ROWS};

#[derive(Parser, Debug)]
#[command(about = "Convert MNIST CSV files to IDX files (train-images-idx3-ubyte, ...)")]
struct Args {
    /// CSV of the training split.
    #[arg(long)]
    train_csv: Option<PathBuf>,
    /// CSV of the test split.
    #[arg(long)]
    test_csv: Option<PathBuf>,
    /// Directory to write the IDX files into (created if needed).
    #[arg(long)]
    out: PathBuf,
    /// Gzip the IDX files (names get `.gz`).
    #[arg(long)]
    gzip: bool,
    /// Fail unless the training CSV holds exactly this many digits.
    #[arg(long)]
    expect_train: Option<usize>,
    /// Fail unless the test CSV holds exactly this many digits.
    #[arg(long)]
    expect_test: Option<usize>,
    /// Keep only the first N training digits (to make a subset).
    #[arg(long)]
    first_train: Option<usize>,
    /// Keep only the first N test digits.
    #[arg(long)]
    first_test: Option<usize>,
}

fn convert(
    split: MnistSplit,
    csv: &PathBuf,
    expect: Option<usize>,
    first: Option<usize>,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let full = read_mnist_csv(csv, MNIST_ROWS, MNIST_COLS)?;
    if let Some(expected) = expect {
        if full.len() != expected {
            return Err(format!(
                "{}: {} digits, expected {expected} for the MNIST {} split",
                csv.display(),
                full.len(),
                split.name()
            )
            .into());
        }
    }
    let data = match first {
        Some(n) => full.first(n)?,
        None => full,
    };
    let (images, labels) = data.write_idx(&args.out, split, args.gzip)?;
    // Read back what was written: the files on disk, not the data in memory, are what training uses.
    let check = MnistDataset::load(&args.out, split)?;
    if check != data {
        return Err(format!(
            "{}: read back differs from what was written",
            images.display()
        )
        .into());
    }
    let s = check.summary();
    println!(
        "{} split: {} digits of {}x{} written to {} and {}",
        split.name(),
        s.len,
        check.rows(),
        check.cols(),
        images.display(),
        labels.display()
    );
    println!("  labels 0-9: {:?}", s.label_histogram);
    println!(
        "  pixels: min {} max {}, scaled to [0,1]: mean {:.4} std {:.4}",
        s.min_pixel, s.max_pixel, s.mean, s.std
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.train_csv.is_none() && args.test_csv.is_none() {
        eprintln!("error: give --train-csv, --test-csv or both");
        return ExitCode::FAILURE;
    }
    let jobs = [
        (
            MnistSplit::Train,
            &args.train_csv,
            args.expect_train,
            args.first_train,
        ),
        (
            MnistSplit::Test,
            &args.test_csv,
            args.expect_test,
            args.first_test,
        ),
    ];
    for (split, csv, expect, first) in jobs {
        if let Some(csv) = csv {
            if let Err(e) = convert(split, csv, expect, first, &args) {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
