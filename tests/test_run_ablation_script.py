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


def test_report_from_a_fetched_archive_draws_heatmaps_of_runs_in_either_eval_layout(tmp_path):
    """`scripts/run_ablation.sh report FETCHED_DIR OUT_DIR`: the attention statistics of a run evaluated into
    eval/ and of one whose eval JSONs lie in checkpoints/ (an older attnlab wrote them there) are both drawn
    as heatmaps beside their JSON and both reach the report."""
    import shutil
    import tarfile

    from models.attention_diagnostics import METRICS

    # a copy of the script's own files: `report` unpacks into <its checkout>/multirun/
    root = tmp_path / "checkout"
    for relative in ("scripts/run_ablation.sh", "scripts/analysis/ablation_report.py", "configs/experiment/ablation.yaml"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, root / relative)
    sweep = tmp_path / "device"
    eval_files = {}
    for seed, folder, sink in ((0, "eval", 0.2), (1, "checkpoints", 0.4)):
        run = sweep / f"{seed}_softmax_s{seed}"
        (run / folder).mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({"variant": "softmax", "seed": seed, "val_loss": 2.0 + seed,
                                                      "steps": 4, "tokens": 400}))
        stats = {"model": {"variant": "softmax", "seed": seed}, "summary": {"sink_mass": sink},
                 "metrics": {name: [[sink, sink]] for name in METRICS}}
        eval_files[seed] = run / folder / "best.attention-val.json"
        eval_files[seed].write_text(json.dumps(stats))
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    with tarfile.open(fetched / "ablation.tar.gz", "w:gz") as archive:
        archive.add(sweep, arcname=sweep.name)
    done = subprocess.run(["bash", str(root / "scripts" / "run_ablation.sh"), "report", str(fetched), str(tmp_path / "out")],
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    unpacked = root / "multirun" / "ablation-fetched" / sweep.name
    for seed, path in eval_files.items():
        heatmaps = unpacked / path.relative_to(sweep).parent
        assert sorted(p.name for p in heatmaps.glob("*.png")) == sorted(f"best.attention-val.{m}.png" for m in METRICS)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["attention"]["softmax"]["sink_mass"]["values"] == [0.2, 0.4]
