"""A run's output carries no third-party notices that say nothing about it (training/quiet_logs.py,
runs/wandb_quiet.py):
no wandb run block unless -v, one summary line of its own, no log line inside a progress bar; and DDP
gets its buffer setting under the name the installed torch wants."""

import inspect
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from train_helpers import ROOT, compose_cfg, tiny_overrides, train_command, write_corpus

import training.ddp_strategy as ddp_strategy
from runs import command_line
from runs.wandb_quiet import wandb_init_settings
from training.quiet_logs import IGNORED_WARNINGS, silence_third_party_notices

NOISE = ("💡 Tip", "anonymous setting has no effect", "LeafSpec", "`IterableDataset` has `__len__`", "Total FLOPs")


def test_a_wandb_run_prints_none_of_the_notices(tmp_path, capfd, caplog):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, logger="wandb", **{
            "train.max_steps": 2, "train.val_every": 2, "callbacks.attention_heatmaps.windows": 4})))
    printed = capfd.readouterr()
    text = printed.out + printed.err + caplog.text + "\n".join(str(w.message) for w in caught)
    assert "val loss" in printed.out  # the run's own summary is still there
    for notice in NOISE:
        assert notice not in text, notice


# a line that a log record or Lightning's own logger starts (Hydra's format: [time][logger][level] - ...)
LOG_LINE_STARTS = (re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\["), re.compile(r"`Trainer\.fit` stopped"))


def shown(line: str) -> str:
    """What a terminal shows of one output line: each carriage return writes over the line from its
    start (cursor movements left out)."""
    screen: list[str] = []
    for segment in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).split("\r"):
        screen[:len(segment)] = segment
    return "".join(screen)


def test_a_wandb_run_ends_with_one_line_of_its_own_and_logs_stay_out_of_the_progress_bars(tmp_path):
    """`python train.py logger=wandb` with the progress bar on, stdout and stderr in one stream as on a
    terminal: none of wandb's run header or summary block, the run's one summary line, and every log
    line (one comes from the attention backend during the sanity check's bar) on a line of its own."""
    pytest.importorskip("wandb")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tmp_path, corpus, logger="wandb", **{
        "train.max_steps": 4, "train.val_every": 2, "trainer.enable_progress_bar": True})
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ATTNLAB_RUN") and k not in ("ATTNLAB_JOB_OVERRIDES", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *train_command(overrides, run_dir)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=480)
    output = proc.stdout.decode()  # bytes: text mode would turn the bars' carriage returns into newlines
    assert proc.returncode == 0, output[-4000:]
    lines = output.split("\n")

    assert not [line for line in lines if line.startswith("wandb:")], output[-3000:]
    assert "Run summary" not in output and "Run history" not in output
    [offline_run] = (run_dir / "wandb").glob("offline-run-*")
    [summary] = [line for line in lines if line.startswith("[softmax] ")]
    val_loss = json.loads((run_dir / "results.json").read_text())["val_loss"]
    assert re.fullmatch(
        rf"\[softmax\] 4 steps \| val loss {val_loss:.4f} nats/token \| perplexity [\d.]+ \| [\d.]+ bits/byte "
        rf"\(unigram baseline [\d.]+\) \| run dir {re.escape(str(run_dir))} \| wandb offline run "
        rf"{re.escape(str(offline_run))} \(upload: wandb sync {re.escape(str(offline_run))}\)", summary), summary

    backend_line = next(line for line in lines if "attention backend=auto on cpu" in line)
    assert "Sanity Checking" in backend_line  # written while the sanity check's bar was drawn
    into_a_bar = [shown(line) for line in lines
                  if any(m.start() > 0 for start in LOG_LINE_STARTS for m in start.finditer(shown(line)))]
    assert into_a_bar == []
    assert any(LOG_LINE_STARTS[1].match(shown(line)) for line in lines)  # Lightning's line, during the bar too


def test_verbose_command_line_gives_wandb_its_own_output_back(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    try:
        assert command_line.without_verbose_flag(["train.py", "-v", "attn=alsc"]) == ["train.py", "attn=alsc"]
        assert command_line.verbose() and wandb_init_settings() == {}
        assert command_line.without_verbose_flag(["train.py", "attn=alsc"]) == ["train.py", "attn=alsc"]
        assert not command_line.verbose() and wandb_init_settings()["settings"].silent is True
    finally:
        command_line.without_verbose_flag(["pytest"])


def test_filters_are_installed_once_and_match_the_warnings():
    silence_third_party_notices()
    silence_third_party_notices()
    import logging

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(type(f).__name__ == "_DropTips" for f in rank_zero.filters) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_third_party_notices()  # filters added after simplefilter take precedence
        warnings.warn("Your `IterableDataset` has `__len__` defined. In combination with ...", UserWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("an unrelated warning", UserWarning)
    assert [str(w.message) for w in caught] == ["an unrelated warning"]
    assert len(IGNORED_WARNINGS) == 2


def test_broadcast_buffers_is_renamed_where_torch_deprecates_it(monkeypatch):
    kwargs = {"broadcast_buffers": False, "bucket_cap_mb": 512}
    new_torch = "forward_sync_buffers" in inspect.signature(ddp_strategy.DistributedDataParallel).parameters
    got = ddp_strategy.ddp_buffer_kwargs(kwargs)
    assert got == ({"forward_sync_buffers": False, "bucket_cap_mb": 512} if new_torch else kwargs)
    assert kwargs == {"broadcast_buffers": False, "bucket_cap_mb": 512}  # the strategy's own dict unchanged

    class OldDDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=25):
            pass

    monkeypatch.setattr(ddp_strategy, "DistributedDataParallel", OldDDP)
    assert ddp_strategy.ddp_buffer_kwargs(kwargs) == kwargs


@pytest.mark.parametrize("value", [True, False])
def test_model_summary_stays_available_on_request(tmp_path, capfd, value):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 1, "train.val_every": 1,
                                                                "+trainer.enable_model_summary": value})))
    assert ("Trainable params" in capfd.readouterr().out) is value
