"""A training step's forward, loss and backward captured as one CUDA graph (train.cuda_graphs=step).

At research sizes a step is host-bound: even with torch.compile's CUDA graphs (reduce-overhead)
the host spends milliseconds per step rebuilding the saved activations between the forward and
the backward graph and running autograd's engine. Captured whole, the step costs one replay: the
batch is copied into static input buffers, the graph runs, and the loss and every parameter's
gradient land in static tensors (the parameters' .grad, which the graph overwrites each replay).
The optimizer, the clip and the non-finite guard then run eagerly on those gradients.

The first WARMUP_CALLS steps run eagerly (compilation, kernel autotuning and the libraries' lazy
set-up must happen outside a capture); the capture then records the step and the step replays it.
Gradient accumulation is not supported (a replay overwrites the gradients).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

WARMUP_CALLS = 3


def capture_cuda_graph(step: Callable[[], tuple], reset: Callable[[], None]
                       ) -> tuple[Callable[[], None], tuple]:
    """(replay, outputs) of `step` (which returns a tuple of tensors) captured as a CUDA graph, after
    one warm-up run on a side stream (the pattern of PyTorch's whole-network capture) and `reset()`
    (which drops the warm-up's gradients, so the captured backward writes fresh ones instead of
    accumulating); each replay overwrites `outputs`. Capturing records the kernels without running
    them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (loggers, the data loader's) may go on during capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        output = step()
    return graph.replay, output


class CapturedStep:
    """loss_fn(x, y) -> scalar loss, with its backward into `params`' gradients, as one replay per
    call after WARMUP_CALLS eager calls. Returns the step's loss (detached).

    With `tail(loss, params)` (a pytree of tensors, e.g. a registered dataclass, from the detached
    loss and the parameters' fresh gradients), `tail_outputs` holds the latest call's result: its
    tensors are the graph's static outputs, valid until the next call overwrites them."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], params,
                 capture: Callable = capture_cuda_graph, tail: Callable[[torch.Tensor, list], Any] | None = None):
        self.loss_fn = loss_fn
        self.params = [p for p in params if p.requires_grad]
        self.capture = capture
        self.tail = tail
        self.tail_outputs: Any = None
        self.calls = 0
        self._replay = None
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None
        self._outputs: tuple = ()
        self._tail_spec = None
        self._grads: list = []

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def _drop_grads(self) -> None:
        for p in self.params:  # the captured backward then allocates them in the graph's memory
            p.grad = None

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """(loss, *the tail's tensors) of one forward and backward; the tail's structure is kept."""
        loss = self.loss_fn(x, y)
        loss.backward()
        loss = loss.detach()
        tail = self.tail(loss, self.params) if self.tail is not None else ()
        leaves, self._tail_spec = pytree.tree_flatten(tail)
        return (loss, *leaves)

    def _forward_backward(self) -> tuple:
        return self._step(*self._static)

    def _unpack(self, outputs: tuple) -> torch.Tensor:
        if self.tail is not None:
            self.tail_outputs = pytree.tree_unflatten(list(outputs[1:]), self._tail_spec)
        return outputs[0]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not self.captured and self.calls <= WARMUP_CALLS:
            self._drop_grads()  # a step's gradients are its own (the caller does not zero them)
            return self._unpack(self._step(x, y))
        if not self.captured:
            self._static = (x.clone(), y.clone())
            self._replay, self._outputs = self.capture(self._forward_backward, self._drop_grads)
            self._grads = [p.grad for p in self.params]
            self._unpack(self._outputs)  # the tail's static tensors: the same object after every replay
        else:
            if x.shape != self._static[0].shape or y.shape != self._static[1].shape:
                raise ValueError(f"train.cuda_graphs=step replays one batch shape, captured "
                                 f"{tuple(self._static[0].shape)}; got inputs {tuple(x.shape)}, targets {tuple(y.shape)} "
                                 "(use train.cuda_graphs=false for batches of varying shape)")
            self._static[0].copy_(x)
            self._static[1].copy_(y)
        self._replay()
        # the graph writes the same gradient tensors each replay; whoever set .grad to None since
        # (zero_grad, a skipped step) gets them back
        for p, grad in zip(self.params, self._grads):
            p.grad = grad
        # a replay overwrites the static loss; the step's own value stays (the tail is read within the step)
        return self._outputs[0].clone()
