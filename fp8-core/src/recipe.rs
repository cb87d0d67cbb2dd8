//! [`Fp8Recipe`]: the one value that says how a whole model computes in FP8 (Transformer Engine's
//! `DelayedScaling` recipe is the model): the formats of the forward and backward operands, how
//! activations and output gradients are scaled, and the weights' margin.

use crate::{Fp8Error, Fp8Format, QType, ScalingRecipe};

/// Which FP8 formats the operands of an FP8 linear use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8Formats {
    /// E4M3 for the forward operands (activations, weights), E5M2 for the output gradients: the range
    /// gradients need, the precision activations need (Transformer Engine's `HYBRID`).
    #[default]
    Hybrid,
}

impl Fp8Formats {
    /// The format of activations and weights.
    pub fn forward(self) -> Fp8Format {
        match self {
            Fp8Formats::Hybrid => Fp8Format::E4M3,
        }
    }

    /// The format of output gradients.
    pub fn backward(self) -> Fp8Format {
        match self {
            Fp8Formats::Hybrid => Fp8Format::E5M2,
        }
    }
}

/// How a model computes in FP8, model-wide.
///
/// ```
/// use fp8_core::{Fp8Recipe, ScalingRecipe};
///
/// let recipe = Fp8Recipe::default(); // delayed scaling, window 16, margin 0, E4M3 / E5M2
/// assert_eq!(recipe.activations, ScalingRecipe::delayed_default());
/// let current = Fp8Recipe { activations: ScalingRecipe::current_default(), ..recipe };
/// current.validate()?;
/// assert_eq!(current.name(), "hybrid E4M3/E5M2, activations current (margin 0), gradients delayed (window 16, margin 0), weights current (margin 0)");
/// # Ok::<(), fp8_core::Fp8Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Recipe {
    /// Formats of the forward and backward operands.
    pub formats: Fp8Formats,
    /// Scaling of the inputs of FP8 linears (delayed with an amax window, or current).
    pub activations: ScalingRecipe,
    /// Scaling of the output gradients of FP8 linears.
    pub gradients: ScalingRecipe,
    /// The weights are always scaled currently (their amax comes with the optimizer step); their scale
    /// is divided by `2^weight_margin`.
    pub weight_margin: i32,
}

impl Default for Fp8Recipe {
    /// Delayed scaling (window 16, max, margin 0, power-of-two scales) of activations and gradients,
    /// current scaling of the weights, E4M3 forward and E5M2 backward.
    fn default() -> Self {
        Fp8Recipe {
            formats: Fp8Formats::Hybrid,
            activations: ScalingRecipe::delayed_default(),
            gradients: ScalingRecipe::delayed_default(),
            weight_margin: 0,
        }
    }
}

impl Fp8Recipe {
    /// Checks the margins and history windows.
    pub fn validate(&self) -> Result<(), Fp8Error> {
        self.activations.validate()?;
        self.gradients.validate()?;
        ScalingRecipe::Current {
            margin: self.weight_margin,
            rounding: crate::ScaleRounding::PowerOfTwo,
        }
        .validate()
    }

    /// The storage type of activations.
    pub fn activation_qtype(&self) -> QType {
        QType::from(self.formats.forward())
    }

    /// The storage type of output gradients.
    pub fn gradient_qtype(&self) -> QType {
        QType::from(self.formats.backward())
    }

    /// The recipe in words (named in run summaries, metrics and checkpoints).
    pub fn name(&self) -> String {
        let scaling = |r: &ScalingRecipe| match r {
            ScalingRecipe::Delayed {
                history_len,
                margin,
                ..
            } => format!("delayed (window {history_len}, margin {margin})"),
            ScalingRecipe::Current { margin, .. } => format!("current (margin {margin})"),
        };
        let formats = match self.formats {
            Fp8Formats::Hybrid => "hybrid E4M3/E5M2",
        };
        format!(
            "{formats}, activations {}, gradients {}, weights current (margin {})",
            scaling(&self.activations),
            scaling(&self.gradients),
            self.weight_margin
        )
    }
}
