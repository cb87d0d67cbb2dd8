//! `linear_crossover`: the measured FP8/BF16 crossover of `lm_fsdp --fp8-layers auto`
//! (`DEFAULT_FP8_AUTO_THRESHOLD`). Each block linear of the GPT presets' widths (c_attn d->3d, attn_proj
//! d->d, c_fc d->4d, mlp_proj 4d->d; c_attn and c_fc also behind their LayerNorm, whose fused kernel
//! writes an FP8 linear's input) is timed through a training step (forward, backward with dx and dW,
//! optimizer step with the FP8 weight's re-quantization) in BF16 and in FP8, at each token count: CUDA
//! events, 5 warm-up steps, the median of 20. What is in the time: `fsdp_examples::gpt::crossover`.
//!
//! Prints one row per shape, by token count and k (tokens, linear, feed, in, out, k = in*out/(in+out), BF16 and FP8 step µs,
//! FP8/BF16, and each precision's forward/backward/optimizer split), then per token count the crossover
//! (the smallest k from which FP8 was faster at every larger measured k), for the linears as the model
//! runs them and for every linear alone, and the threshold that suggests (the largest over the token
//! counts). `--json FILE` also writes the rows and the crossovers.
//!
//! ```text
//! linear_crossover [--device auto|cpu|cuda] [--tokens 4096,8192,16384] [--widths 768,1024,1280,1600,2560]
//!                  [--iters 20] [--states low|f32] [--grad-shards f32|bf16] [--json FILE]
//! ```
//!
//! Without a GPU (or with `--device cpu`) it runs tiny shapes (tokens 16,32; widths 32,64; 1 warm-up
//! and 2 timed steps unless given) on the CPU: that exercises the code, its numbers say nothing about
//! a GPU. On the GPU machine source `cuda-env.sh` first.

use clap::Parser;
use fp8_kernels::Device;
use fsdp_comm::{Communicator, DistEnv, NcclComm, NcclConfig, ThreadGroup, DEFAULT_THREAD_TIMEOUT};
use fsdp_examples::gpt::crossover::{
    combined_threshold, crossover_of, measure, CaseSet, Crossover, CrossoverConfig, CrossoverRow,
    StepTimes, GPU_TOKENS, GPU_WIDTHS,
};
use fsdp_nn::DEFAULT_FP8_AUTO_THRESHOLD;
use fsdp_train::DeviceChoice;
use fsdp_train::{DeviceArg, GradShardsArg, StatesArg};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// FP8/BF16 crossover of the GPT block linears (one linear per measurement, one GPU).
#[derive(Parser, Debug)]
#[command(name = "linear_crossover", about)]
struct Args {
    /// Where to run (auto: CUDA when usable, else the CPU with tiny shapes).
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// Token counts [default: 4096,8192,16384 on CUDA; 16,32 on the CPU].
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<usize>>,
    /// Model widths [default: the presets' 768,1024,1280,1600,2560 on CUDA; 32,64 on the CPU].
    #[arg(long, value_delimiter = ',')]
    widths: Option<Vec<usize>>,
    /// Timed steps per shape (the median is reported) [default: 20 on CUDA, 2 on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    iters: Option<u64>,
    /// Optimizer states of the FP8 weight (as lm_fsdp --optimizer-states).
    #[arg(long, value_enum, default_value_t = StatesArg::Low)]
    states: StatesArg,
    /// Gradient shards (as lm_fsdp --grad-shards).
    #[arg(long, value_enum, default_value_t = GradShardsArg::F32)]
    grad_shards: GradShardsArg,
    /// Also write the rows and crossovers as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn comm_for(arg: DeviceArg) -> Result<Arc<dyn Communicator>, Box<dyn std::error::Error>> {
    let (device, why) = arg.resolve();
    if let Some(why) = why {
        println!("no usable GPU ({why}): tiny shapes on the CPU");
    }
    if device == DeviceChoice::Cuda {
        if let Device::Cuda(c) = Device::cuda(0)? {
            c.require_fp8()?;
        }
        let comm = NcclComm::from_dist_env(&DistEnv::single(), &NcclConfig::default())?;
        Ok(Arc::new(comm))
    } else {
        let comm = ThreadGroup::new(1, DEFAULT_THREAD_TIMEOUT)?
            .pop()
            .ok_or("no thread rank")?;
        Ok(Arc::new(comm))
    }
}

fn split(t: &StepTimes) -> String {
    format!(
        "{:.0}/{:.0}/{:.0}",
        t.forward_ms * 1e3,
        t.backward_ms * 1e3,
        t.optimizer_ms * 1e3
    )
}

fn print_table(rows: &[CrossoverRow]) {
    println!(
        "\n{:>6} {:<10} {:<10} {:>6} {:>6} {:>6} {:>10} {:>10} {:>8}  {:>18} {:>18}",
        "tokens",
        "linear",
        "feed",
        "in",
        "out",
        "k",
        "BF16 µs",
        "FP8 µs",
        "FP8/BF16",
        "BF16 fwd/bwd/opt",
        "FP8 fwd/bwd/opt"
    );
    // By token count, then k: the crossover reads down each block.
    let mut sorted: Vec<&CrossoverRow> = rows.iter().collect();
    sorted.sort_by_key(|r| {
        (
            r.tokens,
            r.case.k,
            r.case.d,
            r.case.linear.name(),
            r.case.feed.name(),
        )
    });
    for r in sorted {
        println!(
            "{:>6} {:<10} {:<10} {:>6} {:>6} {:>6} {:>10.1} {:>10.1} {:>8.3}  {:>18} {:>18}",
            r.tokens,
            r.case.linear.name(),
            r.case.feed.name(),
            r.case.inf,
            r.case.outf,
            r.case.k,
            r.bf16.step_ms * 1e3,
            r.fp8.step_ms * 1e3,
            r.ratio(),
            split(&r.bf16),
            split(&r.fp8)
        );
    }
}

fn times_json(t: &StepTimes) -> serde_json::Value {
    serde_json::json!({
        "forward_us": t.forward_ms * 1e3,
        "backward_us": t.backward_ms * 1e3,
        "optimizer_us": t.optimizer_ms * 1e3,
        "step_us": t.step_ms * 1e3,
    })
}

fn crossover_json(c: &Crossover) -> serde_json::Value {
    serde_json::json!({
        "text": c.describe(),
        "suggested_threshold": c.suggested_threshold(),
    })
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let comm = comm_for(args.device)?;
    let dev = comm.device().clone();
    let on_cuda = dev.is_cuda();
    let config = CrossoverConfig {
        tokens: args.tokens.clone().unwrap_or_else(|| {
            if on_cuda {
                GPU_TOKENS.to_vec()
            } else {
                vec![16, 32]
            }
        }),
        widths: args.widths.clone().unwrap_or_else(|| {
            if on_cuda {
                GPU_WIDTHS.to_vec()
            } else {
                vec![32, 64]
            }
        }),
        warmup: if on_cuda { 5 } else { 1 },
        iters: match args.iters {
            Some(n) => usize::try_from(n)?,
            None if on_cuda => 20,
            None => 2,
        },
        states: args.states.into(),
        grad_shards: args.grad_shards.into(),
    };
    println!(
        "linear_crossover on {}: tokens {:?}, widths {:?}, {} warm-up + median of {} steps ({}), \
         optimizer states {:?}, {} gradient shards",
        if on_cuda { "CUDA device 0" } else { "the CPU" },
        config.tokens,
        config.widths,
        config.warmup,
        config.iters,
        if on_cuda {
            "CUDA events on the compute stream"
        } else {
            "host time; CPU numbers say nothing about a GPU"
        },
        config.states,
        config.grad_shards.name()
    );
    println!(
        "a step = training forward + backward (dx, dW, one-rank gradient reduction) + AdamW step (FP8: \
         weight re-quantization); the same bf16 x and dy for both precisions"
    );
    let rows = measure(&comm, &config, |case| {
        eprintln!(
            "measured {} d={} ({})",
            case.linear.name(),
            case.d,
            case.feed.name()
        );
    })?;
    print_table(&rows);
    println!();
    let mut json_sets = Vec::new();
    for set in [CaseSet::AsInModel, CaseSet::AllAlone] {
        let mut per_tokens = Vec::new();
        let mut json_tokens = Vec::new();
        for &tokens in &config.tokens {
            let c = crossover_of(&rows, tokens, set)?;
            println!(
                "crossover, {}, tokens {tokens}: {}",
                set.name(),
                c.describe()
            );
            json_tokens
                .push(serde_json::json!({"tokens": tokens, "crossover": crossover_json(&c)}));
            per_tokens.push(c);
        }
        let suggested = combined_threshold(&per_tokens);
        println!(
            "measured crossover, {}: {}",
            set.name(),
            match suggested {
                Some(t) => format!(
                    "threshold {t} (FP8 faster for every measured linear with k >= {t} at every token \
                     count; DEFAULT_FP8_AUTO_THRESHOLD is {DEFAULT_FP8_AUTO_THRESHOLD})"
                ),
                None => "none: at some token count FP8 was not faster even at the largest k".into(),
            }
        );
        json_sets.push(serde_json::json!({
            "set": set.name(),
            "per_tokens": json_tokens,
            "suggested_threshold": suggested,
        }));
    }
    if let Some(path) = &args.json {
        let json_rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "tokens": r.tokens,
                    "linear": r.case.linear.name(),
                    "feed": r.case.feed.name(),
                    "d": r.case.d,
                    "in": r.case.inf,
                    "out": r.case.outf,
                    "k": r.case.k,
                    "bf16": times_json(&r.bf16),
                    "fp8": times_json(&r.fp8),
                    "fp8_over_bf16": r.ratio(),
                })
            })
            .collect();
        let doc = serde_json::json!({
            "device": if on_cuda { "cuda" } else { "cpu" },
            "warmup": config.warmup,
            "iters": config.iters,
            "states": format!("{:?}", config.states),
            "grad_shards": config.grad_shards.name(),
            "default_threshold": DEFAULT_FP8_AUTO_THRESHOLD,
            "rows": json_rows,
            "crossovers": json_sets,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("linear_crossover: {e}");
            ExitCode::FAILURE
        }
    }
}
