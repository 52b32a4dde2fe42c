"""Attention-weight dropout shared by every backend (DESIGN.md §4, Dropout).

With probability p each weight w_ij is dropped: out_i = sum_j (m_ij / (1 - p)) w_ij v_j,
m_ij ~ Bernoulli(1 - p) i.i.d. over (batch, query head, i, j). The weight dropped is the final
one: the softmax probability (normalized before dropout), or the rectified threshold weight, for
diff_threshold the combined w1 - lambda w2 (one mask for both views).

The fused kernels draw m from Triton's counter-based Philox generator, keyed by a per-call seed
(an int64 tensor of one element, so torch.compile and CUDA graphs see a tensor, not a constant)
and the offset ((b * H + h) * N + i) * N + j: the backward regenerates the forward's mask exactly.
`attn.kernels.dropout.keep_mask` materializes that mask (tests feed it to the reference). The
reference draws m with torch (same distribution, not the same bits). No Triton import here.
"""

from __future__ import annotations

import torch

SEED_HIGH = 2**62  # seeds are drawn from [0, SEED_HIGH)


def check_dropout_p(dropout_p, name: str = "dropout_p") -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def draw_seed(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh kernel dropout seed: int64 tensor (1,) on `device`, from torch's generator of that
    device (reproducible under torch.manual_seed; traceable by torch.compile, no host sync)."""
    return torch.randint(0, SEED_HIGH, (1,), device=device, dtype=torch.int64, generator=generator)


def seed_tensor(seed, device: torch.device) -> torch.Tensor:
    """The kernels' seed operand from an int or an integer tensor of one element."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype == torch.bool:
            raise ValueError(f"dropout_seed must be an int or an integer tensor of one element, got "
                             f"dtype {seed.dtype} shape {tuple(seed.shape)}")
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"dropout_seed must be an int in [0, 2**63) or a one-element integer tensor, got {seed!r}")
    return torch.tensor([seed], device=device, dtype=torch.int64)


def reference_keep_mask(shape, dropout_p: float, device: torch.device, seed=None) -> torch.Tensor:
    """Bool keep mask m (True = kept, probability 1 - p) drawn with torch: from a generator
    seeded with `seed` when given (an int or a one-element tensor, read on the host), else from
    torch's generator of `device`."""
    generator = None
    if seed is not None:
        value = int(seed.reshape(-1)[0].item()) if isinstance(seed, torch.Tensor) else int(seed)
        generator = torch.Generator(device=device).manual_seed(value)
    return torch.rand(shape, device=device, generator=generator) >= dropout_p


def apply_dropout(w: torch.Tensor, dropout_p: float, keep: torch.Tensor) -> torch.Tensor:
    """w * m / (1 - p): dropped weights are exactly 0, kept ones rescaled (autograd-exact)."""
    return torch.where(keep, w * (1.0 / (1.0 - dropout_p)), torch.zeros_like(w))
