//! Reduction order and per-step arithmetic, shared by the thread backend and the tests.
//!
//! NCCL's ring reduce-scatter sends the partial sum of chunk `c` around the ring: it starts as rank
//! `c+1`'s value, each following rank adds its own value and rounds to the element type, and rank `c`
//! adds its value last. [`ring_order`] is that order (ranks taken modulo the world size); the thread
//! backend applies it to every reduction, so results are reproducible run to run and follow NCCL's
//! rounding:
//!
//! - f32: each step is an f32 addition (rounded to nearest even);
//! - bf16 / f16: each step is the correctly rounded sum in the type (computed as an f32 sum of the two
//!   operands, then rounded to the type: double rounding through f32 is exact for one addition, because
//!   f32 has at least `2p + 2` significand bits for these types);
//! - FP8: each step is `fp8(f16(a + b))` with saturation, what NCCL does (`__hadd` on the two values
//!   widened to half, then a `satfinite` conversion back): decode both codes to f32, add in f32 (exact
//!   or correctly rounded), round to f16 with RNE, encode that value to FP8 with round-to-nearest-even
//!   and saturation ([`fp8_core::Fp8Format::encode`]). NaN stays NaN; an infinity (E5M2) or an
//!   overflow saturates to the largest finite value.
//! - max / min: NaN loses against a number (`fmaxf`); these are exact, so the order only matters for
//!   signed zeros.
//!
//! All-reduce uses the same chains: the buffer is split into `world_size` contiguous chunks
//! ([`chunk_range`]) and the elements of chunk `c` are reduced in `ring_order(c)`. (NCCL slices an
//! all-reduce further by channel and loop, so for several ranks its chain start may differ element by
//! element; the error bound of the FP8 sum does not depend on the order.)
//!
//! ## Error bound of the FP8 sum
//! With `u = 2^-(m+1)` (`m` = 3 mantissa bits for E4M3, 2 for E5M2) each step rounds the exact sum
//! `t_k = s_{k-1} + x_k` of the incoming partial and the local value to the nearest FP8 value, so
//! `|s_k - t_k| <= u * |t_k|` in the normal range and `<= min_subnormal / 2` below it (the f16 step in
//! between does not change the result: f16 has 11 >= 2p + 2 significand bits). Summing the `N - 1`
//! steps, when no partial exceeds the largest finite value:
//!
//! `|s_N - sum(x)| <= (N - 1) * (u * max_k |t_k| + min_subnormal / 2)`.

use crate::collective::ReduceOp;
use fp8_core::Fp8Format;
use half::{bf16, f16};
use std::ops::Range;

/// The ranks that add to chunk `chunk`, in order: `chunk+1, chunk+2, ..., chunk` (mod `world_size`).
/// The first rank's value starts the partial result; the last one is the chunk's owner.
pub fn ring_order(chunk: usize, world_size: usize) -> impl Iterator<Item = usize> {
    (1..=world_size).map(move |k| (chunk + k) % world_size.max(1))
}

/// Elements of chunk `chunk` when `len` elements are split into `world_size` contiguous chunks:
/// `chunk*len/world_size .. (chunk+1)*len/world_size`.
pub fn chunk_range(len: usize, world_size: usize, chunk: usize) -> Range<usize> {
    let n = world_size.max(1) as u128;
    let l = len as u128;
    let start = (chunk as u128 * l / n) as usize;
    let end = ((chunk as u128 + 1) * l / n) as usize;
    start..end
}

/// Element types the ring reductions work on.
pub trait RingElement: Copy + Send + Sync + 'static {
    /// One step of the reduction: the partial result `acc` combined with the next rank's `x`, rounded
    /// to the element type as NCCL does.
    fn combine(op: ReduceOp, acc: Self, x: Self) -> Self;
}

fn max_nan_loses(a: f32, b: f32) -> f32 {
    // f32::max returns the non-NaN operand, like fmaxf.
    a.max(b)
}

fn min_nan_loses(a: f32, b: f32) -> f32 {
    a.min(b)
}

impl RingElement for f32 {
    fn combine(op: ReduceOp, acc: f32, x: f32) -> f32 {
        match op {
            ReduceOp::Sum => acc + x,
            ReduceOp::Max => max_nan_loses(acc, x),
            ReduceOp::Min => min_nan_loses(acc, x),
        }
    }
}

impl RingElement for bf16 {
    fn combine(op: ReduceOp, acc: bf16, x: bf16) -> bf16 {
        bf16::from_f32(f32::combine(op, acc.to_f32(), x.to_f32()))
    }
}

impl RingElement for f16 {
    fn combine(op: ReduceOp, acc: f16, x: f16) -> f16 {
        f16::from_f32(f32::combine(op, acc.to_f32(), x.to_f32()))
    }
}

/// One FP8 step: `fp8(f16(a + b))` with saturation for sums; exact max/min.
pub fn fp8_combine(format: Fp8Format, op: ReduceOp, acc: u8, x: u8) -> u8 {
    let a = format.decode(acc);
    let b = format.decode(x);
    match op {
        ReduceOp::Sum => format.encode(f16::from_f32(a + b).to_f32()),
        ReduceOp::Max => format.encode(max_nan_loses(a, b)),
        ReduceOp::Min => format.encode(min_nan_loses(a, b)),
    }
}

/// [`fp8_combine`] for every pair of codes, `table[(acc << 8) | x]`: the thread backend's fast path
/// (built once per format and operation from `fp8_combine`, so it is the same function).
pub fn fp8_combine_table(format: Fp8Format, op: ReduceOp) -> &'static [u8] {
    use std::sync::OnceLock;
    static TABLES: [OnceLock<Vec<u8>>; 6] = [const { OnceLock::new() }; 6];
    let f = match format {
        Fp8Format::E4M3 => 0,
        Fp8Format::E5M2 => 1,
    };
    let o = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    };
    TABLES[f * 3 + o].get_or_init(|| {
        (0..=u16::MAX)
            .map(|i| fp8_combine(format, op, (i >> 8) as u8, (i & 0xFF) as u8))
            .collect()
    })
}

/// Writes into `out` the reduction of `inputs[r][range]` over ranks `r`, for chunk `chunk`'s ring
/// order. `inputs` holds one slice per rank (all of one length); `out.len() == range.len()`.
///
/// Rank by rank over the whole range (the first rank's values start the partial results, each next rank
/// is combined into them), which is the same per-element chain as NCCL's and vectorises.
pub fn reduce_chunk_with<T: Copy>(
    inputs: &[&[T]],
    chunk: usize,
    range: Range<usize>,
    out: &mut [T],
    combine: impl Fn(T, T) -> T,
) {
    if inputs.is_empty() {
        return;
    }
    let mut order = ring_order(chunk, inputs.len());
    let first = order.next().unwrap_or(0);
    out.copy_from_slice(&inputs[first][range.clone()]);
    for r in order {
        for (o, &x) in out.iter_mut().zip(&inputs[r][range.clone()]) {
            *o = combine(*o, x);
        }
    }
}

/// [`reduce_chunk_with`] for the float types.
pub fn reduce_chunk<T: RingElement>(
    inputs: &[&[T]],
    op: ReduceOp,
    chunk: usize,
    range: Range<usize>,
    out: &mut [T],
) {
    reduce_chunk_with(inputs, chunk, range, out, |a, b| T::combine(op, a, b));
}

/// [`reduce_chunk_with`] for FP8 codes of `format`.
pub fn reduce_chunk_fp8(
    inputs: &[&[u8]],
    format: Fp8Format,
    op: ReduceOp,
    chunk: usize,
    range: Range<usize>,
    out: &mut [u8],
) {
    let table = fp8_combine_table(format, op);
    reduce_chunk_with(inputs, chunk, range, out, |a, b| {
        table[((a as usize) << 8) | b as usize]
    });
}

/// The FP8 unit roundoff `2^-(m+1)` of the error bound in the module docs.
pub fn fp8_unit_roundoff(format: Fp8Format) -> f64 {
    (-(format.mantissa_bits() as f64 + 1.0)).exp2()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_order_ends_at_the_chunk_owner_and_visits_everyone() {
        for n in 1..=8 {
            for c in 0..n {
                let order: Vec<usize> = ring_order(c, n).collect();
                assert_eq!(order.len(), n);
                assert_eq!(*order.last().unwrap(), c);
                assert_eq!(order[0], (c + 1) % n);
                let mut sorted = order.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn chunks_tile_the_buffer() {
        for len in [0usize, 1, 5, 7, 64, 1001] {
            for n in 1..=8 {
                let mut next = 0;
                for c in 0..n {
                    let r = chunk_range(len, n, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn fp8_step_rounds_through_half_and_saturates() {
        let f = Fp8Format::E4M3;
        // 448 + 448 saturates to 448 (0x7E); NaN stays NaN.
        assert_eq!(fp8_combine(f, ReduceOp::Sum, 0x7E, 0x7E), 0x7E);
        assert!(f.is_nan(fp8_combine(f, ReduceOp::Sum, 0x7F, 0x38)));
        // 1 + 0.0625 = 1.0625: halfway between 1 and 1.125, ties to even (1.0).
        let one = f.encode(1.0);
        let small = f.encode(0.0625);
        assert_eq!(f.decode(fp8_combine(f, ReduceOp::Sum, one, small)), 1.0);
        // E5M2: infinity saturates; max keeps the number over NaN.
        let e = Fp8Format::E5M2;
        assert_eq!(e.decode(fp8_combine(e, ReduceOp::Sum, 0x7C, 0x3C)), 57344.0);
        assert_eq!(e.decode(fp8_combine(e, ReduceOp::Max, 0x7F, 0x3C)), 1.0);
    }

    #[test]
    fn tables_agree_with_the_step_function() {
        for f in Fp8Format::ALL {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let t = fp8_combine_table(f, op);
                assert_eq!(t.len(), 65536);
                for a in (0..=255u8).step_by(3) {
                    for b in 0..=255u8 {
                        assert_eq!(
                            t[((a as usize) << 8) | b as usize],
                            fp8_combine(f, op, a, b)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn order_matters_for_rounded_sums() {
        // In E4M3 1 + 0.0625 + 0.0625: starting from 1 both small terms are lost (ties to even), but
        // summing the small ones first keeps them. A fixed order is what makes results reproducible.
        let f = Fp8Format::E4M3;
        let one = f.encode(1.0);
        let s = f.encode(0.0625);
        let ranks: Vec<Vec<u8>> = vec![vec![s], vec![one], vec![s]];
        let inputs: Vec<&[u8]> = ranks.iter().map(|v| v.as_slice()).collect();
        let mut out = [0u8];
        // chunk 0 on 3 ranks: 1 (one), 2 (s), 0 (s) -> 1 + s = 1, 1 + s = 1.
        reduce_chunk_fp8(&inputs, f, ReduceOp::Sum, 0, 0..1, &mut out);
        assert_eq!(f.decode(out[0]), 1.0);
        // chunk 1: 2 (s), 0 (s), 1 (one) -> 0.125 + 1 = 1.125.
        reduce_chunk_fp8(&inputs, f, ReduceOp::Sum, 1, 0..1, &mut out);
        assert_eq!(f.decode(out[0]), 1.125);
    }
}
