"""What the training loop feeds the optimizer and reports: the learning rate of every step, the
weight-decay groups and the decay the optimizer applies to each, gradient clipping's effect, and
the logged bits per byte. Each test pins exact values, so an off-by-one warmup, a stretched cosine,
decay on norms or lambdas, a missing clip, a clip that scales gradients up or a wrong bpb constant
fails."""

from __future__ import annotations

import math

import pytest
import torch

from eval.run_logs import metric_by_step
from models.lit import LitGPT
from models.schedules import warmup_cosine
from train_helpers import compose_cfg, tiny_overrides, write_corpus

TINY = {"vocab_size": 32, "context": 8, "n_layer": 2, "n_head": 2, "n_kv_head": 2, "d_model": 16}


def test_lr_schedule_values_at_chosen_steps():
    """Linear warmup over warmup_steps (step 0 already at 1/warmup), cosine from 1 to min_lr_ratio
    over the remaining steps, then the floor."""
    def lr_factor(step, warmup_steps=10, max_steps=110, min_lr_ratio=0.1):
        return warmup_cosine(step, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio)

    expected = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 35: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 60: 0.55,
                85: 0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 109: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99)),
                110: 0.1, 500: 0.1}
    for step, want in expected.items():
        assert lr_factor(step) == pytest.approx(want, abs=1e-12), step
    assert lr_factor(0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == pytest.approx(1.0)
    assert lr_factor(5, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == pytest.approx(0.5)


def _record_optimizer_steps(monkeypatch):
    """Wrap the optimizer train.py builds: every step records its learning rates and the global
    gradient norm the step sees (after clipping)."""
    seen = []
    real = LitGPT.configure_optimizers

    def recording(self):
        out = real(self)
        opt = out["optimizer"]
        step = opt.step

        def recorded_step(*args, closure=None, **kwargs):
            # Lightning passes its closure (forward, backward, then hooks and clipping) to the step
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
            seen.append({"lr": [g["lr"] for g in opt.param_groups], "grad_norm": norm})
            step(*args, **kwargs)
            return loss

        opt.step = recorded_step
        return out

    monkeypatch.setattr(LitGPT, "configure_optimizers", recording)
    return seen


def test_every_optimizer_step_uses_the_scheduled_lr_and_the_clipped_gradient(tmp_path, monkeypatch):
    from training import train

    seen = _record_optimizer_steps(monkeypatch)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    lr, clip = 2e-3, 1e-3  # a clip far below the raw gradient norm: every step is clipped
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 9, "train.val_every": 9, "train.warmup_steps": 3, "train.lr": lr,
        "train.min_lr_ratio": 0.2, "train.grad_clip": clip})))
    assert len(seen) == 9
    for step, record in enumerate(seen):
        factor = warmup_cosine(step, warmup_steps=3, max_steps=9, min_lr_ratio=0.2)
        assert record["lr"] == pytest.approx([lr * factor] * 2, rel=1e-12), step
        assert record["grad_norm"] == pytest.approx(clip, rel=1e-4), step


class FusedAdamWRecordingMoments(torch.optim.AdamW):
    """Fused AdamW (as on GPU; PyTorch has it on CPU too) recording, per step, the raw gradient
    norm, the grad_scale the clip set, and the norm of the first moment after the step."""

    seen: list[dict] = []

    def __init__(self, *args, fused=None, **kwargs):
        super().__init__(*args, fused=True, **kwargs)

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        raw = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
        scale = getattr(self, "grad_scale", None)
        super().step()
        moment = torch.linalg.vector_norm(torch.stack([self.state[p]["exp_avg"].norm() for p in params])).item()
        FusedAdamWRecordingMoments.seen.append(
            {"raw": raw, "grad_scale": None if scale is None else float(scale), "moment": moment})
        return loss


def test_a_fused_optimizer_clips_inside_its_step(tmp_path, monkeypatch):
    """With a fused optimizer the clip is its grad_scale (the gradients are divided inside the fused
    step, no pass over them): the divisor is norm / clip, and the first step's moment is
    (1 - beta1) times the clipped gradient, whose norm is the clip."""
    from training import train

    FusedAdamWRecordingMoments.seen = []
    monkeypatch.setattr(torch.optim, "AdamW", FusedAdamWRecordingMoments)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    clip = 1e-3
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 3, "train.val_every": 3, "train.grad_clip": clip})))
    seen = FusedAdamWRecordingMoments.seen
    assert len(seen) == 3
    for record in seen:
        assert record["raw"] > 10 * clip, "the clip binds"
        assert record["grad_scale"] == pytest.approx((record["raw"] + 1e-6) / clip, rel=1e-5)
    assert seen[0]["moment"] == pytest.approx(0.1 * clip, rel=1e-4)  # AdamW's beta1 = 0.9


def test_without_clipping_the_optimizer_sees_the_raw_gradient(tmp_path, monkeypatch):
    """The other side of the clipping test: with train.grad_clip=null the norms are the raw ones,
    far above the 1e-3 the clipped run sees (so that test's equality is the clip's doing)."""
    from training import train

    seen = _record_optimizer_steps(monkeypatch)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 3, "train.val_every": 3, "train.grad_clip": "null"})))
    assert len(seen) == 3 and all(r["grad_norm"] > 0.05 for r in seen), seen


def test_logged_grad_norm_is_the_pre_clip_norm_of_each_step(tmp_path, monkeypatch):
    """train/grad_norm is the norm of the step's gradients before clipping: without a clip, what
    the optimizer sees; with a clip far below it, still the raw norm (the optimizer sees the clip)."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    for clip in ("null", 1e-3):
        seen = _record_optimizer_steps(monkeypatch)
        run = tmp_path / f"clip{clip}"
        train.run(compose_cfg(tiny_overrides(run, corpus, **{
            "train.max_steps": 4, "train.val_every": 4, "train.grad_clip": clip})))
        logged = metric_by_step(run / "run", "train/grad_norm")
        assert sorted(logged) == [0, 1, 2, 3], logged  # one value per step (log_every 1)
        if clip == "null":
            raw = [r["grad_norm"] for r in seen]
            assert [logged[s] for s in range(4)] == pytest.approx(raw, rel=1e-5)
        else:
            assert all(r["grad_norm"] == pytest.approx(1e-3, rel=1e-4) for r in seen)
            assert all(v > 0.05 for v in logged.values()), logged


def test_a_clip_above_the_gradient_norm_leaves_the_gradient_untouched(tmp_path, monkeypatch):
    """Clipping scales by min(1, clip / norm) (torch.nn.utils.clip_grad_norm_'s rule): with a clip far
    above every step's norm the optimizer sees exactly the logged pre-clip norm, never a larger one."""
    from training import train

    seen = _record_optimizer_steps(monkeypatch)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    clip = 1e3
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 4, "train.val_every": 4, "train.grad_clip": clip})))
    logged = metric_by_step(tmp_path / "run", "train/grad_norm")
    assert sorted(logged) == [0, 1, 2, 3], logged
    assert all(0 < v < clip / 10 for v in logged.values()), logged  # the clip never binds
    assert [r["grad_norm"] for r in seen] == pytest.approx([logged[s] for s in range(4)], rel=1e-5)


def test_the_optimizer_decays_the_matrices_and_nothing_else(tmp_path, monkeypatch):
    """The AdamW train.py builds: train.weight_decay on exactly the decayed group of
    weight_decay_groups (pinned by the next test), 0 on the rest (norm gains), each parameter in
    one group."""
    from training import train

    built = []
    real = LitGPT.configure_optimizers

    def recording(self):
        out = real(self)
        built.append((self, out["optimizer"]))
        return out

    monkeypatch.setattr(LitGPT, "configure_optimizers", recording)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 2, "train.val_every": 2, "train.weight_decay": 0.3})))
    (lit, optimizer), = built
    decay, no_decay = lit.weight_decay_groups()
    assert decay and no_decay
    groups = [({id(p) for p in g["params"]}, g["weight_decay"]) for g in optimizer.param_groups]
    assert groups == [({id(p) for p in decay}, 0.3), ({id(p) for p in no_decay}, 0.0)]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(lit.model.parameters()))


@pytest.mark.parametrize("variant,lambda_mode", [("softmax", "reparam"), ("diff_threshold", "reparam"),
                                                 ("diff_threshold", "clamp"), ("diff_threshold", "scalar_clamp")])
def test_weight_decay_groups_are_exactly_the_matrices(variant, lambda_mode):
    """Decayed: every linear weight and the (tied) embedding, once. Not decayed: every norm gain and
    the differential lambda parameters. Nothing else, nothing twice."""
    lit = LitGPT(model={**TINY, "attn": {"name": variant, "backend": "reference", "lambda_mode": lambda_mode}},
                 )
    names = {id(p): n for n, p in lit.model.named_parameters()}
    decay, no_decay = lit.weight_decay_groups()
    decayed = sorted(names[id(p)] for p in decay)
    kept = sorted(names[id(p)] for p in no_decay)
    want_decayed = ["embed.weight"] + [f"blocks.{i}.{m}.weight" for i in range(2)
                                       for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")]
    assert decayed == sorted(want_decayed)
    lambdas = {"reparam": "attn.extras.lambda_vectors", "clamp": "attn.extras.lambda_raw",
               "scalar_clamp": "attn.extras.lambda_scalar"}[lambda_mode]
    want_kept = ["norm.weight"] + [f"blocks.{i}.{m}" for i in range(2) for m in ("norm1.weight", "norm2.weight")]
    if variant == "diff_threshold":  # per-head output norm and lambda
        want_kept += [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.head_norm.weight", lambdas)]
    assert kept == sorted(want_kept)
    assert len(decay) + len(no_decay) == len(list(lit.model.parameters()))


def test_logged_bits_per_byte_are_the_validation_nats_over_ln2_and_bytes_per_token(tmp_path):
    """A character tokenizer on text with multi-byte characters: bytes per token is not 1, so the
    conversion must use the split's own byte count. Every logged val/bpb and the final
    results.json agree with val/loss / ln 2 / (UTF-8 bytes / tokens of the validation split)."""
    from training import train
    from hydra.utils import instantiate

    corpus = tmp_path / "corpus.txt"
    text = write_corpus(tmp_path / "plain.txt", lines=800).read_text()
    corpus.write_text(text.replace("a", "ä").replace("o", "ø"))
    overrides = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 6, "train.val_every": 3,
                                                     "data/tokenizer": "char"})
    cfg = compose_cfg(overrides)
    results = train.run(cfg)
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    stats = dm.split_stats("val")
    bytes_per_token = stats["bytes"] / stats["tokens"]
    assert 1.05 < bytes_per_token < 2.0  # the multi-byte characters count
    loss, bpb = (metric_by_step(tmp_path / "run", name) for name in ("val/loss", "val/bpb"))
    assert loss.keys() == bpb.keys() and len(loss) == 2
    for step in loss:
        assert bpb[step] == pytest.approx(loss[step] / math.log(2) / bytes_per_token, rel=1e-6), step
    assert results["val_bpb"] == pytest.approx(results["val_loss"] / math.log(2) / bytes_per_token, rel=1e-9)


def test_step_scalars_by_hand():
    """The step's norm, clip factors and non-finite flag (models/step_scalars.py) on known values."""
    from models.step_scalars import CLIP_EPS, norm_and_clip, nonfinite_found, step_scalars

    norms = [torch.tensor(3.0), torch.tensor(4.0, dtype=torch.bfloat16)]
    norm, divisor = norm_and_clip(norms, 1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(5.0)
    assert divisor.item() == pytest.approx(5.0 + CLIP_EPS)
    assert norm_and_clip(norms, 2.0)[1].item() == pytest.approx((5.0 + CLIP_EPS) / 2.0)
    assert norm_and_clip(norms, 10.0)[1].item() == 1.0, "a clip above the norm never scales up"
    assert norm_and_clip(norms, None)[1] is None
    cases = {(5.0, 1.0): 0.0, (math.inf, 1.0): 1.0, (math.nan, 1.0): 1.0, (5.0, math.inf): 1.0, (5.0, -math.nan): 1.0,
             (math.inf, -math.inf): 1.0}
    for (g, loss), want in cases.items():
        found = nonfinite_found(torch.tensor(g), torch.tensor(loss))
        assert found.shape == () and found.dtype == torch.float32 and found.item() == want, (g, loss)
    # all of them at once from the gradients (the captured step's tail)
    grads = [torch.full((2,), 1.5), torch.tensor([[2.0, 0.0], [1.0, 2.0]])]  # squares sum to 4.5 and 9
    scalars = step_scalars(grads, 2.0, torch.tensor(1.0))
    assert [n.item() for n in scalars.per_param_norms] == pytest.approx([math.sqrt(4.5), 3.0])
    assert scalars.norm.item() == pytest.approx(math.sqrt(13.5))
    assert scalars.divisor.item() == pytest.approx((math.sqrt(13.5) + CLIP_EPS) / 2.0)
    assert scalars.found_nonfinite.item() == 0.0
    assert step_scalars(grads, None).divisor is None and step_scalars(grads, None).found_nonfinite is None
    assert step_scalars(grads, 2.0, torch.tensor(math.nan)).found_nonfinite.item() == 1.0
    grads[1][0, 0] = math.inf
    assert step_scalars(grads, 2.0, torch.tensor(1.0)).found_nonfinite.item() == 1.0
