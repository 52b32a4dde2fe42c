"""scripts/run_ablation.sh device end to end on CPU: a tiny model, one process per variant, each run
evaluated in its process, the shared deadline, the report and the packed archive."""

import json
import os
import subprocess
import sys
from pathlib import Path

from train_helpers import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def run_device(tmp_path: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    tiny = ["trainer=cpu", "train.cuda_graphs=false", "data=text", f"data.source.path={corpus}", "data/tokenizer=byte",
            "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2", "model.d_model=32", "model.context=32",
            "train.batch_size=4", "train.val_every=2", "train.val_tokens=512", "train.warmup_steps=1",
            "train.attention_stats_sequences=2", "+evaluate.perplexity.max_tokens=300",
            "+evaluate.attention_stats.num_tokens=64"]
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "ABLATION_SWEEP": str(tmp_path / "sweep"),
           "ABLATION_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "run_ablation.sh"), "device", *tiny, *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_every_run_is_trained_evaluated_and_reported(tmp_path):
    proc = run_device(tmp_path, {"ABLATION_VARIANTS": "softmax,threshold", "ABLATION_SEEDS": "0,1"}, "train.max_steps=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/results.json"))]
    assert sorted((r["variant"], r["seed"]) for r in results) == [("softmax", 0), ("softmax", 1),
                                                                  ("threshold", 0), ("threshold", 1)]
    for r in results:
        assert r["steps"] == 4
        assert set(r["evaluations"]) == {"perplexity", "attention_stats"}
        for evaluation in r["evaluations"].values():
            assert "error" not in evaluation and all(Path(p).is_file() for p in evaluation["paths"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "4 runs: 2 variants x seeds [0, 1]" in report
    assert (tmp_path / "out" / "ablation.tar.gz").is_file()
    assert "ablation wall time (runs, evaluations, report):" in (tmp_path / "out" / "environment.txt").read_text()
    # one process per variant: its seeds in one Hydra multirun
    assert "Launching 2 jobs" in (tmp_path / "sweep" / "logs" / "train_softmax.log").read_text()


def test_the_deadline_stops_a_run_and_a_later_seed_does_not_start(tmp_path):
    # 40 s: room for the process start on a loaded CI machine, then seed 0 trains until the deadline
    proc = run_device(tmp_path, {"ABLATION_VARIANTS": "softmax", "ABLATION_SEEDS": "0,1", "ABLATION_TRAIN_BUDGET_S": "40"},
                      "train.max_steps=1000000", "train.val_every=20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/results.json")]
    assert [r["seed"] for r in results] == [0]  # seed 1 came after the deadline
    assert 0 < results[0]["steps"] < 1_000_000
    assert "error" not in results[0]["evaluations"]["perplexity"]
    assert "train.stop_at_time passed" in (tmp_path / "sweep" / "logs" / "train_softmax.log").read_text()
