//! The CPU embedding kernels (the reference of the CUDA kernels) against plain implementations: the
//! grouping of a batch's ids, the forward gather (exact for f32 outputs, one rounding for bf16), the
//! backward against f64 sums and against the documented summation order bit for bit, "add into"
//! semantics, and argument errors.

use fp8_kernels::embedding::{
    embedding_backward, embedding_backward_at, embedding_forward, PositionGrad, PositionTable,
    RowGroups, EMBEDDING_CHUNK,
};
use fp8_kernels::{Buffer, Device, FloatElement};
use half::bf16;
use proptest::prelude::*;

fn to_t<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

/// A batch: (vocab, d, seq, ids). Ids are drawn from a small range sometimes, so ids repeat (and some
/// repeat more than EMBEDDING_CHUNK times).
fn batch() -> impl Strategy<Value = (usize, usize, usize, Vec<i32>)> {
    (1usize..60, 1usize..40, 1usize..5, 1usize..30, any::<bool>()).prop_flat_map(
        |(vocab, d, batch, seq, narrow)| {
            let hi = if narrow { vocab.min(3) } else { vocab } as i32;
            (
                Just(vocab),
                Just(d),
                Just(seq),
                proptest::collection::vec(0..hi, batch * seq),
            )
        },
    )
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = fp8_kernels::rng::SplitMix64::new(seed);
    (0..n).map(|_| rng.uniform_f32() * 3.0).collect()
}

proptest! {
    #[test]
    fn grouping_covers_every_position_once((vocab, _d, _seq, ids) in batch()) {
        let g = RowGroups::from_ids(&Device::cpu(), &ids, vocab).unwrap();
        prop_assert_eq!(g.len(), ids.len());
        let u = g.unique_ids();
        prop_assert!(u.windows(2).all(|w| w[0] < w[1]));
        let mut seen = vec![false; ids.len()];
        for (k, &id) in u.iter().enumerate() {
            let p = g.positions(k);
            prop_assert!(!p.is_empty());
            prop_assert!(p.windows(2).all(|w| w[0] < w[1]));
            for &q in p {
                prop_assert_eq!(ids[q as usize], id);
                prop_assert!(!seen[q as usize]);
                seen[q as usize] = true;
            }
        }
        prop_assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn forward_gathers_rows((vocab, d, seq, ids) in batch(), with_pos in any::<bool>()) {
        let dev = Device::cpu();
        let n = ids.len();
        let table = to_t::<bf16>(&values(vocab * d, 1));
        let pos = to_t::<bf16>(&values((seq + 2) * d, 2));
        let g = RowGroups::from_ids(&dev, &ids, vocab).unwrap();
        let tb = dev.upload(&table).unwrap();
        let pb = dev.upload(&pos).unwrap();
        let positions = with_pos.then_some(PositionTable { table: &pb, seq });
        let mut out32 = dev.zeros::<f32>(n * d).unwrap();
        embedding_forward(&tb, d, positions, &g, &mut out32).unwrap();
        let mut out16 = dev.zeros::<bf16>(n * d).unwrap();
        embedding_forward(&tb, d, positions, &g, &mut out16).unwrap();
        let (o32, o16) = (out32.to_vec().unwrap(), out16.to_vec().unwrap());
        for p in 0..n {
            for c in 0..d {
                let mut want = table[ids[p] as usize * d + c].to_f32() as f64;
                if with_pos {
                    want += pos[(p % seq) * d + c].to_f32() as f64;
                }
                // f32: the exact sum rounded once; bf16: within one bf16 ulp of it.
                prop_assert_eq!(o32[p * d + c], want as f32);
                let got = o16[p * d + c].to_f32() as f64;
                prop_assert!((got - want).abs() <= 2f64.powi(-8) * want.abs());
            }
        }
    }

    #[test]
    fn backward_adds_the_sums((vocab, d, seq, ids) in batch()) {
        let dev = Device::cpu();
        let n = ids.len();
        let dy = values(n * d, 3);
        let old_t = values(vocab * d, 4);
        let old_p = values(seq * d, 5);
        let g = RowGroups::from_ids(&dev, &ids, vocab).unwrap();
        let dyb = dev.upload(&dy).unwrap();
        let mut dt = dev.upload(&old_t).unwrap();
        let mut dp = dev.upload(&old_p).unwrap();
        embedding_backward(&dyb, d, &g, &mut dt, Some(PositionGrad { grad: &mut dp, seq })).unwrap();
        let (dt, dp) = (dt.to_vec().unwrap(), dp.to_vec().unwrap());
        // The documented order, bit for bit: per id, chunks of EMBEDDING_CHUNK positions summed from zero,
        // chunk sums left to right, then added to the old value.
        for row in 0..vocab {
            let positions: Vec<usize> = (0..n).filter(|&p| ids[p] as usize == row).collect();
            for c in 0..d {
                let mut total: Option<f32> = None;
                let mut abs = 0.0f64;
                let mut exact = 0.0f64;
                for chunk in positions.chunks(EMBEDDING_CHUNK) {
                    let mut s = 0.0f32;
                    for &p in chunk {
                        s += dy[p * d + c];
                        abs += dy[p * d + c].abs() as f64;
                        exact += dy[p * d + c] as f64;
                    }
                    total = Some(match total { None => s, Some(t) => t + s });
                }
                let old = old_t[row * d + c];
                let want = total.map_or(old, |t| old + t);
                prop_assert_eq!(dt[row * d + c].to_bits(), want.to_bits(), "row {} col {}", row, c);
                let e = old as f64 + exact;
                prop_assert!((dt[row * d + c] as f64 - e).abs() <= 1e-6 * (abs + old.abs() as f64) + 1e-30);
            }
        }
        let batch = n / seq;
        for t in 0..seq {
            for c in 0..d {
                let mut s = 0.0f32;
                for b in 0..batch {
                    s += dy[(b * seq + t) * d + c];
                }
                prop_assert_eq!(dp[t * d + c].to_bits(), (old_p[t * d + c] + s).to_bits());
            }
        }
    }

    #[test]
    fn backward_at_an_offset_equals_a_temporary_added_there(
        (vocab, d, seq, ids) in batch(),
        before in 0usize..40,
        after in 0usize..40,
    ) {
        // A flat gradient holding other values around the table's range (a tied head's gradient, other
        // parameters): the in-place form adds into the range and touches nothing else, with the bits of
        // a zeroed temporary added afterwards.
        let dev = Device::cpu();
        let n = ids.len();
        let dyb = dev.upload(&values(n * d, 6)).unwrap();
        let flat = values(before + vocab * d + after, 7);
        let g = RowGroups::from_ids(&dev, &ids, vocab).unwrap();
        let mut at = dev.upload(&flat).unwrap();
        embedding_backward_at(&dyb, d, &g, (&mut at, before), None).unwrap();
        let mut tmp = dev.zeros::<f32>(vocab * d).unwrap();
        embedding_backward(&dyb, d, &g, &mut tmp, None).unwrap();
        let tmp = tmp.to_vec().unwrap();
        let mut want = flat.clone();
        for (w, t) in want[before..before + vocab * d].iter_mut().zip(&tmp) {
            *w += *t;
        }
        let got = at.to_vec().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert_eq!(a.to_bits(), b.to_bits(), "element {}", i);
        }
        // A range that does not fit is refused.
        let mut short = dev.zeros::<f32>(before + vocab * d).unwrap();
        prop_assert!(embedding_backward_at(&dyb, d, &g, (&mut short, before + 1), None).is_err());
        let _ = seq;
    }
}

#[test]
fn bf16_gradients_round_once() {
    let dev = Device::cpu();
    let (vocab, d) = (5, 3);
    let ids = [1i32, 1, 4];
    let g = RowGroups::from_ids(&dev, &ids, vocab).unwrap();
    let dy: Vec<bf16> = to_t(&[0.5, 1.0, 1.5, 0.25, 0.125, 2.0, 3.0, 3.0, 3.0]);
    let dyb = dev.upload(&dy).unwrap();
    let mut dt: Buffer<bf16> = dev.upload(&to_t(&[1.0; 15])).unwrap();
    embedding_backward(&dyb, d, &g, &mut dt, None).unwrap();
    let dt: Vec<f32> = dt.to_vec().unwrap().iter().map(|v| v.to_f32()).collect();
    assert_eq!(&dt[3..6], &[1.75, 2.125, 4.5]);
    assert_eq!(&dt[12..15], &[4.0, 4.0, 4.0]);
    assert!(dt[..3].iter().chain(&dt[6..12]).all(|&v| v == 1.0));
}

#[test]
fn a_frequent_id_is_split_into_chunks() {
    // 100 positions of one id: 4 chunks, two levels; compare with the documented order.
    let dev = Device::cpu();
    let ids = vec![2i32; 100];
    let d = 5;
    let dy = values(100 * d, 8);
    let g = RowGroups::from_ids(&dev, &ids, 3).unwrap();
    let dyb = dev.upload(&dy).unwrap();
    let mut dt = dev.zeros::<f32>(3 * d).unwrap();
    embedding_backward(&dyb, d, &g, &mut dt, None).unwrap();
    let dt = dt.to_vec().unwrap();
    for c in 0..d {
        let sums: Vec<f32> = (0..100)
            .collect::<Vec<usize>>()
            .chunks(EMBEDDING_CHUNK)
            .map(|ch| ch.iter().fold(0.0f32, |s, &p| s + dy[p * d + c]))
            .collect();
        let total = sums[1..].iter().fold(sums[0], |t, s| t + s);
        assert_eq!(dt[2 * d + c].to_bits(), (0.0 + total).to_bits());
    }
}

#[test]
fn invalid_arguments_are_errors() {
    let dev = Device::cpu();
    let e = RowGroups::from_ids(&dev, &[0, 3, 7], 5).unwrap_err();
    assert!(e.to_string().contains("id 7 at position 2"), "{e}");
    assert!(RowGroups::from_ids(&dev, &[-1], 5).is_err());
    let g = RowGroups::from_ids(&dev, &[0, 1, 2, 3], 5).unwrap();
    let table = dev.zeros::<f32>(5 * 4).unwrap();
    let mut out = dev.zeros::<f32>(4 * 4).unwrap();
    assert!(embedding_forward(&table, 4, None, &g, &mut out).is_ok());
    assert!(embedding_forward(&table, 5, None, &g, &mut out).is_err());
    assert!(embedding_forward(&table, 0, None, &g, &mut out).is_err());
    let pos = dev.zeros::<f32>(3 * 4).unwrap();
    let positions = |seq| Some(PositionTable { table: &pos, seq });
    assert!(
        embedding_forward(&table, 4, positions(3), &g, &mut out).is_err(),
        "4 positions are not whole sequences of 3"
    );
    assert!(
        embedding_forward(&table, 4, positions(4), &g, &mut out).is_err(),
        "3 rows < seq 4"
    );
    let dy = dev.zeros::<f32>(4 * 4).unwrap();
    let mut dt = dev.zeros::<f32>(4 * 4).unwrap();
    assert!(embedding_backward(&dy, 4, &g, &mut dt, None).is_err());
}
