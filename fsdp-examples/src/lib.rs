//! Layers (`nn`), the MNIST FSDP example and the MLP benchmark.
//!
//! Planned: Conv2d, Linear in FP8/BF16/F32, pooling, dropout and losses; a distributed sampler; the
//! `mnist_fsdp` binary and the `mlp_bench` benchmark.
//!
//! ```
//! assert_eq!(fsdp_examples::CRATE_NAME, "fsdp-examples");
//! ```
#![warn(missing_docs)]

/// The crate name, until the examples land.
pub const CRATE_NAME: &str = "fsdp-examples";
