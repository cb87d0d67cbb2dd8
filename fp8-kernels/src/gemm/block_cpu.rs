//! The CPU block-scaled FP8 GEMM, the reference of the CUDA one: per 128-wide K block, the f32 GEMM of the
//! decoded codes (the `gemm` crate), scaled by both operands' inverse scales and added to an f32
//! accumulator; then `alpha * acc + beta * C`, rounded once to the output type.

use super::block::BlockOperand;
use super::cpu::gemm_f32_host;
use super::{CpuParallelism, GemmOutput, GemmSpec, Transpose};
use crate::block_quantize::ScaleStrides;
use crate::cpu_kernel::transpose_copy;
use crate::KernelError;
use fp8_core::{BlockLayout, BLOCK_SIZE};
use rayon::prelude::*;

const WHAT: &str = "gemm_fp8_block";

/// Output rows per rayon task of the transposes.
const TRANSPOSE_BAND: usize = 32;

/// One operand as the reduction reads it: `[outer, k]` decoded codes (unscaled) and each row's inverse
/// scale per K block, `[outer, ceil(k / 128)]`.
struct KMajor {
    decoded: Vec<f32>,
    scale_inv: Vec<f32>,
}

/// Decodes `op` (stored `[outer, k]`, or `[k, outer]` when transposed) K-major.
fn k_major(op: &BlockOperand<'_>, outer: usize, k: usize) -> Result<KMajor, KernelError> {
    let x = &op.matrix;
    let (codes, si) = (x.data.host(WHAT)?, x.scale_inv.host(WHAT)?);
    let table = x.format.decode_table();
    let mut decoded: Vec<f32> = codes.iter().map(|&c| table[c as usize]).collect();
    if op.transposed {
        let mut t = vec![0.0f32; decoded.len()];
        transpose_copy(&decoded, k, outer, TRANSPOSE_BAND, &mut t);
        decoded = t;
    }
    let kb = k.div_ceil(BLOCK_SIZE);
    let [br, bc] = x.layout.block_shape();
    let st = op.strides;
    let mut scale_inv = Vec::with_capacity(outer * kb);
    for r in 0..outer {
        scale_inv.extend((0..kb).map(|j| {
            // The stored layout's block of element (r, j * 128) seen K-major.
            let at = if op.transposed {
                st.index(j * BLOCK_SIZE / br, r / bc)
            } else {
                st.index(r / br, j * BLOCK_SIZE / bc)
            };
            si[at]
        }));
    }
    Ok(KMajor { decoded, scale_inv })
}

/// Columns `k0 .. k0 + w` of row-major `x [rows, k]`, as a contiguous `[rows, w]`.
fn columns(x: &[f32], rows: usize, k: usize, k0: usize, w: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * w);
    for r in 0..rows {
        out.extend_from_slice(&x[r * k + k0..r * k + k0 + w]);
    }
    out
}

/// `c = alpha * sum_kb (A_kb B_kb^T) * sa * sb + beta * c` (see the module docs of `block.rs`).
pub(super) fn gemm<O: GemmOutput>(
    spec: &GemmSpec,
    a: &BlockOperand<'_>,
    b: &BlockOperand<'_>,
    c: &mut [O],
) -> Result<(), KernelError> {
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (ak, bk) = (k_major(a, m, k)?, k_major(b, n, k)?);
    let kb = k.div_ceil(BLOCK_SIZE);
    let mut acc = vec![0.0f32; m * n];
    let mut part = vec![0.0f32; m * n];
    let parallel = !matches!(spec.parallelism, CpuParallelism::Single);
    for j in 0..kb {
        let k0 = j * BLOCK_SIZE;
        let w = BLOCK_SIZE.min(k - k0);
        let (ab, bb) = (
            columns(&ak.decoded, m, k, k0, w),
            columns(&bk.decoded, n, k, k0, w),
        );
        let block = GemmSpec::new(m, n, w)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(spec.parallelism);
        gemm_f32_host(&block, &ab, &bb, &mut part)?;
        let (sa, sb) = (&ak.scale_inv, &bk.scale_inv);
        let add = |(i, (acc_row, part_row)): (usize, (&mut [f32], &[f32]))| {
            let sai = sa[i * kb + j];
            for (l, (o, &p)) in acc_row.iter_mut().zip(part_row).enumerate() {
                *o += p * sai * sb[l * kb + j];
            }
        };
        if parallel {
            acc.par_chunks_mut(n)
                .zip(part.par_chunks(n))
                .enumerate()
                .for_each(add);
        } else {
            acc.chunks_mut(n)
                .zip(part.chunks(n))
                .enumerate()
                .for_each(add);
        }
    }
    let (alpha, beta) = (spec.alpha, spec.beta);
    let write = |(o, &v): (&mut O, &f32)| {
        let mut y = alpha * v;
        if beta != 0.0 {
            y += beta * o.to_f32();
        }
        *o = O::from_f32(y);
    };
    if parallel {
        c.par_iter_mut().zip(acc.par_iter()).for_each(write);
    } else {
        c.iter_mut().zip(acc.iter()).for_each(write);
    }
    Ok(())
}

/// Codes transposed, and block `(j, i)` of the transpose at `dst_strides` = block `(i, j)` of `layout`.
pub(super) fn transpose(
    codes: &[u8],
    layout: &BlockLayout,
    scale_inv: &[f32],
    src_strides: &ScaleStrides,
    dst_codes: &mut [u8],
    dst_scale_inv: &mut [f32],
    dst_strides: &ScaleStrides,
) {
    transpose_copy(
        codes,
        layout.rows(),
        layout.cols(),
        TRANSPOSE_BAND,
        dst_codes,
    );
    let [gr, gc] = layout.grid();
    for i in 0..gr {
        for j in 0..gc {
            dst_scale_inv[dst_strides.index(j, i)] = scale_inv[src_strides.index(i, j)];
        }
    }
}
