"""The differential threshold attention forward in Gluon for sm_90 (Hopper), in one pass.

Two score views (q, k) and (q2, k2) share v (DESIGN.md §4, `diff_threshold`):

    w_ij = relu(q_i.k_j - tau_i)^p - lambda_h relu(q2_i.k2_j - tau_i)^p,   tau_i = beta sqrt(2 ln n_i / D)
    out_i = sum_j w_ij v_j over the keys j query i sees (n_i of them; a row that sees none: 0)

lambda_h is read per head from a (H,) tensor of any float dtype and strides, in fp32, as the portable
kernel reads it (`attn/kernels/threshold_family.py`, DIFF).

Schedule: `gluon_pipeline`'s (FA3's producer warp and two consumer warpgroups of 64 query rows each),
with a ring of three streamed operands. Per key block the producer loads K and K2 into one slot (one
"ready" barrier for the pair) and V into another; each consumer holds its Q and Q2 tiles in shared
memory, issues S1 = Q K^T and S2 = Q2 K2^T back to back as async wgmmas beside the previous block's
O += W V, forms W = relu(S1 - tau)^p - lambda relu(S2 - tau)^p in the wgmmas' registers while the tensor
cores run W V, and issues one W V per block: three products per block, not four. A program per work item
(query block, batch x head) or, with `persistent=True`, `gluon_pipeline`'s persistent grid (its producer
loads the next item's first key block, then its Q and Q2 tiles, while the consumers finish). Key blocks wholly
visible to every row run without mask arithmetic; on the causal diagonal and the ragged last block both
views' scores of keys a row does not see become -inf before the weight (relu(-inf - tau) = 0), as in
the one-map forward. A NaN score of a visible key gives a NaN weight, as the reference does.

Two fp32 score tiles of 64 x BLOCK_N and the 64 x D accumulator live in a consumer's registers at once
(plus the previous block's 16-bit weights): BLOCK_N is 64 at D = 128 and 128 at D = 64
(`tile_config`), which keeps the loops free of local memory.

Serves what the one-map Gluon forward serves (`gluon_weighted_fwd`): no segments, key lengths, window
or dropout; causal (bottom-right aligned: query row i at key position i + KV - N) or full; GQA with q2
and k2 shaped like q and k; D 64 / 128; bf16 / fp16. Behind the public function through the kernel tiers:
`attn/kernels/threshold_family.py`'s forward plan offers `launch_diff_threshold` to the differential calls
it serves (`attn/kernels/tiers.py`, ATTNLAB_GLUON).
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
    PRODUCER_REGS,
    allocate_item_empty,
    check_operands,
    compile_gluon_sm90,
    descriptor,
    descriptor_type,
    fence_async_shared,
    invalidate_ring,
    issue_pv,
    key_blocks,
    mbarrier,
    persistent_item,
    persistent_programs,
    program_rows,
    pv_operand,
    release,
    tma,
    tma_tile,
    tma_view,
    visible_key,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from attn.kernels.gluon_weighted_fwd import THRESHOLD, TINY, _ex2, _lg2, _row_value, power_mode
from attn.kernels.runtime import DirectLauncher, cdiv

HEAD_DIMS = (64, 128)


def tile_config(head_dim: int) -> dict:
    """Constexprs per head dim: BLOCK_M query rows (64 per consumer warpgroup), BLOCK_N keys per ring
    slot, STAGES ring slots (a slot: K, K2 and V, 3 BLOCK_N D 2 bytes; plus Q and Q2, 2 BLOCK_M D 2 bytes).
    BLOCK_N keeps S1, S2 (64 x BLOCK_N fp32 each) and O (64 x D fp32) within a consumer's registers."""
    if head_dim == 64:
        return dict(BLOCK_M=128, BLOCK_N=128, STAGES=3)  # 3 x 48 KiB + 32 KiB
    if head_dim == 128:
        return dict(BLOCK_M=128, BLOCK_N=64, STAGES=3)  # 3 x 48 KiB + 64 KiB
    raise ValueError(f"gluon differential threshold forward: head dim must be one of {HEAD_DIMS}, got {head_dim}")


@gluon.jit
def _allocate_ring(q_desc, k_desc, v_desc, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, TILES: gl.constexpr = 2):
    """Shared memory and barriers: both consumers' Q and Q2 halves (one barrier for all four tiles; TILES = 1:
    one tile of each that both consumers read), STAGES slots of K, K2 and V, a ready / empty mbarrier pair for
    the slot's K and K2 and one for its V (empty barriers count one arrival per consumer)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [TILES, HALF_M, HEAD_DIM], q_desc.layout)
    q2_smem = gl.allocate_shared_memory(dtype, [TILES, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    k2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    return q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def _load_queries(q_desc, q2_desc, q_smem, q2_smem, q_bar, q_row, q_col, HALF_M: gl.constexpr, do_desc=None,
                  do_smem=None, WITH_DO: gl.constexpr = False):
    """Both consumers' Q and Q2 halves of the query block from row q_row (WITH_DO: and dO's), on one barrier."""
    if WITH_DO:
        mbarrier.expect(q_bar, 6 * q_desc.block_type.nbytes)
    else:
        mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row + half * HALF_M, q_col], q_bar, q_smem.index(half))
        tma.async_copy_global_to_shared(q2_desc, [q_row + half * HALF_M, q_col], q_bar, q2_smem.index(half))
        if WITH_DO:
            tma.async_copy_global_to_shared(do_desc, [q_row + half * HALF_M, q_col], q_bar, do_smem.index(half))


@gluon.jit
def _stream_keys(k_desc, k2_desc, v_desc, k_smem, k2_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_row, kv_col,
                 first, count, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key blocks i = 0 .. count-1 from row k_row + i BLOCK_N as the ring's tiles j = first + i: K and K2 (one
    ready barrier) and V into slot j % STAGES, each once both consumers released the slot's previous use
    (empty phase parity starts at 1: the first round does not wait)."""
    for i in range(count):
        j = first + i
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        r = k_row + i * BLOCK_N
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [r, kv_col], k_ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(k2_desc, [r, kv_col], k_ready.index(s), k2_smem.index(s))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [r, kv_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _producer(q_desc, q2_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, k_ready,
              v_ready, k_empty, v_empty, q_row, k_row, kv_col, q_col, n_tiles,
              HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: Q and Q2 once, then K, K2 and V of key blocks 0 .. n_tiles-1 (`_stream_keys`)."""
    _load_queries(q_desc, q2_desc, q_smem, q2_smem, q_bar, q_row, q_col, HALF_M)
    _stream_keys(k_desc, k2_desc, v_desc, k_smem, k2_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_row, kv_col,
                 0, n_tiles, BLOCK_N, STAGES)


@gluon.jit
def _persistent_producer(q_desc, q2_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar,
                         q_empty, k_ready, v_ready, k_empty, v_empty, q_len, kv_len, H, GROUP, BH, n_items,
                         HEAD_DIM: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, do_desc=None, do_smem=None, WITH_DO: gl.constexpr = False):
    """One warp of the persistent forward (`gluon_pipeline.persistent_producer`'s order with both views): per
    work item its first key block, then its Q and Q2 tiles once both consumers are done with the last item's
    (q_empty), then the rest of its key blocks. WITH_DO (the differential backward's dQ kernel): dO's rows
    too, on the query tiles' barrier (`gluon_diff_bwd._load_rows`)."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        k_row = b * kv_len
        kv_col = hk * HEAD_DIM
        first = gl.minimum(n_tiles, 1)
        _stream_keys(k_desc, k2_desc, v_desc, k_smem, k2_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_row,
                     kv_col, ring, first, BLOCK_N, STAGES)
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        if WITH_DO:
            _load_queries(q_desc, q2_desc, q_smem, q2_smem, q_bar, b * q_len + m0, h * HEAD_DIM, HALF_M, do_desc,
                          do_smem, True)
        else:
            _load_queries(q_desc, q2_desc, q_smem, q2_smem, q_bar, b * q_len + m0, h * HEAD_DIM, HALF_M)
        _stream_keys(k_desc, k2_desc, v_desc, k_smem, k2_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     k_row + first * BLOCK_N, kv_col, ring + first, n_tiles - first, BLOCK_N, STAGES)
        ring += n_tiles
        it += 1


@gluon.jit
def _issue_scores(j, q_smem, q2_smem, k_smem, k2_smem, k_ready, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Waits for key block j's K and K2 tiles, then issues S1 = Q K^T and S2 = Q2 K2^T as async wgmmas
    (not waited on)."""
    s = j % STAGES
    k_tile = k_smem.index(s)
    k2_tile = k2_smem.index(s)
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s1 = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    s2 = warpgroup_mma(q2_smem, k2_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    return s1, s2, k_tile, k2_tile


@gluon.jit
def _rectified_power(x, power, POWER_MODE: gl.constexpr):
    """relu(x)^p in fp32 (NaN for a NaN x). POWER_MODE 1 / 2: p = 1 / 2 without a MUFU op; 0: any p > 0,
    2^(p log2 x) on MUFU.LG2 and MUFU.EX2 (x clamped to the smallest normal, so log2 stays finite)."""
    relu = gl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    if POWER_MODE == 1:
        w = relu
    elif POWER_MODE == 2:
        w = relu * relu
    else:  # relu is 0 for x <= 0 and NaN for a NaN x, so it stands in where no power is taken
        w = gl.where(x > 0.0, _ex2(power * _lg2(gl.maximum(x, TINY))), relu)
    return w


@gluon.jit
def _diff_weights(s1, s2, j, tau, lam, last_key, kv_len, power, POWER_MODE: gl.constexpr, MASKED: gl.constexpr,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block j's raw scores of both views (fp32, in the wgmmas' registers) -> its weights
    w = relu(s1 - tau)^p - lam relu(s2 - tau)^p (fp32), 0 at keys the rows do not see (MASKED: both views'
    scores select -inf there before the weight; one select on w instead spills in the D = 64 masked loop)."""
    t = gl.expand_dims(tau, 1)
    if MASKED:
        s_layout: gl.constexpr = s1.type.layout
        visible = visible_key(j, last_key, kv_len, s_layout, CAUSAL, BLOCK_N)
        s1 = gl.where(visible, s1, -float("inf"))
        s2 = gl.where(visible, s2, -float("inf"))
    return _rectified_power(s1 - t, power, POWER_MODE) - lam * _rectified_power(s2 - t, power, POWER_MODE)


@gluon.jit
def _pipelined_block(j, r, w16, acc, q_smem, q2_smem, k_smem, k2_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     tau, lam, last_key, kv_len, power, s_layout: gl.constexpr, p_layout: gl.constexpr,
                     POWER_MODE: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block j with block j - 1's W V in flight: S1_j, S2_j and O += W_{j-1} V_{j-1} issued back to
    back, block j's weights formed while the tensor cores run W_{j-1} V_{j-1}. r: block j's tile in the ring
    (j, plus the tiles of a persistent program's earlier work items). Returns (W_j packed, O)."""
    s1, s2, k_tile, k2_tile = _issue_scores(r, q_smem, q2_smem, k_smem, k2_smem, k_ready, s_layout, BLOCK_M, BLOCK_N,
                                            STAGES)
    acc, v_tile = issue_pv(r - 1, w16, acc, v_smem, v_ready, STAGES)
    s1, s2, q_smem, q2_smem, k_tile, k2_tile = warpgroup_mma_wait(
        num_outstanding=1, deps=(s1, s2, q_smem, q2_smem, k_tile, k2_tile))
    release(r, k_empty, STAGES)
    w = _diff_weights(s1, s2, j, tau, lam, last_key, kv_len, power, POWER_MODE, MASKED, CAUSAL, BLOCK_N)
    # W_{j-1} among the deps: its registers stay live until the wgmma that reads them retired
    acc, v_tile, w16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, w16))
    release(r - 1, v_empty, STAGES)
    return pv_operand(w, v_smem, p_layout), acc


@gluon.jit
def _consumer(q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, o_base,
              stride_on, LAM, lam_offset, m0, q_len, kv_len, n_full, n_tiles, tau_scale, power, ring, q_phase, q_empty,
              POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr,
              PERSISTENT: gl.constexpr = False):
    """One warpgroup: BLOCK_M (64) query rows from m0 against key blocks [0, n_tiles) (unmasked below n_full);
    key block j is ring tile ring + j, the query tiles' phase q_phase. PERSISTENT: one of a persistent
    program's work items, which arrives on q_empty once its last S1 / S2 products retired (the producer then
    loads the next item's query tiles). Stores its rows of out."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS_C, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    last_key = gl.minimum(rows + (kv_len - q_len), kv_len - 1)
    tau = _row_value(rows, kv_len, q_len, tau_scale, THRESHOLD, False, CAUSAL)
    lam = gl.load(LAM + lam_offset).to(gl.float32)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, q_phase)
    if n_tiles > 0:
        s1, s2, k_tile, k2_tile = _issue_scores(ring, q_smem, q2_smem, k_smem, k2_smem, k_ready, s_layout, BLOCK_M,
                                                BLOCK_N, STAGES)
        s1, s2, q_smem, q2_smem, k_tile, k2_tile = warpgroup_mma_wait(
            num_outstanding=0, deps=(s1, s2, q_smem, q2_smem, k_tile, k2_tile))
        release(ring, k_empty, STAGES)
        if n_full > 0:
            w0 = _diff_weights(s1, s2, 0, tau, lam, last_key, kv_len, power, POWER_MODE, False, CAUSAL, BLOCK_N)
        else:
            w0 = _diff_weights(s1, s2, 0, tau, lam, last_key, kv_len, power, POWER_MODE, True, CAUSAL, BLOCK_N)
        w16 = pv_operand(w0, v_smem, p_layout)
        for j in range(1, n_full):
            w16, acc = _pipelined_block(j, ring + j, w16, acc, q_smem, q2_smem, k_smem, k2_smem, v_smem, k_ready,
                                        v_ready, k_empty, v_empty, tau, lam, last_key, kv_len, power, s_layout,
                                        p_layout, POWER_MODE, False, CAUSAL, BLOCK_M, BLOCK_N, STAGES)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            w16, acc = _pipelined_block(j, ring + j, w16, acc, q_smem, q2_smem, k_smem, k2_smem, v_smem, k_ready,
                                        v_ready, k_empty, v_empty, tau, lam, last_key, kv_len, power, s_layout,
                                        p_layout, POWER_MODE, True, CAUSAL, BLOCK_M, BLOCK_N, STAGES)
        if PERSISTENT:  # every score product of the item has retired: the query tiles are free
            gl.thread_barrier()
            mbarrier.arrive(q_empty)
        acc, v_tile = issue_pv(ring + n_tiles - 1, w16, acc, v_smem, v_ready, STAGES)
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
def _gluon_diff_threshold_fwd_kernel(q_desc, k_desc, v_desc, q2_desc, k2_desc, O, LAM,
                                     stride_ob, stride_on, stride_oh, stride_lam,
                                     H, GROUP, q_len, kv_len, tau_scale, power,
                                     POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Program (query block, batch x head): rows [m0, m0 + BLOCK_M), two consumer warpgroups of
    BLOCK_M / 2 rows each (the default partition and a 4-warp worker) and a 1-warp TMA producer."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    b, h, hk, bh, m0 = program_rows(q_len, H, GROUP, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = _allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    o_base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    lam_offset = h.to(gl.int64) * stride_lam
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), q2_smem.index(0), k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                     v_empty, O, o_base, stride_on, LAM, lam_offset, m0, q_len, kv_len, n_full, n_tiles, tau_scale,
                     power, 0, 0, k_empty, POWER_MODE, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_consumer, (q_smem.index(1), q2_smem.index(1), k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                     v_empty, O, o_base, stride_on, LAM, lam_offset, m0 + HALF_M, q_len, kv_len, n_full, n_tiles,
                     tau_scale, power, 0, 0, k_empty, POWER_MODE, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES,
                     NUM_WARPS_C)),
        (_producer, (q_desc, q2_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar,
                     k_ready, v_ready, k_empty, v_empty, b * q_len + m0, b * kv_len, hk * HEAD_DIM, h * HEAD_DIM,
                     n_tiles, HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)


@gluon.jit
def _persistent_consumer(q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                         O, LAM, stride_ob, stride_on, stride_oh, stride_lam, H, GROUP, BH, n_items, q_len, kv_len,
                         tau_scale, power, POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr, HALF_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                         NUM_WARPS_C: gl.constexpr, WARPGROUP: gl.constexpr):
    """One consumer warpgroup of the persistent forward: `_consumer` on its half of each work item of the
    program (`gluon_pipeline.work_item`'s order, as the producer), the ring's tile count and the query tiles'
    phase carried from item to item."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        _consumer(q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O,
                  b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh, stride_on, LAM,
                  h.to(gl.int64) * stride_lam, m0 + WARPGROUP * HALF_M, q_len, kv_len, n_full, n_tiles, tau_scale,
                  power, ring, it & 1, q_empty, POWER_MODE, CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C,
                  True)
        ring += n_tiles
        it += 1


@gluon.jit
def _gluon_diff_threshold_fwd_persistent_kernel(q_desc, k_desc, v_desc, q2_desc, k2_desc, O, LAM,
                                                stride_ob, stride_on, stride_oh, stride_lam,
                                                H, GROUP, q_len, kv_len, tau_scale, power, BH,
                                                POWER_MODE: gl.constexpr, CAUSAL: gl.constexpr,
                                                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                                STAGES: gl.constexpr):
    """The persistent form of `_gluon_diff_threshold_fwd_kernel` (a grid of at most one program per SM, each
    running work items (query block, batch x head) in `gluon_pipeline.work_item`'s order): the same partitions
    and per-item work, the producer loading the next item's tiles while the consumers finish this one."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_items = gl.cdiv(q_len, BLOCK_M) * BH
    q_smem, q2_smem, k_smem, k2_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = _allocate_ring(
        q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, STAGES)
    q_empty = allocate_item_empty()
    gl.warp_specialize([
        (_persistent_consumer, (q_smem.index(0), q2_smem.index(0), k_smem, k2_smem, v_smem, q_bar, q_empty, k_ready,
                                v_ready, k_empty, v_empty, O, LAM, stride_ob, stride_on, stride_oh, stride_lam, H,
                                GROUP, BH, n_items, q_len, kv_len, tau_scale, power, POWER_MODE, CAUSAL, HALF_M,
                                BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, 0)),
        (_persistent_consumer, (q_smem.index(1), q2_smem.index(1), k_smem, k2_smem, v_smem, q_bar, q_empty, k_ready,
                                v_ready, k_empty, v_empty, O, LAM, stride_ob, stride_on, stride_oh, stride_lam, H,
                                GROUP, BH, n_items, q_len, kv_len, tau_scale, power, POWER_MODE, CAUSAL, HALF_M,
                                BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C, 1)),
        (_persistent_producer, (q_desc, q2_desc, k_desc, k2_desc, v_desc, q_smem, q2_smem, k_smem, k2_smem, v_smem,
                                q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, q_len, kv_len, H, GROUP, BH,
                                n_items, HEAD_DIM, HALF_M, BLOCK_N, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES)
    mbarrier.invalidate(q_empty)


# ---------------------------------------------------------------------------------------------
# host side


@functools.cache
def _forward_plan(dtype, head_dim: int, causal: bool, power_constexpr: int):
    """What every launch of one kernel form shares: (BLOCK_M, the query tile, the key / value tile, the
    constexprs)."""
    cfg = tile_config(head_dim)
    constexprs = dict(POWER_MODE=power_constexpr, CAUSAL=causal, HEAD_DIM=head_dim, **cfg)
    return (cfg["BLOCK_M"], tma_tile(dtype, cfg["BLOCK_M"] // 2, head_dim), tma_tile(dtype, cfg["BLOCK_N"], head_dim),
            constexprs)


_FORWARD = DirectLauncher(_gluon_diff_threshold_fwd_kernel, "gluon_diff_fwd")
_PERSISTENT_FORWARD = DirectLauncher(_gluon_diff_threshold_fwd_persistent_kernel, "gluon_diff_fwd_persistent")


def launch_diff_threshold(q, k, v, q2, k2, lam, causal: bool, beta: float, power: float, persistent: bool = False):
    """Differential threshold attention's output (B, N, H, D) in q's dtype, without checks:
    w = relu(q.k - tau_i)^power - lam_h relu(q2.k2 - tau_i)^power, tau_i = beta sqrt(2 ln n_i / D).
    q, q2 (B, N, H, D); k, k2, v (B, KV, H_kv, D); lam (H,). TMA descriptors: q and q2 in half query blocks
    (one consumer's rows), k, v and k2 in BLOCK_N keys (a ring slot). `persistent`: the persistent kernel
    (one program per SM running work items in turn)."""
    import torch

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    block_m, q_tile, kv_tile, constexprs = _forward_plan(q.dtype, d, causal, power_mode(power))
    out = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    descriptors = (descriptor(tma_view(q), q_tile), descriptor(tma_view(k), kv_tile), descriptor(tma_view(v), kv_tile),
                   descriptor(tma_view(q2), q_tile), descriptor(tma_view(k2), kv_tile))
    scalars = (n * h * d, h * d, d, lam.stride(0),  # out's strides (contiguous), lam's
               h, h // h_kv, n, kv_len, float(beta * math.sqrt(2.0 / d)), float(power))
    if persistent:
        _PERSISTENT_FORWARD.run((persistent_programs(cdiv(n, block_m) * bsz * h, q.device),), descriptors, (out, lam),
                                (*scalars, bsz * h), constexprs, GLUON_OPTIONS)
    else:
        _FORWARD.run((cdiv(n, block_m), bsz * h), descriptors, (out, lam), scalars, constexprs, GLUON_OPTIONS)
    return out


def check_second_view(q, k, q2, k2, lam, beta, power, what: str, dout=None):
    """ValueErrors naming what a direct call of a differential threshold kernel (`what`) misses besides
    `check_operands`' requirements of q, k, v: q2 and `dout` (where given) of q's shape, dtype and device, k2 of
    k's; lam an (H,) float tensor on q's device; power > 0 and finite, beta finite."""
    import torch

    pairs = (("q2", q2, "q", q), ("k2", k2, "k", k)) + ((("dout", dout, "q", q),) if dout is not None else ())
    for name, t, like_name, like in pairs:
        if not isinstance(t, torch.Tensor) or t.shape != like.shape:
            raise ValueError(f"{what}: {name} must have the shape of {like_name} {tuple(like.shape)}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
        if t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"{what}: {name} must match {like_name}'s dtype and device ({like.dtype}, "
                             f"{like.device}), got {t.dtype}, {t.device}")
    h = q.shape[2]
    if not isinstance(lam, torch.Tensor) or tuple(lam.shape) != (h,):
        raise ValueError(f"{what}: lam must be a tensor of shape (H,) = ({h},), got {getattr(lam, 'shape', lam)}")
    if lam.dtype not in (torch.float32, torch.bfloat16, torch.float16) or lam.device != q.device:
        raise ValueError(f"{what}: lam must be float32, bfloat16 or float16 on q's device ({q.device}), got "
                         f"{lam.dtype} on {lam.device}")
    if not (math.isfinite(float(power)) and power > 0):
        raise ValueError(f"{what}: power must be > 0 and finite, got {power}")
    if not math.isfinite(float(beta)):
        raise ValueError(f"{what}: beta must be finite, got {beta}")


def gluon_diff_threshold_forward(q, k, v, q2, k2, lam, causal: bool, beta: float = 1.0, power: float = 2.0):
    """`launch_diff_threshold` with its operands checked (ValueError naming what a call misses)."""
    what = "gluon differential threshold forward"
    check_operands(q, k, v, causal, what)
    check_second_view(q, k, q2, k2, lam, beta, power, what)
    return launch_diff_threshold(q, k, v, q2, k2, lam, causal, beta, power)


def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90,
                 power: float = 2.0, lam_dtype: str = "fp32", block_n: int | None = None, stages: int | None = None,
                 persistent: bool = False):
    """The kernel (`persistent`: the persistent one) compiled for sm_<arch> without a GPU
    (`gluon_pipeline.compile_gluon_sm90`), on `tile_config(head_dim)` or another BLOCK_N / STAGES."""
    cfg = tile_config(head_dim)
    cfg.update({key: value for key, value in (("BLOCK_N", block_n), ("STAGES", stages)) if value is not None})
    q_type = descriptor_type(dtype, [cfg["BLOCK_M"] // 2, head_dim])
    kv_type = descriptor_type(dtype, [cfg["BLOCK_N"], head_dim])
    signature = {"q_desc": q_type, "k_desc": kv_type, "v_desc": kv_type, "q2_desc": q_type, "k2_desc": kv_type,
                 "O": f"*{dtype}", "LAM": f"*{lam_dtype}", "stride_ob": "i32", "stride_on": "i32",
                 "stride_oh": "i32", "stride_lam": "i32", "H": "i32", "GROUP": "i32", "q_len": "i32",
                 "kv_len": "i32", "tau_scale": "fp32", "power": "fp32", "POWER_MODE": "constexpr",
                 "CAUSAL": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                 "STAGES": "constexpr"}
    constexprs = {"POWER_MODE": power_mode(power), "CAUSAL": causal, "HEAD_DIM": head_dim, **cfg}
    if persistent:
        signature = {**{key: value for key, value in signature.items() if value != "constexpr"}, "BH": "i32",
                     **{key: value for key, value in signature.items() if value == "constexpr"}}
        return compile_gluon_sm90(_gluon_diff_threshold_fwd_persistent_kernel, signature, constexprs, ("O",), arch)
    return compile_gluon_sm90(_gluon_diff_threshold_fwd_kernel, signature, constexprs, ("O",), arch)
