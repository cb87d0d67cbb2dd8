//! Log-softmax with the negative log-likelihood loss (PyTorch's `log_softmax` + `nll_loss`).

use crate::layer::{module_without_state, take_saved};
use crate::{NnError, Shape, Tensor};
use fp8_kernels::elementwise;
use fp8_kernels::softmax::{self, nll_stat};
use fp8_kernels::Buffer;
use fsdp_shard::Ctx;

/// `loss = mean_r -log_softmax(logits)[r, label_r]` over `[rows, classes]` logits. The forward writes
/// device statistics ([`nll_stat`]: mean loss, correct predictions, labels out of range) without a host
/// read; the backward returns `(softmax - onehot) * grad_scale / rows`.
#[derive(Debug)]
pub struct LogSoftmaxNll {
    classes: usize,
    rows: usize,
    log_probs: Option<Buffer<f32>>,
    stats: Option<Buffer<f32>>,
}

impl LogSoftmaxNll {
    /// The loss over `classes` classes.
    pub fn new(classes: usize) -> Result<Self, NnError> {
        if classes == 0 {
            return Err(NnError::usage("LogSoftmaxNll", "no classes"));
        }
        Ok(LogSoftmaxNll {
            classes,
            rows: 0,
            log_probs: None,
            stats: None,
        })
    }

    /// Forward: the loss statistics of `logits [rows, classes]` against `labels [rows]`.
    pub fn forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        logits: Tensor,
        labels: &Buffer<i32>,
    ) -> Result<&Buffer<f32>, NnError> {
        let rows = labels.len();
        if logits.shape().numel() != rows * self.classes {
            return Err(NnError::usage(
                "LogSoftmaxNll",
                format!(
                    "logits of shape {:?} for {rows} labels of {} classes",
                    logits.shape(),
                    self.classes
                ),
            ));
        }
        let dev = ctx.device().clone();
        let mut lp = dev.uninit::<f32>(rows * self.classes)?;
        let fits = self.stats.as_ref().is_some_and(|s| s.device() == dev);
        if !fits {
            self.stats = Some(dev.zeros(nll_stat::LEN)?);
        }
        let stats = self
            .stats
            .as_mut()
            .ok_or_else(|| NnError::usage("LogSoftmaxNll", "stats"))?;
        softmax::log_softmax_nll_forward(
            logits.data(),
            labels,
            rows,
            self.classes,
            &mut lp,
            stats,
        )?;
        self.rows = rows;
        self.log_probs = ctx.is_training().then_some(lp);
        Ok(stats)
    }

    /// The statistics of the last forward (see [`nll_stat`]).
    pub fn stats(&self) -> Result<&Buffer<f32>, NnError> {
        self.stats
            .as_ref()
            .ok_or_else(|| NnError::usage("LogSoftmaxNll", "no forward yet"))
    }

    /// Backward: the logits' gradient scaled by `grad_scale` (e.g. `1 / (ranks * micro-batches)`, for the
    /// mean over the global batch).
    pub fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        labels: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<Tensor, NnError> {
        let lp = take_saved(&mut self.log_probs, "LogSoftmaxNll")?;
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
        let mut d = Tensor::uninit(ctx.device(), Shape::matrix(self.rows, self.classes)?)?;
        softmax::log_softmax_nll_backward(&lp, labels, self.rows, self.classes, d.data_mut())?;
        if grad_scale != 1.0 {
            elementwise::scale(d.data_mut(), grad_scale)?;
        }
        Ok(d)
    }
}

module_without_state!(LogSoftmaxNll);
