//! Checkpoints: sharded (one file per rank, reshardable N -> M, committed as a whole by one atomic
//! rename) and full (consolidated), in safetensors format with per-tensor and header checksums, durable
//! writes, and one writer per directory ([`CheckpointLock`]).

mod file;
mod file_ops;
mod generation;
mod lock;
mod sharded;

pub use file::{write_atomic, CheckpointFile, TensorRecord, FORMAT_KEY, FORMAT_VERSION};
pub use file_ops::StopAfter;
pub use generation::{read_commit, Commit};
pub use lock::{
    check_replaceable_file, check_writable_dir, check_writable_file, CheckpointLock, LOCK_FILE,
};
pub use sharded::{
    load_sharded, read_full, read_index, save_full, save_sharded, save_sharded_with, shard_file,
    shard_file_bytes, FullParams, FullWeights, LoadedCheckpoint, SaveOptions, SHARD_FILE_MARGIN,
};
