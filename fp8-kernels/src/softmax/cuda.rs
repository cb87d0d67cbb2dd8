//! Launches of the softmax kernels (`softmax.cu`). `mod.rs` validated every argument.

use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::SOFTMAX_MODULE;
use crate::launch::{grid, launch, one_block};
use crate::{Buffer, CudaDevice, KernelError};

/// Threads of the one block of `nll_stats` (its shared arrays are sized for it: `NLL_THREADS`).
const NLL_THREADS: u32 = 256;

/// One warp per row.
pub(super) fn log_softmax(
    dev: &CudaDevice,
    logits: &Buffer<f32>,
    rows: usize,
    classes: usize,
    log_probs: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "log_softmax_forward";
    let cfg = grid(dev, rows as u64 * 32);
    let (r, c) = (rows as u64, classes as u64);
    let (xs, os) = (cs(logits, WHAT)?, cs_mut(log_probs, WHAT)?);
    launch!(
        dev,
        &SOFTMAX_MODULE,
        "log_softmax_fwd",
        cfg,
        "log_softmax_fwd(const float* x, float* lp, u64 rows, u64 classes)",
        [xs, os, &r, &c]
    )
}

/// One block with a fixed reduction tree.
pub(super) fn nll_stats(
    dev: &CudaDevice,
    log_probs: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    stats: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "nll_loss_stats";
    let (r, c) = (rows as u64, classes as u64);
    let (lp, ls, ss) = (
        cs(log_probs, WHAT)?,
        cs(labels, WHAT)?,
        cs_mut(stats, WHAT)?,
    );
    launch!(
        dev,
        &SOFTMAX_MODULE,
        "nll_stats",
        one_block(NLL_THREADS),
        "nll_stats(const float* lp, const int* labels, float* stats, u64 rows, u64 classes)",
        [lp, ls, ss, &r, &c]
    )
}

pub(super) fn log_softmax_nll_backward(
    dev: &CudaDevice,
    log_probs: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    g: f32,
    dlogits: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "log_softmax_nll_backward";
    let n = log_probs.len() as u64;
    let cfg = grid(dev, n);
    let (r, c) = (rows as u64, classes as u64);
    let (lp, ls, ds) = (
        cs(log_probs, WHAT)?,
        cs(labels, WHAT)?,
        cs_mut(dlogits, WHAT)?,
    );
    launch!(
        dev,
        &SOFTMAX_MODULE,
        "log_softmax_nll_bwd",
        cfg,
        "log_softmax_nll_bwd(const float* lp, const int* labels, float* dx, u64 rows, u64 classes, \
         float grad_scale)",
        [lp, ls, ds, &r, &c, &g]
    )
}
