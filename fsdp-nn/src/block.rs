//! [`TransformerBlock`]: the pre-norm GPT-2 block `x1 = x + attn(ln_1(x))`, `y = x1 + mlp(ln_2(x1))`.
//!
//! Its parameters sit flat under the block's path, as nanoGPT's `Block` names them (`ln_1.weight`,
//! `c_attn.weight`, `attn_proj.weight`, `ln_2.weight`, `c_fc.weight`, `mlp_proj.weight`): the attention and
//! the MLP are visited without a path component of their own.
//!
//! Each norm feeds the linear after it: when that linear is FP8 the norm writes its E4M3 input directly
//! ([`Norm::forward_linear`]). The block keeps its input `x` and `x1` for the norms' backward (the
//! residual stream, in the activation type); the branches keep what their own backward needs. The
//! backward adds each norm's input gradient into the residual gradient in place (one rounding per add),
//! so the block's `dx` is the output gradient plus both branches' contributions without extra buffers.

use crate::attention::{CausalSelfAttention, KvCache};
use crate::layer::{Activation, InputGrad, Layer};
use crate::norm::Norm;
use crate::{Mlp, NnError, Tensor, WeightInit};
use fp8_kernels::attention::AttentionConfig;
use fp8_kernels::elementwise as ops;
use fp8_kernels::layer_norm::NormKind;
use fsdp_shard::{Ctx, Module, ShardError, Visitor};

/// How a [`TransformerBlock`] is built.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockConfig {
    /// Model width.
    pub d: usize,
    /// Attention heads (`d / heads` features each).
    pub heads: usize,
    /// MLP hidden width (GPT-2: `4 d`).
    pub hidden: usize,
    /// LayerNorm or RMSNorm.
    pub norm: NormKind,
    /// Initial standard deviation of `c_attn` and `c_fc` (GPT-2: 0.02).
    pub init_std: f64,
    /// Initial standard deviation of `attn_proj` and `mlp_proj` (GPT-2: `0.02 / sqrt(2 L)`).
    pub proj_std: f64,
    /// An explicit seed of the block's weights; `None` (the default): each parameter's own seed.
    pub seed: Option<u64>,
    /// The attention kernels' configuration.
    pub attention: AttentionConfig,
    /// Whether norms write their FP8 linear's input directly (bit-identical; on by default).
    pub fuse_norm_fp8: bool,
}

impl BlockConfig {
    /// GPT-2's block of width `d` with `heads` heads for a model of `layers` blocks (which sets the
    /// projections' initial scale); its linears in the activations' float precision (a model converts
    /// chosen linears to FP8 with [`crate::convert_to_fp8`]).
    pub fn gpt2(d: usize, heads: usize, layers: usize) -> Self {
        BlockConfig {
            d,
            heads,
            hidden: 4 * d,
            norm: NormKind::LayerNorm,
            init_std: 0.02,
            proj_std: 0.02 / (2.0 * layers.max(1) as f64).sqrt(),
            seed: None,
            attention: AttentionConfig::default(),
            fuse_norm_fp8: true,
        }
    }
}

/// The pre-norm transformer block (see the module docs).
#[derive(Debug)]
pub struct TransformerBlock<T: Activation = f32> {
    ln_1: Norm<T>,
    attn: CausalSelfAttention<T>,
    ln_2: Norm<T>,
    mlp: Mlp<T>,
    /// The block's input (for `ln_1`'s backward).
    x: Option<Tensor<T>>,
    /// `x + attn(ln_1(x))` (for `ln_2`'s backward).
    x1: Option<Tensor<T>>,
}

impl<T: Activation> TransformerBlock<T> {
    /// A block as `config` says.
    pub fn new(config: &BlockConfig) -> Result<Self, NnError> {
        let c = config;
        let norm = |kind| -> Result<Norm<T>, NnError> {
            Ok(Norm::of_kind(kind, c.d)?.fused_fp8(c.fuse_norm_fp8))
        };
        let mut attn = CausalSelfAttention::new(c.d, c.heads, [c.init_std, c.proj_std])?
            .with_config(c.attention);
        let mut mlp = Mlp::new(c.d, c.hidden)?
            .with_names("c_fc", "mlp_proj")
            .with_init(
                WeightInit::Normal(c.init_std),
                WeightInit::Normal(c.proj_std),
            );
        if let Some(s) = c.seed {
            let seed = |k: u64| crate::init::stream_seed(s, k);
            attn = attn.with_seed(seed(1));
            mlp = mlp.with_seed(seed(2));
        }
        Ok(TransformerBlock {
            ln_1: norm(c.norm)?,
            attn,
            ln_2: norm(c.norm)?,
            mlp,
            x: None,
            x1: None,
        })
    }

    /// The attention.
    pub fn attention(&self) -> &CausalSelfAttention<T> {
        &self.attn
    }

    /// The MLP.
    pub fn mlp(&self) -> &Mlp<T> {
        &self.mlp
    }

    /// One decoding step of one sequence (evaluation only): `x` is the next token (`[1, 1, d]`), `cache`
    /// this block's keys and values of the positions before it (see [`KvCache`]).
    pub fn decode(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: Tensor<T>,
        cache: &mut KvCache,
    ) -> Result<Tensor<T>, NnError> {
        let mut x1 = self.attn.decode_normed(ctx, &mut self.ln_1, &x, cache)?;
        ops::axpy(1.0, x.data(), x1.data_mut())?;
        let u = self.ln_2.forward_linear(ctx, &x1, self.mlp.up_mut())?;
        let mut y = self.mlp.forward_after_up(ctx, u)?;
        ops::axpy(1.0, x1.data(), y.data_mut())?;
        Ok(y)
    }

    /// Bytes kept for the backward.
    pub fn saved_bytes(&self) -> usize {
        self.x.as_ref().map_or(0, |t| t.data().num_bytes())
            + self.x1.as_ref().map_or(0, |t| t.data().num_bytes())
            + self.attn.saved_bytes()
            + self.mlp.saved_bytes()
    }
}

impl<T: Activation> Module for TransformerBlock<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        // nanoGPT's order and names: ln_1, c_attn, attn_proj, ln_2, c_fc, mlp_proj.
        v.child("ln_1", &mut self.ln_1)?;
        self.attn.visit(v)?;
        v.child("ln_2", &mut self.ln_2)?;
        self.mlp.visit(v)
    }
}

impl<T: Activation> Layer<T> for TransformerBlock<T> {
    /// `x` is `[batch, seq, d]`.
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let mut x1 = self.attn.forward_normed(ctx, &mut self.ln_1, &x)?;
        ops::axpy(1.0, x.data(), x1.data_mut())?;
        let u = self.ln_2.forward_linear(ctx, &x1, self.mlp.up_mut())?;
        let mut y = self.mlp.forward_after_up(ctx, u)?;
        ops::axpy(1.0, x1.data(), y.data_mut())?;
        let training = ctx.is_training();
        self.x = training.then_some(x);
        self.x1 = training.then_some(x1);
        Ok(y)
    }

    fn backward_step(
        &mut self,
        ctx: &mut Ctx<'_>,
        mut dy: Tensor<T>,
        need_dx: bool,
    ) -> InputGrad<T> {
        let missing = || NnError::usage("TransformerBlock", "backward without a training forward");
        let x = self.x.take().ok_or_else(missing)?;
        let x1 = self.x1.take().ok_or_else(missing)?;
        // dy is d(out); the MLP branch's input gradient is added into it: dy becomes d(x1).
        let dh2 = self.mlp.backward_ref(ctx, &dy, true)?.ok_or_else(missing)?;
        self.ln_2.backward_ref(ctx, &x1, &dh2, Some(&mut dy))?;
        drop((dh2, x1));
        // Then the attention branch: dy becomes d(x).
        let dh1 = self
            .attn
            .backward_ref(ctx, &dy, true)?
            .ok_or_else(missing)?;
        self.ln_1.backward_ref(ctx, &x, &dh1, Some(&mut dy))?;
        Ok(need_dx.then_some(dy))
    }

    fn forget_saved(&mut self) {
        self.x = None;
        self.x1 = None;
        self.attn.drop_saved();
        self.mlp.forget_saved();
        self.ln_1.forget_saved();
        self.ln_2.forget_saved();
    }
}
