"""The pipe profile's plumbing (scripts/bench/profile_kernel_pipes.py) with a stand-in for Nsight Compute:
how it reads ncu's raw CSV, the table it writes, and what a refusing ncu leaves. No GPU needed."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import profile_kernel_pipes as pipes  # noqa: E402
import timing  # noqa: E402

TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
STALL = "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
RAW = f'''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","{TENSOR}","{STALL}"
"","","nsecond","%","inst"
"0","_gluon_softmax_fwd_kernel","586,368","53.86","2.16"
'''


def test_the_raw_csv_gives_the_last_kernels_numbers():
    metrics = pipes.parse_raw_csv(RAW)
    assert metrics["Kernel Name"] == "_gluon_softmax_fwd_kernel"
    assert metrics["gpu__time_duration.sum"] == 586368.0 and metrics[TENSOR] == 53.86 and metrics[STALL] == 2.16
    assert metrics["units"]["gpu__time_duration.sum"] == "nsecond"
    assert pipes.duration_us(metrics) == pytest.approx(586.368)
    in_us = {**metrics, "gpu__time_duration.sum": 586.368, "units": {"gpu__time_duration.sum": "usecond"}}
    assert pipes.duration_us(in_us) == pytest.approx(586.368)
    assert pipes.parse_raw_csv("==PROF== nothing profiled\n") == {}


def _stand_in_ncu(tmp_path: Path, raw: str, refuse_metrics: bool) -> Path:
    """An `ncu` that prints `raw` for a metric request (or exits 1 when refuse_metrics), a line of text for
    a section request, a SASS line for a source request, and records its arguments."""
    script = tmp_path / "ncu"
    (tmp_path / "raw.csv").write_text(raw)
    script.write_text(f'''#!/bin/sh
echo "$@" >> "{tmp_path}/calls"
case "$*" in
  *"--page raw"*) {"exit 1" if refuse_metrics else f'cat "{tmp_path}/raw.csv"'} ;;
  *"--page source"*) echo '"Address","Source"' ;;
  *) echo "Section: Compute Workload Analysis" ;;
esac
''')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize("refuse", [False, True], ids=["metrics", "refused"])
def test_a_profile_run_writes_its_table_or_the_sections_of_a_refusing_ncu(tmp_path, monkeypatch, refuse):
    ncu = _stand_in_ncu(tmp_path, RAW, refuse)
    monkeypatch.setattr(timing, "result_header", lambda: {"gpu": "stand-in"})
    out = tmp_path / "pipes"
    monkeypatch.setattr(sys, "argv", ["profile_kernel_pipes.py", "--ncu", str(ncu), "--variants", "softmax,sdpa",
                                      "--source", "softmax", "--out", str(out), "--calls", "4"])
    assert pipes.main() == (1 if refuse else 0)
    result = json.loads(out.with_suffix(".json").read_text())
    calls = (tmp_path / "calls").read_text().splitlines()
    # each child profiles the last of its calls of the variant's kernel, on the tier asked for
    assert all("--launch-skip 3 --launch-count 1" in c and "--clock-control none" in c for c in calls)
    assert any(pipes.KERNELS["gluon"] in c and "--variant softmax" in c for c in calls)
    assert any(pipes.KERNELS["sdpa"] in c and "--variant sdpa" in c for c in calls)
    assert (tmp_path / "pipes_softmax_source.csv").read_text().startswith('"Address","Source"')
    table = out.with_suffix(".md").read_text()
    if refuse:
        assert set(result["metrics"]) == {"softmax", "sdpa"}
        assert all("ncu exit 1" in m["error"] for m in result["metrics"].values())
        assert (tmp_path / "pipes_softmax_sections.txt").read_text().startswith("Section:")
        assert "| softmax | ncu exit 1" in table
    else:
        assert result["metrics"]["softmax"][TENSOR] == 53.86
        assert "| softmax | 586.37 | - | 53.86 |" in table  # ns -> us; no issue-slot metric given
        assert "stall wait" in table


def test_stall_hot_spots_rank_instructions_and_opcodes_by_sampled_stalls():
    page = "\n".join([
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"0x10","MUFU.TANH R1, R2 ;","60","50"',
        '"0x20","@P0 MUFU.EX2 R3, R1 ;","30","20"',
        '"0x30","FFMA R4, R3, R5, R6 ;","10","5"',
    ])
    text = pipes.stall_hot_spots(page)
    assert "100 samples" in text
    assert text.index("`MUFU.TANH R1, R2 ;` | 60.0%") < text.index("`@P0 MUFU.EX2 R3, R1 ;` | 30.0%")
    assert "| MUFU | 90.0% |" in text and "| FFMA | 10.0% |" in text  # a predicated op counts as its opcode
    assert pipes.stall_hot_spots('"Address","Source"\n"0x10","NOP ;"').startswith("no stall-sampling column")
