"""Learning-rate (warmup-stable-decay) and batch-size schedules.

What
    LRSchedule: linear warmup, a constant ("stable") phase, and a decay over the last
    decay_steps steps with a linear, cosine, exponential or minus_sqrt shape (Megatron-Core's
    WSD styles, its formulas), or an inverse-square-root decay from the end of warmup
    (Megatron's "inverse-square-root"); the step convention and the formulas are in its
    docstring.
    BatchSizeSchedule: the global batch size (in tokens) as a step function of the number of
    tokens consumed so far, e.g. "0:256K 50M:512K 200M:1M".

Contract
    Both are pure functions of the step / consumed tokens, so resuming from a checkpoint only
    needs the step and the token count; state_dict stores the configuration so a resumed run
    can check or restore it. The values are Python floats/ints computed on the host: setting
    them costs no device sync.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from graphtrain.config import JobConfig

DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt", "inverse_sqrt")


class LRSchedule:
    """Warmup-stable-decay learning rate, a pure function of the optimizer step.

    Step convention (0-based optimizer steps, `total_steps` of them, the last total_steps - 1):
    - warmup, step < warmup_steps: lr * (step + 1) / warmup_steps, so step 0 trains at
      lr / warmup_steps (not 0, which would waste a step; torchtitan's warmup);
    - stable, warmup_steps <= step < total_steps - decay_steps: lr;
    - decay, step >= decay_start = total_steps - decay_steps: progress
      r = (step - decay_start) / decay_steps, so the first decay step trains at lr and the last
      step (total_steps - 1) at r = (D-1)/D, one step short of min_lr: the value Megatron-Core
      (num_steps = step) and torchtitan (its "virtual last step") give the same step, so with
      min_lr = 0 the last step still trains. Steps past the end use r = 1 (min_lr).
      decay_steps = 0: no decay, lr throughout.
      Shapes, with r in [0, 1] (Megatron-Core's WSD decay styles, min_lr = 0 allowed for all):
        linear:      min + (max - min) * (1 - r)
        cosine:      min + (max - min) * 0.5 * (1 + cos(pi * r))
        exponential: min + (max - min) * (2 * 0.5 ** r - 1)
        minus_sqrt:  min + (max - min) * (1 - sqrt(r))
    - inverse_sqrt (replaces the stable phase and the decay; decay_steps is not used): every
      step from warmup_steps on trains at max(min, max * sqrt(max(W, 1) / max(step, 1))), W =
      warmup_steps, Megatron's formula at its num_steps = step (step W trains at lr); past the end
      (step > total_steps), min_lr.
    """

    def __init__(
        self,
        *,
        lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        total_steps: int,
        decay_style: str,
    ) -> None:
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"unknown decay_style {decay_style!r}; expected one of {DECAY_STYLES}")
        for name, value in (
            ("warmup_steps", warmup_steps),
            ("decay_steps", decay_steps),
            ("total_steps", total_steps),
        ):
            if int(value) != value or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {total_steps}")
        if warmup_steps + decay_steps > total_steps:
            raise ValueError(
                f"warmup_steps ({warmup_steps}) + decay_steps ({decay_steps}) = "
                f"{warmup_steps + decay_steps} exceeds total_steps ({total_steps})"
            )
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if min_lr < 0:
            raise ValueError(f"min_lr must be >= 0, got {min_lr}")
        if min_lr > lr:
            raise ValueError(f"min_lr ({min_lr}) must not exceed lr ({lr})")
        self.lr = float(lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.total_steps = int(total_steps)
        self.decay_style = decay_style
        # The step most recently passed to apply(); -1 before the first call.
        self.last_step = -1

    @property
    def decay_start(self) -> int:
        """First step of the decay phase."""
        return self.total_steps - self.decay_steps

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based optimizer step `step` (see the module docstring)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        hi, lo = self.lr, self.min_lr
        if self.decay_style == "inverse_sqrt":
            if step > self.total_steps:
                return lo
            return max(lo, hi * math.sqrt(max(self.warmup_steps, 1) / max(step, 1)))
        if step < self.decay_start or self.decay_steps == 0:
            return self.lr
        # r = 0 at the first decay step, (D-1)/D at the last step (module docstring).
        r = min(1.0, (step - self.decay_start) / self.decay_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - r
        elif self.decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * r))
        elif self.decay_style == "exponential":
            coeff = 2.0 * 0.5**r - 1.0
        else:  # minus_sqrt
            coeff = 1.0 - math.sqrt(r)
        return lo + (hi - lo) * coeff

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the learning rate of every param group for `step`; returns it.

        A tensor lr (capturable / compiled optimizers) is filled in place so graphs that captured
        it see the new value.
        """
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self.last_step = step
        return lr

    def state_dict(self) -> dict[str, Any]:
        """Configuration and last applied step, for checkpoints."""
        return {
            "lr": self.lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "total_steps": self.total_steps,
            "decay_style": self.decay_style,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict (validated like the constructor's arguments)."""
        state = dict(state)
        last_step = int(state.pop("last_step", -1))
        self.__init__(**state)  # validated like the constructor's arguments
        self.last_step = last_step

    def __repr__(self) -> str:
        return (
            f"LRSchedule(lr={self.lr}, min_lr={self.min_lr}, warmup_steps={self.warmup_steps}, "
            f"decay_steps={self.decay_steps}, total_steps={self.total_steps}, "
            f"decay_style={self.decay_style!r})"
        )


# One rule for every number in a batch-size spec, thresholds and batch sizes alike: binary
# multiples, so "256K" = 262144 tokens = 64 sequences of 4096.
_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_NUMBER = re.compile(r"^(\d+)([KMG]?)$")


def parse_token_count(text: str) -> int:
    """Parse "4096", "256K", "50M", "1G" (K = 1024, M = 1024**2, G = 1024**3; case-insensitive)."""
    match = _NUMBER.match(text.strip().upper())
    if match is None:
        raise ValueError(
            f"bad token count {text!r}; expected an integer with an optional K/M/G suffix "
            "(K = 1024, M = 1024**2, G = 1024**3), e.g. 256K"
        )
    return int(match.group(1)) * _SUFFIXES[match.group(2)]


def lr_schedule_from_config(cfg: JobConfig) -> LRSchedule:
    """The job's learning-rate schedule: the trainer's, and that of the e2e benchmark's loop."""
    return LRSchedule(
        lr=cfg.optim.lr,
        min_lr=cfg.schedule.min_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.decay_steps,
        total_steps=cfg.training.steps,
        decay_style=cfg.schedule.decay_style,
    )


class BatchSizeSchedule:
    """Global batch size in tokens as a step function of the tokens consumed so far.

    Built from (threshold, tokens_per_step) pairs: from `threshold` consumed tokens on, each
    optimizer step consumes `tokens_per_step` tokens. The first threshold must be 0 and thresholds
    must strictly increase. `parse` reads the string form "0:256K 50M:512K 200M:1M" (entries
    separated by spaces or commas; K = 1024, M = 1024**2, G = 1024**3 for both numbers) or a
    single integer / "512K" for a constant batch size.
    """

    def __init__(self, entries: list[tuple[int, int]]) -> None:
        if not entries:
            raise ValueError("batch-size schedule is empty; give at least one 'threshold:size'")
        for i, (threshold, size) in enumerate(entries):
            where = f"batch-size schedule entry {i} ({threshold}:{size})"
            if threshold < 0:
                raise ValueError(f"{where}: threshold must be >= 0")
            if size <= 0:
                raise ValueError(f"{where}: batch size must be positive")
            if i == 0 and threshold != 0:
                raise ValueError(f"{where}: the first threshold must be 0")
            if i > 0 and threshold <= entries[i - 1][0]:
                raise ValueError(
                    f"{where}: thresholds must strictly increase, but {threshold} follows "
                    f"{entries[i - 1][0]}"
                )
        self.entries = [(int(t), int(s)) for t, s in entries]

    @classmethod
    def constant(cls, tokens_per_step: int) -> BatchSizeSchedule:
        """A schedule with one batch size for the whole run."""
        return cls([(0, tokens_per_step)])

    @classmethod
    def parse(cls, spec: str | int) -> BatchSizeSchedule:
        """Parse "0:256K 50M:512K 200M:1M", or a constant "512K" / 524288."""
        if isinstance(spec, int):
            return cls.constant(spec)
        items = [item for item in re.split(r"[\s,]+", spec.strip()) if item]
        if len(items) == 1 and ":" not in items[0]:
            return cls.constant(parse_token_count(items[0]))
        entries = []
        for item in items:
            parts = item.split(":")
            if len(parts) != 2:
                raise ValueError(
                    f"bad batch-size schedule entry {item!r} in {spec!r}; expected "
                    "'consumed_tokens:batch_tokens', e.g. '50M:512K'"
                )
            entries.append((parse_token_count(parts[0]), parse_token_count(parts[1])))
        return cls(entries)

    def tokens_per_step(self, consumed_tokens: int) -> int:
        """Global batch size in tokens for a step that starts after `consumed_tokens` tokens."""
        if consumed_tokens < 0:
            raise ValueError(f"consumed_tokens must be >= 0, got {consumed_tokens}")
        size = self.entries[0][1]
        for threshold, entry_size in self.entries:
            if consumed_tokens >= threshold:
                size = entry_size
            else:
                break
        return size

    def micro_batches_per_step(
        self, consumed_tokens: int, *, micro_batch_size: int, seq_len: int, dp_world_size: int
    ) -> int:
        """Gradient-accumulation steps: global tokens / (micro_batch_size * seq_len * dp_world_size).

        Raises ValueError naming every number when that is not a positive integer.
        """
        tokens = self.tokens_per_step(consumed_tokens)
        return _micro_batches(tokens, micro_batch_size, seq_len, dp_world_size)

    def check(self, *, micro_batch_size: int, seq_len: int, dp_world_size: int) -> None:
        """Check every entry divides evenly, so a bad schedule fails at startup, not mid-run."""
        for _, tokens in self.entries:
            _micro_batches(tokens, micro_batch_size, seq_len, dp_world_size)

    def state_dict(self) -> dict[str, Any]:
        """The entries, for checkpoints."""
        return {"entries": [list(e) for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore entries from state_dict (validated)."""
        self.entries = BatchSizeSchedule([tuple(e) for e in state["entries"]]).entries

    def __repr__(self) -> str:
        return f"BatchSizeSchedule({self.entries})"


def _micro_batches(tokens: int, micro_batch_size: int, seq_len: int, dp_world_size: int) -> int:
    """tokens / (micro_batch_size * seq_len * dp_world_size) as an exact positive integer."""
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("seq_len", seq_len),
        ("dp_world_size", dp_world_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    per_micro_step = micro_batch_size * seq_len * dp_world_size
    if tokens % per_micro_step != 0 or tokens < per_micro_step:
        raise ValueError(
            f"global batch of {tokens} tokens is not a positive multiple of micro_batch_size "
            f"({micro_batch_size}) * seq_len ({seq_len}) * dp_world_size ({dp_world_size}) = "
            f"{per_micro_step} tokens; {tokens} / {per_micro_step} = {tokens / per_micro_step:g}"
        )
    return tokens // per_micro_step
