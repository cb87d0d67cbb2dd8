//! Launches of the Adam kernels (`adam.cu`) and of the step control (`control.cu`). The public functions
//! of `mod.rs` and `control.rs` validated ranges, slots and buffer lengths; device agreement of the
//! remaining buffers is checked here.

use super::control::{AdamControlParams, MasterSource, SlotScales};
use super::{AdamGrad, AmaxSlots, Coefficients, LowPrecisionAdamState, WeightDecay};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::ADAM_MODULE;
use crate::launch::{self, kernel_name, launch, one_block, optional_ptr, optional_ptr_mut, BLOCK};
use crate::{Buffer, CudaDevice, DType, Device, KernelError};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use fp8_core::Fp8Format;
use std::ops::Range;

fn same(what: &'static str, dev: &CudaDevice, d: Device) -> Result<(), KernelError> {
    if d == Device::Cuda(dev.clone()) {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

/// A grid-stride launch over `n` elements taken `per_thread` at a time.
fn grid(dev: &CudaDevice, n: usize, per_thread: u64) -> Result<LaunchConfig, KernelError> {
    Ok(launch::grid(dev, (n as u64).div_ceil(per_thread)))
}

/// The kernel-name suffix of a gradient type.
fn grad_suffix<G: AdamGrad>(what: &'static str) -> Result<&'static str, KernelError> {
    match G::DTYPE {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        other => Err(KernelError::InvalidArgument {
            what,
            detail: format!("{other} gradients are not supported"),
        }),
    }
}

/// F32 states; `adam_f32_g_<G>` with the coefficients by value, `adam_f32_ctl_g_<G>` reading them (and
/// the skip flag) from a coefficient buffer.
#[allow(clippy::too_many_arguments)]
pub(super) fn adam_f32<G: AdamGrad>(
    dev: &CudaDevice,
    coef: Coefficients<'_>,
    range: Range<usize>,
    master: &mut Buffer<f32>,
    m: &mut Buffer<f32>,
    v: &mut Buffer<f32>,
    grad: &Buffer<G>,
    amax: Option<AmaxSlots<'_>>,
) -> Result<(), KernelError> {
    let what = "adam_step_f32";
    same(what, dev, m.device())?;
    same(what, dev, v.device())?;
    same(what, dev, grad.device())?;
    if let Some(a) = &amax {
        same(what, dev, a.buffer.device())?;
    }
    let n = range.len();
    if n == 0 {
        return Ok(());
    }
    let g = grad_suffix::<G>(what)?;
    let cfg = grid(dev, n, 8)?;
    let (off, len) = (range.start as u64, n as u64);
    let slot = amax.as_ref().map_or(0, |a| a.base as u64);
    let (gs, ms, vs, ws) = (
        cs(grad, what)?,
        cs_mut(m, what)?,
        cs_mut(v, what)?,
        cs_mut(master, what)?,
    );
    let amax = amax.map(|a| cs_mut(a.buffer, what)).transpose()?;
    let amax = optional_ptr_mut(amax, dev.stream());
    // Each thread takes 8 elements per iteration; the amax slot is in bounds or the pointer is null.
    match coef {
        Coefficients::Host(c) => launch!(
            dev,
            &ADAM_MODULE,
            kernel_name!("adam_f32_g_", g),
            cfg,
            "adam_f32_g_<G>(float* master, float* m, float* v, const G* grad, u64 offset, u64 n, AdamCoef c, \
             float* amax, u64 slot)",
            [ws, ms, vs, gs, &off, &len, c, &amax.ptr, &slot]
        ),
        Coefficients::Device(b) => {
            let co = cs(b, what)?;
            launch!(
                dev,
                &ADAM_MODULE,
                kernel_name!("adam_f32_ctl_g_", g),
                cfg,
                "adam_f32_ctl_g_<G>(float* master, float* m, float* v, const G* grad, u64 offset, u64 n, \
                 const float* coef, float* amax, u64 slot)",
                [ws, ms, vs, gs, &off, &len, co, &amax.ptr, &slot]
            )
        }
    }
}

/// Low-precision states; `adam_lp_g_<G>` or `adam_lp_ctl_g_<G>` as for F32 states.
#[allow(clippy::too_many_arguments)]
pub(super) fn adam_low_precision<G: AdamGrad>(
    dev: &CudaDevice,
    coef: Coefficients<'_>,
    range: Range<usize>,
    state: LowPrecisionAdamState<'_>,
    grad: &Buffer<G>,
    scales: &Buffer<f32>,
    scale_base: usize,
    amax: AmaxSlots<'_>,
) -> Result<(), KernelError> {
    let what = "adam_step_low_precision";
    let LowPrecisionAdamState { master, m, v } = state;
    for d in [
        m.device(),
        v.device(),
        grad.device(),
        scales.device(),
        amax.buffer.device(),
    ] {
        same(what, dev, d)?;
    }
    dev.require_fp8()?;
    let n = range.len();
    if n == 0 {
        return Ok(());
    }
    let g = grad_suffix::<G>(what)?;
    let cfg = grid(dev, n, 8)?;
    let (off, len) = (range.start as u64, n as u64);
    let (sbase, abase) = (scale_base as u64, amax.base as u64);
    let (gs, ss, ms, vs, ws) = (
        cs(grad, what)?,
        cs(scales, what)?,
        cs_mut(m, what)?,
        cs_mut(v, what)?,
        cs_mut(master, what)?,
    );
    let am = cs_mut(amax.buffer, what)?;
    // Six scales from sbase and three amax slots from abase, all in bounds.
    match coef {
        Coefficients::Host(c) => launch!(
            dev,
            &ADAM_MODULE,
            kernel_name!("adam_lp_g_", g),
            cfg,
            "adam_lp_g_<G>(u16* master, u8* m, u16* v, const G* grad, u64 offset, u64 n, AdamCoef c, \
             const float* scales, u64 sbase, float* amax, u64 abase)",
            [ws, ms, vs, gs, &off, &len, c, ss, &sbase, am, &abase]
        ),
        Coefficients::Device(b) => {
            let co = cs(b, what)?;
            launch!(
                dev,
                &ADAM_MODULE,
                kernel_name!("adam_lp_ctl_g_", g),
                cfg,
                "adam_lp_ctl_g_<G>(u16* master, u8* m, u16* v, const G* grad, u64 offset, u64 n, \
                 const float* coef, const float* scales, u64 sbase, float* amax, u64 abase)",
                [ws, ms, vs, gs, &off, &len, co, ss, &sbase, am, &abase]
            )
        }
    }
}

/// The kernel-side copy of [`AdamControlParams`] (`StepParams` in control.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ControlRepr {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    max_grad_norm: f64,
    clip_eps: f64,
    bound_slack: f64,
    ratio_factor: f64,
    maximize: i32,
    decay_mode: i32,
    low: i32,
    master_margin: i32,
    m_margin: i32,
    v_margin: i32,
    slots: u64,
    world_size: u64,
}

// SAFETY: `#[repr(C)]` plain data (9 f64, 6 i32, 2 u64) with the layout of control.cu's `StepParams`.
unsafe impl DeviceRepr for ControlRepr {}

impl ControlRepr {
    fn new(p: &AdamControlParams) -> Self {
        let rule = p.state_scales;
        let margins = rule.map_or([0; 3], |r| r.margins);
        ControlRepr {
            lr: p.adam.lr,
            beta1: p.adam.beta1,
            beta2: p.adam.beta2,
            eps: p.adam.eps,
            weight_decay: p.adam.weight_decay,
            max_grad_norm: p.max_grad_norm.unwrap_or(0.0),
            clip_eps: p.clip_eps,
            bound_slack: rule.map_or(1.0, |r| r.slack),
            ratio_factor: rule.map_or(1.0, |r| r.ratio_factor),
            maximize: i32::from(p.adam.maximize),
            decay_mode: match p.adam.decay_mode {
                WeightDecay::L2 => 1,
                WeightDecay::Decoupled => 2,
            },
            low: i32::from(rule.is_some()),
            master_margin: margins[0],
            m_margin: margins[1],
            v_margin: margins[2],
            slots: p.slots as u64,
            world_size: p.world_size as u64,
        }
    }
}

pub(super) fn coefficients_from_stats(
    dev: &CudaDevice,
    p: &AdamControlParams,
    sums: &Buffer<f32>,
    ctl_buf: &mut Buffer<f32>,
    coef: &mut Buffer<f32>,
    slots: Option<SlotScales<'_>>,
    report: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "adam_coefficients_from_stats";
    let params = ControlRepr::new(p);
    let (s, c, co, r) = (
        cs(sums, what)?,
        cs_mut(ctl_buf, what)?,
        cs_mut(coef, what)?,
        cs_mut(report, what)?,
    );
    let stream = dev.stream();
    // The slot buffers are null for F32 states (`low == 0`), where the kernel does not touch them.
    let (amaxes, scales, write, kernel_scales) = match slots {
        Some(sl) => (
            Some(cs(sl.amaxes, what)?),
            Some(cs(sl.scales, what)?),
            Some(cs_mut(sl.write, what)?),
            Some(cs_mut(sl.kernel_scales, what)?),
        ),
        None => (None, None, None, None),
    };
    let (amaxes, scales) = (optional_ptr(amaxes, stream), optional_ptr(scales, stream));
    let write = optional_ptr_mut(write, stream);
    let kernel_scales = optional_ptr_mut(kernel_scales, stream);
    launch!(
        dev,
        &ADAM_MODULE,
        "adam_coefficients_from_stats",
        one_block(BLOCK),
        "adam_coefficients_from_stats(StepParams p, const float* sums, float* ctl, float* coef_out, \
         const float* amaxes, const float* scales, float* write, float* kernel_scales, float* report)",
        [
            &params,
            s,
            c,
            co,
            &amaxes.ptr,
            &scales.ptr,
            &write.ptr,
            &kernel_scales.ptr,
            r
        ]
    )
}

#[allow(clippy::too_many_arguments)]
pub(super) fn commit_amaxes(
    dev: &CudaDevice,
    coef: &Buffer<f32>,
    agreed: &Buffer<f32>,
    per_slot: usize,
    amaxes: &mut Buffer<f32>,
    scales: &mut Buffer<f32>,
    write: Option<&Buffer<f32>>,
    weight_amax: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    let what = "adam_commit_amaxes";
    let n = weight_amax.len();
    if n == 0 {
        return Ok(());
    }
    let cfg = grid(dev, n, 1)?;
    let (ps, slots) = (per_slot as u64, n as u64);
    let (co, ag) = (cs(coef, what)?, cs(agreed, what)?);
    let (am, sc, wa) = (
        cs_mut(amaxes, what)?,
        cs_mut(scales, what)?,
        cs_mut(weight_amax, what)?,
    );
    let write = write.map(|w| cs(w, what)).transpose()?;
    let write = optional_ptr(write, dev.stream());
    launch!(
        dev,
        &ADAM_MODULE,
        "adam_commit_amaxes",
        cfg,
        "adam_commit_amaxes(const float* coef, const float* agreed, u64 per_slot, u64 slots, float* amaxes, \
         float* scales, const float* write, float* weight_amax)",
        [co, ag, &ps, &slots, am, sc, &write.ptr, wa]
    )
}

/// The kernel arguments `master32, master16, state_scales, slot` of a [`MasterSource`] (null for the
/// unused form).
struct MasterArgs<'a> {
    master32: crate::launch::OptionalPtr<'a>,
    master16: crate::launch::OptionalPtr<'a>,
    state_scales: crate::launch::OptionalPtr<'a>,
    slot: u64,
}

fn master_args<'a>(
    dev: &'a CudaDevice,
    source: MasterSource<'a>,
    what: &'static str,
) -> Result<MasterArgs<'a>, KernelError> {
    let stream = dev.stream();
    Ok(match source {
        MasterSource::F32(m) => MasterArgs {
            master32: optional_ptr(Some(cs(m, what)?), stream),
            master16: optional_ptr::<u16>(None, stream),
            state_scales: optional_ptr::<f32>(None, stream),
            slot: 0,
        },
        MasterSource::F16 {
            master,
            scales,
            slot,
        } => MasterArgs {
            master32: optional_ptr::<f32>(None, stream),
            master16: optional_ptr(Some(cs(master, what)?), stream),
            state_scales: optional_ptr(Some(cs(scales, what)?), stream),
            slot: slot as u64,
        },
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn weight_source_values(
    dev: &CudaDevice,
    coef: &Buffer<f32>,
    out: &mut Buffer<f32>,
    range: Range<usize>,
    fp8: &Buffer<u8>,
    weight_scales: &Buffer<f32>,
    wslot: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "weight_source_values";
    dev.require_fp8()?;
    let n = range.len();
    if n == 0 {
        return Ok(());
    }
    let cfg = grid(dev, n, 4)?;
    let (off, len, ws) = (range.start as u64, n as u64, wslot as u64);
    let (co, q, wsc) = (cs(coef, what)?, cs(fp8, what)?, cs(weight_scales, what)?);
    let src = master_args(dev, source, what)?;
    let o = cs_mut(out, what)?;
    // Exactly one of the master pointers is non-null.
    launch!(
        dev,
        &ADAM_MODULE,
        "weight_source_values",
        cfg,
        "weight_source_values(const float* coef, float* out, u64 off, u64 n, const u8* fp8, \
         const float* weight_scales, u64 wslot, const float* master32, const u16* master16, \
         const float* state_scales, u64 gslot)",
        [
            co,
            o,
            &off,
            &len,
            q,
            wsc,
            &ws,
            &src.master32.ptr,
            &src.master16.ptr,
            &src.state_scales.ptr,
            &src.slot
        ]
    )
}

pub(super) fn cast_weight_source(
    dev: &CudaDevice,
    coef: &Buffer<f32>,
    fp8: &mut Buffer<u8>,
    range: Range<usize>,
    weight_scales: &Buffer<f32>,
    wslot: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "cast_weight_source";
    dev.require_fp8()?;
    let n = range.len();
    if n == 0 {
        return Ok(());
    }
    let cfg = grid(dev, n, 4)?;
    let (off, len, ws) = (range.start as u64, n as u64, wslot as u64);
    let (co, wsc) = (cs(coef, what)?, cs(weight_scales, what)?);
    let src = master_args(dev, source, what)?;
    let q = cs_mut(fp8, what)?;
    // Exactly one of the master pointers is non-null.
    launch!(
        dev,
        &ADAM_MODULE,
        "cast_weight_source",
        cfg,
        "cast_weight_source(const float* coef, u8* fp8, u64 off, u64 n, const float* weight_scales, \
         u64 wslot, const float* master32, const u16* master16, const float* state_scales, u64 gslot)",
        [
            co,
            q,
            &off,
            &len,
            wsc,
            &ws,
            &src.master32.ptr,
            &src.master16.ptr,
            &src.state_scales.ptr,
            &src.slot
        ]
    )
}

/// The 128x128 block-scaled cast of the piece `range` (`[rows, cols]`) from its master; `control.rs`
/// checked the range, the shape (32-bit sides) and the scale extent.
#[allow(clippy::too_many_arguments)]
pub(super) fn cast_weight_blocks(
    dev: &CudaDevice,
    coef: &Buffer<f32>,
    codes: &mut Buffer<u8>,
    range: Range<usize>,
    [rows, cols]: [usize; 2],
    scale_inv: &mut Buffer<f32>,
    scale_offset: usize,
    ld: usize,
    source: MasterSource<'_>,
) -> Result<(), KernelError> {
    let what = "cast_weight_blocks";
    dev.require_fp8()?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = crate::block_quantize::blocks128_launch(dev, rows, cols);
    let (off, soff, ld) = (range.start as u64, scale_offset as u64, ld as u64);
    let (r, c) = (rows as i32, cols as i32);
    let fmax = Fp8Format::E4M3.max();
    let co = cs(coef, what)?;
    let src = master_args(dev, source, what)?;
    let (q, si) = (cs_mut(codes, what)?, cs_mut(scale_inv, what)?);
    // codes and the master hold off + rows * cols elements, scale_inv the index soff + i * ld + j of every
    // block (i, j); exactly one of the master pointers is non-null.
    launch!(
        dev,
        &ADAM_MODULE,
        "cast_weight_blocks",
        cfg,
        "cast_weight_blocks(const float* coef, u8* codes, u64 off, int rows, int cols, float* scale_inv, \
         u64 soff, u64 ld, float fmax, const float* master32, const u16* master16, \
         const float* state_scales, u64 gslot)",
        [
            co,
            q,
            &off,
            &r,
            &c,
            si,
            &soff,
            &ld,
            &fmax,
            &src.master32.ptr,
            &src.master16.ptr,
            &src.state_scales.ptr,
            &src.slot
        ]
    )
}
