"""The eager training step (no torch.compile) per variant against the same model on SDPA, in paired rounds.

The host of a GPU machine drifts between processes and minutes (SDPA's eager step at `small` moved
12-16 ms between runs), which swamps a one-shot tokens/s comparison. Here every variant's step is
built in one process and timed once per round, in a fresh random order each round; a variant's
speed is the median over rounds of SDPA's time / its time in the same round. Then a census of one
step per variant: CUDA kernel launches and the aten ops whose counts differ from SDPA's (what the
variant's model adds), and a cProfile of a few steps.

    python scripts/bench/train_eager_rounds.py --out DIR [--model small] [--rounds 6] [--only softmax/sdpa,threshold/triton]

A case may carry environment settings for its steps alone, `variant/backend@NAME=VALUE;NAME=VALUE`
(e.g. `diff_threshold/triton@ATTNLAB_GLUON=0` beside `diff_threshold/triton`: the kernels' launch plans
key on their settings, so both forms run in the same process and rounds).

Writes DIR/train_eager_rounds.json (the header, rows, per-round times and the census) and prints a
markdown table. `scripts/gpu_check.py train:eager_rounds` runs it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import CASES, build_step  # noqa: E402
from timing import result_header, sync  # noqa: E402

BASE = "softmax/sdpa"
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def parse_case(case: str) -> tuple[str, dict[str, str]]:
    """'variant/backend@NAME=VALUE;NAME=VALUE' -> ('variant/backend', {NAME: VALUE}); no '@': no settings."""
    name, _, tail = case.partition("@")
    settings = {}
    for item in filter(None, tail.split(";")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"case {case!r}: settings are NAME=VALUE separated by ';', got {item!r}")
        settings[key] = value
    return name, settings


def with_settings(step, settings: dict[str, str]):
    """`step` run with the environment variables `settings` set, each restored after."""
    if not settings:
        return step

    def run():
        saved = {key: os.environ.get(key) for key in settings}
        os.environ.update(settings)
        try:
            return step()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return run


def paired_rows(times: dict[str, list[float]], base: str = BASE) -> list[dict]:
    """Per case: best and median ms over rounds, and its speed against `base` as the median of the
    per-round ratios base / case (each round times every case once) and as best / best."""
    rows = []
    for name, ms in times.items():
        ratios = [b / t for b, t in zip(times[base], ms)]
        rows.append({"case": name, "best_ms": min(ms), "median_ms": statistics.median(ms),
                     "speed_vs_sdpa_paired": statistics.median(ratios),
                     "speed_vs_sdpa_best": min(times[base]) / min(ms), "rounds_ms": ms})
    return rows


def host_ms(step, reps: int = 5, sleep_cycles: int = 200_000_000) -> float:
    """The host's time to run one step while the GPU is still busy with a sleep kernel queued before it
    (about 0.1 s at H100 clocks): the step's Python and launch work alone, never waiting on the GPU; the
    median over `reps`. A step that synchronizes waits for the sleep and shows it here. Without a GPU: the
    step's time."""
    times = []
    for _ in range(reps):
        sync()
        if torch.cuda.is_available():
            torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        sync()
    return statistics.median(times)


def census(step, host: float, steps: int = 5) -> dict:
    """Per step: CUDA launches, how many times each aten op ran, GPU time per kernel, and `host`, the step's
    `host_ms` taken before any profiler ran in this process: taken after the profiler, they read 13-50 % more
    than the steps' own wall time on an H100 (public_path/train_eager_rounds_host_time_h100.log), which the
    host's work alone cannot take."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync()
    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    launches = sum(e.name in LAUNCHES for e in prof.events())
    kernels = collections.Counter()  # GPU time (us) per kernel name, summed over the steps
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time_total
    return {"host_ms": host, "launches": launches / steps,
            "aten_ops": {name: n / steps for name, n in ops.items()},
            "gpu_ms": sum(kernels.values()) / steps / 1e3,
            "top_kernels_us": {name: us / steps for name, us in kernels.most_common(12)}}


def op_differences(case: dict, base: dict, top: int = 25) -> list[tuple[str, float]]:
    """The aten ops whose per-step counts differ from the base's, largest differences first."""
    names = set(case["aten_ops"]) | set(base["aten_ops"])
    diff = {n: case["aten_ops"].get(n, 0) - base["aten_ops"].get(n, 0) for n in names}
    return sorted(((n, d) for n, d in diff.items() if d), key=lambda nd: -abs(nd[1]))[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="steps per case per round")
    ap.add_argument("--only", default=",".join(f"{v}/{b}" for v, b, _ in CASES),
                    help="comma list of variant/backend cases, each with optional @NAME=VALUE;... settings "
                         "(SDPA's is always timed)")
    ap.add_argument("--profile", default="", help="comma list of cases to cProfile (a few steps each)")
    args = ap.parse_args()
    model_cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{args.model}.yaml").read_text())
    model_cfg["vocab_size"] = 2048
    wanted = [BASE] + [case for case in args.only.split(",") if case and case != BASE]
    known = {f"{variant}/{backend}": (variant, backend, params) for variant, backend, params in CASES}
    steps = {}
    for case in dict.fromkeys(wanted):
        name, settings = parse_case(case)
        if name not in known:
            raise ValueError(f"--only: unknown case {name!r}; cases are {sorted(known)}")
        variant, backend, params = known[name]
        _, step = build_step(model_cfg, variant, backend, params, args.batch, eager=True)
        step = with_settings(step, settings)
        for _ in range(5):  # tuning and first launches
            step()
        sync()
        steps[case] = step
    times = collections.defaultdict(list)
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(steps)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    rows = paired_rows(dict(times))
    print("| case | best ms | median ms | vs SDPA (median of paired rounds) | vs SDPA (best / best) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['best_ms']:.2f} | {r['median_ms']:.2f} | {r['speed_vs_sdpa_paired']:.3f} "
              f"| {r['speed_vs_sdpa_best']:.3f} |")
    hosts = {name: host_ms(step) for name, step in steps.items()}  # before the census's profiler
    counts = {name: census(step, hosts[name]) for name, step in steps.items()}
    for name, c in counts.items():
        print(f"\n## {name}: {c['launches']:.0f} launches per step (SDPA {counts[BASE]['launches']:.0f}), "
              f"GPU busy {c['gpu_ms']:.2f} ms per step (SDPA {counts[BASE]['gpu_ms']:.2f}), host "
              f"{c['host_ms']:.2f} ms per step with the GPU busy (SDPA {counts[BASE]['host_ms']:.2f})")
        for kernel, us in c["top_kernels_us"].items():
            print(f"  {us:8.1f} us  {kernel[:110]}")
        for op, d in op_differences(c, counts[BASE]):
            print(f"  {d:+.0f} {op}")
    for name in filter(None, args.profile.split(",")):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            steps[name]()
        sync()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        print(f"\n## cProfile {name}, {args.steps} steps\n{text.getvalue()}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**result_header(), "model": args.model, "batch": args.batch, "rounds": args.rounds, "steps": args.steps}
    (args.out / "train_eager_rounds.json").write_text(json.dumps({"meta": meta, "rows": rows, "census": counts},
                                                                 indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
