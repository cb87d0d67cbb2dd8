//! The `mnist_csv_to_idx` binary end to end on a small CSV.

mod scratch;

use scratch::scratch_dir;
use std::process::Command;

use fsdp_examples::data::{MnistDataset, MnistSplit};

fn csv_of(data: &MnistDataset) -> String {
    let mut text = String::from("label");
    for i in 0..784 {
        text.push_str(&format!(",{}x{}", i / 28 + 1, i % 28 + 1));
    }
    text.push('\n');
    for i in 0..data.len() {
        text.push_str(&data.label(i).unwrap().to_string());
        for p in data.image(i).unwrap() {
            text.push_str(&format!(",{p}"));
        }
        text.push('\n');
    }
    text
}

#[test]
fn converts_checks_counts_and_takes_subsets() {
    let source = MnistDataset::load(
        fsdp_examples::data::committed_subset_dir(),
        MnistSplit::Test,
    )
    .unwrap()
    .first(30)
    .unwrap();
    let dir = scratch_dir("convert");
    std::fs::write(dir.join("test.csv"), csv_of(&source)).unwrap();
    let bin = env!("CARGO_BIN_EXE_mnist_csv_to_idx");

    let out = Command::new(bin)
        .args(["--test-csv", dir.join("test.csv").to_str().unwrap()])
        .args([
            "--expect-test",
            "30",
            "--out",
            dir.join("idx").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("test split: 30 digits"));
    assert_eq!(
        MnistDataset::load(dir.join("idx"), MnistSplit::Test).unwrap(),
        source
    );

    let out = Command::new(bin)
        .args(["--test-csv", dir.join("test.csv").to_str().unwrap()])
        .args([
            "--first-test",
            "7",
            "--gzip",
            "--out",
            dir.join("gz").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(dir.join("gz/t10k-labels-idx1-ubyte.gz").is_file());
    assert_eq!(
        MnistDataset::load(dir.join("gz"), MnistSplit::Test).unwrap(),
        source.first(7).unwrap()
    );

    // A wrong count fails and says so.
    let out = Command::new(bin)
        .args(["--test-csv", dir.join("test.csv").to_str().unwrap()])
        .args([
            "--expect-test",
            "10000",
            "--out",
            dir.join("bad").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("30 digits, expected 10000"));

    // A gzip archive given as the CSV: an error naming the file, without echoing its bytes.
    let gz = dir.join("gz/t10k-images-idx3-ubyte.gz");
    let out = Command::new(bin)
        .args(["--test-csv", gz.to_str().unwrap()])
        .args(["--out", dir.join("bad").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).expect("stderr is text");
    assert!(
        stderr.contains("t10k-images-idx3-ubyte.gz:1:") && stderr.contains("not a CSV text file"),
        "{stderr}"
    );
    assert!(
        stderr
            .chars()
            .all(|c| c == '\n' || (c.is_ascii() && !c.is_ascii_control())),
        "{stderr:?}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
