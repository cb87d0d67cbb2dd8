//! Launches of the element-wise kernels (`elementwise.cu`): grid-stride loops over the elements.
//! `mod.rs` validated every argument (lengths, devices, parameters).

use super::{Dropout, GeluApprox};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::ELEMENTWISE_MODULE;
use crate::launch::{grid, kernel_name, launch};
use crate::{Buffer, CudaDevice, FloatElement, KernelError};

pub(super) fn bias_add<T: FloatElement>(
    dev: &CudaDevice,
    x: &mut Buffer<T>,
    bias: &Buffer<T>,
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "bias_add";
    let cfg = grid(dev, (rows * cols) as u64);
    let (r, c) = (rows as u64, cols as u64);
    let (xs, bs) = (cs_mut(x, WHAT)?, cs(bias, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("bias_add_", T::NAME),
        cfg,
        "bias_add_<T>(T* x, const T* b, u64 rows, u64 cols)",
        [xs, bs, &r, &c]
    )
}

pub(super) fn relu_forward<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "relu_forward";
    let n = x.len() as u64;
    let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("relu_fwd_", T::NAME),
        grid(dev, n),
        "relu_fwd_<T>(const T* x, T* y, u64 n)",
        [xs, ys, &n]
    )
}

pub(super) fn relu_backward<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    dy: &Buffer<T>,
    dx: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "relu_backward";
    let n = x.len() as u64;
    let (xs, gs, ds) = (cs(x, WHAT)?, cs(dy, WHAT)?, cs_mut(dx, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("relu_bwd_", T::NAME),
        grid(dev, n),
        "relu_bwd_<T>(const T* x, const T* dy, T* dx, u64 n)",
        [xs, gs, ds, &n]
    )
}

pub(super) fn gelu_forward<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    y: &mut Buffer<T>,
    approx: GeluApprox,
) -> Result<(), KernelError> {
    const WHAT: &str = "gelu_forward";
    let n = x.len() as u64;
    let exact = (approx == GeluApprox::Erf) as i32;
    let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("gelu_fwd_", T::NAME),
        grid(dev, n),
        "gelu_fwd_<T>(const T* x, T* y, u64 n, int exact)",
        [xs, ys, &n, &exact]
    )
}

pub(super) fn gelu_backward<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    dy: &Buffer<T>,
    dx: &mut Buffer<T>,
    approx: GeluApprox,
) -> Result<(), KernelError> {
    const WHAT: &str = "gelu_backward";
    let n = x.len() as u64;
    let exact = (approx == GeluApprox::Erf) as i32;
    let (xs, gs, ds) = (cs(x, WHAT)?, cs(dy, WHAT)?, cs_mut(dx, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("gelu_bwd_", T::NAME),
        grid(dev, n),
        "gelu_bwd_<T>(const T* x, const T* dy, T* dx, u64 n, int exact)",
        [xs, gs, ds, &n, &exact]
    )
}

pub(super) fn dropout_forward<T: FloatElement>(
    dev: &CudaDevice,
    x: &Buffer<T>,
    params: Dropout,
    y: &mut Buffer<T>,
    mask: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "dropout_forward";
    let n = x.len() as u64;
    let (seed, offset) = (params.seed, params.offset);
    let (thr, scale) = (params.threshold(), params.keep_scale());
    let (xs, ys, ms) = (cs(x, WHAT)?, cs_mut(y, WHAT)?, cs_mut(mask, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("dropout_fwd_", T::NAME),
        grid(dev, n),
        "dropout_fwd_<T>(const T* x, T* y, u8* mask, u64 n, u64 seed, u64 offset, u32 threshold, \
         float scale)",
        [xs, ys, ms, &n, &seed, &offset, &thr, &scale]
    )
}

pub(super) fn dropout_backward<T: FloatElement>(
    dev: &CudaDevice,
    dy: &Buffer<T>,
    mask: &Buffer<u8>,
    scale: f32,
    dx: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "dropout_backward";
    let n = dy.len() as u64;
    let (gs, ms, ds) = (cs(dy, WHAT)?, cs(mask, WHAT)?, cs_mut(dx, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("dropout_bwd_", T::NAME),
        grid(dev, n),
        "dropout_bwd_<T>(const T* dy, const u8* mask, T* dx, u64 n, float scale)",
        [gs, ms, ds, &n, &scale]
    )
}

pub(super) fn scale<T: FloatElement>(
    dev: &CudaDevice,
    x: &mut Buffer<T>,
    a: f32,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    let xs = cs_mut(x, "scale")?;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("scale_", T::NAME),
        grid(dev, n),
        "scale_<T>(T* x, u64 n, float a)",
        [xs, &n, &a]
    )
}

pub(super) fn axpy<T: FloatElement>(
    dev: &CudaDevice,
    a: f32,
    x: &Buffer<T>,
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "axpy";
    let n = x.len() as u64;
    let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("axpy_", T::NAME),
        grid(dev, n),
        "axpy_<T>(const T* x, T* y, u64 n, float a)",
        [xs, ys, &n, &a]
    )
}

pub(super) fn add<T: FloatElement>(
    dev: &CudaDevice,
    a: &Buffer<T>,
    b: &Buffer<T>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add";
    let n = a.len() as u64;
    let (as_, bs, os) = (cs(a, WHAT)?, cs(b, WHAT)?, cs_mut(out, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("add_", T::NAME),
        grid(dev, n),
        "add_<T>(const T* a, const T* b, T* out, u64 n)",
        [as_, bs, os, &n]
    )
}

pub(super) fn add_at<D: FloatElement, S: FloatElement>(
    dev: &CudaDevice,
    dst: &mut Buffer<D>,
    offset: usize,
    src: &Buffer<S>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add_at";
    let name = match D::NAME {
        "f32" => kernel_name!("add_at_", S::NAME),
        "bf16" => kernel_name!("add_at_", S::NAME, "_to_bf16"),
        other => {
            return Err(KernelError::InvalidArgument {
                what: WHAT,
                detail: format!("{other} destinations are not supported"),
            })
        }
    };
    let n = src.len() as u64;
    let o = offset as u64;
    let (d, s) = (cs_mut(dst, WHAT)?, cs(src, WHAT)?);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        name,
        grid(dev, n),
        "add_at_<S>[_to_bf16](D* dst, u64 offset, const S* src, u64 n)",
        [d, &o, s, &n]
    )
}
