"""model.attn_dropout (attention weights, training mode only) and model.embed_dropout (after the
token embedding): defaults, train / eval behaviour on both backends, compiled tracing, config errors."""

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from models.gpt import GPT, GPTConfig  # noqa: E402
from models.lit import gpt_config_from_dict  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"


def tiny(name="softmax", backend="reference", **model):
    torch.manual_seed(0)
    return GPT(gpt_config_from_dict({"vocab_size": 64, "context": 16, "n_layer": 2, "n_head": 2, "n_kv_head": 1,
                                     "d_model": 32, **model, "attn": {"name": name, "backend": backend}}))


IDX = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_defaults_are_zero_in_the_dataclass_and_every_model_config():
    assert GPTConfig().attn_dropout == 0.0 and GPTConfig().embed_dropout == 0.0
    files = sorted(CONFIGS.glob("*.yaml"))
    assert files
    for path in files:
        cfg = yaml.safe_load(path.read_text())
        assert cfg["attn_dropout"] == 0.0 and cfg["embed_dropout"] == 0.0, path.name


@pytest.mark.parametrize("field", ["attn_dropout", "embed_dropout", "dropout"])
@pytest.mark.parametrize("bad", [1.0, -0.1, 2, "0.1", True, None])
def test_dropout_fields_outside_0_1_are_named(field, bad):
    with pytest.raises(ValueError, match=rf"model\.{field} must be a float in \[0, 1\), got"):
        tiny(**{field: bad})


@pytest.mark.parametrize("name,backend", [("softmax", "reference"), ("threshold", "reference"),
                                          ("softcap_tanh", "triton"), ("diff_threshold", "triton")])
def test_attn_dropout_acts_in_training_mode_only(name, backend):
    plain, dropped = tiny(name, backend), tiny(name, backend, attn_dropout=0.4)
    dropped.load_state_dict(plain.state_dict())
    plain.eval()
    dropped.eval()
    with torch.no_grad():
        reference = plain(IDX)
        assert torch.equal(dropped(IDX), reference)  # eval: no dropout, bitwise
        dropped.train()
        torch.manual_seed(1)
        a = dropped(IDX)
        torch.manual_seed(1)
        b = dropped(IDX)
        c = dropped(IDX)
        plain.train()
        assert torch.equal(plain(IDX), reference)  # p = 0 in training mode is no dropout
    assert torch.equal(a, b)  # reproducible from torch's seed
    assert not torch.equal(a, c) and not torch.allclose(a, reference, atol=1e-4)


def test_attn_dropout_trains_through_the_kernels():
    model = tiny("softmax", "triton", attn_dropout=0.2)
    model.train()
    loss = model(IDX, targets=IDX.roll(-1, dims=1))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_embed_dropout_drops_embeddings_in_training_mode_only():
    model = tiny(embed_dropout=0.5)
    seen = []
    model.embed_drop.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    model.train()
    model(IDX)
    x, y = seen[-1]
    dropped = (y == 0) & (x != 0)
    assert 0.4 < dropped.float().mean().item() < 0.6
    torch.testing.assert_close(y[~dropped], 2.0 * x[~dropped])
    model.eval()
    model(IDX)
    x, y = seen[-1]
    assert torch.equal(x, y)
    assert model.state_dict().keys() == tiny().state_dict().keys()


@pytest.mark.parametrize("name", ["softmax", "diff_threshold"])
def test_compiled_model_with_attn_dropout_traces_in_one_graph(name):
    """fullgraph=True through the custom ops with the seed drawn in the graph; the compiled model is
    reproducible from torch's seed and, in eval mode, equals the eager model."""
    torch._dynamo.reset()
    model = tiny(name, "triton", attn_dropout=0.3)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    model.train()
    torch.manual_seed(3)
    a = compiled(IDX)
    torch.manual_seed(3)
    b = compiled(IDX)
    c = compiled(IDX)
    a.sum().backward()
    assert counter.frame_count == 1
    assert torch.equal(a, b) and not torch.equal(a, c)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(IDX), model(IDX), rtol=1e-5, atol=1e-6)
