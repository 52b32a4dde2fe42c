"""The training metrics of a log step, read from the device one step later so the GPU never idles.

Reading a device value on the host (`.cpu()`, `.item()`) waits for every queued kernel. On a log
step that wait empties the GPU's queue, and the GPU then idles for as long as the host takes to
write the logs and queue the next step (measured in docs/results/captured_step/).
So a log step only gathers its values: device
scalars are stacked and copied to pinned host memory without blocking, and a CUDA event is
recorded behind them (`LogStepMetrics.seal`). The next batch end, when the host has queued the
next step, waits for that event (the end of the log step's kernels, not of the queue) and writes
the values with the log step's own step index (`LogStepMetrics.take`). The throughput clock is
a CUDA event too (`StreamClock`): the window is timed on the GPU's stream, without a sync.
On devices without CUDA the copies are plain and the clock is the host's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class StreamClock:
    """Time stamps on the device's stream: a recorded CUDA event on CUDA devices (read once it has
    completed, no host sync), `time.perf_counter()` elsewhere (the host runs in step there)."""

    def __init__(self, device: torch.device):
        self.device = device

    def stamp(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def seconds(start, end) -> float:
        """Seconds from stamp `start` to stamp `end`; `end` must be complete (LogStepMetrics.take)."""
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3


@dataclass
class SealedLogStep:
    """The values of one log step in flight to the host."""

    step: int  # the logger's step index of the log step
    names: list[str]  # of the device values, in the order of `host`
    host: torch.Tensor  # (len(names),) float32, pinned on CUDA: filled when `ready` completes
    numbers: dict[str, float]  # values that were host numbers already
    ready: object  # a CUDA event recorded after the copy, or None
    context: dict = field(default_factory=dict)  # what the writer needs besides the values


class LogStepMetrics:
    """Collects a log step's values (`add`), sends them to the host (`seal`) and hands them over
    at a later batch end (`take`)."""

    def __init__(self):
        self._values: dict[str, torch.Tensor | float] = {}
        self._sealed: SealedLogStep | None = None

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """A value of the current log step: a one-element tensor (any device, any float or int
        dtype; read as float32) or a number."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"log value {name!r} must have one element, got shape {tuple(value.shape)}")
            value = value.detach().reshape(())
        self._values[name] = value

    def seal(self, step: int, **context) -> None:
        """Send the current values to the host without waiting (on the device of the first tensor
        value: all of a step's tensors live there); the previous sealed step must have been taken."""
        if self._sealed is not None:
            raise RuntimeError("the previous log step's values were not taken")
        names = [n for n, v in self._values.items() if isinstance(v, torch.Tensor)]
        numbers = {n: float(v) for n, v in self._values.items() if not isinstance(v, torch.Tensor)}
        ready = None
        if names:
            device = self._values[names[0]].device
            stacked = torch.stack([self._values[n].to(device=device, dtype=torch.float32) for n in names])
            if stacked.is_cuda:
                host = torch.empty(stacked.shape, dtype=torch.float32, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host = stacked.cpu()
        else:
            host = torch.zeros(0)
        self._sealed = SealedLogStep(step, names, host, numbers, ready, context)
        self._values = {}

    def take(self) -> SealedLogStep | None:
        """The sealed step with its host values filled (waits for its own kernels only), or None."""
        sealed, self._sealed = self._sealed, None
        if sealed is not None and sealed.ready is not None:
            sealed.ready.synchronize()
        return sealed

    @staticmethod
    def values(sealed: SealedLogStep) -> dict[str, float]:
        return {**dict(zip(sealed.names, sealed.host.tolist())), **sealed.numbers}
