"""PackedLoader: order, sharding, exact resume and argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from graphtrain.data.loader import PackedLoader

EOS = 0
VOCAB = 100


def make_stream(num_tokens: int, seed: int = 0) -> np.ndarray:
    """Random documents of 1-20 tokens, each ending with EOS."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=num_tokens).astype(np.uint16)
    tokens[rng.random(num_tokens) < 0.1] = EOS
    tokens[-1] = EOS
    return tokens


def make_loader(tokens: np.ndarray | list[np.ndarray], **kwargs: int) -> PackedLoader:
    args = dict(seq_len=8, micro_batch_size=2, vocab_size=VOCAB, eos_id=EOS, seed=3)
    args.update(kwargs)
    return PackedLoader(tokens, **args)


def take(loader: PackedLoader, n: int) -> list[TensorDict]:
    return [next(loader) for _ in range(n)]


def same(a: list[TensorDict], b: list[TensorDict]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
        for x, y in zip(a, b, strict=True)
    )


def window_starts(batches: list[TensorDict], stream: np.ndarray, seq_len: int) -> list[int]:
    """Which window (index into stream // seq_len) each row of the batches is."""
    starts = []
    for td in batches:
        for row in td["input_ids"].numpy():
            matches = [
                w
                for w in range((len(stream) - 1) // seq_len)
                if np.array_equal(stream[w * seq_len : w * seq_len + seq_len], row)
            ]
            assert len(matches) == 1
            starts.append(matches[0])
    return starts


def test_rows_are_windows_and_labels_read_one_past() -> None:
    stream = np.arange(1, 34, dtype=np.int64)  # 33 tokens, one document: 4 windows of 8 + 1
    loader = make_loader(stream, eos_id=None, micro_batch_size=1, vocab_size=40)
    assert loader.num_windows == 4
    for td in take(loader, 4):
        start = int(td["input_ids"][0, 0]) - 1
        assert start % 8 == 0
        assert td["labels"][0].tolist() == list(range(start + 2, start + 10))


def test_each_epoch_is_a_permutation_and_depends_on_seed_and_epoch() -> None:
    stream = make_stream(8 * 20 + 1)
    loader = make_loader(stream, micro_batch_size=1)
    assert loader.num_windows == 20
    epochs = [window_starts(take(loader, 20), stream, 8) for _ in range(3)]
    assert all(sorted(e) == list(range(20)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.epoch == 3
    again = make_loader(stream, micro_batch_size=1)
    assert window_starts(take(again, 20), stream, 8) == epochs[0]
    other_seed = make_loader(stream, micro_batch_size=1, seed=4)
    assert window_starts(take(other_seed, 20), stream, 8) != epochs[0]


def test_dp_shards_are_disjoint_and_cover_the_single_rank_rows() -> None:
    stream = make_stream(8 * 50 + 1)
    single = take(make_loader(stream, micro_batch_size=6), 20)  # crosses epochs (50 rows each)
    ranks = [
        take(make_loader(stream, micro_batch_size=2, dp_rank=r, dp_world_size=3), 20)
        for r in range(3)
    ]
    for step in range(20):
        combined = torch.cat([ranks[r][step]["input_ids"] for r in range(3)])
        assert torch.equal(combined, single[step]["input_ids"])
    # Within one epoch (first 8 steps = 48 rows), no row is seen twice across ranks.
    seen = window_starts([ranks[r][s] for r in range(3) for s in range(8)], stream, 8)
    assert len(seen) == len(set(seen)) == 48


@pytest.mark.parametrize("steps_before", [3, 9])  # mid-epoch; then the next batches cross epoch 1
def test_exact_resume(steps_before: int) -> None:
    stream = make_stream(8 * 21 + 1)  # 21 windows: epoch boundaries fall inside micro-batches
    original = make_loader(stream, micro_batch_size=2)
    take(original, steps_before)
    state = original.state_dict()
    expected = take(original, 6)
    resumed = make_loader(stream, micro_batch_size=2)
    resumed.load_state_dict(state)
    assert same(take(resumed, 6), expected)
    assert resumed.state_dict() == original.state_dict()


def test_resume_with_another_dp_world_size_keeps_the_global_position() -> None:
    stream = make_stream(8 * 30 + 1)
    two_ranks = [make_loader(stream, dp_rank=r, dp_world_size=2) for r in range(2)]
    for loader in two_ranks:
        take(loader, 5)
    state = two_ranks[0].state_dict()
    assert state == two_ranks[1].state_dict() and state["consumed_rows"] == 20
    expected = [torch.cat([next(two_ranks[0])["input_ids"], next(two_ranks[1])["input_ids"]])]
    one_rank = make_loader(stream, micro_batch_size=4)
    one_rank.load_state_dict(state)
    assert torch.equal(next(one_rank)["input_ids"], expected[0])


def test_rows_never_span_shards() -> None:
    a = np.full(8 * 3 + 5, 1, dtype=np.uint16)  # 3 windows, 4 tail tokens unused
    b = np.full(8 * 2 + 1, 2, dtype=np.uint16)  # 2 windows
    loader = make_loader([a, b], micro_batch_size=5, eos_id=None)
    assert loader.num_windows == 5
    rows = next(loader)["input_ids"]
    assert sorted(int(r[0]) for r in rows) == [1, 1, 1, 2, 2]
    assert all(len(set(r.tolist())) == 1 for r in rows)


def test_argument_errors() -> None:
    stream = make_stream(100)
    assert make_loader(stream, seq_len=99).num_windows == 1  # exactly one row fits
    with pytest.raises(ValueError, match=r"100 tokens.*seq_len \+ 1 = 101"):
        make_loader(stream, seq_len=100)
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        make_loader(stream, seq_len=1)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        make_loader(stream, micro_batch_size=0)
    with pytest.raises(ValueError, match="dp_rank=2, dp_world_size=2"):
        make_loader(stream, dp_rank=2, dp_world_size=2)
    with pytest.raises(ValueError, match=r"token id 99 >= the model vocab_size=99.*at least 100"):
        make_loader(np.append(stream, 99).astype(np.uint16), vocab_size=99)
    # Target ids out of range: counted, the first one named with its place.
    bad = stream.astype(np.int32)
    bad[[7, 50, 51]] = [120, -1, 130]
    with pytest.raises(ValueError, match="token id 130 >= the model vocab_size=100") as e:
        make_loader([stream[:5], bad])
    assert "3 ids outside [0, 100); the first, 120, at token 7 of shard 1" in str(e.value)
    with pytest.raises(ValueError, match="negative token id -1") as e:
        make_loader(np.where(bad > 99, 5, bad))
    assert "1 ids outside [0, 100); the first, -1, at token 50 of shard 0" in str(e.value)
    loader = make_loader(stream)
    other = make_loader(stream, seed=5)
    with pytest.raises(ValueError, match="seed=3 but this loader has seed=5"):
        other.load_state_dict(loader.state_dict())


@pytest.mark.parametrize(("dp", "mbs"), [(2, 2), (2, 3), (3, 1), (3, 4)])
def test_eval_batches_split_one_fixed_set_over_any_layout(dp: int, mbs: int) -> None:
    """The first 7 rows of epoch 0, whatever the dp size and micro-batch: the ranks' real rows
    together are those of one rank with one micro-batch, the padding carries no label, and every
    rank runs the same number of full micro-batches."""
    stream = make_stream(400)
    (one,) = make_loader(stream, micro_batch_size=7).eval_batches(7)
    expected = sorted(map(tuple, one["labels"].tolist()))
    per_rank = [
        make_loader(stream, micro_batch_size=mbs, dp_rank=r, dp_world_size=dp).eval_batches(7)
        for r in range(dp)
    ]
    assert len({len(b) for b in per_rank}) == 1
    assert all(td["labels"].shape[0] == mbs for batches in per_rank for td in batches)
    rows = [
        tuple(row)
        for batches in per_rank
        for td in batches
        for row in td["labels"].tolist()
        if any(x != -100 for x in row)
    ]
    assert sorted(rows) == expected
    counted = sum(td["num_label_tokens"] for batches in per_rank for td in batches)
    assert counted == one["num_label_tokens"] == int((one["labels"] != -100).sum())
    # Evaluating moves nothing: training continues where it was.
    loader = make_loader(stream)
    loader.eval_batches(7)
    assert loader.consumed_rows == 0
