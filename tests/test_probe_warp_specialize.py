"""scripts/bench/probe_warp_specialize.py on the CPU (Triton's interpreter, fp32): its loop, with and without
the warp-specialization request, gives SDPA's output, so the GPU's timings compare correct kernels and
a wrong output there (NaN, as some Triton 3.6 configs give) is the compiler's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import probe_warp_specialize as probe  # noqa: E402


def test_dry_run_gives_sdpa_output(tmp_path):
    out = tmp_path / "probe.json"
    rows = probe.main(["--dry-run", "--out", str(out)])
    assert [r["name"] for r in rows] == ["sdpa", "plain 128x64 w4 s2", "ws 128x64 w4 s2"]
    for r in rows[1:]:
        assert "error" not in r, r
        assert r["max_abs_err_vs_sdpa"] < 1e-4, r
    assert json.loads(out.read_text())["rows"] == rows
