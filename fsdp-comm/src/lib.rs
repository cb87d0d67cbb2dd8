//! Collectives for fully sharded data parallelism.
//!
//! One interface, [`Communicator`]: all-gather, reduce-scatter, all-reduce (sum, max, min), broadcast,
//! all-to-all and barrier on [`fp8_kernels::Buffer`]s of f32, bf16, f16, bytes, and FP8 E4M3/E5M2 codes
//! (sums rounded per step the way NCCL does), and variable-count forms for uneven shards
//! (`all_gather_v`, `reduce_scatter_v`, `all_to_all_v`; see [`collective`]). Two backends:
//!
//! - [`thread_group`]: ranks as threads of one process on the CPU, exchanging through shared memory,
//!   with a fixed reduction order ([`ring`]) so results are reproducible; [`run_ranks`] runs a closure
//!   on every rank.
//! - [`nccl`]: one process per GPU over NCCL, with a TCP [`rendezvous`] from torchrun-style environment
//!   variables, a watchdog and timeouts. Processes are started by the `fsdp-run` launcher ([`launch`]).
//!
//! Every wait is bounded: a rank that does not arrive ends in a timeout error on the others, a rank that
//! panics or fails poisons its group, and nothing hangs.
//!
//! ```
//! use fsdp_comm::{run_ranks, Communicator, CommError, ReduceOp};
//! use fp8_kernels::Device;
//!
//! // Four ranks: each contributes two values; all-gather concatenates them in rank order and
//! // reduce-scatter hands rank r the sum of chunk r.
//! let results = run_ranks(4, |comm| {
//!     let dev = Device::cpu();
//!     let r = comm.rank() as f32;
//!     let shard = dev.upload(&[r, 10.0 * r])?;
//!     let mut full = dev.zeros::<f32>(8)?;
//!     comm.all_gather((&shard).into(), (&mut full).into())?;
//!
//!     let grads = dev.upload(&[1.0f32; 8])?;
//!     let mut mine = dev.zeros::<f32>(2)?;
//!     comm.reduce_scatter((&grads).into(), (&mut mine).into(), ReduceOp::Sum)?;
//!     Ok::<_, CommError>((full.to_vec()?, mine.to_vec()?))
//! })?;
//! assert_eq!(results[2].0, vec![0.0, 0.0, 1.0, 10.0, 2.0, 20.0, 3.0, 30.0]);
//! assert_eq!(results[2].1, vec![4.0, 4.0]);
//! # Ok::<(), CommError>(())
//! ```
#![warn(missing_docs)]

pub mod collective;
mod error;
pub mod launch;
pub mod nccl;
pub mod rendezvous;
pub mod ring;
pub mod thread_group;

pub use collective::{
    Collective, CollectiveKind, CommDType, CommWork, Communicator, RecvBuf, ReduceOp, SendBuf,
};
pub use error::CommError;
pub use nccl::{NcclComm, NcclConfig};
pub use rendezvous::DistEnv;
pub use thread_group::{
    run_ranks, run_ranks_each, run_ranks_failures, run_ranks_timeout, RankFailures, ThreadComm,
    ThreadGroup, DEFAULT_THREAD_TIMEOUT, MAX_THREAD_RANKS,
};
