//! What a user of the binaries can rely on (the CPU binaries `lm_fsdp` and `mnist_fsdp`): a committed
//! checkpoint is never overwritten silently; SIGINT / SIGTERM stop cleanly after the current step with a
//! checkpoint, and the resumed run is bit for bit the run that was not stopped; sizes, threads, head
//! dims, input paths and flags that cannot apply are refused before any work, naming the flag; weights
//! that are not finite are refused naming the tensor; a resume names the program that wrote a foreign
//! checkpoint, accepts a flag equal to the preset's value, and says when there is nothing left to train;
//! an export that cannot be written (a file size limit standing in for a full disk) names the flag, the
//! path and the operating system's error at one and two ranks, leaves no temporary file, and the
//! checkpoint saved before it holds the trained weights.

mod scratch;

use fsdp_examples::data::tokens::committed_shakespeare_slice_dir;
use scratch::scratch_dir;
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const LM: &str = env!("CARGO_BIN_EXE_lm_fsdp");
const MNIST: &str = env!("CARGO_BIN_EXE_mnist_fsdp");
const MLP: &str = env!("CARGO_BIN_EXE_mlp_bench");

/// A small, fast LM run on the committed slice: d 64, 1 block of 2 heads, sequences of 32.
fn lm_args() -> Vec<String> {
    let data = committed_shakespeare_slice_dir();
    [
        "--device",
        "cpu",
        "--no-progress",
        "--compact-vocab",
        "--d-model",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--max-val-batches",
        "2",
        "--threads-per-rank",
        "1",
        "--data",
        data.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn lm(extra: &[&str]) -> Output {
    Command::new(LM)
        .args(with(&lm_args(), extra))
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs and expects a refusal whose message holds every one of `words`, within `secs` seconds.
fn refused(bin: &str, args: &[String], words: &[&str], secs: u64) -> String {
    let t0 = Instant::now();
    let o = Command::new(bin).args(args).output().unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{args:?} was accepted:\n{t}");
    // A refusal is an error exit (1, or clap's 2), never a panic (101) or an abort (134).
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "{args:?}: exit {:?}, not a refusal:\n{t}",
        o.status
    );
    for w in words {
        assert!(t.contains(w), "{args:?}: no {w:?} in\n{t}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(secs),
        "{args:?}: refused only after {:?}",
        t0.elapsed()
    );
    t
}

/// `base` with the flags of `extra` replacing its own (a flag is followed by its value unless the next
/// token is a flag).
fn with(base: &[String], extra: &[&str]) -> Vec<String> {
    let mut v = base.to_vec();
    for flag in extra.iter().filter(|a| a.starts_with("--")) {
        v = without(&v, flag);
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// `base` without `flag` (and its value).
fn without(base: &[String], flag: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < base.len() {
        if base[i] == flag {
            let has_value = base.get(i + 1).is_some_and(|n| !n.starts_with("--"));
            i += if has_value { 2 } else { 1 };
            continue;
        }
        out.push(base[i].clone());
        i += 1;
    }
    out
}

#[test]
fn a_committed_checkpoint_is_not_overwritten_silently() {
    let dir = scratch_dir("overwrite");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let o = lm(&["--steps", "3", "--save", c, "--world-size", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    let args = with(
        &lm_args(),
        &["--steps", "2", "--save", c, "--world-size", "2"],
    );
    refused(
        LM,
        &args,
        &["--save", "step 3", "--resume", "--overwrite"],
        10,
    );
    let o = lm(&[
        "--steps",
        "2",
        "--save",
        c,
        "--world-size",
        "2",
        "--overwrite",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a run printing a line per step, waits for `step {at}:`, sends `signal`, and returns the exit
/// status and the output.
fn interrupt(args: &[String], at: u64, signal: i32) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(LM)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let mut lines = BufReader::new(stdout).lines();
    let want = format!("step {at}:");
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with(&want) {
            // SAFETY: kill(2) on the child we started; no memory is involved.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
            break;
        }
    }
    for line in lines {
        seen.push_str(&line.unwrap());
        seen.push('\n');
    }
    let status = child.wait().unwrap();
    (status, seen)
}

#[test]
fn a_signal_stops_after_the_step_saves_and_the_resume_is_bit_for_bit() {
    use std::os::unix::process::ExitStatusExt;
    for (signal, code, name) in [
        (libc::SIGINT, 130, "SIGINT"),
        (libc::SIGTERM, 143, "SIGTERM"),
    ] {
        let dir = scratch_dir(&format!("signal-{code}"));
        let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
        let common = with(
            &lm_args(),
            &["--steps", "24", "--world-size", "2", "--log-every", "1"],
        );
        let whole = Command::new(LM)
            .args(with(&common, &["--export", &path("whole.safetensors")]))
            .output()
            .unwrap();
        assert!(whole.status.success(), "{}", text(&whole));
        let (status, out) = interrupt(&with(&common, &["--save", &path("ckpt")]), 3, signal);
        assert_eq!(
            status.code(),
            Some(code),
            "{name}: {status:?} {:?}\n{out}",
            status.signal()
        );
        assert!(
            out.contains(&format!("stopped by {name} after step")) && out.contains("--resume"),
            "{out}"
        );
        let resumed = Command::new(LM)
            .args(with(
                &common,
                &[
                    "--resume",
                    &path("ckpt"),
                    "--save",
                    &path("ckpt"),
                    "--export",
                    &path("parts.safetensors"),
                ],
            ))
            .output()
            .unwrap();
        assert!(resumed.status.success(), "{}", text(&resumed));
        let read = |n: &str| std::fs::read(dir.join(n)).unwrap();
        assert!(
            read("whole.safetensors") == read("parts.safetensors"),
            "{name}: the resumed run's weights differ from the uninterrupted run's"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn sizes_threads_head_dims_and_flags_are_refused_before_work() {
    let base = lm_args();
    let cases: &[(&[&str], &[&str])] = &[
        (&["--batch-size", "100000000"], &["GiB", "--batch-size"]),
        (&["--batch-size", "4294967297"], &["--batch-size"]),
        (&["--batch-size", "18446744073709551615"], &["--batch-size"]),
        (
            &["--layers", "100000000"],
            &["GiB", "model state", "activations", "100000000 blocks"],
        ),
        (
            &["--threads-per-rank", "100000"],
            &["--threads-per-rank", "limit"],
        ),
        (
            &["--d-model", "65", "--heads", "5"],
            &["--d-model", "--heads", "head dim"],
        ),
        (
            &["--precision", "fp32", "--fp8-grad-comm"],
            &["--fp8-grad-comm", "fp32"],
        ),
        (
            &["--precision", "bf16", "--fp8-layers", "auto"],
            &["--fp8-layers"],
        ),
        // Every FP8 flag is refused where no linear is FP8, so the summary never names one unused.
        (
            &["--precision", "bf16", "--fp8-scaling", "current"],
            &["--fp8-scaling", "bf16"],
        ),
        (
            &["--precision", "fp32", "--fp8-margin", "2"],
            &["--fp8-margin", "fp32"],
        ),
        (
            &["--precision", "fp32", "--optimizer-states", "f32"],
            &["--optimizer-states", "fp32"],
        ),
        (
            &["--fp8-layers", "none", "--fp8-grad-comm"],
            &["--fp8-grad-comm", "--fp8-layers none"],
        ),
        (
            &["--fp8-scaling", "current", "--fp8-amax-history", "4"],
            &["--fp8-amax-history", "--fp8-scaling current"],
        ),
        (
            &["--precision", "bf16", "--recipe", "block"],
            &["--recipe", "bf16"],
        ),
        // Block scaling has no per-tensor history or margin to set.
        (
            &["--recipe", "block", "--fp8-margin", "1"],
            &["--fp8-margin", "--recipe block"],
        ),
        (
            &["--recipe", "block", "--fp8-scaling", "delayed"],
            &["--fp8-scaling", "--recipe block"],
        ),
        // Sizes near 2^64 are refused naming the flag, never an arithmetic panic.
        (
            &["--d-model", "18446744073709551615"],
            &["--d-model", "too large"],
        ),
        (&["--seq-len", "18446744073709551615"], &["--seq-len"]),
        (
            &["--layers", "18446744073709551615"],
            &["--layers", "overflows"],
        ),
        (
            &[
                "--metrics",
                "/tmp/x.jsonl",
                "--plot",
                "/tmp/x.svg",
                "--compare",
                "/nonexistent.jsonl",
            ],
            &["--compare", "/nonexistent.jsonl"],
        ),
        (
            &["--init-from", "/nonexistent.safetensors"],
            &["--init-from"],
        ),
        (&["--steps", "5", "--epochs", "2"], &["--steps", "--epochs"]),
        (
            &["--stop-after-steps", "5", "--steps", "5"],
            &["--stop-after-steps"],
        ),
    ];
    for (args, words) in cases {
        refused(LM, &with(&base, args), words, 20);
    }
    // Outputs renamed into place never replace a link; --compare files are read before training.
    let dir = scratch_dir("paths");
    std::fs::write(dir.join("target"), b"keep").unwrap();
    std::os::unix::fs::symlink(dir.join("target"), dir.join("link")).unwrap();
    std::fs::write(dir.join("empty.jsonl"), b"").unwrap();
    std::fs::write(dir.join("garbage.jsonl"), [0xffu8, 0xfe, 0x00, 0x80]).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    refused(
        LM,
        &with(&base, &["--export", &p("link")]),
        &["--export", "symbolic link"],
        20,
    );
    assert_eq!(std::fs::read(dir.join("target")).unwrap(), b"keep");
    for (file, word) in [("empty.jsonl", "no metrics records"), ("garbage.jsonl", "")] {
        let args = with(
            &base,
            &[
                "--metrics",
                &p("m.jsonl"),
                "--plot",
                &p("m.svg"),
                "--compare",
                &p(file),
            ],
        );
        let out = refused(LM, &args, &["--compare", file, word], 20);
        assert!(
            !out.contains("step 1:"),
            "refused only after training:\n{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    // The MLP bench's thread ranks are capped like the Trainer's (2^64 - 1 once panicked).
    for threads in ["100000", "18446744073709551615"] {
        refused(
            MLP,
            &["--device", "cpu", "--threads", threads].map(String::from),
            &["--threads", "limit"],
            10,
        );
    }
    // MNIST: zero epochs, and no silent nothing.
    refused(
        MNIST,
        &["--subset", "--device", "cpu", "--epochs", "0"].map(String::from),
        &["--epochs"],
        10,
    );
}

#[test]
fn weights_that_are_not_finite_are_refused_naming_the_tensor() {
    let dir = scratch_dir("nan");
    let good = dir.join("good.safetensors");
    let o = lm(&["--steps", "1", "--export", good.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let bytes = std::fs::read(&good).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    for (name, _, data) in &mut tensors {
        if name == "h.0.c_fc.weight" {
            data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, safetensors::serialize(views, None).unwrap()).unwrap();
    refused(
        LM,
        &with(
            &lm_args(),
            &["--steps", "1", "--init-from", bad.to_str().unwrap()],
        ),
        &["--init-from", "h.0.c_fc.weight", "non-finite"],
        20,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resumes_name_the_writer_accept_preset_values_and_say_when_done() {
    let dir = scratch_dir("resume");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let o = lm(&["--steps", "2", "--save", c]);
    assert!(o.status.success(), "{}", text(&o));
    // --d-model 64 is the run's own value: no change.
    let o = lm(&[
        "--steps",
        "3",
        "--resume",
        c,
        "--save",
        c,
        "--d-model",
        "64",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // At or past --steps: nothing to train, said so, success.
    let o = lm(&["--steps", "3", "--resume", c]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("nothing to train"), "{}", text(&o));
    // Another program's checkpoint is named as such.
    refused(
        MNIST,
        &[
            "--subset",
            "--device",
            "cpu",
            "--limit-batches",
            "1",
            "--resume",
            c,
        ]
        .map(String::from),
        &["written by lm_fsdp", "mnist_fsdp"],
        20,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs lm_fsdp with `args` under a file size limit of `limit` bytes (`RLIMIT_FSIZE`), with `SIGXFSZ`
/// ignored so that a write past the limit fails with EFBIG ("File too large") as on a full disk,
/// instead of killing the process.
fn lm_with_file_limit(args: &[String], limit: u64) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(LM);
    cmd.args(args);
    // SAFETY: the closure runs in the child between fork and exec and calls only async-signal-safe
    // functions (signal, setrlimit) on values on its own stack; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: limit as libc::rlim_t,
                rlim_max: limit as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().unwrap()
}

/// Sizes of the files of `ckpt`'s committed generation.
fn rank_file_sizes(ckpt: &std::path::Path) -> Vec<u64> {
    let commit = fsdp_shard::checkpoint::read_commit(ckpt).unwrap();
    (0..commit.world_size)
        .map(|r| std::fs::metadata(commit.shard_file(r)).unwrap().len())
        .collect()
}

/// Entries of `dir` that a failed write of `name` could have left: the file or a temporary of it.
fn leftovers(dir: &std::path::Path, name: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n == name || (n.contains(name) && n.contains(".tmp")))
        .collect()
}

#[test]
fn an_export_that_cannot_be_written_names_the_os_error_and_the_weights_survive() {
    let dir = scratch_dir("efbig");
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    // FP8 linears dominate this model and their low-precision states take 3 bytes a weight, so each of
    // the two ranks' checkpoint files is smaller than the F32 export (4 bytes a parameter): a file size
    // limit between the two lets the --save files be written but not the --export file.
    let base = with(
        &lm_args(),
        &[
            "--d-model",
            "128",
            "--layers",
            "16",
            "--steps",
            "2",
            "--world-size",
            "2",
            "--optimizer-states",
            "low",
        ],
    );
    let free = Command::new(LM)
        .args(with(
            &base,
            &[
                "--save",
                &path("free"),
                "--export",
                &path("free.safetensors"),
            ],
        ))
        .output()
        .unwrap();
    assert!(free.status.success(), "{}", text(&free));
    let export_size = std::fs::metadata(path("free.safetensors")).unwrap().len();
    let ranks = rank_file_sizes(&dir.join("free"));
    assert_eq!(ranks.len(), 2);
    let largest = ranks.iter().copied().max().unwrap();
    assert!(
        largest < export_size,
        "rank files {ranks:?} are not smaller than the export ({export_size} bytes)"
    );
    let limit = largest + (export_size - largest) / 2;

    let o = lm_with_file_limit(
        &with(
            &base,
            &["--save", &path("ckpt"), "--export", &path("w.safetensors")],
        ),
        limit,
    );
    let t = text(&o);
    assert!(
        !o.status.success(),
        "the export past the limit succeeded:\n{t}"
    );
    let named = format!("--export {}", path("w.safetensors"));
    for w in [
        named.as_str(),
        "File too large",
        "os error 27",
        "the trained weights are in the --save checkpoint",
    ] {
        assert!(t.contains(w), "no {w:?} in\n{t}");
    }
    assert!(
        leftovers(&dir, "w.safetensors").is_empty(),
        "left beside the export: {:?}",
        leftovers(&dir, "w.safetensors")
    );
    // The checkpoint was saved before the export: committed, each file within the limit, at the last
    // step, so a resume to the same step has nothing to train.
    let saved = rank_file_sizes(&dir.join("ckpt"));
    assert!(saved.iter().all(|&s| s <= limit), "{saved:?} over {limit}");
    let resumed = Command::new(LM)
        .args(with(&base, &["--resume", &path("ckpt")]))
        .output()
        .unwrap();
    let r = text(&resumed);
    assert!(resumed.status.success(), "{r}");
    assert!(
        r.contains("nothing to train") && r.contains("at step 2"),
        "{r}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failed_export_names_the_os_error_at_one_and_two_ranks() {
    for ws in ["1", "2"] {
        let dir = scratch_dir(&format!("efbig-ws{ws}"));
        let out = dir.join("w.safetensors");
        let o = lm_with_file_limit(
            &with(
                &lm_args(),
                &[
                    "--steps",
                    "1",
                    "--world-size",
                    ws,
                    "--export",
                    out.to_str().unwrap(),
                ],
            ),
            // The export of this model is about 1.8 MB; nothing else this run writes comes near 64 KiB.
            64 << 10,
        );
        let t = text(&o);
        assert!(!o.status.success(), "--world-size {ws}: accepted:\n{t}");
        let named = format!("--export {}", out.display());
        for w in [named.as_str(), "File too large", "os error 27"] {
            assert!(t.contains(w), "--world-size {ws}: no {w:?} in\n{t}");
        }
        assert!(
            !t.contains("could not write the export"),
            "--world-size {ws}: another rank's error was reported instead of rank 0's:\n{t}"
        );
        assert!(
            leftovers(&dir, "w.safetensors").is_empty(),
            "--world-size {ws}: {:?}",
            leftovers(&dir, "w.safetensors")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn non_finite_steps_stop_the_run_after_the_stated_limit() {
    // lr 1e30 drives the weights out of range after the first step: every later gradient is
    // non-finite, each such step is skipped, and the third in a row stops the run naming the flag.
    let out = refused(
        LM,
        &with(
            &lm_args(),
            &[
                "--lr",
                "1e30",
                "--steps",
                "30",
                "--max-skipped-steps",
                "3",
                "--log-every",
                "1",
            ],
        ),
        &["3 consecutive steps", "non-finite", "--max-skipped-steps 3"],
        60,
    );
    assert!(!out.contains("step 30:"), "{out}");
}
