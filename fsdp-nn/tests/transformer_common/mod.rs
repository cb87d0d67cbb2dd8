//! Shared by the transformer layer tests: a one-rank model on the CPU, parameter access by id, an input
//! held as a parameter (so finite differences cover the input gradient), and directional finite
//! differences.
#![allow(dead_code)]

use fp8_kernels::rng::SplitMix64;
use fsdp_comm::{Communicator, ThreadGroup};
use fsdp_nn::{NnError, Shape, Tensor};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GatheredParam, Module, ParamDecl, ParamId, ParamKind, ShardError,
    Visitor, WrapPolicy,
};
use std::sync::Arc;
use std::time::Duration;

/// A one-rank model of `module` on the CPU (F32 gradients, one unit).
pub fn one_rank<M: Module>(module: M) -> FsdpModel<M> {
    let comm: Arc<dyn Communicator> = Arc::new(
        ThreadGroup::new(1, Duration::from_secs(120))
            .unwrap()
            .pop()
            .unwrap(),
    );
    FsdpModel::new(module, comm, WrapPolicy::Single, FsdpConfig::default()).unwrap()
}

/// `n` values uniform in `[-a, a)` from `seed`.
pub fn uniform(n: usize, a: f32, seed: u64) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| (2.0 * r.uniform_f32() - 1.0) * a).collect()
}

/// The current values of plain parameter `id` (one rank: the shard is the whole parameter).
pub fn values<M: Module>(model: &FsdpModel<M>, id: ParamId) -> Vec<f32> {
    let (u, _, slot) = model.layout().locate(id.index().unwrap()).unwrap();
    let shard = model.sharded().unit(u).unwrap().plain.to_vec().unwrap();
    shard[slot.offset..slot.offset + slot.numel].to_vec()
}

/// Overwrites plain parameter `id` (released first, so the next pass gathers the new values).
pub fn set_values<M: Module>(model: &mut FsdpModel<M>, id: ParamId, v: &[f32]) {
    model.release_all().unwrap();
    let (u, _, slot) = model.layout().locate(id.index().unwrap()).unwrap();
    let (off, n) = (slot.offset, slot.numel);
    assert_eq!(v.len(), n);
    let unit = model.sharded_mut().unit_mut(u).unwrap();
    unit.plain.host_mut("test").unwrap()[off..off + n].copy_from_slice(v);
}

/// The reduced gradient of parameter `id` (one rank, F32 shards).
pub fn grad<M: Module>(model: &FsdpModel<M>, id: ParamId) -> Vec<f32> {
    let (u, g, slot) = model.layout().locate(id.index().unwrap()).unwrap();
    let shard = model
        .sharded()
        .unit(u)
        .unwrap()
        .grad(g)
        .to_f32_vec()
        .unwrap();
    shard[slot.offset..slot.offset + slot.numel].to_vec()
}

/// An input tensor held as a parameter `<path>.x`: its gradient is the layer's input gradient.
pub struct Source {
    pub id: ParamId,
    shape: Vec<usize>,
    init: Vec<f32>,
}

impl Source {
    pub fn new(shape: &[usize], init: Vec<f32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), init.len());
        Source {
            id: ParamId::UNSET,
            shape: shape.to_vec(),
            init,
        }
    }

    /// The input as an f32 tensor.
    pub fn tensor(&self, ctx: &mut Ctx<'_>) -> Result<Tensor<f32>, NnError> {
        let dev = ctx.device().clone();
        let [p] = ctx.params([self.id])?;
        let b = match p {
            GatheredParam::Plain(b) => b.to_device(&dev)?,
            _ => unreachable!("plain F32"),
        };
        Tensor::new(b, Shape::new(&self.shape)?)
    }

    /// Adds the input gradient.
    pub fn backward(&self, ctx: &mut Ctx<'_>, dx: &Tensor<f32>) -> Result<(), NnError> {
        ctx.add_grad(self.id, dx.data())?;
        Ok(())
    }
}

impl Module for Source {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        let init = self.init.clone();
        let f = move || init.clone();
        v.param(
            "x",
            &ParamDecl::new(&self.shape, ParamKind::Plain, &f),
            &mut self.id,
        )
    }
}

/// `sum(y * r)` in f64.
pub fn dot(y: &[f32], r: &[f32]) -> f64 {
    y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// One directional finite-difference check: the derivative of `loss` along a random `+-1` direction over
/// parameter `id`, from central differences with steps `h` and `h/2` (`h` = 1 % of the parameter's RMS,
/// at least `min_step`) combined by Richardson extrapolation (error `O(h^4)`), against
/// `analytic . direction`. Returns `(finite difference, analytic)`, both per unit step.
pub fn directional<M: Module>(
    model: &mut FsdpModel<M>,
    id: ParamId,
    analytic: &[f32],
    seed: u64,
    min_step: f32,
    loss: &mut dyn FnMut(&mut FsdpModel<M>) -> f64,
) -> (f64, f64) {
    let p0 = values(model, id);
    let mut r = SplitMix64::new(seed);
    let v: Vec<f32> = (0..p0.len())
        .map(|_| if r.next_u64() & 1 == 0 { 1.0 } else { -1.0 })
        .collect();
    let rms = (p0.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / p0.len() as f64).sqrt();
    let h = (0.01 * rms as f32).max(min_step);
    let mut central = |h: f32| -> f64 {
        let shifted =
            |s: f32| -> Vec<f32> { p0.iter().zip(&v).map(|(&p, &d)| p + s * d).collect() };
        let (up, down) = (shifted(h), shifted(-h));
        set_values(model, id, &up);
        let plus = loss(model);
        set_values(model, id, &down);
        let minus = loss(model);
        // Divide by the step actually taken (p0 +- h rounded to f32), measured along the direction.
        let taken: f64 = up
            .iter()
            .zip(&down)
            .zip(&v)
            .map(|((&a, &b), &d)| (a as f64 - b as f64) * d as f64)
            .sum::<f64>()
            / p0.len() as f64;
        (plus - minus) / taken
    };
    let (d1, d2) = (central(h), central(h / 2.0));
    set_values(model, id, &p0);
    let an: f64 = analytic
        .iter()
        .zip(&v)
        .map(|(&g, &d)| g as f64 * d as f64)
        .sum();
    ((4.0 * d2 - d1) / 3.0, an)
}

/// Asserts finite differences and analytic directional derivatives agree within `rel` of the larger
/// (plus `abs`), printing both.
pub fn assert_close(what: &str, fd: f64, an: f64, rel: f64, abs: f64) {
    let err = (fd - an).abs();
    eprintln!(
        "{what}: finite difference {fd:.6e}, analytic {an:.6e}, relative error {:.2e}",
        err / an.abs().max(1e-30)
    );
    assert!(
        err <= rel * fd.abs().max(an.abs()) + abs,
        "{what}: finite difference {fd:e} vs analytic {an:e}"
    );
    assert!(
        an.abs() > 10.0 * abs,
        "{what}: derivative {an:e} too small to test"
    );
}
