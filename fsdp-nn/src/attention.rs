//! [`CausalSelfAttention`]: `attn_proj(attention(rope(c_attn(x))))` with `c_attn: d -> (H + 2 KV) hd`
//! and `attn_proj: H hd -> d` (no biases), the attention causal over each sequence of a `[B, T, d]`
//! input. GPT-2 has `KV = H` and no RoPE; Llama 3 has grouped-query attention (`KV < H`, query head `h`
//! reading key/value head `h / (H / KV)`) and rotary positions ([`CausalSelfAttention::with_rope`]).
//!
//! `c_attn` writes `qkv [B, T, (H + 2 KV) hd]` (per token the query heads, then the key heads, then the
//! value heads; for `KV = H` GPT-2's `[B, T, 3, H, hd]`), the layout the flash-attention kernels read
//! (`fp8_kernels::attention`): no transpose around them. With RoPE one pass
//! (`fp8_kernels::rope::rope_forward`) writes the rotated copy the attention reads and keeps; the
//! backward rotates dQ and dK back in one pass before `c_attn`'s backward. The attention runs in BF16 with F32
//! accumulation; the forward keeps `qkv`, the output and the per-row log-sum-exp for the backward, which
//! is deterministic by default ([`AttentionConfig`]). With `f32` activations on the CPU the attention is
//! the F32 reference (`fp8_kernels::attention::cpu`) with no BF16 rounding, so finite differences check
//! the layer's backward; with `f32` activations on CUDA the operands are rounded to BF16 around the
//! kernels.
//!
//! When `c_attn` is FP8 and a norm precedes it, [`CausalSelfAttention::forward_normed`] lets the norm
//! write `c_attn`'s E4M3 input directly ([`Norm::forward_linear`]).
//!
//! Incremental decoding ([`CausalSelfAttention::decode_normed`], one token of one sequence per call)
//! keeps the past keys and values in a [`KvCache`] in host memory and computes the new token's attention
//! on the host in F32 (the flash-attention kernels have no decode mode): per token only `qkv` (`3d`
//! values) comes back from the device and the output (`d` values) goes up; the linears run where the
//! model lives.

use crate::layer::{take_saved, Activation, InputGrad, Layer};
use crate::norm::Norm;
use crate::retype::{buffer_converted, buffer_into, buffer_mut, buffer_ref};
use crate::{Linear, LinearPrecision, NnError, Shape, Tensor, WeightInit};
use fp8_kernels::attention::{
    attention_backward, attention_forward, cpu, AttentionConfig, AttentionShape, AttentionWorkspace,
};
use fp8_kernels::rope::{rope_backward, rope_forward, RopeShape, RopeSpec, RopeTable};
use fp8_kernels::{convert, Buffer, DType, Device};
use fsdp_shard::{Ctx, Module, ShardError, Visitor};
use half::bf16;

/// The keys and values of the positions decoded so far, for one sequence: `[len, kv_heads, head_dim]`
/// each, f32 in host memory (values as the layer's rotated `qkv` held them, so BF16 activations are
/// BF16-exact).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// An empty cache for `heads` heads of `head_dim` (multi-head attention: as many key/value heads).
    pub fn new(heads: usize, head_dim: usize) -> Self {
        Self::grouped(heads, heads, head_dim)
    }

    /// An empty cache for `heads` query heads over `kv_heads` key/value heads of `head_dim`.
    pub fn grouped(heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        KvCache {
            heads,
            kv_heads,
            head_dim,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.k.len() / (self.kv_heads * self.head_dim).max(1)
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
    }

    /// Appends the keys and values of `qkv` (one position, `[heads + 2 kv_heads, head_dim]`) and returns
    /// the attention output of its query over every position held (`[heads, head_dim]`), softmax scale
    /// `scale`, in f32 (each row's softmax from its max, as the CPU reference computes it).
    fn step(&mut self, qkv: &[f32], scale: f32) -> Vec<f32> {
        let (h, kvh, hd) = (self.heads, self.kv_heads, self.head_dim);
        let (q_w, kv_w) = (h * hd, kvh * hd);
        self.k.extend_from_slice(&qkv[q_w..q_w + kv_w]);
        self.v.extend_from_slice(&qkv[q_w + kv_w..q_w + 2 * kv_w]);
        let len = self.len();
        let group = h / kvh.max(1);
        let mut out = vec![0f32; q_w];
        let mut p = vec![0f32; len];
        for head in 0..h {
            let kv = head / group.max(1);
            let q = &qkv[head * hd..(head + 1) * hd];
            for (j, pj) in p.iter_mut().enumerate() {
                let k = &self.k[(j * kvh + kv) * hd..(j * kvh + kv + 1) * hd];
                *pj = q.iter().zip(k).fold(0f32, |s, (a, b)| s + a * b) * scale;
            }
            let m = p.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut l = 0f32;
            for x in p.iter_mut() {
                *x = (*x - m).exp();
                l += *x;
            }
            let o = &mut out[head * hd..(head + 1) * hd];
            for (j, &pj) in p.iter().enumerate() {
                let v = &self.v[(j * kvh + kv) * hd..(j * kvh + kv + 1) * hd];
                for (oc, &vc) in o.iter_mut().zip(v) {
                    *oc += pj / l * vc;
                }
            }
        }
        out
    }
}

/// Rotary positions of a [`CausalSelfAttention`]: Hugging Face's rotate-half RoPE with base `theta`
/// (Llama 3: 500000) and optionally Llama 3.1's frequency scaling, for positions below `max_positions`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The frequencies' base (`rope_theta`).
    pub theta: f64,
    /// Llama 3.1's rewrite of the frequencies (`rope_scaling` of type `llama3`).
    pub scaling: Option<fp8_kernels::rope::Llama3RopeScaling>,
    /// Positions the tables cover (the longest sequence, or prompt plus generated tokens).
    pub max_positions: usize,
}

/// What the forward keeps for the backward.
#[derive(Debug)]
enum Saved {
    /// The BF16 kernels' operands.
    Bf16 {
        qkv: Buffer<bf16>,
        out: Buffer<bf16>,
        lse: Buffer<f32>,
    },
    /// The F32 reference's input (it recomputes the rest).
    F32 { qkv: Buffer<f32> },
}

/// Causal self-attention with `heads` query heads of `d / heads` features over `kv_heads` key/value
/// heads; parameters `c_attn.weight [(H + 2 KV) hd, d]` and `attn_proj.weight [d, d]` under the module's
/// path (names chosen by [`CausalSelfAttention::with_names`]).
#[derive(Debug)]
pub struct CausalSelfAttention<T: Activation = f32> {
    d: usize,
    heads: usize,
    kv_heads: usize,
    c_attn: Linear<T>,
    attn_proj: Linear<T>,
    names: [String; 2],
    rope: Option<Rope>,
    /// The tables of `rope`, built on the first pass on the device it runs on.
    rope_table: Option<RopeTable>,
    config: AttentionConfig,
    workspace: AttentionWorkspace,
    saved: Option<(AttentionShape, Saved)>,
    /// Recast `attn_proj`'s FP8 input from the kept output in the backward instead of keeping its codes.
    recast_proj_input: bool,
}

impl<T: Activation> CausalSelfAttention<T> {
    /// Attention over `d` features in `heads` heads, the two linears in the activations' float precision
    /// (see [`crate::convert_to_fp8`]), weights initialised `N(0, std^2)` (`c_attn`) and
    /// `N(0, proj_std^2)` (`attn_proj`) from their own seeds.
    pub fn new(d: usize, heads: usize, stds: [f64; 2]) -> Result<Self, NnError> {
        Self::grouped(d, heads, heads, stds)
    }

    /// Grouped-query attention: `heads` query heads over `kv_heads` key/value heads (`kv_heads` divides
    /// `heads`; `kv_heads == heads` is [`CausalSelfAttention::new`]).
    pub fn grouped(
        d: usize,
        heads: usize,
        kv_heads: usize,
        stds: [f64; 2],
    ) -> Result<Self, NnError> {
        if heads == 0 || d % heads != 0 {
            return Err(NnError::usage(
                "CausalSelfAttention",
                format!("{d} features do not split into {heads} heads"),
            ));
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(NnError::usage(
                "CausalSelfAttention",
                format!("{kv_heads} key/value heads do not divide {heads} query heads"),
            ));
        }
        let hd = d / heads;
        Ok(CausalSelfAttention {
            d,
            heads,
            kv_heads,
            c_attn: Linear::new(d, (heads + 2 * kv_heads) * hd)?
                .without_bias()
                .with_init(WeightInit::Normal(stds[0])),
            attn_proj: Linear::new(d, d)?
                .without_bias()
                .with_init(WeightInit::Normal(stds[1])),
            names: ["c_attn".into(), "attn_proj".into()],
            rope: None,
            rope_table: None,
            config: AttentionConfig::default(),
            workspace: AttentionWorkspace::new(),
            saved: None,
            recast_proj_input: true,
        })
    }

    /// The fused query/key/value projection (a block's norm writes its FP8 input).
    pub fn c_attn_mut(&mut self) -> &mut Linear<T> {
        &mut self.c_attn
    }

    /// Whether a per-tensor FP8 `attn_proj` keeps no copy of its input's E4M3 codes between the passes
    /// (`true`, the default): the attention keeps its output for its own backward anyway, and the
    /// backward casts that output again with the forward's scale ([`Linear::set_keep_fp8_input`]): the
    /// same codes, `d` bytes per token less held per layer, one cast kernel more in the backward.
    pub fn recast_proj_input(mut self, on: bool) -> Self {
        self.recast_proj_input = on;
        self
    }

    /// Both linears in `precision` (a model converts chosen linears with [`crate::convert_to_fp8`]).
    pub fn with_precision(mut self, precision: LinearPrecision) -> Result<Self, NnError> {
        self.c_attn.set_precision(precision)?;
        self.attn_proj.set_precision(precision)?;
        Ok(self)
    }

    /// With weights drawn from `seed` (`c_attn`) and a stream derived from it (`attn_proj`) instead of
    /// their own seeds.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.c_attn = self.c_attn.with_seed(seed);
        self.attn_proj = self.attn_proj.with_seed(seed ^ 0xA7);
        self
    }

    /// With another attention configuration (kernel family, dQ accumulation, tiles, softmax scale).
    pub fn with_config(mut self, config: AttentionConfig) -> Self {
        self.config = config;
        self
    }

    /// With rotary positions applied to the queries and keys (checked: an even head dim, a finite
    /// positive base, a valid scaling).
    pub fn with_rope(mut self, rope: Rope) -> Result<Self, NnError> {
        RopeTable::host_tables(RopeSpec {
            max_positions: 1,
            ..self.rope_spec(rope)
        })?;
        if rope.max_positions == 0 {
            return Err(NnError::usage(
                "CausalSelfAttention",
                "RoPE tables of 0 positions",
            ));
        }
        self.rope = Some(rope);
        self.rope_table = None;
        Ok(self)
    }

    /// The two linears' names (default `c_attn`, `attn_proj`; Llama: `qkv_proj`, `o_proj`).
    pub fn with_names(mut self, qkv: &str, out: &str) -> Self {
        self.names = [qkv.to_string(), out.to_string()];
        self
    }

    /// Query heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// The rotary positions, if any.
    pub fn rope(&self) -> Option<Rope> {
        self.rope
    }

    fn rope_spec(&self, rope: Rope) -> RopeSpec {
        RopeSpec {
            max_positions: rope.max_positions,
            head_dim: self.d / self.heads,
            theta: rope.theta,
            scaling: rope.scaling,
        }
    }

    /// `qkv` with the queries and keys rotated for positions `start_pos ..` (a new buffer), or `qkv`
    /// itself without RoPE.
    fn rotate(
        &mut self,
        device: &Device,
        qkv: Tensor<T>,
        batch: usize,
        seq: usize,
        start_pos: usize,
    ) -> Result<Tensor<T>, NnError> {
        let rope_shape = self.rope_shape(batch, seq, start_pos);
        let Some(table) = self.table(device)? else {
            return Ok(qkv);
        };
        let mut out = Tensor::<T>::uninit(device, qkv.shape())?;
        rope_forward(table, qkv.data(), out.data_mut(), rope_shape)?;
        Ok(out)
    }

    fn rope_shape(&self, batch: usize, seq: usize, start_pos: usize) -> RopeShape {
        RopeShape {
            batch,
            seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            start_pos,
        }
    }

    /// The RoPE tables on `device` (built on first use, rebuilt if the layer moved), `None` without RoPE.
    fn table(&mut self, device: &Device) -> Result<Option<&RopeTable>, NnError> {
        let Some(rope) = self.rope else {
            return Ok(None);
        };
        if self
            .rope_table
            .as_ref()
            .is_none_or(|t| t.device() != *device)
        {
            self.rope_table = None;
            self.rope_table = Some(RopeTable::new(device, self.rope_spec(rope))?);
        }
        Ok(self.rope_table.as_ref())
    }

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.d / self.heads
    }

    /// The QKV linear.
    pub fn c_attn(&self) -> &Linear<T> {
        &self.c_attn
    }

    /// The output projection.
    pub fn attn_proj(&self) -> &Linear<T> {
        &self.attn_proj
    }

    /// Bytes kept for the backward.
    pub fn saved_bytes(&self) -> usize {
        let own = match &self.saved {
            Some((_, Saved::Bf16 { qkv, out, lse })) => {
                qkv.num_bytes() + out.num_bytes() + lse.num_bytes()
            }
            Some((_, Saved::F32 { qkv })) => qkv.num_bytes(),
            None => 0,
        };
        own + self.c_attn.saved_bytes() + self.attn_proj.saved_bytes()
    }

    fn shape_of(&self, x: Shape) -> Result<AttentionShape, NnError> {
        match x.dims() {
            &[b, t, d] if d == self.d => Ok(AttentionShape::gqa(
                b,
                self.heads,
                self.kv_heads,
                t,
                self.d / self.heads,
            )),
            _ => Err(NnError::usage(
                "CausalSelfAttention",
                format!("expects an input [batch, seq, {}], got {x:?}", self.d),
            )),
        }
    }

    /// The layer on `norm(x)`, the norm writing `c_attn`'s FP8 input when `c_attn` is FP8
    /// ([`Norm::forward_linear`]). `x` is `[batch, seq, d]`.
    pub fn forward_normed(
        &mut self,
        ctx: &mut Ctx<'_>,
        norm: &mut Norm<T>,
        x: &Tensor<T>,
    ) -> Result<Tensor<T>, NnError> {
        let shape = self.shape_of(x.shape())?;
        let qkv = norm.forward_linear(ctx, x, &mut self.c_attn)?;
        let qkv = self.rotate(&ctx.device().clone(), qkv, shape.batch, shape.seq_len, 0)?;
        self.forward_qkv(ctx, shape, qkv)
    }

    /// One decoding step (evaluation only): `x` is the next token of one sequence (`[1, 1, d]`); its key
    /// and value join `cache`, and the output is the layer's output for that token given every position
    /// in the cache (the result the full forward gives at that position).
    pub fn decode_normed(
        &mut self,
        ctx: &mut Ctx<'_>,
        norm: &mut Norm<T>,
        x: &Tensor<T>,
        cache: &mut KvCache,
    ) -> Result<Tensor<T>, NnError> {
        const WHAT: &str = "CausalSelfAttention::decode_normed";
        if ctx.is_training() {
            return Err(NnError::usage(WHAT, "decoding is for evaluation passes"));
        }
        if x.shape().dims() != [1, 1, self.d] {
            return Err(NnError::usage(
                WHAT,
                format!("expects one token [1, 1, {}], got {:?}", self.d, x.shape()),
            ));
        }
        let hd = self.d / self.heads;
        if cache.heads != self.heads || cache.kv_heads != self.kv_heads || cache.head_dim != hd {
            return Err(NnError::usage(
                WHAT,
                format!(
                    "a cache of {} heads over {} key/value heads of {}, the layer has {} over {} of {hd}",
                    cache.heads, cache.kv_heads, cache.head_dim, self.heads, self.kv_heads
                ),
            ));
        }
        let qkv = norm.forward_linear(ctx, x, &mut self.c_attn)?;
        let qkv = self.rotate(&ctx.device().clone(), qkv, 1, 1, cache.len())?;
        let host: Vec<f32> = qkv.data().to_vec()?.iter().map(|v| v.to_f32()).collect();
        let out = cache.step(&host, self.config.scale_for(hd));
        let out: Vec<T> = out.into_iter().map(T::from_f32).collect();
        let out = Tensor::new(ctx.device().upload(&out)?, x.shape())?;
        let y = self.attn_proj.forward_ref(ctx, &out)?;
        self.end_forward(false);
        Ok(y)
    }

    /// The attention and the output projection from `qkv = c_attn(x)`.
    fn forward_qkv(
        &mut self,
        ctx: &mut Ctx<'_>,
        shape: AttentionShape,
        qkv: Tensor<T>,
    ) -> Result<Tensor<T>, NnError> {
        let dev = ctx.device().clone();
        let training = ctx.is_training();
        let out_shape = qkv.shape().with_last(self.d)?;
        let cpu_f32 = T::DTYPE == DType::F32 && !dev.is_cuda();
        // The F32 reference path keeps qkv only, not the output: attn_proj keeps its own input then.
        let keep = cpu_f32 || !self.recast_proj_input;
        self.attn_proj.set_keep_fp8_input(keep);
        self.attn_proj.set_keep_block_input(keep);
        if cpu_f32 {
            let qkv = buffer_into::<T, f32>(qkv.into_data(), "CausalSelfAttention")?;
            let mut out = dev.uninit::<f32>(shape.out_len())?;
            let mut lse = dev.uninit::<f32>(shape.lse_len())?;
            const WHAT: &str = "CausalSelfAttention";
            cpu::forward(
                &shape,
                self.config.scale_for(shape.head_dim),
                qkv.host(WHAT)?,
                out.host_mut(WHAT)?,
                lse.host_mut(WHAT)?,
            );
            let out = Tensor::new(buffer_into::<f32, T>(out, WHAT)?, out_shape)?;
            let y = self.attn_proj.forward_ref(ctx, &out)?;
            self.saved = training.then_some((shape, Saved::F32 { qkv }));
            self.end_forward(training);
            return Ok(y);
        }
        let qkv16 = buffer_converted(qkv.into_data())?;
        let mut out16 = dev.uninit::<bf16>(shape.out_len())?;
        let mut lse = dev.uninit::<f32>(shape.lse_len())?;
        attention_forward(&shape, &self.config, &qkv16, &mut out16, &mut lse)?;
        let (y, out16) = match buffer_ref::<bf16, T>(&out16) {
            Some(_) => {
                // bf16 activations: the projection reads the attention output itself.
                let out = Tensor::new(
                    buffer_into::<bf16, T>(out16, "CausalSelfAttention")?,
                    out_shape,
                )?;
                let y = self.attn_proj.forward_ref(ctx, &out)?;
                (
                    y,
                    buffer_into::<T, bf16>(out.into_data(), "CausalSelfAttention")?,
                )
            }
            None => {
                let mut out = Tensor::<T>::uninit(&dev, out_shape)?;
                convert(&out16, out.data_mut())?;
                (self.attn_proj.forward_ref(ctx, &out)?, out16)
            }
        };
        self.saved = training.then_some((
            shape,
            Saved::Bf16 {
                qkv: qkv16,
                out: out16,
                lse,
            },
        ));
        self.end_forward(training);
        Ok(y)
    }

    fn end_forward(&mut self, training: bool) {
        if !training {
            self.c_attn.drop_saved();
            self.attn_proj.drop_saved();
        }
    }

    /// The backward from the output gradient `dy`: adds both weights' gradients and returns the gradient
    /// of `c_attn`'s input (the norm's output in a block) when `need_dx`.
    pub fn backward_ref(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: &Tensor<T>,
        need_dx: bool,
    ) -> InputGrad<T> {
        let (shape, saved) = take_saved(&mut self.saved, "CausalSelfAttention")?;
        if let Saved::Bf16 { out, .. } = &saved {
            if self.attn_proj.awaits_fp8_input() {
                // attn_proj's input was `out` (in T: the same values); its codes again, same scale.
                self.attn_proj.restore_fp8_input(out)?;
            }
            if self.attn_proj.awaits_block_input() {
                // Block-scaled: its tiles cast again from the same values.
                let shape = dy.shape().with_last(self.d)?;
                self.attn_proj.save_block_input_values(ctx, out, shape)?;
            }
        }
        let d_out = self
            .attn_proj
            .backward_ref(ctx, dy, true)?
            .ok_or_else(|| NnError::usage("CausalSelfAttention", "no gradient from attn_proj"))?;
        let dev = ctx.device().clone();
        let qkv_shape = d_out.shape().with_last(shape.qkv_width())?;
        let d_qkv = match saved {
            Saved::F32 { qkv } => {
                const WHAT: &str = "CausalSelfAttention";
                let d_out32 = buffer_ref::<T, f32>(d_out.data())
                    .ok_or_else(|| NnError::usage(WHAT, "f32 path with other activations"))?;
                let mut d_qkv = Tensor::<T>::uninit(&dev, qkv_shape)?;
                let dq = buffer_mut::<T, f32>(d_qkv.data_mut())
                    .ok_or_else(|| NnError::usage(WHAT, "f32 path with other activations"))?;
                cpu::backward(
                    &shape,
                    self.config.scale_for(shape.head_dim),
                    qkv.host(WHAT)?,
                    d_out32.host(WHAT)?,
                    dq.host_mut(WHAT)?,
                );
                d_qkv
            }
            Saved::Bf16 { qkv, out, lse } => {
                let d_out16 = buffer_converted(d_out.into_data())?;
                let mut d_qkv16 = dev.uninit::<bf16>(shape.qkv_len())?;
                attention_backward(
                    &shape,
                    &self.config,
                    &qkv,
                    &out,
                    &d_out16,
                    &lse,
                    &mut d_qkv16,
                    &mut self.workspace,
                )?;
                drop((qkv, out, lse, d_out16));
                Tensor::new(buffer_converted(d_qkv16)?, qkv_shape)?
            }
        };
        let rope_shape = self.rope_shape(shape.batch, shape.seq_len, 0);
        let d_qkv = match self.table(&dev)? {
            Some(table) => {
                let mut d = Tensor::<T>::uninit(&dev, qkv_shape)?;
                rope_backward(table, d_qkv.data(), d.data_mut(), rope_shape)?;
                d
            }
            None => d_qkv,
        };
        self.c_attn.backward_ref(ctx, &d_qkv, need_dx)
    }

    /// Frees what the last forward kept.
    pub fn drop_saved(&mut self) {
        self.saved = None;
        self.c_attn.drop_saved();
        self.attn_proj.drop_saved();
    }
}

impl<T: Activation> Module for CausalSelfAttention<T> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child(&self.names[0], &mut self.c_attn)?;
        v.child(&self.names[1], &mut self.attn_proj)
    }
}

impl<T: Activation> Layer<T> for CausalSelfAttention<T> {
    /// `x` is `[batch, seq, d]`.
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let shape = self.shape_of(x.shape())?;
        let qkv = self.c_attn.forward(ctx, x)?;
        let qkv = self.rotate(&ctx.device().clone(), qkv, shape.batch, shape.seq_len, 0)?;
        self.forward_qkv(ctx, shape, qkv)
    }

    fn backward_step(&mut self, ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        self.backward_ref(ctx, &dy, need_dx)
    }

    fn forget_saved(&mut self) {
        self.drop_saved();
    }
}
