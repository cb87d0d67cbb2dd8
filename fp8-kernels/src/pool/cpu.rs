//! The CPU implementation of max pooling, the reference of the CUDA kernels (one task per plane).

use super::Pool2dGeometry;
use rayon::prelude::*;

/// Window maxima and their flat input indices (first maximum in row-major window order; NaN wins).
pub(super) fn max_pool2d_forward(
    xs: &[f32],
    g: &Pool2dGeometry,
    y: &mut [f32],
    indices: &mut [u32],
) {
    let (oh, ow) = (g.out_h(), g.out_w());
    let plane_out = oh * ow;
    if plane_out == 0 {
        return;
    }
    y.par_chunks_mut(plane_out)
        .zip(indices.par_chunks_mut(plane_out))
        .enumerate()
        .for_each(|(plane, (yo, io))| {
            let base = plane * g.height * g.width;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut bi = base + oy * g.stride * g.width + ox * g.stride;
                    let mut best = xs[bi];
                    for ky in 0..g.kernel {
                        let row = base + (oy * g.stride + ky) * g.width + ox * g.stride;
                        for kx in 0..g.kernel {
                            let v = xs[row + kx];
                            if v > best || (v.is_nan() && !best.is_nan()) {
                                best = v;
                                bi = row + kx;
                            }
                        }
                    }
                    yo[oy * ow + ox] = best;
                    io[oy * ow + ox] = bi as u32;
                }
            }
        });
}

/// `dx = 0`, then `dx[indices[i]] += dy[i]` (indices checked by the caller).
pub(super) fn max_pool2d_backward(dy: &[f32], indices: &[u32], dx: &mut [f32]) {
    dx.fill(0.0);
    for (&g, &i) in dy.iter().zip(indices) {
        dx[i as usize] += g;
    }
}
