//! [`TransformerBlock`]: the pre-norm block `x1 = x + attn(ln_1(x))`, `y = x1 + mlp(ln_2(x1))` of GPT-2
//! ([`BlockConfig::gpt2`]: LayerNorm, multi-head attention, GELU MLP) and Llama 3
//! ([`BlockConfig::llama`]: RMSNorm, grouped-query attention with RoPE, SwiGLU MLP).
//!
//! Parameter names ([`BlockNames`]): GPT-2's sit flat under the block's path, as nanoGPT's `Block` names
//! them (`ln_1.weight`, `c_attn.weight`, `attn_proj.weight`, `ln_2.weight`, `c_fc.weight`,
//! `mlp_proj.weight`: the attention and the MLP are visited without a path component of their own);
//! Llama's are Hugging Face's with the projections fused (`input_layernorm.weight`,
//! `self_attn.qkv_proj.weight`, `self_attn.o_proj.weight`, `post_attention_layernorm.weight`,
//! `mlp.gate_up_proj.weight`, `mlp.down_proj.weight`).
//!
//! Each norm feeds the linear after it: when that linear is FP8 the norm writes its E4M3 input directly
//! ([`Norm::forward_linear`]). The block keeps its input `x` and `x1` for the norms' backward (the
//! residual stream, in the activation type); the branches keep what their own backward needs. What can
//! be written again from kept values is not kept ([`TransformerBlock::recast_fp8_inputs`], default on):
//! the FP8 inputs of `c_attn` and the MLP's first linear (the norms' fused forward again, from `x` and
//! `x1`) and of the attention's projection (its kept output cast again), at the forward's scales. The
//! backward adds each norm's input gradient into the residual gradient in place (one rounding per add),
//! so the block's `dx` is the output gradient plus both branches' contributions without extra buffers.

use crate::attention::{CausalSelfAttention, KvCache, Rope};
use crate::layer::{Activation, InputGrad, Layer};
use crate::norm::Norm;
use crate::{Mlp, MlpActivation, NnError, Tensor, WeightInit};
use fp8_kernels::attention::AttentionConfig;
use fp8_kernels::elementwise as ops;
use fp8_kernels::layer_norm::NormKind;
use fsdp_shard::{Ctx, Module, ShardError, Visitor};

/// The names of a [`TransformerBlock`]'s parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockNames {
    /// The first norm (`ln_1`; Llama: `input_layernorm`).
    pub norm_1: String,
    /// The second norm (`ln_2`; Llama: `post_attention_layernorm`).
    pub norm_2: String,
    /// The attention's path component (`None`: its linears sit directly under the block; Llama:
    /// `self_attn`).
    pub attention: Option<String>,
    /// The attention's two linears (`c_attn`, `attn_proj`; Llama: `qkv_proj`, `o_proj`).
    pub attention_linears: [String; 2],
    /// The MLP's path component (`None` for GPT-2; Llama: `mlp`).
    pub mlp: Option<String>,
    /// The MLP's two linears (`c_fc`, `mlp_proj`; Llama: `gate_up_proj`, `down_proj`).
    pub mlp_linears: [String; 2],
}

impl BlockNames {
    /// nanoGPT's names.
    pub fn gpt2() -> Self {
        BlockNames {
            norm_1: "ln_1".into(),
            norm_2: "ln_2".into(),
            attention: None,
            attention_linears: ["c_attn".into(), "attn_proj".into()],
            mlp: None,
            mlp_linears: ["c_fc".into(), "mlp_proj".into()],
        }
    }

    /// Hugging Face `LlamaDecoderLayer`'s names, with the fused projections.
    pub fn llama() -> Self {
        BlockNames {
            norm_1: "input_layernorm".into(),
            norm_2: "post_attention_layernorm".into(),
            attention: Some("self_attn".into()),
            attention_linears: ["qkv_proj".into(), "o_proj".into()],
            mlp: Some("mlp".into()),
            mlp_linears: ["gate_up_proj".into(), "down_proj".into()],
        }
    }
}

/// How a [`TransformerBlock`] is built.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockConfig {
    /// Model width.
    pub d: usize,
    /// Attention (query) heads (`d / heads` features each).
    pub heads: usize,
    /// Key/value heads (dividing `heads`; `heads` for multi-head attention).
    pub kv_heads: usize,
    /// MLP hidden width (GPT-2: `4 d`).
    pub hidden: usize,
    /// The MLP's nonlinearity.
    pub activation: MlpActivation,
    /// Rotary positions in the attention (Llama), or none (GPT-2's learned position table).
    pub rope: Option<Rope>,
    /// The parts' names.
    pub names: BlockNames,
    /// LayerNorm or RMSNorm.
    pub norm: NormKind,
    /// The norms' epsilon (1e-5, PyTorch's and Llama 3's).
    pub norm_eps: f32,
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
            kv_heads: heads,
            hidden: 4 * d,
            activation: MlpActivation::Gelu,
            rope: None,
            names: BlockNames::gpt2(),
            norm: NormKind::LayerNorm,
            norm_eps: fp8_kernels::layer_norm::DEFAULT_EPS,
            init_std: 0.02,
            proj_std: 0.02 / (2.0 * layers.max(1) as f64).sqrt(),
            seed: None,
            attention: AttentionConfig::default(),
            fuse_norm_fp8: true,
        }
    }

    /// A Llama 3 decoder layer of width `d`, `heads` query heads over `kv_heads` key/value heads, a
    /// SwiGLU MLP of `hidden` (`intermediate_size`), RMSNorm, and `rope`, for a model of `layers` layers
    /// (the peer's init: 0.02, and `0.02 / sqrt(2 L)` for `o_proj` and `down_proj`).
    pub fn llama(
        d: usize,
        heads: usize,
        kv_heads: usize,
        hidden: usize,
        layers: usize,
        rope: Rope,
    ) -> Self {
        BlockConfig {
            kv_heads,
            hidden,
            activation: MlpActivation::SwiGlu,
            rope: Some(rope),
            names: BlockNames::llama(),
            norm: NormKind::RmsNorm,
            ..Self::gpt2(d, heads, layers)
        }
    }
}

/// The pre-norm transformer block (see the module docs).
#[derive(Debug)]
pub struct TransformerBlock<T: Activation = f32> {
    names: BlockNames,
    ln_1: Norm<T>,
    attn: CausalSelfAttention<T>,
    ln_2: Norm<T>,
    mlp: Mlp<T>,
    /// The block's input (for `ln_1`'s backward).
    x: Option<Tensor<T>>,
    /// `x + attn(ln_1(x))` (for `ln_2`'s backward).
    x1: Option<Tensor<T>>,
    /// The norms' FP8 outputs (the inputs of `c_attn` and the MLP's first linear) are written again
    /// from `x` and `x1` in the backward instead of kept.
    recast_norm_outputs: bool,
    /// The MLP's up output is recomputed in the backward from the recast codes instead of kept.
    recompute_up_output: bool,
}

impl<T: Activation> TransformerBlock<T> {
    /// A block as `config` says.
    pub fn new(config: &BlockConfig) -> Result<Self, NnError> {
        let c = config;
        let norm = |kind| -> Result<Norm<T>, NnError> {
            Ok(Norm::of_kind(kind, c.d)?
                .with_eps(c.norm_eps)
                .fused_fp8(c.fuse_norm_fp8))
        };
        let n = &c.names;
        let mut attn =
            CausalSelfAttention::grouped(c.d, c.heads, c.kv_heads, [c.init_std, c.proj_std])?
                .with_config(c.attention)
                .with_names(&n.attention_linears[0], &n.attention_linears[1]);
        if let Some(rope) = c.rope {
            attn = attn.with_rope(rope)?;
        }
        let mut mlp = Mlp::with_activation(c.d, c.hidden, c.activation)?
            .with_names(&n.mlp_linears[0], &n.mlp_linears[1])
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
            names: c.names.clone(),
            ln_1: norm(c.norm)?,
            attn,
            ln_2: norm(c.norm)?,
            mlp,
            x: None,
            x1: None,
            recast_norm_outputs: true,
            recompute_up_output: false,
        })
    }

    /// Whether three of the block's four per-tensor FP8 linears keep no E4M3 copy of their input between
    /// the passes (`true`, the default), because the block keeps the values they come from anyway:
    /// `c_attn`'s and the MLP's first linear's inputs are the norms' outputs of `x` and `x1`, which the
    /// block keeps for the norms' backward, and the backward runs each norm's fused forward again at
    /// the forward's scale to write the codes (`Norm::restore_linear_input`); the attention's output
    /// projection casts the kept attention output again (`CausalSelfAttention::recast_proj_input`).
    /// The same codes: bit-identical training, `3 d` bytes per token less held per block, for two norm
    /// passes and one cast more in the backward. (The MLP's second linear is recast already where its
    /// activation is fused with the cast: `Mlp::recompute_gelu`.)
    pub fn recast_fp8_inputs(mut self, on: bool) -> Self {
        self.recast_norm_outputs = on;
        self.attn = self.attn.recast_proj_input(on);
        self
    }

    /// Whether the backward recomputes the MLP's up output (`[gate | up]`, Llama's `2 hidden` wide
    /// SwiGLU input, or GPT-2's pre-GELU `4 d`) instead of keeping it (default off): the up GEMM once
    /// more in the backward, from the E4M3 codes the recast already writes again
    /// ([`TransformerBlock::recast_fp8_inputs`], [`crate::Mlp::set_keep_up_output`]). Bit-identical
    /// training; `tokens * up_out` activations (2 bytes each in BF16) fewer held per block for one FP8
    /// GEMM of `2 tokens d up_out` flops more. Selective recomputation: a model turns it on for as many
    /// blocks as its memory needs, the earliest first (their activations are held longest; the last
    /// block's recomputation would not lower the peak at the start of the backward). Takes effect where
    /// the recast does (an MLP fused with per-tensor FP8 casts, fed by a fused norm); elsewhere the
    /// block keeps the output as before.
    pub fn recompute_mlp_up(mut self, on: bool) -> Self {
        self.recompute_up_output = on;
        self
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
        // The forward's order: norm, attention, norm, MLP (nanoGPT's and Hugging Face's).
        let n = &self.names;
        v.child(&n.norm_1, &mut self.ln_1)?;
        match &n.attention {
            Some(path) => v.child(path, &mut self.attn)?,
            None => self.attn.visit(v)?,
        }
        v.child(&n.norm_2, &mut self.ln_2)?;
        match &n.mlp {
            Some(path) => v.child(path, &mut self.mlp),
            None => self.mlp.visit(v),
        }
    }
}

impl<T: Activation> Layer<T> for TransformerBlock<T> {
    /// `x` is `[batch, seq, d]`.
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let keep = !self.recast_norm_outputs;
        self.attn.c_attn_mut().set_keep_fp8_input(keep);
        self.mlp.up_mut().set_keep_fp8_input(keep);
        let mut x1 = self.attn.forward_normed(ctx, &mut self.ln_1, &x)?;
        ops::axpy(1.0, x.data(), x1.data_mut())?;
        let u = self.ln_2.forward_linear(ctx, &x1, self.mlp.up_mut())?;
        // Only where the backward can write the up linear's input codes again.
        let drop_u = self.recompute_up_output && self.mlp.up().awaits_fp8_input();
        self.mlp.set_keep_up_output(!drop_u);
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
        let recompute_up = self.mlp.awaits_up_output();
        let codes = self
            .ln_2
            .restore_linear_input(ctx, &x1, self.mlp.up_mut(), recompute_up)?;
        if recompute_up {
            let codes = codes.as_ref().ok_or_else(|| {
                NnError::usage(
                    "TransformerBlock",
                    "the MLP dropped its up output but its input codes were not written again",
                )
            })?;
            self.mlp.restore_up_output(ctx, codes)?;
        }
        drop(codes);
        let dh2 = self.mlp.backward_ref(ctx, &dy, true)?.ok_or_else(missing)?;
        self.ln_2.backward_ref(ctx, &x1, &dh2, Some(&mut dy))?;
        drop((dh2, x1));
        // Then the attention branch: dy becomes d(x).
        self.ln_1
            .restore_linear_input(ctx, &x, self.attn.c_attn_mut(), false)?;
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
