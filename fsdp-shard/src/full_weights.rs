//! Full (unsharded) tensors by parameter name: what an export writes and an import reads.
//!
//! [`FullWeights`] is a source of such tensors that [`crate::FsdpModel::import_from`] loads into the
//! shards; [`SafetensorsFile`] is the workspace's own format (one safetensors file by parameter name, as
//! `fsdp_optim::export_full` writes it and PyTorch's `safetensors.torch.load_file` reads it). Another
//! format (a Hugging Face checkpoint directory with other names) implements [`FullWeights`] over its own
//! reader.

use crate::ShardError;
use std::path::{Path, PathBuf};

/// One full tensor: its parameter name, shape and F32 values (row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct FullTensor {
    /// The parameter's dotted name (`h.3.c_attn.weight`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values.
    pub values: Vec<f32>,
}

/// A source of full tensors by parameter name.
pub trait FullWeights {
    /// Where the tensors come from, for messages (a path).
    fn origin(&self) -> String;
    /// The tensor `name` with its shape and F32 values, `None` when the source has no such tensor; an
    /// error names what is wrong with it (an unsupported element type, a bad encoding).
    fn tensor(&self, name: &str) -> Result<Option<FullTensor>, String>;
    /// Every name the source holds (for a strict import, which refuses names the model lacks).
    fn names(&self) -> Vec<String>;
}

/// One safetensors file read into memory (F32, BF16 or F16 tensors).
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl SafetensorsFile {
    /// Reads `path` and checks that it is a safetensors file.
    pub fn read(path: &Path) -> Result<Self, ShardError> {
        let bytes = std::fs::read(path).map_err(|source| ShardError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            ShardError::Checkpoint(format!("{}: not a safetensors file ({e})", path.display()))
        })?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            bytes,
        })
    }

    fn view(&self) -> Result<safetensors::SafeTensors<'_>, String> {
        safetensors::SafeTensors::deserialize(&self.bytes).map_err(|e| e.to_string())
    }
}

impl FullWeights for SafetensorsFile {
    fn origin(&self) -> String {
        self.path.display().to_string()
    }

    fn tensor(&self, name: &str) -> Result<Option<FullTensor>, String> {
        let file = self.view()?;
        let Ok(view) = file.tensor(name) else {
            return Ok(None);
        };
        Ok(Some(FullTensor {
            name: name.to_string(),
            shape: view.shape().to_vec(),
            values: tensor_f32(&view)?,
        }))
    }

    fn names(&self) -> Vec<String> {
        self.view()
            .map(|f| f.names().into_iter().map(String::from).collect())
            .unwrap_or_default()
    }
}

/// A tensor's values as F32 (F32, BF16 and F16 accepted).
fn tensor_f32(view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, String> {
    use safetensors::Dtype;
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => return Err(format!("type {other:?}; F32, BF16 or F16 expected")),
    })
}
