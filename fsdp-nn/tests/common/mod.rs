//! What the layer and architecture tests share: deterministic values, rank runners, gradient shards
//! reassembled on the host, and a communicator that counts the collectives it runs.
#![allow(dead_code)]

pub mod tiny_lm;

use fp8_kernels::rng::SplitMix64;
use fp8_kernels::Device;
use fsdp_comm::{
    run_ranks, Collective, CollectiveKind, CommError, CommWork, Communicator, DistEnv, NcclComm,
    NcclConfig, ReduceOp, ThreadGroup, DEFAULT_THREAD_TIMEOUT,
};
use fsdp_nn::{Linear, LinearPrecision, NnError, Relu, Sequential};
use fsdp_shard::{ModelLayout, ParamGroup, ShardedModel};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Any error of a rank (layers, shards, optimizer, collectives).
pub type TestError = Box<dyn std::error::Error + Send + Sync>;
/// A rank's result.
pub type TestResult<T> = Result<T, TestError>;

/// `name0` (`Linear(d_in -> d_hid)` in `precisions[0]`, seed 1) - `act` ReLU - `name1`
/// (`Linear(d_hid -> d_out)` in `precisions[1]`, seed 2).
pub fn linear_relu_linear(
    [name0, name1]: [&str; 2],
    (d_in, d_hid, d_out): (usize, usize, usize),
    precisions: [LinearPrecision; 2],
) -> Result<Sequential, NnError> {
    Ok(Sequential::new()
        .push(
            name0,
            Linear::new(d_in, d_hid)?
                .with_precision(precisions[0])?
                .with_seed(1),
        )
        .push("act", Relu::new())
        .push(
            name1,
            Linear::new(d_hid, d_out)?
                .with_precision(precisions[1])?
                .with_seed(2),
        ))
}

/// One thread rank on the CPU.
pub fn cpu_comm() -> TestResult<Arc<dyn Communicator>> {
    let comm = ThreadGroup::new(1, DEFAULT_THREAD_TIMEOUT)?
        .pop()
        .ok_or("no rank")?;
    Ok(Arc::new(comm))
}

/// For a GPU test: an NCCL communicator of world size 1 on GPU 0 (`DistEnv::single()`, as the examples
/// do without a launcher; `fsdp-comm` has no other single-rank communicator on CUDA). Panics, naming the
/// cause, when the GPU is missing, has no FP8, or NCCL cannot start: with a GPU present that is a failure
/// of the machine's setup, not a skip.
pub fn cuda_comm() -> Arc<dyn Communicator> {
    let gpu = Device::cuda(0).unwrap_or_else(|e| panic!("no usable CUDA device: {e}"));
    if let Device::Cuda(c) = &gpu {
        if let Err(e) = c.require_fp8() {
            panic!("no FP8 on this GPU: {e}");
        }
    }
    drop(gpu);
    let comm = NcclComm::from_dist_env(&DistEnv::single(), &NcclConfig::default())
        .expect("an NCCL communicator of one rank (source cuda-env.sh)");
    Arc::new(comm)
}

/// Deterministic values uniform in `[-scale, scale)`.
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.uniform_f32() * scale).collect()
}

/// Runs `f` on `n` thread ranks and returns their results in rank order (a failure fails the test,
/// naming the cause).
pub fn on_ranks<R: Send>(
    n: usize,
    f: impl Fn(Arc<dyn Communicator>) -> TestResult<R> + Sync,
) -> Vec<R> {
    match run_ranks(n, |comm| f(Arc::new(comm))) {
        Ok(v) => v,
        Err(e) => panic!("a rank failed: {e}"),
    }
}

/// The bit patterns of `v` (for bitwise comparisons that also tell -0 from 0 and compare NaNs).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// This rank's reduced gradient shards widened to F32: per unit, `[FP8 group, plain group]`.
pub fn grad_shards(model: &ShardedModel) -> TestResult<Vec<[Vec<f32>; 2]>> {
    let mut out = Vec::new();
    for u in 0..model.num_units() {
        let s = model.unit(u)?;
        out.push([
            s.grad(ParamGroup::Fp8).to_f32_vec()?,
            s.grad(ParamGroup::Plain).to_f32_vec()?,
        ]);
    }
    Ok(out)
}

/// The reduced gradient of parameter `name` from every rank's shards (rank order; a block-scaled FP8
/// group's shards are uneven and stored padded: only each rank's real range is taken).
pub fn full_grad(layout: &ModelLayout, per_rank: &[Vec<[Vec<f32>; 2]>], name: &str) -> Vec<f32> {
    let p = layout
        .param_index(name)
        .unwrap_or_else(|| panic!("no parameter {name}"));
    let (u, g, slot) = layout.locate(p).expect("located");
    let group = layout.units[u].group(g);
    let ws = per_rank.len();
    let flat: Vec<f32> = per_rank
        .iter()
        .enumerate()
        .flat_map(|(rank, r)| {
            let real = group.shard_range(rank, ws).len();
            r[u][g as usize][..real].iter().copied()
        })
        .collect();
    flat[slot.offset..slot.offset + slot.numel].to_vec()
}

/// `sqrt(sum (a - b)^2) / max(sqrt(sum b^2), tiny)`.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

/// A communicator that forwards to another and counts the collectives started through it, by kind and
/// reduction (to check how many all-reduces a step runs).
pub struct CountingComm {
    inner: Arc<dyn Communicator>,
    counts: Mutex<Vec<(CollectiveKind, Option<ReduceOp>)>>,
    barriers: AtomicUsize,
}

impl CountingComm {
    /// Counts what goes through `inner`.
    pub fn new(inner: Arc<dyn Communicator>) -> Arc<Self> {
        Arc::new(CountingComm {
            inner,
            counts: Mutex::new(Vec::new()),
            barriers: AtomicUsize::new(0),
        })
    }

    /// Forgets what was counted.
    pub fn reset(&self) {
        self.counts.lock().expect("lock").clear();
        self.barriers.store(0, Ordering::SeqCst);
    }

    /// The collectives since the last reset, in order.
    pub fn calls(&self) -> Vec<(CollectiveKind, Option<ReduceOp>)> {
        self.counts.lock().expect("lock").clone()
    }

    /// How many collectives of `kind` with reduction `op` ran since the last reset.
    pub fn count(&self, kind: CollectiveKind, op: Option<ReduceOp>) -> usize {
        self.calls()
            .iter()
            .filter(|(k, o)| *k == kind && *o == op)
            .count()
    }
}

impl Communicator for CountingComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> &Device {
        self.inner.device()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.barriers.fetch_add(1, Ordering::SeqCst);
        self.inner.barrier()
    }
    fn start(&self, call: Collective<'_>) -> Result<CommWork, CommError> {
        self.counts
            .lock()
            .expect("lock")
            .push((call.kind(), call.op()));
        self.inner.start(call)
    }
}

/// Everything a training run produced, as bits, for tests that compare two ways of computing the same
/// training (fused against unfused, recast against kept): per step the loss, the output, the gathered
/// weights, the FP8 weight scales and the module state (scaling metas); at the end the FP8 masters.
#[derive(Debug, Default, PartialEq)]
pub struct StepTrace {
    pub losses: Vec<u64>,
    pub outputs: Vec<Vec<u16>>,
    pub params: Vec<Vec<(String, Vec<u32>)>>,
    pub weight_scales: Vec<Vec<u32>>,
    pub module_state: Vec<std::collections::BTreeMap<String, String>>,
    pub masters: Vec<Vec<u32>>,
}

impl StepTrace {
    /// Records one step after the optimizer stepped: its loss, the BF16 output, and the model's state.
    pub fn record_step<M: fsdp_shard::Module>(
        &mut self,
        model: &mut fsdp_shard::FsdpModel<M>,
        loss: f64,
        out: &[half::bf16],
    ) -> TestResult<()> {
        self.losses.push(loss.to_bits());
        self.outputs.push(out.iter().map(|v| v.to_bits()).collect());
        self.params.push(
            model
                .gathered_params()?
                .into_iter()
                .map(|(n, v)| (n, bits(&v)))
                .collect(),
        );
        self.weight_scales.push(
            model
                .sharded()
                .weight_scales()?
                .iter()
                .flat_map(|&(_, s, i)| [s.to_bits(), i.to_bits()])
                .collect(),
        );
        self.module_state.push(model.export_module_state()?);
        Ok(())
    }

    /// Records the optimizer's FP8 master shards at the end of the run.
    pub fn record_masters<M: fsdp_shard::Module>(
        &mut self,
        model: &fsdp_shard::FsdpModel<M>,
        opt: &fsdp_optim::FsdpAdamW,
    ) -> TestResult<()> {
        for u in 0..model.sharded().num_units() {
            self.masters.push(bits(&opt.fp8_master_shard(u)?));
        }
        Ok(())
    }

    /// Asserts that `self` equals `want` bit for bit, field by field, naming the run in `label`.
    pub fn assert_bitwise_eq(&self, want: &StepTrace, label: &str) {
        assert_eq!(self.losses, want.losses, "{label}: losses");
        assert_eq!(self.outputs, want.outputs, "{label}: outputs");
        assert_eq!(self.params, want.params, "{label}: weights");
        assert_eq!(
            self.weight_scales, want.weight_scales,
            "{label}: weight scales"
        );
        assert_eq!(self.module_state, want.module_state, "{label}: metas");
        assert_eq!(self.masters, want.masters, "{label}: masters");
    }
}
