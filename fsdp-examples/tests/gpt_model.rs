//! The GPT model: parameter names and shapes against the PyTorch peer's, initialisation, FLOPs, batch
//! checks, a finite-difference check of the whole model in F32, the tied table's gradient, and the
//! equivalence of its forward variants.

mod gpt_common;

use fp8_core::Fp8Recipe;
use fsdp_examples::gpt::{Gpt, GptConfig, Sampling, GPT2_PADDED_VOCAB, PRESETS};
use fsdp_nn::{convert_to_fp8, Fp8Filter, LinearPrecision};
use fsdp_shard::{FsdpModel, Mode, ParamKind};
use gpt_common::*;
use half::bf16;

/// The peer's `named_parameters()` for `L` blocks (bench/peers/peer_gpt.py: `GPT.__init__` registers
/// `wte`, `wpe`, `h`, `ln_f`, `lm_head`, whose weight is `wte.weight` and so is not listed again; each
/// `Block.__init__` registers `ln_1`, `c_attn`, `attn_proj`, `ln_2`, `c_fc`, `mlp_proj`, all without
/// biases), with their shapes.
fn peer_parameters(d: usize, layers: usize, seq: usize) -> Vec<(String, Vec<usize>)> {
    let mut v = vec![
        ("wte.weight".to_string(), vec![50304, d]),
        ("wpe.weight".to_string(), vec![seq, d]),
    ];
    for i in 0..layers {
        for (name, shape) in [
            ("ln_1.weight", vec![d]),
            ("c_attn.weight", vec![3 * d, d]),
            ("attn_proj.weight", vec![d, d]),
            ("ln_2.weight", vec![d]),
            ("c_fc.weight", vec![4 * d, d]),
            ("mlp_proj.weight", vec![d, 4 * d]),
        ] {
            v.push((format!("h.{i}.{name}"), shape));
        }
    }
    v.push(("ln_f.weight".to_string(), vec![d]));
    v
}

#[test]
fn parameter_names_and_shapes_are_the_peers() {
    for &(name, d, layers, heads) in &PRESETS {
        let config = GptConfig::preset(name, 256).unwrap();
        assert_eq!(
            (config.d_model, config.layers, config.heads),
            (d, layers, heads)
        );
        let mut model = Gpt::<bf16>::new(config.clone()).unwrap();
        let specs = fsdp_shard::module::param_specs(&mut model).unwrap();
        let ours: Vec<(String, Vec<usize>)> = specs
            .iter()
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect();
        assert_eq!(ours, peer_parameters(d, layers, 256), "{name}");
        let total: usize = specs.iter().map(|s| s.numel()).sum();
        assert_eq!(total, config.num_params(), "{name}");
        // Unconverted, every parameter is plain.
        for s in &specs {
            assert_eq!(s.kind, ParamKind::Plain, "{}", s.name);
            assert_eq!(
                s.decay,
                s.shape.len() == 2,
                "{}: decay as the peer's groups",
                s.name
            );
        }
    }
    // The untied variant adds the head's own matrix at the end.
    let config = GptConfig {
        tie_embeddings: false,
        ..GptConfig::preset("tiny", 64).unwrap()
    };
    let mut model = Gpt::<f32>::new(config.clone()).unwrap();
    let specs = fsdp_shard::module::param_specs(&mut model).unwrap();
    assert_eq!(specs.last().unwrap().name, "lm_head.weight");
    assert_eq!(
        specs.iter().map(|s| s.numel()).sum::<usize>(),
        config.num_params()
    );
    assert!(GptConfig::preset("gpt5", 64).is_err());
}

#[test]
fn parameter_count_and_flops_are_the_peers_formula() {
    // gpt2 at T = 1024: V d + T d + L (12 d^2 + 2 d) + d, computed by hand.
    let c = GptConfig::preset("gpt2", 1024).unwrap();
    let n = 50304 * 768 + 1024 * 768 + 12 * (12 * 768 * 768 + 2 * 768) + 768;
    assert_eq!(n, 124_373_760);
    assert_eq!(c.num_params(), n);
    // flops_per_token = 6 (N - T d) + 6 L T d.
    let f = 6.0 * (n as f64 - 1024.0 * 768.0) + 6.0 * 12.0 * 1024.0 * 768.0;
    assert_eq!(c.flops_per_token(), f);
    let xl = GptConfig::preset("gpt2-xl", 1024).unwrap();
    assert_eq!(
        xl.num_params(),
        50304 * 1600 + 1024 * 1600 + 48 * (12 * 1600 * 1600 + 3200) + 1600
    );
}

#[test]
fn fp8_layer_choice() {
    let fp8 = |preset: &str| -> Vec<String> {
        let mut gpt = Gpt::<bf16>::new(GptConfig::preset(preset, 64).unwrap()).unwrap();
        convert_to_fp8(&mut gpt, &Fp8Filter::auto(), &Fp8Recipe::default())
            .unwrap()
            .into_iter()
            .filter(|p| p.starts_with("h.0."))
            .collect()
    };
    // gpt2: every linear stays BF16; gpt-3b: every linear FP8; gpt2-xl: all but attn_proj.
    assert!(fp8("gpt2").is_empty());
    assert_eq!(
        fp8("gpt-3b"),
        ["h.0.c_attn", "h.0.attn_proj", "h.0.c_fc", "h.0.mlp_proj"]
    );
    assert_eq!(fp8("gpt2-xl"), ["h.0.c_attn", "h.0.c_fc", "h.0.mlp_proj"]);
    // The converted model stores exactly those weights as FP8.
    let mut model = Gpt::<bf16>::new(GptConfig::preset("gpt2-xl", 64).unwrap()).unwrap();
    convert_to_fp8(&mut model, &Fp8Filter::auto(), &Fp8Recipe::default()).unwrap();
    let specs = fsdp_shard::module::param_specs(&mut model).unwrap();
    for s in specs.iter().filter(|s| s.name.starts_with("h.")) {
        let fp8 = s.name.ends_with("c_attn.weight")
            || s.name.ends_with("c_fc.weight")
            || s.name.ends_with("mlp_proj.weight");
        assert_eq!(s.kind == ParamKind::Fp8Weight, fp8, "{}", s.name);
    }
    // Unconverted, the linears are the activations' float precision.
    let mut none = Gpt::<f32>::new(GptConfig::preset("tiny", 64).unwrap()).unwrap();
    assert!(fsdp_nn::linear_precisions(&mut none)
        .unwrap()
        .iter()
        .all(|l| l.3 == LinearPrecision::F32));
}

/// Mean and standard deviation.
fn moments(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / n;
    (m, var.sqrt())
}

#[test]
fn initialisation_is_gpt2s() {
    let config = GptConfig {
        ..GptConfig::preset("tiny", 64).unwrap()
    };
    let mut model = one_rank::<f32>(config);
    let params = model.gathered_params().unwrap();
    let proj_std = 0.02 / (2.0f64 * 2.0).sqrt();
    for (name, v) in &params {
        let (m, s) = moments(v);
        if name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight") || name == "ln_f.weight" {
            assert!(v.iter().all(|&x| x == 1.0), "{name}");
            continue;
        }
        let want = if name.ends_with("proj.weight") {
            proj_std
        } else {
            0.02
        };
        assert!(m.abs() < 0.1 * want, "{name}: mean {m}");
        assert!(
            (s / want - 1.0).abs() < 0.05,
            "{name}: std {s}, want {want}"
        );
    }
    // Every parameter draws its own values.
    let c_attn: Vec<&Vec<f32>> = params
        .iter()
        .filter(|(n, _)| n.ends_with("c_attn.weight"))
        .map(|(_, v)| v)
        .collect();
    assert_ne!(c_attn[0], c_attn[1]);
}

/// A small F32 model for finite differences: d 32 in 2 heads of 16, 2 blocks, a vocabulary of 64,
/// sequences of 8, the head in chunks of 5 tokens (16 tokens: 5, 5, 5, 1).
fn small(tie: bool) -> GptConfig {
    GptConfig {
        vocab: 64,
        head_chunk: 5,
        tie_embeddings: tie,
        seed: 7,
        ..GptConfig::new(32, 2, 2, 8)
    }
}

/// The mean loss of one batch (per-token losses summed in f64).
fn mean_loss(model: &mut FsdpModel<Gpt<f32>>, inputs: &[i32], targets: &[i32], mode: Mode) -> f64 {
    let dev = model.device().clone();
    let b = model.module().batch(&dev, inputs, targets, 2, 8).unwrap();
    model.forward(mode, |m, ctx| m.forward(ctx, &b)).unwrap();
    let per = model.module().loss().unwrap().per_token.to_vec().unwrap();
    per.iter().map(|&l| l as f64).sum::<f64>() / per.len() as f64
}

#[test]
fn whole_model_finite_differences() {
    let mut model = one_rank::<f32>(small(true));
    // Larger weights than GPT-2's initial ones, so every path (attention scores included) is far from
    // linear and every gradient is well above the loss's rounding noise.
    let names = model.param_names().unwrap();
    for (k, (name, id)) in names.iter().enumerate() {
        let n = values(&model, *id).len();
        let v = if name.contains("ln_") {
            uniform(n, 0.5, 1.5, 1000 + k as u64)
        } else {
            uniform(n, -0.3, 0.3, 1000 + k as u64)
        };
        set_values(&mut model, *id, &v);
    }
    let inputs = ids(16, 64, 1);
    let targets = ids(16, 64, 2);
    let dev = model.device().clone();
    let batch = model.module().batch(&dev, &inputs, &targets, 2, 8).unwrap();
    model
        .forward(Mode::Train, |m, ctx| m.forward(ctx, &batch))
        .unwrap();
    model.backward(|m, ctx| m.backward(ctx, &batch)).unwrap();
    let grads: Vec<Vec<f32>> = names.iter().map(|(_, id)| grad(&model, *id)).collect();
    for (k, ((name, id), g)) in names.iter().zip(&grads).enumerate() {
        let mut loss = |m: &mut _| mean_loss(m, &inputs, &targets, Mode::Eval);
        let (fd, an) = directional(&mut model, *id, g, 500 + k as u64, 0.0, &mut loss);
        let err = (fd - an).abs() / fd.abs().max(an.abs());
        eprintln!(
            "{name}: finite difference {fd:.6e}, analytic {an:.6e}, relative error {err:.2e}"
        );
        assert!(an.abs() > 1e-3, "{name}: derivative {an} too small to test");
        assert!(
            err < 3e-3,
            "{name}: finite difference {fd} vs analytic {an}"
        );
    }
}

#[test]
fn tied_table_gradient_is_the_sum_of_its_two_uses() {
    let inputs = ids(16, 64, 3);
    let targets = ids(16, 64, 4);
    let mut tied = one_rank::<f32>(small(true));
    let mut untied = one_rank::<f32>(small(false));
    let mut out = Vec::new();
    for m in [&mut tied, &mut untied] {
        let dev = m.device().clone();
        let b = m.module().batch(&dev, &inputs, &targets, 2, 8).unwrap();
        m.forward(Mode::Train, |g, ctx| g.forward(ctx, &b)).unwrap();
        let loss = m.module().loss().unwrap().sum.to_vec().unwrap()[0];
        m.backward(|g, ctx| g.backward(ctx, &b)).unwrap();
        let names = m.param_names().unwrap();
        let by_name = |n: &str| {
            names
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, id)| *id)
                .unwrap()
        };
        let wte = grad(m, by_name("wte.weight"));
        let head = names
            .iter()
            .any(|(k, _)| k == "lm_head.weight")
            .then(|| grad(m, by_name("lm_head.weight")));
        out.push((loss, wte, head));
    }
    let (tied_loss, tied_wte, _) = &out[0];
    let (untied_loss, emb_use, head_use) = &out[1];
    let head_use = head_use.as_ref().unwrap();
    // The untied head starts as a copy of the table, so the two models compute the same loss.
    assert_eq!(tied_loss.to_bits(), untied_loss.to_bits());
    // Both uses contribute, and the tied gradient is their sum (the head's added first).
    assert!(emb_use.iter().any(|&g| g != 0.0) && head_use.iter().any(|&g| g != 0.0));
    let sum: Vec<f32> = head_use.iter().zip(emb_use).map(|(h, e)| h + e).collect();
    assert_eq!(tied_wte, &sum);
    // Rows of ids absent from the batch get the head's gradient only.
    let d = 32;
    let absent = (0..64).find(|r| !inputs.contains(&(*r as i32))).unwrap();
    assert_eq!(
        &tied_wte[absent * d..(absent + 1) * d],
        &head_use[absent * d..(absent + 1) * d]
    );
}

#[test]
fn forward_variants_agree() {
    let inputs = ids(16, 64, 5);
    let targets = ids(16, 64, 6);
    let mut a = one_rank::<f32>(small(true));
    let mut b = one_rank::<f32>(small(true));
    // Training and evaluation forwards compute the same loss; the initial loss is near ln(64).
    let eval = mean_loss(&mut a, &inputs, &targets, Mode::Eval);
    let train = mean_loss(&mut a, &inputs, &targets, Mode::Train);
    assert_eq!(eval.to_bits(), train.to_bits());
    assert!((train - 64f64.ln()).abs() < 0.1, "initial loss {train}");
    let dev = a.device().clone();
    let batch = a.module().batch(&dev, &inputs, &targets, 2, 8).unwrap();
    // Gradients halved by the reduction, as for the mean over two ranks.
    a.set_grad_divisor(2.0).unwrap();
    b.set_grad_divisor(2.0).unwrap();
    a.backward(|m, ctx| m.backward(ctx, &batch)).unwrap();
    // The head's gradients made in the forward: the same bits everywhere.
    b.forward(Mode::Train, |m, ctx| m.forward_with_grad(ctx, &batch))
        .unwrap();
    b.backward(|m, ctx| m.backward(ctx, &batch)).unwrap();
    for (name, id) in a.param_names().unwrap() {
        assert_eq!(grad(&a, id), grad(&b, id), "{name}");
    }
    assert_eq!(
        a.module().loss().unwrap().sum.to_vec().unwrap(),
        b.module().loss().unwrap().sum.to_vec().unwrap()
    );
}

#[test]
fn batches_are_checked_when_made() {
    let model = Gpt::<f32>::new(small(true)).unwrap();
    let dev = fp8_kernels::Device::cpu();
    let ok = ids(16, 64, 1);
    let mut bad = ok.clone();
    bad[5] = 64;
    let e = model.batch(&dev, &bad, &ok, 2, 8).unwrap_err();
    assert!(
        e.to_string().contains("64") && e.to_string().contains("position 5"),
        "{e}"
    );
    let e = model.batch(&dev, &ok, &bad, 2, 8).unwrap_err();
    assert!(e.to_string().contains("position 5"), "{e}");
    // Longer than the position table, or the wrong count.
    assert!(model
        .batch(&dev, &ids(18, 64, 1), &ids(18, 64, 1), 2, 9)
        .is_err());
    assert!(model.batch(&dev, &ok, &ok, 2, 7).is_err());
    // A batch checked against another vocabulary is refused by the model.
    let other = fsdp_nn::TokenBatch::new(&dev, &ok, &ok, 2, 8, GPT2_PADDED_VOCAB).unwrap();
    let mut m = one_rank::<f32>(small(true));
    assert!(m
        .forward(Mode::Eval, |g, ctx| g.forward(ctx, &other))
        .is_err());
}

/// A small F32 model with weights far from their initial scale, so the logits have clear maxima.
fn spread_weights(model: &mut FsdpModel<Gpt<f32>>) {
    let names = model.param_names().unwrap();
    for (k, (name, id)) in names.iter().enumerate() {
        let n = values(model, *id).len();
        let v = if name.contains("ln_") {
            uniform(n, 0.5, 1.5, 2000 + k as u64)
        } else {
            uniform(n, -0.4, 0.4, 2000 + k as u64)
        };
        set_values(model, *id, &v);
    }
}

#[test]
fn generation_with_the_cache_equals_full_forwards() {
    let config = GptConfig {
        seq_len: 12,
        ..small(true)
    };
    let mut model = one_rank::<f32>(config);
    spread_weights(&mut model);
    let prompt = [5, 17, 3];
    let new = model
        .forward(Mode::Eval, |m, ctx| {
            m.generate(ctx, &prompt, &Sampling::greedy(9))
        })
        .unwrap();
    assert_eq!(new.len(), 9);
    // The reference: a full forward of the whole sequence for every new token.
    let mut seq = prompt.to_vec();
    for (step, &got) in new.iter().enumerate() {
        let logits = model
            .forward(Mode::Eval, |m, ctx| m.last_logits(ctx, &seq))
            .unwrap();
        let best = (0..64)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as i32;
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(sorted[0] - sorted[1] > 1e-3, "step {step}: a near tie");
        assert_eq!(got, best, "step {step}");
        seq.push(best);
    }
    // Sampling: reproducible per seed, top-1 is greedy, ids in range.
    let s = |seed, top_k| Sampling {
        max_new_tokens: 9,
        temperature: 0.8,
        top_k,
        seed,
    };
    let a = model
        .forward(Mode::Eval, |m, ctx| m.generate(ctx, &prompt, &s(1, None)))
        .unwrap();
    let b = model
        .forward(Mode::Eval, |m, ctx| m.generate(ctx, &prompt, &s(1, None)))
        .unwrap();
    assert_eq!(a, b);
    assert!(a.iter().all(|&t| (0..64).contains(&t)));
    let top1 = model
        .forward(Mode::Eval, |m, ctx| {
            m.generate(ctx, &prompt, &s(2, Some(1)))
        })
        .unwrap();
    assert_eq!(top1, new);
    let draws: Vec<Vec<i32>> = (0..4)
        .map(|seed| {
            model
                .forward(Mode::Eval, |m, ctx| {
                    m.generate(ctx, &prompt, &s(seed, None))
                })
                .unwrap()
        })
        .collect();
    assert!(
        draws.iter().any(|d| d != &draws[0]),
        "different seeds, different samples"
    );
    // Too long for the position table, or in a training pass: refused.
    for (mode, tokens) in [(Mode::Eval, 10), (Mode::Train, 2)] {
        let sampling = Sampling::greedy(tokens);
        let r = model.forward(mode, |m, ctx| m.generate(ctx, &prompt, &sampling));
        assert!(r.is_err(), "{mode:?}, {tokens} new tokens");
    }
}

#[test]
fn recomputed_blocks_give_the_same_gradients() {
    let inputs = ids(16, 64, 7);
    let targets = ids(16, 64, 8);
    for fp8 in [Fp8Filter::None, Fp8Filter::All] {
        let mut out = Vec::new();
        for recompute in [false, true] {
            // One head of 32: the BF16 attention kernels take head dims 32, 64, 128.
            let config = GptConfig {
                recompute_blocks: recompute,
                heads: 1,
                ..small(true)
            };
            let mut m = one_rank_with::<bf16>(config, &fp8);
            let dev = m.device().clone();
            let b = m.module().batch(&dev, &inputs, &targets, 2, 8).unwrap();
            m.forward(Mode::Train, |g, ctx| g.forward(ctx, &b)).unwrap();
            m.backward(|g, ctx| g.backward(ctx, &b)).unwrap();
            let grads: Vec<Vec<f32>> = m
                .param_names()
                .unwrap()
                .iter()
                .map(|&(_, id)| grad(&m, id))
                .collect();
            out.push((grads, m.scaling().pending().to_vec().unwrap()));
        }
        assert_eq!(out[0], out[1], "{fp8:?}: recomputation changes nothing");
        assert!(out[0].0.iter().all(|g| g.iter().all(|v| v.is_finite())));
    }
}
