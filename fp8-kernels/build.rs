//! Probes the build machine for what some tests need beyond Rust, and tells the tests through cfgs:
//! - `nvrtc_found`: a library that cudarc's dynamic loading would open as NVRTC (the names it tries, on
//!   `LD_LIBRARY_PATH`, in the dynamic loader's cache and in the default directories). The NVRTC compile
//!   tests run with it and are ignored, with the reason, without it.
//! - `cxx20_found`: a C++ compiler (`CXX`, else `g++`, else `c++`) that accepts `-std=c++20`, which the
//!   attention emulator tests need.
//!
//! A test binary built with a cfg set and run where the thing is missing fails: the probe says what the
//! build machine has, it never turns a missing library into a pass.
//!
//! `FP8_KERNELS_REQUIRE` (comma- or space-separated `nvrtc`, `cxx20`) turns a missing requirement into a
//! build error, so that CI cannot quietly ignore the tests it is meant to run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The CUDA version of cudarc's `cuda-13000` feature (the workspace pins it).
const CUDA_MAJOR: u32 = 13;
const CUDA_MINOR: u32 = 0;

/// The file names cudarc 0.19 tries for a library (`get_lib_name_candidates`), Linux only.
fn lib_name_candidates(lib: &str) -> Vec<String> {
    let (major, minor) = (CUDA_MAJOR, CUDA_MINOR);
    let mut names = vec![
        format!("lib{lib}.so"),
        format!("lib{lib}64.so"),
        format!("lib{lib}64_{major}.so"),
        format!("lib{lib}64_{major}{minor}.so"),
        format!("lib{lib}64_{major}{minor}_0.so"),
        format!("lib{lib}64_{major}0_{minor}.so"),
        format!("lib{lib}64_10.so"),
        format!("lib{lib}64_11.so"),
        format!("lib{lib}64_12.so"),
        format!("lib{lib}64_{major}0_0.so"),
        format!("lib{lib}64_9.so"),
    ];
    for v in [major, 12, 11, 10, 9, 1] {
        names.push(format!("lib{lib}.so.{v}"));
    }
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// Directories the dynamic loader searches by name: `LD_LIBRARY_PATH`, then its cache (`ldconfig -p`),
/// then the default directories.
fn loader_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for ldconfig in ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"] {
        let Ok(out) = Command::new(ldconfig)
            .arg("-p")
            .stderr(Stdio::null())
            .output()
        else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        // Lines read "\tlibfoo.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libfoo.so.1".
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some((_, path)) = line.split_once("=> ") {
                if let Some(dir) = Path::new(path.trim()).parent() {
                    dirs.push(dir.to_path_buf());
                }
            }
        }
        break;
    }
    dirs.extend(["/lib", "/usr/lib", "/lib64", "/usr/lib64"].map(PathBuf::from));
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// The first candidate file of `lib` in the loader's directories.
fn find_library(lib: &str) -> Option<PathBuf> {
    let names = lib_name_candidates(lib);
    loader_dirs()
        .into_iter()
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| p.is_file())
}

/// The first compiler of `CXX`, `g++`, `c++` that accepts `-std=c++20` (as the emulator tests choose).
fn find_cxx20() -> Option<String> {
    let candidates: Vec<String> = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["g++".to_string(), "c++".to_string()])
        .collect();
    candidates.into_iter().find(|cxx| {
        Command::new(cxx)
            .args(["-std=c++20", "-x", "c++", "-fsyntax-only", "-"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=LD_LIBRARY_PATH");
    println!("cargo::rerun-if-env-changed=CXX");
    println!("cargo::rerun-if-env-changed=FP8_KERNELS_REQUIRE");
    println!("cargo::rustc-check-cfg=cfg(nvrtc_found)");
    println!("cargo::rustc-check-cfg=cfg(cxx20_found)");

    let required = std::env::var("FP8_KERNELS_REQUIRE").unwrap_or_default();
    let required: Vec<&str> = required
        .split([',', ' '])
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(unknown) = required.iter().find(|r| !["nvrtc", "cxx20"].contains(r)) {
        panic!("FP8_KERNELS_REQUIRE: unknown requirement {unknown:?} (known: nvrtc, cxx20)");
    }

    match find_library("nvrtc") {
        Some(_) => println!("cargo::rustc-cfg=nvrtc_found"),
        None if required.contains(&"nvrtc") => panic!(
            "FP8_KERNELS_REQUIRE names nvrtc, but no NVRTC library is on LD_LIBRARY_PATH or in the \
             loader's directories (names tried, as cudarc does: {})",
            lib_name_candidates("nvrtc").join(", ")
        ),
        None => {}
    }
    match find_cxx20() {
        Some(_) => println!("cargo::rustc-cfg=cxx20_found"),
        None if required.contains(&"cxx20") => panic!(
            "FP8_KERNELS_REQUIRE names cxx20, but no C++ compiler (CXX, g++, c++) accepts -std=c++20"
        ),
        None => {}
    }
}
