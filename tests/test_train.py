"""Training end to end on CPU: checkpoints, exact resume, results, multirun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runs.checkpoints import load_checkpoint
from eval.run_logs import metric_by_step, train_losses
from train_helpers import compose_cfg, tiny_overrides, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_training_checkpoints_and_reports(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt")
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 30, "train.val_every": 15})))
    run = tmp_path / "run"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "checkpoints" / "best.ckpt").is_file()
    saved = json.loads((run / "results.json").read_text())
    assert saved["val_loss"] == pytest.approx(results["val_loss"])
    # learned something: far below the uniform byte model (8 bits/byte) and improving
    assert saved["val_bpb"] < 6.0
    val = list(metric_by_step(run, "val/loss").values())
    assert len(val) >= 2 and val[-1] < val[0]
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 30
    assert isinstance(ckpt["hyper_parameters"]["model"], dict)
    assert not list((run / "checkpoints").glob("*.tmp")), "no temp files left behind"


def test_resume_continues_exactly(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt")
    straight = tmp_path / "straight"
    train.run(compose_cfg(tiny_overrides(straight, corpus, **{"train.max_steps": 8, "train.val_every": 4})))
    first = tmp_path / "first"
    train.run(compose_cfg(tiny_overrides(first, corpus, **{"train.max_steps": 8, "train.stop_at_step": 4, "train.val_every": 4})))
    resumed = tmp_path / "resumed"
    ckpt = first / "run" / "checkpoints" / "last.ckpt"
    train.run(compose_cfg(tiny_overrides(resumed, corpus, **{"train.max_steps": 8, "train.val_every": 4}) + [f"ckpt_path={ckpt}"]))
    a, b = train_losses(straight / "run"), train_losses(resumed / "run")
    later = sorted(s for s in a if s >= 4)
    assert later and all(s in b for s in later)
    assert [a[s] for s in later] == [b[s] for s in later]  # bitwise on CPU


@pytest.mark.slow
def test_multirun_separate_dirs_one_group(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    overrides = [o for o in tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2})
                 if not o.startswith("paths.output_dir")]
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "attn=softmax,threshold", "seed=0",
           "logger=wandb", f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/results.json"))]
    assert [r["variant"] for r in results] == ["softmax", "threshold"]
    assert len({r["run_dir"] for r in results}) == 2
    assert len({r["wandb_group"] for r in results}) == 1 and results[0]["wandb_group"].startswith("default-")


def test_wandb_offline_run_id_is_checkpointed_and_resumed(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    first = tmp_path / "first"
    common = {"logger": "wandb", "train.max_steps": 4, "train.val_every": 2}
    train.run(compose_cfg(tiny_overrides(first, corpus, **common, **{"train.stop_at_step": 2})))
    ckpt = load_checkpoint(first / "run" / "checkpoints" / "last.ckpt")
    run_id = ckpt["wandb_run_id"]
    assert [p.name.endswith(run_id) for p in (first / "run" / "wandb").glob("offline-run-*")] == [True]
    resumed = tmp_path / "resumed"
    train.run(compose_cfg(tiny_overrides(resumed, corpus, **common) + [f"ckpt_path={first / 'run' / 'checkpoints' / 'last.ckpt'}"]))
    assert [p.name.endswith(run_id) for p in (resumed / "run" / "wandb").glob("offline-run-*")] == [True]
    assert load_checkpoint(resumed / "run" / "checkpoints" / "last.ckpt")["wandb_run_id"] == run_id


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_throughput_and_mfu_are_logged_per_log_window(tmp_path, grad_accum):
    """tokens/s and MFU: one value per log write, over the batches since the last one (the clock,
    a device sync on GPU, is read once per log write, also under gradient accumulation), and in
    results.json the steady-state mean of the windows that start after the warm-up."""
    from training import train
    from models.lit import WARMUP_STEPS

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 20, "train.val_every": 20, "train.log_every": 3, "train.peak_tflops": 2.0,
        "train.grad_accum": grad_accum})))
    rates = metric_by_step(tmp_path / "run", "train/tokens_per_s")
    mfus = metric_by_step(tmp_path / "run", "train/mfu")
    # the window opens at the first batch end and closes at each log write (batches 3, 6, ... 18,
    # and 20: Lightning also writes logs at the stop request that puts the last validation in fit)
    ends = [step + 1 for step in rates]
    assert ends == [3, 6, 9, 12, 15, 18, 20] and sorted(mfus) == sorted(rates)
    # val_every counts optimizer steps, also under accumulation (Lightning's interval counts batches)
    assert [step + 1 for step in metric_by_step(tmp_path / "run", "val/loss")] == [20]
    from models.gpt import GPT
    from models.lit import gpt_config_from_dict

    model_hparams = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["hyper_parameters"]["model"]
    flops_per_token = GPT(gpt_config_from_dict(model_hparams)).flops_per_token()
    for step, tps in rates.items():
        assert tps > 0
        assert mfus[step] == pytest.approx(tps * flops_per_token / 2e12, rel=1e-5)
    # each window holds every micro-batch since the previous write: seconds = tokens / tokens_per_s
    tokens_per_step = 4 * 32 * grad_accum  # tiny_overrides: batch 4, context 32
    steady = [((end - start) * tokens_per_step, rates[end - 1])
              for start, end in zip(ends, ends[1:]) if start >= WARMUP_STEPS]
    assert len(steady) == 5
    mean = sum(t for t, _ in steady) / sum(t / tps for t, tps in steady)
    assert results["tokens_per_s"] == pytest.approx(mean, rel=1e-5)
    assert results["mfu"] == pytest.approx(results["tokens_per_s"] * flops_per_token / 2e12, rel=1e-9)


def test_last_validation_runs_inside_fit_whatever_val_every(tmp_path, monkeypatch):
    """The final numbers come from a validation inside fit after the last step (max_steps=5 is no
    multiple of val_every=3); no trainer.validate() follows fit (it fails under multi-GPU FSDP)."""
    import lightning as L

    from training import train

    def no_validate(*args, **kwargs):
        raise AssertionError("trainer.validate() after fit")

    monkeypatch.setattr(L.Trainer, "validate", no_validate)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 5, "train.val_every": 3})))
    val = metric_by_step(tmp_path / "run", "val/loss")
    assert [step + 1 for step in val] == [3, 5]
    assert results["steps"] == 5 and results["val_loss"] == pytest.approx(val[4], rel=1e-6)


def test_training_logs_are_written_at_their_own_steps_and_self_log_gets_only_cpu_values(tmp_path, monkeypatch):
    """On a GPU, self.log of a Python number is a blocking copy to the device, and Lightning reads
    every cached progress-bar value back (.item()) after every batch: a device-resident value is a
    host sync per step. So the training values go to the loggers directly, at the step index of
    the log step that gathered them (models/log_step_metrics.py), and self.log (the progress bar)
    only ever gets CPU tensors; the last step's row holds that step's values (not the previous
    log step's)."""
    from training import train
    from models.lit import LitGPT

    records = []
    real_log = LitGPT.log

    def recording_log(self, name, value, *args, **kwargs):
        if self.trainer.training and not self.trainer.sanity_checking and not self.trainer.validating:
            records.append((self.global_step, name, isinstance(value, torch.Tensor) and value.device.type == "cpu"))
        return real_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LitGPT, "log", recording_log)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 8, "train.val_every": 4, "train.log_every": 3})))
    assert records and all(on_cpu for *_, on_cpu in records), records
    assert {name for _, name, _ in records} <= {"train/loss", "train/tokens_per_s", "train/mfu"}
    tokens = metric_by_step(tmp_path / "run", "train/tokens")
    assert [step + 1 for step in tokens] == [3, 6, 8]  # the log writes: every 3 steps, and the last
    assert tokens[7] == 8 * 4 * 32  # the last step's own count (tiny_overrides: batch 4, context 32)
    for name in ("train/loss", "train/lr", "train/tokens_per_s", "train/nonfinite_steps", "train/grad_norm/embed",
                 "train/grad_norm/block0", "train/grad_norm/final_norm"):
        assert sorted(metric_by_step(tmp_path / "run", name)) == [2, 5, 7], name
    losses = train_losses(tmp_path / "run")
    assert losses[7] != losses[5]


def test_resuming_a_finished_run_reports_the_same_final_numbers(tmp_path, monkeypatch):
    """Resuming from the last checkpoint of a finished run: fit has nothing to do, and the run
    reports exactly its own final numbers, from the checkpoint, without a trainer.validate()
    (which fails under multi-GPU FSDP)."""
    import lightning as L

    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    common = {"train.max_steps": 4, "train.val_every": 3}
    first = train.run(compose_cfg(tiny_overrides(tmp_path / "first", corpus, **common)))

    def no_validate(*args, **kwargs):
        raise AssertionError("the final validation is in the checkpoint; trainer.validate must not run")

    with monkeypatch.context() as patched:
        patched.setattr(L.Trainer, "validate", no_validate)
        again = train.run(compose_cfg(tiny_overrides(tmp_path / "again", corpus, **common)
                                      + [f"ckpt_path={first['last_checkpoint']}"]))
    assert again["steps"] == first["steps"] == 4
    assert again["val_loss"] == first["val_loss"] and again["val_bpb"] == first["val_bpb"]

    # a checkpoint without the stored validation (older ones): validated again, the same numbers
    from runs.checkpoints import atomic_torch_save, load_checkpoint

    older = load_checkpoint(first["last_checkpoint"])
    del older["last_validation"]
    atomic_torch_save(older, tmp_path / "older.ckpt")
    revalidated = train.run(compose_cfg(tiny_overrides(tmp_path / "older", corpus, **common)
                                        + [f"ckpt_path={tmp_path / 'older.ckpt'}"]))
    assert revalidated["steps"] == 4
    assert revalidated["val_loss"] == first["val_loss"] and revalidated["val_bpb"] == first["val_bpb"]


def test_run_labels_name_a_variants_own_settings():
    from training.run_label import run_label

    assert run_label("softmax", []) == "softmax"
    assert run_label("softcap_tanh", ["attn=softcap_tanh", "attn.params.cap=2", "seed=1", "train.lr=1e-3"]) \
        == "softcap_tanh[cap=2]"
    assert run_label("diff_threshold", ["attn.lambda_mode=scalar_clamp", "attn.backend=triton", "+attn.params.beta=0.5"]) \
        == "diff_threshold[beta=0.5,lambda_mode=scalar_clamp]"


@pytest.mark.parametrize("overrides, folder", [
    ([], "softmax"),
    (["attn=softcap_tanh", "attn.params.cap=2", "seed=1"], "softmax+cap-2"),
    (["attn.lambda_mode=scalar_clamp", "attn.backend=triton", "+attn.params.beta=0.5"],
     "softmax+beta-0.5+lambda_mode-scalar_clamp"),
    (["attn.params.cap=-1"], "softmax+cap--1"),
    (["attn.params.cap=1e-3"], "softmax+cap-1e-3"),
    (["attn.params.x=[1,2]"], "softmax+x-1-2"),
    (["attn.params.x='a b'"], "softmax+x-a-b"),
    (['attn.params.x="$(rm -rf ~)"'], "softmax+x-rm--rf"),
])
def test_folder_labels_need_no_quoting_in_a_shell_or_a_hydra_override(overrides, folder):
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from training.run_label import folder_label

    name = f"0_{folder_label('softmax', overrides)}_s0"
    assert name == f"0_{folder}_s0"
    assert shlex.quote(name) == name
    assert OverridesParser.create().parse_override(f"ckpt=multirun/x/{name}").value() == f"multirun/x/{name}"


def test_a_sweep_over_a_variant_parameter_gives_distinct_labels_dirs_and_wandb_names(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    overrides = [o for o in tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2})
                 if not o.startswith("paths.output_dir")]
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "attn=softcap_tanh", "attn.params.cap=2,50", "seed=0",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.parent.name for p in (tmp_path / "sweep").glob("*/results.json"))
    # names a shell and a ckpt= override take unquoted
    assert jobs == ["0_softcap_tanh+cap-2_s0", "1_softcap_tanh+cap-50_s0"], jobs
    labels = [json.loads((tmp_path / "sweep" / j / "results.json").read_text())["label"] for j in jobs]
    assert labels == ["softcap_tanh[cap=2]", "softcap_tanh[cap=50]"]

    from training import loggers

    monkeypatch.setattr(loggers, "run_label_of", lambda cfg: "softcap_tanh[cap=2]")
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus, **{"logger": "wandb", "attn": "softcap_tanh"}))
    wandb_logger = next(lg for lg in loggers.build_loggers(cfg, tmp_path / "w", None, resuming=False)
                        if lg.__class__.__name__ == "WandbLogger")
    assert wandb_logger._wandb_init["name"] == "softcap_tanh[cap=2]-s0"
    assert set(wandb_logger._wandb_init["tags"]) == {"softcap_tanh", "softcap_tanh[cap=2]", "seed0"}


def test_stop_at_time_ends_a_run_at_the_deadline_and_refuses_one_past_it(tmp_path):
    import time

    from training import train
    from training.config_checks import check_config

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    deadline = time.time() + 4.0
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 100_000, "train.val_every": 50,
                                                          "train.stop_at_time": deadline}))
    results = train.run(cfg)
    assert 0 < results["steps"] < 100_000  # stopped by the deadline, not by max_steps
    assert time.time() - deadline < 60
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == results["steps"]
    late = compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.stop_at_time": time.time() - 5,
                                                           "paths.output_dir": str(tmp_path / "late")}))
    with pytest.raises(ValueError, match="train.stop_at_time passed"):
        train.run(late)
    both = compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.stop_at_time": deadline,
                                                           "+trainer.max_time": "00:00:01:00"}))
    with pytest.raises(ValueError, match="train.stop_at_time .* and trainer.max_time"):
        check_config(both)
    with pytest.raises(ValueError, match="train.stop_at_time must be null or a unix time"):
        check_config(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.stop_at_time": "soon"})))
