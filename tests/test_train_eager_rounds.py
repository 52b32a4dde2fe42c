"""scripts/bench/train_eager_rounds.py on the CPU: speeds from paired rounds (a slow round for every case
cancels), the op census's differences from SDPA's step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import train_eager_rounds as rounds  # noqa: E402


def test_paired_rounds_cancel_a_slow_round_and_best_over_best_does_not_pair():
    times = {"softmax/sdpa": [10.0, 20.0, 10.0], "threshold/triton": [12.5, 25.0, 12.5],
             "sigmoid/triton": [10.0, 10.0, 20.0]}
    rows = {r["case"]: r for r in rounds.paired_rows(times)}
    assert rows["softmax/sdpa"]["speed_vs_sdpa_paired"] == 1.0
    assert rows["threshold/triton"]["speed_vs_sdpa_paired"] == pytest.approx(0.8)  # 0.8 in every round
    assert rows["threshold/triton"]["median_ms"] == 12.5 and rows["threshold/triton"]["best_ms"] == 12.5
    # sigmoid: 1.0, 2.0, 0.5 in the three rounds -> median 1.0; best over best 10 / 10
    assert rows["sigmoid/triton"]["speed_vs_sdpa_paired"] == 1.0
    assert rows["sigmoid/triton"]["speed_vs_sdpa_best"] == 1.0
    assert rows["threshold/triton"]["rounds_ms"] == [12.5, 25.0, 12.5]


def test_census_counts_a_steps_aten_ops_and_the_differences_name_what_a_case_adds():
    x = torch.randn(8, 8, requires_grad=True)

    def plain():
        (x * 2).sum().backward()

    def normed():
        torch.nn.functional.normalize(x * 2, dim=-1).sum().backward()

    base = rounds.census(plain, rounds.host_ms(plain), steps=2)
    case = rounds.census(normed, rounds.host_ms(normed), steps=2)
    assert base["aten_ops"]["aten::mul"] >= 1 and base["launches"] == 0  # no GPU: no launches
    assert base["host_ms"] > 0
    diff = dict(rounds.op_differences(case, base))
    assert diff.get("aten::linalg_vector_norm", 0) >= 1
    assert "aten::mul" not in diff or diff["aten::mul"] != 0
    assert all(d != 0 for d in diff.values())


def test_a_case_carries_environment_settings_for_its_steps_alone(monkeypatch):
    assert rounds.parse_case("threshold/triton") == ("threshold/triton", {})
    assert rounds.parse_case("diff_threshold/triton@ATTNLAB_GLUON=0;ATTNLAB_DIFF_DKDV=split") == (
        "diff_threshold/triton", {"ATTNLAB_GLUON": "0", "ATTNLAB_DIFF_DKDV": "split"})
    with pytest.raises(ValueError, match="settings are NAME=VALUE"):
        rounds.parse_case("threshold/triton@ATTNLAB_GLUON")
    monkeypatch.setenv("ATTNLAB_GLUON", "auto")
    monkeypatch.delenv("ATTNLAB_DIFF_DKDV", raising=False)
    seen = []

    def step():
        seen.append((rounds.os.environ.get("ATTNLAB_GLUON"), rounds.os.environ.get("ATTNLAB_DIFF_DKDV")))
        return "loss"

    run = rounds.with_settings(step, {"ATTNLAB_GLUON": "0", "ATTNLAB_DIFF_DKDV": "split"})
    assert run() == "loss" and seen == [("0", "split")]
    assert rounds.os.environ["ATTNLAB_GLUON"] == "auto" and "ATTNLAB_DIFF_DKDV" not in rounds.os.environ
    assert rounds.with_settings(step, {}) is step
