"""Habits that used to lose or mislabel runs (issue 37): a fresh run into a directory that holds a run,
and a resume that changes the model. Each is refused before any work, in one line that names the way on."""

from __future__ import annotations

import json

import pytest

from train_helpers import compose_cfg, tiny_overrides, write_corpus

SHORT = {"train.max_steps": 4, "train.val_every": 2}


def _files(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and ".hydra" not in p.parts}


def test_a_fresh_run_into_a_finished_runs_directory_is_refused_and_changes_nothing(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT)))
    run = tmp_path / "run"
    before = _files(run)
    with pytest.raises(ValueError, match=r"run directory .*run already holds a run \(results.json; checkpoints/ "
                                         r"\(.*last.ckpt.*\); csv/metrics.csv\): resume it with ckpt_path=auto, give "
                                         r"this run a new hydra.run.dir, or replace it with train.overwrite=true"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT, **{"train.lr": 0.01})))
    after = _files(run)
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before if k.name != "train.log")
    # the ways on: resume (nothing left to train: the same result), or replace on purpose
    assert train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT, ckpt_path="auto")))["steps"] == 4
    replaced = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{**SHORT, "train.overwrite": True,
                                                                           "train.max_steps": 2})))
    assert replaced["steps"] == 2


def test_train_overwrite_must_be_a_bool(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    with pytest.raises(ValueError, match="train.overwrite must be true or false, got 'yes'"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.overwrite": "yes"})))


def test_a_resume_that_changes_the_model_is_refused_with_the_diff(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    first = tmp_path / "first"
    train.run(compose_cfg(tiny_overrides(first, corpus, **SHORT, **{"train.stop_at_step": 2})))
    ckpt = first / "run" / "checkpoints" / "last.ckpt"
    for overrides, diff in (({"attn": "alsc"}, r"attn.name: 'softmax' -> 'alsc'"),
                            ({"model.n_layer": 3}, r"model.n_layer: 2 -> 3")):
        with pytest.raises(ValueError, match=rf"ckpt_path={ckpt} was trained as another model \(.*{diff}.*\): resume "
                                             r"it with its own settings, or start a fresh run in a new hydra.run.dir"):
            train.run(compose_cfg(tiny_overrides(tmp_path / "second", corpus, **SHORT, **overrides,
                                                 ckpt_path=str(ckpt))))
    assert not (tmp_path / "second" / "run" / "results.json").exists()


def test_a_resume_records_the_settings_it_changed_on_purpose(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT, **{"train.stop_at_step": 2})))
    results = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT, ckpt_path="auto",
                                                   **{"train.lr": 0.001, "model.dropout": 0.1})))
    assert results["steps"] == 4
    assert results["changed_on_resume"] == {"model.dropout": [0.0, 0.1], "optimizer.lr": [0.003, 0.001]}
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["changed_on_resume"] == results["changed_on_resume"]


def test_a_refused_run_leaves_the_runs_hydra_record_alone(tmp_path):
    """Hydra wrote .hydra/ before the run was refused: the refused invocation's settings replaced the
    record of the run the directory holds. train.py writes .hydra/ itself, once the run is allowed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    run = tmp_path / "kept"
    overrides = [o for o in tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2})
                 if not o.startswith("paths.output_dir=")]
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, str(root / "train.py"), *overrides, f"hydra.run.dir={run}"]
    subprocess.run(command, cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    record = {name: (run / ".hydra" / name).read_text() for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    assert "  n_layer: 2\n" in record["config.yaml"] and "- model.n_layer=2\n" in record["overrides.yaml"]
    assert f"dir: {run}" in record["hydra.yaml"]
    refused = subprocess.run([*command, "train.lr=0.009", "model.n_layer=1"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr
    assert {name: (run / ".hydra" / name).read_text() for name in record} == record
