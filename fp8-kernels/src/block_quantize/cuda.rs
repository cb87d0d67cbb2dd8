//! Launches of the block-scaled casts (`block_quantize.cu`). `mod.rs` validated every argument: the
//! lengths of the input, codes and scales against the layout, sides within 32-bit indices, one device,
//! and a non-empty matrix.

use super::{
    BlockCastInput, BlockQuantLayout, BlockQuantOutput, BlockQuantSpec, PackedRows1x128,
    ScaleStrides, BLOCK_ACTIVATION_MODULE, BLOCK_QUANTIZE_MODULE,
};
use crate::cast::format_name;
use crate::elementwise::GeluApprox;
use crate::launch::{grid, kernel_name, launch, optional_ptr, optional_ptr_mut};
use crate::{CudaDevice, FloatElement, KernelError};
use cudarc::driver::{CudaSlice, LaunchConfig};
use fp8_core::{BlockLayout, Fp8Format, ScaleRounding, BLOCK_SIZE};

/// At most this many thread blocks per SM for the tile kernels (grid-stride loops cover the rest).
const TILE_BLOCKS_PER_SM: usize = 16;

/// `items` thread blocks of `block` threads, at most [`TILE_BLOCKS_PER_SM`] per SM, at least one.
fn tile_launch(dev: &CudaDevice, items: usize, block: (u32, u32, u32)) -> LaunchConfig {
    let cap = dev.sm_count().max(1) as usize * TILE_BLOCKS_PER_SM;
    LaunchConfig {
        grid_dim: (items.clamp(1, cap) as u32, 1, 1),
        block_dim: block,
        shared_mem_bytes: 0,
    }
}

/// The launch of `bq_128x128_impl` (`blocks128.cuh`) over `[rows, cols]`: one block of 256 threads per
/// 128x128 block (the kernel's thread layout needs exactly 256).
pub(crate) fn blocks128_launch(dev: &CudaDevice, rows: usize, cols: usize) -> LaunchConfig {
    tile_launch(
        dev,
        rows.div_ceil(BLOCK_SIZE) * cols.div_ceil(BLOCK_SIZE),
        (256, 1, 1),
    )
}

/// One block of 256 threads per 128 x 128 region of `[rows, cols]` (`bq_tiles_impl` needs exactly 256).
fn regions_launch(dev: &CudaDevice, rows: usize, cols: usize) -> LaunchConfig {
    tile_launch(
        dev,
        rows.div_ceil(BLOCK_SIZE) * cols.div_ceil(BLOCK_SIZE),
        (256, 1, 1),
    )
}

/// An output's device slices (codes, scales, inverse scales), or none.
type OutputParts<'b> = (
    Option<&'b mut CudaSlice<u8>>,
    Option<&'b mut CudaSlice<f32>>,
    Option<&'b mut CudaSlice<f32>>,
);

fn output_parts<'b>(
    o: Option<&'b mut BlockQuantOutput<'_>>,
) -> Result<OutputParts<'b>, KernelError> {
    const WHAT: &str = "block_quantize_tiles";
    Ok(match o {
        Some(o) => (
            Some(o.codes.cuda_mut(WHAT)?),
            Some(o.scale.cuda_mut(WHAT)?),
            Some(o.scale_inv.cuda_mut(WHAT)?),
        ),
        None => (None, None, None),
    })
}

/// `input`'s `[rows, cols]` values to the 1x128 output `rows_out` and/or the 128x1 transposed output
/// `cols_out` (`bq_tiles_impl`: an absent output is a null pointer, and that layout is skipped).
#[allow(clippy::too_many_arguments)]
pub(super) fn quantize_tiles<T: FloatElement>(
    dev: &CudaDevice,
    input: BlockCastInput<'_, T>,
    [rows, cols]: [usize; 2],
    format: Fp8Format,
    rounding: ScaleRounding,
    (row_strides, col_strides): (ScaleStrides, ScaleStrides),
    rows_out: Option<&mut BlockQuantOutput<'_>>,
    cols_out: Option<&mut BlockQuantOutput<'_>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "block_quantize_tiles";
    dev.require_fp8()?;
    let stream = dev.stream().clone();
    let fmax = format.max();
    let exact = matches!(rounding, ScaleRounding::Exact) as i32;
    let (r, c) = (rows as i32, cols as i32);
    let (srs, scs) = (row_strides.row as u64, row_strides.col as u64);
    let (trs, tcs) = (col_strides.row as u64, col_strides.col as u64);
    let (y, s, si) = output_parts(rows_out)?;
    let (yt, ts, tsi) = output_parts(cols_out)?;
    let (y, s, si) = (
        optional_ptr_mut(y, &stream),
        optional_ptr_mut(s, &stream),
        optional_ptr_mut(si, &stream),
    );
    let (yt, ts, tsi) = (
        optional_ptr_mut(yt, &stream),
        optional_ptr_mut(ts, &stream),
        optional_ptr_mut(tsi, &stream),
    );
    let cfg = regions_launch(dev, rows, cols);
    let fname = format_name(format);
    // The inputs hold what mod.rs checked for [rows, cols] (gu of SwiGLU 2 * rows * cols, dh of its
    // gradient rows * cols / 2); y and yt hold rows * cols codes and the scale buffers their strides'
    // len, which hold the index of every tile of the two output layouts (checked by mod.rs); a null
    // output is never touched.
    match input {
        BlockCastInput::Values(x) => {
            let x = x.cuda(WHAT)?;
            launch!(
            dev,
            &BLOCK_QUANTIZE_MODULE,
            kernel_name!("bq_both_", T::NAME, "_", fname),
            cfg,
            "bq_both_<T>_<fmt>(const T* x, u8* y, float* scale, float* scale_inv, u64 srs, u64 scs, u8* yt, \
             float* tscale, float* tscale_inv, u64 trs, u64 tcs, float fmax, int exact, int rows, int cols)",
            [x, &y.ptr, &s.ptr, &si.ptr, &srs, &scs, &yt.ptr, &ts.ptr, &tsi.ptr, &trs, &tcs,
             &fmax, &exact, &r, &c]
        )
        }
        BlockCastInput::Gelu { u, approx } => {
            let ge = (approx == GeluApprox::Erf) as i32;
            let u = u.cuda(WHAT)?;
            launch!(
                dev,
                &BLOCK_ACTIVATION_MODULE,
                kernel_name!("bq_gelu_bf16_", fname),
                cfg,
                "bq_gelu_<T>_<fmt>(const T* u, int gelu_exact, u8* y, float* scale, float* scale_inv, u64 srs, \
                 u64 scs, u8* yt, float* tscale, float* tscale_inv, u64 trs, u64 tcs, float fmax, int exact, \
                 int rows, int cols)",
                [u, &ge, &y.ptr, &s.ptr, &si.ptr, &srs, &scs, &yt.ptr, &ts.ptr, &tsi.ptr, &trs,
                 &tcs, &fmax, &exact, &r, &c]
            )
        }
        BlockCastInput::GeluGrad { u, dy, approx } => {
            let ge = (approx == GeluApprox::Erf) as i32;
            let (u, dy) = (u.cuda(WHAT)?, dy.cuda(WHAT)?);
            launch!(
                dev,
                &BLOCK_ACTIVATION_MODULE,
                kernel_name!("bq_gelu_grad_bf16_", fname),
                cfg,
                "bq_gelu_grad_<T>_<fmt>(const T* u, const T* dy, int gelu_exact, u8* y, float* scale, \
                 float* scale_inv, u64 srs, u64 scs, u8* yt, float* tscale, float* tscale_inv, u64 trs, \
                 u64 tcs, float fmax, int exact, int rows, int cols)",
                [u, dy, &ge, &y.ptr, &s.ptr, &si.ptr, &srs, &scs, &yt.ptr, &ts.ptr,
                 &tsi.ptr, &trs, &tcs, &fmax, &exact, &r, &c]
            )
        }
        BlockCastInput::SwiGlu { gu } => {
            let gu = gu.cuda(WHAT)?;
            launch!(
            dev,
            &BLOCK_ACTIVATION_MODULE,
            kernel_name!("bq_swiglu_bf16_", fname),
            cfg,
            "bq_swiglu_<T>_<fmt>(const T* gu, u8* y, float* scale, float* scale_inv, u64 srs, u64 scs, \
             u8* yt, float* tscale, float* tscale_inv, u64 trs, u64 tcs, float fmax, int exact, int rows, \
             int cols)",
            [gu, &y.ptr, &s.ptr, &si.ptr, &srs, &scs, &yt.ptr, &ts.ptr, &tsi.ptr, &trs, &tcs,
             &fmax, &exact, &r, &c]
        )
        }
        BlockCastInput::Norm {
            x,
            weight,
            bias,
            stats,
            ..
        } => {
            let (x, w) = (x.cuda(WHAT)?, weight.cuda(WHAT)?);
            let (mean, rstd) = (stats.mean.cuda(WHAT)?, stats.rstd.cuda(WHAT)?);
            let b = optional_ptr(bias.map(|b| b.cuda(WHAT)).transpose()?, &stream);
            // w and b hold cols values, mean and rstd rows (checked by mod.rs).
            launch!(
                dev,
                &BLOCK_ACTIVATION_MODULE,
                kernel_name!("bq_norm_bf16_", fname),
                cfg,
                "bq_norm_<T>_<fmt>(const T* x, const T* w, const T* b, const float* mean, \
                 const float* rstd, u8* y, float* scale, float* scale_inv, u64 srs, u64 scs, u8* yt, \
                 float* tscale, float* tscale_inv, u64 trs, u64 tcs, float fmax, int exact, int rows, \
                 int cols)",
                [x, w, &b.ptr, mean, rstd, &y.ptr, &s.ptr, &si.ptr, &srs, &scs, &yt.ptr, &ts.ptr,
                 &tsi.ptr, &trs, &tcs, &fmax, &exact, &r, &c]
            )
        }
        BlockCastInput::SwiGluGrad { gu, dh } => {
            let (gu, dh) = (gu.cuda(WHAT)?, dh.cuda(WHAT)?);
            launch!(
            dev,
            &BLOCK_ACTIVATION_MODULE,
            kernel_name!("bq_swiglu_grad_bf16_", fname),
            cfg,
            "bq_swiglu_grad_<T>_<fmt>(const T* gu, const T* dh, u8* y, float* scale, float* scale_inv, \
             u64 srs, u64 scs, u8* yt, float* tscale, float* tscale_inv, u64 trs, u64 tcs, float fmax, \
             int exact, int rows, int cols)",
            [gu, dh, &y.ptr, &s.ptr, &si.ptr, &srs, &scs, &yt.ptr, &ts.ptr,
             &tsi.ptr, &trs, &tcs, &fmax, &exact, &r, &c]
        )
        }
    }
}

/// `x [rows, cols]` to codes and block scales in `spec.layout`, the scales stored at `strides`.
#[allow(clippy::too_many_arguments)]
pub(super) fn quantize<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    [rows, cols]: [usize; 2],
    spec: BlockQuantSpec,
    strides: ScaleStrides,
    codes: &mut CudaSlice<u8>,
    scale: &mut CudaSlice<f32>,
    scale_inv: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let fmax = spec.format.max();
    let exact = matches!(spec.rounding, ScaleRounding::Exact) as i32;
    let (r, c) = (rows as i32, cols as i32);
    let (srs, scs) = (strides.row as u64, strides.col as u64);
    let cfg = match spec.layout {
        // One warp per 1x128 tile.
        BlockQuantLayout::Rows1x128 => grid(dev, (rows * cols.div_ceil(BLOCK_SIZE) * 32) as u64),
        // One block of 256 threads per 128 x 128 region (bq_tiles_impl's thread layout).
        BlockQuantLayout::Columns128x1Transposed => regions_launch(dev, rows, cols),
        BlockQuantLayout::Blocks128x128 => blocks128_launch(dev, rows, cols),
    };
    // x and codes hold rows * cols elements, scale and scale_inv `strides.len` values, which hold the
    // index `i * srs + j * scs` of every block (i, j) of the layout's output (checked by mod.rs); every
    // kernel of this family reads and writes only inside those extents.
    launch!(
        dev,
        &BLOCK_QUANTIZE_MODULE,
        kernel_name!(
            "bq_",
            spec.layout.name(),
            "_",
            T::NAME,
            "_",
            format_name(spec.format)
        ),
        cfg,
        "bq_<layout>_<T>_<fmt>(const T* x, u8* y, float* scale, float* scale_inv, u64 srs, u64 scs, \
         float fmax, int exact, int rows, int cols)",
        [x, codes, scale, scale_inv, &srs, &scs, &fmax, &exact, &r, &c]
    )
}

/// `out = T(decode(codes) * scale_inv[block])` over `layout`, the scales stored at `strides`.
pub(super) fn dequantize<T: FloatElement>(
    dev: &CudaDevice,
    codes: &CudaSlice<u8>,
    layout: &BlockLayout,
    strides: &ScaleStrides,
    format: Fp8Format,
    scale_inv: &CudaSlice<f32>,
    out: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let [br, bc] = layout.block_shape();
    let (r, c) = (layout.rows() as i32, layout.cols() as i32);
    let (br, bc) = (br as i32, bc as i32);
    let (srs, scs) = (strides.row as u64, strides.col as u64);
    let cfg = grid(dev, layout.numel() as u64);
    // codes and out hold rows * cols elements, scale_inv `strides.len` values holding every block's
    // index (checked by mod.rs).
    launch!(
        dev,
        &BLOCK_QUANTIZE_MODULE,
        kernel_name!("bdq_", format_name(format), "_", T::NAME),
        cfg,
        "bdq_<fmt>_<T>(const u8* q, T* y, const float* scale_inv, u64 srs, u64 scs, int rows, int cols, \
         int block_rows, int block_cols)",
        [codes, out, scale_inv, &srs, &scs, &r, &c, &br, &bc]
    )
}

/// `x [rows, cols]` to packed 1x128 row records.
pub(super) fn quantize_packed<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    packing: &PackedRows1x128,
    format: Fp8Format,
    rounding: ScaleRounding,
    packed: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let fmax = format.max();
    let exact = matches!(rounding, ScaleRounding::Exact) as i32;
    let (rows, cols) = (packing.rows(), packing.cols());
    let (r, c) = (rows as i32, cols as i32);
    let (row_bytes, soff) = (packing.row_bytes() as u64, packing.scales_offset() as u64);
    // One warp per 1x128 tile.
    let cfg = grid(dev, (rows * packing.blocks_per_row() * 32) as u64);
    // x holds rows * cols elements and packed rows * row_bytes bytes (checked by mod.rs); each record's
    // codes end before scales_offset and its scales (4-byte aligned: offsets are multiples of 16) before
    // row_bytes.
    launch!(
        dev,
        &BLOCK_QUANTIZE_MODULE,
        kernel_name!("bqp_1x128_", T::NAME, "_", format_name(format)),
        cfg,
        "bqp_1x128_<T>_<fmt>(const T* x, u8* p, u64 row_bytes, u64 scales_offset, float fmax, int exact, \
         int rows, int cols)",
        [x, packed, &row_bytes, &soff, &fmax, &exact, &r, &c]
    )
}

/// `out += alpha * sum over the records of their dequantized codes`, in record order.
pub(super) fn dequantize_sum<D: FloatElement>(
    dev: &CudaDevice,
    packed: &CudaSlice<u8>,
    packing: &PackedRows1x128,
    format: Fp8Format,
    alpha: f32,
    out: &mut CudaSlice<D>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    let (pieces, cols) = (packing.rows() as i32, packing.cols() as i32);
    let (row_bytes, soff) = (packing.row_bytes() as u64, packing.scales_offset() as u64);
    // One thread per 8 elements.
    let cfg = grid(dev, packing.cols().div_ceil(8) as u64);
    // packed holds rows * row_bytes bytes and out cols elements (checked by mod.rs).
    launch!(
        dev,
        &BLOCK_QUANTIZE_MODULE,
        kernel_name!("bdqs_", format_name(format), "_", D::NAME),
        cfg,
        "bdqs_<fmt>_<D>(const u8* p, D* out, float alpha, int pieces, int cols, u64 row_bytes, \
         u64 scales_offset)",
        [packed, out, &alpha, &pieces, &cols, &row_bytes, &soff]
    )
}
