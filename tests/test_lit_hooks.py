"""LitGPT's hooks called one at a time on a tiny model, with a stand-in trainer and a recording
`log`: no Lightning run, so each test takes milliseconds (the mutation run over models/lit.py
runs these for every mutant). What they pin: the validation sums and their reduction over ranks,
val/loss, val/ppl and val/bpb, which validations count as the latest, the loss reductions, the
checkpoint fields and what a resumed module takes back from them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from models.lit import LitGPT
from models.step_scalars import StepScalars

TINY = {"vocab_size": 32, "context": 8, "n_layer": 1, "n_head": 2, "n_kv_head": 2, "d_model": 16,
        "attn": {"name": "softmax", "backend": "reference"}}


def attached(lit: LitGPT, **trainer) -> list[tuple[str, float]]:
    """Attach a stand-in trainer (global_step, sanity_checking, ...) and record self.log's calls."""
    lit._trainer = SimpleNamespace(**{"global_step": 7, "sanity_checking": False, "current_epoch": 0,
                                      "loggers": [], **trainer})
    logged = []
    lit.log = lambda name, value, **kw: logged.append((name, float(value)))
    return logged


class RecordingLogger:
    """A logger that keeps each write: (global step when written, step index, metrics)."""

    def __init__(self, lit):
        self.lit, self.writes = lit, []

    def log_metrics(self, metrics, step):
        self.writes.append((self.lit._trainer.global_step, step, dict(metrics)))

    def by_step(self) -> dict[int, dict[str, float]]:
        return {step: metrics for _, step, metrics in self.writes}


def validate(lit: LitGPT, batches, gathered=None) -> dict[str, float]:
    """One validation epoch over (x, y) batches; `gathered` stands for all_gather (one rank: itself)."""
    lit.on_validation_epoch_start()
    for i, batch in enumerate(batches):
        lit.validation_step(batch, i)
    lit.all_gather = gathered or (lambda t: t)
    logged = {}
    real_log = lit.log
    lit.log = lambda name, value, **kw: (logged.__setitem__(name, float(value)), real_log(name, value, **kw))
    lit.on_validation_epoch_end()
    lit.log = real_log
    return logged


def batches(seed=0, n=3, b=2, t=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, (b, t), generator=g), torch.randint(0, 32, (b, t), generator=g)) for _ in range(n)]


def direct_nats(lit, data):
    total = sum(torch.nn.functional.cross_entropy(lit.model(x).double().reshape(-1, 32), y.reshape(-1),
                                                  reduction="sum").item() for x, y in data)
    return total / sum(y.numel() for _, y in data)


def test_validation_logs_token_weighted_nats_their_exp_and_bits_per_byte():
    torch.manual_seed(0)
    lit = LitGPT(model=TINY, bytes_per_token={"val": 1.5, "train": 9.0})
    attached(lit)
    # batches of different sizes: the mean is over tokens, not over batches
    data = batches(n=2) + [(torch.randint(0, 32, (1, 8)), torch.randint(0, 32, (1, 8)))]
    with torch.no_grad():
        logged = validate(lit, data)
        nats = direct_nats(lit, data)
    assert logged["val/loss"] == pytest.approx(nats, rel=1e-6)
    assert logged["val/ppl"] == pytest.approx(math.exp(nats), rel=1e-6)
    assert logged["val/bpb"] == pytest.approx(nats / math.log(2) / 1.5, rel=1e-6)
    assert lit.last_validation == {"step": 7, "val/loss": logged["val/loss"]}
    assert lit._window is None  # validation time is left out of the next throughput window


def test_val_bpb_is_not_logged_without_the_splits_bytes_per_token():
    lit = LitGPT(model=TINY, bytes_per_token={"train": 1.0})
    attached(lit)
    with torch.no_grad():
        assert set(validate(lit, batches())) == {"val/loss", "val/ppl"}


def test_the_sums_of_every_rank_make_the_validation_loss():
    """all_gather gives (world size, 2) under DDP: the token-weighted mean over all ranks' sums."""
    lit = LitGPT(model=TINY)
    attached(lit)
    other_rank = torch.tensor([300.0, 100.0], dtype=torch.float64)  # 3 nats/token over 100 tokens
    with torch.no_grad():
        logged = validate(lit, batches(n=1), gathered=lambda t: torch.stack([t, other_rank]))
        mine = direct_nats(lit, batches(n=1))
    assert logged["val/loss"] == pytest.approx((mine * 16 + 300.0) / (16 + 100), rel=1e-6)


def test_perplexity_is_capped_and_an_empty_validation_is_zero_not_nan():
    lit = LitGPT(model=TINY)
    lit.all_gather = lambda t: t
    records = attached(lit)
    lit.on_validation_epoch_start()
    lit._val_sums += torch.tensor([80.0, 1.0], dtype=torch.float64)  # 80 nats: exp(80) would be 5.5e34
    lit.on_validation_epoch_end()
    assert dict(records)["val/loss"] == 80.0
    assert dict(records)["val/ppl"] == pytest.approx(math.exp(50.0), rel=1e-12)
    records = attached(lit)
    lit.on_validation_epoch_start()  # no batch: 0 tokens
    lit.on_validation_epoch_end()
    assert dict(records)["val/loss"] == 0.0 and dict(records)["val/ppl"] == 1.0


def test_the_sanity_check_is_not_the_latest_validation():
    lit = LitGPT(model=TINY)
    attached(lit, sanity_checking=True)
    with torch.no_grad():
        validate(lit, batches())
    assert lit.last_validation == {}
    attached(lit, sanity_checking=False, global_step=3)
    with torch.no_grad():
        logged = validate(lit, batches())
    assert lit.last_validation == {"step": 3, "val/loss": logged["val/loss"]}


def test_loss_reductions():
    torch.manual_seed(1)
    lit = LitGPT(model=TINY)
    (x, y), = batches(n=1)
    with torch.no_grad():
        total = lit._loss((x, y), reduction="sum")
        assert lit._loss((x, y)).item() == pytest.approx(total.item() / y.numel(), rel=1e-6)
        assert total.item() == pytest.approx(direct_nats(lit, [(x, y)]) * y.numel(), rel=1e-5)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        lit._loss((x, y), reduction="none")


def test_a_checkpoint_holds_the_counters_the_model_config_and_the_tokenizer_and_gives_them_back():
    from dataclasses import asdict

    record = {"kind": "char", "alphabet": "abc"}
    lit = LitGPT(model=TINY, tokenizer=record)
    lit.tokens_seen, lit.last_validation = 1234, {"step": 5, "val/loss": 2.5}
    checkpoint = {}
    lit.on_save_checkpoint(checkpoint)
    assert checkpoint == {"tokens_seen": 1234, "model_config": asdict(lit.model_cfg),
                          "last_validation": {"step": 5, "val/loss": 2.5}, "tokenizer": record}
    assert checkpoint["last_validation"] is not lit.last_validation and checkpoint["tokenizer"] is not record
    resumed = LitGPT(model=TINY)
    resumed.on_load_checkpoint(checkpoint)
    assert (resumed.tokens_seen, resumed.last_validation, resumed.tokenizer_record) == (1234, checkpoint["last_validation"], record)
    # without a tokenizer record: none written; a module built with its own record keeps it
    plain = {}
    LitGPT(model=TINY).on_save_checkpoint(plain)
    assert "tokenizer" not in plain
    own = LitGPT(model=TINY, tokenizer={"kind": "byte"})
    own.on_load_checkpoint(checkpoint)
    assert own.tokenizer_record == {"kind": "byte"}
    # a checkpoint of an older version, without the counters: zero tokens, no validation yet
    old = LitGPT(model=TINY)
    old.on_load_checkpoint({"tokenizer": None})
    assert (old.tokens_seen, old.last_validation, old.tokenizer_record) == (0, {}, None)


@pytest.mark.parametrize("unit", ["model", "block"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_compile_wraps_the_chosen_unit_with_the_chosen_mode(unit, cuda_graphs, monkeypatch):
    """train.compile_unit=model: one torch.compile of the whole model, the forward goes through it;
    =block: one per block plus the output, the forward is the model itself. CUDA graphs are
    torch.compile's reduce-overhead mode. (Recorded, not compiled: the tests that compile are
    tests/test_compile.py's.)"""
    calls = []

    def recording_compile(fn, **kwargs):
        calls.append((fn, kwargs))
        return SimpleNamespace(compiled=fn)

    monkeypatch.setattr(torch, "compile", recording_compile)
    plain = LitGPT(model=TINY)
    assert plain.forward_fn is plain.model and calls == []  # compile=False: nothing compiled
    lit = LitGPT(model={**TINY, "n_layer": 2}, compile=True, compile_unit=unit, cuda_graphs=cuda_graphs)
    mode = "reduce-overhead" if cuda_graphs else None
    assert all(kwargs == {"fullgraph": True, "mode": mode} for _, kwargs in calls), calls
    if unit == "model":
        assert [fn for fn, _ in calls] == [lit.model] and lit.forward_fn.compiled is lit.model
    else:
        blocks = [block._call_impl for block in lit.model.blocks]
        assert [fn for fn, _ in calls][:2] == blocks and len(calls) == 3  # two blocks, then the output
        assert lit.forward_fn is lit.model
    assert lit.cuda_graphs is cuda_graphs
    assert "forward_fn" not in dict(lit.named_children())  # out of the module tree: each weight saved once


class FakeEvent:
    """torch.cuda.Event on CPU: a stamp whose elapsed time is the difference of given times."""

    times = iter(())

    def __init__(self, enable_timing=False):
        self.time = None

    def record(self):
        self.time = next(FakeEvent.times)

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.time - self.time) * 1e3


def test_on_a_cuda_device_nothing_syncs_and_peak_memory_is_logged_in_gib(monkeypatch):
    """The GPU-only branches of the batch end, on CPU: a module that reports a CUDA device, with
    torch.cuda's memory counter, synchronize and events stood in for. The throughput clock is a
    CUDA event; no batch end synchronizes the device."""
    lit = LitGPT(model=TINY)
    logger = RecordingLogger(lit)
    attached(lit, world_size=1, _logger_connector=SimpleNamespace(should_update_logs=True), loggers=[logger],
             fit_loop=SimpleNamespace(_should_accumulate=lambda: False), strategy=SimpleNamespace(model=torch.nn.Identity()))
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30 + 2**29)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.times = iter([1.0, 3.0])
    monkeypatch.setattr(lit, "optimizers", lambda: SimpleNamespace(param_groups=[{"lr": 0.25}]))
    lit._device = torch.device("cuda", 0)
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    for step in (0, 1):
        lit._trainer.global_step = step
        lit._loss_to_log = torch.tensor(2.0 + step)
        lit.on_train_batch_end(None, batch, step)
    lit.on_train_end()
    logged = logger.by_step()
    assert logged[0]["train/peak_mem_gb"] == 3.5
    assert logged[0]["train/lr"] == 0.25 and logged[0]["train/loss"] == 2.0 and logged[1]["train/loss"] == 3.0
    assert logged[1]["train/tokens_per_s"] == 16 / 2.0  # one batch between the stamps at 1.0 and 3.0
    assert synced == []
    for step, other in enumerate(("cpu", "mps"), start=2):  # other devices: no CUDA call
        lit._device = torch.device(other)
        lit._trainer.global_step = step
        lit._window = None  # a window does not span devices
        lit.on_train_batch_end(None, batch, step)
        lit.on_train_end()
        assert "train/peak_mem_gb" not in logger.by_step()[step] and synced == []


def logging_trainer(lit, world_size, steps_that_write, fsdp=False):
    """A stand-in trainer whose log writes happen on `steps_that_write` (global steps); returns
    (the recording logger, self.log's calls, a function that moves the trainer to a step)."""
    connector = SimpleNamespace(should_update_logs=False)
    wrapped = SimpleNamespace(clip_grad_norm_=lambda *a: None) if fsdp else torch.nn.Identity()
    logger = RecordingLogger(lit)
    logged = attached(lit, world_size=world_size, _logger_connector=connector, strategy=SimpleNamespace(model=wrapped),
                      fit_loop=SimpleNamespace(_should_accumulate=lambda: False), loggers=[logger])

    def at(step):
        lit._trainer.global_step = step
        connector.should_update_logs = step in steps_that_write
    return logger, logged, at


def test_tokens_throughput_and_mfu_count_every_rank(monkeypatch):
    """World size 2: each rank's batch is half of the step's tokens. train/tokens, tokens/s and MFU
    (over world size x peak) are of the whole step; windows that start before WARMUP_STEPS are
    logged but left out of the steady-state mean. A log step's values are written at the next
    batch end (the last at the end of training), at the log step's own step index."""
    from models.lit import WARMUP_STEPS

    assert WARMUP_STEPS == 5
    lit = LitGPT(model=TINY, peak_tflops=2.0)
    logger, logged, at = logging_trainer(lit, world_size=2, steps_that_write={0, 1, 5, 7, 8})
    clock = iter([10.0, 12.0, 20.0, 22.0, 23.0])  # stamped at the first batch's end and at each later log step
    monkeypatch.setattr(lit, "_stream_clock", lambda: SimpleNamespace(stamp=lambda: next(clock)))
    monkeypatch.setattr(lit, "optimizers", lambda: SimpleNamespace(param_groups=[{"lr": 0.5}]))
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))  # 16 tokens a rank
    for step in range(9):
        at(step)
        with torch.no_grad():
            lit.training_step(batch, step)
        lit.on_train_batch_end(None, batch, step)
    at(9)
    lit.on_train_end()
    assert lit.tokens_seen == 9 * 32
    by_step = logger.by_step()
    assert [(written, step) for written, step, _ in logger.writes] == [(1, 0), (2, 1), (6, 5), (8, 7), (9, 8)]
    assert by_step[7]["train/tokens"] == 8 * 32 and by_step[7]["train/lr"] == 0.5 and by_step[7]["epoch"] == 0
    assert "train/tokens_per_s" not in by_step[0]  # no batch in the first window yet
    rates = {s: by_step[s]["train/tokens_per_s"] for s in (1, 5, 7, 8)}
    assert rates == {1: 32 / 2.0, 5: 4 * 32 / 8.0, 7: 2 * 32 / 2.0, 8: 32 / 1.0}
    for s, tps in rates.items():
        assert by_step[s]["train/mfu"] == pytest.approx(tps * lit.flops_per_token / (2.0e12 * 2), rel=1e-9)
    # the progress bar gets the loss and rates through self.log, at the batch end that writes them
    assert ("train/tokens_per_s", 32 / 2.0) in logged and not any(name == "train/lr" for name, _ in logged)
    # steady state: the windows that opened at steps 5 and 7 (>= WARMUP_STEPS)
    assert lit.throughput == {"tokens": 96, "seconds": 3.0} and lit.mean_tokens_per_s() == 32.0


def test_gradient_norms_are_logged_once_and_not_under_sharded_gradients(monkeypatch):
    for fsdp in (False, True):
        lit = LitGPT(model=TINY)
        logger, _, at = logging_trainer(lit, world_size=1, steps_that_write={0}, fsdp=fsdp)
        monkeypatch.setattr(lit, "optimizers", lambda: SimpleNamespace(param_groups=[{"lr": 0.5}]))
        lit._loss_to_log = torch.tensor(1.0)
        lit._step_scalars = (0, StepScalars([], torch.tensor(3.0), None, None), [])
        lit._layer_grad_norms = (["embed", "block0"], torch.tensor([1.0, 2.0]))
        at(0)
        lit.on_train_batch_end(None, (torch.zeros(1, 8, dtype=torch.long),) * 2, 0)
        assert lit._layer_grad_norms is None  # logged once
        lit.on_train_end()
        norms = {k: v for k, v in logger.by_step()[0].items() if k.startswith("train/grad_norm")}
        if fsdp:  # this rank's shard's norm is not the model's: the total is not logged
            assert norms == {"train/grad_norm/embed": 1.0, "train/grad_norm/block0": 2.0}
        else:
            assert norms == {"train/grad_norm": 3.0, "train/grad_norm/embed": 1.0, "train/grad_norm/block0": 2.0}


def test_optimizer_and_scheduler_configs_must_be_partial_targets():
    partial = {"_target_": "torch.optim.AdamW", "_partial_": True}
    LitGPT(model=TINY, optimizer=partial, scheduler={**partial, "_target_": "models.schedules.warmup_cosine"})
    for name in ("optimizer", "scheduler"):
        for bad in ({"_target_": "torch.optim.AdamW"}, {**partial, "_partial_": "true"}, {"_partial_": True}, "adamw"):
            with pytest.raises(ValueError, match=f"{name} must be a config with a `_target_` and `_partial_: true`"):
                LitGPT(model=TINY, **{name: bad})


class RecordingSGD(torch.optim.SGD):
    """An optimizer target that records the `fused` it is built with."""
    made: list = []

    def __init__(self, params, lr=0.1, **kwargs):
        RecordingSGD.made.append(kwargs.get("fused", "not given"))
        super().__init__(params, lr=lr)


@pytest.mark.parametrize("cuda,precision,configured,want", [
    (True, "bf16-mixed", None, True),  # fused: null on CUDA: the fused kernel
    (True, "32-true", None, True),
    (True, "16-mixed", None, None),  # Lightning's AMP plugin refuses to clip a fused optimizer
    (False, "bf16-mixed", None, None),  # off CUDA: PyTorch's default
    (True, "bf16-mixed", False, False),  # an explicit choice stays
])
def test_fused_null_picks_the_fused_kernel_on_cuda_except_under_fp16(cuda, precision, configured, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    RecordingSGD.made = []
    lit = LitGPT(model=TINY, optimizer={"_target_": f"{__name__}.RecordingSGD", "_partial_": True, "fused": configured},
                 scheduler={"_target_": "models.schedules.warmup_cosine", "_partial_": True, "warmup_steps": 1,
                            "max_steps": 4, "min_lr_ratio": 0.1})
    attached(lit, precision=precision)
    out = lit.configure_optimizers()
    assert RecordingSGD.made == [want] and type(out["optimizer"]) is RecordingSGD
    assert out["lr_scheduler"]["interval"] == "step"


def test_eager_mode_runs_compiled_functions_eagerly_by_default():
    """training/callbacks/validation_samples.py calls eager_mode() with no argument: compiled code must not compile there."""
    from torch._dynamo.testing import CompileCounter

    from models.lit import eager_mode

    torch._dynamo.reset()
    counter = CompileCounter()
    double = torch.compile(lambda x: 2 * x, backend=counter)
    with eager_mode():
        assert double(torch.ones(3)).tolist() == [2.0] * 3
    assert counter.frame_count == 0
    with eager_mode(False):
        double(torch.ones(3))
    assert counter.frame_count == 1  # compiled only outside eager mode


def test_the_scheduler_is_a_plain_function_of_the_step_with_the_configured_values():
    """configure_optimizers' LambdaLR gets a plain functools.partial of the configured schedule (Hydra's
    own partial re-checks its target policy on every call, every step), with the same values."""
    import functools

    from hydra.utils import instantiate

    from models.lit import schedule_function
    from models.schedules import warmup_cosine

    node = {"_target_": "models.schedules.warmup_cosine", "_partial_": True, "warmup_steps": 10, "max_steps": 100,
            "min_lr_ratio": 0.1}
    lit = LitGPT(model=TINY, optimizer={"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1.0}, scheduler=node)
    lit.trainer = SimpleNamespace(precision="32-true")
    sched = lit.configure_optimizers()["lr_scheduler"]["scheduler"]
    factor = sched.lr_lambdas[0]
    assert type(factor) is functools.partial and factor.func is warmup_cosine
    hydra_factor = instantiate(node)
    assert [factor(s) for s in (0, 9, 10, 55, 100, 150)] == [hydra_factor(s) for s in (0, 9, 10, 55, 100, 150)]
    with pytest.raises(ValueError, match="must give a function of the step"):
        schedule_function(lambda step: 1.0)
    with pytest.raises(ValueError, match="must return a number"):
        schedule_function(functools.partial(lambda step, x: x, x="fast"))


def test_log_step_metrics_hand_over_each_sealed_step_once():
    """Tensors and numbers of a log step come back as floats, keyed by name, with the step index
    and context given at seal; a step must be taken before the next is sealed."""
    from models.log_step_metrics import LogStepMetrics

    metrics = LogStepMetrics()
    assert metrics.take() is None
    metrics.add("a", torch.tensor([2.5]))
    metrics.add("b", 3)
    metrics.add("c", torch.tensor(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="one element"):
        metrics.add("d", torch.zeros(2))
    metrics.seal(11, window=None)
    with pytest.raises(RuntimeError, match="not taken"):
        metrics.seal(12)
    sealed = metrics.take()
    assert sealed.step == 11 and sealed.context == {"window": None}
    assert LogStepMetrics.values(sealed) == {"a": 2.5, "b": 3.0, "c": 7.0}
    assert metrics.take() is None
    metrics.seal(12)  # nothing added: an empty step
    assert LogStepMetrics.values(metrics.take()) == {}
