//! The FP8 and float linear operations on the CPU against dequantize-then-f64-matmul references built
//! from the exact quantized inputs (fp8-core's encode with the metas' scales), including the meta
//! updates (delayed scaling) over several steps.

use fp8_core::{Fp8Format, ScalingRecipe};
use fp8_kernels::linear::LinearElement;
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{CpuParallelism, Device, FloatLinear, Fp8Linear, Fp8LinearConfig};
use half::bf16;
use proptest::prelude::*;

fn splitmix(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| rng.uniform_f32() * scale).collect()
}

/// Quantize-dequantize with fp8-core: the values the FP8 GEMMs see.
fn qdq(x: &[f32], f: Fp8Format, scale: f32) -> Vec<f64> {
    x.iter()
        .map(|&v| f.decode(f.encode(v * scale)) as f64 / scale as f64)
        .collect()
}

/// `C[m, n] = A[m, k] * B[n, k]^T` in f64, with `sum |a b|` for the tolerance.
fn matmul_nt(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                c[i * n + j] += a[i * k + p] * b[j * k + p];
                mag[i * n + j] += (a[i * k + p] * b[j * k + p]).abs();
            }
        }
    }
    (c, mag)
}

fn transpose(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = rel * s + 1e-6 * w.abs() + 1e-30;
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol})"
        );
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// Runs `steps` forward/backward steps of an FP8 linear op and checks every output against the
/// reference built from the scales the metas held at that step.
fn run_fp8_linear<T: LinearElement>(
    tokens: usize,
    inf: usize,
    outf: usize,
    steps: u64,
    seed: u64,
    to_t: fn(f32) -> T,
) {
    let dev = Device::cpu();
    let cfg = Fp8LinearConfig {
        parallelism: CpuParallelism::Single,
        input_recipe: ScalingRecipe::delayed_default(),
        ..Fp8LinearConfig::default()
    };
    let mut op = Fp8Linear::new(&dev, inf, outf, cfg).unwrap();
    let w_master = splitmix(seed, outf * inf, 0.5);
    let mut w_q = dev.zeros::<u8>(outf * inf).unwrap();
    op.cast_weight(&dev.upload(&w_master).unwrap(), &mut w_q)
        .unwrap();
    let w_scale = op.weight_meta().scale().to_vec().unwrap()[0];
    // current scaling: the weight scale comes from its own amax
    assert_eq!(
        w_scale,
        fp8_core::compute_scale(
            amax(&w_master),
            448.0,
            0,
            fp8_core::ScaleRounding::PowerOfTwo,
            1.0
        )
    );
    let wd = qdq(&w_master, Fp8Format::E4M3, w_scale);
    let bias = splitmix(seed ^ 5, outf, 1.0);
    let mut dw = dev.zeros::<f32>(outf * inf).unwrap();
    let mut db = dev.zeros::<f32>(outf).unwrap();
    let mut dw_want = vec![0.0f64; outf * inf];
    let mut dw_mag = vec![0.0f64; outf * inf];
    let mut db_want = vec![0.0f64; outf];
    let mut db_mag = vec![0.0f64; outf];
    for step in 0..steps {
        // activations and gradients whose size changes from step to step
        let xs = 2f32.powi(step as i32 % 5 - 2);
        let x32: Vec<f32> = splitmix(seed ^ (step + 10), tokens * inf, xs)
            .into_iter()
            .map(|v| to_t(v).to_f32())
            .collect();
        let dy32: Vec<f32> = splitmix(seed ^ (step + 100), tokens * outf, 1e-3 * xs)
            .into_iter()
            .map(|v| to_t(v).to_f32())
            .collect();
        let x = dev
            .upload(&x32.iter().map(|&v| to_t(v)).collect::<Vec<T>>())
            .unwrap();
        let dy = dev
            .upload(&dy32.iter().map(|&v| to_t(v)).collect::<Vec<T>>())
            .unwrap();
        let s_in = op.input_meta().scale().to_vec().unwrap()[0];
        let s_g = op.grad_output_meta().scale().to_vec().unwrap()[0];

        let mut y = dev.zeros::<f32>(tokens * outf).unwrap();
        let saved = op
            .forward(&x, &w_q, None, Some(&dev.upload(&bias).unwrap()), &mut y)
            .unwrap();
        let xd = qdq(&x32, Fp8Format::E4M3, s_in);
        let (mut y_want, y_mag) = matmul_nt(&xd, &wd, tokens, outf, inf);
        for t in 0..tokens {
            for o in 0..outf {
                y_want[t * outf + o] += bias[o] as f64;
            }
        }
        assert_close("y", &y.to_vec().unwrap(), &y_want, &y_mag, 1e-5);
        assert_eq!(saved.x_t().len(), tokens * inf);

        let mut dx = dev.zeros::<f32>(tokens * inf).unwrap();
        op.backward(
            &saved,
            &dy,
            &w_q,
            None,
            None,
            Some(&mut dx),
            &mut dw,
            step > 0,
            Some(&mut db),
        )
        .unwrap();
        let dyd = qdq(&dy32, Fp8Format::E5M2, s_g);
        // dx = dy W: (dy [t, out]) * (W^T [in, out])^T
        let (dx_want, dx_mag) = matmul_nt(&dyd, &transpose(&wd, outf, inf), tokens, inf, outf);
        assert_close("dx", &dx.to_vec().unwrap(), &dx_want, &dx_mag, 1e-5);
        let (dws, dwm) = matmul_nt(
            &transpose(&dyd, tokens, outf),
            &transpose(&xd, tokens, inf),
            outf,
            inf,
            tokens,
        );
        for i in 0..outf * inf {
            dw_want[i] += dws[i];
            dw_mag[i] += dwm[i];
        }
        assert_close("dW", &dw.to_vec().unwrap(), &dw_want, &dw_mag, 1e-5);
        for o in 0..outf {
            db_want[o] += (0..tokens).map(|t| dy32[t * outf + o] as f64).sum::<f64>();
            db_mag[o] += (0..tokens)
                .map(|t| (dy32[t * outf + o] as f64).abs())
                .sum::<f64>();
        }
        assert_close("db", &db.to_vec().unwrap(), &db_want, &db_mag, 1e-5);

        // the casts recorded this step's amaxes; the update moves them into the scales
        assert_eq!(
            op.input_meta().pending_amax().to_vec().unwrap()[0],
            amax(&x32)
        );
        assert_eq!(
            op.grad_output_meta().pending_amax().to_vec().unwrap()[0],
            amax(&dy32)
        );
        let mut want_in = op.input_meta().to_meta().unwrap();
        want_in.update_from_amax(amax(&x32));
        let mut want_g = op.grad_output_meta().to_meta().unwrap();
        want_g.update_from_amax(amax(&dy32));
        op.update_scales().unwrap();
        for (got, want) in [
            (op.input_meta().to_meta().unwrap(), want_in),
            (op.grad_output_meta().to_meta().unwrap(), want_g),
        ] {
            assert_eq!(got.history(), want.history());
            assert_eq!(got.scale(), want.scale());
            assert_eq!(got.recorded(), want.recorded());
        }
        assert_eq!(op.input_meta().pending_amax().to_vec().unwrap()[0], 0.0);
    }
}

#[test]
fn fp8_linear_f32_input_several_steps() {
    run_fp8_linear::<f32>(24, 40, 16, 5, 3, |v| v);
}

#[test]
fn fp8_linear_bf16_input_odd_shapes() {
    run_fp8_linear::<bf16>(7, 13, 5, 4, 4, bf16::from_f32);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn fp8_linear_random_shapes(tokens in 1usize..20, inf in 1usize..24, outf in 1usize..20, seed in any::<u64>()) {
        run_fp8_linear::<f32>(tokens, inf, outf, 3, seed, |v| v);
    }

    #[test]
    fn float_linear_matches_f64(tokens in 1usize..20, inf in 1usize..24, outf in 1usize..20, seed in any::<u64>(),
                                accumulate in any::<bool>()) {
        let dev = Device::cpu();
        let op = FloatLinear::new(inf, outf, CpuParallelism::Single).unwrap();
        let x = splitmix(seed, tokens * inf, 1.0);
        let w = splitmix(seed ^ 1, outf * inf, 1.0);
        let b = splitmix(seed ^ 2, outf, 1.0);
        let dy = splitmix(seed ^ 3, tokens * outf, 1.0);
        let dw0 = splitmix(seed ^ 4, outf * inf, 1.0);
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (xb, wb) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut y = dev.zeros::<f32>(tokens * outf).unwrap();
        op.forward(&xb, &wb, Some(&dev.upload(&b).unwrap()), &mut y).unwrap();
        let (mut yw, ym) = matmul_nt(&f(&x), &f(&w), tokens, outf, inf);
        for t in 0..tokens { for o in 0..outf { yw[t * outf + o] += b[o] as f64; } }
        assert_close("y", &y.to_vec().unwrap(), &yw, &ym, 1e-5);
        let mut dx = dev.zeros::<f32>(tokens * inf).unwrap();
        let mut dw = dev.upload(&dw0).unwrap();
        let mut db = dev.zeros::<f32>(outf).unwrap();
        op.backward(&xb, &dev.upload(&dy).unwrap(), &wb, Some(&mut dx), &mut dw, accumulate, Some(&mut db)).unwrap();
        let (dxw, dxm) = matmul_nt(&f(&dy), &transpose(&f(&w), outf, inf), tokens, inf, outf);
        assert_close("dx", &dx.to_vec().unwrap(), &dxw, &dxm, 1e-5);
        let (mut dww, mut dwm) = matmul_nt(&transpose(&f(&dy), tokens, outf), &transpose(&f(&x), tokens, inf), outf, inf, tokens);
        if accumulate {
            for i in 0..dww.len() { dww[i] += dw0[i] as f64; dwm[i] += (dw0[i] as f64).abs(); }
        }
        assert_close("dW", &dw.to_vec().unwrap(), &dww, &dwm, 1e-5);
        let dbw: Vec<f64> = (0..outf).map(|o| (0..tokens).map(|t| dy[t * outf + o] as f64).sum()).collect();
        let dbm: Vec<f64> = (0..outf).map(|o| (0..tokens).map(|t| (dy[t * outf + o] as f64).abs()).sum()).collect();
        assert_close("db", &db.to_vec().unwrap(), &dbw, &dbm, 1e-5);
    }
}

#[test]
fn linear_shape_errors() {
    let dev = Device::cpu();
    assert!(Fp8Linear::new(&dev, 0, 4, Fp8LinearConfig::default()).is_err());
    let mut op = Fp8Linear::new(&dev, 4, 3, Fp8LinearConfig::default()).unwrap();
    let w = dev.zeros::<u8>(12).unwrap();
    let x = dev.zeros::<f32>(10).unwrap(); // not a multiple of 4
    let mut y = dev.zeros::<f32>(6).unwrap();
    assert!(op.forward::<f32, f32>(&x, &w, None, None, &mut y).is_err());
    let x = dev.zeros::<f32>(8).unwrap();
    let w_bad = dev.zeros::<u8>(11).unwrap();
    assert!(op
        .forward::<f32, f32>(&x, &w_bad, None, None, &mut y)
        .is_err());
    let mut y_bad = dev.zeros::<f32>(5).unwrap();
    assert!(op
        .forward::<f32, f32>(&x, &w, None, None, &mut y_bad)
        .is_err());
    let saved = op.forward::<f32, f32>(&x, &w, None, None, &mut y).unwrap();
    let dy = dev.zeros::<f32>(5).unwrap();
    let mut dw = dev.zeros::<f32>(12).unwrap();
    assert!(op
        .backward::<f32, f32, f32>(&saved, &dy, &w, None, None, None, &mut dw, false, None)
        .is_err());
}
