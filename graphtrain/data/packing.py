"""Turn packed token rows into a training micro-batch: inputs, labels, positions and document ids.

A row is ``seq_len + 1`` consecutive tokens of a stream in which every document ends with ``eos_id``;
it usually holds the tail of one document, several whole ones and the head of another. With
``x = row[:-1]`` (inputs) and ``y = row[1:]`` (next tokens), a new document starts at position 0 and
after every eos in ``x``. Hence:

- ``labels[t] = y[t]``, except -100 (ignored by cross-entropy) where ``x[t]`` is eos: the next token
  starts another document and must not be predicted from this one. The eos itself is predicted (it is
  the last token of its document), so the model learns where documents end. Reading ``seq_len + 1``
  tokens gives every other position, the last one included, a label.
- ``position_ids`` count from 0 at each document start; ``document_ids`` number the documents of a row
  0, 1, 2, ... so that attention is allowed where ``document_ids`` match and the key is not after the
  query (same-document causal).

Two plain Python ints, computed here on the CPU from the document lengths, are attached as non-tensor
entries so the trainer never has to sync a device to read them:

- ``num_attention_pairs``: the number of (query, key) pairs the same-document causal mask allows,
  summed over rows: sum of L * (L + 1) / 2 over the documents (length L) of each row. For exact FLOPs.
- ``num_label_tokens``: the number of labels that are not -100. For normalizing the loss over a step.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

IGNORE_INDEX = -100


def pack_rows(rows: np.ndarray, eos_id: int | None) -> TensorDict:
    """The micro-batch of ``rows`` ((B, T + 1) integers); ``eos_id`` None means no boundaries.

    Returns a TensorDict with batch_size [B]: ``input_ids``, ``labels``, ``position_ids`` (B, T) int64,
    ``document_ids`` (B, T) int32, and the Python ints ``num_attention_pairs``, ``num_label_tokens``.
    """
    assert rows.ndim == 2 and rows.shape[1] >= 3, rows.shape
    rows = rows.astype(np.int64, copy=False)
    inputs = np.ascontiguousarray(rows[:, :-1])  # (B, T)
    next_tokens = rows[:, 1:]  # (B, T)
    batch, seq_len = inputs.shape

    if eos_id is None:
        is_eos = np.zeros_like(inputs, dtype=bool)
    else:
        is_eos = inputs == eos_id
    labels = np.where(is_eos, IGNORE_INDEX, next_tokens)

    # A document starts at the row start and right after every eos.
    starts = np.empty_like(is_eos)
    starts[:, 0] = True
    starts[:, 1:] = is_eos[:, :-1]
    document_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    index = np.arange(seq_len)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    position_ids = index - last_start

    # Document lengths: distances between consecutive starts in the flattened (B*T) array. Every row
    # begins with a start, so no document spans two rows.
    start_flat = np.flatnonzero(starts)
    lengths = np.diff(start_flat, append=batch * seq_len)
    num_attention_pairs = int((lengths * (lengths + 1) // 2).sum())
    num_label_tokens = int(batch * seq_len - is_eos.sum())

    td = TensorDict(
        {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
            "document_ids": torch.from_numpy(document_ids),
        },
        batch_size=[batch],
    )
    td.set_non_tensor("num_attention_pairs", num_attention_pairs)
    td.set_non_tensor("num_label_tokens", num_label_tokens)
    return td
