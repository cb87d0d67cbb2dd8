//! A norm writing its FP8 linear's input directly (`Norm::forward_linear` with fusion on) gives the same
//! bits as the norm's output followed by the linear's own E4M3 cast: outputs, input gradients, weight
//! gradients (which read the saved transposed codes) and recorded amaxes, over several steps of delayed
//! scaling (so the scale moves off its initial value), in training and evaluation, for LayerNorm with and
//! without a bias and RMSNorm. (The port of the old `Fp8Linear::quantize_input_norm` wrapper's test.)
//! Before a block-scaled linear the fused norm computes its statistics only and the linear's casts apply
//! them (`BlockCastInput::Norm`): the same bits as the norm's output cast by the linear, with the linear
//! keeping its input or recasting it in the backward from the kept statistics, at token counts that are
//! and are not a multiple of the GEMM's 16.

mod transformer_common;

use fp8_kernels::layer_norm::NormKind;
use fsdp_nn::{Linear, LinearPrecision, NnError, Norm, Shape, Tensor};
use fsdp_shard::{Ctx, FsdpModel, Mode, Module, ShardError, Visitor};
use half::bf16;
use transformer_common::*;

struct NormLinear {
    norm: Norm<bf16>,
    linear: Linear<bf16>,
}

impl Module for NormLinear {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("norm", &mut self.norm)?;
        v.child("linear", &mut self.linear)
    }
}

fn bits(b: &fp8_kernels::Buffer<bf16>) -> Vec<u16> {
    b.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

impl NormLinear {
    fn new(kind: NormKind, bias: bool, fused: bool) -> Self {
        let norm = Norm::of_kind(kind, 48).unwrap().fused_fp8(fused);
        NormLinear {
            norm: if bias { norm.with_bias() } else { norm },
            linear: Linear::new(48, 32)
                .and_then(|l| l.with_precision(LinearPrecision::Fp8))
                .map(|l| l.with_seed(3))
                .unwrap()
                .without_bias(),
        }
    }

    fn forward(&mut self, ctx: &mut Ctx<'_>, x: &Tensor<bf16>) -> Result<Vec<u16>, NnError> {
        let y = self.norm.forward_linear(ctx, x, &mut self.linear)?;
        Ok(bits(y.data()))
    }

    fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: &Tensor<bf16>,
        dy: &Tensor<bf16>,
    ) -> Result<Vec<u16>, NnError> {
        let dh = self.linear.backward_ref(ctx, dy, true)?.expect("dx");
        let dx = self.norm.backward_ref(ctx, x, &dh, None)?.expect("dx");
        Ok(bits(dx.data()))
    }
}

fn tensor(model: &FsdpModel<NormLinear>, v: &[f32], shape: &[usize]) -> Tensor<bf16> {
    let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    Tensor::new(
        model.device().upload(&h).unwrap(),
        Shape::new(shape).unwrap(),
    )
    .unwrap()
}

#[test]
fn fused_norm_cast_equals_norm_then_cast() {
    for (kind, bias) in [
        (NormKind::LayerNorm, false),
        (NormKind::LayerNorm, true),
        (NormKind::RmsNorm, false),
    ] {
        let mut fused = one_rank(NormLinear::new(kind, bias, true));
        let mut plain = one_rank(NormLinear::new(kind, bias, false));
        let meta = fused.module().linear.input_meta();
        let shape = [3, 8, 48];
        for step in 0..5u64 {
            // Inputs growing step by step, and norm weights away from 1, so the amax and the delayed
            // scale change.
            let x = uniform(3 * 8 * 48, 1.0 + step as f32, 100 + step);
            let w = uniform(48, 3.0 + step as f32, 200 + step);
            for m in [&mut fused, &mut plain] {
                let id = m.module().norm.weight_id();
                set_values(m, id, &w);
            }
            let dy = uniform(3 * 8 * 32, 1.0, 300 + step);
            let mut out = Vec::new();
            for m in [&mut fused, &mut plain] {
                m.sharded_mut().zero_grads().unwrap();
                let (xt, dyt) = (tensor(m, &x, &shape), tensor(m, &dy, &[3, 8, 32]));
                let y = m
                    .forward(Mode::Train, |n, ctx| n.forward(ctx, &xt))
                    .unwrap();
                let pending = m.scaling().pending().to_vec().unwrap();
                let dx = m.backward(|n, ctx| n.backward(ctx, &xt, &dyt)).unwrap();
                let names = m.param_names().unwrap();
                let grads: Vec<Vec<f32>> = names.iter().map(|&(_, id)| grad(m, id)).collect();
                let pending_all = m.scaling().pending().to_vec().unwrap();
                let eval = m.forward(Mode::Eval, |n, ctx| n.forward(ctx, &xt)).unwrap();
                m.parts_mut().1.update_local().unwrap();
                let scale = m.scaling().get(meta).unwrap().scale().to_vec().unwrap()[0];
                out.push((y, pending, dx, grads, pending_all, eval, scale));
            }
            let (a, b) = (&out[0], &out[1]);
            let what = format!("{kind:?} bias {bias} step {step}");
            assert_eq!(a.0, b.0, "{what}: output");
            assert_eq!(a.1, b.1, "{what}: input amax");
            assert!(a.1.iter().any(|&v| v > 0.0), "{what}: an amax was recorded");
            assert_eq!(a.2, b.2, "{what}: input gradient");
            assert_eq!(a.3, b.3, "{what}: parameter gradients");
            assert_eq!(a.4, b.4, "{what}: all amaxes");
            assert_eq!(a.5, b.5, "{what}: evaluation output");
            assert_eq!(a.0, a.5, "{what}: evaluation equals training");
            assert_eq!(a.6.to_bits(), b.6.to_bits(), "{what}: next scale");
            if step >= 2 {
                assert_ne!(a.6, 1.0, "{what}: the delayed scale moved");
            }
        }
    }
}

#[test]
fn fused_norm_block_cast_equals_norm_then_block_cast() {
    let recipe = fp8_core::Fp8Recipe::block_scaled(fp8_core::ScaleRounding::PowerOfTwo);
    let block_net = |kind, bias, fused| {
        let mut n = NormLinear::new(kind, bias, fused);
        n.linear = Linear::new(48, 32)
            .and_then(|l| l.with_precision(LinearPrecision::Fp8))
            .and_then(|l| l.with_fp8_recipe(&recipe))
            .map(|l| l.with_seed(3))
            .unwrap()
            .without_bias();
        one_rank(n)
    };
    for (kind, bias) in [
        (NormKind::LayerNorm, false),
        (NormKind::LayerNorm, true),
        (NormKind::RmsNorm, false),
    ] {
        for (batch, recast) in [(4, false), (3, false), (4, true), (3, true)] {
            let mut fused = block_net(kind, bias, true);
            let mut plain = block_net(kind, bias, false);
            assert!(fused.module().linear.is_block_scaled());
            let shape = [batch, 8, 48];
            let x = uniform(batch * 8 * 48, 2.0, 100 + batch as u64);
            let w = uniform(48, 3.0, 200);
            let dy = uniform(batch * 8 * 32, 1.0, 300);
            let mut out = Vec::new();
            for m in [&mut fused, &mut plain] {
                let id = m.module().norm.weight_id();
                set_values(m, id, &w);
                m.sharded_mut().zero_grads().unwrap();
                let (xt, dyt) = (tensor(m, &x, &shape), tensor(m, &dy, &[batch, 8, 32]));
                let y = m
                    .forward(Mode::Train, |n, ctx| {
                        // A caller that holds x asks the linear to keep nothing of its input.
                        n.linear.set_keep_fp8_input(!recast);
                        n.forward(ctx, &xt)
                    })
                    .unwrap();
                let awaited = m.module().linear.awaits_block_input();
                let dx = m
                    .backward(|n, ctx| {
                        n.norm
                            .restore_linear_input(ctx, &xt, &mut n.linear, false)?;
                        n.backward(ctx, &xt, &dyt)
                    })
                    .unwrap();
                let names = m.param_names().unwrap();
                let grads: Vec<Vec<f32>> = names.iter().map(|&(_, id)| grad(m, id)).collect();
                let eval = m.forward(Mode::Eval, |n, ctx| n.forward(ctx, &xt)).unwrap();
                out.push((y, awaited, dx, grads, eval));
            }
            let (a, b) = (&out[0], &out[1]);
            let what = format!("{kind:?} bias {bias} batch {batch} recast {recast}");
            assert_eq!(a.1, recast, "{what}: the linear waits for its input");
            assert_eq!(a.0, b.0, "{what}: output");
            assert_eq!(a.2, b.2, "{what}: input gradient");
            assert_eq!(a.3, b.3, "{what}: parameter gradients");
            assert!(
                a.3.iter().all(|g| g.iter().any(|&v| v != 0.0)),
                "{what}: gradients"
            );
            assert_eq!(a.4, b.4, "{what}: evaluation output");
            assert_eq!(a.0, a.4, "{what}: evaluation equals training");
        }
    }
}

#[test]
fn fused_norm_refuses_a_mismatched_linear() {
    // A norm of width 48 before a linear of 32 inputs.
    let mut m = one_rank(NormLinear {
        norm: Norm::layer_norm(48).unwrap(),
        linear: Linear::new(32, 16)
            .and_then(|l| l.with_precision(LinearPrecision::Fp8))
            .map(|l| l.with_seed(1))
            .unwrap(),
    });
    let x: Vec<bf16> = vec![bf16::ONE; 4 * 48];
    let x = Tensor::new(
        m.device().upload(&x).unwrap(),
        Shape::matrix(4, 48).unwrap(),
    )
    .unwrap();
    let e = m
        .forward(Mode::Train, |n, ctx| {
            n.norm.forward_linear(ctx, &x, &mut n.linear).map(|_| ())
        })
        .unwrap_err();
    assert!(e.to_string().contains("48"), "{e}");
}
