"""The project's cosmic-ray filter, run by scripts/mutation/run_cosmic_ray.sh after cosmic-ray's own
operators-filter:

    python scripts/mutation/cosmic_ray/filters.py session.sqlite scripts/mutation/cosmic_ray/NAME.toml

It marks as SKIPPED (never run, never counted in the score):
1. the mutants that can only change text: inside type annotations of a module with
   `from __future__ import annotations` (an annotation there is a string nobody evaluates:
   `dict | None` -> `dict & None` changes nothing), and inside f-strings (what a message or a
   log key says, not what the code does: equivalent mutants for a score of behaviour);
2. with `[cosmic-ray.filters.sample] fraction = F, seed = S` in the config, all but a seeded random
   fraction F of the mutants still pending: for a module whose full run does not fit the time
   (each mutant imports torch and Lightning, ~6 s, before its tests run). The same seed and
   module give the same sample.

cosmic-ray's own filters select by operator name, line range, git diff or a
`# pragma: no mutate` comment, none of which finds annotations or samples.
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
from functools import lru_cache
from pathlib import Path

from cosmic_ray.config import load_config
from cosmic_ray.tools.filters.filter_app import FilterApp
from cosmic_ray.work_item import WorkerOutcome, WorkResult


@lru_cache
def text_only_spans(path: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((start line, col), (end line, col)) of every f-string of a module, and of every annotation
    when the module postpones their evaluation."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    postponed = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                    and any(a.name == "annotations" for a in n.names) for n in tree.body)
    nodes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            nodes.append(node)
        elif not postponed:
            continue
        elif isinstance(node, ast.arg) and node.annotation is not None:
            nodes.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            nodes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            nodes.append(node.annotation)
    return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in nodes]


def is_text_only(path: str, start, end) -> bool:
    # cosmic-ray's positions are (1-based line, 0-based column), as the ast's
    return any(lo <= tuple(start) and tuple(end) <= hi for lo, hi in text_only_spans(path))


class ProjectFilter(FilterApp):
    def description(self):
        return __doc__

    def add_args(self, parser: argparse.ArgumentParser):
        parser.add_argument("config", help="the run's scripts/mutation/cosmic_ray/NAME.toml")

    def filter(self, work_db, args):
        text_only = [item.job_id for item in work_db.pending_work_items
                     if all(is_text_only(str(m.module_path), m.start_pos, m.end_pos) for m in item.mutations)]
        if text_only:
            work_db.set_multiple_results(text_only, WorkResult(
                output="text only: inside an annotation or an f-string", worker_outcome=WorkerOutcome.SKIPPED))
        print(f"filters: {len(text_only)} mutants inside annotations or f-strings skipped")
        sample = load_config(args.config).sub("filters", "sample")
        fraction = float(sample.get("fraction", 1.0))
        if fraction < 1.0:
            pending = sorted(work_db.pending_work_items,
                             key=lambda it: [(str(m.module_path), tuple(m.start_pos), m.operator_name, m.occurrence)
                                             for m in it.mutations])
            keep = set(random.Random(int(sample.get("seed", 0))).sample(range(len(pending)),
                                                                       round(fraction * len(pending))))
            left_out = [item.job_id for i, item in enumerate(pending) if i not in keep]
            if left_out:
                work_db.set_multiple_results(left_out, WorkResult(
                    output=f"not in the seeded {fraction:.0%} sample", worker_outcome=WorkerOutcome.SKIPPED))
            print(f"filters: a {fraction:.0%} sample: {len(keep)} of {len(pending)} mutants run, "
                  f"{len(left_out)} skipped")


if __name__ == "__main__":
    sys.exit(ProjectFilter().main())
