//! Memory accounting: bytes one rank holds, by category.

use std::fmt;

/// Bytes held by one rank, by category. Optimizer states come from the optimizer
/// ([`crate::ShardedState::state_bytes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// FP8 weight shards and their scales.
    pub fp8_weight_shards: usize,
    /// Plain parameter shards (F32; the master copy of plain parameters).
    pub plain_param_shards: usize,
    /// Reduced gradient shards held now, their real bytes (F32 or BF16, see `GradDtype`): 0 between
    /// steps when they are transient (`ShardedModel::set_transient_grads`).
    pub grad_shards: usize,
    /// Most gradient-shard bytes held at once: `grad_shards` when the shards persist; with transient
    /// shards stepped unit by unit, the largest unit's (they are not model state, but a transient of the
    /// backward).
    pub peak_grad_shards: usize,
    /// Full gradients awaiting reduction (no-sync accumulation keeps them across micro-batches).
    pub full_grads: usize,
    /// Gathered parameters held now.
    pub gathered: usize,
    /// Largest amount of gathered parameters held at once.
    pub peak_gathered: usize,
    /// Optimizer states (master weights of FP8 parameters, moments).
    pub optimizer_states: usize,
    /// What the device reports in use (CUDA only; the whole process's context).
    pub device_used: Option<usize>,
}

impl MemoryReport {
    /// Model state held persistently: parameter shards, gradient shards and optimizer states.
    pub fn model_state(&self) -> usize {
        self.fp8_weight_shards + self.plain_param_shards + self.grad_shards + self.optimizer_states
    }

    /// The categories of [`MemoryReport::model_state`] for reports: `(key, label, bytes)`, the key as
    /// in the programs' JSON lines, the label for tables.
    pub fn model_state_parts(&self) -> [(&'static str, &'static str, usize); 4] {
        [
            (
                "fp8_weight_shards",
                "FP8 weight shards",
                self.fp8_weight_shards,
            ),
            (
                "plain_param_shards",
                "plain parameter shards",
                self.plain_param_shards,
            ),
            ("grad_shards", "gradient shards", self.grad_shards),
            (
                "optimizer_states",
                "optimizer states",
                self.optimizer_states,
            ),
        ]
    }
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fp8 weights {:.2} MiB, plain params {:.2} MiB, grads {:.2} MiB, optimizer {:.2} MiB, \
             model state {:.2} MiB, gathered peak {:.2} MiB",
            mib(self.fp8_weight_shards),
            mib(self.plain_param_shards),
            mib(self.grad_shards),
            mib(self.optimizer_states),
            mib(self.model_state()),
            mib(self.peak_gathered)
        )?;
        if self.peak_grad_shards > self.grad_shards {
            write!(
                f,
                ", transient grads peak {:.2} MiB",
                mib(self.peak_grad_shards)
            )?;
        }
        if let Some(d) = self.device_used {
            write!(f, ", device in use {:.2} MiB", mib(d))?;
        }
        Ok(())
    }
}
