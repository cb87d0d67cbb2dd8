//! Launches of the embedding kernels (`embedding.cu`). Arguments were validated by `mod.rs`.

use super::{PositionGrad, PositionTable, RowGroups, EMBEDDING_MODULE};
use crate::cast::FloatElement;
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::launch::{grid, kernel_name, launch, optional_ptr};
use crate::{Buffer, CudaDevice, KernelError};

fn index_of<'a>(
    groups: &'a RowGroups,
    what: &'static str,
) -> Result<(&'a Buffer<i32>, &'a Buffer<u32>), KernelError> {
    groups
        .device
        .as_ref()
        .map(|d| (&d.ids, &d.index))
        .ok_or(KernelError::WrongDevice(what))
}

pub(super) fn forward<T: FloatElement, O: FloatElement>(
    dev: &CudaDevice,
    table: &Buffer<T>,
    d: usize,
    positions: Option<PositionTable<'_, T>>,
    groups: &RowGroups,
    out: &mut Buffer<O>,
) -> Result<(), KernelError> {
    const WHAT: &str = "embedding_forward";
    if groups.is_empty() {
        return Ok(());
    }
    let (ids, _) = index_of(groups, WHAT)?;
    let items = (groups.len() * d.div_ceil(8)) as u64;
    let cfg = grid(dev, items);
    let (n, dd, vocab) = (groups.len() as i32, d as i32, groups.vocab as i32);
    let seq = positions.as_ref().map_or(1, |p| p.seq) as i32;
    let (ts, is, os) = (cs(table, WHAT)?, cs(ids, WHAT)?, cs_mut(out, WHAT)?);
    let pos = positions.map(|p| cs(p.table, WHAT)).transpose()?;
    let pos = optional_ptr(pos, dev.stream());
    // table holds vocab*d elements, pos at least seq*d, ids n, out n*d (checked by the caller); ids
    // outside 0..vocab are not read through.
    launch!(
        dev,
        &EMBEDDING_MODULE,
        kernel_name!("embedding_fwd_", T::NAME, "_", O::NAME),
        cfg,
        "embedding_fwd_<T>_<O>(const T* table, const T* pos, const int* ids, O* out, int n, int d, \
         int vocab, int seq)",
        [ts, &pos.ptr, is, os, &n, &dd, &vocab, &seq]
    )
}

pub(super) fn backward<G: FloatElement, D: FloatElement>(
    dev: &CudaDevice,
    dy: &Buffer<G>,
    d: usize,
    groups: &RowGroups,
    (d_table, range): (&mut Buffer<D>, std::ops::Range<usize>),
    d_positions: Option<PositionGrad<'_, D>>,
) -> Result<(), KernelError> {
    const WHAT: &str = "embedding_backward";
    if groups.is_empty() {
        return Ok(());
    }
    let (_, index) = index_of(groups, WHAT)?;
    let idx = cs(index, WHAT)?;
    let [o, cs0, cd, mr, mf, end] = groups.layout();
    if end != idx.len() {
        return Err(KernelError::Internal(format!(
            "RowGroups index holds {} words, its layout {end}",
            idx.len()
        )));
    }
    let nvec = d.div_ceil(8);
    let dd = d as i32;
    let stream = dev.stream();
    // SAFETY: every partial slot (partial_slots rows of d) is written by `embedding_bwd_chunks_*` (one chunk
    // per slot) before `embedding_bwd_multi_*` reads it, in stream order. At least one element so the
    // pointer is valid when there is no slot.
    let mut partial = unsafe { stream.alloc::<f32>((groups.partial_slots * d).max(1)) }?;
    {
        let cfg = grid(dev, (groups.chunks * nvec) as u64);
        let chunks = groups.chunks as i32;
        let (order, starts, dests) = (idx.slice(o..cs0), idx.slice(cs0..cd), idx.slice(cd..mr));
        let mut table = cs_mut(d_table, WHAT)?.slice_mut(range.clone());
        let (gs, ts, ps) = (cs(dy, WHAT)?, &mut table, &mut partial);
        // The index views hold n, chunks + 1 and chunks words built by RowGroups (positions < n, table
        // rows < vocab, slots < partial_slots); dy holds n*d elements, the table view vocab*d (checked by the
        // caller).
        launch!(
            dev,
            &EMBEDDING_MODULE,
            kernel_name!("embedding_bwd_chunks_", G::NAME, "_", D::NAME),
            cfg,
            "embedding_bwd_chunks_<G>_<D>(const G* dy, const u32* order, const u32* chunk_start, \
             const u32* chunk_dest, int chunks, int d, D* d_table, float* partial)",
            [gs, &order, &starts, &dests, &chunks, &dd, ts, ps]
        )?;
    }
    if groups.multi_groups > 0 {
        let cfg = grid(dev, (groups.multi_groups * nvec) as u64);
        let m = groups.multi_groups as i32;
        let (rows, first) = (idx.slice(mr..mf), idx.slice(mf..end));
        let mut table = cs_mut(d_table, WHAT)?.slice_mut(range);
        let (ps, ts) = (&partial, &mut table);
        // multi_row holds `groups` table rows < vocab, multi_first groups + 1 increasing slot offsets <=
        // partial_slots; partial holds partial_slots*d.
        launch!(
            dev,
            &EMBEDDING_MODULE,
            kernel_name!("embedding_bwd_multi_", D::NAME),
            cfg,
            "embedding_bwd_multi_<D>(const float* partial, const u32* multi_row, const u32* multi_first, \
             int groups, int d, D* d_table)",
            [ps, &rows, &first, &m, &dd, ts]
        )?;
    }
    if let Some(p) = d_positions {
        let cfg = grid(dev, (p.seq * nvec) as u64);
        let (batch, seq) = ((groups.len() / p.seq) as i32, p.seq as i32);
        let (gs, ps) = (cs(dy, WHAT)?, cs_mut(p.grad, WHAT)?);
        // dy holds batch*seq*d elements, d_pos at least seq*d (checked by the caller).
        launch!(
            dev,
            &EMBEDDING_MODULE,
            kernel_name!("embedding_bwd_pos_", G::NAME, "_", D::NAME),
            cfg,
            "embedding_bwd_pos_<G>_<D>(const G* dy, int batch, int seq, int d, D* d_pos)",
            [gs, &batch, &seq, &dd, ps]
        )?;
    }
    Ok(())
}
