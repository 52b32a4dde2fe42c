"""Where train.py's per-step host time goes: Lightning's SimpleProfiler (host time per hook and
loop action) and every host-device synchronization of the steady state, with the code that made it.

    python scripts/bench/profile_train_loop.py [--out DIR] [train.py overrides ...]

A sync stops the host from queueing the next kernels while the GPU runs, so a step then costs host
time plus GPU time instead of the larger of the two. Syncs are found with
torch.cuda.set_sync_debug_mode("warn") (each blocking op warns, with the stack that made it),
counted per call site. Compilation and autotuning sync too; they show up with small counts, while
a per-step sync shows up about once per training step. CUDA only for the sync census; the hook
timings work on any device.

--trace-steps A:B also records steps [A, B) with torch.profiler and prints the host's ops by
their own (self) time: a host that waits for the GPU shows it as a long CUDA runtime call
(cudaMemcpyAsync, cudaStreamSynchronize, ...); then the GPU's timeline (`gpu_timeline`): busy
time per step against wall time per step, and the kernels by total time. Busy close to wall means
the step is GPU-bound (extra GPU work is the cost); busy well under wall means the GPU waits for
the host. --trace-out writes the Chrome trace.
--python-steps A:B runs cProfile over steps [A, B) and prints the Python functions by own time:
where the training loop's host time goes, ours and Lightning's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import tempfile
import runpy
import sys
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.profilers import SimpleProfiler

ROOT = Path(__file__).resolve().parents[2]
SYNC_WARNING = "synchronizing"


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames outside torch's own modules: where our code or Lightning asked for the sync."""
    frames = [f for f in stack if "site-packages/torch/" not in f.filename and "warnings.py" not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def steady_state_table(durations: dict[str, list[float]], skip: int) -> str:
    """Median and 90th percentile host time per action after its first `skip` calls, largest total first."""
    rows = []
    for action, times in durations.items():
        steady = sorted(times[skip:])
        if steady:
            rows.append((sum(steady), action, len(steady), steady[len(steady) // 2], steady[int(0.9 * (len(steady) - 1))]))
    lines = [f"\n# host time per action, steady state (first {skip} calls left out)\n",
             "| action | calls | median ms | p90 ms | total s |", "| --- | ---: | ---: | ---: | ---: |"]
    for total, action, n, median, p90 in sorted(rows, reverse=True)[:30]:
        lines.append(f"| {action[:90]} | {n} | {1e3 * median:.3f} | {1e3 * p90:.3f} | {total:.3f} |")
    return "\n".join(lines)


GPU_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_timeline(profile: torch.profiler.profile, steps: int, top: int = 15) -> str:
    """The GPU's side of a torch.profiler recording of `steps` steps: busy time (the union of its
    kernel and copy intervals) against the wall time from the first GPU event to the last, per
    step, and the kernels by total time. Read from the Chrome trace (its format is stable across
    torch versions)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        profile.export_chrome_trace(f.name)
        events = [e for e in json.loads(Path(f.name).read_text())["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_KINDS]
    if not events:
        return "\n# GPU timeline: no GPU events recorded\n"
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    wall = end - spans[0][0]
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for e in events:
        totals[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    lines = [f"\n# GPU timeline over {steps} steps: wall {wall / steps / 1e3:.3f} ms/step, GPU busy "
             f"{busy / steps / 1e3:.3f} ms/step ({100 * busy / wall:.1f}%), {len(events) / steps:.0f} GPU events/step\n",
             "| kernel | per step | us/step | share of busy |", "| --- | ---: | ---: | ---: |"]
    for name, total in totals.most_common(top):
        lines.append(f"| {name[:100]} | {counts[name] / steps:.1f} | {total / steps:.1f} | {100 * total / busy:.1f}% |")
    return "\n".join(lines)


class StepTrace(L.Callback):
    """torch.profiler over training steps [first, stop): the host's ops by self time, printed."""

    def __init__(self, first: int, stop: int, trace_out: str | None):
        self.first, self.stop, self.trace_out = first, stop, trace_out
        self.profile = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.first and self.profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities)
            self.profile.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profile is not None and trainer.global_step == self.stop:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profile.__exit__(None, None, None)
            steps = self.stop - self.first
            print(f"\n# host ops by self time over training steps [{self.first}, {self.stop}) ({steps} steps)\n")
            print(self.profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            if torch.cuda.is_available():
                print(gpu_timeline(self.profile, steps))
            if self.trace_out:
                self.profile.export_chrome_trace(self.trace_out)
            self.profile = None


class PythonProfile(L.Callback):
    """cProfile over training steps [first, stop): Python functions by own and by cumulative time, printed."""

    def __init__(self, first: int, stop: int):
        self.first, self.stop = first, stop
        self.profile = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.first and self.profile is None:
            self.profile = cProfile.Profile()
            self.profile.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profile is not None and trainer.global_step == self.stop:
            self.profile.disable()
            for order, what in (("tottime", "own time"), ("cumulative", "time including their callees")):
                text = io.StringIO()
                pstats.Stats(self.profile, stream=text).sort_stats(order).print_stats(40)
                print(f"\n# Python functions by {what} over training steps [{self.first}, {self.stop}) "
                      f"({self.stop - self.first} steps; cProfile slows the host)\n")
                print(text.getvalue())
            self.profile = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", type=int, default=10, help="calls of each action left out (compilation, autotuning)")
    ap.add_argument("--out", default=None, help="folder for the profiler's report (default: the run dir)")
    ap.add_argument("--trace-steps", default=None, help="A:B: torch.profiler over training steps [A, B)")
    ap.add_argument("--trace-out", default=None, help="with --trace-steps: write the Chrome trace here")
    ap.add_argument("--python-steps", default=None, help="A:B: cProfile over training steps [A, B)")
    ap.add_argument("--no-sync-census", action="store_true", help="leave torch's sync debug mode off")
    args, overrides = ap.parse_known_args()
    syncs: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            syncs[call_site(traceback.extract_stack()[:-1])] += 1
        else:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    census = torch.cuda.is_available() and not args.no_sync_census
    if census:
        torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        warnings.showwarning = record
    extra_callbacks = []
    if args.trace_steps:
        extra_callbacks.append(StepTrace(*(int(x) for x in args.trace_steps.split(":")), args.trace_out))
    if args.python_steps:
        extra_callbacks.append(PythonProfile(*(int(x) for x in args.python_steps.split(":"))))
    if extra_callbacks:
        original_trainer_init = L.Trainer.__init__

        def with_callbacks(self, *a, callbacks=None, **k):
            original_trainer_init(self, *a, callbacks=list(callbacks or []) + extra_callbacks, **k)

        L.Trainer.__init__ = with_callbacks
    profilers = []
    original_init = SimpleProfiler.__init__

    def keep(self, *a, **k):  # the Trainer builds the profiler; keep it to read its raw durations
        original_init(self, *a, **k)
        profilers.append(self)

    SimpleProfiler.__init__ = keep
    profiler = ["+trainer.profiler._target_=lightning.pytorch.profilers.SimpleProfiler",
                "+trainer.profiler.filename=profile_simple", "+trainer.profiler.extended=false"]
    if args.out:
        profiler.append(f"+trainer.profiler.dirpath={args.out}")
    sys.argv = [str(ROOT / "train.py"), *overrides, *profiler]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        if census:
            torch.cuda.set_sync_debug_mode("default")
        for p in profilers:
            print(steady_state_table(p.recorded_durations, args.skip))
        print(f"\n# host-device syncs by call site ({sum(syncs.values())} in all)\n")
        print("| count | call site (innermost first) |\n| ---: | --- |")
        for site, n in syncs.most_common(40):
            print(f"| {n} | {site} |")


if __name__ == "__main__":
    main()
