//! The Llama model on the CPU:
//! - its parameters are Hugging Face's `LlamaForCausalLM` tensors with the two fused projections, in
//!   the model's order, as `hf::LlamaNameMap` lists them (tied and untied), and their count is
//!   `LlamaConfig::num_params`;
//! - greedy generation with the per-layer key/value caches (grouped-query attention, RoPE at each
//!   token's position) picks the tokens full forwards pick;
//! - through the Trainer, `--export` writes a Hugging Face directory (config.json and split tensors)
//!   that `--init-from` reads back to the same validation loss, and a second export after a step with
//!   learning rate 0 is the same bytes;
//! - a checkpoint written by transformers' `save_pretrained` (`testdata/llama-tiny-hf`: `llama-tiny`'s
//!   shape, vocabulary 256, 11 shards and an index, tied; `scripts/llama_fixture.py` made it on the GPU
//!   machine with transformers 5.17) imports with its `config.json`, gives transformers' logits on its
//!   fixed input within 1e-3 (F32), and exports back to the same tensors bit for bit.

mod gpt_common;
mod scratch;

use fsdp_comm::{Communicator, ThreadGroup};
use fsdp_examples::data::tokens::{
    committed_shakespeare_slice_dir, write_token_file, TokenFile, GPT2_VOCAB_SIZE,
};
use fsdp_examples::gpt::Sampling;
use fsdp_examples::hf::{
    read_hf_safetensors, HfLlamaFormat, LlamaHfConfig, LlamaNameMap, CONFIG_FILE,
};
use fsdp_examples::llama::{wrap_policy, Llama, LlamaConfig, PRESETS};
use fsdp_examples::lm::{LmOptions, LmTask};
use fsdp_optim::ExportDtype;
use fsdp_shard::FullTensor;
use fsdp_shard::{FsdpConfig, FsdpModel, Mode};
use fsdp_train::weights::WeightsFormat;
use fsdp_train::{DeviceChoice, Precision, RunLength, TrainConfig, TrainReport, Trainer};
use gpt_common::{set_values, uniform, values};
use half::bf16;
use scratch::scratch_dir;
use std::sync::Arc;
use std::time::Duration;

fn one_rank(config: LlamaConfig) -> FsdpModel<Llama<f32>> {
    let comm: Arc<dyn Communicator> = Arc::new(
        ThreadGroup::new(1, Duration::from_secs(300))
            .unwrap()
            .pop()
            .unwrap(),
    );
    let llama = Llama::<f32>::new(config).unwrap();
    FsdpModel::new(llama, comm, wrap_policy(), FsdpConfig::default()).unwrap()
}

/// d 64 in 2 query heads of 32 over 1 key/value head, SwiGLU of 96, a vocabulary of 64.
fn small(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab: 64,
        tie_embeddings: tied,
        ..LlamaConfig::new(64, 2, 2, 1, 96, 12)
    }
}

#[test]
fn parameters_are_the_hugging_face_tensors_fused() {
    for tied in [true, false] {
        let config = small(tied);
        let hf = config.to_hf("float32").unwrap();
        let map = LlamaNameMap::new(&hf);
        let mut model = one_rank(config.clone());
        let ours: Vec<(String, Vec<usize>)> = model
            .param_names()
            .unwrap()
            .into_iter()
            .map(|(name, id)| {
                let shape = model.sharded().layout().params[id.index().unwrap()]
                    .shape
                    .clone();
                (name, shape)
            })
            .collect();
        let expected: Vec<(String, Vec<usize>)> = map
            .entries()
            .iter()
            .map(|e| (e.name.clone(), e.shape.clone()))
            .collect();
        assert_eq!(ours, expected, "tied {tied}");
        assert_eq!(model.num_params(), config.num_params(), "tied {tied}");
    }
    // The presets' counts: Llama 3.2 1B (1.24B with the tied head), 3B (3.21B), Llama 3.1 8B (8.03B).
    let count = |name: &str| {
        let p = PRESETS.iter().find(|p| p.name == name).unwrap();
        LlamaConfig {
            tie_embeddings: p.tied,
            ..LlamaConfig::new(p.d_model, p.layers, p.heads, p.kv_heads, p.ffn, 8192)
        }
        .num_params()
    };
    assert_eq!(count("llama-1b"), 1_235_814_400);
    assert_eq!(count("llama-3b"), 3_212_749_824);
    assert_eq!(count("llama-8b"), 8_030_261_248);
}

#[test]
fn generation_with_the_cache_equals_full_forwards() {
    let mut model = one_rank(small(true));
    // Weights far from their initial scale, so the logits have clear maxima.
    let names = model.param_names().unwrap();
    for (k, (name, id)) in names.iter().enumerate() {
        let n = values(&model, *id).len();
        let v = if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            uniform(n, 0.5, 1.5, 2000 + k as u64)
        } else {
            uniform(n, -0.4, 0.4, 2000 + k as u64)
        };
        set_values(&mut model, *id, &v);
    }
    let prompt = [5, 17, 3];
    let new = model
        .forward(Mode::Eval, |m, ctx| {
            m.generate(ctx, &prompt, &Sampling::greedy(9))
        })
        .unwrap();
    assert_eq!(new.len(), 9);
    let mut seq = prompt.to_vec();
    for (step, &got) in new.iter().enumerate() {
        let all = model
            .forward(Mode::Eval, |m, ctx| m.logits(ctx, &seq))
            .unwrap();
        let last = &all[(seq.len() - 1) * 64..];
        let best = (0..64)
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap() as i32;
        let mut sorted = last.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(sorted[0] - sorted[1] > 1e-3, "step {step}: a near tie");
        assert_eq!(got, best, "step {step}");
        seq.push(best);
    }
    // The sequence must fit the RoPE tables.
    assert!(model
        .forward(Mode::Eval, |m, ctx| m.generate(
            ctx,
            &prompt,
            &Sampling::greedy(10)
        ))
        .is_err());
}

/// The first 4096 tokens of the committed slice as train.bin and val.bin.
fn data_dir() -> std::path::PathBuf {
    let dir = scratch_dir("llama-data");
    let slice = TokenFile::open(
        committed_shakespeare_slice_dir().join("train.bin"),
        GPT2_VOCAB_SIZE,
    )
    .unwrap();
    let part = &slice.tokens()[..4096];
    write_token_file(dir.join("train.bin"), part).unwrap();
    write_token_file(dir.join("val.bin"), part).unwrap();
    dir
}

fn train(options: &LmOptions, c: &TrainConfig) -> TrainReport {
    let task = LmTask::<Llama<bf16>>::new(options.clone(), 1).unwrap();
    Trainer::new(c.clone()).run(&task).unwrap()
}

#[test]
fn hugging_face_export_then_init_from_gives_the_model_back() {
    let data = data_dir();
    let dir = scratch_dir("llama-export");
    let (first_dir, second_dir) = (dir.join("first"), dir.join("second"));
    let opts = LmOptions {
        d_model: Some(64),
        layers: Some(2),
        heads: Some(2),
        kv_heads: Some(1),
        ffn: Some(96),
        batch_size: 4,
        compact_vocab: true,
        max_val_batches: Some(4),
        ..LmOptions::new("llama-tiny", 32, data)
    };
    let mut base = TrainConfig::new(RunLength::Steps(4));
    base.lr = 3e-3;
    base.device = DeviceChoice::Cpu;
    base.precision = Precision::Bf16;
    base.eval_every = Some(4);
    let mut first = base.clone();
    first.export = Some(first_dir.clone());
    let trained = train(&opts, &first);
    // The directory is a Hugging Face checkpoint of this shape with split projections.
    let hf = LlamaHfConfig::read(first_dir.join(CONFIG_FILE)).unwrap();
    assert_eq!(
        (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads),
        (64, 2, 2)
    );
    assert_eq!((hf.num_key_value_heads, hf.intermediate_size), (1, 96));
    assert!(hf.tie_word_embeddings);
    let tensors = read_hf_safetensors(&first_dir).unwrap();
    let k = tensors
        .get("model.layers.1.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(k.shape(), [32, 64]);
    assert!(tensors.get("model.layers.0.mlp.gate_proj.weight").is_some());
    assert!(tensors.get("lm_head.weight").is_none());
    // One step with learning rate 0 changes no weight: its validation is the exported model's, and its
    // export is the same bytes.
    let mut again = base;
    again.init_from = Some(first_dir.clone());
    again.export = Some(second_dir.clone());
    again.lr = 0.0;
    again.length = RunLength::Steps(1);
    again.eval_every = Some(1);
    let loaded = train(&opts, &again);
    let (a, b) = (
        trained.last().unwrap().test_loss,
        loaded.last().unwrap().test_loss,
    );
    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    let bytes = |d: &std::path::Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        bytes(&first_dir) == bytes(&second_dir),
        "the re-export differs"
    );
    // An export never lands in a directory that already holds a model.
    let mut over = TrainConfig::new(RunLength::Steps(1));
    over.device = DeviceChoice::Cpu;
    over.export = Some(first_dir.clone());
    let task = LmTask::<Llama<bf16>>::new(opts.clone(), 1).unwrap();
    let err = Trainer::new(over).run(&task).unwrap_err().to_string();
    assert!(err.contains("already holds a model"), "{err}");
}

#[test]
fn a_transformers_checkpoint_gives_transformers_logits_and_exports_back_bitwise() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/llama-tiny-hf");
    let hf = LlamaHfConfig::read(dir.join(CONFIG_FILE)).unwrap();
    assert_eq!(hf.rope_theta, 500000.0);
    let config = LlamaConfig::from_hf(&hf, hf.max_position_embeddings).unwrap();
    let mut model = one_rank(config);
    let format = HfLlamaFormat::new(hf.clone());
    let source = format.read(&dir).unwrap();
    let loaded = model.import_from(source.as_ref(), true).unwrap();
    assert_eq!(loaded.len(), 2 + 2 * 6); // embedding, final norm, 6 per layer
                                         // transformers' logits on the fixture's input.
    let expected = safetensors::SafeTensors::deserialize(
        &std::fs::read(dir.join("expected_logits.safetensors")).unwrap(),
    )
    .unwrap()
    .tensor("logits")
    .unwrap()
    .data()
    .chunks_exact(4)
    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    .collect::<Vec<f32>>();
    let ids: Vec<i32> = (0..24).map(|i| (i * 37 + 11) % 256).collect();
    let ours = model
        .forward(Mode::Eval, |m, ctx| m.logits(ctx, &ids))
        .unwrap();
    assert_eq!(ours.len(), expected.len());
    let worst = ours
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("largest logit difference against transformers: {worst:e}");
    assert!(worst < 1e-3, "largest logit difference {worst}");
    // Export the imported weights: the same tensors as the checkpoint, bit for bit.
    let out = scratch_dir("llama-fixture-export").join("export");
    let tensors: Vec<FullTensor> = model
        .gathered_params()
        .unwrap()
        .into_iter()
        .map(|(name, values)| {
            let id = model
                .param_names()
                .unwrap()
                .into_iter()
                .find(|(n, _)| *n == name)
                .unwrap()
                .1;
            let shape = model.sharded().layout().params[id.index().unwrap()]
                .shape
                .clone();
            FullTensor {
                name,
                shape,
                values,
            }
        })
        .collect();
    format.check_output(&out).unwrap();
    format.write(&out, tensors, ExportDtype::F32).unwrap();
    let (a, b) = (
        read_hf_safetensors(&dir).unwrap(),
        read_hf_safetensors(&out).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (name, t) in a.iter() {
        assert_eq!(b.get(name).map(|u| u.data()), Some(t.data()), "{name}");
    }
    let back = LlamaHfConfig::read(out.join(CONFIG_FILE)).unwrap();
    assert_eq!(
        (back.hidden_size, back.num_key_value_heads, back.rope_theta),
        (128, 2, 500000.0)
    );
}
