//! Layer checks: forward against simple f64 references, and backward against central finite differences
//! of those references in f64, on small random shapes (proptest). The FP8 linear is checked against the
//! F32 one within FP8's error.

use fp8_kernels::{Buffer, CpuParallelism, Device};
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_examples::nn::{
    Conv2d, Dropout, Linear, LinearPrecision, LogSoftmaxNll, MaxPool2d, NnError, Relu,
};
use fsdp_shard::{
    FsdpConfig, ModelLayout, ParamGroup, ParamSpec, ShardError, ShardedModel, WrapPolicy,
};
use proptest::prelude::*;
use std::sync::Arc;

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = fsdp_examples::sampler::SplitMix64::new(seed);
    (0..n)
        .map(|_| ((rng.next_u64() >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32)
        .collect()
}

/// Any failure inside a rank (printed by `unwrap` through `Debug`).
#[derive(Debug)]
#[allow(dead_code)] // fields are read through Debug
enum TestError {
    Shard(ShardError),
    Nn(NnError),
    Comm(fsdp_comm::CommError),
}
impl From<ShardError> for TestError {
    fn from(e: ShardError) -> Self {
        TestError::Shard(e)
    }
}
impl From<NnError> for TestError {
    fn from(e: NnError) -> Self {
        TestError::Nn(e)
    }
}
impl From<fsdp_comm::CommError> for TestError {
    fn from(e: fsdp_comm::CommError) -> Self {
        TestError::Comm(e)
    }
}
impl From<fp8_kernels::KernelError> for TestError {
    fn from(e: fp8_kernels::KernelError) -> Self {
        TestError::Nn(e.into())
    }
}

/// Runs `f` on a one-rank sharded model holding `specs` with `init` values, gathered.
fn with_model<R: Send>(
    specs: Vec<ParamSpec>,
    init: Vec<Vec<f32>>,
    f: impl Fn(&mut ShardedModel) -> Result<R, TestError> + Sync,
) -> R {
    let layout = Arc::new(ModelLayout::new(specs, &WrapPolicy::Single).unwrap());
    let mut out = run_ranks(1, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (mut model, _) =
            ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &|p| {
                init[p].clone()
            })?;
        model.gather(0)?;
        f(&mut model)
    })
    .unwrap();
    out.remove(0)
}

/// The reduced gradient of parameter `name` (one rank: the whole gradient).
fn grad_of(model: &mut ShardedModel, name: &str) -> Vec<f32> {
    model.reduce_grads(0).unwrap();
    let p = model.index(name).unwrap();
    let (u, g, slot) = model.layout().locate(p).unwrap();
    let (off, n) = (slot.offset, slot.numel);
    let all = model.unit(u).unwrap().grads[g as usize].to_vec().unwrap();
    assert_eq!(g, ParamGroup::Plain);
    all[off..off + n].to_vec()
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
        let conv = Conv2d::new("c", c, oc, k, CpuParallelism::Single).unwrap();
        let x = values(seed, n * c * h * wd);
        let w = values(seed ^ 1, oc * c * k * k);
        let b = values(seed ^ 2, oc);
        let out_len = n * oc * (h - k + 1) * (wd - k + 1);
        let r = f64s(&values(seed ^ 3, out_len));
        let r32: Vec<f32> = r.iter().map(|&v| v as f32).collect();
        let specs = conv.param_specs();
        let (y, dx, dw, db) = with_model(specs, vec![w.clone(), b.clone()], |model| {
            let mut conv = Conv2d::new("c", c, oc, k, CpuParallelism::Single)?;
            let dev = Device::cpu();
            let xb = dev.upload(&x)?;
            let (y, s) = conv.forward(model, &xb, shape)?;
            assert_eq!(s, [n, oc, h - k + 1, wd - k + 1]);
            let y = y.to_vec()?;
            let dy = dev.upload(&r32)?;
            let dx = conv.backward(model, &dy, true)?.map(Buffer::to_vec).transpose()?;
            Ok((y, dx.unwrap_or_default(), grad_of(model, "c.weight"), grad_of(model, "c.bias")))
        });
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
        let dev = Device::cpu();
        let lin = Linear::new("l", inf, outf, precision, &dev, CpuParallelism::Single).unwrap();
        let x = values(seed, tokens * inf);
        let w = values(seed ^ 1, outf * inf);
        let b = values(seed ^ 2, outf);
        let r = f64s(&values(seed ^ 3, tokens * outf));
        let r32: Vec<f32> = r.iter().map(|&v| v as f32).collect();
        let (y, dx, dw, db) = with_model(lin.param_specs(), vec![w.clone(), b.clone()], |model| {
            let mut lin = Linear::new("l", inf, outf, precision, &Device::cpu(), CpuParallelism::Single)?;
            let xb = Device::cpu().upload(&x)?;
            let y = lin.forward(model, &xb)?.to_vec()?;
            let dy = Device::cpu().upload(&r32)?;
            let dx = lin.backward(model, &dy, true)?.map(Buffer::to_vec).transpose()?;
            Ok((y, dx.unwrap_or_default(), grad_of(model, "l.weight"), grad_of(model, "l.bias")))
        });
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

    /// ReLU, max-pool and log-softmax+NLL: backward equals finite differences of f64 references.
    #[test]
    fn relu_pool_loss_match_finite_differences(
        n in 1usize..3, c in 1usize..3, half_h in 1usize..4, half_w in 1usize..4, seed in any::<u64>(),
    ) {
        let dev = Device::cpu();
        let (h, w) = (2 * half_h, 2 * half_w);
        let x = values(seed, n * c * h * w);
        let xd = f64s(&x);
        let xb = dev.upload(&x).unwrap();
        // ReLU (inputs away from the kink: finite differences are exact there).
        let mut relu = Relu::new();
        let y = relu.forward(&xb).unwrap().to_vec().unwrap();
        prop_assert_eq!(&y, &x.iter().map(|v| v.max(0.0)).collect::<Vec<_>>());
        let r = f64s(&values(seed ^ 5, x.len()));
        let dx = relu.backward(&dev.upload(&r.iter().map(|&v| v as f32).collect::<Vec<_>>()).unwrap()).unwrap().to_vec().unwrap();
        let g = numeric_grad(&xd, |p| p.iter().zip(&r).map(|(v, q)| v.max(0.0) * q).sum());
        assert_close("relu dx", &dx, &g, 1e-6);
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
        let mut pool = MaxPool2d::new(2, 2).unwrap();
        let (py, ps) = pool.forward(&xb, [n, c, h, w]).unwrap();
        prop_assert_eq!(ps, [n, c, half_h, half_w]);
        assert_close("pool forward", &py.to_vec().unwrap(), &pool_ref(&xd), 0.0);
        let rp = f64s(&values(seed ^ 6, n * c * half_h * half_w));
        let dpx = pool.backward(&dev.upload(&rp.iter().map(|&v| v as f32).collect::<Vec<_>>()).unwrap()).unwrap().to_vec().unwrap();
        assert_close("pool dx", &dpx, &numeric_grad(&xd, |p| dot(&pool_ref(p), &rp)), 1e-6);
        // Log-softmax + mean NLL over rows of `classes` logits.
        let classes = c * h;
        let rows = n * w;
        let logits = &x[..rows * classes];
        let labels: Vec<i32> = (0..rows).map(|i| ((seed as usize + 7 * i) % classes) as i32).collect();
        let nll_ref = |p: &[f64]| -> f64 {
            (0..rows).map(|i| {
                let row = &p[i * classes..(i + 1) * classes];
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                lse - row[labels[i] as usize]
            }).sum::<f64>() / rows as f64
        };
        let mut loss = LogSoftmaxNll::new(classes).unwrap();
        let lb = dev.upload(&labels).unwrap();
        let stats = loss.forward(&dev.upload(logits).unwrap(), &lb).unwrap().to_vec().unwrap();
        let ld = f64s(logits);
        prop_assert!((stats[0] as f64 - nll_ref(&ld)).abs() <= 1e-5 * nll_ref(&ld).abs().max(1.0));
        let d = loss.backward(&lb, 0.5).unwrap().to_vec().unwrap();
        let g: Vec<f64> = numeric_grad(&ld, nll_ref).iter().map(|v| 0.5 * v).collect();
        assert_close("nll dlogits", &d, &g, 1e-5);
    }
}

/// Dropout: the kept fraction is near 1 - p, kept values are scaled by 1/(1-p), backward applies the same
/// mask, and restoring the generator offset reproduces the masks.
#[test]
fn dropout_masks_scale_and_replay() {
    let dev = Device::cpu();
    let x = dev.upload(&vec![1.0f32; 40_000]).unwrap();
    let mut d = Dropout::new(0.25, 99).unwrap();
    let y1 = d.forward(&x, true).unwrap().to_vec().unwrap();
    let kept = y1.iter().filter(|&&v| v != 0.0).count() as f64 / y1.len() as f64;
    assert!((kept - 0.75).abs() < 0.01, "kept {kept}");
    let scale = (1.0f64 / 0.75) as f32;
    assert!(y1.iter().all(|&v| v == 0.0 || v == scale));
    let g = d.backward(&x).unwrap().to_vec().unwrap();
    assert_eq!(g, y1, "backward of ones applies the forward mask and scale");
    assert_eq!(d.offset(), 40_000);
    let y2 = d.forward(&x, true).unwrap().to_vec().unwrap();
    assert_ne!(y1, y2, "the next call draws a new mask");
    d.set_offset(40_000);
    assert_eq!(d.forward(&x, true).unwrap().to_vec().unwrap(), y2);
    assert_eq!(
        d.forward(&x, false).unwrap().to_vec().unwrap(),
        vec![1.0; 40_000]
    );
    assert!(Dropout::new(1.0, 0).is_err());
}

/// The FP8 linear agrees with the F32 one within FP8's error: the output and dx stay within a few
/// percent by norm (E4M3 operands carry 4 significant bits, E5M2 gradients 3), and its scales adapt.
/// (dW is not compared: it is the same kernel path as dx and is covered in fp8-kernels.)
#[test]
fn fp8_linear_tracks_f32_linear() {
    let (tokens, inf, outf) = (32, 48, 10);
    let x = values(11, tokens * inf);
    let w: Vec<f32> = values(12, outf * inf).iter().map(|v| v * 0.2).collect();
    let b = values(13, outf);
    let r = values(14, tokens * outf);
    let run = |precision: LinearPrecision| {
        let lin = Linear::new(
            "l",
            inf,
            outf,
            precision,
            &Device::cpu(),
            CpuParallelism::Single,
        )
        .unwrap();
        with_model(lin.param_specs(), vec![w.clone(), b.clone()], |model| {
            let dev = Device::cpu();
            let mut lin = Linear::new("l", inf, outf, precision, &dev, CpuParallelism::Single)?;
            let xb = dev.upload(&x)?;
            let dy = dev.upload(&r)?;
            // Two steps: the first uses the initial scale 1, the second the delayed scales.
            let mut out = None;
            for _ in 0..2 {
                let y = lin.forward(model, &xb)?.to_vec()?;
                let dx = lin
                    .backward(model, &dy, true)?
                    .map(Buffer::to_vec)
                    .transpose()?;
                if let Some([a, g]) = lin.pending_amaxes() {
                    let amaxes = dev.upload(&[a.to_vec()?[0], g.to_vec()?[0]])?;
                    lin.update_scales_from(&amaxes, 0)?;
                }
                model.zero_grads()?;
                out = Some((y, dx.unwrap_or_default()));
            }
            let (y, dx) = out.unwrap_or_default();
            let metas = lin.scaling_metas()?;
            Ok((y, dx, metas))
        })
    };
    let (y32, dx32, none) = run(LinearPrecision::F32);
    assert!(none.is_none());
    let (y8, dx8, metas) = run(LinearPrecision::Fp8);
    assert_close("fp8 forward", &y8, &f64s(&y32), 0.08);
    assert_close("fp8 dx", &dx8, &f64s(&dx32), 0.15);
    let [input, grad] = metas.expect("FP8 layers have metas");
    // amax of x is below 1: the power-of-two scale is at least 448/1 rounded down, i.e. 256.
    assert!(input.scale() >= 256.0, "input scale {}", input.scale());
    assert!(grad.scale() > 1.0, "output-gradient scale {}", grad.scale());
}
