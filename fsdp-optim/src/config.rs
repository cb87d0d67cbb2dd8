//! Hyperparameters and state precisions.

use crate::OptimError;

/// How the optimizer stores the states of FP8 weights. Plain parameters (biases, convolutions) always
/// keep F32 states: their master is the model's plain shard itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StatePrecision {
    /// F32 master, F32 first moment, F32 second moment (12 bytes per parameter).
    F32,
    /// MS-AMP's recipe (the default): F16 master, FP8 E4M3 first moment and F16 second moment, each with
    /// its own per-parameter scale (5 bytes per parameter).
    #[default]
    LowPrecision,
}

impl StatePrecision {
    /// Optimizer-state bytes per FP8-weight parameter: master, first and second moment.
    pub fn state_bytes_per_param(self) -> usize {
        match self {
            StatePrecision::F32 => 4 + 4 + 4,
            StatePrecision::LowPrecision => 2 + 1 + 2,
        }
    }

    /// Name used in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            StatePrecision::F32 => "f32",
            StatePrecision::LowPrecision => "low_precision",
        }
    }
}

/// Hyperparameters of [`crate::FsdpAdam`] and [`crate::FsdpAdamW`], named and defaulted as in PyTorch.
///
/// Gradients are used as the model holds them: averaging over ranks and micro-batches is the caller's
/// business (make the loss a mean over the global batch, as the examples do).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamOptions {
    /// Learning rate (the base value a schedule multiplies), `>= 0`.
    pub lr: f64,
    /// `(beta1, beta2)`, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator, `> 0`.
    pub eps: f64,
    /// Weight decay, `>= 0`: an L2 penalty in Adam, decoupled decay in AdamW.
    pub weight_decay: f64,
    /// Ascend instead of descend.
    pub maximize: bool,
    /// AMSGrad: not implemented; `true` is rejected with [`OptimError::Unsupported`].
    pub amsgrad: bool,
    /// Clip the gradients by their global L2 norm (over every shard on every rank) to at most this value.
    pub max_grad_norm: Option<f64>,
    /// Storage of the FP8 weights' states.
    pub state_precision: StatePrecision,
}

impl AdamOptions {
    /// `torch.optim.Adam` defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0; low-precision
    /// states.
    pub fn adam() -> Self {
        AdamOptions {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            maximize: false,
            amsgrad: false,
            max_grad_norm: None,
            state_precision: StatePrecision::default(),
        }
    }

    /// `torch.optim.AdamW` defaults: as [`AdamOptions::adam`] with weight_decay 1e-2.
    pub fn adamw() -> Self {
        AdamOptions {
            weight_decay: 1e-2,
            ..Self::adam()
        }
    }

    /// Checks every value; the error names the offending one.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |m: String| Err(OptimError::InvalidHyperparameter(m));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("lr must be finite and >= 0, got {}", self.lr));
        }
        let (b1, b2) = self.betas;
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return bad(format!("betas must be in [0, 1), got ({b1}, {b2})"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps must be finite and > 0, got {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            ));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return bad(format!("max_grad_norm must be finite and > 0, got {n}"));
            }
        }
        if self.amsgrad {
            return Err(OptimError::Unsupported(
                "amsgrad (its extra state would cost another buffer per parameter); use amsgrad = false"
                    .into(),
            ));
        }
        Ok(())
    }
}
