"""Pass gated_delta_rule: it replaces the marked recurrence region of a Gated DeltaNet block with
graphtrain::chunk_gated_delta_rule, outputs and gradients as eager; off, the region stays;
other regions are left alone; it fires in every GDN block of hybrid-debug and hybrid-moe-debug
compiled the way the trainer compiles them."""

import dataclasses
import json

import pytest
import torch
from conftest import pass_step

from graphtrain.compile import apply_compile, backend, region_config
from models import MODEL_PRESETS, build_model

OP = "graphtrain.chunk_gated_delta_rule.default"
REGION = "torch.ops.higher_order.invoke_subgraph"
FORM = "graphtrain.passes.gated_delta_rule.chunked_form"  # compile.gdr_form = "inline"


def _model(preset, seed=0):
    torch.manual_seed(seed)
    model = build_model(MODEL_PRESETS[preset])
    model.init_weights(seed=seed)
    return model


def _block_inputs(model, T=70):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, T, model.cfg.dim, generator=gen)
    rope = model.rope[torch.arange(T)].expand(2, T, -1, -1)
    doc = torch.tensor([[0] * 30 + [1] * (T - 30), [0] * T])
    return x, rope, doc


def _run(block, x, rope, doc, dump=None, passes=("+gated_delta_rule",), **pass_options):
    """Output and the gradients of x and of every parameter, eager or compiled (aot_eager)."""
    x = x.detach().clone().requires_grad_()
    fn = block
    if dump is not None:
        torch._dynamo.reset()
        compiled = backend(
            inner="aot_eager", dump_dir=dump, passes=passes, pass_options=pass_options
        )
        fn = torch.compile(block, backend=compiled, fullgraph=True)
    with region_config():  # as apply_compile traces a region: the recurrence stays one node
        out = fn(x, rope, None, doc)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return out.detach(), torch.autograd.grad(out, [x, *block.parameters()], g)


def test_pass_replaces_the_region_and_keeps_values_and_gradients(tmp_path):
    model = _model("hybrid-debug")
    block = model.layers["0"]
    inputs = _block_inputs(model)
    out, grads = _run(block, *inputs)
    out_c, grads_c = _run(block, *inputs, dump=tmp_path)
    step = pass_step(tmp_path, "gated_delta_rule")
    assert step["op_diff"][OP] == 1 and step["op_diff"][REGION] == -1, step
    assert "scale=0.25, chunk_size=64" in step["notes"][0]
    # On CPU the op is the model's code: the output is bitwise eager's; the gradients leave the
    # op contiguous, so sums downstream may round in another order (1 ulp).
    assert torch.equal(out_c, out)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_inline_form_leaves_the_chunked_form_for_the_compiler(tmp_path):
    """compile.gdr_form = "inline": the region becomes a call of chunked_form, which
    AOTAutograd traces through: the graphs it compiles hold the chunked form's own ops (on CPU
    the model's code, its inverse by a triangular solve), no region, no op; eager's numerics."""
    model = _model("hybrid-debug")
    block = model.layers["0"]
    inputs = _block_inputs(model)
    out, grads = _run(block, *inputs)
    out_c, grads_c = _run(block, *inputs, dump=tmp_path, gdr_form="inline")
    step = pass_step(tmp_path, "gated_delta_rule")
    assert step["op_diff"][FORM] == 1 and step["op_diff"][REGION] == -1, step
    assert OP not in step["op_diff"]
    assert "= chunked_form(" in step["notes"][0] and "chunk_size=64); on cpu" in step["notes"][0]
    for part in ("forward", "backward"):
        (traced,) = tmp_path.glob(f"*/{part}/00_captured.txt")
        code = traced.read_text()
        assert "chunked_form" not in code and "invoke_subgraph" not in code
        assert "chunk_gated_delta_rule" not in code
        assert "linalg_solve_triangular" in code, part
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bad_form_is_one_clear_error():
    """The form the pass reads, checked as the config checks it (a backend built by hand has
    no config in front of it)."""
    from graphtrain.config import CompileConfig, JobConfig, pass_options
    from graphtrain.passes.gated_delta_rule import _choice

    assert _choice(pass_options(JobConfig())) == ("auto", "op")
    cfg = JobConfig(compile=CompileConfig(gdr_form="inline"))
    assert _choice(pass_options(cfg)) == ("auto", "inline")
    with pytest.raises(ValueError, match=r"gdr_form must be one of \('op', 'inline'\), got 'x'"):
        _choice({"gdr_form": "x"})
    with pytest.raises(ValueError, match=r"gdr_form='inline' takes graphtrain's kernels"):
        _choice({"gdr_form": "inline", "gdr_kernels": "fla"})
    with pytest.raises(ValueError, match=r"not gdr_kernels='fla': set compile\.gdr_form='op'"):
        CompileConfig(gdr_form="inline", gdr_kernels="fla")
    with pytest.raises(ValueError, match=r"compile\.gdr_form must be one of .*, got 'x'"):
        CompileConfig(gdr_form="x")


def test_a_chunk_our_kernels_cannot_take_leaves_the_region(tmp_path, monkeypatch):
    """Where our CUDA kernels would run (choose_kernels made to say so on CPU) with a chunk
    whose tiles overflow shared memory, the region stays (the model's code runs) and the note
    names the chunk size, the key head dim and the ways out."""
    import graphtrain.custom_ops.gated_delta_rule as gdr

    model = _model("hybrid-debug")
    block = model.layers["0"]
    monkeypatch.setattr(gdr, "choose_kernels", lambda kernels, dtype, device: "triton")
    for module in block.modules():
        if hasattr(module, "chunk_size"):
            monkeypatch.setattr(module, "chunk_size", 256)
    out, grads = _run(block, *_block_inputs(model))
    out_c, grads_c = _run(block, *_block_inputs(model), dump=tmp_path)
    step = pass_step(tmp_path, "gated_delta_rule")
    assert OP not in step["op_diff"], step
    note = step["notes"][0]
    assert "chunk_size 256 and key head dim" in note and "compile.gdr_kernels = 'fla'" in note
    assert torch.equal(out_c, out)
    for a, b in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_pass_off_leaves_the_region_and_eager_numerics(tmp_path):
    model = _model("hybrid-debug")
    block = model.layers["1"]
    inputs = _block_inputs(model, T=33)
    out, grads = _run(block, *inputs)
    out_c, grads_c = _run(block, *inputs, dump=tmp_path, passes=("-gated_delta_rule",))
    (summary,) = list(tmp_path.glob("*/summary.json"))
    labels = [s["label"] for s in json.loads(summary.read_text())]
    assert "gated_delta_rule" not in labels
    captured = pass_step(tmp_path, "captured")["op_counts"]
    assert captured.get(REGION) == 1 and OP not in captured
    assert torch.equal(out_c, out)
    for a, b in zip(grads_c, grads, strict=True):
        assert torch.equal(a, b)


def test_other_regions_are_left_alone(tmp_path):
    @torch.compiler.nested_compile_region
    def region(x):
        return x.sin() * 2

    def fn(x):
        return region(x) + 1

    torch._dynamo.reset()
    x = torch.randn(4)
    compiled = backend(inner="aot_eager", dump_dir=tmp_path, passes=["+gated_delta_rule"])
    out = torch.compile(fn, backend=compiled)(x)
    torch.testing.assert_close(out, x.sin() * 2 + 1)
    step = pass_step(tmp_path, "gated_delta_rule")
    assert step["notes"] == ["no Gated DeltaNet recurrence region in this graph"]
    assert not step["op_diff"]


@pytest.mark.parametrize("preset", ["hybrid-debug", "hybrid-moe-debug"])
def test_pass_fires_in_every_gdn_block_of_the_compiled_model(tmp_path, preset):
    """apply_compile as the trainer calls it (aot_eager here): one op per GDN block graph, none
    in attention blocks; the loss and gradients as eager's to rounding (the fused cross-entropy
    and the op's contiguous gradients change summation orders)."""
    cfg = MODEL_PRESETS[preset]
    eager, compiled = _model(preset), _model(preset)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=gen)
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    pos = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40).clone()
    pos[1] = torch.arange(40)
    from graphtrain.attention import document_causal_mask

    mask = document_causal_mask(doc)
    torch._dynamo.reset()
    apply_compile(compiled, inner="aot_eager", dump_dir=tmp_path, passes=["+gated_delta_rule"])
    losses = []
    for model in (eager, compiled):
        loss = model(ids, ids, position_ids=pos, attn_mask=mask, document_ids=doc)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Blocks of one kind share their compiled code: one graph per block class.
    replaced = 0
    for summary in tmp_path.glob("block-*/summary.json"):
        steps = {s["label"]: s for s in json.loads(summary.read_text())}
        replaced += steps["gated_delta_rule"]["op_diff"].get(OP, 0)
        assert steps["captured"]["op_counts"].get(REGION, 0) == steps["gated_delta_rule"][
            "op_diff"
        ].get(OP, 0)
    kinds = {type(b) for b in compiled.layers.values() if hasattr(b, "linear_attention")}
    assert replaced == len(kinds) >= 1


def test_region_is_plain_code_in_eager():
    """The markers do nothing outside torch.compile: the layer's output equals the chunked
    function called directly."""
    from models.gated_deltanet import chunk_gated_delta_rule, gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 4, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 9, 2, generator=gen), torch.rand(1, 9, 2, generator=gen)
    assert torch.equal(
        gated_delta_rule(q, k, v, g, beta, None, 4, 0.5),
        chunk_gated_delta_rule(q, k, v, g, beta, None, 4, 0.5),
    )
    assert dataclasses.is_dataclass(MODEL_PRESETS["hybrid-debug"])


@pytest.mark.slow
def test_a_region_no_pass_replaced_is_inlined_and_inductor_differentiates_it(tmp_path):
    """The pass off, Inductor: the backend inlines the region before AOT autograd. Kept as an
    invoke_subgraph node, Inductor's compiled backward gave in_proj_ba's gradient ~180% off
    (the recurrence in whole chunks, here one of 64, followed by the gated norm; torch 2.11 to
    2.14, CPU), other gradients up to 5%. Against float64 eager; fp32 rounding is ~1e-6 here."""
    model = _model("hybrid-debug")
    block = model.layers["0"]
    x, rope, doc = _block_inputs(model, T=64)
    want = _run(block.double(), x.double(), rope.double(), doc)[1]
    block.float()
    x = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    be = backend(inner="inductor", dump_dir=tmp_path, passes=("-gated_delta_rule",))
    with region_config():
        out = torch.compile(block, backend=be, fullgraph=True)(x, rope, None, doc)
    assert pass_step(tmp_path, "captured")["op_counts"].get(REGION) == 1
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, [x, *block.parameters()], g)
    names = ["x", *(n for n, _ in block.named_parameters())]
    for name, a, b in zip(names, got, want, strict=True):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-4, (name, err)
    forward = (next(tmp_path.glob("*/forward/summary.json"))).read_text()
    assert "invoke_subgraph" not in forward
