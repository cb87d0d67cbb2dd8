//! The FP8 `Mlp`'s GELU fused with the casts around it (`fused(true)`) trains bit-identically to GELU then
//! the linears' own casts (`fused(false)`), and recasting the down linear's input in the backward
//! (`recompute_gelu(true)`) to keeping it: over several optimizer steps, on one and two ranks, the losses,
//! outputs, weights, weight scales, activation/gradient metas and optimizer masters are all bitwise equal.
//! (The fused kernels write the same FP8 codes, transposes and amaxes as the unfused sequence: this is
//! the layer-level form of fp8-kernels' former `linear_wrappers_equal_unfused_sequence`.) The same for
//! the SwiGLU MLP, whose gate/up product is fused with the casts the same way.

mod common;

use common::{on_ranks, values, StepTrace, TestResult};
use fp8_kernels::elementwise::scale;
use fsdp_nn::{Layer, LinearPrecision, Mlp, MlpActivation, MlpBlock, Recompute, Shape, Tensor};
use fsdp_optim::{step_model, AdamOptions, FsdpAdamW};
use fsdp_shard::{FsdpConfig, FsdpModel, Mode, Module, ShardError, Visitor, WrapPolicy};
use half::bf16;

const D: usize = 32;
const TOKENS: usize = 48;
const BLOCKS: usize = 2;
const STEPS: usize = 4;

/// Blocks `h.0`, `h.1`, ... (one unit each).
struct Stack {
    h: Vec<Box<dyn Layer<bf16>>>,
}

impl Module for Stack {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("h", &mut self.h)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    activation: MlpActivation,
    fused: bool,
    recompute_gelu: bool,
    recompute_block: bool,
}

fn run(variant: Variant, ranks: usize) -> Vec<StepTrace> {
    on_ranks(ranks, |comm| {
        let rank = comm.rank() as u64;
        let mut h: Vec<Box<dyn Layer<bf16>>> = Vec::new();
        for b in 0..BLOCKS {
            let mlp = Mlp::<bf16>::with_activation(D, 4 * D, variant.activation)?
                .with_precision(LinearPrecision::Fp8)?
                .with_seed(7 + b as u64)
                .fused(variant.fused)
                .recompute_gelu(variant.recompute_gelu);
            if variant.recompute_block {
                h.push(Box::new(Recompute::new(MlpBlock::new(mlp))));
            } else {
                h.push(Box::new(MlpBlock::new(mlp)));
            }
        }
        let mut model = FsdpModel::new(
            Stack { h },
            comm,
            WrapPolicy::ChildrenOf("h".into()),
            FsdpConfig::default(),
        )?;
        let mut opt = FsdpAdamW::for_model(
            &mut model,
            AdamOptions {
                lr: 1e-2,
                ..AdamOptions::adamw()
            },
        )?;
        let dev = model.device().clone();
        let shape = Shape::matrix(TOKENS, D)?;
        let mut t = StepTrace::default();
        for step in 0..STEPS {
            // Inputs that differ per rank and grow per step, so the delayed scales move.
            // SwiGLU's product is quadratic in the input: larger inputs push its amax past E4M3's range
            // as GELU's are.
            let gain = match variant.activation {
                MlpActivation::Gelu => 1.0,
                MlpActivation::SwiGlu => 3.0,
            };
            let spread = gain * (1.0 + 3.0 * step as f32) * (1 + rank) as f32;
            let x: Vec<bf16> = values(100 * step as u64 + rank, TOKENS * D, spread)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let x = Tensor::new(dev.upload(&x)?, shape)?;
            let y = model.forward(Mode::Train, |s, ctx| {
                let mut x = x;
                for b in &mut s.h {
                    x = b.forward(ctx, x)?;
                }
                Ok::<_, fsdp_nn::NnError>(x)
            })?;
            let out = y.data().to_vec()?;
            let loss: f64 =
                out.iter().map(|v| (v.to_f32() as f64).powi(2)).sum::<f64>() / out.len() as f64;
            let mut dy = Tensor::new(y.data().to_device(&dev)?, shape)?;
            scale(dy.data_mut(), 2.0 / (TOKENS * D) as f32)?;
            model.backward(|s, ctx| {
                let mut dy = dy;
                for (i, b) in s.h.iter_mut().enumerate().rev() {
                    match b.backward_step(ctx, dy, i > 0)? {
                        Some(d) => dy = d,
                        None => break,
                    }
                }
                Ok::<_, fsdp_nn::NnError>(())
            })?;
            step_model(&mut opt, &mut model)?;
            t.record_step(&mut model, loss, &out)?;
        }
        t.record_masters(&model, &opt)?;
        Ok::<_, common::TestError>(t)
    })
}

fn check(ranks: usize, activation: MlpActivation) -> TestResult<()> {
    let base = Variant {
        activation,
        fused: false,
        recompute_gelu: false,
        recompute_block: false,
    };
    let reference = run(base, ranks);
    // The runs train and their scales move, so equal traces are not vacuous.
    let l = &reference[0].losses;
    assert!(
        f64::from_bits(l[STEPS - 1]) != f64::from_bits(l[0]),
        "losses {l:?}"
    );
    let state = &reference[0].module_state[STEPS - 1];
    let down = match activation {
        MlpActivation::Gelu => "c_proj",
        MlpActivation::SwiGlu => "down_proj",
    };
    let input_meta = &state[&format!("scaling.h.0.mlp.{down}.input")];
    assert!(
        !input_meta.starts_with("3f800000;"),
        "the down linear's input scale moved off 1: {input_meta}"
    );
    assert_eq!(reference[0].params[0].len(), 2 * BLOCKS);
    for variant in [
        Variant {
            fused: true,
            ..base
        },
        Variant {
            fused: true,
            recompute_gelu: true,
            ..base
        },
        Variant {
            fused: true,
            recompute_gelu: true,
            recompute_block: true,
            ..base
        },
        Variant {
            recompute_block: true,
            ..base
        },
    ] {
        let got = run(variant, ranks);
        for (r, (g, want)) in got.iter().zip(&reference).enumerate() {
            g.assert_bitwise_eq(want, &format!("{variant:?}, rank {r}"));
        }
    }
    Ok(())
}

#[test]
fn fused_and_recomputed_gelu_train_bit_identically_on_one_rank() -> TestResult<()> {
    check(1, MlpActivation::Gelu)
}

#[test]
fn fused_and_recomputed_gelu_train_bit_identically_on_two_ranks() -> TestResult<()> {
    check(2, MlpActivation::Gelu)
}

#[test]
fn fused_and_recomputed_swiglu_train_bit_identically_on_one_rank() -> TestResult<()> {
    check(1, MlpActivation::SwiGlu)
}

#[test]
fn fused_and_recomputed_swiglu_train_bit_identically_on_two_ranks() -> TestResult<()> {
    check(2, MlpActivation::SwiGlu)
}
