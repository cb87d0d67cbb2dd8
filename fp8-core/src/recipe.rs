//! [`Fp8Recipe`]: the one value that says how a whole model computes in FP8 (Transformer Engine's
//! `DelayedScaling` recipe is the model): the formats of the forward and backward operands, how
//! activations and output gradients are scaled, the weights' margin, and the granularity of the scales
//! ([`BlockRecipe`]: per tensor, or per block as in DeepSeek-V3).

use crate::{Fp8Error, Fp8Format, QType, ScaleRounding, ScalingGranularity, ScalingRecipe};

/// Which FP8 formats the operands of an FP8 linear use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8Formats {
    /// E4M3 for the forward operands (activations, weights), E5M2 for the output gradients: the range
    /// gradients need, the precision activations need (Transformer Engine's `HYBRID`).
    #[default]
    Hybrid,
    /// E4M3 for every operand, output gradients included: DeepSeek-V3's choice with block scales, whose
    /// per-tile scales give the gradients the range that E5M2 would otherwise provide.
    E4M3,
}

impl Fp8Formats {
    /// The format of activations and weights.
    pub fn forward(self) -> Fp8Format {
        match self {
            Fp8Formats::Hybrid | Fp8Formats::E4M3 => Fp8Format::E4M3,
        }
    }

    /// The format of output gradients.
    pub fn backward(self) -> Fp8Format {
        match self {
            Fp8Formats::Hybrid => Fp8Format::E5M2,
            Fp8Formats::E4M3 => Fp8Format::E4M3,
        }
    }

    /// The formats in words (`hybrid E4M3/E5M2`, `E4M3`).
    pub fn name(self) -> &'static str {
        match self {
            Fp8Formats::Hybrid => "hybrid E4M3/E5M2",
            Fp8Formats::E4M3 => "E4M3",
        }
    }
}

/// The scale granularity of each operand of an FP8 linear (see [`crate::block`]).
///
/// An operand scaled by blocks is scaled *currently*, block by block: each block's scale comes from the
/// amax of its own real elements as the operand is cast ([`crate::block_scale`]: margin 0, `rounding`,
/// scale 1 for a block that is all zeros or holds a non-finite value). So [`Fp8Recipe::validate`] wants
/// the per-tensor recipe of a block-scaled activation or gradient to say exactly that (current, margin
/// 0, the same rounding), and a weight margin of 0 when the weights are block-scaled: no field of a
/// recipe is silently unused.
///
/// The default, [`BlockRecipe::per_tensor`], is one scale per tensor for every operand: today's
/// behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockRecipe {
    /// Inputs of FP8 linears: per tensor or 1x128 tiles along the reduction dimension (for the
    /// weight-gradient GEMM they are re-quantized in 128x1 tiles, the 1x128 tiles of the transpose).
    pub activations: ScalingGranularity,
    /// Output gradients: per tensor or 1x128 tiles along the reduction dimension.
    pub gradients: ScalingGranularity,
    /// Weights: per tensor or 128x128 blocks.
    pub weights: ScalingGranularity,
    /// How block scales are rounded: power of two (exact scaling, the default) or `fmax / amax` itself.
    pub rounding: ScaleRounding,
}

impl Default for BlockRecipe {
    fn default() -> Self {
        Self::per_tensor()
    }
}

impl BlockRecipe {
    /// One scale per tensor for every operand.
    pub const fn per_tensor() -> Self {
        BlockRecipe {
            activations: ScalingGranularity::PerTensor,
            gradients: ScalingGranularity::PerTensor,
            weights: ScalingGranularity::PerTensor,
            rounding: ScaleRounding::PowerOfTwo,
        }
    }

    /// DeepSeek-V3's granularity: 1x128 tiles for activations and gradients, 128x128 blocks for weights,
    /// with block scales rounded as `rounding` says.
    pub const fn deepseek_v3(rounding: ScaleRounding) -> Self {
        BlockRecipe {
            activations: ScalingGranularity::Block1x128,
            gradients: ScalingGranularity::Block1x128,
            weights: ScalingGranularity::Block128x128,
            rounding,
        }
    }

    /// Whether no operand is block-scaled.
    pub const fn is_per_tensor(&self) -> bool {
        !(self.activations.is_block() || self.gradients.is_block() || self.weights.is_block())
    }

    /// Checks that each operand has a granularity it supports: activations and gradients per tensor or
    /// 1x128, weights per tensor or 128x128.
    pub fn validate(&self) -> Result<(), Fp8Error> {
        use ScalingGranularity as G;
        let check = |operand: &str, g: G, block: G| {
            if g == G::PerTensor || g == block {
                Ok(())
            } else {
                Err(Fp8Error::InvalidRecipe(format!(
                    "{operand} cannot be scaled in {g} blocks (per-tensor or {block} only)"
                )))
            }
        };
        check("activations", self.activations, G::Block1x128)?;
        check("gradients", self.gradients, G::Block1x128)?;
        check("weights", self.weights, G::Block128x128)
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
///
/// Block scaling (DeepSeek-V3): [`Fp8Recipe::block_scaled`], or set [`Fp8Recipe::blocks`] with
/// current per-tensor recipes for the block-scaled operands.
///
/// ```
/// use fp8_core::{Fp8Recipe, ScaleRounding};
///
/// let r = Fp8Recipe::block_scaled(ScaleRounding::PowerOfTwo);
/// r.validate()?;
/// assert_eq!(r.name(), "E4M3, activations 1x128 blocks, gradients 1x128 blocks, weights 128x128 blocks, power-of-two block scales");
/// // A delayed recipe cannot describe block-scaled activations.
/// let bad = Fp8Recipe { blocks: r.blocks, ..Fp8Recipe::default() };
/// assert!(bad.validate().is_err());
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
    /// The scale granularity of each operand; per tensor by default.
    pub blocks: BlockRecipe,
}

impl Default for Fp8Recipe {
    /// Delayed scaling (window 16, max, margin 0, power-of-two scales) of activations and gradients,
    /// current scaling of the weights, E4M3 forward and E5M2 backward, one scale per tensor.
    fn default() -> Self {
        Fp8Recipe {
            formats: Fp8Formats::Hybrid,
            activations: ScalingRecipe::delayed_default(),
            gradients: ScalingRecipe::delayed_default(),
            weight_margin: 0,
            blocks: BlockRecipe::per_tensor(),
        }
    }
}

impl Fp8Recipe {
    /// DeepSeek-V3's recipe: E4M3 everywhere, 1x128 tiles for activations and gradients, 128x128 blocks
    /// for weights, block scales rounded as `rounding` says (the per-tensor recipes set to match).
    pub const fn block_scaled(rounding: ScaleRounding) -> Self {
        let current = ScalingRecipe::Current {
            margin: 0,
            rounding,
        };
        Fp8Recipe {
            formats: Fp8Formats::E4M3,
            activations: current,
            gradients: current,
            weight_margin: 0,
            blocks: BlockRecipe::deepseek_v3(rounding),
        }
    }

    /// Checks the margins and history windows, the granularities, and that every block-scaled operand's
    /// per-tensor settings describe block scaling (see [`BlockRecipe`]).
    pub fn validate(&self) -> Result<(), Fp8Error> {
        self.activations.validate()?;
        self.gradients.validate()?;
        ScalingRecipe::Current {
            margin: self.weight_margin,
            rounding: crate::ScaleRounding::PowerOfTwo,
        }
        .validate()?;
        self.blocks.validate()?;
        let block_current = ScalingRecipe::Current {
            margin: 0,
            rounding: self.blocks.rounding,
        };
        for (operand, g, recipe) in [
            ("activations", self.blocks.activations, &self.activations),
            ("gradients", self.blocks.gradients, &self.gradients),
        ] {
            if g.is_block() && *recipe != block_current {
                return Err(Fp8Error::InvalidRecipe(format!(
                    "{operand} are scaled in {g} blocks, each block currently with margin 0 and {} \
                     scales, but their per-tensor recipe is {recipe:?}",
                    rounding_name(self.blocks.rounding)
                )));
            }
        }
        if self.blocks.weights.is_block() && self.weight_margin != 0 {
            return Err(Fp8Error::InvalidRecipe(format!(
                "weights are scaled in {} blocks (margin 0) but the weight margin is {}",
                self.blocks.weights, self.weight_margin
            )));
        }
        Ok(())
    }

    /// The scale granularity of activations.
    pub fn activation_granularity(&self) -> ScalingGranularity {
        self.blocks.activations
    }

    /// The scale granularity of output gradients.
    pub fn gradient_granularity(&self) -> ScalingGranularity {
        self.blocks.gradients
    }

    /// The scale granularity of weights.
    pub fn weight_granularity(&self) -> ScalingGranularity {
        self.blocks.weights
    }

    /// The storage type of activations.
    pub fn activation_qtype(&self) -> QType {
        QType::from(self.formats.forward())
    }

    /// The storage type of output gradients.
    pub fn gradient_qtype(&self) -> QType {
        QType::from(self.formats.backward())
    }

    /// The recipe in words (named in run summaries, metrics and checkpoints). A per-tensor recipe reads
    /// as it always has; a block-scaled operand is named by its blocks, and the block scales' rounding
    /// follows.
    pub fn name(&self) -> String {
        let scaling = |r: &ScalingRecipe, g: ScalingGranularity| match (g.is_block(), r) {
            (true, _) => format!("{g} blocks"),
            (
                false,
                ScalingRecipe::Delayed {
                    history_len,
                    margin,
                    ..
                },
            ) => format!("delayed (window {history_len}, margin {margin})"),
            (false, ScalingRecipe::Current { margin, .. }) => format!("current (margin {margin})"),
        };
        let weights = if self.blocks.weights.is_block() {
            format!("{} blocks", self.blocks.weights)
        } else {
            format!("current (margin {})", self.weight_margin)
        };
        let mut name = format!(
            "{}, activations {}, gradients {}, weights {weights}",
            self.formats.name(),
            scaling(&self.activations, self.blocks.activations),
            scaling(&self.gradients, self.blocks.gradients),
        );
        if !self.blocks.is_per_tensor() {
            name.push_str(&format!(
                ", {} block scales",
                rounding_name(self.blocks.rounding)
            ));
        }
        name
    }
}

fn rounding_name(r: ScaleRounding) -> &'static str {
    match r {
        ScaleRounding::PowerOfTwo => "power-of-two",
        ScaleRounding::Exact => "exact",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_recipe_is_per_tensor_and_named_as_before() {
        let r = Fp8Recipe::default();
        r.validate().unwrap();
        assert!(r.blocks.is_per_tensor());
        assert_eq!(r.weight_granularity(), ScalingGranularity::PerTensor);
        // The description written into run summaries and checkpoints before block scaling existed.
        assert_eq!(
            r.name(),
            "hybrid E4M3/E5M2, activations delayed (window 16, margin 0), gradients delayed \
             (window 16, margin 0), weights current (margin 0)"
        );
        assert_eq!(BlockRecipe::default(), BlockRecipe::per_tensor());
    }

    #[test]
    fn block_scaled_recipe() {
        for rounding in [ScaleRounding::PowerOfTwo, ScaleRounding::Exact] {
            let r = Fp8Recipe::block_scaled(rounding);
            r.validate().unwrap();
            assert_eq!(r.gradient_qtype(), QType::E4M3);
            assert_eq!(r.activation_granularity(), ScalingGranularity::Block1x128);
            assert_eq!(r.weight_granularity(), ScalingGranularity::Block128x128);
        }
        assert!(Fp8Recipe::block_scaled(ScaleRounding::Exact)
            .name()
            .ends_with("weights 128x128 blocks, exact block scales"));
        // Only the weights in blocks: the other operands keep their per-tensor descriptions.
        let w = Fp8Recipe {
            blocks: BlockRecipe {
                weights: ScalingGranularity::Block128x128,
                ..BlockRecipe::per_tensor()
            },
            ..Fp8Recipe::default()
        };
        w.validate().unwrap();
        assert_eq!(
            w.name(),
            "hybrid E4M3/E5M2, activations delayed (window 16, margin 0), gradients delayed \
             (window 16, margin 0), weights 128x128 blocks, power-of-two block scales"
        );
    }

    #[test]
    fn contradictory_recipes_are_refused() {
        use ScalingGranularity as G;
        let base = Fp8Recipe::block_scaled(ScaleRounding::PowerOfTwo);
        let bad = [
            // Granularities an operand does not support.
            Fp8Recipe {
                blocks: BlockRecipe {
                    activations: G::Block128x128,
                    ..base.blocks
                },
                ..base
            },
            Fp8Recipe {
                blocks: BlockRecipe {
                    weights: G::Block1x128,
                    ..base.blocks
                },
                ..base
            },
            // A delayed or margined recipe for block-scaled gradients.
            Fp8Recipe {
                gradients: ScalingRecipe::delayed_default(),
                ..base
            },
            Fp8Recipe {
                gradients: ScalingRecipe::Current {
                    margin: 1,
                    rounding: ScaleRounding::PowerOfTwo,
                },
                ..base
            },
            // Rounding of the per-tensor recipe disagreeing with the block scales'.
            Fp8Recipe {
                activations: ScalingRecipe::Current {
                    margin: 0,
                    rounding: ScaleRounding::Exact,
                },
                ..base
            },
            // A weight margin with block-scaled weights.
            Fp8Recipe {
                weight_margin: 2,
                ..base
            },
        ];
        for r in bad {
            assert!(
                matches!(r.validate(), Err(Fp8Error::InvalidRecipe(_))),
                "{r:?} validated"
            );
        }
    }
}
