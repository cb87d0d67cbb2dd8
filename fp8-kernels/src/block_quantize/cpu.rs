//! The CPU implementation of the block-scaled casts (rayon over bands of block rows): the reference of
//! the CUDA kernels.

use super::PackedRows1x128;
use super::ScaleStrides;
use crate::cpu_kernel::transpose_copy;
use crate::FloatElement;
use fp8_core::{block_scale, BlockLayout, Fp8Format, ScaleRounding, BLOCK_SIZE};
use rayon::prelude::*;

/// The scale outputs of a cast and where each block's values go (the scales themselves only when asked).
pub(super) struct ScaleOut<'a> {
    pub(super) scale: Option<&'a mut [f32]>,
    pub(super) scale_inv: &'a mut [f32],
    pub(super) strides: ScaleStrides,
}

/// `layout`'s scales read from `stored` (at `strides`) into a row-major vector over the grid.
pub(crate) fn gather_row_major(
    stored: &[f32],
    layout: &BlockLayout,
    strides: &ScaleStrides,
) -> Vec<f32> {
    let [gr, gc] = layout.grid();
    let mut out = Vec::with_capacity(gr * gc);
    for i in 0..gr {
        out.extend((0..gc).map(|j| stored[strides.index(i, j)]));
    }
    out
}

/// Output rows per task of the transpose.
const TRANSPOSE_BAND: usize = 32;

/// `x^T` of row-major `x [rows, cols]`, as `[cols, rows]`.
pub(super) fn transpose<T: FloatElement>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    if x.is_empty() {
        return Vec::new();
    }
    let mut t = vec![x[0]; x.len()];
    transpose_copy(x, rows, cols, TRANSPOSE_BAND, &mut t);
    t
}

/// Casts `x` (row-major, the shape of `layout`) block by block: for each block the amax of its real
/// elements (NaN ignored), its scale by [`block_scale`], `scale_inv = 1 / scale`, and the codes
/// `encode(x * scale)`. One rayon task per band of `block_rows` rows; the scales are computed row-major
/// and then stored at their indices in `out`.
pub(super) fn quantize<T: FloatElement>(
    x: &[T],
    layout: &BlockLayout,
    format: Fp8Format,
    rounding: ScaleRounding,
    codes: &mut [u8],
    mut out: ScaleOut<'_>,
) {
    if layout.numel() == 0 {
        return;
    }
    let mut scale = vec![0.0f32; layout.num_blocks()];
    let mut scale_inv = vec![0.0f32; layout.num_blocks()];
    let cols = layout.cols();
    let [br, bc] = layout.block_shape();
    let gc = layout.grid()[1];
    let fmax = format.max();
    // A band of block rows (fewer when the matrix is shorter: no overflow, rows * cols fits).
    let band = br.min(layout.rows()) * cols;
    codes
        .par_chunks_mut(band)
        .zip(x.par_chunks(band))
        .zip(scale.par_chunks_mut(gc).zip(scale_inv.par_chunks_mut(gc)))
        .for_each(|((q, xs), (s, si))| {
            let h = xs.len() / cols;
            for j in 0..gc {
                let (c0, w) = (j * bc, bc.min(cols - j * bc));
                let mut amax = 0.0f32;
                for r in 0..h {
                    for v in &xs[r * cols + c0..r * cols + c0 + w] {
                        // f32::max ignores NaN.
                        amax = amax.max(v.to_f32().abs());
                    }
                }
                let sc = block_scale(amax, fmax, rounding);
                s[j] = sc;
                si[j] = 1.0 / sc;
                for r in 0..h {
                    let span = r * cols + c0..r * cols + c0 + w;
                    for (o, v) in q[span.clone()].iter_mut().zip(&xs[span]) {
                        *o = format.encode(v.to_f32() * sc);
                    }
                }
            }
        });
    for (b, (&s, &si)) in scale.iter().zip(&scale_inv).enumerate() {
        let at = out.strides.index(b / gc, b % gc);
        if let Some(scale) = out.scale.as_deref_mut() {
            scale[at] = s;
        }
        out.scale_inv[at] = si;
    }
}

/// `out[i] = T(decode(codes[i]) * scale_inv[block of i])`, one rayon task per band of block rows.
pub(super) fn dequantize<T: FloatElement>(
    codes: &[u8],
    layout: &BlockLayout,
    format: Fp8Format,
    scale_inv: &[f32],
    out: &mut [T],
) {
    if layout.numel() == 0 {
        return;
    }
    let cols = layout.cols();
    let [br, bc] = layout.block_shape();
    let gc = layout.grid()[1];
    let table = format.decode_table();
    let band = br.min(layout.rows()) * cols;
    out.par_chunks_mut(band)
        .zip(codes.par_chunks(band))
        .zip(scale_inv.par_chunks(gc))
        .for_each(|((o, q), si)| {
            for (k, (o, &c)) in o.iter_mut().zip(q).enumerate() {
                *o = T::from_f32(table[c as usize] * si[(k % cols) / bc]);
            }
        });
}

/// The 1x128 cast of `x [rows, cols]` into packed row records: as [`quantize`] with the 1x128 layout
/// (the same amax, scale, codes and `scale_inv`), writing each row's codes and inverse scales into its
/// record. One rayon task per tile.
pub(super) fn quantize_packed<T: FloatElement>(
    x: &[T],
    packing: &PackedRows1x128,
    format: Fp8Format,
    rounding: ScaleRounding,
    packed: &mut [u8],
) {
    let (cols, row_bytes) = (packing.cols(), packing.row_bytes());
    if packing.rows() * cols == 0 {
        return;
    }
    let (soff, fmax) = (packing.scales_offset(), format.max());
    packed
        .par_chunks_mut(row_bytes)
        .zip(x.par_chunks(cols))
        .for_each(|(record, xs)| {
            let (codes, scales) = record.split_at_mut(soff);
            codes[..cols]
                .par_chunks_mut(BLOCK_SIZE)
                .zip(xs.par_chunks(BLOCK_SIZE))
                .zip(scales.par_chunks_mut(4))
                .for_each(|((q, xs), si)| {
                    // f32::max ignores NaN.
                    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
                    let sc = block_scale(amax, fmax, rounding);
                    si.copy_from_slice(&(1.0 / sc).to_le_bytes());
                    for (o, v) in q.iter_mut().zip(xs) {
                        *o = format.encode(v.to_f32() * sc);
                    }
                });
        });
}

/// `out[i] = D(f32(out[i]) + alpha * sum_r decode(code_r[i]) * scale_inv_r[i / 128])`, the sum in row
/// order from row 0. One rayon task per 128-element tile of `out`.
pub(super) fn dequantize_sum<D: FloatElement>(
    packed: &[u8],
    packing: &PackedRows1x128,
    format: Fp8Format,
    alpha: f32,
    out: &mut [D],
) {
    let (rows, row_bytes, soff) = (packing.rows(), packing.row_bytes(), packing.scales_offset());
    let table = format.decode_table();
    out.par_chunks_mut(BLOCK_SIZE)
        .enumerate()
        .for_each(|(j, o)| {
            let c0 = j * BLOCK_SIZE;
            let mut sum = [0.0f32; BLOCK_SIZE];
            for r in 0..rows {
                let record = &packed[r * row_bytes..(r + 1) * row_bytes];
                let at = soff + 4 * j;
                let si = f32::from_le_bytes([
                    record[at],
                    record[at + 1],
                    record[at + 2],
                    record[at + 3],
                ]);
                for (s, &c) in sum.iter_mut().zip(&record[c0..c0 + o.len()]) {
                    let d = table[c as usize] * si;
                    // Row 0 starts the sum (0 + d would turn -0 into +0).
                    *s = if r == 0 { d } else { *s + d };
                }
            }
            for (o, s) in o.iter_mut().zip(&sum) {
                *o = D::from_f32(o.to_f32() + alpha * s);
            }
        });
}
