"""Habits that used to lose or mislabel runs (issue 37): a fresh run into a directory that holds a run,
and a resume that changes the model. Each is refused before any work, in one line that names the way on."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from train_helpers import compose_cfg, run_command, tiny_overrides, train_command, train_tiny_run, write_corpus

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
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    run = tmp_path / "kept"
    command = train_command(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2}), run)
    assert run_command(command, tmp_path).returncode == 0
    record = {name: (run / ".hydra" / name).read_text() for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    assert "  n_layer: 2\n" in record["config.yaml"] and "- model.n_layer=2\n" in record["overrides.yaml"]
    assert f"dir: {run}" in record["hydra.yaml"]
    refused = run_command([*command, "train.lr=0.009", "model.n_layer=1"], tmp_path)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr
    assert {name: (run / ".hydra" / name).read_text() for name in record} == record


def test_a_copied_run_is_evaluated_from_its_own_files(tmp_path):
    """results.json records the checkpoints' absolute paths where the run was trained: an evaluation of a
    copy (cp -a orig backup) read and wrote the original's files, which may have trained on since."""
    (tmp_path / "orig").mkdir()
    original = train_tiny_run(tmp_path / "orig")
    copy = tmp_path / "backup"
    shutil.copytree(original, copy)
    before = {p: p.stat().st_mtime_ns for p in original.rglob("*")}
    done = run_command(["-m", "eval.perplexity", f"ckpt={copy}", "split=val", "contexts=[8]"], tmp_path)
    assert done.returncode == 0, done.stderr
    written = list((copy / "eval").glob("*.perplexity-val.contexts=8.json"))
    assert len(written) == 1
    assert json.loads(written[0].read_text())["model"]["checkpoint"].startswith(str(copy / "checkpoints"))
    assert {p: p.stat().st_mtime_ns for p in original.rglob("*")} == before


@pytest.mark.parametrize("overrides,error", [
    # item 8: a variant parameter without the + prefix reaches attnlab's check, not Hydra's struct error
    (["attn.params.capp=3"], r"attn=softmax does not take \['capp'\]; allowed parameters: \['sm_scale'\]"),
    (["attn.params.cap=5"], r"attn=softmax does not take \['cap'\]; allowed parameters: \['sm_scale'\]"),
    (["attn.lambda_mode=scalar_clamp"], r"attn.lambda_mode=scalar_clamp applies to the variants "
                                        r"\['diff_threshold'\] only: attn=softmax does not read it \(leave attn.lambda_mode out\)"),
    (["train.lr=-1e-3"], r"train.lr must be > 0, got -0.001"),
    (["ckpt_path=missing.ckpt"], r"ckpt_path: checkpoint not found: missing.ckpt \(a .ckpt file, or auto: .*\)"),
    (["attn=tanh"], r"In 'train': Could not find 'attn/tanh'; available options: alsc, diff_threshold, sigmoid, "
                    r"softcap_softsign, softcap_tanh, softmax, threshold"),
    (["train.lrr=1"], r"Could not override 'train.lrr'. To append to your config use \+train.lrr=1 Key 'lrr' is "
                      r"not in struct"),
], ids=["unknown_param", "param_of_another_variant", "unused_setting", "bad_value", "missing_checkpoint",
        "unknown_option", "unknown_key"])
def test_a_bad_command_line_is_one_error_line_and_leaves_no_run_folder(tmp_path, overrides, error):
    """Bad settings, a missing checkpoint, an unknown config option: one `error:` line on stderr, exit
    status 2, before any work, and no run folder left in outputs/ (Hydra makes one before the task runs)."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    command = [*train_command(tiny_overrides(tmp_path, corpus)), *overrides]
    done = run_command(command, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.fullmatch(f"error: {error}", done.stderr.strip()), done.stderr[-3000:]
    assert not list((tmp_path / "outputs").rglob("*_s0")) and not (tmp_path / "cache").exists()


def test_a_run_failing_after_it_started_leaves_no_run_folder_and_v_shows_the_traceback(tmp_path):
    """A missing data file is found after the run took its directory (lock, .hydra/ record, job log): the
    folder is removed all the same, the last line is the error; -v shows the traceback."""
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    command = [*train_command(tiny_overrides(tmp_path, corpus)), f"data.source.path={tmp_path / 'missing.txt'}"]
    done = run_command(command, tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"error: data.source.path: file not found: '{tmp_path / 'missing.txt'}' (resolved to {tmp_path / 'missing.txt'})")
    assert "Traceback" not in done.stderr and not list((tmp_path / "outputs").rglob("*_s0"))
    verbose = run_command([*command, "-v"], tmp_path)
    assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.strip().splitlines()[-1].startswith("ValueError: data.source.path: file not found")


def test_a_file_that_is_no_checkpoint_is_one_line_without_advice_to_load_it_unsafely(tmp_path):
    """torch.load's refusal of a pickle advises re-running it with weights_only=False (running code from
    a file someone handed over) or allow-listing its globals: the eval commands and train.py print only
    what is wrong with the file."""
    import pickle

    handed_over = tmp_path / "model.ckpt"
    handed_over.write_bytes(pickle.dumps({"state_dict": {}, "note": "not a torch file"}))
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    expected = (re.escape(f"error: checkpoint {handed_over} cannot be read safely (corrupt, truncated or not a torch "
                          "file): it holds what a safe load refuses (Unsupported operand ") + r"\d+\)")
    for command in (["-m", "eval.perplexity", f"ckpt={handed_over}"],
                    train_command(tiny_overrides(tmp_path, corpus, ckpt_path=str(handed_over)), tmp_path / "run")):
        done = run_command(command, tmp_path)
        assert done.returncode == 2 and re.fullmatch(expected, done.stderr.strip()), done.stderr[-3000:]


def test_results_json_is_replaced_atomically(tmp_path, monkeypatch):
    """An empty results.json (a kill or a full disk during its write) broke every eval command: a failure
    while results.json is written leaves the previous complete file."""
    import errno
    import os

    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT)))
    results = tmp_path / "run" / "results.json"
    before = results.read_text()
    real_fsync = os.fsync

    def full_disk_for_results(fd):
        if "results.json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_for_results)
    with pytest.raises(OSError, match="No space left on device"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **SHORT, ckpt_path="auto")))  # rewrites results.json
    assert results.read_text() == before and json.loads(before)["steps"] == 4
    assert [p.name for p in results.parent.iterdir() if "results.json" in p.name] == ["results.json"]


def test_a_run_with_an_empty_results_json_is_still_evaluated(tmp_path):
    """An empty results.json (a kill while an older attnlab wrote it) broke every eval command: the run's
    checkpoints are evaluated all the same, after a warning naming the file."""
    run = train_tiny_run(tmp_path)
    (run / "results.json").write_text("")
    done = run_command(["-m", "eval.perplexity", f"ckpt={run}", "split=val", "contexts=[8]"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{run / 'results.json'} is not valid JSON" in done.stdout + done.stderr
    written = json.loads(next((run / "eval").glob("best.perplexity-val.*.json")).read_text())
    assert written["model"]["checkpoint"] == str(run / "checkpoints" / "best.ckpt")
