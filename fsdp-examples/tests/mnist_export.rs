//! Full export and import by name: a trained MNIST model's master weights are written as one safetensors
//! file named as PyTorch names the reference net's parameters, read back into a sharded model at another
//! world size, and written again bit for bit; the FP8 weights the run used are the masters quantized.

use fp8_core::Fp8Recipe;
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_examples::data::committed_subset_dir;
use fsdp_examples::mnist::{wrap_policy, MnistError, MnistNet, MnistOptions, MnistTask, NetConfig};
use fsdp_nn::{convert_to_fp8, Fp8Filter};
use fsdp_optim::{export_full, AdamOptions, ExportDtype, FsdpAdam, StatePrecision};
use fsdp_shard::{FsdpConfig, FsdpModel};
use fsdp_train::{DeviceChoice, RunLength, TrainConfig, Trainer};
use safetensors::SafeTensors;
use std::sync::Arc;

fn tensors(bytes: &[u8]) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    v.sort();
    v
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn export_has_pytorch_names_and_round_trips_at_another_world_size() {
    let dir = std::env::temp_dir().join(format!("mnist-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let first = dir.join("trained.safetensors");
    let task = MnistTask::new(MnistOptions {
        batch_size: 8,
        test_batch_size: 500,
        data_dir: committed_subset_dir(),
        limit_batches: Some(4),
        ..MnistOptions::default()
    })
    .unwrap();
    let mut config = TrainConfig::new(RunLength::Epochs(1));
    config.world_size = 2;
    config.device = DeviceChoice::Cpu;
    config.threads_per_rank = Some(1);
    config.optimizer_states = StatePrecision::F32;
    config.export = Some(first.clone());
    config.collect_params = true;
    let report = Trainer::new(config).run(&task).unwrap();
    let bytes = std::fs::read(&first).unwrap();
    let exported = tensors(&bytes);
    let names: Vec<&str> = exported.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "conv1.bias",
            "conv1.weight",
            "conv2.bias",
            "conv2.weight",
            "fc1.bias",
            "fc1.weight",
            "fc2.bias",
            "fc2.weight"
        ]
    );
    let shape = |n: &str| exported.iter().find(|t| t.0 == n).unwrap().1.clone();
    assert_eq!(shape("conv1.weight"), [32, 1, 3, 3]);
    assert_eq!(shape("fc1.weight"), [128, 9216]);
    // Plain parameters are the shards exactly; FP8 weights are the masters, of which the run's E4M3
    // weights are the quantization (relative error at most 2^-4 for normal values).
    for (name, values) in &report.params {
        let master = f32s(&exported.iter().find(|t| &t.0 == name).unwrap().2);
        assert_eq!(master.len(), values.len(), "{name}");
        let fp8 = name.starts_with("fc") && name.ends_with("weight");
        let amax = master.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (m, q) in master.iter().zip(values) {
            if fp8 {
                assert!(
                    (m - q).abs() <= m.abs() / 16.0 + amax * 2f32.powi(-15),
                    "{name}: master {m} vs E4M3 {q}"
                );
            } else {
                assert_eq!(m.to_bits(), q.to_bits(), "{name}");
            }
        }
    }
    // Into one rank, then out again: the same bytes.
    let second = dir.join("again.safetensors");
    let (src, dst) = (first.clone(), second.clone());
    run_ranks(1, move |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut net = MnistNet::new(NetConfig { seed: 99, rank: 0 })?;
        convert_to_fp8(&mut net, &Fp8Filter::All, &Fp8Recipe::default())?;
        let mut model = FsdpModel::new(net, comm, wrap_policy(), FsdpConfig::default())?;
        let loaded = model.import_full(&src, true)?;
        assert_eq!(loaded.len(), 8);
        let options = AdamOptions {
            state_precision: StatePrecision::F32,
            ..AdamOptions::adam()
        };
        let opt = FsdpAdam::for_model(&mut model, options)?;
        export_full(&mut model, &opt, &dst, ExportDtype::F32)?;
        Ok::<_, MnistError>(())
    })
    .unwrap();
    let again = tensors(&std::fs::read(&second).unwrap());
    assert_eq!(
        again, exported,
        "export -> import -> export changed the weights"
    );
    // A file that lacks a parameter, or has one too many in strict mode, is refused naming it.
    let e = run_ranks(1, move |comm: ThreadComm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut net = MnistNet::new(NetConfig { seed: 1, rank: 0 })?;
        convert_to_fp8(&mut net, &Fp8Filter::All, &Fp8Recipe::default())?;
        let mut model = FsdpModel::new(net, comm, wrap_policy(), FsdpConfig::default())?;
        let opt = FsdpAdam::for_model(&mut model, AdamOptions::adam())?;
        drop(opt);
        Ok::<_, MnistError>(model.import_full(&first, true).map(|_| ()))
    })
    .unwrap();
    assert!(e[0].is_err(), "import after the optimizer took the masters");
    let _ = std::fs::remove_dir_all(&dir);
}
