"""Reading cuobjdump's SASS listings (torch-free: the Gluon counter runs under a Triton without torch).

`parse_sass` gives (address, instruction) pairs, `innermost_loops` the bodies of the innermost loops
(a branch back to a lower address) holding a given instruction, `registers_renamed` tells whether two
listings are one program with its values in other registers, `opcode_category` sorts an
instruction into the first matching column of a (column, opcode prefixes) table, and `cuobjdump`
runs Triton's bundled cuobjdump on a cubin; `fixed_layout_ptxas` makes ptxas's output repeatable;
`markdown_table` prints rows.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

LINE_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_RE = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+)")


def parse_sass(text: str) -> list[tuple[int, str]]:
    """[(address, instruction without its predicate)]."""
    return [(int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))) for m in LINE_RE.finditer(text)]


REGISTER_RE = re.compile(r"\b(?:U?R|U?P)\d+\b")  # R7, UR4, P0, UP1; not RZ, URZ, PT, UPT
GUARD_RE = re.compile(r"^(@!?\S+)\s+")
DEFINED_RE = re.compile(r"(?:U?R|U?P)\d+")  # a first operand that is a register alone: what the instruction writes


def registers_renamed(before: str, after: str) -> bool:
    """Whether listing `after` is `before` with its registers' values renamed one for one: the same instructions
    with the same predicates and operands in the same order, and in listing order each register an instruction
    reads (its guard, its operands after the first, a first operand with an address) the register that holds the
    other listing's value there, a register written (a first operand that is a register alone) starting a new
    pairing. A value's register may differ from place to place as ptxas reuses registers; two values never
    share one. Listing order, not control flow: a heuristic for two compiles of one program, not a proof."""
    a = [m.group(2) for m in LINE_RE.finditer(before)]
    b = [m.group(2) for m in LINE_RE.finditer(after)]
    if len(a) != len(b):
        return False
    forward: dict[str, str] = {}
    backward: dict[str, str] = {}

    def read(rx: str, ry: str) -> bool:
        if forward.get(rx, ry) != ry or backward.get(ry, rx) != rx:
            return False
        forward[rx], backward[ry] = ry, rx
        return True

    def write(rx: str, ry: str) -> None:
        if backward.get(forward.get(rx)) == rx:
            del backward[forward[rx]]
        if forward.get(backward.get(ry)) == ry:
            del forward[backward[ry]]
        forward[rx], backward[ry] = ry, rx

    for x, y in zip(a, b):
        if REGISTER_RE.sub("%", x) != REGISTER_RE.sub("%", y):
            return False
        guard_x, guard_y = GUARD_RE.match(x), GUARD_RE.match(y)
        if guard_x and not all(read(rx, ry) for rx, ry in zip(REGISTER_RE.findall(guard_x.group(1)),
                                                               REGISTER_RE.findall(guard_y.group(1)))):
            return False
        ops_x = x[guard_x.end() if guard_x else 0:].partition(" ")[2].split(",")
        ops_y = y[guard_y.end() if guard_y else 0:].partition(" ")[2].split(",")
        written = DEFINED_RE.fullmatch(ops_x[0].strip()) is not None
        for op_x, op_y in zip(ops_x[1:] if written else ops_x, ops_y[1:] if written else ops_y):
            if not all(read(rx, ry) for rx, ry in zip(REGISTER_RE.findall(op_x), REGISTER_RE.findall(op_y))):
                return False
        if written:
            write(ops_x[0].strip(), ops_y[0].strip())
    return True


def innermost_loops(instrs: list[tuple[int, str]], holds: Callable[[str], bool]) -> list[list[str]]:
    """Bodies of the innermost loops (a branch back to a lower address) with an instruction for which
    `holds` is true, in address order."""
    spans = []
    for addr, ins in instrs:
        m = BRANCH_RE.search(ins)
        if m and int(m.group(1), 16) <= addr:
            spans.append((int(m.group(1), 16), addr))
    inner = sorted(s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans))
    bodies = [[ins for addr, ins in instrs if lo <= addr <= hi] for lo, hi in inner]
    return [body for body in bodies if any(holds(ins) for ins in body)]


def opcode_category(ins: str, categories: list[tuple[str, tuple[str, ...]]]) -> str:
    """The first column of `categories` whose prefixes the opcode starts with, else "other"."""
    op = ins.split()[0]
    return next((col for col, prefixes in categories if op.startswith(prefixes)), "other")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """The rows as a markdown table of `columns`; floats with two decimals."""
    def cell(value) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, f.name], check=True, capture_output=True,
                              text=True).stdout


def fixed_layout_ptxas(directory: Path, ptxas: str) -> str | None:
    """A wrapper of `ptxas` (written to `directory`) for TRITON_PTXAS_PATH that gives the same SASS for the same
    PTX every time, or None where this machine cannot run one. Triton 3.6's bundled ptxas (CUDA 12.8) does not:
    from one PTX file of a Gluon kernel it wrote two listings (other register numbers and order) over repeated
    runs, and one listing every time with address-space randomization off, so the wrapper runs it under
    `setarch -R`."""
    setarch = shutil.which("setarch")
    if setarch is None:
        return None
    wrapper = Path(directory) / "ptxas"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(setarch)} -R {shlex.quote(ptxas)} "$@"\n')
    wrapper.chmod(0o755)
    try:  # a container may refuse the personality change: then setarch fails
        subprocess.run([str(wrapper), "--version"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return str(wrapper)
