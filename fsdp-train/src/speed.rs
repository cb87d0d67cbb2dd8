//! The speed mode (`--speed`): warm-up steps, then timed steps on one batch, each a full training step
//! (forward with the loss, backward with the gradient reductions, the optimizer step); a step's time is
//! the wall time from a synchronised device to the device synchronised after the optimizer step (the
//! PyTorch peers' `perf_counter` around the step and `torch.cuda.synchronize()`); the median is
//! reported, with the peak memory of the timed steps and the model state by category.

use crate::profile::{
    begin_profiled_step, finish_profiled_step, mark, Phase, StepProfile, StepProfiler,
};
use crate::task::TrainTask;
use crate::trainer::Trainer;
use crate::TrainError;
use fp8_kernels::{Device, KernelError};
use fsdp_shard::MemoryReport;
use std::time::Instant;

/// How a speed run is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeedOptions {
    /// Untimed steps first.
    pub warmup_steps: usize,
    /// Timed steps.
    pub timed_steps: usize,
    /// Also time the forward, backward and optimizer phases of the timed steps.
    pub profile: bool,
}

impl Default for SpeedOptions {
    /// The peers' 5 warm-up and 20 timed steps.
    fn default() -> Self {
        SpeedOptions {
            warmup_steps: 5,
            timed_steps: 20,
            profile: false,
        }
    }
}

/// What a speed run measured (rank 0's view).
#[derive(Debug, Clone)]
pub struct SpeedReport {
    /// The program.
    pub program: String,
    /// The options.
    pub options: SpeedOptions,
    /// Ranks.
    pub world_size: usize,
    /// Samples or tokens per rank and step.
    pub units_per_rank_step: u64,
    /// What a unit is (`samples`, `tokens`).
    pub unit: &'static str,
    /// Parameters.
    pub params: usize,
    /// Model FLOPs per unit, when the task knows them.
    pub flops_per_unit: Option<f64>,
    /// Linears in FP8, by path.
    pub fp8_linears: Vec<String>,
    /// Linears in all.
    pub linears: usize,
    /// The LM head's GEMMs run in FP8 (`--fp8-head`).
    pub fp8_head: bool,
    /// The arithmetic in words.
    pub recipe: String,
    /// Seconds of each timed step.
    pub step_times: Vec<f64>,
    /// Peak bytes during the timed steps: the CUDA pool's high-water mark (workspaces included), or
    /// the live host buffers of the process on the CPU (all thread ranks).
    pub peak_bytes: u64,
    /// Where `peak_bytes` comes from.
    pub peak_source: &'static str,
    /// Model state of rank 0 by category.
    pub memory: MemoryReport,
    /// The optimizer in words.
    pub optimizer: String,
    /// The device in words.
    pub device: String,
    /// The last step's loss on rank 0 (its mean over the batch).
    pub loss: f64,
    /// Phase timings (with [`SpeedOptions::profile`]).
    pub profile: Option<StepProfile>,
    /// The task's facts (`preset`, shape, ...).
    pub describe: Vec<(String, serde_json::Value)>,
    /// Precision flag value.
    pub precision: &'static str,
    /// The optimizer stepped inside the backward (`--optimizer-in-backward`).
    pub optimizer_in_backward: bool,
    /// Bytes the model held for the backward after the last timed forward on rank 0
    /// ([`TrainTask::held_bytes`]), when the task counts them.
    pub held_bytes: Option<u64>,
}

impl SpeedReport {
    /// Median step seconds.
    pub fn median_step(&self) -> f64 {
        let mut t = self.step_times.clone();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
    }

    /// Units (samples or tokens) per second over all ranks.
    pub fn units_per_sec(&self) -> f64 {
        (self.units_per_rank_step * self.world_size as u64) as f64 / self.median_step()
    }

    /// Model TFLOP/s (the peers' formula), when the task knows its FLOPs.
    pub fn model_tflops(&self) -> Option<f64> {
        self.flops_per_unit.map(|f| self.units_per_sec() * f / 1e12)
    }

    /// The human table.
    pub fn table(&self) -> String {
        let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
        let m = &self.memory;
        let mut t = format!(
            "{} --speed: {} params, {} {} per rank and step, {} rank(s), {}\n",
            self.program,
            self.params,
            self.units_per_rank_step,
            self.unit,
            self.world_size,
            self.device
        );
        t.push_str("| quantity | value |\n| --- | --- |\n");
        let mut row = |k: &str, v: String| t.push_str(&format!("| {k} | {v} |\n"));
        for (k, v) in &self.describe {
            row(k, v.to_string().trim_matches('"').to_string());
        }
        row("precision", self.precision.into());
        row(
            "FP8 linears",
            format!("{} of {}", self.fp8_linears.len(), self.linears),
        );
        if self.fp8_head {
            row("FP8 LM head", "yes".into());
        }
        row("recipe", self.recipe.clone());
        row("optimizer", self.optimizer.clone());
        row(
            "median step (s)",
            format!("{:.4} (of {})", self.median_step(), self.step_times.len()),
        );
        row(
            &format!("{}/s", self.unit),
            format!("{:.0}", self.units_per_sec()),
        );
        if let Some(tf) = self.model_tflops() {
            row("model TFLOP/s", format!("{tf:.1}"));
        }
        row(
            &format!("peak memory (GiB, {})", self.peak_source),
            format!("{:.3}", gib(self.peak_bytes as usize)),
        );
        for (_, label, bytes) in m.model_state_parts() {
            row(&format!("{label} (GiB)"), format!("{:.3}", gib(bytes)));
        }
        row("model state (GiB)", format!("{:.3}", gib(m.model_state())));
        if let Some(h) = self.held_bytes {
            row(
                "activations held for the backward (GiB)",
                format!("{:.3}", gib(h as usize)),
            );
        }
        if m.peak_grad_shards > m.grad_shards {
            // Transient shards (the step in the backward): not model state, but part of the peak.
            row(
                "gradient shards held at once, transient (GiB)",
                format!("{:.3}", gib(m.peak_grad_shards)),
            );
        }
        row("last loss", format!("{:.4}", self.loss));
        if let Some(p) = &self.profile {
            t.push_str(&p.table());
        }
        t
    }

    /// The one JSON line (the peers' `speed` keys, and ours).
    pub fn json(&self) -> serde_json::Value {
        let m = &self.memory;
        let mut j = serde_json::json!({
            "impl": "fp8-fsdp",
            "program": self.program,
            "mode": self.precision,
            "params": self.params,
            "world": self.world_size,
            "step_s": self.median_step(),
            format!("{}_per_s", self.unit): self.units_per_sec(),
            "model_TFLOPs": self.model_tflops(),
            "peak_GiB": self.peak_bytes as f64 / f64::from(1u32 << 30),
            "peak_source": self.peak_source,
            "fp8_layers": self.fp8_linears,
            "fp8_head": self.fp8_head,
            "recipe": self.recipe,
            "optimizer": self.optimizer,
            "device": self.device,
            "warmup": self.options.warmup_steps,
            "step_times_s": self.step_times,
            "model_state_bytes": model_state_json(m),
            "loss": self.loss,
            "profile_ms": self.profile.as_ref().map(StepProfile::json_ms),
        });
        if let Some(obj) = j.as_object_mut() {
            if let Some(h) = self.held_bytes {
                obj.insert("held_activation_bytes".into(), h.into());
            }
            if self.optimizer_in_backward {
                obj.insert("optimizer_in_backward".into(), true.into());
                obj.insert(
                    "transient_grad_shards_peak_bytes".into(),
                    m.peak_grad_shards.into(),
                );
            }
            for (k, v) in &self.describe {
                obj.entry(k.clone()).or_insert(v.clone());
            }
        }
        j
    }
}

/// `model_state_bytes` of the programs' JSON lines: bytes per category of the model state, and `total`.
pub fn model_state_json(m: &MemoryReport) -> serde_json::Value {
    let mut parts: serde_json::Map<_, _> = m
        .model_state_parts()
        .into_iter()
        .map(|(key, _, bytes)| (key.to_string(), bytes.into()))
        .collect();
    parts.insert("total".into(), m.model_state().into());
    parts.into()
}

/// Opens a peak-memory window: waits for the device and resets the high-water marks of the CUDA pool
/// and of the live CPU buffers (process-wide: every thread rank's).
pub fn reset_peak_memory(device: &Device) -> Result<(), KernelError> {
    device.synchronize()?;
    if let Device::Cuda(c) = device {
        c.reset_pool_high_water()?;
    }
    fp8_kernels::device::reset_host_buffer_peak();
    Ok(())
}

/// The high-water mark of bytes since [`reset_peak_memory`]: the CUDA pool's, or on the CPU the live CPU
/// buffers'.
pub fn peak_memory(device: &Device) -> Result<u64, KernelError> {
    Ok(match device {
        Device::Cuda(c) => c.pool_memory()?.1,
        Device::Cpu => fp8_kernels::device::host_buffer_bytes().peak as u64,
    })
}

struct RankSpeed {
    profile: Option<StepProfile>,
    times: Vec<f64>,
    peak: u64,
    memory: MemoryReport,
    optimizer: String,
    loss: f64,
    units: u64,
    linears: Vec<(String, fsdp_nn::LinearPrecision)>,
    params: usize,
    held: Option<u64>,
}

impl Trainer {
    /// Times training steps of `task` (see the module documentation); the configuration's precision,
    /// FP8 choice, reduction, gradient shards, optimizer states, ranks and device apply, its outputs and
    /// length do not.
    pub fn speed<T: TrainTask>(
        &self,
        task: &T,
        options: SpeedOptions,
    ) -> Result<SpeedReport, TrainError> {
        let c = self.config();
        c.validate()?;
        if options.timed_steps == 0 {
            return Err(TrainError::Config(
                "--speed-steps must be at least 1".into(),
            ));
        }
        let (outcomes, device) = self.launch(task, |env| self.speed_rank(task, env, options))?;
        let first = outcomes
            .into_iter()
            .next()
            .ok_or_else(|| TrainError::Config("no rank ran".into()))?;
        Ok(SpeedReport {
            program: task.name().to_string(),
            options,
            world_size: c.world_size,
            units_per_rank_step: first.units,
            unit: task.unit(),
            params: first.params,
            flops_per_unit: task.flops_per_unit(),
            fp8_linears: first
                .linears
                .iter()
                .filter(|(_, p)| *p == fsdp_nn::LinearPrecision::Fp8)
                .map(|(n, _)| n.clone())
                .collect(),
            linears: first.linears.len(),
            fp8_head: c.fp8_head,
            recipe: self.recipe_name(),
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
            describe: task.describe(),
            precision: c.precision.name(),
            optimizer_in_backward: c.optimizer_in_backward,
            held_bytes: first.held,
        })
    }

    fn speed_rank<T: TrainTask>(
        &self,
        task: &T,
        env: &crate::RankEnv,
        options: SpeedOptions,
    ) -> Result<RankSpeed, TrainError> {
        let device = env.device.clone();
        if let Device::Cuda(cu) = &device {
            cu.set_pool_release_threshold(u64::MAX)?;
        }
        let (mut model, linears) = self.build_for_speed(task, env)?;
        let mut opt = self.optimizer(task, &mut model)?;
        let mut data = task.data(env).map_err(TrainError::task)?;
        let batch = task.speed_batch(&mut data, env).map_err(TrainError::task)?;
        let units = task.batch_weight(&batch);
        if !task.averages_in_loss() {
            model.set_grad_divisor(env.world_size as f32)?;
        }
        let mut held = None;
        let mut step = |model: &mut fsdp_shard::FsdpModel<T::Model>,
                        prof: &mut Option<crate::profile::ProfiledStep>|
         -> Result<(), TrainError> {
            mark(prof, Phase::Data)?;
            task.forward(model, &batch).map_err(TrainError::task)?;
            held = task.held_bytes(model);
            mark(prof, Phase::Forward)?;
            self.begin_step(task, opt.as_mut(), model)?;
            task.backward(model, &batch).map_err(TrainError::task)?;
            mark(prof, Phase::Backward)?;
            self.finish_step(opt.as_mut(), model)?;
            mark(prof, Phase::Optimizer)?;
            Ok(())
        };
        for _ in 0..options.warmup_steps {
            step(&mut model, &mut None)?;
        }
        reset_peak_memory(&device)?;
        let mut profiler = options
            .profile
            .then(|| StepProfiler::new(&device, options.timed_steps, options.warmup_steps, false));
        let mut profile = None;
        let mut times = Vec::with_capacity(options.timed_steps);
        for _ in 0..options.timed_steps {
            device.synchronize()?;
            let t0 = Instant::now();
            let mut prof = begin_profiled_step(&mut profiler)?;
            step(&mut model, &mut prof)?;
            device.synchronize()?;
            times.push(t0.elapsed().as_secs_f64());
            finish_profiled_step(&mut profiler, prof, &mut profile, false)?;
        }
        let peak = peak_memory(&device)?;
        let loss = {
            let l = task.loss(&model).map_err(TrainError::task)?;
            let v = f64::from(l.values.to_vec()?.first().copied().unwrap_or(f32::NAN));
            match l.kind {
                crate::LossKind::Mean => v,
                crate::LossKind::Sum => v / units.max(1) as f64,
            }
        };
        let memory = opt.memory(model.sharded())?;
        Ok(RankSpeed {
            profile,
            times,
            peak,
            memory,
            optimizer: opt.describe(),
            loss,
            units,
            linears,
            params: model.num_params(),
            held,
        })
    }
}
