//! Optional per-phase timing of a training step (`mlp_bench --profile`).
//!
//! On CUDA each phase is bracketed by timing events on the stream it runs on (compute, or communication
//! for the gathers) and the elapsed times are read after the step's synchronisation, so the profile
//! adds events but no host syncs inside the step; on the CPU, where kernels run synchronously, it is wall
//! time. Events add a few microseconds per phase: profiled step times are slightly above unprofiled ones.

use super::MlpError;
use fp8_kernels::{Device, GpuEvent};
use std::time::Instant;

/// The phases of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// All-gathers of the units (communication stream; overlapped with compute when prefetched).
    Gather,
    /// The compute stream waiting for a gather (the part of the gathers not hidden).
    GatherWait,
    /// `bf16` mode: F32 -> BF16 conversion of the gathered weights.
    WeightConvert,
    /// Casts of activations to E4M3 (forward, and forward recompute).
    ForwardCast,
    /// Forward GEMMs.
    ForwardGemm,
    /// GELU forward.
    Gelu,
    /// Residual adds and the loss gradient.
    Residual,
    /// Casts of output gradients to E5M2.
    BackwardCast,
    /// Backward GEMMs (`dx` and `dW`).
    BackwardGemm,
    /// GELU backward.
    GeluBackward,
    /// Adding the weight gradients into the unit's flat gradient.
    GradAdd,
    /// Gradient reduce-scatter (and release of the gathered unit).
    Reduction,
    /// Optimizer step, FP8 re-quantization of the weights, and scale updates.
    Optimizer,
    /// `--fused`: GELU fused with the E4M3 cast of its output (replaces GELU + the down input's cast).
    GeluCastFused,
    /// `--fused`: GELU backward fused with the E5M2 cast of its output (replaces GELU backward + the up
    /// output gradient's cast).
    GeluBackwardCastFused,
    /// `--recompute-gelu`: the backward's recast of the down linear's input from `u`.
    GeluRecast,
}

impl Phase {
    /// Every phase, in table order.
    pub const ALL: [Phase; 16] = [
        Phase::Gather,
        Phase::GatherWait,
        Phase::WeightConvert,
        Phase::ForwardCast,
        Phase::ForwardGemm,
        Phase::Gelu,
        Phase::GeluCastFused,
        Phase::Residual,
        Phase::BackwardCast,
        Phase::BackwardGemm,
        Phase::GeluBackward,
        Phase::GeluBackwardCastFused,
        Phase::GeluRecast,
        Phase::GradAdd,
        Phase::Reduction,
        Phase::Optimizer,
    ];

    /// A short name for the table.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Gather => "gathers (comm stream)",
            Phase::GatherWait => "gather waits (compute stream)",
            Phase::WeightConvert => "bf16 weight conversion",
            Phase::ForwardCast => "forward casts (e4m3)",
            Phase::ForwardGemm => "forward GEMMs",
            Phase::Gelu => "GELU",
            Phase::Residual => "residual adds, loss grad",
            Phase::BackwardCast => "backward casts (e5m2)",
            Phase::BackwardGemm => "backward GEMMs",
            Phase::GeluBackward => "GELU backward",
            Phase::GeluRecast => "GELU input recast (backward)",
            Phase::GradAdd => "weight-gradient adds",
            Phase::Reduction => "gradient reduction",
            Phase::Optimizer => "optimizer + re-quantization",
            Phase::GeluCastFused => "GELU + e4m3 cast (fused)",
            Phase::GeluBackwardCastFused => "GELU backward + e5m2 cast (fused)",
        }
    }

    fn index(self) -> usize {
        Phase::ALL.iter().position(|p| *p == self).unwrap_or(0)
    }
}

/// The start of a timed phase.
pub(crate) enum Mark {
    Cuda(GpuEvent, bool),
    Host(Instant),
}

/// Per-phase timer; totals accumulate over the steps it is enabled for.
pub(crate) struct Profiler {
    device: Device,
    pending: Vec<(Phase, GpuEvent, GpuEvent)>,
    totals: [f64; Phase::ALL.len()],
    steps: u64,
}

impl Profiler {
    pub(crate) fn new(device: Device) -> Self {
        Profiler {
            device,
            pending: Vec::new(),
            totals: [0.0; Phase::ALL.len()],
            steps: 0,
        }
    }

    /// Starts a phase on the compute stream (`comm`: the communication stream).
    pub(crate) fn start(&self, comm: bool) -> Result<Mark, MlpError> {
        Ok(match &self.device {
            Device::Cuda(c) => {
                let e = if comm {
                    c.record_comm_timed()?
                } else {
                    c.record_compute_timed()?
                };
                Mark::Cuda(e, comm)
            }
            Device::Cpu => Mark::Host(Instant::now()),
        })
    }

    /// Ends the phase started by `mark`.
    pub(crate) fn stop(&mut self, phase: Phase, mark: Mark) -> Result<(), MlpError> {
        match (mark, &self.device) {
            (Mark::Cuda(e0, comm), Device::Cuda(c)) => {
                let e1 = if comm {
                    c.record_comm_timed()?
                } else {
                    c.record_compute_timed()?
                };
                self.pending.push((phase, e0, e1));
            }
            (Mark::Host(t0), _) => self.totals[phase.index()] += t0.elapsed().as_secs_f64(),
            (Mark::Cuda(..), Device::Cpu) => {
                return Err(MlpError::Config("CUDA mark on a CPU profiler".into()))
            }
        }
        Ok(())
    }

    /// Closes a step: synchronises and adds the step's event times to the totals.
    pub(crate) fn end_step(&mut self) -> Result<(), MlpError> {
        self.device.synchronize()?;
        for (phase, e0, e1) in self.pending.drain(..) {
            self.totals[phase.index()] += f64::from(e0.elapsed_ms(&e1)?) / 1e3;
        }
        self.steps += 1;
        Ok(())
    }

    /// Mean seconds per step of each phase that ran, in table order.
    pub(crate) fn mean_per_step(&self) -> Vec<(Phase, f64)> {
        let n = self.steps.max(1) as f64;
        Phase::ALL
            .iter()
            .filter(|p| self.totals[p.index()] > 0.0)
            .map(|p| (*p, self.totals[p.index()] / n))
            .collect()
    }
}

/// Starts a phase when profiling.
pub(crate) fn start(p: &Option<Profiler>, comm: bool) -> Result<Option<Mark>, MlpError> {
    p.as_ref().map(|p| p.start(comm)).transpose()
}

/// Ends a phase when profiling.
pub(crate) fn stop(
    p: &mut Option<Profiler>,
    phase: Phase,
    m: Option<Mark>,
) -> Result<(), MlpError> {
    match (p, m) {
        (Some(p), Some(m)) => p.stop(phase, m),
        _ => Ok(()),
    }
}
