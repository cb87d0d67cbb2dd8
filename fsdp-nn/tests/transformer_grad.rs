//! Finite-difference checks of the transformer layers' backward passes in F32 on the CPU (where the
//! attention is the F32 reference, so nothing is rounded to BF16): embeddings, LayerNorm/RMSNorm (both the
//! returned and the accumulated input gradient), causal self-attention, the chunked LM head with its
//! cross-entropy, and the pre-norm block. Each check perturbs one parameter (or the layer's input, held
//! as a parameter) along a random +-1 direction by 1 % of its RMS and compares the central difference of
//! the loss with the analytic directional derivative.

mod transformer_common;

use fsdp_nn::{
    BlockConfig, CausalSelfAttention, Embedding, Layer, LmHead, Mlp, MlpActivation, NnError, Norm,
    Rope, Tensor, TokenBatch, TransformerBlock,
};
use fsdp_shard::{Ctx, FsdpModel, Mode, Module, ParamId, ShardError, Visitor};
use transformer_common::*;

/// `y = layer(x)` with `x` a parameter; the loss is `sum(y * r)` for a fixed `r`.
struct Probe<L> {
    src: Source,
    layer: L,
}

impl<L: Module> Module for Probe<L> {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("src", &mut self.src)?;
        v.child("layer", &mut self.layer)
    }
}

impl<L: Layer<f32>> Probe<L> {
    fn forward(&mut self, ctx: &mut Ctx<'_>) -> Result<Vec<f32>, NnError> {
        let x = self.src.tensor(ctx)?;
        Ok(self.layer.forward(ctx, x)?.data().to_vec()?)
    }

    fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        r: &[f32],
        shape: fsdp_nn::Shape,
    ) -> Result<(), NnError> {
        let dy = Tensor::new(ctx.device().upload(r)?, shape)?;
        let dx = self.layer.backward(ctx, dy)?;
        self.src.backward(ctx, &dx)
    }
}

/// Checks every parameter of `Probe(layer)` (the input included) by finite differences.
fn check_layer<L: Layer<f32> + 'static>(
    what: &str,
    layer: L,
    x_shape: &[usize],
    out_shape: &[usize],
    rel: f64,
) {
    let n: usize = x_shape.iter().product();
    let src = Source::new(x_shape, uniform(n, 1.0, 11));
    let mut model = one_rank(Probe { src, layer });
    let out_n: usize = out_shape.iter().product();
    let r = uniform(out_n, 1.0, 12);
    let out = fsdp_nn::Shape::new(out_shape).unwrap();
    model.forward(Mode::Train, |m, ctx| m.forward(ctx)).unwrap();
    model.backward(|m, ctx| m.backward(ctx, &r, out)).unwrap();
    let names = model.param_names().unwrap();
    let grads: Vec<(String, ParamId, Vec<f32>)> = names
        .into_iter()
        .map(|(name, id)| {
            let g = grad(&model, id);
            (name, id, g)
        })
        .collect();
    let mut loss = |m: &mut FsdpModel<Probe<L>>| -> f64 {
        let y = m.forward(Mode::Eval, |m, ctx| m.forward(ctx)).unwrap();
        dot(&y, &r)
    };
    for (k, (name, id, g)) in grads.iter().enumerate() {
        for dir in 0..2u64 {
            let (fd, an) = directional(
                &mut model,
                *id,
                g,
                100 + 7 * k as u64 + dir,
                1e-3,
                &mut loss,
            );
            assert_close(&format!("{what} {name} direction {dir}"), fd, an, rel, 1e-9);
        }
    }
}

#[test]
fn layer_norm_and_rms_norm_backward() {
    check_layer(
        "LayerNorm",
        Norm::<f32>::layer_norm(24).unwrap(),
        &[5, 24],
        &[5, 24],
        2e-3,
    );
    check_layer(
        "LayerNorm+bias",
        Norm::<f32>::layer_norm(24).unwrap().with_bias(),
        &[2, 3, 24],
        &[2, 3, 24],
        2e-3,
    );
    check_layer(
        "RMSNorm",
        Norm::<f32>::rms_norm(24).unwrap(),
        &[5, 24],
        &[5, 24],
        2e-3,
    );
}

/// `z = x + norm(x)`: the backward adds the norm's input gradient into `dz` in place (the pre-norm
/// block's residual gradient).
struct Residual {
    src: Source,
    norm: Norm<f32>,
}

impl Module for Residual {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("src", &mut self.src)?;
        v.child("norm", &mut self.norm)
    }
}

impl Residual {
    fn forward(&mut self, ctx: &mut Ctx<'_>) -> Result<Vec<f32>, NnError> {
        let x = self.src.tensor(ctx)?;
        let y = self.norm.forward_ref(ctx, &x)?;
        let (x, y) = (x.data().to_vec()?, y.data().to_vec()?);
        Ok(x.iter().zip(&y).map(|(a, b)| a + b).collect())
    }

    /// Returns `(accumulated, r + returned dx)` to compare the two modes.
    fn backward(&mut self, ctx: &mut Ctx<'_>, r: &[f32], fresh: bool) -> Result<Vec<f32>, NnError> {
        let x = self.src.tensor(ctx)?;
        let shape = x.shape();
        let dz = Tensor::new(ctx.device().upload(r)?, shape)?;
        let mut acc = Tensor::new(ctx.device().upload(r)?, shape)?;
        if fresh {
            let dx = self.norm.backward_ref(ctx, &x, &dz, None)?.expect("dx");
            let v: Vec<f32> = dx
                .data()
                .to_vec()?
                .iter()
                .zip(r)
                .map(|(a, b)| b + a)
                .collect();
            return Ok(v);
        }
        assert!(self
            .norm
            .backward_ref(ctx, &x, &dz, Some(&mut acc))?
            .is_none());
        self.src.backward(ctx, &acc)?;
        acc.data().to_vec().map_err(Into::into)
    }
}

#[test]
fn norm_accumulate_mode_is_the_residual_gradient() {
    for rms in [false, true] {
        let norm = if rms {
            Norm::rms_norm(16)
        } else {
            Norm::layer_norm(16)
        }
        .unwrap()
        .with_bias();
        let src = Source::new(&[6, 16], uniform(96, 2.0, 3));
        let mut model = one_rank(Residual { src, norm });
        let r = uniform(96, 1.0, 4);
        // Accumulating equals adding the returned dx to the residual gradient, bit for bit in f32.
        model.forward(Mode::Train, |m, ctx| m.forward(ctx)).unwrap();
        let fresh = model.backward(|m, ctx| m.backward(ctx, &r, true)).unwrap();
        model.sharded_mut().zero_grads().unwrap();
        model.forward(Mode::Train, |m, ctx| m.forward(ctx)).unwrap();
        let acc = model.backward(|m, ctx| m.backward(ctx, &r, false)).unwrap();
        assert_eq!(fresh, acc, "rms {rms}");
        let names = model.param_names().unwrap();
        let mut loss = |m: &mut FsdpModel<Residual>| -> f64 {
            let z = m.forward(Mode::Eval, |m, ctx| m.forward(ctx)).unwrap();
            dot(&z, &r)
        };
        for (k, (name, id)) in names.into_iter().enumerate() {
            let g = grad(&model, id);
            let (fd, an) = directional(&mut model, id, &g, 40 + k as u64, 1e-3, &mut loss);
            assert_close(
                &format!("residual norm (rms {rms}) {name}"),
                fd,
                an,
                2e-3,
                1e-9,
            );
        }
    }
}

#[test]
fn attention_backward() {
    // d = 16 in 2 heads of 8; larger weights than GPT-2's so the softmax is far from uniform.
    let attn = CausalSelfAttention::<f32>::new(16, 2, [0.4, 0.3])
        .unwrap()
        .with_seed(5);
    check_layer("attention", attn, &[2, 5, 16], &[2, 5, 16], 3e-3);
}

/// Llama-style RoPE (a small base so the rotation turns noticeably within a few positions).
fn rope() -> Rope {
    Rope {
        theta: 10.0,
        scaling: None,
        max_positions: 8,
    }
}

#[test]
fn grouped_query_attention_with_rope_backward() {
    // d = 32 in 4 query heads of 8 over 2 and over 1 key/value heads, RoPE on the queries and keys.
    for kv_heads in [2, 1] {
        let attn = CausalSelfAttention::<f32>::grouped(32, 4, kv_heads, [0.4, 0.3])
            .unwrap()
            .with_seed(5)
            .with_rope(rope())
            .unwrap();
        check_layer(
            &format!("GQA attention ({kv_heads} kv heads) with RoPE"),
            attn,
            &[2, 5, 32],
            &[2, 5, 32],
            3e-3,
        );
    }
}

#[test]
fn swiglu_mlp_backward() {
    let mlp = Mlp::<f32>::with_activation(16, 24, MlpActivation::SwiGlu)
        .unwrap()
        .with_init(
            fsdp_nn::WeightInit::Normal(0.4),
            fsdp_nn::WeightInit::Normal(0.3),
        )
        .with_seed(3);
    check_layer("SwiGLU MLP", mlp, &[2, 3, 16], &[2, 3, 16], 3e-3);
}

#[test]
fn llama_block_backward() {
    let cfg = BlockConfig {
        init_std: 0.3,
        proj_std: 0.2,
        seed: Some(9),
        ..BlockConfig::llama(32, 4, 2, 40, 2, rope())
    };
    let block = TransformerBlock::<f32>::new(&cfg).unwrap();
    check_layer("Llama block", block, &[2, 4, 32], &[2, 4, 32], 3e-3);
}

#[test]
fn transformer_block_backward() {
    for norm in [
        fp8_kernels::layer_norm::NormKind::LayerNorm,
        fp8_kernels::layer_norm::NormKind::RmsNorm,
    ] {
        let cfg = BlockConfig {
            init_std: 0.3,
            proj_std: 0.2,
            seed: Some(9),
            norm,
            ..BlockConfig::gpt2(16, 2, 2)
        };
        let block = TransformerBlock::<f32>::new(&cfg).unwrap();
        check_layer(
            &format!("block ({norm:?})"),
            block,
            &[2, 4, 16],
            &[2, 4, 16],
            3e-3,
        );
    }
}

/// The token and position embeddings summed; the loss is `sum(y * r)`.
struct Embed {
    wte: Embedding,
    wpe: Embedding,
}

impl Module for Embed {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("wte", &mut self.wte)?;
        v.child("wpe", &mut self.wpe)
    }
}

#[test]
fn embedding_backward() {
    let (vocab, d, seq, batch) = (20, 8, 6, 3);
    let mut model = one_rank(Embed {
        wte: Embedding::new(vocab, d)
            .map(|l| l.with_seed(1))
            .unwrap()
            .with_std(0.5),
        wpe: Embedding::new(seq + 2, d)
            .map(|l| l.with_seed(2))
            .unwrap()
            .with_std(0.5),
    });
    // Repeated ids (7 three times, 0 and 19 at the ends of the table).
    let ids = [7, 3, 7, 0, 19, 7, 1, 2, 3, 4, 5, 6, 19, 18, 17, 16, 15, 14];
    let dev = model.device().clone();
    let tb = TokenBatch::new(&dev, &ids, &ids, batch, seq, vocab).unwrap();
    let r = uniform(batch * seq * d, 1.0, 8);
    let y: Vec<f32> = model
        .forward(Mode::Train, |m, ctx| {
            let y = m.wte.forward::<f32>(ctx, &tb, Some(&m.wpe))?;
            y.data().to_vec().map_err(NnError::from)
        })
        .unwrap();
    // The forward is the sum of the two rows, exactly.
    let (wte, wpe) = (
        values(&model, model.module().wte.weight_id()),
        values(&model, model.module().wpe.weight_id()),
    );
    for (p, &id) in ids.iter().enumerate() {
        for c in 0..d {
            assert_eq!(
                y[p * d + c],
                wte[id as usize * d + c] + wpe[(p % seq) * d + c]
            );
        }
    }
    model
        .backward(|m, ctx| {
            let dy = Tensor::new(
                ctx.device().upload(&r)?,
                fsdp_nn::Shape::new(&[batch, seq, d])?,
            )?;
            m.wte.backward(ctx, &dy, &tb, Some(&m.wpe))
        })
        .unwrap();
    // The gradient is a sum of rows of r: compare with f64 sums, then by finite differences.
    let g_wte = grad(&model, model.module().wte.weight_id());
    let g_wpe = grad(&model, model.module().wpe.weight_id());
    for row in 0..vocab {
        for c in 0..d {
            let want: f64 = ids
                .iter()
                .enumerate()
                .filter(|(_, &i)| i as usize == row)
                .map(|(p, _)| r[p * d + c] as f64)
                .sum();
            assert!(
                (g_wte[row * d + c] as f64 - want).abs() < 1e-6,
                "wte[{row}, {c}]"
            );
        }
    }
    for t in 0..seq + 2 {
        for c in 0..d {
            let want: f64 = if t < seq {
                (0..batch).map(|b| r[(b * seq + t) * d + c] as f64).sum()
            } else {
                0.0
            };
            assert!(
                (g_wpe[t * d + c] as f64 - want).abs() < 1e-6,
                "wpe[{t}, {c}]"
            );
        }
    }
    let mut loss = |m: &mut FsdpModel<Embed>| -> f64 {
        let y = m
            .forward(Mode::Eval, |m, ctx| {
                let y = m.wte.forward::<f32>(ctx, &tb, Some(&m.wpe))?;
                y.data().to_vec().map_err(NnError::from)
            })
            .unwrap();
        dot(&y, &r)
    };
    for (k, (id, g)) in [
        (model.module().wte.weight_id(), g_wte),
        (model.module().wpe.weight_id(), g_wpe),
    ]
    .into_iter()
    .enumerate()
    {
        let (fd, an) = directional(&mut model, id, &g, 60 + k as u64, 1e-3, &mut loss);
        assert_close(&format!("embedding table {k}"), fd, an, 1e-4, 1e-9);
    }
    // Ids outside the table are refused when the batch is made.
    let bad = TokenBatch::new(&dev, &[0, 20], &[0, 0], 1, 2, vocab).unwrap_err();
    assert!(bad.to_string().contains("20"), "{bad}");
    let bad = TokenBatch::new(&dev, &[0, 1], &[0, -1], 1, 2, vocab).unwrap_err();
    assert!(bad.to_string().contains("-1"), "{bad}");
    assert!(TokenBatch::new(&dev, &[0, 1, 2], &[0, 1, 2], 1, 2, vocab).is_err());
}

/// The LM head on an input held as a parameter; the loss is the head's mean cross-entropy.
struct Head {
    src: Source,
    head: LmHead<f32>,
}

impl Module for Head {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("src", &mut self.src)?;
        v.child("lm_head", &mut self.head)
    }
}

impl Head {
    fn forward(
        &mut self,
        ctx: &mut Ctx<'_>,
        targets: &fp8_kernels::Buffer<i32>,
        early: Option<f32>,
    ) -> Result<f64, NnError> {
        let x = self.src.tensor(ctx)?;
        match early {
            Some(g) => self.head.forward_with_grad(ctx, x, targets, g)?,
            None => self.head.forward(ctx, x, targets)?,
        }
        let per = self.head.loss()?.per_token.to_vec()?;
        Ok(per.iter().map(|&l| l as f64).sum::<f64>() / per.len() as f64)
    }

    fn backward(
        &mut self,
        ctx: &mut Ctx<'_>,
        targets: &fp8_kernels::Buffer<i32>,
        g: f32,
    ) -> Result<(), NnError> {
        let dx = self.head.backward(ctx, targets, g)?;
        self.src.backward(ctx, &dx)
    }
}

fn head_model(chunk: usize) -> FsdpModel<Head> {
    head_model_in(chunk, false)
}

fn head_model_in(chunk: usize, fp8: bool) -> FsdpModel<Head> {
    let (tokens, d, vocab) = (10, 8, 24);
    one_rank(Head {
        src: Source::new(&[tokens, d], uniform(tokens * d, 1.0, 21)),
        head: LmHead::new(d, vocab)
            .map(|l| l.with_seed(22))
            .unwrap()
            .with_std(0.5)
            .with_chunk(chunk)
            .unwrap()
            .with_fp8(fp8),
    })
}

/// Loss and every gradient of one step: (loss, [x grad, weight grad]).
fn head_step(
    model: &mut FsdpModel<Head>,
    targets: &[i32],
    scale: f32,
    early: bool,
) -> (f64, Vec<Vec<f32>>) {
    model.sharded_mut().zero_grads().unwrap();
    let dev = model.device().clone();
    let t = dev.upload(targets).unwrap();
    let loss = model
        .forward(Mode::Train, |m, ctx| {
            m.forward(ctx, &t, early.then_some(scale))
        })
        .unwrap();
    model.backward(|m, ctx| m.backward(ctx, &t, scale)).unwrap();
    let ids = [model.module().src.id, model.module().head.weight_id()];
    (loss, ids.iter().map(|&id| grad(model, id)).collect())
}

#[test]
fn lm_head_backward_chunked() {
    let targets: Vec<i32> = (0..10).map(|i| (i * 7 + 3) % 24).collect();
    // Chunks of 4, 4 and 2 tokens.
    let mut model = head_model(4);
    let (_, grads) = head_step(&mut model, &targets, 1.0, false);
    let dev = model.device().clone();
    let t = dev.upload(&targets).unwrap();
    let mut loss = |m: &mut FsdpModel<Head>| -> f64 {
        m.forward(Mode::Eval, |m, ctx| m.forward(ctx, &t, None))
            .unwrap()
    };
    let ids = [model.module().src.id, model.module().head.weight_id()];
    for (k, (id, g)) in ids.into_iter().zip(&grads).enumerate() {
        for dir in 0..2 {
            let (fd, an) = directional(&mut model, id, g, 80 + 2 * k as u64 + dir, 1e-3, &mut loss);
            assert_close(
                &format!("LM head parameter {k} direction {dir}"),
                fd,
                an,
                2e-3,
                1e-9,
            );
        }
    }
}

#[test]
fn lm_head_chunking_and_early_gradients_agree() {
    let targets: Vec<i32> = (0..10).map(|i| (i * 5 + 1) % 24).collect();
    let scale = 0.25;
    let (loss_one, g_one) = head_step(&mut head_model(1000), &targets, scale, false);
    for chunk in [1, 3, 4, 10] {
        let mut m = head_model(chunk);
        let (loss, g) = head_step(&mut m, &targets, scale, false);
        // Per-token losses are computed row by row: the same bits; the sums of dW over chunks differ
        // from one GEMM in the order of additions only.
        assert_eq!(loss.to_bits(), loss_one.to_bits(), "chunk {chunk}: loss");
        for (k, (a, b)) in g.iter().zip(&g_one).enumerate() {
            let max = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-6 * max,
                    "chunk {chunk}, gradient {k}: {x} vs {y}"
                );
            }
        }
        // Gradients made during the forward equal those of the backward's recomputation, bit for bit.
        let (loss_e, g_e) = head_step(&mut m, &targets, scale, true);
        assert_eq!(loss_e.to_bits(), loss.to_bits());
        assert_eq!(g_e, g, "chunk {chunk}: early gradients");
    }
    // The gradient is of `scale * mean loss`.
    let (_, g_unit) = head_step(&mut head_model(4), &targets, 1.0, false);
    let (_, g_scaled) = head_step(&mut head_model(4), &targets, scale, false);
    for (a, b) in g_unit[1].iter().zip(&g_scaled[1]) {
        assert!(
            (a * scale - b).abs() <= 1e-6 * a.abs().max(1e-3),
            "{a} * {scale} vs {b}"
        );
    }
    // A backward with another scale than the forward's gradients is refused.
    let mut m = head_model(4);
    let dev = m.device().clone();
    let t = dev.upload(&targets).unwrap();
    m.forward(Mode::Train, |m, ctx| m.forward(ctx, &t, Some(0.5)))
        .unwrap();
    assert!(m.backward(|m, ctx| m.backward(ctx, &t, 0.25)).is_err());
}

/// `v` through an FP8 format at the power-of-two scale of `bound` (the value the kernels' GEMMs read:
/// `decode(encode(v s)) / s`).
fn fake_quantize(v: &[f32], format: fp8_core::Fp8Format, bound: f32) -> Vec<f32> {
    let s = fp8_core::compute_scale(
        bound,
        format.max(),
        0,
        fp8_core::ScaleRounding::PowerOfTwo,
        1.0,
    );
    v.iter()
        .map(|&x| format.decode(format.encode(x * s)) * (1.0 / s))
        .collect()
}

fn amax(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// The FP8 head against its definition built from float pieces on the CPU: `x` and `W` through E4M3 at
/// the power-of-two scales of their amaxes, the F32 GEMM, the cross-entropy kernel's gradient, that
/// gradient through E5M2 at the scale of `grad_scale / tokens`, then `dx = G W_q` and `dW = G^T x_q`.
/// A wrong scale, format, operand layout or chunk accumulation breaks the agreement by far more than
/// the summation-order slack allowed.
#[test]
fn fp8_lm_head_equals_its_quantized_definition() {
    use fp8_core::Fp8Format::{E4M3, E5M2};
    use fp8_kernels::cross_entropy::{cross_entropy, CrossEntropyOutputs, CrossEntropySpec};
    use fp8_kernels::gemm::gemm_f32;
    use fp8_kernels::{Device, GemmSpec, Transpose};

    let (tokens, d, vocab) = (10usize, 8usize, 24usize);
    let targets: Vec<i32> = (0..10).map(|i| (i * 5 + 1) % 24).collect();
    let scale = 0.25f32;
    for (chunk, early) in [(4, false), (4, true), (1000, false), (3, true)] {
        let mut model = head_model_in(chunk, true);
        assert!(model.module().head.is_fp8());
        let (loss, g) = head_step(&mut model, &targets, scale, early);
        let x = values(&model, model.module().src.id);
        let w = values(&model, model.module().head.weight_id());

        let dev = Device::Cpu;
        let xq = fake_quantize(&x, E4M3, amax(&x));
        let wq = fake_quantize(&w, E4M3, amax(&w));
        let mut logits = dev.zeros::<f32>(tokens * vocab).unwrap();
        let fwd = GemmSpec::new(tokens, vocab, d).transposes(Transpose::No, Transpose::Yes);
        gemm_f32(
            &fwd,
            &dev.upload(&xq).unwrap(),
            &dev.upload(&wq).unwrap(),
            &mut logits,
        )
        .unwrap();
        let row_scale = scale / tokens as f32;
        let (mut lse, mut per) = (dev.zeros(tokens).unwrap(), dev.zeros(tokens).unwrap());
        let (mut sum, mut bad) = (dev.zeros(1).unwrap(), dev.zeros(1).unwrap());
        let spec = CrossEntropySpec {
            rows: tokens,
            vocab,
            row_offset: 0,
            ignore_index: None,
            grad_scale: Some(row_scale),
        };
        let t = dev.upload(&targets).unwrap();
        let outputs = CrossEntropyOutputs {
            lse: &mut lse,
            loss: &mut per,
            loss_sum: &mut sum,
            invalid_targets: &mut bad,
        };
        cross_entropy(&spec, &mut logits, &t, outputs).unwrap();
        let want_loss: f64 =
            per.to_vec().unwrap().iter().map(|&l| l as f64).sum::<f64>() / tokens as f64;
        let gq = fake_quantize(&logits.to_vec().unwrap(), E5M2, row_scale);
        let gq = dev.upload(&gq).unwrap();
        let mut dx = dev.zeros::<f32>(tokens * d).unwrap();
        gemm_f32(
            &GemmSpec::new(tokens, d, vocab),
            &gq,
            &dev.upload(&wq).unwrap(),
            &mut dx,
        )
        .unwrap();
        let mut dw = dev.zeros::<f32>(vocab * d).unwrap();
        let dw_spec = GemmSpec::new(vocab, d, tokens).transposes(Transpose::Yes, Transpose::No);
        gemm_f32(&dw_spec, &gq, &dev.upload(&xq).unwrap(), &mut dw).unwrap();

        let what = format!("chunk {chunk}, early {early}");
        assert!(
            (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
            "{what}: loss {loss} vs {want_loss}"
        );
        for (k, (got, want)) in g
            .iter()
            .zip([dx.to_vec().unwrap(), dw.to_vec().unwrap()])
            .enumerate()
        {
            let max = amax(&want);
            assert!(max > 0.0, "{what}: gradient {k} is zero");
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * max,
                    "{what}, gradient {k}[{i}]: {a} vs {b}"
                );
            }
        }
    }
}

/// The FP8 head's loss and gradients stay within FP8's error of the float head's, its evaluation
/// forward gives the training forward's loss bit for bit, and it does differ from the float head (the
/// flag is not ignored).
#[test]
fn fp8_lm_head_is_close_to_the_float_head() {
    let targets: Vec<i32> = (0..10).map(|i| (i * 7 + 3) % 24).collect();
    let scale = 1.0;
    let (loss_f, g_f) = head_step(&mut head_model_in(4, false), &targets, scale, false);
    let mut model = head_model_in(4, true);
    let (loss_q, g_q) = head_step(&mut model, &targets, scale, false);
    assert_ne!(
        loss_q.to_bits(),
        loss_f.to_bits(),
        "the FP8 head computed the float loss"
    );
    assert!(
        (loss_q - loss_f).abs() <= 0.02 * loss_f.abs(),
        "loss {loss_q} vs float {loss_f}"
    );
    for (k, (q, f)) in g_q.iter().zip(&g_f).enumerate() {
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in q.iter().zip(f) {
            num += (*a as f64 - *b as f64).powi(2);
            den += (*b as f64).powi(2);
        }
        let rel = (num / den).sqrt();
        assert!(
            rel < 0.1,
            "gradient {k}: relative L2 error {rel} against the float head"
        );
    }
    let dev = model.device().clone();
    let t = dev.upload(&targets).unwrap();
    let eval = model
        .forward(Mode::Eval, |m, ctx| m.forward(ctx, &t, None))
        .unwrap();
    assert_eq!(eval.to_bits(), loss_q.to_bits(), "evaluation loss");
}

#[test]
fn a_sole_reader_embedding_drops_its_gathered_table_after_the_lookup() {
    let (vocab, d, seq, batch) = (20, 8, 6, 3);
    let ids = [7, 3, 7, 0, 19, 7, 1, 2, 3, 4, 5, 6, 19, 18, 17, 16, 15, 14];
    let r = uniform(batch * seq * d, 1.0, 8);
    let mut runs = Vec::new();
    for sole in [false, true] {
        // The position table stays unused: a second table in the same unit.
        let mut model = one_rank(Embed {
            wte: Embedding::new(vocab, d)
                .map(|l| l.with_seed(1).with_std(0.5).with_sole_reader(sole))
                .unwrap(),
            wpe: Embedding::new(4, d).map(|l| l.with_seed(2)).unwrap(),
        });
        let dev = model.device().clone();
        let tb = TokenBatch::new(&dev, &ids, &ids, batch, seq, vocab).unwrap();
        let p = model.module().wte.weight_id().index().unwrap();
        let mut per_step = Vec::new();
        for _ in 0..2 {
            let y: Vec<f32> = model
                .forward(Mode::Train, |m, ctx| {
                    let y = m.wte.forward::<f32>(ctx, &tb, None)?;
                    // The other table of the unit is still there to read.
                    ctx.plain(m.wpe.weight_id())?;
                    y.data().to_vec().map_err(NnError::from)
                })
                .unwrap();
            let held = model.sharded().memory().unwrap().gathered;
            let taken = model.sharded().is_taken(p);
            model
                .backward(|m, ctx| {
                    let dy = Tensor::new(
                        ctx.device().upload(&r)?,
                        fsdp_nn::Shape::new(&[batch, seq, d])?,
                    )?;
                    m.wte.backward(ctx, &dy, &tb, None)
                })
                .unwrap();
            let g = grad(&model, model.module().wte.weight_id());
            model.sharded_mut().zero_grads().unwrap();
            per_step.push((y, held, taken, g));
        }
        // An evaluation forward borrows the table as gathered.
        model
            .forward(Mode::Eval, |m, ctx| {
                m.wte.forward::<f32>(ctx, &tb, None).map(drop)
            })
            .unwrap();
        runs.push(per_step);
    }
    for (step, (kept, dropped)) in runs[0].iter().zip(&runs[1]).enumerate() {
        // The same lookup and the same gradient, bit for bit; the table's 20 x 8 F32 values gone from
        // the gathered unit after the forward.
        assert_eq!(kept.0, dropped.0, "step {step}: forward");
        assert_eq!(kept.3, dropped.3, "step {step}: gradient");
        assert_eq!(
            kept.1 - dropped.1,
            vocab * d * 4,
            "step {step}: gathered bytes"
        );
        assert_eq!((kept.2, dropped.2), (false, true), "step {step}");
    }
}
