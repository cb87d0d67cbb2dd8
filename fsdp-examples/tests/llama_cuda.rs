//! GPU check of the Llama model (ignored without a GPU; `scripts/gpu-tests.sh` runs it): a small Llama's
//! forward and backward on CUDA (world size 1, NCCL) against the same model on the CPU, in the training
//! configuration (BF16 activations, FP8 linears, fused RMSNorm and SwiGLU casts, grouped-query flash
//! attention on RoPE-rotated inputs) and with BF16 and F32 linears; tied and untied heads, head dims 32,
//! 64 and 128, Llama 3.1's RoPE frequency scaling, plain parameters gathered in BF16
//! (`FsdpConfig::plain_gather_dtype`, on both devices); and two CUDA steps give the same bits.
//!
//! The tolerances are the GPT check's (`gpt_cuda.rs` explains them): relative L2 error of every gradient
//! against the CPU's at most 5e-2 (BF16 activations) or 2e-2 (F32), or twice the FP8 quantization's own
//! effect on that gradient when the linears are FP8; the mean loss within 1e-2 (BF16) or 2e-3 (F32). A
//! wrong kernel (a query head reading the wrong key/value head, an unrotated or misrotated key, a
//! swapped gate and up) gives errors of order 1.

mod gpt_common;

use fp8_core::Fp8Recipe;
use fp8_kernels::rope::Llama3RopeScaling;
use fsdp_comm::{Communicator, NcclComm, NcclConfig, ThreadGroup};
use fsdp_examples::llama::{wrap_policy, Llama, LlamaConfig};
use fsdp_nn::{convert_to_fp8, Activation, Fp8Filter};
use fsdp_shard::{FsdpConfig, FsdpModel, GatherDtype, Mode};
use gpt_common::{grad, ids};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;

const VOCAB: usize = 4096;
const SEQ: usize = 64;
const BATCH: usize = 4;

/// d 128 (256 at head dim 128), `heads` query heads over `kv` key/value heads, SwiGLU of 3d, 2 layers.
fn config(d: usize, heads: usize, kv: usize, tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab: VOCAB,
        head_chunk: 100,
        tie_embeddings: tied,
        ..LlamaConfig::new(d, 2, heads, kv, 3 * d, SEQ)
    }
}

fn wrap<T: Activation>(
    config: LlamaConfig,
    fp8: &Fp8Filter,
    plain_gather: GatherDtype,
    comm: Arc<dyn Communicator>,
) -> Result<FsdpModel<Llama<T>>, String> {
    let mut llama = Llama::<T>::new(config).map_err(|e| e.to_string())?;
    convert_to_fp8(&mut llama, fp8, &Fp8Recipe::default()).map_err(|e| e.to_string())?;
    let fsdp = FsdpConfig {
        plain_gather_dtype: plain_gather,
        ..FsdpConfig::default()
    };
    FsdpModel::new(llama, comm, wrap_policy(), fsdp).map_err(|e| e.to_string())
}

fn cpu_model<T: Activation>(
    config: LlamaConfig,
    fp8: &Fp8Filter,
    plain_gather: GatherDtype,
) -> FsdpModel<Llama<T>> {
    let comm: Arc<dyn Communicator> = Arc::new(
        ThreadGroup::new(1, Duration::from_secs(300))
            .unwrap()
            .pop()
            .unwrap(),
    );
    wrap(config, fp8, plain_gather, comm).unwrap()
}

fn cuda_model<T: Activation>(
    config: LlamaConfig,
    fp8: &Fp8Filter,
    plain_gather: GatherDtype,
) -> Result<FsdpModel<Llama<T>>, String> {
    let comm = NcclComm::from_env(&NcclConfig::default()).map_err(|e| e.to_string())?;
    wrap(config, fp8, plain_gather, Arc::new(comm))
}

/// Loss and every gradient (by name) after one training step of a fixed batch.
fn step<T: Activation>(model: &mut FsdpModel<Llama<T>>) -> (f64, Vec<(String, Vec<f32>)>) {
    let dev = model.device().clone();
    let inputs = ids(BATCH * SEQ, VOCAB, 1);
    let targets = ids(BATCH * SEQ, VOCAB, 2);
    let b = model
        .module()
        .batch(&dev, &inputs, &targets, BATCH, SEQ)
        .unwrap();
    model
        .forward(Mode::Train, |m, ctx| m.forward(ctx, &b))
        .unwrap();
    let loss = model.module().loss().unwrap().mean().unwrap();
    model.backward(|m, ctx| m.backward(ctx, &b)).unwrap();
    let grads = model
        .param_names()
        .unwrap()
        .into_iter()
        .map(|(name, id)| {
            let g = grad(model, id);
            (name, g)
        })
        .collect();
    model.sharded_mut().zero_grads().unwrap();
    (loss, grads)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn compare<T: Activation>(
    what: &str,
    config: LlamaConfig,
    filter: Fp8Filter,
    grad_tol: f64,
    loss_tol: f64,
) {
    compare_gathered::<T>(what, config, filter, GatherDtype::F32, grad_tol, loss_tol)
}

/// [`compare`] with the plain parameters gathered in `plain_gather` on both devices.
fn compare_gathered<T: Activation>(
    what: &str,
    config: LlamaConfig,
    filter: Fp8Filter,
    plain_gather: GatherDtype,
    grad_tol: f64,
    loss_tol: f64,
) {
    let mut gpu =
        cuda_model::<T>(config.clone(), &filter, plain_gather).expect("a CUDA GPU with NCCL");
    let fp8 = !matches!(filter, Fp8Filter::None);
    let mut cpu = cpu_model::<T>(config.clone(), &filter, plain_gather);
    let (loss_c, grads_c) = step(&mut cpu);
    let (loss_g, grads_g) = step(&mut gpu);
    assert_eq!(grads_c.len(), grads_g.len(), "{what}: parameter lists");
    // The FP8 quantization's own effect per gradient: the same model with BF16 linears on the CPU.
    let noise: Vec<f64> = if fp8 {
        let mut plain = cpu_model::<T>(config, &Fp8Filter::None, plain_gather);
        let (_, grads_p) = step(&mut plain);
        grads_c
            .iter()
            .zip(&grads_p)
            .map(|((_, c), (_, p))| rel_l2(c, p))
            .collect()
    } else {
        vec![0.0; grads_c.len()]
    };
    println!("{what}: loss CPU {loss_c:.6}, CUDA {loss_g:.6}");
    let mut worst = 0f64;
    for (((name, c), (name_g, g)), q) in grads_c.iter().zip(&grads_g).zip(&noise) {
        assert_eq!(name, name_g, "{what}: parameter order");
        let e = rel_l2(g, c);
        let bound = grad_tol.max(2.0 * q);
        worst = worst.max(e / bound);
        println!(
            "{what}: {name:44} relative L2 error {e:.3e} (FP8 noise {q:.3e}, bound {bound:.3e})"
        );
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{what}: {name} not finite on CUDA"
        );
        assert!(
            c.iter().any(|v| *v != 0.0),
            "{what}: {name} has a zero gradient on the CPU (the check would be empty)"
        );
    }
    assert!(
        (loss_c - loss_g).abs() <= loss_tol,
        "{what}: loss {loss_c} vs {loss_g}"
    );
    assert!(
        worst <= 1.0,
        "{what}: worst gradient error / bound {worst:.3} > 1"
    );
    // A second CUDA step on the same weights gives the same bits (deterministic kernels).
    let (loss_2, grads_2) = step(&mut gpu);
    assert_eq!(
        loss_2.to_bits(),
        loss_g.to_bits(),
        "{what}: CUDA loss repeats"
    );
    for ((name, a), (_, b)) in grads_g.iter().zip(&grads_2) {
        assert_eq!(a, b, "{what}: {name} repeats on CUDA");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn llama_cuda_matches_cpu() {
    let fp8 = Fp8Filter::All;
    compare::<bf16>(
        "bf16 + FP8, hd 32, GQA 4/2, tied",
        config(128, 4, 2, true),
        fp8.clone(),
        5e-2,
        1e-2,
    );
    compare::<bf16>(
        "bf16 + FP8, hd 64, GQA 2/1, untied, layer 0's MLP up output recomputed",
        LlamaConfig {
            recompute_mlp_up: 1,
            ..config(128, 2, 1, false)
        },
        fp8.clone(),
        5e-2,
        1e-2,
    );
    compare::<bf16>(
        "bf16 + FP8, hd 128, GQA 2/1, Llama 3.1 RoPE",
        LlamaConfig {
            rope_scaling: Some(Llama3RopeScaling {
                original_max_position_embeddings: 32,
                ..Llama3RopeScaling::llama3_1()
            }),
            ..config(256, 2, 1, true)
        },
        fp8,
        5e-2,
        1e-2,
    );
    // Norm weights, embeddings and the tied head gathered in BF16: the CUDA layers read (or cast) the
    // BF16 copies as the CPU's do.
    compare_gathered::<bf16>(
        "bf16 + FP8, hd 64, GQA 4/2, tied, plain parameters gathered in BF16",
        config(256, 4, 2, true),
        Fp8Filter::All,
        GatherDtype::Bf16,
        5e-2,
        1e-2,
    );
    compare::<bf16>(
        "bf16, BF16 linears, hd 32, MHA",
        config(128, 4, 4, true),
        Fp8Filter::None,
        5e-2,
        1e-2,
    );
    compare::<f32>(
        "f32, F32 linears, hd 32, GQA 4/2, untied",
        config(128, 4, 2, false),
        Fp8Filter::None,
        2e-2,
        2e-3,
    );
}
