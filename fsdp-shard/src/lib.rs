//! Flat-parameter units for FSDP (ZeRO-3).
//!
//! Planned: flatten, pad and shard parameters; FP8 weight shards with per-tensor metas; all-gather before
//! compute; gradient reduce-scatter in F32/BF16 or FP8; gradient accumulation; checkpoints that reshard.
//!
//! ```
//! assert_eq!(fsdp_shard::CRATE_NAME, "fsdp-shard");
//! ```
#![warn(missing_docs)]

/// The crate name, until the units land.
pub const CRATE_NAME: &str = "fsdp-shard";
