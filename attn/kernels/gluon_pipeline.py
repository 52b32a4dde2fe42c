"""What the Gluon sm_90 attention forwards share: the TMA ring of key / value tiles, its producer and
the consumers' wgmma issue and release, the program's rows and key blocks, and the host side
(descriptors, checks, compiling without a GPU).

Schedule (one program = BLOCK_M query rows of one (batch, head)):

- a producer partition (one warp, few registers) issues TMA loads: the query tile once, then
  the key and value tiles of every key block the rows can see, into a ring of STAGES
  shared-memory slots. Each slot has a "ready" mbarrier per operand (the TMA completes it with
  its byte count) and an "empty" mbarrier per operand (the consumer arrives when its wgmma has
  read the slot); the producer waits on "empty" before it overwrites a slot.
- two consumer warpgroups (the default partition and a 4-warp worker partition, 64 rows each,
  each with its own register budget through setmaxnreg) share the ring: a slot's empty barriers
  count one arrival per warpgroup. By default they are not tied to each other, so one's elementwise
  work can run while the other's wgmma does (FA3's inter-warpgroup overlap); a kernel's PINGPONG
  constexpr orders them as FA3's ping-pong does (they take turns at issuing their wgmmas, two named
  barriers: the protocol below `release`). Each consumer issues block j's S = Q K^T and block j-1's
  O += P V back to back (FA3's intra-warpgroup overlap) and turns S into P while the tensor cores run P V.
- causal programs are issued longest first (the last query block first).

Layouts as the portable kernels take them: q, out (B, N, H, D); k, v (B, KV, H_kv, D) with
H % H_kv == 0 (GQA). Causal is bottom-right aligned: query row i sits at key position
i + KV - N. The TMA descriptors view q as (B N, H D) and k, v as (B KV, H_kv D): a tile that runs
past a batch's last row reads the next batch's rows, which the key mask (key < KV) and the row
mask of the stores (row < N) discard.

Written against Triton 3.6's Gluon API (`triton.experimental.gluon`); Gluon changes between Triton
releases, so `gluon_api_available()` says whether the installed Triton has what these files use.
"""

from __future__ import annotations

import functools

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:  # Triton 3.6's Gluon Hopper API (names moved or changed in other releases)
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _IMPORT_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = exc

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
NUM_WARPS = 4  # the default partition: one consumer warpgroup (the second is a worker partition)
CONSUMER_REGS = gl.constexpr(240)  # setmaxnreg of the worker consumer warpgroup
PRODUCER_REGS = gl.constexpr(24)  # and of the TMA producer warp


@functools.cache
def gluon_api_available() -> tuple[bool, str]:
    """(usable, reason): whether the installed Triton has the Gluon Hopper API this kernel is
    written against (Triton 3.6: warp_specialize([(fn, args), ...], warps, regs), gl.thread_barrier,
    hopper tma / mbarrier / warpgroup_mma, host TensorDescriptor with an NVMMASharedLayout)."""
    if _IMPORT_ERROR is not None:
        return False, f"triton {triton.__version__}: Gluon Hopper imports failed ({_IMPORT_ERROR})"
    import inspect

    params = list(inspect.signature(gl.warp_specialize.__wrapped__ if hasattr(gl.warp_specialize, "__wrapped__")
                                    else gl.warp_specialize).parameters)
    if params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        return False, (f"triton {triton.__version__}: gl.warp_specialize{tuple(params)} is not Triton 3.6's "
                       "(functions_and_args, worker_num_warps, worker_num_regs)")
    if not hasattr(gl, "thread_barrier"):
        return False, f"triton {triton.__version__}: no gl.thread_barrier (renamed after Triton 3.6)"
    if not hasattr(tma, "async_copy_global_to_shared"):
        return False, f"triton {triton.__version__}: no hopper tma.async_copy_global_to_shared"
    return True, f"triton {triton.__version__}"


def tile_config(head_dim: int) -> dict:
    """Constexprs per head dim: BLOCK_M query rows (64 per consumer warpgroup), BLOCK_N keys per
    ring slot, STAGES ring slots (K and V: 2 BLOCK_N D 2 bytes a slot; Q: BLOCK_M D 2 bytes)."""
    if head_dim == 64:
        return dict(BLOCK_M=128, BLOCK_N=128, STAGES=3)  # 3 x 32 KiB + 16 KiB
    if head_dim == 128:
        return dict(BLOCK_M=128, BLOCK_N=128, STAGES=2)  # 2 x 64 KiB + 32 KiB
    raise ValueError(f"gluon softmax forward: head dim must be one of {HEAD_DIMS}, got {head_dim}")


@gluon.jit
def program_rows(q_len, H, GROUP, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(b, h, hk, bh, m0) of this program: batch, head, its kv head (GQA), batch x head, first row;
    causal programs run the last query blocks first (longest first)."""
    num_m = gl.cdiv(q_len, BLOCK_M)
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    return b, h, h // GROUP, bh, pid_m * BLOCK_M


@gluon.jit
def key_blocks(m0, q_len, kv_len, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(n_full, n_tiles): key blocks [0, n_full) are visible to every row of the program, blocks
    [n_full, n_tiles) need the mask (the causal diagonal, the ragged last block)."""
    if CAUSAL:
        p0 = m0 + kv_len - q_len  # key position of the program's first row
        hi = gl.minimum(gl.maximum(p0 + BLOCK_M, 0), kv_len)
        n_full = gl.minimum(gl.maximum(p0 + 1, 0), kv_len) // BLOCK_N
    else:
        hi = kv_len
        n_full = kv_len // BLOCK_N
    n_tiles = gl.cdiv(hi, BLOCK_N)
    return gl.minimum(n_full, n_tiles), n_tiles


@gluon.jit
def visible_key(j, last_key, kv_len, s_layout: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Which scores of key block j a consumer's rows see (a [rows, BLOCK_N] boolean): key < kv_len,
    and causal key <= the row's position, as one compare per score against `last_key`
    (min(row position, kv_len - 1), negative for a row that sees no key)."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:
        visible = gl.expand_dims(cols, 0) <= gl.expand_dims(last_key - j * BLOCK_N, 1)
    else:
        visible = gl.expand_dims(cols < kv_len - j * BLOCK_N, 0)
    return visible


@gluon.jit
def allocate_ring(q_desc, k_desc, v_desc, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr):
    """Shared memory and barriers: the two consumers' stationary tiles (the forwards' query halves; the
    backward's query and key halves, through the descriptor passed as q_desc), STAGES slots of the two
    streamed operands (key and value; query and dO), and the ready / empty mbarriers (initialized; empty
    ones count one arrival per consumer)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
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
    return q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def invalidate_ring(q_bar, k_ready, v_ready, k_empty, v_empty, STAGES: gl.constexpr):
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))


@gluon.jit
def producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              q_row, k_row, kv_col, q_col, n_tiles,
              HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: Q once, then K and V of key blocks 0 .. n_tiles-1 into ring slot j % STAGES
    (`stream_ring`)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, q_col], q_bar, q_smem.index(1))
    stream_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_row, kv_col, 0, n_tiles,
                BLOCK_N, STAGES)


# Persistent forwards: one program per SM, each running work items (query block, batch x head) t = pid,
# pid + programs, ... in the order `work_item` gives; the ring's tile count and the query tile's phase run on
# across a program's items, so the producer loads the next item's first key / value tiles and its query tile
# while the consumers finish this item (its last P V and the epilogue), which a program per item cannot
# overlap (FlashAttention-3's persistent schedule, statically assigned).
# (batch, head) pairs per work-item group: of 1, 2, 8, 32 and 192 (every pair in one group), 2 is the fastest
# on an H100 at (16,12,1024,64) and within 3 % of the fastest (1) at (4,16,4096,128)
# (docs/results/gluon/persistent_forward_h100.md); larger groups spread the items in flight over more heads'
# key / value tiles (8: 11 % slower than the per-item grid at 4K keys)
HEADS_PER_WORK_GROUP = gl.constexpr(2)


@gluon.jit
def grouped_block(t, num_blocks, BH):
    """(bh, block) of work item t of BH (batch x head) pairs' num_blocks blocks each: items run through groups of
    HEADS_PER_WORK_GROUP pairs, within a group by block and then by pair, so the items in flight at once cover
    a few heads' tiles (L2 reuse). The last group may hold fewer pairs."""
    group_items = num_blocks * HEADS_PER_WORK_GROUP
    group = t // group_items
    first_head = group * HEADS_PER_WORK_GROUP
    heads = gl.minimum(BH - first_head, HEADS_PER_WORK_GROUP)
    r = t - group * group_items
    block = r // heads
    return first_head + r % heads, block


@gluon.jit
def work_item(t, q_len, H, GROUP, BH, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(b, h, hk, bh, m0) of work item t of BH (batch x head) pairs' query blocks, in `grouped_block`'s order
    (causal: the last query block, the longest, first in each group)."""
    num_m = gl.cdiv(q_len, BLOCK_M)
    bh, pid_m = grouped_block(t, num_m, BH)
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    b = bh // H
    h = bh % H
    return b, h, h // GROUP, bh, pid_m * BLOCK_M


@gluon.jit
def persistent_item(t, q_len, kv_len, H, GROUP, BH, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr):
    """Work item t's (b, h, hk, bh, m0, n_full, n_tiles): its rows (`work_item`) and key blocks (`key_blocks`)."""
    b, h, hk, bh, m0 = work_item(t, q_len, H, GROUP, BH, BLOCK_M, CAUSAL)
    n_full, n_tiles = key_blocks(m0, q_len, kv_len, CAUSAL, BLOCK_M, BLOCK_N)
    return b, h, hk, bh, m0, n_full, n_tiles


@gluon.jit
def allocate_item_empty():
    """A persistent program's mbarrier for the tiles it loads once per work item (the forward's query tile,
    the backward's query and dO tiles or key and value tiles): one arrival per consumer warpgroup once its
    item's last product that reads them retired, after which the producer loads the next item's."""
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_empty, count=2)
    fence_async_shared()
    return q_empty


@gluon.jit
def persistent_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                        v_empty, q_len, kv_len, H, GROUP, BH, n_items, HEAD_DIM: gl.constexpr, HALF_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, do_desc, do_smem,
                        WITH_DO: gl.constexpr):
    """One warp of a persistent query-block kernel: per work item of this program, its first key / value tiles,
    then its query tile once both consumers are done with the last item's (q_empty: one arrival per consumer,
    after the item's last product that reads it retired), then the rest of its key / value tiles
    (`stream_ring`). The first tiles come before the query tile's wait so that they load while the consumers
    finish the last item. WITH_DO (the backward's dQ kernels): dO's rows too (do_desc into do_smem, on the
    query tile's barrier); the forwards pass q_desc and q_smem there, unused."""
    ring = 0
    it = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, hk, bh, m0, n_full, n_tiles = persistent_item(t, q_len, kv_len, H, GROUP, BH, 2 * HALF_M, BLOCK_N,
                                                            CAUSAL)
        k_row = b * kv_len
        kv_col = hk * HEAD_DIM
        first = gl.minimum(n_tiles, 1)
        stream_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_row, kv_col, ring, first,
                    BLOCK_N, STAGES)
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        if WITH_DO:
            mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
        else:
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        q_row = b * q_len + m0
        tma.async_copy_global_to_shared(q_desc, [q_row, h * HEAD_DIM], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, h * HEAD_DIM], q_bar, q_smem.index(1))
        if WITH_DO:
            tma.async_copy_global_to_shared(do_desc, [q_row, h * HEAD_DIM], q_bar, do_smem.index(0))
            tma.async_copy_global_to_shared(do_desc, [q_row + HALF_M, h * HEAD_DIM], q_bar, do_smem.index(1))
        stream_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_row + first * BLOCK_N,
                    kv_col, ring + first, n_tiles - first, BLOCK_N, STAGES)
        ring += n_tiles
        it += 1


@gluon.jit
def stream_ring(a_desc, b_desc, a_smem, b_smem, a_ready, b_ready, a_empty, b_empty, row, col, first, count,
                BLOCK: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of two streamed operands (the forward's K and V; the backward's Q and dO, or K and V):
    tiles i = 0 .. count-1 from rows row + i BLOCK, column col, are the ring's tiles j = first + i, in slot
    j % STAGES. A slot is reused once its consumers have arrived on its empty barrier (phase parity
    starts at 1: a fresh barrier's preceding phase counts as complete, so the first round does not wait).
    `first` lets one ring carry several runs of tiles (a GQA group's query heads) in order."""
    for i in range(count):
        j = first + i
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        r = row + i * BLOCK
        mbarrier.wait(a_empty.index(s), empty_phase)
        mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [r, col], a_ready.index(s), a_smem.index(s))
        mbarrier.wait(b_empty.index(s), empty_phase)
        mbarrier.expect(b_ready.index(s), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [r, col], b_ready.index(s), b_smem.index(s))


@gluon.jit
def issue_qk(j, q_smem, k_smem, k_ready, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """Waits for key block j's K tile, then issues S = Q K^T as an async wgmma (not waited on)."""
    s = j % STAGES
    k_tile = k_smem.index(s)
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    return qk, k_tile


@gluon.jit
def issue_pv(j, p16, acc, v_smem, v_ready, STAGES: gl.constexpr):
    """Waits for key block j's V tile, then issues O += P V as an async wgmma with P from registers."""
    s = j % STAGES
    v_tile = v_smem.index(s)
    mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
    acc = warpgroup_mma(p16, v_tile, acc, is_async=True)
    return acc, v_tile


@gluon.jit
def release(j, empty, STAGES: gl.constexpr):
    """Hands ring slot j % STAGES of one operand back to the producer once every warp of the
    warpgroup has waited for its wgmma on the slot: one arrival per warpgroup."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(j % STAGES))


# ---------------------------------------------------------------------------------------------
# ping-pong of the two consumer warpgroups (a kernel's PINGPONG constexpr; off by default)
#
# With PINGPONG the consumers take turns at issuing their wgmmas (FlashAttention-3's warp-scheduler
# barriers): warpgroup 0 issues a group of wgmmas, then warpgroup 1 issues its group, then warpgroup 0 its
# next, and so on, so the tensor cores run one warpgroup's products while the other one's exp2 / MUFU work
# runs. A consumer's wgmma issue groups per program are, with n = n_tiles key blocks (the program's range:
# both consumers run the same n, so both issue the same n + 1 groups):
#
#     group 0        S_0 = Q K_0^T                                  (`issue_first_qk`)
#     group j        S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, 1 <= j < n   (`issue_qk_pv`)
#     group n        O += P_{n-1} V_{n-1}                            (`issue_last_pv`)
#
# Two hardware named barriers carry the turn, TURN_BARRIERS[w] the one warpgroup w waits on, each counting
# 256 threads: the waiting warpgroup's 128 (bar.sync, which blocks) and the other warpgroup's 128
# (bar.arrive, which does not). Warpgroup w waits on its barrier before a group and arrives on the other's
# after it, with two exceptions: warpgroup 0 starts (no wait before its group 0) and warpgroup 1 does not
# arrive after its group n (nothing waits for it). Per program TURN_BARRIERS[1] then completes n + 1 times
# (warpgroup 0 arrives after each of its groups 0..n, warpgroup 1 waits before each of its groups 0..n) and
# TURN_BARRIERS[0] n times (warpgroup 1 arrives after its groups 0..n-1, warpgroup 0 waits before its groups
# 1..n): every arrival meets its wait, and both barriers are idle when the program ends. The turn passes
# strictly in alternation: warpgroup 0 arrives for its group g + 1 only after its wait on warpgroup 1's
# arrival from group g, which warpgroup 1 made after its own wait for group g had completed, so no barrier
# ever holds two arrivals of one warpgroup. A program without key blocks (n = 0) issues no group in either
# consumer and touches neither barrier.
#
# The ring's mbarrier waits for a group's K and V tiles come before the turn's wait, so a warpgroup holding
# the turn never blocks on the producer. That order cannot deadlock: the tiles that group j waits for
# (K_j, V_{j-1}) reuse the ring slots of K_{j-STAGES} and V_{j-1-STAGES}, which each consumer frees in its
# key-block iteration j - STAGES (STAGES >= 2), and a warpgroup at its group j has the other warpgroup at
# least past issuing its group j - 2 (it waited for that group's turn), after which that iteration's frees
# need only the other warpgroup's own wgmmas to retire. tests/test_gluon_pingpong_protocol.py checks the
# protocol as a model (every interleaving of producer and consumers), tests/test_gluon_compile.py the turn
# waits and passes in the compiled SASS.
#
# Barrier ids: Triton 3.6's warp-specialize lowering uses named barrier 0 (the default partition's
# gl.thread_barrier), 1 (the partition switch, all threads) and 2 + i (worker partition i's
# gl.thread_barrier when it has more than one warp): 0, 1 and 2 here (the 1-warp producer's barriers are
# bar.warp.sync). The turn takes two of the remaining ids, spelled out in `_wait_turn` / `_pass_turn`'s PTX.
TURN_BARRIERS = (14, 15)


@gluon.jit
def _wait_turn(WARPGROUP: gl.constexpr):
    """Blocks until the other consumer warpgroup passed the turn (bar.sync on TURN_BARRIERS[WARPGROUP], 256
    threads: this warpgroup's 128 and the other one's 128 arrivals)."""
    if WARPGROUP == 0:
        gl.inline_asm_elementwise("bar.sync 14, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync 15, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pass_turn(WARPGROUP: gl.constexpr):
    """Passes the turn to the other consumer warpgroup (bar.arrive on its barrier, without waiting)."""
    if WARPGROUP == 0:
        gl.inline_asm_elementwise("bar.arrive 15, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive 14, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def issue_first_qk(j, q_smem, k_smem, k_ready, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPGROUP: gl.constexpr, PINGPONG: gl.constexpr):
    """A program's first key block's S = Q K^T, ring tile j (0, or where a persistent program's earlier
    tiles left the ring: `issue_qk`); PINGPONG: as issue group 0 (warpgroup 0 starts without waiting)."""
    if PINGPONG:
        k_tile = k_smem.index(j % STAGES)
        mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
        if WARPGROUP == 1:
            _wait_turn(WARPGROUP)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        _pass_turn(WARPGROUP)
    else:
        qk, k_tile = issue_qk(j, q_smem, k_smem, k_ready, s_layout, BLOCK_M, BLOCK_N, STAGES)
    return qk, k_tile


@gluon.jit
def issue_qk_pv(j, p16, acc, q_smem, k_smem, v_smem, k_ready, v_ready, s_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPGROUP: gl.constexpr,
                PINGPONG: gl.constexpr):
    """Key block j's S = Q K^T and block j - 1's O += P V, issued back to back (`issue_qk`, `issue_pv`);
    PINGPONG: both tiles waited for first, then both wgmmas as issue group j inside the turn."""
    if PINGPONG:
        s = j % STAGES
        k_tile = k_smem.index(s)
        v_tile = v_smem.index((j - 1) % STAGES)
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index((j - 1) % STAGES), ((j - 1) // STAGES) & 1)
        _wait_turn(WARPGROUP)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p16, v_tile, acc, is_async=True)
        _pass_turn(WARPGROUP)
    else:
        qk, k_tile = issue_qk(j, q_smem, k_smem, k_ready, s_layout, BLOCK_M, BLOCK_N, STAGES)
        acc, v_tile = issue_pv(j - 1, p16, acc, v_smem, v_ready, STAGES)
    return qk, k_tile, acc, v_tile


@gluon.jit
def issue_last_pv(j, p16, acc, v_smem, v_ready, STAGES: gl.constexpr, WARPGROUP: gl.constexpr,
                  PINGPONG: gl.constexpr):
    """The last key block j's O += P V (`issue_pv`); PINGPONG: as the last issue group (warpgroup 1 does not
    pass the turn on: warpgroup 0 issues nothing after it)."""
    if PINGPONG:
        v_tile = v_smem.index(j % STAGES)
        mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
        _wait_turn(WARPGROUP)
        acc = warpgroup_mma(p16, v_tile, acc, is_async=True)
        if WARPGROUP == 0:
            _pass_turn(WARPGROUP)
    else:
        acc, v_tile = issue_pv(j, p16, acc, v_smem, v_ready, STAGES)
    return acc, v_tile


@gluon.jit
def pv_operand(p, v_smem, p_layout: gl.constexpr):
    """P as the P V wgmma's register operand: V's dtype, the dot-operand layout."""
    return gl.convert_layout(p.to(v_smem.dtype), p_layout)


# ---------------------------------------------------------------------------------------------
# host side


# Triton's options of every launch of the warp-specialized kernels (read, never changed)
GLUON_OPTIONS = {"num_warps": NUM_WARPS}


def gl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


@functools.cache
def _default_layout(block_shape: tuple, element_type):
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), element_type)


def smem_layout(block_shape, element_type):
    """The NVMMA shared layout of a TMA tile (the widest swizzle the 16-bit row allows: 128 B), one object
    per block shape and element type."""
    return _default_layout(tuple(block_shape), element_type)


@functools.cache
def tma_tile(dtype, rows: int, cols: int) -> tuple[list, object]:
    """(block shape, NVMMA shared layout) of TMA tiles of rows x cols elements of torch `dtype`, made once
    per tile and checked once by TensorDescriptor's own checks (block shape, layout) on a stand-in tensor."""
    import torch

    block = [rows, cols]
    layout = smem_layout(block, gl_dtype(dtype))
    TensorDescriptor(torch.empty((rows, cols), dtype=dtype), [rows, cols], [cols, 1], block, layout)
    return block, layout


def _plain_descriptor_class() -> bool:
    """Whether TensorDescriptor is the plain dataclass of Triton 3.6 (these fields, an instance __dict__),
    which `descriptor` fills without its constructor."""
    import dataclasses

    if _IMPORT_ERROR is not None or not dataclasses.is_dataclass(TensorDescriptor):
        return False
    if "__slots__" in vars(TensorDescriptor):
        return False
    return [f.name for f in dataclasses.fields(TensorDescriptor)] == ["base", "shape", "strides", "block_shape",
                                                                       "layout", "padding"]


_PLAIN_DESCRIPTOR = _plain_descriptor_class()


def descriptor(view, tile) -> "TensorDescriptor":
    """The TMA descriptor of `view` (`tma_view`'s (tensor, shape, strides)) in tiles `tile` (`tma_tile`'s).

    Filled without TensorDescriptor's per-call checks (a few microseconds per descriptor), whose
    conditions hold by construction: `tma_view` gives a 16-byte aligned base and row stride and a unit
    last stride, `tma_tile` checked the block shape and layout once, and the operands' checks (or the
    launch plans') keep N, KV and the head sizes positive. The driver's cuTensorMapEncodeTiled, which
    Triton's launcher calls with these fields, refuses a base or stride that breaks them."""
    flat, shape, strides = view
    block, layout = tile
    if not _PLAIN_DESCRIPTOR:
        return TensorDescriptor(flat, list(shape), list(strides), block, layout)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__ = {"base": flat, "shape": list(shape), "strides": list(strides), "block_shape": block,
                     "layout": layout, "padding": "zero"}
    return desc


def tma_view(t):
    """t (B, L, H, D) as the 2-d (B L, H D) matrix its TMA descriptor reads: (tensor, shape, strides). Row
    b L + l (one batch and position) starts at b stride(0) + l stride(1), so the view needs unit stride in D,
    stride(2) = D, stride(0) = L stride(1), a 16-byte aligned base and row stride (TMA's requirements); a
    size-1 dim's stride is free (with L = 1 the rows step by stride(0)). A tensor without that layout is
    copied once into a fresh one with standard strides."""
    bsz, length, heads, d = t.shape
    stride = t.stride()
    row = stride[1] if length > 1 else stride[0] if bsz > 1 else heads * d
    if (stride[3] != 1 or (heads > 1 and stride[2] != d) or (bsz > 1 and stride[0] != length * row)
            or t.data_ptr() % 16 or row * t.element_size() % 16):
        import torch

        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
        row = heads * d
    return t, (bsz * length, heads * d), (row, 1)


@functools.cache
def _sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(items: int, device) -> int:
    """A persistent grid's programs for `items` work items on `device`: at most one per SM."""
    import torch

    return min(items, _sm_count(device.index if device.index is not None else torch.cuda.current_device()))


def serves(q, k, v) -> bool:
    """Whether the kernel serves these operands (the rest of `check_operands` is the caller's: devices,
    shapes, a positive scale): D in HEAD_DIMS, bf16 / fp16."""
    import torch

    return q.shape[-1] in HEAD_DIMS and q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype


def check_operands(q, k, v, causal, what: str):
    """ValueErrors naming what a direct call of a Gluon forward (`what`) misses: the Gluon API, 4-d
    CUDA tensors of one 16-bit dtype on sm_90, (B, KV, H_kv, D) keys and values, D in HEAD_DIMS,
    H % H_kv == 0, N and KV positive, a bool `causal`."""
    import torch

    ok, why = gluon_api_available()
    if not ok:
        raise ValueError(f"{what} needs Triton 3.6's Gluon Hopper API: {why}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what}: {name} must be a 4-d tensor, got {getattr(t, 'shape', type(t))}")
        if not t.is_cuda:
            raise ValueError(f"{what}: {name} must be on a CUDA device (sm_90)")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{what}: {name} must be bfloat16 or float16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise ValueError(f"{what} needs an sm_90 (Hopper) GPU, got capability "
                         f"{torch.cuda.get_device_capability(q.device)}")
    bsz, n, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"{what}: k and v must be (B, KV, H_kv, D) = (B, KV, H_kv, {d}) with B = {bsz}, got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"{what}: head dim D must be one of {HEAD_DIMS}, got {d}")
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"{what}: H ({h}) must be a multiple of H_kv ({h_kv})")
    if n == 0 or k.shape[1] == 0:
        raise ValueError(f"{what}: N and KV must be positive, got N={n}, KV={k.shape[1]}")
    if not isinstance(causal, bool):
        raise ValueError(f"{what}: causal must be a bool, got {causal!r}")


def descriptor_type(dtype: str, block) -> str:
    """The signature type of a TMA descriptor argument for compiling without a GPU: a `dtype` ("bf16",
    "fp16") tile of `block` rows x columns in its NVMMA shared layout (`smem_layout`)."""
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{smem_layout(list(block), gdt)!r}>"


def compile_gluon_sm90(fn, signature: dict, constexprs: dict, aligned: tuple[str, ...], arch: int = 90,
                       num_warps: int = NUM_WARPS):
    """`fn` compiled for sm_<arch> without a GPU (triton.compile on a GluonASTSource with a GPUTarget):
    the CompiledKernel, whose .asm holds ttgir / ptx / cubin. `signature` types every argument
    (descriptors by `descriptor_type`, constexprs as "constexpr"), `constexprs` gives the constexprs'
    values by name; `aligned` names the pointers compiled as 16-byte aligned; integer scalars are
    compiled unaligned (no divisibility specialization)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(fn.arg_names)
    signature = {name: signature[name] for name in names}  # in the kernel's argument order
    constexprs = {(names.index(k),): v for k, v in constexprs.items()}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 128), options={"num_warps": num_warps})


def compile_sm90(fn, head_dim: int, dtype: str, signature: dict, constexprs: dict, aligned: tuple[str, ...],
                 arch: int = 90):
    """A forward `fn` compiled for sm_<arch> without a GPU (`compile_gluon_sm90`): `signature` names
    the arguments after the three descriptors (q_desc, k_desc, v_desc, filled in here from
    `tile_config(head_dim)`, as are HEAD_DIM and the tile constexprs)."""
    cfg = tile_config(head_dim)
    q_block, kv_block = [cfg["BLOCK_M"] // 2, head_dim], [cfg["BLOCK_N"], head_dim]
    signature = {"q_desc": descriptor_type(dtype, q_block), "k_desc": descriptor_type(dtype, kv_block),
                 "v_desc": descriptor_type(dtype, kv_block), **signature,
                 "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr"}
    return compile_gluon_sm90(fn, signature, {**constexprs, "HEAD_DIM": head_dim, **cfg}, aligned, arch)
