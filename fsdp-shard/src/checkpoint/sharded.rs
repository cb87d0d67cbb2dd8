//! Sharded checkpoints (one file per rank, reshardable from N to M ranks) and full checkpoints
//! (consolidated on rank 0).
//!
//! A sharded checkpoint is a directory:
//! - `rank-RRRRR-of-NNNNN.safetensors`, one per rank: the rank's FP8 weight shard of every unit (`F8_E4M3`),
//!   its plain parameter shard (`F32`), the weights' scales, and the optimizer's state shards with their
//!   per-parameter scales; metadata: the model layout (JSON), world size, rank, the caller's key/values
//!   (step, schedule, data position, random-generator state of that rank) and the optimizer's scalars;
//! - `index.json`, written by rank 0 after every rank has written its file: world size and the
//!   caller's key/values. A directory without it is an incomplete save.
//!
//! Offsets within a unit's flat buffers do not depend on the world size, so loading at another world size
//! concatenates the saved shards, drops the old tail padding and cuts the new shard.

use super::file::{CheckpointFile, TensorRecord};
use crate::layout::{ModelLayout, ParamGroup};
use crate::model::ShardedModel;
use crate::state::{ShardedState, StateShard};
use crate::ShardError;
use fp8_core::QType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const INDEX: &str = "index.json";
const USER_PREFIX: &str = "user.";
const OPT_PREFIX: &str = "optim.";

/// The file of `rank` in a checkpoint of `world_size` ranks.
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

#[derive(serde::Serialize, serde::Deserialize)]
struct Index {
    format: String,
    world_size: usize,
    extra: BTreeMap<String, String>,
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

/// Saves this rank's part of a sharded checkpoint (call on every rank; collective).
pub fn save_sharded(
    dir: &Path,
    model: &ShardedModel,
    state: Option<&dyn ShardedState>,
    extra: &BTreeMap<String, String>,
) -> Result<(), ShardError> {
    let comm = model.comm().clone();
    let (rank, ws) = (comm.rank(), comm.world_size());
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
    file.write_atomic(&shard_file(dir, rank, ws))?;
    comm.barrier()?;
    if rank == 0 {
        let index = Index {
            format: super::FORMAT_VERSION.into(),
            world_size: ws,
            extra: extra.clone(),
        };
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| ShardError::Checkpoint(format!("index: {e}")))?;
        super::write_atomic(&dir.join(INDEX), text.as_bytes())?;
    }
    comm.barrier()?;
    Ok(())
}

/// Reads `dir`'s index: the saved world size and the caller's key/values.
pub fn read_index(dir: &Path) -> Result<(usize, BTreeMap<String, String>), ShardError> {
    let path = dir.join(INDEX);
    let text = std::fs::read_to_string(&path).map_err(|e| ShardError::Io {
        path: path.clone(),
        source: e,
    })?;
    let index: Index = serde_json::from_str(&text).map_err(|e| {
        ShardError::Checkpoint(format!("{}: malformed index ({e})", path.display()))
    })?;
    if index.format != super::FORMAT_VERSION {
        return Err(ShardError::Checkpoint(format!(
            "{}: unsupported format {:?}",
            path.display(),
            index.format
        )));
    }
    if index.world_size == 0 {
        return Err(ShardError::Checkpoint(format!(
            "{}: world size 0",
            path.display()
        )));
    }
    Ok((index.world_size, index.extra))
}

/// Reads and checks all files of a sharded checkpoint against `layout`.
fn read_all(dir: &Path, layout: &ModelLayout) -> Result<(usize, Vec<CheckpointFile>), ShardError> {
    let (n, _) = read_index(dir)?;
    let mut files = Vec::with_capacity(n);
    for r in 0..n {
        let path = shard_file(dir, r, n);
        let f = CheckpointFile::read(&path)?;
        let origin = path.display().to_string();
        let ws: usize = f.meta_parse("world_size")?;
        let rank: usize = f.meta_parse("rank")?;
        if ws != n || rank != r {
            return Err(ShardError::Checkpoint(format!(
                "{origin}: says rank {rank} of {ws}, expected rank {r} of {n}"
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
    Ok((n, files))
}

/// Concatenates the saved shards of tensor `key`, checks each has `saved_shard` elements of `qtype`, and
/// cuts this rank's new shard (`len` = unpadded group length, re-padded for `ws`).
fn reshard(
    files: &[CheckpointFile],
    key: &str,
    qtype: QType,
    saved_shard: usize,
    len: usize,
    rank: usize,
    new_shard: usize,
) -> Result<Vec<u8>, ShardError> {
    let es = qtype.size_bytes();
    let mut full = Vec::with_capacity(files.len() * saved_shard * es);
    for (r, f) in files.iter().enumerate() {
        let t = f.tensor(key)?;
        if t.qtype != qtype || t.bytes.len() != saved_shard * es {
            return Err(ShardError::Checkpoint(format!(
                "rank {r}: tensor {key} is {} x {} bytes, expected {qtype} x {}",
                t.qtype,
                t.bytes.len(),
                saved_shard * es
            )));
        }
        full.extend_from_slice(&t.bytes);
    }
    full.truncate(len * es);
    full.resize(new_shard * (rank + 1) * es, 0);
    Ok(full[new_shard * rank * es..].to_vec())
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
    let (n, files) = read_all(dir, &layout)?;
    for (u, unit) in layout.units.iter().enumerate() {
        let g8 = unit.group(ParamGroup::Fp8);
        let gp = unit.group(ParamGroup::Plain);
        let codes = reshard(
            &files,
            &unit_key(u, "fp8"),
            QType::E4M3,
            g8.shard_len(n),
            g8.len,
            rank,
            g8.shard_len(ws),
        )?;
        let plain = reshard(
            &files,
            &unit_key(u, "plain"),
            QType::F32,
            gp.shard_len(n),
            gp.len,
            rank,
            gp.shard_len(ws),
        )?;
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
            sh.bytes = reshard(
                &files,
                &key,
                sh.qtype,
                g.shard_len(n),
                g.len,
                rank,
                g.shard_len(ws),
            )?;
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
        model.gather(u)?;
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
    if rank == 0 {
        file.write_atomic(path)?;
    }
    model.comm().barrier()?;
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
                let inv = f.tensor(&inv_key)?.to_f32(&inv_key)?;
                let inv = *inv
                    .first()
                    .ok_or_else(|| ShardError::Checkpoint(format!("{inv_key} is empty")))?;
                let fmt = t
                    .qtype
                    .fp8_format()
                    .ok_or(fp8_core::Fp8Error::NotFp8(t.qtype))?;
                let mut v = vec![0f32; t.bytes.len()];
                fmt.decode_scaled(&t.bytes, inv, &mut v)?;
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
