//! The device-side control of an Adam step (and the Adam updates reading their coefficients from the
//! device, and the casts of per-tensor and block-scaled FP8 weights from their masters): NVRTC compile
//! check, CPU properties against simple references, and CUDA against CPU on random inputs, bit for bit
//! (needs a GPU: ignored unless run with `--ignored`).

mod common;

use common::{assert_kernels, cuda_device, nvrtc_test, sm90_ptx};
use fp8_core::Fp8Format;
use fp8_kernels::adam::control::*;
use fp8_kernels::adam::{
    adam_element, adam_step_f32, adam_step_low_precision, AmaxSlots, Coefficients,
};
use fp8_kernels::adam::{lp_slot, LowPrecisionAdamState};
use fp8_kernels::kernel_source::ADAM_MODULE;
use fp8_kernels::reduce::{norm_stats, norm_stats_finish, NORM_STATS_ACC_LEN};
use fp8_kernels::segmented::{segmented_cast, Segment, SegmentTable};
use fp8_kernels::{
    block_quantize, AdamConfig, BlockQuantLayout, BlockQuantSpec, Buffer, Device, ScaleOrder,
    WeightDecay,
};
use half::{bf16, f16};
use proptest::prelude::*;

nvrtc_test! {
    fn adam_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&ADAM_MODULE);
        assert_kernels(
            &ptx,
            &[
                "adam_coefficients_from_stats",
                "adam_lp_ctl_g_f32",
                "weight_source_values",
                "cast_weight_source",
                "adam_f32_ctl_g_bf16",
                "adam_lp_ctl_g_bf16",
                "adam_commit_amaxes",
                "cast_weight_blocks",
            ],
        );
    }
}

/// The state-scale rule fsdp-optim's policy uses (margins of master, first and second moment; bound
/// slack; factor of the update-ratio bound).
const RULE: StateScaleRule = StateScaleRule {
    margins: [4, 0, 1],
    slack: 1.01,
    ratio_factor: 2.0,
};

#[allow(clippy::too_many_arguments)]
fn params(
    lr: f64,
    b1: f64,
    b2: f64,
    wd: f64,
    l2: bool,
    clip: f64,
    low: bool,
    n: usize,
    ws: usize,
) -> AdamControlParams {
    AdamControlParams {
        adam: AdamConfig {
            lr,
            beta1: b1,
            beta2: b2,
            eps: 1e-8,
            weight_decay: wd,
            decay_mode: if l2 {
                WeightDecay::L2
            } else {
                WeightDecay::Decoupled
            },
            maximize: false,
        },
        max_grad_norm: (clip > 0.0).then_some(clip),
        clip_eps: 1e-6,
        state_scales: low.then_some(RULE),
        slots: n,
        world_size: ws,
    }
}

/// Runs norm_stats + finish + adam_coefficients_from_stats on `dev` and returns (sums, ctl, coef, write,
/// kernel scales).
#[allow(clippy::type_complexity)]
fn control_run(
    dev: &Device,
    p: &AdamControlParams,
    grads: &[Vec<f32>],
    amaxes: &[f32],
    scales: &[f32],
    ctl0: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = p.slots;
    let mut acc = dev.zeros::<f32>(NORM_STATS_ACC_LEN).unwrap();
    let mut sums = dev.zeros::<f32>(2 + n * p.world_size).unwrap();
    for (i, g) in grads.iter().enumerate() {
        let b = dev.upload(g).unwrap();
        norm_stats(&b, 0..g.len(), &mut acc, Some((&mut sums, 2 + i % n))).unwrap();
    }
    norm_stats_finish(&mut acc, 0, &mut sums).unwrap();
    let mut c = dev.upload(ctl0).unwrap();
    let mut coef = dev.zeros::<f32>(COEF_LEN).unwrap();
    let am = dev.upload(amaxes).unwrap();
    let sc = dev.upload(scales).unwrap();
    let mut write = dev.zeros::<f32>(3 * n).unwrap();
    let mut ks = dev.zeros::<f32>(6 * n).unwrap();
    let mut rep = dev.zeros::<f32>(ctl::LEN).unwrap();
    adam_coefficients_from_stats(
        p,
        &sums,
        &mut c,
        &mut coef,
        Some(SlotScales {
            amaxes: &am,
            scales: &sc,
            write: &mut write,
            kernel_scales: &mut ks,
        }),
        &mut rep,
    )
    .unwrap();
    assert_eq!(rep.to_vec().unwrap(), c.to_vec().unwrap());
    (
        sums.to_vec().unwrap(),
        c.to_vec().unwrap(),
        coef.to_vec().unwrap(),
        write.to_vec().unwrap(),
        ks.to_vec().unwrap(),
    )
}

fn rnd(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    ((*seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The control kernel's coefficients are AdamConfig::coefficients' (same arithmetic), its statistics
    /// the plain sums, and its write scales cover the exact new states (the bound rule).
    #[test]
    fn control_matches_references(
        seed in any::<u64>(), lr in 1e-5f64..1e-1, b1 in 0.0f64..0.99, b2 in 0.5f64..0.9999,
        wd in 0.0f64..0.2, l2 in any::<bool>(), step in 0u32..5000, clip in prop_oneof![Just(0.0), 0.1f64..10.0],
        nan in any::<bool>(),
    ) {
        let mut s = seed | 1;
        let n = 3;
        let mut grads: Vec<Vec<f32>> = (0..n).map(|i| (0..(5 + 7 * i)).map(|_| rnd(&mut s) * 3.0).collect()).collect();
        if nan { grads[1][2] = f32::NAN; grads[2][0] = f32::INFINITY; }
        let p = params(lr, b1, b2, wd, l2, clip, true, n, 1);
        let amaxes: Vec<f32> = (0..3 * n).map(|_| rnd(&mut s).abs()).collect();
        let scales: Vec<f32> = (0..3 * n).map(|k| 2f32.powi(k as i32 % 5)).collect();
        let mut ctl0 = vec![0f32; ctl::LEN];
        ctl0[ctl::STEP] = f32::from_bits(step);
        let (sums, c, coef, write, ks) = control_run(&Device::cpu(), &p, &grads, &amaxes, &scales, &ctl0);
        let all: Vec<f32> = grads.iter().flatten().copied().collect();
        let nf = all.iter().filter(|x| !x.is_finite()).count();
        let sq: f64 = all.iter().filter(|x| x.is_finite()).map(|&x| x as f64 * x as f64).sum();
        prop_assert_eq!(sums[0], nf as f32);
        prop_assert!(((sums[1] as f64) - sq).abs() <= 1e-6 * sq.max(1e-30));
        for i in 0..n {
            let a = grads[i].iter().filter(|x| x.is_finite()).fold(0f32, |m, x| m.max(x.abs()));
            prop_assert_eq!(sums[2 + i], a);
        }
        if nan {
            prop_assert_eq!(coef[COEF_SKIP], 1.0);
            prop_assert_eq!(c[ctl::STEP].to_bits(), step);
            prop_assert_eq!(c[ctl::SKIP_COUNT].to_bits(), 1);
            return Ok(());
        }
        prop_assert_eq!(coef[COEF_SKIP], 0.0);
        prop_assert_eq!(c[ctl::STEP].to_bits(), step + 1);
        let norm = (sums[1] as f64).sqrt();
        let gs = if clip > 0.0 { (clip / (norm + 1e-6)).min(1.0) } else { 1.0 };
        let cfg = AdamConfig { lr, beta1: b1, beta2: b2, eps: 1e-8, weight_decay: wd,
            decay_mode: if l2 { WeightDecay::L2 } else { WeightDecay::Decoupled }, maximize: false };
        let want = cfg.coefficients(step as u64 + 1, gs as f32).unwrap();
        // The coefficient words hold exactly these coefficients.
        let (got, skipped) = coefficients_of(&Buffer::from_vec(coef.clone())).unwrap();
        prop_assert!(!skipped);
        prop_assert_eq!(got, want);
        prop_assert_eq!(coef[4], want.step_size);
        prop_assert_eq!(coef[9], want.grad_scale);
        // Write scales: powers of two, and the kernel table reads with the old inverses.
        for i in 0..n {
            for k in 0..3 {
                prop_assert_eq!(write[3 * i + k].to_bits() & 0x007F_FFFF, 0);
                prop_assert_eq!(ks[6 * i + 2 * k], 1.0 / scales[3 * i + k]);
                prop_assert_eq!(ks[6 * i + 2 * k + 1], write[3 * i + k]);
            }
            // The exact first moment from the previous amax and this gradient fits the E4M3 range.
            let m_new = b1 as f32 * amaxes[3 * i + 1] + (1.0 - b1 as f32) * sums[2 + i] * gs as f32;
            prop_assert!(m_new * write[3 * i + 1] <= 448.0 * 1.001);
        }
    }

    /// A skipped step leaves weights and states untouched (unlike lr = 0, which moves the moments), and
    /// the skip path of weight_source_values reproduces the FP8 weight's codes through the cast.
    #[test]
    fn skip_is_a_no_op(seed in any::<u64>(), len in 1usize..200, e in -6i32..6) {
        let dev = Device::cpu();
        let mut s = seed | 1;
        let w: Vec<f32> = (0..len).map(|_| rnd(&mut s)).collect();
        let g: Vec<f32> = (0..len).map(|_| rnd(&mut s)).collect();
        let mut coef = vec![0f32; COEF_LEN];
        coef[COEF_SKIP] = 1.0;
        let coef_b = dev.upload(&coef).unwrap();
        let (mut mw, mut mm, mut mv) = (dev.upload(&w).unwrap(), dev.upload(&g).unwrap(), dev.upload(&g).unwrap());
        let gb = dev.upload(&g).unwrap();
        let mut amax = dev.zeros::<f32>(1).unwrap();
        adam_step_f32(Coefficients::Device(&coef_b), 0..len, &mut mw, &mut mm, &mut mv, &gb,
            Some(AmaxSlots { buffer: &mut amax, base: 0 })).unwrap();
        prop_assert_eq!(mw.to_vec().unwrap(), w.clone());
        prop_assert_eq!(mm.to_vec().unwrap(), g.clone());
        prop_assert_eq!(amax.to_vec().unwrap(), vec![0.0]);
        // lr = 0 is not a no-op for the moments: the guard is needed.
        let c0 = AdamConfig { lr: 0.0, ..AdamConfig::default() }.coefficients(1, 1.0).unwrap();
        let (_, m1, _) = adam_element(&c0, g[0], w[0], 0.0, 0.0);
        prop_assert!(g[0] == 0.0 || m1 != 0.0);
        // weight_source_values on a skipped step: decode * scale_inv, cast back with the scale: same codes.
        let scale = 2f32.powi(e);
        let codes: Vec<u8> = w.iter().map(|x| Fp8Format::E4M3.encode(x * scale)).collect();
        let q = dev.upload(&codes).unwrap();
        let wsc = dev.upload(&[scale, 1.0 / scale]).unwrap();
        let mut out: Buffer<f32> = dev.zeros(len).unwrap();
        weight_source_values(&coef_b, &mut out, 0..len, &q, &wsc, 0, MasterSource::F32(&mw)).unwrap();
        let back: Vec<u8> = out.to_vec().unwrap().iter().map(|x| Fp8Format::E4M3.encode(x * scale)).collect();
        prop_assert_eq!(back, codes);
    }
}

/// A closure running an F32-state step on (master, m, v).
type F32Step<'a> = dyn Fn(&mut Buffer<f32>, &mut Buffer<f32>, &mut Buffer<f32>) + 'a;

/// The coefficient buffer of AdamW step `t` with PyTorch's defaults (not skipped).
fn coef_words(t: u64) -> Vec<f32> {
    let c = AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::default()
    }
    .coefficients(t, 1.0)
    .unwrap();
    let i = |x: i32| f32::from_bits(x as u32);
    let mut w = vec![
        c.beta1,
        c.one_minus_beta1,
        c.beta2,
        c.one_minus_beta2,
        c.step_size,
        c.bc2_sqrt,
        c.eps,
        c.weight_decay,
        c.decay,
        c.grad_scale,
        i(c.maximize),
        i(c.l2),
        i(c.decoupled),
        i(c.pad),
    ];
    w.resize(COEF_LEN, 0.0);
    w
}

/// Runs `cast_weight_source` and, for comparison, `weight_source_values` into an F32 buffer followed by
/// `segmented_cast` over `range`, on `dev`; returns both code vectors.
#[allow(clippy::too_many_arguments)]
fn cast_both_ways(
    dev: &Device,
    skip: bool,
    codes: &[u8],
    range: std::ops::Range<usize>,
    scale_pair: [f32; 2],
    master32: &[f32],
    master16: Option<(&[f16], f32)>,
) -> (Vec<u8>, Vec<u8>) {
    let mut coef = vec![0f32; COEF_LEN];
    coef[COEF_SKIP] = if skip { 1.0 } else { 0.0 };
    let coef = dev.upload(&coef).unwrap();
    let wsc = dev.upload(&scale_pair).unwrap();
    let m32 = dev.upload(master32).unwrap();
    let (m16, st) = match master16 {
        Some((m, s)) => (
            Some(dev.upload(m).unwrap()),
            dev.upload(&[0.0, 0.0, 0.0, s, 1.0, 1.0]).unwrap(),
        ),
        None => (None, dev.zeros::<f32>(6).unwrap()),
    };
    let source = || match &m16 {
        Some(m) => MasterSource::F16 {
            master: m,
            scales: &st,
            slot: 1,
        },
        None => MasterSource::F32(&m32),
    };
    let mut fused = dev.upload(codes).unwrap();
    cast_weight_source(&coef, &mut fused, range.clone(), &wsc, 0, source()).unwrap();
    let q = dev.upload(codes).unwrap();
    let mut out: Buffer<f32> = dev.zeros(codes.len()).unwrap();
    weight_source_values(&coef, &mut out, range.clone(), &q, &wsc, 0, source()).unwrap();
    let table = SegmentTable::new(
        dev,
        &[Segment {
            start: range.start,
            end: range.end,
            slot: 0,
        }],
    )
    .unwrap();
    let mut two_pass = dev.upload(codes).unwrap();
    segmented_cast(&out, &table, fp8_core::Fp8Format::E4M3, &wsc, &mut two_pass).unwrap();
    (fused.to_vec().unwrap(), two_pass.to_vec().unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The fused source cast writes the same codes as weight_source_values + segmented_cast (F32 and F16
    /// masters, skipped or not), and leaves codes outside the range alone.
    #[test]
    fn cast_weight_source_is_source_values_then_cast(
        seed in any::<u64>(), len in 1usize..300, e in -6i32..6, skip in any::<bool>(), f16m in any::<bool>(),
        cut in 0usize..50,
    ) {
        let mut s = seed | 1;
        let scale = 2f32.powi(e);
        let w: Vec<f32> = (0..len).map(|_| rnd(&mut s) * 3.0).collect();
        let codes: Vec<u8> = (0..len).map(|_| (rnd(&mut s).to_bits() >> 9) as u8).collect();
        let m16: Vec<f16> = w.iter().map(|&x| f16::from_f32(x * 16.0)).collect();
        let start = cut.min(len - 1);
        let (fused, two) = cast_both_ways(&Device::cpu(), skip, &codes, start..len, [scale, 1.0 / scale],
            &w, f16m.then_some((&m16[..], 16.0)));
        prop_assert_eq!(&fused[..start], &codes[..start]);
        prop_assert_eq!(fused, two);
    }

    /// BF16 gradients: the statistics and both Adam steps equal the F32 path fed the widened values.
    #[test]
    fn bf16_gradients_equal_widened_f32(seed in any::<u64>(), len in 1usize..200) {
        let dev = Device::cpu();
        let mut s = seed | 1;
        let g16: Vec<bf16> = (0..len).map(|_| bf16::from_f32(rnd(&mut s) * 0.1)).collect();
        let g32: Vec<f32> = g16.iter().map(|g| g.to_f32()).collect();
        let w: Vec<f32> = (0..len).map(|_| rnd(&mut s)).collect();
        let (b16, b32) = (dev.upload(&g16).unwrap(), dev.upload(&g32).unwrap());
        let stats = |g: &dyn Fn(&mut Buffer<f32>, &mut Buffer<f32>)| {
            let mut acc = dev.zeros::<f32>(NORM_STATS_ACC_LEN).unwrap();
            let mut sums = dev.zeros::<f32>(3).unwrap();
            g(&mut acc, &mut sums);
            norm_stats_finish(&mut acc, 0, &mut sums).unwrap();
            sums.to_vec().unwrap()
        };
        let a = stats(&|acc, sums| norm_stats(&b16, 0..len, acc, Some((sums, 2))).unwrap());
        let b = stats(&|acc, sums| norm_stats(&b32, 0..len, acc, Some((sums, 2))).unwrap());
        prop_assert_eq!(a, b);
        let coef = dev.upload(&coef_words(3)).unwrap();
        let run32 = |g: &F32Step<'_>| {
            let (mut mw, mut mm, mut mv) = (dev.upload(&w).unwrap(), dev.zeros(len).unwrap(), dev.zeros(len).unwrap());
            g(&mut mw, &mut mm, &mut mv);
            (mw.to_vec().unwrap(), mm.to_vec().unwrap(), mv.to_vec().unwrap())
        };
        let c = Coefficients::Device(&coef);
        let x = run32(&|w, m, v| adam_step_f32(c, 0..len, w, m, v, &b16, None).unwrap());
        let y = run32(&|w, m, v| adam_step_f32(c, 0..len, w, m, v, &b32, None).unwrap());
        prop_assert_eq!(x, y);
        let scales = dev.upload(&[1.0f32 / 1024.0, 1024.0, 1.0, 64.0, 1.0, 1024.0]).unwrap();
        let lp = |use16: bool| {
            let mut master = dev.upload(&w.iter().map(|&x| f16::from_f32(x * 1024.0)).collect::<Vec<_>>()).unwrap();
            let mut m = dev.zeros::<u8>(len).unwrap();
            let mut v = dev.zeros::<f16>(len).unwrap();
            let mut amax = dev.zeros::<f32>(lp_slot::AMAXES).unwrap();
            let st = LowPrecisionAdamState { master: &mut master, m: &mut m, v: &mut v };
            let am = AmaxSlots { buffer: &mut amax, base: 0 };
            if use16 {
                adam_step_low_precision(c, 0..len, st, &b16, &scales, 0, am).unwrap();
            } else {
                adam_step_low_precision(c, 0..len, st, &b32, &scales, 0, am).unwrap();
            }
            (master.to_vec().unwrap(), m.to_vec().unwrap(), v.to_vec().unwrap(), amax.to_vec().unwrap())
        };
        prop_assert_eq!(lp(true), lp(false));
    }
}

/// CUDA against CPU for the fused source cast and the BF16-gradient kernels, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_cast_weight_source_and_bf16_grads_match_cpu() {
    let gpu = cuda_device();
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    for case in 0..64u32 {
        let len = 1 + (case as usize * 7919) % 100_000;
        let w: Vec<f32> = (0..len).map(|_| rnd(&mut s) * 3.0).collect();
        let codes: Vec<u8> = (0..len)
            .map(|_| (rnd(&mut s).to_bits() >> 9) as u8)
            .collect();
        let m16: Vec<f16> = w.iter().map(|&x| f16::from_f32(x * 16.0)).collect();
        let scale = 2f32.powi(case as i32 % 9 - 4);
        let start = (case as usize * 13) % len;
        let master16 = (case % 2 == 0).then_some((&m16[..], 16.0f32));
        let args = |d: &Device| {
            cast_both_ways(
                d,
                case % 5 == 0,
                &codes,
                start..len,
                [scale, 1.0 / scale],
                &w,
                master16,
            )
        };
        let (c, g) = (args(&Device::cpu()), args(&gpu));
        assert_eq!(c.0, g.0, "case {case}: fused cast");
        assert_eq!(g.0, g.1, "case {case}: fused vs two-pass on the GPU");
        // BF16 gradients through the statistics and the low-precision step.
        let g16: Vec<bf16> = (0..len)
            .map(|_| bf16::from_f32(rnd(&mut s) * 0.1))
            .collect();
        let run = |d: &Device| {
            let b = d.upload(&g16).unwrap();
            let mut acc = d.zeros::<f32>(NORM_STATS_ACC_LEN).unwrap();
            let mut sums = d.zeros::<f32>(3).unwrap();
            norm_stats(&b, 0..len, &mut acc, Some((&mut sums, 2))).unwrap();
            let coef = d.upload(&coef_words(2)).unwrap();
            let scales = d
                .upload(&[1.0f32 / 16.0, 16.0, 1.0, 64.0, 1.0, 1024.0])
                .unwrap();
            let mut master = d.upload(&m16).unwrap();
            let mut m = d.zeros::<u8>(len).unwrap();
            let mut v = d.zeros::<f16>(len).unwrap();
            let mut amax = d.zeros::<f32>(3).unwrap();
            adam_step_low_precision(
                Coefficients::Device(&coef),
                0..len,
                LowPrecisionAdamState {
                    master: &mut master,
                    m: &mut m,
                    v: &mut v,
                },
                &b,
                &scales,
                0,
                AmaxSlots {
                    buffer: &mut amax,
                    base: 0,
                },
            )
            .unwrap();
            let mut mw = d.upload(&w).unwrap();
            let (mut m2, mut v2) = (d.zeros::<f32>(len).unwrap(), d.zeros::<f32>(len).unwrap());
            adam_step_f32(
                Coefficients::Device(&coef),
                0..len,
                &mut mw,
                &mut m2,
                &mut v2,
                &b,
                None,
            )
            .unwrap();
            (
                sums.to_vec().unwrap()[2],
                acc.to_vec().unwrap()[2].to_bits(),
                master.to_vec().unwrap(),
                m.to_vec().unwrap(),
                v.to_vec().unwrap(),
                amax.to_vec().unwrap(),
                mw.to_vec().unwrap(),
            )
        };
        let (c, g) = (run(&Device::cpu()), run(&gpu));
        assert_eq!(c.0, g.0, "case {case}: bf16 grad amax");
        assert_eq!(c.1, g.1, "case {case}: bf16 non-finite count");
        assert_eq!(c.2, g.2, "case {case}: master");
        assert_eq!(c.3, g.3, "case {case}: m");
        assert_eq!(c.4, g.4, "case {case}: v");
        assert_eq!(c.5, g.5, "case {case}: amaxes");
        assert_eq!(c.6, g.6, "case {case}: f32-state master");
    }
    println!(
        "PASS: cast_weight_source and bf16-gradient optimizer kernels CUDA == CPU on 64 cases"
    );
}

/// CUDA against CPU on random inputs: statistics (amax and count exact, sum of squares within 1e-6),
/// control outputs bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_control_matches_cpu() {
    let (gpu, mut s) = (cuda_device(), 0x9E37_79B9_7F4A_7C15u64);
    for case in 0..200u32 {
        let n = 1 + (case as usize % 5);
        let mut grads: Vec<Vec<f32>> = (0..n)
            .map(|i| {
                (0..(1 + (case as usize * 37 + i * 101) % 3000))
                    .map(|_| rnd(&mut s) * 10f32.powi((case % 7) as i32 - 3))
                    .collect()
            })
            .collect();
        if case % 11 == 0 {
            grads[0][0] = f32::NAN;
        }
        let p = params(
            1e-3 * (1 + case % 9) as f64,
            0.9,
            0.999,
            0.01 * (case % 3) as f64,
            case % 2 == 0,
            if case % 4 == 0 { 0.5 } else { 0.0 },
            true,
            n,
            1,
        );
        let amaxes: Vec<f32> = (0..3 * n).map(|_| rnd(&mut s).abs() * 4.0).collect();
        let scales: Vec<f32> = (0..3 * n).map(|k| 2f32.powi(k as i32 % 7 - 2)).collect();
        let mut ctl0 = vec![0f32; ctl::LEN];
        ctl0[ctl::STEP] = f32::from_bits(case * 13);
        let cpu = control_run(&Device::cpu(), &p, &grads, &amaxes, &scales, &ctl0);
        let cuda = control_run(&gpu, &p, &grads, &amaxes, &scales, &ctl0);
        assert_eq!(cpu.0[0], cuda.0[0], "case {case}: non-finite count");
        assert_eq!(cpu.0[2..], cuda.0[2..], "case {case}: amaxes");
        let (a, b) = (cpu.0[1] as f64, cuda.0[1] as f64);
        assert!(
            (a - b).abs() <= 1e-6 * a.abs().max(1e-30),
            "case {case}: sum of squares {a} vs {b}"
        );
        if a == b {
            assert_eq!(cpu.1, cuda.1, "case {case}: control");
            assert_eq!(cpu.2, cuda.2, "case {case}: coefficients");
            assert_eq!(cpu.3, cuda.3, "case {case}: write scales");
            assert_eq!(cpu.4, cuda.4, "case {case}: kernel scales");
        }
    }
    println!("PASS: Adam step control CUDA == CPU on 200 random cases");
}

// ---- cast_weight_blocks: the 128x128 block-scaled cast of a weight piece from its master ----

/// `rows * cols` master values: uniform in [-1, 1) times `2^e`, `e` in `-e_max..e_max` varying by bands
/// of 16 rows and 48 columns (so blocks get different scales); with `special`, an all-zero first block
/// (scale 1) and a NaN and an infinity further on (the infinity's block takes scale 1, the NaN is
/// ignored by the amax).
fn block_master(rows: usize, cols: usize, seed: u64, e_max: i32, special: bool) -> Vec<f32> {
    let mut s = seed | 1;
    let mut x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let band = (i / cols / 16 * 7 + i % cols / 48) as u64;
            let e = (band.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as i32 % (2 * e_max) - e_max;
            rnd(&mut s) * 2f32.powi(e)
        })
        .collect();
    if special {
        for r in 0..rows.min(128) {
            for c in 0..cols.min(128) {
                x[r * cols + c] = 0.0;
            }
        }
        let n = x.len();
        if n > 128 * cols {
            x[n - 1] = f32::NAN;
            x[n - 1 - cols / 2] = f32::INFINITY;
        }
    }
    x
}

/// What `cast_weight_blocks` reads: a flat shard of `len` F32 master values or, with `Some(scale)`, the
/// same values stored as F16 times `scale` with the scale at state slot 1.
struct BlockMaster {
    m32: Vec<f32>,
    m16: Option<(Vec<f16>, f32)>,
}

impl BlockMaster {
    fn new(m32: Vec<f32>, f16_scale: Option<f32>) -> Self {
        let m16 = f16_scale.map(|sc| (m32.iter().map(|&x| f16::from_f32(x * sc)).collect(), sc));
        BlockMaster { m32, m16 }
    }

    /// The F32 values of `range` as the cast reads them (F16: `value * (1 / scale)`, cast_weight_source's
    /// decoding).
    fn values(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        match &self.m16 {
            Some((m, sc)) => {
                let inv = 1.0 / sc;
                m[range].iter().map(|h| h.to_f32() * inv).collect()
            }
            None => self.m32[range].to_vec(),
        }
    }
}

/// Runs `cast_weight_blocks` on `dev` over `codes0` / `scale_inv0` (returned after the call).
#[allow(clippy::too_many_arguments)]
fn cast_blocks_run(
    dev: &Device,
    skip: bool,
    codes0: &[u8],
    range: std::ops::Range<usize>,
    cols: usize,
    scale_inv0: &[f32],
    scale_offset: usize,
    master: &BlockMaster,
) -> (Vec<u8>, Vec<f32>) {
    let mut coef = coef_words(2);
    coef[COEF_SKIP] = if skip { 1.0 } else { 0.0 };
    let coef = dev.upload(&coef).unwrap();
    let m32 = dev.upload(&master.m32).unwrap();
    let (m16, st) = match &master.m16 {
        Some((m, sc)) => (
            Some(dev.upload(m).unwrap()),
            dev.upload(&[0.5, 2.0, 4.0, *sc, 8.0, 16.0]).unwrap(),
        ),
        None => (None, dev.zeros::<f32>(6).unwrap()),
    };
    let source = match &m16 {
        Some(m) => MasterSource::F16 {
            master: m,
            scales: &st,
            slot: 1,
        },
        None => MasterSource::F32(&m32),
    };
    let mut q = dev.upload(codes0).unwrap();
    let mut si = dev.upload(scale_inv0).unwrap();
    cast_weight_blocks(&coef, &mut q, range, cols, &mut si, scale_offset, source).unwrap();
    (q.to_vec().unwrap(), si.to_vec().unwrap())
}

/// `block_quantize` (128x128 blocks, E4M3, power-of-two scales, the GEMM's scale order) of `x [rows,
/// cols]` on the CPU: the codes, the inverse scales (padding entries 0) and their row stride `ld`.
fn blocks_reference(x: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>, usize) {
    let dev = Device::cpu();
    let spec = BlockQuantSpec::new(BlockQuantLayout::Blocks128x128, Fp8Format::E4M3)
        .with_scale_order(ScaleOrder::Gemm);
    let layout = spec.layout.output_layout(rows, cols).unwrap();
    let strides = ScaleOrder::Gemm.strides(&layout).unwrap();
    let xb = dev.upload(x).unwrap();
    let mut q: Buffer<u8> = dev.zeros(rows * cols).unwrap();
    let mut sc: Buffer<f32> = dev.zeros(strides.len).unwrap();
    let mut si: Buffer<f32> = dev.zeros(strides.len).unwrap();
    block_quantize(&xb, [rows, cols], spec, &mut q, &mut sc, &mut si).unwrap();
    (q.to_vec().unwrap(), si.to_vec().unwrap(), strides.row)
}

/// Distinct recognizable values for scale buffers before a cast (so untouched entries show).
fn scale_sentinels(n: usize) -> Vec<f32> {
    (0..n).map(|k| -0.25 - k as f32).collect()
}

/// Column counts: multiples of 16 (128 and 256 among them) and arbitrary widths (partial last blocks).
fn block_cols() -> impl Strategy<Value = usize> {
    prop_oneof![(1usize..=24).prop_map(|k| 16 * k), 1usize..300]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// A piece cast from its master is bit for bit `block_quantize` (128x128, E4M3, GEMM order) of the
    /// decoded master values, its codes at `range` and its inverse scales from `scale_offset`; codes
    /// outside the range and scale entries outside the real blocks (padding, neighbours) are untouched.
    #[test]
    fn cast_weight_blocks_is_block_quantize_of_the_master(
        seed in any::<u64>(), rows in 1usize..400, cols in block_cols(), pre in 0usize..300,
        post in 0usize..50, scale_offset in 0usize..20, scale_post in 0usize..10,
        f16_scale in prop_oneof![
            Just(None),
            (-4i32..=4).prop_map(|e| Some(2f32.powi(e))),
            (0.3f32..5.0).prop_map(Some),
        ],
        special in any::<bool>(),
    ) {
        let n = rows * cols;
        let len = pre + n + post;
        let range = pre..pre + n;
        let e_max = if f16_scale.is_some() { 10 } else { 30 };
        let x = block_master(len, 1, seed, e_max, false);
        let mut m32 = x;
        m32[range.clone()].copy_from_slice(&block_master(rows, cols, seed ^ 1, e_max, special));
        let master = BlockMaster::new(m32, f16_scale);
        let mut s = seed | 1;
        let codes0: Vec<u8> = (0..len).map(|_| (rnd(&mut s).to_bits() >> 9) as u8).collect();
        let (want_q, want_si, ld) = blocks_reference(&master.values(range.clone()), rows, cols);
        let scale_inv0 = scale_sentinels(scale_offset + want_si.len() + scale_post);
        let (q, si) = cast_blocks_run(&Device::cpu(), false, &codes0, range.clone(), cols, &scale_inv0,
            scale_offset, &master);
        let mut expect_q = codes0.clone();
        expect_q[range].copy_from_slice(&want_q);
        prop_assert!(q == expect_q, "codes differ");
        let mut expect_si = scale_inv0.clone();
        let grid_cols = cols.div_ceil(128);
        for i in 0..rows.div_ceil(128) {
            for j in 0..grid_cols {
                expect_si[scale_offset + i * ld + j] = want_si[i * ld + j];
            }
        }
        prop_assert_eq!(ld, grid_cols.next_multiple_of(4));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&si), bits(&expect_si));
    }

    /// On a skipped step nothing is written, whatever the master holds.
    #[test]
    fn cast_weight_blocks_skipped_writes_nothing(
        seed in any::<u64>(), rows in 1usize..300, cols in block_cols(), pre in 0usize..100,
        f16m in any::<bool>(),
    ) {
        let n = rows * cols;
        let range = pre..pre + n;
        let master = BlockMaster::new(block_master(pre + n, 1, seed, 8, true), f16m.then_some(4.0));
        let mut s = seed | 1;
        let codes0: Vec<u8> = (0..pre + n).map(|_| (rnd(&mut s).to_bits() >> 9) as u8).collect();
        let scale_inv0 = scale_sentinels(3 + rows.div_ceil(128) * cols.div_ceil(128).next_multiple_of(4));
        let (q, si) = cast_blocks_run(&Device::cpu(), true, &codes0, range.clone(), cols, &scale_inv0, 3,
            &master);
        prop_assert!(q == codes0, "codes changed on a skipped step");
        prop_assert_eq!(&si, &scale_inv0);
        // The same call not skipped does write (the comparison above can fail).
        let (q, _) = cast_blocks_run(&Device::cpu(), false, &codes0, range, cols, &scale_inv0, 3, &master);
        prop_assert!(q != codes0 || n < 4);
    }

    /// A weight cut at a block-row boundary into two pieces held by two ranks (each piece at its own
    /// offsets in its rank's code and scale shards): the pieces' codes and scales, concatenated, are the
    /// whole weight's `block_quantize` output. This is what lets each rank cast its rows alone.
    #[test]
    fn cast_weight_blocks_pieces_concatenate_to_the_whole_weight(
        seed in any::<u64>(), rows in 129usize..600, cols in block_cols(), cut_blocks in 1usize..5,
        offsets in (0usize..200, 0usize..200, 0usize..9, 0usize..9), f16m in any::<bool>(),
    ) {
        let cut = 128 * cut_blocks.min((rows - 1) / 128);
        let whole = block_master(rows, cols, seed, 12, false);
        let (want_q, want_si, ld) = blocks_reference(
            &BlockMaster::new(whole.clone(), f16m.then_some(0.5)).values(0..rows * cols), rows, cols);
        let (pre_a, pre_b, soff_a, soff_b) = offsets;
        let mut s = seed | 1;
        let mut got_q = Vec::new();
        let mut got_si = vec![0.0f32; want_si.len()];
        for (piece_rows, pre, soff) in [(0..cut, pre_a, soff_a), (cut..rows, pre_b, soff_b)] {
            // This rank's flat shard: other values, then the piece, then more.
            let n = piece_rows.len() * cols;
            let mut m32: Vec<f32> = (0..pre + n + 7).map(|_| rnd(&mut s) * 1e3).collect();
            m32[pre..pre + n].copy_from_slice(&whole[piece_rows.start * cols..piece_rows.end * cols]);
            let master = BlockMaster::new(m32, f16m.then_some(0.5));
            let codes0: Vec<u8> = (0..pre + n + 7).map(|_| (rnd(&mut s).to_bits() >> 9) as u8).collect();
            let grid_rows = piece_rows.len().div_ceil(128);
            let scale_inv0 = scale_sentinels(soff + grid_rows * ld + 2);
            let (q, si) = cast_blocks_run(&Device::cpu(), false, &codes0, pre..pre + n, cols, &scale_inv0, soff,
                &master);
            got_q.extend_from_slice(&q[pre..pre + n]);
            let first_block_row = piece_rows.start / 128;
            for i in 0..grid_rows {
                for j in 0..cols.div_ceil(128) {
                    got_si[(first_block_row + i) * ld + j] = si[soff + i * ld + j];
                }
            }
        }
        prop_assert!(got_q == want_q, "codes differ from the whole weight's");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&got_si), bits(&want_si));
    }
}

/// Every argument check of `cast_weight_blocks` (the CPU path; the checks come before the device
/// dispatch, so CUDA makes the same ones).
#[test]
fn cast_weight_blocks_rejects_bad_arguments() {
    let dev = Device::cpu();
    let coef = dev.upload(&coef_words(1)).unwrap();
    let (rows, cols) = (130, 200);
    let n = rows * cols;
    let m32 = dev.upload(&vec![0.5f32; n]).unwrap();
    let mut q: Buffer<u8> = dev.zeros(n).unwrap();
    // 2 block rows, 2 block columns, rows padded to 4: the last scale written is 3 + 1 * 4 + 1.
    let need = 3 + 4 + 2;
    let mut si: Buffer<f32> = dev.zeros(need).unwrap();
    let src = MasterSource::F32(&m32);
    cast_weight_blocks(&coef, &mut q, 0..n, cols, &mut si, 3, src).unwrap();
    let mut short: Buffer<f32> = dev.zeros(need - 1).unwrap();
    let e = cast_weight_blocks(&coef, &mut q, 0..n, cols, &mut short, 3, src).unwrap_err();
    assert!(e.to_string().contains("scale"), "{e}");
    // Not whole rows, no columns, outside the codes, outside the master.
    for (range, c) in [(0..n - 1, cols), (0..n, 0), (0..n, 7)] {
        let e = cast_weight_blocks(&coef, &mut q, range, c, &mut si, 0, src).unwrap_err();
        assert!(e.to_string().contains("whole rows"), "{e}");
    }
    let mut small_q: Buffer<u8> = dev.zeros(n - cols).unwrap();
    assert!(cast_weight_blocks(&coef, &mut small_q, 0..n, cols, &mut si, 0, src).is_err());
    let short_master = dev.upload(&vec![0.5f32; n - cols]).unwrap();
    let e = cast_weight_blocks(
        &coef,
        &mut q,
        0..n,
        cols,
        &mut si,
        0,
        MasterSource::F32(&short_master),
    )
    .unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    // An F16 master whose slot has no scale.
    let m16 = dev.upload(&vec![f16::ONE; n]).unwrap();
    let st = dev.zeros::<f32>(3).unwrap();
    let f16_src = MasterSource::F16 {
        master: &m16,
        scales: &st,
        slot: 1,
    };
    assert!(cast_weight_blocks(&coef, &mut q, 0..n, cols, &mut si, 0, f16_src).is_err());
    // A short coefficient buffer.
    let short_coef = dev.zeros::<f32>(COEF_LEN - 1).unwrap();
    assert!(cast_weight_blocks(&short_coef, &mut q, 0..n, cols, &mut si, 0, src).is_err());
    // Sides beyond the kernels' 32-bit indices (an empty piece: nothing to allocate).
    let e = cast_weight_blocks(&coef, &mut q, 0..0, 1 << 31, &mut si, 0, src).unwrap_err();
    assert!(e.to_string().contains("32-bit"), "{e}");
    // An empty piece writes nothing and needs only its offset inside the scales.
    cast_weight_blocks(&coef, &mut q, 5..5, cols, &mut si, need, src).unwrap();
    assert!(cast_weight_blocks(&coef, &mut q, 5..5, cols, &mut si, need + 1, src).is_err());
}

/// CUDA against CPU for the block-scaled weight cast, bit for bit: shapes from one partial block to
/// many blocks (columns multiples of 16 and not of 128, rows not multiples of 128), F32 and F16 masters,
/// pieces at offsets inside larger shards, special values, and skipped steps.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_cast_weight_blocks_matches_cpu() {
    let gpu = common::fp8_gpu();
    let shapes = [
        (1, 16),
        (3, 100),
        (127, 144),
        (128, 128),
        (129, 1040),
        (300, 4096),
        (1000, 2064),
        (2048, 4096),
        (4100, 1536),
        (77, 14336),
    ];
    let mut s = 0x5851_F42D_4C95_7F2Du64;
    for (case, &(rows, cols)) in shapes.iter().cycle().take(3 * shapes.len()).enumerate() {
        let n = rows * cols;
        let pre = (case * 4099) % 3000;
        let len = pre + n + 17;
        let f16_scale = match case % 3 {
            0 => None,
            1 => Some(2f32.powi(case as i32 % 7 - 3)),
            _ => Some(3.0),
        };
        let e_max = if f16_scale.is_some() { 10 } else { 30 };
        let mut m32: Vec<f32> = (0..len).map(|_| rnd(&mut s)).collect();
        m32[pre..pre + n].copy_from_slice(&block_master(
            rows,
            cols,
            case as u64,
            e_max,
            case % 4 == 1,
        ));
        let master = BlockMaster::new(m32, f16_scale);
        let codes0: Vec<u8> = (0..len)
            .map(|_| (rnd(&mut s).to_bits() >> 9) as u8)
            .collect();
        let soff = case % 11;
        let scale_inv0 =
            scale_sentinels(soff + rows.div_ceil(128) * cols.div_ceil(128).next_multiple_of(4) + 3);
        let skip = case % 10 == 9;
        let run = |d: &Device| {
            cast_blocks_run(
                d,
                skip,
                &codes0,
                pre..pre + n,
                cols,
                &scale_inv0,
                soff,
                &master,
            )
        };
        let (cpu, cuda) = (run(&Device::cpu()), run(&gpu));
        if let Some(d) = common::first_difference("codes", &cpu.0, &cuda.0) {
            panic!("case {case} ({rows} x {cols}, f16 {f16_scale:?}, skip {skip}): {d}");
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if let Some(d) = common::first_difference("scale_inv", &bits(&cpu.1), &bits(&cuda.1)) {
            panic!("case {case} ({rows} x {cols}, f16 {f16_scale:?}, skip {skip}): {d}");
        }
    }
    println!(
        "PASS: cast_weight_blocks CUDA == CPU on {} cases",
        3 * shapes.len()
    );
}
