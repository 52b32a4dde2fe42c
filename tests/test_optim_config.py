"""The optimizer, scheduler and callbacks config groups, logger=tensorboard and the per-layer
gradient norms: each schedule's values at its phase boundaries, Muon's parameter split and its
equality with torch's Muon and AdamW stepped apart, resuming a Muon run exactly, early stopping,
and the config errors, each naming its field."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from eval.run_logs import metric_by_step, train_losses
from models.lit import LitGPT
from models.schedules import warmup_linear, warmup_stable_decay
from train_helpers import compose_cfg, tiny_overrides, write_corpus

TINY = {"vocab_size": 32, "context": 8, "n_layer": 2, "n_head": 2, "n_kv_head": 2, "d_model": 16}
HAS_MUON = hasattr(torch.optim, "Muon")
needs_muon = pytest.mark.skipif(not HAS_MUON, reason=f"torch {torch.__version__} has no torch.optim.Muon")


# ---- schedules: warm-up start and end, stable phase, decay start, last step, the floor ----

def test_linear_schedule_values():
    def f(step):
        return warmup_linear(step, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)

    expected = {0: 0.1, 9: 1.0, 10: 1.0, 11: 1 - 0.9 / 100, 60: 0.55, 109: 0.1 + 0.9 / 100, 110: 0.1, 500: 0.1}
    for step, want in expected.items():
        assert f(step) == pytest.approx(want, abs=1e-12), step
    assert warmup_linear(0, warmup_steps=0, max_steps=4, min_lr_ratio=0.0) == 1.0
    assert warmup_linear(3, warmup_steps=0, max_steps=4, min_lr_ratio=0.0) == pytest.approx(0.25)


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_warmup_stable_decay_values(shape):
    """max_steps 100, decay_fraction 0.2: the decay phase is steps 80..99, the floor at 100."""
    def f(step):
        return warmup_stable_decay(step, warmup_steps=10, max_steps=100, min_lr_ratio=0.1,
                                   decay_fraction=0.2, decay_shape=shape)

    def decayed(progress):
        if shape == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 0.1 + 0.9 * (1 - progress)

    expected = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 50: 1.0, 79: 1.0, 80: 1.0, 81: decayed(1 / 20), 90: decayed(0.5),
                99: decayed(19 / 20), 100: 0.1, 300: 0.1}
    for step, want in expected.items():
        assert f(step) == pytest.approx(want, abs=1e-12), step
    assert f(90) == pytest.approx(0.55)  # the midpoint of either shape


def test_warmup_stable_decay_rounds_the_decay_phase_and_may_start_at_the_warmup_end():
    # 0.25 x 10 = 2.5 rounds to 2 decay steps (banker's rounding): steps 8 and 9
    f = dict(warmup_steps=2, max_steps=10, min_lr_ratio=0.0, decay_fraction=0.25)
    assert [warmup_stable_decay(s, **f) for s in range(11)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    # the whole post-warm-up span decays: the same as warmup_linear
    whole = dict(warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    assert [warmup_stable_decay(s, **whole, decay_fraction=0.8) for s in range(12)] == pytest.approx(
        [warmup_linear(s, **whole) for s in range(12)])


@pytest.mark.parametrize("settings,match", [
    ({"decay_fraction": 0.0}, r"scheduler\.decay_fraction must be in \(0, 1\]"),
    ({"decay_fraction": 1.5}, r"scheduler\.decay_fraction must be in \(0, 1\]"),
    ({"decay_fraction": 0.95}, r"start at or after the warm-up's end \(train\.warmup_steps=10\)"),
    ({"decay_fraction": 0.001}, "at least 1 step"),
    ({"decay_shape": "exp"}, r"scheduler\.decay_shape must be one of \('linear', 'cosine'\)"),
    ({"min_lr_ratio": 2}, r"scheduler\.min_lr_ratio \(train\.min_lr_ratio\) must be in \[0, 1\]"),
    ({"warmup_steps": -1}, r"scheduler\.warmup_steps \(train\.warmup_steps\) must be an int >= 0"),
])
def test_bad_schedule_settings_are_named(settings, match):
    base = dict(warmup_steps=10, max_steps=100, min_lr_ratio=0.1, decay_fraction=0.2, decay_shape="linear")
    with pytest.raises(ValueError, match=match):
        warmup_stable_decay(0, **{**base, **settings})


def _record_lrs(monkeypatch):
    """The learning rates of every optimizer step train.py takes (after the scheduler set them)."""
    seen, built = [], []
    real = LitGPT.configure_optimizers

    def recording(self):
        out = real(self)
        opt = out["optimizer"]
        built.append((self, opt))
        step = opt.step

        def recorded_step(*args, **kwargs):
            seen.append([g["lr"] for g in opt.param_groups])
            return step(*args, **kwargs)

        opt.step = recorded_step
        return out

    monkeypatch.setattr(LitGPT, "configure_optimizers", recording)
    return seen, built


@pytest.mark.parametrize("scheduler,schedule", [
    ("linear", lambda s: warmup_linear(s, warmup_steps=2, max_steps=10, min_lr_ratio=0.2)),
    ("wsd", lambda s: warmup_stable_decay(s, warmup_steps=2, max_steps=10, min_lr_ratio=0.2, decay_fraction=0.3,
                                          decay_shape="cosine")),
])
def test_train_py_steps_with_the_chosen_schedule(scheduler, schedule, tmp_path, monkeypatch):
    from training import train

    seen, _ = _record_lrs(monkeypatch)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    extra = ["scheduler.decay_fraction=0.3", "scheduler.decay_shape=cosine"] if scheduler == "wsd" else []
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 10, "train.val_every": 10, "train.warmup_steps": 2, "train.lr": 1e-3,
        "train.min_lr_ratio": 0.2}) + [f"scheduler={scheduler}", *extra]))
    assert len(seen) == 10
    for step, lrs in enumerate(seen):
        assert lrs == pytest.approx([1e-3 * schedule(step)] * 2, rel=1e-12), step
    if scheduler == "wsd":  # steps 2..6 stable, 7..9 the decay
        assert [lrs[0] for lrs in seen[1:8]] == pytest.approx([1e-3] * 7)
        assert seen[9][0] < seen[8][0] < 1e-3


# ---- optimizers ----

def _named(lit, params):
    names = {id(p): n for n, p in lit.model.named_parameters()}
    return sorted(names[id(p)] for p in params)


@pytest.mark.parametrize("variant", ["softmax", "diff_threshold"])
def test_muon_groups_hold_the_hidden_matrices_and_adamw_the_rest(variant):
    """Muon: every 2-D weight inside a block. AdamW: the embedding (the LM head too; decayed) and,
    not decayed, the norm gains and lambda parameters (the lambda vectors are 3-D, not Muon's)."""
    lit = LitGPT(model={**TINY, "attn": {"name": variant, "backend": "reference"}})
    muon, embedding, no_decay = lit.param_groups(hidden_matrix_group=True)
    assert muon["use_muon"] and not embedding["use_muon"] and not no_decay["use_muon"]
    assert "weight_decay" not in muon and "weight_decay" not in embedding and no_decay["weight_decay"] == 0.0
    assert _named(lit, muon["params"]) == sorted(f"blocks.{i}.{m}.weight" for i in range(2)
                                                 for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down"))
    assert _named(lit, embedding["params"]) == ["embed.weight"]
    assert _named(lit, no_decay["params"]) == _named(lit, lit.weight_decay_groups()[1])
    # without the split: exactly the two weight-decay groups
    decay, kept = lit.weight_decay_groups()
    plain = lit.param_groups()
    assert [g["params"] for g in plain] == [decay, kept] and plain[1]["weight_decay"] == 0.0 and len(plain[0]) == 1


def _optimizer_cfg(option, **overrides):
    from omegaconf import OmegaConf

    cfg = compose_cfg([f"optimizer={option}", "paths.output_dir=/tmp/x",
                       *[f"{k}={v}" for k, v in overrides.items()]])
    return OmegaConf.to_container(cfg.optimizer, resolve=True)


@pytest.mark.parametrize("option", ["adamw", "sgd", pytest.param("muon", marks=needs_muon)])
def test_every_optimizer_config_builds_with_the_weight_decay_split(option):
    lit = LitGPT(model={**TINY, "attn": {"name": "diff_threshold", "backend": "reference"}},
                 optimizer=_optimizer_cfg(option, **{"train.weight_decay": 0.3, "train.lr": 2e-3}),
                 scheduler={"_target_": "models.schedules.warmup_cosine", "_partial_": True, "warmup_steps": 1,
                            "max_steps": 4, "min_lr_ratio": 0.1})
    opt = lit.configure_optimizers()["optimizer"]
    want = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}.get(option)
    if want is not None:
        assert type(opt) is want
    decay, no_decay = lit.weight_decay_groups()
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.3 for p in g["params"]}
    kept = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed == {id(p) for p in decay} and kept == {id(p) for p in no_decay}
    assert all(g["lr"] == pytest.approx(2e-3) for g in opt.param_groups)  # step 0 ends the 1-step warm-up


@needs_muon
def test_muon_with_adamw_steps_exactly_as_the_two_torch_optimizers_apart():
    """Three steps of MuonWithAdamW equal torch.optim.Muon on the matrices plus torch.optim.AdamW on
    the rest, stepped separately with the same settings (bitwise), also after a state round trip."""
    from models.optim import MuonWithAdamW

    torch.manual_seed(0)
    lit = LitGPT(model={**TINY, "attn": {"name": "softmax", "backend": "reference"}})
    twin = copy.deepcopy(lit)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    combined = MuonWithAdamW(lit.param_groups(hidden_matrix_group=True), **hyper, betas=(0.9, 0.95), eps=1e-8)
    muon_g, emb_g, nd_g = twin.param_groups(hidden_matrix_group=True)
    muon = torch.optim.Muon(muon_g["params"], **hyper, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": emb_g["params"]}, {"params": nd_g["params"], "weight_decay": 0.0}],
                              **hyper, betas=(0.9, 0.95), eps=1e-8)
    x = torch.randint(0, 32, (2, 8))
    for step in range(3):
        if step == 2:  # the state survives a checkpoint: a fresh optimizer loads it and goes on
            state = copy.deepcopy(combined.state_dict())
            combined = MuonWithAdamW(lit.param_groups(hidden_matrix_group=True), **hyper)
            combined.load_state_dict(state)
        for model, opts in ((lit, [combined]), (twin, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            model._loss((x, x)).backward()
            for o in opts:
                o.step()
    for (name, a), b in zip(lit.model.named_parameters(), twin.model.parameters()):
        assert torch.equal(a, b), name
    assert len(combined.state) == len(list(lit.model.parameters()))


@needs_muon
def test_a_muon_run_trains_and_resumes_exactly(tmp_path, monkeypatch):
    from training import train
    from models.optim import MuonWithAdamW

    _, built = _record_lrs(monkeypatch)
    corpus = write_corpus(tmp_path / "corpus.txt")
    common = {"train.max_steps": 6, "train.val_every": 3}
    straight = train.run(compose_cfg(tiny_overrides(tmp_path / "straight", corpus, **common) + ["optimizer=muon"]))
    assert isinstance(built[0][1], MuonWithAdamW) and math.isfinite(straight["val_loss"])
    train.run(compose_cfg(tiny_overrides(tmp_path / "first", corpus, **common, **{"train.stop_at_step": 3})
                          + ["optimizer=muon"]))
    ckpt = tmp_path / "first" / "run" / "checkpoints" / "last.ckpt"
    train.run(compose_cfg(tiny_overrides(tmp_path / "resumed", corpus, **common) + ["optimizer=muon", f"ckpt_path={ckpt}"]))
    a, b = train_losses(tmp_path / "straight" / "run"), train_losses(tmp_path / "resumed" / "run")
    assert [a[s] for s in (3, 4, 5)] == [b[s] for s in (3, 4, 5)]  # bitwise on CPU: Muon's momentum restored


@needs_muon
def test_a_muon_step_with_a_nonfinite_loss_is_skipped(tmp_path, monkeypatch):
    """The non-finite guard's host path drops the step's gradients: neither Muon nor the AdamW part
    moves a weight or its state on the poisoned steps (2 and 4 of 6)."""
    from training import train
    from runs.checkpoints import load_checkpoint

    real_build = train.build_model

    def build(*args, **kwargs):
        lit = real_build(*args, **kwargs)
        poisoned = lambda: lit.training and lit._trainer is not None and lit.trainer.global_step in (2, 4)  # noqa: E731
        lit.model.blocks[1].mlp.register_forward_hook(lambda m, a, out: out * float("inf") if poisoned() else out)
        return lit

    monkeypatch.setattr(train, "build_model", build)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "skip"}) + ["optimizer=muon"]))
    assert results["nonfinite_steps"] == 2 and math.isfinite(results["val_loss"])
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())
    optimizer_state = state["optimizer_states"][0]
    adamw_steps = {float(s["step"]) for s in optimizer_state["state"].values() if "step" in s}
    assert adamw_steps == {4.0}, "6 steps, 2 skipped: the AdamW part's step count"
    buffers = [s["momentum_buffer"] for s in optimizer_state["state"].values() if "momentum_buffer" in s]
    assert len(buffers) == 8 and all(torch.isfinite(b).all() for b in buffers)  # Muon's: 4 matrices x 2 blocks


def test_muon_without_torch_muon_names_the_option_and_the_torch_version(tmp_path, monkeypatch):
    from training import train

    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    with pytest.raises(ValueError, match=rf"optimizer=muon needs torch\.optim\.Muon .*torch {re.escape(torch.__version__)}"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus) + ["optimizer=muon"]))
    assert not (tmp_path / "cache").exists(), "the error must come before any data work"


# ---- callbacks ----

def test_early_stopping_stops_when_val_loss_stops_improving(tmp_path):
    """min_delta far above any improvement, patience 1: the first validation sets the best, the
    second does not beat it by min_delta, and training stops there (step 6 of 12)."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 12, "train.val_every": 3})
                                    + ["callbacks=[default,early_stopping]", "callbacks.early_stopping.patience=1",
                                       "callbacks.early_stopping.min_delta=100"]))
    assert results["steps"] == 6
    assert sorted(metric_by_step(tmp_path / "run", "val/loss")) == [2, 5]  # the steps before validations 1 and 2
    assert results["best_checkpoint"].endswith("best.ckpt")


def test_the_default_callbacks_run_without_early_stopping_and_an_entry_can_be_left_out(tmp_path):
    from training import train

    cfg = compose_cfg(["paths.output_dir=/tmp/x"])
    assert list(cfg.callbacks) == ["model_checkpoint", "attention_heatmaps", "nonfinite_guard", "last_checkpoint_every_n_steps",
                                   "max_logit", "attention_monitor", "validation_samples"]
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 4, "train.val_every": 2})
                                    + ["callbacks.model_checkpoint=null"]))
    assert results["steps"] == 4 and results["best_checkpoint"] is None
    assert not (tmp_path / "run" / "checkpoints" / "best.ckpt").exists()


# ---- logger=tensorboard ----

def test_tensorboard_logger_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2, "logger": "tensorboard"})))
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert metric_by_step(tmp_path / "run", "train/loss")  # the CSV log as well


def test_tensorboard_missing_is_named_with_the_pip_command(tmp_path, monkeypatch):
    import importlib.util

    from training import train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "tensorboardX") else real(name, *a))
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    with pytest.raises(ValueError, match=r"logger=tensorboard needs the tensorboard package.*pip install tensorboard"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, logger="tensorboard")))


# ---- per-layer gradient norms ----

@pytest.mark.parametrize("per_layer", [True, False])
def test_per_layer_grad_norms_are_logged_on_log_steps_and_make_up_the_total(per_layer, tmp_path, monkeypatch):
    """train/grad_norm/{embed,block0,block1,final_norm}: on the steps whose logs are written only
    (computed only then), and their root sum of squares is train/grad_norm."""
    import models.lit
    from training import train

    computed = []
    real = models.lit.grad_norm_layers
    monkeypatch.setattr(models.lit, "grad_norm_layers", lambda model: computed.append(1) or real(model))
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 8, "train.val_every": 4, "train.log_every": 3,
        "train.log_grad_norm_per_layer": str(per_layer).lower()})))
    total = metric_by_step(tmp_path / "run", "train/grad_norm")
    assert sorted(total) == [2, 5, 7]  # every 3 steps, and the last
    names = ["embed", "block0", "block1", "final_norm"]
    if not per_layer:
        assert not computed
        assert metric_by_step(tmp_path / "run", "train/grad_norm/block0") == {}
        return
    assert len(computed) == 3
    layers = {name: metric_by_step(tmp_path / "run", f"train/grad_norm/{name}") for name in names}
    for step in total:
        parts = [layers[name][step] for name in names]
        assert all(v > 0 for v in parts), (step, parts)
        assert math.sqrt(sum(v * v for v in parts)) == pytest.approx(total[step], rel=1e-5), step


# ---- config errors ----

@pytest.mark.parametrize("override,match", [
    ("optimizer._partial_=false", r"optimizer\._partial_ must be true"),
    ("+optimizer.foo=1", r"optimizer: AdamW does not take the settings"),
    ("optimizer._target_=torch.optim.Nope", r"optimizer\._target_='torch\.optim\.Nope' does not import"),
    ("scheduler=wsd scheduler.decay_fraction=0", r"scheduler\.decay_fraction must be in \(0, 1\]"),
    ("scheduler=wsd scheduler.decay_shape=exp", r"scheduler\.decay_shape must be one of"),
    ("+scheduler.foo=1", r"scheduler: warmup_cosine does not take the settings"),
    ("train.min_lr_ratio=2", r"train\.min_lr_ratio must be in \[0, 1\], got 2"),
    ("callbacks=[default,early_stopping] callbacks.early_stopping.monitor=val/acc",
     r"callbacks\.early_stopping\.monitor must be one of \('val/loss', 'val/ppl', 'val/bpb'\)"),
    ("+callbacks.foo=3", r"callbacks\.foo must be a config with a `_target_`"),
    ("train.log_grad_norm_per_layer=maybe", r"train\.log_grad_norm_per_layer must be true or false"),
])
def test_optimizer_scheduler_callback_errors_name_the_field(override, match, tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    with pytest.raises(ValueError, match=match):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus) + override.split()))
    assert not (tmp_path / "cache").exists(), "the error must come before any data work"


@needs_muon
def test_muon_under_fsdp_is_refused(tmp_path):
    from training.config_checks import check_config

    cfg = compose_cfg(tiny_overrides(tmp_path, tmp_path / "x.txt", trainer="fsdp") + ["optimizer=muon"])
    with pytest.raises(ValueError, match=r"optimizer=models\.optim\.MuonWithAdamW does not run under an FSDP trainer"):
        check_config(cfg)
