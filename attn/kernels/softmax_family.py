"""Fused Triton kernels of the softmax family: softmax, softcap (tanh, soft_sign), ALSC.

Math (DESIGN.md §4): x = q.k, y = s x, z = t_i * F(y), w = softmax over visible keys of z,
out = w v. One forward kernel and one backward (dk/dv kernel + dq kernel) serve every
cap; the cap is a compile-time switch (CAP), its value and the ALSC knee are runtime
scalars. Cap forms, all written so that the backward derivative comes from the value
the forward already computes:

    CAP_NONE      F = y                                     F' = 1
    CAP_TANH      T = tanh(x s/c),  F = c T                 F' = 1 - T^2
    CAP_SOFT_SIGN u = x s/c, r = 1/(1+|u|), F = c u r       F' = r^2
    CAP_ALSC      g = c - a, y'' = y/g, cl = clamp(y'', -a/g, a/g),
                  T = tanh(y'' - cl), F = g (cl + T)         F' = 1 - T^2

(ALSC: inside the knee y - cl = 0, so T = 0 and F = y, F' = 1; outside it is exactly
sign(y)(a + g tanh((|y|-a)/g)); kappa = 0 gives the tanh cap.)

Online softmax in base 2: the forward keeps the running max and sum of exp2(z log2 e)
and saves lse2 = m + log2(l) per row (+inf for a row that sees nothing, so every
recomputed probability of such a row is exactly 0). The backward is exact:
dz = p (dp - delta), delta_i = dO_i . O_i; dx = s t_i F'(y) dz; dt_i = sum_j dz_ij F_ij.

Dropout (attn/dropout.py; the constexpr DROPOUT, compiled out at p = 0): with m the keep mask
(attn/kernels/dropout.py, regenerated tile by tile in the backward) and r = 1/(1-p), l sums every
p (normalized before dropout) and out = r sum_j m_ij p_ij v_j / l. Backward: dv = (r m p)^T dO,
dp = r m (dO v^T), dz = p (dp - delta); delta_i = sum_j p_ij dp_ij = dO_i . O_i still, because
O holds the dropped weights.

Layers (FlashAttention's shape): Triton kernels -> launchers registered as torch ops with fake
implementations and no autograd (`attnlab::softmax_family_fwd/_bwd`) -> one autograd.Function
(`runtime.AutogradOp`: the ops when traced, the same impls eagerly) -> `fused_attention`, the
function the registry points at. This module never imports `attn.reference`.
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
                                  ensure_descriptor_scratch, kernel_op, n_bucket, pinned_index, tma_alignment,
                                  use_tma)
from attn.kernels.runtime import tuned_configs as _tuned_configs
from attn.kernels.tiers import (GLUON_DQ_ENV, GLUON_ENV, GLUON_EXP2_ENV, GLUON_PERSISTENT_ENV, GLUON_SCHEDULE_ENV,
                                TierChoice, TimedChoice, choose_gluon_backward_grid, choose_gluon_dq_form,
                                choose_gluon_grid, gluon_candidate, gluon_dq_form, gluon_exp2_degree, gluon_pingpong,
                                tiered)
from attn.kernels.tiles import (batch_and_head, clip_to_key_split, full_key_span_ignoring_padding,
                                full_query_span_ignoring_padding, head_descriptor, head_tile_ptrs, key_block_program,
                                key_ranges, load_head_rows, query_block_program, query_row_ranges, tile_visible,
                                tile_visible_in_query_range)
from attn.families.softmax import FAMILY
from attn.masks import MaskSpec
from attn.validation import KERNEL_HEAD_DIMS, check_kernel_inputs, check_key_lengths, kernel_segment_bounds

CAP_IDS = {"none": 0, "tanh": 1, "soft_sign": 2, "alsc": 3}
LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = KERNEL_HEAD_DIMS
# tuning keys' length buckets stop here (the best tiles stop changing past 8K)
N_BUCKET_CAP = 16384
# ATTNLAB_TMA=1 loads tiles through TMA descriptors in launches of at least this many query rows (shorter
# ones are host-bound, and take configs untimed: some of those Triton 3.6 cannot compile with TMA)
TMA_MIN_ROWS = 1024


# --------------------------------------------------------------------------- caps


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:
        # MUFU.TANH: max relative error ~2^-11, far below the 16-bit inputs' rounding
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|) in (0, 1]: no overflow
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def _rcp(x, FAST: tl.constexpr):
    if FAST:
        # MUFU.RCP (relative error ~2^-23) instead of an IEEE division
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def _cap(x, cap_value, alsc_a, alsc_g, qk_scale, CAP: tl.constexpr, FAST: tl.constexpr):
    """x = q.k (fp32) -> (G, D): G times the row factor is z; D = F'(y) (1 where unused).

    The row factor (log2 units) is t * log2e * {s, c, c, g} for CAP = {none, tanh, soft_sign, alsc};
    `qk_scale` is s for none, s/c for tanh/soft_sign, s/g for alsc (whose `alsc_a` is then a/g).
    """
    if CAP == 0:
        g = x
        d = x  # unused
    elif CAP == 1:
        g = _tanh(x * qk_scale, FAST)
        d = 1.0 - g * g
    elif CAP == 2:
        u = x * qk_scale
        r = _rcp(1.0 + tl.abs(u), FAST)
        g = u * r
        d = r * r
    else:
        # in units of g = c - a: y'' = s x / g, a'' = a / g; F = g (cl + T)
        y = x * qk_scale
        cl = tl.minimum(tl.maximum(y, -alsc_a), alsc_a)
        t = _tanh(y - cl, FAST)
        g = cl + t
        d = 1.0 - t * t
    return g, d


# ------------------------------------------------------------------------ forward


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_src, v_src, b, hk, start, offs_m, offs_n0, lo, hi, kv_len, window,
              hs, he, cs, ce, stride_kn, stride_vn, row_scale, cap_value, alsc_a, alsc_g, qk_scale,
              CAP: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, DOT_PREC: tl.constexpr, FIXED_MAX: tl.constexpr,
              HAS_TEMP: tl.constexpr, seed, bh, dropout_p, DROPOUT: tl.constexpr, TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One key tile of the online softmax. Without a temperature `row_scale` is a positive
    scalar, so max(g) * scale is the row max and g * scale - m is one FMA per score.
    DROPOUT: the normalizer l sums every p, the accumulator only the kept ones (the 1/(1-p)
    rescale is applied once to the output). k_src / v_src: TMA descriptors (TMA) or the head's
    pointers (k transposed)."""
    offs_n = start + offs_n0
    if TMA:  # keys past kv_len arrive as zeros, as the masked loads give them
        k = tl.trans(load_head_rows(k_src, b, start, hk, BLOCK_N, HEAD_DIM))
        v = load_head_rows(v_src, b, start, hk, BLOCK_N, HEAD_DIM)
    elif MASKED:
        in_n = offs_n < kv_len
        k = tl.load(k_src + offs_n[None, :] * stride_kn, mask=in_n[None, :], other=0.0)
        v = tl.load(v_src + offs_n[:, None] * stride_vn, mask=in_n[:, None], other=0.0)
    else:
        k = tl.load(k_src + offs_n[None, :] * stride_kn)
        v = tl.load(v_src + offs_n[:, None] * stride_vn)
    x = tl.dot(q, k, input_precision=DOT_PREC)
    g, _ = _cap(x, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST)
    if MASKED:
        vis = tile_visible(offs_m, offs_n, lo, hi, kv_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        g = tl.where(vis, g, float("-inf"))  # scale > 0 or per-row: -inf stays -inf (t = 0 rows: see below)
    if FIXED_MAX:
        # bounded logits (a cap without temperature): shift by the row's own diagonal logit
        # (visible to every row that sees anything), no running max and no rescaling of the
        # accumulator; softmax is shift-invariant, so the math is the same
        p = tl.exp2(g * row_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], kv_len, dropout_p), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        return acc, l_i, m_i
    else:
        if HAS_TEMP:
            z = g * row_scale[:, None]
            if MASKED:
                z = tl.where(vis, z, float("-inf"))  # a zero / negative temperature must not flip -inf
            m_new = tl.maximum(m_i, tl.max(z, 1))
            p = tl.exp2(z - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(g, 1) * row_scale)
            p = tl.exp2(g * row_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], kv_len, dropout_p), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        return acc, l_i, m_new


# GPU candidates, one list per kernel whatever the head dim and cap; N <= 64 runs one untimed: the
# forward SMALL_FWD_CONFIG, the backward kernels their first. The first is the pinned default
# (ATTNLAB_AUTOTUNE=0: deterministic runs and the ablation, whose measured numbers use it); the small
# 4-warp tiles after it are what tuning picks at (4,16,4096,128) bf16: two or three such programs
# share an SM and overlap one's softmax with another's matrix products (docs/results/kernel_tile_sweep/).
SMALL_FWD_CONFIG = TileConfig(64, 64, 4, 3)
FWD_CONFIGS = [TileConfig(128, 64, 8, 3), SMALL_FWD_CONFIG, TileConfig(64, 32, 4, 3), TileConfig(128, 64, 4, 2),
               TileConfig(128, 128, 8, 3)]
DKDV_CONFIGS = [TileConfig(64, 128, 8, 2), TileConfig(32, 64, 4, 3), TileConfig(64, 64, 4, 2), TileConfig(32, 64, 4, 4),
                TileConfig(16, 64, 4, 3), TileConfig(64, 128, 8, 3), TileConfig(32, 128, 4, 3)]
DQ_CONFIGS = [TileConfig(128, 64, 8, 2), TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 3),
              TileConfig(128, 32, 4, 3)]
# kinds: "fwd" and "q" (query-block programs), "kv" (key-block programs). Interpreter tiles have
# BLOCK_M != BLOCK_N so that query and key tiles never line up (ATTNLAB_INTERPRET_BLOCKS overrides)
CONFIG_TABLE = ConfigTable({("fwd",): FWD_CONFIGS, ("kv",): DKDV_CONFIGS, ("q",): DQ_CONFIGS},
                           {"fwd": (64, 32), "q": (64, 32), "kv": (32, 64)},
                           small={"fwd": SMALL_FWD_CONFIG, "kv": DKDV_CONFIGS[0], "q": DQ_CONFIGS[0]},
                           env_blocks=True, key_block_kinds=("kv",))


@triton.jit
def _key_tile_sources(K, V, b, hk, H, GROUP, kv_len, stride_kb, stride_kn, stride_kh, stride_kd,
                      stride_vb, stride_vn, stride_vh, stride_vd, V_TRANSPOSED: tl.constexpr, TMA: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Where a query-block program's key and value tiles come from: TMA descriptors of K and V, or
    pointers to kv head hk's keys with D along rows (k transposed for q k^T) and v as (keys, D), or
    transposed too (V_TRANSPOSED, dq's d o v^T); a tile's key offsets are added by the caller."""
    offs_d = tl.arange(0, HEAD_DIM)
    if TMA:
        num_b = tl.num_programs(1) // H
        k_src = head_descriptor(K, num_b, kv_len, H // GROUP, stride_kb, stride_kn, stride_kh, BLOCK_N, HEAD_DIM)
        v_src = head_descriptor(V, num_b, kv_len, H // GROUP, stride_vb, stride_vn, stride_vh, BLOCK_N, HEAD_DIM)
    else:
        k_src = K + b * stride_kb + hk * stride_kh + offs_d[:, None] * stride_kd
        if V_TRANSPOSED:
            v_src = V + b * stride_vb + hk * stride_vh + offs_d[:, None] * stride_vd
        else:
            v_src = V + b * stride_vb + hk * stride_vh + offs_d[None, :] * stride_vd
    return k_src, v_src


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, TEMP, BOUNDS, SEED, LENS,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh, stride_od, stride_os,
    stride_tb, stride_tn,
    H, GROUP, q_len, kv_len, window, split_len,
    qk_scale, out_scale, cap_value, alsc_a, alsc_g, fixed_max, dropout_p,
    HEAD_DIM: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, HAS_TEMP: tl.constexpr, FAST: tl.constexpr, DOT_PREC: tl.constexpr,
    FIXED_MAX: tl.constexpr, DROPOUT: tl.constexpr, SPLIT_KV: tl.constexpr, HAS_LENS: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Query rows [m0, m0 + BLOCK_M) of one (batch, head). Query row i sits at key position
    i + kv_len - q_len (bottom-right alignment); every mask and tile range works on positions.
    HAS_LENS: kv_len is the capacity of a static cache and the row's own key count is LENS[b]
    (int32, clamped to [0, kv_len]); keys at or past it do not exist (loads masked, never seen).
    SPLIT_KV (flash-decoding): program_id(2) = s takes only keys [s split_len, (s+1) split_len)
    and writes its normalized partial output at O + s stride_os and its lse2 at
    LSE + s (B H q_len) (+inf where the split holds no visible key); `_combine_splits_kernel`
    merges the splits.
    TMA (not with SPLIT_KV or HAS_LENS): K and V tiles come through TMA descriptors."""
    bh, b, h, hk, kv_len, offs_m, pos_m, p0, hs, he, cs, ce = query_block_program(
        BOUNDS, H, GROUP, q_len, kv_len, BLOCK_M, HAS_SEG, LENS, HAS_LENS)
    split = tl.program_id(2)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    in_m = offs_m < q_len
    seed = load_seed(SEED, DROPOUT)

    q = tl.load(head_tile_ptrs(Q, b, h, offs_m, offs_d, stride_qb, stride_qn, stride_qh, stride_qd),
                mask=in_m[:, None], other=0.0)
    if HAS_TEMP:
        t = tl.load(TEMP + b * stride_tb + offs_m * stride_tn, mask=in_m, other=0.0).to(tl.float32)
        row_scale = t * out_scale
    else:
        row_scale = out_scale
    k_src, v_src = _key_tile_sources(K, V, b, hk, H, GROUP, kv_len, stride_kb, stride_kn, stride_kh, stride_kd,
                                     stride_vb, stride_vn, stride_vh, stride_vd, False, TMA, BLOCK_N, HEAD_DIM)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FIXED_MAX:
        # shift = z_ii (the key at the row's own position): |z - z_ii| <= 2 c log2e, so exp2 neither
        # overflows nor underflows (host guard), the diagonal adds exactly ~1 to l, and a single-key
        # row gets p = 1 as with a max
        kd = tl.load(head_tile_ptrs(K, b, hk, pos_m, offs_d, stride_kb, stride_kn, stride_kh, stride_kd),
                     mask=in_m[:, None], other=0.0)
        gd, _ = _cap(tl.sum(q.to(tl.float32) * kd.to(tl.float32), 1), cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST)
        m_i = gd * out_scale
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: exp2(m_old - m_new) never NaN

    lo, hi, lo2, hi2 = key_ranges(p0, kv_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    lo, hi = clip_to_key_split(lo, hi, split, split_len, SPLIT_KV)
    a, bnd = full_key_span_ignoring_padding(lo, hi, p0, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for start in range(lo, a, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_src, v_src, b, hk, start, pos_m, offs_n0, lo, hi, kv_len,
                                  window, hs, he, cs, ce, stride_kn, stride_vn, row_scale, cap_value, alsc_a,
                                  alsc_g, qk_scale, CAP, FAST, True, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC,
                                  FIXED_MAX, HAS_TEMP, seed, bh, dropout_p, DROPOUT, TMA, BLOCK_N, HEAD_DIM)
    for start in range(a, bnd, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_src, v_src, b, hk, start, pos_m, offs_n0, lo, hi, kv_len,
                                  window, hs, he, cs, ce, stride_kn, stride_vn, row_scale, cap_value, alsc_a,
                                  alsc_g, qk_scale, CAP, FAST, False, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC,
                                  FIXED_MAX, HAS_TEMP, seed, bh, dropout_p, DROPOUT, TMA, BLOCK_N, HEAD_DIM)
    for start in range(bnd, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_src, v_src, b, hk, start, pos_m, offs_n0, lo, hi, kv_len,
                                  window, hs, he, cs, ce, stride_kn, stride_vn, row_scale, cap_value, alsc_a,
                                  alsc_g, qk_scale, CAP, FAST, True, CAUSAL, HAS_WINDOW, HAS_SEG, DOT_PREC,
                                  FIXED_MAX, HAS_TEMP, seed, bh, dropout_p, DROPOUT, TMA, BLOCK_N, HEAD_DIM)
    if HAS_SEG:  # candidates' own diagonal
        for start in range(lo2, hi2, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_src, v_src, b, hk, start, pos_m, offs_n0, lo2, hi2,
                                      kv_len, window, hs, he, cs, ce, stride_kn, stride_vn, row_scale,
                                      cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST, True, CAUSAL,
                                      HAS_WINDOW, HAS_SEG, DOT_PREC, FIXED_MAX, HAS_TEMP, seed, bh, dropout_p,
                                      DROPOUT, TMA, BLOCK_N, HEAD_DIM)

    seen = l_i != 0.0  # rows that saw nothing have l = 0 exactly; NaN (a NaN score) propagates, as in the reference
    if HAS_SEG:  # padding rows see nothing (unmasked tiles may have touched them)
        seen = seen & (((pos_m >= hs) & (pos_m < he)) | ((pos_m >= cs) & (pos_m < ce)))
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    out = tl.where(seen[:, None], out, 0.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("inf"))
    tl.store(head_tile_ptrs(O + split * stride_os, b, h, offs_m, offs_d, stride_ob, stride_on, stride_oh, stride_od),
             out.to(O.dtype.element_ty), mask=in_m[:, None])
    tl.store(LSE + (split * tl.num_programs(1) + bh) * q_len + offs_m, lse, mask=in_m)


@triton.jit
def _combine_splits_kernel(PART_O, PART_LSE, O, LSE,
                           stride_pb, stride_pn, stride_ph, stride_pd, stride_ps,
                           stride_ob, stride_on, stride_oh, stride_od,
                           H, q_len, num_splits,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge the per-split (normalized output, lse2) of a SPLIT_KV forward into the output and
    lse2 of the whole key range: weights 2^(lse_s - max_s lse_s); splits without a visible key
    (lse +inf) weigh 0; a row no split saw gets 0 and lse +inf, as the plain forward gives."""
    pid_m = tl.program_id(0)  # BLOCK_N unused (the runtime passes both tile sizes)
    bh = tl.program_id(1)
    b, h = batch_and_head(bh, H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_m = offs_m < q_len
    num_bh = tl.num_programs(1)
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    for s in range(0, num_splits):
        lse_s = tl.load(PART_LSE + (s * num_bh + bh) * q_len + offs_m, mask=in_m, other=float("inf"))
        m = tl.maximum(m, tl.where(lse_s == float("inf"), float("-inf"), lse_s))
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(0, num_splits):
        lse_s = tl.load(PART_LSE + (s * num_bh + bh) * q_len + offs_m, mask=in_m, other=float("inf"))
        w = tl.where(lse_s == float("inf"), 0.0, tl.exp2(lse_s - m))
        o_s = tl.load(head_tile_ptrs(PART_O + s * stride_ps, b, h, offs_m, offs_d, stride_pb, stride_pn, stride_ph,
                                     stride_pd), mask=in_m[:, None], other=0.0)
        acc += w[:, None] * o_s
        l_sum += w
    seen = l_sum > 0.0
    l_safe = tl.where(seen, l_sum, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(seen, m + tl.log2(l_safe), float("inf"))
    tl.store(head_tile_ptrs(O, b, h, offs_m, offs_d, stride_ob, stride_on, stride_oh, stride_od),
             out.to(O.dtype.element_ty), mask=in_m[:, None])
    tl.store(LSE + bh * q_len + offs_m, lse, mask=in_m)


# ----------------------------------------------------------------------- backward


@triton.jit
def _bwd_preprocess(O, DO, DELTA, stride_ob, stride_on, stride_oh, stride_od,
                    stride_dob, stride_don, stride_doh, stride_dod, H, q_len,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)  # BLOCK_N unused (the runtime passes both tile sizes)
    bh = tl.program_id(1)
    b, h = batch_and_head(bh, H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_m = offs_m < q_len
    o = tl.load(head_tile_ptrs(O, b, h, offs_m, offs_d, stride_ob, stride_on, stride_oh, stride_od),
                mask=in_m[:, None], other=0.0).to(tl.float32)
    do = tl.load(head_tile_ptrs(DO, b, h, offs_m, offs_d, stride_dob, stride_don, stride_doh, stride_dod),
                 mask=in_m[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + bh * q_len + offs_m, tl.sum(o * do, 1), mask=in_m)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, t_ptr, dq_ptrs, start, offs_m0, offs_n, lo, hi,
               kv_len, window, hs, he, cs, ce, stride_qn, stride_don, stride_tn, stride_dqn, out_scale, cap_value,
               alsc_a, alsc_g, qk_scale, CAP: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TEMP: tl.constexpr,
               DOT_PREC: tl.constexpr, seed, bh, dropout_p, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
               b, h, pos_offset, TMA: tl.constexpr, DQ_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Query positions [start, start + BLOCK_M) against this program's keys; the pointers (lse_ptr,
    delta_ptr, t_ptr, dq_ptrs, and q_src / do_src without TMA) are indexed by key position (the kernel
    shifts them by the queries' offset), and only positions of real query rows are visited.
    DROPOUT (m the keep mask, r = 1/(1-p)): dv += (m p)^T do (r applied once at the end),
    dp = m r (v . do), ds = p (dp - delta) with delta = do . out (out already dropped).
    ATOMIC_DQ: also adds this tile's ds k (the rows' dq share, unscaled) to the fp32 rows at dq_ptrs
    (DQ_TMA: dq_ptrs is a TMA descriptor of those rows and the tile goes in one bulk reduce-add).
    q_src / do_src: TMA descriptors indexed by query row (TMA; rows past q_len arrive as zeros) or
    pointers indexed by key position (q transposed)."""
    offs_m = start + offs_m0
    in_m = offs_m < kv_len
    if TMA:
        q = tl.trans(load_head_rows(q_src, b, start - pos_offset, h, BLOCK_M, HEAD_DIM))  # (D, BM)
        do = load_head_rows(do_src, b, start - pos_offset, h, BLOCK_M, HEAD_DIM)  # (BM, D)
    elif MASKED:
        q = tl.load(q_src + offs_m[None, :] * stride_qn, mask=in_m[None, :], other=0.0)
        do = tl.load(do_src + offs_m[:, None] * stride_don, mask=in_m[:, None], other=0.0)
    else:
        q = tl.load(q_src + offs_m[None, :] * stride_qn)
        do = tl.load(do_src + offs_m[:, None] * stride_don)
    if MASKED:
        lse = tl.load(lse_ptr + offs_m, mask=in_m, other=float("inf"))
        delta = tl.load(delta_ptr + offs_m, mask=in_m, other=0.0)
    else:
        lse = tl.load(lse_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
    col_scale = tl.zeros_like(delta) + out_scale
    if HAS_TEMP:
        t = tl.load(t_ptr + offs_m * stride_tn, mask=in_m, other=0.0).to(tl.float32)
        col_scale = col_scale * t
    xT = tl.dot(k, q, input_precision=DOT_PREC)  # (BN, BM)
    g, fprime = _cap(xT, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST)
    pT = tl.exp2(g * col_scale[None, :] - lse[None, :])
    if MASKED:
        vis = tile_visible_in_query_range(offs_m, offs_n, lo, hi, kv_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW,
                                          HAS_SEG)
        pT = tl.where(tl.trans(vis), pT, 0.0)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BN, BM)
    if DROPOUT:
        keepT = dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], kv_len, dropout_p)
        dv = tl.dot(tl.where(keepT, pT, 0.0).to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpT = tl.where(keepT, dpT * (1.0 / (1.0 - dropout_p)), 0.0)
    else:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dsT = pT * (dpT - delta[None, :])
    # dx = s * t * F' * dz; the constant s (and c for tanh/soft_sign) is applied once at the end
    if HAS_TEMP:
        dsT = dsT * t[None, :]
    if CAP != 0:
        dsT = dsT * fprime
    dsT = dsT.to(q.dtype)
    dk = tl.dot(dsT, tl.trans(q), dk, input_precision=DOT_PREC)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC)  # (BM, D)
        if DQ_TMA:  # one bulk reduce-add of the tile (rows past q_len are clipped by the copy engine)
            dq_ptrs.atomic_add([b, start - pos_offset, h, 0], dq.reshape(1, BLOCK_M, 1, HEAD_DIM))
        elif MASKED:
            tl.atomic_add(dq_ptrs + offs_m[:, None] * stride_dqn, dq, mask=in_m[:, None], sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs + offs_m[:, None] * stride_dqn, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, DK, DV, DQ_ACC, LSE, DELTA, TEMP, BOUNDS, SEED,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_tb, stride_tn,
    H, H_KV, GROUP, q_len, kv_len, window,
    qk_scale, out_scale, grad_scale, cap_value, alsc_a, alsc_g, dropout_p,
    HEAD_DIM: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, HAS_TEMP: tl.constexpr, FAST: tl.constexpr, DOT_PREC: tl.constexpr,
    DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr, DQ_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dk, dv of keys [n0, n0 + BLOCK_N) of one (batch, kv head); TMA: q and do tiles through TMA
    descriptors. ATOMIC_DQ (the one-pass backward): the same tiles also add each query row's dq share,
    unscaled, to the zeroed fp32 DQ_ACC (B, N, H, D), in whatever order the programs run, so the sum
    is not bitwise repeatable; DQ_TMA: by TMA bulk reduce (GPU only) instead of per-element atomics."""
    b, hk, n0, offs_n, hs, he, cs, ce = key_block_program(BOUNDS, H_KV, BLOCK_N, HAS_SEG)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m0 = tl.arange(0, BLOCK_M)
    in_n = offs_n < kv_len
    seed = load_seed(SEED, DROPOUT)
    # query row i sits at key position i + pos_offset (bottom-right alignment): the loops below run
    # over positions, and the query-indexed pointers are shifted by -pos_offset rows to match
    pos_offset = kv_len - q_len

    k = tl.load(head_tile_ptrs(K, b, hk, offs_n, offs_d, stride_kb, stride_kn, stride_kh, stride_kd),
                mask=in_n[:, None], other=0.0)
    v = tl.load(head_tile_ptrs(V, b, hk, offs_n, offs_d, stride_vb, stride_vn, stride_vh, stride_vd),
                mask=in_n[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    t_ptr = TEMP + b * stride_tb - pos_offset * stride_tn

    lo, hi, lo2, hi2 = query_row_ranges(n0, pos_offset, kv_len, window, hs, he, cs, ce, BLOCK_N, CAUSAL, HAS_WINDOW,
                                        HAS_SEG)
    a, bnd = full_query_span_ignoring_padding(lo, hi, n0, kv_len, window, hs, he, BLOCK_M, BLOCK_N, CAUSAL,
                                              HAS_WINDOW, HAS_SEG)
    num_b = tl.num_programs(1) // H_KV
    if TMA:
        q_desc = head_descriptor(Q, num_b, q_len, H, stride_qb, stride_qn, stride_qh, BLOCK_M, HEAD_DIM)
        do_desc = head_descriptor(DO, num_b, q_len, H, stride_dob, stride_don, stride_doh, BLOCK_M, HEAD_DIM)
    if DQ_TMA:
        dq_desc = head_descriptor(DQ_ACC, num_b, q_len, H, stride_dqb, stride_dqn, stride_dqh, BLOCK_M, HEAD_DIM)
    for gi in range(0, GROUP):  # GQA: the query heads of this kv head, reduced in registers
        h = hk * GROUP + gi
        bh = b * H + h
        if TMA:
            q_src = q_desc
            do_src = do_desc
        else:
            q_src = Q + b * stride_qb + h * stride_qh + offs_d[:, None] * stride_qd - pos_offset * stride_qn
            do_src = DO + b * stride_dob + h * stride_doh + offs_d[None, :] * stride_dod - pos_offset * stride_don
        lse_ptr = LSE + (b * H + h) * q_len - pos_offset
        delta_ptr = DELTA + (b * H + h) * q_len - pos_offset
        if DQ_TMA:
            dq_ptrs = dq_desc
        else:
            dq_ptrs = DQ_ACC + b * stride_dqb + h * stride_dqh + offs_d[None, :] * stride_dqd - pos_offset * stride_dqn
        for start in range(lo, a, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, t_ptr, dq_ptrs, start, offs_m0,
                                offs_n, lo, hi, kv_len, window, hs, he, cs, ce, stride_qn, stride_don, stride_tn,
                                stride_dqn, out_scale, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST, True, CAUSAL,
                                HAS_WINDOW, HAS_SEG, HAS_TEMP, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                                ATOMIC_DQ, b, h, pos_offset, TMA, DQ_TMA, BLOCK_M, HEAD_DIM)
        for start in range(a, bnd, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, t_ptr, dq_ptrs, start, offs_m0,
                                offs_n, lo, hi, kv_len, window, hs, he, cs, ce, stride_qn, stride_don, stride_tn,
                                stride_dqn, out_scale, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST, False, CAUSAL,
                                HAS_WINDOW, HAS_SEG, HAS_TEMP, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                                ATOMIC_DQ, b, h, pos_offset, TMA, DQ_TMA, BLOCK_M, HEAD_DIM)
        for start in range(bnd, hi, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, t_ptr, dq_ptrs, start, offs_m0,
                                offs_n, lo, hi, kv_len, window, hs, he, cs, ce, stride_qn, stride_don, stride_tn,
                                stride_dqn, out_scale, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST, True, CAUSAL,
                                HAS_WINDOW, HAS_SEG, HAS_TEMP, DOT_PREC, seed, bh, dropout_p, DROPOUT,
                                ATOMIC_DQ, b, h, pos_offset, TMA, DQ_TMA, BLOCK_M, HEAD_DIM)
        if HAS_SEG:
            for start in range(lo2, hi2, BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, t_ptr, dq_ptrs, start,
                                    offs_m0, offs_n, lo2, hi2, kv_len, window, hs, he, cs, ce, stride_qn, stride_don,
                                    stride_tn, stride_dqn, out_scale, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST,
                                    True, CAUSAL, HAS_WINDOW, HAS_SEG, HAS_TEMP, DOT_PREC, seed, bh, dropout_p,
                                    DROPOUT, ATOMIC_DQ, b, h, pos_offset, TMA, DQ_TMA, BLOCK_M, HEAD_DIM)
    dk = dk * grad_scale
    if DROPOUT:
        dv = dv * (1.0 / (1.0 - dropout_p))
    tl.store(head_tile_ptrs(DK, b, hk, offs_n, offs_d, stride_dkb, stride_dkn, stride_dkh, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=in_n[:, None])
    tl.store(head_tile_ptrs(DV, b, hk, offs_n, offs_d, stride_dvb, stride_dvn, stride_dvh, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=in_n[:, None])


@triton.jit
def _dq_tile(dq, dt, q, do, lse, delta, row_scale, t, k_src, v_src, start, offs_m, offs_n0, lo, hi,
             kv_len, window, hs, he, cs, ce, stride_kn, stride_vn, cap_value, alsc_a, alsc_g, qk_scale,
             CAP: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_TEMP: tl.constexpr, NEED_DT: tl.constexpr,
             DOT_PREC: tl.constexpr, seed, bh, dropout_p, DROPOUT: tl.constexpr, b, hk, TMA: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """k_src / v_src: TMA descriptors (TMA; keys past kv_len arrive as zeros) or the head's pointers
    (tiles transposed)."""
    offs_n = start + offs_n0
    if TMA:
        kT = tl.trans(load_head_rows(k_src, b, start, hk, BLOCK_N, HEAD_DIM))  # (D, BN)
        vT = tl.trans(load_head_rows(v_src, b, start, hk, BLOCK_N, HEAD_DIM))  # (D, BN)
    elif MASKED:
        in_n = offs_n < kv_len
        kT = tl.load(k_src + offs_n[None, :] * stride_kn, mask=in_n[None, :], other=0.0)
        vT = tl.load(v_src + offs_n[None, :] * stride_vn, mask=in_n[None, :], other=0.0)
    else:
        kT = tl.load(k_src + offs_n[None, :] * stride_kn)
        vT = tl.load(v_src + offs_n[None, :] * stride_vn)
    x = tl.dot(q, kT, input_precision=DOT_PREC)
    g, fprime = _cap(x, cap_value, alsc_a, alsc_g, qk_scale, CAP, FAST)
    p = tl.exp2(g * row_scale[:, None] - lse[:, None])
    if MASKED:
        vis = tile_visible(offs_m, offs_n, lo, hi, kv_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do, vT, input_precision=DOT_PREC)
    if DROPOUT:
        keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], kv_len, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    if NEED_DT:
        dt += tl.sum(ds * g, 1)  # F = g times a constant, applied at the end
    if HAS_TEMP:
        ds = ds * t[:, None]
    if CAP != 0:
        ds = ds * fprime
    dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PREC)
    return dq, dt


@triton.jit
def _dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, TEMP, DT, BOUNDS, SEED,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_tb, stride_tn,
    H, GROUP, q_len, kv_len, window,
    qk_scale, out_scale, grad_scale, dt_scale, cap_value, alsc_a, alsc_g, dropout_p,
    HEAD_DIM: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SEG: tl.constexpr, HAS_TEMP: tl.constexpr, NEED_DT: tl.constexpr, FAST: tl.constexpr,
    DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dq (and the rows' d-temperature sums) of query rows [m0, m0 + BLOCK_M) of one (batch, head);
    TMA: k and v tiles through TMA descriptors."""
    bh, b, h, hk, kv_len, offs_m, pos_m, p0, hs, he, cs, ce = query_block_program(
        BOUNDS, H, GROUP, q_len, kv_len, BLOCK_M, HAS_SEG)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    in_m = offs_m < q_len
    seed = load_seed(SEED, DROPOUT)

    q = tl.load(head_tile_ptrs(Q, b, h, offs_m, offs_d, stride_qb, stride_qn, stride_qh, stride_qd),
                mask=in_m[:, None], other=0.0)
    do = tl.load(head_tile_ptrs(DO, b, h, offs_m, offs_d, stride_dob, stride_don, stride_doh, stride_dod),
                 mask=in_m[:, None], other=0.0)
    lse = tl.load(LSE + bh * q_len + offs_m, mask=in_m, other=float("inf"))
    delta = tl.load(DELTA + bh * q_len + offs_m, mask=in_m, other=0.0)
    row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + out_scale
    t = row_scale
    if HAS_TEMP:
        t = tl.load(TEMP + b * stride_tb + offs_m * stride_tn, mask=in_m, other=0.0).to(tl.float32)
        row_scale = row_scale * t
    k_src, v_src = _key_tile_sources(K, V, b, hk, H, GROUP, kv_len, stride_kb, stride_kn, stride_kh, stride_kd,
                                     stride_vb, stride_vn, stride_vh, stride_vd, True, TMA, BLOCK_N, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dt = tl.zeros([BLOCK_M], dtype=tl.float32)

    lo, hi, lo2, hi2 = key_ranges(p0, kv_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    a, bnd = full_key_span_ignoring_padding(lo, hi, p0, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for start in range(lo, a, BLOCK_N):
        dq, dt = _dq_tile(dq, dt, q, do, lse, delta, row_scale, t, k_src, v_src, start, pos_m, offs_n0, lo, hi,
                          kv_len, window, hs, he, cs, ce, stride_kn, stride_vn, cap_value, alsc_a, alsc_g,
                          qk_scale, CAP, FAST, True, CAUSAL, HAS_WINDOW, HAS_SEG, HAS_TEMP, NEED_DT, DOT_PREC, seed,
                          bh, dropout_p, DROPOUT, b, hk, TMA, BLOCK_N, HEAD_DIM)
    for start in range(a, bnd, BLOCK_N):
        dq, dt = _dq_tile(dq, dt, q, do, lse, delta, row_scale, t, k_src, v_src, start, pos_m, offs_n0, lo, hi,
                          kv_len, window, hs, he, cs, ce, stride_kn, stride_vn, cap_value, alsc_a, alsc_g,
                          qk_scale, CAP, FAST, False, CAUSAL, HAS_WINDOW, HAS_SEG, HAS_TEMP, NEED_DT, DOT_PREC, seed,
                          bh, dropout_p, DROPOUT, b, hk, TMA, BLOCK_N, HEAD_DIM)
    for start in range(bnd, hi, BLOCK_N):
        dq, dt = _dq_tile(dq, dt, q, do, lse, delta, row_scale, t, k_src, v_src, start, pos_m, offs_n0, lo, hi,
                          kv_len, window, hs, he, cs, ce, stride_kn, stride_vn, cap_value, alsc_a, alsc_g,
                          qk_scale, CAP, FAST, True, CAUSAL, HAS_WINDOW, HAS_SEG, HAS_TEMP, NEED_DT, DOT_PREC, seed,
                          bh, dropout_p, DROPOUT, b, hk, TMA, BLOCK_N, HEAD_DIM)
    if HAS_SEG:
        for start in range(lo2, hi2, BLOCK_N):
            dq, dt = _dq_tile(dq, dt, q, do, lse, delta, row_scale, t, k_src, v_src, start, pos_m, offs_n0,
                              lo2, hi2, kv_len, window, hs, he, cs, ce, stride_kn, stride_vn, cap_value, alsc_a,
                              alsc_g, qk_scale, CAP, FAST, True, CAUSAL, HAS_WINDOW, HAS_SEG, HAS_TEMP, NEED_DT,
                              DOT_PREC, seed, bh, dropout_p, DROPOUT, b, hk, TMA, BLOCK_N, HEAD_DIM)
    dq = dq * grad_scale
    tl.store(head_tile_ptrs(DQ, b, h, offs_m, offs_d, stride_dqb, stride_dqn, stride_dqh, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=in_m[:, None])
    if NEED_DT:
        tl.store(DT + bh * q_len + offs_m, dt * dt_scale, mask=in_m)


# ----------------------------------------------------------------------- launchers

_FWD = Kernel(_fwd_kernel, "softmax_family_fwd")
_DKDV = Kernel(_dkdv_kernel, "softmax_family_dkdv")
_DQ = Kernel(_dq_kernel, "softmax_family_dq")
_PREPROCESS = Kernel(_bwd_preprocess, "softmax_family_delta")
_COMBINE = Kernel(_combine_splits_kernel, "softmax_family_combine_splits")
_PREPROCESS_CONFIG = [TileConfig(64, 64, 4, 2)]  # BLOCK_M rows per program (BLOCK_N unused)



def _scalars(cap: int, cap_value: float, knee: float, sm_scale: float):
    """(qk_scale, out_scale (log2 units, times t), grad_scale (dx = grad_scale * sum), F scale, a, g)."""
    c = float(cap_value)
    if cap == 0:
        return sm_scale, sm_scale * LOG2E, sm_scale, sm_scale, 0.0, 1.0
    if cap in (1, 2):
        return sm_scale / c, c * LOG2E, sm_scale, c, 0.0, 1.0
    a = float(knee) * c
    g = c - a
    return sm_scale / g, g * LOG2E, sm_scale, g, a / g, 1.0


def _flags(q: torch.Tensor):
    fast = q.is_cuda and q.dtype != torch.float32 and not interpreting()
    prec = dot_precision(q.dtype)
    return fast, prec


FIXED_SHIFT_ENV = "ATTNLAB_FIXED_SHIFT"


def fixed_shift_enabled() -> bool:
    """Whether capped forwards may shift by the diagonal logit instead of a running max (ATTNLAB_FIXED_SHIFT,
    default 1; 0 gives the online-softmax forward, for comparisons)."""
    raw = setting(FIXED_SHIFT_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{FIXED_SHIFT_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def _fwd_impl(q, k, v, bounds, temperature, cap, cap_value, knee, sm_scale, causal, window, dropout_p=0.0, seed=None,
              key_lengths=None):
    """(out, lse2); with `key_lengths` (B,) int32 the launches (grid, splits, configs) depend on the
    capacity k.shape[1] only, and the kernels read each row's length on the device. The operands
    are those `fused_attention` checked."""
    signature = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, bounds is not None,
                 None if temperature is None else temperature.stride(), key_lengths is not None, cap, cap_value,
                 knee, sm_scale, causal, window, dropout_p, tma_alignment(k, v))
    plan = _FWD_PLANS.get(signature, q, k, v, temperature, bounds is not None, key_lengths is not None, cap,
                          cap_value, knee, sm_scale, causal, window, dropout_p)
    return plan(q, k, v, bounds, temperature, seed, key_lengths)


def _fwd_plan(q, k, v, temperature, has_bounds, has_lens, cap, cap_value, knee, sm_scale, causal, window,
              dropout_p):
    """The forward's launches for one signature: (q, k, v, bounds, temperature, seed, key_lengths) ->
    (out, lse2)."""
    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    qk_scale, out_scale, _, _, alsc_a, alsc_g = _scalars(cap, cap_value, knee, sm_scale)
    fast, prec = _flags(q)
    has_temp = temperature is not None
    st = (temperature.stride(0), temperature.stride(1)) if has_temp else (0, 0)
    splits = 1
    if not has_bounds and dropout_p == 0.0:
        splits = decode_splits(n, kv_len, bsz * h, decode_config().block_n, q.device)
    # a cap bounds |z| by c (log2 units: c log2e); without a temperature the forward can then
    # shift by the diagonal logit instead of a running max: p = exp2(z - z_ii) lies in
    # [2^-2B, 2^2B], B = c log2e, and l <= KV 2^2B; bf16/fp32 keep that range (fp16 p would
    # not), with 2^18 headroom in fp32 for |v| in acc = sum p v
    fixed_max = (cap != 0 and not has_temp and q.dtype != torch.float16 and splits == 1 and not has_lens
                 and 2.0 * float(cap_value) * LOG2E + math.log2(max(kv_len, 2)) <= 108.0 and fixed_shift_enabled())
    meta = dict(HEAD_DIM=d, CAP=cap, CAUSAL=causal or window > 0, HAS_WINDOW=window > 0, HAS_SEG=has_bounds,
                HAS_TEMP=has_temp, FAST=fast, DOT_PREC=prec, FIXED_MAX=fixed_max,
                DROPOUT=dropout_p > 0.0, HAS_LENS=has_lens)
    tma = splits == 1 and not has_lens and n >= TMA_MIN_ROWS and use_tma("fwd", k, v)
    meta["TMA"] = tma
    if splits > 1:
        return _split_kv_plan(q, k, v, splits, meta, st, has_temp, has_lens, qk_scale, out_scale, cap_value, alsc_a,
                              alsc_g, window)
    lse_shape = (bsz, h, n)

    out_strides = torch.empty_like(q).stride()  # what every call's torch.empty_like(q) gives
    scalars = (*q.stride(), *k.stride(), *v.stride(), *out_strides, 0, *st,
               h, h // h_kv, n, kv_len, window, kv_len,
               qk_scale, out_scale, float(cap_value), alsc_a, alsc_g, 0.0, float(dropout_p))
    tune_key = (q.dtype, n_bucket(n, N_BUCKET_CAP), n_bucket(kv_len, N_BUCKET_CAP), *meta.values())
    meta = {**meta, "SPLIT_KV": False}
    configs = CONFIG_TABLE.candidates("fwd", n=n)
    grid = (lambda cfg: (cdiv(n, cfg.block_m), bsz * h))

    def forward(q, k, v, bounds, temperature, seed, key_lengths):
        out = torch.empty_like(q)
        lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
        if tma:
            ensure_descriptor_scratch()
        tensors = (q, k, v, out, lse, temperature if has_temp else lse, bounds if has_bounds else lse,
                   seed_operand(dropout_p, seed, lse), key_lengths if has_lens else lse)  # lse: never read
        _FWD.launch(grid, tensors, scalars, meta, configs, tune_key)
        return out, lse

    # the Gluon forward serves every cap and temperature, without segments, key lengths, a window or
    # dropout; its running max of raw scores needs a positive row scale (a cap's is c log2 e)
    gluon_mask = not (has_bounds or has_lens or window or dropout_p)
    if not (gluon_mask and (cap != 0 or has_temp or sm_scale > 0) and gluon_candidate(q.device)):
        return forward
    from attn.kernels import gluon_softmax_fwd

    if not gluon_softmax_fwd.serves(q, k, v):
        return forward
    # a cap without temperature bounds |z| by c log2 e: the Gluon forward shifts by that bound instead
    # of a running max (p in [2^-2B, 1], B = c log2 e; bf16 P keeps that range where B <= 50)
    shift = cap_value * LOG2E if (cap != 0 and not has_temp and q.dtype == torch.bfloat16
                                   and 2.0 * float(cap_value) * LOG2E <= 100.0 and fixed_shift_enabled()) else None

    exp2_poly = gluon_exp2_degree(q.dtype)
    pingpong = gluon_pingpong()

    def gluon_grid(persistent):
        def gluon_forward(q, k, v, bounds, temperature, seed, key_lengths):
            return gluon_softmax_fwd.launch_forward(q, k, v, causal, out_scale, cap=cap, cap_scale=qk_scale,
                                                    alsc_knee=alsc_a, shift=shift, temperature=temperature,
                                                    exp2_poly=exp2_poly, pingpong=pingpong, persistent=persistent)
        return gluon_forward

    # the grids' timing keys on the work items too: a persistent grid pays off with many per SM
    gluon_forward = choose_gluon_grid(_GLUON_GRIDS, (*tune_key, n_bucket(bsz * h)), gluon_grid, pingpong)
    return tiered(_TIERS, tune_key, forward, gluon_forward)


_FWD_PLANS = LaunchPlans(_fwd_plan, PLAN_SETTINGS + (FIXED_SHIFT_ENV, GLUON_ENV, GLUON_EXP2_ENV, GLUON_SCHEDULE_ENV,
                                                     GLUON_PERSISTENT_ENV))
# softmax-family forwards on sm_90 that the Gluon kernel serves: the portable kernel or the Gluon one
# (attn/kernels/tiers.py)
_TIERS = TierChoice("softmax_family_fwd")
# the Gluon forward's grid per tuning key under ATTNLAB_GLUON_PERSISTENT=auto: "per_item" or "persistent"
_GLUON_GRIDS = TimedChoice("gluon softmax forward grid")


def _split_kv_plan(q, k, v, splits, meta, st, has_temp, has_lens, qk_scale, out_scale, cap_value, alsc_a, alsc_g,
                   window):
    """Flash-decoding for one signature: `splits` programs per query block, each over one contiguous
    key range (whole key tiles), writing a normalized partial output and its lse2 (fp32); then one
    merge kernel weighs the partials by 2^(lse_s - max lse) into `out` and `lse`, the same (out, lse)
    the one-pass forward gives (the backward reads them as usual). With per-row key lengths (meta
    HAS_LENS) the ranges cover the capacity; a range wholly past a row's length sees no key, writes
    lse2 = +inf, and the merge weighs it 0. Shapes, strides, scalars and grids are the signature's, so
    a call (a decode step: host-bound) only allocates and launches."""
    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    cfg = decode_config()
    split_len = cdiv(cdiv(kv_len, splits), cfg.block_n) * cfg.block_n
    splits = cdiv(kv_len, split_len)
    part_shape, part_lse_shape, lse_shape = (splits, bsz, n, h, d), (splits, bsz, h, n), (bsz, h, n)
    part_strides = contiguous_strides(part_shape)
    out_strides = torch.empty_like(q).stride()  # what every call's torch.empty_like(q) gives
    split_scalars = (*q.stride(), *k.stride(), *v.stride(), *part_strides[1:], part_strides[0], *st,
                     h, h // h_kv, n, kv_len, window, split_len,
                     qk_scale, out_scale, float(cap_value), alsc_a, alsc_g, 0.0, 0.0)
    split_meta = {**meta, "SPLIT_KV": True}
    split_grid = (lambda c: (cdiv(n, c.block_m), bsz * h, splits))
    combine_scalars = (*part_strides[1:], part_strides[0], *out_strides, h, n, splits)
    combine_meta, combine_config = {"HEAD_DIM": d}, [TileConfig(16, 16, 4, 1)]
    combine_grid = (lambda c: (cdiv(n, c.block_m), bsz * h))

    def split_forward(q, k, v, bounds, temperature, seed, key_lengths):
        out = torch.empty_like(q)
        lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
        part_out = torch.empty(part_shape, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(part_lse_shape, device=q.device, dtype=torch.float32)
        _FWD.launch(split_grid, (q, k, v, part_out, part_lse, temperature if has_temp else lse, lse, lse,
                                 key_lengths if has_lens else lse), split_scalars, split_meta, [cfg], ())
        _COMBINE.launch(combine_grid, (part_out, part_lse, out, lse), combine_scalars, combine_meta, combine_config, ())
        return out, lse
    return split_forward


def _bwd_impl(do, q, k, v, out, lse, bounds, temperature, need_dt, cap, cap_value, knee, sm_scale, causal, window,
              dropout_p=0.0, seed=None):
    need_dt = bool(need_dt and temperature is not None)
    signature = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), do.stride(), q.dtype,
                 q.device, bounds is not None, None if temperature is None else temperature.stride(), need_dt,
                 cap, cap_value, knee, sm_scale, causal, window, dropout_p, tma_alignment(q, k, v, do))
    plan = _BWD_PLANS.get(signature, do, q, k, v, out, temperature, bounds is not None, need_dt, cap, cap_value,
                          knee, sm_scale, causal, window, dropout_p)
    return plan(do, q, k, v, out, lse, bounds, temperature, seed)


def _bwd_plan(do, q, k, v, out, temperature, has_bounds, need_dt, cap, cap_value, knee, sm_scale, causal, window,
              dropout_p):
    """The backward's launches for one signature: (do, q, k, v, out, lse, bounds, temperature, seed) ->
    (dq, dk, dv, dt)."""
    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    qk_scale, out_scale, grad_scale, f_scale, alsc_a, alsc_g = _scalars(cap, cap_value, knee, sm_scale)
    fast, prec = _flags(q)
    has_temp = temperature is not None
    st = (temperature.stride(0), temperature.stride(1)) if has_temp else (0, 0)
    nb = (n_bucket(n, N_BUCKET_CAP), n_bucket(kv_len, N_BUCKET_CAP))
    mask_meta = dict(HEAD_DIM=d, CAP=cap, CAUSAL=causal or window > 0, HAS_WINDOW=window > 0, HAS_SEG=has_bounds,
                     HAS_TEMP=has_temp)
    # the kernels' dk/dq sums carry t * F'; the constant factor dx/dsum is grad_scale
    kv_meta = dict(**mask_meta, FAST=fast, DOT_PREC=prec, DROPOUT=dropout_p > 0.0)
    tma_kv = n >= TMA_MIN_ROWS and use_tma("dkdv", q, do)
    tma_q = n >= TMA_MIN_ROWS and use_tma("dq", k, v)
    # the one-pass form's dq tiles added by TMA bulk reduce (the interpreter has no descriptor reduce);
    # its fp32 dq is laid out as q
    tma_dq_add = q.is_cuda and n >= TMA_MIN_ROWS and use_tma("dq_add", q)
    any_tma = (tma_kv or tma_q or tma_dq_add) and q.is_cuda
    kv_configs = CONFIG_TABLE.candidates("kv", n=kv_len)
    q_configs = CONFIG_TABLE.candidates("q", n=n)
    dq_strides, dk_strides, dv_strides = (torch.empty_like(x).stride() for x in (q, k, v))
    delta_shape = (bsz, h, n)
    preprocess_scalars = (*out.stride(), *do.stride(), h, n)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    kv_scalars = (*dk_strides, *dv_strides)
    kv_tail = (*st, h, h_kv, group, n, kv_len, window,
               qk_scale, out_scale, grad_scale, float(cap_value), alsc_a, alsc_g, float(dropout_p))
    q_scalars = (*common, *dq_strides, *st, h, group, n, kv_len, window,
                 qk_scale, out_scale, grad_scale, f_scale, float(cap_value), alsc_a, alsc_g, float(dropout_p))
    q_meta = dict(**mask_meta, NEED_DT=need_dt, FAST=fast, DOT_PREC=prec, DROPOUT=dropout_p > 0.0, TMA=tma_q)
    q_key = (q.dtype, *nb, *q_meta.values())

    def kv_key(atomic: bool) -> tuple:
        return (q.dtype, *nb, group, *kv_meta.values(), atomic, tma_kv, atomic and tma_dq_add)

    kv_metas = {atomic: {**kv_meta, "ATOMIC_DQ": atomic, "TMA": tma_kv, "DQ_TMA": atomic and tma_dq_add}
                for atomic in (False, True)}
    kv_keys = {atomic: kv_key(atomic) for atomic in (False, True)}
    key_grid = (lambda cfg: (cdiv(kv_len, cfg.block_n), bsz * h_kv))
    query_grid = (lambda cfg: (cdiv(n, cfg.block_m), bsz * h))
    eligible = d <= ONE_PASS_MAX_HEAD_DIM and kv_len >= ONE_PASS_MIN_KEYS
    no_dq_acc = (0, 0, 0, 0)

    def backward(do, q, k, v, out, lse, bounds, temperature, seed):
        delta = torch.empty(delta_shape, device=q.device, dtype=torch.float32)
        _PREPROCESS.launch(query_grid, (out, do, delta), preprocess_scalars, {"HEAD_DIM": d},
                           _PREPROCESS_CONFIG, ())
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        if any_tma:
            ensure_descriptor_scratch()
        seed_arg = seed_operand(dropout_p, seed, lse)
        dt_rows = torch.empty(delta_shape, device=q.device, dtype=torch.float32) if need_dt else lse
        temp = temperature if has_temp else lse
        bnd = bounds if has_bounds else lse

        def dkdv(dq_acc=None):
            atomic = dq_acc is not None
            _DKDV.launch(key_grid, (q, k, v, do, dk, dv, dq_acc if atomic else lse, lse, delta, temp, bnd, seed_arg),
                         (*common, *kv_scalars, *(dq_acc.stride() if atomic else no_dq_acc), *kv_tail),
                         kv_metas[atomic], kv_configs, kv_keys[atomic])

        def separate():  # dk/dv, then a query-block kernel for dq (recomputing p and dp)
            dkdv()
            _DQ.launch(query_grid, (q, k, v, do, dq, lse, delta, temp, dt_rows, bnd, seed_arg), q_scalars, q_meta,
                       q_configs, q_key)

        def one_pass():  # dk/dv and dq from the same tiles, dq summed in fp32 by atomic adds
            dq_acc = torch.zeros((bsz, n, h, d), device=q.device, dtype=torch.float32)
            if _DKDV.tunes(kv_configs, kv_keys[True]):  # tuning runs the kernel many times: sum once more
                dkdv(dq_acc)
                dq_acc.zero_()
            dkdv(dq_acc)
            torch.mul(dq_acc, grad_scale, out=dq)  # scaled and cast in one kernel

        forms = {"separate": separate, "one_pass": one_pass}
        forms[_dq_form(kv_keys[False], forms, need_dt, eligible)]()
        dt = dt_rows.sum(dim=1).to(temperature.dtype) if need_dt else q.new_empty(0)
        return dq, dk, dv, dt

    # the Gluon backward serves every cap and temperature (and its gradient) without segments, a window or
    # dropout, from either forward's (out, lse2)
    if has_bounds or window or dropout_p or kv_len < n or not (cap != 0 or has_temp or sm_scale > 0):
        return backward
    if not gluon_candidate(q.device):
        return backward
    from attn.kernels import gluon_softmax_bwd

    if not gluon_softmax_bwd.serves(q, k, v):
        return backward
    logits = dict(cap=cap, cap_value=float(cap_value), knee=float(knee))

    def gluon_with_dt(persistent):
        def gluon_backward(do, q, k, v, out, lse, bounds, temperature, seed):
            return gluon_softmax_bwd.launch_backward_with_dt(q, k, v, out, do, lse, sm_scale, causal,
                                                             temperature=temperature, persistent=persistent,
                                                             **logits)
        return gluon_backward

    def gluon_form(form, persistent=False):
        def gluon_backward(do, q, k, v, out, lse, bounds, temperature, seed):
            dq, dk, dv = gluon_softmax_bwd.launch_backward(q, k, v, out, do, lse, sm_scale, causal,
                                                           temperature=temperature, form=form,
                                                           persistent=persistent, **logits)
            return dq, dk, dv, q.new_empty(0)
        return gluon_backward

    # the Gluon dq form in the key: each form's tier timing is its own
    dq_form = gluon_dq_form()
    tier_key = (q.dtype, *nb, group, d, causal, cap, has_temp, need_dt, dq_form)
    # the separate form's two grids, timed per key with the work items (the one-pass form runs per item)
    grid_key = (*tier_key, n_bucket(bsz * h))
    if need_dt:  # only the separate form's dQ kernel sums d-temperature
        gluon = choose_gluon_backward_grid(_GLUON_BWD_GRIDS, grid_key, gluon_with_dt, "softmax")
    else:
        separate = choose_gluon_backward_grid(_GLUON_BWD_GRIDS, grid_key,
                                              lambda persistent: gluon_form("separate", persistent), "softmax")
        if dq_form == "auto":  # the two forms timed per key (inside the Gluon tier's first, untimed call)
            gluon = choose_gluon_dq_form(_GLUON_DQ_FORMS, tier_key, separate, gluon_form("one_pass"))
        else:
            gluon = separate if dq_form == "separate" else gluon_form(dq_form)
    return tiered(_BWD_TIERS, tier_key, backward, gluon)


_BWD_PLANS = LaunchPlans(_bwd_plan, PLAN_SETTINGS + (GLUON_ENV, GLUON_DQ_ENV, GLUON_PERSISTENT_ENV))
# softmax backwards on sm_90 that the Gluon kernels serve: the portable kernels or the Gluon ones
_BWD_TIERS = TierChoice("softmax_family_bwd")
# the Gluon backward's dq form per tuning key under ATTNLAB_GLUON_DQ=auto: "separate" or "one_pass"
_GLUON_DQ_FORMS = TimedChoice("gluon softmax backward dq form")
# the separate form's grid per tuning key under ATTNLAB_GLUON_PERSISTENT=auto: "per_item" or "persistent"
_GLUON_BWD_GRIDS = TimedChoice("gluon softmax backward grid")


# the backward's form per tuning key: "separate" (dk/dv kernel, then the dq kernel) or "one_pass"
_dq_forms: dict[tuple, str] = {}
DQ_FORM_ENV = "ATTNLAB_SOFTMAX_DQ"
# where tuning considers the one-pass form: on an H200 it won at head dim 64 with 2048 keys (7-8%
# faster fwd+bwd) and lost at head dim 128 (4096 keys) and with 512 keys (docs/results/kernel_tile_sweep/);
# at 1024 keys the fwd+bwd call is host-bound, where the form's extra launches (zero fill, scaled copy)
# cost more than its atomics save (docs/results/public_path/)
ONE_PASS_MAX_HEAD_DIM = 64
ONE_PASS_MIN_KEYS = 2048


def _dq_form(key: tuple, forms: dict, need_dt: bool, eligible: bool) -> str:
    """How the backward gets dq. "one_pass": the dk/dv kernel also adds each tile's ds k to an fp32
    dq by atomic adds (5 matrix products per tile instead of 4 + 3 over two kernels, as FlashAttention-2
    and cuDNN do); "separate": a dq kernel recomputes p and dp per query block, and sums in a fixed
    order. Where `eligible` (ONE_PASS_MAX_HEAD_DIM, ONE_PASS_MIN_KEYS), autotuning times both at a key's
    first call (each writes all of dq, dk, dv) and keeps the faster. "separate" otherwise, and always
    under pinned configs (ATTNLAB_AUTOTUNE=0, deterministic runs), torch.use_deterministic_algorithms,
    the interpreter, and when d-temperature is asked for (only the dq kernel sums it);
    ATTNLAB_SOFTMAX_DQ=one_pass|separate pins a form at any shape (one_pass still yields to d-temperature)."""
    pinned = setting(DQ_FORM_ENV)
    if pinned is not None and pinned not in forms:
        raise ValueError(f"{DQ_FORM_ENV} must be one of {tuple(forms)}, got {pinned!r}")
    if need_dt:
        return "separate"
    if pinned is not None:
        return pinned
    if (not eligible or interpreting() or pinned_index() is not None
            or torch.are_deterministic_algorithms_enabled()):
        return "separate"
    form = _dq_forms.get(key)
    if form is None:
        for fn in forms.values():  # tune each form's kernels outside the timing
            fn()
        from triton.testing import do_bench

        times = {name: do_bench(fn, warmup=10, rep=40, return_mode="median") for name, fn in forms.items()}
        form = _dq_forms[key] = min(times, key=times.get)
    return form


def tuned_configs() -> dict[str, str]:
    """The configs and backward forms tuning chose so far, readable (for benchmark reports)."""
    out = _tuned_configs((_FWD, _DKDV, _DQ))
    out.update({f"backward dq form, {key}": form for key, form in _dq_forms.items()})
    out.update(_TIERS.report())
    out.update(_BWD_TIERS.report())
    out.update(_GLUON_DQ_FORMS.report())
    out.update(_GLUON_GRIDS.report())
    out.update(_GLUON_BWD_GRIDS.report())
    return out


# ------------------------------------------------------------------- launcher ops


@kernel_op("softmax_family_fwd")
def softmax_family_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor], cap: int, cap_value: float, knee: float, sm_scale: float,
    causal: bool, window: int, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
    key_lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B,N,H,D) and lse2 (B,H,N) fp32 (base-2 logsumexp of z log2 e before dropout; +inf for
    empty rows). dropout_p > 0: weights dropped with the mask of `seed` (int64 (1,)).
    key_lengths (B,) int32: per-row filled lengths of a static cache (forward only, no backward)."""
    return _fwd_impl(q, k, v, bounds, temperature, cap, cap_value, knee, sm_scale, causal, window, dropout_p, seed,
                     key_lengths)


@torch.library.register_fake(softmax_family_fwd, lib=KERNEL_LIBRARY)
def _(q, k, v, bounds, temperature, cap, cap_value, knee, sm_scale, causal, window, dropout_p=0.0, seed=None,
      key_lengths=None):
    bsz, n, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((bsz, h, n), dtype=torch.float32)


@kernel_op("softmax_family_bwd")
def softmax_family_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    bounds: Optional[torch.Tensor], temperature: Optional[torch.Tensor], need_dt: bool, cap: int,
    cap_value: float, knee: float, sm_scale: float, causal: bool, window: int, dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and d-temperature ((B, N), or an empty tensor when not asked for)."""
    return _bwd_impl(do, q, k, v, out, lse, bounds, temperature, need_dt, cap, cap_value, knee, sm_scale,
                     causal, window, dropout_p, seed)


@torch.library.register_fake(softmax_family_bwd, lib=KERNEL_LIBRARY)
def _(do, q, k, v, out, lse, bounds, temperature, need_dt, cap, cap_value, knee, sm_scale, causal, window,
      dropout_p=0.0, seed=None):
    if need_dt and temperature is not None:
        dt = torch.empty_like(temperature)
    else:
        dt = q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dt


def _setup_context(ctx, inputs, output):
    q, k, v, bounds, temperature, cap, cap_value, knee, sm_scale, causal, window, *rest = inputs
    # the op's defaults when left out; key_lengths calls are forward only (fused_attention checks)
    dropout_p, seed, _ = tuple(rest) + (0.0, None, None)[len(rest):]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bounds, temperature, seed)
    ctx.params = (cap, cap_value, knee, sm_scale, causal, window, dropout_p)


def _backward(ctx, grad_out, ops):
    """The op's input gradients: dq, dk, dv, d-temperature (None unless asked for), through the
    backward op (ops) or its impl."""
    q, k, v, out, lse, bounds, temperature, seed = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    need_dt = temperature is not None and ctx.needs_input_grad[4]
    backward = softmax_family_bwd if ops else _bwd_impl
    dq, dk, dv, dt = backward(grad_out.contiguous(), q, k, v, out, lse, bounds, temperature, need_dt, *ctx.params,
                              seed)
    return dq, dk, dv, None, (dt if need_dt else None), None, None, None, None, None, None, None, None, None


# One autograd.Function: traced calls run the ops (their fakes trace), eager calls the same impls directly
_ATTENTION = AutogradOp(softmax_family_fwd, _fwd_impl, _setup_context, _backward, "SoftmaxFamilyFunction",
                        result=lambda output: output[0])


# ------------------------------------------------------------------------- public


def fused_attention(q, k, v, spec, mask: MaskSpec, segment_ids=None, temperature=None, *, extra=None,
                    bounds=None, dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None,
                    key_lengths: Optional[torch.Tensor] = None):
    """Softmax-family attention through the fused kernels: q (B,N,H,D), k/v (B,KV,H_kv,D) -> (B,N,H,D).

    KV >= N keys, aligned bottom-right (query i at key position i + KV - N, attn/masks.py); a call
    with at most `runtime.DECODE_MAX_QUERIES` queries against a long key sequence splits the keys
    across programs (flash-decoding, `_split_kv_plan`). Segment ids need KV == N.
    `bounds`: `attn.segment_bounds(segment_ids)` computed once per batch by the caller (a model
    with many layers); computed here from segment_ids when not given. `dropout_p` > 0 drops the
    probabilities with the mask of `dropout_seed` (int64 tensor (1,), attn/dropout.py).
    `key_lengths` (B,) int32: k / v are a static cache, row b's keys are [0, key_lengths[b])
    (`attn.attention`); forward only. `extra`: the family's mapping of extra tensors, empty (or None)
    for every softmax-family spec."""
    FAMILY.checked_extra(spec, extra)
    check_kernel_inputs(q, k, kernels="the softmax-family kernels")
    if key_lengths is not None:
        check_key_lengths(key_lengths, q, k, segment_ids=segment_ids, bounds=bounds, dropout_p=dropout_p,
                          tensors=(v, temperature))
    bounds = kernel_segment_bounds(q, k, segment_ids, bounds)
    args = (q, k, v, bounds, temperature, CAP_IDS[spec.cap], float(spec.cap_value), float(spec.knee),
            float(spec.scale(q.shape[-1])), bool(mask.is_causal), int(mask.window or 0), float(dropout_p),
            dropout_seed if dropout_p > 0.0 else None)
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (attn.dropout.draw_seed)")
    if key_lengths is not None:  # forward only: no autograd node
        return _ATTENTION.inference((*args, key_lengths), (q, k, v, temperature))
    return _ATTENTION(args, (q, k, v, temperature))


__all__ = ["fused_attention", "softmax_family_fwd", "softmax_family_bwd", "CAP_IDS", "tuned_configs"]
