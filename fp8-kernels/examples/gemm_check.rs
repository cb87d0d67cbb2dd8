//! GPU check of the GEMM, Adam and linear kernels: random inputs (fresh seed per run, printed), the CUDA
//! result against the CPU implementation, one PASS/FAIL line per check with the bound it had to meet.
//! Exit code 1 if any check fails, and without a usable GPU (saying why: nothing was checked).
//!
//! Bounds: Adam (F32 and low-precision states) and the FP8 casts inside the linear op must be
//! bit-identical; GEMMs must satisfy `|gpu - cpu| <= rel * (|alpha| sum_k |a b| + |beta c|)` with rel 1e-5
//! for F32/BF16 inputs (f32 output), 2.5e-4 for FP8 (Hopper FP8 tensor cores accumulate with about 14
//! significant bits between promotions to f32; the worst seen on the H200 was 1.24e-4), plus 2^-7 of the
//! value (one bf16 ulp) for bf16 outputs.

use fp8_core::Fp8Format;
use fp8_kernels::adam::{adam_step_f32, adam_step_low_precision, AmaxSlots};
use fp8_kernels::gemm::{gemm, gemm_at, gemm_f32, gemm_f32_host, gemm_fp8, gemm_fp8_at};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{
    AdamConfig, Buffer, Device, DeviceScalar, Element, Fp8Matrix, GemmOutput, GemmSpec,
    LowPrecisionAdamState, Transpose, WeightDecay,
};
use half::{bf16, f16};
use std::process::ExitCode;

/// The workspace generator with this file's own float mappings on top.
struct Rng(SplitMix64);
impl Rng {
    /// Uniform in [-scale, scale), never exactly zero.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = ((self.0.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
                (u * 2.0 - 1.0) * scale
            })
            .collect()
    }
    fn fp8(&mut self, n: usize, f: Fp8Format) -> Vec<u8> {
        self.vec(n, 1.0)
            .into_iter()
            .map(|v| f.encode(v * f.max() * 0.5))
            .collect()
    }
}

#[derive(Default)]
struct Report {
    failed: usize,
    passed: usize,
}

impl Report {
    fn line(&mut self, ok: bool, name: &str, detail: String) {
        if ok {
            self.passed += 1;
            println!("PASS {name}: {detail}");
        } else {
            self.failed += 1;
            println!("FAIL {name}: {detail}");
        }
    }
    fn error(&mut self, name: &str, e: impl std::fmt::Display) {
        self.failed += 1;
        println!("FAIL {name}: error {e}");
    }
}

/// Worst `|g - c| / (rel * mag)` over the elements (<= 1 passes), with `mag` the error scale.
/// Relative bound of FP8 GEMMs against the f32 CPU result (see the module docs).
const FP8_REL: f64 = 2.5e-4;

fn worst(gpu: &[f32], cpu: &[f32], mag: &[f32], rel: f64, bf16_out: bool) -> f64 {
    gpu.iter()
        .zip(cpu)
        .zip(mag)
        .map(|((g, c), m)| {
            // A bf16 output may differ by one bf16 ulp when the two f32 accumulations straddle a
            // rounding boundary: at most 2^-7 of the value (7 stored mantissa bits).
            let extra = if bf16_out {
                (*c as f64).abs() * 2f64.powi(-7)
            } else {
                0.0
            };
            ((*g as f64) - (*c as f64)).abs() / (rel * *m as f64 + extra + 1e-30)
        })
        .fold(0.0, f64::max)
}

/// The error scale `|alpha| (|op(A)| |op(B)|) + |beta c|` (an f32 GEMM of absolute values).
fn magnitude(spec: &GemmSpec, a: &[f32], b: &[f32], c: &[f32]) -> Vec<f32> {
    let abs = |x: &[f32]| x.iter().map(|v| v.abs()).collect::<Vec<_>>();
    let mut out = abs(c);
    let s = GemmSpec {
        alpha: spec.alpha.abs(),
        beta: spec.beta.abs(),
        ..*spec
    };
    if gemm_f32_host(&s, &abs(a), &abs(b), &mut out).is_err() {
        return vec![f32::INFINITY; c.len()];
    }
    out
}

fn to_f32<T: GemmOutput>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

fn both<T: Element>(gpu: &Device, host: &[T]) -> Result<(Buffer<T>, Buffer<T>), String> {
    Ok((
        Device::cpu().upload(host).map_err(|e| e.to_string())?,
        gpu.upload(host).map_err(|e| e.to_string())?,
    ))
}

const TRANSPOSES: [(Transpose, Transpose); 4] = [
    (Transpose::No, Transpose::No),
    (Transpose::No, Transpose::Yes),
    (Transpose::Yes, Transpose::No),
    (Transpose::Yes, Transpose::Yes),
];

fn check_float_gemms(gpu: &Device, rng: &mut Rng, r: &mut Report) -> Result<(), String> {
    for (m, n, k) in [(127, 65, 91), (256, 128, 512), (1, 300, 17)] {
        for (ta, tb) in TRANSPOSES {
            let spec = GemmSpec::new(m, n, k).transposes(ta, tb).scalars(1.5, 0.5);
            let a = rng.vec(m * k, 2.0);
            let b = rng.vec(k * n, 2.0);
            let c = rng.vec(m * n, 2.0);
            let mag = magnitude(&spec, &a, &b, &c);
            // F32
            let (ac, ag) = both(gpu, &a)?;
            let (bc, bg) = both(gpu, &b)?;
            let (mut cc, mut cg) = both(gpu, &c)?;
            let res = gemm_f32(&spec, &ac, &bc, &mut cc).and(gemm_f32(&spec, &ag, &bg, &mut cg));
            let name = format!("gemm_f32 {m}x{n}x{k} {ta:?}/{tb:?} alpha 1.5 beta 0.5");
            match res.and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?))) {
                Ok((hc, hg)) => {
                    let w = worst(&hg, &hc, &mag, 1e-5, false);
                    r.line(w <= 1.0, &name, format!("worst error / bound = {w:.3}"));
                }
                Err(e) => r.error(&name, e),
            }
            // BF16 -> f32 and bf16
            let a16: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
            let b16: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let mag16 = magnitude(&spec, &to_f32(&a16), &to_f32(&b16), &c);
            let (ac, ag) = both(gpu, &a16)?;
            let (bc, bg) = both(gpu, &b16)?;
            let (mut cc, mut cg) = both(gpu, &c)?;
            let name = format!("gemm_bf16->f32 {m}x{n}x{k} {ta:?}/{tb:?}");
            match gemm(&spec, &ac, &bc, &mut cc)
                .and(gemm(&spec, &ag, &bg, &mut cg))
                .and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?)))
            {
                Ok((hc, hg)) => {
                    let w = worst(&hg, &hc, &mag16, 1e-5, false);
                    r.line(w <= 1.0, &name, format!("worst error / bound = {w:.3}"));
                }
                Err(e) => r.error(&name, e),
            }
            let c16: Vec<bf16> = c.iter().map(|&v| bf16::from_f32(v)).collect();
            let (mut cc, mut cg) = both(gpu, &c16)?;
            let name = format!("gemm_bf16->bf16 {m}x{n}x{k} {ta:?}/{tb:?}");
            match gemm(&spec, &ac, &bc, &mut cc)
                .and(gemm(&spec, &ag, &bg, &mut cg))
                .and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?)))
            {
                Ok((hc, hg)) => {
                    let w = worst(&to_f32(&hg), &to_f32(&hc), &mag16, 1e-5, true);
                    r.line(w <= 1.0, &name, format!("worst error / bound = {w:.3}"));
                }
                Err(e) => r.error(&name, e),
            }
        }
    }
    Ok(())
}

fn check_fp8_gemms(gpu: &Device, rng: &mut Rng, r: &mut Report) -> Result<(), String> {
    // (100, 36, 68): transposed operands whose columns are multiples of 4 with padded edges (the
    // 4-byte transpose), (100, 37, 70): ones that are not (the byte transpose).
    let shapes = [(256, 128, 512), (100, 37, 70), (100, 36, 68), (64, 144, 16)];
    let formats = [
        (Fp8Format::E4M3, Fp8Format::E4M3),
        (Fp8Format::E5M2, Fp8Format::E4M3),
        (Fp8Format::E4M3, Fp8Format::E5M2),
        (Fp8Format::E5M2, Fp8Format::E5M2),
    ];
    let scales = [0.0f32, 0.125, 4.0];
    let (sc, sg) = both(gpu, &scales)?;
    for (m, n, k) in shapes {
        for (ta, tb) in TRANSPOSES {
            for (fa, fb) in formats {
                for beta in [0.0f32, 1.0] {
                    let spec = GemmSpec::new(m, n, k).transposes(ta, tb).scalars(1.0, beta);
                    let a = rng.fp8(m * k, fa);
                    let b = rng.fp8(k * n, fb);
                    let c = rng.vec(m * n, 100.0);
                    let ad: Vec<f32> = a.iter().map(|&q| fa.decode(q) * scales[1]).collect();
                    let bd: Vec<f32> = b.iter().map(|&q| fb.decode(q) * scales[2]).collect();
                    let mag = magnitude(&spec, &ad, &bd, &c);
                    let (ac, ag) = both(gpu, &a)?;
                    let (bc, bg) = both(gpu, &b)?;
                    let name =
                        format!("gemm_fp8 {fa}x{fb}->f32 {m}x{n}x{k} {ta:?}/{tb:?} beta {beta}");
                    let (mut cc, mut cg) = both(gpu, &c)?;
                    match gemm_fp8(&spec, op(&ac, fa, &sc, 1), op(&bc, fb, &sc, 2), &mut cc)
                        .and(gemm_fp8(
                            &spec,
                            op(&ag, fa, &sg, 1),
                            op(&bg, fb, &sg, 2),
                            &mut cg,
                        ))
                        .and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?)))
                    {
                        Ok((hc, hg)) => {
                            let w = worst(&hg, &hc, &mag, FP8_REL, false);
                            r.line(w <= 1.0, &name, format!("worst error / bound = {w:.3}"));
                        }
                        Err(e) => r.error(&name, e),
                    }
                    let c16: Vec<bf16> = c.iter().map(|&v| bf16::from_f32(v)).collect();
                    let (mut cc, mut cg) = both(gpu, &c16)?;
                    let name =
                        format!("gemm_fp8 {fa}x{fb}->bf16 {m}x{n}x{k} {ta:?}/{tb:?} beta {beta}");
                    match gemm_fp8(&spec, op(&ac, fa, &sc, 1), op(&bc, fb, &sc, 2), &mut cc)
                        .and(gemm_fp8(
                            &spec,
                            op(&ag, fa, &sg, 1),
                            op(&bg, fb, &sg, 2),
                            &mut cg,
                        ))
                        .and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?)))
                    {
                        Ok((hc, hg)) => {
                            let w = worst(&to_f32(&hg), &to_f32(&hc), &mag, FP8_REL, true);
                            r.line(w <= 1.0, &name, format!("worst error / bound = {w:.3}"));
                        }
                        Err(e) => r.error(&name, e),
                    }
                }
            }
        }
    }
    Ok(())
}

/// `gemm_fp8_at` and `gemm_at` (BF16 operands) with beta 1 into an F32 buffer with elements before and
/// after `C`, at offsets the direct path takes (0, 64: 256-byte aligned, m, n, k multiples of 16) and ones
/// that go through a temporary (3, and a shape of no multiples of 16): `C` against the CPU within the GEMM
/// bounds, every element outside it unchanged.
fn check_gemms_into_a_range(gpu: &Device, rng: &mut Rng, r: &mut Report) -> Result<(), String> {
    let scales = [0.0f32, 0.125, 4.0];
    let (sc, sg) = both(gpu, &scales)?;
    for (m, n, k) in [(256, 128, 512), (100, 37, 70)] {
        for offset in [0usize, 64, 3] {
            for (ta, tb) in [
                (Transpose::No, Transpose::Yes),
                (Transpose::Yes, Transpose::Yes),
            ] {
                let spec = GemmSpec::new(m, n, k).transposes(ta, tb).scalars(1.0, 1.0);
                let big = rng.vec(offset + m * n + 5, 100.0);
                let (fa, fb) = (Fp8Format::E5M2, Fp8Format::E4M3);
                let (a, b) = (rng.fp8(m * k, fa), rng.fp8(k * n, fb));
                let ad: Vec<f32> = a.iter().map(|&q| fa.decode(q) * scales[1]).collect();
                let bd: Vec<f32> = b.iter().map(|&q| fb.decode(q) * scales[2]).collect();
                let mag = magnitude(&spec, &ad, &bd, &big[offset..offset + m * n]);
                let (ac, ag) = both(gpu, &a)?;
                let (bc, bg) = both(gpu, &b)?;
                let (mut cc, mut cg) = both(gpu, &big)?;
                let name = format!("gemm_fp8_at {m}x{n}x{k} {ta:?}/{tb:?} offset {offset}");
                let run = gemm_fp8_at(
                    &spec,
                    op(&ac, fa, &sc, 1),
                    op(&bc, fb, &sc, 2),
                    &mut cc,
                    offset,
                )
                .and(gemm_fp8_at(
                    &spec,
                    op(&ag, fa, &sg, 1),
                    op(&bg, fb, &sg, 2),
                    &mut cg,
                    offset,
                ))
                .and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?)));
                range_line(r, &name, run, (&big, offset, m * n), &mag);

                let a16: Vec<bf16> = ad.iter().map(|&v| bf16::from_f32(v)).collect();
                let b16: Vec<bf16> = bd.iter().map(|&v| bf16::from_f32(v)).collect();
                let (ac, ag) = both(gpu, &a16)?;
                let (bc, bg) = both(gpu, &b16)?;
                let (mut cc, mut cg) = both(gpu, &big)?;
                let name = format!("gemm_at bf16->f32 {m}x{n}x{k} {ta:?}/{tb:?} offset {offset}");
                let run = gemm_at(&spec, &ac, &bc, &mut cc, offset)
                    .and(gemm_at(&spec, &ag, &bg, &mut cg, offset))
                    .and_then(|_| Ok((cc.to_vec()?, cg.to_vec()?)));
                range_line(r, &name, run, (&big, offset, m * n), &mag);
            }
        }
    }
    Ok(())
}

/// One line for a GEMM into a range: inside it the GPU against the CPU (FP8 bound), outside it the GPU's
/// buffer bit for bit as it was.
fn range_line(
    r: &mut Report,
    name: &str,
    run: Result<(Vec<f32>, Vec<f32>), fp8_kernels::KernelError>,
    (before, offset, mn): (&[f32], usize, usize),
    mag: &[f32],
) {
    match run {
        Ok((hc, hg)) => {
            let range = offset..offset + mn;
            let w = worst(&hg[range.clone()], &hc[range.clone()], mag, FP8_REL, false);
            let kept = hg
                .iter()
                .zip(before)
                .enumerate()
                .filter(|(i, _)| !range.contains(i))
                .all(|(_, (g, b))| g.to_bits() == b.to_bits());
            r.line(
                w <= 1.0 && kept,
                name,
                format!("worst error / bound = {w:.3}, outside C unchanged: {kept}"),
            );
        }
        Err(e) => r.error(name, e),
    }
}

fn op<'a>(d: &'a Buffer<u8>, f: Fp8Format, s: &'a Buffer<f32>, i: usize) -> Fp8Matrix<'a> {
    Fp8Matrix {
        data: d,
        format: f,
        scale_inv: DeviceScalar {
            buffer: s,
            index: i,
        },
    }
}

fn bits_equal<T: bytemuck::Pod>(a: &[T], b: &[T]) -> (bool, usize) {
    let (x, y): (&[u8], &[u8]) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
    let size = std::mem::size_of::<T>().max(1);
    let diffs = x
        .chunks(size)
        .zip(y.chunks(size))
        .filter(|(p, q)| p != q)
        .count();
    (x.len() == y.len() && diffs == 0, diffs)
}

fn check_adam(gpu: &Device, rng: &mut Rng, r: &mut Report) -> Result<(), String> {
    let n = 100_003;
    for (decay, maximize) in [(WeightDecay::Decoupled, false), (WeightDecay::L2, true)] {
        let cfg = AdamConfig {
            lr: 3e-3,
            weight_decay: 0.05,
            decay_mode: decay,
            maximize,
            ..AdamConfig::default()
        };
        for range in [0..n, 16..n - 5, 3..n - 1] {
            let e = |e: fp8_kernels::KernelError| e.to_string();
            // F32 states, bf16 gradient
            let w0 = rng.vec(n, 1.0);
            let (mut wc, mut wg) = both(gpu, &w0)?;
            let (mut mc, mut mg) = both(gpu, &vec![0.0f32; n])?;
            let (mut vc, mut vg) = both(gpu, &vec![0.0f32; n])?;
            let (mut ac, mut ag) = both(gpu, &[0.0f32; 2])?;
            for step in 1..=5 {
                let g: Vec<bf16> = rng.vec(n, 0.1).into_iter().map(bf16::from_f32).collect();
                let (gc, gg) = both(gpu, &g)?;
                let coef = cfg.coefficients(step, 0.5).map_err(e)?;
                adam_step_f32(
                    &coef,
                    range.clone(),
                    &mut wc,
                    &mut mc,
                    &mut vc,
                    &gc,
                    Some(AmaxSlots {
                        buffer: &mut ac,
                        base: 1,
                    }),
                )
                .map_err(e)?;
                adam_step_f32(
                    &coef,
                    range.clone(),
                    &mut wg,
                    &mut mg,
                    &mut vg,
                    &gg,
                    Some(AmaxSlots {
                        buffer: &mut ag,
                        base: 1,
                    }),
                )
                .map_err(e)?;
            }
            let mut diffs = 0;
            let mut ok = true;
            for (x, y) in [(&wc, &wg), (&mc, &mg), (&vc, &vg), (&ac, &ag)] {
                let (o, d) = bits_equal(&x.to_vec().map_err(e)?, &y.to_vec().map_err(e)?);
                ok &= o;
                diffs += d;
            }
            r.line(
                ok,
                &format!("adam f32 states {decay:?} maximize {maximize} range {range:?}, 5 steps"),
                format!("bit-identical master/m/v/amax required; {diffs} elements differ"),
            );

            // low-precision states, f32 gradient
            let wl: Vec<f16> = w0.iter().map(|&v| f16::from_f32(v * 1024.0)).collect();
            let (mut wlc, mut wlg) = both(gpu, &wl)?;
            let (mut mlc, mut mlg) = both(gpu, &vec![0u8; n])?;
            let (mut vlc, mut vlg) = both(gpu, &vec![f16::ZERO; n])?;
            let (mut alc, mut alg) = both(gpu, &[0.0f32; 3])?;
            let scales = [
                1.0 / 1024.0,
                1024.0,
                1.0 / 4096.0,
                4096.0,
                1.0 / 65536.0,
                65536.0 * 16.0,
            ];
            let (sc, sg) = both(gpu, &scales)?;
            for step in 1..=3 {
                let g = rng.vec(n, 0.1);
                let (gc, gg) = both(gpu, &g)?;
                let coef = cfg.coefficients(step, 1.0).map_err(e)?;
                // read scale of the next step = write scale of this one: keep the pair consistent
                adam_step_low_precision(
                    &coef,
                    range.clone(),
                    LowPrecisionAdamState {
                        master: &mut wlc,
                        m: &mut mlc,
                        v: &mut vlc,
                    },
                    &gc,
                    &sc,
                    0,
                    AmaxSlots {
                        buffer: &mut alc,
                        base: 0,
                    },
                )
                .map_err(e)?;
                adam_step_low_precision(
                    &coef,
                    range.clone(),
                    LowPrecisionAdamState {
                        master: &mut wlg,
                        m: &mut mlg,
                        v: &mut vlg,
                    },
                    &gg,
                    &sg,
                    0,
                    AmaxSlots {
                        buffer: &mut alg,
                        base: 0,
                    },
                )
                .map_err(e)?;
            }
            let (o1, d1) = bits_equal(&wlc.to_vec().map_err(e)?, &wlg.to_vec().map_err(e)?);
            let (o2, d2) = bits_equal(&mlc.to_vec().map_err(e)?, &mlg.to_vec().map_err(e)?);
            let (o3, d3) = bits_equal(&vlc.to_vec().map_err(e)?, &vlg.to_vec().map_err(e)?);
            let (o4, d4) = bits_equal(&alc.to_vec().map_err(e)?, &alg.to_vec().map_err(e)?);
            r.line(o1 && o2 && o3 && o4,
                   &format!("adam low-precision {decay:?} maximize {maximize} range {range:?}, 3 steps"),
                   format!("bit-identical f16 master / e4m3 m / f16 v / amaxes required; differing: {d1}/{d2}/{d3}/{d4}"));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("gemm_check: no usable GPU, nothing checked ({e})");
            return ExitCode::FAILURE;
        }
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5EED);
    println!("gemm_check: seed {seed:#x}");
    let mut rng = Rng(SplitMix64::new(seed));
    let mut report = Report::default();
    for (name, f) in [
        (
            "float GEMMs",
            check_float_gemms as fn(&Device, &mut Rng, &mut Report) -> Result<(), String>,
        ),
        ("FP8 GEMMs", check_fp8_gemms),
        ("GEMMs into a range", check_gemms_into_a_range),
        ("Adam", check_adam),
    ] {
        if let Err(e) = f(&gpu, &mut rng, &mut report) {
            report.error(name, e);
        }
    }
    println!(
        "gemm_check: {} passed, {} failed",
        report.passed, report.failed
    );
    if report.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
