//! Cross-entropy over one chunk of logits `[rows, vocab]` (f32 or bf16, row-major) with integer targets,
//! computing per-row log-sum-exp and loss, adding the chunk's loss sum into a device accumulator, and
//! overwriting the logits in place with their gradient `(softmax - onehot) * grad_scale`.
//!
//! It is made for a language-model head run in chunks of tokens: `logits = x W^T` for a chunk (BF16
//! GEMM), this kernel, then `dx = dlogits W` and `dW += dlogits^T x`, so the `[tokens, vocab]` logits
//! never exist at once (see `examples/layer_kernel_bench.rs`).
//!
//! # Definitions (both devices; f32 arithmetic, one rounding per operation)
//! - The row's log-sum-exp is computed online in one pass, in the order of the CUDA kernel (512 threads
//!   per row; see `cross_entropy.cu`): `lse = M + ln(S)` with `M` the row max and `S = sum exp(x - M)`,
//!   using [`exp_fixed`] and [`ln_fixed`], fixed polynomial evaluations that both devices compute
//!   identically (about 1 ulp from the true functions).
//! - `loss = lse - x[target]`; a row whose target equals `ignore_index` has loss 0 and a zero gradient
//!   (PyTorch's `ignore_index`); a row whose target is outside `0..vocab` (and not ignored) is counted in
//!   the invalid-target counter, gets loss NaN and a zero gradient, and its logits are never indexed by
//!   that target (no wild read). Check targets when a batch is built ([`check_targets`]).
//! - Gradient (when `grad_scale` is given): `g = exp(x - lse)`, minus 1 at the target, times
//!   `grad_scale`, rounded to the logits' type, written over the logits. The second pass rereads the row,
//!   or, for bf16 rows that fit (see [`CrossEntropyLaunch`]), reuses the values the first pass held in
//!   registers.
//! - `loss_sum[0] += sum of the chunk's losses` in a fixed order (256 strided partial sums, butterflies),
//!   so accumulating chunk after chunk on one stream is deterministic.
//!
//! - [`cross_entropy_to_fp8`] writes the gradient as FP8 codes into a buffer of its own instead:
//!   `encode(round_T(g) * scale)`, the in-place gradient followed by the plain cast, in one pass.
//!
//! CPU and CUDA agree bit for bit (lse, loss, gradient or its codes, sum, counter).

mod cpu;
mod cuda;

use crate::device::device_of;
use crate::gemm::DeviceScalar;
use crate::kernel_source::{KernelModule, ModuleArch};
use crate::FloatElement;
use crate::{check_len, Buffer, DType, KernelError};
use fp8_core::Fp8Format;

pub use cpu::{exp_fixed, ln_fixed};

/// The CUDA module: `cuda/common.cuh`, then `src/cross_entropy/cross_entropy.cu` (paths relative to the
/// crate).
pub const CROSS_ENTROPY_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_cross_entropy",
    files: &["cuda/common.cuh", "src/cross_entropy/cross_entropy.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("cross_entropy.cu")
    ),
    arch: ModuleArch::Portable,
};

/// One chunk: `rows` rows of `vocab` logits, for batch rows `row_offset .. row_offset + rows` of the
/// target, lse and loss buffers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropySpec {
    /// Rows of this chunk.
    pub rows: usize,
    /// Classes per row.
    pub vocab: usize,
    /// Index of the chunk's first row in `targets`, `lse` and `loss`.
    pub row_offset: usize,
    /// Targets equal to this are ignored (loss 0, gradient 0), as PyTorch's `ignore_index`.
    pub ignore_index: Option<i32>,
    /// Write the gradient times this factor over the logits (e.g. `1 / counted tokens` for a mean loss);
    /// `None` leaves the logits unchanged (evaluation).
    pub grad_scale: Option<f32>,
}

impl CrossEntropySpec {
    /// `rows x vocab` at offset 0, no ignored target, gradient scaled by `grad_scale`.
    pub fn new(rows: usize, vocab: usize, grad_scale: f32) -> Self {
        CrossEntropySpec {
            rows,
            vocab,
            row_offset: 0,
            ignore_index: None,
            grad_scale: Some(grad_scale),
        }
    }
}

/// How the CUDA kernel is launched: a choice of speed only, results are the same bit for bit (tested). The
/// CPU ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CrossEntropyLaunch {
    /// Vectors of 8 logits per thread held in registers between the two passes (0, 8 or 16; bf16 only).
    /// `None` chooses 0 (each pass reads the row: measured faster on the H200, the kernel being bound by
    /// its arithmetic). With 8 or 16, vectors beyond 8 * 512 * n of a row, and every vector of rows that
    /// are not 16-byte vectorisable (vocab not a multiple of 8), are still read in each pass.
    pub vectors_per_thread: Option<u32>,
}

/// The outputs of [`cross_entropy`] besides the gradient.
#[derive(Debug)]
pub struct CrossEntropyOutputs<'a> {
    /// Per-row log-sum-exp (f32), written at the chunk's rows.
    pub lse: &'a mut Buffer<f32>,
    /// Per-row loss (f32), written at the chunk's rows.
    pub loss: &'a mut Buffer<f32>,
    /// `loss_sum[0] += ` the chunk's loss sum.
    pub loss_sum: &'a mut Buffer<f32>,
    /// `invalid_targets[0] += ` the number of targets outside `0..vocab` (not ignored).
    pub invalid_targets: &'a mut Buffer<u32>,
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// Checks targets on the host when a batch is built: every target must be in `0..vocab` or equal to
/// `ignore_index`. The error names the first bad target and its position.
pub fn check_targets(
    targets: &[i32],
    vocab: usize,
    ignore_index: Option<i32>,
) -> Result<(), KernelError> {
    match targets
        .iter()
        .position(|&t| Some(t) != ignore_index && (t < 0 || t as usize >= vocab))
    {
        Some(p) => Err(bad(
            "check_targets",
            format!(
                "target {} at position {p} is outside 0..{vocab}",
                targets[p]
            ),
        )),
        None => Ok(()),
    }
}

/// Loss, log-sum-exp and (with `spec.grad_scale`) the in-place gradient of one chunk of logits; adds the
/// chunk's loss sum and invalid-target count into the accumulators (see the module docs).
pub fn cross_entropy<T: FloatElement>(
    spec: &CrossEntropySpec,
    logits: &mut Buffer<T>,
    targets: &Buffer<i32>,
    out: CrossEntropyOutputs<'_>,
) -> Result<(), KernelError> {
    cross_entropy_with_launch(spec, CrossEntropyLaunch::default(), logits, targets, out)
}

/// The gradient of [`cross_entropy_to_fp8`]: FP8 codes in a buffer of their own.
#[derive(Debug)]
pub struct CrossEntropyFp8Grad<'a> {
    /// The chunk's `[rows, vocab]` codes (row 0 is the chunk's first row, whatever `row_offset` is).
    pub codes: &'a mut Buffer<u8>,
    /// Format of the codes.
    pub format: Fp8Format,
    /// `code = encode(round_T(g) * scale)`, read on the device.
    pub scale: DeviceScalar<'a>,
}

/// [`cross_entropy`] with the gradient written as FP8 codes into `grad.codes` instead of over the logits,
/// which stay unchanged: `encode(round_T(g) * scale)` with `g` the in-place gradient before its rounding to
/// the logits' type `T`. The codes equal what the in-place kernel followed by the plain cast
/// ([`crate::cast_to_fp8`] at the same scale) gives, bit for bit, without the gradient's pass through
/// memory in `T`. Needs `spec.grad_scale`.
pub fn cross_entropy_to_fp8<T: FloatElement>(
    spec: &CrossEntropySpec,
    logits: &Buffer<T>,
    targets: &Buffer<i32>,
    out: CrossEntropyOutputs<'_>,
    grad: CrossEntropyFp8Grad<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cross_entropy_to_fp8";
    let Some(grad_scale) = spec.grad_scale else {
        return Err(bad(WHAT, "FP8 gradient codes need a grad_scale".into()));
    };
    let end = check::<T>(WHAT, spec, logits.len(), targets, &out)?;
    check_len(WHAT, logits.len(), grad.codes.len())?;
    if grad.scale.index >= grad.scale.buffer.len() || grad.scale.index > i32::MAX as usize {
        return Err(bad(
            WHAT,
            format!(
                "scale index {} out of a buffer of {}",
                grad.scale.index,
                grad.scale.buffer.len()
            ),
        ));
    }
    let dev = device_of(
        WHAT,
        &[
            logits,
            targets,
            out.lse,
            out.loss,
            out.loss_sum,
            out.invalid_targets,
            grad.codes,
            grad.scale.buffer,
        ],
    )?;
    if spec.rows == 0 {
        return Ok(());
    }
    match dev {
        None => {
            let scale = grad.scale.host_value(WHAT)?;
            let range = spec.row_offset..end;
            let lse = &mut out.lse.host_mut(WHAT)?[range.clone()];
            let loss = &mut out.loss.host_mut(WHAT)?[range.clone()];
            let invalid = cpu::rows_to_codes(
                logits.host(WHAT)?,
                spec.vocab,
                &targets.host(WHAT)?[range],
                spec.ignore_index,
                grad_scale,
                (grad.codes.host_mut(WHAT)?, grad.format, scale),
                lse,
                loss,
            );
            add_to_accumulators(loss, invalid, out.loss_sum, out.invalid_targets)
        }
        Some(dev) => cuda::cross_entropy_to_fp8(&dev, spec, logits, targets, out, grad),
    }
}

/// [`cross_entropy`] with explicit CUDA launch choices (results unchanged; for benchmarks and tests).
pub fn cross_entropy_with_launch<T: FloatElement>(
    spec: &CrossEntropySpec,
    launch: CrossEntropyLaunch,
    logits: &mut Buffer<T>,
    targets: &Buffer<i32>,
    out: CrossEntropyOutputs<'_>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cross_entropy";
    match launch.vectors_per_thread {
        None | Some(0) => {}
        Some(8 | 16) if T::DTYPE == DType::BF16 => {}
        Some(n) => {
            return Err(bad(
                WHAT,
                format!(
                    "{n} vectors per thread for {} logits (0, or 8 or 16 for bf16)",
                    T::DTYPE
                ),
            ))
        }
    }
    let end = check::<T>(WHAT, spec, logits.len(), targets, &out)?;
    let dev = device_of(
        WHAT,
        &[
            logits,
            targets,
            out.lse,
            out.loss,
            out.loss_sum,
            out.invalid_targets,
        ],
    )?;
    if spec.rows == 0 {
        return Ok(());
    }
    match dev {
        None => {
            let range = spec.row_offset..end;
            let lse = &mut out.lse.host_mut(WHAT)?[range.clone()];
            let loss = &mut out.loss.host_mut(WHAT)?[range.clone()];
            let invalid = cpu::rows(
                logits.host_mut(WHAT)?,
                spec.vocab,
                &targets.host(WHAT)?[range],
                spec.ignore_index,
                spec.grad_scale,
                lse,
                loss,
            );
            add_to_accumulators(loss, invalid, out.loss_sum, out.invalid_targets)
        }
        Some(dev) => cuda::cross_entropy(&dev, spec, launch, logits, targets, out),
    }
}

/// The CPU's `loss_sum[0] += sum`, `invalid_targets[0] += invalid`.
fn add_to_accumulators(
    loss: &[f32],
    invalid: u32,
    loss_sum: &mut Buffer<f32>,
    invalid_targets: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "cross_entropy";
    let sum = cpu::loss_sum(loss);
    let acc = &mut loss_sum.host_mut(WHAT)?[0];
    *acc += sum;
    let cnt = &mut invalid_targets.host_mut(WHAT)?[0];
    *cnt = cnt.wrapping_add(invalid);
    Ok(())
}

/// Checks the element type, the shape, the scale and the buffer lengths; returns the chunk's end row.
fn check<T: FloatElement>(
    what: &'static str,
    spec: &CrossEntropySpec,
    logits_len: usize,
    targets: &Buffer<i32>,
    out: &CrossEntropyOutputs<'_>,
) -> Result<usize, KernelError> {
    match T::DTYPE {
        DType::F32 | DType::BF16 => {}
        other => return Err(bad(what, format!("logits of {other} (f32 or bf16 only)"))),
    }
    if spec.vocab == 0 {
        return Err(bad(what, "vocab must be positive".into()));
    }
    let end = spec
        .row_offset
        .checked_add(spec.rows)
        .ok_or_else(|| bad(what, "row range overflows".into()))?;
    if spec.vocab > i32::MAX as usize || end > i32::MAX as usize {
        return Err(bad(
            what,
            format!(
                "{} rows at offset {} of {} classes exceed the 32-bit index range",
                spec.rows, spec.row_offset, spec.vocab
            ),
        ));
    }
    if let Some(g) = spec.grad_scale {
        if !g.is_finite() {
            return Err(bad(what, format!("grad_scale {g} is not finite")));
        }
    }
    let n = spec
        .rows
        .checked_mul(spec.vocab)
        .ok_or_else(|| bad(what, "rows x vocab overflows".into()))?;
    check_len(what, n, logits_len)?;
    for (name, len) in [
        ("targets", targets.len()),
        ("lse", out.lse.len()),
        ("loss", out.loss.len()),
    ] {
        if len < end {
            return Err(bad(
                what,
                format!("{name} holds {len} rows, the chunk needs rows up to {end}"),
            ));
        }
    }
    if out.loss_sum.is_empty() || out.invalid_targets.is_empty() {
        return Err(bad(what, "the accumulators must hold one element".into()));
    }
    Ok(end)
}

/// The log-sum-exp of one row as the kernels compute it, for references and tests.
pub fn row_lse<T: FloatElement>(row: &[T]) -> f32 {
    cpu::row_lse(row)
}

/// The chunk loss sum in the kernel's order, for references and tests.
pub fn loss_sum(loss: &[f32]) -> f32 {
    cpu::loss_sum(loss)
}
