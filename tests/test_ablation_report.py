"""scripts/analysis/ablation_report.py on fake run directories, its t quantiles, and the ablation config's parameter match."""

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import attn
from models.gpt import GPT
from models.lit import gpt_config_from_dict
from train_helpers import compose_cfg

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ablation_report", REPO / "scripts" / "analysis" / "ablation_report.py")
report = importlib.util.module_from_spec(spec)
sys.modules["ablation_report"] = report  # dataclasses look their module up while the class is built
spec.loader.exec_module(report)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("df,expected", [(1, 12.7062047), (2, 4.3026527), (4, 2.7764451), (10, 2.2281389), (30, 2.0422725), (1000, 1.9623391)])
def test_t_quantile_matches_tables(df, expected):
    assert report.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_symmetry_and_median():
    assert report.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    assert report.t_quantile(0.025, 5) == pytest.approx(-report.t_quantile(0.975, 5), abs=1e-9)
    assert report.t_quantile(0.95, 7) == pytest.approx(1.8945786, abs=1e-6)


def make_run(root: Path, variant: str, seed: int, val_loss: float, tokens_per_s=(900.0, 1000.0, 1100.0),
             ppl=None, attention=None, curve=((1, 3.0), (3, 2.5)), maps=None, diagnostics=None,
             eval_folder="eval") -> Path:
    """A run directory as train.py + the eval commands write it (steps 4, 100 tokens per step).
    `diagnostics`: {step: {csv column: value}} logged with the validation of that step. `eval_folder`:
    where the eval JSONs lie (eval/; checkpoints/ in runs evaluated by an older attnlab)."""
    run = root / f"{variant}_s{seed}"
    (run / "csv").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    results = {
        "variant": variant, "seed": seed, "steps": 4, "tokens": 400, "params": 1000,
        "val_loss": val_loss, "val_ppl": math.exp(val_loss), "val_bpb": val_loss / math.log(2) / 4.0,
        "best_checkpoint": str(run / "checkpoints" / "best.ckpt"), "peak_memory_bytes": 2.5 * 2**30,
    }
    (run / "results.json").write_text(json.dumps(results))
    extra = sorted({key for row in (diagnostics or {}).values() for key in row})
    columns = ["epoch", "step", "train/loss", "train/tokens", "train/tokens_per_s", "val/loss", "val/ppl", *extra]
    with (run / "csv" / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for step, tps in enumerate(tokens_per_s):
            w.writerow({"epoch": 0, "step": step, "train/loss": 3.0, "train/tokens": (step + 1) * 100, "train/tokens_per_s": tps})
        for step, loss in curve:
            w.writerow({"epoch": 0, "step": step, "val/loss": loss, **(diagnostics or {}).get(step, {})})
        w.writerow({"epoch": 1, "step": 4, "val/loss": curve[-1][1]})  # the final validate after fit
    (run / eval_folder).mkdir(exist_ok=True)
    if ppl is not None:
        rows = [{"context": c, "context_multiple": c / 512, "nats_per_token": math.log(p), "ppl": p, "bpb": 1.0}
                for c, p in ppl.items()]
        (run / eval_folder / "best.perplexity-test.json").write_text(json.dumps({"results": rows}))
    if attention is not None:
        payload = {"summary": attention, **({"metrics": maps} if maps else {}),
                   "model": {"variant": variant, "seed": seed}}
        (run / eval_folder / "best.attention-val.json").write_text(json.dumps(payload))
    return run


def test_report_on_two_runs_gives_means_cis_and_pngs(tmp_path):
    maps = {"sink_mass": [[0.3, 0.2], [0.1, None]], "zero_fraction": [[0.0, 0.0], [0.0, 0.0]]}
    a = make_run(tmp_path / "runs", "softmax", 0, 2.0, ppl={512: 10.0, 1024: 12.0},
                 attention={"zero_fraction": 0.0, "sink_mass": 0.3}, maps=maps)
    b = make_run(tmp_path / "runs", "softmax", 1, 2.2, tokens_per_s=(1.0, 2000.0, 2000.0, 2200.0),
                 ppl={512: 14.0, 1024: 16.0}, attention={"zero_fraction": 0.0, "sink_mass": 0.5})
    out = tmp_path / "report"
    assert report.main([str(a), str(b), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    loss = summary["per_variant"]["softmax"]["val_loss"]
    assert loss["n"] == 2 and loss["mean"] == pytest.approx(2.1)
    assert loss["std"] == pytest.approx(math.sqrt(0.02))  # sample std of (2.0, 2.2)
    assert loss["ci95"] == pytest.approx(12.7062047 * math.sqrt(0.02) / math.sqrt(2), rel=1e-6)
    # tokens/s: median of each run's logged steps after the first, then the mean over runs
    assert summary["per_variant"]["softmax"]["tokens_per_s"]["mean"] == pytest.approx((1050.0 + 2000.0) / 2)
    assert summary["per_variant"]["softmax"]["peak_memory_gb"]["mean"] == pytest.approx(2.5)
    assert summary["extrapolation"]["softmax"]["1024"]["ppl"]["mean"] == pytest.approx(14.0)
    assert summary["attention"]["softmax"]["sink_mass"]["mean"] == pytest.approx(0.4)
    md = (out / "report.md").read_text()
    assert "2.1000 ± 0.1414 [0.8294, 3.3706]" in md
    for name in ("val_loss_vs_tokens.png", "extrapolation.png", "throughput.png", "attention_maps.png"):
        assert (out / name).read_bytes()[:8] == PNG
        assert f"]({name})" in md


def test_the_report_reads_eval_results_from_eval_and_from_an_older_runs_checkpoints(tmp_path):
    """`python scripts/analysis/ablation_report.py SWEEP`: a run evaluated into eval/ and one whose eval JSONs lie in
    checkpoints/ (an older attnlab wrote them there) both get their perplexity and attention statistics;
    where a run has both, eval/ wins."""
    from train_helpers import run_command

    runs = tmp_path / "sweep"
    make_run(runs, "softmax", 0, 2.0, ppl={512: 10.0}, attention={"sink_mass": 0.2})
    old = make_run(runs, "softmax", 1, 2.2, ppl={512: 14.0}, attention={"sink_mass": 0.4}, eval_folder="checkpoints")
    make_run(runs, "alsc", 0, 2.1, ppl={512: 11.0}, eval_folder="checkpoints")
    newer = make_run(tmp_path / "newer", "alsc", 0, 2.1, ppl={512: 12.0})
    (newer / "eval").rename(runs / "alsc_s0" / "eval")  # alsc_s0 evaluated again, into eval/
    done = run_command([str(REPO / "scripts" / "analysis" / "ablation_report.py"), str(runs), "--out", str(tmp_path / "out")], tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["extrapolation"]["softmax"]["512"]["ppl"]["values"] == [10.0, 14.0]
    assert summary["attention"]["softmax"]["sink_mass"]["values"] == [0.2, 0.4]
    assert summary["extrapolation"]["alsc"]["512"]["ppl"]["values"] == [12.0]
    assert (old / "checkpoints" / "best.perplexity-test.json").is_file()


def test_validation_curve_is_read_against_tokens(tmp_path):
    run = make_run(tmp_path, "softmax", 0, 2.0, curve=((1, 3.0), (3, 2.5)))
    loaded = report.load_run(run, "test", "val")
    # val at step s follows s + 1 steps of 100 tokens; the final validate (step 4) repeats the 400-token point
    assert loaded.curve == [(200.0, 3.0), (400.0, 2.5)]


def test_paired_difference_to_softmax(tmp_path):
    runs = tmp_path / "sweep"
    for seed, (base, alsc) in enumerate([(2.00, 1.95), (2.20, 2.13), (2.10, 2.06)]):
        make_run(runs, "softmax", seed, base)
        make_run(runs, "alsc", seed, alsc)
    make_run(runs, "threshold", 0, 2.5)  # one seed only: no CI
    summary = report.build_report([runs], tmp_path / "out")
    d = summary["paired_vs_softmax"]["alsc"]["val_loss"]
    diffs = [-0.05, -0.07, -0.04]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    assert d["values"] == pytest.approx(diffs) and d["mean"] == pytest.approx(mean)
    assert d["ci95"] == pytest.approx(4.3026527 * std / math.sqrt(3), rel=1e-6)
    assert d["ci95_high"] < 0  # consistently better on every seed
    assert summary["paired_vs_softmax"]["threshold"]["val_loss"]["ci95"] is None
    md = (tmp_path / "out" / "report.md").read_text()
    assert "better than softmax (CI below 0)" in md and "too few paired seeds" in md
    assert summary["variants"] == ["softmax", "alsc", "threshold"]  # registry order


def test_row_trajectories_best_loss_margin_and_preface(tmp_path):
    """Row diagnostics and lambda over training (mean over layers and seeds), the best validation
    loss paired to softmax, the ±margin reading and the hand-written preface."""
    runs = tmp_path / "runs"
    for seed, shift in ((0, 0.0), (1, 0.02)):
        make_run(runs, "softmax", seed, 2.5 + shift, curve=((1, 3.0 + shift), (3, 2.5 + shift)))
        diagnostics = {1: {"val/attn/empty_rows": 0.9 - shift, "val/lambda/layer0": 0.5, "val/lambda/layer1": 0.3},
                       3: {"val/attn/empty_rows": 0.6 - shift, "val/lambda/layer0": 0.2, "val/lambda/layer1": 0.2}}
        # overfits: best (2.0 + shift) at step 1, final 2.6 + shift
        make_run(runs, "diff_threshold", seed, 2.6 + shift, curve=((1, 2.0 + shift), (3, 2.6 + shift)),
                 diagnostics=diagnostics)
    preface = tmp_path / "reading.md"
    preface.write_text("## Reading\n\nThe hand-written conclusion.\n")
    out = tmp_path / "report"
    assert report.main([str(runs), "--out", str(out), "--margin", "0.05", "--preface", str(preface)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    trajectory = summary["trajectories"]["diff_threshold"]
    # validations after 2 and 4 steps of 100 tokens; mean over seeds 0.9/0.88 and 0.6/0.58
    assert [t for t, _ in trajectory["empty_rows"]] == [200, 400]
    assert [x for _, x in trajectory["empty_rows"]] == pytest.approx([0.89, 0.59])
    assert [x for _, x in trajectory["lambda"]] == pytest.approx([0.4, 0.2])  # mean over the logged lambdas
    assert "empty_rows" not in summary["trajectories"]["softmax"]
    best = summary["per_variant"]["diff_threshold"]["best_val_loss"]
    assert best["values"] == pytest.approx([2.0, 2.02])
    assert summary["per_variant"]["diff_threshold"]["best_val_tokens"]["values"] == [200, 200]
    paired = summary["paired_vs_softmax"]["diff_threshold"]
    assert paired["best_val_loss"]["values"] == pytest.approx([-0.5, -0.5])
    assert paired["val_loss"]["values"] == pytest.approx([0.1, 0.1])
    text = (out / "report.md").read_text()
    assert text.index("The hand-written conclusion.") < text.index("## Final validation metrics")
    assert "worse by more than 0.05 nats" in text and "better by more than 0.05 nats" in text
    assert "**empty-row fraction**" in text and "| diff_threshold | 0.8900 | 0.5900 |" in text
    for name in ("row_opening.png", "lambda.png"):
        assert (out / name).read_bytes().startswith(PNG)


@pytest.mark.parametrize("low,high,reading", [(0.03, 0.05, "worse by more than 0.02"), (-0.01, 0.015, "within 0.02"),
                                              (-0.05, -0.03, "better by more than 0.02"),
                                              (0.01, 0.03, "not decided at ±0.02")])
def test_margin_reading(low, high, reading):
    d = {"n": 3, "ci95_low": low, "ci95_high": high}
    assert reading in report.verdict(d, margin=0.02)
    assert "0.02" not in report.verdict(d)


def test_heatmap_colour_scale_fits_the_values():
    import numpy as np

    assert report.colour_limit([np.array([[0.01, 0.02]]), np.array([[np.nan, 0.005]])]) == pytest.approx(0.02)
    assert report.colour_limit([np.zeros((2, 2)), np.full((1, 1), np.nan)]) == 1.0


def test_margin_must_be_positive(tmp_path, capsys):
    make_run(tmp_path / "runs", "softmax", 0, 2.0)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "o"), "--margin", "0"]) == 2
    assert "--margin must be > 0" in capsys.readouterr().err


def test_report_refuses_folders_without_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert report.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2


def ablation_model(variant: str, vocab_size: int, experiment: str = "ablation", **overrides) -> GPT:
    cfg = compose_cfg([f"experiment={experiment}", f"attn={variant}", "paths.output_dir=/tmp/unused"]
                      + [f"{k}={v}" for k, v in overrides.items()])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["vocab_size"] = vocab_size
    model["attn"] = OmegaConf.to_container(cfg.attn, resolve=True)
    return GPT(gpt_config_from_dict(model))


def test_ablation_parameter_counts_within_two_percent():
    """Build all six ablation models: total and non-embedding parameters within 2% of softmax.
    diff_threshold's second q/k projection is paid for by its narrower MLP (configs/experiment/ablation.yaml)."""
    cfg = compose_cfg(["experiment=ablation", "paths.output_dir=/tmp/unused"])
    vocab = cfg.data.tokenizer.vocab_size  # the BPE size of the ablation's corpus
    counts = {v: ablation_model(v, vocab) for v in attn.variant_names()}
    base = counts["softmax"]
    for variant, model in counts.items():
        for non_embedding in (False, True):
            rel = abs(model.num_params(non_embedding) - base.num_params(non_embedding)) / base.num_params(non_embedding)
            assert rel < 0.02, (variant, non_embedding, rel)
    assert counts["diff_threshold"].cfg.mlp_ratio == 3.0 and base.cfg.mlp_ratio == 4.0
    # and the compensation is needed: at the base MLP width the differential model is far off
    unmatched = ablation_model("diff_threshold", vocab, **{"model.mlp_ratio": 4.0})
    assert (unmatched.num_params(True) - base.num_params(True)) / base.num_params(True) > 0.1


def test_ablation_sweeps_six_variants_times_three_seeds():
    from hydra import compose, initialize_config_dir

    from train_helpers import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=ablation", "paths.output_dir=/tmp/unused"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True)
    assert sorted(params["attn"].split(",")) == sorted(attn.variant_names())
    assert params["seed"].split(",") == ["0", "1", "2"]
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN" and cfg.logger.kind == "wandb"


def test_a_sweep_over_a_variant_parameter_gives_one_row_per_setting(tmp_path):
    """Runs recorded with labels (train.py's results.json "label") of one variant and seed are
    separate rows, ordered by the registry's variant order; without labels they would collide."""
    runs = []
    for label, loss in (("softcap_tanh[cap=50]", 2.1), ("softcap_tanh[cap=2]", 2.4), ("softmax", 2.0)):
        run = make_run(tmp_path / "runs" / label.replace("[", "_").replace("]", ""), label.split("[")[0], 0, loss)
        results = json.loads((run / "results.json").read_text())
        (run / "results.json").write_text(json.dumps({**results, "label": label}))
        runs.append(str(run))
    out = tmp_path / "report"
    assert report.main([*runs, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variants"] == ["softmax", "softcap_tanh[cap=2]", "softcap_tanh[cap=50]"]
    assert summary["per_variant"]["softcap_tanh[cap=2]"]["val_loss"]["mean"] == pytest.approx(2.4)
    assert "softcap_tanh[cap=50]" in (out / "report.md").read_text()
    for run in runs:  # the same runs without labels: one variant with seed 0 twice
        results = json.loads((Path(run) / "results.json").read_text())
        results.pop("label")
        (Path(run) / "results.json").write_text(json.dumps(results))
    with pytest.raises(ValueError, match=r"variant softcap_tanh has several runs with seed\(s\) \[0\] and the same settings"):
        report.build_report(runs, tmp_path / "report2", "t", "test", "val")


def test_setting_labels_are_ordered_by_their_numbers(tmp_path):
    """`python scripts/analysis/ablation_report.py SWEEP` on a sweep over cap=2.5,5,10: rows in the caps' numeric order
    (string order put cap=10 before cap=2.5 and cap=5)."""
    from train_helpers import run_command

    for label, loss in (("softcap_tanh[cap=10]", 2.1), ("softcap_tanh[cap=5]", 2.2), ("softcap_tanh[cap=2.5]", 2.3),
                        ("softmax", 2.0)):
        run = make_run(tmp_path / "runs" / label.replace("[", "_").replace("]", ""), label.split("[")[0], 0, loss)
        results = json.loads((run / "results.json").read_text())
        (run / "results.json").write_text(json.dumps({**results, "label": label}))
    out = tmp_path / "report"
    done = run_command([str(REPO / "scripts" / "analysis" / "ablation_report.py"), str(tmp_path / "runs"), "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    expected = ["softmax", "softcap_tanh[cap=2.5]", "softcap_tanh[cap=5]", "softcap_tanh[cap=10]"]
    assert json.loads((out / "summary.json").read_text())["variants"] == expected
    final_metrics = (out / "report.md").read_text().split("## Final validation metrics", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in final_metrics.splitlines() if line.startswith("| ")]
    assert rows[2:] == expected  # after the header and its rule


def test_natural_order_compares_numbers_by_value():
    labels = ["alsc[kappa=0.5]", "alsc[kappa=0.25]", "alsc[cap=-1]", "alsc[cap=-2]", "alsc[cap=1e-3]", "alsc"]
    assert report.variant_order(labels) == ["alsc", "alsc[cap=-2]", "alsc[cap=-1]", "alsc[cap=1e-3]",
                                            "alsc[kappa=0.25]", "alsc[kappa=0.5]"]


def test_a_loss_curve_of_one_validation_is_drawn_as_a_point(tmp_path, monkeypatch):
    """Runs with one validation each: a line through one point draws nothing, so the point gets a marker,
    the legend says so, and the seeds' min..max is an error bar (a band over one x is empty)."""
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig) or save(fig, *a, **k))
    runs = [report.load_run(make_run(tmp_path, "softmax", seed, 2.0 + seed, curve=((3, 2.5 + seed),)), "test", "val")
            for seed in (0, 1)]
    runs.append(report.load_run(make_run(tmp_path, "alsc", 0, 2.0, curve=((1, 3.0), (3, 2.4))), "test", "val"))
    path = report.plot_curves(runs, ["softmax", "alsc"], tmp_path / "curves.png")
    assert path.read_bytes()[:8] == PNG
    [ax] = drawn[-1].axes
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"softmax (n=2, one validation)", "alsc (n=1)"}
    point = lines["softmax (n=2, one validation)"]
    assert list(point.get_xdata()) == [0.0004] and point.get_marker() not in (None, "None", "", " ")
    assert lines["alsc (n=1)"].get_marker() in (None, "None", "", " ")  # a curve stays a line
    # the error bar spans the two seeds' losses 2.5 and 3.5
    bars = [c for c in ax.collections if len(c.get_segments()) == 1]
    assert [[tuple(p) for p in c.get_segments()[0]] for c in bars] == [[(0.0004, 2.5), (0.0004, 3.5)]]


def test_tda_parity_models_match_in_size_and_meet_the_issues_scale():
    """The parity experiment: >= 20M parameters at context >= 512, every arm within 2% of softmax
    (both lambda modes), one pass over the training tokens."""
    cfg = compose_cfg(["experiment=tda_parity", "paths.output_dir=/tmp/unused"])
    vocab = cfg.data.tokenizer.vocab_size
    base = ablation_model("softmax", vocab, "tda_parity")
    assert base.num_params() >= 20e6 and base.cfg.context >= 512
    for variant, overrides in (("threshold", {}), ("diff_threshold", {"attn.lambda_mode": "scalar_clamp"}),
                               ("diff_threshold", {"attn.lambda_mode": "reparam"})):
        model = ablation_model(variant, vocab, "tda_parity", **overrides)
        rel = abs(model.num_params(True) - base.num_params(True)) / base.num_params(True)
        assert rel < 0.02, (variant, overrides, rel)
    tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.model.context
    train_tokens = 16_123_355  # the bibles train split under its BPE 8192 (configs/data/bibles.yaml)
    assert 0.95 < tokens / train_tokens <= 1.0  # one pass: past it this corpus overfits
