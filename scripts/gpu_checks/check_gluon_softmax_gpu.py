"""One GPU call for the Gluon sm_90 softmax forward (attn/kernels/gluon_softmax_fwd.py): checks, then times.

1. Correctness against a float64 PyTorch reference, DESIGN.md section 6's rule (attn.testing.error_ratio:
   err(kernel) <= 2 err(PyTorch in the same dtype) + floor) for out and lse2 (base-2 logsumexp of
   sm_scale q.k), on odd lengths (N = 1, 17, 127, 1000), causal and not, GQA, KV > N, D 64 / 128,
   bf16 / fp16. Outputs are the kernel's own allocations (torch.empty): a row it never wrote is
   caught only if it holds garbage, so each case also runs after filling the caching allocator's
   free blocks with NaN.
2. Timing (triton.testing.do_bench, median ms, TFLOP/s with the causal half) against SDPA and the
   portable Triton kernel (attn.attention backend='triton', variant softmax, ATTNLAB_GLUON=0) and the
   public function as it chooses its tier (ATTNLAB_GLUON=auto) at the SHAPES below, bf16; then every
   softmax-family variant (caps, temperature), threshold and sigmoid through the public function on
   either tier against SDPA, forward and forward + backward (their correctness through the public
   function: tests/test_gluon_gpu.py), the differential threshold included (attn/kernels/gluon_diff_fwd.py,
   gluon_diff_bwd.py); the Gluon forwards also with their two consumer warpgroups in
   ping-pong (ATTNLAB_GLUON_SCHEDULE=pingpong: `gluon_pingpong` columns, forward only).

`--kernel NAME=PATH` (repeatable) adds another version of the kernel file (loaded by its path) to both
steps, beside the current one (A/B of a schedule change in one process).

Prints a table and writes <out>/gluon_softmax.json. Exits 1 if a correctness case fails (a case whose
compile or launch raises counts as failed and is reported; the rest still run), 0 otherwise.

    python scripts/gpu_checks/check_gluon_softmax_gpu.py --out $OUT
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks' timing harness: TFLOP/s

from timing import attention_flops, median_ms, result_header, tflops  # noqa: E402

LOG2E = 1.4426950408889634

# (B, N, KV, H, H_kv, D, causal, dtype)
CASES = [
    (1, 1, 1, 2, 2, 64, False, "bf16"),
    (1, 1, 1, 2, 2, 128, True, "bf16"),
    (2, 17, 17, 4, 4, 64, True, "bf16"),
    (2, 17, 17, 4, 2, 128, False, "fp16"),
    (1, 127, 127, 4, 1, 128, True, "bf16"),
    (2, 127, 127, 2, 2, 64, False, "bf16"),
    (2, 1000, 1000, 4, 2, 128, True, "bf16"),
    (1, 1000, 1000, 4, 4, 64, True, "fp16"),
    (1, 1000, 1000, 4, 4, 128, False, "bf16"),
    (2, 256, 256, 8, 2, 128, True, "fp16"),
    (1, 100, 300, 4, 4, 128, True, "bf16"),   # KV > N: bottom-right causal
    (1, 300, 100, 2, 2, 64, True, "bf16"),    # N > KV: the first 200 rows see no key
    (1, 4096, 4096, 4, 4, 128, True, "bf16"),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(q, k, v, sm_scale, causal):
    """(out (B,N,H,D), lse2 (B,H,N)) in q's dtype arithmetic; rows that see no key: out 0, lse2 +inf."""
    bsz, n, h, d = q.shape
    kv_len, h_kv = k.shape[1], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(h // h_kv, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * sm_scale
    if causal:
        pos = torch.arange(n, device=q.device)[:, None] + (kv_len - n)
        s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > pos, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = (p @ vt).transpose(1, 2)
    lse2 = torch.where(seen, lse * LOG2E, torch.full_like(lse, float("inf")))
    return out, lse2


def poison_allocator(device):
    """Fill free cached blocks with NaN so an unwritten output element shows."""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    try:
        blob = torch.empty(int(min(free * 0.5, 4 << 30)) // 4, device=device, dtype=torch.float32)
        blob.fill_(float("nan"))
        del blob
    except RuntimeError:
        pass


def checked_row(row: dict, check, names) -> bool:
    """Run `check()` (a dict of float64-rule ratios and errors) into `row`: its entries, "ok" (every
    `ratio_<name>` within the rule), "s" (seconds) and, where it raised, "error" (the traceback)."""
    t0 = time.perf_counter()
    try:
        row.update(check())
        ok = all(row[f"ratio_{name}"] <= 1.0 for name in names)
    except Exception:
        row["error"] = traceback.format_exc()
        ok = False
    row["ok"] = ok
    row["s"] = round(time.perf_counter() - t0, 2)
    return ok


def check_case(case, gluon_softmax_forward, error_ratio):
    bsz, n, kv_len, h, h_kv, d, causal, dt = case
    dtype = DTYPES[dt]
    g = torch.Generator(device="cuda").manual_seed(1000 + CASES.index(case))
    q64 = torch.randn(bsz, n, h, d, device="cuda", dtype=torch.float64, generator=g)
    k64 = torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)
    v64 = torch.randn(bsz, kv_len, h_kv, d, device="cuda", dtype=torch.float64, generator=g)
    sm_scale = 1.0 / math.sqrt(d)
    ref_out, ref_lse = reference(q64, k64, v64, sm_scale, causal)
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    same_out, same_lse = reference(q, k, v, sm_scale, causal)
    poison_allocator(q.device)
    out, lse = gluon_softmax_forward(q, k, v, sm_scale, causal)
    torch.cuda.synchronize()
    seen = torch.isfinite(ref_lse)
    if not torch.equal(torch.isinf(lse) & (lse > 0), ~seen):
        return {"ratio_out": float("inf"), "ratio_lse": float("inf"), "note": "lse2 +inf rows differ"}
    floor_out = 1e-3 * max(1.0, ref_out.abs().max().item())
    r_out = error_ratio(out.double(), same_out.double(), ref_out, floor=floor_out)
    fin = seen
    if fin.any():
        floor_lse = 1e-3 * max(1.0, ref_lse[fin].abs().max().item())
        r_lse = error_ratio(lse[fin].double(), same_lse[fin].double(), ref_lse[fin], floor=floor_lse)
    else:
        r_lse = 0.0
    return {"ratio_out": r_out, "ratio_lse": r_lse}


def load_kernel_version(path: Path):
    """gluon_softmax_forward of another version of the kernel file, loaded by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gluon_version_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gluon_softmax_forward


def with_env(name: str, value: str, fn):
    """fn() with the environment variable `name` set to `value` (the launch plans read their settings
    at each call)."""
    import os

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def with_gluon(mode: str, fn):
    """fn() with ATTNLAB_GLUON=mode (the public function's tier switch, attn/kernels/tiers.py)."""
    return with_env("ATTNLAB_GLUON", mode, fn)


def with_exp2(form: str, fn):
    """fn() with ATTNLAB_GLUON_EXP2=form (the Gluon softmax forward's exp2, attn/kernels/tiers.py)."""
    return with_env("ATTNLAB_GLUON_EXP2", form, fn)


def with_schedule(schedule: str, fn):
    """fn() with ATTNLAB_GLUON_SCHEDULE=schedule (the Gluon forwards' consumer order, attn/kernels/tiers.py)."""
    return with_env("ATTNLAB_GLUON_SCHEDULE", schedule, fn)


SHAPES = [(4, 16, 4096, 128, True), (2, 16, 8192, 128, True), (4, 16, 4096, 128, False), (8, 16, 1024, 64, True),
          (16, 12, 1024, 64, True)]


def time_shapes(kernels: dict, results):
    import torch.nn.functional as F

    import attn

    spec = attn.get_variant("softmax").make_spec()
    rows = []
    for b, h, n, d, causal in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        sm_scale = 1.0 / math.sqrt(d)
        impls = {
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
            "triton_portable": lambda: with_gluon("0", lambda: attn.attention(q, k, v, spec, causal=causal,
                                                                               backend="triton")),
            "public_auto": lambda: with_gluon("auto", lambda: attn.attention(q, k, v, spec, causal=causal,
                                                                             backend="triton")),
            **{name: (lambda fn=fn: fn(q, k, v, sm_scale, causal)) for name, fn in kernels.items()},
        }
        for name, fn in impls.items():
            row = {"shape": [b, h, n, d], "causal": causal, "impl": name}
            try:
                with torch.no_grad():
                    ms = median_ms(fn, warmup=100, rep=500)
                row.update(ms=ms, tflops=tflops(attention_flops(b, h, n, d, causal), ms))
            except Exception as exc:  # report and go on
                row.update(error=f"{type(exc).__name__}: {exc}"[:2000])
            rows.append(row)
        here = [r for r in rows if r["shape"] == [b, h, n, d] and r["causal"] == causal]
        base = next((r.get("ms") for r in here if r["impl"] == "sdpa"), None)
        for r in here:
            if base and r.get("ms"):
                r["x_sdpa"] = base / r["ms"]
    results["timing"] = rows
    from attn.kernels.softmax_family import tuned_configs

    results["tiers"] = {k: v for k, v in tuned_configs().items() if "tier" in k}
    for k, v in results["tiers"].items():
        print(f"{k}: {v}")
    print(f"\n{'shape (B,H,N,D) bf16':<24}{'causal':<8}{'impl':<26}{'ms':>9}{'TFLOP/s':>10}{'x SDPA':>8}")
    for r in rows:
        label = f"{str(tuple(r['shape'])):<24}{str(r['causal']):<8}{r['impl']:<26}"
        if "error" in r:
            print(f"{label}  ERROR {r['error'][:200]}")
        else:
            print(f"{label}{r['ms']:>9.3f}{r['tflops']:>10.1f}"
                  f"{r.get('x_sdpa', float('nan')):>8.2f}")


# the public function per softmax-family variant: SDPA (plain softmax, the yardstick), the portable
# forward (ATTNLAB_GLUON=0) and the Gluon forward (ATTNLAB_GLUON=1); forward, and forward + backward
VARIANT_SHAPES = [(4, 16, 4096, 128), (16, 12, 1024, 64)]
VARIANTS = [("softmax", {}, False), ("softmax", {}, True), ("softcap_tanh", {}, False), ("softcap_softsign", {}, False),
            ("alsc", {}, False), ("threshold", {}, False), ("threshold", {"power": 1.5}, False), ("sigmoid", {}, False),
            ("diff_threshold", {}, False)]


def variant_label(name, params, tempered):
    """A row's name: the variant, its non-default parameters, "+ temperature"."""
    label = name + "".join(f" {key}={value}" for key, value in params.items())
    return label + (" + temperature" if tempered else "")


# the ATTNLAB_GLUON value each tier column runs its forward and its backward under
TIER_MODES = {"portable": "0", "gluon": "1"}


def time_variants(results, shapes=VARIANT_SHAPES, passes=("fwd", "fwd+bwd"), only=None, exp2_forms=False):
    import torch.nn.functional as F

    import attn

    rows = []
    for b, h, n, d in shapes:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        temperature = torch.rand(b, n, device="cuda") + 0.5
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)

        def sdpa():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        for name, params, tempered in VARIANTS:
            label = variant_label(name, params, tempered)
            if only is not None and label not in only:
                continue
            variant = attn.get_variant(name)
            spec = variant.make_spec(**params)
            t = temperature if tempered else None
            two_views = variant.views == 2  # the differential threshold: a second q / k view, per-head lambdas
            extra = None
            if two_views:
                extra = {"q2": torch.randn_like(q.detach()), "k2": torch.randn_like(k.detach()),
                         "lam": torch.full((h,), 0.5, device="cuda")}

            def ours(mode):
                return lambda: with_gluon(mode, lambda: attn.attention(q, k, v, spec, causal=True, temperature=t,
                                                                      extra=extra, backend="triton"))
            impls = {"sdpa": (sdpa, dot), "portable": (ours("0"), do), "gluon": (ours("1"), do)}
            if exp2_forms and (name.startswith(("softcap", "alsc")) or (name == "softmax" and not tempered)):
                # exp2 on the FMA pipes for every score / every other score (ATTNLAB_GLUON_EXP2; forward only)
                for form in ("poly", "half"):
                    impls[f"gluon_exp2_{form}"] = (lambda form=form: with_exp2(form, ours("1")), None)
            if not two_views:
                # the two consumer warpgroups in ping-pong (ATTNLAB_GLUON_SCHEDULE; forward only)
                impls["gluon_pingpong"] = (lambda: with_schedule("pingpong", ours("1")), None)
            if name == "sigmoid":  # the reciprocal by 2 Newton steps instead of MUFU.RCP (forward only)
                from attn.kernels.gluon_weighted_fwd import gluon_sigmoid_forward

                impls["gluon_newton2"] = (lambda: gluon_sigmoid_forward(q, k, v, True, d ** -0.5, None, newton=2), None)
            for pass_name in passes:
                times = {}
                for impl, (fn, grad) in impls.items():
                    if grad is None and pass_name != "fwd":
                        continue
                    try:
                        if pass_name == "fwd":
                            with torch.no_grad():
                                times[impl] = median_ms(fn, warmup=50, rep=300)
                        else:
                            step = lambda fn=fn, grad=grad: fn().backward(grad)  # noqa: E731
                            if impl in TIER_MODES:  # the backward on the forward's tier too
                                step = lambda step=step, mode=TIER_MODES[impl]: with_gluon(mode, step)  # noqa: E731
                            times[impl] = median_ms(step, warmup=20, rep=200)
                    except Exception as exc:  # report and go on
                        times[impl] = float("nan")
                        print(f"{label} {impl} {pass_name}: {type(exc).__name__}: {exc}"[:500])
                row = {"shape": [b, h, n, d], "variant": label, "pass": pass_name, "ms": times,
                       "x_sdpa": {impl: times["sdpa"] / ms for impl, ms in times.items()}}
                rows.append(row)
    results["variants"] = rows
    print(f"\n{'shape (B,H,N,D) bf16 causal':<28}{'variant':<24}{'pass':<9}"
          f"{'sdpa ms':>9}{'portable':>10}{'gluon':>9}{'portable x':>12}{'gluon x':>9}")
    for r in rows:
        ms, x = r["ms"], r["x_sdpa"]
        extra = "".join(f"  {impl} {t:.3f} ms ({x[impl]:.2f}x)" for impl, t in ms.items()
                        if impl not in ("sdpa", "portable", "gluon"))
        gluon_ms, gluon_x = ms.get("gluon", float("nan")), x.get("gluon", float("nan"))
        print(f"{str(tuple(r['shape'])):<28}{r['variant']:<24}{r['pass']:<9}{ms['sdpa']:>9.3f}{ms['portable']:>10.3f}"
              f"{gluon_ms:>9.3f}{x['portable']:>12.2f}{gluon_x:>9.2f}{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gluon_softmax.json")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--variants-only", action="store_true",
                    help="only the per-variant timing at the first variant shape (no checks, no shape table)")
    ap.add_argument("--passes", default="fwd", help="with --variants-only: comma list of fwd, fwd+bwd")
    ap.add_argument("--only", default=None, help="with --variants-only: comma list of row names to time (default all): "
                    + ", ".join(variant_label(*v) for v in VARIANTS))
    ap.add_argument("--exp2-forms", action="store_true",
                    help="with --variants-only: also the polynomial exp2 forms (ATTNLAB_GLUON_EXP2=poly, half; slower than MUFU)")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=PATH",
                    help="another version of the kernel file to check and time beside the current one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {**result_header(), "capability": torch.cuda.get_device_capability(), "cases": []}
    failed = 0
    from attn.kernels.tiers import gluon_usable

    if not gluon_usable(torch.device("cuda")):
        results["skipped"] = "not an sm_90 GPU with Triton's Gluon Hopper API"
        print(f"skipped: {results['skipped']}")
        (args.out / "gluon_softmax.json").write_text(json.dumps(results, indent=1))
        return 0
    try:
        from attn.kernels.gluon_softmax_fwd import gluon_softmax_forward
        from attn.testing import error_ratio
    except Exception:
        results["import_error"] = traceback.format_exc()
        print(results["import_error"])
        (args.out / "gluon_softmax.json").write_text(json.dumps(results, indent=1))
        return 1

    if args.variants_only:
        passes = tuple(args.passes.split(","))
        if not set(passes) <= {"fwd", "fwd+bwd"}:
            raise SystemExit(f"--passes must be a comma list of fwd, fwd+bwd, got {args.passes!r}")
        only = None if args.only is None else set(args.only.split(","))
        unknown = (only or set()) - {variant_label(*v) for v in VARIANTS}
        if unknown:
            raise SystemExit(f"--only: unknown rows {sorted(unknown)}; the rows are "
                             + ", ".join(variant_label(*v) for v in VARIANTS))
        time_variants(results, VARIANT_SHAPES[:1], passes, only, args.exp2_forms)
        (args.out / "gluon_softmax.json").write_text(json.dumps(results, indent=1, default=str))
        return 0
    kernels = {"gluon_sm90": gluon_softmax_forward}
    for spec in args.kernel:
        name, _, path = spec.partition("=")
        kernels[name] = load_kernel_version(Path(path))
    print(f"{'kernel':<26}{'B,N,KV,H,Hkv,D,causal,dtype':<40}{'ratio out':>10}{'ratio lse':>10}  status")
    for kernel_name, forward in kernels.items():
        for case in CASES:
            row = {"kernel": kernel_name, "case": list(case)}
            t0 = time.perf_counter()
            try:
                row.update(check_case(case, forward, error_ratio))
                ok = row["ratio_out"] <= 1.0 and row["ratio_lse"] <= 1.0
            except Exception as exc:  # a compile or launch failure of one config: report, go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:4000]
                row["traceback"] = traceback.format_exc()[-4000:]
                ok = False
            row["ok"] = ok
            row["s"] = time.perf_counter() - t0
            failed += not ok
            results["cases"].append(row)
            status = "ok" if ok else ("ERROR " + row["error"][:300] if "error" in row else "FAIL " + row.get("note", ""))
            print(f"{kernel_name:<26}{str(case):<40}{row.get('ratio_out', float('nan')):>10.3f}"
                  f"{row.get('ratio_lse', float('nan')):>10.3f}  {status}", flush=True)
    results["failed"] = failed
    if not args.no_timing:
        try:
            time_shapes(kernels, results)
            time_variants(results)
        except Exception:
            results["timing_error"] = traceback.format_exc()
            print(results["timing_error"])
    (args.out / "gluon_softmax.json").write_text(json.dumps(results, indent=1, default=str))
    total = len(CASES) * len(kernels)
    print(f"\n{total - failed}/{total} correctness cases pass; JSON in {args.out / 'gluon_softmax.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
