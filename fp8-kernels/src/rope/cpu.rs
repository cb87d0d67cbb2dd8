//! The CPU implementation of RoPE (rayon over tokens): the operations of `rope.cu` in the same order.

use super::{Direction, RopeShape};
use crate::FloatElement;
use rayon::prelude::*;

/// One rotated pair: `(x1*c - x2*s, x2*c + x1*s)`, each product and sum rounded once in f32.
#[inline]
fn rotate_pair(x1: f32, x2: f32, c: f32, s: f32) -> (f32, f32) {
    (x1 * c - x2 * s, x2 * c + x1 * s)
}

/// `out` = `x` with Q and K heads rotated (by `sin` negated for the backward), V copied.
pub(super) fn rotate<T: FloatElement>(
    x: &[T],
    out: &mut [T],
    cos: &[f32],
    sin: &[f32],
    shape: RopeShape,
    head_dim: usize,
    direction: Direction,
) {
    let width = shape.token_width(head_dim);
    let rotated = (shape.heads + shape.kv_heads) * head_dim;
    let half = head_dim / 2;
    if width == 0 || shape.seq == 0 {
        return;
    }
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .enumerate()
        .for_each(|(token, (o, xs))| {
            let pos = shape.start_pos + token % shape.seq;
            let (c, s) = (
                &cos[pos * half..(pos + 1) * half],
                &sin[pos * half..(pos + 1) * half],
            );
            for (oh, xh) in o[..rotated]
                .chunks_exact_mut(head_dim)
                .zip(xs[..rotated].chunks_exact(head_dim))
            {
                for i in 0..half {
                    let sv = match direction {
                        Direction::Forward => s[i],
                        Direction::Backward => -s[i],
                    };
                    let (a, b) = rotate_pair(xh[i].to_f32(), xh[i + half].to_f32(), c[i], sv);
                    oh[i] = T::from_f32(a);
                    oh[i + half] = T::from_f32(b);
                }
            }
            o[rotated..].copy_from_slice(&xs[rotated..]);
        });
}
