//! Compiles every CUDA module of the crate (the registry `kernel_source::MODULES`) for sm_90 (sm_90a for
//! the modules built for that target) with NVRTC,
//! as the crate builds them (no GPU needed), and checks that no CUDA source under `src/` or `cuda/` is
//! left out of the registry. The compile test is ignored, with the reason, where the build found no NVRTC
//! (`build.rs`; CI puts NVIDIA's NVRTC wheel on `LD_LIBRARY_PATH`); the registry check always runs.

mod common;

use common::{nvrtc_test, require_nvrtc, sm90_ptx};
use fp8_kernels::kernel_source::{compile_ptx, KernelModule, ModuleArch, CAST_MODULE, MODULES};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// Every `.cu` and `.cuh` file under `dir`, as paths relative to the crate root.
fn cuda_sources(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            cuda_sources(root, &path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu") | Some("cuh")
        ) {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn every_cuda_source_belongs_to_a_registered_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    cuda_sources(root, &root.join("src"), &mut found);
    cuda_sources(root, &root.join("cuda"), &mut found);
    assert!(
        found.len() >= 12,
        "expected the crate's CUDA sources, found {found:?}"
    );
    let listed: Vec<&str> = MODULES
        .iter()
        .flat_map(|m| m.files.iter().copied())
        .collect();
    for file in &found {
        // A module may name its files relative to the crate root or (older style) by file name.
        let registered = listed
            .iter()
            .any(|l| file == l || file.ends_with(&format!("/{l}")));
        assert!(
            registered,
            "{file} is in no module of kernel_source::MODULES: register the module that compiles it, \
             so that this test compiles it too"
        );
    }
    for m in MODULES {
        for f in m.files {
            assert!(
                found
                    .iter()
                    .any(|x| x == f || x.ends_with(&format!("/{f}"))),
                "{}: file {f} does not exist",
                m.name
            );
        }
    }
    let mut names: Vec<&str> = MODULES.iter().map(|m| m.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), MODULES.len(), "module names must be unique");
}

/// Compiles one module for its compute capability 9.0 target and checks its PTX: the line to print, or
/// what failed.
fn compile_checked(m: &KernelModule) -> Result<String, String> {
    let target = m
        .target_for((9, 0))
        .map_err(|e| format!("{}: {e}", m.name))?;
    let ptx = compile_ptx(m, target).map_err(|e| format!("{}: {e}", m.name))?;
    let text = ptx.to_src();
    if !text.contains(&format!(".target {target}\n")) {
        return Err(format!("{}: PTX target is not {target}", m.name));
    }
    if !text.contains(".entry") {
        return Err(format!("{}: no kernels in PTX", m.name));
    }
    Ok(format!(
        "compiled {} ({}) for {target}",
        m.name,
        m.files.join(" + ")
    ))
}

nvrtc_test! {
    fn every_kernel_module_compiles_for_sm90() {
        require_nvrtc();
        // Each module for the target it gets on a compute capability 9.0 GPU: sm_90, or sm_90a for the
        // modules built for that target alone (ModuleArch::Sm90a). The modules compile on every core
        // through rayon (NVRTC compiles separate programs concurrently, as the parallel tests of the other
        // NVRTC test binaries do): one at a time they took 204 s of a 2-core CI machine.
        let results: Vec<Result<String, String>> = MODULES.par_iter().map(compile_checked).collect();
        let failures: Vec<String> = results
            .into_iter()
            .filter_map(|r| match r {
                Ok(line) => {
                    println!("{line}");
                    None
                }
                Err(e) => Some(e),
            })
            .collect();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(
            MODULES.iter().any(|m| m.arch == ModuleArch::Sm90a),
            "the sm_90a modules are registered (and compiled above)"
        );
        // The casts must use the hardware FP8 conversions.
        let cast = sm90_ptx(&CAST_MODULE);
        for insn in [
            "cvt.rn.satfinite.e4m3x2.f32",
            "cvt.rn.satfinite.e5m2x2.f32",
            "cvt.rn.f16x2.e4m3x2",
        ] {
            assert!(cast.contains(insn), "cast module lacks {insn}");
        }
    }
}
