"""Reliability guarantees of docs/reliability.md, each proven by a test that can fail:
crash safety (SIGKILL), corrupted inputs, numeric guards, kernel input validation,
determinism and security (weights_only loads, no eval of configs, no writes outside the
run and cache directories)."""

from __future__ import annotations

import ast
import errno
import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


import pytest
import torch

import attn
from data.cache import MANIFEST_NAME
from data.datamodule import TokenDataModule
from runs.checkpoints import atomic_torch_save, load_checkpoint
from training.callbacks.nonfinite_guard import NonFiniteError
from eval.run_logs import metric_by_step, train_losses
from train_helpers import compose_cfg, tiny_overrides, write_corpus

ROOT = Path(__file__).resolve().parents[1]

# Runs a script in a subprocess with two test-only instruments, installed from outside the
# code under test: fsyncs of files whose name contains $PATTERN are recorded in $MARKER (one
# line each) and, from the $SLEEP_FROM-th on, sleep: that window lies between the temp file's
# write and its rename. $STEP_SLEEP slows each training step so that random kills land
# inside training; $VAL_SLEEP marks each validation batch of training in $MARKER and sleeps after it.
INSTRUMENTED = r"""
import os, runpy, sys, time
marker, pattern = os.environ["RELIABILITY_MARKER"], os.environ["RELIABILITY_PATTERN"]
sleep_from, sleep_s = int(os.environ.get("RELIABILITY_SLEEP_FROM", "0")), float(os.environ.get("RELIABILITY_SLEEP", "0"))
real_fsync = os.fsync
def fsync(fd):
    real_fsync(fd)
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if pattern in os.path.basename(name):
        with open(marker, "a") as f:
            f.write(name + "\n")
        with open(marker) as f:
            seen = len(f.read().splitlines())
        if sleep_from and seen >= sleep_from:
            time.sleep(sleep_s)
os.fsync = fsync
step_sleep = float(os.environ.get("RELIABILITY_STEP_SLEEP", "0"))
if step_sleep:
    import models.lit as lit
    real_step = lit.LitGPT.training_step
    def slow_step(self, batch, batch_idx):
        time.sleep(step_sleep)
        return real_step(self, batch, batch_idx)
    lit.LitGPT.training_step = slow_step
val_sleep = float(os.environ.get("RELIABILITY_VAL_SLEEP", "0"))
if val_sleep:  # each validation batch of training (not the sanity check) is marked, then sleeps
    import models.lit as lit
    real_val_step = lit.LitGPT.validation_step
    def slow_val_step(self, batch, batch_idx):
        out = real_val_step(self, batch, batch_idx)
        if not self.trainer.sanity_checking:
            with open(marker, "a") as f:
                f.write(f"validation batch {batch_idx}\n")
            time.sleep(val_sleep)
        return out
    lit.LitGPT.validation_step = slow_val_step
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start_instrumented(script_args: list[str], marker: Path, pattern: str, cwd: Path, sleep_from=0, sleep=0.0,
                       step_sleep=0.0, val_sleep=0.0) -> subprocess.Popen:
    env = {**os.environ, "RELIABILITY_MARKER": str(marker), "RELIABILITY_PATTERN": pattern,
           "RELIABILITY_SLEEP_FROM": str(sleep_from), "RELIABILITY_SLEEP": str(sleep),
           "RELIABILITY_STEP_SLEEP": str(step_sleep), "RELIABILITY_VAL_SLEEP": str(val_sleep),
           "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    # output goes to a file: a full pipe would block the child
    log = open(marker.with_name(marker.name + f".{time.monotonic_ns()}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-c", INSTRUMENTED, *script_args], cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = Path(log.name)
    log.close()
    return proc


def wait_for_lines(marker: Path, count: int, proc: subprocess.Popen, timeout: float = 240.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = marker.read_text().splitlines() if marker.exists() else []
        if len(lines) >= count:
            return lines
        if proc.poll() is not None:
            pytest.fail(f"process ended (rc {proc.returncode}) before {count} marked fsyncs: "
                        f"{proc.log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {count} marked fsyncs within {timeout} s")


def sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def metric_values(run_dir: Path, name: str) -> list[float]:
    return list(metric_by_step(run_dir, name).values())


def train_args(overrides: list[str], run_dir: Path) -> list[str]:
    return [str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]


# ======================================================================== 1. crash safety


def test_sigkill_during_checkpoint_write_and_at_random_moments_then_exact_resume(tmp_path):
    """A SIGKILL while last.ckpt is being written leaves the previous complete last.ckpt;
    kills at random moments never leave an unloadable one; resuming from whatever is left
    reaches the uninterrupted run's losses bitwise."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1500)
    common = {"train.max_steps": 12, "train.val_every": 6, "train.ckpt_every_steps": 2,
              "paths.cache_dir": str(tmp_path / "cache")}
    reference = train.run(compose_cfg(tiny_overrides(tmp_path / "straight", corpus, **common)))
    straight = train_losses(tmp_path / "straight" / "run")

    killed_dir = tmp_path / "killed"
    overrides = tiny_overrides(killed_dir, corpus, **common)
    last = killed_dir / "run" / "checkpoints" / "last.ckpt"

    # (a) killed inside the second write of last.ckpt (step 4), between fsync and rename
    marker = tmp_path / "ckpt_fsyncs.txt"
    proc = start_instrumented(train_args(overrides, killed_dir / "run"), marker, ".last.ckpt.", tmp_path,
                              sleep_from=2, sleep=600)
    lines = wait_for_lines(marker, 2, proc)
    sigkill(proc)
    assert all(line.endswith(".tmp") for line in lines), "last.ckpt is written through a temp file"
    ckpt = load_checkpoint(last)
    assert ckpt["global_step"] == 2, "the interrupted write must not have replaced the step-2 checkpoint"

    # (b) resumed, then killed at random moments (startup, training, validation or a write)
    # kill moments vary per run on purpose (more coverage over time); a failure names its seed,
    # and RELIABILITY_KILL_SEED=<seed> replays it
    seed = int(os.environ.get("RELIABILITY_KILL_SEED", time.time_ns()))
    rng = random.Random(seed)
    for attempt in range(2):
        delay = rng.uniform(2.0, 14.0)
        proc = start_instrumented(train_args(overrides + [f"ckpt_path={last}"], killed_dir / "run"), tmp_path / "none",
                                  "no-such-file", tmp_path, step_sleep=0.4)
        try:
            proc.wait(timeout=delay)
            assert proc.returncode == 0, f"RELIABILITY_KILL_SEED={seed}\n" + proc.log_path.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            sigkill(proc)
        ckpt = load_checkpoint(last)  # never torn, whenever the kill came
        assert 2 <= ckpt["global_step"] <= 12, (f"RELIABILITY_KILL_SEED={seed}", attempt, delay, ckpt["global_step"])

    # (c) resume to the end: the same losses as the uninterrupted run, bitwise on CPU
    resumed_step = load_checkpoint(last)["global_step"]
    final = train.run(compose_cfg(tiny_overrides(tmp_path / "final", corpus, **common) + [f"ckpt_path={last}"]))
    assert final["val_loss"] == reference["val_loss"], f"resumed from step {resumed_step}, RELIABILITY_KILL_SEED={seed}"
    if resumed_step < 12:
        resumed = train_losses(tmp_path / "final" / "run")
        steps = sorted(s for s in resumed if s >= resumed_step)
        assert steps and [resumed[s] for s in steps] == [straight[s] for s in steps], f"resumed from step {resumed_step}"


def test_one_last_checkpoint_always_the_newest(tmp_path, monkeypatch):
    """train.ckpt_every_steps and the validations write the same checkpoints/last.ckpt (no
    last-v1.ckpt), each write newer than the one before, and no every-N write precedes a
    validation at the same step (a kill during that validation would lose it on resume)."""
    from training import train
    from runs.checkpoints import AtomicCheckpointIO

    writes = []
    real_save = AtomicCheckpointIO.save_checkpoint

    def recording_save(self, checkpoint, path, storage_options=None):
        writes.append((Path(path).name, checkpoint["global_step"]))
        return real_save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", recording_save)
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 8, "train.val_every": 3, "train.ckpt_every_steps": 2})))
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert names == ["best.ckpt", "last.ckpt"], names
    last = [step for name, step in writes if name == "last.ckpt"]
    # every-N at 2, 4, 8 is the last step's validation; validations at 3, 6, 8; 6 is not written twice
    assert last == [2, 3, 4, 6, 8], writes
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 8


def test_a_run_directory_held_by_a_live_run_is_refused_and_freed_when_it_ends(tmp_path):
    """Two runs given one hydra.run.dir: the second stops at once naming the holder's pid (it used to
    crash mid-run after mixing files); once the holder is gone, however it ended, the directory is free."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    run_dir = tmp_path / "shared" / "run"
    overrides = tiny_overrides(tmp_path / "shared", corpus, **{"train.max_steps": 40, "train.val_every": 20})
    marker = tmp_path / "fsyncs.txt"
    holder = start_instrumented(train_args(overrides, run_dir), marker, "no-such-file", tmp_path, step_sleep=0.5)
    deadline = time.monotonic() + 120
    while not (run_dir / ".run.lock").is_file() or not (run_dir / ".run.lock").read_text().strip():
        assert holder.poll() is None and time.monotonic() < deadline, holder.log_path.read_text()[-3000:]
        time.sleep(0.05)
    with pytest.raises(ValueError, match=rf"run directory {re.escape(str(run_dir))} is in use by another live run "
                                         rf"\(pid {holder.pid}\)"):
        train.run(compose_cfg(overrides))
    sigkill(holder)
    results = train.run(compose_cfg(tiny_overrides(tmp_path / "shared", corpus, **{"train.max_steps": 2,
                                                                                  "train.val_every": 2})))
    assert results["steps"] == 2


def test_resuming_in_the_same_directory_keeps_the_earlier_metric_rows(tmp_path):
    """Lightning's CSV logger deletes an existing metrics.csv; a run resumed in its own directory
    keeps the rows it logged before and appends the resumed ones. ckpt_path=auto: the same command
    starts fresh in an empty directory and resumes from the directory's own last.ckpt once there is one
    (what a requeued SLURM job runs)."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    common = {"train.max_steps": 8, "train.val_every": 4, "ckpt_path": "auto"}
    first = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **common, **{"train.stop_at_step": 4})))
    assert first["steps"] == 4 and sorted(train_losses(tmp_path / "run")) == [0, 1, 2, 3]
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **common)))
    assert sorted(train_losses(tmp_path / "run")) == list(range(8))
    assert sorted(metric_by_step(tmp_path / "run", "val/loss")) == [3, 7]


def test_resuming_from_a_runs_checkpoint_continues_in_that_run_directory(tmp_path):
    """`python train.py ckpt_path=<run>/checkpoints/last.ckpt` without an output directory writes
    into <run>: one CSV history, its checkpoints, results.json and its train.log; the directory
    Hydra made for the invocation keeps only Hydra's files. Naming an output directory still wins."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    common = {"train.max_steps": 8, "train.val_every": 4, "paths.cache_dir": str(tmp_path / "cache")}
    first = tmp_path / "first"
    overrides = [o for o in tiny_overrides(tmp_path, corpus, **common) if not o.startswith("paths.output_dir=")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, "train.stop_at_step=4", f"hydra.run.dir={first}"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    assert sorted(train_losses(first)) == [0, 1, 2, 3]
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides,
                           f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(train_losses(first)) == list(range(8))  # one history, both halves
    assert json.loads((first / "results.json").read_text())["steps"] == 8
    assert "resuming in the checkpoint's run directory" in (first / "train.log").read_text()
    hydra_dirs = [p for p in (tmp_path / "outputs").rglob(".hydra")]
    assert len(hydra_dirs) == 1  # the invocation's own folder: Hydra's files and nothing of the run
    assert not (hydra_dirs[0].parent / "checkpoints").exists() and not (hydra_dirs[0].parent / "csv").exists()
    elsewhere = tmp_path / "elsewhere"
    subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
                    f"hydra.run.dir={elsewhere}"], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    assert (elsewhere / "results.json").is_file()


def test_sigterm_checkpoints_at_the_next_step_boundary_exits_143_and_resumes_exactly(tmp_path):
    """SIGTERM (SLURM preemption): the run stops at the end of the step it is in, writes
    checkpoints/last.ckpt there (newer than the last validation's), exits with status 143 (not 0),
    writes no results.json, and resuming from that checkpoint reaches the uninterrupted run's
    losses bitwise."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1500)
    common = {"train.max_steps": 12, "train.val_every": 6, "paths.cache_dir": str(tmp_path / "cache")}
    reference = train.run(compose_cfg(tiny_overrides(tmp_path / "straight", corpus, **common)))
    straight = train_losses(tmp_path / "straight" / "run")

    run_dir = tmp_path / "stopped" / "run"
    overrides = tiny_overrides(tmp_path / "stopped", corpus, **common)
    marker = tmp_path / "ckpt_fsyncs.txt"
    proc = start_instrumented(train_args(overrides, run_dir), marker, ".last.ckpt.", tmp_path, step_sleep=0.4)
    wait_for_lines(marker, 1, proc)  # the step-6 validation wrote last.ckpt; training goes on
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    log = proc.log_path.read_text()
    assert proc.returncode == 143, log[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    step = load_checkpoint(last)["global_step"]
    # written at the signal: after step 6 when the signal lands while step 6's validation is still
    # writing its checkpoint (the marker is that write's fsync), later otherwise
    assert 6 <= step < 12, step
    assert f"SIGTERM: stopped after step {step}" in log
    assert not (run_dir / "results.json").exists()
    # every step the checkpoint holds has its logged loss on disk, the last one (deferred to the next
    # batch end, which never came) included
    assert sorted(train_losses(run_dir)) == list(range(step))

    final = train.run(compose_cfg(tiny_overrides(tmp_path / "resumed", corpus, **common) + [f"ckpt_path={last}"]))
    assert final["val_loss"] == reference["val_loss"] and final["steps"] == 12
    resumed = train_losses(tmp_path / "resumed" / "run")
    later = sorted(s for s in resumed if s >= step)
    assert later and [resumed[s] for s in later] == [straight[s] for s in later]


def test_a_sigkill_after_a_checkpoint_keeps_every_logged_row_up_to_it(tmp_path):
    """Lightning's CSV logger writes its file every 100 steps: a SIGKILL lost the curves of steps the
    checkpoint covered, which a resume does not run again. Killed while the step-4 validation's last.ckpt
    is written: the train losses of steps 0-3 and that validation's val/loss are on disk."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 8, "train.val_every": 4})
    marker = tmp_path / "ckpt_fsyncs.txt"
    proc = start_instrumented(train_args(overrides, run_dir), marker, ".last.ckpt.", tmp_path, sleep_from=1, sleep=600)
    wait_for_lines(marker, 1, proc)
    sigkill(proc)
    assert sorted(train_losses(run_dir)) == [0, 1, 2, 3]
    assert sorted(metric_by_step(run_dir, "val/loss")) == [3]


def test_a_validation_interrupted_by_sigterm_runs_again_on_resume(tmp_path):
    """SIGTERM during a validation: the checkpoint is written mid-validation; the resume reruns that
    validation from its first batch (Lightning alone skipped it: its val/loss missing, its model never
    ranked for best.ckpt), and the run ends as the uninterrupted one."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1500)
    common = {"train.max_steps": 8, "train.val_every": 4, "paths.cache_dir": str(tmp_path / "cache")}
    reference = train.run(compose_cfg(tiny_overrides(tmp_path / "straight", corpus, **common)))
    straight_val = metric_by_step(tmp_path / "straight" / "run", "val/loss")

    run_dir = tmp_path / "stopped" / "run"
    marker = tmp_path / "validation_batches.txt"
    proc = start_instrumented(train_args(tiny_overrides(tmp_path / "stopped", corpus, **common), run_dir), marker,
                              "no-such-file", tmp_path, val_sleep=2.0)
    wait_for_lines(marker, 1, proc)  # inside the step-4 validation, after its first batch
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 143, proc.log_path.read_text()[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == 4
    assert 3 not in metric_by_step(run_dir, "val/loss")

    final = train.run(compose_cfg(tiny_overrides(tmp_path / "resumed", corpus, **common) + [f"ckpt_path={last}"]))
    assert metric_by_step(tmp_path / "resumed" / "run", "val/loss") == straight_val  # steps 3 and 7
    assert final["val_loss"] == reference["val_loss"]
    # the validation progress is whole again: a resume from a validation's own checkpoint is not taken
    # for an interrupted one (which would validate twice)
    progress = load_checkpoint(tmp_path / "resumed" / "run" / "checkpoints" / "last.ckpt")["loops"]["fit_loop"]
    total = progress["epoch_loop.val_loop.batch_progress"]["total"]
    assert total["ready"] == total["started"] == total["processed"] == total["completed"]


def test_a_full_disk_is_named_when_a_checkpoint_cannot_be_written(tmp_path, monkeypatch):
    """torch.save reports a full disk as "[enforce fail at inline_container.cc] ... file write failed":
    the error says "no space left", names the file, and the previous checkpoint and the directory
    are left as they were. Another write error with space to spare passes through unchanged."""
    from collections import namedtuple

    import runs.checkpoints as checkpoints

    path = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def failing_save(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: "
                           "file write failed")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoints.torch, "save", failing_save)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 4096))
    with pytest.raises(OSError, match=rf"no space left on the device writing checkpoint {re.escape(str(path))}"):
        atomic_torch_save({"state_dict": {"w": torch.zeros(3)}}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: usage(10**12, 10**9, 10**11))
    with pytest.raises(RuntimeError, match="inline_container"):
        atomic_torch_save({"state_dict": {"w": torch.zeros(3)}}, path)


@pytest.mark.parametrize("code,named", [(errno.EFBIG, "File too large"), (errno.EDQUOT, "Disk quota exceeded")])
def test_a_file_size_limit_or_quota_is_named_as_such_not_as_a_full_disk(tmp_path, monkeypatch, code, named):
    """torch.save wraps the OS's error in "[enforce fail at inline_container.cc] . unexpected pos ..." (seen
    with a file size limit: the OSError is its context); with little space left on the device it was
    reported as a full disk. The OS's own reason is named, with the file."""
    from collections import namedtuple

    import runs.checkpoints as checkpoints

    path = tmp_path / "last.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def failing_save(obj, f):
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726") from None

    monkeypatch.setattr(checkpoints.torch, "save", failing_save)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: namedtuple("usage", "total used free")(1, 1, 4096))
    with pytest.raises(OSError, match=rf"^\[Errno {code}\] {named} writing checkpoint {re.escape(str(path))} \(the "
                                      rf"previous last.ckpt is intact\)") as info:
        atomic_torch_save({"state_dict": {"w": torch.zeros(3)}}, path)
    assert info.value.errno == code and "no space left" not in str(info.value)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


CACHE_BUILD = r"""
import sys
from data.datamodule import TokenDataModule
corpus, cache = sys.argv[1:3]
dm = TokenDataModule(source={"kind": "text", "path": corpus}, tokenizer={"kind": "byte"}, cache_dir=cache,
                     seq_len=16, batch_size=4, val_tokens=1000, seed=0)
dm.prepare_data()
"""


def test_sigkill_during_tokenization_then_rerun_rebuilds_the_same_cache(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=2000)
    script = tmp_path / "build_cache.py"
    script.write_text(CACHE_BUILD)
    # killed while val.bin is being written (train.bin already complete, no manifest yet)
    marker = tmp_path / "fsyncs.txt"
    proc = start_instrumented([str(script), str(corpus), str(tmp_path / "cache")], marker, "val.bin.tmp-", tmp_path,
                              sleep_from=1, sleep=600)
    wait_for_lines(marker, 1, proc)
    sigkill(proc)
    directory = next(p for p in (tmp_path / "cache" / "tokens").glob("text-*") if p.is_dir())
    assert (directory / "train.bin").is_file() and not (directory / MANIFEST_NAME).exists()
    assert list(directory.glob("val.bin.tmp-*")), "the kill left the half-written temp file"

    def build(cache_dir: Path) -> TokenDataModule:
        dm = TokenDataModule(source={"kind": "text", "path": str(corpus)}, tokenizer={"kind": "byte"},
                             cache_dir=str(cache_dir), seq_len=16, batch_size=4, val_tokens=1000, seed=0)
        dm.prepare_data()
        dm.setup()
        return dm

    with caplog.at_level(logging.WARNING, logger="data.cache"):
        rerun = build(tmp_path / "cache")
    assert any("partial cache" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    clean = build(tmp_path / "clean_cache")
    assert not list(rerun.cache_path.glob("*.tmp-*")), "stale temp files are removed by the rebuild"
    for name in ("train.bin", "val.bin", "test.bin"):
        assert (rerun.cache_path / name).read_bytes() == (clean.cache_path / name).read_bytes(), name
    strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k != "created_utc"}
    assert strip(rerun.cache_path / MANIFEST_NAME) == strip(clean.cache_path / MANIFEST_NAME)


# ======================================================================== 2. corrupted inputs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny finished run: (its tmp dir, corpus, last.ckpt)."""
    from training import train

    tmp = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(tmp / "corpus.txt", lines=1000)
    train.run(compose_cfg(tiny_overrides(tmp, corpus, **{"train.max_steps": 4, "train.val_every": 4})))
    return tmp, corpus, tmp / "run" / "checkpoints" / "last.ckpt"


def tensor_offset(path: Path) -> int:
    """Byte offset in the file of the data of the largest weight (a flip there changes a value)."""
    state = load_checkpoint(path)["state_dict"]
    name = max(state, key=lambda k: state[k].numel())
    offset = path.read_bytes().find(state[name].numpy().tobytes())
    assert offset > 0
    return offset + state[name].numel() * state[name].element_size() // 2


def flip_byte(src: Path, dst: Path, offset: int) -> Path:
    payload = bytearray(src.read_bytes())
    payload[offset] ^= 0x04
    dst.write_bytes(bytes(payload))
    return dst


@pytest.mark.parametrize("damage", ["truncated", "bit-flip-in-weights"])
def test_corrupt_checkpoint_as_ckpt_path_is_a_clear_error_from_load_checkpoint(trained, tmp_path, damage):
    from training import train

    _, corpus, last = trained
    bad = tmp_path / "bad.ckpt"
    if damage == "truncated":
        bad.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    else:
        flip_byte(last, bad, tensor_offset(last))
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus) + [f"ckpt_path={bad}"])
    with pytest.raises(ValueError, match=rf"checkpoint {bad} (cannot be read safely|fails its content sha256)") as info:
        train.run(cfg)
    assert Path(info.traceback[-1].path).name == "checkpoints.py", "raised by load_checkpoint itself"
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before training started"


def test_no_bit_flip_loads_silently_different_values(trained, tmp_path):
    """Flips spread over the whole file: each either raises a ValueError or loads the
    identical checkpoint (a flip in zip padding or in an unused header field)."""
    _, _, last = trained
    original = load_checkpoint(last)
    size = last.stat().st_size
    silent = 0
    for i, offset in enumerate(range(7, size, max(1, size // 60))):
        try:
            loaded = load_checkpoint(flip_byte(last, tmp_path / f"flip{i}.ckpt", offset))
        except ValueError:
            continue
        silent += 1
        for key, value in original["state_dict"].items():
            assert torch.equal(loaded["state_dict"][key], value), f"flip at byte {offset} changed {key} silently"
        assert loaded["global_step"] == original["global_step"]
    assert silent < 30, "most flips must be detected"


def test_checkpoint_without_training_fields_is_refused(tmp_path):
    path = tmp_path / "weights.pt"
    atomic_torch_save({"w": torch.ones(2)}, path)
    with pytest.raises(ValueError, match=r"is not an attnlab training checkpoint"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"checkpoint not found: .*missing\.ckpt"):
        load_checkpoint(tmp_path / "missing.ckpt")


def byte_dm(corpus: Path, cache_dir: Path, **source) -> TokenDataModule:
    return TokenDataModule(source={"kind": "text", "path": str(corpus), **source}, tokenizer={"kind": "byte"},
                           cache_dir=str(cache_dir), seq_len=16, batch_size=4, val_tokens=1000, seed=0)


def edit_manifest_tokens(directory: Path) -> None:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["splits"]["val"]["tokens"] += 5
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def lengthen_shard(directory: Path) -> None:
    with open(directory / "train.bin", "ab") as f:
        f.write(b"\x00\x01" * 3)


@pytest.mark.parametrize(
    "damage, reason",
    [(edit_manifest_tokens, r"shard val\.bin has \d+ bytes, the manifest says"),
     (lengthen_shard, r"shard train\.bin has \d+ bytes, the manifest says")],
    ids=["manifest-does-not-match-shards", "shard-of-wrong-length"],
)
def test_cache_mismatch_is_named_and_rebuilt(tmp_path, caplog, damage, reason):
    """Recovery: the cache is derived data, so a mismatch is logged (naming the file) and rebuilt."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=500)
    dm = byte_dm(corpus, tmp_path / "cache")
    dm.prepare_data()
    dm.setup()
    original = {name: (dm.cache_path / name).read_bytes() for name in ("train.bin", "val.bin", "test.bin")}
    damage(dm.cache_path)
    # setup() alone (no prepare_data) runs the cheap size check and must not read a mismatched shard
    with caplog.at_level(logging.WARNING, logger="data.cache"):
        again = byte_dm(corpus, tmp_path / "cache")
        again.setup()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "data.cache"]
    assert len(warnings) == 1 and "rebuilding" in warnings[0]
    assert re.search(reason, warnings[0]), warnings[0]
    for name, payload in original.items():
        assert (again.cache_path / name).read_bytes() == payload


def test_empty_train_file_names_the_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=rf"the train split .* is empty: data\.source\.path \({empty}\) holds no rows"):
        byte_dm(empty, tmp_path / "cache").prepare_data()


def test_non_utf8_text_file_is_an_error_naming_file_byte_and_line(tmp_path):
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes("ok line\nsecond line\n".encode() * 50 + "caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"data\.source\.path: {corpus} is not valid UTF-8 \(byte 1003, line 101"):
        byte_dm(corpus, tmp_path / "cache").prepare_data()
    assert not (tmp_path / "cache" / "tokens").exists() or not any((tmp_path / "cache" / "tokens").rglob("*.bin"))


def test_non_utf8_sequence_split_across_read_chunks_is_located(tmp_path):
    from data.sources import check_utf8

    path = tmp_path / "f.txt"
    path.write_bytes(b"a" * 9 + "é".encode() + b"\n" + b"\xff")  # é's 2 bytes straddle the 10-byte chunks
    with pytest.raises(ValueError, match=r"is not valid UTF-8 \(byte 12, line 2"):
        check_utf8(path, "path", chunk_bytes=10)
    path.write_bytes(b"abc" + "é".encode()[:1])  # truncated sequence at the end of the file
    with pytest.raises(ValueError, match=r"is not valid UTF-8 \(byte 3, line 1"):
        check_utf8(path, "path", chunk_bytes=2)


def test_split_empty_after_filtering_is_a_clear_error(tmp_path):
    """jsonl rows whose text is null or empty are dropped: a val split of only such rows is refused."""
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps({"text": f"document {i} with words"}) + "\n" for i in range(50)))
    val_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", None, "", None]))
    dm = TokenDataModule(source={"kind": "jsonl", "path": str(train_file), "val_path": str(val_file),
                                 "test_fraction": 0.1},
                         tokenizer={"kind": "byte"}, cache_dir=str(tmp_path / "cache"), seq_len=16, batch_size=4,
                         val_tokens=1000, seed=0)
    with pytest.raises(ValueError, match=r"the val split of data source .* is empty \(no document with text\)"):
        dm.prepare_data()


# ======================================================================== 3. numeric guards


def poison_layer(monkeypatch, bad_steps: set[int], kind: str):
    """Make the built model produce inf: 'forward' makes block 1's MLP output inf at the
    given steps; 'grad' makes only the gradient of block 0's MLP down-projection inf; 'loss'
    adds inf to the model's loss, a constant that leaves every gradient finite."""
    from training import train

    real_build = train.build_model

    def build(*args, **kwargs):
        lit = real_build(*args, **kwargs)

        def active() -> bool:
            return lit.training and lit._trainer is not None and lit.trainer.global_step in bad_steps

        if kind == "forward":
            lit.model.blocks[1].mlp.register_forward_hook(lambda m, a, out: out * float("inf") if active() else out)
        elif kind == "loss":
            lit.model.register_forward_hook(lambda m, a, out: out + float("inf") if active() else out)
        else:
            weight = lit.model.blocks[0].mlp.down.weight
            weight.register_hook(lambda g: torch.full_like(g, float("inf")) if active() else g)
        return lit

    monkeypatch.setattr(train, "build_model", build)


class RecordingFusedAdamW(torch.optim.AdamW):
    """Fused AdamW (as on GPU) that records the guard's on-device skip flag at each step."""

    flags: list[float] = []

    def __init__(self, *args, fused=None, **kwargs):
        super().__init__(*args, fused=True, **kwargs)

    def step(self, closure=None):
        out = super().step(closure)
        RecordingFusedAdamW.flags.append(float(self.found_inf))
        return out


@pytest.mark.parametrize("optimizer", ["unfused", "fused", "fused_captured"])
def test_nonfinite_steps_are_skipped_counted_and_logged(tmp_path, monkeypatch, optimizer):
    """unfused (AdamW's CPU default): the host-synced path (gradients dropped); fused: the skip
    stays on the device (the optimizer's found_inf flag, no host sync); fused_captured: the same
    under train.cuda_graphs=step, whose flag is computed inside the captured step (a stand-in of
    the CUDA graph on CPU; the bad steps come after the capture)."""
    from training import train

    bad, steps = {2, 4}, 6
    if optimizer.startswith("fused"):
        RecordingFusedAdamW.flags = []
        monkeypatch.setattr(torch.optim, "AdamW", RecordingFusedAdamW)
    if optimizer == "fused_captured":
        from models.captured_step import WARMUP_CALLS
        from train_helpers import use_eager_captured_step

        calls = use_eager_captured_step(monkeypatch)
        # replays (the call after the warm-up captures), a good one between and after
        bad, steps = {WARMUP_CALLS + 1, WARMUP_CALLS + 3}, WARMUP_CALLS + 5
    poison_layer(monkeypatch, bad, "forward")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "skip",
                                                                        "train.max_steps": steps})))
    assert metric_values(tmp_path / "run", "train/nonfinite_steps")[-1] == 2.0
    losses = [v for _, v in sorted(train_losses(tmp_path / "run").items())]
    assert len(losses) == steps and sum(not torch.isfinite(torch.tensor(v)) for v in losses) == 2
    assert torch.isfinite(torch.tensor(losses[-1]))
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values()), "no inf/NaN reached the weights"
    assert torch.isfinite(torch.tensor(results["val_loss"]))
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["nonfinite_steps"] == saved["nonfinite_steps"] == 2  # the run reports what it skipped
    guard_state = next(v for k, v in state["callbacks"].items() if k.startswith("NonFiniteGuard"))
    assert guard_state == {"nonfinite_steps": 2}, "the count survives a resume"
    adam_steps = {float(s["step"]) for s in state["optimizer_states"][0]["state"].values()}
    assert adam_steps == {steps - 2.0}, "2 steps skipped: AdamW's step count and moments untouched by them"
    if optimizer.startswith("fused"):
        assert RecordingFusedAdamW.flags == [float(step in bad) for step in range(steps)]
    if optimizer == "fused_captured":
        assert [calls[step] for step in sorted(bad)] == [True, True], calls


@pytest.mark.parametrize("optimizer", ["unfused", "fused"])
def test_a_nonfinite_loss_with_finite_gradients_is_skipped(tmp_path, monkeypatch, optimizer):
    """The loss flag on its own: an inf loss whose gradients all stay finite (the logged gradient
    norms show it) is skipped as well, on both paths, though the gradient check sees nothing."""
    from training import train

    if optimizer == "fused":
        RecordingFusedAdamW.flags = []
        monkeypatch.setattr(torch.optim, "AdamW", RecordingFusedAdamW)
    poison_layer(monkeypatch, {1, 3}, "loss")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "skip"})))
    losses = train_losses(tmp_path / "run")
    assert sorted(s for s, v in losses.items() if not math.isfinite(v)) == [1, 3], losses
    grad_norms = metric_by_step(tmp_path / "run", "train/grad_norm")
    assert len(grad_norms) == 6 and all(math.isfinite(v) for v in grad_norms.values()), grad_norms
    assert results["nonfinite_steps"] == 2
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    adam_steps = {float(s["step"]) for s in state["optimizer_states"][0]["state"].values()}
    assert adam_steps == {4.0}, "6 steps, 2 skipped on their loss"
    if optimizer == "fused":
        assert RecordingFusedAdamW.flags == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_strategies_that_shard_gradients_are_recognized():
    """The guard's predicate for all-reducing its skip flag: FSDP ranks each check their own
    gradient shard (they must agree); DDP gradients are identical after its all-reduce. (The
    collective itself needs a sharded multi-GPU run: not covered on CPU.)"""
    from types import SimpleNamespace

    import lightning as L

    from training.sharding import shards_gradients

    assert not shards_gradients(SimpleNamespace(world_size=1, strategy=L.pytorch.strategies.FSDPStrategy()))
    assert shards_gradients(SimpleNamespace(world_size=2, strategy=L.pytorch.strategies.FSDPStrategy()))
    assert not shards_gradients(SimpleNamespace(world_size=2, strategy=L.pytorch.strategies.DDPStrategy()))
    from training.ddp_strategy import CurrentStreamDDPStrategy  # trainer=ddp's

    assert not shards_gradients(SimpleNamespace(world_size=2, strategy=CurrentStreamDDPStrategy()))


def test_callback_forwards_reach_sharded_parameters_through_the_wrapper():
    """The guard's and the max-logit monitor's extra forwards: under FSDP on several GPUs the
    root's parameters are gathered only inside the wrapper's forward (a direct call saw the
    flat 1-D shards: "'weight' must be 2-D" on 2 H200s), so the call must pass through it;
    under DDP it goes direct."""
    from types import SimpleNamespace

    import lightning as L

    from training.sharding import call_with_whole_params

    class Lit(L.LightningModule):
        def probe(self, x, scale=1):
            return x * scale

    class Wrapper(torch.nn.Module):  # stands in for FullyShardedDataParallel
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.inner(*args, **kwargs)

    for strategy, world_size, through_wrapper in ((L.pytorch.strategies.FSDPStrategy(), 2, 1),
                                                  (L.pytorch.strategies.DDPStrategy(), 2, 0),
                                                  (L.pytorch.strategies.FSDPStrategy(), 1, 0)):
        lit = Lit()
        wrapper = Wrapper(lit)
        strategy.model = wrapper
        trainer = SimpleNamespace(world_size=world_size, strategy=strategy)
        assert call_with_whole_params(trainer, lit, "probe", 2, scale=3) == 6
        assert wrapper.calls == through_wrapper, type(strategy).__name__
        assert lit.forward.__func__ is L.LightningModule.forward  # restored after the redirection


def test_without_the_guard_the_same_fault_poisons_the_weights(tmp_path, monkeypatch):
    """The control for the test above: it would fail if the guard did nothing."""
    from training import train

    poison_layer(monkeypatch, {2}, "forward")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "off", "train.max_steps": 4,
                                                                 "train.val_every": 4})))
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["state_dict"]
    assert not all(torch.isfinite(v).all() for v in state.values())


def test_nonfinite_loss_stops_naming_step_and_first_module(tmp_path, monkeypatch):
    from training import train

    poison_layer(monkeypatch, {3}, "forward")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    with pytest.raises(NonFiniteError) as info:
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "stop"})))
    message = str(info.value)
    assert "global step 3" in message and "loss is not finite" in message
    assert "first module with a non-finite forward output: model.blocks.1.mlp" in message
    assert "first parameter with a non-finite gradient: model." in message


def test_nonfinite_gradient_with_finite_loss_stops_naming_the_parameter(tmp_path, monkeypatch):
    from training import train

    poison_layer(monkeypatch, {1}, "grad")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    with pytest.raises(NonFiniteError, match=r"global step 1 .*; loss is finite; first parameter with a non-finite "
                                             r"gradient: model\.blocks\.0\.mlp\.down\.weight"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "stop"})))


def test_bad_nonfinite_policy_is_named(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=200)
    with pytest.raises(ValueError, match=r"train\.nonfinite must be one of \('skip', 'stop', 'off'\), got 'ignore'"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.nonfinite": "ignore"})))
    with pytest.raises(ValueError, match=r"train\.ckpt_every_steps must be null or a positive int, got 0"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.ckpt_every_steps": 0})))


def test_max_logit_per_layer_is_logged_and_correct(trained):
    """val/max_logit/layer{i} equals the max scaled q.k over visible pairs of the first
    validation batch, recomputed here independently with the final weights."""
    tmp, _, last = trained
    logged = [metric_values(tmp / "run", f"val/max_logit/layer{i}") for i in range(2)]
    assert all(len(v) >= 1 for v in logged)
    from models.lit import LitGPT

    ckpt = load_checkpoint(last)
    lit = LitGPT(**ckpt["hyper_parameters"])
    lit.load_state_dict(ckpt["state_dict"])
    lit.eval()
    cfg = compose_cfg(tiny_overrides(tmp, tmp / "corpus.txt"))
    from hydra.utils import instantiate

    dm = instantiate(cfg.data)
    dm.setup("validate")
    x = next(iter(dm.val_dataloader()))[0]
    with torch.no_grad():
        h = lit.model.embed(x)
        expected = []
        for block in lit.model.blocks:
            qs, ks, _ = block.attn.split_heads(block.norm1(h))
            s = torch.einsum("bihd,bjhd->bhij", qs[0], ks[0]) * block.attn.spec.scale(qs[0].shape[-1])
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            expected.append(s.masked_fill(~causal, -float("inf")).amax().item())
            h = block(h)
    # the final validation (trainer.validate after fit) used these weights
    assert [v[-1] for v in logged] == pytest.approx(expected, rel=1e-5)


# ======================================================================== 4. kernel input validation

B, N, H, D = 2, 8, 4, 16


def qkv(h_kv=2, d=D, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, N, H, d, generator=gen).to(dtype), torch.randn(B, N, h_kv, d, generator=gen).to(dtype),
            torch.randn(B, N, h_kv, d, generator=gen).to(dtype))


BAD_INPUTS = {
    "k-dtype": (lambda q, k, v: dict(k=k.half()), r"k must have the dtype of q"),
    "v-device": (lambda q, k, v: dict(v=v.to("meta")), r"v must be on the device of q"),
    "k-ndim": (lambda q, k, v: dict(k=k[0]), r"k must have 4 dims"),
    "q-shape": (lambda q, k, v: dict(q=q[:, :, :, :8]), r"k must have shape \(B, KV, H_kv, D\) = \(2, KV >= 8, H_kv, 8\)"),
    "gqa-heads": (lambda q, k, v: dict(k=k[:, :, :1].expand(B, N, 3, D).contiguous(), v=v[:, :, :1].expand(B, N, 3, D).contiguous()),
                  r"query heads \(4\) must be divisible by k's heads H_kv \(3\)"),
    "segment-value": (lambda q, k, v: dict(segment_ids=torch.tensor([[1, 1, 2, -1, -1, 0, 0, 0]] * B)),
                      r"segment_ids values must be in \{1 \(history\), -1 \(candidate\), 0 \(padding\)\}"),
    "segment-history-gap": (lambda q, k, v: dict(segment_ids=torch.tensor([[1, 0, 1, -1, -1, 0, 0, 0]] * B)),
                            r"segment_ids: the history \(1\) positions must form one contiguous range"),
    "segment-candidate-gap": (lambda q, k, v: dict(segment_ids=torch.tensor([[1, 1, -1, 0, -1, 0, 0, 0]] * B)),
                              r"segment_ids: the candidate \(-1\) positions must form one contiguous range"),
    "temperature-shape": (lambda q, k, v: dict(temperature=torch.ones(B, N, H)), r"temperature must have 2 dims"),
    "temperature-transposed": (lambda q, k, v: dict(temperature=torch.ones(N, B)),
                               r"temperature must have shape \(B, N\) = \(2, 8\), got \(8, 2\)"),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_kernel_inputs_are_value_errors_naming_the_argument(backend, case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = qkv()
    change, message = BAD_INPUTS[case]
    args = {"q": q, "k": k, "v": v, **change(q, k, v)}
    with pytest.raises(ValueError, match=message):
        attn.attention(args.pop("q"), args.pop("k"), args.pop("v"), spec, backend=backend, **args)


@pytest.mark.parametrize("d, dtype, message", [
    (24, torch.float32, r"head dim D must be one of \(16, 32, 64, 128\) for backend='triton', got 24"),
    (256, torch.float32, r"head dim D must be one of \(16, 32, 64, 128\) for backend='triton', got 256"),
    (16, torch.float64, r"q\.dtype must be float16, bfloat16 or float32 for backend='triton'"),
])
@pytest.mark.parametrize("variant", ["softmax", "threshold"])
def test_kernel_limits_under_the_interpreter(d, dtype, message, variant, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = qkv(d=d, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        attn.attention(q, k, v, attn.get_variant(variant).make_spec(), backend="triton")


def test_valid_inputs_pass_on_both_backends(monkeypatch):
    """The control: the same tensors without the fault run and agree across backends."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = attn.get_variant("softmax").make_spec()
    q, k, v = qkv()
    seg = torch.tensor([[1, 1, 1, -1, -1, 0, 0, 0]] * B)
    temp = torch.full((B, N), 1.5)
    ref = attn.attention(q, k, v, spec, backend="reference", segment_ids=seg, temperature=temp)
    tri = attn.attention(q, k, v, spec, backend="triton", segment_ids=seg, temperature=temp)
    valid = seg != 0
    torch.testing.assert_close(tri[valid], ref[valid], atol=2e-5, rtol=1e-4)


# ======================================================================== 5. determinism


def test_deterministic_runs_give_bitwise_equal_losses(tmp_path, monkeypatch):
    """Two deterministic=true runs through the fused kernels (the interpreter here) give the same
    losses bit for bit, with the kernel configs pinned (what keeps a GPU from choosing tiles by
    timing: test_softmax_family.py::test_pinned_configs_skip_timing; on the GPU itself
    scripts/gpu_checks/check_train_determinism.py)."""
    from training import train

    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    cublas_before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    pinned_while_running = []
    build_model = train.build_model
    monkeypatch.setattr(train, "build_model", lambda *args, **kwargs: (
        pinned_while_running.append(os.environ.get("ATTNLAB_AUTOTUNE")), build_model(*args, **kwargs))[1])

    corpus = write_corpus(tmp_path / "corpus.txt", lines=1000)
    runs = []
    for name in ("a", "b"):
        overrides = tiny_overrides(tmp_path / name, corpus, **{"deterministic": True, "train.max_steps": 5,
                                                                 "train.val_every": 5, "attn.backend": "triton",
                                                                 "paths.cache_dir": str(tmp_path / "cache")})
        results = train.run(compose_cfg(overrides))
        runs.append((train_losses(tmp_path / name / "run"), results["val_loss"]))
    (losses_a, val_a), (losses_b, val_b) = runs
    assert len(losses_a) == 5 and losses_a == losses_b and val_a == val_b
    assert pinned_while_running == ["0", "0"]  # kernel tiles pinned (GPU: no timing-based choice)
    # and given back: the next run in this process (a multirun's next job) is neither pinned nor
    # in torch's deterministic mode unless it asks
    assert "ATTNLAB_AUTOTUNE" not in os.environ and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == cublas_before
    assert not torch.are_deterministic_algorithms_enabled()


# ======================================================================== 6. security


def python_sources() -> list[Path]:
    """Every Python file of the project (not the venv, not generated outputs)."""
    skip = {"outputs", "multirun", "attnlab.egg-info"}

    def ours(parts) -> bool:  # hidden folders hold virtualenvs (.venv, CI's .ci-venv), caches, git
        return not skip.intersection(parts) and not any(part.startswith(".") for part in parts)

    return [p for p in ROOT.rglob("*.py") if ours(p.relative_to(ROOT).parts)]


def calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            yield node, owner, name


def test_torch_load_only_with_weights_only_true():
    """Outside tests/, every torch.load( passes weights_only=True (a literal True)."""
    offenders, seen = [], 0
    for path in python_sources():
        if path.relative_to(ROOT).parts[0] == "tests":
            continue
        for node, owner, name in calls(ast.parse(path.read_text(), str(path))):
            if owner == "torch" and name == "load":
                seen += 1
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not ok:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert seen >= 1, "the scan found the loader in runs/checkpoints.py"
    assert not offenders, offenders


# resolvers that only format strings or list config names (each tested below on hostile input)
STRING_ONLY_RESOLVERS = {"training/run_label.py", "runs/config_dir.py"}


def test_the_run_label_resolver_only_formats_strings():
    from omegaconf import OmegaConf

    import training.run_label  # noqa: F401  (registers attnlab_folder_label)

    cfg = OmegaConf.create({"d": "attn.params.cap=__import__('os').system('x'),seed=1",
                            "label": "${attnlab_folder_label:softcap_tanh,${d}}"})
    assert cfg.label == "softcap_tanh+cap-__import__-os-.system-x"


def test_the_group_options_resolver_takes_group_names_only():
    from omegaconf import OmegaConf

    from runs.config_dir import group_options  # registers attnlab_group_options

    assert group_options("data/tokenizer") == "bpe, byte, char, pretrained"
    for hostile in ("../..", "/etc", "data/../..", "__import__('os').system('x')", ""):
        with pytest.raises(ValueError, match="config group"):
            group_options(hostile)
    with pytest.raises(ValueError, match="no config group 'nothing'"):
        group_options("nothing")
    cfg = OmegaConf.create({"listed": "${attnlab_group_options:data/tokenizer}"})
    assert cfg.listed == "bpe, byte, char, pretrained"


def test_no_code_evaluation_of_configs_or_files():
    """No eval/exec/compile of strings, no pickle/marshal/yaml.load (unsafe) and no
    OmegaConf resolver that evaluates, anywhere in the project's code outside tests/."""
    offenders = []
    for path in python_sources():
        if path.relative_to(ROOT).parts[0] == "tests":
            continue
        text = path.read_text()
        for node, owner, name in calls(ast.parse(text, str(path))):
            literal_import = name == "__import__" and node.args and isinstance(node.args[0], ast.Constant)
            bad = (owner is None and name in {"eval", "exec", "compile", "__import__"} and not literal_import) \
                or (owner in {"pickle", "marshal", "dill", "cloudpickle"} and name in {"load", "loads"}) \
                or (owner == "yaml" and name in {"load", "unsafe_load", "full_load"}) \
                or (owner == "OmegaConf" and name == "register_new_resolver"
                    and str(path.relative_to(ROOT)) not in STRING_ONLY_RESOLVERS)
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner or ''}.{name}")
    assert not offenders, offenders
    for cfg in (ROOT / "configs").rglob("*.yaml"):
        assert "${eval:" not in cfg.read_text() and "${python:" not in cfg.read_text(), cfg


class _Payload:
    """Unpickling this would create the marker file (arbitrary code at load time)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_with_a_pickled_object_is_refused_without_running_it(trained, tmp_path):
    _, _, last = trained
    ckpt = load_checkpoint(last)
    marker = tmp_path / "code_ran"
    ckpt["extra"] = _Payload(marker)
    evil = tmp_path / "evil.ckpt"
    torch.save(ckpt, evil)
    with pytest.raises(ValueError, match=rf"checkpoint {evil} cannot be read safely"):
        load_checkpoint(evil)
    assert not marker.exists(), "the pickled object's code must not run"
    torch.load(evil, weights_only=False)  # the control: an unsafe load would have run it
    assert marker.exists()


def test_paths_are_reported_and_nothing_is_written_outside_run_and_cache(tmp_path):
    """python train.py from an empty cwd with HOME and TMPDIR inside tmp: afterwards, new
    files exist only under the run and cache directories, and both are logged resolved."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    cwd, home, tmpdir = tmp_path / "cwd", tmp_path / "home", tmp_path / "tmpdir"
    for d in (cwd, home, tmpdir):
        d.mkdir()
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    overrides = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_", "WANDB_DIR", "TRITON_CACHE",
                                                                  "TORCHINDUCTOR", "MPLCONFIG", "ATTNLAB_CACHE"))}
    # ATTNLAB_CACHE_DIR (the documented way to move the cache) also places matplotlib's font cache
    env.update(HOME=str(home), TMPDIR=str(tmpdir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(ROOT), ATTNLAB_CACHE_DIR=str(cache_dir))
    before = {p for p in tmp_path.rglob("*")}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    created = {p for p in tmp_path.rglob("*") if p.is_file()} - before
    outside = sorted(str(p.relative_to(tmp_path)) for p in created
                     if not (p.is_relative_to(run_dir) or p.is_relative_to(cache_dir)))
    assert not outside, outside
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    output = proc.stdout + proc.stderr
    assert f"run dir: {run_dir.resolve()}" in output and f"cache dir: {cache_dir.resolve()}" in output


# ======================================================================== 7. non-finite inputs in the kernels


@pytest.mark.parametrize("name", attn.variant_names())
def test_nonfinite_inputs_propagate_in_the_kernels_as_in_the_reference(name, monkeypatch):
    """A NaN query row, a NaN key or a non-finite temperature gives NaN exactly where the reference
    gives NaN (the kernels turned them into zeros: the non-finite guard never saw them), and
    non-finite gradients whenever the reference's are. (tests/test_gpu.py: the same on a GPU, bf16 too.)"""
    from attn.testing import nonfinite_cases, nonfinite_pattern

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = attn.get_variant(name).make_spec()
    for label, tensors in nonfinite_cases(name, torch.device("cpu"), torch.float32):
        (ref_nan, ref_finite), (ker_nan, ker_finite) = (nonfinite_pattern(spec, tensors, b) for b in ("reference", "triton"))
        assert ref_nan.any(), label  # the case does poison something
        assert torch.equal(ker_nan, ref_nan), f"{name}, {label}: NaN at {ker_nan.nonzero().tolist()} vs {ref_nan.nonzero().tolist()}"
        assert ker_finite == ref_finite, f"{name}, {label}: gradients finite {ker_finite}, reference {ref_finite}"
