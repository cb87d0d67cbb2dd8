//! The settings a checkpoint records and a resume checks ([`RunSettings`], [`check_resume`]), and the
//! metrics file of a resumed run cut back to its checkpoint ([`resume_metrics`]).
//!
//! The protocol: a checkpoint's key/values hold the position (the caller's keys),
//! every identity setting (`seed`, `precision`, ...: a resume with another value is refused with an
//! error naming the flag and both values) and every hyperparameter (`hyper.lr`, ...: a resume may change
//! them; the changes are returned as `flag: saved -> now` lines). A checkpoint written at a point that
//! also wrote a metrics line carries that line ([`LAST_RECORD_KEY`]): the line is written after the
//! checkpoint, so a crash between the two is repaired on resume, never duplicated.

use crate::metrics::{parse_metrics, MetricsError, MetricsRecord, MetricsWriter};
use std::collections::BTreeMap;
use std::path::Path;

/// The checkpoint key of the metrics line written at the point the checkpoint closes.
pub const LAST_RECORD_KEY: &str = "metrics.last_epoch";

/// One setting of a run as a checkpoint records it: `(checkpoint key, flag, value)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSetting {
    /// Key in the checkpoint.
    pub key: &'static str,
    /// The flag that sets it, for messages.
    pub flag: &'static str,
    /// Its value in this run.
    pub value: String,
}

impl RunSetting {
    /// A setting.
    pub fn new(key: &'static str, flag: &'static str, value: impl ToString) -> Self {
        RunSetting {
            key,
            flag,
            value: value.to_string(),
        }
    }
}

/// The settings a checkpoint records: those a resume must share (the data order and the numerics
/// depend on them) and the hyperparameters it may change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSettings {
    /// The binary that saves, named when a checkpoint lacks a setting.
    pub binary: String,
    /// Settings a resume must share.
    pub identity: Vec<RunSetting>,
    /// Settings a resume may change (reported).
    pub hyperparameters: Vec<RunSetting>,
}

impl RunSettings {
    /// Every setting as checkpoint key/values.
    pub fn to_extra(&self) -> BTreeMap<String, String> {
        self.identity
            .iter()
            .chain(&self.hyperparameters)
            .map(|s| (s.key.to_string(), s.value.clone()))
            .collect()
    }
}

/// Checks a checkpoint's key/values against this run before anything is loaded: an identity setting
/// must match (the error names the flag and both values); changed hyperparameters are returned as
/// `flag: saved -> now` lines.
pub fn check_resume(
    saved: &BTreeMap<String, String>,
    settings: &RunSettings,
) -> Result<Vec<String>, String> {
    for s in &settings.identity {
        let flag = s.flag;
        let have = saved.get(s.key).ok_or_else(|| {
            format!(
                "the checkpoint does not record {flag} (not saved by {}?)",
                settings.binary
            )
        })?;
        if *have != s.value {
            return Err(format!(
                "the checkpoint was saved with {flag} {have}, this run has {flag} {}; resume with \
                 the same {flag} (it decides the data order and the numerics)",
                s.value
            ));
        }
    }
    Ok(settings
        .hyperparameters
        .iter()
        .filter_map(|s| {
            saved
                .get(s.key)
                .filter(|v| **v != s.value)
                .map(|v| format!("{}: {v} -> {}", s.flag, s.value))
        })
        .collect())
}

/// The metrics line a checkpoint carries (written at the point it closes), if any.
pub fn saved_record(
    saved: &BTreeMap<String, String>,
) -> Result<Option<MetricsRecord>, MetricsError> {
    Ok(saved
        .get(LAST_RECORD_KEY)
        .map(|line| parse_metrics(line, "the checkpoint's last metrics line"))
        .transpose()?
        .and_then(|mut v| v.pop()))
}

/// Opens the metrics file of a resumed run: keeps the records `keep` selects (those written before
/// the checkpoint; lines after it came from the interrupted run), then writes `carried`, the line the
/// checkpoint carries (dropped by `keep`, written again so that neither a gap nor a duplicate remains).
pub fn resume_metrics(
    path: &Path,
    keep: impl Fn(&MetricsRecord) -> bool,
    carried: Option<&MetricsRecord>,
) -> Result<MetricsWriter, MetricsError> {
    let mut w = MetricsWriter::resume_keeping(path, keep)?;
    if let Some(r) = carried {
        w.write(r)?;
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(seed: u64, lr: f64) -> RunSettings {
        RunSettings {
            binary: "test".into(),
            identity: vec![RunSetting::new("seed", "--seed", seed)],
            hyperparameters: vec![RunSetting::new("hyper.lr", "--lr", lr)],
        }
    }

    #[test]
    fn identity_mismatch_names_the_flag_and_hyperparameter_changes_are_listed() {
        let saved = settings(1, 0.1).to_extra();
        let e = check_resume(&saved, &settings(7, 0.1)).unwrap_err();
        assert!(e.contains("--seed 1") && e.contains("--seed 7"), "{e}");
        assert_eq!(
            check_resume(&saved, &settings(1, 0.2)).unwrap(),
            ["--lr: 0.1 -> 0.2"]
        );
        let e = check_resume(&BTreeMap::new(), &settings(1, 0.1)).unwrap_err();
        assert!(e.contains("does not record --seed"), "{e}");
    }
}
