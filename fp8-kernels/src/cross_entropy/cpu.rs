//! The CPU implementation of the cross-entropy kernel (rayon over rows): the reference the CUDA kernel is
//! tested against. It simulates the kernel's 512 threads per row, its butterflies and its exp / log
//! evaluations operation for operation, so the two agree bit for bit.

use crate::cpu_kernel::xor_butterfly;
use crate::FloatElement;
use fp8_core::Fp8Format;
use rayon::prelude::*;

/// Threads per row of the CUDA kernel (`CE_THREADS`).
const THREADS: usize = 512;
/// Threads of the loss-sum kernel (`CE_SUM_THREADS`).
const SUM_THREADS: usize = 256;
const LOWEST: f32 = f32::MIN;

/// The constants of [`exp_fixed`] / [`ln_fixed`] as f32 bit patterns, identical in the kernel (Cephes'
/// expf and logf coefficients).
const LOG2E: f32 = f32::from_bits(0x3FB8_AA3B); // 1.44269504
const LN2_HI: f32 = f32::from_bits(0x3F31_8000); // 0.693359375
const LN2_LO: f32 = f32::from_bits(0xB95E_8083); // -2.12194440e-4
const SQRTH: f32 = f32::from_bits(0x3F35_04F3); // 0.70710678
const TWO_M64: f32 = f32::from_bits(0x1F80_0000); // 2^-64
const TWO_P64: f32 = f32::from_bits(0x5F80_0000); // 2^64

/// The f32 values of bit patterns.
const fn f32_array<const N: usize>(bits: [u32; N]) -> [f32; N] {
    let mut out = [0.0f32; N];
    let mut i = 0;
    while i < N {
        out[i] = f32::from_bits(bits[i]);
        i += 1;
    }
    out
}
/// 1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1.
const EXP_P: [f32; 6] = f32_array([
    0x3950_6967,
    0x3AB7_43CE,
    0x3C08_8908,
    0x3D2A_A9C1,
    0x3E2A_AAAA,
    0x3F00_0000,
]);
/// 7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
/// -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1.
const LOG_P: [f32; 9] = f32_array([
    0x3D90_21BB,
    0xBDEB_D1B8,
    0x3DEF_251A,
    0xBDFE_5D4F,
    0x3E11_E9BF,
    0xBE2A_AE50,
    0x3E4C_CEAC,
    0xBE7F_FFFC,
    0x3EAA_AAAA,
]);

/// `exp(x)` as the kernels compute it: Cody-Waite reduction by ln 2 with `k = rint(x log2 e)`, Cephes'
/// degree-5 polynomial on `[-ln2/2, ln2/2]` evaluated with fused multiply-adds, then `y * 2^k` rounded
/// once (two exact power-of-two steps, no branch). About 1 ulp from the true value; `exp(0) = 1` exactly;
/// arguments are clamped to `[-104, 89]` (results 0 and +inf at the ends); NaN propagates (the clamp is
/// two selects that keep NaN, and `NaN as i32` is 0 as the kernel's `__float2int_rz`).
pub fn exp_fixed(x: f32) -> f32 {
    let x = if x < -104.0 { -104.0 } else { x };
    let x = if x > 89.0 { 89.0 } else { x };
    let kf = (x * LOG2E).round_ties_even();
    let r = (-kf).mul_add(LN2_HI, x);
    let r = (-kf).mul_add(LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // k is in -150..=128: y * 2^(k -+ 64) is exact, the multiplication by 2^(+-64) rounds once.
    let k = kf as i32;
    let (k2, f) = if k > 63 {
        (k - 64, TWO_P64)
    } else {
        (k + 64, TWO_M64)
    };
    (y * f32::from_bits(((k2 + 127) as u32) << 23)) * f
}

/// `ln(x)` as the kernels compute it: `x = m 2^e` with `m` in `[sqrt(1/2), sqrt(2))`, Cephes' logf
/// polynomial in `m - 1` with fused multiply-adds. NaN for NaN and negative inputs, `-inf` for 0.
pub fn ln_fixed(x: f32) -> f32 {
    if x.is_nan() || x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    let mut bits = x.to_bits();
    let mut e = 0i32;
    if bits < 0x0080_0000 {
        bits = (x * 8_388_608.0).to_bits();
        e = -23;
    }
    e += (bits >> 23) as i32 - 126;
    let mut m = f32::from_bits((bits & 0x007F_FFFF) | 0x3F00_0000);
    if m < SQRTH {
        e -= 1;
        m = (m + m) + -1.0;
    } else {
        m += -1.0;
    }
    let z = m * m;
    let mut y = LOG_P[0];
    for &c in &LOG_P[1..] {
        y = y.mul_add(m, c);
    }
    y = (y * m) * z;
    let fe = e as f32;
    y = fe.mul_add(LN2_LO, y);
    y = (-0.5f32).mul_add(z, y);
    fe.mul_add(LN2_HI, m + y)
}

/// The kernel's combination of two online (max, sum) pairs.
#[inline]
fn combine((m, s): (f32, f32), (m2, s2): (f32, f32)) -> (f32, f32) {
    let big = if m2 > m { m2 } else { m };
    (big, s * exp_fixed(m + -big) + s2 * exp_fixed(m2 + -big))
}

/// `__shfl_xor_sync` butterfly of [`combine`] over 32 lanes; every lane ends with lane 0's value.
fn butterfly(p: [(f32, f32); 32]) -> (f32, f32) {
    xor_butterfly(p, combine)
}

/// The log-sum-exp of one row in the kernel's order.
pub(crate) fn row_lse<T: FloatElement>(row: &[T]) -> f32 {
    let vocab = row.len();
    let mut state = vec![(LOWEST, 0.0f32); THREADS];
    for j in 0..vocab.div_ceil(8) {
        let (m, s) = &mut state[j % THREADS];
        let v = &row[8 * j..(8 * j + 8).min(vocab)];
        let mut vm = LOWEST;
        for x in v {
            let x = x.to_f32();
            if x > vm {
                vm = x;
            }
        }
        if vm > *m {
            *s *= exp_fixed(*m + -vm);
            *m = vm;
        }
        for x in v {
            *s += exp_fixed(x.to_f32() + -*m);
        }
    }
    let warps: Vec<(f32, f32)> = state
        .chunks(32)
        .map(|w| {
            let mut lanes = [(0.0f32, 0.0f32); 32];
            lanes.copy_from_slice(w);
            butterfly(lanes)
        })
        .collect();
    let mut lanes = [(LOWEST, 0.0f32); 32];
    lanes[..warps.len()].copy_from_slice(&warps);
    let (m, s) = butterfly(lanes);
    m + ln_fixed(s)
}

/// What one row produced.
pub(crate) struct RowResult {
    pub lse: f32,
    pub loss: f32,
    pub invalid: bool,
}

/// One row's log-sum-exp and loss, and whether its target is valid.
fn row_stats<T: FloatElement>(
    logits: &[T],
    target: i32,
    ignore_index: Option<i32>,
) -> (RowResult, bool) {
    let vocab = logits.len();
    let ignored = ignore_index == Some(target);
    let valid = !ignored && target >= 0 && (target as usize) < vocab;
    let xt = if valid {
        logits[target as usize].to_f32()
    } else {
        0.0
    };
    let lse = row_lse(logits);
    let loss = if ignored {
        0.0
    } else if valid {
        lse + -xt
    } else {
        f32::NAN
    };
    let res = RowResult {
        lse,
        loss,
        invalid: !ignored && !valid,
    };
    (res, valid)
}

/// The gradient of entry `e` holding `x`, in f32 before the rounding to the logits' type.
#[inline]
fn gradient(x: f32, e: usize, target: i32, valid: bool, lse: f32, gs: f32) -> f32 {
    let mut p = exp_fixed(x + -lse);
    if valid && e == target as usize {
        p += -1.0;
    }
    if valid {
        p * gs
    } else {
        0.0
    }
}

/// One row: log-sum-exp, loss, and (with `grad_scale`) the gradient written over the row.
pub(crate) fn row<T: FloatElement>(
    logits: &mut [T],
    target: i32,
    ignore_index: Option<i32>,
    grad_scale: Option<f32>,
) -> RowResult {
    let (res, valid) = row_stats(logits, target, ignore_index);
    if let Some(gs) = grad_scale {
        for (e, v) in logits.iter_mut().enumerate() {
            *v = T::from_f32(gradient(v.to_f32(), e, target, valid, res.lse, gs));
        }
    }
    res
}

/// [`rows`] with the gradient as FP8 codes `encode(round_T(g) * scale)` in `codes`, the logits unchanged.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows_to_codes<T: FloatElement>(
    logits: &[T],
    vocab: usize,
    targets: &[i32],
    ignore_index: Option<i32>,
    grad_scale: f32,
    (codes, format, scale): (&mut [u8], Fp8Format, f32),
    lse: &mut [f32],
    loss: &mut [f32],
) -> u32 {
    logits
        .par_chunks(vocab)
        .zip(codes.par_chunks_mut(vocab))
        .zip(targets.par_iter())
        .zip(lse.par_iter_mut().zip(loss.par_iter_mut()))
        .map(|(((r, c), &t), (l, lo))| {
            let (res, valid) = row_stats(r, t, ignore_index);
            for (e, (x, code)) in r.iter().zip(c.iter_mut()).enumerate() {
                let g = gradient(x.to_f32(), e, t, valid, res.lse, grad_scale);
                *code = format.encode(T::from_f32(g).to_f32() * scale);
            }
            *l = res.lse;
            *lo = res.loss;
            res.invalid as u32
        })
        .sum()
}

/// Every row of `logits` (`rows x vocab`) with its target; fills `lse` and `loss` (one per row) and returns
/// the number of invalid targets.
pub(crate) fn rows<T: FloatElement>(
    logits: &mut [T],
    vocab: usize,
    targets: &[i32],
    ignore_index: Option<i32>,
    grad_scale: Option<f32>,
    lse: &mut [f32],
    loss: &mut [f32],
) -> u32 {
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .zip(lse.par_iter_mut().zip(loss.par_iter_mut()))
        .map(|((r, &t), (l, lo))| {
            let res = row(r, t, ignore_index, grad_scale);
            *l = res.lse;
            *lo = res.loss;
            res.invalid as u32
        })
        .sum()
}

/// The loss-sum kernel's order: 256 strided partial sums from zero, warp butterflies, then a butterfly of
/// the 8 warp sums (24 zero lanes).
pub(crate) fn loss_sum(loss: &[f32]) -> f32 {
    let mut part = [0.0f32; SUM_THREADS];
    for (i, &v) in loss.iter().enumerate() {
        part[i % SUM_THREADS] += v;
    }
    let sum_butterfly = |p: [f32; 32]| xor_butterfly(p, |a, b| a + b);
    let mut lanes = [0.0f32; 32];
    for (w, chunk) in part.chunks(32).enumerate() {
        let mut p = [0.0f32; 32];
        p.copy_from_slice(chunk);
        lanes[w] = sum_butterfly(p);
    }
    sum_butterfly(lanes)
}
