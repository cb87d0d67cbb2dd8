//! Per-epoch training metrics as JSON lines, and an SVG plot that overlays runs.
//!
//! A metrics file holds one JSON object per line, one line per epoch, appended and flushed as each
//! epoch ends (so a crashed or interrupted run keeps its finished epochs):
//!
//! ```text
//! {"epoch":1,"train_loss":0.2153,"test_loss":0.0512,"test_accuracy":98.35,"test_correct":9835,"test_total":10000,"seconds":41.2,"samples_per_sec":1456.3,"lr":0.001}
//! ```
//!
//! Non-finite numbers (a diverged run) are written as `null` and read back as NaN; unknown fields are
//! kept in [`MetricsRecord::extra`], so newer files still load. A resumed run opens the file with
//! [`MetricsWriter::resume`], which first cuts it back to the epochs its checkpoint holds, so lines
//! written after that checkpoint are not repeated. [`render_svg`] draws train loss and test accuracy
//! per epoch of several runs side by side, with a legend.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What can go wrong reading, writing or plotting metrics.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum MetricsError {
    /// The operating system refused a read or write.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line is not a metrics record.
    #[error("{}:{line}: not an epoch metrics record: {source}", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// Serialising a record failed.
    #[error("serialising epoch metrics: {0}")]
    Serialize(#[from] serde_json::Error),
    /// A plot was asked for without any data.
    #[error("nothing to plot: {0}")]
    NothingToPlot(String),
}

/// Serialises non-finite floats as `null` and reads `null` back as NaN (JSON has no NaN).
mod nullable_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            serializer.serialize_f64(*value)
        } else {
            serializer.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
    }
}

/// The metrics of one evaluation point (an epoch's end, or every N optimizer steps).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// Epoch number, starting at 1 as in the reference output.
    pub epoch: u32,
    /// Optimizer steps done at this point (absent in files of per-epoch runs written before steps were
    /// recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// Mean training loss since the previous point (NaN when it diverged).
    #[serde(with = "nullable_f64")]
    pub train_loss: f64,
    /// Mean evaluation loss (per test sample or validation token).
    #[serde(with = "nullable_f64")]
    pub test_loss: f64,
    /// Test accuracy in percent (0-100): `100 * test_correct / test_total`.
    #[serde(with = "nullable_f64")]
    pub test_accuracy: f64,
    /// Correctly classified test digits.
    pub test_correct: u64,
    /// Test digits evaluated.
    pub test_total: u64,
    /// Wall-clock seconds of the epoch (training and test).
    #[serde(with = "nullable_f64")]
    pub seconds: f64,
    /// Training samples per second over all ranks.
    #[serde(with = "nullable_f64")]
    pub samples_per_sec: f64,
    /// Learning rate used in the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Any further fields (precision, world size, memory, ...), kept as they are.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl MetricsRecord {
    /// A record with the required fields; `test_accuracy` is derived from the counts.
    pub fn new(
        epoch: u32,
        train_loss: f64,
        test_loss: f64,
        test_correct: u64,
        test_total: u64,
        seconds: f64,
        samples_per_sec: f64,
    ) -> Self {
        let test_accuracy = if test_total == 0 {
            f64::NAN
        } else {
            100.0 * test_correct as f64 / test_total as f64
        };
        MetricsRecord {
            epoch,
            step: None,
            train_loss,
            test_loss,
            test_accuracy,
            test_correct,
            test_total,
            seconds,
            samples_per_sec,
            lr: None,
            extra: BTreeMap::new(),
        }
    }

    /// The record as one JSON line (without the newline).
    pub fn to_json_line(&self) -> Result<String, MetricsError> {
        Ok(serde_json::to_string(self)?)
    }
}

/// Parses JSON lines of metrics; blank lines are skipped, `path` names the source in errors.
pub fn parse_metrics(
    text: &str,
    path: impl AsRef<Path>,
) -> Result<Vec<MetricsRecord>, MetricsError> {
    let path = path.as_ref();
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|source| MetricsError::Parse {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })
        })
        .collect()
}

/// Reads a metrics file.
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<MetricsRecord>, MetricsError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_metrics(&text, path)
}

/// Appends records to a metrics file, one flushed line per record.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    dropped: usize,
}

impl MetricsWriter {
    /// Creates (or truncates) a metrics file for a new run; creates missing parent directories.
    pub fn create(path: impl AsRef<Path>) -> Result<Self, MetricsError> {
        Self::open(path.as_ref(), false)
    }

    /// Opens a metrics file for appending (a resumed run), creating it if absent.
    pub fn append(path: impl AsRef<Path>) -> Result<Self, MetricsError> {
        Self::open(path.as_ref(), true)
    }

    /// Opens the metrics file of a resumed run: records of epochs after `through_epoch` (written after
    /// the checkpoint being resumed, before a crash) are removed first, so they are not repeated.
    pub fn resume(path: impl AsRef<Path>, through_epoch: u32) -> Result<Self, MetricsError> {
        Self::resume_keeping(path, |m| m.epoch <= through_epoch)
    }

    /// [`MetricsWriter::resume`] keeping the records `keep` selects (by a step in
    /// [`MetricsRecord::extra`], say). The file is rewritten atomically (a synced temporary file renamed
    /// over it) only when something is removed; a last line cut short by a crash is removed, any other
    /// unreadable line is an error naming it. A missing file is created.
    pub fn resume_keeping(
        path: impl AsRef<Path>,
        keep: impl Fn(&MetricsRecord) -> bool,
    ) -> Result<Self, MetricsError> {
        let path = path.as_ref();
        let io = |source| MetricsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(e)),
        };
        let lines: Vec<&str> = text.lines().collect();
        let (mut kept, mut dropped) = (String::new(), 0usize);
        for (i, line) in lines.iter().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<MetricsRecord>(line) {
                Ok(m) if keep(&m) => {
                    kept.push_str(line);
                    kept.push('\n');
                }
                Ok(_) => dropped += 1,
                // A crash in the middle of writing the last line.
                Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => dropped += 1,
                Err(source) => {
                    return Err(MetricsError::Parse {
                        path: path.to_path_buf(),
                        line: i + 1,
                        source,
                    })
                }
            }
        }
        if dropped > 0 {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default();
            let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
            let tmp_io = |source| MetricsError::Io {
                path: tmp.clone(),
                source,
            };
            let mut f = File::create(&tmp).map_err(tmp_io)?;
            f.write_all(kept.as_bytes()).map_err(tmp_io)?;
            f.sync_all().map_err(tmp_io)?;
            std::fs::rename(&tmp, path).map_err(io)?;
        }
        let mut writer = Self::open(path, true)?;
        writer.dropped = dropped;
        Ok(writer)
    }

    /// How many records [`MetricsWriter::resume`] removed (0 for a new file).
    pub fn dropped_on_resume(&self) -> usize {
        self.dropped
    }

    fn open(path: &Path, append: bool) -> Result<Self, MetricsError> {
        let io = |source| MetricsError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(io)?;
        Ok(MetricsWriter {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            dropped: 0,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one record as a line and flushes it to the file.
    pub fn write(&mut self, record: &MetricsRecord) -> Result<(), MetricsError> {
        let line = record.to_json_line()?;
        let io = |source| MetricsError::Io {
            path: self.path.clone(),
            source,
        };
        self.out.write_all(line.as_bytes()).map_err(io)?;
        self.out.write_all(b"\n").map_err(io)?;
        self.out.flush().map_err(io)
    }
}

mod plot;

pub use plot::{render_svg, PlotKind, PlotOptions, PlotSeries};
