//! GPU bench of the GEMMs and the fused AdamW: prints one table.
//!
//! - FP8 (E4M3 x E4M3 -> BF16, scale pointers, no fast accumulation, as `torch._scaled_mm`'s default) and
//!   BF16 GEMM TFLOP/s, `y = A B^T` with `A [m, k]`, `B [n, k]` (the shapes of `peer_kernels.py`:
//!   `(m, k, n)`), over the target shapes and a sweep to find where FP8 stops beating BF16;
//! - fused AdamW over 256M parameters, low-precision states (bf16 grad, f16 master, E4M3 m, f16 v) and F32
//!   states, in bytes/s counted by the bytes the step must move.
//!
//! Timing: host clock around `iters` launches after warm-up, with a device synchronize at both ends.
//! Run `peer_kernels.py` on the same lease for the side-by-side peer figures. Without a GPU it prints why
//! and exits 0.

use fp8_core::Fp8Format;
use fp8_kernels::adam::{adam_step_f32, adam_step_low_precision, bytes_per_element, AmaxSlots};
use fp8_kernels::gemm::{gemm, gemm_fp8};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{
    AdamConfig, Buffer, DType, Device, DeviceScalar, Fp8Matrix, GemmSpec, KernelError,
    LowPrecisionAdamState, Transpose,
};
use half::{bf16, f16};
use rayon::prelude::*;
use std::time::Instant;

/// Peer figures (`torch._scaled_mm`) measured on the H200 on 2026-12-02, for orientation only.
const PEER_FP8_8192: f64 = 1271.0;
const COPY_TBPS: f64 = 4.09;

fn random(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .into_par_iter()
        .map(|i| {
            // Counter-based, so the parallel fill does not depend on how rayon splits it.
            let z = SplitMix64::mix(seed.wrapping_add((i as u64).wrapping_mul(SplitMix64::GAMMA)));
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn time<F: FnMut() -> Result<(), KernelError>>(
    dev: &Device,
    warm: usize,
    iters: usize,
    mut f: F,
) -> Result<f64, KernelError> {
    for _ in 0..warm {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

/// (FP8 TFLOP/s, FP8 fast-accum TFLOP/s, BF16 TFLOP/s) for `A [m, k] B[n, k]^T`.
fn bench_gemm(dev: &Device, m: usize, k: usize, n: usize) -> Result<(f64, f64, f64), KernelError> {
    let iters = if m * n * k >= 1 << 36 { 20 } else { 100 };
    let spec = GemmSpec::new(m, n, k).transposes(Transpose::No, Transpose::Yes);
    let flops = spec.flops();
    let a = random(m * k, 1);
    let b = random(n * k, 2);
    // FP8: normal-distribution-like data scaled into the E4M3 range, as torch's randn().to(e4m3).
    let f = Fp8Format::E4M3;
    let a8: Vec<u8> = a.par_iter().map(|&v| f.encode(v * 3.0)).collect();
    let b8: Vec<u8> = b.par_iter().map(|&v| f.encode(v * 3.0)).collect();
    let (a8, b8) = (dev.upload(&a8)?, dev.upload(&b8)?);
    let one = dev.upload(&[1.0f32])?;
    let mut y = dev.zeros::<bf16>(m * n)?;
    let op = |d| Fp8Matrix {
        data: d,
        format: f,
        scale_inv: DeviceScalar {
            buffer: &one,
            index: 0,
        },
    };
    let t8 = time(dev, 5, iters, || gemm_fp8(&spec, op(&a8), op(&b8), &mut y))?;
    let fast = GemmSpec {
        fp8_fast_accum: true,
        ..spec
    };
    let t8f = time(dev, 5, iters, || gemm_fp8(&fast, op(&a8), op(&b8), &mut y))?;
    drop((a8, b8));
    let a16: Vec<bf16> = a.par_iter().map(|&v| bf16::from_f32(v)).collect();
    let b16: Vec<bf16> = b.par_iter().map(|&v| bf16::from_f32(v)).collect();
    let (a16, b16) = (dev.upload(&a16)?, dev.upload(&b16)?);
    let t16 = time(dev, 5, iters, || gemm(&spec, &a16, &b16, &mut y))?;
    Ok((flops / t8 / 1e12, flops / t8f / 1e12, flops / t16 / 1e12))
}

fn bench_adam(dev: &Device, n: usize) -> Result<(f64, f64), KernelError> {
    let cfg = AdamConfig::default();
    let coef = cfg.coefficients(10, 1.0)?;
    let g: Vec<bf16> = random(n, 3)
        .par_iter()
        .map(|&v| bf16::from_f32(v * 1e-2))
        .collect();
    let grad: Buffer<bf16> = dev.upload(&g)?;
    drop(g);
    // low-precision states
    let w: Vec<f16> = random(n, 4)
        .par_iter()
        .map(|&v| f16::from_f32(v * 1000.0))
        .collect();
    let mut master = dev.upload(&w)?;
    drop(w);
    let mut m = dev.zeros::<u8>(n)?;
    let mut v = dev.zeros::<f16>(n)?;
    let scales = dev.upload(&[1e-3f32, 1e3, 1.0, 1.0, 1.0, 1.0])?;
    let mut amax = dev.zeros::<f32>(3)?;
    let t_lp = time(dev, 3, 20, || {
        adam_step_low_precision(
            &coef,
            0..n,
            LowPrecisionAdamState {
                master: &mut master,
                m: &mut m,
                v: &mut v,
            },
            &grad,
            &scales,
            0,
            AmaxSlots {
                buffer: &mut amax,
                base: 0,
            },
        )
    })?;
    drop((master, m, v));
    let lp = (bytes_per_element(true, DType::BF16) * n) as f64 / t_lp / 1e12;
    // F32 states
    let mut master = dev.upload(&random(n, 5))?;
    let mut m = dev.zeros::<f32>(n)?;
    let mut v = dev.zeros::<f32>(n)?;
    let t32 = time(dev, 3, 20, || {
        adam_step_f32(
            &coef,
            0..n,
            &mut master,
            &mut m,
            &mut v,
            &grad,
            Some(AmaxSlots {
                buffer: &mut amax,
                base: 0,
            }),
        )
    })?;
    let f32s = (bytes_per_element(false, DType::BF16) * n) as f64 / t32 / 1e12;
    Ok((lp, f32s))
}

fn main() {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("gemm_bench: no usable GPU, nothing measured ({e})");
            return;
        }
    };
    println!("gemm_bench on CUDA device 0");
    println!(
        "| shape m x k x n | FP8 TFLOP/s | FP8 fast-accum TFLOP/s | BF16 TFLOP/s | FP8 / BF16 |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let mut shapes: Vec<(usize, usize, usize)> = vec![(8192, 8192, 8192), (16384, 8192, 28672)];
    for s in [512, 1024, 2048, 3072, 4096, 6144, 8192] {
        shapes.push((s, s, s));
    }
    shapes.extend_from_slice(&[
        (64, 9216, 128),
        (128, 4096, 4096),
        (1024, 4096, 4096),
        (4096, 4096, 16384),
        (16384, 4096, 4096),
    ]);
    let mut fp8_8192 = None;
    for (m, k, n) in shapes {
        match bench_gemm(&dev, m, k, n) {
            Ok((f8, f8f, f16)) => {
                if (m, k, n) == (8192, 8192, 8192) && fp8_8192.is_none() {
                    fp8_8192 = Some(f8);
                }
                println!(
                    "| {m} x {k} x {n} | {f8:.1} | {f8f:.1} | {f16:.1} | {:.2} |",
                    f8 / f16
                )
            }
            Err(e) => println!("| {m} x {k} x {n} | error: {e} | | | |"),
        }
    }
    if let Some(f8) = fp8_8192 {
        println!(
            "FP8 8192^3: {f8:.1} TFLOP/s = {:.3} x the H200 peer ({PEER_FP8_8192} TFLOP/s; target >= 0.95)",
            f8 / PEER_FP8_8192
        );
    }
    let n = 256 << 20;
    match bench_adam(&dev, n) {
        Ok((lp, f32s)) => {
            println!("| AdamW 256M params | TB/s | fraction of {COPY_TBPS} TB/s copy |");
            println!("| --- | --- | --- |");
            println!(
                "| low precision (bf16 grad, f16 master, e4m3 m, f16 v; {} B/param) | {lp:.2} | {:.2} |",
                bytes_per_element(true, DType::BF16),
                lp / COPY_TBPS
            );
            println!(
                "| f32 states (bf16 grad; {} B/param) | {f32s:.2} | {:.2} |",
                bytes_per_element(false, DType::BF16),
                f32s / COPY_TBPS
            );
            println!("AdamW target: >= 0.70 of copy bandwidth");
        }
        Err(e) => println!("AdamW bench failed: {e}"),
    }
}
