"""Where a compiled training step's GPU time goes: kernel time per category and the top kernels.

Runs scripts/bench/bench_train.py's step (bf16 autocast, torch.compile fullgraph, fused AdamW) under
torch.profiler for a few steps per case, after a timed run of the same step. The categories
answer "why is MFU what it is": matmuls, attention, the loss over the vocabulary, the
optimizer, everything else (norms, RoPE, residual adds), and the profiled steps' time outside
kernels (host overhead, launch gaps).

    python scripts/bench/profile_train_step.py --cases sdpa:16:eager,sdpa:16,triton:16,sdpa:32 --out prof
    (a case is BACKEND:BATCH[:eager]; eager = the loss outside the compiled graph)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402  (same directory: the step being profiled is bench_train's)
from timing import git_commit  # noqa: E402

# first match wins; kernel names come from cuBLAS/CUTLASS, FlashAttention, inductor and our kernels
CATEGORIES = [
    ("optimizer", re.compile(r"adam|foreach|multi_tensor", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|_fwd_kernel|_dq_kernel|_dkdv_kernel|_bwd_preprocess|zero_count", re.I)),
    ("loss (log-softmax, nll)", re.compile(r"log_softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm100_|matmul|_mm_", re.I)),
    ("embedding", re.compile(r"embedding|index_put|scatter|indexing_backward", re.I)),
    ("fused elementwise / norms (inductor)", re.compile(r"^triton_", re.I)),
]


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def profile_case(model_cfg: dict, backend: str, batch: int, loss_in_graph: bool, steps: int, peak: float):
    variant = "softmax"
    model, step = bench_train.build_step(model_cfg, variant, backend, {}, batch, loss_in_graph)
    bench_train.warm_up(step)
    seconds, _ = bench_train.time_steps(step, 20)
    ms_per_step = seconds * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled_seconds, _ = bench_train.time_steps(step, steps)
    kernels = defaultdict(float)  # name -> total microseconds over the profiled steps
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.key] += evt.device_time_total
    per_cat = defaultdict(float)
    for name, us in kernels.items():
        per_cat[category(name)] += us / steps / 1e3
    busy = sum(per_cat.values())
    tokens_per_s = batch * model.cfg.context / (ms_per_step / 1e3)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    return {
        "backend": backend, "batch": batch, "loss_in_graph": loss_in_graph, "ms_per_step": ms_per_step,
        "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * model.flops_per_token() / (peak * 1e12),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
        # kernel time vs the profiled steps' own wall time (the profiler slows steps a little)
        "gpu_busy_ms": busy, "profiled_ms_per_step": profiled_seconds * 1e3,
        "not_in_kernels_ms": profiled_seconds * 1e3 - busy,
        "ms_per_category": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [(name[:120], category(name), us / steps / 1e3) for name, us in top],
    }


def report(rows, meta) -> str:
    lines = [f"# Training step profile: {meta['model']}, bf16, compiled", "",
             f"{meta['date']} | {meta['gpu']} | torch {meta['torch']} | commit {meta['commit']}", "",
             "| backend | batch | loss | ms/step | tokens/s | MFU | peak mem GiB | profiled ms/step | kernel ms/step | not in kernels ms |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['batch']} | {'in graph' if r['loss_in_graph'] else 'eager'} | {r['ms_per_step']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gb']:.1f} | {r['profiled_ms_per_step']:.2f} | "
            f"{r['gpu_busy_ms']:.2f} | {r['not_in_kernels_ms']:.2f} |")
    for r in rows:
        loss = "in graph" if r["loss_in_graph"] else "eager"
        lines += ["", f"## {r['backend']}, batch {r['batch']}, loss {loss}: ms per step by category", "",
                  "| category | ms | share of GPU busy time |", "| --- | ---: | ---: |"]
        lines += [f"| {c} | {ms:.2f} | {100 * ms / r['gpu_busy_ms']:.1f}% |" for c, ms in r["ms_per_category"].items()]
        lines += ["", "| top kernel | category | ms |", "| --- | --- | ---: |"]
        lines += [f"| `{n}` | {c} | {ms:.3f} |" for n, c, ms in r["top_kernels_ms"][:12]]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2_small")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--cases", default="sdpa:16:eager,sdpa:16,triton:16",
                    help="comma list of BACKEND:BATCH[:eager] (eager: loss outside the compiled graph)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per case")
    ap.add_argument("--peak-tflops", type=float, default=989.4)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_train_step.py needs a CUDA GPU")
    model_cfg = yaml.safe_load((bench_train.ROOT / "configs" / "model" / f"{args.model}.yaml").read_text())
    model_cfg["vocab_size"] = args.vocab
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "commit": git_commit(), "model": args.model}
    rows = []
    for case in args.cases.split(","):
        backend, batch, *rest = case.split(":")
        if backend not in ("sdpa", "triton") or rest not in ([], ["eager"]):
            raise SystemExit(f"--cases: {case!r} is not BACKEND:BATCH[:eager] with BACKEND sdpa or triton")
        rows.append(profile_case(model_cfg, backend, int(batch), not rest, args.steps, args.peak_tflops))
        print({k: v for k, v in rows[-1].items() if k != "top_kernels_ms"}, flush=True)
        text = report(rows, meta)
        if args.out:  # after every case: a cut-off run keeps its numbers
            Path(args.out).with_suffix(".md").write_text(text + "\n")
            Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
