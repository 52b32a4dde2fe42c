"""NCCL all-reduce bandwidth between the GPUs of this host, one process per GPU: the ceiling on
how fast DDP can exchange gradients. Prints a table (algorithm bandwidth = bytes / time) and
writes OUT.json; run NCCL_DEBUG=INFO to see which transport NCCL picked (P2P/NVLink, SHM, ...).

    python scripts/bench/bench_allreduce.py --gpus 2 --out gpu_out/bench_allreduce
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from timing import git_commit

# the sizes DDP sends (MiB): its first and default buckets, and GPT-2 small's (vocab 2048, 86.5M
# parameters) whole gradient in bf16 (173) and fp32 (346)
SIZES_MB = (1, 25, 173, 346)


def worker(rank: int, world: int, port: int, iters: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for mb in SIZES_MB:
            x = torch.ones(mb * 2**20 // dtype.itemsize, dtype=dtype, device="cuda")
            for _ in range(3):  # NCCL sets up its channels on the first calls
                dist.all_reduce(x)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                dist.all_reduce(x)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / iters
            rows.append({"dtype": str(dtype).removeprefix("torch."), "mb": mb, "ms": ms,
                         "algbw_gb_s": mb * 2**20 / (ms * 1e-3) / 1e9})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--out", default="gpu_out/bench_allreduce")
    args = ap.parse_args()
    if args.gpus < 2 or args.gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus must be between 2 and the {torch.cuda.device_count()} visible GPUs, got {args.gpus}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(worker, args=(args.gpus, args.port, args.iters, queue), nprocs=args.gpus,
                               start_method="spawn", join=False)
    while not procs.join():  # returns once per exited process; raises with a worker's error
        pass
    rows = queue.get(timeout=10)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "gpus": args.gpus, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "commit": git_commit()}
    print(f"{meta}\n| dtype | MB | ms | algbw GB/s |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['dtype']} | {r['mb']} | {r['ms']:.3f} | {r['algbw_gb_s']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
