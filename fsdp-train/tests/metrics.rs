//! Metrics records as JSON lines, and the SVG plot of several runs.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use fsdp_train::metrics::{
    parse_metrics, read_metrics, render_svg, MetricsError, MetricsRecord, MetricsWriter,
    PlotOptions, PlotSeries,
};
use proptest::prelude::*;

fn scratch_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fsdp-train-{name}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A plausible run: loss falling and accuracy rising towards `final_acc`.
fn fake_run(epochs: u32, final_acc: f64, loss_scale: f64) -> Vec<MetricsRecord> {
    (1..=epochs)
        .map(|e| {
            let t = f64::from(e);
            let correct = ((final_acc - 1.5 / t) * 100.0).round() as u64;
            let mut m = MetricsRecord::new(
                e,
                loss_scale / t,
                0.8 * loss_scale / t,
                correct,
                10_000,
                2.5,
                24_000.0,
            );
            m.lr = Some(1e-3 * 0.7f64.powi(e as i32 - 1));
            m
        })
        .collect()
}

fn arb_finite() -> impl Strategy<Value = f64> {
    prop_oneof![-1e6f64..1e6, 0.0f64..1.0, Just(0.0)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn json_lines_round_trip(
        records in prop::collection::vec(
            (1u32..100, arb_finite(), arb_finite(), 0u64..10_000, arb_finite(), arb_finite(),
             prop::option::of(arb_finite())),
            0..6,
        )
    ) {
        let records: Vec<MetricsRecord> = records
            .into_iter()
            .map(|(e, tl, vl, c, s, sps, lr)| {
                let mut m = MetricsRecord::new(e, tl, vl, c, 10_000, s, sps);
                m.lr = lr;
                m
            })
            .collect();
        let text: String = records.iter().map(|m| m.to_json_line().unwrap() + "\n").collect();
        prop_assert_eq!(text.lines().count(), records.len());
        prop_assert_eq!(parse_metrics(&text, "m.jsonl").unwrap(), records);
    }
}

#[test]
fn accuracy_is_derived_in_percent() {
    let m = MetricsRecord::new(3, 0.1, 0.05, 9_876, 10_000, 1.0, 1.0);
    assert!((m.test_accuracy - 98.76).abs() < 1e-12);
    assert!(MetricsRecord::new(1, 0.1, 0.1, 0, 0, 1.0, 1.0)
        .test_accuracy
        .is_nan());
}

#[test]
fn non_finite_values_survive_as_null() {
    let mut m = MetricsRecord::new(2, f64::NAN, f64::INFINITY, 980, 1000, 1.0, 2.0);
    m.extra
        .insert("precision".into(), serde_json::Value::from("fp8"));
    let line = m.to_json_line().unwrap();
    assert!(line.contains(r#""train_loss":null"#), "{line}");
    assert!(line.contains(r#""precision":"fp8""#), "{line}");
    let back = &parse_metrics(&line, "x").unwrap()[0];
    assert!(back.train_loss.is_nan() && back.test_loss.is_nan());
    assert_eq!(back.test_correct, 980);
    assert_eq!(back.extra["precision"], "fp8");
}

#[test]
fn unknown_fields_are_kept_and_missing_ones_rejected() {
    let line = r#"{"epoch":1,"train_loss":0.5,"test_loss":0.2,"test_accuracy":95.0,"test_correct":950,"test_total":1000,"seconds":3.0,"samples_per_sec":20000.0,"world_size":2,"memory":{"params":123}}"#;
    let m = &parse_metrics(line, "x").unwrap()[0];
    assert_eq!(m.extra["world_size"], 2);
    assert_eq!(m.extra["memory"]["params"], 123);
    assert_eq!(m.lr, None);
    // Written back, the extra fields are still there.
    let again = &parse_metrics(&m.to_json_line().unwrap(), "x").unwrap()[0];
    assert_eq!(again, m);

    let text = format!("{line}\n\n{{\"epoch\":2,\"train_loss\":0.4}}\n");
    match parse_metrics(&text, "run.jsonl").unwrap_err() {
        MetricsError::Parse { path, line, .. } => {
            assert_eq!(path, PathBuf::from("run.jsonl"));
            assert_eq!(line, 3);
        }
        e => panic!("expected a parse error, got {e}"),
    }
    let err = parse_metrics("not json", "bad.jsonl").unwrap_err();
    assert!(err.to_string().starts_with("bad.jsonl:1:"), "{err}");
}

/// `w` after writing `records`.
fn written(mut w: MetricsWriter, records: &[MetricsRecord]) -> MetricsWriter {
    for m in records {
        w.write(m).unwrap();
    }
    w
}

#[test]
fn writer_creates_appends_and_reads_back() {
    let dir = scratch_dir("metrics-writer");
    let path = dir.join("runs/fp8.jsonl");
    let run = fake_run(4, 99.1, 0.3);
    let w = written(MetricsWriter::create(&path).unwrap(), &run[..2]);
    // Flushed per record: readable while the writer is still open.
    assert_eq!(read_metrics(&path).unwrap(), run[..2]);
    drop(w);
    written(MetricsWriter::append(&path).unwrap(), &run[2..]);
    assert_eq!(read_metrics(&path).unwrap(), run);
    // create truncates.
    MetricsWriter::create(&path).unwrap();
    assert!(read_metrics(&path).unwrap().is_empty());
    assert!(matches!(
        read_metrics(dir.join("absent.jsonl")),
        Err(MetricsError::Io { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resume_cuts_the_file_back_to_the_checkpoint() {
    let dir = scratch_dir("metrics-resume");
    let path = dir.join("m.jsonl");
    let run = fake_run(4, 99.1, 0.3);
    // Epochs 1-3 written; the run crashed after epoch 3's line but before epoch 3's checkpoint, so
    // the resumed run (from epoch 2's checkpoint) writes epoch 3 again.
    written(MetricsWriter::create(&path).unwrap(), &run[..3]);
    let w = MetricsWriter::resume(&path, 2).unwrap();
    assert_eq!(w.dropped_on_resume(), 1);
    written(w, &run[2..]);
    assert_eq!(read_metrics(&path).unwrap(), run, "no epoch twice");
    // Nothing past the checkpoint: the file is left as it is.
    let before = std::fs::read(&path).unwrap();
    let w = MetricsWriter::resume(&path, 4).unwrap();
    assert_eq!(w.dropped_on_resume(), 0);
    drop(w);
    assert_eq!(std::fs::read(&path).unwrap(), before);
    // A last line cut short by a crash is removed; a bad line before it is an error naming it.
    let mut torn = before.clone();
    torn.extend_from_slice(b"{\"epoch\":5,\"train_lo");
    std::fs::write(&path, &torn).unwrap();
    drop(MetricsWriter::resume(&path, 9).unwrap());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let mut bad = b"{\"epoch\":1}\n".to_vec();
    bad.extend_from_slice(&before);
    std::fs::write(&path, &bad).unwrap();
    let err = MetricsWriter::resume(&path, 9).unwrap_err();
    assert!(err.to_string().contains("m.jsonl:1:"), "{err}");
    // A missing file is created; records kept by their step.
    let fresh = dir.join("new/steps.jsonl");
    MetricsWriter::resume(&fresh, 3).unwrap();
    assert!(read_metrics(&fresh).unwrap().is_empty());
    std::fs::create_dir_all(dir.join("new")).unwrap();
    let mut w = MetricsWriter::create(&fresh).unwrap();
    for (i, m) in run.iter().enumerate() {
        let mut m = m.clone();
        m.step = Some(100 * (i as u64 + 1));
        w.write(&m).unwrap();
    }
    drop(w);
    let w = MetricsWriter::resume_keeping(&fresh, |m| m.step <= Some(200)).unwrap();
    assert_eq!(w.dropped_on_resume(), 2);
    assert_eq!(read_metrics(&fresh).unwrap().len(), 2);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The `points` attribute of every polyline of `class` inside the series group labelled `label`.
fn polylines(svg: &str, label: &str, class: &str) -> Vec<Vec<(f64, f64)>> {
    let mut out = Vec::new();
    let needle = format!(r#"<g class="series" data-label="{label}""#);
    for (start, _) in svg.match_indices(&needle) {
        let group = &svg[start..start + svg[start..].find("</g>").unwrap()];
        for line in group.lines() {
            if line.starts_with(&format!(r#"<polyline class="{class}""#)) {
                let pts = line
                    .split("points=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap();
                out.push(
                    pts.split(' ')
                        .map(|p| {
                            let (x, y) = p.split_once(',').unwrap();
                            (x.parse().unwrap(), y.parse().unwrap())
                        })
                        .collect(),
                );
            }
        }
    }
    out
}

#[test]
fn svg_holds_every_series_in_both_panels_with_a_legend() {
    let f32_run = PlotSeries {
        label: "f32-seed1".into(),
        epochs: fake_run(14, 99.25, 0.25),
    };
    let fp8_run = PlotSeries {
        label: "fp8 <seed 1>".into(),
        epochs: fake_run(10, 99.1, 0.3),
    };
    let svg = render_svg(&[f32_run, fp8_run], &PlotOptions::default()).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // Labels are escaped.
    assert!(svg.contains(r#"data-label="fp8 &lt;seed 1&gt;""#));
    assert!(!svg.contains("<seed"));
    for (label, n) in [("f32-seed1", 14), ("fp8 &lt;seed 1&gt;", 10)] {
        let loss = polylines(&svg, label, "train-loss");
        let acc = polylines(&svg, label, "test-accuracy");
        assert_eq!((loss.len(), acc.len()), (1, 1), "{label}");
        assert_eq!((loss[0].len(), acc[0].len()), (n, n), "{label}");
        // Epochs go left to right; loss falls (y grows downwards in SVG), accuracy rises.
        assert!(
            loss[0]
                .windows(2)
                .all(|w| w[1].0 > w[0].0 && w[1].1 > w[0].1),
            "{label}"
        );
        assert!(
            acc[0]
                .windows(2)
                .all(|w| w[1].0 > w[0].0 && w[1].1 <= w[0].1),
            "{label}"
        );
        assert!(svg.contains(&format!(r#"<g class="legend-entry" data-label="{label}">"#)));
    }
    // Both runs share the x axis: epoch 1 sits at the same x in each.
    let a = polylines(&svg, "f32-seed1", "test-accuracy")[0][0].0;
    let b = polylines(&svg, "fp8 &lt;seed 1&gt;", "test-accuracy")[0][0].0;
    assert_eq!(a, b);
    assert_eq!(
        svg.matches(r#"<circle class="point""#).count(),
        2 * (14 + 10)
    );
    for text in ["Train loss", "Test accuracy", "test accuracy (%)", "epoch"] {
        assert!(svg.contains(text), "missing {text}");
    }
}

#[test]
fn nan_breaks_the_line_and_single_epochs_get_markers() {
    let mut epochs = fake_run(6, 98.0, 0.4);
    epochs[3].train_loss = f64::NAN;
    let svg = render_svg(
        &[
            PlotSeries {
                label: "diverged".into(),
                epochs,
            },
            PlotSeries {
                label: "one".into(),
                epochs: fake_run(1, 97.0, 0.5),
            },
        ],
        &PlotOptions::default(),
    )
    .unwrap();
    let loss = polylines(&svg, "diverged", "train-loss");
    assert_eq!(loss.iter().map(Vec::len).collect::<Vec<_>>(), [3, 2]);
    assert!(polylines(&svg, "one", "train-loss").is_empty());
    assert_eq!(svg.matches(r#"<circle class="point""#).count(), 5 + 6 + 2);
    assert!(!svg.contains("NaN"));
}

#[test]
fn empty_input_is_an_error() {
    assert!(matches!(
        render_svg(&[], &PlotOptions::default()),
        Err(MetricsError::NothingToPlot(_))
    ));
    let empty = PlotSeries {
        label: "x".into(),
        epochs: vec![],
    };
    assert!(render_svg(&[empty], &PlotOptions::default()).is_err());
}
