"""SASS instruction counts of the Gluon sm_90 softmax forward's two key-block loops, compiled on a CPU.

No GPU: the kernel module (attn/kernels/gluon_softmax_fwd.py, or another version of it) is loaded by
its path, with the repository's `attn` package importable (torch, CPU build, is enough), and
`compile_sm90` builds the kernel for sm_90 with the ptxas Triton ships; cuobjdump (also Triton's) gives
the SASS and the launch's register count. The kernel is written against Triton 3.6's Gluon API, so run
it with a Triton 3.6 environment:

    /work/venv36/bin/python scripts/analysis/gluon_sass_counts.py                            # D 64/128, causal or not
    python scripts/analysis/gluon_sass_counts.py --head-dim 128 --causal 1 --sass /tmp/sass  # also each loop's SASS
    python scripts/analysis/gluon_sass_counts.py --kernel /tmp/old_gluon_softmax_fwd.py         # another version of it
    python scripts/analysis/gluon_sass_counts.py --variant tanh alsc temperature             # the capped / tempered forms
    python scripts/analysis/gluon_sass_counts.py --variant bwd_dkdv bwd_dq                   # the softmax backward's kernels
    python scripts/analysis/gluon_sass_counts.py --variant threshold_bwd_dkdv sigmoid_bwd_dq  # the weighted backwards' kernels
    python scripts/analysis/gluon_sass_counts.py --variant bwd_dkdv_tanh bwd_dq_alsc_temperature_dt  # capped, tempered
    python scripts/analysis/gluon_sass_counts.py --variant bwd_dkdv_one_pass bwd_dkdv_one_pass_tanh  # dQ in the dK / dV kernel
    python scripts/analysis/gluon_sass_counts.py --variant threshold diff_threshold      # one and two score maps
    python scripts/analysis/gluon_sass_counts.py --variant tanh tanh_pingpong sigmoid_pingpong  # consumers in ping-pong
    python scripts/analysis/gluon_sass_counts.py --variant diff_bwd_dkdv diff_bwd_dkdv_second diff_bwd_dq  # its backward

Each consumer warpgroup (64 query rows, 4 warps) runs an unmasked loop (key blocks every row sees) and
a masked loop (the causal diagonal and the ragged last block: it selects -inf). Both consumers' loops
are found (innermost loops holding HGMMA); a row gives the smaller of the two (they differ by a few
integer instructions). Per score = instructions per warp x 32 x 4 warps / (64 rows x BLOCK_N keys):
thread-level operations per score.

The backward (attn/kernels/gluon_softmax_bwd.py, `--variant bwd_dkdv bwd_dq`): the key-block kernel's
loops run one query block (BLOCK_M rows) against a warpgroup's 64 keys (S^T, dP^T, dV, dK: its masked
loop is the causal diagonal, and only causal programs have one); the query-block kernel's loops one key
block (BLOCK_N keys) against a warpgroup's 64 rows (S, dP, dQ), masked as the forward's. The variants
bwd_<kernel>_<form> compile a cap (tanh, soft_sign, alsc), a temperature or both into either kernel, and the
_dt ones the temperature's gradient into the dQ kernel too. bwd_dkdv_one_pass(_<form>) is the key-block
kernel of the one-pass form (ATTNLAB_GLUON_DQ=one_pass): the same loops with dS^T to shared memory, the dQ
product and its TMA reduce-add per tile (no dQ kernel runs in that form). The threshold and sigmoid backwards
(attn/kernels/gluon_weighted_bwd.py, `--variant <name>_bwd_dkdv <name>_bwd_dq` for threshold, threshold_p1,
threshold_p1.5 and sigmoid) have the same loops. The differential threshold forward
(attn/kernels/gluon_diff_fwd.py, `--variant diff_threshold diff_threshold_p1 diff_threshold_p1.5`) has the
forward's two loops with two score products per key block; its per_score counts per (query, key) position,
both views' scores together. The differential backward (attn/kernels/gluon_diff_bwd.py, `--variant diff_bwd_dkdv
diff_bwd_dkdv_second diff_bwd_dkdv_views diff_bwd_dkdv_exchange diff_bwd_dq`, and _p1 / _p1.5 of each): diff_bwd_dkdv
is the key-block launch that computes dV at the head dim (the fused form at D = 64, the first view's at D = 128, both
on 32-row query blocks), diff_bwd_dkdv_second the second view's dK2 launch, diff_bwd_dkdv_views the view-warpgroup
form's launch (a warpgroup per view on the same 64 keys: its row is one warpgroup's loop, the smaller of the two, so
both warpgroups together run about twice its count per position), diff_bwd_dkdv_exchange the view-exchange form's (the
same, dP^T and dV once: view 1's loop has three products, view 2's three; its row is the shorter loop), diff_bwd_dq
the query-block dQ / dQ2 / d-lambda kernel (diff_bwd_dq_views its view-warpgroup form: a warpgroup per view on the
same 64 rows, its row the first view's loop, the shorter; diff_bwd_dq_persistent, diff_bwd_dkdv_persistent and
diff_bwd_dkdv_second_persistent the persistent forms, diff_bwd_dkdv_fused32 the fused form on 32-row query blocks,
diff_bwd_dkdv_views_one_pass the view warpgroups' one-pass form, dQ and dQ2 added in the key-block loops);
their per_score counts per (query, key) position as well. The forwards' <form>_pingpong variants compile the two
consumer warpgroups in
ping-pong (gluon_pipeline's turn barriers: each loop holds one BAR.SYNC and one BAR.ARV more, counted as sync).
`loop_spills` counts local-memory instructions inside the counted loop, `spills` those of the whole kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the attn package: the kernels' shared Gluon parts

from sass_listing import cuobjdump, innermost_loops, markdown_table, opcode_category, parse_sass  # noqa: E402

KERNEL = Path(__file__).resolve().parents[2] / "attn" / "kernels" / "gluon_softmax_fwd.py"
CATEGORIES = [  # (column, opcode prefixes), first match wins
    ("hgmma", ("HGMMA",)),
    ("mufu", ("MUFU",)),
    ("ffma", ("FFMA",)),
    ("fmul", ("FMUL",)),
    ("fadd", ("FADD",)),
    ("other_fp", ("FMNMX", "FSEL", "FSETP", "F2F", "FCHK", "FSWZADD", "HADD2", "HFMA2", "HMUL2")),
    ("mem", ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDL", "STL", "UTMA", "ATOM", "RED")),
    ("sync", ("BAR", "DEPBAR", "WARPGROUP", "MEMBAR", "FENCE", "SYNCS", "WARPSYNC", "ARRIVES")),
    ("int", ("IMAD", "IADD", "LEA", "LOP", "SHF", "ISETP", "SEL", "MOV", "IMNMX", "PRMT", "VIADD", "S2R", "CS2R",
             "I2F", "F2I", "IABS", "POPC", "FLO", "PLOP3", "P2R", "R2P", "U", "LDC", "S2UR", "R2UR", "VOTE")),
]
COLUMNS = ["config", "loop", "instr", "per_score", "hgmma", "mufu", "ffma", "fmul", "fadd", "other_fp", "int", "sync",
           "mem", "other", "regs", "loop_spills", "spills"]



def category(ins: str) -> str:
    return opcode_category(ins, CATEGORIES)


def hgmma_loops(instrs: list[tuple[int, str]]) -> list[list[str]]:
    return innermost_loops(instrs, lambda ins: ins.startswith("HGMMA"))

def load_kernel_module(path: Path = KERNEL):
    """The kernel module, loaded from its file (another version of it may sit outside the package)."""
    spec = importlib.util.spec_from_file_location("gluon_softmax_fwd", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module




TURN_EVENTS = [  # (event, instruction pattern): gluon_pipeline's ping-pong as it reads in the SASS
    ("wait14", re.compile(r"^BAR\.SYNC(\.\S+)? 0xe, 0x100$")), ("wait15", re.compile(r"^BAR\.SYNC(\.\S+)? 0xf, 0x100$")),
    ("pass14", re.compile(r"^BAR\.ARV 0xe, 0x100$")), ("pass15", re.compile(r"^BAR\.ARV 0xf, 0x100$")),
    ("issue", re.compile(r"^WARPGROUP\.ARRIVE")), ("retire", re.compile(r"^WARPGROUP\.DEPBAR")),
    ("ring_wait", re.compile(r"^SYNCS\.PHASECHK")), ("exit", re.compile(r"^EXIT")),
]


def turn_events(instrs: list[tuple[int, str]]) -> list[str]:
    """The kernel's SASS in address order reduced to the events of the consumers' ping-pong: waitN / passN
    (BAR.SYNC / BAR.ARV on named barrier N for 256 threads), issue (WARPGROUP.ARRIVE: a wgmma issue
    starts), retire (WARPGROUP.DEPBAR: a wgmma wait), ring_wait (an mbarrier wait of the K / V ring),
    exit."""
    events = []
    for _, ins in instrs:
        event = next((name for name, pattern in TURN_EVENTS if pattern.match(ins)), None)
        if event is not None:
            events.append(event)
    return events


def is_masked(body: list[str], scores_per_thread: int = 64) -> bool:
    """The masked loop compares each score's key with the row's last key (ISETP per score pair or
    more; the unmasked loop has a few, for the loop itself)."""
    return sum(ins.startswith("ISETP") for ins in body) >= scores_per_thread // 2


def is_masked_by_select(body: list[str], scores_per_thread: int = 32) -> bool:
    """The one-pass key-block kernel's masked loop without the causal mask (keys past the key length): its
    mask is per key row, so ptxas keeps a predicate per row and selects (FSEL) each score, with few ISETP."""
    return sum(ins.startswith(("ISETP", "FSEL")) for ins in body) >= scores_per_thread // 2


def loop_counts(body: list[str], block_n: int) -> dict:
    """Counts per category of one loop body of a 64 x block_n score tile per warpgroup."""
    row = {col: 0 for col, _ in CATEGORIES} | {"other": 0}
    for ins in body:
        row[category(ins)] += 1
    return {**row, "instr": len(body), "per_score": round(len(body) * 32 * 4 / (64 * block_n), 2),
            "loop_spills": sum(ins.startswith(("LDL", "STL")) for ins in body)}




# --variant: the softmax family's logit forms (gluon_softmax_fwd.compile_sm90's cap, has_temp, fixed_shift)
# and the threshold / sigmoid weights (gluon_weighted_fwd.compile_sm90's weight, power, newton)
VARIANTS = {"softmax": dict(cap=0), "temperature": dict(cap=0, has_temp=True),
            "tanh": dict(cap=1, fixed_shift=True), "tanh_online": dict(cap=1), "soft_sign": dict(cap=2, fixed_shift=True),
            "alsc": dict(cap=3, fixed_shift=True), "alsc_temperature": dict(cap=3, has_temp=True),
            "threshold": dict(weight=1, power=2.0), "threshold_p1": dict(weight=1, power=1.0),
            "threshold_p1.5": dict(weight=1, power=1.5), "sigmoid": dict(weight=2, newton=0),
            "sigmoid_newton": dict(weight=2, newton=2), "tanh_poly_exp2": dict(cap=1, fixed_shift=True, exp2_poly=3),
            "tanh_half_poly_exp2": dict(cap=1, fixed_shift=True, exp2_poly=-3),
            "softmax_poly_exp2": dict(cap=0, exp2_poly=3), "soft_sign_poly_exp2": dict(cap=2, fixed_shift=True, exp2_poly=3),
            "soft_sign_half_poly_exp2": dict(cap=2, fixed_shift=True, exp2_poly=-3),
            "alsc_half_poly_exp2": dict(cap=3, fixed_shift=True, exp2_poly=-3)}
# the forwards with the two consumer warpgroups in ping-pong (compile_sm90's pingpong): <form>_pingpong
PINGPONG_FORMS = ("softmax", "temperature", "tanh", "tanh_online", "soft_sign", "alsc", "alsc_temperature",
                  "threshold", "threshold_p1", "threshold_p1.5", "sigmoid")
VARIANTS.update({f"{form}_pingpong": {**VARIANTS[form], "pingpong": True} for form in PINGPONG_FORMS})
WEIGHTED = Path(__file__).resolve().parents[2] / "attn" / "kernels" / "gluon_weighted_fwd.py"
# the softmax backward's kernels (gluon_softmax_bwd.compile_sm90's kernel, cap, has_temp, need_dt)
VARIANTS.update({"bwd_dkdv": dict(kernel="dkdv"), "bwd_dq": dict(kernel="dq")})
BACKWARD_FORMS = {"tanh": dict(cap=1), "soft_sign": dict(cap=2), "alsc": dict(cap=3),
                  "temperature": dict(has_temp=True), "alsc_temperature": dict(cap=3, has_temp=True)}
VARIANTS.update({f"bwd_{kernel}_{form}": dict(kernel=kernel, **kwargs)
                 for kernel in ("dkdv", "dq") for form, kwargs in BACKWARD_FORMS.items()})
# the key-block kernel with FlashAttention-3's dQ path (ATTNLAB_GLUON_DQ=one_pass), plain and capped / tempered
VARIANTS.update({"bwd_dkdv_one_pass": dict(kernel="dkdv_one_pass")})
VARIANTS.update({f"bwd_dkdv_one_pass_{form}": dict(kernel="dkdv_one_pass", **kwargs)
                 for form, kwargs in BACKWARD_FORMS.items()})
VARIANTS.update({"bwd_dq_temperature_dt": dict(kernel="dq", has_temp=True, need_dt=True),
                 "bwd_dq_alsc_temperature_dt": dict(kernel="dq", cap=3, has_temp=True, need_dt=True)})
BACKWARD = Path(__file__).resolve().parents[2] / "attn" / "kernels" / "gluon_softmax_bwd.py"
# the threshold and sigmoid backwards' kernels (gluon_weighted_bwd.compile_sm90's kernel, weight, power)
VARIANTS.update({f"{name}_bwd_{kernel}": dict(kernel=kernel, **weight)
                 for name, weight in (("threshold", dict(weight=1, power=2.0)),
                                      ("threshold_p1", dict(weight=1, power=1.0)),
                                      ("threshold_p1.5", dict(weight=1, power=1.5)),
                                      ("sigmoid", dict(weight=2)))
                 for kernel in ("dkdv", "dkdv_one_pass", "dq")})
WEIGHTED_BACKWARD = Path(__file__).resolve().parents[2] / "attn" / "kernels" / "gluon_weighted_bwd.py"
# the differential threshold forward (gluon_diff_fwd.compile_sm90's power)
DIFFERENTIAL_VARIANTS = {"diff_threshold": dict(power=2.0), "diff_threshold_p1": dict(power=1.0),
                         "diff_threshold_p1.5": dict(power=1.5)}
VARIANTS.update(DIFFERENTIAL_VARIANTS)
DIFFERENTIAL = Path(__file__).resolve().parents[2] / "attn" / "kernels" / "gluon_diff_fwd.py"
# the differential threshold backward's kernels (gluon_diff_bwd.compile_sm90's kernel, power)
DIFFERENTIAL_BACKWARD_VARIANTS = {f"diff_bwd_{kernel}{suffix}": dict(kernel=kernel, power=power)
                                  for kernel in ("dkdv", "dkdv_second", "dkdv_views", "dkdv_exchange", "dq",
                                                 "dq_persistent", "dq_views", "dkdv_persistent",
                                                 "dkdv_second_persistent")
                                  for suffix, power in (("", 2.0), ("_p1", 1.0), ("_p1.5", 1.5))}
# the fused key-block form (D = 64) on 32-row query blocks (gluon_diff_bwd's fused_query_rows; FUSED_QUERY_ROWS is 64)
DIFFERENTIAL_BACKWARD_VARIANTS.update({f"diff_bwd_dkdv_fused32{suffix}": dict(kernel="dkdv", power=power, block_m=32)
                                       for suffix, power in (("", 2.0), ("_p1", 1.0), ("_p1.5", 1.5))})
# the view warpgroups' one-pass form (dQ, dQ2 and the d-lambda terms in the key-block kernel; p = 1 and 2 only)
DIFFERENTIAL_BACKWARD_VARIANTS.update({f"diff_bwd_dkdv_views_one_pass{suffix}": dict(kernel="dkdv_views_one_pass",
                                                                                     power=power)
                                       for suffix, power in (("", 2.0), ("_p1", 1.0))})
VARIANTS.update(DIFFERENTIAL_BACKWARD_VARIANTS)
DIFFERENTIAL_BACKWARD = Path(__file__).resolve().parents[2] / "attn" / "kernels" / "gluon_diff_bwd.py"


def kernel_file(variant: str) -> Path | None:
    """The kernel file of a variant other than the softmax forward's (None: --kernel's)."""
    if variant in DIFFERENTIAL_VARIANTS:
        return DIFFERENTIAL
    if variant in DIFFERENTIAL_BACKWARD_VARIANTS:
        return DIFFERENTIAL_BACKWARD
    if "weight" in VARIANTS[variant] and "kernel" in VARIANTS[variant]:
        return WEIGHTED_BACKWARD
    if "weight" in VARIANTS[variant]:
        return WEIGHTED
    if "kernel" in VARIANTS[variant]:
        return BACKWARD
    return None


def tile_width(module, variant: str, head_dim: int) -> int:
    """The score tile's second dim per warpgroup and loop iteration (the first is 64): the forwards'
    and the dQ kernel's BLOCK_N keys, the dK / dV kernel's BLOCK_M query rows."""
    kernel = VARIANTS[variant].get("kernel")
    if variant in DIFFERENTIAL_BACKWARD_VARIANTS:  # its key-block kernels' forms differ in BLOCK_M
        if kernel in ("dq", "dq_persistent"):
            return module.dq_tile_config(head_dim)["BLOCK_N"]
        if kernel == "dq_views":
            return module.dq_tile_config(head_dim, "view_warpgroups")["BLOCK_N"]
        if kernel == "dkdv_views_one_pass":
            return module.one_pass_tile_config(head_dim)["BLOCK_M"]
        views = {"dkdv_second": module.SECOND_VIEW, "dkdv_second_persistent": module.SECOND_VIEW,
                 "dkdv_views": module.VIEW_WARPGROUPS, "dkdv_exchange": module.VIEW_EXCHANGE}.get(
            kernel, module.dkdv_forms(head_dim)[0])
        return VARIANTS[variant].get("block_m") or module.dkdv_tile_config(head_dim, views)["BLOCK_M"]
    if kernel in ("dkdv", "dkdv_one_pass"):
        return module.dkdv_tile_config(head_dim)["BLOCK_M"]
    if kernel == "dq":
        return module.dq_tile_config(head_dim)["BLOCK_N"]
    return module.tile_config(head_dim)["BLOCK_N"]


def count(module, head_dim: int, causal: bool, dtype: str = "bf16", sass_dir: Path | None = None,
          variant: str = "softmax") -> list[dict]:
    """One row per loop kind (unmasked, masked) of the kernel compiled for sm_90."""
    compiled = module.compile_sm90(head_dim, dtype, causal, **VARIANTS[variant])
    cubin = compiled.asm["cubin"]
    sass = cuobjdump(cubin, "-sass")
    regs = int(dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", cuobjdump(cubin, "-res-usage"))).get("REG", 0))
    instrs = parse_sass(sass)
    spills = sum(ins.startswith(("LDL", "STL")) for _, ins in instrs)
    loops = hgmma_loops(instrs)
    block_n = tile_width(module, variant, head_dim)
    config = f"{variant} D={head_dim} {'causal' if causal else 'full'} {dtype}"
    rows = []
    kinds = (("unmasked", False), ("masked", True))
    if VARIANTS[variant].get("kernel", "") in ("dkdv", "dkdv_second", "dkdv_views", "dkdv_exchange", "dkdv_persistent",
                                               "dkdv_second_persistent") and not causal:
        kinds = kinds[:1]  # without the causal mask every query block runs unmasked
    # (the one-pass key-block kernel runs its masked loop without the causal mask too: every query block
    # of a program whose keys run past the key length, whose keys must not reach dq)
    masked_loop = is_masked
    if VARIANTS[variant].get("kernel") in ("dkdv_one_pass", "dkdv_views_one_pass") and not causal:
        masked_loop = is_masked_by_select
    for kind, masked in kinds:
        bodies = [body for body in loops if masked_loop(body, 64 * block_n // 128) == masked]
        if not bodies:
            raise RuntimeError(f"{config}: no {kind} loop with HGMMA in the SASS")
        body = min(bodies, key=len)
        if sass_dir is not None:
            (sass_dir / f"{variant}_d{head_dim}_{'causal' if causal else 'full'}_{kind}.sass").write_text("\n".join(body) + "\n")
        rows.append({"config": config, "loop": kind, **loop_counts(body, block_n), "regs": regs, "spills": spills})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--variant", nargs="+", choices=list(VARIANTS), default=["softmax"])
    ap.add_argument("--sass", type=Path, help="a folder: write each counted loop body there")
    ap.add_argument("--kernel", type=Path, default=KERNEL, help="another version of the kernel file (before/after)")
    ap.add_argument("--turns", action="store_true",
                    help="also print each kernel's ping-pong events in SASS order (turn_events)")
    args = ap.parse_args(argv)
    module = load_kernel_module(args.kernel)
    from attn.kernels.gluon_pipeline import gluon_api_available

    ok, why = gluon_api_available()
    if not ok:
        print(f"the kernel needs Triton 3.6's Gluon API: {why}", file=sys.stderr)
        return 2
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    others = {path: load_kernel_module(path) for path in {kernel_file(v) for v in args.variant} - {None}}
    rows = [row for variant in args.variant for d in args.head_dim for c in args.causal
            for row in count(others.get(kernel_file(variant), module), d, bool(c), args.dtype, args.sass, variant)]
    print(markdown_table(rows, COLUMNS))
    if args.turns:
        for variant in args.variant:
            kernel_module = others.get(kernel_file(variant), module)
            for d in args.head_dim:
                for c in args.causal:
                    compiled = kernel_module.compile_sm90(d, args.dtype, bool(c), **VARIANTS[variant])
                    events = turn_events(parse_sass(cuobjdump(compiled.asm["cubin"], "-sass")))
                    print(f"\n{variant} D={d} {'causal' if c else 'full'}: {' '.join(events)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
