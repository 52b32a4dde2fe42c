"""One GPU call for the Gluon sm_90 softmax backward (attn/kernels/gluon_softmax_bwd.py): checks, then times.

1. Correctness against float64, DESIGN.md section 6's rule (attn.testing.error_ratio: err(kernel) <= 2
   err(PyTorch in the same dtype) + floor) for dq, dk, dv from the portable forward's out and lse2, on odd
   lengths, causal and not, KV > N and KV < N, GQA, D 64 / 128, bf16 / fp16, after filling the caching
   allocator's free blocks with NaN (an unwritten element shows). (tests/test_gluon_bwd_gpu.py holds the
   same checks with torch.empty poisoned, and with the Gluon forward's out and lse2.)
2. Timing, backward only (triton.testing.do_bench median ms; TFLOP/s of 2.5x the forward's useful FLOPs,
   halved when causal): SDPA's backward (torch.autograd.grad through scaled_dot_product_attention, the
   graph kept), the portable backward (softmax_family._bwd_impl as the public function's autograd calls it,
   its tuning done before the timing) and the Gluon backward (`launch_backward`: delta, dK / dV, dQ), at
   SHAPES (B, H, N, D, causal), bf16.

Prints both tables and writes <out>/gluon_softmax_bwd.json. Exits 1 if a correctness case fails (a case whose
compile or launch raises counts as failed and is reported; the rest still run), 0 otherwise.

    python scripts/gpu_checks/check_gluon_softmax_bwd_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks' timing harness

from timing import attention_flops, median_ms, result_header, tflops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gluon_softmax_gpu import poison_allocator  # noqa: E402

# (B, N, KV, H, H_kv, D, causal, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, True, "bf16"),
    (2, 17, 17, 4, 2, 128, False, "fp16"),
    (1, 127, 127, 4, 1, 128, True, "bf16"),
    (2, 200, 200, 2, 2, 64, False, "bf16"),
    (1, 100, 300, 4, 4, 128, True, "bf16"),   # KV > N
    (1, 300, 100, 4, 2, 64, True, "bf16"),    # KV < N: the first 200 rows see no key
    (2, 1000, 1000, 4, 2, 128, True, "bf16"),
    (1, 1000, 1000, 4, 4, 64, True, "fp16"),
    (1, 4096, 4096, 4, 4, 128, True, "bf16"),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(4, 16, 4096, 128, True), (16, 12, 1024, 64, True), (16, 12, 1024, 64, False)]


def reference_grads(q, k, v, do, sm_scale, causal):
    """(dq, dk, dv) of plain softmax attention in q's dtype arithmetic (dense, by autograd)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    h, h_kv = q.shape[2], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * sm_scale
    if causal:
        n, kv_len = q.shape[1], k.shape[1]
        pos = torch.arange(n, device=q.device)[:, None] + (kv_len - n)
        s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > pos, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = (p @ vt).transpose(1, 2)
    return torch.autograd.grad(out, (q, k, v), do)


def portable_forward(q, k, v, sm_scale, causal):
    """(out, lse2) of the portable forward (ATTNLAB_GLUON=0 for the call)."""
    import os

    from attn.kernels import softmax_family

    old = os.environ.get("ATTNLAB_GLUON")
    os.environ["ATTNLAB_GLUON"] = "0"
    try:
        return softmax_family._fwd_impl(q, k, v, None, None, 0, 0.0, 0.0, sm_scale, causal, 0)
    finally:
        if old is None:
            os.environ.pop("ATTNLAB_GLUON")
        else:
            os.environ["ATTNLAB_GLUON"] = old


def check_case(case, error_ratio):
    from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward

    bsz, n, kv_len, h, h_kv, d, causal, dt = case
    dtype = DTYPES[dt]
    g = torch.Generator(device="cuda").manual_seed(2000 + CASES.index(case))
    q64 = torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g)
    k64 = torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)
    v64 = torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)
    do64 = torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g)
    sm_scale = 1.0 / math.sqrt(d)
    ref = reference_grads(q64, k64, v64, do64, sm_scale, causal)
    q, k, v, do = (x.to(dtype) for x in (q64, k64, v64, do64))
    same = reference_grads(q, k, v, do, sm_scale, causal)
    out, lse2 = portable_forward(q, k, v, sm_scale, causal)
    poison_allocator(q.device)
    got = gluon_softmax_backward(q, k, v, out, do, lse2, sm_scale, causal)
    torch.cuda.synchronize()
    row = {}
    for name, fused, torch_same, ref64 in zip(("dq", "dk", "dv"), got, same, ref):
        floor = 1e-3 * max(1.0, ref64.abs().max().item())
        row[f"ratio_{name}"] = error_ratio(fused.double(), torch_same.double(), ref64, floor=floor)
    return row


def time_shapes(results):
    import torch.nn.functional as F

    from attn.kernels import softmax_family
    from attn.kernels.gluon_softmax_bwd import launch_backward

    rows = []
    for b, h, n, d, causal in SHAPES:
        sm_scale = d ** -0.5
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        # SDPA on its own (B, H, N, D) tensors, the graph kept for repeated backwards
        qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        out_s = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=sm_scale)
        do_s = do.transpose(1, 2).contiguous()
        out, lse2 = portable_forward(q, k, v, sm_scale, causal)

        def portable():
            return softmax_family._bwd_impl(do, q, k, v, out, lse2, None, None, False, 0, 0.0, 0.0, sm_scale,
                                            causal, 0)

        impls = {
            "sdpa": lambda: torch.autograd.grad(out_s, (qs, ks, vs), do_s, retain_graph=True),
            "portable": portable,
            "gluon": lambda: launch_backward(q, k, v, out, do, lse2, sm_scale, causal),
        }
        flops = 2.5 * attention_flops(b, h, n, d, causal)
        row = {"shape": [b, h, n, d, causal]}
        for name, fn in impls.items():
            try:
                fn()  # compiles and tunes outside the timing
                ms = median_ms(fn)
                row[name] = {"ms": ms, "tflops": tflops(flops, ms)}
            except Exception:
                row[name] = {"error": traceback.format_exc(limit=3)}
        rows.append(row)
        cells = "".join(f"{row[k]['ms']:>10.3f}{row[k]['tflops']:>8.0f}" if "ms" in row[k] else f"{'error':>18}"
                        for k in impls)
        vs_sdpa = (f"{row['sdpa']['ms'] / row['gluon']['ms']:.2f}x" if "ms" in row["gluon"] and "ms" in row["sdpa"]
                   else "-")
        print(f"{str((b, h, n, d, 'causal' if causal else 'full')):<30}{cells}   gluon vs sdpa {vs_sdpa}")
        impls.clear()  # the SDPA graph and its tensors go before the next shape's
    results["timing"] = rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gluon_softmax_bwd.json")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {**result_header(), "capability": torch.cuda.get_device_capability(), "cases": []}
    dump = lambda: (args.out / "gluon_softmax_bwd.json").write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    from attn.kernels.tiers import gluon_usable

    if not gluon_usable(torch.device("cuda")):
        results["skipped"] = "not an sm_90 GPU with Triton's Gluon Hopper API"
        print(f"skipped: {results['skipped']}")
        dump()
        return 0
    from attn.testing import error_ratio

    failed = 0
    print(f"{'B,N,KV,H,Hkv,D,causal,dtype':<44}{'ratio dq':>10}{'ratio dk':>10}{'ratio dv':>10}  status")
    for case in CASES:
        row = {"case": list(case)}
        t0 = time.perf_counter()
        try:
            row.update(check_case(case, error_ratio))
            ok = all(row[f"ratio_{name}"] <= 1.0 for name in ("dq", "dk", "dv"))
        except Exception:
            row["error"] = traceback.format_exc()
            ok = False
        row["ok"] = ok
        row["s"] = round(time.perf_counter() - t0, 2)
        failed += not ok
        results["cases"].append(row)
        ratios = "".join(f"{row.get(f'ratio_{name}', float('nan')):>10.3f}" for name in ("dq", "dk", "dv"))
        print(f"{str(case):<44}{ratios}  {'ok' if ok else 'FAIL'}")
        if "error" in row:
            print(row["error"])
    dump()
    if not args.no_timing:
        print(f"\n{'(B,H,N,D,mask) bf16, backward':<30}" + "".join(f"{name + ' ms':>10}{'TF/s':>8}"
                                                                   for name in ("sdpa", "portable", "gluon")))
        time_shapes(results)
        dump()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
