//! The element kinds the collectives take and a buffer of any of them, held as raw bits for bitwise
//! comparisons: what the collective tests share.
#![allow(dead_code)]

use fp8_core::Fp8Format;
use fp8_kernels::{Buffer, Device, Element};
use fsdp_comm::{RecvBuf, SendBuf};
use half::{bf16, f16};

/// An element type of a collective: the float types, plain bytes, or FP8 codes of a format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    F32,
    BF16,
    F16,
    Bytes,
    Fp8(Fp8Format),
}

/// Every kind.
pub const KINDS: [Kind; 6] = [
    Kind::F32,
    Kind::BF16,
    Kind::F16,
    Kind::Bytes,
    Kind::Fp8(Fp8Format::E4M3),
    Kind::Fp8(Fp8Format::E5M2),
];

/// The value of `bits` as an element of `kind` (bytes as their number).
pub fn decode(kind: Kind, bits: u32) -> f64 {
    match kind {
        Kind::F32 => f32::from_bits(bits) as f64,
        Kind::BF16 => bf16::from_bits(bits as u16).to_f64(),
        Kind::F16 => f16::from_bits(bits as u16).to_f64(),
        Kind::Fp8(f) => f.decode(bits as u8) as f64,
        Kind::Bytes => bits as f64,
    }
}

/// A buffer of one of the element types on some device.
pub enum Buf {
    F32(Buffer<f32>),
    BF16(Buffer<bf16>),
    F16(Buffer<f16>),
    U8(Buffer<u8>),
}

/// A buffer on `dev` of the values `from(bits[i])`.
fn upload_bits<T: Element>(dev: &Device, bits: &[u32], from: impl Fn(u32) -> T) -> Buffer<T> {
    let values: Vec<T> = bits.iter().map(|&b| from(b)).collect();
    dev.upload(&values).unwrap()
}

/// `to(b[i])` of every element of a buffer.
fn download_bits<T: Element>(b: &Buffer<T>, to: impl Fn(T) -> u32) -> Vec<u32> {
    b.to_vec().unwrap().into_iter().map(to).collect()
}

impl Buf {
    /// A buffer on `dev` holding `bits` (the low 16 or 8 bits for the narrower kinds).
    pub fn new(dev: &Device, kind: Kind, bits: &[u32]) -> Self {
        match kind {
            Kind::F32 => Buf::F32(upload_bits(dev, bits, f32::from_bits)),
            Kind::BF16 => Buf::BF16(upload_bits(dev, bits, |b| bf16::from_bits(b as u16))),
            Kind::F16 => Buf::F16(upload_bits(dev, bits, |b| f16::from_bits(b as u16))),
            Kind::Bytes | Kind::Fp8(_) => Buf::U8(upload_bits(dev, bits, |b| b as u8)),
        }
    }

    /// A buffer of a pattern the collective must overwrite, so an element it does not write is noticed.
    pub fn poisoned(dev: &Device, kind: Kind, len: usize) -> Self {
        Self::new(dev, kind, &vec![0x55; len])
    }

    pub fn send(&self, kind: Kind) -> SendBuf<'_> {
        match (self, kind) {
            (Buf::F32(b), _) => b.into(),
            (Buf::BF16(b), _) => b.into(),
            (Buf::F16(b), _) => b.into(),
            (Buf::U8(b), Kind::Fp8(f)) => SendBuf::fp8(b, f),
            (Buf::U8(b), _) => b.into(),
        }
    }

    pub fn recv(&mut self, kind: Kind) -> RecvBuf<'_> {
        match (self, kind) {
            (Buf::F32(b), _) => b.into(),
            (Buf::BF16(b), _) => b.into(),
            (Buf::F16(b), _) => b.into(),
            (Buf::U8(b), Kind::Fp8(f)) => RecvBuf::fp8(b, f),
            (Buf::U8(b), _) => b.into(),
        }
    }

    /// The elements' bits, widened to u32.
    pub fn bits(&self) -> Vec<u32> {
        match self {
            Buf::F32(b) => download_bits(b, f32::to_bits),
            Buf::BF16(b) => download_bits(b, |x| u32::from(x.to_bits())),
            Buf::F16(b) => download_bits(b, |x| u32::from(x.to_bits())),
            Buf::U8(b) => download_bits(b, u32::from),
        }
    }
}
