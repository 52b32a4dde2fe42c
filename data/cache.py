"""The token cache: each split tokenized once into a flat memmap shard plus a manifest.

Layout, under `<cache_dir>/tokens/<source>-<tokenizer>-<key>/`:

    train.bin  val.bin  test.bin   token ids, native byte order, uint16 (vocab < 65536) or uint32
    manifest.json                  written last; its presence marks a complete cache

A split's token stream is its documents in order, each with the source's separator text as its
tail and then, when the tokenizer has one and the source's rows are whole documents
(Source.rows_are_documents), the end-of-text token (Tokenizer.encode_documents):
`doc1 sep <|endoftext|> doc2 sep <|endoftext|> ...`. The directory key hashes the source
fingerprint, the tokenizer hash and FORMAT_VERSION, so changing any of them builds a new cache
next to the old one. The manifest records the source description, the tokenizer (kind, hash,
vocab size), the end-of-text id put after each document (null: none), the dtype and, per split, the token count
(end-of-text tokens included), the UTF-8 byte count of the tokenized text (documents plus
separators, the end-of-text token adds none; the denominator of bits-per-byte) and the sha256
of the shard.

Every file is written atomically (temp file in the same directory, fsync, os.replace) and
the manifest goes last, so a crash mid-build leaves shards without a manifest. On load the
manifest is checked against the shards (size, and sha256 when verifying); a partial,
truncated or corrupted cache is logged with a warning and rebuilt.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data.atomic import atomic_write_text, atomic_writer, exclusive_lock, remove_stale_temp_files, sha256_file
from data.progress import progress_bar
from data.sources import SPLITS, Source, stable_hash
from data.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# 2: documents are followed by the tokenizer's end-of-text token (when it has one), and special-token
# text inside documents is encoded as plain text
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
# Documents are tokenized in groups of about this many UTF-8 bytes: large enough for the
# Rust tokenizers' batch parallelism, small enough to bound memory on huge corpora.
ENCODE_CHUNK_BYTES = 8 << 20


class CacheInvalid(RuntimeError):
    """The token cache is absent or does not match its manifest."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def cache_key(source: Source, tokenizer: Tokenizer) -> str:
    return stable_hash({"source": source.fingerprint(), "tokenizer": tokenizer.hash, "format": FORMAT_VERSION})


def cache_directory(cache_dir: str | os.PathLike, source: Source, tokenizer: Tokenizer) -> Path:
    name = f"{source.slug()}-{tokenizer.kind}{tokenizer.vocab_size}-{cache_key(source, tokenizer)[:16]}"
    return Path(cache_dir) / "tokens" / name


def shard_path(directory: Path, split: str) -> Path:
    return directory / f"{split}.bin"


def _expected_identity(source: Source, tokenizer: Tokenizer) -> dict:
    return {"format_version": FORMAT_VERSION, "source_key": stable_hash(source.fingerprint()), "tokenizer_hash": tokenizer.hash}


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        leftovers = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        if leftovers:
            raise CacheInvalid(f"partial cache: {MANIFEST_NAME} is missing next to {leftovers}")
        raise CacheInvalid("no cache yet")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CacheInvalid(f"{MANIFEST_NAME} is unreadable ({error})") from None
    if not isinstance(manifest, dict):
        raise CacheInvalid(f"{MANIFEST_NAME} is not a JSON object")
    return manifest


def check_cache(directory: Path, source: Source, tokenizer: Tokenizer, verify_checksums: bool = True) -> dict:
    """Return the manifest if the cache in `directory` is complete and intact, else raise
    CacheInvalid with the reason. Sizes are always checked; sha256 when `verify_checksums`."""
    manifest = read_manifest(directory)
    expected = _expected_identity(source, tokenizer)
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise CacheInvalid(f"manifest {key} is {manifest.get(key)!r}, expected {value!r}")
    try:
        itemsize = np.dtype(manifest["dtype"]).itemsize
        splits = manifest["splits"]
        entries = {split: splits[split] for split in SPLITS}
    except (KeyError, TypeError) as error:
        raise CacheInvalid(f"manifest is missing a field ({error})") from None
    for split, entry in entries.items():
        path = shard_path(directory, split)
        if not path.is_file():
            raise CacheInvalid(f"shard {path.name} is missing")
        expected_bytes = int(entry["tokens"]) * itemsize
        actual_bytes = path.stat().st_size
        if actual_bytes != expected_bytes:
            raise CacheInvalid(
                f"shard {path.name} has {actual_bytes} bytes, the manifest says {expected_bytes} (truncated or overwritten)"
            )
        if verify_checksums and sha256_file(path) != entry["sha256"]:
            raise CacheInvalid(f"shard {path.name} fails its sha256 checksum (corrupted)")
        # a shard rewritten with its manifest passes the checksum: ids the model has no embedding for
        # would fail deep in training (an IndexError on CPU, a device assert on a GPU)
        largest = int(np.memmap(path, dtype=manifest["dtype"], mode="r").max()) if verify_checksums and expected_bytes else 0
        if largest >= tokenizer.vocab_size:
            raise CacheInvalid(f"shard {path.name} holds token ids outside [0, {tokenizer.vocab_size}) (the tokenizer's "
                               "vocabulary)")
    return manifest


def _document_chunks(documents: Iterable[str], separator: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for document in documents:
        text = document + separator
        chunk.append(text)
        size += len(text)
        if size >= ENCODE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_shard(path: Path, source: Source, split: str, tokenizer: Tokenizer, dtype: np.dtype) -> dict:
    """Tokenize `split` into `path` (atomically), streaming: memory stays bounded by one
    chunk however large the split. Returns the manifest entry."""
    digest = hashlib.sha256()
    tokens = byte_count = documents = nonempty_documents = 0
    cap = source.max_tokens(split)
    started = time.perf_counter()
    logger.info("tokenizing the %s split of %s%s", split, source.slug(), f" (up to {cap:,} tokens)" if cap else "")
    with atomic_writer(path) as handle, progress_bar(f"tokenizing {split}", cap) as advance:
        for chunk in _document_chunks(source.documents(split), source.separator):
            ids = tokenizer.encode_documents(chunk) if source.rows_are_documents else tokenizer.encode_to_array(chunk)
            advance(int(ids.size))
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise ValueError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size}) for split {split!r}")
            payload = ids.astype(dtype).tobytes()
            handle.write(payload)
            digest.update(payload)
            tokens += int(ids.size)
            byte_count += sum(len(text.encode("utf-8")) for text in chunk)
            documents += len(chunk)
            # rows that were empty (or became empty after filtering) add only separators
            nonempty_documents += sum(len(text) > len(source.separator) for text in chunk)
            # The cap is checked per chunk so documents stay whole: the split may exceed
            # it by at most one chunk.
            if cap is not None and tokens >= cap:
                break
        if tokens == 0 or nonempty_documents == 0:
            raise ValueError(
                f"the {split} split of data source {source.slug()!r} is empty (no document with text); "
                "check data.source (held-out works, files, fractions, text column)"
            )
    logger.info("%s split: %s tokens from %s documents in %.1f s", split, f"{tokens:,}", f"{documents:,}",
                time.perf_counter() - started)
    return {"file": path.name, "tokens": tokens, "bytes": byte_count, "documents": documents, "sha256": digest.hexdigest()}


def build_cache(directory: Path, source: Source, tokenizer: Tokenizer) -> dict:
    """Tokenize all splits into `directory` and write the manifest last."""
    directory.mkdir(parents=True, exist_ok=True)
    # Remove the manifest first: if this build dies, the directory reads as partial.
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    remove_stale_temp_files(directory)
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {split: _write_shard(shard_path(directory, split), source, split, tokenizer, dtype) for split in SPLITS}
    manifest = {
        **_expected_identity(source, tokenizer),
        "source": source.describe(),
        "tokenizer": tokenizer.describe(),
        "end_of_text_id": tokenizer.end_of_text_id if source.rows_are_documents else None,
        "dtype": dtype.name,
        "separator": source.separator,
        "splits": splits,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_text(directory / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def ensure_token_cache(
    cache_dir: str | os.PathLike, source: Source, tokenizer: Tokenizer, verify_checksums: bool = True
) -> tuple[Path, dict]:
    """Return (directory, manifest) of a valid cache, building or rebuilding it if needed.
    A cache that exists but fails the check is rebuilt with a warning naming the reason."""
    directory = cache_directory(cache_dir, source, tokenizer)
    try:
        return directory, check_cache(directory, source, tokenizer, verify_checksums)
    except CacheInvalid:
        pass
    with exclusive_lock(directory.with_name(directory.name + ".lock")):
        try:  # a concurrent job may have built it while we waited for the lock
            return directory, check_cache(directory, source, tokenizer, verify_checksums)
        except CacheInvalid as problem:
            if directory.is_dir() and any(directory.iterdir()):
                logger.warning("token cache %s is invalid: %s; rebuilding", directory, problem)
            else:
                logger.info("building token cache %s", directory)
        try:
            manifest = build_cache(directory, source, tokenizer)
        finally:
            source.release()
    return directory, manifest


def open_shard(directory: Path, manifest: dict, split: str) -> np.memmap:
    """Read-only memmap of a split's token ids."""
    entry = manifest["splits"][split]
    dtype = np.dtype(manifest["dtype"])
    if entry["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(shard_path(directory, split), dtype=dtype, mode="r", shape=(int(entry["tokens"]),))
