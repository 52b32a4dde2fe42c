"""GPU check of train.cuda_graphs=step (models/captured_step.py) on a small GPT, fused kernels:

1. without dropout, every replay gives the loss and gradients of an eager step on the same batch
   and weights (bitwise, or within bf16-free fp32 noise: printed);
2. with attention and residual dropout, the masks are fresh on every replay: replays of one batch
   give different losses (a mask frozen into the graph would repeat one loss), whose mean matches
   the eager steps' mean within their spread.

    python scripts/check_captured_step_gpu.py [--only no_dropout|dropout]

Prints one line per check; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.captured_step import WARMUP_CALLS, CapturedStep  # noqa: E402
from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402


def build(dropout: float) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, context=256, n_layer=2, n_head=4, n_kv_head=4, d_model=128,
                    dropout=dropout, attn_dropout=dropout, attn=AttnConfig(name="softcap_tanh", backend="triton"))
    return GPT(cfg).cuda().train()


def loss_fn(model):
    return lambda x, y: F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("no_dropout", "dropout"), default=None, help="run one of the two checks")
    only = ap.parse_args().only
    failures = 0
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 512, (8, 256), device="cuda", generator=gen)
    y = torch.randint(0, 512, (8, 256), device="cuda", generator=gen)

    if only != "dropout":
        failures += check_without_dropout(x, y)
    if only != "no_dropout":
        failures += check_with_dropout(x, y)
    return 1 if failures else 0


def check_without_dropout(x, y) -> int:
    model = build(0.0)
    step = CapturedStep(loss_fn(model), model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    worst_loss, worst_grad = 0.0, 0.0
    for i in range(WARMUP_CALLS + 4):
        loss = step(x, y)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        eager = loss_fn(model)(x, y)
        eager.backward()
        eager = eager.item()  # no autograd graph may outlive its step: the capture's backward would
        # then meet an AccumulateGrad node of the default stream (an invalid capture)
        worst_loss = max(worst_loss, abs(loss.item() - eager))
        worst_grad = max(worst_grad, max((g - p.grad).abs().max().item() for g, p in zip(grads, params)))
    ok = step.captured and worst_loss <= 1e-5 and worst_grad <= 1e-5
    print(f"{'ok  ' if ok else 'FAIL'} no dropout: captured={step.captured}, replay vs eager max |loss diff| "
          f"{worst_loss:.2e}, max |grad diff| {worst_grad:.2e}")
    return int(not ok)


def check_with_dropout(x, y) -> int:
    model = build(0.1)
    step = CapturedStep(loss_fn(model), model.parameters())
    for _ in range(WARMUP_CALLS + 1):
        step(x, y)
    replayed = [step(x, y).item() for _ in range(20)]
    eager = []
    for _ in range(20):
        eager.append(loss_fn(model)(x, y).item())
    distinct = len(set(replayed))
    spread = statistics.stdev(eager)
    gap = abs(statistics.mean(replayed) - statistics.mean(eager))
    ok = step.captured and distinct == len(replayed) and gap <= 4 * spread / len(eager) ** 0.5 + 1e-6
    print(f"{'ok  ' if ok else 'FAIL'} dropout 0.1: {distinct}/{len(replayed)} distinct replay losses; mean replay "
          f"{statistics.mean(replayed):.5f} vs eager {statistics.mean(eager):.5f} (eager stdev {spread:.5f})")
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
