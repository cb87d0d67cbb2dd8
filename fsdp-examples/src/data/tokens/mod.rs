//! Token data for language models: llm.c's token files, training and validation windows, GPT-2's
//! tokenizer, and the Shakespeare corpus of the GPT example.
//!
//! - [`file`](mod@file): [`TokenFile::open`] maps a `u16` token file and validates its header and every
//!   id; [`TokenFileU32`] does the same for Llama 3's `u32` files (and reads `u16` ones widened);
//!   [`write_token_file`] and [`write_token_file_u32`] write them.
//! - [`windows`]: [`TrainWindowSampler`] (seeded random windows per step and rank, resumable from a
//!   `u64`), [`ValidationWindows`] (every non-overlapping window, in batches), [`unigram_entropy_nats`].
//! - [`gpt2_bpe`]: [`Gpt2Bpe`], GPT-2's BPE (r50k_base) for encoding the corpus and decoding samples.
//! - [`hf_tokenizer`]: [`HfTokenizer`], a Hugging Face `tokenizer.json` (Llama 3's BPE), and the
//!   document encoding, split and format choice of the `hf_tokenize` binary.
//! - [`shakespeare`]: the corpus's file selection, order and split, its token counts and SHA-256.
//!
//! Get the data with `scripts/fetch-shakespeare.sh` (writes `data/shakespeare/`); a slice is committed in
//! this crate's `testdata/shakespeare/` ([`committed_shakespeare_slice_dir`]). See `docs/gpt-data.md`.
//!
//! ```
//! use fsdp_examples::data::tokens::{encode_token_file, TrainWindowSampler, ValidationWindows};
//!
//! let tokens: Vec<u16> = (0..100).collect();
//! let bytes = encode_token_file(&tokens)?;
//! assert_eq!(bytes.len(), 1024 + 2 * 100);
//!
//! // Two random windows of 8 per step; the position alone resumes the sequence.
//! let mut sampler = TrainWindowSampler::new(tokens.len(), 8, 2, 1, 0)?;
//! let (mut x, mut y) = (vec![0i32; 16], vec![0i32; 16]);
//! let first = sampler.fill_next(&tokens, &mut x, &mut y)?;
//! assert_eq!(y[0], x[0] + 1);
//! let saved = sampler.position();
//! let next = sampler.next_starts();
//! sampler.set_position(saved);
//! assert_eq!(sampler.next_starts(), next);
//! assert!(first.iter().all(|&s| s < 100 - 8 - 1));
//!
//! // Validation: (100 - 1) / 8 = 12 windows, in batches of 5, 5 and 2.
//! let val = ValidationWindows::new(tokens.len(), 8, 5)?;
//! assert_eq!((val.window_count(), val.batch_count()), (12, 3));
//! assert_eq!(val.batch_starts(2), [80, 88]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod error;
pub mod file;
pub mod gpt2_bpe;
pub mod hf_tokenizer;
pub mod shakespeare;
pub mod windows;

pub use error::{TokenDataError, SHAKESPEARE_FETCH_COMMAND};
pub use file::{
    encode_token_file, encode_token_file_u32, validate_token_header, validate_token_ids,
    write_token_file, write_token_file_u32, TokenFile, TokenFileOf, TokenFileU32, TokenFormat,
    TokenHeader, TokenId, GPT2_END_OF_TEXT, GPT2_VOCAB_SIZE, TOKEN_FILE_HEADER_BYTES,
    TOKEN_FILE_MAGIC, TOKEN_FILE_U32_MAGIC, TOKEN_FILE_U32_VERSION, TOKEN_FILE_VERSION,
};
pub use gpt2_bpe::Gpt2Bpe;
pub use hf_tokenizer::{
    choose_format, split_point, text_input_files, write_token_split, DocumentMarkers,
    EncodedDocuments, HfTokenizeError, HfTokenizer, SplitAt, ValFraction, WrittenTokenFile,
    U16_ID_LIMIT,
};
pub use shakespeare::{
    committed_shakespeare_slice_dir, read_utf8_text, shakespeare_text_files, split_train_val,
    train_val_split_index, DEFAULT_SHAKESPEARE_DIR, SHAKESPEARE_TEXT_COUNT,
    SHAKESPEARE_TEXT_SUFFIX, SHAKESPEARE_TRAIN_SHA256, SHAKESPEARE_TRAIN_TOKENS,
    SHAKESPEARE_VAL_SHA256, SHAKESPEARE_VAL_TOKENS,
};
pub use windows::{
    fill_windows, unigram_cross_entropy_nats, unigram_entropy_nats, TrainWindowSampler,
    ValidationWindows,
};
