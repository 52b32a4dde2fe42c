"""One attention call at a training shape: wall time eager and compiled, GPU kernel time, host time.

At the sizes researchers ablate, a call's host work (argument checks, dispatch, kernel launches)
can exceed its GPU time; this measures both, per variant, in one process against SDPA:

  eager_ms     fwd+bwd through the model's call (`attn.AttentionCall`), do_bench median
  public_ms    the same through the public, validated `attn.attention`
  compiled_ms  the same call inside torch.compile(fullgraph=True), compiled on its first call
  kernel_ms    the sum of GPU kernel times of one fwd+bwd (torch.profiler)
  host_us      host time of one fwd+bwd at a tiny shape of the same kind (the GPU never waits
               the host out there, so the wall time is the host's)

    python scripts/bench/bench_attention_call.py --out gpu_out/attention_call [--profile]

--profile prints the cProfile functions that take the host time of eager calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import back_to_back_ms, median_ms, result_header  # noqa: E402

import attn  # noqa: E402

VARIANTS = [  # (variant, params)
    ("softmax", {}),
    ("softcap_tanh", {"cap": 30.0}),
    ("softcap_softsign", {"cap": 30.0}),
    ("alsc", {"cap": 30.0, "knee": 0.5}),
    ("threshold", {"beta": 1.0, "power": 2.0}),
    ("diff_threshold", {"beta": 1.0, "power": 2.0}),
    ("sigmoid", {}),
]


def inputs(variant: str, b: int, h: int, n: int, d: int):
    """q, k, v (B, N, H, D) bf16 leaves and the extra per-call tensors of the variant."""
    torch.manual_seed(0)

    def make(unit=False):
        x = torch.randn(b, n, h, d, device="cuda", dtype=torch.float32)
        x = F.normalize(x, dim=-1) if unit else x
        return x.to(torch.bfloat16).requires_grad_()

    threshold = variant in ("threshold", "diff_threshold")
    q, k, v = make(threshold), make(threshold), make()
    extra = {}
    if variant == "diff_threshold":
        extra = {"q2": make(True), "k2": make(True),
                 "lam": torch.full((h,), 0.5, device="cuda", dtype=torch.bfloat16, requires_grad=True)}
    return q, k, v, extra


def fwd_bwd(fn, q, k, v, extra, do):
    out = fn(q, k, v, extra=extra)
    out.backward(do)


def kernel_ms(call, iters: int = 20) -> float:
    """Sum of GPU kernel times per call (torch.profiler), the L2 flush of do_bench not included."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    return total_us / iters / 1e3


def host_us(call) -> float:
    """µs per call of 300 calls queued back to back (one batch): at a tiny shape, the host's time."""
    return 1e3 * back_to_back_ms(call, calls=300, batches=1)


def profile_host(call, label: str, iters: int = 300, top: int = 30) -> str:
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        call()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return f"==== {label}: cProfile over {iters} fwd+bwd calls, by own time\n" + s.getvalue()


def attention_fn(spec, backend: str, public: bool = False):
    if not public:
        return attn.AttentionCall(spec, causal=True, backend=backend)

    def fn(q, k, v, extra=None):
        return attn.attention(q, k, v, spec, causal=True, backend=backend, extra=extra)

    return fn


def measure(variant, params, backend, shape, tiny, profile: bool):
    spec = attn.get_variant(variant).make_spec(**params)
    eager = attention_fn(spec, backend)
    row = {"variant": variant, "backend": backend}
    q, k, v, extra = inputs(variant, *shape)
    do = torch.randn_like(q)

    def call(fn=eager):
        fwd_bwd(fn, q, k, v, extra, do)

    torch._dynamo.reset()
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    try:  # the first call of the compiled function is its first call at all (no eager call before)
        call(compiled)
        row["compiled_first_call"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported, the other columns still run
        row["compiled_first_call"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    call()
    row["eager_ms"] = median_ms(call)
    row["public_ms"] = median_ms(lambda: call(attention_fn(spec, backend, public=True)))
    if row["compiled_first_call"] == "ok":
        row["compiled_ms"] = median_ms(lambda: call(compiled))
    row["kernel_ms"] = kernel_ms(call)
    tq, tk, tv, textra = inputs(variant, *tiny)
    tdo = torch.randn_like(tq)
    row["host_us"] = host_us(lambda: fwd_bwd(eager, tq, tk, tv, textra, tdo))
    if row["compiled_first_call"] == "ok":  # its own graph for the tiny shape (no dynamic shapes)
        compiled_tiny = torch.compile(eager, fullgraph=True, dynamic=False)
        row["compiled_host_us"] = host_us(lambda: fwd_bwd(compiled_tiny, tq, tk, tv, textra, tdo))
    text = ""
    if profile:
        text = profile_host(lambda: fwd_bwd(eager, tq, tk, tv, textra, tdo), f"{variant} ({backend})")
    return row, text


def markdown(meta, rows) -> str:
    sdpa = next((r for r in rows if r["backend"] == "sdpa"), None)
    lines = [
        f"# One attention call, (B,H,N,D) = {tuple(meta['shape'])}, causal, bf16, fwd+bwd", "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · commit {meta['commit']} · "
        f"host time at {tuple(meta['tiny'])}", "",
        "| variant | backend | eager ms | vs SDPA | public API ms | compiled ms | kernel ms | host us eager | host us compiled | compiled on first call |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        rel = f"{r['eager_ms'] / sdpa['eager_ms']:.2f}x" if sdpa else "-"
        cms = f"{r['compiled_ms']:.3f}" if "compiled_ms" in r else "-"
        chu = f"{r['compiled_host_us']:.0f}" if "compiled_host_us" in r else "-"
        pub = f"{r['public_ms']:.3f}" if "public_ms" in r else "-"
        lines.append(f"| {r['variant']} | {r['backend']} | {r['eager_ms']:.3f} | {rel} | {pub} | {cms} | "
                     f"{r['kernel_ms']:.3f} | "
                     f"{r['host_us']:.0f} | {chu} | {r['compiled_first_call']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_out/attention_call")
    ap.add_argument("--shape", default="16,12,1024,64", help="B,H,N,D")
    ap.add_argument("--tiny", default="1,2,128,64", help="B,H,N,D of the host-time measurement")
    ap.add_argument("--variants", default=None, help="comma list (SDPA always runs)")
    ap.add_argument("--profile", action="store_true", help="print cProfile of the eager host path")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    tiny = tuple(int(x) for x in args.tiny.split(","))
    wanted = set(args.variants.split(",")) if args.variants else None
    meta = {**result_header(), "shape": shape, "tiny": tiny}
    print(meta, flush=True)
    cases = [("softmax", {}, "sdpa")] + [(v, p, "triton") for v, p in VARIANTS if not wanted or v in wanted]
    rows, profiles = [], []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for variant, params, backend in cases:
        row, text = measure(variant, params, backend, shape, tiny, args.profile)
        rows.append(row)
        profiles.append(text)
        print(row, flush=True)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows))
    if args.profile:
        out.with_suffix(".profile.txt").write_text("\n".join(profiles))
        print("\n".join(profiles))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
