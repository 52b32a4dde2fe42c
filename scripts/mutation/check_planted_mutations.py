"""Plant known bugs one at a time and check that the tests meant to catch each one fail.

Each entry of MUTATIONS names a file, an exact snippet of its source, the snippet's
replacement, and the pytest node ids that should catch the change. The script:

1. checks that every snippet occurs exactly once in its file and that every mutated file
   still parses (a stale list is an error, never a silent pass);
2. copies the repository's files (tracked and untracked, not ignored: `git ls-files`) into
   a temporary directory, so the working tree it runs from is never modified;
3. runs the union of all selections there on the unmutated code (the baseline: every
   selected test must pass, or a "caught" result would mean nothing);
4. for each mutation, writes the mutated file into the copy, runs
   `python -m pytest -q -x -p no:cacheprovider <selection>` with a timeout, and restores
   the file: caught (pytest exit 1: a test failed), survived (exit 0), error (a timeout or
   any other exit status: a collection error, no tests selected, ...).

It prints a markdown table and a score line, writes the results as JSON with --json, and
exits 0 when every mutation was caught, 1 when any survived or errored, 2 when the list is
stale or the baseline fails.

    python scripts/mutation/check_planted_mutations.py [--json OUT] [--only NAME ...] [--timeout S] [--list]

PYTHONPATH points at the copy, so the copy's code is imported even where attnlab is also
installed in editable mode from another checkout, and in subprocesses the tests start.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("attn", "data", "eval", "models", "training")

NUMERICS = "tests/test_training_numerics.py"
RELIABILITY = "tests/test_reliability.py"
EVAL = "tests/test_eval.py"
DATA = "tests/test_data.py"
REFERENCE = "tests/test_reference.py"
MODEL = "tests/test_model.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    replacement: str
    description: str
    selection: tuple[str, ...]  # pytest node ids expected to catch it


MUTATIONS = [
    # ------------------------------------------------------------------ learning-rate schedule
    Mutation(
        "lr-warmup-off-by-one", "models/schedules.py",
        "def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:\n"
        "    \"\"\"Linear warm-up, then cosine decay from 1 to min_lr_ratio between warmup_steps and max_steps.\"\"\"\n"
        "    _check_common(warmup_steps, max_steps, min_lr_ratio)\n"
        "    if step < warmup_steps:\n"
        "        return (step + 1) / warmup_steps",
        "def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:\n"
        "    \"\"\"Linear warm-up, then cosine decay from 1 to min_lr_ratio between warmup_steps and max_steps.\"\"\"\n"
        "    _check_common(warmup_steps, max_steps, min_lr_ratio)\n"
        "    if step < warmup_steps:\n"
        "        return (step + 2) / warmup_steps",
        "linear warmup one step ahead",
        (f"{NUMERICS}::test_lr_schedule_values_at_chosen_steps",
         f"{NUMERICS}::test_every_optimizer_step_uses_the_scheduled_lr_and_the_clipped_gradient"),
    ),
    Mutation(
        "cosine-stretched-10pct", "models/schedules.py",
        "    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))\n"
        "    return _decay(progress, min_lr_ratio, \"cosine\")",
        "    progress = min(1.0, (step - warmup_steps) / (max(1, max_steps - warmup_steps) * 1.1))\n"
        "    return _decay(progress, min_lr_ratio, \"cosine\")",
        "cosine phase 10% longer than max_steps - warmup_steps",
        (f"{NUMERICS}::test_lr_schedule_values_at_chosen_steps",
         f"{NUMERICS}::test_every_optimizer_step_uses_the_scheduled_lr_and_the_clipped_gradient"),
    ),
    # ------------------------------------------------------------------ weight decay
    Mutation(
        "decay-groups-everything", "models/lit.py",
        "(decay if id(p) in decayed else no_decay).append(p)",
        "decay.append(p)",
        "weight_decay_groups puts every parameter in the decayed group",
        (f"{NUMERICS}::test_weight_decay_groups_are_exactly_the_matrices",),
    ),
    Mutation(
        "decay-on-no-decay-group", "models/lit.py",
        '{"params": no_decay, "weight_decay": 0.0}',
        '{"params": no_decay, "weight_decay": o.weight_decay}',
        "the optimizer decays the no-decay group (norm gains, lambdas) too",
        (f"{NUMERICS}::test_the_optimizer_decays_the_matrices_and_nothing_else",),
    ),
    # ------------------------------------------------------------------ logged bits per byte
    Mutation(
        "val-bpb-constant", "models/lit.py",
        'nats / math.log(2) / self.bytes_per_token["val"]',
        'nats / math.log(2.1) / self.bytes_per_token["val"]',
        "training-time val/bpb divides by ln 2.1",
        (f"{NUMERICS}::test_logged_bits_per_byte_are_the_validation_nats_over_ln2_and_bytes_per_token",),
    ),
    # ------------------------------------------------------------------ gradient clipping and its norm
    Mutation(
        "clip-scale-not-applied", "models/lit.py",
        "torch._foreach_div_(grads, divisor)",
        "torch._foreach_div_(grads, 1.0)",
        "the clip scale is computed but the gradients are not scaled",
        (f"{NUMERICS}::test_every_optimizer_step_uses_the_scheduled_lr_and_the_clipped_gradient",),
    ),
    Mutation(
        "clip-clamp-max-2", "models/step_scalars.py",
        "min=1.0)",
        "min=0.5)",
        "clip divisor clamped at 0.5 instead of 1: gradients below the clip are scaled up",
        (f"{NUMERICS}::test_every_optimizer_step_uses_the_scheduled_lr_and_the_clipped_gradient",
         f"{NUMERICS}::test_a_clip_above_the_gradient_norm_leaves_the_gradient_untouched"),
    ),
    Mutation(
        "grad-norm-logged-after-clip", "models/lit.py",
        "torch._foreach_div_(grads, divisor)",
        "torch._foreach_div_(grads, divisor)\n"
        "                self._step_scalars[1].norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))",
        "train/grad_norm is the norm after clipping",
        (f"{NUMERICS}::test_logged_grad_norm_is_the_pre_clip_norm_of_each_step",),
    ),
    Mutation(
        "grad-norm-first-gradient-only", "models/step_scalars.py",
        "torch._foreach_norm(grads)",
        "torch._foreach_norm(grads[:1])",
        "the step's gradient norm covers only the first parameter's gradient",
        (f"{NUMERICS}::test_logged_grad_norm_is_the_pre_clip_norm_of_each_step",
         f"{NUMERICS}::test_every_optimizer_step_uses_the_scheduled_lr_and_the_clipped_gradient"),
    ),
    # ------------------------------------------------------------------ non-finite guard
    Mutation(
        "guard-ignores-loss-flag", "models/step_scalars.py",
        "torch.isfinite(grad_norm + loss)",
        "torch.isfinite(grad_norm + 0 * loss.nan_to_num(0.0, 0.0, 0.0))",
        "the non-finite guard never looks at the loss",
        (f"{RELIABILITY}::test_nonfinite_steps_are_skipped_counted_and_logged",
         f"{RELIABILITY}::test_nonfinite_loss_stops_naming_step_and_first_module",
         f"{RELIABILITY}::test_a_nonfinite_loss_with_finite_gradients_is_skipped"),
    ),
    Mutation(
        "guard-ignores-gradients", "models/step_scalars.py",
        "torch.isfinite(grad_norm + loss)",
        "torch.isfinite(0 * grad_norm.nan_to_num(0.0, 0.0, 0.0) + loss)",
        "the non-finite guard never looks at the gradients",
        (f"{RELIABILITY}::test_nonfinite_gradient_with_finite_loss_stops_naming_the_parameter",),
    ),
    # ------------------------------------------------------------------ eval perplexity
    Mutation(
        "ppl-window-start-off-by-one", "eval/perplexity.py",
        "windows.append(Window(end - context, context, n))",
        "windows.append(Window(end - context + 1, context, n))",
        "every window after the first starts one token late",
        (f"{EVAL}::test_windows_by_hand_stride_below_and_equal_to_context",
         f"{EVAL}::test_windows_score_each_target_once_with_max_left_context",
         f"{EVAL}::test_left_context_is_the_window_defined_one"),
    ),
    Mutation(
        "ppl-inputs-shifted", "eval/perplexity.py",
        "logits = logits_fn(ids[:, :-1])",
        "logits = logits_fn(ids[:, 1:])",
        "the model is fed the targets (inputs shifted by one)",
        (f"{EVAL}::test_bigram_model_on_a_tiny_text_by_hand",
         f"{EVAL}::test_bigram_model_matches_direct_sum",
         f"{EVAL}::test_left_context_is_the_window_defined_one"),
    ),
    Mutation(
        "eval-bpb-constant", "eval/perplexity.py",
        "LN2 = math.log(2.0)",
        "LN2 = math.log(2.1)",
        "eval bits per byte divide by ln 2.1",
        (f"{EVAL}::test_bits_per_byte_formula",
         f"{EVAL}::test_evaluate_run_contexts_strides_and_bpb"),
    ),
    Mutation(
        "eval-bpb-split-bytes", "eval/perplexity.py",
        'scored_bytes = bytes_per_token * scored["tokens"]',
        "scored_bytes = split_bytes",
        "eval bits per byte over the bytes of all tokens, not of the scored ones",
        (f"{EVAL}::test_evaluate_run_contexts_strides_and_bpb",),
    ),
    # ------------------------------------------------------------------ batch sampling
    Mutation(
        "sampling-y-not-shifted", "data/sampling.py",
        "return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()",
        "return windows[:, :-1].contiguous(), windows[:, :-1].contiguous()",
        "targets y equal the inputs x",
        (f"{DATA}::test_train_batch_is_a_pure_function_of_seed_and_position",
         f"{DATA}::test_val_windows_are_deterministic_contiguous_and_device_independent"),
    ),
    Mutation(
        "sampling-with-replacement", "data/sampling.py",
        "replace=False",
        "replace=True",
        "training window starts drawn with replacement",
        (f"{DATA}::test_global_batch_larger_than_the_split_is_refused",
         f"{DATA}::test_ranks_split_one_global_batch_into_disjoint_shares"),
    ),
    # ------------------------------------------------------------------ reference attention
    Mutation(
        "causal-mask-sees-next-key", "attn/masks.py",
        "visible &= j <= i",
        "visible &= j <= i + 1",
        "causal mask off by one: a query sees the next key",
        (f"{REFERENCE}::test_dense_mask_literal_examples",
         f"{REFERENCE}::test_softmax_family_matches_loops"),
    ),
    Mutation(
        "window-mask-one-key-too-many", "attn/masks.py",
        "visible &= j > i - spec.window",
        "visible &= j >= i - spec.window",
        "sliding window off by one: a query sees window + 1 keys",
        (f"{REFERENCE}::test_dense_mask_literal_examples",
         f"{REFERENCE}::test_dense_mask_and_counts_match_loops"),
    ),
    Mutation(
        "softmax-scale-missing", "attn/families/softmax.py",
        "per_query_head_scores(q, k) * spec.scale(d)",
        "per_query_head_scores(q, k)",
        "reference softmax attention without the 1/sqrt(D) scale",
        (f"{REFERENCE}::test_softmax_family_matches_loops",),
    ),
    Mutation(
        "rope-base-ignored", "models/gpt.py",
        "self.inv_freq.copy_(self.base ** (",
        "self.inv_freq.copy_(10000.0 ** (",
        "RoPE frequencies always use base 10000",
        (f"{MODEL}::test_rope_tables_match_the_rotation_within_and_beyond_the_context",
         f"{MODEL}::test_rope_base_sets_the_rotation_frequencies"),
    ),
    Mutation(
        "rope-base-not-passed", "models/gpt.py",
        "RoPE(cfg.head_dim, cfg.rope_base, cfg.context)",
        "RoPE(cfg.head_dim, 10000.0, cfg.context)",
        "the model ignores model.rope_base",
        (f"{MODEL}::test_rope_base_sets_the_rotation_frequencies",),
    ),
    Mutation(
        "scalar-lambda-not-clamped", "attn/families/differential.py",
        "return _fp32(self.lambda_scalar).clamp(0.0, 1.0).expand(self.n_head).contiguous()",
        "return _fp32(self.lambda_scalar).expand(self.n_head).contiguous()",
        "the official TDA lambda (scalar_clamp) is not clamped to [0, 1]",
        (f"{MODEL}::test_differential_lambda_is_learned",),
    ),
    Mutation(
        "monitor-max-over-heads", "training/callbacks/attention_monitor.py",
        "layer_means.append(sum(values) / len(values))",
        "layer_means.append(max(values))",
        "the validation-time attention statistics take the largest head instead of the mean",
        ("tests/test_attention_monitor.py::test_logged_row_statistics_match_the_checkpoints_statistics",),
    ),
    Mutation(
        "run-label-keeps-backend", "training/run_label.py",
        'NOT_A_SETTING = ("attn.backend",)',
        "NOT_A_SETTING = ()",
        "the run label counts the backend as a variant setting",
        ("tests/test_train.py::test_run_labels_name_a_variants_own_settings",),
    ),
]


@dataclass
class Result:
    name: str
    path: str
    description: str
    selection: list[str]
    result: str  # caught | survived | error
    seconds: float
    first_failure: str | None  # the first FAILED/ERROR node id pytest reported
    output_tail: str


def check_mutations(root: Path, mutations: list[Mutation]) -> None:
    """Every snippet occurs exactly once and every mutated file parses; raises SystemExit otherwise."""
    problems = []
    names = [m.name for m in mutations]
    if len(set(names)) != len(names):
        problems.append("duplicate mutation names")
    for m in mutations:
        source = (root / m.path).read_text()
        count = source.count(m.original)
        if count != 1:
            problems.append(f"{m.name}: {m.original!r} occurs {count} times in {m.path} (expected exactly once)")
            continue
        try:
            ast.parse(source.replace(m.original, m.replacement), m.path)
        except SyntaxError as error:
            problems.append(f"{m.name}: the mutated {m.path} does not parse: {error}")
        for node in m.selection:
            test_file = node.split("::")[0]
            if not (root / test_file).is_file():
                problems.append(f"{m.name}: selection {node!r}: no file {test_file}")
            elif "::" in node and f"def {node.split('::')[1].split('[')[0]}(" not in (root / test_file).read_text():
                problems.append(f"{m.name}: selection {node!r}: no such test in {test_file}")
    if problems:
        raise SystemExit("stale mutation list:\n  " + "\n  ".join(problems))


def copy_repository(root: Path, destination: Path) -> None:
    """The repository's tracked and untracked (not ignored) files, as they are in the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for relative in filter(None, listed):
        source = root / relative
        if not source.exists() and not source.is_symlink():  # deleted in the working tree
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def environment_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no stale bytecode between two mutations of one file
    return env


def check_imports_come_from(copy: Path, env: dict[str, str]) -> None:
    code = "import importlib\n" + "".join(
        f"print(importlib.import_module({name!r}).__file__)\n" for name in PACKAGES
    )
    files = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, check=True,
                           capture_output=True, text=True).stdout.split()
    outside = [f for f in files if not Path(f).resolve().is_relative_to(copy.resolve())]
    if outside:
        raise SystemExit(f"the copy's packages are not the ones imported: {outside}")


@dataclass
class PytestRun:
    status: int | None  # pytest's exit status; None: killed at the timeout
    seconds: float
    first_failure: str | None  # the first FAILED/ERROR node id pytest reported
    output: str


def run_pytest(copy: Path, env: dict[str, str], selection: list[str], timeout: float) -> PytestRun:
    """pytest in its own process group, so a timeout also ends the processes the tests started."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output, status = f"{output}\nkilled after {timeout:g} s", None
    failure = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return PytestRun(status, time.perf_counter() - start, failure.group(1) if failure else None, output)


def run_mutation(copy: Path, env: dict[str, str], mutation: Mutation, timeout: float) -> Result:
    """caught: pytest exit status 1 (a test failed); survived: 0; error: anything else (a timeout,
    a collection error, no tests collected, an internal error)."""
    target = copy / mutation.path
    original_source = target.read_text()
    target.write_text(original_source.replace(mutation.original, mutation.replacement))
    try:
        run = run_pytest(copy, env, list(mutation.selection), timeout)
    finally:
        target.write_text(original_source)
    result = {0: "survived", 1: "caught"}.get(run.status, "error")
    tail = run.output[-600:] if result == "caught" else f"pytest exit status {run.status}\n{run.output[-3000:]}"
    return Result(mutation.name, mutation.path, mutation.description, list(mutation.selection),
                  result, round(run.seconds, 1), run.first_failure, tail)


def short_selection(selection: list[str]) -> str:
    """Node ids without the tests/ prefix, one per line in a table cell."""
    return "<br>".join(s.removeprefix("tests/") for s in selection)


def markdown_table(results: list[Result]) -> str:
    lines = ["| mutation | file | selection | result | first failing test | seconds |",
             "|---|---|---|---|---|---:|"]
    for r in results:
        failing = (r.first_failure or "").removeprefix("tests/")
        lines.append(f"| `{r.name}`: {r.description} | {r.path} | {short_selection(r.selection)} | "
                     f"{r.result} | {failing} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated code")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)

    mutations = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutations: {sorted(unknown)}")
        mutations = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        for m in mutations:
            print(f"{m.name:32} {m.path:22} {m.description}")
        return 0
    check_mutations(ROOT, mutations)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="planted_mutations_") as temp:
        copy = Path(temp) / "repo"
        copy_repository(ROOT, copy)
        env = environment_for(copy)
        check_imports_come_from(copy, env)
        baseline = None
        if not args.no_baseline:
            union = list(dict.fromkeys(node for m in mutations for node in m.selection))
            run = run_pytest(copy, env, union, args.timeout * 2)
            summary = re.findall(r"^=* ?(\d+ passed.*?)(?: =*)?$", run.output, re.MULTILINE)
            baseline = {"result": "passed" if run.status == 0 else "failed", "seconds": round(run.seconds, 1),
                        "pytest_summary": summary[-1] if summary else None}
            print(f"baseline (unmutated, {len(union)} selections): {baseline['result']} in {run.seconds:.1f} s "
                  f"({baseline['pytest_summary']})", flush=True)
            if run.status != 0:
                print(f"the selected tests do not pass without any mutation (exit status {run.status}, "
                      f"{run.first_failure}):\n{run.output[-3000:]}", file=sys.stderr)
                return 2
        results = []
        for m in mutations:
            result = run_mutation(copy, env, m, args.timeout)
            results.append(result)
            print(f"{m.name}: {result.result} in {result.seconds:.1f} s"
                  + (f" ({result.first_failure})" if result.first_failure else ""), flush=True)
            if result.result != "caught":
                print(result.output_tail, flush=True)
    wall = time.perf_counter() - started

    caught = sum(r.result == "caught" for r in results)
    survived = [r.name for r in results if r.result == "survived"]
    errors = [r.name for r in results if r.result == "error"]
    score = (f"score: {caught}/{len(results)} caught ({100 * caught / len(results):.0f}%); "
             f"survived: {', '.join(survived) or 'none'}; errors: {', '.join(errors) or 'none'}; "
             f"wall time {wall:.0f} s")
    print()
    print(markdown_table(results))
    print()
    print(score)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "commit": commit, "working_tree_dirty": dirty, "python": sys.version.split()[0],
            "baseline": baseline, "caught": caught, "total": len(results), "survived": survived,
            "errors": errors, "wall_seconds": round(wall, 1), "results": [asdict(r) for r in results],
        }, indent=2) + "\n")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
