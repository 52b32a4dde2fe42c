"""The score of a cosmic-ray session, skipped mutants left out (cr-report counts a skipped mutant as
killed), and the survivors by source line:

    python scripts/mutation/cosmic_ray/score.py session.sqlite [--diffs]
"""

from __future__ import annotations

import argparse
import collections
import sqlite3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("session")
    parser.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    args = parser.parse_args()
    db = sqlite3.connect(args.session)
    rows = db.execute(
        "SELECT s.module_path, s.start_pos_row, s.operator_name, r.worker_outcome, r.test_outcome, r.diff "
        "FROM mutation_specs s LEFT JOIN work_results r ON r.job_id = s.job_id").fetchall()
    outcome = collections.Counter()
    survivors = []
    for module, line, op, worker, test, diff in rows:
        worker, test = (worker or "").lower() or None, (test or "").lower()  # stored as the enums' names
        if worker is None:
            outcome["pending"] += 1
        elif worker == "skipped":
            outcome["skipped"] += 1
        elif worker != "normal":  # the worker itself failed or timed out
            outcome[worker] += 1
        elif test == "survived":
            outcome["survived"] += 1
            survivors.append((module, line, op.removeprefix("core/"), diff or ""))
        else:
            outcome["killed" if test == "killed" else test] += 1
    # a mutant whose tests time out counts as caught (a test noticed: it never finished)
    caught = outcome["killed"] + outcome["incompetent"] + outcome["timeout"]
    run = caught + outcome["survived"]
    print(f"mutants: {len(rows)}; " + ", ".join(f"{k}: {v}" for k, v in sorted(outcome.items())))
    if run:
        print(f"score: {caught}/{run} caught ({caught / run:.0%}) of the mutants run")
    by_line = collections.defaultdict(list)
    for module, line, op, diff in survivors:
        by_line[(module, line)].append((op, diff))
    for (module, line), ops in sorted(by_line.items()):
        print(f"{module}:{line}  {len(ops)}  " + " ".join(op for op, _ in ops))
        if args.diffs:
            for op, diff in ops:
                changed = [d for d in diff.splitlines() if d[:1] in "+-" and d[:3] not in ("+++", "---")]
                print(f"    {op}: " + " | ".join(changed))


if __name__ == "__main__":
    main()
