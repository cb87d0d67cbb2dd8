//! The CPU cross-entropy (the reference of the CUDA kernel) against a plain f64 implementation on random
//! shapes and logits; its exp and log against f64; the gradient against central finite differences of the
//! f64 mean loss; chunking with row offsets; ignored and invalid targets; argument errors (launch choices
//! included); the FP8-code gradient (`cross_entropy_to_fp8`) against the in-place gradient followed by the
//! plain cast.

mod common;

use common::CeBuffers;
use fp8_core::Fp8Format;
use fp8_kernels::cross_entropy::{
    check_targets, cross_entropy, cross_entropy_to_fp8, cross_entropy_with_launch, exp_fixed,
    ln_fixed, loss_sum, CrossEntropyFp8Grad, CrossEntropyLaunch, CrossEntropySpec,
};
use fp8_kernels::{cast_to_fp8, Buffer, DType, Device, DeviceScalar, FloatElement};
use half::bf16;
use proptest::prelude::*;

fn to_t<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

/// f64 (lse, softmax) of one row.
fn ref_row(x: &[f64]) -> (f64, Vec<f64>) {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
    let lse = m + s.ln();
    (lse, x.iter().map(|v| (v - lse).exp()).collect())
}

struct Run<T> {
    grad: Vec<T>,
    lse: Vec<f32>,
    loss: Vec<f32>,
    sum: f32,
    invalid: u32,
}

fn run<T: FloatElement>(spec: &CrossEntropySpec, logits: &[T], targets: &[i32]) -> Run<T> {
    let dev = Device::cpu();
    let mut lg = dev.upload(logits).unwrap();
    let tg = dev.upload(targets).unwrap();
    let mut out = CeBuffers::new(&dev, targets.len(), 0.25, 3);
    cross_entropy(spec, &mut lg, &tg, out.outputs()).unwrap();
    Run {
        grad: lg.to_vec().unwrap(),
        lse: out.lse.to_vec().unwrap(),
        loss: out.loss.to_vec().unwrap(),
        sum: out.sum.to_vec().unwrap()[0] - 0.25,
        invalid: out.invalid.to_vec().unwrap()[0] - 3,
    }
}

fn check_against_f64<T: FloatElement>(
    rows: usize,
    vocab: usize,
    logits: &[f32],
    targets: &[i32],
) -> Result<(), TestCaseError> {
    let lt = to_t::<T>(logits);
    let gs = 1.0 / rows as f32;
    let r = run(&CrossEntropySpec::new(rows, vocab, gs), &lt, targets);
    let ulp = if T::DTYPE == DType::BF16 {
        2f64.powi(-7)
    } else {
        2f64.powi(-23)
    };
    let mut total = 0.0f64;
    for row in 0..rows {
        let x: Vec<f64> = lt[row * vocab..(row + 1) * vocab]
            .iter()
            .map(|v| v.to_f32() as f64)
            .collect();
        let (lse, p) = ref_row(&x);
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let tol = 1e-5 * (1.0 + m.abs());
        prop_assert!(
            (r.lse[row] as f64 - lse).abs() <= tol,
            "lse {} vs {lse}",
            r.lse[row]
        );
        let t = targets[row] as usize;
        let loss = lse - x[t];
        prop_assert!(
            (r.loss[row] as f64 - loss).abs() <= tol + 1e-6 * x[t].abs(),
            "loss {} vs {loss}",
            r.loss[row]
        );
        total += r.loss[row] as f64;
        for (c, &pc) in p.iter().enumerate() {
            let want = (pc - if c == t { 1.0 } else { 0.0 }) * gs as f64;
            let got = r.grad[row * vocab + c].to_f32() as f64;
            let tol = gs as f64 * (2e-5 * pc + 1.2e-7) + ulp * want.abs() + 1e-38;
            prop_assert!(
                (got - want).abs() <= tol,
                "grad [{row}, {c}] {got} vs {want}"
            );
        }
    }
    prop_assert!((r.sum as f64 - total).abs() <= 1e-5 * total.abs() + 1e-6);
    prop_assert_eq!(r.invalid, 0);
    Ok(())
}

fn case() -> impl Strategy<Value = (usize, usize, Vec<f32>, Vec<i32>)> {
    (1usize..6, 1usize..3000, 0.1f32..30.0).prop_flat_map(|(rows, vocab, spread)| {
        (
            Just(rows),
            Just(vocab),
            proptest::collection::vec(-1.0f32..1.0, rows * vocab)
                .prop_map(move |v| v.into_iter().map(|x| x * spread).collect::<Vec<_>>()),
            proptest::collection::vec(0..vocab as i32, rows),
        )
    })
}

/// The codes, lse, loss, sum and invalid count of `cross_entropy_to_fp8` against the in-place kernel
/// followed by `cast_to_fp8` at the same scale; the logits must come back unchanged.
fn check_codes<T: FloatElement>(
    (rows, vocab, logits, targets): (usize, usize, &[f32], &[i32]),
    format: Fp8Format,
    scale: f32,
) -> Result<(), TestCaseError> {
    let dev = Device::cpu();
    let lt = to_t::<T>(logits);
    let spec = CrossEntropySpec::new(rows, vocab, 1.0 / rows as f32);
    let want = run(&spec, &lt, targets);
    let grad: Buffer<T> = dev.upload(&want.grad).unwrap();
    let scale_buf = dev.upload(&[scale]).unwrap();
    let mut want_codes = dev.zeros::<u8>(lt.len()).unwrap();
    cast_to_fp8(&grad, format, &scale_buf, &mut want_codes, None).unwrap();

    let lg: Buffer<T> = dev.upload(&lt).unwrap();
    let tg = dev.upload(targets).unwrap();
    let mut out = CeBuffers::new(&dev, rows, 0.25, 3);
    let mut codes = dev.zeros::<u8>(lt.len()).unwrap();
    let sink = CrossEntropyFp8Grad {
        codes: &mut codes,
        format,
        scale: DeviceScalar::new(&scale_buf, 0).unwrap(),
    };
    cross_entropy_to_fp8(&spec, &lg, &tg, out.outputs(), sink).unwrap();
    let same = |a: &[T], b: &[T]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.to_f32().to_bits() == y.to_f32().to_bits())
    };
    prop_assert!(same(&lg.to_vec().unwrap(), &lt), "the logits changed");
    prop_assert_eq!(codes.to_vec().unwrap(), want_codes.to_vec().unwrap());
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    prop_assert_eq!(bits(out.lse.to_vec().unwrap()), bits(want.lse));
    prop_assert_eq!(bits(out.loss.to_vec().unwrap()), bits(want.loss));
    prop_assert_eq!(
        (out.sum.to_vec().unwrap()[0] - 0.25).to_bits(),
        want.sum.to_bits()
    );
    prop_assert_eq!(out.invalid.to_vec().unwrap()[0] - 3, want.invalid);
    Ok(())
}

proptest! {
    #[test]
    fn fp8_codes_equal_the_in_place_gradient_then_cast(
        (rows, vocab, logits, mut targets) in case(),
        e5m2 in any::<bool>(),
        scale_exp in 0i32..24,
        invalid_first in any::<bool>(),
    ) {
        if invalid_first {
            targets[0] = vocab as i32;
        }
        let format = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        // Up to far past the largest entry 1 / rows at the format's largest value: saturation included.
        let scale = 2f32.powi(scale_exp) * rows as f32;
        check_codes::<f32>((rows, vocab, &logits, &targets), format, scale)?;
        check_codes::<bf16>((rows, vocab, &logits, &targets), format, scale)?;
    }

    #[test]
    fn matches_f64((rows, vocab, logits, targets) in case()) {
        check_against_f64::<f32>(rows, vocab, &logits, &targets)?;
        check_against_f64::<bf16>(rows, vocab, &logits, &targets)?;
    }

    #[test]
    fn exp_is_within_two_ulp(x in -87.3f32..88.7) {
        let got = exp_fixed(x) as f64;
        let want = (x as f64).exp();
        prop_assert!((got - want).abs() <= 2.5e-7 * want, "exp({x}) = {got}, want {want}");
    }

    #[test]
    fn exp_of_tiny_results_is_within_a_subnormal_step(x in -104.0f32..-87.3) {
        let got = exp_fixed(x) as f64;
        let want = (x as f64).exp();
        prop_assert!((got - want).abs() <= 2.5e-7 * want + 2f64.powi(-149), "exp({x}) = {got}, want {want}");
    }

    #[test]
    fn ln_is_within_two_ulp(bits in 1u32..0x7F80_0000) {
        let x = f32::from_bits(bits);
        let got = ln_fixed(x) as f64;
        let want = (x as f64).ln();
        // Relative to the result, or to 1e-7 absolute near x = 1 where the result is tiny.
        prop_assert!((got - want).abs() <= 2.5e-7 * want.abs().max(0.5), "ln({x}) = {got}, want {want}");
    }

    #[test]
    fn chunks_with_offsets_equal_one_call((rows, vocab, logits, targets) in case()) {
        let lt = to_t::<bf16>(&logits);
        let gs = 0.5f32;
        let whole = run(&CrossEntropySpec::new(rows, vocab, gs), &lt, &targets);
        // Rows 0..k, then k..rows into the same buffers.
        let k = rows / 2;
        let dev = Device::cpu();
        let tg = dev.upload(&targets).unwrap();
        let mut out = CeBuffers::new(&dev, rows, 0.0, 0);
        let mut grads = Vec::new();
        for (a, b) in [(0, k), (k, rows)] {
            let mut chunk: Buffer<bf16> = dev.upload(&lt[a * vocab..b * vocab]).unwrap();
            let spec = CrossEntropySpec { row_offset: a, ..CrossEntropySpec::new(b - a, vocab, gs) };
            cross_entropy(&spec, &mut chunk, &tg, out.outputs()).unwrap();
            grads.extend(chunk.to_vec().unwrap());
        }
        prop_assert_eq!(&grads, &whole.grad);
        prop_assert_eq!(&out.lse.to_vec().unwrap(), &whole.lse);
        let loss = out.loss.to_vec().unwrap();
        prop_assert_eq!(&loss, &whole.loss);
        let want = (0.0 + loss_sum(&loss[..k])) + loss_sum(&loss[k..]);
        prop_assert_eq!(out.sum.to_vec().unwrap()[0].to_bits(), want.to_bits());
        prop_assert_eq!(whole.sum.to_bits(), ((0.25 + loss_sum(&loss)) - 0.25).to_bits());
    }
}

#[test]
fn exp_and_ln_special_values() {
    assert_eq!(exp_fixed(0.0), 1.0);
    assert_eq!(exp_fixed(-0.0), 1.0);
    assert_eq!(exp_fixed(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_fixed(-200.0), 0.0);
    assert_eq!(exp_fixed(f32::INFINITY), f32::INFINITY);
    assert_eq!(exp_fixed(89.0), f32::INFINITY);
    assert!(exp_fixed(88.7).is_finite());
    assert!(exp_fixed(f32::NAN).is_nan());
    assert_eq!(ln_fixed(1.0), 0.0);
    assert_eq!(ln_fixed(0.0), f32::NEG_INFINITY);
    assert_eq!(ln_fixed(f32::INFINITY), f32::INFINITY);
    assert!(ln_fixed(-1.0).is_nan());
    assert!(ln_fixed(f32::NAN).is_nan());
    let tiny = f32::from_bits(1);
    assert!((ln_fixed(tiny) as f64 - (tiny as f64).ln()).abs() < 1e-5);
}

#[test]
fn gradient_matches_finite_differences() {
    let (rows, vocab) = (3, 37);
    let mut rng = fp8_kernels::rng::SplitMix64::new(5);
    let logits: Vec<f32> = (0..rows * vocab).map(|_| rng.uniform_f32() * 4.0).collect();
    let targets = [3i32, 0, 36];
    let mean_loss = |x: &[f64]| -> f64 {
        (0..rows)
            .map(|r| {
                let (lse, _) = ref_row(&x[r * vocab..(r + 1) * vocab]);
                lse - x[r * vocab + targets[r] as usize]
            })
            .sum::<f64>()
            / rows as f64
    };
    let r = run(
        &CrossEntropySpec::new(rows, vocab, 1.0 / rows as f32),
        &logits,
        &targets,
    );
    let x64: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
    let h = 1e-6;
    for i in 0..rows * vocab {
        let (mut xp, mut xm) = (x64.clone(), x64.clone());
        xp[i] += h;
        xm[i] -= h;
        let fd = (mean_loss(&xp) - mean_loss(&xm)) / (2.0 * h);
        let got = r.grad[i] as f64;
        assert!(
            (got - fd).abs() <= 1e-4 * fd.abs().max(1e-3),
            "logit {i}: gradient {got} vs finite difference {fd}"
        );
    }
    let want = mean_loss(&x64) * rows as f64;
    assert!((r.sum as f64 - want).abs() < 1e-5 * want);
}

#[test]
fn ignored_and_invalid_targets() {
    let (rows, vocab) = (4, 10);
    let logits: Vec<f32> = (0..rows * vocab).map(|i| (i % 7) as f32 * 0.3).collect();
    // Row 1 ignored (-100), row 2 out of range (10), row 3 negative (-1, not the ignore index).
    let targets = [2i32, -100, 10, -1];
    let spec = CrossEntropySpec {
        ignore_index: Some(-100),
        ..CrossEntropySpec::new(rows, vocab, 1.0)
    };
    let r = run(&spec, &logits, &targets);
    assert_eq!(r.invalid, 2);
    assert_eq!(r.loss[1], 0.0);
    assert!(r.loss[2].is_nan() && r.loss[3].is_nan());
    assert!(r.loss[0].is_finite() && r.loss[0] > 0.0);
    assert!(r.sum.is_nan(), "an invalid target makes the loss sum NaN");
    for row in 1..4 {
        assert!(r.grad[row * vocab..(row + 1) * vocab]
            .iter()
            .all(|&g| g == 0.0));
    }
    let g0: f32 = r.grad[..vocab].iter().sum();
    assert!(g0.abs() < 1e-6, "a valid row's gradient sums to 0: {g0}");
    assert!(r.lse.iter().all(|v| v.is_finite()));

    // Without a gradient the logits are unchanged.
    let spec = CrossEntropySpec {
        grad_scale: None,
        ..spec
    };
    let r = run(&spec, &logits, &targets);
    assert_eq!(r.grad, logits);

    assert!(check_targets(&[0, 9, -100], 10, Some(-100)).is_ok());
    let e = check_targets(&[0, 9, 10], 10, Some(-100)).unwrap_err();
    assert!(e.to_string().contains("target 10 at position 2"), "{e}");
    assert!(check_targets(&[-100], 10, None).is_err());
}

#[test]
fn invalid_arguments_are_errors() {
    let dev = Device::cpu();
    let mut logits = dev.zeros::<f32>(20).unwrap();
    let targets = dev.upload(&[0i32, 1]).unwrap();
    let mut out = CeBuffers::new(&dev, 2, 0.0, 0);
    let mut call = |spec: CrossEntropySpec, logits: &mut Buffer<f32>| {
        cross_entropy(&spec, logits, &targets, out.outputs())
    };
    assert!(call(CrossEntropySpec::new(2, 10, 0.5), &mut logits).is_ok());
    assert!(call(CrossEntropySpec::new(2, 9, 0.5), &mut logits).is_err());
    assert!(call(CrossEntropySpec::new(2, 0, 0.5), &mut logits).is_err());
    assert!(call(CrossEntropySpec::new(2, 10, f32::NAN), &mut logits).is_err());
    let off = CrossEntropySpec {
        row_offset: 1,
        ..CrossEntropySpec::new(2, 10, 0.5)
    };
    assert!(call(off, &mut logits).is_err(), "rows 1..3 of 2 targets");
}

/// Register-held variants exist for bf16 with 8 or 16 vectors per thread only; valid choices leave the CPU
/// results unchanged.
#[test]
fn launch_choices_are_checked() {
    fn call<T: FloatElement>(vectors: Option<u32>) -> Result<Vec<u32>, fp8_kernels::KernelError> {
        let dev = Device::cpu();
        let host: Vec<T> = (0..32).map(|i| T::from_f32(i as f32 * 0.25)).collect();
        let mut logits = dev.upload(&host).unwrap();
        let targets = dev.upload(&[3i32, 7]).unwrap();
        let mut out = CeBuffers::new(&dev, 2, 0.0, 0);
        cross_entropy_with_launch(
            &CrossEntropySpec::new(2, 16, 0.5),
            CrossEntropyLaunch {
                vectors_per_thread: vectors,
            },
            &mut logits,
            &targets,
            out.outputs(),
        )?;
        Ok(logits
            .to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_f32().to_bits())
            .chain(out.lse.to_vec().unwrap().iter().map(|v| v.to_bits()))
            .collect())
    }
    let base = call::<bf16>(None).unwrap();
    for ok in [Some(0), Some(8), Some(16)] {
        assert_eq!(call::<bf16>(ok).unwrap(), base, "bf16 {ok:?}");
    }
    for bad in [Some(4), Some(12), Some(32)] {
        assert!(call::<bf16>(bad).is_err(), "bf16 {bad:?}");
    }
    assert!(call::<f32>(Some(0)).is_ok());
    for bad in [Some(8), Some(16)] {
        assert!(call::<f32>(bad).is_err(), "f32 {bad:?}");
    }
}

#[test]
fn fp8_codes_need_a_gradient_scale_and_matching_buffers() {
    let dev = Device::cpu();
    let lg: Buffer<f32> = dev.upload(&[0.5f32, -1.0, 2.0, 0.0]).unwrap();
    let tg = dev.upload(&[1i32, 3]).unwrap();
    let scale = dev.upload(&[8.0f32]).unwrap();
    let mut out = CeBuffers::new(&dev, 2, 0.0, 0);
    let call = |spec: CrossEntropySpec, codes_len: usize, out: &mut CeBuffers| {
        let mut codes = dev.zeros::<u8>(codes_len).unwrap();
        let sink = CrossEntropyFp8Grad {
            codes: &mut codes,
            format: Fp8Format::E5M2,
            scale: DeviceScalar::new(&scale, 0).unwrap(),
        };
        cross_entropy_to_fp8(&spec, &lg, &tg, out.outputs(), sink).map(|_| codes.to_vec().unwrap())
    };
    let ok = CrossEntropySpec::new(2, 2, 0.5);
    let codes = call(ok, 4, &mut out).unwrap();
    // Row 0: softmax(0.5, -1) - onehot(1), times 0.5, times 8: a positive and a negative code.
    assert!(
        codes[0] != 0 && codes[0] & 0x80 == 0 && codes[1] & 0x80 != 0,
        "{codes:?}"
    );
    let no_scale = CrossEntropySpec {
        grad_scale: None,
        ..ok
    };
    assert!(call(no_scale, 4, &mut out).is_err());
    assert!(call(ok, 3, &mut out).is_err());
}
