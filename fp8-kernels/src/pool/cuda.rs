//! Launches of the pooling kernels (`pool.cu`). `mod.rs` validated the geometry and every length.

use super::Pool2dGeometry;
use crate::kernel_source::POOL_MODULE;
use crate::launch::{grid, launch};
use crate::{CudaDevice, KernelError};
use cudarc::driver::{CudaSlice, DeviceRepr};

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
    x: &CudaSlice<f32>,
    geom: &Pool2dGeometry,
    y: &mut CudaSlice<f32>,
    indices: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    let cfg = grid(dev, geom.output_len() as u64);
    let g = repr(geom);
    launch!(
        dev,
        &POOL_MODULE,
        "maxpool_fwd_f32",
        cfg,
        "maxpool_fwd_f32(const float* x, float* y, u32* idx, PoolGeom g)",
        [x, y, indices, &g]
    )
}

/// `dx` zeroed, then one atomic add per gradient element.
pub(super) fn max_pool2d_backward(
    dev: &CudaDevice,
    dy: &CudaSlice<f32>,
    indices: &CudaSlice<u32>,
    dx: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    dev.stream().memset_zeros(dx)?;
    let n = dy.len() as u64;
    let cfg = grid(dev, n);
    launch!(
        dev,
        &POOL_MODULE,
        "maxpool_bwd_f32",
        cfg,
        "maxpool_bwd_f32(const float* dy, const u32* idx, float* dx, u64 n)",
        [dy, indices, dx, &n]
    )
}
