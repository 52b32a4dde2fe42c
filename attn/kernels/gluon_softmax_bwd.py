"""The softmax family's attention backward in Gluon for sm_90 (Hopper): every cap (none, tanh, soft_sign,
ALSC) and an optional per-row temperature with its gradient, without segments, a window or dropout.

Inputs and outputs are the portable backward's (`softmax_family._bwd_plan`): q, out, dout (B, N, H, D);
k, v (B, KV, H_kv, D), H % H_kv == 0; an optional temperature t (B, N) (any float dtype and strides, any
sign); lse2 (B, H, N) fp32, the base-2 logsumexp of the log2-unit logits z = t F(s q.k) log2(e) (+inf
for a row that sees no key) that either forward writes; causal is bottom-right aligned (query row i at
key position i + KV - N). Returns dq, dk, dv in the inputs' dtype (`launch_backward`), and dt (B, N) in
t's dtype (`launch_backward_with_dt`).

Math (softmax_family's module docstring; the cap's constants are its `_scalars`): with g the capped score
in the units the kernels compute it (`gluon_softmax_fwd._cap`: F = c' g, c' = s, c or c - a), p_ij =
exp2(t_i c' log2(e) g_ij - lse2_i), delta_i = dO_i . O_i, dp = dO v^T, dz = p (dp - delta); dv = p^T dO,
dk = s (t F'(y) dz)^T q, dq = s (t F'(y) dz) k, dt_i = c' sum_j dz_ij g_ij (summed over heads). Plain
softmax (CAP 0, no temperature): g = q.k, F' = 1, t = 1. The cap and the temperature are constexprs
(CAP, HAS_TEMP, and NEED_DT in the dQ kernel): the plain kernels compile without any of it
(scripts/analysis/gluon_sass_counts.py counts their loops).

Two forms of dq: "separate" (always for the temperature's gradient) and "one_pass"; ATTNLAB_GLUON_DQ
(`dq_form`) pins one, and its default, "auto", lets the backward plans time both per tuning key
(`tiers.choose_gluon_dq_form`). Each launch is written against Triton 3.6's Gluon API
(`gluon_pipeline.gluon_api_available`).

The separate form, three launches:

1. `_delta_kernel`: delta (B, H, N) fp32 = rowsum(dO * O) (the portable `_bwd_preprocess`).
2. `_dkdv_kernel`, FlashAttention-3's key-block schedule: one program per BLOCK_N (128) keys of one
   (batch, kv head); a 1-warp producer TMA-loads the keys' K and V once (two 64-row halves) and then,
   for every query head of the kv head's group and every query block that sees the keys, Q and dO
   tiles of BLOCK_M (64) rows into a STAGES-slot ring (ready / empty mbarriers per operand, as the
   forwards' K / V ring). Two consumer warpgroups own 64 keys each and per query block run
   S^T = K Q^T - lse2 / c and dP^T = V dO^T - delta (c = s log2 e; async wgmma from shared memory,
   issued back to back, the per-query terms as the accumulators' starting values), P^T = exp2(c S^T)
   as soon as S^T lands, dS^T = P^T dP^T, then dV += P^T dO and dK += dS^T Q (P^T and dS^T from
   registers, issued back to back). dK, dV stay in registers across the whole program (GQA: summed
   over the group's heads) and are stored once.
3. `_dq_kernel`, the forwards' query-block schedule: one program per 128 query rows of one (batch,
   head), Q and dO loaded once, K and V streamed through the forwards' ring (`gluon_pipeline`); per
   key block S = Q K^T and dP = dO V^T back to back, P, dS = P (dP - delta), dQ += dS K (dS from
   registers). dq is written once, scaled by s (and the row's t), in q's dtype: no fp32 accumulator in
   global memory, no atomics, the same bits every run. NEED_DT: each row's sum of dz g, per (batch, head,
   row) in fp32, summed over heads on the host.

The separate form's persistent grid (`_persistent_dkdv_kernel`, `_persistent_dq_kernel`; `launch_backward`'s
`persistent`): at most one program per SM, each running work items in turn (key blocks in `key_block_item`'s
order, query blocks in `gluon_pipeline.work_item`'s), the ring's tile count and the once-per-item tiles'
phase carried across items; the consumers arrive on an item-empty mbarrier once an item's last product
retired, and the producer loads the next item's first streamed tiles, then (after that barrier) its
stationary ones (K and V; Q and dO), while the consumers store this item's gradients. Each item's arithmetic
is the per-item kernel's: the same bits (tests/test_gluon_bwd_gpu.py -k persistent, on the GPU). The plans offer
it (`tiers.PERSISTENT_BACKWARDS_OFFERED`): ATTNLAB_GLUON_PERSISTENT picks the grid, "auto" times both per key.

The one-pass form, FlashAttention-3's dQ path (`_launch_one_pass`), three launches:

1. `_delta_zero_dq_kernel`: `_delta_kernel`'s delta, and zeros in an fp32 dq (B, N, H, D).
2. `_dkdv_dq_kernel`: the key-block kernel above, and per (query head, query block) each consumer also
   writes its dS^T to shared memory as the transposed view of its 64 key columns of dS (BLOCK_M queries x
   BLOCK_N keys, a transposing stmatrix); an mbarrier counts both warpgroups' halves in, and each
   warpgroup, once its dV and dK retired, loads dS (ldmatrix) as the register operand of dQ's D / 2
   columns over all 128 keys, dS K[:, cols] (K from shared memory, a 64 x D / 2 fp32 accumulator), stores
   the tile to an fp32 staging tile and adds it to the fp32 dq by a TMA bulk reduce-add
   (`_tma_reduce_add`: Triton 3.6's Gluon builder has the op, its tma module no wrapper). A second
   mbarrier holds the next dS until both warpgroups have loaded this one; the staging tile is rewritten
   once its previous reduce has read it. Keys past
   KV in the program's last block get p = 0 from the masked blocks' compare (every block of such a
   program runs masked), so they add nothing to dq. dS carries t F'(y), so dq needs only the scale s.
3. `_dq_cast_kernel`: dq = s dq_acc in q's dtype.

Both forms launch through `runtime.DirectLauncher`, each from its own plan cached per form (`_backward_plan`,
`_one_pass_plan`: tile configs, constexprs, TMA tiles, the one-pass form's fp32 dq tile among them), so a
call builds only its descriptors, outputs and scalars.

5 matrix products per (key block, query block) tile instead of 7 over two kernels, and every score's
exp2 (and cap) computed once instead of twice; in exchange the two consumer warpgroups of a program
advance in step (dS's buffer is shared), dq's sums arrive in any order (not bit-reproducible), and
an fp32 dq of 4 B N H D bytes is zeroed, reduced into and read back. The temperature's gradient stays
on the separate form (only the dQ kernel sums dz g per row).

Caps and temperatures: the plain key-block kernel folds -lse2 / c into S^T's accumulator start; a cap is
not linear, so capped or tempered blocks start S^T from zero and take lse2 (and t) per query column in
registers. The cap's slope F' comes from the same intermediates as g (`_capped_with_slope`). At D = 128
those blocks wait for dP^T together with S^T (the cap's values beside dK, dV and an in-flight dP^T spill).

Why the form is timed rather than fixed: both are within the float64 rule on an H100 (every case of the
GPU checks, D = 64 and 128), and neither wins everywhere: at (4, 16, 4096, 128) causal bf16 the one-pass
form is 9 % faster than the separate one for tanh and 1 % slower for plain softmax. The one-pass form
trades two products and the recomputed exp2 / cap per score for dS's shared-memory round trip, the
warpgroups' lockstep and the fp32 dq's traffic; its loops spill a few values at D = 128 under the 168
registers a consumer warpgroup gets (tests/test_gluon_compile.py's ONE_PASS_LOOP_SPILLS). Its reduce-adds
sum dq in no fixed order, so pinned configs (ATTNLAB_AUTOTUNE=0) and torch.use_deterministic_algorithms
keep the separate form. The portable backward chooses the same way (`softmax_family._dq_form`).

Masks: key-block programs visit only query blocks that see their keys (causal: from the first row at
key position >= n0); blocks on the causal diagonal run with one compare per score, the rest without
mask arithmetic. Rows past N (a TMA tile that runs into the next batch's rows, or zeros past the
tensor) get lse2 = +inf and delta = 0 from masked loads, so their p is exactly 0; keys past KV in a
key-block program only touch their own dK / dV rows, which are not stored (one-pass: they are masked, as
dq would see them). A one-pass query block's TMA reduce-add past N adds the zero dS rows of those queries
to the next batch's rows, or is clipped past the tensor. The dQ kernel masks keys as the forward does
(`gluon_pipeline.visible_key`).
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
    HEAD_DIMS,
    LOG2E,
    PRODUCER_REGS,
    allocate_item_empty,
    allocate_ring,
    check_operands,
    compile_gluon_sm90,
    descriptor,
    descriptor_type,
    fence_async_shared,
    grouped_block,
    invalidate_ring,
    issue_qk,
    key_blocks,
    mbarrier,
    persistent_item,
    persistent_producer,
    persistent_programs,
    program_rows,
    release,
    stream_ring,
    tma,
    tma_tile,
    tma_view,
    visible_key,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from attn.kernels.gluon_softmax_fwd import _rcp, _tanh
from attn.kernels.runtime import DirectLauncher, cdiv
from attn.kernels.tiers import GLUON_DQ_ENV as DQ_FORM_ENV  # noqa: F401 (the tests' and checks' name)
from attn.kernels.tiers import gluon_dq_form as dq_form

try:  # Triton 3.6's Gluon builtin decorator and the TMA reduce kinds (gluon_pipeline checks the API)
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin
except ImportError:  # pragma: no cover - depends on the installed Triton
    _ir = None

    def _gluon_builtin(fn):
        return fn

DELTA_BLOCK_M = 64  # rows per program of the delta kernel
CAST_BLOCK = 4096  # elements per program of the one-pass form's dq scale-and-cast kernel


def dkdv_tile_config(head_dim: int) -> dict:
    """The key-block kernel's constexprs: BLOCK_N keys per program (64 per consumer warpgroup), BLOCK_M
    query rows per ring slot, STAGES slots of Q and dO. Shared memory: K and V 2 BLOCK_N D bytes each,
    a slot 2 x 2 BLOCK_M D bytes (D = 128: 64 KiB + 3 x 32 KiB; D = 64: 32 KiB + 3 x 16 KiB)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon softmax backward: head dim must be one of {HEAD_DIMS}, got {head_dim}")
    return dict(BLOCK_M=64, BLOCK_N=128, STAGES=3)


# True: the key-block loops load each query block's lse2, delta and temperature during the block before
# (`_rows_of_block`'s AHEAD; the one-pass form loads them in their block), so that no load's latency sits
# before a block's first product. The same bits as loading them in their block, 1.02-1.08x faster on an H100
# (scripts/gpu_checks/ab_gluon_backward.py; docs/gluon.md).
ROW_VALUES_AHEAD = gl.constexpr(True)
DQ_REDUCE_COLS = 32  # fp32 columns of a 128-byte swizzle row: the widest box one reduce message carries


def dq_accumulator_block(head_dim: int) -> list[int]:
    """The one-pass form's TMA reduce box of the fp32 dq: one query block's rows (BLOCK_M) by at most 32
    columns (128 bytes, the swizzle's width). Each consumer warpgroup of the key-block kernel adds its
    BLOCK_M x D / 2 staging tile by D / 64 reduce-adds (one at D = 64, two at D = 128)."""
    return [dkdv_tile_config(head_dim)["BLOCK_M"], min(head_dim // 2, DQ_REDUCE_COLS)]


def dq_staging_layout():
    """The shared layout of the one-pass form's fp32 dQ staging tile and of its TMA reduce descriptor:
    a 128-byte swizzle. The accumulator's fragment stores (8 bytes per thread, a warp's 8 rows at one
    column pair) land on 8 rows' distinct 16-byte chunks, free of bank conflicts (unswizzled, rows 256
    bytes apart hit the same banks 8 times). Triton 3.6 lowers the reduce-add to one message per call,
    and its launcher encodes a swizzled descriptor's box as the swizzle's width (32 fp32 columns), so the
    kernel reduces each 32-column block of the tile (a subview of the staging tile) by its own call
    (`tests/test_gluon_compile.py` checks that the calls' sources, messages and box agree)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def dq_tile_config(head_dim: int) -> dict:
    """The query-block kernel's constexprs: BLOCK_M rows per program (64 per consumer warpgroup),
    BLOCK_N keys per ring slot, STAGES slots of K and V. Registers per consumer thread: S and dP
    BLOCK_N / 2 fp32 each, dQ D / 2; at D = 128 BLOCK_N is 64 (32 + 32 + 64: with 128 keys the loop
    spilled). Shared memory: Q and dO 2 BLOCK_M D bytes each, a slot 2 x 2 BLOCK_N D bytes (D = 128:
    64 KiB + 3 x 32 KiB; D = 64: 32 KiB + 3 x 32 KiB)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"gluon softmax backward: head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if head_dim == 128:
        return dict(BLOCK_M=128, BLOCK_N=64, STAGES=3)
    return dict(BLOCK_M=128, BLOCK_N=128, STAGES=3)


# ------------------------------------------------------------------------------------------ delta


@gluon.jit
def _row_block(H, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The delta kernels' program: (batch, head, its BLOCK_M row indices, the head dim's column indices),
    the indices in the slices of the 2-d `layout`."""
    bh = gl.program_id(1)
    rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    return bh // H, bh % H, rows, cols


@gluon.jit
def _delta_kernel(O, DO, DELTA, stride_ob, stride_on, stride_oh, stride_dob, stride_don, stride_doh, H, q_len,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """delta[b, h, i] = sum_d dO[b, i, h, d] O[b, i, h, d] in fp32, BLOCK_M rows of one (batch, head)
    per program (O and dO contiguous in d)."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
    b, h, rows, cols = _row_block(H, HEAD_DIM, BLOCK_M, layout)
    in_rows = gl.expand_dims(rows < q_len, 1)
    offs_o = (b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + gl.expand_dims(rows.to(gl.int64) * stride_on, 1) + gl.expand_dims(cols, 0))
    offs_do = (b.to(gl.int64) * stride_dob + h.to(gl.int64) * stride_doh
               + gl.expand_dims(rows.to(gl.int64) * stride_don, 1) + gl.expand_dims(cols, 0))
    o = gl.load(O + offs_o, mask=in_rows, other=0.0).to(gl.float32)
    do = gl.load(DO + offs_do, mask=in_rows, other=0.0).to(gl.float32)
    gl.store(DELTA + (b * H + h).to(gl.int64) * q_len + rows, gl.sum(o * do, axis=1), mask=rows < q_len)


@gluon.jit
def _delta_zero_dq_kernel(O, DO, DELTA, DQ_ACC, stride_ob, stride_on, stride_oh, stride_dob, stride_don, stride_doh,
                          H, q_len, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """The one-pass form's first kernel: `_delta_kernel`'s rows, and zeros in the same rows of DQ_ACC, the
    (B, N, H, D) contiguous fp32 dq the key-block kernel reduces into."""
    _delta_kernel(O, DO, DELTA, stride_ob, stride_on, stride_oh, stride_dob, stride_don, stride_doh, H, q_len,
                  HEAD_DIM, BLOCK_M)
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
    b, h, rows, cols = _row_block(H, HEAD_DIM, BLOCK_M, layout)
    offs_acc = ((b.to(gl.int64) * q_len + gl.expand_dims(rows.to(gl.int64), 1)) * H + h) * HEAD_DIM \
        + gl.expand_dims(cols, 0)
    gl.store(DQ_ACC + offs_acc, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout),
             mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def _dq_cast_kernel(DQ_ACC, DQ, numel, grad_scale, BLOCK: gl.constexpr):
    """The one-pass form's last step: dq = grad_scale dq_acc in dq's dtype, both contiguous (B, N, H, D),
    BLOCK elements per program."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32],
                                            warps_per_cta=[gl.num_warps()], order=[0])
    offs = gl.program_id(0).to(gl.int64) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    acc = gl.load(DQ_ACC + offs, mask=offs < numel, other=0.0)
    gl.store(DQ + offs, (acc * grad_scale).to(DQ.dtype.element_ty), mask=offs < numel)


# ---------------------------------------------------------------------------- dK, dV (key blocks)


@gluon.jit
def query_block_range(n0, q_len, kv_len, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(i_lo, i_full, i_hi): the query blocks (of BLOCK_M rows) that see keys [n0, n0 + BLOCK_N) are
    [i_lo, i_hi); those in [i_lo, i_full) need the causal mask (some row there does not see every key
    of the block), those in [i_full, i_hi) see every key. Query row i sees key j when
    j <= i + kv_len - q_len."""
    i_hi = gl.cdiv(q_len, BLOCK_M)
    if CAUSAL:
        offset = kv_len - q_len
        first_row = gl.maximum(n0 - offset, 0)  # the first row that sees key n0
        i_lo = gl.minimum(first_row // BLOCK_M, i_hi)
        # a block from row m on sees every key of the block when m + offset >= n0 + BLOCK_N - 1
        i_full = gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M)
        i_full = gl.minimum(gl.maximum(i_full, i_lo), i_hi)
    else:
        i_lo = i_hi * 0
        i_full = i_lo
    return i_lo, i_full, i_hi


@gluon.jit
def key_block_program(H_KV, q_len, kv_len, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A key-block program's place, in the order of `tiles.key_block_program` (the portable kernels'):
    (b, hk, n0, i_lo, i_full, i_hi), its batch and kv head (program axis 1 runs over batch x kv head), its
    first key n0 (axis 0, in BLOCK_N steps) and `query_block_range`'s query blocks for its keys."""
    n0 = gl.program_id(0) * BLOCK_N
    bhk = gl.program_id(1)
    i_lo, i_full, i_hi = query_block_range(n0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    return bhk // H_KV, bhk % H_KV, n0, i_lo, i_full, i_hi


@gluon.jit
def key_block_item(t, H_KV, BHK, q_len, kv_len, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """`key_block_program`'s (b, hk, n0, i_lo, i_full, i_hi) for work item t of a persistent key-block kernel:
    the key blocks of BHK (batch x kv head) pairs in `gluon_pipeline.grouped_block`'s order (the first key
    block, which the most query blocks see, first in each group)."""
    bhk, pid_n = grouped_block(t, gl.cdiv(kv_len, BLOCK_N), BHK)
    n0 = pid_n * BLOCK_N
    i_lo, i_full, i_hi = query_block_range(n0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    return bhk // H_KV, bhk % H_KV, n0, i_lo, i_full, i_hi


@gluon.jit
def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready, do_ready,
                   q_empty, do_empty, k_row, kv_col, q_row, hk, GROUP, i_lo, i_hi,
                   HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's K and V (two HALF_N-row halves each) once, then Q and dO of query
    blocks i_lo .. i_hi - 1 of each query head of kv head hk's group, in that order, through the ring."""
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, kv_col], kv_bar, k_halves.index(0))
    tma.async_copy_global_to_shared(k_desc, [k_row + HALF_N, kv_col], kv_bar, k_halves.index(1))
    tma.async_copy_global_to_shared(v_desc, [k_row, kv_col], kv_bar, v_halves.index(0))
    tma.async_copy_global_to_shared(v_desc, [k_row + HALF_N, kv_col], kv_bar, v_halves.index(1))
    count = i_hi - i_lo
    for gi in range(GROUP):
        h = hk * GROUP + gi
        stream_ring(q_desc, do_desc, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty,
                    q_row + i_lo * BLOCK_M, h * HEAD_DIM, gi * count, count, BLOCK_M, STAGES)


@gluon.jit
def persistent_dkdv_producer(k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar, kv_empty,
                             q_ready, do_ready, q_empty, do_empty, H_KV, GROUP, BHK, n_items, q_len, kv_len,
                             HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One warp of a persistent key-block kernel: per work item of this program (`key_block_item`), its first
    Q and dO tiles, then its K and V once both consumers are done with the last item's (kv_empty: one
    arrival per consumer after its last product retired), then the rest of `_dkdv_producer`'s tiles. The
    first tiles come before the wait so that they load while the consumers finish the last item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0, i_lo, i_full, i_hi = key_block_item(t, H_KV, BHK, q_len, kv_len, CAUSAL, BLOCK_M, 2 * HALF_N)
        count = i_hi - i_lo
        q_row = b * q_len + i_lo * BLOCK_M
        first = gl.minimum(count, 1)
        stream_ring(q_desc, do_desc, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty, q_row,
                    hk * GROUP * HEAD_DIM, ring, first, BLOCK_M, STAGES)
        mbarrier.wait(kv_empty, (it & 1) ^ 1)
        k_row = b * kv_len + n0
        kv_col = hk * HEAD_DIM
        mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row, kv_col], kv_bar, k_halves.index(0))
        tma.async_copy_global_to_shared(k_desc, [k_row + HALF_N, kv_col], kv_bar, k_halves.index(1))
        tma.async_copy_global_to_shared(v_desc, [k_row, kv_col], kv_bar, v_halves.index(0))
        tma.async_copy_global_to_shared(v_desc, [k_row + HALF_N, kv_col], kv_bar, v_halves.index(1))
        stream_ring(q_desc, do_desc, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty, q_row + first * BLOCK_M,
                    hk * GROUP * HEAD_DIM, ring + first, count - first, BLOCK_M, STAGES)
        for gi in range(1, GROUP):
            stream_ring(q_desc, do_desc, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty, q_row,
                        (hk * GROUP + gi) * HEAD_DIM, ring + gi * count, count, BLOCK_M, STAGES)
        ring += GROUP * count
        it += 1


@gluon.jit
def _query_rows(rows_ptr, m, q_len, other, BLOCK_M: gl.constexpr):
    """Values of query rows [m, m + BLOCK_M) (lse2 or delta), one per thread of the warpgroup (`other`
    for rows past q_len): loading them in S^T's column layout directly would cost every thread a 64-bit
    address per column it holds."""
    flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[gl.num_warps()],
                                          order=[0])
    rows = m + gl.arange(0, BLOCK_M, layout=flat)
    return gl.load(rows_ptr + rows, mask=rows < q_len, other=other)


@gluon.jit
def _temperature_rows(temp_rows, stride_tn, m, q_len, BLOCK_M: gl.constexpr):
    """The temperatures of query rows [m, m + BLOCK_M) in fp32 (`_query_rows`' layout; 0 past q_len),
    from one batch's row of the (B, N) temperature with row stride stride_tn."""
    flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[gl.num_warps()],
                                          order=[0])
    rows = m + gl.arange(0, BLOCK_M, layout=flat)
    return gl.load(temp_rows + rows.to(gl.int64) * stride_tn, mask=rows < q_len, other=0.0).to(gl.float32)


@gluon.jit
def _block_rows(lse_rows, delta_rows, temp_rows, stride_tn, m, q_len, HAS_TEMP: gl.constexpr, BLOCK_M: gl.constexpr):
    """The per-row values query block m's S^T and dP^T start from: (lse2, delta, temperature) in
    `_query_rows`' layout, the temperature delta's placeholder without HAS_TEMP. The key-block loop loads
    them a block ahead of their use, so that their latency overlaps the block before instead of holding
    up its first product."""
    lse = _query_rows(lse_rows, m, q_len, float("inf"), BLOCK_M)
    delta = _query_rows(delta_rows, m, q_len, 0.0, BLOCK_M)
    if HAS_TEMP:
        t = _temperature_rows(temp_rows, stride_tn, m, q_len, BLOCK_M)
    else:
        t = delta
    return lse, delta, t


@gluon.jit
def _rows_of_block(i, next_rows, lse_rows, delta_rows, temp_rows, stride_tn, q_len, AHEAD: gl.constexpr,
                   HAS_TEMP: gl.constexpr, BLOCK_M: gl.constexpr):
    """(query block i's `_block_rows`, the rows carried to the next block). AHEAD: block i's are
    next_rows, loaded during block i - 1, and block i + 1's load now (the last load of a head goes unused);
    else block i's load now (the one-pass form, whose D = 128 masked loop spills with the loads ahead)."""
    if AHEAD:
        rows = next_rows
        next_rows = _block_rows(lse_rows, delta_rows, temp_rows, stride_tn, (i + 1) * BLOCK_M, q_len, HAS_TEMP,
                                BLOCK_M)
    else:
        rows = _block_rows(lse_rows, delta_rows, temp_rows, stride_tn, i * BLOCK_M, q_len, HAS_TEMP, BLOCK_M)
    return rows, next_rows


@gluon.jit
def _capped_with_slope(x, cap_scale, alsc_knee, CAP: gl.constexpr):
    """Raw scores x = q.k -> (g, F'(y)): g the capped score in `gluon_softmax_fwd._cap`'s units (the same
    formulas, so the same values as the forward's), F' the cap's slope from the same intermediates, as
    the portable `softmax_family._cap` gives them (CAP 1, 2 or 3): tanh g = T = tanh(x s/c), F' = 1 - T^2;
    soft_sign r = 1/(1 + |u|), g = u r, F' = r^2 (u = x s/c); ALSC g = clamp(y, +-a') + T,
    T = tanh(y - clamp), F' = 1 - T^2 (y = x s/(c - a))."""
    if CAP == 1:
        g = _tanh(x * cap_scale)
        slope = 1.0 - g * g
    elif CAP == 2:
        u = x * cap_scale
        r = _rcp(1.0 + gl.abs(u))
        g = u * r
        slope = r * r
    else:
        y = x * cap_scale
        clamped = gl.minimum(gl.maximum(y, -alsc_knee), alsc_knee)
        t = _tanh(y - clamped)
        g = clamped + t
        slope = 1.0 - t * t
    return g, slope


@_gluon_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of shared memory `src` into the global tile of `tensor_desc` at `coord`
    (cp.reduce.async.bulk.tensor .add; Triton 3.6's Gluon builder has the op, its tma module no wrapper).
    Tracked as a TMA store: `tma.store_wait` waits until src has been read."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _issue_with_columns(j, a_tile, ring, ready, columns, st_layout: gl.constexpr, ROWS: gl.constexpr,
                        COLS: gl.constexpr, STAGES: gl.constexpr):
    """Waits for ring tile j, then issues A ring_tile^T + C as an async wgmma, the accumulator C
    starting as `columns` (one value per query, the tile's columns) in every row: the wgmma adds a
    per-column term for free, and the column values never sit in registers beside the tiles.
    Returns (the accumulator, the ring tile)."""
    s = j % STAGES
    tile = ring.index(s)
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    column_values = gl.convert_layout(columns, gl.SliceLayout(0, st_layout))
    acc = gl.expand_dims(column_values, 0).broadcast_to([ROWS, COLS])
    return warpgroup_mma(a_tile, tile.permute((1, 0)), acc, use_acc=True, is_async=True), tile


@gluon.jit
def _issue_from_zero(j, a_tile, ring, ready, st_layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                     STAGES: gl.constexpr):
    """Waits for ring tile j, then issues A ring_tile^T as an async wgmma from a zero accumulator.
    Returns (the accumulator, the ring tile)."""
    s = j % STAGES
    tile = ring.index(s)
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    zero = gl.zeros([ROWS, COLS], gl.float32, st_layout)
    return warpgroup_mma(a_tile, tile.permute((1, 0)), zero, use_acc=False, is_async=True), tile


@gluon.jit
def publish_ds(j, ds_t16, ds_rows, ds_ready, ds_free):
    """The one-pass dQ path's first half, per tile j: once both warpgroups have loaded the previous tile's dS
    (ds_free), this warpgroup's dS^T (16-bit, its keys' rows) goes to ds_rows, the transposed view of its key
    columns of the shared dS, and ds_ready counts it in."""
    mbarrier.wait(ds_free, (j & 1) ^ 1)  # both warpgroups have loaded the previous tile's dS
    ds_rows.store(ds_t16)  # read back by ldmatrix only: no async-proxy fence
    gl.thread_barrier()
    mbarrier.arrive(ds_ready)


@gluon.jit
def add_dq_tile(j, ds_smem, k_cols, dq_staging, dq_desc, ds_ready, ds_free, dq_row, dq_col, dq_layout: gl.constexpr,
                HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr):
    """The one-pass dQ path's second half, per tile j, once this warpgroup's dV and dK products retired (their
    16-bit operands' registers free): once both warpgroups' dS^T are in (ds_ready), this warpgroup's dQ columns
    dQ[:, dq_col:] = dS K[:, cols] (dS (BLOCK_M queries x 2 HALF_N keys) loaded from ds_smem to registers,
    times k_cols, the pair of K halves' DQ_COLS columns in shared memory; a BLOCK_M x DQ_COLS fp32
    accumulator in dq_layout); ds_free counts both warpgroups' loads out of ds_smem, and the tile goes through
    dq_staging to the fp32 dq at (dq_row, dq_col) by TMA reduce-adds, after the previous tile's reduce has
    read dq_staging."""
    mbarrier.wait(ds_ready, j & 1)  # the other warpgroup's keys' dS^T rows are in too
    # dS as the dQ product's register operand (ldmatrix): its k steps need no shared-memory
    # descriptors, and ds_smem is free for the next tile as soon as every warp has loaded it. One
    # product per half of the keys: each K half is its own TMA tile (at D = 128 a half's rows are two
    # 128-byte-swizzle column blocks, so the halves are not one 128-row tile)
    ds_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    ds_lo = ds_smem.slice(0, HALF_N, dim=1).load(ds_operand)
    ds_hi = ds_smem.slice(HALF_N, HALF_N, dim=1).load(ds_operand)
    gl.thread_barrier()
    mbarrier.arrive(ds_free)
    k_lo = k_cols[0]
    k_hi = k_cols[1]
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    dq = warpgroup_mma(ds_lo, k_lo, dq_zero, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_hi, k_hi, dq, is_async=True)
    dq, ds_lo, ds_hi, k_lo, k_hi = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_lo, ds_hi, k_lo, k_hi))
    reduce_dq_tile(dq, dq_staging, dq_desc, dq_row, dq_col, DQ_COLS)


@gluon.jit
def reduce_dq_tile(dq, dq_staging, dq_desc, dq_row, dq_col, DQ_COLS: gl.constexpr, PENDING: gl.constexpr = 0):
    """A warpgroup's fp32 dQ tile (registers, DQ_COLS columns) added to the fp32 dq at (dq_row, dq_col): once all
    but the PENDING latest of this warpgroup's reduces (one bulk group each) have read their staging, the tile
    goes to dq_staging and to dq by TMA reduce-adds, one per dq_desc box of columns. PENDING = 0: dq_staging
    is the warpgroup's one staging tile; a tile's reduces behind double-buffered staging may leave the other
    buffer's in flight."""
    tma.store_wait(PENDING)  # dq_staging's previous reduces have read it
    gl.thread_barrier()
    dq_staging.store(dq)
    fence_async_shared()
    gl.thread_barrier()
    REDUCE_COLS: gl.constexpr = dq_desc.block_type.shape[1]
    for part in gl.static_range(DQ_COLS // REDUCE_COLS):
        _tma_reduce_add(dq_desc, [dq_row, dq_col + part * REDUCE_COLS],
                        dq_staging.slice(part * REDUCE_COLS, REDUCE_COLS, dim=1))


@gluon.jit
def _dkdv_block(j, m, dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, q_empty, do_empty, lse, delta, t,
                first_col, qk_scale, cap_scale, alsc_knee,
                ds_smem, ds_rows, k_cols, dq_staging, dq_desc, ds_ready, ds_free, dq_row, dq_col,
                st_layout: gl.constexpr, a_layout: gl.constexpr, dq_layout: gl.constexpr, CAP: gl.constexpr,
                HAS_TEMP: gl.constexpr, MASKED: gl.constexpr, ONE_PASS_DQ: gl.constexpr, HALF_N: gl.constexpr,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup's keys against the query block from row m (ring tile j), whose rows' lse2, delta and
    temperature t (HAS_TEMP) are given (`_block_rows`, loaded a block ahead). Plain softmax: S^T =
    K Q^T - lse2 / c (c = qk_scale = s log2 e) and dP^T = V dO^T - delta issued back to back, the
    per-query terms as the accumulators' starting values; P^T = exp2(c S^T) as soon as S^T is in
    (while dP^T runs), dS^T = P^T dP^T once dP^T is; then dV += P^T dO and dK += dS^T Q issued back
    to back, dO's slot handed back when dV retired, Q's when dK did. A cap or a temperature: S^T = K Q^T
    from zero, (g, F'(y)) = `_capped_with_slope(S^T)`, P^T = exp2(g t c - lse2) with the query columns'
    lse2 and t (c = qk_scale, the log2-unit scale of g), dS^T = P^T t F'(y) dP^T; at D = 64 P^T t F'(y)
    forms while dP^T runs, at D = 128 after both retired (WAIT_DP_WITH_S: with dK and dV at 128
    registers a thread, S^T, dP^T in flight and the cap's values beside them, the loop spills).
    MASKED: the causal compare, key row r visible to query column c when c >= first_col[r] - m.
    ONE_PASS_DQ: dS^T also goes to ds_rows, the transposed view of this warpgroup's key columns of ds_smem
    (dS, BLOCK_M queries x BLOCK_N keys, both warpgroups'; a transposing stmatrix), and ds_ready counts both
    halves in. Once dV and dK retired (their 16-bit operands' registers free), this warpgroup's dQ columns:
    dQ[:, dq_col:] = dS K[:, cols] (ds_smem loaded to registers, times k_cols, all BLOCK_N keys' rows of
    its D / 2 columns in shared memory; a 64 x D / 2 fp32 accumulator); ds_free counts both warpgroups'
    loads out of ds_smem, and the tile goes through dq_staging to the fp32 dq at (dq_row, dq_col) by a TMA
    reduce-add (after waiting for the previous tile's reduce to have read dq_staging). dS as a register
    operand rather than a shared-memory one: its 8 k steps' descriptors would stay live across the loop,
    and the D = 128 loops spilled."""
    PLAIN: gl.constexpr = CAP == 0 and not HAS_TEMP
    WAIT_DP_WITH_S: gl.constexpr = dk.shape[1] > 64
    DQ_COLS: gl.constexpr = dk.shape[1] // 2
    column: gl.constexpr = gl.SliceLayout(0, st_layout)
    cols = gl.arange(0, BLOCK_M, layout=column)
    if PLAIN:
        # rows past q_len, and rows that see no key (lse2 = +inf): a start of -1e30, so p = exp2(-huge) = 0
        # (finite, as the tensor cores' accumulator takes it); delta 0
        s_start = gl.where(lse == float("inf"), -1.0e30, -lse / qk_scale)
        s_t, q_tile = _issue_with_columns(j, k_tile, q_ring, q_ready, s_start, st_layout, HALF_N, BLOCK_M, STAGES)
    else:
        s_t, q_tile = _issue_from_zero(j, k_tile, q_ring, q_ready, st_layout, HALF_N, BLOCK_M, STAGES)
    dp_t, do_tile = _issue_with_columns(j, v_tile, do_ring, do_ready, -delta, st_layout, HALF_N, BLOCK_M, STAGES)
    if PLAIN or not WAIT_DP_WITH_S:
        s_t, k_tile, q_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, k_tile, q_tile))  # S^T retired
    else:  # S^T and dP^T retired: no wait between P^T and dS^T, so they form score by score
        s_t, dp_t, k_tile, q_tile, v_tile, do_tile = warpgroup_mma_wait(
            num_outstanding=0, deps=(s_t, dp_t, k_tile, q_tile, v_tile, do_tile))
    if PLAIN:
        p_t = gl.exp2(s_t * qk_scale)
    else:
        # rows past q_len and rows that see no key: lse2 = +inf, p = exp2(-inf) = 0
        neg_lse = gl.expand_dims(gl.convert_layout(-lse, column), 0)
        if CAP != 0:
            g, slope = _capped_with_slope(s_t, cap_scale, alsc_knee, CAP)
        else:
            g = s_t
        if HAS_TEMP:
            t_cols = gl.expand_dims(gl.convert_layout(t, column), 0)
            p_t = gl.exp2(g * (t_cols * qk_scale) + neg_lse)
        else:
            p_t = gl.exp2(g * qk_scale + neg_lse)
    if MASKED:
        visible = gl.expand_dims(cols, 0) >= gl.expand_dims(first_col - m, 1)
        p_t = gl.where(visible, p_t, 0.0)
    if PLAIN:
        dp_t, v_tile, do_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, v_tile, do_tile))  # dP^T retired
        ds_t = p_t * dp_t
    else:
        # dS^T = P^T t F'(y) dP^T
        p_slope = p_t
        if CAP != 0:
            p_slope = p_slope * slope
        if HAS_TEMP:
            p_slope = p_slope * t_cols
        if not WAIT_DP_WITH_S:
            dp_t, v_tile, do_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, v_tile, do_tile))
        ds_t = p_slope * dp_t
    # both products from registers, issued back to back: P^T and dS^T in 16 bits are all that stays
    # live beside dK and dV while the tensor cores run them
    p16 = gl.convert_layout(p_t.to(q_ring.dtype), a_layout)
    ds_t16 = ds_t.to(q_ring.dtype)
    ds16 = gl.convert_layout(ds_t16, a_layout)
    if ONE_PASS_DQ:
        publish_ds(j, ds_t16, ds_rows, ds_ready, ds_free)
    dv = warpgroup_mma(p16, do_tile, dv, is_async=True)
    dk = warpgroup_mma(ds16, q_tile, dk, is_async=True)
    if ONE_PASS_DQ:
        # dV and dK retired (P^T's and dS^T's registers free) before the dQ tile's accumulator is live
        dv, p16, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dv, p16, do_tile))
        release(j, do_empty, STAGES)
        dk, ds16, q_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds16, q_tile))
        release(j, q_empty, STAGES)
        add_dq_tile(j, ds_smem, k_cols, dq_staging, dq_desc, ds_ready, ds_free, dq_row, dq_col, dq_layout, HALF_N,
                    BLOCK_M, DQ_COLS)
    else:
        dv, p16, do_tile = warpgroup_mma_wait(num_outstanding=1, deps=(dv, p16, do_tile))
        release(j, do_empty, STAGES)
        dk, ds16, q_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds16, q_tile))
        release(j, q_empty, STAGES)
    return dk, dv


@gluon.jit
def finish_key_block(dk, dv, DK, DV, b, hk, key0, kv_len, grad_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                     stride_dvn, stride_dvh, kv_empty, kv_layout: gl.constexpr, ONE_PASS_DQ: gl.constexpr,
                     PERSISTENT: gl.constexpr, HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A key-block consumer's end: its last dq reduce read (ONE_PASS_DQ), its persistent item's K and V
    released on kv_empty (PERSISTENT), then its key rows [key0, key0 + HALF_N) below kv_len of dk (times
    grad_scale) and dv stored for batch b, kv head hk."""
    if ONE_PASS_DQ:
        tma.store_wait(0)  # the last reduce has read dq_staging before the program's shared memory goes
    if PERSISTENT:  # every product of the item has retired: K and V are free
        gl.thread_barrier()
        mbarrier.arrive(kv_empty)

    keys = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    in_keys = gl.expand_dims(keys < kv_len, 1)
    keys64 = gl.expand_dims(keys.to(gl.int64), 1)
    dk_ptrs = DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + keys64 * stride_dkn
    gl.store(dk_ptrs + gl.expand_dims(offs_d, 0), (dk * grad_scale).to(DK.dtype.element_ty), mask=in_keys)
    dv_ptrs = DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh + keys64 * stride_dvn
    gl.store(dv_ptrs + gl.expand_dims(offs_d, 0), dv.to(DV.dtype.element_ty), mask=in_keys)


@gluon.jit
def _dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty,
                   DK, DV, LSE, DELTA, TEMP, b, hk, key0, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn,
                   stride_dvh, stride_tb, stride_tn, H, GROUP, q_len, kv_len, i_lo, i_full, i_hi, qk_scale, cap_scale,
                   alsc_knee, grad_scale, ds_smem, ds_rows, k_cols, dq_staging, dq_desc, ds_ready, ds_free, dq_col0,
                   ring, kv_phase, kv_empty, CAP: gl.constexpr, HAS_TEMP: gl.constexpr, CAUSAL: gl.constexpr,
                   ONE_PASS_DQ: gl.constexpr, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr, PERSISTENT: gl.constexpr = False):
    """One warpgroup: keys [key0, key0 + HALF_N) against every query block of the program's range for
    each query head of the group; stores its rows of dk (times grad_scale) and dv. ONE_PASS_DQ: also
    adds dq's columns [dq_col0, dq_col0 + D / 2) of every (query head, query block) tile to the fp32 dq
    (`_dkdv_block`; ds_smem .. ds_free are its buffers and barriers, unused otherwise). The dQ product
    runs over all BLOCK_N keys, so keys past kv_len (the next batch's, or the TMA's zeros past the tensor)
    must have dS = 0: the masked blocks' compare hides them (p = 0 whatever their scores). Causal, it
    already does (a key past kv_len is visible to query columns past q_len only, whose p is 0), and
    every block of a program whose keys run past kv_len is a masked one; full, the compare is
    key < kv_len, and `_dkdv_dq_kernel` makes every block of such a program a masked one. The ring's tiles
    start at ring, K's and V's phase is kv_phase. PERSISTENT: one of a persistent program's work items (never
    ONE_PASS_DQ), which arrives on kv_empty once its last product retired."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    # causal: key row r is visible to query rows i >= key - (kv_len - q_len)
    key_rows = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, st_layout))
    first_col = key_rows - (kv_len - q_len)
    if ONE_PASS_DQ and not CAUSAL:  # every query sees a key before kv_len, none one past it
        first_col = gl.where(key_rows < kv_len, 0, 1 << 30)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    count = i_hi - i_lo
    temp_rows = TEMP + b.to(gl.int64) * stride_tb

    mbarrier.wait(kv_bar, kv_phase)
    for gi in range(GROUP):
        h = hk * GROUP + gi
        bh = b * H + h
        lse_rows = LSE + bh.to(gl.int64) * q_len
        delta_rows = DELTA + bh.to(gl.int64) * q_len
        dq_col = h * HEAD_DIM + dq_col0  # ONE_PASS_DQ: this warpgroup's first column of dq
        j0 = ring + gi * count - i_lo  # ring tile of query block i: j0 + i
        next_rows = _block_rows(lse_rows, delta_rows, temp_rows, stride_tn, i_lo * BLOCK_M, q_len, HAS_TEMP, BLOCK_M)
        for i in range(i_lo, i_full):
            rows, next_rows = _rows_of_block(i, next_rows, lse_rows, delta_rows, temp_rows, stride_tn, q_len,
                                             ROW_VALUES_AHEAD and not ONE_PASS_DQ, HAS_TEMP, BLOCK_M)
            lse, delta, t = rows
            dk, dv = _dkdv_block(j0 + i, i * BLOCK_M, dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready,
                                 q_empty, do_empty, lse, delta, t, first_col, qk_scale, cap_scale, alsc_knee,
                                 ds_smem, ds_rows, k_cols, dq_staging, dq_desc, ds_ready, ds_free,
                                 b * q_len + i * BLOCK_M, dq_col, st_layout, a_layout, dq_layout, CAP, HAS_TEMP, True,
                                 ONE_PASS_DQ, HALF_N, BLOCK_M, STAGES)
        for i in range(i_full, i_hi):
            rows, next_rows = _rows_of_block(i, next_rows, lse_rows, delta_rows, temp_rows, stride_tn, q_len,
                                             ROW_VALUES_AHEAD and not ONE_PASS_DQ, HAS_TEMP, BLOCK_M)
            lse, delta, t = rows
            dk, dv = _dkdv_block(j0 + i, i * BLOCK_M, dk, dv, k_tile, v_tile, q_ring, do_ring, q_ready, do_ready,
                                 q_empty, do_empty, lse, delta, t, first_col, qk_scale, cap_scale, alsc_knee,
                                 ds_smem, ds_rows, k_cols, dq_staging, dq_desc, ds_ready, ds_free,
                                 b * q_len + i * BLOCK_M, dq_col, st_layout, a_layout, dq_layout, CAP, HAS_TEMP, False,
                                 ONE_PASS_DQ, HALF_N, BLOCK_M, STAGES)
    finish_key_block(dk, dv, DK, DV, b, hk, key0, kv_len, grad_scale, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                     stride_dvn, stride_dvh, kv_empty, kv_layout, ONE_PASS_DQ, PERSISTENT, HALF_N, HEAD_DIM)


@gluon.jit
def _dkdv_kernel(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE, DELTA, TEMP,
                 stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn,
                 H, H_KV, GROUP, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale,
                 CAP: gl.constexpr, HAS_TEMP: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Program (key block, batch x kv head): keys [n0, n0 + BLOCK_N), two consumer warpgroups of
    BLOCK_N / 2 keys each (the default partition and a 4-warp worker) and a 1-warp TMA producer.
    Programs of the first key blocks (the longest under a causal mask) start first. CAP (`_capped_with_slope`, with
    cap_scale and alsc_knee) and HAS_TEMP (TEMP (B, N), strides stride_tb, stride_tn) are compiled in
    only where asked; qk_scale is the log2-unit scale of the capped score. The consumers' one-pass buffers
    and barriers (`_dkdv_consumer`'s ds_smem .. dq_col0) are placeholders they never touch here."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_N: gl.constexpr = BLOCK_N // 2
    b, hk, n0, i_lo, i_full, i_hi = key_block_program(H_KV, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    # K halves, the Q / dO ring and its barriers (allocate_ring's stationary halves and streamed pair)
    k_halves, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = allocate_ring(
        k_desc, q_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
    v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)

    gl.warp_specialize([
        (_dkdv_consumer, (k_halves.index(0), v_halves.index(0), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, LSE, DELTA, TEMP, b, hk, n0, stride_dkb, stride_dkn, stride_dkh,
                          stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn, H, GROUP, q_len, kv_len, i_lo,
                          i_full, i_hi, qk_scale, cap_scale, alsc_knee, grad_scale, k_halves, k_halves, k_halves,
                          k_halves, k_desc, kv_bar, kv_bar, 0, 0, 0, kv_bar, CAP, HAS_TEMP, CAUSAL, False, HALF_N,
                          BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dkdv_consumer, (k_halves.index(1), v_halves.index(1), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, LSE, DELTA, TEMP, b, hk, n0 + HALF_N, stride_dkb, stride_dkn,
                          stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn, H, GROUP, q_len,
                          kv_len, i_lo, i_full, i_hi, qk_scale, cap_scale, alsc_knee, grad_scale, k_halves, k_halves,
                          k_halves, k_halves, k_desc, kv_bar, kv_bar, 0, 0, 0, kv_bar, CAP, HAS_TEMP, CAUSAL, False,
                          HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready,
                          do_ready, q_empty, do_empty, b * kv_len + n0, hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo,
                          i_hi, HALF_N, HEAD_DIM, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)


@gluon.jit
def _persistent_dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, kv_empty, q_ready, do_ready, q_empty,
                              do_empty, DK, DV, LSE, DELTA, TEMP, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                              stride_dvn, stride_dvh, stride_tb, stride_tn, H, H_KV, GROUP, BHK, n_items, q_len,
                              kv_len, qk_scale, cap_scale, alsc_knee, grad_scale, CAP: gl.constexpr,
                              HAS_TEMP: gl.constexpr, CAUSAL: gl.constexpr, HALF_N: gl.constexpr,
                              BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                              NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent key-block kernel: `_dkdv_consumer` on its half of each work
    item of the program (`key_block_item`'s order, as the producer), the ring's tile count and K's and V's
    phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, hk, n0, i_lo, i_full, i_hi = key_block_item(t, H_KV, BHK, q_len, kv_len, CAUSAL, BLOCK_M, 2 * HALF_N)
        _dkdv_consumer(k_tile, v_tile, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, LSE,
                       DELTA, TEMP, b, hk, n0 + WARPGROUP * HALF_N, stride_dkb, stride_dkn, stride_dkh, stride_dvb,
                       stride_dvn, stride_dvh, stride_tb, stride_tn, H, GROUP, q_len, kv_len, i_lo, i_full, i_hi,
                       qk_scale, cap_scale, alsc_knee, grad_scale, k_tile, k_tile, k_tile, k_tile, k_tile, kv_bar,
                       kv_bar, 0, ring, it & 1, kv_empty, CAP, HAS_TEMP, CAUSAL, False, HALF_N, BLOCK_M, HEAD_DIM,
                       STAGES, NUM_WARPS_C, True)
        ring += GROUP * (i_hi - i_lo)
        it += 1


@gluon.jit
def _persistent_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE, DELTA, TEMP,
                            stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb,
                            stride_tn, H, H_KV, GROUP, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale, BHK,
                            CAP: gl.constexpr, HAS_TEMP: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
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
                                     do_ready, q_empty, do_empty, DK, DV, LSE, DELTA, TEMP, stride_dkb, stride_dkn,
                                     stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn, H, H_KV,
                                     GROUP, BHK, n_items, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale,
                                     CAP, HAS_TEMP, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
        (_persistent_dkdv_consumer, (k_halves.index(1), v_halves.index(1), q_ring, do_ring, kv_bar, kv_empty, q_ready,
                                     do_ready, q_empty, do_empty, DK, DV, LSE, DELTA, TEMP, stride_dkb, stride_dkn,
                                     stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn, H, H_KV,
                                     GROUP, BHK, n_items, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale,
                                     CAP, HAS_TEMP, CAUSAL, HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
        (persistent_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar,
                                    kv_empty, q_ready, do_ready, q_empty, do_empty, H_KV, GROUP, BHK, n_items, q_len,
                                    kv_len, HALF_N, HEAD_DIM, BLOCK_M, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    mbarrier.invalidate(kv_empty)


@gluon.jit
def one_pass_key_block_program(H_KV, q_len, kv_len, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr):
    """`key_block_program` for a one-pass key-block kernel: without the causal mask, a program whose keys run
    past kv_len runs every query block masked (i_full = i_hi), so that those keys reach no dq."""
    b, hk, n0, i_lo, i_full, i_hi = key_block_program(H_KV, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    if not CAUSAL:
        if n0 + BLOCK_N > kv_len:
            i_full = i_hi
    return b, hk, n0, i_lo, i_full, i_hi


@gluon.jit
def allocate_dq_path(k_halves, dq_desc, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr):
    """The one-pass dQ path's shared memory and barriers beside a key-block kernel's (K in k_halves, two
    HALF_N-key tiles): dS's BLOCK_M x 2 HALF_N buffer and each warpgroup's transposed view of its keys'
    columns, each warpgroup's DQ_COLS columns of both K halves, a BLOCK_M x DQ_COLS fp32 staging tile per
    warpgroup (dq_desc's layout), and ds_ready / ds_free (one arrival per warpgroup). Returns (ds_smem,
    ds_rows_0, ds_rows_1, k_cols_0, k_cols_1, staging_0, staging_1, ds_ready, ds_free)."""
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 2 * HALF_N], k_halves.dtype)
    ds_smem = gl.allocate_shared_memory(k_halves.dtype, [BLOCK_M, 2 * HALF_N], ds_layout)
    dq_staging = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], dq_desc.layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_ready, count=2)
    mbarrier.init(ds_free, count=2)
    fence_async_shared()
    ds_rows_0 = ds_smem.slice(0, HALF_N, dim=1).permute((1, 0))  # each warpgroup's keys' columns of dS, as dS^T
    ds_rows_1 = ds_smem.slice(HALF_N, HALF_N, dim=1).permute((1, 0))
    # each warpgroup's dQ columns of K, in each half of the keys (a pair: the halves are separate tiles)
    k_cols_0 = (k_halves.index(0).slice(0, DQ_COLS, dim=1), k_halves.index(1).slice(0, DQ_COLS, dim=1))
    k_cols_1 = (k_halves.index(0).slice(DQ_COLS, DQ_COLS, dim=1), k_halves.index(1).slice(DQ_COLS, DQ_COLS, dim=1))
    return (ds_smem, ds_rows_0, ds_rows_1, k_cols_0, k_cols_1, dq_staging.index(0), dq_staging.index(1), ds_ready,
            ds_free)


@gluon.jit
def allocate_one_pass_key_block(k_desc, v_desc, q_desc, do_desc, dq_desc, HALF_N: gl.constexpr,
                                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                                DQ_COLS: gl.constexpr):
    """A one-pass key-block kernel's shared memory and barriers: K's two HALF_N-key halves with the Q / dO ring
    (`allocate_ring`), V's halves, and the dQ path's (`allocate_dq_path`). Returns (k_halves, v_halves, then
    allocate_ring's ring and barriers, then allocate_dq_path's values)."""
    k_halves, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty = allocate_ring(
        k_desc, q_desc, do_desc, HALF_N, BLOCK_M, HEAD_DIM, STAGES)
    v_halves = gl.allocate_shared_memory(v_desc.dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
    ds_smem, ds_rows_0, ds_rows_1, k_cols_0, k_cols_1, staging_0, staging_1, ds_ready, ds_free = allocate_dq_path(
        k_halves, dq_desc, HALF_N, BLOCK_M, DQ_COLS)
    return (k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty, do_empty, ds_smem, ds_rows_0,
            ds_rows_1, k_cols_0, k_cols_1, staging_0, staging_1, ds_ready, ds_free)


@gluon.jit
def _dkdv_dq_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, DK, DV, LSE, DELTA, TEMP,
                    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn,
                    H, H_KV, GROUP, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale,
                    CAP: gl.constexpr, HAS_TEMP: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """`_dkdv_kernel` with FlashAttention-3's dQ path (the one-pass form): every tile's dS K also goes
    into the fp32 dq behind dq_desc ((B N, H D), BLOCK_M x D / 2 boxes) by TMA reduce-add, each
    consumer warpgroup adding half of the head dim's columns over all BLOCK_N keys. Beside
    `_dkdv_kernel`'s shared memory and barriers: dS's BLOCK_M x BLOCK_N buffer (each warpgroup writes its
    keys' columns), a BLOCK_M x D / 2 fp32 staging tile per warpgroup (`dq_staging_layout`), and the
    ds_ready / ds_free barriers (one arrival per warpgroup). Shared memory at D = 128: 160 KiB of K, V and
    the ring, 16 KiB of dS, 2 x 16 KiB of staging. Without the causal mask, every query block of a program
    whose keys run past kv_len runs masked (`_dkdv_consumer` hides those keys from dq)."""
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
                          do_empty, DK, DV, LSE, DELTA, TEMP, b, hk, n0, stride_dkb, stride_dkn, stride_dkh,
                          stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn, H, GROUP, q_len, kv_len, i_lo,
                          i_full, i_hi, qk_scale, cap_scale, alsc_knee, grad_scale, ds_smem, ds_rows_0, k_cols_0,
                          staging_0, dq_desc, ds_ready, ds_free, 0, 0, 0, kv_bar, CAP, HAS_TEMP, CAUSAL, True,
                          HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dkdv_consumer, (k_halves.index(1), v_halves.index(1), q_ring, do_ring, kv_bar, q_ready, do_ready, q_empty,
                          do_empty, DK, DV, LSE, DELTA, TEMP, b, hk, n0 + HALF_N, stride_dkb, stride_dkn,
                          stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_tb, stride_tn, H, GROUP, q_len,
                          kv_len, i_lo, i_full, i_hi, qk_scale, cap_scale, alsc_knee, grad_scale, ds_smem, ds_rows_1,
                          k_cols_1, staging_1, dq_desc, ds_ready, ds_free, DQ_COLS, 0, 0, kv_bar, CAP, HAS_TEMP,
                          CAUSAL, True, HALF_N, BLOCK_M, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_halves, v_halves, q_ring, do_ring, kv_bar, q_ready,
                          do_ready, q_empty, do_empty, b * kv_len + n0, hk * HEAD_DIM, b * q_len, hk, GROUP, i_lo,
                          i_hi, HALF_N, HEAD_DIM, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(kv_bar, q_ready, do_ready, q_empty, do_empty, STAGES)
    mbarrier.invalidate(ds_ready)
    mbarrier.invalidate(ds_free)


# ------------------------------------------------------------------------------- dQ (query blocks)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_halves, do_halves, k_ring, v_ring, q_bar, k_ready, v_ready,
                 k_empty, v_empty, q_row, q_col, k_row, kv_col, n_tiles,
                 HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: both consumers' Q and dO rows once, then K and V of key blocks 0 .. n_tiles-1."""
    mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_halves.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, q_col], q_bar, q_halves.index(1))
    tma.async_copy_global_to_shared(do_desc, [q_row, q_col], q_bar, do_halves.index(0))
    tma.async_copy_global_to_shared(do_desc, [q_row + HALF_M, q_col], q_bar, do_halves.index(1))
    stream_ring(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_row, kv_col, 0, n_tiles,
                BLOCK_N, STAGES)


@gluon.jit
def _dq_block(j, r, dq, dt, q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, lse, delta, row_scale,
              last_key, kv_len, qk_scale, cap_scale, alsc_knee, s_layout: gl.constexpr, a_layout: gl.constexpr,
              CAP: gl.constexpr, HAS_TEMP: gl.constexpr, NEED_DT: gl.constexpr, MASKED: gl.constexpr,
              CAUSAL: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block j (ring tile r) for one warpgroup's rows: S = Q K^T and dP = dO V^T back to back, P as soon
    as S is in, V's slot back once dP retired, dS = P (dP - delta), dQ += dS K, K's slot back once that retired.
    A cap or a temperature: (g, F'(y)) = `_capped_with_slope(S)`, P = exp2(g row_scale - lse2) (row_scale =
    t qk_scale, or qk_scale), P F'(y) formed while dP runs (and P g for d-temperature), dS = that times
    (dP - delta) (the row's t is the caller's, once on dQ); NEED_DT adds the rows' sum of P (dP - delta) g
    to dt. Returns (dq, dt)."""
    PLAIN: gl.constexpr = CAP == 0 and not HAS_TEMP
    s, k_tile = issue_qk(r, q_tile, k_ring, k_ready, s_layout, HALF_M, BLOCK_N, STAGES)
    dp, v_tile = issue_qk(r, do_tile, v_ring, v_ready, s_layout, HALF_M, BLOCK_N, STAGES)
    s, q_tile, k_tile = warpgroup_mma_wait(num_outstanding=1, deps=(s, q_tile, k_tile))  # S retired
    if PLAIN:
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
    else:
        if CAP != 0:
            g, slope = _capped_with_slope(s, cap_scale, alsc_knee, CAP)
        else:
            g = s
        if HAS_TEMP:
            p = gl.exp2(g * gl.expand_dims(row_scale, 1) - gl.expand_dims(lse, 1))
        else:
            p = gl.exp2(g * qk_scale - gl.expand_dims(lse, 1))
    if MASKED:
        p = gl.where(visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N), p, 0.0)
    if not PLAIN:
        # dS's factor F'(y) on P while dP runs (g is dead after it, but for P g)
        p_slope = p
        if CAP != 0:
            p_slope = p_slope * slope
        if NEED_DT:
            p_g = p * g
    dp, do_tile, v_tile = warpgroup_mma_wait(num_outstanding=0, deps=(dp, do_tile, v_tile))  # dP retired
    release(r, v_empty, STAGES)
    if PLAIN:
        ds = p * (dp - gl.expand_dims(delta, 1))
    else:
        dz = dp - gl.expand_dims(delta, 1)
        ds = p_slope * dz
        if NEED_DT:
            dt += gl.sum(p_g * dz, axis=1)
    ds16 = gl.convert_layout(ds.to(k_ring.dtype), a_layout)
    dq = warpgroup_mma(ds16, k_tile, dq, is_async=True)
    dq, k_tile, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, k_tile, ds16))
    release(r, k_empty, STAGES)
    return dq, dt


@gluon.jit
def _dq_consumer(q_tile, do_tile, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty,
                 DQ, LSE, DELTA, TEMP, DT, dq_base, stride_dqn, lse_base, temp_base, stride_tn, m0, q_len, kv_len,
                 n_full, n_tiles, qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale, ring, q_phase, q_empty,
                 CAP: gl.constexpr, HAS_TEMP: gl.constexpr, NEED_DT: gl.constexpr, CAUSAL: gl.constexpr,
                 HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 NUM_WARPS_C: gl.constexpr, PERSISTENT: gl.constexpr = False):
    """One warpgroup: rows [m0, m0 + HALF_M) against the program's key blocks ([0, n_full) unmasked,
    [n_full, n_tiles) masked); key block j is ring tile ring + j, Q's and dO's phase q_phase; stores its rows
    of dq (times grad_scale) and, NEED_DT, of the rows' d-temperature share (times dt_scale, one value per
    (batch, head, row)). PERSISTENT: one of a persistent program's work items, which arrives on q_empty once
    its last product retired."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    in_rows = rows < q_len
    lse = gl.load(LSE + lse_base + rows, mask=in_rows, other=float("inf"))
    delta = gl.load(DELTA + lse_base + rows, mask=in_rows, other=0.0)
    if HAS_TEMP:  # rows past q_len: t = 0 (their p is 0 through lse2 = +inf)
        t = gl.load(TEMP + temp_base + rows.to(gl.int64) * stride_tn, mask=in_rows, other=0.0).to(gl.float32)
        row_scale = t * qk_scale
    else:
        row_scale = delta  # unused
    # causal: the last key each row sees, min(row position, kv_len - 1) (negative: none)
    last_key = gl.minimum(rows + (kv_len - q_len), kv_len - 1)
    dq = gl.zeros([HALF_M, HEAD_DIM], gl.float32, dq_layout)
    dt = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bar, q_phase)
    for j in range(0, n_full):
        dq, dt = _dq_block(j, ring + j, dq, dt, q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
                           lse, delta, row_scale, last_key, kv_len, qk_scale, cap_scale, alsc_knee, s_layout,
                           a_layout, CAP, HAS_TEMP, NEED_DT, False, CAUSAL, HALF_M, BLOCK_N, STAGES)
    for j in range(n_full, n_tiles):
        dq, dt = _dq_block(j, ring + j, dq, dt, q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
                           lse, delta, row_scale, last_key, kv_len, qk_scale, cap_scale, alsc_knee, s_layout,
                           a_layout, CAP, HAS_TEMP, NEED_DT, True, CAUSAL, HALF_M, BLOCK_N, STAGES)
    if PERSISTENT:  # every product of the item has retired: Q and dO are free
        gl.thread_barrier()
        mbarrier.arrive(q_empty)

    offs_m = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, dq_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    dq_ptrs = DQ + dq_base + gl.expand_dims(offs_m.to(gl.int64) * stride_dqn, 1) + gl.expand_dims(offs_d, 0)
    if HAS_TEMP:  # dS's factor t, constant along the row: once on dQ
        dq = dq * gl.expand_dims(gl.convert_layout(t, gl.SliceLayout(1, dq_layout)), 1)
    gl.store(dq_ptrs, (dq * grad_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(offs_m < q_len, 1))
    if NEED_DT:
        gl.store(DT + lse_base + rows, dt * dt_scale, mask=in_rows)


@gluon.jit
def _dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, TEMP, DT, stride_dqb, stride_dqn, stride_dqh,
               stride_tb, stride_tn, H, GROUP, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale,
               CAP: gl.constexpr, HAS_TEMP: gl.constexpr, NEED_DT: gl.constexpr, CAUSAL: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Program (query block, batch x head): rows [m0, m0 + BLOCK_M), two consumer warpgroups of
    BLOCK_M / 2 rows each and a 1-warp TMA producer; causal programs run the last query blocks first.
    CAP, HAS_TEMP (TEMP (B, N), strides stride_tb, stride_tn) and NEED_DT (DT (B, H, N) fp32, the rows'
    d-temperature per head) are compiled in only where asked."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    b, h, hk, bh, m0 = program_rows(q_len, H, GROUP, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    q_halves, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty = allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    do_halves = gl.allocate_shared_memory(do_desc.dtype, [2, HALF_M, HEAD_DIM], do_desc.layout)

    dq_base = b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
    lse_base = bh.to(gl.int64) * q_len
    temp_base = b.to(gl.int64) * stride_tb
    gl.warp_specialize([
        (_dq_consumer, (q_halves.index(0), do_halves.index(0), k_ring, v_ring, q_bar, k_ready, v_ready, k_empty,
                        v_empty, DQ, LSE, DELTA, TEMP, DT, dq_base, stride_dqn, lse_base, temp_base, stride_tn, m0,
                        q_len, kv_len, n_full, n_tiles, qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale, 0, 0,
                        q_bar, CAP, HAS_TEMP, NEED_DT, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_dq_consumer, (q_halves.index(1), do_halves.index(1), k_ring, v_ring, q_bar, k_ready, v_ready, k_empty,
                        v_empty, DQ, LSE, DELTA, TEMP, DT, dq_base, stride_dqn, lse_base, temp_base, stride_tn,
                        m0 + HALF_M, q_len, kv_len, n_full, n_tiles, qk_scale, cap_scale, alsc_knee, grad_scale,
                        dt_scale, 0, 0, q_bar, CAP, HAS_TEMP, NEED_DT, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                        NUM_WARPS_C)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_halves, do_halves, k_ring, v_ring, q_bar, k_ready,
                        v_ready, k_empty, v_empty, b * q_len + m0, h * HEAD_DIM, b * kv_len, hk * HEAD_DIM, n_tiles,
                        HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


@gluon.jit
def _persistent_dq_consumer(q_tile, do_tile, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, DQ,
                            LSE, DELTA, TEMP, DT, stride_dqb, stride_dqn, stride_dqh, stride_tb, stride_tn, H, GROUP,
                            BH, n_items, q_len, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale,
                            CAP: gl.constexpr, HAS_TEMP: gl.constexpr, NEED_DT: gl.constexpr, CAUSAL: gl.constexpr,
                            HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                            NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent query-block kernel: `_dq_consumer` on its half of each work
    item of the program (`gluon_pipeline.persistent_item`'s order, as the producer), the ring's tile count and
    Q's and dO's phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        _dq_consumer(q_tile, do_tile, k_ring, v_ring, q_bar, k_ready, v_ready, k_empty, v_empty, DQ, LSE, DELTA,
                     TEMP, DT, b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh, stride_dqn,
                     bh.to(gl.int64) * q_len, b.to(gl.int64) * stride_tb, stride_tn, m0 + WARPGROUP * HALF_M, q_len,
                     kv_len, n_full, n_tiles, qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale, ring, it & 1,
                     q_empty, CAP, HAS_TEMP, NEED_DT, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, True)
        ring += n_tiles
        it += 1


@gluon.jit
def _persistent_dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, LSE, DELTA, TEMP, DT, stride_dqb, stride_dqn,
                          stride_dqh, stride_tb, stride_tn, H, GROUP, q_len, kv_len, qk_scale, cap_scale, alsc_knee,
                          grad_scale, dt_scale, BH, CAP: gl.constexpr, HAS_TEMP: gl.constexpr, NEED_DT: gl.constexpr,
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
                                   v_ready, k_empty, v_empty, DQ, LSE, DELTA, TEMP, DT, stride_dqb, stride_dqn,
                                   stride_dqh, stride_tb, stride_tn, H, GROUP, BH, n_items, q_len, kv_len, qk_scale,
                                   cap_scale, alsc_knee, grad_scale, dt_scale, CAP, HAS_TEMP, NEED_DT, CAUSAL,
                                   HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
        (_persistent_dq_consumer, (q_halves.index(1), do_halves.index(1), k_ring, v_ring, q_bar, q_empty, k_ready,
                                   v_ready, k_empty, v_empty, DQ, LSE, DELTA, TEMP, DT, stride_dqb, stride_dqn,
                                   stride_dqh, stride_tb, stride_tn, H, GROUP, BH, n_items, q_len, kv_len, qk_scale,
                                   cap_scale, alsc_knee, grad_scale, dt_scale, CAP, HAS_TEMP, NEED_DT, CAUSAL,
                                   HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
        (persistent_producer, (q_desc, k_desc, v_desc, q_halves, k_ring, v_ring, q_bar, q_empty, k_ready, v_ready,
                               k_empty, v_empty, q_len, kv_len, H, GROUP, BH, n_items, HEAD_DIM, HALF_M, BLOCK_N,
                               STAGES, CAUSAL, do_desc, do_halves, True)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)
    mbarrier.invalidate(q_empty)


# ---------------------------------------------------------------------------------------------
# host side


CAPS = {0: "none", 1: "tanh", 2: "soft_sign", 3: "alsc"}  # softmax_family.CAP_IDS' ids


class BackwardTiles:
    """The TMA tiles both backward kernels read (`tma_tile`'s), per dtype and head dim: 64-row tiles of Q and
    dO (one consumer's rows, or a ring slot), the dK / dV kernel's half key blocks, the dQ kernel's key blocks."""

    def __init__(self, dtype, head_dim: int, kv_cfg: dict, q_cfg: dict):
        self.rows = tma_tile(dtype, 64, head_dim)
        self.half_keys = tma_tile(dtype, kv_cfg["BLOCK_N"] // 2, head_dim)
        self.key_block = tma_tile(dtype, q_cfg["BLOCK_N"], head_dim)


@functools.cache
def backward_tiles(dtype, head_dim: int) -> tuple[dict, dict, BackwardTiles]:
    """(dK / dV tile config, dQ tile config, their TMA tiles) of the backward kernels (also the threshold and
    sigmoid backwards'), made once per dtype and head dim."""
    kv_cfg, q_cfg = dkdv_tile_config(head_dim), dq_tile_config(head_dim)
    return kv_cfg, q_cfg, BackwardTiles(dtype, head_dim, kv_cfg, q_cfg)


@functools.lru_cache(maxsize=256)
def _backward_plan(dtype, head_dim: int, causal: bool, cap: int, cap_value: float, knee: float, sm_scale: float,
                   has_temp: bool, need_dt: bool):
    """What every launch of one backward form shares: (dK / dV config, dQ config, tiles, the kernels' float
    scalars (qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale), the delta / dK dV / dQ constexprs)."""
    from attn.kernels.softmax_family import _scalars

    kv_cfg, q_cfg, tiles = backward_tiles(dtype, head_dim)
    # the portable kernels' constants: the capped score g scales by qk_scale (log2 units, times t) into z;
    # dx = grad_scale t F' dz; dt = dt_scale sum_j dz g
    cap_scale, qk_scale, grad_scale, dt_scale, alsc_knee, _ = _scalars(cap, float(cap_value), float(knee),
                                                                       float(sm_scale))
    delta_constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=DELTA_BLOCK_M)
    dkdv_constexprs = dict(CAP=cap, HAS_TEMP=has_temp, CAUSAL=causal, HEAD_DIM=head_dim, **kv_cfg)
    dq_constexprs = dict(CAP=cap, HAS_TEMP=has_temp, NEED_DT=need_dt, CAUSAL=causal, HEAD_DIM=head_dim, **q_cfg)
    return (kv_cfg, q_cfg, tiles, (qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale), delta_constexprs,
            dkdv_constexprs, dq_constexprs)


_DELTA = DirectLauncher(_delta_kernel, "gluon_softmax_bwd_delta")
_DKDV = DirectLauncher(_dkdv_kernel, "gluon_softmax_bwd_dkdv")
_DQ = DirectLauncher(_dq_kernel, "gluon_softmax_bwd_dq")
_PERSISTENT_DKDV = DirectLauncher(_persistent_dkdv_kernel, "gluon_softmax_bwd_dkdv_persistent")
_PERSISTENT_DQ = DirectLauncher(_persistent_dq_kernel, "gluon_softmax_bwd_dq_persistent")


@functools.cache
def dq_accumulator_tile(head_dim: int) -> tuple[list, object]:
    """(block shape, shared layout) of the one-pass form's fp32 dq descriptor (`dq_accumulator_block`,
    `dq_staging_layout`), made once per head dim and checked once by TensorDescriptor's own checks on a
    stand-in tensor, as `tma_tile`'s are."""
    import torch

    from attn.kernels.gluon_pipeline import TensorDescriptor

    block, layout = dq_accumulator_block(head_dim), dq_staging_layout()
    TensorDescriptor(torch.empty(block, dtype=torch.float32), block, [block[1], 1], block, layout)
    return block, layout


@functools.lru_cache(maxsize=256)
def _one_pass_plan(dtype, head_dim: int, causal: bool, cap: int, cap_value: float, knee: float, sm_scale: float,
                   has_temp: bool):
    """What every one-pass launch of one backward form shares (`_backward_plan`'s entries, no dt): (dK / dV
    config, tiles, the fp32 dq's tile (`dq_accumulator_tile`), the float scalars (qk_scale, cap_scale,
    alsc_knee, grad_scale), the delta / dK dV dQ / scale-and-cast constexprs)."""
    kv_cfg, _, tiles, floats, delta_constexprs, dkdv_constexprs, _ = _backward_plan(
        dtype, head_dim, causal, cap, cap_value, knee, sm_scale, has_temp, False)
    return (kv_cfg, tiles, dq_accumulator_tile(head_dim), floats[:4], delta_constexprs, dkdv_constexprs,
            dict(BLOCK=CAST_BLOCK))


_DELTA_ZERO_DQ = DirectLauncher(_delta_zero_dq_kernel, "gluon_softmax_bwd_delta_zero_dq")
_DKDV_DQ = DirectLauncher(_dkdv_dq_kernel, "gluon_softmax_bwd_dkdv_dq")
_DQ_CAST = DirectLauncher(_dq_cast_kernel, "gluon_softmax_bwd_dq_cast")


def _launch(q, k, v, out, dout, lse2, sm_scale: float, causal: bool, cap: int, cap_value: float, knee: float,
            temperature, need_dt: bool, one_pass: bool, persistent: bool = False):
    """(dq, dk, dv, dt or None). The separate form: three launches (delta, the key-block dK / dV kernel,
    the query-block dQ kernel; `persistent`: those two on the persistent grid), then dt (B, N) in
    temperature's dtype, the dQ kernel's (B, H, N) rows summed over heads. The one-pass form (`one_pass`,
    never with need_dt, per item): delta (zeroing the fp32 dq too), the key-block kernel with the dQ path,
    and dq's scale-and-cast."""
    import torch

    if one_pass and not need_dt:
        return _launch_one_pass(q, k, v, out, dout, lse2, sm_scale, causal, cap, cap_value, knee, temperature)

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    has_temp = temperature is not None
    kv_cfg, q_cfg, tiles, floats, delta_constexprs, dkdv_constexprs, dq_constexprs = _backward_plan(
        q.dtype, d, causal, cap, cap_value, knee, sm_scale, has_temp, need_dt)
    qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale = floats
    q_view, do_view, k_view, v_view = tma_view(q), tma_view(dout), tma_view(k), tma_view(v)
    q_desc, do_desc = descriptor(q_view, tiles.rows), descriptor(do_view, tiles.rows)
    k_half_desc, v_half_desc = descriptor(k_view, tiles.half_keys), descriptor(v_view, tiles.half_keys)
    k_block_desc, v_block_desc = descriptor(k_view, tiles.key_block), descriptor(v_view, tiles.key_block)

    do_flat = do_view[0]  # contiguous in (H, D): the strides below are its own
    delta = torch.empty((bsz, h, n), device=q.device, dtype=torch.float32)
    so, sdo = out.stride(), do_flat.stride()
    _DELTA.run((cdiv(n, DELTA_BLOCK_M), bsz * h), (), (out, do_flat, delta),
               (so[0], so[1], so[2], sdo[0], sdo[1], sdo[2], h, n), delta_constexprs, GLUON_OPTIONS)

    dq = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k.dtype)
    dv = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=v.dtype)
    temp, (stride_tb, stride_tn) = (temperature, temperature.stride()) if has_temp else (lse2, (0, 0))
    dt_rows = torch.empty((bsz, h, n), device=q.device, dtype=torch.float32) if need_dt else lse2
    kv_strides = (kv_len * h_kv * d, h_kv * d, d)  # dk's and dv's (contiguous)
    dkdv_args = ((k_half_desc, v_half_desc, q_desc, do_desc), (dk, dv, lse2, delta, temp),
                 (*kv_strides, *kv_strides, stride_tb, stride_tn,
                  h, h_kv, h // h_kv, n, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale))
    dq_args = ((q_desc, do_desc, k_block_desc, v_block_desc), (dq, lse2, delta, temp, dt_rows),
               (n * h * d, h * d, d, stride_tb, stride_tn,  # dq's strides (contiguous), the temperature's
                h, h // h_kv, n, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale, dt_scale))
    kv_blocks, q_blocks = cdiv(kv_len, kv_cfg["BLOCK_N"]), cdiv(n, q_cfg["BLOCK_M"])
    if persistent:
        descriptors, tensors, scalars = dkdv_args
        _PERSISTENT_DKDV.run((persistent_programs(kv_blocks * bsz * h_kv, q.device),), descriptors, tensors,
                             (*scalars, bsz * h_kv), dkdv_constexprs, GLUON_OPTIONS)
        descriptors, tensors, scalars = dq_args
        _PERSISTENT_DQ.run((persistent_programs(q_blocks * bsz * h, q.device),), descriptors, tensors,
                           (*scalars, bsz * h), dq_constexprs, GLUON_OPTIONS)
    else:
        _DKDV.run((kv_blocks, bsz * h_kv), *dkdv_args, dkdv_constexprs, GLUON_OPTIONS)
        _DQ.run((q_blocks, bsz * h), *dq_args, dq_constexprs, GLUON_OPTIONS)
    dt = dt_rows.sum(dim=1).to(temperature.dtype) if need_dt else None
    return dq, dk, dv, dt


def _launch_one_pass(q, k, v, out, dout, lse2, sm_scale: float, causal: bool, cap: int, cap_value: float,
                     knee: float, temperature):
    """(dq, dk, dv, None) by the one-pass form: delta with the fp32 dq (B, N, H, D) zeroed, the key-block
    kernel adding every tile's dS K to it (dS carries t F'), then dq = grad_scale dq_acc in q's dtype."""
    import torch

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    has_temp = temperature is not None
    kv_cfg, tiles, dq_tile, floats, delta_constexprs, dkdv_constexprs, cast_constexprs = _one_pass_plan(
        q.dtype, d, causal, cap, cap_value, knee, sm_scale, has_temp)
    qk_scale, cap_scale, alsc_knee, grad_scale = floats
    q_view, do_view, k_view, v_view = tma_view(q), tma_view(dout), tma_view(k), tma_view(v)
    q_desc, do_desc = descriptor(q_view, tiles.rows), descriptor(do_view, tiles.rows)
    k_half_desc, v_half_desc = descriptor(k_view, tiles.half_keys), descriptor(v_view, tiles.half_keys)

    do_flat = do_view[0]  # contiguous in (H, D): the strides below are its own
    delta = torch.empty((bsz, h, n), device=q.device, dtype=torch.float32)
    dq_acc = torch.empty((bsz, n, h, d), device=q.device, dtype=torch.float32)  # zeroed by the delta kernel
    so, sdo = out.stride(), do_flat.stride()
    _DELTA_ZERO_DQ.run((cdiv(n, DELTA_BLOCK_M), bsz * h), (), (out, do_flat, delta, dq_acc),
                       (so[0], so[1], so[2], sdo[0], sdo[1], sdo[2], h, n), delta_constexprs, GLUON_OPTIONS)
    # dq_acc as the 2-d (B N, H D) matrix of its reduce boxes (contiguous: a 16-byte aligned base and rows)
    dq_desc = descriptor((dq_acc, (bsz * n, h * d), (h * d, 1)), dq_tile)

    dk = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=k.dtype)
    dv = torch.empty((bsz, kv_len, h_kv, d), device=q.device, dtype=v.dtype)
    temp, (stride_tb, stride_tn) = (temperature, temperature.stride()) if has_temp else (lse2, (0, 0))
    kv_strides = (kv_len * h_kv * d, h_kv * d, d)  # dk's and dv's (contiguous)
    _DKDV_DQ.run((cdiv(kv_len, kv_cfg["BLOCK_N"]), bsz * h_kv), (k_half_desc, v_half_desc, q_desc, do_desc, dq_desc),
                 (dk, dv, lse2, delta, temp),
                 (*kv_strides, *kv_strides, stride_tb, stride_tn,
                  h, h_kv, h // h_kv, n, kv_len, qk_scale, cap_scale, alsc_knee, grad_scale),
                 dkdv_constexprs, GLUON_OPTIONS)
    dq = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    numel = dq.numel()
    _DQ_CAST.run((cdiv(numel, CAST_BLOCK),), (), (dq_acc, dq), (numel, grad_scale), cast_constexprs, GLUON_OPTIONS)
    return dq, dk, dv, None


def launch_backward(q, k, v, out, dout, lse2, sm_scale: float, causal: bool, *, cap: int = 0,
                    cap_value: float = 0.0, knee: float = 0.0, temperature=None, form: str | None = None,
                    persistent: bool = False):
    """(dq, dk, dv) in the inputs' dtype, without checks (for callers that checked the operands once).
    Logits z_ij = t_i F(sm_scale q_i.k_j) as the portable kernels define them: F the cap `cap` (CAPS' ids;
    its `cap_value` c > 0 and, for ALSC, `knee` in [0, 1), the spec's values), t the optional (B, N)
    `temperature` (any float dtype and strides, any sign), 1 without; sm_scale > 0 without a cap or a
    temperature. `lse2` (B, H, N) fp32 contiguous as either forward writes it for these logits.
    The dq form `form` ("separate" or "one_pass"; None: the one ATTNLAB_GLUON_DQ names, "auto" meaning
    "separate" here, since the backward plans time the forms): three launches (delta, the key-block dK / dV
    kernel, the query-block dQ kernel), or the one-pass form's (delta zeroing the fp32 dq, the key-block
    kernel with the dQ path, dq's scale-and-cast). `persistent`: the separate form's key-block and query-block
    kernels on the persistent grid (a program per SM running work items in turn; the one-pass form runs per
    item)."""
    one_pass = (form or dq_form()) == "one_pass"
    dq, dk, dv, _ = _launch(q, k, v, out, dout, lse2, sm_scale, causal, cap, cap_value, knee, temperature, False,
                            one_pass, persistent)
    return dq, dk, dv


def launch_backward_with_dt(q, k, v, out, dout, lse2, sm_scale: float, causal: bool, *, temperature,
                            cap: int = 0, cap_value: float = 0.0, knee: float = 0.0, persistent: bool = False):
    """`launch_backward` with the temperature's gradient too: (dq, dk, dv, dt), dt (B, N) in temperature's
    dtype (the dQ kernel's per-head rows summed over heads, as the portable backward sums them). Always the
    separate form, whatever ATTNLAB_GLUON_DQ says: only the dQ kernel sums dt; `persistent` as
    `launch_backward`'s."""
    return _launch(q, k, v, out, dout, lse2, sm_scale, causal, cap, cap_value, knee, temperature, True, False,
                   persistent)


def _check_backward(q, k, v, out, dout, lse2, sm_scale, causal, cap, cap_value, knee, temperature):
    """ValueErrors naming what a call of the checked entries misses."""
    import torch

    what = "gluon softmax backward"
    check_operands(q, k, v, causal, what)
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{what}: {name} must have q's shape {tuple(q.shape)}, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{what}: {name} must be {q.dtype} on {q.device} as q, got {t.dtype} on {t.device}")
    bsz, n, h, _ = q.shape
    if not isinstance(lse2, torch.Tensor) or tuple(lse2.shape) != (bsz, h, n):
        raise ValueError(f"{what}: lse2 must be (B, H, N) = {(bsz, h, n)}, got "
                         f"{tuple(getattr(lse2, 'shape', ())) or type(lse2)}")
    if lse2.dtype != torch.float32 or lse2.device != q.device or not lse2.is_contiguous():
        raise ValueError(f"{what}: lse2 must be a contiguous float32 tensor on {q.device}, got {lse2.dtype} on "
                         f"{lse2.device}{'' if lse2.is_contiguous() else ', not contiguous'}")
    if out.stride(-1) != 1:
        raise ValueError(f"{what}: out must be contiguous in its last dim, got strides {tuple(out.stride())}")
    if isinstance(cap, bool) or cap not in CAPS:
        raise ValueError(f"{what}: cap must be one of {CAPS} (softmax_family.CAP_IDS), got {cap!r}")
    if cap != 0 and not (math.isfinite(float(cap_value)) and cap_value > 0):
        raise ValueError(f"{what}: cap_value must be > 0 and finite with cap {cap} ({CAPS[cap]}), got {cap_value}")
    if cap == 3 and not (0.0 <= float(knee) < 1.0):
        raise ValueError(f"{what}: knee must be in [0, 1) with cap 3 (alsc), got {knee}")
    if temperature is not None:
        if not isinstance(temperature, torch.Tensor) or tuple(temperature.shape) != (bsz, n):
            raise ValueError(f"{what}: temperature must be (B, N) = {(bsz, n)}, got "
                             f"{tuple(getattr(temperature, 'shape', ())) or type(temperature)}")
        if not temperature.is_floating_point() or temperature.device != q.device:
            raise ValueError(f"{what}: temperature must be a floating-point tensor on {q.device}, got "
                             f"{temperature.dtype} on {temperature.device}")
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"{what}: sm_scale must be finite, got {sm_scale}")
    if cap == 0 and temperature is None and not sm_scale > 0:
        raise ValueError(f"{what}: sm_scale must be > 0 without a cap or a temperature, got {sm_scale}")


def gluon_softmax_backward(q, k, v, out, dout, lse2, sm_scale: float, causal: bool, *, cap: int = 0,
                           cap_value: float = 0.0, knee: float = 0.0, temperature=None):
    """(dq, dk, dv) of softmax-family attention, Gluon / sm_90, from the forward's `out` and `lse2`
    (`gluon_softmax_fwd`'s or the portable forward's, for the same logits). q, out, dout (B, N, H, D);
    k, v (B, KV, H_kv, D), H % H_kv == 0; D in {64, 128}; bf16 or fp16; lse2 (B, H, N) fp32 contiguous.
    cap, cap_value, knee, temperature: `launch_backward`'s. Raises ValueError naming the requirement a
    call misses."""
    _check_backward(q, k, v, out, dout, lse2, sm_scale, causal, cap, cap_value, knee, temperature)
    return launch_backward(q, k, v, out, dout, lse2, float(sm_scale), causal, cap=cap, cap_value=float(cap_value),
                           knee=float(knee), temperature=temperature)


def gluon_softmax_backward_with_dt(q, k, v, out, dout, lse2, sm_scale: float, causal: bool, *, temperature,
                                   cap: int = 0, cap_value: float = 0.0, knee: float = 0.0):
    """`gluon_softmax_backward` with the temperature's gradient: (dq, dk, dv, dt), dt (B, N) in temperature's
    dtype (`launch_backward_with_dt`). Raises ValueError naming the requirement a call misses."""
    import torch

    if not isinstance(temperature, torch.Tensor):
        raise ValueError(f"gluon softmax backward: temperature must be a (B, N) tensor for its gradient, got "
                         f"{type(temperature)}")
    _check_backward(q, k, v, out, dout, lse2, sm_scale, causal, cap, cap_value, knee, temperature)
    return launch_backward_with_dt(q, k, v, out, dout, lse2, float(sm_scale), causal, temperature=temperature,
                                   cap=cap, cap_value=float(cap_value), knee=float(knee))


# ---------------------------------------------------------------------------------------------
# compiling without a GPU

KERNELS = ("delta", "delta_zero_dq", "dkdv", "dkdv_one_pass", "dq", "dq_cast")


def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90,
                 kernel: str = "dkdv", cap: int = 0, has_temp: bool = False, need_dt: bool = False,
                 persistent: bool = False):
    """One of the backward's kernels (`kernel` in KERNELS) compiled for sm_<arch> without a GPU
    (`gluon_pipeline.compile_gluon_sm90`): the dK / dV kernels (dkdv, and dkdv_one_pass with the dQ path) and
    the dQ kernel with a cap (`cap`, CAP_IDS' ids) and a temperature (`has_temp`), the dQ kernel also with
    d-temperature (`need_dt`); delta_zero_dq and dq_cast are the one-pass form's delta and last kernels.
    `persistent`: the persistent form of dkdv or dq."""
    if kernel in ("delta", "delta_zero_dq"):
        zero_dq = kernel == "delta_zero_dq"
        signature = {"O": f"*{dtype}", "DO": f"*{dtype}", "DELTA": "*fp32", "DQ_ACC": "*fp32",
                     **{name: "i32" for name in ("stride_ob", "stride_on", "stride_oh", "stride_dob", "stride_don",
                                                 "stride_doh", "H", "q_len")},
                     "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr"}
        return compile_gluon_sm90(_delta_zero_dq_kernel if zero_dq else _delta_kernel, signature,
                                  {"HEAD_DIM": head_dim, "BLOCK_M": DELTA_BLOCK_M},
                                  ("O", "DO", "DELTA", "DQ_ACC") if zero_dq else ("O", "DO", "DELTA"), arch)
    if kernel == "dq_cast":
        signature = {"DQ_ACC": "*fp32", "DQ": f"*{dtype}", "numel": "i32", "grad_scale": "fp32", "BLOCK": "constexpr"}
        return compile_gluon_sm90(_dq_cast_kernel, signature, {"BLOCK": CAST_BLOCK}, ("DQ_ACC", "DQ"), arch)
    if persistent and kernel not in ("dkdv", "dq"):
        raise ValueError(f"persistent compiles the dkdv and dq kernels only, got kernel={kernel!r}")
    if need_dt and not (kernel == "dq" and has_temp):
        raise ValueError(f"need_dt compiles into the dq kernel with has_temp only, got kernel={kernel!r}, "
                         f"has_temp={has_temp}")
    rows = descriptor_type(dtype, [64, head_dim])
    scalars = {"stride_tb": "i32", "stride_tn": "i32", "q_len": "i32", "kv_len": "i32", "qk_scale": "fp32",
               "cap_scale": "fp32", "alsc_knee": "fp32", "grad_scale": "fp32"}
    tail = {"CAP": "constexpr", "HAS_TEMP": "constexpr", "CAUSAL": "constexpr", "HEAD_DIM": "constexpr",
            "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr"}
    constexprs = {"CAP": cap, "HAS_TEMP": has_temp, "CAUSAL": causal, "HEAD_DIM": head_dim}
    if kernel in ("dkdv", "dkdv_one_pass"):
        cfg = dkdv_tile_config(head_dim)
        keys = descriptor_type(dtype, [cfg["BLOCK_N"] // 2, head_dim])
        dq_block = dq_accumulator_block(head_dim)
        dq_acc = f"tensordesc<fp32[{dq_block[0]}, {dq_block[1]}],{dq_staging_layout()!r}>"
        signature = {"k_desc": keys, "v_desc": keys, "q_desc": rows, "do_desc": rows, "dq_desc": dq_acc,
                     "DK": f"*{dtype}", "DV": f"*{dtype}", "LSE": "*fp32", "DELTA": "*fp32", "TEMP": "*fp32",
                     **{f"stride_d{t}{dim}": "i32" for t in "kv" for dim in "bnh"},
                     "H": "i32", "H_KV": "i32", "GROUP": "i32", "BHK": "i32", **scalars, **tail}
        fn = (_dkdv_dq_kernel if kernel == "dkdv_one_pass" else
              _persistent_dkdv_kernel if persistent else _dkdv_kernel)
        aligned = ("DK", "DV", "LSE", "DELTA")
    elif kernel == "dq":
        cfg = dq_tile_config(head_dim)
        keys = descriptor_type(dtype, [cfg["BLOCK_N"], head_dim])
        signature = {"q_desc": rows, "do_desc": rows, "k_desc": keys, "v_desc": keys, "DQ": f"*{dtype}",
                     "LSE": "*fp32", "DELTA": "*fp32", "TEMP": "*fp32", "DT": "*fp32", "stride_dqb": "i32",
                     "stride_dqn": "i32", "stride_dqh": "i32", "H": "i32", "GROUP": "i32", "BH": "i32", **scalars,
                     "dt_scale": "fp32", "NEED_DT": "constexpr", **tail}
        fn, aligned = (_persistent_dq_kernel if persistent else _dq_kernel), ("DQ", "LSE", "DELTA", "DT")
        constexprs["NEED_DT"] = need_dt
    else:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return compile_gluon_sm90(fn, signature, {**constexprs, **cfg}, aligned, arch)
