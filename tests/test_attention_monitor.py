"""The validation-time attention monitor (training/callbacks/attention_monitor.py): per-layer row statistics
and lambda logged at each validation equal what eval's attention statistics compute on the same
sequences from the checkpoint; the official TDA lambda (scalar_clamp) is logged per head."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

from runs.model import load_run
from eval.run_logs import metric_by_step
from models.attention_diagnostics import attention_statistics
from train_helpers import compose_cfg, tiny_overrides, write_corpus


@pytest.mark.parametrize("variant,extra", [("softmax", {}), ("diff_threshold", {"attn.lambda_mode": "scalar_clamp"})])
def test_logged_row_statistics_match_the_checkpoints_statistics(tmp_path, variant, extra):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    cfg = compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "attn": variant, "attn.backend": "reference", "train.max_steps": 4, "train.val_every": 4,
        "train.attention_stats_sequences": 3, **extra}))
    train.run(cfg)
    run_dir = tmp_path / "run"
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    x, _ = next(iter(dm.val_dataloader()))
    model = load_run(run_dir / "checkpoints" / "last.ckpt").model
    expected = attention_statistics(model, [x[:3]])["metrics"]
    for name in ("zero_fraction", "empty_rows", "surviving_keys", "sink_mass"):
        per_layer = []
        for i, heads in enumerate(expected[name]):
            logged = metric_by_step(run_dir, f"val/attn/{name}/layer{i}")
            assert sorted(logged) == [3], logged  # one validation, after the 4th step
            per_layer.append(sum(heads) / len(heads))
            assert logged[3] == pytest.approx(per_layer[-1], rel=1e-6, abs=1e-9), (name, i)
        assert metric_by_step(run_dir, f"val/attn/{name}")[3] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-6)
    if variant == "softmax":  # every visible weight is positive: nothing is zero, no row is empty
        assert metric_by_step(run_dir, "val/attn/zero_fraction")[3] == 0.0
        assert metric_by_step(run_dir, "val/attn/empty_rows")[3] == 0.0
    else:  # one learnable scalar per layer, the same for every head, near its 0.5 init after 4 steps
        for i, block in enumerate(model.blocks):
            want = float(block.attn.extras.lambda_scalar.clamp(0, 1))
            for h in range(2):
                assert metric_by_step(run_dir, f"val/lambda/layer{i}/head{h}")[3] == pytest.approx(want, rel=1e-6)
            assert abs(want - 0.5) < 0.05


def test_zero_sequences_turn_the_monitor_off_and_bad_values_are_named(tmp_path):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=600)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{
        "train.max_steps": 2, "train.val_every": 2, "train.attention_stats_sequences": 0})))
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        assert "val/attn/" not in f.readline()
    with pytest.raises(ValueError, match=r"train.attention_stats_sequences must be an int >= 0, got -1"):
        train.run(compose_cfg(tiny_overrides(tmp_path / "bad", corpus, **{"train.attention_stats_sequences": -1})))
