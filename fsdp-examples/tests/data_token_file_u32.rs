//! llm.c's Llama 3 token files (magic 20240801, version 7, u32 tokens): written bytes against the format
//! written out by hand, read back mapped; GPT-2's u16 files still read, by both readers; each reader
//! refuses what it cannot hold, naming the file and the field.

mod scratch;

use scratch::scratch_dir;
use std::path::Path;

use fsdp_examples::data::tokens::{
    encode_token_file_u32, write_token_file, write_token_file_u32, TokenDataError, TokenFile,
    TokenFileU32, TokenFormat, GPT2_VOCAB_SIZE, TOKEN_FILE_HEADER_BYTES,
};
use proptest::prelude::*;

/// Llama 3's vocabulary: 128000 byte-pair ids and 256 special tokens.
const LLAMA3_VOCAB_SIZE: u32 = 128256;

/// The u32 format written out by hand: 256 little-endian i32 (magic, version, count, zeros), then u32
/// tokens.
fn reference_u32_file(magic: i32, version: i32, count: i32, tokens: &[u32]) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    let mut out: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    out.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    out
}

fn open_u32_err(path: &Path, vocab: u32) -> TokenDataError {
    let err = TokenFileU32::open(path, vocab).unwrap_err();
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "the message names the file: {err}"
    );
    err
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn u32_files_match_the_format_and_read_back_mapped(
        tokens in prop::collection::vec(0u32..LLAMA3_VOCAB_SIZE, 0..3000)
    ) {
        let dir = scratch_dir("u32-roundtrip");
        let path = dir.join("t.bin");
        write_token_file_u32(&path, &tokens).unwrap();
        let expected = reference_u32_file(20240801, 7, tokens.len() as i32, &tokens);
        prop_assert_eq!(std::fs::read(&path).unwrap(), expected.clone());
        prop_assert_eq!(encode_token_file_u32(&tokens).unwrap(), expected);
        let file = TokenFileU32::open(&path, LLAMA3_VOCAB_SIZE).unwrap();
        prop_assert_eq!(file.tokens(), &tokens[..]);
        prop_assert_eq!(file.format(), TokenFormat::U32);
        prop_assert_eq!(file.len(), tokens.len());
        prop_assert_eq!(file.is_mapped(), cfg!(target_endian = "little"));
        prop_assert!(!dir.join("t.bin.partial").exists());
    }
}

#[test]
fn ids_above_65535_survive_and_the_largest_u32_too() {
    let dir = scratch_dir("u32-large");
    let path = dir.join("large.bin");
    let tokens = [0, 65535, 65536, 128255, 1 << 24, u32::MAX - 1];
    write_token_file_u32(&path, &tokens).unwrap();
    let file = TokenFileU32::open(&path, u32::MAX).unwrap();
    assert_eq!(file.tokens(), tokens);
}

#[test]
fn a_u16_file_still_reads_and_widens_for_the_u32_reader() {
    let dir = scratch_dir("u32-widen");
    let path = dir.join("gpt2.bin");
    let tokens: Vec<u16> = (0..3000u16).map(|i| i * 16).collect();
    write_token_file(&path, &tokens).unwrap();
    let narrow = TokenFile::open(&path, GPT2_VOCAB_SIZE).unwrap();
    assert_eq!(narrow.tokens(), &tokens[..]);
    assert_eq!(narrow.format(), TokenFormat::U16);
    let wide = TokenFileU32::open(&path, GPT2_VOCAB_SIZE).unwrap();
    let widened: Vec<u32> = tokens.iter().map(|&t| u32::from(t)).collect();
    assert_eq!(wide.tokens(), &widened[..]);
    assert_eq!(wide.format(), TokenFormat::U16);
    assert!(!wide.is_mapped(), "a widened file is a copy");
    // The u16 reader's offsets are 2 bytes a token, also through the u32 reader.
    match open_u32_err(&path, 16 * 100) {
        TokenDataError::TokenOutOfRange { index, offset, .. } => {
            assert_eq!(
                (index, offset),
                (100, (TOKEN_FILE_HEADER_BYTES + 200) as u64)
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_u16_reader_refuses_a_u32_file_pointing_at_the_u32_reader() {
    let dir = scratch_dir("u32-narrow");
    let path = dir.join("llama.bin");
    write_token_file_u32(&path, &[1, 2, 3]).unwrap();
    let err = TokenFile::open(&path, GPT2_VOCAB_SIZE).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("u32 tokens") && msg.contains("TokenFileU32") && msg.contains("llama.bin"),
        "{msg}"
    );
    assert!(matches!(err, TokenDataError::BadHeader { .. }), "{err:?}");
}

#[test]
fn u32_headers_counts_and_ids_are_checked_with_offsets() {
    let dir = scratch_dir("u32-bad");
    let put = |name: &str, bytes: Vec<u8>| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    // Each magic with the other format's version.
    for (magic, version, want) in [(20240801, 1, "version 1"), (20240520, 7, "version 7")] {
        let path = put("version.bin", reference_u32_file(magic, version, 0, &[]));
        match open_u32_err(&path, LLAMA3_VOCAB_SIZE) {
            TokenDataError::BadHeader { offset, reason, .. } => {
                assert_eq!(offset, 4);
                assert!(reason.contains(want), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Four bytes a token: 12 promised, 10 present.
    let tokens: Vec<u32> = (0..10).map(|i| 70000 + i).collect();
    let path = put("short.bin", reference_u32_file(20240801, 7, 12, &tokens));
    match open_u32_err(&path, LLAMA3_VOCAB_SIZE) {
        TokenDataError::Truncated {
            expected, found, ..
        } => assert_eq!((expected, found), (1024 + 48, 1024 + 40)),
        other => panic!("{other:?}"),
    }
    let path = put("long.bin", reference_u32_file(20240801, 7, 9, &tokens));
    match open_u32_err(&path, LLAMA3_VOCAB_SIZE) {
        TokenDataError::TrailingBytes { offset, extra, .. } => {
            assert_eq!((offset, extra), (1024 + 36, 4))
        }
        other => panic!("{other:?}"),
    }
    // The first id not below the vocabulary, at 4 bytes a token.
    let mut ids = vec![5u32; 50];
    ids[20] = LLAMA3_VOCAB_SIZE - 1;
    ids[33] = LLAMA3_VOCAB_SIZE;
    let path = put("ids.bin", reference_u32_file(20240801, 7, 50, &ids));
    match open_u32_err(&path, LLAMA3_VOCAB_SIZE) {
        TokenDataError::TokenOutOfRange {
            index, offset, id, ..
        } => assert_eq!(
            (index, offset, id),
            (
                33,
                (TOKEN_FILE_HEADER_BYTES + 4 * 33) as u64,
                LLAMA3_VOCAB_SIZE
            )
        ),
        other => panic!("{other:?}"),
    }
}
