"""Host time per eager `attn.attention` call on a GPU, per kernel tier and launch path.

A call's time here is `calls` calls queued back to back, then one synchronize, per call (the median of
`rounds` rounds, after warm-up calls that compile): at the tiny shape (B,N,H,D) = (1,128,2,64) the GPU
never waits for the host to fall behind, so the figure is the host's work per call; at the training shape
(16,1024,12,64) it is the larger of the host's and the GPU's time per call, as an eager training step sees it.

Rows: variant (softmax, softcap_tanh, threshold, sigmoid, diff_threshold) x shape x fwd / fwd+bwd, bf16,
causal. Columns:

  portable     ATTNLAB_GLUON=0: the portable Triton kernels (their direct launches)
  gluon        ATTNLAB_GLUON=1: the Gluon kernels where they serve the call, launched directly
  gluon_jit    ATTNLAB_GLUON=1 ATTNLAB_DIRECT_LAUNCH=0: the same launches, each through Triton's JIT
  sdpa         attn.attention(backend="sdpa"), softmax rows only

`gluon ran` says whether a Gluon kernel launched in the gluon column's calls (diff_threshold has no Gluon
path behind the public function: its gluon columns run the portable kernels, a control). fwd calls take
inputs without gradients (no autograd node); fwd+bwd calls take leaves that require them and run
torch.autograd.grad (no accumulation into .grad). Tile configs are pinned (ATTNLAB_AUTOTUNE=0): no tuning
runs inside the script. With a warm Triton cache it takes well under a minute on an H100; a cold cache adds
the compiles (portable and Gluon kernels of every variant).

    python scripts/bench/host_cost_call_gpu.py --out $OUT/host_cost_call [--variants softmax,threshold]

Writes <out>.json and <out>.md (the table, also printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["ATTNLAB_AUTOTUNE"] = "0"  # pinned tile configs: no tuning inside the timed script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import result_header  # noqa: E402

import attn  # noqa: E402
from attn.kernels import runtime, tiers  # noqa: E402

VARIANTS = {"softmax": {}, "softcap_tanh": {"cap": 30.0}, "threshold": {"beta": 1.0, "power": 2.0}, "sigmoid": {},
            "diff_threshold": {"beta": 1.0, "power": 2.0}}
SHAPES = {"tiny": (1, 128, 2, 64), "train": (16, 1024, 12, 64)}  # (B, N, H, D)
# column -> (backend, environment); None: the variable unset
COLUMNS = {"portable": ("triton", {tiers.GLUON_ENV: "0", runtime.DIRECT_ENV: None}),
           "gluon": ("triton", {tiers.GLUON_ENV: "1", runtime.DIRECT_ENV: None}),
           "gluon_jit": ("triton", {tiers.GLUON_ENV: "1", runtime.DIRECT_ENV: "0"}),
           "sdpa": ("sdpa", {tiers.GLUON_ENV: "0", runtime.DIRECT_ENV: None})}


def set_env(env: dict) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def make_call(variant: str, shape: tuple, mode: str, backend: str):
    """A no-argument call of attn.attention on fixed inputs: fwd (inputs without gradients) or fwd+bwd
    (leaves that require them, torch.autograd.grad of every leaf)."""
    b, n, h, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    threshold = variant in ("threshold", "diff_threshold")
    grad = mode == "fwd+bwd"

    def tensor(unit=False):
        x = torch.randn(b, n, h, d, device="cuda", generator=gen)
        x = F.normalize(x, dim=-1) if unit else x
        return x.to(torch.bfloat16).requires_grad_(grad)

    q, k, v = tensor(threshold), tensor(threshold), tensor()
    extra = {}
    if variant == "diff_threshold":
        extra = {"q2": tensor(True), "k2": tensor(True),
                 "lam": torch.full((h,), 0.5, device="cuda", dtype=torch.bfloat16, requires_grad=grad)}
    spec = attn.get_variant(variant).make_spec(**VARIANTS[variant])
    leaves = (q, k, v, *extra.values())
    do = torch.randn(b, n, h, d, device="cuda", generator=gen).to(torch.bfloat16)

    def fwd():
        return attn.attention(q, k, v, spec, causal=True, backend=backend, extra=extra or None)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), leaves, do)

    return fwd_bwd if grad else fwd


def per_call_us(call, calls: int, rounds: int, warmup: int = 3) -> float:
    """µs per call of `calls` calls queued back to back then one synchronize, median of `rounds` rounds."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def gluon_launched(call) -> bool:
    """Whether one call launches a Gluon kernel (every Gluon launcher is named gluon_*)."""
    names = []
    run = runtime.DirectLauncher.run

    def spy(self, *args, **kwargs):
        names.append(self.name)
        return run(self, *args, **kwargs)

    runtime.DirectLauncher.run = spy
    try:
        call()
        torch.cuda.synchronize()
    finally:
        runtime.DirectLauncher.run = run
    return any(name.startswith("gluon_") for name in names)


def measure(variant: str, shape_name: str, mode: str, calls: int, rounds: int) -> dict:
    shape = SHAPES[shape_name]
    row = {"variant": variant, "shape": shape_name, "bnhd": shape, "mode": mode}
    n_calls = calls if shape_name == "tiny" else max(10, calls // 5)
    for column, (backend, env) in COLUMNS.items():
        if backend == "sdpa" and variant != "softmax":
            continue
        set_env(env)
        call = make_call(variant, shape, mode, backend)
        call()  # compiles outside the timing
        if column == "gluon":
            row["gluon_ran"] = gluon_launched(call)
        row[f"{column}_us"] = per_call_us(call, n_calls, rounds)
    set_env({tiers.GLUON_ENV: None, runtime.DIRECT_ENV: None})
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    def us(row, column):
        value = row.get(f"{column}_us")
        return "-" if value is None else f"{value:.1f}"

    lines = [
        "# Host time per eager attn.attention call, per tier and launch path (µs per call, back to back)", "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · commit {meta['commit']} · "
        f"bf16, causal, tile configs pinned; (B,N,H,D) tiny {SHAPES['tiny']}, train {SHAPES['train']}", "",
        "| variant | shape | pass | portable | gluon (direct) | gluon (JIT) | gluon - portable | gluon JIT - direct | sdpa | gluon ran |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        diff = r["gluon_us"] - r["portable_us"]
        jit = r["gluon_jit_us"] - r["gluon_us"]
        lines.append(f"| {r['variant']} | {r['shape']} | {r['mode']} | {us(r, 'portable')} | {us(r, 'gluon')} | "
                     f"{us(r, 'gluon_jit')} | {diff:+.1f} | {jit:+.1f} | {us(r, 'sdpa')} | "
                     f"{'yes' if r['gluon_ran'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_out/host_cost_call", help="output path without suffix")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--calls", type=int, default=100, help="calls per timed round at the tiny shape (a fifth, "
                                                           "at least 10, at the training shape)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per figure (their median)")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    shapes = [s for s in args.shapes.split(",") if s]
    for name, known in (("variant", VARIANTS), ("shape", SHAPES)):
        unknown = [x for x in (variants if name == "variant" else shapes) if x not in known]
        if unknown:
            raise SystemExit(f"--{name}s: unknown {unknown}; choose from {', '.join(known)}")
    if not torch.cuda.is_available():
        raise SystemExit("host_cost_call_gpu.py needs a CUDA GPU")
    meta = {**result_header(), "shapes": SHAPES, "calls": args.calls, "rounds": args.rounds,
            "gluon_usable": tiers.gluon_usable(torch.device("cuda"))}
    print(meta, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.perf_counter()
    for shape_name in shapes:
        for variant in variants:
            for mode in ("fwd", "fwd+bwd"):
                row = measure(variant, shape_name, mode, args.calls, args.rounds)
                rows.append(row)
                print(row, flush=True)
                out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                out.with_suffix(".md").write_text(markdown(meta, rows))
    meta["seconds"] = round(time.perf_counter() - started, 1)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(markdown(meta, rows))
    print(f"{meta['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
