"""graphtrain's torch.compile backend, and the one place where Dynamo/Inductor flags are set.

    Dynamo graph (torch IR, pre-autograd)
      -> pre-grad passes       graphtrain.passes, stage "pre_grad", in registry order
      -> AOT autograd          (inside Inductor, or aot_eager's)
      -> post-grad passes      stage "post_grad", on the forward and the backward graph
      -> Inductor, or aot_eager (runs the aten graphs as they are: debugging, fast CPU tests)

`torch.compile(m, backend="graphtrain")` works after `import graphtrain` (default passes,
Inductor); `backend(passes=[...], inner="aot_eager", dump_dir=...)` gives a configured one.

Regions (`apply_compile`): every transformer block on its own, all blocks sharing one backend
(identical blocks share one compiled graph), one region for the final norm, output head and loss
(`head_loss`), and one per MTP depth ("mtp_1", ...), whose head and loss go through `head_loss`.
CUDA graphs for the MTP regions (`cudagraph_mtp`): Inductor's cudagraph trees, switched on for
those regions only; where the layout rules them out before any capture (not CUDA, aot_eager,
expert parallel, FSDP2, activation checkpointing), `cudagraph_fallback_reason` names why and
the regions run as ordinary compiled code, announced by one log line.
Selective recomputation (`activation_memory_budget` < 1): each region's partitioner keeps at
most that fraction of the activations it saves by default beyond the region's inputs and
recomputes the rest in the backward; graphtrain's ops and random ops are always saved.
Why per-block regions, why cudagraph trees over make_graphed_callables, and each fallback:
docs/design/compile.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo
from torch import nn
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from graphtrain.compile_fixes import inline_regions, unalias_all_reduce_inputs
from graphtrain.passes import PassContext, PassSpec, resolve_passes
from graphtrain.passes.dump import GraphDumper, write_compile_info

if TYPE_CHECKING:
    from graphtrain.config import Fp8Config

logger = logging.getLogger(__name__)

INNER_BACKENDS = ("inductor", "aot_eager")

# Dynamo flags, each with its reason.
# A compiled region with fullgraph=True that still recompiles for every block instance would hit
# the default limit of 8 on deep models; identical blocks share code, so a recompile is a bug we
# want to hear about rather than a silent fallback to eager.
torch._dynamo.config.fail_on_recompile_limit_hit = True


def _allow_fp32_grouped_mm_under_compile() -> None:
    """Let torch.compile trace fp32 torch._grouped_mm (every CPU run of the MoE model).

    torch's fake-tensor (meta) kernel of aten._grouped_mm (2.11 to 2.14) accepts bf16 only,
    although the CPU kernel and CUDA's fallback compute fp32 (pytorch PR 162059 enabled fp32 and left
    "better compile support" for later): compiling fails with "Expected inputs of BF16 type".
    This registers a fake kernel that returns, for fp32, the output layout torch's own meta code
    gives, and defers to torch's kernel for every other dtype. Registered only while torch still
    rejects fp32, so it disappears by itself once torch is fixed.
    """
    try:  # private helpers; where they are missing, so is the fix's need (checked on 2.11-2.14)
        from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm
    except ImportError:
        return
    probe = torch.empty(8, 8, device="meta")
    try:
        meta_grouped_mm(probe, probe.expand(1, 8, 8), offs=probe.new_empty(1, dtype=torch.int32))
        return
    except RuntimeError:
        pass

    def _grouped_mm_fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == mat_b.dtype == torch.float32 and bias is None and out_dtype is None:
            return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    # The op has a Meta kernel, next to which torch 2.11 refuses a fake kernel unless
    # allow_override=True (the default from 2.13 on); fake tensors then take this one first.
    torch.library.register_fake("aten::_grouped_mm", allow_override=True)(_grouped_mm_fake)


_allow_fp32_grouped_mm_under_compile()


def _run_passes(
    passes: Sequence[PassSpec],
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    region: str,
    dumper: GraphDumper | None,
    options: Mapping[str, Any],
) -> torch.fx.GraphModule:
    if dumper is not None and not dumper.steps:
        dumper.snapshot("captured", gm)
    for spec in passes:
        ctx = PassContext(region=region, options=options)
        start = time.perf_counter()
        gm = spec(gm, example_inputs, ctx)
        seconds = time.perf_counter() - start
        for note in ctx.notes:
            logger.debug("pass %s on %s: %s", spec.name, region, note)
        if dumper is not None:
            dumper.snapshot(spec.name, gm, ctx.notes, seconds=seconds)
    return gm


def _no_shared_aot_cache_across_ranks() -> None:
    """Turn the AOTAutograd cache off in a process that is one of several ranks.

    Its key (checked on torch 2.13) misses what AOT tracing bakes into a distributed graph: the
    process-group names of the collectives (a DeviceMesh input is hashed by its type) and the
    rank's mesh coordinate (the offsets of its shard). Ranks on one host share the cache on
    disk, so a rank could load another tp group's graph ("Could not resolve the process group
    registered under the name ...") or another tp rank's backward: wrong gradients, silently.
    Inductor's FX graph cache stays on: its key is the AOT graph, names and offsets included.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        torch._functorch.config.enable_autograd_cache = False


def _must_save(graph: torch.fx.Graph) -> None:
    """Tag the joint graph's nodes that the memory-budget partitioner must save, never
    recompute: graphtrain's ops (the fused loss computes its gradients in the forward, the FP8
    casts count saturation, and the partitioner prices an op it has no FLOP formula for as free)
    and random ops (torch recomputes them with fresh randomness, wrong gradients without an
    error: pytorch issue 190758; under Inductor, its seeds)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace == "graphtrain" or torch.Tag.nondeterministic_seeded in target.tags:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _saves_a_tuple(forward: torch.fx.GraphModule) -> bool:
    outputs = next(n for n in reversed(forward.graph.nodes) if n.op == "output").args[0]
    return any(
        isinstance(out, torch.fx.Node) and isinstance(out.meta.get("val"), (tuple, list))
        for out in outputs
    )


def _is_opaque(node: torch.fx.Node) -> bool:
    from torch._library.fake_class_registry import FakeScriptObject

    return node.op == "placeholder" and isinstance(node.meta.get("val"), FakeScriptObject)


def budget_partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """torch's min-cut partitioner under the memory budget, after _must_save. On torch < 2.14
    a region where only tagged ops were left to trade saved a multi-output op's tuple (torch
    returned the inputs and the tagged nodes, fixed in 2.14): such a region is partitioned
    again with its default activations."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    _must_save(joint.graph)
    flags = torch._functorch.config
    # The partitioner sizes every input: a tensor-parallel region's DeviceMesh is an opaque
    # object that torch 2.13+ refuses to size unless told it holds no tensors (it holds none);
    # torch 2.12 has it opaque and no way to say so (2.11 does not make it an input).
    opaque = "unsafe_treat_script_objects_as_zero_size"
    if not hasattr(flags, opaque) and any(_is_opaque(n) for n in joint.graph.nodes):
        raise ValueError(
            f"training.activation_memory_budget={flags.activation_memory_budget} in a region "
            f"with an opaque input (tensor parallel's DeviceMesh): torch {torch.__version__}'s "
            "partitioner cannot size it (torch 2.11 and 2.13+ can); set "
            "training.activation_memory_budget=1 or parallel.tp=1"
        )
    with flags.patch({opaque: True} if hasattr(flags, opaque) else {}):
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    if not _saves_a_tuple(forward):
        return forward, backward
    logger.info("activation_memory_budget: a region keeps its default activations (torch < 2.14)")
    with flags.patch(activation_memory_budget=1.0):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


class BudgetPartition(CustomPartitionerFn):
    """budget_partition as Inductor's partitioner (after its joint-graph passes); a class at
    module level, so that Inductor's cache can pickle it."""

    def __call__(self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        return budget_partition(joint, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        return "graphtrain.compile.budget_partition"


def _is_backward(gm: torch.fx.GraphModule) -> bool:
    # AOT autograd names the incoming gradients of a backward graph tangents_1, tangents_2, ...
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)


class _PostGradPasses:
    """Runs the post-grad passes (and dumps) on each AOT graph; plugs into both inner backends."""

    def __init__(
        self,
        passes: Sequence[PassSpec],
        region: str,
        dump_dir: Path | None,
        options: Mapping[str, Any],
    ) -> None:
        self.passes, self.region, self.dump_dir = list(passes), region, dump_dir
        self.options = options

    def run(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        kind = "backward" if _is_backward(gm) else "forward"
        dumper = GraphDumper(self.dump_dir / kind) if self.dump_dir is not None else None
        _run_passes(self.passes, gm, example_inputs, f"{self.region}/{kind}", dumper, self.options)


def _inductor_post_grad_pass(post: _PostGradPasses) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class InductorPostGrad(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            if clones := unalias_all_reduce_inputs(graph):
                logger.debug("%s: %d all-reduced cat inputs cloned", post.region, clones)
            post.run(graph.owning_module, ())

        def uuid(self) -> Any:
            # Inductor's FX graph cache keys on this, beside the graph before these passes:
            # the same passes with the same options (parallel.tp_overlap_variant changes what
            # overlap_tp_comm writes) give the same graphs. Its key misses whether the backward
            # may reuse its saved tensors' memory (donated_buffer): a backward cached with it on
            # ran a second time (split_backward_flags) read what its first run overwrote, so
            # the flag is in. When dumping, None turns the cache off so every graph is written.
            if post.dump_dir is not None:
                return None
            options = tuple(sorted((key, repr(value)) for key, value in post.options.items()))
            donated = torch._functorch.config.donated_buffer
            return "unalias_all_reduce", donated, tuple(p.name for p in post.passes), options

    return InductorPostGrad()


class GraphtrainBackend:
    """A Dynamo backend: pre-grad passes, then the inner backend with post-grad passes hooked in."""

    def __init__(
        self,
        *,
        passes: Sequence[str] = (),
        inner: str = "inductor",
        dump_dir: str | Path | None = None,
        region: str = "graph",
        pass_options: Mapping[str, Any] | None = None,
        inductor_options: Mapping[str, Any] | None = None,
        activation_memory_budget: float = 1.0,
    ) -> None:
        if inner not in INNER_BACKENDS:
            raise ValueError(f"compile.backend must be one of {INNER_BACKENDS}, got {inner!r}")
        if not 0 < activation_memory_budget <= 1:
            raise ValueError(
                f"activation_memory_budget must be in (0, 1], got {activation_memory_budget}"
            )
        self.passes = resolve_passes(passes)
        self.inner = inner
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.region = region
        self.pass_options = dict(pass_options or {})
        self.inductor_options = dict(inductor_options or {})
        self.activation_memory_budget = activation_memory_budget
        self._graph_ids = itertools.count()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        _no_shared_aot_cache_across_ranks()
        graph_dir = None
        if self.dump_dir is not None:
            graph_dir = self.dump_dir / f"{self.region}-{next(self._graph_ids)}"
        pre = [p for p in self.passes if p.stage == "pre_grad"]
        dumper = None
        if graph_dir is not None:
            dumper = GraphDumper(graph_dir)
            write_compile_info(graph_dir)
        # The passes work out new nodes' metadata on fake tensors: without autograd, so that a
        # region compiled inside activation checkpointing (whose hooks count the tensors saved
        # for backward) sees no extra saves during the forward that compiles it.
        with torch.no_grad():
            gm = _run_passes(pre, gm, example_inputs, self.region, dumper, self.pass_options)
        # A region the passes left (kept as one node for them: region_config) is inlined, as
        # Dynamo would have done: Inductor miscompiled one (graphtrain.compile_fixes).
        for name in inline_regions(gm):
            logger.debug("%s: region %s inlined (no pass replaced it)", self.region, name)
        post = _PostGradPasses(
            [p for p in self.passes if p.stage == "post_grad"],
            self.region,
            graph_dir,
            self.pass_options,
        )
        budget = self.activation_memory_budget
        # AOT autograd partitions the joint graph while this call compiles the forward. The
        # backward is traced with autocast off, as the step runs it (outside the forward's
        # autocast): torch's default traces it under the forward's autocast, which made the
        # backward matmuls of a region's fp32 code (autocast disabled there) bf16, unlike eager.
        flags = {"activation_memory_budget": budget, "backward_pass_autocast": "off"}
        with torch._functorch.config.patch(**flags):
            if self.inner == "inductor":
                from torch._inductor.compile_fx import compile_fx

                patches = dict(self.inductor_options)
                patches["post_grad_custom_post_pass"] = _inductor_post_grad_pass(post)
                if budget < 1:
                    patches["custom_partitioner_fn"] = BudgetPartition()
                return compile_fx(gm, example_inputs, config_patches=patches)
            return _aot_eager(gm, example_inputs, post, budget < 1)


def _aot_eager(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    post: _PostGradPasses,
    budgeted: bool,
) -> Callable:
    """torch's aot_eager (min-cut partitioner, inference input mutations kept) with the
    post-grad passes; `budgeted`: budget_partition as the partitioner."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        post.run(graph, inputs)
        return boxed_nop(graph, inputs)

    return aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=budget_partition if budgeted else min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def split_backward_flags() -> contextlib.AbstractContextManager[None]:
    """AOT autograd flags around a pipeline schedule that splits each backward in two (input
    gradients, then weight gradients, with retain_graph=True: zbv, dualpipev): a compiled
    backward that donates its saved buffers refuses a second call ("PP breaks under compile",
    torchtitan's users' complaint), so donated_buffer is off. AOT autograd reads the flag when a
    region compiles and again at each backward, both inside the schedule's step; off, the
    backward only reuses fewer buffers."""
    return torch._functorch.config.patch(donated_buffer=False)


@contextlib.contextmanager
def inspection_flags() -> Any:
    """Inductor flags while `graphtrain inspect` compiles (not in training):
    * trace.provenance_tracking_level=1: Inductor records, per generated kernel, the FX nodes
      it computes and their stack traces (torch._inductor.debug), which inspect keeps beside the
      generated code to attribute kernel time to source lines;
    * cpp.enable_kernel_profile: Inductor's C++ kernels (CPU) open a profiler record named after
      the kernel, so that `inspect --profile` sees them (Triton kernels are named in a GPU trace
      already). A flag that this torch lacks is skipped (the attribution then says so).
    """
    import torch._inductor.config as inductor_config

    wanted = {"trace.provenance_tracking_level": 1, "cpp.enable_kernel_profile": True}
    patches = {}
    for name, value in wanted.items():
        section, _, flag = name.partition(".")
        if hasattr(getattr(inductor_config, section, None), flag):
            patches[name] = value
    with inductor_config.patch(patches):
        yield


def backend(**options: Any) -> GraphtrainBackend:
    """A configured graphtrain backend: passes=["-name", "+name"], inner="inductor"|"aot_eager",
    dump_dir=path (write graph dumps), region=name (the dump folder's prefix),
    pass_options={...} (what the passes read: graphtrain.config.pass_options),
    inductor_options={...} (Inductor config patches of this backend's regions),
    activation_memory_budget=fraction in (0, 1] (selective recomputation; 1: off)."""
    return GraphtrainBackend(**options)


def step_hooks(*, fp8: Fp8Config | None) -> list[Any]:
    """The step hooks (graphtrain.step.StepHook) of the ops the passes insert, so that the
    step and the loop know no op: FP8's saturation counters where training.fp8 is on (fp8: the
    job's [fp8] section then, else None)."""
    if fp8 is None:
        return []
    from graphtrain.passes.fp8_linear import FP8Saturation

    return [FP8Saturation(fp8)]


def cudagraph_fallback_reason(
    *, device_type: str, inner: str, fullgraph: bool, fsdp: bool, activation_checkpoint: bool
) -> str | None:
    """Why the MTP regions cannot run as CUDA graphs in this layout, or None if they can
    (module docstring)."""
    if device_type != "cuda":
        return f"training runs on {device_type}; CUDA graphs need a CUDA device"
    if inner != "inductor":
        return f"compile.backend={inner!r}; the CUDA graphs come from Inductor"
    if not fullgraph:
        return "expert parallel's all-to-all has data-dependent shapes"
    if fsdp:
        return "FSDP2 gathers the parameters into new memory every step (their addresses move)"
    if activation_checkpoint:
        return "activation checkpointing would replay the captured forward inside backward"
    return None


class _CudagraphSkipReporter(logging.Handler):
    """Says once, as a warning in graphtrain's log, that Inductor skipped a CUDA graph capture
    and why. Inductor logs each skip to its "cudagraphs" artifact logger only (silent unless
    TORCH_LOGS asks), so a run whose MTP regions could not be captured (mutated inputs, a CPU
    tensor, an op that cannot be captured...) was silently slower. Only the MTP regions have
    CUDA graphs on, so a skip is theirs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)  # skips are warnings; the artifact's info is not one
        self.reported = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.reported:
            return
        self.reported = True
        logger.warning(
            "compile.cudagraph_mtp: Inductor did not capture an MTP region as a CUDA graph; it "
            "runs without one (slower): %s",
            record.getMessage(),
        )


def watch_cudagraph_skips() -> _CudagraphSkipReporter:
    """Report Inductor's CUDA graph skips once (_CudagraphSkipReporter); idempotent."""
    from torch._inductor import cudagraph_utils

    log = cudagraph_utils.cudagraphs_log
    found = next((h for h in log.handlers if isinstance(h, _CudagraphSkipReporter)), None)
    if found is None:
        found = _CudagraphSkipReporter()
        log.addHandler(found)
    return found


def region_config(fullgraph: bool = True) -> Any:
    """The Dynamo flags a graphtrain region is traced under, as a context manager or decorator
    (torch._dynamo.config.patch), so that a plain torch.compile in the same process (the
    benchmarks' plain rows) traces with torch's defaults:
    * a torch.compiler.nested_compile_region called once (the Gated DeltaNet recurrence, once
      per block) stays one invoke_subgraph node, the node the gated_delta_rule pass replaces
      with its op; the backend inlines what the passes leave (torches without the flag never
      inline such a region);
    * with fullgraph=False (expert parallel's all-to-all and its split sizes), ops whose output
      shape or value depends on the data (the router's bincount) stay in the graph for the
      passes to see, as fullgraph=True keeps them."""
    flags: dict[str, Any] = {}
    if hasattr(torch._dynamo.config, "inline_single_use_invoke_subgraph"):
        flags["inline_single_use_invoke_subgraph"] = False
    if not fullgraph:
        flags |= {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
    return torch._dynamo.config.patch(flags)


def _compile_region(module: nn.Module, region_backend: GraphtrainBackend, fullgraph: bool) -> None:
    module.compile(backend=region_backend, fullgraph=fullgraph)
    module._compiled_call_impl = region_config(fullgraph)(module._compiled_call_impl)


def apply_compile(
    model: nn.Module,
    *,
    passes: Sequence[str] = (),
    inner: str = "inductor",
    dump_dir: str | Path | None = None,
    fullgraph: bool = True,
    pass_options: Mapping[str, Any] | None = None,
    cudagraph_mtp: bool = False,
    device_type: str = "cpu",
    fsdp: bool = False,
    activation_checkpoint: bool = False,
    regions: Collection[str] | None = None,
    activation_memory_budget: float = 1.0,
) -> None:
    """Compile each transformer block, each MTP depth's layer and the head+loss region of
    `model` in place.

    regions: compile only these ("block", "mtp_1", ..., "head_loss"), the others run eager
    (None: all); `graphtrain inspect --profile` compiles one region again with a pass off.

    cudagraph_mtp: run the MTP regions as CUDA graphs where `cudagraph_fallback_reason` (given
    device_type, fsdp, activation_checkpoint and this call's inner and fullgraph) allows;
    otherwise they are compiled as the rest and one log line names the reason.

    activation_memory_budget: every region's selective recomputation (module docstring).

    Module.compile keeps parameter names (no `_orig_mod.` prefix), so checkpoints and the TP and
    FSDP plans see the same names compiled or not.
    """
    common = {
        "passes": passes,
        "inner": inner,
        "dump_dir": dump_dir,
        "pass_options": pass_options,
        "activation_memory_budget": activation_memory_budget,
    }
    block_backend = backend(**common, region="block")
    for block in model.layers.values() if regions is None or "block" in regions else ():
        _compile_region(block, block_backend, fullgraph)
    mtp_layers = list(model.mtp_layers.values()) if getattr(model, "mtp_layers", None) else []
    mtp_options = {}
    if mtp_layers and cudagraph_mtp:
        reason = cudagraph_fallback_reason(
            device_type=device_type,
            inner=inner,
            fullgraph=fullgraph,
            fsdp=fsdp,
            activation_checkpoint=activation_checkpoint,
        )
        if reason is None:
            mtp_options = {"triton.cudagraphs": True}
            watch_cudagraph_skips()  # a capture Inductor skips later is said, not silent
        else:
            logger.info("compile.cudagraph_mtp: the MTP layers run without CUDA graphs: %s", reason)
    for k, mtp_layer in enumerate(mtp_layers, start=1):
        if regions is not None and f"mtp_{k}" not in regions:
            continue
        # A backend per depth: Dynamo keeps one compiled entry per backend, so each depth has
        # its own code (and CUDA graphs over its own parameters) instead of sharing one.
        mtp_backend = backend(**common, region=f"mtp_{k}", inductor_options=mtp_options)
        _compile_region(mtp_layer, mtp_backend, fullgraph)
    if regions is not None and "head_loss" not in regions:
        return
    head_backend = backend(**common, region="head_loss")
    model.head_loss = torch.compile(model.head_loss, backend=head_backend, fullgraph=fullgraph)


torch._dynamo.register_backend(name="graphtrain", compiler_fn=backend())
