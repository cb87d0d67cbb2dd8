//! The file format of `--export` and `--init-from`: full weights by parameter name.
//!
//! A task picks its format with [`crate::TrainTask::weights_format`]. The default, [`SafetensorsFormat`],
//! is one safetensors file under the model's own parameter names (any world size reads it back, and
//! PyTorch's `safetensors.torch.load_file`). A model with a published ecosystem format (a Hugging Face
//! checkpoint directory with its `config.json` and its own tensor names) implements [`WeightsFormat`]
//! over that format's reader and writer; the Trainer gathers and scatters the shards either way.

use fsdp_optim::{write_safetensors, ExportDtype, OptimError};
use fsdp_shard::{FullTensor, FullWeights, SafetensorsFile, ShardError};
use std::path::Path;

/// How full weights are written and read.
pub trait WeightsFormat {
    /// Writes `tensors` (the model's parameters by name, in the model's order, F32 master values) to
    /// `path` in `dtype`. Called on rank 0 only.
    fn write(
        &self,
        path: &Path,
        tensors: Vec<FullTensor>,
        dtype: ExportDtype,
    ) -> Result<(), OptimError>;

    /// Opens `path` as a source of full tensors under the model's parameter names (every rank reads).
    fn read(&self, path: &Path) -> Result<Box<dyn FullWeights>, ShardError>;

    /// Checks, before any work, that [`WeightsFormat::write`] can write `path` (default: a regular
    /// file that can be created or replaced in an existing directory).
    fn check_output(&self, path: &Path) -> Result<(), ShardError> {
        fsdp_shard::checkpoint::check_replaceable_file(path)
    }
}

/// One safetensors file under the model's own parameter names.
#[derive(Debug, Clone, Copy, Default)]
pub struct SafetensorsFormat;

impl WeightsFormat for SafetensorsFormat {
    fn write(
        &self,
        path: &Path,
        tensors: Vec<FullTensor>,
        dtype: ExportDtype,
    ) -> Result<(), OptimError> {
        write_safetensors(path, &tensors, dtype)
    }

    fn read(&self, path: &Path) -> Result<Box<dyn FullWeights>, ShardError> {
        Ok(Box::new(SafetensorsFile::read(path)?))
    }
}
