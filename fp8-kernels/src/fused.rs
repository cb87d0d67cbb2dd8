//! GELU fused with the FP8 cast of its result (the input of an FP8 GEMM that follows a GELU): one pass
//! over the activations instead of two in each direction.
//!
//! - forward, [`gelu_cast_fp8`]: `h = gelu(u)` is cast with a device-resident scale into row-major codes
//!   and the codes of `h^T` (the operands of the FP8 forward GEMM and of the weight-gradient GEMM), and the
//!   amax of `h` accumulates into a device slot; `h` itself is never written.
//! - backward, [`gelu_backward_cast_fp8`]: `du = gelu'(u) * dh` is cast the same way (E5M2 for the
//!   output gradient; both layouts, as the two backward GEMMs consume them).
//!
//! Bit-identity: each value is computed with [`crate::ops::gelu_scalar`] / [`crate::ops::gelu_grad_scalar`]
//! (the CUDA kernels with ops.cu's expression), rounded to the element type `T` as the unfused
//! [`crate::ops::gelu_forward`] / [`crate::ops::gelu_backward`] store it, and then amax'ed and encoded as
//! [`crate::cast_transpose_to_fp8`] does. So the codes, transposed codes and amax equal those of the two
//! unfused kernels on the same device, bit for bit.

use crate::cast::{cuda_of, format_name, same_device, AmaxSlot, FloatElement};
use crate::kernel_source::{cast_transpose_launch, function, sm_count, KernelModule};
use crate::ops::{gelu_grad_scalar, gelu_scalar, GeluApprox};
use crate::{check_len, Buffer, Element, KernelError};
use cudarc::driver::{CudaSlice, PushKernelArg};
use fp8_core::Fp8Format;
use rayon::prelude::*;

/// The fused GELU + cast kernels: `common.cuh`, then `ops.cu` (its `erf_approx` and GELU constants),
/// then `fused.cu`.
pub const FUSED_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_fused",
    files: &["common.cuh", "ops.cu", "fused.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/ops.cu"),
        include_str!("../cuda/fused.cu")
    ),
};

/// Side of the square tiles of the CPU transpose and the CUDA kernels (as `cast_transpose_to_fp8`).
const TILE: usize = 32;
/// Rows per rayon task of the CPU elementwise pass.
const CPU_ROWS_TARGET: usize = 1 << 14;
/// A null device pointer (no amax output).
const NULL_PTR: u64 = 0;

/// What is cast: `gelu(u)` or `gelu'(u) * dh`.
#[derive(Clone, Copy)]
enum Value<'a, T> {
    Forward,
    Backward(&'a [T]),
}

fn check_shape(what: &'static str, shape: [usize; 2]) -> Result<usize, KernelError> {
    let [rows, cols] = shape;
    let n = rows
        .checked_mul(cols)
        .ok_or_else(|| KernelError::InvalidArgument {
            what,
            detail: format!("shape {rows}x{cols} overflows"),
        })?;
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("shape {rows}x{cols} exceeds the 32-bit index range"),
        });
    }
    Ok(n)
}

fn cslice<'a, T: Element>(
    b: &'a Buffer<T>,
    what: &'static str,
) -> Result<&'a CudaSlice<T>, KernelError> {
    b.as_cuda()
        .map(|(s, _)| s)
        .ok_or(KernelError::WrongDevice(what))
}

fn cslice_mut<'a, T: Element>(
    b: &'a mut Buffer<T>,
    what: &'static str,
) -> Result<&'a mut CudaSlice<T>, KernelError> {
    b.as_cuda_mut()
        .map(|(s, _)| s)
        .ok_or(KernelError::WrongDevice(what))
}

/// CPU: row-major codes and the amax of the values (NaN never raises it, as in `cast`).
fn cpu_values_cast<T: FloatElement>(
    u: &[T],
    value: Value<'_, T>,
    approx: GeluApprox,
    format: Fp8Format,
    scale: f32,
    out: &mut [u8],
) -> f32 {
    let run = |i0: usize, d: &mut [u8]| {
        let mut a = 0.0f32;
        for (k, o) in d.iter_mut().enumerate() {
            let i = i0 + k;
            let v = u[i].to_f32();
            let h = match value {
                Value::Forward => T::from_f32(gelu_scalar(v, approx)),
                Value::Backward(dh) => T::from_f32(gelu_grad_scalar(v, approx) * dh[i].to_f32()),
            }
            .to_f32();
            a = a.max(h.abs());
            *o = format.encode(h * scale);
        }
        a
    };
    if out.len() < CPU_ROWS_TARGET {
        run(0, out)
    } else {
        out.par_chunks_mut(CPU_ROWS_TARGET)
            .enumerate()
            .map(|(c, d)| run(c * CPU_ROWS_TARGET, d))
            .reduce(|| 0.0, f32::max)
    }
}

/// CPU: `yt [cols, rows] = y^T` for row-major `y [rows, cols]` bytes, in bands of `TILE` output rows.
fn cpu_transpose_codes(y: &[u8], rows: usize, cols: usize, yt: &mut [u8]) {
    if rows == 0 || cols == 0 {
        return;
    }
    yt.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(band, out)| {
            let c0 = band * TILE;
            let cw = out.len() / rows;
            for r in 0..rows {
                let row = &y[r * cols + c0..r * cols + c0 + cw];
                for (dc, &v) in row.iter().enumerate() {
                    out[dc * rows + r] = v;
                }
            }
        });
}

#[allow(clippy::too_many_arguments)]
fn run_fused<T: FloatElement>(
    what: &'static str,
    u: &Buffer<T>,
    dh: Option<&Buffer<T>>,
    shape: [usize; 2],
    approx: GeluApprox,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: &mut Buffer<u8>,
    out_t: &mut Buffer<u8>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    let n = check_shape(what, shape)?;
    let [rows, cols] = shape;
    check_len(what, n, u.len())?;
    if let Some(g) = dh {
        check_len(what, n, g.len())?;
    }
    check_len(what, n, out.len())?;
    check_len(what, n, out_t.len())?;
    if scale.is_empty() {
        return Err(KernelError::InvalidArgument {
            what,
            detail: "scale buffer is empty".into(),
        });
    }
    if let Some(a) = &amax {
        if a.slot >= a.buffer.len() {
            return Err(KernelError::InvalidArgument {
                what,
                detail: format!(
                    "amax slot {} outside a buffer of {}",
                    a.slot,
                    a.buffer.len()
                ),
            });
        }
    }
    let dev = cuda_of(u);
    if let Some(g) = dh {
        same_device(what, &dev, g)?;
    }
    same_device(what, &dev, scale)?;
    same_device(what, &dev, out)?;
    same_device(what, &dev, out_t)?;
    if let Some(a) = &amax {
        same_device(what, &dev, a.buffer)?;
    }
    match dev {
        None => {
            let s = scale.host(what)?[0];
            let value = match dh {
                Some(g) => Value::Backward(g.host(what)?),
                None => Value::Forward,
            };
            let a = cpu_values_cast(u.host(what)?, value, approx, format, s, out.host_mut(what)?);
            cpu_transpose_codes(out.host(what)?, rows, cols, out_t.host_mut(what)?);
            if let Some(slot) = amax {
                let v = &mut slot.buffer.host_mut(what)?[slot.slot];
                *v = v.max(a);
            }
            Ok(())
        }
        Some(dev) => {
            dev.require_fp8()?;
            let kind = if dh.is_some() { "gelu_bwd" } else { "gelu" };
            let name = format!("{kind}_cast_transpose_{}_{}", T::NAME, format_name(format));
            let f = function(&dev, &FUSED_MODULE, &name)?;
            let cfg = cast_transpose_launch(sm_count(&dev)?, rows, cols);
            let (r, c) = (rows as i32, cols as i32);
            let exact = (approx == GeluApprox::Erf) as i32;
            let us = cslice(u, what)?;
            let ss = cslice(scale, what)?;
            let ys = cslice_mut(out, what)?;
            let yt = cslice_mut(out_t, what)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(us);
            if let Some(g) = dh {
                b.arg(cslice(g, what)?);
            }
            b.arg(ys).arg(yt).arg(ss);
            let slot: i32;
            match amax {
                Some(a) => {
                    slot = a.slot as i32;
                    b.arg(cslice_mut(a.buffer, what)?);
                }
                None => {
                    slot = 0;
                    b.arg(&NULL_PTR);
                }
            }
            b.arg(&slot).arg(&r).arg(&c).arg(&exact);
            // SAFETY: `gelu[_bwd]_cast_transpose_<T>_<fmt>(const T* x, [const T* dy,] u8* y, u8* yt,
            // const float* scale, float* amax or null, int slot, int rows, int cols, int exact)`; every
            // buffer holds rows*cols elements (checked above), scale at least one, the slot is in bounds.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Forward: `h = gelu(u)` for row-major `u [rows, cols]`, rounded to `T`, cast to `format` with
/// `scale[0]` (read on the device) into `out` (`[rows, cols]`) and `out_t` (`h^T`, `[cols, rows]`); the
/// amax of `h` accumulates into `amax` when given. Equal bit for bit to [`crate::ops::gelu_forward`] into a
/// `T` buffer followed by [`crate::cast_transpose_to_fp8`] of it.
#[allow(clippy::too_many_arguments)]
pub fn gelu_cast_fp8<T: FloatElement>(
    u: &Buffer<T>,
    shape: [usize; 2],
    approx: GeluApprox,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: &mut Buffer<u8>,
    out_t: &mut Buffer<u8>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    run_fused(
        "gelu_cast_fp8",
        u,
        None,
        shape,
        approx,
        format,
        scale,
        out,
        out_t,
        amax,
    )
}

/// Backward: `du = gelu'(u) * dh` (row-major `[rows, cols]`), rounded to `T`, cast to `format` with
/// `scale[0]` into `out` and `out_t` (`du^T`); the amax of `du` accumulates into `amax` when given.
/// Equal bit for bit to [`crate::ops::gelu_backward`] into a `T` buffer followed by
/// [`crate::cast_transpose_to_fp8`] of it.
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward_cast_fp8<T: FloatElement>(
    u: &Buffer<T>,
    dh: &Buffer<T>,
    shape: [usize; 2],
    approx: GeluApprox,
    format: Fp8Format,
    scale: &Buffer<f32>,
    out: &mut Buffer<u8>,
    out_t: &mut Buffer<u8>,
    amax: Option<AmaxSlot<'_>>,
) -> Result<(), KernelError> {
    run_fused(
        "gelu_backward_cast_fp8",
        u,
        Some(dh),
        shape,
        approx,
        format,
        scale,
        out,
        out_t,
        amax,
    )
}
