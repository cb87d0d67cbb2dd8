//! `QType`: the element types a tensor can be stored in.

use crate::{Fp8Error, Fp8Format};

/// Storage type of a tensor: one of the two FP8 formats, or a 16/32-bit float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QType {
    /// FP8 E4M3 (OCP "FN"), max 448.
    E4M3,
    /// FP8 E5M2, max 57344.
    E5M2,
    /// IEEE binary16, max 65504.
    F16,
    /// bfloat16, max about 3.39e38.
    BF16,
    /// IEEE binary32.
    F32,
}

impl QType {
    /// All types, in a fixed order.
    pub const ALL: [QType; 5] = [
        QType::E4M3,
        QType::E5M2,
        QType::F16,
        QType::BF16,
        QType::F32,
    ];

    /// Largest finite value of the type.
    pub fn max_finite(self) -> f32 {
        match self {
            QType::E4M3 => Fp8Format::E4M3.max(),
            QType::E5M2 => Fp8Format::E5M2.max(),
            QType::F16 => half::f16::MAX.to_f32(),
            QType::BF16 => half::bf16::MAX.to_f32(),
            QType::F32 => f32::MAX,
        }
    }

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            QType::E4M3 | QType::E5M2 => 1,
            QType::F16 | QType::BF16 => 2,
            QType::F32 => 4,
        }
    }

    /// The FP8 format, when this is an FP8 type.
    pub const fn fp8_format(self) -> Option<Fp8Format> {
        match self {
            QType::E4M3 => Some(Fp8Format::E4M3),
            QType::E5M2 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }

    /// Whether the type is one of the FP8 formats.
    pub const fn is_fp8(self) -> bool {
        self.fp8_format().is_some()
    }

    /// The name used in checkpoints and command lines (`e4m3`, `e5m2`, `f16`, `bf16`, `f32`).
    pub const fn name(self) -> &'static str {
        match self {
            QType::E4M3 => "e4m3",
            QType::E5M2 => "e5m2",
            QType::F16 => "f16",
            QType::BF16 => "bf16",
            QType::F32 => "f32",
        }
    }
}

impl From<Fp8Format> for QType {
    fn from(f: Fp8Format) -> Self {
        match f {
            Fp8Format::E4M3 => QType::E4M3,
            Fp8Format::E5M2 => QType::E5M2,
        }
    }
}

impl std::fmt::Display for QType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for QType {
    type Err = Fp8Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QType::ALL
            .into_iter()
            .find(|q| q.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Fp8Error::UnknownQType(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maxima_and_sizes() {
        assert_eq!(QType::E4M3.max_finite(), 448.0);
        assert_eq!(QType::E5M2.max_finite(), 57344.0);
        assert_eq!(QType::F16.max_finite(), 65504.0);
        assert_eq!(QType::BF16.max_finite(), f32::from_bits(0x7F7F_0000));
        assert_eq!(QType::F32.max_finite(), f32::MAX);
        assert_eq!(QType::BF16.size_bytes(), 2);
        for q in QType::ALL {
            assert_eq!(q.name().parse::<QType>().unwrap(), q);
        }
        assert!("fp7".parse::<QType>().is_err());
    }
}
