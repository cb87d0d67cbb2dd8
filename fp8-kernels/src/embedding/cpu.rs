//! The CPU implementation of the embedding kernels (rayon over output rows): the reference the CUDA kernels
//! are tested against. Same sums in the same order (see `embedding.cu`), so the two agree bit for bit.

use super::{RowGroups, EMBEDDING_CHUNK};
use crate::FloatElement;
use rayon::prelude::*;

/// `out[p] = O(table[ids[p]] (+ pos[p % seq]))`.
pub(crate) fn forward<T: FloatElement, O: FloatElement>(
    table: &[T],
    pos: Option<(&[T], usize)>,
    ids: &[i32],
    d: usize,
    out: &mut [O],
) {
    out.par_chunks_mut(d)
        .zip(ids.par_iter())
        .enumerate()
        .for_each(|(p, (o, &id))| {
            let t = &table[id as usize * d..(id as usize + 1) * d];
            match pos {
                Some((pt, seq)) => {
                    let pr = &pt[(p % seq) * d..(p % seq + 1) * d];
                    for ((y, a), b) in o.iter_mut().zip(t).zip(pr) {
                        *y = O::from_f32(a.to_f32() + b.to_f32());
                    }
                }
                None => {
                    for (y, a) in o.iter_mut().zip(t) {
                        *y = O::from_f32(a.to_f32());
                    }
                }
            }
        });
}

/// `d_table[id] = D(d_table[id] + total)` for every id of the batch, where `total` is the sum of its
/// chunks' sums (each over at most [`EMBEDDING_CHUNK`] positions in increasing order, from zero), added
/// left to right starting from the first chunk's.
pub(crate) fn backward_table<G: FloatElement, D: FloatElement>(
    dy: &[G],
    groups: &RowGroups,
    d: usize,
    d_table: &mut [D],
) {
    let unique = &groups.unique;
    let offsets = &groups.group_offsets;
    let order = &groups.order;
    d_table
        .par_chunks_mut(d)
        .enumerate()
        .for_each(|(row, out)| {
            let Ok(g) = unique.binary_search(&(row as i32)) else {
                return;
            };
            let positions = &order[offsets[g] as usize..offsets[g + 1] as usize];
            let mut total: Option<Vec<f32>> = None;
            for chunk in positions.chunks(EMBEDDING_CHUNK) {
                let mut s = vec![0.0f32; d];
                for &p in chunk {
                    let r = &dy[p as usize * d..(p as usize + 1) * d];
                    for (a, v) in s.iter_mut().zip(r) {
                        *a += v.to_f32();
                    }
                }
                match total.as_mut() {
                    None => total = Some(s),
                    Some(t) => {
                        for (a, v) in t.iter_mut().zip(&s) {
                            *a += *v;
                        }
                    }
                }
            }
            if let Some(t) = total {
                for (o, v) in out.iter_mut().zip(&t) {
                    *o = D::from_f32(o.to_f32() + v);
                }
            }
        });
}

/// `d_pos[t] = D(d_pos[t] + sum over b in order of dy[b * seq + t])` for `t < seq`.
pub(crate) fn backward_positions<G: FloatElement, D: FloatElement>(
    dy: &[G],
    batch: usize,
    seq: usize,
    d: usize,
    d_pos: &mut [D],
) {
    d_pos[..seq * d]
        .par_chunks_mut(d)
        .enumerate()
        .for_each(|(t, out)| {
            let mut s = vec![0.0f32; d];
            for b in 0..batch {
                let r = &dy[(b * seq + t) * d..(b * seq + t + 1) * d];
                for (a, v) in s.iter_mut().zip(r) {
                    *a += v.to_f32();
                }
            }
            for (o, v) in out.iter_mut().zip(&s) {
                *o = D::from_f32(o.to_f32() + v);
            }
        });
}
