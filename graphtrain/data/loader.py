"""Deterministic, resumable, data-parallel-sharded loader of packed micro-batches.

The token stream (one or more 1-D arrays, usually memory-mapped; documents end with eos) is cut into
windows of ``seq_len + 1`` tokens with stride ``seq_len``, so consecutive windows share one token and
every token is an input exactly once per epoch. Windows never span two shards; a shard's last
``< seq_len + 1`` tokens are not used. One window is one row of a micro-batch (see packing.py).

Order: a global, infinite sequence of rows. Epoch e is a permutation of all windows drawn from
``numpy.random.default_rng([seed, e])``, so the order depends only on (seed, epoch); epoch e + 1
follows epoch e directly, and one micro-batch may hold rows of both.

Sharding and state: every ``next()`` takes the next ``micro_batch_size * dp_world_size`` global rows;
rank r gets rows ``[r * B, (r + 1) * B)`` of them. The ranks thus see disjoint rows, and together the
same rows in the same order as a single rank with micro-batch ``B * dp_world_size``. All ranks must
call ``next()`` equally often. The state is one number, ``consumed_rows``, the global rows consumed so
far (equal on all ranks), so resuming is exact, and resuming with another ``dp_world_size`` or
``micro_batch_size`` continues from the same global position with the new split.

Not the loader's job: pinning memory and moving to a device (the trainer calls
``td.to(device, non_blocking=True)``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from graphtrain.data.packing import IGNORE_INDEX, pack_rows


def check_loader_args(
    *, seq_len: int, micro_batch_size: int, dp_rank: int, dp_world_size: int, seed: int
) -> None:
    """Raise ValueError naming the bad value; callers use it to fail before tokenizing anything."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(
            f"need 0 <= dp_rank < dp_world_size, got dp_rank={dp_rank}, dp_world_size={dp_world_size}"
        )
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def count_windows(tokens: Sequence[np.ndarray], seq_len: int) -> int:
    """Rows per epoch of a stream: windows of seq_len + 1 tokens, stride seq_len, within each shard."""
    return sum(max(len(s) - 1, 0) // seq_len for s in tokens)


def _where_out_of_range(shards: Sequence[np.ndarray], vocab_size: int) -> str:
    """How many ids lie outside [0, vocab_size), and where the first one is (error path only)."""
    count, first = 0, None
    for index, shard in enumerate(shards):
        bad = (
            (shard >= vocab_size) | (shard < 0) if shard.dtype.kind == "i" else shard >= vocab_size
        )
        count += int(bad.sum())
        if first is None and bad.any():
            position = int(np.argmax(bad))
            first = f"the first, {int(shard[position])}, at token {position} of shard {index}"
    return f"{count} ids outside [0, {vocab_size}); {first}"


class RowLoader:
    """The loader protocol (PackedLoader, BlendedLoader): an infinite iterator of packed
    micro-batches over a global sequence of rows, resumable from ``consumed_rows``. A loader
    gives ``row(global_row)`` and its ``state_dict`` / ``load_state_dict``; this class deals
    the rows to the dp ranks (module docstring) and packs them."""

    micro_batch_size: int
    eos_id: int | None
    dp_rank: int
    dp_world_size: int
    consumed_rows: int

    def row(self, global_row: int) -> np.ndarray:
        """Global row `global_row`: seq_len + 1 token ids."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[TensorDict]:
        return self

    def __next__(self) -> TensorDict:
        first = self.consumed_rows + self.dp_rank * self.micro_batch_size
        rows = np.stack([self.row(first + i) for i in range(self.micro_batch_size)])
        self.consumed_rows += self.micro_batch_size * self.dp_world_size
        return pack_rows(rows, self.eos_id)

    def reset(self) -> None:
        """Start again from the first row (e.g. to evaluate on the same rows each time)."""
        self.consumed_rows = 0

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class PackedLoader(RowLoader):
    """Infinite iterator of packed micro-batches (TensorDicts, see ``pack_rows``) with exact resume."""

    def __init__(
        self,
        tokens: np.ndarray | Sequence[np.ndarray],
        *,
        seq_len: int,
        micro_batch_size: int,
        vocab_size: int,
        eos_id: int | None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
    ) -> None:
        check_loader_args(
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seed=seed,
        )
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {vocab_size})")
        shards = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
        for shard in shards:
            if shard.ndim != 1 or shard.dtype.kind not in "iu":
                raise ValueError(
                    f"token streams must be 1-D integer arrays, got shape {shard.shape} dtype {shard.dtype}"
                )
        num_tokens = sum(len(s) for s in shards)
        windows = np.array([max(len(s) - 1, 0) // seq_len for s in shards], dtype=np.int64)
        num_windows = int(windows.sum())
        if num_windows == 0:
            raise ValueError(
                f"the token stream has {num_tokens} tokens (largest shard "
                f"{max((len(s) for s in shards), default=0)}), fewer than one row of "
                f"seq_len + 1 = {seq_len + 1} tokens; use more data or a smaller seq_len"
            )
        # One pass over the stream at construction: token ids (inputs and, one position on, the
        # targets of the loss) must index the model's embedding and head. Checked here, on the
        # host, a bad id costs the step no device sync and stops the run before training.
        nonempty = [s for s in shards if len(s)]
        self.max_token_id = max(int(s.max()) for s in nonempty)
        if self.max_token_id >= vocab_size:
            raise ValueError(
                f"the token stream holds token id {self.max_token_id} >= the model vocab_size="
                f"{vocab_size} ({_where_out_of_range(shards, vocab_size)}); raise "
                f"model.vocab_size to at least {self.max_token_id + 1} or check the tokenizer / "
                "token dtype"
            )
        signed = [s for s in nonempty if s.dtype.kind == "i"]
        min_token_id = min((int(s.min()) for s in signed), default=0)
        if min_token_id < 0:
            raise ValueError(
                f"the token stream holds a negative token id {min_token_id} "
                f"({_where_out_of_range(shards, vocab_size)}); token ids must be in "
                f"[0, {vocab_size})"
            )

        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.num_windows = num_windows
        self.consumed_rows = 0
        self.shards = shards  # the token arrays read (views of memory maps, never copied)
        # Global index of the first window of each shard, plus the total at the end.
        self._window_offsets = np.concatenate([[0], np.cumsum(windows)])
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """The epoch of the next global row."""
        return self.consumed_rows // self.num_windows

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def _window(self, window: int) -> np.ndarray:
        shard = int(np.searchsorted(self._window_offsets, window, side="right")) - 1
        start = (window - int(self._window_offsets[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1])

    def row(self, global_row: int) -> np.ndarray:
        epoch, index = divmod(global_row, self.num_windows)
        return self._window(int(self._permutation(epoch)[index]))

    def eval_batches(self, num_rows: int) -> list[TensorDict]:
        """This dp rank's share of a fixed evaluation set: the first ``num_rows`` global rows of
        epoch 0 (the order does not depend on the layout), row i on dp rank i % dp_world_size.

        Every rank gets the same number of full micro-batches, ceil(num_rows / (dp_world_size *
        micro_batch_size)), so collectives inside the forward match up and compiled shapes stay
        static; the slots past ``num_rows`` repeat row 0 with every label IGNORE_INDEX, and
        ``num_label_tokens`` counts only real labels. Summed over ranks, loss x num_label_tokens
        and num_label_tokens then depend on ``num_rows`` alone, not on the world size or
        micro-batch size. Does not move the training position (``consumed_rows``).
        """
        per_batch = self.micro_batch_size * self.dp_world_size
        num_batches = -(-num_rows // per_batch)
        mine = list(range(self.dp_rank, num_batches * per_batch, self.dp_world_size))
        batches = []
        for start in range(0, len(mine), self.micro_batch_size):
            rows = mine[start : start + self.micro_batch_size]
            td = pack_rows(
                np.stack([self.row(r if r < num_rows else 0) for r in rows]), self.eos_id
            )
            padding = torch.tensor([r >= num_rows for r in rows])
            td["labels"][padding] = IGNORE_INDEX
            td.set_non_tensor("num_label_tokens", int((td["labels"] != IGNORE_INDEX).sum()))
            batches.append(td)
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The resume state: ``consumed_rows`` plus what must match on load (ints only)."""
        return {
            "consumed_rows": self.consumed_rows,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batches are those the saving loader would have yielded.

        ``dp_world_size``, ``dp_rank`` and ``micro_batch_size`` may differ from the saving loader's;
        the global position is kept. A different seed, seq_len or data (number of windows) is an error.
        """
        for key in ("seed", "seq_len", "num_windows"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={int(state[key])} but this loader has "
                    f"{key}={getattr(self, key)}; resume with the same data, seq_len and seed"
                )
        consumed = int(state["consumed_rows"])
        if consumed < 0:
            raise ValueError(f"loader state has consumed_rows={consumed} < 0")
        self.consumed_rows = consumed
