"""build_data: the trainer's entry point over text, token shards and the default corpus."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphtrain.data import DataBundle, build_data
from graphtrain.data.corpus import default_corpus_files, read_document
from graphtrain.data.holdout import is_held_out
from graphtrain.data.tokenizer import Tokenizer, load_tokenizer


def build(**kwargs: Any) -> DataBundle:
    args: dict[str, Any] = dict(
        paths=None,
        tokenizer_path=None,
        vocab_size=300,
        seq_len=16,
        micro_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        seed=0,
    )
    args.update(kwargs)
    return build_data(**args)


def documents_of(stream: np.ndarray, tok: Tokenizer) -> list[str]:
    """Decode a cached token stream back into its documents."""
    ends = np.flatnonzero(stream == tok.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(stream[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


@pytest.fixture
def corpus(tmp_path: Path, make_documents: Callable[..., list[str]]) -> tuple[Path, list[str]]:
    docs = make_documents(3000)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def test_text_with_holdout_and_cache_reuse(
    tmp_path: Path,
    corpus: tuple[Path, list[str]],
    tiny_tokenizer_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, docs = corpus
    cache = tmp_path / "cache"
    bundle = build(paths=[str(path)], tokenizer_path=str(tiny_tokenizer_path), cache_dir=cache)
    tok = bundle.tokenizer
    assert tok is not None and bundle.vocab_size_needed == tok.vocab_size == 300
    assert bundle.val is not None and bundle.val.seed != bundle.train.seed
    train_stream, val_stream = bundle.train.shards[0], bundle.val.shards[0]
    assert isinstance(train_stream, np.memmap)
    train_docs, val_docs = documents_of(train_stream, tok), documents_of(val_stream, tok)
    # Every document lands on exactly one side, in order; about 1% is held out.
    assert train_docs == [d for d in docs if not is_held_out(d)]
    assert val_docs == [d for d in docs if is_held_out(d)]
    assert 10 <= len(val_docs) <= 60
    td = next(bundle.train)
    assert td["input_ids"].shape == (2, 16)

    # A second build (another rank, a restart) loads the caches and never tokenizes.
    def no_encoding(*args: object) -> None:
        raise AssertionError("tokenized again although the cache exists")

    monkeypatch.setattr(Tokenizer, "encode_batch", no_encoding)
    again = build(paths=[str(path)], tokenizer_path=str(tiny_tokenizer_path), cache_dir=cache)
    np.testing.assert_array_equal(again.train.shards[0], train_stream)
    # No .lock files stay behind.
    assert sorted(p.suffix for p in cache.iterdir()) == [".npy", ".npy"]


def test_text_with_val_paths(
    tmp_path: Path, tiny_tokenizer_path: Path, make_documents: Callable[..., list[str]]
) -> None:
    for name, seed in (("train", 0), ("val", 1)):
        for i, doc in enumerate(make_documents(30, seed=seed)):
            (tmp_path / f"{name}{i:03d}.txt").write_text(doc)
    bundle = build(
        paths=[str(tmp_path / "train*.txt")],
        val_paths=[str(tmp_path / "val*.txt")],
        tokenizer_path=str(tiny_tokenizer_path),
        cache_dir=tmp_path / "cache",
    )
    tok = load_tokenizer(tiny_tokenizer_path)
    assert bundle.val is not None
    assert documents_of(bundle.val.shards[0], tok) == make_documents(30, seed=1)


def test_tokenizer_larger_than_model_vocab(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"300 tokens.*vocab_size is 256.*model\.vocab_size"):
        build(
            paths=[str(tmp_path / "a.txt")],
            tokenizer_path=str(tiny_tokenizer_path),
            vocab_size=256,
            cache_dir=tmp_path,
        )


def test_empty_text_data(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="no non-empty document"):
        build(
            paths=[str(tmp_path / "a.jsonl")],
            tokenizer_path=str(tiny_tokenizer_path),
            cache_dir=tmp_path,
        )
    assert not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".*tmp"))


def test_pretokenized_without_tokenizer(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 500, size=5000).astype(np.uint16)
    tokens[::7] = 3
    tokens[:2500].tofile(tmp_path / "s0.bin")
    np.save(tmp_path / "s1.npy", tokens[2500:])
    with pytest.warns(UserWarning, match="no document boundaries"):
        bundle = build(
            paths=[str(tmp_path / "s0.bin"), str(tmp_path / "s1.npy")],
            vocab_size=600,
            cache_dir=tmp_path,
        )
    assert bundle.tokenizer is None and bundle.train.eos_id is None
    assert bundle.vocab_size_needed == int(tokens.max()) + 1
    # The last 1% of tokens (at least one row) is held out.
    assert bundle.val is not None
    np.testing.assert_array_equal(np.concatenate(bundle.val.shards), tokens[-50:])
    np.testing.assert_array_equal(np.concatenate(bundle.train.shards), tokens[:-50])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bundle = build(
            paths=[str(tmp_path / "s1.npy")], eos_id=3, vocab_size=600, cache_dir=tmp_path
        )
    assert bundle.train.eos_id == 3
    with pytest.raises(ValueError, match=r"token id 49\d.*vocab_size=400"):
        build(paths=[str(tmp_path / "s1.npy")], eos_id=3, vocab_size=400, cache_dir=tmp_path)


def test_argument_errors_come_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        build(seq_len=1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="token_dtype"):
        build(token_dtype="int8", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_default_corpus_end_to_end(tmp_path: Path) -> None:
    """Trains the default tokenizer on the full stdlib corpus and tokenizes it (~15-40 s on 2 cores)."""
    bundle = build(vocab_size=1024, seq_len=256, micro_batch_size=4, cache_dir=tmp_path)
    assert bundle.tokenizer is not None and bundle.vocab_size_needed == 1024
    assert bundle.val is not None and bundle.train.num_windows > 50 * bundle.val.num_windows
    td = next(bundle.train)
    assert td["input_ids"].shape == (4, 256)
    # The val stream starts with the first val file, followed by eos.
    first = read_document(default_corpus_files("val")[0])
    ids = bundle.tokenizer.encode(first)
    stream = bundle.val.shards[0]
    assert stream[: len(ids) + 1].tolist() == [*ids, bundle.tokenizer.eos_id]
    assert bundle.tokenizer.decode(ids) == first
