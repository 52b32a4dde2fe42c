"""Corpus statistics: unigram token counts and the unigram bits-per-byte baseline.

The unigram baseline is the cross-entropy of a model that ignores context: p(t) is the
add-one smoothed frequency of token t in the TRAIN split,

    p(t) = (count_train(t) + 1) / (N_train + V),

and on an evaluation split with tokens t_1..t_n that encode B UTF-8 bytes

    unigram bpb = sum_i -log2 p(t_i) / B.

Bits per byte (not per token) makes models with different tokenizers comparable; a language
model that learns anything about context should land well below this number.
"""

from __future__ import annotations

import numpy as np

# Bincount in slices so a multi-GB memmap never becomes one int64 array in memory.
COUNT_CHUNK_TOKENS = 1 << 24


def unigram_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 counts of each id in [0, vocab_size)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), COUNT_CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + COUNT_CHUNK_TOKENS])
        counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    return counts


def unigram_log2_probs(train_counts: np.ndarray) -> np.ndarray:
    """log2 of the add-one smoothed unigram distribution fitted on `train_counts`."""
    vocab_size = len(train_counts)
    return np.log2(train_counts + 1.0) - np.log2(float(train_counts.sum()) + vocab_size)


def unigram_bits(train_counts: np.ndarray, eval_counts: np.ndarray) -> float:
    """Total bits the train-fitted unigram model spends on a split with `eval_counts`."""
    return float(-(eval_counts * unigram_log2_probs(train_counts)).sum())


def unigram_bpb(train_counts: np.ndarray, eval_counts: np.ndarray, eval_bytes: int) -> float:
    if eval_bytes <= 0:
        raise ValueError(f"eval_bytes must be positive, got {eval_bytes}")
    return unigram_bits(train_counts, eval_counts) / eval_bytes
