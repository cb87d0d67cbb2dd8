//! The attention kernels of `attention.cu` and the wgmma forward of `attention_wgmma.cu`, run on the CPU
//! by a host emulator, against the CPU reference: the GPU test's comparisons for machines without a GPU.
//! For the wgmma forward the emulator's wgmma follows the same reading of the PTX ISA (descriptors,
//! swizzle, fragments) as the kernel, so it checks everything but that reading, which the GPU probes
//! (`attention_cuda`'s `wgmma_probes_match_cpu`) check.
//!
//! `attention_common/emulator.cpp` compiles `attention.cu` itself with a C++ compiler (one std::thread
//! per CUDA thread; ldmatrix, mma, cp.async and shuffles emulated from the PTX ISA's element mappings;
//! shared and global addresses checked; AddressSanitizer where the compiler has it). The kernels' own
//! index arithmetic, tile loops, masks, double buffering, dQ splits and synchronisation run as written, so
//! a bug there fails here. What this cannot catch: a misreading of the PTX specification shared by the
//! kernels and the emulator, timing-dependent races beyond the two cp.async extremes run here, and
//! performance. The GPU tests (`attention_cuda.rs`) settle those.
//!
//! Needs a C++20 compiler (`CXX`, else `g++`, else `c++`): ignored, with the reason, where the build found
//! none (`build.rs`), and failing where the compiler found then is missing or cannot build the emulator.
//! Small shapes only: every CUDA thread is an OS thread.

mod attention_common;

use attention_common::{
    assert_no_failures, check_all, check_forward, cycled_variants, inputs, matrix_probe_ok,
    probe_name, probe_ok, reference, wgmma_probe_name, wgmma_probes, wgmma_shapes, Inputs, Outputs,
    ProbeCase, WgmmaProbeCase, PROBES,
};
use fp8_kernels::attention::{
    default_wgmma_backward_tiles, default_wgmma_tiles, wgmma_backward_variants,
    wgmma_forward_variants, AttentionConfig, AttentionShape, BackwardKernels, LayoutProbe,
    WgmmaBackwardTiles, WgmmaProbe,
};
use half::bf16;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The emulator binary, built once per test binary.
fn emulator() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(build).clone()
}

fn build() -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/attention_common/emulator.cpp");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("attention_emulator");
    let compilers: Vec<String> = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["g++".to_string(), "c++".to_string()])
        .collect();
    let Some(cxx) = compilers.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }) else {
        panic!("no C++ compiler (CXX, g++, c++) to build the kernel emulator");
    };
    let base = [
        "-std=c++20",
        "-O1",
        "-pthread",
        "-Wall",
        "-Wno-unknown-pragmas",
        "-Wno-unused-function",
        // GCC notes that 64-byte aligned parameters (the TMA maps) changed ABI in GCC 4.6.
        "-Wno-psabi",
    ];
    let mut logs = String::new();
    for sanitize in [true, false] {
        let mut cmd = Command::new(&cxx);
        cmd.args(base);
        if sanitize {
            cmd.arg("-fsanitize=address");
        }
        cmd.arg("-o").arg(&out).arg(&src);
        let o = cmd.output().expect("running the C++ compiler");
        if o.status.success() {
            if !sanitize {
                println!("note: emulator built without AddressSanitizer (not available)");
            }
            return out;
        }
        logs.push_str(&String::from_utf8_lossy(&o.stderr));
        if !sanitize {
            break;
        }
    }
    panic!("the emulator does not compile with {cxx}:\n{logs}");
}

fn write<T: bytemuck::Pod>(path: &Path, v: &[T]) {
    std::fs::write(path, bytemuck::cast_slice(v)).unwrap();
}

fn read<T: bytemuck::Pod>(path: &Path, n: usize) -> Vec<T> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(bytes.len(), n * std::mem::size_of::<T>(), "{path:?}");
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes);
    v
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Emulator arguments of one kernel variant (after the shape and scale).
#[derive(Clone)]
struct Variant {
    name: String,
    copies: &'static str,
    fwd: String,
    bwd: String,
}

/// The emulator's name of a backward choice (deterministic fused backward with `splits`, 0 = default).
fn bwd_arg(b: &BackwardKernels, splits: usize) -> String {
    match b {
        BackwardKernels::Fused { query_rows } => format!("fused:q{query_rows}:det:{splits}"),
        BackwardKernels::Separate { dkdv, dq } => format!("sep:{dkdv}:{dq}"),
    }
}

/// The variants run for head dim `hd`: the simple kernels; the defaults (cp.async copies done at issue,
/// and only at the wait); with `all`, every compiled forward, dK/dV and dQ variant (the i-th of each
/// list together) and the fused backward with 64-row tiles and the default splits, with 32-row tiles and
/// two splits, and with atomics.
fn variants(hd: usize, all: bool) -> Vec<Variant> {
    let (fwd, bwd) = AttentionConfig::default().kernels_for(hd).unwrap();
    let v = |name: String, copies, fwd: String, bwd: String| Variant {
        name,
        copies,
        fwd,
        bwd,
    };
    let mut out = vec![
        v("simple".into(), "early", "simple".into(), "simple".into()),
        v(
            format!("default {fwd} {bwd}"),
            "early",
            fwd.to_string(),
            bwd_arg(&bwd, 0),
        ),
        v(
            format!("default {fwd} {bwd}, late copies"),
            "late",
            fwd.to_string(),
            bwd_arg(&bwd, 0),
        ),
    ];
    if !all {
        return out;
    }
    for (i, (f, b)) in cycled_variants(hd).into_iter().enumerate() {
        out.push(v(
            format!("{f} {b}"),
            if i % 2 == 0 { "late" } else { "early" },
            f.to_string(),
            bwd_arg(&b, 0),
        ));
    }
    out.push(v(
        "fused q64".into(),
        "late",
        fwd.to_string(),
        "fused:q64:det:0".into(),
    ));
    out.push(v(
        "fused q32 splits 2".into(),
        "early",
        fwd.to_string(),
        "fused:q32:det:2".into(),
    ));
    out.push(v(
        "fused q64 atomic".into(),
        "early",
        fwd.to_string(),
        "fused:q64:atomic".into(),
    ));
    out
}

fn run(bin: &Path, inp: &Inputs, v: &Variant, scale: f32, dir: &Path) -> Result<Outputs, String> {
    run_with(bin, inp, v, scale, dir, &[])
}

/// [`run`] with environment variables for the emulator.
fn run_with(
    bin: &Path,
    inp: &Inputs,
    v: &Variant,
    scale: f32,
    dir: &Path,
    env: &[(&str, &str)],
) -> Result<Outputs, String> {
    let s = &inp.shape;
    write(&dir.join("qkv.bin"), &inp.x);
    write(&dir.join("dout.bin"), &inp.dy);
    let o = Command::new(bin)
        .envs(env.iter().copied())
        .arg("run")
        .arg(dir)
        .arg(dir)
        .args([s.batch, s.heads, s.kv_heads, s.seq_len, s.head_dim].map(|x| x.to_string()))
        .arg(format!("{scale:e}"))
        .arg(v.copies)
        .arg(&v.fwd)
        .arg(&v.bwd)
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(format!(
            "emulator failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    let f = |v: Vec<bf16>| v.iter().map(|b| b.to_f32()).collect::<Vec<_>>();
    Ok(Outputs {
        out: f(read(&dir.join("out.bin"), s.out_len())),
        lse: read(&dir.join("lse.bin"), s.lse_len()),
        dqkv: f(read(&dir.join("dqkv.bin"), s.qkv_len())),
    })
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_layout_probes_match_cpu() {
    let bin = emulator();
    let dir = scratch("attention_emulated_probes");
    let case = ProbeCase::new(11);
    let a16: Vec<bf16> = case.a.iter().map(|&v| bf16::from_f32(v)).collect();
    write(&dir.join("b.bin"), &case.b16);
    let mut ok = true;
    for probe in PROBES {
        let which = match probe {
            LayoutProbe::ABt => "abt",
            LayoutProbe::PB => "pb",
            LayoutProbe::AtB => "atb",
        };
        if probe == LayoutProbe::PB {
            write(&dir.join("a.bin"), &case.a);
        } else {
            write(&dir.join("a.bin"), &a16);
        }
        let o = Command::new(&bin)
            .args(["probe", which])
            .arg(&dir)
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "probe {which}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let got: Vec<f32> = read(&dir.join("out.bin"), 64 * 64);
        ok &= probe_ok(probe_name(probe), &got, &case.want(probe));
    }
    assert!(ok, "a layout probe failed (see the lines above)");
}

/// Shapes: every head dim, `T` below, at and across the 64-row tiles, a partial last tile; whether to
/// run every variant there (the emulator is slow: one OS thread per CUDA thread), which the cases
/// with several blocks in each direction and partial last blocks (T = 130, 200) do.
fn cases() -> Vec<(AttentionShape, Option<f32>, bool)> {
    let mut v = Vec::new();
    for hd in [32, 64, 128] {
        for (b, h, t) in [(1, 1, 1), (1, 2, 17), (2, 1, 64), (1, 1, 130)] {
            v.push((AttentionShape::new(b, h, t, hd), None, t == 130));
        }
    }
    v.push((AttentionShape::new(1, 1, 200, 64), Some(0.3), true));
    v
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_kernels_match_cpu() {
    let bin = emulator();
    let dir = scratch("attention_emulated_kernels");
    let mut fails = Vec::new();
    for (i, (shape, scale, all)) in cases().into_iter().enumerate() {
        let inp = inputs(shape, 500 + i as u64);
        let scale = AttentionConfig {
            softmax_scale: scale,
            ..Default::default()
        }
        .scale_for(shape.head_dim);
        let want = reference(&inp, scale);
        for v in &variants(shape.head_dim, all) {
            let label = format!(
                "B{} H{} T{} hd{} scale {scale:.3} [emulated {}]",
                shape.batch, shape.heads, shape.seq_len, shape.head_dim, v.name
            );
            match run(&bin, &inp, v, scale, &dir) {
                Ok(got) => fails.extend(check_all(&label, &shape, &got, &want)),
                Err(e) => {
                    println!("FAIL {label}: {e}");
                    fails.push(format!("{label}: {e}"));
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_deterministic_backward_repeats_bits() {
    let bin = emulator();
    let dir = scratch("attention_emulated_determinism");
    let inp = inputs(AttentionShape::new(1, 2, 150, 32), 9);
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    // The fused backward with two splits per head (several blocks add into their own buffers) and the
    // default (separate) backward.
    for v in variants(32, true)
        .into_iter()
        .filter(|v| v.name.starts_with("default") || v.name == "fused q32 splits 2")
    {
        let a = run(&bin, &inp, &v, 0.2, &dir).unwrap();
        let b = run(&bin, &inp, &v, 0.2, &dir).unwrap();
        assert_eq!(bits(&a.dqkv), bits(&b.dqkv), "{}", v.name);
        assert_eq!(bits(&a.out), bits(&b.out), "{}", v.name);
    }
}

/// Grouped-query shapes (`kv_heads` < `heads`): groups of 2 and 4, one key/value head, `T` across the
/// 64-row tiles with a partial last tile; every variant on the first (the dK/dV group sum runs in the
/// separate dK/dV kernels, both warp layouts, and in the fused kernel with splits and atomics).
fn gqa_cases() -> Vec<(AttentionShape, bool)> {
    vec![
        (AttentionShape::gqa(1, 4, 2, 130, 32), true),
        (AttentionShape::gqa(2, 4, 1, 70, 64), false),
        (AttentionShape::gqa(1, 4, 1, 65, 128), false),
    ]
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_gqa_kernels_match_cpu() {
    let bin = emulator();
    let dir = scratch("attention_emulated_gqa");
    let mut fails = Vec::new();
    for (i, (shape, all)) in gqa_cases().into_iter().enumerate() {
        let inp = inputs(shape, 700 + i as u64);
        let scale = AttentionConfig::default().scale_for(shape.head_dim);
        let want = reference(&inp, scale);
        for v in &variants(shape.head_dim, all) {
            let label = format!(
                "B{} H{} KV{} T{} hd{} [emulated {}]",
                shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.head_dim, v.name
            );
            match run(&bin, &inp, v, scale, &dir) {
                Ok(got) => fails.extend(check_all(&label, &shape, &got, &want)),
                Err(e) => {
                    println!("FAIL {label}: {e}");
                    fails.push(format!("{label}: {e}"));
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_gqa_deterministic_backward_repeats_bits() {
    let bin = emulator();
    let dir = scratch("attention_emulated_gqa_determinism");
    let inp = inputs(AttentionShape::gqa(1, 4, 2, 150, 32), 19);
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for v in variants(32, true)
        .into_iter()
        .filter(|v| v.name.starts_with("default") || v.name == "fused q32 splits 2")
    {
        let a = run(&bin, &inp, &v, 0.2, &dir).unwrap();
        let b = run(&bin, &inp, &v, 0.2, &dir).unwrap();
        assert_eq!(bits(&a.dqkv), bits(&b.dqkv), "{}", v.name);
        assert_eq!(bits(&a.out), bits(&b.out), "{}", v.name);
    }
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_wgmma_probes_match_cpu() {
    let bin = emulator();
    let dir = scratch("attention_emulated_wgmma_probes");
    let mut ok = true;
    for (probe, hd) in wgmma_probes() {
        let case = WgmmaProbeCase::new(probe, hd, 21);
        let which = match probe {
            WgmmaProbe::Abt16 => "abt16",
            WgmmaProbe::Abt => "abt",
            WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. } => "pv",
        };
        if which == "pv" {
            write(&dir.join("a.bin"), &case.a);
        } else {
            let a16: Vec<bf16> = case.a.iter().map(|&v| bf16::from_f32(v)).collect();
            write(&dir.join("a.bin"), &a16);
        }
        write(&dir.join("b.bin"), &case.b16);
        let o = Command::new(&bin)
            .args(["wgprobe", which, &hd.to_string()])
            .arg(&dir)
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "wgmma probe {which} hd{hd}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let got: Vec<f32> = read(&dir.join("out.bin"), 64 * case.out_cols());
        ok &= matrix_probe_ok(
            &wgmma_probe_name(probe, hd),
            &got,
            &case.want(),
            case.out_cols(),
        );
    }
    assert!(ok, "a wgmma probe failed (see the lines above)");
}

/// The wgmma shapes the emulator runs (up to T = 257; T = 1024 only on the GPU: the emulator runs a
/// thread per CUDA thread) with the default scale, and `extra` with scale 0.3.
fn emulated_wgmma_cases(extra: AttentionShape) -> Vec<(AttentionShape, Option<f32>)> {
    let mut cases: Vec<(AttentionShape, Option<f32>)> = wgmma_shapes()
        .into_iter()
        .filter(|s| s.seq_len <= 257)
        .map(|s| (s, None))
        .collect();
    cases.push((extra, Some(0.3)));
    cases
}

/// The label of one emulated wgmma run.
fn wgmma_label(shape: &AttentionShape, scale: f32, v: &Variant) -> String {
    format!(
        "B{} H{} KV{} T{} hd{} scale {scale:.3} [emulated {}, {} results]",
        shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.head_dim, v.name, v.copies
    )
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_wgmma_forward_matches_cpu() {
    // Every wgmma forward variant on the wgmma shapes up to T = 257 (T = 1024 only on the GPU: the
    // emulator runs a thread per CUDA thread), wgmma results and cp.async copies at issue and at the
    // waits in turn; and a non-default scale. The first variant of each shape with the default backward
    // on its outputs, the others alone (out and lse), which keeps the test to a minute or two.
    let bin = emulator();
    let dir = scratch("attention_emulated_wgmma");
    let mut fails = Vec::new();
    for (i, (shape, scale)) in emulated_wgmma_cases(AttentionShape::new(1, 2, 100, 64))
        .into_iter()
        .enumerate()
    {
        let inp = inputs(shape, 1100 + i as u64);
        let scale = AttentionConfig {
            softmax_scale: scale,
            ..Default::default()
        }
        .scale_for(shape.head_dim);
        let want = reference(&inp, scale);
        let (_, bwd) = AttentionConfig::default()
            .kernels_for(shape.head_dim)
            .unwrap();
        for (j, tiles) in wgmma_forward_variants(shape.head_dim).iter().enumerate() {
            let v = Variant {
                name: format!("wgmma {tiles}"),
                copies: if (i + j) % 2 == 0 { "late" } else { "early" },
                fwd: format!("wg:{tiles}"),
                bwd: if j == 0 {
                    bwd_arg(&bwd, 0)
                } else {
                    "none".into()
                },
            };
            let label = wgmma_label(&shape, scale, &v);
            match run(&bin, &inp, &v, scale, &dir) {
                Ok(got) if j == 0 => fails.extend(check_all(&label, &shape, &got, &want)),
                Ok(got) => fails.extend(check_forward(&label, &shape, &got, &want)),
                Err(e) => {
                    println!("FAIL {label}: {e}");
                    fails.push(format!("{label}: {e}"));
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_wgmma_backward_matches_cpu() {
    // The wgmma backward on the wgmma shapes up to T = 257 (GQA groups 1, 2, 4 and 8, partial last
    // tiles) and a non-default scale with a group of 3: the deterministic dK/dV and dQ kernels (every
    // compiled pair in turn, the default first; the pipelined dQ kernel wherever T > 64; the
    // warp-specialised dQ kernel everywhere) and the fused
    // kernel (with two split buffers and atomic, alternately), wgmma results and cp.async copies at issue
    // and at the waits in turn.
    let bin = emulator();
    let dir = scratch("attention_emulated_wgmma_backward");
    let mut fails = Vec::new();
    for (i, (shape, scale)) in emulated_wgmma_cases(AttentionShape::gqa(1, 6, 2, 150, 64))
        .into_iter()
        .enumerate()
    {
        let inp = inputs(shape, 1300 + i as u64);
        let scale = AttentionConfig {
            softmax_scale: scale,
            ..Default::default()
        }
        .scale_for(shape.head_dim);
        let want = reference(&inp, scale);
        let hd = shape.head_dim;
        let fwd = default_wgmma_tiles(hd).unwrap();
        // The ordered fused kernel has its own test below.
        let pairs: Vec<_> = wgmma_backward_variants(hd)
            .into_iter()
            .filter(|t| !t.ordered)
            .collect();
        let sep = if i < 2 {
            default_wgmma_backward_tiles(hd).unwrap()
        } else {
            pairs[i % pairs.len()]
        };
        let mut backwards = vec![
            (
                format!("wgmma {sep}"),
                format!(
                    "wgsep:g{}{}:{}",
                    sep.kv_warpgroups,
                    if sep.kv_specialized { "w" } else { "" },
                    sep.dq
                ),
            ),
            (
                "wgmma fused".to_string(),
                ["wg:det:2", "wg:atomic"][i % 2].to_string(),
            ),
        ];
        // The pipelined dQ kernel wherever there are several key blocks to overlap; the warp-specialised
        // dQ kernel everywhere.
        if shape.seq_len > 64 {
            backwards.push(("wgmma q g1n64p".to_string(), "wgsep:g1:g1n64p".to_string()));
        }
        backwards.push((
            "wgmma kv g2w q g2n64w".to_string(),
            "wgsep:g2w:g2n64w".to_string(),
        ));
        for (j, (name, bwd)) in backwards.into_iter().enumerate() {
            let v = Variant {
                name: format!("wgmma {fwd}, backward {name} ({bwd})"),
                copies: if (i + j) % 2 == 0 { "late" } else { "early" },
                fwd: format!("wg:{fwd}"),
                bwd,
            };
            let label = wgmma_label(&shape, scale, &v);
            match run(&bin, &inp, &v, scale, &dir) {
                Ok(got) => fails.extend(check_all(&label, &shape, &got, &want)),
                Err(e) => {
                    println!("FAIL {label}: {e}");
                    fails.push(format!("{label}: {e}"));
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[cfg_attr(not(cxx20_found), ignore = "needs a C++20 compiler (CXX, g++ or c++)")]
fn emulated_ordered_backward_matches_cpu_and_repeats() {
    // The fused deterministic wgmma backward (one kernel, dQ added tile by tile with bulk reductions in
    // key-block order; the emulator also checks that every tile's turn counter ends at the number of
    // key blocks that reach it; at head dim 128 every other shape with dQ's columns split between the
    // warpgroups) on the wgmma shapes up to T = 257 and a group of 3 with a non-default scale: against
    // the CPU, and the same bits with wgmma results, TMA copies and bulk reductions at
    // issue and at the waits (there with the last warp of each warpgroup slow at its waits).
    let bin = emulator();
    let dir = scratch("attention_emulated_ordered_backward");
    let mut fails = Vec::new();
    for (i, (shape, scale)) in emulated_wgmma_cases(AttentionShape::gqa(1, 6, 2, 150, 64))
        .into_iter()
        .enumerate()
    {
        let inp = inputs(shape, 1700 + i as u64);
        let scale = AttentionConfig {
            softmax_scale: scale,
            ..Default::default()
        }
        .scale_for(shape.head_dim);
        let want = reference(&inp, scale);
        let fwd = default_wgmma_tiles(shape.head_dim).unwrap();
        // At head dim 128 the shapes alternate between the two ways of splitting dQ's products.
        let (kernel, bwd) = if shape.head_dim == 128 && i % 2 == 1 {
            (WgmmaBackwardTiles::ORDERED_COLUMNS, "wgordc")
        } else {
            (WgmmaBackwardTiles::ORDERED, "wgord")
        };
        let mut runs = Vec::new();
        for copies in ["early", "late"] {
            let v = Variant {
                name: format!("wgmma {fwd}, backward {kernel}"),
                copies,
                fwd: format!("wg:{fwd}"),
                bwd: bwd.to_string(),
            };
            let label = wgmma_label(&shape, scale, &v);
            // Late results with the last warp of each warpgroup slow: a shared-memory operand that one
            // warp overwrites while a sibling's part of the wgmma still reads it fails the run.
            match run_with(
                &bin,
                &inp,
                &v,
                scale,
                &dir,
                &[("ATT_EMULATOR_SLOW_WARP_US", "300")],
            ) {
                Ok(got) => {
                    fails.extend(check_all(&label, &shape, &got, &want));
                    runs.push((label, got));
                }
                Err(e) => {
                    println!("FAIL {label}: {e}");
                    fails.push(format!("{label}: {e}"));
                }
            }
        }
        if let [(label, a), (_, b)] = &runs[..] {
            let differ = a
                .dqkv
                .iter()
                .zip(&b.dqkv)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            if differ > 0 {
                fails.push(format!(
                    "{label}: {differ} gradient elements differ between early and late results"
                ));
            }
        }
    }
    assert_no_failures(&fails);
}
