//! The file operations of a save (make a directory, create, write, fsync, rename, remove), each one
//! counted, so a test can stop a save after any number of them ([`StopAfter`]) and check that what is
//! left on disk loads as the previous checkpoint or the new one, never a mix.
//!
//! Writes are durable: a file is written under a temporary name in its directory, synced, renamed over
//! its final name, and the directory is synced so the rename itself survives a power loss.

use crate::ShardError;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A test hook that stops a save after a number of file operations, as a crash at that point would:
/// the operation that would exceed the budget and every later one fail with an error, so nothing the
/// save would have done afterwards happens.
///
/// Give it to [`super::save_sharded_with`] through [`super::SaveOptions::stop_after`].
#[derive(Debug)]
pub struct StopAfter {
    limit: usize,
    rank: Option<usize>,
    count: AtomicUsize,
    done: Mutex<Vec<String>>,
}

impl StopAfter {
    /// Stops every rank after `ops` operations counted over all ranks together (a machine failure).
    pub fn all_ranks(ops: usize) -> Self {
        Self::new(ops, None)
    }

    /// Stops only `rank`, after `ops` of its own operations (that process crashing); the other ranks go
    /// on until they wait for it.
    pub fn rank(rank: usize, ops: usize) -> Self {
        Self::new(ops, Some(rank))
    }

    fn new(limit: usize, rank: Option<usize>) -> Self {
        StopAfter {
            limit,
            rank,
            count: AtomicUsize::new(0),
            done: Mutex::new(Vec::new()),
        }
    }

    /// Whether an operation was refused (so the save stopped early).
    pub fn stopped(&self) -> bool {
        self.count.load(Ordering::SeqCst) > self.limit
    }

    /// The operations performed, in order ("rank 0: rename ...").
    pub fn performed(&self) -> Vec<String> {
        self.done.lock().map(|d| d.clone()).unwrap_or_default()
    }

    /// Counts one operation of `rank`; an error once the budget is spent.
    fn admit(&self, rank: usize, what: &dyn Fn() -> String) -> Result<(), ShardError> {
        if self.rank.is_some_and(|r| r != rank) {
            return Ok(());
        }
        let n = self.count.fetch_add(1, Ordering::SeqCst);
        if n >= self.limit {
            return Err(ShardError::Checkpoint(format!(
                "save stopped by the test hook before operation {} (rank {rank}: {})",
                n + 1,
                what()
            )));
        }
        if let Ok(mut d) = self.done.lock() {
            d.push(format!("rank {rank}: {}", what()));
        }
        Ok(())
    }
}

fn io_error(path: &Path, source: std::io::Error) -> ShardError {
    ShardError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The temporary name `path` is written under: `.NAME.tmp-PID` in the same directory.
pub(crate) fn temporary_path(path: &Path) -> Result<PathBuf, ShardError> {
    let name = path
        .file_name()
        .ok_or_else(|| ShardError::Checkpoint(format!("{} is not a file path", path.display())))?;
    Ok(path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// If `file_name` is a temporary of this module (`.NAME.tmp-PID`), NAME and PID.
pub(crate) fn parse_temporary(file_name: &str) -> Option<(&str, u32)> {
    let rest = file_name.strip_prefix('.')?;
    let (name, pid) = rest.rsplit_once(".tmp-")?;
    let pid = pid.parse().ok()?;
    (!name.is_empty()).then_some((name, pid))
}

/// File operations of one rank, counted against an optional [`StopAfter`].
#[derive(Clone, Copy)]
pub(crate) struct FileOps<'a> {
    rank: usize,
    stop: Option<&'a StopAfter>,
}

impl<'a> FileOps<'a> {
    pub(crate) fn new(rank: usize, stop: Option<&'a StopAfter>) -> Self {
        FileOps { rank, stop }
    }

    /// Operations without a test hook.
    pub(crate) fn unhooked() -> FileOps<'static> {
        FileOps {
            rank: 0,
            stop: None,
        }
    }

    fn admit(&self, what: &dyn Fn() -> String) -> Result<(), ShardError> {
        match self.stop {
            Some(s) => s.admit(self.rank, what),
            None => Ok(()),
        }
    }

    /// Creates `dir` and its missing parents.
    pub(crate) fn create_dir(&self, dir: &Path) -> Result<(), ShardError> {
        self.admit(&|| format!("make directory {}", dir.display()))?;
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))
    }

    /// Syncs a directory, making the creations, renames and removals of its entries durable.
    pub(crate) fn sync_dir(&self, dir: &Path) -> Result<(), ShardError> {
        self.admit(&|| format!("fsync directory {}", dir.display()))?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error(dir, e))
    }

    /// Writes `bytes` to `path` durably: a temporary file in the same directory (create, write,
    /// fsync), renamed over `path`, then the directory synced. A crash at any point leaves either the
    /// previous `path` or the new one, and at most a temporary that the next save removes.
    pub(crate) fn write_durable(&self, path: &Path, bytes: &[u8]) -> Result<(), ShardError> {
        super::lock::refuse_special_file(path)?;
        let tmp = temporary_path(path)?;
        self.admit(&|| format!("create {}", tmp.display()))?;
        let mut f = std::fs::File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let written = self
            .admit(&|| format!("write {} bytes to {}", bytes.len(), tmp.display()))
            .and_then(|()| f.write_all(bytes).map_err(|e| io_error(&tmp, e)))
            .and_then(|()| self.admit(&|| format!("fsync {}", tmp.display())))
            .and_then(|()| f.sync_all().map_err(|e| io_error(&tmp, e)));
        drop(f);
        if let Err(e) = written {
            // A full disk or a failing device: leave no partial temporary behind (a crash leaves one,
            // which the next write of the same path removes).
            if self.stop.is_none() {
                let _ = std::fs::remove_file(&tmp);
                // Name the file asked for, not the temporary that is gone.
                if let ShardError::Io { source, .. } = e {
                    return Err(ShardError::Io {
                        path: path.to_path_buf(),
                        source,
                    });
                }
            }
            return Err(e);
        }
        self.admit(&|| format!("rename {} to {}", tmp.display(), path.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error(path, e))?;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        self.sync_dir(dir)
    }

    /// Removes a file.
    pub(crate) fn remove_file(&self, path: &Path) -> Result<(), ShardError> {
        self.admit(&|| format!("remove {}", path.display()))?;
        std::fs::remove_file(path).map_err(|e| io_error(path, e))
    }

    /// Removes a directory and everything in it.
    pub(crate) fn remove_dir_all(&self, dir: &Path) -> Result<(), ShardError> {
        self.admit(&|| format!("remove directory {}", dir.display()))?;
        std::fs::remove_dir_all(dir).map_err(|e| io_error(dir, e))
    }
}

/// Whether process `pid` exists (a temporary of a live process may still be in use).
pub(crate) fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) with signal 0 sends nothing and has no memory-safety preconditions; it only
    // reports whether the process exists (EPERM: it exists but belongs to someone else).
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporaries_parse_back() {
        let t = temporary_path(Path::new("/a/index.json")).unwrap();
        let name = t.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            parse_temporary(name),
            Some(("index.json", std::process::id()))
        );
        assert_eq!(parse_temporary("index.json"), None);
        assert_eq!(parse_temporary(".lock"), None);
        assert_eq!(parse_temporary(".x.tmp-abc"), None);
        assert_eq!(parse_temporary("..tmp-12"), None);
    }

    #[test]
    fn stop_after_refuses_from_the_budget_on() {
        let stop = StopAfter::all_ranks(2);
        let ops = FileOps::new(0, Some(&stop));
        let dir = std::env::temp_dir().join(format!("fsdp-fileops-{}", std::process::id()));
        ops.create_dir(&dir).unwrap();
        ops.sync_dir(&dir).unwrap();
        assert!(!stop.stopped());
        assert!(ops.write_durable(&dir.join("x"), b"abc").is_err());
        assert!(stop.stopped());
        assert!(!dir.join("x").exists());
        assert_eq!(stop.performed().len(), 2);
        // Another rank's hook does not count this rank.
        let only1 = StopAfter::rank(1, 0);
        FileOps::new(0, Some(&only1))
            .write_durable(&dir.join("y"), b"y")
            .unwrap();
        assert!(!only1.stopped());
        assert!(FileOps::new(1, Some(&only1)).sync_dir(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(process_exists(std::process::id()));
    }
}
