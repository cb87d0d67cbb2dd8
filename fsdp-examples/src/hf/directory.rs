//! Hugging Face's safetensors layout of a model directory, written and read.
//!
//! Up to the shard size limit the tensors go to one `model.safetensors`. Above it they are split, in the
//! set's order, into `model-00001-of-0000n.safetensors`, ... (a shard is closed when the next tensor would
//! take it over the limit; a tensor larger than the limit gets a shard of its own), and
//! `model.safetensors.index.json` maps every name to its shard:
//!
//! ```json
//! {"metadata": {"total_size": 123456}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...}}
//! ```
//!
//! `total_size` is the bytes of all tensors' elements (headers excluded). Every file carries the
//! metadata `{"format": "pt"}`, which `transformers` requires. This is the layout `save_pretrained` writes
//! (its default limit, 5 GB, is [`DEFAULT_SHARD_LIMIT_BYTES`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};

use super::error::HfError;
use super::tensors::{HfDtype, HfTensor, TensorSet};

/// The single-file name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// `save_pretrained`'s default shard size limit, 5 GB (decimal, as Hugging Face counts it).
pub const DEFAULT_SHARD_LIMIT_BYTES: u64 = 5_000_000_000;

/// The name of shard `k` (from 1) of `n`.
pub fn shard_file_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// `model.safetensors.index.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// `{"total_size": bytes}`, plus anything else a writer put there.
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// Tensor name to shard file name.
    pub weight_map: BTreeMap<String, String>,
}

impl ShardIndex {
    /// `metadata.total_size`, if present and an integer.
    pub fn total_size(&self) -> Option<u64> {
        self.metadata.get("total_size").and_then(|v| v.as_u64())
    }
}

/// What [`write_hf_safetensors`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenFiles {
    /// The safetensors files, in order.
    pub files: Vec<PathBuf>,
    /// The index, when the tensors were sharded.
    pub index: Option<PathBuf>,
}

/// Writes `tensors` (each in its own element type) into the directory `dir` (created if needed): one
/// `model.safetensors` when their bytes are at most `shard_limit_bytes`, otherwise shards and an index.
/// Each file is written under a temporary name and renamed. Stale files of the other layout in `dir`
/// are not removed: write into an empty directory.
pub fn write_hf_safetensors(
    dir: impl AsRef<Path>,
    tensors: &TensorSet,
    shard_limit_bytes: u64,
) -> Result<WrittenFiles, HfError> {
    let dir = dir.as_ref();
    if shard_limit_bytes == 0 {
        return Err(HfError::invalid(
            "write_hf_safetensors",
            "the shard size limit is 0",
        ));
    }
    if tensors.is_empty() {
        return Err(HfError::invalid("write_hf_safetensors", "no tensors"));
    }
    std::fs::create_dir_all(dir).map_err(|e| HfError::io(dir, e))?;
    let mut shards: Vec<Vec<(&str, &HfTensor)>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, t) in tensors.iter() {
        let bytes = t.data().len() as u64;
        let current = shards.len() - 1;
        if !shards[current].is_empty() && size + bytes > shard_limit_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        let last = shards.len() - 1;
        shards[last].push((name, t));
        size += bytes;
    }
    if shards.len() == 1 {
        let path = dir.join(SINGLE_FILE);
        write_safetensors_file(&path, &shards[0])?;
        return Ok(WrittenFiles {
            files: vec![path],
            index: None,
        });
    }
    let n = shards.len();
    let mut files = Vec::with_capacity(n);
    let mut weight_map = BTreeMap::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = shard_file_name(k + 1, n);
        let path = dir.join(&file);
        write_safetensors_file(&path, shard)?;
        for (name, _) in shard {
            weight_map.insert((*name).to_string(), file.clone());
        }
        files.push(path);
    }
    let index = ShardIndex {
        metadata: [(
            "total_size".to_string(),
            serde_json::Value::from(tensors.total_bytes() as u64),
        )]
        .into_iter()
        .collect(),
        weight_map,
    };
    let index_path = dir.join(INDEX_FILE);
    let text = serde_json::to_string_pretty(&index).map_err(|e| HfError::Json {
        path: index_path.clone(),
        reason: e.to_string(),
    })?;
    write_file(&index_path, text.as_bytes())?;
    Ok(WrittenFiles {
        files,
        index: Some(index_path),
    })
}

/// Writes one safetensors file of `tensors` (metadata `{"format": "pt"}`).
pub fn write_safetensors_file(path: &Path, tensors: &[(&str, &HfTensor)]) -> Result<(), HfError> {
    let bad = |reason: String| HfError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|(name, t)| {
            TensorView::new(t.dtype().to_safetensors(), t.shape().to_vec(), t.data())
                .map(|v| (*name, v))
                .map_err(|e| bad(format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect();
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| bad(e.to_string()))?;
    write_file(path, &bytes)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    fsdp_shard::checkpoint::write_atomic(path, bytes).map_err(|e| HfError::Layout {
        path: path.to_path_buf(),
        reason: format!("cannot write: {e}"),
    })
}

/// Reads a Hugging Face checkpoint: a directory with `model.safetensors.index.json` and its shards, or
/// with `model.safetensors`, or one safetensors file. Tensors must be F32 or BF16. A sharded directory's
/// index must name exactly the tensors its shards hold, each in the shard it names (its
/// `metadata.total_size` is not checked: published indexes do not all count it the same way). The set
/// is in the order of the files, then of the tensors' offsets in each.
pub fn read_hf_safetensors(path: impl AsRef<Path>) -> Result<TensorSet, HfError> {
    let path = path.as_ref();
    if !path.is_dir() {
        let mut set = TensorSet::new();
        read_safetensors_file(path, &mut set, |_| Ok(()))?;
        return Ok(set);
    }
    let index_path = path.join(INDEX_FILE);
    if index_path.is_file() {
        return read_sharded(path, &index_path);
    }
    let single = path.join(SINGLE_FILE);
    if single.is_file() {
        let mut set = TensorSet::new();
        read_safetensors_file(&single, &mut set, |_| Ok(()))?;
        return Ok(set);
    }
    Err(HfError::Layout {
        path: path.to_path_buf(),
        reason: format!("holds neither {SINGLE_FILE} nor {INDEX_FILE}"),
    })
}

/// Reads the index of a sharded directory.
pub fn read_shard_index(index_path: &Path) -> Result<ShardIndex, HfError> {
    let text = std::fs::read_to_string(index_path).map_err(|e| HfError::io(index_path, e))?;
    serde_json::from_str(&text).map_err(|e| HfError::Json {
        path: index_path.to_path_buf(),
        reason: format!("not a shard index ({e})"),
    })
}

fn read_sharded(dir: &Path, index_path: &Path) -> Result<TensorSet, HfError> {
    let index = read_shard_index(index_path)?;
    let layout = |reason: String| HfError::Layout {
        path: index_path.to_path_buf(),
        reason,
    };
    // Shard files in the order of their names (model-00001-of-..., model-00002-of-...).
    let mut files: Vec<&str> = index.weight_map.values().map(String::as_str).collect();
    files.sort_unstable();
    files.dedup();
    if files.is_empty() {
        return Err(layout("the weight_map is empty".into()));
    }
    if let Some(bad) = files
        .iter()
        .find(|f| Path::new(f).file_name() != Some(std::ffi::OsStr::new(f)))
    {
        return Err(layout(format!(
            "the weight_map names {bad:?}, not a file in this directory"
        )));
    }
    let mut set = TensorSet::new();
    for file in files {
        read_safetensors_file(&dir.join(file), &mut set, |name| {
            match index.weight_map.get(name) {
                Some(f) if f == file => Ok(()),
                Some(f) => Err(format!("the index puts {name} in {f}")),
                None => Err(format!("{name} is not in the index")),
            }
        })?;
    }
    let mut absent: Vec<&str> = index
        .weight_map
        .keys()
        .map(String::as_str)
        .filter(|n| !set.contains(n))
        .collect();
    if !absent.is_empty() {
        absent.sort_unstable();
        return Err(layout(format!(
            "the index names tensors no shard holds: {}",
            absent.join(", ")
        )));
    }
    Ok(set)
}

/// Adds the tensors of the safetensors file `path` to `set`, after `accept` (which says what is wrong
/// with a name, if anything) passes each name.
fn read_safetensors_file(
    path: &Path,
    set: &mut TensorSet,
    accept: impl Fn(&str) -> Result<(), String>,
) -> Result<(), HfError> {
    let bytes = std::fs::read(path).map_err(|e| HfError::io(path, e))?;
    let bad = |reason: String| HfError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let mut tensors = file.tensors();
    // File order: the set then lists a directory's tensors as they lie on disk.
    tensors.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
    for (name, view) in tensors {
        accept(&name).map_err(bad)?;
        let dtype = HfDtype::from_safetensors(view.dtype()).ok_or_else(|| {
            bad(format!(
                "{name} is {:?}; only F32 and BF16 are read",
                view.dtype()
            ))
        })?;
        let tensor = HfTensor::new(dtype, view.shape().to_vec(), view.data().to_vec())?;
        if set.contains(&name) {
            return Err(bad(format!("{name} is also in another file")));
        }
        set.insert(name, tensor)?;
    }
    Ok(())
}
