"""The Gluon sm_90 softmax forward (attn/kernels/gluon_softmax_fwd.py) and backward
(attn/kernels/gluon_softmax_bwd.py) compile for Hopper on the CPU.

No GPU: triton.compile on a GluonASTSource for GPUTarget("cuda", 90, 128). Skipped unless the installed
Triton has the Gluon API the kernel is written against (Triton 3.6; later releases renamed parts of it).
The PTX must hold the schedule's instructions: wgmma (async, with waits), TMA bulk tensor loads,
mbarrier waits, setmaxnreg for the partitions, and no local memory (spills); the SASS of both key-block
loops (scripts/analysis/gluon_sass_counts.py, Triton's cuobjdump) multiplies by the scale in no per-score FMUL.
The backward's key-block (dK / dV) and query-block (dQ) kernels: the same PTX checks, and SASS loops with
their wgmma counts, one exp2 per score and no local memory inside a loop."""

import importlib.util
import re
from pathlib import Path

import pytest

from attn.kernels import gluon_pipeline
from attn.kernels import gluon_softmax_bwd as gsb
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


def _assert_hopper_schedule(ptx: str, dtype: str):
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{dtype}\.{dtype}", ptx)
    assert "wgmma.wait_group" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "mbarrier.try_wait" in ptx
    assert "setmaxnreg" in ptx
    assert not re.search(r"\.local\b|\bld\.local|\bst\.local", ptx)


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("head_dim,causal,dtype", [(64, True, "bf16"), (128, False, "fp16"), (128, True, "bf16")])
def test_backward_compiles_for_sm90_with_wgmma_and_tma(kernel, head_dim, causal, dtype):
    compiled = gsb.compile_sm90(head_dim, dtype, causal, kernel=kernel)
    _assert_hopper_schedule(compiled.asm["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert compiled.metadata.shared <= 227 * 1024


def test_backward_delta_kernel_compiles():
    ptx = gsb.compile_sm90(128, "bf16", True, kernel="delta").asm["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx


@pytest.mark.parametrize("variant", ["bwd_dkdv", "bwd_dq"])
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_backward_loops_run_their_products_with_one_exp2_per_score_and_no_local_memory(variant, head_dim, causal):
    """Per iteration the key-block loop runs S^T = K Q^T and dP^T = V dO^T (k = D), dV += P^T dO and
    dK += dS^T Q (k = BLOCK_M); the query-block loop S = Q K^T and dP = dO V^T (k = D), dQ += dS K
    (k = BLOCK_N); a wgmma takes 16 of k per instruction. One MUFU.EX2 per score of the warpgroup's
    64 x width tile (width / 2 per thread)."""
    module = _sass_counts()
    rows = {row["loop"]: row for row in module.count(gsb, head_dim, causal, variant=variant)}
    width = module.tile_width(gsb, variant, head_dim)
    expected_loops = {"unmasked"} if (variant == "bwd_dkdv" and not causal) else {"unmasked", "masked"}
    assert set(rows) == expected_loops
    for row in rows.values():
        products_over_width = 2 if variant == "bwd_dkdv" else 1  # dV and dK, or dQ
        assert row["hgmma"] == 2 * (head_dim // 16) + products_over_width * (width // 16), row
        assert row["mufu"] >= width // 2, row
        assert row["loop_spills"] == 0, row
