"""scripts/gpu_checks/ab_gluon_backward.py on the CPU: the other version's kernel modules load as modules of
their own, each bound to the other version's modules it imports, and this tree's modules stay in place."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_checks"))

import ab_gluon_backward as ab  # noqa: E402


def test_the_other_versions_modules_import_each_other_and_this_trees_stay(tmp_path):
    import attn.kernels.gluon_weighted_bwd as weighted

    source = (ROOT / "attn" / "kernels" / "gluon_weighted_bwd.py").read_text()
    (tmp_path / "gluon_weighted_bwd.py").write_text(source + "\nOTHER_VERSION = True\n")
    versions = ab.load_versions(tmp_path)
    old, new = versions["old"], versions["new"]
    assert getattr(old["gluon_weighted_bwd"], "OTHER_VERSION", False)
    assert not hasattr(new["gluon_weighted_bwd"], "OTHER_VERSION")
    # the other version's differential backward runs the other version's key-block step
    assert old["gluon_diff_bwd"]._dkdv_block is old["gluon_weighted_bwd"]._dkdv_block
    assert new["gluon_diff_bwd"]._dkdv_block is new["gluon_weighted_bwd"]._dkdv_block
    assert old["gluon_weighted_bwd"]._dkdv_block is not new["gluon_weighted_bwd"]._dkdv_block
    # a file the folder lacks is this tree's, loaded again as the other version's own module
    assert old["gluon_softmax_bwd"] is not new["gluon_softmax_bwd"]
    assert sys.modules["attn.kernels.gluon_weighted_bwd"] is weighted is new["gluon_weighted_bwd"]


def test_every_case_names_a_known_variant_and_launch_option():
    options = {"temperature", "persistent", "form", "dkdv_form", "dq_form"}
    for variant, shape, causal, opts in ab.CASES + ab.TIMED:
        assert variant in (*ab.CAPS, "threshold", "sigmoid", "diff_threshold")
        assert len(shape) == 6 and isinstance(causal, bool) and set(opts) <= options
