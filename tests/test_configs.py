"""Every config file composes; every experiment trains a few steps; config errors name the field."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from models.config_checks import check_config
from train_helpers import CONFIG_DIR, compose_cfg, tiny_overrides, write_corpus

GROUPS = ["attn", "model", "data", "trainer", "logger", "experiment"]
LOCAL_DATA_FIELDS = {"text": "data.source.path", "jsonl": "data.source.path", "parquet": "data.source.path"}


def options(group):
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_config_file_composes(group, option, tmp_path):
    overrides = [f"{group}={option}", f"paths.output_dir={tmp_path}"]
    if group == "data" and option in LOCAL_DATA_FIELDS:
        overrides.append(f"{LOCAL_DATA_FIELDS[option]}={tmp_path / 'x.txt'}")
    cfg = compose_cfg(overrides)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    check_config(cfg)
    if group == "attn":
        assert cfg.attn.name == option


def test_slurm_launcher_preset_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "paths.output_dir=/tmp/x"], return_hydra_config=True)
    assert cfg.hydra.launcher.nodes == 1
    assert "submitit" in cfg.hydra.launcher._target_


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_trains_a_few_steps(experiment, tmp_path):
    import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    overrides = [f"experiment={experiment}"] + tiny_overrides(
        tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2}
    )
    results = train.run(compose_cfg(overrides))
    assert results["steps"] == 2 and results["val_loss"] > 0


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
    ("logger.kind=tensorboard", "logger.kind"),
])
def test_config_errors_are_caught_before_training(override, match, tmp_path):
    import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus) + override.split())
    with pytest.raises(ValueError, match=match):
        train.run(cfg)
    assert not (tmp_path / "cache").exists(), "the error must come before any data work"


def test_missing_local_data_file_is_named(tmp_path):
    import train

    missing = tmp_path / "nope.txt"
    cfg = compose_cfg(tiny_overrides(tmp_path, missing))
    with pytest.raises((ValueError, FileNotFoundError), match="nope.txt"):
        train.run(cfg)
