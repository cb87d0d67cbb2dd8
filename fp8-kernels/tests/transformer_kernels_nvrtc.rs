//! Compiles the CUDA modules of the transformer kernel families (layer_norm forward and backward per
//! register bound, and the previous forward; cross_entropy, embedding) for sm_90 with NVRTC, as the crate
//! builds them (no GPU needed), and checks properties of the code: every entry point the launchers name
//! exists (and, for layer_norm, no other), no kernel spills registers
//! (ptxas's report), the FP8 cast uses the hardware conversion, the register-held row kernels keep their
//! rows in registers (no local-memory arrays), and the cross-entropy kernel uses its own exp (fused
//! multiply-adds), not the hardware approximation. Ignored, with the reason, where the build found no NVRTC.

mod common;

use common::nvrtc_test;
use cudarc::nvrtc::result as nvrtc;
use fp8_kernels::cross_entropy::CROSS_ENTROPY_MODULE;
use fp8_kernels::embedding::EMBEDDING_MODULE;
use fp8_kernels::kernel_source::{nvrtc_status, KernelModule, PRECISE_OPTIONS};
use fp8_kernels::layer_norm::{
    backward_module, forward_module, BACKWARD_PREFETCH_VECTORS, BACKWARD_VECTORS_PER_LANE,
    FORWARD_VECTORS_PER_LANE, LAYER_NORM_LEGACY_MODULE,
};
use std::ffi::{c_char, CString};
use std::time::Instant;

fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&c| c != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `m` as the crate does (`kernel_source::compile_ptx`: sm_90, the precise options) and also
/// asks ptxas for its resource report; returns the PTX. Asserts that no kernel spills registers to local
/// memory.
fn compile(m: &KernelModule) -> String {
    if let Err(e) = nvrtc_status() {
        panic!("{e}");
    }
    let t = Instant::now();
    let src = CString::new(m.source).expect("source without NUL");
    let prog = nvrtc::create_program(&src, None).expect("nvrtc program");
    let mut opts = vec![
        "--gpu-architecture=sm_90".to_string(),
        "--ptxas-options=-v".to_string(),
    ];
    opts.extend(PRECISE_OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is a live program created above; the options are plain strings that cudarc turns
    // into C strings for the call; the log and PTX are read from the same live program, which is destroyed
    // last and not used after.
    let (compiled, log, ptx) = unsafe {
        let compiled = nvrtc::compile_program(prog, &opts);
        let log = nvrtc::get_program_log(prog).map(|l| text(&l));
        let ptx = nvrtc::get_ptx(prog).map(|p| text(&p));
        nvrtc::destroy_program(prog).expect("destroy nvrtc program");
        (compiled, log, ptx)
    };
    let log = log.expect("nvrtc log");
    if let Err(e) = compiled {
        panic!("{}: {e:?}\n{log}", m.name);
    }
    println!(
        "{} compiled for sm_90 in {:.1} s",
        m.name,
        t.elapsed().as_secs_f64()
    );
    // ptxas reports, per entry: "Compiling entry function 'NAME'", "... N bytes spill stores, M bytes
    // spill loads", "Used R registers, ...".
    let mut entry = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            entry = rest.split('\'').next().unwrap_or("").to_string();
        } else if line.contains("spill stores") {
            assert!(
                line.contains(" 0 bytes spill stores, 0 bytes spill loads"),
                "{entry} spills: {line}"
            );
        } else if let Some(used) = line.split("Used ").nth(1) {
            println!("  {entry}: {used}");
        }
    }
    let ptx = ptx.expect("nvrtc PTX");
    assert!(ptx.contains(".target sm_90"), "{}: PTX target", m.name);
    ptx
}

/// The PTX text of one entry point (from its `.entry` line to the next entry).
fn entry<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry {name}"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(ptx.len(), |e| start + 1 + e);
    &ptx[start..end]
}

nvrtc_test! {
    fn layer_norm_forward_modules_compile_for_sm90() {
        // The per-width modules the launches load: each holds its register bound's entries, for both norms
        // and every rows-per-warp count built, and nothing else.
        for nv in FORWARD_VECTORS_PER_LANE {
            let m = forward_module(nv);
            let ptx = compile(m);
            let types: &[&str] = if nv == 0 { &["f32", "bf16"] } else { &["bf16"] };
            let rpws: &[u32] = match nv {
                0 | 2 | 3 | 4 => &[1, 2, 4],
                6 | 8 => &[1, 2],
                _ => &[1],
            };
            for t in types {
                for rpw in rpws {
                    for kind in ["ln", "rms"] {
                        let plain = format!("ln_fwd_{t}_nv{nv}_r{rpw}_{kind}");
                        let stats = format!("ln_stats_{t}_nv{nv}_r{rpw}_{kind}");
                        let fused = format!("ln_fwd_fp8_{t}_e4m3_nv{nv}_r{rpw}_{kind}");
                        assert!(!entry(&ptx, &plain).contains(".local"), "{plain} uses local memory");
                        // The statistics alone: no output store of the element type.
                        let st = entry(&ptx, &stats);
                        assert!(!st.contains(".local"), "{stats} uses local memory");
                        let out_store = if *t == "bf16" { "st.global.v4" } else { "st.global.v4.f32" };
                        assert!(!st.contains(out_store), "{stats} stores rows");
                        let body = entry(&ptx, &fused);
                        assert!(body.contains("cvt.rn.satfinite.e4m3x2.f32"), "{fused}");
                        assert!(!body.contains(".local"), "{fused} uses local memory");
                    }
                }
            }
            let entries = ptx.matches(".entry ").count();
            assert_eq!(entries, types.len() * rpws.len() * 6, "{}: entries", m.name);
        }
        let legacy = compile(&LAYER_NORM_LEGACY_MODULE);
        for nv in ["nv0", "nv4", "nv8", "nv12", "nv16"] {
            entry(&legacy, &format!("ln_legacy_fwd_bf16_{nv}"));
            entry(&legacy, &format!("ln_legacy_fwd_fp8_bf16_e4m3_{nv}"));
        }
        entry(&legacy, "ln_legacy_fwd_f32_nv0");
        entry(&legacy, "ln_legacy_fwd_fp8_f32_e4m3_nv0");
    }
}

nvrtc_test! {
    fn layer_norm_backward_modules_compile_for_sm90() {
        for nv in BACKWARD_VECTORS_PER_LANE {
            let m = backward_module(nv);
            let ptx = compile(m);
            let types: &[(&str, &str)] = if nv == 0 {
                &[("f32", "f32"), ("f32", "bf16"), ("bf16", "f32"), ("bf16", "bf16")]
            } else {
                &[("bf16", "bf16")]
            };
            let prefetch: &[u32] = if BACKWARD_PREFETCH_VECTORS.contains(&nv) {
                &[0, 1]
            } else {
                &[0]
            };
            for (x, g) in types {
                for pf in prefetch {
                    for kind in ["ln", "rms"] {
                        let name = format!("ln_bwd_{x}_{g}_nv{nv}_{kind}_pf{pf}");
                        assert!(!entry(&ptx, &name).contains(".local"), "{name} uses local memory");
                    }
                }
            }
            entry(&ptx, "ln_param_reduce");
            let entries = ptx.matches(".entry ").count();
            assert_eq!(entries, types.len() * prefetch.len() * 2 + 1, "{}: entries", m.name);
        }
    }
}

nvrtc_test! {
    fn cross_entropy_module_compiles_for_sm90() {
        let ptx = compile(&CROSS_ENTROPY_MODULE);
        for name in [
            "cross_entropy_f32",
            "cross_entropy_bf16",
            "cross_entropy_bf16_nv8",
            "cross_entropy_bf16_nv16",
            "cross_entropy_f32_e4m3",
            "cross_entropy_f32_e5m2",
            "cross_entropy_bf16_e4m3",
            "cross_entropy_bf16_e5m2",
        ] {
            let body = entry(&ptx, name);
            assert!(body.contains("fma.rn.f32"), "{name}: polynomial exp");
            assert!(
                !body.contains("ex2.approx") && !body.contains("lg2.approx"),
                "{name}: hardware approximations would not match the CPU"
            );
            assert!(!body.contains(".local"), "{name} uses local memory");
        }
        entry(&ptx, "cross_entropy_loss_sum");
    }
}

nvrtc_test! {
    fn embedding_module_compiles_for_sm90() {
        let ptx = compile(&EMBEDDING_MODULE);
        for a in ["f32", "bf16"] {
            for b in ["f32", "bf16"] {
                entry(&ptx, &format!("embedding_fwd_{a}_{b}"));
                entry(&ptx, &format!("embedding_bwd_chunks_{a}_{b}"));
                entry(&ptx, &format!("embedding_bwd_pos_{a}_{b}"));
            }
            entry(&ptx, &format!("embedding_bwd_multi_{a}"));
        }
    }
}
