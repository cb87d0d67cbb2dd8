//! Language models trained with FP8 FSDP on the Trainer: every preset of the GPT-2 and Llama 3 families
//! on a token stream in llm.c's format (the PyTorch peers' run), thread ranks on the CPU or one process
//! per GPU; a Llama model can start from a Hugging Face checkpoint (`--init-from DIR`) and export one
//! (`--export DIR`). `--speed` times the peer's speed measurement instead. See `docs/gpt.md` and
//! `docs/llama.md`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fsdp_examples::data::tokens::{committed_shakespeare_slice_dir, DEFAULT_SHAKESPEARE_DIR};
use fsdp_examples::gpt::Gpt;
use fsdp_examples::hf::{LlamaHfConfig, CONFIG_FILE};
use fsdp_examples::llama::Llama;
use fsdp_examples::lm::{LanguageModel, LmFamily, LmOptions, LmTask};
use fsdp_train::{
    run_main, DeviceArg, DeviceChoice, PlotKind, PlotStyle, PrecisionArg, RunLength, TaskDefaults,
    TrainArgs,
};
use half::bf16;

#[derive(Parser, Debug)]
#[command(
    about = "Train a language model (GPT-2 and Llama 3 family presets) with FP8 fully sharded data \
             parallelism"
)]
struct Args {
    /// Model: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-3b, llama-tiny, llama-small, llama-1b,
    /// llama-3b, llama-8b [default: tiny on the CPU, gpt2 on a GPU; the checkpoint's shape with
    /// --init-from a Hugging Face directory].
    #[arg(long)]
    preset: Option<String>,
    /// Override the preset's width.
    #[arg(long)]
    d_model: Option<usize>,
    /// Override the preset's number of blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the preset's number of heads (d-model / heads must be 32, 64 or 128).
    #[arg(long)]
    heads: Option<usize>,
    /// Override a Llama preset's key/value heads (dividing the heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Override a Llama preset's SwiGLU width.
    #[arg(long)]
    ffn: Option<usize>,
    /// Sequences per rank and micro-batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Sequence length (rows of the position table) [default: 64 on the CPU, 512 on a GPU].
    #[arg(long)]
    seq_len: Option<usize>,
    /// Directory of train.bin and val.bin (scripts/fetch-shakespeare.sh fills the default one; on the
    /// CPU the committed slice is used when the default one is empty).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Renumber the data's ids densely and size the vocabulary to them (fast CPU smoke runs; the
    /// export is then not the peer's shape).
    #[arg(long)]
    compact_vocab: bool,
    /// Validate on at most N batches [default: all on a GPU, as the peer; 32 on the CPU, where a full
    /// pass over val.bin takes minutes].
    #[arg(long)]
    max_val_batches: Option<usize>,
    /// After training, print N tokens generated from a fixed prompt.
    #[arg(long)]
    sample: Option<usize>,
    /// Recompute each block's forward in its backward instead of keeping its activations.
    #[arg(long)]
    recompute: bool,
    /// The first N blocks recompute their MLP's up output (Llama's `[gate | up]`) in the backward from
    /// the FP8 codes the backward writes anyway, instead of keeping it: bit-identical training, one
    /// FP8 GEMM more per block, `tokens x up width` BF16 values less held per block (selective
    /// recomputation for a memory budget; FP8 MLPs fed by a fused norm).
    #[arg(long, default_value_t = 0, value_name = "N")]
    recompute_mlp_up: usize,
    #[command(flatten)]
    train: TrainArgs,
}

/// Validation batches on the CPU unless `--max-val-batches` says otherwise.
const CPU_VAL_BATCHES: usize = 32;

fn run<M: LanguageModel>(args: &Args, options: LmOptions, on_cpu: bool) -> ExitCode {
    let world_size = args.train.world_size.unwrap_or(1);
    // The speed mode times random token batches: it reads no data.
    let task = if args.train.speed {
        LmTask::<M>::for_speed(options, world_size)
    } else {
        LmTask::<M>::new(options, world_size)
    };
    let task = match task {
        Ok(t) => t,
        Err(e) => {
            eprintln!("lm_fsdp: {e}");
            return ExitCode::FAILURE;
        }
    };
    let defaults = TaskDefaults::new(RunLength::Steps(if on_cpu { 50 } else { 600 }), 6e-4);
    let plot = PlotStyle {
        kind: PlotKind::LanguageModel,
        title: "Language model: loss per step".into(),
    };
    run_main(&task, &args.train, &defaults, &plot)
}

fn main() -> ExitCode {
    let mut args = Args::parse();
    let on_cpu = args.train.resolved_device() == DeviceChoice::Cpu;
    if on_cpu {
        args.train.device = DeviceArg::Cpu;
    }
    let data_dir = match &args.data {
        _ if args.train.speed => PathBuf::new(),
        Some(d) => d.clone(),
        None => {
            let full = PathBuf::from(DEFAULT_SHAKESPEARE_DIR);
            if on_cpu && !full.join("train.bin").exists() {
                let slice = committed_shakespeare_slice_dir();
                eprintln!(
                    "{} has no train.bin: training on the committed slice in {} (fetch the full data \
                     with scripts/fetch-shakespeare.sh)",
                    full.display(),
                    slice.display()
                );
                slice
            } else {
                full
            }
        }
    };
    // The full validation set is the peer's, but on the CPU it costs minutes per evaluation.
    let max_val_batches = match (args.max_val_batches, on_cpu, args.train.speed) {
        (Some(n), _, _) => Some(n),
        (None, true, false) => {
            eprintln!(
                "validating on the first {CPU_VAL_BATCHES} batches of val.bin on the CPU \
                 (--max-val-batches N to change)"
            );
            Some(CPU_VAL_BATCHES)
        }
        _ => None,
    };
    // A Hugging Face checkpoint (a directory with config.json, or a file beside one) gives the shape.
    let hf_config = match hf_config_of(args.train.init_from.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lm_fsdp: {e}");
            return ExitCode::FAILURE;
        }
    };
    let preset = match (&args.preset, &hf_config) {
        (Some(p), _) => p.clone(),
        (None, Some(_)) => "llama-tiny".into(),
        (None, None) => if on_cpu { "tiny" } else { "gpt2" }.into(),
    };
    let family = if hf_config.is_some() {
        Some(LmFamily::Llama3)
    } else {
        LmFamily::of_preset(&preset)
    };
    let Some(family) = family else {
        eprintln!(
            "lm_fsdp: --preset {preset:?} is not a preset (one of {})",
            LmFamily::preset_names().join(", ")
        );
        return ExitCode::FAILURE;
    };
    let options = LmOptions {
        preset,
        d_model: args.d_model,
        layers: args.layers,
        heads: args.heads,
        kv_heads: args.kv_heads,
        ffn: args.ffn,
        hf_config,
        seq_len: args.seq_len.unwrap_or(if on_cpu { 64 } else { 512 }),
        batch_size: args.batch_size,
        data_dir,
        compact_vocab: args.compact_vocab,
        max_val_batches,
        sample: args.sample,
        seed: args.train.seed,
        recompute_blocks: args.recompute,
        recompute_mlp_up: args.recompute_mlp_up,
    };
    // F32 linears need f32 activations; every other precision trains with bf16 activations.
    let f32_acts = args.train.precision == PrecisionArg::Fp32;
    match (family, f32_acts) {
        (LmFamily::Gpt2, true) => run::<Gpt<f32>>(&args, options, on_cpu),
        (LmFamily::Gpt2, false) => run::<Gpt<bf16>>(&args, options, on_cpu),
        (LmFamily::Llama3, true) => run::<Llama<f32>>(&args, options, on_cpu),
        (LmFamily::Llama3, false) => run::<Llama<bf16>>(&args, options, on_cpu),
    }
}

/// The Hugging Face config of the checkpoint `--init-from` names: `DIR/config.json`, or the
/// `config.json` beside a safetensors file; `None` for a file without one (our own export format).
fn hf_config_of(init_from: Option<&std::path::Path>) -> Result<Option<LlamaHfConfig>, String> {
    let Some(path) = init_from else {
        return Ok(None);
    };
    let config = if path.is_dir() {
        path.join(CONFIG_FILE)
    } else {
        path.with_file_name(CONFIG_FILE)
    };
    if !config.is_file() {
        if path.is_dir() {
            return Err(format!(
                "--init-from {}: a directory without {CONFIG_FILE} (a Hugging Face checkpoint has one)",
                path.display()
            ));
        }
        return Ok(None);
    }
    LlamaHfConfig::read(&config)
        .map(Some)
        .map_err(|e| format!("--init-from {}: {e}", path.display()))
}
