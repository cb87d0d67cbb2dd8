//! Encodes text files with a Hugging Face `tokenizer.json` (Llama 3's, or any other) into llm.c token
//! files `train.bin` and `val.bin`: `u16` when the vocabulary fits, else `u32`. See `docs/llama.md`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use fsdp_examples::data::tokens::{
    choose_format, split_point, text_input_files, write_token_split, DocumentMarkers,
    HfTokenizeError, HfTokenizer, SplitAt, TokenFormat, ValFraction,
};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
#[command(about = "Text files -> llm.c token files (train.bin, val.bin) through a tokenizer.json")]
struct Args {
    /// Text files (each one document) or directories (each of their *.txt files, in name order, one
    /// document).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The tokenizer.json, or a model directory holding one.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Directory to write train.bin and val.bin into (created if needed).
    #[arg(long)]
    out: PathBuf,
    /// Token written before each document, by its text (e.g. "<|begin_of_text|>").
    #[arg(long, conflicts_with = "bos_id")]
    bos: Option<String>,
    /// Token written before each document, by its id.
    #[arg(long)]
    bos_id: Option<u32>,
    /// Token written after each document, by its text (e.g. "<|end_of_text|>").
    #[arg(long, conflicts_with = "eos_id")]
    eos: Option<String>,
    /// Token written after each document, by its id.
    #[arg(long)]
    eos_id: Option<u32>,
    /// Fraction of the tokens that go to val.bin (the end of the stream), a decimal in (0, 1).
    #[arg(long, default_value = "0.1")]
    val_fraction: String,
    /// Where to cut: at token floor(n (1 - f)), or at the document boundary nearest to it.
    #[arg(long, value_enum, default_value_t = SplitArg::Token)]
    split_at: SplitArg,
    /// Token file format: u16 (llm.c's GPT-2 files), u32 (its Llama 3 files), or auto (u16 when the
    /// tokenizer's vocabulary has at most 65536 ids).
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    format: FormatArg,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum SplitArg {
    Token,
    Document,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum FormatArg {
    Auto,
    U16,
    U32,
}

fn run(args: &Args) -> Result<(), HfTokenizeError> {
    let fraction = ValFraction::parse(&args.val_fraction)?;
    let tokenizer = HfTokenizer::from_file(&args.tokenizer)?;
    let markers = DocumentMarkers {
        bos: tokenizer.marker("BOS", args.bos.as_deref(), args.bos_id)?,
        eos: tokenizer.marker("EOS", args.eos.as_deref(), args.eos_id)?,
    };
    let files = text_input_files(&args.inputs)?;
    let total_bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    // indicatif draws only on a terminal, so logs and pipes see the summary lines alone.
    let bar = ProgressBar::new(total_bytes);
    if let Ok(style) = ProgressStyle::with_template(
        "encoding {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, eta {eta})",
    ) {
        bar.set_style(style);
    }
    let documents = tokenizer.encode_files(&files, markers, &mut |done| bar.set_position(done))?;
    bar.finish_and_clear();
    let split_at = match args.split_at {
        SplitArg::Token => SplitAt::Token,
        SplitArg::Document => SplitAt::Document,
    };
    let cut = split_point(&documents, fraction, split_at)?;
    let requested = match args.format {
        FormatArg::Auto => None,
        FormatArg::U16 => Some(TokenFormat::U16),
        FormatArg::U32 => Some(TokenFormat::U32),
    };
    let format = choose_format(requested, tokenizer.vocab_size());
    println!(
        "{}: vocabulary {} ids; {} documents, {total_bytes} bytes -> {} tokens (BOS {:?}, EOS {:?})",
        tokenizer.path().display(),
        tokenizer.vocab_size(),
        files.len(),
        documents.tokens.len(),
        markers.bos,
        markers.eos
    );
    for file in write_token_split(&args.out, &documents, cut, format, tokenizer.vocab_size())? {
        println!(
            "  {}: {} tokens, {:?} (read back and checked)",
            file.path.display(),
            file.tokens,
            file.format
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
