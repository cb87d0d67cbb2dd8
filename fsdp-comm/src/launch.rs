//! The local launcher behind `fsdp-run`: starts `N` copies of a command with torchrun-style variables,
//! prefixes their output, forwards SIGINT/SIGTERM, and ends the job when one process fails.
//!
//! Each child runs in its own process group, so signals (forwarded or from the launcher's cleanup) reach
//! everything it started, and a terminal's Ctrl-C is delivered once, through the launcher. When a child
//! exits unsuccessfully, the others get SIGTERM, then SIGKILL after a grace period, and the failure is
//! reported with the rank and its exit status.
//!
//! Each child also asks the kernel for SIGKILL when the launcher's spawning thread ends
//! (`PR_SET_PDEATHSIG`, Linux), so a launcher killed by SIGKILL, which runs no cleanup, takes its ranks
//! with it instead of leaving them running (still holding GPUs, ports and checkpoint locks).

use crate::error::CommError;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What happens to the children's stdout and stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputMode {
    /// Each line is written to the launcher's stdout/stderr prefixed by `[rank R] `.
    Prefix,
    /// Children write straight to the launcher's stdout/stderr.
    Inherit,
    /// Discarded (tests).
    Null,
}

/// A job to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Number of processes (ranks) on this host.
    pub nproc: usize,
    /// `MASTER_ADDR` given to the children.
    pub master_addr: String,
    /// `MASTER_PORT`; 0 picks a free port.
    pub master_port: u16,
    /// The program and its arguments.
    pub command: Vec<OsString>,
    /// Output handling.
    pub output: OutputMode,
    /// Time between SIGTERM and SIGKILL when ending the other ranks.
    pub kill_grace: Duration,
}

impl LaunchConfig {
    /// `nproc` copies of `command` on 127.0.0.1 with a free port and prefixed output.
    pub fn new(nproc: usize, command: Vec<OsString>) -> Self {
        LaunchConfig {
            nproc,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            command,
            output: OutputMode::Prefix,
            kill_grace: Duration::from_secs(5),
        }
    }
}

/// The first rank that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Its rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// How it ended.
    pub status: ExitStatus,
}

impl std::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} (pid {}) failed: {}",
            self.rank,
            self.pid,
            describe_status(&self.status)
        )
    }
}

/// How a job ended.
#[derive(Debug, Clone)]
pub struct LaunchOutcome {
    /// Exit status of every rank, in rank order.
    pub statuses: Vec<ExitStatus>,
    /// The first rank that failed (the others were then terminated).
    pub failure: Option<RankFailure>,
    /// A signal the launcher received and forwarded.
    pub interrupted_by: Option<i32>,
    /// The `MASTER_PORT` the children got.
    pub master_port: u16,
}

impl LaunchOutcome {
    /// Whether every rank exited with status 0 and no signal was forwarded.
    pub fn success(&self) -> bool {
        self.failure.is_none() && self.interrupted_by.is_none()
    }

    /// The launcher's exit code: 0 on success, the failed rank's code (or 128 + signal), or 128 + the
    /// forwarded signal.
    pub fn exit_code(&self) -> i32 {
        if let Some(f) = &self.failure {
            return match (f.status.code(), f.status.signal()) {
                (Some(c), _) if c != 0 => c,
                (_, Some(s)) => 128 + s,
                _ => 1,
            };
        }
        if let Some(s) = self.interrupted_by {
            return 128 + s;
        }
        0
    }
}

/// "exit code 3" or "killed by signal 9 (SIGKILL)".
pub fn describe_status(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}{}", signal_name(s)),
        _ => "unknown status".into(),
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGINT => " (SIGINT)",
        libc::SIGTERM => " (SIGTERM)",
        libc::SIGKILL => " (SIGKILL)",
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGABRT => " (SIGABRT)",
        _ => "",
    }
}

static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn record_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe. The launch loop forwards it.
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM to this process be forwarded to the children of [`launch`] instead of
/// killing the launcher. Call once from the launcher's `main`.
pub fn install_signal_forwarding() -> Result<(), CommError> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let handler = record_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only performs an atomic store, which is async-signal-safe.
        let prev = unsafe { libc::signal(sig, handler) };
        if prev == libc::SIG_ERR {
            return Err(CommError::Launch(format!(
                "could not install a handler for signal {sig}"
            )));
        }
    }
    Ok(())
}

/// A free TCP port on `addr` (bound and released at once; the usual small race applies).
pub fn pick_free_port(addr: &str) -> Result<u16, CommError> {
    let sa: SocketAddr = (addr, 0)
        .to_socket_addrs()
        .map_err(|e| CommError::io(format!("resolving {addr}"), e))?
        .next()
        .ok_or_else(|| CommError::Launch(format!("{addr} resolves to no address")))?;
    let l = TcpListener::bind(sa).map_err(|e| CommError::io(format!("binding {sa}"), e))?;
    Ok(l.local_addr()
        .map_err(|e| CommError::io("reading a bound port", e))?
        .port())
}

fn signal_group(pid: u32, sig: i32) {
    if let Ok(p) = i32::try_from(pid) {
        // SAFETY: kill(2) has no memory-safety preconditions; a negative pid names the child's process
        // group, which the child leads (it was spawned with process_group(0)).
        unsafe {
            libc::kill(-p, sig);
        }
    }
}

fn copy_lines(src: impl Read, rank: usize, to_stderr: bool) {
    let reader = BufReader::new(src);
    for line in reader.split(b'\n') {
        let Ok(line) = line else { break };
        let mut msg = format!("[rank {rank}] ").into_bytes();
        msg.extend_from_slice(&line);
        msg.push(b'\n');
        // Output errors (closed pipe) cannot be reported anywhere better; drop the line.
        if to_stderr {
            let _ = std::io::stderr().lock().write_all(&msg);
        } else {
            let _ = std::io::stdout().lock().write_all(&msg);
        }
    }
}

/// Makes the child of `cmd` receive SIGKILL when the launcher goes away.
///
/// `PR_SET_PDEATHSIG` fires when the thread that forked the child exits; [`launch`] forks from the
/// thread that then waits for every child, so that thread outlives the children unless the launcher
/// dies. A launcher that died between the fork and the `prctl` is caught by comparing the parent pid.
#[cfg(target_os = "linux")]
fn die_with_launcher(cmd: &mut Command, launcher_pid: u32) {
    let parent = libc::pid_t::try_from(launcher_pid).unwrap_or(0);
    let arm = move || -> std::io::Result<()> {
        // SAFETY: runs in the forked child before exec; prctl(2) and getppid(2) are plain system calls
        // (async-signal-safe), and the error values are built without allocating.
        unsafe {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
        }
        Ok(())
    };
    // SAFETY: the closure only makes async-signal-safe system calls and touches no shared state, as
    // pre_exec requires of code that runs between fork and exec.
    unsafe {
        cmd.pre_exec(arm);
    }
}

/// Other systems have no parent-death signal; the launcher's own cleanup is all there is.
#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_cmd: &mut Command, _launcher_pid: u32) {}

/// Runs the job to completion (or first failure) and reports how it ended. Errors are for jobs that
/// could not be started at all.
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchOutcome, CommError> {
    if cfg.nproc == 0 {
        return Err(CommError::Launch("--nproc must be at least 1".into()));
    }
    let Some(program) = cfg.command.first() else {
        return Err(CommError::Launch(
            "no command given (use: fsdp-run --nproc N -- cmd ...)".into(),
        ));
    };
    let port = if cfg.master_port == 0 {
        pick_free_port(&cfg.master_addr)?
    } else {
        cfg.master_port
    };
    let launcher_pid = std::process::id();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers = 0usize;
    let mut children: Vec<Child> = Vec::with_capacity(cfg.nproc);
    for rank in 0..cfg.nproc {
        let mut cmd = Command::new(program);
        cmd.args(&cfg.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", cfg.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .process_group(0);
        die_with_launcher(&mut cmd, launcher_pid);
        match cfg.output {
            OutputMode::Prefix => {
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
            }
            OutputMode::Inherit => {
                cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
            }
            OutputMode::Null => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in &children {
                    signal_group(c.id(), libc::SIGKILL);
                }
                for c in &mut children {
                    let _ = c.wait();
                }
                return Err(CommError::Launch(format!(
                    "starting rank {rank} ({}): {e}",
                    program.to_string_lossy()
                )));
            }
        };
        if let Some(out) = child.stdout.take() {
            let tx = done_tx.clone();
            readers += 1;
            std::thread::spawn(move || {
                copy_lines(out, rank, false);
                let _ = tx.send(());
            });
        }
        if let Some(err) = child.stderr.take() {
            let tx = done_tx.clone();
            readers += 1;
            std::thread::spawn(move || {
                copy_lines(err, rank, true);
                let _ = tx.send(());
            });
        }
        children.push(child);
    }
    drop(done_tx);

    let n = children.len();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    let mut failure: Option<RankFailure> = None;
    let mut interrupted_by = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    loop {
        let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            interrupted_by = Some(sig);
            for (i, c) in children.iter().enumerate() {
                if statuses[i].is_none() {
                    signal_group(c.id(), sig);
                }
            }
            kill_at.get_or_insert(Instant::now() + cfg.kill_grace);
        }
        for (i, c) in children.iter_mut().enumerate() {
            if statuses[i].is_some() {
                continue;
            }
            match c.try_wait() {
                Ok(Some(st)) => {
                    statuses[i] = Some(st);
                    if !st.success() && failure.is_none() && interrupted_by.is_none() {
                        failure = Some(RankFailure {
                            rank: i,
                            pid: c.id(),
                            status: st,
                        });
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(CommError::io(format!("waiting for rank {i}"), e)),
            }
        }
        if failure.is_some() && kill_at.is_none() {
            for (i, c) in children.iter().enumerate() {
                if statuses[i].is_none() {
                    signal_group(c.id(), libc::SIGTERM);
                }
            }
            kill_at = Some(Instant::now() + cfg.kill_grace);
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if let Some(t) = kill_at {
            if !killed && Instant::now() >= t {
                for (i, c) in children.iter().enumerate() {
                    if statuses[i].is_none() {
                        signal_group(c.id(), libc::SIGKILL);
                    }
                }
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Drain the output of the children; a grandchild that left the process group may keep a pipe
    // open, so this is bounded.
    let drain_deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..readers {
        let left = drain_deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    let statuses = statuses
        .into_iter()
        .map(|s| s.unwrap_or_else(|| ExitStatus::from_raw(1 << 8)))
        .collect();
    Ok(LaunchOutcome {
        statuses,
        failure,
        interrupted_by,
        master_port: port,
    })
}
