"""Attention statistics of a GPT's layers, per head: what each query row's weights look like.

`attention_statistics(model, batches)` runs the model on id batches and, at each layer, recomputes
the float-exact weights from the layer's input with `attn.attention_weights` (the registry's
reference path, which serves every variant: no per-variant code here). `HeadStats` holds the
running sums; METRICS names each statistic (see eval/attention_stats.py for their definitions).
`window_starts` picks the fixed sample of windows and `plot_heatmaps` draws one PNG per metric.
Used by `python -m eval.attention_stats`, the validation-time monitor (training/callbacks/attention_monitor.py)
and the end-of-run heatmaps (training/callbacks/attention_heatmaps.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

import attn

# metric -> (how per-layer/head values aggregate into the model summary, plot title, table header)
METRICS = {
    "zero_fraction": ("mean", "exact-zero fraction of visible weights", "zero"),
    "empty_rows": ("mean", "share of all-zero rows", "empty"),
    "surviving_keys": ("mean", "mean nonzero keys per row", "keys"),
    "surviving_share": ("mean", "mean share of visible keys kept", "kept"),
    "sink_mass": ("mean", "sink mass (|w| share of the first token)", "sink"),
    "entropy": ("mean", "row entropy of |w| (nats)", "entropy"),
    "max_logit": ("max", "max logit z (softmax, sigmoid) / max q.k (threshold)", "max z"),
    "max_score": ("max", "max raw score before any cap", "max s"),
}


def family_logits(spec, scores: torch.Tensor, head_dim: int, n_visible: torch.Tensor) -> torch.Tensor:
    """The quantity a row's weights are a function of, from q.k (B, H, N, KV) and the keys each query
    sees, n_visible (B or 1, 1, N): the family's `logits` (z = cap(s q.k) for the softmax family, q.k
    itself for the threshold family, s q.k + b_i for sigmoid)."""
    return attn.family_of(spec).logits(spec, scores, head_dim, n_visible)


def raw_scores(spec, scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The raw score before any cap, from q.k: the family's `scores`."""
    return attn.family_of(spec).scores(spec, scores, head_dim)


def per_head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (B,N,H,D), k (B,N,Hkv,D) -> q.k (B,H,N,N), kv heads repeated for GQA."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bihd,bjhd->bhij", q.float(), k.float())


class HeadStats:
    """Running per-head sums of one layer over batches."""

    def __init__(self, n_head: int):
        z = lambda: torch.zeros(n_head, dtype=torch.float64)  # noqa: E731
        self.zero, self.visible = z(), z()
        self.rows, self.empty_rows = z(), z()
        self.surviving, self.surviving_share = z(), z()
        self.sink_rows, self.sink, self.entropy = z(), z(), z()
        self.max_logit = torch.full((n_head,), -math.inf, dtype=torch.float64)
        self.max_score = torch.full((n_head,), -math.inf, dtype=torch.float64)

    def add(self, weights: torch.Tensor, visible: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor) -> None:
        """weights, logits, scores (B, H, N, N); visible (1 or B, N, N) bool."""
        w = weights.double()
        vis = visible[:, None].expand_as(w)
        nonzero = (w != 0) & vis
        abs_w = w.abs() * vis
        row_sum = abs_w.sum(-1)  # (B, H, N)
        visible_per_row = vis.sum(-1).double()
        live_row = visible_per_row > 0  # rows that see any key (all of them under a causal mask)
        kept = nonzero.sum(-1).double()

        def per_head(t: torch.Tensor, dims=(0, 2)) -> torch.Tensor:
            return t.sum(dim=dims).double().cpu()

        self.zero += per_head((w == 0) & vis, (0, 2, 3))
        self.visible += per_head(vis, (0, 2, 3))
        self.rows += per_head(live_row)
        self.empty_rows += per_head((row_sum == 0) & live_row)
        self.surviving += per_head(kept * live_row)
        self.surviving_share += per_head(torch.where(live_row, kept / visible_per_row.clamp_min(1), 0))
        # the first query row can only see the first key: its sink share is 1 by construction
        sink_row = (row_sum > 0) & live_row
        sink_row[..., 0] = False
        p = abs_w / row_sum.clamp_min(torch.finfo(torch.float64).tiny)[..., None]
        entropy = -(torch.where(p > 0, p * p.log(), 0.0)).sum(-1)
        self.sink_rows += per_head(sink_row)
        self.sink += per_head(torch.where(sink_row, p[..., 0], 0))
        self.entropy += per_head(torch.where(sink_row, entropy, 0))
        neg_inf = torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device)
        self.max_logit = torch.maximum(self.max_logit, torch.where(vis, logits, neg_inf).amax(dim=(0, 2, 3)).double().cpu())
        self.max_score = torch.maximum(self.max_score, torch.where(vis, scores, neg_inf).amax(dim=(0, 2, 3)).double().cpu())

    def result(self) -> dict[str, list[float | None]]:
        def ratio(num, den):
            return [float(n / d) if d > 0 else None for n, d in zip(num.tolist(), den.tolist())]

        return {
            "zero_fraction": ratio(self.zero, self.visible),
            "empty_rows": ratio(self.empty_rows, self.rows),
            "surviving_keys": ratio(self.surviving, self.rows),
            "surviving_share": ratio(self.surviving_share, self.rows),
            "sink_mass": ratio(self.sink, self.sink_rows),
            "entropy": ratio(self.entropy, self.sink_rows),
            "max_logit": [float(x) if math.isfinite(x) else None for x in self.max_logit.tolist()],
            "max_score": [float(x) if math.isfinite(x) else None for x in self.max_score.tolist()],
        }


def layer_weights(layer, x: torch.Tensor):
    """Float-exact weights, logits and raw scores of one attention layer for its input x (B, N, C).

    Only generic layer properties are used: its spec, its score views, its family's extra tensors
    (`extras`, the family's layer module: a second q/k view and lambda for differential variants), its window.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        # the projection in its weights' dtype (bf16 under FSDP mixed precision), the rest in fp32
        qs, ks, _ = layer.split_heads(x.to(layer.qkv.weight.dtype))
        qs, ks = [q.float() for q in qs], [k.float() for k in ks]
        mask = attn.MaskSpec(causal=True, window=layer.window)
        weights = attn.attention_weights(qs[0], ks[0], layer.spec, mask, extra=layer.extras(qs, ks))
        views = [per_head_scores(q, k) for q, k in zip(qs, ks)]
        head_dim = qs[0].shape[-1]
        n_visible = attn.visible_key_counts(mask, x.shape[1], device=x.device)[:, None]
        logits = torch.stack([family_logits(layer.spec, s, head_dim, n_visible) for s in views]).amax(0)
        scores = torch.stack([raw_scores(layer.spec, s, head_dim) for s in views]).amax(0)
        visible = attn.dense_mask(mask, x.shape[1], device=x.device)
    return weights, visible, logits, scores


@torch.no_grad()
def attention_statistics(model, batches) -> dict:
    """Per layer x head statistics of `model` over an iterable of id batches (B, N)."""
    layers = [block.attn for block in model.blocks]
    stats = [HeadStats(layer.n_head) for layer in layers]
    hooks = []
    for layer, acc in zip(layers, stats):
        def capture(module, args, acc=acc):
            acc.add(*layer_weights(module, args[0]))

        hooks.append(layer.register_forward_pre_hook(capture))
    try:
        tokens = 0
        for ids in batches:
            model(ids)
            tokens += ids.numel()
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = [s.result() for s in stats]
    metrics = {name: [layer[name] for layer in per_layer] for name in METRICS}
    return {"tokens": tokens, "metrics": metrics, "summary": summarize(metrics)}


def summarize(metrics: dict) -> dict:
    """Model-level numbers: mean (or max) over layers and heads, ignoring undefined entries."""
    summary = {}
    for name, (how, _, _) in METRICS.items():
        values = [v for layer in metrics[name] for v in layer if v is not None]
        if not values:
            summary[name] = None
        else:
            summary[name] = float(np.mean(values)) if how == "mean" else float(np.max(values))
    return summary


def window_starts(num_split_tokens: int, seq_len: int, num_tokens: int) -> list[int]:
    """Evenly spaced window starts over the split: a fixed, deterministic sample."""
    if num_split_tokens < seq_len:
        raise ValueError(f"the split has {num_split_tokens} tokens, fewer than seq_len={seq_len}")
    count = max(1, math.ceil(num_tokens / seq_len))
    last = num_split_tokens - seq_len
    return sorted(set(np.linspace(0, last, count).round().astype(int).tolist()))


def plot_heatmaps(metrics: dict, label: str, prefix: Path) -> list[Path]:
    """One PNG per metric of `metrics` (attention_statistics' per layer x head lists), named
    <prefix>.<metric>.png (the folder made when missing): layers down, heads across, values annotated,
    titled `label` above the metric's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (_, title, _) in METRICS.items():
        values = np.array([[np.nan if v is None else v for v in layer] for layer in metrics[name]], dtype=float)
        n_layer, n_head = values.shape
        # at least wide enough for the two-line title
        fig, ax = plt.subplots(figsize=(max(4.5, 1.0 + 0.7 * n_head), 1.4 + 0.5 * n_layer), dpi=110)
        image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", aspect="auto")
        middle = np.nanmean(values) if np.isfinite(values).any() else 0.0
        fig.colorbar(image, ax=ax)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(n_head))
        ax.set_yticks(range(n_layer))
        ax.set_title(f"{label}\n{title}", fontsize=9)
        if n_layer * n_head <= 256:
            for (i, j), v in np.ndenumerate(values):
                if np.isfinite(v):
                    # dark text on the bright (high) end of viridis, light text on the dark end
                    color = "k" if v > middle else "w"
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6, color=color)
        fig.tight_layout()
        path = prefix.with_name(f"{prefix.name}.{name}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
