"""The shared test inputs and guards do what the kernel tests rely on."""

import torch

from attn.masks import CANDIDATE, HISTORY, validate_segment_ids
from attn.testing import nan_poisoned_empty, random_segment_ids


def test_nan_poisoning_fills_floats_and_restores():
    real = torch.empty
    with nan_poisoned_empty():
        assert torch.isnan(torch.empty(3, 4)).all()
        assert torch.isnan(torch.empty_like(torch.zeros(2, dtype=torch.float16))).all()
        assert torch.empty(3, dtype=torch.int32).dtype == torch.int32  # integers untouched
    assert torch.empty is real


def test_random_segment_ids_are_valid_ranker_layouts():
    gen = torch.Generator().manual_seed(0)
    ids = random_segment_ids(5, 40, gen, min_history=10, max_history=20, padding_row=True)
    validate_segment_ids(ids, 5, 40)  # values and contiguity
    assert (ids[0, :13] == CANDIDATE).all() and (ids[0, 13:39] == HISTORY).all() and ids[0, 39] == 0
    assert (ids[-1] == 0).all()
    history = (ids[1:4] == HISTORY).sum(-1)
    assert ((history >= 10) & (history <= 20)).all()
    again = random_segment_ids(5, 40, torch.Generator().manual_seed(0), min_history=10, max_history=20, padding_row=True)
    assert torch.equal(ids, again)
