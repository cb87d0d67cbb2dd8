//! The block-scaled FP8 GEMM on CUDA: cuBLASLt's `VEC128_32F` / `BLK128x128_32F` scale modes, TN layout.
//! `block.rs` checked every argument (shapes, lengths, blocks, multiples of 16); here each operand is
//! brought to K-major codes with scales in [`ScaleOrder::Gemm`] (as is when it already is: the usual
//! case, no extra pass), and the row-major problem is mapped onto cuBLASLt's column-major one as in
//! `cuda.rs` (`C^T = B A^T`: our B is cuBLASLt's A, with B's scales and scale mode).

use super::blaslt::{BlasLt, ColMajorMatmul, PlanKey, SCALE_BLK128X128, SCALE_VEC128};
use super::block::{BlockFp8Matrix, BlockKind, BlockOperand};
use super::cuda::{
    cuda_type, elementwise_grid, fp8_type, gemm_float, relayout_u8, relayout_u8_into, same_device,
    scale_output, to_i64,
};
use super::{GemmOutput, GemmSpec};
use crate::block_quantize::{block_dequantize, ScaleOrder, ScaleStrides};
use crate::device::{cuda_slice, cuda_slice_mut};
use crate::kernel_source::GEMM_LAYOUT_MODULE;
use crate::launch::launch;
use crate::{Buffer, CudaDevice, Device, KernelError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use fp8_core::{BlockLayout, Fp8Format};
use half::bf16;

const WHAT: &str = "gemm_fp8_block";

fn scale_mode(kind: BlockKind) -> u32 {
    match kind {
        BlockKind::Tiles1x128 => SCALE_VEC128,
        BlockKind::Blocks128x128 => SCALE_BLK128X128,
    }
}

/// Copies the scales of `layout`'s grid from `src` (at `src_strides`) into `dst` (at `dst_strides`),
/// reading the grid transposed when `transpose` (then `dst` holds the scales of `layout.transposed()`).
fn copy_scales(
    dev: &CudaDevice,
    src: &CudaSlice<f32>,
    layout: &BlockLayout,
    src_strides: &ScaleStrides,
    transpose: bool,
    dst: &mut CudaSlice<f32>,
    dst_strides: &ScaleStrides,
) -> Result<(), KernelError> {
    let [gr, gc] = layout.grid();
    // Over the destination's grid: (gc x gr) when transposing, its block (i, j) is the source's (j, i).
    let (rows, cols, srs, scs) = if transpose {
        (gc, gr, src_strides.col, src_strides.row)
    } else {
        (gr, gc, src_strides.row, src_strides.col)
    };
    if rows * cols == 0 {
        return Ok(());
    }
    if src.len() < src_strides.len || dst.len() < dst_strides.len {
        return Err(KernelError::Internal(format!(
            "scale copy: {} and {} values held for {} and {}",
            src.len(),
            dst.len(),
            src_strides.len,
            dst_strides.len
        )));
    }
    let v = |x: usize| to_i64(WHAT, x);
    let (srs, scs, drs, dcs) = (v(srs)?, v(scs)?, v(dst_strides.row)?, v(dst_strides.col)?);
    let (r, c) = (v(rows)?, v(cols)?);
    // Every index i * rs + j * cs of the grid lies below its strides' len (ScaleOrder::strides), which
    // both buffers hold (checked above).
    launch!(
        dev,
        &GEMM_LAYOUT_MODULE,
        "gemm_block_scales_copy",
        elementwise_grid(rows * cols),
        "gemm_block_scales_copy(const float* src, long long src_rs, long long src_cs, float* dst, \
         long long dst_rs, long long dst_cs, long long rows, long long cols)",
        [src, &srs, &scs, dst, &drs, &dcs, &r, &c]
    )
}

/// One operand K-major (`[outer, k]` codes, scales in the GEMM's order): the caller's buffers, or
/// temporaries when it was stored transposed or its scales row-major.
struct KMajorOperand<'a> {
    codes: Option<CudaSlice<u8>>,
    scales: Option<CudaSlice<f32>>,
    src_codes: &'a CudaSlice<u8>,
    src_scales: &'a CudaSlice<f32>,
}

impl KMajorOperand<'_> {
    fn codes(&self) -> &CudaSlice<u8> {
        self.codes.as_ref().unwrap_or(self.src_codes)
    }
    fn scales(&self) -> &CudaSlice<f32> {
        self.scales.as_ref().unwrap_or(self.src_scales)
    }
}

fn k_major<'a>(
    dev: &CudaDevice,
    op: &BlockOperand<'a>,
    outer: usize,
    k: usize,
) -> Result<KMajorOperand<'a>, KernelError> {
    let x = &op.matrix;
    let src_codes = cuda_slice(x.data, WHAT)?;
    let src_scales = cuda_slice(x.scale_inv, WHAT)?;
    let codes = if op.transposed {
        Some(relayout_u8(dev, src_codes, [k, outer], true, [outer, k])?)
    } else {
        None
    };
    let scales = if op.transposed || x.scale_order != ScaleOrder::Gemm {
        let target = ScaleOrder::Gemm.strides(&op.k_major_layout())?;
        // Zeros: the padding entries are then defined, though cuBLASLt does not read them.
        let mut dst = dev.stream().alloc_zeros::<f32>(target.len.max(1))?;
        copy_scales(
            dev,
            src_scales,
            &x.layout,
            &op.strides,
            op.transposed,
            &mut dst,
            &target,
        )?;
        Some(dst)
    } else {
        None
    };
    Ok(KMajorOperand {
        codes,
        scales,
        src_codes,
        src_scales,
    })
}

/// The block-scaled GEMM through cuBLASLt (see the module docs), into `C`'s `m x n` elements from element
/// `c_offset` of `c` (`block.rs` checked the range; a nonzero offset only with `k > 0`, operands not both
/// E5M2, and the address 256-byte aligned).
pub(super) fn gemm<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: &BlockOperand<'_>,
    b: &BlockOperand<'_>,
    c: &mut Buffer<O>,
    c_offset: usize,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    for (what, d) in [
        ("gemm_fp8_block: A", a.matrix.data.device()),
        ("gemm_fp8_block: B", b.matrix.data.device()),
        ("gemm_fp8_block: A scales", a.matrix.scale_inv.device()),
        ("gemm_fp8_block: B scales", b.matrix.scale_inv.device()),
    ] {
        same_device(what, dev, &d)?;
    }
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    let e5m2_pair = a.matrix.format == Fp8Format::E5M2 && b.matrix.format == Fp8Format::E5M2;
    if c_offset != 0 && (k == 0 || e5m2_pair) {
        return Err(KernelError::Internal(
            "a block-scaled GEMM with k = 0 or two E5M2 operands into a range of C".into(),
        ));
    }
    if k == 0 {
        return scale_output(dev, m, n, spec.beta, c);
    }
    if e5m2_pair {
        return e5m2_pair_as_bf16(dev, spec, &a.matrix, &b.matrix, c);
    }
    let ak = k_major(dev, a, m, k)?;
    let bk = k_major(dev, b, n, k)?;
    let key = PlanKey {
        a_type: fp8_type(b.matrix.format),
        b_type: fp8_type(a.matrix.format),
        cd_type: cuda_type(O::DTYPE)?,
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        trans_a: true,
        trans_b: false,
        m: n as u64,
        n: m as u64,
        k: k as u64,
        lda: to_i64(WHAT, k)?,
        ldb: to_i64(WHAT, k)?,
        ldd: to_i64(WHAT, n)?,
        scaled: true,
        fast_accum: false,
        a_scale_mode: scale_mode(b.kind),
        b_scale_mode: scale_mode(a.kind),
    };
    let blas = BlasLt::for_device(dev)?;
    let stream = dev.stream().clone();
    let (pa, _ga) = ak.codes().device_ptr(&stream);
    let (pb, _gb) = bk.codes().device_ptr(&stream);
    let (sa, _gsa) = ak.scales().device_ptr(&stream);
    let (sb, _gsb) = bk.scales().device_ptr(&stream);
    let (pd, _gd) = cuda_slice_mut(c, WHAT)?.device_ptr_mut(&stream);
    let pd = pd + (c_offset * std::mem::size_of::<O>()) as u64;
    let mm = ColMajorMatmul {
        key,
        a: pb,
        b: pa,
        d: pd,
        alpha: spec.alpha,
        beta: spec.beta,
        a_scale: Some(sb),
        b_scale: Some(sa),
    };
    // SAFETY: A and B are [m, k] and [n, k] K-major codes of this device (lengths checked by block.rs
    // against the layouts, or written so by relayout_u8), C holds [m, n] from c_offset (checked by block.rs); their
    // scales are whole f32 buffers in the GEMM's order of the K-major layouts (ScaleOrder::Gemm's
    // lengths, checked by block.rs or allocated so by k_major), which is the order and extent the scale
    // modes make cuBLASLt read. The guards keep every buffer ordered on the stream until the call has
    // been queued, and the temporaries' frees are ordered after it.
    unsafe { blas.run(dev, &mm) }.map_err(|e| match e {
        KernelError::Blas(b2)
            if b2.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED =>
        {
            KernelError::InvalidArgument {
                what: WHAT,
                detail: format!(
                    "cuBLASLt has no kernel for {m} x {n} x {k}, A {} {:?} x B {} {:?} -> {} \
                     (CUBLAS_STATUS_NOT_SUPPORTED; block scales need sm_90 and cuBLAS 12.9 or newer)",
                    a.kind.name(),
                    a.matrix.format,
                    b.kind.name(),
                    b.matrix.format,
                    O::DTYPE
                ),
            }
        }
        other => other,
    })
}

/// E5M2 x E5M2 has no cuBLASLt FP8 kernel: both operands dequantized to BF16 (their block scales
/// applied; exact for power-of-two scales in range), then a BF16 GEMM with the call's transposes.
fn e5m2_pair_as_bf16<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: &BlockFp8Matrix<'_>,
    b: &BlockFp8Matrix<'_>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    let gpu = Device::Cuda(dev.clone());
    let dequantized = |x: &BlockFp8Matrix<'_>| -> Result<Buffer<bf16>, KernelError> {
        let mut out = gpu.zeros::<bf16>(x.layout.numel())?;
        block_dequantize(
            x.data,
            &x.layout,
            x.scale_order,
            x.format,
            x.scale_inv,
            &mut out,
        )?;
        Ok(out)
    };
    let (a16, b16) = (dequantized(a)?, dequantized(b)?);
    gemm_float(dev, spec, &a16, &b16, c)
}

/// [`super::transpose_block_fp8`] on CUDA: the codes by the tiled byte transpose, the scales by the
/// scale copy with the grid read transposed. `block.rs` checked every length.
pub(super) fn transpose(
    dev: &CudaDevice,
    src: &BlockFp8Matrix<'_>,
    src_strides: &ScaleStrides,
    dst_codes: &mut CudaSlice<u8>,
    dst_scale_inv: &mut CudaSlice<f32>,
    dst_strides: &ScaleStrides,
) -> Result<(), KernelError> {
    let (rows, cols) = (src.layout.rows(), src.layout.cols());
    if rows * cols == 0 {
        return Ok(());
    }
    let codes = cuda_slice(src.data, "transpose_block_fp8")?;
    relayout_u8_into(dev, codes, [rows, cols], true, [cols, rows], dst_codes)?;
    let scales = cuda_slice(src.scale_inv, "transpose_block_fp8")?;
    copy_scales(
        dev,
        scales,
        &src.layout,
        src_strides,
        true,
        dst_scale_inv,
        dst_strides,
    )
}
