"""Tests of graphtrain::fp8_cast (scaled saturating cast to FP8, with its transpose).

The oracle is torch's own conversion (round to nearest-even, after a clamp to +-fp8_max) of
x * scale, scale = fp8_max / max(amax, EPS). The Triton kernels (fp8_amax's and fp8_cast's)
run under TRITON_INTERPRET=1 in a child process on fp32 inputs and must equal the references
bit for bit: odd shapes (not multiples of the 64 x 64 tile), all-zero, subnormal inputs,
values that round to FP8 subnormals, values beyond amax (saturation), NaN (with all mantissa
bits set, as CUDA makes it: those bits once overflowed the byte's arithmetic) and inf, exact ties
between FP8 neighbours (the kernel builds each byte by integer arithmetic, on the GPU too:
docs/design/fp8.md says why); and the per-slice forms (fp8_amax(x, per_slice=True), fp8_cast of
x [E, R, C] with amax [E]) on a stack of such slices, against the 3-D reference and against
the 2-D reference slice by slice; and the cast that writes y_t in padded row groups (groups
of 0 to 130 rows, tiles that span groups, rows past the last group). GPU tests (marker gpu)
repeat this on CUDA in fp32 and bf16, with whole 64 x 64 tiles in two columns of tiles too
(the shapes where the GPU's own conversion, used for a day, stored wrong bytes were partial
tiles past the first column).
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import graphtrain.custom_ops  # noqa: F401  (registers the ops)
from graphtrain.custom_ops import fp8_amax as fa
from graphtrain.custom_ops import fp8_cast as fc

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(37, 45), (1, 1), (65, 70)]  # (65, 70): 2 x 2 tiles of 64 x 64
SPECIALS = ("random", "zero", "nan", "inf", "subnormal", "saturate", "ties")


def _ties(n: int, g: torch.Generator) -> torch.Tensor:
    """n values cycling through every finite E4M3 value, every midpoint between neighbours
    (normal and subnormal) and the fp32 neighbours of each midpoint, random signs, 448 first:
    with amax 448 the E4M3 scale is 1 and the E5M2 scale 128, so the midpoints are exact ties
    of E4M3's grid and half the values ties of E5M2's (round to nearest-even decides them,
    one fp32 ulp off a tie decides the direction)."""
    grid = torch.arange(128, dtype=torch.uint8).view(E4M3).float()
    grid = grid[grid.isfinite()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    off = (torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0)))
    values = torch.cat([grid, mid, *off])
    values = values[torch.randperm(values.numel(), generator=g)].repeat(n // values.numel() + 1)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return torch.cat([torch.tensor([448.0]), values[: n - 1] * signs[1:]])


def _input(shape: tuple[int, int], special: str, seed: int = 0) -> tuple[torch.Tensor, float]:
    """(x, factor): x over ~60 binades; amax is multiplied by factor (<1 saturates)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-30, 30, shape, generator=g).float()
    )
    x.view(-1)[0] = 0.0
    factor = 1.0
    if special == "zero":
        x.zero_()
    elif special == "nan":  # CUDA's own NaN, all mantissa bits set (a NaN product's there)
        x.view(torch.int32).view(-1)[-1] = 0x7FFFFFFF
    elif special == "inf":
        x.view(-1)[-1] = -float("inf")
    elif special == "subnormal":
        x = x * 1e-40  # fp32 subnormals, amax below EPS
    elif special == "saturate":
        factor = 0.25  # a stale amax: the largest values clip at +-fp8_max
    elif special == "ties":
        x = _ties(x.numel(), g).reshape(shape)
    return x, factor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN equals any NaN: the sign of a NaN the cast makes itself
    (-inf * 0 when amax is inf) is the hardware's, negative on x86, positive on CUDA (seen on an
    H200); a NaN of the input keeps its sign everywhere."""
    return not _mismatch(a, b)


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """Empty where a and b are the same as _same says, else how they differ: how many elements,
    the first few positions with both values (bytes in hex for FP8)."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} against {tuple(b.shape)}"
    a, b = a.cpu(), b.cpu()
    nan = a.float().isnan() & b.float().isnan()
    differ = ~((_bits(a) == _bits(b)) | nan)
    if not differ.any():
        return ""
    where = differ.nonzero()[:4].tolist()
    fmt = (lambda t: hex(int(t))) if a.dtype in (E4M3, E5M2) else (lambda t: t.item())
    firsts = [f"{i}: {fmt(_bits(a)[tuple(i)])} / {fmt(_bits(b)[tuple(i)])}" for i in where]
    return f"{int(differ.sum())} of {a.numel()} differ (got / want at {', '.join(firsts)})"


def _cast_mismatches(got, want, *key) -> list:
    """(*key, output name, how it differs) for each of fp8_cast's outputs that differs."""
    names = ("y", "y_t", "scale_inv", "counts")
    pairs = zip(names, got, want, strict=True)
    return [(*key, name, diff) for name, u, v in pairs if (diff := _mismatch(u, v))]


def check_kernels(run_amax, run_cast, shapes=SHAPES) -> None:
    """Every mismatch at once (a GPU run is rare: the first must not hide the others)."""
    wrong = []
    for shape in shapes:
        for special in SPECIALS:
            x, factor = _input(shape, special)
            amax = fa.fp8_amax_ref(x)
            if diff := _mismatch(run_amax(x), amax):
                wrong.append((shape, special, "amax", diff))
            for dtype, pow2 in ((E4M3, False), (E5M2, False), (E4M3, special == "random")):
                want = fc.fp8_cast_ref(x, amax * factor, dtype, pow2, True)
                got = run_cast(x, amax * factor, dtype, pow2, True)
                wrong += _cast_mismatches(got, want, shape, special, str(dtype), pow2)
    assert not wrong, wrong


def check_slice_kernels(run_amax, run_cast) -> None:
    """Per-slice amax and cast of slices with different specials (a NaN, an all-zero slice, a
    stale amax in one slice only): bit for bit the 3-D reference, which is bit for bit the
    2-D cast of each slice with its own amax (counts summed)."""
    specials = ("random", "zero", "nan", "inf", "saturate")
    for shape in SHAPES[:2]:
        slices = [_input(shape, special, seed=i) for i, special in enumerate(specials)]
        x = torch.stack([t for t, _ in slices])
        factor = torch.tensor([f for _, f in slices])
        amax = fa.fp8_amax_ref(x, per_slice=True)
        assert _same(amax, torch.stack([fa.fp8_amax_ref(t) for t in x]))
        assert _same(run_amax(x, True), amax), shape
        for dtype, pow2 in ((E4M3, False), (E5M2, False), (E4M3, True)):
            want = fc.fp8_cast_ref(x, amax * factor, dtype, pow2, True)
            got = run_cast(x, amax * factor, dtype, pow2, True)
            per_slice = [
                fc.fp8_cast_ref(t, a, dtype, pow2, True)
                for t, a in zip(x, amax * factor, strict=True)
            ]
            y, y_t, s_inv, counts = (torch.stack(list(ts)) for ts in zip(*per_slice, strict=True))
            for name, u, v, w in zip(("y", "y_t", "scale_inv", "counts"), got, want,
                                     (y, y_t, s_inv, counts.sum(0)), strict=True):  # fmt: skip
                assert _same(u, v) and _same(v, w), (shape, dtype, pow2, name)


# (rows of each group, rows past the last): empty groups, groups under 16 rows and over the
# 64-row tile, tiles spanning several groups
GROUPINGS = (([5, 0, 37, 3], 2), ([70, 1, 0, 130], 0), ([16, 64, 17], 9), ([0], 3))


def padded_layout(y: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """y's rows as y_t's columns in padded groups, built group by group on the host: group g
    from column sum of max(16, ceil16(rows)) over the groups before it, zeros elsewhere."""
    want = torch.zeros(y.shape[1], fc.padded_width(y.shape[0], len(counts)), dtype=torch.uint8)
    row = col = 0
    for n in counts:
        want[:, col : col + n] = y.view(torch.uint8)[row : row + n].t()
        row, col = row + n, col + max(16, -(-n // 16) * 16)
    return want.view(y.dtype)


def check_grouped_kernel(run_cast) -> None:
    """y_t in padded groups: bit for bit the reference up to the last group's end (the
    kernel leaves the columns past it unwritten), which is y's rows placed group by group;
    y, scale_inv and counts cover every row, those past the last group too."""
    for (counts, tail), special in zip(
        GROUPINGS, ("random", "nan", "saturate", "ties"), strict=True
    ):
        x, factor = _input((sum(counts) + tail, 70), special)
        amax = fa.fp8_amax_ref(x) * factor
        groups = torch.tensor(counts).cumsum(0).int()
        want = fc.fp8_cast_ref(x, amax, E4M3, False, True, groups)
        got = run_cast(x, amax, E4M3, False, True, groups)
        end = int(fc.padded_offsets(groups)[-1])
        assert want[1].shape == (70, fc.padded_width(x.shape[0], len(counts)))
        assert _same(want[1][:, :end], padded_layout(want[0], counts)[:, :end]), counts
        assert _same(got[1][:, :end], want[1][:, :end]), (counts, special)
        for i, name in ((0, "y"), (2, "scale_inv"), (3, "counts")):
            assert _same(got[i], want[i]), (counts, special, name)


def test_per_slice_reference():
    """The 3-D reference against the 2-D reference slice by slice (CPU; kernels below)."""
    check_slice_kernels(fa.fp8_amax_ref, fc.fp8_cast_ref)
    check_grouped_kernel(fc.fp8_cast_ref)
    x = torch.randn(3, 5, 7)
    amax = torch.ops.graphtrain.fp8_amax(x, True)
    y, y_t, s_inv, _ = torch.ops.graphtrain.fp8_cast(x, amax, E4M3, False, True)
    assert y.shape == (3, 5, 7) and y_t.shape == (3, 7, 5) and s_inv.shape == (3,)
    # each slice's largest |x| maps to fp8_max: each slice has its own scale
    assert torch.equal(y.float().abs().amax((1, 2)), torch.full((3,), 448.0))


def test_reference_numerics():
    """The reference itself: scale, saturation, zeros, NaN/inf, round-to-even, counts."""
    x = torch.tensor([[0.0, 1.0, -2.0, 3.0]])
    y, y_t, s_inv, counts = torch.ops.graphtrain.fp8_cast(x, torch.tensor(3.0), E4M3, False, True)
    # 448 / 3 * [1, 2, 3] = [149.3, 298.7, 448] -> nearest E4M3 [144, 288, 448]
    assert y.float().tolist() == [[0.0, 144.0, -288.0, 448.0]]
    assert torch.equal(y_t.view(torch.uint8), y.t().view(torch.uint8))
    assert s_inv.item() == pytest.approx(3.0 / 448.0) and counts.tolist() == [0, 0]
    # the scale is the IEEE quotient, as the kernel's div_rn (torch's `448 / a` is 448 * (1 / a),
    # one ulp off for about a quarter of these amaxes)
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 100
    for dtype, fp8_max in ((E4M3, 448.0), (E5M2, 57344.0)):
        scale, scale_inv = fc.fp8_scale(amax, dtype, False)
        assert torch.equal(scale, (fp8_max / amax.double()).float())
        assert torch.equal(scale_inv, (1 / scale.double()).float())
    # power-of-two scale 2^7 (the largest power of two <= 448 / 3): scaling is exact
    y, _, s_inv, _ = torch.ops.graphtrain.fp8_cast(x, torch.tensor(3.0), E4M3, True, False)
    assert s_inv.item() == 2.0**-7 and torch.equal(y.float() * s_inv, x)
    # all-zero: zeros and a finite scale
    y, _, s_inv, _ = fc.fp8_cast_ref(torch.zeros(3, 4), torch.tensor(0.0), E4M3, False, False)
    assert torch.equal(y.float(), torch.zeros(3, 4)) and s_inv.isfinite() and s_inv > 0
    # a stale amax: values beyond fp8_max (+ half a step) clip and are counted; a tiny value
    # flushes to zero and is counted
    x = torch.tensor([[1.0, -8.0, 1e-9, 2.0]])
    y, _, _, counts = fc.fp8_cast_ref(x, torch.tensor(1.0), E4M3, False, False)
    assert y.float().tolist() == [[448.0, -448.0, 0.0, 448.0]] and counts.tolist() == [2, 1]
    # NaN anywhere: NaN everywhere; inf: NaN at the inf (scale 0), zeros elsewhere
    x = torch.tensor([[1.0, float("nan")]])
    y, *_ = fc.fp8_cast_ref(x, fa.fp8_amax_ref(x), E5M2, False, False)
    assert y.float().isnan().all()
    x = torch.tensor([[1.0, float("inf")]])
    y, *_ = fc.fp8_cast_ref(x, fa.fp8_amax_ref(x), E4M3, False, False)
    assert y.float()[0, 1].isnan() and y.float()[0, 0] == 0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_error_against_float64(dtype):
    """Dequantised values lie within half an FP8 step of x (relative 2^-4 E4M3, 2^-3 E5M2 for
    normal values), and the largest |x| maps to fp8_max."""
    x = torch.randn(33, 17, generator=torch.Generator().manual_seed(3))
    y, _, s_inv, _ = torch.ops.graphtrain.fp8_cast(x, fa.fp8_amax_ref(x), dtype, False, False)
    back = y.double() * s_inv.double()
    rel = 2.0 ** -(4 if dtype == E4M3 else 3)
    tiny = torch.finfo(dtype).smallest_normal * s_inv.double()
    normal = x.abs() > tiny
    assert ((back - x.double()).abs()[normal] <= rel * x.double().abs()[normal]).all()
    assert y.float().abs().max().item() == torch.finfo(dtype).max


def test_bad_arguments():
    amax = torch.tensor(1.0)
    with pytest.raises(ValueError, match="2-D float tensor"):
        torch.ops.graphtrain.fp8_cast(torch.randn(2, 3, 4), amax, E4M3, False, False)
    with pytest.raises(ValueError, match="float8_dtype must be one of"):
        torch.ops.graphtrain.fp8_cast(torch.randn(2, 3), amax, torch.bfloat16, False, False)
    with pytest.raises(ValueError, match="0-d float32"):
        torch.ops.graphtrain.fp8_cast(torch.randn(2, 3), amax.view(1), E4M3, False, False)
    match = r"or a 3-D x \[E, R, C\] with an \[E\] float32 amax .* \(4, 2, 3\) and amax .* \(\)"
    with pytest.raises(ValueError, match=match):
        torch.ops.graphtrain.fp8_cast(torch.randn(4, 2, 3), amax, E4M3, False, False)
    groups = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"groups needs .* transpose False, groups torch.int32"):
        torch.ops.graphtrain.fp8_cast(torch.randn(2, 3), amax, E4M3, False, False, groups)
    for bad in (groups.long(), groups[:0], groups[None]):
        match = r"int32 \[G\] end rows .* " + re.escape(f"groups {bad.dtype} {tuple(bad.shape)}")
        with pytest.raises(ValueError, match=match):
            torch.ops.graphtrain.fp8_cast(torch.randn(2, 3), amax, E4M3, False, True, bad)


def test_opcheck():
    for transpose in (False, True):
        torch.library.opcheck(
            torch.ops.graphtrain.fp8_cast.default,
            (torch.randn(5, 7), torch.tensor(2.5), E5M2, True, transpose),
        )
        torch.library.opcheck(
            torch.ops.graphtrain.fp8_cast.default,
            (torch.randn(3, 5, 7), torch.tensor([2.5, 0.0, 1.0]), E4M3, False, transpose),
        )
    groups = torch.tensor([2, 2, 4], dtype=torch.int32)
    args = (torch.randn(5, 7), torch.tensor(2.5), E4M3, False, True, groups)
    torch.library.opcheck(torch.ops.graphtrain.fp8_cast.default, args)


def check_recorded(run_cast, device: torch.device) -> None:
    """A cast with record adds its counts and x's size to its class's row of the saturation
    counters of the device it ran on (the kernel's own atomic adds on CUDA), nothing to the
    other rows; an empty x adds nothing but is cast."""
    for shape, special in (((65, 70), "saturate"), ((0, 5), "random")):
        x, factor = _input(shape, special) if shape[0] else (torch.zeros(shape), 1.0)
        amax = fa.fp8_amax_ref(x) * factor
        before = fc._counters(device).cpu().clone()  # .cpu() of a CPU tensor is itself
        counts = run_cast(x, amax, "gradient")[3].cpu()
        delta = fc._counters(device).cpu() - before
        want = torch.zeros_like(delta)
        want[fc.TENSOR_CLASSES.index("gradient")] = torch.tensor([*counts.tolist(), x.numel()])
        assert torch.equal(delta, want), (shape, delta, counts)
        assert counts[0] > 0 or not x.numel(), counts  # "saturate" clips


# ------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter (fp32, small shapes)
# ------------------------------------------------------------------------------------------


def _interpreter_checks() -> None:
    assert fc._use_triton(torch.zeros(1))
    check_kernels(fa.fp8_amax_triton, fc.fp8_cast_triton)
    check_slice_kernels(fa.fp8_amax_triton, fc.fp8_cast_triton)
    check_grouped_kernel(fc.fp8_cast_triton)
    check_recorded(
        lambda x, amax, cls: fc.fp8_cast_triton(x, amax, E4M3, False, True, record=cls),
        torch.device("cpu"),
    )
    print("interpreter all ok")


def test_triton_kernels_under_interpreter():
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter all ok")


@pytest.mark.gpu
def test_cuda_kernels_match_reference():
    """Every check runs, and the test reports every failure (a GPU run is rare)."""

    def cast_cuda(x, amax, *args):
        args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]  # groups
        return [t.cpu() for t in torch.ops.graphtrain.fp8_cast(x.cuda(), amax.cuda(), *args)]

    def amax_cuda(x, *args):
        return torch.ops.graphtrain.fp8_amax(x.cuda(), *args).cpu()

    def bf16_casts():
        """bf16 over one to many tiles and blocks (y_t is each tile's y read back after a
        barrier), fp8_linear's GPU test's shapes first (its bf16 gradients were wrong)."""
        wrong = []
        for shape in ((64, 96), (96, 128), (300, 200), (1000, 1100)):
            for special in ("random", "ties", "nan", "saturate"):
                x, factor = _input(shape, special)
                x = x.to(device="cuda", dtype=torch.bfloat16)
                amax = torch.ops.graphtrain.fp8_amax(x) * factor
                for dtype in (E4M3, E5M2):
                    got = torch.ops.graphtrain.fp8_cast(x, amax, dtype, False, True)
                    want = fc.fp8_cast_ref(x, amax, dtype, False, True)
                    wrong += _cast_mismatches(got, want, shape, special, str(dtype))
        assert not wrong, wrong

    checks = {
        "kernels": lambda: check_kernels(amax_cuda, cast_cuda, [*SHAPES, (128, 192), (64, 96)]),
        "slices": lambda: check_slice_kernels(amax_cuda, cast_cuda),
        "groups": lambda: check_grouped_kernel(cast_cuda),
        "recorded": lambda: check_recorded(
            lambda x, amax, cls: torch.ops.graphtrain.fp8_cast(
                x.cuda(), amax.cuda(), E4M3, False, True, record=cls
            ),
            torch.device("cuda", torch.cuda.current_device()),
        ),
        "bf16": bf16_casts,
    }
    failures = {}
    for name, check in checks.items():
        try:
            check()
        except AssertionError as error:
            failures[name] = str(error)[:4000]
    assert not failures, failures


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
