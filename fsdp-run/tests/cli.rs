//! The `fsdp-run` binary, with `sh -c` children: output prefixes, failure propagation, signal forwarding,
//! ranks and the processes they start dying with the launcher, and the refusal of flags this host
//! cannot honour (each message naming its flag). CPU-only: the sh ranks run with `--device cpu`, so the
//! GPU count of the machine does not bound them.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fsdp_run() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp-run"))
}

/// The launcher running `sh -c script` as `nproc` CPU ranks, with `flags` of its own.
fn sh_ranks(nproc: usize, flags: &[&str], script: &str) -> Command {
    let mut c = fsdp_run();
    c.args(["--nproc", &nproc.to_string(), "--device", "cpu"])
        .args(flags)
        .args(["--", "sh", "-c", script]);
    c
}

/// [`sh_ranks`] started in the background, its output discarded.
fn spawn_sh_ranks(nproc: usize, script: &str) -> Child {
    sh_ranks(nproc, &[], script)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn the_binary_prefixes_output_and_propagates_failure() {
    let out = sh_ranks(2, &[], "echo hello from $RANK").output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[rank 0] hello from 0"), "{stdout}");
    assert!(stdout.contains("[rank 1] hello from 1"), "{stdout}");

    let out = sh_ranks(
        2,
        &["--master-port", "0"],
        "if [ \"$RANK\" = 0 ]; then echo bad >&2; exit 7; fi; sleep 60",
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[rank 0] bad"), "{stderr}");
    assert!(
        stderr.contains("rank 0") && stderr.contains("exit code 7"),
        "{stderr}"
    );
}

#[test]
fn the_binary_forwards_sigterm_to_its_ranks() {
    let dir = temp_dir("sig");
    let script = format!(
        "trap 'echo got-term > {}/term_$RANK; exit 0' TERM; while true; do sleep 0.05; done",
        dir.display()
    );
    let mut child = spawn_sh_ranks(2, &script);
    std::thread::sleep(Duration::from_millis(700));
    // SAFETY: plain kill(2) on our own child process.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "launcher did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    for r in 0..2 {
        let t = std::fs::read_to_string(dir.join(format!("term_{r}"))).unwrap();
        assert_eq!(t.trim(), "got-term");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether process `pid` still runs (a zombie, killed but not yet reaped by its new parent, does not).
fn is_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name: "PID (comm) S ...".
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

#[test]
fn ranks_die_when_the_launcher_is_killed() {
    let dir = temp_dir("pdeath");
    // Each rank records its pid, then becomes a long sleep (exec keeps the pid).
    let script = format!("echo $$ > {}/pid_$RANK; exec sleep 60", dir.display());
    let mut launcher = spawn_sh_ranks(2, &script);
    let pids = wait_for_pids(&dir, &["pid_0".to_string(), "pid_1".to_string()]);
    // Give `exec sleep` time to replace the shell, then kill the launcher without letting it clean up.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        pids.iter().all(|&p| is_running(p)),
        "ranks {pids:?} not running"
    );
    launcher.kill().unwrap(); // SIGKILL
    launcher.wait().unwrap();
    let alive = survivors_after(&pids, Duration::from_secs(10));
    assert!(alive.is_empty(), "ranks {alive:?} outlived the launcher");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pids written to `dir/<name>` by the ranks, waiting up to 30 s for every file.
fn wait_for_pids(dir: &std::path::Path, names: &[String]) -> Vec<i32> {
    let start = Instant::now();
    loop {
        let read: Vec<Option<i32>> = names
            .iter()
            .map(|n| {
                std::fs::read_to_string(dir.join(n))
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
            })
            .collect();
        if read.iter().all(Option::is_some) {
            return read.into_iter().flatten().collect();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the ranks did not write {names:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to `limit` for `pids` to stop running; SIGKILLs and returns those that did not.
fn survivors_after(pids: &[i32], limit: Duration) -> Vec<i32> {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&p| is_running(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive: Vec<i32> = pids.iter().copied().filter(|&p| is_running(p)).collect();
    for &p in &alive {
        // SAFETY: plain kill(2) of a process this test started (through the launcher); cleanup only.
        unsafe {
            libc::kill(p, libc::SIGKILL);
        }
    }
    alive
}

#[test]
fn processes_the_ranks_started_die_when_the_launcher_is_killed() {
    let dir = temp_dir("grandchild");
    // Each rank (a shell) starts a background sleep (in the rank's process group), records both pids and
    // waits for the sleep.
    let script = format!(
        "sleep 300 & echo $! > {d}/child_$RANK; echo $$ > {d}/rank_$RANK; wait",
        d = dir.display()
    );
    let mut launcher = spawn_sh_ranks(2, &script);
    let names: Vec<String> = (0..2)
        .flat_map(|r| [format!("rank_{r}"), format!("child_{r}")])
        .collect();
    let pids = wait_for_pids(&dir, &names);
    assert!(
        pids.iter().all(|&p| is_running(p)),
        "ranks and their children {pids:?} not running"
    );
    launcher.kill().unwrap(); // SIGKILL: the launcher runs no cleanup
    launcher.wait().unwrap();
    let alive = survivors_after(&pids, Duration::from_secs(5));
    assert!(
        alive.is_empty(),
        "{alive:?} of the ranks and their children {pids:?} outlived the launcher"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_a_rank_leaves_behind_in_its_group_ends_with_it() {
    let dir = temp_dir("leftover");
    // The rank starts a background sleep and exits at once, successfully.
    let script = format!(
        "sleep 300 & echo $! > {}/child_$RANK; exit 0",
        dir.display()
    );
    let start = Instant::now();
    let out = sh_ranks(1, &[], &script).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let pids = wait_for_pids(&dir, &["child_0".to_string()]);
    let alive = survivors_after(&pids, Duration::from_secs(5));
    assert!(alive.is_empty(), "the rank's child {alive:?} outlived it");
    // The sleep held the rank's output pipe; ending it lets the launcher finish at once.
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "launcher waited for the leftover"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs the launcher with `args` and returns (exit code, stderr), failing if it takes over 20 s.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let start = Instant::now();
    let out = fsdp_run().args(args).output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "fsdp-run {args:?} took {:?} to answer",
        start.elapsed()
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that the launcher refuses `args` (exit code 2) with a message containing `expect`.
fn refused_with(args: &[&str], expect: &str) {
    let (code, stderr) = refused(args);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains(expect), "{stderr}");
}

#[test]
fn an_nproc_beyond_the_host_is_refused_before_anything_starts() {
    let dir = temp_dir("nproc");
    let started = format!("touch {}/started_$RANK", dir.display());
    let cores = std::thread::available_parallelism().unwrap().get();

    // The probe's case: the default device (GPUs when the driver shows some, the CPU otherwise).
    refused_with(
        &["--nproc", "100000", "--", "sh", "-c", &started],
        "--nproc 100000 exceeds the limit of",
    );

    // CPU ranks: 4 per core, and the message says so.
    let over = (4 * cores + 1).to_string();
    let (code, stderr) = refused(&[
        "--nproc", &over, "--device", "cpu", "--", "sh", "-c", &started,
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    let limit = 4 * cores;
    assert!(
        stderr.contains(&format!("--nproc {over} exceeds the limit of {limit}:"))
            && stderr.contains(&format!("4 per core on the {cores} core(s)")),
        "{stderr}"
    );

    // CUDA ranks: the visible GPUs, or a refusal naming --device cuda where there are none.
    let (code, stderr) = refused(&["--nproc", "100000", "--device", "cuda", "--", "true"]);
    assert_eq!(code, Some(2), "{stderr}");
    match fsdp_comm::launch::visible_cuda_gpus() {
        Ok(gpus) if gpus > 0 => assert!(
            stderr.contains(&format!("--nproc 100000 exceeds the limit of {gpus}:"))
                && stderr.contains(&format!("shows {gpus} GPU(s)")),
            "{stderr}"
        ),
        _ => assert!(stderr.contains("--device cuda, but"), "{stderr}"),
    }

    refused_with(
        &["--nproc", "0", "--", "true"],
        "--nproc must be at least 1",
    );
    for bad in ["-1", "two"] {
        refused_with(
            &["--nproc", bad, "--", "true"],
            &format!("invalid value '{bad}' for '--nproc"),
        );
    }

    // Not one rank was started by any of these.
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(leftovers.is_empty(), "ranks started: {leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_numbers_and_addresses_are_refused_naming_their_flag() {
    for bad in ["1e300", "-1", "nan", "inf", "soon"] {
        let (code, stderr) = refused(&["--nproc", "1", "--kill-grace", bad, "--", "true"]);
        assert_eq!(code, Some(2), "--kill-grace {bad}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value '{bad}' for '--kill-grace"))
                && stderr.contains("3600"),
            "{stderr}"
        );
    }
    refused_with(
        &["--nproc", "1", "--master-port", "70000", "--", "true"],
        "invalid value '70000' for '--master-port",
    );

    // A port something else listens on: rank 0 could not serve the rendezvous there.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    refused_with(
        &[
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--master-port",
            &port,
            "--",
            "true",
        ],
        &format!("--master-port {port}: rank 0 could not listen"),
    );
    drop(busy);

    // An address of another host (TEST-NET-1, reserved for documentation).
    refused_with(
        &[
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--master-addr",
            "192.0.2.1",
            "--",
            "true",
        ],
        "--master-addr 192.0.2.1: cannot listen",
    );

    refused_with(
        &["--nproc", "1", "--device", "gpu", "--", "true"],
        "invalid value 'gpu' for '--device",
    );
}
