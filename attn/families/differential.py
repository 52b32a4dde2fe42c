"""The differential threshold's layer module: the per-head lambda and the second q/k view
(DESIGN.md §4, model side).

Three lambda parametrizations, chosen by the model option `lambda_mode` (AttnConfig.lambda_mode):
- `reparam` (Differential Transformer, per head): lambda_h = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init
  with lambda_init = 0.8 - 0.6 exp(-0.3 * layer_index), and the attention output scaled by
  (1 - lambda_init);
- `clamp`: one parameter per head, initialized to lambda_init, clamped to [0, 1];
- `scalar_clamp` (the official TDA code): one parameter per layer, initialized to 0.5, clamped to
  [0, 1], shared by every head.
The lambda parameters are not weight-decayed (LitGPT.weight_decay_groups decays linear and embedding
weights only).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from attn.families.layer_extras import LayerExtras, LayerShape


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """t.float(), without the dispatcher's call where t is fp32 already (a parameter per layer and step)."""
    return t if t.dtype == torch.float32 else t.float()


def lambda_init(layer_index: int) -> float:
    """0.8 - 0.6 exp(-0.3 * layer_index): the Differential Transformer's lambda_init."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


class DifferentialLambda(LayerExtras):
    """The extra mapping of a differential variant: the second view's 'q2' and 'k2' and the
    per-head 'lam' (H,) in q's dtype. Subclasses hold the parameters and compute `per_head_lambda`."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        if shape.views != 2:
            raise ValueError(f"a differential layer projects 2 q/k views, got {shape.views}")
        self.n_head = shape.n_head
        self.lambda_init = lambda_init(shape.layer_index)

    def per_head_lambda(self) -> torch.Tensor:
        """lambda_h (H,) in fp32."""
        raise NotImplementedError

    def forward(self, qs, ks):
        return {"q2": qs[1], "k2": ks[1], "lam": self.per_head_lambda().to(qs[0].dtype)}

    def per_head_values(self):
        return {"lambda": self.per_head_lambda()}


class ReparamLambda(DifferentialLambda):
    """lambda_h = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init; the output scaled by (1 - lambda_init)."""

    def __init__(self, shape: LayerShape):
        super().__init__(shape)
        # lq1, lk1, lq2, lk2 of every head
        self.lambda_vectors = nn.Parameter(torch.zeros(4, shape.n_head, shape.head_dim).normal_(0, 0.1))

    def per_head_lambda(self):
        # both terms in one product, sum and exp over (2, H, D): (lq1, lq2) times (lk1, lk2); fewer small ops
        # (launches in an eager step) than a product, sum and exp per term
        lq, lk = _fp32(self.lambda_vectors).view(2, 2, self.n_head, -1).unbind(1)
        first, second = torch.exp((lq * lk).sum(-1)).unbind(0)
        return first - second + self.lambda_init

    def scale_output(self, y):
        return y * (1.0 - self.lambda_init)


class ClampLambda(DifferentialLambda):
    """One parameter per head, initialized to lambda_init, clamped to [0, 1]."""

    def __init__(self, shape: LayerShape):
        super().__init__(shape)
        self.lambda_raw = nn.Parameter(torch.full((shape.n_head,), self.lambda_init))

    def per_head_lambda(self):
        return _fp32(self.lambda_raw).clamp(0.0, 1.0)


class ScalarClampLambda(DifferentialLambda):
    """The official TDA code's lambda: one parameter per layer, initialized to 0.5, clamped to [0, 1]."""

    def __init__(self, shape: LayerShape):
        super().__init__(shape)
        self.lambda_scalar = nn.Parameter(torch.tensor(0.5))

    def per_head_lambda(self):
        return _fp32(self.lambda_scalar).clamp(0.0, 1.0).expand(self.n_head).contiguous()


LAMBDA_PARAMETRIZATIONS: dict[str, type[DifferentialLambda]] = {
    "reparam": ReparamLambda,
    "clamp": ClampLambda,
    "scalar_clamp": ScalarClampLambda,
}
LAMBDA_MODES = tuple(LAMBDA_PARAMETRIZATIONS)
