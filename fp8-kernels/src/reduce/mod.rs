//! Reductions: sums over the rows or the columns of a matrix in fixed orders both devices reproduce, the
//! amax and count of non-finite values of a buffer, and the norm statistics of a range (sum of squares of
//! the finite values, non-finite count, amax) accumulated over several ranges and finished once.
//!
//! Every function runs where its buffers live: the CPU (`cpu.rs`) or the buffers' GPU (`cuda.rs`,
//! `reduce.cu`), where results stay on the device.

mod cpu;
mod cuda;

use crate::device::{device_of, dispatch, shape_len};
use crate::{check_len, Buffer, FloatElement, KernelError};
use std::ops::Range;

/// Rows per chunk of [`sum_over_rows`]: at least 64, about `sqrt(rows)` for tall inputs, so both levels
/// of the sum are short.
pub fn sum_rows_chunk(rows: usize) -> usize {
    let mut r = (rows as f64).sqrt() as usize;
    while r * r < rows {
        r += 1;
    }
    r.max(64)
}

/// Column sums of a row-major `[rows, cols]` tensor: `out[c] = sum_r x[r, c]`, identical on both devices
/// (e.g. the gradient of a bias added to every row). The order is fixed in two levels: rows are cut into
/// chunks of [`sum_rows_chunk`]`(rows)` rows, each chunk summed in row order from zero, then the chunk
/// sums are added in chunk order starting from the first (one chunk, i.e. up to 64 rows: plain row order).
pub fn sum_over_rows<T: FloatElement>(
    x: &Buffer<T>,
    rows: usize,
    cols: usize,
    out: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "sum_over_rows";
    check_len(WHAT, shape_len(WHAT, &[rows, cols])?, x.len())?;
    check_len(WHAT, cols, out.len())?;
    let chunk = sum_rows_chunk(rows);
    dispatch!(WHAT, [x, out],
        cpu: cpu::sum_over_rows(x.host(WHAT)?, rows, cols, chunk, out.host_mut(WHAT)?),
        cuda(dev): cuda::sum_over_rows(&dev, x.cuda(WHAT)?, rows, cols, chunk, out.cuda_mut(WHAT)?))
}

/// The summation order of a warp reduction: 32 lane-strided partial sums, then a butterfly (xor 16, 8,
/// 4, 2, 1). The CPU uses it so row sums match the GPU bit for bit.
pub fn warp_order_sum(values: impl Iterator<Item = f32>) -> f32 {
    let mut p = [0.0f32; 32];
    for (i, v) in values.enumerate() {
        p[i & 31] += v;
    }
    crate::cpu_kernel::xor_butterfly(p, |a, b| a + b)
}

/// Row sums of a row-major `[rows, cols]` tensor: `out[r] = sum_c x[r, c]`, in the warp order of
/// [`warp_order_sum`] (identical on both devices).
pub fn sum_over_cols<T: FloatElement>(
    x: &Buffer<T>,
    rows: usize,
    cols: usize,
    out: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "sum_over_cols";
    check_len(WHAT, shape_len(WHAT, &[rows, cols])?, x.len())?;
    check_len(WHAT, rows, out.len())?;
    dispatch!(WHAT, [x, out],
        cpu: cpu::sum_over_cols(x.host(WHAT)?, cols, out.host_mut(WHAT)?),
        cuda(dev): cuda::sum_over_cols(&dev, x.cuda(WHAT)?, rows, cols, out.cuda_mut(WHAT)?))
}

/// `amax[0] = max(amax[0], max |x| over the finite x)` and `count[0] += the number of NaN or infinite
/// x` (e.g. the statistics of a gradient before an FP8 cast, which would saturate infinities).
pub fn finite_amax_count(
    x: &Buffer<f32>,
    amax: &mut Buffer<f32>,
    count: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "finite_amax_count";
    if amax.is_empty() || count.is_empty() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "amax and count need one element each".into(),
        });
    }
    let dev = device_of(WHAT, &[x, amax, count])?;
    if x.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let (a, c) = cpu::finite_amax_count(x.host(WHAT)?);
            let am = &mut amax.host_mut(WHAT)?[0];
            *am = am.max(a);
            let cn = &mut count.host_mut(WHAT)?[0];
            *cn = cn.wrapping_add(c as u32);
            Ok(())
        }
        Some(dev) => {
            let (xs, a) = (x.cuda(WHAT)?, amax.cuda_mut(WHAT)?);
            cuda::finite_amax_count(&dev, xs, a, count.cuda_mut(WHAT)?)
        }
    }
}

/// Words of the accumulator of [`norm_stats`]: the f64 sum of squares (two words), the `u32` count of
/// non-finite values, one word of padding.
pub const NORM_STATS_ACC_LEN: usize = 4;

/// Adds the statistics of `x[range]` to the accumulator `acc` ([`NORM_STATS_ACC_LEN`] words, zero at
/// first): the sum of squares of the finite values in f64 and the count of non-finite values; with `amax =
/// Some((buffer, slot))` it also raises `buffer[slot]` to the amax of the finite values. `x` is f32 or
/// bf16 (widened exactly). The CPU sums in order; the GPU's order is not fixed (f64 atomics), so the sum
/// of squares may differ in its last bits, the count and amax never.
pub fn norm_stats<T: FloatElement>(
    x: &Buffer<T>,
    range: Range<usize>,
    acc: &mut Buffer<f32>,
    amax: Option<(&mut Buffer<f32>, usize)>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_stats";
    if range.start > range.end || range.end > x.len() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("range {range:?} outside a buffer of {}", x.len()),
        });
    }
    check_at_least(WHAT, acc.len(), NORM_STATS_ACC_LEN)?;
    if let Some((b, s)) = &amax {
        check_at_least(WHAT, b.len(), s + 1)?;
    }
    dispatch!(WHAT, [x, acc, &amax.as_ref().map(|(b, _)| &**b)],
    cpu: {
        let (sq, nf, am) = cpu::norm_stats(&x.host(WHAT)?[range]);
        let a = acc.host_mut(WHAT)?;
        let old = f64::from_bits(a[0].to_bits() as u64 | ((a[1].to_bits() as u64) << 32));
        let bits = (old + sq).to_bits();
        a[0] = f32::from_bits(bits as u32);
        a[1] = f32::from_bits((bits >> 32) as u32);
        a[2] = f32::from_bits(a[2].to_bits().saturating_add(nf));
        if let Some((b, s)) = amax {
            let slot = &mut b.host_mut(WHAT)?[s];
            *slot = slot.max(am);
        }
    },
    cuda(dev): {
        let amax = match amax {
            Some((b, slot)) => Some((b.cuda_mut(WHAT)?, slot)),
            None => None,
        };
        cuda::norm_stats(&dev, x.cuda(WHAT)?, range, acc.cuda_mut(WHAT)?, amax)
    })
}

/// Finishes [`norm_stats`]: `sums[0] = ` the non-finite count of `acc` plus `extra_nonfinite`, `sums[1] =
/// ` the sum of squares rounded to f32; clears `acc` for the next accumulation.
pub fn norm_stats_finish(
    acc: &mut Buffer<f32>,
    extra_nonfinite: u32,
    sums: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_stats_finish";
    check_at_least(WHAT, acc.len(), NORM_STATS_ACC_LEN)?;
    check_at_least(WHAT, sums.len(), 2)?;
    dispatch!(WHAT, [acc, sums],
    cpu: {
        let a = acc.host_mut(WHAT)?;
        let sq = f64::from_bits(a[0].to_bits() as u64 | ((a[1].to_bits() as u64) << 32));
        let nf = a[2].to_bits().wrapping_add(extra_nonfinite);
        a.fill(0.0);
        let s = sums.host_mut(WHAT)?;
        s[0] = nf as f32;
        s[1] = sq as f32;
    },
    cuda(dev): {
        let (a, s) = (acc.cuda_mut(WHAT)?, sums.cuda_mut(WHAT)?);
        cuda::norm_stats_finish(&dev, a, extra_nonfinite, s)
    })
}

/// Moves a device counter of non-finite values into a [`norm_stats`] accumulator: `acc`'s count +=
/// `count[0]` (wrapping, as the accumulator counts) and `count[0] = 0`. E.g. the values an FP8 gradient
/// cast would have saturated, counted before it ([`finite_amax_count`]): the count reaches the step's
/// statistics without a read of the device.
pub fn norm_stats_take_count(
    acc: &mut Buffer<f32>,
    count: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_stats_take_count";
    check_at_least(WHAT, acc.len(), NORM_STATS_ACC_LEN)?;
    check_at_least(WHAT, count.len(), 1)?;
    dispatch!(WHAT, [acc, count],
    cpu: {
        let c = &mut count.host_mut(WHAT)?[0];
        let a = &mut acc.host_mut(WHAT)?[2];
        *a = f32::from_bits(a.to_bits().wrapping_add(*c));
        *c = 0;
    },
    cuda(dev): cuda::norm_stats_take_count(&dev, acc.cuda_mut(WHAT)?, count.cuda_mut(WHAT)?))
}

fn check_at_least(what: &'static str, len: usize, need: usize) -> Result<(), KernelError> {
    if len < need {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("buffer of {len} words, need {need}"),
        });
    }
    Ok(())
}
