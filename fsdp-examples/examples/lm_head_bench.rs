//! `lm_head_bench`: the LM head with its cross-entropy (`fsdp_nn::LmHead`, BF16 activations), forward
//! and backward to `dx` and `dW` as a training step runs it (`forward_with_grad`, then `backward`), in
//! float and in FP8 (`--fp8-head`), at `peer_layers.py`'s shapes and the Llama-3 vocabulary's. Per shape:
//! the median of `--iters` steps after 3 warm-up steps (CUDA events on the compute stream) and the extra
//! peak (the pool's high-water mark during a step minus what the step's start held and the `dx` it
//! returns; on the CPU the same from the byte count of live CPU buffers). With `--peer FILE` (the JSON
//! lines of `peer_layers.py`, same call) its `lmhead_ce_fwd_bwd` figures stand beside ours.
//!
//! ```text
//! lm_head_bench [--iters 10] [--peer FILE] [--chunk TOKENS] [--bf16-gather]
//!               [--shapes 8192x2560x50304,16384x768x50304,16384x2048x128256]
//! ```
//!
//! Made for CUDA (source `cuda-env.sh` on the GPU machine); without a GPU it runs one tiny shape on the
//! CPU (`--device cpu`, or name `--shapes`), whose times say nothing but whose extra peak is counted the
//! same way: a shape scaled down by `s` in tokens, width, vocabulary and chunk holds about `1 / s^2` of
//! the full shape's bytes, so the memory plan can be checked without a GPU.

use clap::Parser;
use fp8_kernels::device::{host_buffer_bytes, reset_host_buffer_peak};
use fp8_kernels::{CudaDevice, Device};
use fsdp_comm::{Communicator, DistEnv, NcclComm, NcclConfig, ThreadGroup, DEFAULT_THREAD_TIMEOUT};
use fsdp_nn::{LmHead, NnError, Shape, Tensor};
use fsdp_shard::{
    FsdpConfig, FsdpModel, GatherDtype, Mode, Module, ShardError, Visitor, WrapPolicy,
};
use fsdp_train::{DeviceArg, DeviceChoice};
use half::bf16;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// The LM head + cross-entropy step, float and FP8, beside PyTorch's.
#[derive(Parser, Debug)]
#[command(name = "lm_head_bench", about)]
struct Args {
    /// Where to run (auto: CUDA when usable, else one tiny shape on the CPU).
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// Timed steps per shape and precision (the median is reported).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// peer_layers.py's JSON lines from the same call.
    #[arg(long)]
    peer: Option<PathBuf>,
    /// TOKENSxDxVOCAB shapes [default: the peer's two and llama-1b's 16384x2048x128256].
    #[arg(long, value_delimiter = ',')]
    shapes: Option<Vec<String>>,
    /// Tokens per chunk of the head [default: the head's own, `fsdp_nn::DEFAULT_HEAD_CHUNK`].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    chunk: Option<u64>,
    /// Gather the head's table in BF16 (`FsdpConfig::plain_gather_dtype`) instead of F32.
    #[arg(long)]
    bf16_gather: bool,
}

struct Probe {
    head: LmHead<bf16>,
}

impl Module for Probe {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("lm_head", &mut self.head)
    }
}

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// `(median ms, extra peak GiB)` of the head's training step.
fn measure(
    comm: Arc<dyn Communicator>,
    [tokens, d, vocab]: [usize; 3],
    fp8: bool,
    iters: usize,
    chunk: Option<usize>,
    bf16_gather: bool,
) -> BenchResult<(f64, f64)> {
    let mut head = LmHead::<bf16>::new(d, vocab)?.with_fp8(fp8);
    if let Some(c) = chunk {
        head = head.with_chunk(c)?;
    }
    let mut model = FsdpModel::new(
        Probe { head },
        comm,
        WrapPolicy::Single,
        FsdpConfig {
            plain_gather_dtype: if bf16_gather {
                GatherDtype::Bf16
            } else {
                GatherDtype::F32
            },
            ..FsdpConfig::default()
        },
    )?;
    let dev = model.device().clone();
    let cuda = dev.as_cuda("lm_head_bench").ok().cloned();
    if let Some(c) = &cuda {
        c.set_pool_release_threshold(u64::MAX)?;
    }
    // The peer's inputs: x with standard deviation 0.5, targets below GPT-2's 50257 words.
    let x: Vec<bf16> = (0..tokens * d)
        .map(|i| bf16::from_f32(((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.7))
        .collect();
    let x = dev.upload(&x)?;
    let targets: Vec<i32> = (0..tokens)
        .map(|i| ((i * 104_729) % vocab.min(50257)) as i32)
        .collect();
    let targets = dev.upload(&targets)?;
    let step = |model: &mut FsdpModel<Probe>| -> BenchResult<()> {
        let mut xb = dev.uninit::<bf16>(tokens * d)?;
        xb.copy_from(&x)?;
        let xt = Tensor::new(xb, Shape::matrix(tokens, d)?)?;
        model.forward(Mode::Train, |m, ctx| {
            m.head.forward_with_grad(ctx, xt, &targets, 1.0)
        })?;
        let dx = model.backward(|m, ctx| -> Result<Tensor<bf16>, NnError> {
            m.head.backward(ctx, &targets, 1.0)
        })?;
        drop(dx);
        model.sharded_mut().zero_grads()?;
        Ok(())
    };
    for _ in 0..3 {
        step(&mut model)?;
    }
    dev.synchronize()?;
    // What one step holds beyond what its start held and the `dx` it returns (dropped at its end, so
    // subtracted as the peer's input gradient).
    let held = (tokens * d * 2) as u64;
    let extra = match &cuda {
        Some(c) => {
            let (before, _) = c.pool_memory()?;
            c.reset_pool_high_water()?;
            step(&mut model)?;
            dev.synchronize()?;
            let (_, high) = c.pool_memory()?;
            high.saturating_sub(before).saturating_sub(held)
        }
        None => {
            let before = host_buffer_bytes().live as u64;
            reset_host_buffer_peak();
            step(&mut model)?;
            let high = host_buffer_bytes().peak as u64;
            high.saturating_sub(before).saturating_sub(held)
        }
    } as f64
        / f64::from(1u32 << 30);
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        times.push(time_one(cuda.as_ref(), || step(&mut model))?);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok((times[times.len() / 2], extra))
}

fn time_one(cuda: Option<&CudaDevice>, f: impl FnOnce() -> BenchResult<()>) -> BenchResult<f64> {
    match cuda {
        Some(c) => {
            let a = c.record_compute_timed()?;
            f()?;
            let b = c.record_compute_timed()?;
            Ok(f64::from(a.elapsed_ms(&b)?))
        }
        None => {
            let t = Instant::now();
            f()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        }
    }
}

/// `(ms, extra peak GiB)` of the peer's `lmhead_ce_fwd_bwd` record of this shape.
fn peer_figure(lines: &str, [tokens, d, vocab]: [usize; 3]) -> Option<(f64, f64)> {
    lines
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| {
            r["op"] == "lmhead_ce_fwd_bwd"
                && r["tokens"] == tokens
                && r["d"] == d
                && r["vocab"] == vocab
        })
        .and_then(|r| Some((r["s"].as_f64()? * 1e3, r["extra_peak_GiB"].as_f64()?)))
}

fn parse_shape(s: &str) -> BenchResult<[usize; 3]> {
    let v: Vec<usize> = s
        .split('x')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("shape {s}: {e}"))?;
    match v.as_slice() {
        [t, d, vocab] if *t > 0 && *d > 0 && *vocab > 0 => Ok([*t, *d, *vocab]),
        _ => Err(format!("shape {s}: want TOKENSxDxVOCAB, each at least 1").into()),
    }
}

fn run(args: Args) -> BenchResult<()> {
    let (device, why) = args.device.resolve();
    let comm: Arc<dyn Communicator> = if device == DeviceChoice::Cuda {
        if let Device::Cuda(c) = Device::cuda(0)? {
            c.require_fp8()?;
        }
        Arc::new(NcclComm::from_dist_env(
            &DistEnv::single(),
            &NcclConfig::default(),
        )?)
    } else {
        println!(
            "lm_head_bench: on the CPU ({}): one tiny shape, times say nothing",
            why.map_or_else(|| "asked".to_string(), |e| e.to_string())
        );
        Arc::new(
            ThreadGroup::new(1, DEFAULT_THREAD_TIMEOUT)?
                .pop()
                .ok_or("no thread rank")?,
        )
    };
    let shapes: Vec<[usize; 3]> = match (&args.shapes, device) {
        (Some(list), _) => list
            .iter()
            .map(|s| parse_shape(s))
            .collect::<Result<_, _>>()?,
        (None, DeviceChoice::Cuda) => vec![
            [8192, 2560, 50304],
            [16384, 768, 50304],
            [16384, 2048, 128256],
        ],
        (None, _) => vec![[64, 32, 256]],
    };
    let peer = match &args.peer {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => String::new(),
    };
    let iters = usize::try_from(args.iters)?;
    let chunk = args.chunk.map(usize::try_from).transpose()?;
    println!("| shape (tokens x d x vocab) | head | ours ms | extra peak GiB | PyTorch ms | extra peak GiB | ours / PyTorch |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for shape in shapes {
        let p = peer_figure(&peer, shape);
        for fp8 in [false, true] {
            let (ms, gib) = measure(comm.clone(), shape, fp8, iters, chunk, args.bf16_gather)?;
            let (pms, pgib, ratio) = match p {
                Some((pms, pgib)) => (
                    format!("{pms:.2}"),
                    format!("{pgib:.2}"),
                    format!("{:.2}x", ms / pms),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            let [t, d, v] = shape;
            println!(
                "| {t} x {d} x {v} | {} | {ms:.2} | {gib:.3} | {pms} | {pgib} | {ratio} |",
                if fp8 { "FP8" } else { "BF16" }
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lm_head_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
