"""Compile every graphtrain Triton kernel for Hopper (sm_90) or Blackwell (sm_100) on a machine
without a GPU, at the configurations the CUDA launchers choose at benchmark shapes, and report
each compiled variant's shared memory, registers, spills and global memory instructions
(tests/custom_ops/test_triton_aot.py asserts on them).

How: a stub Triton driver reports a CUDA target; JITFunction.run is patched to compile only
(warmup=True) and record what it compiled; Autotuner.run compiles every config instead of
benchmarking (what the first CUDA call's autotuning compiles). The real launchers are called on
*meta* tensors (no memory; data_ptr() keeps the storage offset, so Triton's alignment
specialisation is the real one), so block sizes, warps, stages and constexprs are those of the
CUDA path. Shared memory is the compiled kernel's metadata; registers and spills come from
`ptxas -v` (the ptxas in the triton wheel). Limits: 232448 B of shared memory per block (227 KiB,
H100/H200/B200 opt-in) and 65536 registers per SM (registers x threads of one block).

Run as a script in its own process (the patches and the stub driver never enter a test process):
    python tests/triton_aot.py --subset fast|ci|all --arch 90|100 --out records.json
Each record: case, kernel, constexprs, num_warps, num_stages, shared, regs, spill_stores,
spill_loads, global_ops (SASS global loads and stores by width, e.g. {"STG.E.128": 4}),
instructions (SASS, static: a straight-line kernel's work a thread), compile_s, error (None
when it compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

SMEM_LIMIT = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin, H100/H200/B200 (227 KiB)
REGS_PER_SM = 65536

RECORDS: list[dict[str, Any]] = []
CASES: list[tuple[str, str, Callable[[], None]]] = []  # (name, subset, run)
_CURRENT = {"case": "", "arch": 90}
_SEEN: set = set()


TIERS = ("fast", "ci", "all")  # each includes the ones before it


def case(name: str, subset: str = "ci") -> Callable:
    """Register a launcher call in a tier: "fast" is the representative set the suite runs
    unmarked, "ci" the slow-marked rest that still fits the suite's budget, "all" adds what
    takes minutes per case (run on request: GRAPHTRAIN_TRITON_AOT_ALL=1)."""

    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CASES.append((name, subset, fn))
        return fn

    return register


def find(package: str, name: str) -> Any:
    """`name` from `package` or one of its submodules: a launcher keeps its name when its
    module is split into a package."""
    module = importlib.import_module(package)
    if hasattr(module, name):
        return getattr(module, name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + "."):
        sub = importlib.import_module(info.name)
        if hasattr(sub, name):
            return getattr(sub, name)
    raise AttributeError(f"no {name!r} in {package} or its submodules")


_PTXAS_LOGS: dict[str, str] = {}  # sha256 of a PTX -> the log of Triton's own ptxas -v on it


def keep_ptxas_logs() -> None:
    """Keep the log of the `ptxas -v` Triton runs on each PTX it compiles (it prints it on
    request), so that _ptxas reads registers and spills from it instead of running ptxas on
    the same PTX again (half the ptxas time of a compile check). A kernel Triton's cache
    gave, or a triton without the knob, still gets its own ptxas run."""
    from triton import knobs
    from triton.backends.nvidia.compiler import CUDABackend

    if not hasattr(knobs.nvidia, "dump_ptxas_log"):
        return
    knobs.nvidia.dump_ptxas_log = True
    make_cubin = CUDABackend.make_cubin

    def logged(self: Any, src: str, *args: Any, **kwargs: Any) -> Any:
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                return make_cubin(self, src, *args, **kwargs)
        except Exception:
            sys.stdout.write(log.getvalue())  # Triton's own report of the failure
            raise
        finally:
            _PTXAS_LOGS[hashlib.sha256(src.encode()).hexdigest()] = log.getvalue()

    CUDABackend.make_cubin = logged


def _ptxas(ptx: str, arch: int) -> dict[str, int | None]:
    """ptxas -v's registers and spills for `ptx`, with the ptxas Triton compiles for `arch`
    with (triton 3.9 takes its CUDA 13 ptxas for Hopper too: its PTX is too new for the
    CUDA 12.9 one): from the log of Triton's own run where keep_ptxas_logs kept it."""
    from triton.backends.nvidia.compiler import get_ptxas

    log = _PTXAS_LOGS.get(hashlib.sha256(ptx.encode()).hexdigest())
    if log is None:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        try:
            run = subprocess.run(
                [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=900,
            )
        finally:
            os.unlink(f.name)
        log = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "regs": int(regs.group(1)) if regs else None,
        "spill_stores": int(spill.group(1)) if spill else None,
        "spill_loads": int(spill.group(2)) if spill else None,
    }


def _sass(cubin: bytes) -> dict:
    """global_ops, the SASS global loads and stores of a compiled kernel by width (static
    counts, from the triton wheel's cuobjdump: "STG.E.U8" is a byte a thread, "STG.E.128" 16
    bytes), and instructions, its SASS instruction count."""
    from collections import Counter

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        run = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True
        )
    finally:
        os.unlink(f.name)
    return {
        "global_ops": dict(Counter(re.findall(r"\b((?:LDG|STG)\.E[\w.]*)", run.stdout))),
        "instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", run.stdout)),
    }


def _install(arch: int) -> None:
    """The stub driver and the compile-only patches (this process only)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    class StubDriver:
        """Just enough of a Triton driver for compile-only runs (nothing launches)."""

        def __init__(self) -> None:
            self.target = GPUTarget("cuda", arch, 32)

        def get_current_target(self) -> Any:
            return self.target

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            return torch.device("cuda", 0)

        def is_active(self) -> bool:
            return True

    driver.set_active(StubDriver())
    keep_ptxas_logs()
    original = JITFunction.run
    options = ("num_warps", "num_stages", "num_ctas", "maxnreg", "debug", "instrumentation_mode")

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        consts = {k: v for k, v in kwargs.items() if k not in options}
        dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        key = (
            self.fn.__name__,
            tuple(sorted((k, str(v)) for k, v in consts.items())),
            kwargs.get("num_warps", 4),
            kwargs.get("num_stages", 3),
            dtypes,
        )
        if key in _SEEN:  # the JIT cache would not compile it again either
            return None
        _SEEN.add(key)
        record: dict[str, Any] = {
            "case": _CURRENT["case"],
            "arch": arch,
            "kernel": self.fn.__name__,
            "constexprs": {k: v for k, v in consts.items() if k.isupper()},
            "dtypes": [d.removeprefix("torch.") for d in dtypes],
            "num_warps": kwargs.get("num_warps", 4),
            "num_stages": kwargs.get("num_stages", 3),
            "error": None,
        }
        start = time.perf_counter()
        try:
            compiled = original(self, *args, grid=grid, warmup=True, **kwargs)
            record["shared"] = compiled.metadata.shared
            record["num_warps"] = compiled.metadata.num_warps
            record["num_stages"] = compiled.metadata.num_stages
            record.update(_ptxas(compiled.asm["ptx"], arch))
            record.update(_sass(compiled.asm["cubin"]))
        except Exception as error:  # a compile error is what we report
            record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            record["traceback"] = traceback.format_exc()[-2000:]
        record["compile_s"] = round(time.perf_counter() - start, 2)
        RECORDS.append(record)
        print(line(record), flush=True)
        return None

    def every_config(self: Any, *args: Any, **kwargs: Any) -> None:
        grid = kwargs.pop("grid")
        kwargs.pop("warmup", None)
        for config in self.configs:
            self.fn.run(*args, grid=grid, warmup=True, **{**kwargs, **config.all_kwargs()})

    JITFunction.run = compile_only
    Autotuner.run = every_config
    _meta_addmm_out_dtype(torch)


def _meta_addmm_out_dtype(torch: Any) -> None:
    """torch 2.11's meta kernel of addmm with out_dtype (its addmm decomposition) reads out_dtype
    as beta and raises; fast mode's cuBLAS accumulation calls it (the CUDA kernel is sound). On
    such a torch, torch.addmm into a meta `out` with out_dtype returns `out`."""
    acc = torch.empty(2, 2, device="meta")
    half = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    try:
        torch.addmm(acc, half, half, out_dtype=torch.float32, out=acc)
        return
    except TypeError:
        pass
    original = torch.addmm

    def addmm(*args: Any, out: Any = None, out_dtype: Any = None, **kwargs: Any) -> Any:
        if out is not None and out.is_meta and out_dtype is not None:
            return out
        extra = {} if out_dtype is None else {"out_dtype": out_dtype}
        return original(*args, out=out, **extra, **kwargs)

    torch.addmm = addmm


def config(record: dict[str, Any]) -> str:
    """The compiled variant, in one short string (the table's config column)."""
    skip = ("FP8_MAX", "CLIP", "EPS")
    consts = ",".join(f"{k}={v}" for k, v in record["constexprs"].items() if k not in skip)
    return f"w{record['num_warps']} s{record['num_stages']} {consts}"


def line(record: dict[str, Any]) -> str:
    status = record["error"] or "compiled"
    return (
        f"sm_{record['arch']} {record['case'][:44]:44} {record['kernel'][:26]:26} "
        f"smem={record.get('shared', '-')!s:>6} regs={record.get('regs', '-')!s:>3} "
        f"spill={record.get('spill_stores', '-')!s:>5} {record['compile_s']:6.1f}s {status} "
        f"[{config(record)}]"
    )


def _meta(*shape: int, dtype: Any = None) -> Any:
    import torch

    return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")


# --------------------------------------------------------------------------------------------
# The cases: the launchers at benchmark shapes (DESIGN.md's targets, the moe-1b preset).


def _cases() -> None:
    import torch

    from graphtrain.custom_ops import adamw_step as aw
    from graphtrain.custom_ops import fp8_amax as fa
    from graphtrain.custom_ops import fp8_cast as fc
    from graphtrain.custom_ops import moe_permute as mp
    from graphtrain.custom_ops import moe_swiglu as sw

    f32, bf16 = torch.float32, torch.bfloat16
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    amax0 = _meta(dtype=f32)

    # FP8 amax and casts (fp8_linear, fp8_grouped_mm): activations, gradients, fp32 masters.
    for dt, subset in ((bf16, "fast"), (f32, "ci")):
        x = _meta(16384, 4096, dtype=dt)
        tag = str(dt).removeprefix("torch.")
        case(f"fp8_amax {tag} 16384x4096", subset)(lambda x=x: fa.fp8_amax_triton(x))
        case(f"fp8_cast {tag} 16384x4096 e4m3 +T", subset)(
            lambda x=x: fc.fp8_cast_triton(x, amax0, e4m3, False, True)
        )
    g = _meta(16384, 4096)
    case("fp8_cast bf16 grad 16384x4096 e5m2 +T")(
        lambda: fc.fp8_cast_triton(g, amax0, e5m2, False, True)
    )
    w = _meta(64, 1024, 1024, dtype=f32)  # moe-1b's w1|w3 experts, fp32 masters
    case("fp8_amax per-slice fp32 [64,1024,1024]")(lambda: fa.fp8_amax_triton(w, per_slice=True))
    case("fp8_cast per-slice fp32 [64,1024,1024]")(
        lambda: fc.fp8_cast_triton(w, _meta(64, dtype=f32), e4m3, True, True)
    )
    M = 98304  # moe-1b: 16384 tokens x top-6
    xg, offs = _meta(M, 1024), _meta(64, dtype=torch.int32)
    case("fp8_cast GROUPED bf16 [98304,1024] 64 groups", "fast")(
        lambda: fc.fp8_cast_triton(xg, amax0, e4m3, False, True, offs)
    )

    # AdamW (optim.implementation = "graphtrain"): fp32 / bf16 moments, with and without copies.
    aw._to_device = lambda host, device: host.to(device)  # meta: no host-to-device copy
    sizes = [(4096, 4096), (1024,), (14336, 4096), (7,)]
    for state in (f32, bf16):
        for copies in (True, False):
            ps, gs = ([_meta(*s, dtype=f32) for s in sizes] for _ in range(2))
            ms, vs = ([_meta(*s, dtype=state) for s in sizes] for _ in range(2))
            cs = [_meta(*s, dtype=bf16) for s in sizes] if copies else []
            subset = "fast" if (state, copies) == (f32, True) else "ci"
            case(f"adamw_step state={str(state)[6:]} copies={copies}", subset)(
                lambda ps=ps, gs=gs, ms=ms, vs=vs, cs=cs: aw.adamw_step_triton(
                    ps, gs, ms, vs, cs, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                    weight_decay=0.1, step=3.0,
                )
            )  # fmt: skip
    flat = _meta(4096 * 4096 + 3, dtype=f32)  # a parameter at an odd offset of a flat buffer
    p_un = [flat[3:].view(4096, 4096)]
    case("adamw_step unaligned (ALIGNED=False)")(
        lambda: aw.adamw_step_triton(
            p_un, p_un, p_un, p_un, [], lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
            weight_decay=0.1, step=3.0,
        )
    )  # fmt: skip

    # Linear + cross-entropy (head_loss): fast and low-memory mode at the benchmark shapes.
    lce_triton = find("graphtrain.custom_ops.linear_cross_entropy", "_lce_triton")
    shapes = [(8192, 4096, 128256), (16384, 2048, 151936)]
    modes = [
        (bf16, bf16, "low_memory", True),
        (bf16, f32, "low_memory", True),
        (bf16, f32, "fast", True),  # the trainer's default: fp32 master head
        (bf16, bf16, "fast", True),
        (bf16, bf16, "fast", False),
        (f32, f32, "low_memory", True),  # fp32 compute (no autocast)
    ]
    for N, H, V in shapes:
        for hdt, wdt, mode, acc in modes:
            # Every case compiles its kernels again (K, the chunk length, is a constexpr): the
            # first shape's bf16 modes in the suite, the rest (the fp32 path's ptxas runs with
            # kilobytes of spills take minutes each) on request.
            first = (N, H, V) == shapes[0]
            subset = "fast" if first and (hdt, wdt, mode) == (bf16, bf16, "low_memory") else "ci"
            if not first or hdt == f32 or (wdt, mode) == (bf16, "fast"):
                subset = "all"
            hidden, weight = _meta(N, H, dtype=hdt), _meta(V, H, dtype=wdt)
            name = f"lce {mode} h={str(hdt)[6:]} w={str(wdt)[6:]} acc32={acc} {N}x{H}x{V}"
            case(name, subset)(
                lambda h=hidden, w=weight, m=mode, a=acc, N=N: lce_triton(
                    h, w, _meta(N, dtype=torch.int64), row_scale=_meta(N, dtype=f32),
                    lse_in=None, mode=m, fp32_accumulator=a,
                )
            )  # fmt: skip
        hidden, weight = _meta(N, H), _meta(V, H)
        case(f"lce low_memory backward(none) {N}x{H}x{V}", "ci" if N == 8192 else "all")(
            lambda h=hidden, w=weight, N=N: lce_triton(
                h, w, _meta(N, dtype=torch.int64), row_scale=_meta(N, dtype=f32),
                lse_in=_meta(N, dtype=f32), reduction="none",
            )
        )  # fmt: skip

    scale = find("graphtrain.custom_ops.linear_cross_entropy", "_lce_scale_kernel")
    gw = _meta(128256, 4096)  # the fp32-accumulated head gradient's in-place scaling
    case("lce scale bf16 [128256,4096]", "fast")(
        lambda: scale[(-(-gw.numel() // 4096),)](gw, _meta(dtype=f32), gw.numel(), BLOCK=4096)
    )

    # MoE router (fused forward and backward).
    route = find("graphtrain.custom_ops.moe_route", "moe_route_triton")
    route_backward = find("graphtrain.custom_ops.moe_route", "moe_route_backward_triton")
    options = find("graphtrain.custom_ops.moe_route", "RouteOptions")
    sigmoid = dict(score_func="sigmoid", num_groups=8, topk_groups=4, normalize=True)
    routers = [
        ("bench 65536x256 top8 softmax", 65536, 256, 8, {}, False, "ci"),
        ("bench 65536x256 top8 sigmoid g8/4 bias", 65536, 256, 8, sigmoid, True, "ci"),
        ("bench 65536x256 top8 softmax post-topk", 65536, 256, 8, {"pre_softmax": False}, False,
         "ci"),
        ("moe-1b 16384x64 top6 sigmoid g8/4 bias seqaux", 16384, 64, 6,
         {**sigmoid, "aux_seq_len": 4096}, True, "fast"),
        ("moe-1b + z-loss (return_lse)", 16384, 64, 6,
         {**sigmoid, "aux_seq_len": 4096, "return_lse": True}, True, "ci"),
        ("4096 experts top8 softmax", 8192, 4096, 8, {}, False, "ci"),
        ("256 experts softmax aux+lse", 65536, 256, 8, {"aux_seq_len": 4096, "return_lse": True},
         False, "ci"),
    ]  # fmt: skip
    for name, T, E, k, opts, bias, subset in routers:
        logits = _meta(T, E, dtype=f32)
        b = _meta(E, dtype=f32) if bias else None
        case(f"moe_route fwd {name}", subset)(
            lambda lg=logits, b=b, k=k, o=opts: route(lg, b, k, **o)
        )
        o = options(k, **opts)
        gaux = _meta(o.sequences(T), E, dtype=f32) if o.aux_seq_len else None
        glse = _meta(T, dtype=f32) if o.return_lse else None
        case(f"moe_route bwd {name}", subset)(
            lambda lg=logits, k=k, o=o, ga=gaux, gl=glse, T=T: route_backward(
                _meta(T, k, dtype=f32), ga, gl, lg, _meta(T, k, dtype=torch.int64),
                **o.backward_options(),
            )
        )  # fmt: skip

    # Gated DeltaNet's loop over chunks at Qwen3-Next's head shape (32 value heads of 128, keys
    # 128), sequence 4096 in 64 chunks of 64 (N and C are constexprs of the kernels); the
    # chunk terms are torch's. 16-bit inputs: tf32 products (fp32 inputs: tf32x3, the ci tier).
    gdr = importlib.import_module("graphtrain.custom_ops.gated_delta_rule")
    shape = (1, 32, 64, 64)  # B, H, N, C
    q_state, u_v, u_s, k_end = (_meta(*shape, 128, dtype=f32) for _ in range(4))
    intra, decay = _meta(*shape, 64, dtype=f32), _meta(*shape[:3], 1, 1, dtype=f32)
    states = _meta(*shape[:3], 128, 128, dtype=f32)
    for precision, subset in (("tf32", "fast"), ("tf32x3", "ci")):
        case(f"gated_delta_rule recurrence fwd 1x32x4096 D=128 {precision}", subset)(
            lambda p=precision: gdr.chunk_recurrence_triton(
                q_state, intra, u_v, u_s, k_end, decay, p
            )
        )
        case(f"gated_delta_rule recurrence bwd 1x32x4096 D=128 {precision}", subset)(
            lambda p=precision: gdr.chunk_recurrence_backward_triton(
                u_v, q_state, intra, u_s, k_end, decay, u_v, states, p
            )
        )

    # Each chunk's system inverted (graphtrain::unit_lower_inverse): 1 x 32 x 64 chunks of 64,
    # and a padded size (24) in the ci tier.
    uli = importlib.import_module("graphtrain.custom_ops.unit_lower_inverse")
    for C, subset in ((64, "fast"), (24, "ci")):
        case(f"unit_lower_inverse 2048 x {C}x{C}", subset)(
            lambda C=C: uli.unit_lower_inverse_triton(_meta(1, 32, 64, C, C, dtype=f32))
        )

    # MoE dispatch (permute / unpermute and its backward).
    for T, k, D, xdt, subset in (
        (16384, 6, 1024, f32, "ci"),
        (16384, 6, 1024, bf16, "fast"),
        (8192, 8, 7168, bf16, "ci"),
    ):
        x, order = _meta(T, D, dtype=xdt), _meta(T * k, dtype=torch.int64)
        ys, wts = _meta(T * k, D), _meta(T, k, dtype=f32)
        tag = f"T={T} k={k} D={D} x={str(xdt)[6:]}"
        case(f"moe_permute {tag}", subset)(
            lambda x=x, o=order, k=k: mp.moe_permute_triton(x, o, k, dtype=bf16)
        )
        case(f"moe_unpermute {tag}", subset)(
            lambda ys=ys, o=order, w=wts, k=k, d=xdt: mp.moe_unpermute_triton(ys, o, w, k, dtype=d)
        )
        case(f"moe_unpermute_bwd {tag}", subset)(
            lambda ys=ys, o=order, w=wts, k=k, x=x, T=T, D=D: mp.moe_unpermute_backward_triton(
                _meta(T, D, dtype=x.dtype), ys, o, w, k
            )
        )

    # The experts' weighted SwiGLU (fold_routing_weights), moe-1b's 16384 x 6 rows, F = 512.
    ab, ws = _meta(98304, 1024), _meta(98304, dtype=f32)
    case("moe_weighted_swiglu 98304 x [512|512] bf16", "fast")(
        lambda: sw.moe_weighted_swiglu_triton(ab, ws)
    )
    case("moe_weighted_swiglu_bwd 98304 x [512|512] bf16", "fast")(
        lambda: sw.moe_weighted_swiglu_backward_triton(_meta(98304, 512), ab, ws)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", choices=TIERS, default="fast")
    parser.add_argument("--arch", type=int, choices=(90, 100), default=90)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="run the cases whose name has this text")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _install(args.arch)
    _cases()
    start = time.time()
    for name, subset, run in CASES:
        if TIERS.index(subset) > TIERS.index(args.subset) or args.only not in name:
            continue
        _CURRENT["case"] = name
        try:
            run()
        except Exception as error:  # a launcher that fails on meta
            RECORDS.append({
                "case": name, "arch": args.arch, "kernel": "(launcher)", "constexprs": {},
                "dtypes": [], "num_warps": 0, "num_stages": 0, "compile_s": 0.0,
                "error": f"launcher {type(error).__name__}: {str(error)[:300]}",
                "traceback": traceback.format_exc()[-2000:],
            })  # fmt: skip
            print(line(RECORDS[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(RECORDS, f, indent=1, default=str)
    print(f"{len(RECORDS)} kernels compiled for sm_{args.arch} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
