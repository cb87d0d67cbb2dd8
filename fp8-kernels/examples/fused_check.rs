//! GPU check of the fused GELU + FP8 cast kernels (`fp8_kernels::gelu_cast`) on random inputs at MLP sizes:
//! on CUDA device 0 the fused kernels must equal the unfused GPU path (GELU kernel into BF16, then cast +
//! transpose) bit for bit (codes, transposed codes, amax); against the CPU implementation they must agree
//! up to one FP8 step per code (the devices' `exp` may differ in the last f32 bit), with the count of
//! differing codes printed.
//!
//! Usage: `fused_check [--seed N]`. One line per check; exits 1 on any FAIL, and without a usable GPU
//! (saying why: nothing was checked).

use fp8_core::Fp8Format;
use fp8_kernels::elementwise::{gelu_backward, gelu_forward, GeluApprox};
use fp8_kernels::gelu_cast::{gelu_backward_cast_fp8, gelu_cast_fp8};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{cast_transpose_to_fp8, AmaxSlot, Buffer, Device, KernelError};
use half::bf16;
use std::process::ExitCode;

/// Codes, transposed codes, amax.
type Outputs = (Vec<u8>, Vec<u8>, f32);

struct Case<'a> {
    shape: [usize; 2],
    u: &'a [bf16],
    dh: Option<&'a [bf16]>,
    format: Fp8Format,
    scale: f32,
}

fn run_fused(dev: &Device, c: &Case<'_>) -> Result<Outputs, KernelError> {
    let n = c.u.len();
    let u = dev.upload(c.u)?;
    let scale = dev.upload(&[c.scale])?;
    let (mut y, mut yt, mut amax) = (dev.zeros::<u8>(n)?, dev.zeros::<u8>(n)?, dev.zeros(1)?);
    let slot = Some(AmaxSlot::first(&mut amax));
    match c.dh {
        None => gelu_cast_fp8(
            &u,
            c.shape,
            GeluApprox::Erf,
            c.format,
            &scale,
            &mut y,
            &mut yt,
            slot,
        )?,
        Some(g) => {
            let g = dev.upload(g)?;
            gelu_backward_cast_fp8(
                &u,
                &g,
                c.shape,
                GeluApprox::Erf,
                c.format,
                &scale,
                &mut y,
                &mut yt,
                slot,
            )?
        }
    }
    Ok((y.to_vec()?, yt.to_vec()?, amax.to_vec()?[0]))
}

fn run_unfused(dev: &Device, c: &Case<'_>) -> Result<Outputs, KernelError> {
    let n = c.u.len();
    let u = dev.upload(c.u)?;
    let mut h: Buffer<bf16> = dev.zeros(n)?;
    match c.dh {
        None => gelu_forward(&u, &mut h, GeluApprox::Erf)?,
        Some(g) => gelu_backward(&u, &dev.upload(g)?, &mut h, GeluApprox::Erf)?,
    }
    let scale = dev.upload(&[c.scale])?;
    let (mut y, mut yt, mut amax) = (dev.zeros::<u8>(n)?, dev.zeros::<u8>(n)?, dev.zeros(1)?);
    cast_transpose_to_fp8(
        &h,
        c.shape,
        c.format,
        &scale,
        &mut yt,
        Some(&mut y),
        Some(AmaxSlot::first(&mut amax)),
    )?;
    Ok((y.to_vec()?, yt.to_vec()?, amax.to_vec()?[0]))
}

fn ordinal(code: u8) -> i32 {
    let m = (code & 0x7F) as i32;
    if code & 0x80 != 0 {
        -m
    } else {
        m
    }
}

fn run(seed: u64) -> Result<usize, KernelError> {
    let gpu = Device::cuda(0)?;
    if let Device::Cuda(c) = &gpu {
        c.require_fp8()?;
    }
    let cpu = Device::cpu();
    let mut rng = SplitMix64::new(seed);
    let mut failures = 0;
    // MLP-like shapes ([tokens, 4d]) and ragged ones (partial tiles).
    for shape in [[4096usize, 8192usize], [1000, 777], [33, 4097], [1, 1]] {
        let n = shape[0] * shape[1];
        let u: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(rng.uniform_f32() * 4.0))
            .collect();
        let dh: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(rng.uniform_f32() * 1e-4))
            .collect();
        for (backward, format, scale) in [
            (false, Fp8Format::E4M3, 64.0f32),
            (true, Fp8Format::E5M2, 2f32.powi(20)),
        ] {
            let c = Case {
                shape,
                u: &u,
                dh: backward.then_some(&dh[..]),
                format,
                scale,
            };
            let name = format!(
                "{} {}x{} {format:?}",
                if backward {
                    "gelu_backward_cast_fp8"
                } else {
                    "gelu_cast_fp8"
                },
                shape[0],
                shape[1]
            );
            let got = run_fused(&gpu, &c)?;
            let unfused = run_unfused(&gpu, &c)?;
            let exact =
                got.0 == unfused.0 && got.1 == unfused.1 && got.2.to_bits() == unfused.2.to_bits();
            println!(
                "{} {name}: fused vs unfused on the GPU, bit-exact",
                if exact { "PASS" } else { "FAIL" }
            );
            failures += usize::from(!exact);
            let on_cpu = run_fused(&cpu, &c)?;
            let mut differing = 0usize;
            let mut worst = 0i32;
            for (g, w) in [(&got.0, &on_cpu.0), (&got.1, &on_cpu.1)] {
                for (&a, &b) in g.iter().zip(w.iter()) {
                    let d = (ordinal(a) - ordinal(b)).abs();
                    differing += usize::from(d != 0);
                    worst = worst.max(d);
                }
            }
            let amax_ok = (got.2 - on_cpu.2).abs() <= on_cpu.2.abs() / 128.0;
            let ok = worst <= 1 && amax_ok;
            println!(
                "{} {name}: GPU vs CPU, {differing} of {} codes differ (at most {worst} step), amax {} vs {}",
                if ok { "PASS" } else { "FAIL" },
                2 * n,
                got.2,
                on_cpu.2
            );
            failures += usize::from(!ok);
        }
    }
    Ok(failures)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let mut seed = 0x5EED_F05Eu64;
    match args.as_slice() {
        [_] => {}
        [_, flag, v] if flag == "--seed" => match v.parse() {
            Ok(s) => seed = s,
            Err(_) => {
                eprintln!("--seed needs an integer");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: fused_check [--seed N]");
            return ExitCode::from(2);
        }
    }
    println!("fused_check seed {seed}");
    match run(seed) {
        Ok(0) => {
            println!("all checks passed");
            ExitCode::SUCCESS
        }
        Ok(n) => {
            println!("{n} check(s) FAILED");
            ExitCode::FAILURE
        }
        Err(KernelError::CudaUnavailable(why)) => {
            println!("nothing checked: CUDA is not available ({why})");
            ExitCode::FAILURE
        }
        Err(KernelError::Fp8Unsupported { major, minor }) => {
            println!("nothing checked: this GPU ({major}.{minor}) has no FP8 instructions");
            ExitCode::FAILURE
        }
        Err(e) => {
            println!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
