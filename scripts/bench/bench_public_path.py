"""What a user of `attn.attention` feels, in one process, and the speed regression gate.

Every row times the public function as a user calls it (validation and mask preparation included,
except the `attn.segments` row, whose mask is built once outside the timing as FlexAttention's
BlockMask is), beside its yardstick: the host-bound suites (call, decode) as the median ms per call of
batches of calls queued back to back, the GPU-bound ones (ranker, kernels) as triton.testing.do_bench
medians after warm-up:

  call      (16,12,1024,64) causal bf16 fwd+bwd: SDPA eager and compiled alone, each variant eager,
            each variant inside torch.compile(fullgraph=True) (the call alone compiled)
  decode    one query against a 4K-key cache, (B,H,D) = (8,16,128), no grad: SDPA, each variant
  ranker    2048 history + 2048 candidates, softcap_tanh, (4,16,4096,128), fwd and fwd+bwd:
            segment_ids= (one tensor, checked on its first call), segment_ids=attn.segments(ids),
            the full mask, and FlexAttention compiled with the same mask and cap (its BlockMask built
            once, outside the timing); each round times them starting one row further on
  kernels   (4,16,4096,128) causal bf16 fwd and fwd+bwd: SDPA, softmax, softcap_tanh, softcap_softsign, alsc,
            threshold, sigmoid, diff_threshold (also against threshold's time) (on sm_90 each on the tier the call's
            first timing chose: the Gluon kernels' gate)

    python scripts/bench/bench_public_path.py --out gpu_out/public_path [--baseline FILE|auto]
    python scripts/bench/bench_public_path.py --out gpu_out/public_path --write-baseline FILE
    python scripts/bench/bench_public_path.py --suites kernels --kernel-variants threshold,sigmoid   # some variants

Rows report the median over the --repeats rounds; the gate reads each row's best round. --baseline
compares each row with the file's (measured on the same GPU name) and exits 1 when one is slower by
more than its suite's noise allowance: --noise (default 8%) for the GPU-bound suites (ranker, kernels),
on the best round's ms; --host-noise (default 30%) for the host-bound ones (call, decode), whose rounds
follow the host's load and vary far more (the measured spreads: docs/results/public_path/), on the
row's time over its yardstick's in the same round (SDPA's eager call, SDPA compiled, SDPA's decode
step; the best round's ratio): machines of one GPU kind differ in host speed (SDPA's compiled call
moved 30% between two H100 machines), which a ratio to torch's own call on the same host cancels
in part only: where SDPA's row is GPU-bound and ours host-bound (the decode step, the eager call), a slower host
moves ours alone. So each host-bound suite also times a host probe (`host_probe_step`: a Python-defined no-op
autograd.Function and one tiny launch, the host work every such row pays; no GPU time to speak of), and a
host-bound row regresses only when it is over its allowance both as a ratio to its yardstick and as its time
scaled by the host's speed (this run's probe over the baseline's; baselines without a probe: the ratio
alone). A host-bound row over its allowance after the rounds is timed again --recheck times (default 5)
right beside its yardstick (the row, then the yardstick, on fresh inputs), and the best of those ratios joins
the rounds' before the gate reports it: the host's load moves these rows by 20-50 % between rounds, and a
slowdown that holds through the pairs is the code's. The yardstick rows themselves are torch's and are
reported, not gated. The host-bound gate catches only large regressions. Baselines are
committed per GPU kind under docs/results/baselines/, named after the GPU (`--baseline auto` picks
this GPU's; `--write-baseline` writes one from this run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import back_to_back_ms, median_ms, result_header  # noqa: E402

import attn  # noqa: E402

PARAMS = {"softmax": {}, "softcap_tanh": {"cap": 30.0}, "softcap_softsign": {"cap": 30.0},
          "alsc": {"cap": 30.0, "knee": 0.5}, "threshold": {"beta": 1.0, "power": 2.0},
          "diff_threshold": {"beta": 1.0, "power": 2.0}, "sigmoid": {}}
VARIANTS = ["softmax", "softcap_tanh", "threshold", "sigmoid", "diff_threshold"]  # of the call and decode suites
# of the kernels suite: every variant in issue 35's target table (the other caps share softcap_tanh's host path)
KERNEL_VARIANTS = ["softmax", "softcap_tanh", "softcap_softsign", "alsc", "threshold", "sigmoid", "diff_threshold"]


def tensors(variant: str, b: int, n: int, h: int, d: int, grad: bool, kv: int | None = None) -> dict:
    unit = variant in ("threshold", "diff_threshold")

    def rand(length):
        x = torch.randn(b, length, h, d, device="cuda")
        return (F.normalize(x, dim=-1) if unit else x).to(torch.bfloat16).requires_grad_(grad)

    kv = n if kv is None else kv
    x = {"q": rand(n), "k": rand(kv), "v": rand(kv), "extra": None}
    if variant == "diff_threshold":
        x["extra"] = {"q2": rand(n), "k2": rand(kv),
                      "lam": torch.full((h,), 0.5, device="cuda", dtype=torch.bfloat16, requires_grad=grad)}
    return x


def sdpa(q, k, v, causal: bool):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


CALL_SHAPE = (16, 12, 1024, 64)  # (B, H, N, D) of the call suite
DECODE_SHAPE = (8, 16, 128, 4096)  # (B, H, D, cache keys) of the decode suite
KERNEL_SHAPE = (4, 16, 4096, 128)  # (B, H, N, D) of the kernels suite


def call_step(variant: str, compiled: bool):
    """One row of the call suite as a callable: fwd+bwd of SDPA (`variant` "sdpa") or of the variant through
    attn.attention, eager or inside torch.compile(fullgraph=True), on fresh inputs; run once here, so a
    compiled one is compiled (and any kernel tuned) before it is timed."""
    b, h, n, d = CALL_SHAPE
    x = tensors("softmax" if variant == "sdpa" else variant, b, n, h, d, True)
    do = torch.randn_like(x["q"])
    if variant == "sdpa":
        # SDPA alone in a compiled region: the price torch's compiled-region wrappers add to any one op
        attention = torch.compile(sdpa, fullgraph=True) if compiled else sdpa

        def step():
            attention(x["q"], x["k"], x["v"], True).backward(do)
    else:
        spec = attn.get_variant(variant).make_spec(**PARAMS[variant])

        def call():
            return attn.attention(x["q"], x["k"], x["v"], spec, causal=True, extra=x["extra"])

        attention = torch.compile(call, fullgraph=True) if compiled else call

        def step():
            attention().backward(do)
    step()
    return step


def decode_step(variant: str):
    """One row of the decode suite as a callable (run it under torch.no_grad()): one query of SDPA
    (`variant` "sdpa") or of the variant through attn.attention against the cache; run once here."""
    b, h, d, cache = DECODE_SHAPE
    x = tensors("softmax" if variant == "sdpa" else variant, b, 1, h, d, False, kv=cache)
    if variant == "sdpa":
        def step():
            return sdpa(x["q"], x["k"], x["v"], False)
    else:
        spec = attn.get_variant(variant).make_spec(**PARAMS[variant])

        def step():
            return attn.attention(x["q"], x["k"], x["v"], spec, causal=True, extra=x["extra"])
    with torch.no_grad():
        step()
    return step


class _NoOpFunction(torch.autograd.Function):
    """A Python-defined differentiable op that allocates its output and computes nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad


def host_probe_step():
    """The host probe as a callable: what every host-bound row pays on the host and nothing else (a Python
    function call, a Python-defined autograd.Function over tensors that require grad, its node built where
    grad mode is on (the call suite; the decode suite times it under no_grad, as its rows), an allocation, one
    launch of a one-element kernel), so its time per call measures the host's speed at that moment."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.zeros(1, device=device, requires_grad=True) for _ in range(3))
    counter = torch.zeros(1, device=device)

    def step():
        counter.add_(1.0)
        return _NoOpFunction.apply(q, k, v)

    step()
    return step


def call_rows() -> dict[str, float]:
    torch._dynamo.reset()
    rows = {"call host probe": back_to_back_ms(host_probe_step()),
            "call sdpa fwd+bwd": back_to_back_ms(call_step("sdpa", False)),
            "call sdpa compiled fwd+bwd": back_to_back_ms(call_step("sdpa", True))}
    for variant in VARIANTS:
        torch._dynamo.reset()  # each variant's closure is the same code object: its own cache, no recompiles
        eager, compiled = call_step(variant, False), call_step(variant, True)
        rows[f"call {variant} eager fwd+bwd"] = back_to_back_ms(eager)
        rows[f"call {variant} compiled fwd+bwd"] = back_to_back_ms(compiled)
    return rows


def decode_rows() -> dict[str, float]:
    steps = {"decode host probe": host_probe_step(), "decode sdpa": decode_step("sdpa"),
             **{f"decode {variant}": decode_step(variant) for variant in VARIANTS}}
    with torch.no_grad():
        return {name: back_to_back_ms(step) for name, step in steps.items()}


def host_pair(name: str):
    """(the row's step, its yardstick's step) for a host-bound row of the call or decode suite, built afresh."""
    suite, variant, *rest = name.split(" ")
    if suite == "call":
        compiled = rest[0] == "compiled"
        torch._dynamo.reset()  # the row's compiled closure and SDPA's: two code objects, one cache each
        return call_step(variant, compiled), call_step("sdpa", compiled)
    return decode_step(variant), decode_step("sdpa")


def recheck(names: list[str], pairs: int) -> dict[str, list[list[float]]]:
    """Per host-bound row, `pairs` (row ms, yardstick ms) timings, the two timed one after the other each
    time (row and yardstick share the host's state of that moment); the gate then takes the best of these
    ratios beside the rounds' (`compare`). Decode rows are timed under torch.no_grad() as their suite is."""
    out = {}
    for name in names:
        step, yard_step = host_pair(name)
        with torch.no_grad() if name.startswith("decode") else contextlib.nullcontext():
            out[name] = [[back_to_back_ms(step), back_to_back_ms(yard_step)] for _ in range(pairs)]
        print(f"recheck {name}: " + ", ".join(f"{ms / yard:.3f}x" for ms, yard in out[name]), flush=True)
    return out


_RANKER_ROUND = itertools.count()


def ranker_rows() -> dict[str, float]:
    b, h, n, d = 4, 16, 4096, 128
    spec = attn.get_variant("softcap_tanh").make_spec(**PARAMS["softcap_tanh"])
    x = tensors("softcap_tanh", b, n, h, d, True)
    do = torch.randn_like(x["q"])
    ids = torch.ones(b, n, dtype=torch.int64, device="cuda")
    ids[:, n // 2:] = -1
    masks = {"segment_ids": ids, "segments": attn.segments(ids), "full mask": None}
    calls = {}
    for name, segment_ids in masks.items():
        def call(segment_ids=segment_ids):
            return attn.attention(x["q"], x["k"], x["v"], spec, causal=False, segment_ids=segment_ids)

        calls[name] = (call, do)
    flex = flex_ranker_call(x, ids)
    if flex is not None:
        calls["flex"] = flex
    rows = {}
    # each round starts at the next row: no row is always timed first or after the same neighbour
    order = list(calls.items())
    start = next(_RANKER_ROUND) % len(order)
    for name, (call, grad) in order[start:] + order[:start]:
        call().backward(grad)
        with torch.no_grad():
            rows[f"ranker {name} fwd"] = median_ms(call)
        rows[f"ranker {name} fwd+bwd"] = median_ms(lambda: call().backward(grad))
    return rows


def flex_ranker_call(x: dict, ids: torch.Tensor):
    """(call, grad) for FlexAttention compiled with the ranker's mask and the tanh cap (its BlockMask
    built here, once, outside the timing), or None where this torch has no FlexAttention."""
    try:
        from bench_attention import _flex, block_mask_for, score_mod_for
    except ImportError:
        return None
    if _flex is None:
        return None
    from attn.masks import MaskSpec

    b, n = ids.shape
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (x["q"], x["k"], x["v"]))
    block_mask = block_mask_for(MaskSpec(causal=False), ids, b, n, q.device)
    score_mod = score_mod_for("tanh")

    def call():
        return _flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return call, torch.randn_like(q)


def kernel_rows(variants=KERNEL_VARIANTS) -> dict[str, float]:
    b, h, n, d = KERNEL_SHAPE
    rows = {}
    for variant in ("sdpa", *variants):
        x = tensors("softmax" if variant == "sdpa" else variant, b, n, h, d, True)
        do = torch.randn_like(x["q"])
        if variant == "sdpa":
            def call(x=x):
                return sdpa(x["q"], x["k"], x["v"], True)
        else:
            spec = attn.get_variant(variant).make_spec(**PARAMS[variant])

            def call(x=x, spec=spec):
                return attn.attention(x["q"], x["k"], x["v"], spec, causal=True, extra=x["extra"])
        call().backward(do)
        with torch.no_grad():
            rows[f"kernels {variant} fwd"] = median_ms(call)
        rows[f"kernels {variant} fwd+bwd"] = median_ms(lambda: call().backward(do))
    return rows


SUITES = {"call": call_rows, "decode": decode_rows, "ranker": ranker_rows, "kernels": kernel_rows}


def ratios(rows: dict[str, float]) -> dict[str, float]:
    """The issue's target ratios from one round's rows (time over the yardstick's time)."""
    out = {}
    for name, ms in rows.items():
        suite, *rest = name.split(" ")
        if name.endswith(HOST_PROBE):
            continue
        if suite == "call" and "sdpa" not in name:
            out[f"{name} / SDPA"] = ms / rows["call sdpa fwd+bwd"]
            if "compiled" in name:
                out[f"{name} / eager"] = ms / rows[name.replace("compiled", "eager")]
                if "call sdpa compiled fwd+bwd" in rows:
                    out[f"{name} / SDPA compiled"] = ms / rows["call sdpa compiled fwd+bwd"]
        elif suite == "decode" and "sdpa" not in name:
            out[f"{name} / SDPA"] = ms / rows["decode sdpa"]
        elif suite == "ranker" and "full mask" not in name and "flex" not in name:
            out[f"{name} / full mask"] = ms / rows[f"ranker full mask {rest[-1]}"]
            if f"ranker flex {rest[-1]}" in rows:
                out[f"{name}: Flex / ours"] = rows[f"ranker flex {rest[-1]}"] / ms
        elif suite == "kernels" and "sdpa" not in name:
            out[f"{name}: SDPA / ours"] = rows[f"kernels sdpa {rest[-1]}"] / ms
            if "diff_threshold" in name and f"kernels threshold {rest[-1]}" in rows:  # issue 35's ratio
                out[f"{name} / threshold"] = ms / rows[f"kernels threshold {rest[-1]}"]
    return out


HOST_BOUND_SUITES = ("call", "decode")
HOST_PROBE = "host probe"  # each host-bound suite's row "<suite> host probe" (host_probe_step)


HOST_TIMING = "back-to-back"  # how the host-bound suites are timed (timing.back_to_back_ms)


def yardstick(name: str) -> str | None:
    """The row a host-bound row is measured against in the gate (torch's own call of the suite, same host,
    same round); None for GPU-bound rows and for the yardsticks themselves."""
    suite = name.split(" ")[0]
    if suite not in HOST_BOUND_SUITES or "sdpa" in name or name.endswith(HOST_PROBE):
        return None
    if suite == "call":
        return "call sdpa compiled fwd+bwd" if "compiled" in name else "call sdpa fwd+bwd"
    return "decode sdpa"


def compare(best: dict[str, float], spread: dict[str, float], baseline: dict, noise: float,
            host_noise: float, rounds: dict[str, list[float]] | None = None,
            rechecks: dict[str, list[list[float]]] | None = None) -> list[str]:
    """Rows slower than the baseline by more than their suite's allowance (fractions), as report lines:
    a GPU-bound row's best round against the baseline's best by `noise`; a host-bound row (HOST_BOUND_SUITES)
    as its time over its `yardstick`'s, the best over `rounds` of the same round's ratio (without rounds:
    the best rounds') and over its `rechecks` pairs (`recheck`), against the baseline's best rows' ratio, by
    `host_noise`; where the baseline has the suite's host probe, such a row fails only if its time scaled by the
    host's speed (this run's best probe over the baseline's) is over the baseline's by `host_noise` as well.
    Yardstick and probe rows, rows the baseline lacks, and host-bound rows of a baseline timed another way (its
    meta's host_timing) are not compared."""
    same_host_timing = baseline.get("meta", {}).get("host_timing") == HOST_TIMING
    base_best = baseline["best"]
    failures = []
    for name, ms in best.items():
        base = base_best.get(name)
        host_bound = name.split(" ")[0] in HOST_BOUND_SUITES
        if base is None or (host_bound and not same_host_timing):
            continue
        if not host_bound:
            if ms > base * (1.0 + noise):
                failures.append(f"REGRESSION {name}: {ms:.4f} ms vs baseline {base:.4f} ms (+{ms / base - 1:.1%}, "
                                f"allowed +{noise:.0%}; this run's spread over rounds {spread.get(name, 0):.1%})")
            continue
        yard = yardstick(name)
        if yard is None or yard not in best or yard not in base_best:
            continue
        if rounds and name in rounds and yard in rounds:
            ratio = min(t / y for t, y in zip(rounds[name], rounds[yard]))
        else:
            ratio = ms / best[yard]
        if rechecks and name in rechecks:
            ratio = min([ratio] + [t / y for t, y in rechecks[name]])
        base_ratio = base / base_best[yard]
        if ratio <= base_ratio * (1.0 + host_noise):
            continue
        probe = f"{name.split(' ')[0]} {HOST_PROBE}"
        host_note = ""
        if probe in best and probe in base_best:
            host_speed = best[probe] / base_best[probe]  # > 1: this host is slower than the baseline's
            if ms / host_speed <= base * (1.0 + host_noise):
                continue
            host_note = f"; scaled by this host's probe ({host_speed:.2f}x the baseline's) {ms / host_speed:.4f} ms"
        failures.append(f"REGRESSION {name}: {ratio:.3f}x {yard} vs baseline {base_ratio:.3f}x "
                        f"(+{ratio / base_ratio - 1:.1%}, allowed +{host_noise:.0%}; {ms:.4f} ms vs baseline "
                        f"{base:.4f} ms{host_note})")
    return failures


def baseline_path(gpu_name: str) -> Path:
    """docs/results/baselines/<GPU name, lower case, runs of other characters as '_'>.json"""
    return ROOT / "docs" / "results" / "baselines" / (re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") + ".json")


def regressed_rows(failures: list[str]) -> list[str]:
    """The row names of `compare`'s report lines."""
    return [line.removeprefix("REGRESSION ").split(":")[0] for line in failures]


def markdown(meta: dict, rows: dict, best: dict, spread: dict, failures: list[str],
             rechecks: dict[str, list[list[float]]] | None = None) -> str:
    lines = [f"# The public attention path, {meta['date']}", "",
             f"{meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · commit {meta['commit']} · "
             f"median of {meta['repeats']} rounds (call and decode: back-to-back calls, median of 7 batches of 50; "
             "ranker and kernels: a do_bench median)", "",
             "| row | ms (median) | ms (best round) | spread over rounds |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {ms:.4f} | {best[name]:.4f} | {spread[name]:.1%} |" for name, ms in rows.items()]
    best_ratios = ratios(best)
    lines += ["", "| ratio | median rounds | best rounds |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {value:.2f} | {best_ratios[name]:.2f} |" for name, value in ratios(rows).items()]
    if meta.get("baseline"):
        lines += ["", f"Against {meta['baseline']} (allowed: {meta['noise']:.0%} GPU-bound, best rounds; "
                  f"{meta['host_noise']:.0%} host-bound, best ratios to the yardstick in the same round): "
                  + ("no regression." if not failures else "")]
        lines += [f"- {line}" for line in failures]
    if rechecks:
        lines += ["", "Host-bound rows over their allowance after the rounds, timed again beside their yardstick "
                  f"({meta['recheck']} pairs, the row then the yardstick each time; the best pair's ratio joins the "
                  "rounds'):"]
        lines += [f"- {name}: " + ", ".join(f"{ms / yard:.3f}x" for ms, yard in pairs)
                  for name, pairs in rechecks.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_out/public_path")
    ap.add_argument("--suites", default=",".join(SUITES), help=f"comma list of {', '.join(SUITES)}")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every suite; rows report the median")
    ap.add_argument("--baseline", default=None, help="a committed baseline JSON to compare with")
    ap.add_argument("--noise", type=float, default=0.08,
                    help="allowed slowdown of a GPU-bound row against the baseline (fraction)")
    ap.add_argument("--host-noise", type=float, default=0.30,
                    help="allowed slowdown of a host-bound row (call, decode) against the baseline (fraction)")
    ap.add_argument("--recheck", type=int, default=5,
                    help="pairs of (row, yardstick) timings for each host-bound row over its allowance after the "
                         "rounds, before the gate reports it (0: none)")
    ap.add_argument("--write-baseline", default=None, help="write this run's rows as a baseline JSON here")
    ap.add_argument("--kernel-variants", default=",".join(KERNEL_VARIANTS),
                    help="comma list of the kernels suite's variants (SDPA always runs; the gate compares the rows "
                         "run)")
    args = ap.parse_args()
    suites = args.suites.split(",")
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise SystemExit(f"--suites: unknown {sorted(unknown)}; allowed: {', '.join(SUITES)}")
    kernel_variants = args.kernel_variants.split(",")
    unknown = set(kernel_variants) - set(KERNEL_VARIANTS)
    if unknown:
        raise SystemExit(f"--kernel-variants: unknown {sorted(unknown)}; allowed: {', '.join(KERNEL_VARIANTS)}")
    SUITES["kernels"] = functools.partial(kernel_rows, kernel_variants)
    meta = {**result_header(), "repeats": args.repeats,
            "baseline": args.baseline, "noise": args.noise, "host_noise": args.host_noise, "host_timing": HOST_TIMING,
            "recheck": args.recheck}
    rounds: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for suite in suites:
            measured = SUITES[suite]()
            for name, ms in measured.items():
                rounds.setdefault(name, []).append(ms)
            # per suite, so that a run stopped by a time limit still shows what it measured
            print(f"round {r + 1}, {suite}: " + ", ".join(f"{n} {ms:.4f}" for n, ms in measured.items()), flush=True)
    rows = {name: statistics.median(values) for name, values in rounds.items()}
    best = {name: min(values) for name, values in rounds.items()}
    spread = {name: (max(values) - min(values)) / statistics.median(values) for name, values in rounds.items()}
    failures, rechecks = [], {}
    if args.baseline == "auto":
        args.baseline = str(baseline_path(meta["gpu"]))
        meta["baseline"] = args.baseline
        if not Path(args.baseline).exists():
            raise SystemExit(f"--baseline auto: no baseline for {meta['gpu']} ({args.baseline}); write one with "
                             "--write-baseline")
    if args.baseline:
        baseline = json.loads(Path(args.baseline).read_text())
        if baseline["meta"]["gpu"] != meta["gpu"]:
            raise SystemExit(f"--baseline {args.baseline} was measured on {baseline['meta']['gpu']}, this is "
                             f"{meta['gpu']}: compare with a baseline of the same GPU kind")
        failures = compare(best, spread, baseline, args.noise, args.host_noise, rounds)
        host_bound = [name for name in regressed_rows(failures) if name.split(" ")[0] in HOST_BOUND_SUITES]
        if host_bound and args.recheck > 0:  # the host's load moves these rows by tens of percent between rounds
            rechecks = recheck(host_bound, args.recheck)
            failures = compare(best, spread, baseline, args.noise, args.host_noise, rounds, rechecks)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": rows, "best": best, "spread": spread, "rounds": rounds, "ratios": ratios(rows),
              "failures": failures, "rechecks": rechecks}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(meta, rows, best, spread, failures, rechecks)
    out.with_suffix(".md").write_text(text)
    print(text)
    if args.write_baseline:
        Path(args.write_baseline).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write_baseline).write_text(json.dumps({"meta": meta, "rows": rows, "best": best, "spread": spread},
                                                        indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
