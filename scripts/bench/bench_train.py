"""Training throughput (tokens/s, MFU, peak memory) of the GPT per attention variant on one GPU.

Rows per variant: a plain PyTorch training loop (no Lightning: compiled step, fused AdamW, random
tokens), and with --train-py `train.py` itself on the same model size (its steady-state tokens/s
from results.json, Shakespeare tokens). The same model with torch SDPA (plain softmax) is the
yardstick, in the same process. bf16 autocast, torch.compile(fullgraph=True) end to end;
--eager adds the same loop without torch.compile; --cuda-graphs replays the compiled step as CUDA
graphs: the plain loop through torch.compile (mode reduce-overhead), train.py through
train.cuda_graphs=step (its whole forward and backward as one graph). --tiers runs every kernel case
once per kernel tier (`ATTNLAB_GLUON` set for the case, train.py's process included: `auto` the public
function's timed choice, `gluon` the Gluon kernels wherever they serve, `portable` the portable Triton
kernels), each row beside the same loop's portable row: on Hopper, what the Gluon tier changes in a
whole training step.

    python scripts/bench/bench_train.py --model gpt2_small --batch 16 --out gpu_out/bench_train
    python scripts/bench/bench_train.py --model small --vocab 2048 --batch 32 --train-py --cuda-graphs
    python scripts/bench/bench_train.py --model gpt2_small --batch 16 --tiers auto,portable
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from attn.kernels.tiers import GLUON_ENV  # noqa: E402
from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402
from timing import git_commit, sync  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a dry run of the script

CASES = [  # (variant, backend, params)
    ("softmax", "sdpa", {}),
    ("softmax", "triton", {}),
    ("softcap_tanh", "triton", {"cap": 30.0}),
    ("softcap_softsign", "triton", {"cap": 30.0}),
    ("alsc", "triton", {"cap": 30.0, "knee": 0.5}),
    ("threshold", "triton", {"beta": 1.0, "power": 2.0}),
    ("diff_threshold", "triton", {"beta": 1.0, "power": 2.0}),
    ("sigmoid", "triton", {}),
]


# --tiers names -> ATTNLAB_GLUON values (attn/kernels/tiers.py)
TIERS = {"auto": "auto", "gluon": "1", "portable": "0"}


@contextlib.contextmanager
def kernel_tier(tier: str | None):
    """ATTNLAB_GLUON set for one case (None: the environment as it is), restored after; the public
    function reads it per call and keys its launch plans by it, and train.py's process inherits it."""
    if tier is None:
        yield
        return
    before = os.environ.get(GLUON_ENV)
    os.environ[GLUON_ENV] = TIERS[tier]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLUON_ENV, None)
        else:
            os.environ[GLUON_ENV] = before


def build_step(model_cfg: dict, variant: str, backend: str, params: dict, batch: int, loss_in_graph: bool = True,
               cuda_graphs: bool = False, eager: bool = False):
    """The compiled model and one full training step (forward, loss, backward, fused AdamW) on random tokens.
    eager=True: the model as it is, without torch.compile (a notebook's or a variable-shape loop).

    loss_in_graph=False computes the loss outside the compiled graph, from fp32-upcast logits
    (how the trainer did it before; kept to measure the difference)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    cfg = GPTConfig(**model_cfg, attn=AttnConfig(name=variant, backend=backend, params=params))
    model = GPT(cfg).to(DEVICE)
    compiled = model if eager else torch.compile(model, fullgraph=True, mode="reduce-overhead" if cuda_graphs else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), device=DEVICE)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step():
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            if loss_in_graph:
                loss = compiled(inputs, targets=targets) / targets.numel()
            else:
                logits = compiled(inputs)
        if not loss_in_graph:
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def warm_up(step, steps: int = 5) -> None:
    """Untimed steps (compile, autotune), then the peak-memory counter is reset."""
    for _ in range(steps):
        step()
    sync()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def time_steps(step, steps: int) -> tuple[float, torch.Tensor]:
    """(seconds per step, last loss) over `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    return (time.perf_counter() - t0) / steps, loss


def traced_timeline(step, steps: int = 10) -> str:
    """The GPU timeline of `steps` more steps under torch.profiler (profile_train_loop.gpu_timeline)."""
    from profile_train_loop import gpu_timeline

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    return gpu_timeline(prof, steps)


def bench_case(model_cfg: dict, variant: str, backend: str, params: dict, batch: int, steps: int, peak: float,
               loss_in_graph: bool = True, cuda_graphs: bool = False, trace: bool = False, eager: bool = False):
    model, step = build_step(model_cfg, variant, backend, params, batch, loss_in_graph, cuda_graphs, eager)
    cfg = model.cfg
    warm_up(step)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    dt, loss = time_steps(step, steps)
    recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before
    if trace:
        print(f"[{variant}, {'eager' if eager else 'plain'} loop, CUDA graphs {cuda_graphs}]" + traced_timeline(step),
              flush=True)
    tps = batch * cfg.context / dt
    return {
        "variant": variant, "backend": backend, "ms_per_step": dt * 1e3, "tokens_per_s": tps,
        "mfu": tps * model.flops_per_token() / (peak * 1e12), "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0,
        "params_m": model.num_params() / 1e6, "loss": loss.item(), "new_graphs_while_timed": recompiles,
        "loss_in_graph": loss_in_graph, "loop": "eager" if eager else "plain", "cuda_graphs": cuda_graphs,
    }


def train_py_case(args, model_cfg: dict, variant: str, backend: str, params: dict, cuda_graphs: bool) -> dict:
    """train.py on the same model size and batch (Shakespeare tokens, its own data pipeline, Lightning),
    long enough for steady-state windows; its results.json tokens_per_s (after warm-up, outside validation)."""
    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_train_{variant}_"))
    steps = args.train_py_steps
    overrides = [
        "experiment=gpu_small", f"model={args.model}", f"attn={variant}", f"attn.backend={backend}",
        f"model.context={model_cfg['context']}", f"train.batch_size={args.batch}", f"train.max_steps={steps}",
        f"train.val_every={steps}", "train.log_every=10", "train.val_tokens=65536", "train.log_max_logit=false",
        "train.compile=true", f"train.cuda_graphs={'step' if cuda_graphs else 'false'}", "logger=csv",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
        *[f"attn.params.{k}={v}" for k, v in params.items()], *args.train_py_overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, capture_output=True,
                          text=True)
    row = {"variant": variant, "backend": backend, "loop": "train.py", "cuda_graphs": cuda_graphs,
           "wall_s": time.perf_counter() - t0, "overrides": overrides}
    results = run_dir / "results.json"
    if proc.returncode != 0 or not results.exists():
        row["error"] = f"exit {proc.returncode}: {proc.stderr[-300:]}"
        return row
    res = json.loads(results.read_text())
    metrics = run_dir / "csv" / "metrics.csv"
    if metrics.exists():  # every logged window's tokens/s: a slow window (a recompile, a stall) shows here
        with metrics.open() as f:
            row["window_tokens_per_s"] = [round(float(r["train/tokens_per_s"])) for r in csv.DictReader(f)
                                          if r.get("train/tokens_per_s")]
    row.update(tokens_per_s=res["tokens_per_s"], mfu=res["mfu"] or 0.0, peak_mem_gb=res["peak_memory_gb"] or 0.0,
               params_m=res["params"] / 1e6, ms_per_step=args.batch * model_cfg["context"] / res["tokens_per_s"] * 1e3,
               loss=res["val_loss"], new_graphs_while_timed="-")
    return row


def write_report(args, model_cfg, rows):
    """Table + JSON of the rows so far (written after every case: a cut-off run keeps its numbers)."""
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)", "torch": torch.__version__,
        "triton": __import__("triton").__version__, "commit": git_commit(), "model": args.model,
        "model_config": model_cfg, "batch": args.batch, "steps": args.steps, "peak_tflops": args.peak_tflops,
        "loss_in_graph": not args.loss_outside_graph,
    }
    lines = [
        f"# Training throughput: {args.model}, batch {args.batch} x {model_cfg['context']}, bf16"
        + (", compiled" if any(r.get("loop", "plain") != "eager" for r in rows) else ", eager")
        + ("" if meta["loss_in_graph"] else ", loss outside the compiled graph"),
        "", f"{meta['date']} | {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | commit {meta['commit']}", "",
        "| variant | backend | kernel tier | loop | CUDA graphs | ms/step | tokens/s | vs SDPA (same loop) "
        "| vs plain loop (same variant) | vs portable tier (same loop) | MFU | peak mem GB "
        "| graphs compiled while timed |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def find(loop, variant, backend, graphs, tier):
        return next((r["tokens_per_s"] for r in rows if r.get("loop", "plain") == loop and r["variant"] == variant
                     and r["backend"] == backend and r.get("cuda_graphs", False) == graphs
                     and r.get("tier") == tier and "tokens_per_s" in r), None)

    def ratio(value, reference):
        return f"{value / reference:.2f}x" if reference else "-"

    for r in rows:
        loop, graphs, tier = r.get("loop", "plain"), r.get("cuda_graphs", False), r.get("tier")
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['backend']} | {tier or '-'} | {loop} | {graphs} | "
                         f"error: {r['error'][:80]} | | | | | | | |")
            continue
        tps = r["tokens_per_s"]
        sdpa = find(loop, "softmax", "sdpa", graphs, None)
        plain = find("plain", r["variant"], r["backend"], graphs, tier) if loop != "plain" else None
        portable = (find(loop, r["variant"], r["backend"], graphs, "portable")
                    if tier is not None and tier != "portable" else None)
        lines.append(
            f"| {r['variant']} | {r['backend']} | {tier or '-'} | {loop} | {graphs} | {r['ms_per_step']:.1f} | "
            f"{tps:,.0f} | {ratio(tps, sdpa)} | {ratio(tps, plain)} | {ratio(tps, portable)} | {100 * r['mfu']:.1f}% | "
            f"{r['peak_mem_gb']:.1f} | {r['new_graphs_while_timed']} |"
        )
    table = "\n".join(lines)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(table + "\n")
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2_small", help="a configs/model/*.yaml preset")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--context", type=int, default=None, help="the model's context (default: the preset's)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="bf16 dense peak (H100/H200: 989.4)")
    ap.add_argument("--variants", default=None, help="comma list of the kernel cases to run (the SDPA yardstick always runs)")
    ap.add_argument("--loss-outside-graph", action="store_true",
                    help="compute the loss eagerly from fp32 logits (the trainer's former path), for comparison")
    ap.add_argument("--cuda-graphs", action="store_true", help="also every case with CUDA graphs (reduce-overhead)")
    ap.add_argument("--no-default", action="store_true", help="with --cuda-graphs or --eager: only those rows")
    ap.add_argument("--eager", action="store_true", help="also every case without torch.compile (loop 'eager')")
    ap.add_argument("--train-py", action="store_true", help="also train.py per case (needs hydra and the token cache)")
    ap.add_argument("--train-py-steps", type=int, default=80)
    ap.add_argument("--train-py-overrides", nargs="*", default=[], help="extra Hydra overrides for train.py")
    ap.add_argument("--tiers", default=None,
                    help=f"comma list of kernel tiers ({', '.join(TIERS)}): every kernel case once per tier")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--trace", action="store_true",
                    help="print each plain-loop case's GPU timeline over 10 more steps (busy vs wall, top kernels)")
    args = ap.parse_args()
    model_cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{args.model}.yaml").read_text())
    model_cfg["vocab_size"] = args.vocab
    if args.context:
        model_cfg["context"] = args.context
    wanted = set(args.variants.split(",")) if args.variants else None
    tiers = args.tiers.split(",") if args.tiers else [None]
    unknown = {t for t in tiers if t is not None and t not in TIERS}
    if unknown:
        raise SystemExit(f"--tiers: unknown {sorted(unknown)}; allowed: {', '.join(TIERS)}")
    rows = []
    modes = ([] if args.no_default else ["plain"]) + (["graphs"] if args.cuda_graphs else []) + (
        ["eager"] if args.eager else [])
    for variant, backend, params in CASES:
        if wanted and backend != "sdpa" and variant not in wanted:
            continue
        for tier, mode in [(t, m) for t in ([None] if backend == "sdpa" else tiers) for m in modes]:
            graphs = mode == "graphs"
            with kernel_tier(tier):
                try:
                    row = bench_case(model_cfg, variant, backend, params, args.batch, args.steps, args.peak_tflops,
                                     loss_in_graph=not args.loss_outside_graph, cuda_graphs=graphs,
                                     trace=args.trace, eager=mode == "eager")
                except Exception as e:  # report and continue: one failing variant must not hide the others
                    row = {"variant": variant, "backend": backend, "cuda_graphs": graphs,
                           "loop": "eager" if mode == "eager" else "plain", "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append({**row, "tier": tier})
                print(rows[-1], flush=True)
                write_report(args, model_cfg, rows)
                if args.train_py and mode != "eager":
                    rows.append({**train_py_case(args, model_cfg, variant, backend, params, graphs), "tier": tier})
                    print(rows[-1], flush=True)
                    write_report(args, model_cfg, rows)
    print(write_report(args, model_cfg, rows))


if __name__ == "__main__":
    main()
