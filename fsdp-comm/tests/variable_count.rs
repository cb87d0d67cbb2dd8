//! The variable-count collectives (`all_gather_v`, `reduce_scatter_v`, `all_to_all_v`) on thread ranks
//! against a host reference, at world sizes 1 to 4 with uneven counts that include zeros, for every
//! element type they take; random counts and values by proptest; the async forms; and the errors: wrong
//! lengths, wrong numbers of counts, overflowing sums, FP8 reduce-scatter-v, ranks that disagree on
//! counts, all-to-all-v counts that do not match between peers. Every error is checked on every rank
//! (a rank that refused must not leave the others waiting). Also an NCCL test at world size 1 (ignored:
//! needs a GPU).
//!
//! The reduce-scatter-v reference computes each step in f64 and rounds once to the element type, along
//! `ring_order(rank)`: the thread backend's order for rank `rank`'s shard.

mod common;

use common::{decode, Buf, Kind, KINDS};
use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;

use fsdp_comm::ring::ring_order;
use fsdp_comm::{
    run_ranks_each, run_ranks_timeout, CommError, Communicator, RecvBuf, ReduceOp, SendBuf,
};
use half::{bf16, f16};
use proptest::prelude::*;
use std::time::Duration;

/// Never below 5 s in CI; a hang would show as a timeout error, which no test accepts.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The types reduce-scatter-v takes.
const REDUCIBLE_V: [Kind; 3] = [Kind::F32, Kind::BF16, Kind::F16];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

/// `len` random elements of `kind` as bits: any pattern for the moves (NaNs and every FP8 code must
/// arrive unchanged), finite values of either sign over magnitudes 2^-10 .. 2^10 for the reductions.
fn random_bits(kind: Kind, len: usize, reducing: bool, rng: &mut SplitMix64) -> Vec<u32> {
    (0..len)
        .map(|_| {
            let r = rng.next_u64();
            if !reducing {
                return match kind {
                    Kind::F32 => r as u32,
                    Kind::BF16 | Kind::F16 => r as u32 & 0xFFFF,
                    Kind::Bytes | Kind::Fp8(_) => r as u32 & 0xFF,
                };
            }
            let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
            let e = ((r >> 8) % 21) as i32 - 10;
            let frac = ((r >> 16) % 1_000_000) as f32 / 1_000_000.0;
            let v = sign * (1.0 + frac) * (e as f32).exp2();
            match kind {
                Kind::F32 => v.to_bits(),
                Kind::BF16 => bf16::from_f32(v).to_bits() as u32,
                Kind::F16 => f16::from_f32(v).to_bits() as u32,
                Kind::Bytes | Kind::Fp8(_) => unreachable!("no reductions of {kind:?}"),
            }
        })
        .collect()
}

/// One reduction step in f64, rounded once to the element type.
fn reference_step(kind: Kind, op: ReduceOp, a: u32, b: u32) -> u32 {
    let (x, y) = (decode(kind, a), decode(kind, b));
    let v = match op {
        ReduceOp::Sum => x + y,
        ReduceOp::Max => x.max(y),
        ReduceOp::Min => x.min(y),
    };
    match kind {
        Kind::F32 => (v as f32).to_bits(),
        Kind::BF16 => bf16::from_f64(v).to_bits() as u32,
        Kind::F16 => f16::from_f64(v).to_bits() as u32,
        Kind::Bytes | Kind::Fp8(_) => unreachable!("no reductions of {kind:?}"),
    }
}

/// `sum(counts[..i])` for every `i` (one more entry than `counts`: the last is the total).
fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut out = vec![0];
    for c in counts {
        out.push(out.last().unwrap() + c);
    }
    out
}

/// All-gather-v of `inputs[r]` (`counts[r]` elements) on `counts.len()` thread ranks; every rank's
/// receive buffer.
fn all_gather_v_threads(kind: Kind, inputs: &[Vec<u32>], counts: &[usize]) -> Vec<Vec<u32>> {
    let total: usize = counts.iter().sum();
    run_ranks_timeout(counts.len(), TIMEOUT, |comm| {
        let dev = comm.device().clone();
        let x = Buf::new(&dev, kind, &inputs[comm.rank()]);
        let mut y = Buf::poisoned(&dev, kind, total);
        comm.all_gather_v(x.send(kind), y.recv(kind), counts)?;
        Ok::<_, CommError>(y.bits())
    })
    .unwrap()
}

/// Reduce-scatter-v of `inputs[r]` (`sum(counts)` elements each); every rank's shard.
fn reduce_scatter_v_threads(
    kind: Kind,
    op: ReduceOp,
    inputs: &[Vec<u32>],
    counts: &[usize],
) -> Vec<Vec<u32>> {
    run_ranks_timeout(counts.len(), TIMEOUT, |comm| {
        let dev = comm.device().clone();
        let x = Buf::new(&dev, kind, &inputs[comm.rank()]);
        let mut y = Buf::poisoned(&dev, kind, counts[comm.rank()]);
        comm.reduce_scatter_v(x.send(kind), y.recv(kind), counts, op)?;
        Ok::<_, CommError>(y.bits())
    })
    .unwrap()
}

/// All-to-all-v where rank `r` sends `matrix[r][j]` elements to rank `j`: `inputs[r]` holds
/// `sum(matrix[r])` elements. Every rank's receive buffer.
fn all_to_all_v_threads(kind: Kind, inputs: &[Vec<u32>], matrix: &[Vec<usize>]) -> Vec<Vec<u32>> {
    run_ranks_timeout(matrix.len(), TIMEOUT, |comm| {
        let r = comm.rank();
        let dev = comm.device().clone();
        let send_counts = matrix[r].clone();
        let recv_counts: Vec<usize> = matrix.iter().map(|row| row[r]).collect();
        let x = Buf::new(&dev, kind, &inputs[r]);
        let mut y = Buf::poisoned(&dev, kind, recv_counts.iter().sum());
        comm.all_to_all_v(x.send(kind), &send_counts, y.recv(kind), &recv_counts)?;
        Ok::<_, CommError>(y.bits())
    })
    .unwrap()
}

fn check_all_gather_v(kind: Kind, counts: &[usize], seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let inputs: Vec<Vec<u32>> = counts
        .iter()
        .map(|&c| random_bits(kind, c, false, &mut rng))
        .collect();
    let want = inputs.concat();
    for (r, got) in all_gather_v_threads(kind, &inputs, counts)
        .iter()
        .enumerate()
    {
        assert_eq!(got, &want, "{kind:?}, counts {counts:?}: rank {r}");
    }
}

fn check_reduce_scatter_v(kind: Kind, op: ReduceOp, counts: &[usize], seed: u64) {
    let n = counts.len();
    let off = offsets(counts);
    let mut rng = SplitMix64::new(seed);
    let inputs: Vec<Vec<u32>> = (0..n)
        .map(|_| random_bits(kind, off[n], true, &mut rng))
        .collect();
    let outs = reduce_scatter_v_threads(kind, op, &inputs, counts);
    for (r, got) in outs.iter().enumerate() {
        let want: Vec<u32> = (off[r]..off[r + 1])
            .map(|i| {
                let mut order = ring_order(r, n);
                let mut acc = inputs[order.next().unwrap()][i];
                for k in order {
                    acc = reference_step(kind, op, acc, inputs[k][i]);
                }
                acc
            })
            .collect();
        assert_eq!(
            got.len(),
            want.len(),
            "{kind:?} {op}, counts {counts:?}: rank {r}"
        );
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            // The same value: max/min may pick either zero of equal magnitude.
            let same = g == w || (op != ReduceOp::Sum && decode(kind, g) == decode(kind, w));
            assert!(
                same,
                "{kind:?} {op}, counts {counts:?}: rank {r} element {i}: got {} ({g:#x}), want {} ({w:#x})",
                decode(kind, g),
                decode(kind, w)
            );
        }
    }
}

fn check_all_to_all_v(kind: Kind, matrix: &[Vec<usize>], seed: u64) {
    let n = matrix.len();
    let mut rng = SplitMix64::new(seed);
    let inputs: Vec<Vec<u32>> = matrix
        .iter()
        .map(|row| random_bits(kind, row.iter().sum(), false, &mut rng))
        .collect();
    let outs = all_to_all_v_threads(kind, &inputs, matrix);
    for (r, got) in outs.iter().enumerate() {
        // Chunk j of rank r's receive buffer is rank j's chunk for r.
        let want: Vec<u32> = (0..n)
            .flat_map(|j| {
                let start = offsets(&matrix[j])[r];
                inputs[j][start..start + matrix[j][r]].to_vec()
            })
            .collect();
        assert_eq!(got, &want, "{kind:?}, matrix {matrix:?}: rank {r}");
    }
}

/// Uneven counts with zeros at world sizes 1 to 4 (128-row blocks, a rank with none, single elements).
fn count_cases() -> Vec<Vec<usize>> {
    vec![
        vec![0],
        vec![7],
        vec![0, 0],
        vec![256, 0],
        vec![0, 5],
        vec![3, 1000],
        vec![128, 0, 37],
        vec![0, 0, 1],
        vec![5, 9, 2],
        vec![0, 256, 1, 0],
        vec![128, 128, 128, 0],
        vec![1, 0, 0, 0],
        vec![33, 17, 0, 64],
    ]
}

#[test]
fn all_gather_v_concatenates_uneven_shards_at_world_sizes_1_to_4() {
    for counts in count_cases() {
        for kind in KINDS {
            check_all_gather_v(kind, &counts, 3);
        }
    }
}

#[test]
fn reduce_scatter_v_matches_the_ring_reference_at_world_sizes_1_to_4() {
    for counts in count_cases() {
        for kind in REDUCIBLE_V {
            for op in OPS {
                check_reduce_scatter_v(kind, op, &counts, 5);
            }
        }
    }
}

#[test]
fn all_to_all_v_delivers_every_chunk_at_world_sizes_1_to_4() {
    let matrices: Vec<Vec<Vec<usize>>> = vec![
        vec![vec![0]],
        vec![vec![9]],
        vec![vec![0, 0], vec![0, 0]],
        vec![vec![3, 0], vec![5, 1]],
        vec![vec![0, 7], vec![0, 0]],
        vec![vec![1, 2, 0], vec![0, 0, 0], vec![4, 0, 128]],
        vec![vec![0, 5, 0], vec![2, 0, 3], vec![1, 1, 1]],
        vec![
            vec![0, 1, 2, 3],
            vec![4, 0, 0, 5],
            vec![0, 0, 0, 0],
            vec![128, 0, 6, 1],
        ],
    ];
    for matrix in matrices {
        for kind in KINDS {
            check_all_to_all_v(kind, &matrix, 9);
        }
    }
}

/// A count that is zero about a third of the time.
fn count() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), 1usize..24]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_counts_and_values_match_the_reference(
        counts in (1usize..=4).prop_flat_map(|n| prop::collection::vec(count(), n)),
        kind_pick in 0usize..6,
        rs_pick in 0usize..3,
        op_pick in 0usize..3,
        seed in any::<u64>(),
    ) {
        check_all_gather_v(KINDS[kind_pick], &counts, seed);
        check_reduce_scatter_v(REDUCIBLE_V[rs_pick], OPS[op_pick], &counts, seed);
    }

    #[test]
    fn random_all_to_all_v_matches_the_definition(
        matrix in (1usize..=4).prop_flat_map(|n| {
            prop::collection::vec(prop::collection::vec(count(), n), n)
        }),
        kind_pick in 0usize..6,
        seed in any::<u64>(),
    ) {
        check_all_to_all_v(KINDS[kind_pick], &matrix, seed);
    }
}

#[test]
fn async_forms_are_complete_on_threads() {
    let counts = [2usize, 0, 1];
    let out = run_ranks_timeout(3, TIMEOUT, |comm| {
        let dev = comm.device().clone();
        let r = comm.rank();
        let shard = dev.upload(&vec![r as f32; counts[r]])?;
        let mut full = dev.zeros::<f32>(3)?;
        let work = comm.all_gather_v_async((&shard).into(), (&mut full).into(), &counts)?;
        assert!(work.is_complete());
        work.wait()?;

        let grads = dev.upload(&[1.0f32, 2.0, 3.0])?;
        let mut mine = dev.zeros::<f32>(counts[r])?;
        let work = comm.reduce_scatter_v_async(
            (&grads).into(),
            (&mut mine).into(),
            &counts,
            ReduceOp::Sum,
        )?;
        assert!(work.is_complete());
        work.wait()?;

        // Every rank sends one element to each rank: its own rank number.
        let x = dev.upload(&[r as f32; 3])?;
        let mut y = dev.zeros::<f32>(3)?;
        let work = comm.all_to_all_v_async((&x).into(), &[1, 1, 1], (&mut y).into(), &[1, 1, 1])?;
        assert!(work.is_complete());
        work.wait()?;
        Ok::<_, CommError>((full.to_vec()?, mine.to_vec()?, y.to_vec()?))
    })
    .unwrap();
    let sums = [vec![3.0, 6.0], vec![], vec![9.0]];
    for (r, (full, mine, y)) in out.into_iter().enumerate() {
        assert_eq!(full, vec![0.0, 0.0, 2.0], "rank {r}");
        assert_eq!(mine, sums[r], "rank {r}");
        assert_eq!(y, vec![0.0, 1.0, 2.0], "rank {r}");
    }
}

/// Every rank's result of `f` on `n` thread ranks, each expected to fail.
fn errors_of(
    n: usize,
    f: impl Fn(&dyn Communicator) -> Result<(), CommError> + Sync,
) -> Vec<CommError> {
    run_ranks_each(n, TIMEOUT, |comm| f(&comm))
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.expect_err(&format!("rank {r}: the collective must fail")))
        .collect()
}

/// An all-gather-v of f32 with this rank's send and receive lengths and counts.
fn gather(
    comm: &dyn Communicator,
    send: usize,
    recv: usize,
    counts: &[usize],
) -> Result<(), CommError> {
    let dev = comm.device().clone();
    let x = dev.zeros::<f32>(send)?;
    let mut y = dev.zeros::<f32>(recv)?;
    comm.all_gather_v((&x).into(), (&mut y).into(), counts)
}

/// A reduce-scatter-v of f32 likewise.
fn scatter(
    comm: &dyn Communicator,
    send: usize,
    recv: usize,
    counts: &[usize],
) -> Result<(), CommError> {
    let dev = comm.device().clone();
    let x = dev.zeros::<f32>(send)?;
    let mut y = dev.zeros::<f32>(recv)?;
    comm.reduce_scatter_v((&x).into(), (&mut y).into(), counts, ReduceOp::Sum)
}

/// An all-to-all-v of bytes with buffers of the sums of the counts.
fn exchange(comm: &dyn Communicator, send: &[usize], recv: &[usize]) -> Result<(), CommError> {
    let dev = comm.device().clone();
    let x = dev.zeros::<u8>(send.iter().sum())?;
    let mut y = dev.zeros::<u8>(recv.iter().sum())?;
    comm.all_to_all_v((&x).into(), send, (&mut y).into(), recv)
}

/// The error of rank `bad` is its own `LengthMismatch`; the others see `PeerFailed` naming it.
fn assert_own_and_peer(errs: &[CommError], bad: usize, op: &str, expected: usize, actual: usize) {
    for (r, e) in errs.iter().enumerate() {
        if r == bad {
            match e {
                CommError::LengthMismatch {
                    op: o,
                    expected: x,
                    actual: a,
                    ..
                } if *o == op && *x == expected && *a == actual => {}
                _ => panic!("rank {r}: expected a length mismatch {expected} vs {actual}: {e}"),
            }
        } else {
            assert!(
                matches!(e, CommError::PeerFailed { rank, op: o, .. } if *rank == bad && o == op),
                "rank {r}: {e}"
            );
        }
    }
}

#[test]
fn wrong_lengths_fail_on_every_rank_before_data_moves() {
    let counts = [4usize, 0, 2];
    // all-gather-v: rank 1's send must have counts[1] = 0 elements.
    let errs = errors_of(3, |c| {
        let s = if c.rank() == 1 { 3 } else { counts[c.rank()] };
        gather(c, s, 6, &counts)
    });
    assert_own_and_peer(&errs, 1, "all_gather_v", 0, 3);
    // all-gather-v: rank 2's receive buffer is not sum(counts).
    let errs = errors_of(3, |c| {
        let recv = if c.rank() == 2 { 7 } else { 6 };
        gather(c, counts[c.rank()], recv, &counts)
    });
    assert_own_and_peer(&errs, 2, "all_gather_v", 6, 7);
    // reduce-scatter-v: rank 0's send is short; then rank 1's receive is not counts[1].
    let errs = errors_of(3, |c| {
        let send = if c.rank() == 0 { 5 } else { 6 };
        scatter(c, send, counts[c.rank()], &counts)
    });
    assert_own_and_peer(&errs, 0, "reduce_scatter_v", 6, 5);
    let errs = errors_of(3, |c| {
        let recv = if c.rank() == 1 { 1 } else { counts[c.rank()] };
        scatter(c, 6, recv, &counts)
    });
    assert_own_and_peer(&errs, 1, "reduce_scatter_v", 0, 1);
    // all-to-all-v: rank 1's send buffer is not sum(send_counts).
    let errs = errors_of(2, |c| {
        let dev = c.device().clone();
        let x = dev.zeros::<u8>(if c.rank() == 1 { 3 } else { 2 })?;
        let mut y = dev.zeros::<u8>(2)?;
        c.all_to_all_v((&x).into(), &[1, 1], (&mut y).into(), &[1, 1])
    });
    assert_own_and_peer(&errs, 1, "all_to_all_v", 2, 3);
    // all-to-all-v: what a rank sends itself must be what it receives from itself.
    let errs = errors_of(2, |c| {
        if c.rank() == 0 {
            exchange(c, &[2, 1], &[3, 1])
        } else {
            exchange(c, &[1, 0], &[1, 0])
        }
    });
    assert_own_and_peer(&errs, 0, "all_to_all_v", 2, 3);
}

#[test]
fn wrong_numbers_of_counts_and_overflowing_sums_fail_on_every_rank() {
    // Two counts on three ranks: every rank refuses on its own.
    for e in errors_of(3, |c| gather(c, 1, 2, &[1, 1])) {
        assert_eq!(
            e,
            CommError::LengthMismatch {
                op: "all_gather_v",
                what: "counts (one per rank)",
                expected: 3,
                actual: 2
            }
        );
    }
    for e in errors_of(2, |c| scatter(c, 3, 1, &[1, 1, 1])) {
        assert!(
            matches!(
                e,
                CommError::LengthMismatch {
                    op: "reduce_scatter_v",
                    what: "counts (one per rank)",
                    expected: 2,
                    actual: 3
                }
            ),
            "{e}"
        );
    }
    for e in errors_of(2, |c| exchange(c, &[1], &[1, 0])) {
        assert!(
            matches!(
                e,
                CommError::LengthMismatch {
                    op: "all_to_all_v",
                    what: "send_counts (one per rank)",
                    ..
                }
            ),
            "{e}"
        );
    }
    for e in errors_of(2, |c| exchange(c, &[1, 0], &[1, 0, 0])) {
        assert!(
            matches!(
                e,
                CommError::LengthMismatch {
                    op: "all_to_all_v",
                    what: "recv_counts (one per rank)",
                    ..
                }
            ),
            "{e}"
        );
    }
    // Sums that overflow usize (the buffers themselves are small: the sum is checked first).
    let huge = [usize::MAX, 1];
    for e in errors_of(2, |c| gather(c, 1, 0, &huge)) {
        assert!(
            matches!(&e, CommError::InvalidArgument { op: "all_gather_v", detail } if detail.contains("overflows")),
            "{e}"
        );
    }
    for e in errors_of(2, |c| scatter(c, 0, 1, &huge)) {
        assert!(
            matches!(&e, CommError::InvalidArgument { op: "reduce_scatter_v", detail } if detail.contains("overflows")),
            "{e}"
        );
    }
    for e in errors_of(2, |c| {
        let dev = c.device().clone();
        let x = dev.zeros::<u8>(1)?;
        let mut y = dev.zeros::<u8>(1)?;
        c.all_to_all_v((&x).into(), &[1, 0], (&mut y).into(), &huge)
    }) {
        assert!(
            matches!(&e, CommError::InvalidArgument { op: "all_to_all_v", detail } if detail.contains("recv_counts")),
            "{e}"
        );
    }
}

#[test]
fn fp8_and_bytes_reduce_scatter_v_are_refused_on_every_rank() {
    for format in Fp8Format::ALL {
        let errs = errors_of(2, |c| {
            let dev = c.device().clone();
            let x = dev.zeros::<u8>(3)?;
            let mut y = dev.zeros::<u8>(if c.rank() == 0 { 1 } else { 2 })?;
            c.reduce_scatter_v(
                SendBuf::fp8(&x, format),
                RecvBuf::fp8(&mut y, format),
                &[1, 2],
                ReduceOp::Sum,
            )
        });
        for e in errs {
            match &e {
                CommError::Unsupported { op, why, .. } => {
                    assert_eq!(*op, "reduce_scatter_v");
                    assert!(why.contains("BF16 or F32"), "{e}");
                }
                _ => panic!("{format:?}: expected Unsupported, got {e}"),
            }
        }
    }
    for e in errors_of(2, |c| {
        let dev = c.device().clone();
        let x = dev.zeros::<u8>(2)?;
        let mut y = dev.zeros::<u8>(1)?;
        c.reduce_scatter_v((&x).into(), (&mut y).into(), &[1, 1], ReduceOp::Max)
    }) {
        assert!(
            matches!(
                e,
                CommError::Unsupported {
                    op: "reduce_scatter_v",
                    ..
                }
            ),
            "{e}"
        );
    }
    // The element types of send and receive must agree.
    for e in errors_of(2, |c| {
        let dev = c.device().clone();
        let x = dev.zeros::<f32>(2)?;
        let mut y = dev.zeros::<bf16>(2)?;
        c.all_gather_v((&x).into(), (&mut y).into(), &[2, 0])
    }) {
        assert!(matches!(e, CommError::DTypeMismatch { .. }), "{e}");
    }
}

#[test]
fn ranks_that_disagree_on_counts_fail_on_every_rank() {
    // Each rank's call is consistent in itself, but rank 1 has other counts: named, on every rank.
    let errs = errors_of(2, |c| {
        let counts: &[usize] = if c.rank() == 0 { &[2, 2] } else { &[1, 3] };
        gather(c, counts[c.rank()], 4, counts)
    });
    for e in errs {
        match &e {
            CommError::RankMismatch { op, detail } => {
                assert_eq!(op, "all_gather_v");
                assert!(
                    detail.contains("counts [2, 2]") && detail.contains("counts [1, 3]"),
                    "{e}"
                );
            }
            _ => panic!("expected RankMismatch, got {e}"),
        }
    }
    let errs = errors_of(2, |c| {
        let counts: &[usize] = if c.rank() == 0 { &[2, 2] } else { &[1, 3] };
        scatter(c, 4, counts[c.rank()], counts)
    });
    for e in errs {
        assert!(matches!(e, CommError::RankMismatch { .. }), "{e}");
    }
}

#[test]
fn mismatched_all_to_all_v_counts_fail_on_every_rank_and_leave_the_group_usable() {
    let results = run_ranks_each(3, TIMEOUT, |c| {
        // Rank 0 sends 2 elements to rank 1, which expects 3 from it; every other pair agrees.
        let matrix = [[1usize, 2, 0], [4, 0, 1], [0, 5, 6]];
        let r = c.rank();
        let send = matrix[r].to_vec();
        let mut recv: Vec<usize> = matrix.iter().map(|row| row[r]).collect();
        if r == 1 {
            recv[0] = 3;
        }
        let err = match exchange(&c, &send, &recv) {
            Ok(()) => panic!("rank {r}: the mismatched all-to-all-v must fail"),
            Err(e) => e,
        };
        // The failure was found before any data moved and poisoned nothing: the next call works.
        let counts = [1usize, 0, 2];
        let dev = c.device().clone();
        let x = dev.upload(&vec![r as f32 + 1.0; counts[r]])?;
        let mut y = dev.zeros::<f32>(3)?;
        c.all_gather_v((&x).into(), (&mut y).into(), &counts)?;
        Ok::<_, CommError>((err, y.to_vec()?))
    })
    .unwrap();
    for (r, res) in results.into_iter().enumerate() {
        let (e, y) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        match &e {
            CommError::RankMismatch { op, detail } => {
                assert_eq!(op, "all_to_all_v");
                assert!(
                    detail.contains("rank 0 sends 2 elements to rank 1")
                        && detail.contains("expects 3"),
                    "{e}"
                );
            }
            _ => panic!("rank {r}: expected RankMismatch, got {e}"),
        }
        assert_eq!(y, vec![1.0, 3.0, 3.0], "rank {r}");
    }
}

/// NCCL at world size 1: each "v" collective is a copy (the shard is everything), for every element type
/// it takes, blocking and async, with a zero count too; FP8 reduce-scatter-v and wrong lengths are
/// refused before NCCL sees them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_size_one_variable_count_collectives() {
    use fsdp_comm::nccl::{NcclComm, NcclConfig};
    use fsdp_comm::DistEnv;
    let comm = NcclComm::from_dist_env(&DistEnv::single(), &NcclConfig::default())
        .unwrap_or_else(|e| panic!("NCCL at world size 1: {e}"));
    let dev = comm.device().clone();
    let mut rng = SplitMix64::new(13);
    for kind in KINDS {
        for len in [0usize, 1, 1000, 65_537] {
            let counts = [len];
            let reducing = REDUCIBLE_V.contains(&kind);
            let x = random_bits(kind, len, reducing, &mut rng);
            let xb = Buf::new(&dev, kind, &x);
            let what = format!("{kind:?} len {len}");

            let mut y = Buf::poisoned(&dev, kind, len);
            comm.all_gather_v(xb.send(kind), y.recv(kind), &counts)
                .unwrap_or_else(|e| panic!("all_gather_v {what}: {e}"));
            assert_eq!(y.bits(), x, "all_gather_v {what}");
            let mut y = Buf::poisoned(&dev, kind, len);
            comm.all_gather_v_async(xb.send(kind), y.recv(kind), &counts)
                .and_then(|w| w.wait())
                .unwrap_or_else(|e| panic!("all_gather_v_async {what}: {e}"));
            assert_eq!(y.bits(), x, "all_gather_v_async {what}");

            let mut y = Buf::poisoned(&dev, kind, len);
            comm.all_to_all_v(xb.send(kind), &counts, y.recv(kind), &counts)
                .unwrap_or_else(|e| panic!("all_to_all_v {what}: {e}"));
            assert_eq!(y.bits(), x, "all_to_all_v {what}");
            let mut y = Buf::poisoned(&dev, kind, len);
            comm.all_to_all_v_async(xb.send(kind), &counts, y.recv(kind), &counts)
                .and_then(|w| w.wait())
                .unwrap_or_else(|e| panic!("all_to_all_v_async {what}: {e}"));
            assert_eq!(y.bits(), x, "all_to_all_v_async {what}");

            if reducing {
                for op in OPS {
                    let mut y = Buf::poisoned(&dev, kind, len);
                    comm.reduce_scatter_v(xb.send(kind), y.recv(kind), &counts, op)
                        .unwrap_or_else(|e| panic!("reduce_scatter_v {op} {what}: {e}"));
                    assert_eq!(y.bits(), x, "reduce_scatter_v {op} {what}");
                    let mut y = Buf::poisoned(&dev, kind, len);
                    comm.reduce_scatter_v_async(xb.send(kind), y.recv(kind), &counts, op)
                        .and_then(|w| w.wait())
                        .unwrap_or_else(|e| panic!("reduce_scatter_v_async {op} {what}: {e}"));
                    assert_eq!(y.bits(), x, "reduce_scatter_v_async {op} {what}");
                }
            } else {
                let mut y = Buf::poisoned(&dev, kind, len);
                let e = comm
                    .reduce_scatter_v(xb.send(kind), y.recv(kind), &counts, ReduceOp::Sum)
                    .expect_err("reduce_scatter_v of FP8 or bytes must be refused");
                assert!(matches!(e, CommError::Unsupported { .. }), "{what}: {e}");
            }
        }
    }
    let x = dev.zeros::<f32>(8).unwrap();
    let mut y = dev.zeros::<f32>(9).unwrap();
    assert!(matches!(
        comm.all_gather_v((&x).into(), (&mut y).into(), &[8]),
        Err(CommError::LengthMismatch { .. })
    ));
    assert!(matches!(
        comm.all_to_all_v((&x).into(), &[8], (&mut y).into(), &[9]),
        Err(CommError::LengthMismatch { .. })
    ));
    assert!(matches!(
        comm.reduce_scatter_v((&x).into(), (&mut y).into(), &[8, 1], ReduceOp::Sum),
        Err(CommError::LengthMismatch { .. })
    ));
}
