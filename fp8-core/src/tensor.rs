//! [`ScaledTensor`]: a host tensor stored in a [`QType`] with its [`ScalingMeta`].

use crate::{Fp8Error, QType, ScalingMeta, ScalingRecipe};
use half::{bf16, f16};
use rayon::prelude::*;

/// A tensor on the host: shape, storage type, raw little-endian bytes and scaling metadata.
///
/// FP8 data is stored as `encode(x * scale)`; F16/BF16/F32 data is stored as `x * scale` rounded to the type
/// (for F16 the scale keeps small values out of the subnormal range; for BF16 and F32 it is usually 1).
#[derive(Debug, Clone, PartialEq)]
pub struct ScaledTensor {
    shape: Vec<usize>,
    bytes: Vec<u8>,
    meta: ScalingMeta,
}

/// Number of elements of a shape, or an error on overflow.
pub fn shape_numel(shape: &[usize]) -> Result<usize, Fp8Error> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Fp8Error::ShapeOverflow(shape.to_vec()))
}

impl ScaledTensor {
    /// Quantizes f32 data with current scaling: the tensor's own amax sets the scale (per the recipe's
    /// margin and rounding), the amax is recorded in the meta's history, and the data is encoded.
    pub fn quantize_f32(
        shape: &[usize],
        data: &[f32],
        qtype: QType,
        recipe: ScalingRecipe,
    ) -> Result<Self, Fp8Error> {
        let mut meta = ScalingMeta::new(qtype, recipe)?;
        let amax = amax_f32(data);
        meta.update_from_amax(amax);
        Self::quantize_f32_with_meta(shape, data, meta)
    }

    /// Quantizes f32 data with the meta's current scale (delayed scaling: the scale was set by earlier
    /// amaxes). The meta is stored unchanged; the caller records the amax it wants.
    pub fn quantize_f32_with_meta(
        shape: &[usize],
        data: &[f32],
        meta: ScalingMeta,
    ) -> Result<Self, Fp8Error> {
        let n = shape_numel(shape)?;
        if n != data.len() {
            return Err(Fp8Error::ShapeMismatch {
                shape: shape.to_vec(),
                expected: n,
                actual: data.len(),
            });
        }
        let qtype = meta.qtype();
        let scale = meta.scale();
        let mut bytes = vec![0u8; n * qtype.size_bytes()];
        match qtype {
            QType::E4M3 | QType::E5M2 => {
                let f = qtype.fp8_format().ok_or(Fp8Error::NotFp8(qtype))?;
                f.encode_scaled(data, scale, &mut bytes)?;
            }
            QType::F16 => store(data, &mut bytes, |x| f16::from_f32(x * scale).to_le_bytes()),
            QType::BF16 => store(data, &mut bytes, |x| {
                bf16::from_f32(x * scale).to_le_bytes()
            }),
            QType::F32 => store(data, &mut bytes, |x| (x * scale).to_le_bytes()),
        }
        Ok(ScaledTensor {
            shape: shape.to_vec(),
            bytes,
            meta,
        })
    }

    /// Quantizes bf16 data (widened to f32 exactly, then as [`ScaledTensor::quantize_f32`]).
    pub fn quantize_bf16(
        shape: &[usize],
        data: &[bf16],
        qtype: QType,
        recipe: ScalingRecipe,
    ) -> Result<Self, Fp8Error> {
        let wide: Vec<f32> = data.par_iter().map(|x| x.to_f32()).collect();
        Self::quantize_f32(shape, &wide, qtype, recipe)
    }

    /// Quantizes f16 data (widened to f32 exactly, then as [`ScaledTensor::quantize_f32`]).
    pub fn quantize_f16(
        shape: &[usize],
        data: &[f16],
        qtype: QType,
        recipe: ScalingRecipe,
    ) -> Result<Self, Fp8Error> {
        let wide: Vec<f32> = data.par_iter().map(|x| x.to_f32()).collect();
        Self::quantize_f32(shape, &wide, qtype, recipe)
    }

    /// Wraps existing bytes (e.g. read from a checkpoint), checking their length against the shape.
    pub fn from_bytes(
        shape: &[usize],
        bytes: Vec<u8>,
        meta: ScalingMeta,
    ) -> Result<Self, Fp8Error> {
        let n = shape_numel(shape)?;
        let q = meta.qtype();
        let expected = n
            .checked_mul(q.size_bytes())
            .ok_or_else(|| Fp8Error::ShapeOverflow(shape.to_vec()))?;
        if bytes.len() != expected {
            return Err(Fp8Error::ByteLengthMismatch {
                qtype: q,
                elements: n,
                expected,
                actual: bytes.len(),
            });
        }
        Ok(ScaledTensor {
            shape: shape.to_vec(),
            bytes,
            meta,
        })
    }

    /// Decodes to f32 and multiplies by `scale_inv`.
    pub fn dequantize(&self) -> Vec<f32> {
        let inv = self.meta.scale_inv();
        let n = self.numel();
        match self.meta.qtype() {
            QType::E4M3 | QType::E5M2 => {
                let mut out = vec![0f32; n];
                if let Some(f) = self.meta.qtype().fp8_format() {
                    // Lengths match by construction.
                    let _ = f.decode_scaled(&self.bytes, inv, &mut out);
                }
                out
            }
            QType::F16 => load::<2>(&self.bytes, |b| f16::from_le_bytes(b).to_f32() * inv),
            QType::BF16 => load::<2>(&self.bytes, |b| bf16::from_le_bytes(b).to_f32() * inv),
            QType::F32 => load::<4>(&self.bytes, |b| f32::from_le_bytes(b) * inv),
        }
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        self.bytes.len() / self.meta.qtype().size_bytes()
    }

    /// Storage type.
    pub fn qtype(&self) -> QType {
        self.meta.qtype()
    }

    /// Raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Scaling metadata.
    pub fn meta(&self) -> &ScalingMeta {
        &self.meta
    }

    /// Consumes the tensor, returning its bytes and meta.
    pub fn into_parts(self) -> (Vec<usize>, Vec<u8>, ScalingMeta) {
        (self.shape, self.bytes, self.meta)
    }
}

/// Largest `|x|` over finite and infinite values; NaN entries are ignored.
pub fn amax_f32(data: &[f32]) -> f32 {
    data.par_iter()
        .with_min_len(1 << 14)
        .map(|x| x.abs())
        .reduce(|| 0.0, f32::max)
}

fn store<const N: usize>(data: &[f32], out: &mut [u8], f: impl Fn(f32) -> [u8; N] + Sync) {
    out.par_chunks_mut(N)
        .with_min_len(1 << 12)
        .zip(data.par_iter())
        .for_each(|(o, &x)| o.copy_from_slice(&f(x)));
}

fn load<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f32 + Sync) -> Vec<f32> {
    bytes
        .par_chunks_exact(N)
        .with_min_len(1 << 12)
        .map(|c| {
            let mut b = [0u8; N];
            b.copy_from_slice(c);
            f(b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_all_qtypes() {
        let data: Vec<f32> = (0..1000)
            .map(|i| ((i as f32) * 0.731).sin() * 3.0)
            .collect();
        for q in QType::ALL {
            let t =
                ScaledTensor::quantize_f32(&[10, 100], &data, q, ScalingRecipe::current_default())
                    .unwrap();
            assert_eq!(t.numel(), 1000);
            assert_eq!(t.bytes().len(), 1000 * q.size_bytes());
            let back = t.dequantize();
            let tol = match q {
                QType::E4M3 => 3.0 / 16.0,
                QType::E5M2 => 3.0 / 8.0,
                QType::F16 => 3.0 / 2048.0,
                QType::BF16 => 3.0 / 256.0,
                QType::F32 => 0.0,
            };
            for (a, b) in data.iter().zip(&back) {
                assert!((a - b).abs() <= tol, "{q}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn shape_and_byte_errors() {
        let r = ScaledTensor::quantize_f32(&[3, 3], &[0.0; 8], QType::E4M3, Default::default());
        assert!(matches!(
            r,
            Err(Fp8Error::ShapeMismatch {
                expected: 9,
                actual: 8,
                ..
            })
        ));
        let meta = ScalingMeta::new(QType::F16, Default::default()).unwrap();
        let r = ScaledTensor::from_bytes(&[4], vec![0; 7], meta);
        assert!(matches!(
            r,
            Err(Fp8Error::ByteLengthMismatch { expected: 8, .. })
        ));
        assert!(shape_numel(&[usize::MAX, 2]).is_err());
        // A zero-size tensor is valid and empty.
        let t = ScaledTensor::quantize_f32(&[0, 5], &[], QType::E5M2, Default::default()).unwrap();
        assert!(t.dequantize().is_empty());
    }
}
