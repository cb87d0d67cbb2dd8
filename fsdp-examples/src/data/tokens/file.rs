//! Token files in llm.c's format: write them, and open them as a validated, memory-mapped token slice.
//!
//! | bytes | meaning |
//! | --- | --- |
//! | 0 .. 4 | magic `20240520`, little-endian `i32` |
//! | 4 .. 8 | version `1` (u16 tokens; llm.c's version 2 holds u32 tokens and is rejected here) |
//! | 8 .. 12 | token count `n`, little-endian `i32` |
//! | 12 .. 1024 | the rest of the 256-`i32` header, written as zeros and not read |
//! | 1024 .. 1024 + 2n | the tokens, little-endian `u16` |
//!
//! This is what llm.c's `dev/data/*.py` writes and what PyTorch peers read with
//! `torch.from_file(path, size=256, dtype=torch.int32)`.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::TokenDataError;
use crate::data::partial_file::write_via_partial;

/// The magic number in the first header field.
pub const TOKEN_FILE_MAGIC: i32 = 20240520;
/// The only format version read and written: tokens are `u16`.
pub const TOKEN_FILE_VERSION: i32 = 1;
/// The header's size in bytes (256 `i32`).
pub const TOKEN_FILE_HEADER_BYTES: usize = 1024;
/// The number of ids of GPT-2's tokenizer (r50k_base): 50256 byte-pair merges and bytes, plus
/// `<|endoftext|>`. Models pad their embedding to 50304, but a file never holds an id above 50256.
pub const GPT2_VOCAB_SIZE: u32 = 50257;
/// GPT-2's `<|endoftext|>` token, written after each document.
pub const GPT2_END_OF_TEXT: u16 = 50256;

/// The bytes of a token file holding `tokens`: the header, then the tokens.
pub fn encode_token_file(tokens: &[u16]) -> Result<Vec<u8>, TokenDataError> {
    let count = i32::try_from(tokens.len()).map_err(|_| {
        TokenDataError::invalid(
            "encode_token_file",
            format!(
                "{} tokens do not fit the header's i32 count (at most {})",
                tokens.len(),
                i32::MAX
            ),
        )
    })?;
    let mut bytes = vec![0u8; TOKEN_FILE_HEADER_BYTES + 2 * tokens.len()];
    bytes[0..4].copy_from_slice(&TOKEN_FILE_MAGIC.to_le_bytes());
    bytes[4..8].copy_from_slice(&TOKEN_FILE_VERSION.to_le_bytes());
    bytes[8..12].copy_from_slice(&count.to_le_bytes());
    for (out, t) in bytes[TOKEN_FILE_HEADER_BYTES..]
        .chunks_exact_mut(2)
        .zip(tokens)
    {
        out.copy_from_slice(&t.to_le_bytes());
    }
    Ok(bytes)
}

/// Writes `tokens` as a token file at `path`, under a temporary name first (`path` + `.partial`) and then
/// renamed, so an interrupted run never leaves a complete-looking file.
pub fn write_token_file(path: impl AsRef<Path>, tokens: &[u16]) -> Result<(), TokenDataError> {
    let path = path.as_ref();
    let bytes = encode_token_file(tokens)?;
    write_via_partial(path, |mut writer| {
        writer.write_all(&bytes)?;
        Ok(writer)
    })
    .map_err(|(path, source)| TokenDataError::Io { path, source })
}

/// Checks the header of a token file of `file_len` bytes and returns its token count.
///
/// `header` holds the file's first bytes (at least 12 are read when the file has them).
pub fn validate_token_header(
    header: &[u8],
    file_len: u64,
    path: &Path,
) -> Result<usize, TokenDataError> {
    let header_len = TOKEN_FILE_HEADER_BYTES as u64;
    if file_len < header_len || header.len() < 12 {
        return Err(header_truncated(path, file_len));
    }
    let field =
        |i: usize| i32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let bad = |offset: u64, reason: String| TokenDataError::BadHeader {
        path: path.to_path_buf(),
        offset,
        reason,
    };
    let magic = field(0);
    if magic != TOKEN_FILE_MAGIC {
        return Err(bad(
            0,
            format!("magic number {magic}, expected {TOKEN_FILE_MAGIC}: not an llm.c token file"),
        ));
    }
    let version = field(4);
    if version != TOKEN_FILE_VERSION {
        return Err(bad(
            4,
            format!(
                "version {version}, expected {TOKEN_FILE_VERSION} (u16 tokens; version 2 files hold u32 \
                 tokens and are not supported)"
            ),
        ));
    }
    let count = field(8);
    let count =
        u64::try_from(count).map_err(|_| bad(8, format!("token count {count} is negative")))?;
    let expected = header_len + 2 * count;
    if file_len < expected {
        return Err(TokenDataError::Truncated {
            path: path.to_path_buf(),
            what: format!("the header's {count} tokens of 2 bytes after the 1024-byte header"),
            expected,
            found: file_len,
        });
    }
    if file_len > expected {
        return Err(TokenDataError::TrailingBytes {
            path: path.to_path_buf(),
            count,
            offset: expected,
            extra: file_len - expected,
        });
    }
    usize::try_from(count).map_err(|_| bad(8, format!("token count {count} exceeds usize")))
}

fn header_truncated(path: &Path, file_len: u64) -> TokenDataError {
    TokenDataError::Truncated {
        path: path.to_path_buf(),
        what: "the 256 x i32 header of an llm.c token file".into(),
        expected: TOKEN_FILE_HEADER_BYTES as u64,
        found: file_len,
    }
}

/// Checks that every id of `tokens` is below `vocab_size`; the error names the first offender, its index
/// and its byte offset in the file.
pub fn validate_token_ids(
    tokens: &[u16],
    vocab_size: u32,
    path: &Path,
) -> Result<(), TokenDataError> {
    match tokens.iter().position(|&t| u32::from(t) >= vocab_size) {
        None => Ok(()),
        Some(index) => Err(TokenDataError::TokenOutOfRange {
            path: path.to_path_buf(),
            index: index as u64,
            offset: (TOKEN_FILE_HEADER_BYTES + 2 * index) as u64,
            id: u32::from(tokens[index]),
            vocab_size,
        }),
    }
}

/// Where the tokens of an open file live.
enum TokenStorage {
    /// The file's pages, shared with every other process (rank) that maps the same file.
    Mapped(Mmap),
    /// A decoded copy, used only where the mapped bytes cannot be viewed as `u16` in place (a big-endian
    /// host). Little-endian hosts, every platform this project targets, never take this path.
    Owned(Vec<u16>),
}

/// An open, validated token file: its header checked against its length, and every token id below the
/// vocabulary size given to [`TokenFile::open`].
///
/// The file is memory-mapped rather than read: the ranks of a host (one process per GPU) then share one
/// copy of the data in the page cache instead of each holding its own, and opening costs no copy, only the
/// one validation pass over the ids. Ranks that are threads of one process share a `TokenFile` through an
/// `Arc` (it is `Send + Sync`).
///
/// The mapping assumes the file is not modified while open (as for any data file being trained on):
/// another process truncating or rewriting it would change the bytes under the validated slice.
pub struct TokenFile {
    path: PathBuf,
    storage: TokenStorage,
    count: usize,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("tokens", &self.count)
            .field("mapped", &matches!(self.storage, TokenStorage::Mapped(_)))
            .finish()
    }
}

impl TokenFile {
    /// Opens, maps and validates the token file at `path`: magic, version, and token count against the
    /// file's length, then every id against `vocab_size` ([`GPT2_VOCAB_SIZE`] for GPT-2's tokenizer).
    pub fn open(path: impl AsRef<Path>, vocab_size: u32) -> Result<Self, TokenDataError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| TokenDataError::from_io(path, e))?;
        let io = |e| TokenDataError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let file_len = file.metadata().map_err(io)?.len();
        if file_len < TOKEN_FILE_HEADER_BYTES as u64 {
            // Checked before mapping: an empty file cannot be mapped at all.
            return Err(header_truncated(path, file_len));
        }
        // SAFETY: mapping a file is sound as long as no one modifies it while mapped; token files are
        // read-only inputs, and the type's documentation states the assumption. All reads below go
        // through the bounds-checked slice the map derefs to.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let count = validate_token_header(&map[..], map.len() as u64, path)?;
        let payload = &map[TOKEN_FILE_HEADER_BYTES..TOKEN_FILE_HEADER_BYTES + 2 * count];
        let in_place =
            cfg!(target_endian = "little") && bytemuck::try_cast_slice::<u8, u16>(payload).is_ok();
        let storage = if in_place {
            TokenStorage::Mapped(map)
        } else {
            TokenStorage::Owned(
                payload
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            )
        };
        let file = TokenFile {
            path: path.to_path_buf(),
            storage,
            count,
        };
        validate_token_ids(file.tokens(), vocab_size, path)?;
        Ok(file)
    }

    /// The tokens, in file order.
    pub fn tokens(&self) -> &[u16] {
        match &self.storage {
            TokenStorage::Mapped(map) => {
                let payload =
                    &map[TOKEN_FILE_HEADER_BYTES..TOKEN_FILE_HEADER_BYTES + 2 * self.count];
                // `open` maps only when this cast succeeds (little-endian host, 2-byte-aligned payload:
                // a page-aligned map plus 1024); the empty fallback is unreachable.
                bytemuck::try_cast_slice(payload).unwrap_or(&[])
            }
            TokenStorage::Owned(tokens) => tokens,
        }
    }

    /// The number of tokens (the header's count).
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether the file holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the tokens are viewed in the mapped pages (true on little-endian hosts) rather than copied.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, TokenStorage::Mapped(_))
    }
}
