"""Helpers to run train.py in-process on a tiny generated corpus (no network)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(ROOT / "configs")


def write_corpus(path: Path, lines: int = 3000, seed: int = 0) -> Path:
    """A small learnable corpus: templated sentences over a tiny vocabulary."""
    rng = random.Random(seed)
    names = ["anna", "bert", "carl", "dora", "emil", "fred"]
    verbs = ["sees", "likes", "helps", "calls", "finds"]
    things = ["the cat", "a dog", "the red ball", "an old book", "the river"]
    text = "\n".join(
        f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(things)} and {rng.choice(names)} {rng.choice(verbs)} it."
        for _ in range(lines)
    )
    path.write_text(text + "\n")
    return path


def tiny_overrides(tmp_path: Path, corpus: Path, **extra) -> list[str]:
    base = {
        "data": "text",
        "data.source.path": str(corpus),
        "data/tokenizer": "byte",
        "trainer": "cpu",
        "logger": "csv",
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.n_kv_head": 2,
        "model.d_model": 32,
        "model.context": 32,
        "train.batch_size": 4,
        "train.max_steps": 6,
        "train.val_every": 3,
        "train.val_tokens": 512,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "train.compile": False,
        "paths.cache_dir": str(tmp_path / "cache"),
        "paths.output_dir": str(tmp_path / "run"),
        "trainer.enable_progress_bar": False,
        # the end-of-run attention heatmaps cost about a second a run; tests/test_attention_heatmaps.py
        # and test_quiet_logs.py run them
        "callbacks.attention_heatmaps.windows": 0,
    }
    base.update(extra)
    return [k if v is None else f"{k}={v}" for k, v in base.items()]


def run_train_py(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python train.py *args` in cwd, in a clean environment; asserts it succeeded."""
    # a clean environment for the run-dir hand-over (no inherited ATTNLAB_RUN_DIR / ranks)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ATTNLAB_RUN") and k not in ("ATTNLAB_JOB_OVERRIDES", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def run_command(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    """`python <args>` as a user runs it (a script path, or "-m", "eval.perplexity", ...) from `cwd`,
    with this checkout importable; output captured, the exit status not checked."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environment, capture_output=True, text=True)


def train_command(overrides: list[str], run_dir: Path | None = None) -> list[str]:
    """train.py's arguments for run_command: a run in `run_dir` (hydra.run.dir), or with None in the
    folder Hydra makes under outputs/; tiny_overrides' paths.output_dir is dropped (Hydra sets it)."""
    kept = [o for o in overrides if not o.startswith("paths.output_dir=")]
    return [str(ROOT / "train.py"), *kept, *([f"hydra.run.dir={run_dir}"] if run_dir is not None else [])]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=overrides)


def train_tiny_run(tmp_path: Path, **extra) -> Path:
    """A real few-step training run on a tiny corpus in tmp_path/run, with the .hydra/config.yaml
    Hydra would write (train.run is called in-process, which writes no Hydra files)."""
    from omegaconf import OmegaConf

    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    settings = {"train.max_steps": 2, "train.val_every": 2, "model.context": 16, **extra}
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus, **settings))
    train.run(cfg)
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir()
    saved = OmegaConf.to_container(cfg, resolve=False)
    saved["paths"]["output_dir"] = str(run_dir)
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    return run_dir


def eager_capture_for(params: list):
    """A CPU stand-in for models.captured_step.capture_cuda_graph with a CUDA graph's semantics: the
    capture records without running (here: the step is kept), and each replay runs the step again
    and writes its outputs and `params`' gradients into the tensors the capture returned (static
    addresses)."""

    def capture(step, reset):
        reset()
        outputs = step()  # the "recorded" outputs; the real capture would leave them unwritten
        with_grad = [p for p in params if p.grad is not None]
        static_grads = [p.grad for p in with_grad]

        def replay():
            for p in with_grad:
                p.grad = None
            for static, fresh in zip(outputs, step(), strict=True):
                static.copy_(fresh)
            for p, static in zip(with_grad, static_grads):
                static.copy_(p.grad)
                p.grad = static

        return replay, outputs

    return capture


def use_eager_captured_step(monkeypatch) -> list[bool]:
    """train.cuda_graphs=step on CPU: train.py picks the captured step and every CapturedStep
    captures with eager_capture_for. Returns the list of `captured` before each step call."""
    from training import train
    from models import captured_step

    monkeypatch.setattr(train, "cuda_graphs_enabled", lambda *a: ("step", "test"))
    real_init, real_call = captured_step.CapturedStep.__init__, captured_step.CapturedStep.__call__

    def init(self, loss_fn, params, capture=None, tail=None):
        params = list(params)
        real_init(self, loss_fn, params, capture=eager_capture_for([p for p in params if p.requires_grad]), tail=tail)

    calls: list[bool] = []
    monkeypatch.setattr(captured_step.CapturedStep, "__init__", init)
    monkeypatch.setattr(captured_step.CapturedStep, "__call__",
                        lambda self, x, y: calls.append(self.captured) or real_call(self, x, y))
    return calls
