"""moe_route: the options, the argument checks and the output shapes.

What
    RouteOptions         everything but the tensors, frozen; the op schemas are written from its
                         fields (schema_options), so the list is written once; check() is shared
                         by the kernels and the fake (bad input fails at trace time with a
                         ValueError naming the bad value)
    check_route_args     RouteOptions.check on the op's own arguments (the pass asks it first)
    empty_outputs        the outputs' shapes and dtypes: the fake's outputs, the kernels' buffers
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops.utils import compute_dtype, schema_arguments

SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2", "max")
NORMALIZE_EPS = 1e-20  # the spec's guard in weights / (weights.sum() + eps)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Kernel codes of the score function.
_SOFTMAX_PRE, _SOFTMAX_POST, _SIGMOID = 0, 1, 2


@dataclass(frozen=True)
class RouteOptions:
    """moe_route's options, one value for the reference, the kernels, the fake, the autograd
    wiring and the registration (whose schema is written from these fields and defaults).
    Built from the op's arguments with RouteOptions(top_k, **options)."""

    top_k: int
    score_func: str = "softmax"
    pre_softmax: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = False
    route_scale: float = 1.0
    group_score: str = "top2"
    aux_seq_len: int = 0
    return_lse: bool = False
    count_plain: bool = False

    @property
    def score_code(self) -> int:
        """The kernels' code of the score function."""
        if self.score_func == "sigmoid":
            return _SIGMOID
        return _SOFTMAX_PRE if self.pre_softmax else _SOFTMAX_POST

    def sequences(self, T: int) -> int:
        """Rows S of aux_sums for T tokens (0 without aux sums)."""
        return T // self.aux_seq_len if self.aux_seq_len else 0

    @property
    def group_limited(self) -> bool:
        """Whether the group limit drops experts (keeping every group masks nothing)."""
        return self.num_groups > 1 and self.topk_groups < self.num_groups

    def backward_options(self) -> dict[str, Any]:
        """The keyword arguments of moe_route_backward."""
        return {name: getattr(self, name) for name in BACKWARD_OPTIONS}

    def check(self, logits: Tensor, bias: Tensor | None) -> None:
        """Raise ValueError naming the bad value when these options and tensors do not
        describe a router. normalize and return_lse take any value."""
        self._check_choices()
        if logits.dim() != 2:
            raise ValueError(f"moe_route: logits must be [T, E], got shape {tuple(logits.shape)}")
        if logits.dtype not in _LOGIT_DTYPES:
            raise ValueError(
                "moe_route: logits must be float32, bfloat16, float16 or float64, got "
                f"{logits.dtype}"
            )
        T, E = logits.shape
        self._check_groups(E)
        if bias is not None:
            bias_dtypes = (torch.float32, torch.float64) if logits.dtype == torch.float64 else ()
            if bias.dim() != 1 or bias.shape[0] != E:
                raise ValueError(
                    f"moe_route: bias must be [E]=[{E}], got shape {tuple(bias.shape)}"
                )
            if bias.dtype != torch.float32 and bias.dtype not in bias_dtypes:
                raise ValueError(f"moe_route: bias must be float32, got {bias.dtype}")
            if bias.device != logits.device:
                raise ValueError(f"moe_route: bias is on {bias.device}, logits on {logits.device}")
        if self.aux_seq_len < 0 or (self.aux_seq_len and T % self.aux_seq_len):
            raise ValueError(
                f"moe_route: aux_seq_len={self.aux_seq_len} must be 0 (no aux sums) or divide "
                f"the number of tokens T={T}"
            )
        if self.count_plain and not self.aux_seq_len:
            raise ValueError(
                "moe_route: count_plain=True needs aux_seq_len > 0 (plain_counts has a row per "
                "sequence of aux_seq_len tokens), got aux_seq_len=0"
            )

    def _check_choices(self) -> None:
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"moe_route: score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}"
            )
        if self.score_func == "sigmoid" and not self.pre_softmax:
            raise ValueError(
                "moe_route: pre_softmax=False (softmax after the top-k) needs "
                "score_func='softmax', got score_func='sigmoid'"
            )
        if self.group_score not in GROUP_SCORES:
            raise ValueError(
                f"moe_route: group_score must be one of {GROUP_SCORES}, got {self.group_score!r}"
            )
        if not math.isfinite(self.route_scale):
            raise ValueError(f"moe_route: route_scale must be finite, got {self.route_scale}")

    def _check_groups(self, E: int) -> None:
        G, kept = self.num_groups, self.topk_groups
        if G < 1 or E % G != 0:
            raise ValueError(
                f"moe_route: num_groups={G} must be >= 1 and divide the number of experts E={E}"
            )
        if not 1 <= kept <= G:
            raise ValueError(f"moe_route: topk_groups={kept} must be in [1, num_groups={G}]")
        available = kept * (E // G)
        if not 1 <= self.top_k <= available:
            raise ValueError(
                f"moe_route: top_k={self.top_k} must be in [1, {available}]: the experts in the "
                f"topk_groups={kept} kept groups of E/num_groups={E // G}"
            )


# The options the backward reads (its op's keyword arguments).
BACKWARD_OPTIONS = ("score_func", "pre_softmax", "normalize", "route_scale", "aux_seq_len")


def check_route_args(logits: Tensor, bias: Tensor | None, top_k: int, **options: Any) -> None:
    """moe_route's argument checks (RouteOptions.check) on its own arguments: ValueError
    naming the bad value."""
    RouteOptions(top_k, **options).check(logits, bias)


def empty_outputs(logits: Tensor, o: RouteOptions) -> tuple[Tensor, ...]:
    """Uninitialised (weights, indices, counts, aux_sums, lse, plain_counts) of their shapes:
    the fake's outputs and the kernels' output buffers."""
    T, E = logits.shape
    dtype = compute_dtype(logits.dtype)
    return (
        logits.new_empty((T, o.top_k), dtype=dtype),
        logits.new_empty((T, o.top_k), dtype=torch.int64),
        logits.new_empty((E,), dtype=torch.int64),
        logits.new_empty((o.sequences(T), E), dtype=dtype),
        logits.new_empty((T if o.return_lse else 0,), dtype=dtype),
        logits.new_empty((o.sequences(T) if o.count_plain else 0, E), dtype=dtype),
    )


# The forward op's keyword options: every field after top_k.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(RouteOptions))[1:]


def schema_options(names: tuple[str, ...], *, defaults: bool) -> str:
    """The schema's keyword arguments for these RouteOptions fields (with their defaults)."""
    return schema_arguments(RouteOptions, names, first_default=names[0] if defaults else None)
