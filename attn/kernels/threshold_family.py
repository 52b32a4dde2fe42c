"""Fused Triton kernels of the threshold family (DESIGN.md §4): forward and exact backward.

    threshold:       w_ij = relu(q_i.k_j - tau_i)^p
    diff_threshold:  w_ij = relu(q_i.k_j - tau_i)^p - lambda_h relu(q2_i.k2_j - tau_i)^p
    out_i = sum_j w_ij v_j over visible keys j,   tau_i = beta * sqrt(2 ln(n_i) / D)

One forward kernel and two backward kernels (dq; dk/dv) serve both variants: the second
view is the compile-time switch DIFF. The differential kernel computes both score views of
a tile and feeds their difference to a single w.V product (3 matrix products per forward
tile, not 4). Nothing is normalized, so, unlike softmax attention, the forward saves no
row statistics and the backward needs no preprocessing pass:

    dv_j  = sum_i w_ij dout_i                       dp_ij = dout_i . v_j
    dq_i  = sum_j dp_ij g1_ij k_j                   dk_j  = sum_i dp_ij g1_ij q_i
    dq2_i = -lambda_h sum_j dp_ij g2_ij k2_j        dk2_j = -lambda_h sum_i dp_ij g2_ij q2_i
    dlambda_h = -sum_ij dp_ij relu(x2_ij - tau_i)^p

with g = d relu(x - tau)^p / dx = p relu(x - tau)^(p-1) (0 where x <= tau, also for p < 1,
as the reference's where() gives). Dropout (attn/dropout.py; the constexpr DROPOUT,
compiled out at p = 0): the combined weight w becomes m w / (1 - p) with m the keep mask
(attn/kernels/dropout.py, regenerated in the backward); dv uses that weight, and dp_ij becomes
m_ij dp_ij / (1 - p) in every other gradient above (both views, d-lambda).

d-lambda is reduced without atomics: every key-block program writes its own partial sum, and
torch sums the partials in a fixed order.

Masks come from the shared `attn/kernels/tiles.py` (key_ranges / query_ranges skip the
tiles a mask empties; tile_visible masks inside a tile; visible_counts gives n_i). Each
visited range is further split into tiles that every query (key) of the block sees in
full, which run without any mask arithmetic, and boundary tiles, which are masked.

Inputs are read through their strides in their own dtype (bf16/fp16 go to the tensor
cores as they are, fp32 accumulation); fp32 inputs use IEEE fp32 products (no tf32), so
tests against the float64 reference are meaningful. GQA: query head h reads kv head
h // (H / H_kv); the dk/dv program of a kv head loops over its query heads, so nothing is
repeated in memory and nothing is accumulated atomically.

The differential dk/dv runs fused (one launch, three accumulators) or split (dk + dv, then
dk2 + d-lambda); the autotuner times both per key and keeps the faster. Diagnostics: `zero_fraction` counts exact zeros of w per head in a kernel (no N x N
tensor). Knobs for tests and GPU sweeps: ATTNLAB_AUTOTUNE=0 pins tile configs
(ATTNLAB_KERNEL_CONFIG=i picks the i-th candidate), ATTNLAB_DIFF_DKDV=fused|split pins
the dk/dv form. Measurements: docs/results/bench_threshold.md.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from attn.kernels.dropout import dropout_keep, load_seed, seed_operand
from attn.kernels.env import interpreting, setting
from attn.kernels.runtime import (KERNEL_LIBRARY, PLAN_SETTINGS, AutogradOp, ConfigTable, Kernel, LaunchPlans,
                                  TileConfig, cdiv, contiguous_strides, decode_config, decode_splits, dot_precision,
                                  kernel_op, n_bucket, pinned_index)
from attn.kernels.runtime import tuned_configs as _tuned_configs
from attn.kernels.splits import sum_key_splits
from attn.kernels.tiers import (GLUON_DIFF_DKDV_ENV, GLUON_DIFF_DQ_ENV, GLUON_DQ_ENV, GLUON_ENV, GLUON_PERSISTENT_ENV,
                                GLUON_SCHEDULE_ENV, TierChoice, TimedChoice, choose_gluon_backward_grid,
                                choose_gluon_diff_dkdv_form, choose_gluon_diff_dq_form, choose_gluon_grid,
                                choose_gluon_weighted_dq_form, gluon_candidate, gluon_dq_form, gluon_pingpong, tiered)
from attn.kernels.tiles import (clip_to_key_split, full_key_span_all_rows, full_query_span_all_rows, head_tile_ptrs,
                                key_block_program, key_ranges, load_segment_bounds, load_tile, mask_and_drop,
                                masked_tile, masked_tile_count, query_block_program, query_heads, query_row_ranges,
                                tile_visible, tile_visible_in_query_range, visible_counts)
from attn.families.threshold import FAMILY
from attn.masks import MaskSpec, visible_key_counts
from attn.specs import ThresholdFamilySpec
from attn.validation import KERNEL_HEAD_DIMS, check_kernel_inputs, check_key_lengths, kernel_segment_bounds

SUPPORTED_HEAD_DIMS = KERNEL_HEAD_DIMS
# d-lambda partial sums are laid out per MIN_BLOCK keys, so every block size fills the
# whole buffer (see _dkdv_kernel) and autotuning trials leave no stale partials behind
_DLAM_SLOT = 16
# the smallest positive normal fp32: general powers clamp x to it before log2, keeping
# p * x^(p-1) finite for p < 1 (the reference is finite there too)
_TINY = 1.1754943508222875e-38

# ----------------------------------------------------------------------------------------
# elementwise pieces
# ----------------------------------------------------------------------------------------


@triton.jit
def _relu(x):
    """max(x, 0) that keeps a NaN score NaN, as the reference does (plain max(NaN, 0) gives 0): one
    NaN-propagating max instruction, so propagation costs nothing per score."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rectified_power(x, power, POWER_MODE: tl.constexpr):
    """relu(x)^p (fp32; NaN for a NaN score). POWER_MODE 1 / 2: p = 1 / 2 fast paths; 0: any p > 0."""
    r = _relu(x)
    if POWER_MODE == 1:
        w = r
    elif POWER_MODE == 2:
        w = r * r
    else:
        # r is 0 for x <= 0 and NaN for a NaN score, so it stands in where the power is not taken
        w = tl.where(x > 0.0, tl.exp2(power * tl.log2(tl.maximum(x, 1.1754943508222875e-38))), r)
    return w


@triton.jit
def _rectified_power_and_grad(x, power, POWER_MODE: tl.constexpr):
    """(relu(x)^p, p relu(x)^(p-1) [0 where x <= 0]) in fp32; both NaN for a NaN score."""
    positive = x > 0.0
    r = _relu(x)
    if POWER_MODE == 1:
        w = r
        g = tl.where(positive, 1.0, r)
    elif POWER_MODE == 2:
        w = r * r
        g = 2.0 * r
    else:
        pm1 = tl.where(positive, tl.exp2((power - 1.0) * tl.log2(tl.maximum(x, 1.1754943508222875e-38))), r)
        w = pm1 * r
        g = power * pm1
    return w, g


@triton.jit
def _rectified_power_grad(x, power, POWER_MODE: tl.constexpr):
    """p relu(x)^(p-1), 0 where x <= 0 (fp32; NaN for a NaN score)."""
    if POWER_MODE == 1:
        g = tl.where(x > 0.0, 1.0, _relu(x))
    elif POWER_MODE == 2:
        g = 2.0 * _relu(x)
    else:
        g = tl.where(
            x > 0.0, power * tl.exp2((power - 1.0) * tl.log2(tl.maximum(x, 1.1754943508222875e-38))), _relu(x)
        )
    return g


@triton.jit
def _row_threshold(offs_m, kv_len, window, hs, he, cs, ce, tau_scale,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    """tau_i = beta sqrt(2 ln n_i / D) = tau_scale * sqrt(ln n_i); n_i = 0 (sees nothing) -> 0."""
    n_i = visible_counts(offs_m, kv_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
    return tau_scale * tl.sqrt(tl.log(tl.maximum(n_i, 1.0)))


# ----------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------


@triton.jit
def _second_view_tiles(Q2, K2, LAM, q, k_base, b64, h, hk, offs_m, offs_d, row_ok,
                       sq2b, sq2n, sq2h, sq2d, sk2b, sk2h, slam, DIFF: tl.constexpr):
    """A query-block program's second view (q2 tile, k2 head base, lambda_h in fp32); without DIFF
    the first view's q and k_base and an unused 0."""
    if DIFF:
        q2 = tl.load(head_tile_ptrs(Q2, b64, h, offs_m, offs_d, sq2b, sq2n, sq2h, sq2d), mask=row_ok, other=0.0)
        k2_base = K2 + b64 * sk2b + hk * sk2h
        lam = tl.load(LAM + h * slam).to(tl.float32)
    else:
        q2 = q
        k2_base = k_base
        lam = 0.0
    return q2, k2_base, lam


@triton.jit
def _fwd_tile(acc, q, q2, tau, lam, k_base, v_base, k2_base,
              skn, skd, svn, svd, sk2n, sk2d,
              offs_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, power,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_SEG: tl.constexpr, DIFF: tl.constexpr, DOT_PREC: tl.constexpr,
              seed, bh, dropout_p, DROPOUT: tl.constexpr):
    """acc += w(q, keys [n0, n0 + BLOCK_N)) . v; MASKED tiles keep keys in [key_lo, key_hi).
    DROPOUT: w (both views combined) -> m w / (1 - p), m the call's keep mask."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, offs_n, offs_d, skn, skd, kv_len, MASKED)
    v = load_tile(v_base, offs_n, offs_d, svn, svd, kv_len, MASKED)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) - tau[:, None]
    w = _rectified_power(x, power, POWER_MODE)
    if DIFF:
        k2 = load_tile(k2_base, offs_n, offs_d, sk2n, sk2d, kv_len, MASKED)
        x2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) - tau[:, None]
        w = w - lam * _rectified_power(x2, power, POWER_MODE)
    w = mask_and_drop(w, offs_m, offs_n, key_lo, key_hi, kv_len, window, hs, he, cs, ce, seed, bh, dropout_p,
                      MASKED, CAUSAL, HAS_WINDOW, HAS_SEG, DROPOUT)
    # the one w.V product per tile (both views already combined in w)
    return tl.dot(w.to(v.dtype), v, acc, input_precision=DOT_PREC)


# Scalars that vary with the problem size are not specialized on (value 1 / divisibility
# by 16), so one compiled kernel serves every N, head count, GQA ratio and window: compile
# once per mask kind / variant / dtype / head dim, and a warm-up anywhere fills the cache.
_RUNTIME_SCALARS = ["q_len", "kv_len", "num_heads", "group", "window", "N_BUCKET"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS + ["split_len"])
def _fwd_kernel(
    Q, K, V, Q2, K2, LAM, BOUNDS, OUT, SEED, LENS,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sq2b, sq2n, sq2h, sq2d, sk2b, sk2n, sk2h, sk2d, slam,
    sob, son, soh, sod, sos,
    q_len, kv_len, num_heads, group, window, split_len, tau_scale, power, N_BUCKET, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, DIFF: tl.constexpr, DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr,
    SPLIT_KV: tl.constexpr, HAS_LENS: tl.constexpr,
):
    """Query rows [m0, m0 + BLOCK_M) of one (batch, head); query row i sits at key position
    i + kv_len - q_len (bottom-right alignment), and masks, tile ranges and n_i work on positions.
    SPLIT_KV (flash-decoding): program_id(2) = s takes only keys [s split_len, (s+1) split_len)
    and writes its partial sum at OUT + s sos (fp32); the launcher sums the splits (a split
    that sees no key writes zeros).
    HAS_LENS: kv_len is the capacity of a static cache and the row's own key count is LENS[b]
    (int32, clamped to [0, kv_len]); keys at or past it do not exist (loads masked, never seen,
    not counted in n_i)."""
    bh, b, h, hk, kv_len, offs_m, pos_m, p0, hs, he, cs, ce = query_block_program(
        BOUNDS, num_heads, group, q_len, kv_len, BLOCK_M, HAS_SEG, LENS, HAS_LENS)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    seed = load_seed(SEED, DROPOUT)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < q_len
    q = tl.load(head_tile_ptrs(Q, b64, h, offs_m, offs_d, sqb, sqn, sqh, sqd), mask=row_ok, other=0.0)
    k_base = K + b64 * skb + hk * skh
    v_base = V + b64 * svb + hk * svh
    q2, k2_base, lam = _second_view_tiles(Q2, K2, LAM, q, k_base, b64, h, hk, offs_m, offs_d, row_ok,
                                          sq2b, sq2n, sq2h, sq2d, sk2b, sk2h, slam, DIFF)
    tau = _row_threshold(pos_m, kv_len, window, hs, he, cs, ce, tau_scale, CAUSAL, HAS_WINDOW, HAS_SEG)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, hi, lo2, hi2 = key_ranges(p0, kv_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    lo, hi = clip_to_key_split(lo, hi, split, split_len, SPLIT_KV)
    a, z = full_key_span_all_rows(p0, lo, hi, kv_len, window, hs, he, cs, ce, BLOCK_M, BLOCK_N,
                                  CAUSAL, HAS_WINDOW, HAS_SEG)
    for n0 in range(a, z, BLOCK_N):
        acc = _fwd_tile(acc, q, q2, tau, lam, k_base, v_base, k2_base, skn, skd, svn, svd, sk2n, sk2d,
                        pos_m, n0, lo, hi, kv_len, window, hs, he, cs, ce, power,
                        HEAD_DIM, BLOCK_N, False, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF, DOT_PREC, seed, bh, dropout_p, DROPOUT)
    for t in range(0, masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK_N)):
        n0, key_lo, key_hi = masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK_N)
        acc = _fwd_tile(acc, q, q2, tau, lam, k_base, v_base, k2_base, skn, skd, svn, svd, sk2n, sk2d,
                        pos_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, power,
                        HEAD_DIM, BLOCK_N, True, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF, DOT_PREC, seed, bh, dropout_p, DROPOUT)
    tl.store(head_tile_ptrs(OUT + split * sos, b64, h, offs_m, offs_d, sob, son, soh, sod),
             acc.to(OUT.dtype.element_ty), mask=row_ok)


# ----------------------------------------------------------------------------------------
# backward: dq (query-block programs, same key ranges as the forward)
# ----------------------------------------------------------------------------------------


@triton.jit
def _dq_tile(dq, dq2, q, q2, do, tau, lam, k_base, v_base, k2_base,
             skn, skd, svn, svd, sk2n, sk2d,
             offs_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, power,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             HAS_SEG: tl.constexpr, DIFF: tl.constexpr, DOT_PREC: tl.constexpr,
             seed, bh, dropout_p, DROPOUT: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, offs_n, offs_d, skn, skd, kv_len, MASKED)
    v = load_tile(v_base, offs_n, offs_d, svn, svd, kv_len, MASKED)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) - tau[:, None]
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    # masks both views' ds; under dropout d(m w / (1 - p)) / dw
    dp = mask_and_drop(dp, offs_m, offs_n, key_lo, key_hi, kv_len, window, hs, he, cs, ce, seed, bh, dropout_p,
                       MASKED, CAUSAL, HAS_WINDOW, HAS_SEG, DROPOUT)
    ds = dp * _rectified_power_grad(x, power, POWER_MODE)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    if DIFF:
        k2 = load_tile(k2_base, offs_n, offs_d, sk2n, sk2d, kv_len, MASKED)
        x2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) - tau[:, None]
        ds2 = dp * (-lam * _rectified_power_grad(x2, power, POWER_MODE))
        dq2 = tl.dot(ds2.to(k2.dtype), k2, dq2, input_precision=DOT_PREC)
    return dq, dq2


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _dq_kernel(
    Q, K, V, Q2, K2, LAM, BOUNDS, DO, DQ, DQ2, SEED,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sq2b, sq2n, sq2h, sq2d, sk2b, sk2n, sk2h, sk2d, slam,
    sdob, sdon, sdoh, sdod,
    q_len, kv_len, num_heads, group, window, tau_scale, power, N_BUCKET, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, DIFF: tl.constexpr, DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr,
):
    bh, b, h, hk, kv_len, offs_m, pos_m, p0, hs, he, cs, ce = query_block_program(
        BOUNDS, num_heads, group, q_len, kv_len, BLOCK_M, HAS_SEG)
    b64 = b.to(tl.int64)
    seed = load_seed(SEED, DROPOUT)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < q_len
    q = tl.load(head_tile_ptrs(Q, b64, h, offs_m, offs_d, sqb, sqn, sqh, sqd), mask=row_ok, other=0.0)
    do = tl.load(head_tile_ptrs(DO, b64, h, offs_m, offs_d, sdob, sdon, sdoh, sdod), mask=row_ok, other=0.0)
    k_base = K + b64 * skb + hk * skh
    v_base = V + b64 * svb + hk * svh
    q2, k2_base, lam = _second_view_tiles(Q2, K2, LAM, q, k_base, b64, h, hk, offs_m, offs_d, row_ok,
                                          sq2b, sq2n, sq2h, sq2d, sk2b, sk2h, slam, DIFF)
    tau = _row_threshold(pos_m, kv_len, window, hs, he, cs, ce, tau_scale, CAUSAL, HAS_WINDOW, HAS_SEG)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, hi, lo2, hi2 = key_ranges(p0, kv_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    a, z = full_key_span_all_rows(p0, lo, hi, kv_len, window, hs, he, cs, ce, BLOCK_M, BLOCK_N,
                                  CAUSAL, HAS_WINDOW, HAS_SEG)
    for n0 in range(a, z, BLOCK_N):
        dq, dq2 = _dq_tile(dq, dq2, q, q2, do, tau, lam, k_base, v_base, k2_base, skn, skd, svn, svd, sk2n, sk2d,
                           pos_m, n0, lo, hi, kv_len, window, hs, he, cs, ce, power,
                           HEAD_DIM, BLOCK_N, False, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF, DOT_PREC, seed, bh, dropout_p, DROPOUT)
    for t in range(0, masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK_N)):
        n0, key_lo, key_hi = masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK_N)
        dq, dq2 = _dq_tile(dq, dq2, q, q2, do, tau, lam, k_base, v_base, k2_base, skn, skd, svn, svd, sk2n, sk2d,
                           pos_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, power,
                           HEAD_DIM, BLOCK_N, True, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF, DOT_PREC, seed, bh, dropout_p, DROPOUT)
    # dq / dq2 are contiguous (B, N, H, D) allocations of the launcher
    out_offs = b64 * q_len * num_heads * HEAD_DIM + offs_m[:, None] * (num_heads * HEAD_DIM) + h * HEAD_DIM
    tl.store(DQ + out_offs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok)
    if DIFF:
        tl.store(DQ2 + out_offs + offs_d[None, :], dq2.to(DQ2.dtype.element_ty), mask=row_ok)


# ----------------------------------------------------------------------------------------
# backward: dk, dv (dk2, d-lambda partials) — key-block programs over the query ranges
# ----------------------------------------------------------------------------------------


@triton.jit
def _dkdv_tile(dk, dv, dk2, dlam, k, v, k2, lam, q_base, do_base, q2_base,
               sqn, sqd, sdon, sdod, sq2n, sq2d,
               offs_n, m0, q_lo, q_hi, kv_len, window, hs, he, cs, ce, tau_scale, power,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
               POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SEG: tl.constexpr, DIFF: tl.constexpr, VIEWS: tl.constexpr, DOT_PREC: tl.constexpr,
               seed, bh, dropout_p, DROPOUT: tl.constexpr):
    """One query tile at key positions [m0, m0 + BLOCK_M) against this program's keys (q_base,
    do_base and q2_base are indexed by key position); MASKED tiles keep queries in [q_lo, q_hi). Tiles are held transposed, (keys, queries), so dv and dk
    accumulate without transposing the accumulators.

    VIEWS (differential only): 0 = dk, dv, dk2 and d-lambda in one pass; 1 = dk and dv;
    2 = dk2 and d-lambda (the split form: two launches with 2 and 1 accumulators instead
    of one launch with 3, which at D = 128 does not fit the register file)."""
    FIRST: tl.constexpr = (not DIFF) or VIEWS != 2
    SECOND: tl.constexpr = DIFF and VIEWS != 1
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    do = load_tile(do_base, offs_m, offs_d, sdon, sdod, kv_len, MASKED)
    tau = _row_threshold(offs_m, kv_len, window, hs, he, cs, ce, tau_scale, CAUSAL, HAS_WINDOW, HAS_SEG)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    if MASKED:
        vis = tile_visible_in_query_range(offs_m, offs_n, q_lo, q_hi, kv_len, window, hs, he, cs, ce,
                                          CAUSAL, HAS_WINDOW, HAS_SEG)
        visT = tl.trans(vis)
        dpT = tl.where(visT, dpT, 0.0)  # masks every ds term and d-lambda
    if DROPOUT:  # one keep mask m for the combined weight: dv += (m w / (1 - p))^T do, dp -> m dp / (1 - p)
        keepT = dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], kv_len, dropout_p)
        dpT = tl.where(keepT, dpT * (1.0 / (1.0 - dropout_p)), 0.0)
    if FIRST:
        q = load_tile(q_base, offs_m, offs_d, sqn, sqd, kv_len, MASKED)
        xT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) - tau[None, :]
        wT, gT = _rectified_power_and_grad(xT, power, POWER_MODE)
    if DIFF:
        q2 = load_tile(q2_base, offs_m, offs_d, sq2n, sq2d, kv_len, MASKED)
        x2T = tl.dot(k2, tl.trans(q2), input_precision=DOT_PREC) - tau[None, :]
        w2T, g2T = _rectified_power_and_grad(x2T, power, POWER_MODE)
        if SECOND:
            dlam += tl.sum(tl.sum(dpT * w2T, axis=1), axis=0)
            dk2 = tl.dot((dpT * (-lam * g2T)).to(q2.dtype), q2, dk2, input_precision=DOT_PREC)
        if FIRST:
            wT = wT - lam * w2T
    if FIRST:
        if MASKED:
            wT = tl.where(visT, wT, 0.0)
        if DROPOUT:
            wT = tl.where(keepT, wT * (1.0 / (1.0 - dropout_p)), 0.0)
        dv = tl.dot(wT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dk = tl.dot((dpT * gT).to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv, dk2, dlam


@triton.jit(do_not_specialize=_RUNTIME_SCALARS + ["dlam_slots"])
def _dkdv_kernel(
    Q, K, V, Q2, K2, LAM, BOUNDS, DO, DK, DV, DK2, DLAM_PART, SEED,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sq2b, sq2n, sq2h, sq2d, sk2b, sk2n, sk2h, sk2d, slam,
    sdob, sdon, sdoh, sdod,
    q_len, kv_len, num_heads, group, window, tau_scale, power, N_BUCKET, dlam_slots, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, DIFF: tl.constexpr, VIEWS: tl.constexpr, DOT_PREC: tl.constexpr,
    DLAM_SLOT: tl.constexpr, DROPOUT: tl.constexpr,
):
    FIRST: tl.constexpr = (not DIFF) or VIEWS != 2
    SECOND: tl.constexpr = DIFF and VIEWS != 1
    num_kv_heads = num_heads // group
    b, hk, n0, offs_n, hs, he, cs, ce = key_block_program(BOUNDS, num_kv_heads, BLOCK_N, HAS_SEG)
    b64 = b.to(tl.int64)
    seed = load_seed(SEED, DROPOUT)

    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n[:, None] < kv_len
    k = tl.load(head_tile_ptrs(K, b64, hk, offs_n, offs_d, skb, skn, skh, skd), mask=key_ok, other=0.0)
    v = tl.load(head_tile_ptrs(V, b64, hk, offs_n, offs_d, svb, svn, svh, svd), mask=key_ok, other=0.0)
    if DIFF:
        k2 = tl.load(head_tile_ptrs(K2, b64, hk, offs_n, offs_d, sk2b, sk2n, sk2h, sk2d), mask=key_ok, other=0.0)
    else:
        k2 = k

    # query row i sits at key position i + pos_offset (bottom-right alignment): the loops below run
    # over positions, and the query-indexed pointers are shifted by -pos_offset rows to match
    pos_offset = kv_len - q_len
    lo, hi, lo2, hi2 = query_row_ranges(n0, pos_offset, kv_len, window, hs, he, cs, ce, BLOCK_N, CAUSAL, HAS_WINDOW,
                                        HAS_SEG)
    a, z = full_query_span_all_rows(n0, lo, hi, kv_len, window, hs, he, cs, ce, BLOCK_M, BLOCK_N,
                                    CAUSAL, HAS_WINDOW, HAS_SEG)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # GQA: this kv head's query heads, one after another (no repeated K/V, no atomics)
    for h in range(hk * group, hk * group + group):
        bh = b * num_heads + h
        q_base = Q + b64 * sqb + h * sqh - pos_offset * sqn
        do_base = DO + b64 * sdob + h * sdoh - pos_offset * sdon
        if DIFF:
            q2_base = Q2 + b64 * sq2b + h * sq2h - pos_offset * sq2n
            lam = tl.load(LAM + h * slam).to(tl.float32)
        else:
            q2_base = q_base
            lam = 0.0
        dlam = tl.zeros([], dtype=tl.float32)
        for m0 in range(a, z, BLOCK_M):
            dk, dv, dk2, dlam = _dkdv_tile(dk, dv, dk2, dlam, k, v, k2, lam, q_base, do_base, q2_base,
                                           sqn, sqd, sdon, sdod, sq2n, sq2d,
                                           offs_n, m0, lo, hi, kv_len, window, hs, he, cs, ce, tau_scale, power,
                                           HEAD_DIM, BLOCK_M, False, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF,
                                           VIEWS, DOT_PREC, seed, bh, dropout_p, DROPOUT)
        for t in range(0, masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK_M)):
            m0, q_lo, q_hi = masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK_M)
            dk, dv, dk2, dlam = _dkdv_tile(dk, dv, dk2, dlam, k, v, k2, lam, q_base, do_base, q2_base,
                                           sqn, sqd, sdon, sdod, sq2n, sq2d,
                                           offs_n, m0, q_lo, q_hi, kv_len, window, hs, he, cs, ce, tau_scale, power,
                                           HEAD_DIM, BLOCK_M, True, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF,
                                           VIEWS, DOT_PREC, seed, bh, dropout_p, DROPOUT)
        if SECOND:
            # this program owns slots [n0, n0 + BLOCK_N) / DLAM_SLOT of head h: its partial of d-lambda
            # (-sum dp w2, negated here so that the launcher's reduction is a sum alone) goes to the first,
            # zeros to the rest, so the buffer is fully written whatever the block size (no zero-fill, no
            # stale autotuning trials)
            slots = n0 // DLAM_SLOT + tl.arange(0, BLOCK_N // DLAM_SLOT)
            vals = tl.where(tl.arange(0, BLOCK_N // DLAM_SLOT) == 0, -dlam, 0.0)
            tl.store(DLAM_PART + (b64 * num_heads + h) * dlam_slots + slots, vals, mask=slots < dlam_slots)
    # dk / dv / dk2 are contiguous (B, N, H_kv, D) allocations of the launcher
    out_offs = b64 * kv_len * num_kv_heads * HEAD_DIM + offs_n[:, None] * (num_kv_heads * HEAD_DIM) + hk * HEAD_DIM
    if FIRST:
        tl.store(DK + out_offs + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=key_ok)
        tl.store(DV + out_offs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)
    if SECOND:
        tl.store(DK2 + out_offs + offs_d[None, :], dk2.to(DK2.dtype.element_ty), mask=key_ok)


# ----------------------------------------------------------------------------------------
# diagnostic: exact zeros of w per (batch, head, query block), without an N x N tensor
# ----------------------------------------------------------------------------------------


@triton.jit
def _zero_count_tiles(zeros, q, q2, tau, lam, k_base, k2_base, skn, skd, sk2n, sk2d,
                      offs_m, start, end, key_lo, key_hi, seq_len, window, hs, he, cs, ce, power,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, POWER_MODE: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
                      DIFF: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_d, skn, skd, seq_len, True)
        w = _rectified_power(tl.dot(q, tl.trans(k), input_precision=DOT_PREC) - tau[:, None], power, POWER_MODE)
        if DIFF:
            k2 = load_tile(k2_base, offs_n, offs_d, sk2n, sk2d, seq_len, True)
            x2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) - tau[:, None]
            w = w - lam * _rectified_power(x2, power, POWER_MODE)
        vis = tile_visible(offs_m, offs_n, key_lo, key_hi, seq_len, window, hs, he, cs, ce,
                           CAUSAL, HAS_WINDOW, HAS_SEG)
        # a weight is zero for the w.V product when it is zero in the operands' dtype
        is_zero = vis & (w.to(k.dtype) == 0.0)
        zeros += tl.sum(tl.sum(is_zero.to(tl.int32), axis=1), axis=0)
    return zeros


@triton.jit(do_not_specialize=["seq_len", "num_heads", "group", "window"])
def _zero_count_kernel(
    Q, K, Q2, K2, LAM, BOUNDS, ZEROS,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd,
    sq2b, sq2n, sq2h, sq2d, sk2b, sk2n, sk2h, sk2d, slam,
    seq_len, num_heads, group, window, tau_scale, power,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POWER_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, DIFF: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk = query_heads(bh, num_heads, group)
    b64 = b.to(tl.int64)
    hs, he, cs, ce = load_segment_bounds(BOUNDS, b, HAS_SEG)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < seq_len
    q = tl.load(head_tile_ptrs(Q, b64, h, offs_m, offs_d, sqb, sqn, sqh, sqd), mask=row_ok, other=0.0)
    k_base = K + b64 * skb + hk * skh
    q2, k2_base, lam = _second_view_tiles(Q2, K2, LAM, q, k_base, b64, h, hk, offs_m, offs_d, row_ok,
                                          sq2b, sq2n, sq2h, sq2d, sk2b, sk2h, slam, DIFF)
    tau = _row_threshold(offs_m, seq_len, window, hs, he, cs, ce, tau_scale, CAUSAL, HAS_WINDOW, HAS_SEG)
    zeros = tl.zeros([], dtype=tl.int32)
    lo, hi, lo2, hi2 = key_ranges(m0, seq_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    zeros = _zero_count_tiles(zeros, q, q2, tau, lam, k_base, k2_base, skn, skd, sk2n, sk2d,
                              offs_m, lo, hi, lo, hi, seq_len, window, hs, he, cs, ce, power,
                              HEAD_DIM, BLOCK_N, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF, DOT_PREC)
    if HAS_SEG:
        zeros = _zero_count_tiles(zeros, q, q2, tau, lam, k_base, k2_base, skn, skd, sk2n, sk2d,
                                  offs_m, lo2, hi2, lo2, hi2, seq_len, window, hs, he, cs, ce, power,
                                  HEAD_DIM, BLOCK_N, POWER_MODE, CAUSAL, HAS_WINDOW, HAS_SEG, DIFF, DOT_PREC)
    tl.store(ZEROS + (b * num_heads + h) * tl.num_programs(0) + pid_m, zeros)


# ----------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------


# GPU candidates per (kernel, head dim, differential, views); the first is the pinned
# default. BLOCK_M: query rows, BLOCK_N: key rows of a tile. The dk/dv kernel keeps two
# (BLOCK_N, D) fp32 accumulators live (three in the fused differential form, views 0), hence
# its short query tiles. views 1 / 2: the split differential dk/dv (dk, dv / dk2 + d-lambda),
# see _dkdv_diff. At head dim 128 the lists also hold what tuning picks in a wide sweep on an
# H200 (docs/results/kernel_tile_sweep/): small 4-warp tiles for the threshold forward and dk/dv
# (two or three programs per SM overlap), 128-key tiles for the differential dk/dv.
GPU_CONFIGS = {
    ("fwd", 128, False, 0): [TileConfig(128, 64, 8, 3), TileConfig(64, 32, 4, 3), TileConfig(64, 64, 4, 3),
                             TileConfig(128, 128, 8, 3)],
    ("fwd", 128, True, 0): [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 2)],
    ("fwd", 64, False, 0): [TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3),
                            TileConfig(64, 32, 4, 3)],
    ("fwd", 64, True, 0): [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 4, 3)],
    ("dq", 128, False, 0): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
    ("dq", 128, True, 0): [TileConfig(128, 64, 8, 2), TileConfig(64, 64, 8, 3)],
    ("dq", 64, False, 0): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
    ("dq", 64, True, 0): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
    ("dkdv", 128, False, 0): [TileConfig(32, 128, 8, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 2),
                              TileConfig(64, 128, 8, 3)],
    ("dkdv", 128, True, 0): [TileConfig(16, 64, 8, 3), TileConfig(16, 128, 8, 3), TileConfig(32, 128, 8, 3),
                             TileConfig(32, 64, 8, 2)],
    ("dkdv", 128, True, 1): [TileConfig(32, 128, 8, 2), TileConfig(32, 128, 8, 3), TileConfig(64, 128, 8, 2),
                             TileConfig(16, 128, 8, 3)],
    ("dkdv", 128, True, 2): [TileConfig(32, 128, 8, 3), TileConfig(64, 128, 8, 3), TileConfig(64, 64, 4, 2)],
    ("dkdv", 64, False, 0): [TileConfig(64, 128, 8, 3), TileConfig(32, 128, 8, 3), TileConfig(32, 64, 4, 3)],
    ("dkdv", 64, True, 0): [TileConfig(32, 128, 8, 3), TileConfig(64, 64, 4, 3)],
    ("dkdv", 64, True, 1): [TileConfig(64, 128, 8, 3), TileConfig(32, 128, 8, 3)],
    ("dkdv", 64, True, 2): [TileConfig(64, 128, 8, 3), TileConfig(64, 64, 4, 3)],
}
_DEFAULT_CONFIGS = [TileConfig(64, 64, 4, 2)]  # head dims without a tuned table (16, 32)
# the interpreter (CPU tests): small tiles keep it fast and still exercise the masked /
# unmasked split; tests may override this table
INTERPRETER_CONFIG = {"fwd": (16, 16), "dq": (16, 16), "dkdv": (16, 16), "zeros": (16, 16)}
CONFIG_TABLE = ConfigTable(GPU_CONFIGS, INTERPRETER_CONFIG, default=_DEFAULT_CONFIGS)

# Tuning is keyed on dtype, bucketed N and every constexpr (head dim, mask kind, variant, power
# mode); the batch, head counts and exact N are not in the key (attn/kernels/runtime.py).
_KERNELS = {"fwd": Kernel(_fwd_kernel, "threshold_fwd"), "dq": Kernel(_dq_kernel, "threshold_dq"),
            "dkdv": Kernel(_dkdv_kernel, "threshold_dkdv")}
# fused (one launch) or split (two launches) differential dk/dv, measured per key
_dkdv_diff_form: dict[tuple, str] = {}


def _launch_settings(kind: str, meta: dict, buckets: tuple, dtype, views: int = 0) -> tuple:
    """(meta, configs, tuning key) of kernel `kind` for its variant (head dim, differential, dk/dv
    views); tuning keys: dtype, the (query, key) length buckets and every constexpr."""
    if kind == "dkdv":
        meta = {**meta, "VIEWS": views}
    configs = CONFIG_TABLE.candidates(kind, meta["HEAD_DIM"], meta["DIFF"], views)
    return meta, configs, (dtype, buckets, *meta.values())


def tuned_configs() -> dict[str, str]:
    """The configs tuning chose so far, readable (for benchmark reports)."""
    out = _tuned_configs(_KERNELS.values())
    out.update({f"dk/dv differential form, {key}": form for key, form in _dkdv_diff_form.items()})
    for choice in (_TIERS, _BWD_TIERS, _DIFF_TIERS, _DIFF_BWD_TIERS, _GLUON_GRIDS, _DIFF_GLUON_GRIDS,
                   _GLUON_BWD_GRIDS, _GLUON_DIFF_DKDV_FORMS, _GLUON_DIFF_DQ_FORMS, _GLUON_DIFF_BWD_GRIDS):
        out.update(choice.report())
    return out


def _power_mode(power: float) -> int:
    return 1 if power == 1.0 else 2 if power == 2.0 else 0


def _strides(t: Optional[torch.Tensor], like: torch.Tensor):
    return tuple((t if t is not None else like).stride())


def _common_args(q, k, v, q2, k2, lam):
    """Strides of q, k, v, q2, k2 (q's / k's stand in without a second view) and lam."""
    lam_stride = lam.stride(0) if lam is not None else 0
    return (
        *q.stride(), *k.stride(), *v.stride(),
        *_strides(q2, q), *_strides(k2, k), lam_stride,
    )


def _meta(q, k, power, causal, window, has_bounds: bool, differential):
    head_dim = q.shape[-1]
    return dict(
        HEAD_DIM=head_dim,
        POWER_MODE=_power_mode(power),
        CAUSAL=bool(causal or window > 0),
        HAS_WINDOW=window > 0,
        HAS_SEG=has_bounds,
        DIFF=differential,
        DOT_PREC=dot_precision(q.dtype),
    )


def _tau_scale(beta: float, head_dim: int) -> float:
    return beta * math.sqrt(2.0 / head_dim)


def _stride_of(t: Optional[torch.Tensor]):
    return None if t is None else t.stride()


def _signature(q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p) -> tuple:
    """What a call's launch plan follows from (LaunchPlans); the second view's dtypes decide whether a
    Gluon kernel serves the call."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), _stride_of(q2), _stride_of(k2), _stride_of(lam),
            q.dtype, None if q2 is None else (q2.dtype, k2.dtype), q.device, bounds is not None, beta, power, causal,
            window, dropout_p)


# lambda dtypes the Gluon differential kernels read; lambda of another float dtype goes to them as its
# fp32 copy, the value the portable kernels read (they convert lambda to fp32 too)
_GLUON_LAMBDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gluon_lambda(lam: torch.Tensor) -> torch.Tensor:
    return lam if lam.dtype in _GLUON_LAMBDA_DTYPES else lam.float()


def _forward_impl(q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p=0.0, seed=None,
                  key_lengths=None):
    """The forward's output; with `key_lengths` (B,) int32 the launches (grid, splits, configs)
    depend on the capacity k.shape[1] only, and the kernel reads each row's length on the device."""
    signature = (_signature(q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p),
                 key_lengths is not None)
    plan = _FWD_PLANS.get(signature, q, k, v, q2, k2, lam, bounds is not None, beta, power, causal, window,
                          dropout_p, key_lengths is not None)
    return plan(q, k, v, q2, k2, lam, bounds, seed, key_lengths)


def _forward_plan(q, k, v, q2, k2, lam, has_bounds, beta, power, causal, window, dropout_p, has_lens):
    """The forward's launches for one signature: (q, k, v, q2, k2, lam, bounds, seed, key_lengths) -> out."""
    bsz, n, heads, d = q.shape
    kv_len = k.shape[1]
    group = heads // k.shape[2]
    out_shape = (bsz, n, heads, d)
    if n == 0 or bsz == 0:
        return lambda q, *rest: torch.empty(out_shape, device=q.device, dtype=q.dtype)
    differential = q2 is not None
    meta = {**_meta(q, k, power, causal, window, has_bounds, differential), "DROPOUT": dropout_p > 0.0,
            "HAS_LENS": has_lens}
    common = _common_args(q, k, v, q2, k2, lam)
    scalars = (n, kv_len, heads, group, window, kv_len, _tau_scale(beta, d), float(power), n_bucket(kv_len),
               float(dropout_p))
    splits = 1
    if not has_bounds and dropout_p == 0.0:
        splits = decode_splits(n, kv_len, bsz * heads, decode_config().block_n, q.device)

    def operands(q, k, v, q2, k2, lam, bounds):  # q stands in for the tensors a variant does not read
        if differential:
            return q, k, v, q2, k2, lam, bounds if has_bounds else q
        return q, k, v, q, k, q, bounds if has_bounds else q

    if splits > 1:
        # flash-decoding: each split sums its key range into fp32 partials; nothing to rescale
        # (no row max, no normalizer), so merging is a plain sum (a split past a row's key length
        # adds its zeros)
        cfg = decode_config()
        split_len = cdiv(cdiv(kv_len, splits), cfg.block_n) * cfg.block_n
        splits = cdiv(kv_len, split_len)
        part_shape = (splits, bsz, n, heads, d)
        part_strides = contiguous_strides(part_shape)
        split_scalars = (*common, *part_strides[1:], part_strides[0], n, kv_len, heads, group, window, split_len,
                         *scalars[6:])
        split_meta = {**meta, "SPLIT_KV": True}
        split_grid = (lambda c: (cdiv(n, c.block_m), bsz * heads, splits))

        def split_forward(q, k, v, q2, k2, lam, bounds, seed, key_lengths):
            part = torch.empty(part_shape, device=q.device, dtype=torch.float32)
            _KERNELS["fwd"].launch(split_grid, (*operands(q, k, v, q2, k2, lam, bounds), part, q,
                                                key_lengths if has_lens else q),
                                   split_scalars, split_meta, [cfg], ())
            return sum_key_splits(part, torch.empty(out_shape, device=q.device, dtype=q.dtype))
        return split_forward

    full_scalars = (*common, *contiguous_strides(out_shape), 0, *scalars)
    full_meta, configs, tune_key = _launch_settings("fwd", {**meta, "SPLIT_KV": False}, (n_bucket(n), n_bucket(kv_len)),
                                                    q.dtype)
    grid = (lambda cfg: (cdiv(n, cfg.block_m), bsz * heads))

    def forward(q, k, v, q2, k2, lam, bounds, seed, key_lengths):
        out = torch.empty(out_shape, device=q.device, dtype=q.dtype)
        _KERNELS["fwd"].launch(grid, (*operands(q, k, v, q2, k2, lam, bounds), out, seed_operand(dropout_p, seed, q),
                                      key_lengths if has_lens else q),
                               full_scalars, full_meta, configs, tune_key)
        return out

    # the Gluon forwards serve calls without segments, key lengths, a window or dropout
    if has_bounds or has_lens or window or dropout_p or not gluon_candidate(q.device):
        return forward
    if differential:
        from attn.kernels import gluon_diff_fwd

        if not (gluon_diff_fwd.serves(q, k, v) and gluon_diff_fwd.serves(q2, k2, v)):
            return forward

        def gluon_diff_grid(persistent):
            def gluon_diff_forward(q, k, v, q2, k2, lam, bounds, seed, key_lengths):
                return gluon_diff_fwd.launch_diff_threshold(q, k, v, q2, k2, _gluon_lambda(lam), causal, beta, power,
                                                            persistent=persistent)
            return gluon_diff_forward

        diff_key = (*tune_key, float(power))
        gluon_diff_forward = choose_gluon_grid(_DIFF_GLUON_GRIDS, (*diff_key, n_bucket(bsz * heads)), gluon_diff_grid,
                                               False)
        return tiered(_DIFF_TIERS, diff_key, forward, gluon_diff_forward)
    from attn.kernels import gluon_weighted_fwd

    if not gluon_weighted_fwd.serves(q, k, v):
        return forward

    pingpong = gluon_pingpong()

    def gluon_grid(persistent):
        def gluon_forward(q, k, v, q2, k2, lam, bounds, seed, key_lengths):
            return gluon_weighted_fwd.launch_threshold(q, k, v, causal, beta, power, pingpong=pingpong,
                                                       persistent=persistent)
        return gluon_forward

    gluon_forward = choose_gluon_grid(_GLUON_GRIDS, (*tune_key, n_bucket(bsz * heads)), gluon_grid, pingpong)
    return tiered(_TIERS, tune_key, forward, gluon_forward)


_FWD_PLANS = LaunchPlans(_forward_plan, PLAN_SETTINGS + (GLUON_ENV, GLUON_SCHEDULE_ENV, GLUON_PERSISTENT_ENV))
# forwards on sm_90 that a Gluon kernel serves: the portable kernel or the Gluon one (attn/kernels/tiers.py),
# chosen per tuning key for the one-map threshold and for the differential threshold
_TIERS = TierChoice("threshold_family_fwd")
_DIFF_TIERS = TierChoice("diff_threshold_fwd")
# the Gluon forwards' grid per tuning key under ATTNLAB_GLUON_PERSISTENT=auto: "per_item" or "persistent"
_GLUON_GRIDS = TimedChoice("gluon threshold forward grid")
_DIFF_GLUON_GRIDS = TimedChoice("gluon diff_threshold forward grid")


def _dkdv_diff(dkdv, key) -> None:
    """Differential dk/dv: fused (one launch: dk, dv, dk2, d-lambda; 6 products per tile and
    three accumulators) or split (two launches, dk + dv and dk2 + d-lambda: 8 products per
    tile pair, at most two accumulators, so larger tiles fit the registers). Autotuning
    measures both forms at a key's first call (both write every output, so whichever runs
    last leaves a complete result); ATTNLAB_DIFF_DKDV=fused|split pins one."""

    def fused():
        dkdv(0)

    def split():
        dkdv(1)
        dkdv(2)

    forms = {"fused": fused, "split": split}
    pinned = setting("ATTNLAB_DIFF_DKDV")
    if pinned is not None and pinned not in forms:
        raise ValueError(f"ATTNLAB_DIFF_DKDV must be one of {tuple(forms)}, got {pinned!r}")
    if pinned is not None or interpreting() or pinned_index() is not None:  # pinned, or no timing: split
        forms[pinned or "split"]()
        return
    form = _dkdv_diff_form.get(key)
    if form is None:
        for fn in forms.values():  # autotune each form's kernels outside the timing
            fn()
        from triton.testing import do_bench

        times = {name: do_bench(fn, warmup=10, rep=40, return_mode="median")
                 for name, fn in forms.items()}
        form = _dkdv_diff_form[key] = min(times, key=times.get)
    forms[form]()


def _backward_impl(dout, q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p=0.0, seed=None):
    signature = (_signature(q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p), dout.stride())
    plan = _BWD_PLANS.get(signature, dout, q, k, v, q2, k2, lam, bounds is not None, beta, power, causal, window,
                          dropout_p)
    return plan(dout, q, k, v, q2, k2, lam, bounds, seed)


def _backward_plan(dout, q, k, v, q2, k2, lam, has_bounds, beta, power, causal, window, dropout_p):
    """The backward's launches for one signature: (dout, q, k, v, q2, k2, lam, bounds, seed) -> (dq, dk, dv)
    or, differential, (dq, dk, dv, dq2, dk2, dlam)."""
    bsz, n, heads, d = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    differential = q2 is not None
    q_shape, k_shape = (bsz, n, heads, d), (bsz, kv_len, kv_heads, d)
    dlam_slots = cdiv(max(kv_len, 1), _DLAM_SLOT)
    dlam_shape = (bsz, heads, dlam_slots)
    empty = n == 0 or bsz == 0
    common = _common_args(q, k, v, q2, k2, lam)
    meta = {**_meta(q, k, power, causal, window, has_bounds, differential), "DROPOUT": dropout_p > 0.0}
    scalars = (n, kv_len, heads, group, window, _tau_scale(beta, d), float(power), n_bucket(kv_len))
    buckets = (n_bucket(n), n_bucket(kv_len))
    dq_scalars = (*common, *dout.stride(), *scalars, float(dropout_p))
    dq_meta, dq_configs, dq_key = _launch_settings("dq", meta, buckets, q.dtype)
    dkdv_scalars = (*common, *dout.stride(), *scalars, dlam_slots, float(dropout_p))
    dkdv_settings = {views: _launch_settings("dkdv", {**meta, "DLAM_SLOT": _DLAM_SLOT}, buckets, q.dtype, views)
                     for views in ((0, 1, 2) if differential else (0,))}
    query_grid = (lambda cfg: (cdiv(n, cfg.block_m), bsz * heads))
    key_grid = (lambda cfg: (cdiv(kv_len, cfg.block_n), bsz * kv_heads))
    diff_key = (d, q.dtype, buckets, meta["CAUSAL"], meta["HAS_WINDOW"], meta["HAS_SEG"], meta["DROPOUT"])

    def backward(dout, q, k, v, q2, k2, lam, bounds, seed):
        dq = torch.empty(q_shape, device=q.device, dtype=q.dtype)
        dk = torch.empty(k_shape, device=q.device, dtype=k.dtype)
        dv = torch.empty(k_shape, device=q.device, dtype=v.dtype)
        dq2 = torch.empty_like(dq) if differential else None
        dk2 = torch.empty_like(dk) if differential else None
        dlam_part = torch.empty(dlam_shape, device=q.device, dtype=torch.float32) if differential else None
        if not empty:
            ops = (q, k, v, q2 if differential else q, k2 if differential else k, lam if differential else q,
                   bounds if has_bounds else q)
            seed_arg = seed_operand(dropout_p, seed, q)
            _KERNELS["dq"].launch(query_grid, (*ops, dout, dq, dq2 if differential else dq, seed_arg), dq_scalars,
                                  dq_meta, dq_configs, dq_key)
            dkdv_tensors = (*ops, dout, dk, dv, dk2 if differential else dk, dlam_part if differential else dq,
                            seed_arg)

            def dkdv(views):
                _KERNELS["dkdv"].launch(key_grid, dkdv_tensors, dkdv_scalars, *dkdv_settings[views])

            if differential:
                _dkdv_diff(dkdv, diff_key)
            else:
                dkdv(0)
        if not differential:
            return dq, dk, dv
        if empty:
            dlam_part.zero_()
        # fixed-order reduction of the per-(batch, head, key block) partials: deterministic
        dlam = dlam_part.sum(dim=(0, 2)).to(lam.dtype)
        return dq, dk, dv, dq2, dk2, dlam

    # the Gluon backwards serve calls without segments, a window or dropout, with at least as many keys as queries
    if has_bounds or window or dropout_p or empty or kv_len < n or not gluon_candidate(q.device):
        return backward
    tier_key = (q.dtype, *buckets, group, d, causal, float(power))
    if differential:
        from attn.kernels import gluon_diff_bwd

        if not (gluon_diff_bwd.serves(q, k, v) and gluon_diff_bwd.serves(q2, k2, v)):
            return backward

        work_key = (*tier_key, n_bucket(bsz * heads))

        def diff_form(dkdv_form):
            def query_block_form(dq_form):
                def grid(persistent):
                    def gluon_diff_backward(dout, q, k, v, q2, k2, lam, bounds, seed):
                        *grads, dlam = gluon_diff_bwd.launch_diff_threshold_backward(
                            q, k, v, q2, k2, _gluon_lambda(lam), dout, causal, beta, power, dkdv_form=dkdv_form,
                            persistent=persistent, dq_form=dq_form)
                        return (*grads, dlam.to(lam.dtype))  # d-lambda in lambda's dtype, as the portable backward's
                    return gluon_diff_backward
                if dkdv_form != "key_halves" and dq_form != "rows":  # no launch of these forms has a persistent grid
                    return grid(False)
                return choose_gluon_backward_grid(_GLUON_DIFF_BWD_GRIDS, (*work_key, dkdv_form, dq_form), grid,
                                                  "diff_threshold")
            return choose_gluon_diff_dq_form(_GLUON_DIFF_DQ_FORMS, (*work_key, dkdv_form), query_block_form)

        gluon_diff_backward = choose_gluon_diff_dkdv_form(_GLUON_DIFF_DKDV_FORMS, work_key, diff_form)
        return tiered(_DIFF_BWD_TIERS, tier_key, backward, gluon_diff_backward)
    from attn.kernels import gluon_weighted_bwd

    if not gluon_weighted_bwd.serves(q, k, v):
        return backward

    def gluon_grid(persistent, one_pass=False):
        def gluon_backward(dout, q, k, v, q2, k2, lam, bounds, seed):
            return gluon_weighted_bwd.launch_threshold_backward(q, k, v, dout, causal, beta, power,
                                                                persistent=persistent, one_pass=one_pass)
        return gluon_backward

    separate = choose_gluon_backward_grid(_GLUON_BWD_GRIDS, (*tier_key, n_bucket(bsz * heads)), gluon_grid,
                                          "threshold")
    gluon_backward = choose_gluon_weighted_dq_form(_GLUON_DQ_FORMS, (*tier_key, gluon_dq_form()), separate,
                                                   gluon_grid(False, one_pass=True), "threshold")
    return tiered(_BWD_TIERS, tier_key, backward, gluon_backward)


_BWD_PLANS = LaunchPlans(_backward_plan, PLAN_SETTINGS + (GLUON_ENV, GLUON_PERSISTENT_ENV, GLUON_DIFF_DKDV_ENV,
                                                           GLUON_DIFF_DQ_ENV, GLUON_DQ_ENV))
# backwards on sm_90 that the Gluon kernels serve: the portable kernels or the Gluon ones, chosen per tuning
# key for the one-map threshold and for the differential threshold
_BWD_TIERS = TierChoice("threshold_family_bwd")
# the one-map threshold's Gluon backward grid per tuning key under ATTNLAB_GLUON_PERSISTENT=auto
_GLUON_BWD_GRIDS = TimedChoice("gluon threshold backward grid")
# the one-map threshold's Gluon dQ form per tuning key under ATTNLAB_GLUON_DQ=auto, where
# tiers.WEIGHTED_ONE_PASS_OFFERED holds "threshold": "separate" or "one_pass"
_GLUON_DQ_FORMS = TimedChoice("gluon threshold backward dq form")
_DIFF_BWD_TIERS = TierChoice("diff_threshold_bwd")
# the differential threshold's Gluon key-block form per tuning key, among tiers.DIFF_DKDV_FORMS_OFFERED
_GLUON_DIFF_DKDV_FORMS = TimedChoice("gluon diff_threshold backward key-block form")
# its query-block form per tuning key and key-block form, among tiers.DIFF_DQ_FORMS_OFFERED
_GLUON_DIFF_DQ_FORMS = TimedChoice("gluon diff_threshold backward query-block form")
# and its grids (per item, persistent) per tuning key and both forms, once offered
# (tiers.PERSISTENT_BACKWARDS_OFFERED holding "diff_threshold")
_GLUON_DIFF_BWD_GRIDS = TimedChoice("gluon diff_threshold backward grid")


# ----------------------------------------------------------------------------------------
# launcher ops (fakes; autograd by the family's Function) and the public entry point
# ----------------------------------------------------------------------------------------


@kernel_op("threshold_attention")
def threshold_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q2: Optional[torch.Tensor], k2: Optional[torch.Tensor], lam: Optional[torch.Tensor],
    bounds: Optional[torch.Tensor], beta: float, power: float, causal: bool, window: int,
    dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None, key_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fused threshold(-differential) attention forward; q2/k2/lam None -> plain threshold.
    dropout_p > 0: weights dropped with the mask of `seed` (int64 (1,)).
    key_lengths (B,) int32: per-row filled lengths of a static cache (forward only, no backward)."""
    return _forward_impl(q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p, seed, key_lengths)


@torch.library.register_fake(threshold_attention_op, lib=KERNEL_LIBRARY)
def _(q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p=0.0, seed=None, key_lengths=None):
    return q.new_empty(q.shape)


@kernel_op("threshold_attention_backward")
def threshold_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    bounds: Optional[torch.Tensor], beta: float, power: float, causal: bool, window: int,
    dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of plain threshold attention."""
    return _backward_impl(dout, q, k, v, None, None, None, bounds, beta, power, causal, window, dropout_p, seed)


@torch.library.register_fake(threshold_attention_backward_op, lib=KERNEL_LIBRARY)
def _(dout, q, k, v, bounds, beta, power, causal, window, dropout_p=0.0, seed=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@kernel_op("diff_threshold_attention_backward")
def diff_threshold_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q2: torch.Tensor, k2: torch.Tensor, lam: torch.Tensor,
    bounds: Optional[torch.Tensor], beta: float, power: float, causal: bool, window: int,
    dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dq2, dk2, dlam) of differential threshold attention."""
    return _backward_impl(dout, q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p, seed)


@torch.library.register_fake(diff_threshold_attention_backward_op, lib=KERNEL_LIBRARY)
def _(dout, q, k, v, q2, k2, lam, bounds, beta, power, causal, window, dropout_p=0.0, seed=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q2.new_empty(q2.shape), k2.new_empty(k2.shape), lam.new_empty(lam.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, q2, k2, lam, bounds, beta, power, causal, window, *rest = inputs
    # the op's defaults when left out; key_lengths calls are forward only (fused_attention checks)
    dropout_p, seed, _ = tuple(rest) + (0.0, None, None)[len(rest):]
    ctx.save_for_backward(q, k, v, q2, k2, lam, bounds, seed)
    ctx.scalars = (beta, power, causal, window, dropout_p)
    ctx.differential = q2 is not None


_NO_GRADS = (None,) * 8  # bounds, beta, power, causal, window, dropout_p, seed, key_lengths


def _backward(ctx, dout, ops):
    """The op's input gradients (q2, k2, lam: None without the second view), through the backward
    ops (ops) or their impl."""
    q, k, v, q2, k2, lam, bounds, seed = ctx.saved_tensors
    if ctx.differential:
        backward = diff_threshold_attention_backward_op if ops else _backward_impl
        return (*backward(dout, q, k, v, q2, k2, lam, bounds, *ctx.scalars, seed), *_NO_GRADS)
    if ops:
        dq, dk, dv = threshold_attention_backward_op(dout, q, k, v, bounds, *ctx.scalars, seed)
    else:
        dq, dk, dv = _backward_impl(dout, q, k, v, None, None, None, bounds, *ctx.scalars, seed)
    return dq, dk, dv, None, None, None, *_NO_GRADS


# One autograd.Function: eager calls run `_forward_impl` / `_backward_impl` directly (no dispatcher);
# anything traced (torch.compile, export, fake or subclass tensors) runs `attnlab::threshold_attention`
# and its backward ops, whose fakes make the Function traceable.
_ATTENTION = AutogradOp(threshold_attention_op, _forward_impl, _setup_context, _backward,
                        "ThresholdAttentionFunction")


def _second_view(spec: ThresholdFamilySpec, extra) -> tuple:
    """(q2, k2, lam) from the family's `extra` mapping (None each without the second view)."""
    if not isinstance(spec, ThresholdFamilySpec):
        raise ValueError(f"spec must be a ThresholdFamilySpec, got {type(spec).__name__}")
    extra = FAMILY.checked_extra(spec, extra)
    return tuple(extra.get(name) for name in ("q2", "k2", "lam"))


def _op_arguments(q, k, spec: ThresholdFamilySpec, mask: MaskSpec, segment_ids, q2, k2, lam, bounds=None):
    check_kernel_inputs(q, k, kernels="the threshold-family kernels")
    if spec.differential and (q2 is None or k2 is None or lam is None):
        raise ValueError("diff_threshold needs tensors for extra['q2'], extra['k2'] (second view) and "
                         "extra['lam'] (per-head lambda), got None")
    bounds = kernel_segment_bounds(q, k, segment_ids, bounds)
    return bounds, float(spec.beta), float(spec.power), bool(mask.is_causal), int(mask.window or 0)


def fused_attention(q, k, v, spec: ThresholdFamilySpec, mask: MaskSpec, segment_ids=None, temperature=None, *,
                    extra=None, bounds=None, dropout_p: float = 0.0,
                    dropout_seed: Optional[torch.Tensor] = None,
                    key_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Threshold-family attention through the fused kernels: q (B,N,H,D), k/v (B,KV,H_kv,D) -> (B,N,H,D).

    KV >= N keys, aligned bottom-right (query i at key position i + KV - N, attn/masks.py; n_i counts
    the keys visible there); a call with at most `runtime.DECODE_MAX_QUERIES` queries against a long
    key sequence splits the keys across programs (flash-decoding). Segment ids need KV == N.

    `extra`: the family's mapping of extra tensors, with exactly the keys
    `FAMILY.extra_inputs(spec)`: for spec.differential the second view 'q2' (B,N,H,D), 'k2'
    (B,KV,H_kv,D) and the per-head lambda 'lam' (H,); empty (or None) otherwise.
    Differentiable in q, k, v (and the extra tensors); traceable by
    torch.compile(fullgraph=True) through the `attnlab::threshold_attention` custom op.
    `bounds`: `attn.segment_bounds(segment_ids)` computed once per batch by the caller.
    `dropout_p` > 0 drops the (combined) weights with the mask of `dropout_seed` (int64 tensor (1,),
    attn/dropout.py).
    `key_lengths` (B,) int32: k / v (and k2) are a static cache, row b's keys are
    [0, key_lengths[b]) (`attn.attention`); forward only.
    """
    if temperature is not None:
        raise ValueError("temperature is only defined for the softmax family; got one for a threshold variant")
    q2, k2, lam = _second_view(spec, extra)
    if key_lengths is not None:
        check_key_lengths(key_lengths, q, k, segment_ids=segment_ids, bounds=bounds, dropout_p=dropout_p,
                          tensors=(v, q2, k2, lam))
    bounds, beta, power, causal, window = _op_arguments(q, k, spec, mask, segment_ids, q2, k2, lam, bounds)
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (attn.dropout.draw_seed)")
    drop = (float(dropout_p), dropout_seed if dropout_p > 0.0 else None)
    args = (q, k, v, q2, k2, lam, bounds, beta, power, causal, window, *drop)
    if key_lengths is not None:  # forward only: no autograd node
        return _ATTENTION.inference((*args, key_lengths), (q, k, v, q2, k2, lam))
    return _ATTENTION(args, (q, k, v, q2, k2, lam))


def zero_fraction(q, k, spec: ThresholdFamilySpec, mask: MaskSpec, segment_ids=None, *, extra=None) -> torch.Tensor:
    """Per head fraction (H,) float64 of visible (i, j) whose weight w_ij is exactly zero; `extra`
    as in `fused_attention`.

    Counted by a Triton kernel tile by tile (no N x N tensor; same masks and tile skipping
    as the forward). A weight counts as zero when it is zero in the operands' dtype, i.e.
    when it drops out of the w.V product. Matches `attn.reference.exact_zero_fraction` up to
    scores that round across the threshold. No gradient.
    """
    q2, k2, lam = _second_view(spec, extra)
    bounds, beta, power, causal, window = _op_arguments(q, k, spec, mask, segment_ids, q2, k2, lam)
    bsz, n, heads, d = q.shape
    if k.shape[1] != n:
        raise ValueError(f"zero_fraction needs queries and keys of one length, got {n} queries and {k.shape[1]} keys")
    differential = q2 is not None
    if n == 0 or bsz == 0:
        return torch.zeros(heads, dtype=torch.float64, device=q.device)
    if interpreting():
        block_m, block_n = INTERPRETER_CONFIG["zeros"]
        warps = 4
    else:
        block_m, block_n, warps = 64, 64, 4
    n_blocks = cdiv(n, block_m)
    zeros = torch.empty((bsz, heads, n_blocks), device=q.device, dtype=torch.int32)
    with torch.no_grad():
        _zero_count_kernel[(n_blocks, bsz * heads)](
            q, k, q2 if differential else q, k2 if differential else k, lam if differential else q,
            bounds if bounds is not None else q, zeros,
            *q.stride(), *k.stride(), *_strides(q2, q), *_strides(k2, k), lam.stride(0) if differential else 0,
            n, heads, heads // k.shape[2], window, _tau_scale(beta, d), power,
            **_meta(q, k, power, causal, window, bounds is not None, differential),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )
        visible = visible_key_counts(mask, n, segment_ids, device=q.device).double().expand(bsz, n).sum()
        return zeros.sum(dim=(0, 2)).double() / visible.clamp_min(1.0)


__all__ = ["fused_attention", "zero_fraction", "threshold_attention_op", "GPU_CONFIGS", "SUPPORTED_HEAD_DIMS"]
