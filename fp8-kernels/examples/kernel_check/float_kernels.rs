//! The float kernels' part of `kernel_check`: element-wise kernels, reductions, the batched transpose
//! (f32 and bf16), and softmax + NLL, im2col/col2im and pooling (f32), each on random inputs on the CPU
//! and the GPU, compared as `main.rs` describes.

use crate::{narrow, up, widen, Report, Rng};
use fp8_kernels::conv::{self, Conv2dGeometry};
use fp8_kernels::elementwise::{self, Dropout, GeluApprox};
use fp8_kernels::pool::{self, Pool2dGeometry};
use fp8_kernels::reduce;
use fp8_kernels::softmax::{self, nll_stat};
use fp8_kernels::{Device, FloatElement, KernelError};

pub(crate) fn ops_checks<T: FloatElement>(
    rep: &mut Report,
    rng: &mut Rng,
    cpu: &Device,
    gpu: &Device,
) -> Result<(), KernelError> {
    let t = T::NAME;
    let (rows, cols) = (517usize, 300usize);
    let n = rows * cols;
    let x: Vec<T> = narrow(&(0..n).map(|_| rng.sym(6.0)).collect::<Vec<_>>());
    let dy: Vec<T> = narrow(&(0..n).map(|_| rng.sym(2.0)).collect::<Vec<_>>());
    let bias: Vec<T> = narrow(&(0..cols).map(|_| rng.sym(1.0)).collect::<Vec<_>>());
    let (xc, xg) = (up(cpu, &x)?, up(gpu, &x)?);
    let (gc, gg) = (up(cpu, &dy)?, up(gpu, &dy)?);

    let (mut bc, mut bg) = (up(cpu, &x)?, up(gpu, &x)?);
    elementwise::bias_add(&mut bc, &up(cpu, &bias)?, rows, cols)?;
    elementwise::bias_add(&mut bg, &up(gpu, &bias)?, rows, cols)?;
    rep.exact_buffers(&format!("bias_add {t} {rows}x{cols}"), &bc, &bg)?;

    let (mut sc, mut sg) = (cpu.zeros::<f32>(cols)?, gpu.zeros::<f32>(cols)?);
    reduce::sum_over_rows(&xc, rows, cols, &mut sc)?;
    reduce::sum_over_rows(&xg, rows, cols, &mut sg)?;
    rep.exact_f32(
        &format!("sum_over_rows (bias grad) {t} {rows}x{cols}"),
        &sc.to_vec()?,
        &sg.to_vec()?,
    );
    // One chunk (<= 64 rows) and the conv bias-gradient shapes of the MNIST net (tall, few columns).
    for (r, c) in [(40usize, 300usize), (43_264, 32), (36_864, 64)] {
        let v: Vec<T> = narrow(&(0..r * c).map(|_| rng.sym(2.0)).collect::<Vec<_>>());
        let (mut sc, mut sg) = (cpu.zeros::<f32>(c)?, gpu.zeros::<f32>(c)?);
        reduce::sum_over_rows(&up(cpu, &v)?, r, c, &mut sc)?;
        reduce::sum_over_rows(&up(gpu, &v)?, r, c, &mut sg)?;
        rep.exact_f32(
            &format!("sum_over_rows (bias grad) {t} {r}x{c}"),
            &sc.to_vec()?,
            &sg.to_vec()?,
        );
    }
    let (mut sc, mut sg) = (cpu.zeros::<f32>(rows)?, gpu.zeros::<f32>(rows)?);
    reduce::sum_over_cols(&xc, rows, cols, &mut sc)?;
    reduce::sum_over_cols(&xg, rows, cols, &mut sg)?;
    rep.exact_f32(&format!("sum_over_cols {t}"), &sc.to_vec()?, &sg.to_vec()?);

    let (mut yc, mut yg) = (cpu.zeros::<T>(n)?, gpu.zeros::<T>(n)?);
    elementwise::relu_forward(&xc, &mut yc)?;
    elementwise::relu_forward(&xg, &mut yg)?;
    rep.exact_buffers(&format!("relu_forward {t}"), &yc, &yg)?;
    elementwise::relu_backward(&xc, &gc, &mut yc)?;
    elementwise::relu_backward(&xg, &gg, &mut yg)?;
    rep.exact_buffers(&format!("relu_backward {t}"), &yc, &yg)?;

    // bf16 outputs round the f32 result once: one bf16 ulp (2^-8 relative) covers a last-bit f32
    // difference that crosses a rounding boundary.
    let bound = if t == "f32" { 1e-5 } else { 8e-3 };
    for approx in [GeluApprox::Tanh, GeluApprox::Erf] {
        elementwise::gelu_forward(&xc, &mut yc, approx)?;
        elementwise::gelu_forward(&xg, &mut yg, approx)?;
        rep.close_f32(
            &format!("gelu_forward {approx:?} {t}"),
            &widen(&yc.to_vec()?),
            &widen(&yg.to_vec()?),
            bound,
        );
        elementwise::gelu_backward(&xc, &gc, &mut yc, approx)?;
        elementwise::gelu_backward(&xg, &gg, &mut yg, approx)?;
        rep.close_f32(
            &format!("gelu_backward {approx:?} {t}"),
            &widen(&yc.to_vec()?),
            &widen(&yg.to_vec()?),
            bound,
        );
    }

    let params = Dropout {
        p: 0.1 + rng.unit() * 0.5,
        seed: rng.next(),
        offset: rng.below(1 << 40),
    };
    let (mut mc, mut mg) = (cpu.zeros::<u8>(n)?, gpu.zeros::<u8>(n)?);
    elementwise::dropout_forward(&xc, params, &mut yc, &mut mc)?;
    elementwise::dropout_forward(&xg, params, &mut yg, &mut mg)?;
    let mask = mc.to_vec()?;
    rep.exact_u8(
        &format!("dropout mask p={:.3} {t}", params.p),
        &mask,
        &mg.to_vec()?,
    );
    let kept = mask.iter().filter(|&&m| m == 1).count() as f64 / n as f64;
    let expect = 1.0 - params.p as f64;
    rep.line(
        "dropout keep fraction vs 1-p",
        n,
        (kept - expect).abs(),
        0.0,
        "|diff| <= 0.01",
        (kept - expect).abs() <= 0.01,
    );
    rep.exact_buffers(&format!("dropout_forward {t}"), &yc, &yg)?;
    elementwise::dropout_backward(&gc, &mc, params, &mut yc)?;
    elementwise::dropout_backward(&gg, &mg, params, &mut yg)?;
    rep.exact_buffers(&format!("dropout_backward {t}"), &yc, &yg)?;

    let a = rng.sym(3.0);
    let (mut pc, mut pg) = (up(cpu, &x)?, up(gpu, &x)?);
    elementwise::scale(&mut pc, a)?;
    elementwise::scale(&mut pg, a)?;
    rep.exact_buffers(&format!("scale {t}"), &pc, &pg)?;
    elementwise::axpy(a, &gc, &mut pc)?;
    elementwise::axpy(a, &gg, &mut pg)?;
    rep.exact_buffers(&format!("axpy {t}"), &pc, &pg)?;
    elementwise::add(&xc, &gc, &mut yc)?;
    elementwise::add(&xg, &gg, &mut yg)?;
    rep.exact_buffers(&format!("add (residual) {t}"), &yc, &yg)?;
    conv::transpose_batched(&xc, [11, 47, 300], &mut yc)?;
    conv::transpose_batched(&xg, [11, 47, 300], &mut yg)?;
    rep.exact_buffers(&format!("transpose_batched {t}"), &yc, &yg)?;
    Ok(())
}

pub(crate) fn f32_only_ops(
    rep: &mut Report,
    rng: &mut Rng,
    cpu: &Device,
    gpu: &Device,
) -> Result<(), KernelError> {
    // log-softmax + NLL
    for (rows, classes) in [(64usize, 10usize), (1000, 1000)] {
        let x: Vec<f32> = (0..rows * classes).map(|_| rng.sym(8.0)).collect();
        let labels: Vec<i32> = (0..rows)
            .map(|_| rng.below(classes as u64) as i32)
            .collect();
        let (lc, lg) = (up(cpu, &labels)?, up(gpu, &labels)?);
        let (mut pc, mut pg) = (cpu.zeros::<f32>(x.len())?, gpu.zeros::<f32>(x.len())?);
        let (mut sc, mut sg) = (
            cpu.zeros::<f32>(nll_stat::LEN)?,
            gpu.zeros::<f32>(nll_stat::LEN)?,
        );
        softmax::log_softmax_nll_forward(&up(cpu, &x)?, &lc, rows, classes, &mut pc, &mut sc)?;
        softmax::log_softmax_nll_forward(&up(gpu, &x)?, &lg, rows, classes, &mut pg, &mut sg)?;
        rep.close_f32(
            &format!("log_softmax {rows}x{classes}"),
            &pc.to_vec()?,
            &pg.to_vec()?,
            2e-6,
        );
        let (s1, s2) = (sc.to_vec()?, sg.to_vec()?);
        rep.close_f32("nll mean loss", &s1[..1], &s2[..1], 1e-5);
        rep.exact_f32("nll correct count / invalid labels", &s1[1..], &s2[1..]);
        let (mut dc, mut dg) = (cpu.zeros::<f32>(x.len())?, gpu.zeros::<f32>(x.len())?);
        softmax::log_softmax_nll_backward(&pc, &lc, rows, classes, &mut dc)?;
        softmax::log_softmax_nll_backward(&pg, &lg, rows, classes, &mut dg)?;
        rep.close_f32(
            &format!("log_softmax_nll_backward {rows}x{classes}"),
            &dc.to_vec()?,
            &dg.to_vec()?,
            1e-6,
        );
    }
    // im2col / col2im (MNIST conv shapes and a strided, padded one)
    for g in [
        Conv2dGeometry {
            batch: 64,
            channels: 1,
            height: 28,
            width: 28,
            kernel_h: 3,
            kernel_w: 3,
            stride: 1,
            padding: 0,
        },
        Conv2dGeometry {
            batch: 64,
            channels: 32,
            height: 26,
            width: 26,
            kernel_h: 3,
            kernel_w: 3,
            stride: 1,
            padding: 0,
        },
        Conv2dGeometry {
            batch: 3,
            channels: 5,
            height: 17,
            width: 13,
            kernel_h: 5,
            kernel_w: 3,
            stride: 2,
            padding: 2,
        },
    ] {
        let x: Vec<f32> = (0..g.input_len()).map(|_| rng.sym(2.0)).collect();
        let m = g.patches() * g.patch_len();
        let (mut cc, mut cg) = (cpu.zeros::<f32>(m)?, gpu.zeros::<f32>(m)?);
        conv::im2col(&up(cpu, &x)?, &g, &mut cc)?;
        conv::im2col(&up(gpu, &x)?, &g, &mut cg)?;
        let name = format!(
            "im2col {}x{}x{}x{} k{}x{} s{} p{}",
            g.batch, g.channels, g.height, g.width, g.kernel_h, g.kernel_w, g.stride, g.padding
        );
        rep.exact_f32(&name, &cc.to_vec()?, &cg.to_vec()?);
        let d: Vec<f32> = (0..m).map(|_| rng.sym(1.0)).collect();
        let (mut xc, mut xg) = (cpu.zeros::<f32>(x.len())?, gpu.zeros::<f32>(x.len())?);
        conv::col2im(&up(cpu, &d)?, &g, &mut xc)?;
        conv::col2im(&up(gpu, &d)?, &g, &mut xg)?;
        rep.exact_f32(
            &name.replace("im2col", "col2im"),
            &xc.to_vec()?,
            &xg.to_vec()?,
        );
    }
    // max pool
    for g in [
        Pool2dGeometry::two_by_two(64, 64, 24, 24),
        Pool2dGeometry {
            batch: 2,
            channels: 3,
            height: 11,
            width: 9,
            kernel: 3,
            stride: 2,
        },
    ] {
        // rounded values so ties occur
        let x: Vec<f32> = (0..g.input_len())
            .map(|_| (rng.sym(4.0) * 4.0).round() / 4.0)
            .collect();
        let (mut yc, mut yg) = (
            cpu.zeros::<f32>(g.output_len())?,
            gpu.zeros::<f32>(g.output_len())?,
        );
        let (mut ic, mut ig) = (
            cpu.zeros::<u32>(g.output_len())?,
            gpu.zeros::<u32>(g.output_len())?,
        );
        pool::max_pool2d_forward(&up(cpu, &x)?, &g, &mut yc, &mut ic)?;
        pool::max_pool2d_forward(&up(gpu, &x)?, &g, &mut yg, &mut ig)?;
        let name = format!(
            "max_pool2d k{} s{} {}x{}x{}x{}",
            g.kernel, g.stride, g.batch, g.channels, g.height, g.width
        );
        rep.exact_f32(&name, &yc.to_vec()?, &yg.to_vec()?);
        let (i1, i2) = (ic.to_vec()?, ig.to_vec()?);
        rep.line(
            &format!("{name} indices"),
            i1.len(),
            0.0,
            0.0,
            "exact",
            i1 == i2,
        );
        let dy: Vec<f32> = (0..g.output_len()).map(|_| rng.sym(1.0)).collect();
        let (mut dc, mut dg) = (cpu.zeros::<f32>(x.len())?, gpu.zeros::<f32>(x.len())?);
        pool::max_pool2d_backward(&up(cpu, &dy)?, &ic, &mut dc)?;
        pool::max_pool2d_backward(&up(gpu, &dy)?, &ig, &mut dg)?;
        if g.stride >= g.kernel {
            rep.exact_f32(&format!("{name} backward"), &dc.to_vec()?, &dg.to_vec()?);
        } else {
            // overlapping windows: atomic adds in any order
            rep.close_f32(
                &format!("{name} backward (overlap)"),
                &dc.to_vec()?,
                &dg.to_vec()?,
                1e-6,
            );
        }
    }
    Ok(())
}
