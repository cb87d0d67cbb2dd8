//! The sharded-state interface optimizers implement, so checkpoints and memory accounting can see their
//! states without this crate depending on any optimizer.

use crate::layout::ParamGroup;
use crate::ShardError;
use fp8_core::QType;

/// One state tensor of one unit group on this rank: a shard in the group's flat layout (same length as the
/// parameter shard), with one scale per parameter slot when it is stored in a scaled low-precision type.
///
/// Scales are per parameter and agreed across ranks (the optimizer all-reduces the amaxes), so a state
/// shard reshards exactly: the bytes are cut and concatenated like the parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct StateShard {
    /// State name, e.g. `exp_avg`, `exp_avg_sq`, `master`.
    pub name: String,
    /// Unit index.
    pub unit: usize,
    /// Group within the unit.
    pub group: ParamGroup,
    /// Storage type of `bytes`.
    pub qtype: QType,
    /// This rank's shard, little-endian.
    pub bytes: Vec<u8>,
    /// `scale` per slot of the group (empty for unscaled F32 states). Stored values are `x * scale`.
    pub slot_scales: Vec<f32>,
}

/// Implemented by optimizers (and anything else holding per-shard state).
pub trait ShardedState {
    /// Every state shard this rank holds, copied to the host.
    fn export_state(&self) -> Result<Vec<StateShard>, ShardError>;
    /// Replaces the states with `shards` (same names, units, groups and lengths as exported).
    fn import_state(&mut self, shards: Vec<StateShard>) -> Result<(), ShardError>;
    /// Bytes of state held on this rank.
    fn state_bytes(&self) -> usize;
    /// Scalar state to checkpoint (step counters, schedule position), as key/value strings.
    fn scalar_state(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Restores the scalar state.
    fn load_scalar_state(&mut self, _values: &[(String, String)]) -> Result<(), ShardError> {
        Ok(())
    }
}
