//! The training loop: data-parallel steps over sharded parameters, evaluation, metrics, checkpoints.

use super::batches::Batches;
use super::{wrap_policy, MnistError, MnistNet, NetConfig};
use crate::data::{MnistDataset, MnistSplit};
use crate::metrics::{MetricsRecord, MetricsWriter};
use crate::progress::{EpochProgress, ProgressMode};
pub use crate::run_setup::DeviceChoice;
use crate::run_setup::{launch_ranks, RankLaunch, RunOutputs};
use crate::sampler::{DistributedSampler, Remainder};
use crate::training::profile::{finish_profiled_step, mark, StepProfiler};
pub use crate::training::profile::{Phase, PhaseTiming, StepProfile, PROFILE_WARMUP_STEPS};
use crate::training::{
    check_resume, resume_metrics, save_run, saved_record, RunSetting, RunSettings,
};
use fp8_core::Fp8Format;
use fp8_kernels::elementwise;
use fp8_kernels::softmax::nll_stat;
use fp8_kernels::{CpuParallelism, Device};
use fsdp_comm::{Communicator, ReduceOp};
use fsdp_nn::LinearPrecision;
use fsdp_optim::{
    export_full, step_model, AdamOptions, ExportDtype, FsdpAdam, Optimizer, StatePrecision, StepLr,
};
use fsdp_shard::checkpoint::{load_sharded, read_index};
use fsdp_shard::{FsdpConfig, FsdpModel, GradReduction, MemoryReport, Mode};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A training run. [`TrainConfig::default`] is the reference setup (14 epochs, batch 64 per rank, test
/// batch 1000, Adam lr 1e-3, StepLR gamma 0.7, seed 1, FP8, one rank).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Epochs to train (1-based; a resumed run continues up to this epoch).
    pub epochs: u32,
    /// Training batch per rank (per micro-batch with accumulation).
    pub batch_size: usize,
    /// Test batch per rank.
    pub test_batch_size: usize,
    /// Base learning rate of Adam.
    pub lr: f64,
    /// StepLR factor applied after every epoch.
    pub gamma: f64,
    /// Seed of initialisation, shuffling and dropout.
    pub seed: u64,
    /// Arithmetic of the linear layers.
    pub precision: LinearPrecision,
    /// Reduce-scatter the FP8 weights' gradients in FP8 (E5M2) instead of F32.
    pub fp8_grad_comm: bool,
    /// Storage of the FP8 weights' optimizer states (`fsdp_optim::FsdpAdam`; the CUDA fallback keeps F32).
    pub optimizer_states: StatePrecision,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Ranks: threads on the CPU; on CUDA it must match the launcher's `WORLD_SIZE` (1 without one).
    pub world_size: usize,
    /// Where to run.
    pub device: DeviceChoice,
    /// Directory of the MNIST IDX files.
    pub data_dir: PathBuf,
    /// Save a sharded checkpoint here after every epoch (and every `save_every_steps` steps).
    pub save: Option<PathBuf>,
    /// Also save every this many optimizer steps (mid-epoch), when `save` is set.
    pub save_every_steps: Option<u64>,
    /// Resume from this sharded checkpoint (same world size, precision, batch size and seed).
    pub resume: Option<PathBuf>,
    /// Append one JSON line per epoch here (rank 0).
    pub metrics: Option<PathBuf>,
    /// At the end, write the master weights here as one safetensors file named as PyTorch names the
    /// reference net's parameters (`conv1.weight`, ..., `fc2.bias`).
    pub export: Option<PathBuf>,
    /// Element type of the exported file.
    pub export_dtype: ExportDtype,
    /// Train at most this many batches per epoch and rank (smoke runs).
    pub limit_batches: Option<usize>,
    /// Stop after this many optimizer steps in total (after saving, when `save` is set): an
    /// interruption, for testing resumption.
    pub stop_after_steps: Option<u64>,
    /// Progress bar on rank 0.
    pub progress: ProgressMode,
    /// Print the reference lines on rank 0.
    pub print: bool,
    /// CPU threads per rank (default: the cores divided by the ranks, at least 1).
    pub threads_per_rank: Option<usize>,
    /// Time the phases of this many training steps (after [`PROFILE_WARMUP_STEPS`] warm-up steps of the
    /// first epoch run) and print a table on rank 0: CUDA-event time on a GPU, host time everywhere.
    pub profile_steps: Option<usize>,
    /// With `profile_steps` on a GPU: wait for the device at every phase boundary, so each phase's GPU
    /// time is its own kernels' time and its host time is pure queuing cost (the step is serialised, so
    /// the wall time is their sum, not the overlapped step).
    pub profile_sync: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 14,
            batch_size: 64,
            test_batch_size: 1000,
            lr: 1e-3,
            gamma: 0.7,
            seed: 1,
            precision: LinearPrecision::Fp8,
            fp8_grad_comm: false,
            optimizer_states: StatePrecision::default(),
            grad_accum: 1,
            world_size: 1,
            device: DeviceChoice::Auto,
            data_dir: PathBuf::from(crate::data::DEFAULT_MNIST_DIR),
            save: None,
            save_every_steps: None,
            resume: None,
            metrics: None,
            export: None,
            export_dtype: ExportDtype::F32,
            limit_batches: None,
            stop_after_steps: None,
            progress: ProgressMode::Auto,
            print: true,
            threads_per_rank: None,
            profile_steps: None,
            profile_sync: false,
        }
    }
}

/// What a run produced (rank 0's view, plus every rank's memory).
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// One record per epoch run by this invocation.
    pub epochs: Vec<MetricsRecord>,
    /// Memory held per rank at the end, by category (optimizer states included).
    pub memory: Vec<MemoryReport>,
    /// Every parameter at the end, gathered and as F32 (FP8 weights decoded), in declaration order, with
    /// its name (PyTorch's names for the reference net).
    pub params: Vec<(String, Vec<f32>)>,
    /// Optimizer steps taken in total (including those before a resume).
    pub steps: u64,
    /// Whether the run stopped at `stop_after_steps` before finishing.
    pub stopped_early: bool,
    /// The device, in words.
    pub device: String,
    /// Ranks.
    pub world_size: usize,
    /// The optimizer, in words.
    pub optimizer: String,
    /// Rank 0's phase timings when `profile_steps` was set and the window completed.
    pub profile: Option<StepProfile>,
    /// Per rank, the mean loss of every training micro-batch this invocation ran, in order (the value the
    /// loss kernel produced on that rank's batch). Read only on the CPU, where it costs no device wait;
    /// empty on CUDA.
    pub step_losses: Vec<Vec<f32>>,
}

impl TrainReport {
    /// Mean seconds per epoch (training and test).
    pub fn seconds_per_epoch(&self) -> f64 {
        mean(self.epochs.iter().map(|e| e.seconds))
    }

    /// Mean training samples per second over all ranks.
    pub fn samples_per_sec(&self) -> f64 {
        mean(self.epochs.iter().map(|e| e.samples_per_sec))
    }
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

impl TrainConfig {
    fn validate(&self) -> Result<(), MnistError> {
        let bad = |m: String| Err(MnistError::Config(m));
        if self.batch_size == 0 || self.test_batch_size == 0 {
            return bad("batch sizes must be at least 1".into());
        }
        if self.grad_accum == 0 {
            return bad("gradient accumulation needs at least 1 micro-batch".into());
        }
        if self.world_size == 0 {
            return bad("world size must be at least 1".into());
        }
        let usable = |v: f64| v.is_finite() && v >= 0.0;
        if !usable(self.lr) || !usable(self.gamma) {
            return bad(format!(
                "lr {} and gamma {} must be finite and >= 0",
                self.lr, self.gamma
            ));
        }
        for (flag, value) in [
            ("--limit-batches", self.limit_batches.map(|v| v as u64)),
            (
                "--threads-per-rank",
                self.threads_per_rank.map(|v| v as u64),
            ),
            ("--stop-after-steps", self.stop_after_steps),
            ("--save-every", self.save_every_steps),
            ("--profile-steps", self.profile_steps.map(|v| v as u64)),
        ] {
            if value == Some(0) {
                return bad(format!(
                    "{flag} must be at least 1 (0 would silently do nothing)"
                ));
            }
        }
        if self.save_every_steps.is_some() && self.save.is_none() {
            return bad("--save-every needs --save".into());
        }
        Ok(())
    }

    /// The learning rate of `epoch` (1-based): StepLR with step 1, `lr * gamma^(epoch - 1)`.
    pub fn lr_for_epoch(&self, epoch: u32) -> f64 {
        self.lr * self.gamma.powi(epoch.saturating_sub(1) as i32)
    }
}

/// Trains and tests as `config` says; prints the reference lines on rank 0 when `config.print`.
pub fn train(config: &TrainConfig) -> Result<TrainReport, MnistError> {
    config.validate()?;
    // Outputs are checked (and the checkpoint directory locked) before any work.
    let files: Vec<(&str, &Path)> = config
        .metrics
        .iter()
        .map(|m| ("--metrics", m.as_path()))
        .chain(config.export.iter().map(|e| ("--export", e.as_path())))
        .collect();
    let _outputs = RunOutputs::prepare(config.save.as_deref().map(|d| ("--save", d)), &files)?;
    let train_data = MnistDataset::load(&config.data_dir, MnistSplit::Train)?;
    let test_data = MnistDataset::load(&config.data_dir, MnistSplit::Test)?;
    let data_id = data_fingerprint(&train_data, &test_data);
    let data = (&train_data, &test_data, data_id.as_str());
    let launch = RankLaunch {
        binary: "mnist_fsdp",
        device: config.device,
        world_size: config.world_size,
        threads_per_rank: config.threads_per_rank,
        // Collectives wait at most this long for the other ranks (an evaluation pass can be long).
        timeout: Duration::from_secs(600),
    };
    let (outcomes, device) = launch_ranks(&launch, |comm, par| run_rank(comm, config, data, par))?;
    let memory = outcomes.iter().map(|o| o.memory.clone()).collect();
    let step_losses = outcomes.iter().map(|o| o.step_losses.clone()).collect();
    let Some(first) = outcomes.into_iter().next() else {
        return Err(MnistError::Config("no rank ran".into()));
    };
    Ok(TrainReport {
        epochs: first.records,
        memory,
        params: first.params,
        steps: first.steps,
        stopped_early: first.stopped,
        device,
        world_size: config.world_size,
        optimizer: first.optimizer,
        profile: first.profile,
        step_losses,
    })
}

struct RankOutcome {
    records: Vec<MetricsRecord>,
    memory: MemoryReport,
    params: Vec<(String, Vec<f32>)>,
    steps: u64,
    stopped: bool,
    optimizer: String,
    profile: Option<StepProfile>,
    step_losses: Vec<f32>,
}

/// Where training stands: the next batch of an epoch and the epoch's loss so far.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Position {
    epoch: u32,
    batch: usize,
    step: u64,
    loss_sum: f32,
    samples: u64,
}

const POSITION_KEYS: [&str; 5] = [
    "epoch",
    "batch",
    "global_step",
    "train_loss_sum",
    "train_samples",
];

impl Position {
    fn to_extra(self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        let vals = [
            self.epoch.to_string(),
            self.batch.to_string(),
            self.step.to_string(),
            format!("{:08x}", self.loss_sum.to_bits()),
            self.samples.to_string(),
        ];
        for (k, v) in POSITION_KEYS.iter().zip(vals) {
            m.insert((*k).to_string(), v);
        }
        m
    }

    fn from_extra(extra: &BTreeMap<String, String>) -> Result<Self, MnistError> {
        let get = |k: &str| {
            extra
                .get(k)
                .ok_or_else(|| MnistError::Checkpoint(format!("no {k} in the checkpoint")))
        };
        let num = |k: &str| -> Result<u64, MnistError> {
            get(k)?
                .parse()
                .map_err(|e| MnistError::Checkpoint(format!("{k}: {e}")))
        };
        let bits = u32::from_str_radix(get("train_loss_sum")?, 16)
            .map_err(|e| MnistError::Checkpoint(format!("train_loss_sum: {e}")))?;
        Ok(Position {
            epoch: u32::try_from(num("epoch")?)
                .map_err(|e| MnistError::Checkpoint(format!("epoch: {e}")))?,
            batch: num("batch")? as usize,
            step: num("global_step")?,
            loss_sum: f32::from_bits(bits),
            samples: num("train_samples")?,
        })
    }
}

/// The settings a checkpoint records: those a resumed run must share with the saved one (the data
/// order and numerics depend on them) and the hyperparameters it may change (printed and recorded in
/// the metrics when they do).
fn run_settings(config: &TrainConfig, data: &str) -> RunSettings {
    RunSettings {
        binary: "mnist_fsdp",
        identity: vec![
            RunSetting::new("seed", "--seed", config.seed),
            RunSetting::new(
                "precision",
                "--precision",
                format!("{:?}", config.precision),
            ),
            RunSetting::new("batch_size", "--batch-size", config.batch_size),
            RunSetting::new("grad_accum", "--grad-accum", config.grad_accum),
            RunSetting::new("fp8_grad_comm", "--fp8-grad-comm", config.fp8_grad_comm),
            RunSetting::new(
                "optimizer_states",
                "--optimizer-states",
                config.optimizer_states.name(),
            ),
            RunSetting::new("data", "--data-dir", data),
        ],
        hyperparameters: vec![
            RunSetting::new("hyper.lr", "--lr", config.lr),
            RunSetting::new("hyper.gamma", "--gamma", config.gamma),
            RunSetting::new("hyper.epochs", "--epochs", config.epochs),
        ],
    }
}

/// A fingerprint of the training and test data: sizes and a CRC of the labels (changing the dataset under
/// a resumed run changes the data order and the numbers).
pub fn data_fingerprint(train: &MnistDataset, test: &MnistDataset) -> String {
    let mut h = crc32fast::Hasher::new();
    h.update(train.labels());
    h.update(test.labels());
    format!("{}+{}:{:08x}", train.len(), test.len(), h.finalize())
}

fn save(
    dir: &Path,
    model: &mut FsdpModel<MnistNet>,
    opt: &dyn Optimizer,
    pos: Position,
    config: &TrainConfig,
    data_id: &str,
    epoch_record: Option<&MetricsRecord>,
) -> Result<(), MnistError> {
    let settings = run_settings(config, data_id);
    save_run(dir, model, opt, pos.to_extra(), &settings, epoch_record)?;
    Ok(())
}

/// Test loss sum, correct predictions and digits over all ranks (each rank evaluates its shard of the
/// test set, padding excluded, so every digit counts once).
fn evaluate(
    model: &mut FsdpModel<MnistNet>,
    comm: &dyn Communicator,
    data: &MnistDataset,
    batch: usize,
    buffers: &mut Batches,
    indices: &[usize],
) -> Result<(f64, u64, u64), MnistError> {
    let device = model.device().clone();
    // Gathered once for the whole pass on every rank (a collective), so ranks with fewer test batches
    // than others take part in the same collectives.
    model.gather_all()?;
    let mut sums = [0f32; 3];
    for (ci, chunk) in indices.chunks(batch).enumerate() {
        let start = ci * batch;
        let range = start..start + chunk.len();
        let (images, labels) = buffers.load(data, indices, range, &device)?;
        let images = images.to_device(&device)?;
        model.forward(Mode::Eval, |net, ctx| net.forward(ctx, images, labels))?;
        let stats = model.module().loss_stats()?.to_vec()?;
        sums[0] += stats[nll_stat::MEAN_LOSS] * chunk.len() as f32;
        sums[1] += stats[nll_stat::CORRECT];
        sums[2] += chunk.len() as f32;
        if stats[nll_stat::INVALID_LABELS] != 0.0 {
            return Err(MnistError::Config("test labels outside 0..10".into()));
        }
    }
    model.release_all()?;
    comm.all_reduce_host_f32(&mut sums, ReduceOp::Sum)?;
    Ok((sums[0] as f64, sums[1] as u64, sums[2] as u64))
}

/// `fsdp_optim::FsdpAdam` with a StepLR schedule (step one epoch), on the CPU and on CUDA (where its step
/// is queued on the device without host reads).
fn new_optimizer(
    model: &mut FsdpModel<MnistNet>,
    config: &TrainConfig,
) -> Result<Box<dyn Optimizer>, MnistError> {
    let options = AdamOptions {
        lr: config.lr,
        state_precision: config.optimizer_states,
        ..AdamOptions::adam()
    };
    let mut opt = FsdpAdam::for_model(model, options)?;
    opt.set_schedule(Box::new(StepLr::new(1, config.gamma)?));
    Ok(Box::new(opt))
}

/// Moves the StepLR schedule (one step per epoch) to `epoch` (1-based).
fn start_epoch(opt: &mut dyn Optimizer, epoch: u32) -> Result<(), MnistError> {
    let want = u64::from(epoch.saturating_sub(1));
    if opt.schedule_position() > want {
        return Err(MnistError::Config(format!(
            "the schedule is at epoch {}, past epoch {epoch}",
            opt.schedule_position() + 1
        )));
    }
    opt.set_schedule_position(want);
    Ok(())
}

fn run_rank(
    comm: Arc<dyn Communicator>,
    config: &TrainConfig,
    (train_data, test_data, data_id): (&MnistDataset, &MnistDataset, &str),
    parallelism: CpuParallelism,
) -> Result<RankOutcome, MnistError> {
    let device = comm.device().clone();
    if let Device::Cuda(c) = &device {
        // Keep freed pool memory cached across the evaluation's host reads instead of unmapping it.
        c.set_pool_release_threshold(u64::MAX)?;
    }
    let (rank, ws) = (comm.rank(), comm.world_size());
    let lead = rank == 0;
    let net = MnistNet::new(NetConfig {
        precision: config.precision,
        seed: config.seed,
        rank,
    })?;
    let fsdp = FsdpConfig {
        grad_reduction: if config.fp8_grad_comm {
            GradReduction::Fp8(Fp8Format::E5M2)
        } else {
            GradReduction::F32
        },
        ..FsdpConfig::default()
    };
    let mut model = FsdpModel::new(net, comm.clone(), wrap_policy(), fsdp)?;
    model.set_cpu_parallelism(parallelism);
    let mut opt = new_optimizer(&mut model, config)?;
    let mut pos = Position {
        epoch: 1,
        batch: 0,
        step: 0,
        loss_sum: 0.0,
        samples: 0,
    };
    let mut resumed_changes = Vec::new();
    let mut resumed_extra = BTreeMap::new();
    if let Some(dir) = &config.resume {
        // The settings first, so a mismatch names its flag instead of failing inside the load.
        let (_, saved) = read_index(dir)?;
        resumed_changes =
            check_resume(&saved, &run_settings(config, data_id)).map_err(MnistError::Checkpoint)?;
        if lead && config.print {
            for c in &resumed_changes {
                println!("resuming with a changed setting: {c}");
            }
        }
        let loaded = load_sharded(dir, model.sharded_mut(), Some(opt.as_state_mut()))?;
        if loaded.saved_world_size != ws {
            return Err(MnistError::Checkpoint(format!(
                "saved by {} rank(s); resuming needs the same world size (got {ws}) to continue the \
                 exact data order and dropout streams",
                loaded.saved_world_size
            )));
        }
        pos = Position::from_extra(&loaded.extra)?;
        resumed_extra = loaded.extra.clone();
        model.import_module_state(&loaded.extra)?;
    }
    let train_sampler =
        DistributedSampler::new(train_data.len(), ws, rank, config.seed, Remainder::Pad)?;
    let test_sampler =
        DistributedSampler::new(test_data.len(), ws, rank, config.seed, Remainder::Pad)?
            .with_shuffle(false);
    let mut writer = match (&config.metrics, lead) {
        // A resume cuts the file back to the checkpoint's epochs: after an epoch-end checkpoint, to the
        // epoch before it, then writes the epoch's line the checkpoint carries (a crash between the save
        // and the line leaves neither a gap nor a duplicate); after a mid-epoch checkpoint, to the epochs
        // completed before it.
        (Some(path), true) if config.resume.is_some() => {
            let last = saved_record(&resumed_extra)?.filter(|_| pos.batch == 0);
            let through = pos.epoch.saturating_sub(if last.is_some() { 2 } else { 1 });
            Some(resume_metrics(path, |m| m.epoch <= through, last.as_ref())?)
        }
        (Some(path), true) => Some(MetricsWriter::create(path)?),
        _ => None,
    };
    let mut train_batches = Batches::new(train_data, &device)?;
    let mut test_batches = Batches::new(test_data, &device)?;
    let mut test_order = test_sampler.indices(0);
    test_order.truncate(test_sampler.num_real_samples());
    test_batches.set_order(&test_order, &device)?;
    let mut loss_acc = device.upload(&[pos.loss_sum, 0.0, 0.0])?;
    let mut records = Vec::new();
    let mut profiler = config
        .profile_steps
        .filter(|&n| n > 0)
        .map(|n| StepProfiler::new(&device, n, PROFILE_WARMUP_STEPS, config.profile_sync));
    let mut profile = None;
    let mut steps_run = 0usize;
    let mut step_losses = Vec::new();
    while pos.epoch <= config.epochs {
        let epoch = pos.epoch;
        start_epoch(opt.as_mut(), epoch)?;
        let lr = opt.current_lr();
        let started = Instant::now();
        let mut batches = train_sampler.batches(u64::from(epoch), config.batch_size)?;
        if let Some(l) = config.limit_batches {
            batches.truncate(l);
        }
        // Batch `bi` is `order[bi * batch_size..]`: the concatenated batches, uploaded once on a GPU.
        let order: Vec<usize> = batches.iter().flatten().copied().collect();
        train_batches.set_order(&order, &device)?;
        let nb = batches.len();
        let total: u64 = batches.iter().map(|b| (b.len() * ws) as u64).sum();
        let mode = if lead {
            config.progress
        } else {
            ProgressMode::Hidden
        };
        let mut progress = EpochProgress::new(epoch, total, mode);
        let mut shown_loss = f64::NAN;
        // Reading the batch loss waits for the GPU: only for a visible progress bar, every 10th batch.
        let read_every = match (device.is_cuda(), progress.is_visible()) {
            (false, _) => 1,
            (true, true) => 10,
            (true, false) => usize::MAX,
        };
        let trained_from = pos.batch;
        for (bi, indices) in batches.iter().enumerate().skip(pos.batch) {
            let rows = indices.len();
            let mut prof = match profiler.as_mut() {
                Some(p) if steps_run >= PROFILE_WARMUP_STEPS => p.begin()?,
                _ => None,
            };
            let first = bi * config.batch_size;
            let (images, labels) =
                train_batches.load(train_data, &order, first..first + rows, &device)?;
            mark(&mut prof, Phase::Data)?;
            let micro = bi % config.grad_accum;
            let step_start = bi - micro;
            let micro_count = config.grad_accum.min(nb - step_start);
            let last_micro = micro + 1 == micro_count;
            model.sharded_mut().set_grad_sync(last_micro);
            let images = images.to_device(&device)?;
            model.forward(Mode::Train, |net, ctx| net.forward(ctx, images, labels))?;
            let stats = model.module().loss_stats()?;
            elementwise::axpy(rows as f32, stats, &mut loss_acc)?;
            if !device.is_cuda() {
                step_losses.push(stats.to_vec()?[nll_stat::MEAN_LOSS]);
            }
            if read_every != usize::MAX && ((bi + 1) % read_every == 0 || bi + 1 == nb) {
                shown_loss = f64::from(stats.to_vec()?[nll_stat::MEAN_LOSS]);
            }
            mark(&mut prof, Phase::Forward)?;
            let grad_scale = 1.0 / (ws * micro_count) as f32;
            model.backward(|net, ctx| net.backward(ctx, labels, grad_scale))?;
            mark(&mut prof, Phase::Backward)?;
            pos.samples += (rows * ws) as u64;
            progress.advance((rows * ws) as u64, shown_loss);
            if !last_micro {
                finish_profiled_step(&mut profiler, prof, &mut profile, lead && config.print)?;
                steps_run += 1;
                continue;
            }
            step_model(opt.as_mut(), &mut model)?;
            mark(&mut prof, Phase::Optimizer)?;
            finish_profiled_step(&mut profiler, prof, &mut profile, lead && config.print)?;
            steps_run += 1;
            pos.step += 1;
            pos.batch = bi + 1;
            let stop = config.stop_after_steps == Some(pos.step);
            let periodic = config
                .save_every_steps
                .is_some_and(|k| k > 0 && pos.step % k == 0);
            if let (Some(dir), true) = (&config.save, stop || periodic) {
                pos.loss_sum = loss_acc.to_vec()?[0];
                save(dir, &mut model, opt.as_ref(), pos, config, data_id, None)?;
            }
            if stop {
                progress.finish();
                let params = model.gathered_params()?;
                let memory = opt.memory(model.sharded())?;
                return Ok(RankOutcome {
                    records,
                    memory,
                    params,
                    steps: pos.step,
                    stopped: true,
                    optimizer: opt.describe(),
                    profile,
                    step_losses,
                });
            }
        }
        progress.finish();
        // Training loss: per-digit mean over the epoch and all ranks.
        let mut sums = [loss_acc.to_vec()?[0], 0.0, 0.0];
        comm.all_reduce_host_f32(&mut sums[..1], ReduceOp::Sum)?;
        let train_loss = if pos.samples > 0 {
            f64::from(sums[0]) / pos.samples as f64
        } else {
            f64::NAN
        };
        let trained_samples: u64 = batches[trained_from.min(nb)..]
            .iter()
            .map(|b| (b.len() * ws) as u64)
            .sum();
        let train_secs = started.elapsed().as_secs_f64();
        let (test_loss_sum, correct, count) = evaluate(
            &mut model,
            comm.as_ref(),
            test_data,
            config.test_batch_size,
            &mut test_batches,
            &test_order,
        )?;
        let seconds = started.elapsed().as_secs_f64();
        let test_loss = test_loss_sum / count.max(1) as f64;
        let mut record = MetricsRecord::new(
            epoch,
            train_loss,
            test_loss,
            correct,
            count,
            seconds,
            trained_samples as f64 / train_secs.max(1e-9),
        );
        record.lr = Some(lr);
        record
            .extra
            .insert("precision".into(), format!("{:?}", config.precision).into());
        record.extra.insert("world_size".into(), (ws as u64).into());
        record.extra.insert(
            "device".into(),
            (if device.is_cuda() { "cuda" } else { "cpu" }).into(),
        );
        record
            .extra
            .insert("train_seconds".into(), train_secs.into());
        if lead && config.print {
            println!("Train Epoch: {epoch} \tLoss: {train_loss:.6}");
            println!(
                "Test set: Average loss: {test_loss:.4}, Accuracy: {correct}/{count} ({:.2}%)\n",
                record.test_accuracy
            );
        }
        if !resumed_changes.is_empty() {
            record
                .extra
                .insert("resumed_changes".into(), resumed_changes.join("; ").into());
            resumed_changes.clear();
        }
        pos = Position {
            epoch: epoch + 1,
            batch: 0,
            step: pos.step,
            loss_sum: 0.0,
            samples: 0,
        };
        loss_acc.fill_zero()?;
        // The checkpoint of the epoch first, then its metrics line: a crash between the two leaves a
        // checkpoint whose resume writes the line again (after cutting the file back), never twice.
        if let Some(dir) = &config.save {
            save(
                dir,
                &mut model,
                opt.as_ref(),
                pos,
                config,
                data_id,
                Some(&record),
            )?;
        }
        if let Some(w) = writer.as_mut() {
            w.write(&record)?;
        }
        records.push(record);
    }
    if let Some(path) = &config.export {
        export_full(&mut model, opt.as_ref(), path, config.export_dtype)?;
    }
    let params = model.gathered_params()?;
    let memory = opt.memory(model.sharded())?;
    Ok(RankOutcome {
        records,
        memory,
        params,
        steps: pos.step,
        stopped: false,
        optimizer: opt.describe(),
        profile,
        step_losses,
    })
}
