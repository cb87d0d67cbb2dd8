//! The FP8/BF16 crossover of `--fp8-layers auto`: reading the crossover from synthetic tables (a clean
//! crossover, FP8 always faster, never faster, noise below the crossover, ties, shared k), the measured
//! shapes, the threshold reaching the model, and one tiny CPU measurement through the real layers.

use fp8_core::Fp8Recipe;
use fp8_kernels::Device;
use fsdp_comm::{Communicator, ThreadGroup, DEFAULT_THREAD_TIMEOUT};
use fsdp_examples::gpt::crossover::{
    combined_threshold, crossover_cases, crossover_of, measure, pick_crossover, BlockLinear,
    CaseSet, Crossover, CrossoverConfig, Feed, KTiming, GPU_WIDTHS,
};
use fsdp_examples::gpt::{Gpt, GptConfig};
use fsdp_nn::{convert_to_fp8, fp8_auto_ratio, Fp8Filter, LinearInfo, DEFAULT_FP8_AUTO_THRESHOLD};
use fsdp_optim::StatePrecision;
use fsdp_shard::GradDtype;
use std::sync::Arc;

/// Rows `(k, bf16, fp8)`.
fn table(rows: &[(usize, f64, f64)]) -> Vec<KTiming> {
    rows.iter()
        .map(|&(k, bf16, fp8)| KTiming { k, bf16, fp8 })
        .collect()
}

#[test]
fn a_clean_crossover_is_the_first_k_of_the_faster_run() {
    let t = table(&[
        (384, 10.0, 14.0),
        (512, 20.0, 22.0),
        (640, 30.0, 29.0),
        (1024, 60.0, 40.0),
    ]);
    let c = pick_crossover(&t).unwrap();
    assert_eq!(
        c,
        Crossover::At {
            k: 640,
            slower_at: 512
        }
    );
    assert_eq!(c.suggested_threshold(), Some(640));
    // Row order does not matter.
    let mut rev = t.clone();
    rev.reverse();
    assert_eq!(pick_crossover(&rev).unwrap(), c);
}

#[test]
fn a_slower_point_above_a_faster_one_moves_the_crossover_up() {
    // FP8 wins at 512 by noise, loses at 640: the crossover is above 640.
    let t = table(&[
        (384, 10.0, 14.0),
        (512, 20.0, 19.0),
        (640, 30.0, 31.0),
        (1024, 60.0, 40.0),
        (2048, 90.0, 50.0),
    ]);
    assert_eq!(
        pick_crossover(&t).unwrap(),
        Crossover::At {
            k: 1024,
            slower_at: 640
        }
    );
}

#[test]
fn every_row_of_a_shared_k_must_be_faster() {
    // c_fc and mlp_proj share k; one of them loses at 614.
    let t = table(&[
        (614, 30.0, 29.0),
        (614, 30.0, 30.5),
        (768, 40.0, 35.0),
        (1024, 60.0, 40.0),
    ]);
    assert_eq!(
        pick_crossover(&t).unwrap(),
        Crossover::At {
            k: 768,
            slower_at: 614
        }
    );
}

#[test]
fn a_tie_is_not_faster() {
    let t = table(&[(384, 10.0, 10.0), (512, 20.0, 19.0)]);
    assert_eq!(
        pick_crossover(&t).unwrap(),
        Crossover::At {
            k: 512,
            slower_at: 384
        }
    );
}

#[test]
fn fp8_always_faster_and_never_faster() {
    let fast = table(&[(384, 10.0, 9.0), (1024, 60.0, 40.0)]);
    let c = pick_crossover(&fast).unwrap();
    assert_eq!(c, Crossover::Fp8AlwaysFaster { min_k: 384 });
    assert_eq!(c.suggested_threshold(), Some(384));
    assert!(
        c.describe().contains("every measured k"),
        "{}",
        c.describe()
    );

    let slow = table(&[(384, 10.0, 11.0), (512, 20.0, 19.0), (1024, 60.0, 61.0)]);
    let c = pick_crossover(&slow).unwrap();
    assert_eq!(c, Crossover::NoCrossover { max_k: 1024 });
    assert_eq!(c.suggested_threshold(), None);
    assert!(c.describe().contains("no crossover"), "{}", c.describe());
}

#[test]
fn empty_and_broken_tables_are_refused() {
    assert!(pick_crossover(&[]).is_err());
    for bad in [
        (384, f64::NAN, 1.0),
        (384, 1.0, f64::INFINITY),
        (384, 0.0, 1.0),
        (384, 1.0, -2.0),
    ] {
        let e = pick_crossover(&table(&[(256, 1.0, 2.0), bad]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("k 384"), "{e}");
    }
}

#[test]
fn the_combined_threshold_is_the_largest_and_none_wins() {
    let at = |k| Crossover::At { k, slower_at: 1 };
    assert_eq!(
        combined_threshold(&[at(640), Crossover::Fp8AlwaysFaster { min_k: 384 }, at(960)]),
        Some(960)
    );
    assert_eq!(
        combined_threshold(&[at(640), Crossover::NoCrossover { max_k: 2048 }]),
        None
    );
}

#[test]
fn the_cases_are_the_block_linears_of_each_width() {
    let cases = crossover_cases(&GPU_WIDTHS);
    // Four linears alone and two after their norm per width.
    assert_eq!(cases.len(), 6 * GPU_WIDTHS.len());
    for c in &cases {
        let (i, o) = c.linear.features(c.d);
        assert_eq!((c.inf, c.outf), (i, o));
        assert_eq!(c.k, i * o / (i + o));
        assert!(c.feed == Feed::Alone || c.linear.after_norm(), "{c:?}");
    }
    let d768: Vec<_> = cases
        .iter()
        .filter(|c| c.d == 768 && c.feed == Feed::Alone)
        .map(|c| (c.linear, c.k))
        .collect();
    assert_eq!(
        d768,
        [
            (BlockLinear::CAttn, 576),
            (BlockLinear::AttnProj, 384),
            (BlockLinear::CFc, 614),
            (BlockLinear::MlpProj, 614),
        ]
    );
    // The model's set takes each linear once per width; the alone set takes every linear alone.
    for set in [CaseSet::AsInModel, CaseSet::AllAlone] {
        let n = cases.iter().filter(|c| set.contains(c)).count();
        assert_eq!(n, 4 * GPU_WIDTHS.len(), "{set:?}");
    }
    assert!(cases
        .iter()
        .filter(|c| CaseSet::AsInModel.contains(c))
        .all(|c| (c.feed == Feed::AfterNorm) == c.linear.after_norm()));
}

#[test]
fn the_threshold_reaches_the_model() {
    let fp8 = |filter: &Fp8Filter| -> Vec<String> {
        let mut gpt = Gpt::<half::bf16>::new(GptConfig {
            vocab: 256,
            ..GptConfig::new(128, 1, 4, 16)
        })
        .unwrap();
        convert_to_fp8(&mut gpt, filter, &Fp8Recipe::default()).unwrap()
    };
    // d 128: k = 96 (c_attn), 64 (attn_proj), 102 (c_fc, mlp_proj).
    assert_eq!(fp8_auto_ratio(128, 512), 102);
    assert_eq!(
        fp8(&Fp8Filter::Auto { threshold: 100 }),
        ["h.0.c_fc", "h.0.mlp_proj"]
    );
    assert_eq!(
        fp8(&Fp8Filter::Auto { threshold: 64 }),
        ["h.0.c_attn", "h.0.attn_proj", "h.0.c_fc", "h.0.mlp_proj"]
    );
    assert!(fp8(&Fp8Filter::auto()).is_empty());
    // The measured default: gpt-3b's attn_proj (k = 1280) is FP8, a 2048 x 2048 linear (k = 1024) is not.
    let at = |i, o| LinearInfo {
        path: "x",
        in_features: i,
        out_features: o,
    };
    assert!(Fp8Filter::auto().accepts(&at(2560, 2560)));
    assert!(!Fp8Filter::auto().accepts(&at(2048, 2048)));
    assert_eq!(DEFAULT_FP8_AUTO_THRESHOLD, 1200);
}

#[test]
fn a_tiny_cpu_measurement_runs_the_real_layers() {
    let comm: Arc<dyn Communicator> = Arc::new(
        ThreadGroup::new(1, DEFAULT_THREAD_TIMEOUT)
            .unwrap()
            .pop()
            .unwrap(),
    );
    assert!(matches!(comm.device(), Device::Cpu));
    let config = CrossoverConfig {
        tokens: vec![8, 16],
        widths: vec![16],
        warmup: 1,
        iters: 1,
        states: StatePrecision::LowPrecision,
        grad_shards: GradDtype::F32,
    };
    let mut seen = 0;
    let rows = measure(&comm, &config, |_| seen += 1).unwrap();
    assert_eq!(seen, 6);
    assert_eq!(rows.len(), 6 * 2);
    for r in &rows {
        for t in [r.bf16, r.fp8] {
            assert!(t.step_ms > 0.0 && t.step_ms.is_finite(), "{r:?}");
            assert!(t.forward_ms >= 0.0 && t.backward_ms >= 0.0 && t.optimizer_ms >= 0.0);
        }
    }
    for set in [CaseSet::AsInModel, CaseSet::AllAlone] {
        for tokens in [8, 16] {
            crossover_of(&rows, tokens, set).unwrap();
        }
    }
    // Bad configurations are refused before anything is built.
    let bad = CrossoverConfig {
        iters: 0,
        ..config.clone()
    };
    assert!(measure(&comm, &bad, |_| {}).is_err());
    let bad = CrossoverConfig {
        tokens: vec![],
        ..config
    };
    assert!(measure(&comm, &bad, |_| {}).is_err());
}
