//! Gradient reduction: reduce-scatter of a unit's full gradients into this rank's shard, exactly (F32),
//! in BF16, or in FP8.
//!
//! The FP8 path (one scale for all ranks, so the sums the reduce-scatter forms cannot overflow):
//! 1. every rank takes the amax of its full gradient buffer and counts its non-finite values (before any
//!    cast: a saturating cast makes infinities finite);
//! 2. one all-reduce(MAX) of the amax, so every rank uses the same scale;
//! 3. the scale is the usual power of two for that amax divided by a further `2^ceil(log2(world_size))`, so
//!    a sum over all ranks cannot exceed the format's largest value;
//! 4. cast, reduce-scatter with the FP8 sum (NCCL adds pairs in half precision and rounds to FP8 each ring
//!    step; the thread backend emulates that), decode with the inverse scale and add to the F32 shard.
//!
//! The block-scaled FP8 path ([`GradReduction::Fp8Block`]): a reduce-scatter cannot sum values quantized
//! under different per-block scales, so the ranks exchange codes instead of summing them on the wire:
//! 1. every rank counts its non-finite values (as above) and casts its full gradient, viewed as
//!    `[world_size, shard_len]` (row `r` = the region rank `r` owns), in 1x128 tiles with power-of-two
//!    scales, writing one record per row: the row's codes, then its tiles' F32 inverse scales
//!    ([`PackedRows1x128`]); tiles start at each shard's start and end at its end (a shard whose length
//!    is not a multiple of 128 ends in a partial tile), so no tile straddles a shard boundary;
//! 2. one all-to-all of those bytes: rank `r` receives record `r` of every rank, codes and scales in one
//!    collective, and no collective to agree on scales (each tile carries its own);
//! 3. rank `r` dequantizes the `world_size` pieces and sums them in F32 in rank order (one fused kernel,
//!    [`block_dequantize_sum`]), divides by the divisor and adds to its shard: the same bits on every
//!    device and backend.

use crate::ShardError;
use fp8_core::{Fp8Format, ScaleRounding};
use fp8_kernels::elementwise::{add_at, scale};
use fp8_kernels::reduce::finite_amax_count;
use fp8_kernels::{
    add_decoded_fp8, block_dequantize_sum, block_quantize_packed, cast_to_fp8, convert,
    scale_from_amax, Buffer, Device, Element, FloatElement, PackedRows1x128,
};
use fsdp_comm::{Communicator, RecvBuf, ReduceOp, SendBuf};
use half::bf16;

/// How gradients travel in the reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradReduction {
    /// F32 sums: exact up to summation order.
    #[default]
    F32,
    /// BF16 on the wire (half the bytes), summed per ring step in BF16, added to an F32 shard.
    Bf16,
    /// FP8 on the wire (a quarter of the bytes), with a shared power-of-two scale.
    Fp8(Fp8Format),
    /// Block-scaled FP8 exchange (see the module docs): 1x128 tiles, each with its own power-of-two
    /// scale, sent by all-to-all and summed in F32 by the receiving rank in rank order.
    ///
    /// Bytes per gradient element in the records: 1 (code) + 4/128 (an F32 inverse scale per 128
    /// elements) = 1.03125, plus at most 30 bytes of padding per shard; against 4 for the F32 and 2 for
    /// the BF16 reduce-scatter (and 1 for the per-tensor [`GradReduction::Fp8`], whose sums are rounded to
    /// FP8 at each ring step). Each rank sends `(world_size - 1) / world_size` of its records, as a ring
    /// reduce-scatter sends that fraction of its buffer, so the ratios hold for the traffic too: 3.9x less
    /// than F32, 1.9x less than BF16.
    ///
    /// Error: each piece is within half an FP8 step of its tile's scale, `|d - x| <= u * amax_tile`
    /// (`u = 2^-(mantissa bits + 1)`: `2^-4` for E4M3, `2^-3` for E5M2), and the F32 sum of `world_size`
    /// pieces adds at most `(world_size - 1) * 2^-24` of the sum of their magnitudes. E4M3 is
    /// [`GradReduction::FP8_BLOCK`]'s format: within a 128-element tile E4M3's range (`2^17.8` with
    /// subnormals) is rarely short, and its error is half of E5M2's (see `docs/fsdp.md`).
    Fp8Block(Fp8Format),
}

impl GradReduction {
    /// The block-scaled FP8 exchange in its default format, E4M3.
    pub const FP8_BLOCK: GradReduction = GradReduction::Fp8Block(Fp8Format::E4M3);
}

/// Runs gradient reductions and remembers the non-finite values it saw before FP8 casts.
///
/// Every step runs where the buffers live, through fp8-kernels (CPU with rayon, or the GPU's compute
/// stream with the collectives on its communication stream): on CUDA nothing goes through the host. The
/// FP8 path's amax, scale and non-finite count stay in small device buffers; the count is read only by
/// [`GradReducer::take_nonfinite`]. Wire and receive buffers are kept and reused while their lengths
/// match, so a step with equal-sized units allocates nothing here after the first unit.
#[derive(Debug)]
pub struct GradReducer {
    device: Device,
    /// `[amax]`, `[scale]`, `[scale_inv]` of the current FP8 reduction.
    amax: Option<Buffer<f32>>,
    scale: Option<Buffer<f32>>,
    scale_inv: Option<Buffer<f32>>,
    /// Non-finite values seen since the last `take_nonfinite` (u32 on the device, wrapping).
    nonfinite: Option<Buffer<u32>>,
    scratch: Scratch,
}

/// Reused wire and receive buffers.
#[derive(Debug, Default)]
struct Scratch {
    part_f32: Option<Buffer<f32>>,
    wire_bf16: Option<Buffer<bf16>>,
    part_bf16: Option<Buffer<bf16>>,
    wire_u8: Option<Buffer<u8>>,
    part_u8: Option<Buffer<u8>>,
}

/// The buffer in `slot` if it has `len` elements, else a fresh zeroed one put there.
fn reuse<'a, T: Element>(
    device: &Device,
    slot: &'a mut Option<Buffer<T>>,
    len: usize,
) -> Result<&'a mut Buffer<T>, ShardError> {
    if slot.as_ref().is_none_or(|b| b.len() != len) {
        *slot = Some(device.zeros::<T>(len)?);
    }
    slot.as_mut()
        .ok_or_else(|| ShardError::State("scratch buffer vanished".into()))
}

fn scalar<'a>(
    device: &Device,
    slot: &'a mut Option<Buffer<f32>>,
) -> Result<&'a mut Buffer<f32>, ShardError> {
    reuse(device, slot, 1)
}

/// Power of two `>= world_size`: the pre-scale divisor that keeps a sum of `world_size` values in range.
pub fn world_prescale_margin(world_size: usize) -> i32 {
    world_size.max(1).next_power_of_two().trailing_zeros() as i32
}

impl GradReducer {
    /// A reducer for buffers on `device`.
    pub fn new(_mode: GradReduction, device: &Device) -> Self {
        GradReducer {
            device: device.clone(),
            amax: None,
            scale: None,
            scale_inv: None,
            nonfinite: None,
            scratch: Scratch::default(),
        }
    }

    /// Non-finite gradient values seen (and cleared) since the last call, for the FP8 path. On CUDA this
    /// reads a counter on the device (it waits for the queued work): call it once per step.
    pub fn take_nonfinite(&mut self) -> u64 {
        self.try_take_nonfinite().unwrap_or(u64::MAX)
    }

    /// [`GradReducer::take_nonfinite`] with device errors reported (`take_nonfinite` reports a failed read
    /// as `u64::MAX` non-finite values, so a caller that skips steps on non-finite gradients skips).
    pub fn try_take_nonfinite(&mut self) -> Result<u64, ShardError> {
        match self.nonfinite.as_mut() {
            None => Ok(0),
            Some(c) => {
                let n = c.to_vec()?.first().copied().unwrap_or(0);
                c.fill_zero()?;
                Ok(u64::from(n))
            }
        }
    }

    /// [`GradReducer::take_nonfinite`] on the device: moves the count into the non-finite count of
    /// `acc`, an accumulator of `fp8_kernels::reduce::norm_stats`, without reading it (a step taken unit
    /// by unit in the backward keeps the device queue full).
    pub fn take_nonfinite_into(&mut self, acc: &mut Buffer<f32>) -> Result<(), ShardError> {
        if let Some(c) = self.nonfinite.as_mut() {
            fp8_kernels::reduce::norm_stats_take_count(acc, c)?;
        }
        Ok(())
    }

    /// The FP8 scale pair `[scale]`, `[scale_inv]` of the last FP8 reduction (device buffers), if any.
    pub fn last_fp8_scales(&self) -> Option<(&Buffer<f32>, &Buffer<f32>)> {
        Some((self.scale.as_ref()?, self.scale_inv.as_ref()?))
    }

    /// Reduce-scatters `full` (length `world_size * shard.len()`) and adds this rank's reduced chunk,
    /// divided by `divisor`, to `shard` (F32, or BF16: the chunk is added in f32 and the sum rounded once
    /// to BF16). `full` is scratch afterwards (it may be scaled in place). A divisor of 1 costs nothing;
    /// another one costs one pass over the smallest buffer that still gives one rounding: the received
    /// chunk (F32), the full buffer before its BF16 rounding (BF16 wire), or the FP8 decode scale (FP8
    /// wire); the block FP8 exchange multiplies the F32 sum inside its fused kernel. For a power of two
    /// the result is bitwise the sum of pre-divided gradients (block FP8: while no tile scale reaches its
    /// `2^±125` limit and no value is an F32 subnormal).
    pub fn reduce_scatter_add<D: FloatElement>(
        &mut self,
        comm: &dyn Communicator,
        mode: GradReduction,
        full: &mut Buffer<f32>,
        shard: &mut Buffer<D>,
        divisor: f32,
    ) -> Result<(), ShardError> {
        if !(divisor.is_finite() && divisor > 0.0) {
            return Err(ShardError::InvalidArgument(format!(
                "gradient divisor {divisor}: it must be finite and positive"
            )));
        }
        let alpha = 1.0 / divisor;
        let ws = comm.world_size();
        if full.len() != shard.len() * ws {
            return Err(ShardError::InvalidArgument(format!(
                "gradient buffer of {} elements does not split into {ws} shards of {}",
                full.len(),
                shard.len()
            )));
        }
        let dev = self.device.clone();
        let n = shard.len();
        let s = &mut self.scratch;
        match mode {
            GradReduction::F32 if ws == 1 => {
                // One rank: the sum reduce-scatter is the identity, so the full buffer is added directly
                // (the same values; no receive buffer the size of the unit, no copy).
                if alpha != 1.0 {
                    scale(full, alpha)?;
                }
                add_at(shard, 0, full)?;
            }
            GradReduction::F32 => {
                let part = reuse(&dev, &mut s.part_f32, n)?;
                comm.reduce_scatter((&*full).into(), (&mut *part).into(), ReduceOp::Sum)?;
                if alpha != 1.0 {
                    scale(part, alpha)?;
                }
                add_at(shard, 0, part)?;
            }
            GradReduction::Bf16 => {
                if alpha != 1.0 {
                    scale(full, alpha)?;
                }
                let wire = reuse(&dev, &mut s.wire_bf16, full.len())?;
                convert(full, wire)?;
                let part = reuse(&dev, &mut s.part_bf16, n)?;
                comm.reduce_scatter((&*wire).into(), (&mut *part).into(), ReduceOp::Sum)?;
                add_at(shard, 0, part)?;
            }
            GradReduction::Fp8(format) => {
                // 1. local amax of the finite values and count of the others (before any cast);
                let amax = scalar(&dev, &mut self.amax)?;
                amax.fill_zero()?;
                let count = reuse(&dev, &mut self.nonfinite, 1)?;
                finite_amax_count(full, amax, count)?;
                // 2. one all-reduce MAX on the device buffer: every rank gets the same scale;
                comm.all_reduce_in_place(RecvBuf::F32(amax), ReduceOp::Max)?;
                // 3. scale with the world pre-scale folded in, computed where the amax is;
                let scale_buf = scalar(&dev, &mut self.scale)?;
                let scale_inv = scalar(&dev, &mut self.scale_inv)?;
                scale_from_amax(
                    amax,
                    format,
                    world_prescale_margin(ws),
                    scale_buf,
                    scale_inv,
                )?;
                // 4. cast, FP8 sum reduce-scatter, decode + add.
                let wire = reuse(&dev, &mut s.wire_u8, full.len())?;
                cast_to_fp8(full, format, scale_buf, wire, None)?;
                let part = reuse(&dev, &mut s.part_u8, n)?;
                comm.reduce_scatter(
                    SendBuf::fp8(wire, format),
                    RecvBuf::Fp8(part, format),
                    ReduceOp::Sum,
                )?;
                if alpha != 1.0 {
                    // The divisor folds into the decode scale (one element).
                    scale(scale_inv, alpha)?;
                }
                add_decoded_fp8(shard, part, format, scale_inv)?;
            }
            GradReduction::Fp8Block(format) => {
                // 1. count the non-finite values before the cast saturates them (the amax computed
                // beside the count is not used: every tile finds its own);
                let amax = scalar(&dev, &mut self.amax)?;
                let count = reuse(&dev, &mut self.nonfinite, 1)?;
                finite_amax_count(full, amax, count)?;
                // 2. one record per destination rank: its region's codes and inverse scales;
                let packing = PackedRows1x128::new(ws, n)?;
                let wire = reuse(&dev, &mut s.wire_u8, packing.num_bytes())?;
                block_quantize_packed(full, packing, format, ScaleRounding::PowerOfTwo, wire)?;
                // 3. the all-to-all (one rank: its own records are what it would receive), then the
                // pieces' F32 sum in rank order, divided and added to the shard.
                let received = if ws == 1 {
                    &*wire
                } else {
                    let part = reuse(&dev, &mut s.part_u8, packing.num_bytes())?;
                    comm.all_to_all(SendBuf::Bytes(wire), RecvBuf::Bytes(part))?;
                    &*part
                };
                block_dequantize_sum(received, packing, format, alpha, shard)?;
            }
        }
        Ok(())
    }

    /// [`GradReducer::reduce_scatter_add`] for uneven shards: `full` is the group's flat gradient
    /// (`sum(counts)` elements, rank `r`'s region the `counts[r]` elements after the regions of the
    /// ranks before it) and `shard` this rank's stored shard, at least `counts[rank]` long (a block-scaled
    /// group's shards are stored padded to the largest; the padding is left as it is). F32 and BF16
    /// travel with a variable-count reduce-scatter (no padding on the wire, no copy); the FP8 modes,
    /// whose sums the collectives define over equal chunks, first lay `full` out as `world_size` chunks
    /// of `shard.len()` with zeros after each region (one transient buffer of that size).
    pub fn reduce_scatter_add_uneven<D: FloatElement>(
        &mut self,
        comm: &dyn Communicator,
        mode: GradReduction,
        full: &mut Buffer<f32>,
        shard: &mut Buffer<D>,
        counts: &[usize],
        divisor: f32,
    ) -> Result<(), ShardError> {
        let (rank, ws) = (comm.rank(), comm.world_size());
        let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
        let mine = counts.get(rank).copied();
        match (total, mine) {
            (Some(t), Some(m)) if counts.len() == ws && t == full.len() && m <= shard.len() => {}
            _ => {
                return Err(ShardError::InvalidArgument(format!(
                    "uneven reduction: {} counts for {ws} ranks, a gradient of {} elements and a shard \
                     of {}",
                    counts.len(),
                    full.len(),
                    shard.len()
                )))
            }
        }
        if !(divisor.is_finite() && divisor > 0.0) {
            return Err(ShardError::InvalidArgument(format!(
                "gradient divisor {divisor}: it must be finite and positive"
            )));
        }
        let alpha = 1.0 / divisor;
        let dev = self.device.clone();
        let n = counts[rank];
        match mode {
            _ if ws == 1 => {
                if full.len() == shard.len() {
                    return self.reduce_scatter_add(comm, mode, full, shard, divisor);
                }
                let mut padded = dev.zeros::<f32>(shard.len())?;
                padded.copy_range_from(0, full, 0, full.len())?;
                self.reduce_scatter_add(comm, mode, &mut padded, shard, divisor)
            }
            GradReduction::F32 => {
                let part = reuse(&dev, &mut self.scratch.part_f32, n)?;
                comm.reduce_scatter_v((&*full).into(), (&mut *part).into(), counts, ReduceOp::Sum)?;
                if alpha != 1.0 {
                    scale(part, alpha)?;
                }
                add_at(shard, 0, part).map_err(ShardError::from)
            }
            GradReduction::Bf16 => {
                if alpha != 1.0 {
                    scale(full, alpha)?;
                }
                let s = &mut self.scratch;
                let wire = reuse(&dev, &mut s.wire_bf16, full.len())?;
                convert(full, wire)?;
                let part = reuse(&dev, &mut s.part_bf16, n)?;
                comm.reduce_scatter_v((&*wire).into(), (&mut *part).into(), counts, ReduceOp::Sum)?;
                add_at(shard, 0, part).map_err(ShardError::from)
            }
            GradReduction::Fp8(_) | GradReduction::Fp8Block(_) => {
                let stored = shard.len();
                let mut chunks = dev.zeros::<f32>(ws * stored)?;
                let mut start = 0;
                for (r, &c) in counts.iter().enumerate() {
                    chunks.copy_range_from(r * stored, full, start, c)?;
                    start += c;
                }
                self.reduce_scatter_add(comm, mode, &mut chunks, shard, divisor)
            }
        }
    }

    /// Frees the reused wire and receive buffers (they are re-created on the next reduction).
    pub fn release_scratch(&mut self) {
        self.scratch = Scratch::default();
    }

    /// Bytes held in reused wire and receive buffers.
    pub fn scratch_bytes(&self) -> usize {
        let s = &self.scratch;
        s.part_f32.as_ref().map_or(0, Buffer::num_bytes)
            + s.wire_bf16.as_ref().map_or(0, Buffer::num_bytes)
            + s.part_bf16.as_ref().map_or(0, Buffer::num_bytes)
            + s.wire_u8.as_ref().map_or(0, Buffer::num_bytes)
            + s.part_u8.as_ref().map_or(0, Buffer::num_bytes)
    }
}

/// Rejects a gradient of `len` elements at `offset` that would not fit in a flat buffer of `full_len`.
fn check_range(full_len: usize, offset: usize, len: usize) -> Result<(), ShardError> {
    if offset.checked_add(len).is_none_or(|e| e > full_len) {
        return Err(ShardError::InvalidArgument(
            "gradient range outside its flat buffer".into(),
        ));
    }
    Ok(())
}

/// `full[offset..offset + grad.len()] += grad`, where the buffers live (one kernel on CUDA).
pub fn add_into_range(
    full: &mut Buffer<f32>,
    offset: usize,
    grad: &Buffer<f32>,
) -> Result<(), ShardError> {
    check_range(full.len(), offset, grad.len())?;
    add_at(full, offset, grad)?;
    Ok(())
}

/// `full[offset..offset + grad.len()] += grad` for a BF16 gradient (widened exactly to f32).
pub fn add_into_range_bf16(
    full: &mut Buffer<f32>,
    offset: usize,
    grad: &Buffer<bf16>,
) -> Result<(), ShardError> {
    check_range(full.len(), offset, grad.len())?;
    add_at(full, offset, grad)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prescale_margin_covers_the_world() {
        assert_eq!(world_prescale_margin(1), 0);
        assert_eq!(world_prescale_margin(2), 1);
        assert_eq!(world_prescale_margin(3), 2);
        assert_eq!(world_prescale_margin(4), 2);
        assert_eq!(world_prescale_margin(8), 3);
    }
}
