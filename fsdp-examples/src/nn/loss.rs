//! Log-softmax followed by the negative log-likelihood: the classification loss.

use super::{held, held_mut, reuse_buffer, NnError};
use fp8_kernels::ops::{self, nll_stat};
use fp8_kernels::Buffer;

/// `loss = mean_r -log_softmax(logits)[r, label_r]` over `[rows, classes]` logits, with the number of
/// correct predictions. The statistics stay on the device (`[mean loss, correct, invalid labels]`, see
/// [`fp8_kernels::ops::nll_stat`]) so a GPU step reads them only when the caller wants to.
#[derive(Debug)]
pub struct LogSoftmaxNll {
    classes: usize,
    rows: usize,
    log_probs: Option<Buffer<f32>>,
    stats: Option<Buffer<f32>>,
    dlogits: Option<Buffer<f32>>,
}

impl LogSoftmaxNll {
    /// A loss over `classes` classes.
    pub fn new(classes: usize) -> Result<Self, NnError> {
        if classes == 0 {
            return Err(NnError::usage("LogSoftmaxNll", "no classes"));
        }
        Ok(LogSoftmaxNll {
            classes,
            rows: 0,
            log_probs: None,
            stats: None,
            dlogits: None,
        })
    }

    /// Log-probabilities and statistics of `logits [rows, classes]` against `labels [rows]`. Returns the
    /// statistics buffer (index it with [`nll_stat`]).
    pub fn forward(
        &mut self,
        logits: &Buffer<f32>,
        labels: &Buffer<i32>,
    ) -> Result<&Buffer<f32>, NnError> {
        let rows = labels.len();
        if logits.len() != rows * self.classes {
            return Err(NnError::usage(
                "LogSoftmaxNll",
                format!(
                    "{} logits for {rows} labels of {} classes",
                    logits.len(),
                    self.classes
                ),
            ));
        }
        let dev = logits.device();
        reuse_buffer(&mut self.log_probs, &dev, logits.len())?;
        reuse_buffer(&mut self.stats, &dev, nll_stat::LEN)?;
        let lp = held_mut(&mut self.log_probs, "LogSoftmaxNll", "log-probabilities")?;
        let stats = self
            .stats
            .as_mut()
            .ok_or_else(|| NnError::usage("LogSoftmaxNll", "stats"))?;
        ops::log_softmax_nll_forward(logits, labels, rows, self.classes, lp, stats)?;
        self.rows = rows;
        Ok(stats)
    }

    /// The log-probabilities of the last forward.
    pub fn log_probs(&self) -> Result<&Buffer<f32>, NnError> {
        held(&self.log_probs, "LogSoftmaxNll", "log-probabilities")
    }

    /// Gradient of `grad_scale * mean loss` with respect to the logits:
    /// `grad_scale * (softmax - onehot(label)) / rows`. A data-parallel step passes
    /// `1 / (world_size * micro_batches)` so the summed gradients are those of the global mean.
    pub fn backward(
        &mut self,
        labels: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<&Buffer<f32>, NnError> {
        let lp = held(&self.log_probs, "LogSoftmaxNll", "log-probabilities")?;
        if labels.len() != self.rows {
            return Err(NnError::usage(
                "LogSoftmaxNll",
                format!(
                    "{} labels for a forward of {} rows",
                    labels.len(),
                    self.rows
                ),
            ));
        }
        reuse_buffer(&mut self.dlogits, &lp.device(), lp.len())?;
        let d = held_mut(&mut self.dlogits, "LogSoftmaxNll", "logit gradient")?;
        ops::log_softmax_nll_backward(lp, labels, self.rows, self.classes, d)?;
        if grad_scale != 1.0 {
            ops::scale(d, grad_scale)?;
        }
        Ok(d)
    }
}
