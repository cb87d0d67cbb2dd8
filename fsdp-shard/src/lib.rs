//! Flat-parameter units for fully sharded data parallelism (ZeRO-3), with FP8 weight shards.
//!
//! A model declares its parameters ([`ParamSpec`]); a [`WrapPolicy`] groups them into units
//! ([`ModelLayout`]). Each unit keeps one flat buffer per storage group (FP8 linear weights as bytes, other
//! parameters as F32), every parameter starting at a multiple of 16 elements, padded so each rank holds an
//! equal shard. The unit gathers before compute, frees after, reduce-scatters gradients (exactly or in FP8),
//! accumulates micro-batches, and saves checkpoints that reshard from N to M ranks.
//!
//! ```
//! use fsdp_shard::{ModelLayout, ParamGroup, ParamKind, ParamSpec, WrapPolicy};
//!
//! let params = vec![
//!     ParamSpec::new("fc1", "weight", &[128, 9216], ParamKind::Fp8Weight),
//!     ParamSpec::new("fc1", "bias", &[128], ParamKind::Plain),
//!     ParamSpec::new("fc2", "weight", &[10, 128], ParamKind::Fp8Weight),
//!     ParamSpec::new("fc2", "bias", &[10], ParamKind::Plain),
//! ];
//! let layout = ModelLayout::new(params, &WrapPolicy::MinParams(20_000))?;
//! assert_eq!(layout.units.len(), 2); // fc2 in the root unit, fc1 alone
//! let fp8 = layout.units[1].group(ParamGroup::Fp8);
//! assert_eq!(fp8.shard_len(3) * 3, fp8.padded_len(3)); // equal shards on 3 ranks
//! # Ok::<(), fsdp_shard::ShardError>(())
//! ```
#![warn(missing_docs)]

pub mod checkpoint;
mod error;
pub mod fsdp;
pub mod full_weights;
pub mod grad;
pub mod layout;
pub mod memory;
pub mod model;
pub mod module;
pub mod scaling;
pub mod state;

pub use error::ShardError;
pub use fsdp::{Ctx, FsdpModel, Mode, Phase, UnitGradsReady};
pub use full_weights::{FullTensor, FullWeights, SafetensorsFile};
pub use grad::{GradReducer, GradReduction};
pub use layout::{
    BlockScaleSlot, GroupLayout, ModelLayout, ParamGroup, ParamKind, ParamLocation, ParamSlot,
    ParamSpec, UnitLayout, WrapPolicy, ALIGN, BLOCK_ROWS, SCALE_ROW_ALIGN,
};
pub use memory::MemoryReport;
pub use model::{
    decode_block_rows, quantize_block_rows, FsdpConfig, GatherDtype, GatheredParam, GradDtype,
    GradShard, PlainParam, ShardedModel, UnitShards,
};
pub use module::{
    param_seed, Module, ModulePath, ParamDecl, ParamId, ParamInit, ScalingDecl, ScalingId, Visitor,
};
pub use scaling::{ScalingRegistry, ScalingState, ScalingUse};
pub use state::{ShardedState, StateShard};
