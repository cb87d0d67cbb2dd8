//! Token files in llm.c's format: write them, and open them as a validated, memory-mapped token slice.
//!
//! | bytes | meaning |
//! | --- | --- |
//! | 0 .. 4 | magic, little-endian `i32`: `20240520` (GPT-2) or `20240801` (Llama 3) |
//! | 4 .. 8 | version: `1` with magic `20240520` (`u16` tokens), `7` with magic `20240801` (`u32` tokens) |
//! | 8 .. 12 | token count `n`, little-endian `i32` |
//! | 12 .. 1024 | the rest of the 256-`i32` header, written as zeros and not read |
//! | 1024 .. 1024 + 2n or 4n | the tokens, little-endian `u16` or `u32` |
//!
//! These are the two formats of llm.c's `dev/data/data_common.py` (`HEADERS_INFO`: `"gpt-2"` and
//! `"llama-3"`), which PyTorch peers read with `torch.from_file(path, size=256, dtype=torch.int32)`. Any
//! other magic or version is refused (llm.c never wrote a version 2). Vocabularies above 65536 ids (Llama
//! 3's 128256) need the `u32` format.
//!
//! [`TokenFile`] opens `u16` files in place; a `u32` file is refused with a pointer to [`TokenFileU32`],
//! which opens `u32` files in place and `u16` files too, widened into a copy.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::TokenDataError;
use crate::data::partial_file::write_via_partial;

/// The magic number of GPT-2 (`u16`) token files.
pub const TOKEN_FILE_MAGIC: i32 = 20240520;
/// The version of GPT-2 (`u16`) token files.
pub const TOKEN_FILE_VERSION: i32 = 1;
/// The magic number of Llama 3 (`u32`) token files.
pub const TOKEN_FILE_U32_MAGIC: i32 = 20240801;
/// The version of Llama 3 (`u32`) token files.
pub const TOKEN_FILE_U32_VERSION: i32 = 7;
/// The header's size in bytes (256 `i32`).
pub const TOKEN_FILE_HEADER_BYTES: usize = 1024;
/// The number of ids of GPT-2's tokenizer (r50k_base): 50256 byte-pair merges and bytes, plus
/// `<|endoftext|>`. Models pad their embedding to 50304, but a file never holds an id above 50256.
pub const GPT2_VOCAB_SIZE: u32 = 50257;
/// GPT-2's `<|endoftext|>` token, written after each document.
pub const GPT2_END_OF_TEXT: u16 = 50256;

/// The two token file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenFormat {
    /// Magic 20240520, version 1, `u16` tokens (GPT-2).
    U16,
    /// Magic 20240801, version 7, `u32` tokens (Llama 3).
    U32,
}

impl TokenFormat {
    /// The header's magic number.
    pub fn magic(self) -> i32 {
        match self {
            TokenFormat::U16 => TOKEN_FILE_MAGIC,
            TokenFormat::U32 => TOKEN_FILE_U32_MAGIC,
        }
    }

    /// The header's version.
    pub fn version(self) -> i32 {
        match self {
            TokenFormat::U16 => TOKEN_FILE_VERSION,
            TokenFormat::U32 => TOKEN_FILE_U32_VERSION,
        }
    }

    /// Bytes per token.
    pub fn token_bytes(self) -> usize {
        match self {
            TokenFormat::U16 => 2,
            TokenFormat::U32 => 4,
        }
    }
}

/// A token id type of a file: `u16` or `u32` (sealed).
pub trait TokenId: bytemuck::Pod + Into<u32> + private::Sealed {
    /// The format that stores this type.
    const FORMAT: TokenFormat;
    /// Writes this token as little-endian bytes into `out` (exactly its size).
    fn put_le(self, out: &mut [u8]);
    /// A token of this type from little-endian bytes of `format` (a `u16` widened, never narrowed: the
    /// caller refuses a `u32` file for `u16` tokens before decoding).
    fn from_le(bytes: &[u8], format: TokenFormat) -> Self;
}

mod private {
    pub trait Sealed {}
    impl Sealed for u16 {}
    impl Sealed for u32 {}
}

impl TokenId for u16 {
    const FORMAT: TokenFormat = TokenFormat::U16;
    fn put_le(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
    fn from_le(bytes: &[u8], _format: TokenFormat) -> Self {
        u16::from_le_bytes([bytes[0], bytes[1]])
    }
}

impl TokenId for u32 {
    const FORMAT: TokenFormat = TokenFormat::U32;
    fn put_le(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
    fn from_le(bytes: &[u8], format: TokenFormat) -> Self {
        match format {
            TokenFormat::U16 => u32::from(u16::from_le_bytes([bytes[0], bytes[1]])),
            TokenFormat::U32 => u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
        }
    }
}

fn encode_tokens<T: TokenId>(tokens: &[T], what: &'static str) -> Result<Vec<u8>, TokenDataError> {
    let count = i32::try_from(tokens.len()).map_err(|_| {
        TokenDataError::invalid(
            what,
            format!(
                "{} tokens do not fit the header's i32 count (at most {})",
                tokens.len(),
                i32::MAX
            ),
        )
    })?;
    let width = T::FORMAT.token_bytes();
    let mut bytes = vec![0u8; TOKEN_FILE_HEADER_BYTES + width * tokens.len()];
    bytes[0..4].copy_from_slice(&T::FORMAT.magic().to_le_bytes());
    bytes[4..8].copy_from_slice(&T::FORMAT.version().to_le_bytes());
    bytes[8..12].copy_from_slice(&count.to_le_bytes());
    for (out, t) in bytes[TOKEN_FILE_HEADER_BYTES..]
        .chunks_exact_mut(width)
        .zip(tokens)
    {
        t.put_le(out);
    }
    Ok(bytes)
}

/// The bytes of a `u16` token file holding `tokens`: the header, then the tokens.
pub fn encode_token_file(tokens: &[u16]) -> Result<Vec<u8>, TokenDataError> {
    encode_tokens(tokens, "encode_token_file")
}

/// The bytes of a `u32` token file (magic 20240801, version 7) holding `tokens`.
pub fn encode_token_file_u32(tokens: &[u32]) -> Result<Vec<u8>, TokenDataError> {
    encode_tokens(tokens, "encode_token_file_u32")
}

/// Writes `tokens` as a `u16` token file at `path`, under a temporary name first (`path` + `.partial`)
/// and then renamed, so an interrupted run never leaves a complete-looking file.
pub fn write_token_file(path: impl AsRef<Path>, tokens: &[u16]) -> Result<(), TokenDataError> {
    write_bytes(path.as_ref(), &encode_token_file(tokens)?)
}

/// Writes `tokens` as a `u32` token file at `path`, as [`write_token_file`] does.
pub fn write_token_file_u32(path: impl AsRef<Path>, tokens: &[u32]) -> Result<(), TokenDataError> {
    write_bytes(path.as_ref(), &encode_token_file_u32(tokens)?)
}

fn write_bytes(path: &Path, bytes: &[u8]) -> Result<(), TokenDataError> {
    write_via_partial(path, |mut writer| {
        writer.write_all(bytes)?;
        Ok(writer)
    })
    .map_err(|(path, source)| TokenDataError::Io { path, source })
}

/// What a valid header says: the format and the token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenHeader {
    /// The format (from the magic and version).
    pub format: TokenFormat,
    /// The number of tokens after the header.
    pub count: usize,
}

/// Checks the header of a token file of `file_len` bytes (magic and version of one of the two formats,
/// count against the length) and returns what it says.
///
/// `header` holds the file's first bytes (at least 12 are read when the file has them).
pub fn validate_token_header(
    header: &[u8],
    file_len: u64,
    path: &Path,
) -> Result<TokenHeader, TokenDataError> {
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
    let format = match magic {
        TOKEN_FILE_MAGIC => TokenFormat::U16,
        TOKEN_FILE_U32_MAGIC => TokenFormat::U32,
        _ => {
            return Err(bad(
                0,
                format!(
                    "magic number {magic}, expected {TOKEN_FILE_MAGIC} (u16 tokens) or \
                     {TOKEN_FILE_U32_MAGIC} (u32 tokens): not an llm.c token file"
                ),
            ))
        }
    };
    let version = field(4);
    if version != format.version() {
        return Err(bad(
            4,
            format!(
                "version {version}, expected {} for magic {magic} (llm.c writes version \
                 {TOKEN_FILE_VERSION} with u16 tokens, {TOKEN_FILE_U32_VERSION} with u32 tokens)",
                format.version()
            ),
        ));
    }
    let count = field(8);
    let count =
        u64::try_from(count).map_err(|_| bad(8, format!("token count {count} is negative")))?;
    let width = format.token_bytes() as u64;
    let expected = header_len + width * count;
    if file_len < expected {
        return Err(TokenDataError::Truncated {
            path: path.to_path_buf(),
            what: format!(
                "the header's {count} tokens of {width} bytes after the 1024-byte header"
            ),
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
    let count =
        usize::try_from(count).map_err(|_| bad(8, format!("token count {count} exceeds usize")))?;
    Ok(TokenHeader { format, count })
}

fn header_truncated(path: &Path, file_len: u64) -> TokenDataError {
    TokenDataError::Truncated {
        path: path.to_path_buf(),
        what: "the 256 x i32 header of an llm.c token file".into(),
        expected: TOKEN_FILE_HEADER_BYTES as u64,
        found: file_len,
    }
}

/// Checks that every id of `tokens` (read from a file of `format`) is below `vocab_size`; the error names
/// the first offender, its index and its byte offset in the file.
pub fn validate_token_ids<T: TokenId>(
    tokens: &[T],
    format: TokenFormat,
    vocab_size: u32,
    path: &Path,
) -> Result<(), TokenDataError> {
    match tokens.iter().position(|&t| t.into() >= vocab_size) {
        None => Ok(()),
        Some(index) => Err(TokenDataError::TokenOutOfRange {
            path: path.to_path_buf(),
            index: index as u64,
            offset: (TOKEN_FILE_HEADER_BYTES + format.token_bytes() * index) as u64,
            id: tokens[index].into(),
            vocab_size,
        }),
    }
}

/// Where the tokens of an open file live.
enum TokenStorage<T> {
    /// The file's pages, shared with every other process (rank) that maps the same file.
    Mapped(Mmap),
    /// A decoded copy, used only where the mapped bytes cannot be viewed as `T` in place (a big-endian
    /// host, or a `u16` file opened for `u32` tokens).
    Owned(Vec<T>),
}

/// An open, validated token file of `T` tokens: its header checked against its length, and every token
/// id below the vocabulary size given to [`TokenFileOf::open`]. Use it as [`TokenFile`] (`u16`) or
/// [`TokenFileU32`].
///
/// The file is memory-mapped rather than read: the ranks of a host (one process per GPU) then share one
/// copy of the data in the page cache instead of each holding its own, and opening costs no copy, only the
/// one validation pass over the ids. Ranks that are threads of one process share a token file through an
/// `Arc` (it is `Send + Sync`).
///
/// The mapping assumes the file is not modified while open (as for any data file being trained on):
/// another process truncating or rewriting it would change the bytes under the validated slice.
pub struct TokenFileOf<T: TokenId> {
    path: PathBuf,
    storage: TokenStorage<T>,
    format: TokenFormat,
    count: usize,
}

/// A file of `u16` tokens (GPT-2's format); a `u32` file is refused.
pub type TokenFile = TokenFileOf<u16>;
/// A file read as `u32` tokens: Llama 3's format in place, GPT-2's widened into a copy.
pub type TokenFileU32 = TokenFileOf<u32>;

impl<T: TokenId> std::fmt::Debug for TokenFileOf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("tokens", &self.count)
            .field("mapped", &matches!(self.storage, TokenStorage::Mapped(_)))
            .finish()
    }
}

impl<T: TokenId> TokenFileOf<T> {
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
        let TokenHeader { format, count } =
            validate_token_header(&map[..], map.len() as u64, path)?;
        if format.token_bytes() > T::FORMAT.token_bytes() {
            return Err(TokenDataError::BadHeader {
                path: path.to_path_buf(),
                offset: 0,
                reason: format!(
                    "magic {} version {}: the file holds u32 tokens; open it as TokenFileU32",
                    format.magic(),
                    format.version()
                ),
            });
        }
        let width = format.token_bytes();
        let payload = &map[TOKEN_FILE_HEADER_BYTES..TOKEN_FILE_HEADER_BYTES + width * count];
        let in_place = format == T::FORMAT
            && cfg!(target_endian = "little")
            && bytemuck::try_cast_slice::<u8, T>(payload).is_ok();
        let storage = if in_place {
            TokenStorage::Mapped(map)
        } else {
            TokenStorage::Owned(
                payload
                    .chunks_exact(width)
                    .map(|b| T::from_le(b, format))
                    .collect(),
            )
        };
        let file = TokenFileOf {
            path: path.to_path_buf(),
            storage,
            format,
            count,
        };
        validate_token_ids(file.tokens(), format, vocab_size, path)?;
        Ok(file)
    }

    /// The tokens, in file order.
    pub fn tokens(&self) -> &[T] {
        match &self.storage {
            TokenStorage::Mapped(map) => {
                let payload = &map[TOKEN_FILE_HEADER_BYTES
                    ..TOKEN_FILE_HEADER_BYTES + T::FORMAT.token_bytes() * self.count];
                // `open` maps only when this cast succeeds (little-endian host, the file's own width,
                // an aligned payload: a page-aligned map plus 1024); the empty fallback is unreachable.
                bytemuck::try_cast_slice(payload).unwrap_or(&[])
            }
            TokenStorage::Owned(tokens) => tokens,
        }
    }

    /// The file's format (a [`TokenFileU32`] may hold a `u16` file).
    pub fn format(&self) -> TokenFormat {
        self.format
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

    /// Whether the tokens are viewed in the mapped pages (true on little-endian hosts when the file's
    /// width is `T`'s) rather than copied.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, TokenStorage::Mapped(_))
    }
}
