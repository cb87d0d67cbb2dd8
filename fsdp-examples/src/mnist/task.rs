//! The MNIST run as a [`TrainTask`]: the reference net, its data per rank, its loss and its test.

use super::batches::Batches;
use super::{wrap_policy, MnistError, MnistNet, NetConfig};
use crate::data::{MnistDataset, MnistSplit};
use crate::sampler::{DistributedSampler, Remainder};
use fp8_kernels::softmax::nll_stat;
use fp8_kernels::Buffer;
use fsdp_optim::{AdamOptions, FsdpAdam, LrSchedule, Optimizer, StepLr};
use fsdp_shard::{FsdpModel, Mode, WrapPolicy};
use fsdp_train::{
    evaluate_sums, BatchIndex, Evaluation, LossKind, LossValue, MemoryEstimate, MemoryPlan,
    MetricsRecord, OptimizerChoice, RankEnv, RunSetting, ScheduleClock, SchedulePlan, TrainError,
    TrainTask,
};
use std::path::PathBuf;

/// What the MNIST run is: its data and batches (the rest is the Trainer's configuration).
#[derive(Debug, Clone, PartialEq)]
pub struct MnistOptions {
    /// Directory of the MNIST IDX files.
    pub data_dir: PathBuf,
    /// Training batch per rank (per micro-batch).
    pub batch_size: usize,
    /// Test batch per rank.
    pub test_batch_size: usize,
    /// StepLR factor per epoch.
    pub gamma: f64,
    /// Train at most this many batches per epoch and rank (smoke runs).
    pub limit_batches: Option<usize>,
    /// Seed of the initial parameters, the shuffles and the dropout streams (the Trainer's `--seed`).
    pub seed: u64,
}

impl Default for MnistOptions {
    /// The reference setup: batch 64, test batch 1000, gamma 0.7, seed 1, the default data directory.
    fn default() -> Self {
        MnistOptions {
            data_dir: PathBuf::from(crate::data::DEFAULT_MNIST_DIR),
            batch_size: 64,
            test_batch_size: 1000,
            gamma: 0.7,
            limit_batches: None,
            seed: 1,
        }
    }
}

/// The MNIST task: the datasets, loaded once and shared by the ranks.
#[derive(Debug)]
pub struct MnistTask {
    options: MnistOptions,
    train: MnistDataset,
    test: MnistDataset,
    data_id: String,
}

/// A rank's data: its samplers, the batches of the current epoch, and the device copies.
pub struct MnistData {
    train_sampler: DistributedSampler,
    epoch: Option<u32>,
    batches: Vec<Vec<usize>>,
    order: Vec<usize>,
    train_batches: Batches,
    test_batches: Batches,
    test_order: Vec<usize>,
}

/// One micro-batch: NCHW images and labels on the rank's device.
pub struct MnistBatch {
    images: Buffer<f32>,
    labels: Buffer<i32>,
    /// `1 / (world_size * micro_batches)`: the loss gradient's scale (see `averages_in_loss`).
    grad_scale: f32,
}

impl MnistTask {
    /// Loads the datasets of `options.data_dir`.
    pub fn new(options: MnistOptions) -> Result<Self, MnistError> {
        for (flag, v) in [
            ("--batch-size", options.batch_size),
            ("--test-batch-size", options.test_batch_size),
            ("--limit-batches", options.limit_batches.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(MnistError::Config(format!(
                    "{flag} must be at least 1 (0 would silently do nothing)"
                )));
            }
        }
        if !(options.gamma.is_finite() && options.gamma >= 0.0) {
            return Err(MnistError::Config(format!(
                "--gamma {} must be finite and >= 0",
                options.gamma
            )));
        }
        let train = MnistDataset::load(&options.data_dir, MnistSplit::Train)?;
        let test = MnistDataset::load(&options.data_dir, MnistSplit::Test)?;
        let data_id = data_fingerprint(&train, &test);
        Ok(MnistTask {
            options,
            train,
            test,
            data_id,
        })
    }

    /// The options.
    pub fn options(&self) -> &MnistOptions {
        &self.options
    }

    fn epoch_list(
        &self,
        sampler: &DistributedSampler,
        epoch: u32,
    ) -> Result<Vec<Vec<usize>>, MnistError> {
        let mut batches = sampler.batches(u64::from(epoch), self.options.batch_size)?;
        if let Some(l) = self.options.limit_batches {
            batches.truncate(l);
        }
        Ok(batches)
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

impl TrainTask for MnistTask {
    type Model = MnistNet;
    type Data = MnistData;
    type Batch = MnistBatch;
    type Error = TrainError;

    fn name(&self) -> &str {
        "mnist_fsdp"
    }

    fn identity(&self) -> Vec<RunSetting> {
        let o = &self.options;
        vec![
            RunSetting::new("batch_size", "--batch-size", o.batch_size),
            RunSetting::new(
                "limit_batches",
                "--limit-batches",
                o.limit_batches.map_or("all".to_string(), |l| l.to_string()),
            ),
            RunSetting::new("data", "--data-dir", &self.data_id),
        ]
    }

    fn hyperparameters(&self) -> Vec<RunSetting> {
        vec![
            RunSetting::new("hyper.gamma", "--gamma", self.options.gamma),
            RunSetting::new(
                "hyper.test_batch_size",
                "--test-batch-size",
                self.options.test_batch_size,
            ),
        ]
    }

    fn build_model(&self, env: &RankEnv) -> Result<MnistNet, TrainError> {
        MnistNet::new(NetConfig {
            seed: self.options.seed,
            rank: env.rank,
        })
        .map_err(TrainError::task)
    }

    fn wrap_policy(&self) -> WrapPolicy {
        wrap_policy()
    }

    fn optimizer(
        &self,
        model: &mut FsdpModel<MnistNet>,
        choice: &OptimizerChoice,
    ) -> Result<Box<dyn Optimizer>, TrainError> {
        let options = AdamOptions {
            lr: choice.lr,
            state_precision: choice.states,
            ..AdamOptions::adam()
        };
        Ok(Box::new(FsdpAdam::for_model(model, options)?))
    }

    fn schedule(&self, _plan: &SchedulePlan) -> Result<Option<Box<dyn LrSchedule>>, TrainError> {
        Ok(Some(Box::new(StepLr::new(1, self.options.gamma)?)))
    }

    fn schedule_clock(&self) -> ScheduleClock {
        ScheduleClock::Epoch
    }

    /// A lower bound of one rank's peak: the model state priced by the run's plan, a training batch
    /// (this rank's rows: the batch, or its share of the data when that is smaller) at 256 KiB per image
    /// on CUDA and 2 MiB on the CPU (the activations the backward keeps, F32, and the im2col of the second
    /// convolution; the CPU held about 3 MiB per image, measured at batch 256 and 1024), and an
    /// evaluation batch at 128 KiB (CUDA) or 768 KiB (CPU; measured about 1.1 MiB) per image.
    fn memory_estimate(&self, plan: &MemoryPlan) -> Result<Option<MemoryEstimate>, TrainError> {
        let ws = plan.world_size.max(1);
        let train_rows = self.options.batch_size.min(self.train.len().div_ceil(ws)) as u64;
        let test_rows = self.options.test_batch_size.min(self.test.len()) as u64;
        let (train_per, test_per) = if plan.cuda {
            (256u64 << 10, 128u64 << 10)
        } else {
            (2u64 << 20, 768u64 << 10)
        };
        // fc1 9216 x 128 and fc2 128 x 10 are the linears; the convolutions and biases are plain.
        let (linear, other) = (9216 * 128 + 128 * 10, 320 + 18_496 + 128 + 10);
        // With the optimizer in the backward the gradient shards are transient: fc1's is the largest.
        let state = plan
            .model_state(linear, other)
            .and_then(|s| s.checked_add(plan.transient_grad_shards(9216 * 128 + 128)?))
            .unwrap_or(u64::MAX);
        Ok(Some(
            MemoryEstimate::default()
                .part(format!("model state over {ws} rank(s)"), state)
                .part(
                    format!(
                        "a training batch of {train_rows} images (--batch-size {})",
                        self.options.batch_size
                    ),
                    train_rows.saturating_mul(train_per),
                )
                .part(
                    format!(
                        "an evaluation batch of {test_rows} images (--test-batch-size {})",
                        self.options.test_batch_size
                    ),
                    test_rows.saturating_mul(test_per),
                ),
        ))
    }

    fn data(&self, env: &RankEnv) -> Result<MnistData, TrainError> {
        let (rank, ws) = (env.rank, env.world_size);
        let seed = self.options.seed;
        let wrap = |e: MnistError| TrainError::task(e);
        let train_sampler =
            DistributedSampler::new(self.train.len(), ws, rank, seed, Remainder::Pad)
                .map_err(|e| wrap(e.into()))?;
        let test_sampler = DistributedSampler::new(self.test.len(), ws, rank, seed, Remainder::Pad)
            .map_err(|e| wrap(e.into()))?
            .with_shuffle(false);
        let mut test_order = test_sampler.indices(0);
        test_order.truncate(test_sampler.num_real_samples());
        let mut test_batches = Batches::new(&self.test, &env.device).map_err(wrap)?;
        test_batches
            .set_order(&test_order, &env.device)
            .map_err(wrap)?;
        Ok(MnistData {
            train_sampler,
            epoch: None,
            batches: Vec::new(),
            order: Vec::new(),
            train_batches: Batches::new(&self.train, &env.device).map_err(wrap)?,
            test_batches,
            test_order,
        })
    }

    fn epoch_batches(
        &self,
        data: &mut MnistData,
        _env: &RankEnv,
        epoch: u32,
    ) -> Result<Option<u64>, TrainError> {
        let n = self
            .epoch_list(&data.train_sampler, epoch)
            .map_err(TrainError::task)?
            .len();
        Ok(Some(n as u64))
    }

    fn batch(
        &self,
        data: &mut MnistData,
        env: &RankEnv,
        at: BatchIndex,
    ) -> Result<MnistBatch, TrainError> {
        let wrap = TrainError::task;
        if data.epoch != Some(at.epoch) {
            data.batches = self
                .epoch_list(&data.train_sampler, at.epoch)
                .map_err(wrap)?;
            // Batch `i` is `order[i * batch_size..]`: the concatenated batches, uploaded once on a GPU.
            data.order = data.batches.iter().flatten().copied().collect();
            data.train_batches
                .set_order(&data.order, &env.device)
                .map_err(wrap)?;
            data.epoch = Some(at.epoch);
        }
        let i = usize::try_from(at.index).unwrap_or(usize::MAX);
        let rows = data
            .batches
            .get(i)
            .ok_or_else(|| TrainError::Config(format!("epoch {} has no batch {i}", at.epoch)))?
            .len();
        let first = i * self.options.batch_size;
        let (images, labels) = data
            .train_batches
            .load(&self.train, &data.order, first..first + rows, &env.device)
            .map_err(wrap)?;
        Ok(MnistBatch {
            images: images.to_device(&env.device)?,
            labels: labels.to_device(&env.device)?,
            grad_scale: 1.0 / (env.world_size as u64 * at.step_micro_batches.max(1)) as f32,
        })
    }

    /// The reference's numerics (recorded bit for bit by the golden test) scale the loss gradient.
    fn averages_in_loss(&self) -> bool {
        true
    }

    fn batch_weight(&self, batch: &MnistBatch) -> u64 {
        batch.labels.len() as u64
    }

    fn forward(
        &self,
        model: &mut FsdpModel<MnistNet>,
        batch: &MnistBatch,
    ) -> Result<(), TrainError> {
        let images = batch.images.to_device(model.device())?;
        model
            .forward(Mode::Train, |net, ctx| {
                net.forward(ctx, images, &batch.labels)
            })
            .map_err(TrainError::task)?;
        Ok(())
    }

    fn loss<'m>(&self, model: &'m FsdpModel<MnistNet>) -> Result<LossValue<'m>, TrainError> {
        Ok(LossValue {
            values: model.module().loss_stats().map_err(TrainError::task)?,
            kind: LossKind::Mean,
        })
    }

    fn backward(
        &self,
        model: &mut FsdpModel<MnistNet>,
        batch: &MnistBatch,
    ) -> Result<(), TrainError> {
        model
            .backward(|net, ctx| net.backward(ctx, &batch.labels, batch.grad_scale))
            .map_err(TrainError::task)?;
        Ok(())
    }

    /// Test loss per digit and accuracy over all ranks (each rank evaluates its shard of the test set,
    /// padding excluded, so every digit counts once).
    fn evaluate(
        &self,
        model: &mut FsdpModel<MnistNet>,
        data: &mut MnistData,
        env: &RankEnv,
    ) -> Result<Evaluation, TrainError> {
        let tb = self.options.test_batch_size;
        let chunks = data.test_order.len().div_ceil(tb);
        let device = env.device.clone();
        let sums = evaluate_sums(
            model,
            0..chunks,
            |model, ci| -> Result<[f32; 3], TrainError> {
                let start = ci * tb;
                let end = (start + tb).min(data.test_order.len());
                let (images, labels) = data
                    .test_batches
                    .load(&self.test, &data.test_order, start..end, &device)
                    .map_err(TrainError::task)?;
                let images = images.to_device(&device)?;
                model
                    .forward(Mode::Eval, |net, ctx| net.forward(ctx, images, labels))
                    .map_err(TrainError::task)?;
                let stats = model
                    .module()
                    .loss_stats()
                    .map_err(TrainError::task)?
                    .to_vec()?;
                if stats[nll_stat::INVALID_LABELS] != 0.0 {
                    return Err(TrainError::Config("test labels outside 0..10".into()));
                }
                let n = (end - start) as f32;
                Ok([stats[nll_stat::MEAN_LOSS] * n, stats[nll_stat::CORRECT], n])
            },
        )?;
        let count = sums[2] as u64;
        Ok(Evaluation {
            loss: f64::from(sums[0]) / count.max(1) as f64,
            correct: Some((sums[1] as u64, count)),
            extra: Vec::new(),
        })
    }

    /// The reference's lines.
    fn report_lines(&self, r: &MetricsRecord) -> Vec<String> {
        vec![
            format!("Train Epoch: {} \tLoss: {:.6}", r.epoch, r.train_loss),
            format!(
                "Test set: Average loss: {:.4}, Accuracy: {}/{} ({:.2}%)\n",
                r.test_loss, r.test_correct, r.test_total, r.test_accuracy
            ),
        ]
    }
}
