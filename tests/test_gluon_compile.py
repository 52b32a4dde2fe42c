"""The Gluon sm_90 softmax forward (attn/kernels/gluon_softmax_fwd.py) compiles for Hopper on the CPU.

No GPU: triton.compile on a GluonASTSource for GPUTarget("cuda", 90, 128). Skipped unless the installed
Triton has the Gluon API the kernel is written against (Triton 3.6; later releases renamed parts of it).
The PTX must hold the schedule's instructions: wgmma (async, with waits), TMA bulk tensor loads,
mbarrier waits, setmaxnreg for the partitions, and no local memory (spills); the SASS of both key-block
loops (scripts/analysis/gluon_sass_counts.py, Triton's cuobjdump) multiplies by the scale in no per-score FMUL."""

import importlib.util
import re
from pathlib import Path

import pytest

from attn.kernels import gluon_pipeline
from attn.kernels import gluon_softmax_fwd as gsf

ROOT = Path(__file__).resolve().parents[1]

OK, WHY = gluon_pipeline.gluon_api_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"Gluon Hopper API of Triton 3.6 not available: {WHY}")


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_compiles_for_sm90_with_wgmma_and_tma(head_dim, causal):
    compiled = gsf.compile_sm90(head_dim, "bf16", causal)
    ptx = compiled.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", ptx)
    assert "wgmma.wait_group" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "mbarrier.try_wait" in ptx
    assert "setmaxnreg" in ptx  # warp-specialized partitions with their own register budgets
    assert not re.search(r"\.local\b|\bld\.local|\bst\.local", ptx)
    assert compiled.metadata.shared <= 227 * 1024



def _sass_counts():
    spec = importlib.util.spec_from_file_location("gluon_sass_counts", ROOT / "scripts" / "analysis" / "gluon_sass_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_softmax_loops_fold_the_scale_into_one_ffma_per_score(head_dim, causal):
    """Per thread a key block holds 64 scores (64 rows x BLOCK_N over 128 threads) and HEAD_DIM / 2
    accumulator elements: the scale rides in the exp2 argument's FFMA (qk * qk_scale - m), so FMUL is
    left for the accumulator's rescale only. No spills."""
    block_n = gsf.tile_config(head_dim)["BLOCK_N"]
    scores = 64 * block_n // 128
    rows = {row["loop"]: row for row in _sass_counts().count(gsf, head_dim, causal)}
    assert set(rows) == {"unmasked", "masked"}
    for row in rows.values():
        assert row["hgmma"] == head_dim // 16 + block_n // 16  # S = Q K^T (k 16 a step), O += P V (k 16)
        assert row["ffma"] >= scores and row["mufu"] >= scores, row
        assert row["fmul"] <= head_dim // 2 + 4, row
        assert row["spills"] == 0
