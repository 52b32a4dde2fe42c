"""Progress bars of the long evaluations (eval/progress.py): drawn on a terminal, silent otherwise,
and fed the work actually done."""

import io

import numpy as np
import torch
from rich.console import Console

from eval.perplexity import score_tokens, scoring_windows
from data.progress import progress_bar, tracked


def test_bar_is_drawn_on_a_terminal_and_counts_to_the_total():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    assert list(tracked(range(5), "scoring", 5, console)) == [0, 1, 2, 3, 4]
    assert "5/5" in out.getvalue() and "scoring" in out.getvalue()


def test_no_bar_without_a_terminal():
    out = io.StringIO()
    with progress_bar("scoring", 3, Console(file=out, force_terminal=False)) as advance:
        advance(3)
    assert list(tracked(range(2), "x", 2, Console(file=out, force_terminal=False))) == [0, 1]
    assert out.getvalue() == ""


def test_perplexity_reports_every_window_once():
    tokens = np.arange(100) % 7
    seen = []
    vocab = 7

    def logits_fn(ids):
        return torch.zeros(*ids.shape, vocab)

    result = score_tokens(logits_fn, tokens, context=16, stride=8, batch_size=3, on_windows=seen.append)
    assert sum(seen) == result["windows"] == len(scoring_windows(len(tokens), 16, 8))
    assert max(seen) <= 3


def test_tokenizing_a_split_is_announced_with_its_count(tmp_path, caplog):
    import logging

    from data.datamodule import TokenDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of the corpus\n" for i in range(400)))
    dm = TokenDataModule(source={"kind": "text", "path": str(corpus), "val_fraction": 0.1, "test_fraction": 0.1},
                         tokenizer={"kind": "byte"}, cache_dir=str(tmp_path / "cache"), seq_len=16, batch_size=4,
                         val_tokens=1000, seed=0)
    with caplog.at_level(logging.INFO, logger="data.cache"):
        dm.prepare_data()
    messages = [r.getMessage() for r in caplog.records if r.name == "data.cache"]
    for split in ("train", "val", "test"):
        assert any(m.startswith(f"tokenizing the {split} split of") for m in messages), messages
        done = [m for m in messages if m.startswith(f"{split} split: ")]
        assert done and "tokens from" in done[0]
    dm.setup("fit")
    assert f"{dm.split_stats('train')['tokens']:,} tokens" in next(m for m in messages if m.startswith("train split: "))
