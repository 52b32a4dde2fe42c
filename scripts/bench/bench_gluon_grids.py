"""The Gluon softmax-family forward's two grids side by side on an sm_90 GPU: a program per work item
against the persistent grid (attn/kernels/gluon_pipeline.py), beside SDPA, in one process.

Per shape (causal, bf16): the persistent grid's out and lse2 against the per-item grid's, bit for bit (the
same arithmetic per item), then the do_bench median ms of SDPA (cuDNN) and of both grids' direct entries
(`gluon_softmax_fwd.launch_forward`), plain softmax and tanh (c = 30, its bound shift); then the forward
(no gradient) through `attn.attention` as a user calls it (ATTNLAB_GLUON and ATTNLAB_GLUON_PERSISTENT as
set: by default the timed choices), softmax and softcap_tanh, with the tiers and grids those calls chose
(`tuned_configs()`). With
--heads-per-group G the persistent grid's work-item order takes groups of G (batch, head) pairs
(`gluon_pipeline.HEADS_PER_WORK_GROUP`, a compile-time constant: set before the first compile, so one
value per process).

    python scripts/bench/bench_gluon_grids.py [--shapes 16,1024,12,64 4,4096,16,128] [--heads-per-group 2]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from timing import median_ms, result_header  # noqa: E402

LOG2E = 1.4426950408889634
CAP = 30.0
SHAPES = ["16,1024,12,64", "8,1024,16,128", "8,2048,16,64", "4,4096,16,128"]


def forward(q, k, v, persistent: bool, capped: bool):
    from attn.kernels import gluon_softmax_fwd

    sm_scale = q.shape[-1] ** -0.5
    if not capped:
        return lambda: gluon_softmax_fwd.launch_forward(q, k, v, True, sm_scale * LOG2E, persistent=persistent)
    return lambda: gluon_softmax_fwd.launch_forward(q, k, v, True, CAP * LOG2E, cap=1, cap_scale=sm_scale / CAP,
                                                    shift=CAP * LOG2E, persistent=persistent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES, help="B,N,H,D (causal, bf16)")
    ap.add_argument("--heads-per-group", type=int, default=None,
                    help="the persistent grid's (batch, head) pairs per work-item group (default: the module's)")
    ap.add_argument("--out", default=None, help="write a JSON of the rows")
    args = ap.parse_args()
    from triton.experimental.gluon import language as gl

    import attn
    from attn.kernels import gluon_pipeline, softmax_family

    if args.heads_per_group is not None:  # before anything compiles the persistent kernel
        gluon_pipeline.HEADS_PER_WORK_GROUP = gl.constexpr(args.heads_per_group)
        gluon_pipeline.work_item.__globals__["HEADS_PER_WORK_GROUP"] = gl.constexpr(args.heads_per_group)
    rows = []
    for shape in args.shapes:
        b, n, h, d = (int(x) for x in shape.split(","))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        row = {"shape": [b, n, h, d],
               "sdpa_ms": median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))}
        for name, capped in (("softmax", False), ("tanh", True)):
            per_item, persistent = forward(q, k, v, False, capped), forward(q, k, v, True, capped)
            a, p = per_item(), persistent()
            row[f"{name}_bitwise"] = bool(torch.equal(a[0], p[0]) and torch.equal(a[1], p[1]))
            row[f"{name}_per_item_ms"] = median_ms(per_item)
            row[f"{name}_persistent_ms"] = median_ms(persistent)
        for variant, params in (("softmax", {}), ("softcap_tanh", {"cap": CAP})):
            spec = attn.get_variant(variant).make_spec(**params)
            with torch.no_grad():
                row[f"{variant}_public_ms"] = median_ms(lambda: attn.attention(q, k, v, spec, causal=True))
        rows.append(row)
        print(f"{shape}: SDPA {row['sdpa_ms']:.4f} ms | " + " | ".join(
            f"{name} per item {row[f'{name}_per_item_ms']:.4f}, persistent {row[f'{name}_persistent_ms']:.4f} ms"
            f" ({row[f'{name}_per_item_ms'] / row[f'{name}_persistent_ms']:.2f}x), bitwise {row[f'{name}_bitwise']}"
            for name in ("softmax", "tanh")) + " | through attn.attention: " + ", ".join(
            f"{variant} {row[f'{variant}_public_ms']:.4f} ms" for variant in ("softmax", "softcap_tanh")), flush=True)
    choices = {key: value for key, value in softmax_family.tuned_configs().items() if " tier, " in key or "grid" in key}
    for key, value in choices.items():
        print(f"{key} -> {value}")
    if args.out:
        meta = {**result_header(), "heads_per_group": gluon_pipeline.HEADS_PER_WORK_GROUP.value}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "choices": choices}, indent=1))
    if not all(row[f"{name}_bitwise"] for row in rows for name in ("softmax", "tanh")):
        sys.exit(1)


if __name__ == "__main__":
    main()
