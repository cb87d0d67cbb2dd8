//! Test bench: random problems on thread ranks with gradients written straight into the shards, and a
//! plain f64 Adam/AdamW reference.
#![allow(dead_code)]

use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_optim::{AdamOptions, OptimError, ShardedAdam, StateMeta, StepReport};
use fsdp_shard::{
    FsdpConfig, GradDtype, ModelLayout, ParamGroup, ParamKind, ParamSpec, ShardedModel, WrapPolicy,
};
use std::sync::Arc;

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    SplitMix64::new(seed).uniform_vec(n)
}

/// A model of FP8 weights and plain parameters with given initial values and gradients per step.
#[derive(Clone)]
pub struct Problem {
    pub layout: Arc<ModelLayout>,
    pub init: Vec<Vec<f32>>,
    /// `grads[step][param]`.
    pub grads: Vec<Vec<Vec<f32>>>,
}

/// A random problem: `shapes` as (rows, cols, fp8?), values of magnitude `w_mag`, gradients of magnitude
/// `g_mag` whose scale drifts per step, `steps` steps.
pub fn random_problem(
    seed: u64,
    shapes: &[(usize, usize, bool)],
    policy: WrapPolicy,
    w_mag: f32,
    g_mag: f32,
    steps: usize,
) -> Problem {
    let params: Vec<ParamSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(r, c, fp8))| {
            let kind = if fp8 {
                ParamKind::Fp8Weight
            } else {
                ParamKind::Plain
            };
            if c == 1 && !fp8 {
                ParamSpec::new(&format!("m{i}"), "p", &[r], kind)
            } else {
                ParamSpec::new(&format!("m{i}"), "p", &[r, c], kind)
            }
        })
        .collect();
    let layout = Arc::new(ModelLayout::new(params, &policy).unwrap());
    let init = shapes
        .iter()
        .enumerate()
        .map(|(i, &(r, c, _))| {
            values(seed * 1000 + i as u64, r * c)
                .into_iter()
                .map(|v| v * w_mag)
                .collect()
        })
        .collect();
    let grads = (0..steps)
        .map(|t| {
            let drift = 1.0 + 0.5 * ((t as f32) * 0.7).sin();
            shapes
                .iter()
                .enumerate()
                .map(|(i, &(r, c, _))| {
                    values(seed * 7919 + (t as u64) * 131 + i as u64, r * c)
                        .into_iter()
                        .map(|v| v * g_mag * drift)
                        .collect()
                })
                .collect()
        })
        .collect();
    Problem {
        layout,
        init,
        grads,
    }
}

/// Writes this rank's shard of the full gradients `grads[param]` into the model's gradient shards.
pub fn set_grads(model: &mut ShardedModel, grads: &[Vec<f32>]) -> Result<(), OptimError> {
    let (rank, ws) = (model.comm().rank(), model.comm().world_size());
    let layout = model.layout().clone();
    for (u, unit) in layout.units.iter().enumerate() {
        for g in ParamGroup::ALL {
            let gl = unit.group(g);
            let mut full = vec![0f32; gl.padded_len(ws)];
            for slot in &gl.slots {
                full[slot.offset..slot.offset + slot.numel].copy_from_slice(&grads[slot.param]);
            }
            let r = gl.shard_range(rank, ws);
            // A block-scaled group's shard is stored padded to the largest rank's length.
            let mut piece = full[r].to_vec();
            piece.resize(gl.shard_len(ws), 0.0);
            let s = model.unit_mut(u)?;
            // BF16 shards get the values rounded to nearest even, as a reduction would store them.
            if model_grad_dtype(s) == GradDtype::Bf16 {
                let h: Vec<half::bf16> = piece.iter().map(|&x| half::bf16::from_f32(x)).collect();
                s.grads_bf16[g as usize].copy_from_host(&h)?;
            } else {
                s.grads[g as usize].copy_from_host(&piece)?;
            }
        }
    }
    Ok(())
}

/// Which gradient shards a unit keeps (BF16 when its BF16 shards hold the elements).
fn model_grad_dtype(s: &fsdp_shard::UnitShards) -> GradDtype {
    if s.grads_bf16.iter().any(|b| !b.is_empty()) {
        GradDtype::Bf16
    } else {
        GradDtype::F32
    }
}

/// One unit on one rank: FP8 master shard (F32), plain shard, FP8 codes shard, weight scales.
pub type UnitResult = (Vec<f32>, Vec<f32>, Vec<u8>, Vec<f32>);

/// What one rank holds after a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RankResult {
    /// Per unit: FP8 master shard (F32), plain shard, FP8 codes shard, weight scales.
    pub shards: Vec<UnitResult>,
    pub metas: Vec<StateMeta>,
    pub reports: Vec<StepReport>,
}

pub fn collect(model: &ShardedModel, opt: &ShardedAdam) -> Result<RankResult, OptimError> {
    let mut shards = Vec::new();
    for u in 0..model.num_units() {
        let s = model.unit(u)?;
        shards.push((
            opt.fp8_master_shard(u)?,
            s.plain.to_vec()?,
            s.fp8.to_vec()?,
            s.weight_scales.to_vec()?,
        ));
    }
    Ok(RankResult {
        shards,
        metas: opt.state_metas()?,
        reports: Vec::new(),
    })
}

/// Every parameter's full values: FP8 weights from the masters, plain parameters from the plain shards;
/// and every FP8 weight dequantized from its codes.
pub fn merge(layout: &ModelLayout, ranks: &[RankResult]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut params = vec![Vec::new(); layout.params.len()];
    let mut dequant = vec![Vec::new(); layout.params.len()];
    for (u, unit) in layout.units.iter().enumerate() {
        let masters: Vec<f32> = ranks.iter().flat_map(|r| r.shards[u].0.clone()).collect();
        let plain: Vec<f32> = ranks.iter().flat_map(|r| r.shards[u].1.clone()).collect();
        let codes: Vec<u8> = ranks.iter().flat_map(|r| r.shards[u].2.clone()).collect();
        let scales = &ranks[0].shards[u].3;
        for (i, s) in unit.group(ParamGroup::Fp8).slots.iter().enumerate() {
            params[s.param] = masters[s.offset..s.offset + s.numel].to_vec();
            let mut d = vec![0f32; s.numel];
            Fp8Format::E4M3
                .decode_scaled(
                    &codes[s.offset..s.offset + s.numel],
                    scales[2 * i + 1],
                    &mut d,
                )
                .unwrap();
            dequant[s.param] = d;
        }
        for s in &unit.group(ParamGroup::Plain).slots {
            params[s.param] = plain[s.offset..s.offset + s.numel].to_vec();
        }
    }
    (params, dequant)
}

/// Runs `problem` on `ws` thread ranks for `steps` steps (gradients from the problem, `poison(step, rank)`
/// may corrupt them) and returns every rank's result.
pub fn run_with(
    problem: &Problem,
    ws: usize,
    options: AdamOptions,
    decoupled: bool,
    steps: usize,
    poison: &(dyn Fn(usize, usize, &mut ShardedModel) + Sync),
) -> Vec<RankResult> {
    run_config(
        problem,
        ws,
        options,
        decoupled,
        steps,
        FsdpConfig::default(),
        poison,
    )
}

/// [`run_with`] with a given sharding configuration (e.g. BF16 gradient shards).
pub fn run_config(
    problem: &Problem,
    ws: usize,
    options: AdamOptions,
    decoupled: bool,
    steps: usize,
    config: FsdpConfig,
    poison: &(dyn Fn(usize, usize, &mut ShardedModel) + Sync),
) -> Vec<RankResult> {
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let init = |p: usize| problem.init[p].clone();
        let (mut model, masters) =
            ShardedModel::new(problem.layout.clone(), comm, config.clone(), &init)?;
        let mode = if decoupled {
            fp8_kernels::WeightDecay::Decoupled
        } else {
            fp8_kernels::WeightDecay::L2
        };
        let mut opt = ShardedAdam::new(&model, masters, options, mode)?;
        let mut reports = Vec::new();
        for t in 0..steps {
            set_grads(&mut model, &problem.grads[t])?;
            poison(t, rank, &mut model);
            reports.push(opt.step_with_report(&mut model)?);
        }
        let mut r = collect(&model, &opt)?;
        r.reports = reports;
        Ok::<_, OptimError>(r)
    })
    .unwrap()
}

pub fn run(
    problem: &Problem,
    ws: usize,
    options: AdamOptions,
    decoupled: bool,
    steps: usize,
) -> Vec<RankResult> {
    run_with(problem, ws, options, decoupled, steps, &|_, _, _| {})
}

/// Plain f64 Adam/AdamW (PyTorch's algorithm) on the problem, with global-norm clipping and weight decay
/// on the parameters of the decay group (`ParamSpec::decay`).
pub fn reference(
    problem: &Problem,
    o: &AdamOptions,
    decoupled: bool,
    steps: usize,
) -> Vec<Vec<f64>> {
    let mut w: Vec<Vec<f64>> = problem
        .init
        .iter()
        .map(|p| p.iter().map(|&x| x as f64).collect())
        .collect();
    let mut m: Vec<Vec<f64>> = w.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v = m.clone();
    let (b1, b2) = o.betas;
    for t in 1..=steps {
        let g = &problem.grads[t - 1];
        let norm = g
            .iter()
            .flatten()
            .map(|&x| (x as f64) * (x as f64))
            .sum::<f64>()
            .sqrt();
        let clip = o
            .max_grad_norm
            .map_or(1.0, |mx| (mx / (norm + 1e-6)).min(1.0));
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        for p in 0..w.len() {
            // Weight decay applies to the parameters declared to decay (matrices by default).
            let wd = if problem.layout.params[p].decay {
                o.weight_decay
            } else {
                0.0
            };
            for i in 0..w[p].len() {
                let mut gi = g[p][i] as f64 * clip;
                if o.maximize {
                    gi = -gi;
                }
                if !decoupled {
                    gi += wd * w[p][i];
                }
                m[p][i] = b1 * m[p][i] + (1.0 - b1) * gi;
                v[p][i] = b2 * v[p][i] + (1.0 - b2) * gi * gi;
                if decoupled {
                    w[p][i] *= 1.0 - o.lr * wd;
                }
                let denom = v[p][i].sqrt() / bc2.sqrt() + o.eps;
                w[p][i] -= o.lr / bc1 * m[p][i] / denom;
            }
        }
    }
    w
}

/// ||a - b|| / ||b|| over all parameters.
pub fn rel_diff(a: &[Vec<f32>], b: &[Vec<f64>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            num += (*p as f64 - q).powi(2);
            den += q * q;
        }
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// ||a - b|| / ||b - init|| : the error relative to how far the reference moved.
pub fn rel_to_motion(a: &[Vec<f32>], b: &[Vec<f64>], init: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for ((x, y), z) in a.iter().zip(b).zip(init) {
        for ((p, q), r) in x.iter().zip(y).zip(z) {
            num += (*p as f64 - q).powi(2);
            den += (q - *r as f64).powi(2);
        }
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

pub fn as_f64(v: &[Vec<f32>]) -> Vec<Vec<f64>> {
    v.iter()
        .map(|p| p.iter().map(|&x| x as f64).collect())
        .collect()
}

/// The standard shapes: two FP8 weights, a bias, a 3-element FP8 weight, a conv-like plain weight.
pub const SHAPES: &[(usize, usize, bool)] = &[
    (24, 20, true),
    (24, 1, false),
    (1, 3, true),
    (10, 24, true),
    (5, 7, false),
];
