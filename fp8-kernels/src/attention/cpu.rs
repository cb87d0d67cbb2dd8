//! The CPU reference: plain causal attention in F32, on F32 slices in the layouts of [`super`]
//! (`qkv [B, T, (H + 2*KV) * hd]`, `out [B, T, H, hd]`, `lse [B, H, T]`; query head `h` reads key/value
//! head `h / (H / KV)`).
//!
//! Each row's softmax is computed from scratch (max, exponentials, sum); the backward recomputes it and
//! forms the exact gradient (`D = sum_k p_k dp_k`, not the rounded output), so these functions are the
//! mathematical reference the CUDA kernels are measured against, not a model of their rounding. Work is
//! split over `(batch, head)` pairs with rayon; within a pair everything runs in a fixed order, so the
//! results do not depend on the thread count.

use super::AttentionShape;
use rayon::prelude::*;

/// Dot product in a fixed (sequential) order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |s, (x, y)| s + x * y)
}

/// Column offsets in a `qkv` row of query head `h`'s q and of the k and v it reads.
fn head_columns(shape: &AttentionShape, h: usize) -> [usize; 3] {
    let (hd, heads, kv) = (shape.head_dim, shape.heads, shape.kv_heads);
    let j = h / shape.group();
    [h * hd, (heads + j) * hd, (heads + kv + j) * hd]
}

/// `(q, k, v)` of one `(b, h)` pair (the k and v of `h`'s key/value head) as `[T][hd]` row-major copies.
fn head_slices(shape: &AttentionShape, qkv: &[f32], b: usize, h: usize) -> [Vec<f32>; 3] {
    let (t_len, hd) = (shape.seq_len, shape.head_dim);
    let row = shape.qkv_width();
    let cols = head_columns(shape, h);
    let mut out = [
        Vec::with_capacity(t_len * hd),
        Vec::with_capacity(t_len * hd),
        Vec::with_capacity(t_len * hd),
    ];
    for t in 0..t_len {
        let base = (b * t_len + t) * row;
        for (o, &c) in out.iter_mut().zip(&cols) {
            o.extend_from_slice(&qkv[base + c..base + c + hd]);
        }
    }
    out
}

/// The softmax row of query `t` over keys `0..=t`: probabilities (normalised) and the log-sum-exp of the
/// scaled scores.
fn softmax_row(q_t: &[f32], k: &[f32], hd: usize, t: usize, scale: f32, p: &mut Vec<f32>) -> f32 {
    p.clear();
    p.extend((0..=t).map(|j| dot(q_t, &k[j * hd..(j + 1) * hd]) * scale));
    let m = p.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut l = 0.0f32;
    for x in p.iter_mut() {
        *x = (*x - m).exp();
        l += *x;
    }
    let inv = 1.0 / l;
    for x in p.iter_mut() {
        *x *= inv;
    }
    m + l.ln()
}

/// Forward: `out[b, t, h, :] = sum_{k <= t} softmax_k(scale * q_t . k_k) v_k` and `lse[b, h, t]` (natural
/// log). Lengths must match `shape` (the public API checks them).
pub fn forward(shape: &AttentionShape, scale: f32, qkv: &[f32], out: &mut [f32], lse: &mut [f32]) {
    let (t_len, hd, heads) = (shape.seq_len, shape.head_dim, shape.heads);
    if shape.is_empty() {
        return;
    }
    let per_head: Vec<Vec<f32>> = lse
        .par_chunks_mut(t_len)
        .enumerate()
        .map(|(bh, lse_row)| {
            let (b, h) = (bh / heads, bh % heads);
            let [q, k, v] = head_slices(shape, qkv, b, h);
            let mut o = vec![0.0f32; t_len * hd];
            let mut p = Vec::with_capacity(t_len);
            for t in 0..t_len {
                lse_row[t] = softmax_row(&q[t * hd..(t + 1) * hd], &k, hd, t, scale, &mut p);
                let o_t = &mut o[t * hd..(t + 1) * hd];
                for (j, &pj) in p.iter().enumerate() {
                    for (od, &vd) in o_t.iter_mut().zip(&v[j * hd..(j + 1) * hd]) {
                        *od += pj * vd;
                    }
                }
            }
            o
        })
        .collect();
    for (bh, o) in per_head.iter().enumerate() {
        let (b, h) = (bh / heads, bh % heads);
        for t in 0..t_len {
            let at = ((b * t_len + t) * heads + h) * hd;
            out[at..at + hd].copy_from_slice(&o[t * hd..(t + 1) * hd]);
        }
    }
}

/// Backward of [`forward`] for the output gradient `d_out [B, T, H, hd]`: writes `d_qkv` in the layout
/// of `qkv` (dq, dk, dv in the slots of q, k, v). dK and dV of a key/value head are the sums of its
/// group's query heads' contributions, added in increasing query-head order (the first one copied, so
/// `KV = H` stores each head's own result).
pub fn backward(shape: &AttentionShape, scale: f32, qkv: &[f32], d_out: &[f32], d_qkv: &mut [f32]) {
    let (t_len, hd, heads) = (shape.seq_len, shape.head_dim, shape.heads);
    if shape.is_empty() {
        return;
    }
    let per_head: Vec<[Vec<f32>; 3]> = (0..shape.batch * heads)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / heads, bh % heads);
            let [q, k, v] = head_slices(shape, qkv, b, h);
            let mut dq = vec![0.0f32; t_len * hd];
            let mut dk = vec![0.0f32; t_len * hd];
            let mut dv = vec![0.0f32; t_len * hd];
            let mut p = Vec::with_capacity(t_len);
            let mut ds = Vec::with_capacity(t_len);
            for t in 0..t_len {
                let q_t = &q[t * hd..(t + 1) * hd];
                let at = ((b * t_len + t) * heads + h) * hd;
                let do_t = &d_out[at..at + hd];
                softmax_row(q_t, &k, hd, t, scale, &mut p);
                // dp_j = dO_t . v_j;  D = sum_j p_j dp_j;  ds_j = p_j (dp_j - D)
                ds.clear();
                ds.extend((0..=t).map(|j| dot(do_t, &v[j * hd..(j + 1) * hd])));
                let d = p.iter().zip(&ds).fold(0.0f32, |s, (a, b)| s + a * b);
                for (dsj, &pj) in ds.iter_mut().zip(&p) {
                    *dsj = pj * (*dsj - d);
                }
                let dq_t = &mut dq[t * hd..(t + 1) * hd];
                for j in 0..=t {
                    let (pj, dsj) = (p[j], ds[j]);
                    let kj = &k[j * hd..(j + 1) * hd];
                    for (x, &kd) in dq_t.iter_mut().zip(kj) {
                        *x += dsj * kd;
                    }
                    for (x, &qd) in dk[j * hd..(j + 1) * hd].iter_mut().zip(q_t) {
                        *x += dsj * qd;
                    }
                    for (x, &od) in dv[j * hd..(j + 1) * hd].iter_mut().zip(do_t) {
                        *x += pj * od;
                    }
                }
            }
            for x in dq.iter_mut().chain(dk.iter_mut()) {
                *x *= scale;
            }
            [dq, dk, dv]
        })
        .collect();
    let row = shape.qkv_width();
    let group = shape.group();
    for (bh, grads) in per_head.iter().enumerate() {
        let (b, h) = (bh / heads, bh % heads);
        let first_of_group = h % group == 0;
        for t in 0..t_len {
            let base = (b * t_len + t) * row;
            for (which, (g, &c)) in grads.iter().zip(&head_columns(shape, h)).enumerate() {
                let dst = &mut d_qkv[base + c..base + c + hd];
                let src = &g[t * hd..(t + 1) * hd];
                if which == 0 || first_of_group {
                    dst.copy_from_slice(src);
                } else {
                    for (d, &x) in dst.iter_mut().zip(src) {
                        *d += x;
                    }
                }
            }
        }
    }
}
