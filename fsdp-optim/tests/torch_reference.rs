//! A fixed small case against numbers produced by `torch.optim.AdamW` / `torch.optim.Adam`
//! (`scripts/torch_adamw_reference.py`, run where PyTorch is installed; its output is committed as
//! `tests/data/torch_adamw_reference.json`; `TORCH_ADAMW_REFERENCE` names another file). A missing file
//! is a failure.

mod common;

use common::*;
use fsdp_optim::{AdamOptions, StatePrecision};
use fsdp_shard::{ModelLayout, ParamKind, ParamSpec, WrapPolicy};
use serde_json::Value;
use std::sync::Arc;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    floats(v)
        .into_iter()
        .map(|x| {
            // serde_json's default float parsing may be one f64 ulp off; the float32 value is unaffected.
            let y = x as f32;
            assert!(
                (y as f64 - x).abs() <= 1e-12 * x.abs(),
                "inputs must be float32 values: {x}"
            );
            y
        })
        .collect()
}

#[test]
fn matches_torch_optim() {
    let path = std::env::var("TORCH_ADAMW_REFERENCE").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/torch_adamw_reference.json"
        )
        .to_string()
    });
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the PyTorch reference numbers {path}: {e}"));
    let j: Value = serde_json::from_str(&text).expect("reference JSON");
    let shape = |k: &str| -> Vec<usize> {
        j["shapes"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    };
    let layout = Arc::new(
        ModelLayout::new(
            vec![
                ParamSpec::new("fc", "weight", &shape("weight"), ParamKind::Fp8Weight),
                // The reference ran torch's optimizer with one parameter group: the bias decays too.
                ParamSpec {
                    decay: true,
                    ..ParamSpec::new("fc", "bias", &shape("bias"), ParamKind::Plain)
                },
            ],
            &WrapPolicy::Single,
        )
        .unwrap(),
    );
    let names = ["weight", "bias"];
    let init: Vec<Vec<f32>> = names.iter().map(|k| f32s(&j["init"][k])).collect();
    let grads: Vec<Vec<Vec<f32>>> = j["grads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| names.iter().map(|k| f32s(&g[k])).collect())
        .collect();
    let problem = Problem {
        layout,
        init,
        grads,
    };
    let cases = j["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let betas = floats(&case["betas"]);
        let steps = case["steps"].as_u64().unwrap() as usize;
        let decoupled = match case["optimizer"].as_str().unwrap() {
            "AdamW" => true,
            "Adam" => false,
            other => panic!("unknown optimizer {other}"),
        };
        let want: Vec<Vec<f64>> = names.iter().map(|k| floats(&case["result"][k])).collect();
        for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
            let o = AdamOptions {
                lr: case["lr"].as_f64().unwrap(),
                betas: (betas[0], betas[1]),
                eps: case["eps"].as_f64().unwrap(),
                weight_decay: case["weight_decay"].as_f64().unwrap(),
                maximize: case["maximize"].as_bool().unwrap(),
                max_grad_norm: case["max_grad_norm"].as_f64(),
                state_precision: precision,
                ..AdamOptions::adam()
            };
            for ws in [1, 2] {
                let got = run(&problem, ws, o, decoupled, steps);
                let (params, _) = merge(&problem.layout, &got);
                let d = rel_diff(&params, &want);
                let motion = rel_to_motion(&params, &want, &problem.init);
                match precision {
                    StatePrecision::F32 => {
                        assert!(d < 1e-6, "{name} ws {ws}: {d:e} by norm");
                        // Per element: f32 arithmetic against float64.
                        for (p, q) in params.iter().flatten().zip(want.iter().flatten()) {
                            let tol = 1e-6 * q.abs() + 1e-7;
                            assert!(
                                (*p as f64 - q).abs() <= tol,
                                "{name} ws {ws}: {p} vs torch {q}"
                            );
                        }
                    }
                    StatePrecision::LowPrecision => {
                        assert!(
                            d < 3e-2 && motion < 0.1,
                            "{name} ws {ws}: low-precision states {d:e} by norm, {motion:e} of the motion"
                        );
                    }
                }
            }
        }
    }
}
