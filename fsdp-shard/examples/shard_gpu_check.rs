//! `shard_gpu_check`: the FSDP step on CUDA (NCCL backend) against the same step on CPU thread ranks, and
//! an event trace of the prefetched gather overlapping compute. Run one process per GPU:
//! `fsdp-run --nproc 1 -- shard_gpu_check` (or plainly `shard_gpu_check` for one rank on GPU 0).
//!
//! The step: gather every unit, gradients = 0.01 * dequantized gathered weight + per-rank noise (so a
//! wrong gather shows), reduce-scatter (F32, BF16, FP8 E4M3, FP8 E5M2) or the block-scaled FP8 exchange
//! (E4M3, E5M2), SGD on F32 masters, FP8 weight re-quantization (segmented amax, one all-reduce MAX,
//! segmented cast). Prints PASS/FAIL per mode;
//! exits non-zero on any FAIL, and also without a GPU (saying why: nothing was checked).

use fp8_core::Fp8Format;
use fp8_kernels::elementwise::axpy;
use fp8_kernels::gemm::{gemm_bf16, GemmSpec};
use fp8_kernels::{dequantize_fp8, Buffer, Device};
use fsdp_comm::{run_ranks, Communicator, NcclComm, NcclConfig};
use fsdp_shard::{
    FsdpConfig, GatheredParam, GradDtype, GradReduction, ModelLayout, ParamGroup, ParamKind,
    ParamSpec, ShardError, ShardedModel, WrapPolicy,
};
use half::bf16;
use std::process::ExitCode;
use std::sync::Arc;

// The CPU test bench's helpers (its model constants are not this check's).
#[path = "../tests/common/mod.rs"]
mod common;
use common::{requantize, values};

const UNITS: usize = 3;
const OUT: usize = 256;
const IN: usize = 528; // not a multiple of the world size times 16: shards cut weights

fn layout() -> Result<Arc<ModelLayout>, ShardError> {
    let mut p = Vec::new();
    for u in 0..UNITS {
        let m = format!("l{u}");
        p.push(ParamSpec::new(
            &m,
            "weight",
            &[OUT, IN],
            ParamKind::Fp8Weight,
        ));
        p.push(ParamSpec::new(&m, "bias", &[OUT], ParamKind::Plain));
    }
    Ok(Arc::new(ModelLayout::new(p, &WrapPolicy::PerModule)?))
}

/// Everything a step leaves on this rank, read back to the host.
#[derive(Debug, PartialEq)]
struct StepResult {
    fp8: Vec<Vec<u8>>,
    scales: Vec<Vec<f32>>,
    plain: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    nonfinite: u64,
}

fn step(
    comm: Arc<dyn Communicator>,
    mode: GradReduction,
    grad_dtype: GradDtype,
) -> Result<StepResult, ShardError> {
    let dev = comm.device().clone();
    let rank = comm.rank() as u64;
    let cfg = FsdpConfig {
        grad_reduction: mode,
        grad_dtype,
        ..FsdpConfig::default()
    };
    let init = |p: usize| {
        let n = if p % 2 == 0 { OUT * IN } else { OUT };
        values(7 + p as u64, n).iter().map(|v| v * 0.2).collect()
    };
    let (mut model, masters) = ShardedModel::new(layout()?, comm.clone(), cfg, &init)?;
    let mut masters: Vec<Buffer<f32>> = masters
        .iter()
        .map(|m| dev.upload(m))
        .collect::<Result<_, _>>()?;
    for u in 0..UNITS {
        model.gather_async(u)?;
    }
    for u in 0..UNITS {
        model.wait_gather(u)?;
        let (w, b) = (format!("l{u}.weight"), format!("l{u}.bias"));
        let (codes, scales) = match model.param(model.index(&w)?)? {
            GatheredParam::Fp8 { codes, scales } => (codes, scales),
            _ => return Err(ShardError::State("weight not per-tensor FP8".into())),
        };
        let mut si = dev.zeros::<f32>(1)?;
        si.copy_range_from(0, scales, 1, 1)?;
        let mut wd = dev.zeros::<f32>(OUT * IN)?;
        dequantize_fp8(codes, Fp8Format::E4M3, &si, &mut wd)?;
        let mut gw = dev.upload(&values(1000 * rank + u as u64, OUT * IN))?;
        axpy(0.01, &wd, &mut gw)?;
        let gb = dev.upload(&values(5000 * rank + u as u64, OUT))?;
        model.add_grad(&w, &gw)?;
        model.add_grad(&b, &gb)?;
        model.release(u)?;
        model.reduce_grads(u)?;
    }
    let mut grads = Vec::new();
    for (u, master) in masters.iter_mut().enumerate() {
        let s = model.unit_mut(u)?;
        // BF16 shards are widened exactly for the (F32) SGD update below.
        let g8 = s.grad(ParamGroup::Fp8).to_f32_vec()?;
        let gp = s.grad(ParamGroup::Plain).to_f32_vec()?;
        axpy(-0.5, &dev.upload(&g8)?, master)?;
        axpy(-0.5, &dev.upload(&gp)?, &mut s.plain)?;
        grads.push(g8);
        grads.push(gp);
    }
    let refs: Vec<&Buffer<f32>> = masters.iter().collect();
    requantize(&mut model, &refs)?;
    let mut out = StepResult {
        fp8: Vec::new(),
        scales: Vec::new(),
        plain: Vec::new(),
        grads,
        nonfinite: model.take_nonfinite_before_cast(),
    };
    for u in 0..UNITS {
        let s = model.unit(u)?;
        out.fp8.push(s.fp8.to_vec()?);
        out.scales.push(s.weight_scales.to_vec()?);
        out.plain.push(s.plain.to_vec()?);
    }
    Ok(out)
}

/// `||a - b|| / ||b||` over all f32 vectors.
fn rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            num += (f64::from(*p) - f64::from(*q)).powi(2);
            den += f64::from(*q).powi(2);
        }
    }
    (num / den.max(1e-300)).sqrt()
}

/// Prefetch trace: unit u + 1's gather is issued before unit u's compute; timing events on both streams.
fn overlap_trace(comm: &Arc<dyn Communicator>) -> Result<bool, Box<dyn std::error::Error>> {
    let Device::Cuda(cuda) = comm.device().clone() else {
        return Ok(true);
    };
    let dev = comm.device().clone();
    let n = 4;
    let (rows, cols) = (8192, 8192);
    let mut p = Vec::new();
    for u in 0..n {
        p.push(ParamSpec::new(
            &format!("u{u}"),
            "weight",
            &[rows, cols],
            ParamKind::Fp8Weight,
        ));
    }
    let layout = Arc::new(ModelLayout::new(p, &WrapPolicy::PerModule)?);
    let init = |i: usize| values(i as u64, rows * cols);
    let (mut model, _) = ShardedModel::new(layout, comm.clone(), FsdpConfig::default(), &init)?;
    let k = 4096;
    let a = dev.upload(&vec![bf16::from_f32(0.01); k * k])?;
    let mut c = dev.zeros::<f32>(k * k)?;
    let spec = GemmSpec::new(k, k, k);
    let mut run = |prefetch: bool| -> Result<(f32, Vec<String>), Box<dyn std::error::Error>> {
        dev.synchronize()?;
        let t0 = cuda.record_compute_timed()?;
        let mut lines = Vec::new();
        let mut ok = true;
        if prefetch {
            model.gather_async(0)?;
        }
        for u in 0..n {
            model.wait_gather(u)?;
            let g = if prefetch && u + 1 < n {
                let g0 = cuda.record_comm_timed()?;
                model.gather_async(u + 1)?;
                Some((g0, cuda.record_comm_timed()?))
            } else {
                None
            };
            let c0 = cuda.record_compute_timed()?;
            for _ in 0..4 {
                gemm_bf16(&spec, &a, &a, &mut c)?;
            }
            let c1 = cuda.record_compute_timed()?;
            model.release(u)?;
            if let Some((g0, g1)) = g {
                let (gs, ge) = (t0.elapsed_ms(&g0)?, t0.elapsed_ms(&g1)?);
                let (cs, ce) = (t0.elapsed_ms(&c0)?, t0.elapsed_ms(&c1)?);
                let overlaps = ge > cs && gs < ce;
                ok &= overlaps;
                lines.push(format!(
                    "  gather of unit {} on the comm stream [{gs:.3}, {ge:.3}] ms, compute of unit {u} [{cs:.3}, {ce:.3}] ms: {}",
                    u + 1,
                    if overlaps { "overlap" } else { "no overlap" }
                ));
            }
        }
        let t1 = cuda.record_compute_timed()?;
        dev.synchronize()?;
        lines.push(format!(
            "  all units: {:.3} ms ({})",
            t0.elapsed_ms(&t1)?,
            if ok { "ok" } else { "serial" }
        ));
        Ok((t0.elapsed_ms(&t1)?, lines))
    };
    run(true)?; // warm-up (module loads, NCCL connections)
    let (t_pre, lines) = run(true)?;
    let (t_seq, _) = run(false)?;
    println!("prefetch trace (4 units of {rows}x{cols} FP8, 4 BF16 GEMMs {k}^3 per unit):");
    for l in &lines {
        println!("{l}");
    }
    println!("  with prefetch {t_pre:.3} ms, gather-then-compute {t_seq:.3} ms");
    Ok(lines.iter().all(|l| !l.contains("no overlap")))
}

fn main() -> ExitCode {
    let comm = match NcclComm::from_env(&NcclConfig::default()) {
        Ok(c) => c,
        Err(e) => {
            println!("FAIL no CUDA/NCCL rank could be started, nothing checked: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, ws) = (comm.rank(), comm.world_size());
    let comm: Arc<dyn Communicator> = Arc::new(comm);
    let mut all_ok = true;
    let modes = [
        ("f32", GradReduction::F32, GradDtype::F32, 1e-6),
        ("bf16", GradReduction::Bf16, GradDtype::F32, 1e-2),
        (
            "fp8-e4m3",
            GradReduction::Fp8(Fp8Format::E4M3),
            GradDtype::F32,
            0.1,
        ),
        (
            "fp8-e5m2",
            GradReduction::Fp8(Fp8Format::E5M2),
            GradDtype::F32,
            0.2,
        ),
        // BF16 gradient shards (the add into the shard rounds once to BF16).
        (
            "f32, bf16 shards",
            GradReduction::F32,
            GradDtype::Bf16,
            1e-2,
        ),
        (
            "bf16, bf16 shards",
            GradReduction::Bf16,
            GradDtype::Bf16,
            1e-2,
        ),
        (
            "fp8-e5m2, bf16 shards",
            GradReduction::Fp8(Fp8Format::E5M2),
            GradDtype::Bf16,
            0.2,
        ),
        // The block exchange sums on the receiving rank in rank order: its FP8 gradient shards match the
        // CPU bit for bit at any world size; only the plain group's F32 reduce-scatter order differs.
        (
            "fp8-block-e4m3",
            GradReduction::Fp8Block(Fp8Format::E4M3),
            GradDtype::F32,
            1e-5,
        ),
        (
            "fp8-block-e5m2",
            GradReduction::Fp8Block(Fp8Format::E5M2),
            GradDtype::F32,
            1e-5,
        ),
        (
            "fp8-block-e4m3, bf16 shards",
            GradReduction::Fp8Block(Fp8Format::E4M3),
            GradDtype::Bf16,
            1e-2,
        ),
    ];
    for (name, mode, dtype, tol) in modes {
        let gpu = step(comm.clone(), mode, dtype);
        let cpu =
            run_ranks(ws, |c| step(Arc::new(c), mode, dtype)).map(|mut v| v.swap_remove(rank));
        let (gpu, cpu) = match (gpu, cpu) {
            (Ok(g), Ok(c)) => (g, c),
            (g, c) => {
                println!(
                    "rank {rank} {name}: FAIL (gpu: {:?}, cpu: {:?})",
                    g.err(),
                    c.err()
                );
                all_ok = false;
                continue;
            }
        };
        let bitwise = gpu == cpu;
        let e_grad = rel(&gpu.grads, &cpu.grads);
        let e_plain = rel(&gpu.plain, &cpu.plain);
        let e_scales = rel(&gpu.scales, &cpu.scales);
        let codes_diff: usize = gpu
            .fp8
            .iter()
            .zip(&cpu.fp8)
            .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
            .sum();
        let codes_total: usize = cpu.fp8.iter().map(Vec::len).sum();
        // At world size 1 every reduction is the identity: the GPU must match bit for bit. Beyond, NCCL's
        // summation order may differ from the thread ring's.
        let ok = if ws == 1 {
            bitwise
        } else {
            e_grad <= tol && e_plain <= tol
        };
        all_ok &= ok;
        println!(
            "rank {rank}/{ws} {name}: {} (bitwise {bitwise}; rel. error grads {e_grad:.3e}, plain {e_plain:.3e}, scales {e_scales:.3e}; FP8 codes differing {codes_diff}/{codes_total}; non-finite {} vs {})",
            if ok { "PASS" } else { "FAIL" },
            gpu.nonfinite,
            cpu.nonfinite
        );
    }
    match overlap_trace(&comm) {
        Ok(true) => println!("rank {rank} prefetch overlap: PASS"),
        Ok(false) => {
            println!("rank {rank} prefetch overlap: FAIL (see trace)");
            all_ok = false;
        }
        Err(e) => {
            println!("rank {rank} prefetch overlap: FAIL ({e})");
            all_ok = false;
        }
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
