//! Embeddings on CUDA against the CPU reference, bit for bit (forward output, token- and position-table
//! gradients added into random old values), on a GPT-2-sized batch with skewed ids (frequent ids take
//! several backward chunks) and on awkward shapes (d not a multiple of 8, one position per sequence), for
//! f32 and bf16 tables, outputs and gradients; and CUDA run twice gives the same bits.
//! GPU tests: ignored unless run with `--ignored` (`scripts/gpu-tests.sh`), and failing where no GPU can
//! be opened.

mod common;

use common::{
    bits, cuda_device, first_difference, join_differences, matches_cpu_and_deterministic,
};
use fp8_kernels::embedding::{
    embedding_backward, embedding_backward_at, embedding_forward, PositionGrad, PositionTable,
    RowGroups,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, Device, FloatElement};
use half::bf16;

struct Case {
    vocab: usize,
    d: usize,
    seq: usize,
    ids: Vec<i32>,
    table: Vec<f32>,
    pos: Vec<f32>,
    dy: Vec<f32>,
    old_table: Vec<f32>,
    old_pos: Vec<f32>,
}

/// `batch * seq` ids skewed towards small ids (u^3), so some ids repeat hundreds of times.
fn case(vocab: usize, d: usize, batch: usize, seq: usize, seed: u64) -> Case {
    let mut rng = SplitMix64::new(seed);
    let n = batch * seq;
    let mut vals = |k: usize| -> Vec<f32> { (0..k).map(|_| rng.uniform_f32()).collect() };
    let table = vals(vocab * d);
    let pos = vals(seq * d);
    let dy = vals(n * d);
    let old_table = vals(vocab * d);
    let old_pos = vals(seq * d);
    let mut rng = SplitMix64::new(seed ^ 0xABCD);
    let ids = (0..n)
        .map(|_| {
            let u = rng.unit_f32() as f64;
            ((u * u * u * vocab as f64) as usize).min(vocab - 1) as i32
        })
        .collect();
    Case {
        vocab,
        d,
        seq,
        ids,
        table,
        pos,
        dy,
        old_table,
        old_pos,
    }
}

fn up<T: FloatElement>(dev: &Device, v: &[f32]) -> Buffer<T> {
    dev.upload(&v.iter().map(|&a| T::from_f32(a)).collect::<Vec<_>>())
        .unwrap()
}

/// Forward output, token-table gradient, position-table gradient, and the token-table gradient added at
/// an offset of a larger buffer (`embedding_backward_at`, the whole buffer).
fn run<T: FloatElement, D: FloatElement>(dev: &Device, c: &Case) -> [Vec<u32>; 4] {
    let n = c.ids.len();
    let g = RowGroups::from_ids(dev, &c.ids, c.vocab).unwrap();
    let table = up::<T>(dev, &c.table);
    let pos = up::<T>(dev, &c.pos);
    let mut out: Buffer<D> = dev.zeros(n * c.d).unwrap();
    embedding_forward(
        &table,
        c.d,
        Some(PositionTable {
            table: &pos,
            seq: c.seq,
        }),
        &g,
        &mut out,
    )
    .unwrap();
    let dy = up::<T>(dev, &c.dy);
    let mut dt = up::<D>(dev, &c.old_table);
    let mut dp = up::<D>(dev, &c.old_pos);
    embedding_backward(
        &dy,
        c.d,
        &g,
        &mut dt,
        Some(PositionGrad {
            grad: &mut dp,
            seq: c.seq,
        }),
    )
    .unwrap();
    let (before, after) = (37, 11);
    let flat: Vec<f32> = (0..before)
        .map(|i| i as f32 * 0.25)
        .chain(c.old_table.iter().copied())
        .chain((0..after).map(|i| -(i as f32)))
        .collect();
    let mut at = up::<D>(dev, &flat);
    embedding_backward_at(&dy, c.d, &g, (&mut at, before), None).unwrap();
    [bits(&out), bits(&dt), bits(&dp), bits(&at)]
}

fn compare<T: FloatElement, D: FloatElement>(gpu: &Device, c: &Case, what: &str) -> bool {
    let cpu = run::<T, D>(&Device::cpu(), c);
    let g1 = run::<T, D>(gpu, c);
    let g2 = run::<T, D>(gpu, c);
    matches_cpu_and_deterministic(what, &cpu, &g1, &g2, |a, b| {
        join_differences(
            ["forward", "d_table", "d_pos", "d_table at an offset"]
                .iter()
                .zip(a.iter().zip(b))
                .map(|(name, (a, b))| first_difference(name, a, b)),
        )
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu_bitwise_and_is_deterministic() {
    let gpu = cuda_device();
    let cases = [
        ("GPT-2 batch 8 x 1024, d 768", case(50304, 768, 8, 1024, 1)),
        ("d 13", case(1000, 13, 4, 64, 2)),
        ("one position per sequence", case(50, 40, 300, 1, 3)),
    ];
    let mut ok = true;
    for (what, c) in &cases {
        ok &= compare::<bf16, f32>(&gpu, c, &format!("{what}: bf16 table, f32 grads"));
        ok &= compare::<f32, f32>(&gpu, c, &format!("{what}: f32"));
        ok &= compare::<bf16, bf16>(&gpu, c, &format!("{what}: bf16"));
        ok &= compare::<f32, bf16>(&gpu, c, &format!("{what}: f32 table, bf16 grads"));
    }
    assert!(ok, "CUDA differs from the CPU or between runs (see above)");
}
