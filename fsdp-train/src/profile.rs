//! Phase timings of training steps (`mnist_fsdp --profile`, `lm_fsdp --speed --profile`,
//! `mlp_bench --profile`): CUDA events around each phase on a GPU (read once, when the window is full),
//! host time everywhere. A phase a program never marks is absent from the profile.

use fp8_kernels::{Device, GpuEvent, KernelError};
use std::time::Instant;

/// Steps run before a profiled window opens (NVRTC compilation, cuBLASLt plans, pool growth).
pub const PROFILE_WARMUP_STEPS: usize = 20;

/// A phase of a training batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Batch assembly: gather on the device (GPU) or fill and upload (CPU).
    Data,
    /// Forward pass with the loss (gathers of the units included) and the loss accumulation.
    Forward,
    /// Backward pass with the gradient reductions.
    Backward,
    /// The optimizer step (FP8 weight re-cast and zeroed gradients included).
    Optimizer,
}

impl Phase {
    /// Every phase, in step order.
    pub const ALL: [Phase; 4] = [
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
    ];

    /// The phase's name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// Time of one phase, per batch of the profiled window.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTiming {
    /// The phase.
    pub phase: Phase,
    /// Milliseconds of the compute stream between the events around the phase (GPU only). This includes
    /// idle time while the GPU waits for the host to queue work, so GPU time close to host time means
    /// the phase is bound by the host (launch overhead, host reads), not by the kernels.
    pub gpu_ms: Option<f64>,
    /// Milliseconds the host spent queuing (GPU) or running (CPU) the phase.
    pub host_ms: f64,
}

/// Phase timings of a profiled window of training batches.
#[derive(Debug, Clone, PartialEq)]
pub struct StepProfile {
    /// Batches timed.
    pub batches: usize,
    /// One entry per [`Phase`] the steps marked, in step order.
    pub phases: Vec<PhaseTiming>,
    /// Wall-clock milliseconds per batch over the window, up to the end of the last batch's GPU work.
    pub wall_ms: f64,
    /// Batches run before the window opened.
    pub warmup: usize,
}

impl StepProfile {
    /// The table printed by `mnist_fsdp --profile`.
    pub fn table(&self) -> String {
        let mut t = format!(
            "Profile of {} training batches (after {} warm-up), ms per batch:\n",
            self.batches, self.warmup
        );
        t.push_str(&format!("  {:<12} {:>10} {:>10}\n", "phase", "gpu", "host"));
        let (mut g, mut h) = (0.0, 0.0);
        let gpu = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        for p in &self.phases {
            t.push_str(&format!(
                "  {:<12} {:>10} {:>10.3}\n",
                p.phase.name(),
                gpu(p.gpu_ms),
                p.host_ms
            ));
            g += p.gpu_ms.unwrap_or(0.0);
            h += p.host_ms;
        }
        let any_gpu = self.phases.iter().any(|p| p.gpu_ms.is_some());
        t.push_str(&format!(
            "  {:<12} {:>10} {:>10.3}\n",
            "sum",
            gpu(any_gpu.then_some(g)),
            h
        ));
        t.push_str(&format!("  {:<12} {:>21.3}\n", "wall", self.wall_ms));
        t
    }

    /// `profile_ms` of the programs' JSON lines: per phase, GPU (`null` on the CPU) and host
    /// milliseconds per batch.
    pub fn json_ms(&self) -> serde_json::Value {
        self.phases
            .iter()
            .map(|ph| {
                let times = serde_json::json!({"gpu": ph.gpu_ms, "host": ph.host_ms});
                (ph.phase.name().to_string(), times)
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// The events and host times of one profiled batch.
pub struct ProfiledStep {
    cuda: Option<fp8_kernels::CudaDevice>,
    sync: bool,
    events: Vec<(Phase, GpuEvent)>,
    begin: Option<GpuEvent>,
    last_host: Instant,
    host_ms: [f64; Phase::ALL.len()],
    marked: [bool; Phase::ALL.len()],
}

/// Collects [`ProfiledStep`]s until the window is full; reads the events only then (one wait).
pub struct StepProfiler {
    cuda: Option<fp8_kernels::CudaDevice>,
    sync: bool,
    target: usize,
    warmup: usize,
    started: Option<Instant>,
    steps: Vec<ProfiledStep>,
    complete: bool,
}

impl StepProfiler {
    /// A profiler of `target` batches on `device`, opened after `warmup` batches (for the table);
    /// `sync` waits for the device at every phase boundary.
    pub fn new(device: &Device, target: usize, warmup: usize, sync: bool) -> Self {
        StepProfiler {
            cuda: device.as_cuda("profile").ok().cloned(),
            sync,
            target,
            warmup,
            started: None,
            steps: Vec::with_capacity(target),
            complete: false,
        }
    }

    /// Starts timing a batch, or `None` once the window is complete.
    pub fn begin(&mut self) -> Result<Option<ProfiledStep>, KernelError> {
        if self.complete {
            return Ok(None);
        }
        if let (Some(c), true) = (&self.cuda, self.sync) {
            wait_for_device(c)?;
        }
        let now = Instant::now();
        self.started.get_or_insert(now);
        let begin = match &self.cuda {
            Some(c) => Some(c.record_compute_timed()?),
            None => None,
        };
        Ok(Some(ProfiledStep {
            cuda: self.cuda.clone(),
            sync: self.sync,
            events: Vec::with_capacity(Phase::ALL.len()),
            begin,
            last_host: now,
            host_ms: [0.0; Phase::ALL.len()],
            marked: [false; Phase::ALL.len()],
        }))
    }

    /// Adds a finished batch; returns the profile when the window is complete.
    pub fn add(&mut self, step: ProfiledStep) -> Result<Option<StepProfile>, KernelError> {
        self.steps.push(step);
        if self.steps.len() < self.target {
            return Ok(None);
        }
        self.complete = true;
        if let Some(c) = &self.cuda {
            c.stream().synchronize().map_err(KernelError::from)?;
        }
        let n = self.steps.len();
        let wall_ms = self
            .started
            .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3)
            / n as f64;
        let mut gpu = [0f64; Phase::ALL.len()];
        let mut host = [0f64; Phase::ALL.len()];
        let mut marked = [false; Phase::ALL.len()];
        for st in &self.steps {
            for (h, v) in host.iter_mut().zip(st.host_ms) {
                *h += v;
            }
            for (m, v) in marked.iter_mut().zip(st.marked) {
                *m |= v;
            }
            let mut prev = st.begin.as_ref();
            for (phase, ev) in &st.events {
                if let Some(p) = prev {
                    gpu[*phase as usize] += f64::from(p.elapsed_ms(ev)?);
                }
                prev = Some(ev);
            }
        }
        let on_gpu = self.cuda.is_some();
        let phases = Phase::ALL
            .iter()
            .filter(|&&p| marked[p as usize])
            .map(|&p| PhaseTiming {
                phase: p,
                gpu_ms: on_gpu.then_some(gpu[p as usize] / n as f64),
                host_ms: host[p as usize] / n as f64,
            })
            .collect();
        self.steps.clear();
        Ok(Some(StepProfile {
            batches: n,
            phases,
            wall_ms,
            warmup: self.warmup,
        }))
    }
}

/// Ends `phase` of a profiled batch (a no-op when the batch is not profiled).
pub fn mark(step: &mut Option<ProfiledStep>, phase: Phase) -> Result<(), KernelError> {
    let Some(st) = step.as_mut() else {
        return Ok(());
    };
    let now = Instant::now();
    st.host_ms[phase as usize] += (now - st.last_host).as_secs_f64() * 1e3;
    st.marked[phase as usize] = true;
    st.last_host = now;
    if let Some(c) = &st.cuda {
        st.events.push((phase, c.record_compute_timed()?));
        if st.sync {
            wait_for_device(c)?;
            // The wait is neither this phase's nor the next one's host time.
            st.last_host = Instant::now();
        }
    }
    Ok(())
}

/// Waits for every stream of the device (compute and communication).
fn wait_for_device(c: &fp8_kernels::CudaDevice) -> Result<(), KernelError> {
    c.context().synchronize().map_err(KernelError::from)?;
    Ok(())
}

/// Starts timing a batch when profiling (see [`StepProfiler::begin`]).
pub fn begin_profiled_step(
    profiler: &mut Option<StepProfiler>,
) -> Result<Option<ProfiledStep>, KernelError> {
    match profiler.as_mut() {
        Some(p) => p.begin(),
        None => Ok(None),
    }
}

/// Hands a profiled batch to the profiler; prints the table on completion when `print`.
pub fn finish_profiled_step(
    profiler: &mut Option<StepProfiler>,
    step: Option<ProfiledStep>,
    out: &mut Option<StepProfile>,
    print: bool,
) -> Result<(), KernelError> {
    let (Some(p), Some(st)) = (profiler.as_mut(), step) else {
        return Ok(());
    };
    if let Some(done) = p.add(st)? {
        if print {
            println!("{}", done.table());
        }
        *out = Some(done);
    }
    Ok(())
}
