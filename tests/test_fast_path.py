"""The model's fast attention path and the kernel runtime's launch caching (issue: host work per call).

- `attn.AttentionCall` (no per-call validation, segment bounds given once per batch) computes
  exactly what the validated public `attn.attention` computes, on every backend this machine has;
- the GPT checks a batch's segment ids and builds their kernel bounds once, not once per layer;
- a function calling `attn.attention` compiles with fullgraph=True on its very first call;
- the runtime's direct launches: a launch reuses a compiled kernel only for the same
  specialization (dtypes, pointer alignment, integer values), and passes the arguments in the
  kernel's signature order;
- `train.cuda_graphs` refuses the settings it cannot serve.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.kernels import runtime
from attn.testing import random_segment_ids
from models.gpt import GPT
from models.lit import LitGPT, gpt_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"softcap_tanh": {"cap": 5.0}, "softcap_softsign": {"cap": 5.0}, "alsc": {"cap": 5.0, "knee": 0.5}}


def _inputs(name: str, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    b, h, h_kv, d = 2, 4, 2, 16
    unit = name in ("threshold", "diff_threshold")

    def t(heads):
        x = torch.randn(b, n, heads, d, generator=gen)
        return F.normalize(x, dim=-1) if unit else x

    x = {"q": t(h), "k": t(h_kv), "v": t(h_kv)}
    if name == "diff_threshold":
        x.update(q2=t(h), k2=t(h_kv), lam=torch.rand(h, generator=gen))
    ids = random_segment_ids(b, n, gen, min_history=n // 4, max_history=n // 2)
    return x, ids, torch.randn(b, n, h, d, generator=gen)


def _outputs_and_grads(fn, x, dout):
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    out = fn(leaves)
    out.backward(dout)
    return [out.detach()] + [leaves[k].grad for k in sorted(leaves)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", attn.variant_names())
def test_attention_call_computes_what_the_public_attention_computes(name, backend):
    spec = attn.get_variant(name).make_spec(**PARAMS.get(name, {}))
    x, ids, dout = _inputs(name, 37, seed=len(name))
    call = attn.AttentionCall(spec, causal=True, window=20, backend=backend)
    bounds = attn.segment_bounds(ids)

    def public(t):
        extra = {k: v for k, v in t.items() if k not in ("q", "k", "v")}
        return attn.attention(t["q"], t["k"], t["v"], spec, causal=True, window=20, segment_ids=ids,
                              backend=backend, extra=extra)

    def fast(t):
        extra = {k: v for k, v in t.items() if k not in ("q", "k", "v")}
        return call(t["q"], t["k"], t["v"], segment_ids=ids, bounds=bounds, extra=extra)

    want, got = _outputs_and_grads(public, x, dout), _outputs_and_grads(fast, x, dout)
    assert torch.isfinite(want[0]).all() and want[0].abs().sum() > 0
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_attention_call_refuses_a_bad_configuration_at_construction():
    spec = attn.get_variant("softmax").make_spec()
    with pytest.raises(ValueError, match="attn.backend must be one of"):
        attn.AttentionCall(spec, backend="cuda")
    with pytest.raises(ValueError, match="spec must be a SoftmaxFamilySpec, ThresholdFamilySpec or SigmoidFamilySpec"):
        attn.AttentionCall("softmax")
    with pytest.raises(ValueError, match="window must be a positive int"):
        attn.AttentionCall(spec, window=0)


def test_the_model_checks_segment_ids_and_builds_bounds_once_per_batch(monkeypatch):
    """Not once per layer: the check syncs with the device, the bounds are a few kernels."""
    import attn.masks as masks

    calls = {"validate": 0, "bounds": 0}
    validate, bounds = masks.validate_segment_ids, attn.segment_bounds

    def counting_validate(*args):
        calls["validate"] += 1
        return validate(*args)

    def counting_bounds(ids):
        calls["bounds"] += 1
        return bounds(ids)

    monkeypatch.setattr(masks, "validate_segment_ids", counting_validate)
    monkeypatch.setattr(attn, "segment_bounds", counting_bounds)
    model = GPT(gpt_config_from_dict({"vocab_size": 32, "context": 24, "n_layer": 3, "n_head": 2, "n_kv_head": 2,
                                      "d_model": 16, "attn": {"name": "softmax", "backend": "reference"}}))
    ids = random_segment_ids(2, 24, torch.Generator().manual_seed(0), min_history=4, max_history=12)
    logits = model(torch.randint(0, 32, (2, 24)), segment_ids=ids)
    assert logits.shape == (2, 24, 32) and torch.isfinite(logits).all()
    assert calls == {"validate": 1, "bounds": 1}
    bad = ids.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match="segment_ids values must be in"):
        model(torch.randint(0, 32, (2, 24)), segment_ids=bad)


@pytest.mark.parametrize("name", ["softcap_tanh", "threshold"])
def test_a_function_calling_attention_compiles_fullgraph_on_its_first_call(name, tmp_path):
    """A fresh interpreter (no other test has loaded the kernels): no eager call comes first, and
    nothing but `import attn` happens before torch.compile traces the call."""
    script = f"""
import torch
import attn
from torch._dynamo.testing import CompileCounter
spec = attn.get_variant("{name}").make_spec()
counter = CompileCounter()
fn = torch.compile(lambda q, k, v: attn.attention(q, k, v, spec, backend="triton"), backend=counter, fullgraph=True)
q, k, v = (torch.nn.functional.normalize(torch.randn(1, 17, 2, 16), dim=-1).requires_grad_() for _ in range(3))
out = fn(q, k, v)
out.sum().backward()
want = attn.attention(q, k, v, spec, backend="reference")
torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
assert counter.frame_count == 1 and q.grad is not None, counter.frame_count
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


class _FakeCompiled:
    """What the runtime reads off Triton's compiled kernel; `run` records every direct launch."""

    def __init__(self, launches):
        self.function, self.packed_metadata = "function", "metadata"
        self.launches = launches

    def run(self, *args):
        self.launches.append(args)


class _FakeJit:
    """A @triton.jit stand-in: parameters A, B (pointers), n, s (scalars), K, BLOCK_M, BLOCK_N (constexprs)."""

    arg_names = ["A", "B", "n", "s", "K", "BLOCK_M", "BLOCK_N"]

    def __init__(self):
        self.jit_launches, self.direct_launches, self.plain_launches = [], [], []

    def __getitem__(self, grid):  # kernel[grid](...): Triton's ordinary launch
        return lambda *args, **options: self.plain_launches.append((args, grid, options))

    def run(self, *args, grid, warmup, **options):
        self.jit_launches.append((args, grid, options))
        return _FakeCompiled(self.direct_launches)


def test_direct_launches_reuse_a_compiled_kernel_only_for_its_own_specialization(monkeypatch):
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.delenv(runtime.DIRECT_ENV, raising=False)
    fn = _FakeJit()
    kernel = runtime.Kernel(fn, "fake")
    cfg = runtime.TileConfig(64, 32, 4, 2)
    buf = torch.zeros(64)
    a, b = buf[:16], buf[16:32]  # 16-byte aligned (offsets of 0 and 64 bytes)

    def launch(x, y, n, meta_k=3):
        kernel.run(cfg, (5, 6), (x, y), (n, 0.5), {"K": meta_k})

    launch(a, b, 100)  # first: through the JIT
    assert len(fn.jit_launches) == 1 and not fn.direct_launches
    args, grid, options = fn.jit_launches[0]
    assert args == (a, b, 100, 0.5) and grid == (5, 6)
    assert options == {"K": 3, "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    launch(b, a, 100)  # other pointers, same alignment and values: direct, in signature order
    assert len(fn.jit_launches) == 1 and len(fn.direct_launches) == 1
    grid0, grid1, grid2, stream, function, metadata, launch_metadata, enter, exit_, *kernel_args = fn.direct_launches[0]
    assert (grid0, grid1, grid2, stream, function, metadata) == (5, 6, 1, 1234, "function", "metadata")
    assert kernel_args[0] is b and kernel_args[1] is a and kernel_args[2:] == [100, 0.5, 3, 64, 32]
    for other in (lambda: launch(buf[1:17], b, 100),  # a pointer no longer 16-byte aligned
                  lambda: launch(a, b, 101),  # another integer value (Triton specializes on divisibility)
                  lambda: launch(a.double(), b, 100),  # another dtype
                  lambda: launch(a, b, 100, meta_k=4)):  # another constexpr
        jit_before = len(fn.jit_launches)
        other()
        assert len(fn.jit_launches) == jit_before + 1, "a different specialization must go through the JIT"
    monkeypatch.setenv(runtime.DIRECT_ENV, "0")  # the switch: every launch through Triton's own kernel[grid]
    direct_before = len(fn.direct_launches)
    launch(b, a, 100)
    assert len(fn.direct_launches) == direct_before and fn.plain_launches[-1][0] == (b, a, 100, 0.5)


def test_cuda_graphs_need_compile_and_no_gradient_accumulation():
    from hydra import compose, initialize_config_dir

    from training.config_checks import check_config

    def cfg(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            return compose("train", overrides=["paths.output_dir=/tmp/unused", "logger=csv", *overrides])

    check_config(cfg("train.compile=true", "train.cuda_graphs=true"))
    with pytest.raises(ValueError, match="train.cuda_graphs=true needs train.compile=true"):
        check_config(cfg("train.cuda_graphs=true"))
    with pytest.raises(ValueError, match="train.cuda_graphs=true needs train.grad_accum=1"):
        check_config(cfg("train.compile=true", "train.cuda_graphs=true", "train.grad_accum=2"))
    with pytest.raises(ValueError, match="train.cuda_graphs must be one of true, false, auto, step; got 'always'"):
        check_config(cfg("train.cuda_graphs=always"))
    check_config(cfg("train.cuda_graphs=step"))  # compiled or not
    with pytest.raises(ValueError, match="train.cuda_graphs=step needs train.grad_accum=1"):
        check_config(cfg("train.cuda_graphs=step", "train.grad_accum=2"))
    model = {"vocab_size": 16, "context": 8, "n_layer": 1, "n_head": 2, "n_kv_head": 2, "d_model": 16}
    with pytest.raises(ValueError, match="train.cuda_graphs=true needs train.compile=true"):
        LitGPT(model=model, compile=False, cuda_graphs=True)


def test_cuda_graphs_auto_turns_on_only_where_they_hold():
    """auto: on for a compiled model on one CUDA device without accumulation; off, naming why, otherwise;
    true and false are taken as given (true's own requirements are check_config's)."""
    from omegaconf import OmegaConf

    from training.config_checks import cuda_graphs_enabled
    from training.launch import devices_per_run

    def train(**kw):
        return OmegaConf.create({"cuda_graphs": "auto", "compile": True, "grad_accum": 1, **kw})

    assert cuda_graphs_enabled(train(), 1, cuda=True)[0]
    for cfg, devices, cuda, why in ((train(compile=False), 1, True, "train.compile=false"), (train(), 1, False, "no CUDA"),
                                    (train(), 2, True, "2 devices"), (train(grad_accum=4), 1, True, "grad_accum=4")):
        on, reason = cuda_graphs_enabled(cfg, devices, cuda)
        assert not on and why in reason, reason
    assert cuda_graphs_enabled(train(cuda_graphs=False), 1, True)[0] is False
    assert cuda_graphs_enabled(train(cuda_graphs=True, compile=False), 4, False)[0] is True
    assert cuda_graphs_enabled(train(cuda_graphs="step", compile=False), 1, True)[0] == "step"
    for devices, cuda, why in ((1, False, "no CUDA device"), (2, True, "2 devices")):
        with pytest.raises(ValueError, match=f"train.cuda_graphs=step needs one CUDA device \\({why}\\)"):
            cuda_graphs_enabled(train(cuda_graphs="step"), devices, cuda)
    assert devices_per_run(OmegaConf.create({"devices": 2, "num_nodes": 3})) == 6
    assert devices_per_run(OmegaConf.create({"devices": [0, 1]})) == 2
    assert devices_per_run(OmegaConf.create({"devices": "0,1,2"})) == 3
    assert devices_per_run(OmegaConf.create({"devices": -1})) == max(torch.cuda.device_count(), 1)


def test_a_captured_step_trains_as_the_eager_step(tmp_path, monkeypatch):
    """train.cuda_graphs=step (the forward, loss and backward of a step as one captured graph) on
    Lightning's loop, with the CUDA graph replaced by an eager stand-in of the same semantics:
    the same losses, gradient norms and weights as the eager run, through the warm-up calls, the
    capture and the replays (zero_grad and the guard's dropped gradients must not lose them)."""
    from training import train
    from models import captured_step
    from train_helpers import compose_cfg, tiny_overrides, use_eager_captured_step, write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    runs = {}
    for mode in ("eager", "step"):
        overrides = {"train.max_steps": 8, "train.val_every": 8, "train.grad_clip": 1e-2}
        if mode == "step":
            calls = use_eager_captured_step(monkeypatch)
        run = tmp_path / mode
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **overrides, **{"paths.output_dir": str(run)})))
        runs[mode] = run
    assert calls == [False] * (captured_step.WARMUP_CALLS + 1) + [True] * (8 - captured_step.WARMUP_CALLS - 1)
    from eval.run_logs import metric_by_step
    for metric in ("train/loss", "train/grad_norm"):
        eager, step = (metric_by_step(runs[m], metric) for m in ("eager", "step"))
        assert eager.keys() == step.keys() and len(eager) >= 2
        for k in eager:
            assert step[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-7), (metric, k)
    weights = [torch.load(runs[m] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for m in runs]
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_a_captured_step_refuses_another_batch_shape():
    from models.captured_step import WARMUP_CALLS, CapturedStep
    from train_helpers import eager_capture_for

    weight = torch.nn.Parameter(torch.ones(3))
    step = CapturedStep(lambda x, y: (weight * x.float()).sum() + 0 * y.sum(), [weight],
                        capture=eager_capture_for([weight]))
    x = torch.ones(2, 3)
    for _ in range(WARMUP_CALLS + 2):
        assert step(x, x).item() == 6.0 and torch.equal(weight.grad, torch.full((3,), 2.0))
    assert step.captured
    with pytest.raises(ValueError, match=r"replays one batch shape, captured \(2, 3\); got inputs \(1, 3\)"):
        step(torch.ones(1, 3), torch.ones(1, 3))
