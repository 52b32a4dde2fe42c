"""scripts/bench/ab_kernel_options.py on CPU: how it reads options, that each option's settings hold only
while it runs, and a dry run that compares every option's outputs with the first one's."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import ab_kernel_options as ab  # noqa: E402


def test_options_are_a_name_and_attnlab_settings():
    assert ab.parse_option("base:") == ("base", {})
    assert ab.parse_option("both:ATTNLAB_FIXED_SHIFT=1,ATTNLAB_SOFTMAX_DQ=one_pass") == (
        "both", {"ATTNLAB_FIXED_SHIFT": "1", "ATTNLAB_SOFTMAX_DQ": "one_pass"})
    assert ab.parse_option("tma_fwd_dq:ATTNLAB_TMA=fwd,dq,ATTNLAB_FIXED_SHIFT=0") == (
        "tma_fwd_dq", {"ATTNLAB_TMA": "fwd,dq", "ATTNLAB_FIXED_SHIFT": "0"})
    for bad in ("base", ":ATTNLAB_X=1", "x:PATH=/tmp", "x:ATTNLAB_X"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab.parse_option(bad)


def test_settings_hold_only_inside(monkeypatch):
    monkeypatch.setenv("ATTNLAB_FIXED_SHIFT", "0")
    monkeypatch.delenv("ATTNLAB_SOFTMAX_DQ", raising=False)
    with ab.case_env({"ATTNLAB_FIXED_SHIFT": "1", "ATTNLAB_SOFTMAX_DQ": "one_pass"}):
        assert os.environ["ATTNLAB_FIXED_SHIFT"] == "1" and os.environ["ATTNLAB_SOFTMAX_DQ"] == "one_pass"
    assert os.environ["ATTNLAB_FIXED_SHIFT"] == "0" and "ATTNLAB_SOFTMAX_DQ" not in os.environ


def test_dry_run_compares_every_option(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_FIXED_SHIFT", raising=False)
    out = tmp_path / "ab"
    assert ab.main(["--dry-run", "--option", "base:", "--option", "fixed:ATTNLAB_FIXED_SHIFT=1",
                    "--option", "one_pass:ATTNLAB_SOFTMAX_DQ=one_pass", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["name"] for r in rows] == [c[0] for c in ab.DRY_CASES]
    for r in rows:
        changes = {opt: e["max_relative_change"] for opt, e in r["options"].items()}
        assert set(changes) == {"base", "fixed", "one_pass"} and changes["base"] == 0.0
        assert all(c < 1e-5 for c in changes.values()), changes  # the same math, other summation orders
    assert "Kernel option A/B" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # option names must differ
        ab.main(["--dry-run", "--option", "a:", "--option", "a:ATTNLAB_FIXED_SHIFT=1", "--out", str(out)])


def test_summary_names_errors_and_changes_and_leaves_the_yardstick_out():
    """The closing summary of a GPU run: plain-softmax cases carry an SDPA row with times only."""
    rows = [{"name": "main softmax causal", "options": {
        "base": {"max_relative_change": 0.0, "fwd_ms": 1.0},
        "tma": {"error": "PTXASError: ptxas exited with -11"},
        "sdpa": {"fwd_ms": 0.8, "fwdbwd_ms": 2.0}}}]
    lines = ab.summary_lines(rows)
    assert len(lines) == 2
    assert "base" in lines[0] and "max relative change 0.00e+00" in lines[0]
    assert "tma" in lines[1] and "ptxas exited with -11" in lines[1]
