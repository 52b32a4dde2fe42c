"""scripts/analysis/gluon_sass_diff.py's verdict on two SASS listings (no compiler needed): identical code, one program
with its registers renamed one for one, the same loops with other code outside them, a loop changed, an instruction
added; a kernel either tree can compile to counts as identical; and the ptxas wrapper it compiles with
(address-space randomization off)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "analysis"))

from gluon_sass_diff import COMPILE_ERROR, compare, kernel_cases  # noqa: E402
from sass_listing import fixed_layout_ptxas  # noqa: E402

ADDR_NO_RANDOMIZE = 0x0040000  # <linux/personality.h>


def listing(*instructions: str) -> str:
    """cuobjdump's layout: /*address*/ instruction ; one per 16 bytes."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(instructions))


PROLOGUE = ("MOV R1, c[0x0][0x28]", "S2R R0, SR_TID.X")
LOOP = ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", "FMUL R2, R24, R25", "ISETP.GE.AND P0, PT, R0, 0x4, PT",
        "@!P0 BRA 0x20")  # a branch back to the loop's first instruction at 0x20
TAIL = ("IADD3 R4, R0, 0x1, RZ", "MOV R5, R4", "EXIT")


def test_identical_code_is_identical():
    code = listing(*PROLOGUE, *LOOP, *TAIL)
    assert compare([code], [code]) == "identical"


def test_a_listing_either_tree_can_compile_to_is_identical():
    code, other = listing(*PROLOGUE, *LOOP, *TAIL), listing(*PROLOGUE, *LOOP, "NOP", *TAIL)
    assert compare([other, code], [code]) == "identical"


def test_registers_renamed_one_for_one_are_the_same_program():
    renamed_tail = ("IADD3 R6, R0, 0x1, RZ", "MOV R5, R6", "EXIT")
    assert compare([listing(*PROLOGUE, *LOOP, *TAIL)], [listing(*PROLOGUE, *LOOP, *renamed_tail)]) == \
        "registers renamed"
    # a predicate and a uniform register renamed in the loop, with every use of each
    loop = (LOOP[0].replace("UR4", "UR6"), LOOP[1], LOOP[2].replace("P0", "P2"), LOOP[3].replace("P0", "P2"))
    assert compare([listing(*PROLOGUE, *LOOP, *TAIL)], [listing(*PROLOGUE, *loop, *TAIL)]) == "registers renamed"


def test_other_values_outside_the_loops_keep_the_loops():
    # the value written to R6 is not the one read from R4: another program, whose loops are still the same
    changed_tail = ("IADD3 R6, R0, 0x1, RZ", "MOV R5, R4", "EXIT")
    assert compare([listing(*PROLOGUE, *LOOP, *TAIL)], [listing(*PROLOGUE, *LOOP, *changed_tail)]) == "same loops"
    # two live values of the one in one register of the other: not a renaming either
    two = ("IADD3 R4, R0, 0x1, RZ", "IADD3 R6, R0, 0x2, RZ", "IADD3 R5, R4, R6, RZ", "EXIT")
    one = ("IADD3 R4, R0, 0x1, RZ", "IADD3 R4, R0, 0x2, RZ", "IADD3 R5, R4, R4, RZ", "EXIT")
    assert compare([listing(*PROLOGUE, *LOOP, *two)], [listing(*PROLOGUE, *LOOP, *one)]) == "same loops"
    # a register reused for a value once the last one it held is dead: the same program
    reused = ("IADD3 R4, R0, 0x1, RZ", "MOV R5, R4", "IADD3 R4, R5, 0x2, RZ", "EXIT")
    other = ("IADD3 R7, R0, 0x1, RZ", "MOV R5, R7", "IADD3 R9, R5, 0x2, RZ", "EXIT")
    assert compare([listing(*PROLOGUE, *LOOP, *reused)], [listing(*PROLOGUE, *LOOP, *other)]) == "registers renamed"


def test_a_loop_reordered_is_not_the_same_loop():
    reordered = (LOOP[0], LOOP[2], LOOP[1], LOOP[3])
    assert compare([listing(*PROLOGUE, *LOOP, *TAIL)], [listing(*PROLOGUE, *reordered, *TAIL)]) == "same opcodes"


def test_an_instruction_more_differs():
    assert compare([listing(*PROLOGUE, *LOOP, *TAIL)], [listing(*PROLOGUE, *LOOP, "NOP", *TAIL)]) == "differs"


def test_a_form_neither_tree_compiles_is_reported_as_such():
    error = COMPILE_ERROR + "ValueError: no such form"
    assert compare([error], [error]) == "both fail to compile"
    assert compare([error], [listing(*PROLOGUE, *LOOP, *TAIL)]) == "differs"


def test_kernel_sets_name_their_cases_and_refuse_unknown_sets():
    cases = kernel_cases("weighted_bwd")
    assert {module for module, _ in cases} == {"gluon_weighted_bwd"}
    assert {kwargs["kernel"] for _, kwargs in cases} == {"dkdv", "dkdv_one_pass", "dq"}
    assert {(kwargs["head_dim"], kwargs["causal"]) for _, kwargs in cases} == {(128, True), (128, False), (64, True),
                                                                              (64, False)}
    assert any(kwargs.get("persistent") for _, kwargs in cases)
    with pytest.raises(ValueError, match="softmax_bwd, weighted_bwd"):
        kernel_cases("forward")


@pytest.mark.skipif(shutil.which("setarch") is None, reason="needs util-linux's setarch")
def test_the_fixed_layout_ptxas_runs_ptxas_without_address_randomization(tmp_path):
    fake_ptxas = tmp_path / "fake_ptxas"  # prints its arguments and its process's personality flags
    fake_ptxas.write_text('#!/bin/sh\necho "$@"; cat /proc/self/personality\n')
    fake_ptxas.chmod(0o755)
    (tmp_path / "tools").mkdir()
    wrapper = fixed_layout_ptxas(tmp_path / "tools", str(fake_ptxas))
    if wrapper is None:
        pytest.skip("this container refuses setarch -R")
    args, personality = subprocess.run([wrapper, "--gpu-name=sm_90a", "a b.ptx"], check=True, capture_output=True,
                                       text=True).stdout.splitlines()
    assert args == "--gpu-name=sm_90a a b.ptx"
    assert int(personality, 16) & ADDR_NO_RANDOMIZE


def test_no_fixed_layout_ptxas_where_ptxas_does_not_run(tmp_path):
    assert fixed_layout_ptxas(tmp_path, "/bin/false") is None  # no setarch, or the wrapper's --version fails
