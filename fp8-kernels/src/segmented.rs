//! Kernels over flat FSDP buffers: per-segment amax, scales and FP8 casts (one launch per buffer, however
//! many weights it holds), a gradient added at an offset, a decoded FP8 chunk added to an F32 shard, and
//! the statistics and scale of an FP8 gradient reduction.
//!
//! A [`SegmentTable`] says which element range of a flat buffer belongs to which weight (its *slot*): the
//! amax of slot `s` goes to `out[base + s]`, the scale pair of slot `s` is `scales[2 s], scales[2 s + 1]`
//! (`[scale, scale_inv]`, the layout of `fsdp-shard`'s per-unit weight scales). The table is uploaded once
//! and reused every step.
//!
//! Every function runs where its buffers live (CPU with rayon, or the buffers' GPU on its compute stream,
//! asynchronously), and the two agree bit for bit: casts are `encode(x * scale)` with one f32 multiply,
//! sums are single f32 additions, amaxes are exact maxima (NaN never raises one).

use crate::cast::{cuda_of, format_name, same_device, FloatElement};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::{function, grid_1d, sm_count, KernelModule};
use crate::{check_len, Buffer, Device, KernelError};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use rayon::prelude::*;

/// The CUDA module of this file.
pub const SEGMENTED_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_segmented",
    files: &["common.cuh", "segmented.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/segmented.cu")
    ),
};

/// Elements per rayon task of the CPU paths.
const CPU_CHUNK: usize = 1 << 14;
/// Blocks per SM of the grid-stride kernels.
const BLOCKS_PER_SM: u32 = 8;

/// One weight's element range `[start, end)` of a flat buffer and its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// First element.
    pub start: usize,
    /// One past the last element.
    pub end: usize,
    /// Index of the weight's amax (`out[base + slot]`) and scale pair (`scales[2 slot..2 slot + 2]`).
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

    /// A launch with one grid row per segment.
    fn launch_config(&self, dev: &crate::CudaDevice) -> Result<LaunchConfig, KernelError> {
        let longest = self.segments.iter().map(Segment::len).max().unwrap_or(1) as u64;
        let rows = self.segments.len() as u32;
        // Fill the GPU about BLOCKS_PER_SM times over, split between the segments.
        let per_row = (BLOCKS_PER_SM / rows.max(1)).max(1);
        let mut cfg = grid_1d(sm_count(dev)?, longest, per_row);
        cfg.grid_dim.1 = rows;
        Ok(cfg)
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

/// Largest `|x|` over a slice, NaN ignored (as `fp8_core::amax_f32`).
fn cpu_amax(x: &[f32]) -> f32 {
    if x.len() < CPU_CHUNK * 4 {
        x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
    } else {
        x.par_chunks(CPU_CHUNK)
            .map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.abs())))
            .reduce(|| 0.0, f32::max)
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
    let dev = cuda_of(x);
    same_device(WHAT, &dev, out)?;
    check_table_device(WHAT, &dev, table)?;
    if table.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let o = out.host_mut(WHAT)?;
            for s in &table.segments {
                let a = cpu_amax(&xs[s.start..s.end]);
                let slot = &mut o[base + s.slot];
                *slot = slot.max(a);
            }
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &SEGMENTED_MODULE, "segmented_amax_f32")?;
            let cfg = table.launch_config(&dev)?;
            let b64 = base as u64;
            let (xs, ts) = (cs(x, WHAT)?, table.device_table(WHAT)?);
            let os = cs_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(ts).arg(os).arg(&b64);
            // SAFETY: `segmented_amax_f32(const float*, const u64*, float*, u64)`; every segment lies inside
            // x and every base + slot inside out (checked above); gridDim.y = number of table rows.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
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
    let dev = cuda_of(amax);
    same_device(WHAT, &dev, scales)?;
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
            let f = function(&dev, &SEGMENTED_MODULE, "segmented_scales")?;
            let cfg = grid_1d(sm_count(&dev)?, count as u64, 1);
            let (b64, c64) = (base as u64, count as u64);
            let a = cs(amax, WHAT)?;
            let s = cs_mut(scales, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(a).arg(&b64).arg(&c64).arg(s).arg(&fmax).arg(&margin);
            // SAFETY: `segmented_scales(const float*, u64, u64, float*, float, int)`; amax holds base + count
            // entries and scales 2 * count (checked above).
            unsafe { b.launch(cfg) }?;
            Ok(())
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
    let dev = cuda_of(x);
    same_device(WHAT, &dev, scales)?;
    same_device(WHAT, &dev, out)?;
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
            dev.require_fp8()?;
            let name = format!("segmented_cast_f32_{}", format_name(format));
            let f = function(&dev, &SEGMENTED_MODULE, &name)?;
            let cfg = table.launch_config(&dev)?;
            let (xs, ts, ss) = (cs(x, WHAT)?, table.device_table(WHAT)?, cs(scales, WHAT)?);
            let ys = cs_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(ys).arg(ts).arg(ss);
            // SAFETY: `segmented_cast_f32_<fmt>(const float*, u8*, const u64*, const float*)`; segments lie
            // inside x and out (same length), slots inside the scale pairs (checked above).
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// `dst[offset + i] += src[i]` for every `i < src.len()`: both widened to f32, one f32 addition, the sum
/// rounded to the destination type (exact for an F32 destination; round to nearest even for a BF16 one,
/// as `half` does: a BF16 gradient shard).
pub fn add_at<D: FloatElement, S: FloatElement>(
    dst: &mut Buffer<D>,
    offset: usize,
    src: &Buffer<S>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add_at";
    let n = src.len();
    if offset.checked_add(n).is_none_or(|e| e > dst.len()) {
        return Err(bad(
            WHAT,
            format!(
                "range {offset}..{offset}+{n} outside a buffer of {}",
                dst.len()
            ),
        ));
    }
    let dev = cuda_of(dst);
    same_device(WHAT, &dev, src)?;
    if n == 0 {
        return Ok(());
    }
    match dev {
        None => {
            let s = src.host(WHAT)?;
            let d = &mut dst.host_mut(WHAT)?[offset..offset + n];
            d.par_chunks_mut(CPU_CHUNK)
                .zip(s.par_chunks(CPU_CHUNK))
                .for_each(|(d, s)| {
                    for (o, v) in d.iter_mut().zip(s) {
                        *o = D::from_f32(o.to_f32() + v.to_f32());
                    }
                });
            Ok(())
        }
        Some(dev) => {
            let name = match D::NAME {
                "f32" => format!("add_at_{}", S::NAME),
                "bf16" => format!("add_at_{}_to_bf16", S::NAME),
                other => return Err(bad(WHAT, format!("{other} destinations are not supported"))),
            };
            let f = function(&dev, &SEGMENTED_MODULE, &name)?;
            let cfg = grid_1d(sm_count(&dev)?, n as u64, BLOCKS_PER_SM);
            let (o64, n64) = (offset as u64, n as u64);
            let s = cs(src, WHAT)?;
            let d = cs_mut(dst, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(d).arg(&o64).arg(s).arg(&n64);
            // SAFETY: `add_at_<S>[_to_bf16](D*, u64, const S*, u64)`; dst holds offset + n elements, src n.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// `dst[i] += decode(q[i]) * scale_inv[0]` (the product rounded to f32, then the f32 sum, rounded to the
/// destination type: exact for F32, nearest even for a BF16 shard).
pub fn add_decoded_fp8<D: FloatElement>(
    dst: &mut Buffer<D>,
    q: &Buffer<u8>,
    format: Fp8Format,
    scale_inv: &Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add_decoded_fp8";
    check_len(WHAT, dst.len(), q.len())?;
    if scale_inv.is_empty() {
        return Err(bad(WHAT, "scale buffer is empty".into()));
    }
    let dev = cuda_of(dst);
    same_device(WHAT, &dev, q)?;
    same_device(WHAT, &dev, scale_inv)?;
    if q.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let si = scale_inv.host(WHAT)?[0];
            let table = format.decode_table();
            let qs = q.host(WHAT)?;
            let d = dst.host_mut(WHAT)?;
            d.par_chunks_mut(CPU_CHUNK)
                .zip(qs.par_chunks(CPU_CHUNK))
                .for_each(|(d, s)| {
                    for (o, &c) in d.iter_mut().zip(s) {
                        *o = D::from_f32(o.to_f32() + table[c as usize] * si);
                    }
                });
            Ok(())
        }
        Some(dev) => {
            let name = match D::NAME {
                "f32" => format!("add_decoded_{}", format_name(format)),
                "bf16" => format!("add_decoded_{}_to_bf16", format_name(format)),
                other => return Err(bad(WHAT, format!("{other} destinations are not supported"))),
            };
            let f = function(&dev, &SEGMENTED_MODULE, &name)?;
            let n = q.len() as u64;
            let cfg = grid_1d(sm_count(&dev)?, n, BLOCKS_PER_SM);
            let (qs, si) = (cs(q, WHAT)?, cs(scale_inv, WHAT)?);
            let d = cs_mut(dst, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(d).arg(qs).arg(si).arg(&n);
            // SAFETY: `add_decoded_<fmt>[_to_bf16](D*, const u8*, const float*, u64)`; dst and q hold n elements,
            // scale_inv at least one.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Statistics of a gradient before an FP8 cast: `amax[0] = max(amax[0], max |x| over finite x)` and
/// `count[0] += number of NaN or infinite x` (a saturating cast would hide them).
pub fn finite_amax_count(
    x: &Buffer<f32>,
    amax: &mut Buffer<f32>,
    count: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "finite_amax_count";
    if amax.is_empty() || count.is_empty() {
        return Err(bad(WHAT, "amax and count need one element each".into()));
    }
    let dev = cuda_of(x);
    same_device(WHAT, &dev, amax)?;
    same_device(WHAT, &dev, count)?;
    if x.is_empty() {
        return Ok(());
    }
    match dev {
        None => {
            let (a, c) = x
                .host(WHAT)?
                .par_chunks(CPU_CHUNK)
                .map(|s| {
                    s.iter().fold((0.0f32, 0u64), |(a, c), v| {
                        if v.is_finite() {
                            (a.max(v.abs()), c)
                        } else {
                            (a, c + 1)
                        }
                    })
                })
                .reduce(|| (0.0, 0), |x, y| (x.0.max(y.0), x.1 + y.1));
            let am = &mut amax.host_mut(WHAT)?[0];
            *am = am.max(a);
            let cn = &mut count.host_mut(WHAT)?[0];
            *cn = cn.wrapping_add(c as u32);
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &SEGMENTED_MODULE, "finite_amax_count_f32")?;
            let n = x.len() as u64;
            let cfg = grid_1d(sm_count(&dev)?, n, BLOCKS_PER_SM);
            let xs = cs(x, WHAT)?;
            let a = cs_mut(amax, WHAT)?;
            let c = cs_mut(count, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(a).arg(c).arg(&n);
            // SAFETY: `finite_amax_count_f32(const float*, float*, u32*, u64)`; x holds n elements, amax and
            // count at least one each.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// The scale of an FP8 gradient reduction: `scale[0] = compute_scale(amax[0], format.max(), margin,
/// PowerOfTwo, 1.0)`, `scale_inv[0] = 1 / scale[0]`, computed where the buffers live (no host round trip).
pub fn grad_scale_from_amax(
    amax: &Buffer<f32>,
    format: Fp8Format,
    margin: i32,
    scale: &mut Buffer<f32>,
    scale_inv: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "grad_scale_from_amax";
    if amax.is_empty() || scale.is_empty() || scale_inv.is_empty() {
        return Err(bad(
            WHAT,
            "amax, scale and scale_inv need one element each".into(),
        ));
    }
    if !(0..=fp8_core::MAX_MARGIN).contains(&margin) {
        return Err(fp8_core::Fp8Error::InvalidMargin(margin).into());
    }
    let dev = cuda_of(amax);
    same_device(WHAT, &dev, scale)?;
    same_device(WHAT, &dev, scale_inv)?;
    let fmax = format.max();
    match dev {
        None => {
            let a = amax.host(WHAT)?[0];
            let s = compute_scale(a, fmax, margin, ScaleRounding::PowerOfTwo, 1.0);
            scale.host_mut(WHAT)?[0] = s;
            scale_inv.host_mut(WHAT)?[0] = 1.0 / s;
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &SEGMENTED_MODULE, "grad_scale_from_amax")?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let a = cs(amax, WHAT)?;
            let s = cs_mut(scale, WHAT)?;
            let si = cs_mut(scale_inv, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(a).arg(s).arg(si).arg(&fmax).arg(&margin);
            // SAFETY: `grad_scale_from_amax(const float*, float*, float*, float, int)`; each buffer holds at
            // least one element.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}
