//! RoPE (rotate-half over a fused `[Q | K | V]` projection output): the CPU kernels against an f64
//! reference written here (independent frequencies, cos and sin), forward then backward as the identity,
//! the Llama-3 frequency rewrite band by band, argument checks, the NVRTC compile of the module, and
//! CUDA against the CPU bit for bit (needs a GPU: ignored unless run with `--ignored`).

mod common;

use common::{
    bits, cuda_device, first_difference, matches_cpu_and_deterministic, nvrtc_test, sm90_ptx,
};
use fp8_kernels::kernel_source::ROPE_MODULE;
use fp8_kernels::rope::{
    inv_freq, rope_backward, rope_forward, Llama3RopeScaling, RopeShape, RopeSpec, RopeTable,
};
use fp8_kernels::{Device, FloatElement};
use half::bf16;
use proptest::prelude::*;

/// A call: table spec, shape, and the input values (f32, rounded to the element type by the test).
#[derive(Debug, Clone)]
struct Case {
    spec: RopeSpec,
    shape: RopeShape,
    x: Vec<f32>,
}

/// Random shapes (KV < H included: `heads = kv_heads * group`), head dims from 2 to 128, positions
/// anywhere in a table of up to 4096, thetas of Llama 2 and 3 and small ones (fast rotations).
fn case() -> impl Strategy<Value = Case> {
    (
        1usize..3,
        1usize..5,
        1usize..4,
        1usize..4,
        prop_oneof![
            Just(2usize),
            Just(4),
            Just(8),
            Just(14),
            Just(64),
            Just(128)
        ],
        prop_oneof![Just(10_000.0f64), Just(500_000.0), 2.0f64..100.0],
        0usize..4096,
        any::<bool>(),
    )
        .prop_flat_map(|(batch, seq, kv, group, hd, theta, start, scaled)| {
            let start = start.min(4096 - seq);
            let shape = RopeShape {
                batch,
                seq,
                heads: kv * group,
                kv_heads: kv,
                start_pos: start,
            };
            let spec = RopeSpec {
                max_positions: 4096,
                head_dim: hd,
                theta,
                scaling: scaled.then(Llama3RopeScaling::llama3_1),
            };
            let n = batch * seq * shape.token_width(hd);
            proptest::collection::vec(-8.0f32..8.0, n).prop_map(move |x| Case { spec, shape, x })
        })
}

/// Frequencies computed here, in f64, from the definitions (transformers' default RoPE and
/// `_compute_llama3_parameters`), independently of the crate's code.
fn reference_freqs(spec: &RopeSpec) -> Vec<f64> {
    let hd = spec.head_dim as f64;
    (0..spec.head_dim / 2)
        .map(|i| {
            let f = spec.theta.powf(-(2.0 * i as f64) / hd);
            let Some(s) = spec.scaling else { return f };
            let old = s.original_max_position_embeddings as f64;
            let wavelen = std::f64::consts::TAU / f;
            if wavelen > old / s.low_freq_factor {
                f / s.factor
            } else if wavelen < old / s.high_freq_factor {
                f
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                f * ((1.0 - smooth) / s.factor + smooth)
            }
        })
        .collect()
}

fn to_t<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn run_forward<T: FloatElement>(dev: &Device, c: &Case) -> Vec<T> {
    let table = RopeTable::new(dev, c.spec).unwrap();
    let x = dev.upload(&to_t::<T>(&c.x)).unwrap();
    let mut out = dev.zeros::<T>(c.x.len()).unwrap();
    rope_forward(&table, &x, &mut out, c.shape).unwrap();
    out.to_vec().unwrap()
}

fn run_backward<T: FloatElement>(dev: &Device, c: &Case, d: &[T]) -> Vec<T> {
    let table = RopeTable::new(dev, c.spec).unwrap();
    let d = dev.upload(d).unwrap();
    let mut dx = dev.zeros::<T>(d.len()).unwrap();
    rope_backward(&table, &d, &mut dx, c.shape).unwrap();
    dx.to_vec().unwrap()
}

/// Checks `got` (forward or, with `sign = -1`, backward of the values `x` already in `T`) against the f64
/// rotation by the reference angles. Tolerance per element: the table's cos/sin are f64 values rounded
/// to f32 (at most 2^-25 absolute each, as |cos|, |sin| <= 1), the two f32 products and the sum add at
/// most 3 roundings of 2^-24 relative of `|x1 c| + |x2 s| <= |x1| + |x2|`: `(|x1| + |x2|) * 2^-21` covers
/// both with margin; then one rounding to `T` (half an ulp: `|ref| * eps_t`).
fn check_rotation<T: FloatElement>(
    c: &Case,
    x: &[T],
    got: &[T],
    sign: f64,
    eps_t: f64,
) -> Result<(), TestCaseError> {
    let freqs = reference_freqs(&c.spec);
    let hd = c.spec.head_dim;
    let half = hd / 2;
    let width = c.shape.token_width(hd);
    let rotated = (c.shape.heads + c.shape.kv_heads) * hd;
    for (token, (xs, gs)) in x.chunks(width).zip(got.chunks(width)).enumerate() {
        let pos = (c.shape.start_pos + token % c.shape.seq) as f64;
        for (k, (&xv, &gv)) in xs.iter().zip(gs).enumerate().skip(rotated) {
            prop_assert_eq!(
                xv.to_f32().to_bits(),
                gv.to_f32().to_bits(),
                "V element {} of token {}",
                k,
                token
            );
        }
        for head in 0..rotated / hd {
            let b = head * hd;
            for (i, &f) in freqs.iter().enumerate() {
                let (s, co) = (pos * f).sin_cos();
                let s = sign * s;
                let (x1, x2) = (xs[b + i].to_f32() as f64, xs[b + i + half].to_f32() as f64);
                let want = [x1 * co - x2 * s, x2 * co + x1 * s];
                let have = [gs[b + i].to_f32() as f64, gs[b + i + half].to_f32() as f64];
                for q in 0..2 {
                    let tol = (x1.abs() + x2.abs()) * 2f64.powi(-21) + want[q].abs() * eps_t;
                    prop_assert!(
                        (have[q] - want[q]).abs() <= tol,
                        "token {} head {} i {} half {}: {} vs {} (tol {})",
                        token,
                        head,
                        i,
                        q,
                        have[q],
                        want[q],
                        tol
                    );
                }
            }
        }
    }
    Ok(())
}

/// Half an ulp relative: f32 2^-24, bf16 2^-8.
const EPS_F32: f64 = 1.0 / 16_777_216.0;
const EPS_BF16: f64 = 1.0 / 256.0;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn forward_matches_f64_reference(c in case(), use_bf16 in any::<bool>()) {
        let cpu = Device::cpu();
        if use_bf16 {
            let got = run_forward::<bf16>(&cpu, &c);
            check_rotation(&c, &to_t::<bf16>(&c.x), &got, 1.0, EPS_BF16)?;
        } else {
            let got = run_forward::<f32>(&cpu, &c);
            check_rotation(&c, &c.x, &got, 1.0, EPS_F32)?;
        }
    }

    #[test]
    fn backward_matches_f64_reference(c in case(), use_bf16 in any::<bool>()) {
        let cpu = Device::cpu();
        if use_bf16 {
            let d = to_t::<bf16>(&c.x);
            let got = run_backward::<bf16>(&cpu, &c, &d);
            check_rotation(&c, &d, &got, -1.0, EPS_BF16)?;
        } else {
            let got = run_backward::<f32>(&cpu, &c, &c.x);
            check_rotation(&c, &c.x, &got, -1.0, EPS_F32)?;
        }
    }

    /// Backward after forward rotates back: in f32, `c^2 + s^2` is 1 within a few 2^-24 and each of
    /// the eight roundings adds at most 2^-24 relative of `|x1| + |x2|`: `(|x1| + |x2|) * 2^-20`
    /// bounds the error. In bf16 the forward output is rounded to 8 bits first: `(|x1| + |x2|) * 2^-7`
    /// (two bf16 roundings of at most 2^-9 relative of `|x1| + |x2|` each, with margin).
    #[test]
    fn backward_of_forward_is_identity(c in case(), use_bf16 in any::<bool>()) {
        let cpu = Device::cpu();
        let (x, back, rel): (Vec<f64>, Vec<f64>, f64) = if use_bf16 {
            let fwd = run_forward::<bf16>(&cpu, &c);
            let back = run_backward::<bf16>(&cpu, &c, &fwd);
            (to_t::<bf16>(&c.x).iter().map(|v| v.to_f64()).collect(), back.iter().map(|v| v.to_f64()).collect(), 2f64.powi(-7))
        } else {
            let fwd = run_forward::<f32>(&cpu, &c);
            let back = run_backward::<f32>(&cpu, &c, &fwd);
            (c.x.iter().map(|&v| v as f64).collect(), back.iter().map(|&v| v as f64).collect(), 2f64.powi(-20))
        };
        let hd = c.spec.head_dim;
        for (tx, tb) in x.chunks(hd).zip(back.chunks(hd)) {
            let mag: f64 = (0..hd / 2).map(|i| tx[i].abs() + tx[i + hd / 2].abs()).fold(0.0, f64::max);
            for (a, b) in tx.iter().zip(tb) {
                prop_assert!((a - b).abs() <= mag * rel, "{} vs {} (head magnitude {})", a, b, mag);
            }
        }
    }

    /// The tables are the f64 cos and sin of `position * inv_freq`, rounded to f32 (correct rounding of
    /// the f64 value: within 2^-24 absolute of the reference, |cos|, |sin| <= 1, the f64 errors far
    /// smaller).
    #[test]
    fn tables_match_reference(hd in 1usize..40, theta in 2.0f64..1e6, scaled in any::<bool>()) {
        let spec = RopeSpec { max_positions: 300, head_dim: 2 * hd, theta, scaling: scaled.then(Llama3RopeScaling::llama3_1) };
        let (cos, sin) = RopeTable::host_tables(spec).unwrap();
        let freqs = reference_freqs(&spec);
        for p in 0..spec.max_positions {
            for (i, f) in freqs.iter().enumerate() {
                let (s, co) = (p as f64 * f).sin_cos();
                prop_assert!((cos[p * hd + i] as f64 - co).abs() <= 2f64.powi(-24));
                prop_assert!((sin[p * hd + i] as f64 - s).abs() <= 2f64.powi(-24));
            }
        }
    }

    /// Random Llama-3 scalings: every frequency lies between `f / factor` and `f`, matches the reference
    /// (relative 1e-12: the same f64 formula evaluated in another order), and the three bands hold.
    #[test]
    fn llama3_frequencies_match_reference(
        factor in 1.5f64..32.0,
        low in 0.5f64..2.0,
        span in 0.5f64..8.0,
        old in 512usize..16384,
        theta in 1e3f64..1e6,
    ) {
        let s = Llama3RopeScaling { factor, low_freq_factor: low, high_freq_factor: low + span, original_max_position_embeddings: old };
        let spec = RopeSpec { max_positions: 1, head_dim: 128, theta, scaling: Some(s) };
        let got = inv_freq(128, theta, Some(s)).unwrap();
        let plain = inv_freq(128, theta, None).unwrap();
        let want = reference_freqs(&spec);
        for i in 0..64 {
            prop_assert!((got[i] - want[i]).abs() <= want[i] * 1e-12, "{}: {} vs {}", i, got[i], want[i]);
            prop_assert!(got[i] <= plain[i] * (1.0 + 1e-12) && got[i] >= plain[i] / factor * (1.0 - 1e-12));
        }
    }
}

/// Llama 3.1 (theta 500000, head dim 128, factor 8, bands at wavelengths 2048 and 8192): the
/// frequencies of each band, from values written out here: the high ones (wavelength below 2048)
/// unchanged, the low ones (above 8192) divided by 8, the smooth band interpolated; and each band is
/// non-empty.
#[test]
fn llama3_1_bands() {
    let theta = 500_000.0f64;
    let got = inv_freq(128, theta, Some(Llama3RopeScaling::llama3_1())).unwrap();
    let mut bands = [0usize; 3];
    for (i, &g) in got.iter().enumerate() {
        let f = 1.0 / theta.powf(i as f64 / 64.0);
        let wavelen = 2.0 * std::f64::consts::PI / f;
        let want = if wavelen < 2048.0 {
            bands[0] += 1;
            f
        } else if wavelen > 8192.0 {
            bands[2] += 1;
            f / 8.0
        } else {
            bands[1] += 1;
            // smooth = 8192 / wavelen - 1 over (4 - 1); the result is a mix of f/8 and f.
            let smooth = (8192.0 / wavelen - 1.0) / 3.0;
            assert!((0.0..=1.0).contains(&smooth));
            (1.0 - smooth) * f / 8.0 + smooth * f
        };
        assert!((g - want).abs() <= want * 1e-14, "{i}: {g} vs {want}");
    }
    assert!(bands.iter().all(|&b| b > 0), "bands {bands:?}");
    // The first frequency is 1 (wavelength 2 pi, unchanged); the last is theta^(-126/128) / 8.
    assert_eq!(got[0], 1.0);
    let last = theta.powf(-126.0 / 128.0) / 8.0;
    assert!((got[63] - last).abs() <= last * 1e-14);
    // Without scaling: the plain frequencies.
    let plain = inv_freq(128, theta, None).unwrap();
    assert!((plain[63] - last * 8.0).abs() <= last * 8e-14);
}

#[test]
fn bad_arguments_are_errors() {
    let cpu = Device::cpu();
    let spec = RopeSpec {
        max_positions: 8,
        head_dim: 4,
        theta: 10_000.0,
        scaling: None,
    };
    assert!(RopeTable::new(
        &cpu,
        RopeSpec {
            head_dim: 3,
            ..spec
        }
    )
    .is_err());
    assert!(RopeTable::new(
        &cpu,
        RopeSpec {
            head_dim: 0,
            ..spec
        }
    )
    .is_err());
    assert!(RopeTable::new(
        &cpu,
        RopeSpec {
            theta: -1.0,
            ..spec
        }
    )
    .is_err());
    assert!(RopeTable::new(
        &cpu,
        RopeSpec {
            max_positions: 0,
            ..spec
        }
    )
    .is_err());
    let bad_scaling = Llama3RopeScaling {
        high_freq_factor: 0.5,
        ..Llama3RopeScaling::llama3_1()
    };
    assert!(inv_freq(4, 10_000.0, Some(bad_scaling)).is_err());
    let table = RopeTable::new(&cpu, spec).unwrap();
    let shape = RopeShape {
        batch: 1,
        seq: 4,
        heads: 2,
        kv_heads: 1,
        start_pos: 4,
    };
    let n = 4 * shape.token_width(4);
    let x = cpu.zeros::<f32>(n).unwrap();
    let mut out = cpu.zeros::<f32>(n).unwrap();
    rope_forward(&table, &x, &mut out, shape).unwrap();
    // Positions past the table, KV not dividing H, wrong lengths.
    assert!(rope_forward(
        &table,
        &x,
        &mut out,
        RopeShape {
            start_pos: 5,
            ..shape
        }
    )
    .is_err());
    assert!(rope_forward(
        &table,
        &x,
        &mut out,
        RopeShape {
            heads: 3,
            kv_heads: 2,
            ..shape
        }
    )
    .is_err());
    assert!(rope_forward(
        &table,
        &x,
        &mut out,
        RopeShape {
            kv_heads: 0,
            ..shape
        }
    )
    .is_err());
    let mut short = cpu.zeros::<f32>(n - 1).unwrap();
    assert!(rope_forward(&table, &x, &mut short, shape).is_err());
    assert!(rope_backward(&table, &short, &mut out, shape).is_err());
}

nvrtc_test! {
    fn rope_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&ROPE_MODULE);
        for t in ["f32", "bf16", "f16"] {
            let entry = format!(".entry rope_{t}(");
            assert!(ptx.contains(&entry), "{entry} missing");
        }
    }
}

/// The CUDA kernels equal the CPU's bit for bit (the same f32 operations on the same table values, one
/// rounding each, no fused multiply-add) and are deterministic, forward and backward, f32 and bf16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu() {
    let (gpu, cpu) = (cuda_device(), Device::cpu());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(48));
    runner
        .run(&(case(), any::<bool>()), |(c, use_bf16)| {
            let what = format!("{:?} hd {} bf16 {use_bf16}", c.shape, c.spec.head_dim);
            let run = |dev: &Device| -> (Vec<u32>, Vec<u32>) {
                let table = RopeTable::new(dev, c.spec).unwrap();
                if use_bf16 {
                    let x = dev.upload(&to_t::<bf16>(&c.x)).unwrap();
                    let (mut y, mut dx) = (
                        dev.zeros::<bf16>(x.len()).unwrap(),
                        dev.zeros::<bf16>(x.len()).unwrap(),
                    );
                    rope_forward(&table, &x, &mut y, c.shape).unwrap();
                    rope_backward(&table, &x, &mut dx, c.shape).unwrap();
                    (bits(&y), bits(&dx))
                } else {
                    let x = dev.upload(&c.x).unwrap();
                    let (mut y, mut dx) = (
                        dev.zeros::<f32>(x.len()).unwrap(),
                        dev.zeros::<f32>(x.len()).unwrap(),
                    );
                    rope_forward(&table, &x, &mut y, c.shape).unwrap();
                    rope_backward(&table, &x, &mut dx, c.shape).unwrap();
                    (bits(&y), bits(&dx))
                }
            };
            let (want, g1, g2) = (run(&cpu), run(&gpu), run(&gpu));
            let ok = matches_cpu_and_deterministic(&what, &want, &g1, &g2, |a, b| {
                common::join_differences([
                    first_difference("forward", &a.0, &b.0),
                    first_difference("backward", &a.1, &b.1),
                ])
            });
            prop_assert!(ok, "CUDA RoPE differs from the CPU: {}", what);
            Ok(())
        })
        .unwrap();
}

/// A Llama-3-8B-sized call (32 query heads, 8 KV heads, head dim 128, 2 x 1024 tokens at start_pos 3000 of
/// an 8192 table with Llama 3.1 scaling), bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu_at_llama3_8b_size() {
    let (gpu, cpu) = (cuda_device(), Device::cpu());
    let spec = RopeSpec {
        max_positions: 8192,
        head_dim: 128,
        theta: 500_000.0,
        scaling: Some(Llama3RopeScaling::llama3_1()),
    };
    let shape = RopeShape {
        batch: 2,
        seq: 1024,
        heads: 32,
        kv_heads: 8,
        start_pos: 3000,
    };
    let mut rng = fp8_kernels::rng::SplitMix64::new(0x0201_0BE5);
    let x: Vec<f32> = (0..2 * 1024 * shape.token_width(128))
        .map(|_| rng.uniform_f32() * 4.0)
        .collect();
    let c = Case { spec, shape, x };
    let want = run_forward::<bf16>(&cpu, &c);
    let got = run_forward::<bf16>(&gpu, &c);
    assert!(
        first_difference("forward", &got, &want).is_none(),
        "{:?}",
        first_difference("forward", &got, &want)
    );
    let back_cpu = run_backward::<bf16>(&cpu, &c, &want);
    let back_gpu = run_backward::<bf16>(&gpu, &c, &want);
    assert!(
        back_cpu == back_gpu,
        "{:?}",
        first_difference("backward", &back_gpu, &back_cpu)
    );
}
