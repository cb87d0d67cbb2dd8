//! Token and position embeddings: the forward gather `out[p] = table[ids[p]] (+ pos_table[p % seq])` and a
//! deterministic backward that adds into the tables' gradients.
//!
//! # Design
//! A batch's ids are grouped once on the host ([`RowGroups::from_ids`]): every id is checked to be in
//! `0..vocab` (an id out of range is an error naming it, never a wild read), and the positions are sorted
//! by `(id, position)` into a CSR layout (unique ids, offsets, positions in increasing order), cut into
//! chunks of at most [`EMBEDDING_CHUNK`] positions that never span two ids. The layout is uploaded in
//! one copy per batch; the kernels then read it on the device (no device-to-host round trip in a step).
//!
//! # Definitions (both devices; f32 arithmetic, one rounding per operation)
//! - Forward: `out[p] = O(table[ids[p]] + pos_table[p % seq])` (or without the position term).
//! - Token-table gradient: for each id of the batch, each chunk's `dy` rows are summed in position order
//!   from zero, the chunk sums are added left to right starting from the first, and the total is added
//!   into the row: `d_table[id] = D(d_table[id] + total)`. Rows of ids absent from the batch are left
//!   unchanged. No atomics: every row is written by one thread per column.
//! - Position-table gradient: `d_pos[t] = D(d_pos[t] + sum over b in order of dy[b, t])` for `t < seq`.
//!
//! CPU (rayon) and CUDA agree bit for bit. Tables, outputs and gradients are each f32 or bf16.

mod cpu;
mod cuda;

use crate::device::{device_of, Placed};
use crate::kernel_source::{KernelModule, ModuleArch};
use crate::FloatElement;
use crate::{check_len, Buffer, DType, Device, KernelError};

/// The CUDA module: `cuda/common.cuh`, then `src/embedding/embedding.cu` (paths relative to the crate).
pub const EMBEDDING_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_embedding",
    files: &["cuda/common.cuh", "src/embedding/embedding.cu"],
    source: concat!(
        include_str!("../../cuda/common.cuh"),
        include_str!("embedding.cu")
    ),
    arch: ModuleArch::Portable,
};

/// Most positions summed by one thread of the backward before its sum goes to a second level: a
/// frequent id (or a batch of padding) is spread over many threads instead of one.
pub const EMBEDDING_CHUNK: usize = 32;

/// The high bit of a chunk's destination marks a partial-sum slot instead of a table row.
const PARTIAL_FLAG: u32 = 0x8000_0000;

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

/// The grouping of one batch's ids for the embedding kernels (see the module docs).
#[derive(Debug)]
pub struct RowGroups {
    vocab: usize,
    /// The ids in position order.
    ids: Vec<i32>,
    /// Distinct ids, increasing.
    unique: Vec<i32>,
    /// `group_offsets[g]..group_offsets[g + 1]` indexes `order` for `unique[g]`.
    group_offsets: Vec<u32>,
    /// Positions sorted by (id, position).
    order: Vec<u32>,
    /// Chunks in total, chunks of ids with several chunks (partial slots), and such ids.
    chunks: usize,
    partial_slots: usize,
    multi_groups: usize,
    /// On CUDA: the ids, and the packed index (order, chunk_start, chunk_dest, multi_row, multi_first).
    device: Option<DeviceIndex>,
}

#[derive(Debug)]
struct DeviceIndex {
    ids: Buffer<i32>,
    index: Buffer<u32>,
}

impl RowGroups {
    /// Groups `ids` (one per position) for a table of `vocab` rows, on `device`. Errors when an id is
    /// outside `0..vocab` (naming the id and its position) or the sizes exceed the kernels' 32-bit indices.
    pub fn from_ids(device: &Device, ids: &[i32], vocab: usize) -> Result<Self, KernelError> {
        const WHAT: &str = "RowGroups::from_ids";
        if vocab > i32::MAX as usize || ids.len() > i32::MAX as usize {
            return Err(bad(
                WHAT,
                format!(
                    "{} ids into {vocab} rows exceed the 32-bit index range",
                    ids.len()
                ),
            ));
        }
        if let Some(p) = ids.iter().position(|&i| i < 0 || i as usize >= vocab) {
            return Err(bad(
                WHAT,
                format!(
                    "id {} at position {p} is outside a table of {vocab} rows",
                    ids[p]
                ),
            ));
        }
        // In range, so non-negative and below 2^31: the packed key sorts by (id, position).
        let mut keyed: Vec<u64> = ids
            .iter()
            .enumerate()
            .map(|(p, &id)| ((id as u64) << 32) | p as u64)
            .collect();
        keyed.sort_unstable();
        let order: Vec<u32> = keyed.iter().map(|&k| k as u32).collect();
        let mut unique = Vec::new();
        let mut group_offsets = Vec::new();
        for (k, &key) in keyed.iter().enumerate() {
            let id = (key >> 32) as i32;
            if unique.last() != Some(&id) {
                unique.push(id);
                group_offsets.push(k as u32);
            }
        }
        group_offsets.push(ids.len() as u32);

        let mut chunk_start = Vec::new();
        let mut chunk_dest = Vec::new();
        let mut multi_row = Vec::new();
        let mut multi_first = Vec::new();
        let mut slot = 0u32;
        for (g, &id) in unique.iter().enumerate() {
            let (a, b) = (group_offsets[g] as usize, group_offsets[g + 1] as usize);
            let n_chunks = (b - a).div_ceil(EMBEDDING_CHUNK);
            if n_chunks > 1 {
                multi_row.push(id as u32);
                multi_first.push(slot);
            }
            for k in 0..n_chunks {
                chunk_start.push((a + k * EMBEDDING_CHUNK) as u32);
                if n_chunks == 1 {
                    chunk_dest.push(id as u32);
                } else {
                    chunk_dest.push(PARTIAL_FLAG | slot);
                    slot += 1;
                }
            }
        }
        chunk_start.push(ids.len() as u32);
        let multi_groups = multi_row.len();
        multi_first.push(slot);
        let chunks = chunk_dest.len();

        let device_index = match device {
            Device::Cpu => None,
            Device::Cuda(_) => {
                let mut packed = Vec::with_capacity(
                    order.len() + chunk_start.len() + chunks + multi_groups + multi_first.len(),
                );
                for part in [&order, &chunk_start, &chunk_dest, &multi_row, &multi_first] {
                    packed.extend_from_slice(part);
                }
                Some(DeviceIndex {
                    ids: device.upload(ids)?,
                    index: device.upload(&packed)?,
                })
            }
        };
        Ok(RowGroups {
            vocab,
            ids: ids.to_vec(),
            unique,
            group_offsets,
            order,
            chunks,
            partial_slots: slot as usize,
            multi_groups,
            device: device_index,
        })
    }

    /// Positions (ids) in the batch.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Rows of the table the ids index.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The ids in position order.
    pub fn ids(&self) -> &[i32] {
        &self.ids
    }

    /// The distinct ids, increasing.
    pub fn unique_ids(&self) -> &[i32] {
        &self.unique
    }

    /// The positions of `unique_ids()[g]`, increasing.
    pub fn positions(&self, g: usize) -> &[u32] {
        match (self.group_offsets.get(g), self.group_offsets.get(g + 1)) {
            (Some(&a), Some(&b)) => &self.order[a as usize..b as usize],
            _ => &[],
        }
    }

    /// The device the grouping lives on.
    pub fn device(&self) -> Device {
        match &self.device {
            Some(d) => d.ids.device(),
            None => Device::Cpu,
        }
    }

    /// Offsets of the parts of the packed device index: (order, chunk_start, chunk_dest, multi_row,
    /// multi_first, end).
    fn layout(&self) -> [usize; 6] {
        let o = 0;
        let cs = o + self.order.len();
        let cd = cs + self.chunks + 1;
        let mr = cd + self.chunks;
        let mf = mr + self.multi_groups;
        [o, cs, cd, mr, mf, mf + self.multi_groups + 1]
    }
}

/// A position table `[rows >= seq, d]` and the sequence length of the batch (`batch = len / seq`).
#[derive(Debug, Clone, Copy)]
pub struct PositionTable<'a, T: FloatElement> {
    /// The table.
    pub table: &'a Buffer<T>,
    /// Positions per sequence: position `p` of the batch uses row `p % seq`.
    pub seq: usize,
}

/// A position table's gradient `[rows >= seq, d]` and the sequence length of the batch.
#[derive(Debug)]
pub struct PositionGrad<'a, D: FloatElement> {
    /// The gradient, added into.
    pub grad: &'a mut Buffer<D>,
    /// Positions per sequence.
    pub seq: usize,
}

impl<T: FloatElement> Placed for PositionTable<'_, T> {
    fn placement(&self) -> Option<Device> {
        self.table.placement()
    }
}

impl<D: FloatElement> Placed for PositionGrad<'_, D> {
    fn placement(&self) -> Option<Device> {
        self.grad.placement()
    }
}

fn check_type<T: FloatElement>(what: &'static str) -> Result<(), KernelError> {
    match T::DTYPE {
        DType::F32 | DType::BF16 => Ok(()),
        other => Err(bad(
            what,
            format!("element type {other} (f32 or bf16 only)"),
        )),
    }
}

/// Checks a position table of `len` elements against `d`, `seq` and the batch length.
fn check_positions(
    what: &'static str,
    len: usize,
    d: usize,
    seq: usize,
    n: usize,
) -> Result<(), KernelError> {
    if seq == 0 || n % seq != 0 {
        return Err(bad(
            what,
            format!("a batch of {n} positions is not whole sequences of {seq}"),
        ));
    }
    if len % d != 0 || len / d < seq {
        return Err(bad(
            what,
            format!("a position table of {len} elements does not hold {seq} rows of {d}"),
        ));
    }
    Ok(())
}

fn check_shape(what: &'static str, groups: &RowGroups, d: usize) -> Result<usize, KernelError> {
    if d == 0 || d > i32::MAX as usize {
        return Err(bad(what, format!("row length {d} (1..2^31)")));
    }
    groups
        .len()
        .checked_mul(d)
        .and(groups.vocab.checked_mul(d))
        .ok_or_else(|| bad(what, "sizes overflow".into()))?;
    Ok(groups.len() * d)
}

/// Forward: `out[p, :] = table[ids[p], :] (+ positions.table[p % seq, :])` for the batch of `groups`,
/// with `table` `[vocab, d]` and `out` `[len, d]` (see the module docs).
pub fn embedding_forward<T: FloatElement, O: FloatElement>(
    table: &Buffer<T>,
    d: usize,
    positions: Option<PositionTable<'_, T>>,
    groups: &RowGroups,
    out: &mut Buffer<O>,
) -> Result<(), KernelError> {
    const WHAT: &str = "embedding_forward";
    check_type::<T>(WHAT)?;
    check_type::<O>(WHAT)?;
    let n = check_shape(WHAT, groups, d)?;
    check_len(WHAT, groups.vocab * d, table.len())?;
    check_len(WHAT, n, out.len())?;
    if let Some(p) = &positions {
        check_positions(WHAT, p.table.len(), d, p.seq, groups.len())?;
    }
    let dev = device_of(WHAT, &[table, out, &positions])?;
    if groups.device() != table.device() {
        return Err(KernelError::WrongDevice(WHAT));
    }
    match dev {
        None => {
            let pos = match &positions {
                Some(p) => Some((p.table.host(WHAT)?, p.seq)),
                None => None,
            };
            cpu::forward(table.host(WHAT)?, pos, &groups.ids, d, out.host_mut(WHAT)?);
            Ok(())
        }
        Some(dev) => cuda::forward(&dev, table, d, positions, groups, out),
    }
}

/// Backward: adds the gradient of the token table into `d_table` (`[vocab, d]`) and, when given, of the
/// position table into `d_positions`, from `dy` (`[len, d]`) of the batch of `groups` (see the module docs).
pub fn embedding_backward<G: FloatElement, D: FloatElement>(
    dy: &Buffer<G>,
    d: usize,
    groups: &RowGroups,
    d_table: &mut Buffer<D>,
    d_positions: Option<PositionGrad<'_, D>>,
) -> Result<(), KernelError> {
    check_len("embedding_backward", groups.vocab * d, d_table.len())?;
    embedding_backward_at(dy, d, groups, (d_table, 0), d_positions)
}

/// [`embedding_backward`] adding the token table's gradient into the `[vocab, d]` range starting at
/// `offset` of a larger buffer (a model's flat gradient, so no table-sized temporary is made and
/// added): the same values, bit for bit, as a zeroed temporary added there afterwards.
pub fn embedding_backward_at<G: FloatElement, D: FloatElement>(
    dy: &Buffer<G>,
    d: usize,
    groups: &RowGroups,
    (d_table, offset): (&mut Buffer<D>, usize),
    d_positions: Option<PositionGrad<'_, D>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "embedding_backward";
    check_type::<G>(WHAT)?;
    check_type::<D>(WHAT)?;
    let n = check_shape(WHAT, groups, d)?;
    check_len(WHAT, n, dy.len())?;
    let table_len = groups.vocab * d;
    if offset
        .checked_add(table_len)
        .is_none_or(|end| end > d_table.len())
    {
        return Err(bad(
            WHAT,
            format!(
                "a table gradient of {table_len} elements at offset {offset} of a buffer of {}",
                d_table.len()
            ),
        ));
    }
    if let Some(p) = &d_positions {
        check_positions(WHAT, p.grad.len(), d, p.seq, groups.len())?;
    }
    let dev = device_of(WHAT, &[dy, d_table, &d_positions])?;
    if groups.device() != dy.device() {
        return Err(KernelError::WrongDevice(WHAT));
    }
    let range = offset..offset + table_len;
    match dev {
        None => {
            let dys = dy.host(WHAT)?;
            cpu::backward_table(dys, groups, d, &mut d_table.host_mut(WHAT)?[range]);
            if let Some(p) = d_positions {
                let batch = groups.len() / p.seq;
                cpu::backward_positions(dys, batch, p.seq, d, p.grad.host_mut(WHAT)?);
            }
            Ok(())
        }
        Some(dev) => cuda::backward(&dev, dy, d, groups, (d_table, range), d_positions),
    }
}
