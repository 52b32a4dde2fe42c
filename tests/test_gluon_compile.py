"""The Gluon sm_90 softmax forward (attn/kernels/gluon_softmax_fwd.py) and backward
(attn/kernels/gluon_softmax_bwd.py) compile for Hopper on the CPU.

No GPU: triton.compile on a GluonASTSource for GPUTarget("cuda", 90, 128). Skipped unless the installed
Triton has the Gluon API the kernel is written against (Triton 3.6; later releases renamed parts of it).
The PTX must hold the schedule's instructions: wgmma (async, with waits), TMA bulk tensor loads,
mbarrier waits, setmaxnreg for the partitions, and no local memory (spills); the SASS of both key-block
loops (scripts/analysis/gluon_sass_counts.py, Triton's cuobjdump) multiplies by the scale in no per-score FMUL.
The backward's key-block (dK / dV) and query-block (dQ) kernels: the same PTX checks, and SASS loops with
their wgmma counts, one exp2 per score and no local memory inside a loop; the same for their capped and
tempered forms (and d-temperature in the dQ kernel), whose caps add one MUFU per score. The one-pass dQ form's
key-block kernel (ATTNLAB_GLUON_DQ=one_pass): the same checks with the dQ product and its TMA reduce-add per
iteration, and its delta (zeroing the fp32 dq) and scale-and-cast kernels.

The threshold and sigmoid backwards (attn/kernels/gluon_weighted_bwd.py): the same PTX checks, the same
wgmma counts per loop, MUFU ops per score as their math needs (none for the threshold at p = 1 and 2, two for
any other p and for the sigmoid) and no local memory inside a loop; their persistent kernels the per-item
kernels' wgmma count and one more mbarrier.

The differential threshold forward (attn/kernels/gluon_diff_fwd.py): the same PTX checks, per loop iteration
both views' S products and one W V product, MUFU ops per score as the power needs (none at p = 1 and 2, a
MUFU lg2 and ex2 per view's score for any other p) and no local memory inside a loop.

The differential threshold backward (attn/kernels/gluon_diff_bwd.py): the same PTX checks, per loop iteration
the products of its kernel (key-block forms: S1^T, S2^T, dP^T, dV, dK and, fused, dK2; the second view's S2^T,
dP^T, dK2; the view warpgroups' S^T, dP^T, dV, dK each; the query-block kernel S1, S2, dP, dQ, dQ2, its view
warpgroups S, dP, dQ each), the
power's MUFU ops and no local memory inside a loop (a bounded few for the view warpgroups at D = 128 with a
general power).

The backwards' key-block kernels compiled again with ROW_VALUES_AHEAD on (each query block's row values
loaded or computed during the block before; on by default in the softmax family's) against the same kernels
with it off: the same products and MUFU ops per loop and no more local memory in them.

The forwards' ping-pong form (PINGPONG: the two consumer warpgroups take turns at issuing their wgmmas,
attn/kernels/gluon_pipeline.py), softmax family (every cap, a temperature) and threshold / sigmoid: the same
PTX checks, the loops' wgmma counts and MUFU ops, no local memory anywhere, and the turn protocol as the SASS
reads (scripts/analysis/gluon_sass_counts.turn_events): every turn wait is followed by wgmma issues only, up to
the pass or the wgmma wait; no ring mbarrier wait while a warpgroup holds the turn; and per kernel the waits
and passes the protocol counts.

The compiles run in one child Python per test session with TRITON_INTERPRET=0: on a machine without a GPU
conftest.py sets TRITON_INTERPRET=1 before Triton is imported, which turns Triton's own jit helpers (the
combine functions behind gl.sum and gl.max) into interpreter objects that a Gluon compile cannot call
(a Triton cache warmed by an earlier compile outside pytest hides that).
"""

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn.kernels import gluon_pipeline

ROOT = Path(__file__).resolve().parents[1]

OK, WHY = gluon_pipeline.gluon_api_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"Gluon Hopper API of Triton 3.6 not available: {WHY}")

# what the tests below compile: name -> (kernel module, compile_sm90 arguments, gluon_sass_counts variant or None)
REQUESTS = {
    **{f"fwd-{d}-{c}": ("gluon_softmax_fwd", dict(head_dim=d, dtype="bf16", causal=c), "softmax")
       for d, c in ((64, True), (128, False))},
    **{f"{k}-{d}-{c}-{t}": ("gluon_softmax_bwd", dict(head_dim=d, dtype=t, causal=c, kernel=k), f"bwd_{k}")
       for k in ("dkdv", "dq") for d, c, t in ((64, True, "bf16"), (128, False, "fp16"), (128, True, "bf16"),
                                                (128, False, "bf16"))},
    "delta": ("gluon_softmax_bwd", dict(head_dim=128, dtype="bf16", causal=True, kernel="delta"), None),
    # the persistent forward (one program per SM, work items in turn)
    **{f"fwd_persistent-{d}-{c}-{cap}": ("gluon_softmax_fwd", dict(head_dim=d, dtype="bf16", causal=c, cap=cap,
                                                                   fixed_shift=cap == 1, persistent=True), None)
       for d, c, cap in ((64, True, 0), (128, False, 0), (128, True, 1))},
}
# the threshold and sigmoid kernels (gluon_weighted_fwd, gluon_weighted_bwd): name -> compile_sm90's weight
# arguments
WEIGHTS = {"threshold": dict(weight=1, power=2.0), "threshold_p1": dict(weight=1, power=1.0),
           "threshold_p1.5": dict(weight=1, power=1.5), "sigmoid": dict(weight=2)}
# the threshold and sigmoid forwards, per item and persistent: (weight name, D, causal)
WEIGHTED_PERSISTENT = [("threshold", 128, True), ("threshold_p1.5", 64, False), ("sigmoid", 64, True),
                       ("sigmoid", 128, False)]
REQUESTS.update({
    f"weighted_fwd{form}-{name}-{d}-{c}": ("gluon_weighted_fwd", dict(head_dim=d, dtype="bf16", causal=c,
                                                                      persistent=form == "_persistent",
                                                                      **WEIGHTS[name]), None)
    for name, d, c in WEIGHTED_PERSISTENT for form in ("", "_persistent")})
WEIGHTED_CONFIGS = {"threshold": ((64, True, "bf16"), (128, False, "fp16"), (128, True, "bf16")),
                    "threshold_p1": ((128, True, "bf16"),), "threshold_p1.5": ((128, True, "bf16"),),
                    "sigmoid": ((64, True, "bf16"), (128, False, "fp16"), (128, True, "bf16"))}
REQUESTS.update({
    f"{name}-{k}-{d}-{c}-{t}": ("gluon_weighted_bwd", dict(head_dim=d, dtype=t, causal=c, kernel=k, **WEIGHTS[name]),
                                f"{name}_bwd_{k}")
    for name, configs in WEIGHTED_CONFIGS.items() for k in ("dkdv", "dq") for d, c, t in configs})
# their persistent kernels: (weight name, kernel, D, causal, dtype), each beside a WEIGHTED_CONFIGS entry
WEIGHTED_BACKWARD_PERSISTENT = [("threshold", "dkdv", 64, True, "bf16"), ("threshold", "dq", 64, True, "bf16"),
                                ("threshold_p1.5", "dkdv", 128, True, "bf16"),
                                ("threshold_p1.5", "dq", 128, True, "bf16"),
                                ("sigmoid", "dkdv", 128, False, "fp16"), ("sigmoid", "dq", 128, True, "bf16")]
REQUESTS.update({
    f"{name}-{k}_persistent-{d}-{c}-{t}": ("gluon_weighted_bwd", dict(head_dim=d, dtype=t, causal=c, kernel=k,
                                                                      persistent=True, **WEIGHTS[name]), None)
    for name, k, d, c, t in WEIGHTED_BACKWARD_PERSISTENT})
# the backward's capped / tempered forms: (gluon_sass_counts variant, its compile_sm90 arguments, D, causal, dtype)
CAPPED_BACKWARD = [
    ("bwd_dkdv_tanh", dict(kernel="dkdv", cap=1), 128, True, "bf16"),
    ("bwd_dkdv_soft_sign", dict(kernel="dkdv", cap=2), 64, True, "bf16"),
    ("bwd_dkdv_alsc", dict(kernel="dkdv", cap=3), 128, True, "bf16"),
    ("bwd_dkdv_alsc_temperature", dict(kernel="dkdv", cap=3, has_temp=True), 128, True, "fp16"),
    ("bwd_dkdv_tanh", dict(kernel="dkdv", cap=1), 64, False, "fp16"),
    ("bwd_dkdv_temperature", dict(kernel="dkdv", has_temp=True), 64, True, "bf16"),
    ("bwd_dq_tanh", dict(kernel="dq", cap=1), 64, True, "bf16"),
    ("bwd_dq_soft_sign", dict(kernel="dq", cap=2), 128, True, "bf16"),
    ("bwd_dq_alsc", dict(kernel="dq", cap=3), 128, False, "fp16"),
    ("bwd_dq_temperature", dict(kernel="dq", has_temp=True), 128, True, "bf16"),
    ("bwd_dq_temperature_dt", dict(kernel="dq", has_temp=True, need_dt=True), 64, True, "bf16"),
    ("bwd_dq_alsc_temperature_dt", dict(kernel="dq", cap=3, has_temp=True, need_dt=True), 128, True, "bf16"),
]
REQUESTS.update({f"{variant}-{d}-{c}-{t}": ("gluon_softmax_bwd", dict(head_dim=d, dtype=t, causal=c, **kwargs), variant)
                 for variant, kwargs, d, c, t in CAPPED_BACKWARD})
# the separate form's persistent kernels: (per-item REQUESTS entry, its compile_sm90 arguments)
SOFTMAX_BACKWARD_PERSISTENT = [
    ("dkdv-64-True-bf16", dict(kernel="dkdv", head_dim=64, dtype="bf16", causal=True)),
    ("dq-128-False-fp16", dict(kernel="dq", head_dim=128, dtype="fp16", causal=False)),
    ("bwd_dkdv_tanh-128-True-bf16", dict(kernel="dkdv", cap=1, head_dim=128, dtype="bf16", causal=True)),
    ("bwd_dq_alsc_temperature_dt-128-True-bf16", dict(kernel="dq", cap=3, has_temp=True, need_dt=True, head_dim=128,
                                                      dtype="bf16", causal=True)),
]
REQUESTS.update({f"{entry}_persistent": ("gluon_softmax_bwd", dict(persistent=True, **kwargs), None)
                 for entry, kwargs in SOFTMAX_BACKWARD_PERSISTENT})
# the one-pass dQ form's key-block kernel (ATTNLAB_GLUON_DQ=one_pass): (gluon_sass_counts variant, compile_sm90
# arguments, D, causal, dtype)
ONE_PASS_BACKWARD = [
    ("bwd_dkdv_one_pass", dict(kernel="dkdv_one_pass"), 128, True, "bf16"),
    ("bwd_dkdv_one_pass", dict(kernel="dkdv_one_pass"), 128, False, "fp16"),
    ("bwd_dkdv_one_pass", dict(kernel="dkdv_one_pass"), 64, True, "bf16"),
    ("bwd_dkdv_one_pass_tanh", dict(kernel="dkdv_one_pass", cap=1), 128, True, "bf16"),
    ("bwd_dkdv_one_pass_tanh", dict(kernel="dkdv_one_pass", cap=1), 64, False, "fp16"),
    ("bwd_dkdv_one_pass_alsc_temperature", dict(kernel="dkdv_one_pass", cap=3, has_temp=True), 64, True, "bf16"),
    ("bwd_dkdv_one_pass_temperature", dict(kernel="dkdv_one_pass", has_temp=True), 128, True, "bf16"),
]
REQUESTS.update({f"{variant}-{d}-{c}-{t}": ("gluon_softmax_bwd", dict(head_dim=d, dtype=t, causal=c, **kwargs), variant)
                 for variant, kwargs, d, c, t in ONE_PASS_BACKWARD})
REQUESTS.update({kernel: ("gluon_softmax_bwd", dict(head_dim=128, dtype="bf16", causal=True, kernel=kernel), None)
                 for kernel in ("delta_zero_dq", "dq_cast")})
# the threshold and sigmoid backwards' one-pass key-block kernel (`one_pass=True`): (weight name, D, causal, dtype)
WEIGHTED_ONE_PASS = [("threshold", 128, True, "bf16"), ("threshold", 128, False, "fp16"),
                     ("threshold", 64, True, "bf16"), ("threshold_p1", 128, True, "bf16"),
                     ("threshold_p1.5", 128, True, "bf16"), ("sigmoid", 128, True, "bf16"),
                     ("sigmoid", 64, False, "bf16")]
REQUESTS.update({
    f"{name}-dkdv_one_pass-{d}-{c}-{t}": ("gluon_weighted_bwd",
                                          dict(head_dim=d, dtype=t, causal=c, kernel="dkdv_one_pass", **WEIGHTS[name]),
                                          f"{name}_bwd_dkdv_one_pass")
    for name, d, c, t in WEIGHTED_ONE_PASS})
# every one-pass key-block kernel's REQUESTS name, and its D: the softmax family's, the threshold's and sigmoid's
ONE_PASS_KERNELS = ([(f"{v}-{d}-{c}-{t}", d) for v, _, d, c, t in ONE_PASS_BACKWARD]
                    + [(f"{name}-dkdv_one_pass-{d}-{c}-{t}", d) for name, d, c, t in WEIGHTED_ONE_PASS])
# the differential threshold forward: (gluon_sass_counts variant, its power, D, causal, dtype)
DIFFERENTIAL = [
    ("diff_threshold", 2.0, 128, True, "bf16"),
    ("diff_threshold", 2.0, 64, True, "bf16"),
    ("diff_threshold", 2.0, 128, False, "fp16"),
    ("diff_threshold", 2.0, 64, False, "bf16"),
    ("diff_threshold_p1", 1.0, 128, True, "bf16"),
    ("diff_threshold_p1", 1.0, 64, True, "fp16"),
    ("diff_threshold_p1.5", 1.5, 128, True, "bf16"),
    ("diff_threshold_p1.5", 1.5, 64, False, "bf16"),
]
REQUESTS.update({f"{variant}-{d}-{c}-{t}": ("gluon_diff_fwd", dict(head_dim=d, dtype=t, causal=c, power=power), variant)
                 for variant, power, d, c, t in DIFFERENTIAL})
# its persistent form: (power, D, causal, dtype), each beside a DIFFERENTIAL entry of the per-item kernel
DIFFERENTIAL_PERSISTENT = [(2.0, 128, True, "bf16"), (2.0, 64, False, "bf16"), (1.5, 128, True, "bf16")]
REQUESTS.update({f"diff_threshold_persistent-{p}-{d}-{c}-{t}": ("gluon_diff_fwd", dict(head_dim=d, dtype=t, causal=c,
                                                                                        power=p, persistent=True), None)
                 for p, d, c, t in DIFFERENTIAL_PERSISTENT})
# the differential threshold backward: (gluon_sass_counts variant, its kernel, power, D, causal, dtype)
DIFFERENTIAL_BACKWARD = [
    (f"diff_bwd_{kernel}{suffix}", kernel, power, d, c, t)
    for kernel in ("dkdv", "dkdv_second", "dkdv_views", "dkdv_exchange", "dq", "dq_persistent", "dq_views",
                   "dkdv_persistent", "dkdv_second_persistent")
    for suffix, power, d, c, t in (("", 2.0, 128, True, "bf16"), ("", 2.0, 64, True, "bf16"),
                                   ("", 2.0, 128, False, "fp16"), ("_p1", 1.0, 64, False, "bf16"),
                                   ("_p1", 1.0, 128, True, "fp16"), ("_p1.5", 1.5, 128, True, "bf16"),
                                   ("_p1.5", 1.5, 64, False, "bf16"))]
# the fused form (D = 64) on 32-row query blocks (gluon_diff_bwd's fused_query_rows=32; FUSED_QUERY_ROWS is 64)
DIFFERENTIAL_BACKWARD += [("diff_bwd_dkdv_fused32", "dkdv", 2.0, 64, True, "bf16"),
                          ("diff_bwd_dkdv_fused32_p1", "dkdv", 1.0, 64, False, "fp16"),
                          ("diff_bwd_dkdv_fused32_p1.5", "dkdv", 1.5, 64, True, "bf16")]
REQUESTS.update({f"{variant}-{d}-{c}-{t}": ("gluon_diff_bwd", dict(head_dim=d, dtype=t, causal=c, kernel=kernel,
                                                                   power=power, **({"block_m": 32} if "fused32" in
                                                                                    variant else {})), variant)
                 for variant, kernel, power, d, c, t in DIFFERENTIAL_BACKWARD})


# the forwards' ping-pong form: (gluon_sass_counts variant, its kernel module, D, causal, dtype)
PINGPONG = [
    ("softmax_pingpong", "gluon_softmax_fwd", 64, True, "bf16"),
    ("softmax_pingpong", "gluon_softmax_fwd", 128, False, "bf16"),
    ("tanh_pingpong", "gluon_softmax_fwd", 128, True, "bf16"),
    ("tanh_online_pingpong", "gluon_softmax_fwd", 64, False, "fp16"),
    ("soft_sign_pingpong", "gluon_softmax_fwd", 64, True, "bf16"),
    ("alsc_pingpong", "gluon_softmax_fwd", 128, True, "bf16"),
    ("alsc_temperature_pingpong", "gluon_softmax_fwd", 128, False, "fp16"),
    ("temperature_pingpong", "gluon_softmax_fwd", 64, True, "bf16"),
    ("sigmoid_pingpong", "gluon_weighted_fwd", 128, True, "bf16"),
    ("sigmoid_pingpong", "gluon_weighted_fwd", 64, False, "bf16"),
    ("threshold_pingpong", "gluon_weighted_fwd", 128, False, "fp16"),
    ("threshold_p1.5_pingpong", "gluon_weighted_fwd", 64, True, "bf16"),
]
PINGPONG_IDS = [f"{v}-{d}-{'causal' if c else 'full'}-{t}" for v, _, d, c, t in PINGPONG]
REQUESTS.update({f"{variant}-{d}-{c}-{t}": (module, {"head_dim": d, "dtype": t, "causal": c, "turns": True}, variant)
                 for variant, module, d, c, t in PINGPONG})


CHILD = r'''
import json, sys
root, requests = sys.argv[1], json.loads(sys.stdin.read())
sys.path[:0] = [root, root + "/scripts/analysis"]
import gluon_sass_counts as counts
from sass_listing import cuobjdump, parse_sass
from attn.kernels import (gluon_diff_bwd, gluon_diff_fwd, gluon_softmax_bwd, gluon_softmax_fwd, gluon_weighted_bwd,
                          gluon_weighted_fwd)
if sys.argv[2:] in (["ahead"], ["in_block"]):  # the key-block loops' row values, whatever the modules' setting
    from triton.experimental.gluon import language as gl
    for module in (gluon_softmax_bwd, gluon_weighted_bwd, gluon_diff_bwd):
        module.ROW_VALUES_AHEAD = gl.constexpr(sys.argv[2] == "ahead")
modules = {"gluon_softmax_fwd": gluon_softmax_fwd, "gluon_softmax_bwd": gluon_softmax_bwd,
           "gluon_weighted_bwd": gluon_weighted_bwd, "gluon_diff_fwd": gluon_diff_fwd,
           "gluon_diff_bwd": gluon_diff_bwd, "gluon_weighted_fwd": gluon_weighted_fwd}
out = {}
for name, (module, kwargs, variant) in requests.items():
    turns = kwargs.pop("turns", False)
    if variant in counts.VARIANTS and "pingpong" in counts.VARIANTS[variant]:  # the variant's form arguments
        kwargs = {**counts.VARIANTS[variant], **kwargs}
    compiled = modules[module].compile_sm90(**kwargs)
    rows = None
    if variant is not None:
        rows = counts.count(modules[module], kwargs["head_dim"], kwargs["causal"], kwargs["dtype"], variant=variant)
    tile_width = counts.tile_width(modules[module], variant, kwargs["head_dim"]) if variant else None
    events = counts.turn_events(parse_sass(cuobjdump(compiled.asm["cubin"], "-sass"))) if turns else None
    out[name] = {"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared, "loops": rows,
                 "tile_width": tile_width, "turns": events,
                 "tensordesc_meta": getattr(compiled.metadata, "tensordesc_meta", None),
                 "ttgir_reduces": [line.strip() for line in compiled.asm["ttgir"].splitlines()
                                   if "ttng.async_tma_reduce" in line],
                 "ttgir_reinterprets": compiled.asm["ttgir"].count("ttg.memdesc_reinterpret")}
print(json.dumps(out))
'''


def _compile(requests: dict, *flags: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), *flags], input=json.dumps(requests), env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def compiled():
    """name -> {"ptx", "shared", "loops" (gluon_sass_counts rows), "tile_width"} of every REQUESTS entry."""
    return _compile(REQUESTS)


# the key-block kernels whose loops take ROW_VALUES_AHEAD (gluon_softmax_bwd, gluon_weighted_bwd, used by
# gluon_diff_bwd), compiled again with it on
AHEAD_REQUESTS = {name: request for name, request in REQUESTS.items()
                  if request[1].get("kernel", "").startswith("dkdv") and request[2] is not None}


@pytest.fixture(scope="module")
def compiled_ahead():
    """`compiled`'s entries of AHEAD_REQUESTS with the row values a block ahead."""
    return _compile(AHEAD_REQUESTS, "ahead")


@pytest.fixture(scope="module")
def compiled_in_block():
    """`compiled`'s entries of AHEAD_REQUESTS with each block computing or loading its own row values."""
    return _compile(AHEAD_REQUESTS, "in_block")


def _assert_hopper_schedule(ptx: str, dtype: str):
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{dtype}\.{dtype}", ptx)
    assert "wgmma.wait_group" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "mbarrier.try_wait" in ptx
    assert "setmaxnreg" in ptx  # warp-specialized partitions with their own register budgets
    assert not re.search(r"\.local\b|\bld\.local|\bst\.local", ptx)


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_compiles_for_sm90_with_wgmma_and_tma(compiled, head_dim, causal):
    result = compiled[f"fwd-{head_dim}-{causal}"]
    _assert_hopper_schedule(result["ptx"], "bf16")
    assert result["shared"] <= 227 * 1024


@pytest.mark.parametrize("head_dim,causal,cap", [(64, True, 0), (128, False, 0), (128, True, 1)])
def test_persistent_forward_compiles_with_the_same_schedule(compiled, head_dim, causal, cap):
    """The persistent form keeps the per-item kernel's Hopper schedule and products (the same consumer
    per work item), plus the query tile's empty barrier."""
    result = compiled[f"fwd_persistent-{head_dim}-{causal}-{cap}"]
    _assert_hopper_schedule(result["ptx"], "bf16")
    assert result["shared"] <= 227 * 1024
    per_item = compiled[f"fwd-{head_dim}-{causal}"]["ptx"] if cap == 0 else None
    if per_item is not None:
        assert result["ptx"].count("wgmma.mma_async") == per_item.count("wgmma.mma_async")
        assert result["ptx"].count("mbarrier.init") == per_item.count("mbarrier.init") + 1


@pytest.mark.parametrize("name,head_dim,causal", WEIGHTED_PERSISTENT)
def test_persistent_weighted_forward_compiles_with_the_per_item_products(compiled, name, head_dim, causal):
    """The threshold and sigmoid forwards' persistent form: the per-item kernel's Hopper schedule and wgmma
    count (the same consumer per work item), plus the query tile's empty barrier."""
    per_item = compiled[f"weighted_fwd-{name}-{head_dim}-{causal}"]["ptx"]
    result = compiled[f"weighted_fwd_persistent-{name}-{head_dim}-{causal}"]
    _assert_hopper_schedule(per_item, "bf16")
    _assert_hopper_schedule(result["ptx"], "bf16")
    assert result["shared"] <= 227 * 1024
    assert result["ptx"].count("wgmma.mma_async") == per_item.count("wgmma.mma_async")
    assert result["ptx"].count("mbarrier.init") == per_item.count("mbarrier.init") + 1


@pytest.mark.parametrize("name,kernel,head_dim,causal,dtype", WEIGHTED_BACKWARD_PERSISTENT)
def test_persistent_weighted_backward_compiles_with_the_per_item_products(compiled, name, kernel, head_dim, causal,
                                                                          dtype):
    """The threshold and sigmoid backwards' persistent dK / dV and dQ kernels: the per-item kernel's Hopper
    schedule and wgmma count (the same consumer per work item), plus the once-per-item tiles' empty barrier."""
    per_item = compiled[f"{name}-{kernel}-{head_dim}-{causal}-{dtype}"]["ptx"]
    result = compiled[f"{name}-{kernel}_persistent-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024
    assert result["ptx"].count("wgmma.mma_async") == per_item.count("wgmma.mma_async")
    assert result["ptx"].count("mbarrier.init") == per_item.count("mbarrier.init") + 1


@pytest.mark.parametrize("entry,kwargs", SOFTMAX_BACKWARD_PERSISTENT, ids=[e for e, _ in SOFTMAX_BACKWARD_PERSISTENT])
def test_persistent_softmax_backward_compiles_with_the_per_item_products(compiled, entry, kwargs):
    """The softmax family backward's persistent dK / dV and dQ kernels (plain, capped, tempered with d-temperature):
    the per-item kernel's Hopper schedule and wgmma count, plus the once-per-item tiles' empty barrier."""
    per_item = compiled[entry]["ptx"]
    result = compiled[f"{entry}_persistent"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[kwargs["dtype"]])
    assert result["shared"] <= 227 * 1024
    assert result["ptx"].count("wgmma.mma_async") == per_item.count("wgmma.mma_async")
    assert result["ptx"].count("mbarrier.init") == per_item.count("mbarrier.init") + 1


@pytest.mark.parametrize("power,head_dim,causal,dtype", DIFFERENTIAL_PERSISTENT)
def test_persistent_differential_forward_compiles_with_the_per_item_products(compiled, power, head_dim, causal, dtype):
    """The differential threshold forward's persistent form: the per-item kernel's Hopper schedule and wgmma
    count, plus the query tiles' empty barrier."""
    variant = {2.0: "diff_threshold", 1.5: "diff_threshold_p1.5"}[power]
    per_item = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]["ptx"]
    result = compiled[f"diff_threshold_persistent-{power}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], dtype)
    assert result["shared"] <= 227 * 1024
    assert result["ptx"].count("wgmma.mma_async") == per_item.count("wgmma.mma_async")
    assert result["ptx"].count("mbarrier.init") == per_item.count("mbarrier.init") + 1


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_softmax_loops_fold_the_scale_into_one_ffma_per_score(compiled, head_dim, causal):
    """Per thread a key block holds 64 scores (64 rows x BLOCK_N over 128 threads) and HEAD_DIM / 2
    accumulator elements: the scale rides in the exp2 argument's FFMA (qk * qk_scale - m), so FMUL is
    left for the accumulator's rescale only. No spills."""
    block_n = gluon_pipeline.tile_config(head_dim)["BLOCK_N"]
    scores = 64 * block_n // 128
    rows = {row["loop"]: row for row in compiled[f"fwd-{head_dim}-{causal}"]["loops"]}
    assert set(rows) == {"unmasked", "masked"}
    for row in rows.values():
        assert row["hgmma"] == head_dim // 16 + block_n // 16  # S = Q K^T (k 16 a step), O += P V (k 16)
        assert row["ffma"] >= scores and row["mufu"] >= scores, row
        assert row["fmul"] <= head_dim // 2 + 4, row
        assert row["spills"] == 0


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("head_dim,causal,dtype", [(64, True, "bf16"), (128, False, "fp16"), (128, True, "bf16")])
def test_backward_compiles_for_sm90_with_wgmma_and_tma(compiled, kernel, head_dim, causal, dtype):
    result = compiled[f"{kernel}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024


def test_backward_delta_kernel_compiles(compiled):
    ptx = compiled["delta"]["ptx"]
    assert "ld.global" in ptx and "st.global" in ptx


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (128, True)])
def test_backward_loops_run_their_products_with_one_exp2_per_score_and_no_local_memory(compiled, kernel, head_dim,
                                                                                       causal):
    """Per iteration the key-block loop runs S^T = K Q^T and dP^T = V dO^T (k = D), dV += P^T dO and
    dK += dS^T Q (k = BLOCK_M); the query-block loop S = Q K^T and dP = dO V^T (k = D), dQ += dS K
    (k = BLOCK_N); a wgmma takes 16 of k per instruction. One MUFU.EX2 per score of the warpgroup's
    64 x width tile (width / 2 per thread)."""
    result = compiled[f"{kernel}-{head_dim}-{causal}-bf16"]
    rows = {row["loop"]: row for row in result["loops"]}
    width = result["tile_width"]
    expected_loops = {"unmasked"} if (kernel == "dkdv" and not causal) else {"unmasked", "masked"}
    assert set(rows) == expected_loops
    products_over_width = 2 if kernel == "dkdv" else 1  # dV and dK, or dQ
    for row in rows.values():
        assert row["hgmma"] == 2 * (head_dim // 16) + products_over_width * (width // 16), row
        assert row["mufu"] >= width // 2, row
        assert row["loop_spills"] == 0, row


WEIGHTED_CASES = [(name, k, d, c, t) for name, configs in WEIGHTED_CONFIGS.items() for k in ("dkdv", "dq")
                  for d, c, t in configs]


@pytest.mark.parametrize("name,kernel,head_dim,causal,dtype", WEIGHTED_CASES,
                         ids=[f"{n}-{k}-{d}-{'causal' if c else 'full'}-{t}" for n, k, d, c, t in WEIGHTED_CASES])
def test_weighted_backward_compiles_for_sm90_with_its_products_and_no_local_memory_in_a_loop(compiled, name, kernel,
                                                                                           head_dim, causal, dtype):
    """The softmax backward's schedule (the PTX checks, the loops' wgmma counts) with the threshold's or the
    sigmoid's weight per score: p = 1 and 2 without a MUFU op per score (a handful per loop for the row
    thresholds), any other p a MUFU lg2 and ex2, the sigmoid a MUFU ex2 and rcp (width / 2 scores per
    thread)."""
    result = compiled[f"{name}-{kernel}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    width = result["tile_width"]
    assert set(rows) == ({"unmasked"} if (kernel == "dkdv" and not causal) else {"unmasked", "masked"})
    products_over_width = 2 if kernel == "dkdv" else 1
    for row in rows.values():
        assert row["hgmma"] == 2 * (head_dim // 16) + products_over_width * (width // 16), row
        if name in ("threshold", "threshold_p1"):
            assert row["mufu"] <= 4, row
        else:
            assert row["mufu"] >= width, row
        assert row["loop_spills"] == 0, row


@pytest.mark.parametrize("variant,kwargs,head_dim,causal,dtype", CAPPED_BACKWARD,
                         ids=[f"{v}-{d}-{'causal' if c else 'full'}-{t}" for v, _, d, c, t in CAPPED_BACKWARD])
def test_capped_and_tempered_backward_compiles_with_the_plain_products_and_no_local_memory_in_its_loops(
        compiled, variant, kwargs, head_dim, causal, dtype):
    """The capped / tempered kernels keep the plain schedule (the same wgmma per loop iteration) and add
    the cap's MUFU (tanh or rcp) beside the exp2 of each score; no loop spills."""
    result = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    width = result["tile_width"]
    assert set(rows) == ({"unmasked"} if (kwargs["kernel"] == "dkdv" and not causal) else {"unmasked", "masked"})
    products_over_width = 2 if kwargs["kernel"] == "dkdv" else 1
    mufu_per_score = 2 if kwargs.get("cap", 0) else 1
    for row in rows.values():
        assert row["hgmma"] == 2 * (head_dim // 16) + products_over_width * (width // 16), row
        assert row["mufu"] >= mufu_per_score * width // 2, row
        assert row["loop_spills"] == 0, row


# local-memory instructions (values ptxas spilled) in the one-pass key-block loops compiled below
# (scripts/analysis/gluon_sass_counts.py, Triton 3.6's ptxas), all at D = 128 causal, where the dQ product runs
# once per half of the keys: the plain unmasked loop 3, tanh's masked loop 4, each tempered loop 7; no other
# loop here has any
ONE_PASS_LOOP_SPILLS = {("bwd_dkdv_one_pass", 128, "unmasked"): 3, ("bwd_dkdv_one_pass_tanh", 128, "masked"): 4,
                        ("bwd_dkdv_one_pass_temperature", 128, "unmasked"): 7,
                        ("bwd_dkdv_one_pass_temperature", 128, "masked"): 7}


@pytest.mark.parametrize("variant,kwargs,head_dim,causal,dtype", ONE_PASS_BACKWARD,
                         ids=[f"{v}-{d}-{'causal' if c else 'full'}-{t}" for v, _, d, c, t in ONE_PASS_BACKWARD])
def test_one_pass_backward_adds_the_dq_product_and_a_tma_reduce_to_each_key_block_iteration(
        compiled, variant, kwargs, head_dim, causal, dtype):
    """The one-pass form's key-block kernel: the key-block schedule's products (S^T, dP^T with k = D; dV, dK
    with k = BLOCK_M) plus dQ's columns of a warpgroup over all BLOCK_N keys (k = BLOCK_N), dS through shared
    memory and the fp32 tile to global memory by a TMA bulk reduce-add (cp.reduce.async.bulk.tensor .add);
    one exp2 per score (and the cap's MUFU), within shared memory, and no local memory in a loop but
    ONE_PASS_LOOP_SPILLS' known ones. A masked loop with either mask."""
    from attn.kernels.gluon_softmax_bwd import dkdv_tile_config

    result = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]
    ptx = result["ptx"]
    _assert_hopper_schedule(ptx, {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)
    assert "cp.async.bulk.wait_group.read" in ptx  # the staging tile reused only once its reduce read it
    assert "stmatrix.sync.aligned.m8n8.x4.trans" in ptx  # dS^T to shared memory as dS
    assert "ldmatrix" in ptx  # dS back as the dQ product's register operand
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    width = result["tile_width"]
    assert set(rows) == {"unmasked", "masked"}  # full: the masked loop hides keys past the key length
    block_n = dkdv_tile_config(head_dim)["BLOCK_N"]
    mufu_per_score = 2 if kwargs.get("cap", 0) else 1
    for kind, row in rows.items():
        assert row["hgmma"] == 2 * (head_dim // 16) + 2 * (width // 16) + block_n // 16, row
        assert row["mufu"] >= mufu_per_score * width // 2, row
        assert row["loop_spills"] <= ONE_PASS_LOOP_SPILLS.get((variant, head_dim, kind), 0), row


# the weighted one-pass loops' local memory at D = 128 under the 168 registers a consumer warpgroup gets (the
# causal diagonal's masked loop, a few blocks per key block): (weight name, loop) -> spill instructions
WEIGHTED_ONE_PASS_LOOP_SPILLS = {("threshold", "masked"): 16, ("threshold_p1", "masked"): 20,
                                 ("threshold_p1.5", "unmasked"): 1, ("threshold_p1.5", "masked"): 3}


@pytest.mark.parametrize("name,head_dim,causal,dtype", WEIGHTED_ONE_PASS,
                         ids=[f"{n}-{d}-{'causal' if c else 'full'}-{t}" for n, d, c, t in WEIGHTED_ONE_PASS])
def test_weighted_one_pass_backward_adds_the_dq_product_and_a_tma_reduce_to_each_key_block_iteration(
        compiled, name, head_dim, causal, dtype):
    """The threshold's and sigmoid's one-pass key-block kernel: the separate form's key-block products plus a
    warpgroup's dQ columns over all BLOCK_N keys, dS through shared memory (stmatrix, ldmatrix) and the fp32 tile
    to global memory by TMA reduce-adds; the weight's MUFU ops once per score (none at p = 1, 2; lg2 and ex2 at
    a general p; ex2 and rcp for the sigmoid), within shared memory, a masked loop with either mask, and no local
    memory in a loop but WEIGHTED_ONE_PASS_LOOP_SPILLS' known ones."""
    from attn.kernels.gluon_softmax_bwd import dkdv_tile_config

    result = compiled[f"{name}-dkdv_one_pass-{head_dim}-{causal}-{dtype}"]
    ptx = result["ptx"]
    _assert_hopper_schedule(ptx, {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)
    assert "cp.async.bulk.wait_group.read" in ptx
    assert "stmatrix.sync.aligned.m8n8.x4.trans" in ptx and "ldmatrix" in ptx
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    assert set(rows) == {"unmasked", "masked"}
    width, block_n = result["tile_width"], dkdv_tile_config(head_dim)["BLOCK_N"]
    mufu_per_score = 0 if name in ("threshold", "threshold_p1") else 2
    for kind, row in rows.items():
        assert row["hgmma"] == 2 * (head_dim // 16) + 2 * (width // 16) + block_n // 16, row
        assert mufu_per_score * width // 2 <= row["mufu"] <= mufu_per_score * width // 2 + 2, row
        allowed = WEIGHTED_ONE_PASS_LOOP_SPILLS.get((name, kind), 0) if head_dim == 128 else 0
        assert row["loop_spills"] <= allowed, row


@pytest.mark.parametrize("name,head_dim", ONE_PASS_KERNELS, ids=[name for name, _ in ONE_PASS_KERNELS])
def test_one_pass_reduce_messages_cover_the_dq_tile(compiled, name, head_dim):
    """Each dQ reduce-add is one TMA message of the box the launcher encodes into the descriptor (the
    compiled kernel's tensordesc metadata), its source a subview of exactly that box, and each source
    site's calls together cover the warpgroup's BLOCK_M x D / 2 staging tile: a box narrower than what a
    message is meant to carry leaves dq columns unsummed."""
    from attn.kernels.gluon_softmax_bwd import dkdv_tile_config

    result = compiled[name]
    box = result["tensordesc_meta"][-1]["block_size"]  # dq_desc, the kernel's fifth descriptor
    reduces = result["ttgir_reduces"]
    assert reduces and result["ptx"].count("cp.reduce.async.bulk.tensor") == len(reduces)
    staging = [dkdv_tile_config(head_dim)["BLOCK_M"], head_dim // 2]
    sites = collections.Counter()
    for line in reduces:
        # the source's type: its shape, then the allocation's (printed for a subview only)
        source = re.search(r"!ttg\.memdesc<(\d+)x(\d+)xf32,[^>]*?(?:(\d+)x(\d+))?>", line)
        assert source, line
        rows, cols = int(source[1]), int(source[2])
        tile_rows, tile_cols = (int(source[3]), int(source[4])) if source[3] else (rows, cols)
        assert [rows, cols] == box and [tile_rows, tile_cols] == staging, (line, box, staging)
        sites[re.search(r"loc\(#loc\d+\)", line).group()] += 1
    assert all(calls * box[1] == staging[1] for calls in sites.values()), (sites, box, staging)


@pytest.mark.parametrize("name,head_dim", ONE_PASS_KERNELS, ids=[name for name, _ in ONE_PASS_KERNELS])
def test_one_pass_dq_product_reads_each_k_half_as_its_own_tile(compiled, name, head_dim):
    """The dQ product's K operand: subviews of each 64-key half's own TMA tile, no shared buffer reinterpreted.
    A view of both halves as one 128-row tile is wrong where a row spans two 128-byte-swizzle column blocks
    (D = 128): its rows 64-127 are the first half's second column block (the second GPU run's dq error)."""
    assert compiled[name]["ttgir_reinterprets"] == 0


def test_one_pass_delta_and_cast_kernels_compile(compiled):
    """The one-pass form's delta kernel also stores the fp32 dq's zeros; its last kernel reads fp32, stores dq."""
    assert compiled["delta_zero_dq"]["ptx"].count("st.global") > compiled["delta"]["ptx"].count("st.global")
    cast = compiled["dq_cast"]["ptx"]
    assert "ld.global" in cast and "st.global" in cast


@pytest.mark.parametrize("variant,power,head_dim,causal,dtype", DIFFERENTIAL,
                         ids=[f"{v}-{d}-{'causal' if c else 'full'}-{t}" for v, _, d, c, t in DIFFERENTIAL])
def test_differential_forward_runs_three_products_per_key_block_without_local_memory_in_its_loops(
        compiled, variant, power, head_dim, causal, dtype):
    """Per key block a consumer runs S1 = Q K^T and S2 = Q2 K2^T (k = D) and one O += W V (k = BLOCK_N), a
    wgmma taking 16 of k per instruction; the weights of both views need no MUFU op at p = 1 and 2 and a lg2
    and an ex2 per view's score otherwise (BLOCK_N / 2 positions per thread). Both score tiles and the
    accumulator stay in registers: no local memory in either loop."""
    result = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    width = result["tile_width"]
    assert set(rows) == {"unmasked", "masked"}
    for row in rows.values():
        assert row["hgmma"] == 2 * (head_dim // 16) + width // 16, row
        if power in (1.0, 2.0):
            assert row["mufu"] == 0, row
        else:
            assert row["mufu"] == 2 * 2 * (width // 2), row
        assert row["loop_spills"] == 0, row


@pytest.mark.parametrize("variant,kernel,power,head_dim,causal,dtype", DIFFERENTIAL_BACKWARD,
                         ids=[f"{v}-{d}-{'causal' if c else 'full'}-{t}" for v, _, _, d, c, t in DIFFERENTIAL_BACKWARD])
def test_differential_backward_runs_its_products_without_local_memory_in_its_loops(
        compiled, variant, kernel, power, head_dim, causal, dtype):
    """Per loop iteration (a k of 16 per wgmma instruction): the key-block kernel that computes dV (the fused form
    at D = 64, the first view's at D = 128) runs S1^T, S2^T, dP^T (k = D) and dV, dK (fused also dK2; k = its
    query block); the second view's key-block kernel S2^T, dP^T (k = D) and dK2; the query-block kernel S1, S2,
    dP (k = D) and dQ, dQ2 (k = its key block), the key-halves kernels and the query-block kernel on either grid
    (per item, persistent); the view-warpgroup form's loops (one per view's warpgroup) S^T,
    dP^T (k = D) and dV, dK (k = its query block); the view-exchange form's loops six products between them,
    view 1 S1^T, dP^T (k = D) and dK (k = its query block), view 2 S2^T (k = D) and dV, dK2 (k = its query
    block) (the row counted is the shorter loop, either view's); the query-block kernel's view-warpgroup form
    (one loop per view's warpgroup) S, dP (k = D) and dQ (k = its key block). The weights and gradients of both
    views need no MUFU op per score at p = 1 and 2 (a handful per loop for the row thresholds) and a lg2 and an
    ex2 per view's score otherwise (width / 2 scores per thread). Every score tile and accumulator stays in registers:
    no local memory in a loop, but for the view-warpgroup form at D = 128 with a general power (its lg2 / ex2
    temporaries beside two 64 x 128 accumulators and the view's lambda): at most 4 local-memory instructions
    per iteration (measured: 4 in the causal diagonal's loops, 2 in the second view's unmasked loop)."""
    result = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    width = result["tile_width"]
    assert set(rows) == ({"unmasked"} if (kernel.startswith("dkdv") and not causal) else {"unmasked", "masked"})
    products = {"dkdv": [(3, 3 if head_dim == 64 else 2)], "dkdv_second": [(2, 1)], "dkdv_views": [(2, 2)],
                "dkdv_exchange": [(2, 1), (1, 2)], "dq": [(3, 2)],
                "dq_views": [(2, 1)]}[kernel.removesuffix("_persistent")]
    # (products of k = D, products of k = width) per loop
    one_view = ("dkdv_second", "dkdv_views", "dkdv_exchange", "dq_views")
    views = 1 if kernel.removesuffix("_persistent") in one_view else 2
    spills_allowed = 4 if (kernel == "dkdv_views" and head_dim == 128 and power not in (1.0, 2.0)) else 0
    for row in rows.values():
        assert row["hgmma"] in [score * (head_dim // 16) + other * (width // 16) for score, other in products], row
        if power in (1.0, 2.0):
            assert row["mufu"] <= 4, row
        else:
            assert row["mufu"] >= views * width, row
        assert row["loop_spills"] <= spills_allowed, row


# the differential view warpgroups' one-pass form (p = 1 and 2): (gluon_sass_counts variant, power, D, causal, dtype)
DIFFERENTIAL_ONE_PASS = [("diff_bwd_dkdv_views_one_pass", 2.0, 128, True, "bf16"),
                         ("diff_bwd_dkdv_views_one_pass_p1", 1.0, 128, True, "fp16"),
                         ("diff_bwd_dkdv_views_one_pass", 2.0, 64, False, "bf16")]
# its loops' local memory at D = 128 under the 168 registers a consumer warpgroup gets: (variant, loop) -> spill
# instructions per iteration (the causal diagonal's masked loop, a block or two per key block)
DIFFERENTIAL_ONE_PASS_LOOP_SPILLS = {("diff_bwd_dkdv_views_one_pass", "unmasked"): 3,
                                     ("diff_bwd_dkdv_views_one_pass", "masked"): 26,
                                     ("diff_bwd_dkdv_views_one_pass_p1", "unmasked"): 3,
                                     ("diff_bwd_dkdv_views_one_pass_p1", "masked"): 38}


@pytest.fixture(scope="module")
def compiled_diff_one_pass():
    """`compiled`'s record of each DIFFERENTIAL_ONE_PASS kernel (a child of its own: the main one's time is spent)."""
    return _compile({f"{v}-{d}-{c}-{t}": ("gluon_diff_bwd", dict(head_dim=d, dtype=t, causal=c, power=p,
                                                                 kernel="dkdv_views_one_pass"), v)
                     for v, p, d, c, t in DIFFERENTIAL_ONE_PASS})


@pytest.mark.parametrize("variant,power,head_dim,causal,dtype", DIFFERENTIAL_ONE_PASS,
                         ids=[f"{v}-{d}-{'causal' if c else 'full'}-{t}" for v, _, d, c, t in DIFFERENTIAL_ONE_PASS])
def test_differential_one_pass_backward_adds_each_views_dq_products_and_reduces(
        compiled_diff_one_pass, variant, power, head_dim, causal, dtype):
    """The view warpgroups' one-pass kernel: per loop (one view's warpgroup) the view-warpgroup form's products
    (S^T, dP^T with k = D; dV, dK with k = its query block) plus the view's dQ over its 64 keys in D / 64 parts
    (k = 64 each), dS^T through the warpgroup's own shared tile (stmatrix, ldmatrix) and the fp32 parts to global
    memory by TMA reduce-adds whose staging waits leave the other tile's reduces in flight (wait_group.read 2);
    no MUFU op per score at p = 1 and 2; within shared memory; a masked loop with either mask; no local memory in
    a loop but DIFFERENTIAL_ONE_PASS_LOOP_SPILLS' known ones."""
    from attn.kernels.gluon_diff_bwd import one_pass_tile_config

    result = compiled_diff_one_pass[f"{variant}-{head_dim}-{causal}-{dtype}"]
    ptx = result["ptx"]
    _assert_hopper_schedule(ptx, {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+2;", ptx)
    assert "stmatrix.sync.aligned.m8n8.x4.trans" in ptx and "ldmatrix" in ptx
    assert result["shared"] <= 227 * 1024
    rows = {row["loop"]: row for row in result["loops"]}
    assert set(rows) == {"unmasked", "masked"}
    cfg, width = one_pass_tile_config(head_dim), result["tile_width"]
    for kind, row in rows.items():
        dq_products = (head_dim // cfg["DQ_COLS"]) * (cfg["BLOCK_N"] // 16)
        assert row["hgmma"] == 2 * (head_dim // 16) + 2 * (width // 16) + dq_products, row
        assert row["mufu"] <= 4, row
        allowed = DIFFERENTIAL_ONE_PASS_LOOP_SPILLS.get((variant, kind), 0) if head_dim == 128 else 0
        assert row["loop_spills"] <= allowed, row


@pytest.mark.parametrize("variant,module,head_dim,causal,dtype", PINGPONG, ids=PINGPONG_IDS)
def test_pingpong_forward_keeps_the_schedule_and_its_loops(compiled, variant, module, head_dim, causal, dtype):
    """The ping-pong form runs the default form's products per key block (S = Q K^T, O += P V: k = D and
    k = BLOCK_N) and its MUFU ops (the softmax family one exp2 per score and one more for a cap; the sigmoid
    an ex2 and an rcp; the threshold none at p = 2, a lg2 and an ex2 at p = 1.5), with no local memory
    anywhere in the kernel; each loop holds one turn wait and one pass (BAR.SYNC / BAR.ARV)."""
    result = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]
    _assert_hopper_schedule(result["ptx"], {"bf16": "bf16", "fp16": "f16"}[dtype])
    assert result["shared"] <= 227 * 1024
    assert re.search(r"bar\.sync\s+14, 256;", result["ptx"]) and re.search(r"bar\.arrive\s+15, 256;", result["ptx"])
    rows = {row["loop"]: row for row in result["loops"]}
    assert set(rows) == {"unmasked", "masked"}
    width = result["tile_width"]
    scores = 64 * width // 128
    form = variant.removesuffix("_pingpong")
    mufu = {"threshold": 0, "threshold_p1.5": 2 * scores, "sigmoid": 2 * scores}.get(
        form, (1 if form in ("softmax", "temperature") else 2) * scores)
    for row in rows.values():
        assert row["hgmma"] == head_dim // 16 + width // 16, row
        assert mufu <= row["mufu"] <= mufu + 4, row
        assert row["spills"] == 0 and row["loop_spills"] == 0, row
        assert row["sync"] >= 13, row  # the default loop's 11 synchronisations, a turn wait and a pass


@pytest.mark.parametrize("variant,module,head_dim,causal,dtype", PINGPONG, ids=PINGPONG_IDS)
def test_pingpong_turns_sit_around_the_wgmma_issue_groups(compiled, variant, module, head_dim, causal, dtype):
    """gluon_pipeline's protocol as the SASS reads in address order. Warpgroup 0 (the default partition)
    waits on barrier 14 and passes on 15, warpgroup 1 the reverse. Every turn wait is followed by one or
    two wgmma issue groups (S alone in group 0, S and P V in a loop, P V alone at the end) and then the pass
    or, for warpgroup 1's last group, the wgmma wait: no ring mbarrier wait and no other barrier while a
    warpgroup holds the turn, and every pass directly follows an issue. Per kernel: warpgroup 1 waits before
    group 0, in both key-block loops and before the last P V (4 waits on 15) and passes after group 0 and
    in both loops (3 passes on 14); warpgroup 0 passes after group 0, in both loops and after the last P V
    (4 on 15) and waits in both loops and before the last P V (3 on 14)."""
    events = compiled[f"{variant}-{head_dim}-{causal}-{dtype}"]["turns"]
    assert {e: events.count(e) for e in ("wait14", "wait15", "pass14", "pass15")} == \
        {"wait14": 3, "wait15": 4, "pass14": 3, "pass15": 4}, events
    for i, event in enumerate(events):
        if event.startswith("wait"):  # the turn: one or two issues, then the pass (or warpgroup 1's last wait)
            end = next(k for k in range(i + 1, len(events)) if events[k] != "issue")
            assert 1 <= end - i - 1 <= 2, events[i:end + 1]
            passed = "pass15" if event == "wait14" else "pass14"
            assert events[end] == passed or (event == "wait15" and events[end] == "retire"), events[i:end + 1]
        elif event.startswith("pass"):  # right after an issue, and the turn's next event is the wgmma wait
            assert events[i - 1] == "issue" and events[i + 1] == "retire", events[max(0, i - 3):i + 2]


@pytest.mark.parametrize("name", sorted(AHEAD_REQUESTS))
def test_row_values_ahead_keep_the_products_and_the_loops_free_of_local_memory(compiled_in_block, compiled_ahead,
                                                                                name):
    """With ROW_VALUES_AHEAD on, each key-block loop runs the products it runs with it off and no more
    local memory (none, but the view warpgroups' bounded few at D = 128 with a general power, as above)."""
    on, off = compiled_ahead[name], compiled_in_block[name]
    _assert_hopper_schedule(on["ptx"], "f16" if name.endswith("fp16") else "bf16")
    rows_on = {row["loop"]: row for row in on["loops"]}
    rows_off = {row["loop"]: row for row in off["loops"]}
    assert set(rows_on) == set(rows_off)
    for loop, row in rows_on.items():
        assert row["hgmma"] == rows_off[loop]["hgmma"], (loop, row)
        assert row["mufu"] == rows_off[loop]["mufu"], (loop, row)
        allowed = 4 if ("dkdv_views_p1.5" in name and "-128-" in name) else 0
        assert row["loop_spills"] <= max(allowed, rows_off[loop]["loop_spills"]), (loop, row)
