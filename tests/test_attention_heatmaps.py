"""The attention heatmaps written and logged at the end of a run (training/callbacks/attention_heatmaps.py):
PNGs and a JSON in the run directory with the CSV logger, images in wandb's offline run and
tensorboard, and a warning instead of a failed run when something goes wrong."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from train_helpers import compose_cfg, tiny_overrides, write_corpus

from models.attention_diagnostics import METRICS
from training.callbacks.attention_heatmaps import AttentionHeatmapsAtEnd

# tiny_overrides switches the heatmaps off (they cost about a second a run): on here, as by default
SHORT = {"train.max_steps": 2, "train.val_every": 2, "callbacks.attention_heatmaps.windows": 4}


def run(tmp_path, *extra, **settings):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    return train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{**SHORT, **settings}) + list(extra)))


def test_a_run_ends_with_heatmaps_of_every_metric_in_its_directory(tmp_path):
    import matplotlib.image

    results = run(tmp_path)
    folder = tmp_path / "run" / "attention_heatmaps"
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"step2.{m}.png" for m in METRICS] + ["step2.json"])
    for metric in METRICS:
        pixels = matplotlib.image.imread(folder / f"step2.{metric}.png")
        assert pixels.ndim == 3 and np.isfinite(pixels).all() and pixels.std() > 0  # a drawn image, not a blank
    record = json.loads((folder / "step2.json").read_text())
    assert record["step"] == results["steps"] == 2 and record["variant"] == "softmax" and record["split"] == "val"
    assert len(record["window_starts"]) == 4 and record["tokens"] == 4 * 32  # 4 windows of the context (32)
    for metric in METRICS:
        layers = record["metrics"][metric]
        assert len(layers) == 2 and all(len(heads) == 2 for heads in layers)  # 2 layers x 2 heads
        assert all(v is not None and np.isfinite(v) for heads in layers for v in heads), metric
    assert record["metrics"]["zero_fraction"] == [[0.0, 0.0], [0.0, 0.0]]  # softmax weights are never exactly 0
    assert 0 < record["summary"]["sink_mass"] < 1


def test_the_heatmaps_are_on_by_default_with_four_windows():
    cfg = compose_cfg(["paths.output_dir=/unused"])
    assert cfg.callbacks.attention_heatmaps.windows == 4
    assert cfg.callbacks.attention_heatmaps._target_ == "training.callbacks.attention_heatmaps.AttentionHeatmapsAtEnd"


@pytest.mark.parametrize("switch", [{"callbacks.attention_heatmaps.windows": 0}, {"callbacks.attention_heatmaps": "null"}])
def test_the_heatmaps_can_be_switched_off(tmp_path, switch):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    overrides = tiny_overrides(tmp_path, corpus, **{"train.max_steps": 2, "train.val_every": 2})
    overrides = [o for o in overrides if not o.startswith("callbacks.")] + [f"{k}={v}" for k, v in switch.items()]
    train.run(compose_cfg(overrides))
    assert not (tmp_path / "run" / "attention_heatmaps").exists()


def test_a_failure_is_a_warning_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    import training.callbacks.attention_heatmaps as heatmaps

    def broken(model, batches):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(heatmaps, "attention_statistics", broken)
    with caplog.at_level(logging.WARNING, logger="training.callbacks.attention_heatmaps"):
        results = run(tmp_path)
    assert results["steps"] == 2 and np.isfinite(results["val_loss"])
    assert "attention heatmaps skipped at step 2: RuntimeError: out of memory" in caplog.text
    assert not (tmp_path / "run" / "attention_heatmaps").exists()


def test_bad_windows_are_named():
    with pytest.raises(ValueError, match=r"callbacks\.attention_heatmaps\.windows must be an int >= 0, got -1"):
        AttentionHeatmapsAtEnd("run", windows=-1)


def test_wandb_offline_run_holds_the_heatmap_images(tmp_path):
    pytest.importorskip("wandb")
    run(tmp_path, logger="wandb")  # offline by default
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    images = sorted((runs[0] / "files" / "media" / "images" / "attention" / "heatmap").glob("*.png"))
    # wandb names a logged image <key's last part>_<its step>_<hash>.png
    assert sorted(p.name.rsplit("_", 2)[0] for p in images) == sorted(METRICS)


def test_tensorboard_gets_each_heatmap_as_an_rgb_image(tmp_path):
    """add_image with HWC float pixels in [0, 1]: what torch.utils.tensorboard's SummaryWriter takes
    (a stand-in writer here; test_optim_config runs the real logger when tensorboard is installed)."""
    callback = AttentionHeatmapsAtEnd(tmp_path)
    pngs = []
    for metric in ("sink_mass", "entropy"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(2, 2))
        ax.imshow(np.random.default_rng(0).random((3, 3)))
        pngs.append(tmp_path / f"step7.{metric}.png")
        fig.savefig(pngs[-1])
        plt.close(fig)
    added = []
    writer = SimpleNamespace(add_image=lambda tag, image, global_step, dataformats: added.append(
        (tag, image, global_step, dataformats)))
    TensorBoardLogger = type("TensorBoardLogger", (), {"experiment": writer})
    trainer = SimpleNamespace(global_step=7, loggers=[TensorBoardLogger()])
    callback._log_images(trainer, pngs)
    assert [(tag, step, fmt) for tag, _, step, fmt in added] == [
        ("attention/heatmap/sink_mass", 7, "HWC"), ("attention/heatmap/entropy", 7, "HWC")]
    for _, image, _, _ in added:
        assert image.ndim == 3 and image.shape[2] == 3 and np.isfinite(image).all() and 0 <= image.min() <= image.max() <= 1
