//! The two OCP FP8 formats: bit layout, encode (round-to-nearest-even with saturation) and decode.
//!
//! The encode rules are those of Hopper's `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`, so GPU kernels that use
//! the hardware instruction and the CPU code here produce identical bytes:
//! - round to nearest, ties to even;
//! - any finite value or infinity beyond the largest finite code saturates to it (with the input's sign);
//! - NaN becomes the canonical NaN `0x7F` (the sign of a NaN input is not kept).

use crate::error::Fp8Error;
use rayon::prelude::*;

/// An 8-bit floating-point format of the OCP FP8 specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// E4M3 "FN": 4 exponent bits (bias 7), 3 mantissa bits, largest finite 448, no infinity,
    /// NaN is `S.1111.111` (`0x7F`, `0xFF`).
    E4M3,
    /// E5M2: 5 exponent bits (bias 15), 2 mantissa bits, largest finite 57344, infinities `0x7C`/`0xFC`,
    /// NaNs `S.11111.{01,10,11}`.
    E5M2,
}

/// Slices shorter than this are converted on the calling thread: splitting them costs more than it saves.
const PAR_THRESHOLD: usize = 1 << 16;
/// Elements per rayon task in the slice paths.
const PAR_CHUNK: usize = 1 << 14;

impl Fp8Format {
    /// Both formats, in a fixed order (handy for tests and tables).
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// Number of exponent bits.
    pub const fn exponent_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 4,
            Fp8Format::E5M2 => 5,
        }
    }

    /// Number of explicit mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// Exponent bias.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// The code of the largest finite positive value (`0x7E` = 448, `0x7B` = 57344).
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// The canonical NaN produced by [`Fp8Format::encode`].
    pub const fn nan_code(self) -> u8 {
        0x7F
    }

    /// Largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// Smallest positive normal value (`2^(1 - bias)`).
    pub fn min_normal(self) -> f32 {
        f32::from_bits(((1 - self.bias() + 127) as u32) << 23)
    }

    /// Smallest positive subnormal value, which is also the spacing of subnormals.
    pub fn min_subnormal(self) -> f32 {
        f32::from_bits(((1 - self.bias() - self.mantissa_bits() as i32 + 127) as u32) << 23)
    }

    /// Whether a code is a NaN of this format.
    pub const fn is_nan(self, code: u8) -> bool {
        match self {
            Fp8Format::E4M3 => code & 0x7F == 0x7F,
            Fp8Format::E5M2 => code & 0x7F > 0x7C,
        }
    }

    /// Whether a code is an infinity (never true for E4M3).
    pub const fn is_infinite(self, code: u8) -> bool {
        match self {
            Fp8Format::E4M3 => false,
            Fp8Format::E5M2 => code & 0x7F == 0x7C,
        }
    }

    /// Encode one value: round to nearest even, saturate to the largest finite value, NaN to `0x7F`.
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let abs = bits & 0x7FFF_FFFF;
        if abs > 0x7F80_0000 {
            return self.nan_code();
        }
        let m = self.mantissa_bits();
        let max_code = self.max_code() as u32;
        // f32 exponent field of the smallest normal of this format.
        let min_normal_exp = (1 - self.bias() + 127) as u32;
        let code = if abs < (min_normal_exp << 23) {
            // Subnormal range: the value is an integer multiple of the subnormal spacing after exact
            // power-of-two scaling; f32 rounding of that quotient is exactly the rounding we need.
            let q = f32::from_bits(abs) / self.min_subnormal();
            q.round_ties_even() as u32
        } else {
            // Normal range: drop the low mantissa bits of the f32 with round-to-nearest-even; a carry
            // propagates into the exponent as it should. Then move the exponent to this format's bias.
            let shift = 23 - m;
            let lsb = (abs >> shift) & 1;
            let rounded = (abs + (1 << (shift - 1)) - 1 + lsb) >> shift;
            rounded - (((127 - self.bias()) as u32) << m)
        };
        sign | code.min(max_code) as u8
    }

    /// Decode one code to the f32 it represents exactly (every FP8 value is an f32).
    #[inline]
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => E4M3_DECODE[code as usize],
            Fp8Format::E5M2 => E5M2_DECODE[code as usize],
        }
    }

    /// Encode `src[i] * scale` into `dst[i]` (the multiply is done in f32, as the GPU kernels do).
    pub fn encode_scaled(self, src: &[f32], scale: f32, dst: &mut [u8]) -> Result<(), Fp8Error> {
        check_len(src.len(), dst.len())?;
        let run = |s: &[f32], d: &mut [u8]| {
            for (o, &x) in d.iter_mut().zip(s) {
                *o = self.encode(x * scale);
            }
        };
        for_each_chunk(src, dst, run);
        Ok(())
    }

    /// Encode `src[i] * scale` and return the largest `|src[i]|` seen (before scaling), in one pass.
    ///
    /// NaN inputs do not raise the returned amax (they are encoded as NaN); an infinite input makes it infinite.
    pub fn encode_scaled_with_amax(
        self,
        src: &[f32],
        scale: f32,
        dst: &mut [u8],
    ) -> Result<f32, Fp8Error> {
        check_len(src.len(), dst.len())?;
        let run = |s: &[f32], d: &mut [u8]| {
            let mut amax = 0.0f32;
            for (o, &x) in d.iter_mut().zip(s) {
                amax = amax.max(x.abs());
                *o = self.encode(x * scale);
            }
            amax
        };
        if src.len() < PAR_THRESHOLD {
            Ok(run(src, dst))
        } else {
            Ok(src
                .par_chunks(PAR_CHUNK)
                .zip(dst.par_chunks_mut(PAR_CHUNK))
                .map(|(s, d)| run(s, d))
                .reduce(|| 0.0, f32::max))
        }
    }

    /// Decode `src[i]` and multiply by `scale_inv` into `dst[i]`.
    pub fn decode_scaled(
        self,
        src: &[u8],
        scale_inv: f32,
        dst: &mut [f32],
    ) -> Result<(), Fp8Error> {
        check_len(src.len(), dst.len())?;
        let table = match self {
            Fp8Format::E4M3 => &E4M3_DECODE,
            Fp8Format::E5M2 => &E5M2_DECODE,
        };
        let run = |s: &[u8], d: &mut [f32]| {
            for (o, &c) in d.iter_mut().zip(s) {
                *o = table[c as usize] * scale_inv;
            }
        };
        for_each_chunk(src, dst, run);
        Ok(())
    }

    /// The 256 decoded values of this format, indexed by code.
    pub fn decode_table(self) -> &'static [f32; 256] {
        match self {
            Fp8Format::E4M3 => &E4M3_DECODE,
            Fp8Format::E5M2 => &E5M2_DECODE,
        }
    }
}

impl std::fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        })
    }
}

/// `run` over matching chunks of `src` and `dst`: the whole slices below `PAR_THRESHOLD` elements, else
/// chunks of `PAR_CHUNK` in parallel.
fn for_each_chunk<S: Sync, D: Send>(src: &[S], dst: &mut [D], run: impl Fn(&[S], &mut [D]) + Sync) {
    if src.len() < PAR_THRESHOLD {
        run(src, dst);
    } else {
        src.par_chunks(PAR_CHUNK)
            .zip(dst.par_chunks_mut(PAR_CHUNK))
            .for_each(|(s, d)| run(s, d));
    }
}

fn check_len(src: usize, dst: usize) -> Result<(), Fp8Error> {
    if src == dst {
        Ok(())
    } else {
        Err(Fp8Error::LengthMismatch {
            expected: src,
            actual: dst,
        })
    }
}

/// Builds the decode table from the bit fields (integer work only, so it runs at compile time).
const fn build_decode(exp_bits: u32, man_bits: u32, bias: i32, e4m3fn: bool) -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0usize;
    while code < 256 {
        let c = code as u32;
        let sign = (c >> 7) << 31;
        let e = (c >> man_bits) & ((1 << exp_bits) - 1);
        let m = c & ((1 << man_bits) - 1);
        let exp_all_ones = e == (1 << exp_bits) - 1;
        let bits = if e4m3fn && exp_all_ones && m == (1 << man_bits) - 1 {
            0x7FC0_0000 | sign
        } else if !e4m3fn && exp_all_ones {
            if m == 0 {
                0x7F80_0000 | sign
            } else {
                0x7FC0_0000 | sign
            }
        } else if e == 0 {
            if m == 0 {
                sign
            } else {
                // Subnormal: m * 2^(1 - bias - man_bits); normalise into an f32.
                let mut mm = m;
                let mut exp = 1 - bias - man_bits as i32;
                // Shift the leading one of mm to bit man_bits position is not needed: build from integer.
                let mut lead = 0;
                while (mm >> lead) > 1 {
                    lead += 1;
                }
                exp += lead;
                mm &= (1 << lead) - 1;
                sign | (((exp + 127) as u32) << 23) | (mm << (23 - lead))
            }
        } else {
            let exp = e as i32 - bias;
            sign | (((exp + 127) as u32) << 23) | (m << (23 - man_bits))
        };
        table[code] = f32::from_bits(bits);
        code += 1;
    }
    table
}

static E4M3_DECODE: [f32; 256] = build_decode(4, 3, 7, true);
static E5M2_DECODE: [f32; 256] = build_decode(5, 2, 15, false);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes() {
        let f = Fp8Format::E4M3;
        assert_eq!(f.decode(0x7E), 448.0);
        assert!(f.decode(0x7F).is_nan());
        assert_eq!(f.decode(0x01), 2f32.powi(-9));
        assert_eq!(f.decode(0x08), 2f32.powi(-6));
        assert_eq!(f.decode(0x38), 1.0);
        assert_eq!(f.decode(0xB8), -1.0);
        assert_eq!(f.min_normal(), 2f32.powi(-6));
        assert_eq!(f.min_subnormal(), 2f32.powi(-9));
        let g = Fp8Format::E5M2;
        assert_eq!(g.decode(0x7B), 57344.0);
        assert_eq!(g.decode(0x7C), f32::INFINITY);
        assert_eq!(g.decode(0xFC), f32::NEG_INFINITY);
        assert!(g.decode(0x7D).is_nan());
        assert_eq!(g.decode(0x01), 2f32.powi(-16));
        assert_eq!(g.decode(0x3C), 1.0);
        assert_eq!(g.min_subnormal(), 2f32.powi(-16));
    }

    #[test]
    fn encode_special_values() {
        for f in Fp8Format::ALL {
            assert_eq!(f.encode(0.0), 0x00);
            assert_eq!(f.encode(-0.0), 0x80);
            assert_eq!(f.encode(f32::INFINITY), f.max_code());
            assert_eq!(f.encode(f32::NEG_INFINITY), 0x80 | f.max_code());
            assert_eq!(f.encode(f32::NAN), 0x7F);
            assert_eq!(f.encode(1e30), f.max_code());
            assert_eq!(f.encode(-1e30), 0x80 | f.max_code());
            assert_eq!(f.encode(f32::MIN_POSITIVE), 0);
            assert_eq!(f.encode(f.max()), f.max_code());
        }
        // 464 is the midpoint between 448 and the (absent) 480: saturates, never NaN.
        assert_eq!(Fp8Format::E4M3.encode(464.0), 0x7E);
        assert_eq!(Fp8Format::E4M3.encode(1.0625), 0x38); // tie 1.0 / 1.125 -> even (1.0)
        assert_eq!(Fp8Format::E4M3.encode(1.1875), 0x3A); // tie 1.125 / 1.25 -> even (1.25)
                                                          // Half of the smallest subnormal ties to zero; just above rounds up.
        let tiny = Fp8Format::E4M3.min_subnormal();
        assert_eq!(Fp8Format::E4M3.encode(tiny * 0.5), 0);
        assert_eq!(Fp8Format::E4M3.encode(tiny * 0.5000001), 1);
        assert_eq!(Fp8Format::E4M3.encode(tiny * 1.5), 2);
    }

    #[test]
    fn round_trip_of_every_code() {
        for f in Fp8Format::ALL {
            for c in 0..=255u8 {
                if f.is_nan(c) {
                    continue;
                }
                let v = f.decode(c);
                let expected = if f.is_infinite(c) {
                    (c & 0x80) | f.max_code()
                } else {
                    c
                };
                assert_eq!(f.encode(v), expected, "{f} code {c:#04x} value {v}");
            }
        }
    }

    #[test]
    fn slice_length_mismatch_is_an_error() {
        let mut d = [0u8; 3];
        assert!(Fp8Format::E4M3
            .encode_scaled(&[1.0; 4], 1.0, &mut d)
            .is_err());
        let mut o = [0f32; 2];
        assert!(Fp8Format::E5M2.decode_scaled(&[0; 3], 1.0, &mut o).is_err());
    }
}
