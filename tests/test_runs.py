"""runs.run.Run on run directories laid out as train.py writes them (files only, no training)."""

import json

import pytest

from runs.run import Run, eval_result_path, resolve_checkpoints, runs_in


def make_run(folder, results=None, checkpoints=("best.ckpt", "last.ckpt"), config="seed: 7\ngroup: ablation\n"):
    (folder / "checkpoints").mkdir(parents=True)
    for name in checkpoints:
        (folder / "checkpoints" / name).write_bytes(b"not read here")
    if results is not None:
        (folder / "results.json").write_text(json.dumps(results))
    if config is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "config.yaml").write_text(config)
    return folder


def test_a_run_opens_from_its_directory_or_a_checkpoint_in_it(tmp_path):
    run_dir = make_run(tmp_path / "run", {"variant": "alsc", "label": "alsc[cap=5]", "seed": 3,
                                          "best_checkpoint": "/elsewhere/checkpoints/best.ckpt"})
    by_dir, by_checkpoint = Run.open(run_dir), Run.open(run_dir / "checkpoints" / "last.ckpt")
    assert by_dir.dir == run_dir and by_checkpoint.dir == run_dir.resolve()
    assert by_dir.checkpoint() == run_dir / "checkpoints" / "best.ckpt"  # its own file, not the recorded path
    assert by_dir.checkpoint("last") == by_dir.last_checkpoint_path == run_dir / "checkpoints" / "last.ckpt"
    assert (by_dir.label, by_dir.seed, by_dir.wandb_group, by_dir.config.group) == ("alsc[cap=5]", 3, "ablation", "ablation")
    with pytest.raises(ValueError, match="which must be one of"):
        by_dir.checkpoint("newest")
    with pytest.raises(FileNotFoundError, match="is not a training run"):
        Run.open(tmp_path)
    loose = tmp_path / "loose.ckpt"
    loose.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is not inside a run directory"):
        Run.open(loose)
    assert Run.of_checkpoint(loose) is None


def test_an_unreadable_results_json_is_left_out_and_the_seed_comes_from_the_config(tmp_path, caplog):
    run = Run(make_run(tmp_path / "run"))
    (run.dir / "results.json").write_text("")
    assert run.results is None and "is not valid JSON" in caplog.text
    assert run.seed == 7 and run.label is None
    assert run.checkpoint() == run.dir / "checkpoints" / "best.ckpt"


def test_a_sweep_folder_gives_its_runs_and_their_checkpoints(tmp_path):
    first = make_run(tmp_path / "sweep" / "0_softmax", {"variant": "softmax"})
    second = make_run(tmp_path / "sweep" / "1_alsc", None, checkpoints=("last.ckpt",))
    assert [run.dir for run in runs_in(tmp_path / "sweep")] == [first, second]
    assert resolve_checkpoints(str(tmp_path / "sweep")) == [first / "checkpoints" / "best.ckpt",
                                                           second / "checkpoints" / "last.ckpt"]  # best falls back
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no training run"):
        runs_in(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        resolve_checkpoints(str(tmp_path / "missing"))


def test_eval_results_go_to_the_runs_eval_folder_and_are_read_from_it_or_checkpoints(tmp_path):
    run = Run(make_run(tmp_path / "run", {"variant": "softmax"}))
    best = run.dir / "checkpoints" / "best.ckpt"
    assert eval_result_path(best, "perplexity", "test") == run.eval_dir / "best.perplexity-test.json"
    assert eval_result_path(best, "perplexity", "test", settings="stride=4").name == "best.perplexity-test.stride=4.json"
    assert eval_result_path(tmp_path / "loose.ckpt", "perplexity", "val") == tmp_path / "loose.perplexity-val.json"
    assert run.eval_result("perplexity", "test") is None
    (run.dir / "checkpoints" / "best.perplexity-test.json").write_text('{"older": true}')
    assert run.eval_result("perplexity", "test") == {"older": True}
    run.eval_dir.mkdir()
    (run.eval_dir / "best.perplexity-test.json").write_text('{"older": false}')
    assert run.eval_result("perplexity", "test") == {"older": False}


def test_write_results_replaces_results_json(tmp_path):
    run = Run(make_run(tmp_path / "run", {"variant": "softmax"}))
    run.write_results({"variant": "alsc"})
    assert json.loads((run.dir / "results.json").read_text()) == {"variant": "alsc"}
    assert run.previous_files() == ["results.json", "checkpoints/ (best.ckpt, last.ckpt)"]
