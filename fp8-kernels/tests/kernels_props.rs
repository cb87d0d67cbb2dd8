//! Property tests of the CPU element-wise, reduction, softmax, conv and pooling kernels against naive
//! references written here.

use fp8_kernels::conv::{self, Conv2dGeometry};
use fp8_kernels::elementwise::{self, Dropout, GeluApprox};
use fp8_kernels::pool::{self, Pool2dGeometry};
use fp8_kernels::reduce;
use fp8_kernels::softmax::{self, nll_stat};
use fp8_kernels::{Device, KernelError};
use half::bf16;
use proptest::prelude::*;

fn vals(len: usize, seed: u64, spread: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * spread
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn bias_add_and_grad(rows in 0usize..40, cols in 0usize..40, seed in any::<u64>()) {
        let dev = Device::cpu();
        let x = vals(rows * cols, seed, 10.0);
        let b = vals(cols, seed ^ 7, 3.0);
        let mut xb = dev.upload(&x).unwrap();
        elementwise::bias_add(&mut xb, &dev.upload(&b).unwrap(), rows, cols).unwrap();
        let got = xb.to_vec().unwrap();
        for r in 0..rows { for c in 0..cols {
            prop_assert_eq!(got[r * cols + c], x[r * cols + c] + b[c]);
        }}
        let mut db = dev.zeros::<f32>(cols).unwrap();
        reduce::sum_over_rows(&dev.upload(&x).unwrap(), rows, cols, &mut db).unwrap();
        let db = db.to_vec().unwrap();
        for c in 0..cols {
            let mut s = 0.0f32;
            for r in 0..rows { s += x[r * cols + c]; }
            prop_assert_eq!(db[c], s);
        }
        // bf16 storage: computed in f32, rounded once.
        let xh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let bh: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut xhb = dev.upload(&xh).unwrap();
        elementwise::bias_add(&mut xhb, &dev.upload(&bh).unwrap(), rows, cols).unwrap();
        let goth = xhb.to_vec().unwrap();
        for i in 0..rows * cols {
            prop_assert_eq!(goth[i], bf16::from_f32(xh[i].to_f32() + bh[i % cols].to_f32()));
        }
    }

    #[test]
    fn row_sums_follow_the_warp_order(rows in 0usize..20, cols in 0usize..300, seed in any::<u64>()) {
        let dev = Device::cpu();
        let x = vals(rows * cols, seed, 5.0);
        let mut out = dev.zeros::<f32>(rows).unwrap();
        reduce::sum_over_cols(&dev.upload(&x).unwrap(), rows, cols, &mut out).unwrap();
        let got = out.to_vec().unwrap();
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            // exact warp order: 32 strided partials, butterfly
            let mut p = [0.0f32; 32];
            for (i, &v) in row.iter().enumerate() { p[i % 32] += v; }
            for off in [16, 8, 4, 2, 1] {
                let q = p;
                for l in 0..32 { p[l] = q[l] + q[l ^ off]; }
            }
            prop_assert_eq!(got[r], p[0]);
            let plain: f64 = row.iter().map(|&v| v as f64).sum();
            prop_assert!((got[r] as f64 - plain).abs() <= 1e-4 * (1.0 + plain.abs()) + 1e-4 * cols as f64);
        }
    }

    #[test]
    fn relu_forward_backward(xs in proptest::collection::vec(prop_oneof![-5.0f32..5.0, Just(0.0f32), Just(-0.0f32)], 0..200), seed in any::<u64>()) {
        let dev = Device::cpu();
        let dy = vals(xs.len(), seed, 2.0);
        let x = dev.upload(&xs).unwrap();
        let mut y = dev.zeros::<f32>(xs.len()).unwrap();
        elementwise::relu_forward(&x, &mut y).unwrap();
        let mut dx = dev.zeros::<f32>(xs.len()).unwrap();
        elementwise::relu_backward(&x, &dev.upload(&dy).unwrap(), &mut dx).unwrap();
        let (y, dx) = (y.to_vec().unwrap(), dx.to_vec().unwrap());
        for i in 0..xs.len() {
            prop_assert_eq!(y[i].to_bits(), if xs[i] > 0.0 { xs[i] } else { 0.0 }.to_bits());
            prop_assert_eq!(dx[i], if xs[i] > 0.0 { dy[i] } else { 0.0 });
        }
    }

    #[test]
    fn gelu_matches_definitions(xs in proptest::collection::vec(-8.0f32..8.0, 0..200), seed in any::<u64>()) {
        let dev = Device::cpu();
        let dy = vals(xs.len(), seed, 2.0);
        let x = dev.upload(&xs).unwrap();
        for approx in [GeluApprox::Tanh, GeluApprox::Erf] {
            let mut y = dev.zeros::<f32>(xs.len()).unwrap();
            elementwise::gelu_forward(&x, &mut y, approx).unwrap();
            let mut dx = dev.zeros::<f32>(xs.len()).unwrap();
            elementwise::gelu_backward(&x, &dev.upload(&dy).unwrap(), &mut dx, approx).unwrap();
            let (y, dx) = (y.to_vec().unwrap(), dx.to_vec().unwrap());
            for i in 0..xs.len() {
                let v = xs[i] as f64;
                let (want, dwant) = match approx {
                    GeluApprox::Tanh => {
                        let k = (2.0 / std::f64::consts::PI).sqrt();
                        let u = k * (v + 0.044715 * v * v * v);
                        let t = u.tanh();
                        (0.5 * v * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * v * v))
                    }
                    GeluApprox::Erf => {
                        // erf by a series (accurate for |v/sqrt2| <= 6).
                        let z = v / std::f64::consts::SQRT_2;
                        let erf = erf_series(z);
                        let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
                        (0.5 * v * (1.0 + erf), 0.5 * (1.0 + erf) + v * pdf)
                    }
                };
                prop_assert!((y[i] as f64 - want).abs() <= 2e-6 * (1.0 + want.abs()), "{:?} x={} got {} want {}", approx, v, y[i], want);
                let g = dwant * dy[i] as f64;
                prop_assert!((dx[i] as f64 - g).abs() <= 2e-6 * (1.0 + g.abs()), "{:?} grad x={} got {} want {}", approx, v, dx[i], g);
            }
        }
    }

    #[test]
    fn log_softmax_nll(rows in 1usize..20, classes in 1usize..40, seed in any::<u64>(), spread in 0.1f32..30.0) {
        let dev = Device::cpu();
        let x = vals(rows * classes, seed, spread);
        let labels: Vec<i32> = (0..rows).map(|r| ((seed >> (r % 32)) as usize % classes) as i32).collect();
        let mut lp = dev.zeros::<f32>(rows * classes).unwrap();
        let mut stats = dev.zeros::<f32>(nll_stat::LEN).unwrap();
        let lb = dev.upload(&labels).unwrap();
        softmax::log_softmax_nll_forward(&dev.upload(&x).unwrap(), &lb, rows, classes, &mut lp, &mut stats).unwrap();
        let lpv = lp.to_vec().unwrap();
        let st = stats.to_vec().unwrap();
        let mut loss = 0.0f64;
        let mut correct = 0;
        for r in 0..rows {
            let row = &x[r * classes..(r + 1) * classes];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
            let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            for c in 0..classes {
                let want = row[c] as f64 - lse;
                prop_assert!((lpv[r * classes + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
            }
            loss -= row[labels[r] as usize] as f64 - lse;
            let best = (0..classes).fold(0, |b, c| if row[c] > row[b] { c } else { b });
            correct += (best == labels[r] as usize) as u32;
        }
        prop_assert!((st[nll_stat::MEAN_LOSS] as f64 - loss / rows as f64).abs() <= 1e-5 * (1.0 + loss.abs()));
        prop_assert_eq!(st[nll_stat::CORRECT], correct as f32);
        prop_assert_eq!(st[nll_stat::INVALID_LABELS], 0.0);
        let mut d = dev.zeros::<f32>(rows * classes).unwrap();
        softmax::log_softmax_nll_backward(&lp, &lb, rows, classes, &mut d).unwrap();
        let d = d.to_vec().unwrap();
        for r in 0..rows {
            let mut s = 0.0f64;
            for c in 0..classes {
                let p = (lpv[r * classes + c] as f64).exp();
                let want = (p - if c == labels[r] as usize { 1.0 } else { 0.0 }) / rows as f64;
                prop_assert!((d[r * classes + c] as f64 - want).abs() <= 1e-6);
                s += d[r * classes + c] as f64;
            }
            prop_assert!(s.abs() <= 1e-5, "gradient rows sum to zero");
        }
    }

    #[test]
    fn im2col_col2im_are_adjoint(
        n in 1usize..3, c in 1usize..4, h in 1usize..9, w in 1usize..9,
        k in 1usize..4, stride in 1usize..3, pad in 0usize..2, seed in any::<u64>()
    ) {
        prop_assume!(k <= h + 2 * pad && k <= w + 2 * pad);
        let g = Conv2dGeometry { batch: n, channels: c, height: h, width: w, kernel_h: k, kernel_w: k, stride, padding: pad };
        let dev = Device::cpu();
        let x = vals(g.input_len(), seed, 4.0);
        let mut cols = dev.zeros::<f32>(g.patches() * g.patch_len()).unwrap();
        conv::im2col(&dev.upload(&x).unwrap(), &g, &mut cols).unwrap();
        let cv = cols.to_vec().unwrap();
        let (oh, ow) = (g.out_h(), g.out_w());
        prop_assert_eq!(oh, (h + 2 * pad - k) / stride + 1);
        // naive im2col
        let mut want = vec![0.0f32; cv.len()];
        let mut acc = vec![0.0f32; x.len()];
        let dcol = vals(cv.len(), seed ^ 99, 1.0);
        for ni in 0..n { for oy in 0..oh { for ox in 0..ow {
            let row = (ni * oh + oy) * ow + ox;
            for ci in 0..c { for ky in 0..k { for kx in 0..k {
                let col = (ci * k + ky) * k + kx;
                let yy = (oy * stride + ky) as isize - pad as isize;
                let xx = (ox * stride + kx) as isize - pad as isize;
                if yy >= 0 && xx >= 0 && (yy as usize) < h && (xx as usize) < w {
                    let xi = ((ni * c + ci) * h + yy as usize) * w + xx as usize;
                    want[row * g.patch_len() + col] = x[xi];
                }
            }}}
        }}}
        prop_assert_eq!(&cv, &want);
        // col2im is the adjoint: <im2col(x), d> == <x, col2im(d)>
        let mut dx = dev.zeros::<f32>(x.len()).unwrap();
        conv::col2im(&dev.upload(&dcol).unwrap(), &g, &mut dx).unwrap();
        let dxv = dx.to_vec().unwrap();
        let lhs: f64 = cv.iter().zip(&dcol).map(|(&a, &b)| a as f64 * b as f64).sum();
        let rhs: f64 = x.iter().zip(&dxv).map(|(&a, &b)| a as f64 * b as f64).sum();
        prop_assert!((lhs - rhs).abs() <= 1e-4 * (1.0 + lhs.abs()));
        acc.iter_mut().for_each(|v| *v = 0.0);
        let _ = acc;
    }

    #[test]
    fn max_pool_forward_backward(n in 1usize..3, c in 1usize..3, h in 2usize..10, w in 2usize..10, k in 1usize..4, stride in 1usize..4, seed in any::<u64>()) {
        prop_assume!(k <= h && k <= w);
        let g = Pool2dGeometry { batch: n, channels: c, height: h, width: w, kernel: k, stride };
        let dev = Device::cpu();
        // Few distinct values so ties happen; the first maximum must win.
        let x: Vec<f32> = vals(g.input_len(), seed, 3.0).iter().map(|v| v.round()).collect();
        let mut y = dev.zeros::<f32>(g.output_len()).unwrap();
        let mut idx = dev.zeros::<u32>(g.output_len()).unwrap();
        pool::max_pool2d_forward(&dev.upload(&x).unwrap(), &g, &mut y, &mut idx).unwrap();
        let (yv, iv) = (y.to_vec().unwrap(), idx.to_vec().unwrap());
        let (oh, ow) = (g.out_h(), g.out_w());
        for p in 0..n * c { for oy in 0..oh { for ox in 0..ow {
            let mut best = f32::NEG_INFINITY; let mut bi = 0;
            for ky in 0..k { for kx in 0..k {
                let i = p * h * w + (oy * stride + ky) * w + ox * stride + kx;
                if x[i] > best { best = x[i]; bi = i; }
            }}
            let o = (p * oh + oy) * ow + ox;
            prop_assert_eq!(yv[o], best);
            prop_assert_eq!(iv[o] as usize, bi);
        }}}
        let dy = vals(g.output_len(), seed ^ 5, 1.0);
        let mut dx = dev.upload(&vec![9.0f32; x.len()]).unwrap();
        pool::max_pool2d_backward(&dev.upload(&dy).unwrap(), &idx, &mut dx).unwrap();
        let dxv = dx.to_vec().unwrap();
        let mut want = vec![0.0f32; x.len()];
        for (o, &i) in iv.iter().enumerate() { want[i as usize] += dy[o]; }
        prop_assert_eq!(dxv, want);
    }

    #[test]
    fn dropout_masks_and_scaling(len in 0usize..500, p in 0.0f32..0.95, seed in any::<u64>(), offset in any::<u32>()) {
        let dev = Device::cpu();
        let x = vals(len, seed, 3.0);
        let params = Dropout { p, seed, offset: offset as u64 };
        let mut y = dev.zeros::<f32>(len).unwrap();
        let mut m = dev.zeros::<u8>(len).unwrap();
        elementwise::dropout_forward(&dev.upload(&x).unwrap(), params, &mut y, &mut m).unwrap();
        let (yv, mv) = (y.to_vec().unwrap(), m.to_vec().unwrap());
        let thr = (p as f64 * 4294967296.0).round() as u64;
        let sc = (1.0 / (1.0 - p as f64)) as f32;
        for i in 0..len {
            let keep = (elementwise::dropout_bits(seed, offset as u64 + i as u64) as u64) >= thr;
            prop_assert_eq!(mv[i], keep as u8);
            prop_assert_eq!(yv[i], if keep { x[i] * sc } else { 0.0 });
        }
        let dy = vals(len, seed ^ 3, 1.0);
        let mut dx = dev.zeros::<f32>(len).unwrap();
        elementwise::dropout_backward(&dev.upload(&dy).unwrap(), &m, params, &mut dx).unwrap();
        let dxv = dx.to_vec().unwrap();
        for i in 0..len {
            prop_assert_eq!(dxv[i], if mv[i] == 1 { dy[i] * sc } else { 0.0 });
        }
        // A shifted offset gives the shifted mask (counter-based generator).
        if len > 1 {
            let mut m2 = dev.zeros::<u8>(len - 1).unwrap();
            let mut y2 = dev.zeros::<f32>(len - 1).unwrap();
            let p2 = Dropout { offset: offset as u64 + 1, ..params };
            elementwise::dropout_forward(&dev.upload(&x[1..]).unwrap(), p2, &mut y2, &mut m2).unwrap();
            prop_assert_eq!(&m2.to_vec().unwrap()[..], &mv[1..]);
        }
    }

    #[test]
    fn scale_axpy_add_transpose(len in 0usize..300, a in -4.0f32..4.0, seed in any::<u64>(), b in 1usize..4, r in 1usize..9) {
        let dev = Device::cpu();
        let x = vals(len, seed, 5.0);
        let y0 = vals(len, seed ^ 1, 5.0);
        let mut xs = dev.upload(&x).unwrap();
        elementwise::scale(&mut xs, a).unwrap();
        let sv = xs.to_vec().unwrap();
        let mut yb = dev.upload(&y0).unwrap();
        elementwise::axpy(a, &dev.upload(&x).unwrap(), &mut yb).unwrap();
        let yv = yb.to_vec().unwrap();
        let mut o = dev.zeros::<f32>(len).unwrap();
        elementwise::add(&dev.upload(&x).unwrap(), &dev.upload(&y0).unwrap(), &mut o).unwrap();
        let ov = o.to_vec().unwrap();
        for i in 0..len {
            prop_assert_eq!(sv[i], x[i] * a);
            prop_assert_eq!(yv[i], y0[i] + a * x[i]);
            prop_assert_eq!(ov[i], x[i] + y0[i]);
        }
        let cols = len / (b * r);
        let t = vals(b * r * cols, seed ^ 2, 1.0);
        let mut tt = dev.zeros::<f32>(t.len()).unwrap();
        conv::transpose_batched(&dev.upload(&t).unwrap(), [b, r, cols], &mut tt).unwrap();
        let tv = tt.to_vec().unwrap();
        for bi in 0..b { for ri in 0..r { for ci in 0..cols {
            prop_assert_eq!(tv[(bi * cols + ci) * r + ri], t[(bi * r + ri) * cols + ci]);
        }}}
    }
}

fn erf_series(z: f64) -> f64 {
    if z.abs() > 3.0 {
        // Asymptotic erfc (the alternating series cancels catastrophically out here); error < 1e-9.
        let z2 = z * z;
        let erfc = (-z2).exp() / (z.abs() * std::f64::consts::PI.sqrt())
            * (1.0 - 1.0 / (2.0 * z2) + 3.0 / (4.0 * z2 * z2) - 15.0 / (8.0 * z2 * z2 * z2));
        return z.signum() * (1.0 - erfc);
    }
    // erf z = 2/sqrt(pi) * sum_n (-1)^n z^(2n+1) / (n! (2n+1)).
    let mut sum = 0.0;
    let mut term = z; // (-1)^n z^(2n+1) / n!
    for n in 0..200 {
        sum += term / (2 * n + 1) as f64;
        term *= -z * z / (n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn erf_fit_is_accurate() {
    for i in -400..=400 {
        let x = i as f32 * 0.01;
        let e = elementwise::erf_approx(x) as f64;
        assert!((e - erf_series(x as f64)).abs() < 3e-7, "erf({x})");
    }
}

#[test]
fn bad_shapes_are_errors() {
    let dev = Device::cpu();
    let x = dev.upload(&[1.0f32; 6]).unwrap();
    let mut y = dev.zeros::<f32>(5).unwrap();
    assert!(matches!(
        elementwise::relu_forward(&x, &mut y),
        Err(KernelError::LengthMismatch { .. })
    ));
    let mut x6 = dev.upload(&[1.0f32; 6]).unwrap();
    assert!(elementwise::bias_add(&mut x6, &dev.upload(&[1.0f32; 4]).unwrap(), 2, 3).is_err());
    let g = Conv2dGeometry {
        batch: 1,
        channels: 1,
        height: 2,
        width: 2,
        kernel_h: 3,
        kernel_w: 3,
        stride: 1,
        padding: 0,
    };
    let mut c = dev.zeros::<f32>(9).unwrap();
    assert!(conv::im2col(&dev.upload(&[0.0f32; 4]).unwrap(), &g, &mut c).is_err());
    let bad_p = Dropout {
        p: 1.0,
        seed: 0,
        offset: 0,
    };
    let mut m = dev.zeros::<u8>(6).unwrap();
    let mut y6 = dev.zeros::<f32>(6).unwrap();
    assert!(elementwise::dropout_forward(&x, bad_p, &mut y6, &mut m).is_err());
    let mut st = dev.zeros::<f32>(3).unwrap();
    let mut lp = dev.zeros::<f32>(6).unwrap();
    let labels = dev.upload(&[0i32, 3]).unwrap();
    assert!(
        softmax::log_softmax_nll_forward(&x, &labels, 2, 3, &mut lp, &mut st).is_err(),
        "label 3 of 3 classes"
    );
    let idx = dev.upload(&[7u32]).unwrap();
    let mut dx = dev.zeros::<f32>(4).unwrap();
    assert!(pool::max_pool2d_backward(&dev.upload(&[1.0f32]).unwrap(), &idx, &mut dx).is_err());
}

#[test]
fn large_elementwise_inputs_use_the_parallel_paths() {
    let dev = Device::cpu();
    let n = 100_003;
    let x = vals(n, 42, 4.0);
    let mut y = dev.zeros::<f32>(n).unwrap();
    elementwise::gelu_forward(&dev.upload(&x).unwrap(), &mut y, GeluApprox::Tanh).unwrap();
    let yv = y.to_vec().unwrap();
    for i in 0..n {
        assert_eq!(yv[i], elementwise::gelu_scalar(x[i], GeluApprox::Tanh));
    }
    let (rows, cols) = (1001, 100);
    let xs = vals(rows * cols, 3, 1.0);
    let mut s = dev.zeros::<f32>(cols).unwrap();
    reduce::sum_over_rows(&dev.upload(&xs).unwrap(), rows, cols, &mut s).unwrap();
    let sv = s.to_vec().unwrap();
    for (c, &v) in sv.iter().enumerate() {
        assert_eq!(v, chunked_column_sum(&xs, rows, cols, c));
    }
}

/// The documented order of `sum_over_rows`, written out independently: chunks of
/// `max(64, ceil(sqrt(rows)))` rows summed from zero, chunk sums added from the first.
fn chunked_column_sum(x: &[f32], rows: usize, cols: usize, c: usize) -> f32 {
    let chunk = ((rows as f64).sqrt().ceil() as usize).max(64);
    let mut total: Option<f32> = None;
    let mut r0 = 0;
    loop {
        let mut s = 0.0f32;
        for r in r0..(r0 + chunk).min(rows) {
            s += x[r * cols + c];
        }
        total = Some(match total {
            None => s,
            Some(t) => t + s,
        });
        r0 += chunk;
        if r0 >= rows {
            break;
        }
    }
    total.unwrap_or(0.0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn column_sums_of_tall_inputs_follow_the_chunked_order(
        rows in 0usize..6000, cols in 1usize..9, seed in any::<u64>()
    ) {
        let dev = Device::cpu();
        let x = vals(rows * cols, seed, 3.0);
        let mut s = dev.zeros::<f32>(cols).unwrap();
        reduce::sum_over_rows(&dev.upload(&x).unwrap(), rows, cols, &mut s).unwrap();
        let s = s.to_vec().unwrap();
        let mut plain_err = 0.0f64;
        for c in 0..cols {
            prop_assert_eq!(s[c], chunked_column_sum(&x, rows, cols, c));
            let exact: f64 = (0..rows).map(|r| f64::from(x[r * cols + c])).sum();
            plain_err = plain_err.max((f64::from(s[c]) - exact).abs());
        }
        // And the sum is a sum: within f32 rounding of the exact value.
        prop_assert!(plain_err <= 3.0 * rows as f64 * 6e-8 * 3.0 + 1e-6, "error {plain_err}");
    }
}
