"""Validation samples (training/callbacks/validation_samples.py): written per validation to samples.jsonl and to
wandb's table, drawn without touching training's random state."""

import json

import pytest
from train_helpers import compose_cfg, tiny_overrides, write_corpus

from eval.run_logs import train_losses


def test_each_validation_writes_its_samples_and_training_is_unchanged(tmp_path, monkeypatch):
    from training import train
    from lightning.pytorch.loggers import WandbLogger

    tables = []
    monkeypatch.setattr(WandbLogger, "log_text", lambda self, key, columns, data, step=None: tables.append((key, columns, data, step)))
    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    common = {"train.max_steps": 6, "train.val_every": 3}
    with_samples = train.run(compose_cfg(tiny_overrides(tmp_path / "a", corpus, logger="wandb", **common,
                                                        **{"train.log_samples": 2, "train.sample_tokens": 10})))
    rows = [json.loads(line) for line in (tmp_path / "a" / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 3, 6, 6]
    assert all(r["prompt"] and isinstance(r["sample"], str) and r["sample"] for r in rows)
    assert [(key, step) for key, _, _, step in tables] == [("val/samples", 3), ("val/samples", 6)]
    assert tables[0][1] == ["step", "prompt", "sample"] and len(tables[0][2]) == 2
    without = train.run(compose_cfg(tiny_overrides(tmp_path / "b", corpus, **common, **{"train.log_samples": 0})))
    assert not (tmp_path / "b" / "run" / "samples.jsonl").exists()
    # sampling draws from its own generator: the training losses are bitwise the same
    assert train_losses(tmp_path / "a" / "run") == train_losses(tmp_path / "b" / "run")
    assert with_samples["val_loss"] == without["val_loss"]


@pytest.mark.parametrize("key,value", [("log_samples", -1), ("sample_tokens", 1.5)])
def test_bad_sample_settings_are_named(tmp_path, key, value):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    with pytest.raises(ValueError, match=f"train.{key} must be an int >= 0"):
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{f"train.{key}": value})))
