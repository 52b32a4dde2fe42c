"""The merge of flash-decoding partials for the families without a row max (threshold, sigmoid).

Their split-key forward writes one fp32 partial output per key range; with no max or normalizer to
rescale, the output is the plain sum of the partials, cast to the output's dtype. One launch does
both (a decode step is host-bound: `part.sum(0).to(dtype)` costs two torch ops, each more host time
than a launch). The softmax family merges by its lse instead (`_combine_splits_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn.kernels.runtime import Kernel, TileConfig, cdiv


@triton.jit
def _sum_splits_kernel(PART, OUT, size, splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[i] = sum_s PART[s, i] (fp32, in split order), cast to OUT's dtype; BLOCK_M elements per
    program (BLOCK_N unused)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep = offs < size
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(PART + s * size + offs, mask=keep, other=0.0)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=keep)


_SUM_SPLITS = Kernel(_sum_splits_kernel, "sum_key_splits")
_CONFIG = [TileConfig(1024, 16, 4, 1)]


def sum_key_splits(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = part.sum(0) cast to out's dtype, in one launch: part (S, ...) fp32 and out (...) both
    contiguous, of one element count per split."""
    size = out.numel()
    _SUM_SPLITS.launch(lambda cfg: (cdiv(size, cfg.block_m),), (part, out), (size, part.shape[0]), {}, _CONFIG, ())
    return out
