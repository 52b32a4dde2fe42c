"""GPU correctness check of the fused threshold-family kernels (bf16, larger sizes than the CPU tests).

The DESIGN.md §6 rule (error vs float64 <= 2x the bf16 PyTorch reference's error + a floor) for
out, dq, dk, dv, dq2, dk2, d-lambda, over p in {1, 2, 1.5, 3}, dense / sparse / all-zero rows, every
mask kind, GQA 1/2/4, odd N; outputs NaN-poisoned; both tile configs of each kernel (pinned in
turn) and both forms of the differential dk/dv. Prints the max error ratio per quantity (<= 1
passes). Then, unless --quick: the autotuned configs at N = 4096 pass the same rule, and
torch.compile(fullgraph=True, inductor) of a model block through attn.attention(backend="triton")
agrees with eager; always: d-lambda (and every gradient) bitwise deterministic. Exits 1 on a failure.
Benchmarks: scripts/bench/bench_attention.py --only threshold.

Triton compiles every kernel variant once (mask kind x variant x power mode x head dim x tile
config), so the matrix runs in a pool of worker processes, which compile in parallel.

    python scripts/gpu_checks/check_threshold_gpu.py [--out DIR] [--workers 14] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # the benchmarks' timing harness: a result file's header

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from timing import result_header  # noqa: E402

DEVICE = os.environ.get("ATTNLAB_CHECK_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: dry run of the script
FLOOR = 1e-3  # absolute floor of the rule in bf16 (values are O(1) to O(30))
BETA = {"dense": -1.0, "sparse": 0.5, "zero": 6.0}
MASKS = {
    "none": (False, None, False),
    "causal": (True, None, False),
    "window": (True, 200, False),
    "ranker": (False, None, True),
    "ranker+causal": (True, None, True),
    "ranker+window": (True, 150, True),
}

# (name, B, N, H, H_kv, D, p, beta, mask, differential, tile config index)
CHECK_CASES = [
    ("thr p2 causal", 2, 1000, 4, 4, 128, 2.0, "sparse", "causal", False, 0),
    ("thr p2 causal cfg1", 2, 1000, 4, 4, 128, 2.0, "sparse", "causal", False, 1),
    ("thr p1 causal gqa2", 2, 777, 4, 2, 64, 1.0, "dense", "causal", False, 0),
    ("thr p1.5 causal gqa4", 1, 1031, 8, 2, 128, 1.5, "sparse", "causal", False, 1),
    ("thr p3 none", 2, 513, 4, 4, 64, 3.0, "dense", "none", False, 1),
    ("thr p2 window zero-rows", 2, 1000, 4, 2, 128, 2.0, "zero", "window", False, 0),
    ("thr p1 window", 2, 1000, 4, 1, 64, 1.0, "sparse", "window", False, 1),
    ("thr p2 ranker", 3, 1000, 4, 4, 128, 2.0, "sparse", "ranker", False, 0),
    ("thr p1.5 ranker+causal", 3, 900, 4, 2, 64, 1.5, "dense", "ranker+causal", False, 0),
    ("thr p3 ranker+window", 3, 700, 4, 4, 128, 3.0, "sparse", "ranker+window", False, 1),
    ("thr p2 N=1", 2, 1, 4, 4, 128, 2.0, "dense", "causal", False, 0),
    ("thr p2 N=17", 2, 17, 4, 2, 64, 2.0, "dense", "none", False, 0),
    ("diff p2 causal gqa2", 2, 1000, 4, 2, 128, 2.0, "sparse", "causal", True, 0),
    ("diff p2 causal cfg1", 2, 1000, 4, 4, 128, 2.0, "dense", "causal", True, 1),
    ("diff p1.5 window", 2, 801, 4, 4, 64, 1.5, "dense", "window", True, 0),
    ("diff p1 ranker gqa4", 3, 1000, 8, 2, 128, 1.0, "sparse", "ranker", True, 1),
    ("diff p3 none zero-rows", 2, 300, 4, 4, 64, 3.0, "zero", "none", True, 1),
    ("diff p2 ranker+causal", 3, 640, 4, 1, 64, 2.0, "sparse", "ranker+causal", True, 0),
    ("diff p1.5 N=127", 2, 127, 4, 4, 128, 1.5, "dense", "ranker+window", True, 0),
]


def check_case(name, b, n, h, h_kv, d, power, beta, mask_name, differential, config, seed=0):
    """Max error ratios (<= 1 passes) of one case, kernel in bf16 vs float64 / bf16 references."""
    from attn.kernels import threshold_family as tf
    from attn.masks import MaskSpec
    from attn.reference import reference_attention
    from attn.specs import ThresholdFamilySpec
    from attn.testing import error_ratio, nan_poisoned_empty, outputs_and_grads, random_segment_ids

    dev = DEVICE
    gen = torch.Generator().manual_seed(seed or sum(map(ord, name)))
    causal, window, with_seg = MASKS[mask_name]
    mask = MaskSpec(causal=causal, window=window)
    spec = ThresholdFamilySpec(beta=BETA[beta], power=power, differential=differential)
    seg = random_segment_ids(b, n, gen, min_history=n // 4, max_history=n // 2, padding_row=True).to(dev) if with_seg else None

    def unit(heads):
        return F.normalize(torch.randn(b, n, heads, d, generator=gen, dtype=torch.float64), dim=-1).to(dev)

    tensors = {"q": unit(h), "k": unit(h_kv), "v": torch.randn(b, n, h_kv, d, generator=gen,
                                                                 dtype=torch.float64).to(dev)}
    if differential:
        tensors.update(q2=unit(h), k2=unit(h_kv), lam=(0.2 + 0.6 * torch.rand(h, generator=gen,
                                                                              dtype=torch.float64)).to(dev))
    dout = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64).to(dev)

    def leaves(dtype):
        return {k_: t.to(torch.float32 if k_ == "lam" and dtype != torch.float64 else dtype).requires_grad_()
                for k_, t in tensors.items()}

    def reference(q, k, v, **extra):
        return reference_attention(q, k, v, spec, mask, seg, None, extra=extra)

    def fused(q, k, v, **extra):
        return tf.fused_attention(q, k, v, spec, mask, seg, None, extra=extra)

    # config None: the autotuner's choices. Else tile config `config`, and both forms of the
    # differential dk/dv kernel: split with config 0, fused with config 1
    pins = {} if config is None else {"ATTNLAB_KERNEL_CONFIG": str(config),
                                      "ATTNLAB_DIFF_DKDV": "fused" if config == 1 else "split"}
    ref64 = outputs_and_grads(reference, leaves(torch.float64), dout)
    same = outputs_and_grads(reference, leaves(torch.bfloat16), dout)
    with nan_poisoned_empty(), environment(pins):
        got = outputs_and_grads(fused, leaves(torch.bfloat16), dout)
    return {key: error_ratio(got[key], same[key], want, FLOOR) for key, want in ref64.items()}


def environment(values: dict[str, str]):
    """Set environment variables for a block, then restore them (pins must not leak into the
    autotuned checks that run later in the same process)."""
    return mock.patch.dict(os.environ, values)


def _worker(task):
    os.environ["ATTNLAB_AUTOTUNE"] = "0"  # pinned configs: every config is compiled and checked
    kind, args = task
    t0 = time.time()
    try:
        result = check_case(*args)
        error = None
    except Exception as e:  # report, keep going
        result, error = None, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    return kind, args, result, error, time.time() - t0


def tuned_check(log):
    """The autotuned configs at the main benchmark's key (N bucket 4096, D 128, causal)."""
    ratios = {}
    for differential in (False, True):
        name = f"{'diff' if differential else 'thr'} p2 causal N=4096 (autotuned)"
        os.environ.pop("ATTNLAB_AUTOTUNE", None)
        ratios[name] = check_case(name, 1, 4096, 4, 2, 128, 2.0, "sparse", "causal", differential, None)
        log(f"  {name}: " + " ".join(f"{k}={v:.3f}" for k, v in ratios[name].items()))
    return ratios


def determinism(log):
    import attn

    dev, b, n, h, h_kv, d = "cuda", 2, 2048, 16, 4, 128
    spec = attn.get_variant("diff_threshold").make_spec(beta=0.5)
    g = torch.Generator(device=dev).manual_seed(0)
    x = {k: F.normalize(torch.randn(b, n, hh, d, device=dev, generator=g), dim=-1).to(torch.bfloat16)
         for k, hh in (("q", h), ("k", h_kv), ("v", h_kv), ("q2", h), ("k2", h_kv))}
    lam = torch.rand(h, device=dev, generator=g)
    dout = torch.randn(b, n, h, d, device=dev, generator=g).to(torch.bfloat16)
    runs = []
    for _ in range(3):
        leaves = {k: t.clone().requires_grad_() for k, t in {**x, "lam": lam}.items()}
        out = attn.attention(leaves["q"], leaves["k"], leaves["v"], spec, causal=True,
                             extra={"q2": leaves["q2"], "k2": leaves["k2"], "lam": leaves["lam"]}, backend="triton")
        runs.append(torch.autograd.grad(out, list(leaves.values()), dout))
    same = all(torch.equal(a, c) for run in runs[1:] for a, c in zip(runs[0], run))
    log(f"  gradients bitwise identical over 3 runs (dq, dk, dv, dq2, dk2, dlam): {same}")
    return same


def compile_check(log):
    """torch.compile(fullgraph=True, inductor) of a model block vs eager, bf16, both variants."""
    import attn

    results = {}
    for variant in ("threshold", "diff_threshold"):
        torch._dynamo.reset()
        spec = attn.get_variant(variant).make_spec(beta=0.5)
        views = 5 if spec.differential else 3
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(2, 333, 256, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(256, views * 256, device="cuda", generator=g) / 16).to(torch.bfloat16)
        lam = torch.tensor([0.3, 0.5, 0.7, 0.4], device="cuda")

        def block(x, w, lam):
            parts = (x @ w).split(256, dim=-1)
            heads = lambda t: F.normalize(t.unflatten(-1, (4, 64)).float(), dim=-1).to(t.dtype)  # noqa: E731
            extra = {"q2": heads(parts[3]), "k2": heads(parts[4]), "lam": lam} if spec.differential else {}
            out = attn.attention(heads(parts[0]), heads(parts[1]), parts[2].unflatten(-1, (4, 64)), spec,
                                 causal=True, backend="triton", extra=extra)
            return out.float().square().mean()

        outs = []
        for fn in (block, torch.compile(block, fullgraph=True)):
            wl, ll = w.clone().requires_grad_(), lam.clone().requires_grad_()
            loss = fn(x, wl, ll)
            loss.backward()
            outs.append((loss.detach().float(), wl.grad.float())
                        + ((ll.grad.float(),) if spec.differential else ()))
        diffs = [((c - e).abs().max() / e.abs().max().clamp_min(1e-12)).item() for e, c in zip(*outs)]
        results[variant] = diffs
        log(f"  compile(fullgraph, inductor) vs eager {variant}: rel. max diff loss/dW/dlam = "
            + " ".join(f"{v:.1e}" for v in diffs))
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_out/check_threshold", help="folder for the log and the JSON report")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--quick", action="store_true", help="the matrix and the determinism check only")
    ap.add_argument("--only-checks", default="", help="run only the check cases whose name starts with this")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "check_threshold_gpu.log", "w")
    t_start = time.time()

    def log(msg):
        line = f"[{time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    meta = result_header()
    log(str(meta))
    report = {"meta": meta}

    # the correctness matrix, in parallel worker processes
    tasks = [("check", c) for c in CHECK_CASES if c[0].startswith(args.only_checks)]
    checks = {}
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for kind, targs, result, error, secs in pool.imap_unordered(_worker, tasks):
            if error:
                log(f"  {kind} {targs}: FAILED {error}")
            checks[targs[0]] = result if result is not None else {"error": error}
            if result is not None:
                log(f"  check {targs[0]:28} ({secs:5.1f}s) max ratio {max(result.values()):.3f}")
    report["checks"] = checks
    quantities = ["out", "dq", "dk", "dv", "dq2", "dk2", "dlam"]
    header = f"{'case':30}" + "".join(f"{q:>7}" for q in quantities)
    lines = [header]
    for name, r in checks.items():
        if "error" in r:
            lines.append(f"{name:30} ERROR")
            continue
        lines.append(f"{name:30}" + "".join(f"{r[q]:7.3f}" if q in r else f"{'-':>7}" for q in quantities))
    worst = max((v for r in checks.values() if "error" not in r for v in r.values()), default=math.inf)
    failed = [n for n, r in checks.items() if "error" in r or max(r.values()) > 1.0]
    lines.append(f"max error ratio over the matrix: {worst:.3f} (<= 1 passes); failing cases: {failed or 'none'}")
    report["max_error_ratio"] = worst
    report["failing_cases"] = failed

    try:
        if not args.quick:
            tuned = report["tuned_checks"] = tuned_check(log)
            failed += [name for name, r in tuned.items() if max(r.values()) > 1.0]
        report["deterministic_grads"] = determinism(log)
        if not report["deterministic_grads"]:
            failed.append("deterministic gradients")
        if not args.quick:
            report["compile_vs_eager"] = compile_check(log)
    except Exception:
        log("main-process checks failed:\n" + traceback.format_exc())
        failed.append("main-process checks")
    (out / "check_threshold_gpu.json").write_text(json.dumps(report, indent=1, default=str))
    log("bf16 error ratios (err / (2 x bf16-torch err + 1e-3); <= 1 passes):")
    for line in lines:
        log("  " + line)
    log(f"done in {time.time() - t_start:.0f}s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
