"""Host work of the public `attn.attention` per call, on any machine: the kernel launches stubbed out.

Everything a call does on the host except the launches themselves runs as on a GPU: argument
checks, mask preparation, the autograd Function, output allocation, scalars, tile-config lookup and
the launcher's key (the fused paths' Python, which is what separates a host-bound call from SDPA;
a launch through the compiled kernel's launcher adds about 11-15 us each on an H200 host,
docs/results/host_overhead/). Timed as this thread's CPU time (time.thread_time), so other
processes' load changes the figures less than it changes wall time. CPU tensors, fp16 (1,2,64,16) (the public
function refuses bf16 on the CPU), so every tensor op the path runs costs what an allocation costs.

Rows: fwd+bwd (inputs that require grad), fwd without grad, decode (one query against 256 keys,
no grad, split into 4 key ranges as a GPU decode step is), and fwd+bwd inside
torch.compile(fullgraph=True) (the call alone compiled; the compiled graph calls the launcher ops); on
request (--modes) also "grad fwd" and "compiled grad fwd", the forward alone of inputs that require grad
(the autograd node built, no backward run), eager and compiled, which split a compiled call's price
between its forward and its backward.
Each row also counts the Python and builtin function calls of one call (sys.setprofile), a measure of
host work that does not move with the machine's load. Yardsticks, the costs torch itself puts on any
such call: `q * 2` (one built-in op), a no-op autograd.Function (the floor of a Python-defined differentiable
op) and an autograd.Function over two registered ops that only allocate (the floor of a family's call:
the same ops, outputs and saved tensors with nothing inside), eager and compiled.

    python scripts/bench/host_cost_cpu.py [--variants softmax,threshold] [--profile softmax] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("ATTNLAB_DECODE_SPLITS", "4")  # the split-key decode path, as on a GPU
os.environ.setdefault("ATTNLAB_DIFF_DKDV", "split")  # no timing-based form choice (it needs a GPU)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import attn  # noqa: E402
import attn.ops  # noqa: E402
from attn.kernels import runtime  # noqa: E402

PARAMS = {"softmax": {}, "softcap_tanh": {"cap": 30.0}, "threshold": {"beta": 1.0, "power": 2.0},
          "sigmoid": {}, "diff_threshold": {"beta": 1.0, "power": 2.0}}
B, H, N, D, CACHE = 1, 2, 64, 16, 256


def stub_launches() -> None:
    """Kernels launch nothing and take their first tile config (no timing); Triton counts as usable
    for CPU tensors."""
    runtime.Kernel.run = lambda self, cfg, grid, tensors, scalars, meta: None
    runtime.Kernel.choose = lambda self, grid, tensors, scalars, meta, configs, tune_key: configs[0]
    attn.ops.triton_usable = lambda device: True


class NoOpFunction(torch.autograd.Function):
    """An autograd.Function that allocates its outputs and computes nothing: the floor of any
    Python-defined differentiable op."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


# A forward and a backward op registered as the families' launcher ops are (torch.library's low-level API, a
# fake each), whose kernels only allocate: the families' structure with nothing inside
_EMPTY_OPS = torch.library.Library("attnlab_host_cost", "FRAGMENT")


def _empty_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _empty_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


for _name, _fn in (("empty_forward", _empty_forward), ("empty_backward", _empty_backward)):
    _EMPTY_OPS.define(_name + torch.library.infer_schema(_fn, mutates_args=()))
    _EMPTY_OPS.impl(_name, _fn, "CPU")
    torch.library.register_fake(f"attnlab_host_cost::{_name}", _fn, lib=_EMPTY_OPS)


class EmptyOpsFunction(torch.autograd.Function):
    """An autograd.Function over an empty forward op and an empty backward op, saving what a family's
    Function saves (q, k, v, out, lse): what a fused call costs torch with kernels that cost nothing (its
    compiled rows are torch's compiled-region price for such a call)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.ops.attnlab_host_cost.empty_forward.default(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.attnlab_host_cost.empty_backward.default(grad, *ctx.saved_tensors)


# the yardsticks: torch's own costs that every call above pays too
YARDSTICKS = {"torch q*2": lambda q, k, v: q * 2, "no-op Function": NoOpFunction.apply,
              "empty-ops Function": EmptyOpsFunction.apply}


GRAD_MODES = ("fwd+bwd", "compiled fwd+bwd", "grad fwd", "compiled grad fwd")  # inputs that require grad
BACKWARD_MODES = ("fwd+bwd", "compiled fwd+bwd")


def make_call(variant: str, mode: str):
    if variant in YARDSTICKS:
        return _yardstick_call(YARDSTICKS[variant], mode)
    spec = attn.get_variant(variant).make_spec(**PARAMS[variant])
    grad = mode in GRAD_MODES
    kv = CACHE if mode == "decode" else N
    n = 1 if mode == "decode" else N

    def leaf(length):
        return torch.randn(B, length, H, D, dtype=torch.float16).requires_grad_(grad)

    q, k, v = leaf(n), leaf(kv), leaf(kv)
    extra = None
    if variant == "diff_threshold":
        extra = {"q2": leaf(n), "k2": leaf(kv), "lam": torch.full((H,), 0.5, requires_grad=grad)}
    dout = torch.randn(B, n, H, D, dtype=torch.float16)

    def call():
        return attn.attention(q, k, v, spec, causal=True, extra=extra, backend="triton")

    if mode.startswith("compiled"):
        torch._dynamo.reset()
        attn.ops.preload_kernel(spec, "triton")  # torch.compile cannot trace the kernel module's import
        call = torch.compile(call, fullgraph=True)
    if mode in BACKWARD_MODES:
        return lambda: call().backward(dout)
    return lambda: call()


def _yardstick_call(op, mode: str):
    grad = mode in GRAD_MODES
    q, k, v = (torch.randn(B, N, H, D, dtype=torch.float16).requires_grad_(grad) for _ in range(3))
    dout = torch.randn(B, N, H, D, dtype=torch.float16)

    def call():
        return op(q, k, v)

    if mode.startswith("compiled"):
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True)
    return (lambda: call().backward(dout)) if mode in BACKWARD_MODES else call


def host_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median, best) over rounds of this thread's CPU time per call, in microseconds."""
    for _ in range(20):
        fn()
    per_call = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        per_call.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(per_call), min(per_call)


def calls_per_call(fn, calls: int = 20) -> int:
    """Python and builtin function calls per call of fn (sys.setprofile events): a count of host work
    that other processes' load does not change."""
    for _ in range(5):
        fn()
    count = 0

    def profiler(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profiler)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return round(count / calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join([*YARDSTICKS, *PARAMS]))
    ap.add_argument("--modes", default="fwd+bwd,fwd,decode,compiled fwd+bwd")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default=None, help="a variant: print the cProfile of its eager fwd+bwd")
    ap.add_argument("--out", default=None, help="write OUT.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stub_launches()
    rows = {}
    for variant in args.variants.split(","):
        for mode in args.modes.split(","):
            if variant in YARDSTICKS and mode == "decode":
                continue
            with torch.no_grad() if mode in ("fwd", "decode") else torch.enable_grad():
                fn = make_call(variant, mode)
                median, best = host_us(fn, args.calls, args.rounds)
                python_calls = calls_per_call(fn)
            rows[f"{variant} {mode}"] = {"median_us": median, "best_us": best, "python_calls": python_calls}
            print(f"{variant:16s} {mode:18s} {median:8.1f} us (best {best:.1f}) {python_calls:6d} Python calls",
                  flush=True)
    if args.profile:
        fn = make_call(args.profile, "fwd+bwd")
        fn()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    if args.out:
        meta = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                "torch": torch.__version__, "shape": [B, H, N, D], "cache": CACHE}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
