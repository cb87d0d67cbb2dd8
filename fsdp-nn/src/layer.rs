//! The [`Layer`] interface (a module with a forward and a backward over one tensor) and the
//! [`Sequential`] container.

use crate::{NnError, Shape, Tensor};
use fp8_kernels::{FloatElement, GemmOutput};
use fsdp_shard::{Ctx, Module, ModulePath, ParamDecl, ParamId, ShardError, Visitor};
use half::bf16;

/// Element types of activations and gradients between layers: `f32` or `bf16`.
pub trait Activation: FloatElement + GemmOutput {}

impl Activation for f32 {}

impl Activation for bf16 {}

/// What a backward returns: the input gradient when it was asked for, `None` otherwise.
pub type InputGrad<T = f32> = Result<Option<Tensor<T>>, NnError>;

/// What `layer`'s training forward kept for its backward, taken out of `slot`; an error naming the
/// layer when there was no training forward since the last backward.
pub(crate) fn take_saved<S>(slot: &mut Option<S>, layer: &str) -> Result<S, NnError> {
    slot.take()
        .ok_or_else(|| NnError::usage(layer, "backward without a training forward"))
}

/// The rows of `layer`'s input of `shape`, whose last dimension must be `width`.
pub(crate) fn rows_of_width(layer: &str, shape: Shape, width: usize) -> Result<usize, NnError> {
    if shape.last() != width {
        return Err(NnError::usage(
            layer,
            format!("input of shape {shape:?}; the last dimension must be {width}"),
        ));
    }
    Ok(shape.rows())
}

/// `impl Module` for a layer that declares nothing (no parameter, scaling meta or counter):
/// `module_without_state!(Flatten);` or, generic, `module_without_state!(Relu<T: Activation>);`.
macro_rules! module_without_state {
    ($name:ident<$g:ident: $bound:path>) => {
        module_without_state!(@impl [$g: $bound] $name<$g>);
    };
    ($name:ident) => {
        module_without_state!(@impl [] $name);
    };
    (@impl [$($generics:tt)*] $ty:ty) => {
        impl<$($generics)*> fsdp_shard::Module for $ty {
            fn visit(
                &mut self,
                _v: &mut dyn fsdp_shard::Visitor,
            ) -> Result<(), fsdp_shard::ShardError> {
                Ok(())
            }
        }
    };
}
pub(crate) use module_without_state;

/// A module with a forward and a backward over one tensor: what a [`Sequential`] chains.
///
/// `forward` takes its input by value and keeps what its backward needs. A caller runs the backward with
/// [`Layer::backward`] (hands the parameters' gradients to the context and returns the input gradient)
/// or, for the first layer of a network, [`Layer::backward_params`] (the parameters' gradients only,
/// skipping the input-gradient work). A layer implements both through [`Layer::backward_step`].
pub trait Layer<T: Activation = f32>: Module {
    /// The forward pass.
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError>;
    /// The backward pass as a layer implements it, after a training forward: hands the parameters'
    /// gradients to the context and returns the input gradient when `need_dx` (`None` otherwise).
    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T>;
    /// The backward pass: the parameters' gradients go to the context; returns the input gradient.
    fn backward(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>) -> Result<Tensor<T>, NnError> {
        self.backward_step(ctx, dy, true)?.ok_or_else(|| {
            NnError::usage(
                std::any::type_name::<Self>(),
                "returned no input gradient although one was asked for",
            )
        })
    }
    /// The backward pass of a network's first layer: only the parameters' gradients.
    fn backward_params(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>) -> Result<(), NnError> {
        self.backward_step(ctx, dy, false).map(drop)
    }
    /// Frees what the last forward kept for the backward (see [`Recompute`]). Layers that keep nothing
    /// need not implement it.
    fn forget_saved(&mut self) {}
}

/// Recomputes a layer's forward inside the backward instead of keeping its activations between the
/// passes: only the layer's input is kept (activation checkpointing per module). The recomputed forward
/// sees the same parameters, for FP8 layers the same scales (they change only at the step end), and the
/// same random draws (the layer's counters, e.g. dropout offsets, are rewound to where the forward
/// started), so training is bit-identical to keeping the activations; it costs one more forward of the
/// layer.
pub struct Recompute<L> {
    inner: L,
    input: Option<Box<dyn std::any::Any>>,
    /// The inner layer's counters when its training forward started.
    counters: Vec<u64>,
}

/// Reads every counter of a module in visit order, or writes them back.
struct CounterSnapshot<'a> {
    path: ModulePath,
    values: &'a mut Vec<u64>,
    restore: bool,
    next: usize,
}

impl Visitor for CounterSnapshot<'_> {
    fn path(&mut self) -> &mut ModulePath {
        &mut self.path
    }
    fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
        Ok(())
    }
    fn counter(&mut self, local: &str, value: &mut u64) -> Result<(), ShardError> {
        if self.restore {
            *value = *self.values.get(self.next).ok_or_else(|| {
                ShardError::State(format!(
                    "counter {} was not there when the forward started",
                    self.path.member(local)
                ))
            })?;
            self.next += 1;
        } else {
            self.values.push(*value);
        }
        Ok(())
    }
}

impl<L: Module> Recompute<L> {
    fn snapshot_counters(&mut self, restore: bool) -> Result<(), ShardError> {
        if !restore {
            self.counters.clear();
        }
        self.inner.visit(&mut CounterSnapshot {
            path: ModulePath::root(),
            values: &mut self.counters,
            restore,
            next: 0,
        })
    }
}

impl<L> Recompute<L> {
    /// `inner`, recomputed in the backward.
    pub fn new(inner: L) -> Self {
        Recompute {
            inner,
            input: None,
            counters: Vec::new(),
        }
    }

    /// The wrapped layer.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// Bytes of the input kept for the recomputation, when it is a `Tensor<T>` (the input of a
    /// `Layer<T>`'s last training forward).
    pub fn saved_input_bytes<T: Activation>(&self) -> usize {
        self.input
            .as_ref()
            .and_then(|i| i.downcast_ref::<Tensor<T>>())
            .map_or(0, |t| t.data().num_bytes())
    }

    /// The wrapped layer, mutable (e.g. for an evaluation-only path of its own).
    pub fn inner_mut(&mut self) -> &mut L {
        &mut self.inner
    }
}

impl<L: Module> Module for Recompute<L> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        // Transparent: the inner layer's names are the wrapper's.
        self.inner.visit(v)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        self.inner.as_any_mut()
    }
}

impl<T: Activation, L: Layer<T>> Layer<T> for Recompute<L> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        if !ctx.is_training() {
            return self.inner.forward(ctx, x);
        }
        let keep = Tensor::new(x.data().to_device(ctx.device())?, x.shape())?;
        self.snapshot_counters(false)?;
        let y = self.inner.forward(ctx, x)?;
        self.inner.forget_saved();
        self.input = Some(Box::new(keep));
        Ok(y)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let x = self
            .input
            .take()
            .and_then(|b| b.downcast::<Tensor<T>>().ok())
            .ok_or_else(|| NnError::usage("Recompute", "backward without a training forward"))?;
        // The forward again, inside the backward pass (the context still trains), from the counters
        // the first one started with (it leaves them where the first one did), then its backward.
        self.snapshot_counters(true)?;
        drop(self.inner.forward(ctx, *x)?);
        self.inner.backward_step(ctx, dy, need_dx)
    }

    fn forget_saved(&mut self) {
        self.input = None;
        self.inner.forget_saved();
    }
}

/// Layers applied in order, each a named child (`Sequential::new().push("fc1", Linear::new(...))`
/// names its parameters `fc1.weight`, `fc1.bias`, as PyTorch's attribute names do).
pub struct Sequential<T: Activation = f32> {
    layers: Vec<(String, Box<dyn Layer<T>>)>,
}

impl<T: Activation> Default for Sequential<T> {
    fn default() -> Self {
        Sequential { layers: Vec::new() }
    }
}

impl<T: Activation> std::fmt::Debug for Sequential<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.layers.iter().map(|(n, _)| n))
            .finish()
    }
}

impl<T: Activation> Sequential<T> {
    /// An empty sequence.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `layer` under `name`.
    pub fn push(mut self, name: &str, layer: impl Layer<T> + 'static) -> Self {
        self.layers.push((name.to_string(), Box::new(layer)));
        self
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there is no layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl<T: Activation> Module for Sequential<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        for (name, layer) in &mut self.layers {
            v.child(name, layer)?;
        }
        Ok(())
    }
}

impl<T: Activation> Layer<T> for Sequential<T> {
    fn forward(&mut self, ctx: &mut Ctx<'_>, mut x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        for (_, layer) in &mut self.layers {
            x = layer.forward(ctx, x)?;
        }
        Ok(x)
    }

    fn backward_step(
        &mut self,
        ctx: &mut Ctx<'_>,
        mut dy: Tensor<T>,
        need_dx: bool,
    ) -> InputGrad<T> {
        let n = self.layers.len();
        for (i, (name, layer)) in self.layers.iter_mut().enumerate().rev() {
            let need = i > 0 || need_dx;
            match layer.backward_step(ctx, dy, need)? {
                Some(d) => dy = d,
                None if i == 0 => return Ok(None),
                None => {
                    return Err(NnError::usage(
                        name,
                        format!("returned no input gradient (layer {} of {n})", i + 1),
                    ))
                }
            }
        }
        Ok(Some(dy))
    }
}
