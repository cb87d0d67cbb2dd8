//! The CPU implementations of the conv family: generic loops that mirror the CUDA kernels (one task per
//! output row or plane) and faster paths for the common geometries, tested against the generic loops bit
//! for bit (below).

use super::Conv2dGeometry;
use rayon::prelude::*;

/// Below this many elements the batched transpose stays on the calling thread.
const CPU_PAR_THRESHOLD: usize = 1 << 15;

/// im2col on the CPU for any geometry: one task per column row, bounds-checked per element (the
/// reference the fast paths are tested against).
pub(super) fn im2col_generic(xs: &[f32], g: &Conv2dGeometry, cols: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    if pl == 0 {
        return;
    }
    cols.par_chunks_mut(pl).enumerate().for_each(|(row, out)| {
        let (ox, oy, n) = (row % ow, (row / ow) % oh, row / (ow * oh));
        let mut k = 0;
        for c in 0..g.channels {
            let plane = &xs[(n * g.channels + c) * g.height * g.width..][..g.height * g.width];
            for ky in 0..g.kernel_h {
                let yy = (oy * g.stride + ky) as isize - g.padding as isize;
                for kx in 0..g.kernel_w {
                    let xx = (ox * g.stride + kx) as isize - g.padding as isize;
                    out[k] = if yy >= 0
                        && (yy as usize) < g.height
                        && xx >= 0
                        && (xx as usize) < g.width
                    {
                        plane[yy as usize * g.width + xx as usize]
                    } else {
                        0.0
                    };
                    k += 1;
                }
            }
        }
    });
}

/// im2col on the CPU without padding: every window lies inside the image, so each `(c, ky)` part of a
/// column row is a contiguous copy of `kernel_w` input pixels. One task per image.
pub(super) fn im2col_unpadded(xs: &[f32], g: &Conv2dGeometry, cols: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    let (kh, kw, s, w) = (g.kernel_h, g.kernel_w, g.stride, g.width);
    let image_in = g.channels * g.height * g.width;
    let image_cols = oh * ow * pl;
    if image_cols == 0 || image_in == 0 {
        return;
    }
    cols.par_chunks_mut(image_cols)
        .zip(xs.par_chunks(image_in))
        .for_each(|(out, img)| {
            for (p, row) in out.chunks_exact_mut(pl).enumerate() {
                let (oy, ox) = (p / ow, p % ow);
                let mut dst = row.chunks_exact_mut(kw);
                for plane in img.chunks_exact(g.height * w) {
                    for ky in 0..kh {
                        let src = &plane[(oy * s + ky) * w + ox * s..][..kw];
                        if let Some(d) = dst.next() {
                            d.copy_from_slice(src);
                        }
                    }
                }
            }
        });
}

/// col2im on the CPU for any geometry: one task per input plane, each pixel summing its contributions
/// with `ky` then `kx` ascending (the order of the CUDA kernel).
pub(super) fn col2im_generic(cols: &[f32], g: &Conv2dGeometry, dx: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    let plane_len = g.height * g.width;
    if plane_len == 0 {
        return;
    }
    dx.par_chunks_mut(plane_len)
        .enumerate()
        .for_each(|(plane, out)| {
            let (c, n) = (plane % g.channels, plane / g.channels);
            for (i, d) in out.iter_mut().enumerate() {
                let (xx, yy) = (i % g.width, i / g.width);
                let mut s = 0.0f32;
                for ky in 0..g.kernel_h {
                    let ty = yy + g.padding;
                    if ty < ky || (ty - ky) % g.stride != 0 {
                        continue;
                    }
                    let oy = (ty - ky) / g.stride;
                    if oy >= oh {
                        continue;
                    }
                    for kx in 0..g.kernel_w {
                        let tx = xx + g.padding;
                        if tx < kx || (tx - kx) % g.stride != 0 {
                            continue;
                        }
                        let ox = (tx - kx) / g.stride;
                        if ox >= ow {
                            continue;
                        }
                        let row = (n * oh + oy) * ow + ox;
                        let col = (c * g.kernel_h + ky) * g.kernel_w + kx;
                        s += cols[row * pl + col];
                    }
                }
                *d = s;
            }
        });
}

/// col2im on the CPU for stride 1 without padding, one task per image. Pixel `(y, x)` receives
/// `(ky, kx)` from output pixel `(y - ky, x - kx)`, so walking output rows `oy` downwards and, within
/// one, `kx` upwards adds every pixel's contributions in exactly the generic order (`ky` then `kx`
/// ascending) and gives bit-identical sums. Each output row's block of `cols` is first transposed to
/// `[patch_len, out_w]` so that every `(c, ky, kx)` becomes one contiguous, vectorisable span add.
pub(super) fn col2im_stride1_unpadded(cols: &[f32], g: &Conv2dGeometry, dx: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    let (kh, kw, w) = (g.kernel_h, g.kernel_w, g.width);
    let plane_len = g.height * w;
    let image_in = g.channels * plane_len;
    let image_cols = oh * ow * pl;
    if image_cols == 0 || image_in == 0 {
        dx.fill(0.0);
        return;
    }
    dx.par_chunks_mut(image_in)
        .zip(cols.par_chunks(image_cols))
        .for_each_init(
            || vec![0.0f32; pl * ow],
            |block_t, (out, img_cols)| {
                out.fill(0.0);
                for oy in (0..oh).rev() {
                    let block = &img_cols[oy * ow * pl..][..ow * pl];
                    transpose_2d(block, ow, pl, block_t);
                    let mut spans = block_t.chunks_exact(ow);
                    for plane in out.chunks_exact_mut(plane_len) {
                        for ky in 0..kh {
                            let line = &mut plane[(oy + ky) * w..][..w];
                            for kx in 0..kw {
                                if let Some(span) = spans.next() {
                                    for (d, &v) in line[kx..kx + ow].iter_mut().zip(span) {
                                        *d += v;
                                    }
                                }
                            }
                        }
                    }
                }
            },
        );
}

/// `y = x^T` for a row-major `[rows, cols]` matrix `x`, in 8x8 tiles held in registers: each tile is
/// read as eight contiguous row pieces and written as eight contiguous column pieces.
fn transpose_2d<T: Copy>(x: &[T], rows: usize, cols: usize, y: &mut [T]) {
    const B: usize = 8;
    let (rb, cb) = (rows / B * B, cols / B * B);
    if rows == 0 || cols == 0 {
        return;
    }
    for r0 in (0..rb).step_by(B) {
        for c0 in (0..cb).step_by(B) {
            let mut tile = [[x[0]; B]; B];
            for (i, t) in tile.iter_mut().enumerate() {
                t.copy_from_slice(&x[(r0 + i) * cols + c0..][..B]);
            }
            for j in 0..B {
                let dst = &mut y[(c0 + j) * rows + r0..][..B];
                for (d, t) in dst.iter_mut().zip(&tile) {
                    *d = t[j];
                }
            }
        }
        for c in cb..cols {
            for i in 0..B {
                y[c * rows + r0 + i] = x[(r0 + i) * cols + c];
            }
        }
    }
    for r in rb..rows {
        for c in 0..cols {
            y[c * rows + r] = x[r * cols + c];
        }
    }
}

/// Batched transpose on the CPU: one task per batch entry.
pub(super) fn transpose_batched<T: Copy + Send + Sync>(
    xs: &[T],
    [_, rows, cols]: [usize; 3],
    ys: &mut [T],
) {
    let mat = rows * cols;
    if mat == 0 {
        return;
    }
    if xs.len() < CPU_PAR_THRESHOLD {
        xs.chunks_exact(mat)
            .zip(ys.chunks_exact_mut(mat))
            .for_each(|(x, y)| transpose_2d(x, rows, cols, y));
    } else {
        xs.par_chunks_exact(mat)
            .zip(ys.par_chunks_exact_mut(mat))
            .for_each(|(x, y)| transpose_2d(x, rows, cols, y));
    }
}

#[cfg(test)]
mod fast_path_tests {
    //! The CPU fast paths against the generic CPU loops (which mirror the CUDA kernels), bit for bit.
    use super::*;
    use crate::elementwise::dropout_bits;
    use proptest::prelude::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        // Mixed signs and magnitudes so that summation order shows in the low bits.
        (0..len as u64)
            .map(|i| {
                let b = dropout_bits(seed, i);
                (b as f32 / u32::MAX as f32 - 0.5) * (1 << (b % 13)) as f32
            })
            .collect()
    }

    fn geometry(n: usize, c: usize, h: usize, w: usize, k: usize, stride: usize) -> Conv2dGeometry {
        Conv2dGeometry {
            batch: n,
            channels: c,
            height: h,
            width: w,
            kernel_h: k,
            kernel_w: (k % 3) + 1,
            stride,
            padding: 0,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn im2col_unpadded_matches_generic(n in 1usize..4, c in 1usize..4, h in 3usize..12, w in 3usize..12,
                                           k in 1usize..4, stride in 1usize..3, seed in any::<u64>()) {
            let g = geometry(n, c, h, w, k, stride);
            let x = values(g.input_len(), seed);
            let mut fast = vec![f32::NAN; g.patches() * g.patch_len()];
            let mut reference = fast.clone();
            im2col_unpadded(&x, &g, &mut fast);
            im2col_generic(&x, &g, &mut reference);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&fast), bits(&reference));
        }

        #[test]
        fn col2im_stride1_matches_generic_bitwise(n in 1usize..4, c in 1usize..4, h in 3usize..12,
                                                  w in 3usize..12, k in 1usize..4, seed in any::<u64>()) {
            let g = geometry(n, c, h, w, k, 1);
            let d = values(g.patches() * g.patch_len(), seed);
            let mut fast = vec![f32::NAN; g.input_len()];
            let mut reference = fast.clone();
            col2im_stride1_unpadded(&d, &g, &mut fast);
            col2im_generic(&d, &g, &mut reference);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&fast), bits(&reference));
        }

        #[test]
        fn blocked_transpose_matches_definition(b in 1usize..4, r in 1usize..80, c in 1usize..80,
                                                seed in any::<u64>()) {
            let x = values(b * r * c, seed);
            let mut y = vec![f32::NAN; x.len()];
            transpose_batched(&x, [b, r, c], &mut y);
            for bi in 0..b {
                for ri in 0..r {
                    for ci in 0..c {
                        prop_assert_eq!(y[(bi * c + ci) * r + ri].to_bits(), x[(bi * r + ri) * c + ci].to_bits());
                    }
                }
            }
        }
    }
}
