"""Data-parallel training step without Lightning: does 2-GPU DDP lose time against one GPU
outside the trainer too?

Start with torchrun (one process per GPU; world size 1 runs the model without DDP):

    torchrun --nproc-per-node 2 scripts/bench_ddp_raw.py --out gpu_out/bench_ddp_raw_2

Reports on rank 0 the steady-state ms per step and tokens/s over all GPUs, for a training step
like bench_train's plus train.py's gradient clipping (GPT-2 small shape with bench_ddp's vocab
2048, bf16 autocast, the inner model compiled as train.py does, fused AdamW, random tokens), per
setting (SETTINGS below: DDP on a side stream as
Lightning builds it, no graph split with 25 or 512 MB buckets or a static graph, gradient bucket
views, eager, compiled autograd's python reducer). Two world-size-1 runs started
at once on two GPUs show whether the GPUs slow each other down without any communication.
`--profile-steps N` adds each setting's device time per step in NCCL and in all other kernels, and
writes the profiler's kernel table per rank. Every row says whether the ranks' weights stayed equal
(each rank trains on its own random tokens, so unreduced gradients would show).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import git_commit, sync, time_steps, warm_up  # noqa: E402
from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402


# name: what differs from "default" (compiled inner model, DDP built on the current stream, dynamo's
# DDPOptimizer splitting the graph at gradient-bucket boundaries, gradients copied into buckets)
SETTINGS = {
    "default": {},
    "side_stream": {"side_stream": True},  # DDP built on a side stream, as Lightning does
    "no_split": {"split": False},  # one graph: all gradients at the end of backward, no overlap
    "bucket_view": {"bucket_view": True},  # gradients are views into DDP's buckets (no copy)
    "eager": {"compile": False},
    "no_split_big_buckets": {"split": False, "bucket_mb": 512},  # after the backward: 1 all-reduce, not 13
    "no_split_static_graph": {"split": False, "static_graph": True},  # DDP skips per-step graph bookkeeping
    # DDP's all-reduces traced into the compiled backward (compiled autograd), bucketed by inductor:
    # no graph split and no reducer hooks at run time. On torch 2.11 + H200 dynamo fails to trace the
    # compiled-autograd graph ("Attempt to trace generator"); it runs on CPU (torch 2.13)
    "python_reducer": {"ddp_mode": "python_reducer"},
}


class Inner(torch.nn.Module):
    """The GPT behind a (compiled) forward, as LitGPT holds it (DDP wraps the outer module)."""

    def __init__(self, model: GPT, compile: bool):
        super().__init__()
        self.model = model
        self.forward_fn = torch.compile(model, fullgraph=True) if compile else model

    def forward(self, x, targets):
        return self.forward_fn(x, targets=targets)


def build(model_cfg: dict, batch: int, setting: dict, device: torch.device):
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = setting.get("ddp_mode", setting.get("split", True))
    torch._inductor.config._fuse_ddp_communication = False  # DDP turns it on for python_reducer; settings stay apart
    model = GPT(GPTConfig(**model_cfg, attn=AttnConfig(name="softmax", backend="auto"))).to(device)  # triton on GPU
    module = Inner(model, setting.get("compile", True))
    if dist.is_initialized():
        on_gpu = device.type == "cuda"
        stream = torch.cuda.Stream() if on_gpu and setting.get("side_stream") else None
        with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
            module = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if on_gpu else None, broadcast_buffers=False,
                gradient_as_bucket_view=setting.get("bucket_view", False),
                bucket_cap_mb=setting.get("bucket_mb", 25), static_graph=setting.get("static_graph", False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device).manual_seed(1 + rank)  # different data per rank: unreduced gradients would show
    x = torch.randint(0, model.cfg.vocab_size, (batch, model.cfg.context + 1), device=device, generator=gen)
    inputs, targets = x[:, :-1], x[:, 1:]

    def compiled_autograd():  # a fresh context per step (generator context managers are single-use)
        if setting.get("ddp_mode") != "python_reducer":
            return contextlib.nullcontext()
        return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, fullgraph=True), dynamic=False)

    def step():
        with compiled_autograd():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module(inputs, targets) / targets.numel()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def params_in_sync(model: torch.nn.Module) -> bool:
    """Whether every rank holds the same weights after training on its own data (gradients were reduced)."""
    sample = torch.cat([p.detach().flatten()[:256].float() for p in model.parameters()])
    gathered = [torch.empty_like(sample) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sample)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def kernel_ms_per_step(step, steps: int, table_path: Path | None) -> dict:
    """Device time per step in NCCL kernels and in all other device events (kernels, copies, memsets;
    torch.profiler): whether a slower 2-GPU step runs longer kernels (contention, lost fusion) or
    leaves the GPU idle. An NCCL kernel's time includes its wait for the other rank."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    nccl = other = 0.0
    kernels = 0
    for evt in prof.events():  # device-side kernels and copies; GPU user annotations span them, skip those
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.is_user_annotation:
            continue
        ms = evt.time_range.elapsed_us() / 1e3 / steps
        kernels += 1
        if "nccl" in evt.name.lower():
            nccl += ms
        else:
            other += ms
    if table_path is not None:
        table_path.write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
    return {"nccl_kernel_ms": nccl, "other_kernel_ms": other, "kernels_per_step": kernels / steps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2_small")
    ap.add_argument("--vocab", type=int, default=2048, help="2048: the model of bench_ddp (Shakespeare BPE)")
    ap.add_argument("--batch", type=int, default=16, help="per GPU")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--settings", default=None,
                    help=f"comma list of {list(SETTINGS)}; default: all with DDP but python_reducer (default again last, for drift), "
                         "default,eager on one GPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many steps per setting: device ms in NCCL and other kernels")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:  # a CPU dry run of the script (gloo), e.g. --model tiny --steps 2
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    model_cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{args.model}.yaml").read_text())
    model_cfg["vocab_size"] = args.vocab
    names = args.settings.split(",") if args.settings else (
        [*(n for n in SETTINGS if n != "python_reducer"), "default"] if world > 1 else ["default", "eager"])
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; allowed: {list(SETTINGS)}")
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)", "torch": torch.__version__,
            "commit": git_commit(), "model": args.model, "vocab": args.vocab, "batch_per_gpu": args.batch,
            "steps": args.steps, "nccl_max_nchannels": os.environ.get("NCCL_MAX_NCHANNELS"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(names):
        model, step = build(model_cfg, args.batch, SETTINGS[name], device)
        warm_up(step, steps=8)
        dt, _ = time_steps(step, args.steps)
        rows.append({"world": world, "setting": name, "ms_per_step": dt * 1e3,
                     "tokens_per_s": world * args.batch * model.cfg.context / dt})
        if world > 1:
            rows[-1]["params_in_sync"] = params_in_sync(model)
        if args.profile_steps:
            table = Path(f"{args.out}_{i}_{name}_rank{rank}_kernels.txt") if args.out else None
            rows[-1].update(kernel_ms_per_step(step, args.profile_steps, table))
        if rank == 0:
            print(rows[-1], flush=True)
            if args.out:  # after every setting: a run cut by its time limit keeps what it measured
                Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
