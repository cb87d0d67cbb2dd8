//! `gpt_fsdp`'s training loop: the peer's run (`peer_gpt.py train`) on the sharded model.
//!
//! Each optimizer step draws a global batch of `batch_size x world_size` windows of `train.bin` per
//! micro-batch from one seeded stream ([`TrainWindowSampler`], rank 0's stream, its position saved in
//! checkpoints) and gives each rank its share, so the data does not depend on the world size. The
//! schedule and the optimizer are the peer's ([`peer_schedule`], [`super::peer_adamw_options`]).
//! Validation is the peer's: every non-overlapping `seq_len` window of `val.bin` in batches of
//! `batch_size`, the batches split over the ranks and the sums all-reduced, every `steps / 10` steps
//! and at the end. Checkpoints follow the examples' protocol ([`crate::training`]).

use super::run::{
    build_model, build_optimizer, peer_schedule, GptModelChoice, GptPrecision, GptRunError,
};
use super::{Gpt, Sampling, GPT2_PADDED_VOCAB};
use crate::data::tokens::{
    Gpt2Bpe, TokenFile, TrainWindowSampler, ValidationWindows, GPT2_VOCAB_SIZE,
};
use crate::metrics::{MetricsRecord, MetricsWriter};
use crate::progress::{EpochProgress, ProgressMode};
use crate::run_setup::{launch_ranks, DeviceChoice, RankLaunch, RunOutputs};
use crate::training::{
    check_resume, resume_metrics, save_run, saved_record, RunSetting, RunSettings,
};
use fp8_kernels::{CpuParallelism, Device};
use fsdp_comm::{Communicator, ReduceOp};
use fsdp_nn::Activation;
use fsdp_optim::{export_full, step_model, ExportDtype, Optimizer, StatePrecision};
use fsdp_shard::checkpoint::{load_sharded, read_index};
use fsdp_shard::{FsdpModel, MemoryReport, Mode};
use half::bf16;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The prompt `--sample` continues.
pub const SAMPLE_PROMPT: &str = "ROMEO:\nBut soft, what light";

/// A training run.
#[derive(Debug, Clone, PartialEq)]
pub struct GptTrainConfig {
    /// The model.
    pub model: GptModelChoice,
    /// Windows per rank and micro-batch.
    pub batch_size: usize,
    /// Optimizer steps in total.
    pub steps: u64,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Storage of the FP8 weights' optimizer states.
    pub optimizer_states: StatePrecision,
    /// Ranks.
    pub world_size: usize,
    /// Where.
    pub device: DeviceChoice,
    /// Directory holding `train.bin` and `val.bin`.
    pub data_dir: PathBuf,
    /// Renumber the ids of the data densely (the distinct ids of train and val, padded to a multiple of
    /// 64) and size `wte` to them: a CPU smoke option (the head's cost is proportional to the
    /// vocabulary). Exports are then not the peer's shapes.
    pub compact_vocab: bool,
    /// Validate every this many steps (default `steps / 10`, at least 1) and at the end.
    pub eval_every: Option<u64>,
    /// Evaluate at most this many validation batches (all by default, as the peer).
    pub max_val_batches: Option<usize>,
    /// Save a checkpoint here at the end (and every `save_every` steps).
    pub save: Option<PathBuf>,
    /// Also save every this many steps.
    pub save_every: Option<u64>,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Stop after this many steps in total (saving first with `save`): an interruption, for tests.
    pub stop_after_steps: Option<u64>,
    /// One JSON line per validation here (rank 0).
    pub metrics: Option<PathBuf>,
    /// Write the master weights here at the end (peer names, `wte.weight` once).
    pub export: Option<PathBuf>,
    /// Element type of the export.
    pub export_dtype: ExportDtype,
    /// Load the weights of such a file before training (by name).
    pub init_from: Option<PathBuf>,
    /// Generate this many tokens from [`SAMPLE_PROMPT`] after training.
    pub sample: Option<usize>,
    /// Progress bar on rank 0.
    pub progress: ProgressMode,
    /// Print lines on rank 0.
    pub print: bool,
    /// CPU threads per rank.
    pub threads_per_rank: Option<usize>,
}

/// One validation point.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalPoint {
    /// Steps done.
    pub step: u64,
    /// The step's training loss (mean over its global batch).
    pub train_loss: f64,
    /// Mean loss over the validation windows.
    pub val_loss: f64,
    /// The step's learning rate.
    pub lr: f64,
    /// Training tokens per second (all ranks) since the last point.
    pub tokens_per_sec: f64,
}

/// What a run produced (rank 0's view).
#[derive(Debug, Clone)]
pub struct GptTrainReport {
    /// Every validation point of this invocation.
    pub evals: Vec<EvalPoint>,
    /// The training loss of every step of this invocation (global mean; read on the CPU only, or at
    /// validation points on CUDA).
    pub step_losses: Vec<(u64, f64)>,
    /// Steps done in total.
    pub steps: u64,
    /// Whether it stopped at `stop_after_steps`.
    pub stopped_early: bool,
    /// The generated text of `sample`.
    pub sample: Option<String>,
    /// Rank 0's model state by category.
    pub memory: MemoryReport,
    /// The device in words.
    pub device: String,
    /// The optimizer in words.
    pub optimizer: String,
    /// The recipe in words.
    pub recipe: String,
    /// Block linears in FP8.
    pub fp8_linears: Vec<&'static str>,
    /// Parameters.
    pub params: usize,
}

impl GptTrainConfig {
    /// A run of `steps` steps of `model` with the defaults (batch 8, lr 6e-4, one rank, the CPU).
    pub fn new(model: GptModelChoice, steps: u64) -> Self {
        GptTrainConfig {
            model,
            batch_size: 8,
            steps,
            grad_accum: 1,
            lr: 6e-4,
            optimizer_states: StatePrecision::default(),
            world_size: 1,
            device: DeviceChoice::Cpu,
            data_dir: PathBuf::from(crate::data::tokens::DEFAULT_SHAKESPEARE_DIR),
            compact_vocab: false,
            eval_every: None,
            max_val_batches: None,
            save: None,
            save_every: None,
            resume: None,
            stop_after_steps: None,
            metrics: None,
            export: None,
            export_dtype: ExportDtype::F32,
            init_from: None,
            sample: None,
            progress: ProgressMode::Hidden,
            print: false,
            threads_per_rank: None,
        }
    }

    fn validate(&self) -> Result<(), GptRunError> {
        let bad = |m: String| Err(GptRunError::Config(m));
        for (flag, v) in [
            ("--steps", Some(self.steps)),
            ("--batch-size", Some(self.batch_size as u64)),
            ("--grad-accum", Some(self.grad_accum as u64)),
            ("--world-size", Some(self.world_size as u64)),
            ("--save-every", self.save_every),
            ("--eval-every", self.eval_every),
            ("--stop-after-steps", self.stop_after_steps),
            ("--max-val-batches", self.max_val_batches.map(|v| v as u64)),
            (
                "--threads-per-rank",
                self.threads_per_rank.map(|v| v as u64),
            ),
        ] {
            if v == Some(0) {
                return bad(format!(
                    "{flag} must be at least 1 (0 would silently do nothing)"
                ));
            }
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("--lr {} must be finite and >= 0", self.lr));
        }
        if self.save_every.is_some() && self.save.is_none() {
            return bad("--save-every needs --save".into());
        }
        if let Some(n) = self.sample {
            if n + 1 > self.model.seq_len {
                return bad(format!(
                    "--sample {n}: the prompt and {n} new tokens must fit --seq-len {}",
                    self.model.seq_len
                ));
            }
        }
        Ok(())
    }

    fn eval_every(&self) -> u64 {
        self.eval_every.unwrap_or((self.steps / 10).max(1))
    }

    /// The settings a resume must share, and those it may change.
    fn settings(&self, data_id: &str) -> RunSettings {
        let m = &self.model;
        let opt = |v: Option<usize>| v.map_or("preset".to_string(), |v| v.to_string());
        RunSettings {
            binary: "gpt_fsdp",
            identity: vec![
                RunSetting::new("preset", "--preset", &m.preset),
                RunSetting::new("d_model", "--d-model", opt(m.d_model)),
                RunSetting::new("layers", "--layers", opt(m.layers)),
                RunSetting::new("heads", "--heads", opt(m.heads)),
                RunSetting::new("seq_len", "--seq-len", m.seq_len),
                RunSetting::new("seed", "--seed", m.seed),
                RunSetting::new("precision", "--precision", m.precision.name()),
                RunSetting::new(
                    "fp8_layers",
                    "--fp8-layers",
                    format!("{:?}", m.fp8_layers).to_lowercase(),
                ),
                RunSetting::new("fp8_grad_comm", "--fp8-grad-comm", m.fp8_grad_comm),
                RunSetting::new("grad_shards", "--grad-shards", m.grad_shards.name()),
                RunSetting::new("batch_size", "--batch-size", self.batch_size),
                RunSetting::new("grad_accum", "--grad-accum", self.grad_accum),
                RunSetting::new(
                    "optimizer_states",
                    "--optimizer-states",
                    self.optimizer_states.name(),
                ),
                RunSetting::new("compact_vocab", "--compact-vocab", self.compact_vocab),
                RunSetting::new("data", "--data", data_id),
            ],
            hyperparameters: vec![
                RunSetting::new("hyper.lr", "--lr", self.lr),
                RunSetting::new("hyper.steps", "--steps", self.steps),
            ],
        }
    }
}

/// The token data of a run, shared by the thread ranks.
struct RunData {
    train: Vec<u16>,
    val: Vec<u16>,
    /// Dense id -> GPT-2 id with `compact_vocab`.
    dense_to_gpt2: Option<Vec<u16>>,
    vocab: usize,
    id: String,
}

impl RunData {
    fn load(config: &GptTrainConfig) -> Result<Self, GptRunError> {
        let train = TokenFile::open(config.data_dir.join("train.bin"), GPT2_VOCAB_SIZE)?;
        let val = TokenFile::open(config.data_dir.join("val.bin"), GPT2_VOCAB_SIZE)?;
        let mut h = crc32fast::Hasher::new();
        h.update(bytemuck::cast_slice(train.tokens()));
        h.update(bytemuck::cast_slice(val.tokens()));
        let id = format!("{}+{}:{:08x}", train.len(), val.len(), h.finalize());
        let (mut train, mut val) = (train.tokens().to_vec(), val.tokens().to_vec());
        if !config.compact_vocab {
            return Ok(RunData {
                train,
                val,
                dense_to_gpt2: None,
                vocab: GPT2_PADDED_VOCAB,
                id,
            });
        }
        let mut distinct: Vec<u16> = train.iter().chain(&val).copied().collect();
        distinct.sort_unstable();
        distinct.dedup();
        for t in train.iter_mut().chain(val.iter_mut()) {
            // Every id is in `distinct` by construction.
            *t = distinct.binary_search(t).unwrap_or(0) as u16;
        }
        let vocab = distinct.len().div_ceil(64) * 64;
        Ok(RunData {
            train,
            val,
            dense_to_gpt2: Some(distinct),
            vocab,
            id,
        })
    }
}

/// Where training stands.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Position {
    step: u64,
    sampler: u64,
}

impl Position {
    fn to_extra(self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("global_step".to_string(), self.step.to_string()),
            ("sampler_position".to_string(), self.sampler.to_string()),
        ])
    }

    fn from_extra(extra: &BTreeMap<String, String>) -> Result<Self, GptRunError> {
        let num = |k: &str| -> Result<u64, GptRunError> {
            extra
                .get(k)
                .ok_or_else(|| GptRunError::Checkpoint(format!("no {k} in the checkpoint")))?
                .parse()
                .map_err(|e| GptRunError::Checkpoint(format!("{k}: {e}")))
        };
        Ok(Position {
            step: num("global_step")?,
            sampler: num("sampler_position")?,
        })
    }
}

/// Trains as `config` says; prints on rank 0 when `config.print`.
pub fn train(config: &GptTrainConfig) -> Result<GptTrainReport, GptRunError> {
    config.validate()?;
    let files: Vec<(&str, &Path)> = config
        .metrics
        .iter()
        .map(|m| ("--metrics", m.as_path()))
        .chain(config.export.iter().map(|e| ("--export", e.as_path())))
        .collect();
    let _outputs = RunOutputs::prepare(config.save.as_deref().map(|d| ("--save", d)), &files)?;
    let data = RunData::load(config)?;
    let gpt = config.model.config(data.vocab)?;
    if data.train.len() < gpt.seq_len + 2 || data.val.len() < gpt.seq_len + 1 {
        return Err(GptRunError::Config(format!(
            "--seq-len {} is longer than the data allows ({} training and {} validation tokens)",
            gpt.seq_len,
            data.train.len(),
            data.val.len()
        )));
    }
    let launch = RankLaunch {
        binary: "gpt_fsdp",
        device: config.device,
        world_size: config.world_size,
        threads_per_rank: config.threads_per_rank,
        timeout: Duration::from_secs(1800),
    };
    let (outcomes, device) = launch_ranks(&launch, |comm, par| match config.model.precision {
        GptPrecision::Fp32 => run_rank::<f32>(comm, config, &data, par),
        _ => run_rank::<bf16>(comm, config, &data, par),
    })?;
    let mut first = outcomes
        .into_iter()
        .next()
        .ok_or_else(|| GptRunError::Config("no rank ran".into()))?;
    first.device = device;
    first.fp8_linears = config.model.fp8_linears(&gpt);
    first.recipe = config.model.recipe(&gpt);
    first.params = gpt.num_params();
    Ok(first)
}

fn run_rank<T: Activation>(
    comm: Arc<dyn Communicator>,
    config: &GptTrainConfig,
    data: &RunData,
    par: CpuParallelism,
) -> Result<GptTrainReport, GptRunError> {
    let device = comm.device().clone();
    if let Device::Cuda(c) = &device {
        c.set_pool_release_threshold(u64::MAX)?;
    }
    let (rank, ws) = (comm.rank(), comm.world_size());
    let lead = rank == 0 && config.print;
    let gpt = config.model.config(data.vocab)?;
    let settings = config.settings(&data.id);
    let recipe = config.model.recipe(&gpt);
    let mut model = build_model::<T>(comm.clone(), gpt.clone(), &config.model, par)?;
    if let Some(path) = &config.init_from {
        model
            .import_full(path, false)
            .map_err(|e| GptRunError::Config(format!("--init-from {}: {e}", path.display())))?;
    }
    let mut opt = build_optimizer(&mut model, config.lr, config.optimizer_states)?;
    opt.set_schedule(Box::new(peer_schedule(config.steps)?));
    let (b, t, accum) = (config.batch_size, gpt.seq_len, config.grad_accum);
    let mut sampler = TrainWindowSampler::new(data.train.len(), t, b * ws, config.model.seed, 0)?;
    let mut pos = Position {
        step: 0,
        sampler: 0,
    };
    let mut carried = None;
    if let Some(dir) = &config.resume {
        let (_, saved) = read_index(dir)?;
        let changes = check_resume(&saved, &settings).map_err(GptRunError::Checkpoint)?;
        if lead {
            for c in &changes {
                println!("resuming with a changed setting: {c}");
            }
        }
        // The optimizer checks the schedule it loads against its own: load under the saved one.
        let saved_steps = saved
            .get("hyper.steps")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(config.steps);
        opt.set_schedule(Box::new(peer_schedule(saved_steps)?));
        let loaded = load_sharded(dir, model.sharded_mut(), Some(opt.as_state_mut()))?;
        if loaded.saved_world_size != ws {
            return Err(GptRunError::Checkpoint(format!(
                "saved by {} rank(s); resume with --world-size {} (each rank's share of the batch \
                 depends on it)",
                loaded.saved_world_size, loaded.saved_world_size
            )));
        }
        pos = Position::from_extra(&loaded.extra)?;
        model.import_module_state(&loaded.extra)?;
        carried = saved_record(&loaded.extra)?;
        // A changed --steps changes the schedule: rebuild it at the saved position.
        opt.set_schedule(Box::new(peer_schedule(config.steps)?));
        opt.set_schedule_position(pos.step);
        opt.set_lr(config.lr)?;
        sampler.set_position(pos.sampler);
    }
    let mut writer = match (&config.metrics, rank == 0) {
        (Some(path), true) if config.resume.is_some() => {
            let through = pos.step;
            let carried_step = carried.as_ref().map(|r: &MetricsRecord| u64::from(r.epoch));
            Some(resume_metrics(
                path,
                |r| {
                    u64::from(r.epoch) < through
                        || (carried_step.is_none() && u64::from(r.epoch) == through)
                },
                carried.as_ref(),
            )?)
        }
        (Some(path), true) => Some(MetricsWriter::create(path)?),
        _ => None,
    };
    let val = ValidationWindows::new(data.val.len(), t, b)?;
    let eval_every = config.eval_every();
    let tokens_per_step = (b * t * ws * accum) as u64;
    let remaining = config.steps.saturating_sub(pos.step);
    let mode = if rank == 0 {
        config.progress
    } else {
        ProgressMode::Hidden
    };
    let mut progress =
        EpochProgress::new(1, remaining * tokens_per_step, mode).with_labels("train", "tokens");
    // Reading the loss waits for the device: on CUDA only at validation points and, with a visible
    // bar, every 10th step.
    let read_every = match (device.is_cuda(), progress.is_visible()) {
        (false, _) => 1,
        (true, true) => 10,
        (true, false) => u64::MAX,
    };
    let (mut x, mut y) = (vec![0i32; b * ws * t], vec![0i32; b * ws * t]);
    let mine = rank * b * t..(rank + 1) * b * t;
    let scale = 1.0 / (ws * accum) as f32;
    let mut report = GptTrainReport {
        evals: Vec::new(),
        step_losses: Vec::new(),
        steps: pos.step,
        stopped_early: false,
        sample: None,
        memory: MemoryReport::default(),
        device: String::new(),
        optimizer: opt.describe(),
        recipe: String::new(),
        fp8_linears: Vec::new(),
        params: 0,
    };
    let mut since = (Instant::now(), 0u64);
    let mut shown = f64::NAN;
    while pos.step < config.steps {
        let lr = opt.current_lr();
        let s = pos.step + 1;
        let at_eval = s % eval_every == 0 || s == config.steps;
        let read = at_eval || (read_every != u64::MAX && s % read_every == 0);
        let mut loss = 0.0f64;
        for micro in 0..accum {
            sampler.fill_next(&data.train, &mut x, &mut y)?;
            let batch = model
                .module()
                .batch(&device, &x[mine.clone()], &y[mine.clone()], b, t)?;
            model.sharded_mut().set_grad_sync(micro + 1 == accum);
            model.forward(Mode::Train, |m, ctx| {
                m.forward_with_grad(ctx, &batch, scale)
            })?;
            if read {
                loss += model.module().loss()?.mean()? / accum as f64;
            }
            model.backward(|m, ctx| m.backward(ctx, &batch, scale))?;
        }
        step_model(&mut opt, &mut model)?;
        opt.advance_schedule();
        pos = Position {
            step: s,
            sampler: sampler.position(),
        };
        since.1 += tokens_per_step;
        if read {
            let mut l = [loss as f32];
            comm.all_reduce_host_f32(&mut l, ReduceOp::Sum)?;
            shown = f64::from(l[0]) / ws as f64;
            report.step_losses.push((s, shown));
        }
        progress.advance(tokens_per_step, shown);
        let mut record = None;
        if at_eval {
            device.synchronize()?;
            let tokens_per_sec = since.1 as f64 / since.0.elapsed().as_secs_f64().max(1e-9);
            let val_loss = validate(&mut model, comm.as_ref(), &data.val, &val, config)?;
            let point = EvalPoint {
                step: s,
                train_loss: shown,
                val_loss,
                lr,
                tokens_per_sec,
            };
            if lead {
                progress.println(&format!(
                    "step {s}: train loss {:.4}, val loss {val_loss:.4}, lr {lr:.3e}, {tokens_per_sec:.0} \
                     tokens/s",
                    point.train_loss
                ));
            }
            record = Some(metrics_record(&point, config, &recipe));
            report.evals.push(point);
            since = (Instant::now(), 0);
        }
        let stop = config.stop_after_steps == Some(s);
        let periodic = config.save_every.is_some_and(|k| s % k == 0);
        if let (Some(dir), true) = (&config.save, stop || periodic || s == config.steps) {
            save_run(
                dir,
                &mut model,
                &opt,
                pos.to_extra(),
                &settings,
                record.as_ref(),
            )?;
        }
        if let (Some(w), Some(r)) = (writer.as_mut(), &record) {
            w.write(r)?;
        }
        if stop && s < config.steps {
            report.stopped_early = true;
            break;
        }
    }
    progress.finish();
    report.steps = pos.step;
    if !report.stopped_early {
        if let Some(path) = &config.export {
            export_full(&mut model, &opt, path, config.export_dtype)?;
        }
        if let Some(n) = config.sample {
            report.sample = Some(sample(&mut model, n, data)?);
        }
    }
    report.memory = opt.memory(model.sharded())?;
    Ok(report)
}

/// The metrics line of a validation point (`epoch` holds the step, `test_loss` the validation loss,
/// `samples_per_sec` the training tokens per second).
fn metrics_record(point: &EvalPoint, config: &GptTrainConfig, recipe: &str) -> MetricsRecord {
    let mut r = MetricsRecord::new(
        u32::try_from(point.step).unwrap_or(u32::MAX),
        point.train_loss,
        point.val_loss,
        0,
        0,
        0.0,
        point.tokens_per_sec,
    );
    r.lr = Some(point.lr);
    let m = &config.model;
    let extra = [
        ("step", serde_json::json!(point.step)),
        ("val_loss", serde_json::json!(point.val_loss)),
        ("tokens_per_s", serde_json::json!(point.tokens_per_sec)),
        ("precision", serde_json::json!(m.precision.name())),
        (
            "fp8_layers",
            serde_json::json!(format!("{:?}", m.fp8_layers).to_lowercase()),
        ),
        ("fp8_grad_comm", serde_json::json!(m.fp8_grad_comm)),
        ("recipe", serde_json::json!(recipe)),
        ("preset", serde_json::json!(m.preset)),
        ("seed", serde_json::json!(m.seed)),
        ("world_size", serde_json::json!(config.world_size)),
    ];
    for (k, v) in extra {
        r.extra.insert(k.to_string(), v);
    }
    r
}

/// The mean loss over the validation windows: batch `i` on rank `i % world_size`, the sums of
/// `mean x windows` and the window counts all-reduced (the peer's weighting).
fn validate<T: Activation>(
    model: &mut FsdpModel<Gpt<T>>,
    comm: &dyn Communicator,
    tokens: &[u16],
    val: &ValidationWindows,
    config: &GptTrainConfig,
) -> Result<f64, GptRunError> {
    let device = model.device().clone();
    let (rank, ws) = (comm.rank(), comm.world_size());
    let (b, t) = (val.batch(), val.seq_len());
    let (mut x, mut y) = (vec![0i32; b * t], vec![0i32; b * t]);
    let batches = config
        .max_val_batches
        .map_or(val.batch_count(), |m| m.min(val.batch_count()));
    // Gathered once for the pass: ranks with fewer batches take part in the same collectives.
    model.gather_all()?;
    let mut sums = [0f32; 2];
    for i in (rank..batches).step_by(ws) {
        let n = val.fill_batch(tokens, i, &mut x, &mut y)?;
        let batch = model
            .module()
            .batch(&device, &x[..n * t], &y[..n * t], n, t)?;
        model.forward(Mode::Eval, |m, ctx| m.forward(ctx, &batch))?;
        sums[0] += (model.module().loss()?.mean()? * n as f64) as f32;
        sums[1] += n as f32;
    }
    model.release_all()?;
    comm.all_reduce_host_f32(&mut sums, ReduceOp::Sum)?;
    Ok(f64::from(sums[0]) / f64::from(sums[1]).max(1.0))
}

/// Generates `n` tokens from [`SAMPLE_PROMPT`] with temperature 0.8, top-k 200 (nanoGPT's
/// sampling), seed 1, and decodes prompt and continuation.
fn sample<T: Activation>(
    model: &mut FsdpModel<Gpt<T>>,
    n: usize,
    data: &RunData,
) -> Result<String, GptRunError> {
    let bpe = Gpt2Bpe::new()?;
    let mut prompt: Vec<i32> = bpe
        .encode_ordinary(SAMPLE_PROMPT)?
        .iter()
        .map(|&t| i32::from(t))
        .collect();
    if let Some(map) = &data.dense_to_gpt2 {
        // Prompt ids the data lacks map to the nearest known id (a smoke option only).
        prompt = prompt
            .iter()
            .map(|&t| match map.binary_search(&(t as u16)) {
                Ok(i) | Err(i) => i.min(map.len() - 1) as i32,
            })
            .collect();
    }
    let room = model.module().config().seq_len.saturating_sub(n).max(1);
    if prompt.len() > room {
        prompt.drain(..prompt.len() - room);
    }
    let sampling = Sampling {
        max_new_tokens: n,
        temperature: 0.8,
        top_k: Some(200),
        seed: 1,
    };
    model.gather_all()?;
    let new = model.forward(Mode::Eval, |m, ctx| m.generate(ctx, &prompt, &sampling))?;
    model.release_all()?;
    let to_gpt2 = |ids: &[i32]| -> Vec<u16> {
        ids.iter()
            .map(|&t| match &data.dense_to_gpt2 {
                Some(map) => map.get(t as usize).copied().unwrap_or(0),
                None => (t as u16).min(GPT2_VOCAB_SIZE as u16 - 1),
            })
            .collect()
    };
    let mut all = to_gpt2(&prompt);
    all.extend(to_gpt2(&new));
    Ok(bpe.decode_lossy(&all)?)
}
