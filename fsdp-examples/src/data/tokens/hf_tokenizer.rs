//! Text to llm.c token files through a Hugging Face `tokenizer.json` (Llama 3's BPE, or any other the
//! `tokenizers` crate reads): the library side of the `hf_tokenize` binary.
//!
//! - [`HfTokenizer`] loads `tokenizer.json` and encodes documents with `add_special_tokens = false`: the
//!   tokenizer's post-processor (Llama 3's template adds `<|begin_of_text|>`) is not applied; BOS and
//!   EOS ids are added explicitly per document ([`DocumentMarkers`]).
//! - [`text_input_files`]: the documents, one per file (a directory contributes its `*.txt` files).
//! - [`split_point`]: where the stream is cut into `train.bin` and `val.bin` ([`ValFraction`],
//!   [`SplitAt`]).
//! - [`choose_format`] and [`write_token_split`]: `u16` files (magic 20240520) when the vocabulary fits,
//!   else `u32` (magic 20240801), written and read back.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use tokenizers::Tokenizer;

use super::error::TokenDataError;
use super::file::{write_token_file, write_token_file_u32, TokenFileU32, TokenFormat};
use super::shakespeare::read_utf8_text;

/// The number of ids a `u16` token file can hold (ids `0 ..= 65535`).
pub const U16_ID_LIMIT: u32 = 1 << 16;

/// Texts read and encoded per group: bounds the text held in memory at once, and sets how often
/// progress is reported.
const GROUP_TEXT_BYTES: u64 = 32 << 20;

/// Everything that can go wrong between a `tokenizer.json`, text files and token files.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum HfTokenizeError {
    /// The tokenizer file does not exist.
    #[error("{}: no such tokenizer file (give a tokenizer.json or a directory holding one)", path.display())]
    TokenizerMissing { path: PathBuf },
    /// The tokenizer file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The tokenizer file is not a tokenizer the `tokenizers` crate can load.
    #[error("{}: not a Hugging Face tokenizer.json: {reason}", path.display())]
    BadTokenizer { path: PathBuf, reason: String },
    /// The tokenizer failed on a document.
    #[error("{}: encoding failed: {reason}", path.display())]
    Encode { path: PathBuf, reason: String },
    /// A BOS or EOS token given by its text is not in the vocabulary.
    #[error("{what} token {token:?} is not in the tokenizer's vocabulary")]
    UnknownToken { what: &'static str, token: String },
    /// A BOS or EOS id given by number is not below the tokenizer's id bound.
    #[error("{what} id {id} is not below the tokenizer's vocabulary size {vocab_size}")]
    IdOutOfVocabulary {
        what: &'static str,
        id: u32,
        vocab_size: u32,
    },
    /// An id does not fit a `u16` token file, which was asked for.
    #[error(
        "id {id} (token {index} of the stream, in {}) does not fit a u16 token file (ids below 65536); \
         use --format u32 or --format auto",
        document.display()
    )]
    IdTooLargeForU16 {
        id: u32,
        index: usize,
        document: PathBuf,
    },
    /// A token file read back does not hold what was written.
    #[error("{}: read back differs from what was written", path.display())]
    ReadBackMismatch { path: PathBuf },
    /// No input, or inputs that give nothing to split.
    #[error("{0}")]
    Input(String),
    /// Reading a text or writing or reading back a token file failed.
    #[error(transparent)]
    TokenData(#[from] TokenDataError),
}

/// A Hugging Face tokenizer loaded from its `tokenizer.json`.
pub struct HfTokenizer {
    tokenizer: Tokenizer,
    path: PathBuf,
    vocab_size: u32,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads `path`: a `tokenizer.json`, or a directory holding one (a Hugging Face model directory).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, HfTokenizeError> {
        let given = path.as_ref();
        let path = if given.is_dir() {
            given.join("tokenizer.json")
        } else {
            given.to_path_buf()
        };
        let bytes = std::fs::read(&path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                HfTokenizeError::TokenizerMissing { path: path.clone() }
            } else {
                HfTokenizeError::Io {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        let tokenizer =
            Tokenizer::from_bytes(&bytes).map_err(|e| HfTokenizeError::BadTokenizer {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        // The bound every id lies below: one past the largest id of the model's vocabulary and the
        // added tokens (Llama 3: 128000 BPE ids and 256 special ones, 128256).
        let max_id = tokenizer.get_vocab(true).into_values().max();
        let vocab_size = match max_id.and_then(|id| id.checked_add(1)) {
            Some(n) => n,
            None => {
                return Err(HfTokenizeError::BadTokenizer {
                    path,
                    reason: "the vocabulary is empty or holds id 4294967295".into(),
                })
            }
        };
        Ok(HfTokenizer {
            tokenizer,
            path,
            vocab_size,
        })
    }

    /// The `tokenizer.json` this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One past the largest id the tokenizer can produce (its vocabulary with the added tokens).
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// The id of `token` (e.g. `<|end_of_text|>`), model vocabulary or added token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// A BOS or EOS marker: `token` looked up in the vocabulary, or `id` checked against it.
    pub fn marker(
        &self,
        what: &'static str,
        token: Option<&str>,
        id: Option<u32>,
    ) -> Result<Option<u32>, HfTokenizeError> {
        match (token, id) {
            (Some(token), _) => {
                self.token_id(token)
                    .map(Some)
                    .ok_or_else(|| HfTokenizeError::UnknownToken {
                        what,
                        token: token.to_string(),
                    })
            }
            (None, Some(id)) if id >= self.vocab_size => Err(HfTokenizeError::IdOutOfVocabulary {
                what,
                id,
                vocab_size: self.vocab_size,
            }),
            (None, id) => Ok(id),
        }
    }

    /// The ids of `text` without the tokenizer's special-token template (`add_special_tokens = false`).
    /// `source` names the text in errors.
    pub fn encode(&self, text: &str, source: &Path) -> Result<Vec<u32>, HfTokenizeError> {
        self.tokenizer
            .encode(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| HfTokenizeError::Encode {
                path: source.to_path_buf(),
                reason: e.to_string(),
            })
    }

    /// Encodes each file of `files` as one document (read as UTF-8, byte for byte), each wrapped in
    /// `markers`, into one stream in file order. `progress` is called with the text bytes encoded so
    /// far after each group of files.
    pub fn encode_files(
        &self,
        files: &[PathBuf],
        markers: DocumentMarkers,
        progress: &mut dyn FnMut(u64),
    ) -> Result<EncodedDocuments, HfTokenizeError> {
        let mut out = EncodedDocuments::default();
        let mut done_bytes = 0u64;
        let mut rest = files;
        while !rest.is_empty() {
            // A group: files until their sizes reach GROUP_TEXT_BYTES (at least one file).
            let mut group_bytes = 0u64;
            let mut take = 0;
            while take < rest.len() && (take == 0 || group_bytes < GROUP_TEXT_BYTES) {
                group_bytes += std::fs::metadata(&rest[take]).map_or(0, |m| m.len());
                take += 1;
            }
            let (group, tail) = rest.split_at(take);
            rest = tail;
            let encoded: Vec<(Vec<u32>, u64)> = group
                .par_iter()
                .map(|path| {
                    let text = read_utf8_text(path)?;
                    Ok((self.encode(&text, path)?, text.len() as u64))
                })
                .collect::<Result<_, HfTokenizeError>>()?;
            for (path, (ids, text_bytes)) in group.iter().zip(encoded) {
                out.push_document(path, &ids, markers);
                done_bytes += text_bytes;
            }
            progress(done_bytes);
        }
        Ok(out)
    }
}

/// Ids written around every document: BOS before it, EOS after it (either, both or neither).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DocumentMarkers {
    /// Written before each document (Llama 3: `<|begin_of_text|>`, 128000, as llm.c's data scripts do).
    pub bos: Option<u32>,
    /// Written after each document (Llama 3: `<|end_of_text|>`, 128001; GPT-2: `<|endoftext|>`).
    pub eos: Option<u32>,
}

/// A token stream of documents, with where each document ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedDocuments {
    /// The ids of all documents, in order, markers included.
    pub tokens: Vec<u32>,
    /// `ends[i]`: the index one past document `i`'s last token (its EOS when there is one).
    pub ends: Vec<usize>,
    /// The file each document came from.
    pub sources: Vec<PathBuf>,
}

impl EncodedDocuments {
    /// Appends one document: `markers.bos`, `ids`, `markers.eos`.
    pub fn push_document(&mut self, source: &Path, ids: &[u32], markers: DocumentMarkers) {
        self.tokens.extend(markers.bos);
        self.tokens.extend_from_slice(ids);
        self.tokens.extend(markers.eos);
        self.ends.push(self.tokens.len());
        self.sources.push(source.to_path_buf());
    }

    /// The file the token at `index` came from.
    pub fn source_of(&self, index: usize) -> Option<&Path> {
        let document = self.ends.partition_point(|&end| end <= index);
        self.sources.get(document).map(PathBuf::as_path)
    }
}

/// The documents named by `inputs`: a file is one document; a directory contributes its regular files
/// whose names end in `.txt` (not recursively), in byte order of their names. Inputs keep their order.
pub fn text_input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, HfTokenizeError> {
    let mut files = Vec::new();
    for input in inputs {
        let io = |source| HfTokenizeError::Io {
            path: input.clone(),
            source,
        };
        let meta = std::fs::metadata(input).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                HfTokenizeError::Input(format!("{}: no such file or directory", input.display()))
            } else {
                io(source)
            }
        })?;
        if !meta.is_dir() {
            files.push(input.clone());
            continue;
        }
        let mut found = Vec::new();
        for entry in std::fs::read_dir(input).map_err(io)? {
            let entry = entry.map_err(io)?;
            if entry.file_name().as_encoded_bytes().ends_with(b".txt")
                && entry.file_type().map_err(io)?.is_file()
            {
                found.push(entry.path());
            }
        }
        if found.is_empty() {
            return Err(HfTokenizeError::Input(format!(
                "{}: the directory holds no *.txt files",
                input.display()
            )));
        }
        found.sort_by(|a, b| {
            let name = |p: &PathBuf| p.file_name().map(|n| n.as_encoded_bytes().to_vec());
            name(a).cmp(&name(b))
        });
        files.extend(found);
    }
    if files.is_empty() {
        return Err(HfTokenizeError::Input("no input files given".into()));
    }
    Ok(files)
}

/// The fraction of the stream that goes to `val.bin`, an exact decimal (`0.1` is 1/10, so the split of
/// a stream of `n` tokens is computed in integers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValFraction {
    numerator: u64,
    denominator: u64,
}

impl ValFraction {
    /// Parses a decimal strictly between 0 and 1 with at most 18 digits after the point (`0.1`, `.05`).
    pub fn parse(text: &str) -> Result<Self, HfTokenizeError> {
        let bad = || {
            HfTokenizeError::Input(format!(
                "validation fraction {text:?}: expected a decimal strictly between 0 and 1 (e.g. 0.1)"
            ))
        };
        let (whole, digits) = text.split_once('.').ok_or_else(bad)?;
        let digits_ok = digits.len() <= 18 && digits.bytes().all(|b| b.is_ascii_digit());
        if !matches!(whole, "" | "0") || digits.is_empty() || !digits_ok {
            return Err(bad());
        }
        let numerator: u64 = digits.parse().map_err(|_| bad())?;
        if numerator == 0 {
            return Err(bad());
        }
        let exponent = u32::try_from(digits.len()).map_err(|_| bad())?;
        Ok(ValFraction {
            numerator,
            denominator: 10u64.pow(exponent),
        })
    }

    /// The training part of `n` tokens: `floor(n (1 - f))` (for `0.1`, `floor(0.9 n)`, the Shakespeare
    /// corpus's split).
    pub fn train_tokens(self, n: usize) -> usize {
        // u128: n < 2^64 and the factor < 10^18 < 2^60, so the product cannot overflow; the result is
        // at most n, so it fits back.
        (n as u128 * u128::from(self.denominator - self.numerator) / u128::from(self.denominator))
            as usize
    }
}

impl std::fmt::Display for ValFraction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.numerator as f64 / self.denominator as f64)
    }
}

/// Where the stream is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitAt {
    /// At token `floor(n (1 - f))`, whatever document it falls in (as the Shakespeare corpus is split).
    Token,
    /// At the document boundary nearest to token `floor(n (1 - f))` (the earlier one on a tie), so no
    /// document is shared between `train.bin` and `val.bin`.
    Document,
}

/// The index where `documents` is cut into `train.bin` (before it) and `val.bin`; both parts must be
/// non-empty.
pub fn split_point(
    documents: &EncodedDocuments,
    fraction: ValFraction,
    at: SplitAt,
) -> Result<usize, HfTokenizeError> {
    let n = documents.tokens.len();
    let target = fraction.train_tokens(n);
    let cut = match at {
        SplitAt::Token => target,
        SplitAt::Document => documents
            .ends
            .iter()
            .copied()
            .filter(|&end| 0 < end && end < n)
            .min_by_key(|&end| (end.abs_diff(target), end))
            .ok_or_else(|| {
                HfTokenizeError::Input(format!(
                    "{} documents ({n} tokens) have no boundary between their first and last token to \
                     split on; give more documents or split at a token (--split-at token)",
                    documents.ends.len()
                ))
            })?,
    };
    if cut == 0 || cut == n {
        return Err(HfTokenizeError::Input(format!(
            "{n} tokens split at {cut} (validation fraction {fraction}) leave {} empty; give more text \
             or another fraction",
            if cut == 0 { "train.bin" } else { "val.bin" }
        )));
    }
    Ok(cut)
}

/// The format to write: `requested`, or for `None` (auto) `u16` exactly when every id of a vocabulary
/// of `vocab_size` fits one (`vocab_size <= 65536`), else `u32`. Auto decides by the vocabulary, not the
/// ids met, so every file written with one tokenizer has the same format.
pub fn choose_format(requested: Option<TokenFormat>, vocab_size: u32) -> TokenFormat {
    match requested {
        Some(format) => format,
        None if vocab_size <= U16_ID_LIMIT => TokenFormat::U16,
        None => TokenFormat::U32,
    }
}

/// A token file written and read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenTokenFile {
    /// Where it was written.
    pub path: PathBuf,
    /// Its tokens.
    pub tokens: usize,
    /// Its format.
    pub format: TokenFormat,
}

/// Writes `documents` cut at `cut` as `out/train.bin` and `out/val.bin` in `format` (creating `out`),
/// then opens each with [`TokenFileU32`] (ids checked below `vocab_size`) and compares it with the
/// stream. A `u16` file refuses an id above 65535, naming it and its document.
pub fn write_token_split(
    out: &Path,
    documents: &EncodedDocuments,
    cut: usize,
    format: TokenFormat,
    vocab_size: u32,
) -> Result<[WrittenTokenFile; 2], HfTokenizeError> {
    let tokens = &documents.tokens;
    if cut > tokens.len() {
        return Err(HfTokenizeError::Input(format!(
            "split point {cut} is past the {} tokens",
            tokens.len()
        )));
    }
    let narrow = if format == TokenFormat::U16 {
        Some(narrow_to_u16(documents)?)
    } else {
        None
    };
    std::fs::create_dir_all(out).map_err(|source| HfTokenizeError::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let write_part = |name: &str, range: std::ops::Range<usize>| {
        let path = out.join(name);
        match &narrow {
            Some(ids) => write_token_file(&path, &ids[range.clone()])?,
            None => write_token_file_u32(&path, &tokens[range.clone()])?,
        }
        let back = TokenFileU32::open(&path, vocab_size)?;
        if back.format() != format || back.tokens() != &tokens[range.clone()] {
            return Err(HfTokenizeError::ReadBackMismatch { path });
        }
        Ok(WrittenTokenFile {
            path,
            tokens: range.len(),
            format,
        })
    };
    Ok([
        write_part("train.bin", 0..cut)?,
        write_part("val.bin", cut..tokens.len())?,
    ])
}

fn narrow_to_u16(documents: &EncodedDocuments) -> Result<Vec<u16>, HfTokenizeError> {
    documents
        .tokens
        .iter()
        .enumerate()
        .map(|(index, &id)| {
            u16::try_from(id).map_err(|_| HfTokenizeError::IdTooLargeForU16 {
                id,
                index,
                document: documents
                    .source_of(index)
                    .map_or_else(PathBuf::new, Path::to_path_buf),
            })
        })
        .collect()
}
