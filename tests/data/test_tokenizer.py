"""Tokenizer wrapper, user tokenizer loading, and the cached default BPE."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers

from graphtrain.data import tokenizer as tokenizer_module
from graphtrain.data.cache import build_cached
from graphtrain.data.tokenizer import (
    EOS_TOKEN,
    Tokenizer,
    default_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "  leading spaces and unicode: caf\u00e9 \u2603 \U0001f600\n",
    "a literal <|endoftext|> inside data is plain text",
    "",
]


def test_round_trip_and_eos(tiny_tokenizer: Tokenizer) -> None:
    tok = tiny_tokenizer
    assert tok.eos_id == 0 and tok.vocab_size == 300
    assert tok.decode([tok.eos_id]) == EOS_TOKEN
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
        # Data text never produces the document separator.
        assert tok.eos_id not in ids
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_training_is_deterministic(make_documents: Callable[..., list[str]]) -> None:
    docs = make_documents(100, seed=1)
    a = train_bpe_tokenizer(docs, vocab_size=280).to_str()
    b = train_bpe_tokenizer(iter(docs), vocab_size=280).to_str()
    assert a == b


def test_default_tokenizer_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_documents: Callable[..., list[str]]
) -> None:
    files = []
    for i, text in enumerate(make_documents(50)):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(text)
    cache = tmp_path / "cache"
    tok = default_tokenizer(290, cache_dir=cache, files=files)
    assert tok.vocab_size == 290 and tok.path is not None and tok.path.parent == cache
    assert "-v290-" in tok.path.name and tok.path.name.startswith("tokenizer-py3")
    mtime = tok.path.stat().st_mtime_ns

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained although the cache exists")

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", no_training)
    again = default_tokenizer(290, cache_dir=cache, files=files)
    assert again.path == tok.path and again.fingerprint == tok.fingerprint
    assert tok.path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [
        tok.path.name
    ]
    # Another vocab size or file list is another cache entry.
    with pytest.raises(AssertionError, match="retrained"):
        default_tokenizer(291, cache_dir=cache, files=files)
    with pytest.raises(AssertionError, match="retrained"):
        default_tokenizer(290, cache_dir=cache, files=files[:-1])
    with pytest.raises(ValueError, match="at least 257"):
        default_tokenizer(100, cache_dir=cache, files=files)


def test_load_tokenizer_errors(tmp_path: Path, make_documents: Callable[..., list[str]]) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        load_tokenizer(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json"):
        load_tokenizer(broken)
    # A valid tokenizer without any end-of-document token.
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=270, special_tokens=["<pad>"])
    hf.train_from_iterator(make_documents(20), trainer)
    no_eos = tmp_path / "no_eos.json"
    hf.save(str(no_eos))
    with pytest.raises(ValueError, match=r"no_eos\.json.*<\|endoftext\|>.*</s>"):
        load_tokenizer(no_eos)


def test_load_tokenizer_other_eos_and_directory(
    tmp_path: Path, make_documents: Callable[..., list[str]]
) -> None:
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=270, special_tokens=["<s>", "</s>"])
    hf.train_from_iterator(make_documents(20), trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token == "</s>" and tok.eos_id == 1
    assert json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]


def test_build_cached_builds_once_under_concurrency(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        time.sleep(0.05)  # widen the race window
        tmp.write_bytes(b"payload")

    threads = [threading.Thread(target=build_cached, args=(target, build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert target.read_bytes() == b"payload"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]  # no .lock left behind


def _build_as_process(target: Path, log: Path) -> None:
    def build(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.1)
        tmp.write_bytes(b"same bytes from whichever rank builds")

    build_cached(target, build)


def test_build_cached_builds_once_across_processes(tmp_path: Path) -> None:
    """Ranks are processes: the file lock lets exactly one of them build."""
    target, log = tmp_path / "out.bin", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build_as_process, args=(target, log)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(log.read_text().split()) == 1
    assert target.read_bytes() == b"same bytes from whichever rank builds"


def test_build_cached_failure_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"

    def crash(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        build_cached(target, crash)
    assert sorted(os.listdir(tmp_path)) == []  # not even an empty .lock
