//! Hugging Face interop for Llama: config.json read and written back, our fused tensors split into
//! Hugging Face's names and written as a safetensors directory (single file or sharded with an index),
//! then read and fused again bit for bit; every mismatch named.

use std::path::{Path, PathBuf};

use fsdp_examples::hf::{
    read_hf_safetensors, read_shard_index, shard_file_name, write_hf_safetensors, HfDtype, HfError,
    HfTensor, LlamaHfConfig, LlamaNameMap, TensorSet, DEFAULT_SHARD_LIMIT_BYTES, INDEX_FILE,
    SINGLE_FILE,
};

/// Llama 3.1 8B's config.json, as published (plus an unknown key to be kept).
const LLAMA31_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256,
  "custom_key": {"kept": [1, 2]}
}"#;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hf-llama-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn llama31_config_reads_and_round_trips() {
    let c = LlamaHfConfig::from_json_str(LLAMA31_8B).unwrap();
    assert_eq!(
        (c.hidden_size, c.num_hidden_layers, c.num_attention_heads),
        (4096, 32, 32)
    );
    assert_eq!(
        (c.num_key_value_heads, c.head_dim, c.intermediate_size),
        (8, 128, 14336)
    );
    assert_eq!((c.vocab_size, c.max_position_embeddings), (128256, 131072));
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-5, 500000.0));
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
    let s = c.rope_scaling.unwrap();
    assert_eq!(
        (s.factor, s.low_freq_factor, s.high_freq_factor),
        (8.0, 1.0, 4.0)
    );
    assert_eq!(s.original_max_position_embeddings, 8192);
    assert_eq!(c.extra["bos_token_id"], 128000);
    assert_eq!(c.extra["custom_key"]["kept"][1], 2);
    assert!(!c.extra.contains_key("hidden_size") && !c.extra.contains_key("rope_scaling"));

    // Written and read again: the same config; through a file in a directory too.
    let text = c.to_json_string();
    assert_eq!(LlamaHfConfig::from_json_str(&text).unwrap(), c);
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["architectures"][0], "LlamaForCausalLM");
    assert_eq!(value["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(value["head_dim"], 128);
    let dir = scratch("config");
    c.write(dir.join("config.json")).unwrap();
    assert_eq!(LlamaHfConfig::read(&dir).unwrap(), c);
    assert_eq!(LlamaHfConfig::read(dir.join("config.json")).unwrap(), c);
}

#[test]
fn absent_optional_fields_take_hugging_face_defaults_and_head_dim_is_read() {
    let c = LlamaHfConfig::from_json_str(
        r#"{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 300, "tie_word_embeddings": true,
            "rope_scaling": null, "dtype": "float32"}"#,
    )
    .unwrap();
    assert_eq!((c.num_key_value_heads, c.head_dim), (4, 16));
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-6, 10000.0));
    assert_eq!(c.max_position_embeddings, 2048);
    assert!(c.tie_word_embeddings && c.rope_scaling.is_none());
    assert_eq!(c.torch_dtype.as_deref(), Some("float32"));
    let c = LlamaHfConfig::from_json_str(
        r#"{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300,
            "rope_scaling": {"rope_type": "default"}}"#,
    )
    .unwrap();
    assert_eq!((c.num_key_value_heads, c.head_dim), (2, 32));
    assert!(c.rope_scaling.is_none());
}

/// A transformers 5 config.json: RoPE's settings in `rope_parameters` (no `rope_theta`, no
/// `rope_scaling`), `dtype` for `torch_dtype`.
fn transformers5_config(rope_parameters: &str) -> String {
    format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 384, "vocab_size": 256, "rms_norm_eps": 1e-05, "dtype": "float32",
            "rope_parameters": {rope_parameters}, "tie_word_embeddings": true,
            "transformers_version": "5.17.0"}}"#
    )
}

#[test]
fn transformers5_rope_parameters_are_read_like_rope_theta_and_rope_scaling() {
    let c = LlamaHfConfig::from_json_str(&transformers5_config(
        r#"{"rope_theta": 500000.0, "rope_type": "default"}"#,
    ))
    .unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert!(c.rope_scaling.is_none() && !c.extra.contains_key("rope_parameters"));
    let c =
        LlamaHfConfig::from_json_str(&transformers5_config(r#"{"rope_theta": 20000.0}"#)).unwrap();
    assert_eq!(c.rope_theta, 20000.0);
    assert!(c.rope_scaling.is_none());
    let c = LlamaHfConfig::from_json_str(&transformers5_config(
        r#"{"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}"#,
    ))
    .unwrap();
    let s = c.rope_scaling.unwrap();
    assert_eq!((s.factor, s.original_max_position_embeddings), (8.0, 16));
    // Written back in the older keys, which read to the same config.
    let again = LlamaHfConfig::from_json_str(&c.to_json_string()).unwrap();
    assert_eq!((again.rope_theta, again.rope_scaling), (500000.0, Some(s)));
    let err = LlamaHfConfig::from_json_str(&transformers5_config(
        r#"{"rope_theta": 500000.0, "rope_type": "yarn", "factor": 4.0}"#,
    ))
    .unwrap_err();
    assert!(
        matches!(err, HfError::UnsupportedRopeScaling { .. }),
        "{err:?}"
    );
    // Both forms present must agree.
    let both = LLAMA31_8B.replace(
        r#""rope_theta": 500000.0,"#,
        r#""rope_theta": 500000.0, "rope_parameters": {"rope_theta": 10000.0},"#,
    );
    assert_ne!(both, LLAMA31_8B, "the replacement must apply");
    let err = LlamaHfConfig::from_json_str(&both).unwrap_err();
    assert!(
        err.to_string().contains("rope_parameters.rope_theta"),
        "{err}"
    );
    let both = LLAMA31_8B.replace(
        r#""rope_theta": 500000.0,"#,
        r#""rope_theta": 500000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},"#,
    );
    let err = LlamaHfConfig::from_json_str(&both).unwrap_err();
    assert!(err.to_string().contains("differ"), "{err}");
    assert!(LlamaHfConfig::from_json_str(&transformers5_config("[1]")).is_err());
}

fn with_rope_scaling(scaling: &str) -> String {
    LLAMA31_8B.replace(
        r#""rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  }"#,
        &format!(r#""rope_scaling": {scaling}"#),
    )
}

#[test]
fn rope_scaling_types_other_than_llama3_are_refused_by_name() {
    for (scaling, name) in [
        (r#"{"rope_type": "yarn", "factor": 4.0}"#, "yarn"),
        (r#"{"type": "linear", "factor": 2.0}"#, "linear"),
        (r#"{"rope_type": "dynamic", "factor": 2.0}"#, "dynamic"),
        (r#"{"rope_type": "longrope"}"#, "longrope"),
    ] {
        let text = with_rope_scaling(scaling);
        assert_ne!(text, LLAMA31_8B, "the replacement must apply");
        let err = LlamaHfConfig::from_json_str(&text).unwrap_err();
        assert!(
            matches!(&err, HfError::UnsupportedRopeScaling { rope_type } if rope_type == name),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("\"{name}\"")) && msg.contains("llama3"),
            "{msg}"
        );
    }
    let err = LlamaHfConfig::from_json_str(&with_rope_scaling(
        r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}"#,
    ))
    .unwrap_err();
    assert!(
        err.to_string().contains("original_max_position_embeddings"),
        "{err}"
    );
}

#[test]
fn configs_this_model_cannot_run_are_refused_naming_the_field() {
    // (text replaced, its replacement, what the error must say)
    let cases = [
        ("\"silu\"", "\"gelu\"", "hidden_act"),
        (
            "\"attention_bias\": false",
            "\"attention_bias\": true",
            "attention_bias",
        ),
        ("LlamaForCausalLM", "MistralForCausalLM", "architectures"),
        ("\"hidden_size\": 4096,", "", "hidden_size is missing"),
        (
            "\"num_key_value_heads\": 8",
            "\"num_key_value_heads\": 6",
            "num_key_value_heads 6",
        ),
        (
            "\"vocab_size\": 128256",
            "\"vocab_size\": -3",
            "vocab_size -3",
        ),
        (
            "\"rope_theta\": 500000.0",
            "\"rope_theta\": \"big\"",
            "rope_theta",
        ),
    ]
    .map(|(from, to, expected)| (LLAMA31_8B.replace(from, to), expected));
    for (text, expected) in cases {
        assert_ne!(text, LLAMA31_8B, "{expected}: the replacement must apply");
        let err = LlamaHfConfig::from_json_str(&text).unwrap_err().to_string();
        assert!(err.contains(expected), "{expected}: {err}");
    }
    let dir = scratch("config-bad");
    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    let err = LlamaHfConfig::read(&dir).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("not JSON"),
        "{err}"
    );
}

/// A small Llama: 3 layers, 4 query heads of 8 over 2 key/value heads, SwiGLU width 40, 50 tokens.
fn small_config(tied: bool) -> LlamaHfConfig {
    let mut c = LlamaHfConfig::llama3(32, 3, 4, 2, 40, 50).unwrap();
    c.tie_word_embeddings = tied;
    c
}

/// Our tensors of `map`, random F32 values (varied bit patterns, no two tensors alike).
fn random_tensors(map: &LlamaNameMap, seed: u64) -> TensorSet {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut set = TensorSet::new();
    for e in map.entries() {
        let n: usize = e.shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect();
        set.insert(
            e.name.clone(),
            HfTensor::from_f32(e.shape.clone(), &values).unwrap(),
        )
        .unwrap();
    }
    set
}

fn shard_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
    names
}

#[test]
fn export_then_import_is_bitwise_for_every_layout() {
    for tied in [false, true] {
        let config = small_config(tied);
        let map = LlamaNameMap::new(&config);
        let ours = random_tensors(&map, 7 + tied as u64);
        for dtype in [HfDtype::F32, HfDtype::Bf16] {
            let expected = ours.cast(dtype);
            let hf = map.to_hf(&expected).unwrap();
            assert_eq!(hf.contains("lm_head.weight"), !tied);
            assert_eq!(hf.len(), 3 * 9 + 2 + usize::from(!tied));
            let names: Vec<&str> = hf.names().collect();
            let shapes = map.hf_shapes();
            let hf_names: Vec<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, hf_names);
            for limit in [DEFAULT_SHARD_LIMIT_BYTES, 3000] {
                let dir = scratch(&format!("rt-{tied}-{dtype:?}-{limit}"));
                let written = write_hf_safetensors(&dir, &hf, limit).unwrap();
                let files = shard_files(&dir);
                if limit == DEFAULT_SHARD_LIMIT_BYTES {
                    assert_eq!(files, [SINGLE_FILE]);
                    assert!(written.index.is_none() && !dir.join(INDEX_FILE).exists());
                    // One file read directly, not through its directory.
                    let direct = read_hf_safetensors(dir.join(SINGLE_FILE)).unwrap();
                    assert_eq!(map.from_hf(&direct).unwrap(), expected);
                } else {
                    let n = files.len();
                    assert!(n >= 3, "{tied} {dtype:?}: only {n} shards");
                    let want: Vec<String> = (1..=n).map(|k| shard_file_name(k, n)).collect();
                    assert_eq!(files, want);
                    assert_eq!(want[0], format!("model-00001-of-{n:05}.safetensors"));
                    check_index(&dir, &hf, limit);
                }
                let read = read_hf_safetensors(&dir).unwrap();
                assert_eq!(read.len(), hf.len());
                for (name, t) in hf.iter() {
                    assert_eq!(read.get(name), Some(t), "{name}");
                }
                let back = map.from_hf(&read).unwrap();
                let order: Vec<&str> = back.names().collect();
                let want: Vec<&str> = expected.names().collect();
                assert_eq!(order, want);
                for (name, t) in expected.iter() {
                    let b = back.get(name).unwrap();
                    assert_eq!(b.dtype(), dtype, "{name}");
                    assert_eq!(b.shape(), t.shape(), "{name}");
                    assert!(b.data() == t.data(), "{name} differs after the round trip");
                }
            }
        }
    }
}

/// The index names every tensor once, in the shard that holds it; total_size is the sum of the
/// tensors' bytes; no shard but one holding a single tensor exceeds the limit.
fn check_index(dir: &Path, hf: &TensorSet, limit: u64) {
    let index = read_shard_index(&dir.join(INDEX_FILE)).unwrap();
    assert_eq!(index.total_size(), Some(hf.total_bytes() as u64));
    let mut names: Vec<&str> = index.weight_map.keys().map(String::as_str).collect();
    let mut want: Vec<&str> = hf.names().collect();
    names.sort_unstable();
    want.sort_unstable();
    assert_eq!(names, want);
    for file in shard_files(dir) {
        let bytes = std::fs::read(dir.join(&file)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata().as_ref().and_then(|m| m.get("format")),
            Some(&"pt".to_string())
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let held = st.names();
        assert!(!held.is_empty(), "{file} is empty");
        let size: usize = held
            .iter()
            .map(|n| st.tensor(n).unwrap().data().len())
            .sum();
        assert!(
            size as u64 <= limit || held.len() == 1,
            "{file}: {size} bytes"
        );
        for n in held {
            assert_eq!(index.weight_map[n], file, "{n}");
        }
    }
}

#[test]
fn fused_rows_are_q_then_k_then_v_and_gate_then_up() {
    let config = small_config(false);
    let map = LlamaNameMap::new(&config);
    let ours = random_tensors(&map, 3);
    let hf = map.to_hf(&ours).unwrap();
    let qkv = ours
        .get("model.layers.2.self_attn.qkv_proj.weight")
        .unwrap();
    assert_eq!(qkv.shape(), [(4 + 2 + 2) * 8, 32]);
    let row = 32 * 4;
    let attn = "model.layers.2.self_attn";
    for (part, rows) in [("q_proj", 0..32), ("k_proj", 32..48), ("v_proj", 48..64)] {
        let t = hf.get(&format!("{attn}.{part}.weight")).unwrap();
        assert_eq!(t.shape(), [rows.len(), 32], "{part}");
        assert_eq!(
            t.data(),
            &qkv.data()[rows.start * row..rows.end * row],
            "{part}"
        );
    }
    let gate_up = ours.get("model.layers.0.mlp.gate_up_proj.weight").unwrap();
    assert_eq!(gate_up.shape(), [80, 32]);
    let gate = hf.get("model.layers.0.mlp.gate_proj.weight").unwrap();
    let up = hf.get("model.layers.0.mlp.up_proj.weight").unwrap();
    assert_eq!(gate.data(), &gate_up.data()[..40 * row]);
    assert_eq!(up.data(), &gate_up.data()[40 * row..]);
    for name in [
        "model.layers.0.self_attn.o_proj.weight",
        "model.norm.weight",
    ] {
        assert_eq!(hf.get(name), ours.get(name), "{name}");
    }
}

#[test]
fn missing_extra_and_misshaped_tensors_are_named_in_one_error() {
    let config = small_config(false);
    let map = LlamaNameMap::new(&config);
    let hf = map.to_hf(&random_tensors(&map, 5)).unwrap();
    let mut broken = TensorSet::new();
    for (name, t) in hf.iter() {
        match name {
            "model.layers.1.self_attn.k_proj.weight" | "lm_head.weight" => {}
            "model.layers.0.mlp.up_proj.weight" => broken
                .insert(
                    name,
                    HfTensor::from_f32(vec![39, 32], &[0.0; 39 * 32]).unwrap(),
                )
                .unwrap(),
            _ => broken.insert(name, t.clone()).unwrap(),
        }
    }
    broken
        .insert(
            "model.layers.0.self_attn.q_norm.weight",
            HfTensor::from_f32(vec![8], &[1.0; 8]).unwrap(),
        )
        .unwrap();
    // Rotary tables of older checkpoints are skipped, not reported.
    broken
        .insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            HfTensor::from_f32(vec![4], &[1.0; 4]).unwrap(),
        )
        .unwrap();
    let err = map.from_hf(&broken).unwrap_err();
    let HfError::Mismatch(m) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(
        m.missing,
        ["model.layers.1.self_attn.k_proj.weight", "lm_head.weight"]
    );
    assert_eq!(m.extra, ["model.layers.0.self_attn.q_norm.weight"]);
    assert_eq!(m.wrong.len(), 1, "{:?}", m.wrong);
    let msg = err.to_string();
    for needle in [
        "model.layers.1.self_attn.k_proj.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.up_proj.weight has shape [39, 32], expected [40, 32]",
    ] {
        assert!(msg.contains(needle), "{needle} not in: {msg}");
    }
    assert!(!msg.contains("inv_freq"), "{msg}");

    // The parts of one fused tensor must share their element type.
    let mut mixed = TensorSet::new();
    for (name, t) in hf.iter() {
        let t = if name == "model.layers.2.self_attn.v_proj.weight" {
            t.cast(HfDtype::Bf16)
        } else {
            t.clone()
        };
        mixed.insert(name, t).unwrap();
    }
    let err = map.from_hf(&mixed).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.2.self_attn.v_proj.weight")
            && err.contains("model.layers.2.self_attn.qkv_proj.weight"),
        "{err}"
    );

    // Export checks our side the same way.
    let mut ours = random_tensors(&map, 5);
    ours.insert(
        "model.extra.weight",
        HfTensor::from_f32(vec![1], &[0.0]).unwrap(),
    )
    .unwrap();
    let err = map.to_hf(&ours).unwrap_err().to_string();
    assert!(
        err.contains("our tensors") && err.contains("model.extra.weight"),
        "{err}"
    );
}

#[test]
fn a_tied_checkpoint_may_hold_the_head_only_as_a_copy_of_the_embedding() {
    let map = LlamaNameMap::new(&small_config(true));
    let ours = random_tensors(&map, 11);
    let hf = map.to_hf(&ours).unwrap();
    assert!(!hf.contains("lm_head.weight"));
    let embed = hf.get("model.embed_tokens.weight").unwrap().clone();
    let mut with_head = hf.clone();
    with_head.insert("lm_head.weight", embed.clone()).unwrap();
    assert_eq!(map.from_hf(&with_head).unwrap(), ours);
    let mut other_head = hf.clone();
    let mut values = embed.to_f32();
    values[3] += 1.0;
    other_head
        .insert(
            "lm_head.weight",
            HfTensor::from_f32(embed.shape().to_vec(), &values).unwrap(),
        )
        .unwrap();
    let err = map.from_hf(&other_head).unwrap_err().to_string();
    assert!(
        err.contains("lm_head.weight") && err.contains("tie_word_embeddings"),
        "{err}"
    );
    // Our tied model has no head tensor to export.
    let mut ours_with_head = ours.clone();
    ours_with_head.insert("lm_head.weight", embed).unwrap();
    let err = map.to_hf(&ours_with_head).unwrap_err().to_string();
    assert!(err.contains("unexpected lm_head.weight"), "{err}");
}

#[test]
fn inconsistent_directories_are_refused_naming_the_file() {
    let map = LlamaNameMap::new(&small_config(false));
    let hf = map.to_hf(&random_tensors(&map, 13)).unwrap();

    let empty = scratch("layout-empty");
    let err = read_hf_safetensors(&empty).unwrap_err().to_string();
    assert!(
        err.contains(SINGLE_FILE) && err.contains(INDEX_FILE),
        "{err}"
    );

    // A shard gone.
    let dir = scratch("layout-missing-shard");
    write_hf_safetensors(&dir, &hf, 3000).unwrap();
    let files = shard_files(&dir);
    std::fs::remove_file(dir.join(&files[1])).unwrap();
    let err = read_hf_safetensors(&dir).unwrap_err().to_string();
    assert!(err.contains(&files[1]), "{err}");

    // The index names a tensor no shard holds, and puts another in the wrong shard.
    for (edit, expected) in [
        ("ghost", "model.layers.9.mlp.up_proj.weight"),
        ("move", "model.norm.weight"),
    ] {
        let dir = scratch(&format!("layout-{edit}"));
        write_hf_safetensors(&dir, &hf, 3000).unwrap();
        let path = dir.join(INDEX_FILE);
        let mut index = read_shard_index(&path).unwrap();
        let first = shard_files(&dir)[0].clone();
        match edit {
            "ghost" => {
                index.weight_map.insert(expected.into(), first);
            }
            _ => {
                let file = index.weight_map[expected].clone();
                assert_ne!(file, first);
                index.weight_map.insert(expected.into(), first);
            }
        }
        std::fs::write(&path, serde_json::to_string(&index).unwrap()).unwrap();
        let err = read_hf_safetensors(&dir).unwrap_err().to_string();
        assert!(err.contains(expected), "{edit}: {err}");
    }

    // An F16 tensor is refused by name.
    let dir = scratch("layout-f16");
    let data = vec![0u8; 2 * 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![4], &data).unwrap();
    let bytes = safetensors::serialize([("model.norm.weight", view)], None).unwrap();
    std::fs::write(dir.join(SINGLE_FILE), bytes).unwrap();
    let err = read_hf_safetensors(&dir).unwrap_err().to_string();
    assert!(
        err.contains("model.norm.weight") && err.contains("F16"),
        "{err}"
    );
}
