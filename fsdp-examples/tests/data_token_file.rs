//! llm.c token files, GPT-2's (u16) and Llama 3's (magic 20240801, version 7, u32): the written bytes
//! against an encoder written from the format description, read back mapped; GPT-2's files read by both
//! readers; and a clear error (file, byte offset, what is wrong) for every kind of bad file.

mod scratch;

use scratch::scratch_dir;
use std::path::{Path, PathBuf};

use fsdp_examples::data::tokens::{
    encode_token_file, encode_token_file_u32, write_token_file, write_token_file_u32,
    TokenDataError, TokenFile, TokenFileU32, TokenFormat, GPT2_VOCAB_SIZE,
    SHAKESPEARE_FETCH_COMMAND, TOKEN_FILE_HEADER_BYTES,
};
use proptest::prelude::*;

/// The format written out by hand: 256 little-endian i32 (magic, version, count, zeros), then u16 tokens.
fn reference_file(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    let mut out: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    out.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    out
}

fn put(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn open_err(path: &Path, vocab: u32) -> TokenDataError {
    let err = TokenFile::open(path, vocab).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&path.display().to_string()),
        "the message names the file: {message}"
    );
    err
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn written_files_match_the_format_and_read_back(
        tokens in prop::collection::vec(0u16..50257, 0..3000)
    ) {
        let dir = scratch_dir("roundtrip");
        let path = dir.join("t.bin");
        write_token_file(&path, &tokens).unwrap();
        let expected = reference_file(20240520, 1, tokens.len() as i32, &tokens);
        prop_assert_eq!(std::fs::read(&path).unwrap(), expected.clone());
        prop_assert_eq!(encode_token_file(&tokens).unwrap(), expected);
        let file = TokenFile::open(&path, GPT2_VOCAB_SIZE).unwrap();
        prop_assert_eq!(file.tokens(), &tokens[..]);
        prop_assert_eq!(file.len(), tokens.len());
        prop_assert_eq!(file.is_empty(), tokens.is_empty());
        prop_assert_eq!(file.is_mapped(), cfg!(target_endian = "little"));
        prop_assert!(!dir.join("t.bin.partial").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_missing_file_names_the_fetch_script() {
    let dir = scratch_dir("missing");
    let err = open_err(&dir.join("train.bin"), GPT2_VOCAB_SIZE);
    assert!(matches!(err, TokenDataError::Missing { .. }), "{err:?}");
    assert!(err.to_string().contains(SHAKESPEARE_FETCH_COMMAND));
}

#[test]
fn a_file_shorter_than_the_header_is_truncated() {
    let dir = scratch_dir("short");
    for len in [0usize, 11, 12, 1023] {
        let bytes = reference_file(20240520, 1, 0, &[]);
        let path = put(&dir, "short.bin", &bytes[..len]);
        match open_err(&path, GPT2_VOCAB_SIZE) {
            TokenDataError::Truncated {
                expected, found, ..
            } => assert_eq!((expected, found), (1024, len as u64)),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_wrong_magic_version_or_negative_count_names_the_field_offset() {
    let dir = scratch_dir("header");
    let cases = [
        (
            reference_file(20240521, 1, 2, &[1, 2]),
            0u64,
            "magic number 20240521",
        ),
        (
            reference_file(0x3f00_0000, 1, 2, &[1, 2]),
            0,
            "not an llm.c token file",
        ),
        (reference_file(20240520, 2, 2, &[1, 2]), 4, "version 2"),
        (reference_file(20240520, 1, -3, &[]), 8, "token count -3"),
    ];
    for (bytes, want_offset, want_text) in cases {
        let path = put(&dir, "bad.bin", &bytes);
        let err = open_err(&path, GPT2_VOCAB_SIZE);
        assert!(err.to_string().contains(want_text), "{err}");
        match err {
            TokenDataError::BadHeader { offset, .. } => assert_eq!(offset, want_offset),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_count_that_disagrees_with_the_length_is_reported_both_ways() {
    let dir = scratch_dir("count");
    let tokens: Vec<u16> = (0..10).collect();
    // The header promises 12 tokens, the file holds 10: truncated.
    let path = put(&dir, "short.bin", &reference_file(20240520, 1, 12, &tokens));
    match open_err(&path, GPT2_VOCAB_SIZE) {
        TokenDataError::Truncated {
            expected, found, ..
        } => assert_eq!((expected, found), (1024 + 24, 1024 + 20)),
        other => panic!("{other:?}"),
    }
    // The header promises 7: three tokens too many, from byte 1038 on.
    let path = put(&dir, "long.bin", &reference_file(20240520, 1, 7, &tokens));
    match open_err(&path, GPT2_VOCAB_SIZE) {
        TokenDataError::TrailingBytes {
            count,
            offset,
            extra,
            ..
        } => assert_eq!((count, offset, extra), (7, 1038, 6)),
        other => panic!("{other:?}"),
    }
    // An odd byte after the tokens.
    let mut bytes = reference_file(20240520, 1, 10, &tokens);
    bytes.push(0);
    let path = put(&dir, "odd.bin", &bytes);
    assert!(matches!(
        open_err(&path, GPT2_VOCAB_SIZE),
        TokenDataError::TrailingBytes { extra: 1, .. }
    ));
}

#[test]
fn the_first_id_outside_the_vocabulary_is_named_with_its_offset() {
    let dir = scratch_dir("ids");
    let mut tokens = vec![7u16; 100];
    tokens[40] = 50256; // the largest GPT-2 id is fine
    tokens[63] = 50257; // the first one past the vocabulary
    tokens[80] = 65535;
    let path = put(&dir, "ids.bin", &reference_file(20240520, 1, 100, &tokens));
    let err = open_err(&path, GPT2_VOCAB_SIZE);
    assert!(err.to_string().contains("byte offset 1150"), "{err}");
    match err {
        TokenDataError::TokenOutOfRange {
            index,
            offset,
            id,
            vocab_size,
            ..
        } => assert_eq!(
            (index, offset, id, vocab_size),
            (63, (TOKEN_FILE_HEADER_BYTES + 126) as u64, 50257, 50257)
        ),
        other => panic!("{other:?}"),
    }
    // The same file is valid for a vocabulary that holds every id.
    assert_eq!(TokenFile::open(&path, 65536).unwrap().len(), 100);
    // And a smaller vocabulary catches the first 7.
    match open_err(&path, 7) {
        TokenDataError::TokenOutOfRange { index, .. } => assert_eq!(index, 0),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_empty_token_file_opens() {
    let dir = scratch_dir("empty");
    let path = dir.join("empty.bin");
    write_token_file(&path, &[]).unwrap();
    let file = TokenFile::open(&path, GPT2_VOCAB_SIZE).unwrap();
    assert!(file.is_empty());
    assert_eq!(file.tokens(), &[] as &[u16]);
}

#[test]
fn ranks_as_threads_share_one_open_file() {
    let dir = scratch_dir("shared");
    let path = dir.join("s.bin");
    let tokens: Vec<u16> = (0..5000u16).collect();
    write_token_file(&path, &tokens).unwrap();
    let file = std::sync::Arc::new(TokenFile::open(&path, GPT2_VOCAB_SIZE).unwrap());
    let sums: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let file = std::sync::Arc::clone(&file);
                s.spawn(move || file.tokens().iter().map(|&t| u64::from(t)).sum())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![4999 * 5000 / 2; 3]);
}

/// Llama 3's vocabulary: 128000 byte-pair ids and 256 special tokens.
const LLAMA3_VOCAB_SIZE: u32 = 128256;

/// The u32 format written out by hand: the header of [`reference_file`], then u32 tokens.
fn reference_u32_file(magic: i32, version: i32, count: i32, tokens: &[u32]) -> Vec<u8> {
    let mut out = reference_file(magic, version, count, &[]);
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
