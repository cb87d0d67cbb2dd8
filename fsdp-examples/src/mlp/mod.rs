//! The MLP-stack benchmark model of `mlp_bench`, the model of the PyTorch peer script (`peer_fsdp.py`):
//! `blocks` blocks of `x + Linear(4d -> d)(GELU(Linear(d -> 4d)(x)))` without biases (exact erf GELU as
//! `nn.GELU()`), an input of `tokens` rows in BF16, loss = mean of squares of the output, AdamW, one FSDP
//! unit per block.
//!
//! The model is `fsdp_nn::MlpBlock`s; sharding, gathers, prefetch, reduction and the scale agreement are
//! `fsdp_shard::FsdpModel`'s and the optimizer's. Two modes ([`BenchMode`]): `bf16` (BF16 GEMMs over F32
//! parameters converted per gather, F32 AdamW states: what PyTorch FSDP2 with BF16 mixed precision does)
//! and `fp8` (FP8 linears with GELU fused into the casts, weights gathered in E4M3, low-precision AdamW
//! states, BF16 gradient shards by default).

use fp8_core::Fp8Recipe;
use fp8_kernels::elementwise::scale;
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, Device};
use fsdp_comm::Communicator;
use fsdp_nn::{Layer, LinearPrecision, Mlp, MlpBlock, Recompute, Shape, Tensor};
use fsdp_optim::{step_model, AdamOptions, FsdpAdamW, Optimizer, StatePrecision};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GradDtype, GradReduction, MemoryReport, Mode, Module, ShardError,
    Visitor, WrapPolicy,
};
use fsdp_train::profile::{mark, Phase, ProfiledStep};
use half::bf16;
use std::sync::Arc;

/// Errors of the benchmark model.
pub type MlpError = crate::ModelError;

/// Compute precision of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BenchMode {
    /// BF16 GEMMs, F32 master weights and F32 AdamW states.
    Bf16,
    /// FP8 linears, FP8 weight shards and all-gather.
    Fp8,
}

impl BenchMode {
    /// `"bf16"` or `"fp8"`.
    pub fn name(self) -> &'static str {
        match self {
            BenchMode::Bf16 => "bf16",
            BenchMode::Fp8 => "fp8",
        }
    }
}

/// The benchmark's sizes and options.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpConfig {
    /// Model width `d` (hidden width `4 d`).
    pub d: usize,
    /// Number of blocks (= FSDP units).
    pub blocks: usize,
    /// Rows of the input.
    pub tokens: usize,
    /// Compute mode.
    pub mode: BenchMode,
    /// Gradient reduction of FP8 weights (`fp8` mode; `bf16` mode always reduces in F32).
    pub grad_reduction: GradReduction,
    /// Storage of the reduced gradient shards in `fp8` mode (`bf16` mode keeps F32 shards, as PyTorch's
    /// FSDP2 mixed precision does).
    pub grad_dtype: GradDtype,
    /// Keep only each block's input and recompute the block in the backward (`fsdp_nn::Recompute`).
    pub recompute: bool,
    /// `fp8` mode: GELU fused with the FP8 casts around it (bit-identical to unfused).
    pub fused: bool,
    /// `fp8` mode: recast the down linear's input from the kept pre-activation in the backward instead
    /// of keeping it per block (bit-identical).
    pub recompute_gelu: bool,
    /// Learning rate.
    pub lr: f64,
    /// Seed of the initial weights and the input.
    pub seed: u64,
    /// `fp8` mode: the FP8 recipe of every linear (per tensor by default; `Fp8Recipe::block_scaled` for
    /// DeepSeek-V3's block scaling).
    pub recipe: Fp8Recipe,
}

impl MlpConfig {
    /// The defaults of the benchmark at width `d`: FP8 with fused GELU casts and the GELU recast, BF16
    /// gradient shards, exact gradient reduction (its best configuration).
    pub fn fp8(d: usize, blocks: usize, tokens: usize) -> Self {
        MlpConfig {
            d,
            blocks,
            tokens,
            mode: BenchMode::Fp8,
            grad_reduction: GradReduction::F32,
            grad_dtype: GradDtype::Bf16,
            recompute: false,
            fused: true,
            recompute_gelu: true,
            recipe: Fp8Recipe::default(),
            lr: 1e-4,
            seed: 0,
        }
    }

    /// Parameters of the model: `blocks * 8 d^2`, or an error when that overflows.
    pub fn params(&self) -> Result<usize, MlpError> {
        self.blocks
            .checked_mul(8)
            .and_then(|v| v.checked_mul(self.d))
            .and_then(|v| v.checked_mul(self.d))
            .ok_or_else(|| {
                MlpError::Config(format!(
                    "{} blocks of width {} overflow the parameter count",
                    self.blocks, self.d
                ))
            })
    }

    fn validate(&self) -> Result<(), MlpError> {
        if self.d == 0 || self.blocks == 0 || self.tokens == 0 {
            return Err(MlpError::Config(
                "d, blocks and tokens must be positive".into(),
            ));
        }
        self.params()?;
        self.tokens
            .checked_mul(4 * self.d)
            .ok_or_else(|| MlpError::Config("tokens x 4d overflows".into()))?;
        Ok(())
    }
}

/// Deterministic pseudo-random values, roughly uniform in `[-1, 1)` (SplitMix64).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    SplitMix64::new(seed).uniform_vec(n)
}

/// The stack: blocks `h.0`, `h.1`, ... (one FSDP unit each).
pub struct MlpStack {
    h: Vec<Box<dyn Layer<bf16>>>,
}

impl Module for MlpStack {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("h", &mut self.h)
    }
}

impl MlpStack {
    /// The blocks of `config`.
    pub fn new(config: &MlpConfig) -> Result<Self, MlpError> {
        let precision = match config.mode {
            BenchMode::Bf16 => LinearPrecision::Bf16,
            BenchMode::Fp8 => LinearPrecision::Fp8,
        };
        let mut h: Vec<Box<dyn Layer<bf16>>> = Vec::with_capacity(config.blocks);
        for b in 0..config.blocks {
            let mlp = Mlp::<bf16>::new(config.d, 4 * config.d)?
                .with_precision(precision)?
                .with_seed(fsdp_nn::init::stream_seed(config.seed, b as u64))
                .fused(config.fused)
                .recompute_gelu(config.recompute_gelu);
            let block = MlpBlock::new(mlp);
            if config.recompute {
                h.push(Box::new(Recompute::new(block)));
            } else {
                h.push(Box::new(block));
            }
        }
        let mut stack = MlpStack { h };
        if config.mode == BenchMode::Fp8 && !config.recipe.blocks.is_per_tensor() {
            // The model-wide conversion pass sets the recipe of every (already FP8) linear.
            fsdp_nn::convert_to_fp8(&mut stack, &fsdp_nn::Fp8Filter::All, &config.recipe)?;
        }
        Ok(stack)
    }

    fn forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        mut x: Tensor<bf16>,
    ) -> Result<Tensor<bf16>, MlpError> {
        for b in &mut self.h {
            x = b.forward(ctx, x)?;
        }
        Ok(x)
    }

    fn backward(&mut self, ctx: &mut Ctx<'_>, mut dy: Tensor<bf16>) -> Result<(), MlpError> {
        let n = self.h.len();
        for (i, b) in self.h.iter_mut().enumerate().rev() {
            match b.backward_step(ctx, dy, i > 0)? {
                Some(d) => dy = d,
                None if i == 0 => return Ok(()),
                None => return Err(MlpError::Config(format!("block {i} of {n}: no gradient"))),
            }
        }
        Ok(())
    }
}

/// The benchmark model on one rank: the wrapped stack, its optimizer and input.
pub struct MlpBench {
    config: MlpConfig,
    model: FsdpModel<MlpStack>,
    optimizer: FsdpAdamW,
    input: Buffer<bf16>,
    output: Option<Buffer<bf16>>,
}

impl MlpBench {
    /// Builds the sharded model and the optimizer on `comm`'s device.
    pub fn new(config: MlpConfig, comm: Arc<dyn Communicator>) -> Result<Self, MlpError> {
        config.validate()?;
        let (d, t) = (config.d, config.tokens);
        let device = comm.device().clone();
        if let Device::Cuda(c) = &device {
            // Keep freed pool memory cached between steps instead of unmapping it at every sync.
            c.set_pool_release_threshold(u64::MAX)?;
        }
        let fsdp = FsdpConfig {
            reshard_after_forward: true,
            grad_reduction: match config.mode {
                BenchMode::Bf16 => GradReduction::F32,
                BenchMode::Fp8 => config.grad_reduction,
            },
            weight_margin: 0,
            grad_dtype: match config.mode {
                BenchMode::Bf16 => GradDtype::F32,
                BenchMode::Fp8 => config.grad_dtype,
            },
            ..FsdpConfig::default()
        };
        let stack = MlpStack::new(&config)?;
        let mut model = FsdpModel::new(stack, comm, WrapPolicy::ChildrenOf("h".into()), fsdp)?;
        let options = AdamOptions {
            lr: config.lr,
            state_precision: match config.mode {
                BenchMode::Bf16 => StatePrecision::F32,
                BenchMode::Fp8 => StatePrecision::LowPrecision,
            },
            ..AdamOptions::adamw()
        };
        let optimizer = FsdpAdamW::for_model(&mut model, options)?;
        let x: Vec<bf16> = values(config.seed ^ 0xABCD, t * d)
            .into_iter()
            .map(|v| bf16::from_f32(v * 1.7))
            .collect();
        Ok(MlpBench {
            input: device.upload(&x)?,
            config,
            model,
            optimizer,
            output: None,
        })
    }

    /// The input, `[tokens, d]` row-major (a host copy).
    pub fn input(&self) -> Result<Vec<bf16>, MlpError> {
        Ok(self.input.to_vec()?)
    }

    /// Replaces the input (`[tokens, d]` row-major): e.g. a different input per rank, as data
    /// parallelism feeds them (the default input is the same on every rank).
    pub fn set_input(&mut self, x: &[bf16]) -> Result<(), MlpError> {
        let n = self.config.tokens * self.config.d;
        if x.len() != n {
            return Err(MlpError::Config(format!(
                "an input of {} values; the bench takes tokens x d = {n}",
                x.len()
            )));
        }
        self.input = self.device().upload(x)?;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &MlpConfig {
        &self.config
    }

    /// The wrapped model.
    pub fn model(&self) -> &FsdpModel<MlpStack> {
        &self.model
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Which optimizer runs.
    pub fn optimizer_name(&self) -> String {
        self.optimizer.describe()
    }

    /// Bytes held by this rank by category, optimizer states included.
    pub fn memory(&self) -> Result<MemoryReport, MlpError> {
        Ok(Optimizer::memory(&self.optimizer, self.model.sharded())?)
    }

    /// One training step: forward, backward with per-unit gradient reduction, AdamW with the FP8 scale
    /// agreement and re-quantization. Nothing is read back to the host (on CUDA the step is only queued
    /// when this returns).
    pub fn step(&mut self) -> Result<(), MlpError> {
        self.step_profiled(&mut None)
    }

    /// [`MlpBench::step`], marking the forward, backward (with the loss gradient and the reductions) and
    /// optimizer phases of `prof` (the Trainer's step profiler; a no-op with `None`).
    pub fn step_profiled(&mut self, prof: &mut Option<ProfiledStep>) -> Result<(), MlpError> {
        let (t, d) = (self.config.tokens, self.config.d);
        let dev = self.device().clone();
        let shape = Shape::matrix(t, d)?;
        self.output = None;
        let x = Tensor::new(self.input.to_device(&dev)?, shape)?;
        let h = self
            .model
            .forward(Mode::Train, |stack, ctx| stack.forward(ctx, x))?;
        mark(prof, Phase::Forward)?;
        // dL/dh_L = 2 h_L / (T d).
        let mut dh = Tensor::new(h.data().to_device(&dev)?, shape)?;
        scale(dh.data_mut(), 2.0 / (t * d) as f32)?;
        self.output = Some(h.into_data());
        self.model.backward(|stack, ctx| stack.backward(ctx, dh))?;
        mark(prof, Phase::Backward)?;
        step_model(&mut self.optimizer, &mut self.model)?;
        mark(prof, Phase::Optimizer)?;
        Ok(())
    }

    /// The output `h_L` of the last forward, `[T, d]` (a host round trip).
    pub fn output(&self) -> Result<Vec<bf16>, MlpError> {
        let out = self
            .output
            .as_ref()
            .ok_or_else(|| MlpError::Config("no step has run".into()))?;
        Ok(out.to_vec()?)
    }

    /// The loss `mean(h_L^2)` of the last forward (reads the output: a host round trip).
    pub fn loss(&self) -> Result<f64, MlpError> {
        let out = self.output()?;
        let s: f64 = out.iter().map(|v| (v.to_f32() as f64).powi(2)).sum();
        Ok(s / out.len().max(1) as f64)
    }

    /// Every FP8 scale of the model (weights' and activations'), for checking that ranks agree.
    pub fn fp8_scales(&self) -> Result<Vec<f32>, MlpError> {
        let mut out: Vec<f32> = self
            .model
            .sharded()
            .weight_scales()?
            .into_iter()
            .map(|(_, s, _)| s)
            .collect();
        let reg = self.model.scaling();
        for i in 0..reg.len() {
            let id = reg.id(i)?;
            out.push(reg.get(id)?.scale().to_vec()?[0]);
        }
        Ok(out)
    }
}
