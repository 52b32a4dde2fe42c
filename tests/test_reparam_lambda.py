"""attn/kernels/reparam_lambda.py: the reparametrized lambda's one-launch kernels (natively on a GPU, the
interpreter on CPU) against the float64 formula by the DESIGN.md §6 rule, forward and backward, and the
differential layer's use of them."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within_reference_error

import attn.families.differential as differential
from attn.kernels.reparam_lambda import reparam_lambda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOOR = 1e-6


def formula(vectors: torch.Tensor, lambda_init: float) -> torch.Tensor:
    """exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init per head, vectors (4, H, D) in (lq1, lk1, lq2, lk2) order."""
    lq1, lk1, lq2, lk2 = vectors
    return torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + lambda_init


@pytest.mark.parametrize("heads,d", [(1, 16), (3, 24), (5, 80), (12, 64), (2, 128)])
def test_kernels_match_the_float64_formula(heads, d):
    """Forward (lambda) and backward (the vectors' gradient for a random d-lambda) on fresh random vectors
    of a few head counts and odd widths (the interpreter's programs hold 2 heads: several programs, a
    partial last one)."""
    gen = torch.Generator().manual_seed(heads * 1000 + d)
    ref = (torch.randn(4, heads, d, generator=gen, dtype=torch.float64) * (0.9 / d ** 0.5)).requires_grad_()
    dlam = torch.randn(heads, generator=gen, dtype=torch.float64)
    lambda_init = 0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * heads)).item()
    results = {}
    for name, vectors in (("ref64", ref), ("torch32", ref.detach().float().requires_grad_()),
                          ("kernel", ref.detach().float().to(DEVICE).requires_grad_())):
        lam = reparam_lambda(vectors, lambda_init) if name == "kernel" else formula(vectors, lambda_init)
        (grad,) = torch.autograd.grad(lam, vectors, dlam.to(lam.dtype).to(lam.device))
        results[name] = (lam.detach().cpu(), grad.cpu())
    for i, what in enumerate(("lambda", "d vectors")):
        assert_within_reference_error(what, results["kernel"][i], results["torch32"][i], results["ref64"][i],
                                      floor=FLOOR)
    assert results["kernel"][0].dtype == torch.float32


def test_the_layer_takes_the_kernels_where_they_serve(monkeypatch):
    """ReparamLambda's lambda through the kernels (a kernel device, fp32, eager) equals its torch-op form,
    values and gradients; under torch.compile, or for float64 vectors, it takes the torch ops."""
    from attn.families.layer_extras import LayerShape

    torch.manual_seed(0)
    layer = differential.ReparamLambda(LayerShape(layer_index=2, n_head=3, n_kv_head=3, head_dim=20, views=2))
    layer = layer.to(DEVICE)
    dlam = torch.randn(3, device=DEVICE)
    monkeypatch.setattr(differential, "KERNEL_DEVICE_TYPES", ())
    plain = layer.per_head_lambda()
    (plain_grad,) = torch.autograd.grad(plain, layer.lambda_vectors, dlam)
    monkeypatch.setattr(differential, "KERNEL_DEVICE_TYPES", (DEVICE.type,))
    assert differential._lambda_kernel_serves(layer.lambda_vectors)
    fused = layer.per_head_lambda()
    assert type(fused.grad_fn).__name__.startswith("ReparamLambdaFunction")
    (fused_grad,) = torch.autograd.grad(fused, layer.lambda_vectors, dlam)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-6, atol=1e-6)
    assert not differential._lambda_kernel_serves(layer.lambda_vectors.detach().double())
    assert not differential._lambda_kernel_serves(layer.lambda_vectors.detach().transpose(1, 2))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not differential._lambda_kernel_serves(layer.lambda_vectors)
