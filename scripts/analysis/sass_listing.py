"""Reading cuobjdump's SASS listings (torch-free: the Gluon counter runs under a Triton without torch).

`parse_sass` gives (address, instruction) pairs, `innermost_loops` the bodies of the innermost loops
(a branch back to a lower address) holding a given instruction, `opcode_category` sorts an
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
