"""The tier choice between the portable kernels and the Gluon sm_90 ones (attn/kernels/tiers.py), on the
CPU: the ATTNLAB_GLUON switch, the timed choice per tuning key, and that nothing picks Gluon where it
cannot run. tests/test_gluon_gpu.py runs the Gluon tier itself on a Hopper GPU."""

from __future__ import annotations

import pytest
import torch
from attn.kernels import runtime, tiers


def _impls(log):
    return (lambda *args: log.append(("portable", args)) or "portable-result",
            lambda *args: log.append(("gluon", args)) or "gluon-result")


@pytest.fixture
def fake_timer(monkeypatch):
    """Timing that reports a fixed time per implementation (by the name its call logs)."""
    times = {}

    def median_ms(fn):
        before = len(calls)
        fn()
        return times[calls[before][0]]

    calls = []
    monkeypatch.setattr(runtime, "median_ms", median_ms)
    return times, calls


def test_switch_values(monkeypatch):
    monkeypatch.delenv(tiers.GLUON_ENV, raising=False)
    assert tiers.gluon_mode() == tiers.GLUON_DEFAULT
    for value in tiers.GLUON_MODES:
        monkeypatch.setenv(tiers.GLUON_ENV, value)
        assert tiers.gluon_mode() == value
    monkeypatch.setenv(tiers.GLUON_ENV, "yes")
    with pytest.raises(ValueError, match="ATTNLAB_GLUON must be one of"):
        tiers.gluon_mode()


@pytest.mark.parametrize("mode,expected", [("0", "portable-result"), ("1", "gluon-result")])
def test_forced_tier_runs_without_timing(mode, expected, monkeypatch, fake_timer):
    monkeypatch.setenv(tiers.GLUON_ENV, mode)
    _, calls = fake_timer
    portable, gluon = _impls(calls)
    choice = tiers.TierChoice("kernel")
    assert choice.pick(("key",), portable, gluon, (1,))(1) == expected
    assert choice.timings == {} and len(calls) == 1


@pytest.mark.parametrize("portable_ms,gluon_ms,winner", [(1.0, 0.8, "gluon"), (0.5, 0.9, "portable")])
def test_auto_times_each_key_once_and_keeps_the_faster(portable_ms, gluon_ms, winner, monkeypatch, fake_timer):
    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    times, calls = fake_timer
    times.update(portable=portable_ms, gluon=gluon_ms)
    portable, gluon = _impls(calls)
    choice = tiers.TierChoice("kernel")
    assert choice.pick(("a",), portable, gluon, (7,))(7) == f"{winner}-result"
    assert choice.timings[("a",)] == {"portable": portable_ms, "gluon": gluon_ms}
    assert choice.chosen == {("a",): winner}
    timed_calls = len(calls)
    assert all(args == (7,) for _, args in calls)  # timed on the call's own arguments
    choice.pick(("a",), portable, gluon, (7,))(7)
    assert len(calls) == timed_calls + 1 and len(choice.timings) == 1  # remembered, not timed again
    choice.pick(("b",), portable, gluon, (8,))
    assert set(choice.timings) == {("a",), ("b",)}
    assert winner in next(iter(choice.report().values()))


def test_pinned_configs_keep_the_portable_tier_untimed(monkeypatch, fake_timer):
    monkeypatch.setenv(tiers.GLUON_ENV, "auto")
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    _, calls = fake_timer
    portable, gluon = _impls(calls)
    choice = tiers.TierChoice("kernel")
    assert choice.pick(("a",), portable, gluon, ())() == "portable-result"
    assert choice.chosen == {} and choice.timings == {}


def test_gluon_never_usable_off_a_cuda_device_or_under_the_interpreter(monkeypatch):
    assert not tiers.gluon_usable(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not tiers.gluon_usable(torch.device("cuda", 0))  # decided before any CUDA query


def test_softmax_plans_read_the_switch(monkeypatch):
    """A changed ATTNLAB_GLUON takes effect at the next call: the forward's plans key on it."""
    from attn.kernels import softmax_family as sf

    assert tiers.GLUON_ENV in sf._FWD_PLANS.settings
