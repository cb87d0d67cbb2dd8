//! The GEMMs on CUDA: row-major problems mapped onto cuBLASLt's column-major ones (`C^T[n, m] =
//! op(B)^T op(A)^T`, so B becomes cuBLASLt's "A" and A its "B"), and the layout kernels (`layout.cu`) that
//! bring FP8 operands into the one layout cuBLASLt's FP8 kernels accept. `mod.rs` checked the lengths.

use super::blaslt::{BlasLt, ColMajorMatmul, PlanKey, SCALE_SCALAR};
use super::{DeviceScalar, Fp8Matrix, GemmOutput, GemmSpec, FP8_DIM_MULTIPLE};
use crate::device::{cuda_slice, cuda_slice_mut};
use crate::kernel_source::GEMM_LAYOUT_MODULE;
use crate::launch::launch;
use crate::{Buffer, CudaDevice, DType, Device, Element, KernelError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use fp8_core::Fp8Format;
use half::bf16;

/// cuBLASLt type tags of the element types GEMMs take.
pub(super) fn cuda_type(d: DType) -> Result<sys::cudaDataType_t, KernelError> {
    match d {
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
        other => Err(KernelError::InvalidArgument {
            what: "gemm",
            detail: format!("{other} is not a GEMM element type"),
        }),
    }
}

pub(super) fn fp8_type(f: Fp8Format) -> sys::cudaDataType_t {
    match f {
        Fp8Format::E4M3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType_t::CUDA_R_8F_E5M2,
    }
}

pub(super) fn same_device(
    what: &'static str,
    dev: &CudaDevice,
    other: &Device,
) -> Result<(), KernelError> {
    if *other == Device::Cuda(dev.clone()) {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

/// One thread per element in blocks of 256, at most 2^16 blocks (grid-stride beyond).
pub(super) fn elementwise_grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn to_i64(what: &'static str, x: usize) -> Result<i64, KernelError> {
    i64::try_from(x).map_err(|_| KernelError::InvalidArgument {
        what,
        detail: format!("{x} does not fit in i64"),
    })
}

/// `c = beta * c` on the device (the empty-sum GEMM, k = 0).
pub(super) fn scale_output<O: GemmOutput>(
    dev: &CudaDevice,
    rows: usize,
    cols: usize,
    beta: f32,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    if beta == 0.0 {
        return c.fill_zero();
    }
    let zeros = dev.stream().alloc_zeros::<f32>(rows * cols)?;
    unpad_into(dev, &zeros, cols, rows, cols, beta, c)
}

/// `c[i, j] = tmp[i * ld + j] + beta * c[i, j]` over the `rows x cols` of `c` (`tmp` holds at least
/// `rows * ld` values, `cols <= ld`).
fn unpad_into<O: GemmOutput>(
    dev: &CudaDevice,
    tmp: &CudaSlice<f32>,
    ld: usize,
    rows: usize,
    cols: usize,
    beta: f32,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    let name = match O::DTYPE {
        DType::F32 => "gemm_unpad_f32",
        DType::BF16 => "gemm_unpad_bf16",
        other => {
            return Err(KernelError::InvalidArgument {
                what: "gemm output",
                detail: format!("{other} is not a GEMM output type"),
            })
        }
    };
    let (ld, r, cl) = (
        to_i64("gemm", ld)?,
        to_i64("gemm", rows)?,
        to_i64("gemm", cols)?,
    );
    let cs = cuda_slice_mut(c, "gemm output")?;
    launch!(
        dev,
        &GEMM_LAYOUT_MODULE,
        name,
        elementwise_grid(rows * cols),
        "gemm_unpad_<O>(const float* tmp, long long ld, long long rows, long long cols, float beta, O* c)",
        [tmp, &ld, &r, &cl, &beta, cs]
    )
}

/// Copies `op(src)` (src is `src_rows x src_cols` codes) into a zero-padded `dst_rows x dst_cols` buffer.
pub(super) fn relayout_u8(
    dev: &CudaDevice,
    src: &CudaSlice<u8>,
    src_shape: [usize; 2],
    transpose: bool,
    [dst_rows, dst_cols]: [usize; 2],
) -> Result<CudaSlice<u8>, KernelError> {
    // SAFETY: every element is written by the kernel below (zeros outside the source).
    let mut dst = unsafe { dev.stream().alloc::<u8>(dst_rows * dst_cols) }?;
    relayout_u8_into(
        dev,
        src,
        src_shape,
        transpose,
        [dst_rows, dst_cols],
        &mut dst,
    )?;
    Ok(dst)
}

/// [`relayout_u8`] into `dst`, which holds at least `dst_rows * dst_cols` codes; `src` holds
/// `src_rows * src_cols`.
pub(super) fn relayout_u8_into(
    dev: &CudaDevice,
    src: &CudaSlice<u8>,
    [src_rows, src_cols]: [usize; 2],
    transpose: bool,
    [dst_rows, dst_cols]: [usize; 2],
    dst: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    if src.len() < src_rows * src_cols || dst.len() < dst_rows * dst_cols {
        return Err(KernelError::Internal(format!(
            "relayout of {src_rows} x {src_cols} codes ({} held) into {dst_rows} x {dst_cols} ({} held)",
            src.len(),
            dst.len()
        )));
    }
    let (sr, sc, dr, dc) = (
        to_i64("gemm", src_rows)?,
        to_i64("gemm", src_cols)?,
        to_i64("gemm", dst_rows)?,
        to_i64("gemm", dst_cols)?,
    );
    if transpose && src_cols % 4 == 0 && dst_cols % 4 == 0 {
        let grid_x =
            u32::try_from(dst_cols.div_ceil(64)).map_err(|_| KernelError::InvalidArgument {
                what: "gemm",
                detail: format!("{dst_cols} columns are too many for one grid"),
            })?;
        let cfg = LaunchConfig {
            grid_dim: (
                grid_x.max(1),
                dst_rows.div_ceil(64).clamp(1, 65535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // The kernel reads src^T inside src_rows x src_cols and writes dst_rows x dst_cols (checked above),
        // in 4-byte words at multiples of 4 bytes from the starts (both column counts are multiples of 4,
        // the buffers' starts are allocation starts).
        return launch!(
            dev,
            &GEMM_LAYOUT_MODULE,
            "gemm_transpose_u8_v4",
            cfg,
            "gemm_transpose_u8_v4(const u8* src, long long src_rows, long long src_cols, u8* dst, \
             long long dst_rows, long long dst_cols)",
            [src, &sr, &sc, dst, &dr, &dc]
        );
    }
    let tr: i32 = i32::from(transpose);
    let grid_x =
        u32::try_from(dst_cols.div_ceil(32)).map_err(|_| KernelError::InvalidArgument {
            what: "gemm",
            detail: format!("{dst_cols} columns are too many for one grid"),
        })?;
    let grid_y = dst_rows.div_ceil(32).clamp(1, 65535) as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid_x.max(1), grid_y, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // The kernel reads op(src) inside src_rows x src_cols (checked above) and writes dst_rows x dst_cols.
    launch!(
        dev,
        &GEMM_LAYOUT_MODULE,
        "gemm_relayout_u8",
        cfg,
        "gemm_relayout_u8(const u8* src, long long src_rows, long long src_cols, int transpose, u8* dst, \
         long long dst_rows, long long dst_cols)",
        [src, &sr, &sc, &tr, dst, &dr, &dc]
    )
}

/// F32 or BF16 GEMM (any transposes, any shape) through cuBLASLt.
pub(super) fn gemm_float<T: Element, O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    gemm_float_at(dev, spec, a, b, c, 0)
}

/// The bytes a `C` that starts inside its buffer must be aligned to: cuBLASLt's heuristics assume 256-byte
/// aligned matrices unless told otherwise.
pub(super) const OUTPUT_ALIGN_BYTES: usize = 256;

/// Whether `C` starting at element `c_offset` of `c` has the alignment cuBLASLt assumes.
pub(super) fn output_aligned<O: GemmOutput>(
    dev: &CudaDevice,
    c: &mut Buffer<O>,
    c_offset: usize,
) -> Result<bool, KernelError> {
    let stream = dev.stream().clone();
    let (p, _g) = cuda_slice_mut(c, "gemm: C")?.device_ptr_mut(&stream);
    let at = p + (c_offset * std::mem::size_of::<O>()) as u64;
    Ok(at % OUTPUT_ALIGN_BYTES as u64 == 0)
}

/// [`gemm_float`] into `C`'s `m x n` elements from element `c_offset` of `c` (`mod.rs` checked the range
/// and the alignment; `k > 0` there).
pub(super) fn gemm_float_at<T: Element, O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<O>,
    c_offset: usize,
) -> Result<(), KernelError> {
    same_device("gemm: A", dev, &a.device())?;
    same_device("gemm: B", dev, &b.device())?;
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if c_offset != 0 {
            return Err(KernelError::Internal(
                "a GEMM with k = 0 into a range of C".into(),
            ));
        }
        return scale_output(dev, m, n, spec.beta, c);
    }
    let in_type = cuda_type(T::DTYPE)?;
    let compute = if T::DTYPE == DType::F32 && spec.allow_tf32 {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let key = PlanKey {
        a_type: in_type,
        b_type: in_type,
        cd_type: cuda_type(O::DTYPE)?,
        compute,
        trans_a: spec.trans_b.is_yes(),
        trans_b: spec.trans_a.is_yes(),
        m: n as u64,
        n: m as u64,
        k: k as u64,
        lda: to_i64("gemm", if spec.trans_b.is_yes() { k } else { n })?,
        ldb: to_i64("gemm", if spec.trans_a.is_yes() { m } else { k })?,
        ldd: to_i64("gemm", n)?,
        scaled: false,
        fast_accum: false,
        a_scale_mode: SCALE_SCALAR,
        b_scale_mode: SCALE_SCALAR,
    };
    let blas = BlasLt::for_device(dev)?;
    let stream = dev.stream().clone();
    let (pa, _ga) = cuda_slice(a, "gemm: A")?.device_ptr(&stream);
    let (pb, _gb) = cuda_slice(b, "gemm: B")?.device_ptr(&stream);
    let (pd, _gd) = cuda_slice_mut(c, "gemm: C")?.device_ptr_mut(&stream);
    let mm = ColMajorMatmul {
        key,
        a: pb,
        b: pa,
        d: pd + (c_offset * std::mem::size_of::<O>()) as u64,
        alpha: spec.alpha,
        beta: spec.beta,
        a_scale: None,
        b_scale: None,
    };
    // SAFETY: A, B and C are buffers of this device whose lengths `mod.rs` checked against the shape the
    // key describes (the row-major [m, k], [k, n], [m, n] are the column-major transposes; C's m x n
    // elements from `c_offset` lie inside its buffer at a 256-byte aligned address); the guards keep them
    // ordered on the stream until the call returns.
    unsafe { blas.run(dev, &mm) }
}

/// The device address of a scale (index checked against the buffer).
fn scalar_ptr(
    what: &'static str,
    s: &DeviceScalar<'_>,
    stream: &CudaStream,
) -> Result<u64, KernelError> {
    let slice = cuda_slice(s.buffer, what)?;
    if s.index >= slice.len() {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("scale index {} out of {}", s.index, slice.len()),
        });
    }
    let (p, _g) = slice.device_ptr(stream);
    Ok(p + (s.index * std::mem::size_of::<f32>()) as u64)
}

/// FP8 GEMM through cuBLASLt, re-laying out or padding operands that break its FP8 rules.
pub(super) fn gemm_fp8<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    gemm_fp8_at(dev, spec, a, b, c, 0)
}

/// [`gemm_fp8`] into `C`'s `m x n` elements from element `c_offset` of `c`: only where m, n and k are
/// multiples of 16 (the product goes straight to `C`; `mod.rs` checked that, the range and the alignment).
pub(super) fn gemm_fp8_at<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
    c_offset: usize,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    for (what, d) in [
        ("gemm_fp8: A", a.data.device()),
        ("gemm_fp8: B", b.data.device()),
        ("gemm_fp8: A scale", a.scale_inv.buffer.device()),
        ("gemm_fp8: B scale", b.scale_inv.buffer.device()),
    ] {
        same_device(what, dev, &d)?;
    }
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if a.format == Fp8Format::E5M2 && b.format == Fp8Format::E5M2 {
        return gemm_e5m2_pair_as_bf16(dev, spec, a, b, c, c_offset);
    }
    let stream = dev.stream().clone();
    let fits = [m, n, k]
        .iter()
        .all(|&d| d > 0 && d % FP8_DIM_MULTIPLE == 0);
    let pad = |d: usize| d.div_ceil(FP8_DIM_MULTIPLE).max(1) * FP8_DIM_MULTIPLE;
    let (mp, np, kp) = if fits {
        (m, n, k)
    } else {
        (pad(m), pad(n), pad(k))
    };
    if !fits && c_offset != 0 {
        return Err(KernelError::Internal(
            "a padded FP8 GEMM into a range of C".into(),
        ));
    }

    let a_src = cuda_slice(a.data, "gemm_fp8: A")?;
    let b_src = cuda_slice(b.data, "gemm_fp8: B")?;
    // A must be [m, k] row-major (K-major), B must be [n, k] row-major.
    let a_tmp = if fits && !spec.trans_a.is_yes() {
        None
    } else {
        let src = if spec.trans_a.is_yes() {
            [k, m]
        } else {
            [m, k]
        };
        Some(relayout_u8(
            dev,
            a_src,
            src,
            spec.trans_a.is_yes(),
            [mp, kp],
        )?)
    };
    let b_tmp = if fits && spec.trans_b.is_yes() {
        None
    } else {
        let src = if spec.trans_b.is_yes() {
            [n, k]
        } else {
            [k, n]
        };
        Some(relayout_u8(
            dev,
            b_src,
            src,
            !spec.trans_b.is_yes(),
            [np, kp],
        )?)
    };
    let a_use = a_tmp.as_ref().unwrap_or(a_src);
    let b_use = b_tmp.as_ref().unwrap_or(b_src);
    let sa = scalar_ptr("gemm_fp8: A scale", &a.scale_inv, &stream)?;
    let sb = scalar_ptr("gemm_fp8: B scale", &b.scale_inv, &stream)?;
    let blas = BlasLt::for_device(dev)?;
    let (pa, _ga) = a_use.device_ptr(&stream);
    let (pb, _gb) = b_use.device_ptr(&stream);
    let key = |cd_type| -> Result<PlanKey, KernelError> {
        Ok(PlanKey {
            a_type: fp8_type(b.format),
            b_type: fp8_type(a.format),
            cd_type,
            compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            trans_a: true,
            trans_b: false,
            m: np as u64,
            n: mp as u64,
            k: kp as u64,
            lda: to_i64("gemm", kp)?,
            ldb: to_i64("gemm", kp)?,
            ldd: to_i64("gemm", np)?,
            scaled: true,
            fast_accum: spec.fp8_fast_accum,
            a_scale_mode: SCALE_SCALAR,
            b_scale_mode: SCALE_SCALAR,
        })
    };
    if fits {
        let key = key(cuda_type(O::DTYPE)?)?;
        let (pd, _gd) = cuda_slice_mut(c, "gemm_fp8: C")?.device_ptr_mut(&stream);
        let mm = ColMajorMatmul {
            key,
            a: pb,
            b: pa,
            d: pd + (c_offset * std::mem::size_of::<O>()) as u64,
            alpha: spec.alpha,
            beta: spec.beta,
            a_scale: Some(sb),
            b_scale: Some(sa),
        };
        // SAFETY: the operands are [m, k] and [n, k] K-major codes of this device (lengths checked by
        // `mod.rs`, layout by `fits` and the transposes), C holds [m, n] from `c_offset` (range and
        // 256-byte alignment checked by `mod.rs`); the scale addresses point into
        // the scale buffers (indices checked by `scalar_ptr`), which the caller holds across the call.
        unsafe { blas.run(dev, &mm) }
    } else {
        let key = key(sys::cudaDataType_t::CUDA_R_32F)?;
        // SAFETY: the GEMM below writes every element (beta = 0).
        let mut tmp = unsafe { stream.alloc::<f32>(mp * np) }?;
        {
            let (pd, _gd) = tmp.device_ptr_mut(&stream);
            let mm = ColMajorMatmul {
                key,
                a: pb,
                b: pa,
                d: pd,
                alpha: spec.alpha,
                beta: 0.0,
                a_scale: Some(sb),
                b_scale: Some(sa),
            };
            // SAFETY: the padded operands are [mp, kp] and [np, kp] codes written by `relayout_u8`, the
            // temporary holds [mp, np] f32; the scale addresses as in the direct path.
            unsafe { blas.run(dev, &mm) }?;
        }
        unpad_into(dev, &tmp, np, m, n, spec.beta, c)
    }
}

/// E5M2 x E5M2 has no cuBLASLt FP8 kernel: dequantize both to BF16 (exact for power-of-two scales) and
/// run a BF16 GEMM.
fn gemm_e5m2_pair_as_bf16<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
    c_offset: usize,
) -> Result<(), KernelError> {
    let a16 = fp8_to_bf16(dev, &a)?;
    let b16 = fp8_to_bf16(dev, &b)?;
    gemm_float_at(dev, spec, &a16, &b16, c, c_offset)
}

/// `decode(codes) * scale_inv` rounded to bf16, in a new buffer.
fn fp8_to_bf16(dev: &CudaDevice, x: &Fp8Matrix<'_>) -> Result<Buffer<bf16>, KernelError> {
    let n = x.data.len();
    let mut out = Device::Cuda(dev.clone()).zeros::<bf16>(n)?;
    let format: i32 = match x.format {
        Fp8Format::E4M3 => 0,
        Fp8Format::E5M2 => 1,
    };
    let (idx, len) = (to_i64("gemm", x.scale_inv.index)?, to_i64("gemm", n)?);
    let src = cuda_slice(x.data, "gemm_fp8")?;
    let scales = cuda_slice(x.scale_inv.buffer, "gemm_fp8 scale")?;
    let dst = cuda_slice_mut(&mut out, "gemm_fp8")?;
    // The scale index lies inside its buffer (DeviceScalar::new checks it).
    launch!(
        dev,
        &GEMM_LAYOUT_MODULE,
        "gemm_fp8_to_bf16",
        elementwise_grid(n),
        "gemm_fp8_to_bf16(const u8* src, int format, const float* scale_inv, long long scale_idx, u16* dst, \
         long long n)",
        [src, &format, scales, &idx, dst, &len]
    )?;
    Ok(out)
}
