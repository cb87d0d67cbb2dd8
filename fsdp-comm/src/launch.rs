//! The local launcher behind `fsdp-run`: starts `N` copies of a command with torchrun-style variables,
//! prefixes their output, forwards SIGINT/SIGTERM, and ends the job when one process fails.
//!
//! Each child runs in its own process group, so signals (forwarded or from the launcher's cleanup) reach
//! everything it started, and a terminal's Ctrl-C is delivered once, through the launcher. When a child
//! exits unsuccessfully, the others get SIGTERM, then SIGKILL after a grace period, and the failure is
//! reported with the rank and its exit status.
//!
//! Nothing a rank starts outlives the launcher (Linux): when a rank exits, what is left of its process
//! group is killed; each child asks the kernel for SIGKILL when the launcher dies (`PR_SET_PDEATHSIG`);
//! and a guard process, forked from the launcher into a group of its own, kills every rank's process
//! group when the launcher dies, even by SIGKILL, which runs no cleanup. Otherwise the processes a rank
//! started (data workers, a shell's background jobs) would keep running, holding GPUs, ports and
//! checkpoint locks.
//!
//! [`LaunchConfig::check`] refuses a job before anything starts: `nproc` beyond the host
//! ([`nproc_cap`]: the visible GPUs for CUDA ranks, [`CPU_RANKS_PER_CORE`] per core otherwise), a kill
//! grace beyond [`MAX_KILL_GRACE`], a master address that does not resolve or a port that cannot be
//! listened on.

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

/// What each rank runs on. It bounds how many ranks one host may start ([`nproc_cap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankDevice {
    /// One CUDA GPU per rank (`LOCAL_RANK` picks it): at most as many ranks as the CUDA driver shows
    /// GPUs (after `CUDA_VISIBLE_DEVICES`).
    Cuda,
    /// No GPU: at most [`CPU_RANKS_PER_CORE`] ranks per core this process may use.
    Cpu,
    /// `Cuda` when the CUDA driver loads and shows at least one GPU, `Cpu` otherwise.
    Auto,
}

impl RankDevice {
    /// The `--device` value: "cuda", "cpu" or "auto".
    pub fn name(self) -> &'static str {
        match self {
            RankDevice::Cuda => "cuda",
            RankDevice::Cpu => "cpu",
            RankDevice::Auto => "auto",
        }
    }
}

/// Ranks per core allowed for programs that use no GPU. Each rank is a process; a few per core leave
/// room for programs that wait on I/O, and anything beyond only oversubscribes the CPU (an `--nproc`
/// typed with extra digits would otherwise fork until the process table is full).
pub const CPU_RANKS_PER_CORE: usize = 4;

/// Longest `kill_grace` (`--kill-grace`): ranks that save a checkpoint on SIGTERM need seconds to
/// minutes, and a longer wait reads as a hung launcher.
pub const MAX_KILL_GRACE: Duration = Duration::from_secs(3600);

/// A job to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Number of processes (ranks) on this host.
    pub nproc: usize,
    /// What the ranks run on, which bounds `nproc` ([`nproc_cap`]).
    pub device: RankDevice,
    /// `MASTER_ADDR` given to the children.
    pub master_addr: String,
    /// `MASTER_PORT`; 0 picks a free port.
    pub master_port: u16,
    /// The program and its arguments.
    pub command: Vec<OsString>,
    /// Output handling.
    pub output: OutputMode,
    /// Time between SIGTERM and SIGKILL when ending the other ranks (at most [`MAX_KILL_GRACE`]).
    pub kill_grace: Duration,
}

impl LaunchConfig {
    /// `nproc` copies of `command` on 127.0.0.1 with a free port and prefixed output, counted as CPU
    /// ranks (set `device` for GPU programs, so that `nproc` is checked against the GPUs).
    pub fn new(nproc: usize, command: Vec<OsString>) -> Self {
        LaunchConfig {
            nproc,
            device: RankDevice::Cpu,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            command,
            output: OutputMode::Prefix,
            kill_grace: Duration::from_secs(5),
        }
    }

    /// Refuses a job this host cannot run before anything starts: no command, `nproc` of 0 or beyond
    /// [`nproc_cap`], `kill_grace` beyond [`MAX_KILL_GRACE`], a `master_addr` that does not resolve or
    /// is not an address of this host, or (with several ranks) a `master_port` that rank 0 could not
    /// listen on (in use, or privileged). The messages name the
    /// `fsdp-run` flags. [`launch`] runs this first.
    pub fn check(&self) -> Result<(), CommError> {
        let invalid = |detail: String| CommError::InvalidArgument {
            op: "launch",
            detail,
        };
        if self.command.is_empty() {
            return Err(invalid(
                "no command given (use: fsdp-run --nproc N -- cmd ...)".into(),
            ));
        }
        if self.nproc == 0 {
            return Err(invalid("--nproc must be at least 1".into()));
        }
        if self.kill_grace > MAX_KILL_GRACE {
            return Err(invalid(format!(
                "--kill-grace {}s is longer than the limit of {}s (the wait between SIGTERM and \
                 SIGKILL when other ranks are stopped)",
                self.kill_grace.as_secs_f64(),
                MAX_KILL_GRACE.as_secs()
            )));
        }
        let cap = nproc_cap(self.device)?;
        if self.nproc > cap.max {
            return Err(invalid(format!(
                "--nproc {} exceeds the limit of {}: {}",
                self.nproc, cap.max, cap.reason
            )));
        }
        let addr = resolve_master(&self.master_addr)?;
        // Rank 0 listens on the port only when there are other ranks to meet (the rendezvous); the
        // address is checked either way (the launcher picks a free port on it).
        let port = if self.nproc > 1 { self.master_port } else { 0 };
        let at = SocketAddr::new(addr.ip(), port);
        if let Err(e) = TcpListener::bind(at) {
            return Err(invalid(
                if e.kind() == std::io::ErrorKind::AddrNotAvailable || port == 0 {
                    format!(
                        "--master-addr {}: cannot listen on {at} ({e}); the ranks run on this host, \
                         so it must be one of its addresses",
                        self.master_addr
                    )
                } else {
                    format!(
                        "--master-port {port}: rank 0 could not listen on {at} ({e}); pass 0 to pick \
                         a free port"
                    )
                },
            ));
        }
        Ok(())
    }
}

/// The address `MASTER_ADDR` names, as rank 0's rendezvous resolves it (the first address).
fn resolve_master(master_addr: &str) -> Result<SocketAddr, CommError> {
    let invalid = |detail: String| CommError::InvalidArgument {
        op: "launch",
        detail,
    };
    (master_addr, 0)
        .to_socket_addrs()
        .map_err(|e| invalid(format!("--master-addr {master_addr} does not resolve: {e}")))?
        .next()
        .ok_or_else(|| {
            invalid(format!(
                "--master-addr {master_addr} resolves to no address"
            ))
        })
}

/// The most ranks a device kind allows on this host, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NprocCap {
    /// The device the ranks were counted for (`Auto` resolved to `Cuda` or `Cpu`).
    pub device: RankDevice,
    /// The most ranks.
    pub max: usize,
    /// Why, in words, for the refusal message.
    pub reason: String,
}

/// How many CUDA GPUs the driver shows this process (`CUDA_VISIBLE_DEVICES` applied), or why none can be
/// counted. The driver library is looked for first: cudarc panics on a missing one.
pub fn visible_cuda_gpus() -> Result<usize, String> {
    // SAFETY: only tries to dlopen libcuda; nothing is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda, the CUDA driver library, could not be loaded".into());
    }
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|e| format!("the CUDA driver reports {e}"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// `CUDA_VISIBLE_DEVICES`, for messages, when it is set.
fn visible_devices_note() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!(" with CUDA_VISIBLE_DEVICES={v:?}"),
        Err(_) => String::new(),
    }
}

/// The most ranks `device` allows here: the visible GPUs for `Cuda` (an error when there are none),
/// [`CPU_RANKS_PER_CORE`] times the cores this process may use for `Cpu`; `Auto` is `Cuda` when the
/// driver shows a GPU and `Cpu` otherwise.
pub fn nproc_cap(device: RankDevice) -> Result<NprocCap, CommError> {
    let gpus = match device {
        RankDevice::Cpu => Err(String::new()),
        RankDevice::Cuda | RankDevice::Auto => visible_cuda_gpus(),
    };
    match (device, gpus) {
        (RankDevice::Cuda | RankDevice::Auto, Ok(n)) if n > 0 => Ok(NprocCap {
            device: RankDevice::Cuda,
            max: n,
            reason: format!(
                "the CUDA driver shows {n} GPU(s){} and each rank takes one{}",
                visible_devices_note(),
                if device == RankDevice::Auto {
                    " (ranks that use no GPU: pass --device cpu)"
                } else {
                    ""
                }
            ),
        }),
        (RankDevice::Cuda, Ok(_)) => Err(CommError::InvalidArgument {
            op: "launch",
            detail: format!(
                "--device cuda, but the CUDA driver shows no GPU{}",
                visible_devices_note()
            ),
        }),
        (RankDevice::Cuda, Err(why)) => Err(CommError::InvalidArgument {
            op: "launch",
            detail: format!("--device cuda, but {why}"),
        }),
        (_, gpus) => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let why_cpu = match gpus {
                Ok(_) => format!(
                    "with no CUDA GPU here (the CUDA driver shows none{})",
                    visible_devices_note()
                ),
                Err(why) if device == RankDevice::Auto => format!("with no CUDA GPU here ({why})"),
                Err(_) => "with --device cpu".into(),
            };
            Ok(NprocCap {
                device: RankDevice::Cpu,
                max: CPU_RANKS_PER_CORE.saturating_mul(cores),
                reason: format!(
                    "{why_cpu}, ranks are CPU programs, limited to {CPU_RANKS_PER_CORE} per core on the \
                     {cores} core(s) this process may use; more would only oversubscribe the CPU"
                ),
            })
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

/// Linux: the guard process and the parts of a rank's start and end that keep the guard's list right.
#[cfg(target_os = "linux")]
mod orphan_guard {
    use super::signal_group;
    use crate::error::CommError;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command, ExitStatus};

    /// A process forked from the launcher that ends every rank's process group when the launcher dies.
    ///
    /// The launcher holds one end of a socket pair (close-on-exec, so ranks do not inherit it past their
    /// exec). Each rank sends its process group id from the forked child before it execs, so the guard
    /// knows the group before the program runs; the launcher sends the negated id before it reaps the
    /// rank (after that the number may be reused). When the launcher's end closes (the launcher died,
    /// or dropped the guard while ranks remained), the guard SIGKILLs every group left on its list and
    /// exits. It lives in a process group of its own, so a signal to the launcher's group (a terminal's
    /// Ctrl-C, `kill -9 -PGID`) does not take it along, and it ignores SIGINT, SIGTERM and SIGHUP: it
    /// ends by itself when the launcher does.
    ///
    /// A subreaper launcher (`PR_SET_CHILD_SUBREAPER`) would not do: when the launcher dies, its adopted
    /// orphans pass on to init, alive.
    pub(super) struct Guard {
        /// The launcher's end of the socket pair.
        socket: OwnedFd,
        pid: libc::pid_t,
    }

    fn os_error(what: &str) -> CommError {
        CommError::io(
            format!("starting the orphan guard: {what}"),
            std::io::Error::last_os_error(),
        )
    }

    impl Guard {
        /// Forks the guard, with room for `nproc` process groups.
        pub(super) fn start(nproc: usize) -> Result<Guard, CommError> {
            let mut fds: [libc::c_int; 2] = [-1; 2];
            // SAFETY: socketpair(2) writes two new descriptors into the two-element array.
            let rc = unsafe {
                libc::socketpair(
                    libc::AF_UNIX,
                    libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                    0,
                    fds.as_mut_ptr(),
                )
            };
            if rc != 0 {
                return Err(os_error("socketpair"));
            }
            // SAFETY: both descriptors were just created and are owned by nothing else.
            let (launcher_end, guard_end) =
                unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            // The guard's list, allocated here: the forked child of a multithreaded process may not
            // allocate (another thread may have held the allocator's lock at the fork).
            let mut groups: Vec<libc::pid_t> = vec![0; nproc];
            // SAFETY: fork(2). The child runs only `guard_main`, which makes async-signal-safe system
            // calls, writes only into memory allocated before the fork, and never returns (it ends with
            // _exit, so no destructor or atexit handler runs in it).
            let pid = unsafe { libc::fork() };
            match pid {
                -1 => Err(os_error("fork")),
                0 => guard_main(guard_end.as_raw_fd(), &mut groups),
                _ => {
                    drop(guard_end);
                    Ok(Guard {
                        socket: launcher_end,
                        pid,
                    })
                }
            }
        }

        /// The descriptor a rank's forked child sends its group on (see [`arm_rank`]).
        pub(super) fn socket(&self) -> RawFd {
            self.socket.as_raw_fd()
        }

        /// Makes the guard exit without killing anything: the launcher has ended every group it started
        /// itself. Used when a rank could not be started: its forked child may have sent its id before
        /// exec failed, and std has reaped it since, so that id is stale.
        pub(super) fn stand_down(self) {
            let _ = send_word(self.socket.as_raw_fd(), 0);
        }

        /// Takes `pgid` off the list: its rank is about to be reaped.
        fn forget(&self, pgid: u32) {
            if let Ok(p) = libc::pid_t::try_from(pgid) {
                // Errors are not fatal here: a guard that died cannot be told anything anyway.
                let _ = send_word(self.socket.as_raw_fd(), -p);
            }
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            // Shutting the socket down is the guard's end of file (even if a forked child of another
            // thread still holds a copy of the descriptor): it ends what is left on its list (nothing
            // after a complete job) and exits; then it is reaped.
            // SAFETY: shutdown(2) of our own socket and waitpid(2) of our own child.
            unsafe {
                libc::shutdown(self.socket.as_raw_fd(), libc::SHUT_RDWR);
                let mut status = 0;
                while libc::waitpid(self.pid, &mut status, 0) == -1
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
                {
                }
            }
        }
    }

    /// Sends one native-endian i32, without SIGPIPE when the peer is gone.
    fn send_word(fd: RawFd, word: i32) -> std::io::Result<()> {
        let bytes = word.to_ne_bytes();
        // SAFETY: send(2) reads `bytes.len()` bytes from a live array; async-signal-safe, so this also
        // runs in a forked child before exec.
        let sent =
            unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
        match sent {
            4 => Ok(()),
            -1 => Err(std::io::Error::last_os_error()),
            _ => Err(std::io::Error::from_raw_os_error(libc::EPIPE)),
        }
    }

    /// Closes every descriptor but `keep`: the guard must not hold the launcher's output, the ranks'
    /// pipes, or another job's guard socket open.
    fn close_all_but(keep: RawFd) {
        let keep = libc::c_uint::try_from(keep).unwrap_or(0);
        // SAFETY: close_range(2) and close(2) on descriptors of this (forked) process only.
        unsafe {
            let below = keep == 0 || libc::syscall(libc::SYS_close_range, 0, keep - 1, 0) == 0;
            let above = libc::syscall(libc::SYS_close_range, keep + 1, libc::c_uint::MAX, 0) == 0;
            if below && above {
                return;
            }
            // Kernels before 5.9 have no close_range: close one by one up to the descriptor limit.
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            let top = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
                limit.rlim_cur.min(1 << 20)
            } else {
                1024
            };
            for fd in 0..top {
                let fd = fd as libc::c_int;
                if fd as libc::c_uint != keep {
                    libc::close(fd);
                }
            }
        }
    }

    /// The guard's whole life, in the forked child: only async-signal-safe calls, no allocation.
    fn guard_main(socket: RawFd, groups: &mut [libc::pid_t]) -> ! {
        // SAFETY: plain system calls on this process; the name is a NUL-terminated static string.
        unsafe {
            libc::setpgid(0, 0);
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_IGN);
            }
            libc::prctl(libc::PR_SET_NAME, c"fsdp-run-guard".as_ptr(), 0, 0, 0);
        }
        close_all_but(socket);
        let mut word = [0u8; 4];
        let mut have = 0usize;
        loop {
            let rest = &mut word[have..];
            // SAFETY: recv(2) writes at most `rest.len()` bytes into the live buffer.
            let got = unsafe { libc::recv(socket, rest.as_mut_ptr().cast(), rest.len(), 0) };
            if got == 0 {
                break; // end of file: the launcher is gone
            }
            if got < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                break;
            }
            have += got as usize;
            if have < word.len() {
                continue;
            }
            have = 0;
            let message = i32::from_ne_bytes(word);
            if message == 0 {
                // SAFETY: _exit(2) ends the forked child without running the parent's destructors.
                unsafe { libc::_exit(0) }
            }
            let (find, put) = if message > 0 {
                (0, message)
            } else {
                (-message, 0)
            };
            if let Some(slot) = groups.iter_mut().find(|g| **g == find) {
                *slot = put;
            }
        }
        for &pgid in groups.iter() {
            if pgid > 0 {
                // The group's id cannot have been reused: the launcher takes a group off the list before
                // it reaps the group's leader, and until then the leader (alive or a zombie) holds the id.
                // A rank the parent-death signal killed at the same moment is reaped by init, which
                // leaves a window of microseconds in which its number would have to come round again.
                signal_group(pgid as u32, libc::SIGKILL);
            }
        }
        // SAFETY: _exit(2) ends the forked child without running the parent's destructors.
        unsafe { libc::_exit(0) }
    }

    /// Makes the rank `cmd` starts die with the launcher and be known to the guard.
    ///
    /// In the forked child, before exec: `PR_SET_PDEATHSIG` = SIGKILL (it fires when the thread that
    /// forked the child exits; [`super::launch`] forks from the thread that then waits for every child,
    /// so that thread outlives the children unless the launcher dies); a launcher that died between the
    /// fork and the `prctl` is caught by comparing the parent pid; then the child's process group (it
    /// leads it: `process_group(0)` has run) is sent to the guard.
    pub(super) fn arm_rank(cmd: &mut Command, launcher_pid: u32, guard: &Guard) {
        let parent = libc::pid_t::try_from(launcher_pid).unwrap_or(0);
        let socket = guard.socket();
        let arm = move || -> std::io::Result<()> {
            // SAFETY: prctl(2), getppid(2) and getpid(2) are plain system calls (async-signal-safe), and
            // the error values are built without allocating.
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
                send_word(socket, libc::getpid())
            }
        };
        // SAFETY: the closure only makes async-signal-safe system calls and touches no shared state, as
        // pre_exec requires of code that runs between fork and exec.
        unsafe {
            cmd.pre_exec(arm);
        }
    }

    /// Reaps `child` if it has exited. First what is left of its process group is killed: the exited
    /// leader is a zombie until reaped and holds the group's id, so the signal cannot reach a group that
    /// reused the number. Then the guard forgets the group, then the leader is reaped.
    pub(super) fn reap_if_exited(
        child: &mut Child,
        guard: &Guard,
    ) -> std::io::Result<Option<ExitStatus>> {
        let pid: libc::id_t = child.id();
        // SAFETY: waitid(2) with WNOWAIT only reports (does not reap) our own child into a zeroed
        // siginfo_t, whose si_pid stays 0 when the child has not exited.
        let exited = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            if libc::waitid(
                libc::P_PID,
                pid,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            info.si_pid() != 0
        };
        if !exited {
            return Ok(None);
        }
        end_group(child, guard);
        child.try_wait()
    }

    /// Kills `child`'s process group and takes it off the guard's list; the caller then reaps `child`.
    pub(super) fn end_group(child: &Child, guard: &Guard) {
        signal_group(child.id(), libc::SIGKILL);
        guard.forget(child.id());
    }
}

/// Other systems: no guard and no parent-death signal; the launcher's own cleanup is all there is.
#[cfg(not(target_os = "linux"))]
mod orphan_guard {
    use crate::error::CommError;
    use std::process::{Child, Command, ExitStatus};

    pub(super) struct Guard;

    impl Guard {
        pub(super) fn start(_nproc: usize) -> Result<Guard, CommError> {
            Ok(Guard)
        }

        pub(super) fn stand_down(self) {}
    }

    pub(super) fn arm_rank(_cmd: &mut Command, _launcher_pid: u32, _guard: &Guard) {}

    pub(super) fn reap_if_exited(
        child: &mut Child,
        _guard: &Guard,
    ) -> std::io::Result<Option<ExitStatus>> {
        child.try_wait()
    }

    pub(super) fn end_group(child: &Child, _guard: &Guard) {
        super::signal_group(child.id(), libc::SIGKILL);
    }
}

/// Runs the job to completion (or first failure) and reports how it ended. Errors are for jobs that
/// could not be started at all ([`LaunchConfig::check`] first).
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchOutcome, CommError> {
    cfg.check()?;
    let Some(program) = cfg.command.first() else {
        return Err(CommError::Launch(
            "no command given (use: fsdp-run --nproc N -- cmd ...)".into(),
        ));
    };
    let port = if cfg.master_port == 0 {
        pick_free_port(&cfg.master_addr).map_err(|e| CommError::InvalidArgument {
            op: "launch",
            detail: format!("--master-addr {}: no free port: {e}", cfg.master_addr),
        })?
    } else {
        cfg.master_port
    };
    let launcher_pid = std::process::id();
    let guard = orphan_guard::Guard::start(cfg.nproc)?;
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
        orphan_guard::arm_rank(&mut cmd, launcher_pid, &guard);
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
                for c in &mut children {
                    orphan_guard::end_group(c, &guard);
                    let _ = c.wait();
                }
                guard.stand_down();
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
            // An error here drops the guard on the way out, which ends the ranks still running.
            match orphan_guard::reap_if_exited(c, &guard) {
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
    // Every group is off the guard's list now; dropping it lets it exit.
    drop(guard);
    // Drain the output of the children; a grandchild that left its rank's process group may keep a
    // pipe open, so this is bounded.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sh_true() -> Vec<OsString> {
        vec!["sh".into(), "-c".into(), "true".into()]
    }

    #[test]
    fn cpu_ranks_are_capped_at_four_per_core() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cap = nproc_cap(RankDevice::Cpu).unwrap();
        assert_eq!(cap.device, RankDevice::Cpu);
        assert_eq!(cap.max, CPU_RANKS_PER_CORE * cores);
        assert!(cap.reason.contains("--device cpu"), "{}", cap.reason);
        assert!(LaunchConfig::new(cap.max, sh_true()).check().is_ok());
        let e = LaunchConfig::new(cap.max + 1, sh_true())
            .check()
            .unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "--nproc {} exceeds the limit of {}",
                cap.max + 1,
                cap.max
            )),
            "{e}"
        );
    }

    #[test]
    fn auto_counts_gpus_when_the_driver_shows_some() {
        let cap = nproc_cap(RankDevice::Auto).unwrap();
        match visible_cuda_gpus() {
            Ok(n) if n > 0 => assert_eq!((cap.device, cap.max), (RankDevice::Cuda, n)),
            _ => assert_eq!(cap.device, RankDevice::Cpu),
        }
    }

    #[test]
    fn a_kill_grace_beyond_the_limit_is_refused_before_its_deadline_overflows() {
        let mut cfg = LaunchConfig::new(1, sh_true());
        cfg.kill_grace = MAX_KILL_GRACE;
        assert!(cfg.check().is_ok());
        cfg.kill_grace = Duration::MAX;
        let e = launch(&cfg).unwrap_err();
        assert!(e.to_string().contains("--kill-grace"), "{e}");
    }

    #[test]
    fn no_command_and_no_ranks_are_refused() {
        let e = LaunchConfig::new(1, Vec::new()).check().unwrap_err();
        assert!(e.to_string().contains("no command"), "{e}");
        let e = LaunchConfig::new(0, sh_true()).check().unwrap_err();
        assert!(e.to_string().contains("--nproc must be at least 1"), "{e}");
    }
}
