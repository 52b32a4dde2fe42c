"""The softmax family's attention forward in Gluon for sm_90 (Hopper), FlashAttention-3's schedule.

Logits z = t_i * cap(s q.k) of every cap (none, tanh, soft_sign, ALSC: `_cap`, in registers) with an
optional per-row temperature t; a cap without temperature shifts by its bound instead of a running
max (no accumulator rescale). Written against Triton 3.6's Gluon API (`triton.experimental.gluon`);
Gluon changes between Triton releases, so `gluon_api_available()` says whether the installed Triton
has what this file uses. `attn/kernels/tiers.py` decides when the softmax family's forward runs it
(sm_90, without segments, key lengths, a window or dropout; ATTNLAB_GLUON).

Schedule (one program = BLOCK_M query rows of one (batch, head)):

- a producer partition (one warp, few registers) issues TMA loads: the query tile once, then
  the key and value tiles of every key block the rows can see, into a ring of STAGES
  shared-memory slots. Each slot has a "ready" mbarrier per operand (the TMA completes it with
  its byte count) and an "empty" mbarrier per operand (the consumer arrives when its wgmma has
  read the slot); the producer waits on "empty" before it overwrites a slot.
- two consumer warpgroups (the default partition and a 4-warp worker partition, 64 rows each,
  each with its own register budget through setmaxnreg) share the ring: a slot's empty barriers
  count one arrival per warpgroup. They are not tied to each other, so one's softmax can run
  while the other's wgmma does (FA3's inter-warpgroup overlap, without FA3's explicit ping-pong
  ordering). Each runs per key block: S = Q K^T as an async wgmma from shared memory, the online softmax in registers
  (exp2 of log2-scaled scores, running max and sum, rescale of the accumulator), then
  O += P V as an async wgmma with P from registers. Key blocks wholly visible to every row of
  the tile run without mask arithmetic; the blocks on the causal diagonal and the ragged last
  block run with the mask.
- causal programs are issued longest first (the last query block first).

Layouts as the portable kernels take them: q, out (B, N, H, D); k, v (B, KV, H_kv, D) with
H % H_kv == 0 (GQA); lse2 (B, H, N) fp32, the base-2 logsumexp of sm_scale q.k
(+inf for a row that sees no key, whose output is 0). Causal is bottom-right aligned: query row
i sits at key position i + KV - N. The TMA descriptors view q as (B N, H D) and k, v as
(B KV, H_kv D): a tile that runs past a batch's last row reads the next batch's rows, which the
key mask (key < KV) and the row mask of the stores (row < N) discard.
"""

from __future__ import annotations

import functools
import math

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
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              q_row, k_row, kv_col, q_col, n_tiles,
              HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: Q once, then K and V of key blocks 0 .. n_tiles-1 into ring slot j % STAGES. A
    slot is reused once the consumer has arrived on its empty barrier (phase parity starts at 1:
    a fresh barrier's preceding phase counts as complete, so the first round does not wait)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, q_col], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        row = k_row + j * BLOCK_N
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _issue_qk(j, q_smem, k_smem, k_ready, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """Waits for key block j's K tile, then issues S = Q K^T as an async wgmma (not waited on)."""
    s = j % STAGES
    k_tile = k_smem.index(s)
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    qk = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    return qk, k_tile


@gluon.jit
def _issue_pv(j, p16, acc, v_smem, v_ready, STAGES: gl.constexpr):
    """Waits for key block j's V tile, then issues O += P V as an async wgmma with P from registers."""
    s = j % STAGES
    v_tile = v_smem.index(s)
    mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
    acc = warpgroup_mma(p16, v_tile, acc, is_async=True)
    return acc, v_tile


@gluon.jit
def _release(j, empty, STAGES: gl.constexpr):
    """Hands ring slot j % STAGES of one operand back to the producer once every warp of the
    warpgroup has waited for its wgmma on the slot: one arrival per warpgroup."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(j % STAGES))


@gluon.jit
def _tanh(x):
    """tanh on MUFU.TANH (max relative error ~2^-11, far below the 16-bit operands' rounding)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _rcp(x):
    """1/x on MUFU.RCP (relative error ~2^-23) instead of an IEEE division."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


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
                   MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block j's scores -> (P in fp32, in the scores' registers, m, l, alpha), the logits
    z = cap(q.k) * row_scale in log2 units; alpha = exp2(m_old - m_new) is the factor the accumulator
    takes before this block's P V is added. row_scale: a scalar > 0, or per row (HAS_TEMP: t_i times
    the scale, any sign). FIXED_SHIFT (a cap bounds |z| by `shift`, no temperature): p = exp2(z - shift)
    with m fixed at `shift`, so alpha is 1 and the accumulator is never rescaled."""
    s_layout: gl.constexpr = qk.type.layout
    g = _cap(qk, cap_scale, alsc_knee, CAP)
    if MASKED:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:  # key < kv_len and key <= row position in one compare per score
            visible = gl.expand_dims(cols, 0) <= gl.expand_dims(last_key - j * BLOCK_N, 1)
        else:
            visible = gl.expand_dims(cols < kv_len - j * BLOCK_N, 0)
    if HAS_TEMP:
        z = g * gl.expand_dims(row_scale, 1)
        if MASKED:  # after the scale: a zero or negative temperature must not turn -inf into NaN / +inf
            z = gl.where(visible, z, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        p = gl.exp2(z - gl.expand_dims(m_new, 1))
    else:
        if MASKED:
            g = gl.where(visible, g, -float("inf"))
        if FIXED_SHIFT:
            m_new = m_i
            p = gl.exp2(g * row_scale - shift)
        else:
            # the scale folded into one FFMA per score: row_scale > 0, so max(g) * row_scale is
            # max(g * row_scale) exactly (rounding is monotone) and -inf stays -inf
            m_new = gl.maximum(m_i, gl.max(g, axis=1) * row_scale)
            p = gl.exp2(g * row_scale - gl.expand_dims(m_new, 1))
    # m is in log2 units and starts finite (alpha never NaN; a row with no visible key keeps m
    # finite and p = exp2(-inf) = 0)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _operand(p, v_smem, p_layout: gl.constexpr):
    """P as the P V wgmma's register operand: V's dtype, the dot-operand layout."""
    return gl.convert_layout(p.to(v_smem.dtype), p_layout)


@gluon.jit
def _pipelined_block(j, p16, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     last_key, kv_len, row_scale, cap_scale, alsc_knee, shift, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, p_layout: gl.constexpr, CAP: gl.constexpr, HAS_TEMP: gl.constexpr,
                     FIXED_SHIFT: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block j with block j - 1's P V in flight (FA3's intra-warpgroup overlap): S_j = Q K_j^T and
    O += P_{j-1} V_{j-1} are issued back to back; the softmax of S_j runs while the tensor cores do
    P_{j-1} V_{j-1}; then O is rescaled by alpha_j. Returns (P_j, O, m, l)."""
    qk, k_tile = _issue_qk(j, q_smem, k_smem, k_ready, s_layout, BLOCK_M, BLOCK_N, STAGES)
    acc, v_tile = _issue_pv(j - 1, p16, acc, v_smem, v_ready, STAGES)
    qk, q_smem, k_tile = warpgroup_mma_wait(num_outstanding=1, deps=(qk, q_smem, k_tile))  # S_j done (groups retire in order)
    _release(j, k_empty, STAGES)
    # exp2 and the row sums in fp32, in S's registers, while P_{j-1} V runs
    p, m_i, l_i, alpha = _softmax_block(qk, j, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee, shift,
                                        CAP, HAS_TEMP, FIXED_SHIFT, MASKED, CAUSAL, BLOCK_N)
    # P_{j-1} among the deps: its registers stay live until the wgmma that reads them retired; P_j is
    # packed to 16 bits after that, into the registers P_{j-1} held (as FA3 orders it), so nothing in
    # the softmax writes a register the in-flight wgmma reads
    acc, v_tile, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, p16))
    _release(j - 1, v_empty, STAGES)
    p_next = _operand(p, v_smem, p_layout)
    if not FIXED_SHIFT:
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return p_next, acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              O, LSE, TEMP, o_base, stride_on, lse_base, temp_base, stride_tn, m0, q_len, kv_len, n_full, n_tiles,
              out_scale, cap_scale, alsc_knee, shift, CAP: gl.constexpr, HAS_TEMP: gl.constexpr,
              FIXED_SHIFT: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS_C: gl.constexpr):
    """One warpgroup: BLOCK_M (64) query rows from m0 against every key block of the program's
    range (the two consumers share the ring, and so the range: a block wholly masked for these
    rows gives p = 0). Key blocks [0, n_full) run unmasked, [n_full, n_tiles) masked. Stores its
    rows of out and lse2."""
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

    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        # block 0 alone (the accumulator is zero: nothing to rescale, no P V in flight)
        qk, k_tile = _issue_qk(0, q_smem, k_smem, k_ready, s_layout, BLOCK_M, BLOCK_N, STAGES)
        qk, q_smem, k_tile = warpgroup_mma_wait(num_outstanding=0, deps=(qk, q_smem, k_tile))
        _release(0, k_empty, STAGES)
        if n_full > 0:
            p0, m_i, l_i, alpha0 = _softmax_block(qk, 0, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee,
                                                  shift, CAP, HAS_TEMP, FIXED_SHIFT, False, CAUSAL, BLOCK_N)
        else:
            p0, m_i, l_i, alpha0 = _softmax_block(qk, 0, m_i, l_i, last_key, kv_len, row_scale, cap_scale, alsc_knee,
                                                  shift, CAP, HAS_TEMP, FIXED_SHIFT, True, CAUSAL, BLOCK_N)
        p16 = _operand(p0, v_smem, p_layout)
        for j in range(1, n_full):
            p16, acc, m_i, l_i = _pipelined_block(j, p16, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready,
                                                  k_empty, v_empty, last_key, kv_len, row_scale, cap_scale, alsc_knee,
                                                  shift, s_layout, o_layout, p_layout, CAP, HAS_TEMP, FIXED_SHIFT,
                                                  False, CAUSAL, BLOCK_M, BLOCK_N, STAGES)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            p16, acc, m_i, l_i = _pipelined_block(j, p16, acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready,
                                                  k_empty, v_empty, last_key, kv_len, row_scale, cap_scale, alsc_knee,
                                                  shift, s_layout, o_layout, p_layout, CAP, HAS_TEMP, FIXED_SHIFT,
                                                  True, CAUSAL, BLOCK_M, BLOCK_N, STAGES)
        # the last block's P V
        acc, v_tile = _issue_pv(n_tiles - 1, p16, acc, v_smem, v_ready, STAGES)
        acc, v_tile, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_tile, p16))
        _release(n_tiles - 1, v_empty, STAGES)

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
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Program (query block, batch x head): rows [m0, m0 + BLOCK_M), two consumer warpgroups of
    BLOCK_M / 2 rows each (the default partition and a 4-warp worker) and a 1-warp TMA producer."""
    NUM_WARPS_C: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS_C == 4, "one warpgroup per consumer partition")
    HALF_M: gl.constexpr = BLOCK_M // 2
    num_m = gl.cdiv(q_len, BLOCK_M)
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = num_m - 1 - pid_m  # longest rows first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M

    # key blocks: [0, n_full) visible to every row of the program, [n_full, n_tiles) need the mask
    if CAUSAL:
        p0 = m0 + kv_len - q_len  # key position of the program's first row
        hi = gl.minimum(gl.maximum(p0 + BLOCK_M, 0), kv_len)
        n_full = gl.minimum(gl.maximum(p0 + 1, 0), kv_len) // BLOCK_N
    else:
        hi = kv_len
        n_full = kv_len // BLOCK_N
    n_tiles = gl.cdiv(hi, BLOCK_N)
    n_full = gl.minimum(n_full, n_tiles)

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
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    o_base = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    lse_base = bh.to(gl.int64) * q_len
    temp_base = b.to(gl.int64) * stride_tb
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     O, LSE, TEMP, o_base, stride_on, lse_base, temp_base, stride_tn, m0, q_len, kv_len, n_full,
                     n_tiles, out_scale, cap_scale, alsc_knee, shift, CAP, HAS_TEMP, FIXED_SHIFT,
                     CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     O, LSE, TEMP, o_base, stride_on, lse_base, temp_base, stride_tn, m0 + HALF_M, q_len, kv_len,
                     n_full, n_tiles, out_scale, cap_scale, alsc_knee, shift, CAP, HAS_TEMP, FIXED_SHIFT,
                     CAUSAL, HALF_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS_C)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     b * q_len + m0, b * kv_len, hk * HEAD_DIM, h * HEAD_DIM, n_tiles, HALF_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))


# ---------------------------------------------------------------------------------------------
# host side


def _gl_dtype(torch_dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]


def smem_layout(block_shape, gl_dtype):
    """The NVMMA shared layout of a TMA tile (the widest swizzle the 16-bit row allows: 128 B)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype)


def _check(q, k, v, sm_scale, causal):
    import torch

    ok, why = gluon_api_available()
    if not ok:
        raise ValueError(f"gluon softmax forward needs Triton 3.6's Gluon Hopper API: {why}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"gluon softmax forward: {name} must be a 4-d tensor, got "
                             f"{getattr(t, 'shape', type(t))}")
        if not t.is_cuda:
            raise ValueError(f"gluon softmax forward: {name} must be on a CUDA device (sm_90)")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"gluon softmax forward: {name} must be bfloat16 or float16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"gluon softmax forward: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise ValueError("gluon softmax forward needs an sm_90 (Hopper) GPU, got capability "
                         f"{torch.cuda.get_device_capability(q.device)}")
    bsz, n, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"gluon softmax forward: k and v must be (B, KV, H_kv, D) = (B, KV, H_kv, {d}) with "
                         f"B = {bsz}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"gluon softmax forward: head dim D must be one of {HEAD_DIMS}, got {d}")
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"gluon softmax forward: H ({h}) must be a multiple of H_kv ({h_kv})")
    if n == 0 or k.shape[1] == 0:
        raise ValueError(f"gluon softmax forward: N and KV must be positive, got N={n}, KV={k.shape[1]}")
    if not (math.isfinite(float(sm_scale)) and sm_scale > 0):  # the kernel's max of raw scores needs scale > 0
        raise ValueError(f"gluon softmax forward: sm_scale must be > 0 and finite, got {sm_scale}")
    if not isinstance(causal, bool):
        raise ValueError(f"gluon softmax forward: causal must be a bool, got {causal!r}")


def _tma_view(t):
    """t (B, L, H, D) as the 2-d (B L, H D) matrix its TMA descriptor reads: contiguous in (H, D),
    rows of one batch consecutive, 16-byte aligned base and row stride (TMA's requirements). A
    tensor without that layout is copied contiguous once."""
    bsz, length, heads, d = t.shape
    flat = (t.stride(3) == 1 and t.stride(2) == d and t.stride(0) == length * t.stride(1))
    if not flat or t.data_ptr() % 16 or (t.stride(1) * t.element_size()) % 16:
        t = t.contiguous()
    return t, (bsz * length, heads * d), (t.stride(1), 1)


def serves(q, k, v) -> bool:
    """Whether the kernel serves these operands (the rest of `_check` is the caller's: devices,
    shapes, a positive scale): D in HEAD_DIMS, bf16 / fp16."""
    import torch

    return q.shape[-1] in HEAD_DIMS and q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype


def gluon_softmax_forward(q, k, v, sm_scale: float, causal: bool):
    """(out (B, N, H, D) in q's dtype, lse2 (B, H, N) fp32) of plain softmax attention, Gluon /
    sm_90. q (B, N, H, D); k, v (B, KV, H_kv, D), H % H_kv == 0; D in {64, 128}; bf16 or fp16.
    Raises ValueError naming the requirement a call misses."""
    _check(q, k, v, sm_scale, causal)
    return launch_forward(q, k, v, causal, float(sm_scale) * LOG2E)


def launch_forward(q, k, v, causal: bool, row_scale: float, *, cap: int = 0, cap_scale: float = 1.0,
                   alsc_knee: float = 0.0, shift: float | None = None, temperature=None):
    """The softmax family's forward without checks, for callers that checked the operands once (the
    softmax family's launch plans): logits z_ij = t_i * row_scale * cap(q_i.k_j) in log2 units, where
    cap is `_cap`'s CAP (with its `cap_scale`, `alsc_knee`) and t the optional (B, N) `temperature`
    (any float dtype, any strides). row_scale must be > 0 without a temperature. `shift`: a bound B of
    |z| (a cap's c log2 e, no temperature) that p = exp2(z - B) uses instead of a running max, so p
    lies in [2^-2B, 1] (the caller keeps 2B within bf16 P's range); None for the online softmax.
    Returns (out, lse2)."""
    import torch

    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    cfg = tile_config(d)
    gdt = _gl_dtype(q.dtype)
    q2, q_shape, q_strides = _tma_view(q)
    k2, k_shape, k_strides = _tma_view(k)
    v2, v_shape, v_strides = _tma_view(v)
    q_block, kv_block = [cfg["BLOCK_M"] // 2, d], [cfg["BLOCK_N"], d]
    q_desc = TensorDescriptor(q2, list(q_shape), list(q_strides), q_block, smem_layout(q_block, gdt))
    k_desc = TensorDescriptor(k2, list(k_shape), list(k_strides), kv_block, smem_layout(kv_block, gdt))
    v_desc = TensorDescriptor(v2, list(v_shape), list(v_strides), kv_block, smem_layout(kv_block, gdt))
    out = torch.empty((bsz, n, h, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((bsz, h, n), device=q.device, dtype=torch.float32)
    has_temp = temperature is not None
    temp, (stride_tb, stride_tn) = (temperature, temperature.stride()) if has_temp else (lse, (0, 0))
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), bsz * h)
    _gluon_softmax_fwd_kernel[grid](
        q_desc, k_desc, v_desc, out, lse, temp,
        out.stride(0), out.stride(1), out.stride(2), stride_tb, stride_tn,
        h, h // h_kv, n, kv_len, float(row_scale), float(cap_scale), float(alsc_knee),
        0.0 if shift is None else float(shift),
        CAP=cap, HAS_TEMP=has_temp, FIXED_SHIFT=shift is not None,
        CAUSAL=causal, HEAD_DIM=d, num_warps=NUM_WARPS, **cfg)
    return out, lse


def compile_sm90(head_dim: int = 128, dtype: str = "bf16", causal: bool = True, arch: int = 90, cap: int = 0,
                 has_temp: bool = False, fixed_shift: bool = False):
    """The kernel compiled for sm_<arch> without a GPU (triton.compile on a GluonASTSource with a
    GPUTarget): the CompiledKernel, whose .asm holds ttgir / ptx / cubin. Integer scalars are
    compiled as a launch with unaligned values (no divisibility specialization)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = tile_config(head_dim)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    q_block, kv_block = [cfg["BLOCK_M"] // 2, head_dim], [cfg["BLOCK_N"], head_dim]

    def desc(block):
        return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{smem_layout(block, gdt)!r}>"

    fn = _gluon_softmax_fwd_kernel
    signature = {"q_desc": desc(q_block), "k_desc": desc(kv_block), "v_desc": desc(kv_block),
                 "O": f"*{dtype}", "LSE": "*fp32", "TEMP": "*fp32",
                 "stride_ob": "i32", "stride_on": "i32", "stride_oh": "i32", "stride_tb": "i32", "stride_tn": "i32",
                 "H": "i32", "GROUP": "i32", "q_len": "i32", "kv_len": "i32", "out_scale": "fp32",
                 "cap_scale": "fp32", "alsc_knee": "fp32", "shift": "fp32",
                 "CAP": "constexpr", "HAS_TEMP": "constexpr", "FIXED_SHIFT": "constexpr",
                 "CAUSAL": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                 "STAGES": "constexpr"}
    constexprs = {"CAP": cap, "HAS_TEMP": has_temp, "FIXED_SHIFT": fixed_shift, "CAUSAL": causal,
                  "HEAD_DIM": head_dim, **cfg}
    names = list(fn.arg_names)
    constexprs = {(names.index(k),): v for k, v in constexprs.items()}
    attrs = {(names.index("O"),): [["tt.divisibility", 16]], (names.index("LSE"),): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    target = GPUTarget("cuda", arch, 128)
    return triton.compile(src, target=target, options={"num_warps": NUM_WARPS})
