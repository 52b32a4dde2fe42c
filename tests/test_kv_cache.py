"""Queries against a longer key sequence (Q < KV, bottom-right aligned) on the reference backend,
and the model's KV-cache decoding: equal to re-encoding the whole window, token for token.

Model tests run on CUDA where there is one (generation then captures its decode step as a real
CUDA graph) and on CPU otherwise, where a stand-in with a graph's semantics covers the capture."""

import pytest
import torch

import attn
from attn.masks import MaskSpec, dense_mask, visible_key_counts
from attn.reference import reference_attention
from models.captured_step import capture_cuda_graph
from models.gpt import GPT, AttnConfig, DecodeStep, GPTConfig, KVCache
from test_kernels_longer_keys import make_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

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
    extra = {key: x[key] for key in ("q2", "k2", "lam") if key in x}
    full = reference_attention(x["q"], x["k"], x["v"], spec, MASKS[mask], temperature=x.get("temperature"),
                               extra=extra)
    for q_len in (1, 4, kv):
        rows = slice(kv - q_len, kv)
        # the queries' rows of the per-query tensors (q2, temperature); keys and lambda whole
        rows_extra = {key: t[:, rows] if key == "q2" else t for key, t in extra.items()}
        temperature = x["temperature"][:, rows] if "temperature" in x else None
        part = attn.attention(x["q"][:, rows], x["k"], x["v"], spec, causal=MASKS[mask].causal,
                              window=MASKS[mask].window, backend="reference", temperature=temperature,
                              extra=rows_extra)
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
    return GPT(cfg).to(DEVICE).eval()


@pytest.mark.parametrize("name,window,lambda_mode", [(n, None, "reparam") for n in VARIANTS]
                         + [("softcap_tanh", 4, "reparam"), ("threshold", 6, "reparam"),
                            ("diff_threshold", None, "scalar_clamp"), ("diff_threshold", 5, "clamp")])
def test_cached_decoding_equals_reencoding_the_window(name, window, lambda_mode):
    """Logits of a prompt then one token at a time against the cache equal the logits of the whole
    sequence at once; greedy generation gives the same tokens with and without the cache."""
    model = tiny_gpt(name, window, lambda_mode)
    seq = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
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
    prompt = torch.randint(0, 61, (1, 20)).to(DEVICE)  # longer than the context already
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
    zeros = torch.zeros(1, 8, dtype=torch.long, device=DEVICE)
    model(zeros, cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 positions; 9 requested"):
        model(zeros[:, :1], cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 positions; 9 requested"):
        DecodeStep(model, cache, graph=False)(zeros[:, :1])
    with pytest.raises(ValueError, match="segment_ids and a KV cache"):
        model(zeros[:, :2], segment_ids=torch.ones(1, 2, dtype=torch.long, device=DEVICE), cache=KVCache(2, 8))


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
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(model.generate(prompt, 19, temperature=0, kv_cache=True),
                       model.generate(prompt, 19, temperature=0, kv_cache=False))


# ------------------------------------------------------------------ static cache, decode step, capture


class EagerCapture:
    """A CPU stand-in for models.captured_step.capture_cuda_graph with a CUDA graph's semantics: the
    warm-up runs the step and reset() undoes it; the capture records without running (here the step
    runs once for its output tensor and reset() undoes that too, since a real capture leaves the
    state as it was); each replay runs the step again, reading the static inputs it closes over,
    and writes into the output tensor the capture returned (static addresses)."""

    def __init__(self):
        self.captures, self.replays = 0, 0

    def __call__(self, step, reset):
        self.captures += 1
        step()
        reset()
        output = step()
        reset()

        def replay():
            self.replays += 1
            output.copy_(step())

        return replay, output


def capture_for(device):
    """None on CUDA (generate's real CUDA-graph capture), the stand-in elsewhere."""
    return None if device.type == "cuda" else EagerCapture()


@pytest.mark.parametrize("name,window,lambda_mode", [(n, None, "reparam") for n in VARIANTS]
                         + [("softcap_tanh", 4, "reparam"), ("diff_threshold", 5, "clamp")])
def test_decode_steps_equal_the_full_forward_and_read_no_host_length(name, window, lambda_mode):
    """GPT.decode_step (RoPE at the device position, keys written at it, attention over the whole
    static cache with its device key lengths) gives the logits of the whole sequence at once; it
    never reads the host length (a captured graph could not), so a poisoned one changes nothing."""
    model = tiny_gpt(name, window, lambda_mode)
    seq = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        full = model(seq)
        cache = model.new_cache()
        steps = [model(seq[:, :5], cache=cache)]
        for t in range(5, 20):
            length, cache.length = cache.length, None
            steps.append(model.decode_step(seq[:, t:t + 1], cache))
            cache.length = length + 1
    assert cache.key_lengths.tolist() == [20, 20] and cache.position.tolist() == [20]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,context,prompt_len,new", [("softmax", 24, 5, 19), ("diff_threshold", 24, 3, 21),
                                                         ("threshold", 16, 20, 40), ("alsc", 12, 4, 30)])
def test_captured_generation_equals_uncached_and_eager(name, context, prompt_len, new):
    """The decode step captured once and replayed (a real CUDA graph on CUDA, the stand-in on CPU)
    gives the eager steps' tokens, and the uncached path's while the sequence fits the context; past
    it the cache is refilled eagerly and the same captured step goes on."""
    model = tiny_gpt(name, context=context)
    prompt = torch.randint(0, 61, (2, prompt_len), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    capture = capture_for(DEVICE)
    graphed = model.generate(prompt, new, temperature=0, graph=True, capture=capture)
    eager = model.generate(prompt, new, temperature=0, graph=False)
    assert graphed.shape == (2, prompt_len + new) and torch.equal(graphed, eager)
    fits = min(context, prompt_len + new)
    if prompt_len <= context:
        assert torch.equal(graphed[:, :fits], model.generate(prompt, fits - prompt_len, temperature=0,
                                                             kv_cache=False))
    if capture is not None:  # one capture per call; every decode step a replay (refills run eagerly)
        length, steps = min(prompt_len, context), 0
        for _ in range(new - 1):
            length, steps = (context - context // 4, steps) if length == context else (length + 1, steps + 1)
        assert capture.captures == 1 and capture.replays == steps > 0


def test_captured_generation_with_a_stop_token_and_sampling():
    model = tiny_gpt("softcap_softsign", context=16)
    prompt = torch.randint(0, 61, (3, 4), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    greedy = model.generate(prompt, 30, temperature=0, graph=False)
    stop = int(greedy[0, 6])  # a token row 0 writes early
    for graph in (True, False):
        out = model.generate(prompt, 30, temperature=0, stop_token=stop, graph=graph, capture=capture_for(DEVICE))
        if graph:
            captured = out
    assert torch.equal(captured, out)
    row0 = captured[0, 4:].tolist()
    assert row0[row0.index(stop):] == [stop] * (len(row0) - row0.index(stop))
    runs = []
    for graph in (True, False):
        gen = torch.Generator(device=DEVICE).manual_seed(11)
        runs.append(model.generate(prompt, 25, temperature=1.0, top_k=7, generator=gen, graph=graph,
                                   capture=capture_for(DEVICE)))
    assert torch.equal(*runs)


def test_captured_decode_under_autocast_sees_the_eager_dtypes():
    """Capture runs in the caller's autocast context: the captured step's logits and the cache have
    the eager step's dtypes (bf16 products) and values; generation gives the same tokens."""
    model = tiny_gpt("softmax", context=20)
    prompt = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with torch.no_grad(), torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        results = []
        for graph in (True, False):
            cache = model.new_cache()
            model(prompt, cache=cache)
            step = DecodeStep(model, cache, graph=graph, capture=capture_for(DEVICE) or capture_cuda_graph)
            logits = [step(prompt[:, t:t + 1]).clone() for t in range(3)]
            assert step.captured == graph
            results.append((logits, cache.layers[0]["v"].dtype))
        assert results[0][1] == results[1][1] == torch.bfloat16
        for a, b in zip(results[0][0], results[1][0]):
            assert a.dtype == b.dtype == torch.bfloat16
            assert torch.equal(a, b)
        graphed = model.generate(prompt, 14, temperature=0, graph=True, capture=capture_for(DEVICE))
        assert torch.equal(graphed, model.generate(prompt, 14, temperature=0, graph=False))


def test_decode_step_and_graph_options_are_checked():
    model = tiny_gpt("threshold", context=12)
    prompt = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="graph must be True, False or None"):
        model.generate(prompt, 2, graph="yes")
    if DEVICE.type != "cuda":
        with pytest.raises(ValueError, match="graph=True captures a CUDA graph; idx is on cpu"):
            model.generate(prompt, 2, graph=True)
    cache = model.new_cache()
    with pytest.raises(ValueError, match="a decode step needs a cache that a forward filled first"):
        model.decode_step(prompt[:, :1], cache)
    with torch.no_grad():
        model(prompt, cache=cache)
    with pytest.raises(ValueError, match="a decode step needs a cache that a forward of this batch size"):
        model.decode_step(prompt[:1, :1], cache)
    with pytest.raises(ValueError, match=r"decode_step takes one token per row, idx of shape \(B, 1\)"):
        model.decode_step(prompt, cache)
    cache = model.new_cache()
    with torch.no_grad():
        model(prompt, cache=cache)
        step = DecodeStep(model, cache, graph=True, capture=capture_for(DEVICE) or capture_cuda_graph)
        step(prompt[:, :1])
        with pytest.raises(ValueError, match=r"replays tokens of shape \(2, 1\), got \(1, 1\)"):
            step(prompt[:1, :1])
        cache.reset()
        model(prompt[:1], cache=cache)  # batch 1: the buffers are reallocated
        cache.set_length(3)
        with pytest.raises(ValueError, match="the KV cache was reallocated after the decode step was captured"):
            step(torch.cat([prompt[:1, :1]] * 2))
    with pytest.raises(ValueError, match=r"KV cache length must lie in \[0, 12\]"):
        cache.set_length(13)
    longer = KVCache(model.cfg.n_layer, 13)
    with torch.no_grad():
        model(prompt, cache=longer)
        with pytest.raises(ValueError, match=r"at most the context \(12 positions\), got capacity 13"):
            model.decode_step(prompt[:, :1], longer)
