//! GEMM property tests on the CPU against an f64 triple loop: all transpose combinations, alpha/beta,
//! F32, BF16 (f32 and bf16 outputs) and FP8 (every format pair) operands; and the GEMMs into a range of a
//! larger buffer (`gemm_at`, `gemm_fp8_at`) against the plain ones, bit for bit, the rest untouched.

use fp8_core::Fp8Format;
use fp8_kernels::gemm::{
    dequantize_fp8_host, gemm, gemm_at, gemm_bf16, gemm_f32, gemm_fp8, gemm_fp8_at,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{CpuParallelism, Device, DeviceScalar, Fp8Matrix, GemmSpec, Transpose};
use half::bf16;
use proptest::prelude::*;

/// `alpha * op(A) op(B) + beta * C` in f64, and the matching error scale `|alpha| sum |a b| + |beta c|`.
fn reference(spec: &GemmSpec, a: &[f64], b: &[f64], c: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (m, n, k) = (spec.m, spec.n, spec.k);
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    // Element (i, p) of op(A) and (p, j) of op(B).
    let a_at = |i: usize, p: usize| {
        if spec.trans_a.is_yes() {
            a[p * m + i]
        } else {
            a[i * k + p]
        }
    };
    let b_at = |p: usize, j: usize| {
        if spec.trans_b.is_yes() {
            b[j * k + p]
        } else {
            b[p * n + j]
        }
    };
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut sa) = (0.0f64, 0.0f64);
            for p in 0..k {
                let (av, bv) = (a_at(i, p), b_at(p, j));
                s += av * bv;
                sa += (av * bv).abs();
            }
            let old = if spec.beta != 0.0 {
                spec.beta as f64 * c[i * n + j]
            } else {
                0.0
            };
            out[i * n + j] = spec.alpha as f64 * s + old;
            mag[i * n + j] = (spec.alpha as f64).abs() * sa + old.abs();
        }
    }
    (out, mag)
}

fn check(got: &[f64], want: &[f64], mag: &[f64], rel: f64) -> Result<(), TestCaseError> {
    for (idx, ((g, w), s)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = rel * s + 1e-30;
        prop_assert!(
            (g - w).abs() <= tol,
            "element {idx}: got {g}, want {w}, tolerance {tol}"
        );
    }
    Ok(())
}

fn transpose() -> impl Strategy<Value = Transpose> {
    prop_oneof![Just(Transpose::No), Just(Transpose::Yes)]
}

prop_compose! {
    fn problem()(m in 1usize..24, n in 1usize..24, k in 0usize..40, ta in transpose(), tb in transpose(),
                 alpha in prop_oneof![Just(1.0f32), -2.0f32..2.0], beta in prop_oneof![Just(0.0f32), Just(1.0f32), -1.5f32..1.5],
                 single in any::<bool>(), seed in any::<u64>()) -> (GemmSpec, u64) {
        let spec = GemmSpec::new(m, n, k).transposes(ta, tb).scalars(alpha, beta)
            .parallelism(if single { CpuParallelism::Single } else { CpuParallelism::Rayon(0) });
        (spec, seed)
    }
}

/// Deterministic pseudo-random values in [-4, 4) (splitmix64).
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| rng.unit_f32() * 8.0 - 4.0).collect()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn gemms_into_a_range_equal_the_plain_gemms(p in problem(), before in 0usize..40, after in 0usize..9) {
        let (spec, seed) = p;
        let dev = Device::cpu();
        let mn = spec.m * spec.n;
        let (a, b) = (values(seed, spec.m * spec.k), values(seed ^ 1, spec.k * spec.n));
        let big0 = values(seed ^ 3, before + mn + after);
        let c0 = big0[before..before + mn].to_vec();
        let (ab, bb) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let expect = |plain: Vec<f32>| {
            let mut e = big0.clone();
            e[before..before + mn].copy_from_slice(&plain);
            bits(e)
        };
        // F32 operands.
        let mut c = dev.upload(&c0).unwrap();
        gemm(&spec, &ab, &bb, &mut c).unwrap();
        let mut big = dev.upload(&big0).unwrap();
        gemm_at(&spec, &ab, &bb, &mut big, before).unwrap();
        prop_assert_eq!(bits(big.to_vec().unwrap()), expect(c.to_vec().unwrap()));
        // FP8 operands (E4M3 x E5M2).
        let (fa, fb) = (Fp8Format::E4M3, Fp8Format::E5M2);
        let qa: Vec<u8> = a.iter().map(|&v| fa.encode(v * 16.0)).collect();
        let qb: Vec<u8> = b.iter().map(|&v| fb.encode(v * 16.0)).collect();
        let (qab, qbb) = (dev.upload(&qa).unwrap(), dev.upload(&qb).unwrap());
        let inv = dev.upload(&[1.0f32 / 16.0]).unwrap();
        let op = |data, format| Fp8Matrix { data, format, scale_inv: DeviceScalar::new(&inv, 0).unwrap() };
        let mut c = dev.upload(&c0).unwrap();
        gemm_fp8(&spec, op(&qab, fa), op(&qbb, fb), &mut c).unwrap();
        let mut big = dev.upload(&big0).unwrap();
        gemm_fp8_at(&spec, op(&qab, fa), op(&qbb, fb), &mut big, before).unwrap();
        prop_assert_eq!(bits(big.to_vec().unwrap()), expect(c.to_vec().unwrap()));
        // A range that runs past the end is refused.
        let mut short = dev.upload(&big0[..before + mn - 1.min(mn)]).unwrap();
        if mn > 0 {
            prop_assert!(gemm_at(&spec, &ab, &bb, &mut short, before).is_err());
        }
    }

    #[test]
    fn f32_gemm_matches_f64(p in problem()) {
        let (spec, seed) = p;
        let dev = Device::cpu();
        let a = values(seed, spec.m * spec.k);
        let b = values(seed ^ 1, spec.k * spec.n);
        let c0 = values(seed ^ 2, spec.m * spec.n);
        let (want, mag) = reference(&spec, &widen(&a), &widen(&b), &widen(&c0));
        let mut c = dev.upload(&c0).unwrap();
        if spec.beta == 0.0 {
            // beta = 0 must not read C, even NaN.
            c.copy_from_host(&vec![f32::NAN; c0.len()]).unwrap();
        }
        gemm_f32(&spec, &dev.upload(&a).unwrap(), &dev.upload(&b).unwrap(), &mut c).unwrap();
        check(&widen(&c.to_vec().unwrap()), &want, &mag, 1e-5)?;
    }

    #[test]
    fn bf16_gemm_matches_f64(p in problem(), bf16_out in any::<bool>()) {
        let (spec, seed) = p;
        let dev = Device::cpu();
        let a: Vec<bf16> = values(seed, spec.m * spec.k).into_iter().map(bf16::from_f32).collect();
        let b: Vec<bf16> = values(seed ^ 1, spec.k * spec.n).into_iter().map(bf16::from_f32).collect();
        let c0: Vec<bf16> = values(seed ^ 2, spec.m * spec.n).into_iter().map(bf16::from_f32).collect();
        let w = |x: &[bf16]| x.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
        let (want, mag) = reference(&spec, &w(&a), &w(&b), &w(&c0));
        let (ab, bb) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
        if bf16_out {
            let mut c = dev.upload(&c0).unwrap();
            gemm_bf16(&spec, &ab, &bb, &mut c).unwrap();
            // one bf16 rounding of the result (2^-8 relative) on top of f32 accumulation
            let got = w(&c.to_vec().unwrap());
            for ((g, x), s) in got.iter().zip(&want).zip(&mag) {
                prop_assert!((g - x).abs() <= x.abs() * 2f64.powi(-8) + 1e-5 * s + 1e-30, "{} vs {}", g, x);
            }
        } else {
            let mut c = dev.upload(&c0.iter().map(|v| v.to_f32()).collect::<Vec<_>>()).unwrap();
            gemm(&spec, &ab, &bb, &mut c).unwrap();
            check(&widen(&c.to_vec().unwrap()), &want, &mag, 1e-5)?;
        }
    }

    #[test]
    fn fp8_gemm_is_dequantized_f64_gemm(p in problem(), fa in 0usize..2, fb in 0usize..2,
                                        ea in -4i32..4, eb in -4i32..4) {
        let (spec, seed) = p;
        let dev = Device::cpu();
        let (fa, fb) = (Fp8Format::ALL[fa], Fp8Format::ALL[fb]);
        // Finite codes only (the inputs of a real GEMM come from saturating casts).
        let codes = |f: Fp8Format, s: u64, n: usize| -> Vec<u8> {
            values(s, n).into_iter().map(|v| f.encode(v * 40.0)).collect()
        };
        let a = codes(fa, seed, spec.m * spec.k);
        let b = codes(fb, seed ^ 1, spec.k * spec.n);
        let (sa, sb) = (2f32.powi(ea), 2f32.powi(eb));
        let scales = dev.upload(&[0.0, sa, sb]).unwrap();
        let c0 = values(seed ^ 2, spec.m * spec.n);
        let (want, mag) = reference(
            &spec,
            &widen(&dequantize_fp8_host(&a, fa, sa)),
            &widen(&dequantize_fp8_host(&b, fb, sb)),
            &widen(&c0),
        );
        let (ab, bb) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
        let mut c = dev.upload(&c0).unwrap();
        gemm_fp8(
            &spec,
            Fp8Matrix { data: &ab, format: fa, scale_inv: DeviceScalar::new(&scales, 1).unwrap() },
            Fp8Matrix { data: &bb, format: fb, scale_inv: DeviceScalar::new(&scales, 2).unwrap() },
            &mut c,
        ).unwrap();
        check(&widen(&c.to_vec().unwrap()), &want, &mag, 1e-5)?;
    }
}

#[test]
fn shape_errors_are_reported() {
    let dev = Device::cpu();
    let spec = GemmSpec::new(4, 5, 6);
    let a = dev.zeros::<f32>(24).unwrap();
    let b = dev.zeros::<f32>(29).unwrap();
    let mut c = dev.zeros::<f32>(20).unwrap();
    assert!(gemm_f32(&spec, &a, &b, &mut c).is_err());
    let b = dev.zeros::<f32>(30).unwrap();
    assert!(gemm_f32(&spec, &a, &b, &mut c).is_ok());
    let mut cb = dev.zeros::<bf16>(20).unwrap();
    // f32 inputs cannot produce a bf16 output through the generic entry point.
    assert!(gemm(&spec, &a, &b, &mut cb).is_err());
    let q = dev.zeros::<u8>(24).unwrap();
    let scales = dev.upload(&[1.0f32]).unwrap();
    let s = DeviceScalar::new(&scales, 0).unwrap();
    let op = |d| Fp8Matrix {
        data: d,
        format: Fp8Format::E4M3,
        scale_inv: s,
    };
    assert!(gemm_fp8(&spec, op(&q), op(&q), &mut c).is_err());
}
