//! Block-scaled FP8 GEMMs (DeepSeek-V3's recipe): operands carrying one f32 inverse scale per 1x128 tile
//! or 128x128 block, as [`crate::block_quantize`] writes them, multiplied with f32 accumulation:
//!
//! ```text
//! C[i, j] = alpha * sum over K blocks kb of ( sum_{k in kb} decode(A[i, k]) decode(B[j, k]) )
//!                                            * scale_inv_A(i, kb) * scale_inv_B(j, kb)  +  beta * C[i, j]
//! ```
//!
//! (row-major `A [m, k]`, `B [n, k]` as [`GemmSpec`] with `trans_a = No`, `trans_b = Yes`). Each 128-wide
//! K block's partial sum is taken in f32 and scaled once; partial blocks at the end of K (k not a
//! multiple of 128) hold only the real elements. On CUDA this is cuBLASLt's `VEC128_32F` (1x128 tiles)
//! and `BLK128x128_32F` (128x128 blocks) scale modes on sm_90 (CUDA 12.9 and newer); the CPU
//! (`block_cpu.rs`) computes the same sum block by block, so with power-of-two scales CPU and GPU
//! multiply the same exact products and differ only in accumulation order.
//!
//! # Operands and their rules (both devices refuse the same calls)
//! - Blocks, seen K-major (each operand's reduction dimension last): 1x128 tiles along K or 128x128
//!   blocks, in any pairing but 128x128 x 128x128 (cuBLASLt has no kernel for it). Per-tensor operands
//!   go to [`super::gemm_fp8`].
//! - A transposed operand (`trans_a = Yes`: A stored `[k, m]`; `trans_b = No`: B stored `[k, n]`) is
//!   accepted when its blocks, read transposed, are such blocks: 128x128 blocks (the weight of the
//!   data-gradient GEMM, `dx = dy W`) or 128x1 tiles. Its codes and scales are transposed into temporaries
//!   on CUDA (exact, no requantization); [`transpose_block_fp8`] makes the transposed copy once for
//!   callers that reuse it. 1x128 tiles of a transposed operand run along the wrong dimension and are
//!   refused: quantize such an operand K-major (`BlockQuantLayout::Columns128x1Transposed` writes the
//!   weight-gradient GEMM's operands so).
//! - m, n and k multiples of [`FP8_DIM_MULTIPLE`] (16; zero is allowed and computes nothing, or
//!   `beta * C` when k is 0). Shapes need not be multiples of 128: the last blocks are partial. cuBLASLt
//!   would take some sides that are multiples of 8 only; this crate keeps the one FP8 rule of 16.
//! - No `fp8_fast_accum` (cuBLASLt has no fast accumulation with block scales).
//! - Scales in either [`ScaleOrder`]; on CUDA row-major scales are copied into the GEMM's order first
//!   (one small kernel), so casts meant for this GEMM should write [`ScaleOrder::Gemm`].
//! - E5M2 x E5M2 (no cuBLASLt kernel) runs on CUDA as a BF16 GEMM of the dequantized operands, as
//!   [`super::gemm_fp8`] does.
//!
//! # The linear layer's three products (`y = x W^T`, `x [t, in]`, `W [out, in]`, `dy [t, out]`)
//! | product | A | B | spec (m, n, k) |
//! | --- | --- | --- | --- |
//! | forward `y = x W^T` | `x`, 1x128 | `W`, 128x128, `trans_b = Yes` | `(t, out, in)` |
//! | data gradient `dx = dy W` | `dy`, 1x128 | `W`, 128x128, `trans_b = No` (or `W^T` from [`transpose_block_fp8`], `Yes`) | `(t, in, out)` |
//! | weight gradient `dW = dy^T x` | `dy^T` (`Columns128x1Transposed` of `dy`), 1x128 | `x^T` (`Columns128x1Transposed` of `x`), 1x128, `trans_b = Yes` | `(out, in, t)` |

use super::{
    block_cpu, block_cuda, cuda_into_range, output_range, GemmOutput, GemmSpec, FP8_DIM_MULTIPLE,
};
use crate::block_quantize::{ScaleOrder, ScaleStrides};
use crate::device::dispatch;
use crate::{check_len, Buffer, Device, KernelError};
use fp8_core::{BlockLayout, Fp8Format, BLOCK_SIZE};

const WHAT: &str = "gemm_fp8_block";

/// A block-scaled FP8 matrix: row-major codes of `layout`'s shape, their format, and one inverse scale
/// per block of `layout` (`value = decode(code) * scale_inv[block]`), stored in `scale_order`.
#[derive(Debug, Clone, Copy)]
pub struct BlockFp8Matrix<'a> {
    /// FP8 codes, row-major `[layout.rows(), layout.cols()]`.
    pub data: &'a Buffer<u8>,
    /// Format of the codes.
    pub format: Fp8Format,
    /// Shape and blocks of the codes (e.g. from `BlockQuantLayout::output_layout`).
    pub layout: BlockLayout,
    /// Inverse scales, `scale_order.strides(&layout)?.len` of them.
    pub scale_inv: &'a Buffer<f32>,
    /// Where each block's inverse scale is stored.
    pub scale_order: ScaleOrder,
}

impl BlockFp8Matrix<'_> {
    /// The strides of the scales, after checking the lengths of codes and scales against the layout.
    fn checked_strides(&self, what: &'static str) -> Result<ScaleStrides, KernelError> {
        let strides = self.scale_order.strides(&self.layout)?;
        check_len(what, self.layout.numel(), self.data.len())?;
        check_len(what, strides.len, self.scale_inv.len())?;
        Ok(strides)
    }
}

/// The blocks of an operand seen K-major: cuBLASLt's scale mode for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BlockKind {
    /// 1 x 128 tiles along K (`VEC128_32F`).
    Tiles1x128,
    /// 128 x 128 blocks (`BLK128x128_32F`).
    Blocks128x128,
}

impl BlockKind {
    fn of(layout: &BlockLayout) -> Option<Self> {
        match layout.block_shape() {
            [1, BLOCK_SIZE] => Some(BlockKind::Tiles1x128),
            [BLOCK_SIZE, BLOCK_SIZE] => Some(BlockKind::Blocks128x128),
            _ => None,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            BlockKind::Tiles1x128 => "1x128",
            BlockKind::Blocks128x128 => "128x128",
        }
    }
}

/// One checked operand of [`gemm_fp8_block`].
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockOperand<'a> {
    pub(super) matrix: BlockFp8Matrix<'a>,
    /// Stored `[k, outer]` (read transposed) instead of `[outer, k]`.
    pub(super) transposed: bool,
    /// The blocks seen K-major.
    pub(super) kind: BlockKind,
    /// Where the stored layout's scales are.
    pub(super) strides: ScaleStrides,
}

impl BlockOperand<'_> {
    /// The layout seen K-major, `[outer, k]`.
    pub(super) fn k_major_layout(&self) -> BlockLayout {
        if self.transposed {
            self.matrix.layout.transposed()
        } else {
            self.matrix.layout
        }
    }
}

fn invalid(detail: String) -> KernelError {
    KernelError::InvalidArgument { what: WHAT, detail }
}

/// Checks one operand: stored `[outer, k]`, or `[k, outer]` when `transposed`.
fn operand<'a>(
    name: &'static str,
    x: BlockFp8Matrix<'a>,
    outer: usize,
    k: usize,
    transposed: bool,
) -> Result<BlockOperand<'a>, KernelError> {
    let want = if transposed { [k, outer] } else { [outer, k] };
    let (rows, cols) = (x.layout.rows(), x.layout.cols());
    if [rows, cols] != want {
        return Err(invalid(format!(
            "{name}'s codes are {rows} x {cols}, the GEMM's shape needs {} x {}",
            want[0], want[1]
        )));
    }
    let strides = x.checked_strides(WHAT)?;
    let seen = if transposed {
        x.layout.transposed()
    } else {
        x.layout
    };
    let [br, bc] = x.layout.block_shape();
    let kind = match BlockKind::of(&seen) {
        Some(kind) => kind,
        None if transposed && [br, bc] == [1, BLOCK_SIZE] => {
            return Err(invalid(format!(
            "{name} is transposed (stored [k, {}]) with 1x128 tiles, which run along the output \
                 dimension, not along the reduction: quantize it K-major (BlockQuantLayout::\
                 Columns128x1Transposed writes the transposed codes and tiles)",
            if name == "A" { "m" } else { "n" }
        )))
        }
        None => {
            return Err(invalid(format!(
                "{name} has {br}x{bc} blocks{}; the block-scaled GEMM takes 1x128 tiles along the \
                 reduction or 128x128 blocks (per-tensor operands go to gemm_fp8)",
                if transposed {
                    " (stored transposed)"
                } else {
                    ""
                }
            )))
        }
    };
    Ok(BlockOperand {
        matrix: x,
        transposed,
        kind,
        strides,
    })
}

/// Checks a call of [`gemm_fp8_block`] (the same rules on both devices) and returns its operands.
fn check<'a>(
    spec: &GemmSpec,
    a: BlockFp8Matrix<'a>,
    b: BlockFp8Matrix<'a>,
    c_len: usize,
) -> Result<(BlockOperand<'a>, BlockOperand<'a>), KernelError> {
    spec.check(a.data.len(), b.data.len(), c_len)?;
    if spec.fp8_fast_accum {
        return Err(invalid(
            "fp8_fast_accum is not available with block scales (cuBLASLt has no such kernel)"
                .into(),
        ));
    }
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if [m, n, k].iter().any(|d| d % FP8_DIM_MULTIPLE != 0) {
        return Err(invalid(format!(
            "m x n x k = {m} x {n} x {k}: every side must be a multiple of {FP8_DIM_MULTIPLE} (pad the \
             operands, or run gemm_fp8, which pads)"
        )));
    }
    let a = operand("A", a, m, k, spec.trans_a.is_yes())?;
    let b = operand("B", b, n, k, !spec.trans_b.is_yes())?;
    if a.kind == BlockKind::Blocks128x128 && b.kind == BlockKind::Blocks128x128 {
        return Err(invalid(
            "both operands have 128x128 blocks; cuBLASLt multiplies 1x128 x 128x128, 128x128 x 1x128 \
             and 1x128 x 1x128 only"
                .into(),
        ));
    }
    Ok((a, b))
}

/// Block-scaled FP8 x FP8 GEMM with f32 accumulation into an f32 or bf16 output (see the module docs
/// for the operands, the rules and what is refused). All buffers on one device; on CUDA it runs on the
/// compute stream with no host round trip.
pub fn gemm_fp8_block<O: GemmOutput>(
    spec: &GemmSpec,
    a: BlockFp8Matrix<'_>,
    b: BlockFp8Matrix<'_>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    let (a, b) = check(spec, a, b, c.len())?;
    match c.device() {
        Device::Cpu => block_cpu::gemm(spec, &a, &b, c.host_mut(WHAT)?),
        Device::Cuda(dev) => block_cuda::gemm(&dev, spec, &a, &b, c, 0),
    }
}

/// [`gemm_fp8_block`] into the `m x n` consecutive elements of `c` from element `offset` (row-major; e.g.
/// a block-scaled weight's gradient inside its unit's flat gradient, accumulated with `beta = 1`); the
/// rest of `c` is left alone. On CUDA the product goes straight there when that address is 256-byte
/// aligned, `k > 0` and the operands are not both E5M2, else through a temporary of `m x n` (copied in
/// when `beta != 0`, copied back out).
pub fn gemm_fp8_block_at<O: GemmOutput>(
    spec: &GemmSpec,
    a: BlockFp8Matrix<'_>,
    b: BlockFp8Matrix<'_>,
    c: &mut Buffer<O>,
    offset: usize,
) -> Result<(), KernelError> {
    let mn = output_range(spec, c.len(), offset)?;
    let (a, b) = check(spec, a, b, mn)?;
    match c.device() {
        Device::Cpu => block_cpu::gemm(spec, &a, &b, &mut c.host_mut(WHAT)?[offset..offset + mn]),
        Device::Cuda(dev) => {
            let e5m2_pair =
                a.matrix.format == Fp8Format::E5M2 && b.matrix.format == Fp8Format::E5M2;
            cuda_into_range(
                &dev,
                spec,
                c,
                offset,
                mn,
                spec.k > 0 && !e5m2_pair,
                |c, at| block_cuda::gemm(&dev, spec, &a, &b, c, at),
            )
        }
    }
}

/// Transposes block-scaled codes exactly: `dst_codes` gets the codes of `src.layout.transposed()`
/// (`[cols, rows]`) and `dst_scale_inv` block `(j, i)`'s inverse scale = `src`'s block `(i, j)`, stored in
/// `dst_order` (`dst_order.strides(&src.layout.transposed())?.len` values; padding untouched). With
/// 128x128 blocks this is the cast of the transposed matrix, so the data-gradient GEMM's `W^T` comes from
/// `W`'s cast without requantization; callers that use `W^T` more than once (every micro-batch of a
/// step) make it once here instead of inside every [`gemm_fp8_block`] call.
pub fn transpose_block_fp8(
    src: BlockFp8Matrix<'_>,
    dst_codes: &mut Buffer<u8>,
    dst_scale_inv: &mut Buffer<f32>,
    dst_order: ScaleOrder,
) -> Result<(), KernelError> {
    const WHAT: &str = "transpose_block_fp8";
    let src_strides = src.checked_strides(WHAT)?;
    let dst_layout = src.layout.transposed();
    let dst_strides = dst_order.strides(&dst_layout)?;
    check_len(WHAT, dst_layout.numel(), dst_codes.len())?;
    check_len(WHAT, dst_strides.len, dst_scale_inv.len())?;
    let (data, scale_inv) = (src.data, src.scale_inv);
    dispatch!(WHAT, [data, scale_inv, dst_codes, dst_scale_inv],
    cpu: block_cpu::transpose(
        data.host(WHAT)?,
        &src.layout,
        scale_inv.host(WHAT)?,
        &src_strides,
        dst_codes.host_mut(WHAT)?,
        dst_scale_inv.host_mut(WHAT)?,
        &dst_strides,
    ),
    cuda(dev): block_cuda::transpose(
        &dev,
        &src,
        &src_strides,
        dst_codes.cuda_mut(WHAT)?,
        dst_scale_inv.cuda_mut(WHAT)?,
        &dst_strides,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::Transpose;
    use fp8_core::ScalingGranularity;

    fn layout(rows: usize, cols: usize, g: ScalingGranularity) -> BlockLayout {
        BlockLayout::new(rows, cols, g).unwrap()
    }

    /// Zero codes and scales of `layout` (row-major scales).
    fn zeros(l: BlockLayout) -> (Buffer<u8>, Buffer<f32>) {
        let dev = Device::cpu();
        (
            dev.zeros(l.numel()).unwrap(),
            dev.zeros(l.num_blocks()).unwrap(),
        )
    }

    fn matrix<'a>(l: BlockLayout, (d, s): &'a (Buffer<u8>, Buffer<f32>)) -> BlockFp8Matrix<'a> {
        BlockFp8Matrix {
            data: d,
            format: Fp8Format::E4M3,
            layout: l,
            scale_inv: s,
            scale_order: ScaleOrder::RowMajor,
        }
    }

    fn message(e: KernelError) -> String {
        match e {
            KernelError::InvalidArgument { detail, .. } => detail,
            other => panic!("not an InvalidArgument: {other}"),
        }
    }

    fn refuse(
        spec: &GemmSpec,
        a: BlockFp8Matrix<'_>,
        b: BlockFp8Matrix<'_>,
        c: &mut Buffer<f32>,
    ) -> String {
        message(gemm_fp8_block(spec, a, b, c).unwrap_err())
    }

    #[test]
    fn refusals_name_the_rule() {
        use ScalingGranularity::{Block128x128 as W, Block1x128 as T, PerTensor as P};
        let dev = Device::cpu();
        let (m, n, k) = (32, 48, 160);
        let tn = GemmSpec::new(m, n, k).transposes(Transpose::No, Transpose::Yes);
        let mut c: Buffer<f32> = dev.zeros(m * n).unwrap();
        let (xl, wl) = (layout(m, k, T), layout(n, k, W));
        let (x, w) = (zeros(xl), zeros(wl));
        // The forward product is accepted.
        gemm_fp8_block(&tn, matrix(xl, &x), matrix(wl, &w), &mut c).unwrap();

        let xw = zeros(layout(m, k, W));
        let e = refuse(&tn, matrix(layout(m, k, W), &xw), matrix(wl, &w), &mut c);
        assert!(e.contains("both operands have 128x128 blocks"), "{e}");
        let xp = zeros(layout(m, k, P));
        let e = refuse(&tn, matrix(layout(m, k, P), &xp), matrix(wl, &w), &mut c);
        assert!(e.contains("per-tensor operands go to gemm_fp8"), "{e}");
        // B stored [k, n] with 1x128 tiles: they run along n.
        let nt = GemmSpec::new(m, n, k);
        let bt = zeros(layout(k, n, T));
        let e = refuse(&nt, matrix(xl, &x), matrix(layout(k, n, T), &bt), &mut c);
        assert!(e.contains("Columns128x1Transposed"), "{e}");
        // A stored shape that does not fit the spec.
        let bw = zeros(layout(k, n, W));
        let e = refuse(&tn, matrix(xl, &x), matrix(layout(k, n, W), &bw), &mut c);
        assert!(e.contains("B's codes are 160 x 48"), "{e}");
        let fast = GemmSpec {
            fp8_fast_accum: true,
            ..tn
        };
        let e = refuse(&fast, matrix(xl, &x), matrix(wl, &w), &mut c);
        assert!(e.contains("fp8_fast_accum"), "{e}");
        // Sides that are not multiples of 16.
        let (m2, k2) = (24, 136);
        let mut c2: Buffer<f32> = dev.zeros(m2 * n).unwrap();
        let spec = GemmSpec::new(m2, n, k2).transposes(Transpose::No, Transpose::Yes);
        let (xl2, wl2) = (layout(m2, k2, T), layout(n, k2, W));
        let (x2, w2) = (zeros(xl2), zeros(wl2));
        let e = refuse(&spec, matrix(xl2, &x2), matrix(wl2, &w2), &mut c2);
        assert!(e.contains("multiple of 16"), "{e}");
        // A scale buffer one short of the layout's blocks.
        let short = (
            dev.zeros(xl.numel()).unwrap(),
            dev.zeros(xl.num_blocks() - 1).unwrap(),
        );
        let e = gemm_fp8_block(&tn, matrix(xl, &short), matrix(wl, &w), &mut c).unwrap_err();
        assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
        // Wrong output length.
        let mut c3: Buffer<f32> = dev.zeros(m * n - 1).unwrap();
        let e = gemm_fp8_block(&tn, matrix(xl, &x), matrix(wl, &w), &mut c3).unwrap_err();
        assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
    }

    #[test]
    fn transposed_weight_is_accepted_and_transposes_exactly() {
        use ScalingGranularity::Block128x128 as W;
        let dev = Device::cpu();
        let (rows, cols) = (130, 300);
        let l = layout(rows, cols, W);
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8).collect();
        let scales: Vec<f32> = (0..l.num_blocks()).map(|b| b as f32 + 0.5).collect();
        let (d, s) = (dev.upload(&codes).unwrap(), dev.upload(&scales).unwrap());
        let src = BlockFp8Matrix {
            data: &d,
            format: Fp8Format::E4M3,
            layout: l,
            scale_inv: &s,
            scale_order: ScaleOrder::RowMajor,
        };
        let t = l.transposed();
        let st = ScaleOrder::Gemm.strides(&t).unwrap();
        let mut dc: Buffer<u8> = dev.zeros(t.numel()).unwrap();
        let mut ds: Buffer<f32> = dev.zeros(st.len).unwrap();
        transpose_block_fp8(src, &mut dc, &mut ds, ScaleOrder::Gemm).unwrap();
        let (dc, ds) = (dc.to_vec().unwrap(), ds.to_vec().unwrap());
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(dc[c * rows + r], codes[r * cols + c]);
            }
        }
        let [gr, gc] = l.grid();
        for i in 0..gr {
            for j in 0..gc {
                assert_eq!(ds[st.index(j, i)], scales[i * gc + j]);
            }
        }
        let mut short: Buffer<f32> = dev.zeros(st.len - 1).unwrap();
        let mut dc2: Buffer<u8> = dev.zeros(t.numel()).unwrap();
        assert!(transpose_block_fp8(src, &mut dc2, &mut short, ScaleOrder::Gemm).is_err());
    }
}
