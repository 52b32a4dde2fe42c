"""Benchmark the fused softmax-family kernels against SDPA and FlexAttention (DESIGN.md §7).

Same process, same inputs: our Triton kernels (through `attn.attention`, backend triton),
`scaled_dot_product_attention` (plain softmax), FlexAttention compiled with the same
score_mod / block mask, and (small shapes) the PyTorch reference under torch.compile.
`triton.testing.do_bench`, median, after warm-up; autotuning and compilation happen in
the warm-up, never inside a measured time. FLOPs are useful work: 4*B*H*D per visible
(query, key) pair forward (so half of 4BHN^2D under a causal mask), backward 2.5x that.

    python scripts/bench_attention.py --out gpu_out/softmax_family  [--only main]
    python scripts/bench_attention.py --only threshold --out gpu_out/bench_threshold

Writes OUT.json and OUT.md (date, GPU, torch/triton versions, commit).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench_train import git_commit  # noqa: E402

import attn  # noqa: E402
from attn.masks import MaskSpec, visible_key_counts  # noqa: E402

torch._dynamo.config.cache_size_limit = 1000
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 1000
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    flex_attention = None

CAP, KNEE = 30.0, 0.5
VARIANT_OF_CAP = {"none": "softmax", "tanh": "softcap_tanh", "soft_sign": "softcap_softsign", "alsc": "alsc"}
_flex = torch.compile(flex_attention, dynamic=False) if flex_attention is not None else None


def score_mod_for(cap: str):
    c, a = CAP, KNEE * CAP
    g = c - a
    if cap == "none":
        return None
    if cap == "tanh":
        return lambda s, b, h, qi, ki: c * torch.tanh(s / c)
    if cap == "soft_sign":
        return lambda s, b, h, qi, ki: s / (1 + torch.abs(s) / c)

    def alsc(s, b, h, qi, ki):
        cl = torch.clamp(s, -a, a)
        return cl + g * torch.tanh((s - cl) / g)

    return alsc


def block_mask_for(mask: MaskSpec, ids, batch, n):
    w = mask.window

    def causal(b, h, qi, ki):
        return qi >= ki

    def window(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < w)

    if ids is not None:
        def ranker(b, h, qi, ki):
            qs, ks = ids[b, qi], ids[b, ki]
            ok = ((qs != 0) & (ks == 1)) | ((qs == -1) & (qi == ki))
            if mask.is_causal:
                ok = ok & (qi >= ki)
            return ok

        return create_block_mask(ranker, B=batch, H=None, Q_LEN=n, KV_LEN=n)
    if w is not None:
        return create_block_mask(window, B=None, H=None, Q_LEN=n, KV_LEN=n)
    if mask.causal:
        return create_block_mask(causal, B=None, H=None, Q_LEN=n, KV_LEN=n)
    return None


def bench(fn, grad=False):
    """Median ms of fn (fwd) or fn + backward (fwd+bwd), and peak memory (GiB) of one call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if grad:
        def call():
            out = fn()
            out.backward(call.do)
        out = fn()
        call.do = torch.randn_like(out)
        del out
        run = call
    else:
        def run():
            with torch.no_grad():
                fn()
    for _ in range(3):  # compile / autotune outside the timing
        run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = do_bench(run, warmup=50, rep=200, return_mode="median")
    return ms, peak


def useful_flops(b, h, n, d, mask, ids):
    pairs = visible_key_counts(mask, n, ids.cpu() if ids is not None else None).sum().item()
    if ids is None:
        pairs *= b
    return 4.0 * h * d * pairs


def ranker_layout(batch, n, hist, cand, device):
    ids = torch.zeros(batch, n, dtype=torch.int64)
    ids[:, :hist] = 1
    ids[:, hist:hist + cand] = -1
    return ids.to(device)


def run_case(name, b, h, n, d, cap, mask, *, h_kv=None, ids=None, sdpa=False, flex=True, ref=False):
    h_kv = h_kv or h
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(b, n, h, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, n, h_kv, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(b, n, h_kv, d, device=dev, dtype=dtype, requires_grad=True)
    params = {} if cap == "none" else ({"cap": CAP, "knee": KNEE} if cap == "alsc" else {"cap": CAP})
    spec = attn.get_variant(VARIANT_OF_CAP[cap]).make_spec(**params)
    flops = useful_flops(b, h, n, d, mask, ids)
    row = {"name": name, "B": b, "H": h, "H_kv": h_kv, "N": n, "D": d, "cap": cap, "mask": mask.kind
           if ids is None else f"ranker{'+causal' if mask.is_causal else ''}", "fwd_gflop": flops / 1e9}

    from attn.kernels.softmax_family import fused_attention

    def ours():
        # the kernel entry point (as Flex gets its block mask built outside the timing, the
        # public API's eager input validation, which syncs on segment ids, is left out)
        return fused_attention(q, k, v, spec, mask, ids)

    impls = {"ours": ours}
    if sdpa:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask.causal,
                                                               enable_gqa=h_kv != h)
    if flex and _flex is not None:
        qf, kf, vf = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        bm = block_mask_for(mask, ids, b, n)
        sm = score_mod_for(cap)
        impls["flex"] = lambda: _flex(qf, kf, vf, score_mod=sm, block_mask=bm, enable_gqa=h_kv != h)
    if ref:
        from attn.reference import reference_attention
        ref_c = torch.compile(reference_attention)
        impls["ref_compiled"] = lambda: ref_c(q, k, v, spec, mask, ids, None)
    for key, fn in impls.items():
        try:
            ms_f, mem_f = bench(fn, grad=False)
            ms_b, mem_b = bench(fn, grad=True)
        except Exception as e:  # report, keep going
            print(f"  {name} {key}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row[key] = {"fwd_ms": ms_f, "fwdbwd_ms": ms_b, "fwd_tflops": flops / ms_f / 1e9,
                    "fwdbwd_tflops": 3.5 * flops / ms_b / 1e9, "peak_gib_fwdbwd": mem_b}
        print(f"  {name:34} {key:12} fwd {ms_f:8.3f} ms {flops / ms_f / 1e9:6.1f} TF/s | fwd+bwd {ms_b:8.3f} ms "
              f"{3.5 * flops / ms_b / 1e9:6.1f} TF/s | peak {mem_b:.2f} GiB", flush=True)
    torch.cuda.empty_cache()
    return row


def cases(only):
    main = (4, 16, 4096, 128)
    causal = MaskSpec(causal=True)
    full = MaskSpec(causal=False)
    out = []
    if only in ("all", "main"):
        out += [("main softmax causal", *main, "none", causal, {"sdpa": True})]
        out += [(f"main {cap} causal", *main, cap, causal, {}) for cap in ("tanh", "soft_sign", "alsc")]
    if only == "ours":  # our kernels alone, main shape (quick regression check)
        out += [(f"main {cap} causal", *main, cap, causal, {"flex": False}) for cap in VARIANT_OF_CAP]
    if only in ("all", "masks"):
        ids = ranker_layout(4, 2048, 1024, 1024, "cuda")
        out += [("ranker 1024h+1024c softmax", 4, 16, 2048, 128, "none", full, {"ids": ids})]
        out += [("full N=2048 softmax", 4, 16, 2048, 128, "none", full, {"sdpa": True})]
        out += [("window 1024 tanh", *main, "tanh", MaskSpec(causal=True, window=1024), {})]
        out += [("gqa H_kv=4 tanh causal", *main, "tanh", causal, {"h_kv": 4})]
        out += [("gqa H_kv=4 softmax causal", *main, "none", causal, {"h_kv": 4, "sdpa": True})]
    if only in ("all", "shapes"):
        out += [("small softmax causal", 8, 16, 1024, 64, "none", causal, {"sdpa": True, "ref": True})]
        out += [("small tanh causal", 8, 16, 1024, 64, "tanh", causal, {})]
        out += [("long softmax causal", 2, 16, 8192, 128, "none", causal, {"sdpa": True})]
        out += [("long tanh causal", 2, 16, 8192, 128, "tanh", causal, {})]
    return out


def ratio(a, b, key):
    """a[key] / b[key], None where a row or its timing is missing (a failed implementation)."""
    try:
        return a[key] / b[key]
    except (KeyError, TypeError):
        return None


def targets(rows):
    by = {r["name"]: r for r in rows}
    res = []

    for cap in ("tanh", "soft_sign", "alsc"):
        r = by.get(f"main {cap} causal")
        if r and "flex" in r and "ours" in r:
            res.append((f"{cap}: fwd speed vs Flex (>= 2.0x)", ratio(r["flex"], r["ours"], "fwd_ms"), 2.0))
            res.append((f"{cap}: fwd+bwd speed vs Flex (>= 1.8x)", ratio(r["flex"], r["ours"], "fwdbwd_ms"), 1.8))
    r = by.get("main softmax causal")
    if r and "sdpa" in r and "ours" in r:
        res.append(("softmax: fwd speed vs SDPA (>= 0.8x)", ratio(r["sdpa"], r["ours"], "fwd_ms"), 0.8))
        res.append(("softmax: fwd+bwd speed vs SDPA (>= 0.7x)", ratio(r["sdpa"], r["ours"], "fwdbwd_ms"), 0.7))
    a, t = by.get("main alsc causal"), by.get("main tanh causal")
    if a and t and "ours" in a and "ours" in t:
        for key in ("fwd_ms", "fwdbwd_ms"):
            res.append((f"ALSC / tanh time, {key[:-3]} (<= 1.10)", ratio(a["ours"], t["ours"], key), -1.10))
    rk, fu = by.get("ranker 1024h+1024c softmax"), by.get("full N=2048 softmax")
    if rk and fu and "ours" in rk and "ours" in fu:
        for key in ("fwd_ms", "fwdbwd_ms"):
            res.append((f"ranker / full time, {key[:-3]} (<= 0.60)", ratio(rk["ours"], fu["ours"], key), -0.60))
    return [{"target": n, "value": v, "met": (v is not None and (v >= lim if lim > 0 else v <= -lim))}
            for n, v, lim in res]


def markdown(meta, rows, tgts, title="Softmax-family attention benchmark"):
    lines = [f"# {title}", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · commit "
             f"`{meta['commit']}` · bf16 · do_bench median", "",
             "TFLOP/s count useful work (visible pairs; fwd+bwd = 3.5x fwd).", "",
             "| case | B,H,H_kv,N,D | impl | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | peak GiB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        for impl in ("ours", "sdpa", "flex", "ref_compiled"):
            if impl in r:
                m = r[impl]
                lines.append(f"| {r['name']} | {r['B']},{r['H']},{r['H_kv']},{r['N']},{r['D']} | {impl} | "
                             f"{m['fwd_ms']:.3f} | {m['fwd_tflops']:.0f} | {m['fwdbwd_ms']:.3f} | "
                             f"{m['fwdbwd_tflops']:.0f} | {m['peak_gib_fwdbwd']:.2f} |")
    lines += ["", "| target | measured | met |", "| --- | ---: | :---: |"]
    for t in tgts:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {v} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# threshold family (issue 4): threshold / diff_threshold vs SDPA and the compiled reference
# ----------------------------------------------------------------------------------------


def run_threshold_case(name, b, h, n, d, variant, mask, *, h_kv=None, ids=None, sdpa=False, ref=False,
                       beta=1.0, power=2.0):
    """One threshold-family case; rows look like run_case's (impls: ours, sdpa, ref_compiled).

    q and k are L2-normalized as the model does; the kernels' speed does not depend on how
    many weights the threshold zeroes (no data-dependent skipping)."""
    h_kv = h_kv or h
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)

    def unit(heads):
        return F.normalize(torch.randn(b, n, heads, d, device=dev, dtype=torch.float32), dim=-1).to(dtype)

    q, k = unit(h).requires_grad_(), unit(h_kv).requires_grad_()
    v = torch.randn(b, n, h_kv, d, device=dev, dtype=dtype, requires_grad=True)
    spec = attn.get_variant(variant).make_spec(beta=beta, power=power)
    second = {}
    if spec.differential:
        second = {"q2": unit(h).requires_grad_(), "k2": unit(h_kv).requires_grad_(),
                  "lam": torch.full((h,), 0.5, device=dev, dtype=torch.float32, requires_grad=True)}
    flops = useful_flops(b, h, n, d, mask, ids)
    row = {"name": name, "variant": variant, "B": b, "H": h, "H_kv": h_kv, "N": n, "D": d, "beta": beta,
           "power": power, "mask": mask.kind if ids is None else f"ranker{'+causal' if mask.is_causal else ''}",
           "fwd_gflop": flops / 1e9}

    kernel_entry = attn.registry.family_kernel(spec)

    def ours():
        # the kernel entry attn.attention dispatches to, without its input validation (which
        # syncs with the device to check segment ids: ~1 ms per call in the ranker case)
        return kernel_entry(q, k, v, spec, mask, ids, None, second.get("q2"), second.get("k2"), second.get("lam"))

    impls = {"ours": ours}
    if sdpa:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask.causal,
                                                               enable_gqa=h_kv != h)
    if ref:
        from attn.reference import reference_attention
        ref_c = torch.compile(reference_attention)
        impls["ref_compiled"] = lambda: ref_c(q, k, v, spec, mask, ids, None, second.get("q2"),
                                              second.get("k2"), second.get("lam"))
    for key, fn in impls.items():
        try:
            ms_f, mem_f = bench(fn, grad=False)
            ms_b, mem_b = bench(fn, grad=True)
        except Exception as e:  # report, keep going
            print(f"  {name} {key}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
            continue
        row[key] = {"fwd_ms": ms_f, "fwdbwd_ms": ms_b, "fwd_tflops": flops / ms_f / 1e9,
                    "fwdbwd_tflops": 3.5 * flops / ms_b / 1e9, "peak_gib_fwd": mem_f, "peak_gib_fwdbwd": mem_b}
        print(f"  {name:34} {key:12} fwd {ms_f:8.3f} ms {flops / ms_f / 1e9:6.1f} TF/s | fwd+bwd {ms_b:8.3f} ms "
              f"{3.5 * flops / ms_b / 1e9:6.1f} TF/s | peak {mem_b:.2f} GiB", flush=True)
    torch.cuda.empty_cache()
    return row


def threshold_cases(only="threshold"):
    """(name, b, h, n, d, variant, mask, extra) like cases(); only: threshold | threshold_main."""
    main = (4, 16, 4096, 128)
    causal = MaskSpec(causal=True)
    out = []
    for variant in ("threshold", "diff_threshold"):
        out += [(f"main {variant} causal", *main, variant, causal, {"sdpa": variant == "threshold", "ref": True})]
    if only == "threshold_main":
        return out
    for variant in ("threshold", "diff_threshold"):
        first = variant == "threshold"
        out += [(f"small {variant} causal", 8, 16, 1024, 64, variant, causal, {"sdpa": first})]
        out += [(f"long {variant} causal", 2, 16, 8192, 128, variant, causal, {"sdpa": first})]
        out += [(f"gqa H_kv=4 {variant} causal", *main, variant, causal, {"h_kv": 4, "sdpa": first})]
        out += [(f"window 1024 {variant}", *main, variant, MaskSpec(causal=True, window=1024), {})]
        ids = ranker_layout(4, 2048, 1024, 1024, "cuda")
        out += [(f"ranker 1024h+1024c {variant}", 4, 16, 2048, 128, variant, MaskSpec(causal=False),
                 {"ids": ids})]
    return out


def threshold_targets(rows):
    by = {r["name"]: r for r in rows}
    res = []

    t, dt_ = by.get("main threshold causal"), by.get("main diff_threshold causal")
    if t and "ours" in t and "sdpa" in t:
        res.append(("threshold: fwd TFLOP/s vs SDPA (>= 0.9x)", ratio(t["sdpa"], t["ours"], "fwd_ms"), 0.9))
        res.append(("threshold: fwd+bwd TFLOP/s vs SDPA (>= 0.8x)", ratio(t["sdpa"], t["ours"], "fwdbwd_ms"), 0.8))
    if t and dt_ and "ours" in t and "ours" in dt_:
        res.append(("diff_threshold / threshold fwd+bwd time (<= 1.6)", ratio(dt_["ours"], t["ours"], "fwdbwd_ms"),
                    -1.6))
    for r in (t, dt_):
        if r and "ours" in r and "ref_compiled" in r:
            res.append((f"{r['variant']}: fwd+bwd speed vs compiled reference (> 1x)",
                        ratio(r["ref_compiled"], r["ours"], "fwdbwd_ms"), 1.0))
            res.append((f"{r['variant']}: fwd+bwd peak memory, reference / ours (> 1x)",
                        ratio(r["ref_compiled"], r["ours"], "peak_gib_fwdbwd"), 1.0))
    return [{"target": n, "value": v, "met": (v is not None and (v >= lim if lim > 0 else v <= -lim))}
            for n, v, lim in res]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_out/bench_attention", help="OUT.md / OUT.json (docs/ holds curated copies)")
    ap.add_argument("--only", default="all",
                    choices=["all", "main", "ours", "masks", "shapes", "threshold", "threshold_main"])
    ap.add_argument("--merge", nargs="*", default=None, help="merge part JSON files into --out, run nothing")
    ap.add_argument("--names", default=None, help="comma list: run only the cases whose name contains one of these")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        rows = [r for part in parts for r in part["rows"]]
        meta = dict(parts[0]["meta"])
        meta["date"] = " / ".join(dict.fromkeys(p["meta"]["date"] for p in parts))
        tgts = targets(rows)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": tgts}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows, tgts))
        return
    commit = git_commit()
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit}
    print(meta, flush=True)
    rows, tgts = [], []
    threshold = args.only.startswith("threshold")
    title = "Threshold-family attention benchmark" if threshold else "Softmax-family attention benchmark"
    wanted = args.names.split(",") if args.names else None
    for name, b, h, n, d, cap, mask, extra in (threshold_cases(args.only) if threshold else cases(args.only)):
        if wanted and not any(w in name for w in wanted):
            continue
        rows.append((run_threshold_case if threshold else run_case)(name, b, h, n, d, cap, mask, **extra))
        # written after every case: a run cut off by a time limit keeps what it measured
        tgts = threshold_targets(rows) if threshold else targets(rows)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": tgts}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows, tgts, title))
    for t in tgts:
        print(f"{t['target']:45} {t['value'] if t['value'] is None else round(t['value'], 3)} "
              f"{'met' if t['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
