"""Generation speed with and without the KV cache (GPT.generate), greedy, randomly initialized
models of the configs/model presets, reference backend unless --backend says otherwise.

    python scripts/bench_generate.py [--models tiny,small] [--variants softmax,threshold]
        [--new-tokens 256] [--prompt 16] [--repeats 3] [--device cpu] [--out docs/results/generate]

Per row: tokens/s of each path (best of --repeats, the two paths interleaved), the speed-up, and
whether both gave the same tokens while the sequence fits the context (past it the cached path
re-encodes 3/4 of the context every context/4 tokens, the uncached one slides by one: GPT.generate).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402


def build(model: str, variant: str, vocab: int, backend: str, device: torch.device) -> GPT:
    preset = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{model}.yaml"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, attn=AttnConfig(name=variant, backend=backend), **preset)).to(device)
    model.eval()
    return model


def timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


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
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for model_name in args.models.split(","):
        for variant in args.variants.split(","):
            model = build(model_name, variant, args.vocab, args.backend, device)
            prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
            runs = {True: [], False: []}
            outputs = {}
            model.generate(prompt, 4, temperature=0, kv_cache=True)  # warm-up (allocations, first calls)
            model.generate(prompt, 4, temperature=0, kv_cache=False)
            for _ in range(args.repeats):
                for kv_cache in (False, True):
                    seconds, outputs[kv_cache] = timed(
                        lambda: model.generate(prompt, args.new_tokens, temperature=0, kv_cache=kv_cache), device)
                    runs[kv_cache].append(seconds)
            row = {"model": model_name, "variant": variant, "context": model.cfg.context,
                   "params": model.num_params(), "uncached_tokens_per_s": args.new_tokens / min(runs[False]),
                   "cached_tokens_per_s": args.new_tokens / min(runs[True]),
                   "same_tokens": bool(torch.equal(outputs[True][:, :model.cfg.context],
                                                   outputs[False][:, :model.cfg.context]))}
            row["speedup"] = row["cached_tokens_per_s"] / row["uncached_tokens_per_s"]
            rows.append(row)
            print(f"{model_name:8} {variant:16} uncached {row['uncached_tokens_per_s']:8.1f} tok/s  cached "
                  f"{row['cached_tokens_per_s']:8.1f} tok/s  {row['speedup']:5.1f}x  same tokens within the context {row['same_tokens']}",
                  flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": args.device,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "commit": commit or "unknown", "backend": args.backend,
            "new_tokens": args.new_tokens, "prompt": args.prompt, "repeats": args.repeats}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        lines = [f"# Generation with and without the KV cache ({args.new_tokens} new tokens, prompt {args.prompt})", "",
                 f"{meta['date']} | {args.device} ({meta['cpu']}, {meta['threads']} threads) | torch {meta['torch']} | "
                 f"backend {args.backend} | commit {meta['commit']} | best of {args.repeats}, greedy, random weights", "",
                 "| model | variant | context | params | uncached tokens/s | cached tokens/s | speed-up | same tokens within the context |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {r['model']} | {r['variant']} | {r['context']} | {r['params']:,} | {r['uncached_tokens_per_s']:.1f} | "
                  f"{r['cached_tokens_per_s']:.1f} | {r['speedup']:.1f}x | {r['same_tokens']} |" for r in rows]
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
