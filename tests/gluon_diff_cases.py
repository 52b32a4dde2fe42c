"""The differential threshold's Gluon GPU tests' shared cases (tests/test_gluon_diff_fwd_gpu.py and
test_gluon_diff_bwd_gpu.py): shapes (tests/gluon_cases.py's and one more), spec parameters, case ids, the
inputs' draw, and the fixture that keeps threshold_family's plans on the portable kernels while the tests
call the Gluon ones directly."""

from __future__ import annotations

import pytest
import torch

import gluon_cases
from attn.kernels import tiers

CUDA = torch.device("cuda")
# the shared matrix and one more: full mask, more keys than queries, GQA, D = 128
SHAPES = [*gluon_cases.SHAPES, (2, 190, 321, 8, 2, 128, False, torch.bfloat16)]
# the persistent grids' shapes: SHAPES and ones with more work items than SMs, a last work-item group of fewer
# (batch, head) pairs than gluon_pipeline.HEADS_PER_WORK_GROUP (B H = 15, 301, 3), rows that see no key (N > KV)
PERSISTENT_SHAPES = SHAPES + [
    (16, 1024, 1024, 12, 12, 64, True, torch.bfloat16),
    (3, 777, 777, 5, 5, 128, True, torch.bfloat16),
    (1, 640, 640, 301, 301, 64, False, torch.bfloat16),
    (1, 700, 200, 3, 1, 64, True, torch.float16),
]

# (spec parameters, shape)
CASES = [
    ({}, SHAPES[0]),
    ({}, SHAPES[1]),
    ({}, SHAPES[2]),
    ({"power": 1.0}, SHAPES[1]),
    ({"power": 1.0}, SHAPES[4]),
    ({"power": 1.0}, SHAPES[8]),
    ({"power": 1.5, "beta": 0.5}, SHAPES[4]),
    ({"power": 1.5}, SHAPES[6]),
    ({"power": 1.5}, SHAPES[7]),
    ({"power": 3.0}, SHAPES[3]),
    ({"beta": 0.25}, SHAPES[5]),  # low thresholds: dense rows
    ({}, SHAPES[6]),
    ({}, SHAPES[7]),
    ({"power": 1.0, "beta": 0.5}, SHAPES[5]),
]


def case_id(case) -> str:
    params, c = case
    extra = "".join(f"-{name}{value}" for name, value in params.items())
    return f"diff{extra}-B{c[0]}-N{c[1]}-KV{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{'causal' if c[6] else 'full'}-{str(c[7])[6:]}"


def draw_inputs(shape, seed):
    """(tensors, lam, gen): float64 tensors on the GPU, unit-norm q, k, q2, k2 (cosine scores, as the
    threshold model feeds them: thresholds that bind) and v; per-head lambdas in [-0.5, 1.2] (float64);
    the generator, for whatever a test draws next."""
    b, n, kv, h, h_kv, d = shape[:6]
    gen = torch.Generator(device=CUDA).manual_seed(seed)

    def unit(*size):
        return torch.nn.functional.normalize(torch.randn(*size, device=CUDA, dtype=torch.float64, generator=gen),
                                             dim=-1)

    tensors = {"q": unit(b, n, h, d), "k": unit(b, kv, h_kv, d),
               "v": torch.randn(b, kv, h_kv, d, device=CUDA, dtype=torch.float64, generator=gen),
               "q2": unit(b, n, h, d), "k2": unit(b, kv, h_kv, d)}
    lam = torch.rand(h, device=CUDA, dtype=torch.float64, generator=gen) * 1.7 - 0.5
    return tensors, lam, gen


@pytest.fixture(autouse=True)
def portable_plans(monkeypatch):
    """threshold_family's plans on the portable kernels (they offer the Gluon tier to these calls otherwise):
    the tests call the Gluon kernels directly and compare with the portable ones."""
    monkeypatch.setenv(tiers.GLUON_ENV, "0")
