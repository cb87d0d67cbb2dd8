//! Compiles the GEMM-layout and Adam CUDA sources with NVRTC for sm_90 (no GPU needed; ignored, with the
//! reason, where the build found no NVRTC), and checks that the Adam kernels contain no
//! fused multiply-add and no flush-to-zero arithmetic, which would break bitwise CPU/GPU agreement.

mod common;

use common::{assert_kernels, nvrtc_test, require_nvrtc, sm90_ptx};
use fp8_kernels::kernel_source::{compile_ptx, ADAM_MODULE, GEMM_LAYOUT_MODULE};

nvrtc_test! {
    fn gemm_and_adam_sources_compile_for_sm90() {
        require_nvrtc();
        for module in [GEMM_LAYOUT_MODULE, ADAM_MODULE] {
            let ptx = compile_ptx(&module, "sm_90")
                .unwrap_or_else(|e| panic!("{}: {e}", module.name))
                .to_src();
            assert!(ptx.contains(".entry"), "{}: no kernels in PTX", module.name);
        }
        let ptx = sm90_ptx(&ADAM_MODULE);
        assert_kernels(
            &ptx,
            &[
                "adam_f32_g_f32",
                "adam_f32_g_bf16",
                "adam_lp_g_f32",
                "adam_lp_g_bf16",
                "adam_f32_ctl_g_f32",
                "adam_lp_ctl_g_bf16",
            ],
        );
        for line in ptx.lines() {
            let l = line.trim();
            assert!(
                !(l.starts_with("fma.") && l.contains(".f32")),
                "fused f32 multiply-add in Adam PTX: {l}"
            );
            assert!(
                !(l.contains(".ftz") && l.contains(".f32")),
                "flush-to-zero f32 op in Adam PTX: {l}"
            );
        }
        let layout = sm90_ptx(&GEMM_LAYOUT_MODULE);
        assert_kernels(
            &layout,
            &[
                "gemm_relayout_u8",
                "gemm_transpose_u8_v4",
                "gemm_unpad_f32",
                "gemm_unpad_bf16",
                "gemm_fp8_to_bf16",
                "gemm_block_scales_copy",
            ],
        );
    }
}

#[test]
#[ignore = "prints the Adam PTX (needs NVRTC)"]
fn dump_adam_ptx() {
    let ptx = sm90_ptx(&ADAM_MODULE);
    std::fs::write(std::env::temp_dir().join("adam_sm90.ptx"), ptx).unwrap();
}
