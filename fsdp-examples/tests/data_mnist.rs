//! The MNIST dataset: the committed real subset, normalisation, batches and the CSV reader.

mod scratch;

use scratch::scratch_dir;
use std::path::PathBuf;

use fsdp_examples::data::{
    check_mnist_files, committed_subset_dir, normalize_pixel, parse_mnist_csv, DataError,
    MnistDataset, MnistSplit, MNIST_MEAN, MNIST_STD,
};
use proptest::prelude::*;

#[test]
fn committed_subset_is_real_mnist() {
    let train = MnistDataset::load(committed_subset_dir(), MnistSplit::Train).unwrap();
    let test = MnistDataset::load(committed_subset_dir(), MnistSplit::Test).unwrap();
    assert_eq!((train.len(), test.len()), (4000, 1000));
    assert_eq!((train.rows(), train.cols()), (28, 28));
    // The first digits of MNIST in its published order.
    assert_eq!(&train.labels()[..10], &[5, 0, 4, 1, 9, 2, 1, 3, 1, 4]);
    assert_eq!(&test.labels()[..10], &[7, 2, 1, 0, 4, 1, 4, 9, 5, 9]);
    for data in [&train, &test] {
        let s = data.summary();
        assert_eq!(s.label_histogram.iter().sum::<usize>(), data.len());
        // Every class is well represented (MNIST classes are 9-11% each).
        assert!(
            s.label_histogram.iter().all(|&c| c * 100 >= data.len() * 8),
            "{s:?}"
        );
        assert_eq!((s.min_pixel, s.max_pixel), (0, 255));
        // The pixel statistics PyTorch normalises with, within a subset's spread.
        assert!((s.mean - f64::from(MNIST_MEAN)).abs() < 0.015, "{s:?}");
        assert!((s.std - f64::from(MNIST_STD)).abs() < 0.015, "{s:?}");
        // Digits are mostly background: every image has ink, none is full.
        for i in 0..data.len() {
            let ink = data.image(i).unwrap().iter().filter(|&&p| p > 128).count();
            assert!((20..500).contains(&ink), "digit {i} has {ink} ink pixels");
        }
    }
}

/// The full data (data/mnist of the repository, written by `scripts/fetch-mnist.sh`; not in CI).
#[test]
#[ignore = "needs data/mnist (scripts/fetch-mnist.sh)"]
fn full_mnist_when_fetched() {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data/mnist"));
    assert!(
        dir.join("train-labels-idx1-ubyte").exists()
            || dir.join("train-labels-idx1-ubyte.gz").exists(),
        "{} has no MNIST (run scripts/fetch-mnist.sh)",
        dir.display()
    );
    let train = MnistDataset::load(&dir, MnistSplit::Train).unwrap();
    let test = MnistDataset::load(&dir, MnistSplit::Test).unwrap();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    let s = train.summary();
    // The published class counts of the MNIST training set.
    assert_eq!(
        s.label_histogram,
        [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    );
    assert!(
        (s.mean - 0.1307).abs() < 5e-5 && (s.std - 0.3081).abs() < 5e-5,
        "{s:?}"
    );
    // The committed subset is the head of the full data.
    let subset = MnistDataset::load(committed_subset_dir(), MnistSplit::Train).unwrap();
    assert_eq!(subset, train.first(4000).unwrap());
}

#[test]
fn missing_directory_names_the_fetch_command() {
    let dir = scratch_dir("mnist-missing");
    let err = MnistDataset::load(&dir, MnistSplit::Test).unwrap_err();
    assert!(matches!(err, DataError::Missing { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("scripts/fetch-mnist.sh") && msg.contains("t10k-images-idx3-ubyte"),
        "{msg}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mismatched_or_foreign_files_are_not_mnist() {
    let dir = scratch_dir("mnist-mismatch");
    let data = MnistDataset::from_raw(vec![1; 3 * 4], vec![0, 1, 2], 2, 2).unwrap();
    data.write_idx(&dir, MnistSplit::Train, false).unwrap();
    // Replace the labels with a file of two labels.
    let short = MnistDataset::from_raw(vec![1; 2 * 4], vec![0, 1], 2, 2).unwrap();
    let other = scratch_dir("mnist-mismatch-src");
    let (_, labels) = short.write_idx(&other, MnistSplit::Train, false).unwrap();
    std::fs::copy(&labels, dir.join("train-labels-idx1-ubyte")).unwrap();
    let err = MnistDataset::load(&dir, MnistSplit::Train).unwrap_err();
    assert!(matches!(err, DataError::NotMnist { .. }), "{err}");
    assert!(
        err.to_string().contains("2 labels for the 3 images"),
        "{err}"
    );
    // Labels where images are expected: wrong dimensionality.
    std::fs::copy(&labels, dir.join("train-images-idx3-ubyte")).unwrap();
    let err = MnistDataset::load(&dir, MnistSplit::Train).unwrap_err();
    assert!(err.to_string().contains("3 dimensions"), "{err}");
    for d in [dir, other] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn gzip_and_plain_files_load_the_same() {
    let data = MnistDataset::load(committed_subset_dir(), MnistSplit::Test)
        .unwrap()
        .first(50)
        .unwrap();
    let dir = scratch_dir("mnist-forms");
    data.write_idx(dir.join("plain"), MnistSplit::Test, false)
        .unwrap();
    data.write_idx(dir.join("gz"), MnistSplit::Test, true)
        .unwrap();
    assert!(dir.join("gz/t10k-images-idx3-ubyte.gz").is_file());
    assert_eq!(
        MnistDataset::load(dir.join("plain"), MnistSplit::Test).unwrap(),
        data
    );
    assert_eq!(
        MnistDataset::load(dir.join("gz"), MnistSplit::Test).unwrap(),
        data
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn normalisation_matches_pytorch_formula() {
    // ToTensor: p / 255 in f32; Normalize: (x - mean) / std in f32.
    for p in 0..=255u8 {
        let expected = (p as f32 / 255.0 - 0.1307f32) / 0.3081f32;
        assert_eq!(normalize_pixel(p).to_bits(), expected.to_bits());
    }
    assert!((normalize_pixel(0) - (-0.424_212_9)).abs() < 1e-6);
    assert!((normalize_pixel(255) - 2.821_486_5).abs() < 1e-5);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fill_batch_is_nchw_normalised(
        indices in prop::collection::vec(0usize..1000, 1..40)
    ) {
        let data = MnistDataset::load(committed_subset_dir(), MnistSplit::Test).unwrap();
        let p = 28 * 28;
        let mut images = vec![f32::NAN; indices.len() * p];
        let mut labels = vec![-1i32; indices.len()];
        data.fill_batch(&indices, &mut images, &mut labels).unwrap();
        for (b, &i) in indices.iter().enumerate() {
            prop_assert_eq!(labels[b], i32::from(data.labels()[i]));
            for y in 0..28 {
                for x in 0..28 {
                    // NCHW with C = 1: element (b, 0, y, x).
                    let got = images[b * p + y * 28 + x];
                    let raw = data.images()[i * p + y * 28 + x];
                    let want = (f64::from(raw) / 255.0 - 0.1307) / 0.3081;
                    prop_assert!((f64::from(got) - want).abs() < 1e-5);
                }
            }
        }
        let all = data.normalized_images();
        for (b, &i) in indices.iter().enumerate() {
            prop_assert_eq!(&images[b * p..(b + 1) * p], &all[i * p..(i + 1) * p]);
        }
    }

    #[test]
    fn csv_round_trips(
        n in 1usize..6,
        rows in 1usize..5,
        cols in 1usize..5,
        seed in any::<u64>(),
        header in any::<bool>(),
        crlf in any::<bool>(),
    ) {
        let mut state = seed;
        let mut next = || { state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (state >> 33) as u32 };
        let labels: Vec<u8> = (0..n).map(|_| (next() % 10) as u8).collect();
        let images: Vec<u8> = (0..n * rows * cols).map(|_| (next() % 256) as u8).collect();
        let eol = if crlf { "\r\n" } else { "\n" };
        let mut text = String::new();
        if header {
            text.push_str("label");
            for c in 0..rows * cols { text.push_str(&format!(",{}x{}", c / cols + 1, c % cols + 1)); }
            text.push_str(eol);
        }
        for (k, &l) in labels.iter().enumerate() {
            text.push_str(&l.to_string());
            for &v in &images[k * rows * cols..(k + 1) * rows * cols] { text.push_str(&format!(",{v}")); }
            text.push_str(eol);
        }
        let data = parse_mnist_csv(text.as_bytes(), "x.csv", rows, cols).unwrap();
        prop_assert_eq!(data, MnistDataset::from_raw(images, labels, rows, cols).unwrap());
    }
}

#[test]
fn batch_errors_are_typed() {
    let data = MnistDataset::from_raw(vec![0; 2 * 4], vec![3, 4], 2, 2).unwrap();
    let mut images = vec![0f32; 8];
    let mut labels = vec![0i32; 2];
    assert!(data.fill_batch(&[0, 2], &mut images, &mut labels).is_err());
    assert!(data.fill_batch(&[0], &mut images, &mut labels).is_err());
    assert!(data
        .fill_batch(&[0, 1], &mut images[..7], &mut labels)
        .is_err());
    data.fill_batch(&[1, 0], &mut images, &mut labels).unwrap();
    assert_eq!(labels, [4, 3]);
    assert!(MnistDataset::from_raw(vec![0; 4], vec![10], 2, 2).is_err());
    assert!(MnistDataset::from_raw(vec![0; 5], vec![1], 2, 2).is_err());
    assert!(data.subset(&[1, 5]).is_err());
    assert_eq!(data.subset(&[1, 1]).unwrap().labels(), &[4, 4]);
    assert!(data.first(0).is_err());
}

#[test]
fn csv_errors_name_file_and_line() {
    let cases: [(&str, &str); 5] = [
        ("1,2,3,4,5\n1,2,3\n", ":2: 3 fields, expected 5"),
        ("1,2,3,4,5\n12,0,0,0,0\n", ":2: label 12"),
        ("1,2,3,4,5\n3,0,0,256,0\n", ":2: pixel 3 is \"256\""),
        ("1,2,3,4,5,6\n", ":1: more than the 5 fields"),
        ("label,a,b,c,d\n", "no data lines"),
    ];
    for (text, needle) in cases {
        let err = parse_mnist_csv(text.as_bytes(), "digits.csv", 2, 2).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("digits.csv") && msg.contains(needle),
            "{msg} lacks {needle}"
        );
    }
    // A non-numeric label after the first line is an error, not a second header.
    let err = parse_mnist_csv(b"1,0,0,0,0\nx,0,0,0,0\n", "d.csv", 2, 2).unwrap_err();
    assert!(err.to_string().contains("d.csv:2"), "{err}");
}

#[test]
fn missing_files_are_each_named() {
    let dir = scratch_dir("mnist-some-missing");
    let data = MnistDataset::load(committed_subset_dir(), MnistSplit::Test)
        .unwrap()
        .first(5)
        .unwrap();
    data.write_idx(&dir, MnistSplit::Train, true).unwrap();
    let err = check_mnist_files(&dir).unwrap_err();
    assert!(err.is_missing(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("t10k-images-idx3-ubyte")
            && msg.contains("t10k-labels-idx1-ubyte")
            && !msg.contains("train-")
            && msg.contains("scripts/fetch-mnist.sh"),
        "{msg}"
    );
    data.write_idx(&dir, MnistSplit::Test, false).unwrap();
    check_mnist_files(&dir).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_directory_in_place_of_a_file_is_not_called_missing() {
    let dir = scratch_dir("mnist-dir-as-file");
    let data = MnistDataset::load(committed_subset_dir(), MnistSplit::Test)
        .unwrap()
        .first(5)
        .unwrap();
    data.write_idx(&dir, MnistSplit::Test, false).unwrap();
    let images = dir.join("t10k-images-idx3-ubyte");
    std::fs::remove_file(&images).unwrap();
    std::fs::create_dir(&images).unwrap();
    for err in [
        MnistDataset::load(&dir, MnistSplit::Test).unwrap_err(),
        check_mnist_files(&dir).unwrap_err(),
    ] {
        assert!(matches!(err, DataError::NotAFile { .. }), "{err}");
        assert!(!err.is_missing());
        let msg = err.to_string();
        assert!(
            msg.contains("t10k-images-idx3-ubyte") && msg.contains("is a directory"),
            "{msg}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn images_of_another_size_are_refused_naming_the_file() {
    let dir = scratch_dir("mnist-27");
    let data = MnistDataset::from_raw(vec![7; 3 * 27 * 27], vec![1, 2, 3], 27, 27).unwrap();
    data.write_idx(&dir, MnistSplit::Train, false).unwrap();
    let err = MnistDataset::load(&dir, MnistSplit::Train).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("train-images-idx3-ubyte") && msg.contains("27x27") && msg.contains("28x28"),
        "{msg}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn binary_input_is_not_echoed_in_csv_errors() {
    // A gzip archive given as CSV, and binary bytes inside a pixel field.
    let mut gz = vec![0x1f, 0x8b, 0x08, 0x00, 0xff, 0xfe, b'\n', 0x80, 0x81];
    gz.extend_from_slice(b",1,2\n");
    let msg = parse_mnist_csv(&gz, "train.csv.gz", 2, 2)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("train.csv.gz:1:") && msg.contains("not a CSV text file"),
        "{msg}"
    );
    assert!(msg.contains("gzip"), "{msg}");
    assert!(
        msg.chars().all(|c| c.is_ascii() && !c.is_ascii_control()),
        "{msg:?}"
    );
    let msg = parse_mnist_csv(b"1,0,0,0,0\n1,0,\x00\xff,0,0\n", "d.csv", 2, 2)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("d.csv:2:") && msg.contains("byte 0x00"),
        "{msg}"
    );
    assert!(!msg.contains('\u{fffd}') && !msg.contains('\0'), "{msg:?}");
    // A long bad field is cut short; a byte-order mark is fine.
    let long = format!("1,0,0,0,0\n1,0,{},0,0\n", "9".repeat(500));
    let msg = parse_mnist_csv(long.as_bytes(), "d.csv", 2, 2)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("(500 characters)") && msg.len() < 200, "{msg}");
    let bom = b"\xef\xbb\xbflabel,a,b,c,d\n3,0,1,2,255\n";
    assert_eq!(
        parse_mnist_csv(bom, "bom.csv", 2, 2).unwrap().labels(),
        &[3]
    );
}
