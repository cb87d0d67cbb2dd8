//! FP8 casts and what surrounds them: amax, the one-pass cast with amax (delayed scaling), the
//! current-scaling cast (scale computed on the device), dequantization (also accumulated into a
//! destination), cast + transpose, and conversions between f32, bf16 and f16.
//!
//! Scales and amaxes are read from and written to device buffers (pointers, never host values), so a
//! training step on CUDA needs no host round trip. Every function runs where its buffers live: on the CPU
//! with rayon (`cpu.rs`), or on the buffers' GPU on its compute stream, asynchronously (`cuda.rs`,
//! `cast.cu`).
//!
//! Bit-exactness: a cast computes `encode(x * scale)` with one f32 multiply, exactly as
//! [`fp8_core::Fp8Format::encode_scaled`]; the CUDA kernels use the hardware `cvt.rn.satfinite`
//! instructions (NaN fixed up to fp8-core's canonical `0x7F`) and agree bit for bit.
//!
//! Amax rules (both devices): the amax is the largest `|x|`; NaN inputs never raise it (they are
//! encoded as NaN); an infinite input makes it infinite. Amax outputs *accumulate*:
//! `slot = max(slot, amax(x))`, so several casts (micro-batches, or pieces of one tensor) can share a
//! slot; zero the slot to start afresh (the scaling-meta update of [`crate::scaling`] does that for its
//! own slot).

mod cpu;
mod cuda;

pub use crate::FloatElement;
pub use cpu::dequantize_fp8_host;

use crate::device::{cuda_of, device_of, dispatch, Placed};
use crate::Device;
use crate::{check_len, Buffer, KernelError};
use cudarc::driver::CudaSlice;
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};

/// Where a kernel accumulates an amax: `buffer[slot] = max(buffer[slot], amax)`.
///
/// A slot must hold a non-negative value (zero, or an earlier amax) before the kernel runs.
#[derive(Debug)]
pub struct AmaxSlot<'a> {
    /// The buffer of amaxes (e.g. all the amaxes a step all-reduces at once).
    pub buffer: &'a mut Buffer<f32>,
    /// Index in `buffer`.
    pub slot: usize,
}

impl Placed for AmaxSlot<'_> {
    fn placement(&self) -> Option<Device> {
        self.buffer.placement()
    }
}

impl<'a> AmaxSlot<'a> {
    /// Slot `slot` of `buffer`.
    pub fn new(buffer: &'a mut Buffer<f32>, slot: usize) -> Self {
        AmaxSlot { buffer, slot }
    }

    /// Slot 0 of `buffer`.
    pub fn first(buffer: &'a mut Buffer<f32>) -> Self {
        AmaxSlot { buffer, slot: 0 }
    }

    /// An error unless the slot lies inside the buffer.
    /// The CUDA slice and slot of an optional amax output (for the CUDA side of a cast).
    fn cuda(
        slot: Option<Self>,
        what: &'static str,
    ) -> Result<Option<(&'a mut CudaSlice<f32>, usize)>, KernelError> {
        slot.map(|a| Ok((a.buffer.cuda_mut(what)?, a.slot)))
            .transpose()
    }

    pub(crate) fn check(&self, what: &'static str) -> Result<(), KernelError> {
        if self.slot < self.buffer.len() {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument {
                what,
                detail: format!(
                    "amax slot {} outside a buffer of {}",
                    self.slot,
                    self.buffer.len()
                ),
            })
        }
    }

    /// Folds a host amax into a CPU slot.
    pub(crate) fn accumulate_host(self, what: &'static str, a: f32) -> Result<(), KernelError> {
        let s = &mut self.buffer.host_mut(what)?[self.slot];
        *s = s.max(a);
        Ok(())
    }
}

/// The parameters of a current-scaling cast: format, margin and rounding of the scale (as in
/// [`fp8_core::compute_scale`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CurrentScaling {
    /// Target format.
    pub format: Fp8Format,
    /// The scale is divided by `2^margin` (0..=[`fp8_core::MAX_MARGIN`]).
    pub margin: i32,
    /// Power-of-two or exact scale.
    pub rounding: ScaleRounding,
}

impl CurrentScaling {
    /// Margin 0, power-of-two scale.
    pub const fn new(format: Fp8Format) -> Self {
        CurrentScaling {
            format,
            margin: 0,
            rounding: ScaleRounding::PowerOfTwo,
        }
    }
}

/// The name of a format in kernel entry points (`e4m3`, `e5m2`).
pub(crate) fn format_name(f: Fp8Format) -> &'static str {
    match f {
        Fp8Format::E4M3 => "e4m3",
        Fp8Format::E5M2 => "e5m2",
    }
}

/// The first value of a CPU scalar buffer.
pub(crate) fn first_value(b: &Buffer<f32>, what: &'static str) -> Result<f32, KernelError> {
    b.host(what)?
        .first()
        .copied()
        .ok_or_else(|| KernelError::InvalidArgument {
            what,
            detail: "scale buffer is empty".into(),
        })
}

/// The outputs of a fused cast that writes row-major codes, their transpose, or both: at least one asked
/// for, each of `n` codes.
pub(crate) fn check_code_layouts(
    what: &'static str,
    n: usize,
    codes: Option<&Buffer<u8>>,
    codes_t: Option<&Buffer<u8>>,
) -> Result<(), KernelError> {
    if codes.is_none() && codes_t.is_none() {
        return Err(KernelError::InvalidArgument {
            what,
            detail: "neither row-major nor transposed codes asked for".into(),
        });
    }
    for c in [codes, codes_t].into_iter().flatten() {
        check_len(what, n, c.len())?;
    }
    Ok(())
}

/// An error when a scalar buffer is empty.
pub(crate) fn check_nonempty(b: &Buffer<f32>, what: &'static str) -> Result<(), KernelError> {
    if b.is_empty() {
        Err(KernelError::InvalidArgument {
            what,
            detail: "scalar buffer is empty".into(),
        })
    } else {
        Ok(())
    }
}

/// Accumulates the amax of `x` into `out` (`out.buffer[out.slot] = max(.., max |x|)`), on the device of `x`.
pub fn amax<T: FloatElement>(x: &Buffer<T>, out: AmaxSlot<'_>) -> Result<(), KernelError> {
    const WHAT: &str = "amax";
    out.check(WHAT)?;
    let dev = device_of(WHAT, &[x, out.buffer])?;
    match dev {
        None => out.accumulate_host(WHAT, cpu::amax(x.host(WHAT)?)),
        Some(dev) => cuda::amax(&dev, x.cuda(WHAT)?, out.buffer.cuda_mut(WHAT)?, out.slot),
    }
}

/// Casts `x` to FP8 in one pass: `out[i] = encode(x[i] * scale[0])`, accumulating the amax of `x` into
/// `amax` when given (delayed scaling). `scale` is read on the device (a pointer, not a host value).
pub fn cast_to_fp8<T: FloatElement>(
    x: &Buffer<T>,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: &mut Buffer<u8>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cast_to_fp8";
    check_len(WHAT, x.len(), out.len())?;
    check_nonempty(scale, WHAT)?;
    if let Some(a) = &amax {
        a.check(WHAT)?;
    }
    let dev = device_of(WHAT, &[x, scale, out, &amax])?;
    match dev {
        None => {
            let s = first_value(scale, WHAT)?;
            let a = cpu::cast(x.host(WHAT)?, format, s, out.host_mut(WHAT)?);
            match amax {
                Some(slot) => slot.accumulate_host(WHAT, a),
                None => Ok(()),
            }
        }
        Some(dev) => {
            let (xs, ss, ys) = (x.cuda(WHAT)?, scale.cuda(WHAT)?, out.cuda_mut(WHAT)?);
            cuda::cast(&dev, xs, format, ss, ys, AmaxSlot::cuda(amax, WHAT)?)
        }
    }
}

/// Current-scaling cast: computes the amax of `x` (written to `amax[0]`, overwriting it), derives the
/// scale from it exactly like [`fp8_core::compute_scale`] (keeping `scale[0]` when the amax is 0 or not
/// finite), writes `scale[0]` and `scale_inv[0] = 1 / scale`, then casts `x` with that scale. On CUDA the
/// scale is computed on the device: two passes over `x` (amax, cast), no host round trip.
pub fn cast_to_fp8_current<T: FloatElement>(
    x: &Buffer<T>,
    spec: CurrentScaling,
    scale: &mut Buffer<f32>,
    scale_inv: &mut Buffer<f32>,
    amax: &mut Buffer<f32>,
    out: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cast_to_fp8_current";
    check_len(WHAT, x.len(), out.len())?;
    if !(0..=fp8_core::MAX_MARGIN).contains(&spec.margin) {
        return Err(fp8_core::Fp8Error::InvalidMargin(spec.margin).into());
    }
    for b in [&*scale, &*scale_inv, &*amax] {
        check_nonempty(b, WHAT)?;
    }
    dispatch!(WHAT, [x, scale, scale_inv, amax, out],
    cpu: {
        let xs = x.host(WHAT)?;
        let a = cpu::amax(xs);
        let prev = first_value(scale, WHAT)?;
        let s = compute_scale(a, spec.format.max(), spec.margin, spec.rounding, prev);
        scale.host_mut(WHAT)?[0] = s;
        scale_inv.host_mut(WHAT)?[0] = 1.0 / s;
        amax.host_mut(WHAT)?[0] = a;
        cpu::cast(xs, spec.format, s, out.host_mut(WHAT)?);
    },
    cuda(dev): {
        let (s, si) = (scale.cuda_mut(WHAT)?, scale_inv.cuda_mut(WHAT)?);
        let (a, ys) = (amax.cuda_mut(WHAT)?, out.cuda_mut(WHAT)?);
        cuda::cast_current(&dev, x.cuda(WHAT)?, spec, s, si, a, ys)
    })
}

/// Dequantizes FP8 codes: `out[i] = decode(q[i]) * scale_inv[0]`, rounded to `T`. `scale_inv` is read on
/// the device.
pub fn dequantize_fp8<T: FloatElement>(
    q: &Buffer<u8>,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "dequantize_fp8";
    check_len(WHAT, q.len(), out.len())?;
    check_nonempty(scale_inv, WHAT)?;
    dispatch!(WHAT, [q, scale_inv, out],
    cpu: {
        let si = first_value(scale_inv, WHAT)?;
        cpu::dequantize(q.host(WHAT)?, format, si, out.host_mut(WHAT)?);
    },
    cuda(dev): {
        let (qs, si) = (q.cuda(WHAT)?, scale_inv.cuda(WHAT)?);
        cuda::dequantize(&dev, qs, format, si, out.cuda_mut(WHAT)?)
    })
}

/// Dequantizes and accumulates: `dst[i] += decode(q[i]) * scale_inv[0]` (the product rounded to f32,
/// then the f32 sum, rounded to the destination type: exact for f32, nearest even for bf16). `dst` is
/// f32 or bf16 (e.g. a reduced FP8 chunk added into a wider accumulator).
pub fn add_decoded_fp8<D: FloatElement>(
    dst: &mut Buffer<D>,
    q: &Buffer<u8>,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add_decoded_fp8";
    check_len(WHAT, dst.len(), q.len())?;
    if scale_inv.is_empty() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "scale buffer is empty".into(),
        });
    }
    let dev = device_of(WHAT, &[dst, q, scale_inv])?;
    if q.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let si = scale_inv.host(WHAT)?[0];
            cpu::add_decoded(dst.host_mut(WHAT)?, q.host(WHAT)?, format, si);
            Ok(())
        }
        Some(dev) => {
            let (qs, si) = (q.cuda(WHAT)?, scale_inv.cuda(WHAT)?);
            cuda::add_decoded(&dev, dst.cuda_mut(WHAT)?, qs, format, si)
        }
    }
}

/// Cast + transpose: `x` is row-major `[rows, cols]`; writes `out_t` = the FP8 codes of `x^T`
/// (row-major `[cols, rows]`, the layout Hopper FP8 GEMMs want for the second operand), and also the
/// untransposed codes into `out` when given. The amax of `x` accumulates into `amax` when given.
pub fn cast_transpose_to_fp8<T: FloatElement>(
    x: &Buffer<T>,
    shape: [usize; 2],
    format: Fp8Format,
    scale: &Buffer<f32>,
    out_t: &mut Buffer<u8>,
    out: Option<&mut Buffer<u8>>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cast_transpose_to_fp8";
    let [rows, cols] = shape;
    let n = rows.checked_mul(cols).ok_or(KernelError::InvalidArgument {
        what: WHAT,
        detail: format!("shape {rows}x{cols} overflows"),
    })?;
    check_len(WHAT, n, x.len())?;
    check_len(WHAT, n, out_t.len())?;
    if let Some(o) = &out {
        check_len(WHAT, n, o.len())?;
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("shape {rows}x{cols} exceeds the 32-bit index range"),
        });
    }
    check_nonempty(scale, WHAT)?;
    if let Some(a) = &amax {
        a.check(WHAT)?;
    }
    let dev = device_of(WHAT, &[x, scale, out_t, &out, &amax])?;
    match dev {
        None => {
            let s = first_value(scale, WHAT)?;
            let xs = x.host(WHAT)?;
            let a = match out {
                Some(o) => cpu::cast(xs, format, s, o.host_mut(WHAT)?),
                None => cpu::amax(xs),
            };
            cpu::cast_transpose(xs, rows, cols, format, s, out_t.host_mut(WHAT)?);
            match amax {
                Some(slot) => slot.accumulate_host(WHAT, a),
                None => Ok(()),
            }
        }
        Some(dev) => {
            let (xs, ss, yt) = (x.cuda(WHAT)?, scale.cuda(WHAT)?, out_t.cuda_mut(WHAT)?);
            let out = out.map(|o| o.cuda_mut(WHAT)).transpose()?;
            let amax = AmaxSlot::cuda(amax, WHAT)?;
            cuda::cast_transpose(&dev, xs, shape, format, ss, yt, out, amax)
        }
    }
}

/// Converts between float types with round-to-nearest-even (`out[i] = D::from_f32(x[i].to_f32())`).
/// Source and destination types must differ (use [`Buffer::copy_from`] for a copy).
pub fn convert<S: FloatElement, D: FloatElement>(
    x: &Buffer<S>,
    out: &mut Buffer<D>,
) -> Result<(), KernelError> {
    const WHAT: &str = "convert";
    check_len(WHAT, x.len(), out.len())?;
    if S::DTYPE == D::DTYPE {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("source and destination are both {}", S::DTYPE),
        });
    }
    dispatch!(WHAT, [x, out],
        cpu: cpu::convert(x.host(WHAT)?, out.host_mut(WHAT)?),
        cuda(dev): cuda::convert(&dev, x.cuda(WHAT)?, out.cuda_mut(WHAT)?))
}

/// Verification aid: `out[i]` = the FP8 code of the f32 whose bit pattern is `start + i`, at scale 1,
/// computed on the GPU. With `canonical_nan` it uses the conversion every cast kernel uses (NaN fixed up
/// to `0x7F`); without, the bare hardware instruction, to observe what the hardware does with NaN.
/// `out` must be a CUDA buffer; `start + out.len()` must not exceed 2^32.
pub fn fp8_encode_bit_patterns(
    start: u32,
    format: Fp8Format,
    canonical_nan: bool,
    out: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "fp8_encode_bit_patterns";
    let dev = cuda_of(out).ok_or(KernelError::NeedsCuda(WHAT))?;
    if start as u64 + out.len() as u64 > 1u64 << 32 {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("{start} + {} runs past 2^32", out.len()),
        });
    }
    cuda::encode_bit_patterns(&dev, start, format, canonical_nan, out.cuda_mut(WHAT)?)
}
