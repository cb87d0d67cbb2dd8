//! Fused Adam/AdamW property tests on the CPU: F32 states against a scalar f64 reference over many
//! steps (both decay modes, maximize, gradient factor, bf16 gradients, sub-ranges), and the low-precision
//! states against their definition (decode * scale_inv, update, encode(x * scale)) and against the F32
//! optimizer's trajectory.

use fp8_core::Fp8Format;
use fp8_kernels::adam::{
    adam_element, adam_step_f32, adam_step_low_precision, f16_saturating, lp_slot, AmaxSlots,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{AdamConfig, Buffer, Device, LowPrecisionAdamState, WeightDecay};
use half::{bf16, f16};
use proptest::prelude::*;

/// PyTorch's Adam/AdamW for one element in f64.
#[allow(clippy::too_many_arguments)]
fn reference_step(
    cfg: &AdamConfig,
    step: u64,
    grad_scale: f64,
    g: f64,
    w: &mut f64,
    m: &mut f64,
    v: &mut f64,
) {
    let mut g = g * grad_scale;
    if cfg.maximize {
        g = -g;
    }
    if cfg.decay_mode == WeightDecay::L2 {
        g += cfg.weight_decay * *w;
    } else {
        *w *= 1.0 - cfg.lr * cfg.weight_decay;
    }
    *m = cfg.beta1 * *m + (1.0 - cfg.beta1) * g;
    *v = cfg.beta2 * *v + (1.0 - cfg.beta2) * g * g;
    let bc1 = 1.0 - cfg.beta1.powi(step as i32);
    let bc2 = 1.0 - cfg.beta2.powi(step as i32);
    let denom = v.sqrt() / bc2.sqrt() + cfg.eps;
    *w -= cfg.lr / bc1 * *m / denom;
}

fn splitmix(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| rng.uniform_f32() * scale).collect()
}

prop_compose! {
    fn config()(lr in 1e-4f64..1e-1, beta1 in 0.0f64..0.99, beta2 in 0.9f64..0.9999, eps in 1e-8f64..1e-3,
                wd in prop_oneof![Just(0.0f64), 0.0f64..0.2], l2 in any::<bool>(), maximize in any::<bool>())
                -> AdamConfig {
        AdamConfig { lr, beta1, beta2, eps, weight_decay: wd,
                     decay_mode: if l2 { WeightDecay::L2 } else { WeightDecay::Decoupled }, maximize }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// 30 steps of F32 Adam/AdamW on a sub-range agree with the f64 reference to f32 rounding, the
    /// elements outside the range are untouched, and the amax slot is max |new master|.
    #[test]
    fn f32_adam_tracks_f64_reference(cfg in config(), n in 1usize..300, start in 0usize..20,
                                     grad_scale in 0.1f32..2.0, bf16_grad in any::<bool>(), seed in any::<u64>()) {
        let dev = Device::cpu();
        let total = start + n + 3;
        let w0 = splitmix(seed, total, 1.0);
        let mut master = dev.upload(&w0).unwrap();
        let mut m = dev.zeros::<f32>(total).unwrap();
        let mut v = dev.zeros::<f32>(total).unwrap();
        let mut rw: Vec<f64> = w0.iter().map(|&x| x as f64).collect();
        let mut rm = vec![0.0f64; total];
        let mut rv = vec![0.0f64; total];
        let mut amax = dev.zeros::<f32>(2).unwrap();
        for step in 1..=30u64 {
            let g32 = splitmix(seed ^ step, total, 0.5);
            let g: Vec<f64> = if bf16_grad {
                g32.iter().map(|&x| bf16::from_f32(x).to_f64()).collect()
            } else {
                g32.iter().map(|&x| x as f64).collect()
            };
            let coef = cfg.coefficients(step, grad_scale).unwrap();
            amax.fill_zero().unwrap();
            let slots = Some(AmaxSlots { buffer: &mut amax, base: 1 });
            if bf16_grad {
                let gb = dev.upload(&g32.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
                adam_step_f32(&coef, start..start + n, &mut master, &mut m, &mut v, &gb, slots).unwrap();
            } else {
                let gb = dev.upload(&g32).unwrap();
                adam_step_f32(&coef, start..start + n, &mut master, &mut m, &mut v, &gb, slots).unwrap();
            }
            for i in start..start + n {
                reference_step(&cfg, step, grad_scale as f64, g[i], &mut rw[i], &mut rm[i], &mut rv[i]);
            }
            let got = master.to_vec().unwrap();
            let want_amax = got[start..start + n].iter().fold(0.0f32, |a, x| a.max(x.abs()));
            prop_assert_eq!(amax.to_vec().unwrap(), vec![0.0, want_amax]);
        }
        let got = master.to_vec().unwrap();
        for i in 0..total {
            if (start..start + n).contains(&i) {
                // f32 rounding accumulates over 30 steps; the update itself is <= lr per step.
                let tol = 1e-5 * rw[i].abs().max(1.0) + 30.0 * 1e-5 * cfg.lr;
                prop_assert!((got[i] as f64 - rw[i]).abs() <= tol, "elem {}: {} vs {}", i, got[i], rw[i]);
            } else {
                prop_assert_eq!(got[i], w0[i]);
            }
        }
    }

    /// One low-precision step equals its definition element by element (bit for bit), and the amaxes
    /// are those of the new f32 values.
    #[test]
    fn low_precision_step_matches_definition(cfg in config(), n in 1usize..200, seed in any::<u64>(),
                                              ew in -2i32..6, em in 0i32..8, ev in 0i32..16, step in 1u64..50) {
        let dev = Device::cpu();
        let w0: Vec<f16> = splitmix(seed, n, 1.0).iter().map(|&x| f16::from_f32(x * 2f32.powi(ew))).collect();
        let m0: Vec<u8> = splitmix(seed ^ 7, n, 100.0).iter().map(|&x| Fp8Format::E4M3.encode(x)).collect();
        let v0: Vec<f16> = splitmix(seed ^ 9, n, 1000.0).iter().map(|&x| f16::from_f32(x.abs())).collect();
        let g = splitmix(seed ^ 11, n, 0.3);
        // read scales (inverse) and write scales, deliberately different
        let sc = [2f32.powi(-ew), 2f32.powi(ew - 1), 2f32.powi(-em), 2f32.powi(em + 1), 2f32.powi(-ev), 2f32.powi(ev)];
        let mut scales = vec![9.0f32; 2];
        scales.extend_from_slice(&sc);
        let scales = dev.upload(&scales).unwrap();
        let coef = cfg.coefficients(step, 1.0).unwrap();
        let (mut wb, mut mb, mut vb) = (dev.upload(&w0).unwrap(), dev.upload(&m0).unwrap(), dev.upload(&v0).unwrap());
        let mut amax = dev.upload(&[0.0f32, 0.0, 0.0, 0.5]).unwrap();
        adam_step_low_precision(
            &coef, 0..n,
            LowPrecisionAdamState { master: &mut wb, m: &mut mb, v: &mut vb },
            &dev.upload(&g).unwrap(), &scales, 2,
            AmaxSlots { buffer: &mut amax, base: 1 },
        ).unwrap();
        let (gw, gm, gv) = (wb.to_vec().unwrap(), mb.to_vec().unwrap(), vb.to_vec().unwrap());
        let mut want_amax = [0.0f32; 3];
        for i in 0..n {
            let w = w0[i].to_f32() * sc[lp_slot::MASTER_SCALE_INV];
            let m = Fp8Format::E4M3.decode(m0[i]) * sc[lp_slot::M_SCALE_INV];
            let v = v0[i].to_f32() * sc[lp_slot::V_SCALE_INV];
            let (nw, nm, nv) = adam_element(&coef, g[i], w, m, v);
            want_amax = [want_amax[0].max(nw.abs()), want_amax[1].max(nm.abs()), want_amax[2].max(nv.abs())];
            prop_assert_eq!(gw[i].to_bits(), f16_saturating(nw * sc[lp_slot::MASTER_SCALE]).to_bits());
            prop_assert_eq!(gm[i], Fp8Format::E4M3.encode(nm * sc[lp_slot::M_SCALE]));
            prop_assert_eq!(gv[i].to_bits(), f16_saturating(nv * sc[lp_slot::V_SCALE]).to_bits());
        }
        let a = amax.to_vec().unwrap();
        prop_assert_eq!(a[0], 0.0);
        prop_assert_eq!(&a[1..3], &want_amax[..2]);
        // slots are folded by max: the preset 0.5 stays if the new v amax is smaller
        prop_assert_eq!(a[3], want_amax[2].max(0.5));
    }
}

/// Low-precision AdamW with per-step current scaling of every state follows the F32 optimizer: after
/// 50 steps the weights differ by a small fraction of how far they moved.
#[test]
fn low_precision_adamw_follows_f32_adamw() {
    let dev = Device::cpu();
    let n = 4096;
    let cfg = AdamConfig {
        lr: 1e-2,
        ..AdamConfig::default()
    };
    let w0 = splitmix(1, n, 1.0);
    let mut w32 = dev.upload(&w0).unwrap();
    let (mut m32, mut v32) = (dev.zeros::<f32>(n).unwrap(), dev.zeros::<f32>(n).unwrap());
    let pow2_scale = |amax: f32, fmax: f32| -> f32 {
        fp8_core::compute_scale(amax, fmax, 1, fp8_core::ScaleRounding::PowerOfTwo, 1.0)
    };
    let ws = pow2_scale(1.0, 65504.0);
    let mut wl = dev
        .upload(
            &w0.iter()
                .map(|&x| f16::from_f32(x * ws))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let mut ml = dev.zeros::<u8>(n).unwrap();
    let mut vl = dev.zeros::<f16>(n).unwrap();
    let mut sc = [1.0 / ws, ws, 1.0, 1.0, 1.0, 1.0];
    for step in 1..=50u64 {
        // a noisy gradient pulling towards a target
        let noise = splitmix(100 + step, n, 0.05);
        let cur = w32.to_vec().unwrap();
        let g: Vec<f32> = cur.iter().zip(&noise).map(|(w, z)| (w - 0.3) + z).collect();
        let coef = cfg.coefficients(step, 1.0).unwrap();
        let gb = dev.upload(&g).unwrap();
        adam_step_f32(&coef, 0..n, &mut w32, &mut m32, &mut v32, &gb, None).unwrap();
        // the low-precision run sees the gradient at its own weights
        let wl_now: Vec<f32> = scaled_values(&wl, sc[0]);
        let gl: Vec<f32> = wl_now
            .iter()
            .zip(&noise)
            .map(|(w, z)| (w - 0.3) + z)
            .collect();
        let scales = dev.upload(&sc).unwrap();
        let mut amax = dev.zeros::<f32>(3).unwrap();
        adam_step_low_precision(
            &coef,
            0..n,
            LowPrecisionAdamState {
                master: &mut wl,
                m: &mut ml,
                v: &mut vl,
            },
            &dev.upload(&gl).unwrap(),
            &scales,
            0,
            AmaxSlots {
                buffer: &mut amax,
                base: 0,
            },
        )
        .unwrap();
        // Re-scale every state to its new amax (what the optimizer crate does between steps).
        let a = amax.to_vec().unwrap();
        let (nw, nm, nv) = (
            pow2_scale(a[0], 65504.0),
            pow2_scale(a[1], 448.0),
            pow2_scale(a[2], 65504.0),
        );
        let rescale16 = |b: &mut fp8_kernels::Buffer<f16>, old_inv: f32, new: f32| {
            let v: Vec<f16> = b
                .to_vec()
                .unwrap()
                .iter()
                .map(|h| f16_saturating(h.to_f32() * old_inv * new))
                .collect();
            b.copy_from_host(&v).unwrap();
        };
        rescale16(&mut wl, sc[1].recip(), nw);
        rescale16(&mut vl, sc[5].recip(), nv);
        let mv: Vec<u8> = ml
            .to_vec()
            .unwrap()
            .iter()
            .map(|&c| Fp8Format::E4M3.encode(Fp8Format::E4M3.decode(c) / sc[3] * nm))
            .collect();
        ml.copy_from_host(&mv).unwrap();
        sc = [1.0 / nw, nw, 1.0 / nm, nm, 1.0 / nv, nv];
    }
    let a = w32.to_vec().unwrap();
    let b: Vec<f32> = scaled_values(&wl, sc[0]);
    let moved = l2_distance(&a, &w0);
    let diff = l2_distance(&a, &b);
    assert!(moved > 1.0, "the weights should move ({moved})");
    assert!(
        diff < 0.05 * moved,
        "low precision drifted: {diff} vs movement {moved}"
    );
}

#[test]
fn range_and_slot_errors() {
    let dev = Device::cpu();
    let coef = AdamConfig::default().coefficients(1, 1.0).unwrap();
    let mut w = dev.zeros::<f32>(8).unwrap();
    let mut m = dev.zeros::<f32>(8).unwrap();
    let mut v = dev.zeros::<f32>(8).unwrap();
    let g = dev.zeros::<f32>(7).unwrap();
    assert!(adam_step_f32(&coef, 0..8, &mut w, &mut m, &mut v, &g, None).is_err());
    assert!(adam_step_f32(&coef, 0..7, &mut w, &mut m, &mut v, &g, None).is_ok());
    let mut amax = dev.zeros::<f32>(1).unwrap();
    let slots = Some(AmaxSlots {
        buffer: &mut amax,
        base: 1,
    });
    assert!(adam_step_f32(&coef, 0..7, &mut w, &mut m, &mut v, &g, slots).is_err());
    let (mut wl, mut ml, mut vl) = (
        dev.zeros::<f16>(8).unwrap(),
        dev.zeros::<u8>(8).unwrap(),
        dev.zeros::<f16>(8).unwrap(),
    );
    let scales = dev.upload(&[1.0f32; 5]).unwrap(); // one short
    let mut amax = dev.zeros::<f32>(3).unwrap();
    let r = adam_step_low_precision(
        &coef,
        0..7,
        LowPrecisionAdamState {
            master: &mut wl,
            m: &mut ml,
            v: &mut vl,
        },
        &g,
        &scales,
        0,
        AmaxSlots {
            buffer: &mut amax,
            base: 0,
        },
    );
    assert!(r.is_err());
}

/// The Euclidean distance of two vectors, in f64.
fn l2_distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// The values of an f16 buffer times `scale_inv`, in f32.
fn scaled_values(b: &Buffer<f16>, scale_inv: f32) -> Vec<f32> {
    b.to_vec()
        .unwrap()
        .iter()
        .map(|h| h.to_f32() * scale_inv)
        .collect()
}
