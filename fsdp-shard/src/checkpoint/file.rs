//! A checkpoint file: named tensors and string metadata in safetensors format, with a CRC-32 per tensor so
//! a flipped bit in the data (which safetensors cannot see) is an error, a CRC-32 of the header (every
//! metadata entry and every tensor's name, type and shape) so an edited step or data position is an
//! error too, and atomic, durable writes.

use super::file_ops::{parse_temporary, process_exists, FileOps};
use crate::ShardError;
use fp8_core::QType;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Metadata key holding the format tag, so a foreign safetensors file is recognised as such.
pub const FORMAT_KEY: &str = "fp8_fsdp.format";
/// Current format tag. Version 2 added the header checksum and sharded checkpoints' generations.
pub const FORMAT_VERSION: &str = "fp8-fsdp-checkpoint/2";
const CRC_PREFIX: &str = "fp8_fsdp.crc32.";
/// Metadata key of the header checksum.
const HEADER_CRC_KEY: &str = "fp8_fsdp.header_crc32";

/// CRC-32 of a header: every metadata entry but the header checksum itself, and every tensor's name,
/// storage type and shape, in a canonical form (sorted; JSON-escaped, so no two headers share it).
fn header_crc<'a>(
    metadata: impl Iterator<Item = (&'a String, &'a String)>,
    tensors: impl Iterator<Item = (String, Dtype, Vec<usize>)>,
) -> String {
    let meta: BTreeMap<&String, &String> = metadata.filter(|(k, _)| *k != HEADER_CRC_KEY).collect();
    let mut tensors: Vec<(String, String, Vec<usize>)> = tensors
        .map(|(name, dtype, shape)| (name, format!("{dtype:?}"), shape))
        .collect();
    tensors.sort();
    // Serialising maps of strings and vectors of strings and integers cannot fail.
    let text = serde_json::to_string(&(meta, tensors)).unwrap_or_default();
    format!("{:08x}", crc32fast::hash(text.as_bytes()))
}

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
        let crc = header_crc(
            meta.iter(),
            self.tensors
                .iter()
                .map(|(n, t)| (n.clone(), dtype_of(t.qtype), t.shape.clone())),
        );
        meta.insert(HEADER_CRC_KEY.into(), crc);
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
        match metadata.get(FORMAT_KEY) {
            Some(v) if v == FORMAT_VERSION => {}
            Some(v) => {
                return Err(bad(format!(
                    "unsupported checkpoint format {v:?} (this version reads {FORMAT_VERSION:?})"
                )))
            }
            None => return Err(bad("not an fp8-fsdp checkpoint (no format tag)".into())),
        }
        let want = metadata
            .remove(HEADER_CRC_KEY)
            .ok_or_else(|| bad("the header has no checksum".into()))?;
        let got = header_crc(
            metadata.iter(),
            st.iter()
                .map(|(n, v)| (n.to_string(), v.dtype(), v.shape().to_vec())),
        );
        if want != got {
            return Err(bad(format!(
                "the header (metadata or tensor shapes) is corrupt or was edited (checksum {got}, \
                 expected {want})"
            )));
        }
        metadata.remove(FORMAT_KEY);
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
    /// `path`, so a crash mid-save leaves the previous file intact; see [`write_atomic`].
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

/// Writes `bytes` to `path` durably through a temporary file (`.NAME.tmp-PID`, synced), a rename and a
/// sync of the directory (created if missing). Temporaries of earlier writes of `path` whose process is
/// gone (or is this one) are removed first: an interrupted write leaves nothing behind for long.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ShardError> {
    let ops = FileOps::unhooked();
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    ops.create_dir(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| ShardError::Checkpoint(format!("{} is not a file path", path.display())))?
        .to_string_lossy()
        .into_owned();
    remove_stale_temporaries(&ops, dir, |n, pid| {
        n == name && (pid == std::process::id() || !process_exists(pid))
    })?;
    ops.write_durable(path, bytes)
}

/// Removes the temporaries (`.NAME.tmp-PID`) in `dir` that `stale(NAME, PID)` selects.
pub(crate) fn remove_stale_temporaries(
    ops: &FileOps<'_>,
    dir: &Path,
    stale: impl Fn(&str, u32) -> bool,
) -> Result<(), ShardError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ShardError::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if parse_temporary(file_name).is_some_and(|(n, pid)| stale(n, pid))
            && entry.file_type().is_ok_and(|t| t.is_file())
        {
            ops.remove_file(&entry.path())?;
        }
    }
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

    /// Replaces the first occurrence of `from` by `to` (same length) in the header.
    fn edit_header(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
        assert_eq!(from.len(), to.len());
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
        let at = header.find(from).expect("text in the header") + 8;
        let mut out = bytes.to_vec();
        out[at..at + from.len()].copy_from_slice(to.as_bytes());
        out
    }

    #[test]
    fn edited_metadata_or_shapes_are_refused() {
        let bytes = sample().to_bytes().unwrap();
        // The step, edited by hand: still valid JSON and valid safetensors, caught by the checksum.
        let edited = edit_header(&bytes, "\"step\":\"7\"", "\"step\":\"9\"");
        let err = CheckpointFile::from_bytes(&edited, "x.safetensors").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("x.safetensors") && msg.contains("header"),
            "{msg}"
        );
        // A shape with the same number of elements.
        let edited = edit_header(&bytes, "[2,2]", "[1,4]");
        assert!(CheckpointFile::from_bytes(&edited, "mem").is_err());
        // No header checksum at all.
        let edited = edit_header(&bytes, "fp8_fsdp.header_crc32", "fp8_fsdp.header_crc33");
        let msg = CheckpointFile::from_bytes(&edited, "mem")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("checksum"), "{msg}");
        // Every single bit flipped anywhere in the header is an error.
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for pos in 0..8 + header_len {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[pos] ^= 1 << bit;
                assert!(
                    CheckpointFile::from_bytes(&b, "mem").is_err(),
                    "flip of bit {bit} at byte {pos} accepted"
                );
            }
        }
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
        // An interrupted write's temporary (of this process, so not in use) goes at the next write.
        let tmp = super::super::file_ops::temporary_path(&path).unwrap();
        std::fs::write(&tmp, b"half a file").unwrap();
        g.write_atomic(&path).unwrap();
        assert!(!tmp.exists());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(CheckpointFile::read(&path).is_err());
    }
}
