//! The launcher as a library (`fsdp_comm::launch`), with `sh -c` children. The `fsdp-run` binary is tested
//! in its own crate.

use fsdp_comm::launch::{launch, LaunchConfig, OutputMode};
use std::ffi::OsString;
use std::path::PathBuf;
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
