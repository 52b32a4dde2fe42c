"""GPU check: non-finite inputs propagate through the fused kernels as through the reference.

Per variant (bf16 and fp32): a NaN query row, a NaN key and a NaN / infinite temperature; the
kernel output must be NaN exactly where the reference's is, and its gradients non-finite when the
reference's are (tests/test_reliability.py runs the same cases under the interpreter).

    python scripts/check_nonfinite_gpu.py [--variants threshold,diff_threshold]

Each case compiles its kernels on first use (about 4 s); ATTNLAB_AUTOTUNE=0 skips the timing of
tile candidates, which a correctness check does not need.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attn  # noqa: E402
from attn.testing import nonfinite_cases, nonfinite_pattern  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(attn.variant_names()), help="comma list (default: every variant)")
    names = ap.parse_args().variants.split(",")
    failed = 0
    for name in names:
        spec = attn.get_variant(name).make_spec()
        for dtype in (torch.bfloat16, torch.float32):
            for label, tensors in nonfinite_cases(name, torch.device("cuda"), dtype):
                (ref_nan, ref_finite), (ker_nan, ker_finite) = (nonfinite_pattern(spec, tensors, backend)
                                                                for backend in ("reference", "triton"))
                ok = bool(ref_nan.any()) and torch.equal(ker_nan, ref_nan) and ker_finite == ref_finite
                failed += not ok
                print(f"{'ok' if ok else 'FAIL':4} {name:16} {str(dtype)[6:]:8} {label:16} NaN outputs "
                      f"{int(ker_nan.sum())} (reference {int(ref_nan.sum())}), gradients finite {ker_finite} "
                      f"(reference {ref_finite})", flush=True)
    print("all pass" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
