//! A fresh, empty directory per call for tests that write files (tests run in parallel: the process id
//! and a counter keep their directories apart).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A new empty directory under the system's temporary directory, its name starting with `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fsdp-examples-{name}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
