//! The CUDA C sources of this crate's kernels: the one registry of NVRTC programs ([`MODULES`]) and their
//! compilation.
//!
//! Each kernel family keeps its `.cu` file beside its Rust code (`src/<family>/<family>.cu`); headers
//! shared by every family live in `cuda/` (`cuda/common.cuh`: FP8 conversion with the hardware `cvt`
//! instructions, bf16/f16 conversion, block amax, device-side `compute_scale`). Each [`KernelModule`] is one
//! NVRTC program: its files concatenated in order (NVRTC sees no file system, so nothing `#include`s
//! anything), embedded in the binary. A [`CudaDevice`] compiles a module for its own architecture on first
//! use and caches it ([`CudaDevice::load_kernel_module`]).
//!
//! [`compile_ptx`] needs only NVRTC, not a GPU: the `nvrtc_compile` test compiles every module of
//! [`MODULES`] for a Hopper GPU (`sm_90`, or `sm_90a` for the modules that need it, [`ModuleArch`]), and
//! fails when a `.cu` file under `src/` or `cuda/` belongs to no registered module, so a family added later
//! cannot escape the check.
//!
//! [`CudaDevice`]: crate::CudaDevice
//! [`CudaDevice::load_kernel_module`]: crate::CudaDevice::load_kernel_module

use crate::KernelError;
use cudarc::nvrtc::{CompileOptions, Ptx};

/// One NVRTC program: a name (the cache key), the files it is built from, the full source text, and the
/// GPUs it is built for.
#[derive(Debug, Clone, Copy)]
pub struct KernelModule {
    /// Unique module name.
    pub name: &'static str,
    /// The files concatenated into `source`, in order, as paths relative to the crate root.
    pub files: &'static [&'static str],
    /// The source handed to NVRTC.
    pub source: &'static str,
    /// The NVRTC targets the module is compiled for.
    pub arch: ModuleArch,
}

/// Which NVRTC target a module is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleArch {
    /// The GPU's own architecture ([`arch_for`]): every module whose instructions exist on every GPU
    /// the crate supports (guarded by `__CUDA_ARCH__` where they differ).
    Portable,
    /// Hopper's architecture-specific target `sm_90a`, whose instructions (`wgmma`, `setmaxnreg`) exist
    /// on compute capability 9.0 only: neither in `sm_90` nor in later targets.
    Sm90a,
}

impl KernelModule {
    /// The NVRTC target of this module on a GPU of compute capability `(major, minor)`, or an error
    /// where the module cannot run (an [`ModuleArch::Sm90a`] module on anything but 9.0).
    pub fn target_for(&self, compute_capability: (i32, i32)) -> Result<&'static str, KernelError> {
        match self.arch {
            ModuleArch::Portable => Ok(arch_for(compute_capability)),
            ModuleArch::Sm90a if compute_capability == (9, 0) => Ok("sm_90a"),
            ModuleArch::Sm90a => Err(KernelError::InvalidArgument {
                what: self.name,
                detail: format!(
                    "this module is built for sm_90a (Hopper, compute capability 9.0); this GPU is {}.{}",
                    compute_capability.0, compute_capability.1
                ),
            }),
        }
    }
}

/// A [`KernelModule`] from crate-relative file paths, concatenated in order and embedded in the binary.
macro_rules! kernel_module {
    ($name:literal, [$($file:literal),+ $(,)?]) => {
        KernelModule {
            name: $name,
            files: &[$($file),+],
            source: concat!($(include_str!(concat!("../", $file))),+),
            arch: ModuleArch::Portable,
        }
    };
}

/// FP8 casts, amax, dequantization (also accumulated into a destination), cast + transpose, conversions.
pub const CAST_MODULE: KernelModule =
    kernel_module!("fp8_kernels_cast", ["cuda/common.cuh", "src/cast/cast.cu"]);

/// Scales from amaxes: the delayed-scaling meta update (history ring) and a scale from one amax.
pub const SCALING_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_scaling",
    ["cuda/common.cuh", "src/scaling/scaling.cu"]
);

/// Element-wise kernels: bias add, ReLU, GELU, dropout, scale, axpy, add, add at an offset.
pub const ELEMENTWISE_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_elementwise",
    [
        "cuda/common.cuh",
        "src/elementwise/gelu.cuh",
        "src/elementwise/elementwise.cu"
    ]
);

/// GELU (forward or backward) fused with the FP8 cast + transpose of its result; GELU's arithmetic is
/// the element-wise family's (`gelu.cuh`), so the fused and unfused results agree bit for bit.
pub const GELU_CAST_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_gelu_cast",
    [
        "cuda/common.cuh",
        "src/elementwise/gelu.cuh",
        "src/gelu_cast/gelu_cast.cu"
    ]
);

/// Reductions: sums over rows and over columns, amax and count of non-finite values, sum of squares.
pub const REDUCE_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_reduce",
    ["cuda/common.cuh", "src/reduce/reduce.cu"]
);

/// Log-softmax over rows, negative log-likelihood statistics and the gradient of their composition.
pub const SOFTMAX_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_softmax",
    ["cuda/common.cuh", "src/softmax/softmax.cu"]
);

/// im2col, col2im and the batched transpose around a convolution's GEMM.
pub const CONV_MODULE: KernelModule =
    kernel_module!("fp8_kernels_conv", ["cuda/common.cuh", "src/conv/conv.cu"]);

/// Max pooling forward and backward.
pub const POOL_MODULE: KernelModule =
    kernel_module!("fp8_kernels_pool", ["cuda/common.cuh", "src/pool/pool.cu"]);

/// The layout kernels of the FP8 GEMM path: re-layout/padding of operands, un-padding of results, FP8 to
/// BF16 for E5M2 x E5M2.
pub const GEMM_LAYOUT_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_gemm_layout",
    ["cuda/common.cuh", "src/gemm/layout.cu"]
);

/// Adam: the fused updates (F32 and low-precision states; coefficients by value or from the device) and
/// the device-side step control (coefficients from reduced statistics, state scales, weight sources, the
/// casts of per-tensor and of 128x128 block-scaled FP8 weights; the latter with the block cast of
/// `blocks128.cuh`, shared with the block_quantize module).
pub const ADAM_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_adam",
    [
        "cuda/common.cuh",
        "src/block_quantize/blocks128.cuh",
        "src/adam/adam.cu",
        "src/adam/control.cu"
    ]
);

/// Per-segment amax, scale pairs and FP8 casts over a table of ranges of a flat buffer.
pub const SEGMENTED_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_segmented",
    ["cuda/common.cuh", "src/segmented/segmented.cu"]
);

/// Row gathers from a device-resident table.
pub const GATHER_ROWS_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_gather_rows",
    ["cuda/common.cuh", "src/gather_rows/gather_rows.cu"]
);

/// Rotary position embedding (rotate-half) of the Q and K heads of a fused projection output.
pub const ROPE_MODULE: KernelModule =
    kernel_module!("fp8_kernels_rope", ["cuda/common.cuh", "src/rope/rope.cu"]);

/// SwiGLU of a fused gate/up projection output (forward, backward), alone or fused with the FP8 cast +
/// transpose of its result.
pub const SWIGLU_CAST_MODULE: KernelModule = kernel_module!(
    "fp8_kernels_swiglu_cast",
    [
        "cuda/common.cuh",
        "src/swiglu_cast/swiglu.cuh",
        "src/swiglu_cast/swiglu_cast.cu"
    ]
);

/// Every NVRTC program of the crate. A family that adds a `.cu` file registers its module here; the
/// `nvrtc_compile` test compiles each one and fails on a `.cu` file that no module lists.
pub const MODULES: &[KernelModule] = &[
    CAST_MODULE,
    SCALING_MODULE,
    ELEMENTWISE_MODULE,
    GELU_CAST_MODULE,
    REDUCE_MODULE,
    SOFTMAX_MODULE,
    CONV_MODULE,
    POOL_MODULE,
    GEMM_LAYOUT_MODULE,
    ADAM_MODULE,
    SEGMENTED_MODULE,
    GATHER_ROWS_MODULE,
    ROPE_MODULE,
    SWIGLU_CAST_MODULE,
    crate::attention::ATTENTION_MODULE,
    crate::attention::ATTENTION_WGMMA_MODULE,
    crate::block_quantize::BLOCK_QUANTIZE_MODULE,
    crate::block_quantize::BLOCK_ACTIVATION_MODULE,
    crate::cross_entropy::CROSS_ENTROPY_MODULE,
    crate::embedding::EMBEDDING_MODULE,
    crate::layer_norm::LAYER_NORM_FORWARD_MODULE,
    crate::layer_norm::LAYER_NORM_BACKWARD_MODULE,
    crate::layer_norm::LAYER_NORM_LEGACY_MODULE,
];

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

/// Compiles `module` to PTX for `arch` (e.g. `"sm_90"`; [`KernelModule::target_for`] says which) with
/// [`PRECISE_OPTIONS`]. Needs NVRTC, not a GPU.
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
