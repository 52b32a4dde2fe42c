"""Where a public `attn.attention` call's time goes on a GPU: host time, GPU time, launches, hot spots.

For each variant at the public-path benchmark's call shape ((16,12,1024,64) causal bf16; --call-shape
sets another): fwd+bwd eager and compiled (torch.compile(fullgraph=True) of the call alone), the
eager forward without gradient; and one decode step (one query against 4K keys); in one process
beside SDPA:

  host us   wall time of 30 calls queued without a sync, per call: the host's own cost while the GPU
            keeps up (a call whose GPU work is longer than its host work fills the launch queue, and
            this column then reads the GPU time)
  wall us   the same 30 calls including the final sync, per call
  GPU us    the summed duration of the GPU kernels of one call (torch.profiler, 10 calls)
  launches  GPU kernels per call
  host ops  the CPU-side torch ops with the most own time per call (torch.profiler)

With --python, cProfile of 200 eager fwd+bwd calls and decode steps per variant lists the Python
functions by own time.

    python scripts/bench/profile_public_call.py --out gpu_out/profile_public_call [--python]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attn  # noqa: E402
from bench_attention_call import profile_host  # noqa: E402
from bench_public_path import PARAMS, VARIANTS, sdpa, tensors  # noqa: E402

QUEUED_CALLS = 30
PROFILED_CALLS = 10


def host_and_wall_us(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(QUEUED_CALLS):
        fn()
    t_host = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_wall = time.perf_counter() - t0
    return t_host / QUEUED_CALLS * 1e6, t_wall / QUEUED_CALLS * 1e6


def profiled(fn, top: int = 8) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels) / PROFILED_CALLS
    launches = sum(e.count for e in kernels) / PROFILED_CALLS
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"gpu_us": gpu_us, "launches": launches,
            "kernels": {e.key[:80]: e.count / PROFILED_CALLS for e in kernels},
            "host_ops": [(e.key[:60], e.count / PROFILED_CALLS, e.self_cpu_time_total / PROFILED_CALLS) for e in cpu]}


def measure(name: str, fn) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    host, wall = min(host_and_wall_us(fn) for _ in range(3))
    row = {"row": name, "host_us": host, "wall_us": wall, **profiled(fn)}
    print(f"{name:40s} host {host:8.1f} us  wall {wall:8.1f} us  GPU {row['gpu_us']:8.1f} us  "
          f"launches {row['launches']:.1f}", flush=True)
    for op, count, us in row["host_ops"]:
        print(f"    {op:60s} x{count:5.1f} {us:8.1f} us", flush=True)
    return row


def call_cases(b: int, h: int, n: int, d: int):
    x = tensors("softmax", b, n, h, d, True)
    do = torch.randn_like(x["q"])
    yield "call sdpa fwd+bwd", lambda: sdpa(x["q"], x["k"], x["v"], True).backward(do), None
    for variant in VARIANTS:
        spec = attn.get_variant(variant).make_spec(**PARAMS[variant])
        xv = tensors(variant, b, n, h, d, True)

        def call(xv=xv, spec=spec):
            return attn.attention(xv["q"], xv["k"], xv["v"], spec, causal=True, extra=xv["extra"])

        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=True)
        yield f"call {variant} eager fwd+bwd", (lambda call=call: call().backward(do)), variant
        yield f"call {variant} compiled fwd+bwd", (lambda compiled=compiled: compiled().backward(do)), None
        yield f"call {variant} eager fwd", (lambda call=call: call()), None


def decode_cases():
    b, h, d, cache = 8, 16, 128, 4096
    x = tensors("softmax", b, 1, h, d, False, kv=cache)
    yield "decode sdpa", lambda: sdpa(x["q"], x["k"], x["v"], False), None
    for variant in VARIANTS:
        spec = attn.get_variant(variant).make_spec(**PARAMS[variant])
        xv = tensors(variant, b, 1, h, d, False, kv=cache)
        yield f"decode {variant}", (lambda xv=xv, spec=spec: attn.attention(
            xv["q"], xv["k"], xv["v"], spec, causal=True, extra=xv["extra"])), variant


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_out/profile_public_call")
    ap.add_argument("--python", action="store_true",
                    help="cProfile of eager fwd+bwd calls and decode steps per variant")
    ap.add_argument("--call-shape", default="16,12,1024,64", help="B,H,N,D of the call rows")
    ap.add_argument("--only", default="call,decode", help="comma list of call, decode")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.call_shape.split(","))
    only = args.only.split(",")
    cases = [*(call_cases(*shape) if "call" in only else ()), *(decode_cases() if "decode" in only else ())]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, texts = [], {}
    for name, fn, variant in cases:
        with torch.no_grad() if name.startswith("decode") or name.endswith(" fwd") else torch.enable_grad():
            rows.append(measure(name, fn))
            if args.python and variant is not None:
                texts[name] = profile_host(fn, name, iters=200, top=25)
        (out / "profile_public_call.json").write_text(json.dumps(rows, indent=1))
    for name, text in texts.items():
        (out / f"python_{name.replace(' ', '_').replace('+', '')}.txt").write_text(text)
        print(f"\n## {name}\n{text[:4000]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
