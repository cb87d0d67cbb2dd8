//! Launches of the cross-entropy kernels (`cross_entropy.cu`). Arguments were validated by `mod.rs`.

use super::{
    CrossEntropyFp8Grad, CrossEntropyLaunch, CrossEntropyOutputs, CrossEntropySpec,
    CROSS_ENTROPY_MODULE,
};
use crate::cast::format_name;
use crate::cast::FloatElement;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::launch::{kernel_name, launch, one_block};
use crate::{Buffer, CudaDevice, KernelError};
use cudarc::driver::LaunchConfig;

/// Threads per row (`CE_THREADS`).
const THREADS: u32 = 512;
/// Threads of the loss-sum kernel (`CE_SUM_THREADS`).
const SUM_THREADS: u32 = 256;
/// Row blocks launched per SM for the re-reading kernels (2048 threads; ptxas gives them 50 to 58 registers,
/// so 2 are resident and the rest wait).
const BLOCKS_PER_SM: u64 = 4;

/// Vectors per thread held in registers: the forced choice, else 0 (re-read). Re-reading is the default
/// because on the H200 (`layer_kernel_bench --sweep`, 2026-12-03) the register kernels were slower at every
/// chunk (8192 x 50304: 1.06 ms re-reading, 1.12 ms holding 8, 1.38 ms holding 16 vectors): the kernel is
/// bound by its arithmetic, not by the second read, and the registers cost resident warps.
fn vectors_per_thread(launch: CrossEntropyLaunch) -> u32 {
    launch.vectors_per_thread.unwrap_or(0)
}

/// One block of `THREADS` per row, at most `per_sm` blocks per SM (a grid-stride loop takes the rest).
fn row_blocks(dev: &CudaDevice, spec: &CrossEntropySpec, per_sm: u64) -> LaunchConfig {
    let blocks = (spec.rows as u64).min(dev.sm_count() as u64 * per_sm);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The row kernels' scalar arguments (`mod.rs` checked that the counts fit in `int`).
struct RowArgs {
    offset: i32,
    rows: i32,
    vocab: i32,
    grad_scale: f32,
    write_grad: i32,
    ignore: i32,
    has_ignore: i32,
}

impl RowArgs {
    fn of(spec: &CrossEntropySpec) -> Self {
        RowArgs {
            offset: spec.row_offset as i32,
            rows: spec.rows as i32,
            vocab: spec.vocab as i32,
            grad_scale: spec.grad_scale.unwrap_or(0.0),
            write_grad: i32::from(spec.grad_scale.is_some()),
            ignore: spec.ignore_index.unwrap_or(0),
            has_ignore: i32::from(spec.ignore_index.is_some()),
        }
    }
}

pub(super) fn cross_entropy<T: FloatElement>(
    dev: &CudaDevice,
    spec: &CrossEntropySpec,
    launch: CrossEntropyLaunch,
    logits: &mut Buffer<T>,
    targets: &Buffer<i32>,
    out: CrossEntropyOutputs<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cross_entropy";
    if spec.rows == 0 {
        return Ok(());
    }
    // The register kernels are declared for 2 (8 vectors) and 1 (16 vectors) resident blocks per SM.
    let nv = vectors_per_thread(launch);
    let (name, per_sm) = match nv {
        0 => (kernel_name!("cross_entropy_", T::NAME), BLOCKS_PER_SM),
        n => (
            kernel_name!("cross_entropy_", T::NAME, "_nv", n),
            16 / n as u64,
        ),
    };
    let cfg = row_blocks(dev, spec, per_sm);
    let RowArgs {
        offset,
        rows,
        vocab,
        grad_scale,
        write_grad,
        ignore,
        has_ignore,
    } = RowArgs::of(spec);
    // The nv entries exist for bf16 only (checked by the caller); targets outside 0..vocab are never used
    // as indices; logits hold rows*vocab elements, targets, lse and loss at least offset + rows, invalid
    // at least one (checked by the caller).
    let (xs, ts) = (cs_mut(logits, WHAT)?, cs(targets, WHAT)?);
    let (lse, loss, invalid) = (
        cs_mut(out.lse, WHAT)?,
        cs_mut(out.loss, WHAT)?,
        cs_mut(out.invalid_targets, WHAT)?,
    );
    launch!(
        dev,
        &CROSS_ENTROPY_MODULE,
        name,
        cfg,
        "cross_entropy_<T>[_nv8|_nv16](T* logits, const int* targets, float* lse, float* loss, \
         u32* invalid, int offset, int rows, int vocab, float grad_scale, int ignore_index, int has_ignore, \
         int write_grad)",
        [xs, ts, lse, loss, invalid, &offset, &rows, &vocab, &grad_scale, &ignore, &has_ignore, &write_grad]
    )?;
    loss_sum(dev, spec, out)
}

/// Adds the chunk's loss sum into the accumulator (one block of 256 threads, in call order).
fn loss_sum(
    dev: &CudaDevice,
    spec: &CrossEntropySpec,
    out: CrossEntropyOutputs<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cross_entropy";
    let (offset, rows) = (spec.row_offset as i32, spec.rows as i32);
    // loss holds at least offset + rows elements, acc at least one (checked by the caller).
    let (loss, sum) = (cs(out.loss, WHAT)?, cs_mut(out.loss_sum, WHAT)?);
    launch!(
        dev,
        &CROSS_ENTROPY_MODULE,
        "cross_entropy_loss_sum",
        one_block(SUM_THREADS),
        "cross_entropy_loss_sum(const float* loss, int offset, int n, float* acc)",
        [loss, &offset, &rows, sum]
    )
}

/// The code variants `cross_entropy_<T>_<format>` (re-reading, as the default in-place kernel).
pub(super) fn cross_entropy_to_fp8<T: FloatElement>(
    dev: &CudaDevice,
    spec: &CrossEntropySpec,
    logits: &Buffer<T>,
    targets: &Buffer<i32>,
    out: CrossEntropyOutputs<'_>,
    grad: CrossEntropyFp8Grad<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cross_entropy_to_fp8";
    if spec.rows == 0 {
        return Ok(());
    }
    let name = kernel_name!("cross_entropy_", T::NAME, "_", format_name(grad.format));
    let cfg = row_blocks(dev, spec, BLOCKS_PER_SM);
    // The caller checked that `spec.grad_scale` is set: `write_grad` is 1.
    let RowArgs {
        offset,
        rows,
        vocab,
        grad_scale,
        write_grad,
        ignore,
        has_ignore,
    } = RowArgs::of(spec);
    let scale_index = grad.scale.index as i32;
    // Targets outside 0..vocab are never used as indices; logits and codes hold rows*vocab elements,
    // targets, lse and loss at least offset + rows, invalid at least one, the scale index lies in
    // its buffer (all checked by the caller and `DeviceScalar::new`); the kernel only reads the logits.
    let (xs, ts) = (cs(logits, WHAT)?, cs(targets, WHAT)?);
    let (lse, loss, invalid) = (
        cs_mut(out.lse, WHAT)?,
        cs_mut(out.loss, WHAT)?,
        cs_mut(out.invalid_targets, WHAT)?,
    );
    let (codes, scale) = (cs_mut(grad.codes, WHAT)?, cs(grad.scale.buffer, WHAT)?);
    launch!(
        dev,
        &CROSS_ENTROPY_MODULE,
        name,
        cfg,
        "cross_entropy_<T>_<format>(const T* logits, const int* targets, float* lse, float* loss, \
         u32* invalid, int offset, int rows, int vocab, float grad_scale, int ignore_index, int has_ignore, \
         int write_grad, u8* codes, const float* code_scale, int scale_index)",
        [xs, ts, lse, loss, invalid, &offset, &rows, &vocab, &grad_scale, &ignore, &has_ignore, &write_grad,
         codes, scale, &scale_index]
    )?;
    loss_sum(dev, spec, out)
}
