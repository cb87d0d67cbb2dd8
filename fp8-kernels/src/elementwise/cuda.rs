//! Launches of the element-wise kernels (`elementwise.cu`): grid-stride loops over the elements.
//! `mod.rs` validated every argument (lengths, devices, parameters).

use super::{Dropout, GeluApprox};
use crate::kernel_source::ELEMENTWISE_MODULE;
use crate::launch::{grid, kernel_name, launch};
use crate::{CudaDevice, FloatElement, KernelError};
use cudarc::driver::CudaSlice;

pub(super) fn bias_add<T: FloatElement>(
    dev: &CudaDevice,
    x: &mut CudaSlice<T>,
    bias: &CudaSlice<T>,
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    let (r, c) = (rows as u64, cols as u64);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("bias_add_", T::NAME),
        grid(dev, r * c),
        "bias_add_<T>(T* x, const T* b, u64 rows, u64 cols)",
        [x, bias, &r, &c]
    )
}

pub(super) fn relu_forward<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    y: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("relu_fwd_", T::NAME),
        grid(dev, n),
        "relu_fwd_<T>(const T* x, T* y, u64 n)",
        [x, y, &n]
    )
}

pub(super) fn relu_backward<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    dy: &CudaSlice<T>,
    dx: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("relu_bwd_", T::NAME),
        grid(dev, n),
        "relu_bwd_<T>(const T* x, const T* dy, T* dx, u64 n)",
        [x, dy, dx, &n]
    )
}

pub(super) fn gelu_forward<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    y: &mut CudaSlice<T>,
    approx: GeluApprox,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    let exact = (approx == GeluApprox::Erf) as i32;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("gelu_fwd_", T::NAME),
        grid(dev, n),
        "gelu_fwd_<T>(const T* x, T* y, u64 n, int exact)",
        [x, y, &n, &exact]
    )
}

pub(super) fn gelu_backward<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    dy: &CudaSlice<T>,
    dx: &mut CudaSlice<T>,
    approx: GeluApprox,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    let exact = (approx == GeluApprox::Erf) as i32;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("gelu_bwd_", T::NAME),
        grid(dev, n),
        "gelu_bwd_<T>(const T* x, const T* dy, T* dx, u64 n, int exact)",
        [x, dy, dx, &n, &exact]
    )
}

pub(super) fn dropout_forward<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    params: Dropout,
    y: &mut CudaSlice<T>,
    mask: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    let (seed, offset) = (params.seed, params.offset);
    let (thr, scale) = (params.threshold(), params.keep_scale());
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("dropout_fwd_", T::NAME),
        grid(dev, n),
        "dropout_fwd_<T>(const T* x, T* y, u8* mask, u64 n, u64 seed, u64 offset, u32 threshold, \
         float scale)",
        [x, y, mask, &n, &seed, &offset, &thr, &scale]
    )
}

pub(super) fn dropout_backward<T: FloatElement>(
    dev: &CudaDevice,
    dy: &CudaSlice<T>,
    mask: &CudaSlice<u8>,
    scale: f32,
    dx: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let n = dy.len() as u64;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("dropout_bwd_", T::NAME),
        grid(dev, n),
        "dropout_bwd_<T>(const T* dy, const u8* mask, T* dx, u64 n, float scale)",
        [dy, mask, dx, &n, &scale]
    )
}

pub(super) fn scale<T: FloatElement>(
    dev: &CudaDevice,
    x: &mut CudaSlice<T>,
    a: f32,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("scale_", T::NAME),
        grid(dev, n),
        "scale_<T>(T* x, u64 n, float a)",
        [x, &n, &a]
    )
}

pub(super) fn axpy<T: FloatElement>(
    dev: &CudaDevice,
    a: f32,
    x: &CudaSlice<T>,
    y: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let n = x.len() as u64;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("axpy_", T::NAME),
        grid(dev, n),
        "axpy_<T>(const T* x, T* y, u64 n, float a)",
        [x, y, &n, &a]
    )
}

pub(super) fn add<T: FloatElement>(
    dev: &CudaDevice,
    a: &CudaSlice<T>,
    b: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let n = a.len() as u64;
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        kernel_name!("add_", T::NAME),
        grid(dev, n),
        "add_<T>(const T* a, const T* b, T* out, u64 n)",
        [a, b, out, &n]
    )
}

pub(super) fn add_at<D: FloatElement, S: FloatElement>(
    dev: &CudaDevice,
    dst: &mut CudaSlice<D>,
    offset: usize,
    src: &CudaSlice<S>,
) -> Result<(), KernelError> {
    let name = match D::NAME {
        "f32" => kernel_name!("add_at_", S::NAME),
        "bf16" => kernel_name!("add_at_", S::NAME, "_to_bf16"),
        other => {
            return Err(KernelError::InvalidArgument {
                what: "add_at",
                detail: format!("{other} destinations are not supported"),
            })
        }
    };
    let (n, o) = (src.len() as u64, offset as u64);
    launch!(
        dev,
        &ELEMENTWISE_MODULE,
        name,
        grid(dev, n),
        "add_at_<S>[_to_bf16](D* dst, u64 offset, const S* src, u64 n)",
        [dst, &o, src, &n]
    )
}
