"""Whether a change to the Gluon kernels changes their machine code: each listed kernel compiled for sm_90 on the
CPU from two trees (`--before DIR`, `--after DIR`, e.g. a `git worktree` of the old commit and the working tree),
its SASS compared. A refactor that moves code into shared @gluon.jit helpers should leave every kernel
`identical`; where it does not, the row says how far the difference goes: `same loops` (every innermost loop
with an HGMMA identical, the opcodes of the whole kernel the same multiset: register names and order outside
the loops moved), `same opcodes` (the whole kernel the same multiset of opcodes) or `differs`. No GPU.

Triton 3.6 does not always compile a kernel to the same SASS: over repeated compiles of one source (Triton's
cache bypassed), the threshold's one-pass key-block kernel at p = 1.5, D = 128, full came out two ways
(register numbers outside its loops). So each tree compiles every kernel --rounds times, and a kernel is
`identical` where some compile of the one tree equals some compile of the other; the row gives the number of
distinct listings per tree.

    git worktree add --detach /tmp/before HEAD
    TRITON_INTERPRET=0 python scripts/analysis/gluon_sass_diff.py --before /tmp/before --after . \\
        --kernels softmax_bwd weighted_bwd [--out FILE.md]

Kernel sets (`--kernels`): softmax_bwd, weighted_bwd (the key-block kernels: per-item, one-pass and persistent
forms of plain, tanh and ALSC-with-temperature / threshold p = 2, 1.5 and sigmoid), at D = 128 and 64, causal
and full, bf16. Each tree is compiled in its own process (the modules are imported from its root).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_listing import innermost_loops, markdown_table, parse_sass  # noqa: E402


def kernel_cases(kernel_set: str) -> list[tuple[str, dict]]:
    """(module under attn.kernels, its compile_sm90 arguments) of a kernel set."""
    cases = []
    for head_dim in (128, 64):
        for causal in (True, False):
            shape = dict(head_dim=head_dim, causal=causal)
            if kernel_set == "softmax_bwd":
                for form in (dict(cap=0), dict(cap=1), dict(cap=3, has_temp=True)):
                    cases += [("gluon_softmax_bwd", dict(shape, kernel="dkdv", **form)),
                              ("gluon_softmax_bwd", dict(shape, kernel="dkdv_one_pass", **form))]
                cases.append(("gluon_softmax_bwd", dict(shape, kernel="dkdv", cap=1, persistent=True)))
            elif kernel_set == "weighted_bwd":
                for weight in (dict(weight=1, power=2.0), dict(weight=1, power=1.5), dict(weight=2)):
                    cases += [("gluon_weighted_bwd", dict(shape, kernel="dkdv", **weight)),
                              ("gluon_weighted_bwd", dict(shape, kernel="dkdv_one_pass", **weight)),
                              ("gluon_weighted_bwd", dict(shape, kernel="dkdv", persistent=True, **weight))]
            else:
                raise ValueError(f"--kernels: unknown set {kernel_set!r}; allowed: softmax_bwd, weighted_bwd")
    return cases


def case_name(module: str, kwargs: dict) -> str:
    return module + " " + " ".join(f"{k}={v}" for k, v in kwargs.items())


def start_compiles(root: Path, cases: list[tuple[str, dict]], rounds: int) -> subprocess.Popen:
    """A process compiling every case `rounds` times from the tree at root, Triton's cache bypassed (so that
    two trees' modules never meet in one interpreter); `finish_compiles` reads its {case name: [distinct SASS]}."""
    program = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = [{str(root)!r}, {str(Path(__file__).resolve().parent)!r}]\n"
        "from sass_listing import cuobjdump\n"
        "out = {}\n"
        f"for _ in range({rounds}):\n"
        f"    for name, module, kwargs in {[(case_name(*case), *case) for case in cases]!r}:\n"
        "        compiled = importlib.import_module('attn.kernels.' + module).compile_sm90(**kwargs)\n"
        "        sass = cuobjdump(compiled.asm['cubin'], '-sass')\n"
        "        out.setdefault(name, [])\n"
        "        if sass not in out[name]:\n"
        "            out[name].append(sass)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "TRITON_ALWAYS_COMPILE": "1", "TRITON_INTERPRET": "0"}
    return subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env=env)


def finish_compiles(root: Path, proc: subprocess.Popen) -> dict[str, list[str]]:
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"compiling the kernels of {root} failed:\n{stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def opcode(instruction: str) -> str:
    return instruction.split(" ")[0]


def compare(before: list[str], after: list[str]) -> str:
    """identical, same loops, same opcodes or differs (see the module's docstring) of two trees' distinct
    listings of one kernel: identical where the two share one, else the verdict on their first listings."""
    if set(before) & set(after):
        return "identical"
    a, b = parse_sass(before[0]), parse_sass(after[0])
    if [i for _, i in a] == [i for _, i in b]:
        return "identical"
    same_opcodes = collections.Counter(opcode(i) for _, i in a) == collections.Counter(opcode(i) for _, i in b)
    if not same_opcodes:
        return "differs"
    holds = re.compile(r"^HGMMA").match
    if innermost_loops(a, holds) == innermost_loops(b, holds):
        return "same loops"
    return "same opcodes"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the tree before the change")
    ap.add_argument("--after", type=Path, required=True, help="the tree after it")
    ap.add_argument("--kernels", nargs="+", default=["softmax_bwd", "weighted_bwd"])
    ap.add_argument("--rounds", type=int, default=2, help="compiles of every kernel per tree")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    cases = [case for kernel_set in args.kernels for case in kernel_cases(kernel_set)]
    running = {root: start_compiles(root, cases, args.rounds) for root in (args.before, args.after)}  # side by side
    before, after = (finish_compiles(root, proc) for root, proc in running.items())
    rows = [{"kernel": name, "instructions before": len(parse_sass(before[name][0])),
             "after": len(parse_sass(after[name][0])),
             "listings before / after": f"{len(before[name])} / {len(after[name])}",
             "result": compare(before[name], after[name])}
            for name in (case_name(*case) for case in cases)]
    table = markdown_table(rows, ["kernel", "instructions before", "after", "listings before / after", "result"])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if all(row["result"] in ("identical", "same loops") for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
