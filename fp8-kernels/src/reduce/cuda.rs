//! Launches of the reductions (`reduce.cu`). `mod.rs` validated every argument.

use crate::kernel_source::REDUCE_MODULE;
use crate::launch::{grid, kernel_name, launch, optional_ptr_mut};
use crate::{CudaDevice, DType, FloatElement, KernelError};
use cudarc::driver::{CudaSlice, LaunchConfig};
use std::ops::Range;

/// Column sums: with one chunk straight into `out`, else per-chunk sums into a temporary, then the sum
/// of the chunk sums.
pub(super) fn sum_over_rows<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    rows: usize,
    cols: usize,
    chunk: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let chunks = rows.div_ceil(chunk).max(1);
    let cfg = grid(dev, (chunks * cols) as u64);
    let (r, c, ch) = (rows as u64, cols as u64, chunk as u64);
    let name = kernel_name!("sum_rows_", T::NAME);
    if chunks == 1 {
        return launch!(
            dev,
            &REDUCE_MODULE,
            name,
            cfg,
            "sum_rows_<T>(const T* x, float* partial, u64 rows, u64 cols, u64 chunk)",
            [x, out, &r, &c, &ch]
        );
    }
    // SAFETY: every element is written by `sum_rows_<T>` below before `sum_partials_f32` reads it.
    let mut partial = unsafe { dev.stream().alloc::<f32>(chunks * cols) }?;
    let p = &mut partial;
    launch!(
        dev,
        &REDUCE_MODULE,
        name,
        cfg,
        "sum_rows_<T>(const T* x, float* partial, u64 rows, u64 cols, u64 chunk)",
        [x, p, &r, &c, &ch]
    )?;
    let k = chunks as u64;
    let p = &partial;
    launch!(
        dev,
        &REDUCE_MODULE,
        "sum_partials_f32",
        grid(dev, cols as u64),
        "sum_partials_f32(const float* partial, float* out, u64 chunks, u64 cols)",
        [p, out, &k, &c]
    )
}

/// Row sums, one warp per row.
pub(super) fn sum_over_cols<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    rows: usize,
    cols: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let (r, c) = (rows as u64, cols as u64);
    launch!(
        dev,
        &REDUCE_MODULE,
        kernel_name!("sum_cols_", T::NAME),
        grid(dev, rows as u64 * 32),
        "sum_cols_<T>(const T* x, float* out, u64 rows, u64 cols)",
        [x, out, &r, &c]
    )
}

pub(super) fn finite_amax_count(
    dev: &CudaDevice,
    x: &CudaSlice<f32>,
    amax: &mut CudaSlice<f32>,
    count: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    launch!(
        dev,
        &REDUCE_MODULE,
        "finite_amax_count_f32",
        grid(dev, n),
        "finite_amax_count_f32(const float* x, float* amax, u32* count, u64 n)",
        [x, amax, count, &n]
    )
}

pub(super) fn norm_stats<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    range: Range<usize>,
    acc: &mut CudaSlice<f32>,
    amax: Option<(&mut CudaSlice<f32>, usize)>,
) -> Result<(), KernelError> {
    const WHAT: &str = "norm_stats";
    let name = match T::DTYPE {
        DType::F32 | DType::BF16 => kernel_name!("norm_stats_", T::NAME),
        other => {
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("{other} values are not supported on CUDA"),
            })
        }
    };
    let n = range.len();
    if n == 0 {
        return Ok(());
    }
    let (off, len) = (range.start as u64, n as u64);
    let (slot, with) = amax.as_ref().map_or((0u64, 0i32), |(_, s)| (*s as u64, 1));
    let amax = optional_ptr_mut(amax.map(|(b, _)| b), dev.stream());
    launch!(
        dev,
        &REDUCE_MODULE,
        name,
        grid(dev, len.div_ceil(4)),
        "norm_stats_<T>(const T* g, u64 off, u64 n, float* acc, float* amax, u64 slot, int with_amax)",
        [x, &off, &len, acc, &amax.ptr, &slot, &with]
    )
}

pub(super) fn norm_stats_finish(
    dev: &CudaDevice,
    acc: &mut CudaSlice<f32>,
    extra_nonfinite: u32,
    sums: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    launch!(
        dev,
        &REDUCE_MODULE,
        "norm_stats_finish",
        LaunchConfig::for_num_elems(1),
        "norm_stats_finish(float* acc, u32 extra_nonfinite, float* sums)",
        [acc, &extra_nonfinite, sums]
    )
}

pub(super) fn norm_stats_take_count(
    dev: &CudaDevice,
    acc: &mut CudaSlice<f32>,
    count: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    launch!(
        dev,
        &REDUCE_MODULE,
        "norm_stats_take_count",
        LaunchConfig::for_num_elems(1),
        "norm_stats_take_count(float* acc, u32* count)",
        [acc, count]
    )
}
