//! SwiGLU over a fused `[gate | up]` projection output: the CPU kernels against an f64 reference written
//! here, the fused FP8 casts against the unfused path (SwiGLU kernel into a buffer of the element type,
//! then `cast_transpose_to_fp8`) bit for bit, argument checks, the NVRTC compile of the module, and CUDA
//! against the CPU bit for bit (needs a GPU: ignored unless run with `--ignored`).

mod common;

use common::{
    assert_each_layout_alone, first_difference, fp8_gpu, join_differences,
    matches_cpu_and_deterministic, nvrtc_test, sm90_ptx,
};
use fp8_core::Fp8Format;
use fp8_kernels::kernel_source::SWIGLU_CAST_MODULE;
use fp8_kernels::swiglu_cast::{
    swiglu_backward, swiglu_backward_cast_fp8, swiglu_cast_fp8, swiglu_forward, SwigluCodes,
};
use fp8_kernels::{cast_transpose_to_fp8, AmaxSlot, Buffer, Device, FloatElement};
use half::{bf16, f16};
use proptest::prelude::*;

/// Gates mostly where silu bends, some far out (where exp overflows or vanishes); ups and output
/// gradients of moderate size.
fn gate() -> impl Strategy<Value = f32> {
    prop_oneof![8 => -12.0f32..12.0, 2 => -120.0f32..120.0, 1 => -1e-3f32..1e-3]
}

/// Shapes `[rows, F]` (ragged ones, and multiples of 64 rows and of 32 / 64 columns, which take the
/// vectorised CUDA cast path) and `gu [rows, 2F]`, `dh [rows, F]`.
fn case() -> impl Strategy<Value = ([usize; 2], Vec<f32>, Vec<f32>)> {
    (
        prop_oneof![1usize..70, Just(64), Just(128)],
        prop_oneof![1usize..70, Just(32), Just(64), Just(96)],
    )
        .prop_flat_map(|(r, f)| {
            let gu = (
                proptest::collection::vec(gate(), r * f),
                proptest::collection::vec(-4.0f32..4.0, r * f),
            )
                .prop_map(move |(g, u)| {
                    let mut gu = Vec::with_capacity(2 * r * f);
                    for row in 0..r {
                        gu.extend_from_slice(&g[row * f..(row + 1) * f]);
                        gu.extend_from_slice(&u[row * f..(row + 1) * f]);
                    }
                    gu
                });
            (
                Just([r, f]),
                gu,
                proptest::collection::vec(-2.0f32..2.0, r * f),
            )
        })
}

fn to_t<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

/// silu and its derivative in f64: `g sigmoid(g)`, `sigmoid(g) (1 + g (1 - sigmoid(g)))`.
fn silu64(g: f64) -> (f64, f64) {
    let s = sigmoid(g);
    (g * s, s * (1.0 + g * (1.0 - s)))
}

/// Error bounds. The kernels' f32 evaluation: `exp_fixed` about 1 ulp (2^-23 relative, taken twice for
/// margin), then one rounding per add, division and product: within 2^-20 relative of the f64 value for
/// `h` and `dup`. For `dgate`, `1 + g (1 - s)` can cancel (near g = -1.28, and `1 - s` when `s` is close
/// to 1), so its bound is relative to the terms' magnitude, `|dh u| s (1 + |g|)`, times 2^-19. Below
/// g = -88.7, exp(-g) overflows and silu is -0 where the true value is below 1e-36 in magnitude: an
/// absolute 1e-35 times the other factor covers it (and subnormal results). Then one rounding to `T`:
/// half an ulp, `eps_t` relative.
fn check_values<T: FloatElement>(
    [rows, f]: [usize; 2],
    gu: &[T],
    dh: Option<&[T]>,
    got: &[T],
    eps_t: f64,
) -> Result<(), TestCaseError> {
    for r in 0..rows {
        for c in 0..f {
            let g = gu[2 * f * r + c].to_f32() as f64;
            let u = gu[2 * f * r + f + c].to_f32() as f64;
            let (silu, dsilu) = silu64(g);
            let s = sigmoid(g);
            let (wants, bounds): (Vec<f64>, Vec<f64>) = match dh {
                None => (
                    vec![silu * u],
                    vec![(silu * u).abs() * 2f64.powi(-20) + 1e-35 * u.abs()],
                ),
                Some(dh) => {
                    let d = dh[f * r + c].to_f32() as f64;
                    (
                        vec![d * u * dsilu, d * silu],
                        vec![
                            (d * u).abs() * s * (1.0 + g.abs()) * 2f64.powi(-19)
                                + 1e-35 * (d * u).abs(),
                            (d * silu).abs() * 2f64.powi(-20) + 1e-35 * d.abs(),
                        ],
                    )
                }
            };
            for (k, (want, bound)) in wants.into_iter().zip(bounds).enumerate() {
                let i = if dh.is_some() {
                    2 * f * r + k * f + c
                } else {
                    f * r + c
                };
                let have = got[i].to_f32() as f64;
                // The output's own rounding: eps_t relative, and at least half its subnormal spacing
                // (eps_t * 2^-126) where the value is subnormal in T (BF16 keeps f32's exponent range
                // with 8 bits: 3.70e-39 rounds to 3.67e-39 there).
                let tol = bound + (want.abs() + f64::from(f32::MIN_POSITIVE)) * eps_t;
                prop_assert!(
                    (have - want).abs() <= tol,
                    "row {} col {} output {}: {} vs {} (g {}, u {}, tol {})",
                    r,
                    c,
                    k,
                    have,
                    want,
                    g,
                    u,
                    tol
                );
            }
        }
    }
    Ok(())
}

fn forward<T: FloatElement>(dev: &Device, shape: [usize; 2], gu: &[f32]) -> Vec<T> {
    let gu = dev.upload(&to_t::<T>(gu)).unwrap();
    let mut h = dev.zeros::<T>(shape[0] * shape[1]).unwrap();
    swiglu_forward(&gu, shape, &mut h).unwrap();
    h.to_vec().unwrap()
}

fn backward<T: FloatElement>(dev: &Device, shape: [usize; 2], gu: &[f32], dh: &[f32]) -> Vec<T> {
    let gu = dev.upload(&to_t::<T>(gu)).unwrap();
    let dh = dev.upload(&to_t::<T>(dh)).unwrap();
    let mut dgu = dev.zeros::<T>(gu.len()).unwrap();
    swiglu_backward(&gu, &dh, shape, &mut dgu).unwrap();
    dgu.to_vec().unwrap()
}

/// What one cast produced: row-major codes, transposed codes, the amax buffer (bits).
type Outputs = (Vec<u8>, Vec<u8>, Vec<u32>);

/// A cast's settings: format, scale, the amax buffer before, its slot.
#[derive(Debug, Clone, Copy)]
struct CastSettings {
    format: Fp8Format,
    scale: f32,
    amax0: [f32; 3],
    slot: usize,
}

fn settings() -> impl Strategy<Value = CastSettings> {
    let format = prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)];
    let scale = prop_oneof![(-12i32..12).prop_map(|e| 2f32.powi(e)), 0.001f32..1000.0];
    let amax0 = (0.0f32..3.0, 0.0f32..3.0, 0.0f32..3.0).prop_map(|(a, b, c)| [a, b, c]);
    (format, scale, amax0, 0usize..3).prop_map(|(format, scale, amax0, slot)| CastSettings {
        format,
        scale,
        amax0,
        slot,
    })
}

/// The fused cast (`dh` None: forward) on `dev`.
fn fused<T: FloatElement>(
    dev: &Device,
    shape: [usize; 2],
    gu: &[f32],
    dh: Option<&[f32]>,
    s: CastSettings,
) -> Outputs {
    let n = shape[0] * shape[1] * if dh.is_some() { 2 } else { 1 };
    let gu = dev.upload(&to_t::<T>(gu)).unwrap();
    let scale = dev.upload(&[s.scale]).unwrap();
    let (mut y, mut yt) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let mut amax = dev.upload(&s.amax0).unwrap();
    let dh = dh.map(|d| dev.upload(&to_t::<T>(d)).unwrap());
    let run = |out: SwigluCodes<'_, '_>| match &dh {
        None => swiglu_cast_fp8(&gu, shape, out).unwrap(),
        Some(d) => swiglu_backward_cast_fp8(&gu, d, shape, out).unwrap(),
    };
    run(SwigluCodes {
        format: s.format,
        scale: &scale,
        codes: Some(&mut y),
        codes_t: Some(&mut yt),
        amax: Some(AmaxSlot::new(&mut amax, s.slot)),
    });
    let (y, yt) = (y.to_vec().unwrap(), yt.to_vec().unwrap());
    let amax_bits = |a: &Buffer<f32>| -> Vec<u32> {
        a.to_vec().unwrap().into_iter().map(f32::to_bits).collect()
    };
    let bits = amax_bits(&amax);
    // Either layout alone: the same codes and amax, the other buffer untouched.
    assert_each_layout_alone(
        dev,
        &y,
        &yt,
        &bits,
        &format!("{shape:?}"),
        |codes, codes_t| {
            let mut amax1 = dev.upload(&s.amax0).unwrap();
            run(SwigluCodes {
                format: s.format,
                scale: &scale,
                codes,
                codes_t,
                amax: Some(AmaxSlot::new(&mut amax1, s.slot)),
            });
            amax_bits(&amax1)
        },
    );
    (y, yt, bits)
}

/// The element-wise kernel into a `T` buffer, then `cast_transpose_to_fp8`.
fn unfused<T: FloatElement>(
    dev: &Device,
    shape: [usize; 2],
    gu: &[f32],
    dh: Option<&[f32]>,
    s: CastSettings,
) -> Outputs {
    let (values, cols) = match dh {
        None => (forward::<T>(dev, shape, gu), shape[1]),
        Some(d) => (backward::<T>(dev, shape, gu, d), 2 * shape[1]),
    };
    let n = values.len();
    let h = dev.upload(&values).unwrap();
    let scale = dev.upload(&[s.scale]).unwrap();
    let (mut y, mut yt) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let mut amax = dev.upload(&s.amax0).unwrap();
    cast_transpose_to_fp8(
        &h,
        [shape[0], cols],
        s.format,
        &scale,
        &mut yt,
        Some(&mut y),
        Some(AmaxSlot::new(&mut amax, s.slot)),
    )
    .unwrap();
    let bits = amax
        .to_vec()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect();
    (y.to_vec().unwrap(), yt.to_vec().unwrap(), bits)
}

fn fused_equals_unfused<T: FloatElement>(
    shape: [usize; 2],
    gu: &[f32],
    dh: Option<&[f32]>,
    s: CastSettings,
) -> Result<(), TestCaseError> {
    let cpu = Device::cpu();
    let got = fused::<T>(&cpu, shape, gu, dh, s);
    let want = unfused::<T>(&cpu, shape, gu, dh, s);
    prop_assert!(
        got == want,
        "{}",
        join_differences([
            first_difference("codes", &got.0, &want.0),
            first_difference("transposed codes", &got.1, &want.1),
            first_difference("amax", &got.2, &want.2),
        ])
    );
    Ok(())
}

const EPS_F32: f64 = 1.0 / 16_777_216.0;
const EPS_BF16: f64 = 1.0 / 256.0;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn forward_matches_f64_reference((shape, gu, _dh) in case(), use_bf16 in any::<bool>()) {
        let cpu = Device::cpu();
        if use_bf16 {
            check_values(shape, &to_t::<bf16>(&gu), None, &forward::<bf16>(&cpu, shape, &gu), EPS_BF16)?;
        } else {
            check_values(shape, &gu, None, &forward::<f32>(&cpu, shape, &gu), EPS_F32)?;
        }
    }

    #[test]
    fn backward_matches_f64_reference((shape, gu, dh) in case(), use_bf16 in any::<bool>()) {
        let cpu = Device::cpu();
        if use_bf16 {
            let got = backward::<bf16>(&cpu, shape, &gu, &dh);
            check_values(shape, &to_t::<bf16>(&gu), Some(&to_t::<bf16>(&dh)), &got, EPS_BF16)?;
        } else {
            check_values(shape, &gu, Some(&dh), &backward::<f32>(&cpu, shape, &gu, &dh), EPS_F32)?;
        }
    }

    /// The reference derivative itself, against a central difference of the f64 silu (step 1e-5:
    /// truncation error about 1e-10 |silu'''|, rounding about 1e-11).
    #[test]
    fn reference_derivative_is_the_derivative(g in -30.0f64..30.0) {
        let h = 1e-5;
        let fd = (silu64(g + h).0 - silu64(g - h).0) / (2.0 * h);
        prop_assert!((fd - silu64(g).1).abs() <= 1e-8, "{} vs {}", fd, silu64(g).1);
    }

    #[test]
    fn fused_forward_equals_swiglu_then_cast_transpose((shape, gu, _dh) in case(), s in settings(), elem in 0u8..3) {
        match elem {
            0 => fused_equals_unfused::<bf16>(shape, &gu, None, s)?,
            1 => fused_equals_unfused::<f32>(shape, &gu, None, s)?,
            _ => fused_equals_unfused::<f16>(shape, &gu, None, s)?,
        }
    }

    #[test]
    fn fused_backward_equals_swiglu_backward_then_cast_transpose((shape, gu, dh) in case(), s in settings(), elem in 0u8..3) {
        match elem {
            0 => fused_equals_unfused::<bf16>(shape, &gu, Some(&dh), s)?,
            1 => fused_equals_unfused::<f32>(shape, &gu, Some(&dh), s)?,
            _ => fused_equals_unfused::<f16>(shape, &gu, Some(&dh), s)?,
        }
    }
}

proptest! {
    // Large enough for the parallel CPU paths (several rayon tasks and transpose bands).
    #![proptest_config(ProptestConfig::with_cases(4))]

    #[test]
    fn large_shapes(rows in 150usize..260, f in 150usize..300, seed in any::<u64>(), use_backward in any::<bool>()) {
        let mut rng = fp8_kernels::rng::SplitMix64::new(seed);
        let gu: Vec<f32> = (0..2 * rows * f).map(|_| rng.uniform_f32() * 6.0 - 3.0).collect();
        let dh: Vec<f32> = (0..rows * f).map(|_| rng.uniform_f32() * 0.01).collect();
        let s = CastSettings { format: if use_backward { Fp8Format::E5M2 } else { Fp8Format::E4M3 }, scale: 16.0, amax0: [0.0; 3], slot: 0 };
        fused_equals_unfused::<bf16>([rows, f], &gu, use_backward.then_some(&dh[..]), s)?;
        let cpu = Device::cpu();
        if use_backward {
            let got = backward::<bf16>(&cpu, [rows, f], &gu, &dh);
            check_values([rows, f], &to_t::<bf16>(&gu), Some(&to_t::<bf16>(&dh)), &got, EPS_BF16)?;
        } else {
            check_values([rows, f], &to_t::<bf16>(&gu), None, &forward::<bf16>(&cpu, [rows, f], &gu), EPS_BF16)?;
        }
    }
}

/// E4M3 outputs of a cast.
fn codes<'a, 'b>(
    scale: &'a Buffer<f32>,
    y: &'a mut Buffer<u8>,
    yt: &'a mut Buffer<u8>,
    amax: Option<AmaxSlot<'b>>,
) -> SwigluCodes<'a, 'b> {
    SwigluCodes {
        format: Fp8Format::E4M3,
        scale,
        codes: Some(y),
        codes_t: Some(yt),
        amax,
    }
}

#[test]
fn bad_arguments_are_errors() {
    let dev = Device::cpu();
    let gu = dev.upload(&[bf16::from_f32(0.5); 12]).unwrap();
    let dh = dev.upload(&[bf16::from_f32(0.5); 6]).unwrap();
    let mut h = dev.zeros::<bf16>(6).unwrap();
    let mut dgu = dev.zeros::<bf16>(12).unwrap();
    swiglu_forward(&gu, [2, 3], &mut h).unwrap();
    swiglu_backward(&gu, &dh, [2, 3], &mut dgu).unwrap();
    assert!(swiglu_forward(&gu, [3, 3], &mut h).is_err());
    assert!(swiglu_forward(&gu, [2, 3], &mut dgu).is_err());
    assert!(swiglu_backward(&gu, &dh, [2, 3], &mut h).is_err());
    assert!(swiglu_backward(&gu, &gu, [2, 3], &mut dgu).is_err());
    assert!(swiglu_forward(&gu, [0, usize::MAX], &mut h).is_err());
    let scale = dev.upload(&[1.0f32]).unwrap();
    let empty = dev.zeros::<f32>(0).unwrap();
    let (mut y, mut yt) = (dev.zeros::<u8>(6).unwrap(), dev.zeros::<u8>(6).unwrap());
    let mut amax = dev.zeros::<f32>(1).unwrap();
    swiglu_cast_fp8(&gu, [2, 3], codes(&scale, &mut y, &mut yt, None)).unwrap();
    assert!(swiglu_cast_fp8(&gu, [2, 3], codes(&empty, &mut y, &mut yt, None)).is_err());
    assert!(swiglu_cast_fp8(
        &gu,
        [2, 3],
        codes(&scale, &mut y, &mut yt, Some(AmaxSlot::new(&mut amax, 1)))
    )
    .is_err());
    // The backward's codes are [rows, 2F]: 6 are too few.
    assert!(
        swiglu_backward_cast_fp8(&gu, &dh, [2, 3], codes(&scale, &mut y, &mut yt, None)).is_err()
    );
}

nvrtc_test! {
    fn swiglu_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&SWIGLU_CAST_MODULE);
        for t in ["f32", "bf16", "f16"] {
            for k in ["swiglu_fwd", "swiglu_bwd"] {
                let entry = format!(".entry {k}_{t}(");
                assert!(ptx.contains(&entry), "{entry} missing");
            }
            for f in ["e4m3", "e5m2"] {
                for k in ["swiglu_cast_transpose", "swiglu_bwd_cast_transpose"] {
                    let entry = format!(".entry {k}_{t}_{f}(");
                    assert!(ptx.contains(&entry), "{entry} missing");
                }
            }
        }
        assert!(ptx.contains("cvt.rn.satfinite.e4m3x2.f32"));
        assert!(ptx.contains("cvt.rn.satfinite.e5m2x2.f32"));
        // exp is the fixed polynomial (as the CPU's exp_fixed), never the hardware approximation.
        assert!(ptx.contains("fma.rn.f32"));
        assert!(!ptx.contains("ex2.approx"), "hardware exp would not match the CPU");
    }
}

/// All four kernels on the GPU equal the CPU's bit for bit (the same f32 operations in the same order,
/// exp included) and are deterministic; shapes take both cast paths (64x64 vectorised and 32x32 tiles).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu() {
    let (gpu, cpu) = (fp8_gpu(), Device::cpu());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(
            &(case(), settings(), any::<bool>()),
            |((shape, gu, dh), s, use_bf16)| {
                let run = |dev: &Device| -> (Vec<u32>, Vec<u32>, Outputs, Outputs) {
                    let widen = |v: Vec<f32>| v.into_iter().map(common::canon).collect::<Vec<_>>();
                    if use_bf16 {
                        (
                            widen(
                                forward::<bf16>(dev, shape, &gu)
                                    .iter()
                                    .map(|v| v.to_f32())
                                    .collect(),
                            ),
                            widen(
                                backward::<bf16>(dev, shape, &gu, &dh)
                                    .iter()
                                    .map(|v| v.to_f32())
                                    .collect(),
                            ),
                            fused::<bf16>(dev, shape, &gu, None, s),
                            fused::<bf16>(dev, shape, &gu, Some(&dh), s),
                        )
                    } else {
                        (
                            widen(forward::<f32>(dev, shape, &gu)),
                            widen(backward::<f32>(dev, shape, &gu, &dh)),
                            fused::<f32>(dev, shape, &gu, None, s),
                            fused::<f32>(dev, shape, &gu, Some(&dh), s),
                        )
                    }
                };
                let (want, g1, g2) = (run(&cpu), run(&gpu), run(&gpu));
                let what = format!("{shape:?} bf16 {use_bf16} {s:?}");
                let ok = matches_cpu_and_deterministic(&what, &want, &g1, &g2, |a, b| {
                    join_differences([
                        first_difference("h", &a.0, &b.0),
                        first_difference("dgu", &a.1, &b.1),
                        first_difference("forward codes", &a.2 .0, &b.2 .0),
                        first_difference("forward codes_t", &a.2 .1, &b.2 .1),
                        first_difference("forward amax", &a.2 .2, &b.2 .2),
                        first_difference("backward codes", &a.3 .0, &b.3 .0),
                        first_difference("backward codes_t", &a.3 .1, &b.3 .1),
                        first_difference("backward amax", &a.3 .2, &b.3 .2),
                    ])
                });
                prop_assert!(ok, "CUDA SwiGLU differs from the CPU: {}", what);
                Ok(())
            },
        )
        .unwrap();
}

/// At Llama-3-8B MLP size (4096 tokens, F = 14336) and a ragged one, BF16, forward into E4M3 and
/// backward into E5M2, fused and unfused, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu_at_mlp_sizes() {
    let (gpu, cpu) = (fp8_gpu(), Device::cpu());
    let mut rng = fp8_kernels::rng::SplitMix64::new(0x5719_106C);
    for shape in [[4096usize, 14336usize], [1000, 777]] {
        let gu: Vec<f32> = (0..2 * shape[0] * shape[1])
            .map(|_| rng.uniform_f32() * 8.0 - 4.0)
            .collect();
        let dh: Vec<f32> = (0..shape[0] * shape[1])
            .map(|_| rng.uniform_f32() * 1e-4)
            .collect();
        let fwd = CastSettings {
            format: Fp8Format::E4M3,
            scale: 64.0,
            amax0: [0.0; 3],
            slot: 0,
        };
        let bwd = CastSettings {
            format: Fp8Format::E5M2,
            scale: 2f32.powi(20),
            amax0: [0.0; 3],
            slot: 1,
        };
        assert!(
            forward::<bf16>(&gpu, shape, &gu) == forward::<bf16>(&cpu, shape, &gu),
            "{shape:?} forward"
        );
        assert!(
            backward::<bf16>(&gpu, shape, &gu, &dh) == backward::<bf16>(&cpu, shape, &gu, &dh),
            "{shape:?} backward"
        );
        assert!(
            fused::<bf16>(&gpu, shape, &gu, None, fwd)
                == fused::<bf16>(&cpu, shape, &gu, None, fwd),
            "{shape:?} fused forward"
        );
        assert!(
            fused::<bf16>(&gpu, shape, &gu, Some(&dh), bwd)
                == fused::<bf16>(&cpu, shape, &gu, Some(&dh), bwd),
            "{shape:?} fused backward"
        );
    }
}
