"""The Gluon backwards of this tree against another version of their kernel files, in one GPU process: bits, then time.

A kernel change that should not move a single bit (a schedule, a load moved, a value computed earlier) is
proven by the outputs of both versions on the same inputs being equal, element for element, where the
other version passed the float64 tests; its speed by timing both versions alternately in the same process.
`--old DIR` holds the other version's gluon_softmax_bwd.py, gluon_weighted_bwd.py and gluon_diff_bwd.py
(e.g. `git show REV:attn/kernels/gluon_weighted_bwd.py > DIR/gluon_weighted_bwd.py`; a file missing from DIR
is this tree's). They are loaded as modules of their own, each importing the other version's modules where
it imports one of these three, and everything else from this tree.

Per case (variant, (B, N, KV, H, H_kv, D), causal, and the launch's form) both versions' gradients are
compared with torch.equal; per timed case, backward launches only (triton.testing.do_bench medians, the
versions alternating over --rounds), old / new ms. Exits 1 when a case's bits differ or a launch fails.

    python scripts/gpu_checks/ab_gluon_backward.py --old /tmp/old_kernels --out $OUT [--rounds 3] [--no-timing]
        [--variants softmax threshold] [--head-dims 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from timing import result_header  # noqa: E402

MODULES = ("gluon_softmax_bwd", "gluon_weighted_bwd", "gluon_diff_bwd")  # in import order
# (variant, (B, N, KV, H, H_kv, D), causal, launch options): every case is compared bit for bit, so only
# deterministic forms (not the softmax one-pass form, whose dq sums by reduce-adds in no fixed order)
CASES = [
    ("softmax", (2, 1000, 1000, 4, 4, 64), True, {}),
    ("softmax", (1, 777, 1300, 4, 2, 128), False, {}),
    ("softmax", (2, 1000, 1000, 4, 4, 128), True, {"temperature": True}),
    ("tanh", (2, 1000, 1000, 4, 2, 128), True, {}),
    ("alsc", (1, 513, 513, 4, 4, 64), True, {}),
    ("softmax", (2, 1000, 1000, 4, 4, 128), True, {"persistent": True}),
    ("threshold", (2, 1000, 1000, 4, 4, 64), True, {}),
    ("threshold", (1, 777, 1300, 4, 2, 128), False, {}),
    ("threshold", (2, 1000, 1000, 4, 4, 128), True, {"persistent": True}),
    ("sigmoid", (2, 1000, 1000, 4, 2, 128), True, {}),
    ("diff_threshold", (2, 1000, 1000, 4, 4, 64), True, {}),
    ("diff_threshold", (2, 1000, 1000, 4, 2, 128), True, {"dkdv_form": "view_warpgroups"}),
    ("diff_threshold", (1, 777, 1300, 4, 4, 128), False, {"dkdv_form": "view_warpgroups"}),
    ("diff_threshold", (2, 1000, 1000, 4, 4, 128), True, {"persistent": True}),
    ("diff_threshold", (2, 1000, 1000, 4, 4, 128), True,
     {"dkdv_form": "view_warpgroups", "dq_form": "view_warpgroups"}),
]
# (variant, (B, N, KV, H, H_kv, D), causal, launch options): timed
TIMED = [
    (variant, shape, True, options)
    for shape in ((4, 4096, 4096, 16, 16, 128), (16, 1024, 1024, 12, 12, 64))
    for variant, options in (("softmax", {}), ("tanh", {}), ("threshold", {}), ("sigmoid", {}),
                             ("diff_threshold", {"dkdv_form": "view_warpgroups" if shape[-1] == 128 else
                                                 "key_halves"}))
]
CAPS = {"softmax": (0, 0.0, 0.0), "tanh": (1, 30.0, 0.0), "alsc": (3, 30.0, 0.5)}


def load_versions(old_dir: Path) -> dict:
    """{"new": {name: module}, "old": {name: module}}: this tree's modules and the other version's, the
    latter loaded from old_dir under private names (this tree's file where old_dir lacks one), each seeing
    the other version's modules of MODULES while it executes."""
    import attn.kernels as kernels_pkg

    new = {name: importlib.import_module(f"attn.kernels.{name}") for name in MODULES}
    old = {}
    saved = {name: sys.modules[f"attn.kernels.{name}"] for name in MODULES}
    try:
        for name in MODULES:
            path = old_dir / f"{name}.py"
            if not path.exists():
                path = ROOT / "attn" / "kernels" / f"{name}.py"
            spec = importlib.util.spec_from_file_location(f"attn.kernels.{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[f"attn.kernels.{name}"] = module  # the next old module imports this one
            setattr(kernels_pkg, name, module)
            spec.loader.exec_module(module)
            old[name] = module
    finally:
        for name, module in saved.items():
            sys.modules[f"attn.kernels.{name}"] = module
            setattr(kernels_pkg, name, module)
    return {"new": new, "old": old}


def make_inputs(variant: str, shape, causal: bool, options: dict, seed: int) -> dict:
    """The launch's inputs, bf16: unit-norm q / k (and q2 / k2) for the threshold variants, the portable
    forward's out and lse2 for the softmax family."""
    import torch.nn.functional as F

    bsz, n, kv, h, h_kv, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(length, heads, unit=False):
        x = torch.randn(bsz, length, heads, d, device="cuda", generator=g)
        return (F.normalize(x, dim=-1) if unit else x).to(torch.bfloat16)

    unit = variant in ("threshold", "diff_threshold")
    x = {"q": rand(n, h, unit), "k": rand(kv, h_kv, unit), "v": rand(kv, h_kv), "do": rand(n, h)}
    if variant == "diff_threshold":
        x["q2"], x["k2"] = rand(n, h, True), rand(kv, h_kv, True)
        x["lam"] = torch.rand(h, device="cuda", generator=g) * 0.8
    if variant in CAPS:
        from check_gluon_softmax_bwd_gpu import portable_forward

        cap, cap_value, knee = CAPS[variant]
        sm_scale = 1.0 / math.sqrt(d)
        t = torch.rand(bsz, n, device="cuda", generator=g) * 2.5 - 0.5 if options.get("temperature") else None
        x["out"], x["lse2"] = portable_forward(x["q"], x["k"], x["v"], sm_scale, causal, t, cap, cap_value, knee)
        x["t"] = t
    return x


def launcher(modules: dict, variant: str, causal: bool, options: dict, x: dict):
    """A no-argument call of `modules`' backward launch for the case."""
    d = x["q"].shape[-1]
    if variant in CAPS:
        cap, cap_value, knee = CAPS[variant]
        mod = modules["gluon_softmax_bwd"]
        return lambda: mod.launch_backward(x["q"], x["k"], x["v"], x["out"], x["do"], x["lse2"], 1.0 / math.sqrt(d),
                                           causal, cap=cap, cap_value=cap_value, knee=knee, temperature=x["t"],
                                           form=options.get("form", "separate"),
                                           persistent=options.get("persistent", False))
    if variant == "threshold":
        mod = modules["gluon_weighted_bwd"]
        return lambda: mod.launch_threshold_backward(x["q"], x["k"], x["v"], x["do"], causal, 1.0, 2.0,
                                                     persistent=options.get("persistent", False))
    if variant == "sigmoid":
        mod = modules["gluon_weighted_bwd"]
        return lambda: mod.launch_sigmoid_backward(x["q"], x["k"], x["v"], x["do"], causal, 1.0 / math.sqrt(d), None,
                                                   persistent=options.get("persistent", False))
    mod = modules["gluon_diff_bwd"]
    return lambda: mod.launch_diff_threshold_backward(
        x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], x["do"], causal, 1.0, 2.0,
        dkdv_form=options.get("dkdv_form", "key_halves"), persistent=options.get("persistent", False),
        dq_form=options.get("dq_form", "rows"))


def selected(cases: list, variants: list[str] | None, head_dims: list[int] | None):
    """(index, case) of the cases of these variants and head dims (None: any)."""
    return [(index, case) for index, case in enumerate(cases)
            if (variants is None or case[0] in variants) and (head_dims is None or case[1][-1] in head_dims)]


def label(variant, shape, causal, options) -> str:
    opts = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{variant} {shape} {'causal' if causal else 'full'}{' ' + opts if opts else ''}"


def main() -> int:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="folder with the other version's kernel files")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--variants", nargs="*", default=None, help="only these variants' cases (default: all)")
    ap.add_argument("--head-dims", nargs="*", type=int, default=None, help="only cases of these head dims")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    versions = load_versions(args.old)
    results = {**result_header(), "old": str(args.old), "bits": [], "timing": []}
    json_path = args.out / "ab_gluon_backward.json"
    dump = lambda: json_path.write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    failed = 0
    print(f"{'case':<100} bits")
    for index, (variant, shape, causal, options) in selected(CASES, args.variants, args.head_dims):
        row = {"case": label(variant, shape, causal, options)}
        try:
            x = make_inputs(variant, shape, causal, options, seed=3000 + index)
            grads = {name: launcher(mods, variant, causal, options, x)() for name, mods in versions.items()}
            torch.cuda.synchronize()
            row["equal"] = all(torch.equal(a, b) for a, b in zip(grads["old"], grads["new"]))
            row["max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                      for a, b in zip(grads["old"], grads["new"]))
        except Exception:
            row["error"] = traceback.format_exc(limit=4)
        ok = row.get("equal", False)
        failed += not ok
        results["bits"].append(row)
        dump()  # each row as it comes: a run cut short keeps what it measured
        print(f"{row['case']:<100} {'equal' if ok else 'DIFFER ' + str(row.get('max_abs_diff', 'error'))}")
        if "error" in row:
            print(row["error"])
    if not args.no_timing:
        print(f"\n{'case':<84}{'old ms':>10}{'new ms':>10}{'old/new':>9}")
        for index, (variant, shape, causal, options) in selected(TIMED, args.variants, args.head_dims):
            row = {"case": label(variant, shape, causal, options)}
            try:
                x = make_inputs(variant, shape, causal, options, seed=4000 + index)
                fns = {name: launcher(mods, variant, causal, options, x) for name, mods in versions.items()}
                for fn in fns.values():
                    fn()
                times = {name: [] for name in fns}
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
                row.update({f"{name}_ms": statistics.median(ms) for name, ms in times.items()})
                row["rounds_ms"] = times
                row["old_over_new"] = row["old_ms"] / row["new_ms"]
                print(f"{row['case']:<84}{row['old_ms']:>10.4f}{row['new_ms']:>10.4f}{row['old_over_new']:>8.3f}x")
            except Exception:
                row["error"] = traceback.format_exc(limit=4)
                failed += 1
                print(f"{row['case']:<84} error\n{row['error']}")
            results["timing"].append(row)
            dump()
    dump()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
