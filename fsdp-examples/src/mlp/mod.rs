//! The MLP-stack benchmark model of `mlp_bench`: the model of the PyTorch peer script
//! (`peer_fsdp.py`): `blocks` blocks of `x + Linear(4d -> d)(GELU(Linear(d -> 4d)(x)))` without biases,
//! exact (erf) GELU as `nn.GELU()`, an input of `tokens` rows, loss = mean of squares of the output,
//! AdamW, one FSDP unit per block.
//!
//! Two modes ([`BenchMode`]):
//! - `bf16`: parameters sharded in F32 (they are the F32 master), gathered and converted to BF16 once per
//!   gather, BF16 GEMMs with f32 accumulation, F32 gradients and F32 AdamW states (what PyTorch FSDP2 with
//!   BF16 mixed precision does);
//! - `fp8`: E4M3 weight shards gathered in FP8 (one byte per element on the wire), [`Fp8Linear`] for both
//!   linears (E4M3 activations and weights, E5M2 output gradients, delayed scaling of activations and
//!   gradients), the backward keeps only the FP8 transposed inputs the weight-gradient GEMM consumes plus
//!   the BF16 pre-activation for GELU (or recomputes the block: [`MlpConfig::recompute`]), gradient
//!   reduction exact (F32) or FP8, weights re-quantized by current scaling after the optimizer step.
//!
//! Buffers are allocated once and reused every step ([`MlpBench::new`] sizes them); the per-step work on
//! CUDA is kernel launches and collectives only, with the next unit's gather prefetched on the
//! communication stream while the current unit computes.

mod adamw;
pub mod profile;

use crate::mlp::adamw::LocalAdamW;
use crate::mlp::profile::{Phase, Profiler};
use fp8_kernels::ops::{add, axpy, gelu_backward, gelu_forward, scale, GeluApprox};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{
    convert, Buffer, CpuParallelism, Device, DeviceScalar, FloatLinear, Fp8Linear, Fp8LinearConfig,
    Fp8LinearSaved, KernelError,
};
use fsdp_comm::Communicator;
use fsdp_optim::{AdamOptions, FsdpAdamW, OptimError, StatePrecision};
use fsdp_shard::{
    FsdpConfig, GatheredParam, GradDtype, GradReduction, MemoryReport, ModelLayout, ParamKind,
    ParamSpec, ShardError, ShardedModel, WrapPolicy,
};
use half::bf16;
use std::sync::Arc;

/// Errors of the benchmark model.
#[derive(Debug, thiserror::Error)]
pub enum MlpError {
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// Sharding or a collective failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A bad configuration.
    #[error("{0}")]
    Config(String),
}

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

/// Which optimizer runs the AdamW step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptimizerChoice {
    /// `fsdp_optim::FsdpAdamW` (low-precision states for FP8 weights in `fp8` mode).
    FsdpOptim,
    /// The bench's own AdamW with F32 states over the F32 masters (fused `adam_step_f32`, device-resident).
    LocalF32,
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
    /// FSDP2 mixed precision does): BF16 halves the gradient bytes (2 instead of 4 per parameter).
    pub grad_dtype: GradDtype,
    /// `fp8` mode: keep only each block's input and recompute the block in the backward pass.
    pub recompute: bool,
    /// `fp8` mode: GELU fused with the FP8 casts around it ([`fp8_kernels::fused`]): one pass over the
    /// `[T, 4d]` activations in each direction instead of two; trains bit-identically to the unfused path.
    pub fused: bool,
    /// `fp8` mode without `recompute`: do not keep the down linear's FP8 input (`gelu(u)^T`, `[4d, T]`
    /// E4M3) per block; the backward recasts it from the kept `u` with the same scale (the metas change
    /// only at the step end), so the codes and the training are bit-identical, for one GELU + cast pass
    /// per block instead of `T * 4d` bytes per block.
    pub recompute_gelu: bool,
    /// The optimizer.
    pub optimizer: OptimizerChoice,
    /// Learning rate.
    pub lr: f64,
    /// Seed of the initial weights and the input.
    pub seed: u64,
}

impl MlpConfig {
    /// Parameters of the model: `blocks * 8 d^2`.
    pub fn params(&self) -> usize {
        self.blocks * 8 * self.d * self.d
    }
}

/// Deterministic pseudo-random values, roughly uniform in `[-1, 1)` (SplitMix64).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    SplitMix64::new(seed).uniform_vec(n)
}

/// One block's per-step buffers (allocated once).
struct BlockBuffers {
    /// Pre-activation `u = h W_up^T` `[T, 4d]` (kept for the GELU backward unless recomputing).
    u: Buffer<bf16>,
    /// FP8 mode without recompute: what the two linears keep for their backward (allocated once,
    /// rewritten by every forward).
    saved: Option<(Fp8LinearSaved, Fp8LinearSaved)>,
    /// The two FP8 linear ops (their delayed-scaling metas), `fp8` mode.
    linears: Option<(Fp8Linear, Fp8Linear)>,
}

/// Buffers shared by all blocks (one block computes at a time).
struct Shared {
    /// GELU output `[T, 4d]` (then the pre-activation's gradient); empty with `fused` in `fp8` mode.
    a: Buffer<bf16>,
    da: Buffer<bf16>,
    /// `[T, d]`: the branch output in the forward, the gradient of the branch input in the backward
    /// (never both live at once).
    branch: Buffer<bf16>,
    /// One weight gradient in F32 (`4 d^2`: up `[4d, d]` and down `[d, 4d]` have the same size); each is
    /// added to the unit's flat gradient before the next is computed.
    dw: Buffer<f32>,
    /// `fp8` mode with BF16 gradient shards: the weight gradient comes out of the GEMM in BF16 (what
    /// the shard rounds it to anyway; half the buffer and half the add's traffic) and `dw` is empty.
    dw16: Option<Buffer<bf16>>,
    /// Pre-activation of the block being recomputed (`fp8` mode with recompute).
    u_recompute: Option<Buffer<bf16>>,
    /// FP8 mode with recompute: the one saved pair (the recomputed block's).
    saved_recompute: Option<(Fp8LinearSaved, Fp8LinearSaved)>,
    /// FP8 mode with `recompute_gelu`: the down linear's saved input, shared by all blocks (written by
    /// each forward, rewritten from `u` by each backward).
    saved_gelu: Option<Fp8LinearSaved>,
    /// FP8 scratch of the linears (E4M3/E5M2 codes and their transposes), `[T, d]` and `[T, 4d]`:
    /// allocated once so no linear allocates per call.
    q_d: Buffer<u8>,
    qt_d: Buffer<u8>,
    q_4d: Buffer<u8>,
    qt_4d: Buffer<u8>,
    /// BF16 copies of the gathered weights, `bf16` mode.
    w_up16: Option<Buffer<bf16>>,
    w_down16: Option<Buffer<bf16>>,
}

/// The benchmark model on one rank: sharded parameters, optimizer, activations.
pub struct MlpBench {
    config: MlpConfig,
    model: ShardedModel,
    optimizer: Optimizer,
    /// The residual stream (`[T, d]` BF16): `h[0]` is the input. When the backward reads block inputs
    /// (`bf16` mode, recompute) `h[i + 1]` is the output of block `i`; otherwise (`fp8` mode keeps what its
    /// backward reads in FP8) only the input and two rotating buffers exist (see [`MlpBench::h_slot`]).
    h: Vec<Buffer<bf16>>,
    /// Gradient of the residual stream flowing back (`[T, d]`).
    dh: Buffer<bf16>,
    blocks: Vec<BlockBuffers>,
    shared: Shared,
    float_up: FloatLinear,
    float_down: FloatLinear,
    step: u64,
    profiler: Option<Profiler>,
}

enum Optimizer {
    Fsdp(Box<FsdpAdamW>),
    Local(Box<LocalAdamW>),
}

impl MlpBench {
    /// Builds the sharded model, the optimizer and every buffer on `comm`'s device.
    pub fn new(config: MlpConfig, comm: Arc<dyn Communicator>) -> Result<Self, MlpError> {
        let (d, t) = (config.d, config.tokens);
        if d == 0 || config.blocks == 0 || t == 0 {
            return Err(MlpError::Config(
                "d, blocks and tokens must be positive".into(),
            ));
        }
        let device = comm.device().clone();
        if let Device::Cuda(c) = &device {
            // Keep freed pool memory cached between steps instead of unmapping it at every sync.
            c.set_pool_release_threshold(u64::MAX)?;
        }
        let kind = match config.mode {
            BenchMode::Bf16 => ParamKind::Plain,
            BenchMode::Fp8 => ParamKind::Fp8Weight,
        };
        let mut specs = Vec::with_capacity(2 * config.blocks);
        for b in 0..config.blocks {
            let m = format!("b{b}");
            specs.push(ParamSpec::new(&m, "up", &[4 * d, d], kind));
            specs.push(ParamSpec::new(&m, "down", &[d, 4 * d], kind));
        }
        let layout = Arc::new(ModelLayout::new(specs, &WrapPolicy::PerModule)?);
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
        };
        // PyTorch's Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        let seed = config.seed;
        let init = move |p: usize| -> Vec<f32> {
            let (n, fan_in) = if p % 2 == 0 {
                (4 * d * d, d)
            } else {
                (4 * d * d, 4 * d)
            };
            let bound = 1.0 / (fan_in as f32).sqrt();
            values(seed.wrapping_mul(1000).wrapping_add(p as u64), n)
                .into_iter()
                .map(|v| v * bound)
                .collect()
        };
        let (model, masters) = ShardedModel::new(layout, comm.clone(), fsdp, &init)?;
        let options = AdamOptions {
            lr: config.lr,
            state_precision: match config.mode {
                BenchMode::Bf16 => StatePrecision::F32,
                BenchMode::Fp8 => StatePrecision::LowPrecision,
            },
            ..AdamOptions::adamw()
        };
        let optimizer = match config.optimizer {
            OptimizerChoice::FsdpOptim => {
                Optimizer::Fsdp(Box::new(FsdpAdamW::new(&model, masters, options)?))
            }
            OptimizerChoice::LocalF32 => Optimizer::Local(Box::new(LocalAdamW::new(
                &model,
                masters,
                config.lr,
                config.mode == BenchMode::Fp8,
            )?)),
        };
        let x: Vec<bf16> = values(seed ^ 0xABCD, t * d)
            .into_iter()
            .map(|v| bf16::from_f32(v * 1.7))
            .collect();
        let mut h = vec![device.upload(&x)?];
        for _ in 1..Self::h_buffers(&config) {
            h.push(device.zeros::<bf16>(t * d)?);
        }
        let par = CpuParallelism::default();
        let mut blocks = Vec::with_capacity(config.blocks);
        for _ in 0..config.blocks {
            let linears = match config.mode {
                BenchMode::Fp8 => {
                    let cfg = Fp8LinearConfig::default();
                    Some((
                        Fp8Linear::new(&device, d, 4 * d, cfg)?,
                        Fp8Linear::new(&device, 4 * d, d, cfg)?,
                    ))
                }
                BenchMode::Bf16 => None,
            };
            let recompute = config.recompute && config.mode == BenchMode::Fp8;
            let saved = if config.mode == BenchMode::Fp8 && !recompute {
                // With recompute_gelu the down linear's saved input lives in `Shared::saved_gelu`.
                let down_tokens = if config.recompute_gelu { 0 } else { t };
                Some((
                    Fp8LinearSaved::zeros(&device, t, d)?,
                    Fp8LinearSaved::zeros(&device, down_tokens, 4 * d)?,
                ))
            } else {
                None
            };
            blocks.push(BlockBuffers {
                // With recompute the shared pre-activation buffer is used instead.
                u: device.zeros::<bf16>(if recompute { 0 } else { t * 4 * d })?,
                saved,
                linears,
            });
        }
        let bf16_mode = config.mode == BenchMode::Bf16;
        let bf16_grads = !bf16_mode && config.grad_dtype == GradDtype::Bf16;
        let fp8_len = |n: usize| if bf16_mode { 0 } else { n };
        let shared = Shared {
            saved_recompute: if config.recompute && !bf16_mode {
                Some((
                    Fp8LinearSaved::zeros(&device, t, d)?,
                    Fp8LinearSaved::zeros(&device, t, 4 * d)?,
                ))
            } else {
                None
            },
            saved_gelu: if config.recompute_gelu && !config.recompute && !bf16_mode {
                Some(Fp8LinearSaved::zeros(&device, t, 4 * d)?)
            } else {
                None
            },
            q_d: device.zeros(fp8_len(t * d))?,
            qt_d: device.zeros(fp8_len(t * d))?,
            q_4d: device.zeros(fp8_len(t * 4 * d))?,
            qt_4d: device.zeros(fp8_len(t * 4 * d))?,
            // The fused fp8 path never materialises the GELU output or its gradient.
            a: device.zeros(if config.fused && !bf16_mode {
                0
            } else {
                t * 4 * d
            })?,
            da: device.zeros(t * 4 * d)?,
            branch: device.zeros(t * d)?,
            dw: device.zeros(if bf16_grads { 0 } else { 4 * d * d })?,
            dw16: if bf16_grads {
                Some(device.zeros(4 * d * d)?)
            } else {
                None
            },
            u_recompute: if config.recompute && !bf16_mode {
                Some(device.zeros(t * 4 * d)?)
            } else {
                None
            },
            w_up16: if bf16_mode {
                Some(device.zeros(4 * d * d)?)
            } else {
                None
            },
            w_down16: if bf16_mode {
                Some(device.zeros(4 * d * d)?)
            } else {
                None
            },
        };
        Ok(MlpBench {
            float_up: FloatLinear::new(d, 4 * d, par)?,
            float_down: FloatLinear::new(4 * d, d, par)?,
            dh: device.zeros(t * d)?,
            config,
            model,
            optimizer,
            h,
            blocks,
            shared,
            step: 0,
            profiler: None,
        })
    }

    /// Turns per-phase timing on (see [`profile`]); totals accumulate over the following steps.
    pub fn enable_profile(&mut self) {
        self.profiler = Some(Profiler::new(self.device().clone()));
    }

    /// Mean seconds per step of each phase since [`MlpBench::enable_profile`] (empty when off).
    pub fn profile(&self) -> Vec<(Phase, f64)> {
        self.profiler
            .as_ref()
            .map(Profiler::mean_per_step)
            .unwrap_or_default()
    }

    /// The configuration.
    pub fn config(&self) -> &MlpConfig {
        &self.config
    }

    /// The sharded model.
    pub fn model(&self) -> &ShardedModel {
        &self.model
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Which optimizer runs.
    pub fn optimizer_name(&self) -> &'static str {
        match &self.optimizer {
            Optimizer::Fsdp(_) => match self.config.mode {
                BenchMode::Bf16 => "fsdp-optim AdamW (f32 states)",
                BenchMode::Fp8 => "fsdp-optim AdamW (f16 master, e4m3 m, f16 v)",
            },
            Optimizer::Local(_) => "local AdamW (f32 master, f32 m, f32 v)",
        }
    }

    /// Bytes held by this rank by category, optimizer states included.
    pub fn memory(&self) -> Result<MemoryReport, MlpError> {
        let mut r = self.model.memory()?;
        r.optimizer_states = match &self.optimizer {
            Optimizer::Fsdp(o) => o.memory(&self.model)?.optimizer_states,
            Optimizer::Local(o) => o.state_bytes(),
        };
        Ok(r)
    }

    /// Bytes of activations and step buffers held by the bench (not model state).
    pub fn activation_bytes(&self) -> usize {
        let s = &self.shared;
        self.h.iter().map(Buffer::num_bytes).sum::<usize>()
            + self.dh.num_bytes()
            + self
                .blocks
                .iter()
                .map(|b| {
                    b.u.num_bytes()
                        + b.saved
                            .as_ref()
                            .map_or(0, |(x, y)| x.num_bytes() + y.num_bytes())
                })
                .sum::<usize>()
            + s.a.num_bytes()
            + s.da.num_bytes()
            + s.branch.num_bytes()
            + s.dw.num_bytes()
            + s.dw16.as_ref().map_or(0, Buffer::num_bytes)
            + s.u_recompute.as_ref().map_or(0, Buffer::num_bytes)
            + s.saved_recompute
                .as_ref()
                .map_or(0, |(x, y)| x.num_bytes() + y.num_bytes())
            + s.saved_gelu.as_ref().map_or(0, Fp8LinearSaved::num_bytes)
            + s.q_d.num_bytes()
            + s.qt_d.num_bytes()
            + s.q_4d.num_bytes()
            + s.qt_4d.num_bytes()
            + s.w_up16.as_ref().map_or(0, Buffer::num_bytes)
            + s.w_down16.as_ref().map_or(0, Buffer::num_bytes)
    }

    /// Residual-stream buffers: all `blocks + 1` when the backward reads block inputs (`bf16` mode and
    /// recompute), else the input and two rotating buffers.
    fn h_buffers(config: &MlpConfig) -> usize {
        let keep_all = config.mode == BenchMode::Bf16 || config.recompute;
        if keep_all {
            config.blocks + 1
        } else {
            (config.blocks + 1).min(3)
        }
    }

    /// Which buffer of `h` holds the residual stream after `i` blocks (`i = 0`: the input).
    fn h_slot(&self, i: usize) -> usize {
        if self.h.len() == self.config.blocks + 1 || i == 0 {
            i
        } else {
            1 + (i - 1) % 2
        }
    }

    /// The output `h_L` of the last forward, `[T, d]` (a host round trip).
    pub fn output(&self) -> Result<Vec<bf16>, MlpError> {
        Ok(self.h[self.h_slot(self.config.blocks)].to_vec()?)
    }

    /// The loss `mean(h_L^2)` of the last forward (reads the output: a host round trip).
    pub fn loss(&self) -> Result<f64, MlpError> {
        let out = self.h[self.h_slot(self.config.blocks)].to_vec()?;
        let s: f64 = out.iter().map(|v| (v.to_f32() as f64).powi(2)).sum();
        Ok(s / out.len() as f64)
    }

    /// One training step: forward, backward with per-unit gradient reduction, AdamW, FP8 re-quantization.
    /// Nothing is read back to the host (on CUDA the step is only queued when this returns), unless
    /// profiling is on, which synchronises at the end of the step to read its timing events.
    pub fn step(&mut self) -> Result<(), MlpError> {
        let n = self.config.blocks;
        // Forward, prefetching unit b + 1 while block b computes.
        self.gather(0)?;
        for b in 0..n {
            self.wait_gather(b)?;
            if b + 1 < n {
                self.gather(b + 1)?;
            }
            self.block_forward(b, true)?;
            self.model.release_after_forward(b)?;
        }
        // dL/dh_L = 2 h_L / (T d).
        let (t, d) = (self.config.tokens, self.config.d);
        let m = profile::start(&self.profiler, false)?;
        self.dh.copy_from(&self.h[self.h_slot(n)])?;
        scale(&mut self.dh, 2.0 / (t * d) as f32)?;
        profile::stop(&mut self.profiler, Phase::Residual, m)?;
        // Backward in reverse, prefetching the previous unit.
        self.gather(n - 1)?;
        for b in (0..n).rev() {
            self.wait_gather(b)?;
            if b > 0 {
                self.gather(b - 1)?;
            }
            if self.recomputing() {
                // Only what the backward reads: u, and the down linear's saved input; the down GEMM
                // and the residual add (their output h[b + 1] is kept) are skipped.
                self.block_forward(b, false)?;
            }
            self.block_backward(b)?;
            let m = profile::start(&self.profiler, false)?;
            self.model.release(b)?;
            self.model.reduce_grads(b)?;
            profile::stop(&mut self.profiler, Phase::Reduction, m)?;
        }
        let m = profile::start(&self.profiler, false)?;
        match &mut self.optimizer {
            Optimizer::Fsdp(o) => {
                o.step(&mut self.model)?;
            }
            Optimizer::Local(o) => o.step(&mut self.model)?,
        }
        for blk in &mut self.blocks {
            if let Some((up, down)) = &mut blk.linears {
                up.update_scales()?;
                down.update_scales()?;
            }
        }
        profile::stop(&mut self.profiler, Phase::Optimizer, m)?;
        if let Some(p) = &mut self.profiler {
            p.end_step()?;
        }
        self.step += 1;
        Ok(())
    }

    fn gather(&mut self, unit: usize) -> Result<(), MlpError> {
        let m = profile::start(&self.profiler, true)?;
        self.model.gather_async(unit)?;
        profile::stop(&mut self.profiler, Phase::Gather, m)
    }

    fn wait_gather(&mut self, unit: usize) -> Result<(), MlpError> {
        let m = profile::start(&self.profiler, false)?;
        self.model.wait_gather(unit)?;
        profile::stop(&mut self.profiler, Phase::GatherWait, m)
    }

    fn recomputing(&self) -> bool {
        self.config.recompute && self.config.mode == BenchMode::Fp8
    }

    /// Block `b`'s forward: `h[b + 1] = h[b] + down(gelu(up(h[b])))`, keeping what the backward needs
    /// (`u` and the FP8 saved inputs: the block's own buffers, or the shared ones when recomputing).
    /// Without `full` (fp8 recompute in the backward) it stops after the down linear's input cast.
    fn block_forward(&mut self, b: usize, full: bool) -> Result<(), MlpError> {
        let (up_name, down_name) = (format!("b{b}.up"), format!("b{b}.down"));
        let fused = self.config.fused;
        // Block input and output: distinct buffers (h_slot never maps i and i + 1 to the same one).
        let (xi, yi) = (self.h_slot(b), self.h_slot(b + 1));
        let (x, y) = if xi < yi {
            let (lo, hi) = self.h.split_at_mut(yi);
            (&lo[xi], &mut hi[0])
        } else {
            let (lo, hi) = self.h.split_at_mut(xi);
            (&hi[0], &mut lo[yi])
        };
        let s = &mut self.shared;
        let blk = &mut self.blocks[b];
        let prof = &mut self.profiler;
        // With recompute, the pre-activation goes to the one shared buffer (read by the backward next).
        let u: &mut Buffer<bf16> = if blk.u.is_empty() {
            s.u_recompute
                .as_mut()
                .ok_or_else(|| MlpError::Config("recompute buffer missing".into()))?
        } else {
            &mut blk.u
        };
        match self.config.mode {
            BenchMode::Bf16 => {
                let (w_up16, w_down16) = match (&mut s.w_up16, &mut s.w_down16) {
                    (Some(a), Some(b)) => (a, b),
                    _ => return Err(MlpError::Config("bf16 weight buffers missing".into())),
                };
                let m = profile::start(prof, false)?;
                convert(self.model.plain(&up_name)?, w_up16)?;
                convert(self.model.plain(&down_name)?, w_down16)?;
                profile::stop(prof, Phase::WeightConvert, m)?;
                let m = profile::start(prof, false)?;
                self.float_up.forward::<bf16, bf16>(x, w_up16, None, u)?;
                profile::stop(prof, Phase::ForwardGemm, m)?;
                let m = profile::start(prof, false)?;
                gelu_forward(u, &mut s.a, GeluApprox::Erf)?;
                profile::stop(prof, Phase::Gelu, m)?;
                let m = profile::start(prof, false)?;
                self.float_down
                    .forward::<bf16, bf16>(&s.a, w_down16, None, &mut s.branch)?;
                profile::stop(prof, Phase::ForwardGemm, m)?;
            }
            BenchMode::Fp8 => {
                let (up, down) = blk
                    .linears
                    .as_mut()
                    .ok_or_else(|| MlpError::Config("fp8 linears missing".into()))?;
                let (saved_up, saved_down) = match (&mut blk.saved, &mut s.saved_recompute) {
                    (Some(p), _) | (None, Some(p)) => (&mut p.0, &mut p.1),
                    (None, None) => {
                        return Err(MlpError::Config(format!("block {b}: no saved buffers")))
                    }
                };
                let saved_down = match s.saved_gelu.as_mut() {
                    Some(g) => g,
                    None => saved_down,
                };
                let (wu, su) = fp8_param(&self.model, &up_name)?;
                let (wd, sd) = fp8_param(&self.model, &down_name)?;
                let m = profile::start(prof, false)?;
                up.quantize_input(x, &mut s.q_d, saved_up)?;
                profile::stop(prof, Phase::ForwardCast, m)?;
                let m = profile::start(prof, false)?;
                up.forward_quantized::<bf16>(
                    &s.q_d,
                    saved_up,
                    wu,
                    Some(DeviceScalar {
                        buffer: su,
                        index: 1,
                    }),
                    None,
                    u,
                )?;
                profile::stop(prof, Phase::ForwardGemm, m)?;
                if fused {
                    // GELU output never materialised: its E4M3 codes and transpose come out directly.
                    let m = profile::start(prof, false)?;
                    down.quantize_input_gelu(u, GeluApprox::Erf, &mut s.q_4d, saved_down)?;
                    profile::stop(prof, Phase::GeluCastFused, m)?;
                } else {
                    let m = profile::start(prof, false)?;
                    gelu_forward(u, &mut s.a, GeluApprox::Erf)?;
                    profile::stop(prof, Phase::Gelu, m)?;
                    let m = profile::start(prof, false)?;
                    down.quantize_input(&s.a, &mut s.q_4d, saved_down)?;
                    profile::stop(prof, Phase::ForwardCast, m)?;
                }
                if !full {
                    return Ok(());
                }
                let m = profile::start(prof, false)?;
                down.forward_quantized::<bf16>(
                    &s.q_4d,
                    saved_down,
                    wd,
                    Some(DeviceScalar {
                        buffer: sd,
                        index: 1,
                    }),
                    None,
                    &mut s.branch,
                )?;
                profile::stop(prof, Phase::ForwardGemm, m)?;
            }
        }
        let m = profile::start(prof, false)?;
        add(x, &s.branch, y)?;
        profile::stop(prof, Phase::Residual, m)?;
        Ok(())
    }

    /// Block `b`'s backward: consumes `dh` (the gradient of `h[b + 1]`) and leaves the gradient of `h[b]`
    /// in it; adds the weight gradients to the unit's flat gradient.
    ///
    /// Buffers: `da = dh W_down` goes to `shared.da`, `du = gelu'(u) da` to `shared.a` (free by then), the
    /// branch's input gradient to `shared.branch`, then `dh += branch`. The down weight's gradient is
    /// added to the unit before the up weight's is computed into the same buffer.
    fn block_backward(&mut self, b: usize) -> Result<(), MlpError> {
        let (up_name, down_name) = (format!("b{b}.up"), format!("b{b}.down"));
        let fused = self.config.fused;
        // The block input: read by the bf16 backward only (fp8 reads its saved FP8 copy).
        let x = &self.h[self.h_slot(b)];
        let s = &mut self.shared;
        let blk = &mut self.blocks[b];
        let prof = &mut self.profiler;
        let u: &Buffer<bf16> = if blk.u.is_empty() {
            s.u_recompute
                .as_ref()
                .ok_or_else(|| MlpError::Config("recompute buffer missing".into()))?
        } else {
            &blk.u
        };
        match self.config.mode {
            BenchMode::Bf16 => {
                let (w_up16, w_down16) = match (&mut s.w_up16, &mut s.w_down16) {
                    (Some(a), Some(b)) => (a, b),
                    _ => return Err(MlpError::Config("bf16 weight buffers missing".into())),
                };
                // Gathered again for the backward (ZeRO-3): convert again.
                let m = profile::start(prof, false)?;
                convert(self.model.plain(&up_name)?, w_up16)?;
                convert(self.model.plain(&down_name)?, w_down16)?;
                profile::stop(prof, Phase::WeightConvert, m)?;
                // a = gelu(u), recomputed: the shared buffer was reused by later blocks.
                let m = profile::start(prof, false)?;
                gelu_forward(u, &mut s.a, GeluApprox::Erf)?;
                profile::stop(prof, Phase::Gelu, m)?;
                let m = profile::start(prof, false)?;
                self.float_down.backward::<bf16, bf16, f32>(
                    &s.a,
                    &self.dh,
                    w_down16,
                    Some(&mut s.da),
                    &mut s.dw,
                    false,
                    None,
                )?;
                profile::stop(prof, Phase::BackwardGemm, m)?;
                let m = profile::start(prof, false)?;
                self.model.add_grad(&down_name, &s.dw)?;
                profile::stop(prof, Phase::GradAdd, m)?;
                let m = profile::start(prof, false)?;
                gelu_backward(u, &s.da, &mut s.a, GeluApprox::Erf)?;
                profile::stop(prof, Phase::GeluBackward, m)?;
                let m = profile::start(prof, false)?;
                self.float_up.backward::<bf16, bf16, f32>(
                    x,
                    &s.a,
                    w_up16,
                    Some(&mut s.branch),
                    &mut s.dw,
                    false,
                    None,
                )?;
                profile::stop(prof, Phase::BackwardGemm, m)?;
            }
            BenchMode::Fp8 => {
                let (up, down) = blk
                    .linears
                    .as_mut()
                    .ok_or_else(|| MlpError::Config("fp8 linears missing".into()))?;
                if let Some(g) = s.saved_gelu.as_mut() {
                    // The down linear's input codes again, from the kept `u`: the input meta's scale
                    // is the forward's (it changes only at the step end), so the codes are too; the
                    // amax it records again is the same maximum.
                    let m = profile::start(prof, false)?;
                    if fused {
                        down.quantize_input_gelu(u, GeluApprox::Erf, &mut s.q_4d, g)?;
                    } else {
                        gelu_forward(u, &mut s.a, GeluApprox::Erf)?;
                        down.quantize_input(&s.a, &mut s.q_4d, g)?;
                    }
                    profile::stop(prof, Phase::GeluRecast, m)?;
                }
                let (saved_up, saved_down) = match (&blk.saved, &s.saved_recompute) {
                    (Some(p), _) | (None, Some(p)) => (&p.0, &p.1),
                    (None, None) => {
                        return Err(MlpError::Config(format!("block {b}: no saved forward")))
                    }
                };
                let saved_down = match s.saved_gelu.as_ref() {
                    Some(g) => g,
                    None => saved_down,
                };
                let (wd, sd) = fp8_param(&self.model, &down_name)?;
                let m = profile::start(prof, false)?;
                down.quantize_grad_output(&self.dh, &mut s.q_d, &mut s.qt_d)?;
                profile::stop(prof, Phase::BackwardCast, m)?;
                let m = profile::start(prof, false)?;
                fp8_backward(
                    down,
                    saved_down,
                    [&s.q_d, &s.qt_d],
                    (wd, sd),
                    &mut s.da,
                    (&mut s.dw, s.dw16.as_mut()),
                )?;
                profile::stop(prof, Phase::BackwardGemm, m)?;
                let m = profile::start(prof, false)?;
                add_weight_grad(&mut self.model, &down_name, &s.dw, s.dw16.as_ref())?;
                profile::stop(prof, Phase::GradAdd, m)?;
                if fused {
                    let m = profile::start(prof, false)?;
                    up.quantize_grad_output_gelu(
                        u,
                        &s.da,
                        GeluApprox::Erf,
                        &mut s.q_4d,
                        &mut s.qt_4d,
                    )?;
                    profile::stop(prof, Phase::GeluBackwardCastFused, m)?;
                } else {
                    let m = profile::start(prof, false)?;
                    gelu_backward(u, &s.da, &mut s.a, GeluApprox::Erf)?;
                    profile::stop(prof, Phase::GeluBackward, m)?;
                    let m = profile::start(prof, false)?;
                    up.quantize_grad_output(&s.a, &mut s.q_4d, &mut s.qt_4d)?;
                    profile::stop(prof, Phase::BackwardCast, m)?;
                }
                // Fetched after the down gradient's add (which borrows the model mutably).
                let (wu, su) = fp8_param(&self.model, &up_name)?;
                let m = profile::start(prof, false)?;
                fp8_backward(
                    up,
                    saved_up,
                    [&s.q_4d, &s.qt_4d],
                    (wu, su),
                    &mut s.branch,
                    (&mut s.dw, s.dw16.as_mut()),
                )?;
                profile::stop(prof, Phase::BackwardGemm, m)?;
            }
        }
        let m = profile::start(prof, false)?;
        axpy(1.0, &s.branch, &mut self.dh)?;
        profile::stop(prof, Phase::Residual, m)?;
        let m = profile::start(prof, false)?;
        add_weight_grad(&mut self.model, &up_name, &s.dw, s.dw16.as_ref())?;
        profile::stop(prof, Phase::GradAdd, m)?;
        Ok(())
    }
}

/// An FP8 linear's backward from its quantized output gradient `[dy_q, dy_t]` and gathered weight
/// `(codes, [scale, scale_inv])`: `dx`, and the weight gradient into the BF16 buffer when there is one
/// (BF16 gradient shards), else the F32 one.
fn fp8_backward(
    linear: &Fp8Linear,
    saved: &Fp8LinearSaved,
    [dy_q, dy_t]: [&Buffer<u8>; 2],
    (weight, scales): (&Buffer<u8>, &Buffer<f32>),
    dx: &mut Buffer<bf16>,
    (dw, dw16): (&mut Buffer<f32>, Option<&mut Buffer<bf16>>),
) -> Result<(), MlpError> {
    let scale_inv = Some(DeviceScalar {
        buffer: scales,
        index: 1,
    });
    match dw16 {
        Some(dw16) => linear.backward_quantized::<bf16, bf16>(
            saved,
            dy_q,
            dy_t,
            weight,
            scale_inv,
            None,
            Some(dx),
            dw16,
            false,
        )?,
        None => linear.backward_quantized::<bf16, f32>(
            saved,
            dy_q,
            dy_t,
            weight,
            scale_inv,
            None,
            Some(dx),
            dw,
            false,
        )?,
    }
    Ok(())
}

/// Adds the weight gradient of [`fp8_backward`] (or the bf16 mode's F32 one) to parameter `name`.
fn add_weight_grad(
    model: &mut ShardedModel,
    name: &str,
    dw: &Buffer<f32>,
    dw16: Option<&Buffer<bf16>>,
) -> Result<(), MlpError> {
    match dw16 {
        Some(g) => model.add_grad_bf16(name, g)?,
        None => model.add_grad(name, dw)?,
    }
    Ok(())
}

/// The gathered FP8 weight `name`: codes and `[scale, scale_inv]`.
fn fp8_param<'a>(
    model: &'a ShardedModel,
    name: &str,
) -> Result<(&'a Buffer<u8>, &'a Buffer<f32>), MlpError> {
    match model.param(model.index(name)?)? {
        GatheredParam::Fp8 { codes, scales } => Ok((codes, scales)),
        GatheredParam::Plain(_) => Err(MlpError::Config(format!("{name} is not an FP8 weight"))),
    }
}
