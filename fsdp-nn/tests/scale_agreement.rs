//! One scale agreement per step, for every model: two ranks fed different data (rank 1's
//! input and output gradient 16 times rank 0's) end the optimizer step with identical scales everywhere
//! — every activation and output-gradient meta and every FP8 weight — from ONE all-reduce(MAX). Each
//! meta's scale is the one of the global amax (the larger rank's), not rank 0's local one (checked
//! against a one-rank run on rank 0's data); each weight's scale is the one of the amax of its whole
//! updated master.

mod common;

use common::{linear_relu_linear, on_ranks, values, CountingComm, TestResult};
use fp8_core::{QType, ScaleRounding, ScalingMeta, ScalingRecipe};
use fsdp_comm::{CollectiveKind, Communicator, ReduceOp};
use fsdp_nn::{Layer, LinearPrecision, Shape, Tensor};
use fsdp_optim::{step_model, AdamOptions, FsdpAdamW, StatePrecision};
use fsdp_shard::{FsdpConfig, FsdpModel, Mode, WrapPolicy};
use std::sync::Arc;

const TOKENS: usize = 20;
const IN: usize = 16;
const HID: usize = 32;
const OUT: usize = 8;

/// What a rank holds around its step.
struct Seen {
    /// Meta names, their types and this rank's pending amaxes before the step.
    names: Vec<String>,
    qtypes: Vec<QType>,
    amaxes: Vec<f32>,
    /// Every meta's scale after the step.
    meta_scales: Vec<f32>,
    /// Every FP8 weight's (parameter, scale) after the step.
    weight_scales: Vec<(usize, f32)>,
    /// This rank's F32 master shard per unit after the step.
    masters: Vec<Vec<f32>>,
    /// All-reduces (MAX, SUM) during the step.
    max_reduces: usize,
    sum_reduces: usize,
    layout: Arc<fsdp_shard::ModelLayout>,
}

/// One training step of `fc1 (FP8) - ReLU - fc2 (FP8)` in `policy`'s units on `ranks` ranks; rank `r`'s
/// input and output gradient are scaled by `gain(r)`.
fn step(ranks: usize, policy: WrapPolicy, gain: impl Fn(usize) -> f32 + Sync) -> Vec<Seen> {
    on_ranks(ranks, |comm| {
        let rank = comm.rank();
        let counting = CountingComm::new(comm);
        let comm: Arc<dyn Communicator> = counting.clone();
        let net = linear_relu_linear(["fc1", "fc2"], (IN, HID, OUT), [LinearPrecision::Fp8; 2])?;
        let mut model = FsdpModel::new(net, comm, policy.clone(), FsdpConfig::default())?;
        let options = AdamOptions {
            lr: 1e-2,
            state_precision: StatePrecision::F32,
            ..AdamOptions::adamw()
        };
        let mut opt = FsdpAdamW::for_model(&mut model, options)?;
        let dev = model.device().clone();
        let g = gain(rank);
        // The same pattern on every rank, scaled: the amaxes differ by the gain.
        let x = Tensor::new(
            dev.upload(&values(3, TOKENS * IN, g))?,
            Shape::matrix(TOKENS, IN)?,
        )?;
        let y = model.forward(Mode::Train, |net, ctx| net.forward(ctx, x))?;
        let dy = Tensor::new(dev.upload(&values(4, TOKENS * OUT, 1e-2 * g))?, y.shape())?;
        model.backward(|net, ctx| net.backward_params(ctx, dy))?;
        let reg = model.scaling();
        let mut qtypes = Vec::new();
        for i in 0..reg.len() {
            qtypes.push(reg.get(reg.id(i)?)?.qtype());
        }
        let names = reg.names().to_vec();
        let amaxes = reg.pending().to_vec()?;
        counting.reset();
        step_model(&mut opt, &mut model)?;
        let max_reduces = counting.count(CollectiveKind::AllReduce, Some(ReduceOp::Max));
        let sum_reduces = counting.count(CollectiveKind::AllReduce, Some(ReduceOp::Sum));
        let reg = model.scaling();
        let meta_scales = (0..reg.len())
            .map(|i| Ok(reg.get(reg.id(i)?)?.scale().to_vec()?[0]))
            .collect::<TestResult<Vec<f32>>>()?;
        let weight_scales = model
            .sharded()
            .weight_scales()?
            .into_iter()
            .map(|(p, s, _)| (p, s))
            .collect();
        let masters = (0..model.sharded().num_units())
            .map(|u| Ok(opt.fp8_master_shard(u)?))
            .collect::<TestResult<Vec<_>>>()?;
        Ok(Seen {
            names,
            qtypes,
            amaxes,
            meta_scales,
            weight_scales,
            masters,
            max_reduces,
            sum_reduces,
            layout: model.layout().clone(),
        })
    })
}

/// The scale a fresh meta of `qtype` (the layers' default recipe) takes after recording `amax`.
fn scale_of(qtype: QType, amax: f32) -> f32 {
    let mut m = ScalingMeta::new(qtype, ScalingRecipe::delayed_default()).expect("meta");
    m.update_from_amax(amax);
    m.scale()
}

#[test]
fn two_ranks_with_different_data_agree_on_every_scale_in_one_all_reduce() {
    for policy in [WrapPolicy::Single, WrapPolicy::PerModule] {
        let two = step(2, policy.clone(), |r| if r == 0 { 1.0 } else { 16.0 });
        let alone = step(1, policy.clone(), |_| 1.0);
        let (r0, r1) = (&two[0], &two[1]);
        // One agreement per step: the statistics' SUM and ONE MAX for every scale of the model.
        for s in &two {
            assert_eq!(s.max_reduces, 1, "{policy:?}: all-reduce(MAX) per step");
            assert_eq!(s.sum_reduces, 1, "{policy:?}: all-reduce(SUM) per step");
        }
        assert_eq!(alone[0].max_reduces, 1);
        // Activation and output-gradient metas: identical on both ranks, the scale of the larger amax
        // (rank 1's), which differs from what rank 0 computes alone.
        assert_eq!(
            r0.names,
            [
                "fc1.input",
                "fc1.grad_output",
                "fc2.input",
                "fc2.grad_output"
            ]
        );
        let mut differ = Vec::new();
        for i in 0..r0.names.len() {
            let name = &r0.names[i];
            assert_eq!(
                r0.meta_scales[i].to_bits(),
                r1.meta_scales[i].to_bits(),
                "{policy:?}: {name} agreed"
            );
            assert!(
                r1.amaxes[i] > r0.amaxes[i],
                "{name}: rank 1's amax is larger"
            );
            let global = r0.amaxes[i].max(r1.amaxes[i]);
            assert_eq!(r0.meta_scales[i], scale_of(r0.qtypes[i], global), "{name}");
            // Rank 0 alone saw its own amax and took its own scale.
            assert_eq!(
                alone[0].amaxes[i], r0.amaxes[i],
                "{name}: same data as rank 0"
            );
            assert_eq!(
                alone[0].meta_scales[i],
                scale_of(r0.qtypes[i], r0.amaxes[i]),
                "{name}"
            );
            if alone[0].meta_scales[i] != r0.meta_scales[i] {
                differ.push(name.clone());
            }
        }
        // The inputs and output gradients of rank 1 are exactly 16 times rank 0's: a 16 times smaller
        // power-of-two scale.
        for name in ["fc1.input", "fc2.grad_output"] {
            let i = r0.names.iter().position(|n| n == name).expect("meta");
            assert_eq!(r0.meta_scales[i] * 16.0, alone[0].meta_scales[i], "{name}");
        }
        assert!(differ.len() >= 2, "{differ:?}");
        // FP8 weights: identical scale pairs on both ranks, the scale of the amax of the whole updated
        // master (split across the two ranks' shards).
        assert_eq!(
            r0.weight_scales, r1.weight_scales,
            "{policy:?}: weight scales"
        );
        assert_eq!(r0.weight_scales.len(), 2);
        let layout = &r0.layout;
        for &(p, s) in &r0.weight_scales {
            let (u, _, slot) = layout.locate(p).expect("located");
            let full: Vec<f32> = two.iter().flat_map(|r| r.masters[u].clone()).collect();
            let master = &full[slot.offset..slot.offset + slot.numel];
            let amax = master.iter().fold(0f32, |m, v| m.max(v.abs()));
            let want = fp8_core::compute_scale(amax, 448.0, 0, ScaleRounding::PowerOfTwo, 1.0);
            assert_eq!(s, want, "{policy:?}: {}", layout.params[p].name);
        }
    }
}
