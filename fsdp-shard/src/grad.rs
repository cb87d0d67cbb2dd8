//! Gradient reduction: reduce-scatter of a unit's full gradients into this rank's shard, exactly (F32),
//! in BF16, or in FP8.
//!
//! The FP8 path (DESIGN.md, "Numerics"):
//! 1. every rank takes the amax of its full gradient buffer and counts its non-finite values (before any
//!    cast: a saturating cast makes infinities finite);
//! 2. one all-reduce(MAX) of the amax, so every rank uses the same scale;
//! 3. the scale is the usual power of two for that amax divided by a further `2^ceil(log2(world_size))`, so
//!    a sum over all ranks cannot exceed the format's largest value;
//! 4. cast, reduce-scatter with the FP8 sum (NCCL adds pairs in half precision and rounds to FP8 each ring
//!    step; the thread backend emulates that), decode with the inverse scale and add to the F32 shard.

use crate::ShardError;
use fp8_core::{compute_scale, Fp8Format, ScaleRounding};
use fp8_kernels::{Buffer, Device};
use fsdp_comm::{Communicator, RecvBuf, ReduceOp, SendBuf};
use half::bf16;
use rayon::prelude::*;

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
}

/// Runs gradient reductions and remembers the non-finite values it saw before FP8 casts.
#[derive(Debug)]
pub struct GradReducer {
    device: Device,
    nonfinite: u64,
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
            nonfinite: 0,
        }
    }

    /// Non-finite gradient values seen (and cleared) since the last call, for the FP8 path.
    pub fn take_nonfinite(&mut self) -> u64 {
        std::mem::take(&mut self.nonfinite)
    }

    /// Reduce-scatters `full` (length `world_size * shard.len()`) and adds this rank's reduced chunk to `shard`.
    pub fn reduce_scatter_add(
        &mut self,
        comm: &dyn Communicator,
        mode: GradReduction,
        full: &Buffer<f32>,
        shard: &mut Buffer<f32>,
    ) -> Result<(), ShardError> {
        let ws = comm.world_size();
        if full.len() != shard.len() * ws {
            return Err(ShardError::InvalidArgument(format!(
                "gradient buffer of {} elements does not split into {ws} shards of {}",
                full.len(),
                shard.len()
            )));
        }
        let dev = &self.device;
        match mode {
            GradReduction::F32 => {
                let mut part = dev.zeros::<f32>(shard.len())?;
                comm.reduce_scatter(full.into(), (&mut part).into(), ReduceOp::Sum)?;
                add_assign(shard, &part)?;
            }
            GradReduction::Bf16 => {
                let wire = to_bf16(full)?;
                let mut part = dev.zeros::<bf16>(shard.len())?;
                comm.reduce_scatter((&wire).into(), (&mut part).into(), ReduceOp::Sum)?;
                add_assign_bf16(shard, &part)?;
            }
            GradReduction::Fp8(format) => {
                let (local_amax, nonfinite) = amax_and_nonfinite(full)?;
                self.nonfinite += nonfinite;
                let mut amax = [local_amax];
                comm.all_reduce_host_f32(&mut amax, ReduceOp::Max)?;
                let scale = compute_scale(
                    amax[0],
                    format.max(),
                    world_prescale_margin(ws),
                    ScaleRounding::PowerOfTwo,
                    1.0,
                );
                let wire = encode(full, format, scale)?;
                let mut part = dev.zeros::<u8>(shard.len())?;
                comm.reduce_scatter(
                    SendBuf::fp8(&wire, format),
                    RecvBuf::Fp8(&mut part, format),
                    ReduceOp::Sum,
                )?;
                add_assign_decoded(shard, &part, format, 1.0 / scale)?;
            }
        }
        Ok(())
    }
}

fn host<'a>(b: &'a Buffer<f32>, what: &'static str) -> Result<&'a [f32], ShardError> {
    Ok(b.host(what)?)
}

/// `full[offset..offset + grad.len()] += grad`.
pub fn add_into_range(
    full: &mut Buffer<f32>,
    offset: usize,
    grad: &Buffer<f32>,
) -> Result<(), ShardError> {
    let g = host(grad, "add_into_range")?;
    let f = full.host_mut("add_into_range")?;
    let dst = f.get_mut(offset..offset + g.len()).ok_or_else(|| {
        ShardError::InvalidArgument("gradient range outside its flat buffer".into())
    })?;
    dst.par_iter_mut()
        .with_min_len(1 << 14)
        .zip(g.par_iter())
        .for_each(|(d, s)| *d += s);
    Ok(())
}

fn add_assign(dst: &mut Buffer<f32>, src: &Buffer<f32>) -> Result<(), ShardError> {
    let s = host(src, "gradient add")?;
    let d = dst.host_mut("gradient add")?;
    d.par_iter_mut()
        .with_min_len(1 << 14)
        .zip(s.par_iter())
        .for_each(|(d, s)| *d += s);
    Ok(())
}

fn to_bf16(src: &Buffer<f32>) -> Result<Buffer<bf16>, ShardError> {
    let s = host(src, "bf16 gradient cast")?;
    Ok(Buffer::from_vec(
        s.par_iter()
            .with_min_len(1 << 14)
            .map(|&x| bf16::from_f32(x))
            .collect(),
    ))
}

fn add_assign_bf16(dst: &mut Buffer<f32>, src: &Buffer<bf16>) -> Result<(), ShardError> {
    let s = src.host("bf16 gradient add")?;
    let d = dst.host_mut("bf16 gradient add")?;
    d.par_iter_mut()
        .with_min_len(1 << 14)
        .zip(s.par_iter())
        .for_each(|(d, s)| *d += s.to_f32());
    Ok(())
}

fn amax_and_nonfinite(src: &Buffer<f32>) -> Result<(f32, u64), ShardError> {
    let s = host(src, "gradient amax")?;
    Ok(s.par_iter()
        .with_min_len(1 << 14)
        .map(|x| {
            if x.is_finite() {
                (x.abs(), 0u64)
            } else {
                (0.0, 1)
            }
        })
        .reduce(|| (0.0, 0), |a, b| (a.0.max(b.0), a.1 + b.1)))
}

fn encode(src: &Buffer<f32>, format: Fp8Format, scale: f32) -> Result<Buffer<u8>, ShardError> {
    let s = host(src, "fp8 gradient cast")?;
    let mut out = vec![0u8; s.len()];
    format.encode_scaled(s, scale, &mut out)?;
    Ok(Buffer::from_vec(out))
}

fn add_assign_decoded(
    dst: &mut Buffer<f32>,
    src: &Buffer<u8>,
    format: Fp8Format,
    scale_inv: f32,
) -> Result<(), ShardError> {
    let s = src.host("fp8 gradient add")?;
    let d = dst.host_mut("fp8 gradient add")?;
    let table = format.decode_table();
    d.par_iter_mut()
        .with_min_len(1 << 14)
        .zip(s.par_iter())
        .for_each(|(d, &c)| *d += table[c as usize] * scale_inv);
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
