//! What several test files of this crate share: NVRTC compile tests (the `nvrtc_test!` attribute set and
//! the PTX of a module for sm_90), and the comparison of CUDA runs against the CPU reference.
// Each test file uses the part it needs.
#![allow(dead_code, unused_macros, unused_imports)]

use fp8_kernels::cross_entropy::CrossEntropyOutputs;
use fp8_kernels::kernel_source::{compile_ptx, nvrtc_status, KernelModule};
use fp8_kernels::layer_norm::{GradMode, NormGrads};
use fp8_kernels::{Buffer, Device, FloatElement};
use std::fmt::Debug;

/// An NVRTC compile test: a `#[test]` that is ignored, with the reason, where the build found no NVRTC.
macro_rules! nvrtc_test {
    ($(#[$attr:meta])* fn $name:ident() $body:block) => {
        $(#[$attr])*
        #[test]
        #[cfg_attr(not(nvrtc_found), ignore = "needs NVRTC (libnvrtc.so.13 on LD_LIBRARY_PATH)")]
        fn $name() $body
    };
}
pub(crate) use nvrtc_test;

/// Fails the test, with the reason, unless NVRTC can be loaded.
pub fn require_nvrtc() {
    if let Err(e) = nvrtc_status() {
        panic!("{e}");
    }
}

/// The PTX of `module` compiled as the crate compiles it for a Hopper GPU of compute capability 9.0:
/// `sm_90`, or `sm_90a` for a module built for that target (needs NVRTC, not a GPU).
pub fn sm90_ptx(module: &KernelModule) -> String {
    require_nvrtc();
    let target = module
        .target_for((9, 0))
        .unwrap_or_else(|e| panic!("{}: {e}", module.name));
    compile_ptx(module, target)
        .unwrap_or_else(|e| panic!("{}: {e}", module.name))
        .to_src()
}

/// Asserts that `ptx` names every kernel of `kernels`.
pub fn assert_kernels(ptx: &str, kernels: &[&str]) {
    for k in kernels {
        assert!(ptx.contains(k), "missing kernel {k}");
    }
}

/// CUDA device 0; the GPU tests fail (they are run on purpose, with `--ignored`) without one.
pub fn cuda_device() -> Device {
    Device::cuda(0).unwrap_or_else(|e| panic!("no usable CUDA device: {e}"))
}

/// CUDA device 0, which must have FP8 instructions (the fused FP8 cast tests).
pub fn fp8_gpu() -> Device {
    let gpu = cuda_device();
    if let Device::Cuda(c) = &gpu {
        if let Err(e) = c.require_fp8() {
            panic!("no FP8 on this GPU: {e}");
        }
    }
    gpu
}

/// The first element where `a` and `b` differ, and how many do, as `name[i]: a vs b (n of len differ)`;
/// `None` when they are equal.
pub fn first_difference<T: PartialEq + Debug>(name: &str, a: &[T], b: &[T]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{name}: lengths {} vs {}", a.len(), b.len()));
    }
    let i = a.iter().zip(b).position(|(x, y)| x != y)?;
    Some(format!(
        "{name}[{i}]: {:?} vs {:?} ({} of {} differ)",
        a[i],
        b[i],
        a.iter().zip(b).filter(|(x, y)| x != y).count(),
        a.len()
    ))
}

/// The differences of the fields that differ, joined (empty when none do).
pub fn join_differences(fields: impl IntoIterator<Item = Option<String>>) -> String {
    fields.into_iter().flatten().collect::<Vec<_>>().join("; ")
}

/// Whether two CUDA runs (`gpu1`, `gpu2`) equal the CPU run bit for bit and each other; prints what
/// differs (`differences` names it) or `ok`.
pub fn matches_cpu_and_deterministic<O: PartialEq>(
    what: &str,
    cpu: &O,
    gpu1: &O,
    gpu2: &O,
    differences: impl Fn(&O, &O) -> String,
) -> bool {
    let mut ok = true;
    if cpu != gpu1 {
        println!("MISMATCH {what}: CUDA vs CPU: {}", differences(gpu1, cpu));
        ok = false;
    }
    if gpu1 != gpu2 {
        println!("NONDETERMINISTIC {what}: {}", differences(gpu1, gpu2));
        ok = false;
    }
    if ok {
        println!("ok {what}");
    }
    ok
}

/// f32 bits with every NaN mapped to one pattern (NaN payloads differ between CPU and GPU arithmetic, and
/// are not compared).
pub fn canon(v: f32) -> u32 {
    if v.is_nan() {
        0x7FC0_0000
    } else {
        v.to_bits()
    }
}

/// A buffer's values widened to f32, as [`canon`] bits.
pub fn bits<T: FloatElement>(b: &Buffer<T>) -> Vec<u32> {
    b.to_vec()
        .unwrap()
        .iter()
        .map(|v| canon(v.to_f32()))
        .collect()
}

/// The gradients of a norm backward, `mode` for dx and the parameter gradients alike.
pub fn norm_grads<'a, G: FloatElement>(
    mode: GradMode,
    dx: &'a mut Buffer<G>,
    dweight: &'a mut Buffer<f32>,
    dbias: Option<&'a mut Buffer<f32>>,
) -> NormGrads<'a, G> {
    NormGrads {
        dx,
        dx_mode: mode,
        dweight,
        dbias,
        param_mode: mode,
    }
}

/// The host copies of a norm backward's dx, dweight and dbias.
pub fn grads_to_host<G: FloatElement>(
    dx: &Buffer<G>,
    dw: &Buffer<f32>,
    db: &Buffer<f32>,
) -> (Vec<G>, Vec<f32>, Vec<f32>) {
    (
        dx.to_vec().unwrap(),
        dw.to_vec().unwrap(),
        db.to_vec().unwrap(),
    )
}

/// The output buffers of cross-entropy calls over `rows` rows on one device.
pub struct CeBuffers {
    pub lse: Buffer<f32>,
    pub loss: Buffer<f32>,
    pub sum: Buffer<f32>,
    pub invalid: Buffer<u32>,
}

impl CeBuffers {
    /// Zero lse and loss, and the given starting loss sum and count of invalid targets.
    pub fn new(dev: &Device, rows: usize, sum: f32, invalid: u32) -> Self {
        CeBuffers {
            lse: dev.zeros(rows).unwrap(),
            loss: dev.zeros(rows).unwrap(),
            sum: dev.upload(&[sum]).unwrap(),
            invalid: dev.upload(&[invalid]).unwrap(),
        }
    }

    /// The buffers as a call's outputs.
    pub fn outputs(&mut self) -> CrossEntropyOutputs<'_> {
        CrossEntropyOutputs {
            lse: &mut self.lse,
            loss: &mut self.loss,
            loss_sum: &mut self.sum,
            invalid_targets: &mut self.invalid,
        }
    }
}

/// For a fused cast that writes row-major codes, their transpose, or both: runs `write` with one layout
/// at a time (the row-major codes, then the transpose) into buffers of `full.len()` bytes filled with
/// 0x55 on `dev`, and asserts that the layout asked for equals `full` / `full_t` (what the kernel wrote
/// with both), the other buffer is untouched, and what `write` returns (an amax, statistics) equals
/// `rest` each time.
pub fn assert_each_layout_alone<R: PartialEq + Debug>(
    dev: &Device,
    full: &[u8],
    full_t: &[u8],
    rest: &R,
    what: &str,
    mut write: impl FnMut(Option<&mut Buffer<u8>>, Option<&mut Buffer<u8>>) -> R,
) {
    let untouched = vec![0x55u8; full.len()];
    for (row_major, transposed) in [(true, false), (false, true)] {
        let (mut q, mut qt) = (
            dev.upload(&untouched).unwrap(),
            dev.upload(&untouched).unwrap(),
        );
        let got = write(row_major.then_some(&mut q), transposed.then_some(&mut qt));
        let what = format!("{what}: row-major {row_major}, transposed {transposed}");
        let (q, qt) = (q.to_vec().unwrap(), qt.to_vec().unwrap());
        let want = |on: bool, codes: &[u8]| {
            if on {
                codes.to_vec()
            } else {
                untouched.clone()
            }
        };
        assert!(q == want(row_major, full), "{what}: row-major codes");
        assert!(qt == want(transposed, full_t), "{what}: transposed codes");
        assert_eq!(&got, rest, "{what}");
    }
}
