"""The Gluon kernels' two grids side by side on an sm_90 GPU: a program per work item against the
persistent grid (attn/kernels/gluon_pipeline.py), beside SDPA, in one process.

Per shape (causal, bf16) and form (plain softmax; tanh, c = 30, its bound shift; threshold p = 2 on unit-norm
q, k; sigmoid; the differential threshold p = 2, unit-norm views): the persistent grid's outputs against the
per-item grid's, bit for bit (the same arithmetic per item), then the do_bench median ms of SDPA (cuDNN) and
of both grids' direct entries (`gluon_softmax_fwd.launch_forward`, `gluon_weighted_fwd.launch_threshold` /
`launch_sigmoid`, `gluon_diff_fwd.launch_diff_threshold`); then the forward (no gradient) through
`attn.attention` as a user calls it (ATTNLAB_GLUON and ATTNLAB_GLUON_PERSISTENT as set: by default the timed
choices) of each form's variant, with the tiers and grids those calls chose (`tuned_configs()`). The backward
forms (threshold_bwd, sigmoid_bwd, softmax_bwd, tanh_bwd): the same for
`gluon_weighted_bwd.launch_threshold_backward` / `launch_sigmoid_backward` and
`gluon_softmax_bwd.launch_backward` (its separate dq form, after the Gluon forward; dq, dk, dv bit for bit),
SDPA's forward + backward, and the forward + backward through `attn.attention` (whose backward plans offer
the persistent grid to the families in `tiers.PERSISTENT_BACKWARDS_OFFERED`). With
--heads-per-group G the persistent grid's work-item order takes groups of G (batch, head) pairs
(`gluon_pipeline.HEADS_PER_WORK_GROUP`, a compile-time constant: set before the first compile, so one
value per process).

    python scripts/bench/bench_gluon_grids.py [--shapes 16,1024,12,64 4,4096,16,128] [--forms softmax threshold]
        [--heads-per-group 2] [--out FILE.json]
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


# form -> (variant, its spec parameters) of the calls through attn.attention
FORMS = {"softmax": ("softmax", {}), "tanh": ("softcap_tanh", {"cap": CAP}), "threshold": ("threshold", {}),
         "sigmoid": ("sigmoid", {}), "diff_threshold": ("diff_threshold", {}),
         "threshold_bwd": ("threshold", {}), "sigmoid_bwd": ("sigmoid", {}), "softmax_bwd": ("softmax", {}),
         "tanh_bwd": ("softcap_tanh", {"cap": CAP})}


def inputs(form: str, b: int, n: int, h: int, d: int) -> dict:
    """The form's operands (bf16, seeded): unit-norm q and k (and the second view) for the threshold forms,
    whose thresholds then bind; per-head lambdas of both signs for the differential threshold."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(unit: bool):
        x = torch.randn(b, n, h, d, device="cuda", generator=gen)
        return (F.normalize(x, dim=-1) if unit else x).to(torch.bfloat16)

    unit = form in ("threshold", "diff_threshold", "threshold_bwd")
    x = {"q": draw(unit), "k": draw(unit), "v": draw(False)}
    if form.endswith("_bwd"):
        x["do"] = draw(False)
    if form == "diff_threshold":
        x.update(q2=draw(True), k2=draw(True), lam=torch.linspace(-0.5, 1.0, h, device="cuda"))
    return x


def direct(form: str, x: dict, persistent: bool):
    """The form's direct Gluon entry on one grid, as a callable."""
    from attn.kernels import gluon_diff_fwd, gluon_softmax_fwd, gluon_weighted_bwd, gluon_weighted_fwd

    q, k, v = x["q"], x["k"], x["v"]
    sm_scale = q.shape[-1] ** -0.5
    if form == "threshold_bwd":
        return lambda: gluon_weighted_bwd.launch_threshold_backward(q, k, v, x["do"], True, 1.0, 2.0,
                                                                    persistent=persistent)
    if form == "sigmoid_bwd":
        return lambda: gluon_weighted_bwd.launch_sigmoid_backward(q, k, v, x["do"], True, sm_scale, None,
                                                                  persistent=persistent)
    if form in ("softmax_bwd", "tanh_bwd"):
        from attn.kernels import gluon_softmax_bwd

        caps = dict(cap=1, cap_value=CAP) if form == "tanh_bwd" else {}
        if "lse2" not in x:
            fwd = (dict(cap=1, cap_scale=sm_scale / CAP, shift=CAP * LOG2E) if form == "tanh_bwd" else {})
            x["out"], x["lse2"] = gluon_softmax_fwd.launch_forward(q, k, v, True, (CAP if caps else sm_scale) * LOG2E,
                                                                   **fwd)
        return lambda: gluon_softmax_bwd.launch_backward(q, k, v, x["out"], x["do"], x["lse2"], sm_scale, True,
                                                         form="separate", persistent=persistent, **caps)
    if form == "softmax":
        return lambda: gluon_softmax_fwd.launch_forward(q, k, v, True, sm_scale * LOG2E, persistent=persistent)
    if form == "tanh":
        return lambda: gluon_softmax_fwd.launch_forward(q, k, v, True, CAP * LOG2E, cap=1, cap_scale=sm_scale / CAP,
                                                        shift=CAP * LOG2E, persistent=persistent)
    if form == "threshold":
        return lambda: gluon_weighted_fwd.launch_threshold(q, k, v, True, 1.0, 2.0, persistent=persistent)
    if form == "sigmoid":
        return lambda: gluon_weighted_fwd.launch_sigmoid(q, k, v, True, sm_scale, None, persistent=persistent)
    return lambda: gluon_diff_fwd.launch_diff_threshold(q, k, v, x["q2"], x["k2"], x["lam"], True, 1.0, 2.0,
                                                        persistent=persistent)


def public(form: str, x: dict):
    """The form's forward (no gradient; a backward form: forward + backward) through attn.attention, as a
    callable."""
    import attn

    variant, params = FORMS[form]
    spec = attn.get_variant(variant).make_spec(**params)
    extra = {"q2": x["q2"], "k2": x["k2"], "lam": x["lam"]} if form == "diff_threshold" else None
    if form.endswith("_bwd"):
        q, k, v = (x[name].detach().requires_grad_() for name in "qkv")

        def step():
            attn.attention(q, k, v, spec, causal=True).backward(x["do"])
        return step

    def call():
        with torch.no_grad():
            return attn.attention(x["q"], x["k"], x["v"], spec, causal=True, extra=extra)
    return call


def same_bits(a, b) -> bool:
    a, b = (t if isinstance(t, tuple) else (t,) for t in (a, b))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES, help="B,N,H,D (causal, bf16)")
    ap.add_argument("--forms", nargs="*", default=list(FORMS), choices=list(FORMS))
    ap.add_argument("--heads-per-group", type=int, default=None,
                    help="the persistent grid's (batch, head) pairs per work-item group (default: the module's)")
    ap.add_argument("--out", default=None, help="write a JSON of the rows")
    args = ap.parse_args()
    from triton.experimental.gluon import language as gl

    from attn.kernels import gluon_pipeline, sigmoid_family, softmax_family, threshold_family

    if args.heads_per_group is not None:  # before anything compiles the persistent kernel
        gluon_pipeline.HEADS_PER_WORK_GROUP = gl.constexpr(args.heads_per_group)
        gluon_pipeline.work_item.__globals__["HEADS_PER_WORK_GROUP"] = gl.constexpr(args.heads_per_group)
    rows = []
    for shape in args.shapes:
        b, n, h, d = (int(x) for x in shape.split(","))
        gen = torch.Generator(device="cuda").manual_seed(0)
        qt, kt, vt = (torch.randn(b, h, n, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
        row = {"shape": [b, n, h, d],
               "sdpa_ms": median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))}
        parts = []
        if any(form.endswith("_bwd") for form in args.forms):
            qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
            dog = torch.randn_like(qt)
            row["sdpa_fwd_bwd_ms"] = median_ms(
                lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dog))
            parts.append(f"SDPA fwd+bwd {row['sdpa_fwd_bwd_ms']:.4f} ms")
        for form in args.forms:
            x = inputs(form, b, n, h, d)
            per_item, persistent = direct(form, x, False), direct(form, x, True)
            row[f"{form}_bitwise"] = same_bits(per_item(), persistent())
            row[f"{form}_per_item_ms"] = median_ms(per_item)
            row[f"{form}_persistent_ms"] = median_ms(persistent)
            row[f"{form}_public_ms"] = median_ms(public(form, x))
            parts.append(f"{form} per item {row[f'{form}_per_item_ms']:.4f}, persistent "
                         f"{row[f'{form}_persistent_ms']:.4f} ms "
                         f"({row[f'{form}_per_item_ms'] / row[f'{form}_persistent_ms']:.2f}x), "
                         f"bitwise {row[f'{form}_bitwise']}, attn.attention "
                         f"{'fwd+bwd ' if form.endswith('_bwd') else ''}{row[f'{form}_public_ms']:.4f} ms")
            del x
        rows.append(row)
        print(f"{shape}: SDPA {row['sdpa_ms']:.4f} ms\n  " + "\n  ".join(parts), flush=True)
    choices = {key: value for family in (softmax_family, threshold_family, sigmoid_family)
               for key, value in family.tuned_configs().items() if " tier, " in key or "grid" in key}
    for key, value in choices.items():
        print(f"{key} -> {value}")
    if args.out:
        meta = {**result_header(), "heads_per_group": gluon_pipeline.HEADS_PER_WORK_GROUP.value,
                "persistent_backwards_offered": args.offer_persistent_backwards}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "choices": choices}, indent=1))
    if not all(row[f"{form}_bitwise"] for row in rows for form in args.forms):
        sys.exit(1)


if __name__ == "__main__":
    main()
