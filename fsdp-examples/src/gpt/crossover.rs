//! The measured FP8/BF16 crossover of [`super::Fp8Layers::Auto`]: one block linear of the GPT model at a
//! time, in FP8 and in BF16, timed through a training step, and the smallest
//! `k = in * out / (in + out)` ([`super::fp8_auto_ratio`]) from which FP8 was faster at every larger `k`.
//! The `linear_crossover` example (`fsdp-examples/examples/linear_crossover.rs`) runs it on the GPU and
//! prints the table; `docs/gpt.md` says how to read it.
//!
//! # What one measurement is
//! The real [`Linear`] as the model builds it (no bias, `N(0, 0.02^2)` weights, delayed scaling of its
//! FP8 input and output gradient), wrapped alone in a one-rank [`FsdpModel`] (one unit) with the
//! optimizer `lm_fsdp` uses ([`peer_adamw_options`]). One step is: a training forward of `x [tokens,
//! in]`, the backward of `dy [tokens, out]` (`dx` and `dW`), and the optimizer step. The step is in the
//! time on purpose: an FP8 weight is re-quantized there (its amax, the scale agreement, the E4M3 cast of
//! the master) and its optimizer states differ (`--states`), so the cost of choosing FP8 for a linear
//! includes it. The one-rank gather of the weight and reduction of its gradient (what a one-GPU run
//! pays too) are in the forward and backward. The same `x` and `dy` (bf16, fixed seeds) feed both
//! precisions; they are copied into fresh tensors before each step's first timing mark.
//!
//! Two ways to feed the linear ([`Feed`]):
//! - [`Feed::Alone`]: the linear's own forward; an FP8 linear casts its bf16 input to E4M3 itself (as
//!   `attn_proj` does in the model). Every linear is measured so.
//! - [`Feed::AfterNorm`]: the LayerNorm before it and the linear, forward and backward, in both
//!   precisions ([`Norm::forward_linear`]): an FP8 linear's input is written by the norm (the fused
//!   cast, as `c_attn` and `c_fc` run in the model), a BF16 linear gets the norm's bf16 output. Measured
//!   for `c_attn` and `c_fc`. (`mlp_proj`'s input cast is fused into the GELU in the model; measured
//!   alone it carries a cast the model does not pay, so its FP8 time here is an upper bound.)
//!
//! Times: on CUDA, events on the compute stream around each part of the step (forward, backward,
//! optimizer), after warm-up steps, the median over the timed steps of each part and of the whole step;
//! the whole step's median decides. On the CPU host time (the CPU mode only exercises the code: its
//! numbers say nothing about a GPU).

use super::GptError;
use crate::lm::peer_adamw_options;
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, CudaDevice, Device, GpuEvent};
use fsdp_comm::Communicator;
use fsdp_nn::fp8_auto_ratio;
use fsdp_nn::{Layer, Linear, LinearPrecision, NnError, Norm, Shape, Tensor, WeightInit};
use fsdp_optim::{step_model, FsdpAdamW, StatePrecision};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GradDtype, GradReduction, Mode, Module, ShardError, Visitor,
    WrapPolicy,
};
use half::bf16;
use std::sync::Arc;
use std::time::Instant;

/// The token counts of the GPU measurement.
pub const GPU_TOKENS: [usize; 3] = [4096, 8192, 16384];

/// The widths of the GPT presets (gpt2 to gpt-3b).
pub const GPU_WIDTHS: [usize; 5] = [768, 1024, 1280, 1600, 2560];

/// One of a block's four linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockLinear {
    /// `d -> 3d`, after `ln_1`.
    CAttn,
    /// `d -> d`, after the attention.
    AttnProj,
    /// `d -> 4d`, after `ln_2`.
    CFc,
    /// `4d -> d`, after the GELU.
    MlpProj,
}

impl BlockLinear {
    /// The four in block order.
    pub const ALL: [BlockLinear; 4] = [
        BlockLinear::CAttn,
        BlockLinear::AttnProj,
        BlockLinear::CFc,
        BlockLinear::MlpProj,
    ];

    /// The parameter name in the model.
    pub fn name(self) -> &'static str {
        match self {
            BlockLinear::CAttn => "c_attn",
            BlockLinear::AttnProj => "attn_proj",
            BlockLinear::CFc => "c_fc",
            BlockLinear::MlpProj => "mlp_proj",
        }
    }

    /// `(in, out)` at width `d`.
    pub fn features(self, d: usize) -> (usize, usize) {
        match self {
            BlockLinear::CAttn => (d, 3 * d),
            BlockLinear::AttnProj => (d, d),
            BlockLinear::CFc => (d, 4 * d),
            BlockLinear::MlpProj => (4 * d, d),
        }
    }

    /// Whether a LayerNorm writes its input in the model (so an FP8 input cast is fused there).
    pub fn after_norm(self) -> bool {
        matches!(self, BlockLinear::CAttn | BlockLinear::CFc)
    }
}

/// How the measured linear gets its input (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feed {
    /// The linear alone: an FP8 linear casts its input itself.
    Alone,
    /// LayerNorm + linear: an FP8 linear's input is written by the norm.
    AfterNorm,
}

impl Feed {
    /// `"alone"` or `"after_norm"`.
    pub fn name(self) -> &'static str {
        match self {
            Feed::Alone => "alone",
            Feed::AfterNorm => "after_norm",
        }
    }
}

/// One linear to measure at every token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearCase {
    /// Model width.
    pub d: usize,
    /// Which linear.
    pub linear: BlockLinear,
    /// How it is fed.
    pub feed: Feed,
    /// Input features.
    pub inf: usize,
    /// Output features.
    pub outf: usize,
    /// [`fp8_auto_ratio`] of `inf -> outf`.
    pub k: usize,
}

/// Every case of `widths`: the four linears alone, and `c_attn` and `c_fc` after their norm.
pub fn crossover_cases(widths: &[usize]) -> Vec<LinearCase> {
    let mut out = Vec::new();
    for &d in widths {
        for linear in BlockLinear::ALL {
            let (inf, outf) = linear.features(d);
            let feeds: &[Feed] = if linear.after_norm() {
                &[Feed::Alone, Feed::AfterNorm]
            } else {
                &[Feed::Alone]
            };
            for &feed in feeds {
                out.push(LinearCase {
                    d,
                    linear,
                    feed,
                    inf,
                    outf,
                    k: fp8_auto_ratio(inf, outf),
                });
            }
        }
    }
    out
}

/// Which cases a crossover is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaseSet {
    /// As the model runs them: `c_attn` and `c_fc` after their norm, `attn_proj` and `mlp_proj` alone.
    AsInModel,
    /// Every linear alone (every FP8 input cast paid by the linear).
    AllAlone,
}

impl CaseSet {
    /// Whether `case` belongs to the set.
    pub fn contains(self, case: &LinearCase) -> bool {
        match self {
            CaseSet::AsInModel => (case.feed == Feed::AfterNorm) == case.linear.after_norm(),
            CaseSet::AllAlone => case.feed == Feed::Alone,
        }
    }

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            CaseSet::AsInModel => "as in the model (c_attn, c_fc after their norm)",
            CaseSet::AllAlone => "every linear alone (input cast included)",
        }
    }
}

/// Median milliseconds of a step's parts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// The training forward.
    pub forward_ms: f64,
    /// The backward (`dx`, `dW`, the one-rank gradient reduction).
    pub backward_ms: f64,
    /// The optimizer step (the FP8 weight's re-quantization included).
    pub optimizer_ms: f64,
    /// The whole step (its own median, not the sum of the parts' medians).
    pub step_ms: f64,
}

/// One row of the table: a case at one token count in both precisions.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossoverRow {
    /// Rows of `x`.
    pub tokens: usize,
    /// The case.
    pub case: LinearCase,
    /// BF16 linear.
    pub bf16: StepTimes,
    /// FP8 linear.
    pub fp8: StepTimes,
}

impl CrossoverRow {
    /// FP8 step time over BF16 step time.
    pub fn ratio(&self) -> f64 {
        self.fp8.step_ms / self.bf16.step_ms
    }
}

/// A point for [`pick_crossover`]: `k` and the two step times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KTiming {
    /// [`fp8_auto_ratio`] of the linear.
    pub k: usize,
    /// BF16 step time (any unit, the same for both).
    pub bf16: f64,
    /// FP8 step time.
    pub fp8: f64,
}

/// Where FP8 starts to pay, read from a table of [`KTiming`]s. FP8 "is faster" when its time is
/// strictly below BF16's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crossover {
    /// FP8 was faster at every measured `k`; `min_k` is the smallest measured (a threshold up to it).
    Fp8AlwaysFaster {
        /// The smallest `k` measured.
        min_k: usize,
    },
    /// FP8 was not faster at the largest `k` measured: no threshold of the measured range pays.
    NoCrossover {
        /// The largest `k` measured.
        max_k: usize,
    },
    /// FP8 was faster at every `k >= k`, and not faster at `slower_at` (the largest `k` where it was not).
    At {
        /// The smallest `k` from which FP8 was faster at every larger measured `k`.
        k: usize,
        /// The largest measured `k` where FP8 was not faster (`< k`).
        slower_at: usize,
    },
}

impl Crossover {
    /// The threshold the measurement suggests (`Auto` runs a linear in FP8 when its `k >= threshold`):
    /// the crossover `k`, the smallest measured `k` when FP8 always won, none when it never did.
    pub fn suggested_threshold(self) -> Option<usize> {
        match self {
            Crossover::Fp8AlwaysFaster { min_k } => Some(min_k),
            Crossover::NoCrossover { .. } => None,
            Crossover::At { k, .. } => Some(k),
        }
    }

    /// In words.
    pub fn describe(self) -> String {
        match self {
            Crossover::Fp8AlwaysFaster { min_k } => {
                format!("FP8 faster at every measured k (smallest k {min_k})")
            }
            Crossover::NoCrossover { max_k } => {
                format!("no crossover: FP8 not faster at the largest measured k ({max_k})")
            }
            Crossover::At { k, slower_at } => {
                format!("FP8 faster at every k >= {k} (not faster at k = {slower_at})")
            }
        }
    }
}

/// The crossover of a table (any order; several rows may share a `k`): the smallest `k` such that FP8
/// was faster in every row of that `k` or larger. Refuses an empty table and times that are not finite
/// and positive.
pub fn pick_crossover(rows: &[KTiming]) -> Result<Crossover, GptError> {
    if rows.is_empty() {
        return Err(GptError::Config(
            "no timings to read a crossover from".into(),
        ));
    }
    if let Some(r) = rows
        .iter()
        .find(|r| !(r.bf16.is_finite() && r.fp8.is_finite() && r.bf16 > 0.0 && r.fp8 > 0.0))
    {
        return Err(GptError::Config(format!(
            "k {}: times {} (BF16) and {} (FP8) must be finite and positive",
            r.k, r.bf16, r.fp8
        )));
    }
    let slower = rows.iter().filter(|r| r.fp8 >= r.bf16).map(|r| r.k).max();
    let min_k = rows.iter().map(|r| r.k).min().unwrap_or(0);
    let max_k = rows.iter().map(|r| r.k).max().unwrap_or(0);
    Ok(match slower {
        None => Crossover::Fp8AlwaysFaster { min_k },
        Some(s) => match rows.iter().map(|r| r.k).filter(|&k| k > s).min() {
            Some(k) => Crossover::At { k, slower_at: s },
            None => Crossover::NoCrossover { max_k },
        },
    })
}

/// The crossover of the rows of `tokens` in `set`.
pub fn crossover_of(
    rows: &[CrossoverRow],
    tokens: usize,
    set: CaseSet,
) -> Result<Crossover, GptError> {
    let points: Vec<KTiming> = rows
        .iter()
        .filter(|r| r.tokens == tokens && set.contains(&r.case))
        .map(|r| KTiming {
            k: r.case.k,
            bf16: r.bf16.step_ms,
            fp8: r.fp8.step_ms,
        })
        .collect();
    pick_crossover(&points)
}

/// One threshold for every token count: the largest suggested one (FP8 paid at every measured token
/// count from there), none when some token count has no crossover.
pub fn combined_threshold(crossovers: &[Crossover]) -> Option<usize> {
    crossovers
        .iter()
        .map(|c| c.suggested_threshold())
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .max()
}

/// How the measurement runs.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossoverConfig {
    /// Token counts, each measured on every case.
    pub tokens: Vec<usize>,
    /// Model widths.
    pub widths: Vec<usize>,
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps (the median is taken).
    pub iters: usize,
    /// Optimizer states of the FP8 weight (as `lm_fsdp --optimizer-states`).
    pub states: StatePrecision,
    /// Gradient shards (as `lm_fsdp --grad-shards`).
    pub grad_shards: GradDtype,
}

impl CrossoverConfig {
    /// Checks the counts.
    pub fn validate(&self) -> Result<(), GptError> {
        if self.tokens.is_empty() || self.widths.is_empty() {
            return Err(GptError::Config("no token counts or no widths".into()));
        }
        if self.tokens.contains(&0) || self.widths.contains(&0) || self.iters == 0 {
            return Err(GptError::Config(format!(
                "token counts {:?}, widths {:?}, {} timed steps: all must be positive",
                self.tokens, self.widths, self.iters
            )));
        }
        Ok(())
    }
}

/// The measured module: a linear, with the LayerNorm before it for [`Feed::AfterNorm`].
struct Subject {
    norm: Option<Norm<bf16>>,
    linear: Linear<bf16>,
    /// The norm's input, for its backward.
    x: Option<Tensor<bf16>>,
}

impl Module for Subject {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        if let Some(n) = &mut self.norm {
            v.child("ln", n)?;
        }
        v.child("lin", &mut self.linear)
    }
}

impl Subject {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<bf16>) -> Result<(), NnError> {
        match &mut self.norm {
            Some(n) => {
                n.forward_linear(ctx, &x, &mut self.linear)?;
                self.x = Some(x);
            }
            None => {
                self.linear.forward(ctx, x)?;
            }
        }
        Ok(())
    }

    fn backward(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<bf16>) -> Result<(), NnError> {
        let dh = self.linear.backward(ctx, dy)?;
        if let Some(n) = &mut self.norm {
            let x = self
                .x
                .take()
                .ok_or_else(|| NnError::usage("linear_crossover", "backward before forward"))?;
            n.backward_ref(ctx, &x, &dh, None)?;
        }
        Ok(())
    }
}

/// A timing mark: a CUDA event on the compute stream, or the host clock.
enum Mark {
    Event(GpuEvent),
    Host(Instant),
}

fn mark(cuda: Option<&CudaDevice>) -> Result<Mark, GptError> {
    Ok(match cuda {
        Some(c) => Mark::Event(c.record_compute_timed()?),
        None => Mark::Host(Instant::now()),
    })
}

fn elapsed_ms(a: &Mark, b: &Mark) -> Result<f64, GptError> {
    match (a, b) {
        (Mark::Event(a), Mark::Event(b)) => Ok(a.elapsed_ms(b)? as f64),
        (Mark::Host(a), Mark::Host(b)) => Ok((*b - *a).as_secs_f64() * 1e3),
        _ => Err(GptError::Config("timing marks of two clocks".into())),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn bf16_values(seed: u64, n: usize, scale: f32) -> Vec<bf16> {
    SplitMix64::new(seed)
        .uniform_vec(n)
        .into_iter()
        .map(|v| bf16::from_f32(v * scale))
        .collect()
}

/// Times `case` in `precision` at every token count of `config` (one model, so the weight and the
/// optimizer are built once).
fn time_case(
    comm: &Arc<dyn Communicator>,
    config: &CrossoverConfig,
    case: &LinearCase,
    precision: LinearPrecision,
) -> Result<Vec<StepTimes>, GptError> {
    let seed = 17 + case.d as u64;
    let linear = Linear::<bf16>::new(case.inf, case.outf)?
        .with_precision(precision)?
        .with_seed(seed)
        .without_bias()
        .with_init(WeightInit::Normal(0.02));
    let norm = match case.feed {
        Feed::Alone => None,
        Feed::AfterNorm => Some(Norm::<bf16>::layer_norm(case.inf)?),
    };
    let subject = Subject {
        norm,
        linear,
        x: None,
    };
    let fsdp = FsdpConfig {
        grad_reduction: GradReduction::F32,
        grad_dtype: config.grad_shards,
        ..FsdpConfig::default()
    };
    let mut model = FsdpModel::new(subject, comm.clone(), WrapPolicy::Single, fsdp)?;
    let mut opt = FsdpAdamW::for_model(&mut model, peer_adamw_options(6e-4, config.states))?;
    let dev = model.device().clone();
    let cuda = match &dev {
        Device::Cuda(c) => Some(c.clone()),
        Device::Cpu => None,
    };
    let mut out = Vec::with_capacity(config.tokens.len());
    for &tokens in &config.tokens {
        // The same inputs for both precisions (seeds depend on the shape only).
        let x: Buffer<bf16> = dev.upload(&bf16_values(
            1 + tokens as u64 * 7 + case.inf as u64,
            tokens * case.inf,
            1.7,
        ))?;
        let dy: Buffer<bf16> = dev.upload(&bf16_values(
            2 + tokens as u64 * 7 + case.outf as u64,
            tokens * case.outf,
            1e-2,
        ))?;
        let (x_shape, y_shape) = (
            Shape::matrix(tokens, case.inf)?,
            Shape::matrix(tokens, case.outf)?,
        );
        let mut marks = Vec::with_capacity(config.iters);
        for i in 0..config.warmup + config.iters {
            if i == config.warmup {
                dev.synchronize()?;
            }
            // Fresh input tensors (the passes consume them), copied before the first mark.
            let xt = Tensor::new(x.to_device(&dev)?, x_shape)?;
            let dyt = Tensor::new(dy.to_device(&dev)?, y_shape)?;
            let m0 = mark(cuda.as_ref())?;
            model.forward(Mode::Train, |s, ctx| s.forward(ctx, xt))?;
            let m1 = mark(cuda.as_ref())?;
            model.backward(|s, ctx| s.backward(ctx, dyt))?;
            let m2 = mark(cuda.as_ref())?;
            step_model(&mut opt, &mut model)?;
            let m3 = mark(cuda.as_ref())?;
            if i >= config.warmup {
                marks.push([m0, m1, m2, m3]);
            }
        }
        dev.synchronize()?;
        let part = |a: usize, b: usize| -> Result<f64, GptError> {
            Ok(median(
                marks
                    .iter()
                    .map(|m| elapsed_ms(&m[a], &m[b]))
                    .collect::<Result<Vec<_>, _>>()?,
            ))
        };
        out.push(StepTimes {
            forward_ms: part(0, 1)?,
            backward_ms: part(1, 2)?,
            optimizer_ms: part(2, 3)?,
            step_ms: part(0, 3)?,
        });
    }
    Ok(out)
}

/// Measures every case of `config` on `comm`'s device (one rank) in BF16 and FP8; `progress` gets each
/// finished case. Rows in case order, token counts within a case in `config.tokens` order.
pub fn measure(
    comm: &Arc<dyn Communicator>,
    config: &CrossoverConfig,
    mut progress: impl FnMut(&LinearCase),
) -> Result<Vec<CrossoverRow>, GptError> {
    config.validate()?;
    if comm.world_size() != 1 {
        return Err(GptError::Config(format!(
            "the crossover is measured on one rank, not {}",
            comm.world_size()
        )));
    }
    if let Device::Cuda(c) = comm.device() {
        // Keep freed pool memory cached between steps (as the training runs do).
        c.set_pool_release_threshold(u64::MAX)?;
    }
    let mut rows = Vec::new();
    for case in crossover_cases(&config.widths) {
        let bf16 = time_case(comm, config, &case, LinearPrecision::Bf16)?;
        let fp8 = time_case(comm, config, &case, LinearPrecision::Fp8)?;
        for ((&tokens, b), f) in config.tokens.iter().zip(bf16).zip(fp8) {
            rows.push(CrossoverRow {
                tokens,
                case,
                bf16: b,
                fp8: f,
            });
        }
        progress(&case);
    }
    Ok(rows)
}
