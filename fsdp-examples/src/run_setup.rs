//! What every training binary checks and holds before it trains: output paths that can be written
//! (checked before the first step, not after an epoch), one writer per checkpoint directory (an advisory
//! lock held for the whole run), and the refusal of launcher variables a CPU run would ignore.

use fsdp_shard::checkpoint::{check_writable_dir, check_writable_file, CheckpointLock};
use fsdp_shard::ShardError;
use std::path::Path;

/// Why a run cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// An output path cannot be written, or the checkpoint directory is in use.
    #[error("{flag} {path}: {source}")]
    Output {
        /// The flag that named the path.
        flag: String,
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: ShardError,
    },
    /// The process was started by a multi-process launcher for a device that runs ranks as threads.
    #[error("{0}")]
    Launcher(String),
}

/// The outputs of a run, checked, and the lock on its checkpoint directory (released when dropped).
#[derive(Debug)]
pub struct RunOutputs {
    _lock: Option<CheckpointLock>,
}

impl RunOutputs {
    /// Checks that every output can be written (`(flag, path, is_directory)`: a probe file is created and
    /// removed) and takes the lock of the checkpoint directory `save` (another run writing there is an
    /// error naming its process).
    pub fn prepare(
        save: Option<(&str, &Path)>,
        files: &[(&str, &Path)],
    ) -> Result<Self, SetupError> {
        let wrap = |flag: &str, path: &Path| {
            let (flag, path) = (flag.to_string(), path.display().to_string());
            move |source| SetupError::Output { flag, path, source }
        };
        for &(flag, path) in files {
            check_writable_file(path).map_err(wrap(flag, path))?;
        }
        let lock = match save {
            Some((flag, dir)) => {
                check_writable_dir(dir).map_err(wrap(flag, dir))?;
                Some(CheckpointLock::acquire(dir).map_err(wrap(flag, dir))?)
            }
            None => None,
        };
        Ok(RunOutputs { _lock: lock })
    }
}

/// Refuses a run on the CPU that a launcher started as one of several processes (`RANK`/`WORLD_SIZE`
/// set): CPU ranks are threads of one process (`--world-size`), so each process would run the whole job
/// and they would write the same outputs.
pub fn refuse_launcher_on_cpu(binary: &str) -> Result<(), SetupError> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (rank, world) = (var("RANK"), var("WORLD_SIZE"));
    if rank.is_none() && world.is_none() {
        return Ok(());
    }
    if world.as_deref() == Some("1") && rank.as_deref().is_none_or(|r| r == "0") {
        return Ok(());
    }
    Err(SetupError::Launcher(format!(
        "{binary} was started as one of several processes (RANK={}, WORLD_SIZE={}) but runs on the \
         CPU, where ranks are threads of one process: run it once with --world-size N instead of under \
         fsdp-run (fsdp-run starts one process per GPU with --device cuda)",
        rank.as_deref().unwrap_or("unset"),
        world.as_deref().unwrap_or("unset")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_checked_and_the_directory_is_locked() {
        let dir = std::env::temp_dir().join(format!("fsdp-run-setup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ckpt = dir.join("ckpt");
        let metrics = dir.join("m.jsonl");
        let held =
            RunOutputs::prepare(Some(("--save", &ckpt)), &[("--metrics", &metrics)]).unwrap();
        // A directory given for a file names the flag.
        let e = RunOutputs::prepare(None, &[("--metrics", &ckpt)]).unwrap_err();
        assert!(e.to_string().starts_with("--metrics"), "{e}");
        // The same process may not take the lock twice either: a second writer is refused.
        let second = RunOutputs::prepare(Some(("--save", &ckpt)), &[]);
        assert!(second.is_err(), "a second writer was accepted");
        drop(held);
        RunOutputs::prepare(Some(("--save", &ckpt)), &[]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
