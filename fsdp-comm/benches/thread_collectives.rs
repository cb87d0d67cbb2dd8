//! Throughput of the thread backend's collectives (CPU): 4 ranks, 1 Mi elements per rank.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fp8_core::Fp8Format;
use fp8_kernels::Device;
use fsdp_comm::{run_ranks, CommError, Communicator, RecvBuf, ReduceOp, SendBuf};
use std::time::{Duration, Instant};

const RANKS: usize = 4;
const LEN: usize = 1 << 20;

/// Runs `op` `iters` times on every rank and returns rank 0's elapsed time.
fn timed(iters: u64, op: impl Fn(&dyn Communicator) -> Result<(), CommError> + Sync) -> Duration {
    let times = run_ranks(RANKS, |comm| {
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            op(&comm)?;
        }
        Ok::<_, CommError>(t.elapsed())
    })
    .expect("benchmark ranks");
    times[0]
}

fn bench(c: &mut Criterion) {
    let d = Device::cpu();
    let mut g = c.benchmark_group("threads_4_ranks");
    g.sample_size(10);
    g.throughput(Throughput::Bytes((LEN * 4) as u64));
    g.bench_function("all_gather_f32_1Mi_per_rank", |b| {
        b.iter_custom(|iters| {
            timed(iters, |comm| {
                let x = d.upload(&vec![1.0f32; LEN])?;
                let mut y = d.zeros::<f32>(LEN * RANKS)?;
                comm.all_gather((&x).into(), (&mut y).into())
            })
        })
    });
    g.bench_function("reduce_scatter_f32_sum_4Mi_in", |b| {
        b.iter_custom(|iters| {
            timed(iters, |comm| {
                let x = d.upload(&vec![0.5f32; LEN * RANKS])?;
                let mut y = d.zeros::<f32>(LEN)?;
                comm.reduce_scatter((&x).into(), (&mut y).into(), ReduceOp::Sum)
            })
        })
    });
    g.throughput(Throughput::Bytes(LEN as u64));
    g.bench_function("reduce_scatter_e4m3_sum_4Mi_in", |b| {
        b.iter_custom(|iters| {
            timed(iters, |comm| {
                let x = d.upload(&vec![0x30u8; LEN * RANKS])?;
                let mut y = d.zeros::<u8>(LEN)?;
                comm.reduce_scatter(
                    SendBuf::fp8(&x, Fp8Format::E4M3),
                    RecvBuf::fp8(&mut y, Fp8Format::E4M3),
                    ReduceOp::Sum,
                )
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
