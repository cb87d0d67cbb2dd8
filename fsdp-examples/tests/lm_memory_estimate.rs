//! The LM memory estimate the Trainer refuses runs with is a lower bound of what real runs held: for
//! every speed run on the H200 committed under docs/results (ours, each with its peak), the estimate
//! of the same shape and batch stays below the measured peak, and above 70 % of it (a bound far below
//! would refuse nothing).

use fsdp_examples::lm::{LmSpec, ShapeOverrides};
use fsdp_optim::StatePrecision;
use fsdp_shard::GradDtype;
use fsdp_train::MemoryPlan;
use std::path::Path;

const RUNS: &[&str] = &[
    "2026-12-04-1154-gpt-gpt2/gpt2.ours.log",
    "2026-12-04-1202-gpt-gpt2-xl-gpt-3b/gpt2-xl.ours.log",
    "2026-12-04-1202-gpt-gpt2-xl-gpt-3b/gpt-3b.ours.log",
    "2026-12-04-1529-gpt-gpt-6.7b/gpt-6.7b.ours.log",
    "2026-12-04-2023-llama-llama-1b/llama-1b.ours.log",
    "2026-12-04-2026-llama-llama-3b-llama-8b/llama-3b.ours.log",
    "2026-12-04-2026-llama-llama-3b-llama-8b/llama-8b.ours.log",
];

/// The JSON line of a speed run's log.
fn speed_line(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    let line = text
        .lines()
        .rev()
        .find_map(|l| l.find("{\"").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{}: no JSON line", path.display()));
    serde_json::from_str(line).unwrap()
}

#[test]
fn the_estimate_is_below_every_measured_h200_peak_and_near_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/results");
    for run in RUNS {
        let j = speed_line(&root.join(run));
        let n = |k: &str| j[k].as_u64().unwrap_or_else(|| panic!("{run}: no {k}")) as usize;
        let preset = j["preset"].as_str().unwrap();
        let o = ShapeOverrides {
            d_model: Some(n("d_model")),
            layers: Some(n("layers")),
            heads: Some(n("heads")),
            ..ShapeOverrides::default()
        };
        let mut spec = LmSpec::with_overrides(preset, o, n("seq")).unwrap();
        spec.vocab = n("vocab");
        let recipe = j["recipe"].as_str().unwrap();
        let plan = MemoryPlan {
            world_size: 1,
            cuda: true,
            fp8_linears: recipe.starts_with("FP8 linears"),
            optimizer_states: StatePrecision::LowPrecision,
            grad_shards: if recipe.contains("BF16 gradient shards") {
                GradDtype::Bf16
            } else {
                GradDtype::F32
            },
            optimizer_in_backward: false,
        };
        let estimate = spec.memory_estimate(n("batch"), &plan).unwrap();
        let peak = j["peak_GiB"].as_f64().unwrap() * f64::from(1u32 << 30);
        let state = j["model_state_bytes"]["total"].as_f64().unwrap();
        let got = estimate.total() as f64;
        eprintln!(
            "{run}: estimate / measured peak {:.3}, model state {:.3e} B",
            got / peak,
            state
        );
        assert!(
            got <= peak && got >= 0.7 * peak,
            "{run}: estimate {:.2} GiB against a measured peak of {:.2} GiB: {estimate:?}",
            got / f64::from(1u32 << 30),
            peak / f64::from(1u32 << 30)
        );
        // The model-state part prices the parameters as the optimizer's report counted them.
        let est_state = estimate.parts[0].bytes as f64;
        assert!(
            (est_state - state).abs() <= 0.01 * state,
            "{run}: model state estimated {est_state} against {state} reported"
        );
    }
}

/// A refusal names the recompute settings with the count that fits: llama-8b at 1 x 8192 on an 80 GB
/// card (78.09 GiB free, as the 2026-12-08 H100 call reported) is refused, and the named
/// `--recompute-mlp-up N` is the smallest count whose own estimate passes.
#[test]
fn a_refusal_names_the_smallest_recompute_count_that_fits() {
    let plan = MemoryPlan {
        world_size: 1,
        cuda: true,
        fp8_linears: true,
        optimizer_states: StatePrecision::LowPrecision,
        grad_shards: GradDtype::Bf16,
        optimizer_in_backward: true,
    };
    let have = (78.09 * f64::from(1u32 << 30)) as u64;
    let spec_with = |n: usize| {
        let mut spec = LmSpec::with_overrides("llama-8b", ShapeOverrides::default(), 8192).unwrap();
        // The Llama-3 tokenizer's vocabulary, which the run sets from its data.
        spec.vocab = 128_256;
        spec.recompute_mlp_up = n;
        spec
    };
    let verdict = |spec: &LmSpec| {
        fsdp_train::memory_verdict(&spec.memory_estimate(1, &plan).unwrap(), true, 1, have)
    };
    let m = verdict(&spec_with(0)).unwrap_err().to_string();
    let named: usize = m
        .split("--recompute-mlp-up ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --recompute-mlp-up count in: {m}"));
    assert!(named > 0 && named <= 32, "{m}");
    assert!(
        verdict(&spec_with(named)).is_ok(),
        "{named} blocks do not fit: {m}"
    );
    assert!(
        verdict(&spec_with(named - 1)).is_err(),
        "{} blocks fit already: {m}",
        named - 1
    );
    // --recompute is named too, and its estimate fits.
    assert!(m.contains("--recompute (about"), "{m}");
    let mut all = spec_with(0);
    all.recompute_blocks = true;
    assert!(verdict(&all).is_ok());
    // From a count already set, the advice names the larger total count.
    let m4 = verdict(&spec_with(4)).unwrap_err().to_string();
    assert!(m4.contains(&format!("--recompute-mlp-up {named} ")), "{m4}");
    eprintln!("{m}");
}
