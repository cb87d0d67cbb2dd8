//! A GPT-2 family language model trained with FP8 FSDP on Shakespeare, the PyTorch peer's run
//! (`shared/bench/peer_gpt.py`): thread ranks on the CPU, or one process per GPU. `--speed` times the
//! peer's speed measurement instead. See `docs/gpt.md`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use fsdp_examples::cli::{DeviceArg, ExportArg, GradShardsArg, PrecisionArg, StatesArg};
use fsdp_examples::data::tokens::{committed_shakespeare_slice_dir, DEFAULT_SHAKESPEARE_DIR};
use fsdp_examples::gpt::{
    speed, train, Fp8Layers, GptModelChoice, GptTrainConfig, SpeedConfig,
    DEFAULT_FP8_AUTO_THRESHOLD,
};
use fsdp_examples::metrics::{render_svg, PlotKind, PlotOptions, PlotSeries};
use fsdp_examples::progress::ProgressMode;
use fsdp_examples::run_setup::{DeviceChoice, RunOutputs};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Fp8LayersArg {
    All,
    Auto,
    None,
}

#[derive(Parser, Debug)]
#[command(
    about = "Train a GPT-2 family model on Shakespeare with FP8 fully sharded data parallelism"
)]
struct Args {
    /// Model: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-3b [default: tiny on the CPU, gpt2 on a GPU].
    #[arg(long)]
    preset: Option<String>,
    /// Override the preset's width.
    #[arg(long)]
    d_model: Option<usize>,
    /// Override the preset's number of blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the preset's number of heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Sequences per rank and micro-batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Sequence length (rows of the position table) [default: 64 on the CPU, 512 on a GPU].
    #[arg(long)]
    seq_len: Option<usize>,
    /// Optimizer steps [default: 50 on the CPU, 600 on a GPU].
    #[arg(long)]
    steps: Option<u64>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Peak learning rate (the peer's 6e-4).
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    /// Arithmetic: FP8 linears (--fp8-layers) with BF16 activations, BF16, or F32.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Fp8)]
    precision: PrecisionArg,
    /// Which block linears run in FP8 with --precision fp8 (auto: those large enough to pay).
    #[arg(long, value_enum, default_value_t = Fp8LayersArg::All)]
    fp8_layers: Fp8LayersArg,
    /// With --fp8-layers auto: a block linear in -> out runs in FP8 when in*out/(in+out) >= N (a
    /// positive integer) [default: DEFAULT_FP8_AUTO_THRESHOLD, 1024; the `linear_crossover` example
    /// measures it].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    fp8_auto_threshold: Option<u64>,
    /// Reduce-scatter the FP8 weights' gradients in FP8 (E5M2) instead of F32.
    #[arg(long)]
    fp8_grad_comm: bool,
    /// Storage of the reduced gradient shards (bf16: half the bytes, one rounding per reduction).
    #[arg(long, value_enum, default_value_t = GradShardsArg::F32)]
    grad_shards: GradShardsArg,
    /// Optimizer states of the FP8 weights.
    #[arg(long, value_enum, default_value_t = StatesArg::Low)]
    optimizer_states: StatesArg,
    /// Ranks: threads on the CPU [default 1]; on CUDA the launcher's process count [default 1].
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// Seed of the weights and the training windows.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Directory of train.bin and val.bin (scripts/fetch-shakespeare.sh fills the default one; on the
    /// CPU the committed slice is used when the default one is empty).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Renumber the data's ids densely and size the vocabulary to them (fast CPU smoke runs; the
    /// export is then not the peer's shape).
    #[arg(long)]
    compact_vocab: bool,
    /// Validate every N steps [default: steps / 10].
    #[arg(long)]
    eval_every: Option<u64>,
    /// Validate on at most N batches [default: all on a GPU, as the peer; 32 on the CPU, where a full
    /// pass over val.bin takes minutes].
    #[arg(long)]
    max_val_batches: Option<usize>,
    /// Save a sharded checkpoint here at the end (and with --save-every).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also save every N steps.
    #[arg(long, requires = "save")]
    save_every: Option<u64>,
    /// Resume from a checkpoint directory (same world size and settings).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after N steps in total (saving first with --save): simulates an interruption.
    #[arg(long)]
    stop_after_steps: Option<u64>,
    /// Write one JSON line per validation here.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write an SVG of train and validation loss per step (needs --metrics; overlays --compare).
    #[arg(long, requires = "metrics")]
    plot: Option<PathBuf>,
    /// Further metrics files to overlay in the plot.
    #[arg(long, requires = "plot")]
    compare: Vec<PathBuf>,
    /// After training, write the master weights to this safetensors file (the peer's names).
    #[arg(long)]
    export: Option<PathBuf>,
    /// Element type of --export.
    #[arg(long, value_enum, default_value_t = ExportArg::F32, requires = "export")]
    export_dtype: ExportArg,
    /// Load the weights of a safetensors file (by name, e.g. an --export) before training.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// After training, print N tokens generated from a fixed prompt.
    #[arg(long)]
    sample: Option<usize>,
    /// Time 20 steps after 5 warm-up steps on random tokens and print one JSON line (no training).
    #[arg(long)]
    speed: bool,
    /// Timed steps of --speed.
    #[arg(long, default_value_t = 20)]
    speed_steps: usize,
    /// With --speed: also time the forward, backward and optimizer phases of the timed steps (CUDA
    /// events on a GPU, host time on the CPU) and print a table.
    #[arg(long, requires = "speed")]
    profile: bool,
    /// CPU threads per rank [default: cores / ranks].
    #[arg(long)]
    threads_per_rank: Option<usize>,
    /// Never draw the progress bar.
    #[arg(long)]
    no_progress: bool,
}

/// Validation batches on the CPU unless `--max-val-batches` says otherwise.
const CPU_VAL_BATCHES: usize = 32;

fn device_choice(arg: DeviceArg) -> DeviceChoice {
    let (device, why) = arg.resolve();
    if let Some(why) = why {
        eprintln!("no usable GPU ({why}); running on the CPU");
    }
    device
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.fp8_auto_threshold.is_some() && args.fp8_layers != Fp8LayersArg::Auto {
        return Err("--fp8-auto-threshold decides nothing without --fp8-layers auto".into());
    }
    let fp8_auto_threshold = match args.fp8_auto_threshold {
        None => DEFAULT_FP8_AUTO_THRESHOLD,
        Some(n) => usize::try_from(n)
            .map_err(|_| format!("--fp8-auto-threshold {n} does not fit this machine's usize"))?,
    };
    if let Some(plot) = &args.plot {
        RunOutputs::prepare(None, &[("--plot", plot.as_path())])?;
    }
    let device = device_choice(args.device);
    let on_cpu = device == DeviceChoice::Cpu;
    let model = GptModelChoice {
        preset: args
            .preset
            .clone()
            .unwrap_or_else(|| if on_cpu { "tiny" } else { "gpt2" }.into()),
        d_model: args.d_model,
        layers: args.layers,
        heads: args.heads,
        seq_len: args.seq_len.unwrap_or(if on_cpu { 64 } else { 512 }),
        precision: args.precision.into(),
        fp8_layers: match args.fp8_layers {
            Fp8LayersArg::All => Fp8Layers::All,
            Fp8LayersArg::Auto => Fp8Layers::Auto,
            Fp8LayersArg::None => Fp8Layers::None,
        },
        fp8_auto_threshold,
        fp8_grad_comm: args.fp8_grad_comm,
        grad_shards: args.grad_shards.into(),
        seed: args.seed,
    };
    let optimizer_states = args.optimizer_states.into();
    if args.speed {
        let report = speed(&SpeedConfig {
            model,
            batch_size: args.batch_size,
            optimizer_states,
            world_size: args.world_size,
            device,
            threads_per_rank: args.threads_per_rank,
            warmup_steps: 5,
            timed_steps: args.speed_steps,
            profile: args.profile,
        })?;
        print!("{}", report.table());
        println!("{}", report.json());
        return Ok(());
    }
    let data_dir = match &args.data {
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
    let max_val_batches = match (args.max_val_batches, on_cpu) {
        (Some(n), _) => Some(n),
        (None, true) => {
            eprintln!(
                "validating on the first {CPU_VAL_BATCHES} batches of val.bin on the CPU \
                 (--max-val-batches N to change)"
            );
            Some(CPU_VAL_BATCHES)
        }
        (None, false) => None,
    };
    let config = GptTrainConfig {
        batch_size: args.batch_size,
        grad_accum: args.grad_accum,
        lr: args.lr,
        optimizer_states,
        world_size: args.world_size,
        device,
        data_dir,
        compact_vocab: args.compact_vocab,
        eval_every: args.eval_every,
        max_val_batches,
        save: args.save.clone(),
        save_every: args.save_every,
        resume: args.resume.clone(),
        stop_after_steps: args.stop_after_steps,
        metrics: args.metrics.clone(),
        export: args.export.clone(),
        export_dtype: args.export_dtype.into(),
        init_from: args.init_from.clone(),
        sample: args.sample,
        progress: if args.no_progress {
            ProgressMode::Hidden
        } else {
            ProgressMode::Auto
        },
        print: true,
        threads_per_rank: args.threads_per_rank,
        ..GptTrainConfig::new(model, args.steps.unwrap_or(if on_cpu { 50 } else { 600 }))
    };
    let report = train(&config)?;
    println!(
        "Summary: {} ({} params) on {}, {} steps, precision {}, FP8 linears [{}], {}; recipe: {}",
        config.model.preset,
        report.params,
        report.device,
        report.steps,
        config.model.precision.name(),
        report.fp8_linears.join(", "),
        report.optimizer,
        report.recipe
    );
    if report.stopped_early {
        println!("stopped after {} steps as asked", report.steps);
    }
    if let Some(last) = report.evals.last() {
        println!(
            "final val loss {:.4} (train {:.4}) at step {}",
            last.val_loss, last.train_loss, last.step
        );
    }
    println!("rank 0 model state: {}", report.memory);
    if let Some(path) = &config.export {
        if !report.stopped_early {
            println!("master weights written to {}", path.display());
        }
    }
    if let Some(text) = &report.sample {
        println!("--- sample ---\n{text}\n--- end of sample ---");
    }
    if let (Some(svg), Some(metrics)) = (&args.plot, &args.metrics) {
        write_plot(svg, metrics, &args.compare)?;
    }
    Ok(())
}

fn write_plot(
    svg: &Path,
    metrics: &Path,
    compare: &[PathBuf],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut series = vec![PlotSeries::from_file(metrics)?];
    for f in compare {
        series.push(PlotSeries::from_file(f)?);
    }
    let options = PlotOptions {
        kind: PlotKind::LanguageModel,
        title: "GPT on Shakespeare: loss per step".into(),
        ..PlotOptions::default()
    };
    std::fs::write(svg, render_svg(&series, &options)?)
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    println!("plot written to {}", svg.display());
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpt_fsdp: {e}");
            ExitCode::FAILURE
        }
    }
}
