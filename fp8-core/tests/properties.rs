//! Property tests of the formats, scaling and scaled tensors against simple definitions.

use fp8_core::{
    compute_scale, Fp8Format, QType, ScaleRounding, ScaledTensor, ScalingMeta, ScalingRecipe,
};
use proptest::prelude::*;

fn format() -> impl Strategy<Value = Fp8Format> {
    prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)]
}

/// Finite f32 values spread over many binades, both signs.
fn wide_f32() -> impl Strategy<Value = f32> {
    (any::<bool>(), -30i32..20, 0.0f32..1.0).prop_map(|(neg, e, m)| {
        let v = (1.0 + m) * 2f32.powi(e);
        if neg {
            -v
        } else {
            v
        }
    })
}

/// Spacing of the format's values around `|v|` (v within range).
fn spacing(f: Fp8Format, v: f32) -> f32 {
    let a = v.abs();
    if a < f.min_normal() {
        f.min_subnormal()
    } else {
        let e = a.log2().floor() as i32;
        // log2 can misround just below a power of two; the bound stays valid with the smaller exponent.
        2f32.powi(e - f.mantissa_bits() as i32)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn decode_of_encode_is_a_nearest_value(f in format(), x in wide_f32()) {
        prop_assume!(x.abs() <= f.max());
        let got = f.decode(f.encode(x)) as f64;
        let err = (got - x as f64).abs();
        for c in 0..=255u8 {
            let v = f.decode(c);
            if v.is_finite() {
                prop_assert!(err <= (v as f64 - x as f64).abs(), "{} {}: got {} but {} is nearer", f, x, got, v);
            }
        }
    }

    #[test]
    fn encode_is_monotonic(f in format(), a in wide_f32(), b in wide_f32()) {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        prop_assert!(f.decode(f.encode(lo)) <= f.decode(f.encode(hi)));
    }

    #[test]
    fn saturates_beyond_max(f in format(), k in 1.0f32..1e30, neg in any::<bool>()) {
        let x = if neg { -f.max() * k } else { f.max() * k };
        let expected = if neg { -f.max() } else { f.max() };
        prop_assert_eq!(f.decode(f.encode(x)), expected);
    }

    #[test]
    fn quantize_error_is_within_half_a_step(
        f in format(),
        data in prop::collection::vec(wide_f32(), 1..200),
        margin in 0i32..3,
    ) {
        let recipe = ScalingRecipe::Current { margin, rounding: ScaleRounding::PowerOfTwo };
        let t = ScaledTensor::quantize_f32(&[data.len()], &data, f.into(), recipe).unwrap();
        let s = t.meta().scale();
        let back = t.dequantize();
        for (x, y) in data.iter().zip(&back) {
            let bound = spacing(f, x * s) / 2.0 / s;
            prop_assert!((x - y).abs() <= bound, "{}: {} -> {} (scale {}, bound {})", f, x, y, s, bound);
        }
    }

    #[test]
    fn scale_never_lets_amax_exceed_max(
        q in prop_oneof![Just(QType::E4M3), Just(QType::E5M2), Just(QType::F16)],
        amax in wide_f32(),
        margin in 0i32..5,
        exact in any::<bool>(),
    ) {
        let amax = amax.abs();
        let rounding = if exact { ScaleRounding::Exact } else { ScaleRounding::PowerOfTwo };
        let fmax = q.max_finite();
        let s = compute_scale(amax, fmax, margin, rounding, 1.0);
        prop_assert!(s.is_normal() && s > 0.0);
        prop_assert!(amax * s <= fmax);
        if !exact {
            prop_assert_eq!(s.to_bits() & 0x007F_FFFF, 0, "power of two");
            // It is the largest such power of two (unless clamped to the f32 range).
            let limit = fmax / 2f32.powi(margin);
            if s < 2f32.powi(fp8_core::SCALE_EXP_LIMIT) {
                prop_assert!(amax * s * 2.0 > limit);
            }
        }
    }

    #[test]
    fn delayed_scale_follows_window_max(
        amaxes in prop::collection::vec(0.001f32..1000.0, 1..40),
        len in 1usize..8,
    ) {
        let recipe = ScalingRecipe::Delayed {
            history_len: len,
            amax_compute: fp8_core::AmaxCompute::Max,
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        };
        let mut meta = ScalingMeta::new(QType::E4M3, recipe).unwrap();
        for (i, &a) in amaxes.iter().enumerate() {
            meta.update_from_amax(a);
            let start = (i + 1).saturating_sub(len);
            let window_max = amaxes[start..=i].iter().copied().fold(0.0, f32::max);
            prop_assert_eq!(meta.window_amax(), window_max);
            prop_assert_eq!(meta.scale(), compute_scale(window_max, 448.0, 0, ScaleRounding::PowerOfTwo, 1.0));
            prop_assert_eq!(meta.scale() * meta.scale_inv(), 1.0);
        }
    }

    #[test]
    fn slice_paths_match_scalar_encode(
        f in format(),
        data in prop::collection::vec(any::<f32>(), 0..300),
        scale_exp in -10i32..10,
    ) {
        let scale = 2f32.powi(scale_exp);
        let mut fast = vec![0u8; data.len()];
        let amax = f.encode_scaled_with_amax(&data, scale, &mut fast).unwrap();
        for (x, c) in data.iter().zip(&fast) {
            prop_assert_eq!(*c, f.encode(x * scale));
        }
        let expected_amax = data.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
        prop_assert_eq!(amax.to_bits(), expected_amax.to_bits());
        let mut back = vec![0f32; data.len()];
        f.decode_scaled(&fast, 1.0 / scale, &mut back).unwrap();
        for (c, y) in fast.iter().zip(&back) {
            let v = f.decode(*c) / scale;
            prop_assert!(v.to_bits() == y.to_bits() || (v.is_nan() && y.is_nan()));
        }
    }
}

#[test]
fn nan_and_infinity_rules() {
    for f in Fp8Format::ALL {
        for nan in [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFFC0_1234),
        ] {
            assert!(f.is_nan(f.encode(nan)));
            assert!(f.decode(f.encode(nan)).is_nan());
        }
        assert_eq!(f.decode(f.encode(f32::INFINITY)), f.max());
        assert_eq!(f.decode(f.encode(f32::NEG_INFINITY)), -f.max());
    }
    assert_eq!(Fp8Format::E5M2.decode(0x7C), f32::INFINITY);
    assert!(Fp8Format::E4M3.decode(0xFF).is_nan());
    // Scaled tensors with non-finite data do not panic and keep NaN as NaN.
    let t = ScaledTensor::quantize_f32(
        &[4],
        &[1.0, f32::NAN, f32::INFINITY, -2.0],
        QType::E4M3,
        ScalingRecipe::current_default(),
    )
    .unwrap();
    let back = t.dequantize();
    assert!(back[1].is_nan());
    assert_eq!(
        t.meta().scale(),
        1.0,
        "an infinite amax keeps the previous scale"
    );
    assert_eq!(back[2], 448.0);
}
