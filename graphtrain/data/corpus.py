"""The embedded default corpus: the Python standard library source of the running interpreter.

Why: a trainer that runs out of the box needs text that is on every machine already. The stdlib
``.py`` files (about 31 MB for CPython 3.11) are real, varied, license-clean code and need no download.

The train/val split is by a stable hash (SHA-256) of each file's path relative to the stdlib root, so it
is the same on every machine with the same Python version, regardless of where Python is installed or
of the order the file system lists directories in. Third-party code (``site-packages``,
``dist-packages``) and anything inside a virtual environment (a directory holding ``pyvenv.cfg``) is
excluded: it differs between machines.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# About 2% of files (and, since file sizes are unrelated to path hashes, roughly 2% of bytes) go to val.
VAL_PER_10K = 200
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_val(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 10_000 < VAL_PER_10K


def _all_stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every stdlib .py file, sorted by relative path."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend into third-party code or virtual environments.
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _EXCLUDED_DIRS
            and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))
        ]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def default_corpus_files(split: str) -> list[Path]:
    """The default corpus files of one split ("train" or "val"), sorted by path relative to the root."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    root = stdlib_root()
    files = [path for rel, path in _all_stdlib_files(root) if _is_val(rel) == (split == "val")]
    if not files:
        raise FileNotFoundError(
            f"the default corpus has no .py files for split {split!r} under the stdlib directory "
            f"{root}; this Python installation ships no standard library source. Pass data paths "
            "explicitly (data.paths) instead."
        )
    return files


def corpus_fingerprint(files: list[Path]) -> str:
    """A hex digest of a file list: paths relative to the stdlib root (when inside it) and sizes.

    Used to key caches: adding, removing or changing the size of a file gives a new fingerprint, while
    a different install location of the same Python does not.
    """
    root = stdlib_root()
    h = hashlib.sha256()
    for path in files:
        try:
            name = path.relative_to(root).as_posix()
        except ValueError:
            name = path.resolve().as_posix()
        h.update(f"{name}\0{path.stat().st_size}\n".encode())
    return h.hexdigest()


def read_document(path: Path) -> str:
    """One file as one document; the few stdlib test files that are not UTF-8 get U+FFFD replacements."""
    return path.read_bytes().decode("utf-8", errors="replace")


def iter_default_documents(split: str) -> Iterator[str]:
    """The documents (one per non-empty file) of a default corpus split, in sorted path order."""
    for path in default_corpus_files(split):
        text = read_document(path)
        if text:
            yield text
