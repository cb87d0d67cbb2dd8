//! Collectives for fully sharded data parallelism.
//!
//! Planned: all-gather, reduce-scatter, all-reduce (sum, max, min), broadcast and barrier over device
//! buffers, with two backends: ranks as threads of one process (CPU) and NCCL (one process per GPU).
//!
//! ```
//! assert_eq!(fsdp_comm::CRATE_NAME, "fsdp-comm");
//! ```
#![warn(missing_docs)]

/// The crate name, until the collectives land.
pub const CRATE_NAME: &str = "fsdp-comm";
