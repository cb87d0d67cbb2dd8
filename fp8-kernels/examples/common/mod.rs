//! What several examples share: timing with CUDA events, the exit status of a benchmark.
// Each example uses the part it needs.
#![allow(dead_code)]

use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{CudaDevice, KernelError};
use half::bf16;
use rayon::prelude::*;
use std::path::Path;
use std::process::ExitCode;

/// The JSON objects of a file of JSON lines (a peer script's output); other lines (a warning, a
/// traceback) are skipped. An unreadable file or one without any JSON object is an error.
pub fn read_json_lines(path: &Path) -> Result<Vec<serde_json::Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let records: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
        .filter(|v| v.is_object())
        .collect();
    if records.is_empty() {
        return Err("holds no JSON records (the peer script's output of this call?)".into());
    }
    Ok(records)
}

/// Milliseconds of each of `iters` runs of `f` after 5 warm-up runs, timed with CUDA events on the
/// compute stream around each run, in the order run.
pub fn event_times_ms(
    dev: &CudaDevice,
    iters: usize,
    mut f: impl FnMut() -> Result<(), KernelError>,
) -> Result<Vec<f64>, KernelError> {
    for _ in 0..5 {
        f()?;
    }
    dev.stream().synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = dev.record_compute_timed()?;
        f()?;
        let end = dev.record_compute_timed()?;
        times.push(start.elapsed_ms(&end)? as f64);
    }
    Ok(times)
}

/// Median milliseconds (the upper one of an even count) of [`event_times_ms`].
pub fn time_ms(
    dev: &CudaDevice,
    iters: usize,
    f: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    let mut times = event_times_ms(dev, iters, f)?;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// The exit status of a benchmark run: success, also when no GPU could be used (said so: nothing was
/// measured); failure on any other error.
pub fn bench_exit(result: Result<(), KernelError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(KernelError::CudaUnavailable(why)) => {
            println!("no GPU bench run: CUDA is not available ({why})");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Random bf16 values, uniform in [-1, 1) (counter-based, so the parallel fill is reproducible).
pub fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    (0..n)
        .into_par_iter()
        .map(|i| {
            let z = SplitMix64::mix(seed.wrapping_add((i as u64).wrapping_mul(SplitMix64::GAMMA)));
            bf16::from_f32(((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}
