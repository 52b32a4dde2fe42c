"""Per-score SASS instruction counts of the fused attention kernels, compiled for a GPU on a CPU.

No GPU is needed: the launch a GPU would make is recorded on the CPU (the runtime's GPU branch,
its ConfigTable and the pinned first candidate, Kernel.launch recorded instead of run, as
tests/test_kernel_runtime.py records tests/kernel_launches.json), Triton's own binder turns it into
the same specialization its JIT would compile (dtypes, 16-byte alignment, integer values; Triton 3.x
internals: create_function_from_signature and JITFunction._pack_args, as its JIT calls them), and
`triton.compile` builds it for sm_90 with the ptxas Triton ships. The unmasked inner loop is the
innermost loop with tensor-core instructions that has the fewest instructions (the masked-tile
loops are the same body plus mask arithmetic). Its instructions are counted per score:

    per score = (loop instructions per warp) x 32 x num_warps / (BLOCK_M x BLOCK_N)

i.e. thread-level operations per score, or warp instructions (issue slots) per 32 scores. The last
columns are an H200's clocks per score per SM for each resource (4 sub-partitions issuing one
warp instruction a clock: 128 per SM; MUFU 16 ops a clock; dense bf16 989 TFLOP/s over 132 SMs at
1.98 GHz) and the largest of the three.

    python scripts/analysis/sass_counts.py --family softmax --kernel dkdv --variant softcap_tanh
    python scripts/analysis/sass_counts.py --variant threshold diff_threshold          # every kernel, both forms
    python scripts/analysis/sass_counts.py --variant softmax --kernel fwd --sass out.sass   # also the loop's SASS
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attn.families import family_of  # noqa: E402
from attn.kernels import runtime  # noqa: E402
from attn.masks import CANDIDATE, HISTORY, MaskSpec  # noqa: E402
from attn.registry import VARIANTS  # noqa: E402
from sass_listing import cuobjdump, innermost_loops, markdown_table, opcode_category, parse_sass  # noqa: E402

FAMILY_DEFAULT_VARIANT = {"softmax": "softmax", "threshold": "threshold", "sigmoid": "sigmoid"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# H200 rates per SM and clock (module docstring)
ISSUE_PER_CLK, MUFU_PER_CLK, TC_FLOP_PER_CLK = 128.0, 16.0, 989e12 / (132 * 1.98e9)
COLUMNS = ["kernel", "variant", "views", "config", "regs", "spill", "smem_kb", "loop", "instr", "mufu", "tc", "tc_flop",
           "ffma_fadd_fmul", "other_fp", "int_addr", "mem", "sync", "other", "clk_issue", "clk_mufu", "clk_tc",
           "bound"]
CATEGORIES = [  # (column, opcode prefixes), first match wins
    ("mufu", ("MUFU",)),
    ("tc", ("HGMMA", "HMMA")),
    ("ffma_fadd_fmul", ("FFMA", "FADD", "FMUL")),
    ("other_fp", ("FMNMX", "FSEL", "FSETP", "F2F", "FCHK", "FSWZADD", "HADD2", "HFMA2", "HMUL2")),
    ("mem", ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "LDL", "STL", "UTMA", "UBLKCP", "ATOM", "RED")),
    ("sync", ("BAR", "DEPBAR", "LDGDEPBAR", "WARPGROUP", "MEMBAR", "FENCE", "SYNCS", "WARPSYNC", "ARRIVES")),
    ("int_addr", ("IMAD", "IADD", "LEA", "LOP", "SHF", "ISETP", "SEL", "MOV", "IMNMX", "PRMT", "VIADD", "S2R", "CS2R",
                  "I2F", "F2I", "IABS", "POPC", "FLO", "PLOP3", "P2R", "R2P", "U", "LDC", "S2UR", "R2UR", "VOTE")),
]


# --mask: causal (default), full, or the ranker layout (first half history, second half candidates)
MASKS = {"causal": MaskSpec(causal=True), "full": MaskSpec(causal=False), "ranker": MaskSpec(causal=False)}



def category(ins: str) -> str:
    return opcode_category(ins, CATEGORIES)


def mma_loops(instrs: list[tuple[int, str]]) -> list[list[str]]:
    return innermost_loops(instrs, lambda ins: category(ins) == "tc")

def mask_inputs(mask: str, batch: int, n: int) -> tuple[MaskSpec, torch.Tensor | None]:
    """(MaskSpec, segment ids or None) of a --mask name."""
    if mask != "ranker":
        return MASKS[mask], None
    ids = torch.full((batch, n), HISTORY, dtype=torch.int64)
    ids[:, n // 2:] = CANDIDATE
    return MASKS[mask], ids


def record_launches(variant: str, shape, dtype: torch.dtype, backward: bool, dkdv_form: str | None,
                    mask: str = "causal") -> list:
    """The launches one call (and its backward) makes on a GPU: [(Kernel, tensors, scalars, meta, configs)]."""
    spec = VARIANTS[variant].make_spec()
    family = family_of(spec)
    fused_attention = family.kernel()
    b, h, n, d = shape
    q, k, v = (torch.empty(b, n, h, d, dtype=dtype, requires_grad=backward) for _ in range(3))
    extra = {name: torch.empty(h, dtype=dtype, requires_grad=backward) if name == "lam" else torch.empty_like(q)
             for name in family.extra_inputs(spec)}
    launches = []

    def record(kernel, grid, tensors, scalars, meta, configs, tune_key):
        launches.append((kernel, tensors, scalars, meta, configs))
        return configs[0]

    env = {"ATTNLAB_AUTOTUNE": "0", **({"ATTNLAB_DIFF_DKDV": dkdv_form} if dkdv_form else {})}
    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):  # the GPU's branch of every kernel module
            if name.startswith("attn.kernels") and hasattr(module, "interpreting"):
                stack.enter_context(mock.patch.object(module, "interpreting", lambda: False))
        stack.enter_context(mock.patch.object(runtime.Kernel, "launch", record))
        stack.enter_context(mock.patch.dict(os.environ, env))
        mask_spec, segment_ids = mask_inputs(mask, b, n)
        out = fused_attention(q, k, v, spec, mask_spec, segment_ids, None, extra=extra or None)
        if backward:
            out.backward(torch.empty_like(out))
    return launches


def gpu_meta(meta: dict, dtype: torch.dtype) -> dict:
    """Constexprs that depend on the tensors being on a GPU take their GPU value (softmax_family._flags:
    FAST = MUFU tanh / rcp for 16-bit CUDA inputs)."""
    return {**meta, "FAST": dtype != torch.float32} if "FAST" in meta else meta


def compile_for(kernel, tensors, scalars, meta, cfg, arch: int):
    """The compiled kernel Triton's JIT would build for this launch on an sm_<arch> GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 64 if arch < 100 else 128)
    backend = make_backend(target)
    fn = kernel.fn
    kwargs = {**meta, **cfg.meta(), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*tensors, *scalars, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)










def mma_flops(ins: str) -> float:
    """Flops of one warp's tensor-core instruction: HGMMA.MxNxK is a warpgroup's (4 warps), HMMA.MNK a warp's."""
    m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", ins)
    if m:
        return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) / 4
    m = re.match(r"HMMA\.(\d\d)(\d)(\d+)", ins)
    return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else 0.0


def count(kernel, tensors, scalars, meta, cfg, arch: int, sass_out: Path | None = None) -> dict:
    compiled = compile_for(kernel, tensors, scalars, meta, cfg, arch)
    cubin = compiled.asm["cubin"]
    sass = cuobjdump(cubin, "-sass")
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", cuobjdump(cubin, "-res-usage")))
    instrs = parse_sass(sass)
    loops = mma_loops(instrs)
    if not loops:
        raise RuntimeError(f"{kernel.name}: no loop with tensor-core instructions in the SASS")
    body = min(loops, key=len)
    if sass_out is not None:
        sass_out.write_text("\n".join(body) + "\n")
    per_score = 32 * cfg.num_warps / (cfg.block_m * cfg.block_n)
    row = {col: 0.0 for col, _ in CATEGORIES} | {"other": 0.0}
    for ins in body:
        row[category(ins)] += per_score
    row["tc_flop"] = sum(mma_flops(ins) for ins in body) * cfg.num_warps / (cfg.block_m * cfg.block_n)
    row["instr"] = len(body) * per_score
    clk = {"issue": row["instr"] / ISSUE_PER_CLK, "mufu": row["mufu"] / MUFU_PER_CLK,
           "tc": row["tc_flop"] / TC_FLOP_PER_CLK}
    spills = sum(ins.startswith(("STL", "LDL")) for _, ins in instrs)
    return {**row, "kernel": kernel.name, "views": meta.get("VIEWS", ""),
            "config": f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}",
            "regs": int(usage.get("REG", 0)), "spill": f"{spills} ({usage.get('STACK', '0')} B)",
            "smem_kb": round(compiled.metadata.shared / 1024), "loop": len(body),
            **{f"clk_{k}": v for k, v in clk.items()}, "bound": max(clk, key=clk.get)}


def kernel_rows(variant: str, kinds, shape, dtype, arch: int, config_index: int, sass_dir: Path | None,
                tiles: runtime.TileConfig | None = None, meta_overrides: dict | None = None,
                mask: str = "causal") -> list[dict]:
    """One row per kernel of `kinds` (the differential dk/dv in both forms); `tiles` and `meta_overrides`
    replace the launch's config and constexprs (what-if compiles of changes the code does not make)."""
    diff = "diff" in variant
    backward = any(kind != "fwd" for kind in kinds)
    launches = record_launches(variant, shape, dtype, backward, "fused" if diff and "dkdv" in kinds else None, mask)
    if diff and "dkdv" in kinds:  # the split form's two launches too
        launches += [x for x in record_launches(variant, shape, dtype, True, "split", mask)
                     if x[0].name.endswith("dkdv")]
    rows, seen = [], set()
    for kernel, tensors, scalars, meta, configs in launches:
        kind = kernel.name.rsplit("_", 1)[-1]
        key = (kernel.name, meta.get("VIEWS"))
        if kind not in kinds or key in seen:
            continue
        seen.add(key)
        cfg = tiles or configs[config_index % len(configs)]
        meta = {**gpu_meta(meta, dtype), **{k: v for k, v in (meta_overrides or {}).items() if k in meta}}
        out = sass_dir / f"{variant}_{kind}{meta.get('VIEWS', '')}.sass" if sass_dir else None
        rows.append({**count(kernel, tensors, scalars, meta, cfg, arch, out), "variant": variant})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(FAMILY_DEFAULT_VARIANT), help="its plain variant, without --variant")
    ap.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), help="registry names (attn/registry.py)")
    ap.add_argument("--kernel", nargs="+", choices=["fwd", "dq", "dkdv"], default=["fwd", "dq", "dkdv"])
    ap.add_argument("--shape", default="4,16,4096,128", help="B,H,N,D (H_kv = H); default issue 15's")
    ap.add_argument("--mask", choices=sorted(MASKS), default="causal",
                    help="ranker: first half history, second half candidates (not causal)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--config", type=int, default=0, help="candidate index of each kernel's list (0: pinned)")
    ap.add_argument("--tiles", help="BLOCK_M,BLOCK_N,warps,stages instead of the candidate list (what-if)")
    ap.add_argument("--meta", nargs="*", default=[], help="KEY=INT constexpr overrides, e.g. FIXED_MAX=1 (what-if)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    ap.add_argument("--sass", type=Path, help="a folder: write each counted loop body there")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: the kernels are interpreted functions then, which do not compile")
    variants = args.variant or [FAMILY_DEFAULT_VARIANT[args.family or "softmax"]]
    if args.family and any(VARIANTS[v].family != args.family for v in variants):
        ap.error(f"--variant {variants} is not all of the {args.family} family")
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    tiles = runtime.TileConfig(*(int(x) for x in args.tiles.split(","))) if args.tiles else None
    overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.meta)}
    rows = [row for v in variants for row in kernel_rows(v, args.kernel, shape, DTYPES[args.dtype], args.arch,
                                                         args.config, args.sass, tiles, overrides, args.mask)]
    print(markdown_table(rows, COLUMNS))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
