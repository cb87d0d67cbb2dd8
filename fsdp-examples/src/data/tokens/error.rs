//! The error type of the token data pipeline (token files, windows, the GPT-2 tokenizer, the Shakespeare
//! corpus). Separate from MNIST's [`crate::data::DataError`] because its cases (header fields, token ids at byte
//! offsets, tokenizer failures) have nothing in common with IDX files.

use std::path::PathBuf;

/// The command that downloads the Shakespeare corpus and writes `train.bin` and `val.bin`.
pub const SHAKESPEARE_FETCH_COMMAND: &str = "scripts/fetch-shakespeare.sh";

/// Everything that can go wrong while reading, writing or windowing token data.
///
/// Every variant that concerns a file names it, and every variant about a place in a file gives its byte
/// offset, so a user sees which file is bad, where, and why.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum TokenDataError {
    /// A token file does not exist.
    #[error(
        "{} not found: run `{SHAKESPEARE_FETCH_COMMAND}` to download the Shakespeare corpus and write \
         train.bin and val.bin",
        path.display()
    )]
    Missing { path: PathBuf },
    /// The operating system refused a read, write or mapping.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A header field (magic, version, token count) holds a value this format does not allow.
    #[error("{}: byte offset {offset}: {reason}", path.display())]
    BadHeader {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// The file is shorter than its header (or the header's token count) requires.
    #[error(
        "{}: truncated: {expected} bytes expected ({what}), the file holds {found}; delete it and run \
         `{SHAKESPEARE_FETCH_COMMAND}` again",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        what: String,
        expected: u64,
        found: u64,
    },
    /// The file is longer than the header's token count says (a foreign or corrupt file).
    #[error(
        "{}: {extra} unexpected bytes from byte offset {offset} on: the header promises {count} tokens \
         ({offset} bytes in all)",
        path.display()
    )]
    TrailingBytes {
        path: PathBuf,
        count: u64,
        offset: u64,
        extra: u64,
    },
    /// A token id is not below the vocabulary size.
    #[error(
        "{}: byte offset {offset} (token {index}): id {id} is not below the vocabulary size {vocab_size}",
        path.display()
    )]
    TokenOutOfRange {
        path: PathBuf,
        index: u64,
        offset: u64,
        id: u32,
        vocab_size: u32,
    },
    /// A text file of a corpus cannot be used (not UTF-8, or the wrong set of files).
    #[error("{}: {reason}", path.display())]
    Corpus { path: PathBuf, reason: String },
    /// The tokenizer failed (its vocabulary could not be built, or an id has no bytes to decode to).
    #[error("GPT-2 tokenizer: {0}")]
    Tokenizer(String),
    /// Arguments that do not fit together (window lengths, batch sizes, buffer sizes).
    #[error("{what}: {detail}")]
    InvalidArgument { what: &'static str, detail: String },
}

impl TokenDataError {
    /// Wraps an I/O error, turning "not found" into [`TokenDataError::Missing`] with the fetch hint.
    pub(crate) fn from_io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            TokenDataError::Missing { path }
        } else {
            TokenDataError::Io { path, source }
        }
    }

    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        TokenDataError::InvalidArgument {
            what,
            detail: detail.into(),
        }
    }
}
