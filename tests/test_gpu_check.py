"""scripts/gpu_check.py, the GPU entry, on CPU: its phases name files that exist, steps are dealt to
the GPUs there are, and a call keeps to its budget (a step past its limit is stopped, one that would
start too late is not started) and leaves its summary and archive."""

import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check as gc  # noqa: E402


def test_every_step_names_files_that_exist():
    for steps in gc.PHASES.values():
        assert len({s.name for s in steps}) == len(steps)
        for step in steps:
            assert step.kind in ("timed", "check", "all")
            for part in step.cmd:
                if part.startswith(("scripts/", "tests/")) or part == "train.py":
                    assert (ROOT / part).is_file(), (step.name, part)


def test_targets_resolve_to_steps_in_order_and_unknown_ones_are_named():
    chosen = gc.resolve(["train:small", "kernels", "kernels:pytest"])
    assert [(p, s.name) for p, s in chosen] == [("train", "small"), ("kernels", "pytest"),
                                                ("kernels", "softmax_family"), ("kernels", "threshold_family"),
                                                ("kernels", "gluon_softmax"), ("kernels", "gluon_softmax_bwd"),
                                                ("kernels", "gluon_weighted_bwd")]
    with pytest.raises(ValueError, match="unknown phase 'kernel'; phases: kernels, sanitize"):
        gc.resolve(["kernel"])
    with pytest.raises(ValueError, match="phase bench has no step 'x'; its steps: main, masks"):
        gc.resolve(["bench:x"])


def test_steps_are_dealt_to_every_gpu():
    chosen = gc.resolve(["bench", "ddp"])
    lanes, every, unfit = gc.plan(chosen, 1)
    assert [s.name for _, s in lanes[0]] == [s.name for s in gc.PHASES["bench"]]  # one GPU: in order
    assert [s.name for _, s in every] == ["fsdp"] and [s.name for _, s in unfit] == ["allreduce", "scaling"]
    lanes, every, unfit = gc.plan(chosen, 2)
    assert all(lanes) and sum(map(len, lanes)) == len(gc.PHASES["bench"])
    assert [s.name for _, s in every] == ["allreduce", "scaling", "fsdp"] and not unfit
    # consecutive checks share their GPU; a timed step runs alone
    lane = gc.resolve(["train"])
    assert [[s.name for _, s in b] for b in gc.batches(lane)][:3] == [
        ["small"], ["determinism", "captured_vs_eager", "host_syncs"], ["gpt2_small_softmax_family"]]


def test_a_call_keeps_to_its_budget_and_leaves_its_results(tmp_path, monkeypatch):
    py = sys.executable
    monkeypatch.setattr(gc, "MIN_START_S", 2)
    monkeypatch.setattr(gc, "PHASES", {"fake": [
        gc.Step("quick", 30, (py, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1], 'r.txt').write_text('x')",
                              "{dir}")),
        gc.Step("fails", 30, (py, "-c", "raise SystemExit(3)"), kind="check"),
        gc.Step("hangs", 2, (py, "-c", "import time; print('started', flush=True); time.sleep(60)")),
        gc.Step("late", 30, (py, "-c", "pass")),
    ]})
    monkeypatch.setattr(gc, "environment", lambda: {})
    monkeypatch.setattr(gc, "describe", lambda env: "environment\n")
    out = tmp_path / "out"
    assert gc.main(["--gpus", "1", "--budget", "4", "--out", str(out), "fake"]) == 1
    summary = (out / "summary.txt").read_text().splitlines()
    status = {line.split()[0]: line.split(None, 1)[1] for line in summary}
    assert status["fake:quick"].startswith("ok ")
    assert status["fake:hangs"].startswith("timed out (2s)")
    assert status["fake:fails"].startswith("failed (exit 3)")
    assert status["fake:late"].startswith("not started (budget)")
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
        assert {"gpu_check/fake/quick/r.txt", "gpu_check/fake/hangs/log.txt", "gpu_check/summary.txt",
                "gpu_check/environment.txt"} <= names
        assert b"started" in tar.extractfile("gpu_check/fake/hangs/log.txt").read()
