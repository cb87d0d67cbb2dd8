//! How a model's parameters are grouped into flat-parameter units and split into equal shards.
//!
//! A model declares its parameters ([`ParamSpec`]) in order; a [`WrapPolicy`] groups them into units. Within a
//! unit, parameters of the same storage group ([`ParamGroup`]: FP8 linear weights, or plain F32 tensors) are laid
//! end to end in one flat buffer, each starting at a multiple of [`ALIGN`] elements. The buffer is padded to a
//! multiple of `ALIGN * world_size` so every rank's shard has the same length and starts aligned. Offsets do
//! not depend on the world size (only the tail padding does), which makes resharding a matter of
//! concatenating shards and cutting them again.
//!
//! Block-scaled FP8 weights ([`ParamKind::Fp8BlockWeight`]: one scale per 128x128 block) are cut
//! differently: a rank must hold whole 128-row block rows of each weight, so that it quantizes its rows
//! from its own master shard with no scale agreement across ranks. Their group is not padded; its shards
//! end on block-row boundaries chosen as close as possible to equal shares ([`GroupLayout::shard_range`]),
//! so shards are uneven (a rank may even hold none). Offsets still do not depend on the world size, only
//! the cut points, and resharding stays a matter of concatenating and cutting again. Beside the codes
//! the group has a flat buffer of inverse block scales ([`GroupLayout::block_scales`]), laid out per
//! weight in the order the block-scaled GEMM reads (block rows of `round_up(ceil(in/128), 4)` values)
//! and cut at the same block rows.

use crate::ShardError;
use serde::{Deserialize, Serialize};

/// Every parameter starts at a multiple of this many elements (cuBLASLt and 16-byte vector loads need it).
pub const ALIGN: usize = 16;

/// What kind of parameter this is, which decides its storage group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParamKind {
    /// The weight of an FP8 linear layer: gathered as FP8 E4M3 (one byte per element), one `ScalingMeta` each.
    Fp8Weight,
    /// The weight of a block-scaled FP8 linear layer: gathered as E4M3 codes with one inverse scale per
    /// 128x128 block; its group's shards end on 128-row block rows (see the module docs).
    Fp8BlockWeight,
    /// Any other parameter (bias, convolution kernel, BF16/F32 linear weight): gathered as F32.
    Plain,
}

/// The flat buffers of a unit: one per storage dtype, since a collective moves one dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParamGroup {
    /// FP8 weights (bytes on the wire, F32 gradients).
    Fp8,
    /// Plain F32 parameters.
    Plain,
}

impl ParamGroup {
    /// Both groups, in a fixed order.
    pub const ALL: [ParamGroup; 2] = [ParamGroup::Fp8, ParamGroup::Plain];

    /// Short name used in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            ParamGroup::Fp8 => "fp8",
            ParamGroup::Plain => "plain",
        }
    }
}

impl ParamKind {
    /// The storage group of this kind.
    pub fn group(self) -> ParamGroup {
        match self {
            ParamKind::Fp8Weight | ParamKind::Fp8BlockWeight => ParamGroup::Fp8,
            ParamKind::Plain => ParamGroup::Plain,
        }
    }
}

/// One parameter of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Unique name, e.g. `fc1.weight`.
    pub name: String,
    /// The module (layer) it belongs to, e.g. `fc1`; wrap policies group by module.
    pub module: String,
    /// Shape (row-major). FP8 weights are `[out_features, in_features]`.
    pub shape: Vec<usize>,
    /// Kind, which decides the storage group.
    pub kind: ParamKind,
    /// Whether weight decay applies (the optimizer's parameter groups). [`ParamSpec::new`] sets it for
    /// matrices (two or more dimensions), not for vectors (biases, norm weights).
    #[serde(default)]
    pub decay: bool,
}

impl ParamSpec {
    /// A parameter of `module` named `module.local`.
    pub fn new(module: &str, local: &str, shape: &[usize], kind: ParamKind) -> Self {
        ParamSpec {
            name: format!("{module}.{local}"),
            module: module.to_string(),
            shape: shape.to_vec(),
            kind,
            decay: shape.len() >= 2,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// How parameters are grouped into units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WrapPolicy {
    /// Every module is its own unit.
    PerModule,
    /// Modules with at least this many parameters get their own unit; the rest share one root unit (placed
    /// first), like PyTorch's `size_based_auto_wrap_policy`.
    MinParams(usize),
    /// One unit for the whole model.
    Single,
    /// One unit per direct child of the named module (`ChildrenOf("h")`: units `h.0`, `h.1`, ... with
    /// every parameter below each), in first-appearance order; the root unit (placed first) holds the
    /// rest. The policy for a stack of blocks: a transformer's `h.N`.
    ChildrenOf(String),
}

/// Where one parameter sits in its group's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSlot {
    /// Index into the model's parameter list.
    pub param: usize,
    /// Offset in elements (a multiple of [`ALIGN`]).
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
    /// Columns of a 2-D parameter (`in_features` of a weight); the block rows of a block-scaled weight
    /// are `BLOCK_ROWS * cols` elements. 0 in layouts written before block-scaled weights existed.
    #[serde(default)]
    pub cols: usize,
}

/// Rows (and columns) of a block of a block-scaled FP8 weight.
pub const BLOCK_ROWS: usize = 128;

/// Inverse block scales of each row of blocks are padded to a multiple of this many values (16 bytes,
/// the alignment the block-scaled GEMM wants of its scales).
pub const SCALE_ROW_ALIGN: usize = 4;

/// Where the inverse block scales of one block-scaled weight sit in its group's scale buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockScaleSlot {
    /// Offset in the scale buffer (a multiple of [`SCALE_ROW_ALIGN`]).
    pub offset: usize,
    /// Rows of blocks, `ceil(rows / 128)`.
    pub block_rows: usize,
    /// Values per row of blocks: `ceil(cols / 128)` rounded up to [`SCALE_ROW_ALIGN`].
    pub row_len: usize,
}

impl BlockScaleSlot {
    /// Number of values (padding included).
    pub fn len(&self) -> usize {
        self.block_rows * self.row_len
    }

    /// Whether the weight has no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One flat buffer of a unit: its parameters and its unpadded length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLayout {
    /// The storage group.
    pub group: ParamGroup,
    /// Parameters in buffer order.
    pub slots: Vec<ParamSlot>,
    /// End of the last parameter, rounded up to [`ALIGN`].
    pub len: usize,
    /// The group holds block-scaled FP8 weights: its shards end on their block rows and it has a scale
    /// buffer (see the module docs).
    #[serde(default)]
    pub block_scaled: bool,
}

impl GroupLayout {
    /// Length of the gathered buffer: padded so `world_size` equal shards each start at a multiple of
    /// [`ALIGN`]; a block-scaled group is not padded (its shards are uneven).
    pub fn padded_len(&self, world_size: usize) -> usize {
        if self.block_scaled {
            return self.len;
        }
        let q = ALIGN * world_size.max(1);
        self.len.div_ceil(q) * q
    }

    /// Elements of every rank's stored shard: the equal share, or for a block-scaled group the largest
    /// shard (every rank stores its shard padded to that length with zeros, so the all-gather and the
    /// reduce-scatter move equal chunks; the rank's real elements are the first
    /// `shard_range(rank).len()`).
    pub fn shard_len(&self, world_size: usize) -> usize {
        if self.block_scaled {
            return self.shard_counts(world_size).into_iter().max().unwrap_or(0);
        }
        self.padded_len(world_size) / world_size.max(1)
    }

    /// Whether every rank's shard has the same length (not so for a block-scaled group).
    pub fn is_even(&self) -> bool {
        !self.block_scaled
    }

    /// The `[start, end)` range of the flat buffer that `rank` holds.
    pub fn shard_range(&self, rank: usize, world_size: usize) -> std::ops::Range<usize> {
        if self.block_scaled {
            let cuts = self.cuts(world_size);
            let r = rank.min(world_size.max(1) - 1);
            return cuts[r]..cuts[r + 1];
        }
        let s = self.shard_len(world_size);
        rank * s..(rank + 1) * s
    }

    /// Every rank's shard range, in rank order (the cut points computed once).
    pub fn shard_ranges(&self, world_size: usize) -> Vec<std::ops::Range<usize>> {
        let ws = world_size.max(1);
        if self.block_scaled {
            let cuts = self.cuts(ws);
            return cuts.windows(2).map(|c| c[0]..c[1]).collect();
        }
        (0..ws).map(|r| self.shard_range(r, ws)).collect()
    }

    /// Every rank's shard length, in rank order (they add up to [`GroupLayout::padded_len`]).
    pub fn shard_counts(&self, world_size: usize) -> Vec<usize> {
        self.shard_ranges(world_size)
            .into_iter()
            .map(|r| r.len())
            .collect()
    }

    /// The group's flat data from the concatenation of every rank's stored shard (an all-gather of
    /// them): as it is for an even group; a block-scaled group's padding after each rank's real
    /// elements dropped.
    pub fn compact_gathered<T: Copy>(&self, gathered: &[T], world_size: usize) -> Vec<T> {
        if !self.block_scaled {
            return gathered.to_vec();
        }
        let ws = world_size.max(1);
        let stored = self.shard_len(ws);
        let mut out = Vec::with_capacity(self.len);
        for (r, n) in self.shard_counts(ws).into_iter().enumerate() {
            if let Some(piece) = gathered.get(r * stored..r * stored + n) {
                out.extend_from_slice(piece);
            }
        }
        out
    }

    /// Positions where a shard of a block-scaled group may end: every block-row start of every weight
    /// and the group's end, ascending.
    fn cut_candidates(&self) -> Vec<usize> {
        let mut c = Vec::new();
        for s in &self.slots {
            let step = BLOCK_ROWS * s.cols.max(1);
            let mut p = s.offset;
            while p < s.offset + s.numel {
                c.push(p);
                p += step;
            }
        }
        c.push(self.len);
        c
    }

    /// The `world_size + 1` cut points of a block-scaled group: `0`, then for each rank boundary the
    /// allowed position nearest to an equal share (ties to the lower one, never before the previous
    /// cut), then the group's end.
    fn cuts(&self, world_size: usize) -> Vec<usize> {
        let ws = world_size.max(1);
        let cand = self.cut_candidates();
        let mut cuts = Vec::with_capacity(ws + 1);
        cuts.push(0);
        for r in 1..ws {
            let target = (self.len as u128 * r as u128 / ws as u128) as usize;
            let prev = cuts[r - 1];
            let best = cand
                .iter()
                .copied()
                .filter(|&c| c >= prev)
                .min_by_key(|&c| c.abs_diff(target))
                .unwrap_or(self.len);
            cuts.push(best);
        }
        cuts.push(self.len);
        cuts
    }

    /// Where each slot's inverse block scales sit in the group's scale buffer (empty unless the group
    /// is block-scaled), in slot order.
    pub fn block_scales(&self) -> Vec<BlockScaleSlot> {
        if !self.block_scaled {
            return Vec::new();
        }
        let mut offset = 0;
        self.slots
            .iter()
            .map(|s| {
                let cols = s.cols.max(1);
                let rows = s.numel / cols;
                let slot = BlockScaleSlot {
                    offset,
                    block_rows: rows.div_ceil(BLOCK_ROWS),
                    row_len: cols.div_ceil(BLOCK_ROWS).next_multiple_of(SCALE_ROW_ALIGN),
                };
                offset += slot.len();
                slot
            })
            .collect()
    }

    /// Length of the group's scale buffer (0 unless block-scaled).
    pub fn scales_len(&self) -> usize {
        self.block_scales().last().map_or(0, |s| s.offset + s.len())
    }

    /// The index in the scale buffer that corresponds to code position `pos` (a block-row start of a
    /// slot, or a slot's or the group's end): the scales of the blocks from `pos` on start there.
    pub fn scale_position(&self, pos: usize) -> usize {
        self.scale_position_in(&self.block_scales(), pos)
    }

    /// [`GroupLayout::scale_position`] with the group's [`GroupLayout::block_scales`] given.
    fn scale_position_in(&self, scales: &[BlockScaleSlot], pos: usize) -> usize {
        for (s, b) in self.slots.iter().zip(scales) {
            if pos < s.offset + s.numel {
                let row = pos.saturating_sub(s.offset) / (BLOCK_ROWS * s.cols.max(1));
                return b.offset + row * b.row_len;
            }
        }
        scales.last().map_or(0, |s| s.offset + s.len())
    }

    /// The range of the scale buffer that `rank` holds (empty unless block-scaled).
    pub fn scale_range(&self, rank: usize, world_size: usize) -> std::ops::Range<usize> {
        if !self.block_scaled {
            return 0..0;
        }
        let (r, scales) = (self.shard_range(rank, world_size), self.block_scales());
        self.scale_position_in(&scales, r.start)..self.scale_position_in(&scales, r.end)
    }

    /// Every rank's scale range, in rank order (empty ranges unless block-scaled).
    pub fn scale_ranges(&self, world_size: usize) -> Vec<std::ops::Range<usize>> {
        let scales = self.block_scales();
        self.shard_ranges(world_size)
            .into_iter()
            .map(|r| {
                if self.block_scaled {
                    self.scale_position_in(&scales, r.start)..self.scale_position_in(&scales, r.end)
                } else {
                    0..0
                }
            })
            .collect()
    }

    /// Length of every rank's stored scale shard: the largest scale range (shards are stored padded to
    /// one length so the all-gather moves equal chunks).
    pub fn scale_shard_len(&self, world_size: usize) -> usize {
        self.scale_counts(world_size).into_iter().max().unwrap_or(0)
    }

    /// Every rank's scale-shard length, in rank order.
    pub fn scale_counts(&self, world_size: usize) -> Vec<usize> {
        self.scale_ranges(world_size)
            .into_iter()
            .map(|r| r.len())
            .collect()
    }

    /// Whether the group holds no parameter.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// A unit: a set of parameters gathered, computed with and freed together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitLayout {
    /// Unit name (the module name, or `root`).
    pub name: String,
    /// The FP8 group and the plain group, in [`ParamGroup::ALL`] order.
    pub groups: [GroupLayout; 2],
}

impl UnitLayout {
    /// The layout of one group.
    pub fn group(&self, g: ParamGroup) -> &GroupLayout {
        &self.groups[g as usize]
    }

    /// Finds a parameter's group and slot.
    pub fn find(&self, param: usize) -> Option<(ParamGroup, &ParamSlot)> {
        ParamGroup::ALL.into_iter().find_map(|g| {
            self.group(g)
                .slots
                .iter()
                .find(|s| s.param == param)
                .map(|s| (g, s))
        })
    }
}

/// Where a parameter is: its unit, group and position in the group's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamLocation {
    /// Unit index.
    pub unit: usize,
    /// Storage group.
    pub group: ParamGroup,
    /// Index in the group's slot list.
    pub slot: usize,
}

/// The whole model's layout: parameters and units. Identical on every rank and independent of the world size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "LayoutParts")]
pub struct ModelLayout {
    /// Parameters in declaration order.
    pub params: Vec<ParamSpec>,
    /// Units in execution order.
    pub units: Vec<UnitLayout>,
    /// Where each parameter is, by parameter index (derived from `units`; a constant-time look-up).
    #[serde(skip)]
    locations: Vec<Option<ParamLocation>>,
}

/// The serialized form of a [`ModelLayout`] (the location index is rebuilt on reading).
#[derive(Deserialize)]
struct LayoutParts {
    params: Vec<ParamSpec>,
    units: Vec<UnitLayout>,
}

impl From<LayoutParts> for ModelLayout {
    fn from(p: LayoutParts) -> Self {
        ModelLayout::from_parts(p.params, p.units)
    }
}

impl ModelLayout {
    /// Groups `params` into units by `policy`. Names must be unique and shapes non-empty in rank.
    pub fn new(params: Vec<ParamSpec>, policy: &WrapPolicy) -> Result<Self, ShardError> {
        for (i, p) in params.iter().enumerate() {
            if p.shape.is_empty() {
                return Err(ShardError::InvalidModel(format!(
                    "parameter {} has an empty shape",
                    p.name
                )));
            }
            if params[..i].iter().any(|q| q.name == p.name) {
                return Err(ShardError::InvalidModel(format!(
                    "parameter name {} appears twice",
                    p.name
                )));
            }
            if p.kind != ParamKind::Plain && p.shape.len() != 2 {
                return Err(ShardError::InvalidModel(format!(
                    "FP8 weight {} must be 2-D [out, in], got shape {:?}",
                    p.name, p.shape
                )));
            }
        }
        // Modules in first-appearance order, with their parameter indices.
        let mut modules: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            match modules.iter_mut().find(|(m, _)| *m == p.module) {
                Some((_, v)) => v.push(i),
                None => modules.push((p.module.clone(), vec![i])),
            }
        }
        let mut unit_params: Vec<(String, Vec<usize>)> = Vec::new();
        match policy {
            WrapPolicy::ChildrenOf(parent) => {
                let prefix = format!("{parent}.");
                let mut root = Vec::new();
                for (i, p) in params.iter().enumerate() {
                    let child = p
                        .module
                        .strip_prefix(&prefix)
                        .and_then(|rest| rest.split('.').next())
                        .filter(|c| !c.is_empty());
                    match child {
                        Some(c) => {
                            let name = format!("{prefix}{c}");
                            match unit_params.iter_mut().find(|(n, _)| *n == name) {
                                Some((_, v)) => v.push(i),
                                None => unit_params.push((name, vec![i])),
                            }
                        }
                        None => root.push(i),
                    }
                }
                if unit_params.is_empty() {
                    return Err(ShardError::InvalidModel(format!(
                        "wrap policy ChildrenOf({parent:?}): no parameter below a child of {parent:?}"
                    )));
                }
                if !root.is_empty() {
                    unit_params.insert(0, ("root".into(), root));
                }
            }
            WrapPolicy::PerModule => unit_params = modules,
            WrapPolicy::Single => {
                unit_params.push(("root".into(), (0..params.len()).collect()));
            }
            WrapPolicy::MinParams(min) => {
                let mut root = Vec::new();
                for (m, idx) in modules {
                    let count: usize = idx.iter().map(|&i| params[i].numel()).sum();
                    if count >= *min {
                        unit_params.push((m, idx));
                    } else {
                        root.extend(idx);
                    }
                }
                if !root.is_empty() {
                    root.sort_unstable();
                    unit_params.insert(0, ("root".into(), root));
                }
            }
        }
        let units = unit_params
            .into_iter()
            .map(|(name, idx)| {
                let groups = ParamGroup::ALL.map(|g| {
                    let mut offset = 0;
                    let mut slots = Vec::new();
                    for &i in idx.iter().filter(|&&i| params[i].kind.group() == g) {
                        let numel = params[i].numel();
                        slots.push(ParamSlot {
                            param: i,
                            offset,
                            numel,
                            cols: params[i].shape.last().copied().unwrap_or(1),
                        });
                        offset += numel.div_ceil(ALIGN) * ALIGN;
                    }
                    let block_scaled = slots
                        .iter()
                        .any(|sl| params[sl.param].kind == ParamKind::Fp8BlockWeight);
                    GroupLayout {
                        group: g,
                        slots,
                        len: offset,
                        block_scaled,
                    }
                });
                UnitLayout { name, groups }
            })
            .collect::<Vec<UnitLayout>>();
        for u in &units {
            let g = u.group(ParamGroup::Fp8);
            let kinds = |k: ParamKind| g.slots.iter().any(|sl| params[sl.param].kind == k);
            if kinds(ParamKind::Fp8BlockWeight) && kinds(ParamKind::Fp8Weight) {
                return Err(ShardError::InvalidModel(format!(
                    "unit {} mixes per-tensor and block-scaled FP8 weights; a model uses one FP8 \
                     recipe for all its FP8 linears",
                    u.name
                )));
            }
        }
        Ok(ModelLayout::from_parts(params, units))
    }

    /// A layout from its parameters and units (e.g. deserialized), with the location index rebuilt.
    pub fn from_parts(params: Vec<ParamSpec>, units: Vec<UnitLayout>) -> Self {
        let mut locations = vec![None; params.len()];
        for (u, unit) in units.iter().enumerate() {
            for g in ParamGroup::ALL {
                for (slot, s) in unit.group(g).slots.iter().enumerate() {
                    if let Some(l) = locations.get_mut(s.param) {
                        *l = Some(ParamLocation {
                            unit: u,
                            group: g,
                            slot,
                        });
                    }
                }
            }
        }
        ModelLayout {
            params,
            units,
            locations,
        }
    }

    /// Where parameter `param` is (constant time).
    pub fn location(&self, param: usize) -> Option<ParamLocation> {
        self.locations.get(param).copied().flatten()
    }

    /// The index of the root unit (the one named `root`, which holds the parameters of no wrapped
    /// module: the model's first and last layers, tied parameters), if the policy made one.
    pub fn root_unit(&self) -> Option<usize> {
        self.units.iter().position(|u| u.name == "root")
    }

    /// Index of the parameter named `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }

    /// The unit index, group and slot of parameter `param` (constant time).
    pub fn locate(&self, param: usize) -> Option<(usize, ParamGroup, &ParamSlot)> {
        let l = self.location(param)?;
        let slot = self.units.get(l.unit)?.group(l.group).slots.get(l.slot)?;
        Some((l.unit, l.group, slot))
    }

    /// Total parameter count (unpadded).
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }
}

/// Copies `full` (a group's unpadded or padded flat data) into `out`, padded to `padded_len` with zeros.
pub fn pad_to<T: Copy + Default>(full: &[T], padded_len: usize) -> Vec<T> {
    let mut v = vec![T::default(); padded_len];
    let n = full.len().min(padded_len);
    v[..n].copy_from_slice(&full[..n]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mnist_params() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("conv1", "weight", &[32, 1, 3, 3], ParamKind::Plain),
            ParamSpec::new("conv1", "bias", &[32], ParamKind::Plain),
            ParamSpec::new("conv2", "weight", &[64, 32, 3, 3], ParamKind::Plain),
            ParamSpec::new("conv2", "bias", &[64], ParamKind::Plain),
            ParamSpec::new("fc1", "weight", &[128, 9216], ParamKind::Fp8Weight),
            ParamSpec::new("fc1", "bias", &[128], ParamKind::Plain),
            ParamSpec::new("fc2", "weight", &[10, 128], ParamKind::Fp8Weight),
            ParamSpec::new("fc2", "bias", &[10], ParamKind::Plain),
        ]
    }

    #[test]
    fn min_params_policy_matches_the_reference_wrapping() {
        let l = ModelLayout::new(mnist_params(), &WrapPolicy::MinParams(20000)).unwrap();
        assert_eq!(l.units.len(), 2);
        assert_eq!(l.units[0].name, "root");
        assert_eq!(l.units[1].name, "fc1");
        let root = &l.units[0];
        // conv1 w, conv1 b, conv2 w, conv2 b, fc2 b in the plain group; fc2 w in the FP8 group.
        let plain: Vec<usize> = root
            .group(ParamGroup::Plain)
            .slots
            .iter()
            .map(|s| s.param)
            .collect();
        assert_eq!(plain, vec![0, 1, 2, 3, 7]);
        assert_eq!(root.group(ParamGroup::Fp8).slots[0].param, 6);
        for u in &l.units {
            for g in &u.groups {
                for s in &g.slots {
                    assert_eq!(s.offset % ALIGN, 0);
                }
                for ws in [1, 2, 3, 4, 8] {
                    assert_eq!(g.padded_len(ws) % (ALIGN * ws), 0);
                    assert!(g.padded_len(ws) >= g.len);
                    assert_eq!(g.shard_len(ws) * ws, g.padded_len(ws));
                }
            }
        }
        assert_eq!(l.numel(), 1_199_882);
    }

    #[test]
    fn bad_models_are_errors() {
        let mut p = mnist_params();
        p.push(ParamSpec::new("fc2", "bias", &[10], ParamKind::Plain));
        assert!(ModelLayout::new(p, &WrapPolicy::PerModule).is_err());
        let p = vec![ParamSpec::new("x", "w", &[2, 3, 4], ParamKind::Fp8Weight)];
        assert!(ModelLayout::new(p, &WrapPolicy::PerModule).is_err());
        let p = vec![ParamSpec::new("x", "w", &[], ParamKind::Plain)];
        assert!(ModelLayout::new(p, &WrapPolicy::PerModule).is_err());
    }

    fn block_params() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("b.qkv", "weight", &[384, 256], ParamKind::Fp8BlockWeight),
            ParamSpec::new("b.o", "weight", &[200, 144], ParamKind::Fp8BlockWeight),
            ParamSpec::new("b.o", "bias", &[200], ParamKind::Plain),
            ParamSpec::new("b.fc", "weight", &[16, 1040], ParamKind::Fp8BlockWeight),
        ]
    }

    #[test]
    fn block_scaled_shards_end_on_block_rows_and_cover_the_group() {
        let l = ModelLayout::new(block_params(), &WrapPolicy::Single).unwrap();
        let g = l.units[0].group(ParamGroup::Fp8);
        assert!(g.block_scaled && !g.is_even());
        assert!(!l.units[0].group(ParamGroup::Plain).block_scaled);
        // Block-row starts of every weight, and the end.
        let mut allowed = vec![0, 128 * 256, 256 * 256];
        let o = g.slots[1].offset;
        allowed.extend([o, o + 128 * 144]);
        allowed.extend([g.slots[2].offset, g.len]);
        for ws in 1..=9 {
            let counts = g.shard_counts(ws);
            assert_eq!(counts.iter().sum::<usize>(), g.padded_len(ws));
            assert_eq!(g.padded_len(ws), g.len);
            let mut next = 0;
            for r in 0..ws {
                let range = g.shard_range(r, ws);
                assert_eq!(range.start, next, "ws {ws} rank {r}");
                assert!(allowed.contains(&range.end), "ws {ws}: cut {}", range.end);
                next = range.end;
            }
            assert_eq!(next, g.len);
            // Scales: contiguous ranges in rank order covering the scale buffer.
            let mut s_next = 0;
            for r in 0..ws {
                let sr = g.scale_range(r, ws);
                assert_eq!(sr.start, s_next);
                s_next = sr.end;
            }
            assert_eq!(s_next, g.scales_len());
        }
        // Two ranks: the cut nearest to half the group.
        let half = g.len / 2;
        let end0 = g.shard_range(0, 2).end;
        let best = allowed.iter().map(|a| a.abs_diff(half)).min().unwrap();
        assert_eq!(end0.abs_diff(half), best);
        let sc = g.block_scales();
        // 384 x 256: 3 block rows of 2 blocks padded to 4; 200 x 144: 2 x 2 -> 4; 16 x 1040: 1 x 9 -> 12.
        assert_eq!(
            sc.iter()
                .map(|b| (b.offset, b.block_rows, b.row_len))
                .collect::<Vec<_>>(),
            vec![(0, 3, 4), (12, 2, 4), (20, 1, 12)]
        );
        assert_eq!(g.scales_len(), 32);
        assert_eq!(g.scale_position(128 * 256), 4);
        assert_eq!(g.scale_position(o + 128 * 144), 16);
    }

    #[test]
    fn per_tensor_and_block_scaled_weights_do_not_share_a_unit() {
        let mut p = block_params();
        p.push(ParamSpec::new(
            "b.x",
            "weight",
            &[16, 16],
            ParamKind::Fp8Weight,
        ));
        let e = ModelLayout::new(p, &WrapPolicy::Single).unwrap_err();
        assert!(
            e.to_string().contains("mixes per-tensor and block-scaled"),
            "{e}"
        );
        let p = vec![ParamSpec::new(
            "x",
            "w",
            &[2, 3, 4],
            ParamKind::Fp8BlockWeight,
        )];
        assert!(ModelLayout::new(p, &WrapPolicy::PerModule).is_err());
    }
}
