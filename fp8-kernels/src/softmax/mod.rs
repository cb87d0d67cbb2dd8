//! Log-softmax over the rows of f32 logits, the negative log-likelihood statistics of log-probabilities
//! (kept on the device), and the gradient of their composition (a classification loss).
//!
//! Row sums of exponentials use the warp order of [`crate::reduce::warp_order_sum`] on both devices; the
//! results differ between CPU (`cpu.rs`) and CUDA (`cuda.rs`, `softmax.cu`) only by the ulps of `exp` and
//! `log`; counts are exact.

mod cpu;
mod cuda;

use crate::device::{dispatch, shape_len};
use crate::{check_len, Buffer, KernelError};

/// Log-softmax over the rows of `[rows, classes]` logits: `lp = x - max - log(sum exp(x - max))`.
pub fn log_softmax_forward(
    logits: &Buffer<f32>,
    rows: usize,
    classes: usize,
    log_probs: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "log_softmax_forward";
    check_len(WHAT, shape_len(WHAT, &[rows, classes])?, logits.len())?;
    check_len(WHAT, logits.len(), log_probs.len())?;
    dispatch!(WHAT, [logits, log_probs],
    cpu: if classes > 0 {
        cpu::log_softmax(logits.host(WHAT)?, classes, log_probs.host_mut(WHAT)?);
    },
    cuda(dev): {
        let (xs, lp) = (logits.cuda(WHAT)?, log_probs.cuda_mut(WHAT)?);
        cuda::log_softmax(&dev, xs, rows, classes, lp)
    })
}

/// Indexes into the stats buffer of [`nll_loss_stats`].
pub mod nll_stat {
    /// Mean negative log-likelihood over the rows with a valid label, divided by all rows.
    pub const MEAN_LOSS: usize = 0;
    /// Rows whose argmax (first maximum) equals the label.
    pub const CORRECT: usize = 1;
    /// Rows whose label is outside `0..classes` (they add nothing to the loss).
    pub const INVALID_LABELS: usize = 2;
    /// Length of the stats buffer.
    pub const LEN: usize = 3;
}

/// NLL statistics of log-probabilities: `stats = [mean loss, correct predictions, invalid labels]` (see
/// [`nll_stat`]), left on the device so the host reads them only when it wants to. On the CPU an invalid
/// label is an error; on CUDA it is counted in `stats[INVALID_LABELS]` (checking would need the host).
pub fn nll_loss_stats(
    log_probs: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    stats: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "nll_loss_stats";
    check_len(WHAT, shape_len(WHAT, &[rows, classes])?, log_probs.len())?;
    check_len(WHAT, rows, labels.len())?;
    check_len(WHAT, nll_stat::LEN, stats.len())?;
    dispatch!(WHAT, [log_probs, labels, stats],
    cpu: {
        let [mean, correct] =
            cpu::nll_stats(WHAT, log_probs.host(WHAT)?, labels.host(WHAT)?, classes)?;
        let s = stats.host_mut(WHAT)?;
        s[nll_stat::MEAN_LOSS] = mean;
        s[nll_stat::CORRECT] = correct;
        s[nll_stat::INVALID_LABELS] = 0.0;
    },
    cuda(dev): {
        let (lp, ls) = (log_probs.cuda(WHAT)?, labels.cuda(WHAT)?);
        cuda::nll_stats(&dev, lp, ls, rows, classes, stats.cuda_mut(WHAT)?)
    })
}

/// Log-softmax then NLL statistics: the forward pass of a classification loss.
pub fn log_softmax_nll_forward(
    logits: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    log_probs: &mut Buffer<f32>,
    stats: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    log_softmax_forward(logits, rows, classes, log_probs)?;
    nll_loss_stats(log_probs, labels, rows, classes, stats)
}

/// Gradient of the mean NLL of log-softmax with respect to the logits:
/// `dlogits = (exp(lp) - onehot(label)) / rows`.
pub fn log_softmax_nll_backward(
    log_probs: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    dlogits: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "log_softmax_nll_backward";
    check_len(WHAT, shape_len(WHAT, &[rows, classes])?, log_probs.len())?;
    check_len(WHAT, rows, labels.len())?;
    check_len(WHAT, log_probs.len(), dlogits.len())?;
    let g = if rows > 0 { 1.0 / rows as f32 } else { 0.0 };
    dispatch!(WHAT, [log_probs, labels, dlogits],
    cpu: if classes > 0 {
        let (lp, ls) = (log_probs.host(WHAT)?, labels.host(WHAT)?);
        cpu::log_softmax_nll_backward(lp, ls, classes, g, dlogits.host_mut(WHAT)?);
    },
    cuda(dev): {
        let (lp, ls) = (log_probs.cuda(WHAT)?, labels.cuda(WHAT)?);
        cuda::log_softmax_nll_backward(&dev, lp, ls, rows, classes, g, dlogits.cuda_mut(WHAT)?)
    })
}
