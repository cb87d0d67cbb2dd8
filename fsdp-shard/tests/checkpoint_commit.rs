//! Crash consistency of sharded checkpoints: a save stopped after any file operation loads as the
//! previous checkpoint or the new one, never a mix; mixes made by hand are refused naming the file;
//! leftovers of interrupted saves go at the next save; edited metadata is refused; one writer per
//! directory.

mod common;

use common::*;
use fsdp_comm::{run_ranks, run_ranks_failures, Communicator, ThreadComm};
use fsdp_shard::checkpoint::{
    check_replaceable_file, check_writable_dir, check_writable_file, load_sharded, read_commit,
    save_full, save_sharded, save_sharded_with, write_atomic, CheckpointLock, FullWeights,
    SaveOptions, StopAfter, LOCK_FILE,
};
use fsdp_shard::{FsdpConfig, ShardError, ShardedModel, WrapPolicy};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WS: usize = 2;
const BATCH: usize = 8;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "fsdp-commit-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn step_extra(step: u64) -> BTreeMap<String, String> {
    BTreeMap::from([("step".to_string(), step.to_string())])
}

fn new_model(comm: ThreadComm) -> Result<(ShardedModel, Sgd), ShardError> {
    let comm: Arc<dyn Communicator> = Arc::new(comm);
    let layout = layout(true, WrapPolicy::MinParams(100));
    let (model, masters) = ShardedModel::new(layout, comm, FsdpConfig::default(), &init)?;
    Ok((model, Sgd { lr: 0.05, masters }))
}

fn train_step(model: &mut ShardedModel, sgd: &mut Sgd, step: u64) -> Result<(), ShardError> {
    let (rank, ws) = (model.comm().rank(), model.comm().world_size());
    let (x, t) = batch(step, BATCH);
    let r = local_rows(rank, ws, BATCH);
    forward_backward_rows(model, (&x, &t), r, BATCH)?;
    sgd.step(model)
}

/// Parameters and optimizer state of a rank.
type State = (Vec<Vec<f32>>, Vec<Vec<f32>>);

fn state_of(model: &mut ShardedModel, sgd: &Sgd) -> Result<State, ShardError> {
    Ok((snapshot(model)?.0, sgd.masters.clone()))
}

/// Sorted names in `dir`.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Saves step 1 (committed), then step 2 with `stop`; loads what is on disk, which must be step 1 or
/// step 2 exactly; then saves step 3, which must leave one generation and no leftovers.
fn stopped_save_round(dir: &Path, stop: Arc<StopAfter>) {
    let _ = std::fs::remove_dir_all(dir);
    let out = run_ranks(WS, |comm: ThreadComm| {
        let (mut model, mut sgd) = new_model(comm)?;
        train_step(&mut model, &mut sgd, 0)?;
        save_sharded(dir, &model, Some(&sgd), &step_extra(1))?;
        let old = state_of(&mut model, &sgd)?;
        train_step(&mut model, &mut sgd, 1)?;
        let new = state_of(&mut model, &sgd)?;
        let options = SaveOptions {
            stop_after: Some(stop.clone()),
        };
        let saved = save_sharded_with(dir, &model, Some(&sgd), &step_extra(2), &options);
        let loaded = load_sharded(dir, &mut model, Some(&mut sgd))?;
        let got = state_of(&mut model, &sgd)?;
        let step = loaded.extra["step"].clone();
        save_sharded(dir, &model, Some(&sgd), &step_extra(3))?;
        Ok::<_, ShardError>((saved.is_ok(), old, new, got, step))
    })
    .unwrap_or_else(|e| panic!("after {:?}: {e}", stop.performed()));
    for (rank, (saved, old, new, got, step)) in out.into_iter().enumerate() {
        let ctx = || format!("rank {rank} after {:?}", stop.performed());
        match step.as_str() {
            "1" => assert!(got == old, "step 1 with other state: {}", ctx()),
            "2" => assert!(got == new, "step 2 with other state: {}", ctx()),
            s => panic!("loaded step {s}: {}", ctx()),
        }
        if saved {
            assert_eq!(
                step,
                "2",
                "a save that succeeded was not committed: {}",
                ctx()
            );
        }
    }
    // The step-3 save removed every leftover: one generation, complete, no temporaries.
    let commit = read_commit(dir).unwrap();
    assert_eq!(commit.extra["step"], "3");
    let gen_name = commit
        .generation_dir()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert_eq!(
        listing(dir),
        vec![LOCK_FILE.to_string(), gen_name, "index.json".to_string()],
        "after {:?}",
        stop.performed()
    );
    assert_eq!(
        listing(&commit.generation_dir()),
        vec![
            "rank-00000-of-00002.safetensors",
            "rank-00001-of-00002.safetensors"
        ]
    );
}

#[test]
fn a_save_stopped_after_any_file_operation_loads_as_the_old_or_the_new_step() {
    let dir = temp_dir("stop");
    type Hook = fn(usize) -> StopAfter;
    let scopes: [(&str, Hook); 3] = [
        ("all ranks", StopAfter::all_ranks),
        ("rank 0", |k| StopAfter::rank(0, k)),
        ("rank 1", |k| StopAfter::rank(1, k)),
    ];
    for (name, hook) in scopes {
        let mut k = 0;
        loop {
            let stop = Arc::new(hook(k));
            stopped_save_round(&dir, stop.clone());
            if !stop.stopped() {
                // k operations were all the save needed: every stopping point has been tried.
                assert!(k >= 5, "{name}: only {k} file operations");
                eprintln!("{name}: stopped after each of {k} file operations");
                break;
            }
            k += 1;
            assert!(k < 100, "{name}: the save never completes");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Saves `steps` in turn into `dir` (2 ranks); returns the bytes of rank 1's file after each save.
fn save_steps(dir: &Path, steps: &[u64]) -> Vec<Vec<u8>> {
    let mut files = Vec::new();
    for &s in steps {
        run_ranks(WS, |comm: ThreadComm| {
            let (mut model, mut sgd) = new_model(comm)?;
            for i in 0..s.min(3) {
                train_step(&mut model, &mut sgd, i)?;
            }
            save_sharded(dir, &model, Some(&sgd), &step_extra(s))
        })
        .unwrap();
        files.push(std::fs::read(read_commit(dir).unwrap().shard_file(1)).unwrap());
    }
    files
}

fn load_error(dir: &Path) -> String {
    let r = run_ranks(WS, |comm: ThreadComm| {
        let (mut model, mut sgd) = new_model(comm)?;
        load_sharded(dir, &mut model, Some(&mut sgd)).map(|l| l.extra)
    });
    match r {
        Ok(extra) => panic!("loaded {extra:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_mix_of_two_saves_is_refused_naming_the_file() {
    // Step 8's rank-1 file inside step 9's checkpoint (the hand-made mix of the issue).
    let dir = temp_dir("mix");
    let files = save_steps(&dir, &[8, 9]);
    let f1 = read_commit(&dir).unwrap().shard_file(1);
    std::fs::write(&f1, &files[0]).unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.contains("rank-00001-of-00002") && msg.contains("mix two saves"),
        "{msg}"
    );
    // A rank file of the same generation number from another directory's save.
    let other = temp_dir("mix-other");
    let other_files = save_steps(&other, &[9, 9]);
    std::fs::write(&f1, &other_files[1]).unwrap();
    assert_eq!(
        read_commit(&dir).unwrap().generation,
        read_commit(&other).unwrap().generation
    );
    let msg = load_error(&dir);
    assert!(msg.contains("mix two saves"), "{msg}");
    std::fs::write(&f1, &files[1]).unwrap();
    assert!(load_sharded_ok(&dir));
    for d in [dir, other] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

fn load_sharded_ok(dir: &Path) -> bool {
    run_ranks(WS, |comm: ThreadComm| {
        let (mut model, mut sgd) = new_model(comm)?;
        load_sharded(dir, &mut model, Some(&mut sgd))
    })
    .is_ok()
}

/// Replaces the first occurrence of `from` by `to` in the file at `path`.
fn edit_file(path: &Path, from: &str, to: &str) {
    let bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .unwrap_or_else(|| panic!("{from} not in {}", path.display()));
    let mut out = bytes[..at].to_vec();
    out.extend_from_slice(to.as_bytes());
    out.extend_from_slice(&bytes[at + from.len()..]);
    std::fs::write(path, out).unwrap();
}

#[test]
fn edited_metadata_is_refused_naming_the_file() {
    let dir = temp_dir("edit");
    save_steps(&dir, &[9]);
    let f1 = read_commit(&dir).unwrap().shard_file(1);
    let good = std::fs::read(&f1).unwrap();
    // user.step of rank 1, edited by hand: valid JSON, valid safetensors, same length.
    edit_file(&f1, "\"user.step\":\"9\"", "\"user.step\":\"8\"");
    let msg = load_error(&dir);
    assert!(
        msg.contains("rank-00001-of-00002") && msg.contains("header"),
        "{msg}"
    );
    std::fs::write(&f1, &good).unwrap();
    // The index's copy of the key/values.
    let index = dir.join("index.json");
    edit_file(&index, "\"step\": \"9\"", "\"step\": \"8\"");
    let msg = load_error(&dir);
    assert!(
        msg.contains("index.json") && msg.contains("corrupt or was edited"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn leftovers_of_interrupted_saves_are_removed_at_the_next_save() {
    let dir = temp_dir("leftovers");
    save_steps(&dir, &[1]);
    let committed = read_commit(&dir).unwrap().generation_dir();
    // An interrupted save's generation (with a half-written temporary) and index temporary, and one
    // generation number far ahead.
    let stale = dir.join("gen-00000007");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(
        stale.join(".rank-00000-of-00002.safetensors.tmp-999999"),
        b"x",
    )
    .unwrap();
    std::fs::write(dir.join(".index.json.tmp-999999"), vec![7u8; 1000]).unwrap();
    assert!(
        load_sharded_ok(&dir),
        "leftovers do not disturb the committed checkpoint"
    );
    save_steps(&dir, &[2]);
    let commit = read_commit(&dir).unwrap();
    assert_eq!(commit.generation, 8, "never reuses a generation number");
    assert!(!committed.exists() && !stale.exists());
    assert_eq!(listing(&dir), vec![LOCK_FILE, "gen-00000008", "index.json"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

const HOLDER_ENV: &str = "FSDP_SHARD_TEST_LOCK_HOLDER";

/// The body of the second process of `a_second_writer_is_refused_naming_the_holder` (does nothing in a
/// normal test run).
#[test]
fn lock_holder_process() {
    let Ok(dir) = std::env::var(HOLDER_ENV) else {
        return;
    };
    let _lock = CheckpointLock::acquire(&dir).unwrap();
    std::fs::write(Path::new(&dir).join("holder-ready"), b"").unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_second_writer_is_refused_naming_the_holder() {
    let dir = temp_dir("lock");
    // In this process: the second acquisition fails naming this process.
    {
        let _lock = CheckpointLock::acquire(&dir).unwrap();
        let msg = CheckpointLock::acquire(&dir).unwrap_err().to_string();
        let me = std::process::id();
        assert!(
            msg.contains(&format!("process {me} (this process)")),
            "{msg}"
        );
        // Saves of this process go ahead under its own lock.
        save_steps(&dir, &[1]);
    }
    // Another process holds the directory, as a second run would.
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["lock_holder_process", "--exact", "--test-threads=1"])
        .env(HOLDER_ENV, &dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let pid = child.0.id();
    let start = Instant::now();
    while !dir.join("holder-ready").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "holder did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(CheckpointLock::holder(&dir), Some(pid));
    let msg = CheckpointLock::acquire(&dir).unwrap_err().to_string();
    assert!(
        msg.contains(&format!("process {pid}")) && msg.contains("in use"),
        "{msg}"
    );
    // A save without the lock is refused on every rank, naming the holder; the checkpoint stays.
    let err = run_ranks(WS, |comm: ThreadComm| {
        let (model, sgd) = new_model(comm)?;
        save_sharded(&dir, &model, Some(&sgd), &step_extra(2))
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains(&format!("process {pid}")), "{err}");
    assert_eq!(read_commit(&dir).unwrap().extra["step"], "1");
    assert!(load_sharded_ok(&dir), "reading needs no lock");
    // The lock goes with its holder, however it ends.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    assert_eq!(CheckpointLock::holder(&dir), None);
    drop(CheckpointLock::acquire(&dir).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn output_paths_are_probed_before_a_run() {
    let dir = temp_dir("probe");
    // A directory where a file is wanted (`--metrics DIR`).
    std::fs::create_dir_all(dir.join("metrics.jsonl")).unwrap();
    let msg = check_writable_file(dir.join("metrics.jsonl"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("metrics.jsonl") && msg.contains("is a directory"),
        "{msg}"
    );
    // A new file in a new directory: fine, and nothing is left behind but the directory.
    check_writable_file(dir.join("new/m.jsonl")).unwrap();
    assert!(listing(&dir.join("new")).is_empty());
    // An existing file keeps its content.
    std::fs::write(dir.join("old.jsonl"), b"line\n").unwrap();
    check_writable_file(dir.join("old.jsonl")).unwrap();
    assert_eq!(std::fs::read(dir.join("old.jsonl")).unwrap(), b"line\n");
    // A file in place of a directory, and a file under a file.
    let msg = check_writable_dir(dir.join("old.jsonl"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("old.jsonl") && msg.contains("not a directory"),
        "{msg}"
    );
    assert!(check_writable_file(dir.join("old.jsonl/x")).is_err());
    check_writable_dir(dir.join("ckpt")).unwrap();
    assert!(listing(&dir.join("ckpt")).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_save_reports_the_failing_rank_as_the_cause() {
    let dir = temp_dir("cause");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("plain-file"), b"").unwrap();
    // A full checkpoint under a regular file: rank 0 cannot write it; rank 1 learns so and fails too.
    let path = dir.join("plain-file/full.safetensors");
    let failures = run_ranks_failures(WS, Duration::from_secs(60), |comm: ThreadComm| {
        let (mut model, _) = new_model(comm)?;
        save_full(&path, &mut model, FullWeights::F32, &BTreeMap::new())
    })
    .unwrap_err();
    assert_eq!(failures.rank, 0, "{failures}");
    assert!(
        failures.error.to_string().contains("plain-file"),
        "{failures}"
    );
    assert_eq!(failures.others.len(), 1);
    assert!(
        failures.others[0].1.to_string().contains("not saved"),
        "{failures}"
    );
    // A sharded save whose rank 1 fails: rank 1's error is the cause, rank 0's "not saved" follows.
    let ckpt = dir.join("ckpt");
    let failures = run_ranks_failures(WS, Duration::from_secs(60), |comm: ThreadComm| {
        let (model, sgd) = new_model(comm)?;
        let options = SaveOptions {
            stop_after: Some(Arc::new(StopAfter::rank(1, 0))),
        };
        save_sharded_with(&ckpt, &model, Some(&sgd), &step_extra(1), &options)
    })
    .unwrap_err();
    assert_eq!(failures.rank, 1, "{failures}");
    assert!(
        failures.error.to_string().contains("test hook"),
        "{failures}"
    );
    assert!(
        failures.others[0]
            .1
            .to_string()
            .contains("rank(s) [1] failed"),
        "{failures}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_renamed_into_place_never_replaces_a_link_or_a_special_file() {
    let dir = temp_dir("special");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("target.bin"), b"keep").unwrap();
    std::os::unix::fs::symlink(dir.join("target.bin"), dir.join("link.bin")).unwrap();
    let socket = std::os::unix::net::UnixListener::bind(dir.join("sock")).unwrap();
    for (name, what) in [
        ("link.bin", "symbolic link"),
        ("sock", "not a regular file"),
    ] {
        let path = dir.join(name);
        let msg = check_replaceable_file(&path).unwrap_err().to_string();
        assert!(msg.contains(name) && msg.contains(what), "{msg}");
        // The writer itself refuses too (a library caller may skip the check).
        let msg = write_atomic(&path, b"new").unwrap_err().to_string();
        assert!(msg.contains(what), "{msg}");
    }
    drop(socket);
    assert!(std::fs::symlink_metadata(dir.join("link.bin"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(dir.join("target.bin")).unwrap(), b"keep");
    // Regular files (existing or new) are fine, as with check_writable_file.
    check_replaceable_file(dir.join("target.bin")).unwrap();
    check_replaceable_file(dir.join("new.bin")).unwrap();
    write_atomic(&dir.join("target.bin"), b"new").unwrap();
    assert_eq!(std::fs::read(dir.join("target.bin")).unwrap(), b"new");
    std::fs::remove_dir_all(&dir).unwrap();
}
