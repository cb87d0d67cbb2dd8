//! Building blocks of the CPU kernels: how element-wise work is split over rayon, the band-wise split of
//! transposes, and the order of a warp's `__shfl_xor_sync` butterfly (which the CPU references follow so
//! their sums match the CUDA kernels bit for bit).

use rayon::prelude::*;

/// The row-major codes a CPU cast writes: the caller's, or `n` codes of `scratch` when it wants only the
/// transpose (which the CPU kernels copy from the row-major codes).
pub(crate) fn codes_or_scratch<'a>(
    codes: Option<&'a mut [u8]>,
    n: usize,
    scratch: &'a mut Vec<u8>,
) -> &'a mut [u8] {
    match codes {
        Some(c) => c,
        None => {
            scratch.resize(n, 0);
            &mut scratch[..]
        }
    }
}

/// `f` over aligned chunks of `chunk` elements of `a` and `b`, in parallel when `a` holds at least
/// `threshold` elements (on the calling thread, in one piece, below that).
pub(crate) fn zip_chunks<A: Sync, B: Send>(
    a: &[A],
    b: &mut [B],
    chunk: usize,
    threshold: usize,
    f: impl Fn(&[A], &mut [B]) + Sync + Send,
) {
    if a.len() < threshold {
        f(a, b);
    } else {
        a.par_chunks(chunk)
            .zip(b.par_chunks_mut(chunk))
            .for_each(|(x, y)| f(x, y));
    }
}

/// `f(c0, cw, out)` for each band of `band` rows of the transpose `dst [cols, rows]` (one rayon task a
/// band): `out` is the band, its rows are the source columns `c0 .. c0 + cw`. Nothing when `rows` or
/// `dst` is empty.
pub(crate) fn transpose_bands<D: Send>(
    dst: &mut [D],
    rows: usize,
    band: usize,
    f: impl Fn(usize, usize, &mut [D]) + Sync + Send,
) {
    if rows == 0 || dst.is_empty() {
        return;
    }
    dst.par_chunks_mut(band * rows)
        .enumerate()
        .for_each(|(b, out)| f(b * band, out.len() / rows, out));
}

/// `dst [cols, rows] = src^T` for row-major `src [rows, cols]`, in bands of `band` output rows.
pub(crate) fn transpose_copy<D: Copy + Send + Sync>(
    src: &[D],
    rows: usize,
    cols: usize,
    band: usize,
    dst: &mut [D],
) {
    transpose_bands(dst, rows, band, |c0, cw, out| {
        for r in 0..rows {
            for (dc, &v) in src[r * cols + c0..r * cols + c0 + cw].iter().enumerate() {
                out[dc * rows + r] = v;
            }
        }
    });
}

/// Elements per rayon task of [`cast_values`].
const CAST_CHUNK: usize = 1 << 14;

/// `out[i] = format.encode(h * scale)` with `h = value(i)` for every `i` of `out`, in parallel chunks;
/// returns the amax of the values (NaN never raises it, as in the cast family). The fused casts (GELU,
/// SwiGLU) give `value` the element they cast, already rounded as the unfused kernel stores it.
pub(crate) fn cast_values(
    out: &mut [u8],
    format: fp8_core::Fp8Format,
    scale: f32,
    value: impl Fn(usize) -> f32 + Sync,
) -> f32 {
    let run = |i0: usize, d: &mut [u8]| {
        let mut a = 0.0f32;
        for (k, o) in d.iter_mut().enumerate() {
            let h = value(i0 + k);
            a = a.max(h.abs());
            *o = format.encode(h * scale);
        }
        a
    };
    if out.len() < CAST_CHUNK {
        run(0, out)
    } else {
        out.par_chunks_mut(CAST_CHUNK)
            .enumerate()
            .map(|(c, d)| run(c * CAST_CHUNK, d))
            .reduce(|| 0.0, f32::max)
    }
}

/// The `__shfl_xor_sync` butterfly of `op` over 32 lanes: lane `l` takes `op(lane l, lane l ^ off)` for
/// off = 16, 8, 4, 2, 1; every lane ends with lane 0's value.
pub(crate) fn xor_butterfly<V: Copy>(mut p: [V; 32], op: impl Fn(V, V) -> V) -> V {
    let mut off = 16;
    while off > 0 {
        let prev = p;
        for (l, v) in p.iter_mut().enumerate() {
            *v = op(prev[l], prev[l ^ off]);
        }
        off >>= 1;
    }
    p[0]
}
