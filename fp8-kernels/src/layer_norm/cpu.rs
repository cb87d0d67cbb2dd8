//! The CPU implementation of LayerNorm / RMSNorm (rayon over rows or column bands): the reference the
//! CUDA kernels are tested against. Every value is computed with the operations, and every sum in the
//! order, of `layer_norm.cu`, so the two agree bit for bit.

use super::{param_order, NormKind, NormSpec, TILE_CHUNKS};
use crate::cpu_kernel::{codes_or_scratch, transpose_copy, xor_butterfly};
use crate::FloatElement;
use fp8_core::Fp8Format;
use rayon::prelude::*;

/// Rows per rayon task (small rows are grouped so a task has some work).
fn rows_per_task(d: usize) -> usize {
    (16_384 / d.max(1)).max(1)
}

/// A row sum in the warp order of the kernels: element `e` goes to lane `(e / 8) % 32`, each lane adds its
/// elements in increasing order from zero, then the lanes are combined by a butterfly (xor 16, 8, 4, 2, 1).
pub(crate) fn warp_vector_sum(d: usize, mut term: impl FnMut(usize) -> f32) -> f32 {
    let mut p = [0.0f32; 32];
    for j in 0..d.div_ceil(8) {
        let lane = &mut p[j % 32];
        for e in 8 * j..(8 * j + 8).min(d) {
            *lane += term(e);
        }
    }
    xor_butterfly(p, |a, b| a + b)
}

/// `(mean, rstd)` of one row (mean 0 for RMSNorm).
pub(crate) fn row_stats<T: FloatElement>(row: &[T], kind: NormKind, eps: f32) -> (f32, f32) {
    let d = row.len();
    let mean = match kind {
        NormKind::LayerNorm => warp_vector_sum(d, |e| row[e].to_f32()) / d as f32,
        NormKind::RmsNorm => 0.0,
    };
    let var = warp_vector_sum(d, |e| {
        let u = row[e].to_f32() - mean;
        u * u
    }) / d as f32;
    (mean, 1.0 / (var + eps).sqrt())
}

/// `(x - mean) * rstd * w (+ b)` in f32.
#[inline]
fn affine(x: f32, w: f32, b: Option<f32>, mean: f32, rstd: f32) -> f32 {
    let y = (x - mean) * rstd * w;
    match b {
        Some(b) => y + b,
        None => y,
    }
}

/// One row's `affine` values from its statistics, each handed to `f` with its output slot.
fn affine_row<T: FloatElement, O>(
    row: &[T],
    w: &[T],
    b: Option<&[T]>,
    mean: f32,
    rstd: f32,
    out: &mut [O],
    f: impl Fn(&mut O, f32),
) {
    for (e, slot) in out.iter_mut().enumerate() {
        f(
            slot,
            affine(
                row[e].to_f32(),
                w[e].to_f32(),
                b.map(|b| b[e].to_f32()),
                mean,
                rstd,
            ),
        );
    }
}

/// Normalises every row of `x` into `f(row index, element index, value)` (value rounded to `T`) and
/// writes the statistics.
#[allow(clippy::too_many_arguments)]
fn for_each_row<T: FloatElement, O: Send>(
    spec: &NormSpec,
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    mean: &mut [f32],
    rstd: &mut [f32],
    out: &mut [O],
    f: impl Fn(&mut O, f32) + Sync,
) {
    let d = spec.d;
    let per = rows_per_task(d);
    out.par_chunks_mut(per * d)
        .zip(mean.par_chunks_mut(per))
        .zip(rstd.par_chunks_mut(per))
        .enumerate()
        .for_each(|(t, ((o, m), s))| {
            for (i, ((orow, mo), so)) in o.chunks_mut(d).zip(m).zip(s).enumerate() {
                let r = t * per + i;
                let row = &x[r * d..(r + 1) * d];
                let (mu, rs) = row_stats(row, spec.kind, spec.eps);
                *mo = mu;
                *so = rs;
                affine_row(row, w, b, mu, rs, orow, &f);
            }
        });
}

/// The forward's output from given row statistics (`[rows]` each) of `x [rows, d]`: [`forward`]'s values
/// when they are its statistics.
pub(crate) fn forward_with_stats<T: FloatElement>(
    d: usize,
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    mean: &[f32],
    rstd: &[f32],
    y: &mut [T],
) {
    y.par_chunks_mut(d.max(1))
        .zip(x.par_chunks(d.max(1)))
        .zip(mean.par_iter().zip(rstd))
        .for_each(|((yr, xr), (&mu, &rs))| {
            affine_row(xr, w, b, mu, rs, yr, |o, v| *o = T::from_f32(v));
        });
}

/// The row statistics alone (those [`forward`] writes).
pub(crate) fn statistics<T: FloatElement>(
    spec: &NormSpec,
    x: &[T],
    mean: &mut [f32],
    rstd: &mut [f32],
) {
    let d = spec.d;
    mean.par_iter_mut()
        .zip(rstd.par_iter_mut())
        .enumerate()
        .for_each(|(r, (mo, so))| {
            (*mo, *so) = row_stats(&x[r * d..(r + 1) * d], spec.kind, spec.eps);
        });
}

/// Forward into `y` (rounded to `T`).
pub(crate) fn forward<T: FloatElement>(
    spec: &NormSpec,
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    mean: &mut [f32],
    rstd: &mut [f32],
    y: &mut [T],
) {
    for_each_row(spec, x, w, b, mean, rstd, y, |o, v| *o = T::from_f32(v));
}

/// Forward fused with the FP8 cast: `q` row-major codes of `h = T(y)`, `qt` their transpose; returns the
/// amax of `h` (NaN never raises it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_fp8<T: FloatElement>(
    spec: &NormSpec,
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    mean: &mut [f32],
    rstd: &mut [f32],
    format: Fp8Format,
    scale: f32,
    q: Option<&mut [u8]>,
    qt: Option<&mut [u8]>,
) -> f32 {
    let n = spec.rows * spec.d;
    let mut h = vec![0.0f32; n];
    for_each_row(spec, x, w, b, mean, rstd, &mut h, |o, v| {
        *o = T::from_f32(v).to_f32()
    });
    let amax = h
        .par_chunks(1 << 14)
        .map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.abs())))
        .reduce(|| 0.0, f32::max);
    let mut scratch = Vec::new();
    let q = codes_or_scratch(q, n, &mut scratch);
    q.par_chunks_mut(1 << 14)
        .zip(h.par_chunks(1 << 14))
        .for_each(|(o, v)| {
            for (c, &hv) in o.iter_mut().zip(v) {
                *c = format.encode(hv * scale);
            }
        });
    if let Some(qt) = qt {
        transpose_copy(q, spec.rows, spec.d, 32, qt);
    }
    amax
}

/// `xhat = (x - mean) * rstd`, or `x * rstd` for RMSNorm (whose mean is not read).
#[inline]
fn xhat(kind: NormKind, x: f32, mean: f32, rstd: f32) -> f32 {
    match kind {
        NormKind::LayerNorm => (x - mean) * rstd,
        NormKind::RmsNorm => x * rstd,
    }
}

/// Backward, dx: `dx = (g - c2 - xhat * c1) * rstd` (optionally added to `dx`), with `g = dy * w`,
/// `c1 = sum(g xhat) / d`, `c2 = sum(g) / d` (0 for RMSNorm, and not subtracted: `g - 0` is `g`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dx<T: FloatElement, G: FloatElement>(
    spec: &NormSpec,
    x: &[T],
    w: &[T],
    mean: &[f32],
    rstd: &[f32],
    dy: &[G],
    dx: &mut [G],
    accumulate: bool,
) {
    let d = spec.d;
    let per = rows_per_task(d);
    dx.par_chunks_mut(per * d).enumerate().for_each(|(t, o)| {
        for (i, drow) in o.chunks_mut(d).enumerate() {
            let r = t * per + i;
            let (xr, gr) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d]);
            let (mu, rs) = (mean[r], rstd[r]);
            let g = |e: usize| gr[e].to_f32() * w[e].to_f32();
            let xh = |e: usize| xhat(spec.kind, xr[e].to_f32(), mu, rs);
            let c1 = warp_vector_sum(d, |e| g(e) * xh(e)) / d as f32;
            let c2 = match spec.kind {
                NormKind::LayerNorm => Some(warp_vector_sum(d, g) / d as f32),
                NormKind::RmsNorm => None,
            };
            for (e, o) in drow.iter_mut().enumerate() {
                let centred = c2.map_or(g(e), |c2| g(e) - c2);
                let v = (centred - xh(e) * c1) * rs;
                *o = G::from_f32(if accumulate { o.to_f32() + v } else { v });
            }
        }
    });
}

/// Backward, parameters: `dw[c] = sum_r dy xhat`, `db[c] = sum_r dy` in the four levels of
/// [`param_order`]`(rows)` (chunks of rows from zero, chunk sums per tile from the tile's first, tile sums
/// per run from the run's first, run sums from the first); the totals overwrite or are added to `dw` /
/// `db`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_params<T: FloatElement, G: FloatElement>(
    spec: &NormSpec,
    x: &[T],
    mean: &[f32],
    rstd: &[f32],
    dy: &[G],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    accumulate: bool,
) {
    let (rows, d) = (spec.rows, spec.d);
    let order = param_order(rows);
    const BAND: usize = 64;
    // Sums of one chunk (rows in order from zero) over a band of columns.
    let chunk_sums = |k: usize, c0: usize, width: usize, pw: &mut [f32], pb: &mut [f32]| {
        pw.fill(0.0);
        pb.fill(0.0);
        for r in k * order.chunk_rows..((k + 1) * order.chunk_rows).min(rows) {
            let (mu, rs) = (mean[r], rstd[r]);
            for i in 0..width {
                let at = r * d + c0 + i;
                let g = dy[at].to_f32();
                pw[i] += g * xhat(spec.kind, x[at].to_f32(), mu, rs);
                pb[i] += g;
            }
        }
    };
    // `acc = first ? v : acc + v`, elementwise.
    let fold = |acc: &mut [f32], v: &[f32], first: bool| {
        for (a, &b) in acc.iter_mut().zip(v) {
            *a = if first { b } else { *a + b };
        }
    };
    let band_sums = |c0: usize, width: usize| -> (Vec<f32>, Vec<f32>) {
        let zeros = || vec![0.0f32; width];
        let (mut total_w, mut total_b) = (zeros(), zeros());
        let (mut run_w, mut run_b) = (zeros(), zeros());
        let (mut tile_w, mut tile_b) = (zeros(), zeros());
        let (mut chunk_w, mut chunk_b) = (zeros(), zeros());
        for ri in 0..order.runs {
            let (t0, t1) = (ri * order.run, ((ri + 1) * order.run).min(order.tiles));
            for t in t0..t1 {
                let (k0, k1) = (t * TILE_CHUNKS, ((t + 1) * TILE_CHUNKS).min(order.chunks));
                for k in k0..k1 {
                    chunk_sums(k, c0, width, &mut chunk_w, &mut chunk_b);
                    fold(&mut tile_w, &chunk_w, k == k0);
                    fold(&mut tile_b, &chunk_b, k == k0);
                }
                fold(&mut run_w, &tile_w, t == t0);
                fold(&mut run_b, &tile_b, t == t0);
            }
            fold(&mut total_w, &run_w, ri == 0);
            fold(&mut total_b, &run_b, ri == 0);
        }
        (total_w, total_b)
    };
    let bands: Vec<(Vec<f32>, Vec<f32>)> = (0..d.div_ceil(BAND))
        .into_par_iter()
        .map(|bi| band_sums(bi * BAND, BAND.min(d - bi * BAND)))
        .collect();
    let apply = |out: &mut [f32], second: bool| {
        for (bi, (w, b)) in bands.iter().enumerate() {
            for (i, &v) in (if second { b } else { w }).iter().enumerate() {
                let o = &mut out[bi * BAND + i];
                *o = if accumulate { *o + v } else { v };
            }
        }
    };
    apply(dw, false);
    if let Some(db) = db {
        apply(db, true);
    }
}
