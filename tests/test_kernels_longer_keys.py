"""Fused kernels with queries against a longer key sequence (Q <= KV, bottom-right aligned: query i
at key position i + KV - Q), every variant, against the float64 reference by the DESIGN.md §6 rule
(forward and every gradient), on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it) and
natively on a GPU (bf16 too); the split-key decode forward (flash-decoding, few queries against many
keys); cached greedy generation on the kernels."""

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.testing import opcheck_launcher
from attn.kernels import runtime
from attn.kernels import softmax_family as sf
from attn.kernels import sigmoid_family as sg
from attn.kernels import threshold_family as tf
from attn.masks import MaskSpec
from attn.testing import outputs_and_grads
from models.gpt import GPT, AttnConfig, GPTConfig
from tolerance import assert_within_reference_error

VARIANTS = {
    "softmax": {},
    "softcap_tanh": {"cap": 2.0},
    "softcap_softsign": {"cap": 2.0},
    "alsc": {"cap": 2.0, "knee": 0.5},
    "threshold": {"beta": 0.3, "power": 2.0},
    "diff_threshold": {"beta": 0.2, "power": 1.5},
    "sigmoid": {},
}
MASKS = {"causal": MaskSpec(causal=True), "window": MaskSpec(causal=True, window=7), "full": MaskSpec(causal=False)}
# absolute allowance (times max(1, |reference|)) for fp32's blockwise-summation noise, as in
# tests/test_softmax_family.py; fp16's from tests/test_threshold_kernels.py
FLOORS = {torch.float32: 3e-6, torch.float16: 1e-4, torch.bfloat16: 8e-3}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_inputs(name, b, n, kv, h, h_kv, d, seed, temperature=False):
    """float64 leaves: q (B, n, H, D), k / v (B, kv, H_kv, D) (unit rows for the threshold family,
    whose scores are cosines), the second view and lambda for diff_threshold, a temperature."""
    gen = torch.Generator().manual_seed(seed)
    unit = "threshold" in name

    def rand(length, heads):
        x = torch.randn(b, length, heads, d, generator=gen, dtype=torch.float64)
        return F.normalize(x, dim=-1) if unit else 2.0 * x

    x = {"q": rand(n, h), "k": rand(kv, h_kv), "v": torch.randn(b, kv, h_kv, d, generator=gen, dtype=torch.float64)}
    if name == "diff_threshold":
        x.update(q2=rand(n, h), k2=rand(kv, h_kv),
                 lam=torch.tensor([0.3, 0.6, 0.1, 0.8, 0.5, 0.2, 0.7, 0.4][:h], dtype=torch.float64))
    if temperature:
        x["temperature"] = 0.5 + torch.rand(b, n, generator=gen, dtype=torch.float64)
    return x


def call_options(tensors: dict) -> dict:
    """attn.attention's keywords for the tensors beyond q, k, v: the temperature and the family's `extra`."""
    rest = dict(tensors)
    return {"temperature": rest.pop("temperature", None), "extra": rest}


def leaves(x, dtype):
    """Leaf copies in dtype on DEVICE (lam stays fp32 for low-precision runs, as a model keeps it)."""
    low = dtype in (torch.float16, torch.bfloat16)
    return {key: t.detach().to(device=DEVICE, dtype=torch.float32 if key == "lam" and low else dtype).requires_grad_()
            for key, t in x.items()}


def check(name, mask, n, kv, group, dtype=torch.float32, *, temperature=False, b=2, h_kv=2, d=16, seed=0):
    """Out and every gradient of backend='triton' within the rule of the float64 reference."""
    spec = attn.get_variant(name).make_spec(**VARIANTS[name])
    x = make_inputs(name, b, n, kv, h_kv * group, h_kv, d, seed, temperature)
    dout = torch.randn(b, n, h_kv * group, d, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64).to(DEVICE)

    def run(backend, dt):
        def fn(q, k, v, **rest):
            return attn.attention(q, k, v, spec, causal=mask.causal, window=mask.window, backend=backend,
                                  **call_options(rest))
        return outputs_and_grads(fn, leaves(x, dt), dout)

    ref64, same, fused = run("reference", torch.float64), run("reference", dtype), run("triton", dtype)
    ref64 = {key: t.to(DEVICE) for key, t in ref64.items()}
    assert set(fused) == {"out"} | {f"d{key}" for key in x}
    ratios = {}
    for key in ref64:
        assert fused[key].shape == ref64[key].shape, key
        allowance = FLOORS[dtype] * max(1.0, ref64[key].abs().max().item())
        ratios[key] = assert_within_reference_error(key, fused[key], same[key], ref64[key], floor=allowance)
    return fused


# every variant x every mask kind; Q, KV and the GQA ratio rotate (Q = 1, odd lengths, Q = KV)
SHAPES = [(1, 37, 2), (5, 29, 1), (19, 45, 4), (16, 16, 2), (3, 48, 1), (23, 41, 2)]
MATRIX = [pytest.param(name, mask, *SHAPES[(i + 2 * j) % len(SHAPES)],
                       id=f"{name}-{mask}-Q{SHAPES[(i + 2 * j) % len(SHAPES)][0]}-KV{SHAPES[(i + 2 * j) % len(SHAPES)][1]}")
          for i, name in enumerate(VARIANTS) for j, mask in enumerate(MASKS)]


@pytest.mark.parametrize("name,mask,n,kv,group", MATRIX)
def test_queries_against_longer_keys_match_the_reference(nan_poison, monkeypatch, name, mask, n, kv, group):
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "0")  # the one-pass forward (the split one: below)
    check(name, MASKS[mask], n, kv, group, temperature=name in ("softcap_tanh", "alsc"), seed=n * kv)


@pytest.mark.parametrize("name", ["alsc", "diff_threshold"])
def test_fp16_queries_against_longer_keys(nan_poison, monkeypatch, name):
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "0")
    check(name, MASKS["window"], 7, 33, 2, torch.float16, temperature=name == "alsc", seed=3)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter mishandles bf16: checked on the GPU only")
@pytest.mark.parametrize("name,mask,n,kv,group", MATRIX)
def test_bf16_queries_against_longer_keys(nan_poison, monkeypatch, name, mask, n, kv, group):
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "0")
    check(name, MASKS[mask], n, kv, group, torch.bfloat16, temperature=name in ("softcap_tanh", "alsc"), seed=n + kv)


def test_window_wider_than_the_cache_and_a_window_of_one(nan_poison, monkeypatch):
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "0")
    check("threshold", MaskSpec(causal=True, window=60), 4, 30, 1, seed=1)  # n_i = position + 1 throughout
    check("softmax", MaskSpec(causal=True, window=1), 6, 21, 2, seed=2)  # each query sees its own key only


class _SplitCounter:
    """Counts launches of the split-key forward (so a test knows the decode path ran)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for kernel in (sf._FWD, tf._KERNELS["fwd"], sg._KERNELS["fwd"]):  # every family's forward takes SPLIT_KV
            self._count_split_launches(monkeypatch, kernel)

    def _count_split_launches(self, monkeypatch, kernel):
        original_launch = kernel.launch

        def counted_launch(grid, tensors, scalars, meta, configs, tune_key):
            self.calls += int(meta.get("SPLIT_KV", False))
            return original_launch(grid, tensors, scalars, meta, configs, tune_key)

        monkeypatch.setattr(kernel, "launch", counted_launch)


# few queries (1..16) against a longer key sequence, keys split into 3 (or as forced) ranges; a
# range holds whole key tiles, and a GPU's tiles are 4-8x the interpreter's: longer caches there
KV_SCALE = 8 if DEVICE.type == "cuda" else 1
DECODE = [("softmax", "causal", 1, 45, 2, 3), ("softcap_softsign", "window", 4, 40, 1, 3),
          ("alsc", "full", 16, 48, 2, 2), ("softcap_tanh", "causal", 2, 33, 4, 5),
          ("threshold", "causal", 1, 45, 2, 3), ("threshold", "window", 9, 40, 1, 2),
          ("diff_threshold", "full", 3, 47, 2, 3), ("diff_threshold", "causal", 16, 37, 1, 4),
          ("sigmoid", "window", 2, 45, 2, 3), ("sigmoid", "full", 16, 40, 1, 2)]


@pytest.mark.parametrize("name,mask,n,kv,group,splits", DECODE,
                         ids=[f"{c[0]}-{c[1]}-Q{c[2]}-KV{c[3]}-S{c[5]}" for c in DECODE])
def test_split_key_decode_forward_matches_the_reference(nan_poison, monkeypatch, name, mask, n, kv, group, splits):
    """The split path's (out, lse) are those of the whole key range: the output matches and so does
    every gradient (the backward reads the merged lse)."""
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, str(splits))
    counter = _SplitCounter(monkeypatch)
    check(name, MASKS[mask], n, kv * KV_SCALE, group, temperature=name == "softcap_tanh", seed=kv + splits)
    assert counter.calls == 1


def test_split_key_decode_rows_without_visible_keys_in_a_split(nan_poison, monkeypatch):
    """A window of 3 leaves every split but the last empty for the last query: those partials weigh 0."""
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "4")
    counter = _SplitCounter(monkeypatch)
    for name in ("softmax", "threshold"):
        check(name, MaskSpec(causal=True, window=3), 2, 64 * KV_SCALE, 2, seed=4)
    assert counter.calls == 2


def test_decode_split_planning(monkeypatch):
    monkeypatch.delenv(runtime.DECODE_SPLITS_ENV, raising=False)
    cpu = torch.device("cpu")
    assert runtime.decode_splits(1, 32768, 128, 64, cpu) == 1  # the interpreter / CPU never splits by itself
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "8")
    assert runtime.decode_splits(4, 4096, 128, 64, cpu) == 8
    assert runtime.decode_splits(4, 100, 128, 64, cpu) == 2  # at most one range per key tile
    assert runtime.decode_splits(runtime.DECODE_MAX_QUERIES + 1, 4096, 128, 64, cpu) == 1
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "many")
    with pytest.raises(ValueError, match="ATTNLAB_DECODE_SPLITS must be a non-negative integer"):
        runtime.decode_splits(1, 4096, 128, 64, cpu)


def test_segment_ids_need_one_length_on_the_kernels():
    ids = torch.ones(1, 4, dtype=torch.long)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 9, 2, 16)
    for name in ("softmax", "threshold"):
        spec = attn.get_variant(name).make_spec(**VARIANTS[name])
        with pytest.raises(ValueError, match="segment_ids need queries and keys of one length"):
            attn.attention(q, k, k, spec, segment_ids=ids, backend="triton")
        kernel = sf.fused_attention if name == "softmax" else tf.fused_attention
        with pytest.raises(ValueError, match="segment_ids need queries and keys of one length"):
            kernel(q, k, k, spec, MaskSpec(), ids)
        with pytest.raises(ValueError, match=r"k must hold at least as many keys as q has queries"):
            kernel(k, q, q, spec, MaskSpec())
    with pytest.raises(ValueError, match="zero_fraction needs queries and keys of one length"):
        tf.zero_fraction(q, k, attn.get_variant("threshold").make_spec(), MaskSpec())


def tiny_triton_gpt(name, window=None):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=61, context=20, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                    attn=AttnConfig(name=name, params=VARIANTS[name], backend="triton", window=window))
    return GPT(cfg).to(DEVICE).eval()


@pytest.mark.parametrize("name,window,splits", [("softmax", None, "0"), ("alsc", 6, "2"),
                                                ("diff_threshold", None, "3"), ("threshold", 5, "0"),
                                                ("sigmoid", 5, "2")])
def test_cached_greedy_generation_on_the_kernels_equals_uncached(monkeypatch, name, window, splits):
    """Prompt once, then one token per step against the cache, through the fused kernels (the split
    decode forward where forced): the same tokens as re-encoding the window each step, and the same
    logits as the reference backend's cached decode."""
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    model = tiny_triton_gpt(name, window)
    prompt = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        cached = model.generate(prompt, 10, temperature=0, kv_cache=True)
        assert torch.equal(cached, model.generate(prompt, 10, temperature=0, kv_cache=False))
        cache = model.new_cache()
        steps = [model(cached[:, :6], cache=cache)] + [model(cached[:, t:t + 1], cache=cache) for t in range(6, 16)]
        for block in model.modules():
            if isinstance(getattr(block, "attend", None), attn.AttentionCall):
                block.attend = attn.AttentionCall(block.spec, causal=True, window=block.window, backend="reference")
        cache = model.new_cache()
        ref = [model(cached[:, :6], cache=cache)] + [model(cached[:, t:t + 1], cache=cache) for t in range(6, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), torch.cat(ref, dim=1), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ per-row key lengths (static cache)

# (variant, mask, Q, capacity KV, GQA group, per-row lengths, forced splits): lengths equal to the
# capacity, odd, equal to Q, below Q (causal: the first queries see nothing; full: all filled keys),
# zero; one-pass ("0") and split forwards, a split count leaving whole ranges past a row's length
KEY_LENGTH_CASES = [
    ("softmax", "causal", 1, 45, 2, (45, 17), "3"),
    ("softcap_tanh", "window", 4, 40, 1, (23, 4), "0"),
    ("softcap_softsign", "full", 3, 37, 4, (2, 37), "2"),
    ("alsc", "causal", 5, 48, 2, (3, 31), "3"),
    ("threshold", "window", 2, 45, 2, (45, 9), "4"),
    ("threshold", "full", 1, 33, 1, (0, 20), "2"),
    ("diff_threshold", "causal", 16, 47, 1, (30, 47), "2"),
    ("diff_threshold", "full", 3, 40, 2, (1, 40), "0"),
    ("sigmoid", "causal", 4, 45, 2, (2, 45), "3"),
    ("sigmoid", "full", 1, 37, 1, (0, 19), "0"),
]


def key_length_inputs(name, n, kv, group, lengths, seed, temperature=False, h_kv=2, d=16):
    """make_inputs with the cache slots past each row's length set to NaN (a slot the call reads
    into its output fails the comparison) and the lengths as the (B,) int32 tensor."""
    x = make_inputs(name, len(lengths), n, kv, h_kv * group, h_kv, d, seed, temperature)
    for key in ("k", "v", "k2"):
        if key in x:
            for row, length in enumerate(lengths):
                x[key][row, length:] = float("nan")
    return x, torch.tensor(lengths, dtype=torch.int32)


def forward_with_lengths(name, mask, x, lengths, backend, dtype):
    spec = attn.get_variant(name).make_spec(**VARIANTS[name])
    t = {key: v.detach().to(device=DEVICE, dtype=torch.float32 if key == "lam" and dtype != torch.float64
                            and dtype != torch.float32 else dtype) for key, v in x.items()}
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    with torch.no_grad():
        return attn.attention(q, k, v, spec, causal=mask.causal, window=mask.window, backend=backend,
                              key_lengths=lengths.to(DEVICE), **call_options(t))


def check_key_lengths(name, mask, n, kv, group, lengths, dtype=torch.float32, seed=0):
    """backend='triton' with key_lengths within the DESIGN.md rule of the float64 reference; the
    reference equal to itself on each row's sliced cache [:length] (where length >= Q), and the
    kernels within the rule there too (the Q <= KV path). Returns the kernels' output."""
    x, lens = key_length_inputs(name, n, kv, group, lengths, seed, temperature=name in ("softcap_tanh", "alsc"))
    ref64 = forward_with_lengths(name, mask, x, lens, "reference", torch.float64)
    same = forward_with_lengths(name, mask, x, lens, "reference", dtype)
    fused = forward_with_lengths(name, mask, x, lens, "triton", dtype)
    allowance = FLOORS[dtype] * max(1.0, ref64.abs().max().item())
    assert_within_reference_error("out", fused, same, ref64, floor=allowance)
    for row, length in enumerate(lengths):
        if length < n:
            continue
        sliced = {key: (t[row:row + 1, :length] if key in ("k", "v", "k2") else t if key == "lam" else t[row:row + 1])
                  for key, t in x.items()}
        plain = forward_with_lengths(name, mask, sliced, torch.tensor([length], dtype=torch.int32), "reference",
                                     torch.float64)
        spec = attn.get_variant(name).make_spec(**VARIANTS[name])
        s = {key: t.to(DEVICE) for key, t in sliced.items()}
        q, k, v = s.pop("q"), s.pop("k"), s.pop("v")
        unsliced_ref = attn.attention(q, k, v, spec, causal=mask.causal, window=mask.window, backend="reference",
                                      **call_options(s))
        torch.testing.assert_close(ref64[row:row + 1], unsliced_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(plain, unsliced_ref, rtol=0, atol=1e-12)
        s = {key: t.to(dtype if key != "lam" or dtype == torch.float32 else torch.float32) for key, t in s.items()}
        with torch.no_grad():
            on_slice = attn.attention(q.to(dtype), k.to(dtype), v.to(dtype), spec, causal=mask.causal,
                                      window=mask.window, backend="triton", **call_options(s))
        torch.testing.assert_close(fused[row:row + 1], on_slice, rtol=0, atol=4 * allowance + 1e-6)
    return fused


@pytest.mark.parametrize("name,mask,n,kv,group,lengths,splits", KEY_LENGTH_CASES,
                         ids=[f"{c[0]}-{c[1]}-Q{c[2]}-KV{c[3]}-L{'_'.join(map(str, c[5]))}-S{c[6]}"
                              for c in KEY_LENGTH_CASES])
def test_key_lengths_match_the_reference(nan_poison, monkeypatch, name, mask, n, kv, group, lengths, splits):
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    counter = _SplitCounter(monkeypatch)
    scale = KV_SCALE if splits != "0" else 1
    lengths = tuple(min(length * scale, kv * scale) if length > n else length for length in lengths)
    out = check_key_lengths(name, MASKS[mask], n, kv * scale, group, lengths, seed=n + kv)
    assert counter.calls >= int(splits not in ("0", "1"))
    for row, length in enumerate(lengths):  # queries at negative positions see nothing under a causal mask
        if MASKS[mask].is_causal and length < n:
            assert torch.equal(out[row, :n - length], torch.zeros_like(out[row, :n - length]))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter mishandles bf16: checked on the GPU only")
@pytest.mark.parametrize("name,mask,n,kv,group,lengths,splits", KEY_LENGTH_CASES,
                         ids=[f"{c[0]}-{c[1]}-bf16" for c in KEY_LENGTH_CASES])
def test_bf16_key_lengths_match_the_reference(nan_poison, monkeypatch, name, mask, n, kv, group, lengths, splits):
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    lengths = tuple(min(length * KV_SCALE, kv * KV_SCALE) if length > n else length for length in lengths)
    check_key_lengths(name, MASKS[mask], n, kv * KV_SCALE, group, lengths, torch.bfloat16, seed=n * kv)


def test_key_lengths_launches_do_not_depend_on_the_values(monkeypatch):
    """A key_lengths call launches the same kernels with the same grid and scalars whatever the
    lengths hold (the values are read on the device): it can be captured once and replayed."""
    from attn.kernels.runtime import Kernel

    launches = []
    real_run = Kernel.run

    def recording_run(self, cfg, grid, tensors, scalars, meta):
        launches.append((self.name, cfg, grid, scalars, tuple(meta.items())))
        return real_run(self, cfg, grid, tensors, scalars, meta)

    monkeypatch.setattr(Kernel, "run", recording_run)
    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, "3")
    for name in ("softmax", "diff_threshold"):
        x, _ = key_length_inputs(name, 1, 40, 2, (40, 40), seed=7)
        per_call = []
        for lengths in ((40, 3), (1, 26)):
            launches.clear()
            forward_with_lengths(name, MASKS["causal"], x, torch.tensor(lengths, dtype=torch.int32), "triton",
                                 torch.float32)
            per_call.append(list(launches))
        assert per_call[0] == per_call[1] and len(per_call[0]) >= 1


def test_key_lengths_are_checked():
    spec = attn.get_variant("softmax").make_spec()
    q, k = torch.randn(2, 1, 2, 16, device=DEVICE), torch.randn(2, 9, 2, 16, device=DEVICE)
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=r"key_lengths must be a \(B,\) = \(2,\) int32 tensor"):
            attn.attention(q, k, k, spec, key_lengths=lens.long(), backend=backend)
        with pytest.raises(ValueError, match=r"key_lengths must be a \(B,\) = \(2,\) int32 tensor"):
            attn.attention(q, k, k, spec, key_lengths=lens[:1], backend=backend)
        # a call does not read the values (that would wait for the device); the explicit check does
        with pytest.raises(ValueError, match=r"key_lengths values must lie in \[0, KV\] = \[0, 9\]"):
            attn.check_inputs(q, k, k, spec, key_lengths=torch.tensor([3, 10], dtype=torch.int32, device=DEVICE))
        attn.check_inputs(q, k, k, spec, key_lengths=lens)
        with pytest.raises(ValueError, match="key_lengths is for inference: dropout_p must be 0"):
            attn.attention(q, k, k, spec, key_lengths=lens, dropout_p=0.1, backend=backend)
        with pytest.raises(ValueError, match="key_lengths is forward-only"):
            attn.attention(q.requires_grad_(), k, k, spec, key_lengths=lens, backend=backend)
        q = q.detach()
        with pytest.raises(ValueError, match="key_lengths is forward-only"):
            attn.AttentionCall(spec, backend=backend)(q, k, k.clone().requires_grad_(), key_lengths=lens)
        with torch.no_grad():  # grad mode off: inputs that require grad are fine
            attn.attention(q.clone().requires_grad_(), k, k, spec, key_lengths=lens, backend=backend)
    ids = torch.ones(2, 9, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="key_lengths cannot be combined with segment_ids"):
        attn.attention(k, k, k, spec, key_lengths=lens, segment_ids=ids)
    with pytest.raises(ValueError, match="key_lengths cannot be combined with segment_ids"):
        sf.fused_attention(k, k, k, spec, MaskSpec(), ids, key_lengths=lens)
    threshold = attn.get_variant("threshold").make_spec()
    with pytest.raises(ValueError, match="key_lengths cannot be combined with segment_ids"):
        tf.fused_attention(k, k, k, threshold, MaskSpec(), ids, key_lengths=lens)
    # backend='sdpa' sends key_lengths calls to the reference
    out = attn.attention(q, k, k, spec, key_lengths=lens, backend="sdpa")
    torch.testing.assert_close(out, attn.attention(q, k, k, spec, key_lengths=lens, backend="reference"))


def test_key_lengths_custom_ops_and_compile():
    """The custom ops take key_lengths (opcheck: fake, schema, dispatch), and a compiled call
    (fullgraph, through the ops) equals the eager one."""
    x, lens = key_length_inputs("diff_threshold", 2, 40, 2, (40, 13), seed=9)
    t = {key: v.float().to(DEVICE) for key, v in x.items()}
    lens = lens.to(DEVICE)
    opcheck_launcher(tf.threshold_attention_op, (t["q"], t["k"], t["v"], t["q2"], t["k2"], t["lam"], None,
                                                      0.2, 1.5, True, 0, 0.0, None, lens))
    q, k, v = (make_inputs("alsc", 2, 2, 40, 4, 2, 16, seed=3)[key].float().to(DEVICE) for key in ("q", "k", "v"))
    opcheck_launcher(sf.softmax_family_fwd, (q, k, v, None, None, sf.CAP_IDS["alsc"], 2.0, 0.5, 0.25, True, 7,
                                                  0.0, None, lens))
    spec = attn.get_variant("alsc").make_spec(**VARIANTS["alsc"])

    def call(q, k, v, lens):
        return attn.AttentionCall(spec, causal=True, backend="triton")(q, k, v, key_lengths=lens)

    with torch.no_grad():
        eager = call(q, k, v, lens)
        compiled = torch.compile(call, fullgraph=True)(q, k, v, lens)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name,window,splits", [("alsc", 6, "2"), ("diff_threshold", None, "3")])
def test_captured_generation_on_the_kernels_equals_eager_steps(monkeypatch, name, window, splits):
    """The decode step on the fused kernels (key_lengths, the split-key forward where forced),
    captured once and replayed: a real CUDA graph under bf16 autocast on a GPU, the stand-in
    (tests/test_kv_cache.py) in fp32 under the interpreter. Same tokens and step logits (values and
    dtypes) as the eager decode steps, and on the GPU the same tokens as uncached decoding in fp32."""
    from models.captured_step import capture_cuda_graph
    from models.gpt import DecodeStep
    from test_kv_cache import EagerCapture

    monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    model = tiny_triton_gpt(name, window)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cuda = DEVICE.type == "cuda"
    capture = capture_cuda_graph if cuda else EagerCapture()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), autocast:
        logits = []
        for graph in (True, False):
            cache = model.new_cache()
            model(prompt, cache=cache)
            step = DecodeStep(model, cache, graph=graph, capture=capture)
            logits.append([step(prompt[:, t:t + 1]).clone() for t in range(4)])
        for a, b in zip(*logits):
            assert a.dtype == b.dtype == (torch.bfloat16 if cuda else torch.float32)
            assert torch.equal(a, b)
        graphed = model.generate(prompt, 18, temperature=0, graph=True, capture=capture)  # past the context (20)
        assert torch.equal(graphed, model.generate(prompt, 18, temperature=0, graph=False))
    if cuda:
        with torch.no_grad():
            assert torch.equal(model.generate(prompt, 15, temperature=0),
                               model.generate(prompt, 15, temperature=0, kv_cache=False))
