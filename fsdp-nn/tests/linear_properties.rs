//! `fsdp_nn::Linear` on the CPU inside a wrapped model (`FsdpModel`, thread ranks) against
//! dequantize-then-f64-matmul references built from the exact quantized operands (fp8-core's encode with
//! the scales the metas held at that step): FP8 forward, backward and saved `x^T` over several steps with
//! delayed-scaling meta updates (local on one rank, agreed by an optimizer step on two), the weight's
//! current scaling, the F32 layer with gradient accumulation, random shapes, and shape errors.
//! (Moved from fp8-kernels' `linear_properties`, where the layer state used to live.)

mod common;

use common::{full_grad, grad_shards, on_ranks, values, TestResult};
use fp8_core::{Fp8Format, QType, ScaleRounding, ScalingMeta};
use fp8_kernels::{CpuParallelism, Device};
use fsdp_nn::init::kaiming_uniform;
use fsdp_nn::{Activation, Layer, Linear, LinearPrecision, NnError, Shape, Tensor};
use fsdp_optim::{step_model, AdamOptions, FsdpAdam, StatePrecision};
use fsdp_shard::{FsdpConfig, FsdpModel, Mode, WrapPolicy};
use half::bf16;
use proptest::prelude::*;

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

/// `|got - want| <= rel * mag + out_rel * |want|` element-wise: `rel` for the f32 accumulation (relative
/// to the sum of |terms|), `out_rel` for the rounding of the output to its type.
fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64, out_rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = rel * s + out_rel * w.abs() + 1e-30;
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol})"
        );
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// Relative rounding of an output stored in `T` (half an ulp: 2^-8 for bf16's 8 significant bits).
fn out_rel<T: Activation>() -> f64 {
    if T::DTYPE == fp8_kernels::DType::BF16 {
        2f64.powi(-8)
    } else {
        1e-6
    }
}

fn to_t<T: Activation>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn from_t<T: Activation>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// What one rank saw in one FP8 step.
struct Fp8Step {
    /// The input and output gradient as the layer got them (rounded to `T`).
    x: Vec<f32>,
    dy: Vec<f32>,
    /// The metas (input, output gradient) before the forward and after the step's update.
    before: [ScalingMeta; 2],
    after: [ScalingMeta; 2],
    y: Vec<f32>,
    dx: Vec<f32>,
    /// The saved `x^T` codes and inverse scale.
    x_t: Vec<u8>,
    x_scale_inv: f32,
    /// This rank's pending amaxes (input, output gradient) after the backward, and after the update.
    pending: [f32; 2],
    pending_after: [f32; 2],
    /// Reduced gradient shards after the backward.
    grads: Vec<[Vec<f32>; 2]>,
}

/// What one rank returns: the weight (decoded), its scale, bias, the steps, the weight at the end.
struct Fp8Run {
    weight: Vec<f32>,
    weight_scale: f32,
    bias: Vec<f32>,
    steps: Vec<Fp8Step>,
    weight_end: Vec<f32>,
    layout: std::sync::Arc<fsdp_shard::ModelLayout>,
}

fn metas<T: Activation>(model: &FsdpModel<Linear<T>>) -> TestResult<[ScalingMeta; 2]> {
    let lin = model.module();
    let reg = model.scaling();
    Ok([
        reg.get(lin.input_meta())?.to_meta()?,
        reg.get(lin.grad_meta())?.to_meta()?,
    ])
}

fn pending<T: Activation>(model: &FsdpModel<Linear<T>>) -> TestResult<[f32; 2]> {
    let p = model.scaling().pending().to_vec()?;
    let slot = |id: fsdp_shard::ScalingId| id.index().map(|i| p[i]).unwrap_or(f32::NAN);
    let lin = model.module();
    Ok([slot(lin.input_meta()), slot(lin.grad_meta())])
}

/// `steps` training steps of an FP8 `Linear<T>` (with bias) on `ranks` thread ranks, each rank with its
/// own data. One rank: the metas are updated from the local amaxes (`update_local`) and the gradient
/// shards accumulate over the steps. Two ranks: an Adam step with lr 0 agrees the metas (and zeroes the
/// gradients) after each step.
fn fp8_run<T: Activation>(
    ranks: usize,
    tokens: usize,
    inf: usize,
    outf: usize,
    steps: u64,
    seed: u64,
) -> Vec<Fp8Run> {
    on_ranks(ranks, |comm| {
        let rank = comm.rank() as u64;
        let lin = Linear::<T>::new(inf, outf)?
            .with_precision(LinearPrecision::Fp8)?
            .with_seed(seed);
        let mut model = FsdpModel::new(lin, comm, WrapPolicy::Single, FsdpConfig::default())?;
        model.set_cpu_parallelism(CpuParallelism::Single);
        let dev = model.device().clone();
        let mut opt = if ranks > 1 {
            let o = AdamOptions {
                lr: 0.0,
                state_precision: StatePrecision::F32,
                ..AdamOptions::adam()
            };
            Some(FsdpAdam::for_model(&mut model, o)?)
        } else {
            None
        };
        let params = model.gathered_params()?;
        let weight = params[0].1.clone();
        let bias = params[1].1.clone();
        let weight_scale = model.sharded().weight_scales()?[0].1;
        let mut records = Vec::new();
        for step in 0..steps {
            // Activations and gradients whose size changes from step to step (and from rank to rank).
            let xs = 2f32.powi(step as i32 % 5 - 2 + rank as i32);
            let data_seed = seed ^ (rank << 40);
            let x = from_t(&to_t::<T>(&values(
                data_seed ^ (step + 10),
                tokens * inf,
                xs,
            )));
            let dy = from_t(&to_t::<T>(&values(
                data_seed ^ (step + 100),
                tokens * outf,
                1e-3 * xs,
            )));
            let before = metas(&model)?;
            let xt = Tensor::new(dev.upload(&to_t::<T>(&x))?, Shape::matrix(tokens, inf)?)?;
            let y = model.forward(Mode::Train, |lin, ctx| lin.forward(ctx, xt))?;
            // The saved E4M3 x^T (a fused producer's buffers are the saved ones).
            let saved = model.module_mut().fp8_input(&dev, tokens)?;
            let (x_t, x_scale_inv) = (saved.x_t.to_vec()?, saved.x_scale_inv.to_vec()?[0]);
            let dyt = Tensor::new(dev.upload(&to_t::<T>(&dy))?, Shape::matrix(tokens, outf)?)?;
            let dx = model
                .backward(|lin, ctx| lin.backward_step(ctx, dyt, true))?
                .ok_or("no dx")?;
            let pend = pending(&model)?;
            let grads = grad_shards(model.sharded())?;
            match &mut opt {
                Some(o) => {
                    step_model(o, &mut model)?;
                }
                None => model.parts_mut().1.update_local()?,
            }
            records.push(Fp8Step {
                x,
                dy,
                before,
                after: metas(&model)?,
                y: from_t(&y.data().to_vec()?),
                dx: from_t(&dx.data().to_vec()?),
                x_t,
                x_scale_inv,
                pending: pend,
                pending_after: pending(&model)?,
                grads,
            });
        }
        let weight_end = model.gathered_params()?[0].1.clone();
        Ok(Fp8Run {
            weight,
            weight_scale,
            bias,
            steps: records,
            weight_end,
            layout: model.layout().clone(),
        })
    })
}

/// Checks every output of [`fp8_run`] against the references built from the scales the metas held.
fn check_fp8_linear<T: Activation>(
    ranks: usize,
    tokens: usize,
    inf: usize,
    outf: usize,
    steps: u64,
    seed: u64,
) {
    let runs = fp8_run::<T>(ranks, tokens, inf, outf, steps, seed);
    // The weight: the layer's initial values cast with current scaling (the scale of their own amax).
    let master = kaiming_uniform(outf * inf, inf, 5f64.sqrt(), seed);
    let w_scale = fp8_core::compute_scale(
        amax(&master),
        Fp8Format::E4M3.max(),
        0,
        ScaleRounding::PowerOfTwo,
        1.0,
    );
    let wd = qdq(&master, Fp8Format::E4M3, w_scale);
    let orel = out_rel::<T>();
    let layout = runs[0].layout.clone();
    let mut dw_want = vec![0.0f64; outf * inf];
    let mut dw_mag = vec![0.0f64; outf * inf];
    let mut db_want = vec![0.0f64; outf];
    let mut db_mag = vec![0.0f64; outf];
    for run in &runs {
        assert_eq!(run.weight_scale, w_scale, "weight scale");
        let got: Vec<f64> = run.weight.iter().map(|&v| v as f64).collect();
        assert_eq!(got, wd, "weight codes: the master cast with its scale");
        assert_eq!(run.weight_end, run.weight, "lr-0 steps keep the weight");
        assert_eq!(run.bias, runs[0].bias);
    }
    for step in 0..steps as usize {
        if ranks > 1 {
            // Each step's gradients are reduced over the ranks, then consumed by the step.
            dw_want.iter_mut().for_each(|v| *v = 0.0);
            dw_mag.iter_mut().for_each(|v| *v = 0.0);
            db_want.iter_mut().for_each(|v| *v = 0.0);
            db_mag.iter_mut().for_each(|v| *v = 0.0);
        }
        let mut global = [0f32; 2];
        for (r, run) in runs.iter().enumerate() {
            let s = &run.steps[step];
            let what = |w: &str| format!("{w}, rank {r}, step {step}");
            let (s_in, s_g) = (s.before[0].scale(), s.before[1].scale());
            // Every rank used the same scales.
            assert_eq!(s_in, runs[0].steps[step].before[0].scale());
            assert_eq!(s_g, runs[0].steps[step].before[1].scale());
            // Forward.
            let xd = qdq(&s.x, Fp8Format::E4M3, s_in);
            let bias: Vec<f64> = from_t(&to_t::<T>(&run.bias))
                .iter()
                .map(|&b| b as f64)
                .collect();
            let (mut y_want, mut y_mag) = matmul_nt(&xd, &wd, tokens, outf, inf);
            for t in 0..tokens {
                for o in 0..outf {
                    y_want[t * outf + o] += bias[o];
                    y_mag[t * outf + o] += bias[o].abs();
                }
            }
            assert_close(&what("y"), &s.y, &y_want, &y_mag, 1e-5, orel);
            // The saved x^T: the E4M3 codes of x with the input scale, transposed, and its inverse
            // scale.
            assert_eq!(s.x_t.len(), tokens * inf);
            for t in 0..tokens {
                for i in 0..inf {
                    let want = Fp8Format::E4M3.encode(s.x[t * inf + i] * s_in);
                    assert_eq!(s.x_t[i * tokens + t], want, "{}", what("x^T"));
                }
            }
            assert_eq!(s.x_scale_inv, 1.0 / s_in, "{}", what("saved scale"));
            // Backward: dx = dy W; dW = dy^T x; db = column sums of dy.
            let dyd = qdq(&s.dy, Fp8Format::E5M2, s_g);
            let (dx_want, dx_mag) = matmul_nt(&dyd, &transpose(&wd, outf, inf), tokens, inf, outf);
            assert_close(&what("dx"), &s.dx, &dx_want, &dx_mag, 1e-5, orel);
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
            for o in 0..outf {
                db_want[o] += (0..tokens).map(|t| s.dy[t * outf + o] as f64).sum::<f64>();
                db_mag[o] += (0..tokens)
                    .map(|t| (s.dy[t * outf + o] as f64).abs())
                    .sum::<f64>();
            }
            // The casts recorded this rank's amaxes; the update cleared them.
            assert_eq!(s.pending, [amax(&s.x), amax(&s.dy)], "{}", what("pending"));
            assert_eq!(s.pending_after, [0.0, 0.0], "{}", what("pending after"));
            global[0] = global[0].max(s.pending[0]);
            global[1] = global[1].max(s.pending[1]);
        }
        let per_rank: Vec<_> = runs.iter().map(|r| r.steps[step].grads.clone()).collect();
        let dw = full_grad(&layout, &per_rank, "weight");
        let db = full_grad(&layout, &per_rank, "bias");
        assert_close(
            &format!("dW, step {step}"),
            &dw,
            &dw_want,
            &dw_mag,
            1e-5,
            1e-6,
        );
        assert_close(
            &format!("db, step {step}"),
            &db,
            &db_want,
            &db_mag,
            1e-5,
            1e-6,
        );
        // The update recorded the (agreed) amax of the step in each meta and moved the scales.
        for (k, want_amax) in global.into_iter().enumerate() {
            let mut want = runs[0].steps[step].before[k].clone();
            want.update_from_amax(want_amax);
            for run in &runs {
                let got = &run.steps[step].after[k];
                assert_eq!(got.history(), want.history(), "meta {k} step {step}");
                assert_eq!(got.scale(), want.scale(), "meta {k} step {step}");
                assert_eq!(got.recorded(), want.recorded(), "meta {k} step {step}");
            }
        }
    }
    let last = &runs[0].steps[steps as usize - 1].after;
    assert_eq!(last[0].qtype(), QType::E4M3);
    assert_eq!(last[1].qtype(), QType::E5M2);
    if steps > 1 {
        assert_ne!(last[0].scale(), 1.0, "the delayed input scale moved");
    }
}

#[test]
fn fp8_linear_f32_activations_several_steps() {
    check_fp8_linear::<f32>(1, 24, 40, 16, 5, 3);
}

#[test]
fn fp8_linear_bf16_activations_odd_shapes() {
    check_fp8_linear::<bf16>(1, 7, 13, 5, 4, 4);
}

#[test]
fn fp8_linear_two_ranks_agree_on_the_metas() {
    check_fp8_linear::<f32>(2, 12, 40, 16, 4, 5);
    check_fp8_linear::<bf16>(2, 9, 24, 33, 3, 6);
}

/// An F32 `Linear` with bias on one rank: forward, dx, and the reduced dW and db against f64; with
/// `accumulate`, a first backward with other data is added into the same gradients.
fn check_float_linear(tokens: usize, inf: usize, outf: usize, seed: u64, accumulate: bool) {
    let x = values(seed, tokens * inf, 1.0);
    let dy = values(seed ^ 3, tokens * outf, 1.0);
    let x0 = values(seed ^ 5, tokens * inf, 1.0);
    let dy0 = values(seed ^ 6, tokens * outf, 1.0);
    let out = on_ranks(1, |comm| {
        let lin = Linear::<f32>::new(inf, outf)?
            .with_precision(LinearPrecision::F32)?
            .with_seed(seed);
        let mut model = FsdpModel::new(lin, comm, WrapPolicy::Single, FsdpConfig::default())?;
        model.set_cpu_parallelism(CpuParallelism::Single);
        let dev = model.device().clone();
        let params = model.gathered_params()?;
        let mut pass = |x: &[f32], dy: &[f32]| -> TestResult<(Vec<f32>, Vec<f32>)> {
            let xt = Tensor::new(dev.upload(x)?, Shape::matrix(tokens, inf)?)?;
            let y = model.forward(Mode::Train, |lin, ctx| lin.forward(ctx, xt))?;
            let dyt = Tensor::new(dev.upload(dy)?, Shape::matrix(tokens, outf)?)?;
            let dx = model
                .backward(|lin, ctx| lin.backward_step(ctx, dyt, true))?
                .ok_or("no dx")?;
            Ok((y.data().to_vec()?, dx.data().to_vec()?))
        };
        if accumulate {
            pass(&x0, &dy0)?;
        }
        let (y, dx) = pass(&x, &dy)?;
        let grads = grad_shards(model.sharded())?;
        Ok((
            params[0].1.clone(),
            params[1].1.clone(),
            y,
            dx,
            grads,
            model.layout().clone(),
        ))
    })
    .remove(0);
    let (w, b, y, dx, grads, layout) = out;
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (mut yw, mut ym) = matmul_nt(&f(&x), &f(&w), tokens, outf, inf);
    for t in 0..tokens {
        for o in 0..outf {
            yw[t * outf + o] += b[o] as f64;
            ym[t * outf + o] += (b[o] as f64).abs();
        }
    }
    assert_close("y", &y, &yw, &ym, 1e-5, 1e-6);
    let (dxw, dxm) = matmul_nt(&f(&dy), &transpose(&f(&w), outf, inf), tokens, inf, outf);
    assert_close("dx", &dx, &dxw, &dxm, 1e-5, 1e-6);
    let dw_of = |x: &[f32], dy: &[f32]| {
        matmul_nt(
            &transpose(&f(dy), tokens, outf),
            &transpose(&f(x), tokens, inf),
            outf,
            inf,
            tokens,
        )
    };
    let db_of = |dy: &[f32]| -> (Vec<f64>, Vec<f64>) {
        (0..outf)
            .map(|o| {
                let col = (0..tokens).map(|t| dy[t * outf + o] as f64);
                (col.clone().sum::<f64>(), col.map(f64::abs).sum::<f64>())
            })
            .unzip()
    };
    let (mut dww, mut dwm) = dw_of(&x, &dy);
    let (mut dbw, mut dbm) = db_of(&dy);
    if accumulate {
        let (a, am) = dw_of(&x0, &dy0);
        let (c, cm) = db_of(&dy0);
        for i in 0..dww.len() {
            dww[i] += a[i];
            dwm[i] += am[i];
        }
        for o in 0..outf {
            dbw[o] += c[o];
            dbm[o] += cm[o];
        }
    }
    let per_rank = [grads];
    assert_close(
        "dW",
        &full_grad(&layout, &per_rank, "weight"),
        &dww,
        &dwm,
        1e-5,
        1e-6,
    );
    assert_close(
        "db",
        &full_grad(&layout, &per_rank, "bias"),
        &dbw,
        &dbm,
        1e-5,
        1e-6,
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn fp8_linear_random_shapes(tokens in 1usize..20, inf in 1usize..24, outf in 1usize..20, seed in any::<u64>()) {
        check_fp8_linear::<f32>(1, tokens, inf, outf, 3, seed);
    }

    #[test]
    fn float_linear_matches_f64(tokens in 1usize..20, inf in 1usize..24, outf in 1usize..20, seed in any::<u64>(),
                                accumulate in any::<bool>()) {
        check_float_linear(tokens, inf, outf, seed, accumulate);
    }
}

fn usage(e: NnError) -> String {
    match e {
        NnError::Usage { .. } => e.to_string(),
        other => panic!("expected a usage error, got {other}"),
    }
}

#[test]
fn linear_shape_errors() {
    // Bad construction.
    assert!(Linear::<f32>::new(0, 4)
        .and_then(|l| l.with_precision(LinearPrecision::Fp8))
        .map(|l| l.with_seed(1))
        .is_err());
    assert!(Linear::<f32>::new(4, 0)
        .and_then(|l| l.with_precision(LinearPrecision::F32))
        .map(|l| l.with_seed(1))
        .is_err());
    assert!(
        Linear::<bf16>::new(4, 3)
            .and_then(|l| l.with_precision(LinearPrecision::F32))
            .map(|l| l.with_seed(1))
            .is_err(),
        "an F32 layer needs f32 activations"
    );
    on_ranks(1, |comm| {
        let dev = Device::cpu();
        let lin = Linear::<f32>::new(4, 3)?
            .with_precision(LinearPrecision::Fp8)?
            .with_seed(1);
        let mut model = FsdpModel::new(lin, comm, WrapPolicy::Single, FsdpConfig::default())?;
        // A backward before any forward.
        let dy = Tensor::new(dev.upload(&[0.0f32; 6])?, Shape::matrix(2, 3)?)?;
        let e = model
            .backward(|lin, ctx| lin.backward_step(ctx, dy, true))
            .unwrap_err();
        assert!(usage(e).contains("before forward"));
        // An input whose last dimension is not the input features.
        let x = Tensor::new(dev.upload(&[0.0f32; 10])?, Shape::matrix(2, 5)?)?;
        let e = model
            .forward(Mode::Train, |lin, ctx| lin.forward(ctx, x))
            .unwrap_err();
        assert!(usage(e).contains("last dimension must be 4"));
        // A good forward, then an output gradient of the wrong size.
        let x = Tensor::new(dev.upload(&[0.5f32; 8])?, Shape::matrix(2, 4)?)?;
        model.forward(Mode::Train, |lin, ctx| lin.forward(ctx, x))?;
        let dy = Tensor::new(dev.upload(&[0.0f32; 5])?, Shape::matrix(1, 5)?)?;
        let e = model
            .backward(|lin, ctx| lin.backward_step(ctx, dy, true))
            .unwrap_err();
        assert!(usage(e).contains("output gradient of shape"));
        // The fused-producer entry points check their sizes: codes of the wrong length, an output shape
        // of the wrong size, gradient codes of the wrong length.
        model.module_mut().fp8_input(&dev, 2)?;
        let codes = dev.zeros::<u8>(7)?;
        let e = model
            .forward(Mode::Train, |lin, ctx| {
                lin.forward_fp8_codes(ctx, &codes, Shape::matrix(2, 3)?)
            })
            .unwrap_err();
        assert!(usage(e).contains("input codes"));
        let codes = dev.zeros::<u8>(8)?;
        let e = model
            .forward(Mode::Train, |lin, ctx| {
                lin.forward_fp8_codes(ctx, &codes, Shape::matrix(2, 4)?)
            })
            .unwrap_err();
        assert!(usage(e).contains("output shape"));
        let (gq, gt) = (dev.zeros::<u8>(5)?, dev.zeros::<u8>(5)?);
        let e = model
            .backward(|lin, ctx| lin.backward_fp8_codes(ctx, &gq, &gt, Shape::matrix(2, 4)?, true))
            .unwrap_err();
        assert!(usage(e).contains("gradient codes"));
        Ok(())
    });
    // The FP8 entry points refuse a float layer.
    on_ranks(1, |comm| {
        let lin = Linear::<f32>::new(4, 3)?
            .with_precision(LinearPrecision::F32)?
            .with_seed(1);
        let mut model = FsdpModel::new(lin, comm, WrapPolicy::Single, FsdpConfig::default())?;
        let e = model.module_mut().fp8_input(&Device::cpu(), 2).unwrap_err();
        assert!(usage(e).contains("needs an FP8 layer"));
        Ok(())
    });
}
