//! What every training binary checks and holds before it trains: output paths that can be written
//! (checked before the first step, not after an epoch), one writer per checkpoint directory (an advisory
//! lock held for the whole run), and the refusal of launcher variables a CPU run would ignore.

use fsdp_shard::checkpoint::{check_writable_dir, check_writable_file, CheckpointLock};
use fsdp_shard::ShardError;
use std::path::Path;

/// Why a run cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// An output path cannot be written, or the checkpoint directory is in use.
    #[error("{flag} {path}: {source}")]
    Output {
        /// The flag that named the path.
        flag: String,
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: ShardError,
    },
    /// The process was started by a multi-process launcher for a device that runs ranks as threads.
    #[error("{0}")]
    Launcher(String),
}

/// The outputs of a run, checked, and the lock on its checkpoint directory (released when dropped).
#[derive(Debug)]
pub struct RunOutputs {
    _lock: Option<CheckpointLock>,
}

impl RunOutputs {
    /// Checks that every output can be written (`(flag, path, is_directory)`: a probe file is created and
    /// removed) and takes the lock of the checkpoint directory `save` (another run writing there is an
    /// error naming its process).
    pub fn prepare(
        save: Option<(&str, &Path)>,
        files: &[(&str, &Path)],
    ) -> Result<Self, SetupError> {
        let wrap = |flag: &str, path: &Path| {
            let (flag, path) = (flag.to_string(), path.display().to_string());
            move |source| SetupError::Output { flag, path, source }
        };
        for &(flag, path) in files {
            check_writable_file(path).map_err(wrap(flag, path))?;
        }
        let lock = match save {
            Some((flag, dir)) => {
                check_writable_dir(dir).map_err(wrap(flag, dir))?;
                Some(CheckpointLock::acquire(dir).map_err(wrap(flag, dir))?)
            }
            None => None,
        };
        Ok(RunOutputs { _lock: lock })
    }
}

/// Refuses a run on the CPU that a launcher started as one of several processes (`RANK`/`WORLD_SIZE`
/// set): CPU ranks are threads of one process (`--world-size`), so each process would run the whole job
/// and they would write the same outputs.
pub fn refuse_launcher_on_cpu(binary: &str) -> Result<(), SetupError> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (rank, world) = (var("RANK"), var("WORLD_SIZE"));
    if rank.is_none() && world.is_none() {
        return Ok(());
    }
    if world.as_deref() == Some("1") && rank.as_deref().is_none_or(|r| r == "0") {
        return Ok(());
    }
    Err(SetupError::Launcher(format!(
        "{binary} was started as one of several processes (RANK={}, WORLD_SIZE={}) but runs on the \
         CPU, where ranks are threads of one process: run it once with --world-size N instead of under \
         fsdp-run (fsdp-run starts one process per GPU with --device cuda)",
        rank.as_deref().unwrap_or("unset"),
        world.as_deref().unwrap_or("unset")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_checked_and_the_directory_is_locked() {
        let dir = std::env::temp_dir().join(format!("fsdp-run-setup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ckpt = dir.join("ckpt");
        let metrics = dir.join("m.jsonl");
        let held =
            RunOutputs::prepare(Some(("--save", &ckpt)), &[("--metrics", &metrics)]).unwrap();
        // A directory given for a file names the flag.
        let e = RunOutputs::prepare(None, &[("--metrics", &ckpt)]).unwrap_err();
        assert!(e.to_string().starts_with("--metrics"), "{e}");
        // The same process may not take the lock twice either: a second writer is refused.
        let second = RunOutputs::prepare(Some(("--save", &ckpt)), &[]);
        assert!(second.is_err(), "a second writer was accepted");
        drop(held);
        RunOutputs::prepare(Some(("--save", &ckpt)), &[]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Where a run's ranks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// CUDA when a GPU and its libraries are usable, else the CPU.
    #[default]
    Auto,
    /// The CPU, ranks as threads.
    Cpu,
    /// CUDA, one process per GPU (NCCL; several GPUs through the `fsdp-run` launcher).
    Cuda,
}

/// How [`launch_ranks`] runs the ranks.
#[derive(Debug, Clone)]
pub struct RankLaunch<'a> {
    /// The binary's name, for messages.
    pub binary: &'a str,
    /// Where.
    pub device: DeviceChoice,
    /// Ranks: threads on the CPU; on CUDA it must equal the launcher's `WORLD_SIZE` (1 without one).
    pub world_size: usize,
    /// CPU threads per rank (default: the cores divided by the ranks).
    pub threads_per_rank: Option<usize>,
    /// How long a CPU collective waits for the other ranks.
    pub timeout: std::time::Duration,
}

/// Runs `rank_fn` on every rank of this process: one CUDA rank (this process's GPU, NCCL, with the world
/// the launcher set up) or `world_size` CPU thread ranks, each with its own rayon pool. Returns each
/// rank's result (one on CUDA) and the device in words. The first rank to fail is the error reported.
pub fn launch_ranks<R, E, F>(launch: &RankLaunch<'_>, rank_fn: F) -> Result<(Vec<R>, String), E>
where
    R: Send,
    E: From<fsdp_comm::CommError>
        + From<fp8_kernels::KernelError>
        + From<SetupError>
        + Send
        + std::fmt::Display,
    F: Fn(std::sync::Arc<dyn fsdp_comm::Communicator>, fp8_kernels::CpuParallelism) -> Result<R, E>
        + Sync,
{
    use fp8_kernels::{CpuParallelism, Device};
    use fsdp_comm::{Communicator, NcclComm, NcclConfig, ThreadComm};
    use std::sync::Arc;
    let use_cuda = match launch.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => Device::auto().0.is_cuda(),
    };
    if use_cuda {
        let comm = NcclComm::from_env(&NcclConfig::default())?;
        if comm.world_size() != launch.world_size {
            return Err(SetupError::Launcher(format!(
                "--world-size {} but the launcher started {} process(es); on CUDA start one process \
                 per GPU with fsdp-run",
                launch.world_size,
                comm.world_size()
            ))
            .into());
        }
        let device = format!(
            "CUDA GPU {} of {} rank(s), NCCL",
            comm.cuda().ordinal(),
            comm.world_size()
        );
        return Ok((
            vec![rank_fn(Arc::new(comm), CpuParallelism::Single)?],
            device,
        ));
    }
    refuse_launcher_on_cpu(launch.binary)?;
    if launch.world_size == 0 {
        return Err(SetupError::Launcher("--world-size must be at least 1".into()).into());
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_rank = launch
        .threads_per_rank
        .unwrap_or((cores / launch.world_size).max(1))
        .max(1);
    let par = if per_rank == 1 {
        CpuParallelism::Single
    } else {
        CpuParallelism::Rayon(per_rank)
    };
    let device = format!(
        "CPU, {} thread rank(s), {per_rank} thread(s) each",
        launch.world_size
    );
    let results =
        fsdp_comm::run_ranks_timeout(launch.world_size, launch.timeout, |comm: ThreadComm| {
            // Each rank gets its own rayon pool, so the kernels of one rank stay on its cores.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(per_rank)
                .thread_name(move |i| format!("rank-worker-{i}"))
                .build()
                .map_err(|e| SetupError::Launcher(format!("thread pool: {e}")))?;
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            pool.install(|| rank_fn(comm, par))
        })?;
    Ok((results, device))
}
