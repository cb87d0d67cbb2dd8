//! The thread backend against a sequential reference, for every collective and element type, plus the
//! failure cases (bad input, panics, missing ranks).
//!
//! The reference computes each reduction step in f64 and rounds once to the element type (for FP8:
//! f64 -> f16 -> FP8), an independent route to the same correctly rounded per-step results; the order
//! of the steps is the crate's `ring_order` (the single definition of the order).

mod common;

use common::{decode, Buf, Kind, KINDS};
use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::Device;
use fsdp_comm::ring::{chunk_range, fp8_unit_roundoff, ring_order};
use fsdp_comm::{
    run_ranks, run_ranks_each, run_ranks_failures, run_ranks_timeout, CommDType, CommError,
    Communicator, RecvBuf, ReduceOp, SendBuf,
};
use half::{bf16, f16};
use proptest::prelude::*;
use std::time::Duration;

/// Never below 5 s in CI, so a loaded machine does not turn slowness into failures.
const TIMEOUT: Duration = Duration::from_secs(5);
/// For tests that must not time out at all.
const LONG: Duration = Duration::from_secs(60);

const REDUCIBLE: [Kind; 5] = [
    Kind::F32,
    Kind::BF16,
    Kind::F16,
    Kind::Fp8(Fp8Format::E4M3),
    Kind::Fp8(Fp8Format::E5M2),
];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

/// The workspace generator (SplitMix64) with this file's own float mapping on top: reproducible
/// values from a proptest seed.
struct Rng(SplitMix64);
impl Rng {
    /// A float spread over magnitudes 2^-10 .. 2^10, either sign, sometimes exactly zero.
    fn float(&mut self) -> f32 {
        let r = self.0.next_u64();
        if r % 17 == 0 {
            return 0.0;
        }
        let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
        let e = ((r >> 8) % 21) as i32 - 10;
        let frac = ((r >> 16) % 1_000_000) as f32 / 1_000_000.0;
        sign * (1.0 + frac) * (e as f32).exp2()
    }
}

/// Raw bits of `len` random elements of `kind`.
fn random_bits(kind: Kind, len: usize, rng: &mut Rng) -> Vec<u32> {
    (0..len)
        .map(|_| match kind {
            Kind::F32 => rng.float().to_bits(),
            Kind::BF16 => bf16::from_f32(rng.float()).to_bits() as u32,
            Kind::F16 => f16::from_f32(rng.float()).to_bits() as u32,
            Kind::Bytes | Kind::Fp8(_) => (rng.0.next_u64() & 0xFF) as u32,
        })
        .collect()
}

/// Round an f64 to the element type, once (FP8: through f16, saturating, as NCCL does).
fn round(kind: Kind, x: f64) -> u32 {
    match kind {
        Kind::F32 => (x as f32).to_bits(),
        Kind::BF16 => bf16::from_f64(x).to_bits() as u32,
        Kind::F16 => f16::from_f64(x).to_bits() as u32,
        Kind::Fp8(f) => f.encode(f16::from_f64(x).to_f32()) as u32,
        Kind::Bytes => x as u32,
    }
}

fn reference_step(kind: Kind, op: ReduceOp, a: u32, b: u32) -> u32 {
    let (x, y) = (decode(kind, a), decode(kind, b));
    let v = match op {
        ReduceOp::Sum => x + y,
        ReduceOp::Max | ReduceOp::Min if x.is_nan() => y,
        ReduceOp::Max | ReduceOp::Min if y.is_nan() => x,
        ReduceOp::Max => x.max(y),
        ReduceOp::Min => x.min(y),
    };
    round(kind, v)
}

/// Sequential reference of element `i` along chunk `chunk`'s ring order.
fn reference_reduce(kind: Kind, op: ReduceOp, inputs: &[Vec<u32>], chunk: usize, i: usize) -> u32 {
    let mut order = ring_order(chunk, inputs.len());
    let mut acc = inputs[order.next().unwrap()][i];
    for r in order {
        acc = reference_step(kind, op, acc, inputs[r][i]);
    }
    acc
}

/// Same value (NaN equals NaN; for max/min also -0 equals +0, whose choice IEEE leaves open).
fn same(kind: Kind, op: Option<ReduceOp>, a: u32, b: u32) -> bool {
    if a == b || kind == Kind::Bytes {
        return a == b;
    }
    let (x, y) = (decode(kind, a), decode(kind, b));
    (x.is_nan() && y.is_nan()) || (matches!(op, Some(ReduceOp::Max | ReduceOp::Min)) && x == y)
}

fn assert_same(kind: Kind, op: Option<ReduceOp>, got: &[u32], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            same(kind, op, *g, *w),
            "{what} ({kind:?}, {op:?}): element {i}: got {} ({g:#x}), want {} ({w:#x})",
            decode(kind, *g),
            decode(kind, *w)
        );
    }
}

fn inputs_for(kind: Kind, n: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = Rng(SplitMix64::new(seed));
    (0..n).map(|_| random_bits(kind, len, &mut rng)).collect()
}

/// Which collective a property test runs.
#[derive(Debug, Clone, Copy)]
enum Call {
    AllGather,
    ReduceScatter(ReduceOp),
    AllReduce(ReduceOp),
    AllReduceInPlace(ReduceOp),
    Broadcast(usize),
    BroadcastInPlace(usize),
}

/// Runs `call` on `inputs.len()` thread ranks; returns every rank's output bits.
fn run_call(kind: Kind, call: Call, inputs: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let n = inputs.len();
    run_ranks_timeout(n, LONG, |comm| {
        let r = comm.rank();
        let input = Buf::new(&Device::cpu(), kind, &inputs[r]);
        let len = inputs[r].len();
        let out_len = match call {
            Call::AllGather => len * n,
            Call::ReduceScatter(_) => len / n,
            _ => len,
        };
        let mut out = Buf::poisoned(&Device::cpu(), kind, out_len);
        match call {
            Call::AllGather => comm.all_gather(input.send(kind), out.recv(kind))?,
            Call::ReduceScatter(op) => comm.reduce_scatter(input.send(kind), out.recv(kind), op)?,
            Call::AllReduce(op) => comm.all_reduce(input.send(kind), out.recv(kind), op)?,
            Call::Broadcast(root) => comm.broadcast(input.send(kind), out.recv(kind), root)?,
            Call::AllReduceInPlace(op) => {
                let mut buf = Buf::new(&Device::cpu(), kind, &inputs[r]);
                comm.all_reduce_in_place(buf.recv(kind), op)?;
                out = buf;
            }
            Call::BroadcastInPlace(root) => {
                let mut buf = Buf::new(&Device::cpu(), kind, &inputs[r]);
                comm.broadcast_in_place(buf.recv(kind), root)?;
                out = buf;
            }
        }
        Ok::<_, CommError>(out.bits())
    })
    .unwrap()
}

fn reference(kind: Kind, call: Call, inputs: &[Vec<u32>], rank: usize) -> Vec<u32> {
    let n = inputs.len();
    let len = inputs[0].len();
    match call {
        Call::AllGather => inputs.concat(),
        Call::Broadcast(root) | Call::BroadcastInPlace(root) => inputs[root].clone(),
        Call::ReduceScatter(op) => {
            let m = len / n;
            (rank * m..(rank + 1) * m)
                .map(|i| reference_reduce(kind, op, inputs, rank, i))
                .collect()
        }
        Call::AllReduce(op) | Call::AllReduceInPlace(op) => {
            let mut out = vec![0; len];
            for c in 0..n {
                for i in chunk_range(len, n, c) {
                    out[i] = reference_reduce(kind, op, inputs, c, i);
                }
            }
            out
        }
    }
}

fn check_call(kind: Kind, call: Call, inputs: &[Vec<u32>]) {
    let outs = run_call(kind, call, inputs);
    let op = match call {
        Call::ReduceScatter(op) | Call::AllReduce(op) | Call::AllReduceInPlace(op) => Some(op),
        _ => None,
    };
    for (r, got) in outs.iter().enumerate() {
        let want = reference(kind, call, inputs, r);
        assert_same(
            kind,
            op,
            got,
            &want,
            &format!("{call:?} rank {r} of {}", inputs.len()),
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn gathers_and_broadcasts_match_the_reference(
        n in 1usize..=8, len in 0usize..24, seed in any::<u64>(), root_pick in any::<usize>(),
        kind_pick in 0usize..6,
    ) {
        let kind = KINDS[kind_pick];
        let inputs = inputs_for(kind, n, len, seed);
        let root = root_pick % n;
        check_call(kind, Call::AllGather, &inputs);
        check_call(kind, Call::Broadcast(root), &inputs);
        check_call(kind, Call::BroadcastInPlace(root), &inputs);
    }

    #[test]
    fn reduce_scatter_matches_the_ring_reference(
        n in 1usize..=8, chunk in 0usize..12, seed in any::<u64>(), kind_pick in 0usize..5,
        op_pick in 0usize..3,
    ) {
        let kind = REDUCIBLE[kind_pick];
        let inputs = inputs_for(kind, n, chunk * n, seed);
        check_call(kind, Call::ReduceScatter(OPS[op_pick]), &inputs);
    }

    #[test]
    fn all_reduce_matches_the_ring_reference(
        n in 1usize..=8, len in 0usize..40, seed in any::<u64>(), kind_pick in 0usize..5,
        op_pick in 0usize..3,
    ) {
        // Lengths need not be multiples of the world size: chunks are split as chunk_range says.
        let kind = REDUCIBLE[kind_pick];
        let inputs = inputs_for(kind, n, len, seed);
        check_call(kind, Call::AllReduce(OPS[op_pick]), &inputs);
        check_call(kind, Call::AllReduceInPlace(OPS[op_pick]), &inputs);
    }

    #[test]
    fn fp8_ring_sum_is_within_the_documented_bound(
        n in 2usize..=8, chunk in 1usize..16, seed in any::<u64>(), e5m2 in any::<bool>(),
    ) {
        let format = if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        let kind = Kind::Fp8(format);
        // Values small enough that no partial sum reaches the largest finite value (no saturation).
        let limit = format.max() as f64 / (2.0 * n as f64);
        let mut rng = Rng(SplitMix64::new(seed));
        let inputs: Vec<Vec<u32>> = (0..n)
            .map(|_| {
                (0..chunk * n)
                    .map(|_| loop {
                        let c = (rng.0.next_u64() & 0xFF) as u8;
                        let v = format.decode(c) as f64;
                        if v.is_finite() && v.abs() <= limit {
                            break c as u32;
                        }
                    })
                    .collect()
            })
            .collect();
        let outs = run_call(kind, Call::ReduceScatter(ReduceOp::Sum), &inputs);
        let u = fp8_unit_roundoff(format);
        let sub = format.min_subnormal() as f64;
        for (r, got) in outs.iter().enumerate() {
            for (j, &g) in got.iter().enumerate() {
                let i = r * chunk + j;
                let exact: f64 = (0..n).map(|k| decode(kind, inputs[k][i])).sum();
                let abs_sum: f64 = (0..n).map(|k| decode(kind, inputs[k][i]).abs()).sum();
                // Largest exact step sum |t_k| along the reference chain.
                let mut order = ring_order(r, n);
                let mut acc = inputs[order.next().unwrap()][i];
                let mut max_t = 0.0f64;
                for k in order {
                    let t = decode(kind, acc) + decode(kind, inputs[k][i]);
                    max_t = max_t.max(t.abs());
                    acc = reference_step(kind, ReduceOp::Sum, acc, inputs[k][i]);
                }
                let err = (decode(kind, g) - exact).abs();
                let steps = (n - 1) as f64;
                let bound = steps * (u * max_t + sub / 2.0);
                prop_assert!(err <= bound, "rank {r} element {j}: error {err} > bound {bound}");
                // The same bound without the partials: |t_k| <= (1 + u)^(n-1) * sum |x|.
                let loose = steps * (u * (1.0 + u).powi(n as i32 - 1) * abs_sum + sub / 2.0);
                prop_assert!(err <= loose, "rank {r} element {j}: error {err} > {loose}");
            }
        }
    }
}

#[test]
fn results_are_bitwise_reproducible_run_to_run() {
    let kind = Kind::Fp8(Fp8Format::E4M3);
    let inputs = inputs_for(kind, 7, 7 * 300, 42);
    let a = run_call(kind, Call::ReduceScatter(ReduceOp::Sum), &inputs);
    for _ in 0..5 {
        assert_eq!(
            run_call(kind, Call::ReduceScatter(ReduceOp::Sum), &inputs),
            a
        );
    }
    let inputs = inputs_for(Kind::BF16, 5, 999, 7);
    let b = run_call(Kind::BF16, Call::AllReduce(ReduceOp::Sum), &inputs);
    assert_eq!(
        run_call(Kind::BF16, Call::AllReduce(ReduceOp::Sum), &inputs),
        b
    );
}

#[test]
fn fp8_sums_round_per_step_not_once() {
    // E4M3 on 4 ranks, chunk 0: order 1, 2, 3, 0. Values 1, 1/16, 1/16, 1/16: every step 1 + 1/16 ties
    // back to 1, so the per-step result is 1, while rounding once would give 1.1875 -> 1.25.
    let f = Fp8Format::E4M3;
    let one = f.encode(1.0) as u32;
    let s = f.encode(0.0625) as u32;
    let inputs = vec![vec![s], vec![one], vec![s], vec![s]];
    let outs = run_call(Kind::Fp8(f), Call::AllReduce(ReduceOp::Sum), &inputs);
    for o in &outs {
        assert_eq!(f.decode(o[0] as u8), 1.0);
    }
    assert_eq!(f.decode(f.encode(1.1875)), 1.25);
}

#[test]
fn host_f32_all_reduce_and_barrier() {
    let res = run_ranks(6, |comm| {
        let r = comm.rank() as f32;
        let mut v = [r, -r, if comm.rank() == 3 { f32::NAN } else { 1.0 }];
        comm.barrier()?;
        comm.all_reduce_host_f32(&mut v, ReduceOp::Max)?;
        let mut counts = [1.0f32, r];
        comm.all_reduce_host_f32(&mut counts, ReduceOp::Sum)?;
        comm.barrier()?;
        Ok::<_, CommError>((v, counts))
    })
    .unwrap();
    for (v, counts) in res {
        // Max drops NaN (like fmaxf and NCCL): a NaN count must be summed, not max-reduced.
        assert_eq!(v, [5.0, 0.0, 1.0]);
        assert_eq!(counts, [6.0, 15.0]);
    }
}

#[test]
fn empty_buffers_are_fine() {
    for kind in KINDS {
        let inputs = vec![Vec::new(); 3];
        check_call(kind, Call::AllGather, &inputs);
        if kind != Kind::Bytes {
            check_call(kind, Call::ReduceScatter(ReduceOp::Sum), &inputs);
            check_call(kind, Call::AllReduce(ReduceOp::Sum), &inputs);
        }
    }
}

/// Every rank's error from one collective call made with per-rank sizes.
fn errors_of(
    n: usize,
    f: impl Fn(&dyn Communicator) -> Result<(), CommError> + Sync,
) -> Vec<CommError> {
    run_ranks_each(n, TIMEOUT, |comm| f(&comm))
        .unwrap()
        .into_iter()
        .map(|r| r.expect_err("every rank must fail"))
        .collect()
}

#[test]
fn bad_sizes_fail_on_every_rank_and_name_both_sizes() {
    let d = Device::cpu();
    // Reduce-scatter of 10 elements on 4 ranks: not divisible.
    let errs = errors_of(4, |comm| {
        let x = d.upload(&[1.0f32; 10])?;
        let mut y = d.zeros::<f32>(2)?;
        comm.reduce_scatter((&x).into(), (&mut y).into(), ReduceOp::Sum)
    });
    for e in &errs {
        assert!(
            matches!(
                e,
                CommError::LengthMismatch {
                    expected: 8,
                    actual: 10,
                    ..
                }
            ),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains('8') && msg.contains("10"), "{msg}");
    }
    // Only rank 2 passes a wrong all-gather output: it fails locally, the others learn it at once.
    let errs = errors_of(3, |comm| {
        let x = d.upload(&[1.0f32; 4])?;
        let mut y = d.zeros::<f32>(if comm.rank() == 2 { 11 } else { 12 })?;
        comm.all_gather((&x).into(), (&mut y).into())
    });
    assert!(
        matches!(
            errs[2],
            CommError::LengthMismatch {
                expected: 12,
                actual: 11,
                ..
            }
        ),
        "{}",
        errs[2]
    );
    for e in &errs[..2] {
        assert!(matches!(e, CommError::PeerFailed { rank: 2, .. }), "{e}");
    }
    // Ranks with different shard sizes: consistent locally, inconsistent across ranks.
    let errs = errors_of(2, |comm| {
        let len = 3 + comm.rank();
        let x = d.upload(&vec![1.0f32; len])?;
        let mut y = d.zeros::<f32>(2 * len)?;
        comm.all_gather((&x).into(), (&mut y).into())
    });
    for e in &errs {
        let msg = e.to_string();
        assert!(matches!(e, CommError::RankMismatch { .. }), "{msg}");
        assert!(msg.contains("send 3") && msg.contains("send 4"), "{msg}");
    }
}

#[test]
fn unsupported_types_and_arguments_are_errors() {
    let d = Device::cpu();
    // Bytes have no arithmetic.
    let errs = errors_of(2, |comm| {
        let x = d.upload(&[1u8; 4])?;
        let mut y = d.zeros::<u8>(4)?;
        comm.all_reduce((&x).into(), (&mut y).into(), ReduceOp::Sum)
    });
    assert!(matches!(&errs[0], CommError::Unsupported { dtype, .. } if dtype == "bytes"));
    // Send and receive types differ (FP8 formats too).
    let errs = errors_of(2, |comm| {
        let x = d.upload(&[1u8; 4])?;
        let mut y = d.zeros::<u8>(4)?;
        comm.all_reduce(
            SendBuf::fp8(&x, Fp8Format::E4M3),
            RecvBuf::fp8(&mut y, Fp8Format::E5M2),
            ReduceOp::Sum,
        )
    });
    assert!(
        matches!(&errs[1], CommError::DTypeMismatch { .. }),
        "{}",
        errs[1]
    );
    // A root outside the group.
    let errs = errors_of(3, |comm| {
        let mut y = d.zeros::<f32>(4)?;
        comm.broadcast_in_place((&mut y).into(), 3)
    });
    assert!(
        matches!(&errs[0], CommError::InvalidArgument { .. }),
        "{}",
        errs[0]
    );
    assert_eq!(CommDType::Fp8(Fp8Format::E5M2).to_string(), "fp8-e5m2");
}

#[test]
fn a_panicking_rank_fails_every_rank_without_hanging() {
    let d = Device::cpu();
    let start = std::time::Instant::now();
    let results = run_ranks_each(4, LONG, |comm| {
        if comm.rank() == 2 {
            panic!("boom on rank two");
        }
        let x = d.upload(&[1.0f32; 4])?;
        let mut y = d.zeros::<f32>(16)?;
        comm.all_gather((&x).into(), (&mut y).into())?;
        Ok::<_, CommError>(())
    })
    .unwrap();
    // Far below the 60 s timeout: the panic poisoned the group.
    assert!(start.elapsed() < Duration::from_secs(30));
    for (r, res) in results.iter().enumerate() {
        let e = res.as_ref().expect_err("every rank fails");
        if r == 2 {
            assert!(
                matches!(e, CommError::RankPanicked { rank: 2, message } if message.contains("boom"))
            );
        } else {
            assert!(e.to_string().contains("rank 2"), "rank {r}: {e}");
        }
    }
    // run_ranks reports the cause.
    let err = run_ranks_timeout(3, LONG, |comm| {
        if comm.rank() == 1 {
            panic!("rank one fails");
        }
        comm.barrier()
    })
    .unwrap_err();
    assert!(
        matches!(err, CommError::RankPanicked { rank: 1, ref message } if message.contains("rank one")),
        "{err}"
    );
}

#[test]
fn a_rank_that_never_arrives_times_out_on_the_others() {
    let d = Device::cpu();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let tx = std::sync::Mutex::new(tx);
    let start = std::time::Instant::now();
    let results = run_ranks_each(3, TIMEOUT, |comm| {
        if comm.rank() == 1 {
            // Absent until the others have given up, then it finds the group poisoned.
            let _ = rx.lock().unwrap().recv_timeout(Duration::from_secs(60));
            return comm.barrier();
        }
        let mut y = d.zeros::<f32>(8)?;
        let r = comm.all_reduce_in_place((&mut y).into(), ReduceOp::Max);
        let _ = tx.lock().unwrap().send(());
        r
    })
    .unwrap();
    let elapsed = start.elapsed();
    assert!(
        elapsed >= TIMEOUT && elapsed < Duration::from_secs(50),
        "{elapsed:?}"
    );
    for r in [0, 2] {
        let e = results[r].as_ref().unwrap_err();
        match e {
            CommError::Timeout { op, missing, .. } => {
                assert!(op.contains("all_reduce"), "{op}");
                assert_eq!(missing, &vec![1]);
            }
            CommError::Poisoned(_) => {}
            other => panic!("rank {r}: {other}"),
        }
        assert!(e.to_string().contains("[1]"), "rank {r}: {e}");
    }
    assert!(results[1].is_err());
}

#[test]
fn a_rank_that_leaves_early_fails_the_others_at_once() {
    let d = Device::cpu();
    let start = std::time::Instant::now();
    let results = run_ranks_each(3, LONG, |comm| {
        if comm.rank() == 0 {
            return Ok(()); // drops its communicator without joining the collective
        }
        let mut y = d.zeros::<f32>(3)?;
        comm.broadcast_in_place((&mut y).into(), 0)
    })
    .unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(results[0].is_ok());
    for r in [1, 2] {
        let e = results[r].as_ref().unwrap_err();
        assert!(e.to_string().contains("[0]"), "{e}");
    }
}

/// An application error: a rank's own failure, or a collective's.
#[derive(Debug)]
enum AppError {
    Own(String),
    Comm(CommError),
}

impl From<CommError> for AppError {
    fn from(e: CommError) -> Self {
        AppError::Comm(e)
    }
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AppError::Own(m) => write!(f, "{m}"),
            AppError::Comm(e) => write!(f, "{e}"),
        }
    }
}

#[test]
fn the_rank_that_failed_first_is_reported_not_the_peers_that_saw_it_leave() {
    // Rank 0 fails alone before its first collective (say, its metrics path is a directory); rank 1
    // waits in a barrier, sees rank 0 leave and returns first. The report is rank 0's cause.
    let run = |comm: fsdp_comm::ThreadComm| -> Result<(), AppError> {
        if comm.rank() == 0 {
            drop(comm);
            std::thread::sleep(Duration::from_millis(300));
            return Err(AppError::Own("metrics: /tmp is a directory".into()));
        }
        comm.barrier()?;
        Ok(())
    };
    let err = run_ranks_timeout(2, LONG, run).unwrap_err();
    assert!(
        matches!(&err, AppError::Own(m) if m.contains("is a directory")),
        "{err}"
    );
    // The consequences stay available, and say they are consequences.
    let failures = run_ranks_failures(3, LONG, run).unwrap_err();
    assert_eq!(failures.rank, 0);
    assert_eq!(failures.others.len(), 2);
    for (r, e) in &failures.others {
        assert!(matches!(e, AppError::Comm(_)), "rank {r}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("consequence") || msg.contains("earlier failure"),
            "rank {r}: {msg}"
        );
    }
    let text = failures.to_string();
    assert!(text.starts_with("rank 0: metrics"), "{text}");
    assert!(
        text.contains("then rank 1") && text.contains("then rank 2"),
        "{text}"
    );
}

#[test]
fn a_failure_learned_from_a_collective_result_is_a_consequence() {
    // Every rank takes part in an all-reduce of error flags; rank 0's flag is set, so rank 1 fails
    // too, first, and says its failure is rank 0's.
    let err = run_ranks_timeout(2, LONG, |comm| -> Result<(), AppError> {
        let mut flags = [0f32; 2];
        flags[0] = 1.0;
        comm.all_reduce_host_f32(&mut flags, ReduceOp::Max)?;
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_millis(300));
            return Err(AppError::Own("rank 0: disk full".into()));
        }
        comm.note_failure_caused_by_peer();
        Err(AppError::Own("not saved: rank 0 failed".into()))
    })
    .unwrap_err();
    assert_eq!(err.to_string(), "rank 0: disk full");
}

#[test]
fn independent_failures_report_the_first_one() {
    // Rank 1 fails on its own at once, rank 0 on its own later: both are causes; the first is reported.
    let err = run_ranks_timeout(2, LONG, |comm| -> Result<(), AppError> {
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        Err(AppError::Own(format!("rank {} failed", comm.rank())))
    })
    .unwrap_err();
    assert_eq!(err.to_string(), "rank 1 failed");
}

#[test]
fn communicators_work_behind_arc_dyn() {
    use std::sync::Arc;
    let out = run_ranks(3, |comm| {
        let c: Arc<dyn Communicator> = Arc::new(comm);
        let d = c.device().clone();
        let x = d.upload(&[c.rank() as f32 + 1.0])?;
        let mut y = d.zeros::<f32>(1)?;
        let work = c.all_reduce_async((&x).into(), (&mut y).into(), ReduceOp::Sum)?;
        assert!(work.is_complete());
        work.wait()?;
        Ok::<_, CommError>(y.to_vec()?[0])
    })
    .unwrap();
    // Chunk 0 of a 1-element buffer on 3 ranks: (2 + 3) + 1.
    assert_eq!(out, vec![6.0; 3]);
}

#[test]
fn a_world_size_beyond_the_limit_is_an_error_not_a_panic() {
    for ws in [fsdp_comm::MAX_THREAD_RANKS + 1, usize::MAX] {
        let Err(e) = fsdp_comm::ThreadGroup::new(ws, Duration::from_secs(1)) else {
            panic!("a world size of {ws} was accepted");
        };
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
        let r = fsdp_comm::run_ranks(ws, |_c| Ok::<(), fsdp_comm::CommError>(()));
        assert!(r.is_err());
    }
    assert_eq!(
        fsdp_comm::ThreadGroup::new(3, Duration::from_secs(1))
            .unwrap()
            .len(),
        3
    );
}
