"""The packages import one another downward only (docs/layout.md, "Layers"):

    scripts/, train.py          the commands and tools
    training/   eval/           training a run; evaluating one (neither imports the other, except below)
    runs/                       a run's directory, checkpoints and model as files (what both read and write)
    models/                     the GPT and its Lightning module
    attn/       data/           the attention variants and their kernels; corpora, tokenizers, the data module

Every import counts, a deferred one inside a function too: each module's source is parsed with `ast`."""

import ast
from pathlib import Path

from train_helpers import ROOT

FLOORS = {"attn": 0, "data": 0, "models": 1, "runs": 2, "training": 3, "eval": 3, "scripts": 4}
# packages of one floor that import each other nowhere but here: (importing module, imported package)
ALLOWED_SIDEWAYS = {
    # `evaluate` in configs/train.yaml: the training process runs the eval commands on the run it trained
    ("training/evaluate_after.py", "eval"),
}


def imported_packages(path: Path) -> set[str]:
    """The attnlab packages (FLOORS' keys) that the module at `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & FLOORS.keys()
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_every_package_imports_only_packages_below_it():
    climbing, sideways = [], []
    for package, floor in FLOORS.items():
        for path in modules_of(package):
            name = path.relative_to(ROOT).as_posix()
            for imported in imported_packages(path) - {package}:
                if FLOORS[imported] > floor:
                    climbing.append(f"{name} imports {imported}")
                elif FLOORS[imported] == floor and (name, imported) not in ALLOWED_SIDEWAYS:
                    sideways.append(f"{name} imports {imported}")
    assert not climbing, climbing
    assert not sideways, sideways


def test_the_allowed_sideways_imports_are_still_there():
    """An allowance that no import needs any more is taken out of ALLOWED_SIDEWAYS."""
    for name, imported in ALLOWED_SIDEWAYS:
        assert imported in imported_packages(ROOT / name), (name, imported)


def test_the_scan_sees_the_imports():
    """The scan finds an import in a function body (eval/lm_harness.py imports eval.harness_model there)
    and the floors cover every package of the wheel."""
    assert "runs" in imported_packages(ROOT / "eval" / "lm_harness.py")
    source = (ROOT / "setup.py").read_text()
    assert all(f'"{package}*"' in source for package in set(FLOORS) - {"scripts"}), source
