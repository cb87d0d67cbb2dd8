//! [`HfLlamaFormat`]: `--export` and `--init-from` in Hugging Face's layout for a Llama model: a
//! directory with `config.json` and `LlamaForCausalLM`-named safetensors (one file, or shards and an
//! index above [`DEFAULT_SHARD_LIMIT_BYTES`]), the fused projections split and joined by
//! [`LlamaNameMap`].

use super::{
    read_hf_safetensors, write_hf_safetensors, HfDtype, HfTensor, LlamaHfConfig, LlamaNameMap,
    TensorSet, CONFIG_FILE, DEFAULT_SHARD_LIMIT_BYTES, INDEX_FILE,
};
use fsdp_optim::{ExportDtype, OptimError};
use fsdp_shard::{FullTensor, FullWeights, ShardError};
use fsdp_train::weights::WeightsFormat;
use std::path::Path;

/// The Hugging Face format of one Llama model (its `config.json` without the element type, which the
/// export sets).
#[derive(Debug, Clone)]
pub struct HfLlamaFormat {
    config: LlamaHfConfig,
    shard_limit_bytes: u64,
}

impl HfLlamaFormat {
    /// The format of the model `config` describes, sharding above 5 GB as `save_pretrained` does.
    pub fn new(config: LlamaHfConfig) -> Self {
        HfLlamaFormat {
            config,
            shard_limit_bytes: DEFAULT_SHARD_LIMIT_BYTES,
        }
    }

    /// With another shard size limit (bytes; small ones for tests).
    pub fn with_shard_limit(mut self, bytes: u64) -> Self {
        self.shard_limit_bytes = bytes;
        self
    }

    /// The config written next to the tensors.
    pub fn config(&self) -> &LlamaHfConfig {
        &self.config
    }
}

fn is_model_file(name: &str) -> bool {
    name == CONFIG_FILE || name == INDEX_FILE || name.ends_with(".safetensors")
}

impl WeightsFormat for HfLlamaFormat {
    fn write(
        &self,
        path: &Path,
        tensors: Vec<FullTensor>,
        dtype: ExportDtype,
    ) -> Result<(), OptimError> {
        let err = |e: super::HfError| OptimError::Mismatch(e.to_string());
        let (hf_dtype, torch) = match dtype {
            ExportDtype::F32 => (HfDtype::F32, "float32"),
            ExportDtype::Bf16 => (HfDtype::Bf16, "bfloat16"),
        };
        let mut ours = TensorSet::new();
        for t in tensors {
            let tensor = HfTensor::from_f32(t.shape, &t.values).map_err(err)?;
            ours.insert(t.name, tensor.cast(hf_dtype)).map_err(err)?;
        }
        let hf = LlamaNameMap::new(&self.config).to_hf(&ours).map_err(err)?;
        drop(ours);
        write_hf_safetensors(path, &hf, self.shard_limit_bytes).map_err(err)?;
        let mut config = self.config.clone();
        config.torch_dtype = Some(torch.into());
        config.write(path.join(CONFIG_FILE)).map_err(err)
    }

    fn read(&self, path: &Path) -> Result<Box<dyn FullWeights>, ShardError> {
        let bad = |e: super::HfError| ShardError::Checkpoint(e.to_string());
        let hf = read_hf_safetensors(path).map_err(bad)?;
        let ours = LlamaNameMap::new(&self.config).from_hf(&hf).map_err(bad)?;
        Ok(Box::new(NamedTensors {
            origin: path.display().to_string(),
            tensors: ours,
        }))
    }

    /// A directory that can be created or written, holding no checkpoint yet (an export never mixes
    /// its files with another's).
    fn check_output(&self, path: &Path) -> Result<(), ShardError> {
        if path.is_file() {
            return Err(ShardError::InvalidArgument(format!(
                "{} is a file; the Hugging Face export is a directory",
                path.display()
            )));
        }
        fsdp_shard::checkpoint::check_writable_dir(path)?;
        let entries = std::fs::read_dir(path).map_err(|source| ShardError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut found: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_model_file(n))
            .collect();
        if !found.is_empty() {
            found.sort();
            return Err(ShardError::InvalidArgument(format!(
                "{} already holds a model ({}); choose a new directory or empty it",
                path.display(),
                found.join(", ")
            )));
        }
        Ok(())
    }
}

/// Our tensors read from a Hugging Face checkpoint, by our names.
struct NamedTensors {
    origin: String,
    tensors: TensorSet,
}

impl FullWeights for NamedTensors {
    fn origin(&self) -> String {
        self.origin.clone()
    }

    fn tensor(&self, name: &str) -> Result<Option<FullTensor>, String> {
        Ok(self.tensors.get(name).map(|t| FullTensor {
            name: name.to_string(),
            shape: t.shape().to_vec(),
            values: t.to_f32(),
        }))
    }

    fn names(&self) -> Vec<String> {
        self.tensors.names().map(String::from).collect()
    }
}
