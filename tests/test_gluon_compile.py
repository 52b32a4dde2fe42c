"""The Gluon sm_90 softmax forward (attn/kernels/gluon_softmax_fwd.py) compiles for Hopper on the CPU.

No GPU: triton.compile on a GluonASTSource for GPUTarget("cuda", 90, 128). Skipped unless the installed
Triton has the Gluon API the kernel is written against (Triton 3.6; later releases renamed parts of it).
The PTX must hold the schedule's instructions: wgmma (async, with waits), TMA bulk tensor loads,
mbarrier waits, setmaxnreg for the partitions, and no local memory (spills)."""

import re

import pytest

from attn.kernels import gluon_softmax_fwd as gsf

OK, WHY = gsf.gluon_api_available()
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
