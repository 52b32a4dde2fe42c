"""Benchmark the fused attention kernels against SDPA and FlexAttention (DESIGN.md §7).

Same process, same inputs: our Triton kernels (the kernel entry point `attn.attention`
dispatches to, with segment bounds computed once per case), `scaled_dot_product_attention`
(plain softmax), FlexAttention compiled with the same score_mod / block mask, and (small
shapes) the PyTorch reference under torch.compile. `triton.testing.do_bench`, median, after
warm-up; autotuning and compilation happen in the warm-up, never inside a measured time.
FLOPs are useful work: 4*B*H*D per visible (query, key) pair forward (so half of 4BHN^2D
under a causal mask), backward 2.5x that.

    python scripts/bench/bench_attention.py --out gpu_out/softmax_family  [--only main]
    python scripts/bench/bench_attention.py --only threshold --out gpu_out/bench_threshold
    python scripts/bench/bench_attention.py --only issue15 --prewarm 6 --out gpu_out/issue15
    python scripts/bench/bench_attention.py --only issue15 --dry-run   # CPU: tiny shapes, no timing
    python scripts/bench/bench_attention.py --only sigmoid --out gpu_out/bench_sigmoid
    python scripts/bench/bench_attention.py --only sigmoid_paths --out gpu_out/sigmoid_paths  # each evaluation path

Writes OUT.json and OUT.md (date, GPU, torch/triton/CUDA versions, commit, the targets table
and, for softmax-family rows, the fraction of tiles the kernels visit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # CPU (--dry-run, tests): Triton runs in its interpreter, set before it loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import FWD_BWD_FLOP_FACTOR, median_ms, result_header, tflops  # noqa: E402

import attn  # noqa: E402
from attn.families import family_of  # noqa: E402
from attn.kernels import softmax_family  # noqa: E402
from attn.masks import MaskSpec, dense_mask, segment_bounds, visible_key_counts  # noqa: E402

torch._dynamo.config.cache_size_limit = 1000
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 1000
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    flex_attention = None

CAP, KNEE = 30.0, 0.5
VARIANT_OF_CAP = {"none": "softmax", "tanh": "softcap_tanh", "soft_sign": "softcap_softsign", "alsc": "alsc"}
_flex = torch.compile(flex_attention, dynamic=False) if flex_attention is not None else None
# a case names a softmax-family cap (these) or a registry variant (every other case)
CAP_CASES = tuple(VARIANT_OF_CAP)


def score_mod_for(cap: str):
    c, a = CAP, KNEE * CAP
    g = c - a
    if cap == "none":
        return None
    if cap == "tanh":
        return lambda s, b, h, qi, ki: c * torch.tanh(s / c)
    if cap == "soft_sign":
        return lambda s, b, h, qi, ki: s / (1 + torch.abs(s) / c)

    def alsc(s, b, h, qi, ki):
        cl = torch.clamp(s, -a, a)
        return cl + g * torch.tanh((s - cl) / g)

    return alsc


def mask_mod_for(mask: MaskSpec, ids):
    """FlexAttention mask_mod with attn/masks.py's visibility (`check_flex_mask` compares the
    two), or None for a full mask without segment ids."""
    w = mask.window

    def causal(b, h, qi, ki):
        return qi >= ki

    def window(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < w)

    if ids is not None:
        # history (1) and candidate (-1) queries see history keys, a candidate also itself,
        # padding (0) sees and is seen by nothing
        def ranker(b, h, qi, ki):
            qs, ks = ids[b, qi], ids[b, ki]
            ok = ((qs != 0) & (ks == 1)) | ((qs == -1) & (qi == ki))
            if w is not None:
                ok = ok & (qi - ki < w)
            if mask.is_causal:
                ok = ok & (qi >= ki)
            return ok

        return ranker
    if w is not None:
        return window
    if mask.causal:
        return causal
    return None


def block_mask_for(mask: MaskSpec, ids, batch, n, device="cuda"):
    mod = mask_mod_for(mask, ids)
    if mod is None:
        return None
    return create_block_mask(mod, B=batch if ids is not None else None, H=None, Q_LEN=n, KV_LEN=n, device=device)


def check_flex_mask(mask: MaskSpec, ids, batch, n, device="cuda") -> bool:
    """Whether the Flex mask_mod's dense mask equals attn.masks.dense_mask (every row of ids)."""
    from torch.nn.attention.flex_attention import create_mask

    mod = mask_mod_for(mask, ids)
    want = dense_mask(mask, n, ids, device=device)  # (B or 1, N, N)
    if mod is None:
        return bool(want.all())
    got = create_mask(mod, batch if ids is not None else 1, 1, n, n, device=device)[:, 0]
    return got.shape == want.shape and bool((got == want).all())


def bench(fn, grad=False):
    """Median ms of fn (fwd) or fn + backward (fwd+bwd), and peak memory (GiB) of one call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if grad:
        def call():
            out = fn()
            out.backward(call.do)
        out = fn()
        call.do = torch.randn_like(out)
        del out
        run = call
    else:
        def run():
            with torch.no_grad():
                fn()
    for _ in range(3):  # compile / autotune outside the timing
        run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = median_ms(run, warmup=50, rep=200)
    return ms, peak


def useful_flops(b, h, n, d, mask, ids):
    pairs = visible_key_counts(mask, n, ids.cpu() if ids is not None else None).sum().item()
    if ids is None:
        pairs *= b
    return 4.0 * h * d * pairs


# Tile visits: Python mirrors of attn/kernels/tiles.py's key_ranges / query_ranges (Q == KV;
# tests/test_bench_attention.py compares them with the Triton functions). A forward (or dq)
# program of query rows [m0, m0 + BLOCK_M) walks key tiles lo, lo + BLOCK_N, ... < hi and,
# with segment ids, the candidates' diagonal lo2 ... < hi2; a dk/dv program of keys
# [n0, n0 + BLOCK_N) walks query tiles the same way over query_ranges.


def key_ranges_py(m0, n, window, hs, he, cs, ce, block_m, causal, has_window, has_seg):
    m1 = min(m0 + block_m, n)
    lo, hi = 0, n
    if causal:
        hi = min(hi, m1)
    if has_window:
        lo = max(lo, m0 - window + 1)
    lo2 = hi2 = 0
    if has_seg:
        any_q = max(m0, hs) < min(m1, he) or max(m0, cs) < min(m1, ce)
        lo = max(lo, hs)
        hi = min(hi, he) if any_q else lo
        lo2 = max(m0, cs)
        hi2 = max(min(m1, ce), lo2)
    return lo, max(hi, lo), lo2, hi2


def query_ranges_py(n0, n, window, hs, he, cs, ce, block_n, causal, has_window, has_seg):
    n1 = min(n0 + block_n, n)
    lo, hi = 0, n
    if causal:
        lo = max(lo, n0)
    if has_window:
        hi = min(hi, n1 - 1 + window)
    lo2 = hi2 = 0
    if has_seg:
        has_hist_key = max(n0, hs) < min(n1, he)
        has_cand = ce > cs
        q_lo = min(hs, cs) if has_cand else hs
        q_hi = max(he, ce) if has_cand else he
        lo = max(lo, q_lo)
        hi = max(min(hi, q_hi) if has_hist_key else lo, lo)
        lo2 = max(n0, cs)
        hi2 = lo2 if has_hist_key else max(min(n1, ce), lo2)
    return lo, max(hi, lo), lo2, hi2


def _cdiv(a, b):
    return -(-a // b)


def tiles_visited(mask: MaskSpec, n, bounds, block_m, block_n, kind="fwd"):
    """Fraction of the (query tile, key tile) grid a kernel walks: kind fwd / dq (programs over
    query blocks of block_m rows, key tiles of block_n) or kv (programs over key blocks of
    block_n, query tiles of block_m). bounds: (B, 4) segment bounds, or None."""
    causal, window = mask.is_causal, int(mask.window or 0)
    rows = [None] if bounds is None else [tuple(int(x) for x in r) for r in bounds.tolist()]
    prog, step = (block_m, block_n) if kind in ("fwd", "dq") else (block_n, block_m)
    ranges = key_ranges_py if kind in ("fwd", "dq") else query_ranges_py
    visited = 0
    for r in rows:
        hs, he, cs, ce = r if r is not None else (0, 0, 0, 0)
        for p0 in range(0, n, prog):
            lo, hi, lo2, hi2 = ranges(p0, n, window, hs, he, cs, ce, prog, causal, window > 0, r is not None)
            visited += _cdiv(hi - lo, step) + (_cdiv(hi2 - lo2, step) if r is not None else 0)
    return visited / (len(rows) * _cdiv(n, prog) * _cdiv(n, step))


def tile_report(mask: MaskSpec, n, ids, configs: dict) -> dict:
    """{fwd, dkdv, dq: {config, visited}} for the softmax-family kernels' configs by launch name,
    plus the fraction of (query, key) pairs that are visible."""
    bounds = segment_bounds(ids).cpu() if ids is not None else None
    out = {}
    for kind, name in (("fwd", "softmax_family_fwd"), ("kv", "softmax_family_dkdv"), ("dq", "softmax_family_dq")):
        cfg = configs.get(name)
        if cfg is not None:
            out[name.rsplit("_", 1)[1]] = {"config": f"{cfg.block_m}x{cfg.block_n}",
                                           "visited": tiles_visited(mask, n, bounds, cfg.block_m, cfg.block_n, kind)}
    counts = visible_key_counts(mask, n, ids.cpu() if ids is not None else None)
    out["visible_pairs"] = counts.sum().item() / (counts.shape[0] * n * n)
    return out


@contextlib.contextmanager
def launched_configs():
    """{kernel name: TileConfig} of every runtime.Kernel launch inside the block."""
    from attn.kernels.runtime import Kernel

    used = {}
    launch = Kernel.launch

    def spy(self, *args, **kwargs):
        cfg = launch(self, *args, **kwargs)
        used[self.name] = cfg
        return cfg

    Kernel.launch = spy
    try:
        yield used
    finally:
        Kernel.launch = launch


def ranker_layout(batch, n, hist, cand, device):
    ids = torch.zeros(batch, n, dtype=torch.int64)
    ids[:, :hist] = 1
    ids[:, hist:hist + cand] = -1
    return ids.to(device)


def spec_for(cap: str):
    params = {} if cap == "none" else ({"cap": CAP, "knee": KNEE} if cap == "alsc" else {"cap": CAP})
    return attn.get_variant(VARIANT_OF_CAP[cap]).make_spec(**params)


def mask_name(mask: MaskSpec, ids) -> str:
    return mask.kind if ids is None else f"ranker{'+causal' if mask.is_causal else ''}"


def softmax_impls(q, k, v, cap, mask, ids, *, sdpa=False, flex=True, ref=False, compiled=True):
    """{name: zero-argument call} for one softmax-family case on q (B,N,H,D), k/v (B,N,H_kv,D):
    ours, and as asked sdpa (plain softmax), flex (same score_mod and mask) and ref_compiled;
    sdpa and flex take and return (B,H,N,D) copies.
    compiled=False: eager FlexAttention (CPU, forward only). Every mask input (segment bounds,
    Flex's block mask) is built here, outside the timed calls."""
    from attn.kernels.softmax_family import fused_attention

    b, n, h, _ = q.shape
    gqa = k.shape[2] != h
    spec = spec_for(cap)
    # the kernel entry point with the segment bounds computed once, as a model does per batch and
    # as Flex gets its block mask: the public API's per-call checks of segment ids (a device sync)
    # and the bounds' device ops stay out of the timing
    bounds = segment_bounds(ids) if ids is not None else None

    def ours():
        return fused_attention(q, k, v, spec, mask, None, bounds=bounds)

    impls = {"ours": ours}
    if sdpa:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask.causal,
                                                               enable_gqa=gqa)
    if flex and flex_attention is not None:
        qf, kf, vf = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))
        bm = block_mask_for(mask, ids, b, n, q.device)
        sm = score_mod_for(cap)
        fa = _flex if compiled else flex_attention
        impls["flex"] = lambda: fa(qf, kf, vf, score_mod=sm, block_mask=bm, enable_gqa=gqa)
    if ref:
        from attn.reference import reference_attention
        ref_c = torch.compile(reference_attention)
        impls["ref_compiled"] = lambda: ref_c(q, k, v, spec, mask, ids, None)
    return impls


def random_qkv(b, h, n, d, h_kv, device, dtype, grad=True):
    torch.manual_seed(0)
    return (torch.randn(b, n, heads, d, device=device, dtype=dtype, requires_grad=grad) for heads in (h, h_kv, h_kv))


def time_impls(name, impls, flops, row):
    """Times every implementation (fwd, fwd+bwd) into row[impl]; a failing one is reported and left out."""
    for key, fn in impls.items():
        try:
            ms_f, mem_f = bench(fn, grad=False)
            ms_b, mem_b = bench(fn, grad=True)
        except Exception as e:  # report, keep going
            print(f"  {name} {key}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
            continue
        tf_f, tf_b = tflops(flops, ms_f), tflops(FWD_BWD_FLOP_FACTOR * flops, ms_b)
        row[key] = {"fwd_ms": ms_f, "fwdbwd_ms": ms_b, "fwd_tflops": tf_f,
                    "fwdbwd_tflops": tf_b, "peak_gib_fwd": mem_f, "peak_gib_fwdbwd": mem_b}
        print(f"  {name:34} {key:12} fwd {ms_f:8.3f} ms {tf_f:6.1f} TF/s | fwd+bwd {ms_b:8.3f} ms "
              f"{tf_b:6.1f} TF/s | peak {mem_b:.2f} GiB", flush=True)


def run_case(name, b, h, n, d, cap, mask, *, h_kv=None, ids=None, sdpa=False, flex=True, ref=False):
    h_kv = h_kv or h
    q, k, v = random_qkv(b, h, n, d, h_kv, "cuda", torch.bfloat16)
    flops = useful_flops(b, h, n, d, mask, ids)
    row = {"name": name, "B": b, "H": h, "H_kv": h_kv, "N": n, "D": d, "cap": cap, "mask": mask_name(mask, ids),
           "fwd_gflop": flops / 1e9}
    if flex and flex_attention is not None:
        row["flex_mask_equal"] = check_flex_mask(mask, ids, b, n, "cuda")
        if not row["flex_mask_equal"]:
            print(f"  {name}: Flex's mask differs from attn.masks.dense_mask: Flex left out", flush=True)
            flex = False
    impls = softmax_impls(q, k, v, cap, mask, ids, sdpa=sdpa, flex=flex, ref=ref)
    softmax_family._dq_forms.clear()  # the backward form this case's tuning picks (one_pass or separate)
    time_impls(name, impls, flops, row)
    # a key outside the one-pass form's shapes (or pinned) is never timed: it runs separate, or the pin
    row["backward_dq_form"] = (sorted(set(softmax_family._dq_forms.values()))
                               or [os.environ.get(softmax_family.DQ_FORM_ENV, "separate")])
    print(f"  {name:34} backward dq form: {row['backward_dq_form']}", flush=True)
    if "ours" in row:
        # the tile configs the tuned launches use (a call after the timing: nothing is tuned here)
        with launched_configs() as used:
            out = impls["ours"]()
            out.backward(torch.randn_like(out))
        row["tiles"] = tile_report(mask, n, ids, used)
        t = row["tiles"]
        print(f"  {name:34} tiles visited: " + ", ".join(f"{kk} {t[kk]['visited']:.3f} ({t[kk]['config']})"
                                                          for kk in ("fwd", "dkdv", "dq") if kk in t)
              + f"; visible pairs {t['visible_pairs']:.3f}", flush=True)
    torch.cuda.empty_cache()
    return row


def cases(only, device="cuda"):
    main = (4, 16, 4096, 128)
    causal = MaskSpec(causal=True)
    full = MaskSpec(causal=False)
    out = []
    if only in ("all", "main"):
        out += [("main softmax causal", *main, "none", causal, {"sdpa": True})]
        out += [(f"main {cap} causal", *main, cap, causal, {}) for cap in ("tanh", "soft_sign", "alsc")]
    if only == "ours":  # our kernels alone, main shape (quick regression check)
        out += [(f"main {cap} causal", *main, cap, causal, {"flex": False}) for cap in VARIANT_OF_CAP]
    if only in ("all", "masks"):
        ids = ranker_layout(4, 2048, 1024, 1024, device)
        out += [("ranker 1024h+1024c softmax", 4, 16, 2048, 128, "none", full, {"ids": ids})]
        out += [("full N=2048 softmax", 4, 16, 2048, 128, "none", full, {"sdpa": True})]
        out += [("window 1024 tanh", *main, "tanh", MaskSpec(causal=True, window=1024), {})]
        out += [("gqa H_kv=4 tanh causal", *main, "tanh", causal, {"h_kv": 4})]
        out += [("gqa H_kv=4 softmax causal", *main, "none", causal, {"h_kv": 4, "sdpa": True})]
    if only in ("all", "shapes"):
        out += [("small softmax causal", 8, 16, 1024, 64, "none", causal, {"sdpa": True, "ref": True})]
        out += [("small tanh causal", 8, 16, 1024, 64, "tanh", causal, {})]
        out += [("long softmax causal", 2, 16, 8192, 128, "none", causal, {"sdpa": True})]
        out += [("long tanh causal", 2, 16, 8192, 128, "tanh", causal, {})]
    return out


def ratio(a, b, key):
    """a[key] / b[key], None where a row or its timing is missing (a failed implementation)."""
    try:
        return a[key] / b[key]
    except (KeyError, TypeError):
        return None


def judged(res):
    """[(name, value, limit)] -> rows of the targets table: limit > 0 means value >= limit,
    limit < 0 means value <= -limit, None an informative ratio (met None)."""
    out = []
    for n, v, lim in res:
        met = None if lim is None else (v is not None and (v >= lim if lim > 0 else v <= -lim))
        out.append({"target": n, "value": v, "met": met})
    return out


def targets(rows):
    by = {r["name"]: r for r in rows}
    res = []

    for cap in ("tanh", "soft_sign", "alsc"):
        r = by.get(f"main {cap} causal")
        if r and "flex" in r and "ours" in r:
            res.append((f"{cap}: fwd speed vs Flex (>= 2.0x)", ratio(r["flex"], r["ours"], "fwd_ms"), 2.0))
            res.append((f"{cap}: fwd+bwd speed vs Flex (>= 1.8x)", ratio(r["flex"], r["ours"], "fwdbwd_ms"), 1.8))
    r = by.get("main softmax causal")
    if r and "sdpa" in r and "ours" in r:
        res.append(("softmax: fwd speed vs SDPA (>= 0.8x)", ratio(r["sdpa"], r["ours"], "fwd_ms"), 0.8))
        res.append(("softmax: fwd+bwd speed vs SDPA (>= 0.7x)", ratio(r["sdpa"], r["ours"], "fwdbwd_ms"), 0.7))
    a, t = by.get("main alsc causal"), by.get("main tanh causal")
    if a and t and "ours" in a and "ours" in t:
        for key in ("fwd_ms", "fwdbwd_ms"):
            res.append((f"ALSC / tanh time, {key[:-3]} (<= 1.10)", ratio(a["ours"], t["ours"], key), -1.10))
    rk, fu = by.get("ranker 1024h+1024c softmax"), by.get("full N=2048 softmax")
    if rk and fu and "ours" in rk and "ours" in fu:
        for key in ("fwd_ms", "fwdbwd_ms"):
            res.append((f"ranker / full time, {key[:-3]} (<= 0.60)", ratio(rk["ours"], fu["ours"], key), -0.60))
    return judged(res)


def markdown(meta, rows, tgts, title="Softmax-family attention benchmark"):
    lines = [f"# {title}", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · commit "
             f"`{meta['commit']}` · bf16 · do_bench median", "",
             "TFLOP/s count useful work (visible pairs; fwd+bwd = 3.5x fwd).", "",
             "| case | B,H,H_kv,N,D | impl | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | peak GiB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        for impl in ("ours", "sdpa", "flex", "ref_compiled"):
            if impl in r:
                m = r[impl]
                lines.append(f"| {r['name']} | {r['B']},{r['H']},{r['H_kv']},{r['N']},{r['D']} | {impl} | "
                             f"{m['fwd_ms']:.3f} | {m['fwd_tflops']:.0f} | {m['fwdbwd_ms']:.3f} | "
                             f"{m['fwdbwd_tflops']:.0f} | {m['peak_gib_fwdbwd']:.2f} |")
    lines += ["", "| target | measured | met |", "| --- | ---: | :---: |"]
    for t in tgts:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {v} | {MET_WORD[t['met']]} |")
    tiled = [r for r in rows if "tiles" in r]
    if tiled:
        lines += ["", "Tiles visited: the fraction of the (query tile, key tile) grid our kernels walk for the "
                  "row's mask, from attn/kernels/tiles.py's ranges at the tile config the tuned launch used "
                  "(BLOCK_M x BLOCK_N); visible pairs: the fraction of (query, key) pairs the mask keeps.", "",
                  "| case | visible pairs | fwd tiles | fwd config | dk/dv tiles | dk/dv config | dq tiles "
                  "| dq config |",
                  "| --- | ---: | ---: | --- | ---: | --- | ---: | --- |"]
        for r in tiled:
            t = r["tiles"]
            cells = [f"{t[k]['visited']:.3f} | {t[k]['config']}" if k in t else "n/a | n/a"
                     for k in ("fwd", "dkdv", "dq")]
            lines.append(f"| {r['name']} | {t['visible_pairs']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


MET_WORD = {True: "yes", False: "no", None: "info"}


# ----------------------------------------------------------------------------------------
# threshold family (issue 4): threshold / diff_threshold vs SDPA and the compiled reference
# ----------------------------------------------------------------------------------------


def variant_inputs(b, h, n, d, h_kv, variant, device, dtype, grad=True):
    """q, k as the model feeds them (L2-normalized where the variant's model default is qk_norm),
    v, and the family's extra per-call tensors (diff_threshold: the second view and lambda)."""
    torch.manual_seed(0)
    l2 = attn.get_variant(variant).qk_norm == "l2"

    def qk(heads):
        x = torch.randn(b, n, heads, d, device=device, dtype=torch.float32)
        return (F.normalize(x, dim=-1) if l2 else x).to(dtype).requires_grad_(grad)

    q, k = qk(h), qk(h_kv)
    v = torch.randn(b, n, h_kv, d, device=device, dtype=dtype, requires_grad=grad)
    spec = attn.get_variant(variant).make_spec()
    extra_names = family_of(spec).extra_inputs(spec)
    second = {}
    if extra_names:
        second = {"q2": qk(h), "k2": qk(h_kv),
                  "lam": torch.full((h,), 0.5, device=device, dtype=torch.float32, requires_grad=grad)}
        assert set(second) == set(extra_names), extra_names
    return q, k, v, second


def variant_impls(q, k, v, second, spec, mask, ids, *, sdpa=False, ref=False):
    """{name: zero-argument call} for one case of a registry variant outside the cap cases (the
    threshold and sigmoid families): ours, and as asked sdpa (plain softmax) and ref_compiled."""
    gqa = k.shape[2] != q.shape[2]
    kernel_entry = attn.registry.family_kernel(spec)
    bounds = segment_bounds(ids) if ids is not None else None
    def ours():
        # the kernel entry attn.attention dispatches to, with the segment bounds computed once: its
        # input validation syncs with the device to check segment ids (~1 ms per call)
        return kernel_entry(q, k, v, spec, mask, None, None, extra=second, bounds=bounds)

    impls = {"ours": ours}
    if sdpa:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask.causal,
                                                               enable_gqa=gqa)
    if ref:
        from attn.reference import reference_attention
        ref_c = torch.compile(reference_attention)
        impls["ref_compiled"] = lambda: ref_c(q, k, v, spec, mask, ids, None, extra=second)
    return impls


def case_env(env: dict | None):
    """The case's environment variables (kernel knobs the launchers read at every call), then the old values."""
    return mock.patch.dict(os.environ, env or {})


def run_variant_case(name, b, h, n, d, variant, mask, *, h_kv=None, ids=None, sdpa=False, ref=False, params=None,
                     env=None):
    """One case of a registry variant at its default parameters (or `params`), under the environment
    variables `env`; rows look like run_case's (impls: ours, sdpa, ref_compiled). The threshold
    kernels' speed does not depend on how many weights the threshold zeroes (no data-dependent skipping)."""
    with case_env(env):
        return _run_variant_case(name, b, h, n, d, variant, mask, h_kv, ids, sdpa, ref, params, env)


def _run_variant_case(name, b, h, n, d, variant, mask, h_kv, ids, sdpa, ref, params, env):
    h_kv = h_kv or h
    q, k, v, second = variant_inputs(b, h, n, d, h_kv, variant, "cuda", torch.bfloat16)
    spec = attn.get_variant(variant).make_spec(**(params or {}))
    flops = useful_flops(b, h, n, d, mask, ids)
    row = {"name": name, "variant": variant, "B": b, "H": h, "H_kv": h_kv, "N": n, "D": d, "params": params or {},
           "mask": mask_name(mask, ids), "fwd_gflop": flops / 1e9, **({"env": env} if env else {})}
    time_impls(name, variant_impls(q, k, v, second, spec, mask, ids, sdpa=sdpa, ref=ref), flops, row)
    torch.cuda.empty_cache()
    return row


def threshold_cases(only="threshold", device="cuda"):
    """(name, b, h, n, d, variant, mask, extra) like cases(); only: threshold | threshold_main."""
    main = (4, 16, 4096, 128)
    causal = MaskSpec(causal=True)
    out = []
    for variant in ("threshold", "diff_threshold"):
        out += [(f"main {variant} causal", *main, variant, causal, {"sdpa": variant == "threshold", "ref": True})]
    if only == "threshold_main":
        return out
    for variant in ("threshold", "diff_threshold"):
        first = variant == "threshold"
        out += [(f"small {variant} causal", 8, 16, 1024, 64, variant, causal, {"sdpa": first})]
        out += [(f"long {variant} causal", 2, 16, 8192, 128, variant, causal, {"sdpa": first})]
        out += [(f"gqa H_kv=4 {variant} causal", *main, variant, causal, {"h_kv": 4, "sdpa": first})]
        out += [(f"window 1024 {variant}", *main, variant, MaskSpec(causal=True, window=1024), {})]
        ids = ranker_layout(4, 2048, 1024, 1024, device)
        out += [(f"ranker 1024h+1024c {variant}", 4, 16, 2048, 128, variant, MaskSpec(causal=False),
                 {"ids": ids})]
    return out


def threshold_targets(rows):
    by = {r["name"]: r for r in rows}
    res = []

    t, dt_ = by.get("main threshold causal"), by.get("main diff_threshold causal")
    if t and "ours" in t and "sdpa" in t:
        res.append(("threshold: fwd TFLOP/s vs SDPA (>= 0.9x)", ratio(t["sdpa"], t["ours"], "fwd_ms"), 0.9))
        res.append(("threshold: fwd+bwd TFLOP/s vs SDPA (>= 0.8x)", ratio(t["sdpa"], t["ours"], "fwdbwd_ms"), 0.8))
    if t and dt_ and "ours" in t and "ours" in dt_:
        res.append(("diff_threshold / threshold fwd+bwd time (<= 1.6)", ratio(dt_["ours"], t["ours"], "fwdbwd_ms"),
                    -1.6))
    for r in (t, dt_):
        if r and "ours" in r and "ref_compiled" in r:
            res.append((f"{r['variant']}: fwd+bwd speed vs compiled reference (> 1x)",
                        ratio(r["ref_compiled"], r["ours"], "fwdbwd_ms"), 1.0))
            res.append((f"{r['variant']}: fwd+bwd peak memory, reference / ours (> 1x)",
                        ratio(r["ref_compiled"], r["ours"], "peak_gib_fwdbwd"), 1.0))
    return judged(res)


# ----------------------------------------------------------------------------------------
# sigmoid attention (issue 18): its kernels against SDPA's plain softmax; `--only sigmoid`
# ----------------------------------------------------------------------------------------


def sigmoid_cases(device="cuda"):
    """(name, b, h, n, d, variant, mask, extra) like cases(); bf16 when run."""
    main = (4, 16, 4096, 128)
    causal = MaskSpec(causal=True)
    return [("main sigmoid causal", *main, "sigmoid", causal, {"sdpa": True}),
            ("small sigmoid causal", 8, 16, 1024, 64, "sigmoid", causal, {"sdpa": True}),
            ("gqa 16:4 sigmoid causal", *main, "sigmoid", causal, {"h_kv": 4, "sdpa": True}),
            ("window 1024 sigmoid", *main, "sigmoid", MaskSpec(causal=True, window=1024), {})]


def sigmoid_targets(rows):
    by = {r["name"]: r for r in rows}
    res = []
    r = by.get("main sigmoid causal")
    if r and "ours" in r and "sdpa" in r:  # SDPA's time / ours: above 1 when ours is faster
        res.append(("sigmoid: fwd speed vs SDPA softmax (>= 1.0x)", ratio(r["sdpa"], r["ours"], "fwd_ms"), 1.0))
        res.append(("sigmoid: fwd+bwd speed vs SDPA softmax (>= 0.85x)", ratio(r["sdpa"], r["ours"], "fwdbwd_ms"), 0.85))
    for name in ("small sigmoid causal", "gqa 16:4 sigmoid causal"):
        r = by.get(name)
        if r and "ours" in r and "sdpa" in r:
            for key, what in (("fwd_ms", "fwd"), ("fwdbwd_ms", "fwd+bwd")):
                res.append((f"{name}: {what} speed vs SDPA softmax", ratio(r["sdpa"], r["ours"], key), None))
    return judged(res)


SIGMOID_PATH_ENV = "ATTNLAB_SIGMOID_PATH"  # attn/kernels/sigmoid_family.py
SIGMOID_PATHS = ("auto", "mufu", "mufu_approx", "newton", "poly")


def sigmoid_path_cases(device="cuda"):
    """The main sigmoid case (and D = 64) once per evaluation path of the kernels (the launchers
    read ATTNLAB_SIGMOID_PATH at every call); SDPA once, on the auto rows."""
    causal = MaskSpec(causal=True)
    return [(f"{label} sigmoid causal path={path}", *shape, "sigmoid", causal,
             {"sdpa": path == "auto", "env": {SIGMOID_PATH_ENV: path}})
            for label, shape in (("main", (4, 16, 4096, 128)), ("small", (8, 16, 1024, 64)))
            for path in SIGMOID_PATHS]


def sigmoid_path_targets(rows):
    """Per path: its speed over the mufu path's (MUFU ex2 and an fp32 division per score) and over
    SDPA's, fwd and fwd+bwd (information, no threshold)."""
    by = {r["name"]: r for r in rows}
    res = []
    for label in ("main", "small"):
        base, sdpa_row = by.get(f"{label} sigmoid causal path=mufu"), by.get(f"{label} sigmoid causal path=auto")
        for path in SIGMOID_PATHS:
            r = by.get(f"{label} sigmoid causal path={path}")
            if not r or "ours" not in r:
                continue
            for key, what in (("fwd_ms", "fwd"), ("fwdbwd_ms", "fwd+bwd")):
                if base and "ours" in base and path != "mufu":
                    res.append((f"{label} path={path}: {what} speed vs path=mufu", ratio(base["ours"], r["ours"], key),
                                None))
                if sdpa_row and "sdpa" in sdpa_row:
                    res.append((f"{label} path={path}: {what} speed vs SDPA softmax",
                                ratio(sdpa_row["sdpa"], r["ours"], key), None))
    return judged(res)


# ----------------------------------------------------------------------------------------
# issue 15: every target row in one process (ranker, recommender shapes, caps, windows, GQA,
# diff_threshold); `--only issue15`, `--dry-run` for the CPU smoke test
# ----------------------------------------------------------------------------------------

THRESHOLD_VARIANTS = ("threshold", "diff_threshold")
RANKER_ROW = (4, 2048, 2048)  # (B, history, candidates) at (H, D) = (16, 128), N = 4096
RECOMMENDER_ROWS = ((128, 384, 128), (32, 1536, 512))  # (B, history, candidates) at (H, D) = (8, 64)
CAPS = ("tanh", "soft_sign", "alsc")


def issue15_cases(device="cuda"):
    """(name, b, h, n, d, cap or threshold variant, mask, extra) like cases(); bf16 when run."""
    main = (4, 16, 4096, 128)
    causal, full = MaskSpec(causal=True), MaskSpec(causal=False)
    b, hist, cand = RANKER_ROW
    out = [(f"ranker {hist}h+{cand}c tanh", b, 16, hist + cand, 128, "tanh", full,
            {"ids": ranker_layout(b, hist + cand, hist, cand, device)}),
           (f"full N={hist + cand} tanh", b, 16, hist + cand, 128, "tanh", full, {"flex": False})]
    for b, hist, cand in RECOMMENDER_ROWS:
        n = hist + cand
        out += [(f"rec B={b} {hist}h+{cand}c tanh", b, 8, n, 64, "tanh", full,
                 {"ids": ranker_layout(b, n, hist, cand, device)}),
                (f"rec B={b} full N={n} tanh", b, 8, n, 64, "tanh", full, {"flex": False})]
    out += [(f"main {v} causal", *main, v, causal, {}) for v in THRESHOLD_VARIANTS]
    out += [("main softmax causal", *main, "none", causal, {"sdpa": True, "flex": False})]
    out += [(f"main {cap} causal", *main, cap, causal, {}) for cap in CAPS]
    out += [("window 1024 tanh", *main, "tanh", MaskSpec(causal=True, window=1024), {})]
    out += [("gqa 16:4 tanh causal", *main, "tanh", causal, {"h_kv": 4, "sdpa": True})]
    return out


def issue15_targets(rows):
    by = {r["name"]: r for r in rows}
    res = []
    phases = (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms"))

    def impl(name, key):
        r = by.get(name)
        return r.get(key) if r else None

    def speed(name, other, ours_name=None):  # other's time / ours: above 1 when ours is faster
        return [ratio(impl(name, other), impl(ours_name or name, "ours"), key) for _, key in phases]

    b, hist, cand = RANKER_ROW
    rk, fu = f"ranker {hist}h+{cand}c tanh", f"full N={hist + cand} tanh"
    for (ph, key) in phases:
        res.append((f"ranker / full time, {ph} (<= 0.55)", ratio(impl(rk, "ours"), impl(fu, "ours"), key), -0.55))
    for (ph, _), v in zip(phases, speed(rk, "flex")):
        res.append((f"ranker: {ph} speed vs Flex (>= 1.8x)", v, 1.8))
    for b, hist, cand in RECOMMENDER_ROWS:
        rec, recfull = f"rec B={b} {hist}h+{cand}c tanh", f"rec B={b} full N={hist + cand} tanh"
        for (ph, _), v in zip(phases, speed(rec, "flex")):
            res.append((f"rec B={b} {hist}h+{cand}c: {ph} speed vs Flex (>= 1.5x)", v, 1.5))
        for (ph, key) in phases:
            res.append((f"rec B={b} {hist}h+{cand}c / full time, {ph}",
                        ratio(impl(rec, "ours"), impl(recfull, "ours"), key), None))
    for (ph, key), lim in zip(phases, (1.3, 1.6)):
        res.append((f"diff_threshold / threshold time, {ph} (<= {lim})",
                    ratio(impl("main diff_threshold causal", "ours"), impl("main threshold causal", "ours"), key),
                    -lim))
    for cap in CAPS:
        name = f"main {cap} causal"
        f_fwd, f_all = speed(name, "flex")
        res.append((f"{cap}: fwd speed vs Flex", f_fwd, None))
        res.append((f"{cap}: fwd+bwd speed vs Flex (>= 1.8x)", f_all, 1.8))
        # SDPA (plain softmax) from the softmax row: the same shape and mask
        s_fwd = ratio(impl("main softmax causal", "sdpa"), impl(name, "ours"), "fwd_ms")
        s_all = ratio(impl("main softmax causal", "sdpa"), impl(name, "ours"), "fwdbwd_ms")
        res.append((f"{cap}: fwd speed vs SDPA softmax", s_fwd, None))
        res.append((f"{cap}: fwd+bwd speed vs SDPA softmax (>= 0.75x)", s_all, 0.75))
    for (ph, _), v, lim in zip(phases, speed("main softmax causal", "sdpa"), (0.9, 0.85)):
        res.append((f"softmax: {ph} speed vs SDPA (>= {lim}x)", v, lim))
    for (ph, _), v in zip(phases, speed("window 1024 tanh", "flex")):
        res.append((f"window 1024 tanh: {ph} speed vs Flex", v, None))
    for other, label in (("flex", "Flex"), ("sdpa", "SDPA softmax")):
        for (ph, _), v in zip(phases, speed("gqa 16:4 tanh causal", other)):
            res.append((f"gqa 16:4 tanh: {ph} speed vs {label}", v, None))
    return judged(res)


def tiny_case(case, n=100, d=32):
    """The case at a CPU-sized shape with the same structure: the layout's history / candidate
    proportions, the window's fraction of N, the GQA group; n is no multiple of any tile."""
    name, b, h, big_n, _, cap, mask, extra = case
    extra = dict(extra)
    extra.pop("ref", None)
    group = h // (extra.get("h_kv") or h)
    h, extra["h_kv"] = (group, 1) if group > 1 else (2, 2)
    b = min(b, 2)
    if extra.get("ids") is not None:
        hs, he, cs, ce = segment_bounds(extra["ids"][:1].cpu())[0].tolist()
        extra["ids"] = ranker_layout(b, n, round((he - hs) * n / big_n), round((ce - cs) * n / big_n), "cpu")
    if mask.window is not None:
        mask = MaskSpec(causal=mask.causal, window=max(1, round(mask.window * n / big_n)))
    return name, b, h, n, d, cap, mask, extra


def dry_check(case, atol=1e-4) -> dict:
    """Builds one case on CPU (fp32, forward only, Triton interpreter, eager Flex), checks that
    Flex's mask equals attn.masks.dense_mask and that every implementation computing the same
    function as ours matches the float64 reference. No timing."""
    from attn.reference import reference_attention

    name, b, h, n, d, cap, mask, extra = case
    h_kv, ids = extra.get("h_kv") or h, extra.get("ids")
    res = {"name": name, "shape": (b, h, h_kv, n, d), "mask": mask_name(mask, ids)}
    if cap not in CAP_CASES:
        q, k, v, second = variant_inputs(b, h, n, d, h_kv, cap, "cpu", torch.float32, grad=False)
        spec = attn.get_variant(cap).make_spec(**extra.get("params", {}))
        impls = variant_impls(q, k, v, second, spec, mask, ids, sdpa=extra.get("sdpa", False))
        same = {"ours"}
    else:
        q, k, v = random_qkv(b, h, n, d, h_kv, "cpu", torch.float32, grad=False)
        second, spec = {}, spec_for(cap)
        flex = extra.get("flex", True) and flex_attention is not None
        if flex:
            res["flex_mask_equal"] = check_flex_mask(mask, ids, b, n, "cpu")
        impls = softmax_impls(q, k, v, cap, mask, ids, sdpa=extra.get("sdpa", False), flex=flex, compiled=False)
        same = {"ours", "flex"} | ({"sdpa"} if cap == "none" and mask.window is None else set())
    f64 = {key: t.double() for key, t in second.items()}
    want = reference_attention(q.double(), k.double(), v.double(), spec, mask, ids, None, extra=f64)
    res["errors"] = {}
    for key, fn in impls.items():
        with torch.no_grad(), warnings.catch_warnings(), case_env(extra.get("env")):
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = fn()
        if key in ("sdpa", "flex"):
            out = out.transpose(1, 2)
        assert out.shape == want.shape, (name, key, out.shape, want.shape)
        if key in same:
            res["errors"][key] = (out.double() - want).abs().max().item()
    res["ok"] = res.get("flex_mask_equal", True) and all(e <= atol for e in res["errors"].values())
    return res


def dry_run(suite_cases) -> list[dict]:
    """Every case at a tiny CPU shape (dry_check), then the tiles-visited fractions at the real
    shapes for the default (pinned) tile configs, since nothing is tuned on CPU."""
    from attn.kernels.softmax_family import DKDV_CONFIGS, DQ_CONFIGS, FWD_CONFIGS

    results = []
    for case in suite_cases:
        r = dry_check(tiny_case(case))
        name, b, h, n, d, cap, mask, extra = case
        if cap in CAP_CASES:
            pinned = {"softmax_family_fwd": FWD_CONFIGS[0], "softmax_family_dkdv": DKDV_CONFIGS[0],
                      "softmax_family_dq": DQ_CONFIGS[0]}
            r["tiles"] = tile_report(mask, n, extra.get("ids"), pinned)
        tiles = "n/a"
        if "tiles" in r:
            t = r["tiles"]
            tiles = ", ".join(f"{k} {t[k]['visited']:.3f}" for k in ("fwd", "dkdv", "dq")) + \
                f"; visible pairs {t['visible_pairs']:.3f}"
        errs = ", ".join(f"{k} {e:.1e}" for k, e in r["errors"].items())
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} {name:34} {r['mask']:8} tiny {r['shape']} "
              f"flex mask equal: {r.get('flex_mask_equal', 'n/a')} | max err {errs} | tiles (pinned) {tiles}",
              flush=True)
        results.append(r)
    return results


SUITES = ["all", "main", "ours", "masks", "shapes", "threshold", "threshold_main", "issue15", "sigmoid",
          "sigmoid_paths"]


def suite(only, device="cuda"):
    """(cases, targets function, title) of one --only choice; device: where segment ids live."""
    if only.startswith("threshold"):
        return threshold_cases(only, device), threshold_targets, "Threshold-family attention benchmark"
    if only == "issue15":
        return issue15_cases(device), issue15_targets, "Attention kernels benchmark: issue 15 targets"
    if only == "sigmoid":
        return sigmoid_cases(device), sigmoid_targets, "Sigmoid attention benchmark"
    if only == "sigmoid_paths":
        return sigmoid_path_cases(device), sigmoid_path_targets, "Sigmoid attention: the kernels' evaluation paths"
    return cases(only, device), targets, "Softmax-family attention benchmark"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_out/bench_attention", help="OUT.md / OUT.json (docs/ holds curated copies)")
    ap.add_argument("--only", default="all", choices=SUITES)
    ap.add_argument("--merge", nargs="*", default=None, help="merge part JSON files into --out, run nothing")
    ap.add_argument("--names", default=None, help="comma list: run only the cases whose name contains one of these")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test: build every case of --only at a tiny shape, check Flex's mask and the "
                         "outputs against the reference, print tiles visited at the real shapes; no timing")
    ap.add_argument("--prewarm", type=int, default=0, metavar="K",
                    help="first compile and tune every case in K worker processes at once (filling Triton's and "
                         "Inductor's on-disk caches), then measure in this process as usual: most of a cold run "
                         "is compiling, one case at a time")
    ap.add_argument("--warm-only", default=None, metavar="I,J,..",
                    help="(a --prewarm worker) run the cases of these indices once each, untimed, write nothing")
    args = ap.parse_args()
    wanted = args.names.split(",") if args.names else None
    if args.dry_run:
        built = [c for c in _dry_suite_cases(args.only) if not wanted or any(w in c[0] for w in wanted)]
        results = dry_run(built)
        bad = [r["name"] for r in results if not r["ok"]]
        print(f"dry run: {len(results) - len(bad)} of {len(results)} cases ok" + (f"; failed: {bad}" if bad else ""))
        sys.exit(1 if bad else 0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    all_cases, targets_of, title = suite(args.only)
    if args.warm_only is not None:
        warm_only([all_cases[int(i)] for i in args.warm_only.split(",") if i])
        return
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        rows = [r for part in parts for r in part["rows"]]
        meta = dict(parts[0]["meta"])
        meta["date"] = " / ".join(dict.fromkeys(p["meta"]["date"] for p in parts))
        tgts = targets_of(rows)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": tgts}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows, tgts, title))
        return
    meta = {**result_header(), "cuda": torch.version.cuda, "suite": args.only}
    print(meta, flush=True)
    if args.prewarm > 0 and not args.merge:
        chosen = [i for i, c in enumerate(all_cases) if not wanted or any(w in c[0] for w in wanted)]
        prewarm(args.only, chosen, args.prewarm, out)
    rows, tgts = [], []
    t0 = time.perf_counter()
    for name, b, h, n, d, cap, mask, extra in all_cases:
        if wanted and not any(w in name for w in wanted):
            continue
        t_case = time.perf_counter()
        runner = run_case if cap in CAP_CASES else run_variant_case
        rows.append(runner(name, b, h, n, d, cap, mask, **extra))
        rows[-1]["case_s"] = round(time.perf_counter() - t_case, 1)  # compile, tuning and timing
        print(f"  {name}: {rows[-1]['case_s']} s (run {time.perf_counter() - t0:.0f} s)", flush=True)
        # written after every case: a run cut off by a time limit keeps what it measured
        tgts = targets_of(rows)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": tgts}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows, tgts, title))
    for t in tgts:
        v = t["value"] if t["value"] is None else round(t["value"], 3)
        print(f"{t['target']:58} {v} {({True: 'met', False: 'MISSED', None: 'info'})[t['met']]}")


def warm_only(some_cases):
    """Each case once, as run_case / run_variant_case build it (compiles and tunes), without timing."""
    global median_ms
    median_ms = lambda fn, **kw: (fn(), 1.0)[1]  # noqa: E731  (bench(): its warm-up calls, then one call)
    for name, b, h, n, d, cap, mask, extra in some_cases:
        t = time.perf_counter()
        (run_case if cap in CAP_CASES else run_variant_case)(name, b, h, n, d, cap, mask, **extra)
        print(f"warmed {name}: {time.perf_counter() - t:.0f} s", flush=True)


def prewarm(only, indices, workers, out):
    """Compile and tune the cases in `workers` processes at once (round robin), wait for all of them;
    the on-disk caches they fill make this process's compiles loads. A failed worker only costs
    its time: the measured run compiles what is missing."""
    t = time.perf_counter()
    procs = []
    for w in range(min(workers, len(indices))):
        mine = ",".join(str(i) for i in indices[w::workers])
        log = open(f"{out}.prewarm{w}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--only", only, "--out", str(out) + ".prewarm",
                                        "--warm-only", mine], stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    print(f"prewarm: {len(procs)} workers, {time.perf_counter() - t:.0f} s, exit codes {codes} "
          f"(logs {out}.prewarm*.log)", flush=True)


def _dry_suite_cases(only):
    """The suite's cases with their segment ids on CPU (dry runs build everything there)."""
    return suite(only, "cpu")[0]


if __name__ == "__main__":
    main()
