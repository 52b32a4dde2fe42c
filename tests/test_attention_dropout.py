"""Attention-weight dropout (attn/dropout.py): the reference's statistics, and the fused kernels of
both families against the float64 reference fed the kernels' own mask
(`attn.kernels.dropout.keep_mask`), by the DESIGN.md §6 rule, for out and every gradient.

The kernel tests (`-k kernel`) run on the GPU where there is one (natively, bf16 cases added) and
under TRITON_INTERPRET=1 (tests/conftest.py) elsewhere; on the GPU only: fresh, unbiased masks
eager, under torch.compile and under CUDA graphs."""

import math

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within_reference_error

import attn
from attn.testing import opcheck_launcher
from attn.dropout import draw_seed
from attn.kernels import sigmoid_family as sg
from attn.kernels import softmax_family as sf
from attn.kernels import threshold_family as tf
from attn.kernels.dropout import keep_mask
from attn.masks import MaskSpec, dense_mask
from attn.reference import attention_weights, reference_attention
from attn.testing import outputs_and_grads, random_segment_ids

FLOOR = {torch.float32: 3e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# where the fused kernels run: natively on a GPU, in the Triton interpreter on CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MASKS = {
    "full": MaskSpec(causal=False),
    "causal": MaskSpec(causal=True),
    "window": MaskSpec(causal=True, window=9),
}


def unit(gen, *shape):
    return F.normalize(torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1)


def make_tensors(name, batch, n, heads, kv_heads, d, seed, temperature=False):
    """float64 inputs of variant `name` (q, k on the unit sphere for the threshold family) and a cotangent."""
    gen = torch.Generator().manual_seed(seed)
    if name in ("threshold", "diff_threshold"):
        tensors = {"q": unit(gen, batch, n, heads, d), "k": unit(gen, batch, n, kv_heads, d)}
    else:
        tensors = {"q": 2 * torch.randn(batch, n, heads, d, generator=gen, dtype=torch.float64),
                   "k": 2 * torch.randn(batch, n, kv_heads, d, generator=gen, dtype=torch.float64)}
    tensors["v"] = torch.randn(batch, n, kv_heads, d, generator=gen, dtype=torch.float64)
    if name == "diff_threshold":
        tensors["q2"] = unit(gen, batch, n, heads, d)
        tensors["k2"] = unit(gen, batch, n, kv_heads, d)
        tensors["lam"] = 0.2 + 0.6 * torch.rand(heads, generator=gen, dtype=torch.float64)
    if temperature:
        tensors["temperature"] = torch.rand(batch, n, generator=gen, dtype=torch.float64) * 1.5 + 0.25
    return tensors, torch.randn(batch, n, heads, d, generator=gen, dtype=torch.float64)


def leaves(tensors, dtype):
    """Leaf copies in dtype (lam and temperature stay fp32 below fp32, as a model keeps them)."""
    out = {}
    for key, t in tensors.items():
        target = torch.float32 if key in ("lam", "temperature") and dtype != torch.float64 else dtype
        out[key] = t.detach().to(device=DEVICE, dtype=target).requires_grad_()
    return out


def spec_of(name, **params):
    return attn.get_variant(name).make_spec(**params)


# ------------------------------------------------------------------------------ reference


def one_hot_values(batch, n, kv_heads):
    """v[b, j, h] = e_j (D = N): out[b, i, h, j] is then the (dropped) weight w'_ij itself."""
    return torch.eye(n, dtype=torch.float64)[None, :, None, :].expand(batch, n, kv_heads, n).contiguous()


def dropped_weights(out):
    """(B, N, H, N) one-hot-value output -> weights (B, H, N, N)."""
    return out.permute(0, 2, 1, 3)


def assert_dropout_statistics(w, w_dropped, visible, p):
    """Among visible (i, j): the dropped fraction is p (4 sigma), every kept weight is w / (1 - p), and
    the total weight is preserved in expectation (4 sigma of its Bernoulli variance sum w^2 p / (1 - p))."""
    w, w_dropped = w.double(), w_dropped.double()
    visible = visible.expand_as(w) & (w != 0)
    count = visible.sum().item()
    dropped = ((w_dropped == 0) & visible).sum().item()
    sigma = math.sqrt(count * p * (1 - p))
    assert abs(dropped - p * count) <= 4 * sigma + 1, (dropped, p * count, sigma)
    kept = (w_dropped != 0) & visible
    torch.testing.assert_close(w_dropped[kept], w[kept] / (1 - p), rtol=1e-5, atol=1e-7)
    assert (w_dropped[~visible] == 0).all()
    total_sigma = math.sqrt((w[visible] ** 2).sum().item() * p / (1 - p))
    assert abs(w_dropped.sum().item() - w.sum().item()) <= 4 * total_sigma, (w_dropped.sum(), w.sum(), total_sigma)


@pytest.mark.parametrize("name", ["softmax", "alsc", "threshold", "diff_threshold"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_reference_dropout_statistics(name, p):
    b, n, h, h_kv = 4, 48, 4, 2
    tensors, _ = make_tensors(name, b, n, h, h_kv, 16, seed=3)
    tensors["v"] = one_hot_values(b, n, h_kv)
    spec = spec_of(name, **({"beta": -1.0} if "threshold" in name else {}))
    mask = MaskSpec(causal=True)
    rest = {key: t for key, t in tensors.items() if key not in ("q", "k", "v")}
    torch.manual_seed(0)
    out = reference_attention(tensors["q"], tensors["k"], tensors["v"], spec, mask, **_by_keyword(rest), dropout_p=p)
    w = attention_weights(tensors["q"], tensors["k"], spec, mask, **_by_keyword(rest))
    assert_dropout_statistics(w, dropped_weights(out), dense_mask(mask, n, None)[:, None], p)


def _by_keyword(rest):
    """The reference's optional per-call tensors by keyword: the temperature and the family's `extra`."""
    return {"temperature": rest.get("temperature"),
            "extra": {key: rest[key] for key in ("q2", "k2", "lam") if key in rest}}


def test_reference_dropout_of_diff_threshold_drops_the_combined_weight():
    """One mask for both views: w' = m (w1 - lambda w2) / (1 - p), whatever the views' signs."""
    b, n, h, p = 2, 24, 2, 0.4
    tensors, _ = make_tensors("diff_threshold", b, n, h, 1, 16, seed=8)
    spec = spec_of("diff_threshold", beta=-1.0)
    mask = MaskSpec(causal=True)
    keep = torch.rand(b, h, n, n, generator=torch.Generator().manual_seed(1)) >= p
    extra = {key: tensors[key] for key in ("q2", "k2", "lam")}
    out = reference_attention(tensors["q"], tensors["k"], one_hot_values(b, n, 1), spec, mask, extra=extra,
                              dropout_p=p, dropout_mask=keep)
    w = attention_weights(tensors["q"], tensors["k"], spec, mask, extra=extra)
    torch.testing.assert_close(dropped_weights(out), torch.where(keep, w / (1 - p), torch.zeros_like(w)),
                               rtol=1e-12, atol=1e-14)


def test_reference_dropout_seed_reproduces_and_p0_is_the_plain_reference():
    tensors, _ = make_tensors("softmax", 2, 20, 2, 2, 16, seed=2)
    spec = spec_of("softmax")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    run = lambda **kw: attn.attention(q, k, v, spec, backend="reference", **kw)  # noqa: E731
    assert torch.equal(run(dropout_p=0.3, dropout_seed=5), run(dropout_p=0.3, dropout_seed=5))
    assert not torch.equal(run(dropout_p=0.3, dropout_seed=5), run(dropout_p=0.3, dropout_seed=6))
    assert torch.equal(run(dropout_p=0.3, dropout_seed=torch.tensor([5])), run(dropout_p=0.3, dropout_seed=5))
    torch.manual_seed(1)
    a = run(dropout_p=0.3)
    torch.manual_seed(1)
    assert torch.equal(a, run(dropout_p=0.3))
    assert torch.equal(run(dropout_p=0.0), run())


def test_softmax_backward_row_term_with_dropout_is_do_dot_out():
    """The kernels' delta_i = dO_i . O_i equals sum_j P_ij dP_ij with dP = (dO V^T) m / (1 - p), and
    dS = P (dP - delta) is the autograd gradient of the scores through softmax and dropout."""
    gen = torch.Generator().manual_seed(0)
    n, d, p = 12, 8, 0.35
    s = torch.randn(n, n, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    do = torch.randn(n, d, generator=gen, dtype=torch.float64)
    keep = torch.rand(n, n, generator=gen) >= p
    probs = torch.softmax(s, dim=-1)
    out = (probs * keep / (1 - p)) @ v
    out.backward(do)
    dp = (do @ v.T) * keep / (1 - p)
    delta = (probs * dp).sum(-1)
    torch.testing.assert_close(delta, (do * out).sum(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.grad, probs * (dp - delta[:, None]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, "0.1", True, None])
def test_dropout_p_outside_0_1_is_named(bad):
    tensors, _ = make_tensors("softmax", 1, 4, 1, 1, 16, seed=0)
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        attn.attention(tensors["q"], tensors["k"], tensors["v"], spec_of("softmax"), backend="reference",
                       dropout_p=bad)


@pytest.mark.parametrize("seed", [torch.tensor([1.5]), torch.tensor([1, 2]), -1, 2.0])
def test_bad_dropout_seed_is_named(seed):
    tensors, _ = make_tensors("softmax", 1, 4, 1, 1, 16, seed=0)
    q, k, v = (tensors[key].to(DEVICE, torch.float32) for key in ("q", "k", "v"))
    seed = seed.to(DEVICE) if isinstance(seed, torch.Tensor) else seed
    with pytest.raises(ValueError, match="dropout_seed must be"):
        attn.attention(q, k, v, spec_of("softmax"), backend="triton", dropout_p=0.2, dropout_seed=seed)


# --------------------------------------------------------------------------------- kernels


def test_kernel_keep_mask_statistics_and_independence():
    b, h, n, p = 2, 3, 70, 0.25
    keep = keep_mask(torch.tensor([99], device=DEVICE), b, h, n, p)
    assert keep.shape == (b, h, n, n) and keep.dtype == torch.bool
    count = keep.numel()
    assert abs((~keep).sum().item() - p * count) <= 4 * math.sqrt(count * p * (1 - p))
    flat = keep.reshape(b * h, n * n).float()
    # masks of different (batch, head) pairs and of transposed (i, j) are not copies of each other
    assert all(not torch.equal(flat[0], flat[i]) for i in range(1, b * h))
    assert not torch.equal(keep[0, 0], keep[0, 0].T)
    assert torch.equal(keep, keep_mask(99, b, h, n, p, device=DEVICE))
    assert not torch.equal(keep, keep_mask(100, b, h, n, p, device=DEVICE))


FUSED = {"softmax": sf.fused_attention, "threshold": tf.fused_attention, "sigmoid": sg.fused_attention}


def family(name):
    return attn.get_variant(name).family


def call(fn, spec, mask, seg, **kw):
    def run(q, k, v, temperature=None, **extra):
        return fn(q, k, v, spec, mask, seg, temperature, extra=extra, **kw)
    return run


def check_kernel_against_reference(name, spec, mask, seg, tensors, dout, dtype, p, seed):
    b, n, h = tensors["q"].shape[:3]
    seed, seg = seed.to(DEVICE), None if seg is None else seg.to(DEVICE)
    keep = keep_mask(seed, b, h, n, p)
    reference = call(reference_attention, spec, mask, seg, dropout_p=p, dropout_mask=keep)
    ref64 = outputs_and_grads(reference, leaves(tensors, torch.float64), dout)
    same = outputs_and_grads(reference, leaves(tensors, dtype), dout)
    got = outputs_and_grads(call(FUSED[family(name)], spec, mask, seg, dropout_p=p, dropout_seed=seed),
                            leaves(tensors, dtype), dout)
    assert set(got) == set(ref64) and "dv" in got
    for key in ref64:
        assert got[key].shape == ref64[key].shape and got[key].dtype == same[key].dtype, key
        allowance = FLOOR[dtype] * max(1.0, ref64[key].abs().max().item())
        assert_within_reference_error(key, got[key], same[key], ref64[key], floor=allowance)
    return got


# (variant, params, mask, segment ids, n, heads, kv_heads, d, temperature, dtype, p)
KERNEL_CASES = [
    ("softmax", {}, "causal", False, 17, 2, 1, 16, False, torch.float32, 0.3),
    ("softcap_tanh", {"cap": 2.0}, "window", False, 45, 2, 2, 16, True, torch.float32, 0.5),
    ("alsc", {"cap": 2.0}, "causal", True, 29, 4, 1, 16, True, torch.float32, 0.2),
    ("softcap_softsign", {"cap": 2.0}, "full", False, 1, 2, 2, 16, False, torch.float32, 0.3),
    ("softmax", {}, "full", True, 40, 2, 2, 32, False, torch.float32, 0.1),
    ("softmax", {}, "window", False, 37, 2, 1, 16, True, torch.float16, 0.3),
    # long enough that a key block holds only candidates (the ranker's own-key path in every kernel)
    ("softcap_tanh", {"cap": 2.0}, "full", True, 200, 2, 1, 16, True, torch.float32, 0.3),
    ("softmax", {}, "causal", True, 200, 4, 2, 16, False, torch.float32, 0.2),
    ("threshold", {"beta": 0.5, "power": 2.0}, "causal", False, 17, 2, 1, 16, False, torch.float32, 0.3),
    ("threshold", {"beta": -1.0, "power": 1.0}, "window", False, 45, 4, 2, 16, False, torch.float32, 0.5),
    ("threshold", {"beta": 0.5, "power": 1.5}, "full", True, 33, 2, 2, 16, False, torch.float32, 0.2),
    ("threshold", {"beta": -1.0, "power": 2.0}, "causal", False, 29, 2, 1, 16, False, torch.float16, 0.3),
    ("diff_threshold", {"beta": 0.5, "power": 2.0}, "causal", False, 17, 2, 1, 16, False, torch.float32, 0.3),
    ("diff_threshold", {"beta": -1.0, "power": 1.5}, "window", False, 41, 4, 2, 16, False, torch.float32, 0.4),
    ("diff_threshold", {"beta": -1.0, "power": 1.0}, "causal", True, 1, 2, 2, 16, False, torch.float32, 0.3),
    ("diff_threshold", {"beta": -1.0, "power": 2.0}, "full", False, 23, 2, 1, 16, False, torch.float16, 0.2),
    ("sigmoid", {}, "causal", True, 31, 2, 1, 16, False, torch.float32, 0.3),
    ("sigmoid", {"bias": -1.0}, "window", False, 45, 4, 2, 16, False, torch.float32, 0.5),
    ("sigmoid", {}, "full", False, 23, 2, 2, 16, False, torch.float16, 0.2),
]
if DEVICE.type == "cuda":  # the interpreter mishandles bf16: checked on the GPU only
    KERNEL_CASES += [case[:9] + (torch.bfloat16,) + case[10:] for case in KERNEL_CASES if case[9] == torch.float32]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[
    f"{c[0]}-{c[2]}{'-seg' if c[3] else ''}-N{c[4]}-H{c[5]}/{c[6]}-D{c[7]}{'-temp' if c[8] else ''}-"
    f"{str(c[9])[6:]}-p{c[10]}" for c in KERNEL_CASES])
def test_kernel_matches_reference_with_the_kernel_mask(case, nan_poison):
    name, params, mask, with_seg, n, heads, kv_heads, d, temp, dtype, p = case
    batch = 2
    tensors, dout = make_tensors(name, batch, n, heads, kv_heads, d, seed=n + heads, temperature=temp)
    seg = random_segment_ids(batch, n, torch.Generator().manual_seed(n)) if with_seg else None
    seed = torch.tensor([1000 + n])
    got = check_kernel_against_reference(name, spec_of(name, **params), MASKS[mask], seg, tensors, dout, dtype,
                                         p, seed)
    if name == "diff_threshold":
        assert {"dq2", "dk2", "dlam"} <= set(got)


def fused_outputs(name, spec, mask, tensors, dout, dtype, **kw):
    return outputs_and_grads(call(FUSED[family(name)], spec, mask, None, **kw), leaves(tensors, dtype), dout)


@pytest.mark.parametrize("name", ["softcap_tanh", "diff_threshold"])
def test_kernel_p0_is_bitwise_the_kernel_without_dropout(name):
    tensors, dout = make_tensors(name, 2, 37, 2, 1, 16, seed=4, temperature=name == "softcap_tanh")
    spec = spec_of(name, **({"cap": 2.0} if name == "softcap_tanh" else {"beta": 0.5}))
    plain = fused_outputs(name, spec, MASKS["causal"], tensors, dout, torch.float32)
    zero = fused_outputs(name, spec, MASKS["causal"], tensors, dout, torch.float32, dropout_p=0.0,
                         dropout_seed=torch.tensor([3], device=DEVICE))
    assert all(torch.equal(plain[key], zero[key]) for key in plain)


@pytest.mark.parametrize("name", ["softmax", "threshold", "sigmoid"])
def test_kernel_same_seed_same_result_other_seed_other_result(name):
    tensors, dout = make_tensors(name, 1, 33, 2, 2, 16, seed=6)
    spec = spec_of(name, **({"beta": -1.0} if name == "threshold" else {}))
    run = lambda seed: fused_outputs(name, spec, MASKS["causal"], tensors, dout, torch.float32,  # noqa: E731
                                     dropout_p=0.3, dropout_seed=torch.tensor([seed], device=DEVICE))
    a, b, c = run(11), run(11), run(12)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert all(not torch.equal(a[key], c[key]) for key in a)


@pytest.mark.parametrize("name", ["softmax", "threshold", "diff_threshold", "sigmoid"])
def test_kernel_dropout_statistics(name):
    """The kernels' own dropped weights, read through one-hot values: fraction p dropped, kept ones
    rescaled by 1 / (1 - p), total weight preserved in expectation."""
    b, n, h, h_kv, p = 2, 32, 2, 1, 0.3
    tensors, _ = make_tensors(name, b, n, h, h_kv, n, seed=9)  # D = N for the one-hot values
    spec = spec_of(name, **({"beta": -1.0} if "threshold" in name else {}))
    mask = MaskSpec(causal=True)
    extra = {key: tensors[key].to(DEVICE, torch.float32) for key in ("q2", "k2", "lam") if key in tensors}
    v = one_hot_values(b, n, h_kv).to(DEVICE, torch.float32)
    out = attn.attention(tensors["q"].to(DEVICE, torch.float32), tensors["k"].to(DEVICE, torch.float32), v, spec,
                         causal=True, backend="triton", dropout_p=p, dropout_seed=123, extra=extra).cpu()
    w = attention_weights(tensors["q"], tensors["k"], spec, mask, extra={key: tensors[key] for key in extra})
    assert_dropout_statistics(w, dropped_weights(out), dense_mask(mask, n, None)[:, None], p)



@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch.compile and CUDA graphs of the kernels: GPU only")
@pytest.mark.parametrize("mode", ["eager", "compile", "cuda_graphs"])
@pytest.mark.parametrize("name", ["softmax", "softcap_tanh", "threshold", "diff_threshold", "sigmoid"])
def test_kernel_dropout_is_fresh_per_call_and_unbiased_eager_compiled_and_graph_replayed(name, mode, monkeypatch):
    """Eager, under torch.compile and under CUDA graphs (mode="reduce-overhead"), bf16: 3 calls on the
    same inputs give 3 different outputs and gradients, and the mean of 200 calls' outputs is the
    output without dropout within 5 standard errors (a mask frozen by compilation or graph capture
    fails both)."""
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    torch.compiler.reset()
    p, samples, (b, n, h, d) = 0.3, 200, (2, 128, 4, 64)
    spec = spec_of(name, **({"beta": -1.0} if "threshold" in name else {}))
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    x = {"q": rand(b, n, h, d), "k": rand(b, n, h, d), "v": rand(b, n, h, d)}
    if "threshold" in name:
        x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    if name == "diff_threshold":
        x["q2"], x["k2"] = F.normalize(rand(b, n, h, d), dim=-1), F.normalize(rand(b, n, h, d), dim=-1)
        x["lam"] = torch.full((h,), 0.3, device=DEVICE)
    x = {key: t.to(torch.bfloat16 if key != "lam" else torch.float32).requires_grad_() for key, t in x.items()}

    def attend(q, k, v, dropout_p, **extra):
        return attn.attention(q, k, v, spec, causal=True, dropout_p=dropout_p, extra=extra)

    def forward(**tensors):
        return attend(dropout_p=p, **tensors)

    forward = {"eager": forward, "compile": torch.compile(forward, fullgraph=True),
               "cuda_graphs": torch.compile(forward, fullgraph=True, mode="reduce-overhead")}[mode]

    def fn(**tensors):  # the compiled forward and its compiled backward (torch.compile's AOT autograd)
        out = forward(**tensors)
        grad_q, = torch.autograd.grad(out.float().square().sum(), [tensors["q"]])
        return out.detach().float(), grad_q.float()

    calls = []
    for _ in range(3):
        out, grad = fn(**x)
        calls.append((out.clone(), grad.clone()))  # graph outputs are overwritten by the next replay
    assert all(not torch.equal(calls[i][j], calls[i + 1][j]) for i in range(2) for j in range(2))
    with torch.no_grad():
        plain = attend(dropout_p=0.0, **{key: t.detach() for key, t in x.items()}).float()
    total, square = torch.zeros_like(plain), torch.zeros_like(plain)
    for _ in range(samples):
        out = fn(**x)[0]
        total += out
        square += out.square()
    mean = total / samples
    stderr = ((square / samples - mean.square()).clamp_min(0) / samples).sqrt()
    # the bf16 rounding of one output (about 2^-8 relative) also separates the mean from plain
    z = ((mean - plain).abs() / (stderr + plain.abs() * 2**-8 + 1e-6)).flatten()
    assert torch.quantile(z, 0.99) < 5.0, f"mean of {samples} calls vs no dropout: z99 {torch.quantile(z, 0.99):.2f}"

def test_public_attention_draws_kernel_seeds_from_torch_generator():
    tensors, _ = make_tensors("softmax", 1, 20, 2, 2, 16, seed=1)
    q, k, v = (tensors[key].to(DEVICE, torch.float32) for key in ("q", "k", "v"))
    spec = spec_of("softmax")
    run = lambda **kw: attn.attention(q, k, v, spec, backend="triton", **kw)  # noqa: E731
    torch.manual_seed(7)
    a = run(dropout_p=0.4)
    torch.manual_seed(7)
    assert torch.equal(a, run(dropout_p=0.4))
    assert not torch.equal(a, run(dropout_p=0.4))
    torch.manual_seed(7)
    seed = draw_seed(q.device)
    assert torch.equal(a, run(dropout_p=0.4, dropout_seed=seed))
    assert torch.equal(run(dropout_p=0.4, dropout_seed=int(seed)), a)


def test_fused_dropout_without_a_seed_is_refused():
    tensors, _ = make_tensors("softmax", 1, 8, 1, 1, 16, seed=1)
    q, k, v = (tensors[key].float() for key in ("q", "k", "v"))
    with pytest.raises(ValueError, match="needs dropout_seed"):
        sf.fused_attention(q, k, v, spec_of("softmax"), MASKS["causal"], dropout_p=0.1)
    with pytest.raises(ValueError, match="needs dropout_seed"):
        tf.fused_attention(q, k, v, spec_of("threshold"), MASKS["causal"], dropout_p=0.1)


def test_opcheck_with_dropout():
    tensors, dout = make_tensors("diff_threshold", 1, 9, 2, 1, 16, seed=2)
    x = {key: t.to(DEVICE, torch.float32) for key, t in tensors.items()}
    dout = dout.to(DEVICE, torch.float32)
    seed = torch.tensor([17], device=DEVICE)
    args = (x["q"], x["k"], x["v"], None, None, 0, 30.0, 0.5, 0.25, True, 0, 0.3, seed)
    opcheck_launcher(sf.softmax_family_fwd, args)
    out, lse = sf.softmax_family_fwd(*args)
    opcheck_launcher(sf.softmax_family_bwd, (dout.float(), x["q"], x["k"], x["v"], out, lse, None, None,
                                                  False, 0, 30.0, 0.5, 0.25, True, 0, 0.3, seed))
    scalars = (0.5, 2.0, True, 0, 0.3, seed)
    opcheck_launcher(tf.threshold_attention_op, (x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], None,
                                                      *scalars))
    opcheck_launcher(tf.diff_threshold_attention_backward_op,
                          (dout.float(), x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], None, *scalars))
