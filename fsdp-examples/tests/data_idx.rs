//! IDX reader and writer: round trips (plain and gzip) and clear errors for bad files.

mod scratch;

use scratch::scratch_dir;
use std::path::PathBuf;

use fsdp_examples::data::{
    encode_idx_u8, parse_idx_u8, read_idx_u8, write_idx_u8, DataError, IdxArray,
};
use proptest::prelude::*;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// A reference IDX encoder written from the format description, independent of the crate's.
fn reference_encode(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8, 0, 0x08, dims.len() as u8];
    for &d in dims {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

fn arb_array() -> impl Strategy<Value = IdxArray> {
    prop::collection::vec(0usize..6, 0..4).prop_flat_map(|dims| {
        let n: usize = dims.iter().product();
        prop::collection::vec(any::<u8>(), n).prop_map(move |data| IdxArray {
            dims: dims.clone(),
            data,
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn encode_matches_reference_and_parses_back(a in arb_array()) {
        let bytes = encode_idx_u8(&a).unwrap();
        prop_assert_eq!(&bytes, &reference_encode(&a.dims, &a.data));
        prop_assert_eq!(parse_idx_u8(&bytes, "mem").unwrap(), a.clone());
        prop_assert_eq!(parse_idx_u8(&gzip(&bytes), "mem.gz").unwrap(), a);
    }

    #[test]
    fn files_round_trip_plain_and_gzip(a in arb_array(), gz in any::<bool>()) {
        let dir = scratch_dir("idx-rt");
        let path = dir.join("x-idx");
        write_idx_u8(&path, &a, gz).unwrap();
        let raw = std::fs::read(&path).unwrap();
        prop_assert_eq!(raw.starts_with(&[0x1f, 0x8b]), gz);
        prop_assert_eq!(read_idx_u8(&path).unwrap(), a);
        // No temporary file is left behind.
        prop_assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn every_truncation_is_an_error(a in arb_array(), cut_fraction in 0.0f64..1.0) {
        let bytes = encode_idx_u8(&a).unwrap();
        let cut = ((bytes.len() as f64) * cut_fraction) as usize;
        prop_assume!(cut < bytes.len());
        let err = parse_idx_u8(&bytes[..cut], "cut-file").unwrap_err();
        prop_assert!(
            matches!(err, DataError::Truncated { .. } | DataError::Malformed { .. }),
            "{err}"
        );
        prop_assert!(err.to_string().contains("cut-file"), "{err}");
    }
}

#[test]
fn truncated_payload_reports_sizes() {
    let a = IdxArray::new(vec![3, 4], (0..12).collect()).unwrap();
    let bytes = encode_idx_u8(&a).unwrap();
    for source in [
        bytes[..bytes.len() - 5].to_vec(),
        gzip(&bytes[..bytes.len() - 5]),
    ] {
        match parse_idx_u8(&source, "images.idx").unwrap_err() {
            DataError::Truncated {
                path,
                expected,
                found,
            } => {
                assert_eq!(path, PathBuf::from("images.idx"));
                assert_eq!((expected, found), (12, 7));
            }
            e => panic!("expected Truncated, got {e}"),
        }
    }
}

#[test]
fn trailing_bytes_are_rejected() {
    let a = IdxArray::new(vec![2], vec![1, 2]).unwrap();
    let mut bytes = encode_idx_u8(&a).unwrap();
    bytes.extend_from_slice(&[9, 9, 9]);
    match parse_idx_u8(&bytes, "f").unwrap_err() {
        DataError::TrailingBytes {
            expected, extra, ..
        } => assert_eq!((expected, extra), (2, 3)),
        e => panic!("expected TrailingBytes, got {e}"),
    }
}

#[test]
fn bad_magic_and_foreign_types_are_malformed() {
    let cases: [(&[u8], &str); 4] = [
        (&[1, 0, 8, 1, 0, 0, 0, 0], "two zero bytes"),
        (&[0, 0, 0x0D, 1, 0, 0, 0, 0], "f32"),
        (&[0, 0, 0x42, 1, 0, 0, 0, 0], "unknown element type 0x42"),
        (&[0, 0, 8, 3, 0, 0, 0, 1], "3 dimensions"),
    ];
    for (bytes, needle) in cases {
        let err = parse_idx_u8(bytes, "weird.bin").unwrap_err();
        assert!(matches!(err, DataError::Malformed { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("weird.bin") && msg.contains(needle), "{msg}");
    }
    // A PNG is not IDX.
    let err = parse_idx_u8(b"\x89PNG\r\n\x1a\n", "pic.png").unwrap_err();
    assert!(matches!(err, DataError::Malformed { .. }), "{err}");
}

#[test]
fn corrupt_gzip_is_reported_as_such() {
    let a = IdxArray::new(vec![100], (0..100).collect()).unwrap();
    let mut gz = gzip(&encode_idx_u8(&a).unwrap());
    let mid = gz.len() / 2;
    for b in &mut gz[mid..mid + 4] {
        *b ^= 0xff;
    }
    let dir = scratch_dir("idx-gz");
    let path = dir.join("broken.gz");
    std::fs::write(&path, &gz).unwrap();
    let err = read_idx_u8(&path).unwrap_err();
    // Corrupt deflate data or a CRC mismatch: either way a gzip error that names the file.
    assert!(matches!(err, DataError::Gzip { .. }), "{err}");
    assert!(err.to_string().contains("broken.gz"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_file_names_the_fetch_command() {
    let dir = scratch_dir("idx-missing");
    let err = read_idx_u8(dir.join("train-images-idx3-ubyte")).unwrap_err();
    assert!(matches!(err, DataError::Missing { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("scripts/fetch-mnist.sh"), "{msg}");
    assert!(msg.contains("train-images-idx3-ubyte"), "{msg}");
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn writer_rejects_inconsistent_arrays() {
    let bad = IdxArray {
        dims: vec![2, 2],
        data: vec![0; 3],
    };
    assert!(encode_idx_u8(&bad).is_err());
    assert!(IdxArray::new(vec![2, 2], vec![0; 3]).is_err());
    let too_many_dims = IdxArray {
        dims: vec![1; 256],
        data: vec![7],
    };
    assert!(encode_idx_u8(&too_many_dims).is_err());
}
