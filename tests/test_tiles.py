"""The shared Triton mask code reproduces attn.masks exactly, tile ranges included."""

import pytest
import torch
import triton
import triton.language as tl

from attn.kernels.tiles import key_ranges, load_segment_bounds, query_ranges, tile_visible, visible_counts
from attn.testing import random_segment_ids
from attn.masks import MaskSpec, dense_mask, segment_bounds, visible_key_counts


@triton.jit
def _paint_by_query_blocks(out_ptr, cnt_ptr, bounds_ptr, seq_len, window,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    hs, he, cs, ce = load_segment_bounds(bounds_ptr, b, HAS_SEG)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    lo, hi, lo2, hi2 = key_ranges(m0, seq_len, window, hs, he, cs, ce, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SEG)
    base = out_ptr + b * seq_len * seq_len
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        vis = tile_visible(offs_m, offs_n, lo, hi, seq_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        ptrs = base + offs_m[:, None] * seq_len + offs_n[None, :]
        inb = (offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len)
        tl.store(ptrs, tl.load(ptrs, mask=inb, other=0) + vis.to(tl.int32), mask=inb)
    for start in range(lo2, hi2, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        vis = tile_visible(offs_m, offs_n, lo2, hi2, seq_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        ptrs = base + offs_m[:, None] * seq_len + offs_n[None, :]
        inb = (offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len)
        tl.store(ptrs, tl.load(ptrs, mask=inb, other=0) + vis.to(tl.int32), mask=inb)
    cnt = visible_counts(offs_m, seq_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
    tl.store(cnt_ptr + b * seq_len + offs_m, cnt, mask=offs_m < seq_len)


@triton.jit
def _paint_by_key_blocks(out_ptr, bounds_ptr, seq_len, window,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hs, he, cs, ce = load_segment_bounds(bounds_ptr, b, HAS_SEG)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    lo, hi, lo2, hi2 = query_ranges(n0, seq_len, window, hs, he, cs, ce, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_SEG)
    base = out_ptr + b * seq_len * seq_len
    for start in range(lo, hi, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        vis = tile_visible(offs_m, offs_n, 0, seq_len, seq_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        vis = vis & (offs_m[:, None] >= lo) & (offs_m[:, None] < hi)
        ptrs = base + offs_m[:, None] * seq_len + offs_n[None, :]
        inb = (offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len)
        tl.store(ptrs, tl.load(ptrs, mask=inb, other=0) + vis.to(tl.int32), mask=inb)
    for start in range(lo2, hi2, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        vis = tile_visible(offs_m, offs_n, 0, seq_len, seq_len, window, hs, he, cs, ce, CAUSAL, HAS_WINDOW, HAS_SEG)
        vis = vis & (offs_m[:, None] >= lo2) & (offs_m[:, None] < hi2)
        ptrs = base + offs_m[:, None] * seq_len + offs_n[None, :]
        inb = (offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len)
        tl.store(ptrs, tl.load(ptrs, mask=inb, other=0) + vis.to(tl.int32), mask=inb)


@pytest.mark.parametrize("n", [1, 17, 40, 67])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (True, 16)])
@pytest.mark.parametrize("with_seg", [False, True])
def test_tile_ranges_cover_mask_exactly_once(n, causal, window, with_seg):
    gen = torch.Generator().manual_seed(n * 31 + (window or 0))
    batch = 4
    seg = random_segment_ids(batch, n, gen, candidates_first_row=False) if with_seg else None
    if with_seg:
        seg[0] = torch.tensor([-1] * (n // 3) + [1] * (n - n // 3))  # candidates before history
    spec = MaskSpec(causal=causal, window=window)
    expected = dense_mask(spec, n, seg).expand(batch, n, n).to(torch.int32)
    bounds = segment_bounds(seg) if with_seg else torch.zeros(batch, 4, dtype=torch.int32)
    for block_m, block_n in [(16, 16), (16, 32), (32, 16)]:
        by_q = torch.zeros(batch, n, n, dtype=torch.int32)
        counts = torch.full((batch, n), -1.0)
        grid = (triton.cdiv(n, block_m), batch)
        _paint_by_query_blocks[grid](by_q, counts, bounds, n, window or 0, block_m, block_n,
                                     spec.is_causal, window is not None, with_seg)
        assert torch.equal(by_q, expected), (block_m, block_n)
        torch.testing.assert_close(counts, visible_key_counts(spec, n, seg).expand(batch, n))
        by_k = torch.zeros(batch, n, n, dtype=torch.int32)
        grid = (triton.cdiv(n, block_n), batch)
        _paint_by_key_blocks[grid](by_k, bounds, n, window or 0, block_m, block_n,
                                   spec.is_causal, window is not None, with_seg)
        assert torch.equal(by_k, expected), (block_m, block_n)
