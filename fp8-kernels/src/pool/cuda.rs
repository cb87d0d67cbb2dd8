//! Launches of the pooling kernels (`pool.cu`). `mod.rs` validated the geometry and every length.

use super::Pool2dGeometry;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::POOL_MODULE;
use crate::launch::{grid, launch};
use crate::{Buffer, CudaDevice, KernelError};
use cudarc::driver::DeviceRepr;

/// The kernel-side copy of [`Pool2dGeometry`] (`PoolGeom` in pool.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PoolGeomRepr {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    k: i32,
    stride: i32,
    oh: i32,
    ow: i32,
}

// SAFETY: a #[repr(C)] struct of eight i32, laid out exactly like `struct PoolGeom` in pool.cu.
unsafe impl DeviceRepr for PoolGeomRepr {}

/// The geometry as the kernels take it (validated by `mod.rs`: every value fits in i32).
fn repr(g: &Pool2dGeometry) -> PoolGeomRepr {
    PoolGeomRepr {
        n: g.batch as i32,
        c: g.channels as i32,
        h: g.height as i32,
        w: g.width as i32,
        k: g.kernel as i32,
        stride: g.stride as i32,
        oh: g.out_h() as i32,
        ow: g.out_w() as i32,
    }
}

pub(super) fn max_pool2d_forward(
    dev: &CudaDevice,
    x: &Buffer<f32>,
    geom: &Pool2dGeometry,
    y: &mut Buffer<f32>,
    indices: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "max_pool2d_forward";
    let cfg = grid(dev, geom.output_len() as u64);
    let g = repr(geom);
    let (xs, ys, is) = (cs(x, WHAT)?, cs_mut(y, WHAT)?, cs_mut(indices, WHAT)?);
    launch!(
        dev,
        &POOL_MODULE,
        "maxpool_fwd_f32",
        cfg,
        "maxpool_fwd_f32(const float* x, float* y, u32* idx, PoolGeom g)",
        [xs, ys, is, &g]
    )
}

/// `dx` zeroed, then one atomic add per gradient element.
pub(super) fn max_pool2d_backward(
    dev: &CudaDevice,
    dy: &Buffer<f32>,
    indices: &Buffer<u32>,
    dx: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "max_pool2d_backward";
    dx.fill_zero()?;
    let n = dy.len() as u64;
    let cfg = grid(dev, n);
    let (gs, is, ds) = (cs(dy, WHAT)?, cs(indices, WHAT)?, cs_mut(dx, WHAT)?);
    launch!(
        dev,
        &POOL_MODULE,
        "maxpool_bwd_f32",
        cfg,
        "maxpool_bwd_f32(const float* dy, const u32* idx, float* dx, u64 n)",
        [gs, is, ds, &n]
    )
}
