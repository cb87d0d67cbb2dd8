//! The `fsdp-run` binary, with `sh -c` children: output prefixes, failure propagation, signal forwarding,
//! and ranks that die with the launcher.

use std::path::PathBuf;
use std::process::Command;
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
