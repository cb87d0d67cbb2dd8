//! Compiles the CUDA modules of the transformer kernel families (layer_norm forward and backward,
//! cross_entropy, embedding) for sm_90 with NVRTC, as the crate builds them (no GPU needed), and checks
//! properties of the PTX: every entry point the launchers name exists, the FP8 cast uses the hardware
//! conversion, the register-held row kernels keep their rows in registers (no local-memory arrays), and the
//! cross-entropy kernel uses its own exp (fused multiply-adds), not the hardware approximation. Skips,
//! saying why, when NVRTC cannot be loaded.

use fp8_kernels::cross_entropy::CROSS_ENTROPY_MODULE;
use fp8_kernels::embedding::EMBEDDING_MODULE;
use fp8_kernels::kernel_source::{compile_ptx, nvrtc_status, KernelModule};
use fp8_kernels::layer_norm::{LAYER_NORM_BACKWARD_MODULE, LAYER_NORM_FORWARD_MODULE};
use std::time::Instant;

fn compile(m: &KernelModule) -> Option<String> {
    if let Err(e) = nvrtc_status() {
        println!("SKIPPED: {e}");
        return None;
    }
    let t = Instant::now();
    let ptx = compile_ptx(m, "sm_90").unwrap_or_else(|e| panic!("{}: {e}", m.name));
    println!(
        "{} compiled for sm_90 in {:.1} s",
        m.name,
        t.elapsed().as_secs_f64()
    );
    let text = ptx.to_src();
    assert!(text.contains(".target sm_90"), "{}: PTX target", m.name);
    Some(text)
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

#[test]
fn layer_norm_forward_module_compiles_for_sm90() {
    let Some(ptx) = compile(&LAYER_NORM_FORWARD_MODULE) else {
        return;
    };
    for nv in ["nv0", "nv4", "nv16"] {
        entry(&ptx, &format!("ln_fwd_bf16_{nv}"));
        let fused = entry(&ptx, &format!("ln_fwd_fp8_bf16_e4m3_{nv}"));
        assert!(fused.contains("cvt.rn.satfinite.e4m3x2.f32"));
    }
    entry(&ptx, "ln_fwd_f32_nv0");
    entry(&ptx, "ln_fwd_fp8_f32_e4m3_nv0");
    assert!(
        !ptx.contains(".entry ln_bwd_"),
        "backward entries in the forward module"
    );
    // A dynamically indexed register cache would show up as a local-memory array.
    for name in [
        "ln_fwd_bf16_nv4",
        "ln_fwd_bf16_nv16",
        "ln_fwd_fp8_bf16_e4m3_nv4",
        "ln_fwd_fp8_bf16_e4m3_nv16",
    ] {
        assert!(
            !entry(&ptx, name).contains(".local"),
            "{name} uses local memory"
        );
    }
}

#[test]
fn layer_norm_backward_module_compiles_for_sm90() {
    let Some(ptx) = compile(&LAYER_NORM_BACKWARD_MODULE) else {
        return;
    };
    for (x, g) in [
        ("f32", "f32"),
        ("f32", "bf16"),
        ("bf16", "f32"),
        ("bf16", "bf16"),
    ] {
        entry(&ptx, &format!("ln_bwd_dx_{x}_{g}_nv0"));
        entry(&ptx, &format!("ln_bwd_params_{x}_{g}"));
    }
    entry(&ptx, "ln_param_sum");
    assert!(
        !ptx.contains(".entry ln_fwd_"),
        "forward entries in the backward module"
    );
    for name in ["ln_bwd_dx_bf16_bf16_nv4", "ln_bwd_dx_bf16_bf16_nv16"] {
        assert!(
            !entry(&ptx, name).contains(".local"),
            "{name} uses local memory"
        );
    }
}

#[test]
fn cross_entropy_module_compiles_for_sm90() {
    let Some(ptx) = compile(&CROSS_ENTROPY_MODULE) else {
        return;
    };
    for name in ["cross_entropy_f32", "cross_entropy_bf16"] {
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

#[test]
fn embedding_module_compiles_for_sm90() {
    let Some(ptx) = compile(&EMBEDDING_MODULE) else {
        return;
    };
    for a in ["f32", "bf16"] {
        for b in ["f32", "bf16"] {
            entry(&ptx, &format!("embedding_fwd_{a}_{b}"));
            entry(&ptx, &format!("embedding_bwd_chunks_{a}_{b}"));
            entry(&ptx, &format!("embedding_bwd_pos_{a}_{b}"));
        }
        entry(&ptx, &format!("embedding_bwd_multi_{a}"));
    }
}
