"""GPU correctness matrix of the fused softmax-family kernels (bf16 and fp16, larger sizes).

Same rule as the CPU tests (DESIGN.md §6): error vs the float64 reference <= 2x the error
of the PyTorch reference in the kernel's dtype + a small floor, for out, dq, dk, dv and
d-temperature. Every cap x every mask kind (and compositions), GQA 1/2/4, odd N, fully
masked rows; outputs NaN-poisoned. Tile configs rotate through the autotuner's list so
every shape of tile is checked. Prints the max error ratio per quantity (<= 1 passes).

    python scripts/gpu_checks/check_softmax_family_gpu.py [--json OUT.json] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import attn  # noqa: E402
from attn.kernels import runtime  # noqa: E402
from attn.kernels import softmax_family as sf  # noqa: E402
from attn.masks import MaskSpec  # noqa: E402
from attn.testing import (  # noqa: E402
    error_ratio, nan_poisoned_empty, random_segment_ids, softmax_family_outputs_and_grads,
)
from attn.reference import reference_attention  # noqa: E402

DEVICE = os.environ.get("ATTNLAB_CHECK_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: dry run of the script
VARIANT_OF_CAP = {"none": "softmax", "tanh": "softcap_tanh", "soft_sign": "softcap_softsign", "alsc": "alsc"}
MASKS = {
    "full": (MaskSpec(causal=False), False),
    "causal": (MaskSpec(causal=True), False),
    "window": (MaskSpec(causal=True, window=200), False),
    "ranker": (MaskSpec(causal=False), True),
    "ranker+causal": (MaskSpec(causal=True), True),
    "ranker+window": (MaskSpec(causal=True, window=150), True),
}



def set_configs(i):
    """Pin every kernel to the i-th candidate of its config list (no timing; attn/kernels/runtime.py)."""
    os.environ[runtime.CONFIG_ENV] = str(i)


def run_case(cap, mask_name, n, group, temp, dtype, cfg, d=128, batch=3, h_kv=2, seed=0):
    mask, seg = MASKS[mask_name]
    dev = DEVICE
    gen = torch.Generator().manual_seed(seed)
    h = h_kv * group
    cap_value = 5.0
    q = (torch.randn(batch, n, h, d, generator=gen, dtype=torch.float64) * 1.5).to(dev)
    k = (torch.randn(batch, n, h_kv, d, generator=gen, dtype=torch.float64) * 1.5).to(dev)
    v = torch.randn(batch, n, h_kv, d, generator=gen, dtype=torch.float64).to(dev)
    do = torch.randn(batch, n, h, d, generator=gen, dtype=torch.float64).to(dev)
    t = (torch.rand(batch, n, generator=gen, dtype=torch.float64) * 1.5 + 0.25).to(dev) if temp else None
    ids = random_segment_ids(batch, n, gen, min_history=n // 4, max_history=n // 2, padding_row=True).to(dev) if seg else None
    params = {} if cap == "none" else {"cap": cap_value}
    spec = attn.get_variant(VARIANT_OF_CAP[cap]).make_spec(**params)
    set_configs(cfg)

    ref, same, fused = (softmax_family_outputs_and_grads(fn, q, k, v, t, do, spec, mask, ids, dt)
                        for fn, dt in ((reference_attention, torch.float64), (reference_attention, dtype),
                                       (sf.fused_attention, dtype)))
    ratios = {name: error_ratio(f, s, r, floor=1e-4 * max(1.0, r.abs().max().item()))
              for name, f, s, r in zip(("out", "dq", "dk", "dv", "dtemp"), fused, same, ref)}
    if seg and batch > 2:  # the all-padding row: zeros, zero gradient
        assert (fused[0][-1] == 0).all() and (fused[1][-1] == 0).all()
    return ratios


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fixed-only", action="store_true", help="only the single-key / fixed-shift cases")
    ap.add_argument("--from-case", type=int, default=0, help="skip the first cases (resume a cut-off run)")
    args = ap.parse_args()
    nan_poisoned_empty().__enter__()  # the whole check runs with NaN-poisoned allocations
    lengths = (1, 17, 127, 200, 333, 1000, 2048)
    groups = (1, 2, 4)
    cases = []
    for i, (cap, mask_name) in enumerate(itertools.product(VARIANT_OF_CAP, MASKS)):
        n = lengths[(i * 3) % len(lengths)] if i % 4 else (2048 if i % 8 == 0 else 1000)
        cases.append((cap, mask_name, n, groups[i % 3], i % 2 == 0, torch.bfloat16, i, 128 if i % 3 else 64))
    cases += [(cap, "causal", 777, 2, True, torch.float16, j, 64) for j, cap in enumerate(VARIANT_OF_CAP)]
    # single-key rows without temperature (the fixed-shift forward path): dq must be ~0
    cases += [(cap, "causal", n, 1, False, torch.bfloat16, j, 128) for j, cap in enumerate(VARIANT_OF_CAP)
              for n in (1, 65)]
    if args.fixed_only:
        cases = cases[-8:]
    elif args.quick:
        cases = cases[:28:6] + cases[-8:]
    cases = cases[args.from_case:]
    worst: dict[str, float] = {}
    rows = []
    t0 = time.time()
    for cap, mask_name, n, group, temp, dtype, cfg, d in cases:
        r = run_case(cap, mask_name, n, group, temp, dtype, cfg, d=d, seed=len(rows))
        rows.append({"cap": cap, "mask": mask_name, "N": n, "group": group, "temperature": temp, "D": d,
                     "dtype": str(dtype).split(".")[-1], "config": cfg, **r})
        for key, val in r.items():
            worst[key] = max(worst.get(key, 0.0), val)
        flag = "ok" if max(r.values()) <= 1 else "FAIL"
        print(f"{flag:4} {cap:9} {mask_name:14} N={n:5} G={group} D={d} t={int(temp)} {str(dtype)[6:]:8} cfg={cfg} "
              + " ".join(f"{k}={v:.3f}" for k, v in r.items()), flush=True)
        if args.json:  # after every case: a run cut off by a time limit keeps its results
            Path(args.json).write_text(json.dumps({"worst": worst, "cases": rows}, indent=1))
    print(f"max error ratio (<= 1 passes) over {len(rows)} cases in {time.time() - t0:.0f}s: "
          + " ".join(f"{k}={v:.3f}" for k, v in worst.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"worst": worst, "cases": rows}, indent=1))
    failed = [r for r in rows if max(v for k, v in r.items() if k in worst) > 1]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
