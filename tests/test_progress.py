"""Progress bars of the long evaluations (eval/progress.py): drawn on a terminal, silent otherwise,
and fed the work actually done."""

import io

import numpy as np
import torch
from rich.console import Console

from eval.perplexity import score_tokens, scoring_windows
from eval.progress import progress_bar, tracked


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
