//! The error type of Hugging Face interop: configs, tensor name maps and safetensors directories.

use std::path::PathBuf;

/// Everything that can go wrong while reading or writing a Hugging Face checkpoint.
///
/// Variants about a file name it; tensor set mismatches list every offending name at once, so one run
/// shows all that is wrong with a checkpoint.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum HfError {
    /// The operating system refused a read or write.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config.json, the shard index) is not valid JSON of the expected shape.
    #[error("{}: {reason}", path.display())]
    Json { path: PathBuf, reason: String },
    /// A config holds values this model cannot use (zero sizes, heads that do not divide, a bias).
    #[error("Llama config: {0}")]
    Config(String),
    /// `rope_scaling` names a type other than `llama3` (or `default`).
    #[error(
        "Llama config: rope_scaling type {rope_type:?} is not supported (only \"llama3\", or \"default\" \
         for none)"
    )]
    UnsupportedRopeScaling { rope_type: String },
    /// A safetensors file that cannot be parsed or written, or a tensor in it of an unusable type.
    #[error("{}: {reason}", path.display())]
    Safetensors { path: PathBuf, reason: String },
    /// A directory that holds neither `model.safetensors` nor an index, or an index that does not match
    /// its shard files.
    #[error("{}: {reason}", path.display())]
    Layout { path: PathBuf, reason: String },
    /// A tensor set whose names or shapes do not match the model's.
    #[error("{0}")]
    Mismatch(#[from] TensorSetMismatch),
    /// A tensor whose bytes do not fit its shape and type, or arguments that do not fit together.
    #[error("{what}: {detail}")]
    InvalidArgument { what: &'static str, detail: String },
}

impl HfError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        HfError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        HfError::InvalidArgument {
            what,
            detail: detail.into(),
        }
    }
}

/// Every way a tensor set differs from what a model expects: the names it lacks, the names it has
/// beyond them, and the tensors of the wrong shape, type or value. Empty lists mean no difference.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TensorSetMismatch {
    /// What was checked (e.g. "Hugging Face checkpoint", "our tensors").
    pub context: String,
    /// Expected names the set lacks, in the model's order.
    pub missing: Vec<String>,
    /// Names the set holds that the model does not have, sorted.
    pub extra: Vec<String>,
    /// `name: what is wrong` for the tensors present under the right name but unusable.
    pub wrong: Vec<String>,
}

impl TensorSetMismatch {
    /// Whether nothing differs.
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.wrong.is_empty()
    }
}

impl std::fmt::Display for TensorSetMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} does not match the model:", self.context)?;
        if !self.missing.is_empty() {
            write!(f, " missing {}", self.missing.join(", "))?;
        }
        if !self.extra.is_empty() {
            let sep = if self.missing.is_empty() { "" } else { ";" };
            write!(f, "{sep} unexpected {}", self.extra.join(", "))?;
        }
        if !self.wrong.is_empty() {
            let sep = if self.missing.is_empty() && self.extra.is_empty() {
                ""
            } else {
                ";"
            };
            write!(f, "{sep} {}", self.wrong.join("; "))?;
        }
        Ok(())
    }
}

impl std::error::Error for TensorSetMismatch {}
