//! Property tests of the CPU cast kernels against naive scalar references written here.

use fp8_core::{
    compute_scale, AmaxCompute, Fp8Format, QType, ScaleRounding, ScalingMeta, ScalingRecipe,
};
use fp8_kernels::{
    amax, cast_to_fp8, cast_to_fp8_current, cast_transpose_to_fp8, convert, dequantize_fp8,
    update_scaling_meta, AmaxInput, AmaxSlot, Buffer, CurrentScaling, Device, FloatElement,
    KernelError, ScalingMetaBuffers,
};
use half::{bf16, f16};
use proptest::prelude::*;

/// Any f32 (NaN, infinities, subnormals included) or a moderate value.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => -600.0f32..600.0,
        1 => proptest::num::f32::ANY,
        1 => -1e-3f32..1e-3,
    ]
}

fn values(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(value(), 0..max_len)
}

fn format() -> impl Strategy<Value = Fp8Format> {
    prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)]
}

/// Current or delayed scaling (history window 1..6, either amax rule), margin 0..3, either rounding.
fn recipe() -> impl Strategy<Value = ScalingRecipe> {
    let rounding = prop_oneof![Just(ScaleRounding::Exact), Just(ScaleRounding::PowerOfTwo)];
    let amax_compute = prop_oneof![Just(AmaxCompute::MostRecent), Just(AmaxCompute::Max)];
    (any::<bool>(), 1usize..6, amax_compute, 0i32..3, rounding).prop_map(
        |(current, history_len, amax_compute, margin, rounding)| {
            if current {
                ScalingRecipe::Current { margin, rounding }
            } else {
                ScalingRecipe::Delayed {
                    history_len,
                    amax_compute,
                    margin,
                    rounding,
                }
            }
        },
    )
}

/// A scaling meta's state in device buffers, as a model's scaling state holds them.
struct MetaBuffers {
    scale: Buffer<f32>,
    scale_inv: Buffer<f32>,
    history: Buffer<f32>,
    state: Buffer<u32>,
}

impl MetaBuffers {
    fn new(dev: &Device, host: &ScalingMeta) -> Self {
        MetaBuffers {
            scale: dev.upload(&[host.scale()]).unwrap(),
            scale_inv: dev.upload(&[host.scale_inv()]).unwrap(),
            history: dev.upload(&host.history()).unwrap(),
            state: dev.upload(&[0u32, 0, 0]).unwrap(),
        }
    }

    fn bufs(&mut self) -> ScalingMetaBuffers<'_> {
        ScalingMetaBuffers {
            scale: &mut self.scale,
            scale_inv: &mut self.scale_inv,
            history: &mut self.history,
            state: &mut self.state,
        }
    }
}

/// Powers of two across the useful range, and arbitrary positive scales.
fn scale() -> impl Strategy<Value = f32> {
    prop_oneof![
        (-40i32..40).prop_map(|e| 2f32.powi(e)),
        1e-6f32..1e6,
        Just(2f32.powi(125)),
        Just(2f32.powi(-125)),
    ]
}

fn naive_amax(x: &[f32]) -> f32 {
    let mut m = 0.0f32;
    for &v in x {
        if !v.is_nan() && v.abs() > m {
            m = v.abs();
        }
    }
    m
}

fn to<T: FloatElement>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn widen<T: FloatElement>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

fn check_cast<T: FloatElement>(xs: &[f32], f: Fp8Format, s: f32, prior: f32) {
    let x: Vec<T> = to(xs);
    let xf = widen(&x);
    let dev = Device::cpu();
    let xb = dev.upload(&x).unwrap();
    let sb = dev.upload(&[s]).unwrap();
    let mut out = dev.zeros::<u8>(x.len()).unwrap();
    let mut am = dev.upload(&[0.0f32, prior]).unwrap();
    cast_to_fp8(&xb, f, &sb, &mut out, Some(AmaxSlot::new(&mut am, 1))).unwrap();
    let got = out.to_vec().unwrap();
    for (i, (&v, &g)) in xf.iter().zip(&got).enumerate() {
        let want = f.encode(v * s);
        assert_eq!(
            g,
            want,
            "{} elem {i}: {v} * {s} -> {g:#04x}, want {want:#04x}",
            T::NAME
        );
    }
    let a = am.to_vec().unwrap();
    assert_eq!(a[0], 0.0, "slot 0 untouched");
    assert_eq!(
        a[1].to_bits(),
        naive_amax(&xf).max(prior).to_bits(),
        "{}",
        T::NAME
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn amax_matches_naive(xs in values(300), prior in 0.0f32..10.0) {
        let dev = Device::cpu();
        for which in 0..3 {
            let (xf, got) = match which {
                0 => {
                    let b = dev.upload(&xs).unwrap();
                    let mut a = dev.upload(&[prior]).unwrap();
                    amax(&b, AmaxSlot::first(&mut a)).unwrap();
                    (xs.clone(), a.to_vec().unwrap()[0])
                }
                1 => {
                    let x: Vec<bf16> = to(&xs);
                    let b = dev.upload(&x).unwrap();
                    let mut a = dev.upload(&[prior]).unwrap();
                    amax(&b, AmaxSlot::first(&mut a)).unwrap();
                    (widen(&x), a.to_vec().unwrap()[0])
                }
                _ => {
                    let x: Vec<f16> = to(&xs);
                    let b = dev.upload(&x).unwrap();
                    let mut a = dev.upload(&[prior]).unwrap();
                    amax(&b, AmaxSlot::first(&mut a)).unwrap();
                    (widen(&x), a.to_vec().unwrap()[0])
                }
            };
            prop_assert_eq!(got.to_bits(), naive_amax(&xf).max(prior).to_bits());
        }
    }

    #[test]
    fn cast_matches_fp8_core_encode(xs in values(300), f in format(), s in scale(), prior in 0.0f32..1.0) {
        check_cast::<f32>(&xs, f, s, prior);
        check_cast::<bf16>(&xs, f, s, prior);
        check_cast::<f16>(&xs, f, s, prior);
    }

    #[test]
    fn current_scaling_matches_compute_scale(
        xs in values(200), f in format(), margin in 0i32..4, exact in any::<bool>(), prev_e in -5i32..5
    ) {
        let rounding = if exact { ScaleRounding::Exact } else { ScaleRounding::PowerOfTwo };
        let prev = 2f32.powi(prev_e);
        let dev = Device::cpu();
        let x: Vec<bf16> = to(&xs);
        let xf = widen(&x);
        let xb = dev.upload(&x).unwrap();
        let mut s = dev.upload(&[prev]).unwrap();
        let mut si = dev.upload(&[123.0f32]).unwrap();
        let mut a = dev.upload(&[77.0f32]).unwrap();
        let mut out = dev.zeros::<u8>(x.len()).unwrap();
        let spec = CurrentScaling { format: f, margin, rounding };
        cast_to_fp8_current(&xb, spec, &mut s, &mut si, &mut a, &mut out).unwrap();
        let am = naive_amax(&xf);
        let want = compute_scale(am, f.max(), margin, rounding, prev);
        prop_assert_eq!(a.to_vec().unwrap()[0].to_bits(), am.to_bits());
        prop_assert_eq!(s.to_vec().unwrap()[0].to_bits(), want.to_bits());
        prop_assert_eq!(si.to_vec().unwrap()[0].to_bits(), (1.0 / want).to_bits());
        let got = out.to_vec().unwrap();
        for (&v, &g) in xf.iter().zip(&got) {
            prop_assert_eq!(g, f.encode(v * want));
        }
        // The scale never overflows the format for finite amax.
        if am.is_finite() && am > 0.0 {
            prop_assert!(am * want <= f.max());
        }
    }

    #[test]
    fn device_meta_update_matches_scaling_meta(
        amaxes in proptest::collection::vec(prop_oneof![4 => 0.0f32..1e4, 1 => proptest::num::f32::ANY], 1..40),
        recipe in recipe(),
        e5m2 in any::<bool>(),
    ) {
        let q = if e5m2 { QType::E5M2 } else { QType::E4M3 };
        let mut host = ScalingMeta::new(q, recipe).unwrap();
        let dev = Device::cpu();
        let mut meta = MetaBuffers::new(&dev, &host);
        let shared = dev.upload(&amaxes).unwrap();
        for (i, &a) in amaxes.iter().enumerate() {
            host.update_from_amax(a);
            let bufs = meta.bufs();
            if i % 2 == 0 {
                // through a pending slot, which the update resets
                let mut own = dev.upload(&[a]).unwrap();
                update_scaling_meta(bufs, q, &recipe, AmaxInput::Take(&mut own, 0)).unwrap();
                prop_assert_eq!(own.to_vec().unwrap()[0], 0.0);
            } else {
                update_scaling_meta(bufs, q, &recipe, AmaxInput::Read(&shared, i)).unwrap();
            }
            prop_assert_eq!(meta.scale.to_vec().unwrap()[0].to_bits(), host.scale().to_bits());
            prop_assert_eq!(meta.scale_inv.to_vec().unwrap()[0].to_bits(), host.scale_inv().to_bits());
        }
        // The ring, read oldest first from its position, is the host history (NaN kept as NaN).
        let ring = meta.history.to_vec().unwrap();
        let st = meta.state.to_vec().unwrap();
        let pos = st[0] as usize;
        let oldest: Vec<u32> = ring[pos..].iter().chain(&ring[..pos]).map(|v| v.to_bits()).collect();
        let hh: Vec<u32> = host.history().iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(oldest, hh);
        prop_assert_eq!(((st[2] as u64) << 32) | st[1] as u64, host.recorded());
    }

    #[test]
    fn dequantize_matches_decode(codes in proptest::collection::vec(any::<u8>(), 0..300), f in format(), e in -20i32..20) {
        let si = 2f32.powi(e) * 1.5;
        let dev = Device::cpu();
        let q = dev.upload(&codes).unwrap();
        let sib = dev.upload(&[si]).unwrap();
        let mut o32 = dev.zeros::<f32>(codes.len()).unwrap();
        let mut o16 = dev.zeros::<bf16>(codes.len()).unwrap();
        let mut oh = dev.zeros::<f16>(codes.len()).unwrap();
        dequantize_fp8(&q, f, &sib, &mut o32).unwrap();
        dequantize_fp8(&q, f, &sib, &mut o16).unwrap();
        dequantize_fp8(&q, f, &sib, &mut oh).unwrap();
        let (a, b, c) = (o32.to_vec().unwrap(), o16.to_vec().unwrap(), oh.to_vec().unwrap());
        for (i, &code) in codes.iter().enumerate() {
            let want = f.decode(code) * si;
            prop_assert_eq!(a[i].to_bits(), want.to_bits());
            prop_assert_eq!(b[i].to_bits(), bf16::from_f32(want).to_bits());
            prop_assert_eq!(c[i].to_bits(), f16::from_f32(want).to_bits());
        }
    }

    #[test]
    fn cast_transpose_matches_naive(rows in 0usize..70, cols in 0usize..70, f in format(), s in scale(), seed in any::<u64>()) {
        let mut st = seed | 1;
        let xs: Vec<f32> = (0..rows * cols).map(|_| {
            st ^= st << 13; st ^= st >> 7; st ^= st << 17;
            ((st >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 900.0
        }).collect();
        let dev = Device::cpu();
        let x = dev.upload(&xs).unwrap();
        let sb = dev.upload(&[s]).unwrap();
        let mut yt = dev.zeros::<u8>(rows * cols).unwrap();
        let mut y = dev.zeros::<u8>(rows * cols).unwrap();
        let mut am = dev.zeros::<f32>(1).unwrap();
        cast_transpose_to_fp8(&x, [rows, cols], f, &sb, &mut yt, Some(&mut y), Some(AmaxSlot::first(&mut am))).unwrap();
        let (t, u) = (yt.to_vec().unwrap(), y.to_vec().unwrap());
        for r in 0..rows {
            for c in 0..cols {
                let want = f.encode(xs[r * cols + c] * s);
                prop_assert_eq!(t[c * rows + r], want);
                prop_assert_eq!(u[r * cols + c], want);
            }
        }
        prop_assert_eq!(am.to_vec().unwrap()[0], naive_amax(&xs));
        // Without the untransposed output and amax the transposed codes are the same.
        let mut yt2 = dev.zeros::<u8>(rows * cols).unwrap();
        cast_transpose_to_fp8(&x, [rows, cols], f, &sb, &mut yt2, None, None).unwrap();
        prop_assert_eq!(yt2.to_vec().unwrap(), t);
    }

    #[test]
    fn conversions_match_half(xs in values(300)) {
        let dev = Device::cpu();
        let x = dev.upload(&xs).unwrap();
        let mut b = dev.zeros::<bf16>(xs.len()).unwrap();
        let mut h = dev.zeros::<f16>(xs.len()).unwrap();
        convert(&x, &mut b).unwrap();
        convert(&x, &mut h).unwrap();
        let (bv, hv) = (b.to_vec().unwrap(), h.to_vec().unwrap());
        let mut hb = dev.zeros::<f16>(xs.len()).unwrap();
        let mut bh = dev.zeros::<bf16>(xs.len()).unwrap();
        let mut back = dev.zeros::<f32>(xs.len()).unwrap();
        convert(&b, &mut hb).unwrap();
        convert(&h, &mut bh).unwrap();
        convert(&b, &mut back).unwrap();
        let (hbv, bhv, backv) = (hb.to_vec().unwrap(), bh.to_vec().unwrap(), back.to_vec().unwrap());
        for (i, &v) in xs.iter().enumerate() {
            let want_b = bf16::from_f32(v);
            let want_h = f16::from_f32(v);
            prop_assert_eq!(bv[i].to_bits(), want_b.to_bits());
            prop_assert_eq!(hv[i].to_bits(), want_h.to_bits());
            prop_assert_eq!(hbv[i].to_bits(), f16::from_f32(want_b.to_f32()).to_bits());
            prop_assert_eq!(bhv[i].to_bits(), bf16::from_f32(want_h.to_f32()).to_bits());
            prop_assert_eq!(backv[i].to_bits(), want_b.to_f32().to_bits());
        }
    }
}

#[test]
fn large_inputs_take_the_parallel_path_and_agree() {
    // Above the CPU parallel threshold, with a length that is not a multiple of any chunk size.
    let n = 300_007;
    let xs: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.618).sin() * 500.0).collect();
    for f in Fp8Format::ALL {
        check_cast::<f32>(&xs, f, 0.75, 0.0);
        check_cast::<bf16>(&xs, f, 2.0, 3.0);
    }
    let dev = Device::cpu();
    let x = dev.upload(&xs).unwrap();
    let mut a = dev.zeros::<f32>(1).unwrap();
    amax(&x, AmaxSlot::first(&mut a)).unwrap();
    assert_eq!(a.to_vec().unwrap()[0], naive_amax(&xs));
}

#[test]
fn nan_and_infinity_follow_the_stated_rules() {
    let dev = Device::cpu();
    let x = dev
        .upload(&[f32::NAN, -f32::NAN, 1.0, f32::NEG_INFINITY])
        .unwrap();
    let s = dev.upload(&[1.0f32]).unwrap();
    let mut y = dev.zeros::<u8>(4).unwrap();
    let mut a = dev.zeros::<f32>(1).unwrap();
    cast_to_fp8(
        &x,
        Fp8Format::E4M3,
        &s,
        &mut y,
        Some(AmaxSlot::first(&mut a)),
    )
    .unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![0x7F, 0x7F, 0x38, 0xFE]);
    assert_eq!(a.to_vec().unwrap()[0], f32::INFINITY);
    // NaN alone never raises the amax.
    let x = dev.upload(&[f32::NAN, 0.5]).unwrap();
    let mut a = dev.zeros::<f32>(1).unwrap();
    amax(&x, AmaxSlot::first(&mut a)).unwrap();
    assert_eq!(a.to_vec().unwrap()[0], 0.5);
}

#[test]
fn bad_arguments_are_errors() {
    let dev = Device::cpu();
    let x = dev.upload(&[1.0f32; 5]).unwrap();
    let s = dev.upload(&[1.0f32]).unwrap();
    let empty: Buffer<f32> = dev.zeros(0).unwrap();
    let mut y4 = dev.zeros::<u8>(4).unwrap();
    let mut y5 = dev.zeros::<u8>(5).unwrap();
    assert!(matches!(
        cast_to_fp8(&x, Fp8Format::E4M3, &s, &mut y4, None),
        Err(KernelError::LengthMismatch { .. })
    ));
    assert!(matches!(
        cast_to_fp8(&x, Fp8Format::E4M3, &empty, &mut y5, None),
        Err(KernelError::InvalidArgument { .. })
    ));
    let mut a = dev.zeros::<f32>(1).unwrap();
    assert!(matches!(
        amax(&x, AmaxSlot::new(&mut a, 1)),
        Err(KernelError::InvalidArgument { .. })
    ));
    let mut yt = dev.zeros::<u8>(5).unwrap();
    assert!(cast_transpose_to_fp8(&x, [2, 3], Fp8Format::E4M3, &s, &mut yt, None, None).is_err());
    let mut o = dev.zeros::<f32>(4).unwrap();
    assert!(dequantize_fp8(&y5, Fp8Format::E5M2, &s, &mut o).is_err());
    let mut same = dev.zeros::<f32>(5).unwrap();
    assert!(convert(&x, &mut same).is_err());
    let (mut sc, mut si, mut am) = (
        dev.upload(&[1.0f32]).unwrap(),
        dev.upload(&[1.0f32]).unwrap(),
        dev.zeros::<f32>(1).unwrap(),
    );
    let spec = CurrentScaling {
        margin: 65,
        ..CurrentScaling::new(Fp8Format::E4M3)
    };
    assert!(cast_to_fp8_current(&x, spec, &mut sc, &mut si, &mut am, &mut y5).is_err());
    // A slot outside the amax vector is an error, not a wild read.
    let bufs = ScalingMetaBuffers {
        scale: &mut sc,
        scale_inv: &mut si,
        history: &mut dev.zeros::<f32>(4).unwrap(),
        state: &mut dev.zeros::<u32>(3).unwrap(),
    };
    let recipe = ScalingRecipe::delayed_default();
    assert!(update_scaling_meta(bufs, QType::E4M3, &recipe, AmaxInput::Read(&s, 3)).is_err());
}

#[test]
fn delayed_casts_record_into_a_slot_and_the_update_consumes_it() {
    // Delayed scaling: casts accumulate the pending amax, the update consumes it.
    let dev = Device::cpu();
    let recipe = ScalingRecipe::delayed_default();
    let host = ScalingMeta::new(QType::E4M3, recipe).unwrap();
    let mut scale = dev.upload(&[host.scale()]).unwrap();
    let mut scale_inv = dev.upload(&[host.scale_inv()]).unwrap();
    let mut history = dev.upload(&host.history()).unwrap();
    let mut state = dev.upload(&[0u32, 0, 0]).unwrap();
    let mut pending = dev.zeros::<f32>(2).unwrap();
    let x1 = dev.upload(&[1.0f32, -3.0]).unwrap();
    let x2 = dev.upload(&[2.0f32, 0.5]).unwrap();
    let mut y = dev.zeros::<u8>(2).unwrap();
    cast_to_fp8(
        &x1,
        Fp8Format::E4M3,
        &scale,
        &mut y,
        Some(AmaxSlot::new(&mut pending, 1)),
    )
    .unwrap();
    cast_to_fp8(
        &x2,
        Fp8Format::E4M3,
        &scale,
        &mut y,
        Some(AmaxSlot::new(&mut pending, 1)),
    )
    .unwrap();
    assert_eq!(pending.to_vec().unwrap(), vec![0.0, 3.0]);
    let bufs = ScalingMetaBuffers {
        scale: &mut scale,
        scale_inv: &mut scale_inv,
        history: &mut history,
        state: &mut state,
    };
    update_scaling_meta(bufs, QType::E4M3, &recipe, AmaxInput::Take(&mut pending, 1)).unwrap();
    assert_eq!(pending.to_vec().unwrap(), vec![0.0, 0.0]);
    assert_eq!(scale.to_vec().unwrap()[0], 128.0); // 448 / 3 -> 2^7
    let mut yt = dev.zeros::<u8>(2).unwrap();
    cast_transpose_to_fp8(&x1, [1, 2], Fp8Format::E4M3, &scale, &mut yt, None, None).unwrap();
    assert_eq!(
        yt.to_vec().unwrap(),
        vec![
            Fp8Format::E4M3.encode(128.0),
            Fp8Format::E4M3.encode(-384.0)
        ]
    );
}
