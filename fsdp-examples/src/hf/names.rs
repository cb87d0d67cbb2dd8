//! The map between our tensor names (fused projections) and Hugging Face's `LlamaForCausalLM` names.
//!
//! Ours differ in two places per layer; every other name is Hugging Face's:
//!
//! | ours | Hugging Face, by rows of ours |
//! | --- | --- |
//! | `model.layers.N.self_attn.qkv_proj.weight` | `q_proj.weight` rows `0..H*d`, `k_proj.weight` rows `H*d..(H+K)*d`, `v_proj.weight` rows `(H+K)*d..(H+2K)*d` |
//! | `model.layers.N.mlp.gate_up_proj.weight` | `gate_proj.weight` rows `0..I`, `up_proj.weight` rows `I..2I` |
//!
//! (`H` query heads, `K` key/value heads, `d` = `head_dim`, `I` = `intermediate_size`; the Hugging Face
//! names are under the same `model.layers.N.self_attn.` / `model.layers.N.mlp.` prefix.) With
//! `tie_word_embeddings` neither side has `lm_head.weight`; an imported tied checkpoint that holds one
//! anyway is accepted when it equals `model.embed_tokens.weight` bit for bit. The rotary tables some older
//! checkpoints saved (`model.layers.N.self_attn.rotary_emb.inv_freq`) are computed, not learned, and are
//! skipped on import.

use std::collections::HashSet;
use std::ops::Range;

use super::config::LlamaHfConfig;
use super::error::{HfError, TensorSetMismatch};
use super::tensors::{HfTensor, TensorSet};

/// The embedding's name (on both sides).
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// The untied head's name (on both sides).
pub const LM_HEAD: &str = "lm_head.weight";
/// The final norm's name (on both sides).
pub const FINAL_NORM: &str = "model.norm.weight";
/// The suffix of rotary tables in older checkpoints, skipped on import.
pub const ROTARY_INV_FREQ_SUFFIX: &str = ".self_attn.rotary_emb.inv_freq";

/// One Hugging Face tensor of ours: its name and the rows of ours it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfPart {
    /// The Hugging Face name.
    pub hf_name: String,
    /// The rows of our tensor it holds (all of them for a tensor that is not fused).
    pub rows: Range<usize>,
}

/// One tensor of ours: name, shape, and the Hugging Face tensors it is made of, in row order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameMapEntry {
    /// Our name.
    pub name: String,
    /// Our shape (`[rows, columns]`, or `[width]` for a norm).
    pub shape: Vec<usize>,
    /// The Hugging Face tensors, covering the rows in order; one part with our name for most tensors.
    pub parts: Vec<HfPart>,
}

impl NameMapEntry {
    /// The shape of `part` (our shape with the part's row count).
    pub fn part_shape(&self, part: &HfPart) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if let Some(rows) = shape.first_mut() {
            *rows = part.rows.len();
        }
        shape
    }
}

/// Every tensor of a `LlamaForCausalLM` of one config, in the model's order (embedding, layers, final
/// norm, head), with its Hugging Face parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaNameMap {
    entries: Vec<NameMapEntry>,
    tied: bool,
}

impl LlamaNameMap {
    /// The map of the model `config` describes.
    pub fn new(config: &LlamaHfConfig) -> Self {
        let h = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let inter = config.intermediate_size;
        let mut entries = Vec::with_capacity(9 * config.num_hidden_layers + 3);
        let whole = |name: String, shape: Vec<usize>| NameMapEntry {
            parts: vec![HfPart {
                hf_name: name.clone(),
                rows: 0..shape[0],
            }],
            name,
            shape,
        };
        let fused = |name: String, cols: usize, parts: &[(String, usize)]| {
            let mut start = 0;
            let parts = parts
                .iter()
                .map(|(hf_name, rows)| {
                    let part = HfPart {
                        hf_name: hf_name.clone(),
                        rows: start..start + rows,
                    };
                    start += rows;
                    part
                })
                .collect();
            NameMapEntry {
                name,
                shape: vec![start, cols],
                parts,
            }
        };
        entries.push(whole(EMBED_TOKENS.into(), vec![config.vocab_size, h]));
        for n in 0..config.num_hidden_layers {
            let layer = format!("model.layers.{n}");
            let attn = format!("{layer}.self_attn");
            let mlp = format!("{layer}.mlp");
            entries.push(whole(format!("{layer}.input_layernorm.weight"), vec![h]));
            entries.push(fused(
                format!("{attn}.qkv_proj.weight"),
                h,
                &[
                    (format!("{attn}.q_proj.weight"), q),
                    (format!("{attn}.k_proj.weight"), kv),
                    (format!("{attn}.v_proj.weight"), kv),
                ],
            ));
            entries.push(whole(format!("{attn}.o_proj.weight"), vec![h, q]));
            entries.push(whole(
                format!("{layer}.post_attention_layernorm.weight"),
                vec![h],
            ));
            entries.push(fused(
                format!("{mlp}.gate_up_proj.weight"),
                h,
                &[
                    (format!("{mlp}.gate_proj.weight"), inter),
                    (format!("{mlp}.up_proj.weight"), inter),
                ],
            ));
            entries.push(whole(format!("{mlp}.down_proj.weight"), vec![h, inter]));
        }
        entries.push(whole(FINAL_NORM.into(), vec![h]));
        if !config.tie_word_embeddings {
            entries.push(whole(LM_HEAD.into(), vec![config.vocab_size, h]));
        }
        LlamaNameMap {
            entries,
            tied: config.tie_word_embeddings,
        }
    }

    /// Our tensors, in the model's order.
    pub fn entries(&self) -> &[NameMapEntry] {
        &self.entries
    }

    /// Whether the head is tied to the embedding.
    pub fn is_tied(&self) -> bool {
        self.tied
    }

    /// Every Hugging Face name with its shape, in the model's order.
    pub fn hf_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.entries
            .iter()
            .flat_map(|e| e.parts.iter().map(|p| (p.hf_name.clone(), e.part_shape(p))))
            .collect()
    }

    /// Export: our tensors (exactly the map's names and shapes) split into Hugging Face's, in the model's
    /// order, each in its own element type.
    pub fn to_hf(&self, ours: &TensorSet) -> Result<TensorSet, HfError> {
        let mut mismatch = TensorSetMismatch {
            context: "our tensors".into(),
            ..TensorSetMismatch::default()
        };
        for e in &self.entries {
            match ours.get(&e.name) {
                None => mismatch.missing.push(e.name.clone()),
                Some(t) => check_shape(&mut mismatch, &e.name, t, &e.shape),
            }
        }
        let known: HashSet<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
        mismatch.extra = unknown_names(ours, &known, |_| false);
        if !mismatch.is_empty() {
            return Err(mismatch.into());
        }
        let mut hf = TensorSet::new();
        for e in &self.entries {
            let Some(t) = ours.get(&e.name) else { continue };
            for p in &e.parts {
                let piece = if e.parts.len() == 1 {
                    t.clone()
                } else {
                    t.rows(p.rows.start, p.rows.end)?
                };
                hf.insert(p.hf_name.clone(), piece)?;
            }
        }
        Ok(hf)
    }

    /// Import: Hugging Face's tensors concatenated into ours, in the model's order. Every expected name
    /// must be present with its shape, the parts of one fused tensor in one element type, and nothing
    /// else (but a tied head equal to the embedding, and rotary tables); the error lists every
    /// difference.
    pub fn from_hf(&self, hf: &TensorSet) -> Result<TensorSet, HfError> {
        let mut mismatch = TensorSetMismatch {
            context: "the Hugging Face checkpoint".into(),
            ..TensorSetMismatch::default()
        };
        for e in &self.entries {
            let mut dtypes = Vec::new();
            for p in &e.parts {
                match hf.get(&p.hf_name) {
                    None => mismatch.missing.push(p.hf_name.clone()),
                    Some(t) => {
                        check_shape(&mut mismatch, &p.hf_name, t, &e.part_shape(p));
                        dtypes.push(t.dtype());
                    }
                }
            }
            if dtypes.windows(2).any(|w| w[0] != w[1]) {
                let names: Vec<&str> = e.parts.iter().map(|p| p.hf_name.as_str()).collect();
                mismatch.wrong.push(format!(
                    "{} have different element types {dtypes:?} (they are fused into {})",
                    names.join(", "),
                    e.name
                ));
            }
        }
        let known: HashSet<&str> = self
            .entries
            .iter()
            .flat_map(|e| e.parts.iter().map(|p| p.hf_name.as_str()))
            .collect();
        let tied = self.tied;
        mismatch.extra = unknown_names(hf, &known, |n| {
            n.ends_with(ROTARY_INV_FREQ_SUFFIX) || (tied && n == LM_HEAD)
        });
        if tied {
            if let (Some(head), Some(embed)) = (hf.get(LM_HEAD), hf.get(EMBED_TOKENS)) {
                if head != embed {
                    mismatch.wrong.push(format!(
                        "{LM_HEAD}: differs from {EMBED_TOKENS} although tie_word_embeddings is true"
                    ));
                }
            }
        }
        if !mismatch.is_empty() {
            return Err(mismatch.into());
        }
        let mut ours = TensorSet::new();
        for e in &self.entries {
            let parts = e
                .parts
                .iter()
                .filter_map(|p| hf.get(&p.hf_name))
                .collect::<Vec<&HfTensor>>();
            let tensor = match parts.as_slice() {
                [one] => (*one).clone(),
                _ => HfTensor::concat_rows(&parts)?,
            };
            ours.insert(e.name.clone(), tensor)?;
        }
        Ok(ours)
    }
}

fn check_shape(mismatch: &mut TensorSetMismatch, name: &str, t: &HfTensor, shape: &[usize]) {
    if t.shape() != shape {
        mismatch.wrong.push(format!(
            "{name} has shape {:?}, expected {shape:?}",
            t.shape()
        ));
    }
}

/// The names of `set` neither in `known` nor allowed by `skip`, sorted.
fn unknown_names(
    set: &TensorSet,
    known: &HashSet<&str>,
    skip: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut extra: Vec<String> = set
        .names()
        .filter(|n| !known.contains(n) && !skip(n))
        .map(str::to_string)
        .collect();
    extra.sort_unstable();
    extra
}
