"""Pass fp8_linear: selected linears and expert grouped GEMMs -> graphtrain::fp8_linear / fp8_grouped_mm.

What
    In the Dynamo graph (pre-grad, torch IR) it finds linears (F.linear, torch._C._nn.linear,
    x @ W.t() and its spellings, plain or under autocast) and the experts' grouped GEMMs
    (torch._grouped_mm(x, W.transpose(-2, -1), offs=offs), W [E, N, K], after
    fuse_sibling_grouped_mm) and replaces each one the filters allow with output 0 of
    graphtrain::fp8_linear(x, W, b, out_dtype=...) or graphtrain::fp8_grouped_mm(x, W, offs,
    out_dtype=...): the three GEMMs of the layer in FP8 with per-tensor current scaling.
    Filters: the [fp8] config section (graphtrain.config.Fp8Config, as pass_options'
    "fp8.<key>"): include / exclude globs over module paths (default exclude: the head and the
    router), dimensions multiples of multiple_of and at least min_dim, experts on or off.
    Column- and row-parallel linears under tp become the op on the local shards with tp_group;
    other DTensor layouts are refused. Every refusal leaves the GEMM and is stated in a note.

Invariant and numerics (preserves_numerics=False)
    Only the matched GEMMs (and transposes left unused) change; the graph's outputs keep their
    shapes and dtypes. Each operand of each GEMM is rounded to FP8 once: about 26 dB SQNR for
    outputs and 22 dB for gradients per GEMM. The debug and moe-debug models trained with FP8
    stay within 0.05 nats of the fp32 loss over 24 steps; tp=2 equals the single-rank FP8
    computation to fp32 rounding (tests/passes/test_fp8_linear_pass.py).
    The filters' reasons, every refusal and the tensor-parallel rewrite: docs/design/fp8.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx import Node

from graphtrain.config import Fp8Config, JobConfig, pass_options
from graphtrain.custom_ops import fp8_grouped_mm, fp8_linear  # noqa: F401  (register the ops)
from graphtrain.custom_ops.fp8_cast import fp8_saturation_stats, fp8_values_cast
from graphtrain.passes import fx
from graphtrain.passes.dump import module_path
from graphtrain.passes.fx import Refuse
from graphtrain.passes.registry import PassContext, register_pass, trainer_runs
from models.layers import local_tensor

PASS = "fp8_linear"
# The defaults of a job without a config: the [fp8] section's (one place for both).
DEFAULT_OPTIONS: dict[str, Any] = {
    f"fp8.{k}": v for k, v in dataclasses.asdict(Fp8Config()).items()
}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
logger = logging.getLogger(__name__)


class FP8Saturation:
    """Step hook (graphtrain.step.StepHook): the fraction of values the step's FP8 casts
    clipped or flushed, per tensor class (graphtrain.custom_ops.fp8_cast's device-side
    counters, read and reset per step). The trainer gets it from graphtrain.compile.step_hooks.
    After the first step it warns once if nothing was cast: training.fp8 is on, but the
    filters (fp8: the job's [fp8] section) kept every GEMM of this rank in bf16."""

    def __init__(self, fp8: Fp8Config) -> None:
        self.fp8 = fp8
        self.checked = False

    def micro_batch(self, weight: float) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def statistics(self) -> dict[str, torch.Tensor]:
        if not self.checked:
            self.checked = True
            if not fp8_values_cast():
                logger.warning(
                    "training.fp8 = true, but no GEMM of this rank ran in FP8 in the first "
                    "step: the fp8_linear pass's filters kept every one in bf16 (fp8.min_dim = "
                    "%d: a GEMM with a dimension below it, where FP8 is slower, stays bf16; "
                    "fp8.include %s, fp8.exclude %s); `graphtrain inspect` names each GEMM "
                    "and why",
                    self.fp8.min_dim, self.fp8.include, self.fp8.exclude,
                )  # fmt: skip
        return fp8_saturation_stats()


@dataclass
class _Gemm:
    node: Node  # the GEMM being replaced
    kind: str  # "linear", "matmul" or "grouped"
    x: Node
    weight: Node
    bias: Any = None
    transpose: Node | None = None  # W.t() / W.transpose(-2, -1), erased when left unused
    offs: Any = None
    tp: _TensorParallel | None = None  # a DTensor linear the pass rewrites on local shards


@dataclass
class _TensorParallel:
    """How a DTensor linear maps to the op on the rank's shards."""

    group: str  # the tp group's name (the op max-reduces its amaxes over it)
    replaced: list[Node]  # erased; the last one's users take the result
    fake_mode: Any
    x_local: Node | None = None  # row-parallel: the local tensor x was made from
    mesh: Any = None  # row-parallel: the mesh to wrap the Partial output on (fx.emit_from_local)


def _is_dtensor(v: Any) -> bool:
    return type(v).__name__ == "DTensor"


def _tensor_parallel(gemm: _Gemm) -> None:
    """Set gemm.tp for the two layouts graphtrain's TP plan gives a linear (else Refuse):
    column-parallel  x Replicate, W Shard(0); the output (Shard(-1)) reaches a plain tensor
                     through no-op redistributes and one .to_local() (ColwiseParallel)
    row-parallel     x Shard(-1) made by DTensor.from_local in the graph, W Shard(1); the
                     output is Partial (RowwiseParallel then reduce-scatters it)
    on a 1-D tp mesh, without bias."""
    from torch.distributed.tensor import Replicate, Shard

    x, w, out = (fx.val(n) for n in (gemm.x, gemm.weight, gemm.node))
    if gemm.kind != "linear" or gemm.bias is not None or not (_is_dtensor(x) and _is_dtensor(w)):
        raise Refuse("DTensor operands other than a bias-free F.linear of two DTensors")
    layout = (tuple(x.placements), tuple(w.placements))
    group = w.device_mesh.get_group().group_name if w.device_mesh.ndim == 1 else None
    if group is not None and layout == ((Replicate(),), (Shard(0),)):
        chain, node = [gemm.node], gemm.node
        while len(node.users) == 1:
            (user,) = node.users
            c = fx.is_call(user, "redistribute", "to_local")
            if c is None or c.input is not node:
                break
            chain.append(user)
            if c.name == "to_local" and not (c.args[1:] or c.kwargs):
                gemm.tp = _TensorParallel(group, chain, fx.val(user).fake_mode)
                return
            if c.name == "to_local" or tuple(fx.val(user).placements) != tuple(out.placements):
                break
            node = user
        raise Refuse(
            "the column-parallel output does not reach .to_local() through no-op redistributes"
        )
    if group is not None and layout == ((Shard(x.ndim - 1),), (Shard(1),)):
        src = fx.is_call(gemm.x, "from_local")
        if src is None:
            raise Refuse("the row-parallel input is not made by DTensor.from_local in this graph")
        local, mesh = src.input, src.arg(1, "device_mesh")
        gemm.tp = _TensorParallel(group, [gemm.node], fx.val(local).fake_mode, local, mesh)
        return
    raise Refuse(
        f"tensor-parallel layout x {list(x.placements)}, weight {list(w.placements)} on a "
        f"{w.device_mesh.ndim}-D mesh: not column- or row-parallel on one tp axis"
    )


def _match(node: Node) -> _Gemm | None:
    """The GEMM at `node`, a refusal (str) for a GEMM of the wrong form, or None."""
    if node.op != "call_function":
        return None
    if node.target in fx.LINEAR_TARGETS:
        return _Gemm(node, "linear", fx.arg(node, 0, "input"), fx.arg(node, 1, "weight"),
                     fx.arg(node, 2, "bias"))  # fmt: skip
    if node.target in fx.MATMUL_TARGETS:
        weight = fx.transpose_of(node.args[1], 2)
        if weight is None:
            return None  # a matmul that is not a linear (attention scores, ...): no note
        return _Gemm(node, "matmul", node.args[0], weight, transpose=node.args[1])
    if node.target is torch._grouped_mm:
        if len(node.args) > 3 or set(node.kwargs) - {"offs"}:
            raise Refuse(f"the grouped GEMM {node.name} has a bias or an out_dtype")
        weight = fx.transpose_of(node.args[1], 3)
        if weight is None:
            raise Refuse(f"the weight of the grouped GEMM {node.name} is not W.transpose(-2, -1)")
        return _Gemm(node, "grouped", node.args[0], weight, transpose=node.args[1],
                     offs=fx.arg(node, 2, "offs"))  # fmt: skip
    return None


def _path(gemm: _Gemm) -> str:
    stack = gemm.node.meta.get("nn_module_stack") or {}
    return module_path(list(stack.values())[-1][0]) if stack else gemm.weight.name


def _unselected(path: str, grouped: bool, opts: dict[str, Any]) -> str | None:
    """Why the [fp8] globs (and fp8.experts) keep the GEMM of module `path` (under its compiled
    region) in bf16, or None."""
    if not any(fnmatch.fnmatchcase(path, g) for g in opts["fp8.include"]):
        return f"module {path!r} matches no fp8.include glob {list(opts['fp8.include'])}"
    excluded = [g for g in opts["fp8.exclude"] if fnmatch.fnmatchcase(path, g)]
    if excluded:
        return f"module {path!r} matches fp8.exclude glob {excluded[0]!r}"
    return "fp8.experts is false" if grouped and not opts["fp8.experts"] else None


def _undersized(dims: dict[str, int], opts: dict[str, Any]) -> str | None:
    """Why the GEMM's dimensions (M, K, N; grouped: K, N) keep it in bf16, or None."""
    multiple, least = opts["fp8.multiple_of"], opts["fp8.min_dim"]
    odd = [f"{k}={d}" for k, d in dims.items() if d % multiple]
    if odd:
        return f"{', '.join(odd)} not a multiple of {multiple}"
    small = [f"{k}={d}" for k, d in dims.items() if d < least]
    if small:
        return f"{', '.join(small)} below fp8.min_dim={least} (FP8 slower than bf16 there)"
    return None


def _check(gemm: _Gemm, path: str, opts: dict[str, Any]) -> None:
    """Raise Refuse saying why this GEMM stays as it is."""
    reason = _unselected(path, gemm.kind == "grouped", opts)
    if reason:
        raise Refuse(reason)
    vals = [fx.val(n) for n in (gemm.x, gemm.weight, gemm.node)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        raise Refuse("its operands have no example values")
    if any(_is_dtensor(v) for v in vals):
        _tensor_parallel(gemm)
        with gemm.tp.fake_mode:  # the GEMM that runs: the rank's shards
            vals = [v.to_local() for v in vals]
    shapes = [tuple(v.shape) for v in vals]
    if not all(isinstance(s, int) for shape in shapes for s in shape):
        raise Refuse(f"symbolic shapes {shapes}")
    if any(v.dtype not in _DTYPES for v in vals):
        raise Refuse(f"dtypes {[str(v.dtype) for v in vals]}, not float32/bfloat16/float16")
    x, w = vals[0], vals[1]
    if gemm.kind == "grouped" and (x.dim() != 2 or not isinstance(gemm.offs, Node)):
        raise Refuse(f"the grouped GEMM takes x {list(x.shape)} without 2-D rows and offs")
    N, K = w.shape[-2], w.shape[-1]
    dims = {"K": K, "N": N} if gemm.kind == "grouped" else {"M": math.prod(x.shape[:-1]), "K": K, "N": N}  # fmt: skip
    reason = _undersized(dims, opts)
    if reason:
        raise Refuse(reason)


def fp8_weights(model: nn.Module, cfg: JobConfig) -> list[nn.Parameter]:
    """Where the trainer runs this pass (compile.enable, fp8_linear among compile.passes, as
    training.fp8 puts it): the weights of `model`'s nn.Linear modules its filters take, judged
    as the pass judges their GEMMs (the module's path under its compiled region, a block or an
    MTP layer, else the model; the rank's shard of the weight; M the micro-batch's tokens).
    graphtrain.precision gives them no working copy: the op casts the fp32 master itself. A
    weight misjudged costs speed (a copy unused, or a cast per use), never correctness; the
    experts' grouped GEMMs keep their copies."""
    if not trainer_runs(PASS, cfg.compile):
        return []
    opts = pass_options(cfg)
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    regions = [f"{a}.{k}." for a in ("layers", "mtp_layers") for k in getattr(model, a, None) or ()]
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        path = name.removeprefix(next((r for r in regions if name.startswith(r)), ""))
        N, K = local_tensor(module.weight).shape
        dims = {"M": tokens, "K": K, "N": N}
        if not (_unselected(path, False, opts) or _undersized(dims, opts)):
            chosen.append(module.weight)
    return chosen


def _rewrite(gm: torch.fx.GraphModule, gemm: _Gemm, opts: dict[str, Any]) -> Node:
    graph, node = gm.graph, gemm.node
    out_val = fx.val(node)
    kwargs = {
        "e4m3_grads": bool(opts["fp8.e4m3_grads"]),
        "pow2_scale": bool(opts["fp8.pow2_scale"]),
        "out_dtype": out_val.dtype,
    }
    if gemm.kind == "grouped":
        op, args = torch.ops.graphtrain.fp8_grouped_mm.default, (gemm.x, gemm.weight, gemm.offs)
    else:
        op, args = torch.ops.graphtrain.fp8_linear.default, (gemm.x, gemm.weight, gemm.bias)
    tp = gemm.tp
    fake_mode = out_val.fake_mode if tp is None else tp.fake_mode
    if tp is not None:
        args = _local_operands(graph, gemm)
        kwargs["tp_group"] = tp.group
        if tp.mesh is None:  # column-parallel: the op's output replaces the .to_local()
            kwargs["out_dtype"] = fx.val(tp.replaced[-1]).dtype
    with fake_mode:  # before touching the graph: the op's checks may refuse
        value = op(*(fx.val(a) if isinstance(a, Node) else a for a in args), **kwargs)
    with graph.inserting_before(node):
        call = graph.call_function(op, args, kwargs)
        call.meta["example_value"] = value
        out = graph.call_function(operator.getitem, (call, 0))
        out.meta["example_value"] = value[0]
        if tp is not None and tp.mesh is not None:
            # row-parallel: the rank's partial sums, wrapped as the Partial DTensor the linear
            # made, for RowwiseParallel's reduce-scatter after it
            from torch.distributed.tensor import Partial

            out = fx.emit_from_local(graph, out, tp.mesh, (Partial(),))
            out.meta["example_value"] = out_val
    for new in (call, *out.all_input_nodes[:1], out):
        fx.copy_meta(node, new)
    replaced = tp.replaced if tp is not None else [node]
    replaced[-1].replace_all_uses_with(out)
    for old in reversed(replaced):
        graph.erase_node(old)
    if gemm.transpose is not None and not gemm.transpose.users:
        graph.erase_node(gemm.transpose)
    return call


def _local_operands(graph: torch.fx.Graph, gemm: _Gemm) -> tuple[Node, Node, None]:
    """The rank's x and W, inserted before the linear. Column-parallel: x.to_local(
    grad_placements=[Partial()]): its input gradient is a partial sum over the tp ranks (each
    holds some of the output columns), which DTensor then reduces where x came from, as for
    the plain linear. Row-parallel: the local tensor x was made from (its gradient is the
    rank's slice)."""
    from torch.distributed.tensor import Partial

    tp = gemm.tp
    with graph.inserting_before(gemm.node):
        w = graph.call_method("to_local", (gemm.weight,))
        x = tp.x_local
        if x is None:
            x = graph.call_method("to_local", (gemm.x,), {"grad_placements": (Partial(),)})
    with tp.fake_mode:
        w.meta["example_value"] = fx.val(gemm.weight).to_local()
        if tp.x_local is None:
            x.meta["example_value"] = fx.val(gemm.x).to_local()
    return x, w, None


@register_pass(PASS, preserves_numerics=False, default_on=False)
def fp8_linear_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Run the linears and expert GEMMs the fp8.* filters select in FP8 (current scaling)."""
    opts = {k: ctx.options.get(k, v) for k, v in DEFAULT_OPTIONS.items()}
    changed = False
    for node in list(gm.graph.nodes):
        try:
            gemm = _match(node)
        except Refuse as why:
            ctx.note(f"kept {node.name}: {why}")
            continue
        if gemm is None:
            continue
        path = _path(gemm)
        try:
            _check(gemm, path, opts)
            w = fx.val(gemm.weight)
            call = _rewrite(gm, gemm, opts)
        except (Refuse, ValueError) as why:  # ValueError: the op's own checks on fake values
            ctx.note(f"kept {gemm.kind} {node.name} ({path}): {why}")
            continue
        ctx.note(
            f"fp8 {gemm.kind} {node.name} ({path}): weight {list(w.shape)} -> {call.name} = "
            f"{call.target}"
        )
        changed = True
    if not changed:
        ctx.note("no linear passed the fp8 filters: nothing rewritten")
    return fx.finish(gm, changed)
