"""Time the public `attn.attention` of several commits' `attn/` in one GPU call (a speed bisect).

The device machine's copy of the tree has no .git, so the commits' `attn/` packages are unpacked
here first, into an ignored folder that the device call carries:

    python scripts/bench/bisect_attention_speed.py prepare OLD MIDDLE HEAD     # here: .bisect/<commit>/attn
    run(command="python3 scripts/bench/bisect_attention_speed.py time --out $OUT/bisect", carry=[".bisect"])

`time` runs one subprocess per snapshot (each imports only its own `attn`, with the snapshot first
on PYTHONPATH), in the order the snapshots were prepared, and times the variant's forward and
forward+backward at one shape against SDPA in that same process (triton.testing.do_bench medians,
kernels tuned as a user's first calls tune them). Rows are written as they come (OUT.json, OUT.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import io
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / ".bisect"
ORDER_FILE = SNAPSHOTS / "order.txt"
PARAMS = {"softmax": {}, "softcap_tanh": {"cap": 30.0}, "threshold": {"beta": 1.0, "power": 2.0},
          "sigmoid": {}}


def prepare(commits: list[str]) -> None:
    """Unpack each commit's attn/ into .bisect/<short hash>/attn and record their order."""
    SNAPSHOTS.mkdir(exist_ok=True)
    names = []
    for commit in commits:
        short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.strip()
        archive = subprocess.run(["git", "archive", short, "attn"], cwd=ROOT, check=True, capture_output=True).stdout
        target = SNAPSHOTS / short
        target.mkdir(exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
        names.append(short)
    ORDER_FILE.write_text("\n".join(names) + "\n")
    print(f"prepared {len(names)} snapshots in {SNAPSHOTS}: {' '.join(names)}")


def worker(variant: str, shape: tuple[int, int, int, int], backward: bool) -> dict:
    """In a subprocess whose `attn` is one snapshot: ms of the variant's fwd (and fwd+bwd), and SDPA's."""
    import torch
    import torch.nn.functional as F
    from timing import median_ms

    import attn

    b, h, n, d = shape
    torch.manual_seed(0)
    unit = variant == "threshold"

    def make():
        x = torch.randn(b, n, h, d, device="cuda")
        return (F.normalize(x, dim=-1) if unit else x).to(torch.bfloat16).requires_grad_()

    q, k, v = make(), make(), make()
    do = torch.randn_like(q)
    spec = attn.get_variant(variant).make_spec(**PARAMS[variant])

    def ours():
        return attn.attention(q, k, v, spec, causal=True, backend="triton")

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    row = {"attn_from": os.path.dirname(os.path.dirname(attn.__file__))}
    for name, fn in (("ours", ours), ("sdpa", sdpa)):
        with torch.no_grad():
            fn()
        torch.cuda.synchronize()
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = median_ms(fn)
        if backward:
            row[f"{name}_fwd_bwd_ms"] = median_ms(lambda: fn().backward(do if name == "ours" else do.transpose(1, 2)))
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# {meta['variant']} at (B,H,N,D) = {tuple(meta['shape'])}, causal, bf16, per commit's attn/", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · "
             f"measured by the tree of commit {meta['commit']}", "",
             "| attn/ of | fwd ms | SDPA fwd ms | fwd vs SDPA | fwd+bwd ms | SDPA fwd+bwd ms | fwd+bwd vs SDPA |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['snapshot']} | error: {r['error'][:80]} | | | | | |")
            continue
        bwd = (f"{r['ours_fwd_bwd_ms']:.3f} | {r['sdpa_fwd_bwd_ms']:.3f} | "
               f"{r['sdpa_fwd_bwd_ms'] / r['ours_fwd_bwd_ms']:.2f}x" if "ours_fwd_bwd_ms" in r else "- | - | -")
        lines.append(f"| {r['snapshot']} | {r['ours_fwd_ms']:.3f} | {r['sdpa_fwd_ms']:.3f} | "
                     f"{r['sdpa_fwd_ms'] / r['ours_fwd_ms']:.2f}x | {bwd} |")
    lines += ["", "x: SDPA's time over ours (above 1: faster than SDPA)."]
    return "\n".join(lines) + "\n"


def time_snapshots(out: Path, variant: str, shape: tuple, timeout: int, backward: bool) -> None:
    from timing import result_header

    names = ORDER_FILE.read_text().split()
    meta = {**result_header(), "variant": variant, "shape": shape}
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        env = {**os.environ, "PYTHONPATH": str(SNAPSHOTS / name)}
        cmd = [sys.executable, __file__, "worker", "--variant", variant, "--shape", ",".join(map(str, shape)),
               *(["--backward"] if backward else [])]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        except subprocess.TimeoutExpired:
            row = {"error": f"timed out after {timeout} s"}
        row["snapshot"] = name
        rows.append(row)
        print(name, row, flush=True)
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("prepare", "time", "worker"))
    ap.add_argument("commits", nargs="*", help="prepare: the commits whose attn/ to unpack, oldest first")
    ap.add_argument("--variant", default="threshold", choices=sorted(PARAMS))
    ap.add_argument("--shape", default="4,16,4096,128", help="B,H,N,D")
    ap.add_argument("--out", default="gpu_out/bisect")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per snapshot")
    ap.add_argument("--backward", action="store_true", help="also time fwd+bwd (compiles and tunes 3x the kernels)")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.mode == "prepare":
        prepare(args.commits)
    elif args.mode == "worker":
        print(json.dumps(worker(args.variant, shape, args.backward)))
    else:
        time_snapshots(Path(args.out), args.variant, shape, args.timeout, args.backward)


if __name__ == "__main__":
    main()
