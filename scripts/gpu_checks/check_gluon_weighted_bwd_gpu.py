"""One GPU call for the Gluon sm_90 threshold and sigmoid backwards (attn/kernels/gluon_weighted_bwd.py): checks,
then times.

1. Correctness against float64, DESIGN.md section 6's rule (attn.testing.error_ratio: err(kernel) <= 2
   err(PyTorch in the same dtype) + floor) for dq, dk, dv, the PyTorch results from the reference
   (`attn.attention(..., backend="reference")`), on odd lengths, causal and not, KV > N, GQA, D 64 / 128,
   bf16 / fp16, threshold at p = 1, 2, 1.5 on unit-norm q and k, sigmoid with the -ln n_i bias and a fixed
   one, after filling the caching allocator's free blocks with NaN (an unwritten element shows).
   (tests/test_gluon_weighted_bwd_gpu.py holds more cases, with torch.empty poisoned.)
2. Timing, backward only (triton.testing.do_bench median ms; TFLOP/s of 2.5x the forward's useful FLOPs,
   halved when causal): SDPA's backward (plain softmax, the speed users know: torch.autograd.grad through
   scaled_dot_product_attention, the graph kept), and per variant the portable backward (the family's
   `_backward_impl` with ATTNLAB_GLUON=0, which its plans would otherwise hand to the Gluon tier; its tuning
   done before the timing) and the Gluon backward (`launch_*_backward`; for the threshold and sigmoid also its
   one-pass form, dQ in the key-block kernel, `one_pass=True`), at
   SHAPES (B, H, N, D, causal), bf16; also the differential threshold's (diff_threshold: both views' six
   gradients, per-head lambdas) portable backward against the Gluon one (attn/kernels/gluon_diff_bwd.py, whose
   correctness is tests/test_gluon_diff_bwd_gpu.py's), in each of its key-block forms (`dkdv_form`: key halves
   per warpgroup, the default; view warpgroups, a warpgroup per score view; view exchange, the view warpgroups
   with dP^T and dV computed once), the key halves on the persistent grids (`persistent=True`), at D = 64
   the fused form on 32-row query blocks (`fused_query_rows=32`; FUSED_QUERY_ROWS is 64), and the query-block
   kernel's view-warpgroup form (`dq_form="view_warpgroups"`) after the key halves and after the view warpgroups,
   and the view warpgroups' one-pass form (`one_pass=True`: dQ and dQ2 in the key-block kernel, no query-block
   kernel) against the view warpgroups with the query-block kernel's view-warpgroup form.

Prints both tables and writes <out>/gluon_weighted_bwd.json. Exits 1 if a correctness case fails (a case whose
compile or launch raises counts as failed and is reported; the rest still run), 0 otherwise.

    python scripts/gpu_checks/check_gluon_weighted_bwd_gpu.py --out $OUT [--no-checks] [--shapes 4,16,4096,128,1]
        [--columns sdpa "diff_threshold gluon views" "diff_threshold gluon views + dq views"]   # only these timed
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks' timing harness

from timing import attention_flops, median_ms, result_header, tflops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gluon_softmax_gpu import checked_row, poison_allocator, with_gluon  # noqa: E402

# (variant, spec parameters, (B, N, KV, H, H_kv, D, causal, dtype))
CASES = [
    ("threshold", {}, (1, 1, 1, 2, 2, 64, True, "bf16")),
    ("threshold", {"power": 1.0}, (2, 17, 17, 4, 2, 128, False, "fp16")),
    ("threshold", {"power": 1.5, "beta": 0.5}, (1, 127, 127, 4, 1, 128, True, "bf16")),
    ("threshold", {}, (1, 100, 300, 4, 4, 128, True, "bf16")),
    ("threshold", {"power": 1.0}, (2, 1000, 1000, 4, 2, 64, True, "bf16")),
    ("sigmoid", {}, (1, 1, 1, 2, 2, 64, True, "bf16")),
    ("sigmoid", {}, (2, 200, 200, 2, 2, 64, False, "bf16")),
    ("sigmoid", {"bias": -2.0}, (1, 100, 300, 4, 4, 128, True, "fp16")),
    ("sigmoid", {}, (2, 1000, 1000, 4, 2, 128, True, "bf16")),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(4, 16, 4096, 128, True)]
# p = 2 and the -ln n_i bias: the families' defaults
TIMED = [("threshold", {}), ("sigmoid", {}), ("diff_threshold", {})]
# the differential backward's key-block forms: key halves per warpgroup (the default), a warpgroup per view, a
# warpgroup per view with dP^T and dV computed once; the key halves on the persistent grids, and (D = 64)
# with the fused form on 32-row query blocks; the query-block kernel's view-warpgroup form after the key halves
# and after the view warpgroups
COLUMNS = (["sdpa"] + [f"{v} {tier}" for v, _ in TIMED for tier in ("portable", "gluon")]
           + ["threshold gluon one pass", "sigmoid gluon one pass"]
           + ["diff_threshold gluon views", "diff_threshold gluon exchange", "diff_threshold gluon persistent",
              "diff_threshold gluon fused 32 rows", "diff_threshold gluon dq views",
              "diff_threshold gluon views + dq views", "diff_threshold gluon views one pass"])
# each differential column against the one it changes one thing of
DIFF_BASES = {"views": "", "exchange": "", "persistent": "", "fused 32 rows": "", "dq views": "",
              "views + dq views": " views", "views one pass": " views + dq views"}


def _spec(variant, params):
    import attn

    return attn.get_variant(variant).make_spec(**params)


def reference_grads(variant, params, q, k, v, do, causal):
    """(dq, dk, dv) of the reference in q's dtype arithmetic (dense, by autograd)."""
    import attn

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attn.attention(q, k, v, _spec(variant, params), causal=causal, backend="reference")
    return torch.autograd.grad(out, (q, k, v), do)


def gluon_backward(variant, params, q, k, v, do, causal):
    from attn.kernels.gluon_weighted_bwd import gluon_sigmoid_backward, gluon_threshold_backward

    spec = _spec(variant, params)
    if variant == "threshold":
        return gluon_threshold_backward(q, k, v, do, causal, float(spec.beta), float(spec.power))
    return gluon_sigmoid_backward(q, k, v, do, causal, float(spec.scale(q.shape[-1])), spec.bias)


def check_case(case, error_ratio):
    variant, params, (bsz, n, kv_len, h, h_kv, d, causal, dt) = case
    dtype = DTYPES[dt]
    g = torch.Generator(device="cuda").manual_seed(3000 + CASES.index(case))
    q64 = torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g)
    k64 = torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)
    v64 = torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)
    do64 = torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g)
    if variant == "threshold":  # cosine scores: thresholds that leave dense and empty rows
        q64, k64 = q64 / q64.norm(dim=-1, keepdim=True), k64 / k64.norm(dim=-1, keepdim=True)
    ref = reference_grads(variant, params, q64, k64, v64, do64, causal)
    q, k, v, do = (x.to(dtype) for x in (q64, k64, v64, do64))
    same = reference_grads(variant, params, q, k, v, do, causal)
    poison_allocator(q.device)
    got = gluon_backward(variant, params, q, k, v, do, causal)
    torch.cuda.synchronize()
    row = {}
    for name, fused, torch_same, ref64 in zip(("dq", "dk", "dv"), got, same, ref):
        floor = 1e-3 * max(1.0, ref64.abs().max().item())
        row[f"ratio_{name}"] = error_ratio(fused.double(), torch_same.double(), ref64, floor=floor)
    return row


def time_shapes(results, shapes=SHAPES, columns=COLUMNS):
    import torch.nn.functional as F

    from attn.kernels import sigmoid_family, threshold_family
    from attn.kernels.gluon_diff_bwd import launch_diff_threshold_backward
    from attn.kernels.gluon_weighted_bwd import launch_sigmoid_backward, launch_threshold_backward

    rows = []
    for b, h, n, d, causal in shapes:
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        qn, kn = (torch.nn.functional.normalize(x.float(), dim=-1).to(torch.bfloat16) for x in (q, k))
        q2n, k2n = (torch.nn.functional.normalize(torch.randn(b, n, h, d, device="cuda"), dim=-1).to(torch.bfloat16)
                    for _ in range(2))
        lam = torch.linspace(-0.5, 1.2, h, device="cuda")
        qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        out_s = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=d ** -0.5)
        do_s = do.transpose(1, 2).contiguous()
        impls = {"sdpa": lambda: torch.autograd.grad(out_s, (qs, ks, vs), do_s, retain_graph=True)}
        for variant, params in TIMED:
            spec = _spec(variant, params)
            if variant == "threshold":
                beta, power = float(spec.beta), float(spec.power)
                impls["threshold portable"] = (lambda: with_gluon("0", lambda: threshold_family._backward_impl(
                    do, qn, kn, v, None, None, None, None, beta, power, causal, 0)))
                impls["threshold gluon"] = lambda: launch_threshold_backward(qn, kn, v, do, causal, beta, power)
                impls["threshold gluon one pass"] = lambda: launch_threshold_backward(qn, kn, v, do, causal, beta,
                                                                                      power, one_pass=True)
            elif variant == "diff_threshold":
                diff_beta, diff_power = float(spec.beta), float(spec.power)
                impls["diff_threshold portable"] = (lambda: with_gluon("0", lambda: threshold_family._backward_impl(
                    do, qn, kn, v, q2n, k2n, lam, None, diff_beta, diff_power, causal, 0)))
                impls["diff_threshold gluon"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power))
                impls["diff_threshold gluon views"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, dkdv_form="view_warpgroups"))
                impls["diff_threshold gluon exchange"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, dkdv_form="view_exchange"))
                impls["diff_threshold gluon persistent"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, persistent=True))
                impls["diff_threshold gluon dq views"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, dq_form="view_warpgroups"))
                impls["diff_threshold gluon views + dq views"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, dkdv_form="view_warpgroups",
                    dq_form="view_warpgroups"))
                impls["diff_threshold gluon views one pass"] = (lambda: launch_diff_threshold_backward(
                    qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, dkdv_form="view_warpgroups",
                    one_pass=True))
                if d == 64:  # the fused key-block form (D = 64 only) on 32-row query blocks
                    impls["diff_threshold gluon fused 32 rows"] = (lambda: launch_diff_threshold_backward(
                        qn, kn, v, q2n, k2n, lam, do, causal, diff_beta, diff_power, fused_query_rows=32))
            else:
                sm_scale, bias = float(spec.scale(d)), spec.bias
                impls["sigmoid portable"] = (lambda: with_gluon("0", lambda: sigmoid_family._backward_impl(
                    do, q, k, v, None, bias, sm_scale, causal, 0)))
                impls["sigmoid gluon"] = lambda: launch_sigmoid_backward(q, k, v, do, causal, sm_scale, bias)
                impls["sigmoid gluon one pass"] = lambda: launch_sigmoid_backward(q, k, v, do, causal, sm_scale, bias,
                                                                                  one_pass=True)
        flops = 2.5 * attention_flops(b, h, n, d, causal)
        row = {"shape": [b, h, n, d, causal]}
        for name, fn in [(name, fn) for name, fn in impls.items() if name in columns]:
            try:
                fn()  # compiles and tunes outside the timing
                ms = median_ms(fn, warmup=10, rep=50)
                row[name] = {"ms": ms, "tflops": tflops(flops, ms)}
            except Exception:
                row[name] = {"error": traceback.format_exc(limit=3)}
        rows.append(row)
        cells = "".join(f"{row[k]['ms']:>22.3f}{row[k]['tflops']:>6.0f}" if "ms" in row.get(k, {})
                        else f"{'error' if k in row else '-':>28}" for k in columns)
        timed = {name: cell["ms"] for name, cell in row.items() if isinstance(cell, dict) and "ms" in cell}
        speedups = "  ".join(
            f"{variant} gluon vs portable {timed[f'{variant} portable'] / timed[f'{variant} gluon']:.2f}x"
            for variant, _ in TIMED if f"{variant} portable" in timed and f"{variant} gluon" in timed)
        for variant in ("threshold", "sigmoid"):
            if f"{variant} gluon" in timed and f"{variant} gluon one pass" in timed:
                speedups += (f"  {variant} one pass vs separate "
                             f"{timed[f'{variant} gluon'] / timed[f'{variant} gluon one pass']:.2f}x")
        for form, base in DIFF_BASES.items():
            base_cell = row.get(f"diff_threshold gluon{base}", {})
            form_cell = row.get(f"diff_threshold gluon {form}", {})
            if "ms" in base_cell and "ms" in form_cell:
                speedups += (f"  diff_threshold {form} vs {base.strip() or 'key halves'} "
                             f"{base_cell['ms'] / form_cell['ms']:.2f}x")
        print(f"{str((b, h, n, d, 'causal' if causal else 'full')):<28}{cells}   {speedups}")
        for name, cell in row.items():
            if isinstance(cell, dict) and "error" in cell:
                print(f"{name}: {cell['error']}")
        impls.clear()  # the SDPA graph and its tensors go before the next shape's
    results["timing"] = rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gluon_weighted_bwd.json")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-checks", action="store_true", help="time only (the tests hold the correctness cases)")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="B,H,N,D[,causal] per shape, bf16 (default: (4,16,4096,128) causal)")
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), metavar="COLUMN",
                    help="time only these columns (each compiles and tunes its kernels; default all of COLUMNS)")
    args = ap.parse_args()
    unknown = sorted(set(args.columns) - set(COLUMNS))
    if unknown:
        ap.error(f"--columns: unknown {unknown}; the columns are {list(COLUMNS)}")
    shapes = SHAPES if args.shapes is None else [
        (*map(int, x.split(",")[:4]), bool(int(x.split(",")[4])) if len(x.split(",")) > 4 else True)
        for x in args.shapes]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {**result_header(), "capability": torch.cuda.get_device_capability(), "cases": []}
    dump = lambda: (args.out / "gluon_weighted_bwd.json").write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    from attn.kernels.tiers import gluon_usable

    if not gluon_usable(torch.device("cuda")):
        results["skipped"] = "not an sm_90 GPU with Triton's Gluon Hopper API"
        print(f"skipped: {results['skipped']}")
        dump()
        return 0
    from attn.testing import error_ratio

    failed = 0
    print(f"{'variant, params, (B,N,KV,H,Hkv,D,causal,dtype)':<72}{'ratio dq':>10}{'ratio dk':>10}{'ratio dv':>10}"
          "  status")
    for case in ([] if args.no_checks else CASES):
        row = {"case": [case[0], case[1], list(case[2])]}
        ok = checked_row(row, lambda: check_case(case, error_ratio), ("dq", "dk", "dv"))
        failed += not ok
        results["cases"].append(row)
        ratios = "".join(f"{row.get(f'ratio_{name}', float('nan')):>10.3f}" for name in ("dq", "dk", "dv"))
        print(f"{f'{case[0]} {case[1]} {case[2]}':<72}{ratios}  {'ok' if ok else 'FAIL'}")
        if "error" in row:
            print(row["error"])
    dump()
    if not args.no_timing:
        columns = [name for name in COLUMNS if name in args.columns]
        print(f"\n{'(B,H,N,D,mask) bf16, bwd':<28}" + "".join(f"{name + ' ms':>22}{'TF/s':>6}" for name in columns))
        time_shapes(results, shapes, columns)
        dump()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
