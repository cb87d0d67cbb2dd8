//! Launch of the RoPE kernel (`rope.cu`). `mod.rs` validated every argument.

use super::{Direction, RopeShape, RopeTable};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::ROPE_MODULE;
use crate::launch::{grid, kernel_name, launch};
use crate::{Buffer, CudaDevice, FloatElement, KernelError};

/// `v` as an `i32` kernel parameter, or an error naming it.
fn int(what: &'static str, name: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::InvalidArgument {
        what,
        detail: format!("{name} {v} exceeds the 32-bit range of the kernel"),
    })
}

pub(super) fn rotate<T: FloatElement>(
    dev: &CudaDevice,
    what: &'static str,
    table: &RopeTable,
    x: &Buffer<T>,
    out: &mut Buffer<T>,
    shape: RopeShape,
    direction: Direction,
) -> Result<(), KernelError> {
    let half = table.spec.head_dim / 2;
    let tokens = (shape.batch * shape.seq) as u64;
    let slots = int(what, "heads + 2 kv_heads", shape.heads + 2 * shape.kv_heads)?;
    let rotated = int(what, "heads + kv_heads", shape.heads + shape.kv_heads)?;
    let (seq, start) = (
        int(what, "seq", shape.seq)?,
        int(what, "start_pos", shape.start_pos)?,
    );
    let half_i = int(what, "head_dim / 2", half)?;
    let backward = (direction == Direction::Backward) as i32;
    let items = tokens * slots as u64 * half as u64;
    let (xs, os, cos, sin) = (
        cs(x, what)?,
        cs_mut(out, what)?,
        cs(&table.cos, what)?,
        cs(&table.sin, what)?,
    );
    launch!(
        dev,
        &ROPE_MODULE,
        kernel_name!("rope_", T::NAME),
        grid(dev, items),
        "rope_<T>(const T* x, T* out, const float* cos_t, const float* sin_t, u64 tokens, int seq, \
         int start_pos, int slots, int rotated_slots, int half, int backward)",
        [xs, os, cos, sin, &tokens, &seq, &start, &slots, &rotated, &half_i, &backward]
    )
}
