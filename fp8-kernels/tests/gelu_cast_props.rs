//! The fused GELU + FP8 cast kernels against the unfused path (GELU kernel into a buffer of the element
//! type, then the cast + transpose kernel) on the CPU, bit for bit, on random shapes, values, scales and
//! formats; against a naive scalar reference of the layout; CUDA against the CPU (needs a GPU:
//! ignored unless run with `--ignored`).

mod common;

use common::{assert_each_layout_alone, fp8_gpu, nvrtc_test, sm90_ptx};
use fp8_core::Fp8Format;
use fp8_kernels::elementwise::{
    gelu_backward, gelu_forward, gelu_grad_scalar, gelu_scalar, GeluApprox,
};
use fp8_kernels::gelu_cast::{gelu_backward_cast_fp8, gelu_cast_fp8};
use fp8_kernels::kernel_source::GELU_CAST_MODULE;
use fp8_kernels::{cast_transpose_to_fp8, AmaxSlot, Buffer, Device, FloatElement};
use half::{bf16, f16};
use proptest::prelude::*;

/// Mostly the range where GELU bends, some large values, some specials (NaN, infinities, subnormals).
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -6.0f32..6.0,
        2 => -600.0f32..600.0,
        1 => proptest::num::f32::ANY,
        1 => -1e-3f32..1e-3,
    ]
}

fn format() -> impl Strategy<Value = Fp8Format> {
    prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)]
}

fn approx() -> impl Strategy<Value = GeluApprox> {
    prop_oneof![Just(GeluApprox::Erf), Just(GeluApprox::Tanh)]
}

/// Powers of two across the useful range, and arbitrary positive scales.
fn scale() -> impl Strategy<Value = f32> {
    prop_oneof![(-12i32..12).prop_map(|e| 2f32.powi(e)), 0.001f32..1000.0,]
}

/// A shape (some sides above one 32-wide tile, ragged edges) and `u`, `dh` of that many values.
fn case(max_side: usize) -> impl Strategy<Value = ([usize; 2], Vec<f32>, Vec<f32>)> {
    (1..max_side, 1..max_side).prop_flat_map(|(r, c)| {
        (
            Just([r, c]),
            proptest::collection::vec(value(), r * c),
            proptest::collection::vec(value(), r * c),
        )
    })
}

/// What one cast produced: row-major codes, transposed codes, the amax buffer (bits).
type Outputs = (Vec<u8>, Vec<u8>, Vec<u32>);

fn bits(v: Vec<f32>) -> Vec<u32> {
    v.into_iter().map(f32::to_bits).collect()
}

/// Inputs of one comparison on a device.
struct Inputs<'a> {
    shape: [usize; 2],
    u: &'a [f32],
    dh: Option<&'a [f32]>,
    approx: GeluApprox,
    format: Fp8Format,
    scale: f32,
    amax0: [f32; 3],
    slot: usize,
}

fn to_t<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn unfused<T: FloatElement>(dev: &Device, c: &Inputs<'_>) -> Outputs {
    let n = c.u.len();
    let u: Buffer<T> = dev.upload(&to_t::<T>(c.u)).unwrap();
    let mut h: Buffer<T> = dev.zeros(n).unwrap();
    match c.dh {
        None => gelu_forward(&u, &mut h, c.approx).unwrap(),
        Some(g) => {
            let g: Buffer<T> = dev.upload(&to_t::<T>(g)).unwrap();
            gelu_backward(&u, &g, &mut h, c.approx).unwrap()
        }
    }
    let scale = dev.upload(&[c.scale]).unwrap();
    let (mut y, mut yt) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let mut amax = dev.upload(&c.amax0).unwrap();
    cast_transpose_to_fp8(
        &h,
        c.shape,
        c.format,
        &scale,
        &mut yt,
        Some(&mut y),
        Some(AmaxSlot::new(&mut amax, c.slot)),
    )
    .unwrap();
    (
        y.to_vec().unwrap(),
        yt.to_vec().unwrap(),
        bits(amax.to_vec().unwrap()),
    )
}

fn fused<T: FloatElement>(dev: &Device, c: &Inputs<'_>) -> Outputs {
    let n = c.u.len();
    let u: Buffer<T> = dev.upload(&to_t::<T>(c.u)).unwrap();
    let scale = dev.upload(&[c.scale]).unwrap();
    let g: Option<Buffer<T>> = c.dh.map(|g| dev.upload(&to_t::<T>(g)).unwrap());
    let run = |y: Option<&mut Buffer<u8>>, yt: Option<&mut Buffer<u8>>| {
        let mut amax = dev.upload(&c.amax0).unwrap();
        let slot = Some(AmaxSlot::new(&mut amax, c.slot));
        match &g {
            None => gelu_cast_fp8(&u, c.shape, c.approx, c.format, &scale, y, yt, slot).unwrap(),
            Some(g) => {
                gelu_backward_cast_fp8(&u, g, c.shape, c.approx, c.format, &scale, y, yt, slot)
                    .unwrap()
            }
        }
        bits(amax.to_vec().unwrap())
    };
    let (mut y, mut yt) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let amax = run(Some(&mut y), Some(&mut yt));
    let (y, yt) = (y.to_vec().unwrap(), yt.to_vec().unwrap());
    // Either layout alone: the same codes and amax, the other buffer untouched.
    assert_each_layout_alone(dev, &y, &yt, &amax, &format!("{:?}", c.shape), run);
    (y, yt, amax)
}

/// The naive scalar definition: value rounded to T, encoded; transpose by index; amax accumulated.
fn naive<T: FloatElement>(c: &Inputs<'_>) -> Outputs {
    let [rows, cols] = c.shape;
    let h: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let v = T::from_f32(c.u[i]).to_f32();
            let x = match c.dh {
                None => gelu_scalar(v, c.approx),
                Some(g) => gelu_grad_scalar(v, c.approx) * T::from_f32(g[i]).to_f32(),
            };
            T::from_f32(x).to_f32()
        })
        .collect();
    let y: Vec<u8> = h.iter().map(|&v| c.format.encode(v * c.scale)).collect();
    let mut yt = vec![0u8; rows * cols];
    for r in 0..rows {
        for k in 0..cols {
            yt[k * rows + r] = y[r * cols + k];
        }
    }
    let mut amax = c.amax0;
    for v in h {
        if !v.is_nan() && v.abs() > amax[c.slot] {
            amax[c.slot] = v.abs();
        }
    }
    (y, yt, bits(amax.to_vec()))
}

fn check_all<T: FloatElement>(c: &Inputs<'_>) -> Result<(), TestCaseError> {
    let cpu = Device::cpu();
    let want = unfused::<T>(&cpu, c);
    let got = fused::<T>(&cpu, c);
    prop_assert_eq!(&got.0, &want.0, "row-major codes");
    prop_assert_eq!(&got.1, &want.1, "transposed codes");
    prop_assert_eq!(&got.2, &want.2, "amax buffer");
    let reference = naive::<T>(c);
    prop_assert_eq!(&got, &reference, "naive reference");
    Ok(())
}

/// GELU approximation, format, scale, the amax buffer before, its slot, and the element type for
/// [`check_elem`].
fn settings() -> impl Strategy<Value = (GeluApprox, Fp8Format, f32, [f32; 3], usize, u8)> {
    let amax0 = (0.0f32..3.0, 0.0f32..3.0, 0.0f32..3.0).prop_map(|(a, b, c)| [a, b, c]);
    (approx(), format(), scale(), amax0, 0usize..3, 0u8..3)
}

/// [`check_all`] in the element type `elem` names: 0 bf16, 1 f32, else f16.
fn check_elem(elem: u8, c: &Inputs<'_>) -> Result<(), TestCaseError> {
    match elem {
        0 => check_all::<bf16>(c),
        1 => check_all::<f32>(c),
        _ => check_all::<f16>(c),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn forward_equals_gelu_then_cast_transpose((shape, u, _dh) in case(80), (approx, format, scale, amax0, slot, elem) in settings()) {
        let c = Inputs { shape, u: &u, dh: None, approx, format, scale, amax0, slot };
        check_elem(elem, &c)?;
    }

    #[test]
    fn backward_equals_gelu_backward_then_cast_transpose((shape, u, dh) in case(80), (approx, format, scale, amax0, slot, elem) in settings()) {
        let c = Inputs { shape, u: &u, dh: Some(&dh), approx, format, scale, amax0, slot };
        check_elem(elem, &c)?;
    }
}

proptest! {
    // Large enough for the parallel CPU paths (several rayon tasks and transpose bands).
    #![proptest_config(ProptestConfig::with_cases(4))]

    #[test]
    fn large_shapes_equal_unfused(
        rows in 150usize..260,
        cols in 150usize..300,
        seed in any::<u64>(),
        backward in any::<bool>(),
    ) {
        let mut rng = fp8_kernels::rng::SplitMix64::new(seed);
        let u: Vec<f32> = (0..rows * cols).map(|_| rng.uniform_f32() * 5.0).collect();
        let dh: Vec<f32> = (0..rows * cols).map(|_| rng.uniform_f32() * 0.01).collect();
        let c = Inputs { shape: [rows, cols], u: &u, dh: backward.then_some(&dh[..]),
            approx: GeluApprox::Erf, format: if backward { Fp8Format::E5M2 } else { Fp8Format::E4M3 },
            scale: 16.0, amax0: [0.0; 3], slot: 0 };
        check_all::<bf16>(&c)?;
    }
}

#[test]
fn bad_arguments_are_errors() {
    let dev = Device::cpu();
    let u = dev.upload(&[bf16::from_f32(0.5); 12]).unwrap();
    let scale = dev.upload(&[1.0f32]).unwrap();
    let empty = dev.zeros::<f32>(0).unwrap();
    let mut y = dev.zeros::<u8>(12).unwrap();
    let mut yt = dev.zeros::<u8>(12).unwrap();
    let mut short = dev.zeros::<u8>(11).unwrap();
    let mut amax = dev.zeros::<f32>(1).unwrap();
    let (a, f) = (GeluApprox::Erf, Fp8Format::E4M3);
    assert!(gelu_cast_fp8(&u, [3, 5], a, f, &scale, Some(&mut y), Some(&mut yt), None).is_err());
    assert!(gelu_cast_fp8(
        &u,
        [3, 4],
        a,
        f,
        &scale,
        Some(&mut short),
        Some(&mut yt),
        None
    )
    .is_err());
    assert!(gelu_cast_fp8(&u, [3, 4], a, f, &empty, Some(&mut y), Some(&mut yt), None).is_err());
    assert!(gelu_cast_fp8(
        &u,
        [3, 4],
        a,
        f,
        &scale,
        Some(&mut y),
        Some(&mut yt),
        Some(AmaxSlot::new(&mut amax, 1))
    )
    .is_err());
    assert!(gelu_cast_fp8(&u, [3, 4], a, f, &scale, None, None, None).is_err());
    let dh = dev.upload(&[bf16::from_f32(0.5); 10]).unwrap();
    assert!(gelu_backward_cast_fp8(
        &u,
        &dh,
        [3, 4],
        a,
        f,
        &scale,
        Some(&mut y),
        Some(&mut yt),
        None
    )
    .is_err());
    assert!(gelu_cast_fp8(
        &u,
        [usize::MAX, 2],
        a,
        f,
        &scale,
        Some(&mut y),
        Some(&mut yt),
        None
    )
    .is_err());
}

nvrtc_test! {
    fn fused_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&GELU_CAST_MODULE);
        for t in ["f32", "bf16", "f16"] {
            for f in ["e4m3", "e5m2"] {
                for k in ["gelu", "gelu_bwd"] {
                    let entry = format!(".entry {k}_cast_transpose_{t}_{f}");
                    assert!(ptx.contains(&entry), "{entry} missing");
                }
            }
        }
        assert!(ptx.contains("cvt.rn.satfinite.e4m3x2.f32"));
        assert!(ptx.contains("cvt.rn.satfinite.e5m2x2.f32"));
    }
}

/// Signed ordinal of an FP8 code (adjacent values have adjacent ordinals; +0 and -0 are both 0).
fn ordinal(code: u8) -> i32 {
    let m = (code & 0x7F) as i32;
    if code & 0x80 != 0 {
        -m
    } else {
        m
    }
}

/// CUDA and CPU agree up to one FP8 step per code (their `exp`/`tanh` may differ in the last f32 bit,
/// which can move the rounded value by one unit), NaN exactly where the other has NaN, and amaxes within
/// one bf16 unit.
fn near(format: Fp8Format, got: &Outputs, want: &Outputs) -> Result<(), TestCaseError> {
    for (what, g, w) in [
        ("codes", &got.0, &want.0),
        ("transposed codes", &got.1, &want.1),
    ] {
        for (i, (&a, &b)) in g.iter().zip(w.iter()).enumerate() {
            let nan = |c: u8| format.decode(c).is_nan();
            prop_assert_eq!(
                nan(a),
                nan(b),
                "{} {}: NaN mismatch {:#04x} {:#04x}",
                what,
                i,
                a,
                b
            );
            prop_assert!(
                (ordinal(a) - ordinal(b)).abs() <= 1,
                "{} {}: {:#04x} vs {:#04x}",
                what,
                i,
                a,
                b
            );
        }
    }
    for (&a, &b) in got.2.iter().zip(&want.2) {
        let (a, b) = (f32::from_bits(a), f32::from_bits(b));
        prop_assert!(
            a == b || (a - b).abs() <= b.abs() * (1.0 / 128.0),
            "amax {} vs {}",
            a,
            b
        );
    }
    Ok(())
}

/// On the GPU the fused kernels equal the unfused GPU kernels bit for bit (same f32 operations, same
/// device math library), and agree with the CPU implementation up to the last bit of `exp`/`tanh`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fused_matches_unfused_and_cpu() {
    let (gpu, cpu) = (fp8_gpu(), Device::cpu());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(
            &(
                case(100),
                approx(),
                format(),
                scale(),
                any::<bool>(),
                0u8..3,
            ),
            |((shape, u, dh), approx, format, scale, backward, elem)| {
                let c = Inputs {
                    shape,
                    u: &u,
                    dh: backward.then_some(&dh[..]),
                    approx,
                    format,
                    scale,
                    amax0: [0.25, 0.0, 1.5],
                    slot: 2,
                };
                let (got, unfused_gpu, on_cpu) = match elem {
                    0 => (
                        fused::<bf16>(&gpu, &c),
                        unfused::<bf16>(&gpu, &c),
                        fused::<bf16>(&cpu, &c),
                    ),
                    1 => (
                        fused::<f32>(&gpu, &c),
                        unfused::<f32>(&gpu, &c),
                        fused::<f32>(&cpu, &c),
                    ),
                    _ => (
                        fused::<f16>(&gpu, &c),
                        unfused::<f16>(&gpu, &c),
                        fused::<f16>(&cpu, &c),
                    ),
                };
                prop_assert_eq!(&got, &unfused_gpu, "fused vs unfused on the GPU");
                near(format, &got, &on_cpu)
            },
        )
        .unwrap();
}

/// As [`cuda_fused_matches_unfused_and_cpu`], at MLP sizes (`[tokens, 4d]`, where the CPU path runs in
/// parallel and the kernels fill the GPU) and ragged ones (partial tiles), BF16 and the erf GELU as a
/// model runs them: forward into E4M3, backward into E5M2 at a gradient-sized scale.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fused_matches_unfused_and_cpu_at_mlp_sizes() {
    let (gpu, cpu) = (fp8_gpu(), Device::cpu());
    let mut rng = fp8_kernels::rng::SplitMix64::new(0x5EED_F05E);
    for shape in [[4096usize, 8192usize], [1000, 777], [33, 4097], [1, 1]] {
        let n = shape[0] * shape[1];
        let u: Vec<f32> = (0..n).map(|_| rng.uniform_f32() * 4.0).collect();
        let dh: Vec<f32> = (0..n).map(|_| rng.uniform_f32() * 1e-4).collect();
        for (backward, format, scale) in [
            (false, Fp8Format::E4M3, 64.0f32),
            (true, Fp8Format::E5M2, 2f32.powi(20)),
        ] {
            let c = Inputs {
                shape,
                u: &u,
                dh: backward.then_some(&dh[..]),
                approx: GeluApprox::Erf,
                format,
                scale,
                amax0: [0.0; 3],
                slot: 0,
            };
            let got = fused::<bf16>(&gpu, &c);
            assert_eq!(
                got,
                unfused::<bf16>(&gpu, &c),
                "{shape:?} backward {backward}: fused vs unfused on the GPU"
            );
            near(format, &got, &fused::<bf16>(&cpu, &c)).unwrap();
        }
    }
}
