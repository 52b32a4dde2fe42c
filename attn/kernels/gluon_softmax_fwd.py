"""The softmax family's attention forward in Gluon for sm_90 (Hopper), FlashAttention-3's schedule.

Logits z = t_i * cap(s q.k) of every cap (none, tanh, soft_sign, ALSC: `_cap`, in registers) with an
optional per-row temperature t; a cap without temperature shifts by its bound instead of a running
max (no accumulator rescale). Written against Triton 3.6's Gluon API (`triton.experimental.gluon`);
Gluon changes between Triton releases, so `gluon_pipeline.gluon_api_available()` says whether the installed Triton
has what this file uses. `attn/kernels/tiers.py` decides when the softmax family's forward runs it
(sm_90, without segments, key lengths, a window or dropout; ATTNLAB_GLUON).

The schedule, the ring and the host side are `gluon_pipeline`'s (its two consumer warpgroups unordered,
or with `launch_forward(pingpong=True)` taking turns at issuing their wgmmas). Per key block a consumer turns
S = Q K^T into P with the online softmax in registers (exp2 of log2-unit logits, running max and
sum, rescale of the accumulator), P V runs as an async wgmma with P from registers. Key blocks
wholly visible to every row of the tile run without mask arithmetic; the blocks on the causal
diagonal and the ragged last block run with the mask. lse2 (B, H, N) fp32 is the base-2
logsumexp of the logits (+inf for a row that sees no key, whose output is 0).
"""

from __future__ import annotations

import functools
import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from attn.kernels.gluon_pipeline import (
    serves,  # which operands the kernels serve: D 64 / 128, bf16 / fp16
    CONSUMER_REGS,
    GLUON_OPTIONS,
    LOG2E,
    PRODUCER_REGS,
    allocate_item_empty,
    allocate_ring,
    check_operands,
    compile_sm90 as compile_kernel,
    descriptor,
    invalidate_ring,
    issue_first_qk,
    issue_last_pv,
    issue_qk_pv,
    key_blocks,
    mbarrier,
    producer,
    persistent_producer,
    persistent_item,
    persistent_programs,
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


@gluon.jit
def _tanh(x):
    """tanh on MUFU.TANH (max relative error ~2^-11, far below the 16-bit operands' rounding)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _rcp(x):
    """1/x on MUFU.RCP (relative error ~2^-23) instead of an IEEE division."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


ROUNDING_SHIFT = gl.constexpr(12582912.0)  # 1.5 * 2^23: x + this holds round(x) in its low mantissa bits


@gluon.jit
def _exp2(x, POLY: gl.constexpr):
    """2^x: POLY 0 on MUFU.EX2 (gl.exp2); POLY 3 or 4 on the FMA pipes (FlashAttention-4's trick, as
    attn/kernels/fast_math.py's exp2_poly: x = n + f, 2^f by a degree-POLY minimax polynomial, 2^n from
    n's bits; relative error 1.0e-4 / 2.9e-6, below half a bf16 / fp16 ulp of P); POLY -3 or -4 half
    each way (even columns on the MUFU, odd ones by the polynomial of degree -POLY), which balances the
    two pipes of a capped forward. The polynomial takes x in [-125, 0] exactly (below: 2^-125, never 0),
    so it serves key blocks without masked scores only."""
    if POLY == 0:
        y = gl.exp2(x)
    elif POLY < 0:
        # half the scores each way: MUFU.EX2 for the even columns, the polynomial for the odd ones
        M: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        layout: gl.constexpr = x.type.layout
        even, odd = gl.split(gl.reshape(x, [M, N // 2, 2]))
        # the pairs are a thread's adjacent registers: back in x's layout without moving data
        y = gl.convert_layout(gl.reshape(gl.join(gl.exp2(even), _exp2(odd, -POLY)), [M, N]), layout)
    else:
        xc = gl.maximum(x, -125.0)
        r = xc + ROUNDING_SHIFT
        f = xc - (r - ROUNDING_SHIFT)
        scale = ((r.to(gl.int32, bitcast=True) << 23) + 0x3F800000).to(gl.float32, bitcast=True)
        if POLY == 3:
            q = 0.05500869080424309 * f + 0.24221062660217285
            q = q * f + 0.6932829022407532
        else:
            q = 0.009582829661667347 * f + 0.055906400084495544
            q = q * f + 0.24024099111557007
            q = q * f + 0.6931241750717163
        y = (q * f + 1.0) * scale
    return y


@gluon.jit
def _cap(x, cap_scale, alsc_knee, CAP: gl.constexpr):
    """Raw scores x = q.k -> g, the capped score in the units the row scale turns into log2-unit
    logits (z = g * row_scale): CAP 0 none (g = x), 1 tanh (g = tanh(x s/c)), 2 soft_sign
    (g = u / (1 + |u|), u = x s/c), 3 ALSC in units of c - a (g = clamp(y, +-a') + tanh(y - clamp),
    y = x s/(c - a), a' = a/(c - a)); `cap_scale` is s/c or s/(c - a), `alsc_knee` a'."""
    if CAP == 1:
        g = _tanh(x * cap_scale)
    elif CAP == 2:
        u = x * cap_scale
        g = u * _rcp(1.0 + gl.abs(u))
    elif CAP == 3:
        y = x * cap_scale
        clamped = gl.minimum(gl.maximum(y, -alsc_knee), alsc_knee)
        g = clamped + _tanh(y - clamped)
    else:
        g = x
    return g


@gluon.jit
def _softmax_block(qk, j, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee, shift,
                   CAP: gl.constexpr, HAS_TEMP: gl.constexpr, FIXED_SHIFT: gl.constexpr,
                   MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, EXP2_POLY: gl.constexpr):
    """Key block j's scores -> (P in fp32, in the scores' registers, m, l, alpha), the logits
    z = cap(q.k) * row_scale in log2 units; alpha = exp2(m_old - m_new) is the factor the accumulator
    takes before this block's P V is added. row_scale: a scalar > 0, or per row (HAS_TEMP: t_i times
    the scale, any sign). FIXED_SHIFT (a cap bounds |z| by `shift`, no temperature): p = exp2(z - shift)
    with m fixed at `shift`, so alpha is 1 and the accumulator is never rescaled. EXP2_POLY > 0: the
    exp2 of unmasked blocks on the FMA pipes (`_exp2`)."""
    POLY: gl.constexpr = 0 if MASKED else EXP2_POLY
    s_layout: gl.constexpr = qk.type.layout
    g = _cap(qk, cap_scale, alsc_knee, CAP)
    if MASKED:
        visible = visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N)
    if HAS_TEMP:
        z = g * gl.expand_dims(row_scale, 1)
        if MASKED:  # after the scale: a zero or negative temperature must not turn -inf into NaN / +inf
            z = gl.where(visible, z, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        p = _exp2(z - gl.expand_dims(m_new, 1), POLY)
    else:
        if MASKED:
            g = gl.where(visible, g, -float("inf"))
        if FIXED_SHIFT:
            m_new = m_i
            p = _exp2(g * row_scale - shift, POLY)
        else:
            # the scale folded into one FFMA per score: row_scale > 0, so max(g) * row_scale is
            # max(g * row_scale) exactly (rounding is monotone) and -inf stays -inf
            m_new = gl.maximum(m_i, gl.max(g, axis=1) * row_scale)
            p = _exp2(g * row_scale - gl.expand_dims(m_new, 1), POLY)
    # m is in log2 units and starts finite (alpha never NaN; a row with no visible key keeps m
    # finite and p = exp2(-inf) = 0)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _pipelined_block(j, r, p16, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     last_key, kv_len, row_scale, cap_scale, alsc_knee, shift, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, p_layout: gl.constexpr, CAP: gl.constexpr, HAS_TEMP: gl.constexpr,
                     FIXED_SHIFT: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EXP2_POLY: gl.constexpr, WARPGROUP: gl.constexpr,
                     PINGPONG: gl.constexpr):
    """Key block j with block j - 1's P V in flight (FA3's intra-warpgroup overlap): S_j = Q K_j^T and
    O += P_{j-1} V_{j-1} are issued back to back (PINGPONG: in this warpgroup's turn, `issue_qk_pv`); the
    softmax of S_j runs while the tensor cores do P_{j-1} V_{j-1}; then O is rescaled by alpha_j. r: block j's
    tile in the ring (j, plus the tiles of a persistent program's earlier work items). Returns (P_j, O, m, l)."""
    qk, k_tile, acc, v_tile = issue_qk_pv(r, p16, acc, q_smem, k_smem, v_smem, k_ready, v_ready, s_layout, BLOCK_M,
                                          BLOCK_N, STAGES, WARPGROUP, PINGPONG)
    qk, q_smem, k_tile = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_smem, k_tile))  # S_j done (groups retire in order)
    release(r, k_empty, STAGES)
    # exp2 and the row sums in fp32, in S's registers, while P_{j-1} V runs
    p, m_i, l_i, alpha = _softmax_block(qk, j, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee, shift,
                                        CAP, HAS_TEMP, FIXED_SHIFT, MASKED, CAUSAL, BLOCK_N, EXP2_POLY)
    # P_{j-1} among the deps: its registers stay live until the wgmma that reads them retired; P_j is
    # packed to 16 bits after that, into the registers P_{j-1} held (as FA3 orders it), so nothing in
    # the softmax writes a register the in-flight wgmma reads
    acc, v_tile, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, p16))
    release(r - 1, v_empty, STAGES)
    p_next = pv_operand(p, v_smem, p_layout)
    if not FIXED_SHIFT:
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return p_next, acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              O, LSE, TEMP, o_base, stride_on, lse_base, temp_base, stride_tn, m0, q_len, kv_len, n_full, n_tiles,
              out_scale, cap_scale, alsc_knee, shift, ring, q_phase, q_empty, CAP: gl.constexpr,
              HAS_TEMP: gl.constexpr, FIXED_SHIFT: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr,
              EXP2_POLY: gl.constexpr, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr,
              PERSISTENT: gl.constexpr = False):
    """One warpgroup (WARPGROUP 0 or 1): BLOCK_M (64) query rows from m0 against every key block of the
    program's range (the two consumers share the ring, and so the range: a block wholly masked for these
    rows gives p = 0). Key blocks [0, n_full) run unmasked, [n_full, n_tiles) masked; key block j is ring
    tile ring + j, the query tile's phase q_phase. PERSISTENT: one of a persistent program's work items,
    which arrives on q_empty once its last S = Q K^T retired (the producer then loads the next item's query
    tile). PINGPONG: the two consumers take turns at issuing their wgmmas (`gluon_pipeline`'s ping-pong
    protocol; both run the same n_tiles). Stores its rows of out and lse2."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # causal: the last key each row sees, min(row position, kv_len - 1) (negative: none)
    last_key = gl.minimum(m0 + (kv_len - q_len) + gl.arange(0, BLOCK_M, layout=row_layout), kv_len - 1)
    if HAS_TEMP:  # the row scale t_i * out_scale (rows past q_len: any finite value, never stored)
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        t = gl.load(TEMP + temp_base + rows.to(gl.int64) * stride_tn, mask=rows < q_len, other=1.0)
        row_scale = t.to(gl.float32) * out_scale
    else:
        row_scale = out_scale
    if FIXED_SHIFT:
        m_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout) + shift
    else:
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, q_phase)
    if n_tiles > 0:
        # block 0 alone (the accumulator is zero: nothing to rescale, no P V in flight)
        qk, k_tile = issue_first_qk(ring, q_smem, k_smem, k_ready, s_layout, BLOCK_M, BLOCK_N, STAGES, WARPGROUP,
                                    PINGPONG)
        qk, q_smem, k_tile = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_smem, k_tile))
        release(ring, k_empty, STAGES)
        if n_full > 0:
            p0, m_i, l_i, alpha0 = _softmax_block(qk, 0, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee,
                                                  shift, CAP, HAS_TEMP, FIXED_SHIFT, False, CAUSAL, BLOCK_N, EXP2_POLY)
        else:
            p0, m_i, l_i, alpha0 = _softmax_block(qk, 0, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee,
                                                  shift, CAP, HAS_TEMP, FIXED_SHIFT, True, CAUSAL, BLOCK_N, EXP2_POLY)
        p16 = pv_operand(p0, v_smem, p_layout)
        for j in range(1, n_full):
            p16, acc, m_i, l_i = _pipelined_block(j, ring + j, p16, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready,
                                                  v_ready, k_empty, v_empty, last_key, kv_len, row_scale, cap_scale,
                                                  alsc_knee, shift, s_layout, o_layout, p_layout, CAP, HAS_TEMP,
                                                  FIXED_SHIFT, False, CAUSAL, BLOCK_M, BLOCK_N, STAGES, EXP2_POLY,
                                                  WARPGROUP, PINGPONG)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            p16, acc, m_i, l_i = _pipelined_block(j, ring + j, p16, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready,
                                                  v_ready, k_empty, v_empty, last_key, kv_len, row_scale, cap_scale,
                                                  alsc_knee, shift, s_layout, o_layout, p_layout, CAP, HAS_TEMP,
                                                  FIXED_SHIFT, True, CAUSAL, BLOCK_M, BLOCK_N, STAGES, EXP2_POLY,
                                                  WARPGROUP, PINGPONG)
        if PERSISTENT:  # every S = Q K^T of the item has retired: the query tile is free
            gl.thread_barrier()
            mbarrier.arrive(q_empty)
        # the last block's P V
        acc, v_tile = issue_last_pv(ring + n_tiles - 1, p16, acc, v_smem, v_ready, STAGES, WARPGROUP, PINGPONG)
        acc, v_tile, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, p16))
        release(ring + n_tiles - 1, v_empty, STAGES)
    elif PERSISTENT:
        gl.thread_barrier()
        mbarrier.arrive(q_empty)

    seen = l_i != 0.0  # a row that saw no key has l = 0 exactly
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, m_i + gl.log2(l_safe), float("inf"))
    inv = gl.convert_layout(gl.where(seen, 1.0 / l_safe, 0.0), gl.SliceLayout(1, o_layout))
    out = acc * gl.expand_dims(inv, 1)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + o_base + gl.expand_dims(offs_m.to(gl.int64) * stride_on, 1) + gl.expand_dims(offs_d, 0)
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=gl.expand_dims(offs_m < q_len, 1))
    offs_l = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    gl.store(LSE + lse_base + offs_l, lse, mask=offs_l < q_len)


@gluon.jit
def _gluon_softmax_fwd_kernel(q_desc, k_desc, v_desc, O, LSE, TEMP,
                              stride_ob, stride_on, stride_oh, stride_tb, stride_tn,
                              H, GROUP, q_len, kv_len, out_scale, cap_scale, alsc_knee, shift,
                              CAP: gl.constexpr, HAS_TEMP: gl.constexpr, FIXED_SHIFT: gl.constexpr,
                              CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EXP2_POLY: gl.constexpr = 0,
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
    lse_base = bh.to(gl.int64) * q_len
    temp_base = b.to(gl.int64) * stride_tb
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     O, LSE, TEMP, o_base, stride_on, lse_base, temp_base, stride_tn, m0, q_len, kv_len, n_full,
                     n_tiles, out_scale, cap_scale, alsc_knee, shift, 0, 0, k_empty, CAP, HAS_TEMP, FIXED_SHIFT,
                     CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, EXP2_POLY, 0, PINGPONG)),
        (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     O, LSE, TEMP, o_base, stride_on, lse_base, temp_base, stride_tn, m0 + HALF_M, q_len, kv_len,
                     n_full, n_tiles, out_scale, cap_scale, alsc_knee, shift, 0, 0, k_empty, CAP, HAS_TEMP,
                     FIXED_SHIFT, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, EXP2_POLY, 1, PINGPONG)),
        (producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     b * q_len + m0, b * kv_len, hk * HEAD_DIM, h * HEAD_DIM, n_tiles, HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


@gluon.jit
def _persistent_consumer(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, TEMP,
                         stride_ob, stride_on, stride_oh, stride_tb, stride_tn, H, GROUP, BH, n_items, q_len, kv_len,
                         out_scale, cap_scale, alsc_knee, shift, CAP: gl.constexpr, HAS_TEMP: gl.constexpr,
                         FIXED_SHIFT: gl.constexpr, CAUSAL: gl.constexpr, HALF_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                         NUM_WARPS_C: gl.constexpr, EXP2_POLY: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of a persistent forward: `_consumer` on its half of each work item of the
    program (`gluon_pipeline.work_item`'s order, as the producer), the ring's tile count and the query tile's
    phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, TEMP,
                  b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh, stride_on, bh.to(gl.int64) * q_len,
                  b.to(gl.int64) * stride_tb, stride_tn, m0 + WARPGROUP * HALF_M, q_len, kv_len, n_full, n_tiles,
                  out_scale, cap_scale, alsc_knee, shift, ring, it & 1, q_empty, CAP, HAS_TEMP, FIXED_SHIFT, CAUSAL,
                  HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, EXP2_POLY, WARPGROUP, False, True)
        ring += n_tiles
        it += 1


@gluon.jit
def _gluon_softmax_fwd_persistent_kernel(q_desc, k_desc, v_desc, O, LSE, TEMP,
                                         stride_ob, stride_on, stride_oh, stride_tb, stride_tn,
                                         H, GROUP, q_len, kv_len, out_scale, cap_scale, alsc_knee, shift, BH,
                                         CAP: gl.constexpr, HAS_TEMP: gl.constexpr, FIXED_SHIFT: gl.constexpr,
                                         CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EXP2_POLY: gl.constexpr = 0):
    """The persistent form of `_gluon_softmax_fwd_kernel` (a grid of at most one program per SM, each
    running work items (query block, batch x head) in `gluon_pipeline.work_item`'s order): the same
    partitions and per-item work, the producer loading the next item's tiles while the consumers finish
    this one. Unordered consumers (no ping-pong)."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_items = gl.cdiv(q_len, BLOCK_M) * BH
    q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    q_empty = allocate_item_empty()
    gl.warp_specialize([
        (_persistent_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                                O, LSE, TEMP, stride_ob, stride_on, stride_oh, stride_tb, stride_tn, H, GROUP, BH,
                                n_items, q_len, kv_len, out_scale, cap_scale, alsc_knee, shift, CAP, HAS_TEMP,
                                FIXED_SHIFT, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, EXP2_POLY, 0)),
        (_persistent_consumer, (q_smem.index(1), k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                                O, LSE, TEMP, stride_ob, stride_on, stride_oh, stride_tb, stride_tn, H, GROUP, BH,
                                n_items, q_len, kv_len, out_scale, cap_scale, alsc_knee, shift, CAP, HAS_TEMP,
                                FIXED_SHIFT, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, EXP2_POLY, 1)),
        (persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                               k_empty, v_empty, q_len, kv_len, H, GROUP, BH, n_items, HEAD_DIM, HALF_M, BLOCK_N,
                               STAGES, CAUSAL, q_desc, q_smem, False)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)
    mbarrier.invalidate(q_empty)


# ---------------------------------------------------------------------------------------------
# host side


def gluon_softmax_forward(q, k, v, sm_scale: float, causal: bool):
    """(out (B, N, H, D) in q's dtype, lse2 (B, H, N) fp32) of plain softmax attention, Gluon /
    sm_90. q (B, N, H, D); k, v (B, KV, H_kv, D), H % H_kv == 0; D in {64, 128}; bf16 or fp16.
    Raises ValueError naming the requirement a call misses."""
    check_operands(q, k, v, causal, "gluon softmax forward")
    if not (math.isfinite(float(sm_scale)) and sm_scale > 0):  # the kernel's max of raw scores needs scale > 0
        raise ValueError(f"gluon softmax forward: sm_scale must be > 0 and finite, got {sm_scale}")
    return launch_forward(q, k, v, causal, float(sm_scale) * LOG2E)


@functools.cache
def _forward_plan(dtype, head_dim: int, causal: bool, cap: int, has_temp: bool, fixed_shift: bool, exp2_poly: int,
                  pingpong: bool, persistent: bool):
    """What every launch of one kernel form shares: (BLOCK_M, the query tile, the key / value tile, the
    constexprs; the persistent kernel has no PINGPONG)."""
    cfg = tile_config(head_dim)
    constexprs = dict(CAP=cap, HAS_TEMP=has_temp, FIXED_SHIFT=fixed_shift, CAUSAL=causal, HEAD_DIM=head_dim,
                      EXP2_POLY=exp2_poly, **({} if persistent else {"PINGPONG": pingpong}), **cfg)
    return (cfg["BLOCK_M"], tma_tile(dtype, cfg["BLOCK_M"] // 2, head_dim), tma_tile(dtype, cfg["BLOCK_N"], head_dim),
            constexprs)


_FORWARD = DirectLauncher(_gluon_softmax_fwd_kernel, "gluon_softmax_fwd")
_PERSISTENT_FORWARD = DirectLauncher(_gluon_softmax_fwd_persistent_kernel, "gluon_softmax_fwd_persistent")


def launch_forward(q, k, v, causal: bool, row_scale: float, *, cap: int = 0, cap_scale: float = 1.0,
                   alsc_knee: float = 0.0, shift: float | None = None, temperature=None, exp2_poly: int = 0,
                   pingpong: bool = False, persistent: bool = False):
    """The softmax family's forward without checks, for callers that checked the operands once (the
    softmax family's launch plans): logits z_ij = t_i * row_scale * cap(q_i.k_j) in log2 units, where
    cap is `_cap`'s CAP (with its `cap_scale`, `alsc_knee`) and t the optional (B, N) `temperature`
    (any float dtype, any strides). row_scale must be > 0 without a temperature. `shift`: a bound B of
    |z| (a cap's c log2 e, no temperature) that p = exp2(z - B) uses instead of a running max, so p
    lies in [2^-2B, 1] (the caller keeps 2B within bf16 P's range); None for the online softmax.
    `exp2_poly`: 0, or the degree (3 for bf16 P, 4 for fp16) of the polynomial exp2 of unmasked key
    blocks (`_exp2`). `pingpong`: the two consumer warpgroups take turns at issuing their wgmmas
    (`gluon_pipeline`'s ping-pong). `persistent`: the persistent kernel (one program per SM running work
    items in turn; not with `pingpong`). Returns (out, lse2)."""
    import torch

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    has_temp = temperature is not None
    if persistent and pingpong:
        raise ValueError("gluon softmax forward: the persistent kernel has no ping-pong schedule")
    block_m, q_tile, kv_tile, constexprs = _forward_plan(q.dtype, d, causal, cap, has_temp, shift is not None,
                                                         exp2_poly, bool(pingpong), bool(persistent))
    out = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((bsz, h, n), device=q.device, dtype=torch.float32)
    temp, (stride_tb, stride_tn) = (temperature, temperature.stride()) if has_temp else (lse, (0, 0))
    descriptors = (descriptor(tma_view(q), q_tile), descriptor(tma_view(k), kv_tile), descriptor(tma_view(v), kv_tile))
    scalars = (n * h * d, h * d, d, stride_tb, stride_tn,  # out's strides (contiguous), the temperature's
               h, h // h_kv, n, kv_len, float(row_scale), float(cap_scale), float(alsc_knee),
               0.0 if shift is None else float(shift))
    if persistent:
        _PERSISTENT_FORWARD.run((persistent_programs(cdiv(n, block_m) * bsz * h, q.device),), descriptors,
                                (out, lse, temp), (*scalars, bsz * h), constexprs, GLUON_OPTIONS)
    else:
        _FORWARD.run((cdiv(n, block_m), bsz * h), descriptors, (out, lse, temp), scalars, constexprs, GLUON_OPTIONS)
    return out, lse



def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90, cap: int = 0,
                 has_temp: bool = False, fixed_shift: bool = False, exp2_poly: int = 0, pingpong: bool = False,
                 persistent: bool = False):
    """The kernel (`persistent`: the persistent one) compiled for sm_<arch> without a GPU
    (`gluon_pipeline.compile_sm90`)."""
    signature = {"O": f"*{dtype}", "LSE": "*fp32", "TEMP": "*fp32",
                 "stride_ob": "i32", "stride_on": "i32", "stride_oh": "i32", "stride_tb": "i32", "stride_tn": "i32",
                 "H": "i32", "GROUP": "i32", "q_len": "i32", "kv_len": "i32", "out_scale": "fp32",
                 "cap_scale": "fp32", "alsc_knee": "fp32", "shift": "fp32",
                 "CAP": "constexpr", "HAS_TEMP": "constexpr", "FIXED_SHIFT": "constexpr", "CAUSAL": "constexpr",
                 "EXP2_POLY": "constexpr", "PINGPONG": "constexpr"}
    constexprs = {"CAP": cap, "HAS_TEMP": has_temp, "FIXED_SHIFT": fixed_shift, "CAUSAL": causal,
                  "EXP2_POLY": exp2_poly, "PINGPONG": bool(pingpong)}
    if persistent:
        del signature["PINGPONG"], constexprs["PINGPONG"]
        signature["BH"] = "i32"
        return compile_kernel(_gluon_softmax_fwd_persistent_kernel, head_dim, dtype, signature, constexprs,
                              ("O", "LSE"), arch)
    return compile_kernel(_gluon_softmax_fwd_kernel, head_dim, dtype, signature, constexprs, ("O", "LSE"), arch)
