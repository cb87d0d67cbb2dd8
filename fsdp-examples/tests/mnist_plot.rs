//! The `mnist_plot` binary: metrics files overlaid in one SVG, labelled by their stems; a bad file named.

mod scratch;

use fsdp_train::metrics::{MetricsRecord, MetricsWriter};
use scratch::scratch_dir;

/// A run of `epochs` epochs reaching `final_acc`.
fn fake_run(epochs: u32, final_acc: f64, loss_scale: f64) -> Vec<MetricsRecord> {
    (1..=epochs)
        .map(|e| {
            let t = f64::from(e);
            let correct = ((final_acc - 1.5 / t) * 100.0).round() as u64;
            MetricsRecord::new(
                e,
                loss_scale / t,
                0.8 * loss_scale / t,
                correct,
                10_000,
                2.5,
                24_000.0,
            )
        })
        .collect()
}

/// The polylines of `class` inside the series group labelled `label`.
fn polylines(svg: &str, label: &str, class: &str) -> Vec<String> {
    let needle = format!(r#"<g class="series" data-label="{label}""#);
    let polyline = format!(r#"<polyline class="{class}""#);
    svg.match_indices(&needle)
        .flat_map(|(start, _)| {
            let end = svg[start..].find("</g>").map_or(svg.len(), |e| start + e);
            svg[start..end]
                .lines()
                .filter(|l| l.starts_with(&polyline))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn plot_binary_overlays_files_labelled_by_stem() {
    let dir = scratch_dir("metrics-plot-bin");
    for (name, acc) in [("f32.jsonl", 99.2), ("fp8-comm.jsonl", 99.0)] {
        let mut w = MetricsWriter::create(dir.join(name)).unwrap();
        for m in fake_run(5, acc, 0.3) {
            w.write(&m).unwrap();
        }
    }
    let out = dir.join("plot.svg");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_mnist_plot"))
        .arg(dir.join("f32.jsonl"))
        .arg(dir.join("fp8-comm.jsonl"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(status.status.success(), "{status:?}");
    let svg = std::fs::read_to_string(&out).unwrap();
    assert_eq!(polylines(&svg, "f32", "train-loss").len(), 1);
    assert_eq!(polylines(&svg, "fp8-comm", "test-accuracy").len(), 1);
    // A bad file is reported with its name and a failing exit status.
    std::fs::write(dir.join("bad.jsonl"), "{oops\n").unwrap();
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_mnist_plot"))
        .arg(dir.join("bad.jsonl"))
        .arg("--out")
        .arg(dir.join("never.svg"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad.jsonl:1"));
    assert!(!dir.join("never.svg").exists());
    std::fs::remove_dir_all(dir).unwrap();
}
