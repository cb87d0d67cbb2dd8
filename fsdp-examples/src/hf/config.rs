//! Hugging Face's `config.json` for `LlamaForCausalLM`: read, checked, and written back.
//!
//! The shape fields (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `intermediate_size`,
//! `vocab_size`) are required: a config without them describes no particular model. The others take
//! Hugging Face's `LlamaConfig` defaults when absent (`num_key_value_heads` = `num_attention_heads`,
//! `head_dim` = `hidden_size / num_attention_heads`, `rms_norm_eps` 1e-6, `rope_theta` 10000,
//! `tie_word_embeddings` false, `max_position_embeddings` 2048). Keys this model does not interpret
//! (`bos_token_id`, `eos_token_id`, `initializer_range`, ...) are kept in [`LlamaHfConfig::extra`] and
//! written back unchanged. Keys that would change the model's arithmetic are checked: `hidden_act` must
//! be `silu`, `attention_bias` and `mlp_bias` false, `architectures` (when present) `LlamaForCausalLM`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::error::HfError;

/// The architecture name written to and expected in `architectures`.
pub const LLAMA_ARCHITECTURE: &str = "LlamaForCausalLM";
/// The `model_type` written.
pub const LLAMA_MODEL_TYPE: &str = "llama";
/// The file name of a Hugging Face model config.
pub const CONFIG_FILE: &str = "config.json";

/// Llama 3.1's frequency-dependent RoPE scaling (`rope_scaling` with `rope_type` `"llama3"`): the
/// kernels' own type, so a read config drives the RoPE tables directly.
pub use fp8_kernels::rope::Llama3RopeScaling;

/// A `LlamaForCausalLM` config: the fields that define the model's shapes and arithmetic, and every other
/// key of the file, kept for writing back.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaHfConfig {
    /// Model width (`hidden_size`).
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention; equal to the query heads for none).
    pub num_key_value_heads: usize,
    /// Width of one head (`head_dim`, or `hidden_size / num_attention_heads` when the file has none).
    pub head_dim: usize,
    /// SwiGLU hidden width (rows of `gate_proj` and of `up_proj`).
    pub intermediate_size: usize,
    /// Rows of the embedding (and of the head).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (500000 for Llama 3).
    pub rope_theta: f64,
    /// Llama 3.1 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Whether the head shares the embedding's weight (no `lm_head.weight` in the checkpoint).
    pub tie_word_embeddings: bool,
    /// The longest context the model is meant for.
    pub max_position_embeddings: usize,
    /// The checkpoint's element type as PyTorch names it (`"bfloat16"`, `"float32"`), if given.
    pub torch_dtype: Option<String>,
    /// Every other key of the file, written back as read.
    pub extra: BTreeMap<String, Value>,
}

/// Keys read into typed fields or checked, never kept in `extra`.
const KNOWN_KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "max_position_embeddings",
    "torch_dtype",
    "dtype",
    "architectures",
    "model_type",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
];

impl LlamaHfConfig {
    /// A config with Llama 3's RoPE base and norm epsilon, untied, no RoPE scaling, no dtype, and the
    /// given shapes (`head_dim` = `hidden_size / num_attention_heads`); checked like a read one.
    pub fn llama3(
        hidden_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
        intermediate_size: usize,
        vocab_size: usize,
    ) -> Result<Self, HfError> {
        let config = LlamaHfConfig {
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: hidden_size.checked_div(num_attention_heads).unwrap_or(0),
            intermediate_size,
            vocab_size,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
            max_position_embeddings: 8192,
            torch_dtype: None,
            extra: BTreeMap::new(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Parses and checks the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, HfError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| HfError::Config(format!("not JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(HfError::Config("the top level is not a JSON object".into()));
        };
        Self::from_map(map)
    }

    /// Reads and checks `path`: a `config.json`, or a directory holding one.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, HfError> {
        let path = path.as_ref();
        let file = if path.is_dir() {
            path.join(CONFIG_FILE)
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|e| HfError::io(&file, e))?;
        Self::from_json_str(&text).map_err(|e| match e {
            HfError::Config(reason) => HfError::Json { path: file, reason },
            other => other,
        })
    }

    /// The config as a JSON object, in Hugging Face's key names (with `architectures`, `model_type`,
    /// `hidden_act` and the biases written out), keys sorted.
    pub fn to_json_value(&self) -> Value {
        let mut map: Map<String, Value> = self
            .extra
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut put = |k: &str, v: Value| {
            map.insert(k.to_string(), v);
        };
        put("architectures", Value::from(vec![LLAMA_ARCHITECTURE]));
        put("model_type", Value::from(LLAMA_MODEL_TYPE));
        put("hidden_act", Value::from("silu"));
        put("attention_bias", Value::from(false));
        put("mlp_bias", Value::from(false));
        put("hidden_size", Value::from(self.hidden_size));
        put("num_hidden_layers", Value::from(self.num_hidden_layers));
        put("num_attention_heads", Value::from(self.num_attention_heads));
        put("num_key_value_heads", Value::from(self.num_key_value_heads));
        put("head_dim", Value::from(self.head_dim));
        put("intermediate_size", Value::from(self.intermediate_size));
        put("vocab_size", Value::from(self.vocab_size));
        put("rms_norm_eps", Value::from(self.rms_norm_eps));
        put("rope_theta", Value::from(self.rope_theta));
        put("tie_word_embeddings", Value::from(self.tie_word_embeddings));
        put(
            "max_position_embeddings",
            Value::from(self.max_position_embeddings),
        );
        put(
            "rope_scaling",
            match &self.rope_scaling {
                None => Value::Null,
                Some(s) => serde_json::json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }),
            },
        );
        if let Some(dtype) = &self.torch_dtype {
            put("torch_dtype", Value::from(dtype.as_str()));
        }
        Value::Object(map)
    }

    /// The config as pretty-printed JSON text.
    pub fn to_json_string(&self) -> String {
        // Serialising a `Value` of strings, numbers and maps cannot fail; the fallback is unreachable.
        serde_json::to_string_pretty(&self.to_json_value()).unwrap_or_default()
    }

    /// Writes the config to `path` (a file name, typically `DIR/config.json`).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), HfError> {
        let path = path.as_ref();
        let mut text = self.to_json_string();
        text.push('\n');
        std::fs::write(path, text).map_err(|e| HfError::io(path, e))
    }

    /// Checks that the sizes are non-zero and fit together (the query heads a multiple of the key/value
    /// heads), and that the RoPE and norm constants are usable.
    pub fn validate(&self) -> Result<(), HfError> {
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(HfError::Config(format!("{name} is 0")));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(HfError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(HfError::Config(format!(
                "rms_norm_eps {} is not a positive number",
                self.rms_norm_eps
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(HfError::Config(format!(
                "rope_theta {} is not a positive number",
                self.rope_theta
            )));
        }
        if let Some(s) = &self.rope_scaling {
            let positive = |v: f64| v.is_finite() && v > 0.0;
            if !(positive(s.factor) && s.factor >= 1.0) {
                return Err(HfError::Config(format!(
                    "rope_scaling factor {} is below 1",
                    s.factor
                )));
            }
            if !(positive(s.low_freq_factor)
                && positive(s.high_freq_factor)
                && s.low_freq_factor < s.high_freq_factor)
            {
                return Err(HfError::Config(format!(
                    "rope_scaling low_freq_factor {} and high_freq_factor {} must be positive, low below \
                     high",
                    s.low_freq_factor, s.high_freq_factor
                )));
            }
            if s.original_max_position_embeddings == 0 {
                return Err(HfError::Config(
                    "rope_scaling original_max_position_embeddings is 0".into(),
                ));
            }
        }
        Ok(())
    }

    fn from_map(mut map: Map<String, Value>) -> Result<Self, HfError> {
        check_architecture(&map)?;
        check_exact(&map, "model_type", &Value::from(LLAMA_MODEL_TYPE))?;
        check_exact(&map, "hidden_act", &Value::from("silu"))?;
        check_exact(&map, "attention_bias", &Value::from(false))?;
        check_exact(&map, "mlp_bias", &Value::from(false))?;
        let hidden_size = required_usize(&map, "hidden_size")?;
        let num_attention_heads = required_usize(&map, "num_attention_heads")?;
        let head_dim = match optional_usize(&map, "head_dim")? {
            Some(d) => d,
            None => {
                if num_attention_heads == 0 || hidden_size % num_attention_heads != 0 {
                    return Err(HfError::Config(format!(
                        "no head_dim, and hidden_size {hidden_size} is not a multiple of \
                         num_attention_heads {num_attention_heads}"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };
        let torch_dtype = match (map.get("torch_dtype"), map.get("dtype")) {
            (Some(v), _) | (None, Some(v)) if !v.is_null() => Some(
                v.as_str()
                    .ok_or_else(|| HfError::Config(format!("torch_dtype {v} is not a string")))?
                    .to_string(),
            ),
            _ => None,
        };
        let config = LlamaHfConfig {
            hidden_size,
            num_hidden_layers: required_usize(&map, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: optional_usize(&map, "num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            head_dim,
            intermediate_size: required_usize(&map, "intermediate_size")?,
            vocab_size: required_usize(&map, "vocab_size")?,
            rms_norm_eps: optional_f64(&map, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: rope_theta(&map)?.unwrap_or(10000.0),
            rope_scaling: rope_scaling_of(&map)?,
            tie_word_embeddings: match map.get("tie_word_embeddings") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(HfError::Config(format!(
                        "tie_word_embeddings {v} is not true or false"
                    )))
                }
            },
            max_position_embeddings: optional_usize(&map, "max_position_embeddings")?
                .unwrap_or(2048),
            torch_dtype,
            extra: BTreeMap::new(),
        };
        for key in KNOWN_KEYS {
            map.remove(*key);
        }
        let config = LlamaHfConfig {
            extra: map.into_iter().collect(),
            ..config
        };
        config.validate()?;
        Ok(config)
    }
}

fn check_architecture(map: &Map<String, Value>) -> Result<(), HfError> {
    match map.get("architectures") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(names)) if names.iter().any(|n| n == LLAMA_ARCHITECTURE) => Ok(()),
        Some(other) => Err(HfError::Config(format!(
            "architectures is {other}, not [\"{LLAMA_ARCHITECTURE}\"]"
        ))),
    }
}

/// A key that, when present and not null, must hold exactly `expected`.
fn check_exact(map: &Map<String, Value>, key: &str, expected: &Value) -> Result<(), HfError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if v == expected => Ok(()),
        Some(v) => Err(HfError::Config(format!(
            "{key} is {v}; this model supports only {expected}"
        ))),
    }
}

fn optional_usize(map: &Map<String, Value>, key: &str) -> Result<Option<usize>, HfError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| HfError::Config(format!("{key} {v} is not a non-negative integer"))),
    }
}

fn required_usize(map: &Map<String, Value>, key: &str) -> Result<usize, HfError> {
    optional_usize(map, key)?.ok_or_else(|| HfError::Config(format!("{key} is missing")))
}

fn optional_f64(map: &Map<String, Value>, key: &str) -> Result<Option<f64>, HfError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| HfError::Config(format!("{key} {v} is not a number"))),
    }
}

/// `rope_parameters`, where transformers 5 writes RoPE's settings (`rope_theta`, `rope_type` and the
/// scaling parameters in one object) instead of the top-level `rope_theta` and `rope_scaling`.
fn rope_parameters(map: &Map<String, Value>) -> Result<Option<&Map<String, Value>>, HfError> {
    match map.get("rope_parameters") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(params)) => Ok(Some(params)),
        Some(other) => Err(HfError::Config(format!(
            "rope_parameters {other} is not an object"
        ))),
    }
}

/// `rope_theta`, top-level or in `rope_parameters`; both present must agree.
fn rope_theta(map: &Map<String, Value>) -> Result<Option<f64>, HfError> {
    let top = optional_f64(map, "rope_theta")?;
    let nested = match rope_parameters(map)? {
        Some(params) => optional_f64(params, "rope_theta")?,
        None => None,
    };
    match (top, nested) {
        (Some(a), Some(b)) if a != b => Err(HfError::Config(format!(
            "rope_theta {a} and rope_parameters.rope_theta {b} differ"
        ))),
        (top, nested) => Ok(top.or(nested)),
    }
}

/// The RoPE scaling from `rope_scaling` or `rope_parameters` (read alike); both present must agree.
fn rope_scaling_of(map: &Map<String, Value>) -> Result<Option<Llama3RopeScaling>, HfError> {
    let top = rope_scaling(map.get("rope_scaling"))?;
    let Some(params) = rope_parameters(map)? else {
        return Ok(top);
    };
    // Without a type the object holds only `rope_theta`: no scaling.
    let nested = if params.contains_key("rope_type") || params.contains_key("type") {
        rope_scaling(Some(&Value::Object(params.clone())))?
    } else {
        None
    };
    if map.get("rope_scaling").is_some_and(|v| !v.is_null()) && top != nested {
        return Err(HfError::Config(format!(
            "rope_scaling {top:?} and rope_parameters {nested:?} differ"
        )));
    }
    Ok(nested)
}

/// `rope_scaling`: null, `{"rope_type": "default"}` (no scaling) or the four `llama3` parameters; the
/// type may be under the older key `type`.
fn rope_scaling(value: Option<&Value>) -> Result<Option<Llama3RopeScaling>, HfError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(HfError::Config(format!(
                "rope_scaling {other} is not an object"
            )))
        }
    };
    let kind = map
        .get("rope_type")
        .or_else(|| map.get("type"))
        .ok_or_else(|| HfError::Config("rope_scaling has no rope_type".into()))?;
    let kind = kind
        .as_str()
        .ok_or_else(|| HfError::Config(format!("rope_scaling rope_type {kind} is not a string")))?;
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let field = |key: &str| {
                optional_f64(map, key)?
                    .ok_or_else(|| HfError::Config(format!("rope_scaling (llama3) has no {key}")))
            };
            let original =
                optional_usize(map, "original_max_position_embeddings")?.ok_or_else(|| {
                    HfError::Config(
                        "rope_scaling (llama3) has no original_max_position_embeddings".into(),
                    )
                })?;
            Ok(Some(Llama3RopeScaling {
                factor: field("factor")?,
                low_freq_factor: field("low_freq_factor")?,
                high_freq_factor: field("high_freq_factor")?,
                original_max_position_embeddings: original,
            }))
        }
        other => Err(HfError::UnsupportedRopeScaling {
            rope_type: other.to_string(),
        }),
    }
}
