//! Checks every collective and element type of the NCCL backend against the thread backend.
//!
//! Run through the launcher on a GPU machine: `fsdp-run --nproc N -- nccl_check` (N GPUs). Each rank
//! builds every rank's inputs from a fixed seed, so it can run the same collective on N thread ranks in
//! process and compare its own NCCL output with the reference:
//! - gathers, broadcasts, all-to-alls (the variable-count forms too), max and min: bit for bit;
//! - sums on one rank: bit for bit (NCCL copies);
//! - sums on several ranks: within the per-step rounding bound against the exact sum (NCCL may pick
//!   another order or algorithm than the emulated ring); the share of bit-exact matches with the
//!   emulation is printed for information.
//!
//! Prints one PASS/FAIL line per check and exits non-zero if any check failed, and also without NCCL or a
//! GPU (saying why: nothing was checked). Options: `--timeout SECONDS` (default 120), `--skip-init-timeout-check`.

use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, Device};
use fsdp_comm::nccl::{nccl_library_status, NcclComm, NcclConfig};
use fsdp_comm::ring::fp8_unit_roundoff;
use fsdp_comm::{
    run_ranks_timeout, CommDType, CommError, Communicator, DistEnv, RecvBuf, ReduceOp, SendBuf,
};
use half::{bf16, f16};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const KINDS: [CommDType; 6] = [
    CommDType::F32,
    CommDType::BF16,
    CommDType::F16,
    CommDType::Bytes,
    CommDType::Fp8(Fp8Format::E4M3),
    CommDType::Fp8(Fp8Format::E5M2),
];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    AllGather,
    AllGatherAsync,
    ReduceScatter(ReduceOp),
    AllReduce(ReduceOp),
    AllReduceInPlace(ReduceOp),
    Broadcast(usize),
    BroadcastInPlace(usize),
    AllToAll,
    /// Uneven shards of [`shard_counts`].
    AllGatherV,
    ReduceScatterV(ReduceOp),
    /// Counts per pair of [`exchange_counts`].
    AllToAllV,
}

impl Call {
    fn op(self) -> Option<ReduceOp> {
        match self {
            Call::ReduceScatter(o)
            | Call::ReduceScatterV(o)
            | Call::AllReduce(o)
            | Call::AllReduceInPlace(o) => Some(o),
            _ => None,
        }
    }
}

/// Uneven shards around `len` for the variable-count checks, the same in every process: every third
/// rank (from rank 1) holds none, the others `len + rank` elements.
fn shard_counts(len: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|r| if r % 3 == 1 { 0 } else { len + r })
        .collect()
}

/// `matrix[r][j]`: what rank `r` sends rank `j` in the all-to-all-v check: zero for about a third of
/// the pairs (never on one rank, where the one pair is the whole exchange), else around `len`.
fn exchange_counts(len: usize, n: usize) -> Vec<Vec<usize>> {
    (0..n)
        .map(|r| {
            (0..n)
                .map(|j| {
                    if n > 1 && (r + 2 * j) % 3 == 1 {
                        0
                    } else {
                        len + r + 2 * j
                    }
                })
                .collect()
        })
        .collect()
}

/// The input length of `rank` for `call` around `len`.
fn input_len(call: Call, len: usize, n: usize, rank: usize) -> usize {
    match call {
        Call::AllGatherV => shard_counts(len, n)[rank],
        Call::ReduceScatterV(_) => shard_counts(len, n).iter().sum(),
        Call::AllToAllV => exchange_counts(len, n)[rank].iter().sum(),
        _ => len,
    }
}

/// The workspace generator with this file's own float mappings on top.
struct Rng(SplitMix64);
impl Rng {
    fn float(&mut self) -> f32 {
        let r = self.0.next_u64();
        let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
        let e = ((r >> 8) % 13) as i32 - 6;
        let frac = ((r >> 16) % 1_000_000) as f32 / 1_000_000.0;
        sign * (1.0 + frac) * (e as f32).exp2()
    }
}

fn decode(kind: CommDType, bits: u32) -> f64 {
    match kind {
        CommDType::F32 => f32::from_bits(bits) as f64,
        CommDType::BF16 => bf16::from_bits(bits as u16).to_f64(),
        CommDType::F16 => f16::from_bits(bits as u16).to_f64(),
        CommDType::Fp8(f) => f.decode(bits as u8) as f64,
        CommDType::Bytes => bits as f64,
    }
}

/// Inputs of `rank`, the same in every process.
fn inputs(kind: CommDType, call: Call, len: usize, n: usize, rank: usize) -> Vec<u32> {
    let tag: u64 = format!("{kind}{call:?}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
    let seed = ((len as u64) << 32) ^ ((rank as u64) << 16) ^ tag;
    let mut rng = Rng(SplitMix64::new(
        seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ rank as u64,
    ));
    (0..len)
        .map(|_| match kind {
            CommDType::F32 => rng.float().to_bits(),
            CommDType::BF16 => bf16::from_f32(rng.float()).to_bits() as u32,
            CommDType::F16 => f16::from_f32(rng.float()).to_bits() as u32,
            CommDType::Bytes => (rng.0.next_u64() & 0xFF) as u32,
            CommDType::Fp8(f) => loop {
                let c = (rng.0.next_u64() & 0xFF) as u8;
                let v = f.decode(c);
                // Sums stay below saturation so the error bound applies; NaN is checked on CPU tests.
                let limit = f.max() / (2.0 * n as f32);
                if v.is_finite() && (call.op() != Some(ReduceOp::Sum) || v.abs() <= limit) {
                    break c as u32;
                }
            },
        })
        .collect()
}

enum Buf {
    F32(Buffer<f32>),
    BF16(Buffer<bf16>),
    F16(Buffer<f16>),
    U8(Buffer<u8>),
}

impl Buf {
    fn new(dev: &Device, kind: CommDType, bits: &[u32]) -> Result<Self, CommError> {
        Ok(match kind {
            CommDType::F32 => {
                Buf::F32(dev.from_vec(bits.iter().map(|&b| f32::from_bits(b)).collect())?)
            }
            CommDType::BF16 => {
                Buf::BF16(dev.from_vec(bits.iter().map(|&b| bf16::from_bits(b as u16)).collect())?)
            }
            CommDType::F16 => {
                Buf::F16(dev.from_vec(bits.iter().map(|&b| f16::from_bits(b as u16)).collect())?)
            }
            CommDType::Bytes | CommDType::Fp8(_) => {
                Buf::U8(dev.from_vec(bits.iter().map(|&b| b as u8).collect())?)
            }
        })
    }
    fn send(&self, kind: CommDType) -> SendBuf<'_> {
        match (self, kind) {
            (Buf::F32(b), _) => b.into(),
            (Buf::BF16(b), _) => b.into(),
            (Buf::F16(b), _) => b.into(),
            (Buf::U8(b), CommDType::Fp8(f)) => SendBuf::fp8(b, f),
            (Buf::U8(b), _) => b.into(),
        }
    }
    fn recv(&mut self, kind: CommDType) -> RecvBuf<'_> {
        match (self, kind) {
            (Buf::F32(b), _) => b.into(),
            (Buf::BF16(b), _) => b.into(),
            (Buf::F16(b), _) => b.into(),
            (Buf::U8(b), CommDType::Fp8(f)) => RecvBuf::fp8(b, f),
            (Buf::U8(b), _) => b.into(),
        }
    }
    fn bits(&self) -> Result<Vec<u32>, CommError> {
        Ok(match self {
            Buf::F32(b) => b.to_vec()?.iter().map(|x| x.to_bits()).collect(),
            Buf::BF16(b) => b.to_vec()?.iter().map(|x| x.to_bits() as u32).collect(),
            Buf::F16(b) => b.to_vec()?.iter().map(|x| x.to_bits() as u32).collect(),
            Buf::U8(b) => b.to_vec()?.iter().map(|&x| x as u32).collect(),
        })
    }
}

/// Runs `call` on `comm` with buffers on its device; returns the output bits.
fn invoke(
    comm: &dyn Communicator,
    kind: CommDType,
    call: Call,
    len: usize,
    input: &[u32],
) -> Result<Vec<u32>, CommError> {
    let dev = comm.device().clone();
    let n = comm.world_size();
    let rank = comm.rank();
    // The variable-count calls: `len` is the base their counts are built around.
    let counts = shard_counts(len, n);
    let matrix = exchange_counts(len, n);
    let send_counts = matrix[rank].clone();
    let recv_counts: Vec<usize> = matrix.iter().map(|row| row[rank]).collect();
    let out_len = match call {
        Call::AllGather | Call::AllGatherAsync => input.len() * n,
        Call::ReduceScatter(_) => input.len() / n,
        Call::AllGatherV => counts.iter().sum(),
        Call::ReduceScatterV(_) => counts[rank],
        Call::AllToAllV => recv_counts.iter().sum(),
        _ => input.len(),
    };
    let x = Buf::new(&dev, kind, input)?;
    // A pattern the collective must overwrite.
    let mut y = Buf::new(&dev, kind, &vec![0x55; out_len])?;
    match call {
        Call::AllGather => comm.all_gather(x.send(kind), y.recv(kind))?,
        Call::AllGatherAsync => {
            let work = comm.all_gather_async(x.send(kind), y.recv(kind))?;
            work.wait()?;
        }
        Call::ReduceScatter(op) => comm.reduce_scatter(x.send(kind), y.recv(kind), op)?,
        Call::AllReduce(op) => comm.all_reduce(x.send(kind), y.recv(kind), op)?,
        Call::Broadcast(root) => comm.broadcast(x.send(kind), y.recv(kind), root)?,
        Call::AllToAll => comm.all_to_all(x.send(kind), y.recv(kind))?,
        Call::AllGatherV => comm.all_gather_v(x.send(kind), y.recv(kind), &counts)?,
        Call::ReduceScatterV(op) => {
            comm.reduce_scatter_v(x.send(kind), y.recv(kind), &counts, op)?
        }
        Call::AllToAllV => {
            comm.all_to_all_v(x.send(kind), &send_counts, y.recv(kind), &recv_counts)?
        }
        Call::AllReduceInPlace(op) => {
            let mut z = Buf::new(&dev, kind, input)?;
            comm.all_reduce_in_place(z.recv(kind), op)?;
            y = z;
        }
        Call::BroadcastInPlace(root) => {
            let mut z = Buf::new(&dev, kind, input)?;
            comm.broadcast_in_place(z.recv(kind), root)?;
            y = z;
        }
    }
    y.bits()
}

fn unit_roundoff(kind: CommDType) -> (f64, f64) {
    match kind {
        CommDType::F32 => (2f64.powi(-24), f32::from_bits(1) as f64),
        CommDType::BF16 => (2f64.powi(-8), bf16::from_bits(1).to_f64()),
        CommDType::F16 => (2f64.powi(-11), f16::from_bits(1).to_f64()),
        CommDType::Fp8(f) => (fp8_unit_roundoff(f), f.min_subnormal() as f64),
        CommDType::Bytes => (0.0, 0.0),
    }
}

struct Checker {
    rank: usize,
    n: usize,
    failures: usize,
    checks: usize,
}

impl Checker {
    fn report(&mut self, name: &str, result: Result<String, String>) {
        self.checks += 1;
        match result {
            Ok(info) => println!("PASS {name} (rank {}/{}){info}", self.rank, self.n),
            Err(why) => {
                self.failures += 1;
                println!("FAIL {name} (rank {}/{}): {why}", self.rank, self.n);
            }
        }
    }

    fn collective(&mut self, comm: &NcclComm, kind: CommDType, call: Call, len: usize) {
        let n = self.n;
        let rank = self.rank;
        let name = format!("{call:?} {kind} len={len}");
        if len == 0 {
            if let Err(e) = comm.device().zeros::<u8>(0) {
                // An fp8-kernels/driver limit, not a collective's: report it without failing.
                println!("SKIP {name}: empty CUDA buffers cannot be allocated: {e}");
                return;
            }
        }
        let all: Vec<Vec<u32>> = (0..n)
            .map(|r| inputs(kind, call, input_len(call, len, n, r), n, r))
            .collect();
        let result = (|| -> Result<String, String> {
            let got =
                invoke(comm, kind, call, len, &all[rank]).map_err(|e| format!("NCCL: {e}"))?;
            let reference = run_ranks_timeout(n, Duration::from_secs(120), |tc| {
                invoke(&tc, kind, call, len, &all[tc.rank()])
            })
            .map_err(|e| format!("thread reference: {e}"))?;
            let want = &reference[rank];
            if got.len() != want.len() {
                return Err(format!(
                    "{} elements, reference has {}",
                    got.len(),
                    want.len()
                ));
            }
            let exact_sum_check = call.op() == Some(ReduceOp::Sum) && n > 1;
            let mut exact = 0usize;
            let mut worst = 0.0f64;
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                if g == w {
                    exact += 1;
                    continue;
                }
                let (gv, wv) = (decode(kind, g), decode(kind, w));
                let same_value = (gv.is_nan() && wv.is_nan()) || (call.op().is_some() && gv == wv);
                if same_value {
                    exact += 1;
                    continue;
                }
                if !exact_sum_check {
                    return Err(format!(
                        "element {i}: got {gv} ({g:#x}), reference {wv} ({w:#x})"
                    ));
                }
                // Several ranks: NCCL's order may differ; check the rounding bound against the exact
                // sum. Element i of this rank's output is element `base + i` of the inputs.
                let base = match call {
                    Call::ReduceScatter(_) => rank * got.len(),
                    Call::ReduceScatterV(_) => shard_counts(len, n)[..rank].iter().sum(),
                    _ => 0,
                };
                let xs: Vec<f64> = all.iter().map(|v| decode(kind, v[base + i])).collect();
                let exact_sum: f64 = xs.iter().sum();
                let abs_sum: f64 = xs.iter().map(|x| x.abs()).sum();
                let (u, sub) = unit_roundoff(kind);
                let steps = (n - 1) as f64;
                let bound = steps * (u * (1.0 + u).powi(n as i32 - 1) * abs_sum + sub / 2.0);
                let err = (gv - exact_sum).abs();
                worst = worst.max(err / bound.max(f64::MIN_POSITIVE));
                if err > bound {
                    return Err(format!(
                        "element {i}: got {gv}, exact sum {exact_sum}, error {err} above bound {bound}"
                    ));
                }
            }
            if exact == got.len() {
                Ok(String::new())
            } else {
                Ok(format!(
                    ": {}/{} bit-exact with the ring emulation, others within the bound (worst {:.2} of it)",
                    exact,
                    got.len(),
                    worst
                ))
            }
        })();
        self.report(&name, result);
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let timeout = args
        .iter()
        .position(|a| a == "--timeout")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|t| t.is_finite() && *t > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(120));
    let skip_init_timeout = args.iter().any(|a| a == "--skip-init-timeout-check");

    if let Err(e) = nccl_library_status() {
        println!("FAIL nccl_check: nothing checked: {e}");
        return ExitCode::FAILURE;
    }
    let env = if DistEnv::is_launched() {
        match DistEnv::from_env() {
            Ok(e) => e,
            Err(e) => {
                println!("FAIL environment: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        DistEnv::single()
    };
    if let Err(e) = Device::cuda(env.local_rank) {
        println!(
            "FAIL nccl_check: nothing checked: no usable GPU {}: {e}",
            env.local_rank
        );
        return ExitCode::FAILURE;
    }
    let cfg = NcclConfig::with_timeout(timeout);
    let t0 = Instant::now();
    let comm = match NcclComm::from_dist_env(&env, &cfg) {
        Ok(c) => c,
        Err(e) => {
            println!("FAIL NCCL init (rank {}/{}): {e}", env.rank, env.world_size);
            return ExitCode::FAILURE;
        }
    };
    let n = comm.world_size();
    let rank = comm.rank();
    let cc = comm.cuda().compute_capability();
    println!(
        "rank {rank}/{n}: NCCL {} on GPU {} (sm_{}{}), init {:.2} s",
        comm.nccl_version(),
        comm.cuda().ordinal(),
        cc.0,
        cc.1,
        t0.elapsed().as_secs_f64()
    );
    let mut ck = Checker {
        rank,
        n,
        failures: 0,
        checks: 0,
    };
    let lens = [0usize, 1, 1000, 65_537];
    for kind in KINDS {
        for &len in &lens {
            ck.collective(&comm, kind, Call::AllGather, len);
            ck.collective(&comm, kind, Call::AllGatherAsync, len);
            ck.collective(&comm, kind, Call::Broadcast(n - 1), len);
            ck.collective(&comm, kind, Call::BroadcastInPlace(0), len);
            ck.collective(&comm, kind, Call::AllToAll, len * n);
            ck.collective(&comm, kind, Call::AllGatherV, len);
            ck.collective(&comm, kind, Call::AllToAllV, len);
            if !kind.reducible() {
                continue;
            }
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                ck.collective(&comm, kind, Call::ReduceScatter(op), len * n);
                ck.collective(&comm, kind, Call::AllReduce(op), len);
                ck.collective(&comm, kind, Call::AllReduceInPlace(op), len);
                // FP8 reduce-scatter-v is refused (checked below).
                if !matches!(kind, CommDType::Fp8(_)) {
                    ck.collective(&comm, kind, Call::ReduceScatterV(op), len);
                }
            }
        }
    }

    // The host-vector all-reduce used for amaxes and non-finite counts, and the barrier.
    let host = (|| -> Result<String, String> {
        let mut v = vec![rank as f32, -(rank as f32), 1.5];
        comm.all_reduce_host_f32(&mut v, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        let want = [(n - 1) as f32, 0.0, 1.5];
        if v != want {
            return Err(format!("max gave {v:?}, want {want:?}"));
        }
        let mut c = vec![1.0f32, rank as f32];
        comm.all_reduce_host_f32(&mut c, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let want = [n as f32, (n * (n - 1) / 2) as f32];
        if c != want {
            return Err(format!("sum gave {c:?}, want {want:?}"));
        }
        comm.barrier().map_err(|e| e.to_string())?;
        Ok(String::new())
    })();
    ck.report("all_reduce_host_f32 + barrier", host);

    // Sizes are checked before NCCL sees them.
    let sizes = (|| -> Result<String, String> {
        let d = comm.device();
        let x = d.zeros::<f32>(10).map_err(|e| e.to_string())?;
        let mut y = d.zeros::<f32>(10 * n + 1).map_err(|e| e.to_string())?;
        match comm.all_gather((&x).into(), (&mut y).into()) {
            Err(CommError::LengthMismatch { .. }) => Ok(String::new()),
            other => Err(format!("expected a length error, got {other:?}")),
        }
    })();
    ck.report("size mismatch is an error", sizes);

    // The variable-count forms check their counts before NCCL sees them, and refuse FP8 sums.
    let v_errors = (|| -> Result<String, String> {
        let d = comm.device();
        let counts = vec![4usize; n];
        let x = d.zeros::<u8>(4 * n).map_err(|e| e.to_string())?;
        let mut y = d.zeros::<u8>(4).map_err(|e| e.to_string())?;
        match comm.reduce_scatter_v(
            SendBuf::fp8(&x, Fp8Format::E4M3),
            RecvBuf::fp8(&mut y, Fp8Format::E4M3),
            &counts,
            ReduceOp::Sum,
        ) {
            Err(CommError::Unsupported { .. }) => {}
            other => {
                return Err(format!(
                    "FP8 reduce_scatter_v: expected Unsupported, got {other:?}"
                ))
            }
        }
        let short = vec![4usize; n + 1];
        let mut full = d.zeros::<u8>(4 * n).map_err(|e| e.to_string())?;
        match comm.all_gather_v((&y).into(), (&mut full).into(), &short) {
            Err(CommError::LengthMismatch { .. }) => Ok(String::new()),
            other => Err(format!(
                "all_gather_v with n + 1 counts: expected a length error, got {other:?}"
            )),
        }
    })();
    ck.report("variable-count argument errors", v_errors);

    if n == 1 && !skip_init_timeout {
        // A second communicator of two ranks whose peer never joins: init must time out, not hang.
        let t = Duration::from_secs(5);
        let result = (|| -> Result<String, String> {
            let id = fsdp_comm::nccl::unique_id().map_err(|e| e.to_string())?;
            let cuda = comm.cuda().clone();
            let start = Instant::now();
            match NcclComm::init(cuda, 0, 2, &id, &NcclConfig::with_timeout(t)) {
                Ok(_) => Err("init of a 2-rank communicator with one rank succeeded".into()),
                Err(e) => {
                    let el = start.elapsed();
                    if el < t + Duration::from_secs(30) {
                        Ok(format!(": {e} after {:.1} s", el.as_secs_f64()))
                    } else {
                        Err(format!("took {el:?}: {e}"))
                    }
                }
            }
        })();
        ck.report("NCCL init with a missing peer times out", result);
    }

    println!(
        "rank {rank}/{n}: {} checks, {} failed, {:.1} s",
        ck.checks,
        ck.failures,
        t0.elapsed().as_secs_f64()
    );
    if ck.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
