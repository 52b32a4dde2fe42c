"""LightningModule: next-token training of the GPT, validation in nats, perplexity and bits per byte."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import asdict

import lightning as L
import torch
from hydra.utils import instantiate

from models.captured_step import CapturedStep
from models.gpt import GPT, AttnConfig, GPTConfig
from models.log_step_metrics import LogStepMetrics, StreamClock
from models.step_scalars import StepScalars, nonfinite_found, step_scalars


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over all ranks, stream-ordered: the host never waits for the GPU.
    (Lightning's sync_dist runs a host-blocking barrier before its all-reduce, which for a
    per-step metric means a host sync every step.)"""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    total = value.detach().clone()
    torch.distributed.all_reduce(total)  # SUM: the one op every backend (gloo too) has
    return total / torch.distributed.get_world_size()


def logger_step(trainer) -> int:
    """The step index Lightning writes the current batch's logs at (its count of batches that
    stepped, which validation logs use too); the global step for a trainer without a fit loop."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return getattr(epoch_loop, "_batches_that_stepped", trainer.global_step)


def writes_logs(trainer) -> bool:
    """Whether Lightning writes logs after the current batch: a log step (its own condition), and
    that step's last micro-batch under gradient accumulation."""
    return trainer._logger_connector.should_update_logs and not trainer.fit_loop._should_accumulate()


COMPILE_UNITS = ("model", "block")
PROGRESS_BAR_METRICS = ("train/loss", "train/tokens_per_s", "train/mfu")
WARMUP_STEPS = 5  # throughput windows starting earlier hold compilation and autotuning; not in the mean


def eager_mode(enabled: bool = True):
    """A context in which compiled functions and modules run eagerly (for hooks)."""
    return torch.compiler.set_stance("force_eager") if enabled else contextlib.nullcontext()


def grad_norm_layers(model: GPT) -> list[tuple[str, list]]:
    """(name, parameters) per layer, in parameter order: `embed` (the token embedding, also the LM
    head), `block{i}`, `final_norm`."""
    layers: dict[str, list] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        layer = f"block{parts[1]}" if parts[0] == "blocks" else {"norm": "final_norm"}.get(parts[0], parts[0])
        layers.setdefault(layer, []).append(p)
    return list(layers.items())


def gpt_config_from_dict(model: dict) -> GPTConfig:
    model = dict(model)
    model["attn"] = AttnConfig(**model.get("attn", {}))
    return GPTConfig(**model)


def schedule_function(factor) -> functools.partial:
    """The learning-rate factor, a function of the step (models/schedules.py), from the partial Hydra
    instantiated: as a plain functools.partial of the same target and arguments. Hydra's partial
    re-checks its target policy on every call (0.1-0.3 ms of host time; LambdaLR calls it once per
    parameter group every step); the target was checked when it was instantiated, and the factor
    is checked here to be a number (the only thing LambdaLR does with it)."""
    if not isinstance(factor, functools.partial):
        raise ValueError(f"the scheduler config must give a function of the step (`_partial_: true`), got {factor!r}")
    plain = functools.partial(factor.func, *factor.args, **factor.keywords)
    first = plain(0)
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        raise ValueError(f"the scheduler's {getattr(factor.func, '__name__', factor.func)!r} must return a number "
                         f"(the factor on the learning rate), got {first!r} at step 0")
    return plain


class LitGPT(L.LightningModule):
    """Hyperparameters are plain dicts, so checkpoints load with weights_only=True."""

    def __init__(
        self, model: dict, optimizer: dict | None = None, scheduler: dict | None = None, compile: bool = False,
        bytes_per_token: dict | None = None, peak_tflops: float | None = None, compile_unit: str = "model",
        cuda_graphs: bool | str = False, log_grad_norm_per_layer: bool = True, tokenizer: dict | None = None,
    ):
        """optimizer, scheduler: resolved configs of configs/optimizer/ and configs/scheduler/ (a
        `_target_` with `_partial_: true`), needed to train, not to evaluate."""
        super().__init__()
        # the tokenizer record (data.tokenizers.tokenizer_record) goes into every checkpoint under
        # "tokenizer", not into the hyperparameters (a BPE vocabulary would fill hparams.yaml)
        self.save_hyperparameters(ignore=["tokenizer"])
        self.tokenizer_record = dict(tokenizer) if tokenizer is not None else None
        self.model_cfg = gpt_config_from_dict(model)
        for name, node in (("optimizer", optimizer), ("scheduler", scheduler)):
            if node is not None and not (isinstance(node, dict) and "_target_" in node and node.get("_partial_") is True):
                raise ValueError(f"{name} must be a config with a `_target_` and `_partial_: true` "
                                 f"(configs/{name}/*.yaml), got {node!r}")
        self.optimizer_cfg, self.scheduler_cfg = optimizer, scheduler
        self.log_grad_norm_per_layer = log_grad_norm_per_layer
        if compile_unit not in COMPILE_UNITS:
            raise ValueError(f"train.compile_unit must be one of {COMPILE_UNITS}, got {compile_unit!r}")
        self.model = GPT(self.model_cfg)
        forward_fn = self.model
        if cuda_graphs not in (True, False, "step"):
            raise ValueError(f"cuda_graphs must be True, False or 'step', got {cuda_graphs!r}")
        if cuda_graphs is True and not compile:
            raise ValueError("train.cuda_graphs=true needs train.compile=true (the graphs are torch.compile's)")
        # cuda_graphs=True: the compiled forward and backward are captured by torch.compile (after
        # warm-up runs, which tune and compile the kernels) and replayed: one launch per graph
        # instead of one per kernel; torch.compile copies each batch into the graph's static input
        # buffers (one device copy). "step": the whole forward, loss and backward as one graph of
        # our own (models/captured_step.py), over the compiled or the eager model.
        self.cuda_graphs = cuda_graphs is True
        mode = "reduce-overhead" if self.cuda_graphs else None
        if compile and compile_unit == "model":  # one graph: the fastest single-device step
            forward_fn = torch.compile(self.model, fullgraph=True, mode=mode)
        elif compile:  # a graph per block, shared by the blocks (see GPT.compile_per_block)
            self.model.compile_per_block(mode=mode)
        # the step's gradient norms, clip divisor and non-finite flag are computed inside the graph
        self.step_graph = (CapturedStep(lambda x, y: self._loss((x, y)), self.model.parameters(),
                                        tail=self._captured_step_scalars)
                           if cuda_graphs == "step" else None)
        # kept out of the module tree so the state dict holds each weight once
        self.__dict__["forward_fn"] = forward_fn
        # UTF-8 bytes per token of each split, for bits per byte
        self.bytes_per_token = bytes_per_token or {}
        self._val_sums = None
        self._window = None  # the throughput window being timed (see on_train_batch_end)
        self.log_step_metrics = LogStepMetrics()  # a log step's values on their way to the host
        self._loss_to_log = None  # the loss of a step whose logs are written, logged at its batch end
        self.tokens_seen = 0
        self.last_validation: dict = {}  # {"step", "val/loss"} of the latest validation (not sanity)
        self.peak_tflops = peak_tflops  # bf16 dense peak of one device, for MFU; None: no MFU
        self.flops_per_token = self.model.flops_per_token()
        self.throughput = {"tokens": 0, "seconds": 0.0}  # steady state: after warm-up, outside validation
        # (global step, StepScalars, the parameters in the order of its per-parameter norms) of the
        # step's gradients: computed once per step (current_step_scalars) or by the captured step
        self._step_scalars: tuple[int, StepScalars, list] | None = None
        self._scalar_params: list = []  # the parameters of the captured step's per-parameter norms
        # (layer names, norms) of train/grad_norm/<layer>, on steps whose logs are written
        self._layer_grad_norms: tuple[list[str], torch.Tensor] | None = None

    def forward(self, idx):
        return self.forward_fn(idx)

    def _loss(self, batch, reduction="mean", eager=False):
        """Next-token cross-entropy of a batch in nats; eager=True runs every compiled part
        eagerly (forward hooks only fire outside compiled graphs)."""
        x, y = batch
        with eager_mode(eager):
            loss_sum = self.forward_fn(x, targets=y)  # the loss inside the compiled graph
        if reduction == "sum":
            return loss_sum
        if reduction == "mean":
            return loss_sum / y.numel()
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")

    def training_step(self, batch, batch_idx):
        if self.cuda_graphs:  # a new step: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        # a captured step runs its backward with the forward (LitGPT.backward then has nothing to do)
        if self.step_graph is not None:
            loss = self.step_graph(*batch)
            self._step_scalars = (self.global_step, self.step_graph.tail_outputs, self._scalar_params)
        else:
            loss = self._loss(batch)
        tokens = batch[0].numel()
        self.tokens_seen += tokens * self.trainer.world_size
        if writes_logs(self.trainer):  # logged at the batch end, after the clock's device sync
            self._loss_to_log = loss.detach()
        return loss

    def backward(self, loss, *args, **kwargs):
        if self.step_graph is None:
            super().backward(loss, *args, **kwargs)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        # Lightning zeroes between training_step and backward; a captured step's training_step ran
        # its backward already, and sets (or overwrites) the gradients itself
        if self.step_graph is None:
            optimizer.zero_grad()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Only the steps whose logs are written log anything, and they only gather their values
        # (models/log_step_metrics.py): the next batch end writes them, once the device has
        # finished the log step, so the host never waits for the queue to empty. A value read on
        # the host at the log step itself would idle the GPU while the logs are written.
        # Throughput: over the batches between two log steps, timed on the device's stream
        # between batch ends (the optimizer step included).
        self.write_log_step()
        first_batch = self._window is None
        if first_batch:
            self._window = {"start": self._stream_clock().stamp(), "tokens": 0, "first_step": self.global_step}
        else:
            self._window["tokens"] += batch[0].numel() * self.trainer.world_size
        if not writes_logs(self.trainer):
            return
        metrics = self.log_step_metrics
        # the mean over ranks (a collective, on every rank's same steps) is the global batch's
        # loss for equal per-rank batches; under accumulation, of the step's last micro-batch
        metrics.add("train/loss", mean_over_ranks(self._loss_to_log))
        metrics.add("train/tokens", float(self.tokens_seen))
        metrics.add("train/lr", float(self.optimizers().param_groups[0]["lr"]))
        if self._step_scalars is not None and not hasattr(self.trainer.strategy.model, "clip_grad_norm_"):
            # the latest step's gradient norm before clipping (under FSDP only this rank's shard's: not logged)
            metrics.add("train/grad_norm", self._step_scalars[1].norm)
        if self._layer_grad_norms is not None:
            names, norms = self._layer_grad_norms
            for name, value in zip(names, norms.unbind()):
                metrics.add(f"train/grad_norm/{name}", value)
            self._layer_grad_norms = None
        if self.device.type == "cuda":  # the allocator's counter: a host number, no sync
            metrics.add("train/peak_mem_gb", torch.cuda.max_memory_allocated(self.device) / 2**30)
        window = None
        if not first_batch:  # no batch in the first window yet
            end = self._stream_clock().stamp()
            window = {**self._window, "end": end}
            self._window = {"start": end, "tokens": 0, "first_step": self.global_step}
        metrics.seal(logger_step(self.trainer), window=window)

    def _stream_clock(self) -> StreamClock:
        return StreamClock(self.device)

    def on_train_end(self):
        self.write_log_step(progress_bar=False)  # the last log step (self.log is closed here)

    def write_log_step(self, progress_bar: bool = True) -> None:
        """Write the sealed log step's values, with its throughput window, at its own step index."""
        sealed = self.log_step_metrics.take()
        if sealed is None:
            return
        values = LogStepMetrics.values(sealed)
        window = sealed.context["window"]
        if window is not None:
            seconds = StreamClock.seconds(window["start"], window["end"])
            tps = window["tokens"] / seconds
            values["train/tokens_per_s"] = tps
            if self.peak_tflops:
                values["train/mfu"] = tps * self.flops_per_token / (self.peak_tflops * 1e12 * self.trainer.world_size)
            if window["first_step"] >= WARMUP_STEPS:  # steady state: compile and autotune are done
                self.throughput["tokens"] += window["tokens"]
                self.throughput["seconds"] += seconds
        self._write_train_metrics(values, sealed.step, progress_bar)

    def _write_train_metrics(self, values: dict[str, float], step: int, progress_bar: bool) -> None:
        """To every logger at `step` (what Lightning's own writes add: the epoch), and the
        progress bar's values through self.log (logger=False: the bar and callback_metrics)."""
        for logger in self.trainer.loggers:
            logger.log_metrics({**values, "epoch": self.current_epoch}, step=step)
        if progress_bar:
            for name in PROGRESS_BAR_METRICS:
                if name in values:
                    self.log(name, torch.tensor(values[name]), prog_bar=True, logger=False)

    def mean_tokens_per_s(self) -> float | None:
        t = self.throughput
        return t["tokens"] / t["seconds"] if t["seconds"] > 0 else None

    def on_validation_epoch_start(self):
        self._val_sums = torch.zeros(2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss_sum = self._loss(batch, reduction="sum")
        self._val_sums += torch.stack([loss_sum.double(), torch.tensor(batch[1].numel(), device=self.device).double()])

    def on_validation_epoch_end(self):
        sums = self.all_gather(self._val_sums)
        if sums.ndim == 2:
            sums = sums.sum(0)
        nats = (sums[0] / sums[1].clamp_min(1)).item()
        if not self.trainer.sanity_checking:
            self.last_validation = {"step": self.global_step, "val/loss": nats}
        self.log("val/loss", nats, prog_bar=True, sync_dist=False)
        self.log("val/ppl", math.exp(min(nats, 50.0)))
        if "val" in self.bytes_per_token:
            self.log("val/bpb", nats / math.log(2) / self.bytes_per_token["val"], prog_bar=True)
        self._window = None  # validation time is not training throughput

    def weight_decay_groups(self) -> tuple[list, list]:
        """(decayed, not decayed) parameters: weight decay on the weights of linear layers and the
        embedding (tied to the head, so listed once) only; norms' gains and the differential
        lambda parameters are not decayed (DESIGN.md §4: lambda parameters get no weight decay)."""
        decayed = {id(m.weight) for m in self.model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
        decay, no_decay = [], []
        for p in self.model.parameters():  # each parameter once (the tied head is the embedding)
            (decay if id(p) in decayed else no_decay).append(p)
        return decay, no_decay

    def param_groups(self, hidden_matrix_group: bool = False) -> list[dict]:
        """The optimizer's parameter groups, decided here only: the decayed group of
        weight_decay_groups takes the optimizer's weight_decay, the other group 0. With
        hidden_matrix_group (Muon, models/optim.py) the decayed group splits in two: the 2-D
        weight matrices inside the transformer blocks (`use_muon: True`) and the rest (the
        embedding, which is also the LM head); the not-decayed group has `use_muon: False`."""
        decay, no_decay = self.weight_decay_groups()
        if not hidden_matrix_group:
            return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        in_blocks = {id(p) for p in self.model.blocks.parameters()}
        hidden = [p for p in decay if p.ndim == 2 and id(p) in in_blocks]
        hidden_ids = {id(p) for p in hidden}
        return [{"params": hidden, "use_muon": True},
                {"params": [p for p in decay if id(p) not in hidden_ids], "use_muon": False},
                {"params": no_decay, "weight_decay": 0.0, "use_muon": False}]

    def configure_optimizers(self):
        if self.optimizer_cfg is None or self.scheduler_cfg is None:
            raise ValueError("training needs LitGPT(optimizer=..., scheduler=...): configs with a `_target_` and "
                             "`_partial_: true`, as in configs/optimizer/ and configs/scheduler/")
        make_optimizer = instantiate(self.optimizer_cfg, _convert_="all")  # the class, its settings bound
        chosen = {}
        if make_optimizer.keywords.get("fused", False) is None:
            # fused: null: the fused kernel on CUDA, except under 16-mixed (Lightning's AMP plugin
            # refuses to clip the gradients of a fused optimizer); PyTorch's default elsewhere
            chosen["fused"] = (torch.cuda.is_available() and str(self.trainer.precision) != "16-mixed") or None
        groups = self.param_groups(hidden_matrix_group=getattr(make_optimizer.func, "takes_hidden_matrix_group", False))
        opt = make_optimizer(groups, **chosen)
        lr_factor = schedule_function(instantiate(self.scheduler_cfg, _convert_="all"))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _captured_step_scalars(self, loss: torch.Tensor, params: list) -> StepScalars:
        """The captured step's tail (models/captured_step.py): the step's scalars from its fresh
        gradients, inside the graph. The parameters with a gradient are those of the capture's run,
        and stay so: the replays run the same kernels."""
        self._scalar_params = [p for p in params if p.grad is not None]
        return step_scalars([p.grad for p in self._scalar_params], self._clip_value(), loss)

    def current_step_scalars(self) -> StepScalars:
        """The gradient norm, clip divisor and non-finite flag of this rank's gradients at the current
        optimizer step, before clipping: device tensors, computed once per step (or by the captured
        step, inside its graph) and shared by the non-finite guard, clipping and the train/grad_norm
        log (the per-parameter norms in one multi-tensor kernel, then a few scalar ops:
        models/step_scalars.py). The norm is non-finite when any gradient is, or when the sum of
        squares overflows fp32 (a gradient of 1e19: clipping by it would zero the update, so such a
        step counts as non-finite too). On steps whose logs are written (and with
        log_grad_norm_per_layer), the per-layer norms too, from the same per-parameter norms: a few
        more small kernels, no host sync."""
        step = self.global_step
        if self._step_scalars is None or self._step_scalars[0] != step:
            with_grad = [p for p in self.parameters() if p.grad is not None]
            if with_grad:
                scalars = step_scalars([p.grad for p in with_grad], self._clip_value())
            else:
                scalars = StepScalars([], torch.zeros((), device=self.device), None, None)
            self._step_scalars = (step, scalars, with_grad)
            if self._logs_layer_grad_norms():
                self._layer_grad_norms = self._per_layer_norms(scalars.per_param_norms, with_grad)
        elif self._logs_layer_grad_norms() and self._layer_grad_norms is None:
            _, scalars, params = self._step_scalars
            self._layer_grad_norms = self._per_layer_norms(scalars.per_param_norms, params)
        return self._step_scalars[1]

    def _per_layer_norms(self, per_param_norms: list, params: list) -> tuple[list[str], torch.Tensor]:
        norm_of = {id(p): n for p, n in zip(params, per_param_norms)}
        names, layer_norms = [], []
        for name, layer_params in grad_norm_layers(self.model):
            own = [norm_of[id(p)] for p in layer_params if id(p) in norm_of]
            names.append(name)
            layer_norms.append(torch.linalg.vector_norm(torch.stack(own).float()) if own
                               else torch.zeros((), device=self.device))
        return names, torch.stack(layer_norms)

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of all of this rank's gradients at the current optimizer step, before
        clipping (current_step_scalars)."""
        return self.current_step_scalars().norm

    def nonfinite_flag(self, loss: torch.Tensor) -> torch.Tensor:
        """1.0 (0-d fp32 device tensor) when the step's `loss` or gradient norm is not finite: the
        captured step's own flag (its loss is the step's loss), else computed here."""
        scalars = self.current_step_scalars()
        if scalars.found_nonfinite is not None:
            return scalars.found_nonfinite
        return nonfinite_found(scalars.norm, loss)

    def _clip_value(self) -> float | None:
        """The trainer's gradient clip (train.grad_clip) where this module clips, else None."""
        if self._trainer is None or hasattr(self.trainer.strategy.model, "clip_grad_norm_"):
            return None
        return float(self.trainer.gradient_clip_val) if self.trainer.gradient_clip_val else None

    def _logs_layer_grad_norms(self) -> bool:
        """Whether this step logs train/grad_norm/<layer>: the option, a step whose logs are written,
        and whole gradients on this rank (under FSDP each rank holds its shard's only: not logged)."""
        return (self.log_grad_norm_per_layer and self._trainer is not None and writes_logs(self.trainer)
                and not hasattr(self.trainer.strategy.model, "clip_grad_norm_"))

    def on_before_optimizer_step(self, optimizer):
        # the per-layer norms of a logged step, when neither the non-finite guard nor clipping
        # asked for the step's scalars already (they run before this hook)
        if self._logs_layer_grad_norms():
            self.current_step_scalars()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # Lightning's AMP plugin refuses to clip for fused AdamW (built for fp16 loss scaling);
        # under bf16 / fp32 there is no scaler, so the gradients are the true ones: clip here.
        if not gradient_clip_val:
            return
        wrapped = self.trainer.strategy.model
        if hasattr(wrapped, "clip_grad_norm_"):  # FSDP: the norm over every rank's shard
            wrapped.clip_grad_norm_(gradient_clip_val)
            return
        # the step's clip divisor (torch.nn.utils.clip_grad_norm_'s rule)
        divisor = self.current_step_scalars().divisor
        if divisor is None:  # no gradients this step
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # unwrap a LightningOptimizer
        if getattr(inner, "_step_supports_amp_scaling", False) and str(self.trainer.precision) != "16-mixed":
            # a fused optimizer divides every gradient by its grad_scale inside its own kernel
            # (the mechanism GradScaler uses to unscale): the clip costs no pass over the gradients
            inner.grad_scale = divisor
        else:  # (the non-finite guard's host-synced skip may have dropped every gradient)
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, divisor)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["model_config"] = asdict(self.model_cfg)
        # a finished run resumed reports it without validating again (train.py)
        checkpoint["last_validation"] = dict(self.last_validation)
        if self.tokenizer_record is not None:
            checkpoint["tokenizer"] = dict(self.tokenizer_record)

    def on_load_checkpoint(self, checkpoint):
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.last_validation = dict(checkpoint.get("last_validation", {}))
        if checkpoint.get("tokenizer") is not None and self.tokenizer_record is None:
            self.tokenizer_record = dict(checkpoint["tokenizer"])
