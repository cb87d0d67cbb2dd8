//! Property tests of the segmented kernels, and of the kernels a sharded gradient path uses beside them
//! (add at an offset, dequantize-accumulate, finite amax and count, scale from one amax), against simple
//! sequential references, and (where a GPU can be opened) the CUDA implementations against the CPU ones,
//! bit for bit (needs a GPU: ignored unless run with `--ignored`).

mod common;

use common::{canon, cuda_device};
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use fp8_kernels::elementwise::add_at;
use fp8_kernels::reduce::{
    finite_amax_count, norm_stats, norm_stats_finish, norm_stats_take_count, NORM_STATS_ACC_LEN,
};
use fp8_kernels::segmented::{
    segmented_amax, segmented_cast, segmented_scales, Segment, SegmentTable,
};
use fp8_kernels::{add_decoded_fp8, scale_from_amax, Buffer, Device};
use half::bf16;
use proptest::prelude::*;

fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -1000.0f32..1000.0,
        1 => -1e-6f32..1e-6,
        1 => prop::sample::select(vec![0.0f32, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e38]),
    ]
}

/// A buffer length and segments over it: disjoint, sorted, with random slots below `slots`.
fn layout() -> impl Strategy<Value = (usize, Vec<Segment>, usize)> {
    (1usize..600, 1usize..6).prop_flat_map(|(len, slots)| {
        (
            Just(len),
            prop::collection::vec((0..=len, 0..=len, 0..slots), 0..6),
            Just(slots),
        )
            .prop_map(|(len, raw, slots)| {
                let mut cuts: Vec<(usize, usize, usize)> = raw
                    .into_iter()
                    .map(|(a, b, s)| (a.min(b), a.max(b), s))
                    .collect();
                cuts.sort();
                let mut segs = Vec::new();
                let mut pos = 0;
                for (a, b, s) in cuts {
                    let start = a.max(pos);
                    if start < b {
                        segs.push(Segment {
                            start,
                            end: b,
                            slot: s,
                        });
                        pos = b;
                    }
                }
                (len, segs, slots)
            })
    })
}

fn ref_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |a, v| if v.is_nan() { a } else { a.max(v.abs()) })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn segmented_amax_matches_per_segment_amax(
        (len, segs, slots) in layout(),
        seed in prop::collection::vec(value(), 600),
        base in 0usize..3,
        start in prop::collection::vec(0.0f32..5.0, 8),
    ) {
        let dev = Device::cpu();
        let x = Buffer::from_vec(seed[..len].to_vec());
        let table = SegmentTable::new(&dev, &segs).unwrap();
        let mut out = Buffer::from_vec(start[..base + slots].to_vec());
        segmented_amax(&x, &table, &mut out, base).unwrap();
        let mut want = start[..base + slots].to_vec();
        for s in &segs {
            let a = ref_amax(&seed[s.start..s.end]);
            want[base + s.slot] = want[base + s.slot].max(a);
        }
        prop_assert_eq!(out.to_vec().unwrap(), want);
    }

    #[test]
    fn segmented_scales_and_cast_match_encode_scaled(
        (len, segs, slots) in layout(),
        seed in prop::collection::vec(value(), 600),
        amaxes in prop::collection::vec(prop_oneof![0.0f32..1e4, Just(0.0), Just(f32::INFINITY)], 6),
        prev in prop::collection::vec(prop::sample::select(vec![1.0f32, 0.5, 64.0]), 6),
        margin in 0i32..4,
        e5m2 in any::<bool>(),
    ) {
        let format = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        let dev = Device::cpu();
        let amax = Buffer::from_vec(amaxes[..slots].to_vec());
        let mut scales = Buffer::from_vec(prev[..slots].iter().flat_map(|&p| [p, 1.0 / p]).collect());
        segmented_scales(&amax, 0, format, margin, &mut scales).unwrap();
        let sc = scales.to_vec().unwrap();
        for i in 0..slots {
            let want = compute_scale(amaxes[i], format.max(), margin, ScaleRounding::PowerOfTwo, prev[i]);
            prop_assert_eq!(sc[2 * i].to_bits(), want.to_bits());
            prop_assert_eq!(sc[2 * i + 1].to_bits(), (1.0 / want).to_bits());
        }
        let x = Buffer::from_vec(seed[..len].to_vec());
        let table = SegmentTable::new(&dev, &segs).unwrap();
        let mut out = Buffer::from_vec(vec![0xAAu8; len]);
        segmented_cast(&x, &table, format, &scales, &mut out).unwrap();
        let mut want = vec![0xAAu8; len];
        for s in &segs {
            for i in s.start..s.end {
                want[i] = format.encode(seed[i] * sc[2 * s.slot]);
            }
        }
        prop_assert_eq!(out.to_vec().unwrap(), want);
    }

    #[test]
    fn add_at_adds_into_the_range_only(
        dst in prop::collection::vec(-10.0f32..10.0, 1..300),
        src in prop::collection::vec(-10.0f32..10.0, 0..300),
        offset in 0usize..300,
    ) {
        let mut d = Buffer::from_vec(dst.clone());
        let s = Buffer::from_vec(src.clone());
        let r = add_at(&mut d, offset, &s);
        if offset + src.len() > dst.len() {
            prop_assert!(r.is_err());
            prop_assert_eq!(d.to_vec().unwrap(), dst);
        } else {
            r.unwrap();
            let mut want = dst.clone();
            for (i, v) in src.iter().enumerate() {
                want[offset + i] += v;
            }
            prop_assert_eq!(d.to_vec().unwrap(), want.clone());
            // The bf16 form widens exactly.
            let mut d16 = Buffer::from_vec(dst.clone());
            let s16 = Buffer::from_vec(src.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
            add_at(&mut d16, offset, &s16).unwrap();
            let mut want16 = dst.clone();
            for (i, v) in src.iter().enumerate() {
                want16[offset + i] += bf16::from_f32(*v).to_f32();
            }
            prop_assert_eq!(d16.to_vec().unwrap(), want16);
        }
    }

    /// BF16 destinations (BF16 gradient shards): one f32 addition of the widened values, rounded once to
    /// nearest even; untouched outside the range.
    #[test]
    fn add_at_into_bf16_rounds_once(
        dst in prop::collection::vec(-10.0f32..10.0, 1..300),
        src in prop::collection::vec(-10.0f32..10.0, 0..300),
        offset in 0usize..300,
        src_bf16 in any::<bool>(),
    ) {
        let d0: Vec<bf16> = dst.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut d = Buffer::from_vec(d0.clone());
        let r = if src_bf16 {
            add_at(&mut d, offset, &Buffer::from_vec(src.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()))
        } else {
            add_at(&mut d, offset, &Buffer::from_vec(src.clone()))
        };
        if offset + src.len() > dst.len() {
            prop_assert!(r.is_err());
            prop_assert_eq!(d.to_vec().unwrap(), d0);
        } else {
            r.unwrap();
            let mut want = d0.clone();
            for (i, &v) in src.iter().enumerate() {
                let v = if src_bf16 { bf16::from_f32(v).to_f32() } else { v };
                want[offset + i] = bf16::from_f32(d0[offset + i].to_f32() + v);
            }
            prop_assert_eq!(d.to_vec().unwrap(), want);
        }
    }

    #[test]
    fn add_decoded_into_bf16_rounds_once(
        dst in prop::collection::vec(-10.0f32..10.0, 0..300),
        codes in prop::collection::vec(any::<u8>(), 300),
        si in prop::sample::select(vec![1.0f32, 0.25, 1.0 / 1024.0, 8.0]),
        e5m2 in any::<bool>(),
    ) {
        let format = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        let q = &codes[..dst.len()];
        let d0: Vec<bf16> = dst.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut d = Buffer::from_vec(d0.clone());
        add_decoded_fp8(&mut d, &Buffer::from_vec(q.to_vec()), format, &Buffer::from_vec(vec![si])).unwrap();
        let got = d.to_vec().unwrap();
        for ((g, a), &c) in got.iter().zip(&d0).zip(q) {
            let w = bf16::from_f32(a.to_f32() + format.decode(c) * si);
            prop_assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
        }
    }

    #[test]
    fn add_decoded_adds_scaled_codes(
        dst in prop::collection::vec(-10.0f32..10.0, 0..300),
        codes in prop::collection::vec(any::<u8>(), 300),
        si in prop::sample::select(vec![1.0f32, 0.25, 1.0 / 1024.0, 8.0]),
        e5m2 in any::<bool>(),
    ) {
        let format = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        let q = &codes[..dst.len()];
        let mut d = Buffer::from_vec(dst.clone());
        add_decoded_fp8(&mut d, &Buffer::from_vec(q.to_vec()), format, &Buffer::from_vec(vec![si])).unwrap();
        let want: Vec<f32> = dst.iter().zip(q).map(|(&a, &c)| a + format.decode(c) * si).collect();
        let got = d.to_vec().unwrap();
        prop_assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            prop_assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
        }
    }

    #[test]
    fn finite_amax_count_separates_non_finite(
        x in prop::collection::vec(value(), 0..400),
        start in 0.0f32..100.0,
        count0 in 0u32..5,
    ) {
        let mut a = Buffer::from_vec(vec![start]);
        let mut c = Buffer::from_vec(vec![count0]);
        finite_amax_count(&Buffer::from_vec(x.clone()), &mut a, &mut c).unwrap();
        let finite_max = x.iter().filter(|v| v.is_finite()).fold(start, |m, v| m.max(v.abs()));
        let bad = x.iter().filter(|v| !v.is_finite()).count() as u32;
        prop_assert_eq!(a.to_vec().unwrap()[0], finite_max);
        prop_assert_eq!(c.to_vec().unwrap()[0], count0 + bad);
    }

    /// A device counter moved into the statistics counts as non-finite values of the gradient, wrapping
    /// as the accumulator does, and is cleared.
    #[test]
    fn norm_stats_take_count_adds_the_counter_and_clears_it(
        x in prop::collection::vec(value(), 0..200),
        counter in prop_oneof![0u32..10, Just(u32::MAX), Just(u32::MAX - 3)],
    ) {
        let dev = Device::cpu();
        let mut acc = dev.zeros::<f32>(NORM_STATS_ACC_LEN).unwrap();
        let xb = dev.upload(&x).unwrap();
        norm_stats(&xb, 0..x.len(), &mut acc, None).unwrap();
        let mut c = dev.upload(&[counter]).unwrap();
        norm_stats_take_count(&mut acc, &mut c).unwrap();
        let mut sums = dev.zeros::<f32>(2).unwrap();
        norm_stats_finish(&mut acc, 0, &mut sums).unwrap();
        let bad = x.iter().filter(|v| !v.is_finite()).count() as u32;
        prop_assert_eq!(sums.to_vec().unwrap()[0], bad.wrapping_add(counter) as f32);
        prop_assert_eq!(c.to_vec().unwrap(), vec![0u32]);
        let mut short = dev.zeros::<f32>(2).unwrap();
        prop_assert!(norm_stats_take_count(&mut short, &mut c).is_err());
    }

    #[test]
    fn scale_from_amax_is_compute_scale_with_previous_one(
        amax in prop_oneof![0.0f32..1e6, Just(0.0), Just(f32::INFINITY), Just(f32::NAN)],
        margin in 0i32..4,
    ) {
        let mut s = Buffer::from_vec(vec![7.0f32]);
        let mut si = Buffer::from_vec(vec![7.0f32]);
        scale_from_amax(&Buffer::from_vec(vec![amax]), Fp8Format::E4M3, margin, &mut s, &mut si).unwrap();
        let want = compute_scale(amax, 448.0, margin, ScaleRounding::PowerOfTwo, 1.0);
        prop_assert_eq!(s.to_vec().unwrap()[0], want);
        prop_assert_eq!(si.to_vec().unwrap()[0], 1.0 / want);
    }
}

#[test]
fn bad_arguments_are_errors() {
    let dev = Device::cpu();
    let reversed = Segment {
        start: 5,
        end: 2,
        slot: 0,
    };
    assert!(SegmentTable::new(&dev, &[reversed]).is_err());
    let t = SegmentTable::new(
        &dev,
        &[Segment {
            start: 0,
            end: 10,
            slot: 1,
        }],
    )
    .unwrap();
    let x = Buffer::from_vec(vec![1.0f32; 8]);
    let mut out = Buffer::from_vec(vec![0.0f32; 2]);
    assert!(
        segmented_amax(&x, &t, &mut out, 0).is_err(),
        "segment past the buffer"
    );
    let x = Buffer::from_vec(vec![1.0f32; 10]);
    assert!(
        segmented_amax(&x, &t, &mut out, 1).is_err(),
        "slot past the amaxes"
    );
    let mut odd = Buffer::from_vec(vec![1.0f32; 3]);
    assert!(segmented_scales(&out, 0, Fp8Format::E4M3, 0, &mut odd).is_err());
    let mut q = Buffer::from_vec(vec![0u8; 10]);
    let scales = Buffer::from_vec(vec![1.0f32; 2]);
    assert!(
        segmented_cast(&x, &t, Fp8Format::E4M3, &scales, &mut q).is_err(),
        "slot 1 of 1 pair"
    );
}

/// CUDA against CPU on random inputs (bitwise).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu_bitwise() {
    let gpu = cuda_device();
    let report = segmented_cuda_check(&gpu, 1 << 20, 7);
    assert!(report.is_empty(), "{report:?}");
}

/// Compares every segmented kernel on `gpu` with the CPU on `n` random values; returns the mismatches.
fn segmented_cuda_check(gpu: &Device, n: usize, seed: u64) -> Vec<String> {
    let mut rng = seed;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((rng >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 200.0
    };
    let mut x: Vec<f32> = (0..n).map(|_| next()).collect();
    x[17] = f32::NAN;
    x[n / 2] = f32::INFINITY;
    let segs = [
        Segment {
            start: 3,
            end: n / 3,
            slot: 0,
        },
        Segment {
            start: n / 3,
            end: n / 3 + 1000,
            slot: 2,
        },
        Segment {
            start: n / 2 + 5,
            end: n - 1,
            slot: 1,
        },
    ];
    let cpu = Device::cpu();
    let mut errs = Vec::new();
    let both = |f: &dyn Fn(&Device) -> Vec<u32>| (f(&cpu), f(gpu));
    let (c, g) = both(&|d: &Device| {
        let t = SegmentTable::new(d, &segs).unwrap();
        let xb = d.upload(&x).unwrap();
        let mut out = d.upload(&[0.0f32, 0.5, 0.0, 0.0]).unwrap();
        segmented_amax(&xb, &t, &mut out, 1).unwrap();
        let mut scales = d.upload(&[1.0f32; 6]).unwrap();
        segmented_scales(&out, 1, Fp8Format::E4M3, 1, &mut scales).unwrap();
        let mut q = d.zeros::<u8>(n).unwrap();
        segmented_cast(&xb, &t, Fp8Format::E4M3, &scales, &mut q).unwrap();
        let mut acc = d.upload(&x[..n / 4]).unwrap();
        add_decoded_fp8(
            &mut acc,
            &d.upload(&q.to_vec().unwrap()[..n / 4]).unwrap(),
            Fp8Format::E4M3,
            &d.upload(&[0.125f32]).unwrap(),
        )
        .unwrap();
        add_at(&mut acc, 100, &d.upload(&x[..1000]).unwrap()).unwrap();
        // BF16 destinations (BF16 gradient shards).
        let mut acc16 = d
            .upload(
                &x[..n / 4]
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        add_decoded_fp8(
            &mut acc16,
            &d.upload(&q.to_vec().unwrap()[..n / 4]).unwrap(),
            Fp8Format::E5M2,
            &d.upload(&[0.25f32]).unwrap(),
        )
        .unwrap();
        add_at(&mut acc16, 100, &d.upload(&x[..1000]).unwrap()).unwrap();
        let x16: Vec<bf16> = x[..2000]
            .iter()
            .map(|&v| bf16::from_f32(v * 0.37))
            .collect();
        add_at(&mut acc16, 3, &d.upload(&x16).unwrap()).unwrap();
        let mut a = d.zeros::<f32>(1).unwrap();
        let mut cnt = d.zeros::<u32>(1).unwrap();
        finite_amax_count(&xb, &mut a, &mut cnt).unwrap();
        let (mut s, mut si) = (d.zeros::<f32>(1).unwrap(), d.zeros::<f32>(1).unwrap());
        scale_from_amax(&a, Fp8Format::E5M2, 2, &mut s, &mut si).unwrap();
        let mut v: Vec<u32> = out.to_vec().unwrap().iter().map(|&f| canon(f)).collect();
        v.extend(scales.to_vec().unwrap().iter().map(|&f| canon(f)));
        v.extend(q.to_vec().unwrap().iter().map(|&b| b as u32));
        v.extend(acc.to_vec().unwrap().iter().map(|&f| canon(f)));
        v.extend(acc16.to_vec().unwrap().iter().map(|&h| {
            if h.is_nan() {
                0x7FC0
            } else {
                u32::from(h.to_bits())
            }
        }));
        v.push(canon(a.to_vec().unwrap()[0]));
        v.push(cnt.to_vec().unwrap()[0]);
        v.push(canon(s.to_vec().unwrap()[0]));
        v.push(canon(si.to_vec().unwrap()[0]));
        v
    });
    if c.len() != g.len() {
        errs.push(format!("lengths {} vs {}", c.len(), g.len()));
    }
    let diffs: Vec<usize> = c
        .iter()
        .zip(&g)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect();
    if !diffs.is_empty() {
        errs.push(format!(
            "{} words differ, first at {}",
            diffs.len(),
            diffs[0]
        ));
    }
    errs
}

/// `norm_stats_take_count` on CUDA against the CPU: the counter lands in the statistics and is cleared.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_norm_stats_take_count_matches_cpu() {
    let gpu = cuda_device();
    for (len, counter) in [(0usize, 5u32), (1000, 0), (4097, 17), (33, u32::MAX)] {
        let x: Vec<f32> = (0..len)
            .map(|i| match i % 97 {
                3 => f32::NAN,
                5 => f32::INFINITY,
                _ => i as f32 * 0.25 - 100.0,
            })
            .collect();
        let run = |d: &Device| {
            let mut acc = d.zeros::<f32>(NORM_STATS_ACC_LEN).unwrap();
            norm_stats(&d.upload(&x).unwrap(), 0..len, &mut acc, None).unwrap();
            let mut c = d.upload(&[counter]).unwrap();
            norm_stats_take_count(&mut acc, &mut c).unwrap();
            let mut sums = d.zeros::<f32>(2).unwrap();
            norm_stats_finish(&mut acc, 0, &mut sums).unwrap();
            (sums.to_vec().unwrap()[0], c.to_vec().unwrap())
        };
        assert_eq!(
            run(&Device::cpu()),
            run(&gpu),
            "{len} values, counter {counter}"
        );
    }
}
