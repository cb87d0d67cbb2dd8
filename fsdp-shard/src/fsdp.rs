//! [`FsdpModel`]: the `fully_shard`-style wrapper. It takes a model (a tree of [`Module`]s) by value,
//! builds the flat-parameter layout by visiting it, and during forward and backward drives gather,
//! prefetch, release and reduce-scatter itself, so a model's code is its layers' forward and backward.
//!
//! # How a pass is driven
//! A layer asks the pass's [`Ctx`] for its parameters by id ([`Ctx::params`]). The context knows each
//! parameter's unit (constant time) and acts on the first use of a unit:
//! - **forward**: the unit is gathered (waiting for a prefetch in flight), the previous non-root unit is
//!   released (ZeRO-3; kept when [`FsdpConfig::reshard_after_forward`] is off in training), and the
//!   unit after it in the order recorded by the previous training forward is prefetched;
//! - **backward**: the previous non-root unit's gradients are complete, so it is reduce-scattered and
//!   released, and the unit before this one is prefetched. A gradient for a unit already reduced in
//!   this backward is an error (share parameters through the root unit).
//!
//! The **root** unit (the parameters of no wrapped module: embeddings, a tied LM head, the last
//! layers) is gathered for the whole pass and reduced at the end of the backward; so a parameter used
//! by two modules — a token embedding tied to the LM head — has one gradient, summed in the root unit.
//! At the end of a training forward every non-root unit is released; at the end of a backward every
//! unit is reduced and released. `docs/architecture.md` has the data flow of a step.
//!
//! # A hook on each unit's reduced gradients
//! A [`UnitGradsReady`] hook ([`FsdpModel::backward_with_hook`], or registered with
//! [`FsdpModel::set_grads_hook`] for every backward) is called once per unit and backward, right after
//! the unit's gradients are reduce-scattered into this rank's shards and its gathered parameters are
//! released: the non-root units in the order their gradients complete, then the root unit, then the
//! units that got no gradient. An optimizer steps the unit there and frees its gradient shards
//! (`fsdp-optim`'s step in the backward), so with transient shards
//! ([`ShardedModel::set_transient_grads`]) no more than one unit's gradient shards exist at a time.
//!
//! ```
//! use fsdp_comm::{run_ranks, Communicator, ThreadComm};
//! use fsdp_shard::{Ctx, FsdpConfig, FsdpModel, Mode, Module, ParamDecl, ParamId, ParamKind};
//! use fsdp_shard::{ShardError, Visitor, WrapPolicy};
//! use std::sync::Arc;
//!
//! /// `loss = sum(w)`: the gradient of every weight is 1.
//! struct Sum { w: ParamId }
//! impl Module for Sum {
//!     fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
//!         v.param("w", &ParamDecl::new(&[8], ParamKind::Plain, &|| vec![0.5; 8]), &mut self.w)
//!     }
//! }
//!
//! let sums = run_ranks(2, |comm: ThreadComm| {
//!     let comm: Arc<dyn Communicator> = Arc::new(comm);
//!     let mut model = FsdpModel::new(Sum { w: ParamId::UNSET }, comm, WrapPolicy::Single,
//!                                    FsdpConfig::default())?;
//!     let total = model.forward(Mode::Train, |m, ctx: &mut Ctx<'_>| {
//!         Ok::<_, ShardError>(ctx.plain(m.w)?.to_vec()?.iter().sum::<f32>())
//!     })?;
//!     model.backward(|m, ctx| {
//!         let ones = ctx.device().upload(&[1.0f32; 8])?;
//!         ctx.add_grad(m.w, &ones)
//!     })?;
//!     // Each rank holds half of the reduced gradient: two ranks each added 1 per element.
//!     let shard = model.sharded().unit(0)?.grads[1].to_vec()?;
//!     Ok::<_, ShardError>((total, shard))
//! })?;
//! assert_eq!(sums[0].0, 4.0);
//! assert!(sums[0].1[..8].iter().all(|&g| g == 2.0) || sums[1].1[..8].iter().all(|&g| g == 2.0));
//! # Ok::<(), ShardError>(())
//! ```

use crate::layout::{ModelLayout, ParamGroup, WrapPolicy};
use crate::model::GradDtype;
use crate::model::{FsdpConfig, GatheredParam, PlainParam, ShardedModel};
use crate::module::{
    initial_values, param_specs, Module, ModulePath, ParamDecl, ParamId, ScalingDecl, ScalingId,
    Visitor,
};
use crate::scaling::{ScalingRegistry, ScalingState, ScalingUse};
use crate::ShardError;
use fp8_kernels::{Buffer, CpuParallelism, Device};
use fsdp_comm::Communicator;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Called by the backward as soon as a unit's gradients are reduce-scattered into this rank's shards
/// (see the module docs): the unit's gradients are final for this backward, its gathered parameters are
/// released and it is not used again in the pass, so its shards, gradients and weights may change.
/// Collective where it calls collectives: every rank gets the same calls in the same order.
pub trait UnitGradsReady {
    /// Unit `u`'s gradient shards hold its reduced gradients of this backward (zeros for a unit that got
    /// none; transient shards are allocated before the call).
    fn unit_ready(&mut self, model: &mut ShardedModel, u: usize) -> Result<(), ShardError>;
}

/// Whether a forward pass trains (saves for the backward, records FP8 amaxes, draws dropout masks) or
/// evaluates (none of that; e.g. validation, sampling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A training forward, followed by [`FsdpModel::backward`].
    Train,
    /// A forward without gradients.
    Eval,
}

/// The pass a [`Ctx`] belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A forward pass in the given mode.
    Forward(Mode),
    /// A backward pass.
    Backward,
}

/// Which units are where in the current pass, and the order units were first used in the last training
/// forward (the prefetch order).
#[derive(Debug, Default)]
struct Schedule {
    root: Option<usize>,
    /// Non-root units in the order of their first use in the last training forward.
    forward_order: Vec<usize>,
    /// The order being recorded by the current training forward.
    recording: Vec<usize>,
    seen: Vec<bool>,
    /// The non-root unit in use.
    current: Option<usize>,
    /// Units already reduced in the current backward.
    reduced: Vec<bool>,
    /// Every unit gathered and kept ([`FsdpModel::gather_all`]) until [`FsdpModel::release_all`].
    pinned: bool,
}

impl Schedule {
    fn new(units: usize, root: Option<usize>) -> Self {
        Schedule {
            root,
            forward_order: Vec::new(),
            recording: Vec::new(),
            seen: vec![false; units],
            current: None,
            reduced: vec![false; units],
            pinned: false,
        }
    }

    fn start_pass(&mut self) {
        self.recording.clear();
        self.seen.iter_mut().for_each(|s| *s = false);
        self.reduced.iter_mut().for_each(|r| *r = false);
        self.current = None;
    }

    /// The unit to prefetch after `u`: the next (forward) or previous (backward) in the recorded order.
    fn neighbour(&self, u: usize, backward: bool) -> Option<usize> {
        let i = self.forward_order.iter().position(|&x| x == u)?;
        if backward {
            i.checked_sub(1).map(|j| self.forward_order[j])
        } else {
            self.forward_order.get(i + 1).copied()
        }
    }
}

/// The context of one forward or backward pass: hands out gathered parameters by id, takes gradients,
/// gives the FP8 scaling metas and tells the layers whether they train.
pub struct Ctx<'a> {
    sharded: &'a mut ShardedModel,
    scaling: &'a mut ScalingRegistry,
    schedule: &'a mut Schedule,
    phase: Phase,
    parallelism: CpuParallelism,
    /// Called after each unit's reduction in a backward.
    hook: Option<&'a mut dyn UnitGradsReady>,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("phase", &self.phase).finish()
    }
}

impl Ctx<'_> {
    /// The pass.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether the layers should save what a backward needs, record FP8 amaxes and draw dropout masks:
    /// a training forward, or a forward recomputed inside the backward.
    pub fn is_training(&self) -> bool {
        !matches!(self.phase, Phase::Forward(Mode::Eval))
    }

    /// The device of the model.
    pub fn device(&self) -> &Device {
        self.sharded.device()
    }

    /// Threading of the CPU kernels (GEMMs) of this rank.
    pub fn cpu_parallelism(&self) -> CpuParallelism {
        self.parallelism
    }

    /// Storage type of the model's gradient shards: a layer may write a weight gradient in BF16 when
    /// the shard rounds it to BF16 anyway.
    pub fn grad_dtype(&self) -> GradDtype {
        self.sharded.config().grad_dtype
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.sharded.comm().rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.sharded.comm().world_size()
    }

    fn unit_of(&self, id: ParamId) -> Result<usize, ShardError> {
        id.index()
            .and_then(|p| self.sharded.layout().location(p))
            .map(|l| l.unit)
            .ok_or_else(|| {
                ShardError::InvalidArgument(format!(
                    "parameter id {id:?} is not one of this model's parameters (a module that was not \
                     part of the model when it was wrapped?)"
                ))
            })
    }

    /// Acts on the use of unit `u` (see the module docs); gathers it when `gather`.
    fn touch(&mut self, u: usize, gather: bool) -> Result<(), ShardError> {
        let s = &mut *self.schedule;
        let backward = self.phase == Phase::Backward;
        if backward && s.reduced[u] {
            return Err(ShardError::State(format!(
                "unit {} used again after its gradients were reduced in this backward: a parameter \
                 shared by modules of different units must be in the root unit",
                self.sharded.layout().units[u].name
            )));
        }
        if Some(u) != s.root && s.current != Some(u) && !s.pinned {
            if let Some(c) = s.current {
                if backward {
                    self.sharded.reduce_grads(c)?;
                    self.sharded.release(c)?;
                    s.reduced[c] = true;
                    if let Some(h) = self.hook.as_deref_mut() {
                        self.sharded.ensure_grad_shards(c)?;
                        h.unit_ready(self.sharded, c)?;
                    }
                } else if self.phase == Phase::Forward(Mode::Eval)
                    || self.sharded.config().reshard_after_forward
                {
                    self.sharded.release(c)?;
                }
            }
            s.current = Some(u);
            if !backward && !s.seen[u] {
                s.seen[u] = true;
                if self.phase == Phase::Forward(Mode::Train) {
                    s.recording.push(u);
                }
            }
            if gather {
                self.sharded.wait_gather(u)?;
            }
            // Prefetch the neighbour in the recorded order after this unit's gather is queued, so it
            // overlaps this unit's compute (see `ShardedModel::gather_async`).
            if let Some(n) = s.neighbour(u, backward) {
                if !(backward && s.reduced[n]) && Some(n) != s.root {
                    self.sharded.gather_async(n)?;
                }
            }
            return Ok(());
        }
        if gather {
            self.sharded.wait_gather(u)?;
        }
        Ok(())
    }

    /// The gathered parameters `ids` (each unit gathered on its first use in the pass).
    pub fn params<const N: usize>(
        &mut self,
        ids: [ParamId; N],
    ) -> Result<[&GatheredParam; N], ShardError> {
        for id in ids {
            let u = self.unit_of(id)?;
            if id.index().is_some_and(|p| self.sharded.is_taken(p)) {
                // Taken out earlier in the pass (`Ctx::take_param`): the unit is gathered again.
                self.sharded.release(u)?;
            }
            self.touch(u, true)?;
        }
        let sharded = &*self.sharded;
        let mut out = Vec::with_capacity(N);
        for id in ids {
            let p = id
                .index()
                .ok_or_else(|| ShardError::InvalidArgument("unset parameter id".into()))?;
            out.push(sharded.param(p)?);
        }
        out.try_into()
            .map_err(|_| ShardError::State("parameter count".into()))
    }

    /// Parameter `id` gathered, moved out of its unit for a module that needs it no more in this pass
    /// (see [`ShardedModel::take_param`]): its memory goes when the module drops it, not when the unit
    /// is released. A later use in the pass gathers the unit again. While the model is pinned
    /// ([`FsdpModel::gather_all`]) the module gets a copy and the unit keeps its own.
    pub fn take_param(&mut self, id: ParamId) -> Result<GatheredParam, ShardError> {
        let [_] = self.params([id])?;
        let p = id
            .index()
            .ok_or_else(|| ShardError::InvalidArgument("unset parameter id".into()))?;
        if self.schedule.pinned {
            return self.sharded.param(p)?.try_clone();
        }
        self.sharded.take_param(p)
    }

    /// A gathered plain parameter in F32: an error where the model gathers plain parameters in BF16
    /// ([`crate::FsdpConfig::plain_gather_dtype`]; [`Ctx::plain_param`] takes either).
    pub fn plain(&mut self, id: ParamId) -> Result<&Buffer<f32>, ShardError> {
        match self.plain_param(id)? {
            PlainParam::F32(b) => Ok(b),
            PlainParam::Bf16(_) => Err(ShardError::InvalidArgument(format!(
                "parameter {id:?} is gathered in BF16 (plain_gather_dtype): read it with plain_param"
            ))),
        }
    }

    /// A gathered plain parameter in the type the model gathers plain parameters in.
    pub fn plain_param(&mut self, id: ParamId) -> Result<PlainParam<'_>, ShardError> {
        let [p] = self.params([id])?;
        p.as_plain().ok_or_else(|| {
            ShardError::InvalidArgument(format!(
                "parameter {id:?} is an FP8 weight, not a plain parameter"
            ))
        })
    }

    /// A gathered FP8 weight: E4M3 codes and `[scale, scale_inv]`.
    pub fn fp8_weight(&mut self, id: ParamId) -> Result<(&Buffer<u8>, &Buffer<f32>), ShardError> {
        let [p] = self.params([id])?;
        match p {
            GatheredParam::Fp8 { codes, scales } => Ok((codes, scales)),
            _ => Err(ShardError::InvalidArgument(format!(
                "parameter {id:?} is not a per-tensor FP8 weight"
            ))),
        }
    }

    /// A gathered block-scaled FP8 weight: E4M3 codes `[out, in]` and one inverse scale per 128x128
    /// block in the block-scaled GEMM's order (see [`GatheredParam::Fp8Block`]).
    pub fn fp8_block_weight(
        &mut self,
        id: ParamId,
    ) -> Result<(&Buffer<u8>, &Buffer<f32>), ShardError> {
        let [p] = self.params([id])?;
        match p {
            GatheredParam::Fp8Block {
                codes, scale_inv, ..
            } => Ok((codes, scale_inv)),
            _ => Err(ShardError::InvalidArgument(format!(
                "parameter {id:?} is not a block-scaled FP8 weight"
            ))),
        }
    }

    fn grad_target(&mut self, id: ParamId) -> Result<usize, ShardError> {
        if self.phase != Phase::Backward {
            return Err(ShardError::State(
                "gradients are accepted only in a backward pass".into(),
            ));
        }
        let u = self.unit_of(id)?;
        self.touch(u, false)?;
        id.index()
            .ok_or_else(|| ShardError::InvalidArgument("unset parameter id".into()))
    }

    /// Adds this rank's full gradient of parameter `id` (summed over its uses: a tied parameter gets
    /// one gradient).
    pub fn add_grad(&mut self, id: ParamId, grad: &Buffer<f32>) -> Result<(), ShardError> {
        let p = self.grad_target(id)?;
        self.sharded.add_grad_at(p, grad)
    }

    /// The full gradient of parameter `id` in place: its unit's flat F32 gradient buffer (created zeroed
    /// on first use) and the parameter's offset in it, for a kernel that accumulates into it (`beta = 1`)
    /// instead of adding a temporary of the parameter's size. In a backward pass, or in a training forward
    /// that already knows its loss scale (an LM head that computes its gradients with its loss); a
    /// gradient written in the forward is reduced with the backward's.
    pub fn grad_slot(&mut self, id: ParamId) -> Result<(&mut Buffer<f32>, usize), ShardError> {
        let p = match self.phase {
            Phase::Backward => self.grad_target(id)?,
            Phase::Forward(Mode::Train) => {
                self.unit_of(id)?;
                id.index()
                    .ok_or_else(|| ShardError::InvalidArgument("unset parameter id".into()))?
            }
            Phase::Forward(Mode::Eval) => {
                return Err(ShardError::State(
                    "gradients are accepted only in training passes".into(),
                ))
            }
        };
        let len = self.param_numel(p)?;
        self.sharded.grad_slot_at(p, len)
    }

    /// Elements of parameter `p`.
    fn param_numel(&self, p: usize) -> Result<usize, ShardError> {
        self.sharded
            .layout()
            .params
            .get(p)
            .map(|spec| spec.numel())
            .ok_or_else(|| ShardError::InvalidArgument(format!("no parameter with index {p}")))
    }

    /// [`Ctx::grad_slot`] in a backward pass together with the state of scaling meta `meta` (e.g. the
    /// output gradient's, whose inverse scale the weight-gradient GEMM reads while it accumulates).
    #[allow(clippy::type_complexity)]
    pub fn grad_slot_and_scaling(
        &mut self,
        id: ParamId,
        meta: ScalingId,
    ) -> Result<((&mut Buffer<f32>, usize), &ScalingState), ShardError> {
        let p = self.grad_target(id)?;
        let len = self.param_numel(p)?;
        let state = self.scaling.get(meta)?;
        Ok((self.sharded.grad_slot_at(p, len)?, state))
    }

    /// [`Ctx::add_grad`] for a BF16 gradient.
    pub fn add_grad_bf16(
        &mut self,
        id: ParamId,
        grad: &Buffer<half::bf16>,
    ) -> Result<(), ShardError> {
        let p = self.grad_target(id)?;
        self.sharded.add_grad_bf16_at(p, grad)
    }

    /// The scaling meta `id` for a cast: its state and, when training, the slot its amax accumulates in.
    pub fn scaling(&mut self, id: ScalingId) -> Result<ScalingUse<'_>, ShardError> {
        let record = self.is_training();
        self.scaling.use_meta(id, record)
    }

    /// A gathered FP8 weight (codes, `[scale, scale_inv]`) together with the state of scaling meta
    /// `meta` (e.g. the output gradient's, whose inverse scale a backward GEMM reads beside the weight).
    #[allow(clippy::type_complexity)]
    pub fn fp8_weight_and_scaling(
        &mut self,
        weight: ParamId,
        meta: ScalingId,
    ) -> Result<((&Buffer<u8>, &Buffer<f32>), &ScalingState), ShardError> {
        let u = self.unit_of(weight)?;
        self.touch(u, true)?;
        let index = weight
            .index()
            .ok_or_else(|| ShardError::InvalidArgument("unset parameter id".into()))?;
        let p = self.sharded.param(index)?;
        let state = self.scaling.get(meta)?;
        match p {
            GatheredParam::Fp8 { codes, scales } => Ok(((codes, scales), state)),
            _ => Err(ShardError::InvalidArgument(format!(
                "parameter {weight:?} is not a per-tensor FP8 weight"
            ))),
        }
    }
}

/// A model wrapped for fully sharded data parallelism: the model (a value, owned), this rank's shards of
/// its parameters, its FP8 scaling metas and the pass schedule.
pub struct FsdpModel<M> {
    module: M,
    sharded: ShardedModel,
    scaling: ScalingRegistry,
    schedule: Schedule,
    initial_masters: Option<Vec<Vec<f32>>>,
    parallelism: CpuParallelism,
    /// The hook every backward calls after each unit's reduction ([`FsdpModel::set_grads_hook`]).
    grads_hook: Option<Box<dyn UnitGradsReady + Send>>,
}

impl<M> std::fmt::Debug for FsdpModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpModel")
            .field("sharded", &self.sharded)
            .field("scaling_metas", &self.scaling.len())
            .finish()
    }
}

/// Registers scaling metas and checks that every parameter id is set.
struct StateRegistrar<'a> {
    path: ModulePath,
    device: &'a Device,
    scaling: &'a mut ScalingRegistry,
}

impl Visitor for StateRegistrar<'_> {
    fn path(&mut self) -> &mut ModulePath {
        &mut self.path
    }
    fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
        Ok(())
    }
    fn scaling(
        &mut self,
        local: &str,
        decl: ScalingDecl,
        id: &mut ScalingId,
    ) -> Result<(), ShardError> {
        *id = self
            .scaling
            .register(self.device, self.path.member(local), decl)?;
        Ok(())
    }
}

/// Reads or writes the counters of every module (`counter.<path>`), for checkpoints.
struct Counters<'a> {
    path: ModulePath,
    out: &'a mut BTreeMap<String, String>,
    load: bool,
}

impl Visitor for Counters<'_> {
    fn path(&mut self) -> &mut ModulePath {
        &mut self.path
    }
    fn param(&mut self, _: &str, _: &ParamDecl<'_>, _: &mut ParamId) -> Result<(), ShardError> {
        Ok(())
    }
    fn counter(&mut self, local: &str, value: &mut u64) -> Result<(), ShardError> {
        let key = format!("counter.{}", self.path.member(local));
        if self.load {
            let text = self.out.get(&key).ok_or_else(|| {
                ShardError::Checkpoint(format!("the checkpoint has no {key} (a different model?)"))
            })?;
            *value = text
                .parse()
                .map_err(|e| ShardError::Checkpoint(format!("{key} = {text:?}: {e}")))?;
        } else {
            self.out.insert(key, value.to_string());
        }
        Ok(())
    }
}

impl<M: Module> FsdpModel<M> {
    /// Wraps `module`: visits it to declare its parameters (ids assigned in visit order) and scaling
    /// metas, groups the parameters into units by `policy`, and shards them over `comm`'s ranks from their
    /// initial values (made one unit at a time). FP8 weights are cast with current scaling.
    pub fn new(
        mut module: M,
        comm: Arc<dyn Communicator>,
        policy: WrapPolicy,
        config: FsdpConfig,
    ) -> Result<Self, ShardError> {
        let specs = param_specs(&mut module)?;
        if specs.is_empty() {
            return Err(ShardError::InvalidModel(
                "the model declares no parameter".into(),
            ));
        }
        let layout = Arc::new(ModelLayout::new(specs, &policy)?);
        let device = comm.device().clone();
        let mut scaling = ScalingRegistry::new(&device)?;
        module.visit(&mut StateRegistrar {
            path: ModulePath::root(),
            device: &device,
            scaling: &mut scaling,
        })?;
        let seed = config.init_seed;
        let (sharded, masters) =
            ShardedModel::with_unit_init(layout.clone(), comm, config, &mut |wanted| {
                initial_values(&mut module, wanted, seed)
            })?;
        let schedule = Schedule::new(layout.units.len(), layout.root_unit());
        Ok(FsdpModel {
            module,
            sharded,
            scaling,
            schedule,
            initial_masters: Some(masters),
            parallelism: CpuParallelism::default(),
            grads_hook: None,
        })
    }

    /// The model.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The model, mutable (e.g. to change a layer's option between passes).
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// This rank's shards and the collectives (for optimizers and checkpoints).
    pub fn sharded(&self) -> &ShardedModel {
        &self.sharded
    }

    /// This rank's shards, mutable (for optimizers).
    pub fn sharded_mut(&mut self) -> &mut ShardedModel {
        &mut self.sharded
    }

    /// The shards and the scaling metas, mutable together (an optimizer step agrees both).
    pub fn parts_mut(&mut self) -> (&mut ShardedModel, &mut ScalingRegistry) {
        (&mut self.sharded, &mut self.scaling)
    }

    /// The FP8 scaling metas of the model's activations and output gradients.
    pub fn scaling(&self) -> &ScalingRegistry {
        &self.scaling
    }

    /// The F32 master shards of the FP8 weights made at construction (one per unit, for the optimizer
    /// that will own them); `None` once taken.
    pub fn take_initial_masters(&mut self) -> Option<Vec<Vec<f32>>> {
        self.initial_masters.take()
    }

    /// The layout.
    pub fn layout(&self) -> &Arc<ModelLayout> {
        self.sharded.layout()
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.sharded.device()
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        self.sharded.comm()
    }

    /// Sets the threading of this rank's CPU kernels (one thread per rank when ranks are threads of one
    /// process; the default lets the kernels use rayon's pool).
    pub fn set_cpu_parallelism(&mut self, parallelism: CpuParallelism) {
        self.parallelism = parallelism;
    }

    fn ctx<'s>(
        &'s mut self,
        phase: Phase,
        hook: Option<&'s mut dyn UnitGradsReady>,
    ) -> (&'s mut M, Ctx<'s>) {
        (
            &mut self.module,
            Ctx {
                sharded: &mut self.sharded,
                scaling: &mut self.scaling,
                schedule: &mut self.schedule,
                phase,
                parallelism: self.parallelism,
                hook,
            },
        )
    }

    /// Registers the hook every following backward calls after each unit's reduction (see the module
    /// docs), or removes it (`None`); returns the previous one. [`FsdpModel::backward_with_hook`] takes
    /// a hook for one backward instead.
    pub fn set_grads_hook(
        &mut self,
        hook: Option<Box<dyn UnitGradsReady + Send>>,
    ) -> Option<Box<dyn UnitGradsReady + Send>> {
        std::mem::replace(&mut self.grads_hook, hook)
    }

    /// Whether a hook is registered ([`FsdpModel::set_grads_hook`]).
    pub fn has_grads_hook(&self) -> bool {
        self.grads_hook.is_some()
    }

    /// Runs a forward pass: `f` calls the model's forward with the pass's context. Afterwards the non-root
    /// units are released (in training, unless [`FsdpConfig::reshard_after_forward`] is off) and the
    /// order of first use is kept for prefetching.
    pub fn forward<R, E: From<ShardError>>(
        &mut self,
        mode: Mode,
        f: impl FnOnce(&mut M, &mut Ctx<'_>) -> Result<R, E>,
    ) -> Result<R, E> {
        self.schedule.start_pass();
        let (module, mut ctx) = self.ctx(Phase::Forward(mode), None);
        let r = f(module, &mut ctx);
        let end = self.end_forward(mode);
        let r = r?;
        end?;
        Ok(r)
    }

    fn end_forward(&mut self, mode: Mode) -> Result<(), ShardError> {
        let release = !self.schedule.pinned
            && (mode == Mode::Eval || self.sharded.config().reshard_after_forward);
        for u in 0..self.sharded.num_units() {
            if Some(u) != self.schedule.root && release {
                self.sharded.release(u)?;
            }
        }
        self.schedule.current = None;
        if mode == Mode::Train && !self.schedule.recording.is_empty() {
            self.schedule.forward_order = std::mem::take(&mut self.schedule.recording);
            // The backward starts with the last unit of the forward: prefetch it now, so it arrives
            // while the loss and the root's layers run.
            if let Some(&last) = self.schedule.forward_order.last() {
                self.sharded.gather_async(last)?;
            }
        }
        Ok(())
    }

    /// Runs a backward pass after a training forward: `f` calls the model's backward with the pass's
    /// context. Units are reduce-scattered as soon as their gradients are complete; at the end every
    /// unit is reduced (or kept for accumulation in no-sync mode, see
    /// [`ShardedModel::set_grad_sync`]) and released. A registered hook
    /// ([`FsdpModel::set_grads_hook`]) is called after each unit's reduction.
    pub fn backward<R, E: From<ShardError>>(
        &mut self,
        f: impl FnOnce(&mut M, &mut Ctx<'_>) -> Result<R, E>,
    ) -> Result<R, E> {
        // Taken out for the pass, so the pass borrows it beside the model's other parts.
        let mut hook = self.grads_hook.take();
        let r = self.run_backward(hook.as_deref_mut().map(|h| h as &mut dyn UnitGradsReady), f);
        self.grads_hook = hook;
        r
    }

    /// [`FsdpModel::backward`] calling `hook` once per unit right after the unit's gradients are
    /// reduce-scattered into this rank's shards (see the module docs), instead of a registered hook.
    /// The gradients must be reduced in this backward: no-sync accumulation
    /// ([`FsdpModel::set_grad_sync`] off) is refused. When `f` fails, no further unit is handed to the
    /// hook.
    pub fn backward_with_hook<R, E: From<ShardError>>(
        &mut self,
        hook: &mut dyn UnitGradsReady,
        f: impl FnOnce(&mut M, &mut Ctx<'_>) -> Result<R, E>,
    ) -> Result<R, E> {
        self.run_backward(Some(hook), f)
    }

    fn run_backward<R, E: From<ShardError>>(
        &mut self,
        mut hook: Option<&mut dyn UnitGradsReady>,
        f: impl FnOnce(&mut M, &mut Ctx<'_>) -> Result<R, E>,
    ) -> Result<R, E> {
        if hook.is_some() && !self.sharded.grad_sync() {
            return Err(ShardError::State(
                "a hook on reduced gradients (an optimizer step in the backward) needs the gradients \
                 reduced in this backward; with gradient sync off (accumulation over micro-batches) \
                 they are not"
                    .into(),
            )
            .into());
        }
        self.schedule.start_pass();
        let pass_hook = hook.as_deref_mut().map(|h| h as &mut dyn UnitGradsReady);
        let (module, mut ctx) = self.ctx(Phase::Backward, pass_hook);
        let r = f(module, &mut ctx);
        let end = self.end_backward(if r.is_ok() { hook } else { None });
        let r = r?;
        end?;
        Ok(r)
    }

    fn end_backward(
        &mut self,
        mut hook: Option<&mut dyn UnitGradsReady>,
    ) -> Result<(), ShardError> {
        let s = &mut self.schedule;
        // The unit in use, the root unit, then the units whose gradients came without a use of their
        // parameters in this backward (or none came): each reduced, released and handed to the hook.
        let mut last: Vec<usize> = s.current.take().into_iter().collect();
        if let Some(r) = s.root {
            last.push(r);
        }
        for u in 0..self.sharded.num_units() {
            if !s.reduced[u] && !last.contains(&u) {
                last.push(u);
            }
        }
        for u in last {
            self.sharded.reduce_grads(u)?;
            self.schedule.reduced[u] = true;
            if let Some(h) = hook.as_deref_mut() {
                self.sharded.release(u)?;
                // A unit that got no gradient is handed over with zeroed shards (transient ones made).
                self.sharded.ensure_grad_shards(u)?;
                h.unit_ready(&mut self.sharded, u)?;
            }
        }
        self.release_all()
    }

    /// Frees every gathered unit (e.g. after an evaluation loop, before an optimizer step) and ends
    /// [`FsdpModel::gather_all`].
    pub fn release_all(&mut self) -> Result<(), ShardError> {
        for u in 0..self.sharded.num_units() {
            self.sharded.release(u)?;
        }
        self.schedule.current = None;
        self.schedule.pinned = false;
        Ok(())
    }

    /// Gathers every unit and keeps them until [`FsdpModel::release_all`]: for a loop of evaluation
    /// forwards (no collective per pass, so ranks with fewer batches than others cannot deadlock the
    /// group, and no gather is repeated). Collective.
    pub fn gather_all(&mut self) -> Result<(), ShardError> {
        for u in 0..self.sharded.num_units() {
            self.sharded.gather(u)?;
        }
        self.schedule.pinned = true;
        Ok(())
    }

    /// The module state for checkpoints: every scaling meta (`scaling.<name>`) and every counter
    /// (`counter.<name>`), as exact text.
    pub fn export_module_state(&mut self) -> Result<BTreeMap<String, String>, ShardError> {
        let mut out = self.scaling.export()?;
        self.module.visit(&mut Counters {
            path: ModulePath::root(),
            out: &mut out,
            load: false,
        })?;
        Ok(out)
    }

    /// Restores what [`FsdpModel::export_module_state`] wrote.
    pub fn import_module_state(
        &mut self,
        values: &BTreeMap<String, String>,
    ) -> Result<(), ShardError> {
        self.scaling.import(values)?;
        let mut copy = values.clone();
        self.module.visit(&mut Counters {
            path: ModulePath::root(),
            out: &mut copy,
            load: true,
        })
    }

    /// Whether the next backwards reduce their gradients (the default) or keep them in the full
    /// buffers for the next micro-batch (no-sync accumulation; see [`ShardedModel::set_grad_sync`]).
    pub fn set_grad_sync(&mut self, sync: bool) {
        self.sharded.set_grad_sync(sync);
    }

    /// Divides every following gradient reduction by `divisor` (see [`FsdpConfig::grad_divisor`]): pass
    /// `world_size * micro_batches` for the mean over a global batch.
    pub fn set_grad_divisor(&mut self, divisor: f32) -> Result<(), ShardError> {
        self.sharded.set_grad_divisor(divisor)
    }

    /// Saves a sharded checkpoint of the model (its shards and its module state: FP8 scaling metas and
    /// counters), the optimizer's `state` and the caller's key/values `extra` into `dir`
    /// (crash-consistent, see [`crate::checkpoint::save_sharded`]). Collective: every rank calls it.
    pub fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
        state: Option<&dyn crate::ShardedState>,
        extra: &BTreeMap<String, String>,
    ) -> Result<(), ShardError> {
        let mut all = extra.clone();
        all.extend(self.export_module_state()?);
        crate::checkpoint::save_sharded(dir, &self.sharded, state, &all)
    }

    /// Loads what [`FsdpModel::save_checkpoint`] wrote (at any world size: shards are resharded) into the
    /// model and the optimizer's `state`, restores the module state, and returns the checkpoint's key/values
    /// with the saved world size.
    pub fn load_checkpoint(
        &mut self,
        dir: &std::path::Path,
        state: Option<&mut dyn crate::ShardedState>,
    ) -> Result<crate::checkpoint::LoadedCheckpoint, ShardError> {
        let loaded = crate::checkpoint::load_sharded(dir, &mut self.sharded, state)?;
        self.import_module_state(&loaded.extra)?;
        Ok(loaded)
    }

    /// Every parameter gathered as F32 (FP8 weights decoded with their scale), by name in visit order.
    /// Collective: every rank calls it.
    pub fn gathered_params(&mut self) -> Result<Vec<(String, Vec<f32>)>, ShardError> {
        self.release_all()?;
        let names = crate::module::param_names(&mut self.module)?;
        // Exact F32 plain values even where compute gathers them in BF16.
        for u in 0..self.sharded.num_units() {
            self.sharded.gather_exact(u)?;
        }
        let mut out = Vec::with_capacity(names.len());
        for (name, id) in names {
            let p = id
                .index()
                .ok_or_else(|| ShardError::State(format!("{name}: unset id")))?;
            out.push((name, self.sharded.param(p)?.to_f32_vec()?));
        }
        self.release_all()?;
        Ok(out)
    }

    /// Loads a consolidated file of full weights by parameter name (safetensors, F32, BF16 or F16
    /// tensors, e.g. one written by `fsdp_optim::export_full` at any world size, or by PyTorch): see
    /// [`FsdpModel::import_from`].
    pub fn import_full(
        &mut self,
        path: &std::path::Path,
        strict: bool,
    ) -> Result<Vec<String>, ShardError> {
        let file = crate::full_weights::SafetensorsFile::read(path)?;
        self.import_from(&file, strict)
    }

    /// Loads full weights by parameter name from `source` into this rank's shards: plain parameters
    /// directly, FP8 weights into the master shards the optimizer will take and into their E4M3 shards,
    /// cast with current scaling from the full tensor's amax (the same on every rank, with no
    /// collective). Call it before the optimizer is created. Every parameter must be in the source with
    /// its shape and finite values; with `strict`, the source may hold nothing else. Returns the names
    /// loaded.
    pub fn import_from(
        &mut self,
        source: &dyn crate::full_weights::FullWeights,
        strict: bool,
    ) -> Result<Vec<String>, ShardError> {
        let masters = self.initial_masters.as_mut().ok_or_else(|| {
            ShardError::State(
                "import full weights before the optimizer is created (it owns the FP8 master \
                 weights once it takes them)"
                    .into(),
            )
        })?;
        let origin = source.origin();
        let names = crate::module::param_names(&mut self.module)?;
        let mut loaded = Vec::with_capacity(names.len());
        for (name, id) in &names {
            let p = id
                .index()
                .ok_or_else(|| ShardError::State(format!("{name}: unset id")))?;
            let crate::full_weights::FullTensor { shape, values, .. } = source
                .tensor(name)
                .map_err(|e| ShardError::Checkpoint(format!("{origin}: {name}: {e}")))?
                .ok_or_else(|| {
                    ShardError::Checkpoint(format!(
                        "{origin} has no tensor {name} (the model's parameter names are \
                         PyTorch-style, e.g. {})",
                        names.first().map_or("", |(n, _)| n.as_str())
                    ))
                })?;
            let spec = &self.sharded.layout().params[p];
            if shape != spec.shape {
                return Err(ShardError::Checkpoint(format!(
                    "{origin}: {name} has shape {shape:?}, the model's is {:?}",
                    spec.shape
                )));
            }
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                let bad = values.iter().filter(|v| !v.is_finite()).count();
                return Err(ShardError::Checkpoint(format!(
                    "{origin}: {name} holds {bad} non-finite value(s) (the first, element {i}, is \
                     {}); a model cannot start from them",
                    values[i]
                )));
            }
            self.sharded.set_param_full(p, &values, masters)?;
            loaded.push(name.clone());
        }
        if strict {
            let known: std::collections::HashSet<&str> =
                names.iter().map(|(n, _)| n.as_str()).collect();
            let mut extra: Vec<String> = source
                .names()
                .into_iter()
                .filter(|n| !known.contains(n.as_str()))
                .collect();
            extra.sort_unstable();
            if !extra.is_empty() {
                return Err(ShardError::Checkpoint(format!(
                    "{origin} holds tensors the model does not have: {}",
                    extra.join(", ")
                )));
            }
        }
        Ok(loaded)
    }

    /// Every parameter's name with its id, in declaration order (the names of
    /// [`FsdpModel::import_full`] and of exported files).
    pub fn param_names(&mut self) -> Result<Vec<(String, ParamId)>, ShardError> {
        crate::module::param_names(&mut self.module)
    }

    /// Number of parameters (each tied parameter once).
    pub fn num_params(&self) -> usize {
        self.sharded.layout().numel()
    }

    /// Whether unit `u` is the root unit.
    pub fn is_root_unit(&self, u: usize) -> bool {
        self.schedule.root == Some(u)
    }

    /// The group a parameter is stored in.
    pub fn param_group(&self, id: ParamId) -> Option<ParamGroup> {
        id.index()
            .and_then(|p| self.sharded.layout().location(p))
            .map(|l| l.group)
    }
}
