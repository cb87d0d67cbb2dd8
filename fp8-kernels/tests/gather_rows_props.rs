//! Property tests of `gather_rows` against a sequential reference, the CUDA implementation against the CPU
//! one (bit for bit; needs a CUDA GPU: ignored unless run with `--ignored`), and an NVRTC compile check of
//! its module (ignored where the build found no NVRTC).

mod common;

use common::{cuda_device, nvrtc_test, sm90_ptx};
use fp8_kernels::gather_rows::{gather_rows, RowIndex};
use fp8_kernels::kernel_source::GATHER_ROWS_MODULE;
use fp8_kernels::Device;
use proptest::prelude::*;

/// A table (`rows` x `row_len`), indices into it (repeats allowed) and a sub-range of them.
fn case() -> impl Strategy<Value = (usize, Vec<f32>, Vec<usize>, std::ops::Range<usize>)> {
    (1usize..40, 1usize..50).prop_flat_map(|(rows, row_len)| {
        (
            Just(row_len),
            prop::collection::vec(-1e6f32..1e6, rows * row_len),
            prop::collection::vec(0..rows, 0..60),
        )
            .prop_flat_map(|(row_len, table, idx)| {
                let n = idx.len();
                (Just(row_len), Just(table), Just(idx), 0..=n, 0..=n)
                    .prop_map(|(rl, t, i, a, b)| (rl, t, i, a.min(b)..a.max(b)))
            })
    })
}

fn reference(
    table: &[f32],
    row_len: usize,
    idx: &[usize],
    range: std::ops::Range<usize>,
) -> Vec<f32> {
    let mut out = Vec::new();
    for &i in &idx[range] {
        out.extend_from_slice(&table[i * row_len..(i + 1) * row_len]);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn cpu_gather_matches_reference((row_len, table, idx, range) in case()) {
        let dev = Device::cpu();
        let rows = table.len() / row_len;
        let index = RowIndex::new(&dev, &idx, rows).unwrap();
        let src = dev.upload(&table).unwrap();
        let mut out = dev.zeros::<f32>(range.len() * row_len).unwrap();
        gather_rows(&src, row_len, &index, range.clone(), &mut out).unwrap();
        prop_assert_eq!(out.to_vec().unwrap(), reference(&table, row_len, &idx, range));
    }

    #[test]
    fn out_of_range_index_is_rejected(rows in 1usize..50, extra in 0usize..5, at in 0usize..10) {
        let dev = Device::cpu();
        let mut idx = vec![0usize; 10];
        idx[at] = rows + extra;
        prop_assert!(RowIndex::new(&dev, &idx, rows).is_err());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_gather_matches_cpu() {
    let gpu = cuda_device();
    let cpu = Device::cpu();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(&case(), |(row_len, table, idx, range)| {
            let rows = table.len() / row_len;
            let mut want = cpu.zeros::<f32>(range.len() * row_len).unwrap();
            let ci = RowIndex::new(&cpu, &idx, rows).unwrap();
            gather_rows(
                &cpu.upload(&table).unwrap(),
                row_len,
                &ci,
                range.clone(),
                &mut want,
            )
            .unwrap();
            let gi = RowIndex::new(&gpu, &idx, rows).unwrap();
            let mut got = gpu.zeros::<f32>(range.len() * row_len).unwrap();
            gather_rows(
                &gpu.upload(&table).unwrap(),
                row_len,
                &gi,
                range.clone(),
                &mut got,
            )
            .unwrap();
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            prop_assert_eq!(bits(got.to_vec().unwrap()), bits(want.to_vec().unwrap()));
            // Labels: i32 rows of length 1.
            let labels: Vec<i32> = (0..rows as i32).map(|v| v * 7 - 3).collect();
            let mut gl = gpu.zeros::<i32>(range.len()).unwrap();
            gather_rows(
                &gpu.upload(&labels).unwrap(),
                1,
                &gi,
                range.clone(),
                &mut gl,
            )
            .unwrap();
            let wl: Vec<i32> = idx[range].iter().map(|&i| labels[i]).collect();
            prop_assert_eq!(gl.to_vec().unwrap(), wl);
            Ok(())
        })
        .unwrap();
}

nvrtc_test! {
    fn gather_rows_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&GATHER_ROWS_MODULE);
        assert!(
            ptx.contains(".entry gather_rows_b32"),
            "kernel entry missing"
        );
    }
}
