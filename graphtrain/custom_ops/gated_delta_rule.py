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
    the optional fla-core package; a clear error where it is missing), "auto" (fla where it
    imports, else ours). CPU and float64 run the reference.

Layers (docs/design/gated_delta_rule.md, "The op"): GatedDeltaRuleOptions, the reference
chunk_gated_delta_rule_ref, our Triton kernels _gdr_fwd_kernel and _gdr_bwd_kernel, FLA's
through chunk_gated_delta_rule_fla and its backward, choose_kernels, the registration.

Numerics
    fp32 state and accumulation for bf16/fp32 inputs (float64 stays float64 on the reference).
    On CPU: the model's own chunked code, bitwise the eager result. Our kernels step position by
    position, FLA's chunk by chunk: agreement to fp32 rounding.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

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


def chunk_gated_delta_rule_backward_ref(
    grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, opts: GatedDeltaRuleOptions,
) -> tuple[Tensor, ...]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta): the reference's vjp, recomputed. torch.func rather than
    torch.autograd.grad: inside an op's kernel the autograd keys are excluded from dispatch
    (no graph would be recorded), functorch's transform brings its own."""

    def forward(*xs: Tensor) -> Tensor:
        return chunk_gated_delta_rule_ref(*xs, segments, opts)

    _, vjp = torch.func.vjp(forward, q, k, v, g, beta)
    return vjp(grad_o)


# --------------------------------------------------------------------------------------------
# Triton kernels (ours)
# --------------------------------------------------------------------------------------------


@triton.jit
def _gdr_step(
    state, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, b, t, row, offs_k, offs_v, mask_k, mask_v, ok,
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):  # fmt: skip
    """One step of the recurrence at position t from `state` (S_{t-1}), fp32: loads k, v, the
    decay a = exp(g) (0 where t starts a new document) and beta, then S' = a S_{t-1},
    r = S'^T k, w = beta (v - r), S_t = S' + k w^T. Returns (k, v, a, beta, S', r, w, S_t).
    `ok` False (past the end) loads zeros, which leave the state unchanged. Masks are combined
    with tl.where, not `&`: triton 3.9's interpreter makes int32 of `block & scalar`, which a
    load refuses as a mask."""
    mk, mv = tl.where(ok, mask_k, False), tl.where(ok, mask_v, False)
    k = tl.load(k_ptr + row * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + row, mask=ok, other=0.0).to(tl.float32))
    beta = tl.load(beta_ptr + row, mask=ok, other=0.0).to(tl.float32)
    if HAS_SEGMENTS:
        if t > 0:
            cur = tl.load(seg_ptr + b * T + t, mask=ok, other=0)
            prev = tl.load(seg_ptr + b * T + t - 1, mask=ok, other=0)
            decay = tl.where(cur == prev, decay, 0.0)  # a new document: the state restarts
    decayed = state * decay
    read = tl.sum(decayed * k[:, None], axis=0)  # S'^T k, (BLOCK_V,)
    write = beta * (v - read)
    return k, v, decay, beta, decayed, read, write, decayed + k[:, None] * write[None, :]


@triton.jit
def _gdr_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, o_ptr, H, scale,
    T: tl.constexpr,  # constant: Triton's interpreter needs constant loop bounds
    DK: tl.constexpr, DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # One program: batch b, head h, value columns [pid_v * BLOCK_V, ...). Inputs contiguous
    # (B, T, H, D); the state S (BLOCK_K, BLOCK_V) stays in fp32 registers for the whole row.
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for t in range(T):
        row = (b * T + t) * H + h  # (b, t, h)
        q = tl.load(q_ptr + row * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32) * scale
        _, _, _, _, _, _, _, state = _gdr_step(
            state, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, b, t, row, offs_k, offs_v, mask_k,
            mask_v, True, T, DK, DV, HAS_SEGMENTS,
        )  # fmt: skip
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + row * DV + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _gdr_bwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, do_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,
    h_ptr,  # (B*H, NUM_CHUNKS, BLOCK_K, BLOCK_V) fp32: the state entering each chunk
    scratch_ptr,  # (B*H, CHUNK, BLOCK_K, BLOCK_V) fp32: the states inside the current chunk
    H, scale,
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):  # fmt: skip
    # One program per (batch, head), the whole state: dq and dk sum over the value columns.
    # Pass 1 runs the recurrence and keeps the state entering each chunk; pass 2 walks the
    # chunks backwards, recomputes a chunk's states from its entry state into scratch, then
    # steps back through it carrying dS, the gradient of the state (fp32 throughout).
    pid = tl.program_id(0)
    b = pid // H
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    tile = offs_k[:, None] * BLOCK_V + offs_v[None, :]
    size = BLOCK_K * BLOCK_V
    h_base = h_ptr + pid * NUM_CHUNKS * size
    s_base = scratch_ptr + pid * CHUNK * size
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for t in range(T):
        if t % CHUNK == 0:
            tl.store(h_base + (t // CHUNK) * size + tile, state)
        row = (b * T + t) * H + pid % H
        _, _, _, _, _, _, _, state = _gdr_step(
            state, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, b, t, row, offs_k, offs_v, mask_k,
            mask_v, True, T, DK, DV, HAS_SEGMENTS,
        )  # fmt: skip

    dstate = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for cc in range(NUM_CHUNKS):
        c = NUM_CHUNKS - 1 - cc
        state = tl.load(h_base + c * size + tile)
        for i in range(CHUNK):
            t = c * CHUNK + i
            # The last chunk may be partial: past T, zero k, beta and g leave S unchanged.
            tl.store(s_base + i * size + tile, state)
            row = (b * T + t) * H + pid % H
            _, _, _, _, _, _, _, state = _gdr_step(
                state, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, b, t, row, offs_k, offs_v,
                mask_k, mask_v, t < T, T, DK, DV, HAS_SEGMENTS,
            )  # fmt: skip
        tl.debug_barrier()  # scratch written above is read below
        for j in range(CHUNK):
            i = CHUNK - 1 - j
            t = c * CHUNK + i
            ok = t < T
            prev_state = tl.load(s_base + i * size + tile)  # S_{t-1}
            row = (b * T + t) * H + pid % H
            mk, mv = tl.where(ok, mask_k, False), tl.where(ok, mask_v, False)
            q = tl.load(q_ptr + row * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + row * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
            k, v, decay, beta, decayed, read, write, new_state = _gdr_step(
                prev_state, k_ptr, v_ptr, g_ptr, beta_ptr, seg_ptr, b, t, row, offs_k, offs_v,
                mask_k, mask_v, ok, T, DK, DV, HAS_SEGMENTS,
            )  # fmt: skip
            dstate += (q * scale)[:, None] * do[None, :]  # o = S_t^T (scale q)
            dq = tl.sum(new_state * do[None, :], axis=1) * scale
            dwrite = tl.sum(dstate * k[:, None], axis=0)
            dk = tl.sum(dstate * write[None, :], axis=1)
            dv = beta * dwrite
            dbeta = tl.sum(dwrite * (v - read), axis=0)
            dread = -beta * dwrite
            ddecayed = dstate + k[:, None] * dread[None, :]
            dk += tl.sum(decayed * dread[None, :], axis=1)
            dg = tl.sum(tl.sum(ddecayed * prev_state, axis=1), axis=0) * decay  # da/dg = a
            dstate = ddecayed * decay
            tl.store(dq_ptr + row * DK + offs_k, dq.to(dq_ptr.dtype.element_ty), mask=mk)
            tl.store(dk_ptr + row * DK + offs_k, dk.to(dk_ptr.dtype.element_ty), mask=mk)
            tl.store(dv_ptr + row * DV + offs_v, dv.to(dv_ptr.dtype.element_ty), mask=mv)
            tl.store(dg_ptr + row, dg.to(dg_ptr.dtype.element_ty), mask=ok)
            tl.store(dbeta_ptr + row, dbeta.to(dbeta_ptr.dtype.element_ty), mask=ok)
        tl.debug_barrier()  # the next chunk overwrites scratch


def _launch_args(q: Tensor, v: Tensor, segments: Tensor | None) -> tuple[Tensor, dict]:
    """Both kernels' segment pointer (q where unread: no segments) and shape constants."""
    seg = segments.contiguous() if segments is not None else q
    return seg, dict(T=q.shape[1], DK=q.shape[3], DV=v.shape[3], HAS_SEGMENTS=segments is not None)


def chunk_gated_delta_rule_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor | None,
    opts: GatedDeltaRuleOptions,
) -> Tensor:  # fmt: skip
    """o by _gdr_fwd_kernel."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    if o.numel() == 0:
        return o
    seg, meta = _launch_args(q, v, segments)
    block_v = min(triton.next_power_of_2(meta["DV"]), 32)
    grid = (q.shape[0] * q.shape[2], triton.cdiv(meta["DV"], block_v))
    block_k = triton.next_power_of_2(meta["DK"])
    _gdr_fwd_kernel[grid](
        q, k, v, g, beta, seg, o, q.shape[2], opts.scale, BLOCK_K=block_k, BLOCK_V=block_v, **meta
    )
    return o


def chunk_gated_delta_rule_backward_triton(
    grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    segments: Tensor | None, opts: GatedDeltaRuleOptions, chunk: int | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) by _gdr_bwd_kernel; `chunk` (default opts.chunk_size): positions
    between kept states. Memory: fp32 states of cdiv(T, chunk) + chunk positions per (batch,
    head), e.g. 80 MiB a head at T = 4096, chunk 64, Dk = Dv = 128."""
    chunk = chunk or opts.chunk_size
    q, k, v, g, beta, grad_o = (x.contiguous() for x in (q, k, v, g, beta, grad_o))
    grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
    if v.numel() == 0:
        return tuple(grads)
    seg, meta = _launch_args(q, v, segments)
    B, T, H, _ = q.shape
    block_k, block_v = triton.next_power_of_2(meta["DK"]), triton.next_power_of_2(meta["DV"])
    num_chunks = triton.cdiv(T, chunk)
    f32 = torch.float32
    states = torch.empty(B * H, num_chunks, block_k, block_v, dtype=f32, device=q.device)
    scratch = torch.empty(B * H, chunk, block_k, block_v, dtype=f32, device=q.device)
    # The (Dk, Dv) fp32 state and its gradient live in registers: at 128 x 128, 4 warps spill
    # 18 KB per thread on sm_90, 16 warps 540 B (tests/triton_aot.py).
    _gdr_bwd_kernel[(B * H,)](
        q, k, v, g, beta, seg, grad_o, *grads, states, scratch, H, opts.scale,
        BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=chunk, NUM_CHUNKS=num_chunks, num_warps=16,
        **meta,
    )  # fmt: skip
    return tuple(grads)


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


def choose_kernels(kernels: str, dtype: torch.dtype, device_type: str) -> str:
    """The code that runs the op: "reference" (CPU, float64), else "fla" or "triton" for the
    option `kernels` (module docstring)."""
    if device_type != "cuda" or dtype == torch.float64:
        return "reference"
    if kernels == "fla" or (kernels == "auto" and fla_importable()):
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
