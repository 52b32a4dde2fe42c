"""scripts/bench/bench_attention.py on CPU: the issue-15 suite's dry run (every case built, Flex's mask
equal to attn.masks.dense_mask, outputs against the reference), the tiles-visited mirrors of
attn/kernels/tiles.py against the Triton functions, and the targets table."""

import os
import sys
from pathlib import Path


import pytest
import torch
import triton
import triton.language as tl

from attn.kernels.tiles import key_ranges, load_segment_bounds, query_ranges
from attn.masks import MaskSpec, segment_bounds
from attn.testing import random_segment_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import bench_attention as ba  # noqa: E402

needs_flex = pytest.mark.skipif(ba.flex_attention is None, reason="FlexAttention is not importable")


@triton.jit
def _ranges_kernel(out_ptr, bounds_ptr, seq_len, window, BLOCK: tl.constexpr, KEYS: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    """out[b, block, :] = key_ranges (KEYS) or query_ranges of program block `block` of row b."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    hs, he, cs, ce = load_segment_bounds(bounds_ptr, b, HAS_SEG)
    if KEYS:
        lo, hi, lo2, hi2 = key_ranges(pid * BLOCK, seq_len, window, hs, he, cs, ce, BLOCK, CAUSAL, HAS_WINDOW,
                                      HAS_SEG)
    else:
        lo, hi, lo2, hi2 = query_ranges(pid * BLOCK, seq_len, window, hs, he, cs, ce, BLOCK, CAUSAL, HAS_WINDOW,
                                        HAS_SEG)
    base = out_ptr + (b * tl.num_programs(0) + pid) * 4
    tl.store(base + 0, lo)
    tl.store(base + 1, hi)
    tl.store(base + 2, lo2)
    tl.store(base + 3, hi2)


MASKS = [MaskSpec(causal=False), MaskSpec(causal=True), MaskSpec(causal=True, window=37)]


@pytest.mark.parametrize("keys", [True, False], ids=["key_ranges", "query_ranges"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.kind)
@pytest.mark.parametrize("seg", [False, True], ids=["no_seg", "seg"])
@pytest.mark.parametrize("n,block", [(200, 64), (333, 32), (96, 128)])
def test_range_mirrors_match_tiles_py(keys, mask, seg, n, block):
    gen = torch.Generator().manual_seed(n + block)
    batch = 5 if seg else 1
    ids = random_segment_ids(batch, n, gen, padding_row=True) if seg else None
    bounds = segment_bounds(ids) if seg else torch.zeros(1, 4, dtype=torch.int32)
    programs = ba._cdiv(n, block)
    got = torch.full((batch, programs, 4), -7, dtype=torch.int32)
    window = int(mask.window or 0)
    _ranges_kernel[(programs, batch)](got, bounds, n, window, BLOCK=block, KEYS=keys, CAUSAL=mask.is_causal,
                                      HAS_WINDOW=window > 0, HAS_SEG=seg)
    mirror = ba.key_ranges_py if keys else ba.query_ranges_py
    for b in range(batch):
        hs, he, cs, ce = bounds[b].tolist()
        for p in range(programs):
            want = mirror(p * block, n, window, hs, he, cs, ce, block, mask.is_causal, window > 0, seg)
            lo, hi, lo2, hi2 = got[b, p].tolist()
            assert (lo, hi) == want[:2], (b, p, got[b, p].tolist(), want)
            if seg:  # the diagonal range is only read under segment ids
                assert (lo2, hi2) == want[2:], (b, p, got[b, p].tolist(), want)


def test_tiles_visited_counts():
    full, causal = MaskSpec(causal=False), MaskSpec(causal=True)
    assert ba.tiles_visited(full, 4096, None, 128, 64) == 1.0
    # causal, 32 query blocks of 128 rows: block i walks 2 (i + 1) key tiles of 64 out of 64
    assert ba.tiles_visited(causal, 4096, None, 128, 64) == sum(2 * (i + 1) for i in range(32)) / (32 * 64)
    # ranker 2048 + 2048: history blocks walk the 32 history tiles, candidate blocks also 2 diagonal tiles
    bounds = segment_bounds(ba.ranker_layout(4, 4096, 2048, 2048, "cpu"))
    assert ba.tiles_visited(full, 4096, bounds, 128, 64) == (16 * 32 + 16 * 34) / (32 * 64)
    # dk/dv: history key blocks (of 128) walk all 64 query tiles of 64, candidate key blocks 2
    assert ba.tiles_visited(full, 4096, bounds, 64, 128, "kv") == (16 * 64 + 16 * 2) / (32 * 64)
    # recommender 384 + 128 at N = 512: 3 history blocks x 6 tiles, one candidate block 6 + 2
    bounds = segment_bounds(ba.ranker_layout(2, 512, 384, 128, "cpu"))
    assert ba.tiles_visited(full, 512, bounds, 128, 64) == (3 * 6 + 8) / (4 * 8)


def test_launched_configs_records_the_tiles_used():
    from attn.kernels.softmax_family import fused_attention

    q, k, v = ba.random_qkv(1, 2, 40, 16, 2, "cpu", torch.float32)
    with ba.launched_configs() as used:
        fused_attention(q, k, v, ba.spec_for("tanh"), MaskSpec(causal=True)).sum().backward()
    bm, bn = (int(x) for x in os.environ.get("ATTNLAB_INTERPRET_BLOCKS", "64,32").split(","))
    assert (used["softmax_family_fwd"].block_m, used["softmax_family_fwd"].block_n) == (bm, bn)
    assert {"softmax_family_dkdv", "softmax_family_dq"} <= set(used)
    report = ba.tile_report(MaskSpec(causal=True), 40, None, used)
    assert report["fwd"]["config"] == f"{bm}x{bn}" and 0 < report["fwd"]["visited"] <= 1
    assert report["visible_pairs"] == sum(range(1, 41)) / 40**2


@needs_flex
@pytest.mark.parametrize("mask", MASKS + [MaskSpec(causal=False, window=9)], ids=lambda m: f"{m.kind}{m.causal}")
def test_flex_mask_equals_dense_mask(mask):
    ids = random_segment_ids(4, 50, torch.Generator().manual_seed(3), padding_row=True)
    for seg in (None, ids):
        assert ba.check_flex_mask(mask, seg, 4, 50, "cpu")


@needs_flex
def test_flex_mask_check_can_fail(monkeypatch):
    ids = ba.ranker_layout(2, 64, 40, 20, "cpu")
    # a ranker mask without the candidates' diagonal
    monkeypatch.setattr(ba, "mask_mod_for", lambda mask, ids: lambda b, h, qi, ki: ids[b, ki] == 1)
    assert not ba.check_flex_mask(MaskSpec(causal=False), ids, 2, 64, "cpu")


@needs_flex
def test_issue15_dry_run():
    results = ba.dry_run(ba.issue15_cases("cpu"))
    assert len(results) == len(ba.issue15_cases("cpu"))
    for r in results:
        assert r["ok"], r
        assert "ours" in r["errors"]
        if r["name"].startswith(("ranker", "rec B", "main tanh", "window", "gqa")) and "full" not in r["name"]:
            assert r["flex_mask_equal"] and "flex" in r["errors"], r
    by = {r["name"]: r for r in results}
    # the pinned forward tile (128 x 64) at the real shapes
    assert by["ranker 2048h+2048c tanh"]["tiles"]["fwd"]["visited"] == pytest.approx(1056 / 2048)
    assert by["rec B=128 384h+128c tanh"]["tiles"]["fwd"]["visited"] == pytest.approx(26 / 32)
    assert by["full N=4096 tanh"]["tiles"]["fwd"]["visited"] == 1.0


def test_sigmoid_suite_runs_the_sigmoid_kernels_against_the_reference():
    """Every sigmoid case builds through the registry (no threshold parameters, the model's inputs:
    no L2 norm) and its output matches the float64 reference at a tiny shape; SDPA's rows are the
    yardstick, not the same function, so they are not compared."""
    cases = ba.sigmoid_cases("cpu")
    assert {c[5] for c in cases} == {"sigmoid"}
    results = ba.dry_run(cases)
    assert [r["name"] for r in results] == [c[0] for c in cases]
    for r in results:
        assert r["ok"] and set(r["errors"]) == {"ours"}, r
    q, k, _, second = ba.variant_inputs(1, 2, 16, 8, 2, "sigmoid", "cpu", torch.float32, grad=False)
    assert second == {} and q.norm(dim=-1).std() > 0  # not unit vectors


def test_variant_targets_judge_sigmoid_against_sdpa():
    rows = [_row("main sigmoid causal", ours=(1.0, 4.0), sdpa=(1.2, 3.0))]
    by = {t["target"]: t for t in ba.sigmoid_targets(rows)}
    fwd = by["sigmoid: fwd speed vs SDPA softmax (>= 1.0x)"]
    both = by["sigmoid: fwd+bwd speed vs SDPA softmax (>= 0.85x)"]
    assert fwd["value"] == pytest.approx(1.2) and fwd["met"] is True
    assert both["value"] == pytest.approx(0.75) and both["met"] is False


def test_sigmoid_paths_suite_sets_each_path_around_its_case(monkeypatch):
    """One case per evaluation path, each run with its ATTNLAB_SIGMOID_PATH (restored after) and
    matching the reference at a tiny shape; the targets compare each path with mufu and SDPA."""
    monkeypatch.delenv(ba.SIGMOID_PATH_ENV, raising=False)
    cases = ba.sigmoid_path_cases("cpu")
    assert [c[7]["env"][ba.SIGMOID_PATH_ENV] for c in cases] == list(ba.SIGMOID_PATHS) * 2
    from attn.kernels import sigmoid_family as sg

    seen = []
    real = sg.sigmoid_path

    def spy(dtype, forward):  # what the launcher reads at each launch
        seen.append(os.environ.get(ba.SIGMOID_PATH_ENV))
        return real(dtype, forward)

    monkeypatch.setattr(sg, "sigmoid_path", spy)
    results = ba.dry_run(cases[:len(ba.SIGMOID_PATHS)])
    assert all(r["ok"] for r in results), results
    assert seen == list(ba.SIGMOID_PATHS)  # one forward launch per case, under its path
    assert ba.SIGMOID_PATH_ENV not in os.environ  # restored after each case
    rows = [_row("main sigmoid causal path=mufu", ours=(2.0, 6.0)),
            _row("main sigmoid causal path=auto", ours=(1.6, 5.0), sdpa=(1.2, 3.0))]
    by = {t["target"]: t["value"] for t in ba.sigmoid_path_targets(rows)}
    assert by["main path=auto: fwd speed vs path=mufu"] == pytest.approx(1.25)
    assert by["main path=auto: fwd+bwd speed vs SDPA softmax"] == pytest.approx(0.6)
    assert by["main path=mufu: fwd speed vs SDPA softmax"] == pytest.approx(0.6)


def _row(name, **impls):
    return {"name": name, **{k: {"fwd_ms": f, "fwdbwd_ms": fb} for k, (f, fb) in impls.items()}}


def test_issue15_targets():
    rows = [_row("ranker 2048h+2048c tanh", ours=(1.0, 4.0), flex=(2.0, 6.0)),
            _row("full N=4096 tanh", ours=(2.0, 8.0)),
            _row("rec B=128 384h+128c tanh", ours=(1.0, 1.0), flex=(1.6, 1.4)),
            _row("rec B=128 full N=512 tanh", ours=(1.25, 2.0)),
            _row("main threshold causal", ours=(1.0, 2.0)),
            _row("main diff_threshold causal", ours=(1.2, 3.4)),
            _row("main softmax causal", ours=(1.0, 3.0), sdpa=(0.95, 2.4)),
            _row("main tanh causal", ours=(1.0, 3.0), flex=(2.0, 5.7))]
    t = {x["target"]: x for x in ba.issue15_targets(rows)}
    assert t["ranker / full time, fwd (<= 0.55)"]["value"] == 0.5 and t["ranker / full time, fwd (<= 0.55)"]["met"]
    assert t["ranker / full time, fwd+bwd (<= 0.55)"]["met"]
    assert t["ranker: fwd speed vs Flex (>= 1.8x)"]["value"] == 2.0
    assert not t["ranker: fwd+bwd speed vs Flex (>= 1.8x)"]["met"]  # 1.5
    assert t["rec B=128 384h+128c: fwd speed vs Flex (>= 1.5x)"]["met"]
    assert not t["rec B=128 384h+128c: fwd+bwd speed vs Flex (>= 1.5x)"]["met"]
    assert t["rec B=128 384h+128c / full time, fwd"] == {"target": "rec B=128 384h+128c / full time, fwd",
                                                         "value": 0.8, "met": None}
    assert t["diff_threshold / threshold time, fwd (<= 1.3)"]["met"]
    assert not t["diff_threshold / threshold time, fwd+bwd (<= 1.6)"]["met"]  # 1.7
    assert t["tanh: fwd+bwd speed vs Flex (>= 1.8x)"]["value"] == pytest.approx(1.9)
    assert t["tanh: fwd+bwd speed vs SDPA softmax (>= 0.75x)"]["value"] == pytest.approx(0.8)
    assert t["softmax: fwd speed vs SDPA (>= 0.9x)"]["met"]
    assert not t["softmax: fwd+bwd speed vs SDPA (>= 0.85x)"]["met"]
    # rows not measured (the B=32 recommender, soft_sign, GQA) give n/a, never met
    missing = t["rec B=32 1536h+512c: fwd speed vs Flex (>= 1.5x)"]
    assert missing["value"] is None and missing["met"] is False
    md = ba.markdown({"date": "d", "gpu": "g", "torch": "t", "triton": "tr", "commit": "c"}, [], list(t.values()))
    assert "| rec B=128 384h+128c / full time, fwd | 0.80 | info |" in md
    assert "| ranker / full time, fwd (<= 0.55) | 0.50 | yes |" in md
