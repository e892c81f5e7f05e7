"""graphtrain::chunk_gated_delta_rule: the op against the step-by-step recurrence (float64,
forward and every gradient, documents), its checks and opcheck; our CUDA path (the chunked
form, its loop over chunks in Triton) under TRITON_INTERPRET=1 in fp32 (a child process: the
interpreter is chosen at import); the choice of CUDA kernels (ours or FLA's) and, where fla-core
is installed, FLA's kernels under the interpreter against our reference and through the op; GPU
tests (marker gpu) check the CUDA paths against float64."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import graphtrain.custom_ops.gated_delta_rule as gdr
from graphtrain.custom_ops.utils import interpreting
from models.gated_deltanet import (
    chunk_gated_delta_rule,
    chunk_recurrence,
    gated_delta_rule_recurrent,
    l2norm,
    segment_ids,
)

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
        ({"kernels": "cuda"}, r"kernels must be one of \('auto', 'triton', 'fla'\), got 'cuda'"),
    ],
)
def test_bad_arguments_raise(change, match):
    q, k, v, g, beta = (x.float() for x in _inputs(2, 19, 2, 4, 3))
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "segments": None}
    kwargs = {"scale": 0.5, "chunk_size": 8, "kernels": "auto"}
    for key, value in change.items():
        (kwargs if key in kwargs else args)[key] = value
    with pytest.raises(ValueError, match=match):
        OP(*args.values(), **kwargs)


# ------------------------------------------------------------------------------------------
# the CUDA kernels' choice: ours or FLA's
# ------------------------------------------------------------------------------------------

FLA_INSTALLED = gdr.fla_importable()


@pytest.mark.parametrize(
    "kernels, dtype, device, fla_imports, expected",
    [
        ("auto", torch.bfloat16, "cuda", True, "fla"),
        ("auto", torch.bfloat16, "cuda", False, "triton"),
        ("triton", torch.float32, "cuda", True, "triton"),
        ("fla", torch.float32, "cuda", False, "fla"),  # and fla_module() says what is missing
        ("fla", torch.float64, "cuda", True, "reference"),
        ("fla", torch.float32, "cpu", True, "reference"),
        ("auto", torch.bfloat16, "cpu", True, "reference"),
    ],
)
def test_choose_kernels(monkeypatch, kernels, dtype, device, fla_imports, expected):
    monkeypatch.setattr(gdr, "fla_importable", lambda: fla_imports)
    monkeypatch.setattr(gdr, "fla_refusal", lambda: None)
    assert gdr.choose_kernels(kernels, dtype, device) == expected


def test_fla_refused_on_hopper_with_the_triton_fla_rejects(monkeypatch):
    """fla-core's gated backward raises on Hopper with Triton >= 3.4.0 and < 3.7.1 (seen on an
    H200 with triton 3.6.0): "auto" then takes ours, "fla" says why and what to do."""
    monkeypatch.setattr(gdr, "fla_importable", lambda: True)
    monkeypatch.setattr(gdr.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gdr.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(gdr.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(gdr, "fla_refusal", gdr.fla_refusal.__wrapped__)  # uncached here
    for version, refused in (("3.3.1", False), ("3.6.0", True), ("3.7.1", False)):
        monkeypatch.setattr(gdr.triton, "__version__", version)
        assert (gdr.fla_refusal() is not None) == refused, version
        assert gdr.choose_kernels("auto", torch.bfloat16, "cuda") == (
            "triton" if refused else "fla"
        )
    monkeypatch.setattr(gdr.triton, "__version__", "3.6.0")
    with pytest.raises(RuntimeError, match=r"gdr_kernels='fla': .* triton 3\.6\.0 .* 'triton'"):
        gdr.choose_kernels("fla", torch.bfloat16, "cuda")
    monkeypatch.setattr(gdr.torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert gdr.fla_refusal() is None  # Blackwell: FLA runs


@pytest.mark.parametrize(
    "chunk, dk, fits",
    [(64, 128, True), (128, 128, True), (64, 256, True), (256, 128, False), (128, 256, False)],
)
def test_our_kernels_refuse_chunks_whose_tiles_overflow_shared_memory(chunk, dk, fits):
    """The bound the sm_90 compiles drew (triton_refusal's docstring); the op refuses before any
    launch, naming both values."""
    assert (gdr.triton_refusal(chunk, dk) is None) == fits
    if not fits:
        xs = _inputs(1, 8, 1, dk, 4, dtype=torch.float32)
        opts = gdr.GatedDeltaRuleOptions(scale=0.5, chunk_size=chunk)
        with pytest.raises(ValueError, match=f"got chunk_size {chunk} and key head dim {dk}"):
            gdr.chunk_gated_delta_rule_triton(*xs, None, opts)


def test_fla_missing_is_one_clear_error(monkeypatch):
    """Asked for where fla-core does not import: the op's kernels and the pass (at compile
    time) raise one error naming the option and the package."""
    from graphtrain.passes.gated_delta_rule import _choice

    monkeypatch.setitem(sys.modules, gdr._FLA_MODULE, None)  # import raises ImportError
    xs = [x.float() for x in _inputs(1, 5, 1, 4, 4)]
    opts = gdr.GatedDeltaRuleOptions(scale=0.5, kernels="fla")
    match = r"compile\.gdr_kernels.*needs the fla-core package.*graphtrain\[fla\]"
    with pytest.raises(RuntimeError, match=match):
        gdr.chunk_gated_delta_rule_fla(*xs, None, opts)
    with pytest.raises(RuntimeError, match=match):
        gdr.chunk_gated_delta_rule_backward_fla(xs[2], *xs, None, opts)
    with pytest.raises(RuntimeError, match=match):
        _choice({"gdr_kernels": "fla"})
    assert _choice({"gdr_kernels": "triton"}) == ("triton", "op") and _choice({})[0] == "auto"
    with pytest.raises(ValueError, match=r"compile\.gdr_kernels must be one of .*, got 'cuda'"):
        _choice({"gdr_kernels": "cuda"})


def test_config_field_reaches_the_pass():
    from graphtrain.config import CompileConfig, JobConfig, pass_options

    cfg = JobConfig(compile=CompileConfig(gdr_kernels="triton"))
    assert pass_options(cfg)["gdr_kernels"] == "triton"
    assert pass_options(JobConfig())["gdr_kernels"] == "auto"
    with pytest.raises(ValueError, match=r"compile\.gdr_kernels must be one of .*, got 'cuda'"):
        CompileConfig(gdr_kernels="cuda")


def test_fla_documents_are_our_segments():
    """Rows laid end to end; a sequence starts at each row start and each segment change."""
    q = torch.zeros(2, 37, 1, 1)
    cu, cu_host = gdr._fla_documents(_segments([[5, 20, 2, 10], [37]]), q)
    assert cu.tolist() == cu_host.tolist() == [0, 5, 25, 27, 37, 74]
    assert cu.dtype == torch.int64 and gdr._fla_documents(None, q) == (None, None)


# ------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter (fp32, tiny shapes)
# ------------------------------------------------------------------------------------------


def _interpreter_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: our CUDA path on CPU, fp32 (the model's chunk
    terms, their inverse and the loop over chunks by the Triton kernels, the backward through
    torch.func) against
    the float64 recurrence and its autograd; Dk, Dv not powers of two, chunks shorter than a
    dot tile, a partial last chunk, documents across chunk boundaries (one of length 1), and
    two column blocks of the kernels (Dv 40 and 96). Then the loop alone against the model's
    chunk_recurrence, every input's gradient; then a compiled block running it, and the chunked
    form compiled with our kernels in its slots."""
    assert interpreting()
    for B, T, H, Dk, Dv, chunk, lengths in [
        (1, 9, 1, 4, 4, 4, None),
        (2, 13, 2, 6, 5, 4, [[3, 1, 9], [13]]),
        (1, 7, 1, 8, 40, 4, [[2, 5]]),
        (1, 40, 2, 16, 96, 16, [[17, 23]]),
    ]:
        xs = _inputs(B, T, H, Dk, Dv, seed=T)
        seg = None if lengths is None else _segments(lengths)
        ref = gated_delta_rule_recurrent(*xs, seg, scale=0.6)
        opts = gdr.GatedDeltaRuleOptions(scale=0.6, chunk_size=chunk)
        out = gdr.chunk_gated_delta_rule_triton(*(x.float() for x in xs), seg, opts)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        xs = [x.requires_grad_() for x in xs]
        ref = gated_delta_rule_recurrent(*xs, seg, scale=0.6)
        grad_o = torch.randn_like(ref)
        expected = torch.autograd.grad(ref, xs, grad_o)
        grads = gdr.chunk_gated_delta_rule_backward_triton(
            grad_o.float(), *(x.detach().float() for x in xs), seg, opts
        )
        for name, a, b in zip("q k v g beta".split(), grads, expected, strict=True):
            assert a.dtype == torch.float32 and b.abs().max() > 0, name
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)
        print(f"interpreter B={B} T={T} H={H} Dk={Dk} Dv={Dv} chunk={chunk} ok")

    gen = torch.Generator().manual_seed(3)
    shape = (2, 3, 5, 6)  # B, H, N, C
    leaves = [
        torch.randn(*shape, 12, generator=gen, dtype=torch.float64),  # q_state
        torch.randn(*shape, 6, generator=gen, dtype=torch.float64).tril(),  # intra
        torch.randn(*shape, 40, generator=gen, dtype=torch.float64),  # u_v
        torch.randn(*shape, 12, generator=gen, dtype=torch.float64) * 0.3,  # u_s
        torch.randn(*shape, 12, generator=gen, dtype=torch.float64) * 0.3,  # k_end
        torch.rand(*shape[:3], 1, 1, generator=gen, dtype=torch.float64),  # chunk_decay
    ]
    leaves = [x.requires_grad_() for x in leaves]
    want = chunk_recurrence(*leaves)
    weight = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(want, leaves, weight)
    ours = [x.detach().float().requires_grad_() for x in leaves]
    got = gdr._ChunkRecurrence.apply(*ours, "ieee")[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got, ours, weight.float())
    names = ("q_state", "intra", "u_v", "u_s", "k_end", "chunk_decay")
    for name, a, b in zip(names, grads, expected, strict=True):
        assert b.abs().max() > 0, name
        # fp32 sums of up to ~40 products whose gradients reach ~180 here: an element near
        # zero carries the rounding of its large terms (2^-24 x 180 x sqrt(40) ~ 7e-5), so
        # the absolute bound follows the gradient's scale (a missing or wrong term is O(1))
        atol = 1e-6 * b.abs().max().item()
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=atol, msg=name)
    print("interpreter recurrence ok")
    _compiled_block_with_our_kernels()
    _compiled_chunked_form_with_our_slots()
    print("interpreter all ok")


def _compiled_chunked_form_with_our_slots() -> None:
    """The chunked form under torch.compile (aot_eager) with our kernels in its two slots (the
    benchmark's "our kernels in its slots" row): forward and every gradient against the
    float64 recurrence, two documents."""
    xs = [x.requires_grad_() for x in _inputs(1, 40, 2, 16, 16, seed=5)]
    seg = _segments([[23, 17]])
    ref = gated_delta_rule_recurrent(*xs, seg, scale=0.25)
    grad_o = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, xs, grad_o)
    torch._dynamo.reset()
    slots = gdr.triton_slots(torch.float32)
    fn = torch.compile(
        lambda *ys: chunk_gated_delta_rule(*ys, seg, 16, 0.25, **slots),
        backend="aot_eager", fullgraph=True,
    )  # fmt: skip
    ours = [x.detach().float().requires_grad_() for x in xs]
    out = fn(*ours)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out, ours, grad_o.float())
    for name, a, b in zip("q k v g beta".split(), grads, expected, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)
    print("interpreter compiled chunked form with our slots ok")


def _compiled_block_with_our_kernels() -> None:
    """hybrid-debug's first block compiled as the trainer compiles it (graphtrain's backend,
    aot_eager) with the gated_delta_rule pass on and our CUDA path standing in on CPU
    (choose_kernels made to pick it), in both forms (compile.gdr_form): the op's forward and
    its backward op (torch.func through the loop's ops) inside the compiled graphs, or the
    chunked form traced into them around our two kernels; output and every gradient as
    eager's, two documents in a row."""
    import tempfile
    from pathlib import Path

    from graphtrain.compile import backend, region_config
    from models import MODEL_PRESETS, build_model

    torch.manual_seed(0)
    model = build_model(MODEL_PRESETS["hybrid-debug"])
    model.init_weights(seed=0)
    block = model.layers["0"]
    T = 70
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, T, model.cfg.dim, generator=gen)
    rope = model.rope[torch.arange(T)].expand(2, T, -1, -1)
    doc = torch.tensor([[0] * 30 + [1] * (T - 30), [0] * T])
    picked = []

    def choose(kernels, dtype, device):
        picked.append(kernels)
        return "triton"

    gdr.choose_kernels = choose

    def run(form: str | None, dump: Path) -> tuple:
        xi = x.clone().requires_grad_()
        fn = block
        if form is not None:
            torch._dynamo.reset()
            compiled = backend(
                inner="aot_eager", passes=("+gated_delta_rule",), dump_dir=dump,
                pass_options={"gdr_form": form},
            )  # fmt: skip
            fn = torch.compile(block, backend=compiled, fullgraph=True)
        with region_config():  # as the trainer traces a region
            out = fn(xi, rope, None, doc)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return out.detach(), torch.autograd.grad(out, [xi, *block.parameters()], g)

    with tempfile.TemporaryDirectory() as tmp:
        out, grads = run(None, Path(tmp))
        for form in ("op", "inline"):
            picked.clear()
            out_c, grads_c = run(form, Path(tmp, form))
            # The pass, then the op's forward and backward (op), or the form's trace (inline).
            assert len(picked) >= 3 if form == "op" else picked, (form, picked)
            if form == "inline":  # our kernels in the graphs AOTAutograd made
                graphs = "".join(p.read_text() for p in Path(tmp, form).rglob("00_captured.txt"))
                for op in ("unit_lower_inverse", "gated_delta_chunk_recurrence_backward"):
                    assert f"graphtrain.{op}" in graphs, op
            torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-6)
            for a, b in zip(grads_c, grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    print("interpreter compiled block ok")


def test_triton_kernels_under_interpreter():
    if interpreting():
        _interpreter_checks()
        return
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter all ok")


# ------------------------------------------------------------------------------------------
# FLA's kernels under the interpreter (fp32, tiny shapes; where fla-core is installed)
# ------------------------------------------------------------------------------------------


def _fla_under_interpreter() -> None:
    """Let FLA's Triton kernels run in Triton's interpreter (this process only): its autotuners
    take their first config (the interpreter has no benchmarker), a scalar converts to an index
    through .item() (NumPy 2 refuses int() of a 1-element array), and a loop over a run-time
    bound yields Triton scalars (FLA's kernels call .to() on the loop variable)."""
    import builtins

    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    from triton.runtime.autotuner import Autotuner

    run = Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    patch = interpreter._patch_lang_tensor

    def patch_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda t: int(t.handle.data.item()))

    def kernel_range(*bounds):
        scalars = any(isinstance(b, tl.core.tensor) for b in bounds)
        for i in builtins.range(*(b.__index__() for b in bounds)):
            if scalars:
                yield tl.core.tensor(
                    interpreter.TensorHandle(np.array([i], np.int32), tl.int32), tl.int32
                )
            else:
                yield i

    Autotuner.run = first_config
    interpreter._patch_lang_tensor = patch_tensor
    gdr.fla_module()
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops"):
            module.range = kernel_range


def _fla_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: FLA's chunk_gated_delta_rule (the peer, called as
    its users call it: rows, or one packed row with cu_seqlens) against our op's reference,
    forward and every gradient; then our op with kernels="fla" (FLA's forward and backward
    through our segments, several rows of documents) against the float64 recurrence."""
    assert interpreting()
    _fla_under_interpreter()
    peer = gdr.fla_module().chunk_gated_delta_rule
    for B, T, H, Dk, Dv, lengths in [
        (2, 37, 3, 16, 8, None),
        (1, 70, 2, 8, 16, [5, 20, 2, 43]),
    ]:
        xs = [x.float().requires_grad_() for x in _inputs(B, T, H, Dk, Dv, seed=T)]
        seg = None if lengths is None else _segments([lengths])
        cu = None if lengths is None else torch.tensor([0, *lengths]).cumsum(0)
        ours = OP(*xs, seg, scale=0.6, chunk_size=16)
        theirs, _ = peer(*xs, scale=0.6, cu_seqlens=cu)
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
        grad_o = torch.randn_like(ours)
        for name, a, b in zip(
            "q k v g beta".split(),
            torch.autograd.grad(theirs, xs, grad_o),
            torch.autograd.grad(ours, xs, grad_o),
            strict=True,
        ):
            assert b.abs().max() > 0, name
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        print(f"fla peer B={B} T={T} H={H} Dk={Dk} Dv={Dv} documents={lengths} ok")

    gdr.choose_kernels = lambda kernels, dtype, device: kernels  # the CUDA path, on CPU
    xs = _inputs(2, 45, 2, 8, 8, seed=1)
    seg = _segments([[30, 15], [1, 44]])
    ref = gated_delta_rule_recurrent(*(x.requires_grad_() for x in xs), seg, scale=0.6)
    grad_o = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, xs, grad_o)
    ys = [x.detach().float().requires_grad_() for x in xs]
    out = OP(*ys, seg, scale=0.6, chunk_size=64, kernels="fla")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(
        "q k v g beta".split(), torch.autograd.grad(out, ys, grad_o.float()), expected, strict=True
    ):
        assert a.dtype == torch.float32 and b.abs().max() > 0, name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)
    print("fla all ok")


@pytest.mark.slow
@pytest.mark.skipif(not FLA_INSTALLED, reason="fla-core (the fla extra) is not installed")
def test_fla_kernels_under_interpreter(monkeypatch):
    if interpreting():
        _fla_checks()
        return
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    monkeypatch.setenv("GRAPHTRAIN_TEST_FLA", "1")  # the child runs _fla_checks
    run_interpreter_checks(__file__, "fla all ok")


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------

# fp32 tolerance of the relative error: ours computes in fp32 (torch's GEMMs, 3xTF32 in the
# loop's kernels); FLA's dots take fp32 inputs as TF32 (10-bit mantissa).
KERNELS_FP32_TOL = [
    ("triton", 1e-4),
    pytest.param(
        "fla",
        5e-3,
        marks=pytest.mark.skipif(
            not FLA_INSTALLED or gdr.fla_refusal() is not None,
            reason=f"no fla-core, or it refuses this GPU: {gdr.fla_refusal()}",
        ),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels, fp32_tol", KERNELS_FP32_TOL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_float64(kernels, fp32_tol, dtype):
    xs = _inputs(2, 300, 4, 128, 128, device="cuda")
    seg = _segments([[100, 200], [300]], device="cuda")
    ref = gated_delta_rule_recurrent(*xs, seg)
    out = OP(*(x.to(dtype) for x in xs), seg, scale=128**-0.5, chunk_size=64, kernels=kernels)
    assert out.dtype == dtype
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (fp32_tol if dtype == torch.float32 else 3e-2), err


@pytest.mark.gpu
@pytest.mark.parametrize("kernels, fp32_tol", KERNELS_FP32_TOL)
def test_cuda_backward_matches_float64(kernels, fp32_tol):
    xs = [x.requires_grad_() for x in _inputs(2, 200, 4, 128, 128, device="cuda")]
    seg = _segments([[50, 150], [200]], device="cuda")
    ref = gated_delta_rule_recurrent(*xs, seg)
    grad_o = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, xs, grad_o)
    grads = torch.ops.graphtrain.chunk_gated_delta_rule_backward(
        grad_o.float(), *(x.detach().float() for x in xs), seg, scale=128**-0.5, chunk_size=64,
        kernels=kernels,
    )  # fmt: skip
    for name, a, b in zip("q k v g beta".split(), grads, expected, strict=True):
        err = (a.double() - b).norm() / b.norm()
        assert err < fp32_tol, (name, err)


def test_benchmark_cpu_smoke():
    """benchmarks/gated_delta_rule.py imports, the op equals the reference, the pass fires, its
    rows run ours first and the compiled reference last, a row refused here says why, and a
    peer whose backward alone refuses (FLA's on Hopper with triton 3.6) keeps its forward time."""
    from conftest import run_benchmark_smoke  # not at the top: this file also runs as a script

    run_benchmark_smoke(
        "gated_delta_rule.py",
        "cpu smoke: the op equals the reference, the pass inserts it, refused rows say why",
    )


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _fla_checks() if os.environ.get("GRAPHTRAIN_TEST_FLA") else _interpreter_checks()


@pytest.mark.gpu
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_cuda_inline_form_matches_float64(inner):
    """compile.gdr_form = "inline" on CUDA: the model's recurrence region compiled by
    graphtrain's backend with the pass's chunked_form in its place (AOTAutograd around our two
    kernels, Inductor fusing the rest) in fp32, forward and every gradient against the float64
    recurrence, to the op's fp32 bound."""
    xs = [x.requires_grad_() for x in _inputs(2, 200, 4, 128, 128, device="cuda")]
    seg = _segments([[50, 150], [200]], device="cuda")
    ref = gated_delta_rule_recurrent(*xs, seg)
    grad_o = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, xs, grad_o)
    out, grads = _inline_form_compiled(inner, xs, seg, grad_o)
    assert (out.double() - ref).norm() / ref.norm() < 1e-4
    for name, a, b in zip("q k v g beta".split(), grads, expected, strict=True):
        err = (a.double() - b).norm() / b.norm()
        assert err < 1e-4, (name, err)


def _inline_form_compiled(inner, xs, seg, grad_o):
    """Output and the five gradients of the region models.gated_deltanet.gated_delta_rule in
    fp32, compiled as the trainer compiles it with compile.gdr_form = "inline"."""
    from graphtrain.compile import backend, region_config
    from models.gated_deltanet import gated_delta_rule

    torch._dynamo.reset()
    compiled = backend(
        inner=inner, passes=("+gated_delta_rule",), pass_options={"gdr_form": "inline"}
    )
    fn = torch.compile(
        lambda *ys: gated_delta_rule(*ys, seg, 64, 128**-0.5), backend=compiled, fullgraph=True
    )
    ours = [x.detach().float().requires_grad_() for x in xs]
    with region_config():  # the region stays one node for the pass, as in the trainer
        out = fn(*ours)
    return out, torch.autograd.grad(out, ours, grad_o.float())
