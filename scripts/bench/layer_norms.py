"""The attention layer's norms as the model computes them against their plain PyTorch forms, on the GPU.

At a training shape under bf16 autocast, forward + backward of: the l2 QK-norm (`models.gpt._qk_normalize`,
one fused rms_norm weighted by D^-1/2) against F.normalize, and the per-head output norm
(`Attention.normalize_output`, one fused rms_norm in the heads' dtype) against the norm through an fp32
copy. Per row: median us (do_bench), CUDA kernels per call, the output dtype and its largest error
against the float64 result.

    python scripts/bench/layer_norms.py [--batch 32 --seq 512 --heads 6 --head-dim 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models.gpt import Attention, AttnConfig, GPTConfig, _qk_normalize  # noqa: E402
from timing import median_ms, result_header  # noqa: E402


def fwd_bwd(fn, x0: torch.Tensor):
    """A step: fn(x) under bf16 autocast, then its backward."""
    x = x0.clone().requires_grad_()
    grad = torch.randn_like(x0)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(x)
        out.backward(grad)
    return step


def kernels_per_call(step) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    b, n, h, d = args.batch, args.seq, args.heads, args.head_dim
    dev = torch.device("cuda")
    layer = Attention(GPTConfig(n_head=h, n_kv_head=h, d_model=h * d, context=n,
                                attn=AttnConfig(name="threshold", backend="reference")), 0).to(dev)
    heads = torch.randn(b, n, 2 * h, d, device=dev, dtype=torch.bfloat16)  # q and k heads
    outs = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
    weight = layer.head_norm.weight
    cases = [
        ("l2 QK-norm: the model's (fused rms_norm)", lambda x: _qk_normalize(x, "l2"), heads,
         lambda x: F.normalize(x, dim=-1)),
        ("l2 QK-norm: F.normalize", lambda x: F.normalize(x, dim=-1), heads, lambda x: F.normalize(x, dim=-1)),
        ("output norm: the model's (fused, heads' dtype)", layer.normalize_output, outs,
         lambda y: F.rms_norm(y, (d,), weight.double(), layer.head_norm.eps)),
        ("output norm: through an fp32 copy", lambda y: layer.head_norm(y.float()).to(y.dtype), outs,
         lambda y: F.rms_norm(y, (d,), weight.double(), layer.head_norm.eps)),
    ]
    rows = []
    for name, fn, x0, exact in cases:
        step = fwd_bwd(fn, x0)
        step()
        us = median_ms(step) * 1e3
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(x0)
        err = (out.double() - exact(x0.double())).abs().max().item()
        rows.append({"case": name, "us_fwd_bwd": us, "kernels": kernels_per_call(step), "dtype": str(out.dtype),
                     "max_error_vs_float64": err})
        print(f"{name:<50} {us:8.1f} us fwd+bwd  {rows[-1]['kernels']:3d} kernels  {out.dtype}  "
              f"max error vs float64 {err:.2e}", flush=True)
    if args.out:
        meta = {**result_header(), "shape": [b, n, h, d]}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
