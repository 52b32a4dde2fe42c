"""Every kernel family on a reduced matrix of small shapes, for `compute-sanitizer`.

Every mask kind, odd N (1, 17, 127, 200, 333), GQA 1/2/4, head dims 64/128, temperature, the
differential form and sigmoid's two biases (the spec's, and -ln n_i), forward and backward, bf16, each case also checked against the float64
reference (DESIGN.md §6 rule, NaN-poisoned outputs). Tile configs rotate through each kernel's
candidate list, so every tile shape is launched. Exits non-zero on an error-ratio failure;
memory errors are the sanitizer's to report (it exits non-zero with --error-exitcode).

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/gpu_checks/sanitize_kernels.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch

# one fixed tile config per launch (the case picks it): no autotuning runs under the sanitizer
os.environ["ATTNLAB_AUTOTUNE"] = "0"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_softmax_family_gpu as sfc  # noqa: E402
import check_threshold_gpu as thc  # noqa: E402
from attn.testing import nan_poisoned_empty  # noqa: E402

LENGTHS = (1, 17, 127, 200, 333)


def softmax_family_cases():
    for i, (cap, mask_name) in enumerate(itertools.product(sfc.VARIANT_OF_CAP, sfc.MASKS)):
        # (cap, mask, N, GQA group, temperature, dtype, tile config index, head dim)
        yield cap, mask_name, LENGTHS[i % len(LENGTHS)], (1, 2, 4)[i % 3], i % 2 == 0, torch.bfloat16, i, (64, 128)[i % 2]


def threshold_cases():
    for i, (mask_name, differential) in enumerate(itertools.product(thc.MASKS, (False, True))):
        n = LENGTHS[i % len(LENGTHS)]
        h_kv = (4, 2, 1)[i % 3]
        # (name, B, N, H, H_kv, D, p, beta, mask, differential, tile config index)
        yield (f"{'diff' if differential else 'thr'} {mask_name} N={n}", 2, n, 4, h_kv, (64, 128)[i % 2],
               (1.0, 2.0, 1.5)[i % 3], ("dense", "sparse", "zero")[i % 3], mask_name, differential, i % 2)


def sigmoid_cases():
    for i, (mask_name, bias) in enumerate(itertools.product(thc.MASKS, (None, -1.5))):
        # (name, B, N, H, H_kv, D, bias, mask, tile config index)
        n = LENGTHS[i % len(LENGTHS)]
        yield (f"sigmoid {mask_name} bias={bias} N={n}", 2, n, 4, (4, 2, 1)[i % 3], (64, 128)[i % 2], bias,
               mask_name, i % 2)


def check_sigmoid_case(name, b, n, h, h_kv, d, bias, mask_name, config):
    """Max error ratios (<= 1 passes) of one sigmoid case, kernel in bf16 vs float64 / bf16 references."""
    from attn.kernels import sigmoid_family as sg
    from attn.masks import MaskSpec
    from attn.reference import reference_attention
    from attn.specs import SigmoidFamilySpec
    from attn.testing import error_ratio, outputs_and_grads, random_segment_ids

    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    causal, window, with_seg = thc.MASKS[mask_name]
    mask = MaskSpec(causal=causal, window=window)
    spec = SigmoidFamilySpec(bias=bias)
    seg = (random_segment_ids(b, n, gen, min_history=n // 4, max_history=n // 2, padding_row=True).to(thc.DEVICE)
           if with_seg else None)
    tensors = {"q": torch.randn(b, n, h, d, generator=gen, dtype=torch.float64),
               "k": torch.randn(b, n, h_kv, d, generator=gen, dtype=torch.float64),
               "v": torch.randn(b, n, h_kv, d, generator=gen, dtype=torch.float64)}
    dout = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64).to(thc.DEVICE)

    def leaves(dtype):
        return {key: t.to(thc.DEVICE, dtype).requires_grad_() for key, t in tensors.items()}

    def reference(q, k, v):
        return reference_attention(q, k, v, spec, mask, seg)

    def fused(q, k, v):
        return sg.fused_attention(q, k, v, spec, mask, seg)

    ref64 = outputs_and_grads(reference, leaves(torch.float64), dout)
    same = outputs_and_grads(reference, leaves(torch.bfloat16), dout)
    with nan_poisoned_empty(), thc.environment({"ATTNLAB_KERNEL_CONFIG": str(config)}):
        got = outputs_and_grads(fused, leaves(torch.bfloat16), dout)
    return {key: error_ratio(got[key], same[key], want, thc.FLOOR) for key, want in ref64.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["all", "softmax", "threshold", "sigmoid"], default="all")
    ap.add_argument("--from-case", type=int, default=0, help="skip the softmax-family cases before this index")
    args = ap.parse_args()
    t0 = time.time()
    worst, failed, count = 0.0, [], 0

    def record(name: str, ratios: dict) -> None:
        nonlocal worst, count
        count += 1
        worst = max(worst, *ratios.values())
        if max(ratios.values()) > 1:
            failed.append(name)
        print(f"{'ok' if max(ratios.values()) <= 1 else 'FAIL':4} {name:48} max ratio {max(ratios.values()):.3f}",
              flush=True)

    if args.family in ("all", "softmax"):
        with nan_poisoned_empty():
            for cap, mask_name, n, group, temp, dtype, cfg, d in softmax_family_cases():
                if cfg < args.from_case:  # cfg is the case index
                    continue
                # seed = the case index: a --from-case run checks the same inputs
                record(f"{cap} {mask_name} N={n} G={group} D={d} t={int(temp)} cfg={cfg}",
                       sfc.run_case(cap, mask_name, n, group, temp, dtype, cfg, d=d, batch=3, seed=cfg))
    if args.family in ("all", "threshold"):
        for case in threshold_cases():
            record(case[0], thc.check_case(*case))
    if args.family in ("all", "sigmoid"):
        for case in sigmoid_cases():
            record(case[0], check_sigmoid_case(*case))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"{count} cases in {time.time() - t0:.0f}s, max error ratio {worst:.3f}, failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
