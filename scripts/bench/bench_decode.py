"""Decode-step benchmark on the GPU: one new query row against a long KV cache, every variant through
the fused kernels (their split-key, flash-decoding forward) against SDPA on the same cache; and
greedy generation tokens/s of a GPT-2-small-sized model with and without the KV cache.

    python scripts/bench/bench_decode.py --out gpu_out/bench_decode [--caches 4096,32768] [--batch 8]
        [--heads 16] [--head-dim 128] [--new-tokens 256] [--prompt 64] [--skip-generate]

Attention: (B, H, D) = (8, 16, 128), bf16, one query row (Q = 1) against caches of 4K and 32K keys,
causal (bottom-right aligned: the last query sees every key). SDPA runs with is_causal=False, which
for a single query row is the same mask (PyTorch's is_causal aligns top-left). Times are
`triton.testing.do_bench` medians after warm-up (autotuning and compilation happen there); GB/s
counts reading K and V once (the memory a decode step must move). Every case is prepared and run
once untimed before the first is timed (the first timed case of a process otherwise ran ~2x slow).
Two timings per call: eager (do_bench: the call's host work included, as a Python loop calling it
feels it; a 4K-key step is ~70 us of GPU work, the size of one call's host work) and graph
(`do_bench_cudagraph`: calls captured in one CUDA graph and replayed, the GPU time alone, as
`GPT.generate`'s captured decode step runs them). The cases are timed --rounds times, each round in
a rotated order (round r starts at case r), and each row reports the median over rounds, so no
case is always first or always after the same neighbour.

Generation: the configs/model/gpt2_small.yaml model, random weights, bf16 autocast, greedy, best of
--repeats, cached and uncached interleaved; backend 'triton' (our kernels, the cached path's decode
steps included) and 'sdpa' (torch's kernels; its decode steps run on the reference, which serves
key_lengths); the cached path is GPT.generate's default on CUDA, its decode step captured as a CUDA
graph and replayed per token (scripts/bench/bench_generate.py also times the eager decode steps).

Writes OUT.json and OUT.md (date, GPU, torch/triton versions, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omegaconf import OmegaConf  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from timing import median_ms, result_header, wall_s  # noqa: E402

import attn  # noqa: E402
from attn.kernels import runtime  # noqa: E402
from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402

# variant -> spec parameters (caps large enough to be realistic, as in scripts/bench/bench_attention.py)
VARIANTS = {
    "softmax": {},
    "softcap_tanh": {"cap": 30.0},
    "softcap_softsign": {"cap": 30.0},
    "alsc": {"cap": 30.0, "knee": 0.5},
    "threshold": {"beta": 1.0, "power": 2.0},
    "diff_threshold": {"beta": 1.0, "power": 2.0},
    "sigmoid": {},
}


def decode_inputs(name: str, batch: int, heads: int, cache: int, head_dim: int, dtype: torch.dtype) -> dict:
    """One query row and a filled cache; unit rows for the threshold family (cosine scores)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(length):
        x = torch.randn(batch, length, heads, head_dim, device="cuda", generator=gen, dtype=torch.float32)
        return (F.normalize(x, dim=-1) if "threshold" in name else x).to(dtype)

    x = {"q": rand(1), "k": rand(cache), "v": rand(cache)}
    if name == "diff_threshold":
        x.update(q2=rand(1), k2=rand(cache), lam=torch.full((heads,), 0.3, device="cuda", dtype=dtype))
    return x


def prepare_decode_step(name: str, batch: int, heads: int, cache: int, head_dim: int, dtype: torch.dtype) -> dict:
    """One decode-step case: its inputs, our call and SDPA's on them, compiled and autotuned."""
    x = decode_inputs(name, batch, heads, cache, head_dim, dtype)
    spec = attn.get_variant(name).make_spec(**VARIANTS[name])
    q, k, v = x.pop("q"), x.pop("k"), x.pop("v")
    splits = runtime.decode_splits(1, cache, batch * heads, 64, q.device)

    def ours():
        return attn.attention(q, k, v, spec, causal=True, backend="triton", extra=x)

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=False)

    with torch.no_grad():
        for fn in (ours, sdpa):  # compile / autotune outside the timing
            fn()
    torch.cuda.synchronize()
    return {"name": name, "batch": batch, "heads": heads, "cache": cache, "head_dim": head_dim, "dtype": dtype,
            "splits": splits, "ours": ours, "sdpa": sdpa,
            "kv_bytes": (2 + (name == "diff_threshold")) * k.numel() * k.element_size()}


def warm_up(case: dict) -> None:
    """Run both calls of a case as the timing will (untimed): every case gets one such pass before
    any is timed, so the first timed case does not pay the GPU's and the libraries' start-up
    (clocks ramping, lazy initialization), which made the first rows of a process ~2x slow."""
    with torch.no_grad():
        for fn in (case["ours"], case["sdpa"]):
            median_ms(fn, rep=50)


def time_decode_step(case: dict) -> dict:
    """One timing of a case: eager (do_bench) and graph-replayed (do_bench_cudagraph) ms, ours and SDPA."""
    with torch.no_grad():
        return {"ms": median_ms(case["ours"], rep=100),
                "sdpa_ms": median_ms(case["sdpa"], rep=100),
                "graph_ms": do_bench_cudagraph(case["ours"], rep=50, return_mode="median"),
                "sdpa_graph_ms": do_bench_cudagraph(case["sdpa"], rep=50, return_mode="median")}


def decode_step_row(case: dict, timings: list[dict]) -> dict:
    """A case's row: the median over rounds of each timing, the per-round values beside them."""
    med = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
    row = {"variant": case["name"], "batch": case["batch"], "heads": case["heads"], "cache": case["cache"],
           "head_dim": case["head_dim"], "dtype": str(case["dtype"]).removeprefix("torch."), "splits": case["splits"],
           **med, "vs_sdpa": med["sdpa_ms"] / med["ms"], "graph_vs_sdpa": med["sdpa_graph_ms"] / med["graph_ms"],
           "gb_per_s": case["kv_bytes"] / med["ms"] / 1e6, "graph_gb_per_s": case["kv_bytes"] / med["graph_ms"] / 1e6,
           "rounds": timings}
    print(f"{row['variant']:17} cache {row['cache']:6}  eager: ours {med['ms'] * 1e3:7.1f} us  sdpa "
          f"{med['sdpa_ms'] * 1e3:7.1f} us ({row['vs_sdpa']:.2f}x)  graph: ours {med['graph_ms'] * 1e3:7.1f} us  sdpa "
          f"{med['sdpa_graph_ms'] * 1e3:7.1f} us ({row['graph_vs_sdpa']:.2f}x, {row['graph_gb_per_s']:.0f} GB/s)  "
          f"{row['splits']} splits", flush=True)
    return row


def sweep_decode_configs(cases: list[dict], configs: list[tuple[int, int, int]], splits: list[int]) -> list[dict]:
    """Graph-replayed time of every case under each decode tile config (BLOCK_N, warps, stages) and
    split count (0: the heuristic's), set through `runtime.decode_config`'s and `runtime.decode_splits`'
    environment knobs."""
    rows = []
    try:
        for block_n, warps, stages in configs:
            os.environ[runtime.DECODE_TILES_ENV] = f"{block_n},{warps},{stages}"
            for split in splits:
                if split:
                    os.environ[runtime.DECODE_SPLITS_ENV] = str(split)
                else:
                    os.environ.pop(runtime.DECODE_SPLITS_ENV, None)
                for case in cases:
                    with torch.no_grad():
                        try:
                            case["ours"]()
                            ms = do_bench_cudagraph(case["ours"], rep=50, return_mode="median")
                        except Exception as e:  # a config that does not fit: report and go on
                            print(f"{case['name']} {os.environ[runtime.DECODE_TILES_ENV]} splits {split}: "
                                  f"{type(e).__name__}", flush=True)
                            continue
                    rows.append({"variant": case["name"], "cache": case["cache"], "block_n": block_n, "warps": warps,
                                 "stages": stages, "splits": split or "auto", "graph_ms": ms,
                                 "gb_per_s": case["kv_bytes"] / ms / 1e6})
                    print(f"sweep {case['name']:15} cache {case['cache']:6} BLOCK_N {block_n:3} warps {warps} stages "
                          f"{stages} splits {split or 'auto':>4}: {ms * 1e3:7.1f} us ({rows[-1]['gb_per_s']:.0f} GB/s)",
                          flush=True)
    finally:
        os.environ.pop(runtime.DECODE_TILES_ENV, None)
        os.environ.pop(runtime.DECODE_SPLITS_ENV, None)
    return rows


def bench_generation(variant: str, backend: str, new_tokens: int, prompt_len: int, repeats: int, vocab: int) -> dict:
    preset = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / "gpt2_small.yaml"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, attn=AttnConfig(name=variant, backend=backend), **preset))
    model.cuda()
    model.eval()
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(1)).cuda()
    best = {True: float("inf"), False: float("inf")}
    outputs = {}
    # bf16 autocast, as eval.generate runs a model on CUDA (fp32 weights, bf16 matrix products)
    with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        for kv_cache in (True, False):  # warm-up: allocations, compilation, autotuning
            model.generate(prompt, 8, temperature=0, kv_cache=kv_cache)
        for _ in range(repeats):
            for kv_cache in (False, True):
                seconds, outputs[kv_cache] = wall_s(
                    lambda: model.generate(prompt, new_tokens, temperature=0, kv_cache=kv_cache), "cuda")
                best[kv_cache] = min(best[kv_cache], seconds)
    context = model.cfg.context
    row = {"model": "gpt2_small", "variant": variant, "backend": backend, "params": model.num_params(),
           "prompt": prompt_len, "new_tokens": new_tokens, "uncached_tokens_per_s": new_tokens / best[False],
           "cached_tokens_per_s": new_tokens / best[True],
           "same_tokens": bool(torch.equal(outputs[True][:, :context], outputs[False][:, :context]))}
    row["speedup"] = row["cached_tokens_per_s"] / row["uncached_tokens_per_s"]
    print(f"gpt2_small {variant:16} {backend:8} uncached {row['uncached_tokens_per_s']:8.1f} tok/s  cached "
          f"{row['cached_tokens_per_s']:8.1f} tok/s  {row['speedup']:5.1f}x  same tokens {row['same_tokens']}",
          flush=True)
    return row


def markdown(meta: dict, steps: list, gens: list) -> str:
    lines = ["# Decode benchmark", "",
             f"{meta['date']} | {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | "
             f"commit {meta['commit']}", "",
             "## One decode step (Q = 1 against the cache, causal; SDPA is_causal=False on the same cache)", "",
             "Eager: one call as a Python loop makes it (host work included). Graph: the calls replayed from "
             "one CUDA graph (GPU time alone, as the captured decode step of `GPT.generate`). Medians over "
             "rounds of rotated case order; SDPA / ours > 1 means ours is faster.", "",
             "| variant | B | H | D | cache | dtype | splits | eager ours (us) | eager SDPA (us) | eager SDPA / ours | "
             "graph ours (us) | graph SDPA (us) | graph SDPA / ours | graph K,V GB/s |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['variant']} | {r['batch']} | {r['heads']} | {r['head_dim']} | {r['cache']} | {r['dtype']} | "
              f"{r['splits']} | {r['ms'] * 1e3:.1f} | {r['sdpa_ms'] * 1e3:.1f} | {r['vs_sdpa']:.2f} | "
              f"{r['graph_ms'] * 1e3:.1f} | {r['sdpa_graph_ms'] * 1e3:.1f} | {r['graph_vs_sdpa']:.2f} | "
              f"{r['graph_gb_per_s']:.0f} |" for r in steps]
    if gens:
        lines += ["", "## Greedy generation, GPT-2-small-sized model (random weights, bf16 autocast, batch 1)", "",
                  "| variant | backend | params | prompt | new tokens | uncached tok/s | cached tok/s | speed-up | "
                  "same tokens within the context |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {r['variant']} | {r['backend']} | {r['params']:,} | {r['prompt']} | {r['new_tokens']} | "
                  f"{r['uncached_tokens_per_s']:.1f} | {r['cached_tokens_per_s']:.1f} | {r['speedup']:.1f}x | "
                  f"{r['same_tokens']} |" for r in gens]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_out/bench_decode", help="OUT.md / OUT.json")
    ap.add_argument("--caches", default="4096,32768", help="cache lengths, comma list")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="timings of every decode case, each round in a rotated order")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--generate-variants", default="softmax,threshold", help="comma list for the generation rows")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--sweep-configs", default="", help="decode tiles to sweep, 'BLOCK_N:warps:stages' comma list "
                    "(graph time only; the decode-step table then is not timed)")
    ap.add_argument("--sweep-splits", default="0", help="key splits to sweep, comma list (0: the heuristic's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = result_header()
    print(meta, flush=True)
    steps, gens = [], []

    def write():  # after every row: a run cut off by a time limit keeps what it measured
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "decode_steps": steps, "generation": gens},
                                                       indent=1))
        out.with_suffix(".md").write_text(markdown(meta, steps, gens))

    cases = [prepare_decode_step(name, args.batch, args.heads, cache, args.head_dim, torch.bfloat16)
             for cache in (int(c) for c in args.caches.split(",")) for name in args.variants.split(",")]
    if args.sweep_configs:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.sweep_configs.split(",")]
        sweep = sweep_decode_configs(cases, configs, [int(x) for x in args.sweep_splits.split(",")])
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "sweep": sweep}, indent=1))
        return 0
    for case in cases:
        warm_up(case)
    timings = [[] for _ in cases]
    for r in range(args.rounds):
        for i in [(r + j) % len(cases) for j in range(len(cases))]:  # round r starts at case r
            timings[i].append(time_decode_step(cases[i]))
        print(f"round {r + 1} of {args.rounds} timed", flush=True)
    for case, times in zip(cases, timings):
        steps.append(decode_step_row(case, times))
    write()
    if not args.skip_generate:
        for name in args.generate_variants.split(","):
            for backend in ("triton", "sdpa") if name == "softmax" else ("triton",):
                gens.append(bench_generation(name, backend, args.new_tokens, args.prompt, args.repeats, args.vocab))
                write()
    print(markdown(meta, steps, gens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
