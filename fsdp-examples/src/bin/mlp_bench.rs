//! `mlp_bench`: step time, model FLOP/s and memory of the MLP-stack model (see `fsdp_examples::mlp`) in
//! BF16 or FP8 FSDP, the same model and measurement as the PyTorch peer script `peer_fsdp.py`: median of
//! 20 steps after 5 warm-up steps, each step bracketed by device synchronisations.
//!
//! `mlp_bench --mode fp8 --d 4096 --blocks 8 --tokens 16384 --device cuda`; on the CPU use small sizes.
//! Prints a table and one JSON line (last line of stdout).

use clap::{Parser, ValueEnum};
use fp8_core::{Fp8Format, Fp8Recipe};
use fp8_kernels::Device;
use fsdp_comm::{run_ranks, Communicator, NcclComm, NcclConfig};
use fsdp_examples::mlp::{BenchMode, MlpBench, MlpConfig, MlpError};
use fsdp_shard::GradReduction;
use fsdp_train::profile::{begin_profiled_step, finish_profiled_step, StepProfile, StepProfiler};
use fsdp_train::RecipeArg;
use fsdp_train::{
    available_bytes, model_state_json, peak_memory, reset_peak_memory, GradShardsArg,
};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Bf16,
    Fp8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Dev {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Reduction {
    F32,
    Bf16,
    Fp8E4m3,
    Fp8E5m2,
    /// The block-scaled FP8 exchange in E4M3 (1x128 tiles, all-to-all, F32 sum on the receiver).
    Fp8BlockE4m3,
    /// The block-scaled FP8 exchange in E5M2.
    Fp8BlockE5m2,
}

/// MLP-stack FSDP benchmark (BF16 vs FP8).
#[derive(Parser, Debug)]
#[command(name = "mlp_bench", version, about)]
struct Args {
    /// Compute mode.
    #[arg(long, value_enum, default_value = "fp8")]
    mode: Mode,
    /// Model width.
    #[arg(long, default_value_t = 4096)]
    d: usize,
    /// Number of blocks (FSDP units).
    #[arg(long, default_value_t = 8)]
    blocks: usize,
    /// Input rows.
    #[arg(long, default_value_t = 16384)]
    tokens: usize,
    /// Device.
    #[arg(long, value_enum, default_value = "cuda")]
    device: Dev,
    /// CPU only: ranks as threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Gradient reduction of the FP8 weights (fp8 mode).
    #[arg(long, value_enum, default_value = "f32")]
    grad_reduction: Reduction,
    /// fp8 mode: storage of the reduced gradient shards (bf16 mode keeps F32).
    #[arg(long, value_enum, default_value = "bf16")]
    grad_shards: GradShardsArg,
    /// fp8 mode: one scale per tensor, or DeepSeek-V3's blocks (1x128 activations and gradients,
    /// 128x128 weights on block-row shards).
    #[arg(long, value_enum, default_value = "tensor")]
    recipe: RecipeArg,
    /// fp8 mode: recompute each block in the backward instead of keeping its activations.
    #[arg(long)]
    recompute: bool,
    /// fp8 mode: separate GELU and FP8 cast kernels instead of the fused ones (the fused kernels, one
    /// pass over the [T, 4d] activations each way, are the default; training is bit-identical).
    #[arg(long)]
    unfused: bool,
    /// fp8 mode: keep each block's FP8 GELU output for the down linear's backward instead of recasting
    /// it from the kept pre-activation (the default recasts: bit-identical, less memory).
    #[arg(long)]
    keep_gelu_input: bool,
    /// Warm-up steps.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Time each phase of the timed steps with CUDA events (host time everywhere) and print a per-phase
    /// table (the Trainer's step profiler); the events add a little time to the step.
    #[arg(long)]
    profile: bool,
}

struct Outcome {
    bench: MlpBench,
    times: Vec<f64>,
    peak_pool: Option<u64>,
    loss: f64,
    profile: Option<StepProfile>,
}

/// Refuses arguments that would do nothing or report nonsense.
fn validate(args: &Args) -> Result<(), MlpError> {
    for (flag, v) in [
        ("--threads", args.threads),
        ("--steps", args.steps),
        ("--d", args.d),
        ("--blocks", args.blocks),
        ("--tokens", args.tokens),
    ] {
        if v == 0 {
            return Err(MlpError::Config(format!("{flag} must be at least 1")));
        }
    }
    // Thread ranks beyond a few per core only oversubscribe the CPU (the Trainer's cap).
    if args.device == Dev::Cpu {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cap = cores
            .saturating_mul(fsdp_train::THREADS_PER_CORE_LIMIT)
            .max(8);
        if args.threads > cap {
            return Err(MlpError::Config(format!(
                "--threads {} exceeds the limit of {cap} thread ranks on this machine's {cores} core(s)",
                args.threads
            )));
        }
    }
    Ok(())
}

/// Bytes one rank needs at least (model state, one gathered block, activations kept for the backward,
/// one block's temporaries), for a refusal before anything is allocated; checked arithmetic throughout.
fn estimate_bytes(config: &MlpConfig, world_size: usize) -> Result<u64, MlpError> {
    let over = || MlpError::Config("the sizes overflow a 64-bit byte count".into());
    let params = config.params()? as u64;
    let (d, t, blocks) = (config.d as u64, config.tokens as u64, config.blocks as u64);
    let per_param_state: u64 = match config.mode {
        BenchMode::Fp8 => 11, // E4M3 shard 1, BF16 gradient 2, F16 master + E4M3 m + F16 v 5, slack 3
        BenchMode::Bf16 => 16, // F32 shard 4, F32 gradient 4, F32 m and v 8
    };
    let state = params
        .checked_mul(per_param_state)
        .ok_or_else(over)?
        .div_ceil(world_size.max(1) as u64);
    let block = 8u64
        .checked_mul(d)
        .and_then(|v| v.checked_mul(d))
        .ok_or_else(over)?;
    let kept_per_block = t
        .checked_mul(d)
        .and_then(|v| v.checked_mul(2 * 4 + 1))
        .ok_or_else(over)?;
    let kept = kept_per_block.checked_mul(blocks).ok_or_else(over)?;
    let temporaries = t
        .checked_mul(d)
        .and_then(|v| v.checked_mul(4 * 6))
        .ok_or_else(over)?;
    [
        state,
        block.checked_mul(6).ok_or_else(over)?,
        kept,
        temporaries,
    ]
    .into_iter()
    .try_fold(0u64, |a, b| a.checked_add(b))
    .ok_or_else(over)
}

fn run(args: &Args, comm: Arc<dyn Communicator>) -> Result<Outcome, MlpError> {
    let device = comm.device().clone();
    if args.mode == Mode::Bf16 && args.recipe == RecipeArg::Block {
        return Err(MlpError::Config(
            "--recipe block chooses the scales of FP8 linears; --mode bf16 has none".into(),
        ));
    }
    let config = MlpConfig {
        recipe: match args.recipe {
            RecipeArg::Tensor => Fp8Recipe::default(),
            RecipeArg::Block => Fp8Recipe::block_scaled(fp8_core::ScaleRounding::PowerOfTwo),
        },
        d: args.d,
        blocks: args.blocks,
        tokens: args.tokens,
        mode: match args.mode {
            Mode::Bf16 => BenchMode::Bf16,
            Mode::Fp8 => BenchMode::Fp8,
        },
        grad_reduction: match args.grad_reduction {
            Reduction::F32 => GradReduction::F32,
            Reduction::Bf16 => GradReduction::Bf16,
            Reduction::Fp8E4m3 => GradReduction::Fp8(Fp8Format::E4M3),
            Reduction::Fp8E5m2 => GradReduction::Fp8(Fp8Format::E5M2),
            Reduction::Fp8BlockE4m3 => GradReduction::Fp8Block(Fp8Format::E4M3),
            Reduction::Fp8BlockE5m2 => GradReduction::Fp8Block(Fp8Format::E5M2),
        },
        grad_dtype: args.grad_shards.into(),
        recompute: args.recompute,
        fused: !args.unfused,
        recompute_gelu: !args.keep_gelu_input,
        lr: args.lr,
        seed: 0,
    };
    // CPU ranks are threads of this process: they share its memory.
    let sharing = if device.is_cuda() {
        1
    } else {
        comm.world_size() as u64
    };
    let need = estimate_bytes(&config, comm.world_size())?
        .checked_mul(sharing)
        .ok_or_else(|| MlpError::Config("the sizes overflow a 64-bit byte count".into()))?;
    if let Some(have) = available_bytes(&device)? {
        if need > have {
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            return Err(MlpError::Config(format!(
                "d={} blocks={} tokens={} needs about {:.1} GiB but the {} has {:.1} GiB available; \
                 choose smaller sizes",
                config.d,
                config.blocks,
                config.tokens,
                gib(need),
                if device.is_cuda() { "GPU" } else { "host" },
                gib(have)
            )));
        }
    }
    let mut bench = MlpBench::new(config, comm.clone())?;
    for _ in 0..args.warmup {
        bench.step()?;
    }
    reset_peak_memory(&device)?;
    let mut profiler = args
        .profile
        .then(|| StepProfiler::new(&device, args.steps, args.warmup, false));
    let mut profile = None;
    let mut times = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        device.synchronize()?;
        let t0 = Instant::now();
        let ev0 = match &device {
            Device::Cuda(c) => Some(c.record_compute_timed()?),
            Device::Cpu => None,
        };
        let mut prof = begin_profiled_step(&mut profiler)?;
        bench.step_profiled(&mut prof)?;
        let secs = match (&device, ev0) {
            (Device::Cuda(c), Some(e0)) => {
                let e1 = c.record_compute_timed()?;
                device.synchronize()?;
                f64::from(e0.elapsed_ms(&e1)?) / 1e3
            }
            _ => t0.elapsed().as_secs_f64(),
        };
        times.push(secs);
        finish_profiled_step(&mut profiler, prof, &mut profile, false)?;
    }
    device.synchronize()?;
    let peak_pool = Some(peak_memory(&device)?);
    let loss = bench.loss()?;
    Ok(Outcome {
        bench,
        times,
        peak_pool,
        loss,
        profile,
    })
}

fn report(args: &Args, o: &Outcome, world_size: usize) -> Result<(), MlpError> {
    let mut t = o.times.clone();
    t.sort_by(f64::total_cmp);
    let median = t.get(t.len() / 2).copied().unwrap_or(f64::NAN);
    let cfg = o.bench.config();
    let params = cfg.params()?;
    let flops = 6.0 * params as f64 * cfg.tokens as f64 * world_size as f64;
    let mem = o.bench.memory()?;
    let gib = |b: f64| b / f64::from(1u32 << 30);
    let device_used = o.bench.device().memory_used()?;
    println!(
        "mlp_bench {} d={} blocks={} tokens={} ranks={} optimizer: {}",
        cfg.mode.name(),
        cfg.d,
        cfg.blocks,
        cfg.tokens,
        world_size,
        o.bench.optimizer_name()
    );
    println!("| quantity | value |");
    println!("| --- | --- |");
    if cfg.mode == BenchMode::Fp8 {
        println!("| FP8 recipe | {} |", cfg.recipe.name());
    }
    println!("| median step (s) | {median:.4} |");
    println!("| model TFLOP/s | {:.1} |", flops / median / 1e12);
    for (_, label, bytes) in mem.model_state_parts() {
        println!("| {label} (GiB) | {:.3} |", gib(bytes as f64));
    }
    println!(
        "| model state (GiB) | {:.3} |",
        gib(mem.model_state() as f64)
    );
    println!(
        "| model state bytes / param | {:.2} |",
        mem.model_state() as f64 * world_size as f64 / params as f64
    );
    let peak_source = if o.bench.device().is_cuda() {
        "CUDA pool high-water mark"
    } else {
        "live CPU buffers high-water mark, all ranks of the process"
    };
    if let Some(p) = o.peak_pool {
        println!(
            "| peak memory (GiB, {peak_source}) | {:.3} |",
            gib(p as f64)
        );
    }
    if let Some(u) = device_used {
        println!(
            "| device memory in use at end (GiB) | {:.3} |",
            gib(u as f64)
        );
    }
    println!("| final loss | {:.6} |", o.loss);
    if let Some(p) = &o.profile {
        println!();
        print!("{}", p.table());
    }
    let json = serde_json::json!({
        "bench": "mlp_bench",
        "mode": cfg.mode.name(),
        "recipe": cfg.recipe.name(),
        "device": if o.bench.device().is_cuda() { "cuda" } else { "cpu" },
        "d": cfg.d, "layers": cfg.blocks, "tokens": cfg.tokens, "ranks": world_size,
        "params": params,
        "grad_reduction": format!("{:?}", args.grad_reduction),
        "grad_shards": match cfg.mode {
            BenchMode::Bf16 => "f32",
            BenchMode::Fp8 => cfg.grad_dtype.name(),
        },
        "recompute": cfg.recompute,
        "fused": cfg.fused,
        "recompute_gelu": cfg.recompute_gelu,
        "optimizer": o.bench.optimizer_name(),
        "warmup": args.warmup, "steps": o.times.len(),
        "step_s": median,
        "step_times_s": o.times,
        "TFLOPs": flops / median / 1e12,
        "model_state_bytes": model_state_json(&mem),
        "peak_GiB": o.peak_pool.map(|p| gib(p as f64)),
        "peak_source": peak_source,
        "device_used_GiB": device_used.map(|u| gib(u as f64)),
        "loss": o.loss,
        "profile_ms": o.profile.as_ref().map(StepProfile::json_ms),
    });
    println!("{json}");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = validate(&args) {
        eprintln!("mlp_bench: {e}");
        return ExitCode::FAILURE;
    }
    let result: Result<(), MlpError> = match args.device {
        Dev::Cuda => (|| {
            let comm = NcclComm::from_env(&NcclConfig::default())?;
            let ws = comm.world_size();
            let rank = comm.rank();
            let o = run(&args, Arc::new(comm))?;
            if rank == 0 {
                report(&args, &o, ws)?;
            }
            Ok(())
        })(),
        Dev::Cpu => run_ranks(args.threads.max(1), |comm| {
            let rank = comm.rank();
            let ws = comm.world_size();
            let o = run(&args, Arc::new(comm))?;
            if rank == 0 {
                report(&args, &o, ws)?;
            }
            Ok::<(), MlpError>(())
        })
        .map(|_| ()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlp_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
