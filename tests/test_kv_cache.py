"""Queries against a longer key sequence (Q < KV, bottom-right aligned) on the reference backend,
and the model's KV-cache decoding: equal to re-encoding the whole window, token for token."""

import pytest
import torch

import attn
from attn.masks import MaskSpec, dense_mask, visible_key_counts
from attn.reference import reference_attention
from models.gpt import GPT, AttnConfig, GPTConfig, KVCache
from test_kernels_longer_keys import make_inputs

VARIANTS = {
    "softmax": {},
    "softcap_tanh": {"cap": 3.0},
    "softcap_softsign": {"cap": 3.0},
    "alsc": {"cap": 3.0, "knee": 0.5},
    "threshold": {"beta": 0.3, "power": 2.0},
    "diff_threshold": {"beta": 0.2, "power": 1.5},
}
MASKS = {"causal": MaskSpec(causal=True), "window": MaskSpec(causal=True, window=5), "full": MaskSpec(causal=False)}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", VARIANTS)
def test_the_last_queries_against_all_keys_are_the_last_rows_of_full_attention(name, mask):
    """Query block i of Q against KV keys is query KV - Q + i of the square problem: same
    visible keys, same tau counts, same output (float64)."""
    b, kv, h, h_kv, d = 2, 13, 4, 2, 8
    x = make_inputs(name, b, kv, kv, h, h_kv, d, seed=kv, temperature=name in ("softcap_tanh", "alsc"))
    spec = attn.get_variant(name).make_spec(**VARIANTS[name])
    full = reference_attention(x["q"], x["k"], x["v"], spec, MASKS[mask], temperature=x.get("temperature"),
                               q2=x.get("q2"), k2=x.get("k2"), lam=x.get("lam"))
    for q_len in (1, 4, kv):
        rows = slice(kv - q_len, kv)
        extra = {key: x[key][:, rows] for key in ("q2", "temperature") if key in x}
        extra.update({key: x[key] for key in ("k2", "lam") if key in x})
        part = attn.attention(x["q"][:, rows], x["k"], x["v"], spec, causal=MASKS[mask].causal,
                              window=MASKS[mask].window, backend="reference", **extra)
        torch.testing.assert_close(part, full[:, rows], rtol=0, atol=1e-12)


def test_bottom_right_alignment_of_masks_and_counts():
    visible = dense_mask(MaskSpec(causal=True, window=3), 2, kv_len=6)[0]
    assert visible.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]
    assert visible_key_counts(MaskSpec(causal=True), 2, kv_len=6).tolist() == [[5.0, 6.0]]
    assert visible_key_counts(MaskSpec(causal=False), 2, kv_len=6).tolist() == [[6.0, 6.0]]
    with pytest.raises(ValueError, match="at least as many as queries"):
        dense_mask(MaskSpec(), 4, kv_len=3)


def test_different_lengths_are_refused_by_sdpa_and_checked():
    spec = attn.get_variant("softmax").make_spec()
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match="backend='sdpa' needs queries and keys of one length"):
        attn.attention(q, k, k, spec, backend="sdpa")
    with pytest.raises(ValueError, match="attn.backend must be one of"):
        attn.attention(q, k, k, spec, backend="fast")
    with pytest.raises(ValueError, match="segment_ids need queries and keys of one length"):
        attn.attention(q, k, k, spec, segment_ids=torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"k must have shape \(B, KV, H_kv, D\)"):
        attn.attention(torch.randn(1, 6, 2, 8), k, k, spec)  # fewer keys than queries
    assert attn.attention(q, k, k, spec).shape == q.shape  # auto: the reference on CPU


def tiny_gpt(name, window=None, lambda_mode="reparam", context=24, backend="reference"):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=61, context=context, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    attn=AttnConfig(name=name, params=VARIANTS[name], backend=backend, window=window,
                                    lambda_mode=lambda_mode))
    return GPT(cfg).eval()


@pytest.mark.parametrize("name,window,lambda_mode", [(n, None, "reparam") for n in VARIANTS]
                         + [("softcap_tanh", 4, "reparam"), ("threshold", 6, "reparam"),
                            ("diff_threshold", None, "scalar_clamp"), ("diff_threshold", 5, "clamp")])
def test_cached_decoding_equals_reencoding_the_window(name, window, lambda_mode):
    """Logits of a prompt then one token at a time against the cache equal the logits of the whole
    sequence at once; greedy generation gives the same tokens with and without the cache."""
    model = tiny_gpt(name, window, lambda_mode)
    seq = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(seq)
        cache = model.new_cache()
        steps = [model(seq[:, :7], cache=cache)] + [model(seq[:, t:t + 1], cache=cache) for t in range(7, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    prompt = seq[:, :5]
    cached = model.generate(prompt, 19, temperature=0, kv_cache=True)  # 24 tokens: the whole context
    assert torch.equal(cached, model.generate(prompt, 19, temperature=0, kv_cache=False))


def test_generation_past_the_context_refills_the_cache_and_keeps_going():
    model = tiny_gpt("threshold", context=16)
    prompt = torch.randint(0, 61, (1, 20))  # longer than the context already
    out = model.generate(prompt, 40, temperature=0, kv_cache=True)
    assert out.shape == (1, 60) and torch.equal(out[:, :20], prompt)
    # the first new token sees the same last-16 window either way
    assert torch.equal(out[:, 20], model.generate(prompt, 1, temperature=0, kv_cache=False)[:, 20])
    torch.manual_seed(3)
    a = model.generate(prompt, 30, temperature=1.0, top_k=5)
    torch.manual_seed(3)
    assert torch.equal(a, model.generate(prompt, 30, temperature=1.0, top_k=5))


def test_cache_capacity_and_segment_ids_are_checked():
    model = tiny_gpt("softmax", context=8)
    cache = model.new_cache()
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 positions; 9 requested"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="segment_ids and a KV cache"):
        model(torch.zeros(1, 2, dtype=torch.long), segment_ids=torch.ones(1, 2, dtype=torch.long), cache=KVCache(2, 8))


def test_longer_keys_take_the_chosen_backend_except_sdpa(monkeypatch):
    """auto picks for KV > N as for KV == N (the kernels where Triton runs); SDPA's causal mask
    aligns top-left, so its longer-key calls run on the reference."""
    from attn import ops

    assert [ops.longer_keys_backend(b) for b in ("auto", "triton", "reference", "sdpa")] == [
        "auto", "triton", "reference", "reference"]
    seen = []
    monkeypatch.setattr(ops, "resolve_backend", lambda backend, device: seen.append(backend) or "reference")
    spec = attn.get_variant("softmax").make_spec()
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 5, 2, 8)
    attn.attention(q, k, k, spec)
    attn.AttentionCall(spec, backend="auto")(q, k, k)
    attn.AttentionCall(spec, backend="sdpa")(q, k, k)
    attn.AttentionCall(spec, backend="auto")(k, k, k)  # one length: auto as always
    assert seen == ["auto", "auto", "reference", "auto"]


def test_a_model_on_sdpa_decodes_its_cache_on_the_reference():
    model = tiny_gpt("softmax", backend="sdpa")
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model.generate(prompt, 19, temperature=0, kv_cache=True),
                       model.generate(prompt, 19, temperature=0, kv_cache=False))
