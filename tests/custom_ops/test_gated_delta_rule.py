"""graphtrain::chunk_gated_delta_rule: the op against the step-by-step recurrence (float64,
forward and every gradient, documents), its checks and opcheck; the Triton forward under
TRITON_INTERPRET=1 in fp32 (a child process: the interpreter is chosen at import); GPU tests
(marker gpu) check the CUDA path against float64."""

import sys

import pytest
import torch
import torch.nn.functional as F

import graphtrain.custom_ops.gated_delta_rule as gdr
from graphtrain.custom_ops.utils import interpreting
from models.gated_deltanet import gated_delta_rule_recurrent, l2norm, segment_ids

OP = torch.ops.graphtrain.chunk_gated_delta_rule


def _inputs(B, T, H, Dk, Dv, seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(B, T, H, Dk), l2norm(randn(B, T, H, Dk)), randn(B, T, H, Dv)
    g = -F.softplus(randn(B, T, H)) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [x.to(dtype=dtype, device=device) for x in (q, k, v, g, beta)]


def _segments(lengths_per_row, device="cpu"):
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    )
    return segment_ids(ids).to(device)


CASES = [
    # B, T, H, Dk, Dv, chunk, documents per row (None: one per row)
    (2, 37, 3, 6, 5, 8, [[5, 20, 2, 10], [37]]),
    (1, 5, 2, 4, 4, 64, None),
    (2, 70, 2, 8, 4, 64, [[1, 69], [64, 6]]),
]


@pytest.mark.parametrize("case", CASES)
def test_op_equals_recurrence_float64_forward_and_gradients(case):
    B, T, H, Dk, Dv, chunk, lengths = case
    xs = [x.requires_grad_() for x in _inputs(B, T, H, Dk, Dv)]
    seg = None if lengths is None else _segments(lengths)
    out = OP(*xs, seg, scale=0.7, chunk_size=chunk)
    ref = gated_delta_rule_recurrent(*xs, seg, scale=0.7)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(ref)
    for name, a, b in zip(
        "q k v g beta".split(),
        torch.autograd.grad((out * w).sum(), xs),
        torch.autograd.grad((ref * w).sum(), xs),
        strict=True,
    ):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("with_segments", [False, True])
def test_opcheck(with_segments):
    xs = [x.float().requires_grad_() for x in _inputs(2, 19, 2, 4, 3)]
    seg = _segments([[7, 12], [19]]) if with_segments else None
    torch.library.opcheck(OP.default, (*xs, seg), {"scale": 0.5, "chunk_size": 8})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"k": torch.zeros(2, 19, 2, 5)}, r"q and k must be \(B, T, H, Dk\) of one shape"),
        ({"v": torch.zeros(2, 18, 2, 3)}, r"v must be \(B, T, H, Dv\)"),
        ({"g": torch.zeros(2, 19)}, r"g must be \(B, T, H\)"),
        ({"segments": torch.zeros(2, 19, dtype=torch.int32)}, "segments must be int64"),
        ({"scale": 0.0}, "scale must be > 0, got 0.0"),
        ({"chunk_size": 0}, "chunk_size must be >= 1, got 0"),
    ],
)
def test_bad_arguments_raise(change, match):
    q, k, v, g, beta = (x.float() for x in _inputs(2, 19, 2, 4, 3))
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "segments": None}
    kwargs = {"scale": 0.5, "chunk_size": 8}
    for key, value in change.items():
        (kwargs if key in kwargs else args)[key] = value
    with pytest.raises(ValueError, match=match):
        OP(*args.values(), **kwargs)


# ------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter (fp32, tiny shapes)
# ------------------------------------------------------------------------------------------


def _interpreter_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: the Triton forward and backward on CPU, fp32,
    against the float64 recurrence and its autograd; Dk, Dv not powers of two, Dv over one
    column block, documents (one of length 1)."""
    assert interpreting()
    for B, T, H, Dk, Dv, lengths in [
        (1, 9, 1, 4, 4, None),
        (2, 13, 2, 6, 5, [[3, 1, 9], [13]]),
        (1, 7, 1, 8, 40, [[2, 5]]),  # two column blocks of 32
    ]:
        xs = _inputs(B, T, H, Dk, Dv, seed=T)
        seg = None if lengths is None else _segments(lengths)
        ref = gated_delta_rule_recurrent(*xs, seg, scale=0.6)
        opts = gdr.GatedDeltaRuleOptions(scale=0.6)
        out = gdr.chunk_gated_delta_rule_triton(*(x.float() for x in xs), seg, opts)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        xs = [x.requires_grad_() for x in xs]
        ref = gated_delta_rule_recurrent(*xs, seg, scale=0.6)
        grad_o = torch.randn_like(ref)
        expected = torch.autograd.grad(ref, xs, grad_o)
        # chunk 4: several chunks of kept states, the last one partial.
        grads = gdr.chunk_gated_delta_rule_backward_triton(
            grad_o.float(), *(x.detach().float() for x in xs), seg, opts, chunk=4
        )
        for name, a, b in zip("q k v g beta".split(), grads, expected, strict=True):
            assert a.dtype == torch.float32 and b.abs().max() > 0, name
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)
        print(f"interpreter B={B} T={T} H={H} Dk={Dk} Dv={Dv} ok")
    print("interpreter all ok")


def test_triton_kernels_under_interpreter():
    if interpreting():
        _interpreter_checks()
        return
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter all ok")


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_matches_float64(dtype, tol):
    xs = _inputs(2, 300, 4, 128, 128, device="cuda")
    seg = _segments([[100, 200], [300]], device="cuda")
    ref = gated_delta_rule_recurrent(*xs, seg)
    out = OP(*(x.to(dtype) for x in xs), seg, scale=128**-0.5, chunk_size=64)
    assert out.dtype == dtype
    err = (out.double() - ref).norm() / ref.norm()
    assert err < tol, err


@pytest.mark.gpu
@needs_cuda
def test_cuda_backward_matches_float64():
    xs = [x.requires_grad_() for x in _inputs(2, 200, 4, 128, 128, device="cuda")]
    seg = _segments([[50, 150], [200]], device="cuda")
    ref = gated_delta_rule_recurrent(*xs, seg)
    grad_o = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, xs, grad_o)
    grads = torch.ops.graphtrain.chunk_gated_delta_rule_backward(
        grad_o.float(), *(x.detach().float() for x in xs), seg, scale=128**-0.5, chunk_size=64
    )
    for name, a, b in zip("q k v g beta".split(), grads, expected, strict=True):
        err = (a.double() - b).norm() / b.norm()
        assert err < 1e-4, (name, err)


def test_benchmark_cpu_smoke():
    """benchmarks/gated_delta_rule.py imports, the op equals the reference, the pass fires."""
    from conftest import run_benchmark_smoke  # not at the top: this file also runs as a script

    run_benchmark_smoke(
        "gated_delta_rule.py", "cpu smoke: the op equals the reference and the pass inserts it"
    )


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
