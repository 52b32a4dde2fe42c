"""scripts/analysis/sass_counts.py on one cheap kernel: compiled for sm_90 on the CPU with the ptxas and cuobjdump
Triton ships (skipped where they are missing), its unmasked loop found and counted per score. It runs in a
subprocess because the test session interprets the kernels (TRITON_INTERPRET=1), and interpreted kernels
do not compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "analysis" / "sass_counts.py"


def _tools_present() -> bool:
    try:
        from triton import knobs

        return all(os.access(tool.path, os.X_OK) for tool in (knobs.nvidia.ptxas, knobs.nvidia.cuobjdump))
    except (ImportError, AttributeError, RuntimeError):
        return False


@pytest.mark.skipif(not _tools_present(), reason="Triton's ptxas / cuobjdump not available")
def test_threshold_forward_counts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--variant", "threshold", "--kernel", "fwd",
                          "--shape", "1,2,256,64", "--dtype", "fp16", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["kernel", "variant", "views"]
    for col in ("regs", "spill", "loop", "instr", "mufu", "tc", "tc_flop", "ffma_fadd_fmul", "int_addr", "mem",
                "sync", "clk_issue", "clk_mufu", "clk_tc", "bound"):
        assert col in header
    assert len(lines) == 3  # header, rule, one kernel
    (row,) = json.loads(out.read_text())
    assert row["kernel"] == "threshold_fwd" and row["variant"] == "threshold"
    assert row["loop"] > 0 and row["regs"] > 0
    assert row["instr"] > row["ffma_fadd_fmul"] > 0 and row["tc"] > 0 and row["mem"] > 0
    assert row["mufu"] == 0  # relu(x - tau)^2 needs no special-function op
    assert row["tc_flop"] == pytest.approx(2 * 2 * 64)  # two matrix products per score at D = 64
    assert row["bound"] in ("issue", "mufu", "tc")


def test_refuses_interpreted_kernels():
    run = subprocess.run([sys.executable, str(SCRIPT), "--variant", "threshold", "--kernel", "fwd"], cwd=ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "TRITON_INTERPRET" in run.stderr


def test_masks_record_the_kernels_their_calls_run():
    """--mask picks the launch recorded: ranker with segment ids (HAS_SEG, not causal), causal without."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts" / "analysis"))
    import sass_counts

    for mask, seg, causal in (("ranker", True, False), ("causal", False, True), ("full", False, False)):
        launches = sass_counts.record_launches("softcap_tanh", (1, 2, 256, 64), torch.float16, True, None, mask)
        assert {kernel.name for kernel, *_ in launches} >= {"softmax_family_fwd", "softmax_family_dkdv"}
        for kernel, tensors, scalars, meta, configs in launches:
            if "HAS_SEG" in meta:
                assert (meta["HAS_SEG"], meta["CAUSAL"]) == (seg, causal), (mask, kernel.name)


@pytest.mark.skipif(not _tools_present(), reason="Triton's ptxas / cuobjdump not available")
def test_ranker_mask_compiles(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "ranker.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--variant", "softmax", "--kernel", "fwd", "--mask", "ranker",
                          "--shape", "1,2,256,64", "--dtype", "fp16", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())
    assert row["kernel"] == "softmax_family_fwd" and row["loop"] > 0 and row["tc"] > 0
