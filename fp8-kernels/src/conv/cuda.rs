//! Launches of the conv kernels (`conv.cu`). `mod.rs` validated the geometry and every length.

use super::Conv2dGeometry;
use crate::kernel_source::CONV_MODULE;
use crate::launch::{grid, kernel_name, launch};
use crate::{CudaDevice, FloatElement, KernelError};
use cudarc::driver::{CudaSlice, DeviceRepr};

/// The kernel-side copy of [`Conv2dGeometry`] (`ConvGeom` in conv.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ConvGeomRepr {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    kh: i32,
    kw: i32,
    stride: i32,
    pad: i32,
    oh: i32,
    ow: i32,
}

// SAFETY: a #[repr(C)] struct of ten i32, laid out exactly like `struct ConvGeom` in conv.cu.
unsafe impl DeviceRepr for ConvGeomRepr {}

/// The geometry as the kernels take it (validated by `mod.rs`: every value fits in i32).
fn repr(g: &Conv2dGeometry) -> ConvGeomRepr {
    ConvGeomRepr {
        n: g.batch as i32,
        c: g.channels as i32,
        h: g.height as i32,
        w: g.width as i32,
        kh: g.kernel_h as i32,
        kw: g.kernel_w as i32,
        stride: g.stride as i32,
        pad: g.padding as i32,
        oh: g.out_h() as i32,
        ow: g.out_w() as i32,
    }
}

pub(super) fn im2col(
    dev: &CudaDevice,
    x: &CudaSlice<f32>,
    geom: &Conv2dGeometry,
    cols: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let g = repr(geom);
    launch!(
        dev,
        &CONV_MODULE,
        "im2col_f32",
        grid(dev, (geom.patches() * geom.patch_len()) as u64),
        "im2col_f32(const float* x, float* cols, ConvGeom g)",
        [x, cols, &g]
    )
}

pub(super) fn col2im(
    dev: &CudaDevice,
    cols: &CudaSlice<f32>,
    geom: &Conv2dGeometry,
    dx: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let g = repr(geom);
    launch!(
        dev,
        &CONV_MODULE,
        "col2im_f32",
        grid(dev, geom.input_len() as u64),
        "col2im_f32(const float* cols, float* dx, ConvGeom g)",
        [cols, dx, &g]
    )
}

pub(super) fn transpose_batched<T: FloatElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    [batch, rows, cols]: [usize; 3],
    y: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let (b, r, c) = (batch as u64, rows as u64, cols as u64);
    launch!(
        dev,
        &CONV_MODULE,
        kernel_name!("transpose_batched_", T::NAME),
        grid(dev, b * r * c),
        "transpose_batched_<T>(const T* x, T* y, u64 batch, u64 rows, u64 cols)",
        [x, y, &b, &r, &c]
    )
}
