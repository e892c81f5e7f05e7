"""graphtrain::adamw_step: one AdamW step over a list of tensors that also writes their bf16
working copies, in one pass and one launch.

What
    adamw_step(params, grads, exp_avgs, exp_avg_sqs, copies, grad_scale=None, lr=, beta1=,
    beta2=, eps=, weight_decay=, step=) updates, in place, each fp32 param and its moments
    exactly as torch.optim.AdamW does, with `step` the step count after this update (shared by
    the list), and writes each param's new value rounded to nearest-even into copies[i] (bf16)
    when `copies` is given (empty: no copies). Grads are fp32, multiplied as they are read by
    `grad_scale` where given (one fp32 element: clipping's coefficient; the grads are left as
    they are). The moments are fp32, or bf16 with the maths of graphtrain.optim.adamw_bf16
    (widened, updated, stored rounded to nearest-even). One launch of _adamw_step_kernel covers
    every tensor of the list (tables of addresses and of (tensor, block) pairs); the CPU kernel
    is adamw_step_ref (torch's foreach ops: the reference).

Numerics
    fp32 arithmetic in torch's order of operations (on the GPU Triton may contract a multiply
    and an add into one rounding: not bitwise torch's fused kernel, within the bound); tests
    compare several steps with a float64 AdamW on odd sizes within a few fp32 roundings
    (tests/custom_ops/test_adamw_step.py states the bound), and the copies bitwise with the
    fp32 result rounded by torch. bf16 values are read and written as their 16 bits, the same
    bits as torch's .to(torch.bfloat16), under TRITON_INTERPRET=1 too.
    The bytes it saves and the kernel's tables: docs/design/working_weights.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024

# (device, sizes) -> the block table on that device; sizes are those of a parameter group.
_BLOCK_TABLES: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}


def _check(params, grads, exp_avgs, exp_avg_sqs, copies, grad_scale) -> None:
    n = len(params)
    if grad_scale is not None and params:
        if (
            grad_scale.numel() != 1
            or grad_scale.dtype != torch.float32
            or grad_scale.device != params[0].device
        ):
            raise ValueError(
                "adamw_step: grad_scale must be one float32 element on the params' device "
                f"({params[0].device}), got {grad_scale.dtype} of shape "
                f"{tuple(grad_scale.shape)} on {grad_scale.device}"
            )
    for name, tensors in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(tensors) != n:
            raise ValueError(f"adamw_step: {len(tensors)} {name} for {n} params")
    if copies and len(copies) != n:
        raise ValueError(f"adamw_step: {len(copies)} copies for {n} params (give all or none)")
    state_dtypes = {t.dtype for t in (*exp_avgs, *exp_avg_sqs)}
    if len(state_dtypes) > 1 or not state_dtypes <= {torch.float32, torch.bfloat16}:
        raise ValueError(
            f"adamw_step: moments must all be float32 or all bfloat16, got {state_dtypes}"
        )
    for i, p in enumerate(params):
        if p.dtype != torch.float32 or grads[i].dtype != torch.float32:
            raise ValueError(
                f"adamw_step: param {i} is {p.dtype} with a {grads[i].dtype} grad; both must be float32"
            )
        if copies and copies[i].dtype != torch.bfloat16:
            raise ValueError(f"adamw_step: copy {i} is {copies[i].dtype}, expected bfloat16")
        group = (grads[i], exp_avgs[i], exp_avg_sqs[i], *([copies[i]] if copies else []))
        for t in (p, *group):
            if t.shape != p.shape or not t.is_contiguous() or t.device != p.device:
                raise ValueError(
                    f"adamw_step: tensor {i}: every tensor must be contiguous, on {p.device}, of "
                    f"shape {tuple(p.shape)}; got {tuple(t.shape)} on {t.device}"
                )


def adamw_step_ref(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    copies: list[Tensor],
    grad_scale: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
) -> None:
    """torch.optim.AdamW's foreach update (bf16 moments widened to fp32 first, as AdamWBF16 does),
    then copies[i] = params[i] rounded; the CPU kernel and the tests' fp32 reference. The
    grads scaled first, where grad_scale is given: what clipping's foreach multiply gives."""
    if not params:
        return
    if grad_scale is not None:
        grads = torch._foreach_mul(grads, grad_scale)
    m = [t.float() for t in exp_avgs]  # the moments themselves when they are fp32
    v = [t.float() for t in exp_avg_sqs]
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, math.sqrt(1 - beta2**step))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, m, denom, -step_size)
    if exp_avgs[0].dtype != torch.float32:
        torch._foreach_copy_(exp_avgs, m)
        torch._foreach_copy_(exp_avg_sqs, v)
    if copies:
        torch._foreach_copy_(copies, params)


@triton.jit
def _load_f32(ptr, offs, mask, BF16: tl.constexpr):
    """fp32 values at ptr[offs] (ptr to float32, or to int16 holding bf16 bits: widened, exact)."""
    if BF16:
        bits = tl.load(ptr + offs, mask=mask, other=0)
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _store_bf16(ptr, offs, x, mask):
    """x rounded to nearest-even into the bf16 bits at ptr[offs] (ptr to int16); NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    tl.store(ptr + offs, rounded.to(tl.int16), mask=mask)


@triton.jit
def _address(row, i, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """Address i of a table row as a pointer to `dtype`; declared a multiple of 16 bytes when
    ALIGNED (an address read from memory carries no alignment the compiler could see, and
    without one it does not vectorise)."""
    ptr = tl.load(row + i).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _update(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    c_ptr,
    offs,
    mask,
    lerp1,
    beta2,
    lerp2,
    eps,
    decay,
    step_size,
    bias2_sqrt,
    g_scale,
    BF16_STATE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """The update of the elements offs[mask] (see _adamw_step_kernel)."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g * g_scale  # rounded to fp32 as clipping's multiply rounds it
    m = _load_f32(m_ptr, offs, mask, BF16_STATE)
    v = _load_f32(v_ptr, offs, mask, BF16_STATE)
    # torch's order: decay, lerp (weight < 0.5 form), mul + addcmul, denom, addcdiv.
    p = p * decay
    m = m + lerp1 * (g - m)
    v = v * beta2 + lerp2 * (g * g)
    # Correctly rounded sqrt and divisions, as torch's (Triton's plain fp32 "/" is approximate).
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    if BF16_STATE:
        _store_bf16(m_ptr, offs, m, mask)
        _store_bf16(v_ptr, offs, v, mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        _store_bf16(c_ptr, offs, p, mask)


@triton.jit
def _adamw_step_kernel(
    addr_ptr,  # [num_tensors, 5] int64: param, grad, exp_avg, exp_avg_sq, copy
    numel_ptr,  # [num_tensors] int64
    blocks_ptr,  # [num_blocks, 2] int32: tensor index, block index within it
    lerp1,  # 1 - beta1, the moments' weights: computed on the host in float64 as torch's
    beta2,  # scalars are (1 - beta in fp32 arithmetic is 2^-22 off for 0.9 and 0.95)
    lerp2,  # 1 - beta2
    eps,
    decay,  # 1 - lr * weight_decay
    step_size,  # lr / (1 - beta1 ** step)
    bias2_sqrt,  # sqrt(1 - beta2 ** step)
    scale_ptr,  # the grads' scale (one fp32 element), read where HAS_SCALE
    BF16_STATE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes: vector loads and stores
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tensor = tl.load(blocks_ptr + 2 * pid)
    block = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64)
    row = addr_ptr + 5 * tensor.to(tl.int64)
    numel = tl.load(numel_ptr + tensor)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    state: tl.constexpr = tl.int16 if BF16_STATE else tl.float32  # bf16 as its bits
    ptrs = (
        _address(row, 0, tl.float32, ALIGNED),
        _address(row, 1, tl.float32, ALIGNED),
        _address(row, 2, state, ALIGNED),
        _address(row, 3, state, ALIGNED),
        _address(row, 4, tl.int16, ALIGNED),
    )
    if HAS_SCALE:
        g_scale = tl.load(scale_ptr)
    else:
        g_scale = 1.0
    hyper = (lerp1, beta2, lerp2, eps, decay, step_size, bias2_sqrt, g_scale)
    if (block + 1) * BLOCK <= numel:
        # A full block: a constant mask, which the compiler sees through (vector accesses).
        full = tl.full((BLOCK,), True, tl.int1)
        _update(*ptrs, offs, full, *hyper, BF16_STATE, HAS_COPY, HAS_SCALE)
    else:
        _update(*ptrs, offs, offs < numel, *hyper, BF16_STATE, HAS_COPY, HAS_SCALE)


def _block_table(params: list[Tensor]) -> Tensor:
    """[num_blocks, 2] int32 (tensor index, block index) on the params' device, cached by sizes."""
    device = params[0].device
    sizes = tuple(p.numel() for p in params)
    key = (device, sizes)
    if key not in _BLOCK_TABLES:
        counts = torch.tensor([triton.cdiv(n, _BLOCK) for n in sizes], dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(sizes)), counts)
        starts = torch.cumsum(counts, 0) - counts
        block = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
        _BLOCK_TABLES[key] = torch.stack([tensor, block], 1).to(torch.int32).to(device)
    return _BLOCK_TABLES[key]


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host table onto `device` without a host synchronisation (pinned, non-blocking;
    the caching host allocator keeps the buffer until the copy has run)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def adamw_step_triton(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    copies: list[Tensor],
    grad_scale: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
) -> None:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): one launch."""
    keep = [i for i, p in enumerate(params) if p.numel()]  # an empty tensor has no blocks
    if not keep:
        return
    rows = [
        [t.data_ptr() for t in (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])]
        + [copies[i].data_ptr() if copies else 0]
        for i in keep
    ]
    kept = [params[i] for i in keep]
    device = kept[0].device
    addrs = _to_device(torch.tensor(rows, dtype=torch.int64), device)
    numels = _to_device(torch.tensor([p.numel() for p in kept], dtype=torch.int64), device)
    blocks = _block_table(kept)
    _adamw_step_kernel[(blocks.shape[0],)](
        addrs,
        numels,
        blocks,
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        1 - lr * weight_decay,
        lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step),
        grad_scale if grad_scale is not None else numels,  # numels: never read
        BF16_STATE=exp_avgs[0].dtype == torch.bfloat16,
        HAS_COPY=bool(copies),
        HAS_SCALE=grad_scale is not None,
        ALIGNED=all(a % 16 == 0 for row in rows for a in row),
        BLOCK=_BLOCK,
    )


@torch.library.custom_op(
    "graphtrain::adamw_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "copies")
)
def adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    copies: list[Tensor],
    grad_scale: Tensor | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
) -> None:
    """One AdamW step over the lists, writing the copies (see the module docstring). CPU:
    adamw_step_ref; CUDA: the Triton kernel."""
    _check(params, grads, exp_avgs, exp_avg_sqs, copies, grad_scale)
    kernel = adamw_step_triton if params and params[0].is_cuda else adamw_step_ref
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        copies,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        grad_scale=grad_scale,
    )


@adamw_step.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, copies, grad_scale=None, **hyper):
    return None
