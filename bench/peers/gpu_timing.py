# GPU-time measurement shared by the kernel peers.
import torch

# About 0.1 s of GPU clock cycles on an H200: long enough for the host to queue a whole run of calls behind it.
SLEEP_CYCLES = 200_000_000


def _median_seconds(fn, warmup, reps, run):
    """After `warmup` untimed calls of `fn`, the median seconds of `reps` runs of `run(start, end)`, which records
    the two CUDA events around what it times."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        run(start, end)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2]


def queued_seconds(fn, calls=20, warmup=5, reps=5):
    """GPU seconds per call without host overhead: `calls` calls are queued behind a sleep kernel that holds
    the GPU while Python launches them, and timed with CUDA events around the run; the median of `reps` such
    runs (after `warmup` untimed calls). Small kernels timed one call at a time would count the launches."""
    def run(start, end):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(calls):
            fn()
        end.record()

    return _median_seconds(fn, warmup, reps, run) / calls


def event_seconds(fn, iters, warmup):
    """The median over `iters` calls, each timed alone with CUDA events (after `warmup` untimed calls)."""
    def run(start, end):
        start.record()
        fn()
        end.record()

    return _median_seconds(fn, warmup, iters, run)
