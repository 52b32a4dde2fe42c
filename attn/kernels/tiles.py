"""Code shared by every Triton kernel: program prologues (batch, heads, rows or keys of a program),
tile pointers and loads, in-tile visibility (and dropout on elementwise weights), tile-skipping
ranges, full-tile spans, n_i.

Semantics are those of `attn/masks.py` (tested against `dense_mask`). Segment ids reach
kernels as per-row bounds [hist_start, hist_end, cand_start, cand_end) (`segment_bounds`).

The mask functions work on key positions: `seq_len` is the number of keys, and a query is
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

from attn.kernels.dropout import dropout_keep


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


# Program prologues. A query-block kernel runs on the grid (query blocks, batch * H[, key splits]),
# a key-block kernel on (key blocks, batch * H_kv). Query row i sits at key position
# i + pos_offset, pos_offset = kv_len - q_len (bottom-right alignment).


@triton.jit
def batch_and_head(bh, num_heads):
    """(batch, head) of program bh = batch * num_heads + head."""
    b = bh // num_heads
    h = bh % num_heads
    return b, h


@triton.jit
def query_heads(bh, num_heads, group):
    """(batch, query head, kv head) of program bh = batch * num_heads + query head; GQA: the kv
    head is head // group."""
    b, h = batch_and_head(bh, num_heads)
    hk = h // group
    return b, h, hk


@triton.jit
def row_key_count(LENS, b, kv_len, HAS_LENS: tl.constexpr):
    """Keys of batch row b: kv_len, or with HAS_LENS (kv_len the capacity of a static cache)
    LENS[b] (int32) clamped to [0, kv_len]."""
    if HAS_LENS:
        kv_len = tl.minimum(tl.maximum(tl.load(LENS + b), 0), kv_len)
    return kv_len


@triton.jit
def query_block_program(BOUNDS, num_heads, group, q_len, kv_len, BLOCK_M: tl.constexpr, HAS_SEG: tl.constexpr,
                        LENS=None, HAS_LENS: tl.constexpr = False):
    """This query-block program's bh, batch, query head, kv head (`query_heads`), key count
    (`row_key_count`), query rows offs_m, their key positions pos_m, the key position p0 of the
    block's first row and the batch row's segment bounds hs, he, cs, ce. The heaviest (causal:
    last) query blocks run first."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk = query_heads(bh, num_heads, group)
    hs, he, cs, ce = load_segment_bounds(BOUNDS, b, HAS_SEG)
    kv_len = row_key_count(LENS, b, kv_len, HAS_LENS)
    pos_offset = kv_len - q_len
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    pos_m = offs_m + pos_offset
    p0 = m0 + pos_offset
    return bh, b, h, hk, kv_len, offs_m, pos_m, p0, hs, he, cs, ce


@triton.jit
def key_block_program(BOUNDS, num_kv_heads, BLOCK_N: tl.constexpr, HAS_SEG: tl.constexpr):
    """This key-block program's batch, kv head, first key n0, keys offs_n and the batch row's
    segment bounds hs, he, cs, ce."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b, hk = batch_and_head(bhk, num_kv_heads)
    hs, he, cs, ce = load_segment_bounds(BOUNDS, b, HAS_SEG)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return b, hk, n0, offs_n, hs, he, cs, ce


@triton.jit
def tile_ptrs(base, rows, cols, stride_row, stride_col):
    """Pointers to rows x cols of a matrix at base."""
    return base + rows[:, None] * stride_row + cols[None, :] * stride_col


@triton.jit
def load_tile(base, rows, cols, stride_row, stride_col, n_rows, MASKED: tl.constexpr):
    """The rows x cols tile of a matrix at base; MASKED: rows at or past n_rows read as 0."""
    if MASKED:
        in_rows = rows[:, None] < n_rows
        tile = tl.load(tile_ptrs(base, rows, cols, stride_row, stride_col), mask=in_rows, other=0.0)
    else:
        tile = tl.load(tile_ptrs(base, rows, cols, stride_row, stride_col))
    return tile


@triton.jit
def head_tile_ptrs(base, batch, head, rows, cols, stride_b, stride_n, stride_h, stride_d):
    """Pointers to rows x cols of one head of a (B, N, H, D) tensor."""
    return tile_ptrs(base + batch * stride_b + head * stride_h, rows, cols, stride_n, stride_d)


@triton.jit
def head_descriptor(base, num_batches, n_rows, num_heads, stride_b, stride_n, stride_h,
                    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A TMA descriptor of a (B, N, H, D) tensor (unit stride in D) whose boxes are BLOCK rows of one
    head: the copy engine moves the tile and rows at or past n_rows read as 0 (no mask, no pointers)."""
    return tl.make_tensor_descriptor(base, shape=[num_batches, n_rows, num_heads, HEAD_DIM],
                                     strides=[stride_b, stride_n, stride_h, 1], block_shape=[1, BLOCK, 1, HEAD_DIM])


@triton.jit
def load_head_rows(desc, batch, row0, head, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows [row0, row0 + BLOCK) of one head through a `head_descriptor`, as a (BLOCK, HEAD_DIM) tile."""
    return desc.load([batch, row0, head, 0]).reshape(BLOCK, HEAD_DIM)


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
def tile_visible_in_query_range(
    offs_m, offs_n, q_lo, q_hi, seq_len, window, hs, he, cs, ce,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
):
    """tile_visible of a key-block program's query tile: queries restricted to [q_lo, q_hi)."""
    vis = tile_visible(offs_m, offs_n, 0, seq_len, seq_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
    return vis & (offs_m[:, None] >= q_lo) & (offs_m[:, None] < q_hi)


@triton.jit
def mask_and_drop(x, offs_m, offs_n, key_lo, key_hi, seq_len, window, hs, he, cs, ce, seed, bh, dropout_p,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
                  DROPOUT: tl.constexpr):
    """x (query rows offs_m x keys offs_n: an unnormalized weight or its dp) set to 0 where the row
    does not see the key (MASKED tiles, keys kept to [key_lo, key_hi)) and, under DROPOUT, where
    the call's keep mask drops it; kept entries are scaled by 1 / (1 - p)."""
    if MASKED:
        vis = tile_visible(offs_m, offs_n, key_lo, key_hi, seq_len, window, hs, he, cs, ce,
                           CAUSAL, HAS_WINDOW, HAS_SEG)
        x = tl.where(vis, x, 0.0)
    if DROPOUT:
        keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], seq_len, dropout_p)
        x = tl.where(keep, x * (1.0 / (1.0 - dropout_p)), 0.0)
    return x


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
def query_row_ranges(n0, pos_offset, seq_len, window, hs, he, cs, ce,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    """query_ranges with the main range cut to positions that hold a query row (>= pos_offset)."""
    lo, hi, lo2, hi2 = query_ranges(n0, seq_len, window, hs, he, cs, ce, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_SEG)
    lo = tl.maximum(lo, pos_offset)
    hi = tl.maximum(hi, lo)
    return lo, hi, lo2, hi2


@triton.jit
def clip_to_key_split(lo, hi, split, split_len, SPLIT_KV: tl.constexpr):
    """[lo, hi) cut to split `split`'s keys [split * split_len, (split + 1) * split_len) under
    SPLIT_KV (flash-decoding); unchanged otherwise."""
    if SPLIT_KV:
        lo = tl.maximum(lo, split * split_len)
        hi = tl.maximum(tl.minimum(hi, (split + 1) * split_len), lo)
    return lo, hi


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


# Full-tile spans: tiles run without mask arithmetic. Two rules, one per kind of weight:
# - `*_all_rows` (threshold and sigmoid families: unnormalized weights): a tile is full only when
#   every row of the block sees all of it, so a block holding padding rows (which see nothing) stays
#   on the masked path and their weights stay 0; one masked loop walks the boundary tiles
#   (`masked_tile`).
# - `*_ignoring_padding` (softmax family): padding rows may sit in a full tile, because the forward
#   zeroes their output and saves lse = +inf for them, which makes their backward p exactly 0; the
#   kernels walk a masked head loop, the full loop and a masked tail loop.


@triton.jit
def aligned_span(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Tiles lo + t*BLOCK lying inside [full_lo, full_hi), as [a, b) with lo <= a <= b <= hi.

    A loop over [lo, hi) in steps of BLOCK is split into [lo, a) masked, [a, b) unmasked
    and [b, hi) masked; a and b stay on the tile grid that starts at lo.
    """
    a = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK) * BLOCK
    b = lo + (tl.maximum(full_hi - lo, 0) // BLOCK) * BLOCK
    a = tl.minimum(a, hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return a, b


@triton.jit
def masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK: tl.constexpr):
    """Start and owning range of the t-th boundary tile.

    The boundary tiles of a program are [lo, a) (head), [z, hi) (tail) and [lo2, hi2)
    (candidates' diagonal), all walked by ONE masked loop: one copy of the loop body
    instead of three keeps compile time and code size down. Each tile masks keys (or
    queries) to its own range, so a tile reaching past it counts nothing twice.
    """
    n_head = tl.cdiv(a - lo, BLOCK)
    n_main = n_head + tl.cdiv(hi - z, BLOCK)
    in_main = t < n_main
    start = tl.where(t < n_head, lo + t * BLOCK,
                     tl.where(in_main, z + (t - n_head) * BLOCK, lo2 + (t - n_main) * BLOCK))
    range_lo = tl.where(in_main, lo, lo2)
    range_hi = tl.where(in_main, hi, hi2)
    return start, range_lo, range_hi


@triton.jit
def masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK: tl.constexpr):
    return tl.cdiv(a - lo, BLOCK) + tl.cdiv(hi - z, BLOCK) + tl.cdiv(hi2 - lo2, BLOCK)


@triton.jit
def segment_union(hs, he, cs, ce):
    """History plus candidate rows as one span when the two ranges touch, else the history."""
    adjacent = (he > hs) & (ce > cs) & ((he == cs) | (ce == hs))
    u_lo = tl.where(adjacent, tl.minimum(hs, cs), hs)
    u_hi = tl.where(adjacent, tl.maximum(he, ce), he)
    return u_lo, u_hi


@triton.jit
def full_key_span_all_rows(m0, lo, hi, kv_len, window, hs, he, cs, ce,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    """Key tiles of [lo, hi) that every valid query row of [m0, m0 + BLOCK_M) sees entirely.

    m0 is the key position of the block's first query row; rows at or past position kv_len are
    never stored by the forward / dq programs, so they do not constrain the span.
    """
    m_last = tl.minimum(m0 + BLOCK_M, kv_len) - 1
    full_lo = lo
    full_hi = tl.minimum(hi, kv_len)
    if CAUSAL:
        full_hi = tl.minimum(full_hi, m0 + 1)
    if HAS_WINDOW:
        full_lo = tl.maximum(full_lo, m_last - window + 1)
    if HAS_SEG:
        # key_ranges already keeps keys inside the history; every row must be a history or
        # candidate row (padding rows see nothing)
        u_lo, u_hi = segment_union(hs, he, cs, ce)
        rows_ok = ((m0 >= hs) & (m_last < he)) | ((m0 >= cs) & (m_last < ce)) | ((m0 >= u_lo) & (m_last < u_hi))
        full_hi = tl.where(rows_ok, full_hi, full_lo)
    return aligned_span(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def full_query_span_all_rows(n0, lo, hi, kv_len, window, hs, he, cs, ce,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    """Query tiles of [lo, hi) (all rows < kv_len) that see every key of [n0, n0 + BLOCK_N)."""
    full_lo = lo
    full_hi = tl.minimum(hi, kv_len)
    if CAUSAL:
        full_lo = tl.maximum(full_lo, n0 + BLOCK_N - 1)
    if HAS_WINDOW:
        full_hi = tl.minimum(full_hi, n0 + window)
    if HAS_SEG:
        u_lo, u_hi = segment_union(hs, he, cs, ce)
        full_lo = tl.maximum(full_lo, u_lo)
        full_hi = tl.minimum(full_hi, u_hi)
        keys_in_history = (n0 >= hs) & (n0 + BLOCK_N <= he)
        full_hi = tl.where(keys_in_history, full_hi, full_lo)
    # a key block reaching past kv_len stays on the masked path
    full_hi = tl.where(n0 + BLOCK_N <= kv_len, full_hi, full_lo)
    return aligned_span(lo, hi, full_lo, full_hi, BLOCK_M)


@triton.jit
def full_key_span_ignoring_padding(lo, hi, m0, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles lo, lo + BLOCK_N, ... of [lo, hi): [a, b) are those every query row of
    [m0, m0 + BLOCK_M) sees (the window bound counts all BLOCK_M rows; padding rows are not
    checked, see above); [lo, a) and [b, hi) need the mask."""
    s_min = lo
    s_max = hi  # a full tile ends at or before s_max
    if CAUSAL:
        s_max = tl.minimum(s_max, m0 + 1)
    if HAS_WINDOW:
        s_min = tl.maximum(s_min, m0 + BLOCK_M - window)
    n_pre = tl.cdiv(tl.maximum(s_min - lo, 0), BLOCK_N)
    n_all = tl.cdiv(hi - lo, BLOCK_N)
    n_pre = tl.minimum(n_pre, n_all)
    a = lo + n_pre * BLOCK_N
    n_full = tl.maximum(s_max - a, 0) // BLOCK_N
    n_full = tl.minimum(n_full, n_all - n_pre)
    b = a + n_full * BLOCK_N
    return a, b


@triton.jit
def full_query_span_ignoring_padding(lo, hi, n0, kv_len, window, hs, he, BLOCK_M: tl.constexpr,
                                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                                     HAS_SEG: tl.constexpr):
    """Mirror of full_key_span_ignoring_padding for a key block [n0, n0 + BLOCK_N): query tiles
    [a, b) of [lo, hi) see every key of the block (padding query rows are not checked: their
    lse = +inf makes their p exactly 0)."""
    s_min = lo
    s_max = hi
    if CAUSAL:
        s_min = tl.maximum(s_min, n0 + BLOCK_N - 1)
    if HAS_WINDOW:
        s_max = tl.minimum(s_max, n0 + window)
    keys_ok = n0 + BLOCK_N <= kv_len
    if HAS_SEG:
        keys_ok = keys_ok & (n0 >= hs) & (n0 + BLOCK_N <= he)
    n_all = tl.cdiv(hi - lo, BLOCK_M)
    n_pre = tl.minimum(tl.cdiv(tl.maximum(s_min - lo, 0), BLOCK_M), n_all)
    a = lo + n_pre * BLOCK_M
    n_full = tl.minimum(tl.maximum(s_max - a, 0) // BLOCK_M, n_all - n_pre)
    n_full = tl.where(keys_ok, n_full, 0)
    b = a + n_full * BLOCK_M
    return a, b
