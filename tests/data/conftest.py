"""Shared fixtures for the data tests: tiny synthetic documents and a tiny trained tokenizer."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from graphtrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer

_WORDS = "alpha beta gamma delta def class return import for while if else None True".split()


def _make_documents(num_docs: int, seed: int = 0) -> list[str]:
    """Distinct short documents of a few random words (deterministic in ``seed``)."""
    rng = random.Random(seed)
    return [
        f"doc {i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12)))
        for i in range(num_docs)
    ]


@pytest.fixture(scope="session")
def make_documents() -> Callable[..., list[str]]:
    """``make_documents(num_docs, seed=0)``: distinct short synthetic documents."""
    return _make_documents


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token byte-level BPE (eos "<|endoftext|>" = id 0) saved as tokenizer.json."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(_make_documents(200), vocab_size=300).save(str(path))
    return path


@pytest.fixture
def tiny_tokenizer(tiny_tokenizer_path: Path) -> Tokenizer:
    return load_tokenizer(tiny_tokenizer_path)
