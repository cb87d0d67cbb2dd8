//! Overlays the train loss and test accuracy of several metrics files (JSON lines, one record per epoch)
//! in one SVG; each run is labelled by its file name without extension.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fsdp_examples::metrics::{render_svg, PlotOptions, PlotSeries};

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
    /// Plot title (empty for none).
    #[arg(long, default_value = "MNIST: train loss and test accuracy per epoch")]
    title: String,
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let series = args
        .metrics
        .iter()
        .map(PlotSeries::from_file)
        .collect::<Result<Vec<_>, _>>()?;
    let options = PlotOptions {
        title: args.title.clone(),
        ..PlotOptions::default()
    };
    let svg = render_svg(&series, &options)?;
    std::fs::write(&args.out, svg).map_err(|e| format!("{}: {e}", args.out.display()))?;
    for s in &series {
        match s.epochs.iter().max_by_key(|m| m.epoch) {
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
