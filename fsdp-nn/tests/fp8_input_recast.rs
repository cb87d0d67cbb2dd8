//! FP8 linears that keep no copy of their E4M3 input between the passes, because the layer around them
//! keeps the values the codes come from, train bit-identically to keeping them: the attention's output
//! projection (`CausalSelfAttention::recast_proj_input`: the backward casts the kept attention output
//! again with the forward's scale) and a transformer block's `c_attn` and first MLP linear
//! (`TransformerBlock::recast_fp8_inputs`: the backward runs the norm's fused forward again from the
//! kept block input). Over several optimizer steps, on one and two thread ranks, the losses, outputs,
//! weights, weight scales, metas and optimizer masters are bitwise equal, and between the passes each
//! recast linear holds `tokens * d - 4` bytes less (its `x^T`, against two scales for one). A block
//! that also recomputes its MLP's up output (`TransformerBlock::recompute_mlp_up`, from the recast
//! codes) trains bit-identically too and holds `tokens * up_out` BF16 values less. Block-scaled linears
//! (`Fp8Recipe::block_scaled`) are recast the same way: the projection's 128x1 tiles cast again from the
//! kept attention output, `c_attn`'s and the MLP's first linear's from the norm's output computed again;
//! each holds its `x^T` codes and tile scales less.

mod common;

use common::{on_ranks, values, StepTrace, TestResult};
use fp8_core::{Fp8Recipe, ScaleRounding};
use fp8_kernels::elementwise::scale;
use fp8_kernels::{BlockQuantLayout, ScaleOrder};
use fsdp_nn::{
    convert_to_fp8, BlockConfig, CausalSelfAttention, Fp8Filter, Layer, LinearPrecision, Rope,
    Shape, Tensor, TransformerBlock,
};
use fsdp_optim::{step_model, AdamOptions, FsdpAdamW};
use fsdp_shard::{FsdpConfig, FsdpModel, Mode, Module, ShardError, Visitor, WrapPolicy};
use half::bf16;

const D: usize = 128;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const BATCH: usize = 2;
const SEQ: usize = 24;
const LAYERS: usize = 2;
const STEPS: usize = 4;

/// Layers `h.0`, `h.1`, ... (one unit each).
struct Stack<L> {
    h: Vec<L>,
}

impl<L: Module> Module for Stack<L> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("h", &mut self.h)
    }
}

/// What a run stacks: attention layers alone, or Llama / GPT-2 blocks, with the recast on or off.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Net {
    Attention {
        recast: bool,
        block: bool,
    },
    Block {
        llama: bool,
        recast: bool,
        /// The first this many blocks recompute the MLP's up output.
        recompute_up: usize,
        /// Block-scaled FP8 (`Fp8Recipe::block_scaled`) instead of per-tensor.
        block: bool,
    },
}

impl Net {
    fn block_scaled(self) -> bool {
        match self {
            Net::Attention { block, .. } | Net::Block { block, .. } => block,
        }
    }
}

/// Linears per layer that keep no input when `net` recasts (and the codes were worth keeping).
fn recast_linears(net: Net) -> usize {
    match net {
        Net::Attention { .. } => 1,
        Net::Block { .. } => 3,
    }
}

/// The MLP's up output width (both block kinds: `4 D`, GPT-2's hidden and Llama's `[gate | up]` of
/// `2 D` each).
const UP_OUT: usize = 4 * D;

fn stack(net: Net) -> TestResult<Stack<Box<dyn LayerModule>>> {
    let mut h: Vec<Box<dyn LayerModule>> = Vec::new();
    for l in 0..LAYERS {
        match net {
            Net::Attention { recast, .. } => h.push(Box::new(
                CausalSelfAttention::<bf16>::grouped(D, HEADS, KV_HEADS, [0.2, 0.2])?
                    .with_precision(LinearPrecision::Fp8)?
                    .with_seed(11 + l as u64)
                    .recast_proj_input(recast),
            )),
            Net::Block {
                llama,
                recast,
                recompute_up,
                ..
            } => {
                let mut c = if llama {
                    let rope = Rope {
                        theta: 500000.0,
                        scaling: None,
                        max_positions: SEQ,
                    };
                    BlockConfig::llama(D, HEADS, KV_HEADS, 2 * D, LAYERS, rope)
                } else {
                    BlockConfig::gpt2(D, HEADS, LAYERS)
                };
                c.init_std = 0.2;
                c.proj_std = 0.2;
                c.seed = Some(11 + l as u64);
                h.push(Box::new(
                    TransformerBlock::<bf16>::new(&c)?
                        .recast_fp8_inputs(recast)
                        .recompute_mlp_up(l < recompute_up),
                ));
            }
        }
    }
    let mut s = Stack { h };
    let recipe = if net.block_scaled() {
        Fp8Recipe::block_scaled(ScaleRounding::PowerOfTwo)
    } else {
        Fp8Recipe::default()
    };
    convert_to_fp8(&mut s, &Fp8Filter::All, &recipe)?;
    Ok(s)
}

/// A layer that is also a module (the stack's element).
trait LayerModule: Layer<bf16> + Module {
    fn held(&self) -> usize;
}

impl LayerModule for CausalSelfAttention<bf16> {
    fn held(&self) -> usize {
        self.saved_bytes()
    }
}

impl LayerModule for TransformerBlock<bf16> {
    fn held(&self) -> usize {
        self.saved_bytes()
    }
}

/// A run's trace and the bytes the layers held between the passes at each step.
struct Trace {
    steps: StepTrace,
    saved_bytes: Vec<usize>,
}

fn run(net: Net, ranks: usize) -> Vec<Trace> {
    on_ranks(ranks, |comm| {
        let rank = comm.rank() as u64;
        let mut model = FsdpModel::new(
            stack(net)?,
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
        let shape = Shape::new(&[BATCH, SEQ, D])?;
        let mut t = Trace {
            steps: StepTrace::default(),
            saved_bytes: Vec::new(),
        };
        for step in 0..STEPS {
            // Inputs that differ per rank and grow per step, so the delayed scales move.
            let spread = (1.0 + 3.0 * step as f32) * (1 + rank) as f32;
            let x: Vec<bf16> = values(100 * step as u64 + rank, BATCH * SEQ * D, spread)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let x = Tensor::new(dev.upload(&x)?, shape)?;
            let mut held = 0;
            let y = model.forward(Mode::Train, |s, ctx| {
                let mut x = x;
                for l in &mut s.h {
                    x = l.forward(ctx, x)?;
                }
                held = s.h.iter().map(|l| l.held()).sum();
                Ok::<_, fsdp_nn::NnError>(x)
            })?;
            let out = y.data().to_vec()?;
            let loss: f64 =
                out.iter().map(|v| (v.to_f32() as f64).powi(2)).sum::<f64>() / out.len() as f64;
            let mut dy = Tensor::new(y.data().to_device(&dev)?, shape)?;
            scale(dy.data_mut(), 2.0 / out.len() as f32)?;
            model.backward(|s, ctx| {
                let mut dy = dy;
                for (i, l) in s.h.iter_mut().enumerate().rev() {
                    match l.backward_step(ctx, dy, i > 0)? {
                        Some(d) => dy = d,
                        None => break,
                    }
                }
                Ok::<_, fsdp_nn::NnError>(())
            })?;
            step_model(&mut opt, &mut model)?;
            t.steps.record_step(&mut model, loss, &out)?;
            t.saved_bytes.push(held);
        }
        t.steps.record_masters(&model, &opt)?;
        Ok::<_, common::TestError>(t)
    })
}

/// `recast_net` trains bit-identically to `kept_net` and holds `fewer` bytes less per step between
/// the passes.
fn check(kept_net: Net, recast_net: Net, ranks: usize, fewer: usize) -> TestResult<()> {
    let kept = run(kept_net, ranks);
    let recast = run(recast_net, ranks);
    // The runs train and the projection's input scale moves, so equal traces are not vacuous.
    let l = &kept[0].steps.losses;
    assert!(
        f64::from_bits(l[STEPS - 1]) != f64::from_bits(l[0]),
        "losses {l:?}"
    );
    let state = &kept[0].steps.module_state[STEPS - 1];
    if recast_net.block_scaled() {
        // No scaling metas: the tiles' scales are the inputs' own.
        assert!(
            !state.keys().any(|k| k.starts_with("scaling.")),
            "{state:?}"
        );
    }
    let metas: Vec<_> = state
        .iter()
        .filter(|(k, _)| k.starts_with("scaling.h.0.") && k.ends_with(".input"))
        .collect();
    assert_eq!(
        metas.len(),
        if recast_net.block_scaled() {
            0
        } else if recast_linears(recast_net) == 1 {
            2
        } else {
            4
        },
        "{state:?}"
    );
    for (k, v) in metas {
        assert!(
            !v.starts_with("3f800000;"),
            "{k}: the input scale moved off 1: {v}"
        );
    }
    for (r, (g, want)) in recast.iter().zip(&kept).enumerate() {
        g.steps.assert_bitwise_eq(&want.steps, &format!("rank {r}"));
        for (step, (&got, &full)) in g.saved_bytes.iter().zip(&want.saved_bytes).enumerate() {
            assert_eq!(
                full.checked_sub(got),
                Some(fewer),
                "rank {r}, step {step}: held {got} bytes against {full}"
            );
        }
    }
    Ok(())
}

/// Per recast linear the E4M3 copy of its input (one byte per element) is not held; per tensor, the
/// two scales it keeps instead (8 bytes) replace the saved inverse scale (4 bytes); block-scaled, the
/// tiles' inverse scales go too.
fn recast_saving(net: Net) -> TestResult<usize> {
    let per_linear = if net.block_scaled() {
        let l = BlockQuantLayout::Columns128x1Transposed.output_layout(BATCH * SEQ, D)?;
        l.numel() + 4 * ScaleOrder::Gemm.strides(&l)?.len
    } else {
        BATCH * SEQ * D - 4
    };
    Ok(LAYERS * recast_linears(net) * per_linear)
}

#[test]
fn recast_projection_input_trains_bit_identically() -> TestResult<()> {
    for (ranks, block) in [(1, false), (2, false), (1, true), (2, true)] {
        let net = Net::Attention {
            recast: true,
            block,
        };
        let kept = Net::Attention {
            recast: false,
            block,
        };
        check(kept, net, ranks, recast_saving(net)?)?;
    }
    Ok(())
}

#[test]
fn recast_block_inputs_train_bit_identically() -> TestResult<()> {
    let cases = [
        (true, 1, false),
        (true, 2, false),
        (false, 1, false),
        (true, 1, true),
        (true, 2, true),
        (false, 1, true),
    ];
    for (llama, ranks, block) in cases {
        let net = Net::Block {
            llama,
            recast: true,
            recompute_up: 0,
            block,
        };
        let kept = Net::Block {
            llama,
            recast: false,
            recompute_up: 0,
            block,
        };
        check(kept, net, ranks, recast_saving(net)?)?;
    }
    Ok(())
}

#[test]
fn recomputed_mlp_up_output_trains_bit_identically() -> TestResult<()> {
    let u_bytes = BATCH * SEQ * UP_OUT * std::mem::size_of::<bf16>();
    for (llama, ranks, blocks) in [(true, 1, LAYERS), (true, 2, 1), (false, 1, LAYERS)] {
        let recast = Net::Block {
            llama,
            recast: true,
            recompute_up: 0,
            block: false,
        };
        let recompute = Net::Block {
            llama,
            recast: true,
            recompute_up: blocks,
            block: false,
        };
        check(recast, recompute, ranks, blocks * u_bytes)?;
    }
    // Without the recast there are no codes to recompute from: the block keeps the output.
    let kept = |recompute_up| Net::Block {
        llama: true,
        recast: false,
        recompute_up,
        block: false,
    };
    check(kept(0), kept(LAYERS), 1, 0)
}
