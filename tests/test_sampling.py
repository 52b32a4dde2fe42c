"""data/sampling.py by hand: window shapes at odd lengths, the evaluation window count at its
boundaries, and evaluation batches that cover every window exactly once with the length they
announce (gaps found by a cosmic-ray run over this module, docs/results/mutation_check.md)."""

from __future__ import annotations

import numpy as np
import pytest

from data.sampling import EvalWindows, TokenFile, eval_window_count, gather_windows


def token_file(tmp_path, n_tokens: int) -> TokenFile:
    path = tmp_path / "tokens.bin"
    np.arange(n_tokens, dtype=np.uint16).tofile(path)
    return TokenFile(path, np.uint16, n_tokens)


@pytest.mark.parametrize("seq_len", [1, 4, 5, 7])
def test_windows_have_seq_len_inputs_and_the_next_tokens_as_targets(seq_len):
    tokens = np.arange(100, dtype=np.uint16)
    x, y = gather_windows(tokens, np.array([0, 3, 50]), seq_len)
    assert x.shape == y.shape == (3, seq_len)
    assert x[1].tolist() == list(range(3, 3 + seq_len)) and y[1].tolist() == list(range(4, 4 + seq_len))


def test_eval_window_count_needs_one_token_past_each_window():
    # n tokens hold (n - 1) // L whole windows of L inputs plus their targets, within the budget
    assert eval_window_count(n_tokens=40, seq_len=8, token_budget=1000) == 4  # 39 predicted tokens
    assert eval_window_count(n_tokens=41, seq_len=8, token_budget=1000) == 5
    assert eval_window_count(n_tokens=41, seq_len=8, token_budget=16) == 2
    assert eval_window_count(n_tokens=41, seq_len=8, token_budget=15) == 1
    assert eval_window_count(n_tokens=1, seq_len=8, token_budget=1000) == 0
    assert eval_window_count(n_tokens=0, seq_len=8, token_budget=1000) == 0


@pytest.mark.parametrize("n_windows,batch_size,world_size", [(10, 3, 1), (10, 5, 1), (7, 2, 3), (1, 4, 1), (9, 1, 2)])
def test_eval_batches_cover_each_window_once_and_len_is_their_number(tmp_path, n_windows, batch_size, world_size):
    seq_len = 5
    tokens = token_file(tmp_path, n_windows * seq_len + 1)
    seen = []
    for rank in range(world_size):
        dataset = EvalWindows(tokens, seq_len, batch_size, n_windows, rank, world_size)
        batches = list(dataset)
        assert len(batches) == len(dataset), (rank, len(batches), len(dataset))
        assert all(0 < len(x) <= batch_size for x, _ in batches)
        seen += [int(row[0]) // seq_len for x, _ in batches for row in x]
    assert sorted(seen) == list(range(n_windows))


def test_rank_slice_bounds_and_refusals():
    from data.sampling import rank_slice

    assert [rank_slice(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    for rank, world_size in ((-1, 2), (2, 2), (0, 0)):
        with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
            rank_slice(10, rank, world_size)


def test_a_split_of_exactly_one_window_gives_that_window_and_an_empty_file_no_tokens(tmp_path):
    from data.sampling import global_window_starts

    assert global_window_starts(seed=0, position=3, global_batch=1, seq_len=8, n_tokens=9).tolist() == [0]
    assert len(TokenFile(tmp_path / "absent.bin", np.uint16, 0).array()) == 0
