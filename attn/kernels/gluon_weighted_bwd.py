"""The threshold and sigmoid families' attention backward in Gluon for sm_90 (Hopper).

Inputs and outputs are the portable backwards' (`threshold_family._backward_plan` for the one-map
threshold, `sigmoid_family._backward_plan`): q, dout (B, N, H, D); k, v (B, KV, H_kv, D), H % H_kv == 0;
causal is bottom-right aligned (query row i at key position i + KV - N). Returns dq, dk, dv in the
inputs' dtype. Neither family normalizes its rows, so the forward saves nothing and there is no
preprocessing pass (no logsumexp, no delta). Their row parameters (beta, p; the bias or -ln n_i) are
constants of the spec or of the mask: no gradient flows to them, and the portable backwards return
none. With dp_ij = dout_i . v_j (DESIGN.md §4):

    threshold  x_ij = q_i.k_j - tau_i, tau_i = beta sqrt(2 ln n_i / D)
               w = relu(x)^p,  g = relu(x)^(p-1) (0 where x <= 0),  ds = dp g
               dv = w^T dout,  dk = p ds^T q,  dq = p ds k
    sigmoid    x_ij = -(s q_i.k_j + b_i) log2 e,  b_i = the spec's bias or -ln n_i
               w = 1 / (1 + 2^x),  g = w (1 - w),  ds = dp g
               dv = w^T dout,  dk = s ds^T q,  dq = s ds k

(n_i: the keys row i sees; the constant factor p or s is applied once, at the store). w and g come
from one evaluation per score: threshold p = 1 / 2 with no MUFU op, any other p with MUFU lg2 and ex2 (inline PTX);
the sigmoid with MUFU ex2 and rcp (the portable backward's default "mufu_approx" path) or, with
`newton`, MUFU ex2 and a Newton reciprocal.

Two launches, the schedule of `gluon_softmax_bwd` (whose producers, query-block ranges and wgmma
issue helper these kernels import):

1. `_dkdv_kernel`, FlashAttention-3's key-block schedule: one program per 128 keys of one (batch, kv
   head); a 1-warp producer TMA-loads K and V once, then Q and dO of every query block that sees the
   keys, for every query head of the kv head's group, into a ring. Two consumer warpgroups own 64 keys
   each and per query block issue S^T = K Q^T + c (c per query column as the accumulator's start:
   -tau_i for the threshold, so S^T is x itself; b_i / s for the sigmoid, so x = -s log2 e S^T) and
   dP^T = V dO^T back to back; W^T and G^T as soon as S^T lands, dV += W^T dO issued while dP^T still
   runs, then dS^T = dP^T G^T and dK += dS^T Q. dK, dV stay in registers across the program (GQA:
   summed over the group's heads) and are stored once.
2. `_dq_kernel`, the forwards' query-block schedule: one program per 128 query rows of one (batch,
   head), Q and dO loaded once, K and V streamed through the ring; per key block S = Q K^T and
   dP = dO V^T back to back, G, dS = dP G, dQ += dS K. dq is written once: no atomics, the same bits
   every run.

Both also run on the persistent grid (`persistent`: at most one program per SM running work items in turn,
`gluon_softmax_bwd.persistent_dkdv_producer` and `gluon_pipeline.persistent_producer` loading the next item's
tiles while this one stores its gradients), each item's arithmetic the per-item kernel's: the same bits
(tests/test_gluon_weighted_bwd_gpu.py -k persistent, on the GPU). The plans offer it
(`tiers.PERSISTENT_BACKWARDS_OFFERED`): ATTNLAB_GLUON_PERSISTENT picks the grid, "auto" times both per key.

The one-pass form (`one_pass=True`, per item; not offered by the plans until its GPU tests pass): the softmax
family's FlashAttention-3 dQ path (`gluon_softmax_bwd`'s one-pass form) in the key-block kernel
(`_dkdv_dq_kernel`): each tile's dS^T also goes to a shared dS, and each warpgroup adds its D / 2 columns of
dS K over the program's keys into a zeroed fp32 dq by TMA reduce-adds; dq = grad_scale dq_acc in q's dtype
after. dk and dv are the separate form's bits; dq's sums arrive in no fixed order.

Masks: key-block programs visit only query blocks that see their keys; the causal diagonal's blocks
compare per score, the rest run without mask arithmetic. Query rows past N (a TMA tile running into the
next batch's rows) start S^T at -1e30: x = -1e30 gives w = g = 0 for the threshold, and for the sigmoid
(s > 0, which the spec enforces) z = s (S - 1e30) gives w = g = 0; keys past KV in a key-block program
touch only their own dK / dV rows, which are not stored. The dQ kernel masks keys as the forwards do
(`gluon_pipeline.visible_key`). A NaN score gives NaN gradients, as the reference does.

Served: what the Gluon forwards serve (`gluon_weighted_fwd`): one score map, no segments, window,
key lengths or dropout; causal or full; GQA; D 64 / 128; bf16 / fp16; KV >= N (KV < N also works: rows
that see no key get zero gradient).
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
    GLUON_OPTIONS,
    LOG2E,
    PRODUCER_REGS,
    allocate_item_empty,
    allocate_ring,
    check_operands,
    compile_gluon_sm90,
    descriptor,
    descriptor_type,
    invalidate_ring,
    issue_qk,
    key_blocks,
    mbarrier,
    persistent_item,
    persistent_producer,
    persistent_programs,
    program_rows,
    release,
    tma_view,
    visible_key,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from attn.kernels.gluon_softmax_bwd import (
    _dkdv_producer,
    _dq_cast_kernel,
    _dq_producer,
    _issue_with_columns,
    CAST_BLOCK,
    add_dq_tile,
    allocate_one_pass_key_block,
    backward_tiles,
    dq_accumulator_block,
    dq_accumulator_tile,
    dq_staging_layout,
    dkdv_tile_config,
    dq_tile_config,
    finish_key_block,
    key_block_item,
    key_block_program,
    one_pass_key_block_program,
    persistent_dkdv_producer,
    publish_ds,
    reduce_dq_tile,
)
from attn.kernels.gluon_weighted_fwd import (
    SIGMOID,
    THRESHOLD,
    TINY,
    _ex2,
    _lg2,
    _rcp,
    _rcp_newton,
    _row_value,
    power_mode,
)
from attn.kernels.runtime import DirectLauncher, cdiv

# True: the key-block loops compute each query block's starts during the block before (`_dkdv_block`'s
# AHEAD; in the SASS a block's first product issues 34 instructions earlier at D = 128). Off: the same bits,
# no faster on an H100 (0.98-1.00x, scripts/gpu_checks/ab_gluon_backward.py; docs/gluon.md).
ROW_VALUES_AHEAD = gl.constexpr(False)
DEAD_ROW_START = gl.constexpr(-1.0e30)  # S^T's start for query rows past N: w = g = 0 (module docstring)
# the sigmoid's reciprocal in the backward: MUFU.RCP (0), as the portable backward's default path
SIGMOID_BWD_NEWTON_STEPS = 0


@gluon.jit
def _weight_and_grad(x, visible, power, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, NEWTON: gl.constexpr,
                     MASKED: gl.constexpr):
    """(w, g) per score from x (module docstring; the threshold's g without the factor p), both 0 where
    `visible` is false (MASKED). A NaN score gives NaN. Threshold p = 1: g is relu(x) itself, which
    `_score_grad` reads as the indicator x > 0 (w and g share their registers)."""
    if WEIGHT == THRESHOLD:
        if MASKED:  # relu(-inf) = 0: the select rides on x, before either function
            x = gl.where(visible, x, -float("inf"))
        relu = gl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
        if POWER_MODE == 1:
            w = relu
            g = relu
        elif POWER_MODE == 2:
            w = relu * relu
            g = relu
        else:  # relu is 0 for x <= 0 and NaN for a NaN score, so it stands in where no power is taken
            g = gl.where(x > 0.0, _ex2((power - 1.0) * _lg2(gl.maximum(x, TINY))), relu)
            w = g * relu
    else:
        if NEWTON > 0:  # the Newton guess needs 1 + 2^x <= 2^126: w = 2^-126 from there on
            w = _rcp_newton(1.0 + _ex2(gl.minimum(x, 126.0, propagate_nan=tl.PropagateNan.ALL)), NEWTON)
        else:
            w = _rcp(1.0 + _ex2(x))
        if MASKED:
            w = gl.where(visible, w, 0.0)
        g = w - w * w
    return w, g


@gluon.jit
def _score_grad(dp, g, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr):
    """dS = dP g; threshold p = 1 (g = relu(x)): dP where relu(x) > 0, else relu(x) (0, or NaN for a NaN
    score), a select instead of a product."""
    if WEIGHT == THRESHOLD and POWER_MODE == 1:
        ds = gl.where(g > 0.0, dp, g)
    else:
        ds = dp * g
    return ds


# ---------------------------------------------------------------------------- dK, dV (key blocks)


@gluon.jit
def _query_starts(m, q_len, kv_len, start_scale, row_param, WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                  CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """S^T's start per query row [m, m + BLOCK_M), one per thread of the warpgroup: the row value of
    `gluon_weighted_fwd._row_value` (tau_i, or b_i log2 e) times start_scale (-1, or 1 / (s log2 e)),
    DEAD_ROW_START past q_len."""
    flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[gl.num_warps()],
                                          order=[0])
    rows = m + gl.arange(0, BLOCK_M, layout=flat)
    start = _row_value(rows, kv_len, q_len, row_param, WEIGHT, HAS_BIAS, CAUSAL) * start_scale
    return gl.where(rows < q_len, start, DEAD_ROW_START)


@gluon.jit
def _dkdv_block(j, m, m_next, start, dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty,
                q_len, kv_len, first_col, score_scale, start_scale, row_param, power, st_layout: gl.constexpr,
                a_layout: gl.constexpr, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                NEWTON: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr, HALF_N: gl.constexpr,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr, lam=1.0, SCALED: gl.constexpr = False,
                AHEAD: gl.constexpr = False, dq_path=0, ONE_PASS_DQ: gl.constexpr = False,
                DQ_OWN: gl.constexpr = False, dlam_rows=0, DLAM: gl.constexpr = False):
    """One warpgroup's keys against the query block from row m (ring tile j): S^T (from `start`, this
    block's `_query_starts`) and dP^T issued back to back; then, while they run, the starts of the block
    from row m_next (the next block's: computed here, their logf and sqrt stay off the next block's path to
    its first product); W^T, G^T once S^T is in and dV += W^T dO issued at once; dS^T = dP^T G^T
    once dP^T is in and dK += dS^T Q; dO's slot handed back when dV retired, Q's when dK did. MASKED: the
    causal compare, key row r visible to query column c when c >= first_col[r] - m. SCALED (the
    differential threshold's second view): W^T times lam and dS^T times -lam p per score. Not AHEAD (for
    a caller whose loop spills with the next starts live): the block computes its own starts from m and
    `start` passes through. ONE_PASS_DQ (the one-pass form, `_dkdv_dq_kernel`): dS^T also goes to the shared dS
    (`gluon_softmax_bwd.publish_ds`) and, once dK and dV retired, this warpgroup's half of the tile's dQ columns
    into the fp32 dq (`gluon_softmax_bwd.add_dq_tile`); dq_path = (ds_smem, ds_rows, k_cols, dq_staging,
    dq_desc, ds_ready, ds_free, the tile's first row and first column of dq). DQ_OWN (the differential
    view-warpgroup one-pass kernel, whose warpgroups share no keys' dS): dS^T goes to this warpgroup's own dS and
    it adds all D columns of the tile's dQ (`add_own_dq_tile`); dq_path = (ds_smem, ds_rows, the K tile,
    its two staging tiles, dq_desc, -, -, row, column). DLAM (the differential second view, p = 1 or 2): dlam_rows (one
    value per key row) gains the tile's d-lambda terms dP W = dS g (before the factor -lam p), and is returned
    last. Returns (dk, dv, the next block's starts[, dlam_rows])."""
    if not AHEAD:
        start = _query_starts(m, q_len, kv_len, start_scale, row_param, WEIGHT, HAS_BIAS, CAUSAL, BLOCK_M)
    s_t, q_tile = _issue_with_columns(j, k_tile, q_ring, q_ready, start, st_layout, HALF_N, BLOCK_M, STAGES)
    dp_t, do_tile = issue_qk(j, v_tile, do_ring, do_ready, st_layout, HALF_N, BLOCK_M, STAGES)
    if AHEAD:
        start_next = _query_starts(m_next, q_len, kv_len, start_scale, row_param, WEIGHT, HAS_BIAS, CAUSAL, BLOCK_M)
    else:
        start_next = start
    s_t, k_tile, q_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, k_tile, q_tile))  # S^T retired
    if WEIGHT == THRESHOLD:
        x = s_t
    else:
        x = s_t * score_scale
    visible = 0
    if MASKED:
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        visible = gl.expand_dims(cols, 0) >= gl.expand_dims(first_col - m, 1)
    w_t, g_t = _weight_and_grad(x, visible, power, WEIGHT, POWER_MODE, NEWTON, MASKED)
    if SCALED:
        w_t = w_t * lam
    w16 = gl.convert_layout(w_t.to(q_ring.dtype), a_layout)
    dv = warpgroup_mma(w16, do_tile, dv, is_async=True)
    dp_t, v_tile, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, v_tile, do_tile))  # dP^T retired
    ds_t = _score_grad(dp_t, g_t, WEIGHT, POWER_MODE)
    if DLAM:  # dP relu(x)^p = dS g at p = 1 (g = relu(x), dS = dP where it is > 0) and at p = 2 (dS = dP g)
        gl.static_assert(POWER_MODE != 0, "the d-lambda terms as dS g hold for p = 1 and 2 only")
        dlam_rows += gl.sum(ds_t * g_t, axis=1)
    if SCALED:
        ds_t = ds_t * (-lam * power)
    ds_t16 = ds_t.to(q_ring.dtype)
    ds16 = gl.convert_layout(ds_t16, a_layout)
    if ONE_PASS_DQ:
        if DQ_OWN:  # this warpgroup's own dS: its loads of the previous tile's are behind add_own_dq_tile's barrier
            dq_path[1].store(ds_t16)
        else:
            publish_ds(j, ds_t16, dq_path[1], dq_path[5], dq_path[6])
    dk = warpgroup_mma(ds16, q_tile, dk, is_async=True)
    dv, w16, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dv, w16, do_tile))
    release(j, do_empty, STAGES)
    dk, ds16, q_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds16, q_tile))
    release(j, q_empty, STAGES)
    if ONE_PASS_DQ:
        if DQ_OWN:
            add_own_dq_tile(j, dq_path[0], dq_path[2], dq_path[3], dq_path[4], dq_path[7], dq_path[8], BLOCK_M,
                            dk.shape[1], dq_path[3].shape[2])
        else:
            DQ_COLS: gl.constexpr = dk.shape[1] // 2
            # the consumer partitions are one warpgroup each (the kernels assert 4 warps)
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, DQ_COLS, 16])
            add_dq_tile(j, dq_path[0], dq_path[2], dq_path[3], dq_path[4], dq_path[5], dq_path[6], dq_path[7],
                        dq_path[8], dq_layout, HALF_N, BLOCK_M, DQ_COLS)
    result = (dk, dv, start_next)
    if DLAM:
        result = (dk, dv, start_next, dlam_rows)
    return result


@gluon.jit
def add_own_dq_tile(j, ds_smem, k_tile, dq_staging, dq_desc, dq_row, dq_col, BLOCK_M: gl.constexpr,
                    HEAD_DIM: gl.constexpr, DQ_COLS: gl.constexpr):
    """One warpgroup's whole dQ tile (ring tile j) from its own dS (ds_smem, BLOCK_M queries x the K tile's keys,
    filled by this warpgroup) once its dV and dK products retired: dS loaded to registers (ldmatrix), then per
    DQ_COLS columns of the head dim dQ = dS K[:, cols] (a BLOCK_M x DQ_COLS fp32 accumulator) added to the fp32
    dq at (dq_row, dq_col + the columns' first) through dq_staging, two staging tiles taken in turn, so that a
    part's reduce waits for the one two parts back, not for the one just issued
    (`gluon_softmax_bwd.reduce_dq_tile`)."""
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    ds_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    gl.thread_barrier()  # every warp's rows of dS^T are in ds_smem
    ds = ds_smem.load(ds_operand)
    gl.thread_barrier()  # every warp has loaded dS before the next tile's rows go in
    PARTS: gl.constexpr = HEAD_DIM // DQ_COLS
    REDUCES: gl.constexpr = DQ_COLS // dq_desc.block_type.shape[1]  # bulk groups per part
    for part in gl.static_range(PARTS):
        k_cols = k_tile.slice(part * DQ_COLS, DQ_COLS, dim=1)
        dq = warpgroup_mma(ds, k_cols, gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout), use_acc=False,
                           is_async=True)
        dq, ds, k_cols = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds, k_cols))
        reduce_dq_tile(dq, dq_staging.index((j * PARTS + part) % 2), dq_desc, dq_row, dq_col + part * DQ_COLS,
                       DQ_COLS, REDUCES)


@gluon.jit
def _next_block_row(i, i_lo, i_hi, BLOCK_M: gl.constexpr):
    """The first row of the query block after block i in a key-block loop over blocks [i_lo, i_hi) per
    head: block i + 1's, or block i_lo's after the last (the next head's first block: the starts do not
    depend on the head)."""
    return gl.where(i + 1 == i_hi, i_lo, i + 1) * BLOCK_M


@gluon.jit
def _dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, b, hk,
                   key0, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, GROUP, q_len, kv_len,
                   i_lo, i_full, i_hi, score_scale, start_scale, row_param, power, grad_scale, ring, kv_phase,
                   kv_empty, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                   NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr,
                   PERSISTENT: gl.constexpr = False, one_pass=0, ONE_PASS_DQ: gl.constexpr = False):
    """One warpgroup: keys [key0, key0 + HALF_N) against every query block of the program's range for
    each query head of the group; stores its rows of dk (times grad_scale) and dv. The ring's tiles start at
    ring, K's and V's phase is kv_phase. PERSISTENT: one of a persistent program's work items, which arrives
    on kv_empty once its last product retired (the producer then loads the next item's K and V).
    ONE_PASS_DQ: also adds dq's columns [dq_col0, dq_col0 + D / 2) of every (query head, query block) tile
    (of the query head's D columns) to the fp32 dq; one_pass = (ds_smem, ds_rows, k_cols, dq_staging, dq_desc,
    ds_ready, ds_free, dq_col0) (`gluon_softmax_bwd.allocate_dq_path`). The dQ product runs over all the
    program's keys, so keys past kv_len must have dS = 0: causal, the masked blocks' compare hides them (such a
    key is visible only to query columns past q_len, whose scores start at DEAD_ROW_START); full, the compare is
    key < kv_len, and `_dkdv_dq_kernel` makes every block of a program whose keys run past kv_len a masked one."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    # causal: key row r is visible to query rows i >= key - (kv_len - q_len)
    key_rows = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, st_layout))
    first_col = key_rows - (kv_len - q_len)
    if ONE_PASS_DQ and not CAUSAL:  # every query sees a key before kv_len, none one past it
        first_col = gl.where(key_rows < kv_len, 0, 1 << 30)
    AHEAD: gl.constexpr = ROW_VALUES_AHEAD and not ONE_PASS_DQ
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    count = i_hi - i_lo
    start = _query_starts(i_lo * BLOCK_M, q_len, kv_len, start_scale, row_param, WEIGHT, HAS_BIAS, CAUSAL, BLOCK_M)

    mbarrier.wait(kv_bar, kv_phase)
    for gi in range(GROUP):  # the row values do not depend on the head: only the ring tiles move on
        j0 = ring + gi * count - i_lo  # ring tile of query block i: j0 + i
        dq_col = 0
        if ONE_PASS_DQ:
            dq_col = (hk * GROUP + gi) * HEAD_DIM + one_pass[7]  # this warpgroup's first column of dq
        if CAUSAL or ONE_PASS_DQ:
            for i in range(i_lo, i_full):
                dq_path = 0
                if ONE_PASS_DQ:  # the tile's buffers and its first row and column of dq
                    dq_path = (one_pass[0], one_pass[1], one_pass[2], one_pass[3], one_pass[4], one_pass[5],
                               one_pass[6], b * q_len + i * BLOCK_M, dq_col)
                dk, dv, start = _dkdv_block(j0 + i, i * BLOCK_M, _next_block_row(i, i_lo, i_hi, BLOCK_M), start,
                                            dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty,
                                            do_empty, q_len, kv_len, first_col, score_scale, start_scale, row_param,
                                            power, st_layout, a_layout, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL,
                                            True, HALF_N, BLOCK_M, STAGES, AHEAD=AHEAD,
                                            dq_path=dq_path, ONE_PASS_DQ=ONE_PASS_DQ)
        for i in range(i_full, i_hi):
            dq_path = 0
            if ONE_PASS_DQ:
                dq_path = (one_pass[0], one_pass[1], one_pass[2], one_pass[3], one_pass[4], one_pass[5], one_pass[6],
                           b * q_len + i * BLOCK_M, dq_col)
            dk, dv, start = _dkdv_block(j0 + i, i * BLOCK_M, _next_block_row(i, i_lo, i_hi, BLOCK_M), start, dk, dv,
                                        k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty, q_len,
                                        kv_len, first_col, score_scale, start_scale, row_param, power, st_layout,
                                        a_layout, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, False, HALF_N, BLOCK_M,
                                        STAGES, AHEAD=AHEAD,
                                        dq_path=dq_path, ONE_PASS_DQ=ONE_PASS_DQ)
    finish_key_block(dk, dv, DK, DV, b, hk, key0, kv_len, grad_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                     stride_dvn, stride_dvh, kv_empty, kv_layout, ONE_PASS_DQ, PERSISTENT, HALF_N, HEAD_DIM)


@gluon.jit
def _dkdv_kernel(k_desc, v_desc, q_desc, do_desc, DK, DV,
                 stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                 H_KV, GROUP, q_len, kv_len, score_scale, start_scale, row_param, power, grad_scale,
                 WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr,
                 CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """Program (key block, batch x kv head): keys [n0, n0 + BLOCK_N), two consumer warpgroups of
    BLOCK_N / 2 keys each (the default partition and a 4-warp worker) and a 1-warp TMA producer."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_N: gl.constexpr = BLOCK_N // 2
    b, hk, n0, i_lo, i_full, i_hi = key_block_program(H_KV, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    k_halves, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = allocate_ring(
        k_desc, q_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
    v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)

    gl.warp_specialize([
        (_dkdv_consumer, (k_halves.index(0), v_halves.index(0), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, b, hk, n0, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn,
                          stride_dvh, GROUP, q_len, kv_len, i_lo, i_full, i_hi, score_scale, start_scale, row_param,
                          power, grad_scale, 0, 0, kv_bar, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_N,
                          BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dkdv_consumer, (k_halves.index(1), v_halves.index(1), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, b, hk, n0 + HALF_N, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                          stride_dvn, stride_dvh, GROUP, q_len, kv_len, i_lo, i_full, i_hi, score_scale, start_scale,
                          row_param, power, grad_scale, 0, 0, kv_bar, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL,
                          HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready,
                          do_ready, q_empty, do_empty, b * kv_len + n0, hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo,
                          i_hi, HALF_N, HEAD_DIM, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)


@gluon.jit
def _dkdv_dq_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, DK, DV,
                    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                    H_KV, GROUP, q_len, kv_len, score_scale, start_scale, row_param, power, grad_scale,
                    WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr,
                    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr):
    """`_dkdv_kernel` with FlashAttention-3's dQ path (the one-pass form, as `gluon_softmax_bwd._dkdv_dq_kernel`):
    every tile's dS K also goes into the fp32 dq behind dq_desc ((B N, H D), BLOCK_M x D / 2 boxes) by TMA
    reduce-add, each consumer warpgroup adding half of the head dim's columns over all BLOCK_N keys; dS carries
    no factor p (or s): the scale-and-cast applies grad_scale. Shared memory at D = 128: 160 KiB of K, V and the
    ring, 16 KiB of dS, 2 x 16 KiB of staging. Without the causal mask, every query block of a program whose
    keys run past kv_len runs masked (`_dkdv_consumer` hides those keys from dq)."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_N: gl.constexpr = BLOCK_N // 2
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    b, hk, n0, i_lo, i_full, i_hi = one_pass_key_block_program(H_KV, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    (k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, ds_smem, ds_rows_0, ds_rows_1,
     k_cols_0, k_cols_1, staging_0, staging_1, ds_ready, ds_free) = allocate_one_pass_key_block(
        k_desc, v_desc, q_desc, do_desc, dq_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES, DQ_COLS)

    gl.warp_specialize([
        (_dkdv_consumer, (k_halves.index(0), v_halves.index(0), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, b, hk, n0, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn,
                          stride_dvh, GROUP, q_len, kv_len, i_lo, i_full, i_hi, score_scale, start_scale, row_param,
                          power, grad_scale, 0, 0, kv_bar, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_N,
                          BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, False,
                          (ds_smem, ds_rows_0, k_cols_0, staging_0, dq_desc, ds_ready, ds_free, 0), True)),
        (_dkdv_consumer, (k_halves.index(1), v_halves.index(1), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, b, hk, n0 + HALF_N, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                          stride_dvn, stride_dvh, GROUP, q_len, kv_len, i_lo, i_full, i_hi, score_scale, start_scale,
                          row_param, power, grad_scale, 0, 0, kv_bar, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL,
                          HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, False,
                          (ds_smem, ds_rows_1, k_cols_1, staging_1, dq_desc, ds_ready, ds_free, DQ_COLS), True)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready,
                          do_ready, q_empty, do_empty, b * kv_len + n0, hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo,
                          i_hi, HALF_N, HEAD_DIM, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    mbarrier.invalidate(ds_ready)
    mbarrier.invalidate(ds_free)


@gluon.jit
def _persistent_dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty,
                              do_empty, DK, DV, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                              H_KV, GROUP, BHK, n_items, q_len, kv_len, score_scale, start_scale, row_param, power,
                              grad_scale, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                              NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr,
                              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr,
                              WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent key-block kernel: `_dkdv_consumer` on its half of each work
    item of the program (`key_block_item`'s order, as the producer), the ring's tile count and K's and V's
    phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0, i_lo, i_full, i_hi = key_block_item(t, H_KV, BHK, q_len, kv_len, CAUSAL, BLOCK_M, 2 * HALF_N)
        _dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, b, hk,
                       n0 + WARPGROUP * HALF_N, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                       GROUP, q_len, kv_len, i_lo, i_full, i_hi, score_scale, start_scale, row_param, power, grad_scale,
                       ring, it & 1, kv_empty, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM,
                       STAGES, NUM_WARPS_C, True)
        ring += GROUP * (i_hi - i_lo)
        it += 1


@gluon.jit
def _persistent_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, DK, DV,
                            stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                            H_KV, GROUP, q_len, kv_len, score_scale, start_scale, row_param, power, grad_scale, BHK,
                            WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                            NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The persistent form of `_dkdv_kernel` (a grid of at most one program per SM, each running work items
    (key block, batch x kv head) in `key_block_item`'s order): the same partitions and per-item work, the
    producer loading the next item's tiles while the consumers finish this one and store its dk and dv."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_N: gl.constexpr = BLOCK_N // 2
    n_items = gl.cdiv(kv_len, BLOCK_N) * BHK
    k_halves, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = allocate_ring(
        k_desc, q_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
    v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
    kv_empty = allocate_item_empty()
    gl.warp_specialize([
        (_persistent_dkdv_consumer, (k_halves.index(0), v_halves.index(0), q_ring, do_ring, kv_bar, kv_empty, q_ready,
                                     do_ready, q_empty, do_empty, DK, DV, stride_dkb, stride_dkn, stride_dkh,
                                     stride_dvb, stride_dvn, stride_dvh, H_KV, GROUP, BHK, n_items, q_len, kv_len,
                                     score_scale, start_scale, row_param, power, grad_scale, WEIGHT, POWER_MODE,
                                     HAS_BIAS, NEWTON, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
        (_persistent_dkdv_consumer, (k_halves.index(1), v_halves.index(1), q_ring, do_ring, kv_bar, kv_empty, q_ready,
                                     do_ready, q_empty, do_empty, DK, DV, stride_dkb, stride_dkn, stride_dkh,
                                     stride_dvb, stride_dvn, stride_dvh, H_KV, GROUP, BHK, n_items, q_len, kv_len,
                                     score_scale, start_scale, row_param, power, grad_scale, WEIGHT, POWER_MODE,
                                     HAS_BIAS, NEWTON, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
        (persistent_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar,
                                    kv_empty, q_ready, do_ready, q_empty, do_empty, H_KV, GROUP, BHK, n_items, q_len,
                                    kv_len, HALF_N, HEAD_DIM, BLOCK_M, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    mbarrier.invalidate(kv_empty)


# ------------------------------------------------------------------------------- dQ (query blocks)


@gluon.jit
def _dq_block(j, r, dq, q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, row_value, last_key,
              kv_len, score_scale, power, s_layout: gl.constexpr, a_layout: gl.constexpr, WEIGHT: gl.constexpr,
              POWER_MODE: gl.constexpr, NEWTON: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
              HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block j (ring tile r) for one warpgroup's rows: S = Q K^T and dP = dO V^T back to back, G as soon
    as S is in, V's slot back once dP retired, dS = dP G, dQ += dS K, K's slot back once that retired."""
    s, k_tile = issue_qk(r, q_tile, k_ring, k_ready, s_layout, HALF_M, BLOCK_N, STAGES)
    dp, v_tile = issue_qk(r, do_tile, v_ring, v_ready, s_layout, HALF_M, BLOCK_N, STAGES)
    s, q_tile, k_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s, q_tile, k_tile))  # S retired
    if WEIGHT == THRESHOLD:
        x = s - gl.expand_dims(row_value, 1)
    else:
        x = s * score_scale - gl.expand_dims(row_value, 1)  # one FFMA per score
    visible = 0
    if MASKED:
        visible = visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N)
    w, g = _weight_and_grad(x, visible, power, WEIGHT, POWER_MODE, NEWTON, MASKED)
    dp, do_tile, v_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp, do_tile, v_tile))  # dP retired
    release(r, v_empty, STAGES)
    ds16 = gl.convert_layout(_score_grad(dp, g, WEIGHT, POWER_MODE).to(k_ring.dtype), a_layout)
    dq = warpgroup_mma(ds16, k_tile, dq, is_async=True)
    dq, k_tile, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, k_tile, ds16))
    release(r, k_empty, STAGES)
    return dq


@gluon.jit
def _dq_consumer(q_tile, do_tile, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, DQ, dq_base, stride_dqn,
                 m0, q_len, kv_len, n_full, n_tiles, score_scale, row_param, power, grad_scale, ring, q_phase,
                 q_empty, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
                 NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr,
                 PERSISTENT: gl.constexpr = False):
    """One warpgroup: rows [m0, m0 + HALF_M) against the program's key blocks ([0, n_full) unmasked,
    [n_full, n_tiles) masked); key block j is ring tile ring + j, Q's and dO's phase q_phase; stores its rows
    of dq (times grad_scale). PERSISTENT: one of a persistent program's work items, which arrives on q_empty
    once its last product retired (the producer then loads the next item's Q and dO)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    row_value = _row_value(rows, kv_len, q_len, row_param, WEIGHT, HAS_BIAS, CAUSAL)
    # causal: the last key each row sees, min(row position, kv_len - 1) (negative: none)
    last_key = gl.minimum(rows + (kv_len - q_len), kv_len - 1)
    dq = gl.zeros([HALF_M, HEAD_DIM], gl.float32, dq_layout)

    mbarrier.wait(q_bar, q_phase)
    for j in range(0, n_full):
        dq = _dq_block(j, ring + j, dq, q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
                       row_value, last_key, kv_len, score_scale, power, s_layout, a_layout, WEIGHT, POWER_MODE, NEWTON,
                       False, CAUSAL, HALF_M, BLOCK_N, STAGES)
    for j in range(n_full, n_tiles):
        dq = _dq_block(j, ring + j, dq, q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
                       row_value, last_key, kv_len, score_scale, power, s_layout, a_layout, WEIGHT, POWER_MODE, NEWTON,
                       True, CAUSAL, HALF_M, BLOCK_N, STAGES)
    if PERSISTENT:  # every product of the item has retired: Q and dO are free
        gl.thread_barrier()
        mbarrier.arrive(q_empty)

    offs_m = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, dq_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    dq_ptrs = DQ + dq_base + gl.expand_dims(offs_m.to(gl.int64) * stride_dqn, 1) + gl.expand_dims(offs_d, 0)
    gl.store(dq_ptrs, (dq * grad_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(offs_m < q_len, 1))


@gluon.jit
def _dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, stride_dqb, stride_dqn, stride_dqh,
               H, GROUP, q_len, kv_len, score_scale, row_param, power, grad_scale,
               WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr,
               CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    """Program (query block, batch x head): rows [m0, m0 + BLOCK_M), two consumer warpgroups of
    BLOCK_M / 2 rows each and a 1-warp TMA producer; causal programs run the last query blocks first."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    b, h, hk, bh, m0 = program_rows(q_len, H, GROUP, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    q_halves, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty = allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    do_halves = gl.allocate_shared_memory(do_desc.dtype, [2, HALF_M, HEAD_DIM], do_desc.layout)

    dq_base = b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
    gl.warp_specialize([
        (_dq_consumer, (q_halves.index(0), do_halves.index(0), k_ring, v_ring, q_bar, k_ready, v_ready, k_empty,
                        v_empty, DQ, dq_base, stride_dqn, m0, q_len, kv_len, n_full, n_tiles, score_scale, row_param,
                        power, grad_scale, 0, 0, q_bar, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N,
                        HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_consumer, (q_halves.index(1), do_halves.index(1), k_ring, v_ring, q_bar, k_ready, v_ready, k_empty,
                        v_empty, DQ, dq_base, stride_dqn, m0 + HALF_M, q_len, kv_len, n_full, n_tiles, score_scale,
                        row_param, power, grad_scale, 0, 0, q_bar, WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL,
                        HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_halves, do_halves, k_ring, v_ring, q_bar, k_ready,
                        v_ready, k_empty, v_empty, b * q_len + m0, h * HEAD_DIM, b * kv_len, hk * HEAD_DIM, n_tiles,
                        HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


@gluon.jit
def _persistent_dq_consumer(q_tile, do_tile, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, DQ,
                            stride_dqb, stride_dqn, stride_dqh, H, GROUP, BH, n_items, q_len, kv_len, score_scale,
                            row_param, power, grad_scale, WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr,
                            HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr, CAUSAL: gl.constexpr, HALF_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                            NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent query-block kernel: `_dq_consumer` on its half of each work
    item of the program (`gluon_pipeline.persistent_item`'s order, as the producer), the ring's tile count and
    Q's and dO's phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        _dq_consumer(q_tile, do_tile, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, DQ,
                     b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh, stride_dqn, m0 + WARPGROUP * HALF_M,
                     q_len, kv_len, n_full, n_tiles, score_scale, row_param, power, grad_scale, ring, it & 1, q_empty,
                     WEIGHT, POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, True)
        ring += n_tiles
        it += 1


@gluon.jit
def _persistent_dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, stride_dqb, stride_dqn, stride_dqh,
                          H, GROUP, q_len, kv_len, score_scale, row_param, power, grad_scale, BH,
                          WEIGHT: gl.constexpr, POWER_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, NEWTON: gl.constexpr,
                          CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr):
    """The persistent form of `_dq_kernel` (a grid of at most one program per SM, each running work items
    (query block, batch x head) in `gluon_pipeline.work_item`'s order): the same partitions and per-item work,
    the producer loading the next item's tiles while the consumers finish this one and store its dq."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_items = gl.cdiv(q_len, BLOCK_M) * BH
    q_halves, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty = allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    do_halves = gl.allocate_shared_memory(do_desc.dtype, [2, HALF_M, HEAD_DIM], do_desc.layout)
    q_empty = allocate_item_empty()
    gl.warp_specialize([
        (_persistent_dq_consumer, (q_halves.index(0), do_halves.index(0), k_ring, v_ring, q_bar, q_empty, k_ready,
                                   v_ready, k_empty, v_empty, DQ, stride_dqb, stride_dqn, stride_dqh, H, GROUP, BH,
                                   n_items, q_len, kv_len, score_scale, row_param, power, grad_scale, WEIGHT,
                                   POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                                   NUM_WARPS_C, 0)),
        (_persistent_dq_consumer, (q_halves.index(1), do_halves.index(1), k_ring, v_ring, q_bar, q_empty, k_ready,
                                   v_ready, k_empty, v_empty, DQ, stride_dqb, stride_dqn, stride_dqh, H, GROUP, BH,
                                   n_items, q_len, kv_len, score_scale, row_param, power, grad_scale, WEIGHT,
                                   POWER_MODE, HAS_BIAS, NEWTON, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                                   NUM_WARPS_C, 1)),
        (persistent_producer, (q_desc, k_desc, v_desc, q_halves, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready,
                               k_empty, v_empty, q_len, kv_len, H, GROUP, BH, n_items, HEAD_DIM, HALF_M, BLOCK_N,
                               STAGES, CAUSAL, do_desc, do_halves, True)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)
    mbarrier.invalidate(q_empty)


# ---------------------------------------------------------------------------------------------
# host side


@functools.cache
def _backward_plan(dtype, head_dim: int, causal: bool, weight: int, power_constexpr: int, has_bias: bool, newton: int):
    """What every launch of one backward form shares: (dK / dV config, dQ config, tiles, the dK / dV and dQ
    kernels' constexprs)."""
    kv_cfg, q_cfg, tiles = backward_tiles(dtype, head_dim)
    constexprs = dict(WEIGHT=weight, POWER_MODE=power_constexpr, HAS_BIAS=has_bias, NEWTON=newton, CAUSAL=causal,
                      HEAD_DIM=head_dim)
    return kv_cfg, q_cfg, tiles, {**constexprs, **kv_cfg}, {**constexprs, **q_cfg}


_DKDV = DirectLauncher(_dkdv_kernel, "gluon_weighted_bwd_dkdv")
_DQ = DirectLauncher(_dq_kernel, "gluon_weighted_bwd_dq")
_PERSISTENT_DKDV = DirectLauncher(_persistent_dkdv_kernel, "gluon_weighted_bwd_dkdv_persistent")
_PERSISTENT_DQ = DirectLauncher(_persistent_dq_kernel, "gluon_weighted_bwd_dq_persistent")
_DKDV_DQ = DirectLauncher(_dkdv_dq_kernel, "gluon_weighted_bwd_dkdv_dq")
_DQ_CAST = DirectLauncher(_dq_cast_kernel, "gluon_weighted_bwd_dq_cast")
_CAST_CONSTEXPRS = dict(BLOCK=CAST_BLOCK)


def _launch(q, k, v, dout, causal: bool, weight: int, score_scale: float, start_scale: float, row_param: float,
            power: float, has_bias: bool, newton: int, grad_scale: float, persistent: bool = False,
            one_pass: bool = False):
    """(dq, dk, dv). The separate form: the key-block dK / dV kernel, then the query-block dQ kernel (both on the
    persistent grid with `persistent`). The one-pass form (`one_pass`, per item): an fp32 dq zeroed, the key-block
    kernel adding every tile's dS K into it (`_dkdv_dq_kernel`), then dq = grad_scale dq_acc in q's dtype."""
    import torch

    if one_pass and persistent:
        raise ValueError("the one-pass form runs per item: one_pass and persistent exclude each other")
    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    kv_cfg, q_cfg, tiles, dkdv_constexprs, dq_constexprs = _backward_plan(
        q.dtype, d, causal, weight, power_mode(power) if weight == 1 else 1, has_bias, newton if weight == 2 else 0)
    q_view, do_view, k_view, v_view = tma_view(q), tma_view(dout), tma_view(k), tma_view(v)
    q_desc, do_desc = descriptor(q_view, tiles.rows), descriptor(do_view, tiles.rows)
    k_half_desc, v_half_desc = descriptor(k_view, tiles.half_keys), descriptor(v_view, tiles.half_keys)
    k_block_desc, v_block_desc = descriptor(k_view, tiles.key_block), descriptor(v_view, tiles.key_block)

    dq = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k.dtype)
    dv = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=v.dtype)
    score_scale, row_param, power, grad_scale = float(score_scale), float(row_param), float(power), float(grad_scale)
    kv_strides = (kv_len * h_kv * d, h_kv * d, d)  # dk's and dv's (contiguous)
    dkdv_scalars = (*kv_strides, *kv_strides, h_kv, h // h_kv, n, kv_len, score_scale, float(start_scale), row_param,
                    power, grad_scale)
    dq_scalars = (n * h * d, h * d, d,  # dq's strides (contiguous)
                  h, h // h_kv, n, kv_len, score_scale, row_param, power, grad_scale)
    kv_blocks, q_blocks = cdiv(kv_len, kv_cfg["BLOCK_N"]), cdiv(n, q_cfg["BLOCK_M"])
    dkdv_descriptors, dq_descriptors = (k_half_desc, v_half_desc, q_desc, do_desc), (q_desc, do_desc, k_block_desc,
                                                                                      v_block_desc)
    if one_pass:
        dq_acc = torch.zeros((bsz, n, h, d), device=q.device, dtype=torch.float32)
        # dq_acc as the 2-d (B N, H D) matrix of its reduce boxes (contiguous: a 16-byte aligned base and rows)
        dq_desc = descriptor((dq_acc, (bsz * n, h * d), (h * d, 1)), dq_accumulator_tile(d))
        _DKDV_DQ.run((kv_blocks, bsz * h_kv), (*dkdv_descriptors, dq_desc), (dk, dv), dkdv_scalars, dkdv_constexprs,
                     GLUON_OPTIONS)
        numel = dq.numel()
        _DQ_CAST.run((cdiv(numel, CAST_BLOCK),), (), (dq_acc, dq), (numel, grad_scale), _CAST_CONSTEXPRS,
                     GLUON_OPTIONS)
        return dq, dk, dv
    if persistent:
        _PERSISTENT_DKDV.run((persistent_programs(kv_blocks * bsz * h_kv, q.device),), dkdv_descriptors, (dk, dv),
                             (*dkdv_scalars, bsz * h_kv), dkdv_constexprs, GLUON_OPTIONS)
        _PERSISTENT_DQ.run((persistent_programs(q_blocks * bsz * h, q.device),), dq_descriptors, (dq,),
                           (*dq_scalars, bsz * h), dq_constexprs, GLUON_OPTIONS)
    else:
        _DKDV.run((kv_blocks, bsz * h_kv), dkdv_descriptors, (dk, dv), dkdv_scalars, dkdv_constexprs, GLUON_OPTIONS)
        _DQ.run((q_blocks, bsz * h), dq_descriptors, (dq,), dq_scalars, dq_constexprs, GLUON_OPTIONS)
    return dq, dk, dv


def launch_threshold_backward(q, k, v, dout, causal: bool, beta: float, power: float, persistent: bool = False,
                              one_pass: bool = False):
    """(dq, dk, dv) of threshold attention in the inputs' dtype, without checks (for callers that checked
    the operands once): w = relu(q.k - tau_i)^power, tau_i = beta sqrt(2 ln n_i / D), as
    `gluon_weighted_fwd.launch_threshold`. Two launches: the key-block dK / dV kernel, the query-block dQ
    kernel; `persistent`: both on the persistent grid (a program per SM running work items in turn);
    `one_pass`: dQ in the key-block kernel by TMA reduce-adds into an fp32 dq (its sums in no fixed order),
    then a scale-and-cast (`_launch`)."""
    return _launch(q, k, v, dout, causal, 1, 1.0, -1.0, beta * math.sqrt(2.0 / q.shape[-1]), power, False, 0,
                   power, persistent, one_pass)


def launch_sigmoid_backward(q, k, v, dout, causal: bool, sm_scale: float, bias: float | None,
                            newton: int | None = None, persistent: bool = False, one_pass: bool = False):
    """(dq, dk, dv) of sigmoid attention in the inputs' dtype, without checks: w = sigmoid(sm_scale q.k +
    b_i), b_i = bias or -ln n_i, as `gluon_weighted_fwd.launch_sigmoid`; sm_scale > 0 (the spec's rule,
    which the rows past N rely on). `newton`: the reciprocal's Newton steps (0: MUFU.RCP; None:
    SIGMOID_BWD_NEWTON_STEPS); `persistent` and `one_pass` as `launch_threshold_backward`'s."""
    if newton is None:
        newton = SIGMOID_BWD_NEWTON_STEPS
    return _launch(q, k, v, dout, causal, 2, -sm_scale * LOG2E, 1.0 / (sm_scale * LOG2E),
                   0.0 if bias is None else bias * LOG2E, 1.0, bias is not None, newton, sm_scale, persistent,
                   one_pass)


def _check_dout(q, dout, what: str):
    import torch

    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"{what}: dout must have q's shape {tuple(q.shape)}, got "
                         f"{tuple(getattr(dout, 'shape', ())) or type(dout)}")
    if dout.dtype != q.dtype or dout.device != q.device:
        raise ValueError(f"{what}: dout must be {q.dtype} on {q.device} as q, got {dout.dtype} on {dout.device}")


def gluon_threshold_backward(q, k, v, dout, causal: bool, beta: float = 1.0, power: float = 2.0,
                             one_pass: bool = False):
    """`launch_threshold_backward` with its operands checked (ValueError naming what a call misses)."""
    what = "gluon threshold backward"
    check_operands(q, k, v, causal, what)
    _check_dout(q, dout, what)
    if not (math.isfinite(float(power)) and power > 0):
        raise ValueError(f"{what}: power must be > 0 and finite, got {power}")
    if not math.isfinite(float(beta)):
        raise ValueError(f"{what}: beta must be finite, got {beta}")
    return launch_threshold_backward(q, k, v, dout, causal, float(beta), float(power), one_pass=bool(one_pass))


def gluon_sigmoid_backward(q, k, v, dout, causal: bool, sm_scale: float, bias: float | None = None,
                           newton: int | None = None, one_pass: bool = False):
    """`launch_sigmoid_backward` with its operands checked (ValueError naming what a call misses)."""
    what = "gluon sigmoid backward"
    check_operands(q, k, v, causal, what)
    _check_dout(q, dout, what)
    if not (math.isfinite(float(sm_scale)) and sm_scale > 0):
        raise ValueError(f"{what}: sm_scale must be > 0 and finite, got {sm_scale}")
    if bias is not None and not math.isfinite(float(bias)):
        raise ValueError(f"{what}: bias must be finite or None, got {bias}")
    if newton is not None and newton not in (0, 1, 2, 3):
        raise ValueError(f"{what}: newton must be None or one of 0, 1, 2, 3, got {newton!r}")
    return launch_sigmoid_backward(q, k, v, dout, causal, float(sm_scale), None if bias is None else float(bias),
                                   newton, one_pass=bool(one_pass))


# ---------------------------------------------------------------------------------------------
# compiling without a GPU

KERNELS = ("dkdv", "dkdv_one_pass", "dq")


def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90,
                 kernel: str = "dkdv", weight: int = 1, power: float = 2.0, has_bias: bool = False,
                 newton: int = SIGMOID_BWD_NEWTON_STEPS, persistent: bool = False):
    """One of the backward's kernels (`kernel` in KERNELS) compiled for sm_<arch> without a GPU
    (`gluon_pipeline.compile_gluon_sm90`): weight 1 threshold (power picks POWER_MODE), 2 sigmoid;
    `persistent` its persistent form."""
    if weight not in (1, 2):
        raise ValueError(f"weight must be 1 (threshold) or 2 (sigmoid), got {weight!r}")
    rows = descriptor_type(dtype, [64, head_dim])
    scalars = {"q_len": "i32", "kv_len": "i32", "score_scale": "fp32"}
    params = {"row_param": "fp32", "power": "fp32", "grad_scale": "fp32"}
    tail = {name: "constexpr" for name in ("WEIGHT", "POWER_MODE", "HAS_BIAS", "NEWTON", "CAUSAL", "HEAD_DIM",
                                           "BLOCK_M", "BLOCK_N", "STAGES")}
    if persistent and kernel == "dkdv_one_pass":
        raise ValueError("the one-pass form (kernel='dkdv_one_pass') runs per item only: persistent must be False")
    if kernel in ("dkdv", "dkdv_one_pass"):
        cfg = dkdv_tile_config(head_dim)
        keys = descriptor_type(dtype, [cfg["BLOCK_N"] // 2, head_dim])
        dq_block = dq_accumulator_block(head_dim)
        dq_acc = f"tensordesc<fp32[{dq_block[0]}, {dq_block[1]}],{dq_staging_layout()!r}>"
        signature = {"k_desc": keys, "v_desc": keys, "q_desc": rows, "do_desc": rows, "dq_desc": dq_acc,
                     "DK": f"*{dtype}", "DV": f"*{dtype}",
                     **{f"stride_d{t}{dim}": "i32" for t in "kv" for dim in "bnh"},
                     "H_KV": "i32", "GROUP": "i32", **scalars, "start_scale": "fp32", **params, **tail}
        fn = (_dkdv_dq_kernel if kernel == "dkdv_one_pass" else
              _persistent_dkdv_kernel if persistent else _dkdv_kernel)
        aligned = ("DK", "DV")
    elif kernel == "dq":
        cfg = dq_tile_config(head_dim)
        keys = descriptor_type(dtype, [cfg["BLOCK_N"], head_dim])
        signature = {"q_desc": rows, "do_desc": rows, "k_desc": keys, "v_desc": keys, "DQ": f"*{dtype}",
                     "stride_dqb": "i32", "stride_dqn": "i32", "stride_dqh": "i32", "H": "i32", "GROUP": "i32",
                     **scalars, **params, **tail}
        fn, aligned = (_persistent_dq_kernel if persistent else _dq_kernel), ("DQ",)
    else:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    signature.update(BHK="i32", BH="i32")  # the persistent kernels' (batch x head pairs); unused names drop out
    constexprs = {"WEIGHT": weight, "POWER_MODE": power_mode(power) if weight == 1 else 1, "HAS_BIAS": has_bias,
                  "NEWTON": newton if weight == 2 else 0, "CAUSAL": causal, "HEAD_DIM": head_dim, **cfg}
    return compile_gluon_sm90(fn, signature, constexprs, aligned, arch)
