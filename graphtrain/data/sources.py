"""Document sources for user data: text files to tokenize, or pre-tokenized token shards.

Each entry of ``paths`` is a file or a glob (``*``, ``?``, ``[...]``, ``**`` recursive); a glob expands
to its matches in sorted order, and entries are taken in the order given. The extension picks the
format:

- ``.txt``: one document per file (the whole file, UTF-8).
- ``.jsonl``: one JSON object per line with a string field ``"text"``; blank lines are skipped.
- ``.parquet``: a string column ``"text"``, read with pyarrow in row batches.
- ``.bin``: raw little-endian token ids, ``uint16`` or ``uint32`` (the caller says which).
- ``.npy``: a 1-D integer numpy array of token ids.

Text documents that are empty are skipped. In pre-tokenized shards, documents are separated by the
tokenizer's eos id; shards are memory-mapped, never read into memory. Text and token formats cannot
be mixed in one list. Bad input raises a ValueError / FileNotFoundError naming the file (and line).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32")
_PARQUET_BATCH_ROWS = 1024


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files named by ``paths`` (files or globs, globs sorted), checked to exist and have a known suffix."""
    if isinstance(paths, (str, Path)):
        raise TypeError(f"paths must be a list of files or globs, got the single value {paths!r}")
    if not paths:
        raise ValueError("paths is empty: give at least one data file or glob")
    files: list[Path] = []
    for value in paths:
        value = str(value)
        if glob.has_magic(value):
            matches = sorted(p for p in glob.glob(value, recursive=True) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(
                    f"the data glob {value!r} matches no files (looked in {os.getcwd()!r})"
                )
            files.extend(Path(p) for p in matches)
        elif Path(value).is_dir():
            raise ValueError(
                f"data path {value!r} is a directory; give files or a glob like '{value}/*.jsonl'"
            )
        elif not Path(value).is_file():
            raise FileNotFoundError(
                f"data file {value!r} does not exist (looked for {os.path.abspath(value)!r})"
            )
        else:
            files.append(Path(value))
    for path in files:
        if path.suffix not in TEXT_SUFFIXES + TOKEN_SUFFIXES:
            raise ValueError(
                f"data file {str(path)!r} has an unknown extension {path.suffix!r}; expected one of "
                f"{', '.join(TEXT_SUFFIXES + TOKEN_SUFFIXES)}"
            )
    return files


def is_pretokenized(files: Sequence[Path]) -> bool:
    """True if all files are token shards, False if all are text; mixing the two is an error."""
    token = [p for p in files if p.suffix in TOKEN_SUFFIXES]
    if token and len(token) != len(files):
        text = next(p for p in files if p.suffix in TEXT_SUFFIXES)
        raise ValueError(
            f"data paths mix pre-tokenized shards ({str(token[0])!r}) and text files "
            f"({str(text)!r}); use one kind per list"
        )
    return bool(token)


def _iter_txt(path: Path) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {str(path)!r} is not valid UTF-8: {e}") from e


def _iter_jsonl(path: Path) -> Iterator[str]:
    # Bytes, decoded line by line: a file that is not UTF-8 is then named with its line.
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{line_number}: not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}); a .jsonl file holds one JSON object per line, in UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not valid JSON: {e}") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f'{path}:{line_number}: expected a JSON object with a string field "text", '
                    f"got {line.strip()[:80]!r}"
                )
            yield record["text"]


def _iter_parquet(path: Path) -> Iterator[str]:
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        raise ValueError(f"data file {str(path)!r} is not a readable parquet file: {e}") from e
    if "text" not in parquet.schema_arrow.names:
        raise ValueError(
            f"parquet file {str(path)!r} has no column 'text'; its columns are "
            f"{parquet.schema_arrow.names}"
        )
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise ValueError(
                    f"parquet file {str(path)!r} row {row}: column 'text' holds {text!r}, not a string"
                )
            yield text
            row += 1


_READERS = {".txt": _iter_txt, ".jsonl": _iter_jsonl, ".parquet": _iter_parquet}


def iter_documents(paths: Sequence[str | Path]) -> Iterator[str]:
    """Yield the non-empty text documents of ``paths`` (files or globs of text formats), in order.

    Paths are expanded and checked before the first document is yielded. Raises ValueError if the
    paths name token shards, or (when exhausted) if they held no non-empty document at all.
    """
    files = expand_paths(paths)
    if is_pretokenized(files):
        raise ValueError(
            f"{str(files[0])!r} is a pre-tokenized shard; iter_documents reads only "
            f"{', '.join(TEXT_SUFFIXES)}"
        )
    return iter_file_documents(files)


def iter_file_documents(files: Sequence[Path]) -> Iterator[str]:
    """Yield the non-empty documents of already expanded text ``files``; error if there are none."""
    found = False
    for path in files:
        for text in _READERS[path.suffix](path):
            if text:
                found = True
                yield text
    if not found:
        raise ValueError(
            f"the data files {[str(p) for p in files][:5]} (of {len(files)}) hold no non-empty document"
        )


def load_token_shard(path: Path, dtype: str = "uint16") -> np.ndarray:
    """Memory-map one pre-tokenized shard as a 1-D integer array (``dtype`` applies to ``.bin`` only)."""
    path = Path(path)
    if path.suffix == ".bin":
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")
        le_dtype = np.dtype(dtype).newbyteorder("<")
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"token shard {str(path)!r} is empty")
        if size % le_dtype.itemsize:
            raise ValueError(
                f"token shard {str(path)!r} has {size} bytes, not a multiple of the {dtype} item "
                f"size {le_dtype.itemsize}; is the dtype right?"
            )
        return np.memmap(path, dtype=le_dtype, mode="r")
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r")
        except Exception as e:
            raise ValueError(f"token shard {str(path)!r} is not a readable .npy file: {e}") from e
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError(
                f"token shard {str(path)!r} must hold a 1-D integer array, got shape {array.shape} "
                f"dtype {array.dtype}"
            )
        if array.size == 0:
            raise ValueError(f"token shard {str(path)!r} is empty")
        return array
    raise ValueError(
        f"{str(path)!r} is not a token shard; expected one of {', '.join(TOKEN_SUFFIXES)}"
    )


def load_token_shards(paths: Sequence[str | Path], dtype: str = "uint16") -> list[np.ndarray]:
    """Memory-map every shard named by ``paths`` (files or globs of ``.bin`` / ``.npy``)."""
    files = expand_paths(paths)
    if not is_pretokenized(files):
        raise ValueError(
            f"{str(files[0])!r} is a text file; load_token_shards reads only {', '.join(TOKEN_SUFFIXES)}"
        )
    return [load_token_shard(p, dtype) for p in files]
