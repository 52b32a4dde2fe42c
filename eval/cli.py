"""`attnlab-eval <command> [-v] [key=value ...]`: the eval commands of an installed attnlab, the same as
`python -m eval.<command> [-v] [key=value ...]` in a clone (-v: verbose, eval/command_line.py). A
command is a module of this package that has its own config, configs/eval/<command>.yaml (common.yaml
holds what the commands share)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

from eval import command_line
from runs.config_dir import CONFIG_DIR


def commands() -> list[str]:
    configs = {path.stem for path in (Path(CONFIG_DIR) / "eval").glob("*.yaml")} - {"common"}
    modules = {module.name for module in pkgutil.iter_modules([str(Path(__file__).parent)])}
    return sorted(configs & modules)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = commands()
    usage = f"usage: attnlab-eval {{{','.join(names)}}} [-v] [key=value ...]  (attnlab-eval <command> --help: its options)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"attnlab-eval: no command {name!r}\n{usage}", file=sys.stderr)
        sys.exit(2)
    # the command's Hydra app reads its overrides from sys.argv, as under python -m eval.<command>
    sys.argv = [sys.argv[0], *rest]
    command_line.run(importlib.import_module(f"eval.{name}").main)


if __name__ == "__main__":
    main()
