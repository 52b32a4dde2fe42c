"""The differential threshold attention backward in Gluon for sm_90 (Hopper).

Inputs and outputs are the portable differential backward's (`threshold_family._backward_plan` with q2,
k2, lam): q, q2, dout (B, N, H, D); k, k2, v (B, KV, H_kv, D), H % H_kv == 0; lam (H,) of any float
dtype, read in fp32; causal is bottom-right aligned (query row i at key position i + KV - N). Returns
(dq, dk, dv, dq2, dk2, dlam): the first five in the inputs' dtype, dlam (H,) in lam's dtype. With
x1_ij = q_i.k_j - tau_i, x2_ij = q2_i.k2_j - tau_i, tau_i = beta sqrt(2 ln n_i / D) (n_i: the keys row i
sees) and dp_ij = dout_i . v_j (DESIGN.md §4, `diff_threshold`):

    w   = relu(x1)^p - lam_h relu(x2)^p             g_v = relu(x_v)^(p-1)  (0 where x_v <= 0)
    dv  = w^T dout
    dk  = p (dp g_1)^T q                            dq  = p (dp g_1) k
    dk2 = -lam_h p (dp g_2)^T q2                    dq2 = -lam_h p (dp g_2) k2
    dlam_h = -sum_ij dp_ij relu(x2_ij)^p

(the factor p of d relu(x)^p / dx and -lam_h p are applied at the stores, except dK2's -lam_h p, which the
key-block kernels apply per score: a GQA program there sums heads with different lambdas). d-lambda is reduced
without atomics: the query-block kernel writes sum_j dp_ij relu(x2_ij)^p per (batch, head, query row) into
an fp32 buffer of its own, and torch sums it over batch and rows in a fixed order and negates it: the same
bits every run.

Launches, on the schedules of `gluon_weighted_bwd` (producer warp, two consumer warpgroups, wgmma
accumulators started at -tau_i so the scores are x itself):

1. key-block kernels, one program per 128 keys of one (batch, kv head), each warpgroup 64 keys; K, K2
   and V are loaded once, the query blocks that see the keys streamed through a ring for every query
   head of the kv head's group (GQA sums stay in registers). Per query block S1^T = K Q^T - tau,
   S2^T = K2 Q2^T - tau and dP^T = V dO^T are issued back to back. Three forms (`VIEWS`):
   - 0, fused: dV += W^T dO, dK += (dP^T G1^T) Q and dK2 += (dP^T G2^T) Q2 in one launch (three 64 x D
     fp32 accumulators beside three 64 x BLOCK_M score tiles: used at D = 64);
   - 1, first view: dV and dK (the ring slot carries Q, Q2 and dO, both views form W);
   - 2, second view: dK2 (the ring carries Q2 and dO only: the one-map kernel's ring and producer).
   At D = 128 three accumulators do not fit a warpgroup's registers beside the score tiles, so the
   backward runs forms 1 (on 32-row query blocks) and 2 (`dkdv_forms`, `dkdv_tile_config`).
   - 3, view warpgroups (`launch_diff_threshold_backward(..., dkdv_form="view_warpgroups")`): one program
     per 64 keys, a warpgroup per score view on the same keys, each the one-map threshold's key-block step
     (`gluon_weighted_bwd._dkdv_block`, 64-row query blocks, two accumulators): view 1 dK and
     dV1 += W1^T dO, view 2 dK2 and dV2 += lambda_h W2^T dO; view 2 hands dV2 to view 1 through an fp32
     shared-memory tile and dv = dV1 - dV2. One launch instead of two, dP^T computed by both warpgroups:
     8 products per block.
   - 4, view exchange (`dkdv_form="view_exchange"`): form 3's program and ring, 6 products per block
     instead of 8. View 1 computes S1^T, dP^T and dK; it hands dP^T and W1^T (fp32 tiles in shared memory,
     XCHG_SLOTS slots with a full / empty mbarrier pair each) to view 2, which computes S2^T, then
     dV += (W1^T - lambda_h W2^T) dO and dK2 from that dP^T. View 2 stores dk2 and dv. Within the float64
     rule on an H100 and 1.5-6 % slower than form 3 there: the exchange costs what the products save.
   The backward plan offers the forms in `tiers.DIFF_DKDV_FORMS_OFFERED` (those whose GPU tests pass):
   ATTNLAB_GLUON_DIFF_DKDV picks one, "auto" times the offered forms per tuning key.
2. `_dq_kernel`, one program per 128 query rows of one (batch, head), Q, Q2 and dO loaded once, K and
   K2 (one ring slot, one ready barrier) and V streamed; per key block S1 = Q K^T, S2 = Q2 K2^T,
   dP = dO V^T, then dQ += (dP G1) K, dQ2 += (dP G2) K2 and the rows' d-lambda sums of dP relu(S2)^p.
   dq, dq2 and the sums are written once (no atomics). Its view-warpgroup form (`_dq_views_kernel`,
   `dq_form="view_warpgroups"`): one program per 64 query rows, a warpgroup per score view on them (view 1 the
   one-map threshold's dQ consumer: S1, dP, dQ; view 2 S2, dP, dQ2 and the d-lambda terms), 6 products per block
   instead of 5 but 64-key blocks at D = 128 and 15.9 instead of 18.7 SASS per position there. The backward plan
   times both forms per tuning key and key-block form (`tiers.DIFF_DQ_FORMS_OFFERED`; ATTNLAB_GLUON_DIFF_DQ).
3. `persistent=True`: the query-block kernel and the key halves' key-block launches (forms 0, 1, 2) on
   persistent grids (`_persistent_dq_kernel`, `_persistent_dkdv_kernel`): at most one program per SM
   running the same work items in turn (the forwards' query-block order, `key_block_item`'s key-block order),
   the producer loading the next item's first streamed tiles and then, once both consumers arrived on the
   item-empty barrier, its stationary ones, while the consumers store this item's gradients: the same bits
   per item. The backward plan times it against the per-item grids per tuning key
   (`tiers.PERSISTENT_BACKWARDS_OFFERED`).
4. `one_pass=True` (p = 1 or 2, with the view warpgroups): no query-block kernel; `_dkdv_views_dq_kernel`'s view
   warpgroups also add each block's dQ1 = dS1 K and dQ2 = dS2 K2 into fp32 buffers by TMA reduce-adds and write
   the d-lambda terms per key, then a cast each. Within the float64 rule on an H100 and slower there (0.63x the
   separate view forms' speed at (4,16,4096,128): each view's reduce-adds of a 64 x D fp32 tile per 64 keys;
   docs/gluon.md), so no backward plan offers it.

Masks: as `gluon_weighted_bwd`: the causal diagonal's blocks compare per score (both views' scores
select -inf where a key is not seen, so w and g vanish there), the rest run without mask arithmetic;
query rows past N start at -1e30 (w = g = 0); keys past KV touch only gradient rows that are not stored;
the dQ kernel masks keys with `gluon_pipeline.visible_key` and stores no row past N. A NaN score gives NaN
gradients, as the reference does.

Served: what the Gluon differential forward serves (`gluon_diff_fwd`): no segments, key lengths, window
or dropout; causal or full; GQA with q2, k2 shaped like q, k; D 64 / 128; bf16 / fp16; KV >= N (KV < N
also works: rows that see no key get zero gradient). Behind the public function through the kernel tiers:
`threshold_family`'s backward plan offers `launch_diff_threshold_backward` to the differential calls it
serves, after either tier's forward (both save only the inputs).
"""

from __future__ import annotations

import functools
import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from attn.kernels.gluon_diff_fwd import (_allocate_ring, _load_queries, _persistent_producer, _rectified_power,
                                         _stream_keys, check_second_view)
from attn.kernels.gluon_pipeline import (
    serves,  # which operands the kernels serve: D 64 / 128, bf16 / fp16
    CONSUMER_REGS,
    GLUON_OPTIONS,
    HEAD_DIMS,
    PRODUCER_REGS,
    allocate_item_empty,
    allocate_ring,
    check_operands,
    compile_gluon_sm90,
    descriptor,
    descriptor_type,
    fence_async_shared,
    invalidate_ring,
    issue_qk,
    key_blocks,
    mbarrier,
    persistent_item,
    persistent_programs,
    program_rows,
    release,
    tma,
    tma_tile,
    tma_view,
    visible_key,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from attn.kernels.gluon_softmax_bwd import (CAST_BLOCK, _dkdv_producer, _dq_cast_kernel, _issue_with_columns,
                                           dq_accumulator_tile, key_block_item, key_block_program,
                                           one_pass_key_block_program, persistent_dkdv_producer)
from attn.kernels.gluon_weighted_bwd import (ROW_VALUES_AHEAD, _dkdv_block, _next_block_row, _query_starts,
                                             _score_grad, _weight_and_grad)
from attn.kernels.gluon_weighted_bwd import _dq_consumer as _weighted_dq_consumer
from attn.kernels.gluon_weighted_fwd import THRESHOLD, _row_value, power_mode
from attn.kernels.runtime import DirectLauncher, cdiv

FUSED = 0  # dK, dV and dK2 in one key-block launch
FIRST_VIEW = 1  # dK and dV
SECOND_VIEW = 2  # dK2
VIEW_WARPGROUPS = 3  # one warpgroup per view on the same keys: dK and dV, dK2, in one launch
VIEW_EXCHANGE = 4  # as VIEW_WARPGROUPS, dP^T and dV computed once: view 1 hands dP^T and W1^T to view 2
# Query rows per ring slot of the fused form (D = 64): 64 rows compile without local memory in the loops, with 21 %
# fewer instructions per position than 32 (15.6 against 19.7 at p = 2), and the backward at (16,12,1024,64) takes
# 0.424 against 0.445 ms on an H100 (docs/results/gluon/diff_bwd_persistent_fused64_h100.md)
FUSED_QUERY_ROWS = 64
# the key-block forms a backward launch takes (`launch_diff_threshold_backward`'s dkdv_form): the key halves
# (`dkdv_forms`: FUSED at D = 64, FIRST_VIEW and SECOND_VIEW at D = 128), VIEW_WARPGROUPS, VIEW_EXCHANGE
DKDV_FORMS = {"key_halves": None, "view_warpgroups": VIEW_WARPGROUPS, "view_exchange": VIEW_EXCHANGE}
# the query-block kernel's forms (`launch_diff_threshold_backward`'s dq_form): "rows", each consumer warpgroup its
# own 64 query rows and both views (`_dq_kernel`); "view_warpgroups", a warpgroup per view on the same 64 rows
# (`_dq_views_kernel`)
DQ_FORMS = ("rows", "view_warpgroups")


def dkdv_tile_config(head_dim: int, views: int, fused_query_rows: int | None = None) -> dict:
    """The key-block kernels' constexprs: BLOCK_N keys per program (64 per consumer warpgroup), BLOCK_M
    query rows per ring slot, STAGES ring slots. Forms 0 and 1 hold two or three 64 x D fp32 accumulators
    beside S1^T, S2^T and dP^T (BLOCK_M / 2 fp32 registers each per thread): BLOCK_M is 32 for form 1 (64
    spills inside its loops at D = 128) and `fused_query_rows` (default FUSED_QUERY_ROWS) for form 0; they
    keep K, K2, V (D = 128: 96 KiB; D = 64: 48 KiB) and 4 slots of Q, Q2, dO (BLOCK_M x D each). Form 2 takes
    64 rows a slot: K2, V (64 / 32 KiB) and 3 slots of Q2, dO (32 / 16 KiB each)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon differential threshold backward: head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if views not in (FUSED, FIRST_VIEW, SECOND_VIEW, VIEW_WARPGROUPS, VIEW_EXCHANGE):
        raise ValueError(f"views must be {FUSED} (fused), {FIRST_VIEW}, {SECOND_VIEW}, {VIEW_WARPGROUPS} (view "
                         f"warpgroups) or {VIEW_EXCHANGE} (view exchange), got {views!r}")
    if views == SECOND_VIEW:
        return dict(BLOCK_M=64, BLOCK_N=128, STAGES=3)
    if views == VIEW_WARPGROUPS:
        return dict(BLOCK_M=64, BLOCK_N=64, STAGES=3)
    if views == VIEW_EXCHANGE:  # XCHG_SLOTS exchange slots of dP^T and W1^T, 32 / 16 KiB each at D = 128 / 64
        return dict(BLOCK_M=64, BLOCK_N=64, STAGES=3, XCHG_SLOTS=1)
    if views == FUSED:
        return dict(BLOCK_M=fused_query_rows or FUSED_QUERY_ROWS, BLOCK_N=128, STAGES=4)
    return dict(BLOCK_M=32, BLOCK_N=128, STAGES=4)


def one_pass_tile_config(head_dim: int) -> dict:
    """`_dkdv_views_dq_kernel`'s constexprs: form 3's 64 keys and 64-row query blocks, DQ_COLS = 64 dQ columns
    per product and reduce staging tile; STAGES ring slots: 2 at D = 128 (the dQ path takes the third slot's 48
    KiB: each view's 8 KiB dS^T and two 16 KiB staging tiles, view 2's holding the dV2 hand-off's 32 KiB), 3 at
    D = 64."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon differential threshold backward: head dim must be one of {HEAD_DIMS}, got {head_dim}")
    return dict(BLOCK_M=64, BLOCK_N=64, STAGES=2 if head_dim == 128 else 3, DQ_COLS=64)


def key_tile_rows(views: int, config: dict) -> int:
    """Rows of a key-block form's K, K2, V tiles: a warpgroup's half of the program's keys, or, for the
    view warpgroups (both on the same keys), all of them."""
    return config["BLOCK_N"] if views in (VIEW_WARPGROUPS, VIEW_EXCHANGE) else config["BLOCK_N"] // 2


def dkdv_forms(head_dim: int) -> tuple[int, ...]:
    """The key-block launches per head dim: the fused form at D = 64; at D = 128 the first and the
    second view's launches (the fused form's three 64 x 128 fp32 accumulators do not fit a warpgroup's
    registers beside its three score tiles)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon differential threshold backward: head dim must be one of {HEAD_DIMS}, got {head_dim}")
    return (FUSED,) if head_dim == 64 else (FIRST_VIEW, SECOND_VIEW)


def dq_tile_config(head_dim: int, dq_form: str = "rows") -> dict:
    """The query-block kernel's constexprs: BLOCK_M rows per program, BLOCK_N keys per ring slot (K, K2 and
    V), STAGES slots. "rows" (`_dq_kernel`): 64 rows per consumer warpgroup, each holding dQ and dQ2 (D / 2
    fp32 registers each per thread) beside S1, S2, dP (BLOCK_N / 2 each): BLOCK_N is 32 at D = 128 (64 spilled
    inside the loops). "view_warpgroups" (`_dq_views_kernel`): 64 rows both warpgroups share, one
    accumulator each, 64-key blocks."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon differential threshold backward: head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if dq_form not in DQ_FORMS:
        raise ValueError(f"dq_form must be one of {DQ_FORMS}, got {dq_form!r}")
    if dq_form == "view_warpgroups":  # Q, Q2, dO 48 / 24 KiB + 3 x 48 / 24 KiB
        return dict(BLOCK_M=64, BLOCK_N=64, STAGES=3)
    if head_dim == 128:
        return dict(BLOCK_M=128, BLOCK_N=32, STAGES=3)  # Q, Q2, dO 96 KiB + 3 x 24 KiB
    return dict(BLOCK_M=128, BLOCK_N=64, STAGES=3)  # 48 KiB + 3 x 24 KiB


# ----------------------------------------------------------------------------- dK, dV, dK2 (key blocks)


@gluon.jit
def _issue_two_views(j, k_tile, k2_tile, q_ring, q2_ring, q_ready, start, st_layout: gl.constexpr,
                     ROWS: gl.constexpr, COLS: gl.constexpr, STAGES: gl.constexpr):
    """Waits for ring tile j (its Q and Q2 share one ready barrier), then issues S1^T = K Q^T + start and
    S2^T = K2 Q2^T + start as async wgmmas, the accumulators starting as `start` (one value per query
    column). Returns (S1^T, S2^T, Q tile, Q2 tile)."""
    s = j % STAGES
    q_tile = q_ring.index(s)
    q2_tile = q2_ring.index(s)
    mbarrier.wait(q_ready.index(s), (j // STAGES) & 1)
    column_values = gl.convert_layout(start, gl.SliceLayout(0, st_layout))
    acc = gl.expand_dims(column_values, 0).broadcast_to([ROWS, COLS])
    s1_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), acc, use_acc=True, is_async=True)
    s2_t = warpgroup_mma(k2_tile, q2_tile.permute((1, 0)), acc, use_acc=True, is_async=True)
    return s1_t, s2_t, q_tile, q2_tile


@gluon.jit
def _visible_columns(m, first_col, st_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """The causal diagonal's [keys, queries] mask: key row r sees query column c when c >= first_col[r] - m."""
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    return gl.expand_dims(cols, 0) >= gl.expand_dims(first_col - m, 1)


@gluon.jit
def _two_view_block(j, m, m_next, start, dk, dv, dk2, k_tile, k2_tile, v_tile, q_ring, q2_ring, do_ring, q_ready,
                    do_ready, q_empty, do_empty, q_len, kv_len, first_col, tau_scale, lam, dk2_scale, power,
                    st_layout: gl.constexpr, a_layout: gl.constexpr, VIEWS: gl.constexpr, POWER_MODE: gl.constexpr,
                    CAUSAL: gl.constexpr, MASKED: gl.constexpr, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr):
    """Forms 0 and 1: one warpgroup's keys against the query block from row m (ring tile j). S1^T, S2^T
    and dP^T issued back to back; W^T = relu(S1^T)^p - lam relu(S2^T)^p and G1^T (form 0: G2^T) once the
    scores are in, dV += W^T dO issued at once; then dK += (dP^T G1^T) Q (form 0: dK2 += dk2_scale
    (dP^T G2^T) Q2). dO's slot goes back when dV retired, the Q / Q2 slot when the last product did. `start`:
    this block's `_query_starts`; the block from row m_next's are computed while the scores' products run
    (as `gluon_weighted_bwd._dkdv_block`), but in form 0 at a general power (its loop, three accumulators
    beside the power's temporaries, spills with one more live value), where each block computes its own
    and `start` passes through. Returns (dk, dv, dk2, the next block's starts)."""
    AHEAD: gl.constexpr = ROW_VALUES_AHEAD and (VIEWS != 0 or POWER_MODE != 0)
    if not AHEAD:
        start = _query_starts(m, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)
    s1_t, s2_t, q_tile, q2_tile = _issue_two_views(j, k_tile, k2_tile, q_ring, q2_ring, q_ready, start, st_layout,
                                                   HALF_N, BLOCK_M, STAGES)
    dp_t, do_tile = issue_qk(j, v_tile, do_ring, do_ready, st_layout, HALF_N, BLOCK_M, STAGES)
    if AHEAD:
        start_next = _query_starts(m_next, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)
    else:
        start_next = start
    s1_t, s2_t, k_tile, k2_tile, q_tile, q2_tile = warpgroup_mma_wait(
        num_outstanding=1, deps=(s1_t, s2_t, k_tile, k2_tile, q_tile, q2_tile))  # S1^T, S2^T retired
    if MASKED:  # relu(-inf) = 0: the select rides on the scores, before either function
        visible = _visible_columns(m, first_col, st_layout, BLOCK_M)
        s1_t = gl.where(visible, s1_t, -float("inf"))
        s2_t = gl.where(visible, s2_t, -float("inf"))
    w1_t, g1_t = _weight_and_grad(s1_t, 0, power, THRESHOLD, POWER_MODE, 0, False)
    if VIEWS == 0:
        w2_t, g2_t = _weight_and_grad(s2_t, 0, power, THRESHOLD, POWER_MODE, 0, False)
    else:
        w2_t = _rectified_power(s2_t, power, POWER_MODE)
    w16 = gl.convert_layout((w1_t - lam * w2_t).to(q_ring.dtype), a_layout)
    dv = warpgroup_mma(w16, do_tile, dv, is_async=True)
    dp_t, v_tile, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, v_tile, do_tile))  # dP^T retired
    ds16 = gl.convert_layout(_score_grad(dp_t, g1_t, THRESHOLD, POWER_MODE).to(q_ring.dtype), a_layout)
    dk = warpgroup_mma(ds16, q_tile, dk, is_async=True)
    if VIEWS == 0:
        ds2_16 = gl.convert_layout((_score_grad(dp_t, g2_t, THRESHOLD, POWER_MODE) * dk2_scale).to(q_ring.dtype),
                                   a_layout)
        dk2 = warpgroup_mma(ds2_16, q2_tile, dk2, is_async=True)
        dv, w16, do_tile = warpgroup_mma_wait(num_outstanding=2, deps=(dv, w16, do_tile))
        release(j, do_empty, STAGES)
        dk, dk2, ds16, ds2_16, q_tile, q2_tile = warpgroup_mma_wait(
            num_outstanding=0, deps=(dk, dk2, ds16, ds2_16, q_tile, q2_tile))
    else:
        dv, w16, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dv, w16, do_tile))
        release(j, do_empty, STAGES)
        dk, ds16, q_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds16, q_tile))
    release(j, q_empty, STAGES)
    return dk, dv, dk2, start_next


@gluon.jit
def _second_view_block(j, m, m_next, start, dk2, k2_tile, v_tile, q2_ring, do_ring, q_ready, do_ready, q_empty,
                       do_empty, q_len, kv_len, first_col, tau_scale, dk2_scale, power, st_layout: gl.constexpr,
                       a_layout: gl.constexpr, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                       HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Form 2: one warpgroup's keys against the query block from row m (ring tile j): S2^T and dP^T
    issued back to back, G2^T once S2^T is in, dO's slot back once dP^T retired, then
    dK2 += dk2_scale (dP^T G2^T) Q2 and the Q2 slot back once it retired. `start`, m_next and the returned
    (dk2, the next block's starts) as `_two_view_block`'s (its loop does not spill either way)."""
    if not ROW_VALUES_AHEAD:
        start = _query_starts(m, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)
    s2_t, q2_tile = _issue_with_columns(j, k2_tile, q2_ring, q_ready, start, st_layout, HALF_N, BLOCK_M, STAGES)
    dp_t, do_tile = issue_qk(j, v_tile, do_ring, do_ready, st_layout, HALF_N, BLOCK_M, STAGES)
    if ROW_VALUES_AHEAD:
        start_next = _query_starts(m_next, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)
    else:
        start_next = start
    s2_t, k2_tile, q2_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s2_t, k2_tile, q2_tile))  # S2^T retired
    visible = 0
    if MASKED:
        visible = _visible_columns(m, first_col, st_layout, BLOCK_M)
    _, g2_t = _weight_and_grad(s2_t, visible, power, THRESHOLD, POWER_MODE, 0, MASKED)
    dp_t, v_tile, do_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, v_tile, do_tile))  # dP^T retired
    release(j, do_empty, STAGES)
    ds2_16 = gl.convert_layout((_score_grad(dp_t, g2_t, THRESHOLD, POWER_MODE) * dk2_scale).to(q2_ring.dtype),
                               a_layout)
    dk2 = warpgroup_mma(ds2_16, q2_tile, dk2, is_async=True)
    dk2, ds2_16, q2_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk2, ds2_16, q2_tile))
    release(j, q_empty, STAGES)
    return dk2, start_next


@gluon.jit
def _store_key_rows(ptr, base, keys, stride_n, acc, kv_len, kv_layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Stores the fp32 accumulator's key rows (those < kv_len) at ptr + base + key stride_n + d."""
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    rows = ptr + base + gl.expand_dims(keys.to(gl.int64) * stride_n, 1) + gl.expand_dims(offs_d, 0)
    gl.store(rows, acc.to(ptr.dtype.element_ty), mask=gl.expand_dims(keys < kv_len, 1))


@gluon.jit
def _dkdv_consumer(k_tile, k2_tile, v_tile, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty,
                   DK, DV, DK2, LAM, stride_lam, kv_base, stride_kvn, hk, key0, GROUP, q_len,
                   kv_len, i_lo, i_full, i_hi, tau_scale, power, ring, kv_phase, kv_empty,
                   VIEWS: gl.constexpr, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HALF_N: gl.constexpr,
                   BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr,
                   PERSISTENT: gl.constexpr = False):
    """One warpgroup: keys [key0, key0 + HALF_N) against every query block of the program's range for
    each query head of the group (lambda per head: dK2's factor -lam_h p rides on its scores); stores its
    rows of its form's gradients (dk times p). Form 2 gets K2 as k_tile and the Q2 ring as q2_ring. The
    ring's tiles start at ring, the key tiles' phase is kv_phase. PERSISTENT: one of a persistent program's
    work items, which arrives on kv_empty once its last product retired (the producer then loads the next
    item's key tiles)."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    # causal: key row r is visible to query rows i >= key - (kv_len - q_len)
    key_rows = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, st_layout))
    first_col = key_rows - (kv_len - q_len)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dk2 = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    count = i_hi - i_lo
    start = _query_starts(i_lo * BLOCK_M, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)

    mbarrier.wait(kv_bar, kv_phase)
    for gi in range(GROUP):  # the row thresholds do not depend on the head: only the ring tiles move on
        h = hk * GROUP + gi
        lam = gl.load(LAM + h.to(gl.int64) * stride_lam).to(gl.float32)
        dk2_scale = -lam * power
        j0 = ring + gi * count - i_lo  # ring tile of query block i: j0 + i
        if CAUSAL:
            for i in range(i_lo, i_full):
                m_next = _next_block_row(i, i_lo, i_hi, BLOCK_M)
                if VIEWS == 2:
                    dk2, start = _second_view_block(
                        j0 + i, i * BLOCK_M, m_next, start, dk2, k_tile, v_tile, q2_ring, do_ring, q_ready,
                        do_ready, q_empty, do_empty, q_len, kv_len, first_col, tau_scale, dk2_scale, power, st_layout,
                        a_layout, POWER_MODE, CAUSAL, True, HALF_N, BLOCK_M, STAGES)
                else:
                    dk, dv, dk2, start = _two_view_block(
                        j0 + i, i * BLOCK_M, m_next, start, dk, dv, dk2, k_tile, k2_tile, v_tile, q_ring, q2_ring,
                        do_ring, q_ready, do_ready, q_empty, do_empty, q_len, kv_len, first_col, tau_scale, lam,
                        dk2_scale, power, st_layout, a_layout, VIEWS, POWER_MODE, CAUSAL, True, HALF_N,
                        BLOCK_M, STAGES)
        for i in range(i_full, i_hi):
            m_next = _next_block_row(i, i_lo, i_hi, BLOCK_M)
            if VIEWS == 2:
                dk2, start = _second_view_block(
                    j0 + i, i * BLOCK_M, m_next, start, dk2, k_tile, v_tile, q2_ring, do_ring, q_ready, do_ready,
                    q_empty, do_empty, q_len, kv_len, first_col, tau_scale, dk2_scale, power, st_layout, a_layout,
                    POWER_MODE, CAUSAL, False, HALF_N, BLOCK_M, STAGES)
            else:
                dk, dv, dk2, start = _two_view_block(
                    j0 + i, i * BLOCK_M, m_next, start, dk, dv, dk2, k_tile, k2_tile, v_tile, q_ring, q2_ring,
                    do_ring, q_ready, do_ready, q_empty, do_empty, q_len, kv_len, first_col, tau_scale, lam, dk2_scale,
                    power, st_layout, a_layout, VIEWS, POWER_MODE, CAUSAL, False, HALF_N, BLOCK_M, STAGES)
    if PERSISTENT:  # every product of the item has retired: the key tiles are free
        gl.thread_barrier()
        mbarrier.arrive(kv_empty)

    keys = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, kv_layout))
    if VIEWS != 2:
        _store_key_rows(DK, kv_base, keys, stride_kvn, dk * power, kv_len, kv_layout, HEAD_DIM)
        _store_key_rows(DV, kv_base, keys, stride_kvn, dv, kv_len, kv_layout, HEAD_DIM)
    if VIEWS != 1:
        _store_key_rows(DK2, kv_base, keys, stride_kvn, dk2, kv_len, kv_layout, HEAD_DIM)


@gluon.jit
def _view_block(i, j0, i_lo, i_hi, start, dk, dv, dlam_rows, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready,
                q_empty, do_empty, q_len, kv_len, first_col, tau_scale, power, lam, dq_col, one_pass,
                st_layout: gl.constexpr, a_layout: gl.constexpr, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                MASKED: gl.constexpr, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                SCALED: gl.constexpr, AHEAD: gl.constexpr, ONE_PASS_DQ: gl.constexpr, DLAM: gl.constexpr):
    """A view warpgroup's step on query block i (ring tile j0 + i): `gluon_weighted_bwd._dkdv_block` on the view's
    tiles, with the one-pass form's dQ path (its own dS, K tile, staging, dq at the block's rows and the head's
    columns dq_col) and d-lambda terms (DLAM) where asked. Returns (dk, dv, the next block's starts, dlam_rows)."""
    dq_path = 0
    if ONE_PASS_DQ:
        dq_path = (one_pass[0], one_pass[1], k_tile, one_pass[2], one_pass[3], 0, 0, one_pass[5] * q_len + i * BLOCK_M,
                   dq_col)
    m_next = _next_block_row(i, i_lo, i_hi, BLOCK_M)
    if DLAM:
        dk, dv, start, dlam_rows = _dkdv_block(
            j0 + i, i * BLOCK_M, m_next, start, dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty,
            do_empty, q_len, kv_len, first_col, 1.0, -1.0, tau_scale, power, st_layout, a_layout, THRESHOLD,
            POWER_MODE, False, 0, CAUSAL, MASKED, KEYS, BLOCK_M, STAGES, lam, SCALED, AHEAD, dq_path, ONE_PASS_DQ,
            True, dlam_rows, True)
    else:
        dk, dv, start = _dkdv_block(
            j0 + i, i * BLOCK_M, m_next, start, dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty,
            do_empty, q_len, kv_len, first_col, 1.0, -1.0, tau_scale, power, st_layout, a_layout, THRESHOLD,
            POWER_MODE, False, 0, CAUSAL, MASKED, KEYS, BLOCK_M, STAGES, lam, SCALED, AHEAD, dq_path, ONE_PASS_DQ,
            ONE_PASS_DQ)
    return dk, dv, start, dlam_rows


@gluon.jit
def _view_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, dv2_smem, dv2_bar,
                   DK, DV, LAM, stride_lam, kv_base, stride_kvn, hk, key0, GROUP, q_len, kv_len, i_lo, i_full, i_hi,
                   tau_scale, power, VIEW: gl.constexpr, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                   KEYS: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                   NUM_WARPS_C: gl.constexpr, one_pass=0, ONE_PASS_DQ: gl.constexpr = False):
    """The view warpgroups' form (`VIEW_WARPGROUPS`): one warpgroup per score view on the program's KEYS
    keys, each running the one-map threshold's key-block step (`gluon_weighted_bwd._dkdv_block`) on its
    view's K tile and Q ring for every query block of every query head of the group. View 1: dK and
    dV1 += W1^T dO; view 2 (lambda_h riding on its scores, heads of a GQA group differ): dK2 with its factor
    -lambda_h p and dV2 += lambda_h W2^T dO. View 2 stores dk2 and hands dV2 to view 1 through dv2_smem
    (arriving on dv2_bar); view 1 stores dk times p and dv = dV1 - dV2. `DK` is the view's gradient of its
    keys (dk or dk2). ONE_PASS_DQ (`_dkdv_views_dq_kernel`): each tile's dQ of the view (dS1 K, or dS2 K2 with
    its factor -lambda_h p) also goes into the view's fp32 dq by TMA reduce-adds (`_dkdv_block`'s DQ_OWN), and
    view 2 writes each head's d-lambda terms per key (sum over the query rows of dP relu(x2)^p; p = 1 or 2) to
    DLAM_PART (B, H, KV); one_pass = (ds_smem, ds_rows, the view's two staging tiles, dq_desc, DLAM_PART, b,
    H)."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    SCALED: gl.constexpr = VIEW == 2
    DLAM: gl.constexpr = ONE_PASS_DQ and VIEW == 2
    # the next block's starts computed during this one, but at p = 1, whose causal diagonal's loop spills so
    AHEAD: gl.constexpr = ROW_VALUES_AHEAD and POWER_MODE != 1 and not ONE_PASS_DQ
    key_rows = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    first_col = key_rows - (kv_len - q_len)
    if ONE_PASS_DQ and not CAUSAL:  # every query sees a key before kv_len, none one past it (dq and d-lambda)
        first_col = gl.where(key_rows < kv_len, 0, 1 << 30)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    count = i_hi - i_lo
    start = _query_starts(i_lo * BLOCK_M, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)

    mbarrier.wait(kv_bar, 0)
    for gi in range(GROUP):  # the row thresholds do not depend on the head: only the ring tiles move on
        lam = 1.0
        if SCALED:
            lam = gl.load(LAM + (hk * GROUP + gi).to(gl.int64) * stride_lam).to(gl.float32)
        j0 = gi * count - i_lo  # ring tile of query block i: j0 + i
        dlam_rows = gl.zeros([KEYS], gl.float32, gl.SliceLayout(1, st_layout))
        dq_col = (hk * GROUP + gi) * HEAD_DIM  # the head's first column of dq (one-pass)
        if CAUSAL or ONE_PASS_DQ:
            for i in range(i_lo, i_full):
                dk, dv, start, dlam_rows = _view_block(
                    i, j0, i_lo, i_hi, start, dk, dv, dlam_rows, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready,
                    q_empty, do_empty, q_len, kv_len, first_col, tau_scale, power, lam, dq_col, one_pass, st_layout,
                    a_layout, POWER_MODE, CAUSAL, True, KEYS, BLOCK_M, STAGES, SCALED, AHEAD, ONE_PASS_DQ, DLAM)
        for i in range(i_full, i_hi):
            dk, dv, start, dlam_rows = _view_block(
                i, j0, i_lo, i_hi, start, dk, dv, dlam_rows, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready,
                q_empty, do_empty, q_len, kv_len, first_col, tau_scale, power, lam, dq_col, one_pass, st_layout,
                a_layout, POWER_MODE, CAUSAL, False, KEYS, BLOCK_M, STAGES, SCALED, AHEAD, ONE_PASS_DQ, DLAM)
        if DLAM:  # this head's d-lambda terms per key (keys past kv_len: not stored)
            part = one_pass[4] + (one_pass[5] * one_pass[6] + hk * GROUP + gi).to(gl.int64) * kv_len
            gl.store(part + key_rows, dlam_rows, mask=key_rows < kv_len)
    if ONE_PASS_DQ:  # the last reduces have read the staging tiles (view 2's take dV2 next; then the program ends)
        tma.store_wait(0)
        gl.thread_barrier()

    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    if VIEW == 2:
        _store_key_rows(DK, kv_base, keys, stride_kvn, dk, kv_len, kv_layout, HEAD_DIM)
        dv2_smem.store(dv)
        gl.thread_barrier()  # every warp's part of dV2 is in shared memory before the one arrival
        mbarrier.arrive(dv2_bar)
    else:
        _store_key_rows(DK, kv_base, keys, stride_kvn, dk * power, kv_len, kv_layout, HEAD_DIM)
        mbarrier.wait(dv2_bar, 0)
        dv = dv - dv2_smem.load(kv_layout)
        _store_key_rows(DV, kv_base, keys, stride_kvn, dv, kv_len, kv_layout, HEAD_DIM)


@gluon.jit
def _exchange_first_block(j, m, dk, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty, dp_smem,
                          w_smem, xchg_full, xchg_empty, q_len, kv_len, first_col, tau_scale, power,
                          st_layout: gl.constexpr, a_layout: gl.constexpr, POWER_MODE: gl.constexpr,
                          CAUSAL: gl.constexpr, MASKED: gl.constexpr, KEYS: gl.constexpr, BLOCK_M: gl.constexpr,
                          STAGES: gl.constexpr, XCHG_SLOTS: gl.constexpr):
    """View 1 of the exchange form on the query block from row m (ring tile j): S1^T and dP^T issued back
    to back, W1^T and G1^T once S1^T is in, dS1^T = dP^T G1^T and dK += dS1^T Q once dP^T is in; while dK
    runs, dP^T and W1^T go to exchange slot j % XCHG_SLOTS (once view 2 read its previous block) for view 2."""
    start = _query_starts(m, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)
    s_t, q_tile = _issue_with_columns(j, k_tile, q_ring, q_ready, start, st_layout, KEYS, BLOCK_M, STAGES)
    dp_t, do_tile = issue_qk(j, v_tile, do_ring, do_ready, st_layout, KEYS, BLOCK_M, STAGES)
    s_t, k_tile, q_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, k_tile, q_tile))  # S1^T retired
    visible = 0
    if MASKED:
        visible = _visible_columns(m, first_col, st_layout, BLOCK_M)
    w_t, g_t = _weight_and_grad(s_t, visible, power, THRESHOLD, POWER_MODE, 0, MASKED)
    dp_t, v_tile, do_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, v_tile, do_tile))  # dP^T retired
    release(j, do_empty, STAGES)
    ds16 = gl.convert_layout(_score_grad(dp_t, g_t, THRESHOLD, POWER_MODE).to(q_ring.dtype), a_layout)
    dk = warpgroup_mma(ds16, q_tile, dk, is_async=True)
    slot = j % XCHG_SLOTS
    # view 2 read block j - XCHG_SLOTS's tiles from this slot (the first round does not wait)
    mbarrier.wait(xchg_empty.index(slot), ((j // XCHG_SLOTS) & 1) ^ 1)
    dp_smem.index(slot).store(dp_t)
    w_smem.index(slot).store(w_t)
    gl.thread_barrier()  # every warp's part of both tiles is in shared memory before the one arrival
    mbarrier.arrive(xchg_full.index(slot))
    dk, ds16, q_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds16, q_tile))
    release(j, q_empty, STAGES)
    return dk


@gluon.jit
def _exchange_second_block(j, m, dk2, dv, k2_tile, q2_ring, do_ring, q_ready, do_ready, q_empty, do_empty, dp_smem,
                           w_smem, xchg_full, xchg_empty, q_len, kv_len, first_col, tau_scale, lam, power,
                           st_layout: gl.constexpr, a_layout: gl.constexpr, POWER_MODE: gl.constexpr,
                           CAUSAL: gl.constexpr, MASKED: gl.constexpr, KEYS: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr, XCHG_SLOTS: gl.constexpr):
    """View 2 of the exchange form on the query block from row m (ring tile j): S2^T, then W2^T and G2^T;
    view 1's W1^T from the exchange tile gives dV += (W1^T - lambda_h W2^T) dO, its dP^T gives
    dS2^T = -lambda_h p dP^T G2^T and dK2 += dS2^T Q2; the exchange tiles are handed back once read."""
    start = _query_starts(m, q_len, kv_len, -1.0, tau_scale, THRESHOLD, False, CAUSAL, BLOCK_M)
    s_t, q2_tile = _issue_with_columns(j, k2_tile, q2_ring, q_ready, start, st_layout, KEYS, BLOCK_M, STAGES)
    s_t, k2_tile, q2_tile = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, k2_tile, q2_tile))  # S2^T retired
    visible = 0
    if MASKED:
        visible = _visible_columns(m, first_col, st_layout, BLOCK_M)
    w_t, g_t = _weight_and_grad(s_t, visible, power, THRESHOLD, POWER_MODE, 0, MASKED)
    slot = j % XCHG_SLOTS
    mbarrier.wait(xchg_full.index(slot), (j // XCHG_SLOTS) & 1)
    w_t = w_smem.index(slot).load(st_layout) - lam * w_t
    w16 = gl.convert_layout(w_t.to(q2_ring.dtype), a_layout)
    s = j % STAGES
    do_tile = do_ring.index(s)
    mbarrier.wait(do_ready.index(s), (j // STAGES) & 1)
    dv = warpgroup_mma(w16, do_tile, dv, is_async=True)
    ds_t = _score_grad(dp_smem.index(slot).load(st_layout), g_t, THRESHOLD, POWER_MODE) * (-lam * power)
    gl.thread_barrier()  # every warp read both tiles before the one arrival
    mbarrier.arrive(xchg_empty.index(slot))
    ds16 = gl.convert_layout(ds_t.to(q2_ring.dtype), a_layout)
    dk2 = warpgroup_mma(ds16, q2_tile, dk2, is_async=True)
    dv, w16, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dv, w16, do_tile))
    release(j, do_empty, STAGES)
    dk2, ds16, q2_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk2, ds16, q2_tile))
    release(j, q_empty, STAGES)
    return dk2, dv


@gluon.jit
def _exchange_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, dp_smem, w_smem,
                       xchg_full, xchg_empty, DK, DV, LAM, stride_lam, kv_base, stride_kvn, hk, key0, GROUP, q_len,
                       kv_len, i_lo, i_full, i_hi, tau_scale, power, VIEW: gl.constexpr, POWER_MODE: gl.constexpr,
                       CAUSAL: gl.constexpr, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                       STAGES: gl.constexpr, XCHG_SLOTS: gl.constexpr, NUM_WARPS_C: gl.constexpr):
    """The exchange form (`VIEW_EXCHANGE`): one warpgroup per score view on the program's KEYS keys for
    every query block of every query head of the group, three products each per block. View 1
    (`_exchange_first_block`, k_tile K, q_ring Q): dP^T once, dK; it stores dk times p. View 2
    (`_exchange_second_block`, k_tile K2, q_ring Q2): dV of both views' weights, dK2 with its factor
    -lambda_h p; it stores dk2 and dv. `DK` is the view's gradient of its keys (dk or dk2)."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    first_col = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout)) - (kv_len - q_len)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    count = i_hi - i_lo

    mbarrier.wait(kv_bar, 0)
    for gi in range(GROUP):  # the row thresholds do not depend on the head: only the ring tiles move on
        j0 = gi * count - i_lo  # ring tile of query block i: j0 + i, also the exchange's block count
        if VIEW == 1:
            if CAUSAL:
                for i in range(i_lo, i_full):
                    dk = _exchange_first_block(j0 + i, i * BLOCK_M, dk, k_tile, v_tile, q_ring, do_ring, q_ready,
                                               do_ready, q_empty, do_empty, dp_smem, w_smem, xchg_full, xchg_empty,
                                               q_len, kv_len, first_col, tau_scale, power, st_layout, a_layout,
                                               POWER_MODE, CAUSAL, True, KEYS, BLOCK_M, STAGES, XCHG_SLOTS)
            for i in range(i_full, i_hi):
                dk = _exchange_first_block(j0 + i, i * BLOCK_M, dk, k_tile, v_tile, q_ring, do_ring, q_ready,
                                           do_ready, q_empty, do_empty, dp_smem, w_smem, xchg_full, xchg_empty,
                                           q_len, kv_len, first_col, tau_scale, power, st_layout, a_layout,
                                           POWER_MODE, CAUSAL, False, KEYS, BLOCK_M, STAGES, XCHG_SLOTS)
        else:
            lam = gl.load(LAM + (hk * GROUP + gi).to(gl.int64) * stride_lam).to(gl.float32)
            if CAUSAL:
                for i in range(i_lo, i_full):
                    dk, dv = _exchange_second_block(j0 + i, i * BLOCK_M, dk, dv, k_tile, q_ring, do_ring, q_ready,
                                                    do_ready, q_empty, do_empty, dp_smem, w_smem, xchg_full,
                                                    xchg_empty, q_len, kv_len, first_col, tau_scale, lam, power,
                                                    st_layout, a_layout, POWER_MODE, CAUSAL, True, KEYS, BLOCK_M,
                                                    STAGES, XCHG_SLOTS)
            for i in range(i_full, i_hi):
                dk, dv = _exchange_second_block(j0 + i, i * BLOCK_M, dk, dv, k_tile, q_ring, do_ring, q_ready,
                                                do_ready, q_empty, do_empty, dp_smem, w_smem, xchg_full, xchg_empty,
                                                q_len, kv_len, first_col, tau_scale, lam, power, st_layout, a_layout,
                                                POWER_MODE, CAUSAL, False, KEYS, BLOCK_M, STAGES, XCHG_SLOTS)

    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    if VIEW == 1:
        _store_key_rows(DK, kv_base, keys, stride_kvn, dk * power, kv_len, kv_layout, HEAD_DIM)
    else:
        _store_key_rows(DK, kv_base, keys, stride_kvn, dk, kv_len, kv_layout, HEAD_DIM)
        _store_key_rows(DV, kv_base, keys, stride_kvn, dv, kv_len, kv_layout, HEAD_DIM)


@gluon.jit
def _load_key_tiles(k_desc, k2_desc, v_desc, k_halves, k2_halves, v_halves, kv_bar, k_row, kv_col,
                    HALF_N: gl.constexpr, KV_TILES: gl.constexpr):
    """The program's (or work item's) K, K2 and V from row k_row: KV_TILES HALF_N-row tiles each, on kv_bar."""
    mbarrier.expect(kv_bar, 3 * KV_TILES * k_desc.block_type.nbytes)
    for half in gl.static_range(KV_TILES):
        tma.async_copy_global_to_shared(k_desc, [k_row + half * HALF_N, kv_col], kv_bar, k_halves.index(half))
        tma.async_copy_global_to_shared(k2_desc, [k_row + half * HALF_N, kv_col], kv_bar, k2_halves.index(half))
        tma.async_copy_global_to_shared(v_desc, [k_row + half * HALF_N, kv_col], kv_bar, v_halves.index(half))


@gluon.jit
def _two_view_producer(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_halves, k2_halves, v_halves, q_ring,
                       q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, k_row, kv_col, q_row, hk,
                       GROUP, i_lo, i_hi, HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr, KV_TILES: gl.constexpr = 2):
    """One warp: the program's K, K2 and V (KV_TILES HALF_N-row tiles each: two halves, or the view
    warpgroups' one) once, then Q and Q2 (one ready barrier) and dO of query blocks i_lo .. i_hi - 1 of
    each query head of kv head hk's group, in that order (`gluon_diff_fwd._stream_keys`'s ring: two tiles on
    one ready barrier, a third on another)."""
    _load_key_tiles(k_desc, k2_desc, v_desc, k_halves, k2_halves, v_halves, kv_bar, k_row, kv_col, HALF_N, KV_TILES)
    count = i_hi - i_lo
    for gi in range(GROUP):
        _stream_keys(q_desc, q2_desc, do_desc, q_ring, q2_ring, do_ring, q_ready, do_ready, q_empty,
                     do_empty, q_row + i_lo * BLOCK_M, (hk * GROUP + gi) * HEAD_DIM, gi * count, count,
                     BLOCK_M, STAGES)


@gluon.jit
def _persistent_two_view_producer(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_halves, k2_halves, v_halves,
                                  q_ring, q2_ring, do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty,
                                  H_KV, GROUP, BHK, n_items, q_len, kv_len, HALF_N: gl.constexpr,
                                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                                  CAUSAL: gl.constexpr):
    """One warp of the persistent key-block kernel (forms 0 and 1; `gluon_softmax_bwd.persistent_dkdv_producer`'s
    order with both views): per work item (`key_block_item`) its first Q, Q2 and dO tiles, then its K, K2 and V
    once both consumers are done with the last item's (kv_empty), then the rest of its query blocks."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0, i_lo, i_full, i_hi = key_block_item(t, H_KV, BHK, q_len, kv_len, CAUSAL, BLOCK_M, 2 * HALF_N)
        count = i_hi - i_lo
        q_row = b * q_len + i_lo * BLOCK_M
        first = gl.minimum(count, 1)
        _stream_keys(q_desc, q2_desc, do_desc, q_ring, q2_ring, do_ring, q_ready, do_ready, q_empty,
                     do_empty, q_row, hk * GROUP * HEAD_DIM, ring, first, BLOCK_M, STAGES)
        mbarrier.wait(kv_empty, (it & 1) ^ 1)
        _load_key_tiles(k_desc, k2_desc, v_desc, k_halves, k2_halves, v_halves, kv_bar, b * kv_len + n0,
                        hk * HEAD_DIM, HALF_N, 2)
        _stream_keys(q_desc, q2_desc, do_desc, q_ring, q2_ring, do_ring, q_ready, do_ready, q_empty,
                     do_empty, q_row + first * BLOCK_M, hk * GROUP * HEAD_DIM, ring + first,
                     count - first, BLOCK_M, STAGES)
        for gi in range(1, GROUP):
            _stream_keys(q_desc, q2_desc, do_desc, q_ring, q2_ring, do_ring, q_ready, do_ready, q_empty,
                         do_empty, q_row, (hk * GROUP + gi) * HEAD_DIM, ring + gi * count, count,
                         BLOCK_M, STAGES)
        ring += GROUP * count
        it += 1


@gluon.jit
def _dkdv_kernel(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, DK, DV, DK2, LAM,
                 stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, q_len, kv_len, tau_scale, power,
                 VIEWS: gl.constexpr, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, XCHG_SLOTS: gl.constexpr = 1):
    """Program (key block, batch x kv head): keys [n0, n0 + BLOCK_N), two consumer warpgroups of
    BLOCK_N / 2 keys each (the default partition and a 4-warp worker) and a 1-warp TMA producer. dk, dv,
    dk2 share one (B, KV, H_kv, D) layout (strides stride_kv*). Form 2 reads only k2_desc, v_desc, q2_desc
    and do_desc."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_N: gl.constexpr = BLOCK_N // 2
    b, hk, n0, i_lo, i_full, i_hi = key_block_program(H_KV, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    kv_base = b.to(gl.int64) * stride_kvb + hk.to(gl.int64) * stride_kvh
    if VIEWS == 4:
        # as form 3, with fp32 exchange tiles of dP^T and W1^T (view 1 to view 2) instead of dV2's tile
        k_tile, k2_tile, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = _allocate_ring(
            k_desc, q_desc, do_desc, BLOCK_N, BLOCK_M, HEAD_DIM, STAGES, 1)
        v_tile = gl.allocate_shared_memory(v_desc.dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
        # a warp's accumulator stores / loads (8 rows x 4 column pairs) hit 8 different 32-byte groups per row
        # under an 8-element XOR swizzle: conflict-free, where a 2-element one leaves them on 16 banks
        xchg_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        dp_smem = gl.allocate_shared_memory(gl.float32, [XCHG_SLOTS, BLOCK_N, BLOCK_M], xchg_layout)
        w_smem = gl.allocate_shared_memory(gl.float32, [XCHG_SLOTS, BLOCK_N, BLOCK_M], xchg_layout)
        xchg_full = gl.allocate_shared_memory(gl.int64, [XCHG_SLOTS, 1], mbarrier.MBarrierLayout())
        xchg_empty = gl.allocate_shared_memory(gl.int64, [XCHG_SLOTS, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(XCHG_SLOTS):
            mbarrier.init(xchg_full.index(slot), count=1)
            mbarrier.init(xchg_empty.index(slot), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_exchange_consumer, (k_tile.index(0), v_tile.index(0), q_ring, do_ring, kv_bar, q_ready, do_ready,
                                  q_empty, do_empty, dp_smem, w_smem, xchg_full, xchg_empty, DK, DV, LAM, stride_lam,
                                  kv_base, stride_kvn, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale,
                                  power, 1, POWER_MODE, CAUSAL, BLOCK_N, BLOCK_M, HEAD_DIM, STAGES, XCHG_SLOTS,
                                  NUM_WARPS_C)),
            (_exchange_consumer, (k2_tile.index(0), v_tile.index(0), q2_ring, do_ring, kv_bar, q_ready, do_ready,
                                  q_empty, do_empty, dp_smem, w_smem, xchg_full, xchg_empty, DK2, DV, LAM,
                                  stride_lam, kv_base, stride_kvn, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi,
                                  tau_scale, power, 2, POWER_MODE, CAUSAL, BLOCK_N, BLOCK_M, HEAD_DIM, STAGES,
                                  XCHG_SLOTS, NUM_WARPS_C)),
            (_two_view_producer, (k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_tile, k2_tile, v_tile, q_ring,
                                  q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, b * kv_len + n0,
                                  hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo, i_hi, BLOCK_N, HEAD_DIM, BLOCK_M, STAGES,
                                  1)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
        for slot in gl.static_range(XCHG_SLOTS):
            mbarrier.invalidate(xchg_full.index(slot))
            mbarrier.invalidate(xchg_empty.index(slot))
    elif VIEWS == 3:
        # BLOCK_N keys for both warpgroups: K, K2, V once; Q and Q2 (one ready barrier, each view's warpgroup
        # releases its own) and dO streamed; an fp32 tile for view 2's dV2
        k_tile, k2_tile, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = _allocate_ring(
            k_desc, q_desc, do_desc, BLOCK_N, BLOCK_M, HEAD_DIM, STAGES, 1)
        v_tile = gl.allocate_shared_memory(v_desc.dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
        dv2_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEAD_DIM],
                                             gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]))
        dv2_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(dv2_bar, count=1)
        fence_async_shared()
        _view_warpgroups(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_tile, k2_tile, v_tile, q_ring, q2_ring,
                         do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, dv2_smem, dv2_bar, DK, DV, DK2, LAM,
                         stride_lam, kv_base, stride_kvn, b, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi,
                         tau_scale, power, 0, 0, POWER_MODE, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS_C)
    elif VIEWS == 2:
        k2_halves, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = allocate_ring(
            k2_desc, q2_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
        v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
        gl.warp_specialize([
            (_dkdv_consumer, (k2_halves.index(0), k2_halves.index(0), v_halves.index(0), q2_ring, q2_ring, do_ring,
                              kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2, LAM, stride_lam,
                              kv_base, stride_kvn, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale,
                              power, 0, 0, kv_bar, VIEWS, POWER_MODE, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES,
                              NUM_WARPS_C)),
            (_dkdv_consumer, (k2_halves.index(1), k2_halves.index(1), v_halves.index(1), q2_ring, q2_ring, do_ring,
                              kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2, LAM, stride_lam,
                              kv_base, stride_kvn, hk, n0 + HALF_N, GROUP, q_len, kv_len, i_lo, i_full, i_hi,
                              tau_scale, power, 0, 0, kv_bar, VIEWS, POWER_MODE, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM,
                              STAGES, NUM_WARPS_C)),
            (_dkdv_producer, (k2_desc, v_desc, q2_desc, do_desc, k2_halves, v_halves, q2_ring, do_ring, kv_bar,
                              q_ready, do_ready, q_empty, do_empty, b * kv_len + n0, hk * HEAD_DIM, b * q_len, hk,
                              GROUP, i_lo, i_hi, HALF_N, HEAD_DIM, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    else:
        # gluon_diff_fwd's ring: two stationary tiles (here K and K2 halves), Q and Q2 in one slot, dO
        k_halves, k2_halves, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = _allocate_ring(
            k_desc, q_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
        v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
        gl.warp_specialize([
            (_dkdv_consumer, (k_halves.index(0), k2_halves.index(0), v_halves.index(0), q_ring, q2_ring, do_ring,
                              kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2, LAM, stride_lam,
                              kv_base, stride_kvn, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale,
                              power, 0, 0, kv_bar, VIEWS, POWER_MODE, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES,
                              NUM_WARPS_C)),
            (_dkdv_consumer, (k_halves.index(1), k2_halves.index(1), v_halves.index(1), q_ring, q2_ring, do_ring,
                              kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2, LAM, stride_lam,
                              kv_base, stride_kvn, hk, n0 + HALF_N, GROUP, q_len, kv_len, i_lo, i_full, i_hi,
                              tau_scale, power, 0, 0, kv_bar, VIEWS, POWER_MODE, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM,
                              STAGES, NUM_WARPS_C)),
            (_two_view_producer, (k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_halves, k2_halves, v_halves,
                                  q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty,
                                  b * kv_len + n0, hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo, i_hi, HALF_N, HEAD_DIM,
                                  BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)


@gluon.jit
def _dkdv_views_dq_kernel(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, dq_desc, dq2_desc, DK, DV, DK2, LAM,
                          DLAM_PART, stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, q_len, kv_len,
                          tau_scale, power, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          DQ_COLS: gl.constexpr):
    """The one-pass form of the view warpgroups (`launch_diff_threshold_backward(..., one_pass=True)`): form 3's
    program (BLOCK_N keys, a warpgroup per view, the two-view producer), whose warpgroups also add each tile's
    dQ of their view into the fp32 dq (view 1, behind dq_desc: dS1 K without the factor p) or dq2 (view 2, behind
    dq2_desc: dS2 K2 with its factor -lambda_h p) by TMA reduce-adds, DQ_COLS columns at a time, and view 2 writes
    the d-lambda terms per (batch, head, key) to DLAM_PART; no query-block kernel runs. p = 1 or 2 (the d-lambda
    terms as dS g). Shared memory at D = 128: K, K2, V 48 KiB, STAGES = 2 slots of Q, Q2, dO (96 KiB), each
    view's dS^T 8 KiB and two fp32 staging tiles of 16 KiB (view 2's also the dV2 hand-off after its loop).
    Without the causal mask, every query block of a program whose keys run past kv_len runs masked (those keys
    reach no dq and no d-lambda)."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    gl.static_assert(POWER_MODE != 0, "the one-pass form's d-lambda terms need p = 1 or 2")
    b, hk, n0, i_lo, i_full, i_hi = one_pass_key_block_program(H_KV, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    kv_base = b.to(gl.int64) * stride_kvb + hk.to(gl.int64) * stride_kvh
    k_tile, k2_tile, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = _allocate_ring(
        k_desc, q_desc, do_desc, BLOCK_N, BLOCK_M, HEAD_DIM, STAGES, 1)
    v_tile = gl.allocate_shared_memory(v_desc.dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], k_desc.dtype)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    # each view's two fp32 staging tiles; view 2's hold the dV2 hand-off once its last reduce has read them
    staging_1 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], dq_desc.layout)
    staging_2 = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], dq_desc.layout)
    gl.static_assert(BLOCK_N * HEAD_DIM <= 2 * BLOCK_M * DQ_COLS, "dV2 fits view 2's staging tiles")
    dv2_smem = staging_2._reinterpret(gl.float32, [BLOCK_N, HEAD_DIM],
                                      gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]))
    dv2_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(dv2_bar, count=1)
    fence_async_shared()
    heads = H_KV * GROUP
    ds_1 = ds_smem.index(0)
    ds_2 = ds_smem.index(1)
    _view_warpgroups(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_tile, k2_tile, v_tile, q_ring, q2_ring,
                     do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, dv2_smem, dv2_bar, DK, DV, DK2, LAM,
                     stride_lam, kv_base, stride_kvn, b, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale,
                     power, (ds_1, ds_1.permute((1, 0)), staging_1, dq_desc, DLAM_PART, b, heads),
                     (ds_2, ds_2.permute((1, 0)), staging_2, dq2_desc, DLAM_PART, b, heads), POWER_MODE, CAUSAL,
                     HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, NUM_WARPS_C, True)


@gluon.jit
def _view_warpgroups(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_tile, k2_tile, v_tile, q_ring, q2_ring,
                     do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, dv2_smem, dv2_bar, DK, DV, DK2, LAM,
                     stride_lam, kv_base, stride_kvn, b, hk, n0, GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale,
                     power, one_pass_1, one_pass_2, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     NUM_WARPS_C: gl.constexpr, ONE_PASS_DQ: gl.constexpr = False):
    """Form 3's partitions on the allocated ring (K, K2, V tiles of BLOCK_N keys): a `_view_consumer` per view
    (one_pass_1 / one_pass_2 their dQ paths under ONE_PASS_DQ) and the two-view producer; then the ring's and
    dv2_bar's barriers invalidated."""
    gl.warp_specialize([
        (_view_consumer, (k_tile.index(0), v_tile.index(0), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, dv2_smem, dv2_bar, DK, DV, LAM, stride_lam, kv_base, stride_kvn, hk, n0, GROUP,
                          q_len, kv_len, i_lo, i_full, i_hi, tau_scale, power, 1, POWER_MODE, CAUSAL, BLOCK_N,
                          BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, one_pass_1, ONE_PASS_DQ)),
        (_view_consumer, (k2_tile.index(0), v_tile.index(0), q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, dv2_smem, dv2_bar, DK2, DV, LAM, stride_lam, kv_base, stride_kvn, hk, n0,
                          GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale, power, 2, POWER_MODE, CAUSAL,
                          BLOCK_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, one_pass_2, ONE_PASS_DQ)),
        (_two_view_producer, (k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_tile, k2_tile, v_tile, q_ring,
                              q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, b * kv_len + n0,
                              hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo, i_hi, BLOCK_N, HEAD_DIM, BLOCK_M, STAGES,
                              1)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    mbarrier.invalidate(dv2_bar)


@gluon.jit
def _persistent_dkdv_consumer(k_tile, k2_tile, v_tile, q_ring, q2_ring, do_ring, kv_bar, kv_empty, q_ready, do_ready,
                              q_empty, do_empty, DK, DV, DK2, LAM, stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV,
                              GROUP, BHK, n_items, q_len, kv_len, tau_scale, power, VIEWS: gl.constexpr,
                              POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HALF_N: gl.constexpr,
                              BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                              NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent key-block kernel (forms 0, 1, 2): `_dkdv_consumer` on its half
    of each work item of the program (`key_block_item`'s order, as the producer), the ring's tile count and
    the key tiles' phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0, i_lo, i_full, i_hi = key_block_item(t, H_KV, BHK, q_len, kv_len, CAUSAL, BLOCK_M, 2 * HALF_N)
        kv_base = b.to(gl.int64) * stride_kvb + hk.to(gl.int64) * stride_kvh
        _dkdv_consumer(k_tile, k2_tile, v_tile, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                       do_empty, DK, DV, DK2, LAM, stride_lam, kv_base, stride_kvn, hk, n0 + WARPGROUP * HALF_N,
                       GROUP, q_len, kv_len, i_lo, i_full, i_hi, tau_scale, power, ring, it & 1, kv_empty, VIEWS,
                       POWER_MODE, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, True)
        ring += GROUP * (i_hi - i_lo)
        it += 1


@gluon.jit
def _persistent_dkdv_kernel(k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, DK, DV, DK2, LAM,
                            stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, q_len, kv_len, tau_scale,
                            power, BHK, VIEWS: gl.constexpr, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr):
    """The persistent form of `_dkdv_kernel`'s key-halves forms 0, 1 and 2 (a grid of at most one program per
    SM, each running work items (key block, batch x kv head) in `key_block_item`'s order): the same partitions
    and per-item work, the producer loading the next item's first query tiles while the consumers finish this
    item and store its gradients. The view forms (3, 4) run per item only."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    gl.static_assert(VIEWS <= 2, "the view forms have no persistent kernel")
    HALF_N: gl.constexpr = BLOCK_N // 2
    n_items = gl.cdiv(kv_len, BLOCK_N) * BHK
    kv_empty = allocate_item_empty()
    if VIEWS == 2:
        k2_halves, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = allocate_ring(
            k2_desc, q2_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
        v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
        gl.warp_specialize([
            (_persistent_dkdv_consumer, (k2_halves.index(0), k2_halves.index(0), v_halves.index(0), q2_ring, q2_ring,
                                         do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2,
                                         LAM, stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, BHK,
                                         n_items, q_len, kv_len, tau_scale, power, VIEWS, POWER_MODE, CAUSAL, HALF_N,
                                         BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
            (_persistent_dkdv_consumer, (k2_halves.index(1), k2_halves.index(1), v_halves.index(1), q2_ring, q2_ring,
                                         do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2,
                                         LAM, stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, BHK,
                                         n_items, q_len, kv_len, tau_scale, power, VIEWS, POWER_MODE, CAUSAL, HALF_N,
                                         BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
            (persistent_dkdv_producer, (k2_desc, v_desc, q2_desc, do_desc, k2_halves, v_halves, q2_ring, do_ring,
                                        kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty, H_KV, GROUP, BHK,
                                        n_items, q_len, kv_len, HALF_N, HEAD_DIM, BLOCK_M, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    else:
        k_halves, k2_halves, q_ring, q2_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = _allocate_ring(
            k_desc, q_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
        v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
        gl.warp_specialize([
            (_persistent_dkdv_consumer, (k_halves.index(0), k2_halves.index(0), v_halves.index(0), q_ring, q2_ring,
                                         do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2,
                                         LAM, stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, BHK,
                                         n_items, q_len, kv_len, tau_scale, power, VIEWS, POWER_MODE, CAUSAL, HALF_N,
                                         BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
            (_persistent_dkdv_consumer, (k_halves.index(1), k2_halves.index(1), v_halves.index(1), q_ring, q2_ring,
                                         do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty, DK, DV, DK2,
                                         LAM, stride_kvb, stride_kvn, stride_kvh, stride_lam, H_KV, GROUP, BHK,
                                         n_items, q_len, kv_len, tau_scale, power, VIEWS, POWER_MODE, CAUSAL, HALF_N,
                                         BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
            (_persistent_two_view_producer, (k_desc, k2_desc, v_desc, q_desc, q2_desc, do_desc, k_halves, k2_halves,
                                             v_halves, q_ring, q2_ring, do_ring, kv_bar, kv_empty, q_ready, do_ready,
                                             q_empty, do_empty, H_KV, GROUP, BHK, n_items, q_len, kv_len, HALF_N,
                                             HEAD_DIM, BLOCK_M, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    mbarrier.invalidate(kv_empty)


# ------------------------------------------------------------------------- dQ, dQ2 (query blocks)


@gluon.jit
def _dq_rows(m0, q_len, kv_len, tau_scale, s_layout: gl.constexpr, ROWS: gl.constexpr, CAUSAL: gl.constexpr):
    """A query-block consumer's rows [m0, m0 + ROWS) in the score layout, their thresholds tau and, causal, the
    last key each sees (min(row position, kv_len - 1); negative: none)."""
    rows = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    tau = _row_value(rows, kv_len, q_len, tau_scale, THRESHOLD, False, CAUSAL)
    return rows, tau, gl.minimum(rows + (kv_len - q_len), kv_len - 1)


@gluon.jit
def _dq_block(j, ring, dq, dq2, dlam_rows, q_tile, q2_tile, do_tile, k_ring, k2_ring, v_ring, k_ready, v_ready,
              k_empty, v_empty, tau, last_key, kv_len, power, s_layout: gl.constexpr, a_layout: gl.constexpr,
              POWER_MODE: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, HALF_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block j (ring tile ring + j) for one warpgroup's rows: S1 = Q K^T, S2 = Q2 K2^T and dP = dO V^T
    back to back, G1, G2 and W2 once the scores are in, V's slot back once dP retired, the rows' d-lambda sums
    of dP W2, dQ += (dP G1) K and dQ2 += (dP G2) K2, the K / K2 slot back once those retired."""
    tile = ring + j
    s = tile % STAGES
    k_tile = k_ring.index(s)
    k2_tile = k2_ring.index(s)
    mbarrier.wait(k_ready.index(s), (tile // STAGES) & 1)
    zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    s1 = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    s2 = warpgroup_mma(q2_tile, k2_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp, v_tile = issue_qk(tile, do_tile, v_ring, v_ready, s_layout, HALF_M, BLOCK_N, STAGES)
    s1, s2, q_tile, q2_tile, k_tile, k2_tile = warpgroup_mma_wait(
        num_outstanding=1, deps=(s1, s2, q_tile, q2_tile, k_tile, k2_tile))  # S1, S2 retired
    t = gl.expand_dims(tau, 1)
    x1 = s1 - t
    x2 = s2 - t
    if MASKED:  # relu(-inf) = 0 for both views
        visible = visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N)
        x1 = gl.where(visible, x1, -float("inf"))
        x2 = gl.where(visible, x2, -float("inf"))
    _, g1 = _weight_and_grad(x1, 0, power, THRESHOLD, POWER_MODE, 0, False)
    w2, g2 = _weight_and_grad(x2, 0, power, THRESHOLD, POWER_MODE, 0, False)
    dp, do_tile, v_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp, do_tile, v_tile))  # dP retired
    release(tile, v_empty, STAGES)
    dlam_rows = dlam_rows + gl.sum(dp * w2, axis=1)
    ds1_16 = gl.convert_layout(_score_grad(dp, g1, THRESHOLD, POWER_MODE).to(k_ring.dtype), a_layout)
    dq = warpgroup_mma(ds1_16, k_tile, dq, is_async=True)
    ds2_16 = gl.convert_layout(_score_grad(dp, g2, THRESHOLD, POWER_MODE).to(k_ring.dtype), a_layout)
    dq2 = warpgroup_mma(ds2_16, k2_tile, dq2, is_async=True)
    dq, dq2, k_tile, k2_tile, ds1_16, ds2_16 = warpgroup_mma_wait(
        num_outstanding=0, deps=(dq, dq2, k_tile, k2_tile, ds1_16, ds2_16))
    release(tile, k_empty, STAGES)
    return dq, dq2, dlam_rows


@gluon.jit
def _dq_consumer(q_tile, q2_tile, do_tile, k_ring, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, DQ,
                 DQ2, dq_base, stride_dqn, LAM, lam_offset, DLAM_PART, dlam_base, m0, q_len, kv_len, n_full, n_tiles,
                 tau_scale, power, ring, q_phase, q_empty, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                 HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 NUM_WARPS_C: gl.constexpr, PERSISTENT: gl.constexpr = False):
    """One warpgroup: rows [m0, m0 + HALF_M) against the program's key blocks ([0, n_full) unmasked,
    [n_full, n_tiles) masked; key block j is ring tile ring + j, the query tiles' phase q_phase); stores its
    rows of dq (times p), dq2 (times -lam p) and their d-lambda sums. PERSISTENT: one of a persistent
    program's work items, which arrives on q_empty once its last product retired (the producer then loads
    the next item's Q, Q2 and dO)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows, tau, last_key = _dq_rows(m0, q_len, kv_len, tau_scale, s_layout, HALF_M, CAUSAL)
    dq = gl.zeros([HALF_M, HEAD_DIM], gl.float32, dq_layout)
    dq2 = gl.zeros([HALF_M, HEAD_DIM], gl.float32, dq_layout)
    dlam_rows = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bar, q_phase)
    for j in range(0, n_full):
        dq, dq2, dlam_rows = _dq_block(j, ring, dq, dq2, dlam_rows, q_tile, q2_tile, do_tile, k_ring, k2_ring, v_ring,
                                       k_ready, v_ready, k_empty, v_empty, tau, last_key, kv_len, power, s_layout,
                                       a_layout, POWER_MODE, False, CAUSAL, HALF_M, BLOCK_N, STAGES)
    for j in range(n_full, n_tiles):
        dq, dq2, dlam_rows = _dq_block(j, ring, dq, dq2, dlam_rows, q_tile, q2_tile, do_tile, k_ring, k2_ring, v_ring,
                                       k_ready, v_ready, k_empty, v_empty, tau, last_key, kv_len, power, s_layout,
                                       a_layout, POWER_MODE, True, CAUSAL, HALF_M, BLOCK_N, STAGES)
    if PERSISTENT:  # every product of the item has retired: Q, Q2 and dO are free
        gl.thread_barrier()
        mbarrier.arrive(q_empty)

    lam = gl.load(LAM + lam_offset).to(gl.float32)
    offs_m = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, dq_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    offs = dq_base + gl.expand_dims(offs_m.to(gl.int64) * stride_dqn, 1) + gl.expand_dims(offs_d, 0)
    in_rows = gl.expand_dims(offs_m < q_len, 1)
    gl.store(DQ + offs, (dq * power).to(DQ.dtype.element_ty), mask=in_rows)
    gl.store(DQ2 + offs, (dq2 * (-lam * power)).to(DQ2.dtype.element_ty), mask=in_rows)
    # this head's d-lambda sums over its keys, one per query row: DLAM_PART[b, h, row]
    gl.store(DLAM_PART + dlam_base + rows, dlam_rows, mask=rows < q_len)


@gluon.jit
def _dq_producer(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, do_smem, k_ring, k2_ring, v_ring,
                 q_bar, k_ready, v_ready, k_empty, v_empty, q_row, q_col, k_row, kv_col, n_tiles,
                 HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: both consumers' Q, Q2 and dO rows once (`gluon_diff_fwd._load_queries`), then per key block
    j < n_tiles K and K2 (one ready barrier) and V into ring slot j % STAGES, each once both consumers released
    the slot's previous use (`gluon_diff_fwd._stream_keys`)."""
    _load_queries(q_desc, q2_desc, q_smem, q2_smem, q_bar, q_row, q_col, HALF_M, do_desc, do_smem, True)
    _stream_keys(k_desc, k2_desc, v_desc, k_ring, k2_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row, kv_col,
                 0, n_tiles, BLOCK_N, STAGES)


@gluon.jit
def _dq_kernel(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, DQ, DQ2, LAM, DLAM_PART, stride_dqb, stride_dqn,
               stride_dqh, stride_lam, H, GROUP, q_len, kv_len, tau_scale, power,
               POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Program (query block, batch x head): rows [m0, m0 + BLOCK_M), two consumer warpgroups of
    BLOCK_M / 2 rows each and a 1-warp TMA producer; causal programs run the last query blocks first. dq
    and dq2 share one (B, N, H, D) layout (strides stride_dq*)."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    b, h, hk, bh, m0 = program_rows(q_len, H, GROUP, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    q_smem, q2_smem, k_ring, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty = _allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, HALF_M, HEAD_DIM], do_desc.layout)
    dq_base = b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
    lam_offset = h.to(gl.int64) * stride_lam
    dlam_base = bh.to(gl.int64) * q_len
    gl.warp_specialize([
        (_dq_consumer, (q_smem.index(0), q2_smem.index(0), do_smem.index(0), k_ring, k2_ring, v_ring, q_bar, k_ready,
                        v_ready, k_empty, v_empty, DQ, DQ2, dq_base, stride_dqn, LAM, lam_offset, DLAM_PART, dlam_base,
                        m0, q_len, kv_len, n_full, n_tiles, tau_scale, power, 0, 0, q_bar, POWER_MODE, CAUSAL, HALF_M,
                        BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_consumer, (q_smem.index(1), q2_smem.index(1), do_smem.index(1), k_ring, k2_ring, v_ring, q_bar, k_ready,
                        v_ready, k_empty, v_empty, DQ, DQ2, dq_base, stride_dqn, LAM, lam_offset, DLAM_PART, dlam_base,
                        m0 + HALF_M, q_len, kv_len, n_full, n_tiles, tau_scale, power, 0, 0, q_bar, POWER_MODE, CAUSAL,
                        HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_producer, (q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, do_smem, k_ring, k2_ring,
                        v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, b * q_len + m0, h * HEAD_DIM, b * kv_len,
                        hk * HEAD_DIM, n_tiles, HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


@gluon.jit
def _persistent_dq_consumer(q_tile, q2_tile, do_tile, k_ring, k2_ring, v_ring, q_bar, q_empty, k_ready, v_ready,
                            k_empty, v_empty, DQ, DQ2, LAM, DLAM_PART, stride_dqb, stride_dqn, stride_dqh, stride_lam,
                            H, GROUP, BH, n_items, q_len, kv_len, tau_scale, power, POWER_MODE: gl.constexpr,
                            CAUSAL: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                            STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent query-block kernel: `_dq_consumer` on its half of each work item
    of the program (`gluon_pipeline.work_item`'s order, as the producer), the ring's tile count and the query
    tiles' phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        _dq_consumer(q_tile, q2_tile, do_tile, k_ring, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty,
                     DQ, DQ2, b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh, stride_dqn, LAM,
                     h.to(gl.int64) * stride_lam, DLAM_PART, bh.to(gl.int64) * q_len, m0 + WARPGROUP * HALF_M, q_len,
                     kv_len, n_full, n_tiles, tau_scale, power, ring, it & 1, q_empty, POWER_MODE, CAUSAL, HALF_M,
                     BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, True)
        ring += n_tiles
        it += 1


@gluon.jit
def _persistent_dq_kernel(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, DQ, DQ2, LAM, DLAM_PART, stride_dqb,
                          stride_dqn, stride_dqh, stride_lam, H, GROUP, q_len, kv_len, tau_scale, power, BH,
                          POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The persistent form of `_dq_kernel` (a grid of at most one program per SM, each running work items
    (query block, batch x head) in `gluon_pipeline.work_item`'s order): the same partitions and per-item work,
    the producer loading the next item's tiles while the consumers finish this one and store its rows."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_items = gl.cdiv(q_len, BLOCK_M) * BH
    q_smem, q2_smem, k_ring, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty = _allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, HALF_M, HEAD_DIM], do_desc.layout)
    q_empty = allocate_item_empty()
    gl.warp_specialize([
        (_persistent_dq_consumer, (q_smem.index(0), q2_smem.index(0), do_smem.index(0), k_ring, k2_ring, v_ring,
                                   q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, DQ, DQ2, LAM, DLAM_PART,
                                   stride_dqb, stride_dqn, stride_dqh, stride_lam, H, GROUP, BH, n_items, q_len,
                                   kv_len, tau_scale, power, POWER_MODE, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                                   NUM_WARPS_C, 0)),
        (_persistent_dq_consumer, (q_smem.index(1), q2_smem.index(1), do_smem.index(1), k_ring, k2_ring, v_ring,
                                   q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, DQ, DQ2, LAM, DLAM_PART,
                                   stride_dqb, stride_dqn, stride_dqh, stride_lam, H, GROUP, BH, n_items, q_len,
                                   kv_len, tau_scale, power, POWER_MODE, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                                   NUM_WARPS_C, 1)),
        (_persistent_producer, (q_desc, q2_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, k_ring, k2_ring, v_ring,
                                q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, q_len, kv_len, H, GROUP, BH,
                                n_items, HEAD_DIM, HALF_M, BLOCK_N, STAGES, CAUSAL, do_desc, do_smem, True)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)
    mbarrier.invalidate(q_empty)


# --------------------------------------------------------- dQ, dQ2 (query blocks, a warpgroup per view)


@gluon.jit
def _dq_second_view_block(j, dq2, dlam_acc, q2_tile, do_tile, k2_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
                          tau, last_key, kv_len, power, s_layout: gl.constexpr, a_layout: gl.constexpr,
                          POWER_MODE: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                          ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block j for the second view's warpgroup: S2 = Q2 K2^T and dP = dO V^T back to back, W2 and G2 once
    S2 is in, V's slot back once dP retired, dlam_acc += dP W2 per score (summed over keys once, after the last
    block), dQ2 += (dP G2) K2, the K / K2 slot back once that retired (the one-map `gluon_weighted_bwd._dq_block`
    with the d-lambda terms)."""
    s2, k2_tile = issue_qk(j, q2_tile, k2_ring, k_ready, s_layout, ROWS, BLOCK_N, STAGES)
    dp, v_tile = issue_qk(j, do_tile, v_ring, v_ready, s_layout, ROWS, BLOCK_N, STAGES)
    s2, q2_tile, k2_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s2, q2_tile, k2_tile))  # S2 retired
    x2 = s2 - gl.expand_dims(tau, 1)
    visible = 0
    if MASKED:
        visible = visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N)
    w2, g2 = _weight_and_grad(x2, visible, power, THRESHOLD, POWER_MODE, 0, MASKED)
    dp, do_tile, v_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp, do_tile, v_tile))  # dP retired
    release(j, v_empty, STAGES)
    dlam_acc = dlam_acc + dp * w2
    ds16 = gl.convert_layout(_score_grad(dp, g2, THRESHOLD, POWER_MODE).to(k2_ring.dtype), a_layout)
    dq2 = warpgroup_mma(ds16, k2_tile, dq2, is_async=True)
    dq2, k2_tile, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq2, k2_tile, ds16))
    release(j, k_empty, STAGES)
    return dq2, dlam_acc


@gluon.jit
def _dq_second_view_consumer(q2_tile, do_tile, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, DQ2,
                             dq_base, stride_dqn, LAM, lam_offset, DLAM_PART, dlam_base, m0, q_len, kv_len, n_full,
                             n_tiles, tau_scale, power, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr):
    """The second view's warpgroup: rows [m0, m0 + ROWS) against the program's key blocks ([0, n_full)
    unmasked, [n_full, n_tiles) masked); stores dq2 (times -lam p) and the rows' d-lambda sums."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows, tau, last_key = _dq_rows(m0, q_len, kv_len, tau_scale, s_layout, ROWS, CAUSAL)
    dq2 = gl.zeros([ROWS, HEAD_DIM], gl.float32, dq_layout)
    dlam_acc = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)  # per-score d-lambda terms, summed after the loops

    mbarrier.wait(q_bar, 0)
    for j in range(0, n_full):
        dq2, dlam_acc = _dq_second_view_block(j, dq2, dlam_acc, q2_tile, do_tile, k2_ring, v_ring, k_ready, v_ready,
                                               k_empty, v_empty, tau, last_key, kv_len, power, s_layout, a_layout,
                                               POWER_MODE, False, CAUSAL, ROWS, BLOCK_N, STAGES)
    for j in range(n_full, n_tiles):
        dq2, dlam_acc = _dq_second_view_block(j, dq2, dlam_acc, q2_tile, do_tile, k2_ring, v_ring, k_ready, v_ready,
                                               k_empty, v_empty, tau, last_key, kv_len, power, s_layout, a_layout,
                                               POWER_MODE, True, CAUSAL, ROWS, BLOCK_N, STAGES)

    dlam_rows = gl.sum(dlam_acc, axis=1)
    lam = gl.load(LAM + lam_offset).to(gl.float32)
    offs_m = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    offs = dq_base + gl.expand_dims(offs_m.to(gl.int64) * stride_dqn, 1) + gl.expand_dims(offs_d, 0)
    gl.store(DQ2 + offs, (dq2 * (-lam * power)).to(DQ2.dtype.element_ty), mask=gl.expand_dims(offs_m < q_len, 1))
    # this head's d-lambda sums over its keys, one per query row: DLAM_PART[b, h, row]
    gl.store(DLAM_PART + dlam_base + rows, dlam_rows, mask=rows < q_len)


@gluon.jit
def _dq_views_producer(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, do_smem, k_ring, k2_ring,
                       v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, q_row, q_col, k_row, kv_col, n_tiles,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's Q, Q2 and dO rows once (one tile each, both warpgroups read dO), then per key
    block K and K2 (one ready barrier) and V into the ring (`gluon_diff_fwd._stream_keys`)."""
    mbarrier.expect(q_bar, 3 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    tma.async_copy_global_to_shared(q2_desc, [q_row, q_col], q_bar, q2_smem)
    tma.async_copy_global_to_shared(do_desc, [q_row, q_col], q_bar, do_smem)
    _stream_keys(k_desc, k2_desc, v_desc, k_ring, k2_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row, kv_col,
                 0, n_tiles, BLOCK_N, STAGES)


@gluon.jit
def _dq_views_kernel(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, DQ, DQ2, LAM, DLAM_PART, stride_dqb,
                     stride_dqn, stride_dqh, stride_lam, H, GROUP, q_len, kv_len, tau_scale, power,
                     POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The query-block kernel's view-warpgroup form (`dq_form="view_warpgroups"`): program (query block of
    BLOCK_M rows, batch x head), a warpgroup per score view on the same rows and a 1-warp TMA producer; the
    first view's warpgroup is the one-map threshold's dQ consumer (`gluon_weighted_bwd._dq_consumer`: S1, dP,
    dQ += (dP G1) K), the second view's `_dq_second_view_consumer` (S2, dP, dQ2, the d-lambda sums). Both
    compute dP: 6 products per block instead of 5, each warpgroup holding one D-wide accumulator, so the key
    blocks are 64 keys at D = 128 too. The ring's empty barriers count one arrival per warpgroup: the first
    view releases a K / K2 slot once dQ's product on K retired, the second once dQ2's on K2 did."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    b, h, hk, bh, m0 = program_rows(q_len, H, GROUP, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    q_smem, q2_smem, k_ring, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty = _allocate_ring(
        q_desc, k_desc, v_desc, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, 1)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    dq_base = b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
    gl.warp_specialize([
        (_weighted_dq_consumer, (q_smem.index(0), do_smem, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty,
                                 DQ, dq_base, stride_dqn, m0, q_len, kv_len, n_full, n_tiles, 1.0, tau_scale, power,
                                 power, 0, 0, q_bar, THRESHOLD, POWER_MODE, False, 0, CAUSAL, BLOCK_M, BLOCK_N,
                                 HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_second_view_consumer, (q2_smem.index(0), do_smem, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty,
                                    v_empty, DQ2, dq_base, stride_dqn, LAM, h.to(gl.int64) * stride_lam, DLAM_PART,
                                    bh.to(gl.int64) * q_len, m0, q_len, kv_len, n_full, n_tiles, tau_scale, power,
                                    POWER_MODE, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_views_producer, (q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_smem.index(0), q2_smem.index(0),
                              do_smem, k_ring, k2_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty,
                              b * q_len + m0, h * HEAD_DIM, b * kv_len, hk * HEAD_DIM, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


# ---------------------------------------------------------------------------------------------
# host side


@functools.cache
def _backward_plan(dtype, head_dim: int, causal: bool, power_constexpr: int, dkdv_form: str,
                   fused_query_rows: int | None, dq_form: str = "rows"):
    """What every launch of one backward form shares: per key-block launch of `dkdv_form` (DKDV_FORMS) its
    config, its key tile (`key_tile_rows`), its query-block tile and its constexprs; then the query-block
    kernel's (`dq_form`, DQ_FORMS) config, its 64-row tile, its key-block tile and its constexprs."""
    forms = []
    views = DKDV_FORMS[dkdv_form]
    for form in ((views,) if views is not None else dkdv_forms(head_dim)):
        cfg = dkdv_tile_config(head_dim, form, fused_query_rows)
        forms.append((cfg, tma_tile(dtype, key_tile_rows(form, cfg), head_dim),
                      tma_tile(dtype, cfg["BLOCK_M"], head_dim),
                      dict(VIEWS=form, POWER_MODE=power_constexpr, CAUSAL=causal, HEAD_DIM=head_dim, **cfg)))
    q_cfg = dq_tile_config(head_dim, dq_form)
    dq_constexprs = dict(POWER_MODE=power_constexpr, CAUSAL=causal, HEAD_DIM=head_dim, **q_cfg)
    return (tuple(forms), q_cfg, tma_tile(dtype, 64, head_dim), tma_tile(dtype, q_cfg["BLOCK_N"], head_dim),
            dq_constexprs)


_DKDV = DirectLauncher(_dkdv_kernel, "gluon_diff_bwd_dkdv")
_DQ = DirectLauncher(_dq_kernel, "gluon_diff_bwd_dq")
_PERSISTENT_DKDV = DirectLauncher(_persistent_dkdv_kernel, "gluon_diff_bwd_dkdv_persistent")
_PERSISTENT_DQ = DirectLauncher(_persistent_dq_kernel, "gluon_diff_bwd_dq_persistent")
_DQ_VIEWS = DirectLauncher(_dq_views_kernel, "gluon_diff_bwd_dq_views")
_DKDV_VIEWS_DQ = DirectLauncher(_dkdv_views_dq_kernel, "gluon_diff_bwd_dkdv_views_dq")
_DQ_CAST = DirectLauncher(_dq_cast_kernel, "gluon_diff_bwd_dq_cast")
_CAST_CONSTEXPRS = dict(BLOCK=CAST_BLOCK)


@functools.cache
def _one_pass_plan(dtype, head_dim: int, causal: bool, power_constexpr: int):
    """What every one-pass launch shares: the config, the key tile, the query-block tile, the fp32 dq's reduce
    tile and the constexprs of `_dkdv_views_dq_kernel`."""
    cfg = one_pass_tile_config(head_dim)
    dq_tile = dq_accumulator_tile(head_dim)
    if dq_tile[0][0] != cfg["BLOCK_M"] or cfg["DQ_COLS"] % dq_tile[0][1]:
        raise AssertionError(f"the fp32 dq's reduce box {dq_tile[0]} does not tile {cfg}")
    return (cfg, tma_tile(dtype, cfg["BLOCK_N"], head_dim), tma_tile(dtype, cfg["BLOCK_M"], head_dim), dq_tile,
            dict(POWER_MODE=power_constexpr, CAUSAL=causal, HEAD_DIM=head_dim, **cfg))


def _launch_one_pass(q, k, v, q2, k2, lam, dout, causal: bool, tau_scale: float, power: float):
    """`launch_diff_threshold_backward(..., one_pass=True)`: dq and dq2 accumulated in fp32 by the view
    warpgroups' one-pass kernel (zeroed first; their sums in no fixed order), then cast (dq times p); d-lambda
    from the kernel's per-key terms by torch's fixed-order sum."""
    import torch

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    cfg, key_tile, rows_tile, dq_tile, constexprs = _one_pass_plan(q.dtype, d, causal, power_mode(power))
    dq_acc = torch.zeros((2, bsz, n, h, d), device=q.device, dtype=torch.float32)  # dq's, then dq2's
    # each as the 2-d (B N, H D) matrix of its reduce boxes (contiguous: 16-byte aligned bases and rows)
    dq_descs = tuple(descriptor((acc, (bsz * n, h * d), (h * d, 1)), dq_tile) for acc in dq_acc)
    dk = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k.dtype)
    dk2 = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k2.dtype)
    dv = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=v.dtype)
    dlam_part = torch.empty((bsz, h, kv_len), device=q.device, dtype=torch.float32)
    descriptors = (*(descriptor(tma_view(t), key_tile) for t in (k, k2, v)),
                   *(descriptor(tma_view(t), rows_tile) for t in (q, q2, dout)), *dq_descs)
    scalars = (kv_len * h_kv * d, h_kv * d, d, lam.stride(0),  # dk's, dv's and dk2's strides (contiguous), lam's
               h_kv, h // h_kv, n, kv_len, tau_scale, power)
    _DKDV_VIEWS_DQ.run((cdiv(kv_len, cfg["BLOCK_N"]), bsz * h_kv), descriptors, (dk, dv, dk2, lam, dlam_part),
                       scalars, constexprs, GLUON_OPTIONS)
    dq = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    dq2 = torch.empty((bsz, n, h, d), device=q.device, dtype=q2.dtype)
    numel = dq.numel()
    for acc, out, scale in ((dq_acc[0], dq, power), (dq_acc[1], dq2, 1.0)):  # dq2's terms carry -lambda_h p
        _DQ_CAST.run((cdiv(numel, CAST_BLOCK),), (), (acc, out), (numel, scale), _CAST_CONSTEXPRS, GLUON_OPTIONS)
    # fixed-order reduction of the per-(batch, head, key) terms: deterministic
    dlam = (-dlam_part.sum(dim=(0, 2))).to(lam.dtype)
    return dq, dk, dv, dq2, dk2, dlam


def launch_diff_threshold_backward(q, k, v, q2, k2, lam, dout, causal: bool, beta: float, power: float,
                                   dkdv_form: str = "key_halves", persistent: bool = False,
                                   fused_query_rows: int | None = None, dq_form: str = "rows",
                                   one_pass: bool = False):
    """(dq, dk, dv, dq2, dk2, dlam) of differential threshold attention without checks (for callers that
    checked the operands once): w = relu(q.k - tau_i)^power - lam_h relu(q2.k2 - tau_i)^power,
    tau_i = beta sqrt(2 ln n_i / D), as `gluon_diff_fwd.launch_diff_threshold`. Gradients of q, k, v, q2,
    k2 in their dtype, dlam (H,) in lam's dtype. Launches: the key-block kernel per form of
    `dkdv_forms(D)` ("key_halves"), or the one launch of the "view_warpgroups" or "view_exchange" form
    (`dkdv_form`, a key of DKDV_FORMS), the query-block kernel, and torch's fixed-order sum of the d-lambda
    partials. `persistent`: the query-block kernel and the key halves' launches on their persistent grids (a
    program per SM running work items in turn; the view forms run per item).
    `fused_query_rows`: the fused form's query rows per ring slot (default FUSED_QUERY_ROWS).
    `dq_form`: the query-block kernel's form (DQ_FORMS; "view_warpgroups" runs per item, `persistent` or not).
    `one_pass` (p = 1 or 2, with the "view_warpgroups" key-block form, per item): no query-block kernel; the view
    warpgroups add dQ and dQ2 into fp32 buffers as they go and write the d-lambda terms (`_dkdv_views_dq_kernel`),
    then a cast each (`_launch_one_pass`)."""
    import torch

    if one_pass:
        if dkdv_form != "view_warpgroups" or persistent or power_mode(power) == 0:
            raise ValueError("the one-pass form runs the view warpgroups per item at p = 1 or 2: dkdv_form must "
                             f"be 'view_warpgroups', persistent False, power 1 or 2, got {dkdv_form!r}, "
                             f"{persistent}, {power}")
        return _launch_one_pass(q, k, v, q2, k2, lam, dout, causal, float(beta * math.sqrt(2.0 / q.shape[-1])),
                                float(power))
    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    forms, q_cfg, rows_tile, key_tile, dq_constexprs = _backward_plan(q.dtype, d, causal, power_mode(power),
                                                                      dkdv_form, fused_query_rows, dq_form)
    tau_scale, power = float(beta * math.sqrt(2.0 / d)), float(power)
    q_view, q2_view, do_view = tma_view(q), tma_view(q2), tma_view(dout)
    k_view, k2_view, v_view = tma_view(k), tma_view(k2), tma_view(v)

    dq = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    dq2 = torch.empty((bsz, n, h, d), device=q.device, dtype=q2.dtype)
    dk = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k.dtype)
    dk2 = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k2.dtype)
    dv = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=v.dtype)
    dlam_part = torch.empty((bsz, h, n), device=q.device, dtype=torch.float32)
    lam_stride = lam.stride(0)

    for cfg, half_keys, query_block, constexprs in forms:
        descriptors = (*(descriptor(t, half_keys) for t in (k_view, k2_view, v_view)),
                       *(descriptor(t, query_block) for t in (q_view, q2_view, do_view)))
        scalars = (kv_len * h_kv * d, h_kv * d, d, lam_stride,  # dk's, dv's and dk2's strides (contiguous), lam's
                   h_kv, h // h_kv, n, kv_len, tau_scale, power)
        blocks = cdiv(kv_len, cfg["BLOCK_N"])
        if persistent and constexprs["VIEWS"] <= SECOND_VIEW:
            _PERSISTENT_DKDV.run((persistent_programs(blocks * bsz * h_kv, q.device),), descriptors,
                                 (dk, dv, dk2, lam), (*scalars, bsz * h_kv), constexprs, GLUON_OPTIONS)
        else:
            _DKDV.run((blocks, bsz * h_kv), descriptors, (dk, dv, dk2, lam), scalars, constexprs, GLUON_OPTIONS)
    # the query-block kernel takes Q, Q2, dO in 64-row tiles (one consumer's rows)
    dq_descriptors = (*(descriptor(t, rows_tile) for t in (q_view, q2_view, do_view)),
                      *(descriptor(t, key_tile) for t in (k_view, k2_view, v_view)))
    dq_scalars = (n * h * d, h * d, d, lam_stride,  # dq's and dq2's strides (contiguous), lam's
                  h, h // h_kv, n, kv_len, tau_scale, power)
    if dq_form == "view_warpgroups":
        _DQ_VIEWS.run((cdiv(n, q_cfg["BLOCK_M"]), bsz * h), dq_descriptors, (dq, dq2, lam, dlam_part), dq_scalars,
                      dq_constexprs, GLUON_OPTIONS)
    elif persistent:
        _PERSISTENT_DQ.run((persistent_programs(cdiv(n, q_cfg["BLOCK_M"]) * bsz * h, q.device),), dq_descriptors,
                           (dq, dq2, lam, dlam_part), (*dq_scalars, bsz * h), dq_constexprs, GLUON_OPTIONS)
    else:
        _DQ.run((cdiv(n, q_cfg["BLOCK_M"]), bsz * h), dq_descriptors, (dq, dq2, lam, dlam_part), dq_scalars,
                dq_constexprs, GLUON_OPTIONS)
    # fixed-order reduction of the per-(batch, head, query row) sums: deterministic
    dlam = (-dlam_part.sum(dim=(0, 2))).to(lam.dtype)
    return dq, dk, dv, dq2, dk2, dlam


def gluon_diff_threshold_backward(q, k, v, q2, k2, lam, dout, causal: bool, beta: float = 1.0, power: float = 2.0,
                                  dkdv_form: str = "key_halves", persistent: bool = False,
                                  fused_query_rows: int | None = None, dq_form: str = "rows",
                                  one_pass: bool = False):
    """`launch_diff_threshold_backward` with its operands checked (ValueError naming what a call misses)."""
    what = "gluon differential threshold backward"
    check_operands(q, k, v, causal, what)
    check_second_view(q, k, q2, k2, lam, beta, power, what, dout=dout)
    if dkdv_form not in DKDV_FORMS:
        raise ValueError(f"{what}: dkdv_form must be one of {tuple(DKDV_FORMS)}, got {dkdv_form!r}")
    if fused_query_rows not in (None, 32, 64):
        raise ValueError(f"{what}: fused_query_rows must be None, 32 or 64, got {fused_query_rows!r}")
    if dq_form not in DQ_FORMS:
        raise ValueError(f"{what}: dq_form must be one of {DQ_FORMS}, got {dq_form!r}")
    if one_pass and (dkdv_form != "view_warpgroups" or persistent or power_mode(float(power)) == 0):
        raise ValueError(f"{what}: one_pass=True needs dkdv_form='view_warpgroups', persistent=False and power 1 or "
                         f"2, got {dkdv_form!r}, {persistent}, {power}")
    return launch_diff_threshold_backward(q, k, v, q2, k2, lam, dout, causal, float(beta), float(power), dkdv_form,
                                          bool(persistent), fused_query_rows, dq_form, bool(one_pass))


# ---------------------------------------------------------------------------------------------
# compiling without a GPU

KERNELS = ("dkdv", "dkdv_first", "dkdv_second", "dkdv_views", "dkdv_exchange", "dkdv_persistent",
           "dkdv_second_persistent", "dq", "dq_persistent", "dq_views", "dkdv_views_one_pass")
_DKDV_VIEWS = {"dkdv": FUSED, "dkdv_first": FIRST_VIEW, "dkdv_second": SECOND_VIEW, "dkdv_views": VIEW_WARPGROUPS,
               "dkdv_exchange": VIEW_EXCHANGE, "dkdv_second_persistent": SECOND_VIEW}


def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90,
                 kernel: str = "dkdv", power: float = 2.0, lam_dtype: str = "fp32", views: int | None = None,
                 block_n: int | None = None, block_m: int | None = None, stages: int | None = None,
                 xchg_slots: int | None = None):
    """One of the backward's kernels compiled for sm_<arch> without a GPU
    (`gluon_pipeline.compile_gluon_sm90`). `kernel`: "dq", or "dkdv" (the key-block launches this head
    dim runs: the fused form at D = 64, the first view's at D = 128; `views` picks another form),
    "dkdv_first" / "dkdv_second" / "dkdv_views" / "dkdv_exchange" (forms 1 / 2 / 3 / 4); "dq_persistent",
    "dkdv_persistent" and "dkdv_second_persistent" the persistent forms; "dq_views" the query-block kernel's
    view-warpgroup form; "dkdv_views_one_pass" the view warpgroups' one-pass form (p = 1 or 2)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    rows = descriptor_type(dtype, [64, head_dim])
    scalars = {"q_len": "i32", "kv_len": "i32", "tau_scale": "fp32", "power": "fp32"}
    tail = {name: "constexpr" for name in ("POWER_MODE", "CAUSAL", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "STAGES")}
    constexprs = {"POWER_MODE": power_mode(power), "CAUSAL": causal, "HEAD_DIM": head_dim}
    if kernel == "dkdv_views_one_pass":
        from attn.kernels.gluon_softmax_bwd import dq_accumulator_block, dq_staging_layout

        cfg = one_pass_tile_config(head_dim)
        if stages is not None:
            cfg["STAGES"] = stages
        keys = descriptor_type(dtype, [cfg["BLOCK_N"], head_dim])
        dq_block = dq_accumulator_block(head_dim)
        dq_acc = f"tensordesc<fp32[{dq_block[0]}, {dq_block[1]}],{dq_staging_layout()!r}>"
        signature = {"k_desc": keys, "k2_desc": keys, "v_desc": keys, "q_desc": rows, "q2_desc": rows,
                     "do_desc": rows, "dq_desc": dq_acc, "dq2_desc": dq_acc, "DK": f"*{dtype}", "DV": f"*{dtype}",
                     "DK2": f"*{dtype}", "LAM": f"*{lam_dtype}", "DLAM_PART": "*fp32", "stride_kvb": "i32",
                     "stride_kvn": "i32", "stride_kvh": "i32", "stride_lam": "i32", "H_KV": "i32", "GROUP": "i32",
                     **scalars, **tail, "DQ_COLS": "constexpr"}
        return compile_gluon_sm90(_dkdv_views_dq_kernel, signature, {**constexprs, **cfg},
                                  ("DK", "DV", "DK2", "DLAM_PART"), arch)
    if kernel in ("dq", "dq_persistent", "dq_views"):
        cfg = dq_tile_config(head_dim, "view_warpgroups" if kernel == "dq_views" else "rows")
        if block_n is not None:
            cfg["BLOCK_N"] = block_n
        keys = descriptor_type(dtype, [cfg["BLOCK_N"], head_dim])
        signature = {"q_desc": rows, "q2_desc": rows, "do_desc": rows, "k_desc": keys, "k2_desc": keys,
                     "v_desc": keys, "DQ": f"*{dtype}", "DQ2": f"*{dtype}", "LAM": f"*{lam_dtype}",
                     "DLAM_PART": "*fp32",
                     "stride_dqb": "i32", "stride_dqn": "i32", "stride_dqh": "i32", "stride_lam": "i32", "H": "i32",
                     "GROUP": "i32", **scalars, **tail}
        if kernel == "dq_persistent":
            signature = {**signature, "BH": "i32"}
            return compile_gluon_sm90(_persistent_dq_kernel, signature, {**constexprs, **cfg},
                                      ("DQ", "DQ2", "DLAM_PART"), arch)
        kernel_fn = _dq_views_kernel if kernel == "dq_views" else _dq_kernel
        return compile_gluon_sm90(kernel_fn, signature, {**constexprs, **cfg}, ("DQ", "DQ2", "DLAM_PART"), arch)
    if views is None:
        views = _DKDV_VIEWS[kernel] if kernel not in ("dkdv", "dkdv_persistent") else dkdv_forms(head_dim)[0]
    cfg = dkdv_tile_config(head_dim, views)
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    if stages is not None:
        cfg["STAGES"] = stages
    if xchg_slots is not None:
        cfg["XCHG_SLOTS"] = xchg_slots
    rows = descriptor_type(dtype, [cfg["BLOCK_M"], head_dim])
    keys = descriptor_type(dtype, [key_tile_rows(views, cfg), head_dim])
    signature = {"k_desc": keys, "k2_desc": keys, "v_desc": keys, "q_desc": rows, "q2_desc": rows, "do_desc": rows,
                 "DK": f"*{dtype}", "DV": f"*{dtype}", "DK2": f"*{dtype}", "LAM": f"*{lam_dtype}",
                 "stride_kvb": "i32", "stride_kvn": "i32", "stride_kvh": "i32", "stride_lam": "i32", "H_KV": "i32",
                 "GROUP": "i32", **scalars, "VIEWS": "constexpr", **tail}
    if kernel.endswith("_persistent"):  # compile_gluon_sm90 takes the signature in the kernel's argument order
        return compile_gluon_sm90(_persistent_dkdv_kernel, {**signature, "BHK": "i32"},
                                  {**constexprs, "VIEWS": views, **cfg}, ("DK", "DV", "DK2"), arch)
    return compile_gluon_sm90(_dkdv_kernel, {**signature, "XCHG_SLOTS": "constexpr"},
                              {**constexprs, "VIEWS": views, "XCHG_SLOTS": 1, **cfg}, ("DK", "DV", "DK2"), arch)
