//! Hugging Face interop for the Llama 3 family (`LlamaForCausalLM`): its `config.json`, the map between
//! our fused tensor names and its split ones, and its safetensors directory layout. The model plugs into
//! these: export gathers our tensors into a [`TensorSet`], [`LlamaNameMap::to_hf`] splits them and
//! [`write_hf_safetensors`] writes the directory; import is [`read_hf_safetensors`], then
//! [`LlamaNameMap::from_hf`]. See `docs/llama.md`.
//!
//! ```
//! use fsdp_examples::hf::{HfTensor, LlamaHfConfig, LlamaNameMap, TensorSet};
//!
//! // Two layers, 4 query heads of 8 over 2 key/value heads.
//! let config = LlamaHfConfig::llama3(32, 2, 4, 2, 48, 100)?;
//! let map = LlamaNameMap::new(&config);
//! let mut ours = TensorSet::new();
//! for e in map.entries() {
//!     let n: usize = e.shape.iter().product();
//!     ours.insert(e.name.clone(), HfTensor::from_f32(e.shape.clone(), &vec![0.5; n])?)?;
//! }
//! let hf = map.to_hf(&ours)?;
//! assert_eq!(hf.get("model.layers.1.self_attn.k_proj.weight").unwrap().shape(), [16, 32]);
//! assert_eq!(map.from_hf(&hf)?, ours);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod config;
pub mod directory;
pub mod error;
pub mod format;
pub mod names;
pub mod tensors;

pub use config::{Llama3RopeScaling, LlamaHfConfig, CONFIG_FILE, LLAMA_ARCHITECTURE};
pub use directory::{
    read_hf_safetensors, read_shard_index, shard_file_name, write_hf_safetensors,
    write_safetensors_file, ShardIndex, WrittenFiles, DEFAULT_SHARD_LIMIT_BYTES, INDEX_FILE,
    SINGLE_FILE,
};
pub use error::{HfError, TensorSetMismatch};
pub use format::HfLlamaFormat;
pub use names::{HfPart, LlamaNameMap, NameMapEntry, EMBED_TOKENS, FINAL_NORM, LM_HEAD};
pub use tensors::{HfDtype, HfTensor, TensorSet};
