//! Overlays several metrics files (JSON lines) in one SVG: MNIST's train loss and test accuracy per epoch,
//! or with `--kind lm` lm_fsdp's train and validation loss per step; each run is labelled by its file
//! name without extension.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fsdp_train::metrics::{render_svg, PlotKind, PlotOptions, PlotSeries};

#[derive(Parser, Debug)]
#[command(
    about = "Plot train loss and test accuracy per epoch of one or more metrics files as SVG"
)]
struct Args {
    /// Metrics files (JSON lines written by mnist_fsdp --metrics).
    #[arg(required = true)]
    metrics: Vec<PathBuf>,
    /// The SVG file to write.
    #[arg(short, long, default_value = "mnist-metrics.svg")]
    out: PathBuf,
    /// Plot title (empty for none) [default: one naming the kind's quantities].
    #[arg(long)]
    title: Option<String>,
    /// What the files hold: MNIST epochs, or language-model steps (lm_fsdp --metrics: train and
    /// validation loss per step).
    #[arg(long, value_enum, default_value_t = KindArg::Mnist)]
    kind: KindArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum KindArg {
    Mnist,
    Lm,
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let series = args
        .metrics
        .iter()
        .map(PlotSeries::from_file)
        .collect::<Result<Vec<_>, _>>()?;
    let (kind, title) = match args.kind {
        KindArg::Mnist => (
            PlotKind::default(),
            "MNIST: train loss and test accuracy per epoch",
        ),
        KindArg::Lm => (PlotKind::LanguageModel, "GPT on Shakespeare: loss per step"),
    };
    let options = PlotOptions {
        kind,
        title: args.title.clone().unwrap_or_else(|| title.to_string()),
        ..PlotOptions::default()
    };
    let svg = render_svg(&series, &options)?;
    std::fs::write(&args.out, svg).map_err(|e| format!("{}: {e}", args.out.display()))?;
    for s in &series {
        match s.epochs.iter().max_by_key(|m| m.epoch) {
            Some(last) if args.kind == KindArg::Lm => println!(
                "{}: {} records, last: step {} train loss {:.4} validation loss {:.4}",
                s.label,
                s.epochs.len(),
                last.epoch,
                last.train_loss,
                last.test_loss
            ),
            Some(last) => println!(
                "{}: {} epochs, last: epoch {} train loss {:.4} test accuracy {:.2}%",
                s.label,
                s.epochs.len(),
                last.epoch,
                last.train_loss,
                last.test_accuracy
            ),
            None => println!("{}: no epochs", s.label),
        }
    }
    println!("wrote {}", args.out.display());
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
