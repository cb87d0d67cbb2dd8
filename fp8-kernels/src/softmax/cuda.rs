//! Launches of the softmax kernels (`softmax.cu`). `mod.rs` validated every argument.

use crate::kernel_source::SOFTMAX_MODULE;
use crate::launch::{grid, launch, one_block};
use crate::{CudaDevice, KernelError};
use cudarc::driver::CudaSlice;

/// Threads of the one block of `nll_stats` (its shared arrays are sized for it: `NLL_THREADS`).
const NLL_THREADS: u32 = 256;

/// One warp per row.
pub(super) fn log_softmax(
    dev: &CudaDevice,
    logits: &CudaSlice<f32>,
    rows: usize,
    classes: usize,
    log_probs: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let (r, c) = (rows as u64, classes as u64);
    launch!(
        dev,
        &SOFTMAX_MODULE,
        "log_softmax_fwd",
        grid(dev, r * 32),
        "log_softmax_fwd(const float* x, float* lp, u64 rows, u64 classes)",
        [logits, log_probs, &r, &c]
    )
}

/// One block with a fixed reduction tree.
pub(super) fn nll_stats(
    dev: &CudaDevice,
    log_probs: &CudaSlice<f32>,
    labels: &CudaSlice<i32>,
    rows: usize,
    classes: usize,
    stats: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let (r, c) = (rows as u64, classes as u64);
    launch!(
        dev,
        &SOFTMAX_MODULE,
        "nll_stats",
        one_block(NLL_THREADS),
        "nll_stats(const float* lp, const int* labels, float* stats, u64 rows, u64 classes)",
        [log_probs, labels, stats, &r, &c]
    )
}

pub(super) fn log_softmax_nll_backward(
    dev: &CudaDevice,
    log_probs: &CudaSlice<f32>,
    labels: &CudaSlice<i32>,
    rows: usize,
    classes: usize,
    g: f32,
    dlogits: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let (r, c) = (rows as u64, classes as u64);
    launch!(
        dev,
        &SOFTMAX_MODULE,
        "log_softmax_nll_bwd",
        grid(dev, log_probs.len() as u64),
        "log_softmax_nll_bwd(const float* lp, const int* labels, float* dx, u64 rows, u64 classes, \
         float grad_scale)",
        [log_probs, labels, dlogits, &r, &c, &g]
    )
}
