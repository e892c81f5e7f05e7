"""``build_data``: the one entry point the trainer calls to get its tokenizer and data loaders.

It picks the data (default corpus, user text, or pre-tokenized shards), the tokenizer (user
tokenizer.json, else the default byte-level BPE), tokenizes once into the cache directory and wraps
the token streams in ``PackedLoader``s. Every rank calls it; cache files are built by whichever process
takes the cache lock first and loaded by the others (see cache.py), so no collective is needed.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphtrain.data.blend import BlendedLoader
from graphtrain.data.corpus import corpus_fingerprint, default_corpus_files, iter_default_documents
from graphtrain.data.holdout import holdout_tokens, is_held_out, split_tail
from graphtrain.data.loader import PackedLoader, check_loader_args, count_windows
from graphtrain.data.sources import (
    TOKEN_DTYPES,
    expand_paths,
    is_pretokenized,
    iter_file_documents,
    load_token_shards,
)
from graphtrain.data.token_cache import cached_token_stream, files_fingerprint
from graphtrain.data.tokenizer import Tokenizer, default_tokenizer, load_tokenizer

# The validation loader's own seed: validation rows do not change when the training seed does.
VAL_SEED = 1


@dataclass(frozen=True)
class DataBundle:
    """What the trainer needs from the data package.

    tokenizer: None only for pre-tokenized data given without a tokenizer.
    train: the training loader (``state_dict`` / ``load_state_dict`` for checkpoints).
    val: the validation loader (seed ``VAL_SEED``; call ``val.reset()`` before each evaluation to see
        the same rows each time), or None when the held-out data is shorter than one row (a warning
        says so).
    vocab_size_needed: the tokenizer's vocabulary size, or for pre-tokenized data without tokenizer
        the largest token id + 1; the model's vocab_size must be at least this.
    """

    tokenizer: Tokenizer | None
    train: PackedLoader | BlendedLoader
    val: PackedLoader | None
    vocab_size_needed: int


def _text_streams(
    files: list[Path] | None,
    val_files: list[Path] | None,
    tokenizer: Tokenizer,
    cache_dir: Path,
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token streams of text data, tokenized once into ``cache_dir``."""
    if files is None:
        train_files, held_files = default_corpus_files("train"), default_corpus_files("val")
        return (
            cached_token_stream(
                iter_default_documents("train"),
                tokenizer,
                cache_dir=cache_dir,
                name="default-train",
                source_key=f"default-corpus\0train\0{corpus_fingerprint(train_files)}",
            ),
            cached_token_stream(
                iter_default_documents("val"),
                tokenizer,
                cache_dir=cache_dir,
                name="default-val",
                source_key=f"default-corpus\0val\0{corpus_fingerprint(held_files)}",
            ),
        )
    key = files_fingerprint(files)
    if val_files is not None:
        train_docs = iter_file_documents(files)
        val_docs = iter_file_documents(val_files)
        train_key, val_key = f"files\0{key}", f"files\0{files_fingerprint(val_files)}"
    else:
        train_docs = (d for d in iter_file_documents(files) if not is_held_out(d))
        val_docs = (d for d in iter_file_documents(files) if is_held_out(d))
        train_key, val_key = f"holdout-train\0{key}", f"holdout-val\0{key}"
    train = cached_token_stream(
        train_docs, tokenizer, cache_dir=cache_dir, name="train", source_key=train_key
    )
    val = cached_token_stream(
        val_docs, tokenizer, cache_dir=cache_dir, name="val", source_key=val_key
    )
    return train, val


def _streams(
    files: list[Path] | None,
    *,
    val_files: list[Path] | None,
    pretokenized: bool,
    tokenizer: Tokenizer | None,
    cache_dir: Path,
    token_dtype: str,
    seq_len: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, val) token streams of `files` (None: the default corpus)."""
    if pretokenized:
        assert files is not None
        train_streams = load_token_shards(files, token_dtype)
        if val_files is not None:
            return train_streams, load_token_shards(val_files, token_dtype)
        total = sum(len(s) for s in train_streams)
        num_tail = holdout_tokens(total, seq_len)
        if total - num_tail >= seq_len + 1:
            return split_tail(train_streams, num_tail)
        return train_streams, []  # too little data to hold any out; warned about below
    assert tokenizer is not None
    train, val = _text_streams(files, val_files, tokenizer, cache_dir)
    return [train], [val]


def build_data(
    *,
    paths: Sequence[str] | None,
    tokenizer_path: str | None,
    vocab_size: int,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    cache_dir: Path,
    val_paths: Sequence[str] | None = None,
    token_dtype: str = "uint16",
    eos_id: int | None = None,
    weights: Sequence[float] | None = None,
) -> DataBundle:
    """Build the tokenizer and the train/val loaders.

    paths: data files or globs (.txt / .jsonl / .parquet text, or .bin / .npy token shards); None
        means the default corpus (Python stdlib source) with its path-hash train/val split.
    tokenizer_path: a user tokenizer.json; None means the default byte-level BPE with ``vocab_size``
        tokens, trained on the default corpus and cached (not used for token shards).
    vocab_size: the model's vocabulary size; a larger tokenizer or a larger token id is an error.
    val_paths: held-out data of the same kind as ``paths``. Without it, user text holds out ~1% of its
        documents (chosen by a hash of their text) and token shards their last ~1% of tokens
        (see holdout.py).
    token_dtype: "uint16" or "uint32", the item type of ``.bin`` shards.
    eos_id: the document separator of token shards when no tokenizer is given; if both are None the
        shards are read as one unbroken document (a warning says so).
    weights: one per entry of ``paths``: a blend (see blend.py), each entry a source of its own.
    """
    # How the loaders cut and deal the rows: checked before any file is read.
    layout = {
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        "seed": seed,
    }
    _check_args(paths, weights, token_dtype, layout)
    cache_dir = Path(cache_dir)
    files, val_files, pretokenized = _inputs(paths, val_paths)
    tokenizer = _tokenizer(
        tokenizer_path, vocab_size, pretokenized=pretokenized, cache_dir=cache_dir
    )
    streams = functools.partial(
        _streams,
        val_files=val_files,
        pretokenized=pretokenized,
        tokenizer=tokenizer,
        cache_dir=cache_dir,
        token_dtype=token_dtype,
        seq_len=seq_len,
    )
    if weights:  # a blend: each entry of paths is a source of its own, with its own hold-out
        train_streams, val_streams = _blend_streams(streams, paths, held_out=val_files is not None)
    else:
        train_streams, val_streams = streams(files)
    if tokenizer is not None:
        eos_id = tokenizer.eos_id
    elif eos_id is None:
        warnings.warn(
            "pre-tokenized data without a tokenizer or eos_id: no document boundaries are known, "
            "so attention and labels run across documents. Pass tokenizer_path or eos_id.",
            stacklevel=2,
        )
    train_loader, val_loader = _loaders(
        train_streams, val_streams, weights, vocab_size=vocab_size, eos_id=eos_id, **layout
    )
    # The vocabulary the model needs: the tokenizer's, or the largest token id of the shards.
    if tokenizer is not None:
        needed = tokenizer.vocab_size
    else:
        needed = max(train_loader.max_token_id, getattr(val_loader, "max_token_id", 0)) + 1
    return DataBundle(
        tokenizer=tokenizer, train=train_loader, val=val_loader, vocab_size_needed=needed
    )


def _check_args(
    paths: Sequence[str] | None,
    weights: Sequence[float] | None,
    token_dtype: str,
    layout: dict[str, int],
) -> None:
    """build_data's argument checks, before any file is read (layout: check_loader_args')."""
    if weights and (paths is None or len(weights) != len(paths)):
        raise ValueError(
            f"data.weights {list(weights)} needs one weight per entry of data.paths "
            f"{list(paths or [])}"
        )
    check_loader_args(**layout)
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {TOKEN_DTYPES}, got {token_dtype!r}")


def _inputs(
    paths: Sequence[str] | None, val_paths: Sequence[str] | None
) -> tuple[list[Path] | None, list[Path] | None, bool]:
    """(train files, held-out files, whether they are token shards); None: not given."""
    files = None if paths is None else expand_paths(paths)
    val_files = None if val_paths is None else expand_paths(val_paths)
    pretokenized = files is not None and is_pretokenized(files)
    if val_files is not None and is_pretokenized(val_files) != pretokenized:
        raise ValueError(
            f"val_paths {list(val_paths)} and paths {list(paths or [])} must be the same kind "
            "(both text or both pre-tokenized shards)"
        )
    return files, val_files, pretokenized


def _tokenizer(
    tokenizer_path: str | None, vocab_size: int, *, pretokenized: bool, cache_dir: Path
) -> Tokenizer | None:
    """The user's tokenizer, else the default BPE for text (None for token shards), checked to
    fit the model's vocabulary."""
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    if tokenizer is None and not pretokenized:
        tokenizer = default_tokenizer(vocab_size, cache_dir=cache_dir)
    if tokenizer is not None:
        _check_fits(tokenizer, vocab_size)
    return tokenizer


def _check_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model vocab_size is "
            f"{vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size} or use "
            "another tokenizer"
        )


def check_inputs(
    *,
    paths: Sequence[str] | None,
    val_paths: Sequence[str] | None,
    tokenizer_path: str | None,
    vocab_size: int,
) -> None:
    """build_data's checks of its inputs, without reading a document (`graphtrain train
    --check`, before any rank starts): the files or globs exist, have known suffixes and are of
    one kind; a given tokenizer loads and fits vocab_size (the default BPE is not built)."""
    _inputs(paths, val_paths)
    if tokenizer_path is not None:
        _check_fits(load_tokenizer(tokenizer_path), vocab_size)


def _blend_streams(
    streams: Callable[..., tuple], paths: Sequence[str], *, held_out: bool
) -> tuple[list, list]:
    """(one train stream list per source, the validation streams) of a blend: the held-out
    files' streams when given (held_out), else every source's own hold-out."""
    per_source = [streams(expand_paths([path])) for path in paths]
    train_streams = [train for train, _ in per_source]
    val_streams = per_source[0][1] if held_out else [v for _, val in per_source for v in val]
    return train_streams, val_streams


def _loaders(
    train_streams: list,
    val_streams: list,
    weights: Sequence[float] | None,
    *,
    seq_len: int,
    micro_batch_size: int,
    vocab_size: int,
    eos_id: int | None,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
) -> tuple[Any, PackedLoader | None]:
    """The training loader (a BlendedLoader over one stream list per source when weighted) and
    the validation loader (None, with a warning, when the held-out data has no whole row)."""
    make_loader = functools.partial(
        PackedLoader,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        vocab_size=vocab_size,
        eos_id=eos_id,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
    )
    if weights:
        train_loader = BlendedLoader(
            [make_loader(t, seed=seed) for t in train_streams],
            weights,
            micro_batch_size=micro_batch_size,
            eos_id=eos_id,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
    else:
        train_loader = make_loader(train_streams, seed=seed)
    val_loader = None
    if count_windows(val_streams, seq_len) > 0:
        val_loader = make_loader(val_streams, seed=VAL_SEED)
    else:
        warnings.warn(
            f"the validation data has {sum(len(s) for s in val_streams)} tokens, fewer than one "
            f"row of seq_len + 1 = {seq_len + 1}; there is no validation loader. Pass val_paths "
            "with more data.",
            stacklevel=3,  # the caller of build_data
        )
    return train_loader, val_loader
