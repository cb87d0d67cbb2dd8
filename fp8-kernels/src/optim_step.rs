//! Device-side control of a sharded Adam step, so that a step on the GPU never waits for the host.
//!
//! A step of `fsdp-optim` runs, on either device:
//! 1. [`grad_stats`] over every gradient range (sum of squares in f64, non-finite count, per-weight amax)
//!    into an accumulator, then [`grad_stats_finish`] into the vector `sums = [non-finite count, sum of
//!    squares, per-rank rows of gradient amaxes]` that the caller all-reduces with SUM;
//! 2. [`step_control`]: the skip decision, the clipping factor, Adam's coefficients of the next step and
//!    the write scales of low-precision states (the bound rule of [`state_write_scales`]), all from the
//!    reduced `sums` and the control buffer (step counters) on the device;
//! 3. [`adam_step_f32_ctl`] / [`adam_step_low_precision_ctl`]: the fused updates of [`crate::adam`] with
//!    the coefficients read from the device; they return at once when the step is skipped, so a skipped
//!    step leaves weights and states untouched (a zero learning rate would not: Adam's moments still move);
//! 4. after the caller's all-reduce MAX of the amaxes, [`step_finish`] (agreed amaxes, new scales, the
//!    weights' amax vector: zeros when skipped, which keeps every weight's scale), and [`apply_source`]
//!    (the F32 values the FP8 weights are cast from: on a skipped step the current weights decoded, whose
//!    cast with the kept power-of-two scale gives the same codes back).
//!
//! The control arithmetic is f64 with each operation rounded once, powers by squaring ([`powi_sq`]), in
//! the same order on both devices, so CPU and CUDA derive bit-identical coefficients and scales; the
//! sum of squares alone is summed in a different order on the GPU (it only moves the clipping factor).
//!
//! Buffers: the control buffer has [`ctl::LEN`] f32 words (counters as `u32` bits), the coefficient
//! buffer [`COEF_LEN`] words ([`AdamCoefficients`] and the skip flag), the statistics accumulator
//! [`STATS_ACC_LEN`] words.

use crate::adam::{
    adam_step_f32, adam_step_low_precision, lp_slot, AdamCoefficients, AdamGrad, AmaxSlots,
    LowPrecisionAdamState,
};
use crate::kernel_source::KernelModule;
use crate::{Buffer, CudaDevice, DType, Device, KernelError, WeightDecay};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use half::f16;
use std::ops::Range;

/// The optimizer-step control kernels (compiled together with the Adam kernels they wrap).
pub const OPTIM_STEP_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_optim_step",
    files: &["common.cuh", "adam.cu", "optim_step.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/adam.cu"),
        include_str!("../cuda/optim_step.cu")
    ),
};

/// Word offsets of the control buffer.
pub mod ctl {
    /// Adam's step count (successful steps), `u32` bits.
    pub const STEP: usize = 0;
    /// Skipped steps so far, `u32` bits.
    pub const SKIPPED: usize = 1;
    /// 1.0 when the last step was skipped.
    pub const LAST_SKIPPED: usize = 2;
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
/// Words of the gradient-statistics accumulator (f64 sum of squares, `u32` count, padding).
pub const STATS_ACC_LEN: usize = 4;

/// Largest finite F16.
pub const F16_MAX: f32 = 65504.0;
/// Margin (binades of headroom) of the F16 master's scale.
pub const MASTER_MARGIN: i32 = 4;
/// Margin of the E4M3 first moment's scale.
pub const M_MARGIN: i32 = 0;
/// Margin of the F16 second moment's scale.
pub const V_MARGIN: i32 = 1;
const E4M3_ROUNDING: f64 = 1.0 / 16.0;
const F16_ROUNDING: f64 = 1.0 / 2048.0;
const ARITHMETIC_SLACK: f64 = 1.01;

/// Host constants of [`step_control`] (mirrors the kernel's `StepParams`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepControlParams {
    /// Learning rate of this step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value; `<= 0` for no clipping.
    pub max_grad_norm: f64,
    /// Nonzero: ascend.
    pub maximize: i32,
    /// 1: L2 weight decay, 2: decoupled.
    pub decay_mode: i32,
    /// Nonzero: low-precision states (compute write scales).
    pub low: i32,
    /// Padding.
    pub pad: i32,
    /// FP8 weights (slots) of the model.
    pub slots: u64,
    /// Ranks (rows of gradient amaxes in `sums`).
    pub world_size: u64,
}

// SAFETY: `#[repr(C)]` plain data (f64/i32/u64) with the layout of the kernel's `StepParams`.
unsafe impl cudarc::driver::DeviceRepr for StepControlParams {}

impl StepControlParams {
    /// The decay mode's code.
    pub fn decay_code(mode: WeightDecay) -> i32 {
        match mode {
            WeightDecay::L2 => 1,
            WeightDecay::Decoupled => 2,
        }
    }
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// `a^b` for `b >= 0` by repeated squaring, each product rounded once (the rule both devices use).
pub fn powi_sq(mut a: f64, mut b: i32) -> f64 {
    let mut r = 1.0;
    loop {
        if b & 1 != 0 {
            r *= a;
        }
        b >>= 1;
        if b == 0 {
            break;
        }
        a *= a;
    }
    r
}

/// Adam's f32 coefficients of step `t` with gradient factor `grad_scale`, as the control kernel computes
/// them (the formula of [`crate::AdamConfig::coefficients`], powers by [`powi_sq`]).
pub fn control_coefficients(p: &StepControlParams, t: i32, grad_scale: f32) -> AdamCoefficients {
    let bc1 = 1.0 - powi_sq(p.beta1, t);
    let bc2 = 1.0 - powi_sq(p.beta2, t);
    let wd = p.weight_decay != 0.0;
    AdamCoefficients {
        beta1: p.beta1 as f32,
        one_minus_beta1: (1.0 - p.beta1) as f32,
        beta2: p.beta2 as f32,
        one_minus_beta2: (1.0 - p.beta2) as f32,
        step_size: (p.lr / bc1) as f32,
        bc2_sqrt: bc2.sqrt() as f32,
        eps: p.eps as f32,
        weight_decay: p.weight_decay as f32,
        decay: (1.0 - p.lr * p.weight_decay) as f32,
        grad_scale,
        maximize: p.maximize,
        l2: i32::from(wd && p.decay_mode == 1),
        decoupled: i32::from(wd && p.decay_mode == 2),
        pad: 0,
    }
}

/// Upper bound of `|m_t| / sqrt(v_t)` times `sqrt(1 - beta2^t)` for exact Adam (Cauchy-Schwarz over
/// Adam's sums), infinite when `beta2 = 0`.
pub fn update_ratio_bound(beta1: f64, beta2: f64, t: i32) -> f64 {
    if beta2 <= 0.0 {
        return f64::INFINITY;
    }
    let gamma = beta1 * beta1 / beta2;
    let sum = if (gamma - 1.0).abs() < 1e-12 {
        t as f64
    } else {
        (1.0 - powi_sq(gamma, t)) / (1.0 - gamma)
    };
    let bc2_sqrt = (1.0 - powi_sq(beta2, t)).sqrt();
    bc2_sqrt * (1.0 - beta1) / (1.0 - beta2).sqrt() * sum.max(0.0).sqrt()
}

/// Upper bounds of one weight's new master, first and second moment (see `fsdp-optim`'s
/// `state_scaling` for the derivation): `prev` are the agreed amaxes after the previous step,
/// `grad_amax` the global amax of this step's gradient, `ratio_bound` [`update_ratio_bound`].
pub fn state_bounds(
    c: &AdamCoefficients,
    beta1: f64,
    beta2: f64,
    eps: f64,
    ratio_bound: f64,
    prev: [f32; 3],
    grad_amax: f32,
) -> [f64; 3] {
    let aw = prev[0] as f64 * (1.0 + F16_ROUNDING);
    let am = prev[1] as f64 * (1.0 + E4M3_ROUNDING);
    let av = prev[2] as f64 * (1.0 + F16_ROUNDING);
    let mut g = grad_amax as f64 * (c.grad_scale as f64).abs();
    if c.l2 != 0 {
        g += c.weight_decay as f64 * aw;
    }
    let bm = beta1 * am + (1.0 - beta1) * g;
    let bv = beta2 * av + (1.0 - beta2) * g * g;
    let ratio = (bm / eps).min(2.0 * ratio_bound);
    let decay = if c.decoupled != 0 {
        (c.decay as f64).abs().max(1.0)
    } else {
        1.0
    };
    let bw = aw * decay + (c.step_size as f64).abs() * ratio;
    [bw, bm, bv].map(|b| b * ARITHMETIC_SLACK)
}

/// A power-of-two scale for values up to `bound` (a zero bound keeps `previous`).
pub fn scale_from_bound(bound: f64, fmax: f32, margin: i32, previous: f32) -> f32 {
    // A bound beyond f32 still deserves the smallest scale, not "keep the previous one".
    let b = if bound.is_nan() {
        0.0
    } else {
        bound.min(f32::MAX as f64) as f32
    };
    compute_scale(b, fmax, margin, ScaleRounding::PowerOfTwo, previous)
}

/// Write scales of master (F16), first moment (E4M3) and second moment (F16) from their bounds.
pub fn state_write_scales(bounds: [f64; 3], previous: [f32; 3]) -> [f32; 3] {
    [
        scale_from_bound(bounds[0], F16_MAX, MASTER_MARGIN, previous[0]),
        scale_from_bound(bounds[1], Fp8Format::E4M3.max(), M_MARGIN, previous[1]),
        scale_from_bound(bounds[2], F16_MAX, V_MARGIN, previous[2]),
    ]
}

/// Reads the coefficients and the skip flag of a host coefficient buffer.
fn host_coefficients(words: &[f32]) -> (AdamCoefficients, bool) {
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

fn coefficient_words(c: &AdamCoefficients) -> [f32; 14] {
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

/// Whether the coefficient buffer says "skipped" (reads the device: for tests and reports).
pub fn coefficients_of(coef: &Buffer<f32>) -> Result<(AdamCoefficients, bool), KernelError> {
    let w = coef.to_vec()?;
    if w.len() != COEF_LEN {
        return Err(bad(
            "coefficients_of",
            format!("{} words, expected {COEF_LEN}", w.len()),
        ));
    }
    Ok(host_coefficients(&w))
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

/// Adds the statistics of `grad[range]` to `acc` (sum of squares of the finite values in f64, count of
/// non-finite values) and, with `amax = Some((buffer, slot))`, raises `buffer[slot]` to the amax of the
/// finite values. The gradient is f32 or bf16 (widened exactly).
pub fn grad_stats<G: AdamGrad>(
    grad: &Buffer<G>,
    range: Range<usize>,
    acc: &mut Buffer<f32>,
    amax: Option<(&mut Buffer<f32>, usize)>,
) -> Result<(), KernelError> {
    let what = "grad_stats";
    check_range(what, &range, grad.len())?;
    check(what, acc.len(), STATS_ACC_LEN)?;
    if let Some((b, s)) = &amax {
        check(what, b.len(), s + 1)?;
    }
    match grad.device() {
        Device::Cpu => {
            let g = &grad.host(what)?[range];
            let mut sq = 0f64;
            let mut nf = 0u32;
            let mut am = 0f32;
            for x in g.iter().map(|v| v.to_f32()) {
                if x.is_finite() {
                    sq += (x as f64) * (x as f64);
                    am = am.max(x.abs());
                } else {
                    nf = nf.saturating_add(1);
                }
            }
            let a = acc.host_mut(what)?;
            let old = f64::from_bits(a[0].to_bits() as u64 | ((a[1].to_bits() as u64) << 32));
            let bits = (old + sq).to_bits();
            a[0] = f32::from_bits(bits as u32);
            a[1] = f32::from_bits((bits >> 32) as u32);
            a[2] = f32::from_bits(a[2].to_bits().saturating_add(nf));
            if let Some((b, s)) = amax {
                let slot = &mut b.host_mut(what)?[s];
                *slot = slot.max(am);
            }
            Ok(())
        }
        Device::Cuda(dev) => cuda::grad_stats(&dev, grad, range, acc, amax),
    }
}

/// `sums[0] = ` non-finite count of `acc` plus `extra_nonfinite`, `sums[1] = ` the sum of squares
/// rounded to f32; clears `acc`.
pub fn grad_stats_finish(
    acc: &mut Buffer<f32>,
    extra_nonfinite: u32,
    sums: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "grad_stats_finish";
    check(what, acc.len(), STATS_ACC_LEN)?;
    check(what, sums.len(), 2)?;
    match acc.device() {
        Device::Cpu => {
            let a = acc.host_mut(what)?;
            let sq = f64::from_bits(a[0].to_bits() as u64 | ((a[1].to_bits() as u64) << 32));
            let nf = a[2].to_bits().wrapping_add(extra_nonfinite);
            a.fill(0.0);
            let s = sums.host_mut(what)?;
            s[0] = nf as f32;
            s[1] = sq as f32;
            Ok(())
        }
        Device::Cuda(dev) => cuda::grad_stats_finish(&dev, acc, extra_nonfinite, sums),
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
/// counters in `ctl`, writes the coefficients and skip flag into `coef` and, for low-precision states,
/// the write scales; `report` receives a copy of `ctl` after the update.
pub fn step_control(
    p: &StepControlParams,
    sums: &Buffer<f32>,
    ctl_buf: &mut Buffer<f32>,
    coef: &mut Buffer<f32>,
    slots: Option<SlotScales<'_>>,
    report: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "step_control";
    let n = p.slots as usize;
    let ws = p.world_size as usize;
    check(what, sums.len(), 2 + if p.low != 0 { ws * n } else { 0 })?;
    check(what, ctl_buf.len(), ctl::LEN)?;
    check(what, coef.len(), COEF_LEN)?;
    check(what, report.len(), ctl::LEN)?;
    if p.low != 0 {
        let s = slots
            .as_ref()
            .ok_or_else(|| bad(what, "low-precision states need slot scales".into()))?;
        check(what, s.amaxes.len(), 3 * n)?;
        check(what, s.scales.len(), 3 * n)?;
        check(what, s.write.len(), 3 * n)?;
        check(what, s.kernel_scales.len(), lp_slot::SCALES * n)?;
    }
    match sums.device() {
        Device::Cpu => {
            let sm = sums.host(what)?;
            let c = ctl_buf.host_mut(what)?;
            let (nonfinite, sumsq) = (sm[0], sm[1]);
            let norm = (sumsq as f64).sqrt();
            let skip = nonfinite != 0.0 || !norm.is_finite();
            let step = c[ctl::STEP].to_bits();
            c[ctl::LAST_NONFINITE] = nonfinite;
            c[ctl::LAST_SUMSQ] = sumsq;
            if skip {
                c[ctl::SKIPPED] = f32::from_bits(c[ctl::SKIPPED].to_bits().wrapping_add(1));
                c[ctl::LAST_SKIPPED] = 1.0;
                coef.host_mut(what)?[COEF_SKIP] = 1.0;
            } else {
                let clip = if p.max_grad_norm > 0.0 {
                    (p.max_grad_norm / (norm + 1e-6)).min(1.0)
                } else {
                    1.0
                };
                let t_u = step.wrapping_add(1);
                let t = t_u.min(i32::MAX as u32) as i32;
                let co = control_coefficients(p, t, clip as f32);
                if p.low != 0 {
                    if let Some(s) = slots {
                        let ub = update_ratio_bound(p.beta1, p.beta2, t);
                        let am = s.amaxes.host(what)?;
                        let sc = s.scales.host(what)?;
                        let wr = s.write.host_mut(what)?;
                        let ks = s.kernel_scales.host_mut(what)?;
                        for i in 0..n {
                            let gmax = (0..ws).fold(0f32, |a, r| a.max(sm[2 + r * n + i]));
                            let prev = [am[3 * i], am[3 * i + 1], am[3 * i + 2]];
                            let old = [sc[3 * i], sc[3 * i + 1], sc[3 * i + 2]];
                            let b = state_bounds(&co, p.beta1, p.beta2, p.eps, ub, prev, gmax);
                            let w = state_write_scales(b, old);
                            wr[3 * i..3 * i + 3].copy_from_slice(&w);
                            let k = &mut ks[lp_slot::SCALES * i..lp_slot::SCALES * (i + 1)];
                            k[lp_slot::MASTER_SCALE_INV] = 1.0 / old[0];
                            k[lp_slot::MASTER_SCALE] = w[0];
                            k[lp_slot::M_SCALE_INV] = 1.0 / old[1];
                            k[lp_slot::M_SCALE] = w[1];
                            k[lp_slot::V_SCALE_INV] = 1.0 / old[2];
                            k[lp_slot::V_SCALE] = w[2];
                        }
                    }
                }
                let cw = coef.host_mut(what)?;
                cw[..14].copy_from_slice(&coefficient_words(&co));
                cw[COEF_SKIP] = 0.0;
                c[ctl::STEP] = f32::from_bits(t_u);
                c[ctl::LAST_SKIPPED] = 0.0;
            }
            let snapshot: Vec<f32> = c[..ctl::LEN].to_vec();
            report.host_mut(what)?[..ctl::LEN].copy_from_slice(&snapshot);
            Ok(())
        }
        Device::Cuda(dev) => cuda::step_control(&dev, p, sums, ctl_buf, coef, slots, report),
    }
}

/// [`adam_step_f32`] with the coefficients read from `coef` (nothing happens when it says "skip"); f32 or
/// bf16 gradients.
pub fn adam_step_f32_ctl<G: AdamGrad>(
    coef: &Buffer<f32>,
    range: Range<usize>,
    master: &mut Buffer<f32>,
    m: &mut Buffer<f32>,
    v: &mut Buffer<f32>,
    grad: &Buffer<G>,
    amax: Option<AmaxSlots<'_>>,
) -> Result<(), KernelError> {
    let what = "adam_step_f32_ctl";
    check(what, coef.len(), COEF_LEN)?;
    match coef.device() {
        Device::Cpu => {
            let (c, skip) = host_coefficients(coef.host(what)?);
            if skip {
                return Ok(());
            }
            adam_step_f32(&c, range, master, m, v, grad, amax)
        }
        Device::Cuda(dev) => cuda::adam_f32_ctl(&dev, coef, range, master, m, v, grad, amax),
    }
}

/// [`adam_step_low_precision`] with the coefficients read from `coef` (nothing happens when it says
/// "skip"); f32 or bf16 gradients.
pub fn adam_step_low_precision_ctl<G: AdamGrad>(
    coef: &Buffer<f32>,
    range: Range<usize>,
    state: LowPrecisionAdamState<'_>,
    grad: &Buffer<G>,
    scales: &Buffer<f32>,
    scale_base: usize,
    amax: AmaxSlots<'_>,
) -> Result<(), KernelError> {
    let what = "adam_step_low_precision_ctl";
    check(what, coef.len(), COEF_LEN)?;
    match coef.device() {
        Device::Cpu => {
            let (c, skip) = host_coefficients(coef.host(what)?);
            if skip {
                return Ok(());
            }
            adam_step_low_precision(&c, range, state, grad, scales, scale_base, amax)
        }
        Device::Cuda(dev) => {
            cuda::adam_lp_ctl(&dev, coef, range, state, grad, scales, scale_base, amax)
        }
    }
}

/// After the all-reduce MAX of the amax vector `agreed` (`per_slot` values per slot: 1 for F32 states,
/// 3 for low precision): unless skipped, `amaxes[3i..3i+3] = agreed` (zero-filled), `scales = write`
/// (when given) and `weight_amax[i] = agreed[per_slot * i]`; when skipped `weight_amax` is zeroed (which
/// keeps every FP8 weight's scale) and nothing else changes.
pub fn step_finish(
    coef: &Buffer<f32>,
    agreed: &Buffer<f32>,
    per_slot: usize,
    amaxes: &mut Buffer<f32>,
    scales: &mut Buffer<f32>,
    write: Option<&Buffer<f32>>,
    weight_amax: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "step_finish";
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
    match coef.device() {
        Device::Cpu => {
            let (_, skip) = host_coefficients(coef.host(what)?);
            let wa = weight_amax.host_mut(what)?;
            if skip {
                wa.fill(0.0);
                return Ok(());
            }
            let ag = agreed.host(what)?;
            let am = amaxes.host_mut(what)?;
            for i in 0..n {
                for k in 0..3 {
                    am[3 * i + k] = if k < per_slot {
                        ag[per_slot * i + k]
                    } else {
                        0.0
                    };
                }
                wa[i] = ag[per_slot * i];
            }
            if let Some(w) = write {
                scales.host_mut(what)?[..3 * n].copy_from_slice(&w.host(what)?[..3 * n]);
            }
            Ok(())
        }
        Device::Cuda(dev) => cuda::step_finish(
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
    /// An error unless the master covers `range` (and, for F16, its slot's scale exists).
    fn check(&self, what: &'static str, range: &Range<usize>) -> Result<(), KernelError> {
        match *self {
            MasterSource::F32(m) => check_range(what, range, m.len()),
            MasterSource::F16 {
                master,
                scales,
                slot,
            } => {
                check_range(what, range, master.len())?;
                check(what, scales.len(), 3 * slot + 3)
            }
        }
    }
}

/// Writes `out[range]`, the F32 values FP8 weight segment `range` is cast from: the master (F32, or F16
/// times `1 / scale`), or on a skipped step the current weight `decode(fp8) * weight_scales[2 * wslot +
/// 1]`.
pub fn apply_source(
    coef: &Buffer<f32>,
    out: &mut Buffer<f32>,
    range: Range<usize>,
    fp8: &Buffer<u8>,
    weight_scales: &Buffer<f32>,
    wslot: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "apply_source";
    check(what, coef.len(), COEF_LEN)?;
    check_range(what, &range, out.len())?;
    check_range(what, &range, fp8.len())?;
    check(what, weight_scales.len(), 2 * wslot + 2)?;
    source.check(what, &range)?;
    match coef.device() {
        Device::Cpu => {
            let (_, skip) = host_coefficients(coef.host(what)?);
            let o = &mut out.host_mut(what)?[range.clone()];
            if skip {
                let si = weight_scales.host(what)?[2 * wslot + 1];
                let q = &fp8.host(what)?[range];
                for (x, &c) in o.iter_mut().zip(q) {
                    *x = Fp8Format::E4M3.decode(c) * si;
                }
                return Ok(());
            }
            match source {
                MasterSource::F32(m) => o.copy_from_slice(&m.host(what)?[range]),
                MasterSource::F16 {
                    master,
                    scales,
                    slot,
                } => {
                    let inv = 1.0 / scales.host(what)?[3 * slot];
                    for (x, h) in o.iter_mut().zip(&master.host(what)?[range]) {
                        *x = h.to_f32() * inv;
                    }
                }
            }
            Ok(())
        }
        Device::Cuda(dev) => {
            cuda::apply_source(&dev, coef, out, range, fp8, weight_scales, wslot, source)
        }
    }
}

/// [`apply_source`] fused with the weight cast, in place: `fp8[i] = encode_e4m3(x_i * weight_scales[2 *
/// wslot])` for `i` in `range`, where `x_i` is what [`apply_source`] writes (reading `weight_scales[2 *
/// wslot + 1]` on a skipped step). Call it after the new scales are in `weight_scales`: on a skipped step
/// the weight's amax is 0, which keeps its scale pair, so the codes are bit-identical to
/// `apply_source` (before the scale update) followed by `segmented_cast` (after it), without the F32
/// buffer of the whole shard between them.
pub fn cast_from_source(
    coef: &Buffer<f32>,
    fp8: &mut Buffer<u8>,
    range: Range<usize>,
    weight_scales: &Buffer<f32>,
    wslot: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "cast_from_source";
    check(what, coef.len(), COEF_LEN)?;
    check_range(what, &range, fp8.len())?;
    check(what, weight_scales.len(), 2 * wslot + 2)?;
    source.check(what, &range)?;
    match coef.device() {
        Device::Cpu => {
            use rayon::prelude::*;
            const CHUNK: usize = 1 << 14;
            let (_, skip) = host_coefficients(coef.host(what)?);
            let ws = weight_scales.host(what)?;
            let (s, si) = (ws[2 * wslot], ws[2 * wslot + 1]);
            let e4m3 = Fp8Format::E4M3;
            let q = &mut fp8.host_mut(what)?[range.clone()];
            if skip {
                q.par_chunks_mut(CHUNK).for_each(|c| {
                    for x in c.iter_mut() {
                        *x = e4m3.encode(e4m3.decode(*x) * si * s);
                    }
                });
                return Ok(());
            }
            match source {
                MasterSource::F32(m) => {
                    let m = &m.host(what)?[range];
                    q.par_chunks_mut(CHUNK)
                        .zip(m.par_chunks(CHUNK))
                        .for_each(|(q, m)| {
                            for (x, &w) in q.iter_mut().zip(m) {
                                *x = e4m3.encode(w * s);
                            }
                        });
                }
                MasterSource::F16 {
                    master,
                    scales,
                    slot,
                } => {
                    let inv = 1.0 / scales.host(what)?[3 * slot];
                    let m = &master.host(what)?[range];
                    q.par_chunks_mut(CHUNK)
                        .zip(m.par_chunks(CHUNK))
                        .for_each(|(q, m)| {
                            for (x, h) in q.iter_mut().zip(m) {
                                *x = e4m3.encode(h.to_f32() * inv * s);
                            }
                        });
                }
            }
            Ok(())
        }
        Device::Cuda(dev) => {
            cuda::cast_from_source(&dev, coef, fp8, range, weight_scales, wslot, source)
        }
    }
}

/// The kernel-name suffix of a gradient type.
fn grad_suffix<G: AdamGrad>(what: &'static str) -> Result<&'static str, KernelError> {
    match G::DTYPE {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        other => Err(bad(what, format!("{other} gradients are not supported"))),
    }
}

mod cuda {
    use super::*;

    fn f(dev: &CudaDevice, name: &str) -> Result<cudarc::driver::CudaFunction, KernelError> {
        crate::kernel_source::function(dev, &OPTIM_STEP_MODULE, name)
    }

    use crate::device::{cuda_slice as cs, cuda_slice_mut as csm};
    use cudarc::driver::{CudaStream, SyncOnDrop};
    use std::sync::Arc;

    fn grid(dev: &CudaDevice, n: usize, per_thread: u64) -> Result<LaunchConfig, KernelError> {
        let sms = crate::kernel_source::sm_count(dev)?;
        Ok(crate::kernel_source::grid_1d(
            sms,
            (n as u64).div_ceil(per_thread),
            8,
        ))
    }

    fn one_block() -> LaunchConfig {
        LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (crate::kernel_source::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(super) fn grad_stats<G: AdamGrad>(
        dev: &CudaDevice,
        grad: &Buffer<G>,
        range: Range<usize>,
        acc: &mut Buffer<f32>,
        amax: Option<(&mut Buffer<f32>, usize)>,
    ) -> Result<(), KernelError> {
        let what = "grad_stats";
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let func = f(dev, &format!("grad_stats_{}", grad_suffix::<G>(what)?))?;
        let stream = dev.stream().clone();
        let cfg = grid(dev, n, 4)?;
        let (off, len) = (range.start as u64, n as u64);
        let g = cs(grad, what)?;
        let a = csm(acc, what)?;
        let mut amax = amax;
        let (amax_ptr, slot, with, _guard) = match amax.as_mut() {
            Some((b, s)) => {
                let sl = csm(b, what)?;
                let (p, gd) = sl.device_ptr_mut(&stream);
                (p, *s as u64, 1i32, Some(gd))
            }
            None => (0u64, 0u64, 0i32, None),
        };
        let mut l = stream.launch_builder(&func);
        l.arg(g)
            .arg(&off)
            .arg(&len)
            .arg(a)
            .arg(&amax_ptr)
            .arg(&slot)
            .arg(&with);
        // SAFETY: reads grad[off..off+n] (checked), adds into the 4-word accumulator (checked) and raises
        // one amax slot (checked) or none; arguments match `grad_stats_f32`.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    pub(super) fn grad_stats_finish(
        dev: &CudaDevice,
        acc: &mut Buffer<f32>,
        extra: u32,
        sums: &mut Buffer<f32>,
    ) -> Result<(), KernelError> {
        let what = "grad_stats_finish";
        let func = f(dev, "grad_stats_finish")?;
        let stream = dev.stream().clone();
        let a = csm(acc, what)?;
        let s = csm(sums, what)?;
        let mut l = stream.launch_builder(&func);
        l.arg(a).arg(&extra).arg(s);
        // SAFETY: one thread reads/clears 4 accumulator words and writes sums[0..2] (lengths checked).
        unsafe { l.launch(LaunchConfig::for_num_elems(1)) }?;
        Ok(())
    }

    pub(super) fn step_control(
        dev: &CudaDevice,
        p: &StepControlParams,
        sums: &Buffer<f32>,
        ctl_buf: &mut Buffer<f32>,
        coef: &mut Buffer<f32>,
        slots: Option<SlotScales<'_>>,
        report: &mut Buffer<f32>,
    ) -> Result<(), KernelError> {
        let what = "step_control";
        let func = f(dev, "step_control")?;
        let stream = dev.stream().clone();
        let s = cs(sums, what)?;
        let c = csm(ctl_buf, what)?;
        let co = csm(coef, what)?;
        let r = csm(report, what)?;
        let mut slots = slots;
        let mut guards = Vec::new();
        let ptrs: [u64; 4] = match slots.as_mut() {
            Some(sl) => {
                let (a, ga) = cs(sl.amaxes, what)?.device_ptr(&stream);
                let (b, gb) = cs(sl.scales, what)?.device_ptr(&stream);
                guards.push(ga);
                guards.push(gb);
                let (w, gw) = csm(sl.write, what)?.device_ptr_mut(&stream);
                let (k, gk) = csm(sl.kernel_scales, what)?.device_ptr_mut(&stream);
                guards.push(gw);
                guards.push(gk);
                [a, b, w, k]
            }
            None => [0; 4],
        };
        let mut l = stream.launch_builder(&func);
        l.arg(p)
            .arg(s)
            .arg(c)
            .arg(co)
            .arg(&ptrs[0])
            .arg(&ptrs[1])
            .arg(&ptrs[2])
            .arg(&ptrs[3])
            .arg(r);
        // SAFETY: one block; reads sums[0..2 + ws * n], the 3n amaxes and scales, writes 3n write scales,
        // 6n kernel scales, the control, coefficient and report words (all lengths checked); the slot
        // pointers are null only when `p.low == 0`, where the kernel does not touch them.
        unsafe { l.launch(one_block()) }?;
        drop(guards);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn adam_f32_ctl<G: AdamGrad>(
        dev: &CudaDevice,
        coef: &Buffer<f32>,
        range: Range<usize>,
        master: &mut Buffer<f32>,
        m: &mut Buffer<f32>,
        v: &mut Buffer<f32>,
        grad: &Buffer<G>,
        amax: Option<AmaxSlots<'_>>,
    ) -> Result<(), KernelError> {
        let what = "adam_step_f32_ctl";
        for len in [master.len(), m.len(), v.len(), grad.len()] {
            check_range(what, &range, len)?;
        }
        if let Some(a) = &amax {
            check(what, a.buffer.len(), a.base + 1)?;
        }
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let func = f(dev, &format!("adam_f32_ctl_g_{}", grad_suffix::<G>(what)?))?;
        let stream = dev.stream().clone();
        let cfg = grid(dev, n, 8)?;
        let (off, len) = (range.start as u64, n as u64);
        let co = cs(coef, what)?;
        let g = cs(grad, what)?;
        let ms = csm(m, what)?;
        let vs = csm(v, what)?;
        let ws = csm(master, what)?;
        let mut amax = amax;
        let (amax_ptr, slot, _guard) = match amax.as_mut() {
            Some(a) => {
                let sl = csm(a.buffer, what)?;
                let (p, gd) = sl.device_ptr_mut(&stream);
                (p, a.base as u64, Some(gd))
            }
            None => (0u64, 0u64, None),
        };
        let mut l = stream.launch_builder(&func);
        l.arg(ws)
            .arg(ms)
            .arg(vs)
            .arg(g)
            .arg(&off)
            .arg(&len)
            .arg(co)
            .arg(&amax_ptr)
            .arg(&slot);
        // SAFETY: as adam_f32_g_f32 (ranges and slot checked), with the coefficients read from the
        // 16-word coefficient buffer (checked).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn adam_lp_ctl<G: AdamGrad>(
        dev: &CudaDevice,
        coef: &Buffer<f32>,
        range: Range<usize>,
        state: LowPrecisionAdamState<'_>,
        grad: &Buffer<G>,
        scales: &Buffer<f32>,
        scale_base: usize,
        amax: AmaxSlots<'_>,
    ) -> Result<(), KernelError> {
        let what = "adam_step_low_precision_ctl";
        let LowPrecisionAdamState { master, m, v } = state;
        for len in [master.len(), m.len(), v.len(), grad.len()] {
            check_range(what, &range, len)?;
        }
        check(what, scales.len(), scale_base + lp_slot::SCALES)?;
        check(what, amax.buffer.len(), amax.base + lp_slot::AMAXES)?;
        dev.require_fp8()?;
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let func = f(dev, &format!("adam_lp_ctl_g_{}", grad_suffix::<G>(what)?))?;
        let stream = dev.stream().clone();
        let cfg = grid(dev, n, 8)?;
        let (off, len) = (range.start as u64, n as u64);
        let (sbase, abase) = (scale_base as u64, amax.base as u64);
        let co = cs(coef, what)?;
        let g = cs(grad, what)?;
        let ss = cs(scales, what)?;
        let ms = csm(m, what)?;
        let vs = csm(v, what)?;
        let ws = csm(master, what)?;
        let am = csm(amax.buffer, what)?;
        let mut l = stream.launch_builder(&func);
        l.arg(ws)
            .arg(ms)
            .arg(vs)
            .arg(g)
            .arg(&off)
            .arg(&len)
            .arg(co)
            .arg(ss)
            .arg(&sbase)
            .arg(am)
            .arg(&abase);
        // SAFETY: as adam_lp_g_f32 (ranges, scale and amax slots checked), with the coefficients read from
        // the 16-word coefficient buffer (checked).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn step_finish(
        dev: &CudaDevice,
        coef: &Buffer<f32>,
        agreed: &Buffer<f32>,
        per_slot: usize,
        amaxes: &mut Buffer<f32>,
        scales: &mut Buffer<f32>,
        write: Option<&Buffer<f32>>,
        weight_amax: &mut Buffer<f32>,
    ) -> Result<(), KernelError> {
        let what = "step_finish";
        let n = weight_amax.len();
        if n == 0 {
            return Ok(());
        }
        let func = f(dev, "step_finish")?;
        let stream = dev.stream().clone();
        let cfg = grid(dev, n, 1)?;
        let (ps, slots) = (per_slot as u64, n as u64);
        let co = cs(coef, what)?;
        let ag = cs(agreed, what)?;
        let am = csm(amaxes, what)?;
        let sc = csm(scales, what)?;
        let wa = csm(weight_amax, what)?;
        let (wptr, _g) = match write {
            Some(w) => {
                let (p, g) = cs(w, what)?.device_ptr(&stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let mut l = stream.launch_builder(&func);
        l.arg(co)
            .arg(ag)
            .arg(&ps)
            .arg(&slots)
            .arg(am)
            .arg(sc)
            .arg(&wptr)
            .arg(wa);
        // SAFETY: reads per_slot * n agreed amaxes and 3n write scales (or none: null), writes 3n amaxes,
        // 3n scales and n weight amaxes (lengths checked).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// The kernel arguments `master32, master16, state_scales, slot` of a [`MasterSource`] (null for the
    /// unused form), with the guards that order their use on `stream`.
    fn master_args<'a>(
        source: MasterSource<'a>,
        stream: &'a Arc<CudaStream>,
        what: &'static str,
    ) -> Result<(Vec<SyncOnDrop<'a>>, [u64; 4]), KernelError> {
        Ok(match source {
            MasterSource::F32(m) => {
                let (p, g) = cs(m, what)?.device_ptr(stream);
                (vec![g], [p, 0, 0, 0])
            }
            MasterSource::F16 {
                master,
                scales,
                slot,
            } => {
                let (p, g) = cs(master, what)?.device_ptr(stream);
                let (s, g2) = cs(scales, what)?.device_ptr(stream);
                (vec![g, g2], [0, p, s, slot as u64])
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_source(
        dev: &CudaDevice,
        coef: &Buffer<f32>,
        out: &mut Buffer<f32>,
        range: Range<usize>,
        fp8: &Buffer<u8>,
        weight_scales: &Buffer<f32>,
        wslot: usize,
        source: MasterSource<'_>,
    ) -> Result<(), KernelError> {
        let what = "apply_source";
        dev.require_fp8()?;
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let func = f(dev, "apply_source")?;
        let stream = dev.stream().clone();
        let cfg = grid(dev, n, 4)?;
        let (off, len, ws) = (range.start as u64, n as u64, wslot as u64);
        let co = cs(coef, what)?;
        let q = cs(fp8, what)?;
        let wsc = cs(weight_scales, what)?;
        let (guards, [m32, m16, ss, gslot]) = master_args(source, &stream, what)?;
        let o = csm(out, what)?;
        let mut l = stream.launch_builder(&func);
        l.arg(co)
            .arg(o)
            .arg(&off)
            .arg(&len)
            .arg(q)
            .arg(wsc)
            .arg(&ws)
            .arg(&m32)
            .arg(&m16)
            .arg(&ss)
            .arg(&gslot);
        // SAFETY: touches [off, off + n) of out, fp8 and the master (checked), reads one weight-scale pair
        // and one state scale (checked); exactly one of the master pointers is non-null.
        unsafe { l.launch(cfg) }?;
        drop(guards);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn cast_from_source(
        dev: &CudaDevice,
        coef: &Buffer<f32>,
        fp8: &mut Buffer<u8>,
        range: Range<usize>,
        weight_scales: &Buffer<f32>,
        wslot: usize,
        source: MasterSource<'_>,
    ) -> Result<(), KernelError> {
        let what = "cast_from_source";
        dev.require_fp8()?;
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let func = f(dev, "cast_from_source")?;
        let stream = dev.stream().clone();
        let cfg = grid(dev, n, 4)?;
        let (off, len, ws) = (range.start as u64, n as u64, wslot as u64);
        let co = cs(coef, what)?;
        let wsc = cs(weight_scales, what)?;
        let (guards, [m32, m16, ss, gslot]) = master_args(source, &stream, what)?;
        let q = csm(fp8, what)?;
        let mut l = stream.launch_builder(&func);
        l.arg(co)
            .arg(q)
            .arg(&off)
            .arg(&len)
            .arg(wsc)
            .arg(&ws)
            .arg(&m32)
            .arg(&m16)
            .arg(&ss)
            .arg(&gslot);
        // SAFETY: reads and rewrites [off, off + n) of fp8 and reads that range of the master (checked),
        // one weight-scale pair and one state scale (checked); exactly one master pointer is non-null.
        unsafe { l.launch(cfg) }?;
        drop(guards);
        Ok(())
    }
}
