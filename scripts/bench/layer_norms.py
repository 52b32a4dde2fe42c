"""The attention layer's norms as the model computes them against their plain PyTorch forms, on the GPU.

At a training shape under bf16 autocast, forward + backward of each norm as the model computes it on CUDA
(models/head_norms.py's Triton kernels: many head rows per program) against torch's fused rms_norm
(the same function's plain form, `kernel=False`: one thread block per row) and other plain forms: the l2
QK-norm (`models.gpt._qk_normalize`; also F.normalize), the rms QK-norm of a sigmoid layer
(`Attention.rms_normalize_heads`: fp32 output, q and k weights) and the per-head output norm
(`Attention.normalize_output`, the heads' dtype; also through an fp32 copy), and each QK-norm with RoPE
as `Attention.split_heads` computes them (`head_norm_rope`: one kernel each way) against the norm and
then the RoPE module's elementwise ops. Per row: median us
(do_bench), CUDA kernels per call, the output dtype and its largest error against the float64 result.

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
from models.head_norms import head_norm_rope, head_rms_norm  # noqa: E402
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
    def layer_of(name: str) -> Attention:
        return Attention(GPTConfig(n_head=h, n_kv_head=h, d_model=h * d, context=n,
                                   attn=AttnConfig(name=name, backend="reference")), 0).to(dev)

    layer, sigmoid = layer_of("threshold"), layer_of("sigmoid")
    with torch.no_grad():  # weights away from 1, as after training
        for w in (layer.head_norm.weight, sigmoid.q_norm.weight, sigmoid.k_norm.weight):
            w.uniform_(0.5, 1.5)
    heads = torch.randn(b, n, 2 * h, d, device=dev, dtype=torch.bfloat16)  # q and k heads
    outs = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
    norm, qw, kw = layer.head_norm, sigmoid.q_norm.weight, sigmoid.k_norm.weight
    eps_rms = torch.finfo(torch.float32).eps  # q_norm's eps None: fp32's machine epsilon
    l2 = dict(eps=torch.finfo(torch.float32).tiny, scale=d ** -0.5)
    rms = dict(second_weight=kw, first_slots=h, period=2 * h, eps=eps_rms, out_dtype=torch.float32)
    rms64 = dict(rms, second_weight=kw.double(), out_dtype=torch.float64)
    tables = layer.rope.table_rows(0, n)  # cos, sin of positions 0 .. n - 1
    cases = [
        ("l2 QK-norm: the model's (Triton head norm)", lambda x: _qk_normalize(x, "l2"), heads,
         lambda x: F.normalize(x, dim=-1)),
        ("l2 QK-norm: torch rms_norm (fused)", lambda x: head_rms_norm(x, **l2, kernel=False), heads,
         lambda x: F.normalize(x, dim=-1)),
        ("l2 QK-norm: F.normalize", lambda x: F.normalize(x, dim=-1), heads, lambda x: F.normalize(x, dim=-1)),
        ("rms QK-norm: the model's (Triton head norm)", sigmoid.rms_normalize_heads, heads,
         lambda x: head_rms_norm(x, qw.double(), **rms64, kernel=False)),
        ("rms QK-norm: torch rms_norm (fp32) x weights", lambda x: head_rms_norm(x, qw, **rms, kernel=False), heads,
         lambda x: head_rms_norm(x, qw.double(), **rms64, kernel=False)),
        # the model's QK-norm with RoPE as split_heads computes it (one kernel each way) against the norm
        # and then the RoPE module's elementwise ops
        ("l2 QK-norm + RoPE: the model's (one Triton kernel)",
         lambda x: head_norm_rope(x, *tables, **l2, out_dtype=x.dtype), heads,
         lambda x: layer.rope(F.normalize(x, dim=-1), 0)),
        ("l2 QK-norm + RoPE: norm kernel, then RoPE's ops",
         lambda x: layer.rope(_qk_normalize(x, "l2"), 0).to(x.dtype), heads,
         lambda x: layer.rope(F.normalize(x, dim=-1), 0)),
        ("rms QK-norm + RoPE: the model's (one Triton kernel)",
         lambda x: head_norm_rope(x, *tables, qw, **dict(rms, out_dtype=x.dtype)), heads,
         lambda x: layer.rope(head_rms_norm(x, qw.double(), **rms64, kernel=False), 0)),
        ("rms QK-norm + RoPE: norm kernel, then RoPE's ops",
         lambda x: layer.rope(sigmoid.rms_normalize_heads(x), 0).to(x.dtype), heads,
         lambda x: layer.rope(head_rms_norm(x, qw.double(), **rms64, kernel=False), 0)),
        ("output norm: the model's (Triton head norm)", layer.normalize_output, outs,
         lambda y: F.rms_norm(y, (d,), norm.weight.double(), norm.eps)),
        ("output norm: torch rms_norm (fused, heads' dtype)",
         lambda y: head_rms_norm(y, norm.weight.to(y.dtype), eps=norm.eps, kernel=False), outs,
         lambda y: F.rms_norm(y, (d,), norm.weight.double(), norm.eps)),
        ("output norm: through an fp32 copy", lambda y: norm(y.float()).to(y.dtype), outs,
         lambda y: F.rms_norm(y, (d,), norm.weight.double(), norm.eps)),
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
