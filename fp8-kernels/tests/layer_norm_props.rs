//! The CPU LayerNorm / RMSNorm (the reference of the CUDA kernels) against a plain f64 implementation on
//! random shapes, values and constants; the fused FP8 output against the unfused path and against
//! `fp8_core`'s encoder, bit for bit; the backward against f64 formulas and against central finite
//! differences of the f64 forward; accumulation modes; argument errors.

mod common;

use common::{assert_each_layout_alone, grads_to_host, norm_grads};
use fp8_core::Fp8Format;
use fp8_kernels::layer_norm::{
    norm_backward, norm_forward, norm_forward_fp8, Fp8NormOutput, GradMode, NormKind, NormSpec,
    NormStats,
};
use fp8_kernels::{cast_transpose_to_fp8, AmaxSlot, Buffer, Device, FloatElement};
use half::{bf16, f16};
use proptest::prelude::*;

/// f64 forward of one row: (mean, rstd, y).
fn ref_row(
    kind: NormKind,
    x: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    eps: f64,
) -> (f64, f64, Vec<f64>) {
    let d = x.len() as f64;
    let mean = match kind {
        NormKind::LayerNorm => x.iter().sum::<f64>() / d,
        NormKind::RmsNorm => 0.0,
    };
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d;
    let rstd = 1.0 / (var + eps).sqrt();
    let y = x
        .iter()
        .enumerate()
        .map(|(i, v)| (v - mean) * rstd * w[i] + b.map_or(0.0, |b| b[i]))
        .collect();
    (mean, rstd, y)
}

/// f64 backward of one row: (dx, per-element dy * xhat, xhat).
fn ref_row_backward(
    kind: NormKind,
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (mean, rstd, _) = ref_row(kind, x, w, None, eps);
    let d = x.len() as f64;
    let xh: Vec<f64> = x.iter().map(|v| (v - mean) * rstd).collect();
    let g: Vec<f64> = dy.iter().zip(w).map(|(a, b)| a * b).collect();
    let c1 = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d;
    let c2 = match kind {
        NormKind::LayerNorm => g.iter().sum::<f64>() / d,
        NormKind::RmsNorm => 0.0,
    };
    let dx = g
        .iter()
        .zip(&xh)
        .map(|(gi, xi)| (gi - c2 - xi * c1) * rstd)
        .collect();
    (dx, xh)
}

fn to_t<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn widen<T: FloatElement>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

/// Relative precision of the element type (one ulp at 1).
fn ulp<T: FloatElement>() -> f64 {
    if T::DTYPE == fp8_kernels::DType::BF16 {
        2f64.powi(-7)
    } else {
        2f64.powi(-23)
    }
}

#[derive(Debug, Clone)]
struct Case {
    kind: NormKind,
    rows: usize,
    d: usize,
    eps: f32,
    x: Vec<f32>,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    dy: Vec<f32>,
}

fn case(max_rows: usize, max_d: usize) -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(NormKind::LayerNorm), Just(NormKind::RmsNorm)],
        1..max_rows,
        1..max_d,
        prop_oneof![Just(1e-5f32), 1e-6f32..1e-2],
        -50.0f32..50.0,
        any::<bool>(),
    )
        .prop_flat_map(|(kind, rows, d, eps, shift, with_bias)| {
            let n = rows * d;
            (
                Just((kind, rows, d, eps)),
                proptest::collection::vec(-3.0f32..3.0, n)
                    .prop_map(move |v| v.into_iter().map(|x| x + shift).collect::<Vec<_>>()),
                proptest::collection::vec(-2.0f32..2.0, d),
                proptest::collection::vec(-1.0f32..1.0, d).prop_map(move |b| {
                    if with_bias {
                        Some(b)
                    } else {
                        None
                    }
                }),
                proptest::collection::vec(-1.0f32..1.0, n),
            )
        })
        .prop_map(|((kind, rows, d, eps), x, w, b, dy)| Case {
            kind,
            rows,
            d,
            eps,
            x,
            w,
            b,
            dy,
        })
}

fn spec(c: &Case) -> NormSpec {
    NormSpec {
        kind: c.kind,
        rows: c.rows,
        d: c.d,
        eps: c.eps,
        launch: Default::default(),
    }
}

/// CPU forward into T; checks stats and y against f64.
fn check_forward<T: FloatElement>(c: &Case) -> Result<(), TestCaseError> {
    let dev = Device::cpu();
    let (xt, wt) = (to_t::<T>(&c.x), to_t::<T>(&c.w));
    let bt = c.b.as_ref().map(|b| to_t::<T>(b));
    let x = dev.upload(&xt).unwrap();
    let w = dev.upload(&wt).unwrap();
    let b = bt.as_ref().map(|b| dev.upload(b).unwrap());
    let mut stats = NormStats::new(&dev, c.rows).unwrap();
    let mut y: Buffer<T> = dev.zeros(c.rows * c.d).unwrap();
    norm_forward(&spec(c), &x, &w, b.as_ref(), &mut stats, &mut y).unwrap();
    let (mean, rstd, y) = (
        stats.mean.to_vec().unwrap(),
        stats.rstd.to_vec().unwrap(),
        y.to_vec().unwrap(),
    );
    let (w64, b64) = (widen(&wt), bt.as_ref().map(|b| widen(b)));
    for r in 0..c.rows {
        let x64 = widen(&xt[r * c.d..(r + 1) * c.d]);
        let (m, rs, yr) = ref_row(c.kind, &x64, &w64, b64.as_deref(), c.eps as f64);
        let mabs = x64.iter().map(|v| v.abs()).sum::<f64>() / c.d as f64;
        prop_assert!(
            (mean[r] as f64 - m).abs() <= 1e-6 * mabs + 1e-30,
            "mean {} vs {m}",
            mean[r]
        );
        prop_assert!(
            (rstd[r] as f64 - rs).abs() <= 1e-5 * rs,
            "rstd {} vs {rs}",
            rstd[r]
        );
        for i in 0..c.d {
            let xh = (x64[i] - m) * rs;
            let scale = (xh * w64[i]).abs() + b64.as_ref().map_or(0.0, |b| b[i].abs());
            let got = y[r * c.d + i].to_f32() as f64;
            // The mean's own rounding (relative to the mean |x|) shifts every xhat by that much times rstd.
            let tol = ulp::<T>() * yr[i].abs() + 2e-5 * scale + 4e-6 * rs * w64[i].abs() * mabs;
            prop_assert!(
                (got - yr[i]).abs() <= tol,
                "row {r} col {i}: y {got} vs {}",
                yr[i]
            );
        }
    }
    Ok(())
}

/// CPU backward; checks dx, dweight, dbias against f64, and the accumulation modes exactly.
fn check_backward<T: FloatElement, G: FloatElement>(c: &Case) -> Result<(), TestCaseError> {
    let dev = Device::cpu();
    let s = spec(c);
    let (xt, wt, gt) = (to_t::<T>(&c.x), to_t::<T>(&c.w), to_t::<G>(&c.dy));
    let x = dev.upload(&xt).unwrap();
    let w = dev.upload(&wt).unwrap();
    let dy = dev.upload(&gt).unwrap();
    let mut stats = NormStats::new(&dev, c.rows).unwrap();
    let mut y: Buffer<T> = dev.zeros(c.rows * c.d).unwrap();
    norm_forward(&s, &x, &w, None, &mut stats, &mut y).unwrap();
    let mut dx: Buffer<G> = dev.zeros(c.rows * c.d).unwrap();
    let mut dw = dev.upload(&vec![f32::NAN; c.d]).unwrap();
    let mut db = dev.upload(&vec![f32::NAN; c.d]).unwrap();
    let backward =
        |mode, dx: &mut Buffer<G>, dw: &mut Buffer<f32>, db: Option<&mut Buffer<f32>>| {
            norm_backward(&s, &x, &w, &stats, &dy, norm_grads(mode, dx, dw, db)).unwrap()
        };
    backward(GradMode::Overwrite, &mut dx, &mut dw, Some(&mut db));
    let (dxv, dwv, dbv) = grads_to_host(&dx, &dw, &db);
    let w64 = widen(&wt);
    let mut dw_ref = vec![0.0f64; c.d];
    let mut dw_tol = vec![0.0f64; c.d];
    let mut db_ref = vec![0.0f64; c.d];
    let mut db_abs = vec![0.0f64; c.d];
    for r in 0..c.rows {
        let x64 = widen(&xt[r * c.d..(r + 1) * c.d]);
        let g64 = widen(&gt[r * c.d..(r + 1) * c.d]);
        let (dxr, xh) = ref_row_backward(c.kind, &x64, &w64, &g64, c.eps as f64);
        let (_, rs, _) = ref_row(c.kind, &x64, &w64, None, c.eps as f64);
        let d = c.d as f64;
        let gw: Vec<f64> = g64.iter().zip(&w64).map(|(a, b)| (a * b).abs()).collect();
        let mean_g = gw.iter().sum::<f64>() / d;
        let mean_gx = gw.iter().zip(&xh).map(|(a, b)| a * b.abs()).sum::<f64>() / d;
        // The f32 mean's rounding (relative to the mean |x|) shifts every xhat by up to delta.
        let mabs = x64.iter().map(|v| v.abs()).sum::<f64>() / d;
        let delta = 4e-6 * rs * mabs;
        for i in 0..c.d {
            let scale = rs * (gw[i] + mean_g + xh[i].abs() * mean_gx);
            let got = dxv[r * c.d + i].to_f32() as f64;
            let tol = ulp::<G>() * dxr[i].abs()
                + 1e-4 * scale
                + rs * delta * (2.0 * mean_g + 2.0 * xh[i].abs() * mean_g)
                + 1e-30;
            prop_assert!(
                (got - dxr[i]).abs() <= tol,
                "dx row {r} col {i}: {got} vs {} (tol {tol})",
                dxr[i]
            );
            dw_ref[i] += g64[i] * xh[i];
            dw_tol[i] += 1e-4 * (g64[i] * xh[i]).abs() + g64[i].abs() * delta;
            db_ref[i] += g64[i];
            db_abs[i] += g64[i].abs();
        }
    }
    for i in 0..c.d {
        prop_assert!(
            (dwv[i] as f64 - dw_ref[i]).abs() <= dw_tol[i] + 1e-30,
            "dw {i}: {} vs {}",
            dwv[i],
            dw_ref[i]
        );
        prop_assert!(
            (dbv[i] as f64 - db_ref[i]).abs() <= 1e-5 * db_abs[i] + 1e-30,
            "db {i}: {} vs {}",
            dbv[i],
            db_ref[i]
        );
    }

    // Accumulation: parameters exactly old + new (f32); dx exactly G(old + new) where new is checked by the
    // f32 path below (with G = f32 that is old + the overwritten value).
    let old_dx: Vec<f32> = (0..c.rows * c.d).map(|i| (i % 7) as f32 - 3.0).collect();
    let old_p: Vec<f32> = (0..c.d).map(|i| (i % 5) as f32 * 0.25).collect();
    let mut dx2: Buffer<G> = dev.upload(&to_t::<G>(&old_dx)).unwrap();
    let mut dw2 = dev.upload(&old_p).unwrap();
    let mut db2 = dev.upload(&old_p).unwrap();
    backward(GradMode::Accumulate, &mut dx2, &mut dw2, Some(&mut db2));
    let (dx2, dw2, db2) = grads_to_host(&dx2, &dw2, &db2);
    for i in 0..c.d {
        prop_assert_eq!(dw2[i].to_bits(), (old_p[i] + dwv[i]).to_bits());
        prop_assert_eq!(db2[i].to_bits(), (old_p[i] + dbv[i]).to_bits());
    }
    if G::DTYPE == fp8_kernels::DType::F32 {
        for i in 0..c.rows * c.d {
            let want = G::from_f32(old_dx[i] + dxv[i].to_f32());
            prop_assert_eq!(dx2[i].to_f32().to_bits(), want.to_f32().to_bits());
        }
    } else {
        for i in 0..c.rows * c.d {
            let want = old_dx[i] + dxv[i].to_f32();
            let got = dx2[i].to_f32();
            let tol = 2.0 * ulp::<G>() as f32 * (want.abs() + dxv[i].to_f32().abs() + 1e-6);
            prop_assert!((got - want).abs() <= tol, "accumulated dx {got} vs {want}");
        }
    }
    Ok(())
}

/// The fused FP8 forward equals the unfused forward + cast_transpose_to_fp8, and fp8-core's encoder.
fn check_fp8<T: FloatElement>(c: &Case, scale: f32) -> Result<(), TestCaseError> {
    let dev = Device::cpu();
    let s = spec(c);
    let n = c.rows * c.d;
    let x = dev.upload(&to_t::<T>(&c.x)).unwrap();
    let w = dev.upload(&to_t::<T>(&c.w)).unwrap();
    let b = c.b.as_ref().map(|b| dev.upload(&to_t::<T>(b)).unwrap());
    let sc = dev.upload(&[scale]).unwrap();
    let mut st1 = NormStats::new(&dev, c.rows).unwrap();
    let mut st2 = NormStats::new(&dev, c.rows).unwrap();
    let (mut q, mut qt) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let mut amax = dev.upload(&[0.5f32, 0.0]).unwrap();
    norm_forward_fp8(
        &s,
        &x,
        &w,
        b.as_ref(),
        &mut st1,
        Fp8NormOutput {
            format: Fp8Format::E4M3,
            scale: &sc,
            codes: Some(&mut q),
            codes_t: Some(&mut qt),
            amax: Some(AmaxSlot::new(&mut amax, 1)),
        },
    )
    .unwrap();
    let mut y: Buffer<T> = dev.zeros(n).unwrap();
    norm_forward(&s, &x, &w, b.as_ref(), &mut st2, &mut y).unwrap();
    let (mut q2, mut qt2) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let mut amax2 = dev.upload(&[0.5f32, 0.0]).unwrap();
    cast_transpose_to_fp8(
        &y,
        [c.rows, c.d],
        Fp8Format::E4M3,
        &sc,
        &mut qt2,
        Some(&mut q2),
        Some(AmaxSlot::new(&mut amax2, 1)),
    )
    .unwrap();
    prop_assert_eq!(q.to_vec().unwrap(), q2.to_vec().unwrap());
    prop_assert_eq!(qt.to_vec().unwrap(), qt2.to_vec().unwrap());
    prop_assert_eq!(
        amax.to_vec().unwrap()[1].to_bits(),
        amax2.to_vec().unwrap()[1].to_bits()
    );
    prop_assert_eq!(amax.to_vec().unwrap()[0], 0.5);
    prop_assert_eq!(st1.mean.to_vec().unwrap(), st2.mean.to_vec().unwrap());
    prop_assert_eq!(st1.rstd.to_vec().unwrap(), st2.rstd.to_vec().unwrap());
    // The codes are fp8-core's saturating round-to-nearest-even encoding of T(y) * scale.
    let h: Vec<f32> = y.to_vec().unwrap().iter().map(|v| v.to_f32()).collect();
    let mut want = vec![0u8; n];
    Fp8Format::E4M3.encode_scaled(&h, scale, &mut want).unwrap();
    let qv = q.to_vec().unwrap();
    prop_assert_eq!(&qv, &want);
    let qtv = qt.to_vec().unwrap();
    for r in 0..c.rows {
        for i in 0..c.d {
            prop_assert_eq!(qtv[i * c.rows + r], want[r * c.d + i]);
        }
    }
    let a = h.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    prop_assert_eq!(amax.to_vec().unwrap()[1], a);
    // Either layout alone: the same codes, amax and statistics, the other buffer untouched.
    let rest = (a.to_bits(), st1.rstd.to_vec().unwrap());
    assert_each_layout_alone(&dev, &qv, &qtv, &rest, "norm", |codes, codes_t| {
        let mut st3 = NormStats::new(&dev, c.rows).unwrap();
        let mut amax3 = dev.upload(&[0.0f32]).unwrap();
        norm_forward_fp8(
            &s,
            &x,
            &w,
            b.as_ref(),
            &mut st3,
            Fp8NormOutput {
                format: Fp8Format::E4M3,
                scale: &sc,
                codes,
                codes_t,
                amax: Some(AmaxSlot::first(&mut amax3)),
            },
        )
        .unwrap();
        (
            amax3.to_vec().unwrap()[0].to_bits(),
            st3.rstd.to_vec().unwrap(),
        )
    });
    Ok(())
}

proptest! {
    #[test]
    fn forward_matches_f64(c in case(6, 700)) {
        check_forward::<f32>(&c)?;
        check_forward::<bf16>(&c)?;
    }

    #[test]
    fn backward_matches_f64(c in case(40, 300)) {
        check_backward::<f32, f32>(&c)?;
        check_backward::<bf16, bf16>(&c)?;
        check_backward::<f32, bf16>(&c)?;
        check_backward::<bf16, f32>(&c)?;
    }

    #[test]
    fn fp8_output_is_the_unfused_cast(
        c in case(40, 200),
        scale in prop_oneof![(-6i32..12).prop_map(|e| 2f32.powi(e)), 0.01f32..500.0],
    ) {
        check_fp8::<f32>(&c, scale)?;
        check_fp8::<bf16>(&c, scale)?;
    }
}

/// The statistics of the f32 forward of `x` on `dev` (its output dropped).
fn forward_stats(
    dev: &Device,
    s: &NormSpec,
    x: &Buffer<f32>,
    w: &Buffer<f32>,
    b: Option<&Buffer<f32>>,
) -> NormStats {
    let mut stats = NormStats::new(dev, s.rows).unwrap();
    let mut y = dev.zeros::<f32>(s.rows * s.d).unwrap();
    norm_forward(s, x, w, b, &mut stats, &mut y).unwrap();
    stats
}

/// Central differences of the f64 forward against the (f32) backward, for `L = sum(y * c)`.
fn finite_difference_check(kind: NormKind, rows: usize, d: usize, seed: u64) {
    let mut rng = fp8_kernels::rng::SplitMix64::new(seed);
    let x: Vec<f32> = (0..rows * d)
        .map(|_| rng.uniform_f32() * 2.0 + 0.3)
        .collect();
    let w: Vec<f32> = (0..d).map(|_| rng.uniform_f32() + 1.0).collect();
    let b: Vec<f32> = (0..d).map(|_| rng.uniform_f32()).collect();
    let cw: Vec<f32> = (0..rows * d).map(|_| rng.uniform_f32()).collect();
    let eps = 1e-5;
    let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
        let mut l = 0.0;
        for r in 0..rows {
            let (_, _, y) = ref_row(kind, &x[r * d..(r + 1) * d], w, Some(b), eps);
            l += y
                .iter()
                .zip(&cw[r * d..(r + 1) * d])
                .map(|(a, c)| a * *c as f64)
                .sum::<f64>();
        }
        l
    };
    let (x64, w64, b64) = (
        x.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        w.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        b.iter().map(|&v| v as f64).collect::<Vec<_>>(),
    );
    let dev = Device::cpu();
    let s = NormSpec {
        kind,
        rows,
        d,
        eps: eps as f32,
        launch: Default::default(),
    };
    let (xb, wb, bb) = (
        dev.upload(&x).unwrap(),
        dev.upload(&w).unwrap(),
        dev.upload(&b).unwrap(),
    );
    let stats = forward_stats(&dev, &s, &xb, &wb, Some(&bb));
    let dy = dev.upload(&cw).unwrap();
    let mut dx = dev.zeros::<f32>(rows * d).unwrap();
    let mut dw = dev.zeros::<f32>(d).unwrap();
    let mut db = dev.zeros::<f32>(d).unwrap();
    norm_backward(
        &s,
        &xb,
        &wb,
        &stats,
        &dy,
        norm_grads(GradMode::Overwrite, &mut dx, &mut dw, Some(&mut db)),
    )
    .unwrap();
    let (dx, dw, db) = grads_to_host(&dx, &dw, &db);
    let h = 1e-5;
    let fd = |which: usize, i: usize| -> f64 {
        let (mut xp, mut wp, mut bp) = (x64.clone(), w64.clone(), b64.clone());
        let (mut xm, mut wm, mut bm) = (x64.clone(), w64.clone(), b64.clone());
        match which {
            0 => {
                xp[i] += h;
                xm[i] -= h;
            }
            1 => {
                wp[i] += h;
                wm[i] -= h;
            }
            _ => {
                bp[i] += h;
                bm[i] -= h;
            }
        }
        (loss(&xp, &wp, &bp) - loss(&xm, &wm, &bm)) / (2.0 * h)
    };
    let close = |got: f32, want: f64, what: &str| {
        assert!(
            (got as f64 - want).abs() <= 1e-3 * want.abs().max(0.05),
            "{kind:?} {what}: backward {got} vs finite difference {want}"
        );
    };
    for (i, &g) in dx.iter().enumerate() {
        close(g, fd(0, i), &format!("dx[{i}]"));
    }
    for i in 0..d {
        close(dw[i], fd(1, i), &format!("dw[{i}]"));
        close(db[i], fd(2, i), &format!("db[{i}]"));
    }
}

#[test]
fn backward_matches_finite_differences() {
    finite_difference_check(NormKind::LayerNorm, 3, 19, 1);
    finite_difference_check(NormKind::RmsNorm, 3, 19, 2);
    finite_difference_check(NormKind::LayerNorm, 2, 300, 3);
    finite_difference_check(NormKind::RmsNorm, 2, 300, 4);
}

#[test]
fn parameter_order_is_a_function_of_rows() {
    use fp8_kernels::layer_norm::{param_order, ParamOrder, MAX_PARAM_CHUNKS, TILE_CHUNKS};
    let at = |rows| {
        let o: ParamOrder = param_order(rows);
        (o.chunk_rows, o.chunks, o.tiles, o.run, o.runs)
    };
    assert_eq!(at(0), (1, 1, 1, 1, 1));
    assert_eq!(at(1), (1, 1, 1, 1, 1));
    assert_eq!(at(8), (1, 8, 1, 1, 1));
    assert_eq!(at(9), (1, 9, 2, 1, 2));
    assert_eq!(at(2048), (1, 2048, 256, 8, 32));
    assert_eq!(at(2049), (2, 1025, 129, 5, 26));
    assert_eq!(at(16_384), (8, 2048, 256, 8, 32));
    assert_eq!(at(8192), (4, 2048, 256, 8, 32));
    assert_eq!(at(1061), (1, 1061, 133, 5, 27));
    for rows in (0..70_000).step_by(997) {
        let o = param_order(rows);
        assert!(
            o.chunks <= MAX_PARAM_CHUNKS && o.chunks * o.chunk_rows >= rows,
            "{rows}: {o:?}"
        );
        assert!((o.chunks - 1) * o.chunk_rows < rows.max(1), "{rows}: {o:?}");
        assert_eq!(o.tiles, o.chunks.div_ceil(TILE_CHUNKS));
        assert!(o.runs <= 32 && o.run * o.runs >= o.tiles && (o.runs - 1) * o.run < o.tiles);
    }
}

#[test]
fn parameter_sums_use_four_levels_on_tall_inputs() {
    // 4133 rows: chunks of 3 rows (the last of 2), 1378 chunks in 173 tiles of 8 (the last of 2 chunks),
    // 29 runs of 6 tiles (the last of 5), so every level runs and every last piece is short; compare with
    // the documented order computed here directly, for both norms (RMSNorm's xhat does not read the mean).
    use fp8_kernels::layer_norm::{param_order, TILE_CHUNKS};
    let (rows, d) = (4133, 24);
    let mut rng = fp8_kernels::rng::SplitMix64::new(9);
    let x: Vec<f32> = (0..rows * d).map(|_| rng.uniform_f32() * 4.0).collect();
    let g: Vec<f32> = (0..rows * d).map(|_| rng.uniform_f32()).collect();
    let w = vec![1.0f32; d];
    let dev = Device::cpu();
    let order = param_order(rows);
    assert_eq!(
        (
            order.chunk_rows,
            order.chunks,
            order.tiles,
            order.run,
            order.runs
        ),
        (3, 1378, 173, 6, 29)
    );
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        let s = NormSpec {
            kind,
            ..NormSpec::layer_norm(rows, d)
        };
        let (xb, wb, gb) = (
            dev.upload(&x).unwrap(),
            dev.upload(&w).unwrap(),
            dev.upload(&g).unwrap(),
        );
        let stats = forward_stats(&dev, &s, &xb, &wb, None);
        let mut dx = dev.zeros::<f32>(rows * d).unwrap();
        let mut dw = dev.zeros::<f32>(d).unwrap();
        let mut db = dev.zeros::<f32>(d).unwrap();
        norm_backward(
            &s,
            &xb,
            &wb,
            &stats,
            &gb,
            norm_grads(GradMode::Overwrite, &mut dx, &mut dw, Some(&mut db)),
        )
        .unwrap();
        let (mean, rstd) = (stats.mean.to_vec().unwrap(), stats.rstd.to_vec().unwrap());
        let xhat = |at: usize, r: usize| match kind {
            NormKind::LayerNorm => (x[at] - mean[r]) * rstd[r],
            NormKind::RmsNorm => x[at] * rstd[r],
        };
        let (dw, db) = (dw.to_vec().unwrap(), db.to_vec().unwrap());
        let mut differs_from_one_chain = 0;
        for c in 0..d {
            let (mut total, mut total_b, mut plain) = (0.0f32, 0.0f32, 0.0f32);
            for ri in 0..order.runs {
                let (t0, t1) = (ri * order.run, ((ri + 1) * order.run).min(order.tiles));
                let (mut run, mut run_b) = (0.0f32, 0.0f32);
                for t in t0..t1 {
                    let (k0, k1) = (t * TILE_CHUNKS, ((t + 1) * TILE_CHUNKS).min(order.chunks));
                    let (mut tile, mut tile_b) = (0.0f32, 0.0f32);
                    for k in k0..k1 {
                        let (mut p, mut pb) = (0.0f32, 0.0f32);
                        let r1 = ((k + 1) * order.chunk_rows).min(rows);
                        for r in k * order.chunk_rows..r1 {
                            let at = r * d + c;
                            let v = g[at] * xhat(at, r);
                            p += v;
                            pb += g[at];
                            plain += v;
                        }
                        tile = if k == k0 { p } else { tile + p };
                        tile_b = if k == k0 { pb } else { tile_b + pb };
                    }
                    run = if t == t0 { tile } else { run + tile };
                    run_b = if t == t0 { tile_b } else { run_b + tile_b };
                }
                total = if ri == 0 { run } else { total + run };
                total_b = if ri == 0 { run_b } else { total_b + run_b };
            }
            assert_eq!(dw[c].to_bits(), total.to_bits(), "{kind:?} dw column {c}");
            assert_eq!(db[c].to_bits(), total_b.to_bits(), "{kind:?} db column {c}");
            differs_from_one_chain += usize::from(plain.to_bits() != total.to_bits());
        }
        // The levels change the rounding: a single chain over the rows would differ somewhere.
        assert!(differs_from_one_chain > 0);
    }
}

#[test]
fn invalid_arguments_are_errors() {
    let dev = Device::cpu();
    let x = dev.upload(&[1.0f32; 12]).unwrap();
    let w = dev.upload(&[1.0f32; 4]).unwrap();
    let mut stats = NormStats::new(&dev, 3).unwrap();
    let mut y = dev.zeros::<f32>(12).unwrap();
    let ok = NormSpec::layer_norm(3, 4);
    assert!(norm_forward(&ok, &x, &w, None, &mut stats, &mut y).is_ok());
    for bad in [
        NormSpec::layer_norm(3, 0),
        NormSpec::layer_norm(4, 4),
        ok.with_eps(f32::NAN),
        ok.with_eps(-1.0),
    ] {
        assert!(norm_forward(&bad, &x, &w, None, &mut stats, &mut y).is_err());
    }
    let w5 = dev.upload(&[1.0f32; 5]).unwrap();
    assert!(norm_forward(&ok, &x, &w5, None, &mut stats, &mut y).is_err());
    let mut short_stats = NormStats::new(&dev, 2).unwrap();
    assert!(norm_forward(&ok, &x, &w, None, &mut short_stats, &mut y).is_err());
    let xh = dev.upload(&[f16::ONE; 12]).unwrap();
    let wh = dev.upload(&[f16::ONE; 4]).unwrap();
    let mut yh = dev.zeros::<f16>(12).unwrap();
    assert!(norm_forward(&ok, &xh, &wh, None, &mut stats, &mut yh).is_err());
    let sc = dev.upload(&[1.0f32]).unwrap();
    let (mut q, mut qt) = (dev.zeros::<u8>(12).unwrap(), dev.zeros::<u8>(12).unwrap());
    let e5 = Fp8NormOutput {
        format: Fp8Format::E5M2,
        scale: &sc,
        codes: Some(&mut q),
        codes_t: Some(&mut qt),
        amax: None,
    };
    assert!(norm_forward_fp8(&ok, &x, &w, None, &mut stats, e5).is_err());
    let mut amax = dev.zeros::<f32>(1).unwrap();
    let out_of_range_slot = Fp8NormOutput {
        format: Fp8Format::E4M3,
        scale: &sc,
        codes: Some(&mut q),
        codes_t: Some(&mut qt),
        amax: Some(AmaxSlot::new(&mut amax, 1)),
    };
    assert!(norm_forward_fp8(&ok, &x, &w, None, &mut stats, out_of_range_slot).is_err());
    let neither = Fp8NormOutput {
        format: Fp8Format::E4M3,
        scale: &sc,
        codes: None,
        codes_t: None,
        amax: None,
    };
    assert!(norm_forward_fp8(&ok, &x, &w, None, &mut stats, neither).is_err());
    let mut dx = dev.zeros::<f32>(11).unwrap();
    let mut dw = dev.zeros::<f32>(4).unwrap();
    let grads = norm_grads(GradMode::Overwrite, &mut dx, &mut dw, None);
    assert!(norm_backward(&ok, &x, &w, &stats, &x, grads).is_err());
}

#[test]
fn the_mean_of_offset_rows_is_correctly_rounded() {
    // Rows of bf16 values around 40 (a residual stream with a large offset): bf16 values there are
    // multiples of 1/4, so the f32 sum of 768 of them is exact and only the division rounds: the mean is
    // within half an ulp of the exact (f64) one. (Outputs near zero in such rows still carry that half
    // ulp of `x - mean`, as PyTorch's do: check_layers_vs_torch reports them in BF16 steps.)
    let (rows, d) = (256, 768);
    let mut rng = fp8_kernels::rng::SplitMix64::new(21);
    let x: Vec<bf16> = (0..rows * d)
        .map(|_| bf16::from_f32(40.0 + rng.uniform_f32() * 3.0))
        .collect();
    let w = vec![bf16::ONE; d];
    let dev = Device::cpu();
    let (xb, wb) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let mut stats = NormStats::new(&dev, rows).unwrap();
    let mut y = dev.zeros::<bf16>(rows * d).unwrap();
    norm_forward(
        &NormSpec::layer_norm(rows, d),
        &xb,
        &wb,
        None,
        &mut stats,
        &mut y,
    )
    .unwrap();
    let mean = stats.mean.to_vec().unwrap();
    let ulp = f64::from(f32::EPSILON) * 32.0; // the ulp of values in [32, 64)
    for (r, &m) in mean.iter().enumerate() {
        let exact = x[r * d..(r + 1) * d]
            .iter()
            .map(|v| f64::from(v.to_f32()))
            .sum::<f64>()
            / d as f64;
        let off = (f64::from(m) - exact).abs() / ulp;
        assert!(off <= 0.5, "row {r}: mean off by {off} ulp");
    }
}
