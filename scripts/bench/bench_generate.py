"""Generation speed with and without the KV cache (GPT.generate), greedy, randomly initialized
models of the configs/model presets, reference backend unless --backend says otherwise.

    python scripts/bench/bench_generate.py [--models tiny,small] [--variants softmax,threshold]
        [--new-tokens 256] [--prompt 16] [--repeats 3] [--device cpu] [--vocab 2048]
        [--autocast auto|none|bf16|fp16] [--out docs/results/generate]

Paths: uncached (every token re-encodes the window), cached eager (the static KV cache, one eager
decode step per token) and, on CUDA, cached with the decode step captured as a CUDA graph and
replayed per token (its capture, once per generate call, is inside the timing). Per row: tokens/s
of each path (best of --repeats, the paths interleaved), the speed-ups over uncached, and whether
the paths gave the same tokens: cached eager against uncached while the sequence fits the context
(past it the cached path re-encodes 3/4 of the context every context/4 tokens, the uncached one
slides by one: GPT.generate), graph against cached eager over the whole output (the same kernels
on the same inputs: expected identical). --autocast auto: bf16 on CUDA (as eval.generate), none on
CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import git_commit, wall_s  # noqa: E402


def build(model: str, variant: str, vocab: int, backend: str, device: torch.device) -> GPT:
    preset = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{model}.yaml"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, attn=AttnConfig(name=variant, backend=backend), **preset)).to(device)
    model.eval()
    return model


def autocast(device: torch.device, kind: str):
    if kind == "auto":
        kind = "bf16" if device.type == "cuda" else "none"
    if kind == "none":
        return contextlib.nullcontext(), kind
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if kind == "bf16" else torch.float16), kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small", help="configs/model presets, comma list")
    ap.add_argument("--variants", default="softmax,threshold", help="comma list")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--autocast", default="auto", choices=("auto", "none", "bf16", "fp16"),
                    help="autocast around generation (auto: bf16 on CUDA, none on CPU)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    context, precision = autocast(device, args.autocast)
    # path -> generate keyword arguments
    paths = {"uncached": dict(kv_cache=False), "cached_eager": dict(kv_cache=True, graph=False)}
    if device.type == "cuda":
        paths["cached_graph"] = dict(kv_cache=True, graph=True)
    rows = []
    for model_name in args.models.split(","):
        for variant in args.variants.split(","):
            model = build(model_name, variant, args.vocab, args.backend, device)
            prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
            runs = {path: [] for path in paths}
            outputs = {}
            with context:
                for kwargs in paths.values():  # warm-up: allocations, compilation, autotuning, first calls
                    model.generate(prompt, 8, temperature=0, **kwargs)
                for _ in range(args.repeats):
                    for path, kwargs in paths.items():
                        seconds, outputs[path] = wall_s(
                            lambda: model.generate(prompt, args.new_tokens, temperature=0, **kwargs), device)
                        runs[path].append(seconds)
            fit = model.cfg.context
            row = {"model": model_name, "variant": variant, "context": fit, "params": model.num_params(),
                   "same_tokens": bool(torch.equal(outputs["cached_eager"][:, :fit], outputs["uncached"][:, :fit]))}
            for path in paths:
                row[f"{path}_tokens_per_s"] = args.new_tokens / min(runs[path])
            row["speedup"] = row["cached_eager_tokens_per_s"] / row["uncached_tokens_per_s"]
            line = (f"{model_name:10} {variant:16} uncached {row['uncached_tokens_per_s']:8.1f} tok/s  cached eager "
                    f"{row['cached_eager_tokens_per_s']:8.1f} tok/s ({row['speedup']:5.1f}x)")
            if "cached_graph" in paths:
                row["graph_speedup"] = row["cached_graph_tokens_per_s"] / row["uncached_tokens_per_s"]
                row["graph_same_tokens"] = bool(torch.equal(outputs["cached_graph"], outputs["cached_eager"]))
                line += (f"  cached graph {row['cached_graph_tokens_per_s']:8.1f} tok/s ({row['graph_speedup']:5.1f}x,"
                         f" same tokens as eager {row['graph_same_tokens']})")
            rows.append(row)
            print(f"{line}  eager same tokens as uncached within the context {row['same_tokens']}", flush=True)
    commit = git_commit()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": args.device,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "commit": commit or "unknown", "backend": args.backend,
            "new_tokens": args.new_tokens, "prompt": args.prompt, "repeats": args.repeats, "autocast": precision,
            "vocab": args.vocab}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        where = meta.get("gpu", f"{args.device} ({meta['cpu']}, {meta['threads']} threads)")
        graph = "cached_graph" in paths
        lines = [f"# Generation with and without the KV cache ({args.new_tokens} new tokens, prompt {args.prompt})", "",
                 f"{meta['date']} | {where} | torch {meta['torch']} | backend {args.backend} | autocast {precision} | "
                 f"vocab {args.vocab} | commit {meta['commit']} | best of {args.repeats}, greedy, random weights, batch 1",
                 "",
                 "| model | variant | context | params | uncached tok/s | cached eager tok/s | speed-up |"
                 + (" cached graph tok/s | speed-up | graph = eager tokens |" if graph else "")
                 + " eager = uncached tokens within the context |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | --- |" if graph else "") + " --- |"]
        for r in rows:
            line = (f"| {r['model']} | {r['variant']} | {r['context']} | {r['params']:,} | "
                    f"{r['uncached_tokens_per_s']:.1f} | {r['cached_eager_tokens_per_s']:.1f} | {r['speedup']:.1f}x |")
            if graph:
                line += f" {r['cached_graph_tokens_per_s']:.1f} | {r['graph_speedup']:.1f}x | {r['graph_same_tokens']} |"
            lines.append(f"{line} {r['same_tokens']} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
