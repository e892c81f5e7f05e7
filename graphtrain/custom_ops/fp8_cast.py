"""graphtrain::fp8_cast: scaled, saturating cast to FP8 (and its transpose, in one read).

What
    fp8_cast(x [R, C], amax, float8_dtype, pow2_scale, transpose, groups=None, *, record=None)
        -> (y [R, C], y_t [C, R] (or [0] without transpose), scale_inv, counts)
    with (scale, scale_inv) = fp8_scale(amax, float8_dtype, pow2_scale):
        scale = fp8_max / max(amax, EPS)      (optionally rounded down to a power of two)
        y = saturate(x * scale) rounded to nearest-even in float8_dtype, y_t = y.T
        counts = [values clipped, nonzero values flushed to 0] (int64)
    amax is a 0-d float32 device tensor (graphtrain::fp8_amax); scale_inv = 1 / scale is what
    torch._scaled_mm takes. x [E, R, C] with amax [E] casts each slice with its own scale in
    one launch. groups (int32 [G], end rows of x's row groups; 2-D x, transpose) writes y_t
    [C, padded_width(R, G)] in padded groups: group g's rows from column padded_offsets[g-1],
    zeros up to padded_offsets[g] (max(16, ceil16(rows)) columns), the columns past the
    last group unspecified (fp8_grouped_mm's wgrad layout). record ("activation",
    "weight" or "gradient") adds the counts to the device-side counters fp8_saturation_stats
    turns into fractions, with no host synchronisation. On CUDA one launch does all of it.

Numerics
    An all-zero x casts to zeros, never NaN. A NaN makes every element NaN; an inf makes that
    element NaN: the trainer's non-finite check stops the run with the step named. Power-of-two
    scales make the scaling exact at the cost of up to one bit of range. The kernel (each byte
    built by integer arithmetic) equals torch's conversion bit for bit (fp8_cast_ref), an
    input NaN's sign too.
    Why both layouts, the per-slice and padded-groups casts, the kernel: docs/design/fp8.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphtrain.custom_ops.utils import interpreting as _interpreting

# amax floor: an all-zero tensor gets a finite scale (fp8_max / EPS fits fp32 for both formats).
EPS = 1e-12
# (max, smallest normal exponent, mantissa bits, clip threshold = max + half the top spacing)
_FORMATS = {
    torch.float8_e4m3fn: (448.0, -6, 3, 448.0 + 16.0),
    torch.float8_e5m2: (57344.0, -14, 2, 57344.0 + 4096.0),
}
FP8_DTYPES = tuple(_FORMATS)

# torch._scaled_grouped_mm's groups along K start at multiples of 16 FP8 elements (16 bytes)
GROUP_ALIGN = 16
TENSOR_CLASSES = ("activation", "weight", "gradient")
_COUNTERS: dict[torch.device, Tensor] = {}  # [class, (clipped, flushed, total)] int64


def _counters(device: torch.device) -> Tensor:
    """The device's saturation counters, made (zeros) on first use."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(len(TENSOR_CLASSES), 3, dtype=torch.int64, device=device)
    return _COUNTERS[device]


def record_saturation(tensor_class: str, counts: Tensor, numel: int) -> None:
    """Add one cast's [clipped, flushed] counts to the device counters of its class."""
    row = _counters(counts.device)[TENSOR_CLASSES.index(tensor_class)]
    row[:2] += counts
    row[2] += numel


def fp8_values_cast() -> int:
    """How many values the FP8 casts recorded since the last reset of the counters, over
    every class and device (a host read: once, not every step)."""
    return int(sum(int(c[:, 2].sum()) for c in _COUNTERS.values()))


def fp8_saturation_stats(reset: bool = True) -> dict[str, Tensor]:
    """Fraction of values clipped at the FP8 maximum and of nonzero values flushed to zero,
    per tensor class, since the last reset: {"fp8/clipped/activation": 0-d float64 tensor, ...,
    "fp8/flushed/gradient": ...}, summed over devices, on the device (no host sync until
    the caller reads them; on the accelerator when a cast ran there, whatever ran first, e.g. a
    CPU reference in the same process). {} when no FP8 op ran."""
    if not _COUNTERS:
        return {}
    device = max(_COUNTERS, key=lambda d: d.type != "cpu")
    total = sum(c.to(device) for c in _COUNTERS.values())
    stats = {}
    for i, name in enumerate(TENSOR_CLASSES):
        n = total[i, 2].clamp_min(1).double()
        stats[f"fp8/clipped/{name}"] = total[i, 0] / n
        stats[f"fp8/flushed/{name}"] = total[i, 1] / n
    if reset:
        for c in _COUNTERS.values():
            c.zero_()
    return stats


def padded_width(R: int, G: int) -> int:
    """Columns of the padded-groups layout of R rows in G groups (static: no host sync)."""
    return -(-R // GROUP_ALIGN) * GROUP_ALIGN + GROUP_ALIGN * G


def _group_sizes(groups: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, padded columns) of each group: max(16, ceil16(rows)) columns; on the device."""
    counts = torch.diff(groups, prepend=groups.new_zeros(1))
    return counts, torch.where(counts > 0, -(-counts // GROUP_ALIGN) * GROUP_ALIGN, GROUP_ALIGN)


def padded_offsets(groups: Tensor) -> Tensor:
    """End columns (int32 [G]) of the padded groups of rows ending at `groups`: group g has
    max(16, ceil16(rows)) columns; on the device, no host sync."""
    return torch.cumsum(_group_sizes(groups)[1], 0, dtype=torch.int32)


def _check(
    x: Tensor,
    amax: Tensor,
    float8_dtype: torch.dtype,
    transpose: bool,
    groups: Tensor | None,
    record: str | None = None,
) -> None:
    if record is not None and record not in TENSOR_CLASSES:
        raise ValueError(f"fp8_cast's record must be one of {TENSOR_CLASSES}, got {record!r}")
    if float8_dtype not in _FORMATS:
        raise ValueError(f"float8_dtype must be one of {FP8_DTYPES}, got {float8_dtype}")
    if (
        x.dim() not in (2, 3)
        or not x.is_floating_point()
        or amax.shape != x.shape[:-2]
        or amax.dtype != torch.float32
    ):
        raise ValueError(
            "fp8_cast takes a 2-D float tensor x with a 0-d float32 amax, or a 3-D x [E, R, C] "
            f"with an [E] float32 amax (one scale per slice), got x {x.dtype} {tuple(x.shape)} "
            f"and amax {amax.dtype} {tuple(amax.shape)}"
        )
    if groups is not None and (
        x.dim() != 2
        or not transpose
        or groups.dim() != 1
        or not groups.numel()
        or groups.dtype != torch.int32
    ):
        raise ValueError(
            "fp8_cast's groups needs a 2-D x, transpose and int32 [G] end rows (G >= 1), got "
            f"x {tuple(x.shape)}, transpose {transpose}, groups {groups.dtype} "
            f"{tuple(groups.shape)}"
        )


def fp8_scale(amax: Tensor, float8_dtype: torch.dtype, pow2_scale: bool) -> tuple[Tensor, Tensor]:
    """(scale, 1 / scale) as float32 device tensors of amax's shape; NaN amax gives NaN, inf
    gives 0. pow2_scale rounds the scale down to a power of two by clearing its mantissa bits
    (exactly 2^floor(log2 scale): a log2 rounded up just below a power of two would give the
    next one, and clip at the format's maximum). The cast kernel computes the same in fp32."""
    a = amax.float().clamp_min(EPS)
    # a divided as the kernel divides (IEEE): torch's `fp8_max / a` is fp8_max * (1 / a), one
    # ulp off for about a quarter of amaxes
    scale = torch.full_like(a, _FORMATS[float8_dtype][0]) / a
    if pow2_scale:
        pow2 = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
        scale = torch.where(scale.isnan(), scale, pow2)
    return scale, scale.reciprocal()


def _y_t_shape(x: Tensor, transpose: bool, groups: Tensor | None) -> tuple:
    *E, R, C = x.shape
    if groups is not None:
        return (C, padded_width(R, groups.shape[0]))
    return (*E, C, R) if transpose else (0,)


def _padded_groups_ref(y: Tensor, groups: Tensor) -> Tensor:
    """y's rows as the columns of the padded-groups layout, zeros elsewhere; the rows past
    groups[-1] after the last group (the kernel leaves those columns unwritten). No host
    read (meta tensors too)."""
    R, C = y.shape
    counts, padded = _group_sizes(groups)
    ends = torch.cumsum(padded, 0, dtype=torch.int32)
    shift = torch.cat([ends - padded - groups + counts, ends[-1:] - groups[-1:]])  # col - row
    rows = torch.arange(R, device=y.device)
    cols = rows + shift.long()[torch.searchsorted(groups, rows.int(), right=True)]
    # as bytes: index_copy_ has no FP8 kernel (torch 2.13, CPU)
    y_t = y.new_zeros((C, padded_width(R, groups.shape[0])), dtype=torch.uint8)
    return y_t.index_copy_(1, cols, y.view(torch.uint8).t()).view(y.dtype)


def fp8_cast_ref(
    x: Tensor,
    amax: Tensor,
    float8_dtype: torch.dtype,
    pow2_scale: bool,
    transpose: bool,
    groups: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fp8_max, _, _, clip = _FORMATS[float8_dtype]
    scale, scale_inv = fp8_scale(amax, float8_dtype, pow2_scale)
    v = x.float() * scale.reshape(*scale.shape, 1, 1)  # one scale per slice
    y = v.clamp(-fp8_max, fp8_max).to(float8_dtype)  # clamp keeps NaN; torch rounds to even
    clipped = (v.abs() > clip).sum()
    flushed = ((x != 0) & (y.view(torch.uint8) & 0x7F == 0)).sum()
    if groups is not None:
        y_t = _padded_groups_ref(y, groups)
    else:  # clone, not contiguous(): a [1, C] tensor's transpose is contiguous, aliasing y
        y_t = y.mT.clone(memory_format=torch.contiguous_format) if transpose else y.new_empty(0)
    return y, y_t, scale_inv, torch.stack([clipped, flushed])


@triton.jit
def _fp8_code(v, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """The FP8 byte of |v| (v fp32, |v| <= the format's max or NaN), sign bit clear, rounded to
    nearest even, in integer arithmetic on v's bits."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # From 2^EMIN up: the mantissa rounded to MBITS bits in place (half less one, plus the kept
    # lowest bit: ties to even; a carry moves into the exponent), the exponent rebiased from
    # 127 to 1 - EMIN.
    keep = bits >> (23 - MBITS)
    normal = ((bits + ((1 << (22 - MBITS)) - 1) + (keep & 1)) >> (23 - MBITS)) - (
        (126 + EMIN) << MBITS
    )
    # Below (FP8 subnormals): adding 2^(EMIN - MBITS + 23) rounds |v| to their spacing
    # 2^(EMIN - MBITS), whose count is then the sum's low bits (2^EMIN itself: 1 << MBITS,
    # its normal code).
    subnormal = (a + 2.0 ** (EMIN - MBITS + 23)).to(tl.int32, bitcast=True) - (
        (EMIN - MBITS + 150) << 23
    )
    # A NaN is the NaN code 0x7F by name: its bits can overflow `normal` (CUDA's own NaN,
    # 0x7FFFFFFF, made it 0x40, 2.0 in E4M3, on an H200); |v| <= max fits below 0x7F.
    return tl.where(a != a, 0x7F, tl.where(a < 2.0**EMIN, subnormal, normal))


@triton.jit
def _scale(amax, FP8_MAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr):
    """fp8_scale's scale of an fp32 amax, as it computes it (IEEE division, the same clamp)."""
    a = tl.where(amax < EPS_, EPS_, amax)  # as clamp_min: NaN stays NaN
    scale = tl.math.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), a)
    if POW2:  # the mantissa bits cleared: 2^floor(log2 scale)
        pow2 = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale != scale, scale, pow2)
    return scale


@triton.jit
def _group_tile(groups_ptr, G, R, pid, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """(first row, end row, first column of y_t, columns of y_t to write) of row tile pid.
    Tiles are numbered group by group, each group's rows from its own first row: every tile's
    columns start at a multiple of 16 (16-byte stores). A group's last tile also writes its
    padding zeros (up to max(16, ceil16(rows)) columns); an empty group gets one tile of
    zeros. Group G (lane G) holds the rows past groups[-1]: in y, not in y_t. Tiles past the
    last (the grid's upper bound) are empty."""
    g = tl.arange(0, BLOCK_G)
    ends = tl.load(groups_ptr + g, mask=g < G, other=R)
    starts = tl.load(groups_ptr + g - 1, mask=(g > 0) & (g <= G), other=0)
    counts = tl.where(g <= G, ends - starts, 0)
    padded = tl.where(g < G, tl.maximum(tl.cdiv(counts, 16), 1) * 16, 0)
    tiles = tl.where(g < G, tl.maximum(tl.cdiv(counts, BLOCK_R), 1), tl.cdiv(counts, BLOCK_R))
    group = tl.sum((tl.cumsum(tiles, 0) <= pid).to(tl.int32), 0)
    tile = pid - tl.sum(tl.where(g < group, tiles, 0), 0)
    here = g == group
    row0 = tl.sum(tl.where(here, starts, 0), 0) + tile * BLOCK_R
    row_end = tl.where(group <= G, tl.sum(tl.where(here, ends, 0), 0), row0)
    col0 = tl.sum(tl.where(g < group, padded, 0), 0) + tile * BLOCK_R
    n_cols = tl.minimum(tl.sum(tl.where(here, padded, 0), 0) - tile * BLOCK_R, BLOCK_R)
    return row0, row_end, col0, n_cols


@triton.jit(do_not_specialize=["NUMEL"])
def _cast_kernel(
    x_ptr,  # [E, R, C]
    amax_ptr,  # [E] fp32
    scale_inv_ptr,  # [E] fp32, written by each slice's first program
    y_ptr,  # [E, R, C] uint8 view of the FP8 output
    yt_ptr,  # [E, C, T_STRIDE] uint8 (TRANSPOSE)
    groups_ptr,  # [G] int32: end rows of x's row groups (GROUPED)
    counts_ptr,  # [2] int64, zeros: clipped, flushed to zero (atomic adds)
    record_ptr,  # [3] int64: a saturation counters row (RECORD): clipped, flushed, total
    R,
    C,
    G,  # groups (GROUPED)
    T_STRIDE,  # row length of y_t: R, or padded_width(R, G) with GROUPED
    NUMEL,  # elements of x, added to the counters' total by program 0 (RECORD)
    FP8_MAX: tl.constexpr,
    EPS_: tl.constexpr,
    POW2: tl.constexpr,
    RECORD: tl.constexpr,
    CLIP: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,  # a power of two above G (GROUPED)
):
    pid_r, pid_c, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GROUPED:
        row0, row_end, col0, n_cols = _group_tile(groups_ptr, G, R, pid_r, BLOCK_R, BLOCK_G)
    else:
        row0, row_end, col0, n_cols = pid_r * BLOCK_R, R, pid_r * BLOCK_R, BLOCK_R
    rows = row0.to(tl.int64) + tl.arange(0, BLOCK_R)
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (rows < row_end)[:, None] & (cols < C)[None, :]
    start = pid_s.to(tl.int64) * R * C  # of the slice in x and y (GROUPED: one slice)
    x_ptr, y_ptr, yt_ptr = x_ptr + start, y_ptr + start, yt_ptr + start
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.load(amax_ptr + pid_s), FP8_MAX, EPS_, POW2)
    if (pid_r == 0) & (pid_c == 0):
        tl.store(
            scale_inv_ptr + pid_s, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        )
    v = x * scale
    clipped = tl.abs(v) > CLIP
    v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    # built by hand, on the GPU too (docs/design/fp8.md: the native conversion stored wrong
    # bytes on an H200; the interpreter's flushes FP8 subnormals)
    code = _fp8_code(v, EMIN, MBITS) | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)
    flushed = (x != 0) & ((code & 0x7F) == 0)
    code = code.to(tl.uint8)
    tl.store(y_ptr + rows[:, None] * C + cols[None, :], code, mask=mask)
    if TRANSPOSE:
        # y_t's tile is y's bytes read back transposed (from L2, after the barrier that
        # orders this block's stores before its loads): transposing in registers made the
        # compiler move the transpose onto x and compute every byte twice, once per layout
        # (docs/design/fp8.md). With GROUPED, col0 is a multiple of 16 and the mask whole
        # 16-column chunks (the rows past row_end are zeros: the group's padding), so the
        # stores are 16 bytes wide.
        r = tl.arange(0, BLOCK_R)
        dst = (col0 // 16).to(tl.int64) * 16 + r
        tl.debug_barrier()
        t_load = (cols < C)[:, None] & (rows < row_end)[None, :]
        code_t = tl.load(y_ptr + rows[None, :] * C + cols[:, None], mask=t_load, other=0)
        if GROUPED:  # the padding: zeros whatever the scale (a NaN one too)
            t_mask = ((r // 16) < (n_cols // 16))[None, :] & (cols < C)[:, None]
        else:
            t_mask = t_load
        tl.store(yt_ptr + cols[:, None] * T_STRIDE + dst[None, :], code_t, mask=t_mask)
    # the tile's counts, added where nonzero (most tiles clip nothing: few atomics contend)
    n_clipped = tl.sum(tl.sum((clipped & mask).to(tl.int32), 1), 0).to(tl.int64)
    n_flushed = tl.sum(tl.sum((flushed & mask).to(tl.int32), 1), 0).to(tl.int64)
    if n_clipped > 0:
        tl.atomic_add(counts_ptr, n_clipped)
        if RECORD:
            tl.atomic_add(record_ptr, n_clipped)
    if n_flushed > 0:
        tl.atomic_add(counts_ptr + 1, n_flushed)
        if RECORD:
            tl.atomic_add(record_ptr + 1, n_flushed)
    if RECORD:
        if (pid_r == 0) & (pid_c == 0) & (pid_s == 0):
            tl.atomic_add(record_ptr + 2, NUMEL.to(tl.int64))


def fp8_cast_triton(
    x: Tensor,
    amax: Tensor,
    float8_dtype: torch.dtype,
    pow2_scale: bool,
    transpose: bool,
    groups: Tensor | None = None,
    record: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp8_cast_ref's outputs from one kernel launch (plus the zeroed counts): the scale, its
    inverse and the counts come from the kernel, which also adds them to the saturation
    counters of `record`'s class. With groups, y_t's columns past the last group are left
    unwritten."""
    if not x.numel():  # no launch: the same outputs from the reference, counts recorded
        return _recorded(
            fp8_cast_ref(x, amax, float8_dtype, pow2_scale, transpose, groups), x, record
        )
    fp8_max, emin, mbits, clip = _FORMATS[float8_dtype]
    x = x.contiguous()
    *E, R, C = x.shape  # E: [] or [num slices]
    y = torch.empty(*E, R, C, dtype=float8_dtype, device=x.device)
    y_t = torch.empty(_y_t_shape(x, transpose, groups), dtype=float8_dtype, device=x.device)
    BLOCK_R, BLOCK_C = 64, 64
    G = groups.shape[0] if groups is not None else 0
    # with groups, at most one more tile a group (and the rows past the last) than R needs
    row_tiles = triton.cdiv(R, BLOCK_R) + (G + 1 if G else 0)
    grid = (row_tiles, triton.cdiv(C, BLOCK_C), E[0] if E else 1)
    counts = torch.zeros(2, dtype=torch.int64, device=x.device)
    scale_inv = torch.empty(amax.shape, dtype=torch.float32, device=x.device)
    _cast_kernel[grid](
        x,
        amax.float().contiguous(),
        scale_inv,
        y.view(torch.uint8),
        y_t.view(torch.uint8),
        groups if G else counts,  # unread without GROUPED
        counts,
        _counters(x.device)[TENSOR_CLASSES.index(record)] if record else counts,  # unread
        R,
        C,
        G,
        y_t.shape[-1] if G else R,
        x.numel(),
        FP8_MAX=fp8_max,
        EPS_=EPS,
        POW2=pow2_scale,
        RECORD=record is not None,
        CLIP=clip,
        EMIN=emin,
        MBITS=mbits,
        TRANSPOSE=transpose,
        GROUPED=G > 0,
        BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C,
        BLOCK_G=triton.next_power_of_2(G + 1),
    )
    return y, y_t, scale_inv, counts


def _use_triton(x: Tensor) -> bool:
    interpreting = _interpreting()
    return x.dtype != torch.float64 and (x.is_cuda or interpreting)


def cast(
    x: Tensor,
    amax: Tensor,
    float8_dtype: torch.dtype,
    pow2_scale: bool,
    transpose: bool,
    groups: Tensor | None = None,
    *,
    record: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x scaled by fp8_max / amax, saturated and rounded to float8_dtype (and transposed,
    in padded groups); with record (a tensor class), its counts are added to the
    saturation counters. graphtrain::fp8_cast's body on every device, and what other ops'
    kernels (fp8_linear's) call directly, where the op's dispatch is host time only: the
    Triton kernel for a CUDA x (which records its counts itself), the reference elsewhere."""
    _check(x, amax, float8_dtype, transpose, groups, record)
    if x.is_cuda and _use_triton(x):
        return fp8_cast_triton(x, amax, float8_dtype, pow2_scale, transpose, groups, record)
    out = fp8_cast_ref(x, amax, float8_dtype, pow2_scale, transpose, groups)
    return _recorded(out, x, record)


fp8_cast = torch.library.custom_op(
    "graphtrain::fp8_cast",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor amax, ScalarType float8_dtype, bool pow2_scale, bool transpose, "
        "Tensor? groups=None, *, str? record=None) "
        "-> (Tensor y, Tensor y_t, Tensor scale_inv, Tensor counts)"
    ),
)(cast)


@fp8_cast.register_fake
def _fp8_cast_fake(x, amax, float8_dtype, pow2_scale, transpose, groups=None, *, record=None):
    _check(x, amax, float8_dtype, transpose, groups, record)
    E = x.shape[:-2]
    return (
        x.new_empty(x.shape, dtype=float8_dtype),
        x.new_empty(_y_t_shape(x, transpose, groups), dtype=float8_dtype),
        x.new_empty(E, dtype=torch.float32),
        x.new_empty((2,), dtype=torch.int64),
    )


def _recorded(out: tuple[Tensor, ...], x: Tensor, record: str | None) -> tuple[Tensor, ...]:
    if record is not None:
        record_saturation(record, out[3], x.numel())
    return out
