//! Launches of the segmented kernels (`segmented.cu`): one grid row per segment (`gridDim.y`), grid-stride
//! within it. `mod.rs` validated the table against the buffers and the slots.

use super::{Segment, SegmentTable};
use crate::cast::format_name;
use crate::kernel_source::SEGMENTED_MODULE;
use crate::launch::{grid_1d, kernel_name, launch, BLOCKS_PER_SM};
use crate::{CudaDevice, KernelError};
use cudarc::driver::{CudaSlice, LaunchConfig};
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
    x: &CudaSlice<f32>,
    table: &SegmentTable,
    out: &mut CudaSlice<f32>,
    base: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_amax";
    let cfg = table_launch(table, dev)?;
    let b64 = base as u64;
    let ts = table.device_table(WHAT)?;
    launch!(
        dev,
        &SEGMENTED_MODULE,
        "segmented_amax_f32",
        cfg,
        "segmented_amax_f32(const float* x, const u64* table, float* out, u64 base)",
        [x, ts, out, &b64]
    )
}

pub(super) fn segmented_scales(
    dev: &CudaDevice,
    amax: &CudaSlice<f32>,
    base: usize,
    count: usize,
    fmax: f32,
    margin: i32,
    scales: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let cfg = grid_1d(dev.sm_count(), count as u64, 1);
    let (b64, c64) = (base as u64, count as u64);
    launch!(
        dev,
        &SEGMENTED_MODULE,
        "segmented_scales",
        cfg,
        "segmented_scales(const float* amax, u64 base, u64 count, float* scales, float fmax, int margin)",
        [amax, &b64, &c64, scales, &fmax, &margin]
    )
}

pub(super) fn segmented_cast(
    dev: &CudaDevice,
    x: &CudaSlice<f32>,
    table: &SegmentTable,
    format: Fp8Format,
    scales: &CudaSlice<f32>,
    out: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "segmented_cast";
    dev.require_fp8()?;
    let cfg = table_launch(table, dev)?;
    let ts = table.device_table(WHAT)?;
    launch!(
        dev,
        &SEGMENTED_MODULE,
        kernel_name!("segmented_cast_f32_", format_name(format)),
        cfg,
        "segmented_cast_f32_<fmt>(const float* x, u8* y, const u64* table, const float* scales)",
        [x, out, ts, scales]
    )
}
