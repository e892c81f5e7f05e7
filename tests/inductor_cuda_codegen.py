"""Inductor's CUDA code generation for a preset's compiled regions, on a machine without a GPU
(tests/test_inductor_cuda_codegen.py runs it in a child process and asserts on its report).

How: the model and its tokens are *fake* CUDA tensors (FakeTensorMode); just enough of CUDA is
stubbed for Inductor to generate its CUDA code: torch.cuda's device queries answer as an H100,
a stub Triton driver reports sm_90 (Triton compiles every generated kernel for it, with the
wheel's ptxas for registers and spills), and a no-op C++ device guard for DeviceType::CUDA
(a plain library built once per torch release with torch.utils.cpp_extension; a CPU build of
torch has none, a CUDA build's asks the driver, and indexing or .contiguous() on a fake CUDA
tensor takes one). It runs on a CPU build of torch or on a CUDA build without a GPU (checked
with 2.11, 2.13 and 2.14). graphtrain's regions and passes are applied as the trainer applies them
(apply_compile, Inductor inner backend, graph dumps). The compiled wrappers then run on the
fake tensors: Triton launches are no-ops, extern and custom ops run their fake kernels, and
every extern torch._scaled_mm call is recorded with its operands' shapes, strides and dtypes.

The backward: autograd's engine asks the accelerator for a device on CUDA tensors, which a CPU
build refuses ("Cannot access accelerator device when none is available"), so the default run
generates the forward regions (under no_grad, as validation runs them). --backward instead
traces each region's forward and backward on fake *CPU* tensors (bf16 CPU autocast, the CPU
attention), keeps the backward graph Inductor's partitioner cuts, then moves it to CUDA and
generates its CUDA code under the stubs (and runs it on fake tensors, which records the
_scaled_mm calls). What differs from a GPU's backward: decisions the passes and the model make
from the device (the attention kernel, compile.lce_mode auto) are the CPU's. The report adds,
per region, the tensors the forward keeps for the backward ("saved": what a step's activation
memory is made of).

    python tests/inductor_cuda_codegen.py --out report.json [--backward]
        [--attention causal|varlen|flex] PRESET [--section.key=value ...]
    python tests/inductor_cuda_codegen.py --jobs JOBS.json
--jobs: a JSON list of such argument lists (forward only), one report each, in one process (its
imports and Inductor's start cost ~7 s; a --backward job traces on CPU before the stubs: alone).
--attention: causal rows (the default), or packed documents through varlen attention or flex
attention with the trainer's block mask (fake ids: only sizes matter here).
Report: status ("ok" or the error), notes (per graph dump: the passes that changed it, their op
diffs and notes), captured (per graph: the op counts Dynamo captured), kernels (name, config,
shared, regs, spills, error), scaled_mm (one entry per call), saved (--backward).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# c10's header alone, loaded as a plain library (its static registration is all it does): built
# cold in ~1 s, where torch/extension.h and its Python binding took ~35 CPU-s (on every fresh
# CI machine).
_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
// A no-op device guard for DeviceType::CUDA: fake CUDA tensors pass through the C++ paths
// that take a guard (indexing, contiguous, ...); nothing runs on a device.
struct FakeCUDAGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return {c10::DeviceType::CUDA, 0}; }
  c10::Device getDevice() const override { return {c10::DeviceType::CUDA, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CUDA, 0));
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCUDAGuardImpl);
"""

H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
    total_memory=80 * 1024**3, warp_size=32, max_threads_per_multi_processor=2048,
    regs_per_multiprocessor=65536, shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472, shared_memory_per_block=49152,
    L2_cache_size=50 * 1024**2, is_integrated=False, is_multi_gpu_board=False,
    gcnArchName="", uuid="00000000-0000-0000-0000-000000000000", clock_rate=1980000,
    memory_clock_rate=2619000, memory_bus_width=5120, max_threads_per_block=1024,
)  # fmt: skip

KERNELS: list[dict[str, Any]] = []
SCALED_MM: list[dict[str, Any]] = []


def install() -> None:
    """The stubs (this process only: never import this module into a test process)."""
    import torch
    from torch.utils.cpp_extension import load
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    # One build per torch release: a CPU and a CUDA build, or two CUDA releases, would share a
    # build folder (and load each other's library) under one name. The build is reused while
    # the source's text is the same, wherever it was written.
    release = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
    with tempfile.TemporaryDirectory(prefix="graphtrain-guard-") as folder:
        source = Path(folder) / "fake_cuda_guard.cpp"
        source.write_text(_GUARD_SOURCE)
        load(
            name=f"graphtrain_fake_cuda_guard_{release}",
            sources=[str(source)],
            is_python_module=False,
            verbose=False,
        )

    class StubDriver:
        def __init__(self) -> None:
            self.target = GPUTarget("cuda", 90, 32)

        def get_current_target(self) -> Any:
            return self.target

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            return torch.device("cuda", 0)

        def is_active(self) -> bool:
            return True

        def get_device_interface(self) -> Any:
            return torch.cuda

        def get_benchmarker(self) -> Any:
            return lambda *args, **kwargs: 1.0

        def get_empty_cache_for_benchmark(self) -> Any:
            return torch.empty(1, device="cpu")

        def clear_cache(self, cache: Any) -> None:
            pass

    stub = StubDriver()
    driver.set_active(stub)
    import torch._inductor.runtime.triton_helpers as helpers

    helpers.set_driver_to_gpu = lambda: driver.set_active(stub)
    import torch._subclasses.fake_tensor as fake_tensor

    # A CUDA build's fake tensors first make a real CUDA tensor ("Found no NVIDIA driver").
    fake_tensor.init_gpu_context = lambda device: None
    c = torch.cuda
    c.is_available = lambda: True
    c.device_count = lambda: 1
    c.current_device = lambda: 0
    c.get_device_properties = lambda device=None: H100
    c._get_device_properties = lambda device=None: H100
    c.get_device_capability = lambda device=None: (9, 0)
    c.get_device_name = lambda device=None: H100.name
    c.is_bf16_supported = lambda *args, **kwargs: True
    c.set_device = lambda device: None
    c._lazy_init = lambda: None
    c.synchronize = lambda device=None: None
    c.mem_get_info = lambda device=None: (70 * 2**30, 80 * 2**30)
    c.memory.mem_get_info = c.mem_get_info
    c.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    c.set_rng_state = lambda state, device="cuda": None
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state
    c.manual_seed = lambda seed: None
    c.manual_seed_all = lambda seed: None
    c.is_current_stream_capturing = lambda: False  # torch 2.14's Dynamo asks (a CUDA build)
    c._exchange_device = lambda index: 0
    c._maybe_exchange_device = lambda index: 0
    torch._C._cuda_getCurrentRawStream = lambda device=0: 0
    torch._C._cuda_getDeviceCount = lambda: 1
    torch._C._dynamo.guards._reinterpret_tensor = lambda t, size, stride, offset=0: t.as_strided(
        size, stride, t.storage_offset() + offset
    )
    # The generated wrapper allocates through a C++ fast path that would bypass the fake mode.
    torch._C._dynamo.guards._empty_strided_cuda = lambda size, stride, dtype: torch.empty_strided(
        size, stride, dtype=dtype, device="cuda"
    )
    # Inductor traces its pattern libraries with real tensors on the input's device: on CPU.
    import torch._inductor.fx_passes.fuse_attention as fuse_attention
    import torch._inductor.fx_passes.misc_patterns as misc_patterns
    import torch._inductor.fx_passes.pad_mm as pad_mm

    for module, name in (
        (fuse_attention, "_sfdp_init"),
        (misc_patterns, "_misc_patterns_init"),
        (pad_mm, "_pad_mm_init"),
    ):
        original = getattr(module, name)
        setattr(
            module, name, (lambda o: lambda input_device=None: o(torch.device("cpu")))(original)
        )
    import torch._dynamo.device_interface as device_interface

    cuda_interface = device_interface.CudaInterface
    cuda_interface.exchange_device = staticmethod(lambda index: 0)
    cuda_interface.maybe_exchange_device = staticmethod(lambda index: 0)
    cuda_interface.current_device = staticmethod(lambda: 0)
    cuda_interface.is_available = staticmethod(lambda: True)

    # Compile only: record every variant of each Inductor Triton kernel, never load or launch.
    from torch._inductor.runtime import triton_heuristics

    sys.path.insert(0, str(HERE))
    from triton_aot import _ptxas, keep_ptxas_logs  # the kernel compile test's report

    keep_ptxas_logs()

    def record(self: Any) -> None:
        for result in self.compile_results:
            kernel = result.kernel
            metadata = getattr(kernel, "metadata", None)
            entry = {
                "name": getattr(self.fn, "__name__", str(self.fn)),
                "config": str(result.config),
                "shared": getattr(metadata, "shared", None),
                "num_warps": getattr(metadata, "num_warps", None),
                "error": None,
            }
            try:
                entry.update(_ptxas(kernel.asm["ptx"], 90))
            except Exception as error:  # no PTX: report, do not stop the run
                entry["error"] = f"{type(error).__name__}: {error}"
            KERNELS.append(entry)
        self.launchers = [lambda *args, **kwargs: None]

    triton_heuristics.CachingAutotuner._make_launchers = record
    triton_heuristics.CachingAutotuner.run = lambda self, *args, **kwargs: None
    # Every extern _scaled_mm the wrappers call, with its operands' layouts.
    from torch._inductor.select_algorithm import extern_kernels

    real_scaled_mm = extern_kernels._scaled_mm

    def scaled_mm(a: Any, b: Any, scale_a: Any, scale_b: Any, *args: Any, **kwargs: Any) -> Any:
        SCALED_MM.append({
            "a": [list(a.shape), list(a.stride()), str(a.dtype)],
            "b": [list(b.shape), list(b.stride()), str(b.dtype)],
            "scale_a": [list(scale_a.shape), str(scale_a.dtype)],
            "scale_b": [list(scale_b.shape), str(scale_b.dtype)],
            "out_dtype": str(kwargs.get("out_dtype")),
            "use_fast_accum": kwargs.get("use_fast_accum", args[3] if len(args) > 3 else False),
        })  # fmt: skip
        if kwargs.get("out") is not None:  # _scaled_mm.out has no fake kernel: nothing runs
            return kwargs["out"]
        return real_scaled_mm(a, b, scale_a, scale_b, *args, **kwargs)

    extern_kernels._scaled_mm = scaled_mm
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # Triton compiles in this process (the stub driver)
    # The static launcher keeps no PTX (ptxas reports registers and spills from it) and loads
    # the cubin on a device.
    inductor_config.use_static_cuda_launcher = False
    if hasattr(inductor_config, "use_static_triton_launcher"):
        inductor_config.use_static_triton_launcher = False
    inductor_config.joint_graph_constant_folding = False  # it runs nodes on real CUDA tensors


def _captured(dump: Path) -> dict[str, dict[str, int]]:
    """graph -> the op counts of its captured (pre-pass) graph."""
    return {
        str(summary.parent.relative_to(dump)): entry["op_counts"]
        for summary in sorted(dump.glob("*/**/summary.json"))
        for entry in json.loads(summary.read_text())
        if entry.get("label") == "captured"
    }


def _notes(dump: Path) -> list[dict[str, Any]]:
    found = []
    for summary in sorted(dump.glob("*/**/summary.json")):
        for entry in json.loads(summary.read_text()):
            if entry.get("notes") or entry.get("op_diff"):
                found.append({
                    "graph": str(summary.parent.relative_to(dump)),
                    "pass": entry.get("label"),
                    "op_diff": entry.get("op_diff"),
                    "notes": (entry.get("notes") or [])[:5],
                })  # fmt: skip
    return found


def _fake_model(cfg: Any, device: str) -> Any:
    """cfg's model with fake parameters and buffers on `device` (under the caller's FakeTensorMode;
    no to_empty swap)."""
    import torch

    from models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                fake = torch.empty(p.shape, dtype=p.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(fake, p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    return model


def _inputs(cfg: Any, device: str, attention: str) -> tuple:
    """Tokens and labels; with "varlen" or "flex", packed documents through that attention
    (fake ids: the kernels are generated, not run, so sizes are enough)."""
    import torch

    from graphtrain.attention import document_block_mask
    from models.gpt import DocumentSpans

    t = cfg.training
    shape = (t.micro_batch_size, t.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, device=device)
    inputs: tuple = (tokens[:, :-1], tokens[:, 1:])
    ids = torch.zeros(shape[0], t.seq_len, dtype=torch.int32, device=device)
    if attention == "varlen":
        cu = torch.zeros(8, dtype=torch.int32, device=device)  # up to 7 documents
        inputs += (None, DocumentSpans(cu, t.seq_len), ids)
    elif attention == "flex":  # the trainer's block mask (its compiled builder too)
        inputs += (None, document_block_mask(ids), ids)
    return inputs


def _trace_backward(
    cfg: Any, dump: Path, attention: str
) -> tuple[list[tuple], list[dict[str, Any]]]:
    """(each region's backward graph with its post-grad pass, each region's saved tensors):
    forward and backward traced on fake CPU tensors, Inductor's partition kept, no CPU code
    generated. Flex attention: torch's API refuses a CPU backward before tracing (its HOPs
    trace on any device): the check is lifted in this process."""
    import torch
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as inductor_config
    import torch.nn.attention.flex_attention as flex
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    if attention == "flex":
        flex._validate_device = lambda *tensors: None

    from graphtrain.compile import apply_compile
    from graphtrain.config import pass_options

    graphs, saved = [], []
    partition, inner = cfx.min_cut_rematerialization_partition, cfx._compile_fx_inner

    def keep(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        fw, bw = partition(joint, inputs, **kwargs)
        outs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        kept = [o for o in outs[kwargs["num_fwd_outputs"] :] if o.op != "placeholder"]
        vals = [(o.name, o.meta.get("val")) for o in kept]
        tensors = [(n, v) for n, v in vals if isinstance(v, torch.Tensor)]
        saved.append({
            "bytes": sum(v.numel() * v.element_size() for _, v in tensors),
            "tensors": [[n, str(v.dtype), list(v.shape)] for n, v in tensors],
        })  # fmt: skip
        # graphtrain's post-grad passes of this region, active while it compiles
        graphs.append((bw, inductor_config.post_grad_custom_post_pass))
        return fw, bw

    def no_run(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        """No CPU code (Inductor's CPU lowering of flex attention's training graphs fails, and
        nothing would run it): a function that returns fake outputs."""
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        vals = [o.meta.get("val") if hasattr(o, "meta") else o for o in out]
        return make_boxed_func(lambda *args: [
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor)
            else v for v in vals
        ])  # fmt: skip

    cfx.min_cut_rematerialization_partition, cfx._compile_fx_inner = keep, no_run
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = _fake_model(cfg, "cpu")
            apply_compile(
                model, passes=cfg.compile.passes, inner="inductor", dump_dir=dump,
                pass_options=pass_options(cfg), device_type="cpu",
            )  # fmt: skip
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(*_inputs(cfg, "cpu", attention))
    finally:
        cfx.min_cut_rematerialization_partition, cfx._compile_fx_inner = partition, inner
    return graphs, saved


def _generate_backward(graphs: list[tuple]) -> None:
    """Each backward graph moved to fake CUDA tensors, its CUDA code generated and run (under
    the stubs: install())."""
    import torch
    import torch._inductor.config as inductor_config
    import torch.utils._pytree as pytree
    import torch.utils._triton as triton_utils
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    for name in dir(triton_utils):  # "no Triton" was cached while torch.cuda said no device
        cache_clear = getattr(getattr(triton_utils, name), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    cuda = torch.device("cuda")

    def on_cuda(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=cuda)
        return v

    for bw, post_grad in graphs:
        # the graph and the subgraphs of its higher-order ops (flex attention's score and mask)
        for graph_module in bw.modules():
            if not isinstance(graph_module, torch.fx.GraphModule):
                continue
            for node in graph_module.graph.nodes:
                if node.kwargs.get("device") == torch.device("cpu"):
                    node.update_kwarg("device", cuda)
            graph_module.recompile()
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            for graph_module in bw.modules():  # the subgraphs' values: only the device changes
                if graph_module is not bw and isinstance(graph_module, torch.fx.GraphModule):
                    for node in graph_module.graph.nodes:
                        if "val" in node.meta:
                            node.meta["val"] = pytree.tree_map(on_cuda, node.meta["val"])
            inputs = [on_cuda(n.meta["val"]) for n in bw.graph.nodes if n.op == "placeholder"]
            FakeTensorProp(bw, mode).propagate(*inputs)
            with inductor_config.patch(post_grad_custom_post_pass=post_grad):
                compiled = compile_fx_inner(bw, inputs, is_backward=True)
            compiled(list(inputs))


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--backward", action="store_true", help="the backward regions, traced on CPU (docstring)"
    )
    parser.add_argument(
        "--attention", choices=("causal", "varlen", "flex"), default="causal",
        help="causal rows, or packed documents through varlen or flex attention",
    )  # fmt: skip
    parser.add_argument("preset")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    jobs = json.loads(Path(argv[1]).read_text()) if argv[:1] == ["--jobs"] else [argv]
    parsed = [_parse(job) for job in jobs]
    backward = any(args.backward for args, _ in parsed)
    if backward and len(parsed) > 1:
        sys.exit("a --backward job runs alone (it traces on CPU before the stubs are installed)")
    if backward:  # a cached CPU artifact would run on the fake CPU tensors: a segfault
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    sys.path.insert(0, str(HERE.parent))
    if not backward:  # the stubs before anything asks torch.cuda about the machine
        install()
    import graphtrain  # noqa: F401  (registers the backend and the ops)

    for args, overrides in parsed:
        _job(args, overrides)
    return 0


def _job(args: argparse.Namespace, overrides: list[str]) -> None:
    """One preset's regions generated, its report written to args.out."""
    import torch

    from graphtrain.config import load_config

    torch._dynamo.reset()
    KERNELS.clear()
    SCALED_MM.clear()
    cfg = load_config(["--preset", args.preset, *overrides])
    dump = Path(tempfile.mkdtemp(prefix="cuda-codegen-"))
    start = time.time()
    status, saved = "ok", None
    try:
        if args.backward:
            graphs, saved = _trace_backward(cfg, dump, args.attention)
            install()
            _generate_backward(graphs)
        else:
            _generate_forward(cfg, dump, args.attention)
    except Exception as error:  # the report says how far it got
        status = f"{type(error).__name__}: {str(error)[:500]}"
        traceback.print_exception(error, file=sys.stderr)  # with its causes
    report = {
        "preset": args.preset,
        "overrides": overrides,
        "status": status,
        "seconds": round(time.time() - start, 1),
        "notes": _notes(dump),
        "captured": _captured(dump),
        "kernels": KERNELS,
        "scaled_mm": SCALED_MM,
        "saved": saved,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    shutil.rmtree(dump, ignore_errors=True)  # what the report needs of it is in the report
    print(f"{args.preset} {overrides}: {status}; {len(KERNELS)} Triton kernels, "
          f"{len(SCALED_MM)} _scaled_mm calls, {report['seconds']} s", flush=True)  # fmt: skip


def _generate_forward(cfg: Any, dump: Path, attention: str) -> None:
    """The forward regions on fake CUDA tensors, under no_grad as validation runs them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphtrain.compile import apply_compile
    from graphtrain.config import pass_options

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _fake_model(cfg, "cuda")
        apply_compile(
            model, passes=cfg.compile.passes, inner="inductor", dump_dir=dump,
            pass_options=pass_options(cfg), cudagraph_mtp=False, device_type="cuda",
        )  # fmt: skip
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            model(*_inputs(cfg, "cuda", attention))


if __name__ == "__main__":
    sys.exit(main())
