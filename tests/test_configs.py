"""Every config file composes; every experiment trains a few steps; config errors name the field."""

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from training.config_checks import check_config
from train_helpers import CONFIG_DIR, compose_cfg, tiny_overrides, write_corpus

GROUPS = ["attn", "model", "data", "data/tokenizer", "trainer", "logger", "optimizer", "scheduler", "callbacks",
          "experiment"]
LOCAL_DATA_FIELDS = {"text": "data.source.path", "jsonl": "data.source.path", "parquet": "data.source.path"}


def options(group):
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_config_file_composes(group, option, tmp_path, monkeypatch):
    if group == "logger" and option == "tensorboard":  # composes whether or not tensorboard is installed
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "tensorboard" else real(name, *a))
    overrides = [f"{group}={option}", f"paths.output_dir={tmp_path}"]
    if group == "data" and option in LOCAL_DATA_FIELDS:
        overrides.append(f"{LOCAL_DATA_FIELDS[option]}={tmp_path / 'x.txt'}")
    cfg = compose_cfg(overrides)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    check_config(cfg)
    if group == "attn":
        assert cfg.attn.name == option


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_takes_a_tokenizer_switch(experiment):
    """data/tokenizer=<kind> after an experiment that picks its own corpus (tda_parity: bibles, BPE 8192)."""
    cfg = compose_cfg([f"experiment={experiment}", "data/tokenizer=char", "paths.output_dir=/unused"])
    assert OmegaConf.to_container(cfg.data.tokenizer, resolve=True) == {"kind": "char"}
    own = compose_cfg([f"experiment={experiment}", "paths.output_dir=/unused"]).data.tokenizer
    assert own.kind == "bpe" and own.vocab_size == (8192 if experiment == "tda_parity" else 2048)


def test_slurm_launcher_preset_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "paths.output_dir=/tmp/x"], return_hydra_config=True)
    assert cfg.hydra.launcher.nodes == 1
    assert "submitit" in cfg.hydra.launcher._target_


# sizes an experiment test may shrink; everything else is the experiment's own
SHRUNK = {"model.n_layer": 1, "model.d_model": 32, "model.n_head": 2, "model.n_kv_head": 2, "model.context": 32,
          "train.batch_size": 2, "train.max_steps": 2, "train.val_every": 2, "train.val_tokens": 256}


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_trains_with_its_own_settings(experiment, tmp_path, monkeypatch):
    """Each experiment trains two steps with its own optimizer, compile, precision, logger and
    model settings; only sizes shrink, the corpus is a local one (no download) and a GPU trainer
    runs on the CPU here."""
    import torch

    from training import train

    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiled.append(k) or real_compile(*a, **k))
    own = OmegaConf.load(Path(CONFIG_DIR) / "experiment" / f"{experiment}.yaml")
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    overrides = [f"experiment={experiment}", "data=text", f"data.source.path={corpus}", "data/tokenizer=byte",
                 f"paths.cache_dir={tmp_path / 'cache'}", f"paths.output_dir={tmp_path / 'run'}",
                 "trainer.enable_progress_bar=false",
                 *[f"{k}={v}" for k, v in SHRUNK.items()]]
    cfg = compose_cfg(overrides)
    if cfg.trainer.accelerator == "gpu":
        cfg.trainer.accelerator = "cpu"
    for key, value in own.get("train", {}).items():  # the experiment's own settings survive
        if f"train.{key}" not in SHRUNK:
            assert cfg.train[key] == value, key
    gpu_trainer = cfg.trainer.accelerator == "cpu" and "gpu" in str(own.get("defaults", ""))
    results = train.run(cfg)
    assert results["steps"] == 2 and math.isfinite(results["val_loss"]) and results["val_loss"] > 0
    assert bool(compiled) == bool(cfg.train.compile), compiled
    if gpu_trainer:
        assert cfg.trainer.precision == "bf16-mixed"


@pytest.mark.parametrize("override,match", [
    ("attn.name=flash", "attn.name must be one of"),
    ("attn=softcap_tanh attn.params.cap=0", "attn.cap"),
    ("attn=alsc attn.params.knee=1.0", "kappa"),
    ("attn=alsc attn.params.knee=-0.1", "kappa"),
    ("model.d_model=33", "must divide model.d_model"),
    ("model.d_model=30", "must be even"),
    ("model.n_kv_head=3", "divisible by model.n_kv_head"),
    ("attn=threshold attn.params.power=0", "attn.power"),
    ("+attn.cap=3", "unknown attn fields"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.lr=-1", "train.lr"),
    ("logger.kind=mlflow", "logger.kind"),
    ("train.lr=abc", "train.lr must be a number"),
    ("train.beta2=x", "train.beta2 must be a number"),
    ("seed=abc", "seed must be an int"),
    ("+train.foo=1", r"unknown train fields \['foo'\]"),
    ("train.warmup_steps=1.5", "train.warmup_steps must be an int"),
    # settings the variant has no use for (they would train without effect)
    ("attn.lambda_mode=scalar_clamp", r"attn.lambda_mode=scalar_clamp applies to the variants "
                                      r"\['diff_threshold'\] only: attn=softmax does not read it"),
    ("attn=threshold attn.lambda_mode=clamp", r"attn=threshold does not read it"),
    # values checked before any data work, each named with what is allowed
    ("model.rope_base=0", r"model.rope_base must be a number > 1, got 0"),
    ("model.mlp_ratio=-1", r"model.mlp_ratio must be a number > 0, got -1"),
    ("train.beta1=1.5", r"train.beta1 must be in \[0, 1\), got 1.5"),
    ("train.weight_decay=-0.1", r"train.weight_decay must be >= 0, got -0.1"),
    ("train.lr=inf", r"train.lr must be a number, got inf"),
    ("trainer.precision=17", r"trainer.precision must be null \(bf16-mixed on CUDA, 32-true elsewhere\) or one of "
                             r"\[.*'bf16-mixed', '32-true'.*\], got 17"),
    ("seed=-1", r"seed must be an int in \[0, 4294967295\], got -1"),
    ("attn.out_norm_eps=1e-3", r"attn.out_norm_eps=0.001 applies only with the output norm on: attn=softmax runs without it"),
])
def test_config_errors_are_caught_before_training(override, match, tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus) + override.split())
    with pytest.raises(ValueError, match=match):
        train.run(cfg)
    assert not (tmp_path / "cache").exists(), "the error must come before any data work"


def test_missing_local_data_file_is_named(tmp_path):
    from training import train

    missing = tmp_path / "nope.txt"
    cfg = compose_cfg(tiny_overrides(tmp_path, missing))
    with pytest.raises((ValueError, FileNotFoundError), match="nope.txt"):
        train.run(cfg)


def _targets(node, path=""):
    """(path, node) of every config node that names a `_target_`, outermost first."""
    from omegaconf import DictConfig, ListConfig

    found = []
    if isinstance(node, DictConfig):
        if "_target_" in node:
            found.append((path, node))
        for key in node:
            found += _targets(node[key], f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            found += _targets(item, f"{path}[{i}]")
    return found


def _check_arguments(cls, node, path):
    """The class imports and takes every argument the config gives it (nested targets built)."""
    import inspect

    from hydra.utils import instantiate

    kwargs = {k: instantiate(v) if OmegaConf.is_config(v) else v for k, v in node.items() if not str(k).startswith("_")}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise AssertionError(f"{path}: {node._target_} does not take {sorted(kwargs)}: {e}") from None
    return kwargs


@pytest.mark.parametrize("option", options("trainer"))
def test_every_trainer_config_builds(option, tmp_path):
    """Every `_target_` of a trainer config is built: strategies (with their DDP arguments checked
    against DistributedDataParallel), wrap policies, hooks; the Trainer itself where this machine
    can run it (CPU and auto), its arguments checked against its signature elsewhere (GPU)."""
    import lightning as L
    from hydra.utils import get_class, instantiate
    from torch.nn.parallel import DistributedDataParallel

    cfg = compose_cfg([f"trainer={option}", f"paths.output_dir={tmp_path}"])
    nodes = _targets(cfg.trainer)
    assert nodes and nodes[0][0] == "" and get_class(cfg.trainer._target_) is L.Trainer
    strategy = cfg.trainer.get("strategy")
    if OmegaConf.is_config(strategy):
        built = instantiate(strategy)
        ddp_kwargs = getattr(built, "_ddp_kwargs", None)
        if ddp_kwargs is not None:
            import inspect
            inspect.signature(DistributedDataParallel).bind_partial(module=None, **ddp_kwargs)
            assert ddp_kwargs.get("bucket_cap_mb") == strategy.get("bucket_cap_mb")
        if strategy.get("ddp_comm_hook") is not None:
            assert callable(built._ddp_comm_hook)
    kwargs = _check_arguments(L.Trainer, cfg.trainer, "trainer")
    if cfg.trainer.accelerator in ("cpu", "auto"):
        trainer = instantiate(cfg.trainer, default_root_dir=str(tmp_path), logger=False,
                              precision=cfg.trainer.precision or "32-true")
        assert isinstance(trainer, L.Trainer)
        if option == "ddp_cpu":
            assert trainer.num_devices == 2 and type(trainer.strategy).__name__ == "CurrentStreamDDPStrategy"
    else:
        assert kwargs["accelerator"] == "gpu"


@pytest.mark.parametrize("option", options("scheduler"))
def test_every_scheduler_config_builds_a_function_of_the_step(option):
    """Each schedule starts at 1/warmup_steps, reaches 1 at the warm-up's end and min_lr_ratio at max_steps."""
    from hydra.utils import instantiate

    cfg = compose_cfg([f"scheduler={option}", "paths.output_dir=/tmp/x", "train.warmup_steps=4",
                       "train.max_steps=40", "train.min_lr_ratio=0.25"])
    lr_factor = instantiate(cfg.scheduler)
    assert [lr_factor(s) for s in (0, 3, 40)] == pytest.approx([0.25, 1.0, 0.25])


@pytest.mark.parametrize("option", options("callbacks"))
def test_every_callbacks_config_builds_its_callbacks(option, tmp_path):
    import lightning as L

    from training.callbacks.configured import build_configured_callbacks

    cfg = compose_cfg([f"callbacks={option}", f"paths.output_dir={tmp_path}", "train.ckpt_every_steps=5"])
    built = build_configured_callbacks(cfg.callbacks)
    assert len(built) == len(cfg.callbacks) and all(isinstance(c, L.Callback) for c in built)


def test_the_train_switches_leave_their_callbacks_out(tmp_path):
    """train.log_max_logit=false, train.attention_stats_sequences=0, train.log_samples=0 and
    train.ckpt_every_steps=null (the default) leave their configs/callbacks/ entries out; train.nonfinite
    reaches the guard."""
    from training.callbacks.configured import build_configured_callbacks

    def built(*overrides):
        cfg = compose_cfg([f"paths.output_dir={tmp_path}", *overrides])
        return {type(c).__name__: c for c in build_configured_callbacks(cfg.callbacks)}

    assert sorted(built()) == ["AttentionHeatmapsAtEnd", "AttentionRowMonitor", "MaxLogitMonitor", "ModelCheckpoint",
                               "NonFiniteGuard", "ValidationSamples"]
    assert built("train.nonfinite=stop")["NonFiniteGuard"].policy == "stop"
    assert built("train.ckpt_every_steps=7")["LastCheckpointEveryNSteps"].every == 7
    assert sorted(built("train.log_max_logit=false", "train.attention_stats_sequences=0", "train.log_samples=0")) == [
        "AttentionHeatmapsAtEnd", "ModelCheckpoint", "NonFiniteGuard"]
    assert "ValidationSamples" not in built("train.sample_tokens=0")
    assert "NonFiniteGuard" not in built("callbacks.nonfinite_guard=null")
    with pytest.raises(ValueError, match=r"train\.nonfinite must be one of"):
        built("train.nonfinite=ignore")


def test_early_stopping_adds_to_the_default_callbacks():
    cfg = compose_cfg(["callbacks=[default,early_stopping]", "paths.output_dir=/tmp/x"])
    assert list(cfg.callbacks) == ["model_checkpoint", "attention_heatmaps", "nonfinite_guard", "last_checkpoint_every_n_steps",
                                 "max_logit", "attention_monitor", "validation_samples", "early_stopping"]
    assert cfg.callbacks.early_stopping.monitor == "val/loss"


@pytest.mark.parametrize("option", options("data"))
def test_every_data_config_builds_its_datamodule(option, tmp_path):
    """The datamodule of every data config is constructed (its argument checks run); nothing is
    downloaded or read until prepare_data."""
    from hydra.utils import instantiate

    from data.datamodule import TokenDataModule

    overrides = [f"data={option}", f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"]
    if option in LOCAL_DATA_FIELDS:  # the local-file configs check that their files exist
        source = tmp_path / f"x.{option.replace('text', 'txt')}"
        if option == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": ["one line", "another"]}), source)
        else:
            source.write_text('{"text": "one line"}\n' if option == "jsonl" else "one line\n")
        overrides.append(f"{LOCAL_DATA_FIELDS[option]}={source}")
    cfg = compose_cfg(overrides)
    dm = instantiate(cfg.data)
    assert isinstance(dm, TokenDataModule)
    assert dm.seq_len == cfg.model.context and dm.batch_size == cfg.train.batch_size
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.bin"))


def test_the_slurm_launcher_takes_its_preset_arguments():
    import inspect

    from hydra import compose, initialize_config_dir
    from hydra.utils import get_class

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "paths.output_dir=/tmp/x"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    cls = get_class(launcher._target_)
    kwargs = {k: v for k, v in OmegaConf.to_container(launcher, resolve=False).items() if not k.startswith("_")}
    # submitit's launcher takes its parameters as **params and checks them against its dataclass
    params = inspect.signature(cls).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    fields = set(SlurmQueueConf.__dataclass_fields__)
    assert set(kwargs) <= fields, sorted(set(kwargs) - fields)


def test_two_runs_started_in_the_same_second_get_their_own_directories(monkeypatch):
    """The run and sweep directory names carry microseconds (seconds alone let two runs of one
    variant and seed started together share a directory)."""
    from hydra import compose, initialize_config_dir

    monkeypatch.delenv("ATTNLAB_RUN_DIR", raising=False)
    dirs = []
    for _ in range(2):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", overrides=["paths.output_dir=/tmp/x"], return_hydra_config=True)
        dirs.append((cfg.hydra.run.dir, cfg.hydra.sweep.dir))
    (run_a, sweep_a), (run_b, sweep_b) = dirs
    assert run_a != run_b and sweep_a != sweep_b, dirs
    assert run_a.endswith("_softmax_s0") and run_a[:-len("_softmax_s0")][-7] == "-"  # ..._HH-MM-SS-ffffff


@pytest.mark.parametrize("variant", sorted(p.stem for p in (Path(CONFIG_DIR) / "attn").glob("*.yaml")))
def test_attn_configs_list_every_parameter_at_the_spec_default(variant, tmp_path):
    """The spec dataclass declares each parameter's default (attn/specs.py); a variant's config
    lists the variant's parameters (overridable without `+`, and logged with the run) at those
    defaults, every one whose default is a value (a null default, as sm_scale's D^-1/2, may be
    left out), so a config and `make_spec()` build the same spec."""
    import attn

    v = attn.get_variant(variant)
    params = OmegaConf.to_container(compose_cfg(tiny_overrides(tmp_path, write_corpus(tmp_path / "c.txt"),
                                                               attn=variant)).attn.params)
    assert set(params) <= set(v.params)
    assert params == {key: v.default(key) for key in params}
    assert all(v.default(key) is None for key in set(v.params) - set(params))
    assert v.make_spec(**params) == v.make_spec()
