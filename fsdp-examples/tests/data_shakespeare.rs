//! GPT-2's tokenizer, the corpus's file selection and split, the `shakespeare_tokenize` binary end to end on
//! small texts, and the committed slice of the real token files (plus the full files when fetched).

mod scratch;

use scratch::scratch_dir;
use std::path::PathBuf;
use std::process::Command;

use fsdp_examples::data::tokens::{
    committed_shakespeare_slice_dir, read_utf8_text, shakespeare_text_files, split_train_val,
    train_val_split_index, unigram_entropy_nats, Gpt2Bpe, TokenDataError, TokenFile,
    TrainWindowSampler, ValidationWindows, GPT2_END_OF_TEXT, GPT2_VOCAB_SIZE,
    SHAKESPEARE_TRAIN_TOKENS, SHAKESPEARE_VAL_TOKENS,
};

#[test]
fn gpt2_encodes_known_ids_and_special_text_as_ordinary() {
    let bpe = Gpt2Bpe::new().unwrap();
    // GPT-2's ids for "Hello", " world" and "!".
    assert_eq!(
        bpe.encode_ordinary("Hello world!").unwrap(),
        [15496, 995, 0]
    );
    // The special token's text is encoded as characters, not as 50256.
    let special = bpe.encode_ordinary("<|endoftext|>").unwrap();
    assert!(special.len() > 1 && !special.contains(&GPT2_END_OF_TEXT));
    assert_eq!(bpe.decode_lossy(&special).unwrap(), "<|endoftext|>");
    // Documents are each followed by <|endoftext|>.
    let docs = ["To be, or not to be", "that is the question:"];
    let mut want = bpe.encode_ordinary(docs[0]).unwrap();
    want.push(GPT2_END_OF_TEXT);
    want.extend(bpe.encode_ordinary(docs[1]).unwrap());
    want.push(GPT2_END_OF_TEXT);
    assert_eq!(bpe.encode_documents(&docs).unwrap(), want);
    assert_eq!(
        bpe.decode_lossy(&want).unwrap(),
        "To be, or not to be<|endoftext|>that is the question:<|endoftext|>"
    );
}

#[test]
fn gpt2_decodes_partial_characters_lossily_and_rejects_padding_ids() {
    let bpe = Gpt2Bpe::new().unwrap();
    let ids = bpe.encode_ordinary("\u{2019}tis").unwrap();
    assert_eq!(bpe.decode_lossy(&ids).unwrap(), "\u{2019}tis");
    // U+2019 is three UTF-8 bytes, which GPT-2 splits over more than one token: the first alone is not text.
    assert!(bpe.decode_lossy(&ids[..1]).unwrap().contains('\u{FFFD}'));
    assert_eq!(bpe.decode_bytes(&ids).unwrap(), "\u{2019}tis".as_bytes());
    let err = bpe.decode_lossy(&[10, 50257]).unwrap_err();
    assert!(err.to_string().contains("50257"), "{err}");
}

#[test]
fn text_files_are_the_gut_texts_in_byte_order() {
    let dir = scratch_dir("files");
    for name in [
        "b_gut.txt",
        "a_gut.txt",
        "a_gut_f.txt",
        "B_gut.txt",
        "c.txt",
        "a_gut.txt.orig",
    ] {
        std::fs::write(dir.join(name), name).unwrap();
    }
    std::fs::create_dir(dir.join("d_gut.txt")).unwrap();
    let names: Vec<String> = shakespeare_text_files(&dir)
        .unwrap()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    // Byte order: upper case before lower case; folio spellings, other files and directories left out.
    assert_eq!(names, ["B_gut.txt", "a_gut.txt", "b_gut.txt"]);

    std::fs::write(dir.join("bad.txt"), b"fine\n\xff\xfe").unwrap();
    match read_utf8_text(dir.join("bad.txt")).unwrap_err() {
        TokenDataError::Corpus { reason, .. } => {
            assert!(reason.contains("byte offset 5"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(dir.join("crlf.txt"), b"a\r\nb").unwrap();
    assert_eq!(read_utf8_text(dir.join("crlf.txt")).unwrap(), "a\r\nb");
}

#[test]
fn the_split_is_the_floor_of_nine_tenths() {
    assert_eq!(
        train_val_split_index(SHAKESPEARE_TRAIN_TOKENS + SHAKESPEARE_VAL_TOKENS),
        SHAKESPEARE_TRAIN_TOKENS
    );
    for n in 0..2000usize {
        let k = train_val_split_index(n);
        // floor(0.9 n): 10k <= 9n < 10(k + 1).
        assert!(10 * k <= 9 * n && 9 * n < 10 * (k + 1), "n {n}: {k}");
    }
    assert_eq!(train_val_split_index(usize::MAX), usize::MAX / 10 * 9 + 4);
    let tokens: Vec<u16> = (0..25).collect();
    let (train, val) = split_train_val(&tokens);
    assert_eq!((train.len(), val[0]), (22, 22));
}

#[test]
fn the_tokenize_binary_encodes_splits_and_checks_counts() {
    let dir = scratch_dir("binary");
    let texts = dir.join("texts");
    std::fs::create_dir(&texts).unwrap();
    let docs = [
        ("b_gut.txt", "Now is the winter of our discontent\n"),
        ("a_gut.txt", "If music be the food of love, play on;\n"),
        ("a_gut_f.txt", "If musicke be the food of Loue, play on,\n"),
        ("c_gut.txt", "O Romeo, Romeo! wherefore art thou Romeo?\n"),
    ];
    for (name, text) in docs {
        std::fs::write(texts.join(name), text).unwrap();
    }
    let bpe = Gpt2Bpe::new().unwrap();
    let want = bpe
        .encode_documents(&[docs[1].1, docs[0].1, docs[3].1])
        .unwrap();
    let (want_train, want_val) = split_train_val(&want);
    let bin = env!("CARGO_BIN_EXE_shakespeare_tokenize");
    let out = dir.join("out");
    let run = |extra: &[&str]| {
        Command::new(bin)
            .args(["encode", "--texts", texts.to_str().unwrap()])
            .args(["--out", out.to_str().unwrap(), "--expect-files", "3"])
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = run(&[
        "--expect-train",
        &want_train.len().to_string(),
        "--expect-val",
        &want_val.len().to_string(),
    ]);
    assert!(ok.status.success(), "{ok:?}");
    let train = TokenFile::open(out.join("train.bin"), GPT2_VOCAB_SIZE).unwrap();
    let val = TokenFile::open(out.join("val.bin"), GPT2_VOCAB_SIZE).unwrap();
    assert_eq!(train.tokens(), want_train);
    assert_eq!(val.tokens(), want_val);

    let wrong = run(&["--expect-val", "1"]);
    assert!(!wrong.status.success());
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(stderr.contains("expected 1"), "{stderr}");

    // A slice of the written files.
    let sliced = dir.join("slice");
    let slice = Command::new(bin)
        .args(["slice", "--from", out.to_str().unwrap()])
        .args(["--out", sliced.to_str().unwrap()])
        .args(["--train-tokens", "5", "--val-tokens", "2"])
        .output()
        .unwrap();
    assert!(slice.status.success(), "{slice:?}");
    let part = TokenFile::open(sliced.join("train.bin"), GPT2_VOCAB_SIZE).unwrap();
    assert_eq!(part.tokens(), &want_train[..5]);
    let too_many = Command::new(bin)
        .args(["slice", "--from", out.to_str().unwrap()])
        .args(["--out", sliced.to_str().unwrap()])
        .args(["--train-tokens", "5", "--val-tokens", "2000"])
        .output()
        .unwrap();
    assert!(!too_many.status.success());
}

/// The committed slice: the first 65,536 tokens of train.bin and the first 8,192 of val.bin.
#[test]
fn the_committed_slice_loads_and_is_shakespeare() {
    let dir = committed_shakespeare_slice_dir();
    let train = TokenFile::open(dir.join("train.bin"), GPT2_VOCAB_SIZE).unwrap();
    let val = TokenFile::open(dir.join("val.bin"), GPT2_VOCAB_SIZE).unwrap();
    assert_eq!((train.len(), val.len()), (65_536, 8_192));
    let bpe = Gpt2Bpe::new().unwrap();
    // The corpus starts with the first text in byte order of the file names.
    let opening = bpe.decode_lossy(&train.tokens()[..24]).unwrap();
    assert!(
        opening.starts_with("ALL'S WELL THAT ENDS WELL\n\nby William Shakespeare"),
        "{opening:?}"
    );
    // The first <|endoftext|> closes All's Well; the next text (Antony and Cleopatra) follows it.
    let eot = train
        .tokens()
        .iter()
        .position(|&t| t == GPT2_END_OF_TEXT)
        .unwrap();
    let next = bpe
        .decode_lossy(&train.tokens()[eot + 1..eot + 16])
        .unwrap();
    assert!(next.starts_with("ANTONY AND CLEOPATRA"), "{next:?}");
    // Every token of the slice decodes to ASCII text (the corpus is ASCII).
    let text = bpe.decode_bytes(val.tokens()).unwrap();
    assert!(text.is_ascii());
    // Unigram entropies, computed independently with Python's collections.Counter on the same files.
    assert!((unigram_entropy_nats(train.tokens()).unwrap() - 6.095221).abs() < 5e-7);
    assert!((unigram_entropy_nats(val.tokens()).unwrap() - 5.751198).abs() < 5e-7);
    // Windows of the GPT example's CI size fit.
    assert_eq!(
        ValidationWindows::new(val.len(), 64, 8)
            .unwrap()
            .window_count(),
        127
    );
    assert!(TrainWindowSampler::new(train.len(), 64, 8, 1, 0).is_ok());
}

/// The full files (data/shakespeare of the repository, written by `scripts/fetch-shakespeare.sh`; not in
/// CI).
#[test]
#[ignore = "needs data/shakespeare (scripts/fetch-shakespeare.sh)"]
fn the_full_files_when_fetched() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/shakespeare");
    assert!(
        dir.join("train.bin").exists(),
        "{} has no train.bin (run scripts/fetch-shakespeare.sh)",
        dir.display()
    );
    let train = TokenFile::open(dir.join("train.bin"), GPT2_VOCAB_SIZE).unwrap();
    let val = TokenFile::open(dir.join("val.bin"), GPT2_VOCAB_SIZE).unwrap();
    assert_eq!(
        (train.len(), val.len()),
        (SHAKESPEARE_TRAIN_TOKENS, SHAKESPEARE_VAL_TOKENS)
    );
    let slice = committed_shakespeare_slice_dir();
    let slice_train = TokenFile::open(slice.join("train.bin"), GPT2_VOCAB_SIZE).unwrap();
    let slice_val = TokenFile::open(slice.join("val.bin"), GPT2_VOCAB_SIZE).unwrap();
    assert_eq!(slice_train.tokens(), &train.tokens()[..slice_train.len()]);
    assert_eq!(slice_val.tokens(), &val.tokens()[..slice_val.len()]);
    let eots = |t: &[u16]| t.iter().filter(|&&x| x == GPT2_END_OF_TEXT).count();
    assert_eq!(eots(train.tokens()) + eots(val.tokens()), 42);
    assert_eq!(val.tokens().last(), Some(&GPT2_END_OF_TEXT));
}
