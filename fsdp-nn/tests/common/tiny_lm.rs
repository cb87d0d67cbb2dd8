//! A tiny language-model-shaped network for the architecture tests: a token embedding `wte` tied to the
//! LM head (one parameter used by two modules through one `ParamId`), a stack of blocks `h.N` (a linear
//! in FP8/BF16/F32, ReLU, optionally dropout, optionally recomputed in the backward), and log-softmax +
//! NLL. Inputs are dense `[tokens, vocab]` rows (one-hot rows make it an embedding look-up), so the
//! embedding and the head are two GEMMs with the same matrix `E [vocab, d]`:
//! `h_0 = x E`, `logits = h_L E^T + b`. Also its f64 reference (F32 blocks, no dropout).

use super::{values, TestResult};
use fp8_kernels::gemm::gemm_f32;
use fp8_kernels::{elementwise, reduce, Buffer, GemmSpec, Transpose};
use fsdp_comm::Communicator;
use fsdp_nn::init::{normal, stream_seed};
use fsdp_nn::{
    Dropout, Layer, Linear, LinearPrecision, LogSoftmaxNll, NnError, Recompute, Relu, Sequential,
    Shape, Tensor,
};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GatheredParam, Module, ParamDecl, ParamId, ParamKind, ShardError,
    Visitor, WrapPolicy,
};
use std::sync::Arc;

/// How the tiny model is built.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TinyConfig {
    pub vocab: usize,
    pub d: usize,
    pub blocks: usize,
    pub precision: LinearPrecision,
    /// A dropout layer with this probability after each block's ReLU.
    pub dropout: Option<f32>,
    /// Each block recomputed in the backward (`fsdp_nn::Recompute`).
    pub recompute: bool,
    /// The head uses the embedding (`wte.weight`); otherwise it declares its own copy (`head.weight`,
    /// the same initial values).
    pub tied: bool,
    /// Overrides the embedding's decay rule (matrices decay by default).
    pub embed_decay: Option<bool>,
    pub seed: u64,
    /// This rank (dropout masks differ per rank).
    pub rank: usize,
}

impl TinyConfig {
    /// F32 blocks, tied, no dropout.
    pub fn new(vocab: usize, d: usize, blocks: usize) -> Self {
        TinyConfig {
            vocab,
            d,
            blocks,
            precision: LinearPrecision::F32,
            dropout: None,
            recompute: false,
            tied: true,
            embed_decay: None,
            seed: 5,
            rank: 0,
        }
    }
}

fn plain(p: &GatheredParam) -> Result<&Buffer<f32>, NnError> {
    match p {
        GatheredParam::Plain(b) => Ok(b),
        _ => Err(NnError::usage("tiny", "expected a plain F32 parameter")),
    }
}

/// `E [vocab, d]`: `h = x E` for `x [tokens, vocab]`.
pub struct Embed {
    pub w: ParamId,
    vocab: usize,
    d: usize,
    seed: u64,
    decay: Option<bool>,
    x: Option<Tensor>,
}

impl Module for Embed {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        let (n, seed) = (self.vocab * self.d, self.seed);
        let init = move || normal(n, 0.5, seed);
        let shape = [self.vocab, self.d];
        let mut decl = ParamDecl::new(&shape, ParamKind::Plain, &init);
        if let Some(d) = self.decay {
            decl = decl.with_decay(d);
        }
        v.param("weight", &decl, &mut self.w)
    }
}

impl Embed {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor) -> Result<Tensor, NnError> {
        let rows = x.shape().rows();
        let dev = ctx.device().clone();
        let mut h = Tensor::uninit(&dev, Shape::matrix(rows, self.d)?)?;
        let spec = GemmSpec::new(rows, self.d, self.vocab).parallelism(ctx.cpu_parallelism());
        let e = plain(ctx.params([self.w])?[0])?;
        gemm_f32(&spec, x.data(), e, h.data_mut())?;
        self.x = ctx.is_training().then_some(x);
        Ok(h)
    }

    fn backward(&mut self, ctx: &mut Ctx<'_>, dh: Tensor) -> Result<(), NnError> {
        let x = self
            .x
            .take()
            .ok_or_else(|| NnError::usage("wte", "backward without a training forward"))?;
        let rows = x.shape().rows();
        let mut de = ctx.device().uninit::<f32>(self.vocab * self.d)?;
        let spec = GemmSpec::new(self.vocab, self.d, rows)
            .transposes(Transpose::Yes, Transpose::No)
            .parallelism(ctx.cpu_parallelism());
        gemm_f32(&spec, x.data(), dh.data(), &mut de)?;
        ctx.add_grad(self.w, &de)?;
        Ok(())
    }
}

/// `logits = h E^T + b` with `E` the embedding's (tied) or its own.
pub struct Head {
    pub tied: ParamId,
    pub own: ParamId,
    pub bias: ParamId,
    untied: bool,
    vocab: usize,
    d: usize,
    seed: u64,
    h: Option<Tensor>,
}

impl Head {
    pub fn weight_id(&self) -> ParamId {
        if self.untied {
            self.own
        } else {
            self.tied
        }
    }

    fn forward(&mut self, ctx: &mut Ctx<'_>, h: Tensor) -> Result<Tensor, NnError> {
        let rows = h.shape().rows();
        let dev = ctx.device().clone();
        let mut y = Tensor::zeros(&dev, Shape::matrix(rows, self.vocab)?)?;
        let spec = GemmSpec::new(rows, self.vocab, self.d)
            .transposes(Transpose::No, Transpose::Yes)
            .scalars(1.0, 1.0)
            .parallelism(ctx.cpu_parallelism());
        let [e, b] = ctx.params([self.weight_id(), self.bias])?;
        elementwise::bias_add(y.data_mut(), plain(b)?, rows, self.vocab)?;
        gemm_f32(&spec, h.data(), plain(e)?, y.data_mut())?;
        self.h = ctx.is_training().then_some(h);
        Ok(y)
    }

    fn backward(&mut self, ctx: &mut Ctx<'_>, dy: Tensor) -> Result<Tensor, NnError> {
        let h = self
            .h
            .take()
            .ok_or_else(|| NnError::usage("head", "backward without a training forward"))?;
        let rows = h.shape().rows();
        let dev = ctx.device().clone();
        let mut de = dev.uninit::<f32>(self.vocab * self.d)?;
        let spec = GemmSpec::new(self.vocab, self.d, rows)
            .transposes(Transpose::Yes, Transpose::No)
            .parallelism(ctx.cpu_parallelism());
        gemm_f32(&spec, dy.data(), h.data(), &mut de)?;
        let mut db = dev.uninit::<f32>(self.vocab)?;
        reduce::sum_over_rows(dy.data(), rows, self.vocab, &mut db)?;
        let mut dh = Tensor::uninit(&dev, Shape::matrix(rows, self.d)?)?;
        let spec = GemmSpec::new(rows, self.d, self.vocab).parallelism(ctx.cpu_parallelism());
        {
            let e = plain(ctx.params([self.weight_id()])?[0])?;
            gemm_f32(&spec, dy.data(), e, dh.data_mut())?;
        }
        ctx.add_grad(self.weight_id(), &de)?;
        ctx.add_grad(self.bias, &db)?;
        Ok(dh)
    }
}

impl Module for Head {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        if self.untied {
            let (n, seed) = (self.vocab * self.d, self.seed);
            let init = move || normal(n, 0.5, seed);
            let shape = [self.vocab, self.d];
            v.param(
                "weight",
                &ParamDecl::new(&shape, ParamKind::Plain, &init),
                &mut self.own,
            )?;
        }
        let (vocab, seed) = (self.vocab, self.seed);
        let init = move || values(seed ^ 0xB, vocab, 0.1);
        v.param(
            "bias",
            &ParamDecl::new(&[vocab], ParamKind::Plain, &init),
            &mut self.bias,
        )
    }
}

/// The network: `wte`, `h.0 ... h.{blocks-1}`, `head`, the loss.
pub struct TinyLm {
    pub config: TinyConfig,
    pub wte: Embed,
    pub h: Vec<Box<dyn Layer>>,
    pub head: Head,
    pub loss: LogSoftmaxNll,
}

impl Module for TinyLm {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("wte", &mut self.wte)?;
        // The head reads the embedding's parameter: one id held by two modules, declared by one.
        self.head.tied = self.wte.w;
        v.child("h", &mut self.h)?;
        v.child("head", &mut self.head)?;
        v.child("loss", &mut self.loss)
    }
}

impl TinyLm {
    pub fn new(c: TinyConfig) -> Result<Self, NnError> {
        let mut h: Vec<Box<dyn Layer>> = Vec::new();
        for b in 0..c.blocks {
            let mut block = Sequential::new()
                .push(
                    "fc",
                    Linear::<f32>::new(c.d, c.d)?
                        .with_precision(c.precision)?
                        .with_seed(stream_seed(c.seed, 10 + b as u64)),
                )
                .push("act", Relu::new());
            if let Some(p) = c.dropout {
                let seed = stream_seed(c.seed, 1000 + 64 * b as u64 + c.rank as u64);
                block = block.push("drop", Dropout::new(p, seed)?);
            }
            if c.recompute {
                h.push(Box::new(Recompute::new(block)));
            } else {
                h.push(Box::new(block));
            }
        }
        let emb_seed = stream_seed(c.seed, 1);
        Ok(TinyLm {
            config: c,
            wte: Embed {
                w: ParamId::UNSET,
                vocab: c.vocab,
                d: c.d,
                seed: emb_seed,
                decay: c.embed_decay,
                x: None,
            },
            h,
            head: Head {
                tied: ParamId::UNSET,
                own: ParamId::UNSET,
                bias: ParamId::UNSET,
                untied: !c.tied,
                vocab: c.vocab,
                d: c.d,
                seed: emb_seed,
                h: None,
            },
            loss: LogSoftmaxNll::new(c.vocab)?,
        })
    }

    /// The logits of `x [tokens, vocab]`.
    pub fn logits(&mut self, ctx: &mut Ctx<'_>, x: Tensor) -> Result<Tensor, NnError> {
        let mut h = self.wte.forward(ctx, x)?;
        for b in &mut self.h {
            h = b.forward(ctx, h)?;
        }
        self.head.forward(ctx, h)
    }

    /// The forward up to the loss; returns the logits and the loss statistics `[mean loss, correct,
    /// invalid labels]` (host copies).
    pub fn forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        x: Tensor,
        labels: &Buffer<i32>,
    ) -> Result<(Vec<f32>, Vec<f32>), NnError> {
        let logits = self.logits(ctx, x)?;
        let copy = logits.data().to_vec()?;
        let stats = self.loss.forward(ctx, logits, labels)?.to_vec()?;
        Ok((copy, stats))
    }

    /// The backward after a training forward, the loss gradient scaled by `grad_scale`.
    pub fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        labels: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<(), NnError> {
        let d = self.loss.backward(ctx, labels, grad_scale)?;
        let mut dh = self.head.backward(ctx, d)?;
        for b in self.h.iter_mut().rev() {
            dh = b.backward(ctx, dh)?;
        }
        self.wte.backward(ctx, dh)
    }
}

/// A batch: one-hot rows of random tokens and random labels.
#[derive(Debug, Clone)]
pub struct Batch {
    pub x: Vec<f32>,
    pub labels: Vec<i32>,
    pub rows: usize,
}

impl Batch {
    pub fn new(vocab: usize, rows: usize, seed: u64) -> Self {
        let mut rng = fp8_kernels::rng::SplitMix64::new(seed);
        let mut x = vec![0f32; rows * vocab];
        let mut labels = Vec::with_capacity(rows);
        for r in 0..rows {
            x[r * vocab + rng.below(vocab as u64) as usize] = 1.0;
            labels.push(rng.below(vocab as u64) as i32);
        }
        Batch { x, labels, rows }
    }

    /// Rows `range` of the batch.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Self {
        let vocab = self.x.len() / self.rows;
        Batch {
            x: self.x[range.start * vocab..range.end * vocab].to_vec(),
            labels: self.labels[range.clone()].to_vec(),
            rows: range.len(),
        }
    }

    /// Every element scaled by `s` (inputs larger than one-hot rows).
    pub fn scaled(mut self, s: f32) -> Self {
        self.x.iter_mut().for_each(|v| *v *= s);
        self
    }
}

/// The tiny model wrapped with one unit per block (`ChildrenOf("h")`), the root for the rest.
pub fn wrap(
    c: TinyConfig,
    comm: Arc<dyn Communicator>,
    fsdp: FsdpConfig,
) -> TestResult<FsdpModel<TinyLm>> {
    let mut model = FsdpModel::new(
        TinyLm::new(c)?,
        comm,
        WrapPolicy::ChildrenOf("h".into()),
        fsdp,
    )?;
    model.set_cpu_parallelism(fp8_kernels::CpuParallelism::Single);
    Ok(model)
}

/// A training forward and backward of `batch` with the loss gradient scaled by `grad_scale`; returns the
/// logits and the loss statistics.
pub fn train_pass(
    model: &mut FsdpModel<TinyLm>,
    batch: &Batch,
    grad_scale: f32,
) -> TestResult<(Vec<f32>, Vec<f32>)> {
    let dev = model.device().clone();
    let vocab = model.module().config.vocab;
    let x = Tensor::new(dev.upload(&batch.x)?, Shape::matrix(batch.rows, vocab)?)?;
    let labels = dev.upload(&batch.labels)?;
    let out = model.forward(fsdp_shard::Mode::Train, |m, ctx| m.forward(ctx, x, &labels))?;
    model.backward(|m, ctx| m.backward(ctx, &labels, grad_scale))?;
    Ok(out)
}

/// An evaluation forward: logits and loss statistics.
pub fn eval_pass(model: &mut FsdpModel<TinyLm>, batch: &Batch) -> TestResult<(Vec<f32>, Vec<f32>)> {
    let dev = model.device().clone();
    let vocab = model.module().config.vocab;
    let x = Tensor::new(dev.upload(&batch.x)?, Shape::matrix(batch.rows, vocab)?)?;
    let labels = dev.upload(&batch.labels)?;
    Ok(model.forward(fsdp_shard::Mode::Eval, |m, ctx| m.forward(ctx, x, &labels))?)
}

/// The f64 reference of an F32 tiny model without dropout: every parameter's gradient of
/// `sum_r grad_scale_r * mean NLL(batch_r)`, by name, from the parameter values by name.
pub fn reference_grads(
    c: &TinyConfig,
    params: &std::collections::BTreeMap<String, Vec<f32>>,
    batches: &[(Batch, f32)],
) -> std::collections::BTreeMap<String, Vec<f64>> {
    let f = |name: &str| -> Vec<f64> { params[name].iter().map(|&v| v as f64).collect() };
    let (v, d) = (c.vocab, c.d);
    let e = f("wte.weight");
    let e_head = if c.tied { e.clone() } else { f("head.weight") };
    let hb = f("head.bias");
    let ws: Vec<(Vec<f64>, Vec<f64>)> = (0..c.blocks)
        .map(|b| (f(&format!("h.{b}.fc.weight")), f(&format!("h.{b}.fc.bias"))))
        .collect();
    let mut g = std::collections::BTreeMap::<String, Vec<f64>>::new();
    let mut add = |name: String, vals: Vec<f64>| {
        let slot = g.entry(name).or_insert_with(|| vec![0.0; vals.len()]);
        slot.iter_mut().zip(vals).for_each(|(a, b)| *a += b);
    };
    // c[m, n] = a[m, k] b[k, n]
    let mm = |a: &[f64], b: &[f64], m: usize, k: usize, n: usize| -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for p in 0..k {
                let av = a[i * k + p];
                for j in 0..n {
                    out[i * n + j] += av * b[p * n + j];
                }
            }
        }
        out
    };
    let tr = |a: &[f64], r: usize, cc: usize| -> Vec<f64> {
        let mut t = vec![0.0; a.len()];
        for i in 0..r {
            for j in 0..cc {
                t[j * r + i] = a[i * cc + j];
            }
        }
        t
    };
    for (batch, scale) in batches {
        let t = batch.rows;
        let x: Vec<f64> = batch.x.iter().map(|&v| v as f64).collect();
        let mut hs = vec![mm(&x, &e, t, v, d)];
        let mut pre = Vec::new();
        for (w, b) in &ws {
            let h = hs.last().expect("h");
            let mut a = mm(h, &tr(w, d, d), t, d, d);
            for r in 0..t {
                for j in 0..d {
                    a[r * d + j] += b[j];
                }
            }
            hs.push(a.iter().map(|&z| z.max(0.0)).collect());
            pre.push(a);
        }
        let hl = hs.last().expect("h").clone();
        let mut logits = mm(&hl, &tr(&e_head, v, d), t, d, v);
        for r in 0..t {
            for j in 0..v {
                logits[r * v + j] += hb[j];
            }
        }
        // dlogits = (softmax - onehot) * scale / rows
        let mut dl = vec![0.0; t * v];
        for r in 0..t {
            let row = &logits[r * v..(r + 1) * v];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|&q| (q - m).exp()).sum();
            for j in 0..v {
                let p = (row[j] - m).exp() / z;
                let y = if j as i32 == batch.labels[r] {
                    1.0
                } else {
                    0.0
                };
                dl[r * v + j] = (p - y) * *scale as f64 / t as f64;
            }
        }
        let head_name = if c.tied { "wte.weight" } else { "head.weight" };
        add(head_name.into(), mm(&tr(&dl, t, v), &hl, v, t, d));
        add(
            "head.bias".into(),
            (0..v)
                .map(|j| (0..t).map(|r| dl[r * v + j]).sum())
                .collect(),
        );
        let mut dh = mm(&dl, &e_head, t, v, d);
        for b in (0..c.blocks).rev() {
            let da: Vec<f64> = dh
                .iter()
                .zip(&pre[b])
                .map(|(&g, &a)| if a > 0.0 { g } else { 0.0 })
                .collect();
            add(
                format!("h.{b}.fc.weight"),
                mm(&tr(&da, t, d), &hs[b], d, t, d),
            );
            add(
                format!("h.{b}.fc.bias"),
                (0..d)
                    .map(|j| (0..t).map(|r| da[r * d + j]).sum())
                    .collect(),
            );
            dh = mm(&da, &ws[b].0, t, d, d);
        }
        add("wte.weight".into(), mm(&tr(&x, t, v), &dh, v, t, d));
    }
    g
}
