//! Launches of the scaling kernels (`scaling.cu`). `mod.rs` validated every argument.

use super::{cpu::MetaRule, AmaxInput, ScalingMetaBuffers};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::SCALING_MODULE;
use crate::launch::{launch, one_block, optional_ptr, optional_ptr_mut};
use crate::{CudaDevice, KernelError};
use cudarc::driver::CudaSlice;
use fp8_core::ScaleRounding;

/// The scaling-meta update on one thread (the kernel reads and writes a handful of words).
pub(super) fn update_meta(
    dev: &CudaDevice,
    rule: &MetaRule,
    meta: ScalingMetaBuffers<'_>,
    amax: AmaxInput<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "update_scaling_meta";
    let len = meta.history.len() as i32;
    let (wm, ex) = (
        rule.window_max as i32,
        matches!(rule.rounding, ScaleRounding::Exact) as i32,
    );
    let (fmax, margin) = (rule.fmax, rule.margin);
    let s = cs_mut(meta.scale, WHAT)?;
    let si = cs_mut(meta.scale_inv, WHAT)?;
    let h = cs_mut(meta.history, WHAT)?;
    let st = cs_mut(meta.state, WHAT)?;
    // reset_src = 1 (Take): the kernel zeroes the slot after reading it; 0 (Read): it only reads it.
    let (src, slot, reset) = match amax {
        AmaxInput::Take(buf, slot) => {
            let src = optional_ptr_mut(Some(cs_mut(buf, WHAT)?), dev.stream());
            (src, slot as i32, 1i32)
        }
        AmaxInput::Read(buf, slot) => (
            optional_ptr(Some(cs(buf, WHAT)?), dev.stream()),
            slot as i32,
            0,
        ),
    };
    launch!(
        dev,
        &SCALING_MODULE,
        "scaling_meta_update",
        one_block(32),
        "scaling_meta_update(float* scale, float* scale_inv, float* history, u32* state, float* amax_src, \
         int slot, int reset_src, int history_len, int window_max, float fmax, int margin, int exact)",
        [s, si, h, st, &src.ptr, &slot, &reset, &len, &wm, &fmax, &margin, &ex]
    )
}

/// `scale[0]`, `scale_inv[0]` from `amax[0]` on one thread.
pub(super) fn scale_from_amax(
    dev: &CudaDevice,
    amax: &CudaSlice<f32>,
    fmax: f32,
    margin: i32,
    scale: &mut CudaSlice<f32>,
    scale_inv: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    launch!(
        dev,
        &SCALING_MODULE,
        "scale_from_amax",
        one_block(32),
        "scale_from_amax(const float* amax, float* scale, float* scale_inv, float fmax, int margin)",
        [amax, scale, scale_inv, &fmax, &margin]
    )
}
