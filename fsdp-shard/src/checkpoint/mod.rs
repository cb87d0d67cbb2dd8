//! Checkpoints: sharded (one file per rank, reshardable N -> M) and full (consolidated), in safetensors
//! format with per-tensor checksums and atomic writes.

mod file;
mod sharded;

pub use file::{write_atomic, CheckpointFile, TensorRecord, FORMAT_KEY, FORMAT_VERSION};
pub use sharded::{
    load_sharded, read_full, read_index, save_full, save_sharded, shard_file, FullParams,
    FullWeights, LoadedCheckpoint,
};
