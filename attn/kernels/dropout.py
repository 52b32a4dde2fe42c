"""Dropout masks of the fused kernels (attn/dropout.py states the semantics).

`dropout_keep` is what every forward and backward tile calls: the same (seed, offset) pairs give
the same uniforms in any tile shape or order, so the backward regenerates the forward's mask.
`keep_mask` materializes the mask of one call (B, H, N, N) for tests against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn.dropout import seed_tensor


@triton.jit
def dropout_keep(seed, bh, rows, cols, seq_len, dropout_p):
    """Keep mask (True: weight kept) of query rows `rows` x key columns `cols` (any broadcastable
    shapes) of program (batch * H + query head) `bh`: uniform(seed, ((bh N + i) N + j)) >= p."""
    offsets = (bh.to(tl.int64) * seq_len + rows.to(tl.int64)) * seq_len + cols.to(tl.int64)
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def load_seed(SEED, DROPOUT: tl.constexpr):
    """The call's dropout seed (int64) from its one-element tensor, or an unused 0 without dropout."""
    if DROPOUT:
        seed = tl.load(SEED)
    else:
        seed = 0
    return seed


@triton.jit
def _keep_mask_kernel(SEED, OUT, seq_len, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seed = tl.load(SEED)
    keep = dropout_keep(seed, bh, rows[:, None], cols[None, :], seq_len, dropout_p)
    inside = (rows[:, None] < seq_len) & (cols[None, :] < seq_len)
    offs = (bh.to(tl.int64) * seq_len + rows[:, None]) * seq_len + cols[None, :]
    tl.store(OUT + offs, keep.to(tl.int8), mask=inside)


def seed_operand(dropout_p, seed, dummy):
    """The seed tensor the kernels load with dropout on; any tensor (never read) without."""
    if dropout_p > 0.0:
        if seed is None:
            raise ValueError("dropout_p > 0 needs a dropout seed tensor (attn.dropout.draw_seed)")
        return seed
    return dummy


def keep_mask(seed, batch: int, heads: int, seq_len: int, dropout_p: float, device=None) -> torch.Tensor:
    """The kernels' keep mask for `seed` (int or one-element tensor): bool (B, H, N, N), [b, h, i, j]
    True where the weight of query i on key j (query head h) is kept."""
    device = torch.device(device) if device is not None else (seed.device if isinstance(seed, torch.Tensor)
                                                              else torch.device("cpu"))
    seed = seed_tensor(seed, device)
    out = torch.empty((batch, heads, seq_len, seq_len), device=device, dtype=torch.int8)
    block = 32
    grid = (-(-seq_len // block), -(-seq_len // block), batch * heads)
    _keep_mask_kernel[grid](seed, out, seq_len, float(dropout_p), BLOCK_M=block, BLOCK_N=block)
    return out.bool()
