//! The CPU gather: one rayon task per output row.

use crate::Element;
use rayon::prelude::*;

/// `out[r] = src[index[r]]` for rows of `row_len` elements (indices checked by the caller).
pub(super) fn gather_rows<T: Element>(src: &[T], row_len: usize, index: &[u32], out: &mut [T]) {
    out.par_chunks_mut(row_len)
        .zip(index.par_iter())
        .for_each(|(row, &i)| {
            let at = i as usize * row_len;
            row.copy_from_slice(&src[at..at + row_len]);
        });
}
