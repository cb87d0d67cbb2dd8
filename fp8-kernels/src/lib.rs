//! Device abstraction (CPU or CUDA) and every kernel fp8-fsdp needs.
//!
//! Everything above this crate calls these kernels and never touches cudarc directly. A [`Device`] is the
//! CPU (rayon) or one CUDA GPU; a [`Buffer`] is a typed array on a device. Each kernel has a CPU
//! implementation, which is the reference its CUDA implementation is tested against on random inputs.
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
pub mod blaslt;
pub mod cast;
pub mod cross_entropy;
pub mod device;
pub mod embedding;
mod error;
pub mod fused;
pub mod gather_rows;
pub mod gemm;
pub mod kernel_source;
pub mod layer_norm;
pub mod ops;
pub mod optim_step;
pub mod rng;
pub mod segmented;

pub use adam::{AdamConfig, AdamGrad, LowPrecisionAdamState, WeightDecay};
pub use attention::{
    attention_backward, attention_forward, AttentionConfig, AttentionKernel, AttentionShape,
    AttentionWorkspace, DqAccumulation,
};
pub use cast::{
    amax, cast_to_fp8, cast_to_fp8_current, cast_transpose_to_fp8, convert, dequantize_fp8,
    update_scaling_meta, AmaxInput, AmaxSlot, CurrentScaling, FloatElement, ScalingMetaBuffers,
};
pub use device::{check_len, Buffer, CudaDevice, DType, Device, Element, GpuEvent};
pub use error::KernelError;
pub use gemm::{CpuParallelism, DeviceScalar, Fp8Matrix, GemmOutput, GemmSpec, Transpose};
