"""Host time per call of the ways an op can be registered and a Triton kernel launched (GPU).

Trivial ops (an empty_like), so only host work is timed: a torch.library.custom_op, a low-level
torch.library.Library op (with and without torch._disable_dynamo), an autograd.Function, each
eager and compiled; a Triton kernel with 40 arguments through kernel[grid] and through the
compiled kernel's launcher directly (the attn runtime's path). Prints one line per way.

    python scripts/bench_launch_overhead.py
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention_call import host_us  # noqa: E402

dev = "cuda"
x = torch.randn(4, 64, device=dev)


def impl(a: torch.Tensor, b: torch.Tensor | None, s: float, flag: bool, w: int) -> torch.Tensor:
    return torch.empty_like(a)


# 1. custom_op
@torch.library.custom_op("micro::co", mutates_args=())
def co(a: torch.Tensor, b: torch.Tensor | None, s: float, flag: bool, w: int) -> torch.Tensor:
    return torch.empty_like(a)


@co.register_fake
def _(a, b, s, flag, w):
    return torch.empty_like(a)


@torch.library.custom_op("micro::co_bwd", mutates_args=())
def co_bwd(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a)


@co_bwd.register_fake
def _(g, a):
    return torch.empty_like(a)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _bwd(ctx, g):
    (a,) = ctx.saved_tensors
    return co_bwd(g, a), None, None, None, None


co.register_autograd(_bwd, setup_context=_setup)

# 2. low-level Library
lib = torch.library.Library("micro", "FRAGMENT")
lib.define("ll(Tensor a, Tensor? b, float s, bool flag, int w) -> Tensor")
lib.define("ll_bwd(Tensor g, Tensor a) -> Tensor")
lib.impl("ll", impl, "CUDA")
lib.impl("ll_bwd", lambda g, a: torch.empty_like(a), "CUDA")
torch.library.register_fake("micro::ll")(lambda a, b, s, flag, w: torch.empty_like(a))
torch.library.register_fake("micro::ll_bwd")(lambda g, a: torch.empty_like(a))


def _bwd_ll(ctx, g):
    (a,) = ctx.saved_tensors
    return torch.ops.micro.ll_bwd(g, a), None, None, None, None


torch.library.register_autograd("micro::ll", _bwd_ll, setup_context=_setup)

lib.define("lld(Tensor a, Tensor? b, float s, bool flag, int w) -> Tensor")
lib.impl("lld", torch._disable_dynamo(impl), "CUDA")
torch.library.register_fake("micro::lld")(lambda a, b, s, flag, w: torch.empty_like(a))


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, s, flag, w):
        ctx.save_for_backward(a)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return torch.empty_like(a), None, None, None, None


xg = torch.randn(4, 64, device=dev, requires_grad=True)
g = torch.ones_like(xg)
rows = {}
rows["empty_like"] = host_us(lambda: torch.empty_like(x), iters=2000)
rows["current raw stream"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(0))
rows["direct python impl"] = host_us(lambda: impl(x, None, 1.0, True, 3))
rows["custom_op no grad"] = host_us(lambda: co(x, None, 1.0, True, 3))
rows["Library.impl no grad"] = host_us(lambda: torch.ops.micro.ll(x, None, 1.0, True, 3))
rows["Library.impl .default no grad"] = host_us(lambda: torch.ops.micro.ll.default(x, None, 1.0, True, 3))
rows["Library.impl+disable_dynamo no grad"] = host_us(lambda: torch.ops.micro.lld.default(x, None, 1.0, True, 3))
rows["custom_op fwd+bwd"] = host_us(lambda: co(xg, None, 1.0, True, 3).backward(g))
rows["Library.impl+register_autograd fwd+bwd"] = host_us(lambda: torch.ops.micro.ll(xg, None, 1.0, True, 3).backward(g))
rows["autograd.Function fwd+bwd"] = host_us(lambda: Fn.apply(xg, None, 1.0, True, 3).backward(g))
rows["empty_like fwd+bwd (mul)"] = host_us(lambda: (xg * 1.0).backward(g))


def compiled_of(op):
    def f(a):
        return op(a, None, 1.0, True, 3)
    return torch.compile(f, fullgraph=True, dynamic=False)


for name, op in [("custom_op", co), ("Library.impl", torch.ops.micro.ll.default)]:
    cf = compiled_of(op)
    rows[f"compiled {name} fwd+bwd"] = host_us(lambda: cf(xg).backward(g), iters=500)
    with torch.no_grad():
        rows[f"compiled {name} no grad"] = host_us(lambda: cf(x), iters=500)


# Triton: a kernel with many args
@triton.jit
def k40(A, B, C, D, E, F, G,
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15, s16, s17, s18, s19,
        s20, s21, s22, s23, n, h, f0, f1, f2, f3,
        HEAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(A + offs * s0, mask=m)
    tl.store(B + offs * s1, a * f0 + h, mask=m)


A = torch.randn(4096, device=dev)
B = torch.empty_like(A)
T = [A, B, A, A, A, A, A]
ints = [1, 1] + [64 * i + 16 for i in range(22)] + [4096, 3]
floats = [2.0, 1.0, 0.5, 0.25]
meta = dict(HEAD=64, CAUSAL=True, BLOCK=128)
grid = (32,)
rows["triton kernel[grid]"] = host_us(lambda: k40[grid](*T, *ints, *floats, **meta))
compiled = k40.run(*T, *ints, *floats, grid=grid, warmup=False, **meta)
from triton import knobs
full = [*T, *ints, *floats, *meta.values()]
B.zero_()


def direct():
    stream = torch._C._cuda_getCurrentRawStream(0)
    compiled.run(32, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)


direct()
torch.cuda.synchronize()
print("direct launch correct:", torch.equal(B, A * 2.0 + 3), flush=True)
rows["triton direct compiled.run"] = host_us(direct)


def keyed():
    key = (tuple((t.dtype, t.data_ptr() % 16) for t in T), tuple(ints))
    cache.get(key)
    direct()


cache = {}
rows["triton direct + key build"] = host_us(keyed)
for k, v in rows.items():
    print(f"{k:45s} {v:8.1f} us")
