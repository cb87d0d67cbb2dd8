//! Launch of the row gather (`gather_rows.cu`). `mod.rs` validated the index, the range and the lengths.

use super::RowIndex;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::GATHER_ROWS_MODULE;
use crate::launch::{launch, BLOCK};
use crate::{Buffer, CudaDevice, Element, KernelError};
use cudarc::driver::LaunchConfig;
use std::ops::Range;

/// Most blocks of one gather launch (grid-stride beyond that; a batch is far smaller).
const MAX_BLOCKS: u64 = 4096;

pub(super) fn gather_rows<T: Element>(
    dev: &CudaDevice,
    src: &Buffer<T>,
    row_len: usize,
    index: &RowIndex,
    range: Range<usize>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "gather_rows";
    if std::mem::size_of::<T>() != 4 {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!(
                "CUDA gathers 4-byte elements, not {}-byte {}",
                std::mem::size_of::<T>(),
                T::DTYPE
            ),
        });
    }
    let idx = index
        .device
        .as_ref()
        .filter(|b| b.device() == src.device())
        .ok_or(KernelError::WrongDevice(WHAT))?;
    let count = range.len();
    let n = (count * row_len) as u64;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as u64).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, rl, first, cnt) = (
        index.rows as u64,
        row_len as u64,
        range.start as u64,
        count as u64,
    );
    let (s, i, o) = (cs(src, WHAT)?, cs(idx, WHAT)?, cs_mut(out, WHAT)?);
    // The kernel moves 32-bit words: the element type is 4 bytes wide (checked above). An index at or
    // past `rows` is not read through (the kernel writes zeros); the RowIndex rejected such indices anyway.
    launch!(
        dev,
        &GATHER_ROWS_MODULE,
        "gather_rows_b32",
        cfg,
        "gather_rows_b32(const u32* src, u64 rows, u64 row_len, const u32* index, u64 first, u64 count, \
         u32* out)",
        [s, &rows, &rl, i, &first, &cnt, o]
    )
}
