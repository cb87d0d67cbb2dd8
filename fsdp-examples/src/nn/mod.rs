//! Neural-network layers over FSDP-sharded parameters: [`Conv2d`] (im2col + GEMM), [`Relu`],
//! [`MaxPool2d`], [`Dropout`], [`Flatten`], [`Linear`] (FP8, BF16 or F32) and [`LogSoftmaxNll`].
//!
//! # How a layer works
//! - Parameters live in a [`fsdp_shard::ShardedModel`]; a layer knows their names (`<module>.weight`,
//!   `<module>.bias`) and declares them with `param_specs`. The caller gathers the layer's unit before
//!   `forward`/`backward` (see `mnist::MnistNet` for a complete FSDP step).
//! - `forward` saves what `backward` needs and returns a reference to the layer's own output buffer;
//!   `backward` returns the gradient of the input (when asked for) and hands parameter gradients to the
//!   model with [`fsdp_shard::ShardedModel::add_grad`].
//! - Every buffer is owned by its layer and reused from step to step; it is reallocated only when the
//!   batch shape changes (training vs. test batches, a final partial batch).
//! - All computation goes through `fp8-kernels`, so a layer runs wherever its buffers live (CPU or CUDA)
//!   with no host round trip on the GPU.
//!
//! Tensors are f32, row-major; images are NCHW.
//!
//! A ReLU forward and backward on the CPU:
//!
//! ```
//! use fp8_kernels::Device;
//! use fsdp_examples::nn::Relu;
//!
//! let dev = Device::cpu();
//! let mut relu = Relu::new();
//! let x = dev.upload(&[-1.0f32, 2.0, 0.5, -3.0])?;
//! assert_eq!(relu.forward(&x)?.to_vec()?, [0.0, 2.0, 0.5, 0.0]);
//! let dy = dev.upload(&[1.0f32; 4])?;
//! assert_eq!(relu.backward(&dy)?.to_vec()?, [0.0, 1.0, 1.0, 0.0]);
//! # Ok::<(), fsdp_examples::nn::NnError>(())
//! ```

mod activation;
mod conv;
mod dropout;
mod flatten;
mod init;
mod linear;
mod loss;
mod pool;

pub use activation::Relu;
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use flatten::Flatten;
pub use init::{kaiming_uniform, uniform_fan_in};
pub use linear::{Linear, LinearPrecision};
pub use loss::LogSoftmaxNll;
pub use pool::MaxPool2d;

use fp8_kernels::{Buffer, Device, Element, KernelError};
use fsdp_shard::ShardError;

/// What can go wrong in a layer.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A kernel failed (shapes, devices, CUDA).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The sharded model refused (parameter not gathered, unknown name, wrong gradient size).
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A layer was used wrongly: wrong input size, backward before forward, bad options.
    #[error("{layer}: {detail}")]
    Usage {
        /// The layer.
        layer: String,
        /// What was wrong.
        detail: String,
    },
}

impl NnError {
    pub(crate) fn usage(layer: &str, detail: impl Into<String>) -> Self {
        NnError::Usage {
            layer: layer.to_string(),
            detail: detail.into(),
        }
    }
}

/// Makes `buf` a buffer of `len` elements on `device`, reusing it when it already is one. Contents are
/// unspecified after a reallocation (zeros).
pub(crate) fn reuse_buffer<T: Element>(
    buf: &mut Option<Buffer<T>>,
    device: &Device,
    len: usize,
) -> Result<(), KernelError> {
    let fits = buf
        .as_ref()
        .is_some_and(|b| b.len() == len && b.device() == *device);
    if !fits {
        *buf = Some(device.zeros::<T>(len)?);
    }
    Ok(())
}

/// The buffer in `slot`, or a usage error naming what is missing (e.g. backward before forward).
pub(crate) fn held<'a, T: Element>(
    slot: &'a Option<Buffer<T>>,
    layer: &str,
    what: &str,
) -> Result<&'a Buffer<T>, NnError> {
    slot.as_ref().ok_or_else(|| {
        NnError::usage(
            layer,
            format!("{what} is missing (backward before forward?)"),
        )
    })
}

/// Mutable version of [`held`].
pub(crate) fn held_mut<'a, T: Element>(
    slot: &'a mut Option<Buffer<T>>,
    layer: &str,
    what: &str,
) -> Result<&'a mut Buffer<T>, NnError> {
    slot.as_mut().ok_or_else(|| {
        NnError::usage(
            layer,
            format!("{what} is missing (backward before forward?)"),
        )
    })
}
