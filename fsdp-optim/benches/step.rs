//! One optimizer step on one thread rank (CPU): a 1024x1024 FP8 weight and its bias, F32 and
//! low-precision states (parameters per second).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fsdp_comm::{Communicator, ThreadGroup, DEFAULT_THREAD_TIMEOUT};
use fsdp_optim::{AdamOptions, FsdpAdamW, OptimError, StatePrecision};
use fsdp_shard::{FsdpConfig, ModelLayout, ParamKind, ParamSpec, ShardedModel, WrapPolicy};
use std::sync::Arc;

const N: usize = 1024;

fn step(c: &mut Criterion) {
    let layout = Arc::new(
        ModelLayout::new(
            vec![
                ParamSpec::new("fc", "weight", &[N, N], ParamKind::Fp8Weight),
                ParamSpec::new("fc", "bias", &[N], ParamKind::Plain),
            ],
            &WrapPolicy::Single,
        )
        .expect("layout"),
    );
    let mut g = c.benchmark_group("fsdp_adamw_step");
    g.throughput(Throughput::Elements((N * N + N) as u64));
    g.sample_size(20);
    for precision in [StatePrecision::F32, StatePrecision::LowPrecision] {
        // World size 1 runs on this thread (criterion's state cannot cross threads).
        let mut run = || {
            let comm = ThreadGroup::new(1, DEFAULT_THREAD_TIMEOUT)?
                .pop()
                .expect("one rank");
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let init = |p: usize| {
                let n = if p == 0 { N * N } else { N };
                (0..n).map(|i| ((i as f32) * 0.37).sin() * 0.1).collect()
            };
            let (mut model, masters) =
                ShardedModel::new(layout.clone(), comm, FsdpConfig::default(), &init)?;
            let options = AdamOptions {
                state_precision: precision,
                ..AdamOptions::adamw()
            };
            let mut opt = FsdpAdamW::new(&model, masters, options)?;
            let grads: Vec<Vec<f32>> = (0..2)
                .map(|k| {
                    let n = model.unit(0).expect("unit").grads[k].len();
                    (0..n).map(|i| ((i as f32) * 0.11).cos() * 0.01).collect()
                })
                .collect();
            g.bench_function(BenchmarkId::new("step", format!("{precision:?}")), |b| {
                b.iter(|| {
                    for (k, grad) in grads.iter().enumerate() {
                        let s = model.unit_mut(0).expect("unit");
                        s.grads[k].copy_from_host(grad).expect("grads");
                    }
                    opt.step(&mut model).expect("step")
                })
            });
            Ok::<_, OptimError>(())
        };
        run().expect("bench");
    }
    g.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
