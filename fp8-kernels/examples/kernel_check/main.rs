//! GPU check: runs every kernel of the cast, scaling, element-wise, reduction, softmax, conv and pooling
//! families on random inputs on the CPU and on CUDA device 0 and compares them (bit-exact for casts,
//! conversions, masks, pooling and the element-wise kernels; a stated relative bound where a
//! transcendental function is involved), then checks the hardware FP8 conversion on all 2^32 f32 bit
//! patterns against `fp8_core::Fp8Format::encode`. The float kernels' checks are in `float_kernels.rs`.
//! (The Adam, segmented, GELU-cast and gather kernels are compared by their test binaries, which run the
//! GPU part when a GPU is present, and by `gemm_check`.)
//!
//! Usage: `kernel_check [--seed N] [--skip-exhaustive]`. One line per check; exits 1 on any FAIL.
//! Without a usable GPU it prints why and exits 1 (nothing was checked).

mod float_kernels;

use float_kernels::{f32_only_ops, ops_checks};
use fp8_core::{AmaxCompute, Fp8Format, QType, ScaleRounding, ScalingMeta, ScalingRecipe};
use fp8_kernels::cast::fp8_encode_bit_patterns;
use fp8_kernels::{
    amax, cast_to_fp8, cast_to_fp8_current, cast_transpose_to_fp8, convert, dequantize_fp8,
    update_scaling_meta, AmaxInput, AmaxSlot, Buffer, CurrentScaling, Device, Element,
    FloatElement, KernelError, ScalingMetaBuffers,
};
use half::{bf16, f16};
use rayon::prelude::*;
use std::process::ExitCode;

/// xorshift64* generator (inputs only; no statistical claims).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn sym(&mut self, spread: f32) -> f32 {
        (self.unit() * 2.0 - 1.0) * spread
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Mostly moderate values over many binades, some special values (NaN, infinities, subnormals).
    fn cast_input(&mut self) -> f32 {
        match self.below(64) {
            0 => f32::NAN,
            1 => -f32::NAN,
            2 => f32::INFINITY,
            3 => f32::NEG_INFINITY,
            4 => f32::from_bits(self.next() as u32 & 0x807F_FFFF), // subnormal
            5 => f32::from_bits(self.next() as u32),               // any pattern
            _ => {
                let e = self.below(40) as i32 - 20;
                self.sym(1.0) * 2f32.powi(e)
            }
        }
    }
}

struct Report {
    failures: usize,
}

impl Report {
    fn line(
        &mut self,
        name: &str,
        size: usize,
        max_abs: f64,
        max_rel: f64,
        bound: &str,
        pass: bool,
    ) {
        if !pass {
            self.failures += 1;
        }
        println!(
            "{:<44} {:>11} {:>12.3e} {:>12.3e}  {:<22} {}",
            name,
            size,
            max_abs,
            max_rel,
            bound,
            if pass { "PASS" } else { "FAIL" }
        );
    }

    /// Bitwise comparison of f32 results (NaN equals NaN, whatever the payload).
    /// [`Report::exact_f32`] of two buffers, widened to f32.
    fn exact_buffers<T: FloatElement>(
        &mut self,
        name: &str,
        cpu: &Buffer<T>,
        gpu: &Buffer<T>,
    ) -> Result<(), KernelError> {
        self.exact_f32(name, &widen(&cpu.to_vec()?), &widen(&gpu.to_vec()?));
        Ok(())
    }

    fn exact_f32(&mut self, name: &str, cpu: &[f32], gpu: &[f32]) {
        let (mut bad, mut abs, mut rel) = (0usize, 0f64, 0f64);
        for (&c, &g) in cpu.iter().zip(gpu) {
            let same = c.to_bits() == g.to_bits() || (c.is_nan() && g.is_nan());
            if !same {
                if bad < 3 {
                    println!(
                        "    mismatch in {name}: cpu {c:e} ({:#010x}) gpu {g:e} ({:#010x})",
                        c.to_bits(),
                        g.to_bits()
                    );
                }
                bad += 1;
                let d = (c as f64 - g as f64).abs();
                abs = abs.max(d);
                rel = rel.max(d / (c.abs() as f64).max(1e-30));
            }
        }
        let pass = bad == 0 && cpu.len() == gpu.len();
        self.line(
            name,
            cpu.len(),
            abs,
            rel,
            &format!("bit-exact ({bad} diff)"),
            pass,
        );
    }

    fn exact_u8(&mut self, name: &str, cpu: &[u8], gpu: &[u8]) {
        let bad = cpu.iter().zip(gpu).filter(|(a, b)| a != b).count();
        if let Some(i) = cpu.iter().zip(gpu).position(|(a, b)| a != b) {
            println!(
                "    first mismatch in {name} at {i}: cpu {:#04x} gpu {:#04x}",
                cpu[i], gpu[i]
            );
        }
        let pass = bad == 0 && cpu.len() == gpu.len();
        self.line(
            name,
            cpu.len(),
            bad as f64,
            0.0,
            &format!("bit-exact ({bad} diff)"),
            pass,
        );
    }

    /// |cpu - gpu| <= rel * max(1, |cpu|) elementwise.
    fn close_f32(&mut self, name: &str, cpu: &[f32], gpu: &[f32], rel_bound: f64) {
        let (mut abs, mut rel, mut pass) = (0f64, 0f64, cpu.len() == gpu.len());
        for (&c, &g) in cpu.iter().zip(gpu) {
            let d = (c as f64 - g as f64).abs();
            let r = d / (c.abs() as f64).max(1.0);
            if r.is_nan() || r > rel_bound {
                pass = false;
            }
            abs = abs.max(d);
            rel = rel.max(r);
        }
        self.line(
            name,
            cpu.len(),
            abs,
            rel,
            &format!("rel <= {rel_bound:.0e}"),
            pass,
        );
    }
}

fn widen<T: FloatElement>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn narrow<T: FloatElement>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn up<T: Element>(d: &Device, v: &[T]) -> Result<Buffer<T>, KernelError> {
    d.upload(v)
}

fn casts_of<T: FloatElement>(
    rep: &mut Report,
    rng: &mut Rng,
    cpu: &Device,
    gpu: &Device,
) -> Result<(), KernelError> {
    let n = (1 << 20) + 13; // a tail that is not a multiple of the vector width
    let raw: Vec<f32> = (0..n).map(|_| rng.cast_input()).collect();
    let x: Vec<T> = narrow(&raw);
    let (xc, xg) = (up(cpu, &x)?, up(gpu, &x)?);
    // amax (finite and NaN only: infinities removed so the value is informative)
    let finite: Vec<T> = x
        .iter()
        .map(|v| {
            if v.to_f32().is_infinite() {
                T::from_f32(1.0)
            } else {
                *v
            }
        })
        .collect();
    let (fc, fg) = (up(cpu, &finite)?, up(gpu, &finite)?);
    let (mut ac, mut ag) = (cpu.upload(&[0.5f32, 0.0])?, gpu.upload(&[0.5f32, 0.0])?);
    amax(&fc, AmaxSlot::new(&mut ac, 1))?;
    amax(&fg, AmaxSlot::new(&mut ag, 1))?;
    rep.exact_f32(&format!("amax {}", T::NAME), &ac.to_vec()?, &ag.to_vec()?);

    for f in Fp8Format::ALL {
        let s = if rng.below(2) == 0 {
            2f32.powi(rng.below(16) as i32 - 8)
        } else {
            0.1 + rng.unit() * 10.0
        };
        let (sc, sg) = (cpu.upload(&[s])?, gpu.upload(&[s])?);
        let (mut yc, mut yg) = (cpu.zeros::<u8>(n)?, gpu.zeros::<u8>(n)?);
        let (mut ac, mut ag) = (cpu.zeros::<f32>(1)?, gpu.zeros::<f32>(1)?);
        cast_to_fp8(&xc, f, &sc, &mut yc, Some(AmaxSlot::first(&mut ac)))?;
        cast_to_fp8(&xg, f, &sg, &mut yg, Some(AmaxSlot::first(&mut ag)))?;
        let yh = yc.to_vec()?;
        // The CPU path itself against fp8-core, element by element.
        let xf = widen(&x);
        let core_ok = xf.iter().zip(&yh).all(|(&v, &c)| f.encode(v * s) == c);
        rep.line(
            &format!("cpu cast {} {f} == fp8_core::encode", T::NAME),
            n,
            0.0,
            0.0,
            "bit-exact",
            core_ok,
        );
        rep.exact_u8(
            &format!("cast {}->{f} (scale {s:.4})", T::NAME),
            &yh,
            &yg.to_vec()?,
        );
        rep.exact_f32(
            &format!("cast {}->{f} amax", T::NAME),
            &ac.to_vec()?,
            &ag.to_vec()?,
        );

        // current scaling, both roundings, random margin and previous scale
        let rounding = if rng.below(2) == 0 {
            ScaleRounding::PowerOfTwo
        } else {
            ScaleRounding::Exact
        };
        let spec = CurrentScaling {
            format: f,
            margin: rng.below(3) as i32,
            rounding,
        };
        let prev = 2f32.powi(rng.below(8) as i32 - 4);
        let mk = |d: &Device| -> Result<_, KernelError> {
            Ok((
                d.upload(&[prev])?,
                d.upload(&[0.0f32])?,
                d.upload(&[0.0f32])?,
            ))
        };
        let ((mut s1, mut i1, mut a1), (mut s2, mut i2, mut a2)) = (mk(cpu)?, mk(gpu)?);
        // finite input so the scale is computed (an infinite amax would keep the previous scale)
        cast_to_fp8_current(&fc, spec, &mut s1, &mut i1, &mut a1, &mut yc)?;
        cast_to_fp8_current(&fg, spec, &mut s2, &mut i2, &mut a2, &mut yg)?;
        let name = format!(
            "cast current {}->{f} {rounding:?} m{}",
            T::NAME,
            spec.margin
        );
        rep.exact_u8(&name, &yc.to_vec()?, &yg.to_vec()?);
        let scal_c = [s1.to_vec()?[0], i1.to_vec()?[0], a1.to_vec()?[0]];
        let scal_g = [s2.to_vec()?[0], i2.to_vec()?[0], a2.to_vec()?[0]];
        rep.exact_f32(&format!("{name} scale/inv/amax"), &scal_c, &scal_g);

        // cast + transpose, both outputs
        for (r, c) in [(1000usize, 333usize), (64, 64), (256, 192), (1, 17)] {
            let m = r * c;
            let (tc, tg) = (up(cpu, &x[..m])?, up(gpu, &x[..m])?);
            let (mut o1, mut o2) = (cpu.zeros::<u8>(m)?, gpu.zeros::<u8>(m)?);
            let (mut t1, mut t2) = (cpu.zeros::<u8>(m)?, gpu.zeros::<u8>(m)?);
            let (mut a1, mut a2) = (cpu.zeros::<f32>(1)?, gpu.zeros::<f32>(1)?);
            cast_transpose_to_fp8(
                &tc,
                [r, c],
                f,
                &sc,
                &mut t1,
                Some(&mut o1),
                Some(AmaxSlot::first(&mut a1)),
            )?;
            cast_transpose_to_fp8(
                &tg,
                [r, c],
                f,
                &sg,
                &mut t2,
                Some(&mut o2),
                Some(AmaxSlot::first(&mut a2)),
            )?;
            let name = format!("cast_transpose {}->{f} {r}x{c}", T::NAME);
            rep.exact_u8(&name, &t1.to_vec()?, &t2.to_vec()?);
            rep.exact_u8(&format!("{name} (plain out)"), &o1.to_vec()?, &o2.to_vec()?);
            rep.exact_f32(&format!("{name} amax"), &a1.to_vec()?, &a2.to_vec()?);
        }
    }
    Ok(())
}

fn dequant_of<T: FloatElement>(
    rep: &mut Report,
    rng: &mut Rng,
    cpu: &Device,
    gpu: &Device,
) -> Result<(), KernelError> {
    let n = (1 << 20) + 7;
    let codes: Vec<u8> = (0..n)
        .map(|i| if i < 256 { i as u8 } else { rng.next() as u8 })
        .collect();
    for f in Fp8Format::ALL {
        let si = 2f32.powi(rng.below(30) as i32 - 15) * if rng.below(2) == 0 { 1.0 } else { 0.37 };
        let (qc, qg) = (up(cpu, &codes)?, up(gpu, &codes)?);
        let (sc, sg) = (cpu.upload(&[si])?, gpu.upload(&[si])?);
        let (mut oc, mut og) = (cpu.zeros::<T>(n)?, gpu.zeros::<T>(n)?);
        dequantize_fp8(&qc, f, &sc, &mut oc)?;
        dequantize_fp8(&qg, f, &sg, &mut og)?;
        rep.exact_buffers(&format!("dequantize {f}->{}", T::NAME), &oc, &og)?;
    }
    Ok(())
}

fn convert_pair<S: FloatElement, D: FloatElement>(
    rep: &mut Report,
    rng: &mut Rng,
    cpu: &Device,
    gpu: &Device,
) -> Result<(), KernelError> {
    let n = (1 << 18) + 5;
    let x: Vec<S> = narrow(&(0..n).map(|_| rng.cast_input()).collect::<Vec<_>>());
    let (mut oc, mut og) = (cpu.zeros::<D>(n)?, gpu.zeros::<D>(n)?);
    convert(&up(cpu, &x)?, &mut oc)?;
    convert(&up(gpu, &x)?, &mut og)?;
    rep.exact_buffers(&format!("convert {}->{}", S::NAME, D::NAME), &oc, &og)?;
    Ok(())
}

fn meta_updates(rep: &mut Report, rng: &mut Rng, gpu: &Device) -> Result<(), KernelError> {
    for (i, (amax_compute, rounding, q)) in [
        (AmaxCompute::Max, ScaleRounding::PowerOfTwo, QType::E4M3),
        (AmaxCompute::MostRecent, ScaleRounding::Exact, QType::E5M2),
        (AmaxCompute::Max, ScaleRounding::Exact, QType::F16),
    ]
    .into_iter()
    .enumerate()
    {
        let recipe = ScalingRecipe::Delayed {
            history_len: 1 + i * 7,
            amax_compute,
            margin: i as i32,
            rounding,
        };
        let mut host = ScalingMeta::new(q, recipe)?;
        // The meta's buffers on the GPU, as a model's scaling state holds them.
        let mut scale = gpu.upload(&[host.scale()])?;
        let mut scale_inv = gpu.upload(&[host.scale_inv()])?;
        let mut history = gpu.upload(&host.history())?;
        let mut state = gpu.upload(&[0u32, 0, 0])?;
        let (mut cpu_s, mut gpu_s) = (Vec::new(), Vec::new());
        for step in 0..60 {
            let a = match rng.below(12) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => 0.0,
                _ => rng.unit() * 2f32.powi(rng.below(40) as i32 - 20),
            };
            host.update_from_amax(a);
            let bufs = ScalingMetaBuffers {
                scale: &mut scale,
                scale_inv: &mut scale_inv,
                history: &mut history,
                state: &mut state,
            };
            if step % 2 == 0 {
                let mut own = gpu.upload(&[a])?;
                update_scaling_meta(bufs, q, &recipe, AmaxInput::Take(&mut own, 0))?;
            } else {
                let shared = gpu.upload(&[0.0, a])?;
                update_scaling_meta(bufs, q, &recipe, AmaxInput::Read(&shared, 1))?;
            }
            cpu_s.extend([host.scale(), host.scale_inv()]);
            gpu_s.extend([scale.to_vec()?[0], scale_inv.to_vec()?[0]]);
        }
        let ring = history.to_vec()?;
        let st = state.to_vec()?;
        let pos = st[0] as usize % ring.len().max(1);
        let oldest_first: Vec<f32> = ring[pos..].iter().chain(&ring[..pos]).copied().collect();
        let recorded = ((st[2] as u64) << 32) | st[1] as u64;
        let back = ScalingMeta::from_parts(q, recipe, scale.to_vec()?[0], &oldest_first, recorded)?;
        let same_state = back
            .history()
            .iter()
            .zip(host.history())
            // A NaN amax is kept as a NaN (window_amax skips it); its payload may differ on the GPU.
            .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
            && back.recorded() == host.recorded();
        rep.exact_f32(
            &format!("scaling meta update {q:?} {amax_compute:?} {rounding:?}"),
            &cpu_s,
            &gpu_s,
        );
        rep.line(
            "scaling meta history/recorded",
            host.history().len(),
            0.0,
            0.0,
            "bit-exact",
            same_state,
        );
    }
    Ok(())
}

/// Every f32 bit pattern through the GPU conversion vs fp8_core::Fp8Format::encode.
fn exhaustive(rep: &mut Report, gpu: &Device) -> Result<(), KernelError> {
    const CHUNK: usize = 1 << 28;
    for f in Fp8Format::ALL {
        for canonical in [true, false] {
            let mut out = gpu.zeros::<u8>(CHUNK)?;
            let (mut bad, mut bad_non_nan) = (0u64, 0u64);
            let mut examples: Vec<(u32, u8, u8)> = Vec::new();
            let mut nan_codes = std::collections::BTreeMap::<u8, u64>::new();
            for c in 0..(1usize << 32) / CHUNK {
                let start = (c * CHUNK) as u32;
                fp8_encode_bit_patterns(start, f, canonical, &mut out)?;
                let got = out.to_vec()?;
                let (b, bn, ex, nans) = got
                    .par_chunks(1 << 20)
                    .enumerate()
                    .map(|(k, part)| {
                        let mut r = (
                            0u64,
                            0u64,
                            Vec::new(),
                            std::collections::BTreeMap::<u8, u64>::new(),
                        );
                        for (j, &g) in part.iter().enumerate() {
                            let bits = start + (k << 20) as u32 + j as u32;
                            let v = f32::from_bits(bits);
                            if v.is_nan() {
                                *r.3.entry(g).or_insert(0) += 1;
                            }
                            let want = f.encode(v);
                            if g != want {
                                r.0 += 1;
                                if !v.is_nan() {
                                    r.1 += 1;
                                }
                                if r.2.len() < 5 {
                                    r.2.push((bits, g, want));
                                }
                            }
                        }
                        r
                    })
                    .reduce(
                        || (0, 0, Vec::new(), Default::default()),
                        |mut a, b| {
                            a.0 += b.0;
                            a.1 += b.1;
                            a.2.extend(b.2);
                            for (k, v) in b.3 {
                                *a.3.entry(k).or_insert(0) += v;
                            }
                            a
                        },
                    );
                bad += b;
                bad_non_nan += bn;
                for e in ex {
                    if examples.len() < 5 {
                        examples.push(e);
                    }
                }
                for (k, v) in nans {
                    *nan_codes.entry(k).or_insert(0) += v;
                }
            }
            let kind = if canonical {
                "cast kernels' conversion"
            } else {
                "bare hardware cvt"
            };
            for (bits, g, w) in &examples {
                println!(
                    "    {f} {kind}: input {bits:#010x} ({:e}) gpu {g:#04x} cpu {w:#04x}",
                    f32::from_bits(*bits)
                );
            }
            println!("    {f} {kind}: NaN inputs became codes {nan_codes:02x?}");
            // The bare instruction is informative only for NaN (fp8-core's NaN code is a choice); any
            // non-NaN mismatch fails either way.
            let pass = if canonical {
                bad == 0
            } else {
                bad_non_nan == 0
            };
            rep.line(
                &format!("exhaustive 2^32 {f} {kind}"),
                1usize << 32,
                bad as f64,
                bad_non_nan as f64,
                "mismatches / non-NaN",
                pass,
            );
        }
    }
    Ok(())
}

fn run(seed: u64, skip_exhaustive: bool) -> Result<usize, KernelError> {
    let gpu = Device::cuda(0)?;
    if let Device::Cuda(d) = &gpu {
        d.require_fp8()?;
        println!(
            "device: CUDA {} compute capability {:?}",
            d.ordinal(),
            d.compute_capability()
        );
    }
    let cpu = Device::cpu();
    let mut rng = Rng(seed | 1);
    let mut rep = Report { failures: 0 };
    println!(
        "{:<44} {:>11} {:>12} {:>12}  {:<22} result",
        "check", "size", "max abs", "max rel", "bound"
    );
    casts_of::<f32>(&mut rep, &mut rng, &cpu, &gpu)?;
    casts_of::<bf16>(&mut rep, &mut rng, &cpu, &gpu)?;
    casts_of::<f16>(&mut rep, &mut rng, &cpu, &gpu)?;
    dequant_of::<f32>(&mut rep, &mut rng, &cpu, &gpu)?;
    dequant_of::<bf16>(&mut rep, &mut rng, &cpu, &gpu)?;
    dequant_of::<f16>(&mut rep, &mut rng, &cpu, &gpu)?;
    convert_pair::<f32, bf16>(&mut rep, &mut rng, &cpu, &gpu)?;
    convert_pair::<f32, f16>(&mut rep, &mut rng, &cpu, &gpu)?;
    convert_pair::<bf16, f32>(&mut rep, &mut rng, &cpu, &gpu)?;
    convert_pair::<f16, f32>(&mut rep, &mut rng, &cpu, &gpu)?;
    convert_pair::<bf16, f16>(&mut rep, &mut rng, &cpu, &gpu)?;
    convert_pair::<f16, bf16>(&mut rep, &mut rng, &cpu, &gpu)?;
    meta_updates(&mut rep, &mut rng, &gpu)?;
    ops_checks::<f32>(&mut rep, &mut rng, &cpu, &gpu)?;
    ops_checks::<bf16>(&mut rep, &mut rng, &cpu, &gpu)?;
    f32_only_ops(&mut rep, &mut rng, &cpu, &gpu)?;
    if skip_exhaustive {
        println!("exhaustive FP8 check skipped (--skip-exhaustive)");
    } else {
        exhaustive(&mut rep, &gpu)?;
    }
    Ok(rep.failures)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5EED);
    let mut skip_exhaustive = false;
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--seed" => {
                match args.get(i + 1).and_then(|s| s.parse().ok()) {
                    Some(s) => seed = s,
                    None => {
                        eprintln!("--seed needs an integer");
                        return ExitCode::from(2);
                    }
                }
                i += 1;
            }
            "--skip-exhaustive" => skip_exhaustive = true,
            other => {
                eprintln!(
                    "unknown argument {other}; usage: kernel_check [--seed N] [--skip-exhaustive]"
                );
                return ExitCode::from(2);
            }
        }
        i += 1;
    }
    println!("kernel_check seed {seed}");
    match run(seed, skip_exhaustive) {
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
