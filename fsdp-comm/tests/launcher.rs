//! The launcher, as a library and as the `fsdp-run` binary, with `sh -c` children.

use fsdp_comm::launch::{launch, LaunchConfig, OutputMode};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn sh(script: &str) -> Vec<OsString> {
    vec!["sh".into(), "-c".into(), script.into()]
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-comm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn all_ranks_get_their_environment_and_succeed() {
    let dir = temp_dir("env");
    let script = format!(
        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT\" > {}/rank_$RANK",
        dir.display()
    );
    let mut cfg = LaunchConfig::new(3, sh(&script));
    cfg.output = OutputMode::Null;
    let out = launch(&cfg).unwrap();
    assert!(out.success(), "{out:?}");
    assert_eq!(out.exit_code(), 0);
    assert_ne!(out.master_port, 0);
    for r in 0..3 {
        let line = std::fs::read_to_string(dir.join(format!("rank_{r}"))).unwrap();
        assert_eq!(
            line.trim(),
            format!("{r} 3 {r} 3 127.0.0.1 {}", out.master_port)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_rank_ends_the_job_and_is_reported() {
    // Rank 1 fails with code 3; the others would run for a minute unless stopped.
    let mut cfg = LaunchConfig::new(
        3,
        sh("if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; sleep 60"),
    );
    cfg.output = OutputMode::Null;
    cfg.kill_grace = Duration::from_secs(5);
    let start = Instant::now();
    let out = launch(&cfg).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "others were not stopped"
    );
    let f = out.failure.as_ref().expect("a failure");
    assert_eq!(f.rank, 1);
    assert_eq!(f.status.code(), Some(3));
    assert_eq!(out.exit_code(), 3);
    assert!(f.to_string().contains("rank 1") && f.to_string().contains("exit code 3"));
    // The others ended by SIGTERM.
    use std::os::unix::process::ExitStatusExt;
    for r in [0, 2] {
        assert_eq!(out.statuses[r].signal(), Some(libc::SIGTERM), "rank {r}");
    }
}

#[test]
fn a_missing_command_is_an_error() {
    let mut cfg = LaunchConfig::new(2, vec!["/nonexistent/fsdp-comm-no-such-binary".into()]);
    cfg.output = OutputMode::Null;
    let e = launch(&cfg).unwrap_err();
    assert!(e.to_string().contains("starting rank 0"), "{e}");
    assert!(launch(&LaunchConfig::new(0, sh("true"))).is_err());
}

fn fsdp_run() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp-run"))
}

#[test]
fn the_binary_prefixes_output_and_propagates_failure() {
    let out = fsdp_run()
        .args(["--nproc", "2", "--", "sh", "-c", "echo hello from $RANK"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[rank 0] hello from 0"), "{stdout}");
    assert!(stdout.contains("[rank 1] hello from 1"), "{stdout}");

    let out = fsdp_run()
        .args([
            "--nproc",
            "2",
            "--master-port",
            "0",
            "--",
            "sh",
            "-c",
            "if [ \"$RANK\" = 0 ]; then echo bad >&2; exit 7; fi; sleep 60",
        ])
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
    let mut child = fsdp_run()
        .args(["--nproc", "2", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
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
    let mut launcher = fsdp_run()
        .args(["--nproc", "2", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let pids: Vec<i32> = loop {
        let read: Vec<Option<i32>> = (0..2)
            .map(|r| {
                std::fs::read_to_string(dir.join(format!("pid_{r}")))
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
            })
            .collect();
        if read.iter().all(Option::is_some) {
            break read.into_iter().flatten().collect();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Give `exec sleep` time to replace the shell, then kill the launcher without letting it clean up.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        pids.iter().all(|&p| is_running(p)),
        "ranks {pids:?} not running"
    );
    launcher.kill().unwrap(); // SIGKILL
    launcher.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
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
    assert!(alive.is_empty(), "ranks {alive:?} outlived the launcher");
    let _ = std::fs::remove_dir_all(&dir);
}
