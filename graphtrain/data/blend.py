"""``BlendedLoader``: training rows drawn from several sources in fixed proportions, as
Megatron's blended datasets do (``data.paths`` with ``data.weights``).

What: every source is a ``PackedLoader`` over its own token streams (its own shuffled order,
repeating in new epochs when the blend asks for more rows than it has: a small, heavily
weighted source is upsampled). Global row r of the blend is row k of source d, where (d, k) is a
pure function of r: rows come in blocks of ``BLOCK`` rows; within a block the source of each
position is chosen greedily as the one furthest behind its share (weight * rows so far - rows
taken), as Megatron's ``build_blending_indices`` does; block b's rows of source d are that
source's rows b * count_d ... So the blend needs no index arrays, resumes exactly from the
number of rows consumed (any dp layout or micro-batch size, as ``PackedLoader``), and every
prefix of n rows holds within about one row per block boundary of weight_d * n rows of source d.

Numerics: weights are normalised to sum 1; proportions are exact per block up to rounding to
whole rows (1 / BLOCK).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from graphtrain.data.loader import PackedLoader, RowLoader, check_loader_args

BLOCK = 1000  # rows per block of the blend schedule


def blend_schedule(weights: Sequence[float], block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(source of each position in a block, index of that row among its source's rows of the
    block): the greedy error-minimising assignment of `block` rows to normalised `weights`."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(
            f"data.weights must be positive numbers, one per path, got {list(weights)}"
        )
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    source = np.empty(block, dtype=np.int64)
    index = np.empty(block, dtype=np.int64)
    for pos in range(block):
        d = int(np.argmax(w * (pos + 1) - counts))  # ties: the first source
        source[pos], index[pos] = d, counts[d]
        counts[d] += 1
    return source, index


class BlendedLoader(RowLoader):
    """Infinite iterator of packed micro-batches drawn from `sources` by `weights`; the same
    protocol as ``PackedLoader`` (``RowLoader``: rows, ``state_dict`` / ``load_state_dict``)."""

    def __init__(
        self,
        sources: Sequence[PackedLoader],
        weights: Sequence[float],
        *,
        micro_batch_size: int,
        eos_id: int | None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
    ) -> None:
        if len(sources) != len(weights):
            raise ValueError(f"{len(weights)} data.weights for {len(sources)} data.paths")
        check_loader_args(
            seq_len=sources[0].seq_len,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seed=0,
        )
        self.sources = list(sources)
        self.weights = [float(w) for w in weights]
        self._source, self._index = blend_schedule(self.weights)
        self._per_block = np.bincount(self._source, minlength=len(sources))
        self.micro_batch_size = micro_batch_size
        self.eos_id = eos_id
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len = sources[0].seq_len
        self.max_token_id = max(s.max_token_id for s in sources)
        self.consumed_rows = 0

    def source_of(self, global_row: int) -> tuple[int, int]:
        """(source, that source's row) of blend row `global_row`."""
        block, pos = divmod(global_row, len(self._source))
        d = int(self._source[pos])
        return d, block * int(self._per_block[d]) + int(self._index[pos])

    def row(self, global_row: int) -> np.ndarray:
        d, k = self.source_of(global_row)
        return self.sources[d].row(k)

    def state_dict(self) -> dict[str, Any]:
        """The position, plus what must match on load: each source's state and the weights."""
        return {
            "consumed_rows": self.consumed_rows,
            "weights": list(self.weights),
            "sources": [s.state_dict() for s in self.sources],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (another dp layout or micro-batch size is fine; other sources,
        weights, seeds or seq_len are an error naming what differs)."""
        if "sources" not in state:
            raise ValueError(
                "the checkpoint's data position is of one source, but data.weights blends "
                f"{len(self.sources)}; resume with the data it was trained on"
            )
        if [float(w) for w in state["weights"]] != self.weights or len(state["sources"]) != len(
            self.sources
        ):
            raise ValueError(
                f"the checkpoint blends data.weights={state['weights']} but this run has "
                f"{self.weights}; resume with the same blend"
            )
        for source, saved in zip(self.sources, state["sources"], strict=True):
            source.load_state_dict(saved)  # checks seed, seq_len and data size
        consumed = int(state["consumed_rows"])
        if consumed < 0:
            raise ValueError(f"loader state has consumed_rows={consumed} < 0")
        self.consumed_rows = consumed
