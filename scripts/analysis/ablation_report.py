#!/usr/bin/env python
"""Markdown report of an attention ablation, from the runs' local files (no wandb account needed).

    python scripts/analysis/ablation_report.py multirun/ablation/2026-...  [more run dirs or sweep folders] \
        --out docs/results/ablation [--title "..."] [--split test]

Reads, per run directory (as train.py and the eval commands write them):
  results.json                               variant, seed, tokens, params, final val loss/ppl/bpb
                                             (and peak_memory_bytes / wandb_group when recorded)
  csv/metrics.csv                            val/loss over training, train/tokens_per_s, and at each
                                             validation the row diagnostics val/attn/* and val/lambda/*
                                             (training/callbacks/attention_monitor.py) when logged
  eval/<ckpt>.perplexity-<split>.json        eval.perplexity at each context length
  eval/<ckpt>.attention-<split>.json         eval.attention_stats summary
                                             (in checkpoints/ for runs evaluated by an older attnlab)

Writes to --out: report.md, summary.json (every number in the report) and the plots
val_loss_vs_tokens.png (mean over seeds, band = min..max over seeds), extrapolation.png
(perplexity against context length), throughput.png (tokens/s), and where the runs logged them
row_opening.png (exact-zero fraction, empty rows, surviving keys, sink mass over training) and
lambda.png (the differential lambda over training).

Statistics: per variant the mean, sample standard deviation and a 95% confidence interval
mean +- t(0.975, n-1) s / sqrt(n) (Student t; the quantile is computed here, no scipy). The
paired difference to softmax uses seeds present for both variants: d_s = x_variant(s) -
x_softmax(s); since seed s of every variant sees the same batches and the same data order,
pairing removes the shared seed-to-seed variation. A CI that contains 0 means the variants
are not distinguishable at this number of seeds. `--margin M` (nats) also reads each paired CI
against +-M: inside it the variant is within M of softmax, above M it is worse by more than M.
The best validation loss (lowest over the run's validations) is paired too: where a run overfits,
the final and the best weights answer different questions. `--preface FILE` puts a hand-written
reading of the numbers under the title.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runs.run import Run as RunDirectory  # noqa: E402  (the run directory as train.py writes it)
from runs.run import runs_in  # noqa: E402

BASELINE = "softmax"
METRICS = (("val_loss", "val loss (nats/token)"), ("val_ppl", "val perplexity"), ("val_bpb", "val bits/byte"))
# variant order in tables and plots: the registry's, then anything else alphabetically
try:
    from attn import variant_names as _variant_names

    VARIANT_ORDER = list(_variant_names())
except Exception:  # the report only reads files; it still works where attn (torch) cannot be imported
    VARIANT_ORDER = ["softmax", "softcap_tanh", "softcap_softsign", "alsc", "threshold", "diff_threshold", "sigmoid"]


# ---------------------------------------------------------------------------- statistics


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Quantile of Student's t with df degrees of freedom (bisection on the CDF)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass
class Summary:
    n: int
    mean: float | None
    std: float | None  # sample standard deviation (ddof = 1); None for n < 2
    ci95: float | None  # half-width of the 95% CI of the mean; None for n < 2
    values: list = field(default_factory=list)

    @property
    def low(self):
        return None if self.ci95 is None else self.mean - self.ci95

    @property
    def high(self):
        return None if self.ci95 is None else self.mean + self.ci95

    def as_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "std": self.std, "ci95": self.ci95,
                "ci95_low": self.low, "ci95_high": self.high, "values": self.values}


def summarize(values) -> Summary:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(values)
    if n == 0:
        return Summary(0, None, None, None, [])
    mean = sum(values) / n
    if n < 2:
        return Summary(1, mean, None, None, values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return Summary(n, mean, std, t_quantile(0.975, n - 1) * std / math.sqrt(n), values)


# ---------------------------------------------------------------------------- reading runs


@dataclass
class Run:
    path: Path
    variant: str
    seed: int | None
    results: dict
    curve: list  # [(tokens, val_loss)] over training
    trajectories: dict  # {"empty_rows": [(tokens, value)], ...}: ROW_METRICS and "lambda" over training
    tokens_per_s: float | None  # median of the logged training throughput (first log left out)
    peak_memory_gb: float | None
    perplexity: dict | None  # eval.perplexity JSON
    attention: dict | None  # eval.attention_stats JSON


def _float(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


# row diagnostics logged at each validation (training/callbacks/attention_monitor.py): mean over layers
ROW_METRICS = (("zero_fraction", "exact-zero fraction of visible weights"), ("empty_rows", "empty-row fraction"),
               ("surviving_keys", "surviving keys per row"), ("sink_mass", "sink mass (first token)"))


def read_metrics_csv(path: Path, results: dict) -> tuple[list, float | None, dict]:
    """Validation curve [(tokens, val loss)], median tokens/s and the row-diagnostic trajectories
    {metric: [(tokens, value)]} (ROW_METRICS, and "lambda": the mean of every logged lambda) from a
    Lightning CSVLogger file."""
    if not path.is_file():
        return [], None, {}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    steps = results.get("steps")
    tokens_total = results.get("tokens")
    per_step = tokens_total / steps if steps and tokens_total else None
    if per_step is None:  # from the logged counters: train/tokens at step s counts s + 1 steps
        pairs = [(int(r["step"]), _float(r.get("train/tokens"))) for r in rows if _float(r.get("train/tokens"))]
        if pairs:
            step, tokens = pairs[-1]
            per_step = tokens / (step + 1)
    curve = {}
    trajectories: dict[str, dict] = defaultdict(dict)
    for r in rows:
        loss = _float(r.get("val/loss"))
        if loss is None or per_step is None:
            continue
        step = int(r["step"])
        # validation logged at step s follows s + 1 optimizer steps (capped at the run's steps:
        # runs from before the last validation moved into fit logged a final one at max_steps)
        done = step + 1 if not steps else min(step + 1, steps)
        curve[done * per_step] = loss
        for metric, _ in ROW_METRICS:
            value = _float(r.get(f"val/attn/{metric}"))
            if value is not None:
                trajectories[metric][done * per_step] = value
        lambdas = [x for key, text in r.items() if key.startswith("val/lambda/") and (x := _float(text)) is not None]
        if lambdas:
            trajectories["lambda"][done * per_step] = sum(lambdas) / len(lambdas)
    speeds = [_float(r.get("train/tokens_per_s")) for r in rows]
    speeds = [s for s in speeds if s is not None]
    if len(speeds) > 1:
        speeds = speeds[1:]  # the first interval includes start-up (kernel compilation, caches)
    tokens_per_s = statistics.median(speeds) if speeds else None
    return sorted(curve.items()), tokens_per_s, {k: sorted(v.items()) for k, v in trajectories.items()}


def _peak_memory_gb(results: dict) -> float | None:
    # train.py records peak_memory_gb as max_memory_allocated / 2**30, i.e. GiB
    for key, scale in (("peak_memory_bytes", 2.0**-30), ("peak_memory_gb", 1.0)):
        if results.get(key) is not None:
            return float(results[key]) * scale
    return None


def find_run_dirs(paths) -> list[Path]:
    found = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such run directory or folder: {p}")
        with contextlib.suppress(FileNotFoundError):  # no run in it: the error below names every path
            found += [run.dir for run in runs_in(p) if (run.dir / "results.json").is_file()]
    if not found:
        raise FileNotFoundError(f"no run with a results.json in {[str(p) for p in paths]}")
    return sorted(set(found))


def load_run(run_dir: Path, split: str, stats_split: str) -> Run:
    run = RunDirectory(run_dir)
    # read here, not through Run.results (which leaves out a results.json it cannot read): the report
    # refuses a run whose results it cannot read
    run.results = results = json.loads((run_dir / "results.json").read_text())
    for key in ("variant", "val_loss"):
        if key not in results:
            raise ValueError(f"{run_dir / 'results.json'} has no {key!r}: not a train.py results file")
    curve, tokens_per_s, trajectories = read_metrics_csv(run_dir / "csv" / "metrics.csv", results)
    if results.get("tokens_per_s") is not None:  # measured by train.py itself, when it records it
        tokens_per_s = float(results["tokens_per_s"])
    return Run(
        # the label (variant and its own overridden settings, training/run_label.py) when recorded:
        # a sweep over a variant's parameter gives one row per setting
        path=run_dir, variant=run.label, seed=results.get("seed"), results=results,
        curve=curve, trajectories=trajectories,
        tokens_per_s=tokens_per_s, peak_memory_gb=_peak_memory_gb(results),
        perplexity=run.eval_result("perplexity", split),
        attention=run.eval_result("attention", stats_split),
    )


# a number in a label: a sign only where a value starts (after =, [ or ,), a fraction, an exponent
NUMBER = re.compile(r"((?:(?<=[=\[,])-)?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)")


def natural_key(text: str) -> tuple:
    """`text` with its numbers compared as numbers: `cap=5` before `cap=10`, `kappa=0.25` before
    `kappa=0.5` (text and numbers alternate, so equal positions hold the same type)."""
    return tuple(float(part) if i % 2 else part for i, part in enumerate(NUMBER.split(text)))


def variant_order(variants) -> list[str]:
    """The registry's order of the variants a label starts with (`softcap_tanh[cap=2]`), then
    labels of unknown variants alphabetically; labels of one variant in natural order (numbers
    by value: `cap=5` before `cap=10`)."""
    def key(label: str):
        base = label.split("[", 1)[0]
        return (VARIANT_ORDER.index(base) if base in VARIANT_ORDER else len(VARIANT_ORDER), base, label != base,
                natural_key(label), label)

    return sorted(set(variants), key=key)


# ---------------------------------------------------------------------------- analysis


def best_val(run: Run) -> tuple[float | None, float | None]:
    """(lowest validation loss over training, the training tokens where it was reached)."""
    if not run.curve:
        return None, None
    tokens, loss = min(run.curve, key=lambda point: point[1])
    return loss, tokens


def mean_trajectory(runs: list[Run], metric: str) -> list:
    """[(tokens, mean over runs)] at the validations every run of the list logged `metric` at."""
    series = [dict(r.trajectories[metric]) for r in runs if r.trajectories.get(metric)]
    if not series:
        return []
    shared = sorted(set.intersection(*(set(x) for x in series)))
    return [(t, sum(x[t] for x in series) / len(series)) for t in shared]


def analyze(runs: list[Run]) -> dict:
    by_variant: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_variant[run.variant].append(run)
    for variant in by_variant:
        seeds = [r.seed for r in by_variant[variant]]
        duplicates = sorted({s for s in seeds if seeds.count(s) > 1 and s is not None})
        if duplicates:
            raise ValueError(f"variant {variant} has several runs with seed(s) {duplicates} and the same settings: "
                             "pass one sweep at a time")
        by_variant[variant].sort(key=lambda r: (r.seed is None, r.seed))
    variants = variant_order(by_variant)
    out: dict = {"variants": variants, "per_variant": {}, "paired_vs_softmax": {}, "extrapolation": {}, "attention": {},
                 "trajectories": {}}
    for v in variants:
        rs = by_variant[v]
        entry = {
            "seeds": [r.seed for r in rs],
            "runs": [str(r.path) for r in rs],
            "params": sorted({r.results.get("params") for r in rs if r.results.get("params") is not None}),
            "tokens": sorted({r.results.get("tokens") for r in rs if r.results.get("tokens") is not None}),
            "tokens_per_s": summarize([r.tokens_per_s for r in rs]).as_dict(),
            "mfu": summarize([r.results.get("mfu") for r in rs]).as_dict(),
            "peak_memory_gb": summarize([r.peak_memory_gb for r in rs]).as_dict(),
        }
        for key, _ in METRICS:
            entry[key] = summarize([r.results.get(key) for r in rs]).as_dict()
        entry["best_val_loss"] = summarize([best_val(r)[0] for r in rs]).as_dict()
        entry["best_val_tokens"] = summarize([best_val(r)[1] for r in rs]).as_dict()
        out["per_variant"][v] = entry
        trajectories = {m: mean_trajectory(rs, m) for m, _ in ROW_METRICS + (("lambda", ""),)}
        out["trajectories"][v] = {m: points for m, points in trajectories.items() if points}
        # perplexity at each evaluated context length
        by_context: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for r in rs:
            for row in (r.perplexity or {}).get("results", []):
                for key in ("ppl", "bpb", "nats_per_token", "context_multiple"):
                    by_context[row["context"]][key].append(row[key])
        out["extrapolation"][v] = {
            str(ctx): {
                "context_multiple": vals["context_multiple"][0],
                **{k: summarize(vals[k]).as_dict() for k in ("ppl", "bpb", "nats_per_token")},
            }
            for ctx, vals in sorted(by_context.items())
        }
        attention_keys = ("zero_fraction", "sink_mass", "empty_rows", "surviving_share", "entropy", "max_logit")
        out["attention"][v] = {
            k: summarize([(r.attention or {}).get("summary", {}).get(k) for r in rs]).as_dict() for k in attention_keys
        }
    if BASELINE in by_variant:
        base = {r.seed: r for r in by_variant[BASELINE]}
        for v in variants:
            if v == BASELINE:
                continue
            pairs = [(r, base[r.seed]) for r in by_variant[v] if r.seed in base]
            out["paired_vs_softmax"][v] = {
                "seeds": [r.seed for r, _ in pairs],
                **{key: summarize([r.results.get(key) - b.results.get(key) for r, b in pairs
                                   if r.results.get(key) is not None and b.results.get(key) is not None]).as_dict()
                   for key in ("val_loss", "val_bpb")},
                "best_val_loss": summarize([best_val(r)[0] - best_val(b)[0] for r, b in pairs
                                            if best_val(r)[0] is not None and best_val(b)[0] is not None]).as_dict(),
            }
    return out


# ---------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(runs: list[Run], variants: list[str], path: Path) -> Path:
    """Validation loss against training tokens: mean over seeds, band from min to max."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for v in variants:
        curves = [dict(r.curve) for r in runs if r.variant == v and r.curve]
        if not curves:
            continue
        shared = sorted(set.intersection(*(set(c) for c in curves)))
        if not shared:
            continue
        values = [[c[t] for c in curves] for t in shared]
        x = [t / 1e6 for t in shared]
        mean = [sum(vs) / len(vs) for vs in values]
        # one validation is one point: a line through it draws nothing, a marker shows it
        one_point = len(shared) == 1
        label = f"{v} (n={len(curves)}{', one validation' if one_point else ''})"
        (line,) = ax.plot(x, mean, label=label, lw=1.5, marker="o" if one_point else None)
        if len(curves) > 1 and one_point:
            ax.errorbar(x, mean, yerr=[[mean[0] - min(values[0])], [max(values[0]) - mean[0]]], fmt="none",
                        ecolor=line.get_color(), capsize=4)
        elif len(curves) > 1:
            ax.fill_between(x, [min(vs) for vs in values], [max(vs) for vs in values], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("validation loss; band (one validation: bar): min..max over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_trajectories(analysis: dict, metrics, path: Path, title: str) -> Path | None:
    """One panel per metric: its mean over seeds against training tokens, one line per variant."""
    metrics = [(m, label) for m, label in metrics
               if any(m in analysis["trajectories"].get(v, {}) for v in analysis["variants"])]
    if not metrics:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), dpi=110, squeeze=False)
    for ax, (metric, label) in zip(axes[0], metrics):
        for v in analysis["variants"]:
            points = analysis["trajectories"].get(v, {}).get(metric)
            if points:
                ax.plot([t / 1e6 for t, _ in points], [x for _, x in points], marker=".", lw=1.3, label=v)
        ax.set_xlabel("training tokens (millions)")
        ax.set_title(label, fontsize=9)
        if metric == "surviving_keys":  # softmax keeps every visible key, threshold rows a few
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_extrapolation(analysis: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    training_context = None
    for v in analysis["variants"]:
        points = analysis["extrapolation"].get(v) or {}
        if not points:
            continue
        contexts = sorted(int(c) for c in points)
        mean = [points[str(c)]["ppl"]["mean"] for c in contexts]
        err = [points[str(c)]["ppl"]["std"] or 0.0 for c in contexts]
        ax.errorbar(contexts, mean, yerr=err, marker="o", capsize=3, label=v, lw=1.5)
        for c in contexts:
            if points[str(c)]["context_multiple"] == 1:
                training_context = c
    if training_context:
        ax.axvline(training_context, color="gray", ls="--", lw=1, label="training context")
    from matplotlib.ticker import FixedLocator, FormatStrFormatter

    all_contexts = sorted({int(c) for v in analysis["variants"] for c in analysis["extrapolation"].get(v) or {}})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # perplexity can grow by orders of magnitude beyond the training length
    ax.xaxis.set_major_locator(FixedLocator(all_contexts))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%d"))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("perplexity (mean over seeds, error bar: std)")
    ax.set_title("length extrapolation")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_throughput(analysis: dict, path: Path) -> Path:
    plt = _plt()
    variants = [v for v in analysis["variants"] if analysis["per_variant"][v]["tokens_per_s"]["n"]]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    means = [analysis["per_variant"][v]["tokens_per_s"]["mean"] / 1e3 for v in variants]
    errs = [(analysis["per_variant"][v]["tokens_per_s"]["std"] or 0.0) / 1e3 for v in variants]
    ax.bar(range(len(variants)), means, yerr=errs, capsize=4, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, rotation=20, ha="right")
    ax.set_ylabel("training throughput (k tokens/s)")
    ax.set_title("tokens/s per run (train.py's steady state), mean over seeds (error bar: std)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def colour_limit(arrays) -> float:
    """Top of a 0-based colour scale shared by `arrays`: their largest finite value (1 if none > 0)."""
    import numpy as np

    finite = [float(np.nanmax(a)) for a in arrays if np.isfinite(a).any()]
    top = max(finite, default=0.0)
    return top if top > 0 else 1.0


def plot_attention_grid(runs: list[Run], variants: list[str], path: Path) -> Path | None:
    """Layer x head maps of sink mass and exact-zero fraction per variant (mean over seeds)."""
    import numpy as np

    panels = ("sink_mass", "zero_fraction")
    maps = {}
    for v in variants:
        stacks = [np.array([[np.nan if x is None else x for x in layer] for layer in r.attention["metrics"][m]], dtype=float)
                  for r in runs if r.variant == v and r.attention and "metrics" in r.attention for m in panels]
        if stacks:
            per_metric = [np.nanmean(np.stack(stacks[i::len(panels)]), axis=0) for i in range(len(panels))]
            maps[v] = per_metric
    if not maps:
        return None
    plt = _plt()
    names = [v for v in variants if v in maps]
    fig, axes = plt.subplots(len(panels), len(names), figsize=(2.0 * len(names) + 1.2, 2.0 * len(panels) + 0.8),
                             dpi=110, squeeze=False, layout="constrained")
    for row, metric in enumerate(panels):
        # one colour scale per metric, shared by the variants and fitted to their values: a sink mass
        # of 0.02 would be invisible on a fixed 0..1 scale
        vmax = colour_limit([maps[v][row] for v in names])
        for col, v in enumerate(names):
            ax = axes[row][col]
            values = maps[v][row]
            image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
            ax.set_xticks(range(values.shape[1]))
            ax.set_yticks(range(values.shape[0]))
            ax.tick_params(labelsize=6)
            if row == 0:
                ax.set_title(v.replace("[", "\n["), fontsize=7)  # a label's settings on their own line
            if row == len(panels) - 1:
                ax.set_xlabel("head", fontsize=7)
            if col == 0:
                ax.set_ylabel(f"{metric}\nlayer", fontsize=7)
        fig.colorbar(image, ax=axes[row].tolist(), shrink=0.8, label=f"{metric} (0..{vmax:.3g})")
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- markdown


def fmt(x, digits=4) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 1e4 or (abs(x) < 1e-3 and x != 0):
        return f"{x:.3g}"
    return f"{x:.{digits}f}"


def fmt_summary(s: dict, digits=4, ci=True) -> str:
    """mean ± std [95% CI]; mean ± std with ci=False."""
    if not s["n"]:
        return "n/a"
    if s["n"] == 1:
        return f"{fmt(s['mean'], digits)} (n=1)"
    std = s["std"] if s["std"] > 1e-12 * max(1.0, abs(s["mean"])) else 0.0  # float noise of equal values
    text = f"{fmt(s['mean'], digits)} ± {fmt(std, digits)}"
    if ci:
        text += f" [{fmt(s['ci95_low'], digits)}, {fmt(s['ci95_high'], digits)}]"
    return text


def verdict(d: dict, margin: float | None = None) -> str:
    if d["n"] < 2:
        return "too few paired seeds for a CI"
    if d["ci95_low"] > 0:
        text = "worse than softmax (CI above 0)"
    elif d["ci95_high"] < 0:
        text = "better than softmax (CI below 0)"
    else:
        text = "not distinguishable from softmax (CI contains 0)"
    if margin is not None:
        if d["ci95_low"] > margin:
            text += f"; worse by more than {margin:g} nats (CI above +{margin:g})"
        elif d["ci95_high"] < -margin:
            text += f"; better by more than {margin:g} nats (CI below -{margin:g})"
        elif -margin <= d["ci95_low"] and d["ci95_high"] <= margin:
            text += f"; within {margin:g} nats (CI inside ±{margin:g})"
        else:
            text += f"; not decided at ±{margin:g} nats (CI crosses ±{margin:g})"
    return text


def write_markdown(analysis: dict, runs: list[Run], out: Path, title: str, plots: dict, split: str,
                   margin: float | None = None, preface: str | None = None) -> Path:
    pv = analysis["per_variant"]
    variants = analysis["variants"]
    lines = [f"# {title}", ""]
    if preface:
        lines += [preface.strip(), "", "---", ""]
    base_params = (pv.get(BASELINE) or {}).get("params") or [None]
    tokens = sorted({t for v in variants for t in pv[v]["tokens"]})
    seeds = sorted({s for v in variants for s in pv[v]["seeds"] if s is not None})
    lines += [
        f"{len(runs)} runs: {len(variants)} variants x seeds {seeds}. Training tokens per run: "
        f"{', '.join(f'{t:,}' for t in tokens) or 'n/a'}.",
        "Every number below is a mean ± sample std over seeds with the 95% confidence interval of the mean "
        "in brackets (Student t, n - 1 degrees of freedom). Final validation numbers are those of the "
        "last weights on the fixed validation budget.",
        "",
        "## Final validation metrics",
        "",
        "| variant | seeds | params (vs softmax) | " + " | ".join(label for _, label in METRICS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in METRICS) + " |",
    ]
    for v in variants:
        params = pv[v]["params"]
        rel = ""
        if params and base_params[0]:
            rel = f" ({100 * (params[0] - base_params[0]) / base_params[0]:+.2f}%)"
        lines.append(
            f"| {v} | {len(pv[v]['seeds'])} | {', '.join(f'{p:,}' for p in params) or 'n/a'}{rel} | "
            + " | ".join(fmt_summary(pv[v][key], 3 if key == "val_ppl" else 4) for key, _ in METRICS) + " |"
        )
    if analysis["paired_vs_softmax"]:
        lines += [
            "", "## Paired difference to softmax (same seed, same batches)", "",
            "d = variant - softmax per seed; negative is better.", "",
            "| variant | paired seeds | Δ val loss | per-seed Δ loss | Δ val bpb | reading (loss) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for v, d in analysis["paired_vs_softmax"].items():
            per_seed = ", ".join(f"s{s}: {x:+.4f}" for s, x in zip(d["seeds"], d["val_loss"]["values"]))
            lines.append(
                f"| {v} | {len(d['seeds'])} | {fmt_summary(d['val_loss'])} | {per_seed or 'n/a'} | "
                f"{fmt_summary(d['val_bpb'])} | {verdict(d['val_loss'], margin)} |"
            )
    if any(pv[v]["best_val_loss"]["n"] for v in variants):
        lines += [
            "", "## Best validation loss over training", "",
            "The lowest validation loss of each run over its validations, and the training tokens where it was "
            "reached (a best earlier than the end means the run overfit or diverged after it); the paired Δ uses "
            "the same seeds as above.", "",
            "| variant | best val loss | at tokens (millions) | final − best | paired Δ best to softmax | reading |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for v in variants:
            best, final = pv[v]["best_val_loss"], pv[v]["val_loss"]
            at = pv[v]["best_val_tokens"]
            gap = final["mean"] - best["mean"] if final["mean"] is not None and best["mean"] is not None else None
            d = analysis["paired_vs_softmax"].get(v, {}).get("best_val_loss")
            at_text = ", ".join(f"{t / 1e6:.1f}" for t in at["values"]) or "n/a"
            lines.append(f"| {v} | {fmt_summary(best)} | {at_text} | {'n/a' if gap is None else f'{gap:+.4f}'} | "
                         f"{fmt_summary(d) if d else '—'} | {verdict(d, margin) if d else '—'} |")
    lines += [
        "", "## Throughput and memory", "",
        "tokens/s: train.py's steady-state mean when results.json records it, else the median of the logged "
        "training steps (first interval left out); mean ± std over seeds. Runs that shared a GPU "
        "(scripts/run_ablation.sh runs variants side by side) were measured under contention: compare "
        "variants within one report only.", "",
        "| variant | tokens/s | MFU | peak memory (GiB) |", "| --- | --- | --- | --- |",
    ]
    for v in variants:
        lines.append(
            f"| {v} | {fmt_summary(pv[v]['tokens_per_s'], 0, ci=False)} | {fmt_summary(pv[v]['mfu'], 3, ci=False)} | "
            f"{fmt_summary(pv[v]['peak_memory_gb'], 2, ci=False)} |"
        )
    if not any(pv[v]["peak_memory_gb"]["n"] for v in variants):
        lines.append("\nPeak memory: not recorded in these runs' results.json.")
    contexts = sorted({int(c) for v in variants for c in analysis["extrapolation"][v]})
    if contexts:
        lines += [
            "", f"## Perplexity and length extrapolation ({split} split)", "",
            "eval.perplexity over the whole split: each token scored once, stride as recorded in the eval JSON. "
            "Contexts beyond the training length use RoPE positions never seen in training.", "",
            "| variant | " + " | ".join(f"ppl @ {c}" for c in contexts) + " | " + " | ".join(f"bpb @ {c}" for c in contexts) + " |",
            "| --- | " + " | ".join("---" for _ in contexts * 2) + " |",
        ]
        for v in variants:
            pts = analysis["extrapolation"][v]
            cells = [fmt_summary(pts[str(c)]["ppl"], 3, ci=False) if str(c) in pts else "n/a" for c in contexts]
            cells += [fmt_summary(pts[str(c)]["bpb"], ci=False) if str(c) in pts else "n/a" for c in contexts]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    if any(analysis["attention"][v]["zero_fraction"]["n"] for v in variants):
        lines += [
            "", "## Attention statistics (eval.attention_stats, mean over layers and heads)", "",
            "zero fraction: share of visible weights exactly 0; sink mass: share of |w| on the first token "
            "(softmax family: its weight); empty rows: all-zero rows; entropy of |w| / sum |w| per row; "
            "max logit: largest z (softmax family, after the cap) or q.k (threshold family), max over layers and heads.", "",
            "| variant | zero fraction | sink mass | empty rows | kept share | entropy (nats) | max logit |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for v in variants:
            a = analysis["attention"][v]
            lines.append(
                f"| {v} | {fmt_summary(a['zero_fraction'], ci=False)} | {fmt_summary(a['sink_mass'], ci=False)} | "
                f"{fmt_summary(a['empty_rows'], ci=False)} | {fmt_summary(a['surviving_share'], ci=False)} | "
                f"{fmt_summary(a['entropy'], 3, ci=False)} | {fmt_summary(a['max_logit'], 2, ci=False)} |"
            )
    tracked = [(m, label) for m, label in ROW_METRICS + (("lambda", "lambda (mean over layers and heads)"),)
               if any(m in analysis["trajectories"].get(v, {}) for v in variants)]
    if tracked:
        lines += ["", "## Over training (logged at each validation, mean over layers and seeds)", ""]
        for metric, label in tracked:
            rows = {v: analysis["trajectories"][v][metric] for v in variants if metric in analysis["trajectories"].get(v, {})}
            tokens = sorted({t for points in rows.values() for t, _ in points})
            lines += [f"**{label}**", "", "| variant | " + " | ".join(f"{t / 1e6:.1f}M" for t in tokens) + " |",
                      "| --- | " + " | ".join("---" for _ in tokens) + " |"]
            for v, points in rows.items():
                at = dict(points)
                lines.append(f"| {v} | " + " | ".join(fmt(at.get(t)) for t in tokens) + " |")
            lines.append("")
    lines += ["", "## Plots", ""]
    for name, path in plots.items():
        lines.append(f"![{name}]({path.name})")
    lines += ["", "## Runs", ""]
    for r in sorted(runs, key=lambda r: (variants.index(r.variant), r.seed if r.seed is not None else -1)):
        lines.append(f"- {r.variant} seed {r.seed}: `{r.path}`")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def build_report(paths, out: Path, title: str = "Attention ablation", split: str = "test", stats_split: str = "val",
                 margin: float | None = None, preface: str | None = None) -> dict:
    runs = [load_run(d, split, stats_split) for d in find_run_dirs(paths)]
    analysis = analyze(runs)
    out.mkdir(parents=True, exist_ok=True)
    plots = {"validation loss vs tokens": plot_curves(runs, analysis["variants"], out / "val_loss_vs_tokens.png")}
    if any(analysis["extrapolation"][v] for v in analysis["variants"]):
        plots["length extrapolation"] = plot_extrapolation(analysis, out / "extrapolation.png")
    if any(analysis["per_variant"][v]["tokens_per_s"]["n"] for v in analysis["variants"]):
        plots["throughput"] = plot_throughput(analysis, out / "throughput.png")
    opening = plot_trajectories(analysis, ROW_METRICS, out / "row_opening.png", "attention rows over training")
    if opening is not None:
        plots["rows over training"] = opening
    lam = plot_trajectories(analysis, (("lambda", "lambda, mean over layers and heads"),), out / "lambda.png",
                            "differential lambda over training")
    if lam is not None:
        plots["lambda over training"] = lam
    grid = plot_attention_grid(runs, analysis["variants"], out / "attention_maps.png")
    if grid is not None:
        plots["attention maps (layer x head, mean over seeds)"] = grid
    report = write_markdown(analysis, runs, out, title, plots, split, margin, preface)
    analysis["report"] = str(report)
    analysis["plots"] = {k: str(p) for k, p in plots.items()}
    (out / "summary.json").write_text(json.dumps(analysis, indent=2))
    return analysis


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or folders holding them (a multirun sweep)")
    parser.add_argument("--out", type=Path, default=Path("ablation_report"), help="output folder (default: ./ablation_report)")
    parser.add_argument("--title", default="Attention ablation")
    parser.add_argument("--split", default="test", help="split of the perplexity JSONs to read (default: test)")
    parser.add_argument("--stats-split", default="val", help="split of the attention-stats JSONs (default: val)")
    parser.add_argument("--margin", type=float, default=None,
                        help="read each paired CI against ±MARGIN nats too (e.g. 0.02: within 0.02 of softmax?)")
    parser.add_argument("--preface", type=Path, default=None, help="a markdown file put under the title (the reading)")
    args = parser.parse_args(argv)
    if args.margin is not None and not args.margin > 0:
        print(f"error: --margin must be > 0 nats, got {args.margin}", file=sys.stderr)
        return 2
    try:
        preface = args.preface.read_text() if args.preface is not None else None
        analysis = build_report(args.runs, args.out, args.title, args.split, args.stats_split, args.margin, preface)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {analysis['report']} and {len(analysis['plots'])} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
