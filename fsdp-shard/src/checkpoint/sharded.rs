//! Sharded checkpoints (one file per rank, reshardable from N to M ranks) and full checkpoints
//! (consolidated on rank 0).
//!
//! A sharded checkpoint is a directory whose `index.json` commits one generation directory (see
//! `generation.rs`), which holds `rank-RRRRR-of-NNNNN.safetensors`, one per rank: the rank's FP8 weight
//! shard of every unit (`F8_E4M3`), its plain parameter shard (`F32`), the weights' scales, and the
//! optimizer's state shards with their per-parameter scales; metadata: the model layout (JSON), world
//! size, rank, generation and save id, the caller's key/values (step, schedule, data position,
//! random-generator state of that rank) and the optimizer's scalars.
//!
//! Offsets within a unit's flat buffers do not depend on the world size, so loading at another world size
//! concatenates the saved shards, drops the old tail padding and cuts the new shard.

use super::file::{CheckpointFile, TensorRecord};
use super::file_ops::{FileOps, StopAfter};
use super::generation::{self, read_commit, save_id_text, Commit, Plan};
use crate::layout::{ModelLayout, ParamGroup};
use crate::model::ShardedModel;
use crate::state::{ShardedState, StateShard};
use crate::ShardError;
use fp8_core::QType;
use fsdp_comm::{CommError, Communicator, ReduceOp};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const USER_PREFIX: &str = "user.";
const OPT_PREFIX: &str = "optim.";
const GENERATION_KEY: &str = "generation";
const SAVE_ID_KEY: &str = "save_id";

/// The file of `rank` in a generation directory of a checkpoint of `world_size` ranks (the committed
/// one is [`Commit::shard_file`]).
pub fn shard_file(dir: &Path, rank: usize, world_size: usize) -> PathBuf {
    dir.join(format!("rank-{rank:05}-of-{world_size:05}.safetensors"))
}

/// What a load found besides the tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedCheckpoint {
    /// World size the checkpoint was saved with.
    pub saved_world_size: usize,
    /// The caller's key/values of the file this rank read (its own rank's file when the world size is
    /// unchanged, rank 0's otherwise).
    pub extra: BTreeMap<String, String>,
}

/// Options of [`save_sharded_with`].
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Test hook: stop the save after a number of file operations, as a crash would.
    pub stop_after: Option<Arc<StopAfter>>,
}

fn unit_key(u: usize, what: &str) -> String {
    format!("unit{u}.{what}")
}

fn state_key(s: &StateShard) -> String {
    format!("state.{}.unit{}.{}", s.name, s.unit, s.group.name())
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// This rank's file of a sharded checkpoint, without the generation (known once rank 0 has planned).
fn rank_file(
    model: &ShardedModel,
    state: Option<&dyn ShardedState>,
    extra: &BTreeMap<String, String>,
) -> Result<CheckpointFile, ShardError> {
    let (rank, ws) = (model.comm().rank(), model.comm().world_size());
    let layout = model.layout();
    let mut file = CheckpointFile::default();
    file.metadata.insert("world_size".into(), ws.to_string());
    file.metadata.insert("rank".into(), rank.to_string());
    file.metadata.insert(
        "layout".into(),
        serde_json::to_string(layout.as_ref())
            .map_err(|e| ShardError::Checkpoint(format!("layout: {e}")))?,
    );
    for (k, v) in extra {
        file.metadata.insert(format!("{USER_PREFIX}{k}"), v.clone());
    }
    for u in 0..model.num_units() {
        let s = model.unit(u)?;
        let codes = s.fp8.to_vec()?;
        file.insert(
            unit_key(u, "fp8"),
            TensorRecord {
                qtype: QType::E4M3,
                shape: vec![codes.len()],
                bytes: codes,
            },
        );
        let plain = s.plain.to_vec()?;
        file.insert(
            unit_key(u, "plain"),
            TensorRecord::from_f32(&[plain.len()], &plain),
        );
        let scales = s.weight_scales.to_vec()?;
        file.insert(
            unit_key(u, "weight_scales"),
            TensorRecord::from_f32(&[scales.len()], &scales),
        );
        if layout.units[u].group(ParamGroup::Fp8).block_scaled {
            let b = s.block_scales.to_vec()?;
            file.insert(
                unit_key(u, "block_scales"),
                TensorRecord::from_f32(&[b.len()], &b),
            );
        }
    }
    if let Some(st) = state {
        for sh in st.export_state()? {
            let key = state_key(&sh);
            let n = sh.bytes.len() / sh.qtype.size_bytes();
            file.insert(
                key.clone(),
                TensorRecord {
                    qtype: sh.qtype,
                    shape: vec![n],
                    bytes: sh.bytes,
                },
            );
            file.insert(
                format!("{key}.scales"),
                TensorRecord::from_f32(&[sh.slot_scales.len()], &sh.slot_scales),
            );
        }
        for (k, v) in st.scalar_state() {
            file.metadata.insert(format!("{OPT_PREFIX}{k}"), v);
        }
    }
    Ok(file)
}

/// Header bytes allowed per tensor of a rank file: its entry (name, type, shape, offsets) and its CRC-32
/// metadata entry; 256 holds names of up to about 60 characters with 12-digit lengths.
const TENSOR_HEADER_BYTES: u64 = 256;
/// Tensors per unit at most: the FP8 codes, plain shard, weight scales and block scales, and up to five optimizer
/// state shards (Adam's FP8 master and moments, the plain moments) each with its scales.
const TENSORS_PER_UNIT: u64 = 4 + 5 * 2;
/// What [`shard_file_bytes`] adds for the fixed metadata (format, world size, rank, generation, save
/// id, checksums) and the filesystem's rounding of the file to whole blocks.
pub const SHARD_FILE_MARGIN: u64 = 16 << 10;

/// The bytes of this rank's file of a sharded checkpoint saved now with `state` and the key/values
/// `extra`, from above, without reading the device's large buffers: the model's shards exactly (FP8
/// codes, plain shard, weight scales), the state's [`ShardedState::state_bytes`] (every state buffer
/// it holds, so at least what it exports), the layout, `extra` and the state's scalars as they are
/// escaped into the header, 256 bytes for each of up to 13 tensors per unit (its header entry and
/// checksum), and [`SHARD_FILE_MARGIN`]. A test holds it at most 64 KiB above the file written. Each
/// rank estimates its own file (the ranks' metadata differ).
pub fn shard_file_bytes(
    model: &ShardedModel,
    state: Option<&dyn ShardedState>,
    extra: &BTreeMap<String, String>,
) -> Result<u64, ShardError> {
    let json = |v: &str| -> Result<u64, ShardError> {
        serde_json::to_string(v)
            .map(|t| t.len() as u64)
            .map_err(|e| ShardError::Checkpoint(format!("estimating a checkpoint: {e}")))
    };
    let entry = |prefix: &str, k: &str, v: &str| -> Result<u64, ShardError> {
        // "prefix.key":"value", with the separators.
        Ok(prefix.len() as u64 + json(k)? + json(v)? + 2)
    };
    let mut bytes = SHARD_FILE_MARGIN;
    for u in 0..model.num_units() {
        let s = model.unit(u)?;
        bytes += (s.fp8.num_bytes()
            + s.plain.num_bytes()
            + s.weight_scales.num_bytes()
            + s.block_scales.num_bytes()) as u64;
    }
    bytes += model.num_units() as u64 * TENSORS_PER_UNIT * TENSOR_HEADER_BYTES;
    let layout = serde_json::to_string(model.layout().as_ref())
        .map_err(|e| ShardError::Checkpoint(format!("layout: {e}")))?;
    bytes += entry("", "layout", &layout)?;
    for (k, v) in extra {
        bytes += entry(USER_PREFIX, k, v)?;
    }
    if let Some(st) = state {
        bytes += st.state_bytes() as u64;
        for (k, v) in st.scalar_state() {
            bytes += entry(OPT_PREFIX, &k, &v)?;
        }
    }
    Ok(bytes)
}

/// Saves a sharded checkpoint into `dir` (call on every rank; collective). The save is committed as a
/// whole or not at all: see [`save_sharded_with`].
pub fn save_sharded(
    dir: &Path,
    model: &ShardedModel,
    state: Option<&dyn ShardedState>,
    extra: &BTreeMap<String, String>,
) -> Result<(), ShardError> {
    save_sharded_with(dir, model, state, extra, &SaveOptions::default())
}

/// [`save_sharded`] with options (a test hook).
///
/// 1. Rank 0 locks `dir` for the save unless this process holds its [`super::CheckpointLock`] (another
///    holder is an error naming its process), removes what interrupted saves left, creates the next
///    generation's directory and broadcasts its number with a fresh save id.
/// 2. Every rank writes its file into that directory durably (temporary file, fsync, rename, directory
///    fsync).
/// 3. An all-reduce of every rank's outcome, the barrier before the commit: if any rank failed, no rank
///    commits and every rank returns an error (the failing rank its own), leaving the previous checkpoint
///    as it was.
/// 4. Rank 0 commits with one atomic rename of `index.json` and removes the previous generation; a
///    final all-reduce tells every rank whether the commit happened.
///
/// A crash at any point leaves `dir` loading as the previous checkpoint (before the rename) or the new
/// one (after it), never a mix.
pub fn save_sharded_with(
    dir: &Path,
    model: &ShardedModel,
    state: Option<&dyn ShardedState>,
    extra: &BTreeMap<String, String>,
    options: &SaveOptions,
) -> Result<(), ShardError> {
    let comm = model.comm().clone();
    let (rank, ws) = (comm.rank(), comm.world_size());
    let ops = FileOps::new(rank, options.stop_after.as_deref());
    let mut own_error: Option<ShardError> = None;
    let mut file = rank_file(model, state, extra)
        .map_err(|e| own_error = Some(e))
        .ok();
    // 1. Rank 0 plans; generation 0 in the broadcast says it could not.
    let mut save_lock = None;
    let mut rank0_plan = None;
    if rank == 0 && own_error.is_none() {
        match generation::prepare(dir, &ops) {
            Ok((plan, lock)) => {
                rank0_plan = Some(plan);
                save_lock = lock;
            }
            Err(e) => own_error = Some(e),
        }
    }
    let plan_bytes = rank0_plan.map(Plan::to_bytes).unwrap_or([0u8; 16]);
    let plan = match broadcast_plan(comm.as_ref(), plan_bytes) {
        Ok(p) => rank0_plan.or(p),
        Err(e) => return Err(own_error.unwrap_or(e.into())),
    };
    // 2. Every rank writes its file.
    if let (Some(plan), Some(file), None) = (plan, file.as_mut(), own_error.as_ref()) {
        let gen_dir = generation::generation_dir(dir, plan.generation);
        file.metadata
            .insert(GENERATION_KEY.into(), plan.generation.to_string());
        file.metadata
            .insert(SAVE_ID_KEY.into(), save_id_text(plan.save_id));
        if let Err(e) = file
            .to_bytes()
            .and_then(|bytes| ops.write_durable(&shard_file(&gen_dir, rank, ws), &bytes))
        {
            own_error = Some(e);
        }
    }
    // 3. Who failed? (The barrier before the commit.)
    let mut failed = vec![0f32; ws];
    failed[rank] = if own_error.is_some() { 1.0 } else { 0.0 };
    if let Err(e) = comm.all_reduce_host_f32(&mut failed, ReduceOp::Max) {
        return Err(own_error.unwrap_or(e.into()));
    }
    if let Some(e) = own_error {
        return Err(e);
    }
    let failed: Vec<usize> = (0..ws).filter(|&r| failed[r] != 0.0).collect();
    let plan = match plan {
        Some(p) if failed.is_empty() => p,
        _ => {
            comm.note_failure_caused_by_peer();
            return Err(ShardError::Checkpoint(format!(
                "{}: not saved: rank(s) {failed:?} failed to write their part (their own errors \
                 say why); the previous checkpoint is unchanged",
                dir.display()
            )));
        }
    };
    // 4. Rank 0 commits; everyone learns whether it did.
    let mut commit_failed = [0f32];
    if rank == 0 {
        if let Err(e) = generation::commit(dir, &plan, ws, extra, &ops) {
            own_error = Some(e);
            commit_failed[0] = 1.0;
        }
    }
    let agreed = comm.all_reduce_host_f32(&mut commit_failed, ReduceOp::Max);
    drop(save_lock);
    if let Some(e) = own_error {
        return Err(e);
    }
    agreed?;
    if commit_failed[0] != 0.0 {
        comm.note_failure_caused_by_peer();
        return Err(ShardError::Checkpoint(format!(
            "{}: not saved: rank 0 could not commit (its error says why); the previous checkpoint \
             is unchanged",
            dir.display()
        )));
    }
    Ok(())
}

/// Broadcasts rank 0's plan; `None` when rank 0 could not plan.
fn broadcast_plan(comm: &dyn Communicator, bytes: [u8; 16]) -> Result<Option<Plan>, CommError> {
    let mut buf = comm.device().upload(&bytes)?;
    comm.broadcast_in_place((&mut buf).into(), 0)?;
    Ok(Plan::from_bytes(&buf.to_vec()?))
}

/// Reads `dir`'s index: the saved world size and the caller's key/values (see [`read_commit`] for the
/// whole commit record).
pub fn read_index(dir: &Path) -> Result<(usize, BTreeMap<String, String>), ShardError> {
    let c = read_commit(dir)?;
    Ok((c.world_size, c.extra))
}

/// Reads and checks all files of the committed generation against `layout`: each must say it is its
/// rank of the committed world size, of the committed generation and save.
fn read_all(dir: &Path, layout: &ModelLayout) -> Result<(Commit, Vec<CheckpointFile>), ShardError> {
    let commit = read_commit(dir)?;
    let n = commit.world_size;
    let mut files = Vec::with_capacity(n);
    for r in 0..n {
        let path = commit.shard_file(r);
        let f = CheckpointFile::read(&path)?;
        let origin = path.display().to_string();
        let ws: usize = f.meta_parse("world_size")?;
        let rank: usize = f.meta_parse("rank")?;
        if ws != n || rank != r {
            return Err(ShardError::Checkpoint(format!(
                "{origin}: says rank {rank} of {ws}, expected rank {r} of {n}"
            )));
        }
        let generation: u64 = f.meta_parse(GENERATION_KEY)?;
        let save_id = f.meta(SAVE_ID_KEY)?;
        if generation != commit.generation || save_id != commit.save_id {
            return Err(ShardError::Checkpoint(format!(
                "{origin}: written by save {save_id} (generation {generation}), but {} commits save \
                 {} (generation {}): the files mix two saves; refusing the checkpoint",
                dir.join(generation::INDEX).display(),
                commit.save_id,
                commit.generation
            )));
        }
        let saved: ModelLayout = serde_json::from_str(f.meta("layout")?)
            .map_err(|e| ShardError::Checkpoint(format!("{origin}: layout unreadable ({e})")))?;
        if &saved != layout {
            return Err(ShardError::Checkpoint(format!(
                "{origin}: saved for a different model (parameters or units differ)"
            )));
        }
        files.push(f);
    }
    Ok((commit, files))
}

/// How a group's data is split into per-rank shards at one world size: every rank stores `stored`
/// elements, of which the first `counts[rank]` are real (the rest padding).
struct Pieces {
    stored: usize,
    counts: Vec<usize>,
}

impl Pieces {
    /// The pieces of group `g` at world size `ws`: equal shards whose real data ends at the group's
    /// length (the last shards hold the padding), or a block-scaled group's uneven shards.
    fn of(g: &crate::layout::GroupLayout, ws: usize) -> Self {
        let stored = g.shard_len(ws);
        let counts = if g.block_scaled {
            g.shard_counts(ws)
        } else {
            (0..ws)
                .map(|r| g.len.saturating_sub(r * stored).min(stored))
                .collect()
        };
        Pieces { stored, counts }
    }
}

/// [`reshard_pieces`] of group `g`'s tensor `key`, saved at world size `n`, for `rank` of `ws`.
fn reshard_group(
    files: &[CheckpointFile],
    key: &str,
    qtype: QType,
    g: &crate::layout::GroupLayout,
    n: usize,
    rank: usize,
    ws: usize,
) -> Result<Vec<u8>, ShardError> {
    reshard_pieces(
        files,
        key,
        qtype,
        &Pieces::of(g, n),
        &Pieces::of(g, ws),
        rank,
    )
}

/// Concatenates the real parts of the saved shards of tensor `key` (each checked to hold
/// `saved.stored` elements of `qtype`) and cuts this rank's new shard, padded to `new.stored`.
fn reshard_pieces(
    files: &[CheckpointFile],
    key: &str,
    qtype: QType,
    saved: &Pieces,
    new: &Pieces,
    rank: usize,
) -> Result<Vec<u8>, ShardError> {
    let es = qtype.size_bytes();
    let mut full = Vec::with_capacity(saved.counts.iter().sum::<usize>() * es);
    for (r, f) in files.iter().enumerate() {
        let t = f.tensor(key)?;
        if t.qtype != qtype || t.bytes.len() != saved.stored * es {
            return Err(ShardError::Checkpoint(format!(
                "rank {r}: tensor {key} is {} x {} bytes, expected {qtype} x {}",
                t.qtype,
                t.bytes.len(),
                saved.stored * es
            )));
        }
        let real = saved.counts.get(r).copied().unwrap_or(0) * es;
        full.extend_from_slice(&t.bytes[..real]);
    }
    let start: usize = new.counts[..rank.min(new.counts.len())].iter().sum();
    let real = new.counts.get(rank).copied().unwrap_or(0);
    let mut out = full
        .get(start * es..(start + real) * es)
        .ok_or_else(|| {
            ShardError::Checkpoint(format!(
                "tensor {key}: the saved shards hold {} elements, rank {rank} needs {}..{}",
                full.len() / es,
                start,
                start + real
            ))
        })?
        .to_vec();
    out.resize(new.stored * es, 0);
    Ok(out)
}

/// The one copy of a tensor that every rank saved identically (scales); differing copies are an error.
fn agreed(files: &[CheckpointFile], key: &str) -> Result<Vec<f32>, ShardError> {
    let first = files[0].tensor(key)?.to_f32(key)?;
    for (r, f) in files.iter().enumerate().skip(1) {
        if f.tensor(key)?.to_f32(key)? != first {
            return Err(ShardError::Checkpoint(format!(
                "tensor {key} differs between rank 0 and rank {r}: scales must agree"
            )));
        }
    }
    Ok(first)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Loads a sharded checkpoint saved at any world size into `model` (and `state`) on this rank.
pub fn load_sharded(
    dir: &Path,
    model: &mut ShardedModel,
    state: Option<&mut dyn ShardedState>,
) -> Result<LoadedCheckpoint, ShardError> {
    let layout = model.layout().clone();
    let (rank, ws) = (model.comm().rank(), model.comm().world_size());
    let (commit, files) = read_all(dir, &layout)?;
    let n = commit.world_size;
    for (u, unit) in layout.units.iter().enumerate() {
        let g8 = unit.group(ParamGroup::Fp8);
        let gp = unit.group(ParamGroup::Plain);
        let codes = reshard_group(&files, &unit_key(u, "fp8"), QType::E4M3, g8, n, rank, ws)?;
        let plain = reshard_group(&files, &unit_key(u, "plain"), QType::F32, gp, n, rank, ws)?;
        let block_scales = if g8.block_scaled {
            let key = unit_key(u, "block_scales");
            let saved = Pieces {
                stored: g8.scale_shard_len(n),
                counts: g8.scale_counts(n),
            };
            let new = Pieces {
                stored: g8.scale_shard_len(ws),
                counts: g8.scale_counts(ws),
            };
            Some(reshard_pieces(
                &files,
                &key,
                QType::F32,
                &saved,
                &new,
                rank,
            )?)
        } else {
            None
        };
        let scales = agreed(&files, &unit_key(u, "weight_scales"))?;
        if scales.len() != 2 * g8.slots.len() {
            return Err(ShardError::Checkpoint(format!(
                "unit {u}: {} weight scales for {} FP8 weights",
                scales.len(),
                g8.slots.len()
            )));
        }
        let s = model.unit_mut(u)?;
        s.fp8.copy_from_host(&codes)?;
        s.plain.copy_from_host(&f32s(&plain))?;
        s.weight_scales.copy_from_host(&scales)?;
        if let Some(b) = block_scales {
            s.block_scales.copy_from_host(&f32s(&b))?;
        }
    }
    let own = if n == ws { rank } else { 0 };
    if let Some(st) = state {
        let mut shards = st.export_state()?;
        for sh in &mut shards {
            let key = state_key(sh);
            let unit = layout.units.get(sh.unit).ok_or_else(|| {
                ShardError::Checkpoint(format!("optimizer state names unit {}", sh.unit))
            })?;
            let g = unit.group(sh.group);
            sh.bytes = reshard_group(&files, &key, sh.qtype, g, n, rank, ws)?;
            sh.slot_scales = agreed(&files, &format!("{key}.scales"))?;
        }
        st.import_state(shards)?;
        let scalars: Vec<(String, String)> = files[own]
            .metadata
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix(OPT_PREFIX)
                    .map(|k| (k.to_string(), v.clone()))
            })
            .collect();
        st.load_scalar_state(&scalars)?;
    }
    let extra = files[own]
        .metadata
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix(USER_PREFIX)
                .map(|k| (k.to_string(), v.clone()))
        })
        .collect();
    Ok(LoadedCheckpoint {
        saved_world_size: n,
        extra,
    })
}

/// How FP8 weights are written in a full checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullWeights {
    /// Dequantized to F32.
    F32,
    /// As `F8_E4M3` codes with a companion `<name>.scale_inv` F32 tensor (PyTorch/HF convention).
    Fp8WithScaleInv,
}

/// Gathers every parameter and writes one consolidated file on rank 0 (call on every rank; collective).
/// Plain parameters are written as F32 by name; FP8 weights per `weights`.
pub fn save_full(
    path: &Path,
    model: &mut ShardedModel,
    weights: FullWeights,
    extra: &BTreeMap<String, String>,
) -> Result<(), ShardError> {
    let layout = model.layout().clone();
    let rank = model.comm().rank();
    let mut file = CheckpointFile::default();
    for (k, v) in extra {
        file.metadata.insert(format!("{USER_PREFIX}{k}"), v.clone());
    }
    for u in 0..layout.units.len() {
        let was = model.is_gathered(u);
        // Exact F32 plain values even where compute gathers them in BF16.
        model.gather_exact(u)?;
        if rank == 0 {
            for g in ParamGroup::ALL {
                for slot in &layout.units[u].group(g).slots {
                    let spec = &layout.params[slot.param];
                    match model.param(slot.param)? {
                        crate::model::GatheredParam::Plain(b) => {
                            file.insert(
                                spec.name.clone(),
                                TensorRecord::from_f32(&spec.shape, &b.to_vec()?),
                            );
                        }
                        crate::model::GatheredParam::PlainBf16(_) => {
                            return Err(ShardError::State(format!(
                                "{}: gathered in BF16 for a consolidated checkpoint",
                                spec.name
                            )))
                        }
                        crate::model::GatheredParam::Fp8Block {
                            codes,
                            scale_inv,
                            cols,
                        } => match weights {
                            FullWeights::F32 => {
                                let v = crate::model::decode_block_rows(
                                    &codes.to_vec()?,
                                    &scale_inv.to_vec()?,
                                    *cols,
                                )?;
                                file.insert(
                                    spec.name.clone(),
                                    TensorRecord::from_f32(&spec.shape, &v),
                                );
                            }
                            FullWeights::Fp8WithScaleInv => {
                                // As DeepSeek-V3's checkpoints hold them: one inverse scale per
                                // 128x128 block, `[ceil(out/128), ceil(in/128)]` (named
                                // `<name>.scale_inv` here, like a per-tensor weight's scalar).
                                let grid_cols = cols.div_ceil(crate::layout::BLOCK_ROWS);
                                let row_len =
                                    grid_cols.next_multiple_of(crate::layout::SCALE_ROW_ALIGN);
                                let si = scale_inv.to_vec()?;
                                let grid: Vec<f32> = si
                                    .chunks(row_len)
                                    .flat_map(|r| r[..grid_cols].to_vec())
                                    .collect();
                                file.insert(
                                    spec.name.clone(),
                                    TensorRecord {
                                        qtype: QType::E4M3,
                                        shape: spec.shape.clone(),
                                        bytes: codes.to_vec()?,
                                    },
                                );
                                file.insert(
                                    format!("{}.scale_inv", spec.name),
                                    TensorRecord::from_f32(
                                        &[grid.len() / grid_cols, grid_cols],
                                        &grid,
                                    ),
                                );
                            }
                        },
                        crate::model::GatheredParam::Fp8 { codes, scales } => {
                            let codes = codes.to_vec()?;
                            let sc = scales.to_vec()?;
                            let inv = sc.get(1).copied().unwrap_or(1.0);
                            match weights {
                                FullWeights::F32 => {
                                    let mut v = vec![0f32; codes.len()];
                                    fp8_core::Fp8Format::E4M3.decode_scaled(&codes, inv, &mut v)?;
                                    file.insert(
                                        spec.name.clone(),
                                        TensorRecord::from_f32(&spec.shape, &v),
                                    );
                                }
                                FullWeights::Fp8WithScaleInv => {
                                    file.insert(
                                        spec.name.clone(),
                                        TensorRecord {
                                            qtype: QType::E4M3,
                                            shape: spec.shape.clone(),
                                            bytes: codes,
                                        },
                                    );
                                    file.insert(
                                        format!("{}.scale_inv", spec.name),
                                        TensorRecord {
                                            qtype: QType::F32,
                                            shape: vec![],
                                            bytes: bytes_f32(&[inv]),
                                        },
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        if !was {
            model.release(u)?;
        }
    }
    // Rank 0 writes; an all-reduce of its outcome (instead of a bare barrier) lets every rank return
    // promptly with an error if the write failed.
    let mut failed = [0f32];
    let mut own_error = None;
    if rank == 0 {
        if let Err(e) = file.write_atomic(path) {
            own_error = Some(e);
            failed[0] = 1.0;
        }
    }
    let agreed = model.comm().all_reduce_host_f32(&mut failed, ReduceOp::Max);
    if let Some(e) = own_error {
        return Err(e);
    }
    agreed?;
    if failed[0] != 0.0 {
        model.comm().note_failure_caused_by_peer();
        return Err(ShardError::Checkpoint(format!(
            "{}: not saved: rank 0 could not write it (its error says why)",
            path.display()
        )));
    }
    Ok(())
}

/// Parameters of a full checkpoint by name: shape and F32 values.
pub type FullParams = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Reads a full checkpoint's parameters by name as F32 (FP8 weights dequantized with their `scale_inv`).
pub fn read_full(path: &Path) -> Result<FullParams, ShardError> {
    let f = CheckpointFile::read(path)?;
    let mut out = BTreeMap::new();
    for (name, t) in &f.tensors {
        if name.ends_with(".scale_inv") {
            continue;
        }
        let values = match t.qtype {
            QType::F32 => t.to_f32(name)?,
            QType::E4M3 | QType::E5M2 => {
                let inv_key = format!("{name}.scale_inv");
                let inv_t = f.tensor(&inv_key)?;
                let inv = inv_t.to_f32(&inv_key)?;
                let fmt = t
                    .qtype
                    .fp8_format()
                    .ok_or(fp8_core::Fp8Error::NotFp8(t.qtype))?;
                let mut v = vec![0f32; t.bytes.len()];
                if let ([_, gc], [_, cols]) = (inv_t.shape.as_slice(), t.shape.as_slice()) {
                    // 128x128 block scales, `[ceil(rows/128), ceil(cols/128)]`.
                    let bs = crate::layout::BLOCK_ROWS;
                    let rows = t.bytes.len() / (*cols).max(1);
                    if *gc != cols.div_ceil(bs) || inv.len() != rows.div_ceil(bs) * gc {
                        return Err(ShardError::Checkpoint(format!(
                            "{}: {inv_key} has shape {:?}, not the 128x128 block grid of {name} {:?}",
                            path.display(),
                            inv_t.shape,
                            t.shape
                        )));
                    }
                    for (i, (c, o)) in t.bytes.chunks(*cols).zip(v.chunks_mut(*cols)).enumerate() {
                        for (j, (cc, oo)) in c.chunks(bs).zip(o.chunks_mut(bs)).enumerate() {
                            fmt.decode_scaled(cc, inv[(i / bs) * gc + j], oo)?;
                        }
                    }
                } else {
                    let inv = *inv
                        .first()
                        .ok_or_else(|| ShardError::Checkpoint(format!("{inv_key} is empty")))?;
                    fmt.decode_scaled(&t.bytes, inv, &mut v)?;
                }
                v
            }
            q => {
                return Err(ShardError::Checkpoint(format!(
                    "{}: tensor {name} has type {q}, expected f32 or fp8",
                    path.display()
                )))
            }
        };
        let numel: usize = t.shape.iter().product();
        if numel != values.len() {
            return Err(ShardError::Checkpoint(format!(
                "{}: tensor {name} shape {:?} does not match its {} values",
                path.display(),
                t.shape,
                values.len()
            )));
        }
        out.insert(name.clone(), (t.shape.clone(), values));
    }
    Ok(out)
}
