"""`TokenDataModule`: the Lightning DataModule behind the `data=` config group.

    dm = TokenDataModule(source={"kind": "shakespeare", ...}, tokenizer={"kind": "bpe", "vocab_size": 2048},
                         cache_dir="~/.cache/attnlab", seq_len=256, batch_size=32, val_tokens=65536, seed=0)
    dm.prepare_data(); dm.setup()
    dm.vocab_size, dm.tokenizer.decode(...), dm.unigram_bpb("val"), dm.token_ids("val")

In the `data=` configs `tokenizer` is the option of the nested group configs/data/tokenizer/
(`data/tokenizer=char` switches it), and `tokenizer_per_kind` holds the corpus's own options per
kind, which those option files read (data/tokenizers.py lists the options of each kind).

prepare_data() (Lightning runs it once per node, on local rank 0) downloads / reads the
source, trains or loads the tokenizer and builds or verifies the token cache (full sha256
check). setup() (every rank) loads the tokenizer and memory-maps the shards after a cheap
size check; called alone in a single process it runs prepare_data() itself if needed.

Training stream and resume: the global batch at position s (batch_size x world_size windows)
is a pure function of (seed, s, global batch size); rank r yields its rows [r*b, (r+1)*b)
(see data/sampling.py). The position is the number
of train batches the training loop has consumed: under a Trainer it advances in
`on_after_batch_transfer` while `trainer.training` (once per batch the loop actually takes,
however far the DataLoader and Lightning's fetcher have prefetched; also correct with
worker processes); outside a Trainer it advances as the loader hands out batches.
`state_dict()` stores it and Lightning saves it in every checkpoint, so `fit(ckpt_path=...)`
continues with exactly the batch the uninterrupted run would have drawn. Caveats: a
LightningModule whose training_step takes `dataloader_iter` bypasses the transfer hooks
(the position would not advance), and resuming with a different seed, batch size,
seq_len or world size is allowed but replays different batches (a warning says so).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from data.cache import CacheInvalid, cache_directory, check_cache, ensure_token_cache, shard_path
from data.sampling import EvalWindows, TokenFile, TrainBatches, TrainPosition, eval_window_count
from data.sources import SPLITS, build_source
from data.stats import unigram_bpb, unigram_counts
from data.tokenizers import (
    Tokenizer, TokenizerNotCached, build_tokenizer, check_tokenizer_per_kind, parse_tokenizer_config,
)

logger = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """A Hydra DictConfig / ListConfig as plain (resolved) Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"data.{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class _CountingLoader:
    """Outside a Trainer: advances the train position as each batch is handed out."""

    def __init__(self, loader: DataLoader, position: TrainPosition):
        self.loader, self.position = loader, position

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            self.position.value += 1
            yield batch


class TokenDataModule(L.LightningDataModule):
    """Token windows from a cached, tokenized corpus. See the module docstring."""

    def __init__(
        self,
        source: Mapping[str, Any],
        tokenizer: Mapping[str, Any],
        cache_dir: str | os.PathLike,
        seq_len: int,
        batch_size: int,
        val_tokens: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        tokenizer_per_kind: Mapping[str, Any] | None = None,
        use_tokenizer: Tokenizer | None = None,
    ):
        super().__init__()
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.val_tokens = _check_int("val_tokens", val_tokens, 1)
        self.seed = _check_int("seed", seed, 0)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        if cache_dir is None or str(cache_dir) == "":
            raise ValueError("data.cache_dir must be a directory path")
        self.cache_dir = Path(os.path.expanduser(str(cache_dir)))
        self.source_config = _plain(source)
        self.tokenizer_config = parse_tokenizer_config(_plain(tokenizer))
        # read by the config files of configs/data/tokenizer/ (interpolations); checked here only
        self.tokenizer_per_kind = check_tokenizer_per_kind(_plain(tokenizer_per_kind))
        # evaluation passes a checkpoint's own tokenizer, used as it is (never trained again), so the
        # splits are tokenized exactly as in training even where `tokenizer` would now train another
        if use_tokenizer is not None and use_tokenizer.kind != self.tokenizer_config["kind"]:
            raise ValueError(f"data.tokenizer.kind is {self.tokenizer_config['kind']!r}, but the checkpoint's tokenizer "
                             f"(which resuming and evaluating a run tokenize with) is of kind {use_tokenizer.kind!r}: "
                             f"use the data config the run was trained with (data/tokenizer={use_tokenizer.kind})")
        self.use_tokenizer = use_tokenizer
        # Building the source validates data.source (kinds, options, local files exist) now,
        # before any training starts; it reads no data yet.
        self.source = build_source(self.source_config, self.cache_dir)

        self.tokenizer: Tokenizer | None = None
        self.vocab_size: int | None = None
        self.manifest: dict | None = None
        self.cache_path: Path | None = None
        self._shards: dict[str, TokenFile] = {}
        self._train_counts: np.ndarray | None = None
        self._position = TrainPosition(0)
        self._train_world_size: int | None = None

    # ------------------------------------------------------------------ preparation

    def _tokenizer(self, allow_training: bool) -> Tokenizer:
        if self.use_tokenizer is not None:
            return self.use_tokenizer
        return build_tokenizer(self.tokenizer_config, self.source, self.cache_dir, allow_training=allow_training)

    def tokenizer_without_training(self) -> Tokenizer | None:
        """The tokenizer this data module tokenizes with, where getting it trains nothing (byte,
        pretrained, one given, a trained one in the cache); None where prepare_data would train one."""
        try:
            return self._tokenizer(allow_training=False)
        except TokenizerNotCached:
            return None

    def prepare_data(self) -> None:
        ensure_token_cache(self.cache_dir, self.source, self._tokenizer(allow_training=True), verify_checksums=True)

    def setup(self, stage: str | None = None) -> None:
        if self.manifest is not None:
            return
        try:
            tokenizer = self._tokenizer(allow_training=False)
            directory = cache_directory(self.cache_dir, self.source, tokenizer)
            manifest = check_cache(directory, self.source, tokenizer, verify_checksums=False)
        except (TokenizerNotCached, CacheInvalid) as problem:
            rank, world_size = self._rank_and_world_size()
            if world_size > 1:
                raise RuntimeError(
                    f"rank {rank}: the data cache under {self.cache_dir} is not ready ({problem}). "
                    "prepare_data() runs on local rank 0 of each node before setup(); if nodes do not share "
                    "data.cache_dir, keep prepare_data_per_node=True"
                ) from None
            tokenizer = self._tokenizer(allow_training=True)
            directory, manifest = ensure_token_cache(self.cache_dir, self.source, tokenizer, verify_checksums=True)
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.cache_path = directory
        self._shards = {
            split: TokenFile(shard_path(directory, split), manifest["dtype"], manifest["splits"][split]["tokens"])
            for split in SPLITS
        }
        self._train_counts = None
        self.manifest = manifest
        logger.info(
            "data %s: %s tokens train / %s val / %s test, vocab %d, cache %s",
            self.source.slug(), *(manifest["splits"][s]["tokens"] for s in SPLITS), self.vocab_size, directory,
        )

    def _require_setup(self) -> dict:
        if self.manifest is None:
            raise RuntimeError("TokenDataModule: call prepare_data() and setup() first")
        return self.manifest

    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    @staticmethod
    def _check_split(split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")

    # ------------------------------------------------------------------ statistics

    def token_ids(self, split: str) -> np.ndarray:
        """Read-only memmap of all token ids of `split` (for strided perplexity etc.)."""
        self._check_split(split)
        self._require_setup()
        return self._shards[split].array()

    def split_stats(self, split: str) -> dict[str, int]:
        """{"tokens": token count, "bytes": UTF-8 bytes of the tokenized text} of `split`."""
        self._check_split(split)
        entry = self._require_setup()["splits"][split]
        return {"tokens": int(entry["tokens"]), "bytes": int(entry["bytes"])}

    def bytes_per_token(self, split: str) -> float:
        stats = self.split_stats(split)
        return stats["bytes"] / stats["tokens"]

    def unigram_bpb(self, split: str) -> float:
        """Bits per byte on `split` of the add-one smoothed unigram model fitted on the train
        split (the baseline a context-using model must beat; data/stats.py)."""
        self._check_split(split)
        self._require_setup()
        assert self.vocab_size is not None
        if self._train_counts is None:
            self._train_counts = unigram_counts(self.token_ids("train"), self.vocab_size)
        eval_counts = self._train_counts if split == "train" else unigram_counts(self.token_ids(split), self.vocab_size)
        return unigram_bpb(self._train_counts, eval_counts, self.split_stats(split)["bytes"])

    # ------------------------------------------------------------------ loaders

    def _loader(self, dataset) -> DataLoader:
        # batch_size=None: the datasets yield whole batches.
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory)

    def train_dataloader(self):
        self._require_setup()
        rank, world_size = self._rank_and_world_size()
        self._train_world_size = world_size
        dataset = TrainBatches(
            self._shards["train"], self.seq_len, self.batch_size, self.seed, rank, world_size, self._position
        )
        loader = self._loader(dataset)
        # Under a Trainer the position advances in on_after_batch_transfer (what the loop
        # really consumed); without one, as batches are handed out.
        return loader if self.trainer is not None else _CountingLoader(loader, self._position)

    def _eval_loader(self, split: str) -> DataLoader:
        self._require_setup()
        n_tokens = len(self._shards[split])
        n_windows = eval_window_count(n_tokens, self.seq_len, self.val_tokens)
        if n_windows == 0:
            raise ValueError(
                f"the {split} split has {n_tokens} tokens and data.val_tokens={self.val_tokens}: no window of "
                f"seq_len={self.seq_len} inputs (+1 target) fits; use a shorter seq_len (model.context) or raise "
                "val_tokens (train.val_tokens)"
            )
        rank, world_size = self._rank_and_world_size()
        return self._loader(EvalWindows(self._shards[split], self.seq_len, self.batch_size, n_windows, rank, world_size))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def eval_windows(self, split: str) -> int:
        """Number of evaluation windows of `split` (over all ranks)."""
        self._check_split(split)
        return eval_window_count(len(self._shards[split]), self.seq_len, self.val_tokens) if self._shards else 0

    # ------------------------------------------------------------------ resume state

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self._position.value += 1
        return batch

    @property
    def train_position(self) -> int:
        """Train batches consumed so far; the next batch drawn is the one at this position."""
        return self._position.value

    def state_dict(self) -> dict[str, Any]:
        return {
            "train_batches_consumed": self._position.value,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self._train_world_size or self._rank_and_world_size()[1],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        consumed = state_dict.get("train_batches_consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"TokenDataModule state: train_batches_consumed must be a non-negative int, got {consumed!r}")
        current = {"seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                   "world_size": self._rank_and_world_size()[1]}
        changed = {key: (state_dict.get(key), value) for key, value in current.items()
                   if key in state_dict and state_dict[key] != value}
        if changed:
            logger.warning(
                "resuming the data stream with changed settings %s (checkpoint, now): the batches after the resume "
                "differ from those of an uninterrupted run", changed,
            )
        self._position.value = consumed
