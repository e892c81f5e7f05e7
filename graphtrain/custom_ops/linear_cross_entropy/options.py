"""linear_cross_entropy: the options, the argument checks and the mode policy.

What
    LCEOptions             everything but the tensors, frozen and validated; the op schemas are
                           generated from its fields (schema_options), so the list is written once
    _check_args            shape and dtype checks shared by the kernels and the fake (bad input
                           fails at trace time)
    fast_mode_extra_bytes  what fast mode holds beyond low-memory mode (the pass's budget test,
                           metrics/memory_plan's figure)
    the buffer sizes       FAST_BUFFER_BYTES and SWEEP_A_BUFFER_BYTES: the logits buffers the
                           CUDA algorithms allocate (read by metrics/memory_plan)

Numerics
    Fast mode with a 16-bit weight and fp32_accumulator=False accumulates grad_weight in the
    weight's dtype over at most four token chunks (four roundings).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops.utils import schema_arguments

REDUCTIONS = ("mean", "sum", "none")
MODES = ("low_memory", "fast")

# CPU reference: logits elements per token chunk (16 MiB of fp32 logits).
_REF_CHUNK_ELEMENTS = 1 << 22
# CUDA low-memory mode: bytes of the logits chunk buffer in sweep A (no grad_weight allocated
# yet, so it can be large: fewer rescales of the fp32 accumulator) and in sweep B (lives next
# to grad_weight, so it is what the peak memory pays on top of the two gradients).
SWEEP_A_BUFFER_BYTES = 256 << 20
_SWEEP_B_BUFFER_BYTES = 32 << 20
_MAX_VOCAB_CHUNK = 8192  # one row of a chunk is held in registers by the per-row kernels
# CUDA fast mode: the [T, V] logits buffer's bytes, and T's range (below 2048 rows the GEMMs
# lose speed; above 4096 the buffer grows without a gain).
FAST_BUFFER_BYTES = 512 << 20
_FAST_MIN_ROWS, _FAST_MAX_ROWS = 2048, 4096
# Token chunks are a whole number of GEMM tiles (256, the largest tile edge of cuBLAS's
# configurations): at V = 128256 the buffer alone would give 2092 rows, ragged tiles in all
# three GEMMs and a 1916-row remainder.
FAST_ROW_MULTIPLE = 256
_MAX_INPUT_DTYPE_CHUNKS = 4  # 16-bit grad_weight accumulation: at most four roundings


# --------------------------------------------------------------------------------------------
# options and argument checks (shared by the real kernels and the fake, so bad input fails at
# trace time)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LCEOptions:
    """Everything but the tensors. The custom ops take these as flat arguments (a torch.library
    schema takes no dataclass): `forward_args` / `from_forward_args` convert, in one place."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    reduction: str = "mean"
    group_name: str | None = None  # tensor-parallel group of a vocab-sharded weight
    compute_grad_hidden: bool = True
    compute_grad_weight: bool = True
    mode: str = "low_memory"  # "low_memory" (four GEMMs) or "fast" (three GEMMs)
    fp32_accumulator: bool = True  # fast mode, 16-bit weight: fp32 [V, H] grad_weight buffer
    token_chunk: int = 0  # fast mode and CPU: rows per token chunk; 0 = chosen from the shape

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, "
                f"got {self.reduction!r}"
            )
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(
                "linear_cross_entropy: label_smoothing must be in [0, 1], "
                f"got {self.label_smoothing}"
            )
        if self.z_loss < 0.0:
            raise ValueError(f"linear_cross_entropy: z_loss must be >= 0, got {self.z_loss}")
        if self.mode not in MODES:
            raise ValueError(
                f"linear_cross_entropy: mode must be one of {MODES}, got {self.mode!r}"
            )
        if self.token_chunk < 0:
            raise ValueError(
                f"linear_cross_entropy: token_chunk must be >= 0 (0 = automatic), "
                f"got {self.token_chunk}"
            )

    def forward_args(self) -> tuple:
        """The flat option arguments of linear_cross_entropy_forward, in schema order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_forward_args(cls, *args: Any) -> LCEOptions:
        return cls(*args)

    def backward_args(self) -> tuple:
        """The flat option arguments of linear_cross_entropy_backward (no reduction: "none")."""
        return tuple(
            getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "reduction"
        )

    @classmethod
    def from_backward_args(cls, ignore_index: int, *rest: Any) -> LCEOptions:
        return cls(ignore_index, rest[0], rest[1], "none", *rest[2:])


def _check_args(hidden: Tensor, weight: Tensor, target: Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or target.dim() != 1:
        raise ValueError(
            "linear_cross_entropy: expected hidden [N, H], weight [V, H], target [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != target.shape[0]:
        raise ValueError(
            "linear_cross_entropy: shapes do not fit: hidden [N, H], weight [V, H], target [N]; "
            f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}"
        )
    master = weight.dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16)
    if not hidden.dtype.is_floating_point or (hidden.dtype != weight.dtype and not master):
        raise ValueError(
            "linear_cross_entropy: hidden and weight must share one floating dtype (or weight "
            f"fp32 with bf16/fp16 hidden: master weights); got {hidden.dtype} and {weight.dtype}"
        )
    if target.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: target must be int64 class ids, got {target.dtype}"
        )


def _input_dtype_accumulation(hidden: Tensor, weight: Tensor, opts: LCEOptions) -> bool:
    """Fast mode accumulates grad_weight in a 16-bit weight's own dtype (<= 4 roundings)."""
    return (
        opts.mode == "fast"
        and not opts.fp32_accumulator
        and weight.dtype in (torch.bfloat16, torch.float16)
    )


def _at_most_four_chunks(rows: int, N: int) -> int:
    """Rows per chunk for fast mode's 16-bit grad_weight accumulation: at most four roundings."""
    return max(rows, math.ceil(N / _MAX_INPUT_DTYPE_CHUNKS))


def _fast_token_chunk(
    N: int, V: int, elem_size: int, input_dtype_accumulation: bool, fp32_buffer: int = 0
) -> int:
    """Fast mode's rows per token chunk on a GPU: the logits buffer within FAST_BUFFER_BYTES,
    rounded down to a multiple of FAST_ROW_MULTIPLE, clamped to [2048, 4096] rows; for 16-bit
    accumulation at least N / 4 rows, rounded up to the multiple (still at most four chunks).
    fp32_buffer: the bytes of the fp32 grad_weight buffer that more than one chunk needs (a
    16-bit weight with fp32_accumulator; one chunk's GEMM accumulates in fp32 and rounds
    once): all N rows in one chunk where its logits take no more than the chunked buffer and
    that fp32 buffer together (fewer, larger GEMMs, no fp32 [V, H] pass per chunk)."""
    rows = FAST_BUFFER_BYTES // max(1, V * elem_size)
    rows = rows // FAST_ROW_MULTIPLE * FAST_ROW_MULTIPLE
    rows = max(_FAST_MIN_ROWS, min(_FAST_MAX_ROWS, rows))
    if input_dtype_accumulation:
        rows = _at_most_four_chunks(rows, N)
        rows = math.ceil(rows / FAST_ROW_MULTIPLE) * FAST_ROW_MULTIPLE
    rows = min(rows, max(N, 1))
    if fp32_buffer and N * V * elem_size <= rows * V * elem_size + fp32_buffer:
        return max(N, 1)
    return rows


def _fp32_buffer_bytes(V: int, H: int, weight_dtype: torch.dtype, fp32_accumulator: bool) -> int:
    """The fp32 [V, H] grad_weight buffer chunked fast mode needs for a 16-bit weight with
    fp32_accumulator. (An fp32 weight's fp32 accumulator is the gradient the parameter gets
    anyway: not extra.)"""
    sixteen = weight_dtype in (torch.bfloat16, torch.float16)
    return V * H * 4 if sixteen and fp32_accumulator else 0


def fast_mode_extra_bytes(
    N: int,
    H: int,
    V: int,
    input_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    fp32_accumulator: bool,
) -> int:
    """Bytes fast mode holds beyond what low-memory mode does (CUDA): its [T, V] logits chunk,
    and the fp32 grad_weight buffer where it takes more than one chunk (_fp32_buffer_bytes)."""
    elem = torch.empty((), dtype=input_dtype).element_size()
    sixteen = weight_dtype in (torch.bfloat16, torch.float16)
    fp32_buffer = _fp32_buffer_bytes(V, H, weight_dtype, fp32_accumulator)
    rows = _fast_token_chunk(N, V, elem, sixteen and not fp32_accumulator, fp32_buffer)
    return rows * V * elem + (fp32_buffer if rows < N else 0)


def unfused_extra_bytes(N: int, V: int, input_dtype: torch.dtype) -> int:
    """An upper bound on what Inductor's unfused head + cross-entropy holds beyond the fused
    op's low-memory mode: the [N, V] logits and their gradient in the input dtype (torch.compile
    measured 3.07 and 2.28 bytes per bf16 logit at 8192 x 128256 and 16384 x 151936 on an H100;
    this counts 4)."""
    return 2 * N * V * torch.empty((), dtype=input_dtype).element_size()


# --------------------------------------------------------------------------------------------
# the op schemas' option arguments, generated from LCEOptions' fields
# --------------------------------------------------------------------------------------------

# The options the user-facing ops take as keywords; the others (the tp group, which gradients to
# compute) the public wrappers set.
USER_OPTIONS = tuple(
    f.name
    for f in dataclasses.fields(LCEOptions)
    if f.name not in ("group_name", "compute_grad_hidden", "compute_grad_weight")
)
# The internal forward op takes every field positionally; defaults from `mode` on (the fields
# added after the first release, so older positional callers keep working).
FORWARD_OPTIONS = tuple(f.name for f in dataclasses.fields(LCEOptions))
BACKWARD_OPTIONS = tuple(name for name in FORWARD_OPTIONS if name != "reduction")
_FIRST_DEFAULTED = "mode"


def schema_options(names: tuple[str, ...], *, all_defaults: bool, int_type: str = "int") -> str:
    """The schema's arguments for these LCEOptions fields, in order: "int ignore_index=-100,
    ...". all_defaults=False gives defaults only from _FIRST_DEFAULTED on. int_type: "SymInt"
    where torch.library would infer it (the positional forward and backward ops)."""
    first = names[0] if all_defaults else _FIRST_DEFAULTED
    return schema_arguments(LCEOptions, names, first_default=first, int_type=int_type)
