"""train.py's `evaluate`: the eval commands run in the training process after each run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_helpers import compose_cfg, tiny_overrides, write_corpus
from training.config_checks import check_config

ROOT = Path(__file__).resolve().parents[1]


def test_a_sweep_evaluates_each_run_in_its_process_as_the_eval_commands_would(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    overrides = [o for o in tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2})
                 if not o.startswith("paths.output_dir")]
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "attn=softmax", "seed=0,1",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides,
           "+evaluate.perplexity={split:test,max_tokens:300,context_multipliers:[1,2]}",
           "+evaluate.attention_stats={num_tokens:64,plot:false}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = sorted(p.parent for p in (tmp_path / "sweep").glob("*/results.json"))
    assert len(run_dirs) == 2

    from eval.perplexity import run_perplexity
    from training.evaluate_after import compose_eval_config

    for run_dir in run_dirs:
        evaluations = json.loads((run_dir / "results.json").read_text())["evaluations"]
        assert set(evaluations) == {"perplexity", "attention_stats"}
        assert not any("error" in e for e in evaluations.values()), evaluations
        [ppl_path] = evaluations["perplexity"]["paths"]
        [stats_path] = evaluations["attention_stats"]["paths"]
        in_process = json.loads(Path(ppl_path).read_text())
        stats = json.loads(Path(stats_path).read_text())
        assert Path(ppl_path).parent == Path(stats_path).parent == run_dir.resolve() / "eval"
        assert [r["context"] for r in in_process["results"]] == [32, 64]
        assert in_process["split"] == "test" and stats["split"] == "val"
        assert in_process["model"]["seed"] == json.loads((run_dir / "results.json").read_text())["seed"]
        # the same numbers as the eval command run on its own (written elsewhere, compared here)
        cfg = compose_eval_config("perplexity", run_dir, {"split": "test", "max_tokens": 300,
                                                          "context_multipliers": [1, 2], "out": str(tmp_path / "alone.json")})
        [alone] = run_perplexity(cfg)
        assert [r["nats_per_token"] for r in alone["results"]] == [r["nats_per_token"] for r in in_process["results"]]
    # the two seeds trained different models
    losses = {json.loads((d / "results.json").read_text())["val_loss"] for d in run_dirs}
    assert len(losses) == 2


def test_a_failed_evaluation_is_recorded_and_the_training_result_stays(tmp_path):
    from training import train
    from omegaconf import OmegaConf

    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2,
                                                            "+evaluate.perplexity.stride": 10_000}))
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)  # as Hydra writes it before the job (eval reads the data config)
    saved = OmegaConf.to_container(cfg, resolve=False)
    saved["paths"]["output_dir"] = str(run_dir)
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    results = train.run(cfg)
    written = json.loads((run_dir / "results.json").read_text())
    assert written["val_loss"] == pytest.approx(results["val_loss"])
    assert "stride" in written["evaluations"]["perplexity"]["error"]
    assert not list(run_dir.rglob("*.perplexity-*.json"))


@pytest.mark.parametrize("override, message", [
    ("+evaluate.lm_eval.split=test", "evaluate.lm_eval: unknown evaluation"),
    ("+evaluate.perplexity.strides=4", "evaluate.perplexity.strides: no such setting"),
    ("+evaluate.perplexity.ckpt=/elsewhere", "evaluate.perplexity.ckpt is set by the training run"),
    ("+evaluate.perplexity=test", "evaluate.perplexity must be a mapping"),
])
def test_bad_evaluate_settings_are_refused_before_training(tmp_path, override, message):
    cfg = compose_cfg([*tiny_overrides(tmp_path, tmp_path / "corpus.txt"), override])
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def test_evaluate_must_be_a_mapping():
    from omegaconf import OmegaConf

    from training.evaluate_after import check_evaluate_config

    with pytest.raises(ValueError, match="evaluate must be a mapping"):
        check_evaluate_config(OmegaConf.create(["perplexity"]))


def test_the_ablation_experiments_evaluate_each_run():
    for experiment in ("ablation", "tda_parity"):
        cfg = compose_cfg([f"experiment={experiment}", "paths.output_dir=/tmp/unused"])
        check_config(cfg)
        assert cfg.evaluate.perplexity.split == "test" and cfg.evaluate.attention_stats.split == "val"
