//! Gathering rows of a device-resident table by index: a data loader's batch assembly on the device.
//!
//! A training loop uploads a whole data set once (e.g. normalised images `[len, row_len]` and labels
//! `[len, 1]`) and each epoch's sample order once as a [`RowIndex`]; every batch is then one launch per
//! table ([`gather_rows`]) with no host-to-device copy and no host wait. Indices are validated when the
//! [`RowIndex`] is built, so the kernel never needs to report an error back to the host.
//!
//! Runs where the buffers live: the CPU (`cpu.rs`, rayon, one task per row) or the buffers' GPU on its
//! compute stream, asynchronously (`cuda.rs`, `gather_rows.cu`). Both are plain copies, so they agree bit
//! for bit.

mod cpu;
mod cuda;

use crate::device::cuda_of;
use crate::{check_len, Buffer, Device, Element, KernelError};
use std::ops::Range;

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// A list of row indices into a table of `rows` rows, checked to be in range, held on the host and (for
/// CUDA) on the device as `u32`.
#[derive(Debug)]
pub struct RowIndex {
    host: Vec<u32>,
    rows: usize,
    device: Option<Buffer<u32>>,
}

impl RowIndex {
    /// An index on `device` into a table of `rows` rows. Errors when an index is `>= rows` or `rows`
    /// does not fit in `u32`.
    pub fn new(device: &Device, indices: &[usize], rows: usize) -> Result<Self, KernelError> {
        let mut r = RowIndex {
            host: Vec::new(),
            rows,
            device: None,
        };
        r.set(device, indices)?;
        Ok(r)
    }

    /// Replaces the indices (e.g. a new epoch's order); the device buffer is reused when the length is
    /// unchanged. On error the previous indices are kept.
    pub fn set(&mut self, device: &Device, indices: &[usize]) -> Result<(), KernelError> {
        const WHAT: &str = "RowIndex";
        if u32::try_from(self.rows).is_err() {
            return Err(bad(WHAT, format!("{} rows exceed u32 indices", self.rows)));
        }
        if let Some(i) = indices.iter().position(|&i| i >= self.rows) {
            return Err(bad(
                WHAT,
                format!(
                    "index {} at position {i} is outside a table of {} rows",
                    indices[i], self.rows
                ),
            ));
        }
        // In range, so below rows, which fits in u32 (checked above).
        let host: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        match device {
            Device::Cpu => self.device = None,
            Device::Cuda(_) if host.is_empty() => self.device = None,
            Device::Cuda(_) => match self.device.as_mut() {
                Some(b) if b.len() == host.len() && b.device() == *device => {
                    b.copy_from_host(&host)?
                }
                _ => self.device = Some(device.upload(&host)?),
            },
        }
        self.host = host;
        Ok(())
    }

    /// Number of indices.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether there is no index.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Rows of the table the indices point into.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The indices (host copy).
    pub fn as_slice(&self) -> &[u32] {
        &self.host
    }
}

/// Copies rows `index[range]` of the table `src` (`index.rows()` rows of `row_len` elements, row-major)
/// into `out` (`range.len()` rows): `out[r * row_len + j] = src[index[range.start + r] * row_len + j]`.
///
/// CUDA supports 4-byte elements (f32, i32, u32); the CPU any element. Errors on mismatched lengths, a
/// range outside the index, or buffers on different devices; never reads the device back.
pub fn gather_rows<T: Element>(
    src: &Buffer<T>,
    row_len: usize,
    index: &RowIndex,
    range: Range<usize>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "gather_rows";
    let table_len = index
        .rows
        .checked_mul(row_len)
        .ok_or_else(|| bad(WHAT, format!("{} rows of {row_len} overflow", index.rows)))?;
    check_len(WHAT, table_len, src.len())?;
    if range.start > range.end || range.end > index.len() {
        return Err(bad(
            WHAT,
            format!(
                "rows {}..{} outside an index of {}",
                range.start,
                range.end,
                index.len()
            ),
        ));
    }
    let count = range.end - range.start;
    check_len(WHAT, count * row_len, out.len())?;
    if src.device() != out.device() {
        return Err(KernelError::WrongDevice(WHAT));
    }
    if count == 0 || row_len == 0 {
        return Ok(());
    }
    match cuda_of(src) {
        None => {
            let idx = &index.host[range];
            cpu::gather_rows(src.host(WHAT)?, row_len, idx, out.host_mut(WHAT)?);
            Ok(())
        }
        Some(dev) => cuda::gather_rows(&dev, src, row_len, index, range, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_out_of_range_indices_and_ranges() {
        let dev = Device::cpu();
        assert!(RowIndex::new(&dev, &[0, 3], 3).is_err());
        let idx = RowIndex::new(&dev, &[2, 0], 3).unwrap();
        let src = dev.upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let mut out = dev.zeros::<f32>(4).unwrap();
        assert!(gather_rows(&src, 2, &idx, 1..3, &mut out).is_err());
        assert!(gather_rows(&src, 3, &idx, 0..2, &mut out).is_err());
        gather_rows(&src, 2, &idx, 0..2, &mut out).unwrap();
        assert_eq!(out.to_vec().unwrap(), [5.0, 6.0, 1.0, 2.0]);
    }
}
