//! The CPU implementations of the Adam family, the reference of the CUDA kernels: the update loops, and
//! the control arithmetic (f64, each operation rounded once, powers by squaring) that `control.cu` runs
//! in the same order.

use super::control::{ctl, words_of, AdamControlParams, StateScaleRule, COEF_SKIP};
use super::{adam_element, f16_saturating, lp_slot, AdamCoefficients, AdamConfig, WeightDecay};
use super::{AdamGrad, F16_MAX};
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use half::f16;
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;
/// Relative rounding of a stored E4M3 value (3 mantissa bits).
const E4M3_ROUNDING: f64 = 1.0 / 16.0;
/// Relative rounding of a stored F16 value (10 mantissa bits).
const F16_ROUNDING: f64 = 1.0 / 2048.0;

fn max_nan_ignored(a: f32, b: f32) -> f32 {
    // f32::max returns the non-NaN operand, like the kernel's NaN-as-zero integer max.
    a.max(b)
}

/// F32 states: updates `w`, `m`, `v` in place and returns the amax of the new `w`.
pub(super) fn adam_f32<G: AdamGrad>(
    c: &AdamCoefficients,
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
) -> f32 {
    w.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .map(|(((w, m), v), g)| {
            let mut a = 0.0f32;
            for i in 0..w.len() {
                let (nw, nm, nv) = adam_element(c, g[i].to_f32(), w[i], m[i], v[i]);
                w[i] = nw;
                m[i] = nm;
                v[i] = nv;
                a = max_nan_ignored(a, nw.abs());
            }
            a
        })
        .reduce(|| 0.0, max_nan_ignored)
}

/// Low-precision states read with the `*_SCALE_INV` and stored with the `*_SCALE` entries of `sc`;
/// returns the amaxes of the new master, m and v.
pub(super) fn adam_low_precision<G: AdamGrad>(
    c: &AdamCoefficients,
    sc: &[f32; lp_slot::SCALES],
    w: &mut [f16],
    m: &mut [u8],
    v: &mut [f16],
    g: &[G],
) -> [f32; 3] {
    let e4m3 = Fp8Format::E4M3;
    let table = e4m3.decode_table();
    w.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .map(|(((w, m), v), g)| {
            let mut a = [0.0f32; 3];
            for i in 0..w.len() {
                let w0 = w[i].to_f32() * sc[lp_slot::MASTER_SCALE_INV];
                let m0 = table[m[i] as usize] * sc[lp_slot::M_SCALE_INV];
                let v0 = v[i].to_f32() * sc[lp_slot::V_SCALE_INV];
                let (nw, nm, nv) = adam_element(c, g[i].to_f32(), w0, m0, v0);
                a[0] = max_nan_ignored(a[0], nw.abs());
                a[1] = max_nan_ignored(a[1], nm.abs());
                a[2] = max_nan_ignored(a[2], nv.abs());
                w[i] = f16_saturating(nw * sc[lp_slot::MASTER_SCALE]);
                v[i] = f16_saturating(nv * sc[lp_slot::V_SCALE]);
                m[i] = e4m3.encode(nm * sc[lp_slot::M_SCALE]);
            }
            a
        })
        .reduce(
            || [0.0; 3],
            |x, y| std::array::from_fn(|i| max_nan_ignored(x[i], y[i])),
        )
}

/// `a^b` for `b >= 0` by repeated squaring, each product rounded once (the rule both devices use; the
/// same as Rust's `f64::powi` on these arguments).
fn powi_sq(mut a: f64, mut b: i32) -> f64 {
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

/// Adam's f32 coefficients of step `t >= 1` with gradient factor `grad_scale`, as the control kernel
/// computes them.
pub(super) fn coefficients(p: &AdamConfig, t: i32, grad_scale: f32) -> AdamCoefficients {
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
        maximize: i32::from(p.maximize),
        l2: i32::from(wd && p.decay_mode == WeightDecay::L2),
        decoupled: i32::from(wd && p.decay_mode == WeightDecay::Decoupled),
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

/// Upper bounds of one weight's new master, first and second moment under `rule` (the derivation is the
/// caller's policy, see `fsdp-optim`'s `policy`): `prev` are the agreed amaxes after the previous step,
/// `grad_amax` the global amax of this step's gradient, `ratio_bound` [`update_ratio_bound`]. The stored
/// previous states are widened by their formats' rounding (F16 master and second moment, E4M3 first
/// moment) before the bounds are taken.
pub fn state_bounds(
    c: &AdamCoefficients,
    adam: &AdamConfig,
    rule: &StateScaleRule,
    ratio_bound: f64,
    prev: [f32; 3],
    grad_amax: f32,
) -> [f64; 3] {
    let (beta1, beta2, eps) = (adam.beta1, adam.beta2, adam.eps);
    let aw = prev[0] as f64 * (1.0 + F16_ROUNDING);
    let am = prev[1] as f64 * (1.0 + E4M3_ROUNDING);
    let av = prev[2] as f64 * (1.0 + F16_ROUNDING);
    let mut g = grad_amax as f64 * (c.grad_scale as f64).abs();
    if c.l2 != 0 {
        g += c.weight_decay as f64 * aw;
    }
    let bm = beta1 * am + (1.0 - beta1) * g;
    let bv = beta2 * av + (1.0 - beta2) * g * g;
    let ratio = (bm / eps).min(rule.ratio_factor * ratio_bound);
    let decay = if c.decoupled != 0 {
        (c.decay as f64).abs().max(1.0)
    } else {
        1.0
    };
    let bw = aw * decay + (c.step_size as f64).abs() * ratio;
    [bw, bm, bv].map(|b| b * rule.slack)
}

/// A power-of-two scale for values up to `bound` with `margin` binades of headroom (a zero bound keeps
/// `previous`).
pub fn scale_from_bound(bound: f64, fmax: f32, margin: i32, previous: f32) -> f32 {
    // A bound beyond f32 still deserves the smallest scale, not "keep the previous one".
    let b = if bound.is_nan() {
        0.0
    } else {
        bound.min(f32::MAX as f64) as f32
    };
    compute_scale(b, fmax, margin, ScaleRounding::PowerOfTwo, previous)
}

/// Write scales of master (F16), first moment (E4M3) and second moment (F16) from their bounds, with the
/// rule's margins.
pub fn state_write_scales(bounds: [f64; 3], previous: [f32; 3], rule: &StateScaleRule) -> [f32; 3] {
    let [mw, mm, mv] = rule.margins;
    [
        scale_from_bound(bounds[0], F16_MAX, mw, previous[0]),
        scale_from_bound(bounds[1], Fp8Format::E4M3.max(), mm, previous[1]),
        scale_from_bound(bounds[2], F16_MAX, mv, previous[2]),
    ]
}

/// The host slices of [`super::control::SlotScales`].
pub(super) struct HostSlotScales<'a> {
    pub(super) amaxes: &'a [f32],
    pub(super) scales: &'a [f32],
    pub(super) write: &'a mut [f32],
    pub(super) kernel_scales: &'a mut [f32],
}

/// The control step on host slices (see `adam_coefficients_from_stats`).
pub(super) fn coefficients_from_stats(
    p: &AdamControlParams,
    sums: &[f32],
    c: &mut [f32],
    coef: &mut [f32],
    slots: Option<HostSlotScales<'_>>,
) {
    let (n, ws) = (p.slots, p.world_size);
    let (nonfinite, sumsq) = (sums[0], sums[1]);
    let norm = (sumsq as f64).sqrt();
    let skip = nonfinite != 0.0 || !norm.is_finite();
    let step = c[ctl::STEP].to_bits();
    c[ctl::LAST_NONFINITE] = nonfinite;
    c[ctl::LAST_SUMSQ] = sumsq;
    if skip {
        c[ctl::SKIP_COUNT] = f32::from_bits(c[ctl::SKIP_COUNT].to_bits().wrapping_add(1));
        c[ctl::LAST_SKIP] = 1.0;
        coef[COEF_SKIP] = 1.0;
        return;
    }
    let clip = match p.max_grad_norm {
        Some(max) => (max / (norm + p.clip_eps)).min(1.0),
        None => 1.0,
    };
    let t_u = step.wrapping_add(1);
    let t = t_u.min(i32::MAX as u32) as i32;
    let co = coefficients(&p.adam, t, clip as f32);
    if let (Some(rule), Some(s)) = (&p.state_scales, slots) {
        let ub = update_ratio_bound(p.adam.beta1, p.adam.beta2, t);
        for i in 0..n {
            let gmax = (0..ws).fold(0f32, |a, r| a.max(sums[2 + r * n + i]));
            let prev = [s.amaxes[3 * i], s.amaxes[3 * i + 1], s.amaxes[3 * i + 2]];
            let old = [s.scales[3 * i], s.scales[3 * i + 1], s.scales[3 * i + 2]];
            let b = state_bounds(&co, &p.adam, rule, ub, prev, gmax);
            let w = state_write_scales(b, old, rule);
            s.write[3 * i..3 * i + 3].copy_from_slice(&w);
            let k = &mut s.kernel_scales[lp_slot::SCALES * i..lp_slot::SCALES * (i + 1)];
            k[lp_slot::MASTER_SCALE_INV] = 1.0 / old[0];
            k[lp_slot::MASTER_SCALE] = w[0];
            k[lp_slot::M_SCALE_INV] = 1.0 / old[1];
            k[lp_slot::M_SCALE] = w[1];
            k[lp_slot::V_SCALE_INV] = 1.0 / old[2];
            k[lp_slot::V_SCALE] = w[2];
        }
    }
    coef[..14].copy_from_slice(&words_of(&co));
    coef[COEF_SKIP] = 0.0;
    c[ctl::STEP] = f32::from_bits(t_u);
    c[ctl::LAST_SKIP] = 0.0;
}

/// `adam_commit_amaxes` on host slices.
pub(super) fn commit_amaxes(
    skip: bool,
    agreed: &[f32],
    per_slot: usize,
    amaxes: &mut [f32],
    scales: &mut [f32],
    write: Option<&[f32]>,
    weight_amax: &mut [f32],
) {
    if skip {
        weight_amax.fill(0.0);
        return;
    }
    let n = weight_amax.len();
    for i in 0..n {
        for k in 0..3 {
            amaxes[3 * i + k] = if k < per_slot {
                agreed[per_slot * i + k]
            } else {
                0.0
            };
        }
        weight_amax[i] = agreed[per_slot * i];
    }
    if let Some(w) = write {
        scales[..3 * n].copy_from_slice(&w[..3 * n]);
    }
}

/// The host view of a [`super::control::MasterSource`]: the whole master, and for F16 its scale.
pub(super) enum HostSource<'a> {
    F32(&'a [f32]),
    F16 { master: &'a [f16], scale: f32 },
}

/// `out` (the elements `range` of a weight) = the values the FP8 weight is cast from.
pub(super) fn weight_source_values(
    skip: bool,
    out: &mut [f32],
    fp8: &[u8],
    scale_inv: f32,
    source: HostSource<'_>,
    range: Range<usize>,
) {
    if skip {
        for (x, &c) in out.iter_mut().zip(fp8) {
            *x = Fp8Format::E4M3.decode(c) * scale_inv;
        }
        return;
    }
    match source {
        HostSource::F32(m) => out.copy_from_slice(&m[range]),
        HostSource::F16 { master, scale } => {
            let inv = 1.0 / scale;
            for (x, h) in out.iter_mut().zip(&master[range]) {
                *x = h.to_f32() * inv;
            }
        }
    }
}

/// The F32 values of `source` over `range`, as [`weight_source_values`] computes them on a step that is not
/// skipped (borrowed for an F32 master, decoded for an F16 one).
pub(super) fn master_values(source: HostSource<'_>, range: Range<usize>) -> Cow<'_, [f32]> {
    match source {
        HostSource::F32(m) => Cow::Borrowed(&m[range]),
        f16_source @ HostSource::F16 { .. } => {
            let mut out = vec![0.0f32; range.len()];
            weight_source_values(false, &mut out, &[], 0.0, f16_source, range);
            Cow::Owned(out)
        }
    }
}

/// `fp8` (the elements `range` of a weight) cast in place from its source with `(scale, scale_inv)`.
pub(super) fn cast_weight_source(
    skip: bool,
    fp8: &mut [u8],
    (s, si): (f32, f32),
    source: HostSource<'_>,
    range: Range<usize>,
) {
    let e4m3 = Fp8Format::E4M3;
    if skip {
        fp8.par_chunks_mut(CHUNK).for_each(|c| {
            for x in c.iter_mut() {
                *x = e4m3.encode(e4m3.decode(*x) * si * s);
            }
        });
        return;
    }
    match source {
        HostSource::F32(m) => {
            fp8.par_chunks_mut(CHUNK)
                .zip(m[range].par_chunks(CHUNK))
                .for_each(|(q, m)| {
                    for (x, &w) in q.iter_mut().zip(m) {
                        *x = e4m3.encode(w * s);
                    }
                });
        }
        HostSource::F16 { master, scale } => {
            let inv = 1.0 / scale;
            fp8.par_chunks_mut(CHUNK)
                .zip(master[range].par_chunks(CHUNK))
                .for_each(|(q, m)| {
                    for (x, h) in q.iter_mut().zip(m) {
                        *x = e4m3.encode(h.to_f32() * inv * s);
                    }
                });
        }
    }
}
