"""A run's output carries no third-party notices that say nothing about it (training/quiet_logs.py),
and DDP gets its buffer setting under the name the installed torch wants."""

import inspect
import warnings

import pytest
from train_helpers import compose_cfg, tiny_overrides, write_corpus

import training.ddp_strategy as ddp_strategy
from training.quiet_logs import IGNORED_WARNINGS, silence_third_party_notices

NOISE = ("💡 Tip", "anonymous setting has no effect", "LeafSpec", "`IterableDataset` has `__len__`", "Total FLOPs")


def test_a_wandb_run_prints_none_of_the_notices(tmp_path, capfd, caplog):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, logger="wandb", **{
            "train.max_steps": 2, "train.val_every": 2, "callbacks.attention_heatmaps.windows": 4})))
    printed = capfd.readouterr()
    text = printed.out + printed.err + caplog.text + "\n".join(str(w.message) for w in caught)
    assert "val loss" in printed.out  # the run's own summary is still there
    for notice in NOISE:
        assert notice not in text, notice


def test_filters_are_installed_once_and_match_the_warnings():
    silence_third_party_notices()
    silence_third_party_notices()
    import logging

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(type(f).__name__ == "_DropTips" for f in rank_zero.filters) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_third_party_notices()  # filters added after simplefilter take precedence
        warnings.warn("Your `IterableDataset` has `__len__` defined. In combination with ...", UserWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("an unrelated warning", UserWarning)
    assert [str(w.message) for w in caught] == ["an unrelated warning"]
    assert len(IGNORED_WARNINGS) == 2


def test_broadcast_buffers_is_renamed_where_torch_deprecates_it(monkeypatch):
    kwargs = {"broadcast_buffers": False, "bucket_cap_mb": 512}
    new_torch = "forward_sync_buffers" in inspect.signature(ddp_strategy.DistributedDataParallel).parameters
    got = ddp_strategy.ddp_buffer_kwargs(kwargs)
    assert got == ({"forward_sync_buffers": False, "bucket_cap_mb": 512} if new_torch else kwargs)
    assert kwargs == {"broadcast_buffers": False, "bucket_cap_mb": 512}  # the strategy's own dict unchanged

    class OldDDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=25):
            pass

    monkeypatch.setattr(ddp_strategy, "DistributedDataParallel", OldDDP)
    assert ddp_strategy.ddp_buffer_kwargs(kwargs) == kwargs


@pytest.mark.parametrize("value", [True, False])
def test_model_summary_stays_available_on_request(tmp_path, capfd, value):
    from training import train

    corpus = write_corpus(tmp_path / "corpus.txt", lines=400)
    train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{"train.max_steps": 1, "train.val_every": 1,
                                                                "+trainer.enable_model_summary": value})))
    assert ("Trainable params" in capfd.readouterr().out) is value
