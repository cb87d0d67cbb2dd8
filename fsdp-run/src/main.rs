//! `fsdp-run --nproc N [--master-port P] -- <command> [args]`: starts N local ranks of a command with
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set.

use clap::Parser;
use fsdp_comm::launch::{self, LaunchConfig, OutputMode};
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

/// Launch N local processes of a distributed program (one per GPU).
#[derive(Parser, Debug)]
#[command(name = "fsdp-run", version, about)]
struct Args {
    /// Number of processes (ranks).
    #[arg(long)]
    nproc: usize,
    /// MASTER_ADDR given to every rank.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// MASTER_PORT given to every rank; 0 picks a free port.
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// Do not prefix each output line with "[rank R] ".
    #[arg(long)]
    no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping the other ranks after a failure.
    #[arg(long, default_value_t = 5.0)]
    kill_grace: f64,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !(args.kill_grace.is_finite() && args.kill_grace >= 0.0) {
        eprintln!("fsdp-run: --kill-grace must be a non-negative number of seconds");
        return ExitCode::from(2);
    }
    let cfg = LaunchConfig {
        nproc: args.nproc,
        master_addr: args.master_addr,
        master_port: args.master_port,
        command: args.command,
        output: if args.no_prefix {
            OutputMode::Inherit
        } else {
            OutputMode::Prefix
        },
        kill_grace: Duration::from_secs_f64(args.kill_grace),
    };
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
            eprintln!("fsdp-run: {e}");
            ExitCode::from(1)
        }
    }
}
