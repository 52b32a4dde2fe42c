"""The public `attn.attention` on a GPU as a user calls it: captured in a CUDA graph and replayed with
new values written into the captured buffers (segment layouts, temperatures, dropout seeds, a
growing KV cache) it gives the eager call's result, and it never waits for the device inside a call.
Skipped without CUDA; `python3 scripts/gpu_check.py kernels` runs it natively.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.testing import random_segment_ids

# every kernel on its first tile config (conftest): tuning runs kernels and must not happen inside a capture
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("first_tile_configs")]
CUDA = torch.device("cuda")
PARAMS = {"softmax": {}, "softcap_tanh": {"cap": 5.0}, "alsc": {"cap": 5.0, "knee": 0.5},
          "threshold": {"beta": 0.5, "power": 2.0}, "diff_threshold": {"beta": 0.5, "power": 2.0}, "sigmoid": {}}



def _inputs(name, b, n, h, d, gen, kv=None):
    kv = n if kv is None else kv
    unit = name in ("threshold", "diff_threshold")

    def rand(length):
        x = torch.randn(b, length, h, d, generator=gen, device=CUDA)
        return (F.normalize(x, dim=-1) if unit else x).to(torch.bfloat16)

    x = {"q": rand(n), "k": rand(kv), "v": rand(kv)}
    if name == "diff_threshold":
        x["extra"] = {"q2": rand(n), "k2": rand(kv), "lam": torch.full((h,), 0.5, device=CUDA, dtype=torch.bfloat16)}
    return x


def _case(name, b, n, h, d, kv=None):
    """(generator, spec, inputs) of one case: fresh bf16 inputs of the variant, its test parameters."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    return gen, attn.get_variant(name).make_spec(**PARAMS[name]), _inputs(name, b, n, h, d, gen, kv=kv)


def _capture(fn):
    """fn captured in a CUDA graph (warmed up on a side stream first, as torch.cuda.graphs asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("name", list(PARAMS))
def test_segment_ids_and_temperature_replayed_with_new_values_give_the_eager_result(name):
    b, n, h, d = 2, 200, 4, 64
    gen, spec, x = _case(name, b, n, h, d)
    ids = random_segment_ids(b, n, torch.Generator().manual_seed(1), min_history=20).to(CUDA)
    softmax_family = attn.family_of(spec).name == "softmax"
    temp = torch.rand(b, n, generator=gen, device=CUDA) + 0.5 if softmax_family else None

    def call():
        return attn.attention(x["q"], x["k"], x["v"], spec, causal=False, segment_ids=ids, temperature=temp,
                              extra=x.get("extra"))

    with torch.no_grad():
        graph, out = _capture(call)
        for seed in (2, 3):
            ids.copy_(random_segment_ids(b, n, torch.Generator().manual_seed(seed), min_history=10).to(CUDA))
            if temp is not None:
                temp.copy_(torch.rand(b, n, generator=gen, device=CUDA) + 0.5)
            graph.replay()
            eager = attn.attention(x["q"], x["k"], x["v"], spec, causal=False, segment_ids=ids.clone(),
                                   temperature=temp, extra=x.get("extra"))
            torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["softmax", "threshold", "sigmoid"])
def test_dropout_seed_replayed_with_a_new_value_gives_the_eager_result(name):
    _, spec, x = _case(name, 2, 130, 2, 64)
    seed = torch.tensor([11], device=CUDA, dtype=torch.int64)

    def call():
        return attn.attention(x["q"], x["k"], x["v"], spec, dropout_p=0.3, dropout_seed=seed)

    with torch.no_grad():
        graph, out = _capture(call)
        results = []
        for value in (5, 6):
            seed.fill_(value)
            graph.replay()
            eager = attn.attention(x["q"], x["k"], x["v"], spec, dropout_p=0.3, dropout_seed=value)
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
            results.append(out.clone())
        assert not torch.equal(results[0], results[1])  # the seed reached the kernel


@pytest.mark.parametrize("name", list(PARAMS))
def test_a_decode_step_replayed_as_the_cache_fills_gives_the_eager_result(name):
    b, capacity, h, d = 3, 512, 4, 64
    gen, spec, x = _case(name, b, 1, h, d, kv=capacity)
    lengths = torch.tensor([1, 100, 300], dtype=torch.int32, device=CUDA)

    def call():
        return attn.attention(x["q"], x["k"], x["v"], spec, key_lengths=lengths, extra=x.get("extra"))

    with torch.no_grad():
        graph, out = _capture(call)
        for step in range(3):
            lengths.add_(97)  # grows past the capacity on the last row: clamped as the eager call is
            x["q"].copy_(torch.randn(x["q"].shape, generator=gen, device=CUDA).to(torch.bfloat16))
            graph.replay()
            eager = attn.attention(x["q"], x["k"], x["v"], spec, key_lengths=lengths.clone(), extra=x.get("extra"))
            torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["softcap_tanh", "threshold", "sigmoid"])
def test_the_segment_mask_object_gives_the_ids_result_forward_and_backward(name):
    _, spec, x = _case(name, 2, 257, 4, 64)
    ids = random_segment_ids(2, 257, torch.Generator().manual_seed(4), min_history=30).to(CUDA)
    mask = attn.segments(ids)
    results = []
    for segment_ids in (ids, mask):
        leaves = {key: x[key].detach().clone().requires_grad_() for key in ("q", "k", "v")}
        out = attn.attention(leaves["q"], leaves["k"], leaves["v"], spec, causal=False, segment_ids=segment_ids,
                             extra=x.get("extra"))
        out.float().square().sum().backward()
        results.append((out, *(leaves[key].grad for key in ("q", "k", "v"))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["softmax", "threshold"])
def test_calls_do_not_wait_for_the_device(name):
    """torch.cuda.set_sync_debug_mode('error') raises on any synchronizing CUDA call."""
    _, spec, x = _case(name, 2, 300, 4, 64)
    ids = random_segment_ids(2, 300, torch.Generator().manual_seed(5), min_history=30).to(CUDA)
    mask = attn.segments(ids)  # the one sync: the mask's check
    lengths = torch.tensor([10, 300], dtype=torch.int32, device=CUDA)
    leaves = {key: x[key].detach().clone().requires_grad_() for key in ("q", "k", "v")}
    calls = [
        lambda: attn.attention(leaves["q"], leaves["k"], leaves["v"], spec).sum().backward(),
        lambda: attn.attention(x["q"], x["k"], x["v"], spec, causal=False, segment_ids=mask),
        lambda: attn.attention(x["q"][:, :1], x["k"], x["v"], spec, key_lengths=lengths),
        # ids: checked (one sync) when first seen, in the warm-up; remembered after
        lambda: attn.attention(x["q"], x["k"], x["v"], spec, causal=False, segment_ids=ids),
    ]
    for call in calls:  # warm: tile configs, compiles
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
