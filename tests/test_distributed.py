"""Data-parallel training on CPU: 2 processes (gloo) through Lightning's ddp launcher.

train.py runs as a subprocess with trainer=ddp_cpu, so Lightning re-runs the script for
rank 1 exactly as it does on a GPU node. Checked: the per-step training losses and the
validation loss equal those of one process with the same global batch (up to fp32
reduction order), and all ranks write into one Hydra run directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eval.run_logs import train_losses
from train_helpers import compose_cfg, run_train_py, tiny_overrides, write_corpus

STEPS = 4


def ddp_args(tmp_path: Path, corpus: Path, per_rank_batch: int, **extra) -> list[str]:
    """tiny_overrides for train.py on the command line, the run dir left to Hydra."""
    overrides = tiny_overrides(tmp_path, corpus, **{
        "trainer": "ddp_cpu", "train.batch_size": per_rank_batch, "train.max_steps": STEPS,
        "train.val_every": STEPS, **extra,
    })
    return [o for o in overrides if not o.startswith("paths.output_dir=")]


@pytest.mark.parametrize("grad_accum", [1, 2])  # 2: DDP's no_sync micro-batches (gradient accumulation)
def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path, grad_accum):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    # one process, global batch 8 (also builds the shared token cache before the DDP run)
    single = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.batch_size": 8, "train.max_steps": STEPS, "train.val_every": STEPS,
        "train.grad_accum": grad_accum, "paths.output_dir": str(tmp_path / "single"),
    })))
    # two processes, 4 each
    ddp_cwd = tmp_path / "ddp"
    run_train_py(ddp_args(tmp_path, corpus, per_rank_batch=4, **{"train.grad_accum": grad_accum}), cwd=ddp_cwd)

    run_dirs = [p for p in (ddp_cwd / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, f"ranks scattered their outputs: {run_dirs}"
    assert len(list(ddp_cwd.rglob("metrics.csv"))) == 1 and len(list(ddp_cwd.rglob("results.json"))) == 1
    run_dir = run_dirs[0]
    results = json.loads((run_dir / "results.json").read_text())
    assert Path(results["run_dir"]).resolve() == run_dir.resolve()
    assert results["steps"] == STEPS
    assert results["tokens"] == single["tokens"] == STEPS * 8 * 32 * grad_accum  # tokens of the global batches

    want, got = train_losses(tmp_path / "single"), train_losses(run_dir)
    assert sorted(got) == sorted(want) and len(want) == STEPS
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got, want)
    # the losses moved, so equal numbers mean equal training, not equal initialization only
    assert want[min(want)] != want[max(want)]
    # the validation windows and their mean do not depend on the world size
    assert results["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_ddp_with_per_block_compile_matches_eager_one_process(tmp_path):
    """train.compile_unit=block under DDP (inductor on CPU): Lightning's DDP wrapper, the compiled
    blocks' gradient hooks and the compiled output/loss together train like the eager single
    process with the same global batch."""
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    single = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.batch_size": 8, "train.max_steps": STEPS, "train.val_every": STEPS,
        "paths.output_dir": str(tmp_path / "single"),
    })))
    ddp_cwd = tmp_path / "ddp"
    run_train_py(ddp_args(tmp_path, corpus, per_rank_batch=4, **{"train.compile": True,
                                                                 "train.compile_unit": "block"}), cwd=ddp_cwd)
    run_dir = next(p for p in (ddp_cwd / "outputs").glob("*/*") if p.is_dir())
    want, got = train_losses(tmp_path / "single"), train_losses(run_dir)
    assert sorted(got) == sorted(want) and len(want) == STEPS
    for step in want:  # inductor may reorder fp32 sums
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), (step, got, want)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_multirun_with_ddp_keeps_each_job_in_its_sweep_dir(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    args = ddp_args(tmp_path, corpus, per_rank_batch=2, **{"train.max_steps": 2, "train.val_every": 2})
    sweep = tmp_path / "sweep"
    run_train_py(["-m", "seed=0,1", f"hydra.sweep.dir={sweep}", *args], cwd=tmp_path / "cwd")
    results = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"))]
    assert [r["seed"] for r in results] == [0, 1]
    assert all(r["steps"] == 2 for r in results)
    assert len(list(sweep.rglob("metrics.csv"))) == 2
    assert not (tmp_path / "cwd" / "outputs").exists(), "a rank ran outside the sweep"


def _mean_over_ranks_worker(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from models.lit import mean_over_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        def no_barrier(*args, **kwargs):
            raise AssertionError("mean_over_ranks must not wait on a barrier")

        dist.barrier, real_barrier = no_barrier, dist.barrier
        value = torch.tensor(float(rank + 1), requires_grad=True) * 2  # 2 on rank 0, 4 on rank 1
        mean = mean_over_ranks(value)
        results[rank] = (mean.item(), value.item(), mean.requires_grad)
        dist.barrier = real_barrier
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A free local port for a gloo process group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mean_over_ranks_averages_without_a_barrier_and_leaves_the_input():
    import torch.multiprocessing as mp

    port = free_port()
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_mean_over_ranks_worker, args=(port, results), nprocs=2, start_method="spawn")
        assert dict(results) == {0: (3.0, 2.0, False), 1: (3.0, 4.0, False)}


def _compiled_graphs_under_ddp_strategy(split_compiled_graph: bool) -> tuple[int, object]:
    """Number of graphs dynamo hands its backend for a 3-layer model compiled inside the strategy's
    DDP wrapper (1 MB buckets, 4 MB layers), and dynamo's optimize_ddp after teardown."""
    import torch
    from lightning.pytorch.accelerators import CPUAccelerator

    from training.ddp_strategy import CurrentStreamDDPStrategy

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Outer(torch.nn.Module):  # LitGPT's layout: DDP wraps a module that calls a compiled model
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])
            self.forward_fn = torch.compile(self.model, backend=counting_backend, fullgraph=True)

        def forward(self, x):
            return self.forward_fn(x)

    torch._dynamo.reset()
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = CurrentStreamDDPStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")],
                                        cluster_environment=LightningEnvironment(),
                                        split_compiled_graph=split_compiled_graph, bucket_cap_mb=1)
    ddp = strategy._setup_model(Outer())
    ddp(torch.randn(4, 1024)).sum().backward()
    strategy.teardown()
    return len(graphs), torch._dynamo.config.optimize_ddp


def test_ddp_strategy_keeps_the_compiled_model_one_graph_unless_asked_to_split(monkeypatch):
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    before = torch._dynamo.config.optimize_ddp
    try:
        torch._dynamo.config.optimize_ddp = "sentinel-restored-at-teardown"  # any prior value comes back
        one_graph, after = _compiled_graphs_under_ddp_strategy(split_compiled_graph=False)
        assert (one_graph, after) == (1, "sentinel-restored-at-teardown")
        split, _ = _compiled_graphs_under_ddp_strategy(split_compiled_graph=True)
        assert split > 1, "DDPOptimizer did not split: the one-graph check above proves nothing"
    finally:
        torch._dynamo.config.optimize_ddp = before
        torch._dynamo.reset()
        dist.destroy_process_group()
