"""The benchmarks' shared timing harness (DESIGN.md §7): GPU time as a `triton.testing.do_bench`
median after warm-up, host-bound time of calls queued back to back, one call's wall time, TFLOP/s
of attention's useful work, the device sync, and the header of a result file (date, GPU, versions,
commit).

Imported by the scripts beside it (`from timing import ...`: a script run as `python
scripts/bench/X.py` has this folder on its path) and by the GPU checks that time kernels or write a
result file (they add this folder to their path)."""

from __future__ import annotations

import datetime as dt
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

FWD_BWD_FLOP_FACTOR = 3.5  # forward + backward, the backward counted as 2.5x the forward (DESIGN.md §7)


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU's queued work; nothing on a CPU device. No device: the GPU when there is one."""
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()


def wall_s(fn, device: torch.device | str | None = None):
    """(seconds, result) of one call of fn, the device's queue drained before and after it."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def median_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """ms per call of fn: `triton.testing.do_bench`'s median, after its `warmup` ms of untimed calls."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def back_to_back_ms(fn, calls: int = 50, batches: int = 7) -> float:
    """ms per call of `calls` calls queued back to back (as a training or decoding loop makes them),
    the median over `batches` batches, after 10 untimed calls. do_bench flushes the L2 cache before
    each call, which lets the host queue a host-bound call while the GPU clears the cache and so hides
    part of its host time; back to back, a call costs the larger of its host and its GPU time."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def attention_flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    """Useful forward FLOPs of attention over n queries and n keys: 4*B*H*N^2*D, halved when causal."""
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / ms / 1e9


def git_commit() -> str:
    """ATTNLAB_COMMIT when set (a copy of the tree without .git, as on a GPU machine), else git's short
    HEAD, else "unknown"."""
    if os.environ.get("ATTNLAB_COMMIT"):
        return os.environ["ATTNLAB_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def result_header() -> dict:
    """The head of a GPU result file's meta: UTC date to the minute, GPU, torch and Triton versions, commit."""
    import triton

    return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit()}
