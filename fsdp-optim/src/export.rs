//! Export of a sharded model's master weights as one consolidated safetensors file, by parameter name.
//!
//! The names are the module tree's (`conv1.weight`, `h.3.attn.c_attn.weight`: PyTorch's
//! `named_parameters()` names for a model written with the same attribute names), a tied parameter once.
//! FP8 weights are written from the optimizer's master copy (the F32 or F16-with-scale master, not the
//! E4M3 codes), so the file is the model being trained, at full precision. Any world size can read it
//! back (`fsdp_shard::FsdpModel::import_full`), and PyTorch with `safetensors.torch.load_file`.

use crate::{OptimError, Optimizer};
use fsdp_comm::ReduceOp;
use fsdp_shard::{FsdpModel, FullTensor, Module, ParamGroup, ShardError};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// Element type of an exported file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportDtype {
    /// F32 (exact masters).
    #[default]
    F32,
    /// BF16 (rounded to nearest even; half the size).
    Bf16,
}

/// Writes every parameter's master values to `path` (rank 0 writes; every rank calls it: the shards
/// are gathered with collectives). A failure to write on rank 0 is an error on every rank. Returns the
/// number of tensors written.
pub fn export_full<M: Module>(
    model: &mut FsdpModel<M>,
    optimizer: &dyn Optimizer,
    path: &Path,
    dtype: ExportDtype,
) -> Result<usize, OptimError> {
    export_with(model, optimizer, |tensors| {
        write_safetensors(path, &tensors, dtype)
    })
}

/// Gathers every parameter's master values (as [`export_full`] does) and hands them, by name in the
/// model's order, to `write` on rank 0 (a tied parameter once); every rank calls it. `write`'s error is
/// rank 0's; the other ranks get an error saying rank 0 failed. Returns the number of tensors handed over.
pub fn export_with<M: Module>(
    model: &mut FsdpModel<M>,
    optimizer: &dyn Optimizer,
    write: impl FnOnce(Vec<FullTensor>) -> Result<(), OptimError>,
) -> Result<usize, OptimError> {
    model.release_all()?;
    let names = model.param_names()?;
    let layout = model.layout().clone();
    let comm = model.comm().clone();
    let dev = model.device().clone();
    let ws = comm.world_size();
    // Full flat values of every unit's two groups (padded layout), gathered from the shards.
    let mut full: Vec<[Vec<f32>; 2]> = Vec::with_capacity(layout.units.len());
    for (u, unit) in layout.units.iter().enumerate() {
        let fp8 = optimizer.fp8_master_shard(u)?;
        let plain = model.sharded().unit(u)?.plain.to_vec()?;
        let mut both: [Vec<f32>; 2] = [Vec::new(), Vec::new()];
        for (g, shard) in [(ParamGroup::Fp8, fp8), (ParamGroup::Plain, plain)] {
            let group = unit.group(g);
            if group.is_empty() {
                continue;
            }
            let send = dev.upload(&shard)?;
            let mut recv = dev.zeros::<f32>(ws * shard.len())?;
            comm.all_gather((&send).into(), (&mut recv).into())?;
            both[g as usize] = group.compact_gathered(&recv.to_vec()?, ws);
        }
        full.push(both);
    }
    let mut written = 0;
    let outcome = if comm.rank() == 0 {
        let mut tensors: Vec<FullTensor> = Vec::with_capacity(names.len());
        for (name, id) in &names {
            let p = id
                .index()
                .ok_or_else(|| ShardError::State(format!("{name}: unset id")))?;
            let loc = layout
                .location(p)
                .ok_or_else(|| ShardError::State(format!("{name}: in no unit")))?;
            let slot = &layout.units[loc.unit].group(loc.group).slots[loc.slot];
            tensors.push(FullTensor {
                name: name.clone(),
                shape: layout.params[p].shape.clone(),
                values: full[loc.unit][loc.group as usize][slot.offset..slot.offset + slot.numel]
                    .to_vec(),
            });
        }
        drop(full);
        written = tensors.len();
        write(tensors)
    } else {
        Ok(())
    };
    // Every rank learns whether rank 0 wrote the file.
    let mut failed = [if outcome.is_err() { 1.0f32 } else { 0.0 }];
    comm.all_reduce_host_f32(&mut failed, ReduceOp::Sum)?;
    outcome?;
    if failed[0] != 0.0 {
        // Rank 0's own error (with the operating system's reason) is the one to report.
        comm.note_failure_caused_by_peer();
        return Err(OptimError::Mismatch(
            "rank 0 could not write the export (its error says why)".into(),
        ));
    }
    Ok(written)
}

/// Writes `tensors` as one safetensors file (metadata `{"format": "pt"}`) in `dtype`, atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[FullTensor],
    dtype: ExportDtype,
) -> Result<(), OptimError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let data: Vec<u8> = match dtype {
                ExportDtype::F32 => t.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ExportDtype::Bf16 => t
                    .values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            };
            (t.name.clone(), t.shape.clone(), data)
        })
        .collect();
    write_file(path, &bytes, dtype)
}

fn write_file(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    dtype: ExportDtype,
) -> Result<(), OptimError> {
    let dt = match dtype {
        ExportDtype::F32 => Dtype::F32,
        ExportDtype::Bf16 => Dtype::BF16,
    };
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(dt, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| ShardError::InvalidArgument(format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect();
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| ShardError::InvalidArgument(format!("safetensors: {e}")))?;
    fsdp_shard::checkpoint::write_atomic(path, &bytes)?;
    Ok(())
}
