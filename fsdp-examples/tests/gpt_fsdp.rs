//! The `gpt_fsdp` runs on the CPU, on the committed Shakespeare slice, through the library entry point
//! the binary calls (`fsdp_examples::gpt::train`), with a small model (d 64, 2 blocks of 2 heads) and the
//! slice's ids renumbered densely (`compact_vocab`: 5.8k rows instead of 50304, which would make the
//! CPU head nine times slower):
//!
//! - it learns: after 40 steps on the slice's first 8192 tokens, the validation loss over every window
//!   of those tokens is below the unigram entropy of the slice (6.095 nats; measured 5.92 here, from
//!   7.52 at the first step), and two ranks, each taking half of every global batch, end within a
//!   stated bound of one rank. (The entropy of the 8192 tokens themselves is 5.836: the test shows
//!   that the model learns the text's statistics in few steps, not yet how much context it uses.)
//! - saving, stopping and resuming gives bitwise the run that did not stop (every step's loss, the
//!   final validation loss, the exported weights' bytes, the metrics file);
//! - `--fp8-grad-comm` at world size 2 stays within a stated bound of the exact reduction;
//! - `--export` then `--init-from` gives back the validation loss;
//! - bad flags are refused with errors naming them, before any training.

use fsdp_examples::data::tokens::{
    committed_shakespeare_slice_dir, unigram_entropy_nats, write_token_file, TokenFile,
    GPT2_VOCAB_SIZE,
};
use fsdp_examples::gpt::{
    train, Fp8Layers, GptModelChoice, GptPrecision, GptTrainConfig, GptTrainReport,
};
use fsdp_examples::run_setup::DeviceChoice;
use fsdp_shard::GradDtype;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpt-fsdp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The first 8192 tokens of the slice's `train.bin`, as `train.bin` and as `val.bin` (a small corpus
/// that 40 steps of 512 tokens see 2.5 times), and the unigram entropy of the whole slice.
fn data_dir() -> (PathBuf, f64) {
    let dir = scratch("data");
    let slice = TokenFile::open(
        committed_shakespeare_slice_dir().join("train.bin"),
        GPT2_VOCAB_SIZE,
    )
    .unwrap();
    let part = &slice.tokens()[..8192];
    write_token_file(dir.join("train.bin"), part).unwrap();
    write_token_file(dir.join("val.bin"), part).unwrap();
    (dir, unigram_entropy_nats(slice.tokens()).unwrap())
}

fn small(precision: GptPrecision, seq_len: usize) -> GptModelChoice {
    GptModelChoice {
        preset: "tiny".into(),
        d_model: Some(64),
        layers: Some(2),
        heads: Some(2),
        seq_len,
        precision,
        fp8_layers: Fp8Layers::All,
        fp8_auto_threshold: fsdp_examples::gpt::DEFAULT_FP8_AUTO_THRESHOLD,
        fp8_grad_comm: false,
        grad_shards: GradDtype::F32,
        seed: 1,
    }
}

fn config(
    data: &Path,
    model: GptModelChoice,
    steps: u64,
    batch: usize,
    ws: usize,
) -> GptTrainConfig {
    GptTrainConfig {
        batch_size: batch,
        world_size: ws,
        lr: 3e-3,
        device: DeviceChoice::Cpu,
        data_dir: data.to_path_buf(),
        compact_vocab: true,
        threads_per_rank: Some((2 / ws).max(1)),
        ..GptTrainConfig::new(model, steps)
    }
}

fn run(c: &GptTrainConfig) -> (GptTrainReport, f64) {
    let t0 = Instant::now();
    let r = train(c).unwrap();
    (r, t0.elapsed().as_secs_f64())
}

fn final_val(r: &GptTrainReport) -> f64 {
    r.evals.last().expect("a validation").val_loss
}

#[test]
fn learns_the_slice_and_two_ranks_follow_one() {
    let (data, entropy) = data_dir();
    let mk = |ws| GptTrainConfig {
        eval_every: Some(40),
        lr: 1e-2,
        ..config(&data, small(GptPrecision::Fp8, 32), 40, 16 / ws, ws)
    };
    let (one, t1) = run(&mk(1));
    let (two, t2) = run(&mk(2));
    let (v1, v2) = (final_val(&one), final_val(&two));
    let first = one.step_losses[0].1;
    eprintln!(
        "initial loss {first:.4}; validation after 40 steps: 1 rank {v1:.4}, 2 ranks {v2:.4}; unigram \
         entropy {entropy:.4}; {t1:.1} s and {t2:.1} s"
    );
    let l1: Vec<f64> = one.step_losses.iter().map(|s| s.1).collect();
    let l2: Vec<f64> = two.step_losses.iter().map(|s| s.1).collect();
    let early = (0..6).map(|s| (l1[s] - l2[s]).abs()).fold(0.0, f64::max);
    eprintln!("largest difference of the training loss over steps 1-6: {early:.2e}");
    assert!(
        v1 < entropy && v2 < entropy,
        "{v1} / {v2} not below {entropy}"
    );
    assert!(first > v1 + 1.0, "the loss did not fall: {first} -> {v1}");
    // Same windows, same initial weights: only the order of the f32 gradient sums differs. The FP8
    // casts turn last-bit differences into rounding flips and training at lr 1e-2 amplifies them:
    // measured, steps 1-6 agree within 1e-4, one step later differs by 0.63 (a loss spike one run
    // takes and the other does not), and the final validation losses within 0.005 (5.9246, 5.9201).
    assert!(early < 1e-3, "two ranks differ from one early: {early}");
    assert!((v1 - v2).abs() < 0.05, "two ranks end at {v2}, one at {v1}");
}

#[test]
fn resuming_is_bitwise_the_run_that_did_not_stop() {
    let (data, _) = data_dir();
    let dir = scratch("resume");
    let base = |name: &str| GptTrainConfig {
        eval_every: Some(3),
        max_val_batches: Some(2),
        metrics: Some(dir.join(format!("{name}.jsonl"))),
        export: Some(dir.join(format!("{name}.safetensors"))),
        ..config(&data, small(GptPrecision::Fp8, 32), 8, 4, 2)
    };
    let (whole, _) = run(&base("whole"));
    let ckpt = dir.join("ckpt");
    let (first, _) = run(&GptTrainConfig {
        save: Some(ckpt.clone()),
        stop_after_steps: Some(5),
        ..base("parts")
    });
    assert!(first.stopped_early);
    let (rest, _) = run(&GptTrainConfig {
        resume: Some(ckpt.clone()),
        ..base("parts")
    });
    assert_eq!(rest.steps, 8);
    let bits = |v: &[(u64, f64)]| v.iter().map(|(s, l)| (*s, l.to_bits())).collect::<Vec<_>>();
    let mut joined = first.step_losses.clone();
    joined.extend(&rest.step_losses);
    assert_eq!(bits(&joined), bits(&whole.step_losses), "step losses");
    assert_eq!(final_val(&rest).to_bits(), final_val(&whole).to_bits());
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap();
    assert!(
        read("whole.safetensors") == read("parts.safetensors"),
        "exported weights differ"
    );
    // The metrics file: the points of steps 3, 6 and 8, once each, the same values.
    let lines = |n: &str| -> Vec<(u32, u64)> {
        fsdp_examples::metrics::read_metrics(dir.join(n))
            .unwrap()
            .iter()
            .map(|r| (r.epoch, r.test_loss.to_bits()))
            .collect()
    };
    assert_eq!(lines("parts.jsonl"), lines("whole.jsonl"));
    assert_eq!(
        lines("whole.jsonl").iter().map(|l| l.0).collect::<Vec<_>>(),
        [3, 6, 8]
    );
    // Another seed is refused, naming the flag.
    let e = train(&GptTrainConfig {
        resume: Some(ckpt),
        model: GptModelChoice {
            seed: 2,
            ..small(GptPrecision::Fp8, 32)
        },
        ..base("other")
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("--seed 1") && e.contains("--seed 2"), "{e}");
}

#[test]
fn fp8_gradient_reduction_and_bf16_shards_stay_near_the_exact_ones() {
    let (data, _) = data_dir();
    let mk = |fp8_grad_comm, grad_shards| GptTrainConfig {
        eval_every: Some(10),
        max_val_batches: Some(4),
        ..config(
            &data,
            GptModelChoice {
                fp8_grad_comm,
                grad_shards,
                ..small(GptPrecision::Fp8, 32)
            },
            10,
            4,
            2,
        )
    };
    let (exact, _) = run(&mk(false, GradDtype::F32));
    let (fp8, _) = run(&mk(true, GradDtype::F32));
    // BF16 gradient shards (one rounding per reduction) stay near the F32 shards too.
    let (half, _) = run(&mk(false, GradDtype::Bf16));
    let diff_half = exact
        .step_losses
        .iter()
        .zip(&half.step_losses)
        .map(|(a, b)| (a.1 - b.1).abs())
        .fold(0.0, f64::max);
    let vh = final_val(&half);
    eprintln!("BF16 gradient shards: val {vh:.4}; largest step-loss difference {diff_half:.3e}");
    assert!(diff_half > 0.0, "BF16 gradient shards changed nothing");
    assert!(
        diff_half < 0.05 && (final_val(&exact) - vh).abs() < 0.03,
        "{diff_half} / {vh}"
    );
    let diff = exact
        .step_losses
        .iter()
        .zip(&fp8.step_losses)
        .map(|(a, b)| (a.1 - b.1).abs())
        .fold(0.0, f64::max);
    let (ve, vf) = (final_val(&exact), final_val(&fp8));
    eprintln!("F32 reduction: val {ve:.4}; FP8 E5M2: val {vf:.4}; largest step-loss difference {diff:.3e}");
    assert!(diff > 0.0, "the FP8 reduction changed nothing");
    assert!(
        diff < 0.05 && (ve - vf).abs() < 0.03,
        "{diff} / {ve} vs {vf}"
    );
}

#[test]
fn export_then_init_from_gives_the_validation_loss_back() {
    let (data, _) = data_dir();
    let dir = scratch("export");
    let file = dir.join("w.safetensors");
    let base = GptTrainConfig {
        eval_every: Some(4),
        max_val_batches: Some(4),
        ..config(&data, small(GptPrecision::Bf16, 32), 4, 4, 1)
    };
    let (trained, _) = run(&GptTrainConfig {
        export: Some(file.clone()),
        ..base.clone()
    });
    // One step with learning rate 0 changes no weight: the validation after it is the exported model's.
    let (loaded, _) = run(&GptTrainConfig {
        init_from: Some(file.clone()),
        lr: 0.0,
        steps: 1,
        eval_every: Some(1),
        ..base
    });
    let (a, b) = (final_val(&trained), final_val(&loaded));
    eprintln!("validation loss trained {a:.6}, loaded {b:.6}");
    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert!(names.contains(&"wte.weight") && names.contains(&"wpe.weight"));
    assert!(!names.iter().any(|n| n.starts_with("lm_head")), "{names:?}");
    assert!(
        names.contains(&"h.1.mlp_proj.weight")
            || names
                .iter()
                .any(|n| n.contains("h.1.") && n.ends_with("mlp_proj.weight")),
        "{names:?}"
    );
    assert_eq!(st.tensor("wpe.weight").unwrap().shape(), [32, 64]);
}

#[test]
fn bad_flags_are_refused_naming_them() {
    let bin = env!("CARGO_BIN_EXE_gpt_fsdp");
    let err = |args: &[&str]| -> String {
        let out = Command::new(bin)
            .args(["--device", "cpu", "--no-progress"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = err(&["--steps", "0"]);
    assert!(e.contains("--steps"), "{e}");
    let e = err(&["--preset", "gpt5"]);
    assert!(e.contains("--preset") && e.contains("gpt2-xl"), "{e}");
    let e = err(&["--d-model", "64", "--heads", "3"]);
    assert!(e.contains("--heads 3") && e.contains("64"), "{e}");
    let e = err(&["--batch-size", "0"]);
    assert!(e.contains("--batch-size"), "{e}");
    let slice = committed_shakespeare_slice_dir();
    let e = err(&[
        "--data",
        slice.to_str().unwrap(),
        "--seq-len",
        "9000",
        "--compact-vocab",
    ]);
    assert!(e.contains("--seq-len 9000"), "{e}");
    let e = err(&["--sample", "100", "--seq-len", "64"]);
    assert!(e.contains("--sample"), "{e}");
    let e = err(&["--data", "/nonexistent-gpt-data"]);
    assert!(e.contains("fetch-shakespeare"), "{e}");
    // The FP8 crossover: a positive integer, and only where it decides something.
    for bad in ["0", "-5", "big"] {
        let flag = format!("--fp8-auto-threshold={bad}");
        let e = err(&["--fp8-layers", "auto", &flag]);
        assert!(e.contains("--fp8-auto-threshold"), "{bad}: {e}");
    }
    let e = err(&["--fp8-auto-threshold", "512"]);
    assert!(
        e.contains("--fp8-auto-threshold") && e.contains("--fp8-layers auto"),
        "{e}"
    );
}

/// On a GPU: the learning run on CUDA ends near the CPU run, and `--speed` on the tiny preset reports a
/// step time, a pool peak and the model state.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_run_and_speed_line() {
    let (dev, why) = fp8_kernels::Device::auto();
    if !dev.is_cuda() {
        panic!(
            "no usable GPU ({})",
            why.map(|e| e.to_string()).unwrap_or_default()
        );
    }
    let (data, entropy) = data_dir();
    let mk = |device| GptTrainConfig {
        eval_every: Some(40),
        lr: 1e-2,
        device,
        ..config(&data, small(GptPrecision::Fp8, 32), 40, 16, 1)
    };
    let (cpu, _) = run(&mk(DeviceChoice::Cpu));
    let (gpu, secs) = run(&mk(DeviceChoice::Cuda));
    let (vc, vg) = (final_val(&cpu), final_val(&gpu));
    eprintln!("validation after 40 steps: CPU {vc:.4}, CUDA {vg:.4} ({secs:.1} s)");
    assert!(vg < entropy, "{vg} not below {entropy}");
    assert!((vc - vg).abs() < 0.1, "CUDA {vg} vs CPU {vc}");
    let report = fsdp_examples::gpt::speed(&fsdp_examples::gpt::SpeedConfig {
        model: GptModelChoice {
            preset: "tiny".into(),
            d_model: None,
            layers: None,
            heads: None,
            ..small(GptPrecision::Fp8, 256)
        },
        batch_size: 4,
        optimizer_states: fsdp_optim::StatePrecision::default(),
        world_size: 1,
        device: DeviceChoice::Cuda,
        threads_per_rank: None,
        warmup_steps: 2,
        timed_steps: 3,
        profile: true,
    })
    .unwrap();
    println!("{}", report.table());
    println!("{}", report.json());
    assert!(report.median_step() > 0.0 && report.tokens_per_sec() > 0.0);
    assert!(report.peak_bytes > report.memory.model_state() as u64);
    assert!(report.loss.is_finite());
    assert!(report.profile.is_some(), "no phase profile");
}
