//! A two-layer MLP trained with plain SGD on thread ranks, written with host loops: the test bench for
//! sharding, reduction, accumulation and checkpoints (the kernels are tested in fp8-kernels).
#![allow(dead_code)]

use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::{
    FsdpConfig, ModelLayout, ParamGroup, ParamKind, ParamSpec, ShardError, ShardedModel,
    ShardedState, StateShard, WrapPolicy,
};
use std::sync::Arc;

pub const IN: usize = 12;
pub const HID: usize = 40;
pub const OUT: usize = 4;

pub fn layout(fp8: bool, policy: WrapPolicy) -> Arc<ModelLayout> {
    let k = if fp8 {
        ParamKind::Fp8Weight
    } else {
        ParamKind::Plain
    };
    let params = vec![
        ParamSpec::new("l1", "weight", &[HID, IN], k),
        ParamSpec::new("l1", "bias", &[HID], ParamKind::Plain),
        ParamSpec::new("l2", "weight", &[OUT, HID], k),
        ParamSpec::new("l2", "bias", &[OUT], ParamKind::Plain),
    ];
    Arc::new(ModelLayout::new(params, &policy).unwrap())
}

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    SplitMix64::new(seed).uniform_vec(n)
}

pub fn init(param: usize) -> Vec<f32> {
    let n = [HID * IN, HID, OUT * HID, OUT][param];
    let scale = [0.3, 0.1, 0.2, 0.1][param];
    values(100 + param as u64, n)
        .into_iter()
        .map(|v| v * scale)
        .collect()
}

/// The global batch of a step: inputs [batch, IN] and targets [batch, OUT].
pub fn batch(step: u64, size: usize) -> (Vec<f32>, Vec<f32>) {
    (
        values(1000 + step, size * IN),
        values(5000 + step, size * OUT),
    )
}

/// SGD with an F32 master copy of the FP8 weights: the state a real optimizer keeps.
pub struct Sgd {
    pub lr: f32,
    pub masters: Vec<Vec<f32>>,
}

pub fn master_buffers(masters: &[Vec<f32>]) -> Vec<fp8_kernels::Buffer<f32>> {
    masters
        .iter()
        .map(|m| fp8_kernels::Buffer::from_vec(m.clone()))
        .collect()
}

impl ShardedState for Sgd {
    fn export_state(&self) -> Result<Vec<StateShard>, ShardError> {
        Ok(self
            .masters
            .iter()
            .enumerate()
            .map(|(u, m)| StateShard {
                name: "master".into(),
                unit: u,
                group: ParamGroup::Fp8,
                qtype: fp8_core::QType::F32,
                bytes: m.iter().flat_map(|x| x.to_le_bytes()).collect(),
                slot_scales: vec![],
            })
            .collect())
    }
    fn import_state(&mut self, shards: Vec<StateShard>) -> Result<(), ShardError> {
        for s in shards {
            self.masters[s.unit] = s
                .bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
        }
        Ok(())
    }
    fn state_bytes(&self) -> usize {
        self.masters.iter().map(|m| m.len() * 4).sum()
    }
    fn scalar_state(&self) -> Vec<(String, String)> {
        vec![("lr".into(), self.lr.to_string())]
    }
}

impl Sgd {
    pub fn step(&mut self, model: &mut ShardedModel) -> Result<(), ShardError> {
        for u in 0..model.num_units() {
            let s = model.unit_mut(u)?;
            let g = s.grad(ParamGroup::Plain).to_f32_vec()?;
            let mut p = s.plain.to_vec()?;
            for (p, g) in p.iter_mut().zip(&g) {
                *p -= self.lr * g;
            }
            s.plain.copy_from_host(&p)?;
            let g = s.grad(ParamGroup::Fp8).to_f32_vec()?;
            for (m, g) in self.masters[u].iter_mut().zip(&g) {
                *m -= self.lr * g;
            }
        }
        let bufs = master_buffers(&self.masters);
        let refs: Vec<&fp8_kernels::Buffer<f32>> = bufs.iter().collect();
        requantize(model, &refs)?;
        model.zero_grads()
    }
}

/// A parameter of a gathered unit as F32 values (FP8 weights dequantized).
pub fn param_f32(model: &ShardedModel, name: &str) -> Vec<f32> {
    model
        .param(model.index(name).unwrap())
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

fn matmul_t(x: &[f32], w: &[f32], b: &[f32], rows: usize, inn: usize, out: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            let mut acc = b[o];
            for i in 0..inn {
                acc += x[r * inn + i] * w[o * inn + i];
            }
            y[r * out + o] = acc;
        }
    }
    y
}

/// Forward and backward of this rank's part of the batch (rows `rows`), loss = sum of squares / global
/// batch; gradients are handed to the model. Returns the local loss contribution.
pub fn forward_backward(
    model: &mut ShardedModel,
    x: &[f32],
    t: &[f32],
    global_batch: usize,
) -> Result<f32, ShardError> {
    let rows = x.len() / IN;
    model.gather(0)?;
    let w1 = param_f32(model, "l1.weight");
    let b1 = param_f32(model, "l1.bias");
    let units = model.num_units();
    let l2_unit = units - 1;
    model.gather(l2_unit)?;
    let w2 = param_f32(model, "l2.weight");
    let b2 = param_f32(model, "l2.bias");
    let pre = matmul_t(x, &w1, &b1, rows, IN, HID);
    let h: Vec<f32> = pre.iter().map(|v| v.max(0.0)).collect();
    let y = matmul_t(&h, &w2, &b2, rows, HID, OUT);
    let mut loss = 0f32;
    let mut dy = vec![0f32; rows * OUT];
    for i in 0..dy.len() {
        let d = y[i] - t[i];
        loss += d * d / global_batch as f32;
        dy[i] = 2.0 * d / global_batch as f32;
    }
    let mut dw2 = vec![0f32; OUT * HID];
    let mut db2 = vec![0f32; OUT];
    let mut dh = vec![0f32; rows * HID];
    for r in 0..rows {
        for o in 0..OUT {
            let g = dy[r * OUT + o];
            db2[o] += g;
            for k in 0..HID {
                dw2[o * HID + k] += g * h[r * HID + k];
                dh[r * HID + k] += g * w2[o * HID + k];
            }
        }
    }
    let mut dw1 = vec![0f32; HID * IN];
    let mut db1 = vec![0f32; HID];
    for r in 0..rows {
        for k in 0..HID {
            let g = if pre[r * HID + k] > 0.0 {
                dh[r * HID + k]
            } else {
                0.0
            };
            db1[k] += g;
            for i in 0..IN {
                dw1[k * IN + i] += g * x[r * IN + i];
            }
        }
    }
    let dev = model.device().clone();
    for (name, g) in [
        ("l2.weight", dw2),
        ("l2.bias", db2),
        ("l1.weight", dw1),
        ("l1.bias", db1),
    ] {
        model.add_grad(name, &dev.upload(&g)?)?;
    }
    for u in (0..units).rev() {
        model.reduce_grads(u)?;
        model.release(u)?;
    }
    Ok(loss)
}

/// [`forward_backward`] on rows `rows` of the batch `(x, t)` (e.g. a rank's [`local_rows`]).
pub fn forward_backward_rows(
    model: &mut ShardedModel,
    (x, t): (&[f32], &[f32]),
    rows: std::ops::Range<usize>,
    global_batch: usize,
) -> Result<f32, ShardError> {
    forward_backward(
        model,
        &x[rows.start * IN..rows.end * IN],
        &t[rows.start * OUT..rows.end * OUT],
        global_batch,
    )
}

/// This rank's rows of a global batch of `global` rows: contiguous blocks.
pub fn local_rows(rank: usize, ws: usize, global: usize) -> std::ops::Range<usize> {
    let per = global / ws;
    rank * per..(rank + 1) * per
}

/// Every parameter gathered as F32, and the weight scales `(param, scale, scale_inv)`.
pub type Snapshot = (Vec<Vec<f32>>, Vec<(usize, f32, f32)>);

/// Trains `steps` SGD steps on `ws` thread ranks with `micro` micro-batches per step and returns, per
/// rank, every parameter gathered as F32 plus the weight scales.
pub fn train(
    ws: usize,
    fp8: bool,
    config: FsdpConfig,
    steps: u64,
    global_batch: usize,
    micro: usize,
) -> Vec<Snapshot> {
    let layout = layout(fp8, WrapPolicy::PerModule);
    run_ranks(ws, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (rank, ws) = (comm.rank(), comm.world_size());
        let (mut model, masters) = ShardedModel::new(layout.clone(), comm, config.clone(), &init)?;
        let mut sgd = Sgd { lr: 0.1, masters };
        for step in 0..steps {
            let (x, t) = batch(step, global_batch);
            let rows = local_rows(rank, ws, global_batch);
            let per_micro = rows.len() / micro;
            for mb in 0..micro {
                let r = rows.start + mb * per_micro..rows.start + (mb + 1) * per_micro;
                forward_backward_rows(&mut model, (&x, &t), r, global_batch)?;
            }
            sgd.step(&mut model)?;
        }
        snapshot(&mut model)
    })
    .unwrap()
}

pub fn snapshot(model: &mut ShardedModel) -> Result<Snapshot, ShardError> {
    let mut params = Vec::new();
    for u in 0..model.num_units() {
        model.gather(u)?;
    }
    for name in ["l1.weight", "l1.bias", "l2.weight", "l2.bias"] {
        params.push(param_f32(model, name));
    }
    for u in 0..model.num_units() {
        model.release(u)?;
    }
    Ok((params, model.weight_scales()?))
}

/// ||a - b|| / ||b|| over all parameters.
pub fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            num += ((p - q) as f64).powi(2);
            den += (*q as f64).powi(2);
        }
    }
    (num / den).sqrt()
}

/// Re-quantizes every FP8 weight shard from F32 master shards with current scaling, as an optimizer
/// does after its update (test support: the library's one re-quantization path is the optimizer's):
/// local amaxes per weight, one all-reduce(MAX), agreed scales, cast.
pub fn requantize(
    model: &mut ShardedModel,
    masters: &[&fp8_kernels::Buffer<f32>],
) -> Result<(), ShardError> {
    use fp8_kernels::segmented::{segmented_amax, segmented_cast, Segment, SegmentTable};
    let dev = model.device().clone();
    let counts = model.fp8_counts();
    let mut amaxes = dev.zeros::<f32>(counts.iter().sum())?;
    let mut tables = Vec::new();
    let mut base = 0;
    for (u, m) in masters.iter().enumerate() {
        let segments: Vec<Segment> = model
            .fp8_segments(u)?
            .into_iter()
            .map(|(slot, r)| Segment {
                start: r.start,
                end: r.end,
                slot,
            })
            .collect();
        let table = SegmentTable::new(&dev, &segments)?;
        segmented_amax(m, &table, &mut amaxes, base)?;
        base += counts[u];
        tables.push(table);
    }
    if !amaxes.is_empty() {
        model
            .comm()
            .all_reduce_in_place((&mut amaxes).into(), fsdp_comm::ReduceOp::Max)?;
    }
    model.set_fp8_weight_scales(&amaxes)?;
    for (u, (m, table)) in masters.iter().zip(&tables).enumerate() {
        let s = model.unit_mut(u)?;
        segmented_cast(m, table, Fp8Format::E4M3, &s.weight_scales, &mut s.fp8)?;
    }
    Ok(())
}
