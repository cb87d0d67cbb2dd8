//! The Hugging Face tokenizer path to token files (`data::tokens::hf_tokenizer`, binary `hf_tokenize`):
//! two hand-built `tokenizer.json` files (a byte-level BPE shaped like Llama 3's, and a word-level one
//! with an id above 65535), files written and read back with the token-file readers, and the errors.

mod scratch;

use std::path::{Path, PathBuf};
use std::process::Command;

use fsdp_examples::data::tokens::{
    choose_format, split_point, text_input_files, train_val_split_index, write_token_split,
    DocumentMarkers, EncodedDocuments, HfTokenizeError, HfTokenizer, SplitAt, TokenFile,
    TokenFileU32, TokenFormat, ValFraction, TOKEN_FILE_MAGIC, TOKEN_FILE_U32_MAGIC,
};
use scratch::scratch_dir;
use serde_json::json;

/// Llama 3's pre-tokenizer pattern (its tokenizer.json's Split regex).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const BOS: u32 = 260;
const EOS: u32 = 261;

/// GPT-2's byte-to-character map of byte-level BPE (`bytes_to_unicode`): printable bytes map to
/// themselves, the others to 256, 257, ... in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap()
    }
}

/// A byte-level BPE tokenizer.json in Llama 3's layout: ids 0..255 the bytes (id = byte value), merges
/// "Ġ t", "h e", "Ġt he", "a t" (ids 256..259), BOS 260 and EOS 261 as added special tokens, and a
/// template post-processor that prepends BOS (which encoding must not apply).
fn bpe_tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_char(b).to_string(), json!(b));
    }
    let sp = byte_char(b' ');
    let merges = [
        (format!("{sp}"), "t".to_string()),
        ("h".into(), "e".into()),
        (format!("{sp}t"), "he".into()),
        ("a".into(), "t".into()),
    ];
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + i));
    }
    let added = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added(BOS, "<|begin_of_text|>"), added(EOS, "<|end_of_text|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated",
             "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [BOS],
                                                     "tokens": ["<|begin_of_text|>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                  "byte_fallback": false, "ignore_merges": true, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
    .to_string()
}

/// A word-level tokenizer.json split on whitespace: `<unk>` 0, `hello` 1, `world` 70000.
fn wide_word_tokenizer_json() -> String {
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1, "world": 70000},
                  "unk_token": "<unk>"}
    })
    .to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn run_cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hf_tokenize"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn header_magic(path: &Path) -> i32 {
    let bytes = std::fs::read(path).unwrap();
    i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

#[test]
fn bpe_fixture_encodes_as_worked_out_by_hand_and_as_the_crate_does() {
    let dir = scratch_dir("hf-bpe");
    let path = write(&dir, "tokenizer.json", &bpe_tokenizer_json());
    // From the directory: tokenizer.json is found in it.
    let tokenizer = HfTokenizer::from_file(&dir).unwrap();
    assert_eq!(tokenizer.path(), path);
    assert_eq!(tokenizer.vocab_size(), 262);
    assert_eq!(tokenizer.token_id("<|end_of_text|>"), Some(EOS));
    // Pieces "the", " cat", " the": t + he; Ġ c at; Ġthe. No BOS from the template.
    let text = "the cat the";
    let ids = tokenizer.encode(text, Path::new("inline")).unwrap();
    assert_eq!(ids, [116, 257, 32, 99, 259, 258]);
    let reference = tokenizers::Tokenizer::from_file(&path).unwrap();
    assert_eq!(ids, reference.encode(text, false).unwrap().get_ids());
    // The template would have put BOS first: encoding really bypasses it.
    assert_eq!(reference.encode(text, true).unwrap().get_ids()[0], BOS);
    // Text outside the merges, including non-ASCII and digits, still matches the crate.
    let other = "Héllo, 12345 wörld!\n\n  at\tthe end";
    assert_eq!(
        tokenizer.encode(other, Path::new("inline")).unwrap(),
        reference.encode(other, false).unwrap().get_ids()
    );
}

#[test]
fn cli_writes_u16_files_that_read_back_as_the_tokenizer_encodes() {
    let dir = scratch_dir("hf-cli-u16");
    let tok = write(&dir, "tokenizer.json", &bpe_tokenizer_json());
    let texts = dir.join("texts");
    std::fs::create_dir_all(&texts).unwrap();
    let docs = [
        ("b.txt", "the cat sat on the mat.\nThe end.\n"),
        ("a.txt", "at the theatre, that cat\n"),
        ("c.txt", "é 2024: the cat's hat"),
    ];
    for (name, text) in docs {
        write(&texts, name, text);
    }
    write(&texts, "notes.md", "not a document");
    let out = dir.join("out");
    let (ok, stdout, stderr) = run_cli(&[
        texts.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--bos",
        "<|begin_of_text|>",
        "--eos-id",
        "261",
        "--val-fraction",
        "0.25",
    ]);
    assert!(ok, "stdout {stdout}\nstderr {stderr}");
    assert!(stdout.contains("3 documents"), "{stdout}");

    // The stream the tokenizer itself gives: documents in name order, each BOS + ids + EOS.
    let reference = tokenizers::Tokenizer::from_file(&tok).unwrap();
    let mut sorted = docs;
    sorted.sort_by_key(|&(name, _)| name);
    let mut expected = Vec::new();
    for (_, text) in sorted {
        expected.push(BOS);
        expected.extend_from_slice(reference.encode(text, false).unwrap().get_ids());
        expected.push(EOS);
    }
    let cut = expected.len() * 3 / 4;
    let (train_path, val_path) = (out.join("train.bin"), out.join("val.bin"));
    assert_eq!(header_magic(&train_path), TOKEN_FILE_MAGIC);
    assert_eq!(header_magic(&val_path), TOKEN_FILE_MAGIC);
    let train = TokenFile::open(&train_path, 262).unwrap();
    let val = TokenFile::open(&val_path, 262).unwrap();
    let widened: Vec<u32> = train
        .tokens()
        .iter()
        .chain(val.tokens())
        .map(|&t| u32::from(t))
        .collect();
    assert_eq!(widened, expected);
    assert_eq!(train.len(), cut);
}

#[test]
fn auto_picks_u32_for_a_vocabulary_above_65536_and_u16_refuses_it() {
    let dir = scratch_dir("hf-wide");
    let tok_path = write(&dir, "tokenizer.json", &wide_word_tokenizer_json());
    let tokenizer = HfTokenizer::from_file(&tok_path).unwrap();
    assert_eq!(tokenizer.vocab_size(), 70001);
    assert_eq!(
        choose_format(None, tokenizer.vocab_size()),
        TokenFormat::U32
    );
    assert_eq!(choose_format(None, 65536), TokenFormat::U16);
    assert_eq!(choose_format(None, 65537), TokenFormat::U32);

    let files = [
        write(&dir, "one.txt", "hello world hello"),
        write(&dir, "two.txt", "world nope hello"),
    ];
    let docs = tokenizer
        .encode_files(&files, DocumentMarkers::default(), &mut |_| {})
        .unwrap();
    assert_eq!(docs.tokens, [1, 70000, 1, 70000, 0, 1]);
    assert_eq!(docs.ends, [3, 6]);

    let out = dir.join("auto");
    let cut = split_point(&docs, ValFraction::parse("0.5").unwrap(), SplitAt::Token).unwrap();
    let format = choose_format(None, tokenizer.vocab_size());
    let written = write_token_split(&out, &docs, cut, format, tokenizer.vocab_size()).unwrap();
    assert_eq!(written[0].tokens + written[1].tokens, 6);
    assert_eq!(header_magic(&out.join("train.bin")), TOKEN_FILE_U32_MAGIC);
    // The u16 reader refuses the file; the u32 reader gives the ids back.
    assert!(TokenFile::open(out.join("train.bin"), 70001).is_err());
    let train = TokenFileU32::open(out.join("train.bin"), 70001).unwrap();
    let val = TokenFileU32::open(out.join("val.bin"), 70001).unwrap();
    assert_eq!(train.tokens(), [1, 70000, 1]);
    assert_eq!(val.tokens(), [70000, 0, 1]);

    // Forced u16: the first id above 65535 is named with its document; nothing is written.
    let forced = dir.join("forced");
    match write_token_split(&forced, &docs, cut, TokenFormat::U16, 70001) {
        Err(HfTokenizeError::IdTooLargeForU16 {
            id: 70000,
            index: 1,
            document,
        }) => assert_eq!(document, files[0]),
        other => panic!("expected IdTooLargeForU16, got {other:?}"),
    }
    assert!(!forced.join("train.bin").exists());
    let mut second_doc = EncodedDocuments::default();
    second_doc.push_document(&files[0], &[1, 2], DocumentMarkers::default());
    second_doc.push_document(&files[1], &[3, 70000], DocumentMarkers::default());
    assert_eq!(second_doc.source_of(3), Some(files[1].as_path()));

    // The binary: auto writes u32, u16 fails with the reason.
    let (ok, stdout, stderr) = run_cli(&[
        dir.join("one.txt").to_str().unwrap(),
        dir.join("two.txt").to_str().unwrap(),
        "--tokenizer",
        tok_path.to_str().unwrap(),
        "--out",
        dir.join("cli").to_str().unwrap(),
        "--val-fraction",
        "0.5",
    ]);
    assert!(ok, "stdout {stdout}\nstderr {stderr}");
    assert_eq!(header_magic(&dir.join("cli/val.bin")), TOKEN_FILE_U32_MAGIC);
    let (ok, _, stderr) = run_cli(&[
        dir.join("one.txt").to_str().unwrap(),
        "--tokenizer",
        tok_path.to_str().unwrap(),
        "--out",
        dir.join("cli16").to_str().unwrap(),
        "--format",
        "u16",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("id 70000") && stderr.contains("does not fit a u16"),
        "{stderr}"
    );
}

#[test]
fn forced_u32_writes_u32_for_a_small_vocabulary() {
    let dir = scratch_dir("hf-u32");
    let tok = write(&dir, "tokenizer.json", &bpe_tokenizer_json());
    let text = write(&dir, "doc.txt", "the cat the cat the cat the cat");
    let out = dir.join("out");
    let (ok, stdout, stderr) = run_cli(&[
        text.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--format",
        "u32",
    ]);
    assert!(ok, "stdout {stdout}\nstderr {stderr}");
    assert_eq!(header_magic(&out.join("train.bin")), TOKEN_FILE_U32_MAGIC);
    let train = TokenFileU32::open(out.join("train.bin"), 262).unwrap();
    assert_eq!(train.tokens()[..3], [116, 257, 32]);
}

#[test]
fn fraction_one_tenth_splits_as_the_shakespeare_corpus() {
    let tenth = ValFraction::parse("0.1").unwrap();
    for n in [0, 1, 9, 10, 11, 99, 1_565_999, 1_566_001, usize::MAX / 16] {
        assert_eq!(tenth.train_tokens(n), train_val_split_index(n), "n = {n}");
    }
    assert_eq!(ValFraction::parse(".25").unwrap().train_tokens(10), 7);
    for bad in [
        "0", "1", "1.0", "0.0", "abc", "-0.1", "0.1x", "", ".", "0.5.1",
    ] {
        assert!(
            matches!(ValFraction::parse(bad), Err(HfTokenizeError::Input(_))),
            "{bad:?} accepted"
        );
    }
}

#[test]
fn document_split_cuts_at_the_nearest_boundary() {
    let mut docs = EncodedDocuments::default();
    let m = DocumentMarkers::default();
    for len in [4usize, 3, 2, 1] {
        docs.push_document(Path::new("d"), &vec![7; len], m);
    }
    // 10 tokens, ends 4, 7, 9, 10; target floor(0.7 * 10) = 7 is a boundary; 0.5 -> 5 is nearest to 4.
    let f = |s| ValFraction::parse(s).unwrap();
    assert_eq!(split_point(&docs, f("0.3"), SplitAt::Document).unwrap(), 7);
    assert_eq!(split_point(&docs, f("0.5"), SplitAt::Document).unwrap(), 4);
    assert_eq!(split_point(&docs, f("0.5"), SplitAt::Token).unwrap(), 5);
    // 0.99 -> target 0: the nearest interior boundary is 4 (a fraction never leaves train empty here).
    assert_eq!(split_point(&docs, f("0.99"), SplitAt::Document).unwrap(), 4);
    assert!(matches!(
        split_point(&docs, f("0.99"), SplitAt::Token),
        Err(HfTokenizeError::Input(_))
    ));
    let mut one = EncodedDocuments::default();
    one.push_document(Path::new("only"), &[1, 2, 3], m);
    let err = split_point(&one, f("0.1"), SplitAt::Document).unwrap_err();
    assert!(err.to_string().contains("--split-at token"), "{err}");
}

#[test]
fn errors_name_the_file_and_the_reason() {
    let dir = scratch_dir("hf-errors");
    let missing = dir.join("absent.json");
    let err = HfTokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(err, HfTokenizeError::TokenizerMissing { .. }));
    assert!(err.to_string().contains("absent.json"), "{err}");

    let bad = write(&dir, "bad.json", "{\"model\": [1, 2,");
    let err = HfTokenizer::from_file(&bad).unwrap_err();
    assert!(matches!(err, HfTokenizeError::BadTokenizer { .. }), "{err}");
    assert!(err
        .to_string()
        .contains("not a Hugging Face tokenizer.json"));
    let not_tokenizer = write(&dir, "config.json", "{\"hidden_size\": 128}");
    assert!(matches!(
        HfTokenizer::from_file(&not_tokenizer),
        Err(HfTokenizeError::BadTokenizer { .. })
    ));

    let tok_path = write(&dir, "tokenizer.json", &bpe_tokenizer_json());
    let tokenizer = HfTokenizer::from_file(&tok_path).unwrap();
    assert!(matches!(
        tokenizer.marker("BOS", Some("<s>"), None),
        Err(HfTokenizeError::UnknownToken { .. })
    ));
    assert!(matches!(
        tokenizer.marker("EOS", None, Some(262)),
        Err(HfTokenizeError::IdOutOfVocabulary { id: 262, .. })
    ));
    assert_eq!(tokenizer.marker("EOS", None, Some(261)).unwrap(), Some(261));
    assert_eq!(tokenizer.marker("EOS", None, None).unwrap(), None);

    let err = text_input_files(&[dir.join("nope.txt")]).unwrap_err();
    assert!(err.to_string().contains("nope.txt"), "{err}");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = text_input_files(std::slice::from_ref(&empty)).unwrap_err();
    assert!(err.to_string().contains("no *.txt files"), "{err}");

    let latin1 = dir.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    let err = tokenizer
        .encode_files(&[latin1], DocumentMarkers::default(), &mut |_| {})
        .unwrap_err();
    assert!(
        err.to_string().contains("not UTF-8 at byte offset 3"),
        "{err}"
    );

    // The binary reports the first error and fails.
    let (ok, _, stderr) = run_cli(&[
        tok_path.to_str().unwrap(),
        "--tokenizer",
        missing.to_str().unwrap(),
        "--out",
        dir.join("out").to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        stderr.starts_with("error: ") && stderr.contains("absent.json"),
        "{stderr}"
    );
    let (ok, _, stderr) = run_cli(&[
        tok_path.to_str().unwrap(),
        "--tokenizer",
        tok_path.to_str().unwrap(),
        "--out",
        dir.join("out").to_str().unwrap(),
        "--val-fraction",
        "1.5",
    ]);
    assert!(!ok);
    assert!(stderr.contains("validation fraction"), "{stderr}");
}
