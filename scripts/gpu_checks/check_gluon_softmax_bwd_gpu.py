"""One GPU call for the Gluon sm_90 softmax backward (attn/kernels/gluon_softmax_bwd.py): checks, then times.

1. Correctness against float64, DESIGN.md section 6's rule (attn.testing.error_ratio: err(kernel) <= 2
   err(PyTorch in the same dtype) + floor) for dq, dk, dv from the portable forward's out and lse2, on odd
   lengths, causal and not, KV > N and KV < N, GQA, D 64 / 128, bf16 / fp16, after filling the caching
   allocator's free blocks with NaN (an unwritten element shows); then CAPPED_CASES: every cap (binding) and
   temperatures of every sign with d-temperature, against attn.attention's float64 reference (KV >= N, as
   the public function takes them). Then ONE_PASS_CASES and ONE_PASS_CAPPED_CASES (entries of both lists) again
   with ATTNLAB_GLUON_DQ=one_pass: dq from the key-block kernel's TMA reduce-adds (d-temperature stays on
   the separate form). (tests/test_gluon_bwd_gpu.py holds the same checks with torch.empty poisoned, and with
   the Gluon forward's out and lse2.)
2. Timing, backward only (triton.testing.do_bench median ms; TFLOP/s of 2.5x the forward's useful FLOPs,
   halved when causal) at SHAPE (B, H, N, D, causal), bf16, one row per TIMED variant (plain softmax, the
   three caps, ALSC with a temperature and its gradient): SDPA's plain softmax backward (torch.autograd.grad
   through scaled_dot_product_attention, the graph kept; the same number on every row, the speed users
   know), the portable backward (softmax_family._bwd_impl with ATTNLAB_GLUON=0, on its first tile configs
   unless --tune-portable, which tunes each variant's kernels before the timing: a dozen compiles each) and
   the Gluon backward (`launch_backward`, or `launch_backward_with_dt`: delta, dK / dV, dQ). The rows named
   "... one-pass" time the Gluon backward with ATTNLAB_GLUON_DQ=one_pass (delta zeroing the fp32 dq, dK / dV
   with dQ's reduce-adds, the scale-and-cast; the portable column is not re-timed) and print the separate
   form's time over theirs.

Prints both tables and writes <out>/gluon_softmax_bwd.json. Exits 1 if a correctness case fails (a case whose
compile or launch raises counts as failed and is reported; the rest still run), 0 otherwise.

    python scripts/gpu_checks/check_gluon_softmax_bwd_gpu.py --out $OUT [--tune-portable] [--no-timing]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks' timing harness

from timing import attention_flops, median_ms, result_header, tflops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gluon_softmax_gpu import checked_row, poison_allocator  # noqa: E402

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
# (variant, spec params, temperature, need_dt, (B, N, KV, H, H_kv, D, causal, dtype)): binding caps, KV >= N
CAPPED_CASES = [
    ("softcap_tanh", {"cap": 2.0}, False, False, (2, 127, 127, 4, 1, 128, True, "bf16")),
    ("softcap_softsign", {"cap": 2.0}, False, False, (1, 200, 300, 4, 2, 64, False, "fp16")),
    ("alsc", {"cap": 3.0, "knee": 0.5}, False, False, (1, 1000, 1000, 4, 2, 128, True, "bf16")),
    ("softmax", {}, True, True, (2, 333, 333, 8, 2, 64, True, "fp16")),
    ("softcap_tanh", {"cap": 2.0}, True, True, (1, 100, 300, 4, 4, 128, True, "bf16")),
    ("alsc", {"cap": 3.0, "knee": 0.5}, True, True, (1, 1000, 1000, 4, 4, 64, True, "bf16")),
]
# the one-pass dQ form (ATTNLAB_GLUON_DQ=one_pass) on: odd N, KV > N and KV < N, GQA, causal and full, D 64 / 128
ONE_PASS_CASES = [CASES[i] for i in (1, 2, 4, 5, 6, 7)]
ONE_PASS_CAPPED_CASES = [CAPPED_CASES[i] for i in (0, 1, 2, 4)]  # the last with dt: the separate form
SHAPE = (4, 16, 4096, 128, True)
# (row name, variant, spec params, temperature, need_dt, ATTNLAB_GLUON_DQ) timed at SHAPE
TIMED = [("softmax", "softmax", {}, False, False, "separate"),
         ("softmax one-pass", "softmax", {}, False, False, "one_pass"),
         ("tanh c=30", "softcap_tanh", {"cap": 30.0}, False, False, "separate"),
         ("tanh c=30 one-pass", "softcap_tanh", {"cap": 30.0}, False, False, "one_pass"),
         ("soft_sign c=30", "softcap_softsign", {"cap": 30.0}, False, False, "separate"),
         ("alsc c=30", "alsc", {"cap": 30.0, "knee": 0.5}, False, False, "separate"),
         ("alsc c=30 +t, dt", "alsc", {"cap": 30.0, "knee": 0.5}, True, True, "separate")]
DQ_FORM_ENV = "ATTNLAB_GLUON_DQ"  # gluon_softmax_bwd.DQ_FORM_ENV


class dq_form:
    """ATTNLAB_GLUON_DQ set to `form` inside the block (the launchers read it per call)."""

    def __init__(self, form: str):
        self.form, self.saved = form, None

    def __enter__(self):
        self.saved = os.environ.get(DQ_FORM_ENV)
        os.environ[DQ_FORM_ENV] = self.form

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop(DQ_FORM_ENV, None)
        else:
            os.environ[DQ_FORM_ENV] = self.saved


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


def portable_forward(q, k, v, sm_scale, causal, temperature=None, cap=0, cap_value=0.0, knee=0.0):
    """(out, lse2) of the portable forward (ATTNLAB_GLUON=0 for the call)."""
    from attn.kernels import softmax_family

    old = os.environ.get("ATTNLAB_GLUON")
    os.environ["ATTNLAB_GLUON"] = "0"
    try:
        return softmax_family._fwd_impl(q, k, v, None, temperature, cap, cap_value, knee, sm_scale, causal, 0)
    finally:
        if old is None:
            os.environ.pop("ATTNLAB_GLUON")
        else:
            os.environ["ATTNLAB_GLUON"] = old


def logits(spec, head_dim):
    """(cap, cap_value, knee, sm_scale) of a softmax-family spec, as fused_attention passes them."""
    from attn.kernels.softmax_family import CAP_IDS

    return CAP_IDS[spec.cap], float(spec.cap_value), float(spec.knee), float(spec.scale(head_dim))


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


def check_capped_case(entry, error_ratio):
    """Ratios of dq, dk, dv (and dt) for one CAPPED_CASES entry, after the portable forward."""
    import attn
    from attn.kernels.gluon_softmax_bwd import gluon_softmax_backward, gluon_softmax_backward_with_dt

    variant, params, with_temperature, need_dt, case = entry
    bsz, n, kv_len, h, h_kv, d, causal, dt = case
    dtype = DTYPES[dt]
    spec = attn.get_variant(variant).make_spec(**params)
    g = torch.Generator(device="cuda").manual_seed(3000 + CAPPED_CASES.index(entry))
    x64 = {"q": torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g),
           "k": torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g),
           "v": torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)}
    do64 = torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g)
    t64 = None
    if with_temperature:  # every sign, zero included
        t64 = torch.rand(bsz, n, device="cuda", dtype=torch.float64, generator=g) * 2.5 - 0.5
        t64[:, ::7] = 0.0

    def reference_grads(to_dtype, t_dtype):
        leaves = {name: x.to(to_dtype).requires_grad_() for name, x in x64.items()}
        t = None if t64 is None else t64.to(t_dtype).requires_grad_(need_dt)
        out = attn.attention(**leaves, spec=spec, causal=causal, temperature=t, backend="reference")
        wrt = list(leaves.values()) + ([t] if need_dt else [])
        return torch.autograd.grad(out, wrt, do64.to(out.dtype))

    ref = reference_grads(torch.float64, torch.float64)
    same = reference_grads(dtype, torch.float32)
    q, k, v, do = (x.to(dtype) for x in (x64["q"], x64["k"], x64["v"], do64))
    temperature = None if t64 is None else t64.float()
    cap, cap_value, knee, sm_scale = logits(spec, d)
    out, lse2 = portable_forward(q, k, v, sm_scale, causal, temperature, cap, cap_value, knee)
    poison_allocator(q.device)
    caps = dict(cap=cap, cap_value=cap_value, knee=knee)
    if need_dt:
        got = gluon_softmax_backward_with_dt(q, k, v, out, do, lse2, sm_scale, causal, temperature=temperature, **caps)
    else:
        got = gluon_softmax_backward(q, k, v, out, do, lse2, sm_scale, causal, temperature=temperature, **caps)
    torch.cuda.synchronize()
    row = {}
    for name, fused, torch_same, ref64 in zip(("dq", "dk", "dv", "dt"), got, same, ref):
        floor = 1e-3 * max(1.0, ref64.abs().max().item())
        row[f"ratio_{name}"] = error_ratio(fused.double(), torch_same.double(), ref64, floor=floor)
    return row


def time_variants(results, tune_portable: bool):
    """One row per TIMED variant at SHAPE: SDPA's plain backward, the portable and the Gluon backward."""
    import attn
    import torch.nn.functional as F

    from attn.kernels import softmax_family
    from attn.kernels.gluon_softmax_bwd import launch_backward, launch_backward_with_dt

    b, h, n, d, causal = SHAPE
    flops = 2.5 * attention_flops(b, h, n, d, causal)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    # SDPA on its own (B, H, N, D) tensors, the graph kept for repeated backwards
    qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    out_s = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=d ** -0.5)
    do_s = do.transpose(1, 2).contiguous()
    sdpa = lambda: torch.autograd.grad(out_s, (qs, ks, vs), do_s, retain_graph=True)  # noqa: E731
    sdpa()
    sdpa_ms = median_ms(sdpa)
    del out_s, qs, ks, vs, do_s, sdpa
    temperature = torch.rand(b, n, device="cuda") * 2.5 - 0.5
    settings = {"ATTNLAB_GLUON": "0", **({} if tune_portable else {"ATTNLAB_AUTOTUNE": "0"})}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    rows = []
    try:
        separate_ms = {}
        for row_name, variant, params, with_temperature, need_dt, form in TIMED:
            spec = attn.get_variant(variant).make_spec(**params)
            cap, cap_value, knee, sm_scale = logits(spec, d)
            t = temperature if with_temperature else None
            out, lse2 = portable_forward(q, k, v, sm_scale, causal, t, cap, cap_value, knee)
            caps = dict(cap=cap, cap_value=cap_value, knee=knee, temperature=t)

            def portable():
                return softmax_family._bwd_impl(do, q, k, v, out, lse2, None, t, need_dt, cap, cap_value, knee,
                                                sm_scale, causal, 0)

            def gluon():
                if need_dt:
                    return launch_backward_with_dt(q, k, v, out, do, lse2, sm_scale, causal, **caps)
                return launch_backward(q, k, v, out, do, lse2, sm_scale, causal, **caps)

            row = {"variant": row_name, "shape": list(SHAPE), "dq_form": form,
                   "sdpa": {"ms": sdpa_ms, "tflops": tflops(flops, sdpa_ms)}}
            timed_fns = (("portable", portable), ("gluon", gluon)) if form == "separate" else (("gluon", gluon),)
            if form != "separate":
                row["portable"] = {"skipped": "timed on the separate row"}
            for name, fn in timed_fns:
                try:
                    with dq_form(form):
                        fn()  # compiles (and tunes) outside the timing
                        ms = median_ms(fn)
                    row[name] = {"ms": ms, "tflops": tflops(flops, ms)}
                except Exception:
                    row[name] = {"error": traceback.format_exc(limit=3)}
            if "ms" in row["gluon"]:
                if form == "separate":
                    separate_ms[variant] = row["gluon"]["ms"]
                elif variant in separate_ms:
                    row["separate_over_one_pass"] = separate_ms[variant] / row["gluon"]["ms"]
            rows.append(row)
            cells = "".join(f"{row[key]['ms']:>10.3f}{row[key]['tflops']:>8.0f}" if "ms" in row[key]
                            else f"{'-' if 'skipped' in row[key] else 'error':>18}"
                            for key in ("sdpa", "portable", "gluon"))
            timed = "ms" in row["gluon"]
            ratios = "".join(f"{row[key]['ms'] / row['gluon']['ms']:>12.2f}x" if timed and "ms" in row[key]
                             else f"{'-':>13}" for key in ("sdpa", "portable"))
            one_pass = (f"   separate/one-pass {row['separate_over_one_pass']:.2f}x"
                        if "separate_over_one_pass" in row else "")
            print(f"{row_name:<20}{cells}{ratios}{one_pass}")
            for key in ("portable", "gluon"):
                if "error" in row[key]:
                    print(row[key]["error"])
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    results["timing"] = {"portable_tuned": tune_portable, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gluon_softmax_bwd.json")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--one-pass-only", action="store_true",
                    help="check only the one-pass cases (ONE_PASS_CASES, ONE_PASS_CAPPED_CASES) before the timing")
    ap.add_argument("--tune-portable", action="store_true",
                    help="tune the portable backward's tiles per variant before timing it (slow: compiles)")
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
    for case in () if args.one_pass_only else CASES:
        row = {"case": list(case)}
        ok = checked_row(row, lambda: check_case(case, error_ratio), ("dq", "dk", "dv"))
        failed += not ok
        results["cases"].append(row)
        ratios = "".join(f"{row.get(f'ratio_{name}', float('nan')):>10.3f}" for name in ("dq", "dk", "dv"))
        print(f"{str(case):<44}{ratios}  {'ok' if ok else 'FAIL'}")
        if "error" in row:
            print(row["error"])
    results["capped_cases"] = []
    print(f"\n{'variant, params, t, dt, case':<90}{'dq':>8}{'dk':>8}{'dv':>8}{'dt':>8}  status")
    for entry in () if args.one_pass_only else CAPPED_CASES:
        variant, params, with_temperature, need_dt, case = entry
        row = {"variant": variant, "params": params, "temperature": with_temperature, "need_dt": need_dt,
               "case": list(case)}
        names = ("dq", "dk", "dv") + (("dt",) if need_dt else ())
        ok = checked_row(row, lambda: check_capped_case(entry, error_ratio), names)
        failed += not ok
        results["capped_cases"].append(row)
        ratios = "".join(f"{row.get(f'ratio_{name}', float('nan')):>8.3f}" for name in ("dq", "dk", "dv", "dt"))
        label = f"{variant} {params} {'t' if with_temperature else '-'} {'dt' if need_dt else '-'} {case}"
        print(f"{label:<90}{ratios}  {'ok' if ok else 'FAIL'}")
        if "error" in row:
            print(row["error"])
    results["one_pass_cases"] = []
    print(f"\n{DQ_FORM_ENV}=one_pass")
    for kind, entries in (("plain", ONE_PASS_CASES), ("capped", ONE_PASS_CAPPED_CASES)):
        for entry in entries:
            row = {"kind": kind, "entry": list(entry) if kind == "plain" else [*entry[:4], list(entry[4])]}
            names = ("dq", "dk", "dv") + (("dt",) if kind == "capped" and entry[3] else ())
            def check(entry=entry, kind=kind):
                with dq_form("one_pass"):
                    return check_case(entry, error_ratio) if kind == "plain" else check_capped_case(entry, error_ratio)

            ok = checked_row(row, check, names)
            failed += not ok
            results["one_pass_cases"].append(row)
            ratios = "".join(f"{row.get(f'ratio_{name}', float('nan')):>8.3f}" for name in ("dq", "dk", "dv", "dt"))
            print(f"{str(entry):<90}{ratios}  {'ok' if ok else 'FAIL'}")
            if "error" in row:
                print(row["error"])
    dump()
    if not args.no_timing:
        b, h, n, d, causal = SHAPE
        mask = "causal" if causal else "full"
        print(f"\n{f'({b},{h},{n},{d}) {mask} bf16':<20}"
              + "".join(f"{name + ' ms':>10}{'TF/s':>8}" for name in ("sdpa", "portable", "gluon"))
              + f"{'sdpa/gluon':>13}{'portable/gl':>13}")
        time_variants(results, args.tune_portable)
        dump()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
