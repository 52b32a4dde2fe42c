"""attnlab's GPU checks and benchmarks in one entry: named phases of time-bounded steps.

    python3 scripts/gpu_check.py [--budget S] [--out DIR] PHASE[:STEP] ...
    python3 scripts/gpu_check.py --list          # every phase's steps: time limit, command

Phases (`--list` names their steps; `PHASE:STEP` runs one step):
  kernels   bf16 correctness of every variant's kernels, natively: the pytest files that run on a
            GPU (tests/test_gpu.py, test_attention_dropout.py, test_kernels_longer_keys.py,
            test_kv_cache.py, test_extra_inputs.py, test_public_path_gpu.py, test_gluon_gpu.py,
            test_gluon_bwd_gpu.py, test_gluon_weighted_bwd_gpu.py, test_gluon_diff_fwd_gpu.py,
            test_gluon_diff_bwd_gpu.py, test_gluon_launch_gpu.py, test_head_norms.py),
            gpu_checks/check_softmax_family_gpu.py, gpu_checks/check_gluon_softmax_gpu.py,
            gpu_checks/check_gluon_softmax_bwd_gpu.py, gpu_checks/check_gluon_weighted_bwd_gpu.py,
            gpu_checks/check_threshold_gpu.py
  sanitize  compute-sanitizer memcheck over both kernel families' small-shape matrix
  bench     bench/bench_attention.py suites (main, masks, threshold, sigmoid, and every kernel target row
            in one process) and one attention call at a training shape, eager and compiled, with its
            host time (bench/bench_attention_call.py); host time per call per kernel tier and launch path
            (bench/host_cost_call_gpu.py); the opt-in kernel options against the defaults
            (bench/ab_kernel_options.py: TMA loads, the online-softmax forward, the one-pass backward with its
            dq added by TMA reduce); Triton's Hopper warp specialization on a minimal attention loop
            (bench/probe_warp_specialize.py); the public function as users call it (bench/bench_public_path.py),
            failing on a regression against docs/results/baselines/<GPU>.json; where a public call's
            time goes (bench/profile_public_call.py); each forward's pipe use and stall reasons under Nsight
            Compute (bench/profile_kernel_pipes.py); the layer's norms against their plain forms
            (bench/layer_norms.py)
  train     bench/bench_train.py: train.py against a plain PyTorch loop at model `small`, GPT-2 small per
            variant against SDPA, both with the public function's kernel tier choice against the portable
            kernels alone (--tiers), the loop at `small` without torch.compile per variant (also in paired
            rounds with each variant's extra ops, bench/train_eager_rounds.py); two
            deterministic runs bitwise equal, the captured step bitwise the eager step
            (gpu_checks/check_train_determinism.py); no host-device sync inside train.py's steps
            (gpu_checks/check_host_syncs.py); kernel time per category (bench/profile_train_step.py); host time per
            Lightning hook (bench/profile_train_loop.py)
  decode    bench/bench_decode.py: one decode step against SDPA on 4K / 32K caches, generation tokens/s
            with and without the KV cache
  ablation  scripts/run_ablation.sh device: every variant x 3 seeds at `small`, evaluations, report
  ddp       NCCL all-reduce bandwidth and train.py on 1 vs all GPUs (2+ GPUs); 20 FSDP steps on
            every GPU

GPUs: every GPU `nvidia-smi -L` lists. Single-GPU steps are dealt to the GPUs and run side by side;
on one GPU a timed step runs alone, while consecutive correctness steps share it. Steps that need
every GPU (ddp, ablation) run after the others, one at a time.

Bounds: each step has a time limit, and the call has one budget (--budget, default 550 s: the device
tool allows 600 s per command). No step runs past the budget; one that would start with less than
60 s left is not started and is named at the end (run it in another call as PHASE:STEP). Scripts
write their results as they go, so a step cut by its limit keeps what it measured.

Results in --out (default $OUT, else gpu_out/): gpu_check.tar.gz (per step its log and files, plus
environment.txt and summary.txt; checkpoints left out) and summary.txt (one line per step: status,
seconds, GPUs, command). Unpack with `tar xzf gpu_check.tar.gz`; numbers worth keeping go to
docs/results/, dated, in its README's index.

Through the device tool. Prepare once here: `bash scripts/run_ablation.sh prepare` writes .whl
(hydra's wheels, which the GPU image lacks) and the token cache .device_cache/attnlab. Then:
    run(command="ATTNLAB_COMMIT=<commit> python3 scripts/gpu_check.py kernels",
        carry=[".whl", ".device_cache/attnlab"], timeout_s=600)
kind="nvidia-h200-x2" (or more GPUs) for the ddp phase and to run more steps per call. The device's
copy of the tree has no .git, so ATTNLAB_COMMIT names the commit the result files record.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = "python3"
MIN_START_S = 60  # a step is not started with less of the budget left
# the kernel test files whose cases matter natively: bf16 (skipped under the interpreter), GPU-only
# checks, and the entry points' handling of CUDA inputs
GPU_TESTS = ["tests/test_gpu.py", "tests/test_attention_dropout.py", "tests/test_kernels_longer_keys.py",
             "tests/test_kv_cache.py", "tests/test_extra_inputs.py", "tests/test_public_path_gpu.py",
             "tests/test_gluon_gpu.py", "tests/test_gluon_bwd_gpu.py", "tests/test_gluon_weighted_bwd_gpu.py",
             "tests/test_gluon_diff_fwd_gpu.py", "tests/test_gluon_diff_bwd_gpu.py", "tests/test_gluon_launch_gpu.py",
             "tests/test_head_norms.py"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One command. `{dir}` in it is the step's output folder, `{gpus}` the number of GPUs it gets.
    kind: "timed" (alone on its GPU), "check" (consecutive checks share a GPU) or "all" (every GPU)."""

    name: str
    limit_s: int
    cmd: tuple[str, ...]
    kind: str = "timed"
    min_gpus: int = 1
    env: tuple[tuple[str, str], ...] = ()


def bench_train(*args: str) -> tuple[str, ...]:
    return (PY, "scripts/bench/bench_train.py", *args)


GPT2_SMALL = ("--model", "gpt2_small", "--batch", "16")
FSDP = (PY, "train.py", "experiment=gpu_small", "trainer=fsdp", "trainer.devices={gpus}", "train.compile=false",
        "train.max_steps=20", "train.val_every=10", "logger=csv", "trainer.enable_progress_bar=false",
        "hydra.run.dir={dir}/run")

PHASES: dict[str, list[Step]] = {
    "kernels": [
        Step("pytest", 330, (PY, "-m", "pytest", "-q", "-n", "6", "-p", "no:cacheprovider", "--timeout", "300",
                             "--junitxml", "{dir}/pytest.xml", *GPU_TESTS), kind="check"),
        Step("softmax_family", 330, (PY, "scripts/gpu_checks/check_softmax_family_gpu.py", "--json", "{dir}/check.json"),
             kind="check"),
        Step("threshold_family", 330, (PY, "scripts/gpu_checks/check_threshold_gpu.py", "--workers", "6", "--out", "{dir}"),
             kind="check"),
        # the Gluon sm_90 forward against float64 and timed beside SDPA and the portable kernel (Hopper only)
        Step("gluon_softmax", 240, (PY, "scripts/gpu_checks/check_gluon_softmax_gpu.py", "--out", "{dir}")),
        # the Gluon sm_90 backward against float64 and timed beside SDPA's and the portable backward (Hopper only)
        Step("gluon_softmax_bwd", 240, (PY, "scripts/gpu_checks/check_gluon_softmax_bwd_gpu.py", "--out", "{dir}")),
        # the Gluon sm_90 threshold and sigmoid backwards against float64 and timed beside SDPA's and the
        # portable backwards (Hopper only)
        Step("gluon_weighted_bwd", 180, (PY, "scripts/gpu_checks/check_gluon_weighted_bwd_gpu.py", "--out", "{dir}")),
    ],
    "sanitize": [
        Step("memcheck", 540, ("compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3",
                               PY, "scripts/gpu_checks/sanitize_kernels.py"), kind="check"),
    ],
    "bench": [
        Step("main", 200, (PY, "scripts/bench/bench_attention.py", "--only", "main", "--out", "{dir}/bench_main")),
        Step("masks", 180, (PY, "scripts/bench/bench_attention.py", "--only", "masks", "--out", "{dir}/bench_masks")),
        Step("threshold", 200, (PY, "scripts/bench/bench_attention.py", "--only", "threshold",
                                "--out", "{dir}/bench_threshold")),
        Step("sigmoid", 200, (PY, "scripts/bench/bench_attention.py", "--only", "sigmoid", "--out", "{dir}/bench_sigmoid")),
        # every kernel target row in one process: ranker, recommender shapes, caps, windows, GQA, diff_threshold
        Step("targets", 330, (PY, "scripts/bench/bench_attention.py", "--only", "issue15", "--prewarm", "6",
                              "--out", "{dir}/bench_targets")),
        Step("call", 150, (PY, "scripts/bench/bench_attention_call.py", "--out", "{dir}/attention_call")),
        Step("host_cost", 150, (PY, "scripts/bench/host_cost_call_gpu.py", "--out", "{dir}/host_cost_call")),
        # what users of the public function feel, against the committed baseline of this GPU kind:
        # fails on a row slower than the baseline beyond the measured noise (the regression gate)
        Step("public", 420, (PY, "scripts/bench/bench_public_path.py", "--baseline", "auto", "--out", "{dir}/public_path")),
        # where a public call's time goes: host and GPU time, launches, host ops, cProfile per variant
        Step("profile_call", 200, (PY, "scripts/bench/profile_public_call.py", "--python",
                                   "--out", "{dir}/profile_public_call")),
        # where each forward's GPU time goes: Nsight Compute's pipe use and stall reasons, beside cuDNN's kernel
        Step("pipes", 240, (PY, "scripts/bench/profile_kernel_pipes.py", "--out", "{dir}/pipes")),
        # the attention layer's norms as the model computes them against their plain PyTorch forms
        Step("layer_norms", 60, (PY, "scripts/bench/layer_norms.py", "--out", "{dir}/layer_norms.json")),
        # the opt-in kernel options against the defaults, one process per case
        Step("options", 450, (PY, "scripts/bench/ab_kernel_options.py", "--rounds", "2", "--option", "default:",
                              "--option", "tma_fwd_dq:ATTNLAB_TMA=fwd,dq",
                              "--option", "online_softmax:ATTNLAB_FIXED_SHIFT=0",
                              "--option", "one_pass_tma_reduce:ATTNLAB_SOFTMAX_DQ=one_pass,ATTNLAB_TMA=dq_add",
                              "--out", "{dir}/ab_kernel_options")),
        # Triton's Hopper warp specialization on a minimal attention loop, against the same loop and SDPA
        Step("warp_specialize", 90, (PY, "scripts/bench/probe_warp_specialize.py",
                                     "--out", "{dir}/probe_warp_specialize.json")),
    ],
    "train": [
        # train.py (the captured step) against the plain loop with torch.compile's CUDA graphs
        Step("small", 420, bench_train("--model", "small", "--vocab", "2048", "--batch", "32", "--steps", "30",
                                       "--variants", "softcap_tanh,threshold", "--cuda-graphs", "--no-default",
                                       "--train-py", "--train-py-steps", "100", "--out", "{dir}/bench_train_small")),
        Step("determinism", 240, (PY, "scripts/gpu_checks/check_train_determinism.py", "--json", "{dir}/determinism.json",
                                  "--variants", "softmax,threshold", "experiment=gpu_small", "train.max_steps=30",
                                  "train.val_every=15", "train.val_tokens=65536"), kind="check"),
        Step("captured_vs_eager", 240, (PY, "scripts/gpu_checks/check_train_determinism.py", "--json", "{dir}/determinism.json",
                                        "--variants", "softcap_tanh", "experiment=gpu_small", "train.max_steps=100",
                                        "train.val_every=100", "--b-overrides", "train.cuda_graphs=false"),
             kind="check"),  # --b-overrides last: it takes every argument after it
        Step("host_syncs", 150, (PY, "scripts/gpu_checks/check_host_syncs.py", "--json", "{dir}/host_syncs.json",
                                 "experiment=gpu_small", "model=gpt2_small", "train.batch_size=16",
                                 "train.max_steps=14", "train.val_every=14", "train.val_tokens=16384",
                                 "train.log_max_logit=false"), kind="check"),
        Step("gpt2_small_softmax_family", 300, bench_train(*GPT2_SMALL, "--variants",
                                                           "softmax,softcap_tanh,softcap_softsign,alsc",
                                                           "--out", "{dir}/bench_train")),
        Step("gpt2_small_others", 300, bench_train(*GPT2_SMALL, "--variants", "threshold,diff_threshold,sigmoid",
                                                   "--out", "{dir}/bench_train")),
        # what the Gluon tier changes in a whole step: each kernel case with the public function's tier choice
        # and with the portable kernels only, train.py (captured step) at `small` and the plain loop at GPT-2 small
        Step("small_tiers", 420, bench_train("--model", "small", "--vocab", "2048", "--batch", "32", "--steps", "30",
                                             "--variants", "softcap_tanh,threshold", "--cuda-graphs", "--no-default",
                                             "--train-py", "--train-py-steps", "100", "--tiers", "auto,portable",
                                             "--out", "{dir}/bench_train_small_tiers")),
        Step("gpt2_small_tiers_softmax_family", 300, bench_train(*GPT2_SMALL, "--variants", "softmax,softcap_tanh",
                                                                 "--tiers", "auto,portable",
                                                                 "--out", "{dir}/bench_train_tiers")),
        Step("gpt2_small_tiers_others", 420, bench_train(*GPT2_SMALL, "--variants",
                                                         "threshold,sigmoid,diff_threshold", "--tiers",
                                                         "auto,portable", "--out", "{dir}/bench_train_tiers")),
        # the plain loop without torch.compile (notebooks, variable shapes), every variant against SDPA
        Step("small_eager", 240, bench_train("--model", "small", "--vocab", "2048", "--batch", "32", "--steps", "30",
                                             "--eager", "--no-default", "--out", "{dir}/bench_train_small_eager")),
        # the same loop in paired rounds (the host's drift cancels) with each variant's extra ops per step
        Step("eager_rounds", 240, (PY, "scripts/bench/train_eager_rounds.py", "--rounds", "6",
                                   "--profile", "threshold/triton", "--out", "{dir}/train_eager_rounds")),
        Step("profile_step", 220, (PY, "scripts/bench/profile_train_step.py", "--cases", "sdpa:16,triton:16",
                                   "--out", "{dir}/profile_train_step")),
        Step("profile_loop", 150, (PY, "scripts/bench/profile_train_loop.py", "--python-steps", "60:70", "--out", "{dir}",
                                   "experiment=gpu_small", "attn=softcap_tanh", "train.max_steps=100",
                                   "train.val_every=100", "train.log_max_logit=false", "logger=csv",
                                   "trainer.enable_progress_bar=false", "hydra.run.dir={dir}/run")),
    ],
    "decode": [
        Step("decode", 480, (PY, "scripts/bench/bench_decode.py", "--out", "{dir}/bench_decode")),
    ],
    "ablation": [
        # its own budget: training stops in time for the evaluations and the report
        Step("ablation", 540, ("bash", "scripts/run_ablation.sh", "device"), kind="all",
             env=(("OUT", "{dir}"), ("ABLATION_TRAIN_BUDGET_S", "{train_budget}"))),
    ],
    "ddp": [
        Step("allreduce", 90, (PY, "scripts/bench/bench_allreduce.py", "--gpus", "{gpus}", "--out", "{dir}/bench_allreduce"),
             kind="all", min_gpus=2, env=(("NCCL_DEBUG", "INFO"),)),
        Step("scaling", 250, (PY, "scripts/bench/bench_ddp.py", "--gpus", "{gpus}", "--out", "{dir}/bench_ddp",
                              "experiment=gpu_small", "model=gpt2_small", "train.batch_size=16", "train.max_steps=100",
                              "train.val_every=100", "train.val_tokens=16384", "train.warmup_steps=10",
                              "train.log_max_logit=false"), kind="all", min_gpus=2),
        Step("fsdp", 150, FSDP, kind="all"),
    ],
}


def resolve(targets: list[str]) -> list[tuple[str, Step]]:
    """(phase, step) for each PHASE or PHASE:STEP, in the order given, each step once."""
    chosen: list[tuple[str, Step]] = []
    for target in targets:
        phase, _, name = target.partition(":")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        steps = [s for s in PHASES[phase] if not name or s.name == name]
        if not steps:
            raise ValueError(f"phase {phase} has no step {name!r}; its steps: {', '.join(s.name for s in PHASES[phase])}")
        chosen += [(phase, s) for s in steps if (phase, s) not in chosen]
    return chosen


def plan(chosen: list[tuple[str, Step]], gpus: int) -> tuple[list[list[tuple[str, Step]]], list, list]:
    """(lanes: the single-GPU steps of each GPU in run order, every-GPU steps, steps this host cannot run)."""
    lanes: list[list[tuple[str, Step]]] = [[] for _ in range(gpus)]
    load = [0.0] * gpus
    shared = [0.0] * gpus  # the longest limit of the checks now at the end of a lane (they run together)
    every, unfit = [], []
    for phase, step in chosen:
        if step.min_gpus > gpus:
            unfit.append((phase, step))
        elif step.kind == "all":
            every.append((phase, step))
        else:
            g = min(range(gpus), key=lambda i: load[i])
            lanes[g].append((phase, step))
            if step.kind == "check":
                load[g] += max(0.0, step.limit_s - shared[g])
                shared[g] = max(shared[g], step.limit_s)
            else:
                load[g] += step.limit_s
                shared[g] = 0.0
    return lanes, every, unfit


def batches(lane: list[tuple[str, Step]]) -> list[list[tuple[str, Step]]]:
    """A lane's steps grouped for running: consecutive checks together, every timed step alone."""
    out: list[list[tuple[str, Step]]] = []
    for item in lane:
        if item[1].kind == "check" and out and out[-1][0][1].kind == "check":
            out[-1].append(item)
        else:
            out.append([item])
    return out


def gpu_count() -> int:
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


class Runner:
    """Runs steps under the call's budget, logs each to its folder in `work`, keeps the summary and
    the archive in `out` current after every step."""

    def __init__(self, work: Path, out: Path, budget_s: float, env: dict[str, str], quiet: bool = False):
        self.work, self.out, self.env, self.quiet = work, out, env, quiet
        self.deadline = time.monotonic() + budget_s
        self.lock = threading.Lock()
        self.rows: list[tuple[str, str, float, str, str]] = []  # (step, status, seconds, gpus, command)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, target: str, status: str, seconds: float, gpus: str, command: str) -> None:
        with self.lock:
            self.rows.append((target, status, seconds, gpus, command))
            print(f"[{target}] {status} after {seconds:.0f}s (GPUs {gpus})", flush=True)
            self.write_summary()

    def write_summary(self) -> None:
        lines = [f"{target:34} {status:24} {seconds:4.0f}s  GPUs {gpus:6} {command}"
                 for target, status, seconds, gpus, command in self.rows]
        text = "\n".join(lines) + "\n"
        (self.work / "summary.txt").write_text(text)
        (self.out / "summary.txt").write_text(text)
        archive = self.out / "gpu_check.tar.gz"
        try:
            with tarfile.open(archive.with_suffix(".tmp"), "w:gz") as tar:
                tar.add(self.work, arcname="gpu_check", filter=lambda t: None if t.name.endswith(".ckpt") else t)
        except OSError as err:  # a running step removed a file while it was read: the next step's update has it
            print(f"archive not updated: {err}", flush=True)
            return
        archive.with_suffix(".tmp").replace(archive)

    def start(self, phase: str, step: Step, gpus: list[int]):
        """The step's process (its own process group), or None where the budget is spent."""
        target, on = f"{phase}:{step.name}", ",".join(map(str, gpus))
        left = self.left()
        if left < MIN_START_S:
            self.record(target, "not started (budget)", 0, on, "")
            return None
        step_dir = self.work / phase / step.name
        step_dir.mkdir(parents=True, exist_ok=True)
        fields = {"dir": str(step_dir), "gpus": str(len(gpus)), "train_budget": str(max(60, int(left) - 150))}
        cmd = [part.format(**fields) for part in step.cmd]
        env = {**self.env, "CUDA_VISIBLE_DEVICES": on}
        env.update({k: self.env.get(k, v.format(**fields)) if k.startswith("ABLATION_") else v.format(**fields)
                    for k, v in step.env})  # the caller's own ABLATION_* settings win
        limit = min(step.limit_s, left)
        log = (step_dir / "log.txt").open("w")
        log.write(f"$ {' '.join(cmd)}\n# GPUs {on}, limit {limit:.0f}s\n")
        log.flush()
        print(f"[{target}] start on GPUs {on}, limit {limit:.0f}s: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return Started(proc, log, time.monotonic(), limit, target, on, " ".join(cmd), step_dir)

    def finish(self, s: "Started") -> None:
        try:
            rc = s.proc.wait(timeout=max(0.0, s.t0 + s.limit - time.monotonic()))
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            stop(s.proc)
            status = f"timed out ({s.limit:.0f}s)"
        s.log.close()
        if not self.quiet:
            tail = (s.step_dir / "log.txt").read_text(errors="replace").splitlines()[-15:]
            with self.lock:
                print("\n".join(f"  | {line[:200]}" for line in tail), flush=True)
        self.record(s.target, status, time.monotonic() - s.t0, s.gpus, s.command)

    def run_batch(self, batch: list[tuple[str, Step]], gpus: list[int]) -> None:
        started = [s for s in (self.start(phase, step, gpus) for phase, step in batch) if s is not None]
        for s in started:
            self.finish(s)

    def run(self, lanes, every, unfit) -> None:
        for phase, step in unfit:
            self.record(f"{phase}:{step.name}", f"not run (needs {step.min_gpus} GPUs)", 0, "-", "")
        threads = [threading.Thread(target=self.run_lane, args=(lane, g)) for g, lane in enumerate(lanes) if lane]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for phase, step in every:
            self.run_batch([(phase, step)], list(range(len(lanes))))

    def run_lane(self, lane: list[tuple[str, Step]], gpu: int) -> None:
        for batch in batches(lane):
            self.run_batch(batch, [gpu])


@dataclasses.dataclass
class Started:
    proc: subprocess.Popen
    log: object
    t0: float
    limit: float
    target: str
    gpus: str
    command: str
    step_dir: Path


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL 10 s later if it is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def environment() -> dict[str, str]:
    """The steps' environment: hydra from the carried wheels where the image lacks it, the repo on the
    path, the carried token cache, wandb offline."""
    env = dict(os.environ)
    paths = [str(ROOT)]
    if subprocess.run([sys.executable, "-c", "import hydra"], capture_output=True).returncode:
        wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
        if wheels:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels], check=False)
            paths.append("/tmp/site")
        else:
            print("warning: no hydra here and no .whl to install it from (scripts/run_ablation.sh prepare)", flush=True)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("ATTNLAB_CACHE_DIR", str(ROOT / ".device_cache" / "attnlab"))
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    return env


def describe(env: dict[str, str]) -> str:
    lines = [f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
             f"commit: {env.get('ATTNLAB_COMMIT', 'unknown (set ATTNLAB_COMMIT)')}"]
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                [sys.executable, "-c", "import sys, torch, triton; print('python', sys.version.split()[0], "
                                       "'torch', torch.__version__, 'triton', triton.__version__)"]):
        try:
            lines.append(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60).stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as err:
            lines.append(f"{cmd[0]}: {err}")
    return "\n".join(lines) + "\n"


def listing() -> str:
    lines = []
    for phase, steps in PHASES.items():
        lines.append(phase)
        for s in steps:
            need = {"timed": "one GPU, alone", "check": "one GPU, shared", "all": "every GPU"}[s.kind]
            if s.min_gpus > 1:
                need += f", {s.min_gpus}+ GPUs"
            lines.append(f"  {phase + ':' + s.name:34} {s.limit_s:4d}s  {need:24} {' '.join(s.cmd)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [--budget S] [--out DIR] "
                                 "PHASE[:STEP] ...  (phases: " + " ".join(PHASES) + "; --list shows the steps)")
    ap.add_argument("targets", nargs="*", metavar="PHASE[:STEP]")
    ap.add_argument("--budget", type=float, default=550.0, help="seconds for every step of this call together")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "gpu_out")))
    ap.add_argument("--list", action="store_true", help="print every phase's steps and exit")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all that nvidia-smi -L lists)")
    args = ap.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if not args.targets:
        ap.error("name at least one phase")
    try:
        chosen = resolve(args.targets)
    except ValueError as err:
        ap.error(str(err))
    gpus = args.gpus if args.gpus is not None else gpu_count()
    if gpus < 1:
        print("no GPU found (nvidia-smi -L lists none)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    budget_end = time.monotonic() + args.budget
    env = environment()
    (work / "environment.txt").write_text(describe(env))
    print((work / "environment.txt").read_text(), end="", flush=True)
    runner = Runner(work, out, budget_end - time.monotonic(), env)
    runner.run(*plan(chosen, gpus))
    later = [target for target, status, *_ in runner.rows if status.startswith("not started")]
    print(f"\nsummary (also {out / 'summary.txt'}; everything in {out / 'gpu_check.tar.gz'}):")
    print((out / "summary.txt").read_text(), end="")
    if later:
        print("not started for the budget; run them in another call: " + " ".join(later))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(status == "ok" or status.startswith("not run") for _, status, *_ in runner.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
