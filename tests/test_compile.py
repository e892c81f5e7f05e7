"""The graphtrain backend: pass stages, dumps, inner backends, and the numerics contract."""

import contextlib
import json
import logging
import operator
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import graphtrain  # noqa: F401  (registers the backend)
from graphtrain.compile import apply_compile, backend
from graphtrain.passes import order, registry
from graphtrain.passes.registry import all_passes, register_pass
from models.gpt import GPT, PRESETS


def relu_to_clamp_pass(gm, example_inputs, *, ctx):
    """Test pass: replace F.relu(x) with torch.clamp(x, min=0) (same numbers, visible in the graph)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (F.relu, torch.relu):
            node.target = torch.clamp
            node.kwargs = {"min": 0.0}
            changed = True
    ctx.note("replaced relu" if changed else "no relu in this graph")
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


SEEN_POST: list[tuple[str, int]] = []


def count_mm_pass(gm, example_inputs, *, ctx):
    """Test pass: records how many aten.mm nodes each post-grad graph has."""
    n = sum(1 for node in gm.graph.nodes if node.target == torch.ops.aten.mm.default)
    SEEN_POST.append((ctx.region, n))
    ctx.note(f"{n} mm")
    return gm


@pytest.fixture
def test_passes(monkeypatch):
    # Only the test passes: the dumps below list exactly the steps they ran.
    monkeypatch.setattr(registry, "_REGISTRY", {})
    test_order = (("pre_grad", "relu_to_clamp", "test"), ("post_grad", "count_mm", "test"))
    monkeypatch.setattr(order, "PASS_ORDER", test_order)
    monkeypatch.setattr(registry, "PASS_ORDER", test_order)
    register_pass("relu_to_clamp", stage="pre_grad", default_on=False, preserves_numerics=True)(
        relu_to_clamp_pass
    )
    register_pass("count_mm", stage="post_grad", default_on=False, preserves_numerics=True)(
        count_mm_pass
    )
    SEEN_POST.clear()


def mlp(x, w1, w2):
    return (F.relu(x @ w1) @ w2).sum()


def inputs():
    torch.manual_seed(0)
    return (
        torch.randn(5, 7, requires_grad=True),
        torch.randn(7, 9, requires_grad=True),
        torch.randn(9, 3, requires_grad=True),
    )


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_passes_run_in_both_stages(test_passes, tmp_path, inner):
    be = backend(
        passes=["+relu_to_clamp", "+count_mm"], inner=inner, dump_dir=tmp_path, region="mlp"
    )
    args = inputs()
    out = torch.compile(mlp, backend=be, fullgraph=True)(*args)
    out.backward()
    grads = [a.grad.clone() for a in args]
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    ref = mlp(*ref_args)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for g, a in zip(grads, ref_args, strict=True):
        torch.testing.assert_close(g, a.grad)
    # Forward has 2 mm; backward 3 or 4 (no grad for x is not known here: all need grad -> 4).
    assert [r for r, _ in SEEN_POST] == ["mlp/forward", "mlp/backward"]
    assert SEEN_POST[0][1] == 2 and SEEN_POST[1][1] == 4

    summary = json.loads((tmp_path / "mlp-0" / "summary.json").read_text())
    assert [s["label"] for s in summary] == ["captured", "relu_to_clamp"]
    assert summary[1]["notes"] == ["replaced relu"]
    assert summary[1]["op_diff"] == {"torch.clamp": 1, "torch.nn.functional.relu": -1}
    assert "clamp" in (tmp_path / "mlp-0" / "01_relu_to_clamp.diff.txt").read_text()
    for kind in ("forward", "backward"):
        steps = json.loads((tmp_path / "mlp-0" / kind / "summary.json").read_text())
        assert [s["label"] for s in steps] == ["captured", "count_mm"]


def test_pass_off_leaves_graph_alone(test_passes, tmp_path):
    be = backend(passes=["+count_mm"], inner="aot_eager", dump_dir=tmp_path, region="mlp")
    torch.compile(mlp, backend=be)(*inputs())
    summary = json.loads((tmp_path / "mlp-0" / "summary.json").read_text())
    assert [s["label"] for s in summary] == ["captured"]
    assert summary[0]["op_counts"].get("torch.nn.functional.relu") == 1


def test_registered_backend_name_and_errors():
    out = torch.compile(lambda x: x * 2 + 1, backend="graphtrain")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0))
    with pytest.raises(ValueError, match=re.escape("compile.backend must be one of")):
        backend(inner="tvm")
    with pytest.raises(ValueError, match="'\\+no_such_pass'"):
        backend(passes=["+no_such_pass"])


def _train_losses(model, steps, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in data[:steps]:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _tiny(seed=0):
    with torch.device("meta"):
        model = GPT(PRESETS["tiny"])
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_numerics_preserving_passes_are_bitwise_equal_to_eager(tmp_path):
    """The tiny model's loss over 3 steps: eager == graphtrain(aot_eager) bit for bit, with
    every numerics-preserving pass on and the others off."""
    switches = [("+" if p.preserves_numerics else "-") + p.name for p in all_passes()]
    torch.manual_seed(0)
    data = [(torch.randint(0, 8192, (2, 64)), torch.randint(0, 8192, (2, 64))) for _ in range(3)]
    eager = _train_losses(_tiny(), 3, data)
    compiled_model = _tiny()
    apply_compile(compiled_model, passes=switches, inner="aot_eager", dump_dir=tmp_path)
    compiled = _train_losses(compiled_model, 3, data)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b), (a.item(), b.item())
    assert (tmp_path / "block-0" / "summary.json").exists()
    assert (tmp_path / "head_loss-0" / "summary.json").exists()
    assert not (tmp_path / "block-1").exists()  # all blocks share one compiled graph


def test_operator_matmul_is_named():
    from graphtrain.passes.dump import op_counts

    gm = torch.fx.symbolic_trace(lambda a, b: operator.matmul(a, b))
    assert op_counts(gm) == {"_operator.matmul": 1}


def test_regions_that_may_break_still_trace_data_dependent_shapes(tmp_path):
    """Compiled with fullgraph=False (what expert parallel needs), an MoE block keeps the
    router's bincount in its graph as fullgraph=True does: no graph break there, and the
    router pass replaces the whole router, counts included."""
    from torch._dynamo.utils import counters

    from models import MODEL_PRESETS, build_model

    torch._dynamo.reset()
    counters.clear()
    cfg = MODEL_PRESETS["moe-debug"]
    model = build_model(cfg)
    model.init_weights(seed=0)
    apply_compile(model, inner="aot_eager", dump_dir=tmp_path, fullgraph=False)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    model(x, labels=x).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    notes = [p.read_text() for p in tmp_path.rglob("*") if p.is_file()]
    assert any("counts from 1 node(s)" in n for n in notes)
    torch._dynamo.reset()


def test_cudagraph_mtp_falls_back_with_one_log_line(caplog):
    """On CPU the MTP regions compile without CUDA graphs and one log line says why; every
    layout that rules the graphs out has its reason."""
    import dataclasses

    from graphtrain.compile import cudagraph_fallback_reason

    cfg = dataclasses.replace(PRESETS["debug"], mtp_depth=2)
    with caplog.at_level(logging.INFO, logger="graphtrain.compile"):
        apply_compile(GPT(cfg), inner="aot_eager", cudagraph_mtp=True, device_type="cpu")
        apply_compile(GPT(cfg), inner="aot_eager", cudagraph_mtp=False, device_type="cpu")
    (line,) = [r.getMessage() for r in caplog.records if "cudagraph_mtp" in r.getMessage()]
    assert "training runs on cpu" in line
    ok = dict(device_type="cuda", inner="inductor", fullgraph=True, fsdp=False)
    assert cudagraph_fallback_reason(**ok, activation_checkpoint=False) is None
    for change, words in [
        (dict(inner="aot_eager"), "aot_eager"),
        (dict(fullgraph=False), "expert parallel"),
        (dict(fsdp=True), "FSDP2"),
        (dict(activation_checkpoint=True), "activation checkpointing"),
    ]:
        reason = cudagraph_fallback_reason(**{**ok, "activation_checkpoint": False, **change})
        assert words in reason, (change, reason)


def test_step_hooks_hand_the_fp8_counters_to_the_step(caplog):
    """training.fp8 gives the step one hook reading (and resetting) the FP8 casts' saturation
    counters; without FP8 none. The step and the loop reach the ops only through it. After a
    first step with a cast it says nothing; after one without, it warns once, naming the
    filters."""
    from graphtrain.compile import step_hooks
    from graphtrain.config import Fp8Config
    from graphtrain.custom_ops import fp8_cast

    assert step_hooks(fp8=None) == []
    (idle,) = step_hooks(fp8=Fp8Config(min_dim=2048))
    fp8_cast.fp8_saturation_stats(reset=True)
    with caplog.at_level("WARNING", logger="graphtrain"):
        idle.statistics()
        idle.statistics()
    (warning,) = [r.getMessage() for r in caplog.records if "training.fp8" in r.getMessage()]
    assert "no GEMM of this rank ran in FP8" in warning and "fp8.min_dim = 2048" in warning
    caplog.clear()
    (hook,) = step_hooks(fp8=Fp8Config())
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    x[0, 0] = 1e6  # the rest of x flushes to zero in E4M3
    torch.ops.graphtrain.fp8_linear(x, w, None)
    with hook.micro_batch(1.0):
        pass
    with caplog.at_level("WARNING", logger="graphtrain"):
        stats = hook.statistics()
    assert stats["fp8/flushed/activation"].item() > 0.9
    assert hook.statistics()["fp8/flushed/activation"].item() == 0  # read and reset
    assert not [r for r in caplog.records if "training.fp8" in r.getMessage()]


def relu_to_neg_pass(gm, example_inputs, *, ctx):
    """Test post-grad pass: aten.relu becomes aten.neg where the option "negate" is on."""
    if ctx.options.get("negate"):
        for node in gm.graph.nodes:
            if node.target == torch.ops.aten.relu.default:
                node.target = torch.ops.aten.neg.default
        gm.recompile()
    return gm


def test_inductors_graph_cache_keys_on_the_post_grad_passes_options(monkeypatch, tmp_path):
    # The FX graph cache keys on the graph before the post-grad passes and on their uuid: the
    # same graph compiled with an option of a post-grad pass changed (overlap_tp_comm's
    # parallel.tp_overlap_variant) must not come back from the cache compiled with the old one
    # (the uuid had only the passes' names: the second compile returned the first's code).
    monkeypatch.setattr(registry, "_REGISTRY", {})
    test_order = (("post_grad", "relu_to_neg", "test"),)
    monkeypatch.setattr(order, "PASS_ORDER", test_order)
    monkeypatch.setattr(registry, "PASS_ORDER", test_order)
    register_pass("relu_to_neg", stage="post_grad", default_on=False, preserves_numerics=False)(
        relu_to_neg_pass
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x = torch.randn(8, 4)

    def f(x):
        return torch.relu(x) * 2

    outs = {}
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=True):
        for negate in (False, True, False):
            torch._dynamo.reset()
            be = backend(passes=["+relu_to_neg"], inner="inductor", pass_options={"negate": negate})
            outs.setdefault(negate, []).append(torch.compile(f, backend=be)(x))
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1  # the third compile: the first's code
    torch.testing.assert_close(outs[False][0], torch.relu(x) * 2, rtol=0, atol=0)
    torch.testing.assert_close(outs[True][0], -x * 2, rtol=0, atol=0)
    torch.testing.assert_close(outs[False][1], outs[False][0], rtol=0, atol=0)


def test_a_split_backward_never_gets_a_cached_backward_that_donates_its_buffers(
    monkeypatch, tmp_path
):
    """The zero-bubble schedules run a region's backward twice (input gradients, then weight
    gradients) with AOT autograd's donated buffers off (split_backward_flags). Inductor's FX
    graph cache key misses that flag (torch 2.11-2.14): a backward compiled with donation on,
    by an earlier run of the same block, came back from the cache, and its second call read
    saved tensors the first had overwritten (w1's gradient 100% off). The backend's post-grad
    pass holds the flag in its uuid: the split backward's gradients are eager's."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from graphtrain.compile import split_backward_flags

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = GPT(PRESETS["debug"])
    model.init_weights(seed=0)
    block = model.layers["1"]
    x0, g0 = torch.randn(2, 64, 64), torch.randn(2, 64, 64)
    rope = torch.randn(2, 64, 8, 2)

    def gradients(fn, split):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = fn(x, rope, None)
        held = y.view(y.shape)  # torch 2.11/2.12 need the output held (pipeline.md)
        if split:
            groups = stage_backward_input([y], [g0], [x], block.parameters())[1]
            stage_backward_weight(block.parameters(), groups)
        else:
            held.backward(g0)
        return {n: p.grad.clone() for n, p in block.named_parameters()}

    want = gradients(block, split=False)
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        for flags in (contextlib.nullcontext, split_backward_flags):  # the cache, then the split
            torch._dynamo.reset()
            with flags():
                compiled = torch.compile(block, backend=backend(inner="inductor"), fullgraph=True)
                got = gradients(compiled, split=flags is split_backward_flags)
    errors = {n: ((got[n] - g).norm() / g.norm()).item() for n, g in want.items()}
    assert max(errors.values()) < 1e-5, errors


def _budget_run(block, inputs, budget, dump_dir):
    """One forward + backward of `block` compiled (aot_eager) at `budget`, its random draws
    seeded: the bytes it saved for the backward (parameters aside), the input and parameter
    gradients, and the backward graph's graphtrain and random ops (from its dump)."""
    torch._dynamo.reset()
    be = backend(inner="aot_eager", dump_dir=dump_dir, activation_memory_budget=budget)
    fn = torch.compile(block, backend=be, fullgraph=True)
    x, *rest = inputs
    saved = []

    def pack(t):
        saved.append(0 if isinstance(t, torch.nn.Parameter) else t.numel() * t.element_size())
        return t

    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x, *rest)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    summary = json.loads(next(dump_dir.glob("*/backward/summary.json")).read_text())
    ops = {k: v for k, v in summary[0]["op_counts"].items() if "graphtrain" in k or "rand" in k}
    return sum(saved), [x.grad, *(p.grad for p in block.parameters())], ops


def test_activation_memory_budget_saves_less_for_the_same_gradients(tmp_path):
    """moe-debug's MoE block with random routing (force_balance: a randn_like) and the MoE ops
    the passes insert: below budget 1 the region saves less and recomputes aten ops in the
    backward; the gradients stay bitwise those of budget 1 (the same aten ops, recomputed),
    and the backward runs the same graphtrain ops and no random op (_must_save: without it the
    backward here ran the router, the weighted SwiGLU and a permute again)."""
    import dataclasses

    from models import MODEL_PRESETS, build_model

    cfg = dataclasses.replace(MODEL_PRESETS["moe-debug"], num_layers=2, force_balance=True)
    model = build_model(cfg)
    model.init_weights(seed=0)
    B, T = 2, 64
    inputs = (torch.randn(B, T, cfg.dim), model.rope[torch.arange(T).expand(B, T)], None)
    runs = {b: _budget_run(model.layers["1"], inputs, b, tmp_path / str(b)) for b in (1, 0.5, 0.1)}
    saved = [runs[b][0] for b in (1, 0.5, 0.1)]
    assert saved[0] > saved[1] > saved[2], saved
    assert saved[2] < saved[0] / 3, saved
    full_ops = runs[1][2]
    assert "graphtrain.moe_route_backward.default" in full_ops, full_ops
    for b in (0.5, 0.1):
        assert runs[b][2] == full_ops, (b, runs[b][2])
        for got, want in zip(runs[b][1], runs[1][1], strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_activation_memory_budget_never_recomputes_a_random_op(inner):
    """dropout under a budget: the backward's mask is the forward's (torch's partitioner alone
    recomputes the dropout with a fresh draw under aot_eager: pytorch issue 190758)."""

    def f(x, w):
        h = F.dropout((x @ w).sin(), 0.5, training=True)
        return (h * h).sum(), h.detach()

    for budget in (0.5, 0.05):
        torch._dynamo.reset()
        x, w = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)
        fn = torch.compile(f, backend=backend(inner=inner, activation_memory_budget=budget))
        loss, h = fn(x, w)
        loss.backward()
        want = (4 * h * (x @ w).cos()) @ w.T  # h = mask * 2 sin(x @ w)
        torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-4)


def test_activation_memory_budget_with_only_graphtrain_ops_to_trade():
    """A region whose only costly op is graphtrain's (multi-output) fused loss: torch < 2.14
    saved its tuple there and failed at the first forward; budget_partition then keeps the
    region's default activations. Right gradients either way."""
    from graphtrain.custom_ops.linear_cross_entropy import linear_cross_entropy

    def f(h, w, y):
        return linear_cross_entropy(h.sin(), w, y) * 2

    torch._dynamo.reset()
    h, w = torch.randn(32, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (32,))
    fn = torch.compile(f, backend=backend(inner="aot_eager", activation_memory_budget=0.05))
    fn(h, w, y).backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    (F.cross_entropy(h2.sin() @ w2.T, y) * 2).backward()
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    with pytest.raises(ValueError, match=r"activation_memory_budget must be in \(0, 1\], got 0"):
        backend(activation_memory_budget=0)


def test_only_graphtrains_regions_keep_a_nested_region_as_one_node():
    """region_config keeps a nested_compile_region called once as one invoke_subgraph node
    (for the gated_delta_rule pass) in graphtrain's regions only: a plain torch.compile in the
    same process (the benchmarks' plain rows) inlines it, as torch does by default (2.13 on).
    (Kept, the Gated DeltaNet region made Inductor's backward wrong, which graphtrain's backend
    now avoids by inlining what its passes leave: test_gated_delta_rule_pass.py.)"""
    from graphtrain.compile import region_config

    @torch.compiler.nested_compile_region
    def region(x):
        return x.sin() * 2

    def fn(x):
        return region(x) + 1

    def kept(config):
        seen = []

        def capture(gm, example_inputs):
            seen.append(any("invoke_subgraph" in str(n.target) for n in gm.graph.nodes))
            return gm.forward

        torch._dynamo.reset()
        with config:
            torch.compile(fn, backend=capture, fullgraph=True)(torch.randn(4))
        return seen

    assert kept(region_config()) == [True]
    # torch 2.11 and 2.12 have no such flag and never inline a region: plain compile keeps it
    plain_inlines = hasattr(torch._dynamo.config, "inline_single_use_invoke_subgraph")
    assert kept(contextlib.nullcontext()) == [not plain_inlines]


@pytest.mark.slow
def test_inductor_gives_eagers_gradients_for_every_region():
    """moe-debug (dense and MoE blocks, MTP depth 1) with every region compiled by Inductor (the
    CUDA default; the CPU tests mostly use aot_eager) and the default passes: the loss and
    every parameter's gradient are eager's, to fp32 rounding (fusions sum in other orders:
    ~1e-6 here). The Gated DeltaNet block, whose kept region Inductor miscompiled:
    test_gated_delta_rule_pass.py."""
    import dataclasses

    from models import MODEL_PRESETS, build_model

    cfg = dataclasses.replace(MODEL_PRESETS["moe-debug"], mtp_depth=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build_model(cfg)
        model.init_weights(seed=0)
        if compiled:
            apply_compile(model, inner="inductor")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), dict(model.named_parameters())))
    (want, eager), (got, inductor) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for name, p in eager.items():
        err = ((inductor[name].grad - p.grad).norm() / p.grad.norm()).item()
        assert err < 1e-4, (name, err)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_backward_of_fp32_code_under_autocast_is_eagers(inner):
    """A region's forward under bf16 autocast with a matmul the model keeps in fp32 (autocast
    disabled there, as the Gated DeltaNet's chunked form does), its backward outside autocast
    as the step runs it: the compiled gradients are eager's. torch's default traced the
    backward under the forward's autocast, making that matmul's gradients bf16 (0.7% off)."""

    class Region(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.linear(x, self.w)  # bf16 under autocast
            with torch.autocast("cpu", enabled=False):
                return (h.float() @ self.w.t()).sum(-1)

    torch.manual_seed(0)
    region = Region()
    x = torch.randn(8, 64, requires_grad=True)
    grads = []
    for fn in (region, torch.compile(region, backend=backend(inner=inner), fullgraph=True)):
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        grads.append(torch.autograd.grad(out.sum(), [x, region.w]))
    for a, b in zip(*grads, strict=True):
        assert b.abs().max() > 1
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
