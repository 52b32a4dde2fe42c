"""Fused Triton kernels of the sigmoid family (DESIGN.md §4): forward and exact backward.

    w_ij = sigmoid(z_ij),  z_ij = s q_i.k_j + b_i,  out_i = sum_j w_ij v_j over visible keys j
    b_i = the spec's bias, or -ln(n_i) (n_i: keys query i sees, `tiles.visible_counts`)

Nothing is normalized, so the forward saves no row statistics and the backward needs no
preprocessing pass (no logsumexp, no delta):

    dv_j = sum_i w_ij dout_i        dp_ij = dout_i . v_j        dz_ij = dp_ij w_ij (1 - w_ij)
    dq_i = s sum_j dz_ij k_j        dk_j  = s sum_i dz_ij q_i

The bias is a constant (a config float or a function of the mask): it takes no gradient. The
kernels work in base 2: z log2(e) = (s log2 e) q.k + b_i log2 e, w = 1 / (1 + 2^-(z log2 e)), which
is exactly 1 where 2^x underflows, 0 where it overflows (the newton path: at most 2^-126), never NaN
but for a NaN score.

Evaluating w (`_sigmoid2`; ATTNLAB_SIGMOID_PATH picks the path at each launch, `sigmoid_path`):

    mufu         1 / (1 + tl.exp2(x)), x = -z log2 e        2 MUFU ops (ex2, rcp) + fix-ups
    mufu_approx  ex2.approx.ftz, rcp.approx.ftz (PTX)       2 MUFU ops, no fix-ups
    newton       MUFU ex2, the reciprocal by Newton steps    1 MUFU op
    poly         2^x by a polynomial, MUFU rcp               1 MUFU op

(attn/kernels/fast_math.py). Default ("auto"), 16-bit inputs on a GPU: newton in the forward,
mufu_approx in the dq and dk/dv kernels; fp32 inputs and the interpreter: mufu. Per score of
the unmasked tile loop (ptxas, sm_90, default tiles at D = 128), instructions issued / MUFU ops:

    forward  mufu 12.3 / 2   mufu_approx 8.3 / 2   newton 13.3 / 1   poly 16.3 / 1
    dq       16.2 / 2        12.2 / 2              17.2 / 1          20.2 / 1
    dk/dv    33.8 / 2        29.8 / 2              34.7 / 1          37.8 / 1

An SM sub-partition issues one instruction per clock and finishes a MUFU op for a warp in 8, so
2 MUFU ops cost 16 clocks per 32 scores and bound the forward; newton takes it to 13.3. The dq and
dk/dv kernels issue more per score than the MUFU ops cost: there the fewest instructions win.
Accuracy follows the input dtype (`NEWTON_STEPS`, `EXP2_POLY_DEGREE`): relative errors of w and
1 - w at most 5e-4 for bf16, 3e-6 for fp16 (below half the spacing of the 16-bit w and dz each
product rounds them to) and ~1e-7 for fp32. The CPU tests run every path but mufu_approx (PTX).

Dropout (attn/dropout.py; the constexpr DROPOUT, compiled out at p = 0): w becomes m w / (1 - p)
with m the keep mask (attn/kernels/dropout.py, regenerated in the backward); dv uses that weight
and dp_ij becomes m_ij dp_ij / (1 - p) in dz.

Masks, tile skipping and the full / boundary tile walk come from `attn/kernels/tiles.py`, as in
the threshold family's kernels: one forward kernel (with the split-key decode form), one dq kernel
(query-block programs) and one dk/dv kernel (key-block programs looping over the kv head's query
heads: GQA without repeated K/V or atomics). Inputs are read through their strides in their own
dtype with fp32 accumulation; fp32 inputs use IEEE fp32 products (no tf32).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn.kernels.dropout import dropout_keep, load_seed, seed_operand
from attn.kernels.env import interpreting, setting
from attn.kernels.fast_math import ex2, exp2_parts, rcp, rcp_newton
from attn.kernels.runtime import (KERNEL_LIBRARY, PLAN_SETTINGS, AutogradOp, ConfigTable, Kernel, LaunchPlans,
                                  TileConfig, cdiv, contiguous_strides, decode_config, decode_splits, dot_precision,
                                  kernel_op, n_bucket)
from attn.kernels.runtime import tuned_configs as _tuned_configs
from attn.kernels.splits import sum_key_splits
from attn.kernels.tiers import (GLUON_DQ_ENV, GLUON_ENV, GLUON_PERSISTENT_ENV, GLUON_SCHEDULE_ENV, TierChoice,
                                TimedChoice, choose_gluon_backward_grid, choose_gluon_grid,
                                choose_gluon_weighted_dq_form, gluon_candidate, gluon_dq_form, gluon_pingpong, tiered)
from attn.kernels.tiles import (clip_to_key_split, full_key_span_all_rows, full_query_span_all_rows, head_tile_ptrs,
                                key_block_program, key_ranges, load_tile, mask_and_drop, masked_tile, masked_tile_count,
                                query_block_program, query_row_ranges, tile_visible_in_query_range, visible_counts)
from attn.families.sigmoid import FAMILY
from attn.masks import MaskSpec
from attn.specs import SigmoidFamilySpec
from attn.validation import KERNEL_HEAD_DIMS, check_kernel_inputs, check_key_lengths, kernel_segment_bounds

SUPPORTED_HEAD_DIMS = KERNEL_HEAD_DIMS
LOG2E = 1.4426950408889634
# the sigmoid's evaluation path (module docstring): "auto" (default) or one path for every kernel
# and dtype (mufu_approx, newton and poly use the approx PTX forms only for 16-bit inputs on a GPU).
# Read at every launch.
PATH_ENV = "ATTNLAB_SIGMOID_PATH"
PATHS = ("auto", "mufu", "mufu_approx", "newton", "poly")
# per input dtype: Newton steps of the reciprocal, degree of the polynomial 2^f (errors:
# attn/kernels/fast_math.py)
NEWTON_STEPS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 3}
EXP2_POLY_DEGREE = {torch.bfloat16: 3, torch.float16: 4, torch.float32: 6}

# ----------------------------------------------------------------------------------------
# elementwise pieces
# ----------------------------------------------------------------------------------------


@triton.jit
def _row_bias(pos_m, kv_len, window, hs, he, cs, ce, bias2,
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    """b_i log2(e) per query position (fp32): the spec's bias (bias2 = bias log2 e), or -log2(n_i)
    (n_i = 0, a row that sees nothing: 0)."""
    if HAS_BIAS:
        b = tl.zeros_like(pos_m).to(tl.float32) + bias2
    else:
        n_i = visible_counts(pos_m, kv_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        b = -tl.log2(tl.maximum(n_i, 1.0))
    return b


@triton.jit
def _sigmoid2(x, NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr):
    """sigmoid(z) = 1 / (1 + 2^x) from x = -z log2(e), in fp32 (the callers form x with one FMA, the
    negation folded in); NaN for NaN, w = 1 exactly for x <= -25. NEWTON > 0: MUFU ex2, the
    reciprocal by NEWTON steps (x clamped at 126: w = 2^-126 at and above it); EXP2_POLY > 0: 2^x by
    the polynomial of that degree (1 + p s as one FMA), MUFU rcp; neither: MUFU ex2 and rcp.
    FAST_MUFU: the MUFU ops as approx PTX, else tl.exp2 and a division. From x = 128 on the last two
    give w = 0."""
    if NEWTON > 0:
        x = tl.minimum(x, 126.0, propagate_nan=tl.PropagateNan.ALL)
        return rcp_newton(1.0 + ex2(x, FAST_MUFU), NEWTON)
    elif EXP2_POLY > 0:
        p, s = exp2_parts(x, EXP2_POLY)
        return rcp(p * s + 1.0, FAST_MUFU)
    else:
        return rcp(1.0 + ex2(x, FAST_MUFU), FAST_MUFU)


# ----------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------


@triton.jit
def _fwd_tile(acc, q, row_bias, k_base, v_base, skn, skd, svn, svd,
              offs_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, qk_scale2,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PREC: tl.constexpr,
              seed, bh, dropout_p, DROPOUT: tl.constexpr,
              NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr):
    """acc += w(q, keys [n0, n0 + BLOCK_N)) . v; MASKED tiles keep keys in [key_lo, key_hi)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, offs_n, offs_d, skn, skd, kv_len, MASKED)
    v = load_tile(v_base, offs_n, offs_d, svn, svd, kv_len, MASKED)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * -qk_scale2 - row_bias[:, None]
    w = _sigmoid2(x, NEWTON, EXP2_POLY, FAST_MUFU)
    w = mask_and_drop(w, offs_m, offs_n, key_lo, key_hi, kv_len, window, hs, he, cs, ce, seed, bh, dropout_p,
                      MASKED, CAUSAL, HAS_WINDOW, HAS_SEG, DROPOUT)
    return tl.dot(w.to(v.dtype), v, acc, input_precision=DOT_PREC)


# Scalars that vary with the problem size are not specialized on (value 1 / divisibility by 16), so
# one compiled kernel serves every N, head count, GQA ratio and window.
_RUNTIME_SCALARS = ["q_len", "kv_len", "num_heads", "group", "window", "N_BUCKET"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS + ["split_len"])
def _fwd_kernel(
    Q, K, V, BOUNDS, OUT, SEED, LENS,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sob, son, soh, sod, sos,
    q_len, kv_len, num_heads, group, window, split_len, qk_scale2, bias2, N_BUCKET, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
    DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr, SPLIT_KV: tl.constexpr, HAS_LENS: tl.constexpr,
    NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr,
):
    """Query rows [m0, m0 + BLOCK_M) of one (batch, head); query row i sits at key position
    i + kv_len - q_len (bottom-right alignment). SPLIT_KV (flash-decoding): program_id(2) = s takes
    keys [s split_len, (s+1) split_len) and writes its fp32 partial sum at OUT + s sos (the launcher
    sums them). HAS_LENS: row b's keys are [0, LENS[b]) of a static cache of kv_len slots."""
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
    row_bias = _row_bias(pos_m, kv_len, window, hs, he, cs, ce, bias2, HAS_BIAS, CAUSAL, HAS_WINDOW, HAS_SEG)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, hi, lo2, hi2 = key_ranges(p0, kv_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    lo, hi = clip_to_key_split(lo, hi, split, split_len, SPLIT_KV)
    a, z = full_key_span_all_rows(p0, lo, hi, kv_len, window, hs, he, cs, ce, BLOCK_M, BLOCK_N,
                                  CAUSAL, HAS_WINDOW, HAS_SEG)
    for n0 in range(a, z, BLOCK_N):
        acc = _fwd_tile(acc, q, row_bias, k_base, v_base, skn, skd, svn, svd,
                        pos_m, n0, lo, hi, kv_len, window, hs, he, cs, ce, qk_scale2,
                        HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                        NEWTON, EXP2_POLY, FAST_MUFU)
    for t in range(0, masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK_N)):
        n0, key_lo, key_hi = masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK_N)
        acc = _fwd_tile(acc, q, row_bias, k_base, v_base, skn, skd, svn, svd,
                        pos_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, qk_scale2,
                        HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                        NEWTON, EXP2_POLY, FAST_MUFU)
    tl.store(head_tile_ptrs(OUT + split * sos, b64, h, offs_m, offs_d, sob, son, soh, sod),
             acc.to(OUT.dtype.element_ty), mask=row_ok)


# ----------------------------------------------------------------------------------------
# backward: dq (query-block programs, the forward's key ranges)
# ----------------------------------------------------------------------------------------


@triton.jit
def _dq_tile(dq, q, do, row_bias, k_base, v_base, skn, skd, svn, svd,
             offs_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, qk_scale2,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PREC: tl.constexpr,
             seed, bh, dropout_p, DROPOUT: tl.constexpr,
             NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr):
    """dq += dz . k (the factor s is applied once, at the store)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, offs_n, offs_d, skn, skd, kv_len, MASKED)
    v = load_tile(v_base, offs_n, offs_d, svn, svd, kv_len, MASKED)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * -qk_scale2 - row_bias[:, None]
    w = _sigmoid2(x, NEWTON, EXP2_POLY, FAST_MUFU)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    # under dropout d(m w / (1 - p)) / dw
    dp = mask_and_drop(dp, offs_m, offs_n, key_lo, key_hi, kv_len, window, hs, he, cs, ce, seed, bh, dropout_p,
                       MASKED, CAUSAL, HAS_WINDOW, HAS_SEG, DROPOUT)
    dz = dp * (w * (1.0 - w))
    return tl.dot(dz.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _dq_kernel(
    Q, K, V, BOUNDS, DO, DQ, SEED,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sdob, sdon, sdoh, sdod,
    q_len, kv_len, num_heads, group, window, qk_scale2, bias2, sm_scale, N_BUCKET, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
    DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr,
    NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr,
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
    row_bias = _row_bias(pos_m, kv_len, window, hs, he, cs, ce, bias2, HAS_BIAS, CAUSAL, HAS_WINDOW, HAS_SEG)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, hi, lo2, hi2 = key_ranges(p0, kv_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    a, z = full_key_span_all_rows(p0, lo, hi, kv_len, window, hs, he, cs, ce, BLOCK_M, BLOCK_N,
                                  CAUSAL, HAS_WINDOW, HAS_SEG)
    for n0 in range(a, z, BLOCK_N):
        dq = _dq_tile(dq, q, do, row_bias, k_base, v_base, skn, skd, svn, svd,
                      pos_m, n0, lo, hi, kv_len, window, hs, he, cs, ce, qk_scale2,
                      HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                      NEWTON, EXP2_POLY, FAST_MUFU)
    for t in range(0, masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK_N)):
        n0, key_lo, key_hi = masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK_N)
        dq = _dq_tile(dq, q, do, row_bias, k_base, v_base, skn, skd, svn, svd,
                      pos_m, n0, key_lo, key_hi, kv_len, window, hs, he, cs, ce, qk_scale2,
                      HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                      NEWTON, EXP2_POLY, FAST_MUFU)
    # dq is a contiguous (B, N, H, D) allocation of the launcher
    out_offs = b64 * q_len * num_heads * HEAD_DIM + offs_m[:, None] * (num_heads * HEAD_DIM) + h * HEAD_DIM
    tl.store(DQ + out_offs + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok)


# ----------------------------------------------------------------------------------------
# backward: dk, dv (key-block programs over the query ranges)
# ----------------------------------------------------------------------------------------


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, sqn, sqd, sdon, sdod,
               offs_n, m0, q_lo, q_hi, kv_len, window, hs, he, cs, ce, qk_scale2, bias2,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_BIAS: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PREC: tl.constexpr,
               seed, bh, dropout_p, DROPOUT: tl.constexpr,
               NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr):
    """One query tile at key positions [m0, m0 + BLOCK_M) against this program's keys (q_base and
    do_base are indexed by key position); MASKED tiles keep queries in [q_lo, q_hi). Tiles are held
    transposed, (keys, queries), so dk and dv accumulate without transposes (s applied at the store)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = load_tile(q_base, offs_m, offs_d, sqn, sqd, kv_len, MASKED)
    do = load_tile(do_base, offs_m, offs_d, sdon, sdod, kv_len, MASKED)
    row_bias = _row_bias(offs_m, kv_len, window, hs, he, cs, ce, bias2, HAS_BIAS, CAUSAL, HAS_WINDOW, HAS_SEG)
    xT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * -qk_scale2 - row_bias[None, :]
    wT = _sigmoid2(xT, NEWTON, EXP2_POLY, FAST_MUFU)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    if MASKED:
        vis = tile_visible_in_query_range(offs_m, offs_n, q_lo, q_hi, kv_len, window, hs, he, cs, ce,
                                          CAUSAL, HAS_WINDOW, HAS_SEG)
        visT = tl.trans(vis)
        dpT = tl.where(visT, dpT, 0.0)
    dzT = dpT * (wT * (1.0 - wT))
    if MASKED:
        wT = tl.where(visT, wT, 0.0)
    if DROPOUT:  # one keep mask m: dv += (m w / (1 - p))^T do, dp -> m dp / (1 - p)
        keepT = dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], kv_len, dropout_p)
        wT = tl.where(keepT, wT * (1.0 / (1.0 - dropout_p)), 0.0)
        dzT = tl.where(keepT, dzT * (1.0 / (1.0 - dropout_p)), 0.0)
    dv = tl.dot(wT.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dk = tl.dot(dzT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _dkdv_kernel(
    Q, K, V, BOUNDS, DO, DK, DV, SEED,
    sqb, sqn, sqh, sqd, skb, skn, skh, skd, svb, svn, svh, svd,
    sdob, sdon, sdoh, sdod,
    q_len, kv_len, num_heads, group, window, qk_scale2, bias2, sm_scale, N_BUCKET, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr,
    DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr,
    NEWTON: tl.constexpr, EXP2_POLY: tl.constexpr, FAST_MUFU: tl.constexpr,
):
    num_kv_heads = num_heads // group
    b, hk, n0, offs_n, hs, he, cs, ce = key_block_program(BOUNDS, num_kv_heads, BLOCK_N, HAS_SEG)
    b64 = b.to(tl.int64)
    seed = load_seed(SEED, DROPOUT)

    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n[:, None] < kv_len
    k = tl.load(head_tile_ptrs(K, b64, hk, offs_n, offs_d, skb, skn, skh, skd), mask=key_ok, other=0.0)
    v = tl.load(head_tile_ptrs(V, b64, hk, offs_n, offs_d, svb, svn, svh, svd), mask=key_ok, other=0.0)

    # query row i sits at key position i + pos_offset (bottom-right alignment): the loops run over
    # positions, and the query-indexed pointers are shifted by -pos_offset rows to match
    pos_offset = kv_len - q_len
    lo, hi, lo2, hi2 = query_row_ranges(n0, pos_offset, kv_len, window, hs, he, cs, ce, BLOCK_N, CAUSAL, HAS_WINDOW,
                                        HAS_SEG)
    a, z = full_query_span_all_rows(n0, lo, hi, kv_len, window, hs, he, cs, ce, BLOCK_M, BLOCK_N,
                                    CAUSAL, HAS_WINDOW, HAS_SEG)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # GQA: this kv head's query heads, one after another (no repeated K/V, no atomics)
    for h in range(hk * group, hk * group + group):
        bh = b * num_heads + h
        q_base = Q + b64 * sqb + h * sqh - pos_offset * sqn
        do_base = DO + b64 * sdob + h * sdoh - pos_offset * sdon
        for m0 in range(a, z, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, sqn, sqd, sdon, sdod,
                                offs_n, m0, lo, hi, kv_len, window, hs, he, cs, ce, qk_scale2, bias2,
                                HEAD_DIM, BLOCK_M, False, HAS_BIAS, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC,
                                seed, bh, dropout_p, DROPOUT,
                                NEWTON, EXP2_POLY, FAST_MUFU)
        for t in range(0, masked_tile_count(lo, a, z, hi, lo2, hi2, BLOCK_M)):
            m0, q_lo, q_hi = masked_tile(t, lo, a, z, hi, lo2, hi2, BLOCK_M)
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, sqn, sqd, sdon, sdod,
                                offs_n, m0, q_lo, q_hi, kv_len, window, hs, he, cs, ce, qk_scale2, bias2,
                                HEAD_DIM, BLOCK_M, True, HAS_BIAS, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC,
                                seed, bh, dropout_p, DROPOUT,
                                NEWTON, EXP2_POLY, FAST_MUFU)
    # dk / dv are contiguous (B, KV, H_kv, D) allocations of the launcher
    out_offs = b64 * kv_len * num_kv_heads * HEAD_DIM + offs_n[:, None] * (num_kv_heads * HEAD_DIM) + hk * HEAD_DIM
    tl.store(DK + out_offs + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out_offs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)


# ----------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------


# GPU candidates per (kernel, head dim); the first is the pinned default. The threshold family's
# plain-variant tables (same operands and accumulators per tile, attn/kernels/threshold_family.py)
# with its small 4-warp tiles as further candidates, not yet swept for sigmoid.
GPU_CONFIGS = {
    ("fwd", 128): [TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3),
                   TileConfig(64, 32, 4, 3)],
    ("fwd", 64): [TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3)],
    ("dq", 128): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 2)],
    ("dq", 64): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)],
    ("dkdv", 128): [TileConfig(32, 128, 8, 3), TileConfig(64, 128, 8, 3), TileConfig(32, 64, 4, 3),
                    TileConfig(64, 64, 4, 2)],
    ("dkdv", 64): [TileConfig(64, 128, 8, 3), TileConfig(32, 128, 8, 3), TileConfig(32, 64, 4, 3)],
}
_DEFAULT_CONFIGS = [TileConfig(64, 64, 4, 2)]  # head dims without a table (16, 32)
# the interpreter (CPU tests): small tiles keep it fast and still exercise the masked / unmasked
# split; tests may override this table
INTERPRETER_CONFIG = {"fwd": (16, 16), "dq": (16, 16), "dkdv": (16, 16)}
CONFIG_TABLE = ConfigTable(GPU_CONFIGS, INTERPRETER_CONFIG, default=_DEFAULT_CONFIGS)

# Tuning is keyed on dtype, bucketed lengths and every constexpr (attn/kernels/runtime.py).
_KERNELS = {"fwd": Kernel(_fwd_kernel, "sigmoid_fwd"), "dq": Kernel(_dq_kernel, "sigmoid_dq"),
            "dkdv": Kernel(_dkdv_kernel, "sigmoid_dkdv")}


def _launch_settings(kind: str, meta: dict, buckets: tuple, dtype) -> tuple:
    """(configs, tuning key) of kernel `kind`: candidates per head dim; keys: dtype, the (query, key)
    length buckets and every constexpr."""
    return CONFIG_TABLE.candidates(kind, meta["HEAD_DIM"]), (dtype, buckets, *meta.values())


def tuned_configs() -> dict[str, str]:
    """The configs tuning chose so far, readable (for benchmark reports)."""
    return {**_tuned_configs(_KERNELS.values()), **_TIERS.report(), **_BWD_TIERS.report(), **_GLUON_GRIDS.report(),
            **_GLUON_BWD_GRIDS.report()}


def _strides(q, k, v):
    return (*q.stride(), *k.stride(), *v.stride())


def sigmoid_path(dtype: torch.dtype, forward: bool) -> dict:
    """The constexprs NEWTON (steps, 0: off), EXP2_POLY (degree, 0: off) and FAST_MUFU of a launch of
    the forward (or of a backward kernel) on inputs of `dtype`, by ATTNLAB_SIGMOID_PATH (module
    docstring). Launches outside the interpreter run on a GPU: the PTX forms need no device check."""
    path = setting(PATH_ENV, "auto")
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    gpu_16bit = dtype != torch.float32 and not interpreting()
    if path == "auto":
        path = ("newton" if forward else "mufu_approx") if gpu_16bit else "mufu"
    return {"NEWTON": NEWTON_STEPS[dtype] if path == "newton" else 0,
            "EXP2_POLY": EXP2_POLY_DEGREE[dtype] if path == "poly" else 0,
            "FAST_MUFU": gpu_16bit and path != "mufu"}


def _meta(q, bias, causal, window, has_bounds: bool, forward: bool):
    return dict(
        HEAD_DIM=q.shape[-1],
        HAS_BIAS=bias is not None,
        CAUSAL=bool(causal or window > 0),
        HAS_WINDOW=window > 0,
        HAS_SEG=has_bounds,
        DOT_PREC=dot_precision(q.dtype),
        **sigmoid_path(q.dtype, forward),
    )


def _scales(sm_scale: float, bias: Optional[float]):
    """(s log2 e, bias log2 e or 0): the kernels' base-2 logit scale and fixed bias."""
    return sm_scale * LOG2E, (bias * LOG2E if bias is not None else 0.0)


def _signature(q, k, v, bounds, bias, sm_scale, causal, window, dropout_p) -> tuple:
    """What a call's launch plan follows from (LaunchPlans)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, bounds is not None, bias,
            sm_scale, causal, window, dropout_p)


def _forward_impl(q, k, v, bounds, bias, sm_scale, causal, window, dropout_p=0.0, seed=None, key_lengths=None):
    """The forward's output; with `key_lengths` (B,) int32 the launches depend on the capacity
    k.shape[1] only, and the kernel reads each row's length on the device."""
    signature = (_signature(q, k, v, bounds, bias, sm_scale, causal, window, dropout_p), key_lengths is not None)
    plan = _FWD_PLANS.get(signature, q, k, v, bounds is not None, bias, sm_scale, causal, window, dropout_p,
                          key_lengths is not None)
    return plan(q, k, v, bounds, seed, key_lengths)


def _forward_plan(q, k, v, has_bounds, bias, sm_scale, causal, window, dropout_p, has_lens):
    """The forward's launches for one signature: (q, k, v, bounds, seed, key_lengths) -> out."""
    bsz, n, heads, d = q.shape
    kv_len = k.shape[1]
    group = heads // k.shape[2]
    out_shape = (bsz, n, heads, d)
    if n == 0 or bsz == 0:
        return lambda q, *rest: torch.empty(out_shape, device=q.device, dtype=q.dtype)
    meta = {**_meta(q, bias, causal, window, has_bounds, True), "DROPOUT": dropout_p > 0.0, "HAS_LENS": has_lens}
    qk_scale2, bias2 = _scales(sm_scale, bias)
    scalars = (n, kv_len, heads, group, window, kv_len, qk_scale2, bias2, n_bucket(kv_len), float(dropout_p))
    splits = 1
    if not has_bounds and dropout_p == 0.0:
        splits = decode_splits(n, kv_len, bsz * heads, decode_config().block_n, q.device)
    if splits > 1:
        # flash-decoding: each split sums its key range into fp32 partials; no row max or normalizer,
        # so the merge is a plain sum (a split past a row's key length adds its zeros)
        cfg = decode_config()
        split_len = cdiv(cdiv(kv_len, splits), cfg.block_n) * cfg.block_n
        splits = cdiv(kv_len, split_len)
        part_shape = (splits, bsz, n, heads, d)
        part_strides = contiguous_strides(part_shape)
        split_scalars = (*_strides(q, k, v), *part_strides[1:], part_strides[0], n, kv_len, heads, group, window,
                         split_len, *scalars[6:])
        split_meta = {**meta, "SPLIT_KV": True}
        split_grid = (lambda c: (cdiv(n, c.block_m), bsz * heads, splits))

        def split_forward(q, k, v, bounds, seed, key_lengths):
            part = torch.empty(part_shape, device=q.device, dtype=torch.float32)
            _KERNELS["fwd"].launch(split_grid, (q, k, v, bounds if has_bounds else q, part, q,
                                                key_lengths if has_lens else q),
                                   split_scalars, split_meta, [cfg], ())
            return sum_key_splits(part, torch.empty(out_shape, device=q.device, dtype=q.dtype))
        return split_forward

    full_scalars = (*_strides(q, k, v), *contiguous_strides(out_shape), 0, *scalars)
    full_meta = {**meta, "SPLIT_KV": False}
    configs, tune_key = _launch_settings("fwd", full_meta, (n_bucket(n), n_bucket(kv_len)), q.dtype)
    grid = (lambda cfg: (cdiv(n, cfg.block_m), bsz * heads))

    def forward(q, k, v, bounds, seed, key_lengths):
        out = torch.empty(out_shape, device=q.device, dtype=q.dtype)
        _KERNELS["fwd"].launch(grid, (q, k, v, bounds if has_bounds else q, out, seed_operand(dropout_p, seed, q),
                                      key_lengths if has_lens else q),  # q: never read
                               full_scalars, full_meta, configs, tune_key)
        return out

    # the Gluon forward serves calls without segments, key lengths, a window or dropout
    if has_bounds or has_lens or window or dropout_p or not gluon_candidate(q.device):
        return forward
    from attn.kernels import gluon_weighted_fwd

    if not gluon_weighted_fwd.serves(q, k, v):
        return forward

    pingpong = gluon_pingpong()

    def gluon_grid(persistent):
        def gluon_forward(q, k, v, bounds, seed, key_lengths):
            return gluon_weighted_fwd.launch_sigmoid(q, k, v, causal, sm_scale, bias, pingpong=pingpong,
                                                     persistent=persistent)
        return gluon_forward

    gluon_forward = choose_gluon_grid(_GLUON_GRIDS, (*tune_key, n_bucket(bsz * heads)), gluon_grid, pingpong)
    return tiered(_TIERS, tune_key, forward, gluon_forward)


def _backward_impl(dout, q, k, v, bounds, bias, sm_scale, causal, window, dropout_p=0.0, seed=None):
    signature = (_signature(q, k, v, bounds, bias, sm_scale, causal, window, dropout_p), dout.stride())
    plan = _BWD_PLANS.get(signature, dout, q, k, v, bounds is not None, bias, sm_scale, causal, window, dropout_p)
    return plan(dout, q, k, v, bounds, seed)


def _backward_plan(dout, q, k, v, has_bounds, bias, sm_scale, causal, window, dropout_p):
    """The backward's launches for one signature: (dout, q, k, v, bounds, seed) -> (dq, dk, dv)."""
    bsz, n, heads, d = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q_shape, k_shape = (bsz, n, heads, d), (bsz, kv_len, kv_heads, d)
    if n == 0 or bsz == 0:
        def no_queries(dout, q, k, v, bounds, seed):
            return (torch.empty(q_shape, device=q.device, dtype=q.dtype),
                    torch.zeros(k_shape, device=q.device, dtype=k.dtype),
                    torch.zeros(k_shape, device=q.device, dtype=v.dtype))
        return no_queries
    meta = {**_meta(q, bias, causal, window, has_bounds, False), "DROPOUT": dropout_p > 0.0}
    qk_scale2, bias2 = _scales(sm_scale, bias)
    scalars = (*_strides(q, k, v), *dout.stride(), n, kv_len, heads, group, window, qk_scale2, bias2,
               float(sm_scale), n_bucket(kv_len), float(dropout_p))
    buckets = (n_bucket(n), n_bucket(kv_len))
    dq_configs, dq_key = _launch_settings("dq", meta, buckets, q.dtype)
    dkdv_configs, dkdv_key = _launch_settings("dkdv", meta, buckets, q.dtype)
    query_grid = (lambda cfg: (cdiv(n, cfg.block_m), bsz * heads))
    key_grid = (lambda cfg: (cdiv(kv_len, cfg.block_n), bsz * kv_heads))

    def backward(dout, q, k, v, bounds, seed):
        dq = torch.empty(q_shape, device=q.device, dtype=q.dtype)
        dk = torch.empty(k_shape, device=q.device, dtype=k.dtype)
        dv = torch.empty(k_shape, device=q.device, dtype=v.dtype)
        ops = (q, k, v, bounds if has_bounds else q)
        seed_arg = seed_operand(dropout_p, seed, q)
        _KERNELS["dq"].launch(query_grid, (*ops, dout, dq, seed_arg), scalars, meta, dq_configs, dq_key)
        _KERNELS["dkdv"].launch(key_grid, (*ops, dout, dk, dv, seed_arg), scalars, meta, dkdv_configs, dkdv_key)
        return dq, dk, dv

    # the Gluon backward serves calls without segments, a window or dropout
    if has_bounds or window or dropout_p or kv_len < n or not sm_scale > 0 or not gluon_candidate(q.device):
        return backward
    from attn.kernels import gluon_weighted_bwd

    if not gluon_weighted_bwd.serves(q, k, v):
        return backward

    def gluon_grid(persistent, one_pass=False):
        def gluon_backward(dout, q, k, v, bounds, seed):
            return gluon_weighted_bwd.launch_sigmoid_backward(q, k, v, dout, causal, sm_scale, bias,
                                                              persistent=persistent, one_pass=one_pass)
        return gluon_backward

    tier_key = (q.dtype, *buckets, group, d, causal, bias is None)
    separate = choose_gluon_backward_grid(_GLUON_BWD_GRIDS, (*tier_key, n_bucket(bsz * heads)), gluon_grid,
                                          "sigmoid")
    gluon_backward = choose_gluon_weighted_dq_form(_GLUON_DQ_FORMS, (*tier_key, gluon_dq_form()), separate,
                                                   gluon_grid(False, one_pass=True), "sigmoid")
    return tiered(_BWD_TIERS, tier_key, backward, gluon_backward)


_FWD_PLANS = LaunchPlans(_forward_plan, PLAN_SETTINGS + (PATH_ENV, GLUON_ENV, GLUON_SCHEDULE_ENV,
                                                          GLUON_PERSISTENT_ENV))
# sigmoid forwards on sm_90 that the Gluon kernel serves: the portable kernel or the Gluon one
# (attn/kernels/tiers.py)
_TIERS = TierChoice("sigmoid_family_fwd")
# the Gluon forward's grid per tuning key under ATTNLAB_GLUON_PERSISTENT=auto: "per_item" or "persistent"
_GLUON_GRIDS = TimedChoice("gluon sigmoid forward grid")
_BWD_PLANS = LaunchPlans(_backward_plan, PLAN_SETTINGS + (PATH_ENV, GLUON_ENV, GLUON_PERSISTENT_ENV, GLUON_DQ_ENV))
# sigmoid backwards on sm_90 that the Gluon kernels serve: the portable kernels or the Gluon ones
_BWD_TIERS = TierChoice("sigmoid_family_bwd")
# the Gluon backward's grid per tuning key under ATTNLAB_GLUON_PERSISTENT=auto
_GLUON_BWD_GRIDS = TimedChoice("gluon sigmoid backward grid")
# the sigmoid's Gluon dQ form per tuning key under ATTNLAB_GLUON_DQ=auto, where tiers.WEIGHTED_ONE_PASS_OFFERED
# holds "sigmoid": "separate" or "one_pass"
_GLUON_DQ_FORMS = TimedChoice("gluon sigmoid backward dq form")


# ----------------------------------------------------------------------------------------
# launcher ops (fakes; autograd by the family's Function) and the public entry point
# ----------------------------------------------------------------------------------------


@kernel_op("sigmoid_attention")
def sigmoid_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Optional[torch.Tensor],
    bias: Optional[float], sm_scale: float, causal: bool, window: int,
    dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None, key_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fused sigmoid attention forward; bias None -> b_i = -ln(n_i). dropout_p > 0: weights dropped
    with the mask of `seed` (int64 (1,)). key_lengths (B,) int32: per-row filled lengths of a static
    cache (forward only)."""
    return _forward_impl(q, k, v, bounds, bias, sm_scale, causal, window, dropout_p, seed, key_lengths)


@torch.library.register_fake(sigmoid_attention_op, lib=KERNEL_LIBRARY)
def _(q, k, v, bounds, bias, sm_scale, causal, window, dropout_p=0.0, seed=None, key_lengths=None):
    return q.new_empty(q.shape)


@kernel_op("sigmoid_attention_backward")
def sigmoid_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Optional[torch.Tensor],
    bias: Optional[float], sm_scale: float, causal: bool, window: int,
    dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of sigmoid attention."""
    return _backward_impl(dout, q, k, v, bounds, bias, sm_scale, causal, window, dropout_p, seed)


@torch.library.register_fake(sigmoid_attention_backward_op, lib=KERNEL_LIBRARY)
def _(dout, q, k, v, bounds, bias, sm_scale, causal, window, dropout_p=0.0, seed=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, bounds, bias, sm_scale, causal, window, *rest = inputs
    # the op's defaults when left out; key_lengths calls are forward only (fused_attention checks)
    dropout_p, seed, _ = tuple(rest) + (0.0, None, None)[len(rest):]
    ctx.save_for_backward(q, k, v, bounds, seed)
    ctx.scalars = (bias, sm_scale, causal, window, dropout_p)


_NO_GRADS = (None,) * 8  # bounds, bias, sm_scale, causal, window, dropout_p, seed, key_lengths


def _backward(ctx, dout, ops):
    q, k, v, bounds, seed = ctx.saved_tensors
    backward = sigmoid_attention_backward_op if ops else _backward_impl
    return (*backward(dout, q, k, v, bounds, *ctx.scalars, seed), *_NO_GRADS)


# One autograd.Function: eager calls run the impls directly, traced calls the ops (their fakes trace)
_ATTENTION = AutogradOp(sigmoid_attention_op, _forward_impl, _setup_context, _backward, "SigmoidAttentionFunction")


def fused_attention(q, k, v, spec: SigmoidFamilySpec, mask: MaskSpec, segment_ids=None, temperature=None, *,
                    extra=None, bounds=None, dropout_p: float = 0.0,
                    dropout_seed: Optional[torch.Tensor] = None,
                    key_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sigmoid attention through the fused kernels: q (B,N,H,D), k/v (B,KV,H_kv,D) -> (B,N,H,D).

    KV >= N keys, aligned bottom-right (query i at key position i + KV - N; n_i counts the keys
    visible there); a call with at most `runtime.DECODE_MAX_QUERIES` queries against a long key
    sequence splits the keys across programs (flash-decoding). Segment ids need KV == N.
    Differentiable in q, k, v; traceable by torch.compile(fullgraph=True) through the
    `attnlab::sigmoid_attention` custom op. `bounds`: `attn.segment_bounds(segment_ids)` computed
    once per batch by the caller. `dropout_p` > 0 drops the weights with the mask of `dropout_seed`
    (int64 tensor (1,), attn/dropout.py). `key_lengths` (B,) int32: k / v are a static cache, row
    b's keys are [0, key_lengths[b]) (`attn.attention`); forward only. `extra`: the family's mapping of
    extra tensors, empty (or None) for sigmoid attention.
    """
    if not isinstance(spec, SigmoidFamilySpec):
        raise ValueError(f"spec must be a SigmoidFamilySpec, got {type(spec).__name__}")
    if temperature is not None:
        raise ValueError("temperature is only defined for the softmax family; got one for attn=sigmoid")
    FAMILY.checked_extra(spec, extra)
    check_kernel_inputs(q, k, kernels="the sigmoid-family kernels")
    if key_lengths is not None:
        check_key_lengths(key_lengths, q, k, segment_ids=segment_ids, bounds=bounds, dropout_p=dropout_p,
                          tensors=(v,))
    bounds = kernel_segment_bounds(q, k, segment_ids, bounds)
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (attn.dropout.draw_seed)")
    bias = float(spec.bias) if spec.bias is not None else None
    drop = (float(dropout_p), dropout_seed if dropout_p > 0.0 else None)
    args = (q, k, v, bounds, bias, float(spec.scale(q.shape[-1])), bool(mask.is_causal), int(mask.window or 0), *drop)
    if key_lengths is not None:  # forward only: no autograd node
        return _ATTENTION.inference((*args, key_lengths), (q, k, v))
    return _ATTENTION(args, (q, k, v))


__all__ = ["fused_attention", "sigmoid_attention_op", "GPU_CONFIGS", "SUPPORTED_HEAD_DIMS"]
