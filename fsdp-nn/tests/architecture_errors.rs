//! Misuse of the module architecture is an error, never a wrong answer: a parameter of a unit used again
//! after that unit's gradients were reduced (sharing across units, which belongs in the root), gradients
//! outside a backward, foreign or unset ids, the wrong kind or size, wrap policies that match nothing,
//! models without parameters or with duplicate names, a second optimizer taking the masters.

mod common;

use common::tiny_lm::{wrap, TinyConfig};
use common::{linear_relu_linear, on_ranks, TestResult};
use fsdp_comm::{run_ranks, Communicator};
use fsdp_nn::{Layer, Linear, LinearPrecision, NnError, Relu, Sequential, Shape, Tensor};
use fsdp_optim::{AdamOptions, FsdpAdamW};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GatheredParam, Mode, Module, ParamDecl, ParamId, ParamKind,
    ShardError, Visitor, WrapPolicy,
};
use std::sync::Arc;

const D: usize = 8;

/// `y = x W_0^T + b` with `W_0` block `h.0`'s weight: a parameter shared across units.
struct CrossHead {
    w: ParamId,
    bias: ParamId,
    x: Option<Tensor>,
}

impl Module for CrossHead {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.param(
            "bias",
            &ParamDecl::new(&[D], ParamKind::Plain, &|| vec![0.0; D]),
            &mut self.bias,
        )
    }
}

/// Blocks `h.0`, `h.1` (one unit each) and a head reusing `h.0`'s weight.
struct Cross {
    h: Vec<Linear>,
    head: CrossHead,
}

impl Module for Cross {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("h", &mut self.h)?;
        self.head.w = self.h[0].weight_id();
        v.child("head", &mut self.head)
    }
}

fn plain(p: &GatheredParam) -> Result<&fp8_kernels::Buffer<f32>, NnError> {
    match p {
        GatheredParam::Plain(b) => Ok(b),
        _ => Err(NnError::usage("head", "plain F32")),
    }
}

impl Cross {
    fn forward(&mut self, ctx: &mut Ctx<'_>, mut x: Tensor) -> Result<Tensor, NnError> {
        for b in &mut self.h {
            x = b.forward(ctx, x)?;
        }
        let dev = ctx.device().clone();
        let rows = x.shape().rows();
        let mut y = Tensor::zeros(&dev, x.shape())?;
        let spec = fp8_kernels::GemmSpec::new(rows, D, D)
            .transposes(fp8_kernels::Transpose::No, fp8_kernels::Transpose::Yes);
        let [w, b] = ctx.params([self.head.w, self.head.bias])?;
        fp8_kernels::elementwise::bias_add(y.data_mut(), plain(b)?, rows, D)?;
        let spec = spec.scalars(1.0, 1.0);
        fp8_kernels::gemm::gemm_f32(&spec, x.data(), plain(w)?, y.data_mut())?;
        self.head.x = Some(x);
        Ok(y)
    }

    fn backward(&mut self, ctx: &mut Ctx<'_>, dy: Tensor) -> Result<(), NnError> {
        let x = self
            .head
            .x
            .take()
            .ok_or_else(|| NnError::usage("head", "no forward"))?;
        let rows = x.shape().rows();
        let dev = ctx.device().clone();
        let mut dw = dev.uninit::<f32>(D * D)?;
        let spec = fp8_kernels::GemmSpec::new(D, D, rows)
            .transposes(fp8_kernels::Transpose::Yes, fp8_kernels::Transpose::No);
        fp8_kernels::gemm::gemm_f32(&spec, dy.data(), x.data(), &mut dw)?;
        let mut dx = Tensor::uninit(&dev, x.shape())?;
        {
            let w = plain(ctx.params([self.head.w])?[0])?;
            fp8_kernels::gemm::gemm_f32(
                &fp8_kernels::GemmSpec::new(rows, D, D),
                dy.data(),
                w,
                dx.data_mut(),
            )?;
        }
        ctx.add_grad(self.head.w, &dw)?;
        let mut dh = dx;
        for (i, b) in self.h.iter_mut().enumerate().rev() {
            match b.backward_step(ctx, dh, i > 0)? {
                Some(d) => dh = d,
                None => break,
            }
        }
        Ok(())
    }
}

#[test]
fn a_parameter_of_a_reduced_unit_used_again_is_an_error() {
    for ranks in [1, 2] {
        let errors = on_ranks(ranks, |comm| {
            let h = vec![
                Linear::new(D, D)?
                    .with_precision(LinearPrecision::F32)?
                    .with_seed(1),
                Linear::new(D, D)?
                    .with_precision(LinearPrecision::F32)?
                    .with_seed(2),
            ];
            let head = CrossHead {
                w: ParamId::UNSET,
                bias: ParamId::UNSET,
                x: None,
            };
            let mut model = FsdpModel::new(
                Cross { h, head },
                comm,
                WrapPolicy::ChildrenOf("h".into()),
                FsdpConfig::default(),
            )?;
            let dev = model.device().clone();
            let x = Tensor::new(dev.upload(&[0.5f32; 4 * D])?, Shape::matrix(4, D)?)?;
            // The forward may use h.0 again (it is gathered again).
            let y = model.forward(Mode::Train, |m, ctx| m.forward(ctx, x))?;
            let dy = Tensor::new(dev.upload(&[1.0f32; 4 * D])?, y.shape())?;
            // The backward reduces h.0 when it moves on to h.1, then h.0's own backward needs it.
            let e = model
                .backward(|m, ctx| m.backward(ctx, dy))
                .expect_err("a unit used after its reduction");
            // The model is usable afterwards (every unit released).
            assert!((0..3).all(|u| !model.sharded().is_gathered(u)));
            Ok(e.to_string())
        });
        for e in errors {
            assert!(
                e.contains("used again after its gradients were reduced")
                    && e.contains("root unit"),
                "{ranks} rank(s): {e}"
            );
        }
    }
}

/// A model of one F32 linear and one FP8 linear.
fn two_linears() -> Result<Sequential, NnError> {
    linear_relu_linear(
        ["a", "b"],
        (D, D, D),
        [LinearPrecision::F32, LinearPrecision::Fp8],
    )
}

fn err<T: std::fmt::Debug, E: std::fmt::Display>(r: Result<T, E>) -> String {
    r.expect_err("an error").to_string()
}

#[test]
fn misuse_of_the_pass_context_is_an_error() {
    on_ranks(1, |comm| {
        let mut model = FsdpModel::new(
            two_linears()?,
            comm,
            WrapPolicy::Single,
            FsdpConfig::default(),
        )?;
        let dev = model.device().clone();
        let ids: Vec<(String, ParamId)> = fsdp_shard::module::param_names(model.module_mut())?;
        let id = |n: &str| ids.iter().find(|(m, _)| m == n).map(|p| p.1).expect("id");
        let (a_w, b_w) = (id("a.weight"), id("b.weight"));
        let g = dev.upload(&[0.0f32; D * D])?;
        // Gradients only in a backward.
        let e = err(model.forward(Mode::Train, |_, ctx| ctx.add_grad(a_w, &g)));
        assert!(e.contains("only in a backward pass"), "{e}");
        // Unset and foreign ids.
        let e = err(model.forward(Mode::Eval, |_, ctx| ctx.plain(ParamId::UNSET).map(|_| ())));
        assert!(e.contains("not one of this model's parameters"), "{e}");
        let foreign = ParamId::from_index(99)?;
        let e = err(model.forward(Mode::Eval, |_, ctx| ctx.plain(foreign).map(|_| ())));
        assert!(e.contains("not one of this model's parameters"), "{e}");
        // The wrong kind.
        let e = err(model.forward(Mode::Eval, |_, ctx| ctx.plain(b_w).map(|_| ())));
        assert!(e.contains("is an FP8 weight"), "{e}");
        let e = err(model.forward(Mode::Eval, |_, ctx| ctx.fp8_weight(a_w).map(|_| ())));
        assert!(e.contains("is not a per-tensor FP8 weight"), "{e}");
        // A gradient of the wrong size.
        let short = dev.upload(&[0.0f32; D])?;
        let e = err(model.backward(|_, ctx| ctx.add_grad(a_w, &short)));
        assert!(e.contains("gradient of a.weight has 8 elements"), "{e}");
        // An unset scaling meta.
        let e = err(model.forward(Mode::Train, |_, ctx| {
            ctx.scaling(fsdp_shard::ScalingId::UNSET).map(|_| ())
        }));
        assert!(e.contains("scaling meta id"), "{e}");
        // A layer used without being part of the model (its ids were never assigned).
        let mut stray = Linear::<f32>::new(D, D)?
            .with_precision(LinearPrecision::F32)?
            .with_seed(3);
        let x = Tensor::new(dev.upload(&[0.0f32; 2 * D])?, Shape::matrix(2, D)?)?;
        let e = err(model.forward(Mode::Eval, |_, ctx| stray.forward(ctx, x)));
        assert!(e.contains("not one of this model's parameters"), "{e}");
        Ok(())
    });
}

#[test]
fn bad_models_are_errors() {
    on_ranks(1, |comm| {
        // A wrap policy that matches no module.
        let e = err(FsdpModel::new(
            two_linears()?,
            comm.clone(),
            WrapPolicy::ChildrenOf("blocks".into()),
            FsdpConfig::default(),
        ));
        assert!(e.contains("ChildrenOf(\"blocks\")"), "{e}");
        // No parameters.
        let e = err(FsdpModel::new(
            Sequential::<f32>::new().push("act", Relu::new()),
            comm.clone(),
            WrapPolicy::Single,
            FsdpConfig::default(),
        ));
        assert!(e.contains("declares no parameter"), "{e}");
        // Two layers under one name.
        let dup = Sequential::<f32>::new()
            .push(
                "fc",
                Linear::new(D, D)?
                    .with_precision(LinearPrecision::F32)?
                    .with_seed(1),
            )
            .push(
                "fc",
                Linear::new(D, D)?
                    .with_precision(LinearPrecision::F32)?
                    .with_seed(2),
            );
        let e = err(FsdpModel::new(
            dup,
            comm.clone(),
            WrapPolicy::Single,
            FsdpConfig::default(),
        ));
        assert!(e.contains("fc.weight appears twice"), "{e}");
        // Initial values of the wrong size.
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
        let e = err(FsdpModel::new(
            Wrong(ParamId::UNSET),
            comm.clone(),
            WrapPolicy::Single,
            FsdpConfig::default(),
        ));
        assert!(e.contains("initial values of w have 3 elements"), "{e}");
        // The FP8 masters go to one optimizer.
        let mut model = wrap(
            TinyConfig {
                precision: LinearPrecision::Fp8,
                ..TinyConfig::new(8, 8, 1)
            },
            comm,
            FsdpConfig::default(),
        )?;
        FsdpAdamW::for_model(&mut model, AdamOptions::adamw())?;
        let e = err(FsdpAdamW::for_model(&mut model, AdamOptions::adamw()));
        assert!(e.contains("already taken"), "{e}");
        Ok(())
    });
}

#[test]
fn ranks_that_disagree_on_the_model_fail_instead_of_hanging() {
    // Rank 1 builds a model with one more block: its first collective does not match rank 0's, and
    // both ranks return an error (the thread group's timeout and argument checks), none hangs.
    let r = run_ranks(2, |comm| -> TestResult<()> {
        let rank = comm.rank();
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut model = wrap(TinyConfig::new(8, 8, 1 + rank), comm, FsdpConfig::default())?;
        model.gathered_params()?;
        Ok(())
    });
    assert!(r.is_err(), "mismatched models must not both succeed");
}
