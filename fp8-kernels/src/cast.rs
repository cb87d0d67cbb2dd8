//! FP8 casts and everything around them: amax, one-pass cast with amax (delayed scaling), the
//! current-scaling cast (scale computed on the device), the update of a device-resident scaling meta,
//! dequantization,
//! cast+transpose, and conversions between f32, bf16 and f16.
//!
//! Scales and amaxes are read from and written to device buffers (pointers, never host values), so a
//! training step on CUDA needs no host round trip. Every function runs where its buffers live: on the CPU
//! with rayon, or on the buffers' GPU on its compute stream (asynchronously).
//!
//! Bit-exactness: a cast computes `encode(x * scale)` with one f32 multiply, exactly as
//! [`fp8_core::Fp8Format::encode_scaled`]; the CUDA kernels use the hardware `cvt.rn.satfinite` instructions
//! (NaN fixed up to fp8-core's canonical `0x7F`) and agree bit for bit.
//!
//! Amax rules (both devices): the amax is the largest `|x|`; NaN inputs never raise it (they are
//! encoded as NaN); an infinite input makes it infinite. Amax outputs *accumulate*:
//! `slot = max(slot, amax(x))`, so several casts (micro-batches, or shards) can share a slot; zero the
//! slot to start afresh (the scaling-meta update does that for its own slot).

use crate::device::{cuda_slice, cuda_slice_mut};
use crate::kernel_source::{cast_transpose_launch, function, grid_1d, sm_count, CAST_MODULE};
use crate::{Buffer, CudaDevice, Device, Element, KernelError};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use fp8_core::{compute_scale, AmaxCompute, Fp8Format, QType, ScaleRounding, ScalingRecipe};
use rayon::prelude::*;

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

impl<'a> AmaxSlot<'a> {
    /// Slot `slot` of `buffer`.
    pub fn new(buffer: &'a mut Buffer<f32>, slot: usize) -> Self {
        AmaxSlot { buffer, slot }
    }

    /// Slot 0 of `buffer`.
    pub fn first(buffer: &'a mut Buffer<f32>) -> Self {
        AmaxSlot { buffer, slot: 0 }
    }

    fn check(&self, what: &'static str) -> Result<(), KernelError> {
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

pub(crate) fn format_name(f: Fp8Format) -> &'static str {
    match f {
        Fp8Format::E4M3 => "e4m3",
        Fp8Format::E5M2 => "e5m2",
    }
}

/// Elements per rayon task of the CPU paths.
const CPU_CHUNK: usize = 1 << 14;
/// Below this many elements the CPU paths stay on the calling thread.
const CPU_PAR_THRESHOLD: usize = 1 << 16;

/// A null device pointer, for optional kernel outputs.
const NULL_PTR: u64 = 0;

/// `max(acc, |v|)` ignoring NaN (f32::max returns the non-NaN operand).
#[inline]
fn amax_fold(acc: f32, v: f32) -> f32 {
    acc.max(v.abs())
}

fn cpu_amax<T: FloatElement>(x: &[T]) -> f32 {
    let run = |s: &[T]| s.iter().fold(0.0f32, |a, &v| amax_fold(a, v.to_f32()));
    if x.len() < CPU_PAR_THRESHOLD {
        run(x)
    } else {
        x.par_chunks(CPU_CHUNK).map(run).reduce(|| 0.0, f32::max)
    }
}

/// Casts `x` into `y` and returns the amax of `x`.
fn cpu_cast<T: FloatElement>(x: &[T], format: Fp8Format, scale: f32, y: &mut [u8]) -> f32 {
    let run = |s: &[T], d: &mut [u8]| {
        let mut a = 0.0f32;
        for (o, &v) in d.iter_mut().zip(s) {
            let v = v.to_f32();
            a = amax_fold(a, v);
            *o = format.encode(v * scale);
        }
        a
    };
    if x.len() < CPU_PAR_THRESHOLD {
        run(x, y)
    } else {
        x.par_chunks(CPU_CHUNK)
            .zip(y.par_chunks_mut(CPU_CHUNK))
            .map(|(s, d)| run(s, d))
            .reduce(|| 0.0, f32::max)
    }
}

fn first_value(b: &Buffer<f32>, what: &'static str) -> Result<f32, KernelError> {
    b.host(what)?
        .first()
        .copied()
        .ok_or_else(|| KernelError::InvalidArgument {
            what,
            detail: "scale buffer is empty".into(),
        })
}

fn check_nonempty(b: &Buffer<f32>, what: &'static str) -> Result<(), KernelError> {
    if b.is_empty() {
        Err(KernelError::InvalidArgument {
            what,
            detail: "scalar buffer is empty".into(),
        })
    } else {
        Ok(())
    }
}

fn accumulate_host(slot: AmaxSlot<'_>, what: &'static str, a: f32) -> Result<(), KernelError> {
    let s = &mut slot.buffer.host_mut(what)?[slot.slot];
    *s = s.max(a);
    Ok(())
}

/// The CUDA device of `x` if it lives on one; then every other buffer must live on the same GPU.
pub(crate) fn cuda_of<T: Element>(x: &Buffer<T>) -> Option<CudaDevice> {
    x.as_cuda().map(|(_, d)| d.clone())
}

/// An error unless `b` lives on `dev` (the same CUDA device, or the CPU when `dev` is None).
pub(crate) fn same_device<T: Element>(
    what: &'static str,
    dev: &Option<CudaDevice>,
    b: &Buffer<T>,
) -> Result<(), KernelError> {
    let ok = match (dev, b.device()) {
        (None, Device::Cpu) => true,
        (Some(d), other) => other == Device::Cuda(d.clone()),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

/// Blocks per SM of the streaming kernels.
const STREAM_BLOCKS_PER_SM: u32 = 8;

fn vec_launch(dev: &CudaDevice, n: usize, per_thread: usize) -> Result<LaunchConfig, KernelError> {
    let items = (n / per_thread) as u64 + 1;
    Ok(grid_1d(sm_count(dev)?, items, STREAM_BLOCKS_PER_SM))
}

/// Accumulates the amax of `x` into `out` (`out.buffer[out.slot] = max(.., max |x|)`), on the device of `x`.
pub fn amax<T: FloatElement>(x: &Buffer<T>, out: AmaxSlot<'_>) -> Result<(), KernelError> {
    const WHAT: &str = "amax";
    out.check(WHAT)?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, out.buffer)?;
    match dev {
        None => accumulate_host(out, WHAT, cpu_amax(x.host(WHAT)?)),
        Some(dev) => {
            let f = function(&dev, &CAST_MODULE, &format!("amax_{}", T::NAME))?;
            let cfg = vec_launch(&dev, x.len(), 16)?;
            let (slot, n) = (out.slot as i32, x.len() as u64);
            let xs = cuda_slice(x, WHAT)?;
            let a = cuda_slice_mut(out.buffer, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(a).arg(&slot).arg(&n);
            // SAFETY: argument types match `amax_<T>(const T*, float*, int, u64)`; the slot is in bounds and
            // the kernel reads exactly n elements of x.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
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
    crate::check_len(WHAT, x.len(), out.len())?;
    check_nonempty(scale, WHAT)?;
    if let Some(a) = &amax {
        a.check(WHAT)?;
    }
    let dev = cuda_of(x);
    same_device(WHAT, &dev, scale)?;
    same_device(WHAT, &dev, out)?;
    if let Some(a) = &amax {
        same_device(WHAT, &dev, a.buffer)?;
    }
    match dev {
        None => {
            let s = first_value(scale, WHAT)?;
            let a = cpu_cast(x.host(WHAT)?, format, s, out.host_mut(WHAT)?);
            match amax {
                Some(slot) => accumulate_host(slot, WHAT, a),
                None => Ok(()),
            }
        }
        Some(dev) => {
            dev.require_fp8()?;
            let name = format!("cast_fp8_{}_{}", T::NAME, format_name(format));
            let f = function(&dev, &CAST_MODULE, &name)?;
            let cfg = vec_launch(&dev, x.len(), 16)?;
            let n = x.len() as u64;
            let xs = cuda_slice(x, WHAT)?;
            let ss = cuda_slice(scale, WHAT)?;
            let ys = cuda_slice_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(ys).arg(ss);
            let slot: i32;
            match amax {
                Some(a) => {
                    slot = a.slot as i32;
                    b.arg(cuda_slice_mut(a.buffer, WHAT)?);
                }
                None => {
                    slot = 0;
                    b.arg(&NULL_PTR);
                }
            }
            b.arg(&slot).arg(&n);
            // SAFETY: `cast_fp8_<T>_<fmt>(const T*, u8*, const float*, float* or null, int, u64)`; x and out
            // hold n elements, scale at least one, the amax slot is in bounds.
            unsafe { b.launch(cfg) }?;
            Ok(())
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
    crate::check_len(WHAT, x.len(), out.len())?;
    if !(0..=fp8_core::MAX_MARGIN).contains(&spec.margin) {
        return Err(fp8_core::Fp8Error::InvalidMargin(spec.margin).into());
    }
    for b in [&*scale, &*scale_inv, &*amax] {
        check_nonempty(b, WHAT)?;
    }
    let dev = cuda_of(x);
    for b in [&*scale, &*scale_inv, &*amax] {
        same_device(WHAT, &dev, b)?;
    }
    same_device(WHAT, &dev, out)?;
    let fmax = spec.format.max();
    let exact = matches!(spec.rounding, ScaleRounding::Exact) as i32;
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let a = cpu_amax(xs);
            let prev = first_value(scale, WHAT)?;
            let s = compute_scale(a, fmax, spec.margin, spec.rounding, prev);
            scale.host_mut(WHAT)?[0] = s;
            scale_inv.host_mut(WHAT)?[0] = 1.0 / s;
            amax.host_mut(WHAT)?[0] = a;
            cpu_cast(xs, spec.format, s, out.host_mut(WHAT)?);
            Ok(())
        }
        Some(dev) => {
            dev.require_fp8()?;
            {
                let a = cuda_slice_mut(amax, WHAT)?;
                let mut first = a.slice_mut(0..1);
                dev.stream().memset_zeros(&mut first)?;
            }
            self::amax(x, AmaxSlot::first(amax))?;
            let name = format!("cast_fp8_current_{}_{}", T::NAME, format_name(spec.format));
            let f = function(&dev, &CAST_MODULE, &name)?;
            let cfg = vec_launch(&dev, x.len(), 16)?;
            let (n, margin) = (x.len() as u64, spec.margin);
            let xs = cuda_slice(x, WHAT)?;
            let ys = cuda_slice_mut(out, WHAT)?;
            let ss = cuda_slice_mut(scale, WHAT)?;
            let si = cuda_slice_mut(scale_inv, WHAT)?;
            let am = cuda_slice(amax, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(ys).arg(ss).arg(si).arg(am);
            b.arg(&fmax).arg(&margin).arg(&exact).arg(&n);
            // SAFETY: `cast_fp8_current_<T>_<fmt>(const T*, u8*, float*, float*, const float*, float, int,
            // int, u64)`; x and out hold n elements, the scalar buffers at least one each.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
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
    crate::check_len(WHAT, q.len(), out.len())?;
    check_nonempty(scale_inv, WHAT)?;
    let dev = cuda_of(q);
    same_device(WHAT, &dev, scale_inv)?;
    same_device(WHAT, &dev, out)?;
    match dev {
        None => {
            let si = first_value(scale_inv, WHAT)?;
            let table = format.decode_table();
            let run = |s: &[u8], d: &mut [T]| {
                for (o, &c) in d.iter_mut().zip(s) {
                    *o = T::from_f32(table[c as usize] * si);
                }
            };
            let (qs, ys) = (q.host(WHAT)?, out.host_mut(WHAT)?);
            if qs.len() < CPU_PAR_THRESHOLD {
                run(qs, ys);
            } else {
                qs.par_chunks(CPU_CHUNK)
                    .zip(ys.par_chunks_mut(CPU_CHUNK))
                    .for_each(|(s, d)| run(s, d));
            }
            Ok(())
        }
        Some(dev) => {
            dev.require_fp8()?;
            let name = format!("dequant_{}_{}", format_name(format), T::NAME);
            let f = function(&dev, &CAST_MODULE, &name)?;
            let cfg = vec_launch(&dev, q.len(), 16)?;
            let n = q.len() as u64;
            let qs = cuda_slice(q, WHAT)?;
            let si = cuda_slice(scale_inv, WHAT)?;
            let ys = cuda_slice_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(qs).arg(ys).arg(si).arg(&n);
            // SAFETY: `dequant_<fmt>_<T>(const u8*, T*, const float*, u64)`; q and out hold n elements.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Side of the square tiles of the CPU and CUDA cast+transpose.
const TRANSPOSE_TILE: usize = 32;

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
    crate::check_len(WHAT, n, x.len())?;
    crate::check_len(WHAT, n, out_t.len())?;
    if let Some(o) = &out {
        crate::check_len(WHAT, n, o.len())?;
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
    let dev = cuda_of(x);
    same_device(WHAT, &dev, scale)?;
    same_device(WHAT, &dev, out_t)?;
    if let Some(o) = &out {
        same_device(WHAT, &dev, o)?;
    }
    if let Some(a) = &amax {
        same_device(WHAT, &dev, a.buffer)?;
    }
    match dev {
        None => {
            let s = first_value(scale, WHAT)?;
            let xs = x.host(WHAT)?;
            let a = match out {
                Some(o) => cpu_cast(xs, format, s, o.host_mut(WHAT)?),
                None => cpu_amax(xs),
            };
            cpu_cast_transpose(xs, rows, cols, format, s, out_t.host_mut(WHAT)?);
            match amax {
                Some(slot) => accumulate_host(slot, WHAT, a),
                None => Ok(()),
            }
        }
        Some(dev) => {
            dev.require_fp8()?;
            let name = format!("cast_transpose_{}_{}", T::NAME, format_name(format));
            let f = function(&dev, &CAST_MODULE, &name)?;
            let cfg = cast_transpose_launch(sm_count(&dev)?, rows, cols);
            let (r, c) = (rows as i32, cols as i32);
            let xs = cuda_slice(x, WHAT)?;
            let ss = cuda_slice(scale, WHAT)?;
            let yt = cuda_slice_mut(out_t, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs);
            match out {
                Some(o) => b.arg(cuda_slice_mut(o, WHAT)?),
                None => b.arg(&NULL_PTR),
            };
            b.arg(yt).arg(ss);
            let slot: i32;
            match amax {
                Some(a) => {
                    slot = a.slot as i32;
                    b.arg(cuda_slice_mut(a.buffer, WHAT)?);
                }
                None => {
                    slot = 0;
                    b.arg(&NULL_PTR);
                }
            }
            b.arg(&slot).arg(&r).arg(&c);
            // SAFETY: `cast_transpose_<T>_<fmt>(const T*, u8* or null, u8*, const float*, float* or null,
            // int, int, int)`; all buffers hold rows*cols elements, the slot is in bounds.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

fn cpu_cast_transpose<T: FloatElement>(
    x: &[T],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    scale: f32,
    yt: &mut [u8],
) {
    if rows == 0 || cols == 0 {
        return;
    }
    // Each task owns a band of TRANSPOSE_TILE output rows (= input columns) and walks it in square tiles,
    // so reads and writes both stay within a few cache lines per row.
    yt.par_chunks_mut(TRANSPOSE_TILE * rows)
        .enumerate()
        .for_each(|(band, out)| {
            let c0 = band * TRANSPOSE_TILE;
            let cw = out.len() / rows;
            for r0 in (0..rows).step_by(TRANSPOSE_TILE) {
                let rh = TRANSPOSE_TILE.min(rows - r0);
                for r in r0..r0 + rh {
                    let row = &x[r * cols + c0..r * cols + c0 + cw];
                    for (dc, &v) in row.iter().enumerate() {
                        out[dc * rows + r] = format.encode(v.to_f32() * scale);
                    }
                }
            }
        });
}

/// Converts between float types with round-to-nearest-even (`out[i] = D::from_f32(x[i].to_f32())`).
/// Source and destination types must differ (use [`Buffer::copy_from`] for a copy).
pub fn convert<S: FloatElement, D: FloatElement>(
    x: &Buffer<S>,
    out: &mut Buffer<D>,
) -> Result<(), KernelError> {
    const WHAT: &str = "convert";
    crate::check_len(WHAT, x.len(), out.len())?;
    if S::DTYPE == D::DTYPE {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("source and destination are both {}", S::DTYPE),
        });
    }
    let dev = cuda_of(x);
    same_device(WHAT, &dev, out)?;
    match dev {
        None => {
            let (xs, ys) = (x.host(WHAT)?, out.host_mut(WHAT)?);
            let run = |s: &[S], d: &mut [D]| {
                for (o, &v) in d.iter_mut().zip(s) {
                    *o = D::from_f32(v.to_f32());
                }
            };
            if xs.len() < CPU_PAR_THRESHOLD {
                run(xs, ys);
            } else {
                xs.par_chunks(CPU_CHUNK)
                    .zip(ys.par_chunks_mut(CPU_CHUNK))
                    .for_each(|(s, d)| run(s, d));
            }
            Ok(())
        }
        Some(dev) => {
            let f = function(
                &dev,
                &CAST_MODULE,
                &format!("convert_{}_{}", S::NAME, D::NAME),
            )?;
            let cfg = vec_launch(&dev, x.len(), 8)?;
            let n = x.len() as u64;
            let xs = cuda_slice(x, WHAT)?;
            let ys = cuda_slice_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(ys).arg(&n);
            // SAFETY: `convert_<S>_<D>(const S*, D*, u64)`; both buffers hold n elements.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// The device buffers of one FP8 scaling meta, as [`update_scaling_meta`] reads and writes them:
/// `scale[1]`, `scale_inv[1]`, `history[window]` (a ring of recorded amaxes) and `state[3]` = ring
/// position (index of the oldest entry) and the 64-bit count of recorded amaxes (low, high word). Who
/// owns them (a layer's meta, a registry of a model's metas) is the caller's business.
#[derive(Debug)]
pub struct ScalingMetaBuffers<'a> {
    /// `scale[0]`: multiply by it before encoding.
    pub scale: &'a mut Buffer<f32>,
    /// `scale_inv[0] = 1 / scale`.
    pub scale_inv: &'a mut Buffer<f32>,
    /// The amax history ring.
    pub history: &'a mut Buffer<f32>,
    /// Ring position and record count.
    pub state: &'a mut Buffer<u32>,
}

/// Where [`update_scaling_meta`] takes the amax it records.
#[derive(Debug)]
pub enum AmaxInput<'a> {
    /// `buffer[slot]`, which is reset to zero after it is read (a pending amax consumed by the update).
    Take(&'a mut Buffer<f32>, usize),
    /// `buffer[slot]`, only read (e.g. one entry of a vector all-reduced with MAX across ranks).
    Read(&'a Buffer<f32>, usize),
}

/// The step-end update of a scaling meta: records `|amax|` in the history ring, recomputes `scale` and
/// `scale_inv` per `recipe` (window maximum or most recent entry; [`fp8_core::compute_scale`] with the
/// recipe's margin and rounding, keeping the previous scale when the amax is zero or not finite), exactly
/// as [`fp8_core::ScalingMeta::update_from_amax`] does on the host, bit for bit. `qtype` gives the format's maximum.
pub fn update_scaling_meta(
    meta: ScalingMetaBuffers<'_>,
    qtype: QType,
    recipe: &ScalingRecipe,
    amax: AmaxInput<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "update_scaling_meta";
    let (window_max, margin, rounding) = match *recipe {
        ScalingRecipe::Delayed {
            amax_compute,
            margin,
            rounding,
            ..
        } => (amax_compute == AmaxCompute::Max, margin, rounding),
        ScalingRecipe::Current { margin, rounding } => (false, margin, rounding),
    };
    let fmax = qtype.max_finite();
    let ScalingMetaBuffers {
        scale,
        scale_inv,
        history,
        state,
    } = meta;
    crate::check_len(WHAT, 1, scale.len())?;
    crate::check_len(WHAT, 1, scale_inv.len())?;
    crate::check_len(WHAT, 3, state.len())?;
    if history.is_empty() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "empty amax history".into(),
        });
    }
    let (src_len, slot) = match &amax {
        AmaxInput::Take(b, s) => (b.len(), *s),
        AmaxInput::Read(b, s) => (b.len(), *s),
    };
    if slot >= src_len {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("amax slot {slot} outside a buffer of {src_len}"),
        });
    }
    let dev = cuda_of(scale);
    for b in [&*scale_inv, &*history] {
        same_device(WHAT, &dev, b)?;
    }
    same_device(WHAT, &dev, state)?;
    match &amax {
        AmaxInput::Take(b, _) => same_device(WHAT, &dev, b)?,
        AmaxInput::Read(b, _) => same_device(WHAT, &dev, b)?,
    }
    match dev {
        None => {
            let a = match amax {
                AmaxInput::Take(b, slot) => {
                    let h = b.host_mut(WHAT)?;
                    let a = h[slot];
                    h[slot] = 0.0;
                    a
                }
                AmaxInput::Read(b, slot) => b.host(WHAT)?[slot],
            };
            let hist = history.host_mut(WHAT)?;
            let st = state.host_mut(WHAT)?;
            let len = hist.len();
            let mut pos = st[0] as usize;
            if pos >= len {
                return Err(KernelError::InvalidArgument {
                    what: WHAT,
                    detail: format!("ring position {pos} outside a history of {len}"),
                });
            }
            hist[pos] = a.abs();
            pos = (pos + 1) % len;
            st[0] = pos as u32;
            let rec = (((st[2] as u64) << 32) | st[1] as u64) + 1;
            st[1] = rec as u32;
            st[2] = (rec >> 32) as u32;
            let w = if window_max {
                hist.iter()
                    .copied()
                    .filter(|h| h.is_finite())
                    .fold(0.0, f32::max)
            } else {
                let h = hist[(pos + len - 1) % len];
                if h.is_finite() {
                    h
                } else {
                    0.0
                }
            };
            let prev = scale.host(WHAT)?[0];
            let s = compute_scale(w, fmax, margin, rounding, prev);
            scale.host_mut(WHAT)?[0] = s;
            scale_inv.host_mut(WHAT)?[0] = 1.0 / s;
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &CAST_MODULE, "scaling_meta_update")?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let len = history.len() as i32;
            let (wm, ex) = (
                window_max as i32,
                matches!(rounding, ScaleRounding::Exact) as i32,
            );
            let (slot, reset) = match &amax {
                AmaxInput::Take(_, s) => (*s as i32, 1i32),
                AmaxInput::Read(_, s) => (*s as i32, 0i32),
            };
            let s = cuda_slice_mut(scale, WHAT)?;
            let si = cuda_slice_mut(scale_inv, WHAT)?;
            let h = cuda_slice_mut(history, WHAT)?;
            let st = cuda_slice_mut(state, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(s).arg(si).arg(h).arg(st);
            match amax {
                AmaxInput::Take(buf, _) => b.arg(cuda_slice_mut(buf, WHAT)?),
                AmaxInput::Read(buf, _) => b.arg(cuda_slice(buf, WHAT)?),
            };
            b.arg(&slot)
                .arg(&reset)
                .arg(&len)
                .arg(&wm)
                .arg(&fmax)
                .arg(&margin)
                .arg(&ex);
            // SAFETY: `scaling_meta_update(float*, float*, float*, u32*, float*, int, int, int, int,
            // float, int, int)`; the history holds `len` entries, the state 3, the slot is in bounds.
            // With reset = 0 the kernel only reads the source, so a shared (immutable) buffer is fine.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
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
    dev.require_fp8()?;
    if start as u64 + out.len() as u64 > 1u64 << 32 {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("{start} + {} runs past 2^32", out.len()),
        });
    }
    let f = function(
        &dev,
        &CAST_MODULE,
        &format!("fp8_bits_{}", format_name(format)),
    )?;
    let cfg = vec_launch(&dev, out.len(), 1)?;
    let (n, flag) = (out.len() as u64, canonical_nan as i32);
    let ys = cuda_slice_mut(out, WHAT)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(ys).arg(&start).arg(&n).arg(&flag);
    // SAFETY: `fp8_bits_<fmt>(u8*, u32, u64, int)`; out holds n bytes.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
