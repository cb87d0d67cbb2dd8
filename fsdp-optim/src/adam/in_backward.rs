//! The step taken unit by unit inside the backward ("optimizer in backward"): each unit is updated as
//! soon as its gradients are reduce-scattered, and its gradient shards are freed at once, so (with
//! transient shards, `ShardedModel::set_transient_grads`) no more than one unit's gradient shards exist
//! at a time instead of the whole model's.
//!
//! # The same arithmetic as the whole-model step
//! Per unit, [`ShardedAdam::step_unit`] runs what [`ShardedAdam::step_agreeing`] runs for every unit at
//! once: the statistics and their all-reduce SUM (the unit's non-finite count, sum of squares and, for
//! low-precision states, the per-rank rows of its gradient amaxes), the device-side coefficients and
//! write scales (from a copy of the step counters as they were when the step began, so every unit uses
//! Adam's step `t + 1`), the fused updates, the all-reduce MAX of the unit's new amaxes, the commit and
//! the unit's new FP8 weight scales and casts. Amaxes and scales are per weight and a maximum is exact,
//! so splitting the all-reduces by unit changes no value: with no skipped step the weights, states,
//! scales and step counters are bit for bit those of the whole-model step.
//! [`ShardedAdam::finish_step_in_backward`] does the rest once per step: the agreement of the model's
//! activation metas (after the backward, as the whole-model step), and the step counters from the
//! units' summed statistics.
//!
//! # What does not carry over
//! - **Clipping** by the global gradient norm needs every gradient before any update: refused
//!   ([`ShardedAdam::check_step_in_backward`]).
//! - **Accumulation** over micro-batches needs the gradients to persist across backwards: the model
//!   refuses a hook while gradient sync is off.
//! - **Non-finite gradients**: a unit whose gradients (on any rank) hold a non-finite value, or whose
//!   sum of squares is not finite, skips its own update; the units stepped before it in this backward
//!   are already updated (a partial step). A non-finite loss (the usual divergence), given to
//!   [`ShardedAdam::begin_step_in_backward`], skips every unit: no partial step then (its non-finite
//!   values count once per unit in the reported count). The step then counts as skipped (its counters stay, its
//!   report says `skipped`), so a training loop's limit on consecutive skipped steps applies as before.
//!   Units that did update took Adam's step `t + 1`; with the counter unchanged they take `t + 1` again
//!   next step (a bias correction one step behind, which fades with `t`). The one case where a step is
//!   reported skipped though no unit skipped: every unit's sum of squares finite but their f32 sum not
//!   (a gradient norm beyond 1.8e19).
//! - The reported gradient norm is the square root of the units' summed f32 sums of squares: equal to
//!   the whole-model one up to the rounding of that sum.

use super::*;
use fp8_kernels::elementwise::axpy;
use fp8_kernels::reduce::{finite_amax_count, norm_stats_take_count};

/// A step begun in the backward and not yet finished.
#[derive(Debug)]
pub(super) struct StepInBackward {
    /// Learning rate of the step (the schedule's when it began).
    lr: f64,
    /// Whether each unit was stepped.
    stepped: Vec<bool>,
    /// `[non-finite count, sum of squares]` of the units stepped so far, over all ranks.
    totals: Buffer<f32>,
    /// Non-finite values of this rank's loss (when given): added to every unit's count, so a non-finite
    /// loss on any rank skips every unit.
    loss_nonfinite: Option<Buffer<u32>>,
}

/// The words `offset..offset + len` of `src` in a buffer of their own.
fn cut(src: &Buffer<f32>, offset: usize, len: usize) -> Result<Buffer<f32>, OptimError> {
    let mut out = src.device().zeros::<f32>(len)?;
    if len > 0 {
        out.copy_range_from(0, src, offset, len)?;
    }
    Ok(out)
}

impl ShardedAdam {
    /// Whether this optimizer can step inside the backward, unit by unit: an error naming what
    /// prevents it (gradient clipping by the global norm needs every gradient before any update).
    pub fn check_step_in_backward(&self) -> Result<(), OptimError> {
        if let Some(max) = self.options.max_grad_norm {
            return Err(OptimError::Unsupported(format!(
                "gradient clipping (max_grad_norm {max}) scales every update by the global gradient \
                 norm, known only once every unit's gradients are reduced; a step in the backward \
                 updates each unit as soon as its own are (drop the clipping or step after the \
                 backward)"
            )));
        }
        Ok(())
    }

    /// Whether a step begun in the backward is waiting for [`ShardedAdam::finish_step_in_backward`].
    pub fn step_in_backward_pending(&self) -> bool {
        self.in_backward.is_some()
    }

    /// Begins a step taken unit by unit in the backward (see the module docs): fixes its learning rate
    /// (the schedule's now). `loss`, this rank's loss of the forward whose backward follows (its
    /// elements are checked, on the device): when one is not finite on any rank, every unit skips, so a
    /// diverged loss skips the whole step as the step after the backward would, with no unit updated.
    /// [`ShardedAdam::step_unit`] begins a step itself (without a loss) when none is.
    pub fn begin_step_in_backward(
        &mut self,
        model: &ShardedModel,
        loss: Option<&Buffer<f32>>,
    ) -> Result<(), OptimError> {
        self.check_step_in_backward()?;
        self.check_model(model)?;
        if self.in_backward.is_some() {
            return Err(mismatch(
                "a step in the backward is already begun: finish it first".into(),
            ));
        }
        let loss_nonfinite = match loss {
            Some(l) => {
                let mut count = self.device.zeros::<u32>(1)?;
                let mut amax = self.device.zeros::<f32>(1)?;
                finite_amax_count(l, &mut amax, &mut count)?;
                Some(count)
            }
            None => None,
        };
        self.in_backward = Some(StepInBackward {
            lr: self.current_lr(),
            stepped: vec![false; self.units.len()],
            totals: self.device.zeros(2)?,
            loss_nonfinite,
        });
        Ok(())
    }

    /// Steps unit `u` from its reduced gradient shards, then clears them (frees transient shards): the
    /// update of the unit's parameters, its new FP8 weights and scales (collective: every rank calls it
    /// for the same units in the same order, e.g. from `FsdpModel`'s hook on reduced gradients). Begins
    /// a step in the backward when none is. Each unit is stepped at most once per step.
    pub fn step_unit(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), OptimError> {
        if self.in_backward.is_none() {
            self.begin_step_in_backward(model, None)?;
        }
        let (lr, done) = match &self.in_backward {
            Some(s) => (s.lr, s.stepped.get(u).copied()),
            None => return Err(mismatch("no step in the backward".into())),
        };
        match done {
            None => {
                return Err(mismatch(format!(
                    "no unit {u}: the model has {}",
                    self.units.len()
                )))
            }
            Some(true) => {
                return Err(mismatch(format!(
                    "unit {u} was already stepped in this step (one backward per step when the \
                     optimizer steps in the backward)"
                )))
            }
            Some(false) => {}
        }
        {
            let s = model.unit(u)?;
            let st = &self.units[u];
            if s.fp8.len() != st.fp8_len || s.plain.len() != st.plain_len {
                return Err(mismatch(format!("unit {u}: shard sizes changed")));
            }
        }
        model.ensure_grad_shards(u)?;
        let low = self.options.state_precision == StatePrecision::LowPrecision;
        let (rank, ws) = (self.rank, self.world_size);
        let dev = self.device.clone();
        let (k, base) = (self.units[u].params.len(), self.units[u].slot_base);

        // 1. The unit's statistics and their all-reduce SUM (the whole-model step's layout for one unit).
        let mut sums = dev.zeros::<f32>(2 + if low { ws * k } else { 0 })?;
        let amax_row = low.then_some((&mut sums, 2 + rank * k));
        unit_stats(
            &self.units[u],
            model.unit(u)?,
            &mut self.stats_acc,
            amax_row,
        )?;
        model.take_nonfinite_before_cast_into(&mut self.stats_acc)?;
        if let Some(bad) = self
            .in_backward
            .as_ref()
            .and_then(|s| s.loss_nonfinite.as_ref())
        {
            let mut count = dev.zeros::<u32>(1)?;
            count.copy_from(bad)?;
            norm_stats_take_count(&mut self.stats_acc, &mut count)?;
        }
        norm_stats_finish(&mut self.stats_acc, 0, &mut sums)?;
        model
            .comm()
            .all_reduce_in_place((&mut sums).into(), ReduceOp::Sum)?;
        if let Some(step) = self.in_backward.as_mut() {
            axpy(1.0, &cut(&sums, 0, 2)?, &mut step.totals)?;
        }

        // 2. Skip or go and the coefficients of step t + 1, from a copy of the counters as the step
        //    began; for low-precision states the unit's write scales, in buffers of its own slots.
        let params = policy::control_params(&self.options, lr, self.decay_mode, low, k, ws);
        let mut counters = dev.zeros::<f32>(ctl::LEN)?;
        counters.copy_from(&self.control)?;
        let mut unit_report = dev.zeros::<f32>(ctl::LEN)?;
        let mut amaxes = cut(&self.amaxes, 3 * base, 3 * k)?;
        let mut scales = cut(&self.scales, 3 * base, 3 * k)?;
        let mut write = dev.zeros::<f32>(if low { 3 * k } else { 0 })?;
        let mut kernel_scales = dev.zeros::<f32>(if low { lp_slot::SCALES * k } else { 0 })?;
        let slot_scales = low.then_some(SlotScales {
            amaxes: &amaxes,
            scales: &scales,
            write: &mut write,
            kernel_scales: &mut kernel_scales,
        });
        adam_coefficients_from_stats(
            &params,
            &sums,
            &mut counters,
            &mut self.coef,
            slot_scales,
            &mut unit_report,
        )?;
        let st = &self.units[u];
        if self.options.weight_decay != 0.0
            && (st.fp8_decay.iter().any(|d| !d) || st.plain_runs.iter().any(|(d, _)| !d))
        {
            self.coef_no_decay.copy_from(&self.coef)?;
            self.coef_no_decay
                .copy_range_from(COEF_L2_WORD, &self.zero_flags, 0, 2)?;
        }

        // 3. The fused updates (they return at once when this unit skips).
        let per_slot = if low { lp_slot::AMAXES } else { 1 };
        let mut amax = dev.zeros::<f32>(per_slot * k)?;
        let bf16_grads = model.config().grad_dtype == GradDtype::Bf16;
        let coefs = (&self.coef, &self.coef_no_decay);
        let s = model.unit_mut(u)?;
        update_unit(
            &mut self.units[u],
            s,
            coefs,
            &kernel_scales,
            0,
            &mut amax,
            bf16_grads,
        )?;

        // 4. The all-reduce MAX of the unit's amaxes, the commit into the model-wide slots, the unit's
        //    new weight scales and casts.
        if k > 0 {
            model
                .comm()
                .all_reduce_in_place((&mut amax).into(), ReduceOp::Max)?;
            let mut weight_amax = dev.zeros::<f32>(k)?;
            adam_commit_amaxes(
                &self.coef,
                &amax,
                per_slot,
                &mut amaxes,
                &mut scales,
                low.then_some(&write),
                &mut weight_amax,
            )?;
            self.amaxes.copy_range_from(3 * base, &amaxes, 0, 3 * k)?;
            self.scales.copy_range_from(3 * base, &scales, 0, 3 * k)?;
            model.set_unit_fp8_weight_scales(u, &weight_amax)?;
            cast_unit_weights(&self.units[u], model.unit_mut(u)?, &self.coef, &self.scales)?;
        }
        model.clear_unit_grads(u)?;
        if let Some(step) = self.in_backward.as_mut() {
            step.stepped[u] = true;
        }
        Ok(())
    }

    /// Finishes the step begun in the backward (collective): steps the units the backward did not hand
    /// over, agrees the model's activation and output-gradient metas (`scaling`: one all-reduce MAX of
    /// their pending amaxes, as [`ShardedAdam::step_agreeing`] does) and moves the step counters from
    /// the units' summed statistics: a step any unit skipped counts as skipped (see the module docs).
    /// Queued on the device; the returned report reads the step's counters on demand.
    pub fn finish_step_in_backward(
        &mut self,
        model: &mut ShardedModel,
        scaling: Option<&mut ScalingRegistry>,
    ) -> Result<PendingStepReport, OptimError> {
        let stepped = match &self.in_backward {
            Some(s) => s.stepped.clone(),
            None => {
                return Err(mismatch(
                    "no step was begun in the backward (the model's hook on reduced gradients \
                     was not called)"
                        .into(),
                ))
            }
        };
        for (u, done) in stepped.into_iter().enumerate() {
            if !done {
                self.step_unit(model, u)?;
            }
        }
        let step = self
            .in_backward
            .take()
            .ok_or_else(|| mismatch("the step in the backward vanished".into()))?;
        let dev = self.device.clone();
        if let Some(reg) = scaling {
            let mut agreed = cut(reg.pending(), 0, reg.len())?;
            if !reg.is_empty() {
                model
                    .comm()
                    .all_reduce_in_place((&mut agreed).into(), ReduceOp::Max)?;
            }
            reg.update_from(&agreed, 0)?;
        }
        // The counters as the whole-model step moves them: skipped when any unit saw a non-finite
        // gradient or a non-finite sum of squares (either makes the totals say so).
        let params = policy::control_params(&self.options, step.lr, self.decay_mode, false, 0, 1);
        let mut report = dev.zeros::<f32>(ctl::LEN)?;
        let mut unused = dev.zeros::<f32>(COEF_LEN)?;
        adam_coefficients_from_stats(
            &params,
            &step.totals,
            &mut self.control,
            &mut unused,
            None,
            &mut report,
        )?;
        Ok(PendingStepReport {
            report,
            lr: step.lr,
            max_grad_norm: None,
        })
    }

    /// Drops a step begun in the backward without finishing it (after a failed backward: the units
    /// stepped so far keep their update, the counters do not move).
    pub fn abandon_step_in_backward(&mut self) {
        self.in_backward = None;
    }
}

impl fsdp_shard::UnitGradsReady for ShardedAdam {
    fn unit_ready(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), ShardError> {
        self.step_unit(model, u).map_err(|e| unit_step_error(u, e))
    }
}

/// An error of the step of unit `u` in the backward, as the model's error.
pub(crate) fn unit_step_error(u: usize, e: OptimError) -> ShardError {
    match e {
        OptimError::Shard(s) => s,
        OptimError::Kernel(k) => ShardError::Kernel(k),
        OptimError::Comm(c) => ShardError::Comm(c),
        other => ShardError::State(format!(
            "the optimizer step of unit {u} in the backward: {other}"
        )),
    }
}
