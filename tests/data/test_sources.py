"""Document sources: text formats, token shards, globs, and their errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphtrain.data.sources import iter_documents, load_token_shards


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_txt_one_document_per_file_glob_sorted(tmp_path: Path) -> None:
    for name, text in [("b.txt", "second"), ("a.txt", "first"), ("c.txt", ""), ("z.md", "no")]:
        (tmp_path / name).write_text(text)
    # Globs expand sorted; the empty file is skipped; entries keep their given order.
    assert list(iter_documents([str(tmp_path / "*.txt")])) == ["first", "second"]
    assert list(iter_documents([tmp_path / "b.txt", tmp_path / "a.txt"])) == ["second", "first"]


def test_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["one", "two\nlines", ""])
    with open(path, "a") as f:
        f.write("\n")  # blank lines are skipped
    assert list(iter_documents([str(path)])) == ["one", "two\nlines"]


@pytest.mark.parametrize(
    ("line", "message"),
    [("{broken", "not valid JSON"), ('{"txt": "x"}', '"text"'), ('{"text": 3}', '"text"')],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n' + line + "\n")
    docs = iter_documents([str(path)])
    assert next(docs) == "ok"
    with pytest.raises(ValueError, match=re.escape(f"{path}:3:") + ".*" + re.escape(message)):
        next(docs)


def test_jsonl_of_random_bytes_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "random.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' + bytes([0x80, 0xFE, 0x01, 0x8E]) * 50)
    docs = iter_documents([str(path)])
    assert next(docs) == "ok"
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not valid UTF-8 (byte 0x80")):
        next(docs)


def test_parquet_in_row_batches(tmp_path: Path) -> None:
    texts = [f"row {i}" for i in range(2500)]  # more than one 1024-row batch
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts, "n": list(range(2500))}), path, row_group_size=700)
    assert list(iter_documents([str(path)])) == texts


def test_parquet_errors(tmp_path: Path) -> None:
    no_column = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_column)
    with pytest.raises(ValueError, match=r"no_text\.parquet.*no column 'text'.*body"):
        list(iter_documents([str(no_column)]))
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["x", None]}), nulls)
    with pytest.raises(ValueError, match=r"nulls\.parquet.*row 1"):
        list(iter_documents([str(nulls)]))


def test_path_errors(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data\.csv.*unknown extension '\.csv'"):
        iter_documents([str(tmp_path / "data.csv")])
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.jsonl"):
        iter_documents([str(tmp_path / "nothing-*.jsonl")])
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        iter_documents([str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="is a directory"):
        iter_documents([str(tmp_path)])
    with pytest.raises(ValueError, match="paths is empty"):
        iter_documents([])
    with pytest.raises(TypeError, match="list"):
        iter_documents(str(tmp_path / "data.csv"))  # type: ignore[arg-type]
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt.*no non-empty document"):
        list(iter_documents([str(tmp_path / "empty.txt")]))
    np.save(tmp_path / "t.npy", np.arange(5))
    with pytest.raises(ValueError, match="mix"):
        iter_documents([str(tmp_path / "empty.txt"), str(tmp_path / "t.npy")])
    with pytest.raises(ValueError, match="pre-tokenized"):
        iter_documents([str(tmp_path / "t.npy")])


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_shards_are_little_endian_memmaps(tmp_path: Path, dtype: str) -> None:
    tokens = np.array([1, 2, 0, 65535, 7], dtype=np.dtype(dtype).newbyteorder("<"))
    tokens.tofile(tmp_path / "a.bin")
    (shard,) = load_token_shards([str(tmp_path / "*.bin")], dtype)
    assert isinstance(shard, np.memmap)
    np.testing.assert_array_equal(shard, tokens)


def test_npy_shards(tmp_path: Path) -> None:
    np.save(tmp_path / "b.npy", np.array([5, 6], dtype=np.int32))
    np.save(tmp_path / "a.npy", np.array([3, 4], dtype=np.uint16))
    shards = load_token_shards([str(tmp_path / "*.npy")])
    assert [s.tolist() for s in shards] == [[3, 4], [5, 6]]
    assert all(isinstance(s, np.memmap) for s in shards)


def test_token_shard_errors(tmp_path: Path) -> None:
    np.arange(3, dtype=np.uint16).tofile(tmp_path / "odd.bin")  # 6 bytes: not uint32
    with pytest.raises(ValueError, match=r"odd\.bin.*6 bytes.*uint32"):
        load_token_shards([str(tmp_path / "odd.bin")], "uint32")
    with pytest.raises(ValueError, match="int64"):
        load_token_shards([str(tmp_path / "odd.bin")], "int64")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.bin.*empty"):
        load_token_shards([str(tmp_path / "empty.bin")])
    np.save(tmp_path / "two_d.npy", np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"two_d\.npy.*1-D integer.*\(2, 2\)"):
        load_token_shards([str(tmp_path / "two_d.npy")])
    np.save(tmp_path / "float.npy", np.zeros(4))
    with pytest.raises(ValueError, match=r"float\.npy.*float64"):
        load_token_shards([str(tmp_path / "float.npy")])
    (tmp_path / "doc.txt").write_text("hi")
    with pytest.raises(ValueError, match="text file"):
        load_token_shards([str(tmp_path / "doc.txt")])
