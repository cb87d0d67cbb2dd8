//! GPU check of `fsdp_nn::Linear`: the same layer in a one-rank wrapped model on the CPU and on CUDA, fed
//! the same data, agrees — the weight cast on the device (an optimizer step with lr 0 re-quantizes the
//! unchanged master) and the saved E4M3 `x^T` bit for bit, `y` within the FP8 GEMM bound, `dx`,
//! accumulated `dW` and `db` within 1e-3 of their largest value, the delayed-scaling metas identical after
//! each update; the BF16 layer's output within the BF16 bound. Ignored unless run with `--ignored`
//! (needs a CUDA GPU). (Moved from fp8-kernels' `gemm_check`, where the layer state used to live.)
//!
//! The CUDA model runs on an NCCL communicator of world size 1 (`NcclComm::from_dist_env` with
//! `DistEnv::single()`, as the examples do without a launcher): `fsdp-comm` has no other single-rank
//! communicator on CUDA. Run on the GPU machine with the environment of `cuda-env.sh`.

mod common;

use common::{cpu_comm, cuda_comm, full_grad, grad_shards, values, TestResult};
use fp8_core::{Fp8Format, Fp8Recipe, ScaleRounding};
use fp8_kernels::block_quantize::{block_dequantize, BlockQuantLayout, BlockQuantSpec, ScaleOrder};
use fp8_kernels::{block_quantize, Device};
use fsdp_comm::Communicator;
use fsdp_nn::{Activation, Layer, Linear, LinearPrecision, Shape, Tensor};
use fsdp_optim::{step_model, AdamOptions, FsdpAdam, StatePrecision};
use fsdp_shard::{FsdpConfig, FsdpModel, GatheredParam, Mode, WrapPolicy};
use half::bf16;
use std::sync::Arc;

/// Relative error of an FP8 GEMM's f32 accumulation against `sum |a b|` (as the GEMM check uses).
const FP8_REL: f64 = 2.5e-4;

/// `max_i |gpu_i - cpu_i| / (rel * mag_i + out_i)`, where `out_i` allows one bf16 ulp of a bf16 output
/// (the two f32 accumulations may straddle a rounding boundary: at most 2^-7 of the value).
fn worst(gpu: &[f32], cpu: &[f32], mag: &[f64], rel: f64, bf16_out: bool) -> f64 {
    gpu.iter()
        .zip(cpu)
        .zip(mag)
        .map(|((&g, &c), &m)| {
            let extra = if bf16_out {
                (c as f64).abs() * 2f64.powi(-7)
            } else {
                0.0
            };
            (g as f64 - c as f64).abs() / (rel * m + extra + 1e-30)
        })
        .fold(0.0, f64::max)
}

/// `sum_k |a[t, k]| |b[o, k]| + |c[o]|`: the error scale of `y = a b^T + c`.
fn magnitude(a: &[f32], b: &[f32], c: &[f32], rows: usize, cols: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; rows * cols];
    for t in 0..rows {
        for o in 0..cols {
            let s: f64 = (0..k)
                .map(|i| (a[t * k + i] as f64 * b[o * k + i] as f64).abs())
                .sum();
            out[t * cols + o] = s + (c[o] as f64).abs();
        }
    }
    out
}

/// `max |gpu - cpu| / max |cpu|`.
fn rel_to_max(gpu: &[f32], cpu: &[f32]) -> f32 {
    let scale = cpu.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(1e-30);
    cpu.iter()
        .zip(gpu)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
        / scale
}

fn model<T: Activation>(
    comm: Arc<dyn Communicator>,
    inf: usize,
    outf: usize,
    precision: LinearPrecision,
) -> TestResult<FsdpModel<Linear<T>>> {
    let lin = Linear::<T>::new(inf, outf)?
        .with_precision(precision)?
        .with_seed(42);
    Ok(FsdpModel::new(
        lin,
        comm,
        WrapPolicy::Single,
        FsdpConfig::default(),
    )?)
}

/// The gathered FP8 weight's codes and inverse scale.
fn weight_codes(model: &mut FsdpModel<Linear<f32>>) -> TestResult<(Vec<u8>, f32)> {
    model.gather_all()?;
    let p = model
        .module()
        .weight_id()
        .index()
        .ok_or("unset weight id")?;
    let out = match model.sharded().param(p)? {
        GatheredParam::Fp8 { codes, scales } => (codes.to_vec()?, scales.to_vec()?[1]),
        _ => return Err("not a per-tensor FP8 weight".into()),
    };
    model.release_all()?;
    Ok(out)
}

fn forward<T: Activation>(
    model: &mut FsdpModel<Linear<T>>,
    x: &[T],
    shape: Shape,
) -> TestResult<Vec<f32>> {
    let dev = model.device().clone();
    let xt = Tensor::new(dev.upload(x)?, shape)?;
    let y = model.forward(Mode::Train, |lin, ctx| lin.forward(ctx, xt))?;
    Ok(y.data().to_vec()?.iter().map(|v| v.to_f32()).collect())
}

fn check(gpu_comm: &Arc<dyn Communicator>) -> TestResult<()> {
    let mut failures = Vec::new();
    let mut seed = 1000u64;
    for (tokens, inf, outf) in [(256, 512, 128), (77, 100, 45)] {
        let name = format!("fp8 linear {tokens}x{inf}->{outf}");
        let mut lc = model::<f32>(cpu_comm()?, inf, outf, LinearPrecision::Fp8)?;
        let mut lg = model::<f32>(gpu_comm.clone(), inf, outf, LinearPrecision::Fp8)?;
        // An optimizer step with lr 0 re-quantizes the unchanged master on each device.
        let lr0 = AdamOptions {
            lr: 0.0,
            state_precision: StatePrecision::F32,
            ..AdamOptions::adam()
        };
        let mut oc = FsdpAdam::for_model(&mut lc, lr0)?;
        let mut og = FsdpAdam::for_model(&mut lg, lr0)?;
        step_model(&mut oc, &mut lc)?;
        step_model(&mut og, &mut lg)?;
        let (wc, w_inv) = weight_codes(&mut lc)?;
        let (wg, w_inv_g) = weight_codes(&mut lg)?;
        if wc != wg || w_inv != w_inv_g {
            failures.push(format!("{name}: weight cast differs"));
        }
        let wd: Vec<f32> = wc
            .iter()
            .map(|&q| Fp8Format::E4M3.decode(q) * w_inv)
            .collect();
        let bias = lc.gathered_params()?[1].1.clone();
        let dev_c = lc.device().clone();
        let dev_g = lg.device().clone();
        let shape = Shape::matrix(tokens, inf)?;
        for step in 0..3 {
            seed += 1;
            // bf16-representable inputs, as a BF16 producer would hand them over.
            let x: Vec<f32> = values(seed, tokens * inf, 3.0)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect();
            let dy: Vec<f32> = values(seed ^ 77, tokens * outf, 1e-3)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect();
            let yc = forward(&mut lc, &x, shape)?;
            let yg = forward(&mut lg, &x, shape)?;
            let sc = lc.module_mut().fp8_input(&dev_c, tokens)?;
            let (xt_c, xs) = (sc.x_t.to_vec()?, sc.x_scale_inv.to_vec()?[0]);
            let sg = lg.module_mut().fp8_input(&dev_g, tokens)?;
            let (xt_g, xs_g) = (sg.x_t.to_vec()?, sg.x_scale_inv.to_vec()?[0]);
            if xt_c != xt_g || xs != xs_g {
                failures.push(format!("{name} step {step}: saved x^T differs"));
            }
            // y's error scale from the operands the GEMM saw (x^T decoded back to x).
            let mut xd = vec![0f32; tokens * inf];
            for t in 0..tokens {
                for i in 0..inf {
                    xd[t * inf + i] = Fp8Format::E4M3.decode(xt_c[i * tokens + t]) * xs;
                }
            }
            let mag = magnitude(&xd, &wd, &bias, tokens, outf, inf);
            let w = worst(&yg, &yc, &mag, FP8_REL, false);
            if w > 1.0 {
                failures.push(format!(
                    "{name} step {step}: y worst error / bound = {w:.3}"
                ));
            }
            let backward = |m: &mut FsdpModel<Linear<f32>>| -> TestResult<Vec<f32>> {
                let dev = m.device().clone();
                let dyt = Tensor::new(dev.upload(&dy)?, Shape::matrix(tokens, outf)?)?;
                let dx = m
                    .backward(|lin, ctx| lin.backward_step(ctx, dyt, true))?
                    .ok_or("no dx")?;
                Ok(dx.data().to_vec()?)
            };
            let (dxc, dxg) = (backward(&mut lc)?, backward(&mut lg)?);
            let (gc, gg) = ([grad_shards(lc.sharded())?], [grad_shards(lg.sharded())?]);
            for (what, c, g) in [
                ("dx", dxc, dxg),
                (
                    "dW (accumulated)",
                    full_grad(lc.layout(), &gc, "weight"),
                    full_grad(lg.layout(), &gg, "weight"),
                ),
                (
                    "db (accumulated)",
                    full_grad(lc.layout(), &gc, "bias"),
                    full_grad(lg.layout(), &gg, "bias"),
                ),
            ] {
                let err = rel_to_max(&g, &c);
                if err > 1e-3 {
                    failures.push(format!(
                        "{name} step {step}: {what}: max |gpu - cpu| / max |cpu| = {err:.2e} (bound 1e-3)"
                    ));
                }
            }
            lc.parts_mut().1.update_local()?;
            lg.parts_mut().1.update_local()?;
            let metas = |m: &FsdpModel<Linear<f32>>| -> TestResult<Vec<(Vec<f32>, f32)>> {
                let reg = m.scaling();
                let mut out = Vec::new();
                for i in 0..reg.len() {
                    let meta = reg.get(reg.id(i)?)?.to_meta()?;
                    out.push((meta.history(), meta.scale()));
                }
                Ok(out)
            };
            let (mc, mg) = (metas(&lc)?, metas(&lg)?);
            if mc != mg {
                failures.push(format!(
                    "{name} step {step}: metas after update differ: cpu {mc:?}, gpu {mg:?}"
                ));
            }
            let scales: Vec<f32> = mg.iter().map(|m| m.1).collect();
            println!("{name} step {step}: y worst/bound {w:.3}, meta scales {scales:?}");
        }
        // The BF16 layer: y within the BF16 GEMM bound (f32 accumulation in any order, bf16 output).
        let mut bc = model::<bf16>(cpu_comm()?, inf, outf, LinearPrecision::Bf16)?;
        let mut bg = model::<bf16>(gpu_comm.clone(), inf, outf, LinearPrecision::Bf16)?;
        let params = bc.gathered_params()?;
        let w16: Vec<f32> = params[0]
            .1
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect();
        let b16: Vec<f32> = params[1]
            .1
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect();
        let x: Vec<bf16> = values(seed ^ 99, tokens * inf, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let yc = forward(&mut bc, &x, shape)?;
        let yg = forward(&mut bg, &x, shape)?;
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let mag = magnitude(&xf, &w16, &b16, tokens, outf, inf);
        // Both sides sum k = inf products in f32 in different orders: each is within k * 2^-24 of the
        // exact sum relative to sum |x||w| (the standard dot-product bound), then rounds once to BF16
        // (one BF16 step apart at most where the f32 sums straddle a rounding boundary).
        let w = worst(&yg, &yc, &mag, inf as f64 * 2f64.powi(-24), true);
        if w > 1.0 {
            failures.push(format!(
                "bf16 linear {tokens}x{inf}->{outf}: y worst error / bound = {w:.3}"
            ));
        }
        println!("bf16 linear {tokens}x{inf}->{outf}: y worst/bound {w:.3}");
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n").into())
    }
}

/// The GPU's block-scaled GEMMs against the CPU's, relative to `sum |a b|` (see the module docs).
const BLOCK_REL: f64 = 1.0 / 256.0;

/// `x [rows, cols]` cast on the host in `layout`'s tiles (E4M3, power-of-two scales) and decoded: the
/// operand a block-scaled GEMM sees (transposed for `Columns128x1Transposed`).
fn host_block_cast(x: &[f32], shape: [usize; 2], layout: BlockQuantLayout) -> TestResult<Vec<f32>> {
    let cpu = Device::cpu();
    let out = layout.output_layout(shape[0], shape[1])?;
    let n = out.num_blocks();
    let (mut codes, mut s, mut si) = (
        cpu.zeros::<u8>(out.numel())?,
        cpu.zeros::<f32>(n)?,
        cpu.zeros::<f32>(n)?,
    );
    let spec = BlockQuantSpec::new(layout, Fp8Format::E4M3);
    block_quantize(&cpu.upload(x)?, shape, spec, &mut codes, &mut s, &mut si)?;
    let mut v = cpu.zeros::<f32>(out.numel())?;
    block_dequantize(
        &codes,
        &out,
        ScaleOrder::RowMajor,
        Fp8Format::E4M3,
        &si,
        &mut v,
    )?;
    Ok(v.to_vec()?)
}

fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

fn block_model<T: Activation>(
    comm: Arc<dyn Communicator>,
    inf: usize,
    outf: usize,
) -> TestResult<FsdpModel<Linear<T>>> {
    let lin = Linear::<T>::new(inf, outf)?
        .with_precision(LinearPrecision::Fp8)?
        .with_fp8_recipe(&Fp8Recipe::block_scaled(ScaleRounding::PowerOfTwo))?
        .with_seed(42);
    Ok(FsdpModel::new(
        lin,
        comm,
        WrapPolicy::Single,
        FsdpConfig::default(),
    )?)
}

/// The gathered block-scaled weight: codes and the decoded values.
fn block_weight<T: Activation>(
    model: &mut FsdpModel<Linear<T>>,
) -> TestResult<(Vec<u8>, Vec<f32>)> {
    model.gather_all()?;
    let p = model
        .module()
        .weight_id()
        .index()
        .ok_or("unset weight id")?;
    let param = model.sharded().param(p)?;
    let out = match param {
        GatheredParam::Fp8Block { codes, .. } => (codes.to_vec()?, param.to_f32_vec()?),
        _ => return Err("not a block-scaled FP8 weight".into()),
    };
    model.release_all()?;
    Ok(out)
}

/// The saved `x^T` codes and inverse scales of the last training forward.
fn block_saved<T: Activation>(model: &FsdpModel<Linear<T>>) -> TestResult<(Vec<u8>, Vec<f32>)> {
    let s = model.module().block_saved().ok_or("nothing saved")?;
    Ok((s.x_t.to_vec()?, s.x_t_scale_inv.to_vec()?))
}

/// The block-scaled layer on the CPU and on `gpu_comm`'s device, two steps of fresh data, gradients
/// accumulated: failures are appended to `failures`.
fn check_block<T: Activation>(
    gpu_comm: &Arc<dyn Communicator>,
    (tokens, inf, outf): (usize, usize, usize),
    failures: &mut Vec<String>,
) -> TestResult<()> {
    let name = format!(
        "block linear {tokens}x{inf}->{outf} ({})",
        std::any::type_name::<T>()
    );
    let bf16_out = T::DTYPE == fp8_kernels::DType::BF16;
    let mut lc = block_model::<T>(cpu_comm()?, inf, outf)?;
    let mut lg = block_model::<T>(gpu_comm.clone(), inf, outf)?;
    let (wc, wd) = block_weight(&mut lc)?;
    let (wg, wdg) = block_weight(&mut lg)?;
    if wc != wg || wd != wdg {
        failures.push(format!("{name}: the weight's block cast differs"));
    }
    let wd_t = transposed(&wd, outf, inf);
    let bias = lc.gathered_params()?[1].1.clone();
    let bias_t: Vec<f32> = bias.iter().map(|&b| T::from_f32(b).to_f32()).collect();
    let shape = Shape::matrix(tokens, inf)?;
    let (mut dw_mag, mut db_mag) = (vec![0f64; outf * inf], vec![0f64; outf]);
    for step in 0..2u64 {
        let seed = 5000 + 10 * step + tokens as u64;
        let x: Vec<f32> = values(seed, tokens * inf, 3.0)
            .into_iter()
            .map(|v| T::from_f32(v).to_f32())
            .collect();
        let dy: Vec<f32> = values(seed ^ 77, tokens * outf, 1e-3)
            .into_iter()
            .map(|v| T::from_f32(v).to_f32())
            .collect();
        let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
        let yc = forward(&mut lc, &xt, shape)?;
        let yg = forward(&mut lg, &xt, shape)?;
        if block_saved(&lc)? != block_saved(&lg)? {
            failures.push(format!("{name} step {step}: saved x^T differs"));
        }
        let xr = host_block_cast(&x, [tokens, inf], BlockQuantLayout::Rows1x128)?;
        let mag = magnitude(&xr, &wd, &bias_t, tokens, outf, inf);
        let wy = worst(&yg, &yc, &mag, BLOCK_REL, bf16_out);
        let backward = |m: &mut FsdpModel<Linear<T>>| -> TestResult<Vec<f32>> {
            let dev = m.device().clone();
            let d: Vec<T> = dy.iter().map(|&v| T::from_f32(v)).collect();
            let dyt = Tensor::new(dev.upload(&d)?, Shape::matrix(tokens, outf)?)?;
            let dx = m
                .backward(|lin, ctx| lin.backward_step(ctx, dyt, true))?
                .ok_or("no dx")?;
            Ok(dx.data().to_vec()?.iter().map(|v| v.to_f32()).collect())
        };
        let (dxc, dxg) = (backward(&mut lc)?, backward(&mut lg)?);
        let dyr = host_block_cast(&dy, [tokens, outf], BlockQuantLayout::Rows1x128)?;
        let mag = magnitude(&dyr, &wd_t, &vec![0.0; inf], tokens, inf, outf);
        let wdx = worst(&dxg, &dxc, &mag, BLOCK_REL, bf16_out);
        // dW's magnitude from the 128x1 casts (both K-major over the tokens), summed over the steps.
        let dyc = host_block_cast(
            &dy,
            [tokens, outf],
            BlockQuantLayout::Columns128x1Transposed,
        )?;
        let xc = host_block_cast(&x, [tokens, inf], BlockQuantLayout::Columns128x1Transposed)?;
        for (a, m) in
            dw_mag
                .iter_mut()
                .zip(magnitude(&dyc, &xc, &vec![0.0; inf], outf, inf, tokens))
        {
            *a += m;
        }
        for (o, m) in db_mag.iter_mut().enumerate() {
            *m += (0..tokens)
                .map(|t| dy[t * outf + o].abs() as f64)
                .sum::<f64>();
        }
        let (gc, gg) = ([grad_shards(lc.sharded())?], [grad_shards(lg.sharded())?]);
        let wdw = worst(
            &full_grad(lg.layout(), &gg, "weight"),
            &full_grad(lc.layout(), &gc, "weight"),
            &dw_mag,
            BLOCK_REL,
            false,
        );
        let wdb = worst(
            &full_grad(lg.layout(), &gg, "bias"),
            &full_grad(lc.layout(), &gc, "bias"),
            &db_mag,
            (tokens + 2) as f64 * 2f64.powi(-23),
            false,
        );
        for (what, w) in [
            ("y", wy),
            ("dx", wdx),
            ("dW (accumulated)", wdw),
            ("db (accumulated)", wdb),
        ] {
            if w > 1.0 {
                failures.push(format!(
                    "{name} step {step}: {what}: worst error / bound {w:.3}"
                ));
            }
        }
        println!(
            "{name} step {step}: worst / bound: y {wy:.3}, dx {wdx:.3}, dW {wdw:.3}, db {wdb:.3}"
        );
    }
    Ok(())
}

/// The block-scaled checks: shapes with full blocks, and with partial tiles, a partial weight block row
/// and a token count padded to 16.
fn check_blocks(gpu_comm: &Arc<dyn Communicator>) -> TestResult<()> {
    let mut failures = Vec::new();
    check_block::<bf16>(gpu_comm, (256, 512, 384), &mut failures)?;
    check_block::<f32>(gpu_comm, (77, 272, 144), &mut failures)?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n").into())
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_block_linear_matches_cpu() {
    if let Err(e) = check_blocks(&cuda_comm()) {
        panic!("CUDA vs CPU block-scaled linear:\n{e}");
    }
}

/// The block check with a second CPU model in the GPU's place.
#[test]
fn the_block_check_passes_cpu_against_cpu() {
    let comm = cpu_comm().expect("a thread rank");
    if let Err(e) = check_blocks(&comm) {
        panic!("CPU vs CPU block-scaled linear:\n{e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_linear_matches_cpu() {
    if let Err(e) = check(&cuda_comm()) {
        panic!("CUDA vs CPU linear:\n{e}");
    }
}

/// The check itself, run with a second CPU model in the GPU's place (everything equal): so a failure on
/// the GPU machine is about the GPU, not about the check.
#[test]
fn the_check_passes_cpu_against_cpu() {
    let comm = cpu_comm().expect("a thread rank");
    if let Err(e) = check(&comm) {
        panic!("CPU vs CPU linear:\n{e}");
    }
}
