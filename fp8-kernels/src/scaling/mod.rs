//! Scales from amaxes, computed where the buffers live (no host round trip on CUDA): the step-end update
//! of a delayed-scaling meta ([`update_scaling_meta`]: history ring, window maximum, new scale) and the
//! scale of one amax ([`scale_from_amax`]). Both follow [`fp8_core::compute_scale`] operation by operation
//! (`cuda/common.cuh`'s `compute_scale_dev`), so CPU and CUDA agree bit for bit.

mod cpu;
mod cuda;

use crate::device::{device_of, dispatch, Placed};
use crate::{check_len, Buffer, Device, KernelError};
use fp8_core::{AmaxCompute, Fp8Format, QType, ScalingRecipe};

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

impl Placed for AmaxInput<'_> {
    fn placement(&self) -> Option<Device> {
        match self {
            AmaxInput::Take(b, _) => b.placement(),
            AmaxInput::Read(b, _) => b.placement(),
        }
    }
}

impl AmaxInput<'_> {
    fn len_and_slot(&self) -> (usize, usize) {
        match self {
            AmaxInput::Take(b, s) => (b.len(), *s),
            AmaxInput::Read(b, s) => (b.len(), *s),
        }
    }
}

/// The step-end update of a scaling meta: records `|amax|` in the history ring, recomputes `scale` and
/// `scale_inv` per `recipe` (window maximum or most recent entry; [`fp8_core::compute_scale`] with the
/// recipe's margin and rounding, keeping the previous scale when the amax is zero or not finite), exactly
/// as [`fp8_core::ScalingMeta::update_from_amax`] does on the host, bit for bit. `qtype` gives the
/// format's maximum.
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
    let rule = cpu::MetaRule {
        window_max,
        fmax: qtype.max_finite(),
        margin,
        rounding,
    };
    check_len(WHAT, 1, meta.scale.len())?;
    check_len(WHAT, 1, meta.scale_inv.len())?;
    check_len(WHAT, 3, meta.state.len())?;
    if meta.history.is_empty() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "empty amax history".into(),
        });
    }
    let (src_len, slot) = amax.len_and_slot();
    if slot >= src_len {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!("amax slot {slot} outside a buffer of {src_len}"),
        });
    }
    let dev = device_of(
        WHAT,
        &[meta.scale, meta.scale_inv, meta.history, meta.state, &amax],
    )?;
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
            let ScalingMetaBuffers {
                scale,
                scale_inv,
                history,
                state,
            } = meta;
            cpu::update_meta(
                WHAT,
                &rule,
                a,
                &mut scale.host_mut(WHAT)?[0],
                &mut scale_inv.host_mut(WHAT)?[0],
                history.host_mut(WHAT)?,
                state.host_mut(WHAT)?,
            )
        }
        Some(dev) => cuda::update_meta(&dev, &rule, meta, amax),
    }
}

/// The scale of one amax with the previous scale taken as 1: `scale[0] = compute_scale(amax[0],
/// format.max(), margin, PowerOfTwo, 1.0)`, `scale_inv[0] = 1 / scale[0]` (e.g. the scale of an FP8
/// gradient reduction from its all-reduced amax; a zero amax gives scale 1, every value being 0).
pub fn scale_from_amax(
    amax: &Buffer<f32>,
    format: Fp8Format,
    margin: i32,
    scale: &mut Buffer<f32>,
    scale_inv: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "scale_from_amax";
    if amax.is_empty() || scale.is_empty() || scale_inv.is_empty() {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: "amax, scale and scale_inv need one element each".into(),
        });
    }
    if !(0..=fp8_core::MAX_MARGIN).contains(&margin) {
        return Err(fp8_core::Fp8Error::InvalidMargin(margin).into());
    }
    let fmax = format.max();
    dispatch!(WHAT, [amax, scale, scale_inv],
    cpu: {
        let (s, si) = cpu::scale_from_amax(amax.host(WHAT)?[0], fmax, margin);
        scale.host_mut(WHAT)?[0] = s;
        scale_inv.host_mut(WHAT)?[0] = si;
    },
    cuda(dev): {
        let (a, s, si) = (amax.cuda(WHAT)?, scale.cuda_mut(WHAT)?, scale_inv.cuda_mut(WHAT)?);
        cuda::scale_from_amax(&dev, a, fmax, margin, s, si)
    })
}
