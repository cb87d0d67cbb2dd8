//! Optional per-phase timing of a training step (`mlp_bench --profile`): forward, backward (with its
//! gradient reductions) and optimizer.
//!
//! On CUDA each phase is bracketed by timing events on the compute stream and the elapsed times are read
//! after the step's synchronisation, so the profile adds events but no host syncs inside the step; on
//! the CPU, where kernels run synchronously, it is wall time. For a kernel-level profile use Nsight
//! Compute on the GPU machine.

use super::MlpError;
use fp8_kernels::{Device, GpuEvent};
use std::time::Instant;

/// The phases of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Forward (gathers waited for included).
    Forward,
    /// Loss gradient and backward (gradient reductions included).
    Backward,
    /// Optimizer step, FP8 re-quantization and scale agreement.
    Optimizer,
}

impl Phase {
    /// Every phase, in table order.
    pub const ALL: [Phase; 3] = [Phase::Forward, Phase::Backward, Phase::Optimizer];

    /// A short name for the table.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward + reductions",
            Phase::Optimizer => "optimizer + re-quantization",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The start of a timed phase.
pub(crate) enum Mark {
    Cuda(GpuEvent),
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

    fn start(&self) -> Result<Mark, MlpError> {
        Ok(match &self.device {
            Device::Cuda(c) => Mark::Cuda(c.record_compute_timed()?),
            Device::Cpu => Mark::Host(Instant::now()),
        })
    }

    fn stop(&mut self, phase: Phase, mark: Mark) -> Result<(), MlpError> {
        match (mark, &self.device) {
            (Mark::Cuda(e0), Device::Cuda(c)) => {
                let e1 = c.record_compute_timed()?;
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
pub(crate) fn start(p: &Option<Profiler>) -> Result<Option<Mark>, MlpError> {
    p.as_ref().map(Profiler::start).transpose()
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
