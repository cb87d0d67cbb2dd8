//! The element types buffers hold ([`Element`], tagged at run time by [`DType`]) and the floating-point
//! ones kernels compute with in f32 ([`FloatElement`]).

use std::fmt;

/// Element types a [`Buffer`](crate::Buffer) can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Bytes (FP8 payloads; the format travels beside the buffer).
    U8,
    /// 32-bit signed integer (labels, indices).
    I32,
    /// 32-bit unsigned integer (masks, counters).
    U32,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
        };
        f.write_str(s)
    }
}

/// A type that can live in a [`Buffer`](crate::Buffer) on either device.
pub trait Element:
    cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + bytemuck::Pod
    + Default
    + fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// The runtime tag of the type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}

/// Floating-point element types kernels read and write: `f32`, `bf16`, `f16`.
pub trait FloatElement: Element + Copy {
    /// Name used in kernel entry points (`f32`, `bf16`, `f16`).
    const NAME: &'static str;
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
    /// Narrowing from f32, round to nearest even (as the `half` crate does).
    fn from_f32(v: f32) -> Self;
}

impl FloatElement for f32 {
    const NAME: &'static str = "f32";
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl FloatElement for half::bf16 {
    const NAME: &'static str = "bf16";
    #[inline]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}
impl FloatElement for half::f16 {
    const NAME: &'static str = "f16";
    #[inline]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}
