//! Model-state memory: the optimizer's share of [`MemoryReport`] and the analytic bytes per parameter.

use super::*;

impl ShardedAdam {
    /// The model's memory report with this optimizer's states added.
    pub fn memory(&self, model: &ShardedModel) -> Result<MemoryReport, OptimError> {
        let mut r = model.memory()?;
        r.optimizer_states = self.state_bytes();
        Ok(r)
    }

    /// Measured model-state bytes (parameter shards, gradient shards, optimizer states) per parameter of
    /// this rank's share (`numel / world_size`), padding included.
    pub fn bytes_per_param(&self, model: &ShardedModel) -> Result<f64, OptimError> {
        let r = self.memory(model)?;
        let share = model.layout().numel() as f64 / self.world_size as f64;
        Ok(r.model_state() as f64 / share.max(1.0))
    }
}

/// Model-state bytes per parameter per rank-share, by part (analytic, padding excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BytesPerParam {
    /// The parameter shard the model keeps (E4M3 code, or F32 for plain parameters).
    pub weight: usize,
    /// The reduced gradient shard (F32 by default in `fsdp-shard`, 2 bytes with BF16 shards: see
    /// [`BytesPerParam::with_grad`]).
    pub grad: usize,
    /// Optimizer master copy (0 for plain parameters: their shard is the master).
    pub master: usize,
    /// First moment.
    pub exp_avg: usize,
    /// Second moment.
    pub exp_avg_sq: usize,
}

impl BytesPerParam {
    /// An FP8 weight's bytes with the given state precision.
    pub fn fp8_weight(precision: StatePrecision) -> Self {
        match precision {
            StatePrecision::F32 => BytesPerParam {
                weight: 1,
                grad: 4,
                master: 4,
                exp_avg: 4,
                exp_avg_sq: 4,
            },
            StatePrecision::LowPrecision => BytesPerParam {
                weight: 1,
                grad: 4,
                master: 2,
                exp_avg: 1,
                exp_avg_sq: 2,
            },
        }
    }

    /// A plain parameter's bytes (F32 parameter = master, F32 gradient, F32 moments).
    pub fn plain() -> Self {
        BytesPerParam {
            weight: 4,
            grad: 4,
            master: 0,
            exp_avg: 4,
            exp_avg_sq: 4,
        }
    }

    /// The peer: BF16 mixed precision with F32 Adam (BF16 weight and gradient, F32 master and moments).
    pub fn bf16_mixed_precision() -> Self {
        BytesPerParam {
            weight: 2,
            grad: 2,
            master: 4,
            exp_avg: 4,
            exp_avg_sq: 4,
        }
    }

    /// The same with gradient shards stored as `dtype`.
    pub fn with_grad(self, dtype: GradDtype) -> Self {
        BytesPerParam {
            grad: dtype.size_bytes(),
            ..self
        }
    }

    /// Total.
    pub fn total(&self) -> usize {
        self.weight + self.grad + self.master + self.exp_avg + self.exp_avg_sq
    }
}
