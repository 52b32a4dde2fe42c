"""Batches from a token shard: seeded random training windows and fixed evaluation windows.

Training: the GLOBAL batch at position s is G = batch_size * world_size windows of
`seq_len + 1` tokens whose start offsets are drawn, distinct, over all train tokens by a
generator seeded by (seed, s, G) alone. Rank r of world_size takes its contiguous share
[r * batch_size, (r + 1) * batch_size) of that global batch. So data-parallel ranks read
disjoint windows at every step, and a run on world_size devices with per-device batch b
trains on exactly the batches of a one-device run with batch world_size * b (the
gradients agree up to the reduction order). The stream has no hidden state besides the
position, so resuming at position s reproduces the uninterrupted run exactly, and any
batch can be recomputed for debugging.

Evaluation: contiguous, non-overlapping windows from the start of the split covering
min(token budget, split) predicted tokens. Window i has inputs tokens[i*L : (i+1)*L] and
targets one to the right. Rank r takes windows r, r + world_size, ...; the set of windows
(hence the tokens scored) does not depend on the number of devices.

Both are IterableDatasets yielding whole (x, y) batches (use DataLoader(batch_size=None)):
Lightning then leaves them alone instead of wrapping them in a DistributedSampler, and with
worker processes each worker takes every num_workers-th batch, which the DataLoader
interleaves back into the original order.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


class TokenFile:
    """A picklable handle on a token shard. Worker processes reopen the memmap instead of
    receiving a pickled copy of the whole array."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype | str, n_tokens: int):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.n_tokens = int(n_tokens)
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        if self._array is None:
            if self.n_tokens == 0:
                self._array = np.zeros(0, dtype=self.dtype)
            else:
                self._array = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._array

    def __len__(self) -> int:
        return self.n_tokens

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_array"] = None
        return state


def rank_slice(n_tokens: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi): the rank-th of world_size contiguous, disjoint, near-equal slices of n_tokens
    items (validates rank and world_size)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return n_tokens * rank // world_size, n_tokens * (rank + 1) // world_size


def global_window_starts(seed: int, position: int, global_batch: int, seq_len: int, n_tokens: int) -> np.ndarray:
    """Start offsets of the `global_batch` windows of the global training batch at
    `position`: a pure function of (seed, position, global_batch) over all `n_tokens`.
    The starts are distinct (drawn without replacement), so no two devices, and no two
    rows of one step, train on the same window."""
    n_starts = n_tokens - seq_len  # a window needs seq_len + 1 tokens: starts 0 .. n_tokens - seq_len - 1
    if n_starts < 1:
        raise ValueError(
            f"the train split has {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use a shorter seq_len (model.context) or more data"
        )
    if global_batch > n_starts:
        raise ValueError(
            f"a global batch of {global_batch} windows (batch_size x devices) needs as many distinct window "
            f"starts, but the train split of {n_tokens} tokens has only {n_starts} for seq_len={seq_len}; "
            "use a smaller batch or more data"
        )
    rng = np.random.default_rng([seed, position, global_batch])
    # Generator.choice without replacement samples a small batch from a large range in
    # O(batch) (Floyd's algorithm), so this stays cheap on billion-token shards.
    return rng.choice(n_starts, size=global_batch, replace=False).astype(np.int64, copy=False)


def train_window_starts(
    seed: int, position: int, rank: int, world_size: int, batch_size: int, seq_len: int, n_tokens: int
) -> np.ndarray:
    """Start offsets of `rank`'s `batch_size` windows at `position`: its contiguous share
    [rank * batch_size, (rank + 1) * batch_size) of the global batch of batch_size * world_size."""
    lo, hi = rank_slice(batch_size * world_size, rank, world_size)  # exactly [rank * b, (rank + 1) * b)
    return global_window_starts(seed, position, batch_size * world_size, seq_len, n_tokens)[lo:hi]


def gather_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (len(starts), seq_len); y is x shifted left by one."""
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    windows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _worker_share() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class TrainPosition:
    """The number of training batches consumed so far: the whole state of the sampler.
    Shared between the DataModule (which advances it) and the dataset (which starts from it
    each time a DataLoader iterator is created)."""

    def __init__(self, value: int = 0):
        self.value = int(value)


class TrainBatches(IterableDataset):
    """Endless seeded random windows; yields the batches at positions p, p+1, ... where p is
    `position.value` when iteration starts."""

    def __init__(
        self, tokens: TokenFile, seq_len: int, batch_size: int, seed: int, rank: int, world_size: int,
        position: TrainPosition,
    ):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.rank, self.world_size, self.position = rank, world_size, position
        # Fail at construction, not in a worker, if the split is too short for the global batch.
        train_window_starts(seed, 0, rank, world_size, batch_size, seq_len, len(tokens))

    def batch_at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = train_window_starts(
            self.seed, position, self.rank, self.world_size, self.batch_size, self.seq_len, len(self.tokens)
        )
        return gather_windows(self.tokens.array(), starts, self.seq_len)

    def __iter__(self):
        # Read the start now, not lazily at the first next(): the stream begins where
        # training stood when the iterator was created.
        worker, workers = _worker_share()
        return map(self.batch_at, itertools.count(self.position.value + worker, workers))


def eval_window_count(n_tokens: int, seq_len: int, token_budget: int) -> int:
    """Whole windows covering min(budget, split) predicted tokens (a window of L inputs
    needs L + 1 tokens)."""
    return min(token_budget, max(n_tokens - 1, 0)) // seq_len


class EvalWindows(IterableDataset):
    """Deterministic contiguous windows 0..n_windows-1; this rank takes every world_size-th,
    batched in order. When world_size does not divide n_windows, ranks differ by at most
    one window (no padding duplicates: every window is scored exactly once over all ranks)."""

    def __init__(self, tokens: TokenFile, seq_len: int, batch_size: int, n_windows: int, rank: int = 0, world_size: int = 1):
        rank_slice(n_windows, rank, world_size)  # validates rank / world_size
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.window_ids = np.arange(rank, n_windows, world_size, dtype=np.int64)

    def __len__(self) -> int:
        return math.ceil(len(self.window_ids) / self.batch_size)

    def __iter__(self):
        worker, workers = _worker_share()
        for batch_index in range(worker, len(self), workers):
            ids = self.window_ids[batch_index * self.batch_size : (batch_index + 1) * self.batch_size]
            yield gather_windows(self.tokens.array(), ids * self.seq_len, self.seq_len)
