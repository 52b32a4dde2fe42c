"""A/B of the softmax-family kernels' launch options in one process: fwd and fwd+bwd time per option
and case, next to SDPA, and how far each option's outputs and gradients move from the first option's.

An option is a name and environment settings the launchers read at each call (ATTNLAB_TMA,
ATTNLAB_FIXED_SHIFT, ATTNLAB_SOFTMAX_DQ, ...); every option tunes its own keys during warm-up. The
options are timed in rounds (A B C, A B C, ...) and each keeps its fastest round's median, so a slow
drift of the GPU (clocks, heat) does not favour the option timed first.

    python3 scripts/bench/ab_kernel_options.py --out gpu_out/ab \\
        --option base: --option tma:ATTNLAB_TMA=1 --option tma_fwd_dq:ATTNLAB_TMA=fwd,dq
    python3 scripts/bench/ab_kernel_options.py --dry-run --option base: --option online:ATTNLAB_FIXED_SHIFT=0  # CPU

Writes OUT.json and OUT.md (date, GPU, versions, commit).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # CPU (--dry-run, tests): Triton runs in its interpreter, set before it loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import case_env, random_qkv, ranker_layout, spec_for, useful_flops  # noqa: E402
from timing import FWD_BWD_FLOP_FACTOR, git_commit, median_ms, tflops  # noqa: E402

from attn.kernels.softmax_family import fused_attention  # noqa: E402
from attn.masks import MaskSpec, segment_bounds  # noqa: E402

CAUSAL, FULL = MaskSpec(causal=True), MaskSpec(causal=False)
# (name, B, H, H_kv, N, D, cap, mask, (history, candidates) or None); the issue-15 shapes, a D=64 one and
# a small model's
CASES = [
    ("main softmax causal", 4, 16, 16, 4096, 128, "none", CAUSAL, None),
    ("main tanh causal", 4, 16, 16, 4096, 128, "tanh", CAUSAL, None),
    ("main alsc causal", 4, 16, 16, 4096, 128, "alsc", CAUSAL, None),
    ("gqa 16:4 tanh causal", 4, 16, 4, 4096, 128, "tanh", CAUSAL, None),
    ("ranker 2048h+2048c tanh", 4, 16, 16, 4096, 128, "tanh", FULL, (2048, 2048)),
    ("d64 softmax causal", 8, 16, 16, 2048, 64, "none", CAUSAL, None),
    ("small model tanh causal", 32, 6, 6, 256, 64, "tanh", CAUSAL, None),
]
DRY_CASES = [("dry tanh causal", 1, 2, 1, 40, 16, "tanh", CAUSAL, None),
             ("dry ranker softmax", 1, 2, 2, 40, 16, "none", FULL, (24, 16))]


def parse_option(text: str) -> tuple[str, dict[str, str]]:
    """'name:ATTNLAB_A=value,ATTNLAB_B=value' (settings may be empty; a value may hold commas, a
    setting starts at ',ATTNLAB_') -> (name, settings)."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"an option is 'name:VAR=value,...', got {text!r}")
    settings = {}
    for item in filter(None, re.split(r",(?=ATTNLAB_)", rest)):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("ATTNLAB_"):
            raise argparse.ArgumentTypeError(f"option {name!r}: a setting is ATTNLAB_VAR=value, got {item!r}")
        settings[var] = value
    return name, settings


def results(call, do):
    """(out, dq, dk, dv) of one call, as fp32."""
    out = call()
    grads = torch.autograd.grad(out, call.inputs, do)
    return [out.detach().float(), *(g.float() for g in grads)]


def relative_change(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def time_ms(fn, grad: bool) -> float:
    if grad:
        return median_ms(lambda: fn().backward(fn.do), warmup=10, rep=60)
    with torch.no_grad():
        return median_ms(fn, warmup=10, rep=60)


def run_case(case, options, rounds: int, device: str, timed: bool) -> dict:
    name, b, h, h_kv, n, d, cap, mask, segments = case
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = random_qkv(b, h, n, d, h_kv, device, dtype)
    ids = ranker_layout(b, n, *segments, device) if segments else None
    bounds = segment_bounds(ids) if ids is not None else None
    spec = spec_for(cap)

    def ours():
        return fused_attention(q, k, v, spec, mask, None, bounds=bounds)

    ours.inputs, ours.do = (q, k, v), torch.randn_like(q)
    row = {"name": name, "B": b, "H": h, "H_kv": h_kv, "N": n, "D": d, "cap": cap,
           "mask": mask.kind if ids is None else "ranker", "options": {}}
    first = None
    working = []
    for opt, settings in options:  # warm-up (tuning, compiling) and the outputs of each option
        try:
            with case_env(settings):
                got = results(ours, ours.do)
        except Exception as e:  # report, keep going with the other options
            row["options"][opt] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name:26} {opt:14} failed: {row['options'][opt]['error']}", flush=True)
            continue
        first = first or got
        row["options"][opt] = {"max_relative_change": relative_change(got, first)}
        working.append((opt, settings))
    if not timed or not working:
        return row
    flops = useful_flops(b, h, n, d, mask, ids)
    yard = {}
    if cap == "none" and ids is None:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def sdpa():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask.causal, enable_gqa=h != h_kv)

        sdpa.do = torch.randn_like(qt)
        yard["sdpa"] = sdpa
    best: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for opt, settings in [*working, *((y, {}) for y in yard)]:
            fn = yard.get(opt, ours)
            with case_env(settings):
                for key, grad in (("fwd_ms", False), ("fwdbwd_ms", True)):
                    ms = time_ms(fn, grad)
                    slot = best.setdefault(opt, {})
                    slot[key] = min(slot.get(key, float("inf")), ms)
    base = working[0][0]
    for opt, t in best.items():
        entry = row["options"].setdefault(opt, {})
        entry.update(t)
        entry["fwd_tflops"] = tflops(flops, t["fwd_ms"])
        entry["fwdbwd_tflops"] = tflops(FWD_BWD_FLOP_FACTOR * flops, t["fwdbwd_ms"])
        entry["baseline"] = base
        for key in ("fwd_ms", "fwdbwd_ms"):
            entry[f"{key}_speed"] = best[base][key] / t[key]
        print(f"  {name:26} {opt:14} fwd {t['fwd_ms']:7.3f} ms ({entry['fwd_ms_speed']:.3f}x) | fwd+bwd "
              f"{t['fwdbwd_ms']:7.3f} ms ({entry['fwdbwd_ms_speed']:.3f}x) | "
              f"change {entry.get('max_relative_change', 0.0):.2e}", flush=True)
    torch.cuda.empty_cache()
    return row


def report(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Kernel option A/B ({meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"commit {meta['commit']})", "",
             "Options: " + "; ".join(f"`{o}` = {s or 'defaults'}" for o, s in meta["options"].items()), "",
             f"Times in ms (the fastest of {meta['rounds']} rounds' medians); speed = the case's first working "
             "option's time / this time; change = max relative difference of out, dq, dk, dv from that option.", "",
             "| case | option | fwd ms | speed | fwd+bwd ms | speed | fwd / fwd+bwd TFLOP/s | change |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        for opt, e in r["options"].items():
            if "error" in e:
                first_line = e["error"].splitlines()[0][:120].replace("|", "/")
                lines.append(f"| {r['name']} | {opt} | failed: {first_line} | | | | | |")
            if "fwd_ms" not in e:
                continue
            change = e.get("max_relative_change")
            lines.append(f"| {r['name']} | {opt} | {e['fwd_ms']:.3f} | {e['fwd_ms_speed']:.3f} | "
                         f"{e['fwdbwd_ms']:.3f} | {e['fwdbwd_ms_speed']:.3f} | "
                         f"{e['fwd_tflops']:.0f} / {e['fwdbwd_tflops']:.0f} | "
                         f"{'-' if change is None else f'{change:.1e}'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--option", dest="options", action="append", type=parse_option, required=True,
                    help="name:ATTNLAB_VAR=value,... (the first is the baseline; repeat for each option)")
    ap.add_argument("--names", default=None, help="comma list: only cases whose name contains one of these")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="gpu_out/ab_kernel_options")
    ap.add_argument("--dry-run", action="store_true", help="tiny cases, outputs compared, no timing (CPU)")
    args = ap.parse_args(argv)
    names = [o for o, _ in args.options]
    if len(set(names)) != len(names):
        ap.error(f"option names must differ, got {names}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = DRY_CASES if args.dry_run else CASES
    if args.names:
        wanted = args.names.split(",")
        cases = [c for c in cases if any(w in c[0] for w in wanted)]
    import triton

    meta = {"date": dt.date.today().isoformat(), "commit": git_commit(), "torch": torch.__version__,
            "triton": triton.__version__, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "rounds": args.rounds, "options": {o: s for o, s in args.options}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases:  # written after each case: a run cut short keeps what it measured
        rows.append(run_case(case, args.options, args.rounds, device, not args.dry_run))
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(report(meta, rows))
    print("\n".join(summary_lines(rows)))
    return 1 if any("error" in e for r in rows for e in r["options"].values()) else 0


def summary_lines(rows: list[dict]) -> list[str]:
    """Per case and option: its error, or how far its outputs moved from the first option's (the
    SDPA yardstick is timed, not compared)."""
    lines = []
    for r in rows:
        for opt, e in r["options"].items():
            if "error" in e:
                lines.append(f"{r['name']:26} {opt:14} {e['error']}")
            elif "max_relative_change" in e:
                lines.append(f"{r['name']:26} {opt:14} max relative change {e['max_relative_change']:.2e}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
