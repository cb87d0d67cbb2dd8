//! FP8 number formats and per-tensor scaling metadata for FP8 mixed-precision training.
//!
//! This crate is the numerical foundation of fp8-fsdp. It has no GPU code and no `unsafe`:
//!
//! - [`Fp8Format`]: OCP E4M3 ("FN": max 448, no infinity) and E5M2 (max 57344, infinities). Encoding
//!   rounds to nearest even and saturates, bit for bit like Hopper's `cvt.rn.satfinite` instructions, so the
//!   GPU kernels of `fp8-kernels` are tested against it. Slice paths run on rayon.
//! - [`QType`]: the storage types of tensors (E4M3, E5M2, F16, BF16, F32) and their ranges.
//! - [`ScalingMeta`], [`ScalingRecipe`]: a tensor's scale, inverse scale and amax history window;
//!   delayed and current scaling; power-of-two scales by default.
//! - [`block`]: block scaling ([`ScalingGranularity`]: per tensor, 1x128 tiles, 128x128 blocks),
//!   [`BlockLayout`] (the blocks of a shape, partial last blocks included) and the block scale rule.
//! - [`Fp8Recipe`]: the model-wide recipe (formats, scaling of each operand, [`BlockRecipe`]).
//! - [`ScaledTensor`]: a host tensor with its bytes and meta; quantize from f32/bf16/f16 and dequantize.
//! - [`reference`]: slow, independent conversions used to check the fast paths.
//!
//! ```
//! use fp8_core::{Fp8Format, QType, ScaledTensor, ScalingMeta, ScalingRecipe};
//!
//! // Plain conversion: 1.0625 lies halfway between 1.0 and 1.125 and rounds to the even code (1.0).
//! assert_eq!(Fp8Format::E4M3.decode(Fp8Format::E4M3.encode(1.0625)), 1.0);
//! assert_eq!(Fp8Format::E4M3.encode(1e9), 0x7E); // saturates to 448
//!
//! // Delayed scaling: the scale follows the largest amax of the window.
//! let mut meta = ScalingMeta::new(QType::E4M3, ScalingRecipe::delayed_default())?;
//! meta.update_from_amax(3.0);
//! assert_eq!(meta.scale(), 128.0); // largest power of two with 3 * s <= 448
//!
//! // A scaled tensor round trip.
//! let x = [0.5f32, -1.25, 3.0, 0.001];
//! let t = ScaledTensor::quantize_f32(&[2, 2], &x, QType::E4M3, ScalingRecipe::current_default())?;
//! let y = t.dequantize();
//! assert_eq!(y[1], -1.25);
//! # Ok::<(), fp8_core::Fp8Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod block;
mod error;
mod format;
mod qtype;
mod recipe;
pub mod reference;
mod scaling;
mod tensor;

pub use block::{block_scale, BlockExtent, BlockLayout, ScalingGranularity, BLOCK_SIZE};
pub use error::Fp8Error;
pub use format::Fp8Format;
pub use qtype::QType;
pub use recipe::{BlockRecipe, Fp8Formats, Fp8Recipe};
pub use scaling::{
    compute_scale, AmaxCompute, ScaleRounding, ScalingMeta, ScalingRecipe, MAX_MARGIN,
    SCALE_EXP_LIMIT,
};
pub use tensor::{amax_f32, shape_numel, ScaledTensor};
