//! `gpt_fsdp --speed`: the peer's `speed` measurement. 5 warm-up steps, then 20 timed steps on one batch
//! of random tokens (seeded), each a full step (forward with the loss, backward with the gradient
//! reductions, AdamW); a step's time is the wall time from a synchronised device to the device
//! synchronised after the optimizer step (the peer's `perf_counter` around `step` and
//! `torch.cuda.synchronize()`); the median of the 20 is reported.

use super::run::{build_model, build_optimizer, GptModelChoice, GptRunError};
use super::GPT2_PADDED_VOCAB;
use crate::data::tokens::GPT2_VOCAB_SIZE;
use crate::run_setup::{launch_ranks, DeviceChoice, RankLaunch};
use crate::training::profile::{
    finish_profiled_step, mark, Phase, ProfiledStep, StepProfile, StepProfiler,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{CpuParallelism, Device};
use fsdp_comm::Communicator;
use fsdp_nn::Activation;
use fsdp_optim::{step_model, Optimizer, StatePrecision};
use fsdp_shard::{MemoryReport, Mode};
use half::bf16;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A speed measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeedConfig {
    /// The model.
    pub model: GptModelChoice,
    /// Sequences per rank and step.
    pub batch_size: usize,
    /// Storage of the FP8 weights' optimizer states.
    pub optimizer_states: StatePrecision,
    /// Ranks.
    pub world_size: usize,
    /// Where.
    pub device: DeviceChoice,
    /// CPU threads per rank.
    pub threads_per_rank: Option<usize>,
    /// Untimed steps first.
    pub warmup_steps: usize,
    /// Timed steps.
    pub timed_steps: usize,
    /// Also time the phases of the timed steps (forward, backward, optimizer) with CUDA events.
    pub profile: bool,
}

/// What a speed run measured (rank 0's view).
#[derive(Debug, Clone)]
pub struct SpeedReport {
    /// The configuration measured.
    pub config: SpeedConfig,
    /// Parameters, the tied matrix once.
    pub params: usize,
    /// The peer's model FLOPs per token.
    pub flops_per_token: f64,
    /// Block linears in FP8, by name.
    pub fp8_linears: Vec<&'static str>,
    /// The recipe in words.
    pub recipe: String,
    /// Seconds of each timed step.
    pub step_times: Vec<f64>,
    /// Peak bytes during the timed steps: the CUDA pool's high-water mark (workspaces included), or
    /// the live host buffers of the process on the CPU (all thread ranks).
    pub peak_bytes: u64,
    /// Where `peak_bytes` comes from.
    pub peak_source: &'static str,
    /// Model state of rank 0 by category (optimizer states included).
    pub memory: MemoryReport,
    /// The optimizer in words.
    pub optimizer: String,
    /// The device in words.
    pub device: String,
    /// The last step's loss on rank 0.
    pub loss: f64,
    /// Phase timings of the timed steps (with `profile`).
    pub profile: Option<StepProfile>,
}

impl SpeedReport {
    /// Median step seconds.
    pub fn median_step(&self) -> f64 {
        let mut t = self.step_times.clone();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
    }

    /// Tokens per second over all ranks.
    pub fn tokens_per_sec(&self) -> f64 {
        (self.config.batch_size * self.config.model.seq_len * self.config.world_size) as f64
            / self.median_step()
    }

    /// Model TFLOP/s (the peer's formula).
    pub fn model_tflops(&self) -> f64 {
        self.tokens_per_sec() * self.flops_per_token / 1e12
    }

    /// The human table.
    pub fn table(&self) -> String {
        let c = &self.config;
        let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
        let m = &self.memory;
        let mut t = format!(
            "gpt_fsdp --speed: {} ({} params), {} x {} per rank, {} rank(s), {}\n",
            c.model.preset, self.params, c.batch_size, c.model.seq_len, c.world_size, self.device
        );
        t.push_str("| quantity | value |\n| --- | --- |\n");
        let mut row = |k: &str, v: String| t.push_str(&format!("| {k} | {v} |\n"));
        row("precision", c.model.precision.name().into());
        row(
            "FP8 linears",
            if self.fp8_linears.is_empty() {
                "none".into()
            } else {
                self.fp8_linears.join(", ")
            },
        );
        row("recipe", self.recipe.clone());
        row("optimizer", self.optimizer.clone());
        row(
            "median step (s)",
            format!("{:.4} (of {})", self.median_step(), self.step_times.len()),
        );
        row("tokens/s", format!("{:.0}", self.tokens_per_sec()));
        row("model TFLOP/s", format!("{:.1}", self.model_tflops()));
        row(
            &format!("peak memory (GiB, {})", self.peak_source),
            format!("{:.3}", gib(self.peak_bytes as usize)),
        );
        row(
            "FP8 weight shards (GiB)",
            format!("{:.3}", gib(m.fp8_weight_shards)),
        );
        row(
            "plain parameter shards (GiB)",
            format!("{:.3}", gib(m.plain_param_shards)),
        );
        row(
            "gradient shards (GiB)",
            format!("{:.3}", gib(m.grad_shards)),
        );
        row(
            "optimizer states (GiB)",
            format!("{:.3}", gib(m.optimizer_states)),
        );
        row("model state (GiB)", format!("{:.3}", gib(m.model_state())));
        row("last loss", format!("{:.4}", self.loss));
        if let Some(p) = &self.profile {
            t.push_str(&p.table());
        }
        t
    }

    /// The one JSON line (the peer's `speed` keys, and ours).
    pub fn json(&self) -> serde_json::Value {
        let c = &self.config;
        let m = &self.memory;
        serde_json::json!({
            "impl": "fp8-fsdp",
            "mode": c.model.precision.name(),
            "preset": c.model.preset,
            "params": self.params,
            "batch": c.batch_size,
            "seq": c.model.seq_len,
            "world": c.world_size,
            "step_s": self.median_step(),
            "tokens_per_s": self.tokens_per_sec(),
            "model_TFLOPs": self.model_tflops(),
            "peak_GiB": self.peak_bytes as f64 / f64::from(1u32 << 30),
            "peak_source": self.peak_source,
            "fp8_layers": self.fp8_linears,
            "fp8_layers_choice": format!("{:?}", c.model.fp8_layers).to_lowercase(),
            "recipe": self.recipe,
            "fp8_grad_comm": c.model.fp8_grad_comm,
            "grad_shards": c.model.grad_shards.name(),
            "optimizer": self.optimizer,
            "device": self.device,
            "warmup": c.warmup_steps,
            "step_times_s": self.step_times,
            "model_state_bytes": {
                "fp8_weight_shards": m.fp8_weight_shards,
                "plain_param_shards": m.plain_param_shards,
                "grad_shards": m.grad_shards,
                "optimizer_states": m.optimizer_states,
                "total": m.model_state(),
            },
            "loss": self.loss,
            "profile_ms": self.profile.as_ref().map(|p| p
                .phases
                .iter()
                .map(|ph| (ph.phase.name().to_string(), serde_json::json!({"gpu": ph.gpu_ms, "host": ph.host_ms})))
                .collect::<serde_json::Map<_, _>>()),
        })
    }
}

struct RankSpeed {
    profile: Option<StepProfile>,
    times: Vec<f64>,
    peak: u64,
    memory: MemoryReport,
    optimizer: String,
    loss: f64,
}

/// Runs the measurement on every rank; returns rank 0's report.
pub fn speed(config: &SpeedConfig) -> Result<SpeedReport, GptRunError> {
    if config.batch_size == 0 || config.timed_steps == 0 || config.world_size == 0 {
        return Err(GptRunError::Config(
            "--batch-size, the timed steps and --world-size must be at least 1".into(),
        ));
    }
    let gpt = config.model.config(GPT2_PADDED_VOCAB)?;
    let launch = RankLaunch {
        binary: "gpt_fsdp",
        device: config.device,
        world_size: config.world_size,
        threads_per_rank: config.threads_per_rank,
        timeout: Duration::from_secs(600),
    };
    let (outcomes, device) = launch_ranks(&launch, |comm, par| match config.model.precision {
        super::GptPrecision::Fp32 => speed_rank::<f32>(comm, config, par),
        _ => speed_rank::<bf16>(comm, config, par),
    })?;
    let first = outcomes
        .into_iter()
        .next()
        .ok_or_else(|| GptRunError::Config("no rank ran".into()))?;
    Ok(SpeedReport {
        params: gpt.num_params(),
        flops_per_token: gpt.flops_per_token(),
        fp8_linears: config.model.fp8_linears(&gpt),
        recipe: config.model.recipe(&gpt),
        step_times: first.times,
        peak_bytes: first.peak,
        peak_source: if device.starts_with("CUDA") {
            "CUDA pool high-water mark"
        } else {
            "live host buffers high-water mark, all ranks of the process"
        },
        memory: first.memory,
        optimizer: first.optimizer,
        device,
        loss: first.loss,
        profile: first.profile,
        config: config.clone(),
    })
}

fn speed_rank<T: Activation>(
    comm: Arc<dyn Communicator>,
    config: &SpeedConfig,
    par: CpuParallelism,
) -> Result<RankSpeed, GptRunError> {
    let device = comm.device().clone();
    if let Device::Cuda(c) = &device {
        c.set_pool_release_threshold(u64::MAX)?;
    }
    let rank = comm.rank() as u64;
    let gpt = config.model.config(GPT2_PADDED_VOCAB)?;
    let mut model = build_model::<T>(comm, gpt, &config.model, par)?;
    let mut opt = build_optimizer(&mut model, 6e-4, config.optimizer_states)?;
    let (b, t) = (config.batch_size, config.model.seq_len);
    // Random ids of GPT-2's vocabulary (as the peer's randint(0, 50257)), inputs and targets drawn
    // independently, one stream per rank.
    let mut rng = SplitMix64::new(config.model.seed ^ rank.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut ids = |n: usize| -> Vec<i32> {
        (0..n)
            .map(|_| rng.below(u64::from(GPT2_VOCAB_SIZE)) as i32)
            .collect()
    };
    let (x, y) = (ids(b * t), ids(b * t));
    let batch = model.module().batch(&device, &x, &y, b, t)?;
    let scale = 1.0 / model.comm().world_size() as f32;
    let mut step = |model: &mut fsdp_shard::FsdpModel<super::Gpt<T>>,
                    prof: &mut Option<ProfiledStep>|
     -> Result<(), GptRunError> {
        // The batch is on the device already: the data phase is empty.
        mark(prof, Phase::Data)?;
        model.forward(Mode::Train, |m, ctx| {
            m.forward_with_grad(ctx, &batch, scale)
        })?;
        mark(prof, Phase::Forward)?;
        model.backward(|m, ctx| m.backward(ctx, &batch, scale))?;
        mark(prof, Phase::Backward)?;
        step_model(&mut opt, model)?;
        mark(prof, Phase::Optimizer)?;
        Ok(())
    };
    for _ in 0..config.warmup_steps {
        step(&mut model, &mut None)?;
    }
    device.synchronize()?;
    if let Device::Cuda(c) = &device {
        c.reset_pool_high_water()?;
    }
    fp8_kernels::device::reset_host_buffer_peak();
    let mut profiler = config
        .profile
        .then(|| StepProfiler::new(&device, config.timed_steps, config.warmup_steps, false));
    let mut profile = None;
    let mut times = Vec::with_capacity(config.timed_steps);
    for _ in 0..config.timed_steps {
        device.synchronize()?;
        let t0 = Instant::now();
        let mut prof = match profiler.as_mut() {
            Some(p) => p.begin()?,
            None => None,
        };
        step(&mut model, &mut prof)?;
        device.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
        finish_profiled_step(&mut profiler, prof, &mut profile, false)?;
    }
    let peak = match &device {
        Device::Cuda(c) => c.pool_memory()?.1,
        Device::Cpu => fp8_kernels::device::host_buffer_bytes().peak as u64,
    };
    let loss = model.module().loss()?.mean()?;
    let memory = opt.memory(model.sharded())?;
    Ok(RankSpeed {
        profile,
        times,
        peak,
        memory,
        optimizer: opt.describe(),
        loss,
    })
}
