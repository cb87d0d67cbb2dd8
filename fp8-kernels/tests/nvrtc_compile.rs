//! Compiles every CUDA source of the crate for sm_90 with NVRTC (no GPU needed). Skips, saying why, when
//! NVRTC cannot be loaded (CI without CUDA); runs wherever NVRTC is installed.

use fp8_kernels::kernel_source::{compile_ptx, nvrtc_status, KernelModule, MODULES};
use std::path::Path;

#[test]
fn every_kernel_source_compiles_for_sm90() {
    if let Err(e) = nvrtc_status() {
        println!("SKIPPED: {e}");
        return;
    }
    for m in MODULES {
        let ptx = compile_ptx(m, "sm_90").unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let text = ptx.to_src();
        assert!(text.contains(".target sm_90"), "{}: PTX target", m.name);
    }
    // The casts must use the hardware FP8 conversions.
    let cast = compile_ptx(&MODULES[0], "sm_90").unwrap().to_src();
    for insn in [
        "cvt.rn.satfinite.e4m3x2.f32",
        "cvt.rn.satfinite.e5m2x2.f32",
        "cvt.rn.f16x2.e4m3x2",
    ] {
        assert!(cast.contains(insn), "cast module lacks {insn}");
    }

    // Every .cu file under cuda/, built the way the crate builds modules (common.cuh + file), so modules
    // defined elsewhere in the crate are compile-checked too.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let common = std::fs::read_to_string(dir.join("common.cuh")).unwrap();
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        let body = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let source: &'static str = Box::leak(format!("{common}{body}").into_boxed_str());
        let files: &'static [&'static str] = Box::leak(Box::new([]));
        let m = KernelModule {
            name: Box::leak(name.clone().into_boxed_str()),
            files,
            source,
        };
        compile_ptx(&m, "sm_90").unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("compiled {name} for sm_90");
        seen += 1;
    }
    assert!(
        seen >= 2,
        "expected at least cast.cu and ops.cu under cuda/"
    );
}
