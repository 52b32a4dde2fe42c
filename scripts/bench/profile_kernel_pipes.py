"""Where a forward kernel's time goes on the GPU: Nsight Compute's per-pipe utilization, issue-slot use
and warp stall reasons of one launch per variant, beside SDPA's kernel, in one table.

For each name in --variants the script starts itself as a child under `ncu` (hardware counters; the
clocks left alone: `--clock-control none`). The child builds (B,N,H,D) bf16 inputs, makes the public
call `attn.attention(..., causal=True)` forward --calls times (no grad; the first compiles) on the
tier --tier forces (ATTNLAB_GLUON: 1 the Gluon sm_90 kernels, 0 the portable ones), and ncu profiles
the last of them. `sdpa` is torch's scaled_dot_product_attention (cuDNN or flash on sm_90).

    python scripts/bench/profile_kernel_pipes.py --out $OUT/pipes [--variants sdpa,softmax,softcap_tanh]

Writes <out>.json (every metric ncu returned, per variant) and <out>.md (the table), and each child's
raw CSV beside them (<out>_<variant>.csv); --source adds a kernel's SASS with sampled stalls per
instruction (<out>_<variant>_source.csv) and its hot spots by instruction and opcode
(<out>_<variant>_stalls.md). Needs ncu on the PATH and a GPU whose counters it can read.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the kernel each variant's forward launches on either tier (a regex over kernel names)
KERNELS = {"sdpa": r"regex:sdpa|fmha|flash|attention",
           "gluon": r"regex:_gluon_\w*fwd",
           "portable": r"regex:_fwd"}
METRICS = [
    "gpu__time_duration.sum",
    "sm__cycles_elapsed.avg",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    r"regex:^sm__pipe_\w+_cycles_active\.avg\.pct_of_peak_sustained_active$",
    r"regex:^sm__inst_executed_pipe_\w+\.avg\.pct_of_peak_sustained_active$",
    r"regex:^smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$",
]
# the table's columns: (heading, metric)
COLUMNS = [
    ("us", "gpu__time_duration.sum"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    # Hopper's wgmma (HGMMA) cycles count under the hmma pipe
    ("tensor %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("xu (MUFU) inst %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("fma %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("alu %", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
]
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats", "InstructionStats"]
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def child(args) -> None:
    """The profiled process: --calls forward calls of one variant (ncu picks the last launch)."""
    import torch

    import attn
    from bench_public_path import PARAMS, sdpa, tensors

    b, n, h, d = args.shape
    x = tensors("softmax" if args.variant == "sdpa" else args.variant, b, n, h, d, False)
    if args.variant == "sdpa":
        def call():
            return sdpa(x["q"], x["k"], x["v"], True)
    else:
        spec = attn.get_variant(args.variant).make_spec(**PARAMS[args.variant])

        def call():
            return attn.attention(x["q"], x["k"], x["v"], spec, causal=True, extra=x["extra"])
    with torch.no_grad():
        for _ in range(args.calls):
            call()
    torch.cuda.synchronize()


def parse_raw_csv(text: str) -> dict:
    """ncu --csv --page raw: a header row of metric names, a units row, one row per profiled kernel;
    the last kernel's values (numbers where they parse) and, under "units", each metric's unit."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return {}
    header, units, last = rows[0], rows[1], rows[-1]
    out: dict = {"units": {name: unit for name, unit in zip(header, units) if unit}}
    for name, value in zip(header, last):
        try:
            out[name] = float(value.replace(",", ""))
        except ValueError:
            out[name] = value
    return out


US_PER = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def duration_us(metrics: dict) -> float | None:
    """The kernel's duration in microseconds, by the unit ncu reported (ns where none was kept)."""
    value = metrics.get("gpu__time_duration.sum")
    if not isinstance(value, float):
        return None
    return value * US_PER.get(metrics.get("units", {}).get("gpu__time_duration.sum", "nsecond"), 1e-3)


def run_ncu(variant: str, args, report: list[str]):
    """ncu (counters, clocks left alone) over a child process making `variant`'s calls, profiling the last
    launch of the variant's kernel; `report`: ncu's options for what to collect and print. The finished
    process, or None past --timeout seconds."""
    tier = "sdpa" if variant == "sdpa" else ("gluon" if args.tier == "1" else "portable")
    cmd = [args.ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", KERNELS[tier],
           "--launch-skip", str(args.calls - 1), "--launch-count", "1", *report,
           sys.executable, __file__, "--child", "--variant", variant,
           "--shape", *map(str, args.shape), "--calls", str(args.calls)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ATTNLAB_GLUON": args.tier},
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None


def profile(variant: str, args, out: Path) -> dict:
    """METRICS of the variant's kernel; when ncu refuses them, its SECTIONS' text beside <out>."""
    done = run_ncu(variant, args, ["--csv", "--page", "raw", "--metrics", ",".join(METRICS)])
    if done is None:
        return {"error": f"ncu ran past {args.timeout} s"}
    Path(f"{out}_{variant}.csv").write_text(done.stdout + "\n# stderr\n" + done.stderr)
    metrics = parse_raw_csv(done.stdout)
    if done.returncode != 0 or not metrics:
        # ncu's own sections instead of the metric list (their names are stable across versions)
        again = run_ncu(variant, args, ["--page", "details", *(a for name in SECTIONS for a in ("--section", name))])
        if again is not None:
            Path(f"{out}_{variant}_sections.txt").write_text(again.stdout + "\n# stderr\n" + again.stderr)
        return {"error": f"ncu exit {done.returncode}: {done.stderr.strip()[-600:]} (sections: "
                         f"{Path(out).name}_{variant}_sections.txt)"}
    return metrics


def stall_hot_spots(text: str, top: int = 15) -> str:
    """From ncu's source page (CSV, one row per SASS instruction): the `top` instructions by sampled warp
    stalls and the samples per opcode, as markdown; a note where the page has no stall-sampling column."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return "no source rows\n"
    header = rows[0]
    sampled = [i for i, name in enumerate(header) if "Stall Sampling" in name and "All" in name]
    source = next((i for i, name in enumerate(header) if name == "Source"), None)
    if not sampled or source is None:
        return f"no stall-sampling column among {header}\n"
    col = sampled[0]

    def samples(row):
        try:
            return float(row[col].replace(",", ""))
        except (ValueError, IndexError):
            return 0.0

    body = [r for r in rows[1:] if len(r) > max(col, source)]
    total = sum(samples(r) for r in body) or 1.0
    per_opcode: dict[str, float] = {}
    for r in body:
        opcode = r[source].split()[0].split(".")[0] if r[source].split() else "?"
        if opcode.startswith("@"):  # a predicate guard: the opcode follows it
            opcode = r[source].split()[1].split(".")[0] if len(r[source].split()) > 1 else "?"
        per_opcode[opcode] = per_opcode.get(opcode, 0.0) + samples(r)
    out = [f"{header[col]}: {total:.0f} samples", "", "| instruction | share |", "| --- | ---: |"]
    for r in sorted(body, key=samples, reverse=True)[:top]:
        out.append(f"| `{r[source].strip()}` | {samples(r) / total:.1%} |")
    out += ["", "| opcode | share |", "| --- | ---: |"]
    for opcode, value in sorted(per_opcode.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        out.append(f"| {opcode} | {value / total:.1%} |")
    return "\n".join(out) + "\n"


def profile_source(variant: str, args, out: Path) -> str:
    """The kernel's SASS with sampled warp stalls per instruction (ncu's source page): the raw CSV and its
    hot spots (`stall_hot_spots`, markdown) beside <out>."""
    done = run_ncu(variant, args, ["--section", "SourceCounters", "--section", "WarpStateStats", "--page", "source",
                                   "--print-source", "sass", "--csv"])
    if done is None:
        return f"ncu ran past {args.timeout} s"
    path = Path(f"{out}_{variant}_source.csv")
    path.write_text(done.stdout + "\n# stderr\n" + done.stderr[-4000:])
    Path(f"{out}_{variant}_stalls.md").write_text(f"# {variant}: sampled stalls per SASS instruction\n\n"
                                                  + stall_hot_spots(done.stdout))
    return f"exit {done.returncode}, {path.name}, {variant}_stalls.md"


def table(results: dict) -> str:
    stalls = sorted({k for m in results.values() for k in m if k.startswith(STALL_PREFIX)})
    # the stall reasons that matter somewhere: >= 0.05 warps per issue in any row
    stalls = [s for s in stalls if any(isinstance(m.get(s), float) and m[s] >= 0.05 for m in results.values())]
    short = [s[len(STALL_PREFIX):-len(STALL_SUFFIX)] for s in stalls]
    head = ["variant", *(c for c, _ in COLUMNS), *(f"stall {s}" for s in short)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for variant, m in results.items():
        if "error" in m:
            lines.append(f"| {variant} | {m['error']} |")
            continue
        cells = []
        for _, metric in [*COLUMNS, *((None, s) for s in stalls)]:
            v = duration_us(m) if metric == "gpu__time_duration.sum" else m.get(metric)
            cells.append(f"{v:.2f}" if isinstance(v, float) else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(meta: dict, results: dict) -> str:
    return ("# Per-pipe profile of one forward launch (Nsight Compute)\n\n"
            + "\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n\n" + table(results) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_out/pipes")
    ap.add_argument("--variants", default="sdpa,softmax,softcap_tanh,alsc,sigmoid,threshold")
    ap.add_argument("--shape", type=int, nargs=4, default=[4, 4096, 16, 128], metavar=("B", "N", "H", "D"))
    ap.add_argument("--tier", default="1", choices=["0", "1"], help="ATTNLAB_GLUON for our variants")
    ap.add_argument("--calls", type=int, default=3, help="forward calls per child; the last is profiled")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per child under ncu")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--source", default="", help="comma list of variants: also their SASS with sampled stalls "
                                                 "per instruction (ncu's source page, raw CSV)")
    ap.add_argument("--render", default=None, help="rewrite FILE.md from a result FILE.json (no profiling)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.render:
        found = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(found["meta"], found["metrics"]))
        return 0
    from timing import result_header

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**result_header(), "shape (B,N,H,D)": args.shape, "causal": True, "dtype": "bf16",
            "tier": "gluon" if args.tier == "1" else "portable", "profiled": f"call {args.calls} of {args.calls}"}
    results = {}
    text = ""
    for variant in filter(None, args.variants.split(",")):
        results[variant] = profile(variant, args, out)
        print(variant, "error: " + results[variant]["error"] if "error" in results[variant] else "ok", flush=True)
        # written after every variant: a run cut short keeps what it measured
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "metrics": results}, indent=1))
        text = markdown(meta, results)
        out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    for variant in filter(None, args.source.split(",")):
        print(f"{variant} source: {profile_source(variant, args, out)}", flush=True)
    return 1 if any("error" in m for m in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
