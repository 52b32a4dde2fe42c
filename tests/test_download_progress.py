"""Download progress: pip's own progress bar on a terminal, none elsewhere (data/pip_download.py),
and the hub's progress bars likewise (data/sources.py). subprocess.run and load_dataset are
stand-ins: nothing is downloaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from data import sources
from data.pip_download import pip_download


class Stream:
    """sys.stdout / sys.stderr as a terminal (or not) would be."""

    def __init__(self, terminal: bool):
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal

    def write(self, text):  # print() and logging may write to it
        return len(text)

    def flush(self):
        pass


def fake_pip(calls, returncode=0, stderr=""):
    def run(command, **kwargs):
        calls.append((command, kwargs))
        captured = kwargs.get("capture_output") or kwargs.get("stdout") == subprocess.PIPE
        return subprocess.CompletedProcess(command, returncode, "Collecting x\n" if captured else None, stderr)
    return run


@pytest.mark.parametrize("terminal", [True, False])
def test_pip_draws_its_progress_bar_on_a_terminal_only(terminal, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(subprocess, "run", fake_pip(calls))
    monkeypatch.setattr(sys, "stdout", Stream(terminal))
    pip_download(["--only-binary", ":all:"], ["pkg==1.0"], tmp_path, "pkg==1.0", "do it by hand")
    [(command, kwargs)] = calls
    assert command[command.index("--progress-bar") + 1] == ("on" if terminal else "off")
    assert command[1:4] == ["-m", "pip", "download"] and command[-3:] == ["-d", str(tmp_path), "pkg==1.0"]
    if terminal:  # pip's stdout (the bar) reaches the terminal; its errors are kept for the message
        assert kwargs == {"stderr": subprocess.PIPE, "text": True}
    else:
        assert kwargs == {"capture_output": True, "text": True}


@pytest.mark.parametrize("terminal", [True, False])
def test_a_failed_download_names_pip_s_last_words_either_way(terminal, monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "run", fake_pip([], returncode=1, stderr="ERROR: No route to host\n"))
    monkeypatch.setattr(sys, "stdout", Stream(terminal))
    with pytest.raises(RuntimeError, match=r"(?s)could not download pkg==1\.0 with pip \(exit code 1\)\. Without network "
                                           r"access, do it by hand\. pip said:\n.*ERROR: No route to host"):
        pip_download([], ["pkg==1.0"], tmp_path, "pkg==1.0", "do it by hand")


@pytest.mark.parametrize("terminal", [True, False])
def test_hub_progress_bars_show_on_a_terminal_only_and_settings_come_back(terminal, monkeypatch):
    import datasets
    from huggingface_hub import utils as hub_utils

    seen = []

    def fake_load_dataset(hub_id, config_name, split, streaming, revision):
        seen.append((datasets.are_progress_bars_disabled(), hub_utils.are_progress_bars_disabled()))
        return datasets.Dataset.from_dict({"text": ["a story."]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(sys, "stderr", Stream(terminal))
    datasets.enable_progress_bars()
    hub_utils.enable_progress_bars()
    source = sources.build_source({"kind": "hub", "hub_id": "someone/stories", "splits": {"train": "train",
                                   "val": "train", "test": "train"}}, "/unused")
    assert list(source.documents("val")) == ["a story."]
    assert seen == [(not terminal, not terminal)]
    # the user's settings afterwards, whatever they were
    assert not datasets.are_progress_bars_disabled() and not hub_utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    list(source.documents("test"))
    assert datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars()
