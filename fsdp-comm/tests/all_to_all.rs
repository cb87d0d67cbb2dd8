//! All-to-all on thread ranks against the definition (chunk `j` of rank `r`'s send lands in chunk `r` of
//! rank `j`'s receive buffer), every chunk of every rank checked bit for bit, at world sizes 1 to 4 and
//! for every element type (FP8 codes and bytes included); an all-to-all applied twice gives the input
//! back; wrong sizes and disagreeing ranks are typed errors on every rank. Also an NCCL test at world
//! size 1 (ignored: needs a GPU).

mod common;

use common::{Buf, Kind, KINDS};
use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;

use fsdp_comm::{run_ranks, run_ranks_each, CommError, Communicator, RecvBuf, SendBuf};
use half::bf16;
use proptest::prelude::*;
use std::time::Duration;

/// Random bits of `len` elements of `kind` for `rank` (any pattern: all-to-all does no arithmetic, so
/// NaNs and every FP8 code must arrive unchanged).
fn input(kind: Kind, len: usize, rank: usize, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed ^ ((rank as u64) << 40));
    let mask = match kind {
        Kind::F32 => u32::MAX,
        Kind::BF16 | Kind::F16 => 0xFFFF,
        Kind::Bytes | Kind::Fp8(_) => 0xFF,
    };
    (0..len).map(|_| rng.next_u64() as u32 & mask).collect()
}

/// All-to-all of `inputs[r]` on `inputs.len()` thread ranks; every rank's receive buffer.
fn all_to_all_threads(kind: Kind, inputs: &[Vec<u32>]) -> Vec<Vec<u32>> {
    run_ranks(inputs.len(), |comm| {
        let dev = comm.device().clone();
        let x = Buf::new(&dev, kind, &inputs[comm.rank()]);
        // A pattern the collective must overwrite.
        let mut y = Buf::new(&dev, kind, &vec![0x55; inputs[comm.rank()].len()]);
        comm.all_to_all(x.send(kind), y.recv(kind))?;
        Ok::<_, CommError>(y.bits())
    })
    .unwrap()
}

/// Checks every chunk of every rank against the definition.
fn check(kind: Kind, inputs: &[Vec<u32>], outputs: &[Vec<u32>]) {
    let n = inputs.len();
    for (r, out) in outputs.iter().enumerate() {
        assert_eq!(out.len(), inputs[r].len(), "rank {r}");
        let chunk = out.len() / n;
        for j in 0..n {
            assert_eq!(
                &out[j * chunk..(j + 1) * chunk],
                &inputs[j][r * chunk..(r + 1) * chunk],
                "{kind:?}, world {n}: chunk {j} of rank {r} is not chunk {r} of rank {j}"
            );
        }
    }
}

#[test]
fn every_chunk_lands_on_its_rank_at_world_sizes_1_to_4() {
    for n in 1..=4 {
        for kind in KINDS {
            for chunk in [0, 1, 3, 1000] {
                let inputs: Vec<Vec<u32>> = (0..n).map(|r| input(kind, n * chunk, r, 7)).collect();
                let outputs = all_to_all_threads(kind, &inputs);
                check(kind, &inputs, &outputs);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn matches_the_definition_and_twice_is_the_identity(
        n in 1usize..=4,
        chunk in 0usize..40,
        kind in prop_oneof![
            Just(Kind::F32), Just(Kind::BF16), Just(Kind::F16), Just(Kind::Bytes),
            Just(Kind::Fp8(Fp8Format::E4M3)), Just(Kind::Fp8(Fp8Format::E5M2))
        ],
        seed in any::<u64>(),
    ) {
        let inputs: Vec<Vec<u32>> = (0..n).map(|r| input(kind, n * chunk, r, seed)).collect();
        let once = all_to_all_threads(kind, &inputs);
        check(kind, &inputs, &once);
        // The exchange transposes the (rank, chunk) grid, so doing it twice restores every input.
        prop_assert_eq!(all_to_all_threads(kind, &once), inputs);
    }
}

#[test]
fn async_form_is_complete_on_threads() {
    let out = run_ranks(3, |comm| {
        let dev = comm.device().clone();
        let x = dev.upload(&[comm.rank() as f32; 6])?;
        let mut y = dev.zeros::<f32>(6)?;
        let work = comm.all_to_all_async((&x).into(), (&mut y).into())?;
        assert!(work.is_complete());
        work.wait()?;
        Ok::<_, CommError>(y.to_vec()?)
    })
    .unwrap();
    for y in out {
        assert_eq!(y, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
    }
}

/// Every rank's error of an all-to-all whose sizes rank `r` picks with `sizes(r)` (send, receive).
fn errors_of(n: usize, sizes: impl Fn(usize) -> (usize, usize) + Sync) -> Vec<CommError> {
    run_ranks_each(n, Duration::from_secs(10), |comm| {
        let dev = comm.device().clone();
        let (s, r) = sizes(comm.rank());
        let x = dev.zeros::<u8>(s)?;
        let mut y = dev.zeros::<u8>(r)?;
        comm.all_to_all(
            SendBuf::fp8(&x, Fp8Format::E4M3),
            RecvBuf::fp8(&mut y, Fp8Format::E4M3),
        )
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect_err("the all-to-all must fail"))
    .collect()
}

#[test]
fn bad_sizes_are_typed_errors_on_every_rank() {
    // Send and receive lengths differ on rank 1: its own error names both; the others see it fail.
    let errs = errors_of(3, |r| if r == 1 { (6, 9) } else { (6, 6) });
    assert!(
        matches!(
            errs[1],
            CommError::LengthMismatch {
                op: "all_to_all",
                expected: 6,
                actual: 9,
                ..
            }
        ),
        "{}",
        errs[1]
    );
    for r in [0, 2] {
        assert!(
            matches!(errs[r], CommError::PeerFailed { rank: 1, .. }),
            "{}",
            errs[r]
        );
    }
    // A length that does not split into world_size chunks, on every rank.
    for e in errors_of(4, |_| (10, 10)) {
        assert_eq!(
            e,
            CommError::NotDivisible {
                op: "all_to_all",
                what: "send and receive buffers",
                len: 10,
                world_size: 4
            }
        );
    }
    // Ranks that agree with themselves but not with each other.
    let errs = errors_of(2, |r| (2 + 2 * r, 2 + 2 * r));
    for e in errs {
        assert!(matches!(e, CommError::RankMismatch { .. }), "{e}");
    }
    // Element types must match.
    let errs = run_ranks_each(2, Duration::from_secs(10), |comm| {
        let dev = comm.device().clone();
        let x = dev.zeros::<f32>(4)?;
        let mut y = dev.zeros::<bf16>(4)?;
        comm.all_to_all((&x).into(), (&mut y).into())
    })
    .unwrap();
    for e in errs {
        assert!(matches!(e, Err(CommError::DTypeMismatch { .. })), "{e:?}");
    }
}

/// NCCL at world size 1: the all-to-all is a copy through one send/receive pair, for every element type
/// and a length that is not a multiple of anything convenient; sizes are checked before NCCL sees them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_size_one_all_to_all() {
    use fsdp_comm::nccl::{NcclComm, NcclConfig};
    use fsdp_comm::DistEnv;
    let comm = NcclComm::from_dist_env(&DistEnv::single(), &NcclConfig::default())
        .unwrap_or_else(|e| panic!("NCCL at world size 1: {e}"));
    let dev = comm.device().clone();
    for kind in KINDS {
        for len in [1usize, 1000, 65_537] {
            let x = input(kind, len, 0, 11);
            let xb = Buf::new(&dev, kind, &x);
            let mut y = Buf::new(&dev, kind, &vec![0x55; len]);
            comm.all_to_all(xb.send(kind), y.recv(kind))
                .unwrap_or_else(|e| panic!("{kind:?} len {len}: {e}"));
            assert_eq!(y.bits(), x, "{kind:?} len {len}");
            let mut z = Buf::new(&dev, kind, &vec![0x55; len]);
            let work = comm.all_to_all_async(xb.send(kind), z.recv(kind)).unwrap();
            work.wait().unwrap();
            assert_eq!(z.bits(), x, "{kind:?} len {len}, async");
        }
    }
    let x = dev.zeros::<f32>(8).unwrap();
    let mut y = dev.zeros::<f32>(9).unwrap();
    assert!(matches!(
        comm.all_to_all((&x).into(), (&mut y).into()),
        Err(CommError::LengthMismatch { .. })
    ));
}
