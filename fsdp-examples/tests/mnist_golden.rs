//! Regression of the MNIST training numerics: the per-micro-batch losses of 50 steps on the committed
//! subset, 2 thread ranks, FP8 and F32, against the bit patterns recorded in
//! `testdata/golden/mnist_step_losses.txt` (`FSDP_WRITE_GOLDEN=1 cargo test --release -p fsdp-examples
//! --test mnist_golden` rewrites it). Any change to an order of operations, a rounding or a data order
//! shows up here as a different bit pattern.
//!
//! The CPU F32 GEMM is the `gemm` crate's, which picks its kernel (AVX-512, FMA, scalar) and its blocking
//! (from the cache sizes) at run time, so its sums round differently on different machines. The file
//! records a fingerprint of that arithmetic (the bits of a set of GEMMs at the net's shapes). Where this
//! machine's fingerprint is the recorded one, every loss must match bit for bit. Elsewhere the FP8 losses
//! still must (their GEMM operands are FP8 codes, whose products and sums come out the same on every
//! machine we have run), and the F32 losses must agree within what the GEMM's rounding alone explains: 5e-5
//! relative over the first 10 steps, 5e-2 over all 50 (between the record of an earlier machine and an FMA
//! machine without AVX2: 5.0e-6 and 5.9e-3), where a wrong gradient or data order is off by far more from
//! the first steps on.

use fp8_kernels::gemm::gemm_f32;
use fp8_kernels::{Buffer, CpuParallelism, Device, GemmSpec, Transpose};
use fsdp_examples::data::committed_subset_dir;
use fsdp_examples::mnist::{MnistOptions, MnistTask};
use fsdp_train::{DeviceChoice, Precision, RunLength, TrainConfig, Trainer};
use std::fmt::Write as _;
use std::path::PathBuf;

const STEPS: u64 = 50;
const WORLD_SIZE: usize = 2;
/// The recorded file's first line: this prefix and the fingerprint in hex.
const FINGERPRINT_PREFIX: &str = "# cpu f32 gemm fingerprint ";
/// F32 losses on a machine whose GEMM rounds differently: relative tolerance over the first
/// `EARLY_STEPS` steps and over all of them.
const EARLY_STEPS: u64 = 10;
const EARLY_TOLERANCE: f64 = 5e-5;
const LATE_TOLERANCE: f64 = 5e-2;

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/golden/mnist_step_losses.txt")
}

/// `precision rank step bits` lines of one run.
fn run(precision: Precision, name: &str) -> String {
    let task = MnistTask::new(MnistOptions {
        batch_size: 16,
        test_batch_size: 250,
        data_dir: committed_subset_dir(),
        ..MnistOptions::default()
    })
    .expect("the committed subset");
    let mut config = TrainConfig::new(RunLength::Epochs(1));
    config.precision = precision;
    config.world_size = WORLD_SIZE;
    config.device = DeviceChoice::Cpu;
    config.threads_per_rank = Some(1);
    config.stop_after_steps = Some(STEPS);
    let report = Trainer::new(config)
        .run(&task)
        .expect("training on the committed subset");
    assert_eq!(report.steps, STEPS);
    assert_eq!(report.step_losses.len(), WORLD_SIZE);
    let mut out = String::new();
    for (rank, losses) in report.step_losses.iter().enumerate() {
        assert_eq!(losses.len() as u64, STEPS, "one loss per micro-batch");
        for (step, l) in losses.iter().enumerate() {
            assert!(l.is_finite());
            writeln!(out, "{name} {rank} {step} {:08x}", l.to_bits()).expect("string write");
        }
    }
    out
}

/// FNV-1a over the bits of CPU F32 GEMMs at the net's shapes (fc1, fc2 and the second convolution's
/// im2col product, forward and both gradients, single-threaded as the ranks run them): equal
/// fingerprints mean the same kernel and blocking, hence the same roundings.
fn gemm_fingerprint() -> u64 {
    let shapes = [
        // (m, n, k, trans_a, trans_b)
        (16, 128, 9216, Transpose::No, Transpose::Yes),
        (16, 9216, 128, Transpose::No, Transpose::No),
        (128, 9216, 16, Transpose::Yes, Transpose::No),
        (16, 10, 128, Transpose::No, Transpose::Yes),
        (576, 64, 288, Transpose::No, Transpose::Yes),
        (64, 288, 576, Transpose::Yes, Transpose::No),
    ];
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut state: u32 = 0x9e37_79b9;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    let dev = Device::cpu();
    for (m, n, k, ta, tb) in shapes {
        let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let b: Vec<f32> = (0..k * n).map(|_| next()).collect();
        let a = dev.upload(&a).expect("cpu upload");
        let b = dev.upload(&b).expect("cpu upload");
        let mut c: Buffer<f32> = dev.zeros(m * n).expect("cpu buffer");
        let spec = GemmSpec {
            trans_a: ta,
            trans_b: tb,
            parallelism: CpuParallelism::Single,
            ..GemmSpec::new(m, n, k)
        };
        gemm_f32(&spec, &a, &b, &mut c).expect("cpu gemm");
        for v in c.to_vec().expect("cpu buffer") {
            for byte in v.to_bits().to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    hash
}

/// `(precision, rank, step, value)` of a `precision rank step bits` line.
fn parse(line: &str) -> Option<(&str, u64, u64, f32)> {
    let mut it = line.split(' ');
    let (name, rank, step, bits) = (it.next()?, it.next()?, it.next()?, it.next()?);
    Some((
        name,
        rank.parse().ok()?,
        step.parse().ok()?,
        f32::from_bits(u32::from_str_radix(bits, 16).ok()?),
    ))
}

#[test]
fn fifty_steps_reproduce_the_recorded_losses_bit_for_bit() {
    let mut now = run(Precision::Fp8, "fp8");
    now.push_str(&run(Precision::Fp32, "f32"));
    let fingerprint = format!("{:016x}", gemm_fingerprint());
    let path = golden_path();
    if std::env::var_os("FSDP_WRITE_GOLDEN").is_some() {
        std::fs::write(&path, format!("{FINGERPRINT_PREFIX}{fingerprint}\n{now}"))
            .expect("write the golden file");
        eprintln!("wrote {}", path.display());
        return;
    }
    let golden = std::fs::read_to_string(&path).expect("golden file is committed");
    let (first, golden) = golden
        .split_once('\n')
        .expect("the golden file starts with its fingerprint line");
    let recorded = first.strip_prefix(FINGERPRINT_PREFIX).unwrap_or_else(|| {
        panic!("the golden file's first line is its fingerprint, not {first:?}")
    });
    let same_gemm = recorded == fingerprint;
    if !same_gemm {
        eprintln!(
            "this machine's F32 GEMM rounds differently (fingerprint {fingerprint}, recorded \
             {recorded}): FP8 losses compared bit for bit, F32 within {EARLY_TOLERANCE} relative over \
             the first {EARLY_STEPS} steps and {LATE_TOLERANCE} over all"
        );
    }
    assert_eq!(
        golden.lines().count(),
        now.lines().count(),
        "number of losses"
    );
    let mut mismatches = Vec::new();
    let mut worst = 0.0f64;
    for (g, n) in golden.lines().zip(now.lines()) {
        let (Some((gname, grank, gstep, gv)), Some((name, rank, step, v))) = (parse(g), parse(n))
        else {
            panic!("unreadable loss line: recorded {g:?}, now {n:?}");
        };
        assert_eq!(
            (gname, grank, gstep),
            (name, rank, step),
            "the lines' order"
        );
        let exact = same_gemm || name == "fp8";
        let ok = if exact {
            g == n
        } else {
            let rel = f64::from((gv - v).abs()) / f64::from(gv.abs()).max(f64::MIN_POSITIVE);
            worst = worst.max(rel);
            let tolerance = if step < EARLY_STEPS {
                EARLY_TOLERANCE
            } else {
                LATE_TOLERANCE
            };
            rel <= tolerance
        };
        if !ok {
            mismatches.push(format!("recorded {g} ({gv}), now {n} ({v})"));
        }
    }
    if !same_gemm {
        eprintln!("largest relative difference of the F32 losses: {worst:.2e}");
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} losses differ; first: {:?}",
        mismatches.len(),
        now.lines().count(),
        &mismatches[..mismatches.len().min(5)]
    );
}
