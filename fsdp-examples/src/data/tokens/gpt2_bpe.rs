//! GPT-2's byte-pair encoding (tiktoken's `r50k_base`), through the `tiktoken-rs` crate: encoding text
//! as ordinary text (special-token strings are not interpreted) and decoding generated ids back to text.
//!
//! `tiktoken-rs` compiles the ranks into the binary (its `assets/r50k_base.tiktoken`, SHA-256
//! `306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930`, the file tiktoken downloads), so
//! nothing is fetched at run time; the crate's version is pinned in `Cargo.lock`.

use rayon::prelude::*;
use tiktoken_rs::CoreBPE;

use super::error::TokenDataError;
use super::file::{GPT2_END_OF_TEXT, GPT2_VOCAB_SIZE};

/// GPT-2's tokenizer. Building it parses the 50k ranks (tens of milliseconds); build it once and share it.
pub struct Gpt2Bpe {
    bpe: CoreBPE,
}

impl std::fmt::Debug for Gpt2Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Bpe(r50k_base)")
    }
}

impl Gpt2Bpe {
    /// Builds the tokenizer from the ranks compiled into `tiktoken-rs`.
    pub fn new() -> Result<Self, TokenDataError> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| TokenDataError::Tokenizer(e.to_string()))?;
        Ok(Gpt2Bpe { bpe })
    }

    /// Encodes `text` as ordinary text: `<|endoftext|>` in the text is encoded as its characters, never
    /// as the special token (tiktoken's `encode_ordinary`).
    pub fn encode_ordinary(&self, text: &str) -> Result<Vec<u16>, TokenDataError> {
        self.bpe
            .encode_ordinary(text)
            .into_iter()
            .map(|id| {
                u16::try_from(id)
                    .ok()
                    .filter(|&t| u32::from(t) < GPT2_VOCAB_SIZE)
                    .ok_or_else(|| {
                        TokenDataError::Tokenizer(format!(
                            "id {id} is outside GPT-2's {GPT2_VOCAB_SIZE} ids"
                        ))
                    })
            })
            .collect()
    }

    /// Encodes each document as ordinary text and appends `<|endoftext|>` (50256) after each, in order.
    /// Documents are encoded independently, so in parallel; the result does not depend on the threads.
    pub fn encode_documents<S: AsRef<str> + Sync>(
        &self,
        documents: &[S],
    ) -> Result<Vec<u16>, TokenDataError> {
        let encoded = documents
            .par_iter()
            .map(|d| self.encode_ordinary(d.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut tokens = Vec::with_capacity(encoded.iter().map(|e| e.len() + 1).sum());
        for doc in encoded {
            tokens.extend(doc);
            tokens.push(GPT2_END_OF_TEXT);
        }
        Ok(tokens)
    }

    /// The bytes the ids stand for, concatenated (`<|endoftext|>` included as its 13 characters).
    pub fn decode_bytes(&self, ids: &[u16]) -> Result<Vec<u8>, TokenDataError> {
        let ids: Vec<u32> = ids.iter().map(|&t| u32::from(t)).collect();
        self.bpe.decode_bytes(&ids).map_err(|e| {
            TokenDataError::Tokenizer(format!(
                "id {} is not in GPT-2's vocabulary (0 .. {GPT2_VOCAB_SIZE}): a model with a padded \
                 vocabulary sampled a padding id",
                e.token
            ))
        })
    }

    /// Decodes generated ids to text. A byte-pair token can hold part of a multi-byte character, so an
    /// arbitrary sequence need not be valid UTF-8: invalid bytes become U+FFFD, as in tiktoken's
    /// `decode(..., errors="replace")`. Ids above 50256 (the padding a model's 50304-row head allows)
    /// are an error.
    pub fn decode_lossy(&self, ids: &[u16]) -> Result<String, TokenDataError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}
