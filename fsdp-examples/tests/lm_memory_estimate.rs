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
