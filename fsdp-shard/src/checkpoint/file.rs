//! A checkpoint file: named tensors and string metadata in safetensors format, with a CRC-32 per tensor so
//! a flipped bit in the data (which safetensors cannot see) is an error, and atomic writes.

use crate::ShardError;
use fp8_core::QType;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Metadata key holding the format tag, so a foreign safetensors file is recognised as such.
pub const FORMAT_KEY: &str = "fp8_fsdp.format";
/// Current format tag.
pub const FORMAT_VERSION: &str = "fp8-fsdp-checkpoint/1";
const CRC_PREFIX: &str = "fp8_fsdp.crc32.";

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRecord {
    /// Storage type.
    pub qtype: QType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub bytes: Vec<u8>,
}

impl TensorRecord {
    /// An F32 tensor from values.
    pub fn from_f32(shape: &[usize], values: &[f32]) -> Self {
        TensorRecord {
            qtype: QType::F32,
            shape: shape.to_vec(),
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// The values of an F32 tensor, or an error naming the tensor.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>, ShardError> {
        if self.qtype != QType::F32 {
            return Err(ShardError::Checkpoint(format!(
                "tensor {name} is {} where f32 was expected",
                self.qtype
            )));
        }
        Ok(self
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// The tensors and metadata of one checkpoint file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointFile {
    /// Tensors by name (sorted, so files are byte-identical for identical content).
    pub tensors: BTreeMap<String, TensorRecord>,
    /// String metadata (safetensors metadata holds only strings).
    pub metadata: BTreeMap<String, String>,
}

fn dtype_of(q: QType) -> Dtype {
    match q {
        QType::E4M3 => Dtype::F8_E4M3,
        QType::E5M2 => Dtype::F8_E5M2,
        QType::F16 => Dtype::F16,
        QType::BF16 => Dtype::BF16,
        QType::F32 => Dtype::F32,
    }
}

fn qtype_of(d: Dtype) -> Option<QType> {
    Some(match d {
        Dtype::F8_E4M3 => QType::E4M3,
        Dtype::F8_E5M2 => QType::E5M2,
        Dtype::F16 => QType::F16,
        Dtype::BF16 => QType::BF16,
        Dtype::F32 => QType::F32,
        _ => return None,
    })
}

impl CheckpointFile {
    /// Adds a tensor (replacing one of the same name).
    pub fn insert(&mut self, name: impl Into<String>, t: TensorRecord) {
        self.tensors.insert(name.into(), t);
    }

    /// The tensor named `name`, or an error saying it is missing.
    pub fn tensor(&self, name: &str) -> Result<&TensorRecord, ShardError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ShardError::Checkpoint(format!("tensor {name} is missing")))
    }

    /// The metadata value of `key`, or an error saying it is missing.
    pub fn meta(&self, key: &str) -> Result<&str, ShardError> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| ShardError::Checkpoint(format!("metadata {key} is missing")))
    }

    /// A metadata value parsed as `T`.
    pub fn meta_parse<T: std::str::FromStr>(&self, key: &str) -> Result<T, ShardError> {
        let v = self.meta(key)?;
        v.parse()
            .map_err(|_| ShardError::Checkpoint(format!("metadata {key} = {v:?} is malformed")))
    }

    /// Serialises to safetensors bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ShardError> {
        let mut meta: HashMap<String, String> = self
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        meta.insert(FORMAT_KEY.into(), FORMAT_VERSION.into());
        let mut views = Vec::with_capacity(self.tensors.len());
        for (name, t) in &self.tensors {
            meta.insert(
                format!("{CRC_PREFIX}{name}"),
                format!("{:08x}", crc32fast::hash(&t.bytes)),
            );
            let view = TensorView::new(dtype_of(t.qtype), t.shape.clone(), &t.bytes)
                .map_err(|e| ShardError::Checkpoint(format!("tensor {name}: {e}")))?;
            views.push((name.clone(), view));
        }
        safetensors::serialize(views, Some(meta))
            .map_err(|e| ShardError::Checkpoint(format!("serialising: {e}")))
    }

    /// Parses and verifies safetensors bytes written by [`CheckpointFile::to_bytes`].
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self, ShardError> {
        let bad = |what: String| ShardError::Checkpoint(format!("{origin}: {what}"));
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("not a valid safetensors file ({e})")))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("unreadable header ({e})")))?;
        let mut metadata: BTreeMap<String, String> = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        match metadata.remove(FORMAT_KEY) {
            Some(v) if v == FORMAT_VERSION => {}
            Some(v) => return Err(bad(format!("unsupported checkpoint format {v:?}"))),
            None => return Err(bad("not an fp8-fsdp checkpoint (no format tag)".into())),
        }
        let mut tensors = BTreeMap::new();
        for (name, view) in st.iter() {
            let qtype = qtype_of(view.dtype()).ok_or_else(|| {
                bad(format!(
                    "tensor {name} has unsupported dtype {:?}",
                    view.dtype()
                ))
            })?;
            let data = view.data();
            let want = metadata
                .remove(&format!("{CRC_PREFIX}{name}"))
                .ok_or_else(|| bad(format!("tensor {name} has no checksum")))?;
            let got = format!("{:08x}", crc32fast::hash(data));
            if want != got {
                return Err(bad(format!(
                    "tensor {name} is corrupt (checksum {got}, expected {want})"
                )));
            }
            tensors.insert(
                name.to_string(),
                TensorRecord {
                    qtype,
                    shape: view.shape().to_vec(),
                    bytes: data.to_vec(),
                },
            );
        }
        if let Some(k) = metadata.keys().find(|k| k.starts_with(CRC_PREFIX)) {
            return Err(bad(format!("checksum {k} names a missing tensor")));
        }
        Ok(CheckpointFile { tensors, metadata })
    }

    /// Writes atomically: a temporary file in the same directory, flushed and synced, then renamed over
    /// `path`, so a crash mid-save leaves the previous file intact.
    pub fn write_atomic(&self, path: &Path) -> Result<(), ShardError> {
        let bytes = self.to_bytes()?;
        write_atomic(path, &bytes)
    }

    /// Reads and verifies a file.
    pub fn read(path: &Path) -> Result<Self, ShardError> {
        let bytes = std::fs::read(path).map_err(|e| ShardError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ShardError> {
    let io = |p: &Path, e: std::io::Error| ShardError::Io {
        path: p.to_path_buf(),
        source: e,
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(d) = dir {
        std::fs::create_dir_all(d).map_err(|e| io(d, e))?;
    }
    let file_name = path
        .file_name()
        .ok_or_else(|| ShardError::Checkpoint(format!("{} is not a file path", path.display())))?;
    let tmp: PathBuf = path.with_file_name(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    {
        let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| io(&tmp, e))?;
        f.sync_all().map_err(|e| io(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointFile {
        let mut f = CheckpointFile::default();
        f.insert("a", TensorRecord::from_f32(&[2, 2], &[1.0, 2.0, 3.0, -4.0]));
        f.insert(
            "w8",
            TensorRecord {
                qtype: QType::E4M3,
                shape: vec![3],
                bytes: vec![0x38, 0x7E, 0x80],
            },
        );
        f.metadata.insert("step".into(), "7".into());
        f
    }

    #[test]
    fn round_trip_and_corruption() {
        let f = sample();
        let bytes = f.to_bytes().unwrap();
        let back = CheckpointFile::from_bytes(&bytes, "mem").unwrap();
        assert_eq!(back, f);
        assert_eq!(back.meta_parse::<u64>("step").unwrap(), 7);
        // Every truncation is an error.
        for cut in 0..bytes.len() {
            assert!(
                CheckpointFile::from_bytes(&bytes[..cut], "mem").is_err(),
                "cut {cut}"
            );
        }
        // A flipped bit in the data region is caught by the checksum.
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x10;
        assert!(CheckpointFile::from_bytes(&flipped, "mem").is_err());
        // A foreign safetensors file (no format tag) is rejected.
        let view = TensorView::new(Dtype::F32, vec![1], &[0, 0, 128, 63]).unwrap();
        let foreign = safetensors::serialize([("x", view)], None).unwrap();
        let err = CheckpointFile::from_bytes(&foreign, "mem").unwrap_err();
        assert!(
            err.to_string().contains("not an fp8-fsdp checkpoint"),
            "{err}"
        );
    }

    #[test]
    fn atomic_write_replaces_and_reads_back() {
        let dir = std::env::temp_dir().join(format!("fsdp-ckpt-file-{}", std::process::id()));
        let path = dir.join("x.safetensors");
        sample().write_atomic(&path).unwrap();
        let mut g = sample();
        g.metadata.insert("step".into(), "8".into());
        g.write_atomic(&path).unwrap();
        assert_eq!(
            CheckpointFile::read(&path).unwrap().meta("step").unwrap(),
            "8"
        );
        let leftovers = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(CheckpointFile::read(&path).is_err());
    }
}
