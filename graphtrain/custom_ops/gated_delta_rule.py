"""graphtrain::chunk_gated_delta_rule: the gated delta rule of Gated DeltaNet as one op.

What
    chunk_gated_delta_rule(q, k, v, g, beta, segments?, *, scale, chunk_size, kernels="auto") -> o
        q, k (B, T, H, Dk); v (B, T, H, Dv); g (log decay, <= 0), beta (B, T, H); segments
        (B, T) int64 from models.gated_deltanet.segment_ids or None (one document per row).
        Per head, state S (Dk, Dv) from zero at each row and segment start:
            S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   a_t = exp(g_t)
            o_t = S_t^T (scale q_t)                         -> o (B, T, H, Dv) in v's dtype
    chunk_gated_delta_rule_backward(grad_o, q, k, v, g, beta, segments?, *, <the same options>)
        -> (dq, dk, dv, dg, dbeta), each in its input's dtype.
    chunk_size: the reference's schedule only (kept so that the op on CPU repeats the model's
    eager numerics exactly). kernels, on CUDA: "triton" (ours), "fla" (flash-linear-attention's,
    the optional fla-core package; a clear error where it is missing or refuses the GPU),
    "auto" (fla where it imports and runs, else ours). CPU and float64 run the reference.

Layers (docs/design/gated_delta_rule.md, "The op"): GatedDeltaRuleOptions, the reference
chunk_gated_delta_rule_ref, our CUDA path (the model's chunked form, its loop over chunks in
_gdr_chunk_fwd/bwd_kernel, its inverses by graphtrain::unit_lower_inverse), FLA's through
chunk_gated_delta_rule_fla and its backward, choose_kernels, the registration.

Numerics
    fp32 state and accumulation for bf16/fp32 inputs (float64 stays float64 on the reference);
    on CPU the model's own chunked code, bitwise the eager result; ours on CUDA the same form
    (the loop's products TF32 for 16-bit inputs, 3xTF32 for fp32), FLA's with TF32 dots.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphtrain.custom_ops.unit_lower_inverse import UnitLowerInverse
from graphtrain.custom_ops.utils import schema_arguments
from models.gated_deltanet import chunk_gated_delta_rule as _model_chunk_gated_delta_rule

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNELS = ("auto", "triton", "fla")
_FLA_MODULE = "fla.ops.gated_delta_rule.chunk"  # FLA's chunked gated delta rule (fla-core 0.6)
_FLA_CHUNK = 64  # FLA's chunk size (its default)


@dataclass(frozen=True)
class GatedDeltaRuleOptions:
    """The op's options: one value for the reference, the kernels, the fake and the autograd
    wiring (the schemas' keyword arguments are written from these fields)."""

    scale: float  # q's factor, usually key_head_dim ** -0.5
    chunk_size: int = 64  # positions per chunk of the reference
    kernels: str = "auto"  # the CUDA kernels: one of KERNELS (module docstring)

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")


_SCHEMA_OPTIONS = schema_arguments(
    GatedDeltaRuleOptions, ("scale", "chunk_size", "kernels"), first_default="kernels"
)


def check_args(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None
) -> None:
    """ValueError naming the bad value (shapes, dtypes) for the op's tensors."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be (B, T, H, Dk) of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, T, H, _ = q.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be (B, T, H, Dv) = ({B}, {T}, {H}, Dv), got {tuple(v.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, H):
            raise ValueError(f"{name} must be (B, T, H) = ({B}, {T}, {H}), got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if segments is not None and (tuple(segments.shape) != (B, T) or segments.dtype != torch.int64):
        raise ValueError(
            f"segments must be int64 (B, T) = ({B}, {T}), got {segments.dtype} "
            f"{tuple(segments.shape)}"
        )


# --------------------------------------------------------------------------------------------
# reference (the CPU kernel and the tests' oracle)
# --------------------------------------------------------------------------------------------


def chunk_gated_delta_rule_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None,
    opts: GatedDeltaRuleOptions,
) -> Tensor:  # fmt: skip
    return _model_chunk_gated_delta_rule(
        q, k, v, g, beta, segments, chunk_size=opts.chunk_size, scale=opts.scale
    )


def _vjp(
    forward: Any, grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, opts: GatedDeltaRuleOptions,
) -> tuple[Tensor, ...]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) of forward(q, k, v, g, beta, segments, opts), recomputed.
    torch.func rather than torch.autograd.grad: inside an op's kernel the autograd keys are
    excluded from dispatch (no graph would be recorded), functorch's transform brings its own."""

    def run(*xs: Tensor) -> Tensor:
        return forward(*xs, segments, opts)

    _, vjp = torch.func.vjp(run, q, k, v, g, beta)
    return vjp(grad_o)


def chunk_gated_delta_rule_backward_ref(
    grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, opts: GatedDeltaRuleOptions,
) -> tuple[Tensor, ...]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta): the reference's vjp, recomputed."""
    return _vjp(chunk_gated_delta_rule_ref, grad_o, q, k, v, g, beta, segments, opts)


# --------------------------------------------------------------------------------------------
# Triton kernels (ours): the model's chunked form, its loop over chunks in one kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _chunk_tiles(
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Both loop kernels' masks and offsets within one chunk, for this program's value columns:
    (C x DK), (C x DV) and (DK x DV) tiles of contiguous fp32 blocks."""
    offs_c = tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ck = (offs_c[:, None] < C) & (offs_k[None, :] < DK)
    cv = (offs_c[:, None] < C) & (offs_v[None, :] < DV)
    kv = (offs_k[:, None] < DK) & (offs_v[None, :] < DV)
    tile_ck = offs_c[:, None] * DK + offs_k[None, :]
    tile_cv = offs_c[:, None] * DV + offs_v[None, :]
    tile_kv = offs_k[:, None] * DV + offs_v[None, :]
    return ck, cv, kv, tile_ck, tile_cv, tile_kv


@triton.jit
def _gdr_chunk_fwd_kernel(
    q_state_ptr, intra_ptr, u_v_ptr, u_s_ptr, k_end_ptr, decay_ptr, o_ptr, u_ptr, states_ptr,
    N: tl.constexpr,  # constant: Triton's interpreter needs constant loop bounds
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # One program: one (batch, head) row bh, value columns [pid_v * BLOCK_V, ...); the state
    # S (BLOCK_K, BLOCK_V) in fp32 registers across the N chunks (models' chunk_recurrence):
    #   states[n] = S;  u[n] = u_v[n] - u_s[n] @ S;  o[n] = q_state[n] @ S + intra[n] @ u[n];
    #   S = decay[n] S + k_end[n]^T @ u[n]   (u and states kept for the backward).
    # Inputs contiguous fp32: u_v, o, u (BH, N, C, DV); q_state, u_s, k_end (BH, N, C, DK);
    # intra (BH, N, C, C); decay (BH, N); states (BH, N, DK, DV). Padding rows and columns
    # load as zeros and are not stored.
    bh = tl.program_id(0)
    ck, cv, kv, tile_ck, tile_cv, tile_kv = _chunk_tiles(C, DK, DV, BLOCK_C, BLOCK_K, BLOCK_V)
    offs_c = tl.arange(0, BLOCK_C)
    cc = (offs_c[:, None] < C) & (offs_c[None, :] < C)
    tile_cc = offs_c[:, None] * C + offs_c[None, :]
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for n in range(N):
        chunk = bh * N + n
        tl.store(states_ptr + chunk * DK * DV + tile_kv, state, mask=kv)
        u_s = tl.load(u_s_ptr + chunk * C * DK + tile_ck, mask=ck, other=0.0)
        u = tl.load(u_v_ptr + chunk * C * DV + tile_cv, mask=cv, other=0.0)
        u -= tl.dot(u_s, state, input_precision=PRECISION)
        tl.store(u_ptr + chunk * C * DV + tile_cv, u, mask=cv)
        q_state = tl.load(q_state_ptr + chunk * C * DK + tile_ck, mask=ck, other=0.0)
        intra = tl.load(intra_ptr + chunk * C * C + tile_cc, mask=cc, other=0.0)
        o = tl.dot(q_state, state, input_precision=PRECISION)
        o += tl.dot(intra, u, input_precision=PRECISION)
        tl.store(o_ptr + chunk * C * DV + tile_cv, o, mask=cv)
        k_end = tl.load(k_end_ptr + chunk * C * DK + tile_ck, mask=ck, other=0.0)
        state = state * tl.load(decay_ptr + chunk) + tl.dot(
            tl.trans(k_end), u, input_precision=PRECISION
        )


@triton.jit
def _gdr_chunk_bwd_kernel(
    u_s_ptr, k_end_ptr, decay_ptr, du_ptr, dstates_ptr, du_v_ptr, dnext_ptr,
    N: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # The forward's loop backwards, over the forward's program grid: dS, the gradient of the
    # state leaving chunk n (zero after the last), is kept (dnext[n]) and carried:
    #   du_v[n] = du[n] + k_end[n] @ dS
    #   dS = dstates[n] + decay[n] dS - u_s[n]^T @ du_v[n]       (the gradient of S_n)
    # The rest of the gradient (u_s, k_end, decay) is batched GEMMs over dnext afterwards.
    bh = tl.program_id(0)
    ck, cv, kv, tile_ck, tile_cv, tile_kv = _chunk_tiles(C, DK, DV, BLOCK_C, BLOCK_K, BLOCK_V)
    dstate = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for nn in range(N):
        chunk = bh * N + N - 1 - nn
        tl.store(dnext_ptr + chunk * DK * DV + tile_kv, dstate, mask=kv)
        k_end = tl.load(k_end_ptr + chunk * C * DK + tile_ck, mask=ck, other=0.0)
        du = tl.load(du_ptr + chunk * C * DV + tile_cv, mask=cv, other=0.0)
        du += tl.dot(k_end, dstate, input_precision=PRECISION)
        tl.store(du_v_ptr + chunk * C * DV + tile_cv, du, mask=cv)
        u_s = tl.load(u_s_ptr + chunk * C * DK + tile_ck, mask=ck, other=0.0)
        dstate = (
            tl.load(dstates_ptr + chunk * DK * DV + tile_kv, mask=kv, other=0.0)
            + tl.load(decay_ptr + chunk) * dstate
            - tl.dot(tl.trans(u_s), du, input_precision=PRECISION)
        )


def _chunk_launch(u_s: Tensor, u_v: Tensor, precision: str) -> tuple[tuple[int, int], dict]:
    """Both kernels' grid and constants: tiles of at least 16 (tl.dot's minimum), value columns
    in blocks of 32, 8 warps, no pipelining. At Qwen3-Next's heads (Dk = Dv = 128, chunks of
    64), compiled for sm_90 (tests/triton_aot.py): tf32 199 and 137 registers, 72 and 56 KiB of
    shared memory, no spills (3 stages or 64 columns spill or overflow shared memory); tf32x3
    (fp32 inputs) spills 928 and 268 B a thread (16 columns spill more), none on sm_100."""
    _, _, N, C, DK = u_s.shape
    DV = u_v.shape[-1]
    block_v = max(16, min(32, triton.next_power_of_2(DV)))
    meta = dict(
        N=N, C=C, DK=DK, DV=DV, BLOCK_C=max(16, triton.next_power_of_2(C)),
        BLOCK_K=max(16, triton.next_power_of_2(DK)), BLOCK_V=block_v, PRECISION=precision,
        num_warps=8, num_stages=1,
    )  # fmt: skip
    return (u_s.shape[0] * u_s.shape[1], triton.cdiv(DV, block_v)), meta


def chunk_recurrence_triton(
    q_state: Tensor, intra: Tensor, u_v: Tensor, u_s: Tensor, k_end: Tensor, chunk_decay: Tensor,
    precision: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """models.gated_deltanet.chunk_recurrence by _gdr_chunk_fwd_kernel (fp32 tensors shaped as
    the model makes them): (o, u, states), u and the states entering the chunks kept for the
    backward; differentiable as _ChunkRecurrence."""
    o, u, states = _chunk_recurrence_fake(q_state, intra, u_v, u_s, k_end, chunk_decay, precision)
    grid, meta = _chunk_launch(u_s, u_v, precision)
    _gdr_chunk_fwd_kernel[grid](
        *(x.contiguous() for x in (q_state, intra, u_v, u_s, k_end, chunk_decay)), o, u, states,
        **meta,
    )  # fmt: skip
    return o, u, states


def _chunk_recurrence_fake(q_state, intra, u_v, u_s, k_end, chunk_decay, precision):
    """(o, u, states), contiguous whatever the inputs' strides (the kernels write them so)."""
    states = u_v.new_empty(*u_s.shape[:3], u_s.shape[-1], u_v.shape[-1])  # (B, H, N, Dk, Dv)
    return u_v.new_empty(u_v.shape), u_v.new_empty(u_v.shape), states


def chunk_recurrence_backward_triton(
    do: Tensor, q_state: Tensor, intra: Tensor, u_s: Tensor, k_end: Tensor, chunk_decay: Tensor,
    u: Tensor, states: Tensor, precision: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of chunk_recurrence_triton's o for (q_state, intra, u_v, u_s, k_end,
    chunk_decay): what o's products give batched, _gdr_chunk_bwd_kernel's loop, then the rest
    batched over its dnext."""
    dq_state = do @ states.transpose(-1, -2)  # o = q_state S_n + intra u
    dintra = do @ u.transpose(-1, -2)
    du = intra.transpose(-1, -2) @ do
    dstates = q_state.transpose(-1, -2) @ do
    du_v = u.new_empty(u.shape)
    dnext = states.new_empty(states.shape)
    grid, meta = _chunk_launch(u_s, u, precision)
    _gdr_chunk_bwd_kernel[grid](
        u_s.contiguous(), k_end.contiguous(), chunk_decay.contiguous(), du, dstates, du_v, dnext,
        **meta,
    )  # fmt: skip
    du_s = -(du_v @ states.transpose(-1, -2))  # u = u_v - u_s S_n
    dk_end = u @ dnext.transpose(-1, -2)  # S_{n+1} = decay S_n + k_end^T u
    ddecay = (dnext * states).sum((-1, -2), keepdim=True)
    return dq_state, dintra, du_v, du_s, dk_end, ddecay


# Ops of their own so that torch.func (the op's backward) calls the launchers with plain tensors.
_chunk_recurrence = torch.library.custom_op(
    "graphtrain::gated_delta_chunk_recurrence", chunk_recurrence_triton, mutates_args=()
)
_chunk_recurrence.register_fake(_chunk_recurrence_fake)
_chunk_recurrence_backward = torch.library.custom_op(
    "graphtrain::gated_delta_chunk_recurrence_backward",
    chunk_recurrence_backward_triton,
    mutates_args=(),
)


@_chunk_recurrence_backward.register_fake
def _chunk_recurrence_backward_fake(do, q_state, intra, u_s, k_end, chunk_decay, u, states, prec):
    return tuple(x.new_empty(x.shape) for x in (q_state, intra, u, u_s, k_end, chunk_decay))


class _ChunkRecurrence(torch.autograd.Function):
    """The recurrence op with its backward op as its gradient, in the forward/setup_context form
    torch.func.vjp (the op's backward) differentiates through: returns (o, u, states), the last
    two not differentiable (kept for the backward)."""

    @staticmethod
    def forward(*terms_and_precision: Any) -> tuple[Tensor, Tensor, Tensor]:
        return _chunk_recurrence(*terms_and_precision)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q_state, intra, _, u_s, k_end, chunk_decay, ctx.precision = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(q_state, intra, u_s, k_end, chunk_decay, *output[1:])

    @staticmethod
    def backward(ctx: Any, do: Tensor, *_: Tensor) -> tuple:
        grads = _chunk_recurrence_backward(do.contiguous(), *ctx.saved_tensors, ctx.precision)
        return (*grads, None)


def triton_refusal(chunk_size: int, dk: int) -> str | None:
    """Why our kernels cannot take this chunk size and key head dim (None: they can). A
    chunk's (C x Dk) and (C x C) fp32 tiles sit in shared memory: with C and Dk padded to
    powers of two, C (Dk + C) <= 32768 fits sm_90's 227 KiB (C = 128 with Dk = 128: 160 KiB;
    C = 256 with Dk = 128 would need 432 KiB, C = 128 with Dk = 256 240 KiB)."""
    c, d = max(16, triton.next_power_of_2(chunk_size)), max(16, triton.next_power_of_2(dk))
    if c * (d + c) <= 32768:
        return None
    return (
        f"graphtrain's gated delta rule kernels take chunk_size * (key head dim + chunk_size) "
        f"<= 32768 (powers of two), got chunk_size {chunk_size} and key head dim {dk}: a smaller "
        "model.linear_chunk_size, or compile.gdr_kernels = 'fla'"
    )


def triton_slots(dtype: torch.dtype) -> dict[str, Any]:
    """Our kernels in the chunked form's slots (the loop: 3xTF32 for fp32, else TF32)."""
    precision = "tf32x3" if dtype == torch.float32 else "tf32"
    return {
        "recurrence": lambda *terms: _ChunkRecurrence.apply(*terms, precision)[0],
        "inverse": UnitLowerInverse.apply,
    }


def chunk_gated_delta_rule_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None,
    opts: GatedDeltaRuleOptions,
) -> Tensor:  # fmt: skip
    """o: the model's chunked form (batched over chunks), our kernels in its two slots."""
    if v.numel() == 0:
        return torch.empty_like(v)
    refusal = triton_refusal(opts.chunk_size, q.shape[-1])
    if refusal:
        raise ValueError(refusal)
    return _model_chunk_gated_delta_rule(
        q, k, v, g, beta, segments, chunk_size=opts.chunk_size, scale=opts.scale,
        **triton_slots(v.dtype),
    )  # fmt: skip


def chunk_gated_delta_rule_backward_triton(
    grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, opts: GatedDeltaRuleOptions,
) -> tuple[Tensor, ...]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta): the vjp of chunk_gated_delta_rule_triton, its forward
    recomputed (the chunk terms' autograd in torch, the loop's by _gdr_chunk_bwd_kernel)."""
    if v.numel() == 0:
        return tuple(torch.empty_like(x) for x in (q, k, v, g, beta))
    grads = _vjp(chunk_gated_delta_rule_triton, grad_o, q, k, v, g, beta, segments, opts)
    return tuple(gr.to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta), strict=True))


# --------------------------------------------------------------------------------------------
# FLA's kernels (the optional fla-core package)
# --------------------------------------------------------------------------------------------


def fla_module() -> ModuleType:
    """FLA's chunked gated delta rule module; RuntimeError naming the option and the package
    where it does not import."""
    try:
        return importlib.import_module(_FLA_MODULE)
    except ImportError as e:
        raise RuntimeError(
            "the gated delta rule's kernels='fla' (config: compile.gdr_kernels) needs the "
            "fla-core package (flash-linear-attention; pip install 'graphtrain[fla]'), and "
            f"importing {_FLA_MODULE} failed: {e}"
        ) from e


@functools.cache
def fla_importable() -> bool:
    """Whether FLA's kernels import here (kernels='auto' uses them on CUDA where they do)."""
    try:
        importlib.import_module(_FLA_MODULE)
    except ImportError:
        return False
    return True


def _fla_documents(segments: Tensor | None, q: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """FLA's varlen layout for our documents: (None, None) without segments (FLA takes the (B,
    T) rows as they are); else cu_seqlens over the rows laid end to end (each row start and
    each change of segment starts a sequence), on q's device and on the host. One host sync:
    FLA plans its chunks on the host."""
    if segments is None:
        return None, None
    seg = segments.cpu()
    starts = torch.ones(seg.shape, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([seg.numel()])])
    return cu.to(q.device), cu


def _fla_rows(xs: tuple[Tensor, ...], cu_seqlens: Tensor | None) -> list[Tensor]:
    """(B, T, ...) -> (1, B T, ...) where FLA takes the rows as one packed sequence."""
    if cu_seqlens is None:
        return [x.contiguous() for x in xs]
    return [x.reshape(1, -1, *x.shape[2:]).contiguous() for x in xs]


def chunk_gated_delta_rule_fla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None,
    opts: GatedDeltaRuleOptions,
) -> Tensor:  # fmt: skip
    """o by FLA's chunk_gated_delta_rule (its chunk size, 64; opts.chunk_size is ours)."""
    fla = fla_module()
    if v.numel() == 0:
        return torch.empty_like(v)
    cu, cu_cpu = _fla_documents(segments, q)
    o, _ = fla.chunk_gated_delta_rule(
        *_fla_rows((q, k, v, g, beta), cu), scale=opts.scale, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu
    )
    return o.reshape(v.shape).to(v.dtype)


def chunk_gated_delta_rule_backward_fla(
    grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, opts: GatedDeltaRuleOptions,
) -> tuple[Tensor, ...]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) by FLA's backward, called as its autograd.Function calls it
    (fla-core 0.6, chunk.py), after recomputing the two things its forward saves for it: the
    chunk-local sums of g and the WY matrix A (cheap next to the backward)."""
    fla = fla_module()
    xs = (q, k, v, g, beta)
    if v.numel() == 0:
        return tuple(torch.empty_like(x) for x in xs)
    cu, cu_cpu = _fla_documents(segments, q)
    q_, k_, v_, g_, beta_, do = _fla_rows((*xs, grad_o), cu)
    idx = None if cu is None else fla.prepare_chunk_indices(cu, _FLA_CHUNK, cu_seqlens_cpu=cu_cpu)
    docs = {"cu_seqlens": cu, "chunk_indices": idx, "chunk_size": _FLA_CHUNK}
    g_sum = fla.chunk_local_cumsum(g_, scale=fla.RCP_LN2, **docs)
    _, _, A = fla.chunk_gated_delta_rule_fwd_intra(k=k_, v=v_, g=g_sum, beta=beta_, **docs)
    dq, dk, dv, dbeta, dg, *_ = fla.chunk_gated_delta_rule_bwd(
        q=q_, k=k_, v=v_, g=g_sum, beta=beta_, A=A, scale=opts.scale, initial_state=None,
        do=do, dht=None, **docs,
    )  # fmt: skip
    return tuple(
        d.reshape(x.shape).to(x.dtype) for d, x in zip((dq, dk, dv, dg, dbeta), xs, strict=True)
    )


# --------------------------------------------------------------------------------------------
# op registration
# --------------------------------------------------------------------------------------------


@functools.cache
def fla_refusal() -> str | None:
    """Why FLA's kernels refuse the op's backward on this machine's GPU, or None (asked once:
    the op asks at every call). fla-core (0.6) raises in its gated backward on Hopper with
    Triton >= 3.4.0 and < 3.7.1 unless tilelang is installed (wrong results there, its issue
    #640): an H200 with triton 3.6.0 hit it on 2026-11-28."""
    version = tuple(int(p) for p in triton.__version__.split(".")[:3] if p.isdigit())
    if (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and (3, 4, 0) <= version < (3, 7, 1)
        and importlib.util.find_spec("tilelang") is None
    ):
        return (
            f"fla-core's gated backward refuses Hopper GPUs with triton {triton.__version__} "
            "(>= 3.4.0 and < 3.7.1: wrong results, its issue #640) unless tilelang is installed"
        )
    return None


def choose_kernels(kernels: str, dtype: torch.dtype, device_type: str) -> str:
    """The code that runs the op: "reference" (CPU, float64), else "fla" or "triton" for the
    option `kernels` (module docstring): "auto" takes FLA's where they import and run here
    (fla_refusal), "fla" raises where they refuse."""
    if device_type != "cuda" or dtype == torch.float64:
        return "reference"
    if kernels == "fla":
        refusal = fla_refusal()
        if refusal is not None:
            raise RuntimeError(
                f"compile.gdr_kernels='fla': {refusal}; use 'triton' (graphtrain's kernels) "
                "or 'auto', or install tilelang or triton >= 3.7.1"
            )
        return "fla"
    if kernels == "auto" and fla_importable() and fla_refusal() is None:
        return "fla"
    return "triton"


_FORWARD = {
    "reference": chunk_gated_delta_rule_ref,
    "triton": chunk_gated_delta_rule_triton,
    "fla": chunk_gated_delta_rule_fla,
}


def _backward_reference(*args: Any) -> tuple[Tensor, ...]:
    grads = chunk_gated_delta_rule_backward_ref(*args)
    return tuple(gr.to(x.dtype) for gr, x in zip(grads, args[1:6], strict=True))


_BACKWARD = {
    "reference": _backward_reference,
    "triton": chunk_gated_delta_rule_backward_triton,
    "fla": chunk_gated_delta_rule_backward_fla,
}


@torch.library.custom_op(
    "graphtrain::chunk_gated_delta_rule",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? segments, *, "
        f"{_SCHEMA_OPTIONS}) -> Tensor"
    ),
)
def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None,
    *, scale: float, chunk_size: int, kernels: str = "auto",
) -> Tensor:  # fmt: skip
    """o (B, T, H, Dv) of the gated delta rule (module docstring), on every device."""
    check_args(q, k, v, g, beta, segments)
    opts = GatedDeltaRuleOptions(scale, chunk_size, kernels)
    run = _FORWARD[choose_kernels(kernels, v.dtype, v.device.type)]
    # Contiguous: the op's outputs have one layout on every device (the fake's).
    return run(q, k, v, g, beta, segments, opts).contiguous()


@chunk_gated_delta_rule.register_fake
def _fake(q, k, v, g, beta, segments, *, scale, chunk_size, kernels="auto"):
    check_args(q, k, v, g, beta, segments)
    GatedDeltaRuleOptions(scale, chunk_size, kernels)
    return v.new_empty(v.shape)


@torch.library.custom_op(
    "graphtrain::chunk_gated_delta_rule_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? segments, "
        f"*, {_SCHEMA_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
)
def chunk_gated_delta_rule_backward(
    grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, *, scale: float, chunk_size: int, kernels: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) of chunk_gated_delta_rule, on every device (on CPU the
    reference's vjp)."""
    opts = GatedDeltaRuleOptions(scale, chunk_size, kernels)
    run = _BACKWARD[choose_kernels(kernels, v.dtype, v.device.type)]
    grads = run(grad_o, q, k, v, g, beta, segments, opts)
    return tuple(gr.contiguous() for gr in grads)


@chunk_gated_delta_rule_backward.register_fake
def _backward_fake(grad_o, q, k, v, g, beta, segments, *, scale, chunk_size, kernels="auto"):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:6])
    ctx.options = dict(keyword_only_inputs)


def _backward(ctx: Any, grad_o: Tensor) -> tuple:
    q, k, v, g, beta, segments = ctx.saved_tensors
    grads = torch.ops.graphtrain.chunk_gated_delta_rule_backward(
        grad_o, q, k, v, g, beta, segments, **ctx.options
    )
    return (*grads, None)


chunk_gated_delta_rule.register_autograd(_backward, setup_context=_setup)
