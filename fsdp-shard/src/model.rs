//! [`ShardedModel`]: one rank's share of every unit, and the gather / reduce lifecycle.
//!
//! Per unit and rank it holds:
//! - the FP8 weight shard (`Buffer<u8>`, E4M3 codes) and the plain parameter shard (`Buffer<f32>`, which is
//!   also the master copy of plain parameters);
//! - for every FP8 weight of the unit, its scale and inverse scale in a small buffer on the device
//!   ([`UnitShards::weight_scales`]: `[scale_0, scale_inv_0, scale_1, scale_inv_1, ...]`), identical on every
//!   rank because it is computed from an all-reduced amax;
//! - the reduced gradient shards of both groups, F32 (the default: micro-batches add up exactly) or BF16
//!   ([`FsdpConfig::grad_dtype`], half the bytes: each reduction's F32 sum is added to the shard in f32 and
//!   rounded once to BF16);
//! - for block-scaled FP8 weights ([`ParamKind::Fp8BlockWeight`]), this rank's inverse block scales
//!   ([`UnitShards::block_scales`]): the rank's whole 128-row block rows are quantized from its own master
//!   rows, so no scale is agreed across ranks; the all-gather moves codes and scales (uneven shards);
//! - while gathered: each parameter cut out of the full flat buffers the all-gather wrote (each group's
//!   flat buffer is freed right after its cut; a group whose one parameter fills it becomes that parameter
//!   without a copy), minus parameters a module took out ([`ShardedModel::take_param`]);
//! - until reduced: the full flat gradients; on one rank, where the reduction is only an addition, either
//!   none (the gradients go to the shards, [`ShardedModel::grads_go_to_shards`]) or one buffer per
//!   parameter that got a gradient.
//!
//! Master weights of FP8 parameters are not here: the optimizer owns them, once.
//!
//! One file (over 800 lines) on purpose: gather, release and reduce act on the same per-unit buffers and
//! their invariants (what is live when) are checked in one place.

use crate::grad::{GradReducer, GradReduction};
use crate::layout::{ModelLayout, ParamGroup, BLOCK_ROWS};
use crate::memory::MemoryReport;
use crate::ShardError;
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use fp8_kernels::block_quantize::{block_quantize, BlockQuantLayout, BlockQuantSpec, ScaleOrder};
use fp8_kernels::cast::convert;
use fp8_kernels::elementwise::{add_at, scale};
use fp8_kernels::segmented::segmented_scales;
use fp8_kernels::{Buffer, Device};
use fsdp_comm::{CommWork, Communicator, RecvBuf, SendBuf};
use half::bf16;
use std::sync::Arc;

/// Makes the initial values of the given parameters (by index), in that order.
pub type UnitInit<'a> = dyn FnMut(&[usize]) -> Result<Vec<Vec<f32>>, ShardError> + 'a;

/// Options of a sharded model.
#[derive(Debug, Clone, PartialEq)]
pub struct FsdpConfig {
    /// Free the gathered parameters after forward and gather again for backward (ZeRO-3, the default);
    /// `false` keeps them until the unit's gradients are reduced (ZeRO-2-like: more memory, one gather less).
    pub reshard_after_forward: bool,
    /// How gradients are reduced across ranks.
    pub grad_reduction: GradReduction,
    /// Margin of the weights' current scaling (scale divided by `2^margin`).
    pub weight_margin: i32,
    /// Storage type of the reduced gradient shards (both groups).
    pub grad_dtype: GradDtype,
    /// Every reduced gradient is divided by this before it is added to the shards: 1 keeps the sum over
    /// the ranks; `world_size * micro_batches` makes the shards hold the mean gradient of the global
    /// batch, so a model's backward needs no `1 / (world_size * micro_batches)` factor of its own
    /// ([`ShardedModel::set_grad_divisor`] changes it between steps, as a trainer does when the last step
    /// of an epoch has fewer micro-batches).
    pub grad_divisor: f32,
    /// The model's seed: a parameter declared with [`crate::ParamDecl::seeded`] draws its initial values
    /// from [`crate::module::param_seed`] of this seed and its dotted name.
    pub init_seed: u64,
    /// The type plain parameters travel and are held in while gathered for compute (FSDP's
    /// `param_dtype` for the plain group): F32 (the default, exact) or BF16, which halves their
    /// all-gather and gathered bytes (each rank rounds its F32 master shard to BF16, nearest even, and
    /// the ranks gather that). The masters, the gradients and the optimizer stay F32; what must be exact
    /// (the consolidated checkpoint, [`crate::FsdpModel::gathered_params`]) gathers F32 whatever this
    /// says ([`ShardedModel::gather_exact`]).
    pub plain_gather_dtype: GatherDtype,
}

/// Storage type of gathered plain parameters ([`FsdpConfig::plain_gather_dtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GatherDtype {
    /// F32: the master values.
    #[default]
    F32,
    /// BF16: the master values rounded to nearest even.
    Bf16,
}

/// Storage type of the reduced gradient shards.
///
/// BF16 shards halve the gradient bytes (2 per parameter instead of 4). Each reduction (one per
/// [`ShardedModel::reduce_grads`]) is summed as the reduction mode says (exactly in F32 by default), added
/// to the shard's current value in f32 and rounded once to BF16 (nearest even). So one micro-batch per
/// step rounds the exact F32 sum once; `k` synchronised micro-batches round `k` times (a relative error
/// up to about `k * 2^-9` of the running sum). For many micro-batches keep F32 shards, or accumulate in the
/// full F32 buffers without syncing ([`ShardedModel::set_grad_sync`]) and reduce once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GradDtype {
    /// F32 shards (exact accumulation).
    #[default]
    F32,
    /// BF16 shards.
    Bf16,
}

impl GradDtype {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            GradDtype::F32 => 4,
            GradDtype::Bf16 => 2,
        }
    }

    /// `"f32"` or `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            GradDtype::F32 => "f32",
            GradDtype::Bf16 => "bf16",
        }
    }
}

/// One gradient shard, in its storage type.
#[derive(Debug, Clone, Copy)]
pub enum GradShard<'a> {
    /// F32 shard.
    F32(&'a Buffer<f32>),
    /// BF16 shard.
    Bf16(&'a Buffer<bf16>),
}

impl GradShard<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GradShard::F32(b) => b.len(),
            GradShard::Bf16(b) => b.len(),
        }
    }

    /// Whether the shard is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f32 (a host copy; reads the device).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, ShardError> {
        Ok(match self {
            GradShard::F32(b) => b.to_vec()?,
            GradShard::Bf16(b) => b.to_vec()?.into_iter().map(bf16::to_f32).collect(),
        })
    }
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            reshard_after_forward: true,
            grad_reduction: GradReduction::F32,
            weight_margin: 0,
            grad_dtype: GradDtype::F32,
            grad_divisor: 1.0,
            init_seed: 0,
            plain_gather_dtype: GatherDtype::F32,
        }
    }
}

/// A parameter cut out of a gathered unit.
#[derive(Debug)]
pub enum GatheredParam {
    /// An FP8 weight: E4M3 codes `[out, in]` (row-major) and its scale pair (`[scale, scale_inv]`, on the
    /// device, for GEMM scale pointers).
    Fp8 {
        /// E4M3 codes.
        codes: Buffer<u8>,
        /// `[scale, scale_inv]`.
        scales: Buffer<f32>,
    },
    /// A block-scaled FP8 weight: E4M3 codes `[out, in]` (row-major) and one inverse scale per 128x128
    /// block in the order the block-scaled GEMM reads (`fp8_kernels::block_quantize::ScaleOrder::Gemm`:
    /// row-major over the blocks, each row of blocks padded to a multiple of 4 values).
    Fp8Block {
        /// E4M3 codes.
        codes: Buffer<u8>,
        /// Inverse block scales.
        scale_inv: Buffer<f32>,
        /// Columns (`in`) of the weight.
        cols: usize,
    },
    /// A plain F32 parameter.
    Plain(Buffer<f32>),
    /// A plain parameter gathered in BF16 ([`GatherDtype::Bf16`]).
    PlainBf16(Buffer<bf16>),
}

/// A gathered plain parameter in the type it was gathered in ([`FsdpConfig::plain_gather_dtype`]).
#[derive(Debug, Clone, Copy)]
pub enum PlainParam<'a> {
    /// The F32 master values.
    F32(&'a Buffer<f32>),
    /// The master values rounded to BF16.
    Bf16(&'a Buffer<bf16>),
}

impl PlainParam<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            PlainParam::F32(b) => b.len(),
            PlainParam::Bf16(b) => b.len(),
        }
    }

    /// Whether the parameter has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl GatheredParam {
    /// A plain parameter as [`PlainParam`]; `None` for an FP8 weight.
    pub fn as_plain(&self) -> Option<PlainParam<'_>> {
        match self {
            GatheredParam::Plain(b) => Some(PlainParam::F32(b)),
            GatheredParam::PlainBf16(b) => Some(PlainParam::Bf16(b)),
            GatheredParam::Fp8 { .. } | GatheredParam::Fp8Block { .. } => None,
        }
    }

    /// The values as F32 on the host: an FP8 weight decoded with its `scale_inv`.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, ShardError> {
        match self {
            GatheredParam::Plain(b) => Ok(b.to_vec()?),
            GatheredParam::PlainBf16(b) => Ok(b.to_vec()?.into_iter().map(bf16::to_f32).collect()),
            GatheredParam::Fp8 { codes, scales } => {
                let c = codes.to_vec()?;
                let inv = scales.to_vec()?.get(1).copied().ok_or_else(|| {
                    ShardError::State("an FP8 weight without its scale pair".into())
                })?;
                let mut v = vec![0f32; c.len()];
                fp8_core::Fp8Format::E4M3.decode_scaled(&c, inv, &mut v)?;
                Ok(v)
            }
            GatheredParam::Fp8Block {
                codes,
                scale_inv,
                cols,
            } => decode_block_rows(&codes.to_vec()?, &scale_inv.to_vec()?, *cols),
        }
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<GatheredParam, ShardError> {
        fn copy<T: fp8_kernels::Element>(b: &Buffer<T>) -> Result<Buffer<T>, ShardError> {
            Ok(b.to_device(&b.device())?)
        }
        Ok(match self {
            GatheredParam::Fp8 { codes, scales } => GatheredParam::Fp8 {
                codes: copy(codes)?,
                scales: copy(scales)?,
            },
            GatheredParam::Fp8Block {
                codes,
                scale_inv,
                cols,
            } => GatheredParam::Fp8Block {
                codes: copy(codes)?,
                scale_inv: copy(scale_inv)?,
                cols: *cols,
            },
            GatheredParam::Plain(b) => GatheredParam::Plain(copy(b)?),
            GatheredParam::PlainBf16(b) => GatheredParam::PlainBf16(copy(b)?),
        })
    }

    /// Bytes held.
    fn num_bytes(&self) -> usize {
        match self {
            GatheredParam::Fp8 { codes, scales } => codes.num_bytes() + scales.num_bytes(),
            GatheredParam::Fp8Block {
                codes, scale_inv, ..
            } => codes.num_bytes() + scale_inv.num_bytes(),
            GatheredParam::Plain(b) => b.num_bytes(),
            GatheredParam::PlainBf16(b) => b.num_bytes(),
        }
    }
}

/// Decodes row-major block-scaled codes of width `cols` (128x128 blocks, scales as
/// [`GatheredParam::Fp8Block`] stores them) to F32 on the host.
pub fn decode_block_rows(
    codes: &[u8],
    scale_inv: &[f32],
    cols: usize,
) -> Result<Vec<f32>, ShardError> {
    use crate::layout::{BLOCK_ROWS, SCALE_ROW_ALIGN};
    if cols == 0 || codes.len() % cols != 0 {
        return Err(ShardError::InvalidArgument(format!(
            "{} block-scaled codes are not rows of {cols}",
            codes.len()
        )));
    }
    let row_len = cols.div_ceil(BLOCK_ROWS).next_multiple_of(SCALE_ROW_ALIGN);
    let rows = codes.len() / cols;
    if scale_inv.len() != rows.div_ceil(BLOCK_ROWS) * row_len {
        return Err(ShardError::InvalidArgument(format!(
            "{} inverse scales for a {rows} x {cols} block-scaled weight",
            scale_inv.len()
        )));
    }
    let mut out = vec![0f32; codes.len()];
    for (i, (c, o)) in codes.chunks(cols).zip(out.chunks_mut(cols)).enumerate() {
        let srow = &scale_inv[(i / BLOCK_ROWS) * row_len..];
        for (j, (cc, oo)) in c
            .chunks(BLOCK_ROWS)
            .zip(o.chunks_mut(BLOCK_ROWS))
            .enumerate()
        {
            Fp8Format::E4M3.decode_scaled(cc, srow[j], oo)?;
        }
    }
    Ok(out)
}

/// Quantizes the row-major `[values.len() / cols, cols]` rows of a block-scaled weight on the host (the
/// CPU kernel, the reference of the optimizer's device cast): codes and inverse scales in the layout of
/// [`GatheredParam::Fp8Block`].
pub fn quantize_block_rows(values: &[f32], cols: usize) -> Result<(Vec<u8>, Vec<f32>), ShardError> {
    if cols == 0 || values.len() % cols != 0 {
        return Err(ShardError::InvalidArgument(format!(
            "{} values are not rows of {cols}",
            values.len()
        )));
    }
    let rows = values.len() / cols;
    let spec = BlockQuantSpec::new(BlockQuantLayout::Blocks128x128, Fp8Format::E4M3)
        .with_scale_order(ScaleOrder::Gemm);
    let layout = spec.layout.output_layout(rows, cols)?;
    let n_scales = spec.scale_order.strides(&layout)?.len;
    let cpu = Device::Cpu;
    let x = cpu.upload(values)?;
    let mut codes = cpu.zeros::<u8>(values.len())?;
    let mut scale = cpu.zeros::<f32>(n_scales)?;
    let mut scale_inv = cpu.zeros::<f32>(n_scales)?;
    block_quantize(
        &x,
        [rows, cols],
        spec,
        &mut codes,
        &mut scale,
        &mut scale_inv,
    )?;
    Ok((codes.to_vec()?, scale_inv.to_vec()?))
}

/// One unit's shards on this rank.
#[derive(Debug)]
pub struct UnitShards {
    /// This rank's E4M3 codes of the unit's FP8 weights (padded flat layout).
    pub fp8: Buffer<u8>,
    /// This rank's plain parameters (padded flat layout); the master copy of plain parameters.
    pub plain: Buffer<f32>,
    /// `[scale, scale_inv]` of every FP8 weight of the unit, in slot order. For block-scaled weights
    /// it is the per-tensor pair of the whole weight, kept as a bound for the optimizer's master scale;
    /// the codes use [`UnitShards::block_scales`].
    pub weight_scales: Buffer<f32>,
    /// This rank's inverse block scales of block-scaled FP8 weights (the group's scale buffer cut at the
    /// rank's block rows, [`crate::GroupLayout::scale_range`], stored padded to
    /// [`crate::GroupLayout::scale_shard_len`]); empty for per-tensor weights.
    pub block_scales: Buffer<f32>,
    /// Reduced gradient shards of the FP8 group and the plain group when they are F32 (the default
    /// [`GradDtype`]); empty when the model keeps BF16 shards.
    pub grads: [Buffer<f32>; 2],
    /// Reduced gradient shards when they are BF16 ([`GradDtype::Bf16`]); empty otherwise.
    pub grads_bf16: [Buffer<bf16>; 2],
    /// Full gradients of the current backward, before reduction.
    full_grads: [Option<FullGrad>; 2],
    /// Per group: gradients went straight into the shard since its last reduction (one rank, see
    /// [`ShardedModel::grads_go_to_shards`]).
    direct_grads: [bool; 2],
    /// Parameters of the gathered unit, per group in slot order; `None` where a module took the
    /// parameter out ([`ShardedModel::take_param`]).
    gathered: Option<[Vec<Option<GatheredParam>>; 2]>,
    /// An all-gather issued by [`ShardedModel::gather_async`] and not yet waited for.
    pending: Option<PendingGather>,
}

impl UnitShards {
    /// Bytes of the unit's reduced gradient shards held now.
    fn grad_shard_bytes(&self) -> usize {
        self.grads.iter().map(Buffer::num_bytes).sum::<usize>()
            + self.grads_bf16.iter().map(Buffer::num_bytes).sum::<usize>()
    }

    /// The reduced gradient shard of group `g` (index of [`ParamGroup`]), in its storage type.
    pub fn grad(&self, g: ParamGroup) -> GradShard<'_> {
        let i = g as usize;
        if self.grads_bf16[i].is_empty() && !self.grads[i].is_empty() {
            GradShard::F32(&self.grads[i])
        } else if !self.grads_bf16[i].is_empty() {
            GradShard::Bf16(&self.grads_bf16[i])
        } else {
            // Both empty (an empty group): either view is the same empty shard.
            GradShard::F32(&self.grads[i])
        }
    }
}

/// A group's full gradient of the current backward, before its reduction.
#[derive(Debug)]
enum FullGrad {
    /// One flat buffer of the group's padded length: what the reduce-scatter takes.
    Flat(Buffer<f32>),
    /// One rank with an F32 reduction: a buffer per parameter (in slot order), made on the parameter's
    /// first gradient. Nothing is communicated, so nothing needs the group contiguous, and a parameter
    /// whose gradient comes late in the backward (a token embedding, last) holds no memory before it.
    PerParam(Vec<Option<Buffer<f32>>>),
}

impl FullGrad {
    fn num_bytes(&self) -> usize {
        match self {
            FullGrad::Flat(b) => b.num_bytes(),
            FullGrad::PerParam(v) => v.iter().flatten().map(Buffer::num_bytes).sum(),
        }
    }
}

/// The full flat buffers an all-gather is writing, and the handles of its collectives.
#[derive(Debug)]
struct PendingGather {
    fp8: Option<Buffer<u8>>,
    /// Inverse block scales of block-scaled weights.
    scales: Option<Buffer<f32>>,
    plain: Option<Buffer<f32>>,
    /// The plain group gathered in BF16, and this rank's shard rounded to BF16 (the all-gather's send
    /// buffer, kept until the collective is waited for).
    plain_bf16: Option<(Buffer<bf16>, Buffer<bf16>)>,
    works: Vec<CommWork>,
}

impl PendingGather {
    fn num_bytes(&self) -> usize {
        self.fp8.as_ref().map_or(0, Buffer::num_bytes)
            + self.scales.as_ref().map_or(0, Buffer::num_bytes)
            + self.plain.as_ref().map_or(0, Buffer::num_bytes)
            + self
                .plain_bf16
                .as_ref()
                .map_or(0, |(full, send)| full.num_bytes() + send.num_bytes())
    }
}

/// The `(slot index, local range)` pieces of rank `rank`'s shard of an FP8 group.
fn shard_segments(
    g: &crate::layout::GroupLayout,
    rank: usize,
    world_size: usize,
) -> Vec<(usize, std::ops::Range<usize>)> {
    let r = g.shard_range(rank, world_size);
    g.slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let start = s.offset.max(r.start);
            let end = (s.offset + s.numel).min(r.end);
            (start < end).then(|| (i, start - r.start..end - r.start))
        })
        .collect()
}

/// One rank's share of a model.
pub struct ShardedModel {
    layout: Arc<ModelLayout>,
    comm: Arc<dyn Communicator>,
    device: Device,
    config: FsdpConfig,
    units: Vec<UnitShards>,
    reducer: GradReducer,
    /// When false, gradients stay in the full buffers across micro-batches (no-sync accumulation).
    sync_grads: bool,
    /// Gradient shards exist only from a unit's reduction until its gradients are consumed
    /// ([`ShardedModel::set_transient_grads`]).
    transient_grads: bool,
    peak_gathered_bytes: usize,
    /// Most gradient-shard bytes held at once.
    peak_grad_shard_bytes: usize,
}

impl std::fmt::Debug for ShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("units", &self.units.len())
            .field("config", &self.config)
            .finish()
    }
}

impl ShardedModel {
    /// Shards a model whose full initial values are given by `init(param_index)` (row-major f32, the same on
    /// every rank, e.g. from a seeded initializer). FP8 weights are cast with current scaling from their
    /// amax; the returned vector holds, per unit, this rank's F32 master shard of the FP8 group (for the
    /// optimizer, which owns FP8 masters).
    pub fn new(
        layout: Arc<ModelLayout>,
        comm: Arc<dyn Communicator>,
        config: FsdpConfig,
        init: &dyn Fn(usize) -> Vec<f32>,
    ) -> Result<(Self, Vec<Vec<f32>>), ShardError> {
        Self::with_unit_init(layout, comm, config, &mut |params: &[usize]| {
            Ok(params.iter().map(|&p| init(p)).collect())
        })
    }

    /// [`ShardedModel::new`] with the initial values made one unit at a time: `init_unit(params)` returns
    /// the values of those parameters, in that order (so a model never holds more than one unit's full
    /// values on the host).
    pub fn with_unit_init(
        layout: Arc<ModelLayout>,
        comm: Arc<dyn Communicator>,
        config: FsdpConfig,
        init_unit: &mut UnitInit<'_>,
    ) -> Result<(Self, Vec<Vec<f32>>), ShardError> {
        if !(config.grad_divisor.is_finite() && config.grad_divisor > 0.0) {
            return Err(ShardError::InvalidArgument(format!(
                "gradient divisor {}: it must be finite and positive",
                config.grad_divisor
            )));
        }
        let device = comm.device().clone();
        let (rank, ws) = (comm.rank(), comm.world_size());
        let mut units = Vec::with_capacity(layout.units.len());
        let mut masters = Vec::with_capacity(layout.units.len());
        for unit in &layout.units {
            let mut full = [
                vec![0f32; unit.group(ParamGroup::Fp8).padded_len(ws)],
                vec![0f32; unit.group(ParamGroup::Plain).padded_len(ws)],
            ];
            let order: Vec<(ParamGroup, usize)> = ParamGroup::ALL
                .into_iter()
                .flat_map(|g| (0..unit.group(g).slots.len()).map(move |i| (g, i)))
                .collect();
            let wanted: Vec<usize> = order
                .iter()
                .map(|&(g, i)| unit.group(g).slots[i].param)
                .collect();
            let mut made = init_unit(&wanted)?;
            if made.len() != wanted.len() {
                return Err(ShardError::InvalidArgument(format!(
                    "unit {}: {} initial tensors for {} parameters",
                    unit.name,
                    made.len(),
                    wanted.len()
                )));
            }
            for (k, &(g, i)) in order.iter().enumerate() {
                {
                    let slot = &unit.group(g).slots[i];
                    let values = std::mem::take(&mut made[k]);
                    if values.len() != slot.numel {
                        return Err(ShardError::InvalidArgument(format!(
                            "initial values of {} have {} elements, its shape needs {}",
                            layout.params[slot.param].name,
                            values.len(),
                            slot.numel
                        )));
                    }
                    full[g as usize][slot.offset..slot.offset + slot.numel]
                        .copy_from_slice(&values);
                }
            }
            drop(made);
            let fp8_group = unit.group(ParamGroup::Fp8);
            let mut scales = Vec::with_capacity(fp8_group.slots.len() * 2);
            let mut codes_full = vec![0u8; fp8_group.padded_len(ws)];
            let mut block_full = vec![0f32; fp8_group.scales_len()];
            let block_slots = fp8_group.block_scales();
            for (i, slot) in fp8_group.slots.iter().enumerate() {
                let values = &full[0][slot.offset..slot.offset + slot.numel];
                let amax = fp8_core::amax_f32(values);
                let s = compute_scale(
                    amax,
                    Fp8Format::E4M3.max(),
                    config.weight_margin,
                    ScaleRounding::PowerOfTwo,
                    1.0,
                );
                let codes = &mut codes_full[slot.offset..slot.offset + slot.numel];
                if let Some(b) = block_slots.get(i) {
                    let (c, si) = quantize_block_rows(values, slot.cols)?;
                    codes.copy_from_slice(&c);
                    block_full[b.offset..b.offset + b.len()].copy_from_slice(&si);
                } else {
                    Fp8Format::E4M3.encode_scaled(values, s, codes)?;
                }
                scales.extend([s, 1.0 / s]);
            }
            let r8 = fp8_group.shard_range(rank, ws);
            let rs = fp8_group.scale_range(rank, ws);
            let rp = unit.group(ParamGroup::Plain).shard_range(rank, ws);
            // Stored shards have the group's shard length: a block-scaled group's shorter shards are
            // padded with zeros (the real elements come first).
            let n8 = fp8_group.shard_len(ws);
            let padded = |v: &[f32], n: usize| crate::layout::pad_to(v, n);
            masters.push(padded(&full[0][r8.clone()], n8));
            let (n32, n16) = match config.grad_dtype {
                GradDtype::F32 => ([n8, rp.len()], [0, 0]),
                GradDtype::Bf16 => ([0, 0], [n8, rp.len()]),
            };
            let grads = [device.zeros::<f32>(n32[0])?, device.zeros::<f32>(n32[1])?];
            let grads_bf16 = [device.zeros::<bf16>(n16[0])?, device.zeros::<bf16>(n16[1])?];
            units.push(UnitShards {
                fp8: device.upload(&crate::layout::pad_to(&codes_full[r8], n8))?,
                plain: device.upload(&full[1][rp])?,
                weight_scales: device.upload(&scales)?,
                block_scales: device
                    .upload(&padded(&block_full[rs], fp8_group.scale_shard_len(ws)))?,
                grads,
                grads_bf16,
                full_grads: [None, None],
                direct_grads: [false, false],
                gathered: None,
                pending: None,
            });
        }
        let reducer = GradReducer::new(config.grad_reduction, &device);
        let peak_grad_shard_bytes = units.iter().map(UnitShards::grad_shard_bytes).sum();
        Ok((
            ShardedModel {
                layout,
                comm,
                device,
                config,
                units,
                reducer,
                sync_grads: true,
                transient_grads: false,
                peak_gathered_bytes: 0,
                peak_grad_shard_bytes,
            },
            masters,
        ))
    }

    /// The model layout.
    pub fn layout(&self) -> &Arc<ModelLayout> {
        &self.layout
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// Number of units.
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// This rank's shards of unit `u`.
    pub fn unit(&self, u: usize) -> Result<&UnitShards, ShardError> {
        self.units
            .get(u)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no unit {u}")))
    }

    /// This rank's shards of unit `u`, mutable (for optimizers).
    pub fn unit_mut(&mut self, u: usize) -> Result<&mut UnitShards, ShardError> {
        self.units
            .get_mut(u)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no unit {u}")))
    }

    /// All-gathers unit `u` and cuts its parameters out (no-op if already gathered). Equivalent to
    /// [`ShardedModel::gather_async`] followed by [`ShardedModel::wait_gather`].
    pub fn gather(&mut self, u: usize) -> Result<(), ShardError> {
        self.gather_async(u)?;
        self.wait_gather(u)
    }

    /// Issues unit `u`'s all-gathers without waiting for them (prefetch): on CUDA they are queued on the
    /// communication stream and run while the compute stream works on something else. A no-op when the
    /// unit is gathered or its gather is already in flight. [`ShardedModel::wait_gather`] completes it.
    ///
    /// Overlap: the NCCL backend orders each collective after the work already queued on the compute
    /// stream when it is issued. So issue the prefetch of unit `u + 1` *before* queuing unit `u`'s compute
    /// (e.g. right after `wait_gather(u)`): then it waits for nothing but earlier work and overlaps `u`'s
    /// kernels. On CPU backends the collective completes inside this call.
    pub fn gather_async(&mut self, u: usize) -> Result<(), ShardError> {
        self.gather_async_as(u, self.config.plain_gather_dtype)
    }

    /// Gathers unit `u` with its plain parameters in F32 whatever [`FsdpConfig::plain_gather_dtype`] says
    /// (a unit gathered or being gathered in BF16 is released and gathered again): for readers that need
    /// the exact values (a consolidated checkpoint, a full-weights export).
    pub fn gather_exact(&mut self, u: usize) -> Result<(), ShardError> {
        let shards = self.unit(u)?;
        // Gathered in BF16, or with a parameter taken out: gathered again.
        let bf16_gathered = shards.gathered.as_ref().is_some_and(|g| {
            g[ParamGroup::Plain as usize]
                .iter()
                .any(|p| !matches!(p, Some(GatheredParam::Plain(_))))
                || g[ParamGroup::Fp8 as usize].iter().any(Option::is_none)
        });
        let bf16_pending = shards
            .pending
            .as_ref()
            .is_some_and(|p| p.plain_bf16.is_some());
        if bf16_gathered || bf16_pending {
            self.release(u)?;
        }
        self.gather_async_as(u, GatherDtype::F32)?;
        self.wait_gather(u)
    }

    /// [`ShardedModel::gather_async`] with the plain group in `plain`.
    fn gather_async_as(&mut self, u: usize, plain: GatherDtype) -> Result<(), ShardError> {
        let ws = self.comm.world_size();
        let layout = self.layout.clone();
        let unit_layout = layout
            .units
            .get(u)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no unit {u}")))?;
        let shards = &self.units[u];
        if shards.gathered.is_some() || shards.pending.is_some() {
            return Ok(());
        }
        let g8 = unit_layout.group(ParamGroup::Fp8);
        let gp = unit_layout.group(ParamGroup::Plain);
        let mut pending = PendingGather {
            fp8: None,
            scales: None,
            plain: None,
            plain_bf16: None,
            works: Vec::with_capacity(3),
        };
        // The receive buffers are left uninitialised: each all-gather writes every element (all ranks'
        // padded shards), so a fill would be a pass over the unit's bytes for nothing.
        if g8.block_scaled {
            // Uneven shards stored padded to one length: the gathered buffers hold each rank's chunk
            // at `rank * shard_len`, and the cut in `wait_gather` skips the padding.
            let mut full = self.device.uninit::<u8>(ws * shards.fp8.len())?;
            pending.works.push(self.comm.all_gather_async(
                SendBuf::fp8(&shards.fp8, Fp8Format::E4M3),
                RecvBuf::Fp8(&mut full, Fp8Format::E4M3),
            )?);
            pending.fp8 = Some(full);
            let mut scales = self.device.uninit::<f32>(ws * shards.block_scales.len())?;
            pending.works.push(
                self.comm
                    .all_gather_async((&shards.block_scales).into(), (&mut scales).into())?,
            );
            pending.scales = Some(scales);
        } else if !g8.is_empty() {
            let mut full = self.device.uninit::<u8>(g8.padded_len(ws))?;
            pending.works.push(self.comm.all_gather_async(
                SendBuf::fp8(&shards.fp8, Fp8Format::E4M3),
                RecvBuf::Fp8(&mut full, Fp8Format::E4M3),
            )?);
            pending.fp8 = Some(full);
        }
        if !gp.is_empty() {
            match plain {
                GatherDtype::F32 => {
                    let mut full = self.device.uninit::<f32>(gp.padded_len(ws))?;
                    pending.works.push(
                        self.comm
                            .all_gather_async((&shards.plain).into(), (&mut full).into())?,
                    );
                    pending.plain = Some(full);
                }
                GatherDtype::Bf16 => {
                    // The shard rounded on the compute stream; the collective is ordered after it.
                    let mut send = self.device.uninit::<bf16>(shards.plain.len())?;
                    convert(&shards.plain, &mut send)?;
                    let mut full = self.device.uninit::<bf16>(gp.padded_len(ws))?;
                    pending.works.push(
                        self.comm
                            .all_gather_async(SendBuf::BF16(&send), RecvBuf::BF16(&mut full))?,
                    );
                    pending.plain_bf16 = Some((full, send));
                }
            }
        }
        let held = self.gathered_bytes() + self.pending_bytes() + pending.num_bytes();
        self.peak_gathered_bytes = self.peak_gathered_bytes.max(held);
        self.units[u].pending = Some(pending);
        Ok(())
    }

    /// Whether unit `u` has a gather in flight (issued by [`ShardedModel::gather_async`], not waited for).
    pub fn is_gather_pending(&self, u: usize) -> bool {
        self.units.get(u).is_some_and(|s| s.pending.is_some())
    }

    /// Completes unit `u`'s gather: orders the compute stream after its all-gathers (the host does not
    /// block) and cuts the parameters out of the full buffers on the compute stream. Issues the gather
    /// first if none is in flight; a no-op when the unit is gathered.
    pub fn wait_gather(&mut self, u: usize) -> Result<(), ShardError> {
        if self.unit(u)?.gathered.is_some() {
            return Ok(());
        }
        if self.units[u].pending.is_none() {
            self.gather_async(u)?;
        }
        let pending = self.units[u]
            .pending
            .take()
            .ok_or_else(|| ShardError::State(format!("unit {u}: no gather in flight")))?;
        let PendingGather {
            fp8,
            scales,
            plain,
            plain_bf16,
            works,
        } = pending;
        for w in works {
            w.wait()?;
        }
        // The all-gather's BF16 send buffer (this rank's shard rounded) is done with.
        let plain_bf16 = plain_bf16.map(|(full, _send)| full);
        let layout = self.layout.clone();
        let unit_layout = &layout.units[u];
        let others = self.gathered_bytes() + self.pending_bytes();
        // Bytes of this unit held now: the flat buffers still alive and the parameters cut so far. Each
        // group's flat buffer is freed right after its cut, and a group of one parameter that fills its
        // flat buffer takes the buffer itself (no copy, no second buffer of the unit's size).
        let mut flats = fp8.as_ref().map_or(0, Buffer::num_bytes)
            + scales.as_ref().map_or(0, Buffer::num_bytes)
            + plain.as_ref().map_or(0, Buffer::num_bytes)
            + plain_bf16.as_ref().map_or(0, Buffer::num_bytes);
        let mut cut = 0;
        let mut peak = others + flats;
        let shards = &self.units[u];
        let mut params: [Vec<Option<GatheredParam>>; 2] = [Vec::new(), Vec::new()];
        let g8 = unit_layout.group(ParamGroup::Fp8);
        let gp = unit_layout.group(ParamGroup::Plain);
        // Each arm owns its flat buffers, freed when it ends.
        match (fp8, scales) {
            (Some(full), Some(all_scales)) => {
                let ws = self.comm.world_size();
                // Computed once per gather: the ranks' pieces of codes and scales.
                let (ranges, scale_ranges) = (g8.shard_ranges(ws), g8.scale_ranges(ws));
                let n8 = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
                let ns = scale_ranges.iter().map(|r| r.len()).max().unwrap_or(0);
                for (slot, b) in g8.slots.iter().zip(g8.block_scales()) {
                    let mut codes = self.device.zeros::<u8>(slot.numel)?;
                    let mut scale_inv = self.device.zeros::<f32>(b.len())?;
                    // The slot's pieces in each rank's chunk (a weight may span several ranks' block rows):
                    // whole block rows, so the piece's scales are whole rows of the slot's scales.
                    let row_elems = BLOCK_ROWS * slot.cols.max(1);
                    for (r, (range, srange)) in ranges.iter().zip(&scale_ranges).enumerate() {
                        let (start, end) = (
                            slot.offset.max(range.start),
                            (slot.offset + slot.numel).min(range.end),
                        );
                        if start >= end {
                            continue;
                        }
                        let src = r * n8 + (start - range.start);
                        codes.copy_range_from(start - slot.offset, &full, src, end - start)?;
                        let s0 = b.offset + (start - slot.offset) / row_elems * b.row_len;
                        let rows = (end - start).div_ceil(row_elems);
                        let src = r * ns + (s0 - srange.start);
                        scale_inv.copy_range_from(
                            s0 - b.offset,
                            &all_scales,
                            src,
                            rows * b.row_len,
                        )?;
                    }
                    cut += codes.num_bytes() + scale_inv.num_bytes();
                    params[ParamGroup::Fp8 as usize].push(Some(GatheredParam::Fp8Block {
                        codes,
                        scale_inv,
                        cols: slot.cols,
                    }));
                }
                peak = peak.max(others + flats + cut);
                flats -= full.num_bytes() + all_scales.num_bytes();
            }
            (Some(full), None) => {
                let len = full.num_bytes();
                let scales_of = |i: usize| -> Result<Buffer<f32>, ShardError> {
                    let mut s = self.device.uninit::<f32>(2)?;
                    s.copy_range_from(0, &shards.weight_scales, 2 * i, 2)?;
                    Ok(s)
                };
                if fills_alone(g8, full.len()) {
                    let scales = scales_of(0)?;
                    cut += len + scales.num_bytes();
                    flats -= len;
                    let p = GatheredParam::Fp8 {
                        codes: full,
                        scales,
                    };
                    params[ParamGroup::Fp8 as usize].push(Some(p));
                } else {
                    for (i, slot) in g8.slots.iter().enumerate() {
                        let mut codes = self.device.uninit::<u8>(slot.numel)?;
                        codes.copy_range_from(0, &full, slot.offset, slot.numel)?;
                        let scales = scales_of(i)?;
                        cut += codes.num_bytes() + scales.num_bytes();
                        params[ParamGroup::Fp8 as usize]
                            .push(Some(GatheredParam::Fp8 { codes, scales }));
                    }
                    peak = peak.max(others + flats + cut);
                    flats -= len;
                }
            }
            _ => {}
        }
        peak = peak.max(others + flats + cut);
        let plain_cut = match (plain, plain_bf16) {
            (Some(full), _) => Some(cut_plain(&self.device, gp, full, GatheredParam::Plain)?),
            (None, Some(full)) => {
                Some(cut_plain(&self.device, gp, full, GatheredParam::PlainBf16)?)
            }
            (None, None) => None,
        };
        if let Some((cut_params, held)) = plain_cut {
            params[ParamGroup::Plain as usize] = cut_params;
            peak = peak.max(others + cut + held);
        }
        self.peak_gathered_bytes = self.peak_gathered_bytes.max(peak);
        self.units[u].gathered = Some(params);
        Ok(())
    }

    fn pending_bytes(&self) -> usize {
        self.units
            .iter()
            .filter_map(|s| s.pending.as_ref())
            .map(PendingGather::num_bytes)
            .sum()
    }

    /// Frees unit `u`'s gathered parameters (and drops a gather still in flight; on CUDA the memory is
    /// reused only after the collective has finished).
    pub fn release(&mut self, u: usize) -> Result<(), ShardError> {
        let s = self.unit_mut(u)?;
        s.gathered = None;
        s.pending = None;
        Ok(())
    }

    /// Frees after forward if the configuration says so (ZeRO-3); keeps otherwise.
    pub fn release_after_forward(&mut self, u: usize) -> Result<(), ShardError> {
        if self.config.reshard_after_forward {
            self.release(u)?;
        }
        Ok(())
    }

    /// Whether unit `u` is gathered.
    pub fn is_gathered(&self, u: usize) -> bool {
        self.units.get(u).is_some_and(|s| s.gathered.is_some())
    }

    /// The gathered parameter `param` (its unit must be gathered); constant time.
    pub fn param(&self, param: usize) -> Result<&GatheredParam, ShardError> {
        let loc = self.layout.location(param).ok_or_else(|| {
            ShardError::InvalidArgument(format!("no parameter with index {param}"))
        })?;
        let gathered = self.units[loc.unit].gathered.as_ref().ok_or_else(|| {
            ShardError::State(format!(
                "parameter {} used while its unit {} is not gathered",
                self.layout.params[param].name, self.layout.units[loc.unit].name
            ))
        })?;
        match gathered[loc.group as usize].get(loc.slot) {
            Some(Some(p)) => Ok(p),
            Some(None) => Err(ShardError::State(format!(
                "parameter {} was taken out of its gathered unit {} (take_param): gather the unit \
                 again to use it",
                self.layout.params[param].name, self.layout.units[loc.unit].name
            ))),
            None => Err(ShardError::State(format!(
                "parameter {param} missing from its unit"
            ))),
        }
    }

    /// Whether parameter `param` was taken out of its gathered unit ([`ShardedModel::take_param`]) and
    /// the unit was not gathered again since.
    pub fn is_taken(&self, param: usize) -> bool {
        self.layout.location(param).is_some_and(|loc| {
            self.units[loc.unit]
                .gathered
                .as_ref()
                .and_then(|g| g[loc.group as usize].get(loc.slot))
                .is_some_and(Option::is_none)
        })
    }

    /// Moves the gathered parameter `param` out of its gathered unit (which must be gathered), for a
    /// module that uses it once more and then no longer in the pass: its memory is freed when the
    /// module drops it instead of when the unit is released (an FP8 LM head that casts its table to
    /// E4M3 once frees the table's gathered copy before its chunk loop; on llama-8b's root unit that is
    /// 2.1 GB in F32 held through the backward otherwise). The rest of the unit stays gathered; a
    /// later use of this parameter needs the unit gathered again ([`ShardedModel::release`], then a
    /// gather), which [`crate::Ctx`] does by itself.
    pub fn take_param(&mut self, param: usize) -> Result<GatheredParam, ShardError> {
        self.param(param)?;
        let loc = self.layout.location(param).ok_or_else(|| {
            ShardError::InvalidArgument(format!("no parameter with index {param}"))
        })?;
        self.units[loc.unit]
            .gathered
            .as_mut()
            .and_then(|g| g[loc.group as usize].get_mut(loc.slot))
            .and_then(Option::take)
            .ok_or_else(|| ShardError::State(format!("parameter {param} missing from its unit")))
    }

    /// The gathered plain parameter named `name`, in F32 (gathered in F32: see
    /// [`ShardedModel::gather_exact`]).
    pub fn plain(&self, name: &str) -> Result<&Buffer<f32>, ShardError> {
        match self.param(self.index(name)?)? {
            GatheredParam::Plain(b) => Ok(b),
            other => Err(ShardError::InvalidArgument(format!(
                "{name} is {}, not a plain F32 parameter",
                gathered_kind(other)
            ))),
        }
    }

    /// The gathered FP8 weight named `name`: its E4M3 codes and `[scale, scale_inv]`.
    pub fn fp8_weight(&self, name: &str) -> Result<(&Buffer<u8>, &Buffer<f32>), ShardError> {
        match self.param(self.index(name)?)? {
            GatheredParam::Fp8 { codes, scales } => Ok((codes, scales)),
            other => Err(ShardError::InvalidArgument(format!(
                "{name} is {}, not a per-tensor FP8 weight",
                gathered_kind(other)
            ))),
        }
    }

    /// The gathered block-scaled FP8 weight named `name`: its E4M3 codes and inverse block scales (see
    /// [`GatheredParam::Fp8Block`]).
    pub fn fp8_block_weight(&self, name: &str) -> Result<(&Buffer<u8>, &Buffer<f32>), ShardError> {
        match self.param(self.index(name)?)? {
            GatheredParam::Fp8Block {
                codes, scale_inv, ..
            } => Ok((codes, scale_inv)),
            other => Err(ShardError::InvalidArgument(format!(
                "{name} is {}, not a block-scaled FP8 weight",
                gathered_kind(other)
            ))),
        }
    }

    /// Index of the parameter named `name`.
    pub fn index(&self, name: &str) -> Result<usize, ShardError> {
        self.layout
            .param_index(name)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no parameter named {name}")))
    }

    /// Adds a full gradient of parameter `name` (from this rank's backward) into the unit's flat gradient.
    pub fn add_grad(&mut self, name: &str, grad: &Buffer<f32>) -> Result<(), ShardError> {
        let param = self.index(name)?;
        self.add_grad_at(param, grad)
    }

    /// [`ShardedModel::add_grad`] for a BF16 gradient (widened exactly to f32 as it is added).
    pub fn add_grad_bf16(
        &mut self,
        name: &str,
        grad: &Buffer<half::bf16>,
    ) -> Result<(), ShardError> {
        let param = self.index(name)?;
        self.add_grad_bf16_at(param, grad)
    }

    /// [`ShardedModel::add_grad`] by parameter index (constant time).
    pub fn add_grad_at(&mut self, param: usize, grad: &Buffer<f32>) -> Result<(), ShardError> {
        let (full, offset) = self.full_grad_range(param, grad.len())?;
        crate::grad::add_into_range(full, offset, grad)
    }

    /// [`ShardedModel::add_grad_bf16`] by parameter index (constant time).
    pub fn add_grad_bf16_at(
        &mut self,
        param: usize,
        grad: &Buffer<half::bf16>,
    ) -> Result<(), ShardError> {
        let (full, offset) = self.full_grad_range(param, grad.len())?;
        crate::grad::add_into_range_bf16(full, offset, grad)
    }

    /// The unit's full flat gradient buffer holding parameter `param` (created zeroed on first use) and
    /// the parameter's offset in it, for a gradient of `len` elements accumulated in place (see
    /// [`crate::Ctx::grad_slot`]).
    pub fn grad_slot_at(
        &mut self,
        param: usize,
        len: usize,
    ) -> Result<(&mut Buffer<f32>, usize), ShardError> {
        self.full_grad_range(param, len)
    }

    /// The buffer a gradient of parameter `param` (`len` elements) accumulates in, and the parameter's
    /// offset in it, after checking that the lengths agree: the unit's gradient shard itself where
    /// [`ShardedModel::grads_go_to_shards`] says so; else on one rank with an F32 reduction the
    /// parameter's own full gradient (offset 0, created zeroed on first use); else the unit's full flat
    /// gradient (created zeroed on first use).
    fn full_grad_range(
        &mut self,
        param: usize,
        len: usize,
    ) -> Result<(&mut Buffer<f32>, usize), ShardError> {
        let ws = self.comm.world_size();
        let loc = self.layout.location(param).ok_or_else(|| {
            ShardError::InvalidArgument(format!("no parameter with index {param}"))
        })?;
        let (u, g, slot_index) = (loc.unit, loc.group, loc.slot);
        let slot = self.layout.units[u]
            .group(g)
            .slots
            .get(slot_index)
            .ok_or_else(|| ShardError::State(format!("parameter {param} missing from its unit")))?;
        let (offset, numel) = (slot.offset, slot.numel);
        if len != numel {
            return Err(ShardError::InvalidArgument(format!(
                "gradient of {} has {len} elements, the parameter {numel}",
                self.layout.params[param].name
            )));
        }
        let gi = g as usize;
        // A group that already holds a full buffer keeps using it (its reduction adds it to the shard).
        if self.grads_go_to_shards(g) && self.units[u].full_grads[gi].is_none() {
            self.ensure_grad_shards(u)?;
            if offset + numel <= self.units[u].grads[gi].len() {
                let s = &mut self.units[u];
                s.direct_grads[gi] = true;
                return Ok((&mut s.grads[gi], offset));
            }
        }
        let group = self.layout.units[u].group(g);
        let (padded, slots) = (group.padded_len(ws), group.slots.len());
        let per_param = ws == 1 && self.reduction(g) == GradReduction::F32 && !group.block_scaled;
        let device = self.device.clone();
        let entry = &mut self.units[u].full_grads[gi];
        if entry.is_none() {
            *entry = Some(if per_param {
                FullGrad::PerParam((0..slots).map(|_| None).collect())
            } else {
                FullGrad::Flat(device.zeros::<f32>(padded)?)
            });
        }
        match entry {
            Some(FullGrad::Flat(full)) => Ok((full, offset)),
            Some(FullGrad::PerParam(bufs)) => {
                let b = bufs.get_mut(slot_index).ok_or_else(|| {
                    ShardError::State(format!("parameter {param} missing from its unit"))
                })?;
                if b.is_none() {
                    *b = Some(device.zeros::<f32>(numel)?);
                }
                let b = b.as_mut().ok_or_else(|| {
                    ShardError::State(format!("parameter {param}: full gradient vanished"))
                })?;
                Ok((b, 0))
            }
            None => Err(ShardError::State("full gradient vanished".into())),
        }
    }

    /// How group `g`'s gradients are reduced: FP8 weights' as [`FsdpConfig::grad_reduction`] says,
    /// plain parameters' always exactly.
    fn reduction(&self, g: ParamGroup) -> GradReduction {
        match g {
            ParamGroup::Fp8 => self.config.grad_reduction,
            ParamGroup::Plain => GradReduction::F32,
        }
    }

    /// Whether gradients of group `g` accumulate straight in the gradient shards instead of a full flat
    /// buffer that [`ShardedModel::reduce_grads`] adds to them: on one rank, where that reduction is the
    /// identity, with F32 shards, an F32 reduction (always for plain parameters; for FP8 weights when
    /// [`FsdpConfig::grad_reduction`] is F32: an FP8 one quantizes on purpose) and a divisor of 1. The
    /// sums are the same (the shard adds each gradient instead of their sum, a different rounding order
    /// only where a parameter gets several gradients in one backward of a later micro-batch), and the
    /// unit's full gradient, as large as its shard on one rank, is never allocated: one F32 copy of the
    /// unit's parameters less at the peak (0.48 GiB for a 50304 x 2560 LM head table, 4.2 GB for
    /// llama-8b's embedding and head).
    pub fn grads_go_to_shards(&self, g: ParamGroup) -> bool {
        self.comm.world_size() == 1
            && self.config.grad_dtype == GradDtype::F32
            && self.config.grad_divisor == 1.0
            && self.reduction(g) == GradReduction::F32
    }

    /// Whether gradients are reduced at [`ShardedModel::reduce_grads`] (true) or kept in the full buffers
    /// across micro-batches (no-sync accumulation: less communication, more memory).
    pub fn set_grad_sync(&mut self, sync: bool) {
        self.sync_grads = sync;
    }

    /// Sets [`FsdpConfig::grad_divisor`] for the following reductions (finite and positive). Refused
    /// while gradients that went straight into the shards (one rank,
    /// [`ShardedModel::grads_go_to_shards`]) wait for their reduction under another divisor: change it
    /// between steps.
    pub fn set_grad_divisor(&mut self, divisor: f32) -> Result<(), ShardError> {
        if !(divisor.is_finite() && divisor > 0.0) {
            return Err(ShardError::InvalidArgument(format!(
                "gradient divisor {divisor}: it must be finite and positive"
            )));
        }
        let pending = self.units.iter().any(|s| s.direct_grads.contains(&true));
        if pending && divisor != self.config.grad_divisor {
            return Err(ShardError::State(format!(
                "gradient divisor {divisor}: this step's gradients went into the shards at divisor {} \
                 (one rank) and are not reduced yet; change the divisor between steps",
                self.config.grad_divisor
            )));
        }
        self.config.grad_divisor = divisor;
        Ok(())
    }

    /// Whether gradients are reduced at the end of each backward ([`ShardedModel::set_grad_sync`]).
    pub fn grad_sync(&self) -> bool {
        self.sync_grads
    }

    /// Reduce-scatters unit `u`'s full gradients into this rank's gradient shards (adding to what they hold)
    /// and frees the full buffers. In no-sync mode it only keeps them for the next micro-batch.
    pub fn reduce_grads(&mut self, u: usize) -> Result<(), ShardError> {
        if !self.sync_grads {
            return Ok(());
        }
        let has_grads = self.unit(u)?.full_grads.iter().any(Option::is_some);
        if has_grads {
            self.ensure_grad_shards(u)?;
        }
        let ws = self.comm.world_size();
        let layout = self.layout.clone();
        let modes = ParamGroup::ALL.map(|g| self.reduction(g));
        let shards = &mut self.units[u];
        // Gradients that went straight into the shards are reduced as they stand.
        shards.direct_grads = [false, false];
        for g in ParamGroup::ALL {
            let group = layout.units[u].group(g);
            let divisor = self.config.grad_divisor;
            let mut full = match shards.full_grads[g as usize].take() {
                None => continue,
                Some(FullGrad::Flat(full)) => full,
                Some(FullGrad::PerParam(bufs)) => {
                    // One rank: each parameter's gradient divided and added at its offset of the
                    // shard, the element operations of the flat path's identity reduction.
                    for (slot, b) in group.slots.iter().zip(bufs) {
                        if let Some(mut b) = b {
                            if divisor != 1.0 {
                                scale(&mut b, 1.0 / divisor)?;
                            }
                            match self.config.grad_dtype {
                                GradDtype::F32 => {
                                    add_at(&mut shards.grads[g as usize], slot.offset, &b)?
                                }
                                GradDtype::Bf16 => {
                                    add_at(&mut shards.grads_bf16[g as usize], slot.offset, &b)?
                                }
                            }
                        }
                    }
                    continue;
                }
            };
            let uneven = group.block_scaled.then(|| group.shard_counts(ws));
            let mode = modes[g as usize];
            let comm = self.comm.as_ref();
            let r = &mut self.reducer;
            let gi = g as usize;
            match (self.config.grad_dtype, &uneven) {
                (GradDtype::F32, None) => {
                    r.reduce_scatter_add(comm, mode, &mut full, &mut shards.grads[gi], divisor)?
                }
                (GradDtype::Bf16, None) => r.reduce_scatter_add(
                    comm,
                    mode,
                    &mut full,
                    &mut shards.grads_bf16[gi],
                    divisor,
                )?,
                (GradDtype::F32, Some(counts)) => r.reduce_scatter_add_uneven(
                    comm,
                    mode,
                    &mut full,
                    &mut shards.grads[gi],
                    counts,
                    divisor,
                )?,
                (GradDtype::Bf16, Some(counts)) => r.reduce_scatter_add_uneven(
                    comm,
                    mode,
                    &mut full,
                    &mut shards.grads_bf16[gi],
                    counts,
                    divisor,
                )?,
            }
        }
        Ok(())
    }

    /// Zeroes the gradient shards (after an optimizer step); transient shards are freed.
    pub fn zero_grads(&mut self) -> Result<(), ShardError> {
        for u in 0..self.units.len() {
            self.clear_unit_grads(u)?;
        }
        Ok(())
    }

    /// Zeroes unit `u`'s gradient shards and drops its full gradients (after the unit's optimizer step);
    /// transient shards ([`ShardedModel::set_transient_grads`]) are freed instead, so their memory goes
    /// back to the device's pool.
    pub fn clear_unit_grads(&mut self, u: usize) -> Result<(), ShardError> {
        let transient = self.transient_grads;
        let device = self.device.clone();
        let s = self.unit_mut(u)?;
        if transient {
            s.grads = [device.zeros::<f32>(0)?, device.zeros::<f32>(0)?];
            s.grads_bf16 = [device.zeros::<bf16>(0)?, device.zeros::<bf16>(0)?];
        } else {
            for g in &mut s.grads {
                g.fill_zero()?;
            }
            for g in &mut s.grads_bf16 {
                g.fill_zero()?;
            }
        }
        s.full_grads = [None, None];
        s.direct_grads = [false, false];
        Ok(())
    }

    /// Whether gradient shards are transient ([`ShardedModel::set_transient_grads`]).
    pub fn transient_grads(&self) -> bool {
        self.transient_grads
    }

    /// Makes the gradient shards transient (`true`): a unit's shards are allocated (zeroed) when its
    /// gradients are reduced or [`ShardedModel::ensure_grad_shards`] asks for them, and freed by
    /// [`ShardedModel::clear_unit_grads`] / [`ShardedModel::zero_grads`], so no gradient shard persists
    /// between steps. An optimizer that steps each unit as soon as its gradients are reduced (inside the
    /// backward) then holds one unit's shards at a time instead of the whole model's. `false` (the
    /// default) keeps zeroed shards of every unit allocated. Switching discards the shards' values: call
    /// it between steps.
    pub fn set_transient_grads(&mut self, transient: bool) -> Result<(), ShardError> {
        self.transient_grads = transient;
        for u in 0..self.units.len() {
            self.clear_unit_grads(u)?;
            if !transient {
                self.ensure_grad_shards(u)?;
            }
        }
        // The peak counts from here: the shards held before the switch are gone.
        self.peak_grad_shard_bytes = self.units.iter().map(UnitShards::grad_shard_bytes).sum();
        Ok(())
    }

    /// Allocates unit `u`'s gradient shards, zeroed, when they are not (transient shards before the
    /// unit's reduction, e.g. for a unit that got no gradient in this backward); a no-op otherwise.
    pub fn ensure_grad_shards(&mut self, u: usize) -> Result<(), ShardError> {
        let device = self.device.clone();
        let dtype = self.config.grad_dtype;
        let s = self.unit_mut(u)?;
        let lens = [s.fp8.len(), s.plain.len()];
        for (i, &n) in lens.iter().enumerate() {
            match dtype {
                GradDtype::F32 if s.grads[i].len() != n => s.grads[i] = device.zeros::<f32>(n)?,
                GradDtype::Bf16 if s.grads_bf16[i].len() != n => {
                    s.grads_bf16[i] = device.zeros::<bf16>(n)?
                }
                _ => {}
            }
        }
        let held = self.units.iter().map(UnitShards::grad_shard_bytes).sum();
        self.peak_grad_shard_bytes = self.peak_grad_shard_bytes.max(held);
        Ok(())
    }

    /// Whether a parameter is an FP8 weight (per-tensor or block-scaled).
    pub fn is_fp8(&self, param: usize) -> bool {
        self.layout
            .params
            .get(param)
            .is_some_and(|p| p.kind.group() == ParamGroup::Fp8)
    }

    fn gathered_bytes(&self) -> usize {
        self.units
            .iter()
            .filter_map(|s| s.gathered.as_ref())
            .flat_map(|v| v.iter().flatten().flatten())
            .map(GatheredParam::num_bytes)
            .sum()
    }

    /// Bytes held by this rank, by category (optimizer states are added by the optimizer).
    pub fn memory(&self) -> Result<MemoryReport, ShardError> {
        let mut r = MemoryReport::default();
        for s in &self.units {
            r.fp8_weight_shards +=
                s.fp8.num_bytes() + s.weight_scales.num_bytes() + s.block_scales.num_bytes();
            r.plain_param_shards += s.plain.num_bytes();
            r.grad_shards += s.grad_shard_bytes();
            r.full_grads += s
                .full_grads
                .iter()
                .flatten()
                .map(FullGrad::num_bytes)
                .sum::<usize>();
        }
        // Full buffers of gathers in flight are gathered memory too.
        r.gathered = self.gathered_bytes() + self.pending_bytes();
        r.peak_gathered = self.peak_gathered_bytes;
        r.peak_grad_shards = self.peak_grad_shard_bytes.max(r.grad_shards);
        r.device_used = self.device.memory_used()?;
        Ok(r)
    }

    /// Per unit, the `(slot index, local range)` pieces of this rank's FP8 shard: which part of the shard
    /// holds which FP8 weight. Ranks whose shard misses a weight get no piece for it.
    pub fn fp8_segments(
        &self,
        u: usize,
    ) -> Result<Vec<(usize, std::ops::Range<usize>)>, ShardError> {
        self.segments(u, ParamGroup::Fp8)
    }

    /// The `(slot index, local range)` pieces of this rank's shard of group `g` of unit `u`.
    pub fn segments(
        &self,
        u: usize,
        g: ParamGroup,
    ) -> Result<Vec<(usize, std::ops::Range<usize>)>, ShardError> {
        let unit = self
            .layout
            .units
            .get(u)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no unit {u}")))?;
        Ok(shard_segments(
            unit.group(g),
            self.comm.rank(),
            self.comm.world_size(),
        ))
    }

    /// Number of FP8 weights of every unit, in order (the amax vector of
    /// [`ShardedModel::set_fp8_weight_scales`] is their concatenation).
    pub fn fp8_counts(&self) -> Vec<usize> {
        self.layout
            .units
            .iter()
            .map(|u| u.group(ParamGroup::Fp8).slots.len())
            .collect()
    }

    /// Sets every FP8 weight's scale pair from its global amax (all-reduced with MAX, flattened over units
    /// in slot order). The optimizer then casts its masters into [`UnitShards::fp8`] with these scales (in
    /// place, with no F32 copy of the shard): the one path by which FP8 weights change after
    /// construction. A zero or non-finite amax keeps the previous scale.
    pub fn set_fp8_weight_scales(&mut self, global_amaxes: &Buffer<f32>) -> Result<(), ShardError> {
        let counts = self.fp8_counts();
        let total: usize = counts.iter().sum();
        if global_amaxes.len() != total {
            return Err(ShardError::InvalidArgument(format!(
                "{} amaxes given for {total} FP8 weights",
                global_amaxes.len()
            )));
        }
        let mut base = 0;
        for (u, shards) in self.units.iter_mut().enumerate() {
            segmented_scales(
                global_amaxes,
                base,
                Fp8Format::E4M3,
                self.config.weight_margin,
                &mut shards.weight_scales,
            )?;
            base += counts[u];
        }
        Ok(())
    }

    /// [`ShardedModel::set_fp8_weight_scales`] for unit `u` alone: `amaxes` holds the global amax of
    /// each of the unit's FP8 weights, in slot order (a step taken unit by unit).
    pub fn set_unit_fp8_weight_scales(
        &mut self,
        u: usize,
        amaxes: &Buffer<f32>,
    ) -> Result<(), ShardError> {
        let count = self
            .layout
            .units
            .get(u)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no unit {u}")))?
            .group(ParamGroup::Fp8)
            .slots
            .len();
        if amaxes.len() != count {
            return Err(ShardError::InvalidArgument(format!(
                "{} amaxes given for the {count} FP8 weights of unit {u}",
                amaxes.len()
            )));
        }
        let margin = self.config.weight_margin;
        segmented_scales(
            amaxes,
            0,
            Fp8Format::E4M3,
            margin,
            &mut self.units[u].weight_scales,
        )?;
        Ok(())
    }

    /// Sets parameter `param` from its full values (the same on every rank): this rank's piece of a plain
    /// parameter is written to its shard; an FP8 weight's piece to `masters` (this rank's F32 master
    /// shards, one per unit, in the FP8 group's layout) and, cast with current scaling from the full
    /// tensor's amax, to the E4M3 shard and the weight's scale pair. No collective.
    pub fn set_param_full(
        &mut self,
        param: usize,
        values: &[f32],
        masters: &mut [Vec<f32>],
    ) -> Result<(), ShardError> {
        let (rank, ws) = (self.comm.rank(), self.comm.world_size());
        let layout = self.layout.clone();
        let loc = layout.location(param).ok_or_else(|| {
            ShardError::InvalidArgument(format!("no parameter with index {param}"))
        })?;
        let group = layout.units[loc.unit].group(loc.group);
        let slot = &group.slots[loc.slot];
        if values.len() != slot.numel {
            return Err(ShardError::InvalidArgument(format!(
                "{} values for {} of {} elements",
                values.len(),
                layout.params[param].name,
                slot.numel
            )));
        }
        let shard = group.shard_range(rank, ws);
        let (start, end) = (
            slot.offset.max(shard.start),
            (slot.offset + slot.numel).min(shard.end),
        );
        let unit = &mut self.units[loc.unit];
        match loc.group {
            ParamGroup::Plain => {
                if start < end {
                    let piece = self
                        .device
                        .upload(&values[start - slot.offset..end - slot.offset])?;
                    unit.plain
                        .copy_range_from(start - shard.start, &piece, 0, end - start)?;
                }
            }
            ParamGroup::Fp8 => {
                let amax = fp8_core::amax_f32(values);
                let s = compute_scale(
                    amax,
                    Fp8Format::E4M3.max(),
                    self.config.weight_margin,
                    ScaleRounding::PowerOfTwo,
                    1.0,
                );
                let scales = self.device.upload(&[s, 1.0 / s])?;
                unit.weight_scales
                    .copy_range_from(2 * loc.slot, &scales, 0, 2)?;
                if start < end {
                    let piece = &values[start - slot.offset..end - slot.offset];
                    if group.block_scaled {
                        // Whole block rows (shards end on them): quantized here, no agreement.
                        let (codes, scale_inv) = quantize_block_rows(piece, slot.cols)?;
                        let s0 = group.scale_position(start) - group.scale_range(rank, ws).start;
                        let scale_inv = self.device.upload(&scale_inv)?;
                        unit.block_scales
                            .copy_range_from(s0, &scale_inv, 0, scale_inv.len())?;
                        let codes = self.device.upload(&codes)?;
                        unit.fp8
                            .copy_range_from(start - shard.start, &codes, 0, end - start)?;
                    }
                    let master = masters.get_mut(loc.unit).ok_or_else(|| {
                        ShardError::InvalidArgument(format!(
                            "no master shard for unit {}",
                            loc.unit
                        ))
                    })?;
                    master
                        .get_mut(start - shard.start..end - shard.start)
                        .ok_or_else(|| {
                            ShardError::InvalidArgument("master shard too short".into())
                        })?
                        .copy_from_slice(piece);
                    if !group.block_scaled {
                        let mut codes = vec![0u8; piece.len()];
                        Fp8Format::E4M3.encode_scaled(piece, s, &mut codes)?;
                        let codes = self.device.upload(&codes)?;
                        unit.fp8
                            .copy_range_from(start - shard.start, &codes, 0, end - start)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Non-finite gradient values seen by FP8 gradient casts since the last call (they cannot be seen in
    /// the reduced shards, because the cast saturates infinities).
    pub fn take_nonfinite_before_cast(&mut self) -> u64 {
        self.reducer.take_nonfinite()
    }

    /// [`ShardedModel::take_nonfinite_before_cast`] on the device: the count moves into the non-finite
    /// count of `acc`, an accumulator of `fp8_kernels::reduce::norm_stats` (no read of the device).
    pub fn take_nonfinite_before_cast_into(
        &mut self,
        acc: &mut Buffer<f32>,
    ) -> Result<(), ShardError> {
        self.reducer.take_nonfinite_into(acc)
    }

    /// Where this rank's piece of FP8 slot `slot` of unit `u` starts in [`UnitShards::block_scales`], for
    /// its piece starting at local position `local` of the FP8 shard (a block-row start; see
    /// [`ShardedModel::fp8_segments`]). An error unless the unit's FP8 group is block-scaled.
    pub fn block_scale_offset(&self, u: usize, local: usize) -> Result<usize, ShardError> {
        let g = self
            .layout
            .units
            .get(u)
            .ok_or_else(|| ShardError::InvalidArgument(format!("no unit {u}")))?
            .group(ParamGroup::Fp8);
        if !g.block_scaled {
            return Err(ShardError::InvalidArgument(format!(
                "unit {u} has no block-scaled FP8 weights"
            )));
        }
        let (rank, ws) = (self.comm.rank(), self.comm.world_size());
        let shard = g.shard_range(rank, ws);
        Ok(g.scale_position(shard.start + local) - g.scale_range(rank, ws).start)
    }

    /// Current scale pairs of every FP8 weight, by parameter index (reads the device buffers).
    pub fn weight_scales(&self) -> Result<Vec<(usize, f32, f32)>, ShardError> {
        let mut out = Vec::new();
        for (unit, s) in self.layout.units.iter().zip(&self.units) {
            let v = s.weight_scales.to_vec()?;
            for (i, slot) in unit.group(ParamGroup::Fp8).slots.iter().enumerate() {
                out.push((slot.param, v[2 * i], v[2 * i + 1]));
            }
        }
        Ok(out)
    }
}

/// What a gathered parameter is, for error messages.
/// Whether a group's only parameter fills its gathered flat buffer of `len` elements (then the buffer
/// is the parameter, without a cut).
fn fills_alone(g: &crate::layout::GroupLayout, len: usize) -> bool {
    matches!(g.slots.as_slice(), [s] if s.offset == 0 && s.numel == len)
}

/// The plain group's parameters cut out of its gathered flat buffer `full` (moved into the one
/// parameter that fills it), each wrapped by `wrap`, and the bytes of the flat buffer and the cut
/// parameters at the cut's fullest.
fn cut_plain<T: fp8_kernels::Element>(
    device: &Device,
    g: &crate::layout::GroupLayout,
    full: Buffer<T>,
    wrap: fn(Buffer<T>) -> GatheredParam,
) -> Result<(Vec<Option<GatheredParam>>, usize), ShardError> {
    if fills_alone(g, full.len()) {
        let bytes = full.num_bytes();
        return Ok((vec![Some(wrap(full))], bytes));
    }
    let mut out = Vec::with_capacity(g.slots.len());
    let mut bytes = full.num_bytes();
    for slot in &g.slots {
        let mut p = device.uninit::<T>(slot.numel)?;
        p.copy_range_from(0, &full, slot.offset, slot.numel)?;
        bytes += p.num_bytes();
        out.push(Some(wrap(p)));
    }
    Ok((out, bytes))
}

fn gathered_kind(p: &GatheredParam) -> &'static str {
    match p {
        GatheredParam::Fp8 { .. } => "a per-tensor FP8 weight",
        GatheredParam::Fp8Block { .. } => "a block-scaled FP8 weight",
        GatheredParam::Plain(_) => "a plain parameter",
        GatheredParam::PlainBf16(_) => "a plain parameter gathered in BF16",
    }
}
