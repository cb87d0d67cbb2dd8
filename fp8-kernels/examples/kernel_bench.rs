//! GPU bench of the cast kernels, timed with CUDA events (warm-up, then the median of N runs):
//! one-pass cast BF16 -> E4M3 with amax output, the current-scaling cast (amax pass + cast pass),
//! dequantize E4M3 -> BF16, and a device-to-device copy as the bandwidth ceiling. Prints one table.
//!
//! Usage: `kernel_bench [--elements N] [--iters N]` (default 2^28 elements, 20 iterations).
//! Bytes are counted as the peer script does: 2 read + 1 written per element for the casts (the current
//! cast's second read of the input is not counted), 1 read + 2 written for the dequantize, 2 + 2 for the copy.

mod common;

use common::{bench_exit, time_ms};
use fp8_core::Fp8Format;
use fp8_kernels::elementwise::{gelu_forward, GeluApprox};
use fp8_kernels::gelu_cast::{gelu_backward_cast_fp8, gelu_cast_fp8};
use fp8_kernels::{
    cast_to_fp8, cast_to_fp8_current, cast_transpose_to_fp8, dequantize_fp8, AmaxSlot,
    CurrentScaling, Device, KernelError,
};
use half::bf16;
use rayon::prelude::*;
use std::process::ExitCode;

fn run(n: usize, iters: usize) -> Result<(), KernelError> {
    let gpu = Device::cuda(0)?;
    let dev = gpu.as_cuda("kernel_bench")?.clone();
    dev.require_fp8()?;
    println!(
        "kernel_bench: CUDA {} (cc {:?}), {n} elements, median of {iters}",
        dev.ordinal(),
        dev.compute_capability()
    );
    let host: Vec<bf16> = (0..n)
        .into_par_iter()
        .map(|i| bf16::from_f32(((i as f32) * 0.618_034).sin() * 300.0))
        .collect();
    let x = gpu.upload(&host)?;
    drop(host);
    let mut x2 = gpu.zeros::<bf16>(n)?;
    let mut q = gpu.zeros::<u8>(n)?;
    let mut back = gpu.zeros::<bf16>(n)?;
    let scale = gpu.upload(&[1.0f32])?;
    let mut amax_buf = gpu.zeros::<f32>(1)?;
    let (mut cs, mut csi, mut ca) = (
        gpu.upload(&[1.0f32])?,
        gpu.upload(&[1.0f32])?,
        gpu.zeros::<f32>(1)?,
    );

    let mut rows: Vec<(String, f64, f64, &str)> = Vec::new();
    let tb = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e12;

    let ms = time_ms(&dev, iters, || x2.copy_from(&x))?;
    let copy = tb(4.0 * n as f64, ms);
    rows.push((
        "device copy bf16 (ceiling)".into(),
        ms,
        copy,
        "4.09 TB/s measured earlier",
    ));

    let ms = time_ms(&dev, iters, || {
        cast_to_fp8(
            &x,
            Fp8Format::E4M3,
            &scale,
            &mut q,
            Some(AmaxSlot::first(&mut amax_buf)),
        )
    })?;
    rows.push((
        "cast bf16->e4m3 + amax (delayed)".into(),
        ms,
        tb(3.0 * n as f64, ms),
        ">= 3.0 TB/s",
    ));

    let spec = CurrentScaling::new(Fp8Format::E4M3);
    let ms = time_ms(&dev, iters, || {
        cast_to_fp8_current(&x, spec, &mut cs, &mut csi, &mut ca, &mut q)
    })?;
    rows.push((
        "cast bf16->e4m3 current scaling".into(),
        ms,
        tb(3.0 * n as f64, ms),
        ">= 2.3 TB/s (1.2x compiled torch 1.93)",
    ));

    let ms = time_ms(&dev, iters, || {
        dequantize_fp8(&q, Fp8Format::E4M3, &csi, &mut back)
    })?;
    rows.push((
        "dequantize e4m3->bf16".into(),
        ms,
        tb(3.0 * n as f64, ms),
        "-",
    ));

    // The MLP's [tokens, 4d] casts: rows of 16384 (or fewer) so both sides are multiples of 64.
    let rows_t = 16384.min(n / 64) / 64 * 64;
    let cols_t = (n / rows_t.max(1)) / 64 * 64;
    let m = rows_t * cols_t;
    if m > 0 {
        let shape = [rows_t, cols_t];
        let mut xs = gpu.zeros::<bf16>(m)?;
        xs.copy_range_from(0, &x, 0, m)?;
        let mut qt = gpu.zeros::<u8>(m)?;
        let mut q2 = gpu.zeros::<u8>(m)?;
        let ms = time_ms(&dev, iters, || {
            cast_transpose_to_fp8(
                &xs,
                shape,
                Fp8Format::E4M3,
                &scale,
                &mut qt,
                Some(&mut q2),
                Some(AmaxSlot::first(&mut amax_buf)),
            )
        })?;
        rows.push((
            format!("cast+transpose bf16->e4m3 {rows_t}x{cols_t}"),
            ms,
            tb(4.0 * m as f64, ms),
            "2 read + 2 written per element",
        ));
        let ms = time_ms(&dev, iters, || {
            gelu_cast_fp8(
                &xs,
                shape,
                GeluApprox::Erf,
                Fp8Format::E4M3,
                &scale,
                Some(&mut q2),
                Some(&mut qt),
                Some(AmaxSlot::first(&mut amax_buf)),
            )
        })?;
        rows.push((
            "GELU + cast+transpose e4m3 (fused)".into(),
            ms,
            tb(4.0 * m as f64, ms),
            "2 read + 2 written",
        ));
        let mut dh = gpu.zeros::<bf16>(m)?;
        gelu_forward(&xs, &mut dh, GeluApprox::Erf)?;
        let ms = time_ms(&dev, iters, || {
            gelu_backward_cast_fp8(
                &xs,
                &dh,
                shape,
                GeluApprox::Erf,
                Fp8Format::E5M2,
                &scale,
                Some(&mut q2),
                Some(&mut qt),
                Some(AmaxSlot::first(&mut amax_buf)),
            )
        })?;
        rows.push((
            "GELU bwd + cast+transpose e5m2 (fused)".into(),
            ms,
            tb(6.0 * m as f64, ms),
            "4 read + 2 written",
        ));
        let ms = time_ms(&dev, iters, || gelu_forward(&xs, &mut dh, GeluApprox::Erf))?;
        rows.push((
            "GELU bf16 (unfused, for reference)".into(),
            ms,
            tb(4.0 * m as f64, ms),
            "2 read + 2 written",
        ));
    }

    println!(
        "{:<36} {:>10} {:>8} {:>8}  target",
        "kernel", "ms", "TB/s", "of copy"
    );
    for (name, ms, t, target) in &rows {
        println!(
            "{name:<36} {ms:>10.4} {t:>8.3} {:>7.1}%  {target}",
            100.0 * t / copy
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (mut n, mut iters) = (1usize << 28, 20usize);
    let mut i = 1;
    while i < args.len() {
        let v = args.get(i + 1).and_then(|s| s.parse::<usize>().ok());
        match (args[i].as_str(), v) {
            ("--elements", Some(v)) if v > 0 => n = v,
            ("--iters", Some(v)) if v > 0 => iters = v,
            _ => {
                eprintln!("usage: kernel_bench [--elements N] [--iters N]");
                return ExitCode::from(2);
            }
        }
        i += 2;
    }
    bench_exit(run(n, iters))
}
