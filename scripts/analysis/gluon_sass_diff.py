"""Whether a change to the Gluon kernels changes their machine code: each listed kernel compiled for sm_90 on the
CPU from two trees (`--before DIR`, `--after DIR`, e.g. a `git worktree` of the old commit and the working tree),
its SASS compared. A refactor that moves code into shared @gluon.jit helpers should leave every kernel
`identical` or `registers renamed` (the same instructions in the same order with values in other registers,
`sass_listing.registers_renamed`: ptxas assigns registers by the order it meets values in, which a helper's
inlining can move); where it does not, the row says how far the difference goes: `same loops` (every innermost loop
with an HGMMA identical, the opcodes of the whole kernel the same multiset: register names and order outside
the loops moved), `same opcodes` (the whole kernel the same multiset of opcodes) or `differs`. No GPU.

Triton 3.6's bundled ptxas does not always turn one PTX into the same SASS (the threshold's one-pass key-block
kernel at p = 1.5, D = 128, full came out with two register assignments), but it does with address-space
randomization off, so the compiles run it under `setarch -R` (`sass_listing.fixed_layout_ptxas`). Where this
machine cannot, each tree compiles every kernel --rounds times (default 2; 1 with the fixed layout), a kernel
is `identical` where some compile of the one tree equals some compile of the other, and a kernel that is not
gets --recheck-rounds more compiles in each tree (default 6; 0 with the fixed layout); the row gives the number
of distinct listings per tree.

    git worktree add --detach /tmp/before HEAD
    TRITON_INTERPRET=0 python scripts/analysis/gluon_sass_diff.py --before /tmp/before --after . \\
        --kernels softmax_bwd weighted_bwd [--out FILE.md]

Kernel sets (`--kernels`, default all; `KERNEL_SETS`): the forwards (softmax_fwd: plain, tanh, ALSC with a
temperature, ping-pong, persistent; weighted_fwd: threshold p = 2, 1.5, sigmoid, persistent; diff_fwd) and the
backwards (softmax_bwd, weighted_bwd: key-block, one-pass and dQ kernels, persistent forms; diff_bwd: its
key-block forms and dQ kernels), each at D = 128 and 64, causal and full, bf16. Each tree is compiled in its
own process (the modules are imported from its root); a form that does not compile at a shape is reported
`both fail to compile` where both trees refuse it alike. Exit status 1 where a kernel reads `same opcodes` or
`differs`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_listing import (fixed_layout_ptxas, innermost_loops, markdown_table, parse_sass,  # noqa: E402
                          registers_renamed)


# kernel set -> (module under attn.kernels, [compile_sm90 arguments besides the shape]); every set compiles at
# D = 128 and 64, causal and full, bf16
_SOFTMAX_FORMS = (dict(cap=0), dict(cap=1), dict(cap=3, has_temp=True))
_WEIGHTS = (dict(weight=1, power=2.0), dict(weight=1, power=1.5), dict(weight=2))
KERNEL_SETS = {
    "softmax_fwd": ("gluon_softmax_fwd", [*_SOFTMAX_FORMS, dict(cap=1, pingpong=True), dict(cap=0, persistent=True)]),
    "weighted_fwd": ("gluon_weighted_fwd", [*_WEIGHTS, dict(weight=1, power=2.0, persistent=True)]),
    "diff_fwd": ("gluon_diff_fwd", [dict(power=2.0), dict(power=1.5), dict(power=2.0, persistent=True)]),
    "softmax_bwd": ("gluon_softmax_bwd", [dict(kernel=kernel, **form) for form in _SOFTMAX_FORMS
                                          for kernel in ("dkdv", "dkdv_one_pass", "dq")]
                    + [dict(kernel="dkdv", cap=1, persistent=True), dict(kernel="dq", cap=1, persistent=True)]),
    "weighted_bwd": ("gluon_weighted_bwd", [dict(kernel=kernel, **weight) for weight in _WEIGHTS
                                            for kernel in ("dkdv", "dkdv_one_pass", "dq")]
                     + [dict(kernel="dkdv", persistent=True, **weight) for weight in _WEIGHTS]),
    "diff_bwd": ("gluon_diff_bwd", [dict(kernel=kernel, power=2.0) for kernel in (
        "dkdv", "dkdv_first", "dkdv_second", "dkdv_views", "dkdv_persistent", "dq", "dq_persistent", "dq_views")]),
}


def kernel_cases(kernel_set: str) -> list[tuple[str, dict]]:
    """(module under attn.kernels, its compile_sm90 arguments) of a kernel set."""
    if kernel_set not in KERNEL_SETS:
        raise ValueError(f"--kernels: unknown set {kernel_set!r}; allowed: {', '.join(KERNEL_SETS)}")
    module, forms = KERNEL_SETS[kernel_set]
    return [(module, dict(head_dim=head_dim, causal=causal, **form))
            for head_dim in (128, 64) for causal in (True, False) for form in forms]


def case_name(module: str, kwargs: dict) -> str:
    return module + " " + " ".join(f"{k}={v}" for k, v in kwargs.items())


def start_compiles(root: Path, cases: list[tuple[str, dict]], rounds: int, ptxas: str | None) -> subprocess.Popen:
    """A process compiling every case `rounds` times from the tree at root, Triton's cache bypassed (so that
    two trees' modules never meet in one interpreter); `finish_compiles` reads its {case name: [distinct SASS]}."""
    program = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = [{str(root)!r}, {str(Path(__file__).resolve().parent)!r}]\n"
        "from sass_listing import cuobjdump\n"
        "out = {}\n"
        f"for _ in range({rounds}):\n"
        f"    for name, module, kwargs in {[(case_name(*case), *case) for case in cases]!r}:\n"
        "        try:\n"
        "            compiled = importlib.import_module('attn.kernels.' + module).compile_sm90(**kwargs)\n"
        "            sass = cuobjdump(compiled.asm['cubin'], '-sass')\n"
        "        except Exception as e:  # a form this shape does not compile to: the same error both sides\n"
        "            sass = f'compile error: {type(e).__name__}: {str(e)[:200]}'\n"
        "        out.setdefault(name, [])\n"
        "        if sass not in out[name]:\n"
        "            out[name].append(sass)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "TRITON_ALWAYS_COMPILE": "1", "TRITON_INTERPRET": "0"}
    if ptxas is not None:
        env["TRITON_PTXAS_PATH"] = ptxas
    return subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env=env)


def compile_both(before: Path, after: Path, cases: list[tuple[str, dict]], rounds: int, ptxas: str | None):
    """({case name: [distinct SASS]} of the tree before, the same of the tree after), compiled side by side."""
    # one tree may be given twice: each side compiles in its own process
    running = [(root, start_compiles(root, cases, rounds, ptxas)) for root in (before, after)]
    return tuple(finish_compiles(root, proc) for root, proc in running)


def finish_compiles(root: Path, proc: subprocess.Popen) -> dict[str, list[str]]:
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"compiling the kernels of {root} failed:\n{stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def compile_trees(before: Path, after: Path, cases: list[tuple[str, dict]], rounds: int, recheck_rounds: int,
                  ptxas: str | None):
    """compile_both, then recheck_rounds more compiles of each kernel whose listings the trees do not share."""
    listings = compile_both(before, after, cases, rounds, ptxas)
    unshared = [case for case in cases  # no listing in common yet (a form both trees refuse has its error in common)
                if not set(listings[0][case_name(*case)]) & set(listings[1][case_name(*case)])]
    if unshared and recheck_rounds:  # a kernel ptxas compiles more than one way may need more tries
        for tree, more in zip(listings, compile_both(before, after, unshared, recheck_rounds, ptxas)):
            for name, sass in more.items():
                tree[name] += [s for s in sass if s not in tree[name]]
    return listings


COMPILE_ERROR = "compile error: "


def opcode(instruction: str) -> str:
    return instruction.split(" ")[0]


def compare(before: list[str], after: list[str]) -> str:
    """identical, registers renamed, same loops, same opcodes or differs (the module's docstring) of two trees'
    distinct listings of one kernel: identical where the two share one, else the verdict on their first listings."""
    if set(before) & set(after):
        return "both fail to compile" if before[0].startswith(COMPILE_ERROR) else "identical"
    if before[0].startswith(COMPILE_ERROR) or after[0].startswith(COMPILE_ERROR):
        return "differs"
    a, b = parse_sass(before[0]), parse_sass(after[0])
    if [i for _, i in a] == [i for _, i in b]:
        return "identical"
    if registers_renamed(before[0], after[0]):
        return "registers renamed"
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
    ap.add_argument("--kernels", nargs="+", default=list(KERNEL_SETS), choices=list(KERNEL_SETS))
    ap.add_argument("--rounds", type=int, help="compiles of every kernel per tree (default 1 with ptxas's fixed "
                    "layout, else 2)")
    ap.add_argument("--recheck-rounds", type=int, help="more compiles per tree of a kernel whose listings the two "
                    "trees do not share yet (default 0 with ptxas's fixed layout, else 6)")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    cases = [case for kernel_set in args.kernels for case in kernel_cases(kernel_set)]
    from triton import knobs  # here: the verdict's tests import this module without Triton

    with tempfile.TemporaryDirectory() as tools:
        ptxas = fixed_layout_ptxas(Path(tools), knobs.nvidia.ptxas.path)
        rounds = args.rounds if args.rounds is not None else (1 if ptxas else 2)
        recheck = args.recheck_rounds if args.recheck_rounds is not None else (0 if ptxas else 6)
        print(f"ptxas: {'fixed layout (setarch -R)' if ptxas else 'as bundled'}; {rounds} compiles per kernel and "
              f"tree, {recheck} more where the trees share no listing", file=sys.stderr)
        before, after = compile_trees(args.before, args.after, cases, rounds, recheck, ptxas)
    rows = [{"kernel": name, "instructions before": len(parse_sass(before[name][0])),
             "after": len(parse_sass(after[name][0])),
             "listings before / after": f"{len(before[name])} / {len(after[name])}",
             "result": compare(before[name], after[name])}
            for name in (case_name(*case) for case in cases)]
    table = markdown_table(rows, ["kernel", "instructions before", "after", "listings before / after", "result"])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    kept = ("identical", "registers renamed", "same loops", "both fail to compile")
    return 0 if all(row["result"] in kept for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
