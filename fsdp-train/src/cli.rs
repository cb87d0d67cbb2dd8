//! [`run_main`]: what a training binary's `main` does after parsing its flags — install the signal
//! handler, train (or time with `--speed`), print the summary, the task's lines and the plot — so a
//! binary is its task and its own flags.

use crate::args::{TaskDefaults, TrainArgs};
use crate::metrics::{render_svg, PlotKind, PlotOptions, PlotSeries};
use crate::setup::RunOutputs;
use crate::speed::SpeedOptions;
use crate::task::TrainTask;
use crate::trainer::{StopReason, Trainer};
use crate::{signal, TrainError};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// How a binary plots its metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotStyle {
    /// The panels (classifier accuracy or language-model losses).
    pub kind: PlotKind,
    /// The title.
    pub title: String,
}

/// Runs `task` as the shared flags `args` say, with the program's `defaults`; prints what a user reads
/// (errors on standard error, prefixed by the program's name) and returns the process's exit code:
/// 0 on success, 1 on an error, 130 / 143 after a clean stop on SIGINT / SIGTERM.
pub fn run_main<T: TrainTask>(
    task: &T,
    args: &TrainArgs,
    defaults: &TaskDefaults,
    plot: &PlotStyle,
) -> ExitCode {
    match run(task, args, defaults, plot) {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(sig)) => ExitCode::from(signal::exit_code(sig)),
        Err(e) => {
            eprintln!("{}: {e}", task.name());
            ExitCode::FAILURE
        }
    }
}

/// [`run_main`] without the printing of errors: `Ok(Some(signal))` after a stop by a signal.
pub fn run<T: TrainTask>(
    task: &T,
    args: &TrainArgs,
    defaults: &TaskDefaults,
    plot: &PlotStyle,
) -> Result<Option<i32>, TrainError> {
    let config = args.config(defaults)?;
    if let Some(p) = &args.plot {
        RunOutputs::prepare(None, &[("--plot", p.as_path())])?;
    }
    let trainer = Trainer::new(config);
    if args.speed {
        let report = trainer.speed(
            task,
            SpeedOptions {
                timed_steps: args.speed_steps,
                profile: args.profile.is_some(),
                ..SpeedOptions::default()
            },
        )?;
        print!("{}", report.table());
        println!("{}", report.json());
        return Ok(None);
    }
    signal::install()
        .map_err(|e| TrainError::Config(format!("installing the signal handler: {e}")))?;
    let report = trainer.run(task)?;
    println!("{}", report.summary(task.name()));
    if let Some(last) = report.last() {
        println!(
            "final: train loss {:.4}, eval loss {:.4} at step {}",
            last.train_loss,
            last.test_loss,
            last.step.unwrap_or(report.steps)
        );
    }
    if let Some(m) = report.memory.first() {
        println!("rank 0 model state: {m}");
    }
    for line in &report.after {
        println!("{line}");
    }
    if let (Some(svg), Some(metrics)) = (&args.plot, &args.metrics) {
        write_plot(svg, metrics, &args.compare, plot)?;
    }
    Ok(match report.stop {
        StopReason::Signal(s) => Some(s),
        _ => None,
    })
}

fn write_plot(
    svg: &Path,
    metrics: &Path,
    compare: &[PathBuf],
    style: &PlotStyle,
) -> Result<(), TrainError> {
    let mut series = vec![PlotSeries::from_file(metrics)?];
    for f in compare {
        series.push(PlotSeries::from_file(f)?);
    }
    let options = PlotOptions {
        kind: style.kind,
        title: style.title.clone(),
        ..PlotOptions::default()
    };
    std::fs::write(svg, render_svg(&series, &options)?)
        .map_err(|e| TrainError::Config(format!("--plot {}: {e}", svg.display())))?;
    println!("plot written to {}", svg.display());
    Ok(())
}
