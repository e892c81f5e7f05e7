"""The CUDA path's plan of linear_cross_entropy, checked on CPU: fast mode's token chunks (whole
GEMM tiles within the buffer budget) and the _lce_dh_kernel launches (one fixed tile per dtype,
nothing autotuned on the live accumulator). The kernels' numerics: test_linear_cross_entropy.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from graphtrain.custom_ops.linear_cross_entropy import cuda, kernels, options
from graphtrain.custom_ops.linear_cross_entropy.options import (
    _FAST_MAX_ROWS,
    _FAST_MIN_ROWS,
    _MAX_INPUT_DTYPE_CHUNKS,
    FAST_BUFFER_BYTES,
    FAST_ROW_MULTIPLE,
    _fast_token_chunk,
    fast_mode_extra_bytes,
)

# Vocabularies of the presets and benchmarks, and odd ones; token counts likewise.
VOCABS = [128256, 151936, 32000, 50257, 262144, 1000003, 257]
TOKENS = [8192, 16384, 4096, 10000, 777, 1]


def test_chunk_at_llama3_vocab_is_whole_tiles():
    """The case of issue 26: V = 128256 in bf16 gave 2092 rows (the 512 MiB buffer / row
    bytes); now 2048, so 8192 tokens are four equal chunks of whole 256-row tiles."""
    assert FAST_BUFFER_BYTES // (128256 * 2) == 2092
    rows = _fast_token_chunk(8192, 128256, 2, False)
    assert rows == 2048
    assert 8192 % rows == 0


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("N", TOKENS)
def test_fp32_accumulation_chunks(N, V, elem):
    """Rows are a multiple of the tile (or all N tokens), in [2048, 4096], and the buffer stays
    within FAST_BUFFER_BYTES unless the 2048-row floor itself is over it; the largest such."""
    rows = _fast_token_chunk(N, V, elem, False)
    want = FAST_BUFFER_BYTES // (V * elem) // FAST_ROW_MULTIPLE * FAST_ROW_MULTIPLE
    want = min(N, max(_FAST_MIN_ROWS, min(_FAST_MAX_ROWS, want)))
    assert rows == want
    if rows < N:
        assert rows % FAST_ROW_MULTIPLE == 0
        assert _FAST_MIN_ROWS <= rows <= _FAST_MAX_ROWS
    if rows > _FAST_MIN_ROWS:
        assert rows * V * elem <= FAST_BUFFER_BYTES
    # One more tile would overflow the buffer (or pass the 4096-row cap).
    if _FAST_MIN_ROWS <= rows < min(N, _FAST_MAX_ROWS):
        assert (rows + FAST_ROW_MULTIPLE) * V * elem > FAST_BUFFER_BYTES


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("N", [*TOKENS, 8193, 40000, 100000])
def test_input_dtype_accumulation_chunks(N, V):
    """16-bit grad_weight accumulation: at most four chunks (four roundings), whole tiles."""
    rows = _fast_token_chunk(N, V, 2, True)
    assert math.ceil(N / rows) <= _MAX_INPUT_DTYPE_CHUNKS
    assert rows == N or rows % FAST_ROW_MULTIPLE == 0
    assert rows >= min(N, _fast_token_chunk(N, V, 2, False))


def test_extra_bytes_follow_the_chunk():
    """The pass's budget figure is the buffer the CUDA path allocates, plus the fp32 grad_weight
    buffer of a 16-bit weight with fp32_accumulator where it takes more than one chunk; where
    one chunk's logits take no more than both, one chunk (no fp32 buffer)."""
    N, H, V = 8192, 4096, 128256
    bf16, f32 = torch.bfloat16, torch.float32
    assert fast_mode_extra_bytes(N, H, V, bf16, f32, True) == 2048 * V * 2
    assert fast_mode_extra_bytes(N, H, V, bf16, bf16, False) == 2048 * V * 2
    # 8192 rows of logits (2.1 GB) against 2048 rows and the fp32 [V, H] buffer (2.6 GB)
    assert _fast_token_chunk(N, V, 2, False, V * H * 4) == N
    assert fast_mode_extra_bytes(N, H, V, bf16, bf16, True) == N * V * 2
    # 16384 x 2048 x 151936: 5.0 GB against 0.6 + 1.2: chunked
    N, H, V = 16384, 2048, 151936
    assert _fast_token_chunk(N, V, 2, False, V * H * 4) == 2048
    assert fast_mode_extra_bytes(N, H, V, bf16, bf16, True) == 2048 * V * 2 + V * H * 4


class _Recorder:
    """Stands in for a Triton kernel: records grid and keyword arguments of each launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))

        return launch


@pytest.mark.parametrize(
    "dtype,tile,launch",
    [
        (torch.bfloat16, kernels._DH_CONFIG_16BIT, kernels._DH_LAUNCH_16BIT),
        (torch.float16, kernels._DH_CONFIG_16BIT, kernels._DH_LAUNCH_16BIT),
        (torch.float32, kernels._DH_CONFIG_FP32, kernels._DH_LAUNCH_FP32),
    ],
)
def test_dh_launch_is_one_fixed_tile(monkeypatch, dtype, tile, launch):
    """Low-memory mode's grad_hidden GEMM (sweep A) at N = 8192, H = 4096, vocab chunks of 8192:
    one launch with the dtype's fixed tile and warps/stages, covering the whole accumulator
    (meta tensors; no autotuner, so nothing runs the in-place update twice or clones the
    accumulator)."""
    rec = _Recorder()
    monkeypatch.setattr(cuda, "_lce_dh_kernel", rec)
    monkeypatch.setattr(cuda, "_interpreting", lambda: False)
    N, H, chunk = 8192, 4096, 8192
    assert (
        cuda._vocab_chunk(
            N, 128256, torch.empty((), dtype=dtype).element_size(), options.SWEEP_A_BUFFER_BYTES
        )
        == chunk
    )
    p = torch.empty(N, chunk, dtype=dtype, device="meta")
    w = torch.empty(chunk, H, dtype=dtype, device="meta")
    acc = torch.empty(N, H, dtype=torch.float32, device="meta")
    alpha = torch.empty(N, dtype=torch.float32, device="meta")
    cuda._launch_dh(p, w, acc, alpha, first=False, has_alpha=True)
    ((grid, kw),) = rec.launches
    assert {k: kw[k] for k in tile} == tile and {k: kw[k] for k in launch} == launch
    assert grid == (triton.cdiv(N, tile["BLOCK_M"]) * triton.cdiv(H, tile["BLOCK_N"]),)
    assert kw["K"] == chunk and kw["INPUT_PRECISION"] == (
        "ieee" if dtype == torch.float32 else "tf32"
    )
    assert not isinstance(kernels._lce_dh_kernel, triton.runtime.autotuner.Autotuner)
    assert not any(
        isinstance(v, triton.runtime.autotuner.Autotuner) for v in vars(kernels).values()
    )


def test_fast_mode_grad_weight_is_cublas_into_the_accumulator(monkeypatch):
    """Fast mode with 16-bit operands and an fp32 weight (the trainer's master head) at
    8192 x 4096 x 128256: grad_weight is one cuBLAS GEMM per token chunk, torch.addmm with
    out_dtype fp32 into the fp32 accumulator itself (the first chunk writes it, beta=0: no zero
    fill and no read; the others add), never the Triton accumulation kernel; the accumulator is
    the gradient returned (meta tensors)."""
    calls = []

    def addmm(acc, a, b, *, beta, out_dtype, out):
        assert beta == (0 if not calls else 1)
        calls.append((acc, a.shape, a.stride(), b.shape, out_dtype, out))
        return out

    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(cuda, "_interpreting", lambda: False)
    for name in ("_lce_dh_kernel", "_lce_stats_kernel", "_lce_grad_kernel"):
        monkeypatch.setattr(cuda, name, _Recorder())
    N, H, V = 8192, 4096, 128256
    hidden = torch.empty(N, H, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(V, H, dtype=torch.float32, device="meta")
    target = torch.empty(N, dtype=torch.int64, device="meta")
    row_scale = torch.empty(N, dtype=torch.float32, device="meta")
    out = cuda._lce_triton(hidden, weight, target, row_scale=row_scale, lse_in=None, mode="fast")
    rows = _fast_token_chunk(N, V, 2, False)
    assert len(calls) == N // rows == 4
    acc = calls[0][0]
    for self_, a_shape, a_stride, b_shape, out_dtype, out_ in calls:
        assert self_ is acc and out_ is acc and out_dtype == torch.float32
        assert acc.shape == (V, H) and acc.dtype == torch.float32
        assert a_shape == (V, rows) and a_stride == (1, V) and b_shape == (rows, H)  # G^T, a view
    assert not cuda._lce_dh_kernel.launches
    assert out[3] is acc  # the fp32 accumulator is the fp32 weight's gradient, not a copy


def test_dh_tiles_fit_hopper():
    """Shared memory of the fixed tiles (num_stages buffers of the P and W tiles) within the
    232,448 B an H100 block may use; the register and spill figures need ptxas (design note)."""
    for tile, launch, elem in (
        (kernels._DH_CONFIG_16BIT, kernels._DH_LAUNCH_16BIT, 2),
        (kernels._DH_CONFIG_FP32, kernels._DH_LAUNCH_FP32, 4),
    ):
        per_stage = (tile["BLOCK_M"] + tile["BLOCK_N"]) * tile["BLOCK_K"] * elem
        assert per_stage * launch["num_stages"] <= 232448
