//! Device-side control of an Adam step, so that a step on the GPU never waits for the host.
//!
//! A step runs, on either device:
//! 1. [`crate::reduce::norm_stats`] over every gradient range and [`crate::reduce::norm_stats_finish`]
//!    into `sums = [non-finite count, sum of squares, per-rank rows of gradient amaxes]`, which the caller
//!    all-reduces with SUM;
//! 2. [`adam_coefficients_from_stats`]: the skip decision (any non-finite gradient, or a non-finite norm),
//!    the clipping factor, Adam's coefficients of the next step and, for low-precision states, the write
//!    scales of the new states (the bound rule of [`state_bounds`] with the caller's [`StateScaleRule`]),
//!    all from the reduced `sums` and the control buffer (step counters) on the device;
//! 3. the fused updates of [`crate::adam`] with [`Coefficients::Device`](super::Coefficients::Device):
//!    they return at once when the step is skipped, so a skipped step leaves weights and states untouched;
//! 4. after the caller's all-reduce MAX of the amaxes, [`adam_commit_amaxes`] (agreed amaxes, new scales,
//!    the weights' amax vector: zeros when skipped, which keeps every weight's scale), then
//!    [`cast_weight_source`] (each FP8 weight cast in place from its master; on a skipped step from its
//!    current codes, decoded, which gives the same codes back) or [`weight_source_values`] (the F32
//!    values themselves); block-scaled weights are cast by [`cast_weight_blocks`] instead (below).
//!
//! # Block-scaled weights
//! A 128x128 block-scaled FP8 weight (DeepSeek-V3's recipe: one F32 scale per 128x128 block of the
//! row-major `[out, in]` weight) needs no agreed amax: each block's scale comes from the block's own new
//! values. Under FSDP a rank's shard of such a weight is whole block rows (its boundaries fall on
//! multiples of 128 rows), so [`cast_weight_blocks`] casts the rank's rows from its master shard alone,
//! right after the update, with no collective: the amax of each block, its power-of-two scale and the
//! codes, exactly as [`block_quantize`](crate::block_quantize::block_quantize) with
//! [`BlockQuantLayout::Blocks128x128`], E4M3 and [`ScaleOrder::Gemm`] casts the decoded master values of
//! the piece (the same code on both devices: `blocks128.cuh` on CUDA, the block cast's CPU loop here).
//! The inverse scales are written in the block-scaled GEMM's order, block `(i, j)` of the piece at
//! `scale_offset + i * ld + j` with `ld = round_up(ceil(in / 128), 4)`, so the pieces of a weight held
//! by different ranks, placed at their block-row offsets, are the whole weight's
//! [`block_quantize`](crate::block_quantize::block_quantize) output, codes and scales bit for bit.
//! On a skipped step nothing is written: the codes and scales of the previous step stay (per-tensor
//! weights re-encode their codes instead, which gives the same codes).
//!
//! The control arithmetic is f64 with each operation rounded once, powers by squaring, in the same order
//! on both devices, so CPU and CUDA derive bit-identical coefficients and scales; the sum of squares
//! alone is summed in a different order on the GPU (it only moves the clipping factor). The choices in it
//! (clipping, headroom of the state scales) are parameters ([`AdamControlParams`]); `fsdp-optim`'s
//! `policy` module sets them.
//!
//! Buffers: the control buffer has [`ctl::LEN`] f32 words (counters as `u32` bits), the coefficient
//! buffer [`COEF_LEN`] words ([`AdamCoefficients`] and the skip flag).

use super::{cpu, cuda, lp_slot, AdamCoefficients, AdamConfig};
use crate::block_quantize::{self, check_sides, BlockQuantLayout, ScaleOrder};
use crate::{Buffer, Device, KernelError};
use half::f16;
use std::ops::Range;

pub use super::cpu::{scale_from_bound, state_bounds, state_write_scales, update_ratio_bound};

/// Word offsets of the control buffer.
pub mod ctl {
    /// Adam's step count (successful steps), `u32` bits.
    pub const STEP: usize = 0;
    /// Skipped steps so far, `u32` bits.
    pub const SKIP_COUNT: usize = 1;
    /// 1.0 when the last step was skipped.
    pub const LAST_SKIP: usize = 2;
    /// Non-finite gradient values of the last step (all ranks).
    pub const LAST_NONFINITE: usize = 3;
    /// Sum of squared gradients of the last step (all ranks), f32.
    pub const LAST_SUMSQ: usize = 4;
    /// Length of the control buffer.
    pub const LEN: usize = 8;
}

/// Words of the coefficient buffer: the 14 words of [`AdamCoefficients`] and the skip flag.
pub const COEF_LEN: usize = 16;
/// Word of the coefficient buffer holding the skip flag (nonzero: skip).
pub const COEF_SKIP: usize = 14;

/// How [`adam_coefficients_from_stats`] bounds the new low-precision states to choose their write scales
/// before they are computed: bound each new state from the agreed amaxes after the previous step and this
/// step's gradient amax ([`state_bounds`]), then take the power-of-two scale that fits the bound with
/// `margins` binades of headroom.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateScaleRule {
    /// Binades of headroom: F16 master, E4M3 first moment, F16 second moment (each in
    /// `0..=fp8_core::MAX_MARGIN`).
    pub margins: [i32; 3],
    /// Every bound is multiplied by this (room for the rounding of the arithmetic), finite and > 0.
    pub slack: f64,
    /// Multiplies the Cauchy-Schwarz bound of `|m / denom|` (room for the rounding of the stored states),
    /// finite and > 0.
    pub ratio_factor: f64,
}

/// The parameters of [`adam_coefficients_from_stats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamControlParams {
    /// The hyperparameters, with this step's learning rate.
    pub adam: AdamConfig,
    /// Clip the global gradient norm to this value (`None`: no clipping): the gradient factor is
    /// `min(1, max_grad_norm / (norm + clip_eps))`.
    pub max_grad_norm: Option<f64>,
    /// Added to the norm in the clipping factor, finite and >= 0.
    pub clip_eps: f64,
    /// `Some` for low-precision states: their write scales are computed with this rule. `None` for F32
    /// states.
    pub state_scales: Option<StateScaleRule>,
    /// Slots (FP8 weights, numbered model-wide).
    pub slots: usize,
    /// Ranks: rows of per-slot gradient amaxes in the reduced statistics (low precision only).
    pub world_size: usize,
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

impl AdamControlParams {
    /// Checks every value (see the field docs).
    pub fn validate(&self) -> Result<(), KernelError> {
        const WHAT: &str = "adam_coefficients_from_stats";
        self.adam.validate()?;
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(bad(
                    WHAT,
                    format!("max_grad_norm {n} must be finite and > 0"),
                ));
            }
        }
        if !(self.clip_eps.is_finite() && self.clip_eps >= 0.0) {
            return Err(bad(
                WHAT,
                format!("clip_eps {} must be finite and >= 0", self.clip_eps),
            ));
        }
        if let Some(r) = &self.state_scales {
            if let Some(&m) = r
                .margins
                .iter()
                .find(|m| !(0..=fp8_core::MAX_MARGIN).contains(*m))
            {
                return Err(fp8_core::Fp8Error::InvalidMargin(m).into());
            }
            for (name, v) in [("slack", r.slack), ("ratio_factor", r.ratio_factor)] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(bad(WHAT, format!("{name} {v} must be finite and > 0")));
                }
            }
        }
        Ok(())
    }

    /// Words of the reduced statistics the call reads: 2, plus `world_size * slots` gradient amaxes for
    /// low-precision states.
    pub fn sums_len(&self) -> usize {
        2 + if self.state_scales.is_some() {
            self.world_size * self.slots
        } else {
            0
        }
    }
}

/// The coefficients and the skip flag held in a coefficient buffer's words.
pub(super) fn coefficient_words(words: &[f32]) -> (AdamCoefficients, bool) {
    let i = |k: usize| words[k].to_bits() as i32;
    let c = AdamCoefficients {
        beta1: words[0],
        one_minus_beta1: words[1],
        beta2: words[2],
        one_minus_beta2: words[3],
        step_size: words[4],
        bc2_sqrt: words[5],
        eps: words[6],
        weight_decay: words[7],
        decay: words[8],
        grad_scale: words[9],
        maximize: i(10),
        l2: i(11),
        decoupled: i(12),
        pad: i(13),
    };
    (c, words[COEF_SKIP] != 0.0)
}

/// The first 14 words of a coefficient buffer holding `c`.
pub(super) fn words_of(c: &AdamCoefficients) -> [f32; 14] {
    let f = |x: i32| f32::from_bits(x as u32);
    [
        c.beta1,
        c.one_minus_beta1,
        c.beta2,
        c.one_minus_beta2,
        c.step_size,
        c.bc2_sqrt,
        c.eps,
        c.weight_decay,
        c.decay,
        c.grad_scale,
        f(c.maximize),
        f(c.l2),
        f(c.decoupled),
        f(c.pad),
    ]
}

/// The coefficients of a coefficient buffer and whether it says "skipped" (reads the device: for tests
/// and reports).
pub fn coefficients_of(coef: &Buffer<f32>) -> Result<(AdamCoefficients, bool), KernelError> {
    let w = coef.to_vec()?;
    if w.len() != COEF_LEN {
        return Err(bad(
            "coefficients_of",
            format!("{} words, expected {COEF_LEN}", w.len()),
        ));
    }
    Ok(coefficient_words(&w))
}

fn check(what: &'static str, len: usize, need: usize) -> Result<(), KernelError> {
    if len < need {
        return Err(bad(what, format!("buffer of {len} words, need {need}")));
    }
    Ok(())
}

fn check_range(what: &'static str, r: &Range<usize>, len: usize) -> Result<(), KernelError> {
    if r.start > r.end || r.end > len {
        return Err(bad(what, format!("range {r:?} outside a buffer of {len}")));
    }
    Ok(())
}

/// An error unless every buffer lives on `device`.
fn on_device(what: &'static str, device: &Device, others: &[Device]) -> Result<(), KernelError> {
    if others.iter().all(|d| d == device) {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

/// Per-slot state-scale buffers of low-precision states: agreed amaxes and current scales (3 per slot:
/// master, first, second moment), the write scales of this step (3 per slot) and the fused kernel's
/// scale table (`lp_slot::SCALES` per slot, model-wide slot numbering).
#[derive(Debug)]
pub struct SlotScales<'a> {
    /// Agreed amaxes after the previous step.
    pub amaxes: &'a Buffer<f32>,
    /// Scales the stored states belong to.
    pub scales: &'a Buffer<f32>,
    /// Output: this step's write scales.
    pub write: &'a mut Buffer<f32>,
    /// Output: read (old inverse) and write scales in the kernel's layout.
    pub kernel_scales: &'a mut Buffer<f32>,
}

/// The control step (see the module docs): from the all-reduced `sums` decides skip or go, updates the
/// counters in `ctl_buf`, writes the coefficients of the next step and the skip flag into `coef` and, for
/// low-precision states (`p.state_scales`), the write scales into `slots`; `report` receives a copy of
/// `ctl_buf` after the update.
pub fn adam_coefficients_from_stats(
    p: &AdamControlParams,
    sums: &Buffer<f32>,
    ctl_buf: &mut Buffer<f32>,
    coef: &mut Buffer<f32>,
    slots: Option<SlotScales<'_>>,
    report: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "adam_coefficients_from_stats";
    p.validate()?;
    let n = p.slots;
    check(what, sums.len(), p.sums_len())?;
    check(what, ctl_buf.len(), ctl::LEN)?;
    check(what, coef.len(), COEF_LEN)?;
    check(what, report.len(), ctl::LEN)?;
    let device = sums.device();
    on_device(
        what,
        &device,
        &[ctl_buf.device(), coef.device(), report.device()],
    )?;
    let slots = match (&p.state_scales, slots) {
        (Some(_), None) => {
            return Err(bad(what, "low-precision states need slot scales".into()));
        }
        (Some(_), Some(s)) => {
            check(what, s.amaxes.len(), 3 * n)?;
            check(what, s.scales.len(), 3 * n)?;
            check(what, s.write.len(), 3 * n)?;
            check(what, s.kernel_scales.len(), lp_slot::SCALES * n)?;
            let devices = [
                s.amaxes.device(),
                s.scales.device(),
                s.write.device(),
                s.kernel_scales.device(),
            ];
            on_device(what, &device, &devices)?;
            Some(s)
        }
        // F32 states: slot scales, if given, are not touched.
        (None, _) => None,
    };
    match device {
        Device::Cpu => {
            let host_slots = match slots {
                Some(s) => Some(cpu::HostSlotScales {
                    amaxes: s.amaxes.host(what)?,
                    scales: s.scales.host(what)?,
                    write: s.write.host_mut(what)?,
                    kernel_scales: s.kernel_scales.host_mut(what)?,
                }),
                None => None,
            };
            let c = ctl_buf.host_mut(what)?;
            cpu::coefficients_from_stats(p, sums.host(what)?, c, coef.host_mut(what)?, host_slots);
            report.host_mut(what)?[..ctl::LEN].copy_from_slice(&c[..ctl::LEN]);
            Ok(())
        }
        Device::Cuda(dev) => {
            cuda::coefficients_from_stats(&dev, p, sums, ctl_buf, coef, slots, report)
        }
    }
}

/// After the all-reduce MAX of the amax vector `agreed` (`per_slot` values per slot: 1 for F32 states,
/// 3 for low precision): unless skipped, `amaxes[3i..3i+3] = agreed` (zero-filled), `scales = write`
/// (when given) and `weight_amax[i] = agreed[per_slot * i]`; when skipped `weight_amax` is zeroed (which
/// keeps every FP8 weight's scale) and nothing else changes.
pub fn adam_commit_amaxes(
    coef: &Buffer<f32>,
    agreed: &Buffer<f32>,
    per_slot: usize,
    amaxes: &mut Buffer<f32>,
    scales: &mut Buffer<f32>,
    write: Option<&Buffer<f32>>,
    weight_amax: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "adam_commit_amaxes";
    let n = weight_amax.len();
    if !(1..=3).contains(&per_slot) {
        return Err(bad(what, format!("{per_slot} amaxes per slot")));
    }
    check(what, coef.len(), COEF_LEN)?;
    check(what, agreed.len(), per_slot * n)?;
    check(what, amaxes.len(), 3 * n)?;
    check(what, scales.len(), 3 * n)?;
    if let Some(w) = write {
        check(what, w.len(), 3 * n)?;
    }
    let device = coef.device();
    let mut devices = vec![agreed.device(), amaxes.device(), scales.device()];
    devices.extend(write.map(Buffer::device));
    devices.push(weight_amax.device());
    on_device(what, &device, &devices)?;
    match device {
        Device::Cpu => {
            let (_, skip) = coefficient_words(coef.host(what)?);
            let write = write.map(|w| w.host(what)).transpose()?;
            cpu::commit_amaxes(
                skip,
                agreed.host(what)?,
                per_slot,
                amaxes.host_mut(what)?,
                scales.host_mut(what)?,
                write,
                weight_amax.host_mut(what)?,
            );
            Ok(())
        }
        Device::Cuda(dev) => cuda::commit_amaxes(
            &dev,
            coef,
            agreed,
            per_slot,
            amaxes,
            scales,
            write,
            weight_amax,
        ),
    }
}

/// The master a FP8 weight segment is cast from.
#[derive(Debug, Clone, Copy)]
pub enum MasterSource<'a> {
    /// F32 master values.
    F32(&'a Buffer<f32>),
    /// F16 stored master with the state scales (3 per slot; the master's at `3 * slot`).
    F16 {
        /// Stored master.
        master: &'a Buffer<f16>,
        /// State scales.
        scales: &'a Buffer<f32>,
        /// Model-wide slot of the segment.
        slot: usize,
    },
}

impl MasterSource<'_> {
    /// An error unless the master covers `range` (and, for F16, its slot's scale exists) on `device`.
    fn check(
        &self,
        what: &'static str,
        range: &Range<usize>,
        device: &Device,
    ) -> Result<(), KernelError> {
        match *self {
            MasterSource::F32(m) => {
                check_range(what, range, m.len())?;
                on_device(what, device, &[m.device()])
            }
            MasterSource::F16 {
                master,
                scales,
                slot,
            } => {
                check_range(what, range, master.len())?;
                check(what, scales.len(), 3 * slot + 3)?;
                on_device(what, device, &[master.device(), scales.device()])
            }
        }
    }

    /// The host slices of the source (CPU paths).
    fn host(&self, what: &'static str) -> Result<cpu::HostSource<'_>, KernelError> {
        Ok(match *self {
            MasterSource::F32(m) => cpu::HostSource::F32(m.host(what)?),
            MasterSource::F16 {
                master,
                scales,
                slot,
            } => cpu::HostSource::F16 {
                master: master.host(what)?,
                scale: scales.host(what)?[3 * slot],
            },
        })
    }
}

/// Writes `out[range]`, the F32 values FP8 weight segment `range` is cast from: the master (F32, or F16
/// times `1 / scale`), or on a skipped step the current weight `decode(fp8) * weight_scales[2 * wslot +
/// 1]`.
pub fn weight_source_values(
    coef: &Buffer<f32>,
    out: &mut Buffer<f32>,
    range: Range<usize>,
    fp8: &Buffer<u8>,
    weight_scales: &Buffer<f32>,
    wslot: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "weight_source_values";
    check(what, coef.len(), COEF_LEN)?;
    check_range(what, &range, out.len())?;
    check_range(what, &range, fp8.len())?;
    check(what, weight_scales.len(), 2 * wslot + 2)?;
    let device = coef.device();
    source.check(what, &range, &device)?;
    on_device(
        what,
        &device,
        &[out.device(), fp8.device(), weight_scales.device()],
    )?;
    match device {
        Device::Cpu => {
            let (_, skip) = coefficient_words(coef.host(what)?);
            let si = weight_scales.host(what)?[2 * wslot + 1];
            let q = &fp8.host(what)?[range.clone()];
            let src = source.host(what)?;
            cpu::weight_source_values(
                skip,
                &mut out.host_mut(what)?[range.clone()],
                q,
                si,
                src,
                range,
            );
            Ok(())
        }
        Device::Cuda(dev) => {
            cuda::weight_source_values(&dev, coef, out, range, fp8, weight_scales, wslot, source)
        }
    }
}

/// [`weight_source_values`] fused with the weight cast, in place: `fp8[i] = encode_e4m3(x_i *
/// weight_scales[2 * wslot])` for `i` in `range`, where `x_i` is what [`weight_source_values`] writes
/// (reading `weight_scales[2 * wslot + 1]` on a skipped step). Call it after the new scales are in
/// `weight_scales`: on a skipped step the weight's amax is 0, which keeps its scale pair, so the codes are
/// bit-identical to [`weight_source_values`] (before the scale update) followed by
/// [`crate::segmented::segmented_cast`] (after it), without an F32 copy of the whole buffer between them.
pub fn cast_weight_source(
    coef: &Buffer<f32>,
    fp8: &mut Buffer<u8>,
    range: Range<usize>,
    weight_scales: &Buffer<f32>,
    wslot: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "cast_weight_source";
    check(what, coef.len(), COEF_LEN)?;
    check_range(what, &range, fp8.len())?;
    check(what, weight_scales.len(), 2 * wslot + 2)?;
    let device = coef.device();
    source.check(what, &range, &device)?;
    on_device(what, &device, &[fp8.device(), weight_scales.device()])?;
    match device {
        Device::Cpu => {
            let (_, skip) = coefficient_words(coef.host(what)?);
            let ws = weight_scales.host(what)?;
            let pair = (ws[2 * wslot], ws[2 * wslot + 1]);
            let src = source.host(what)?;
            cpu::cast_weight_source(
                skip,
                &mut fp8.host_mut(what)?[range.clone()],
                pair,
                src,
                range,
            );
            Ok(())
        }
        Device::Cuda(dev) => {
            cuda::cast_weight_source(&dev, coef, fp8, range, weight_scales, wslot, source)
        }
    }
}

/// The block-scaled counterpart of [`cast_weight_source`]: casts one piece of a 128x128 block-scaled FP8
/// weight from its master, computing the blocks' scales from the new values themselves (see the module
/// docs, "Block-scaled weights").
///
/// `codes[range]` holds `rows_here = range.len() / cols` whole rows of a row-major weight of `cols`
/// columns (its `in_features`), starting at a block-row boundary of the weight; the master values
/// `x = source[range]` (F32, or F16 times `1 / scale` as [`weight_source_values`] decodes them) seen as a
/// `[rows_here, cols]` matrix are cast exactly as [`block_quantize`](crate::block_quantize::block_quantize)
/// with [`BlockQuantLayout::Blocks128x128`], E4M3, power-of-two scales and [`ScaleOrder::Gemm`] casts them:
/// the codes go to `codes[range]` and block `(i, j)`'s inverse scale to
/// `scale_inv[scale_offset + i * ld + j]`, `ld = round_up(ceil(cols / 128), 4)` (the padding entries
/// `j >= ceil(cols / 128)` are not written; the scales themselves are not kept). On a skipped step
/// (the skip flag of `coef`, read on the device) nothing is written.
///
/// Errors unless `cols > 0`, `range.len()` is a multiple of `cols`, `range` lies in `codes` and in the
/// master, the F16 master's slot scale exists, `scale_offset + (ceil(rows_here / 128) - 1) * ld +
/// ceil(cols / 128) <= scale_inv.len()` (`scale_offset <= scale_inv.len()` when `range` is empty),
/// `rows_here` and `cols` fit the kernels' 32-bit indices, and every buffer is on `coef`'s device, on
/// either device alike. On CUDA the cast runs on the compute stream with no host round trip.
pub fn cast_weight_blocks(
    coef: &Buffer<f32>,
    codes: &mut Buffer<u8>,
    range: Range<usize>,
    cols: usize,
    scale_inv: &mut Buffer<f32>,
    scale_offset: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "cast_weight_blocks";
    check(what, coef.len(), COEF_LEN)?;
    check_range(what, &range, codes.len())?;
    if cols == 0 || range.len() % cols != 0 {
        return Err(bad(
            what,
            format!(
                "range {range:?} ({} elements) is not whole rows of {cols} columns",
                range.len()
            ),
        ));
    }
    let rows = range.len() / cols;
    check_sides(what, &[rows, cols])?;
    let layout = BlockQuantLayout::Blocks128x128.output_layout(rows, cols)?;
    // Block (i, j) at i * ld + j: the GEMM order of 128x128 scales.
    let ld = ScaleOrder::Gemm.strides(&layout)?.row;
    let [grid_rows, grid_cols] = layout.grid();
    // One past the last scale written: the last block row's last real block (its padding is not written).
    let scale_end = match grid_rows {
        0 => Some(scale_offset),
        _ => (grid_rows - 1)
            .checked_mul(ld)
            .and_then(|x| x.checked_add(grid_cols))
            .and_then(|x| x.checked_add(scale_offset)),
    };
    let scale_end = match scale_end {
        Some(end) if end <= scale_inv.len() => end,
        _ => {
            return Err(bad(
                what,
                format!(
                    "{grid_rows} x {grid_cols} block scales (rows of {ld}) from {scale_offset} do not fit \
                     a scale buffer of {}",
                    scale_inv.len()
                ),
            ))
        }
    };
    let device = coef.device();
    source.check(what, &range, &device)?;
    on_device(what, &device, &[codes.device(), scale_inv.device()])?;
    match device {
        Device::Cpu => {
            let (_, skip) = coefficient_words(coef.host(what)?);
            if skip {
                return Ok(());
            }
            let values = cpu::master_values(source.host(what)?, range.clone());
            block_quantize::blocks128_e4m3_host(
                &values,
                [rows, cols],
                &mut codes.host_mut(what)?[range],
                &mut scale_inv.host_mut(what)?[scale_offset..scale_end],
                ld,
            )
        }
        Device::Cuda(dev) => cuda::cast_weight_blocks(
            &dev,
            coef,
            codes,
            range,
            [rows, cols],
            scale_inv,
            scale_offset,
            ld,
            source,
        ),
    }
}
