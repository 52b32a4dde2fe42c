"""scripts/bench/timing.py, the benchmarks' timing harness, on CPU: do_bench asked for its median,
back-to-back batches and their median, TFLOP/s with the causal half, the commit a result file names."""

from __future__ import annotations

import string
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import timing  # noqa: E402


def test_median_ms_asks_do_bench_for_its_median_after_warm_up(monkeypatch):
    asked = []

    def do_bench(fn, **kwargs):
        asked.append(kwargs)
        fn()
        return 1.5

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    calls = []
    assert timing.median_ms(lambda: calls.append(1), warmup=10, rep=60) == 1.5
    assert calls == [1]
    assert asked == [{"warmup": 10, "rep": 60, "return_mode": "median"}]


def test_back_to_back_ms_is_the_median_batch_after_ten_untimed_calls(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    clock = iter([0.0, 0.3, 1.0, 1.1, 2.0, 2.2])  # batches of 3 calls: 0.3 s, 0.1 s, 0.2 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = []
    ms = timing.back_to_back_ms(lambda: calls.append(1), calls=3, batches=3)
    assert abs(ms - 0.2 / 3 * 1e3) < 1e-9
    assert len(calls) == 10 + 3 * 3 and len(syncs) == 2 * 3


def test_wall_s_times_one_call_and_returns_its_result():
    seconds, out = timing.wall_s(lambda: torch.ones(3).sum(), "cpu")
    assert seconds >= 0 and out.item() == 3.0


def test_tflops_count_useful_work_with_the_causal_half():
    assert timing.attention_flops(8, 16, 1024, 64, causal=False) == 4.0 * 8 * 16 * 1024 * 1024 * 64
    assert timing.attention_flops(8, 16, 1024, 64, causal=True) == 2.0 * 8 * 16 * 1024 * 1024 * 64
    assert timing.tflops(2e12, 1000.0) == 2.0  # 2e12 FLOPs in one second
    assert timing.FWD_BWD_FLOP_FACTOR == 3.5


def test_git_commit_prefers_attnlab_commit(monkeypatch):
    monkeypatch.setenv("ATTNLAB_COMMIT", "the-commit-a-device-copy-ran")
    assert timing.git_commit() == "the-commit-a-device-copy-ran"
    monkeypatch.delenv("ATTNLAB_COMMIT")
    commit = timing.git_commit()
    assert commit == "unknown" or set(commit) <= set(string.hexdigits.lower())
