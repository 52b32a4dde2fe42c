"""Lightning's DDP strategy with DistributedDataParallel built on the current CUDA stream, and the
compiled model kept as one graph."""

from __future__ import annotations

import inspect

import lightning as L
import torch
from torch.nn.parallel import DistributedDataParallel


def ddp_buffer_kwargs(kwargs: dict) -> dict:
    """DDP keyword arguments with `broadcast_buffers` spelled as this torch wants it: torch >= 2.13
    deprecates it for `forward_sync_buffers` (which still syncs buffers once at construction,
    harmless for the model's constant RoPE tables); older torch knows only `broadcast_buffers`."""
    kwargs = dict(kwargs)
    if "broadcast_buffers" in kwargs and "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        kwargs.setdefault("forward_sync_buffers", kwargs.pop("broadcast_buffers"))
    return kwargs


class CurrentStreamDDPStrategy(L.pytorch.strategies.DDPStrategy):
    """Lightning's DDPStrategy with two changes (measurements: docs/results/bench_ddp.md):

    - DDP is built on the current stream. Lightning builds it inside a fresh side stream; DDP's
      constructor creates the parameters' gradient-accumulation nodes there, so every backward then
      accumulates gradients on that stream and synchronizes it with the backward's.
    - `split_compiled_graph=False` (the default) turns off dynamo's DDPOptimizer, which cuts the
      compiled model into a graph per gradient bucket so that each bucket's all-reduce overlaps the
      rest of the backward. Where GPUs share a fast link (NVLink) the overlap costs more than it
      hides: NCCL kernels hold SMs while they wait for the other rank, and the backward's matmuls
      slow down. The setting is dynamo's global `optimize_ddp`, set while the strategy is set up and
      restored at teardown.
    """

    def __init__(self, *args, split_compiled_graph: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.split_compiled_graph = split_compiled_graph
        self._optimize_ddp_before = None

    def _setup_model(self, model) -> DistributedDataParallel:
        if self._optimize_ddp_before is None:
            self._optimize_ddp_before = torch._dynamo.config.optimize_ddp
        # read by dynamo when it compiles a frame inside DDP's forward: the first step, after this
        torch._dynamo.config.optimize_ddp = self.split_compiled_graph
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                       **ddp_buffer_kwargs(self._ddp_kwargs))

    def teardown(self) -> None:
        if self._optimize_ddp_before is not None:
            torch._dynamo.config.optimize_ddp = self._optimize_ddp_before
            self._optimize_ddp_before = None
        super().teardown()
