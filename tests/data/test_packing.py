"""Packed rows -> inputs, labels, positions, document ids and the attention-pair count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphtrain.data.packing import IGNORE_INDEX, pack_rows

EOS = 0


def reference(row: np.ndarray, eos_id: int | None) -> dict[str, list[int]]:
    """A plain loop over one (T + 1)-token row: the obvious definition of every output."""
    x, y = row[:-1], row[1:]
    labels, positions, doc_ids = [], [], []
    pos, doc = 0, 0
    for t in range(len(x)):
        if t > 0 and x[t - 1] == eos_id:
            pos, doc = 0, doc + 1
        labels.append(IGNORE_INDEX if x[t] == eos_id else int(y[t]))
        positions.append(pos)
        doc_ids.append(doc)
        pos += 1
    return {"labels": labels, "position_ids": positions, "document_ids": doc_ids}


def dense_pair_count(document_ids: torch.Tensor) -> int:
    """Pairs allowed by a dense (B, T, T) same-document causal mask."""
    seq_len = document_ids.shape[1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return int((same_doc & causal).sum())


def test_hand_example() -> None:
    # Tail of a document, a whole one, the head of the next; the 9th token is only a label.
    row = np.array([[11, 12, EOS, 21, 22, 23, EOS, 31, 32]])
    td = pack_rows(row, EOS)
    assert td.batch_size == torch.Size([1])
    assert td["input_ids"].tolist() == [[11, 12, EOS, 21, 22, 23, EOS, 31]]
    assert td["labels"].tolist() == [[12, EOS, -100, 22, 23, EOS, -100, 32]]
    assert td["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert td["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert td["num_attention_pairs"] == 3 * 4 // 2 + 4 * 5 // 2 + 1
    assert td["num_label_tokens"] == 6


def test_dtypes_and_shapes() -> None:
    td = pack_rows(np.arange(2 * 6, dtype=np.uint16).reshape(2, 6), EOS)
    assert td.batch_size == torch.Size([2])
    for key in ("input_ids", "labels", "position_ids"):
        assert td[key].dtype == torch.int64 and td[key].shape == (2, 5)
    assert td["document_ids"].dtype == torch.int32 and td["document_ids"].shape == (2, 5)
    assert isinstance(td["num_attention_pairs"], int)
    assert isinstance(td.to("cpu", non_blocking=True)["num_attention_pairs"], int)


@pytest.mark.parametrize("eos_id", [EOS, None])
def test_matches_reference_on_random_rows(eos_id: int | None) -> None:
    rng = np.random.default_rng(0)
    for batch, seq_len, eos_rate in [(3, 17, 0.2), (5, 8, 0.6), (2, 31, 0.02), (1, 2, 0.5)]:
        tokens = rng.integers(1, 50, size=(batch, seq_len + 1))
        tokens[rng.random(tokens.shape) < eos_rate] = EOS
        td = pack_rows(tokens, eos_id)
        for b in range(batch):
            ref = reference(tokens[b], eos_id)
            for key, expected in ref.items():
                assert td[key][b].tolist() == expected, (key, tokens[b])
        # Labels are -100 exactly at document ends and the next token everywhere else.
        is_boundary = td["input_ids"] == EOS if eos_id is not None else torch.zeros(batch, seq_len)
        assert torch.equal(td["labels"] == IGNORE_INDEX, is_boundary.bool())
        assert td["num_attention_pairs"] == dense_pair_count(td["document_ids"])
        assert td["num_label_tokens"] == int((td["labels"] != IGNORE_INDEX).sum())
