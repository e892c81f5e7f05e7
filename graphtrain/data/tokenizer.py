"""A thin tokenizer wrapper over HF ``tokenizers``, and the cached default byte-level BPE.

Why a wrapper: the rest of graphtrain needs only encode/decode, the vocabulary size and the
end-of-document id, and it must encode data text the same way for every tokenizer: no template
specials (BOS) added by a post-processor, and special-token strings that occur in the text (say a
literal "<|endoftext|>" in a file) tokenized as plain text, so data can never forge a document
boundary. Document boundaries are inserted by the caller as ``eos_id``.

The default tokenizer is a byte-level BPE trained on the default corpus train split at first use
(a few seconds on 2 cores for 8192 tokens) and cached as JSON in the cache directory under a name keyed
on the Python version, the vocabulary size and a fingerprint of the training files.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from graphtrain.data.cache import build_cached
from graphtrain.data.corpus import corpus_fingerprint, default_corpus_files, read_document

EOS_TOKEN = "<|endoftext|>"
# Looked for, in this order, among a user tokenizer's added tokens to find its end-of-document token.
EOS_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
    "<|end|>",
)
# Bump when the training recipe below changes, so old caches are not reused for a new recipe.
_RECIPE_VERSION = 1
_MIN_VOCAB_SIZE = 256 + 1  # the 256 byte-level symbols plus the eos token


class Tokenizer:
    """Encode/decode text; ``eos_id`` separates documents in token streams."""

    def __init__(self, hf: tokenizers.Tokenizer, *, eos_token: str, path: Path | None) -> None:
        eos_id = hf.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"eos token {eos_token!r} is not in the tokenizer's vocabulary")
        # Special-token strings inside data text are plain text (see the module docstring).
        hf.encode_special_tokens = True
        self._hf = hf
        self._eos_token = eos_token
        self._eos_id = int(eos_id)
        self._path = path

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens added."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (parallel over texts inside HF tokenizers)."""
        # encode_batch_fast skips computing offsets; it exists in tokenizers >= 0.21.
        encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens such as eos are kept in the output."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included: every id is < vocab_size."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def eos_token(self) -> str:
        return self._eos_token

    @property
    def path(self) -> Path | None:
        """The tokenizer.json this was loaded from (None for one built in memory)."""
        return self._path

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the serialized tokenizer: equal fingerprints encode identically."""
        return hashlib.sha256(self._hf.to_str().encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(path={self._path}, vocab_size={self.vocab_size}, eos_id={self._eos_id})"


def _find_eos_token(hf: tokenizers.Tokenizer) -> str | None:
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    for candidate in EOS_CANDIDATES:
        if candidate in added:
            return candidate
    return None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a user ``tokenizer.json`` (or a directory holding one) in HF tokenizers format.

    Raises FileNotFoundError if there is no such file, ValueError if it cannot be parsed or has none of
    the end-of-document tokens in ``EOS_CANDIDATES`` among its added tokens.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {str(path)!r} does not exist (looked for {str(Path(path).absolute())!r})"
        )
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(
            f"tokenizer file {str(path)!r} is not a valid HF tokenizers tokenizer.json: {e}"
        ) from e
    eos_token = _find_eos_token(hf)
    if eos_token is None:
        raise ValueError(
            f"tokenizer {str(path)!r} has no end-of-document special token; looked for the added "
            f"tokens {', '.join(EOS_CANDIDATES)}. Add one of them as a special token."
        )
    return Tokenizer(hf, eos_token=eos_token, path=path)


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE; it needs at least "
            f"{_MIN_VOCAB_SIZE} (256 bytes + the eos token)"
        )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train a byte-level BPE with ``EOS_TOKEN`` (id 0) on ``texts``; deterministic for equal inputs."""
    _check_vocab_size(vocab_size)
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # All 256 byte symbols, so any text can be encoded even if some bytes never occur in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return hf


def default_tokenizer(
    vocab_size: int = 8192, *, cache_dir: Path, files: Sequence[Path] | None = None
) -> Tokenizer:
    """The default byte-level BPE, trained on first use and loaded from ``cache_dir`` afterwards.

    ``files`` are the training documents (one per file), by default the default corpus train split.
    The cache name is keyed on the Python version, ``vocab_size`` and a fingerprint of ``files``; it is
    written atomically and, when several processes start at once, built by one of them only.
    """
    files = list(default_corpus_files("train") if files is None else files)
    _check_vocab_size(vocab_size)
    key = hashlib.sha256(
        f"{_RECIPE_VERSION}\0{vocab_size}\0{corpus_fingerprint(files)}".encode()
    ).hexdigest()[:16]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    path = Path(cache_dir) / f"tokenizer-{py}-v{vocab_size}-{key}.json"

    def build(tmp: Path) -> None:
        hf = train_bpe_tokenizer((read_document(p) for p in files), vocab_size)
        hf.save(str(tmp))

    build_cached(path, build)
    return load_tokenizer(path)
