"""Host work of one eager GPT training step per attention variant, on any machine: the kernel launches stubbed.

The step is bench_train.py's `build_step(..., eager=True)` (bf16 autocast forward with the summed loss,
backward, fused AdamW, zero_grad), the model a configs/model preset (default `small`, the eager rounds'
model) with its layer and head structure as given; only the tokens per step (--batch rows of --tokens, the
model's context) and the width (--d-model: 96 keeps the preset's heads, of 16 elements) are small, so
that the CPU's matmuls, weight casts and optimizer arithmetic stay small next to the host work (the
calls per step do not depend on them). Kernel launches are stubbed as
scripts/bench/host_cost_cpu.py stubs them (no launch, the first tile config, Triton counted usable
for CPU tensors), and models/head_norms.py's kernels serve CPU tensors too, so every Python path a
GPU step runs runs here, bar the launch itself and GPU-only plan choices made once per signature.

Per case: this thread's CPU time per step (median and best over rounds, time.thread_time, one
torch thread), the Python and builtin function calls per step (sys.setprofile) and the aten ops per
step (torch.profiler, nested ones counted, as scripts/bench/train_eager_rounds.py's census counts
them); the counts do not move with the machine's load. The CPU time includes the CPU's own
arithmetic, small here but not nil (the SDPA row's CPU attention most of all). The yardstick is the same model on torch SDPA (softmax/sdpa).

    python scripts/bench/host_cost_step_cpu.py [--model small] [--cases softmax/sdpa,threshold/triton]
        [--profile threshold/triton] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_train import CASES, build_step  # noqa: E402
from host_cost_cpu import calls_per_call, host_us, stub_launches  # noqa: E402

import attn.families.differential  # noqa: E402
import models.head_norms  # noqa: E402

DEFAULT_CASES = ("softmax/sdpa", "softmax/triton", "threshold/triton", "sigmoid/triton", "diff_threshold/triton")


def stub_device() -> None:
    """host_cost_cpu's stubs, and the head norms' and the differential lambda's kernels serving CPU tensors
    (as they serve CUDA ones)."""
    stub_launches()
    models.head_norms.KERNEL_DEVICE_TYPES = ("cuda", "cpu")
    attn.families.differential.KERNEL_DEVICE_TYPES = ("cuda", "cpu")


def make_step(model_cfg: dict, case: str, batch: int):
    variant, backend = case.split("/")
    params = next(p for v, b, p in CASES if v == variant and b == backend)
    _, step = build_step(model_cfg, variant, backend, params, batch, eager=True)
    return step


def aten_ops_per_step(step, steps: int = 3) -> float:
    """aten ops per step as torch.profiler counts them (nested ones too), as train_eager_rounds.py's census."""
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return sum(e.name.startswith("aten::") for e in prof.events()) / steps


def profile_text(step, steps: int, top: int = 30) -> str:
    step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="a configs/model/*.yaml preset")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of variant/backend (bench_train CASES)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per row: the model's context (more than 16: a GPU step's path, not the split-key decode)")
    ap.add_argument("--vocab", type=int, default=2048, help="as train_eager_rounds.py")
    ap.add_argument("--d-model", type=int, default=96,
                    help="the model's width (default 96: the preset's heads, of 16; 0: the preset's own)")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="", help="comma list of cases: print the cProfile of a few steps")
    ap.add_argument("--out", default=None, help="write a JSON of the rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stub_device()
    model_cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{args.model}.yaml").read_text())
    model_cfg["vocab_size"] = args.vocab
    if args.d_model:
        model_cfg["d_model"] = args.d_model
    # build_step's rows are (batch, context) tokens: the context is --tokens (it sizes RoPE's tables only)
    model_cfg["context"] = args.tokens
    rows = {}
    print("| case | CPU us/step (median) | best | Python calls/step | aten ops/step |\n| --- | ---: | ---: | ---: | ---: |")
    for case in args.cases.split(","):
        step = make_step(model_cfg, case, args.batch)
        median, best = host_us(step, args.steps, args.rounds)
        calls = calls_per_call(step, calls=5)
        ops = aten_ops_per_step(step)
        rows[case] = {"median_us": median, "best_us": best, "python_calls": calls, "aten_ops": ops}
        print(f"| {case} | {median:.0f} | {best:.0f} | {calls} | {ops:.0f} |", flush=True)
    for case in filter(None, args.profile.split(",")):
        print(f"\n## cProfile {case}\n" + profile_text(make_step(model_cfg, case, args.batch), args.steps))
    if args.out:
        meta = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                "torch": torch.__version__, "model": args.model, "batch": args.batch, "tokens": args.tokens,
                "d_model": model_cfg["d_model"], "vocab": args.vocab}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
