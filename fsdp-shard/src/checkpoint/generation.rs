//! The generations of a sharded checkpoint directory, and the commit that makes one of them current.
//!
//! ```text
//! DIR/
//!   index.json            the commit record: generation, save id, world size, key/values, CRC-32
//!   gen-00000007/         the committed generation: rank-RRRRR-of-NNNNN.safetensors, one per rank
//!   .lock                 the writer's advisory lock (see `lock.rs`)
//! ```
//!
//! A save writes a new generation directory next to the committed one, makes every rank's file durable,
//! and then rank 0 commits by renaming a new `index.json` over the old one: one atomic rename. Until that
//! rename the old index names the old generation, which nothing has touched; after it the new index
//! names the new, complete generation. The old generation is removed after the commit; generations and
//! temporaries that no index names (left by an interrupted save) are removed at the start of the next
//! save.

use super::file::remove_stale_temporaries;
use super::file_ops::FileOps;
use super::lock::CheckpointLock;
use super::FORMAT_VERSION;
use crate::ShardError;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The commit record's file name.
pub(crate) const INDEX: &str = "index.json";
const GENERATION_PREFIX: &str = "gen-";

/// The committed state of a sharded checkpoint directory, as its `index.json` records it.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// The committed generation (counts the saves into this directory, from 1).
    pub generation: u64,
    /// A random id of the save that wrote the generation; every rank file repeats it.
    pub save_id: String,
    /// The world size the checkpoint was saved with.
    pub world_size: usize,
    /// The caller's key/values given to the save (rank 0's).
    pub extra: BTreeMap<String, String>,
}

impl Commit {
    /// The directory holding the committed generation's rank files.
    pub fn generation_dir(&self) -> PathBuf {
        generation_dir(&self.dir, self.generation)
    }

    /// The committed file of `rank`.
    pub fn shard_file(&self, rank: usize) -> PathBuf {
        super::shard_file(&self.generation_dir(), rank, self.world_size)
    }
}

/// The directory of generation `generation` in `dir`.
pub(crate) fn generation_dir(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("{GENERATION_PREFIX}{generation:08}"))
}

fn parse_generation(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(GENERATION_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// What the index holds besides its checksum.
#[derive(serde::Serialize, serde::Deserialize)]
struct IndexBody {
    format: String,
    generation: u64,
    save_id: String,
    world_size: usize,
    extra: BTreeMap<String, String>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct IndexFile {
    #[serde(flatten)]
    body: IndexBody,
    crc32: String,
}

fn body_crc(body: &IndexBody) -> Result<String, ShardError> {
    let text =
        serde_json::to_string(body).map_err(|e| ShardError::Checkpoint(format!("index: {e}")))?;
    Ok(format!("{:08x}", crc32fast::hash(text.as_bytes())))
}

/// Reads and checks `dir`'s commit record.
pub fn read_commit(dir: &Path) -> Result<Commit, ShardError> {
    let path = dir.join(INDEX);
    let text = std::fs::read_to_string(&path).map_err(|e| ShardError::Io {
        path: path.clone(),
        source: e,
    })?;
    let bad = |what: String| ShardError::Checkpoint(format!("{}: {what}", path.display()));
    // The format first, so an index of another version says so rather than failing to parse.
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("malformed index ({e})")))?;
    match value.get("format").and_then(|f| f.as_str()) {
        Some(FORMAT_VERSION) => {}
        Some(other) => {
            return Err(bad(format!(
                "unsupported format {other:?} (this version reads {FORMAT_VERSION:?})"
            )))
        }
        None => return Err(bad("not an fp8-fsdp checkpoint index (no format)".into())),
    }
    let index: IndexFile =
        serde_json::from_value(value).map_err(|e| bad(format!("malformed index ({e})")))?;
    let crc = body_crc(&index.body)?;
    if crc != index.crc32 {
        return Err(bad(format!(
            "the index is corrupt or was edited (checksum {crc}, expected {})",
            index.crc32
        )));
    }
    let b = index.body;
    if b.world_size == 0 {
        return Err(bad("world size 0".into()));
    }
    if b.generation == 0 {
        return Err(bad("generation 0".into()));
    }
    Ok(Commit {
        dir: dir.to_path_buf(),
        generation: b.generation,
        save_id: b.save_id,
        world_size: b.world_size,
        extra: b.extra,
    })
}

/// A save in progress: the generation it writes and the one it replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub generation: u64,
    pub save_id: u64,
    /// The committed generation, removed after the new one is committed.
    pub previous: Option<u64>,
}

impl Plan {
    /// 8 bytes of generation and 8 of save id (little-endian), for the broadcast from rank 0.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.generation.to_le_bytes());
        b[8..].copy_from_slice(&self.save_id.to_le_bytes());
        b
    }

    /// The generation and save id of [`Plan::to_bytes`] (`previous` is rank 0's business); `None` for
    /// generation 0, which says that rank 0 could not prepare the save.
    pub fn from_bytes(b: &[u8]) -> Option<Plan> {
        let generation = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
        let save_id = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
        (generation != 0).then_some(Plan {
            generation,
            save_id,
            previous: None,
        })
    }
}

/// The save id as written in the index and the rank files.
pub(crate) fn save_id_text(id: u64) -> String {
    format!("{id:016x}")
}

/// A fresh save id: clock, process and a counter, mixed (SplitMix64's finaliser).
fn new_save_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut z = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rank 0's preparation of a save: locks the directory for the save unless this process holds its lock
/// already, removes what interrupted saves left (generations no index names, temporaries), and creates
/// the new generation's directory. Returns the plan and the lock taken for the save, if any.
pub(crate) fn prepare(
    dir: &Path,
    ops: &FileOps<'_>,
) -> Result<(Plan, Option<CheckpointLock>), ShardError> {
    let lock = if CheckpointLock::held_by_this_process(dir) {
        None
    } else {
        Some(CheckpointLock::acquire(dir)?)
    };
    // The committed generation: known, none (no index), or unknown (an unreadable index: then no
    // generation is removed, in case it is the one that index meant).
    let committed = if dir.join(INDEX).exists() {
        read_commit(dir).ok().map(|c| Some(c.generation))
    } else {
        Some(None)
    };
    let entries = std::fs::read_dir(dir).map_err(|e| ShardError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let mut generations = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        if let Some(g) = name.to_str().and_then(parse_generation) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                generations.push(g);
            }
        }
    }
    generations.sort_unstable();
    // Under the lock every temporary in the directory is a leftover.
    remove_stale_temporaries(ops, dir, |_, _| true)?;
    if let Some(committed) = committed {
        for &g in &generations {
            if Some(g) != committed {
                ops.remove_dir_all(&generation_dir(dir, g))?;
            }
        }
    }
    let highest = generations
        .iter()
        .copied()
        .chain(committed.flatten())
        .max()
        .unwrap_or(0);
    let generation = highest.checked_add(1).ok_or_else(|| {
        ShardError::Checkpoint(format!("{}: generations exhausted", dir.display()))
    })?;
    ops.create_dir(&generation_dir(dir, generation))?;
    ops.sync_dir(dir)?;
    Ok((
        Plan {
            generation,
            save_id: new_save_id(),
            previous: committed.flatten(),
        },
        lock,
    ))
}

/// Rank 0's commit, once every rank's file of `plan.generation` is durable: the new index replaces
/// the old in one rename, then the previous generation is removed.
pub(crate) fn commit(
    dir: &Path,
    plan: &Plan,
    world_size: usize,
    extra: &BTreeMap<String, String>,
    ops: &FileOps<'_>,
) -> Result<(), ShardError> {
    let body = IndexBody {
        format: FORMAT_VERSION.into(),
        generation: plan.generation,
        save_id: save_id_text(plan.save_id),
        world_size,
        extra: extra.clone(),
    };
    let crc32 = body_crc(&body)?;
    let text = serde_json::to_string_pretty(&IndexFile { body, crc32 })
        .map_err(|e| ShardError::Checkpoint(format!("index: {e}")))?;
    ops.write_durable(&dir.join(INDEX), text.as_bytes())?;
    if let Some(previous) = plan.previous.filter(|&p| p != plan.generation) {
        // The new generation is committed whatever happens here; a generation left behind is removed
        // at the next save, so a failure to remove it now is not a failure of this save.
        let _ = ops.remove_dir_all(&generation_dir(dir, previous));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_names_round_trip() {
        let d = generation_dir(Path::new("/x"), 42);
        let name = d.file_name().unwrap().to_str().unwrap();
        assert_eq!(name, "gen-00000042");
        assert_eq!(parse_generation(name), Some(42));
        assert_eq!(parse_generation("gen-"), None);
        assert_eq!(parse_generation("gen-1a"), None);
        assert_eq!(parse_generation("gen-+1"), None);
        assert_eq!(parse_generation("generation"), None);
        let p = Plan {
            generation: 7,
            save_id: 0xdead_beef_0123_4567,
            previous: Some(6),
        };
        let back = Plan::from_bytes(&p.to_bytes()).unwrap();
        assert_eq!((back.generation, back.save_id), (7, p.save_id));
        assert_eq!(Plan::from_bytes(&[0u8; 16]), None);
        assert_ne!(new_save_id(), new_save_id());
    }
}
