"""Inputs and guards shared by the kernel tests (tests/) and the GPU checks (scripts/)."""

from __future__ import annotations

import contextlib

import torch

from attn.masks import CANDIDATE, HISTORY


def random_segment_ids(
    batch: int, n: int, generator: torch.Generator, *, min_history: int = 0, max_history: int | None = None,
    candidates_first_row: bool = True, padding_row: bool = False,
) -> torch.Tensor:
    """Random ranker layouts (B, N) int64: per row history, then candidates, then padding.

    Row 0 (when `candidates_first_row` and N >= 3) puts the candidates before the history and
    ends with one padding position, so no code may assume an order of the two ranges; the last
    row is all padding when `padding_row` (and B > 1).
    """
    ids = torch.zeros(batch, n, dtype=torch.int64)
    hi = n if max_history is None else max_history
    for b in range(batch):
        history = int(torch.randint(min_history, hi + 1, (1,), generator=generator))
        candidates = int(torch.randint(0, n - history + 1, (1,), generator=generator))
        ids[b, :history] = HISTORY
        ids[b, history:history + candidates] = CANDIDATE
    if candidates_first_row and n >= 3:
        c = n // 3
        ids[0] = 0
        ids[0, :c] = CANDIDATE
        ids[0, c:n - 1] = HISTORY
    if padding_row and batch > 1:
        ids[-1] = 0
    return ids


def random_qkv(draw, generator: torch.Generator, batch: int, n: int, kv: int, heads: int, kv_heads: int, d: int,
               strided: bool = False) -> dict[str, torch.Tensor]:
    """float64 q (B, n, H, D) and k (B, kv, H_kv, D) from `draw(*shape)`, v (B, kv, H_kv, D) standard
    normal from `generator`. strided: q from a packed projection, k and v as views with a non-unit
    head stride (what the kernels must read through their strides)."""
    if strided:
        q = draw(batch, n, 2, heads, d)[:, :, 1]
        k = draw(batch, kv_heads, kv, d).transpose(1, 2)
        v = torch.randn(batch, kv, kv_heads, 2 * d, generator=generator, dtype=torch.float64)[..., ::2]
    else:
        q, k = draw(batch, n, heads, d), draw(batch, kv, kv_heads, d)
        v = torch.randn(batch, kv, kv_heads, d, generator=generator, dtype=torch.float64)
    return {"q": q, "k": k, "v": v}


@contextlib.contextmanager
def nan_poisoned_empty():
    """Inside the block, floating tensors from torch.empty / empty_like start as NaN, so an
    element a kernel never wrote fails the comparison instead of passing by luck."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: poisoned(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poisoned(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def max_error(x: torch.Tensor, ref64: torch.Tensor) -> float:
    return (x.double() - ref64).abs().max().item() if x.numel() else 0.0


def error_ratio(fused: torch.Tensor, torch_same_dtype: torch.Tensor, ref64: torch.Tensor, floor: float,
                factor: float = 2.0) -> float:
    """DESIGN.md §6: err(fused) / (factor x err(PyTorch in the same dtype) + floor), errors vs
    float64; <= 1 passes. inf when `fused` holds a non-finite value (an unwritten NaN-poisoned
    element, say), and when the yardsticks do: a non-finite reference error would make any error
    pass."""
    if not torch.isfinite(fused).all():
        return float("inf")
    if not (torch.isfinite(torch_same_dtype).all() and torch.isfinite(ref64).all()):
        return float("inf")
    return max_error(fused, ref64) / (factor * max_error(torch_same_dtype, ref64) + floor)


def softmax_family_outputs_and_grads(fn, q, k, v, temperature, dout, spec, mask, segment_ids, dtype) -> list:
    """[out, dq, dk, dv(, d-temperature)] of `fn` (reference or kernel entry) on leaf copies of
    the float64 inputs cast to `dtype`."""
    leaves = [x.detach().to(dtype).clone().requires_grad_() if x is not None else None
              for x in (q, k, v, temperature)]
    out = fn(leaves[0], leaves[1], leaves[2], spec, mask, segment_ids, leaves[3])
    out.backward(dout.to(dtype))
    return [out] + [x.grad for x in leaves if x is not None]


def outputs_and_grads(fn, tensors: dict, dout: torch.Tensor) -> dict:
    """{"out": fn(**tensors), "d<name>": gradient of each leaf in `tensors`} for the cotangent `dout`."""
    out = fn(**tensors)
    grads = torch.autograd.grad(out, list(tensors.values()), dout.to(device=out.device, dtype=out.dtype))
    return {"out": out, **{f"d{name}": g for name, g in zip(tensors, grads)}}


def rounding_sensitivity(reference64, tensors: dict, dout: torch.Tensor, dtype: torch.dtype,
                         seed: int = 0) -> dict[str, float]:
    """Per output of `outputs_and_grads(reference64, ...)`: how far the float64 result moves when
    every input is perturbed by one unit roundoff of `dtype` (random sign per element).

    This is the error any algorithm in `dtype` may show without being wrong (the backward-error
    view): about eps x magnitude where the function is well conditioned, far more where it is
    not (p < 1 threshold gradients near tau, large reduced sums such as d-lambda). Kernel tests
    add it to the rule's absolute floor, as FlashAttention's tests scale theirs with the result."""
    gen = torch.Generator().manual_seed(seed)  # signs drawn on the CPU: the same on every device
    eps = torch.finfo(dtype).eps

    def signs(t):
        return (2 * torch.randint(0, 2, t.shape, generator=gen) - 1).to(t.device)

    exact = {name: t.detach().double() for name, t in tensors.items()}
    moved = {name: (t * (1 + eps * signs(t))).requires_grad_() for name, t in exact.items()}
    base = outputs_and_grads(reference64, {n: t.clone().requires_grad_() for n, t in exact.items()}, dout.double())
    shifted = outputs_and_grads(reference64, moved, dout.double())
    return {name: max_error(shifted[name], base[name]) for name in base}


def nonfinite_cases(name: str, device: torch.device, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """(label, tensors) with one non-finite input each, for variant `name`: a NaN query row, a NaN key
    and, for the softmax family, a NaN and an infinite temperature of one row (tests and GPU checks)."""
    gen = torch.Generator().manual_seed(5)
    b, n, h, d = 1, 21, 2, 16

    def unit(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1)

    base = {"q": unit(b, n, h, d), "k": unit(b, n, 1, d), "v": torch.randn(b, n, 1, d, generator=gen)}
    if name == "diff_threshold":
        base.update(q2=unit(b, n, h, d), k2=unit(b, n, 1, d), lam=torch.full((h,), 0.3))
    cases = []
    q = base["q"].clone()
    q[0, 7, 1] = float("nan")
    cases.append(("nan query row", {**base, "q": q}))
    k = base["k"].clone()
    k[0, 11, 0, 3] = float("nan")
    cases.append(("nan key", {**base, "k": k}))
    if name in ("softmax", "softcap_tanh", "softcap_softsign", "alsc"):
        for value in (float("nan"), float("inf")):
            temperature = torch.ones(b, n)
            temperature[0, 9] = value
            cases.append((f"{value} temperature", {**base, "temperature": temperature}))
    return [(label, {key: t.to(device=device, dtype=dtype if key != "lam" else torch.float32)
                     for key, t in tensors.items()}) for label, tensors in cases]


def nonfinite_pattern(spec, tensors: dict, backend: str) -> tuple[torch.Tensor, bool]:
    """(where the causal attention output is NaN, whether every gradient is finite) on `backend`;
    `tensors` holds q, k, v, an optional temperature and the family's extra tensors by name."""
    import attn

    leaves = {key: value.clone().requires_grad_() for key, value in tensors.items()}
    extra = {name: leaves[name] for name in attn.family_of(spec).extra_inputs(spec)}
    out = attn.attention(leaves["q"], leaves["k"], leaves["v"], spec, causal=True, backend=backend,
                         temperature=leaves.get("temperature"), extra=extra)
    out.backward(torch.ones_like(out))
    return torch.isnan(out.detach()).cpu(), all(bool(torch.isfinite(x.grad).all()) for x in leaves.values())


def opcheck_launcher(op, args: tuple) -> None:
    """torch.library.opcheck of a kernel launcher op (schema, fake, dispatch, AOT tracing) on `args`
    with every tensor detached: the launchers have no autograd of their own (their family's
    autograd.Function differentiates through them), so no input may ask for a gradient."""
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(op, detached)
