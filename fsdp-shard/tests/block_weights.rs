//! Block-scaled FP8 weights under sharding (thread ranks): shards end on 128-row block rows, every rank
//! quantizes its own rows, and the all-gathered codes and scales equal a local quantization of the full
//! weight bit for bit; gradients reduce into the uneven shards; checkpoints reshard N -> M.

use fp8_kernels::rng::SplitMix64;
mod common;

use common::Sgd;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::checkpoint::{load_sharded, read_full, save_full, save_sharded, FullWeights};
use fsdp_shard::{
    quantize_block_rows, FsdpConfig, GradDtype, GradReduction, ModelLayout, ParamGroup, ParamKind,
    ParamSpec, ShardError, ShardedModel, WrapPolicy,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Weights of several shapes: rows not multiples of 128, columns multiples of 16 but not of 128, a
/// weight of one block row, and a plain bias between them.
fn layout(policy: WrapPolicy) -> Arc<ModelLayout> {
    let k = ParamKind::Fp8BlockWeight;
    let params = vec![
        ParamSpec::new("a", "weight", &[300, 144], k),
        ParamSpec::new("a", "bias", &[300], ParamKind::Plain),
        ParamSpec::new("b", "weight", &[256, 96], k),
        ParamSpec::new("c", "weight", &[16, 272], k),
        ParamSpec::new("d", "weight", &[520, 32], k),
    ];
    Arc::new(ModelLayout::new(params, &policy).unwrap())
}

fn init(layout: &ModelLayout, p: usize) -> Vec<f32> {
    let n = layout.params[p].numel();
    // Rows of different magnitudes so block scales differ.
    let cols = *layout.params[p].shape.last().unwrap();
    SplitMix64::new(7 + p as u64)
        .uniform_vec(n)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi(((i / cols) % 7) as i32 - 3))
        .collect()
}

fn block_names(layout: &ModelLayout) -> Vec<(usize, String, usize)> {
    layout
        .params
        .iter()
        .enumerate()
        .filter(|(_, p)| p.kind == ParamKind::Fp8BlockWeight)
        .map(|(i, p)| (i, p.name.clone(), p.shape[1]))
        .collect()
}

/// Every rank's gathered block weights, as (codes, inverse scales) by parameter name.
type Gathered = BTreeMap<String, (Vec<u8>, Vec<f32>)>;

fn gather_all(model: &mut ShardedModel) -> Result<Gathered, ShardError> {
    let layout = model.layout().clone();
    let mut out = BTreeMap::new();
    for u in 0..model.num_units() {
        model.gather(u)?;
    }
    for (_, name, _) in block_names(&layout) {
        let (c, s) = model.fp8_block_weight(&name)?;
        out.insert(name, (c.to_vec()?, s.to_vec()?));
    }
    Ok(out)
}

fn expected(layout: &ModelLayout, values: &dyn Fn(usize) -> Vec<f32>) -> Gathered {
    block_names(layout)
        .into_iter()
        .map(|(p, name, cols)| (name, quantize_block_rows(&values(p), cols).unwrap()))
        .collect()
}

#[test]
fn gathered_block_weights_equal_a_local_quantization_at_every_world_size() {
    for policy in [WrapPolicy::Single, WrapPolicy::PerModule] {
        let layout = layout(policy.clone());
        let want = expected(&layout, &|p| init(&layout, p));
        for ws in 1..=5 {
            let l = layout.clone();
            let got = run_ranks(ws, |comm: ThreadComm| {
                let comm: Arc<dyn Communicator> = Arc::new(comm);
                let rank = comm.rank();
                let (mut model, masters) =
                    ShardedModel::new(l.clone(), comm, FsdpConfig::default(), &|p| init(&l, p))?;
                // The masters are the real rows of each rank's shard, padding zero.
                for (u, m) in masters.iter().enumerate() {
                    let g = l.units[u].group(ParamGroup::Fp8);
                    assert_eq!(m.len(), g.shard_len(ws));
                    let real = g.shard_range(rank, ws).len();
                    assert!(m[real..].iter().all(|&v| v == 0.0));
                }
                gather_all(&mut model)
            })
            .unwrap();
            for (r, g) in got.iter().enumerate() {
                assert_eq!(g, &want, "{policy:?}, world size {ws}, rank {r}");
            }
        }
    }
}

#[test]
fn set_param_full_quantizes_the_ranks_rows_without_agreement() {
    let layout = layout(WrapPolicy::Single);
    let new_values = |p: usize| -> Vec<f32> {
        init(&layout, p)
            .into_iter()
            .map(|v| v * -5.0 + 0.25)
            .collect()
    };
    let want = expected(&layout, &new_values);
    for ws in [1, 2, 3, 4] {
        let l = layout.clone();
        let got = run_ranks(ws, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let (mut model, mut masters) =
                ShardedModel::new(l.clone(), comm, FsdpConfig::default(), &|p| init(&l, p))?;
            for (p, _, _) in block_names(&l) {
                model.set_param_full(p, &new_values(p), &mut masters)?;
            }
            gather_all(&mut model)
        })
        .unwrap();
        for g in &got {
            assert_eq!(g, &want, "world size {ws}");
        }
    }
}

/// Gradient values that every reduction mode sums exactly: integers in [-2, 2] (four ranks at most
/// sum to within [-8, 8], exact in BF16 and, with power-of-two tile scales, in E4M3).
fn grad(layout: &ModelLayout, p: usize, rank: usize) -> Vec<f32> {
    let n = layout.params[p].numel();
    (0..n)
        .map(|i| (((i * 7 + p * 3 + rank * 5) % 5) as f32) - 2.0)
        .collect()
}

#[test]
fn gradients_reduce_into_the_uneven_shards_in_every_mode() {
    let layout = layout(WrapPolicy::Single);
    let modes = [
        (GradReduction::F32, GradDtype::F32),
        (GradReduction::Bf16, GradDtype::Bf16),
        (GradReduction::FP8_BLOCK, GradDtype::F32),
        (
            GradReduction::Fp8(fp8_core::Fp8Format::E4M3),
            GradDtype::F32,
        ),
    ];
    for (mode, dtype) in modes {
        for ws in [1, 2, 3, 4] {
            let l = layout.clone();
            let shards = run_ranks(ws, |comm: ThreadComm| {
                let comm: Arc<dyn Communicator> = Arc::new(comm);
                let rank = comm.rank();
                let config = FsdpConfig {
                    grad_reduction: mode,
                    grad_dtype: dtype,
                    ..FsdpConfig::default()
                };
                let (mut model, _) = ShardedModel::new(l.clone(), comm, config, &|p| init(&l, p))?;
                for p in 0..l.params.len() {
                    let g = fp8_kernels::Buffer::from_vec(grad(&l, p, rank));
                    model.add_grad_at(p, &g)?;
                }
                model.reduce_grads(0)?;
                model.unit(0)?.grad(ParamGroup::Fp8).to_f32_vec()
            })
            .unwrap();
            let g8 = layout.units[0].group(ParamGroup::Fp8);
            let mut full = vec![0f32; g8.len];
            for slot in &g8.slots {
                for r in 0..ws {
                    for (i, v) in grad(&layout, slot.param, r).into_iter().enumerate() {
                        full[slot.offset + i] += v;
                    }
                }
            }
            for (r, shard) in shards.iter().enumerate() {
                let range = g8.shard_range(r, ws);
                assert_eq!(shard.len(), g8.shard_len(ws));
                assert_eq!(
                    &shard[..range.len()],
                    &full[range.clone()],
                    "{mode:?}, world size {ws}, rank {r}"
                );
                assert!(shard[range.len()..].iter().all(|&v| v == 0.0));
            }
        }
    }
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-block-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn block_scaled_checkpoints_reshard_and_export() {
    let layout = layout(WrapPolicy::PerModule);
    let changed =
        |p: usize| -> Vec<f32> { init(&layout, p).into_iter().map(|v| v * 3.0).collect() };
    let want = expected(&layout, &changed);
    for (saved_ws, loaded_ws) in [(3, 2), (2, 4), (4, 1), (1, 3)] {
        let dir = temp_dir(&format!("{saved_ws}-{loaded_ws}"));
        let l = layout.clone();
        // Save after changing every weight (so loading cannot succeed by re-initialising).
        let masters_full = run_ranks(saved_ws, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let (mut model, mut masters) =
                ShardedModel::new(l.clone(), comm, FsdpConfig::default(), &|p| init(&l, p))?;
            for (p, _, _) in block_names(&l) {
                model.set_param_full(p, &changed(p), &mut masters)?;
            }
            save_sharded(
                &dir,
                &model,
                Some(&Sgd {
                    lr: 0.0,
                    masters: masters.clone(),
                }),
                &BTreeMap::new(),
            )?;
            Ok::<_, ShardError>(masters)
        })
        .unwrap();
        let loaded = run_ranks(loaded_ws, |comm: ThreadComm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let rank = comm.rank();
            let other = |p: usize| init(&l, p).into_iter().map(|v| -v).collect();
            let (mut model, masters) =
                ShardedModel::new(l.clone(), comm, FsdpConfig::default(), &other)?;
            let mut state = Sgd { lr: 0.0, masters };
            load_sharded(&dir, &mut model, Some(&mut state))?;
            // The loaded master rows are the saved ones, cut at the new block rows.
            for (u, m) in state.masters.iter().enumerate() {
                let g = l.units[u].group(ParamGroup::Fp8);
                let mut saved = Vec::new();
                for (r, sm) in masters_full.iter().enumerate() {
                    saved.extend_from_slice(&sm[u][..g.shard_range(r, saved_ws).len()]);
                }
                let range = g.shard_range(rank, loaded_ws);
                assert_eq!(&m[..range.len()], &saved[range]);
            }
            gather_all(&mut model)
        })
        .unwrap();
        for g in &loaded {
            assert_eq!(g, &want, "saved at {saved_ws}, loaded at {loaded_ws}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // A full checkpoint holds the codes with their block grid, and reads back dequantized.
    let path = temp_dir("full").with_extension("safetensors");
    let l = layout.clone();
    run_ranks(2, |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (mut model, _) =
            ShardedModel::new(l.clone(), comm, FsdpConfig::default(), &|p| init(&l, p))?;
        save_full(
            &path,
            &mut model,
            FullWeights::Fp8WithScaleInv,
            &BTreeMap::new(),
        )
    })
    .unwrap();
    let full = read_full(&path).unwrap();
    for (p, name, cols) in block_names(&layout) {
        let (codes, scale_inv) = quantize_block_rows(&init(&layout, p), cols).unwrap();
        let want = fsdp_shard::decode_block_rows(&codes, &scale_inv, cols).unwrap();
        assert_eq!(full[&name].1, want, "{name}");
        assert_eq!(full[&name].0, layout.params[p].shape);
    }
    let _ = std::fs::remove_file(&path);
}
