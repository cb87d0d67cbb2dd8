//! Encode/decode throughput of the slice paths (elements per second).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fp8_core::Fp8Format;
use std::hint::black_box;

fn codec(c: &mut Criterion) {
    let n = 1 << 22;
    let src: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.618).sin() * 500.0).collect();
    let mut bytes = vec![0u8; n];
    let mut back = vec![0f32; n];
    let mut g = c.benchmark_group("fp8_codec");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(20);
    for f in Fp8Format::ALL {
        g.bench_with_input(BenchmarkId::new("encode_scaled", f), &f, |b, &f| {
            b.iter(|| f.encode_scaled(black_box(&src), 0.5, &mut bytes))
        });
        g.bench_with_input(
            BenchmarkId::new("encode_scaled_with_amax", f),
            &f,
            |b, &f| b.iter(|| f.encode_scaled_with_amax(black_box(&src), 0.5, &mut bytes)),
        );
        g.bench_with_input(BenchmarkId::new("decode_scaled", f), &f, |b, &f| {
            b.iter(|| f.decode_scaled(black_box(&bytes), 2.0, &mut back))
        });
    }
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
