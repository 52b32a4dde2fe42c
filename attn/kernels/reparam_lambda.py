"""The Differential Transformer's reparametrized lambda in one launch each way (attn/families/differential.py's
`ReparamLambda`): lambda_h = exp(lq1_h . lk1_h) - exp(lq2_h . lk2_h) + lambda_init from the layer's
vectors (4, H, D) fp32 in the order (lq1, lk1, lq2, lk2).

In torch ops the forward is five small kernels (product, sum, exp, difference, offset) and the backward
six more (their autograd formulas), each a launch and an autograd node per layer and step; an eager
training step is host-bound, so at `small` (6 layers) they cost more host time than their GPU work.
Here the forward writes lambda (H,) and the two exponentials (2, H) it saves for the backward, and the
backward writes the vectors' gradient (4, H, D) from d-lambda: dlq1 = g1 lk1, dlk1 = g1 lq1, dlq2 = g2 lk2,
dlk2 = g2 lq2 with g1 = dlam e1, g2 = -dlam e2. A program holds BLOCK_M heads (about ELEMENTS_PER_PROGRAM
elements of each vector).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attn.kernels.env import interpreting
from attn.kernels.runtime import Kernel, TileConfig, direct_apply, once_differentiable

ELEMENTS_PER_PROGRAM = 2048  # heads x D (padded) per program and vector


@triton.jit
def _vectors(V, H, D, heads, cols, mask):
    """The four (BLOCK_M, BLOCK_N) fp32 tiles lq1, lk1, lq2, lk2 of these heads."""
    offs = heads[:, None] * D + cols[None, :]
    lq1 = tl.load(V + offs, mask=mask, other=0.0)
    lk1 = tl.load(V + H * D + offs, mask=mask, other=0.0)
    lq2 = tl.load(V + 2 * H * D + offs, mask=mask, other=0.0)
    lk2 = tl.load(V + 3 * H * D + offs, mask=mask, other=0.0)
    return lq1, lk1, lq2, lk2


@triton.jit
def _block(H, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    heads = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    head_ok = heads < H
    return heads, cols, head_ok, head_ok[:, None] & (cols < D)[None, :]


@triton.jit
def _reparam_lambda_fwd(V, LAM, E, H, D, lambda_init, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """LAM (H,) fp32 = e1 - e2 + lambda_init; E (2, H) fp32 = (e1, e2), e_i = exp(lq_i . lk_i)."""
    heads, cols, head_ok, mask = _block(H, D, BLOCK_M, BLOCK_N)
    lq1, lk1, lq2, lk2 = _vectors(V, H, D, heads, cols, mask)
    e1 = tl.exp(tl.sum(lq1 * lk1, axis=1))
    e2 = tl.exp(tl.sum(lq2 * lk2, axis=1))
    tl.store(LAM + heads, e1 - e2 + lambda_init, mask=head_ok)
    tl.store(E + heads, e1, mask=head_ok)
    tl.store(E + H + heads, e2, mask=head_ok)


@triton.jit
def _reparam_lambda_bwd(V, E, DLAM, DV, H, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """DV (4, H, D) fp32: the vectors' gradient from DLAM (H,) (any float dtype)."""
    heads, cols, head_ok, mask = _block(H, D, BLOCK_M, BLOCK_N)
    lq1, lk1, lq2, lk2 = _vectors(V, H, D, heads, cols, mask)
    dlam = tl.load(DLAM + heads, mask=head_ok, other=0.0).to(tl.float32)
    g1 = (dlam * tl.load(E + heads, mask=head_ok, other=0.0))[:, None]
    g2 = (-dlam * tl.load(E + H + heads, mask=head_ok, other=0.0))[:, None]
    offs = heads[:, None] * D + cols[None, :]
    tl.store(DV + offs, g1 * lk1, mask=mask)
    tl.store(DV + H * D + offs, g1 * lq1, mask=mask)
    tl.store(DV + 2 * H * D + offs, g2 * lk2, mask=mask)
    tl.store(DV + 3 * H * D + offs, g2 * lq2, mask=mask)


_FWD = Kernel(_reparam_lambda_fwd, "reparam_lambda_fwd")
_BWD = Kernel(_reparam_lambda_bwd, "reparam_lambda_bwd")


@functools.cache
def _config(d: int, interpreter: bool) -> TileConfig:
    """The launch config for vectors of d elements: BLOCK_M heads per program, BLOCK_N = d padded to a power
    of two; built once per d."""
    block_d = 1 << (d - 1).bit_length()
    block_h = 2 if interpreter else max(1, ELEMENTS_PER_PROGRAM // block_d)  # 2: tests span several programs
    return TileConfig(block_h, block_d, num_warps=4, num_stages=1)


def _launch(kernel: Kernel, h: int, d: int, tensors: tuple, scalars: tuple) -> None:
    cfg = _config(d, interpreting())
    kernel.run(cfg, (-(-h // cfg.block_m),), tensors, scalars, {})


class ReparamLambdaFunction(torch.autograd.Function):
    """lambda (H,) fp32 from the vectors (4, H, D), contiguous fp32, and lambda_init (a float)."""

    @staticmethod
    def forward(ctx, vectors, lambda_init):
        _, h, d = vectors.shape
        lam = torch.empty((h,), device=vectors.device, dtype=torch.float32)
        exps = torch.empty((2, h), device=vectors.device, dtype=torch.float32)
        _launch(_FWD, h, d, (vectors, lam, exps), (h, d, float(lambda_init)))
        ctx.save_for_backward(vectors, exps)
        return lam

    @staticmethod
    @once_differentiable
    def backward(ctx, dlam):
        vectors, exps = ctx.saved_tensors
        _, h, d = vectors.shape
        dvectors = torch.empty_like(vectors)
        _launch(_BWD, h, d, (vectors, exps, dlam.contiguous(), dvectors), (h, d))
        return dvectors, None


_REPARAM_LAMBDA = direct_apply(ReparamLambdaFunction)


def reparam_lambda(vectors: torch.Tensor, lambda_init: float) -> torch.Tensor:
    """lambda (H,) fp32 of the vectors (4, H, D) fp32 (contiguous), differentiable in them."""
    return _REPARAM_LAMBDA(vectors, lambda_init)
