//! CPU throughput of the cast kernels: amax, one-pass cast with amax, dequantize (criterion).

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use fp8_core::Fp8Format;
use fp8_kernels::{amax, cast_to_fp8, dequantize_fp8, AmaxSlot, Buffer, Device, FloatElement};
use half::bf16;
use std::hint::black_box;

/// The outputs of the one-pass cast benchmarks.
struct Cast<'a> {
    scale: &'a Buffer<f32>,
    out: &'a mut Buffer<u8>,
    amax: &'a mut Buffer<f32>,
}

impl Cast<'_> {
    /// Benchmarks the cast of `x` into E4M3 with its amax, as `name`.
    fn bench<T: FloatElement>(
        &mut self,
        g: &mut BenchmarkGroup<'_, WallTime>,
        name: &str,
        x: &Buffer<T>,
    ) {
        g.bench_function(name, |b| {
            b.iter(|| {
                let slot = Some(AmaxSlot::first(self.amax));
                cast_to_fp8(black_box(x), Fp8Format::E4M3, self.scale, self.out, slot).unwrap()
            })
        });
    }
}

fn cast_benches(c: &mut Criterion) {
    let n = 1 << 20;
    let dev = Device::cpu();
    let xs: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 300.0).collect();
    let xb: Vec<bf16> = xs.iter().map(|&v| bf16::from_f32(v)).collect();
    let x = dev.upload(&xs).unwrap();
    let xh = dev.upload(&xb).unwrap();
    let scale = dev.upload(&[1.0f32]).unwrap();
    let mut out = dev.zeros::<u8>(n).unwrap();
    let mut am = dev.zeros::<f32>(1).unwrap();
    let mut deq = dev.zeros::<f32>(n).unwrap();

    let mut g = c.benchmark_group("cpu_cast_1M");
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("amax_f32", |b| {
        b.iter(|| amax(black_box(&x), AmaxSlot::first(&mut am)).unwrap())
    });
    let mut cast = Cast {
        scale: &scale,
        out: &mut out,
        amax: &mut am,
    };
    cast.bench(&mut g, "cast_f32_e4m3_with_amax", &x);
    cast.bench(&mut g, "cast_bf16_e4m3_with_amax", &xh);
    g.bench_function("dequantize_e4m3_f32", |b| {
        b.iter(|| dequantize_fp8(black_box(&out), Fp8Format::E4M3, &scale, &mut deq).unwrap())
    });
    g.finish();
}

criterion_group!(benches, cast_benches);
criterion_main!(benches);
