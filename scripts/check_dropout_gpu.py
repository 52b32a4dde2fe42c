"""GPU check: attention dropout draws a fresh mask on every call, eager, under torch.compile and
under CUDA graphs (torch.compile mode="reduce-overhead"), and is unbiased in each.

Per variant and mode: 3 calls on the same inputs give 3 different outputs and gradients, and the
mean of 200 calls' outputs is the output without dropout within 5 standard errors (a mask frozen
by compilation or graph capture fails both). tests/test_attention_dropout.py -k kernel checks
the kernels against the float64 reference fed the kernels' own mask.

    python scripts/check_dropout_gpu.py [--variants softmax,threshold]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attn  # noqa: E402

DEFAULT_VARIANTS = "softmax,softcap_tanh,threshold,diff_threshold,sigmoid"
P = 0.3
SAMPLES = 200


def inputs(name: str, b=2, n=128, h=4, d=64):
    gen = torch.Generator(device="cuda").manual_seed(0)
    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)
    x = {"q": rand(b, n, h, d), "k": rand(b, n, h, d), "v": rand(b, n, h, d)}
    if "threshold" in name:
        x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    if name == "diff_threshold":
        x["q2"], x["k2"] = F.normalize(rand(b, n, h, d), dim=-1), F.normalize(rand(b, n, h, d), dim=-1)
        x["lam"] = torch.full((h,), 0.3, device="cuda")
    return {key: t.to(torch.bfloat16 if key != "lam" else torch.float32).requires_grad_() for key, t in x.items()}


def check(name: str, mode: str) -> tuple[bool, str]:
    spec = attn.get_variant(name).make_spec(**({"beta": -1.0} if "threshold" in name else {}))
    x = inputs(name)

    def attend(q, k, v, dropout_p, **extra):
        return attn.attention(q, k, v, spec, causal=True, dropout_p=dropout_p, extra=extra)

    def forward(**tensors):
        return attend(dropout_p=P, **tensors)

    forward = {"eager": forward, "compile": torch.compile(forward, fullgraph=True),
               "cuda_graphs": torch.compile(forward, fullgraph=True, mode="reduce-overhead")}[mode]

    def fn(**tensors):  # the compiled forward and its compiled backward (torch.compile's AOT autograd)
        out = forward(**tensors)
        grad_q, = torch.autograd.grad(out.float().square().sum(), [tensors["q"]])
        return out.detach().float(), grad_q.float()

    calls = []
    for _ in range(3):
        out, grad = fn(**x)
        calls.append((out.clone(), grad.clone()))  # graph outputs are overwritten by the next replay
    differ = all(not torch.equal(calls[i][j], calls[i + 1][j]) for i in range(2) for j in range(2))
    with torch.no_grad():
        plain = attend(dropout_p=0.0, **{key: t.detach() for key, t in x.items()}).float()
    total = torch.zeros_like(plain)
    square = torch.zeros_like(plain)
    for _ in range(SAMPLES):
        out = fn(**x)[0]
        total += out
        square += out.square()
    mean = total / SAMPLES
    stderr = ((square / SAMPLES - mean.square()).clamp_min(0) / SAMPLES).sqrt()
    # the bf16 rounding of one output (about 2^-8 relative) also separates the mean from plain
    z = ((mean - plain).abs() / (stderr + plain.abs() * 2**-8 + 1e-6)).flatten()
    unbiased = bool(torch.quantile(z, 0.99) < 5.0)
    return differ and unbiased, f"calls differ {differ}, mean of {SAMPLES} vs no dropout: z99 {torch.quantile(z, 0.99):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list (default {DEFAULT_VARIANTS})")
    failed = 0
    for name in ap.parse_args().variants.split(","):
        for mode in ("eager", "compile", "cuda_graphs"):
            torch.compiler.reset()
            ok, detail = check(name, mode)
            failed += not ok
            print(f"{'ok' if ok else 'FAIL':4} {name:16} {mode:12} {detail}", flush=True)
    print("all pass" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
