//! Device abstraction (CPU or CUDA) and the kernels fp8-fsdp computes with, each named by its operation.
//!
//! Everything above this crate calls these kernels and never touches cudarc directly. A [`Device`] is the
//! CPU (rayon) or one CUDA GPU; a [`Buffer`] is a typed array on a device. Each kernel has a CPU
//! implementation, which is the reference its CUDA implementation is tested against on random inputs.
//!
//! The kernels come in families, one module (folder) each: `mod.rs` holds the public functions, their
//! validation and the CPU/CUDA dispatch, `cpu.rs` the CPU implementation, `cuda.rs` the launches, and the
//! `.cu` file beside them the CUDA source ([`kernel_source`] lists every NVRTC program):
//!
//! | family | kernels |
//! | --- | --- |
//! | [`cast`] | amax, FP8 casts (delayed and current scaling), dequantization, cast + transpose, conversions |
//! | [`block_quantize`](mod@block_quantize) | block-scaled FP8 casts (1x128 tiles, 128x1 tiles transposed, 128x128 blocks), their dequantization, 1x128 casts into packed row records and the F32 sum of their dequantized rows |
//! | [`scaling`] | scales from amaxes: the delayed-scaling meta update, the scale of one amax |
//! | [`gemm`] | F32, BF16, FP8 and block-scaled FP8 GEMMs (the `gemm` crate on the CPU, cuBLASLt on CUDA) |
//! | [`elementwise`] | bias add, ReLU, GELU, dropout, scale, axpy, add, add at an offset |
//! | [`gelu_cast`] | GELU forward/backward fused with the FP8 cast + transpose of its result |
//! | [`reduce`] | sums over rows and columns, amax and count of non-finite values, norm statistics |
//! | [`softmax`] | log-softmax, negative log-likelihood statistics and gradient |
//! | [`conv`] | im2col, col2im, batched transpose |
//! | [`pool`] | max pooling |
//! | [`adam`] | the fused Adam/AdamW updates and the device-side step control |
//! | [`segmented`] | per-segment amax, scale pairs and casts over a table of ranges of one buffer |
//! | [`gather_rows`] | row gathers from a device-resident table |
//! | [`swiglu_cast`] | SwiGLU forward/backward of fused gate/up, alone or fused with the FP8 cast + transpose |
//! | [`rope`] | rotary position embedding (rotate-half, Llama-3 frequency scaling) of fused Q/K/V |
//!
//! CUDA is optional at run time: cudarc loads its libraries dynamically, so this crate builds and its
//! CPU tests run where no CUDA exists, and [`Device::cuda`] returns an error (never panics) there.
//!
//! ```
//! use fp8_kernels::{Device, Buffer};
//!
//! let dev = Device::cpu();
//! let x: Buffer<f32> = dev.upload(&[1.0, -2.5, 3.0])?;
//! assert_eq!(x.to_vec()?, vec![1.0, -2.5, 3.0]);
//! # Ok::<(), fp8_kernels::KernelError>(())
//! ```
#![warn(missing_docs)]

pub mod adam;
pub mod attention;
pub mod block_quantize;
pub mod cast;
pub mod conv;
mod cpu_kernel;
pub mod cross_entropy;
pub mod device;
pub mod elementwise;
pub mod embedding;
mod error;
pub mod gather_rows;
pub mod gelu_cast;
pub mod gemm;
pub mod kernel_source;
mod launch;
pub mod layer_norm;
pub mod pool;
pub mod reduce;
pub mod rng;
pub mod rope;
pub mod scaling;
pub mod segmented;
pub mod softmax;
pub mod swiglu_cast;

pub use adam::{AdamConfig, AdamGrad, LowPrecisionAdamState, WeightDecay};
pub use attention::{
    attention_backward, attention_forward, AttentionConfig, AttentionKernel, AttentionShape,
    AttentionWorkspace, DqAccumulation,
};
pub use block_quantize::{
    block_dequantize, block_dequantize_sum, block_quantize, block_quantize_both,
    block_quantize_packed, block_quantize_tiles, BlockCastInput, BlockQuantLayout,
    BlockQuantOutput, BlockQuantSpec, PackedRows1x128, ScaleOrder,
};
pub use cast::{
    add_decoded_fp8, amax, cast_to_fp8, cast_to_fp8_current, cast_transpose_to_fp8, convert,
    dequantize_fp8, AmaxSlot, CurrentScaling,
};
pub use device::{check_len, Buffer, CudaDevice, DType, Device, Element, FloatElement, GpuEvent};
pub use error::KernelError;
pub use gemm::{
    BlockFp8Matrix, CpuParallelism, DeviceScalar, Fp8Matrix, GemmOutput, GemmSpec, Transpose,
};
pub use scaling::{scale_from_amax, update_scaling_meta, AmaxInput, ScalingMetaBuffers};
