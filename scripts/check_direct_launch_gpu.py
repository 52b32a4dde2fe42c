"""GPU check: the runtime's direct launches give bitwise the results of Triton's JIT launches.

A launch after the first of a specialization skips Triton's JIT (attn/kernels/runtime.py). Per
variant and mask kind: inputs A are run once (the first launch: JIT, compiles), then fresh inputs B
of the same shapes (direct launches: new pointers, same compiled kernels), then B again with
ATTNLAB_DIRECT_LAUNCH=0. Outputs and gradients of the last two must be equal bit for bit; configs
are pinned so both paths run the same tiles. Also: B through the direct path against the float64
reference with the DESIGN.md rule (error <= 2x the bf16 reference's + floor).

    python scripts/check_direct_launch_gpu.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attn  # noqa: E402
from attn.kernels.runtime import DIRECT_ENV  # noqa: E402
from attn.testing import error_ratio, nan_poisoned_empty, random_segment_ids  # noqa: E402

VARIANTS = {"softmax": {}, "softcap_tanh": {"cap": 5.0}, "alsc": {"cap": 5.0, "knee": 0.5},
            "softcap_softsign": {"cap": 5.0}, "threshold": {}, "diff_threshold": {}}
MASKS = {"causal": dict(causal=True), "window": dict(causal=True, window=100), "full": dict(causal=False),
         "ranker": dict(causal=False, ranker=True)}


def make_inputs(variant, mask, gen, b=2, n=333, h=4, h_kv=2, d=64):
    threshold = variant in ("threshold", "diff_threshold")

    def t(heads, unit=False):
        x = torch.randn(b, n, heads, d, generator=gen, dtype=torch.float64)
        return F.normalize(x, dim=-1) if unit else x

    x = {"q": t(h, threshold), "k": t(h_kv, threshold), "v": t(h_kv), "do": t(h)}
    if variant == "diff_threshold":
        x.update(q2=t(h, True), k2=t(h_kv, True), lam=torch.rand(h, generator=gen, dtype=torch.float64))
    if not threshold and mask == "causal":
        x["temperature"] = torch.rand(b, n, generator=gen, dtype=torch.float64) + 0.5
    ids = random_segment_ids(b, n, gen, min_history=n // 4, max_history=n // 2) if mask == "ranker" else None
    return {k: v.cuda() for k, v in x.items()}, (ids.cuda() if ids is not None else None)


def outputs_and_grads(spec, mask, x, ids, dtype, backend):
    opts = {k: v for k, v in MASKS[mask].items() if k != "ranker"}
    q, k, v = (x[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v"))
    extra = {n: x[n].detach().to(dtype).requires_grad_() for n in ("q2", "k2", "lam") if n in x}
    temperature = x["temperature"].detach().to(dtype).requires_grad_() if "temperature" in x else None
    out = attn.attention(q, k, v, spec, segment_ids=ids, backend=backend, temperature=temperature, extra=extra,
                         **opts)
    out.backward(x["do"].to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            **{f"d{n}": t.grad for n, t in extra.items()},
            **({"dtemperature": temperature.grad} if temperature is not None else {})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--masks", default=",".join(MASKS), help="comma list of mask kinds")
    args = ap.parse_args()
    os.environ["ATTNLAB_AUTOTUNE"] = "0"  # both paths on the same (first) tile configs
    gen = torch.Generator().manual_seed(0)
    rows, failed = [], 0
    bf16 = torch.bfloat16
    with nan_poisoned_empty():
        for variant, params in VARIANTS.items():
            spec = attn.get_variant(variant).make_spec(**params)
            for mask in args.masks.split(","):
                first, ids_first = make_inputs(variant, mask, gen)
                outputs_and_grads(spec, mask, first, ids_first, bf16, "triton")  # first launches: the JIT
                x, ids = make_inputs(variant, mask, gen)
                direct = outputs_and_grads(spec, mask, x, ids, bf16, "triton")
                os.environ[DIRECT_ENV] = "0"
                jit = outputs_and_grads(spec, mask, x, ids, bf16, "triton")
                os.environ.pop(DIRECT_ENV)
                ref = outputs_and_grads(spec, mask, x, ids, torch.float64, "reference")
                same = outputs_and_grads(spec, mask, x, ids, bf16, "reference")
                bitwise = all(torch.equal(direct[k], jit[k]) for k in direct)
                ratio = max(error_ratio(direct[k], same[k], ref[k], floor=1e-3 * max(1.0, ref[k].abs().max().item()))
                            for k in ref)
                ok = bitwise and ratio <= 1
                failed += not ok
                rows.append({"variant": variant, "mask": mask, "bitwise_equal_to_jit": bitwise, "error_ratio": ratio})
                print(f"{'ok' if ok else 'FAIL':4} {variant:16} {mask:7} bitwise={bitwise} error_ratio={ratio:.3f}",
                      flush=True)
    print(f"{len(rows) - failed} passed, {failed} failed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
