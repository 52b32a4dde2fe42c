"""Sweep a wide grid of tile configs for every kernel of the issue-15 cases: what the config tables
(`attn/kernels/softmax_family.py`, `threshold_family.py`) would gain from other candidates.

For each case it runs our kernels twice in one process, tuning each kernel on the call's own arguments
with the runtime's tuner (`runtime.Kernel._tune`, every candidate timed with do_bench):

1. with the current tables: the chosen config per kernel, fwd and fwd+bwd times;
2. with the wide grid (this module's *_GRID, plus the table's own candidates): every candidate's time
   per kernel, the chosen ones, fwd and fwd+bwd times.

Compiling is most of a cold run, so `--workers K` first compiles the grid in K processes at once
(each a shard of the grid, untimed), filling Triton's on-disk cache; the timed run then loads.

    python scripts/bench/sweep_tile_configs.py --workers 14 --out gpu_out/sweep
    python scripts/bench/sweep_tile_configs.py --names tanh,threshold --out gpu_out/sweep_small

`--profile` instead lists, per case (and SDPA at the main causal shape), the GPU kernels of 20 fwd+bwd
calls in a row with torch.profiler: what each launch costs inside a sustained loop, next to the
loop's own time per call.

Writes OUT.json and OUT.md (date, GPU, versions, commit; ATTNLAB_COMMIT overrides the commit read
from git, for a device machine whose .git is stale).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton.testing  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

import attn  # noqa: E402
import bench_attention as ba  # noqa: E402
from attn.kernels import runtime, softmax_family, threshold_family  # noqa: E402
from attn.kernels.runtime import TileConfig  # noqa: E402
from attn.masks import MaskSpec  # noqa: E402
from timing import result_header  # noqa: E402

T = TileConfig
# (BLOCK_M, BLOCK_N, warps, stages); BLOCK_M: query rows of a tile, BLOCK_N: key rows
FWD_GRID = [T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 64, 8, 4), T(128, 128, 8, 2), T(128, 128, 8, 3),
            T(128, 32, 4, 3), T(128, 32, 8, 3), T(128, 64, 4, 2), T(128, 64, 4, 3), T(64, 64, 4, 2),
            T(64, 64, 4, 3), T(64, 64, 4, 4), T(64, 128, 4, 2), T(64, 128, 4, 3), T(64, 32, 4, 3),
            T(128, 128, 4, 2)]
# key-block kernels (dk/dv): BLOCK_N keys per program, BLOCK_M query rows per step
KV_GRID = [T(64, 128, 8, 2), T(64, 128, 8, 3), T(32, 128, 8, 2), T(32, 128, 8, 3), T(32, 128, 4, 2),
           T(32, 128, 4, 3), T(16, 128, 8, 3), T(16, 128, 4, 3), T(64, 64, 4, 2), T(64, 64, 4, 3),
           T(64, 64, 8, 3), T(32, 64, 4, 3), T(16, 64, 8, 3), T(32, 64, 8, 2), T(128, 128, 8, 2),
           T(64, 128, 4, 2)]
Q_GRID = [T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 32, 4, 2), T(128, 32, 4, 3), T(128, 32, 8, 3),
          T(64, 64, 4, 2), T(64, 64, 4, 3), T(64, 64, 8, 3), T(64, 128, 4, 2), T(64, 32, 4, 3),
          T(128, 128, 8, 2), T(128, 64, 4, 2)]
# each family's kernel kinds -> grid
GRIDS = {"softmax": {"fwd": FWD_GRID, "kv": KV_GRID, "q": Q_GRID},
         "threshold": {"fwd": FWD_GRID, "dkdv": KV_GRID, "dq": Q_GRID}}
TABLES = {"softmax": softmax_family.CONFIG_TABLE, "threshold": threshold_family.CONFIG_TABLE}
MAIN = (4, 16, 4096, 128)


def cases(device="cuda"):
    """(name, family, b, h, n, d, cap or variant, mask, ids, env)."""
    causal, full = MaskSpec(causal=True), MaskSpec(causal=False)
    b, n = MAIN[0], MAIN[2]
    ranker_ids = ba.ranker_layout(b, n, n // 2, n // 2, device)
    out = [(f"main {cap} causal", "softmax", *MAIN, cap, causal, None, {})
           for cap in ("none", "tanh", "soft_sign", "alsc")]
    out += [("ranker 2048h+2048c tanh", "softmax", *MAIN, "tanh", full, ranker_ids, {}),
            ("full N=4096 tanh", "softmax", *MAIN, "tanh", full, None, {})]
    out += [("main threshold causal", "threshold", *MAIN, "threshold", causal, None, {})]
    out += [(f"main diff_threshold causal, {form} dk/dv", "threshold", *MAIN, "diff_threshold", causal, None,
             {"ATTNLAB_DIFF_DKDV": form}) for form in ("fused", "split")]
    return out


def all_kernels():
    mods = (softmax_family, threshold_family)
    found = [k for m in mods for k in vars(m).values() if isinstance(k, runtime.Kernel)]
    found += [k for k in threshold_family._KERNELS.values()]
    return list({id(k): k for k in found}.values())


def reset_tuning():
    """Forget every tuned config and backward form, so the next call tunes again."""
    for k in all_kernels():
        k.tuned.clear()
        k.timings.clear()
    threshold_family._dkdv_diff_form.clear()
    softmax_family._dq_forms.clear()


@contextlib.contextmanager
def wide_candidates(family: str, shard: tuple[int, int] | None = None):
    """The family's ConfigTable hands out its grid (plus its own candidates, first) for every kind;
    shard (w, K): only the grid entries whose index is w mod K (a compile worker's share)."""
    table = TABLES[family]
    own = table.candidates

    def candidates(kind, *variant, n=None):
        mine = own(kind, *variant, n=n)
        if len(mine) == 1 and n is not None and n <= table.small_n:
            return mine
        grid = list(dict.fromkeys([*mine, *GRIDS[family][kind]]))
        if shard is not None:
            grid = grid[shard[0]::shard[1]] or grid[:1]
        return grid

    with mock.patch.object(table, "candidates", candidates):
        yield


def impl_for(case):
    """The case's `ours` call (bench_attention's construction: segment bounds computed once)."""
    name, family, b, h, n, d, what, mask, ids, env = case
    if family == "softmax":
        q, k, v = ba.random_qkv(b, h, n, d, h, "cuda", torch.bfloat16)
        return ba.softmax_impls(q, k, v, what, mask, ids, flex=False)["ours"]
    q, k, v, second = ba.variant_inputs(b, h, n, d, h, what, "cuda", torch.bfloat16)
    spec = attn.get_variant(what).make_spec()
    return ba.variant_impls(q, k, v, second, spec, mask, ids)["ours"]


def kernel_report() -> dict:
    """{kernel name: {"chosen": str, "times": [[config, ms], ...] fastest first}} of every tuning so far."""
    out = {}
    for k in all_kernels():
        for i, (key, times) in enumerate(k.timings.items()):
            ranked = sorted(times.items(), key=lambda kv: kv[1])
            name = k.name + (f" #{i + 1}" if len(k.timings) > 1 else "")
            out[name] = {"chosen": str(k.tuned.get(key)), "times": [[str(c), round(ms, 4)] for c, ms in ranked]}
    for form in threshold_family._dkdv_diff_form.values():
        out["diff dk/dv form"] = {"chosen": form, "times": []}
    for form in softmax_family._dq_forms.values():
        out["softmax backward dq form"] = {"chosen": form, "times": []}
    return out


def measure(case, wide: bool) -> dict:
    reset_tuning()
    with ba.case_env(case[-1]), (wide_candidates(case[1]) if wide else contextlib.nullcontext()):
        fn = impl_for(case)
        ms_b, _ = ba.bench(fn, grad=True)  # tunes fwd and both backward kernels in its warm-up
        ms_f, _ = ba.bench(fn, grad=False)
        kernels = kernel_report()
    torch.cuda.empty_cache()
    return {"fwd_ms": ms_f, "fwdbwd_ms": ms_b, "kernels": kernels}


def compile_shard(w: int, k: int, wanted):
    """Run each case once per kernel candidate of this shard, untimed (fills Triton's cache)."""
    with mock.patch.object(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1]):
        for case in cases():
            if wanted and not any(x in case[0] for x in wanted):
                continue
            t = time.perf_counter()
            reset_tuning()
            try:
                with ba.case_env(case[-1]), wide_candidates(case[1], (w, k)):
                    fn = impl_for(case)
                    out = fn()
                    out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
            except OutOfResources as e:  # a shard of one candidate that does not fit: the tuner skips it too
                print(f"{case[0]} shard {w}/{k}: {e}", flush=True)
                continue
            print(f"compiled {case[0]} shard {w}/{k}: {time.perf_counter() - t:.0f} s", flush=True)


def precompile(workers: int, names: str | None, out: Path):
    t = time.perf_counter()
    procs = []
    for w in range(workers):
        log = open(f"{out}.compile{w}.log", "w")
        cmd = [sys.executable, __file__, "--compile-shard", f"{w}/{workers}"] + (["--names", names] if names else [])
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    print(f"precompile: {workers} workers, {time.perf_counter() - t:.0f} s, exit codes {codes}", flush=True)


def profile(name: str, fn, iters: int = 20) -> dict:
    """GPU kernels of `iters` fwd+bwd calls of fn in a row: {kernel: [calls per iteration, us per call]} and
    the loop's wall time per iteration (us)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = fn()
    do = torch.randn_like(out)
    del out
    for _ in range(3):
        fn().backward(do)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(iters):
            fn().backward(do)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / iters * 1e6
    kernels = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us > 0 and ev.count >= iters:
            kernels[ev.key[:90]] = [ev.count / iters, us / ev.count]
    busy = sum(n * us for n, us in kernels.values())
    print(f"{name}: loop {wall:.0f} us per fwd+bwd, kernels {busy:.0f} us", flush=True)
    for k, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f"    {n:4.1f} x {us:8.1f} us  {k}", flush=True)
    return {"name": name, "loop_us": wall, "kernel_us": busy, "kernels": kernels}


def markdown(meta, rows) -> str:
    lines = ["# Tile-config sweep of the issue-15 kernels", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · commit "
             f"`{meta['commit']}` · bf16 · each kernel tuned on the call's arguments (do_bench median per "
             f"candidate), then fwd / fwd+bwd timed with the choice; SDPA at the main causal shape "
             f"{meta['sdpa_main_causal_ms']['fwd']:.3f} / {meta['sdpa_main_causal_ms']['fwdbwd']:.3f} ms", "",
             "| case | tables fwd / fwd+bwd ms | wide grid fwd / fwd+bwd ms | gain fwd / fwd+bwd |",
             "| --- | ---: | ---: | ---: |"]
    for r in rows:
        c, w = r["tables"], r["wide"]
        gain_f, gain_b = c["fwd_ms"] / w["fwd_ms"], c["fwdbwd_ms"] / w["fwdbwd_ms"]
        lines.append(f"| {r['name']} | {c['fwd_ms']:.3f} / {c['fwdbwd_ms']:.3f} | {w['fwd_ms']:.3f} / "
                     f"{w['fwdbwd_ms']:.3f} | {gain_f:.3f}x / {gain_b:.3f}x |")
    for r in rows:
        lines += ["", f"## {r['name']}", ""]
        for kname, rep in r["wide"]["kernels"].items():
            now = r["tables"]["kernels"].get(kname, {}).get("chosen")
            top = ", ".join(f"{c} {ms:.3f}" for c, ms in rep["times"][:6])
            lines.append(f"- **{kname}**: tables chose {now}; wide grid chose {rep['chosen']}. Fastest: {top}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_out/sweep_tile_configs")
    ap.add_argument("--names", default=None, help="comma list: only the cases whose name contains one of these")
    ap.add_argument("--workers", type=int, default=0, help="compile the grid in this many processes first")
    ap.add_argument("--compile-shard", default=None, metavar="W/K", help="(a worker) compile shard W of K, untimed")
    ap.add_argument("--profile", action="store_true", help="list each case's GPU kernels in a loop (no sweep)")
    args = ap.parse_args()
    wanted = args.names.split(",") if args.names else None
    if args.compile_shard:
        w, k = (int(x) for x in args.compile_shard.split("/"))
        compile_shard(w, k, wanted)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = result_header()
    print(meta, flush=True)
    if args.profile:
        q, k, v = ba.random_qkv(*MAIN[:3], MAIN[3], MAIN[1], "cuda", torch.bfloat16)
        impls = ba.softmax_impls(q, k, v, "none", MaskSpec(causal=True), None, sdpa=True, flex=False)
        rows = [profile("SDPA main causal", impls["sdpa"])]
        rows += [profile(case[0], impl_for(case)) for case in cases()
                 if not wanted or any(x in case[0] for x in wanted)]
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "profiles": rows}, indent=1))
        return
    if args.workers:
        precompile(args.workers, args.names, out)
    q, k, v = ba.random_qkv(*MAIN[:3], MAIN[3], MAIN[1], "cuda", torch.bfloat16)
    sdpa = ba.softmax_impls(q, k, v, "none", MaskSpec(causal=True), None, sdpa=True, flex=False)["sdpa"]
    meta["sdpa_main_causal_ms"] = {"fwd": ba.bench(sdpa)[0], "fwdbwd": ba.bench(sdpa, grad=True)[0]}
    print("SDPA, main causal:", meta["sdpa_main_causal_ms"], flush=True)
    rows = []
    for case in cases():
        if wanted and not any(x in case[0] for x in wanted):
            continue
        t = time.perf_counter()
        row = {"name": case[0], "tables": measure(case, wide=False), "wide": measure(case, wide=True)}
        rows.append(row)
        c, w = row["tables"], row["wide"]
        print(f"{case[0]:44} tables {c['fwd_ms']:.3f}/{c['fwdbwd_ms']:.3f}  wide {w['fwd_ms']:.3f}/{w['fwdbwd_ms']:.3f}"
              f"  ({time.perf_counter() - t:.0f} s)", flush=True)
        for kname, rep in w["kernels"].items():
            print(f"    {kname:32} now {c['kernels'].get(kname, {}).get('chosen')} | wide "
                  + ", ".join(f"{cfg} {ms:.3f}" for cfg, ms in rep["times"][:4]), flush=True)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows))


if __name__ == "__main__":
    main()
