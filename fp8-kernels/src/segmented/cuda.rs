//! Launches of the segmented kernels (`segmented.cu`): one grid row per segment (`gridDim.y`), grid-stride
//! within it. `mod.rs` validated the table against the buffers and the slots.

use super::{Segment, SegmentTable};
use crate::cast::format_name;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::SEGMENTED_MODULE;
use crate::launch::{grid_1d, kernel_name, launch, BLOCKS_PER_SM};
use crate::{Buffer, CudaDevice, KernelError};
use cudarc::driver::LaunchConfig;
use fp8_core::Fp8Format;

/// A launch with one grid row per segment.
fn table_launch(table: &SegmentTable, dev: &CudaDevice) -> Result<LaunchConfig, KernelError> {
    let longest = table.segments.iter().map(Segment::len).max().unwrap_or(1) as u64;
    let rows = table.segments.len() as u32;
    // Fill the GPU about BLOCKS_PER_SM times over, split between the segments.
    let per_row = (BLOCKS_PER_SM / rows.max(1)).max(1);
    let mut cfg = grid_1d(dev.sm_count(), longest, per_row);
    cfg.grid_dim.1 = rows;
    Ok(cfg)
}

pub(super) fn segmented_amax(
    dev: &CudaDevice,
    x: &Buffer<f32>,
    table: &SegmentTable,
    out: &mut Buffer<f32>,
    base: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_amax";
    let cfg = table_launch(table, dev)?;
    let b64 = base as u64;
    let (xs, ts, os) = (cs(x, WHAT)?, table.device_table(WHAT)?, cs_mut(out, WHAT)?);
    launch!(
        dev,
        &SEGMENTED_MODULE,
        "segmented_amax_f32",
        cfg,
        "segmented_amax_f32(const float* x, const u64* table, float* out, u64 base)",
        [xs, ts, os, &b64]
    )
}

pub(super) fn segmented_scales(
    dev: &CudaDevice,
    amax: &Buffer<f32>,
    base: usize,
    count: usize,
    fmax: f32,
    margin: i32,
    scales: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_scales";
    let cfg = grid_1d(dev.sm_count(), count as u64, 1);
    let (b64, c64) = (base as u64, count as u64);
    let (a, s) = (cs(amax, WHAT)?, cs_mut(scales, WHAT)?);
    launch!(
        dev,
        &SEGMENTED_MODULE,
        "segmented_scales",
        cfg,
        "segmented_scales(const float* amax, u64 base, u64 count, float* scales, float fmax, int margin)",
        [a, &b64, &c64, s, &fmax, &margin]
    )
}

pub(super) fn segmented_cast(
    dev: &CudaDevice,
    x: &Buffer<f32>,
    table: &SegmentTable,
    format: Fp8Format,
    scales: &Buffer<f32>,
    out: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_cast";
    dev.require_fp8()?;
    let cfg = table_launch(table, dev)?;
    let (xs, ts, ss) = (cs(x, WHAT)?, table.device_table(WHAT)?, cs(scales, WHAT)?);
    let ys = cs_mut(out, WHAT)?;
    launch!(
        dev,
        &SEGMENTED_MODULE,
        kernel_name!("segmented_cast_f32_", format_name(format)),
        cfg,
        "segmented_cast_f32_<fmt>(const float* x, u8* y, const u64* table, const float* scales)",
        [xs, ys, ts, ss]
    )
}
