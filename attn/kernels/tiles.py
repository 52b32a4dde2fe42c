"""Mask code shared by every Triton kernel: in-tile visibility, tile-skipping ranges, n_i.

Semantics are those of `attn/masks.py` (tested against `dense_mask`). Segment ids reach
kernels as per-row bounds [hist_start, hist_end, cand_start, cand_end) (`segment_bounds`).

Every function here works on key positions: `seq_len` is the number of keys, and a query is
passed as its key position (query row + KV - Q under the bottom-right alignment of Q queries
against KV keys; the row itself when Q == KV).

Tile skipping: a forward program for query rows [m0, m0 + BLOCK_M) visits at most two key
ranges, the main one (everything, or the history keys under segment ids, clipped by
causal / window) and the candidates' diagonal; the ranges are disjoint and each loop
masks keys to its own range, so no key is counted twice. The backward's key-block
programs visit the mirror-image query ranges.
"""

import triton
import triton.language as tl


@triton.jit
def load_segment_bounds(bounds_ptr, batch, HAS_SEG: tl.constexpr):
    """Per-row [hist_start, hist_end, cand_start, cand_end); unused zeros without segment ids."""
    if HAS_SEG:
        hs = tl.load(bounds_ptr + batch * 4 + 0)
        he = tl.load(bounds_ptr + batch * 4 + 1)
        cs = tl.load(bounds_ptr + batch * 4 + 2)
        ce = tl.load(bounds_ptr + batch * 4 + 3)
    else:
        hs = 0
        he = 0
        cs = 0
        ce = 0
    return hs, he, cs, ce


@triton.jit
def tile_visible(
    offs_m, offs_n, lo, hi, seq_len, window, hs, he, cs, ce,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) bool: query offs_m[i] sees key offs_n[j], keys restricted to [lo, hi)."""
    m = offs_m[:, None]
    n = offs_n[None, :]
    vis = (m < seq_len) & (n >= lo) & (n < hi) & (n < seq_len)
    if CAUSAL:
        vis = vis & (n <= m)
    if HAS_WINDOW:
        vis = vis & (n > m - window)
    if HAS_SEG:
        q_hist = (m >= hs) & (m < he)
        q_cand = (m >= cs) & (m < ce)
        k_hist = (n >= hs) & (n < he)
        vis = vis & (((q_hist | q_cand) & k_hist) | (q_cand & (m == n)))
    return vis


@triton.jit
def key_ranges(
    m0, seq_len, window, hs, he, cs, ce,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
):
    """Keys a query block [m0, m0+BLOCK_M) may see: main [lo, hi) and diagonal [lo2, hi2)."""
    m1 = tl.minimum(m0 + BLOCK_M, seq_len)
    lo = 0
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(hi, m1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, m0 - window + 1)
    lo2 = 0
    hi2 = 0
    if HAS_SEG:
        # queries of this block that are history or candidates see history keys
        any_q = (tl.maximum(m0, hs) < tl.minimum(m1, he)) | (tl.maximum(m0, cs) < tl.minimum(m1, ce))
        lo = tl.maximum(lo, hs)
        hi = tl.where(any_q, tl.minimum(hi, he), lo)
        lo2 = tl.maximum(m0, cs)
        hi2 = tl.minimum(m1, ce)
        hi2 = tl.maximum(hi2, lo2)
    hi = tl.maximum(hi, lo)
    return lo, hi, lo2, hi2


@triton.jit
def query_ranges(
    n0, seq_len, window, hs, he, cs, ce,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
):
    """Queries that may see keys [n0, n0+BLOCK_N): main [lo, hi) and diagonal [lo2, hi2).

    Disjoint ranges; each backward loop masks queries to its own range.
    """
    n1 = tl.minimum(n0 + BLOCK_N, seq_len)
    lo = 0
    hi = seq_len
    if CAUSAL:
        lo = tl.maximum(lo, n0)
    if HAS_WINDOW:
        hi = tl.minimum(hi, n1 - 1 + window)
    lo2 = 0
    hi2 = 0
    if HAS_SEG:
        has_hist_key = tl.maximum(n0, hs) < tl.minimum(n1, he)
        has_cand = ce > cs
        # history keys are seen by history and candidate queries (one span covering both)
        q_lo = tl.where(has_cand, tl.minimum(hs, cs), hs)
        q_hi = tl.where(has_cand, tl.maximum(he, ce), he)
        lo = tl.maximum(lo, q_lo)
        hi = tl.where(has_hist_key, tl.minimum(hi, q_hi), lo)
        hi = tl.maximum(hi, lo)
        # candidate keys are seen only by themselves: the diagonal, outside [lo, hi)
        lo2 = tl.maximum(n0, cs)
        hi2 = tl.minimum(n1, ce)
        hi2 = tl.maximum(hi2, lo2)
        # a block holding history keys already spans every candidate query
        hi2 = tl.where(has_hist_key, lo2, hi2)
    hi = tl.maximum(hi, lo)
    return lo, hi, lo2, hi2


@triton.jit
def visible_counts(
    offs_m, seq_len, window, hs, he, cs, ce,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
):
    """n_i (fp32): keys query offs_m[i] sees, closed form (matches masks.visible_key_counts)."""
    hi = tl.zeros_like(offs_m) + seq_len
    lo = tl.zeros_like(offs_m)
    if CAUSAL:
        hi = offs_m + 1
    if HAS_WINDOW:
        lo = tl.maximum(offs_m - window + 1, 0)
    if HAS_SEG:
        seen = tl.maximum(tl.minimum(hi, he) - tl.maximum(lo, hs), 0)
        q_hist = (offs_m >= hs) & (offs_m < he)
        q_cand = (offs_m >= cs) & (offs_m < ce)
        count = tl.where(q_hist, seen, tl.where(q_cand, seen + 1, 0))
    else:
        count = hi - lo
    return count.to(tl.float32)
