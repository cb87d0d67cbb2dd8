//! [`ShardedAdam`]: Adam / AdamW over one rank's shards of a [`ShardedModel`], and its two faces
//! [`FsdpAdam`] (L2 penalty) and [`FsdpAdamW`] (decoupled weight decay). Weight decay applies to the
//! parameters declared to decay ([`fsdp_shard::ParamSpec::decay`]: matrices by default); the others
//! step with the same coefficients without it.

use crate::config::{AdamOptions, StatePrecision};
use crate::policy::{self, StateAmaxes, StateScales};
use crate::schedule::LrSchedule;
use crate::OptimError;
use fp8_core::{Fp8Format, QType};
use fp8_kernels::adam::control::{
    adam_coefficients_from_stats, adam_commit_amaxes, cast_weight_blocks, cast_weight_source, ctl,
    MasterSource, SlotScales, COEF_LEN,
};
use fp8_kernels::adam::{
    adam_step_f32, adam_step_low_precision, f16_saturating, lp_slot, AmaxSlots, Coefficients,
    LowPrecisionAdamState,
};
use fp8_kernels::reduce::{norm_stats, norm_stats_finish, NORM_STATS_ACC_LEN};
use fp8_kernels::{Buffer, Device, WeightDecay};
use fsdp_comm::ReduceOp;
use fsdp_shard::{
    GradDtype, GradShard, MemoryReport, ParamGroup, ScalingRegistry, ShardError, ShardedModel,
    ShardedState, StateShard, UnitShards,
};
use half::f16;
use std::ops::Range;

mod checkpoint;
mod in_backward;
mod memory;

pub(crate) use in_backward::unit_step_error;
pub use memory::BytesPerParam;

const FP8: usize = ParamGroup::Fp8 as usize;
/// Word of the coefficient buffer holding the L2 flag (the decoupled flag follows): see
/// `fp8_kernels::adam::AdamCoefficients`.
const COEF_L2_WORD: usize = 11;
const _: () = assert!(
    std::mem::offset_of!(fp8_kernels::adam::AdamCoefficients, l2) == COEF_L2_WORD * 4
        && std::mem::offset_of!(fp8_kernels::adam::AdamCoefficients, decoupled)
            == (COEF_L2_WORD + 1) * 4
);
const PLAIN: usize = ParamGroup::Plain as usize;

/// What one call of [`ShardedAdam::step`] did (identical on every rank).
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Adam's step count after this call (skipped steps do not count).
    pub step: u64,
    /// Whether this step was skipped because a gradient was not finite.
    pub skipped: bool,
    /// Steps skipped so far.
    pub skipped_total: u64,
    /// Non-finite gradient values found on all ranks (before any FP8 cast and in the shards).
    pub nonfinite: u64,
    /// Global L2 norm of the gradients before clipping (not finite when skipped).
    pub grad_norm: f64,
    /// Factor the gradients were multiplied with by clipping (1 without clipping or below the limit).
    pub clip_coef: f64,
    /// Learning rate used.
    pub lr: f64,
}

/// The report of a queued step: a copy of the step counters and statistics on the device, read on demand.
#[derive(Debug)]
pub struct PendingStepReport {
    report: Buffer<f32>,
    lr: f64,
    max_grad_norm: Option<f64>,
}

impl PendingStepReport {
    /// Reads the report (on CUDA this waits for the step to finish).
    pub fn read(&self) -> Result<StepReport, OptimError> {
        let r = self.report.to_vec()?;
        if r.len() != ctl::LEN {
            return Err(mismatch(format!("step report of {} words", r.len())));
        }
        let skipped = r[ctl::LAST_SKIP] != 0.0;
        let grad_norm = (r[ctl::LAST_SUMSQ] as f64).sqrt();
        let clip_coef = match (skipped, self.max_grad_norm) {
            (false, Some(max)) => (max / (grad_norm + 1e-6)).min(1.0),
            _ => 1.0,
        };
        Ok(StepReport {
            step: u64::from(r[ctl::STEP].to_bits()),
            skipped,
            skipped_total: u64::from(r[ctl::SKIP_COUNT].to_bits()),
            nonfinite: if skipped {
                r[ctl::LAST_NONFINITE] as u64
            } else {
                0
            },
            grad_norm,
            clip_coef,
            lr: self.lr,
        })
    }
}

/// The per-parameter metas of one FP8 weight's optimizer states: identical on every rank after a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateMeta {
    /// Model parameter index.
    pub param: usize,
    /// Scales the stored master, first and second moment belong to (1 for F32 states).
    pub scales: StateScales,
    /// Agreed amaxes of master, first and second moment after the last step (master only for F32 states).
    pub amaxes: StateAmaxes,
}

/// States of a unit's FP8 group.
#[derive(Debug)]
enum Fp8States {
    F32 {
        master: Buffer<f32>,
        m: Buffer<f32>,
        v: Buffer<f32>,
    },
    Low {
        master: Buffer<f16>,
        m: Buffer<u8>,
        v: Buffer<f16>,
    },
}

#[derive(Debug)]
struct UnitStates {
    fp8: Fp8States,
    plain_m: Buffer<f32>,
    plain_v: Buffer<f32>,
    /// `(slot, local range)` pieces of this rank's FP8 shard.
    segments: Vec<(usize, Range<usize>)>,
    /// For block-scaled FP8 weights, per segment: the weight's columns and where the segment's first
    /// row of block scales is in the unit's block-scale shard. Empty for per-tensor weights.
    block_cast: Vec<(usize, usize)>,
    /// Model parameter index of every FP8 slot.
    params: Vec<usize>,
    /// Index of this unit's first slot in the model-wide slot numbering.
    slot_base: usize,
    fp8_len: usize,
    plain_len: usize,
    /// Whether weight decay applies to each FP8 slot (the parameter's group).
    fp8_decay: Vec<bool>,
    /// The plain shard cut into runs of parameters that do or do not decay (one run when all agree or
    /// there is no weight decay).
    plain_runs: Vec<(bool, Range<usize>)>,
}

/// Adam / AdamW over this rank's shards (see the crate docs for the algorithm). Use it through
/// [`FsdpAdam`] or [`FsdpAdamW`], which fix where weight decay enters.
pub struct ShardedAdam {
    options: AdamOptions,
    decay_mode: WeightDecay,
    schedule: Option<Box<dyn LrSchedule>>,
    schedule_position: u64,
    units: Vec<UnitStates>,
    /// Step counters and the last step's statistics ([`ctl`] layout), on the model's device.
    control: Buffer<f32>,
    /// Adam's coefficients of the current step and the skip flag, written on the device.
    coef: Buffer<f32>,
    /// Gradient-statistics accumulator.
    stats_acc: Buffer<f32>,
    /// Agreed state amaxes, 3 per FP8 slot (model-wide numbering): master, first, second moment.
    amaxes: Buffer<f32>,
    /// Scales the stored states belong to, 3 per FP8 slot (1 for F32 states).
    scales: Buffer<f32>,
    /// This step's write scales, 3 per slot (low precision).
    write: Buffer<f32>,
    /// The fused kernel's read/write scales, `lp_slot::SCALES` per slot (low precision).
    kernel_scales: Buffer<f32>,
    total_slots: usize,
    /// `coef` without weight decay, for parameters outside the decay group (when any).
    coef_no_decay: Buffer<f32>,
    /// Two zero words (the L2 and decoupled flags of the coefficients).
    zero_flags: Buffer<f32>,
    /// A step begun in the backward, unit by unit, not yet finished (see `in_backward`).
    in_backward: Option<in_backward::StepInBackward>,
    rank: usize,
    world_size: usize,
    device: Device,
}

impl std::fmt::Debug for ShardedAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedAdam")
            .field("options", &self.options)
            .field("decay_mode", &self.decay_mode)
            .field("schedule", &self.schedule)
            .field("schedule_position", &self.schedule_position)
            .finish()
    }
}

fn mismatch(m: String) -> OptimError {
    OptimError::Mismatch(m)
}

impl ShardedAdam {
    /// Builds the states of this rank from the model and the F32 master shards of its FP8 groups (as
    /// returned by [`ShardedModel::new`], one per unit). Moments start at zero.
    pub fn new(
        model: &ShardedModel,
        fp8_masters: Vec<Vec<f32>>,
        options: AdamOptions,
        decay_mode: WeightDecay,
    ) -> Result<Self, OptimError> {
        options.validate()?;
        let device = model.device().clone();
        let (rank, world_size) = (model.comm().rank(), model.comm().world_size());
        if fp8_masters.len() != model.num_units() {
            return Err(mismatch(format!(
                "{} master shards for {} units",
                fp8_masters.len(),
                model.num_units()
            )));
        }
        // The model's agreed weight scales bound the initial amaxes: amax <= 448 / scale (for margin >= 0).
        let weight_scales = model.weight_scales()?;
        let margin_factor = 2f32.powi((-model.config().weight_margin).max(0));
        let mut units = Vec::with_capacity(model.num_units());
        let mut amaxes = Vec::new();
        let mut scales = Vec::new();
        let mut slot_base = 0;
        for (u, master) in fp8_masters.into_iter().enumerate() {
            let shards = model.unit(u)?;
            let (fp8_len, plain_len) = (shards.fp8.len(), shards.plain.len());
            if master.len() != fp8_len {
                return Err(mismatch(format!(
                    "unit {u}: master shard has {} elements, the FP8 shard {fp8_len}",
                    master.len()
                )));
            }
            let slots = &model.layout().units[u].group(ParamGroup::Fp8).slots;
            let params: Vec<usize> = slots.iter().map(|s| s.param).collect();
            let segments = model.fp8_segments(u)?;
            let block_cast = if model.layout().units[u].group(ParamGroup::Fp8).block_scaled {
                segments
                    .iter()
                    .map(|(i, r)| Ok((slots[*i].cols, model.block_scale_offset(u, r.start)?)))
                    .collect::<Result<Vec<_>, OptimError>>()?
            } else {
                Vec::new()
            };
            let decays = |p: &usize| model.layout().params.get(*p).is_none_or(|s| s.decay);
            let fp8_decay: Vec<bool> = params.iter().map(decays).collect();
            let plain_slots = &model.layout().units[u].group(ParamGroup::Plain).slots;
            let mut plain_runs: Vec<(bool, Range<usize>)> = Vec::new();
            if options.weight_decay == 0.0 || plain_slots.iter().all(|sl| decays(&sl.param)) {
                if plain_len > 0 {
                    plain_runs.push((true, 0..plain_len));
                }
            } else {
                for (i, r) in model.segments(u, ParamGroup::Plain)? {
                    let d = decays(&plain_slots[i].param);
                    match plain_runs.last_mut() {
                        Some((ld, lr)) if *ld == d && lr.end == r.start => lr.end = r.end,
                        _ => plain_runs.push((d, r)),
                    }
                }
            }
            let unit_amaxes: Vec<StateAmaxes> = params
                .iter()
                .map(|p| {
                    let s = weight_scales
                        .iter()
                        .find(|(q, _, _)| q == p)
                        .map_or(1.0, |x| x.1);
                    [Fp8Format::E4M3.max() / s * margin_factor, 0.0, 0.0]
                })
                .collect();
            let fp8 = match options.state_precision {
                StatePrecision::F32 => Fp8States::F32 {
                    master: device.upload(&master)?,
                    m: device.zeros(fp8_len)?,
                    v: device.zeros(fp8_len)?,
                },
                StatePrecision::LowPrecision => {
                    let unit_scales: Vec<StateScales> = unit_amaxes
                        .iter()
                        .map(|a| [policy::initial_master_scale(a[0]), 1.0, 1.0])
                        .collect();
                    let mut stored = vec![f16::ZERO; fp8_len];
                    for (i, r) in &segments {
                        for k in r.clone() {
                            stored[k] = f16_saturating(master[k] * unit_scales[*i][0]);
                        }
                    }
                    scales.extend(unit_scales);
                    Fp8States::Low {
                        master: device.upload(&stored)?,
                        m: device.zeros(fp8_len)?,
                        v: device.zeros(fp8_len)?,
                    }
                }
            };
            if options.state_precision == StatePrecision::F32 {
                scales.extend(std::iter::repeat_n([1.0; 3], params.len()));
            }
            amaxes.extend(unit_amaxes);
            units.push(UnitStates {
                fp8,
                plain_m: device.zeros(plain_len)?,
                plain_v: device.zeros(plain_len)?,
                segments,
                block_cast,
                slot_base,
                fp8_len,
                plain_len,
                params,
                fp8_decay,
                plain_runs,
            });
            slot_base += slots.len();
        }
        let low = options.state_precision == StatePrecision::LowPrecision;
        let lp_len = |k: usize| if low { k * slot_base } else { 0 };
        let flat = |v: Vec<[f32; 3]>| v.into_iter().flatten().collect::<Vec<f32>>();
        Ok(ShardedAdam {
            options,
            decay_mode,
            schedule: None,
            schedule_position: 0,
            units,
            control: device.zeros(ctl::LEN)?,
            coef: device.zeros(COEF_LEN)?,
            stats_acc: device.zeros(NORM_STATS_ACC_LEN)?,
            amaxes: device.upload(&flat(amaxes))?,
            scales: device.upload(&flat(scales))?,
            write: device.zeros(lp_len(3))?,
            kernel_scales: device.zeros(lp_len(lp_slot::SCALES))?,
            total_slots: slot_base,
            coef_no_decay: device.zeros(COEF_LEN)?,
            zero_flags: device.zeros(2)?,
            in_backward: None,
            rank,
            world_size,
            device,
        })
    }

    /// The hyperparameters.
    pub fn options(&self) -> &AdamOptions {
        &self.options
    }

    /// Where weight decay enters.
    pub fn decay_mode(&self) -> WeightDecay {
        self.decay_mode
    }

    fn counter(&self, k: usize) -> Result<u64, OptimError> {
        let c = self.control.to_vec()?;
        Ok(u64::from(c[k].to_bits()))
    }

    /// Adam's step count (successful steps). Reads the device (it waits for queued work).
    pub fn step_count(&self) -> Result<u64, OptimError> {
        self.counter(ctl::STEP)
    }

    /// Steps skipped for non-finite gradients. Reads the device (it waits for queued work).
    pub fn skipped_steps(&self) -> Result<u64, OptimError> {
        self.counter(ctl::SKIP_COUNT)
    }

    /// Sets the base learning rate (what a schedule multiplies).
    pub fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        AdamOptions { lr, ..self.options }.validate()?;
        self.options.lr = lr;
        Ok(())
    }

    /// Attaches a learning-rate schedule, starting at position 0.
    pub fn set_schedule(&mut self, schedule: Box<dyn LrSchedule>) {
        self.schedule = Some(schedule);
        self.schedule_position = 0;
    }

    /// Advances the schedule by one position (call it per epoch or per step, as the schedule means).
    pub fn advance_schedule(&mut self) {
        self.schedule_position += 1;
    }

    /// The schedule's position.
    pub fn schedule_position(&self) -> u64 {
        self.schedule_position
    }

    /// Sets the schedule's position (e.g. the epoch a run starts or resumes in).
    pub fn set_schedule_position(&mut self, position: u64) {
        self.schedule_position = position;
    }

    /// The optimizer in words: kind, state precision and hyperparameters.
    pub fn describe(&self) -> String {
        let o = &self.options;
        let kind = match self.decay_mode {
            WeightDecay::L2 => "Adam",
            WeightDecay::Decoupled => "AdamW",
        };
        let schedule = self
            .schedule
            .as_ref()
            .map_or_else(|| "constant lr".to_string(), |s| format!("{s:?}"));
        // The state precision applies to FP8 weights only: say so when there are none.
        let states = if self.total_slots == 0 {
            "f32 states: no FP8 weights".to_string()
        } else {
            format!("{} states for FP8 weights", o.state_precision.name())
        };
        format!(
            "fsdp-optim {kind} ({states}) lr {} betas {:?} eps {} weight decay {}, {schedule}",
            o.lr, o.betas, o.eps, o.weight_decay
        )
    }

    /// The learning rate the next step uses.
    pub fn current_lr(&self) -> f64 {
        match &self.schedule {
            Some(s) => s.lr_at(self.options.lr, self.schedule_position),
            None => self.options.lr,
        }
    }

    fn host_triples(b: &Buffer<f32>) -> Result<Vec<[f32; 3]>, OptimError> {
        Ok(b.to_vec()?
            .chunks_exact(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect())
    }

    /// Metas of every FP8 weight's states, in model-wide slot order (reads the device).
    pub fn state_metas(&self) -> Result<Vec<StateMeta>, OptimError> {
        let params = self.units.iter().flat_map(|u| u.params.iter().copied());
        let amaxes = Self::host_triples(&self.amaxes)?;
        let scales = Self::host_triples(&self.scales)?;
        Ok(params
            .zip(amaxes.iter().zip(&scales))
            .map(|(param, (a, s))| StateMeta {
                param,
                scales: *s,
                amaxes: *a,
            })
            .collect())
    }

    /// This rank's master values of unit `u`'s FP8 group as F32 (decoded from F16 for low-precision
    /// states; zeros outside the weights), in the shard layout.
    pub fn fp8_master_shard(&self, u: usize) -> Result<Vec<f32>, OptimError> {
        let unit = self
            .units
            .get(u)
            .ok_or_else(|| mismatch(format!("no unit {u}")))?;
        match &unit.fp8 {
            Fp8States::F32 { master, .. } => Ok(master.to_vec()?),
            Fp8States::Low { master, .. } => {
                let stored = master.to_vec()?;
                let scales = Self::host_triples(&self.scales)?;
                let mut out = vec![0f32; stored.len()];
                for (i, r) in &unit.segments {
                    let inv = 1.0 / scales[unit.slot_base + i][0];
                    for k in r.clone() {
                        out[k] = stored[k].to_f32() * inv;
                    }
                }
                Ok(out)
            }
        }
    }

    fn check_model(&self, model: &ShardedModel) -> Result<(), OptimError> {
        let (rank, ws) = (model.comm().rank(), model.comm().world_size());
        if (rank, ws) != (self.rank, self.world_size) || model.num_units() != self.units.len() {
            return Err(mismatch(format!(
                "optimizer built for rank {} of {} with {} units, model is rank {rank} of {ws} with {} units",
                self.rank,
                self.world_size,
                self.units.len(),
                model.num_units()
            )));
        }
        for (u, st) in self.units.iter().enumerate() {
            let s = model.unit(u)?;
            if s.fp8.len() != st.fp8_len || s.plain.len() != st.plain_len {
                return Err(mismatch(format!("unit {u}: shard sizes changed")));
            }
        }
        Ok(())
    }

    /// One optimizer step on this rank's shards (collective: every rank calls it), queued on the model's
    /// device without waiting for it: the skip decision, clipping, Adam's coefficients and the states'
    /// scales are computed on the device, so a CUDA step never reads device memory back. The returned
    /// [`PendingStepReport`] reads the step's report when asked ([`ShardedAdam::step_with_report`] does
    /// so at once). The gradients are consumed: the model's gradient shards are zeroed afterwards, also
    /// when the step is skipped.
    ///
    /// With FP8 gradient reduction the model counts non-finite values before its casts; that count is
    /// read from the device here (the one host read left in a CUDA step, only in that mode).
    pub fn step(&mut self, model: &mut ShardedModel) -> Result<PendingStepReport, OptimError> {
        self.step_agreeing(model, None)
    }

    /// [`ShardedAdam::step`] that also agrees the model's FP8 activation and output-gradient scales:
    /// their pending amaxes travel in the step's one all-reduce(MAX) with the weights' and states'
    /// amaxes, and every meta is updated from the agreed values (identical scales on every rank).
    pub fn step_agreeing(
        &mut self,
        model: &mut ShardedModel,
        scaling: Option<&mut ScalingRegistry>,
    ) -> Result<PendingStepReport, OptimError> {
        self.check_model(model)?;
        if self.in_backward.is_some() {
            return Err(mismatch(
                "a step begun in the backward is not finished: finish it (finish_step_in_backward) \
                 before a whole-model step"
                    .into(),
            ));
        }
        // Transient gradient shards of units that got no gradient (zeros); a no-op otherwise.
        for u in 0..model.num_units() {
            model.ensure_grad_shards(u)?;
        }
        let lr = self.current_lr();
        let low = self.options.state_precision == StatePrecision::LowPrecision;
        let (rank, ws, n) = (self.rank, self.world_size, self.total_slots);
        let dev = self.device.clone();

        // 1. Local statistics and ONE all-reduce SUM: [non-finite count, sum of squares, per-rank rows of
        //    gradient amaxes (low precision only; zeros elsewhere, so the sum is the exact maximum)].
        let mut sums = dev.zeros::<f32>(2 + if low { ws * n } else { 0 })?;
        for (u, st) in self.units.iter().enumerate() {
            let s = model.unit(u)?;
            let amax_row = low.then_some((&mut sums, 2 + rank * n + st.slot_base));
            unit_stats(st, s, &mut self.stats_acc, amax_row)?;
        }
        // The FP8 reductions' count of non-finite values seen before their casts moves into the
        // statistics on the device: no read of the device inside the step.
        model.take_nonfinite_before_cast_into(&mut self.stats_acc)?;
        norm_stats_finish(&mut self.stats_acc, 0, &mut sums)?;
        model
            .comm()
            .all_reduce_in_place((&mut sums).into(), ReduceOp::Sum)?;

        // 2. On the device: skip or go, clipping (torch.nn.utils.clip_grad_norm_'s formula) folded into
        //    the gradient factor, the coefficients of step t + 1 and the states' write scales.
        let params = policy::control_params(&self.options, lr, self.decay_mode, low, n, ws);
        let mut report = dev.zeros::<f32>(ctl::LEN)?;
        let slot_scales = low.then_some(SlotScales {
            amaxes: &self.amaxes,
            scales: &self.scales,
            write: &mut self.write,
            kernel_scales: &mut self.kernel_scales,
        });
        adam_coefficients_from_stats(
            &params,
            &sums,
            &mut self.control,
            &mut self.coef,
            slot_scales,
            &mut report,
        )?;

        // Parameters outside the decay group (biases, norm weights) step with the same coefficients
        // minus weight decay: the L2 and decoupled flags zeroed on the device.
        let no_decay_used = self.options.weight_decay != 0.0
            && self
                .units
                .iter()
                .any(|st| st.fp8_decay.iter().any(|d| !d) || st.plain_runs.iter().any(|(d, _)| !d));
        if no_decay_used {
            self.coef_no_decay.copy_from(&self.coef)?;
            self.coef_no_decay
                .copy_range_from(COEF_L2_WORD, &self.zero_flags, 0, 2)?;
        }

        // 3. The fused update, per FP8 weight segment (each with its own scales), writing amaxes; every
        //    kernel returns at once on a skipped step. The amax vector has room after the states' amaxes
        //    for the model's activation metas, so one all-reduce agrees them all.
        let per_slot = if low { lp_slot::AMAXES } else { 1 };
        let metas = scaling.as_ref().map_or(0, |r| r.len());
        let mut amax = dev.zeros::<f32>(per_slot * n + metas)?;
        let bf16_grads = model.config().grad_dtype == GradDtype::Bf16;
        for (u, st) in self.units.iter_mut().enumerate() {
            let s = model.unit_mut(u)?;
            let coefs = (&self.coef, &self.coef_no_decay);
            let slot_base = st.slot_base;
            update_unit(
                st,
                s,
                coefs,
                &self.kernel_scales,
                slot_base,
                &mut amax,
                bf16_grads,
            )?;
        }

        // 4. ONE all-reduce(MAX) of every amax: new weights' (for the FP8 casts) and, for low-precision
        //    states, the moments' (for the next step's write scales). Then agreed metas and new weights.
        if let Some(reg) = scaling.as_deref() {
            if metas > 0 {
                amax.copy_range_from(per_slot * n, reg.pending(), 0, metas)?;
            }
        }
        if n + metas > 0 {
            model
                .comm()
                .all_reduce_in_place((&mut amax).into(), ReduceOp::Max)?;
        }
        if let Some(reg) = scaling {
            reg.update_from(&amax, per_slot * n)?;
        }
        let agreed = if metas > 0 {
            let mut head = dev.zeros::<f32>(per_slot * n)?;
            head.copy_range_from(0, &amax, 0, per_slot * n)?;
            head
        } else {
            amax
        };
        let mut weight_amax = dev.zeros::<f32>(n)?;
        adam_commit_amaxes(
            &self.coef,
            &agreed,
            per_slot,
            &mut self.amaxes,
            &mut self.scales,
            low.then_some(&self.write),
            &mut weight_amax,
        )?;
        // New weight scales, then each segment cast in place from its master (or, on a skipped step,
        // from its current codes): no F32 copy of the shards (that copy was 4 bytes per parameter of the
        // whole model at the step's end, the largest transient of a step).
        model.set_fp8_weight_scales(&weight_amax)?;
        for (u, st) in self.units.iter().enumerate() {
            cast_unit_weights(st, model.unit_mut(u)?, &self.coef, &self.scales)?;
        }
        model.zero_grads()?;
        Ok(PendingStepReport {
            report,
            lr,
            max_grad_norm: self.options.max_grad_norm,
        })
    }

    /// [`ShardedAdam::step`], then reads its report (on CUDA this waits for the step).
    pub fn step_with_report(&mut self, model: &mut ShardedModel) -> Result<StepReport, OptimError> {
        self.step(model)?.read()
    }
}

/// Adds the gradient statistics of one unit's shards to `acc` (see `fp8_kernels::reduce::norm_stats`):
/// every FP8 weight segment, its amax into `amax_row.0[amax_row.1 + slot]` when given, then the plain
/// shard.
fn unit_stats(
    st: &UnitStates,
    s: &UnitShards,
    acc: &mut Buffer<f32>,
    mut amax_row: Option<(&mut Buffer<f32>, usize)>,
) -> Result<(), OptimError> {
    for (i, r) in &st.segments {
        let amax = amax_row.as_mut().map(|(b, base)| (&mut **b, *base + i));
        match s.grad(ParamGroup::Fp8) {
            GradShard::F32(g) => norm_stats(g, r.clone(), acc, amax)?,
            GradShard::Bf16(g) => norm_stats(g, r.clone(), acc, amax)?,
        }
    }
    if st.plain_len > 0 {
        match s.grad(ParamGroup::Plain) {
            GradShard::F32(g) => norm_stats(g, 0..st.plain_len, acc, None)?,
            GradShard::Bf16(g) => norm_stats(g, 0..st.plain_len, acc, None)?,
        }
    }
    Ok(())
}

/// The fused updates of one unit: its plain runs, then each FP8 weight segment. `coefs` are the
/// coefficients with and without weight decay; the FP8 segment of slot `i` writes its amaxes at slot
/// `slot_base + i` of `amax` and, for low-precision states, reads its scales at slot `slot_base + i` of
/// `kernel_scales`. Every kernel returns at once on a skipped step.
fn update_unit(
    st: &mut UnitStates,
    s: &mut UnitShards,
    (coef, coef_no_decay): (&Buffer<f32>, &Buffer<f32>),
    kernel_scales: &Buffer<f32>,
    slot_base: usize,
    amax: &mut Buffer<f32>,
    bf16_grads: bool,
) -> Result<(), OptimError> {
    for (decay, r) in &st.plain_runs {
        let (w, m, v) = (&mut s.plain, &mut st.plain_m, &mut st.plain_v);
        let c = if *decay { coef } else { coef_no_decay };
        let r = r.clone();
        if bf16_grads {
            adam_step_f32(
                Coefficients::Device(c),
                r,
                w,
                m,
                v,
                &s.grads_bf16[PLAIN],
                None,
            )?;
        } else {
            adam_step_f32(Coefficients::Device(c), r, w, m, v, &s.grads[PLAIN], None)?;
        }
    }
    match &mut st.fp8 {
        Fp8States::F32 { master, m, v } => {
            for (i, r) in &st.segments {
                let slots = Some(AmaxSlots {
                    buffer: &mut *amax,
                    base: slot_base + i,
                });
                let c = if st.fp8_decay[*i] {
                    coef
                } else {
                    coef_no_decay
                };
                let r = r.clone();
                if bf16_grads {
                    adam_step_f32(
                        Coefficients::Device(c),
                        r,
                        master,
                        m,
                        v,
                        &s.grads_bf16[FP8],
                        slots,
                    )?;
                } else {
                    adam_step_f32(
                        Coefficients::Device(c),
                        r,
                        master,
                        m,
                        v,
                        &s.grads[FP8],
                        slots,
                    )?;
                }
            }
        }
        Fp8States::Low { master, m, v } => {
            for (i, r) in &st.segments {
                let state = LowPrecisionAdamState { master, m, v };
                let base = lp_slot::SCALES * (slot_base + i);
                let slots = AmaxSlots {
                    buffer: &mut *amax,
                    base: lp_slot::AMAXES * (slot_base + i),
                };
                let c = if st.fp8_decay[*i] {
                    coef
                } else {
                    coef_no_decay
                };
                let (r, ks) = (r.clone(), kernel_scales);
                if bf16_grads {
                    let g = &s.grads_bf16[FP8];
                    adam_step_low_precision(Coefficients::Device(c), r, state, g, ks, base, slots)?;
                } else {
                    let g = &s.grads[FP8];
                    adam_step_low_precision(Coefficients::Device(c), r, state, g, ks, base, slots)?;
                }
            }
        }
    }
    Ok(())
}

/// Each FP8 weight segment of one unit cast in place from its master with the unit's new weight scales
/// (on a skipped step from its current codes: the same codes). `scales` are the states' scales
/// (model-wide slots). Block-scaled weights are quantized per 128x128 block of the segment's rows
/// (whole block rows of one weight) instead, their scales written to the unit's block-scale shard: no
/// agreed scale enters.
fn cast_unit_weights(
    st: &UnitStates,
    s: &mut UnitShards,
    coef: &Buffer<f32>,
    scales: &Buffer<f32>,
) -> Result<(), OptimError> {
    for (k, (i, r)) in st.segments.iter().enumerate() {
        if let Some(&(cols, scale_offset)) = st.block_cast.get(k) {
            let source = match &st.fp8 {
                Fp8States::F32 { master, .. } => MasterSource::F32(master),
                Fp8States::Low { master, .. } => MasterSource::F16 {
                    master,
                    scales,
                    slot: st.slot_base + i,
                },
            };
            cast_weight_blocks(
                coef,
                &mut s.fp8,
                r.clone(),
                cols,
                &mut s.block_scales,
                scale_offset,
                source,
            )?;
            continue;
        }
        let source = match &st.fp8 {
            Fp8States::F32 { master, .. } => MasterSource::F32(master),
            Fp8States::Low { master, .. } => MasterSource::F16 {
                master,
                scales,
                slot: st.slot_base + i,
            },
        };
        cast_weight_source(coef, &mut s.fp8, r.clone(), &s.weight_scales, *i, source)?;
    }
    Ok(())
}

macro_rules! adam_face {
    ($name:ident, $mode:expr, $defaults:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug)]
        pub struct $name(ShardedAdam);

        impl $name {
            /// Builds the optimizer for this rank from the model and the F32 master shards of its FP8
            /// groups (as returned by [`ShardedModel::new`]).
            pub fn new(
                model: &ShardedModel,
                fp8_masters: Vec<Vec<f32>>,
                options: AdamOptions,
            ) -> Result<Self, OptimError> {
                Ok($name(ShardedAdam::new(model, fp8_masters, options, $mode)?))
            }

            /// The optimizer with PyTorch's default hyperparameters and low-precision states.
            pub fn with_defaults(
                model: &ShardedModel,
                fp8_masters: Vec<Vec<f32>>,
            ) -> Result<Self, OptimError> {
                Self::new(model, fp8_masters, $defaults)
            }
        }

        impl std::ops::Deref for $name {
            type Target = ShardedAdam;
            fn deref(&self) -> &ShardedAdam {
                &self.0
            }
        }

        impl std::ops::DerefMut for $name {
            fn deref_mut(&mut self) -> &mut ShardedAdam {
                &mut self.0
            }
        }

        impl fsdp_shard::UnitGradsReady for $name {
            fn unit_ready(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), ShardError> {
                self.0.unit_ready(model, u)
            }
        }

        impl ShardedState for $name {
            fn export_state(&self) -> Result<Vec<StateShard>, ShardError> {
                self.0.export_state()
            }
            fn import_state(&mut self, shards: Vec<StateShard>) -> Result<(), ShardError> {
                self.0.import_state(shards)
            }
            fn state_bytes(&self) -> usize {
                self.0.state_bytes()
            }
            fn scalar_state(&self) -> Vec<(String, String)> {
                self.0.scalar_state()
            }
            fn load_scalar_state(&mut self, values: &[(String, String)]) -> Result<(), ShardError> {
                self.0.load_scalar_state(values)
            }
        }
    };
}

adam_face!(
    FsdpAdam,
    WeightDecay::L2,
    AdamOptions::adam(),
    "`torch.optim.Adam` over FSDP shards: weight decay is an L2 penalty added to the gradient."
);
adam_face!(
    FsdpAdamW,
    WeightDecay::Decoupled,
    AdamOptions::adamw(),
    "`torch.optim.AdamW` over FSDP shards: decoupled weight decay (`w *= 1 - lr * weight_decay`)."
);
