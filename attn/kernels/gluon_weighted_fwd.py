"""The threshold and sigmoid families' attention forward in Gluon for sm_90 (Hopper).

Both weigh each visible score on its own, with no row normalization (DESIGN.md §4), so a consumer's
loop has no running max, no sum and no accumulator rescale:

    threshold (WEIGHT 1)   w_ij = relu(q_i.k_j - tau_i)^p,   tau_i = beta sqrt(2 ln n_i / D)
    sigmoid   (WEIGHT 2)   w_ij = 1 / (1 + 2^x),  x = -(s log2 e) q_i.k_j - b_i log2 e,
                           b_i = the spec's bias, or -ln n_i
    out_i = sum_j w_ij v_j over the keys j query i sees (n_i of them; a row that sees none: 0)

The schedule, the ring and the host side are `gluon_pipeline`'s (FA3's producer / two consumer
warpgroups, unordered or in ping-pong with `pingpong=True`, block j's S = Q K^T issued beside block j-1's
W V; a program per work item or, with `persistent=True`, `gluon_pipeline`'s persistent grid). A NaN score
gives a NaN weight, as the reference does. The differential threshold (two score maps), segments, a window, key lengths
and dropout stay on the portable kernels (`attn/kernels/tiers.py` chooses per launch).
"""

from __future__ import annotations

import functools
import math

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from attn.kernels.gluon_pipeline import (
    serves,  # which operands the kernels serve: D 64 / 128, bf16 / fp16
    CONSUMER_REGS,
    LOG2E,
    PRODUCER_REGS,
    allocate_item_empty,
    allocate_ring,
    check_operands,
    GLUON_OPTIONS,
    compile_sm90 as compile_kernel,
    descriptor,
    invalidate_ring,
    issue_first_qk,
    issue_last_pv,
    issue_qk_pv,
    key_blocks,
    mbarrier,
    persistent_producer,
    persistent_item,
    persistent_programs,
    producer,
    program_rows,
    pv_operand,
    release,
    tile_config,
    tma_tile,
    tma_view,
    visible_key,
    warpgroup_mma_wait,
)
from attn.kernels.runtime import DirectLauncher, cdiv

THRESHOLD = gl.constexpr(1)
SIGMOID = gl.constexpr(2)
TINY = gl.constexpr(1.1754943508222875e-38)  # the smallest normal fp32: log2 of it is finite


@gluon.jit
def _ex2(x):
    """2^x on MUFU.EX2 (flushes results below 2^-126 to 0; +inf from 128 on)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _lg2(x):
    """log2 x on MUFU.LG2 (x a normal float: callers clamp it to TINY; absolute error ~2^-22; gl.log2
    compiles to a software log2 of ~20 instructions)."""
    return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _rcp(x):
    """1/x on MUFU.RCP (relative error ~2^-23; 1/inf = 0)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _rcp_newton(d, STEPS: gl.constexpr):
    """1/d for d in [1, 2^126] without a MUFU op: an integer-trick first guess, then STEPS Newton
    steps y (2 - d y) (relative error below 2^-16 after 2 steps, 2^-32 after 3); NaN for NaN."""
    y = (0x7F000000 - d.to(gl.int32, bitcast=True)).to(gl.float32, bitcast=True)
    for _ in gl.static_range(STEPS):
        y = y * (1.0 - d * y) + y
    return y


@gluon.jit
def _row_value(rows, kv_len, q_len, row_param, WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, CAUSAL: gl.constexpr):
    """Per query row: the threshold tau_i (row_param = beta sqrt(2 / D)) or the sigmoid's bias in
    log2 units (HAS_BIAS: row_param = b log2 e; else -log2 n_i), from n_i, the keys row i sees
    (causal: position + 1, rows at negative positions see none; else kv_len); n_i = 0 counts as 1."""
    if CAUSAL:
        n_i = (rows + (kv_len - q_len) + 1).to(gl.float32)
    else:
        n_i = gl.zeros_like(rows).to(gl.float32) + kv_len
    n_i = gl.maximum(n_i, 1.0)
    if WEIGHT == THRESHOLD:
        value = row_param * gl.sqrt(gl.log(n_i))
    elif HAS_BIAS:
        value = gl.zeros_like(n_i) + row_param
    else:
        value = -gl.log2(n_i)
    return value


@gluon.jit
def _weights(s, j, row_value, last_key, kv_len, score_scale, power, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr,
             NEWTON: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block j's raw scores s = q.k (fp32, in the wgmma's registers) -> its weights w (fp32, same
    registers), 0 at keys the rows do not see."""
    r = gl.expand_dims(row_value, 1)
    if MASKED:
        s_layout: gl.constexpr = s.type.layout
        visible = visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N)
    if WEIGHT == THRESHOLD:
        if MASKED:  # relu(-inf - tau) = 0: the select rides on the score (FSEL), before the weight
            s = gl.where(visible, s, -float("inf"))
        x = s - r
        relu = gl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
        if POWER_MODE == 1:
            w = relu
        elif POWER_MODE == 2:
            w = relu * relu
        else:  # relu is 0 for x <= 0 and NaN for a NaN score, so it stands in where no power is taken
            w = gl.where(x > 0.0, _ex2(power * _lg2(gl.maximum(x, TINY))), relu)
    else:
        x = s * score_scale - r  # score_scale = -s log2 e: one FFMA per score
        if NEWTON > 0:  # 2^x >= 2^126 gives w = 2^-126, not 0: the first guess needs d <= 2^126
            w = _rcp_newton(1.0 + _ex2(gl.minimum(x, 126.0, propagate_nan=tl.PropagateNan.ALL)), NEWTON)
        else:
            w = _rcp(1.0 + _ex2(x))
        if MASKED:
            w = gl.where(visible, w, 0.0)
    return w


@gluon.jit
def _pipelined_block(j, r, w16, acc, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, row_value,
                     last_key, kv_len, score_scale, power, s_layout: gl.constexpr, p_layout: gl.constexpr,
                     WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, NEWTON: gl.constexpr, MASKED: gl.constexpr,
                     CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """Key block j with block j - 1's W V in flight: S_j = Q K_j^T and O += W_{j-1} V_{j-1} issued back to
    back (PINGPONG: in this warpgroup's turn, `issue_qk_pv`), S_j's weights formed while the tensor cores
    run W_{j-1} V_{j-1}. r: block j's tile in the ring (j, plus the tiles of a persistent program's earlier
    work items). Returns (W_j packed, O)."""
    s, k_tile, acc, v_tile = issue_qk_pv(r, w16, acc, q_smem, k_smem, v_smem, k_ready, v_ready, s_layout, BLOCK_M,
                                         BLOCK_N, STAGES, WARPGROUP, PINGPONG)
    s, q_smem, k_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s, q_smem, k_tile))
    release(r, k_empty, STAGES)
    w = _weights(s, j, row_value, last_key, kv_len, score_scale, power, WEIGHT, POWER_MODE, NEWTON, MASKED, CAUSAL,
                 BLOCK_N)
    # W_{j-1} among the deps: its registers stay live until the wgmma that reads them retired
    acc, v_tile, w16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, w16))
    release(r - 1, v_empty, STAGES)
    return pv_operand(w, v_smem, p_layout), acc


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, o_base, stride_on, m0, q_len,
              kv_len, n_full, n_tiles, score_scale, row_param, power, ring, q_phase, q_empty, WEIGHT: gl.constexpr,
              POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr,
              PERSISTENT: gl.constexpr = False):
    """One warpgroup (WARPGROUP 0 or 1): BLOCK_M (64) query rows from m0 against key blocks [0, n_tiles)
    (unmasked below n_full; both consumers run the program's n_tiles); key block j is ring tile ring + j, the
    query tile's phase q_phase. PERSISTENT: one of a persistent program's work items, which arrives on
    q_empty once its last S = Q K^T retired (the producer then loads the next item's query tile). PINGPONG:
    the two consumers take turns at issuing their wgmmas (`gluon_pipeline`'s ping-pong protocol). Stores its
    rows of out."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    last_key = gl.minimum(rows + (kv_len - q_len), kv_len - 1)
    row_value = _row_value(rows, kv_len, q_len, row_param, WEIGHT, HAS_BIAS, CAUSAL)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, q_phase)
    if n_tiles > 0:
        s, k_tile = issue_first_qk(ring, q_smem, k_smem, k_ready, s_layout, BLOCK_M, BLOCK_N, STAGES, WARPGROUP,
                                   PINGPONG)
        s, q_smem, k_tile = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_smem, k_tile))
        release(ring, k_empty, STAGES)
        if n_full > 0:
            w0 = _weights(s, 0, row_value, last_key, kv_len, score_scale, power, WEIGHT, POWER_MODE, NEWTON, False,
                          CAUSAL, BLOCK_N)
        else:
            w0 = _weights(s, 0, row_value, last_key, kv_len, score_scale, power, WEIGHT, POWER_MODE, NEWTON, True,
                          CAUSAL, BLOCK_N)
        w16 = pv_operand(w0, v_smem, p_layout)
        for j in range(1, n_full):
            w16, acc = _pipelined_block(j, ring + j, w16, acc, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
                                        v_empty, row_value, last_key, kv_len, score_scale, power, s_layout, p_layout,
                                        WEIGHT, POWER_MODE, NEWTON, False, CAUSAL, BLOCK_M, BLOCK_N, STAGES, WARPGROUP,
                                        PINGPONG)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            w16, acc = _pipelined_block(j, ring + j, w16, acc, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
                                        v_empty, row_value, last_key, kv_len, score_scale, power, s_layout, p_layout,
                                        WEIGHT, POWER_MODE, NEWTON, True, CAUSAL, BLOCK_M, BLOCK_N, STAGES, WARPGROUP,
                                        PINGPONG)
        if PERSISTENT:  # every S = Q K^T of the item has retired: the query tile is free
            gl.thread_barrier()
            mbarrier.arrive(q_empty)
        acc, v_tile = issue_last_pv(ring + n_tiles - 1, w16, acc, v_smem, v_ready, STAGES, WARPGROUP, PINGPONG)
        acc, v_tile, w16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, w16))
        release(ring + n_tiles - 1, v_empty, STAGES)
    elif PERSISTENT:
        gl.thread_barrier()
        mbarrier.arrive(q_empty)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + o_base + gl.expand_dims(offs_m.to(gl.int64) * stride_on, 1) + gl.expand_dims(offs_d, 0)
    gl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=gl.expand_dims(offs_m < q_len, 1))


@gluon.jit
def _gluon_weighted_fwd_kernel(q_desc, k_desc, v_desc, O, stride_ob, stride_on, stride_oh,
                               H, GROUP, q_len, kv_len, score_scale, row_param, power,
                               WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                               NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               PINGPONG: gl.constexpr = False):
    """Program (query block, batch x head): rows [m0, m0 + BLOCK_M), two consumer warpgroups of
    BLOCK_M / 2 rows each (the default partition and a 4-warp worker) and a 1-warp TMA producer;
    PINGPONG: the consumers take turns at issuing their wgmmas (`gluon_pipeline`)."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    b, h, hk, bh, m0 = program_rows(q_len, H, GROUP, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    o_base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, o_base, stride_on,
                     m0, q_len, kv_len, n_full, n_tiles, score_scale, row_param, power, 0, 0, k_empty, WEIGHT,
                     POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, 0,
                     PINGPONG)),
        (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, o_base, stride_on,
                     m0 + HALF_M, q_len, kv_len, n_full, n_tiles, score_scale, row_param, power, 0, 0, k_empty,
                     WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, 1,
                     PINGPONG)),
        (producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                    b * q_len + m0, b * kv_len, hk * HEAD_DIM, h * HEAD_DIM, n_tiles, HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


@gluon.jit
def _persistent_consumer(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, O, stride_ob,
                         stride_on, stride_oh, H, GROUP, BH, n_items, q_len, kv_len, score_scale, row_param, power,
                         WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr,
                         CAUSAL: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of a persistent forward: `_consumer` on its half of each work item of the
    program (`gluon_pipeline.work_item`'s order, as the producer), the ring's tile count and the query tile's
    phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O,
                  b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh, stride_on, m0 + WARPGROUP * HALF_M, q_len,
                  kv_len, n_full, n_tiles, score_scale, row_param, power, ring, it & 1, q_empty, WEIGHT, POWER_MODE,
                  HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, WARPGROUP, False, True)
        ring += n_tiles
        it += 1


@gluon.jit
def _gluon_weighted_fwd_persistent_kernel(q_desc, k_desc, v_desc, O, stride_ob, stride_on, stride_oh,
                                          H, GROUP, q_len, kv_len, score_scale, row_param, power, BH,
                                          WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                                          NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The persistent form of `_gluon_weighted_fwd_kernel` (a grid of at most one program per SM, each running
    work items (query block, batch x head) in `gluon_pipeline.work_item`'s order): the same partitions and
    per-item work, the producer loading the next item's tiles while the consumers finish this one. Unordered
    consumers (no ping-pong)."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_items = gl.cdiv(q_len, BLOCK_M) * BH
    q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    q_empty = allocate_item_empty()
    gl.warp_specialize([
        (_persistent_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                                O, stride_ob, stride_on, stride_oh, H, GROUP, BH, n_items, q_len, kv_len, score_scale,
                                row_param, power, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N,
                                HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
        (_persistent_consumer, (q_smem.index(1), k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                                O, stride_ob, stride_on, stride_oh, H, GROUP, BH, n_items, q_len, kv_len, score_scale,
                                row_param, power, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N,
                                HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
        (persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                               k_empty, v_empty, q_len, kv_len, H, GROUP, BH, n_items, HEAD_DIM, HALF_M, BLOCK_N,
                               STAGES, CAUSAL, q_desc, q_smem, False)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)
    mbarrier.invalidate(q_empty)


# ---------------------------------------------------------------------------------------------
# host side


def power_mode(power: float) -> int:
    """The kernel's POWER_MODE: 1 / 2 for p = 1 / 2 (no MUFU op), 0 for any other p > 0."""
    return 1 if power == 1.0 else 2 if power == 2.0 else 0


# the sigmoid's reciprocal on MUFU.RCP by default: on an H100 at (4,16,4096,128) causal bf16 the forward
# takes 0.565 ms with it and 0.611 ms with 2 Newton steps (fewer MUFU ops, more issued instructions:
# 5.7 against 10.7 per score), docs/results/gluon/
SIGMOID_NEWTON_STEPS = 0


@functools.cache
def _forward_plan(dtype, head_dim: int, causal: bool, weight: int, power_constexpr: int, has_bias: bool, newton: int,
                  pingpong: bool, persistent: bool):
    """What every launch of one kernel form shares: (BLOCK_M, the query tile, the key / value tile, the
    constexprs; the persistent kernel has no PINGPONG)."""
    cfg = tile_config(head_dim)
    constexprs = dict(WEIGHT=weight, POWER_MODE=power_constexpr, HAS_BIAS=has_bias, NEWTON=newton, CAUSAL=causal,
                      HEAD_DIM=head_dim, **({} if persistent else {"PINGPONG": pingpong}), **cfg)
    return (cfg["BLOCK_M"], tma_tile(dtype, cfg["BLOCK_M"] // 2, head_dim), tma_tile(dtype, cfg["BLOCK_N"], head_dim),
            constexprs)


_FORWARD = DirectLauncher(_gluon_weighted_fwd_kernel, "gluon_weighted_fwd")
_PERSISTENT_FORWARD = DirectLauncher(_gluon_weighted_fwd_persistent_kernel, "gluon_weighted_fwd_persistent")


def _launch(q, k, v, causal: bool, weight: int, score_scale: float, row_param: float, power: float, has_bias: bool,
            newton: int, pingpong: bool = False, persistent: bool = False):
    import torch

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    if persistent and pingpong:
        raise ValueError("gluon weighted forward: the persistent kernel has no ping-pong schedule")
    block_m, q_tile, kv_tile, constexprs = _forward_plan(q.dtype, d, causal, weight, power_mode(power), has_bias,
                                                         newton, bool(pingpong), bool(persistent))
    out = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    descriptors = (descriptor(tma_view(q), q_tile), descriptor(tma_view(k), kv_tile), descriptor(tma_view(v), kv_tile))
    scalars = (n * h * d, h * d, d,  # out's strides (contiguous)
               h, h // h_kv, n, kv_len, float(score_scale), float(row_param), float(power))
    if persistent:
        _PERSISTENT_FORWARD.run((persistent_programs(cdiv(n, block_m) * bsz * h, q.device),), descriptors, (out,),
                                (*scalars, bsz * h), constexprs, GLUON_OPTIONS)
    else:
        _FORWARD.run((cdiv(n, block_m), bsz * h), descriptors, (out,), scalars, constexprs, GLUON_OPTIONS)
    return out


def launch_threshold(q, k, v, causal: bool, beta: float, power: float, pingpong: bool = False,
                     persistent: bool = False):
    """Threshold attention's output (B, N, H, D) in q's dtype, without checks (the threshold family's
    launch plans check once): w = relu(q.k - tau_i)^power, tau_i = beta sqrt(2 ln n_i / D). `pingpong`:
    the two consumer warpgroups take turns at issuing their wgmmas (`gluon_pipeline`'s ping-pong).
    `persistent`: the persistent kernel (one program per SM running work items in turn; not with
    `pingpong`)."""
    return _launch(q, k, v, causal, 1, 1.0, beta * math.sqrt(2.0 / q.shape[-1]), power, False, 0, pingpong,
                   persistent)


def launch_sigmoid(q, k, v, causal: bool, sm_scale: float, bias: float | None, newton: int | None = None,
                   pingpong: bool = False, persistent: bool = False):
    """Sigmoid attention's output (B, N, H, D) in q's dtype, without checks (the sigmoid family's launch
    plans check once): w = sigmoid(sm_scale q.k + b_i), b_i = bias or -ln n_i. `newton`: the
    reciprocal's Newton steps (0: MUFU.RCP; None: SIGMOID_NEWTON_STEPS; 2 steps keep w's relative
    error below 2^-16, 3 below 2^-32). `pingpong`, `persistent`: as `launch_threshold`'s."""
    if newton is None:
        newton = SIGMOID_NEWTON_STEPS
    return _launch(q, k, v, causal, 2, -sm_scale * LOG2E, 0.0 if bias is None else bias * LOG2E, 1.0,
                   bias is not None, newton, pingpong, persistent)


def gluon_threshold_forward(q, k, v, causal: bool, beta: float = 1.0, power: float = 2.0, pingpong: bool = False):
    """`launch_threshold` with its operands checked (ValueError naming what a call misses)."""
    check_operands(q, k, v, causal, "gluon threshold forward")
    if not (math.isfinite(float(power)) and power > 0):
        raise ValueError(f"gluon threshold forward: power must be > 0 and finite, got {power}")
    if not math.isfinite(float(beta)):
        raise ValueError(f"gluon threshold forward: beta must be finite, got {beta}")
    return launch_threshold(q, k, v, causal, beta, power, pingpong)


def gluon_sigmoid_forward(q, k, v, causal: bool, sm_scale: float, bias: float | None = None, newton: int | None = None,
                          pingpong: bool = False):
    """`launch_sigmoid` with its operands checked (ValueError naming what a call misses)."""
    check_operands(q, k, v, causal, "gluon sigmoid forward")
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"gluon sigmoid forward: sm_scale must be finite, got {sm_scale}")
    if bias is not None and not math.isfinite(float(bias)):
        raise ValueError(f"gluon sigmoid forward: bias must be finite or None, got {bias}")
    if newton is not None and newton not in (0, 1, 2, 3):
        raise ValueError(f"gluon sigmoid forward: newton must be None or one of 0, 1, 2, 3, got {newton!r}")
    return launch_sigmoid(q, k, v, causal, sm_scale, bias, newton, pingpong)


def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90,
                 weight: int = 1, power: float = 2.0, has_bias: bool = False, newton: int = SIGMOID_NEWTON_STEPS,
                 pingpong: bool = False, persistent: bool = False):
    """The kernel (`persistent`: the persistent one) compiled for sm_<arch> without a GPU
    (`gluon_pipeline.compile_sm90`)."""
    signature = {"O": f"*{dtype}", "stride_ob": "i32", "stride_on": "i32", "stride_oh": "i32",
                 "H": "i32", "GROUP": "i32", "q_len": "i32", "kv_len": "i32", "score_scale": "fp32",
                 "row_param": "fp32", "power": "fp32", "WEIGHT": "constexpr", "POWER_MODE": "constexpr",
                 "HAS_BIAS": "constexpr", "NEWTON": "constexpr", "CAUSAL": "constexpr", "PINGPONG": "constexpr"}
    constexprs = {"WEIGHT": weight, "POWER_MODE": power_mode(power), "HAS_BIAS": has_bias,
                  "NEWTON": newton if weight == 2 else 0, "CAUSAL": causal, "PINGPONG": bool(pingpong)}
    if persistent:
        del signature["PINGPONG"], constexprs["PINGPONG"]
        signature["BH"] = "i32"
        return compile_kernel(_gluon_weighted_fwd_persistent_kernel, head_dim, dtype, signature, constexprs, ("O",),
                              arch)
    return compile_kernel(_gluon_weighted_fwd_kernel, head_dim, dtype, signature, constexprs, ("O",), arch)
