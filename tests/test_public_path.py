"""The public attention path's host behaviour: the reusable segment mask, segment ids checked once per
tensor, the explicit value checks, and eager calls without a gradient (CPU: reference and interpreter)."""

from __future__ import annotations

import pytest
import torch

import attn
import attn.masks as masks
from attn.testing import random_segment_ids


def _qkv(b=2, n=40, h=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=gen) for _ in range(3)]


@pytest.fixture
def count_checks(monkeypatch):
    calls = []
    validate = masks.validate_segment_ids

    def counting(*args):
        calls.append(args[1:])
        return validate(*args)

    monkeypatch.setattr(masks, "validate_segment_ids", counting)
    return calls


def test_segments_carries_the_ids_and_their_bounds():
    ids = random_segment_ids(3, 40, torch.Generator().manual_seed(0), min_history=5)
    mask = attn.segments(ids)
    assert isinstance(mask, attn.SegmentMask) and mask.segment_ids is ids
    torch.testing.assert_close(mask.bounds, attn.segment_bounds(ids))


def test_segments_checks_values_unless_told_not_to():
    ids = random_segment_ids(2, 40, torch.Generator().manual_seed(0), min_history=5)
    bad = ids.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match="segment_ids values must be in"):
        attn.segments(bad)
    gap = ids.clone()
    gap[1, 2] = 0  # a hole in the history range
    with pytest.raises(ValueError, match=r"the history \(1\) positions must form one contiguous range"):
        attn.segments(gap)
    assert attn.segments(gap, check=False).bounds.shape == (2, 4)  # built without reading values
    with pytest.raises(ValueError, match=r"segment_ids must be a \(B, N\) integer tensor, got \(40,\)"):
        attn.segments(ids[0])
    with pytest.raises(ValueError, match="must be an integer tensor, signed"):
        attn.segments(ids.float(), check=False)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", ["softcap_tanh", "threshold", "sigmoid"])
def test_a_segment_mask_gives_what_the_ids_give(name, backend):
    spec = attn.get_variant(name).make_spec()
    q, k, v = _qkv()
    ids = random_segment_ids(2, 40, torch.Generator().manual_seed(1), min_history=5)
    with_ids = attn.attention(q, k, v, spec, causal=False, segment_ids=ids, backend=backend)
    with_mask = attn.attention(q, k, v, spec, causal=False, segment_ids=attn.segments(ids), backend=backend)
    torch.testing.assert_close(with_mask, with_ids, rtol=0, atol=0)
    call = attn.AttentionCall(spec, causal=False, backend=backend)
    torch.testing.assert_close(call(q, k, v, segment_ids=attn.segments(ids)), with_ids, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["softcap_tanh", "threshold", "sigmoid"])
def test_a_segment_mask_launches_exactly_what_the_ids_launch(name, monkeypatch):
    """fwd+bwd with `segments(ids)` runs the same kernels as with `segment_ids=ids`: names, grids, tensor
    layouts, scalars, constexprs, tile configs and equal bounds values (the mask object saves host work
    only; GPU time differences between the two are not its kernels')."""
    from attn.kernels import runtime

    launches = []

    def record(self, cfg, grid, tensors, scalars, meta):
        launches.append((self.name, tuple(grid), cfg, tuple(scalars), tuple(sorted(meta.items())),
                         tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in tensors),
                         [t.clone() for t in tensors if isinstance(t, torch.Tensor) and t.dtype == torch.int32]))

    monkeypatch.setattr(runtime.Kernel, "run", record)
    spec = attn.get_variant(name).make_spec()
    q, k, v = (t.half().requires_grad_() for t in _qkv())
    ids = random_segment_ids(2, 40, torch.Generator().manual_seed(3), min_history=5)
    seen = {}
    for label, mask in (("ids", ids), ("mask", attn.segments(ids))):
        launches.clear()
        attn.attention(q, k, v, spec, causal=False, segment_ids=mask, backend="triton").sum().backward()
        seen[label] = list(launches)
    assert len(seen["ids"]) >= 2  # a forward and a backward at least
    for with_ids, with_mask in zip(seen["ids"], seen["mask"], strict=True):
        assert with_ids[:6] == with_mask[:6]
        assert all(torch.equal(a, b) for a, b in zip(with_ids[6], with_mask[6], strict=True))


def test_a_segment_mask_of_another_batch_is_refused():
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = _qkv()
    mask = attn.segments(random_segment_ids(3, 40, torch.Generator().manual_seed(1), min_history=5))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(B, N\) = \(2, 40\), got \(3, 40\)"):
        attn.attention(q, k, v, spec, causal=False, segment_ids=mask, backend="reference")


def test_ids_are_checked_once_per_tensor_and_again_after_an_in_place_change(count_checks):
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = _qkv()
    ids = random_segment_ids(2, 40, torch.Generator().manual_seed(2), min_history=5)
    for _ in range(3):  # a model's layers, a benchmark's repeats
        attn.attention(q, k, v, spec, causal=False, segment_ids=ids, backend="triton")
    assert len(count_checks) == 1
    last = ids[0, -1].item()
    ids[0, -1] = 7  # an in-place write: the values are checked again, and refused
    with pytest.raises(ValueError, match="segment_ids values must be in"):
        attn.attention(q, k, v, spec, causal=False, segment_ids=ids, backend="triton")
    assert len(count_checks) == 2
    other = ids.clone()
    other[0, -1] = last
    attn.attention(q, k, v, spec, causal=False, segment_ids=other, backend="triton")  # a new tensor: checked
    attn.attention(q, k, v, spec, causal=False, segment_ids=attn.segments(other), backend="triton")  # by segments
    assert len(count_checks) == 4


def test_check_inputs_reads_the_values_a_call_leaves_alone():
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = _qkv(n=1)
    cache_k, cache_v = _qkv(n=9)[1:]
    attn.check_inputs(q, cache_k, cache_v, spec, key_lengths=torch.tensor([3, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key_lengths values must lie in \[0, KV\] = \[0, 9\]"):
        attn.check_inputs(q, cache_k, cache_v, spec, key_lengths=torch.tensor([-1, 9], dtype=torch.int32))
    q, k, v = _qkv()
    ids = random_segment_ids(2, 40, torch.Generator().manual_seed(3), min_history=5)
    attn.check_inputs(q, k, v, spec, causal=False, segment_ids=attn.segments(ids))
    ids[1, 0] = 3
    with pytest.raises(ValueError, match="segment_ids values must be in"):
        attn.check_inputs(q, k, v, spec, causal=False, segment_ids=attn.segments(ids, check=False))
    with pytest.raises(ValueError, match="causal must be True or False"):
        attn.check_inputs(q, k, v, spec, causal=None)


@pytest.mark.parametrize("name", ["softmax", "threshold", "sigmoid"])
def test_an_eager_call_without_a_gradient_builds_no_autograd_node(name):
    spec = attn.get_variant(name).make_spec()
    q, k, v = _qkv()
    with torch.no_grad():
        plain = attn.attention(q.requires_grad_(), k, v, spec, backend="triton")
    assert plain.grad_fn is None
    q.requires_grad_(False)
    assert attn.attention(q, k, v, spec, backend="triton").grad_fn is None
    tracked = attn.attention(q.clone().requires_grad_(), k, v, spec, backend="triton")
    assert tracked.grad_fn is not None
    torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)
