//! The CUDA C sources of this crate's kernels and their compilation with NVRTC.
//!
//! Sources live under `fp8-kernels/cuda/` and are embedded in the binary; each [`KernelModule`] is one
//! NVRTC program: the common header (`common.cuh`: FP8 conversion with the hardware `cvt` instructions,
//! bf16/f16 conversion, block amax) followed by the module's `.cu` file. A [`CudaDevice`] compiles a module
//! for its own architecture on first use and caches it ([`CudaDevice::load_kernel_module`]).
//!
//! [`compile_ptx`] needs only NVRTC, not a GPU, so the sources are compile-checked on machines without
//! one (the `nvrtc_compile` test does that for every module when NVRTC can be loaded).
//!
//! [`CudaDevice`]: crate::CudaDevice
//! [`CudaDevice::load_kernel_module`]: crate::CudaDevice::load_kernel_module

use crate::KernelError;
use cudarc::driver::{CudaFunction, LaunchConfig};
use cudarc::nvrtc::{CompileOptions, Ptx};

/// One NVRTC program: a name (the cache key), the files it is built from, and the full source text.
#[derive(Debug, Clone, Copy)]
pub struct KernelModule {
    /// Unique module name.
    pub name: &'static str,
    /// The files under `fp8-kernels/cuda/` concatenated into `source`, in order.
    pub files: &'static [&'static str],
    /// The source handed to NVRTC.
    pub source: &'static str,
}

/// FP8 casts, amax, scaling-meta updates, dequantization, cast+transpose, float conversions.
pub const CAST_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_cast",
    files: &["common.cuh", "cast.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/cast.cu")
    ),
};

/// Layer operations: bias, activations, softmax + NLL, im2col, pooling, dropout, reductions, axpy.
pub const OPS_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_ops",
    files: &["common.cuh", "ops.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/ops.cu")
    ),
};

/// The modules defined in this file. Other parts of the crate define their own [`KernelModule`]s the same
/// way (`common.cuh` + one `.cu` file); the compile test builds every `.cu` file under `cuda/` like that.
pub const MODULES: &[KernelModule] = &[CAST_MODULE, OPS_MODULE];

/// NVRTC options of these modules: IEEE arithmetic (no fast math, no flush-to-zero, no contraction of
/// multiply-add) so elementwise results match the CPU implementations bit for bit.
pub const PRECISE_OPTIONS: &[&str] = &[
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// Whether NVRTC can be loaded. cudarc panics on first use of a missing library, so this comes first.
pub fn nvrtc_status() -> Result<(), KernelError> {
    // SAFETY: only tries to dlopen NVRTC and look up its symbols; nothing is called.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(KernelError::CudaUnavailable(
            "NVRTC (libnvrtc) could not be loaded (is it on LD_LIBRARY_PATH?)".into(),
        ))
    }
}

/// The NVRTC target for a GPU of compute capability `(major, minor)`.
pub fn arch_for(compute_capability: (i32, i32)) -> &'static str {
    match compute_capability {
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        // Other parts run compute_90 PTX through the driver's JIT.
        _ => "compute_90",
    }
}

/// Compiles `module` to PTX for `arch` (e.g. `"sm_90"`) with [`PRECISE_OPTIONS`]. Needs NVRTC, not a GPU.
pub fn compile_ptx(module: &KernelModule, arch: &'static str) -> Result<Ptx, KernelError> {
    nvrtc_status()?;
    let opts = CompileOptions {
        arch: Some(arch),
        options: PRECISE_OPTIONS.iter().map(|s| s.to_string()).collect(),
        name: Some(format!("{}.cu", module.name)),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(module.source, opts).map_err(|e| KernelError::Compile {
        module: module.name,
        log: match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        },
    })
}

/// Threads per block of the one-dimensional kernels.
pub(crate) const BLOCK: u32 = 256;

/// A 1-D launch over `items` work items with grid-stride loops: enough blocks to fill every SM several
/// times (at most `blocks_per_sm` per SM), never more than the items need, at least one.
pub(crate) fn grid_1d(sm_count: u32, items: u64, blocks_per_sm: u32) -> LaunchConfig {
    let needed = items.div_ceil(BLOCK as u64).max(1);
    let cap = (sm_count.max(1) as u64) * blocks_per_sm as u64;
    LaunchConfig {
        grid_dim: (needed.min(cap) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch of the cast + transpose kernels (`cast_transpose_*`, `gelu[_bwd]_cast_transpose_*`) for a
/// `[rows, cols]` input: a one-dimensional block of 256 threads when both sides are multiples of 64 (the
/// kernels then take their vectorised 64x64-tile path), else a (32, 8) block over 32x32 tiles. At most
/// 16 blocks per SM, with grid-stride loops over the tiles.
pub(crate) fn cast_transpose_launch(sm_count: u32, rows: usize, cols: usize) -> LaunchConfig {
    let cap = sm_count.max(1) as usize * 16;
    if rows % 64 == 0 && cols % 64 == 0 && rows > 0 && cols > 0 {
        let tiles = (rows / 64) * (cols / 64);
        LaunchConfig {
            grid_dim: (tiles.clamp(1, cap) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    } else {
        let tiles = rows.div_ceil(32) * cols.div_ceil(32);
        LaunchConfig {
            grid_dim: (tiles.clamp(1, cap) as u32, 1, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A function of a loaded module, compiling the module on first use.
pub(crate) fn function(
    dev: &crate::CudaDevice,
    module: &KernelModule,
    name: &str,
) -> Result<CudaFunction, KernelError> {
    let m = dev.load_kernel_module(module)?;
    Ok(m.load_function(name)?)
}

/// Number of streaming multiprocessors of the device.
pub(crate) fn sm_count(dev: &crate::CudaDevice) -> Result<u32, KernelError> {
    let n = dev.context().attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok(n.max(1) as u32)
}
