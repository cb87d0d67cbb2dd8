//! The FP8 conversion pass: turns chosen linears of a built model into FP8 before it is wrapped, by a
//! filter on each linear's path and shape, with one model-wide recipe (torchao's
//! `convert_to_float8_training(module_filter_fn=..)` and Transformer Engine's recipe object are the
//! models). A model is written in its float precision; which linears compute in FP8 is a decision of the
//! run, not of the model's code.
//!
//! ```
//! use fp8_core::Fp8Recipe;
//! use fsdp_nn::{convert_to_fp8, Fp8Filter, Linear, LinearPrecision, Relu, Sequential};
//! use half::bf16;
//!
//! let mut net = Sequential::<bf16>::new()
//!     .push("up", Linear::new(4096, 16384)?)
//!     .push("relu", Relu::new())
//!     .push("out", Linear::new(16384, 10)?);
//! // The measured crossover: only the large linear pays for its FP8 casts.
//! let converted = convert_to_fp8(&mut net, &Fp8Filter::auto(), &Fp8Recipe::default())?;
//! assert_eq!(converted, ["up"]);
//! // Or any rule on the path and shape.
//! let mut net = Sequential::<bf16>::new().push("a", Linear::new(64, 64)?).push("b", Linear::new(64, 64)?);
//! let only_b = Fp8Filter::custom(|l| l.path.ends_with('b'));
//! assert_eq!(convert_to_fp8(&mut net, &only_b, &Fp8Recipe::default())?, ["b"]);
//! # Ok::<(), fsdp_nn::NnError>(())
//! ```

use crate::layer::Activation;
use crate::linear::{block_scalable, BlockScaling, Linear, LinearPrecision};
use crate::LmHead;
use crate::NnError;
use fp8_core::Fp8Recipe;
use fsdp_shard::{Module, ModulePath, ParamDecl, ParamId, ShardError, Visitor};
use half::bf16;
use std::sync::Arc;

/// The default crossover of [`Fp8Filter::Auto`]: a linear `in -> out` computes in FP8 when
/// `k = in * out / (in + out) >= 1200`. `k` is the GEMM's flops per element of the two activation casts FP8
/// adds (`2 tokens in out` flops against `tokens (in + out)` cast elements), so it says whether the faster
/// GEMM pays for the casts. Measured on an H200 by the `linear_crossover` example (one training step of
/// each GPT block linear at five widths and 4096-16384 tokens, the FP8 weight re-quantization included):
/// FP8 was faster for every linear with `k >= 1200` at every token count (`docs/benchmarks.md`).
pub const DEFAULT_FP8_AUTO_THRESHOLD: usize = 1200;

/// The quantity [`Fp8Filter::Auto`] compares with its threshold for a linear `inf -> outf`:
/// `inf * outf / (inf + outf)` in integers (rounded down; 0 when both are 0; saturating).
pub fn fp8_auto_ratio(inf: usize, outf: usize) -> usize {
    (inf.saturating_mul(outf))
        .checked_div(inf.saturating_add(outf))
        .unwrap_or(0)
}

/// A linear as the filter sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearInfo<'a> {
    /// The layer's dotted path (`h.3.c_fc`).
    pub path: &'a str,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

/// Which linears [`convert_to_fp8`] converts.
#[derive(Clone)]
pub enum Fp8Filter {
    /// Every linear.
    All,
    /// None (the model stays in its float precision).
    None,
    /// Those whose GEMM is large enough for FP8 to pay: [`fp8_auto_ratio`] `>= threshold`.
    Auto {
        /// See [`DEFAULT_FP8_AUTO_THRESHOLD`].
        threshold: usize,
    },
    /// Those the function accepts.
    Custom(Arc<dyn Fn(&LinearInfo<'_>) -> bool + Send + Sync>),
}

impl std::fmt::Debug for Fp8Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fp8Filter::All => f.write_str("All"),
            Fp8Filter::None => f.write_str("None"),
            Fp8Filter::Auto { threshold } => write!(f, "Auto {{ threshold: {threshold} }}"),
            Fp8Filter::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl Fp8Filter {
    /// [`Fp8Filter::Auto`] at the measured [`DEFAULT_FP8_AUTO_THRESHOLD`].
    pub fn auto() -> Self {
        Fp8Filter::Auto {
            threshold: DEFAULT_FP8_AUTO_THRESHOLD,
        }
    }

    /// A filter from a function of the path and shape.
    pub fn custom(f: impl Fn(&LinearInfo<'_>) -> bool + Send + Sync + 'static) -> Self {
        Fp8Filter::Custom(Arc::new(f))
    }

    /// Whether `linear` is converted.
    pub fn accepts(&self, linear: &LinearInfo<'_>) -> bool {
        match self {
            Fp8Filter::All => true,
            Fp8Filter::None => false,
            Fp8Filter::Auto { threshold } => {
                fp8_auto_ratio(linear.in_features, linear.out_features) >= *threshold
            }
            Fp8Filter::Custom(f) => f(linear),
        }
    }

    /// The filter in words (`all`, `none`, `auto (k >= 1200)`, `custom`).
    pub fn name(&self) -> String {
        match self {
            Fp8Filter::All => "all".into(),
            Fp8Filter::None => "none".into(),
            Fp8Filter::Auto { threshold } => format!("auto (k >= {threshold})"),
            Fp8Filter::Custom(_) => "custom".into(),
        }
    }
}

/// Converts the linears of `module` that `filter` accepts to FP8 with `recipe`, before the model is wrapped
/// (`fsdp_shard::FsdpModel::new`), and returns their paths in visit order. Linears are found through the
/// module tree's visit (children visited with `Visitor::child`), whatever their activation type. Linears
/// already in FP8 get the recipe too (and are listed).
///
/// With a block-scaled recipe (`Fp8Recipe::block_scaled`: DeepSeek-V3's 1x128 / 128x128 blocks) the
/// converted linears compute block-scaled ([`crate::BlockScaling`]); a linear the filter accepts whose
/// sides are not both multiples of 16 ([`crate::block_scalable`], the block-scaled GEMM's rule) stays in
/// its float precision and is not listed (a linear already in FP8 with such sides is an error: it
/// cannot compute block-scaled, and a model holds one kind of FP8 weight). A recipe that block-scales
/// only some operands is refused.
///
/// ```
/// use fp8_core::{Fp8Recipe, ScaleRounding};
/// use fsdp_nn::{convert_to_fp8, Fp8Filter, Linear, Relu, Sequential};
///
/// let mut net = Sequential::<f32>::new()
///     .push("fc1", Linear::new(256, 128)?)
///     .push("relu", Relu::new())
///     .push("fc2", Linear::new(128, 10)?);
/// let recipe = Fp8Recipe::block_scaled(ScaleRounding::PowerOfTwo);
/// // fc2's 10 outputs are no multiple of 16: it stays F32.
/// assert_eq!(convert_to_fp8(&mut net, &Fp8Filter::All, &recipe)?, ["fc1"]);
/// # Ok::<(), fsdp_nn::NnError>(())
/// ```
pub fn convert_to_fp8(
    module: &mut dyn Module,
    filter: &Fp8Filter,
    recipe: &Fp8Recipe,
) -> Result<Vec<String>, NnError> {
    let block = BlockScaling::of_recipe(recipe)
        .map_err(|e| match e {
            NnError::Usage { detail, .. } => NnError::usage("convert_to_fp8", detail),
            other => other,
        })?
        .is_some();
    let mut pass = Conversion {
        path: ModulePath::root(),
        filter,
        recipe,
        block,
        converted: Vec::new(),
        error: None,
    };
    // The root itself may be a linear.
    let r = pass.module(module).and_then(|()| module.visit(&mut pass));
    if let Some(e) = pass.error {
        return Err(e);
    }
    r?;
    Ok(pass.converted)
}

/// Runs the GEMMs of every language-model head of `module` ([`crate::LmHead`], either activation type) in
/// FP8 ([`crate::LmHead::with_fp8`]), before the model is wrapped, and returns their paths in visit order.
/// A pass of its own beside [`convert_to_fp8`]: the head is the one product where FP8 trades the most
/// fidelity (its logits feed the loss directly), so `--fp8-layers all` leaves it in float, as torchao's
/// and torchtitan's default filters leave the output projection, and a run opts in (`--fp8-head`).
///
/// ```
/// use fsdp_nn::{convert_lm_heads_to_fp8, LmHead};
///
/// let mut head = LmHead::<f32>::new(64, 1000)?;
/// assert_eq!(convert_lm_heads_to_fp8(&mut head)?, [""]);
/// assert!(head.is_fp8());
/// # Ok::<(), fsdp_nn::NnError>(())
/// ```
pub fn convert_lm_heads_to_fp8(module: &mut dyn Module) -> Result<Vec<String>, NnError> {
    struct Heads {
        path: ModulePath,
        converted: Vec<String>,
    }
    impl Visitor for Heads {
        fn path(&mut self) -> &mut ModulePath {
            &mut self.path
        }
        fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
            Ok(())
        }
        fn module(&mut self, module: &mut dyn Module) -> Result<(), ShardError> {
            let Some(any) = module.as_any_mut() else {
                return Ok(());
            };
            if let Some(h) = any.downcast_mut::<LmHead<f32>>() {
                h.set_fp8(true);
            } else if let Some(h) = any.downcast_mut::<LmHead<bf16>>() {
                h.set_fp8(true);
            } else {
                return Ok(());
            }
            self.converted.push(self.path.module());
            Ok(())
        }
    }
    let mut h = Heads {
        path: ModulePath::root(),
        converted: Vec::new(),
    };
    h.module(module)?;
    module.visit(&mut h)?;
    Ok(h.converted)
}

/// Sets every linear of `module` to `precision` (a BF16 or F32 run of a model written in another float
/// precision), before the model is wrapped.
pub fn set_linear_precision(
    module: &mut dyn Module,
    precision: LinearPrecision,
) -> Result<(), NnError> {
    struct Setter {
        path: ModulePath,
        precision: LinearPrecision,
        error: Option<NnError>,
    }
    impl Visitor for Setter {
        fn path(&mut self) -> &mut ModulePath {
            &mut self.path
        }
        fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
            Ok(())
        }
        fn module(&mut self, module: &mut dyn Module) -> Result<(), ShardError> {
            let p = self.precision;
            if let Some(Err(e)) = with_linear(module, |l: &mut dyn LinearSetup| l.set(p)) {
                let message = e.to_string();
                self.error = Some(e);
                return Err(ShardError::InvalidModel(message));
            }
            Ok(())
        }
    }
    let mut s = Setter {
        path: ModulePath::root(),
        precision,
        error: None,
    };
    let r = s.module(module).and_then(|()| module.visit(&mut s));
    if let Some(e) = s.error {
        return Err(e);
    }
    Ok(r?)
}

/// The linears of `module` in visit order: `(path, in, out, precision)` (e.g. for a run's summary).
pub fn linear_precisions(
    module: &mut dyn Module,
) -> Result<Vec<(String, usize, usize, LinearPrecision)>, NnError> {
    struct Lister {
        path: ModulePath,
        out: Vec<(String, usize, usize, LinearPrecision)>,
    }
    impl Visitor for Lister {
        fn path(&mut self) -> &mut ModulePath {
            &mut self.path
        }
        fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
            Ok(())
        }
        fn module(&mut self, module: &mut dyn Module) -> Result<(), ShardError> {
            if let Some((i, o, p)) = with_linear(module, |l: &mut dyn LinearSetup| {
                (l.in_features(), l.out_features(), l.precision())
            }) {
                self.out.push((self.path.module(), i, o, p));
            }
            Ok(())
        }
    }
    let mut l = Lister {
        path: ModulePath::root(),
        out: Vec::new(),
    };
    l.module(module)?;
    module.visit(&mut l)?;
    Ok(l.out)
}

/// What the pass needs of a linear, whatever its activation type.
trait LinearSetup {
    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;
    fn precision(&self) -> LinearPrecision;
    fn convert(&mut self, recipe: &Fp8Recipe) -> Result<(), NnError>;
    fn set(&mut self, precision: LinearPrecision) -> Result<(), NnError>;
}

impl<T: Activation> LinearSetup for Linear<T> {
    fn in_features(&self) -> usize {
        Linear::in_features(self)
    }
    fn out_features(&self) -> usize {
        Linear::out_features(self)
    }
    fn precision(&self) -> LinearPrecision {
        Linear::precision(self)
    }
    fn convert(&mut self, recipe: &Fp8Recipe) -> Result<(), NnError> {
        self.set_precision(LinearPrecision::Fp8)?;
        self.set_fp8_recipe(recipe)
    }
    fn set(&mut self, precision: LinearPrecision) -> Result<(), NnError> {
        self.set_precision(precision)
    }
}

/// Runs `f` on `module` when it is a linear of either activation type.
fn with_linear<R>(module: &mut dyn Module, f: impl FnOnce(&mut dyn LinearSetup) -> R) -> Option<R> {
    let any = module.as_any_mut()?;
    if any.is::<Linear<f32>>() {
        return any.downcast_mut::<Linear<f32>>().map(|l| f(l));
    }
    any.downcast_mut::<Linear<bf16>>().map(|l| f(l))
}

struct Conversion<'a> {
    path: ModulePath,
    filter: &'a Fp8Filter,
    recipe: &'a Fp8Recipe,
    /// The recipe is block-scaled.
    block: bool,
    converted: Vec<String>,
    /// A layer's own error (the visitor's error type is the shard crate's).
    error: Option<NnError>,
}

impl Visitor for Conversion<'_> {
    fn path(&mut self) -> &mut ModulePath {
        &mut self.path
    }

    fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
        Ok(())
    }

    fn module(&mut self, module: &mut dyn Module) -> Result<(), ShardError> {
        let path = self.path.module();
        let (filter, recipe, block) = (self.filter, self.recipe, self.block);
        let outcome = with_linear(module, |l: &mut dyn LinearSetup| {
            let (inf, outf) = (l.in_features(), l.out_features());
            let info = LinearInfo {
                path: &path,
                in_features: inf,
                out_features: outf,
            };
            let is_fp8 = l.precision() == LinearPrecision::Fp8;
            if !(filter.accepts(&info) || is_fp8) {
                return Ok(false);
            }
            if block && !block_scalable(inf, outf) {
                return if is_fp8 {
                    Err(NnError::usage(
                        &path,
                        format!(
                            "an FP8 linear {inf} -> {outf} cannot compute block-scaled (sides must \
                             be multiples of 16): build it in float precision and convert_to_fp8 \
                             leaves it there"
                        ),
                    ))
                } else {
                    Ok(false)
                };
            }
            l.convert(recipe).map(|()| true)
        });
        match outcome {
            Some(Ok(true)) => self.converted.push(path),
            Some(Err(e)) => {
                let message = e.to_string();
                self.error = Some(e);
                return Err(ShardError::InvalidModel(message));
            }
            Some(Ok(false)) | None => {}
        }
        Ok(())
    }
}
