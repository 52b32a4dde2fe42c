"""Tokenizers: `byte`, `char`, `bpe` (trained on the train split) and `pretrained`.

Every tokenizer has `encode(text) -> list[int]`, `encode_batch(texts)`, `decode(ids) -> str`,
`vocab_size` and `hash`: a sha256 of everything that determines its output (vocabulary,
merges, rules), so a token cache built with one tokenizer is never read with another.

End of text: `end_of_text_id` is the id of `<|endoftext|>` where the tokenizer has one, and
`encode_documents(texts)` puts it after every document, so a window that spans two documents
sees the boundary (data/cache.py tokenizes the splits with it). Our trained BPE reserves it (it
is in every BPE vocabulary we train); pretrained tokenizers have it when their vocabulary does
(tiktoken's gpt2 has it, id 50256; an HF tokenizer.json when it declares `<|endoftext|>` a special
token). `byte` and `char` have none (all 256 byte ids are bytes; a char vocabulary is the train
split's characters): their documents are separated by the source's separator text only. The text
`<|endoftext|>` inside a document is encoded as plain text by every tokenizer, so a corpus cannot
forge a boundary; `decode` writes the token as `<|endoftext|>`.

Trained tokenizers (`char`, `bpe`) only ever see the train split, so nothing about the
held-out text leaks into the vocabulary. They are trained once and cached under
`<cache_dir>/tokenizers/`, keyed by a hash of the source fingerprint (which fixes the train
works / files), the tokenizer kind and its options (vocab size, ...).

`data.tokenizer` is chosen with `data/tokenizer=<kind>` (configs/data/tokenizer/<kind>.yaml); a data
config gives its corpus's options per kind under `data.tokenizer_per_kind`. Options per kind:
    byte:       (none)                      vocab 256, the UTF-8 bytes
    char:       (none)                      train-split characters + one <unk> id (last)
    bpe:        vocab_size, min_frequency=2, max_train_bytes=null
                byte-level BPE (GPT-2 style pre-tokenization) from HF `tokenizers`, with <|endoftext|>
    pretrained: name (a tiktoken encoding, e.g. gpt2; needs `pip install -e .[tiktoken]`
                and the encoding cached or network) or path (an HF `tokenizer.json`)

`tokenizer_record(tokenizer)` writes any of them as a plain dict (kind, vocab size, hash, a
format name and a JSON text); `tokenizer_from_record` rebuilds it from that dict alone, parsing
JSON only, and checks the rebuilt tokenizer's hash. Checkpoints and export folders carry it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from data.atomic import atomic_write_text, exclusive_lock
from data.sources import Source, stable_hash

logger = logging.getLogger(__name__)

TOKENIZER_KINDS = ("byte", "char", "bpe", "pretrained")
TOKENIZER_OPTIONS = {
    "byte": (),
    "char": (),
    "bpe": ("vocab_size", "min_frequency", "max_train_bytes"),
    "pretrained": ("name", "path"),
}
# Bump when training code changes in a way that changes its output, to retire old caches.
# (2: BPE vocabularies hold END_OF_TEXT)
TRAINED_TOKENIZER_VERSION = 2
UNKNOWN_CHAR = "\ufffd"
END_OF_TEXT = "<|endoftext|>"


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Tokenizer(ABC):
    kind: str

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def hash(self) -> str:
        """sha256 hex of everything that determines encode/decode."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @property
    def end_of_text_id(self) -> int | None:
        """The id of END_OF_TEXT, which encode_documents puts after every document; None: the
        tokenizer has no such token."""
        return None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_to_array(self, texts: Sequence[str]) -> np.ndarray:
        """The token ids of `texts`, concatenated, as int64 (the cache writer's fast path)."""
        encoded = self.encode_batch(texts)
        total = sum(len(ids) for ids in encoded)
        return np.fromiter((i for ids in encoded for i in ids), dtype=np.int64, count=total)

    def encode_documents(self, documents: Sequence[str]) -> np.ndarray:
        """The token ids of `documents` concatenated as int64, each document followed by
        end_of_text_id when the tokenizer has one (the token stream of a split)."""
        end = self.end_of_text_id
        if end is None:
            return self.encode_to_array(documents)
        encoded = self.encode_batch(documents)
        total = sum(len(ids) + 1 for ids in encoded)
        return np.fromiter((i for ids in encoded for i in (*ids, end)), dtype=np.int64, count=total)

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "hash": self.hash}

    @abstractmethod
    def hf_tokenizer(self):
        """The same tokenizer as a Hugging Face `tokenizers.Tokenizer` (same ids for every text; what
        an export's tokenizer.json holds for transformers' AutoTokenizer). It encodes special tokens
        written in the text as the special token, where `encode` encodes them as plain text."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, hash={self.hash[:12]})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text: vocab 256, no training, every text round-trips."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def hash(self) -> str:
        return _sha256_text("attnlab-byte-tokenizer-v1")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_to_array(self, texts: Sequence[str]) -> np.ndarray:
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        # A window can cut a multi-byte character; show it as U+FFFD instead of failing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def hf_tokenizer(self):
        """Byte-level BPE without merges: one token per byte, id = the byte."""
        return _byte_level_bpe({bytes([b]): b for b in range(256)}, [], pattern=None)


class CharTokenizer(Tokenizer):
    """One id per character seen in the train split (sorted by code point), plus a final
    <unk> id for characters that occur only in val/test."""

    kind = "char"

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars) or list(chars) != sorted(chars):
            raise ValueError("CharTokenizer chars must be unique and sorted by code point")
        if not chars:
            raise ValueError("CharTokenizer needs at least one character (is the train split empty?)")
        self.chars = chars
        self.unk_id = len(chars)
        self._code_points = np.array([ord(c) for c in chars], dtype=np.int64)

    @classmethod
    def fit(cls, texts: Iterable[str]) -> "CharTokenizer":
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls("".join(sorted(seen)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    @property
    def hash(self) -> str:
        return stable_hash({"kind": "char", "chars": self.chars})

    def encode_to_array(self, texts: Sequence[str]) -> np.ndarray:
        points = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.searchsorted(self._code_points, points)
        ids = np.minimum(ids, len(self.chars) - 1)
        known = self._code_points[ids] == points
        return np.where(known, ids, self.unk_id).astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_to_array([text]).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] if 0 <= i < self.unk_id else UNKNOWN_CHAR for i in (int(j) for j in ids))

    def to_json(self) -> str:
        return json.dumps({"format": "attnlab-char-tokenizer-v1", "chars": self.chars}, ensure_ascii=True)

    def hf_tokenizer(self):
        """A BPE without merges over the characters; the unknown id is written U+FFFD (as `decode` does)."""
        from tokenizers import Tokenizer as RustTokenizer, decoders, models

        unknown = UNKNOWN_CHAR if UNKNOWN_CHAR not in self.chars else "<unk>"
        vocab = {c: i for i, c in enumerate(self.chars)} | {unknown: self.unk_id}
        tokenizer = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unknown))
        tokenizer.decoder = decoders.Fuse()
        return tokenizer

    @classmethod
    def from_json(cls, text: str) -> "CharTokenizer":
        payload = json.loads(text)
        if payload.get("format") != "attnlab-char-tokenizer-v1":
            raise ValueError("not an attnlab char tokenizer file")
        return cls(payload["chars"])


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer`: our trained byte-level BPE (`kind="bpe"`) or a
    pretrained `tokenizer.json` (`kind="pretrained"`). Special tokens written in the text are
    encoded as plain text (`encode_special_tokens`, which tokenizer.json does not store)."""

    def __init__(self, tokenizer, kind: str):
        self.tokenizer = tokenizer
        self.kind = kind
        # Hash the canonical JSON (vocab, merges, normalizer, pre-tokenizer, decoder) so two
        # files that differ only in formatting get the same hash.
        self._hash = stable_hash(json.loads(tokenizer.to_str()))
        tokenizer.encode_special_tokens = True
        specials = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()
                    if token.special}
        self._end_of_text_id = specials.get(END_OF_TEXT)

    @property
    def end_of_text_id(self) -> int | None:
        return self._end_of_text_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def hash(self) -> str:
        return self._hash

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking; both run in parallel in Rust.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def hf_tokenizer(self):
        from tokenizers import Tokenizer as RustTokenizer

        return RustTokenizer.from_str(self.to_json())


class TiktokenTokenizer(Tokenizer):
    """A named tiktoken encoding (e.g. gpt2). Special tokens in the text are encoded as plain
    text (`encode_ordinary`), so a corpus cannot smuggle in control tokens."""

    kind = "pretrained"

    def __init__(self, encoding):
        self.encoding = encoding
        self._end_of_text_id = (encoding.encode_single_token(END_OF_TEXT)
                                if END_OF_TEXT in encoding.special_tokens_set else None)
        token_bytes = []
        for token_id in range(encoding.n_vocab):
            try:
                token_bytes.append(encoding.decode_single_token_bytes(token_id).hex())
            except KeyError:  # ids that some encodings leave unassigned
                token_bytes.append(None)
        self._hash = stable_hash(
            {"kind": "tiktoken", "name": encoding.name, "pattern": encoding._pat_str, "tokens": token_bytes}
        )

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def end_of_text_id(self) -> int | None:
        return self._end_of_text_id

    @property
    def hash(self) -> str:
        return self._hash

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids], errors="replace")

    def hf_tokenizer(self):
        """Byte-level BPE with the encoding's ranks as vocabulary, each rank's merge (the two tokens
        that byte-pair encoding joins into it) as merges in rank order, its split pattern and its
        special tokens."""
        ranks = self.encoding._mergeable_ranks
        merges = [_merge_of(ranks, token, rank) for token, rank in sorted(ranks.items(), key=lambda item: item[1])
                  if len(token) > 1]
        return _byte_level_bpe(ranks, merges, self.encoding._pat_str, self.encoding._special_tokens)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (byte-level BPE vocabularies are written in them)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte], extra = chr(256 + extra), extra + 1
    return alphabet


def _merge_of(ranks: Mapping[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    """The two tokens that byte-pair encoding with the ranks below `rank` joins into `token`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens")
    return parts[0], parts[1]


def _byte_level_bpe(ranks: Mapping[bytes, int], merges: list, pattern: str | None,
                    special_tokens: Mapping[str, int] | None = None):
    """A Hugging Face byte-level BPE: vocabulary `ranks` (token bytes -> id), `merges` (pairs of
    token bytes, by priority), text split by the regex `pattern` first (None: not split)."""
    from tokenizers import AddedToken, Regex, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_level_alphabet()

    def written(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    tokenizer = RustTokenizer(models.BPE(vocab={written(t): i for t, i in ranks.items()},
                                         merges=[(written(a), written(b)) for a, b in merges]))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = byte_level if pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    for name, token_id in sorted((special_tokens or {}).items(), key=lambda item: item[1]):
        tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if tokenizer.token_to_id(name) != token_id:
            raise ValueError(f"special token {name!r} has id {token_id}, not the next free id: no tokenizer.json for it")
    return tokenizer


# --------------------------------------------------------------------------- training


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> HFTokenizer:
    """Byte-level BPE: GPT-2 pre-tokenization, END_OF_TEXT as a special token (id 0), all 256
    bytes in the initial alphabet (so any text encodes without <unk> and decodes back exactly),
    merges learned up to `vocab_size` tokens in all (fewer if the corpus runs out of pairs seen
    `min_frequency` times)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END_OF_TEXT],
        show_progress=sys.stderr.isatty(),  # the trainer's own bar, on a terminal only
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer, kind="bpe")


def _train_texts(source: Source, max_bytes: int | None) -> Iterator[str]:
    """Train-split documents as they appear in the token stream (with the separator), up
    to `max_bytes` of UTF-8 (None: all). The first document is read before this returns: a
    source's first use (a download with pip's or the Hub's output, its log lines) comes before
    the tokenizer trainer draws its progress bar, not inside it."""
    texts = _train_text_stream(source, max_bytes)
    first = next(texts, None)
    return texts if first is None else itertools.chain([first], texts)


def _train_text_stream(source: Source, max_bytes: int | None) -> Iterator[str]:
    seen = 0
    for document in source.documents("train"):
        text = document + source.separator
        yield text
        seen += len(text.encode("utf-8"))
        if max_bytes is not None and seen >= max_bytes:
            return


# --------------------------------------------------------------------------- config


class TokenizerNotCached(RuntimeError):
    """A trained tokenizer is requested without permission to train it (setup on a rank
    other than the one that runs prepare_data)."""


def parse_tokenizer_config(cfg: Mapping[str, Any]) -> dict:
    """Validate `data.tokenizer`; returns a plain dict with defaults filled in."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"data.tokenizer must be a mapping with a 'kind' key, got {cfg!r}")
    kind = cfg.get("kind")
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"data.tokenizer.kind must be one of {list(TOKENIZER_KINDS)}, got {kind!r}")
    allowed = TOKENIZER_OPTIONS[kind]
    unknown = sorted(set(cfg) - {"kind", *allowed})
    if unknown:
        raise ValueError(
            f"data.tokenizer.{unknown[0]}: unknown option for tokenizer kind {kind!r}; allowed: {['kind', *allowed]}. "
            f"Switch tokenizers with data/tokenizer={kind} (configs/data/tokenizer/{kind}.yaml), which brings that "
            f"kind's options only; a data config gives its corpus's options under tokenizer_per_kind.<kind>"
        )
    parsed: dict[str, Any] = {"kind": kind}
    if kind == "bpe":
        vocab_size = cfg.get("vocab_size")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 257:
            raise ValueError(f"data.tokenizer.vocab_size must be an integer >= 257 (the 256 bytes and {END_OF_TEXT}) "
                             f"for kind 'bpe', got {vocab_size!r}")
        min_frequency = cfg.get("min_frequency", 2)
        if not isinstance(min_frequency, int) or min_frequency < 1:
            raise ValueError(f"data.tokenizer.min_frequency must be an integer >= 1, got {min_frequency!r}")
        max_train_bytes = cfg.get("max_train_bytes")
        if max_train_bytes is not None and (not isinstance(max_train_bytes, int) or max_train_bytes <= 0):
            raise ValueError(f"data.tokenizer.max_train_bytes must be a positive integer or null, got {max_train_bytes!r}")
        parsed.update(vocab_size=vocab_size, min_frequency=min_frequency, max_train_bytes=max_train_bytes)
    elif kind == "pretrained":
        name, path = cfg.get("name"), cfg.get("path")
        if (name is None) == (path is None):
            raise ValueError(
                "data.tokenizer: kind 'pretrained' needs exactly one of name (a tiktoken encoding such as gpt2) "
                "or path (an HF tokenizer.json)"
            )
        parsed.update(name=name, path=path)
    return parsed


def check_tokenizer_per_kind(per_kind: Mapping[str, Any] | None) -> dict:
    """Validate `data.tokenizer_per_kind` (a data config's options per tokenizer kind, which
    configs/data/tokenizer/<kind>.yaml reads): known kinds, each with options of its own kind
    only, so a misspelt option fails instead of being passed over."""
    if per_kind is None:
        return {}
    if not isinstance(per_kind, Mapping):
        raise ValueError(f"data.tokenizer_per_kind must be a mapping of tokenizer kind to options, got {per_kind!r}")
    checked = {}
    for kind, options in per_kind.items():
        if kind not in TOKENIZER_KINDS:
            raise ValueError(f"data.tokenizer_per_kind.{kind}: unknown tokenizer kind; allowed: {list(TOKENIZER_KINDS)}")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"data.tokenizer_per_kind.{kind} must be a mapping of options, got {options!r}")
        unknown = sorted(set(options) - set(TOKENIZER_OPTIONS[kind]))
        if unknown:
            raise ValueError(f"data.tokenizer_per_kind.{kind}.{unknown[0]}: unknown option for tokenizer kind "
                             f"{kind!r}; allowed: {list(TOKENIZER_OPTIONS[kind])}")
        checked[kind] = dict(options)
    return checked


def tokenizer_cache_path(cfg: dict, source: Source, cache_dir: str | os.PathLike) -> Path:
    """Where a trained tokenizer lives: keyed by the source (hence its train works / files),
    the tokenizer kind and its options."""
    key = stable_hash({"tokenizer": cfg, "source": source.fingerprint(), "version": TRAINED_TOKENIZER_VERSION})
    return Path(cache_dir) / "tokenizers" / f"{cfg['kind']}-{source.slug()}-{key[:16]}.json"


def _load_pretrained(cfg: dict) -> Tokenizer:
    if cfg["path"] is not None:
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(os.path.expanduser(str(cfg["path"])))
        if not path.is_file():
            raise ValueError(f"data.tokenizer.path: file not found: {str(cfg['path'])!r} (resolved to {path.resolve()})")
        return HFTokenizer(RustTokenizer.from_file(str(path)), kind="pretrained")
    try:
        import tiktoken
    except ImportError:
        raise ValueError(
            f"data.tokenizer.name={cfg['name']!r} needs tiktoken: pip install -e '.[tiktoken]'"
        ) from None
    try:
        encoding = tiktoken.get_encoding(cfg["name"])
    except ValueError as error:
        raise ValueError(f"data.tokenizer.name: {error}") from None
    except Exception as error:  # network errors while fetching the encoding files
        raise RuntimeError(
            f"data.tokenizer.name={cfg['name']!r}: tiktoken could not load the encoding ({type(error).__name__}: "
            f"{error}). It downloads the files on first use; offline, point TIKTOKEN_CACHE_DIR at a cache "
            "that has them, or use data.tokenizer.path with an HF tokenizer.json."
        ) from None
    return TiktokenTokenizer(encoding)


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_trained(path: Path, tokenizer: Tokenizer) -> None:
    """The tokenizer file and, beside it, the sha256 of its bytes (checked at every load)."""
    text = tokenizer.to_json()
    atomic_write_text(path, text)
    atomic_write_text(_digest_path(path), _sha256_text(text) + "\n")


def _read_trained(kind: str, path: Path) -> Tokenizer | None:
    """Load a cached trained tokenizer; None (with a warning) if the file is unusable or is not the
    file training wrote (an edit that keeps valid JSON would change tokenization silently, and the
    token cache, keyed by the tokenizer's hash, would fill with new entries)."""
    try:
        text = path.read_text(encoding="utf-8")
        digest = _digest_path(path)
        want = digest.read_text().strip() if digest.is_file() else None
        if want is None:  # no digest beside it (an older cache): trusted once, checked from now on
            atomic_write_text(digest, _sha256_text(text) + "\n")
        elif _sha256_text(text) != want:
            logger.warning("tokenizer cache %s is not the file training wrote (its sha256 differs from %s); "
                           "retraining", path, digest)
            return None
        if kind == "char":
            return CharTokenizer.from_json(text)
        from tokenizers import Tokenizer as RustTokenizer

        return HFTokenizer(RustTokenizer.from_str(text), kind="bpe")
    except Exception as error:  # corrupt JSON, truncated file, foreign format
        logger.warning("tokenizer cache %s is unreadable (%s); retraining", path, error)
        return None


def build_tokenizer(
    cfg: Mapping[str, Any], source: Source, cache_dir: str | os.PathLike, allow_training: bool = True
) -> Tokenizer:
    """The tokenizer for `data.tokenizer`. Trained kinds load from the cache or, when
    `allow_training`, train on the train split of `source` and cache the result."""
    cfg = parse_tokenizer_config(cfg)
    kind = cfg["kind"]
    if kind == "byte":
        return ByteTokenizer()
    if kind == "pretrained":
        return _load_pretrained(cfg)

    path = tokenizer_cache_path(cfg, source, cache_dir)
    if path.is_file():
        cached = _read_trained(kind, path)
        if cached is not None:
            return cached
    if not allow_training:
        raise TokenizerNotCached(f"trained tokenizer {path} is missing; run prepare_data() first")
    with exclusive_lock(path.with_suffix(".lock")):
        if path.is_file():  # another process finished training while we waited
            cached = _read_trained(kind, path)
            if cached is not None:
                return cached
        logger.info("training %s tokenizer on the train split of %s -> %s", kind, source.slug(), path)
        if kind == "char":
            tokenizer: Tokenizer = CharTokenizer.fit(_train_texts(source, None))
        else:
            tokenizer = train_bpe(_train_texts(source, cfg["max_train_bytes"]), cfg["vocab_size"], cfg["min_frequency"])
        _write_trained(path, tokenizer)
    return tokenizer


# --------------------------------------------------------------------------- records


# How a tokenizer is written into a checkpoint or an export folder: a plain dict of strings and
# ints (loads with weights_only=True; rebuilding it parses JSON only, it runs no code).
#   {"kind", "vocab_size", "hash", "format", "content"}
# `format` names how `content` (a JSON text) rebuilds the tokenizer:
TOKENIZER_FORMATS = (
    "attnlab-byte",      # BYTE_TOKENIZER_JSON: the 256 UTF-8 bytes, nothing to store
    "attnlab-char",      # CharTokenizer.to_json()
    "hf-tokenizers",     # a Hugging Face tokenizer.json (kind bpe or pretrained)
    "attnlab-tiktoken",  # a tiktoken encoding's pattern, ranks and special tokens
)
RECORD_KEYS = ("kind", "vocab_size", "hash", "format", "content")
BYTE_TOKENIZER_JSON = '{"format": "attnlab-byte-tokenizer-v1"}'


def _tiktoken_json(encoding) -> str:
    ranks = sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1])
    return json.dumps({
        "name": encoding.name,
        "pattern": encoding._pat_str,
        "ranks": [[token.hex(), rank] for token, rank in ranks],
        "special_tokens": dict(encoding._special_tokens),
    }, ensure_ascii=True)


def _tiktoken_from_json(text: str) -> "TiktokenTokenizer":
    import tiktoken

    payload = json.loads(text)
    encoding = tiktoken.Encoding(
        name=payload["name"],
        pat_str=payload["pattern"],
        mergeable_ranks={bytes.fromhex(token): int(rank) for token, rank in payload["ranks"]},
        special_tokens={str(k): int(v) for k, v in payload["special_tokens"].items()},
    )
    return TiktokenTokenizer(encoding)


def tokenizer_record(tokenizer: Tokenizer) -> dict:
    """Everything needed to rebuild `tokenizer` exactly, as plain strings and ints."""
    if isinstance(tokenizer, ByteTokenizer):
        fmt, content = "attnlab-byte", BYTE_TOKENIZER_JSON
    elif isinstance(tokenizer, CharTokenizer):
        fmt, content = "attnlab-char", tokenizer.to_json()
    elif isinstance(tokenizer, HFTokenizer):
        fmt, content = "hf-tokenizers", tokenizer.to_json()
    elif isinstance(tokenizer, TiktokenTokenizer):
        fmt, content = "attnlab-tiktoken", _tiktoken_json(tokenizer.encoding)
    else:
        raise TypeError(f"no record format for tokenizer type {type(tokenizer).__name__}")
    return {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "hash": tokenizer.hash,
            "format": fmt, "content": content}


def tokenizer_from_record(record: Mapping[str, Any], where: str) -> Tokenizer:
    """Rebuild a tokenizer from tokenizer_record's dict; the rebuilt tokenizer must have the
    recorded kind, vocabulary size and hash. Errors name `where` (the file it came from)."""
    if not isinstance(record, Mapping) or sorted(record) != sorted(RECORD_KEYS):
        keys = sorted(record) if isinstance(record, Mapping) else type(record).__name__
        raise ValueError(f"{where}: the tokenizer record must have exactly the keys {list(RECORD_KEYS)}, got {keys}")
    fmt, content = record["format"], record["content"]
    if fmt not in TOKENIZER_FORMATS:
        raise ValueError(f"{where}: unknown tokenizer format {fmt!r}; known: {sorted(TOKENIZER_FORMATS)}")
    if not isinstance(content, str):
        raise ValueError(f"{where}: the tokenizer content must be a string, got {type(content).__name__}")
    try:
        if fmt == "attnlab-byte":
            if json.loads(content) != json.loads(BYTE_TOKENIZER_JSON):
                raise ValueError(f"expected {BYTE_TOKENIZER_JSON}")
            tokenizer: Tokenizer = ByteTokenizer()
        elif fmt == "attnlab-char":
            tokenizer = CharTokenizer.from_json(content)
        elif fmt == "hf-tokenizers":
            from tokenizers import Tokenizer as RustTokenizer

            tokenizer = HFTokenizer(RustTokenizer.from_str(content), kind=str(record["kind"]))
        else:
            tokenizer = _tiktoken_from_json(content)
    except ImportError as error:
        raise ValueError(f"{where}: rebuilding its {fmt} tokenizer needs {error.name}: pip install -e '.[tiktoken]'") from None
    except Exception as error:  # malformed JSON or a foreign file
        raise ValueError(f"{where}: the {fmt} tokenizer content cannot be read ({type(error).__name__}: {error})") from None
    rebuilt = tokenizer.describe()
    wanted = {key: record[key] for key in ("kind", "vocab_size", "hash")}
    if rebuilt != wanted:
        raise ValueError(f"{where}: the tokenizer rebuilt from its content ({describe_tokenizer(rebuilt)}) is not the "
                         f"recorded one ({describe_tokenizer(wanted)})")
    return tokenizer


def describe_tokenizer(tokenizer: Tokenizer | Mapping[str, Any]) -> str:
    """kind, vocabulary size and hash in one line (for messages)."""
    info = tokenizer.describe() if isinstance(tokenizer, Tokenizer) else tokenizer
    return f"kind={info['kind']} vocab={info['vocab_size']} hash={str(info['hash'])[:16]}"
