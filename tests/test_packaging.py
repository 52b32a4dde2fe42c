"""The wheel that `pip install .` builds: every Hydra config as package data (the package
attnlab_configs), the console commands, an install line without the extras' packages; unpacked as
site-packages lays it out, its code finds its own configs. Installing it in a fresh virtualenv with
its dependencies takes minutes: .ci/wheel_check does that in CI and runs the console commands."""

import configparser
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from train_helpers import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built (with pip's build isolation, as `pip install .` does) from a copy of the
    clone's files, so the build writes nothing into the clone."""
    tmp = tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git clone: {listed.stderr.strip()}")
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp / "src" / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
                           str(tmp / "src")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (built,) = (tmp / "dist").glob("attnlab-*.whl")
    return built


def dist_info(archive: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in archive.namelist() if n.endswith(f".dist-info/{name}")]
    return archive.read(path).decode()


def test_the_wheel_ships_every_config_and_the_console_commands(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(dist_info(archive, "entry_points.txt"))
        metadata = Parser().parsestr(dist_info(archive, "METADATA"))
    configs = {f"attnlab_configs/{p.relative_to(ROOT / 'configs').as_posix()}" for p in (ROOT / "configs").rglob("*.yaml")}
    assert len(configs) > 40 and configs <= names, sorted(configs - names)
    assert {"training/train.py", "runs/config_dir.py", "runs/run.py", "eval/cli.py", "eval/perplexity.py"} <= names
    assert not any(n.startswith(("tests/", "scripts/")) or n == "train.py" for n in names)
    assert dict(entry_points["console_scripts"]) == {"attnlab-train": "training.train:cli", "attnlab-eval": "eval.cli:main"}
    # the plain install line: what training needs; lm_eval, transformers, pytest come with extras only
    plain = [r.split(";")[0].strip() for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert {"torch", "lightning", "hydra-core"} <= {r.split(">")[0].split("<")[0].split("=")[0] for r in plain}
    assert not [r for r in plain if r.startswith(("lm_eval", "transformers", "pytest", "accelerate", "tiktoken"))]
    assert set(metadata.get_all("Provides-Extra")) >= {"eval", "hf", "dev"}


def test_the_unpacked_wheel_runs_on_its_own_configs(wheel, tmp_path):
    """As installed (site-packages holds training/ beside attnlab_configs/), from a folder outside the
    clone: the training command composes its config from the wheel's configs."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    code = "import sys; from training.train import cli; sys.argv[0] = 'attnlab-train'; cli()"
    proc = subprocess.run([sys.executable, "-c", code, "--cfg", "job", "attn=alsc", "model=small"], cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "name: alsc" in proc.stdout and "d_model: 384" in proc.stdout
    where = subprocess.run([sys.executable, "-c", "from runs.config_dir import CONFIG_DIR; print(CONFIG_DIR)"],
                           cwd=cwd, env={"PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(site / "attnlab_configs"), where.stderr


def test_attnlab_eval_runs_the_eval_modules(capsys):
    from eval import cli

    assert cli.commands() == ["attention_stats", "export", "generate", "lm_harness", "perplexity"]
    for argv, code in ([], 2), (["--help"], 0), (["common"], 2), (["no_such"], 2):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == code, argv
    out = capsys.readouterr()
    assert "usage: attnlab-eval {attention_stats,export,generate,lm_harness,perplexity}" in out.out
    assert "attnlab-eval: no command 'no_such'" in out.err


def test_an_eval_command_takes_v_for_the_traceback(tmp_path, monkeypatch, capsys):
    """`attnlab-eval <command> -v` (and `python -m eval.<command> -v`): the user error's exception
    instead of its one `error:` line; without -v, the line and exit status 2."""
    from eval import cli
    from runs import command_line

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored afterwards: -v sets it
    missing = tmp_path / "no_such_run"
    try:
        with pytest.raises(SystemExit) as info:
            cli.main(["generate", f"ckpt={missing}"])
        assert info.value.code == 2 and capsys.readouterr().err.startswith("error: ")
        with pytest.raises(FileNotFoundError, match="no_such_run"):
            cli.main(["generate", "-v", f"ckpt={missing}"])
    finally:
        command_line.without_verbose_flag(["pytest"])
