"""The GPT: every variant trains on CPU, parameter/FLOP accounting, generation, config errors."""

import math

import pytest
import torch

import attn
from models.gpt import GPT, AttnConfig, GPTConfig
from models.lit import gpt_config_from_dict

VARIANT_PARAMS = {
    "softmax": {},
    "softcap_tanh": {"cap": 5.0},
    "softcap_softsign": {"cap": 5.0},
    "alsc": {"cap": 5.0, "knee": 0.5},
    "threshold": {"beta": 1.0, "power": 2.0},
    "diff_threshold": {"beta": 1.0, "power": 2.0},
    "sigmoid": {},
}


def tiny(name, **kw):
    return GPTConfig(vocab_size=37, context=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                     attn=AttnConfig(name=name, backend="reference", params=VARIANT_PARAMS[name], **kw))


def test_every_registered_variant_has_a_test_case():
    assert set(VARIANT_PARAMS) == set(attn.variant_names())


@pytest.mark.parametrize("name", list(VARIANT_PARAMS))
def test_variant_overfits_a_repeated_batch(name):
    torch.manual_seed(0)
    model = GPT(tiny(name))
    x = torch.randint(0, 37, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("name", ["softmax", "diff_threshold"])
def test_forward_with_targets_returns_the_summed_cross_entropy(name):
    torch.manual_seed(0)
    model = GPT(tiny(name))
    x, y = torch.randint(0, 37, (3, 16)), torch.randint(0, 37, (3, 16))
    loss_sum = model(x, targets=y)
    expected = torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 37), y.reshape(-1), reduction="sum")
    assert loss_sum.dtype == torch.float32 and loss_sum.shape == ()
    torch.testing.assert_close(loss_sum, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 logits, fp32 loss
        assert model(x, targets=y).dtype == torch.float32


def test_rope_tables_match_the_rotation_within_and_beyond_the_context():
    from models.gpt import RoPE

    rope = RoPE(head_dim=8, base=10000.0, max_len=4)
    x = torch.randn(2, 6, 3, 8)
    pos = torch.arange(6, dtype=torch.float32)[:, None] * rope.inv_freq  # (N, D/2)
    cos, sin = pos.cos()[None, :, None], pos.sin()[None, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    torch.testing.assert_close(rope(x), expected)  # 6 > max_len: computed on the fly
    torch.testing.assert_close(rope(x[:, :4]), expected[:, :4])  # from the tables
    assert "cos_table" not in rope.state_dict(), "tables are derived, not checkpointed"


def test_rope_base_sets_the_rotation_frequencies():
    """inv_freq_i = base^(-2i / D), from the base RoPE is given and from model.rope_base in the GPT;
    at position p the pair (x_i, x_{i + D/2}) turns by the angle p * inv_freq_i."""
    from models.gpt import RoPE

    rope = RoPE(head_dim=8, base=100.0, max_len=4)
    frequencies = [1.0, 100.0 ** -0.25, 0.1, 100.0 ** -0.75]
    torch.testing.assert_close(rope.inv_freq, torch.tensor(frequencies))
    x = torch.zeros(1, 4, 1, 8)
    x[..., :4] = 1.0  # each pair starts at (1, 0)
    angles = [3 * f for f in frequencies]
    want = torch.tensor([math.cos(a) for a in angles] + [math.sin(a) for a in angles])
    torch.testing.assert_close(rope(x)[0, 3, 0], want)
    model = GPT(GPTConfig(vocab_size=16, context=8, n_layer=2, n_head=2, n_kv_head=2, d_model=16, rope_base=500.0,
                          attn=AttnConfig(backend="reference")))
    for block in model.blocks:
        torch.testing.assert_close(block.attn.rope.inv_freq, torch.tensor([500.0 ** (-i / 8) for i in (0, 2, 4, 6)]))


def test_differential_lambda_is_learned():
    torch.manual_seed(0)
    for mode in ("reparam", "clamp", "scalar_clamp"):
        model = GPT(tiny("diff_threshold", lambda_mode=mode))
        x = torch.randint(0, 37, (2, 16))
        model(x).sum().backward()
        layer = model.blocks[1].attn.extras  # the family's layer module (attn/families/differential.py)
        param = {"reparam": "lambda_vectors", "clamp": "lambda_raw", "scalar_clamp": "lambda_scalar"}[mode]
        grad = getattr(layer, param).grad
        assert grad is not None and grad.abs().sum() > 0
        lam = layer.per_head_lambda()
        assert lam.shape == (4,)
        if mode == "reparam":  # lambda_init = 0.8 - 0.6 exp(-0.3 * layer)
            assert abs(layer.lambda_init - (0.8 - 0.6 * torch.exp(torch.tensor(-0.3)).item())) < 1e-6
        if mode == "scalar_clamp":  # the official TDA parametrization: one scalar per layer, init 0.5, in [0, 1]
            assert layer.lambda_scalar.shape == () and torch.equal(lam.detach(), torch.full((4,), 0.5))
            with torch.no_grad():
                layer.lambda_scalar.fill_(1.7)
            assert torch.equal(layer.per_head_lambda(), torch.ones(4))
            with torch.no_grad():
                layer.lambda_scalar.fill_(-0.2)
            assert torch.equal(layer.per_head_lambda(), torch.zeros(4))


def test_reparam_lambda_is_the_differential_transformers_formula():
    """lambda_h = exp(lq1_h . lk1_h) - exp(lq2_h . lk2_h) + lambda_init, the vectors in lambda_vectors' order
    (lq1, lk1, lq2, lk2), in float64 against the layer's fp32 value."""
    torch.manual_seed(0)
    layer = GPT(tiny("diff_threshold", lambda_mode="reparam")).blocks[1].attn.extras
    with torch.no_grad():
        layer.lambda_vectors.normal_(0, 0.7)
    lq1, lk1, lq2, lk2 = layer.lambda_vectors.detach().double()
    expected = torch.exp((lq1 * lk1).sum(-1)) - torch.exp((lq2 * lk2).sum(-1)) + layer.lambda_init
    torch.testing.assert_close(layer.per_head_lambda().double(), expected, rtol=1e-5, atol=1e-6)


def test_head_norm_eps_is_configurable_and_runs_in_fp32():
    """out_norm_eps sets the per-head RMSNorm's eps (default 1e-5, not the dtype's machine
    epsilon); the norm runs in fp32 whatever the attention output's dtype."""
    from models.gpt import Attention, GPTConfig, AttnConfig

    cfg = GPTConfig(vocab_size=37, context=16, n_layer=1, n_head=2, n_kv_head=2, d_model=16,
                    attn=AttnConfig(name="threshold", backend="reference"))
    assert Attention(cfg, 0).head_norm.eps == 1e-5
    cfg.attn.out_norm_eps = 1e-3
    layer = Attention(cfg, 0)
    assert layer.head_norm.eps == 1e-3
    tiny_row = torch.full((1, 1, 1, 8), 1e-4)  # an RMS of 1e-4: eps 1e-3 keeps it small, eps 1e-7 would not
    assert layer.head_norm(tiny_row).abs().max() < 0.01
    with pytest.raises(ValueError, match=r"attn.out_norm_eps must be a number > 0, got 0"):
        GPT(GPTConfig(vocab_size=37, context=16, n_layer=1, n_head=2, n_kv_head=2, d_model=16,
                      attn=AttnConfig(name="threshold", out_norm_eps=0)))


def test_variants_default_qk_norm_and_head_norm_from_the_registry():
    for name in attn.variant_names():
        layer = GPT(tiny(name)).blocks[0].attn
        variant = attn.get_variant(name)
        threshold = variant.family == "threshold"
        assert layer.qk_norm == variant.qk_norm == ("l2" if threshold else "rms" if variant.family == "sigmoid" else "none")
        assert (layer.head_norm is not None) == variant.out_norm == (threshold or variant.family == "sigmoid")


def test_param_count_tied_embedding_and_flops():
    model = GPT(tiny("softmax"))
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))
    cfg = model.cfg
    # 6 N + head matmul + attention (q.k and w.v, forward + backward)
    expected = 6 * model.num_params(non_embedding=True) + 6 * cfg.d_model * cfg.vocab_size
    expected += 6 * cfg.n_layer * 2 * cfg.context * cfg.n_head * cfg.head_dim
    assert model.flops_per_token() == expected


def test_residual_projections_use_scaled_init():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layer=8, d_model=256, n_head=4, n_kv_head=4,
                    attn=AttnConfig(backend="reference"))
    model = GPT(cfg)
    std_proj = model.blocks[0].attn.proj.weight.std().item()
    std_qkv = model.blocks[0].attn.qkv.weight.std().item()
    assert abs(std_qkv - 0.02) < 0.002
    assert abs(std_proj - 0.02 / 4) < 0.001  # 1 / sqrt(2 * 8)


def test_generate_extends_and_respects_greedy():
    torch.manual_seed(0)
    model = GPT(tiny("alsc")).eval()
    prompt = torch.randint(0, 37, (2, 5))
    out = model.generate(prompt, max_new_tokens=20, temperature=0.0)
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)
    again = model.generate(prompt, max_new_tokens=20, temperature=0.0)
    assert torch.equal(out, again)
    # greedy token equals argmax of the model's logits at the last position
    assert torch.equal(out[:, 5], model(prompt)[:, -1].argmax(-1))
    sampled = model.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=5)
    assert sampled.shape == (2, 8)


def test_causality_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    for name in attn.variant_names():
        model = GPT(tiny(name)).eval()
        x = torch.randint(0, 37, (1, 12))
        y = x.clone()
        y[0, 8:] = (y[0, 8:] + 1) % 37
        torch.testing.assert_close(model(x)[:, :8], model(y)[:, :8])


@pytest.mark.parametrize("change,match", [
    (dict(d_model=30), "must divide model.d_model"),
    (dict(n_kv_head=3), "divisible by model.n_kv_head"),
    (dict(mlp="relu"), "model.mlp must be one of"),
    (dict(attn=AttnConfig(name="flash")), "attn.name must be one of"),
    (dict(attn=AttnConfig(name="softcap_tanh", params={"cap": 0.0})), "attn.cap"),
    (dict(attn=AttnConfig(name="alsc", params={"knee": 1.0})), "kappa"),
    (dict(attn=AttnConfig(name="threshold", params={"power": -1.0})), "attn.power"),
    (dict(attn=AttnConfig(name="threshold", params={"cap": 3.0})), "does not take"),
    (dict(attn=AttnConfig(backend="cuda")), "attn.backend must be one of"),
    (dict(attn=AttnConfig(qk_norm="layer")), "attn.qk_norm must be one of"),
])
def test_model_config_errors_name_the_field(change, match):
    base = dict(vocab_size=37, context=16, n_layer=1, n_head=4, n_kv_head=2, d_model=32)
    with pytest.raises(ValueError, match=match):
        GPT(GPTConfig(**{**base, **change}))


def test_sdpa_backend_matches_reference_and_refuses_other_variants():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 33, 4, 16), torch.randn(2, 33, 2, 16), torch.randn(2, 33, 2, 16)
    spec = attn.get_variant("softmax").make_spec()
    for causal in (True, False):
        torch.testing.assert_close(
            attn.attention(q, k, v, spec, causal=causal, backend="sdpa"),
            attn.attention(q, k, v, spec, causal=causal, backend="reference"),
        )
    with pytest.raises(ValueError, match="backend='sdpa' serves only attn=softmax"):
        attn.attention(q, k, v, attn.get_variant("alsc").make_spec(), backend="sdpa")
    with pytest.raises(ValueError, match="no window"):
        attn.attention(q, k, v, spec, window=4, backend="sdpa")


@pytest.mark.parametrize("name", list(VARIANT_PARAMS))
def test_attention_inputs_share_one_dtype_under_autocast(name, monkeypatch):
    """Norms run in fp32 under autocast; the kernels need q, k, v (and views) in one dtype."""
    seen = []
    real = attn.AttentionCall.__call__

    def spy(self, q, k, v, **kw):
        seen.append({t.dtype for t in (q, k, v, *(kw.get("extra") or {}).values())})
        return real(self, q, k, v, **kw)

    monkeypatch.setattr(attn.AttentionCall, "__call__", spy)
    model = GPT(tiny(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 37, (2, 16)))
    assert seen and all(s == {torch.bfloat16} for s in seen), seen


def test_the_rms_qk_norm_of_all_heads_at_once_is_each_kinds_own_rmsnorm():
    """split_heads normalizes every q and k head in one norm and scales each by its kind's weight: the
    same as q_norm on the q heads and k_norm on the k heads (float64, random weights, GQA)."""
    torch.manual_seed(0)
    model = GPT(tiny("sigmoid")).double()  # 4 q heads, 2 kv heads
    layer = model.blocks[0].attn
    assert layer.qk_norm == "rms"
    for norm in (layer.q_norm, layer.k_norm):
        norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, model.cfg.d_model, dtype=torch.float64)
    qs, ks, _ = layer.split_heads(x)
    qkv = layer.qkv(x)
    q_dim, kv_dim, d = layer.n_head * layer.head_dim, layer.n_kv_head * layer.head_dim, layer.head_dim
    q = qkv[..., :q_dim].view(2, 7, layer.n_head, d)
    k = qkv[..., q_dim:q_dim + kv_dim].view(2, 7, layer.n_kv_head, d)
    torch.testing.assert_close(qs[0], layer.rotate(layer.q_norm(q), 0), rtol=0, atol=1e-12)
    torch.testing.assert_close(ks[0], layer.rotate(layer.k_norm(k), 0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("name", attn.variant_names())
def test_the_gpt_on_the_fused_kernels_matches_the_gpt_on_the_reference(name, segments):
    """The whole model, not only the kernel: the same weights on backend triton (the interpreter
    here) and on the reference, fp32 against the float64 reference model by the DESIGN.md rule
    (error <= 2x the fp32 reference model's + floor), for the logits, the loss and every
    parameter's gradient. With segment ids the model checks them once and hands the kernels
    their bounds."""
    from attn.testing import error_ratio, random_segment_ids

    cfg = {"vocab_size": 40, "context": 24, "n_layer": 2, "n_head": 2, "n_kv_head": 1, "d_model": 32,
           "attn": {"name": name, "params": {"cap": 5.0} if name in ("softcap_tanh", "softcap_softsign", "alsc") else {},
                    "window": 9 if name == "alsc" else None}}
    torch.manual_seed(0)
    models = {}
    for key, backend, dtype in (("ref64", "reference", torch.float64), ("ref32", "reference", torch.float32),
                                ("triton", "triton", torch.float32)):
        torch.manual_seed(0)
        m = GPT(gpt_config_from_dict({**cfg, "attn": {**cfg["attn"], "backend": backend}})).to(dtype)
        models[key] = m
    state = models["ref64"].state_dict()
    for m in models.values():
        m.load_state_dict({k: v.to(next(m.parameters()).dtype) for k, v in state.items()})
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 40, (3, 24), generator=gen)
    ids = random_segment_ids(3, 24, gen, min_history=6, max_history=12) if segments else None
    results = {}
    for key, m in models.items():
        logits = m(idx, segment_ids=ids)
        loss = m(idx, segment_ids=ids, targets=idx.roll(-1, dims=1))
        loss.backward()
        results[key] = [logits.detach(), loss.detach().reshape(1)] + [p.grad for p in m.parameters()]
    ratios = [error_ratio(t, r32, r64.double(), floor=1e-6 * max(1.0, r64.abs().max().item()))
              for t, r32, r64 in zip(results["triton"], results["ref32"], results["ref64"])]
    assert torch.isfinite(results["triton"][0]).all()
    assert max(ratios) <= 1.0, ratios
