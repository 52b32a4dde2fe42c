"""Does Triton's Hopper warp specialization pay on this GPU? A minimal attention forward (plain softmax,
not causal, TMA descriptor loads; the loop of Triton's own tutorial) with and without
`tl.range(..., warp_specialize=True)`, over a few tiles, against SDPA, in one process. Prints a table
and writes --out (JSON); the output of every config is checked against SDPA's.

    python3 scripts/bench/probe_warp_specialize.py --out gpu_out/probe_ws.json
    python3 scripts/bench/probe_warp_specialize.py --dry-run        # CPU: the interpreter, tiny shape, fp32, no timing
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # --dry-run on a CPU: Triton's interpreter, set before Triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from timing import attention_flops, median_ms, tflops  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages): Triton 3.6 warp-specializes this loop on sm_90 only with 4 warps
CONFIGS = [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)]


@triton.jit
def _probe_fwd(Q, K, V, O, N, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
               WS: tl.constexpr):
    """Rows [m0, m0 + BLOCK_M) of one (batch*head) of contiguous (BH, N, D) tensors."""
    pid = tl.program_id(0)
    rows = tl.num_programs(1) * N
    qd = tl.make_tensor_descriptor(Q, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    kd = tl.make_tensor_descriptor(K, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    vd = tl.make_tensor_descriptor(V, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    od = tl.make_tensor_descriptor(O, shape=[rows, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    base = tl.program_id(1) * N
    q = qd.load([base + pid * BLOCK_M, 0])
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, N, BLOCK_N, warp_specialize=WS):
        k = kd.load([base + start, 0])
        v = vd.load([base + start, 0])
        s = tl.dot(q, k.T) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    od.store([base + pid * BLOCK_M, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))


def probe(shape, configs, time_it: bool) -> list[dict]:
    """One row per (warp specialization, config): its error against SDPA's output and, time_it, its
    time; the first row is SDPA's."""
    b, h, n, d = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter mishandles bf16
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b * h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    out = torch.empty_like(q)
    qk_scale = d ** -0.5 * 1.4426950408889634

    def sdpa():
        return F.scaled_dot_product_attention(q.view(b, h, n, d), k.view(b, h, n, d), v.view(b, h, n, d))

    ref = sdpa().view(b * h, n, d)
    rows = [{"name": "sdpa", **({"ms": median_ms(sdpa, warmup=50, rep=300)} if time_it else {})}]
    for ws in (False, True):
        for bm, bn, warps, stages in configs:
            name = f"{'ws' if ws else 'plain'} {bm}x{bn} w{warps} s{stages}"
            grid = (triton.cdiv(n, bm), b * h)

            def call():
                _probe_fwd[grid](q, k, v, out, n, qk_scale, BLOCK_M=bm, BLOCK_N=bn, D=d, WS=ws, num_warps=warps,
                                 num_stages=stages)
            try:
                out.fill_(float("nan"))
                call()
                row = {"name": name, "max_abs_err_vs_sdpa": (out.float() - ref.float()).abs().max().item()}
                if time_it:
                    row["ms"] = median_ms(call, warmup=50, rep=300)
                rows.append(row)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is a result too
                rows.append({"name": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    flop = attention_flops(b, h, n, d, causal=False)
    for r in rows:
        if "ms" in r:
            r["tflops"] = tflops(flop, r["ms"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,16,4096,128", help="B,H,N,D")
    ap.add_argument("--out", default="gpu_out/probe_warp_specialize.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape, two configs, errors only (CPU)")
    args = ap.parse_args(argv)
    shape = (1, 2, 256, 16) if args.dry_run else tuple(map(int, args.shape.split(",")))
    rows = probe(shape, CONFIGS[:1] if args.dry_run else CONFIGS, time_it=not args.dry_run)
    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "shape": list(shape)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(meta)
    for r in rows:
        text = r.get("error") or " ".join(filter(None, [
            f"{r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s" if "ms" in r else "",
            f"err {r['max_abs_err_vs_sdpa']:.1e}" if "max_abs_err_vs_sdpa" in r else ""]))
        print(f"{r['name']:28} {text}")
    return rows


if __name__ == "__main__":
    main()
