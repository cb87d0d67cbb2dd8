//! [`LmTask`]: a language model's data, loss, validation and sampling for the Trainer.

use super::{LanguageModel, LmFamily, LmSpec, ShapeOverrides};
use crate::data::tokens::{
    Gpt2Bpe, TokenFileU32, TrainWindowSampler, ValidationWindows, GPT2_VOCAB_SIZE,
};
use crate::gpt::{GptError, Sampling, GPT2_PADDED_VOCAB};
use crate::hf::LlamaHfConfig;
use fp8_kernels::rng::SplitMix64;
use fsdp_nn::TokenBatch;
use fsdp_optim::{AdamOptions, FsdpAdamW, LrSchedule, Optimizer, StatePrecision, WarmupCosine};
use fsdp_shard::{FsdpModel, Mode, WrapPolicy};
use fsdp_train::{
    evaluate_sums, BatchIndex, Evaluation, LossKind, LossValue, MemoryEstimate, MemoryPlan,
    OptimizerChoice, RankEnv, RunSetting, SchedulePlan, TrainError, TrainTask,
};
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::path::PathBuf;

/// The prompt `--sample` continues.
pub const SAMPLE_PROMPT: &str = "ROMEO:\nBut soft, what light";

/// The checkpoint key of the training sampler's position.
const SAMPLER_KEY: &str = "data.sampler_position";

/// What an LM run is beyond the Trainer's configuration: the model's shape and the data.
#[derive(Debug, Clone, PartialEq)]
pub struct LmOptions {
    /// One of the presets.
    pub preset: String,
    /// Overrides of the preset's width, blocks and heads (small models for tests).
    pub d_model: Option<usize>,
    /// See `d_model`.
    pub layers: Option<usize>,
    /// See `d_model`.
    pub heads: Option<usize>,
    /// Override of a Llama preset's key/value heads.
    pub kv_heads: Option<usize>,
    /// Override of a Llama preset's SwiGLU width.
    pub ffn: Option<usize>,
    /// The Hugging Face config of the checkpoint `--init-from` names: the model takes its shape,
    /// vocabulary and RoPE from it instead of a preset's.
    pub hf_config: Option<LlamaHfConfig>,
    /// Sequence length (rows of the position table).
    pub seq_len: usize,
    /// Windows per rank and micro-batch.
    pub batch_size: usize,
    /// Directory holding `train.bin` and `val.bin`.
    pub data_dir: PathBuf,
    /// Renumber the data's ids densely and size the vocabulary to them (a CPU smoke option: the head's
    /// cost is proportional to the vocabulary). Exports are then not the peer's shapes.
    pub compact_vocab: bool,
    /// Evaluate at most this many validation batches (all by default, as the peer).
    pub max_val_batches: Option<usize>,
    /// Generate this many tokens from [`SAMPLE_PROMPT`] after training.
    pub sample: Option<usize>,
    /// Seed of the training windows (the Trainer's `--seed`).
    pub seed: u64,
    /// Recompute each block in the backward instead of keeping its activations.
    pub recompute_blocks: bool,
    /// The first this many blocks recompute their MLP's up output in the backward.
    pub recompute_mlp_up: usize,
}

impl LmOptions {
    /// The `preset` at sequences of `seq_len`, batch 8 per rank, on the data in `data_dir`, seed 1.
    pub fn new(preset: &str, seq_len: usize, data_dir: PathBuf) -> Self {
        LmOptions {
            preset: preset.to_string(),
            d_model: None,
            layers: None,
            heads: None,
            kv_heads: None,
            ffn: None,
            hf_config: None,
            seq_len,
            batch_size: 8,
            data_dir,
            compact_vocab: false,
            max_val_batches: None,
            sample: None,
            seed: 1,
            recompute_blocks: false,
            recompute_mlp_up: 0,
        }
    }
}

/// The token data, shared by the thread ranks.
#[derive(Debug)]
struct Tokens {
    train: Vec<u32>,
    val: Vec<u32>,
    /// Dense id -> the data's id with `compact_vocab`.
    dense_to_gpt2: Option<Vec<u32>>,
    vocab: usize,
    id: String,
}

impl Tokens {
    /// Reads `train.bin` and `val.bin` (either token format), every id below `vocab_bound`; `vocab` is
    /// the model's vocabulary when the ids are not renumbered.
    fn load(o: &LmOptions, vocab_bound: u32, vocab: usize) -> Result<Self, TrainError> {
        let open = |name: &str| {
            TokenFileU32::open(o.data_dir.join(name), vocab_bound)
                .map_err(|e| TrainError::Config(format!("--data {}: {e}", o.data_dir.display())))
        };
        let (train, val) = (open("train.bin")?, open("val.bin")?);
        let mut h = crc32fast::Hasher::new();
        h.update(bytemuck::cast_slice(train.tokens()));
        h.update(bytemuck::cast_slice(val.tokens()));
        let id = format!("{}+{}:{:08x}", train.len(), val.len(), h.finalize());
        let (mut train, mut val) = (train.tokens().to_vec(), val.tokens().to_vec());
        if !o.compact_vocab {
            return Ok(Tokens {
                train,
                val,
                dense_to_gpt2: None,
                vocab,
                id,
            });
        }
        let mut distinct: Vec<u32> = train.iter().chain(&val).copied().collect();
        distinct.sort_unstable();
        distinct.dedup();
        for t in train.iter_mut().chain(val.iter_mut()) {
            // Every id is in `distinct` by construction.
            *t = distinct.binary_search(t).unwrap_or(0) as u32;
        }
        let vocab = distinct.len().div_ceil(64) * 64;
        Ok(Tokens {
            train,
            val,
            dense_to_gpt2: Some(distinct),
            vocab,
            id,
        })
    }
}

/// A rank's data: the training stream's sampler and the validation windows.
pub struct LmData {
    /// `None` for a task without data (the speed mode's).
    sampler: Option<TrainWindowSampler>,
    inputs: Vec<i32>,
    targets: Vec<i32>,
    val: Option<ValidationWindows>,
}

fn no_data() -> TrainError {
    TrainError::Config("this LM task was made without data (for --speed): it cannot train".into())
}

/// The peer's AdamW: betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every matrix (embeddings
/// included), none on the norm weights, no clipping.
pub fn peer_adamw_options(lr: f64, states: StatePrecision) -> AdamOptions {
    AdamOptions {
        lr,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
        state_precision: states,
        ..AdamOptions::adamw()
    }
}

/// The peer's schedule for `steps` steps: warm-up `lr (it + 1) / w` with `w = max(1, steps / 20)`, then
/// a cosine to `lr / 10` at `steps`.
pub fn peer_schedule(steps: u64) -> Result<WarmupCosine, TrainError> {
    Ok(WarmupCosine::new((steps / 20).max(1), steps.max(1), 0.1)?)
}

/// A language model `M` on a token stream (see the module documentation).
pub struct LmTask<M: LanguageModel> {
    options: LmOptions,
    spec: LmSpec,
    /// Llama's Hugging Face export and import format.
    hf_format: Option<crate::hf::HfLlamaFormat>,
    tokens: Tokens,
    world_size: usize,
    model: PhantomData<fn() -> M>,
}

impl<M: LanguageModel> std::fmt::Debug for LmTask<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LmTask")
            .field("options", &self.options)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

fn model_err(e: GptError) -> TrainError {
    TrainError::task(e)
}

impl<M: LanguageModel> LmTask<M> {
    /// Checks the shape and sizes (naming the flags) and loads the data, for a run of `world_size` ranks.
    pub fn new(options: LmOptions, world_size: usize) -> Result<Self, TrainError> {
        let mut spec = Self::spec_of(&options)?;
        Self::check_sizes(&options, world_size)?;
        if let Some(n) = options.sample {
            if n.saturating_add(1) > options.seq_len {
                return Err(TrainError::Config(format!(
                    "--sample {n}: the prompt and {n} new tokens must fit --seq-len {}",
                    options.seq_len
                )));
            }
        }
        if options.max_val_batches == Some(0) {
            return Err(TrainError::Config(
                "--max-val-batches must be at least 1 (0 would silently do nothing)".into(),
            ));
        }
        // GPT-2 ids unless the model's vocabulary came from a checkpoint's config.
        let (bound, vocab) = match &spec.hf_config {
            Some(hf) => (
                u32::try_from(hf.vocab_size).unwrap_or(u32::MAX),
                hf.vocab_size,
            ),
            None => (GPT2_VOCAB_SIZE, GPT2_PADDED_VOCAB),
        };
        if options.hf_config.is_some() && options.compact_vocab {
            return Err(TrainError::Config(
                "--compact-vocab renumbers the ids, but the model from --init-from has its own \
                 vocabulary"
                    .into(),
            ));
        }
        if options.hf_config.is_some() && options.sample.is_some() {
            return Err(TrainError::Config(
                "--sample decodes with GPT-2's tokenizer; a model from a Hugging Face checkpoint has \
                 its own (decode its ids with that tokenizer instead)"
                    .into(),
            ));
        }
        let tokens = Tokens::load(&options, bound, vocab)?;
        spec.vocab = tokens.vocab;
        if tokens.train.len() < spec.seq_len.saturating_add(2)
            || tokens.val.len() < spec.seq_len.saturating_add(1)
        {
            return Err(TrainError::Config(format!(
                "--seq-len {} is longer than the data allows ({} training and {} validation tokens)",
                spec.seq_len,
                tokens.train.len(),
                tokens.val.len()
            )));
        }
        Ok(LmTask {
            options,
            hf_format: spec.hf_format().map_err(model_err)?,
            spec,
            tokens,
            world_size,
            model: PhantomData,
        })
    }

    /// A task without data, for the speed mode (random token batches; the peer's vocabulary of the
    /// family: GPT-2's padded one, Llama 3's): nothing is read from disk.
    pub fn for_speed(options: LmOptions, world_size: usize) -> Result<Self, TrainError> {
        let mut spec = Self::spec_of(&options)?;
        Self::check_sizes(&options, world_size)?;
        if spec.hf_config.is_none() {
            spec.vocab = spec.family.speed_vocab();
        }
        Ok(LmTask {
            options,
            hf_format: spec.hf_format().map_err(model_err)?,
            tokens: Tokens {
                train: Vec::new(),
                val: Vec::new(),
                dense_to_gpt2: None,
                vocab: spec.vocab,
                id: "none".into(),
            },
            spec,
            world_size,
            model: PhantomData,
        })
    }

    /// The model's shape from the preset and the shape flags, with the run's recomputation and seed.
    fn spec_of(options: &LmOptions) -> Result<LmSpec, TrainError> {
        let config = |e: crate::ModelError| TrainError::Config(e.to_string());
        let mut spec = match &options.hf_config {
            Some(hf) => {
                if options.d_model.is_some()
                    || options.layers.is_some()
                    || options.heads.is_some()
                    || options.kv_heads.is_some()
                    || options.ffn.is_some()
                {
                    return Err(TrainError::Config(
                        "the shape comes from the --init-from checkpoint's config.json: drop \
                         --d-model, --layers, --heads, --kv-heads and --ffn"
                            .into(),
                    ));
                }
                LmSpec::from_hf(hf.clone(), options.seq_len).map_err(config)?
            }
            None => LmSpec::with_overrides(
                &options.preset,
                ShapeOverrides {
                    d_model: options.d_model,
                    layers: options.layers,
                    heads: options.heads,
                    kv_heads: options.kv_heads,
                    ffn: options.ffn,
                },
                options.seq_len,
            )
            .map_err(config)?,
        };
        if spec.family != M::FAMILY {
            return Err(TrainError::Config(format!(
                "--preset {} is a {:?} model; this task builds {:?} models",
                spec.preset,
                spec.family,
                M::FAMILY
            )));
        }
        spec.recompute_blocks = options.recompute_blocks;
        if options.recompute_mlp_up > spec.layers {
            return Err(TrainError::Config(format!(
                "--recompute-mlp-up {} exceeds the model's {} blocks",
                options.recompute_mlp_up, spec.layers
            )));
        }
        spec.recompute_mlp_up = options.recompute_mlp_up;
        spec.seed = options.seed;
        Ok(spec)
    }

    /// Every size the run allocates from these flags must be representable.
    fn check_sizes(options: &LmOptions, world_size: usize) -> Result<(), TrainError> {
        if options.batch_size == 0 {
            return Err(TrainError::Config(
                "--batch-size must be at least 1 (0 would silently do nothing)".into(),
            ));
        }
        options
            .batch_size
            .checked_mul(options.seq_len)
            .and_then(|v| v.checked_mul(world_size.max(1)))
            .and_then(|v| v.checked_mul(std::mem::size_of::<i32>()))
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "--batch-size {} x --seq-len {} x --world-size {world_size} overflows this \
                     machine's sizes",
                    options.batch_size, options.seq_len
                ))
            })?;
        Ok(())
    }

    /// The model's shape.
    pub fn spec(&self) -> &LmSpec {
        &self.spec
    }

    /// Parameters of the model (the tied matrix once).
    pub fn num_params(&self) -> usize {
        self.spec.num_params()
    }

    fn tokens_per_rank_batch(&self) -> usize {
        self.options.batch_size * self.spec.seq_len
    }

    fn sample(&self, model: &mut FsdpModel<M>, n: usize) -> Result<String, TrainError> {
        let bpe = Gpt2Bpe::new().map_err(TrainError::task)?;
        let mut prompt: Vec<i32> = bpe
            .encode_ordinary(SAMPLE_PROMPT)
            .map_err(TrainError::task)?
            .iter()
            .map(|&t| i32::from(t))
            .collect();
        if let Some(map) = &self.tokens.dense_to_gpt2 {
            // Prompt ids the data lacks map to the nearest known id (a smoke option only).
            prompt = prompt
                .iter()
                .map(|&t| match map.binary_search(&(t as u32)) {
                    Ok(i) | Err(i) => i.min(map.len() - 1) as i32,
                })
                .collect();
        }
        let room = self.spec.seq_len.saturating_sub(n).max(1);
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
        let new = model
            .forward(Mode::Eval, |m, ctx| m.generate(ctx, &prompt, &sampling))
            .map_err(model_err)?;
        model.release_all()?;
        let to_gpt2 = |ids: &[i32]| -> Vec<u16> {
            ids.iter()
                .map(|&t| match &self.tokens.dense_to_gpt2 {
                    Some(map) => map.get(t as usize).copied().unwrap_or(0) as u16,
                    None => (t.max(0) as u32).min(GPT2_VOCAB_SIZE - 1) as u16,
                })
                .collect()
        };
        let mut all = to_gpt2(&prompt);
        all.extend(to_gpt2(&new));
        bpe.decode_lossy(&all).map_err(TrainError::task)
    }
}

impl<M: LanguageModel> TrainTask for LmTask<M> {
    type Model = M;
    type Data = LmData;
    type Batch = TokenBatch;
    type Error = TrainError;

    fn name(&self) -> &str {
        "lm_fsdp"
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    fn identity(&self) -> Vec<RunSetting> {
        let s = &self.spec;
        let mut settings = vec![
            RunSetting::new("preset", "--preset", &s.preset),
            RunSetting::new("d_model", "--d-model", s.d_model),
            RunSetting::new("layers", "--layers", s.layers),
            RunSetting::new("heads", "--heads", s.heads),
            RunSetting::new("seq_len", "--seq-len", s.seq_len),
            RunSetting::new("batch_size", "--batch-size", self.options.batch_size),
            RunSetting::new(
                "compact_vocab",
                "--compact-vocab",
                self.options.compact_vocab,
            ),
            RunSetting::new("data", "--data", &self.tokens.id),
        ];
        if s.family == LmFamily::Llama3 {
            // GPT-2 checkpoints predate these keys and keep resuming without them.
            settings.push(RunSetting::new("kv_heads", "--kv-heads", s.kv_heads));
            settings.push(RunSetting::new("ffn", "--ffn", s.ffn));
            settings.push(RunSetting::new("vocab", "--init-from", s.vocab));
        }
        settings
    }

    fn build_model(&self, _env: &RankEnv) -> Result<M, TrainError> {
        M::build(&self.spec).map_err(model_err)
    }

    fn wrap_policy(&self) -> WrapPolicy {
        M::wrap_policy()
    }

    fn optimizer(
        &self,
        model: &mut FsdpModel<M>,
        choice: &OptimizerChoice,
    ) -> Result<Box<dyn Optimizer>, TrainError> {
        Ok(Box::new(FsdpAdamW::for_model(
            model,
            peer_adamw_options(choice.lr, choice.states),
        )?))
    }

    fn schedule(&self, plan: &SchedulePlan) -> Result<Option<Box<dyn LrSchedule>>, TrainError> {
        Ok(Some(Box::new(peer_schedule(plan.total_steps)?)))
    }

    /// [`LmSpec::memory_estimate`] of this run's batch.
    fn memory_estimate(&self, plan: &MemoryPlan) -> Result<Option<MemoryEstimate>, TrainError> {
        self.spec
            .memory_estimate(self.options.batch_size, plan)
            .map(Some)
            .map_err(model_err)
    }

    fn data(&self, env: &RankEnv) -> Result<LmData, TrainError> {
        let (b, t, ws) = (self.options.batch_size, self.spec.seq_len, env.world_size);
        if self.tokens.train.is_empty() {
            return Ok(LmData {
                sampler: None,
                inputs: Vec::new(),
                targets: Vec::new(),
                val: None,
            });
        }
        let sampler =
            TrainWindowSampler::new(self.tokens.train.len(), t, b * ws, self.options.seed, 0)
                .map_err(TrainError::task)?;
        let val = ValidationWindows::new(self.tokens.val.len(), t, b).map_err(TrainError::task)?;
        Ok(LmData {
            sampler: Some(sampler),
            inputs: vec![0; b * ws * t],
            targets: vec![0; b * ws * t],
            val: Some(val),
        })
    }

    fn data_state(&self, data: &LmData) -> BTreeMap<String, String> {
        data.sampler
            .iter()
            .map(|s| (SAMPLER_KEY.to_string(), s.position().to_string()))
            .collect()
    }

    fn load_data_state(
        &self,
        data: &mut LmData,
        saved: &BTreeMap<String, String>,
    ) -> Result<(), TrainError> {
        let p = saved
            .get(SAMPLER_KEY)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| TrainError::Checkpoint(format!("no {SAMPLER_KEY} in the checkpoint")))?;
        data.sampler.as_mut().ok_or_else(no_data)?.set_position(p);
        Ok(())
    }

    fn epoch_batches(
        &self,
        _data: &mut LmData,
        _env: &RankEnv,
        _epoch: u32,
    ) -> Result<Option<u64>, TrainError> {
        Ok(None)
    }

    /// The next global batch's windows from the shared stream; this rank's share.
    fn batch(
        &self,
        data: &mut LmData,
        env: &RankEnv,
        _at: BatchIndex,
    ) -> Result<TokenBatch, TrainError> {
        let n = self.tokens_per_rank_batch();
        data.sampler
            .as_mut()
            .ok_or_else(no_data)?
            .fill_next(&self.tokens.train, &mut data.inputs, &mut data.targets)
            .map_err(TrainError::task)?;
        let mine = env.rank * n..(env.rank + 1) * n;
        Ok(TokenBatch::new(
            &env.device,
            &data.inputs[mine.clone()],
            &data.targets[mine],
            self.options.batch_size,
            self.spec.seq_len,
            self.spec.vocab,
        )?)
    }

    fn batch_weight(&self, batch: &TokenBatch) -> u64 {
        batch.tokens() as u64
    }

    fn forward(&self, model: &mut FsdpModel<M>, batch: &TokenBatch) -> Result<(), TrainError> {
        model
            .forward(Mode::Train, |m, ctx| m.forward_train(ctx, batch))
            .map_err(model_err)
    }

    fn loss<'m>(&self, model: &'m FsdpModel<M>) -> Result<LossValue<'m>, TrainError> {
        Ok(LossValue {
            values: &model.module().loss().map_err(model_err)?.sum,
            kind: LossKind::Sum,
        })
    }

    fn backward(&self, model: &mut FsdpModel<M>, batch: &TokenBatch) -> Result<(), TrainError> {
        model
            .backward(|m, ctx| m.backward(ctx, batch))
            .map_err(model_err)
    }

    /// The mean loss over the validation windows: batch `i` on rank `i % world_size`, the sums of
    /// `mean x windows` and the window counts all-reduced (the peer's weighting).
    fn evaluate(
        &self,
        model: &mut FsdpModel<M>,
        data: &mut LmData,
        env: &RankEnv,
    ) -> Result<Evaluation, TrainError> {
        let val = data.val.as_ref().ok_or_else(no_data)?;
        let (b, t) = (val.batch(), val.seq_len());
        let batches = self
            .options
            .max_val_batches
            .map_or(val.batch_count(), |m| m.min(val.batch_count()));
        let (mut x, mut y) = (vec![0i32; b * t], vec![0i32; b * t]);
        let device = env.device.clone();
        let sums = evaluate_sums(
            model,
            (env.rank..batches).step_by(env.world_size),
            |model, i| -> Result<[f32; 2], TrainError> {
                let n = val
                    .fill_batch(&self.tokens.val, i, &mut x, &mut y)
                    .map_err(TrainError::task)?;
                let batch =
                    TokenBatch::new(&device, &x[..n * t], &y[..n * t], n, t, self.spec.vocab)?;
                model
                    .forward(Mode::Eval, |m, ctx| m.forward(ctx, &batch))
                    .map_err(model_err)?;
                let mean = model.module().loss().map_err(model_err)?.mean()?;
                Ok([(mean * n as f64) as f32, n as f32])
            },
        )?;
        Ok(Evaluation {
            loss: f64::from(sums[0]) / f64::from(sums[1]).max(1.0),
            correct: None,
            extra: vec![(
                "val_loss".into(),
                serde_json::json!(f64::from(sums[0]) / f64::from(sums[1]).max(1.0)),
            )],
        })
    }

    fn after_training(
        &self,
        model: &mut FsdpModel<M>,
        _data: &mut LmData,
        _env: &RankEnv,
    ) -> Result<Vec<String>, TrainError> {
        match self.options.sample {
            Some(n) => Ok(vec![format!(
                "--- sample ---\n{}\n--- end of sample ---",
                self.sample(model, n)?
            )]),
            None => Ok(Vec::new()),
        }
    }

    /// Random ids of GPT-2's vocabulary (as the peer's `randint(0, 50257)`), inputs and targets drawn
    /// independently, one stream per rank.
    fn speed_batch(&self, _data: &mut LmData, env: &RankEnv) -> Result<TokenBatch, TrainError> {
        let (b, t) = (self.options.batch_size, self.spec.seq_len);
        let mut rng = SplitMix64::new(
            self.options.seed ^ (env.rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        // The peer's ids: GPT-2's 50257 for the GPT family, the whole vocabulary for Llama.
        let bound = match self.spec.family {
            LmFamily::Gpt2 => u64::from(GPT2_VOCAB_SIZE).min(self.spec.vocab as u64),
            LmFamily::Llama3 => self.spec.vocab as u64,
        };
        let mut ids = |n: usize| -> Vec<i32> { (0..n).map(|_| rng.below(bound) as i32).collect() };
        let (x, y) = (ids(b * t), ids(b * t));
        Ok(TokenBatch::new(&env.device, &x, &y, b, t, self.spec.vocab)?)
    }

    fn flops_per_unit(&self) -> Option<f64> {
        Some(self.spec.flops_per_token())
    }

    fn held_bytes(&self, model: &FsdpModel<M>) -> Option<u64> {
        Some(model.module().held_bytes() as u64)
    }

    fn weights_format(&self) -> Box<dyn fsdp_train::weights::WeightsFormat + '_> {
        match &self.hf_format {
            Some(f) => Box::new(f.clone()),
            None => Box::new(fsdp_train::weights::SafetensorsFormat),
        }
    }

    fn describe(&self) -> Vec<(String, serde_json::Value)> {
        let s = &self.spec;
        vec![
            ("preset".into(), serde_json::json!(s.preset)),
            ("d_model".into(), serde_json::json!(s.d_model)),
            ("layers".into(), serde_json::json!(s.layers)),
            ("heads".into(), serde_json::json!(s.heads)),
            ("kv_heads".into(), serde_json::json!(s.kv_heads)),
            ("ffn".into(), serde_json::json!(s.ffn)),
            ("vocab".into(), serde_json::json!(s.vocab)),
            ("batch".into(), serde_json::json!(self.options.batch_size)),
            ("seq".into(), serde_json::json!(s.seq_len)),
            (
                "recompute".into(),
                serde_json::json!(if s.recompute_blocks {
                    "blocks".to_string()
                } else if s.recompute_mlp_up > 0 {
                    format!("mlp-up x {}", s.recompute_mlp_up)
                } else {
                    "none".to_string()
                }),
            ),
            (
                "world_size_planned".into(),
                serde_json::json!(self.world_size),
            ),
        ]
    }
}
