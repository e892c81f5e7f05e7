"""Pass fuse_linear_cross_entropy: cross_entropy(linear(h, W)) -> graphtrain::linear_cross_entropy.

What
    In the Dynamo graph (pre-grad) it finds a cross_entropy whose input is a bias-free linear
    head (F.linear, h @ W.t(), torch.matmul, nn.Linear), reached through the casts to float32
    and the reshapes canonicalize spells as torch.reshape / .to(torch.float32), and replaces the
    chain with graphtrain.linear_cross_entropy(h.reshape(-1, H), W, target). graphtrain's
    tensor-parallel head (W Shard(0), logits gathered for a plain loss) becomes
    linear_cross_entropy_vocab_parallel on the local shards: the logits are never gathered.
    A plain-torch top-1 accuracy on the same logits is folded into the op's statistics
    (linear_cross_entropy_accuracy.py). The op: graphtrain/custom_ops/linear_cross_entropy/.
    Mode: compile.lce_mode; "auto" on CUDA without tensor parallelism first leaves the loss to
    Inductor where its unfused logits fit compile.lce_memory_budget (it was faster there, with
    a Triton grad_weight GEMM the op no longer uses: benchmarks/RESULTS.md, the 1b profile on
    an H200; kept until measured again); else, and on CPU, it takes fast unless
    fast_mode_extra_bytes exceeds the budget (0: a quarter of the free memory; under tensor
    parallelism the smallest over the tp group, so all its ranks decide alike). Each refusal and
    the chosen mode are stated in a note. Matched model line: GPT.head_loss (models/gpt.py).

Invariant and numerics
    Only the matched nodes are replaced; the graph's outputs keep their values and dtypes up to
    rounding: the fused op sums in another order and keeps the softmax and both gradient
    accumulations in fp32 (preserves_numerics=False; about 1e-5 relative on the debug model in
    fp32). Why, the refusals and the alternatives: docs/design/linear_cross_entropy.md.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import graphtrain.custom_ops.linear_cross_entropy as lce_op  # registers graphtrain::linear_cross_entropy
from graphtrain.custom_ops.utils import group_size as _tp_size
from graphtrain.passes import fx
from graphtrain.passes.fx import Refuse
from graphtrain.passes.linear_cross_entropy_accuracy import _find_accuracy, _fold_accuracy
from graphtrain.passes.registry import PassContext, register_pass

_CE_TARGETS = (F.cross_entropy,)
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_FUSED_OP = torch.ops.graphtrain.linear_cross_entropy.default


@dataclass
class _Match:
    hidden: torch.fx.Node
    weight: torch.fx.Node | str  # a node, or the qualified name of an nn.Linear's weight
    target: torch.fx.Node
    chain: list[torch.fx.Node]  # from the cross_entropy's input back to the head (inclusive)
    transpose: torch.fx.Node | None  # W.t() of the matmul form
    ignore_index: int
    label_smoothing: float
    reduction: str
    compute_dtype: torch.dtype  # the head's output dtype: autocast's, where autocast is on
    group_name: str | None = None  # tensor parallel: the vocab-sharded head's tp group


# Head output dtypes autocast produces from fp32 operands.
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

_FUSED_OP_TP = torch.ops.graphtrain.linear_cross_entropy_vocab_parallel.default


def _describe_users(node: torch.fx.Node, expected: torch.fx.Node | None) -> str:
    others = []
    for user in node.users:
        if user is expected:
            continue
        if user.op == "output":
            others.append("the graph output")
        else:
            others.append(
                f"{user.name} ({user.op} {getattr(user.target, '__name__', user.target)})"
            )
    return ", ".join(others)


def _check_upcast(node: torch.fx.Node) -> None:
    """Refuse unless the cast `node` converts to float32 only."""
    if fx.cast_dtype(node) != torch.float32:
        raise Refuse(
            f"{node.name} converts the logits with .{node.target}{tuple(node.args[1:])} "
            f"{dict(node.kwargs)}"
        )


def _is_cast(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target in ("to", "type", *fx.DTYPE_METHODS)


def _is_reshape(node: torch.fx.Node) -> bool:
    """Reinterprets the logits (row-major order kept, so row n of the [N, V] result is still
    the linear's n-th row); canonicalize spelled view/flatten/... as torch.reshape."""
    return fx.is_call(node, "reshape", "contiguous") is not None


def _is_tp_gather(node: torch.fx.Node) -> bool:
    """.to_local() or .redistribute(...) of a DTensor: how a tensor-parallel head hands the
    logits to a plain loss (checked in _tp_head)."""
    return fx.is_call(node, "to_local", "redistribute") is not None


def _tp_head(
    hidden: Any, weight: Any, head: Any, logits: Any, chain: list[torch.fx.Node]
) -> tuple[str, Any, Any]:
    """For a DTensor head: (tp group name, local hidden, local weight) when it is the
    vocab-parallel layout graphtrain.linear_cross_entropy_vocab_parallel computes (weight
    Shard(0), hidden Replicate, logits Shard(-1) gathered to Replicate and made local before the
    loss, even shards, a 1-D mesh); otherwise Refuse says why not."""
    from torch.distributed.tensor import Replicate, Shard

    if not (fx.is_dtensor(hidden) and fx.is_dtensor(weight) and fx.is_dtensor(head)):
        raise Refuse("part of the head is a DTensor and part is not")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or hidden.device_mesh != mesh:
        raise Refuse(f"the head's DTensors are not on one 1-D mesh ({mesh})")
    if tuple(weight.placements) != (Shard(0),) or tuple(hidden.placements) != (Replicate(),):
        raise Refuse(
            f"the head is not vocab-parallel (weight {weight.placements}, hidden "
            f"{hidden.placements}; wanted Shard(0) and Replicate)"
        )
    if fx.is_dtensor(logits):
        raise Refuse(
            "the loss reads DTensor logits (loss_parallel?): only local logits are matched"
        )
    if weight.shape[0] % mesh.size():
        raise Refuse(f"the vocab {weight.shape[0]} does not split evenly over tp={mesh.size()}")
    gathers = [n for n in chain if _is_tp_gather(n)]
    redistribute = [n for n in gathers if fx.is_call(n, "redistribute")]
    if len(gathers) != 2 or len(redistribute) != 1:
        raise Refuse("the logits do not reach the loss through one redistribute and one to_local")
    gathered = fx.val(redistribute[0])
    if tuple(gathered.placements) != (Replicate(),):
        raise Refuse(f"the logits are redistributed to {gathered.placements}, not Replicate")
    return mesh.get_group().group_name, hidden.to_local(), weight.to_local()


def _logits_chain(ce: torch.fx.Node, logits_in: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from the loss's input back to the head (inclusive), through reshapes and
    float32 casts; each step must feed only the next one, or the logits are needed elsewhere."""
    chain: list[torch.fx.Node] = []
    node, consumer = logits_in, ce
    while True:
        if len(node.users) != 1:
            raise Refuse(
                f"the logits {node.name} are also used by {_describe_users(node, consumer)}; "
                "they must exist, so there is nothing to save"
            )
        chain.append(node)
        if _is_cast(node):
            _check_upcast(node)
        elif not (_is_reshape(node) or _is_tp_gather(node)):
            return chain
        consumer, node = node, node.args[0]
        if not isinstance(node, torch.fx.Node):
            raise Refuse(f"{consumer.name} does not read a graph value")


def _ce_arguments(ce: torch.fx.Node) -> tuple[int, str, float, torch.fx.Node, torch.fx.Node]:
    """(ignore_index, reduction, label_smoothing, logits, target) of the cross_entropy `ce`;
    Refuse where the fused op cannot take them."""
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError as e:
        raise Refuse(f"cannot read its arguments ({e})") from None
    bound.apply_defaults()
    a = bound.arguments
    if a["weight"] is not None:
        raise Refuse("it has class weights (weight=...): the fused op has none")
    if a["size_average"] is not None or a["reduce"] is not None:
        raise Refuse("it uses the legacy size_average/reduce arguments")
    ignore_index, reduction, smoothing = a["ignore_index"], a["reduction"], a["label_smoothing"]
    if not isinstance(ignore_index, int) or not isinstance(reduction, str):
        raise Refuse("ignore_index/reduction are not constants")
    if not isinstance(smoothing, int | float):
        raise Refuse("label_smoothing is not a constant")
    if reduction not in ("mean", "sum", "none"):
        raise Refuse(f"unknown reduction {reduction!r}")
    logits_in, target = a["input"], a["target"]
    if not isinstance(logits_in, torch.fx.Node) or not isinstance(target, torch.fx.Node):
        raise Refuse("its input or target is not a graph value")
    return ignore_index, reduction, float(smoothing), logits_in, target


def _head_operands(
    gm: torch.fx.GraphModule, head: torch.fx.Node
) -> tuple[torch.fx.Node, torch.fx.Node | str, torch.fx.Node | None]:
    """(hidden, weight node or parameter name, the W.t() node of a matmul head) of the linear
    head `head`; Refuse when it is not a bias-free linear."""
    transpose = None
    weight: torch.fx.Node | str
    if head.op == "call_function" and head.target in fx.LINEAR_TARGETS:
        hidden = head.args[0] if head.args else head.kwargs.get("input")
        weight = head.args[1] if len(head.args) > 1 else head.kwargs.get("weight")
        bias = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
        if bias is not None:
            raise Refuse(f"the head {head.name} has a bias")
    elif head.op == "call_function" and head.target in fx.MATMUL_TARGETS:
        hidden, other = head.args[0], head.args[1]
        weight = fx.transpose_of(other, 2)
        if weight is None:
            raise Refuse(
                f"the matmul {head.name} does not multiply by a transposed 2-D weight (h @ W.t())"
            )
        transpose = other
    elif head.op == "call_module" and isinstance(gm.get_submodule(head.target), nn.Linear):
        module = gm.get_submodule(head.target)
        if module.bias is not None:
            raise Refuse(f"the head {head.target} has a bias")
        hidden, weight = head.args[0], f"{head.target}.weight"
    else:
        raise Refuse(f"its input does not come from a linear head (found {head.op} {head.target})")
    if not isinstance(hidden, torch.fx.Node):
        raise Refuse(f"the head {head.name} does not read a graph value")
    return hidden, weight, transpose


def _check_values(
    hidden_val: Any, weight_val: Any, head_val: Any, logits_val: Any, target_val: Any, tp: int
) -> None:
    """Refuse unless the recorded values are what the fused op computes: a 2-D static weight,
    the head's dtype reproducible, [N, V] logits, 1-D int64 class ids."""
    if weight_val.dim() != 2:
        raise Refuse("the weight is not 2-D")
    V, H = weight_val.shape  # under tp: the local shard
    if not isinstance(V, int) or not isinstance(H, int):
        raise Refuse("the vocab or hidden size is symbolic")
    if hidden_val.dim() < 1 or hidden_val.shape[-1] != H:
        raise Refuse("hidden and weight sizes do not fit")
    in_dtypes = {hidden_val.dtype, weight_val.dtype}
    autocast = in_dtypes != {head_val.dtype} and head_val.dtype in _AUTOCAST_DTYPES
    if not head_val.is_floating_point() or (
        in_dtypes != {head_val.dtype} and not (autocast and in_dtypes <= {torch.float32})
    ):
        raise Refuse(
            f"the head computes in {head_val.dtype} from {hidden_val.dtype} x {weight_val.dtype}: "
            "the fused op would not reproduce it"
        )
    if logits_val.dim() != 2 or logits_val.shape[1] != V * tp:
        raise Refuse(f"cross_entropy's input has shape {tuple(logits_val.shape)}, not [N, {V}]")
    if logits_val.dtype not in (torch.float32, head_val.dtype):
        raise Refuse(f"the logits reach cross_entropy as {logits_val.dtype}")
    if target_val.dim() != 1 or target_val.dtype != torch.int64:
        raise Refuse(
            "the target is not a 1-D int64 tensor of class ids (probabilities are not supported)"
        )


def _match(gm: torch.fx.GraphModule, ce: torch.fx.Node) -> _Match:
    """The matched pattern ending in `ce`; Refuse with the reason it does not match."""
    ignore_index, reduction, smoothing, logits_in, target = _ce_arguments(ce)
    chain = _logits_chain(ce, logits_in)
    head = chain[-1]
    hidden, weight, transpose = _head_operands(gm, head)
    # Shapes, dtypes, tensor kinds: from the fake values Dynamo recorded.
    hidden_val, logits_val, target_val, head_val = (
        fx.val(hidden),
        fx.val(logits_in),
        fx.val(target),
        fx.val(head),
    )
    weight_val = fx.val(weight) if isinstance(weight, torch.fx.Node) else gm.get_parameter(weight)
    vals = (hidden_val, weight_val, logits_val, target_val, head_val)
    if any(v is None for v in vals):
        raise Refuse("example_value meta is missing (not a Dynamo graph?)")
    group_name = None
    if any(fx.is_dtensor(v) for v in vals):
        group_name, hidden_val, weight_val = _tp_head(
            hidden_val, weight_val, head_val, logits_val, chain
        )
    _check_values(hidden_val, weight_val, head_val, logits_val, target_val, _tp_size(group_name))
    return _Match(
        hidden,
        weight,
        target,
        chain,
        transpose,
        ignore_index,
        smoothing,
        reduction,
        head_val.dtype,
        group_name,
    )


def _rewrite(
    gm: torch.fx.GraphModule, ce: torch.fx.Node, m: _Match, mode: dict[str, Any]
) -> torch.fx.Node:
    graph = gm.graph
    nodes_before = set(graph.nodes)
    with graph.inserting_before(ce):
        weight = m.weight if isinstance(m.weight, torch.fx.Node) else graph.get_attr(m.weight)
        hidden_val = fx.val(m.hidden)
        weight_val = (
            fx.val(weight) if isinstance(m.weight, torch.fx.Node) else gm.get_parameter(m.weight)
        )
        if isinstance(m.weight, str):
            weight.meta["example_value"] = weight_val
        hidden = m.hidden
        if m.group_name is not None:
            # Tensor parallel: the op works on this rank's vocab shard of W and the replicated
            # hidden; to_local's backward wraps the gradients back (Shard(0) for W; Replicate
            # for h, right because the op all-reduces grad_hidden over the group).
            hidden, weight = (
                fx.emit(graph, "call_method", "to_local", (hidden,)),
                fx.emit(graph, "call_method", "to_local", (weight,)),
            )
            hidden_val, weight_val = fx.val(hidden), fx.val(weight)
        H = weight_val.shape[1]
        if hidden_val.dim() != 2:
            hidden = fx.emit(graph, "call_method", "reshape", (hidden, -1, H))
        if weight_val.dtype != m.compute_dtype and mode["mode"] != "fast":
            # Autocast: the linear ran on bf16/fp16 copies of fp32 operands; make the casts
            # explicit (their backward casts the gradients back, as autocast's do). Fast mode
            # takes the fp32 weight itself and accumulates its fp32 gradient directly.
            weight = fx.emit(graph, "call_method", "to", (weight, m.compute_dtype))
        if fx.val(hidden).dtype != m.compute_dtype:
            hidden = fx.emit(graph, "call_method", "to", (hidden, m.compute_dtype))
        kwargs = {
            "ignore_index": m.ignore_index,
            "label_smoothing": m.label_smoothing,
            "reduction": m.reduction,
            **mode,
        }
        op, args = _FUSED_OP, (hidden, weight, m.target)
        if m.group_name is not None:
            op, args = _FUSED_OP_TP, (*args, m.group_name)
        fused = fx.emit(graph, "call_function", op, args, kwargs)
        result = fused
        ce_dtype = fx.val(ce).dtype
        if fx.dtype(fused) != ce_dtype:
            # The graph computed the loss in a narrower dtype: keep its outputs' dtypes.
            result = fx.emit(graph, "call_method", "to", (fused, ce_dtype))
        # Provenance for the dumps and `graphtrain inspect`: the loss's source line and module;
        # where the loss has none (a loss written at the top level of the compiled function has
        # no nn_module_stack), the head's (e.g. "output").
        head = m.chain[-1]
        for node in set(graph.nodes) - nodes_before:
            for key in fx.META_KEYS:
                source = ce if key in ce.meta else head
                if key in source.meta:
                    node.meta[key] = source.meta[key]
    ce.replace_all_uses_with(result)
    graph.erase_node(ce)
    for node in m.chain:  # from the loss's input back to the head: users go first
        graph.erase_node(node)
    if m.transpose is not None and not m.transpose.users:
        graph.erase_node(m.transpose)
    return fused


def _memory_budget(options: Mapping[str, Any], device: torch.device) -> tuple[int, str]:
    """(bytes, where the figure comes from): compile.lce_memory_budget, or 0 -> a quarter of
    the free device memory now (compile time), or on CPU a quarter of the available system
    memory (the CPU path's buffers live there)."""
    budget = int(options.get("lce_memory_budget", 0))
    if budget > 0:
        return budget, "compile.lce_memory_budget"
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return free // 4, "a quarter of the free device memory"
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (not POSIX): be conservative
        free = 0
    return free // 4, "a quarter of the available system memory"


def _group_budget(
    budget: int, source: str, group_name: str, device: torch.device
) -> tuple[int, str]:
    """The smallest budget over the tp group `group_name`, and where it comes from.

    Fast and low-memory modes (and fast mode's token chunking) issue different numbers of
    collectives, so every rank of the group must decide alike: each rank's own free memory
    differs, and ranks that chose differently would hang in the op's first all-reduce. Every
    rank of the group compiles the same graph, so each runs this one all-reduce per matched
    loss, at the same point."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    # NCCL reduces CUDA tensors only; gloo (CPU tests) CPU tensors.
    on_cuda = device.type == "cuda" and "nccl" in str(dist.get_backend(group))
    where = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    with unset_fake_temporarily():  # a real tensor, even inside the compiler's fake mode
        t = torch.tensor([budget], dtype=torch.int64, device=where)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        smallest = int(t.item())  # compile time, once per matched loss: not in the step
    return (
        smallest,
        f"{source}; the smallest over the {group.size()} ranks of tp group {group_name}",
    )


def _choose_mode(
    options: Mapping[str, Any], m: _Match, gm: torch.fx.GraphModule
) -> tuple[dict[str, Any] | None, str]:
    """The op's mode keywords for compile.lce_mode (None: leave the loss unfused), and why (for
    the pass note).

    auto: on CUDA without tensor parallelism, unfused where unfused_extra_bytes fits the budget
    (Inductor's loss was faster than fast mode's on an H200: its grad_weight GEMM accumulating
    in fp32 runs in Triton, ~10 ms against ~6 for cuBLAS at 8192 x 2048 x 128256); then fast
    mode (three GEMMs) unless its extra bytes over low-memory mode exceed the budget; for a
    16-bit weight first with an fp32 grad_weight buffer, then with 16-bit accumulation over at
    most four chunks (fast_mode_extra_bytes)."""
    choice = options.get("lce_mode", "auto")
    if choice not in ("auto", "fast", "low_memory"):
        raise ValueError(f"compile.lce_mode must be 'auto', 'fast' or 'low_memory', got {choice!r}")
    hidden_val = fx.val(m.hidden)
    weight_val = (
        fx.val(m.weight) if isinstance(m.weight, torch.fx.Node) else gm.get_parameter(m.weight)
    )
    N = math.prod(hidden_val.shape[:-1])
    V, H = weight_val.shape
    if m.group_name is not None:  # DTensors: this rank's shards
        V = V // _tp_size(m.group_name)
    if choice == "low_memory":
        return {"mode": "low_memory"}, "compile.lce_mode = 'low_memory'"
    if not isinstance(N, int):
        if choice == "fast":
            return {"mode": "fast"}, "compile.lce_mode = 'fast'"
        return {"mode": "low_memory"}, "auto: the token count is symbolic, low memory is safe"
    budget, source = _memory_budget(options, hidden_val.device)
    if m.group_name is not None:  # one decision for the whole tp group
        budget, source = _group_budget(budget, source, m.group_name, hidden_val.device)
    gib = 1 << 30
    if choice == "auto" and hidden_val.device.type == "cuda" and m.group_name is None:
        unfused = lce_op.unfused_extra_bytes(N, V, m.compute_dtype)
        if unfused <= budget:
            return None, (
                f"auto: Inductor's unfused loss ({unfused / gib:.2f} GiB of logits and their "
                f"gradient) fits the budget of {budget / gib:.2f} GiB ({source}) and was measured "
                "faster on CUDA; compile.lce_mode = 'fast' or 'low_memory' fuses anyway"
            )
    tried = []
    # fp32 accumulation first; a 16-bit weight's own dtype (four roundings) only if needed.
    for acc in (True, False) if weight_val.dtype in _AUTOCAST_DTYPES else (True,):
        extra = lce_op.fast_mode_extra_bytes(N, H, V, m.compute_dtype, weight_val.dtype, acc)
        how = "fp32" if acc else f"{weight_val.dtype} over at most four chunks"
        if extra <= budget:
            return {"mode": "fast", "fp32_accumulator": acc}, (
                f"{choice}: fast mode's {extra / gib:.2f} GiB extra (grad_weight accumulated "
                f"in {how}) fits the budget of {budget / gib:.2f} GiB ({source})"
            )
        tried.append(f"{extra / gib:.2f} GiB with grad_weight in {how}")
    over = (
        f"fast mode's extra ({', '.join(tried)}) exceeds the budget of {budget / gib:.2f} GiB "
        f"({source})"
    )
    if choice == "fast":
        return {"mode": "fast", "fp32_accumulator": len(tried) == 1}, f"fast as configured; {over}"
    return {"mode": "low_memory"}, f"auto: {over}"


@register_pass("fuse_linear_cross_entropy", preserves_numerics=False)
def fuse_linear_cross_entropy_pass(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: PassContext
) -> torch.fx.GraphModule:
    """Replace cross_entropy(linear(h, W)) with the fused graphtrain::linear_cross_entropy op."""
    ces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CE_TARGETS]
    if not ces:
        ctx.note("no cross_entropy in this graph: nothing to fuse")
        return gm
    changed = False
    for ce in ces:
        acc = _find_accuracy(ce)
        if acc is not None:  # out of the logits' users while matching (it goes if we fuse)
            acc.argmax.replace_input_with(acc.logits, acc.target)
        try:
            m = _match(gm, ce)
        except Refuse as why:
            if acc is not None:
                acc.argmax.replace_input_with(acc.target, acc.logits)
            ctx.note(f"left {ce.name} unchanged: {why}")
            continue
        mode, why = _choose_mode(ctx.options, m, gm)
        if mode is None:
            if acc is not None:
                acc.argmax.replace_input_with(acc.target, acc.logits)
            ctx.note(f"left {ce.name} unchanged: {why}")
            continue
        fused = _rewrite(gm, ce, m, mode)
        if acc is not None:
            why += f"; the top-1 count {acc.reduce.name} comes from the op's statistics"
            _fold_accuracy(gm, fused, acc)
        V, H = fused.args[1].meta["example_value"].shape
        op_name, vocab = "linear_cross_entropy", f"V={V}"
        if m.group_name is not None:
            op_name = "linear_cross_entropy_vocab_parallel"
            vocab = f"V={V} per rank of tp group {m.group_name}"
        ctx.note(
            f"replaced {ce.name} and its head ({', '.join(n.name for n in reversed(m.chain))}) "
            f"with {fused.name} = graphtrain.{op_name}(H={H}, {vocab}, "
            f"reduction={m.reduction!r}, ignore_index={m.ignore_index}, "
            f"label_smoothing={m.label_smoothing}, mode={mode['mode']!r}): {why}"
        )
        changed = True
    return fx.finish(gm, changed)
