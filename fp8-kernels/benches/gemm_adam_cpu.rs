//! CPU throughput of the F32 GEMM (single-threaded and rayon) and of the fused Adam step (criterion).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fp8_kernels::adam::{adam_step_low_precision, AmaxSlots};
use fp8_kernels::gemm::gemm_f32;
use fp8_kernels::{AdamConfig, CpuParallelism, Device, GemmSpec, LowPrecisionAdamState, Transpose};
use half::{bf16, f16};
use std::hint::black_box;

fn gemm_benches(c: &mut Criterion) {
    let dev = Device::cpu();
    let s = 512;
    let a = dev.upload(&vec![0.5f32; s * s]).unwrap();
    let b = dev.upload(&vec![0.25f32; s * s]).unwrap();
    let mut out = dev.zeros::<f32>(s * s).unwrap();
    let mut g = c.benchmark_group("cpu_gemm_f32_512");
    g.throughput(Throughput::Elements((2 * s * s * s) as u64)); // "elements" = FLOPs
    for (name, p) in [
        ("single", CpuParallelism::Single),
        ("rayon", CpuParallelism::Rayon(0)),
    ] {
        let spec = GemmSpec::new(s, s, s)
            .transposes(Transpose::No, Transpose::Yes)
            .parallelism(p);
        g.bench_function(name, |bn| {
            bn.iter(|| gemm_f32(&spec, black_box(&a), black_box(&b), &mut out).unwrap())
        });
    }
    g.finish();
}

fn adam_benches(c: &mut Criterion) {
    let dev = Device::cpu();
    let n = 1 << 20;
    let coef = AdamConfig::default().coefficients(10, 1.0).unwrap();
    let grad = dev.upload(&vec![bf16::from_f32(0.01); n]).unwrap();
    let mut master = dev.upload(&vec![f16::from_f32(0.5); n]).unwrap();
    let mut m = dev.zeros::<u8>(n).unwrap();
    let mut v = dev.zeros::<f16>(n).unwrap();
    let scales = dev.upload(&[1.0f32; 6]).unwrap();
    let mut amax = dev.zeros::<f32>(3).unwrap();
    let mut g = c.benchmark_group("cpu_adam_1M");
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("low_precision_bf16_grad", |b| {
        b.iter(|| {
            let slots = AmaxSlots {
                buffer: &mut amax,
                base: 0,
            };
            let state = LowPrecisionAdamState {
                master: &mut master,
                m: &mut m,
                v: &mut v,
            };
            adam_step_low_precision(&coef, 0..n, state, black_box(&grad), &scales, 0, slots)
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, gemm_benches, adam_benches);
criterion_main!(benches);
