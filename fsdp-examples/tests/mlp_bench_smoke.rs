//! CI smoke test of the MLP-stack benchmark on the CPU with small sizes: both modes train (the loss
//! falls), agree with each other at the start, fused/unfused and recomputed/kept variants train bit for
//! bit alike, ranks fed different inputs agree on every FP8 scale in one all-reduce per step, and the
//! `mlp_bench` binary prints a consistent JSON line.

use fsdp_comm::{
    run_ranks, Collective, CollectiveKind, CommError, CommWork, Communicator, ReduceOp,
};
use fsdp_examples::mlp::{BenchMode, MlpBench, MlpConfig, MlpError};
use fsdp_shard::{GradDtype, GradReduction};
use half::bf16;
use std::sync::{Arc, Mutex};

/// The bench's defaults (fused GELU casts, recast GELU input) at a small size.
fn config(mode: BenchMode) -> MlpConfig {
    MlpConfig {
        mode,
        lr: 1e-2,
        seed: 3,
        ..MlpConfig::fp8(32, 2, 64)
    }
}

/// Loss of the first step's forward and of the last of `steps`.
fn losses(cfg: MlpConfig, ranks: usize, steps: usize) -> (f64, f64) {
    let out = run_ranks(ranks, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut b = MlpBench::new(cfg.clone(), comm)?;
        let mut first = 0.0;
        for s in 0..steps {
            b.step()?;
            if s == 0 {
                first = b.loss()?;
            }
        }
        let last = b.loss()?;
        Ok::<_, MlpError>((first, last))
    })
    .unwrap();
    out[0]
}

#[test]
fn both_modes_train_and_start_from_the_same_loss() {
    let (b0, b1) = losses(config(BenchMode::Bf16), 1, 12);
    let (f0, f1) = losses(config(BenchMode::Fp8), 1, 12);
    assert!(b1 < 0.8 * b0, "bf16 loss {b0} -> {b1}");
    assert!(f1 < 0.8 * f0, "fp8 loss {f0} -> {f1}");
    // Same weights and input; the FP8 forward differs only by quantization.
    assert!((b0 - f0).abs() < 0.05 * b0, "first losses {b0} vs {f0}");
}

#[test]
fn fp8_reduction_and_recompute_on_two_ranks_train() {
    let mut cfg = config(BenchMode::Fp8);
    cfg.grad_reduction = GradReduction::Fp8(fp8_core::Fp8Format::E4M3);
    cfg.recompute = true;
    let (a, b) = losses(cfg.clone(), 2, 12);
    assert!(b < 0.8 * a, "fp8 two ranks loss {a} -> {b}");
    // One rank with the same global batch starts from the same loss (the input is replicated here).
    let (a1, _) = losses(cfg, 1, 1);
    assert!((a - a1).abs() < 1e-6 * a1.max(1.0), "{a} vs {a1}");
}

/// Sizes that overflow or cannot fit, and zero counts, are refused up front with a message naming the
/// cause (exit 1), never a panic (101), an abort (134) or a run.
#[test]
fn bad_sizes_and_counts_are_refused_before_any_work() {
    for (args, expect) in [
        (&["--d", "18446744073709551615"][..], "overflow"),
        (
            &["--d", "65536", "--blocks", "64"][..],
            "choose smaller sizes",
        ),
        (&["--threads", "0"][..], "--threads must be at least 1"),
        (&["--steps", "0"][..], "--steps must be at least 1"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlp_bench"))
            .args(["--device", "cpu"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn binary_prints_a_consistent_json_line() {
    let run = |mode: &str| -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlp_bench"))
            .args([
                "--device", "cpu", "--mode", mode, "--d", "32", "--blocks", "2", "--tokens", "32",
            ])
            .args(["--warmup", "1", "--steps", "3"])
            .args(if mode == "fp8" {
                &["--profile"][..]
            } else {
                &[]
            })
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(text.lines().last().unwrap()).unwrap()
    };
    let (b, f) = (run("bf16"), run("fp8"));
    for j in [&b, &f] {
        assert_eq!(j["params"], 2 * 8 * 32 * 32);
        assert_eq!(j["steps"], 3);
        assert!(j["step_s"].as_f64().unwrap() > 0.0);
        assert!(j["loss"].as_f64().unwrap().is_finite());
    }
    // The profile (fp8 run only) has the three phases a step marks (no data phase), each with host time
    // (no GPU time on the CPU), together at most the whole step time summed over the timed steps' mean.
    let prof = f["profile_ms"].as_object().unwrap();
    assert!(b["profile_ms"].is_null());
    for phase in ["forward", "backward", "optimizer"] {
        let ms = prof[phase]["host"].as_f64().unwrap();
        assert!(ms > 0.0, "{phase}: {ms}");
        assert!(prof[phase]["gpu"].is_null(), "{phase}: {}", prof[phase]);
    }
    assert_eq!(prof.len(), 3);
    let max_step_ms = f["step_times_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() * 1e3)
        .fold(0.0, f64::max);
    let summed: f64 = prof.values().map(|v| v["host"].as_f64().unwrap()).sum();
    assert!(
        summed <= max_step_ms * 1.05,
        "{summed} ms of phases vs step {max_step_ms} ms"
    );
    let state = |j: &serde_json::Value| j["model_state_bytes"]["total"].as_u64().unwrap() as f64;
    // bf16: F32 parameters, gradients, m and v (16 B/param); fp8: 1 + 2 (BF16 gradient shard, the
    // default) + 5 = 8 (plus at most a few per-unit scalars the optimizer may keep).
    let dense = 16.0 * (2 * 8 * 32 * 32) as f64;
    assert!(
        state(&b) >= dense && state(&b) < dense + 1024.0,
        "bf16 state {} vs {dense}",
        state(&b)
    );
    assert_eq!(f["grad_shards"], "bf16");
    assert!(
        state(&f) < 0.51 * state(&b),
        "fp8 state {} vs bf16 {}",
        state(&f),
        state(&b)
    );
}

#[test]
fn recompute_matches_saved_activations() {
    // The recomputed backward (u and the down input re-derived from the kept block input) runs the
    // same kernels on the same values as the saved one, so training is bit-identical.
    let mut cfg = config(BenchMode::Fp8);
    let kept = final_state(cfg.clone(), 1, 4);
    cfg.recompute = true;
    let recomputed = final_state(cfg, 1, 4);
    assert_eq!(kept, recomputed);
    let l = &kept[0].1;
    assert!(l[3] < l[0], "{l:?}");
}

/// Every rank's final residual stream and the gathered master weights after `steps` steps.
fn final_state(cfg: MlpConfig, ranks: usize, steps: usize) -> Vec<(Vec<u32>, Vec<f64>)> {
    run_ranks(ranks, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut b = MlpBench::new(cfg.clone(), comm)?;
        let mut losses = Vec::with_capacity(steps);
        for _ in 0..steps {
            b.step()?;
            losses.push(b.loss()?);
        }
        let out = b.output()?;
        Ok::<_, MlpError>((
            out.into_iter().map(|v| v.to_bits() as u32).collect(),
            losses,
        ))
    })
    .unwrap()
}

/// Asserts that configurations `a` and `b` train 5 steps on `ranks` ranks to bit-identical states, and
/// that they train (so scales and weights move).
fn assert_train_alike(a: MlpConfig, b: MlpConfig, ranks: usize, what: &str) {
    let (sa, sb) = (final_state(a, ranks, 5), final_state(b, ranks, 5));
    assert_eq!(sa, sb, "{what}, {ranks} rank(s)");
    let losses = &sa[0].1;
    assert!(
        losses[4] < losses[0],
        "the runs train (so scales and weights move): {losses:?}"
    );
}

#[test]
fn fused_gelu_casts_train_bit_identically() {
    // The fused kernels write the same FP8 codes, transposes and amaxes as GELU-then-cast, so every step
    // (weights, scales, activations) is identical; with and without recompute, one and two ranks.
    for (recompute, ranks) in [(false, 1), (true, 1), (false, 2)] {
        let mut cfg = config(BenchMode::Fp8);
        cfg.recompute = recompute;
        cfg.fused = false;
        cfg.recompute_gelu = false;
        let plain = cfg.clone();
        cfg.fused = true;
        assert_train_alike(plain, cfg, ranks, &format!("recompute {recompute}"));
    }
}

#[test]
fn recomputed_gelu_input_trains_bit_identically() {
    // The backward recasts the down linear's input from the kept u with the forward's scale: the same
    // codes, so every step is identical; fused and unfused, one and two ranks.
    for (fused, ranks) in [(true, 1), (false, 1), (true, 2)] {
        let mut cfg = config(BenchMode::Fp8);
        cfg.fused = fused;
        cfg.recompute_gelu = false;
        let kept = cfg.clone();
        cfg.recompute_gelu = true;
        assert_train_alike(kept, cfg, ranks, &format!("fused {fused}"));
    }
}

#[test]
fn f32_and_bf16_gradient_shards_train_alike() {
    // One step from the same start: BF16 shards round each reduced gradient once, so the first losses
    // agree exactly (same forward) and the trained losses closely.
    let mut cfg = config(BenchMode::Fp8);
    let (b0, b1) = losses(cfg.clone(), 1, 8);
    cfg.grad_dtype = GradDtype::F32;
    let (f0, f1) = losses(cfg, 1, 8);
    assert_eq!(b0, f0);
    assert!(b1 < 0.8 * b0 && f1 < 0.8 * f0, "{b0} -> {b1}, {f0} -> {f1}");
    assert!(
        (b1 - f1).abs() < 0.02 * f1,
        "bf16 shards {b1} vs f32 shards {f1}"
    );
}

/// Forwards to a communicator and counts the all-reduces with MAX started through it.
struct CountingComm {
    inner: Arc<dyn Communicator>,
    max_reduces: Mutex<usize>,
}

impl Communicator for CountingComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> &fp8_kernels::Device {
        self.inner.device()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn start(&self, call: Collective<'_>) -> Result<CommWork, CommError> {
        if call.kind() == CollectiveKind::AllReduce && call.op() == Some(ReduceOp::Max) {
            *self.max_reduces.lock().unwrap() += 1;
        }
        self.inner.start(call)
    }
}

/// Every FP8 scale after each of `steps` steps, and the all-reduces(MAX) of each step; rank `r`'s input
/// is the default one times `gain(r)`.
#[allow(clippy::type_complexity)]
fn scales_per_step(
    ranks: usize,
    steps: usize,
    gain: impl Fn(usize) -> f32 + Sync,
) -> Vec<(Vec<Vec<f32>>, Vec<usize>)> {
    run_ranks(ranks, |comm| {
        let counting = Arc::new(CountingComm {
            inner: Arc::new(comm),
            max_reduces: Mutex::new(0),
        });
        let comm: Arc<dyn Communicator> = counting.clone();
        let rank = comm.rank();
        let mut b = MlpBench::new(config(BenchMode::Fp8), comm)?;
        let g = gain(rank);
        let x: Vec<bf16> = b
            .input()?
            .iter()
            .map(|v| bf16::from_f32(v.to_f32() * g))
            .collect();
        b.set_input(&x)?;
        let mut scales = Vec::new();
        let mut reduces = Vec::new();
        for _ in 0..steps {
            *counting.max_reduces.lock().unwrap() = 0;
            b.step()?;
            reduces.push(*counting.max_reduces.lock().unwrap());
            scales.push(b.fp8_scales()?);
        }
        Ok::<_, MlpError>((scales, reduces))
    })
    .unwrap()
}

#[test]
fn ranks_fed_different_inputs_agree_on_every_scale() {
    // Rank 1's input is 16 times rank 0's (exact in bf16): the ranks' amaxes differ everywhere.
    let gain = |r: usize| if r == 0 { 1.0 } else { 16.0 };
    let two = scales_per_step(2, 3, gain);
    for s in 0..3 {
        assert_eq!(two[0].0[s], two[1].0[s], "step {s}: every scale agreed");
        assert_eq!(two[0].1[s], 1, "step {s}: one all-reduce(MAX) on rank 0");
        assert_eq!(two[1].1[s], 1, "step {s}: one all-reduce(MAX) on rank 1");
    }
    // After the first step each activation meta holds the scale of the larger of the two ranks' amaxes:
    // the smaller of the scales each input alone gives (one rank with that input runs the same first
    // forward and backward). Weight scales come first (two per block), then the metas.
    let alone0 = scales_per_step(1, 1, |_| 1.0);
    let alone1 = scales_per_step(1, 1, |_| 16.0);
    let weights = 2 * config(BenchMode::Fp8).blocks;
    let (agreed, s0, s1) = (&two[0].0[0], &alone0[0].0[0], &alone1[0].0[0]);
    assert_eq!(agreed.len(), weights + 4 * config(BenchMode::Fp8).blocks);
    let mut differ = 0;
    for i in weights..agreed.len() {
        assert_eq!(agreed[i], s0[i].min(s1[i]), "meta {}", i - weights);
        differ += usize::from(agreed[i] != s0[i]);
    }
    // At least the first block's input meta: 16 times rank 0's amax.
    assert_eq!(agreed[weights] * 16.0, s0[weights]);
    assert!(differ >= 1);
}
