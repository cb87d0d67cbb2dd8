//! One writer per checkpoint directory: an advisory lock ([`CheckpointLock`]) held for a whole run, and
//! probes that an output path is writable before training starts.
//!
//! The lock is `flock(2)` on `DIR/.lock`, which holds the holder's process id for the error message of
//! the next would-be writer. The kernel drops the lock when its holder exits, however it exits, so a
//! crashed run never leaves a stale lock behind. The lock file itself is never removed: removing it would
//! let two processes lock two different files of the same name.

use crate::ShardError;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The lock file's name inside a checkpoint directory.
pub const LOCK_FILE: &str = ".lock";

/// Directories (canonical paths) whose lock this process holds, so saves of this process know the
/// directory is theirs.
static HELD: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn io_error(path: &Path, source: std::io::Error) -> ShardError {
    ShardError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An exclusive advisory lock on a checkpoint directory, released when dropped (or when the process
/// ends).
///
/// A run that saves checkpoints holds it from start to end (in a multi-process job, rank 0's process),
/// so a second run pointed at the same directory fails at once with the first run's process id instead
/// of interleaving its files. [`super::save_sharded`] also takes it for the length of one save when this
/// process does not hold it already.
///
/// ```
/// use fsdp_shard::checkpoint::CheckpointLock;
/// let dir = std::env::temp_dir().join(format!("lock-doc-{}", std::process::id()));
/// let lock = CheckpointLock::acquire(&dir)?;
/// let err = CheckpointLock::acquire(&dir).unwrap_err().to_string();
/// assert!(err.contains(&format!("process {}", std::process::id())), "{err}");
/// drop(lock);
/// CheckpointLock::acquire(&dir)?;
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), fsdp_shard::ShardError>(())
/// ```
#[derive(Debug)]
pub struct CheckpointLock {
    dir: PathBuf,
    _file: File,
}

impl CheckpointLock {
    /// Creates `dir` if needed and locks it, or fails naming the process that holds it.
    pub fn acquire(dir: impl AsRef<Path>) -> Result<Self, ShardError> {
        let dir = dir.as_ref();
        if dir.exists() && !dir.is_dir() {
            return Err(ShardError::Checkpoint(format!(
                "{} is not a directory (a checkpoint is a directory)",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
        let canonical = dir.canonicalize().map_err(|e| io_error(dir, e))?;
        let path = canonical.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_error(&path, e))?;
        // SAFETY: flock(2) on a descriptor this function owns (it stays open as long as `file`); no
        // memory is shared with the kernel.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(in_use(&canonical, holder_of(&path)));
            }
            return Err(io_error(&path, e));
        }
        let pid = std::process::id();
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{pid}"))
            .and_then(|()| file.sync_all())
            .map_err(|e| io_error(&path, e))?;
        if let Ok(mut held) = HELD.lock() {
            held.push(canonical.clone());
        }
        Ok(CheckpointLock {
            dir: canonical,
            _file: file,
        })
    }

    /// The locked directory (canonical path).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The process id written in `dir`'s lock file while some process holds the lock; `None` when the
    /// lock is free (or the directory has none).
    pub fn holder(dir: impl AsRef<Path>) -> Option<u32> {
        let path = dir.as_ref().join(LOCK_FILE);
        let file = File::open(&path).ok()?;
        // SAFETY: as in `acquire`; a successful probe is undone at once (and by closing the file).
        let free = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if free {
            // SAFETY: releases the probe lock taken just above on the same descriptor.
            unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
            return None;
        }
        holder_of(&path)
    }

    /// Whether this process holds the lock of `dir`.
    pub fn held_by_this_process(dir: impl AsRef<Path>) -> bool {
        let Ok(canonical) = dir.as_ref().canonicalize() else {
            return false;
        };
        HELD.lock().is_ok_and(|held| held.contains(&canonical))
    }
}

impl Drop for CheckpointLock {
    fn drop(&mut self) {
        if let Ok(mut held) = HELD.lock() {
            if let Some(i) = held.iter().position(|d| d == &self.dir) {
                held.swap_remove(i);
            }
        }
        // Closing the file (dropping it, right after this) releases the flock.
    }
}

/// The pid in a lock file; a holder that is between truncating and writing it reads as unknown.
fn holder_of(path: &Path) -> Option<u32> {
    let mut text = String::new();
    File::open(path).ok()?.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

fn in_use(dir: &Path, holder: Option<u32>) -> ShardError {
    let who = match holder {
        Some(pid) if pid == std::process::id() => format!("process {pid} (this process)"),
        Some(pid) => format!("process {pid}"),
        None => "another process".to_string(),
    };
    ShardError::Checkpoint(format!(
        "{} is in use by {who} (lock file {}): another run is writing checkpoints there; wait for \
         it to end or choose another directory",
        dir.display(),
        dir.join(LOCK_FILE).display()
    ))
}

/// Checks that a file can be written at `path` before a run depends on it: `path` is not a directory,
/// its directory exists (it is created if missing) and accepts a new file (a probe file is created and
/// removed), and an existing file at `path` opens for writing (its content is left unchanged).
pub fn check_writable_file(path: impl AsRef<Path>) -> Result<(), ShardError> {
    let path = path.as_ref();
    if path.is_dir() {
        return Err(ShardError::InvalidArgument(format!(
            "{} is a directory; a file path is needed",
            path.display()
        )));
    }
    let Some(name) = path.file_name() else {
        return Err(ShardError::InvalidArgument(format!(
            "{} names no file",
            path.display()
        )));
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    probe_dir(dir, &name.to_string_lossy())?;
    if path.exists() {
        OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| io_error(path, e))?;
    }
    Ok(())
}

/// Checks, before any work, that a file written whole under a temporary name and renamed over `path`
/// (an export, a checkpoint file) can be: as [`check_writable_file`], and `path`, when it exists, is a
/// regular file — the rename would replace a device, a pipe or a symbolic link itself, not write
/// through it.
pub fn check_replaceable_file(path: impl AsRef<Path>) -> Result<(), ShardError> {
    let path = path.as_ref();
    refuse_special_file(path)?;
    check_writable_file(path)
}

/// Refuses an existing `path` that is not a regular file (see [`check_replaceable_file`]).
pub(crate) fn refuse_special_file(path: &Path) -> Result<(), ShardError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    let kind = meta.file_type();
    if kind.is_file() || kind.is_dir() {
        // A directory is refused by the writers with their own message.
        return Ok(());
    }
    let what = if kind.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file (a device, pipe or socket)"
    };
    Err(ShardError::InvalidArgument(format!(
        "{} is {what}: the file is written under a temporary name and renamed over it, which would \
         replace it rather than write through it; name a regular file",
        path.display()
    )))
}

/// Checks that files can be written in directory `dir` (created if missing): a probe file is created
/// and removed.
pub fn check_writable_dir(dir: impl AsRef<Path>) -> Result<(), ShardError> {
    let dir = dir.as_ref();
    if dir.exists() && !dir.is_dir() {
        return Err(ShardError::InvalidArgument(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    probe_dir(dir, "dir")
}

fn probe_dir(dir: &Path, tag: &str) -> Result<(), ShardError> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    let probe = dir.join(format!(".{tag}.probe-{}", std::process::id()));
    File::create(&probe).map_err(|e| io_error(&probe, e))?;
    std::fs::remove_file(&probe).map_err(|e| io_error(&probe, e))
}
