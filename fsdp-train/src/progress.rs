//! A per-epoch progress bar (samples done, running loss, samples/s) that draws only on a terminal.
//!
//! When standard output or standard error is not a terminal (a log file, CI, a pipe) the bar is hidden
//! and [`EpochProgress::println`] prints plain lines, so logs hold only the reference output.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether to draw a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// Draw when both standard output and standard error are terminals.
    Auto,
    /// Never draw (e.g. on ranks other than 0).
    Hidden,
    /// Draw on standard error whatever it is (for demonstrations).
    Always,
}

impl ProgressMode {
    /// Whether this mode draws, given whether stdout and stderr are terminals.
    pub fn draws(self, stdout_is_terminal: bool, stderr_is_terminal: bool) -> bool {
        match self {
            ProgressMode::Auto => stdout_is_terminal && stderr_is_terminal,
            ProgressMode::Hidden => false,
            ProgressMode::Always => true,
        }
    }

    /// Whether this mode draws in the current process.
    pub fn draws_here(self) -> bool {
        self.draws(
            std::io::stdout().is_terminal(),
            std::io::stderr().is_terminal(),
        )
    }
}

/// The progress of one epoch on one rank.
#[derive(Debug)]
pub struct EpochProgress {
    bar: ProgressBar,
    visible: bool,
    started: Instant,
    samples: u64,
    loss_sum: f64,
    loss_samples: u64,
    unit: &'static str,
}

impl EpochProgress {
    /// A bar for `epoch` over `total_samples` samples (those of all ranks, when samples/s should be the
    /// global rate).
    pub fn new(epoch: u32, total_samples: u64, mode: ProgressMode) -> Self {
        let visible = mode.draws_here();
        let bar = if visible {
            let bar =
                ProgressBar::with_draw_target(Some(total_samples), ProgressDrawTarget::stderr());
            // The template is a constant; should it ever fail to parse, keep indicatif's default style.
            if let Ok(style) = ProgressStyle::with_template(
                "{prefix} [{bar:30.cyan/blue}] {pos}/{len} {msg} eta {eta}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(format!("epoch {epoch}"));
            bar
        } else {
            ProgressBar::hidden()
        };
        EpochProgress {
            bar,
            visible,
            started: Instant::now(),
            samples: 0,
            loss_sum: 0.0,
            loss_samples: 0,
            unit: "samples",
        }
    }

    /// Replaces the bar's prefix (`epoch N` by default) and the name of what it counts (`samples` by
    /// default; a language model counts `tokens`).
    pub fn with_labels(mut self, prefix: &str, unit: &'static str) -> Self {
        self.bar.set_prefix(prefix.to_string());
        self.unit = unit;
        self
    }

    /// Whether the bar is drawn.
    pub fn is_visible(&self) -> bool {
        self.visible
    }

    /// Records a finished batch of `samples` samples with mean loss `batch_loss`; the bar shows the
    /// sample-weighted mean loss of the epoch so far. Non-finite losses count as samples but are shown
    /// as such rather than averaged in.
    pub fn advance(&mut self, samples: u64, batch_loss: f64) {
        self.samples += samples;
        if batch_loss.is_finite() {
            self.loss_sum += batch_loss * samples as f64;
            self.loss_samples += samples;
        }
        if self.visible {
            let rate = self.samples_per_sec();
            self.bar.set_message(if batch_loss.is_finite() {
                format!("loss {:.4} {rate:.0} {}/s", self.mean_loss(), self.unit)
            } else {
                format!(
                    "loss {batch_loss} (mean {:.4}) {rate:.0} {}/s",
                    self.mean_loss(),
                    self.unit
                )
            });
            self.bar.inc(samples);
        }
    }

    /// Samples recorded so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The sample-weighted mean of the finite batch losses so far (NaN before any).
    pub fn mean_loss(&self) -> f64 {
        if self.loss_samples == 0 {
            f64::NAN
        } else {
            self.loss_sum / self.loss_samples as f64
        }
    }

    /// Samples per second since the bar was created.
    pub fn samples_per_sec(&self) -> f64 {
        let secs = self.started.elapsed().as_secs_f64();
        if secs > 0.0 {
            self.samples as f64 / secs
        } else {
            0.0
        }
    }

    /// Prints a line on standard output without tearing the bar.
    pub fn println(&self, line: &str) {
        if self.visible {
            self.bar.suspend(|| println!("{line}"));
        } else {
            println!("{line}");
        }
    }

    /// Removes the bar from the terminal.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for EpochProgress {
    fn drop(&mut self) {
        // Never leave a half-drawn bar behind when the epoch ends early (an error).
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
    }
}
