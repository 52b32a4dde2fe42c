"""The regression gate's arithmetic (scripts/bench/bench_public_path.py) on made-up rows: no GPU needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import bench_public_path as bp  # noqa: E402

ROWS = {"call sdpa fwd+bwd": 0.40, "call softmax eager fwd+bwd": 0.50, "decode sdpa": 0.08, "decode threshold": 0.10,
        "ranker segments fwd": 0.70, "ranker full mask fwd": 1.20, "kernels sdpa fwd": 0.50,
        "kernels threshold fwd": 0.48, "kernels diff_threshold fwd": 0.72}


def test_ratios_put_each_row_against_its_yardstick():
    r = bp.ratios(ROWS)
    assert r["call softmax eager fwd+bwd / SDPA"] == pytest.approx(1.25)
    assert r["decode threshold / SDPA"] == pytest.approx(1.25)
    assert r["ranker segments fwd / full mask"] == pytest.approx(0.7 / 1.2)
    assert r["kernels threshold fwd: SDPA / ours"] == pytest.approx(0.5 / 0.48)
    assert r["kernels diff_threshold fwd / threshold"] == pytest.approx(0.72 / 0.48)
    assert not any("sdpa" in name.split(" / ")[0] for name in r)


def test_a_row_slower_than_the_baseline_beyond_its_suites_allowance_fails():
    baseline = {"best": dict(ROWS), "meta": {"host_timing": bp.HOST_TIMING}}
    assert bp.compare(ROWS, {}, baseline, 0.08, 0.30) == []
    slower = {**ROWS, "kernels threshold fwd": 0.48 * 1.09, "ranker segments fwd": 0.70 * 1.07,
              "decode threshold": 0.10 * 1.25}
    failures = bp.compare(slower, {"kernels threshold fwd": 0.02}, baseline, 0.08, 0.30)
    assert len(failures) == 1 and failures[0].startswith("REGRESSION kernels threshold fwd") and "+9.0%" in failures[0]
    # host-bound rows (call, decode) get the host allowance
    failures = bp.compare({**ROWS, "decode threshold": 0.10 * 1.31}, {}, baseline, 0.08, 0.30)
    assert len(failures) == 1 and failures[0].startswith("REGRESSION decode threshold")
    assert bp.compare({**ROWS, "a new row": 9.0}, {}, baseline, 0.08, 0.30) == []  # rows the baseline lacks pass


def test_host_bound_rows_are_gated_on_their_ratio_to_the_yardstick_of_the_same_round():
    """A slower host (every host-bound row and its yardstick slower together) passes; our row slower against
    the same round's yardstick beyond the host allowance fails; the yardsticks themselves are not gated; the
    round whose ratio is best counts."""
    rows = {**ROWS, "call sdpa compiled fwd+bwd": 0.45, "call softmax compiled fwd+bwd": 0.55}
    baseline = {"best": dict(rows), "meta": {"host_timing": bp.HOST_TIMING}}
    slower_host = {name: ms * (1.4 if name.split(" ")[0] in bp.HOST_BOUND_SUITES else 1.0) for name, ms in rows.items()}
    assert bp.compare(slower_host, {}, baseline, 0.08, 0.30) == []
    assert bp.compare({**rows, "call sdpa fwd+bwd": 0.40 * 2}, {}, baseline, 0.08, 0.30) == []
    ours_slower = {**rows, "call softmax compiled fwd+bwd": 0.55 * 1.35}
    failures = bp.compare(ours_slower, {}, baseline, 0.08, 0.30)
    assert len(failures) == 1 and failures[0].startswith("REGRESSION call softmax compiled fwd+bwd")
    assert "call sdpa compiled fwd+bwd" in failures[0]
    # per round: a round where the yardstick was slow too gives the ratio that counts
    rounds = {"call softmax compiled fwd+bwd": [0.55 * 1.35, 0.55 * 1.5],
              "call sdpa compiled fwd+bwd": [0.45, 0.45 * 1.5]}
    assert bp.compare(ours_slower, {}, baseline, 0.08, 0.30, rounds) == []


def test_a_slower_host_that_its_probe_shows_passes_and_a_slower_row_on_a_steady_host_fails():
    """Where SDPA's row is GPU-bound and ours host-bound, a slower host moves ours alone: the ratio to the yardstick
    is over its allowance, but the row's time scaled by the host probe (this run's over the baseline's) is within
    it, and the row passes; the same row slower with the probe unchanged fails, and the report names the scaled
    time; probe rows are neither gated nor given ratios."""
    rows = {**ROWS, "decode host probe": 0.010}
    baseline = {"best": dict(rows), "meta": {"host_timing": bp.HOST_TIMING}}
    slow_host = {**rows, "decode host probe": 0.016, "decode threshold": 0.10 * 1.55}
    assert bp.compare(slow_host, {}, baseline, 0.08, 0.30) == []
    slow_row = {**rows, "decode threshold": 0.10 * 1.55}
    failures = bp.compare(slow_row, {}, baseline, 0.08, 0.30)
    assert bp.regressed_rows(failures) == ["decode threshold"] and "scaled by this host's probe (1.00x" in failures[0]
    # a host faster than the baseline's: the scaled time is stricter, the ratio to the yardstick still rules
    fast_host = {**rows, "decode host probe": 0.005, "decode threshold": 0.10 * 1.2}
    assert bp.compare(fast_host, {}, baseline, 0.08, 0.30) == []
    assert bp.compare({**rows, "decode host probe": 0.05}, {}, baseline, 0.08, 0.30) == []
    assert not any("probe" in name for name in bp.ratios(slow_host))
    assert bp.yardstick("decode host probe") is None and bp.yardstick("call host probe") is None


def test_the_host_probe_step_runs_and_builds_an_autograd_node():
    step = bp.host_probe_step()
    out = step()
    assert out.grad_fn is not None and out.shape == (1,)


def test_host_bound_rows_timed_another_way_are_not_compared():
    baseline = {"best": dict(ROWS), "meta": {"host_timing": "do_bench"}}
    slower = {name: ms * 2 for name, ms in ROWS.items()}
    failures = bp.compare(slower, {}, baseline, 0.08, 0.30)
    assert failures and all(f.split(" ")[1] in ("ranker", "kernels") for f in failures)


def test_baselines_are_named_after_the_gpu():
    assert bp.baseline_path("NVIDIA H200").name == "nvidia_h200.json"
    assert bp.baseline_path("NVIDIA H100 80GB HBM3").name == "nvidia_h100_80gb_hbm3.json"


def test_the_committed_baselines_hold_rows_the_benchmark_writes():
    folder = Path(bp.ROOT) / "docs" / "results" / "baselines"
    files = sorted(folder.glob("*.json"))
    assert files, "no committed baseline"
    for path in files:
        data = json.loads(path.read_text())
        assert bp.baseline_path(data["meta"]["gpu"]) == path
        suites = {name.split(" ")[0] for name in data["best"]}
        assert suites <= set(bp.SUITES) and all(0 < data["best"][name] <= data["rows"][name] for name in data["best"])


def test_a_host_bound_row_rechecked_beside_its_yardstick_passes_when_a_pair_is_within_its_allowance():
    """`compare` takes the best of the rounds' and the recheck pairs' ratios: a host-bound row whose rounds were
    over the allowance passes when one (row, yardstick) pair of the recheck is within it, and still fails when
    every pair is over; GPU-bound rows ignore rechecks; `regressed_rows` names the rows of the report lines."""
    baseline = {"best": dict(ROWS), "meta": {"host_timing": bp.HOST_TIMING}}
    slow = {**ROWS, "decode threshold": 0.10 * 1.5, "kernels threshold fwd": 0.48 * 1.2}
    failures = bp.compare(slow, {}, baseline, 0.08, 0.30)
    assert bp.regressed_rows(failures) == ["decode threshold", "kernels threshold fwd"]
    one_good_pair = {"decode threshold": [[0.16, 0.08], [0.11, 0.09]], "kernels threshold fwd": [[0.1, 1.0]]}
    assert bp.regressed_rows(bp.compare(slow, {}, baseline, 0.08, 0.30, rechecks=one_good_pair)) == [
        "kernels threshold fwd"]
    all_slow = {"decode threshold": [[0.16, 0.08], [0.2, 0.1]]}  # 2.0x against the baseline's 1.25x
    assert bp.regressed_rows(bp.compare(slow, {}, baseline, 0.08, 0.30, rechecks=all_slow)) == [
        "decode threshold", "kernels threshold fwd"]


def test_host_pairs_name_the_suite_rows_and_their_yardsticks():
    """Every host-bound row the suites write has a yardstick, and `host_pair` builds the row's step from its name
    (here with the step builders stubbed: no GPU)."""
    built = []
    original = bp.call_step, bp.decode_step
    try:
        bp.call_step = lambda variant, compiled: built.append(("call", variant, compiled)) or len(built)
        bp.decode_step = lambda variant: built.append(("decode", variant)) or len(built)
        assert bp.host_pair("call threshold compiled fwd+bwd") == (1, 2)
        assert bp.host_pair("call softmax eager fwd+bwd") == (3, 4)
        assert bp.host_pair("decode sigmoid") == (5, 6)
    finally:
        bp.call_step, bp.decode_step = original
    assert built == [("call", "threshold", True), ("call", "sdpa", True), ("call", "softmax", False),
                     ("call", "sdpa", False), ("decode", "sigmoid"), ("decode", "sdpa")]
    for variant in bp.VARIANTS:
        assert bp.yardstick(f"call {variant} compiled fwd+bwd") == "call sdpa compiled fwd+bwd"
        assert bp.yardstick(f"call {variant} eager fwd+bwd") == "call sdpa fwd+bwd"
        assert bp.yardstick(f"decode {variant}") == "decode sdpa"


def cpu_tensors(variant, b, n, h, d, grad, kv=None):
    """bench_public_path.tensors on the CPU in fp32: the suites' inputs at a stand-in size."""
    kv = n if kv is None else kv

    def rand(length):
        x = torch.randn(b, length, h, d)
        return (F.normalize(x, dim=-1) if variant in ("threshold", "diff_threshold") else x).requires_grad_(grad)

    x = {"q": rand(n), "k": rand(kv), "v": rand(kv), "extra": None}
    if variant == "diff_threshold":
        x["extra"] = {"q2": rand(n), "k2": rand(kv), "lam": torch.full((h,), 0.5, requires_grad=grad)}
    return x


def counting_timer():
    """(the steps timed, a timer that runs a step once and returns how many steps it has timed): the suites'
    timers replaced, so a test sees which callable each row timed."""
    timed = []

    def count_calls(step):
        step()
        timed.append(step)
        return float(len(timed))

    return timed, count_calls


def test_the_host_bound_suites_and_the_recheck_run_end_to_end_on_cpu_stand_ins(monkeypatch):
    """call_rows, decode_rows and recheck build and run every row's step (eager and compiled calls through
    attn.attention, SDPA's yardsticks) on small CPU tensors, the timer replaced by a counter: the suites' plumbing
    works without a GPU, and each row times the callable built for it."""
    timed, count_calls = counting_timer()
    monkeypatch.setattr(bp, "tensors", cpu_tensors)
    monkeypatch.setattr(bp, "back_to_back_ms", count_calls)
    monkeypatch.setattr(bp, "CALL_SHAPE", (1, 2, 16, 8))
    monkeypatch.setattr(bp, "DECODE_SHAPE", (1, 2, 8, 32))
    monkeypatch.setattr(bp, "VARIANTS", ["threshold", "diff_threshold"])
    decode = bp.decode_rows()
    assert list(decode) == ["decode host probe", "decode sdpa", "decode threshold", "decode diff_threshold"]
    call = bp.call_rows()
    assert list(call) == ["call host probe", "call sdpa fwd+bwd", "call sdpa compiled fwd+bwd",
                          "call threshold eager fwd+bwd", "call threshold compiled fwd+bwd",
                          "call diff_threshold eager fwd+bwd", "call diff_threshold compiled fwd+bwd"]
    assert len(set(map(id, timed))) == len(timed) == 11  # a callable of its own per row
    pairs = bp.recheck(["decode threshold", "call diff_threshold compiled fwd+bwd"], 2)
    assert {name: len(p) for name, p in pairs.items()} == {"decode threshold": 2,
                                                           "call diff_threshold compiled fwd+bwd": 2}
    assert all(row > 0 and yard > 0 for p in pairs.values() for row, yard in p)


def test_the_kernels_suite_times_every_variant_of_the_target_table_on_cpu_stand_ins(monkeypatch):
    """kernel_rows builds and times fwd and fwd+bwd of SDPA and of every variant in KERNEL_VARIANTS (the caps
    soft_sign and ALSC included) through attn.attention on small CPU tensors, the timer replaced by a counter,
    and `ratios` puts each against SDPA (the differential threshold against threshold too)."""
    timed, count_calls = counting_timer()
    monkeypatch.setattr(bp, "tensors", cpu_tensors)
    monkeypatch.setattr(bp, "median_ms", count_calls)
    monkeypatch.setattr(bp, "KERNEL_SHAPE", (1, 2, 16, 8))
    rows = bp.kernel_rows()
    assert list(rows) == [f"kernels {v} {d}" for v in ("sdpa", *bp.KERNEL_VARIANTS) for d in ("fwd", "fwd+bwd")]
    assert {"softcap_softsign", "alsc"} <= set(bp.KERNEL_VARIANTS)
    assert len(set(map(id, timed))) == len(timed) == len(rows)
    ratios = bp.ratios(rows)
    for variant in bp.KERNEL_VARIANTS:
        for direction in ("fwd", "fwd+bwd"):
            name = f"kernels {variant} {direction}"
            assert ratios[f"{name}: SDPA / ours"] == rows[f"kernels sdpa {direction}"] / rows[name]
    assert ratios["kernels diff_threshold fwd+bwd / threshold"] == (rows["kernels diff_threshold fwd+bwd"]
                                                                     / rows["kernels threshold fwd+bwd"])
    some = bp.kernel_rows(["sigmoid"])  # --kernel-variants: SDPA and the variants given
    assert list(some) == [f"kernels {v} {d}" for v in ("sdpa", "sigmoid") for d in ("fwd", "fwd+bwd")]
