//! Layer checks inside a wrapped one-rank model: forward against simple f64 references, and backward
//! against central finite differences of those references in f64, on small random shapes (proptest).
//! Parameters are the layers' own initial values, read back from the model. The FP8 linear is checked
//! against the F32 one within FP8's error; dropout's masks replay from its saved module state.
//! (Moved from fsdp-examples' `mnist_layers`, where the layers used to live.)

mod common;

use common::{full_grad, grad_shards, on_ranks, values, TestResult};
use fp8_kernels::elementwise::{gelu_grad_scalar, gelu_scalar, GeluApprox};
use fp8_kernels::CpuParallelism;
use fsdp_nn::{
    Conv2d, Dropout, Flatten, Gelu, Layer, Linear, LinearPrecision, LogSoftmaxNll, MaxPool2d,
    NnError, Relu, Shape, Tensor,
};
use fsdp_shard::{
    FsdpConfig, FsdpModel, Mode, Module, ParamDecl, ParamId, ParamKind, ShardError, Visitor,
    WrapPolicy,
};
use proptest::prelude::*;

/// A layer under test as child `l` of a model with one unused parameter, so that layers without
/// parameters run inside a pass too.
struct Holder<L> {
    l: L,
    anchor: ParamId,
}

impl<L: Module> Module for Holder<L> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.param(
            "anchor",
            &ParamDecl::new(&[1], ParamKind::Plain, &|| vec![0.0]),
            &mut self.anchor,
        )?;
        v.child("l", &mut self.l)
    }
}

type Model<L> = FsdpModel<Holder<L>>;

/// Runs `f` on a one-rank model holding the layer `make()` makes.
fn with_layer<L: Module, R: Send>(
    make: impl Fn() -> Result<L, NnError> + Sync,
    f: impl Fn(&mut Model<L>) -> TestResult<R> + Sync,
) -> R {
    on_ranks(1, |comm| {
        let holder = Holder {
            l: make()?,
            anchor: ParamId::UNSET,
        };
        let mut model = FsdpModel::new(holder, comm, WrapPolicy::Single, FsdpConfig::default())?;
        model.set_cpu_parallelism(CpuParallelism::Single);
        f(&mut model)
    })
    .remove(0)
}

/// The model's parameter `name` (gathered, F32).
fn param<L: Module>(model: &mut Model<L>, name: &str) -> TestResult<Vec<f32>> {
    Ok(model
        .gathered_params()?
        .into_iter()
        .find(|(n, _)| n == name)
        .ok_or_else(|| format!("no parameter {name}"))?
        .1)
}

/// The reduced gradient of `name` (one rank: the whole gradient).
fn grad<L: Module>(model: &Model<L>, name: &str) -> TestResult<Vec<f32>> {
    Ok(full_grad(
        model.layout(),
        &[grad_shards(model.sharded())?],
        name,
    ))
}

/// A training forward and backward of `x` (shape `shape`) with output gradient `r`; returns `y` and
/// `dx`.
fn train_pass<L: Layer>(
    model: &mut Model<L>,
    x: &[f32],
    shape: &[usize],
    r: &[f32],
) -> TestResult<(Vec<f32>, Shape, Vec<f32>)> {
    let dev = model.device().clone();
    let xt = Tensor::new(dev.upload(x)?, Shape::new(shape)?)?;
    let y = model.forward(Mode::Train, |h, ctx| h.l.forward(ctx, xt))?;
    let dy = Tensor::new(dev.upload(r)?, y.shape())?;
    let dx = model
        .backward(|h, ctx| h.l.backward_step(ctx, dy, true))?
        .ok_or("no dx")?;
    Ok((y.data().to_vec()?, y.shape(), dx.data().to_vec()?))
}

fn conv_ref(
    x: &[f64],
    w: &[f64],
    b: &[f64],
    [n, c, h, wd]: [usize; 4],
    oc: usize,
    k: usize,
) -> Vec<f64> {
    let (oh, ow) = (h - k + 1, wd - k + 1);
    let mut y = vec![0f64; n * oc * oh * ow];
    for i in 0..n {
        for o in 0..oc {
            for yy in 0..oh {
                for xx in 0..ow {
                    let mut s = b[o];
                    for ci in 0..c {
                        for ky in 0..k {
                            for kx in 0..k {
                                s += w[((o * c + ci) * k + ky) * k + kx]
                                    * x[((i * c + ci) * h + yy + ky) * wd + xx + kx];
                            }
                        }
                    }
                    y[((i * oc + o) * oh + yy) * ow + xx] = s;
                }
            }
        }
    }
    y
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Central finite differences of `loss` at `at`, in f64.
fn numeric_grad(at: &[f64], loss: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let eps = 1e-6;
    let mut p = at.to_vec();
    (0..at.len())
        .map(|i| {
            let orig = p[i];
            p[i] = orig + eps;
            let lp = loss(&p);
            p[i] = orig - eps;
            let lm = loss(&p);
            p[i] = orig;
            (lp - lm) / (2.0 * eps)
        })
        .collect()
}

/// `||got - want|| <= tol * max(||scale||, 1e-3)`: for arithmetic whose error follows the magnitude of the
/// terms (`scale`), not of their sum.
fn assert_close_scaled(what: &str, got: &[f32], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = scale.iter().map(|w| w * w).sum::<f64>().sqrt();
    assert!(
        num <= tol * den.max(1e-3),
        "{what}: error {num} against a bound of {} (magnitude {den})",
        tol * den.max(1e-3)
    );
}

/// `||a - b|| <= tol * max(||b||, 1e-3)`.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_close_scaled(what, got, want, want, tol);
}

fn dot(a: &[f64], r: &[f64]) -> f64 {
    a.iter().zip(r).map(|(x, y)| x * y).sum()
}

/// `erf` in f64 by its Taylor series (exact to ~1e-14 for `|x| <= 2.2`, the range used here).
fn erf(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-17 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Conv2d forward equals the direct f64 convolution; its dx, dW and db equal finite differences of
    /// `L = sum(y * r)`.
    #[test]
    fn conv2d_matches_reference_and_finite_differences(
        n in 1usize..3, c in 1usize..4, oc in 1usize..5, k in 1usize..4, extra in 0usize..4,
        seed in any::<u64>(),
    ) {
        let (h, wd) = (k + extra, k + extra + 1);
        let shape = [n, c, h, wd];
        let x = values(seed, n * c * h * wd, 1.0);
        let out_len = n * oc * (h - k + 1) * (wd - k + 1);
        let r = f64s(&values(seed ^ 3, out_len, 1.0));
        let (w, b, y, ys, dx, dw, db) = with_layer(|| Conv2d::new(c, oc, k).map(|l| l.with_seed(seed)), |model| {
            let (w, b) = (param(model, "l.weight")?, param(model, "l.bias")?);
            let (y, ys, dx) = train_pass(model, &x, &shape, &f32s(&r))?;
            Ok((w, b, y, ys, dx, grad(model, "l.weight")?, grad(model, "l.bias")?))
        });
        prop_assert_eq!(ys.dims(), &[n, oc, h - k + 1, wd - k + 1]);
        let (xd, wdd, bd) = (f64s(&x), f64s(&w), f64s(&b));
        assert_close("forward", &y, &conv_ref(&xd, &wdd, &bd, shape, oc, k), 1e-5);
        let gx = numeric_grad(&xd, |xp| dot(&conv_ref(xp, &wdd, &bd, shape, oc, k), &r));
        assert_close("dx", &dx, &gx, 1e-4);
        let gw = numeric_grad(&wdd, |wp| dot(&conv_ref(&xd, wp, &bd, shape, oc, k), &r));
        assert_close("dW", &dw, &gw, 1e-4);
        let gb = numeric_grad(&bd, |bp| dot(&conv_ref(&xd, &wdd, bp, shape, oc, k), &r));
        assert_close("db", &db, &gb, 1e-4);
    }

    /// F32 and BF16 Linear: forward against `x W^T + b` in f64, gradients against finite differences.
    #[test]
    fn linear_matches_reference_and_finite_differences(
        tokens in 1usize..6, inf in 1usize..20, outf in 1usize..12, bf16 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let precision = if bf16 { LinearPrecision::Bf16 } else { LinearPrecision::F32 };
        let x = values(seed, tokens * inf, 1.0);
        let r = f64s(&values(seed ^ 3, tokens * outf, 1.0));
        let (w, b, y, dx, dw, db) = with_layer(
            || Linear::<f32>::new(inf, outf).and_then(|l| l.with_precision(precision)).map(|l| l.with_seed(seed)),
            |model| {
                let (w, b) = (param(model, "l.weight")?, param(model, "l.bias")?);
                let (y, _, dx) = train_pass(model, &x, &[tokens, inf], &f32s(&r))?;
                Ok((w, b, y, dx, grad(model, "l.weight")?, grad(model, "l.bias")?))
            },
        );
        let fwd = |x: &[f64], w: &[f64], b: &[f64]| -> Vec<f64> {
            let mut y = vec![0f64; tokens * outf];
            for t in 0..tokens {
                for o in 0..outf {
                    y[t * outf + o] = b[o] + (0..inf).map(|i| x[t * inf + i] * w[o * inf + i]).sum::<f64>();
                }
            }
            y
        };
        let (xd, wd, bd) = (f64s(&x), f64s(&w), f64s(&b));
        let want_y = fwd(&xd, &wd, &bd);
        let want_dx = numeric_grad(&xd, |p| dot(&fwd(p, &wd, &bd), &r));
        let want_dw = numeric_grad(&wd, |p| dot(&fwd(&xd, p, &bd), &r));
        let want_db = numeric_grad(&bd, |p| dot(&fwd(&xd, &wd, p), &r));
        if bf16 {
            // BF16 rounds each operand (and the output) to 8 significant bits, so the error of a sum is
            // bounded by about 3 * 2^-9 of the sum of |terms|, not of the (possibly cancelling) result:
            // compare against the same quantities computed from absolute values, with a 2^-6 bound.
            let abs = |v: &[f64]| v.iter().map(|a| a.abs()).collect::<Vec<_>>();
            let (xa, wa, ba, ra) = (abs(&xd), abs(&wd), abs(&bd), abs(&r));
            let tol = 2f64.powi(-6);
            assert_close_scaled("forward", &y, &want_y, &fwd(&xa, &wa, &ba), tol);
            assert_close_scaled("dx", &dx, &want_dx, &numeric_grad(&xa, |p| dot(&fwd(p, &wa, &ba), &ra)), tol);
            assert_close_scaled("dW", &dw, &want_dw, &numeric_grad(&wa, |p| dot(&fwd(&xa, p, &ba), &ra)), tol);
            // The bias gradient sums the bf16-rounded output gradient.
            assert_close_scaled("db", &db, &want_db, &numeric_grad(&ba, |p| dot(&fwd(&xa, &wa, p), &ra)), tol);
        } else {
            assert_close("forward", &y, &want_y, 1e-5);
            assert_close("dx", &dx, &want_dx, 1e-4);
            assert_close("dW", &dw, &want_dw, 1e-4);
            assert_close("db", &db, &want_db, 1e-4);
        }
    }

    /// ReLU, max-pool, GELU (both forms), flatten and log-softmax+NLL: backward equals finite differences
    /// of f64 references.
    #[test]
    fn activations_pool_loss_match_finite_differences(
        n in 1usize..3, c in 1usize..3, half_h in 1usize..4, half_w in 1usize..4, seed in any::<u64>(),
    ) {
        let (h, w) = (2 * half_h, 2 * half_w);
        let shape = [n, c, h, w];
        let x = values(seed, n * c * h * w, 1.0);
        let xd = f64s(&x);
        let r = f64s(&values(seed ^ 5, x.len(), 1.0));
        // ReLU (inputs away from the kink: finite differences are exact there).
        let (y, _, dx) = with_layer(|| Ok(Relu::<f32>::new()), |m| train_pass(m, &x, &shape, &f32s(&r)));
        prop_assert_eq!(&y, &x.iter().map(|v| v.max(0.0)).collect::<Vec<_>>());
        let g = numeric_grad(&xd, |p| p.iter().zip(&r).map(|(v, q)| v.max(0.0) * q).sum());
        assert_close("relu dx", &dx, &g, 1e-6);
        // GELU, erf and tanh forms, on inputs spread over [-3, 3).
        let x3: Vec<f32> = x.iter().map(|v| 3.0 * v).collect();
        let x3d = f64s(&x3);
        let gelu_erf = |v: f64| 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2));
        let gelu_tanh = |v: f64| {
            0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
        };
        for (approx, reference) in [
            (GeluApprox::Erf, &gelu_erf as &dyn Fn(f64) -> f64),
            (GeluApprox::Tanh, &gelu_tanh),
        ] {
            let (y, _, dx) = with_layer(
                || Ok(Gelu::<f32>::with_approx(approx)),
                |m| train_pass(m, &x3, &shape, &f32s(&r)),
            );
            let want: Vec<f64> = x3d.iter().map(|&v| reference(v)).collect();
            assert_close(&format!("gelu {approx:?} forward"), &y, &want, 1e-6);
            let g = numeric_grad(&x3d, |p| p.iter().zip(&r).map(|(&v, q)| reference(v) * q).sum());
            assert_close(&format!("gelu {approx:?} dx"), &dx, &g, 1e-5);
            // The layer is the kernels' scalar definition.
            for (i, &v) in x3.iter().enumerate() {
                prop_assert!((y[i] - gelu_scalar(v, approx)).abs() <= 1e-6 * y[i].abs().max(1e-3));
                let gw = gelu_grad_scalar(v, approx) * r[i] as f32;
                prop_assert!((dx[i] - gw).abs() <= 1e-5 * gw.abs().max(1e-3));
            }
        }
        // Flatten: a reshape both ways.
        let (y, ys, dx) = with_layer(|| Ok(Flatten::new()), |m| train_pass(m, &x, &shape, &f32s(&r)));
        prop_assert_eq!(ys.dims(), &[n, c * h * w]);
        prop_assert_eq!(&y, &x);
        prop_assert_eq!(&dx, &f32s(&r));
        // Max-pool 2x2.
        let pool_ref = |p: &[f64]| -> Vec<f64> {
            let mut out = Vec::new();
            for plane in 0..n * c {
                for oy in 0..half_h {
                    for ox in 0..half_w {
                        let mut m = f64::NEG_INFINITY;
                        for ky in 0..2 {
                            for kx in 0..2 {
                                m = m.max(p[plane * h * w + (2 * oy + ky) * w + 2 * ox + kx]);
                            }
                        }
                        out.push(m);
                    }
                }
            }
            out
        };
        let rp = f64s(&values(seed ^ 6, n * c * half_h * half_w, 1.0));
        let (py, ps, dpx) = with_layer(|| MaxPool2d::new(2, 2), |m| train_pass(m, &x, &shape, &f32s(&rp)));
        prop_assert_eq!(ps.dims(), &[n, c, half_h, half_w]);
        assert_close("pool forward", &py, &pool_ref(&xd), 0.0);
        assert_close("pool dx", &dpx, &numeric_grad(&xd, |p| dot(&pool_ref(p), &rp)), 1e-6);
        // Log-softmax + mean NLL over rows of `classes` logits.
        let classes = c * h;
        let rows = n * w;
        let logits = &x[..rows * classes];
        let labels: Vec<i32> = (0..rows).map(|i| ((seed as usize).wrapping_add(7 * i) % classes) as i32).collect();
        let nll_ref = |p: &[f64]| -> f64 {
            (0..rows).map(|i| {
                let row = &p[i * classes..(i + 1) * classes];
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                lse - row[labels[i] as usize]
            }).sum::<f64>() / rows as f64
        };
        let (stats, d) = with_layer(
            || LogSoftmaxNll::new(classes),
            |m| {
                let dev = m.device().clone();
                let lb = dev.upload(&labels)?;
                let lt = Tensor::new(dev.upload(logits)?, Shape::matrix(rows, classes)?)?;
                let stats = m.forward(Mode::Train, |h, ctx| {
                    h.l.forward(ctx, lt, &lb).and_then(|s| Ok(s.to_vec()?))
                })?;
                let d = m.backward(|h, ctx| h.l.backward(ctx, &lb, 0.5))?;
                Ok((stats, d.data().to_vec()?))
            },
        );
        let ld = f64s(logits);
        prop_assert!((stats[0] as f64 - nll_ref(&ld)).abs() <= 1e-5 * nll_ref(&ld).abs().max(1.0));
        let g: Vec<f64> = numeric_grad(&ld, nll_ref).iter().map(|v| 0.5 * v).collect();
        assert_close("nll dlogits", &d, &g, 1e-5);
    }
}

/// Layers keep nothing in an evaluation forward: a backward after it is an error naming the layer.
#[test]
fn backward_after_an_evaluation_forward_is_an_error() {
    let x = values(1, 2 * 4, 1.0);
    let e = with_layer(
        || Ok(Relu::<f32>::new()),
        |m| {
            let dev = m.device().clone();
            let xt = Tensor::new(dev.upload(&x)?, Shape::matrix(2, 4)?)?;
            let y = m.forward(Mode::Eval, |h, ctx| h.l.forward(ctx, xt))?;
            let dy = Tensor::new(dev.upload(&x)?, y.shape())?;
            Ok(m.backward(|h, ctx| h.l.backward_step(ctx, dy, true))
                .unwrap_err()
                .to_string())
        },
    );
    assert!(e.contains("Relu") && e.contains("training forward"), "{e}");
}

/// Dropout: the kept fraction is near 1 - p, kept values are scaled by 1/(1-p), backward applies the same
/// mask, the generator's offset (its module state) replays the masks when restored, and an evaluation
/// forward is the identity and leaves the offset alone.
#[test]
fn dropout_masks_scale_and_replay() {
    assert!(Dropout::new(1.0, 0).is_err());
    assert!(Dropout::new(-0.1, 0).is_err());
    let n = 40_000;
    let ones = vec![1.0f32; n];
    with_layer(
        || Dropout::new(0.25, 99),
        |m| {
            let dev = m.device().clone();
            let t = |v: &[f32]| -> TestResult<Tensor> {
                Ok(Tensor::new(dev.upload(v)?, Shape::matrix(n / 8, 8)?)?)
            };
            let (y1, _, g) = train_pass(m, &ones, &[n / 8, 8], &ones)?;
            let kept = y1.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            assert!((kept - 0.75).abs() < 0.01, "kept {kept}");
            let scale = (1.0f64 / 0.75) as f32;
            assert!(y1.iter().all(|&v| v == 0.0 || v == scale));
            assert_eq!(g, y1, "backward of ones applies the forward mask and scale");
            assert_eq!(m.module().l.offset(), n as u64);
            let state = m.export_module_state()?;
            assert_eq!(
                state.get("counter.l.offset").map(String::as_str),
                Some("40000")
            );
            let (y2, _, _) = train_pass(m, &ones, &[n / 8, 8], &ones)?;
            assert_ne!(y1, y2, "the next forward draws a new mask");
            m.import_module_state(&state)?;
            let (y3, _, _) = train_pass(m, &ones, &[n / 8, 8], &ones)?;
            assert_eq!(y3, y2, "the restored offset replays the mask");
            let before = m.module().l.offset();
            let xe = t(&ones)?;
            let ye = m.forward(Mode::Eval, |h, ctx| h.l.forward(ctx, xe))?;
            assert_eq!(ye.data().to_vec()?, ones);
            assert_eq!(m.module().l.offset(), before, "evaluation draws nothing");
            Ok(())
        },
    );
}

/// The FP8 linear agrees with the F32 one (same initial weights) within FP8's error: the output and dx
/// stay within a few percent by norm (E4M3 operands carry 4 significant bits, E5M2 gradients 3), and its
/// scales adapt. (dW is the same kernel path as dx; `linear_properties` checks it exactly.)
#[test]
fn fp8_linear_tracks_f32_linear() {
    let (tokens, inf, outf) = (32, 48, 10);
    let x = values(11, tokens * inf, 1.0);
    let r = values(14, tokens * outf, 1.0);
    let run = |precision: LinearPrecision| {
        with_layer(
            || {
                Linear::<f32>::new(inf, outf)
                    .and_then(|l| l.with_precision(precision))
                    .map(|l| l.with_seed(12))
            },
            |m| {
                // Two steps: the first uses the initial scale 1, the second the delayed scales.
                let mut out = (Vec::new(), Vec::new());
                for _ in 0..2 {
                    let (y, _, dx) = train_pass(m, &x, &[tokens, inf], &r)?;
                    m.parts_mut().1.update_local()?;
                    m.sharded_mut().zero_grads()?;
                    out = (y, dx);
                }
                let reg = m.scaling();
                let metas = (0..reg.len())
                    .map(|i| Ok(reg.get(reg.id(i)?)?.to_meta()?))
                    .collect::<TestResult<Vec<_>>>()?;
                Ok((out.0, out.1, metas))
            },
        )
    };
    let (y32, dx32, none) = run(LinearPrecision::F32);
    assert!(none.is_empty(), "a float layer has no scaling metas");
    let (y8, dx8, metas) = run(LinearPrecision::Fp8);
    assert_close("fp8 forward", &y8, &f64s(&y32), 0.08);
    assert_close("fp8 dx", &dx8, &f64s(&dx32), 0.15);
    let [input, grad] = <[_; 2]>::try_from(metas).expect("FP8 layers have two metas");
    // amax of x is below 1: the power-of-two scale is at least 448/1 rounded down, i.e. 256.
    assert!(input.scale() >= 256.0, "input scale {}", input.scale());
    assert!(grad.scale() > 1.0, "output-gradient scale {}", grad.scale());
}
