//! The module trait: a model is a tree of modules that declare their parameters and state to a
//! [`Visitor`]; the sharded model ([`crate::FsdpModel`]) builds its layout from that visit and hands the
//! modules typed ids ([`ParamId`], [`ScalingId`]) to reach their gathered parameters and FP8 scaling state
//! during forward and backward. See `docs/architecture.md`.
//!
//! A module implements one method, [`Module::visit`]: it names its parameters (shape, kind, initial
//! values), its FP8 scaling metas and its counters (e.g. a dropout generator's position), and its child
//! modules. The same visit serves every purpose — registration (ids are assigned), checkpoints of module
//! state, export and import of weights by name — so a model has no hand-written glue per purpose.
//!
//! ```
//! use fsdp_shard::{Module, ParamDecl, ParamId, ParamKind, ShardError, Visitor};
//!
//! /// `y = x w` with one weight, for illustration.
//! struct Scale { w: ParamId }
//!
//! impl Module for Scale {
//!     fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
//!         v.param("weight", &ParamDecl::new(&[4], ParamKind::Plain, &|| vec![1.0; 4]), &mut self.w)
//!     }
//! }
//!
//! struct Pair { a: Scale, b: Scale }
//!
//! impl Module for Pair {
//!     fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
//!         v.child("a", &mut self.a)?;
//!         v.child("b", &mut self.b)
//!     }
//! }
//!
//! let mut m = Pair { a: Scale { w: ParamId::UNSET }, b: Scale { w: ParamId::UNSET } };
//! let names: Vec<String> = fsdp_shard::module::param_specs(&mut m)?
//!     .into_iter()
//!     .map(|spec| spec.name)
//!     .collect();
//! assert_eq!(names, ["a.weight", "b.weight"]);
//! assert_eq!(m.b.w.index(), Some(1)); // ids assigned in visit order
//! # Ok::<(), ShardError>(())
//! ```

use crate::layout::{ParamKind, ParamSpec};
use crate::ShardError;
use fp8_core::{QType, ScalingRecipe};

/// The typed id of a parameter of a sharded model: its index in the layout's parameter list, assigned
/// when the model is built. A module keeps the id of each of its parameters and asks the context for
/// the gathered tensor by id (no string look-up per step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(u32);

impl ParamId {
    /// An id not yet assigned (a module before the model is built).
    pub const UNSET: ParamId = ParamId(u32::MAX);

    /// The id of parameter `index` (assigned by the model; public for layouts built by hand).
    pub fn from_index(index: usize) -> Result<Self, ShardError> {
        u32::try_from(index)
            .ok()
            .filter(|&i| i != u32::MAX)
            .map(ParamId)
            .ok_or_else(|| ShardError::InvalidModel(format!("parameter index {index} too large")))
    }

    /// The index, or `None` when unset.
    pub fn index(self) -> Option<usize> {
        (self != Self::UNSET).then_some(self.0 as usize)
    }
}

impl Default for ParamId {
    fn default() -> Self {
        Self::UNSET
    }
}

/// The typed id of an FP8 scaling meta (an activation's or an output gradient's) held by the sharded
/// model on behalf of a module, so every meta of the model is agreed across ranks in one all-reduce and
/// saved in checkpoints without code per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScalingId(u32);

impl ScalingId {
    /// An id not yet assigned.
    pub const UNSET: ScalingId = ScalingId(u32::MAX);

    pub(crate) fn from_index(index: usize) -> Result<Self, ShardError> {
        u32::try_from(index)
            .ok()
            .filter(|&i| i != u32::MAX)
            .map(ScalingId)
            .ok_or_else(|| {
                ShardError::InvalidModel(format!("scaling meta index {index} too large"))
            })
    }

    /// The index, or `None` when unset.
    pub fn index(self) -> Option<usize> {
        (self != Self::UNSET).then_some(self.0 as usize)
    }
}

impl Default for ScalingId {
    fn default() -> Self {
        Self::UNSET
    }
}

/// How a parameter's initial values are made (row-major f32; called once, when the model is built, the
/// same on every rank).
#[derive(Clone, Copy)]
pub enum ParamInit<'a> {
    /// Values that need no randomness (ones, zeros) or a layer's own explicit seed.
    Fixed(&'a dyn Fn() -> Vec<f32>),
    /// Values drawn from the parameter's seed ([`param_seed`] of the model's seed and the parameter's
    /// dotted name), so two parameters never share a stream and the values do not depend on the order in
    /// which layers were built.
    Seeded(&'a dyn Fn(u64) -> Vec<f32>),
}

impl ParamInit<'_> {
    /// The values, `seed` being the parameter's seed.
    pub fn values(&self, seed: u64) -> Vec<f32> {
        match self {
            ParamInit::Fixed(f) => f(),
            ParamInit::Seeded(f) => f(seed),
        }
    }
}

/// The seed of parameter `name` in a model seeded with `model_seed`: a hash of the dotted name (FNV-1a)
/// mixed with the seed (SplitMix64's finaliser). Stable across builds and platforms.
pub fn param_seed(model_seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = model_seed ^ h;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A parameter as a module declares it: shape, kind, whether weight decay applies, and how to make its
/// initial values.
pub struct ParamDecl<'a> {
    /// Shape (row-major).
    pub shape: &'a [usize],
    /// Kind, which decides how it is stored and gathered.
    pub kind: ParamKind,
    /// Whether decoupled weight decay / L2 applies to it (optimizer parameter groups). Default: matrices
    /// (two or more dimensions) decay, vectors (biases, norm weights) do not.
    pub decay: bool,
    /// The initial values.
    pub init: ParamInit<'a>,
}

impl<'a> ParamDecl<'a> {
    /// A parameter with fixed initial values (no seed) and the default decay rule (matrices decay,
    /// vectors do not).
    pub fn new(shape: &'a [usize], kind: ParamKind, init: &'a dyn Fn() -> Vec<f32>) -> Self {
        ParamDecl {
            shape,
            kind,
            decay: shape.len() >= 2,
            init: ParamInit::Fixed(init),
        }
    }

    /// A parameter whose initial values are drawn from its own seed (see [`ParamInit::Seeded`]).
    pub fn seeded(shape: &'a [usize], kind: ParamKind, init: &'a dyn Fn(u64) -> Vec<f32>) -> Self {
        ParamDecl {
            shape,
            kind,
            decay: shape.len() >= 2,
            init: ParamInit::Seeded(init),
        }
    }

    /// Overrides the decay rule.
    pub fn with_decay(mut self, decay: bool) -> Self {
        self.decay = decay;
        self
    }
}

/// An FP8 scaling meta as a module declares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalingDecl {
    /// FP8 type of the cast it scales (E4M3 activations, E5M2 gradients).
    pub qtype: QType,
    /// Delayed (amax history) or current scaling.
    pub recipe: ScalingRecipe,
}

/// The path of the module being visited, e.g. `h.3.attn`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModulePath {
    parts: Vec<String>,
}

impl ModulePath {
    /// The empty (root) path.
    pub fn root() -> Self {
        Self::default()
    }

    /// Enters a child.
    pub fn push(&mut self, name: &str) {
        self.parts.push(name.to_string());
    }

    /// Leaves the current child.
    pub fn pop(&mut self) {
        self.parts.pop();
    }

    /// The module's dotted name (`""` at the root).
    pub fn module(&self) -> String {
        self.parts.join(".")
    }

    /// The dotted name of a member `local` of the current module (`h.3.attn.weight`).
    pub fn member(&self, local: &str) -> String {
        if self.parts.is_empty() {
            local.to_string()
        } else {
            format!("{}.{local}", self.parts.join("."))
        }
    }
}

/// What a [`Module`] declares itself to. Implementations decide what to do with each declaration:
/// register it, save it, load it. The path of the current module is kept by [`Visitor::path`];
/// [`Visitor::child`] (on `dyn Visitor`) enters and leaves children.
pub trait Visitor {
    /// The path of the module being visited.
    fn path(&mut self) -> &mut ModulePath;

    /// A parameter named `local` within the current module. A registering visitor assigns `id`; others
    /// read it.
    fn param(
        &mut self,
        local: &str,
        decl: &ParamDecl<'_>,
        id: &mut ParamId,
    ) -> Result<(), ShardError>;

    /// An FP8 scaling meta named `local`. A registering visitor creates the meta and assigns `id`.
    fn scaling(
        &mut self,
        _local: &str,
        _decl: ScalingDecl,
        _id: &mut ScalingId,
    ) -> Result<(), ShardError> {
        Ok(())
    }

    /// A counter of module state (a random generator's position, a step count) to save in checkpoints.
    fn counter(&mut self, _local: &str, _value: &mut u64) -> Result<(), ShardError> {
        Ok(())
    }

    /// Called by [`Visitor::child`] with each child module (the path already entered) before the child
    /// declares itself: the hook of a pass that acts on modules of a type rather than on declarations
    /// (the FP8 conversion of linears finds them here through [`Module::as_any_mut`]).
    fn module(&mut self, _module: &mut dyn Module) -> Result<(), ShardError> {
        Ok(())
    }
}

impl dyn Visitor + '_ {
    /// Visits child module `name` of the current module.
    pub fn child(&mut self, name: &str, module: &mut dyn Module) -> Result<(), ShardError> {
        self.path().push(name);
        let r = self.module(module).and_then(|()| module.visit(self));
        self.path().pop();
        r
    }
}

/// A part of a model: declares its parameters, scaling metas, counters and children.
///
/// Forward and backward are the module's own methods (their inputs differ from module to module); they
/// take the [`crate::Ctx`] of the pass, which hands out gathered parameters by id and takes gradients.
pub trait Module {
    /// Declares everything the module holds to `v`, children included (see [`Visitor::child`]).
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError>;

    /// The module as [`std::any::Any`], for a pass that changes modules of one type before the model is
    /// wrapped (see [`Visitor::module`]); `None` (the default) for modules no pass looks for.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

impl<M: Module> Module for Vec<M> {
    /// Children named `0`, `1`, ... (PyTorch's `ModuleList`).
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        for (i, m) in self.iter_mut().enumerate() {
            v.child(&i.to_string(), m)?;
        }
        Ok(())
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        (**self).visit(v)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        (**self).as_any_mut()
    }
}

/// Visits `module`, assigns every parameter its id (in visit order) and returns the parameters' specs
/// (initial values are not made here; see [`initial_values`]). A tied parameter is one id held by two
/// modules and declared by one of them.
pub fn param_specs(module: &mut dyn Module) -> Result<Vec<ParamSpec>, ShardError> {
    struct Registrar {
        path: ModulePath,
        out: Vec<ParamSpec>,
    }
    impl Visitor for Registrar {
        fn path(&mut self) -> &mut ModulePath {
            &mut self.path
        }
        fn param(
            &mut self,
            local: &str,
            decl: &ParamDecl<'_>,
            id: &mut ParamId,
        ) -> Result<(), ShardError> {
            let name = self.path.member(local);
            if decl.shape.is_empty() || decl.shape.contains(&0) {
                return Err(ShardError::InvalidModel(format!(
                    "parameter {name} has shape {:?}; every dimension must be at least 1",
                    decl.shape
                )));
            }
            if decl
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .is_none()
            {
                return Err(ShardError::InvalidModel(format!(
                    "parameter {name}: shape {:?} overflows",
                    decl.shape
                )));
            }
            *id = ParamId::from_index(self.out.len())?;
            self.out.push(ParamSpec {
                name,
                module: self.path.module(),
                shape: decl.shape.to_vec(),
                kind: decl.kind,
                decay: decl.decay,
            });
            Ok(())
        }
    }
    let mut r = Registrar {
        path: ModulePath::root(),
        out: Vec::new(),
    };
    module.visit(&mut r)?;
    Ok(r.out)
}

/// The initial values of the parameters with indices `wanted` (in that order), made by visiting the
/// module (the `init` of each declaration is called only for those, seeded ones with
/// [`param_seed`]`(model_seed, name)`). Each must have its shape's size.
pub fn initial_values(
    module: &mut dyn Module,
    wanted: &[usize],
    model_seed: u64,
) -> Result<Vec<Vec<f32>>, ShardError> {
    struct InitValues<'a> {
        path: ModulePath,
        model_seed: u64,
        wanted: &'a [usize],
        out: Vec<Option<Vec<f32>>>,
        next: usize,
    }
    impl Visitor for InitValues<'_> {
        fn path(&mut self) -> &mut ModulePath {
            &mut self.path
        }
        fn param(
            &mut self,
            local: &str,
            decl: &ParamDecl<'_>,
            _id: &mut ParamId,
        ) -> Result<(), ShardError> {
            let i = self.next;
            self.next += 1;
            if let Some(k) = self.wanted.iter().position(|&w| w == i) {
                let name = self.path.member(local);
                let values = decl.init.values(param_seed(self.model_seed, &name));
                let numel: usize = decl.shape.iter().product();
                if values.len() != numel {
                    return Err(ShardError::InvalidModel(format!(
                        "initial values of {} have {} elements, its shape {:?} needs {numel}",
                        self.path.member(local),
                        values.len(),
                        decl.shape
                    )));
                }
                self.out[k] = Some(values);
            }
            Ok(())
        }
    }
    let mut v = InitValues {
        path: ModulePath::root(),
        model_seed,
        wanted,
        out: vec![None; wanted.len()],
        next: 0,
    };
    module.visit(&mut v)?;
    v.out
        .into_iter()
        .zip(wanted)
        .map(|(o, p)| {
            o.ok_or_else(|| {
                ShardError::InvalidModel(format!(
                    "parameter {p} was not declared again (a module's visit must declare the same \
                     parameters every time)"
                ))
            })
        })
        .collect()
}

/// Every parameter's name with its id, in visit order (for export and import by name).
pub fn param_names(module: &mut dyn Module) -> Result<Vec<(String, ParamId)>, ShardError> {
    struct Names {
        path: ModulePath,
        out: Vec<(String, ParamId)>,
    }
    impl Visitor for Names {
        fn path(&mut self) -> &mut ModulePath {
            &mut self.path
        }
        fn param(
            &mut self,
            local: &str,
            _decl: &ParamDecl<'_>,
            id: &mut ParamId,
        ) -> Result<(), ShardError> {
            self.out.push((self.path.member(local), *id));
            Ok(())
        }
    }
    let mut n = Names {
        path: ModulePath::root(),
        out: Vec::new(),
    };
    module.visit(&mut n)?;
    Ok(n.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Leaf {
        w: ParamId,
        n: usize,
        count: u64,
    }

    impl Module for Leaf {
        fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
            let n = self.n;
            let init = move || (0..n).map(|i| i as f32).collect();
            v.param(
                "w",
                &ParamDecl::new(&[n], ParamKind::Plain, &init),
                &mut self.w,
            )?;
            v.counter("count", &mut self.count)
        }
    }

    #[test]
    fn registration_assigns_ids_in_visit_order_with_dotted_names() {
        let leaf = |n| Leaf {
            w: ParamId::UNSET,
            n,
            count: 0,
        };
        let mut blocks = vec![leaf(2), leaf(3)];
        let specs = param_specs(&mut blocks).unwrap();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["0.w", "1.w"]);
        assert_eq!(specs[1].module, "1");
        assert_eq!(
            initial_values(&mut blocks, &[1], 0).unwrap(),
            vec![vec![0.0, 1.0, 2.0]]
        );
        assert!(!specs[0].decay, "vectors do not decay by default");
        assert_eq!(blocks[1].w.index(), Some(1));
        assert_eq!(
            param_names(&mut blocks).unwrap(),
            vec![
                ("0.w".to_string(), ParamId(0)),
                ("1.w".to_string(), ParamId(1))
            ]
        );
    }

    #[test]
    fn bad_declarations_are_errors() {
        let mut zero = Leaf {
            w: ParamId::UNSET,
            n: 0,
            count: 0,
        };
        assert!(param_specs(&mut zero).is_err());
        struct Wrong(ParamId);
        impl Module for Wrong {
            fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
                v.param(
                    "w",
                    &ParamDecl::new(&[2, 2], ParamKind::Plain, &|| vec![0.0; 3]),
                    &mut self.0,
                )
            }
        }
        let mut wrong = Wrong(ParamId::UNSET);
        param_specs(&mut wrong).unwrap();
        let e = initial_values(&mut wrong, &[0], 0).unwrap_err();
        assert!(e.to_string().contains("w"), "{e}");
    }
}
