"""Checks that need a CUDA GPU (skipped without one); `python3 scripts/gpu_check.py kernels` runs them
natively with the other kernel tests that run on a GPU.

- Non-finite inputs propagate through the fused kernels as through the reference, bf16 and fp32
  (tests/test_reliability.py runs the same cases under the interpreter).
- The kernel runtime's direct launches (attn/kernels/runtime.py: a launch after the first of a
  specialization skips Triton's JIT) give bitwise the results of launches through the JIT
  (ATTNLAB_DIRECT_LAUNCH=0), on tile configs pinned so that both run the same tiles, and stay within
  the DESIGN.md §6 rule of the float64 reference.
- `train.cuda_graphs=step` (models/captured_step.py) on a small GPT on the fused kernels: without
  dropout every replay gives the eager step's loss and gradients; with attention and residual
  dropout the masks are fresh on every replay (a mask frozen into the graph would repeat one loss)
  and the replays' mean loss matches the eager steps' within their spread.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.kernels.runtime import DIRECT_ENV
from attn.testing import error_ratio, nonfinite_cases, nonfinite_pattern, random_segment_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")



# ------------------------------------------------------------------------------ non-finite inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", attn.variant_names())
def test_nonfinite_inputs_propagate_in_the_kernels_as_in_the_reference(name, dtype, first_tile_configs):
    spec = attn.get_variant(name).make_spec()
    for label, tensors in nonfinite_cases(name, CUDA, dtype):
        (ref_nan, ref_finite), (ker_nan, ker_finite) = (nonfinite_pattern(spec, tensors, backend)
                                                        for backend in ("reference", "triton"))
        assert ref_nan.any(), label  # the case does poison something
        assert torch.equal(ker_nan, ref_nan), f"{label}: NaN at {ker_nan.nonzero().tolist()} vs {ref_nan.nonzero().tolist()}"
        assert ker_finite == ref_finite, f"{label}: gradients finite {ker_finite}, reference {ref_finite}"


# ------------------------------------------------------------------------------ direct launches

DIRECT_VARIANTS = {"softmax": {}, "softcap_tanh": {"cap": 5.0}, "alsc": {"cap": 5.0, "knee": 0.5},
                   "softcap_softsign": {"cap": 5.0}, "threshold": {}, "diff_threshold": {}}
DIRECT_MASKS = {"causal": dict(causal=True), "window": dict(causal=True, window=100), "full": dict(causal=False),
                "ranker": dict(causal=False, ranker=True)}


def direct_launch_inputs(variant, mask, gen, b=2, n=333, h=4, h_kv=2, d=64):
    """float64 inputs on the GPU (unit q/k rows for the threshold family), a cotangent, segment ids."""
    threshold = variant in ("threshold", "diff_threshold")

    def t(heads, unit=False):
        x = torch.randn(b, n, heads, d, generator=gen, dtype=torch.float64)
        return F.normalize(x, dim=-1) if unit else x

    x = {"q": t(h, threshold), "k": t(h_kv, threshold), "v": t(h_kv), "do": t(h)}
    if variant == "diff_threshold":
        x.update(q2=t(h, True), k2=t(h_kv, True), lam=torch.rand(h, generator=gen, dtype=torch.float64))
    if not threshold and mask == "causal":
        x["temperature"] = torch.rand(b, n, generator=gen, dtype=torch.float64) + 0.5
    ids = random_segment_ids(b, n, gen, min_history=n // 4, max_history=n // 2) if mask == "ranker" else None
    return {k: v.to(CUDA) for k, v in x.items()}, (ids.to(CUDA) if ids is not None else None)


def direct_launch_outputs(spec, mask, x, ids, dtype, backend):
    opts = {k: v for k, v in DIRECT_MASKS[mask].items() if k != "ranker"}
    q, k, v = (x[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v"))
    extra = {n: x[n].detach().to(dtype).requires_grad_() for n in ("q2", "k2", "lam") if n in x}
    temperature = x["temperature"].detach().to(dtype).requires_grad_() if "temperature" in x else None
    out = attn.attention(q, k, v, spec, segment_ids=ids, backend=backend, temperature=temperature, extra=extra,
                         **opts)
    out.backward(x["do"].to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            **{f"d{n}": t.grad for n, t in extra.items()},
            **({"dtemperature": temperature.grad} if temperature is not None else {})}


@pytest.mark.parametrize("mask", list(DIRECT_MASKS))
@pytest.mark.parametrize("variant", list(DIRECT_VARIANTS))
def test_direct_launches_equal_launches_through_the_jit(variant, mask, monkeypatch, first_tile_configs, nan_poison):
    monkeypatch.delenv(DIRECT_ENV, raising=False)
    gen = torch.Generator().manual_seed(0)
    spec = attn.get_variant(variant).make_spec(**DIRECT_VARIANTS[variant])
    bf16 = torch.bfloat16
    first, ids_first = direct_launch_inputs(variant, mask, gen)
    direct_launch_outputs(spec, mask, first, ids_first, bf16, "triton")  # a specialization's first launches: the JIT
    x, ids = direct_launch_inputs(variant, mask, gen)  # new pointers, the same compiled kernels
    direct = direct_launch_outputs(spec, mask, x, ids, bf16, "triton")
    monkeypatch.setenv(DIRECT_ENV, "0")
    jit = direct_launch_outputs(spec, mask, x, ids, bf16, "triton")
    monkeypatch.delenv(DIRECT_ENV)
    for key in direct:
        assert torch.equal(direct[key], jit[key]), key
    ref = direct_launch_outputs(spec, mask, x, ids, torch.float64, "reference")
    same = direct_launch_outputs(spec, mask, x, ids, bf16, "reference")
    for key in ref:
        ratio = error_ratio(direct[key], same[key], ref[key], floor=1e-3 * max(1.0, ref[key].abs().max().item()))
        assert ratio <= 1, (key, ratio)


# ------------------------------------------------------------------------------ one-pass dq by TMA reduce


@pytest.mark.parametrize("mask", list(DIRECT_MASKS))
@pytest.mark.parametrize("variant", ["softmax", "softcap_tanh", "alsc"])
def test_one_pass_dq_added_by_tma_reduce_meets_the_rule(variant, mask, monkeypatch, nan_poison):
    """The one-pass backward with its dq tiles added by TMA bulk reduce (ATTNLAB_TMA=dq_add; the
    interpreter has no descriptor reduce, so only a GPU runs it) against the float64 reference, odd
    length, GQA 2:1, every mask kind; the launches did take that path."""
    from attn.kernels import softmax_family as sf

    monkeypatch.setenv("ATTNLAB_TMA", "dq_add")
    monkeypatch.setenv(sf.DQ_FORM_ENV, "one_pass")
    monkeypatch.setattr(sf, "TMA_MIN_ROWS", 1)
    launched, run = [], sf._DKDV.run
    monkeypatch.setattr(sf._DKDV, "run", lambda cfg, grid, tensors, scalars, meta: (
        launched.append((meta["ATOMIC_DQ"], meta["DQ_TMA"])), run(cfg, grid, tensors, scalars, meta))[1])
    spec = attn.get_variant(variant).make_spec(**DIRECT_VARIANTS[variant])
    x, ids = direct_launch_inputs(variant, mask, torch.Generator().manual_seed(2), n=1037)
    x.pop("temperature", None)  # d-temperature takes the separate form
    fused = direct_launch_outputs(spec, mask, x, ids, torch.bfloat16, "triton")
    assert launched and all(launched), launched
    ref = direct_launch_outputs(spec, mask, x, ids, torch.float64, "reference")
    same = direct_launch_outputs(spec, mask, x, ids, torch.bfloat16, "reference")
    for key in ref:
        ratio = error_ratio(fused[key], same[key], ref[key], floor=1e-3 * max(1.0, ref[key].abs().max().item()))
        assert ratio <= 1, (key, ratio)


# ------------------------------------------------------------------------------ the captured step


def captured_step_model(dropout: float):
    from models.gpt import GPT, AttnConfig, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, context=256, n_layer=2, n_head=4, n_kv_head=4, d_model=128,
                    dropout=dropout, attn_dropout=dropout, attn=AttnConfig(name="softcap_tanh", backend="triton"))
    model = GPT(cfg).to(CUDA).train()
    return model, lambda x, y: F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def token_batch():
    gen = torch.Generator(device=CUDA).manual_seed(1)
    return (torch.randint(0, 512, (8, 256), device=CUDA, generator=gen),
            torch.randint(0, 512, (8, 256), device=CUDA, generator=gen))


def test_captured_step_replays_the_eager_step(first_tile_configs):
    from models.captured_step import WARMUP_CALLS, CapturedStep

    x, y = token_batch()
    model, loss_fn = captured_step_model(0.0)
    step = CapturedStep(loss_fn, model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(WARMUP_CALLS + 4):
        loss = step(x, y)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        eager = loss_fn(x, y)
        eager.backward()
        eager = eager.item()  # no autograd graph may outlive its step: the capture's backward would
        # then meet an AccumulateGrad node of the default stream (an invalid capture)
        assert abs(loss.item() - eager) <= 1e-5
        assert max((g - p.grad).abs().max().item() for g, p in zip(grads, params)) <= 1e-5
    assert step.captured


def test_captured_step_draws_fresh_dropout_masks_per_replay(first_tile_configs):
    from models.captured_step import WARMUP_CALLS, CapturedStep

    x, y = token_batch()
    model, loss_fn = captured_step_model(0.1)
    step = CapturedStep(loss_fn, model.parameters())
    for _ in range(WARMUP_CALLS + 1):
        step(x, y)
    assert step.captured
    replayed = [step(x, y).item() for _ in range(20)]
    eager = [loss_fn(x, y).item() for _ in range(20)]
    assert len(set(replayed)) == len(replayed), "a replay repeated another's loss: a frozen dropout mask"
    spread = statistics.stdev(eager)
    gap = abs(statistics.mean(replayed) - statistics.mean(eager))
    assert gap <= 4 * spread / len(eager) ** 0.5 + 1e-6, (statistics.mean(replayed), statistics.mean(eager), spread)
