//! `fsdp-run --nproc N [--device auto|cuda|cpu] [--master-port P] -- <command> [args]`: starts N local
//! ranks of a command with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` set.

use clap::{Parser, ValueEnum};
use fsdp_comm::launch::{self, LaunchConfig, OutputMode, RankDevice, MAX_KILL_GRACE};
use fsdp_comm::CommError;
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

/// What the ranks run on (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// One GPU per rank when the CUDA driver shows a GPU, the CPU otherwise.
    Auto,
    /// One CUDA GPU per rank; no GPU is an error.
    Cuda,
    /// No GPU: at most 4 ranks per core.
    Cpu,
}

impl From<DeviceArg> for RankDevice {
    fn from(d: DeviceArg) -> Self {
        match d {
            DeviceArg::Auto => RankDevice::Auto,
            DeviceArg::Cuda => RankDevice::Cuda,
            DeviceArg::Cpu => RankDevice::Cpu,
        }
    }
}

/// Launch N local processes of a distributed program (one per GPU).
#[derive(Parser, Debug)]
#[command(name = "fsdp-run", version, about)]
struct Args {
    /// Number of processes (ranks): at most the visible GPUs for CUDA ranks, 4 per core otherwise.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    nproc: usize,
    /// What each rank runs on, which bounds --nproc.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// MASTER_ADDR given to every rank (an address of this host).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// MASTER_PORT given to every rank; 0 picks a free port.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    master_port: u16,
    /// Do not prefix each output line with "[rank R] ".
    #[arg(long)]
    no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping the other ranks after a failure (0 to 3600).
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = parse_kill_grace,
          allow_negative_numbers = true)]
    kill_grace: Duration,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

/// `--kill-grace`: a finite number of seconds from 0 to the library's limit (a larger value would also
/// overflow the launcher's deadline arithmetic).
fn parse_kill_grace(text: &str) -> Result<Duration, String> {
    let max = MAX_KILL_GRACE.as_secs_f64();
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("not a number of seconds (0 to {max})"))?;
    if !(0.0..=max).contains(&secs) {
        return Err(format!(
            "must be from 0 to {max} seconds (the wait between SIGTERM and SIGKILL)"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = LaunchConfig {
        nproc: args.nproc,
        device: args.device.into(),
        master_addr: args.master_addr,
        master_port: args.master_port,
        command: args.command,
        output: if args.no_prefix {
            OutputMode::Inherit
        } else {
            OutputMode::Prefix
        },
        kill_grace: args.kill_grace,
    };
    // A job this host cannot run is a usage error (exit 2, like clap's), reported before anything starts.
    if let Err(e) = cfg.check() {
        report(&e);
        return ExitCode::from(2);
    }
    if let Err(e) = launch::install_signal_forwarding() {
        eprintln!("fsdp-run: {e}");
        return ExitCode::from(1);
    }
    match launch::launch(&cfg) {
        Ok(outcome) => {
            if let Some(f) = &outcome.failure {
                eprintln!("fsdp-run: {f}; the other ranks were stopped");
            } else if let Some(s) = outcome.interrupted_by {
                eprintln!("fsdp-run: received signal {s}, forwarded it to every rank");
            }
            let code = outcome.exit_code();
            ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
        }
        Err(e) => {
            report(&e);
            ExitCode::from(1)
        }
    }
}

/// Prints a launcher error; a refused argument's message already starts with the flag it names.
fn report(e: &CommError) {
    match e {
        CommError::InvalidArgument { detail, .. } => eprintln!("fsdp-run: {detail}"),
        other => eprintln!("fsdp-run: {other}"),
    }
}
