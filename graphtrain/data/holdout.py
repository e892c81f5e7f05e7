"""Deterministic held-out validation data for user data given without ``val_paths``.

- Text: a document is held out when a SHA-256 of its text falls in ``HOLDOUT_PER_10K`` of 10,000
  buckets (1%). Deciding by content, not position, keeps the split stable when files are reordered or
  appended to, and puts duplicate documents on the same side. A small corpus may hold out nothing.
- Pre-tokenized shards: the last 1% of tokens (at least one row of ``seq_len + 1``) of the
  concatenated shards. Token streams carry no cheap per-document identity, and a contiguous tail cuts
  at most one document in two.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HOLDOUT_PER_10K = 100


def is_held_out(text: str) -> bool:
    """True for the ~1% of documents that go to validation (a pure function of the text)."""
    digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "little") % 10_000 < HOLDOUT_PER_10K


def split_tail(
    shards: Sequence[np.ndarray], num_tail_tokens: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(head, tail): the shards cut so that ``tail`` holds their last ``num_tail_tokens`` tokens.

    Slices of memory-mapped shards stay memory-mapped views; nothing is copied.
    """
    head = list(shards)
    tail: list[np.ndarray] = []
    remaining = num_tail_tokens
    while remaining > 0 and head:
        last = head.pop()
        if len(last) <= remaining:
            tail.insert(0, last)
            remaining -= len(last)
        else:
            cut = len(last) - remaining
            head.append(last[:cut])
            tail.insert(0, last[cut:])
            remaining = 0
    return head, tail


def holdout_tokens(total_tokens: int, seq_len: int) -> int:
    """How many tail tokens to hold out of a pre-tokenized stream: 1%, at least one row."""
    return max(total_tokens * HOLDOUT_PER_10K // 10_000, seq_len + 1)
