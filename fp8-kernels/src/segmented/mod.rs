//! Kernels over a table of segments of one flat buffer: per-segment amax, scale pairs from amaxes, and
//! per-segment FP8 casts, each one launch however many segments the table holds.
//!
//! A [`SegmentTable`] says which element range of a buffer belongs to which *slot*: the amax of slot `s`
//! goes to `out[base + s]`, the scale pair of slot `s` is `scales[2 s], scales[2 s + 1]` (`[scale,
//! scale_inv]`). Several tensors packed into one buffer (each its own slot) are thus measured and cast in
//! one pass. The table is uploaded once and reused.
//!
//! Every function runs where its buffers live (CPU with rayon, `cpu.rs`, or the buffers' GPU on its
//! compute stream, asynchronously, `cuda.rs` and `segmented.cu`), and the two agree bit for bit: casts are
//! `encode(x * scale)` with one f32 multiply, amaxes are exact maxima (NaN never raises one).

mod cpu;
mod cuda;

use crate::device::{device_of, same_device};
use crate::{check_len, Buffer, Device, KernelError};
use cudarc::driver::CudaSlice;
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};

/// One element range `[start, end)` of a flat buffer and its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// First element.
    pub start: usize,
    /// One past the last element.
    pub end: usize,
    /// Index of the segment's amax (`out[base + slot]`) and scale pair (`scales[2 slot..2 slot + 2]`).
    pub slot: usize,
}

impl Segment {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// The segments of a flat buffer, on the host and (for CUDA) as a device table of `(start, end, slot)`.
#[derive(Debug)]
pub struct SegmentTable {
    segments: Vec<Segment>,
    /// `(start, end, slot)` as little-endian u64s split into u32 words (the kernels read `const u64*`).
    table: Option<Buffer<u32>>,
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

impl SegmentTable {
    /// A table of `segments` for buffers on `device`. Empty segments are dropped; reversed ones are an
    /// error. Segments may share a slot (their amaxes combine by max) but should not overlap.
    pub fn new(device: &Device, segments: &[Segment]) -> Result<Self, KernelError> {
        let mut kept = Vec::with_capacity(segments.len());
        for s in segments {
            if s.start > s.end {
                return Err(bad(
                    "SegmentTable",
                    format!("segment {}..{} is reversed", s.start, s.end),
                ));
            }
            if !s.is_empty() {
                kept.push(*s);
            }
        }
        if kept.len() > 65535 {
            return Err(bad(
                "SegmentTable",
                format!("{} segments exceed one launch's 65535", kept.len()),
            ));
        }
        let table = match device {
            Device::Cpu => None,
            Device::Cuda(_) if kept.is_empty() => None,
            Device::Cuda(_) => {
                let flat: Vec<u32> = kept
                    .iter()
                    .flat_map(|s| [s.start as u64, s.end as u64, s.slot as u64])
                    .flat_map(|v| [v as u32, (v >> 32) as u32])
                    .collect();
                Some(device.upload(&flat)?)
            }
        };
        Ok(SegmentTable {
            segments: kept,
            table,
        })
    }

    /// The non-empty segments.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Whether there is no non-empty segment.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    fn check(&self, what: &'static str, len: usize, slots: usize) -> Result<(), KernelError> {
        for s in &self.segments {
            if s.end > len {
                return Err(bad(
                    what,
                    format!("segment {}..{} outside a buffer of {len}", s.start, s.end),
                ));
            }
            if s.slot >= slots {
                return Err(bad(what, format!("slot {} outside {slots} slots", s.slot)));
            }
        }
        Ok(())
    }

    fn device_table(&self, what: &'static str) -> Result<&CudaSlice<u32>, KernelError> {
        self.table
            .as_ref()
            .and_then(|t| t.as_cuda())
            .map(|(s, _)| s)
            .ok_or(KernelError::WrongDevice(what))
    }
}

fn check_table_device(
    what: &'static str,
    dev: &Option<crate::CudaDevice>,
    table: &SegmentTable,
) -> Result<(), KernelError> {
    match (&table.table, dev) {
        (Some(t), _) => same_device(what, dev, t),
        (None, None) => Ok(()),
        // An empty CUDA table has no device buffer; a CPU table used with CUDA buffers is an error.
        (None, Some(_)) if table.is_empty() => Ok(()),
        (None, Some(_)) => Err(KernelError::WrongDevice(what)),
    }
}

/// For every segment `s`: `out[base + s.slot] = max(out[base + s.slot], max |x[s.start..s.end]|)` (NaN
/// never raises an amax; an infinity does). Slots must hold non-negative values before the call.
pub fn segmented_amax(
    x: &Buffer<f32>,
    table: &SegmentTable,
    out: &mut Buffer<f32>,
    base: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_amax";
    let slots = out.len().saturating_sub(base);
    table.check(WHAT, x.len(), slots)?;
    let dev = device_of(WHAT, &[x, out])?;
    check_table_device(WHAT, &dev, table)?;
    if table.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let o = out.host_mut(WHAT)?;
            for s in &table.segments {
                let a = cpu::amax(&xs[s.start..s.end]);
                let slot = &mut o[base + s.slot];
                *slot = slot.max(a);
            }
            Ok(())
        }
        Some(dev) => cuda::segmented_amax(&dev, x.cuda(WHAT)?, table, out.cuda_mut(WHAT)?, base),
    }
}

/// New scale pairs from amaxes: for `i < scales.len() / 2`,
/// `scales[2i] = compute_scale(amax[base + i], format.max(), margin, PowerOfTwo, scales[2i])` and
/// `scales[2i + 1] = 1 / scales[2i]`. A zero or non-finite amax keeps the previous scale.
pub fn segmented_scales(
    amax: &Buffer<f32>,
    base: usize,
    format: Fp8Format,
    margin: i32,
    scales: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_scales";
    if scales.len() % 2 != 0 {
        return Err(bad(
            WHAT,
            format!("{} scale entries are not pairs", scales.len()),
        ));
    }
    let count = scales.len() / 2;
    if base.checked_add(count).is_none_or(|e| e > amax.len()) {
        return Err(bad(
            WHAT,
            format!(
                "amaxes {base}..{base}+{count} outside a buffer of {}",
                amax.len()
            ),
        ));
    }
    if !(0..=fp8_core::MAX_MARGIN).contains(&margin) {
        return Err(fp8_core::Fp8Error::InvalidMargin(margin).into());
    }
    let dev = device_of(WHAT, &[amax, scales])?;
    if count == 0 {
        return Ok(());
    }
    let fmax = format.max();
    match dev {
        None => {
            let a = &amax.host(WHAT)?[base..base + count];
            let s = scales.host_mut(WHAT)?;
            for (i, &am) in a.iter().enumerate() {
                let v = compute_scale(am, fmax, margin, ScaleRounding::PowerOfTwo, s[2 * i]);
                s[2 * i] = v;
                s[2 * i + 1] = 1.0 / v;
            }
            Ok(())
        }
        Some(dev) => {
            let (a, s) = (amax.cuda(WHAT)?, scales.cuda_mut(WHAT)?);
            cuda::segmented_scales(&dev, a, base, count, fmax, margin, s)
        }
    }
}

/// For every segment `s`: `out[i] = encode(x[i] * scales[2 s.slot])` for `i` in the segment (elements
/// outside every segment are left as they are).
pub fn segmented_cast(
    x: &Buffer<f32>,
    table: &SegmentTable,
    format: Fp8Format,
    scales: &Buffer<f32>,
    out: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_cast";
    check_len(WHAT, x.len(), out.len())?;
    table.check(WHAT, x.len(), scales.len() / 2)?;
    let dev = device_of(WHAT, &[x, scales, out])?;
    check_table_device(WHAT, &dev, table)?;
    if table.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let sc = scales.host(WHAT)?;
            let o = out.host_mut(WHAT)?;
            for s in &table.segments {
                format.encode_scaled(
                    &xs[s.start..s.end],
                    sc[2 * s.slot],
                    &mut o[s.start..s.end],
                )?;
            }
            Ok(())
        }
        Some(dev) => {
            let (xs, ss) = (x.cuda(WHAT)?, scales.cuda(WHAT)?);
            cuda::segmented_cast(&dev, xs, table, format, ss, out.cuda_mut(WHAT)?)
        }
    }
}
