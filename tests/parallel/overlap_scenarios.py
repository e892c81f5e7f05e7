"""Rank functions for tests/parallel/test_overlap_tp_comm.py (run with parallel_dist.run_ranks).

Each compiles a model (aot_eager) with a post-grad pass (spec "toggle": overlap_tp_comm, or
fp8_all_gather with "+fp8_linear" in spec "passes") switched off and on, trains it the same few
steps in both, and returns the losses, the gradients of every step, the pass's notes (rank
0's graph dumps; overlap_tp_comm's too) and the most collectives of a group its graphs keep in
flight at once, so the test can assert bitwise equality and what was rewritten. A spec's "also"
(passes) adds a third run: the on run with those switched too.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from parallel_scenarios import BATCH, SEED, SEQ
from torch.distributed.tensor import DTensor, Replicate, Shard

from graphtrain.compile import backend
from graphtrain.config import Fp8Config
from graphtrain.parallel import ParallelDims, build_mesh, dp_mesh, parallelize_model
from models import MODEL_PRESETS, build_model, tp_plan

STEPS = 2


def _notes(dump: Path, label: str = "overlap_tp_comm") -> dict[str, list[str]]:
    """{"block-0/forward": [notes...], ...}: the pass's notes of every AOT graph."""
    out: dict[str, list[str]] = {}
    for summary in sorted(dump.glob("*/*/summary.json")):
        graph = f"{summary.parent.parent.name}/{summary.parent.name}"
        for step in json.loads(summary.read_text()):
            if step["label"] == label:
                out.setdefault(graph, []).extend(step["notes"])
    return out


def _train(
    rank: int, world: int, spec: dict[str, Any], on: bool, dump: Path, extra: tuple = ()
) -> dict:
    torch._dynamo.reset()
    toggled = spec.get("toggle", "overlap_tp_comm")
    fsdp_fp8 = toggled == "fp8.fsdp_all_gather_fp8"  # an option of parallelize_model, no pass
    fp8 = {k[4:]: v for k, v in spec.get("options", {}).items() if k.startswith("fp8.")}
    device = spec.get("device", "cpu")
    dims = ParallelDims(**spec["dims"], world_size=world)
    mesh = build_mesh(dims, device)
    if device == "cuda":  # the symm_mem variant's condition (torchtitan's async TP does the same)
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(mesh["tp"].get_group().group_name)
    cfg = dataclasses.replace(MODEL_PRESETS[spec["model"]], num_kv_heads=4)
    with torch.device("meta"):
        model = build_model(cfg)
    parallelize_model(
        model,
        mesh,
        dims,
        plan=tp_plan(cfg, dims.etp, dims.ep),
        ac_mode="none",
        compile_options={
            "inner": spec.get("inner", "aot_eager"),
            "passes": [
                *spec.get("passes", []),
                *([] if on or fsdp_fp8 else [f"-{toggled}"]),
                *extra,
            ],
            "dump_dir": dump if rank == 0 else None,
            "pass_options": {
                "tp_overlap_chunks": spec.get("chunks", 0),
                "tp_overlap_variant": spec.get("variant", "auto"),
                **spec.get("options", {}),
            },
        },
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        fp8_all_gather=Fp8Config(**fp8) if on and fsdp_fp8 else None,
    )
    model.to_empty(device=device)
    model.init_weights(SEED)
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g).to(device)
    dp = dp_mesh(mesh) if dims.dp_size > 1 else None
    rows = BATCH // dims.dp_size
    start = (dp.get_local_rank() if dp is not None else 0) * rows
    tokens = tokens[start : start + rows]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(STEPS):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads.append(
            {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return {"losses": losses, "grads": grads if rank == 0 else None, "gathered": _gathered(model)}


def _gathered(model: torch.nn.Module) -> dict[str, list[torch.dtype]]:
    """{parameter: dtypes FSDP2 all-gathered it in} for the first block ({} without FSDP)."""
    block = model.layers["0"]
    if not hasattr(block, "_get_fsdp_state"):
        return {}
    group = block._get_fsdp_state()._fsdp_param_group
    return {p._param_fqn: [t.dtype for t in p.all_gather_outputs] for p in group.fsdp_params}


_COLLECTIVE = re.compile(
    r"(\w+): \"[^\"]*\" = torch\.ops\._c10d_functional\.(\w+)\.default\(([^)]*)\)"
)


def _most_in_flight(dump: Path) -> int:
    """The most collectives of one group started and not yet waited on at once, over the graphs
    overlap_tp_comm rewrote (their dumps, in the order the graphs run)."""
    most = 0
    for graph in dump.glob("*/*/*_overlap_tp_comm.txt"):
        group_of: dict[str, str] = {}
        in_flight: dict[str, set[str]] = {}
        for name, op, args in _COLLECTIVE.findall(graph.read_text()):
            if op == "wait_tensor":
                handle = args.strip()
                if handle in group_of:
                    in_flight[group_of[handle]].discard(handle)
                continue
            group_of[name] = args.rsplit(",", 1)[-1].strip().strip("'")
            in_flight.setdefault(group_of[name], set()).add(name)
            most = max(most, len(in_flight[group_of[name]]))
    return most


def _scaled_mm_fast_accum(dump: Path) -> list[bool]:
    """use_fast_accum of each aten._scaled_mm in the graphs overlap_tp_comm rewrote."""
    return [
        "use_fast_accum = True" in line
        for graph in dump.glob("*/*/*_overlap_tp_comm.txt")
        for line in graph.read_text().splitlines()
        if "aten._scaled_mm.default(" in line
    ]


# What only the toggled pass reads: specs that differ in nothing else share their off run.
_ON_ONLY = ("name", "chunks", "variant", "compare")


def compare(rank: int, world: int, specs: list[dict[str, Any]]) -> dict[str, Any]:
    """For each spec: the off and on runs, and the pass's notes and most in flight of the on run."""
    out: dict[str, Any] = {}
    offs: dict[str, dict] = {}
    for spec in specs:
        if spec.get("variant") == "symm_mem" and spec.get("device", "cpu") == "cpu":
            _register_cpu_symm_mem()
        with tempfile.TemporaryDirectory() as tmp:
            # A spec that only checks what the pass notes needs no run without it.
            off = None
            if spec.get("compare", True):
                key = json.dumps(
                    {k: v for k, v in spec.items() if k not in _ON_ONLY}, sort_keys=True
                )
                if key not in offs:
                    offs[key] = _train(rank, world, spec, False, Path(tmp) / "off")
                off = offs[key]
            on = _train(rank, world, spec, True, Path(tmp) / "on")
            notes = _notes(Path(tmp) / "on", spec.get("toggle", "overlap_tp_comm"))
            overlap_notes = _notes(Path(tmp) / "on")  # the same unless another pass is toggled
            out[spec["name"]] = {"off": off, "on": on, "notes": notes, "overlap": overlap_notes,
                                 "in_flight": _most_in_flight(Path(tmp) / "on"),
                                 "fast_accum": _scaled_mm_fast_accum(Path(tmp) / "on")}  # fmt: skip
            if "also" in spec:  # a third run: the on run with these passes switched too
                out[spec["name"]]["also"] = _train(
                    rank, world, spec, True, Path(tmp) / "also", tuple(spec["also"])
                )
    if all(spec.get("device", "cpu") == "cpu" for spec in specs):
        out["refusal"] = _gather_without_gemm(rank, world)
        out["fp8_gather"] = _fp8_gather(rank, world)
    return out


_CPU_SYMM_MEM: list = []


def _register_cpu_symm_mem() -> None:
    """torch's own fallback kernels of the symm_mem fused ops (all-gather or reduce-scatter,
    then the matmul) registered for CPU, where torch has none: what the symm_mem rewrite
    computes is checked on gloo; its speed only on GPUs."""
    import torch.distributed._symmetric_memory as symm_mem

    if not _CPU_SYMM_MEM:
        lib = torch.library.Library("symm_mem", "IMPL")
        lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
        lib.impl(
            "fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU"
        )
        _CPU_SYMM_MEM.append(lib)  # registrations live as long as the library object


def _gather_without_gemm(rank: int, world: int) -> list[str]:
    """A sequence-sharded tensor gathered and reduced without a GEMM: left alone, with a note."""
    torch._dynamo.reset()
    mesh = build_mesh(ParallelDims(tp=world, dp_shard=1, world_size=world), "cpu")["tp"]

    def gathered_sum(x: DTensor, w: torch.Tensor) -> torch.Tensor:
        full = x.redistribute(placements=[Replicate()]).to_local()
        return (full.relu() * w).sum()

    x = DTensor.from_local(torch.randn(2, 4, 8), mesh, [Shard(1)])
    with tempfile.TemporaryDirectory() as tmp:
        be = backend(inner="aot_eager", dump_dir=Path(tmp), region="gathered_sum")
        out = torch.compile(gathered_sum, backend=be, fullgraph=True)(
            x, torch.randn(2, 4 * world, 8)
        )
        assert torch.isfinite(out)
        return [n for notes in _notes(Path(tmp)).values() for n in notes]


def _fp8_gather(rank: int, world: int) -> dict[str, Any]:
    """Two bf16 sequence shards gathered into fp8_linear (compiled with fp8_all_gather): x's
    only consumer is the op, so it is gathered in FP8; y is also summed, so it stays bf16. The
    reference gathers bf16 and casts with the global amax: the op's FP8 copy of x must be
    those bytes."""
    torch._dynamo.reset()
    mesh = build_mesh(ParallelDims(tp=world, dp_shard=1, world_size=world), "cpu")["tp"]
    group = mesh.get_group().group_name
    fp8_linear = torch.ops.graphtrain.fp8_linear

    def gathered_fp8(x: DTensor, y: DTensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full_x = x.redistribute(placements=[Replicate()]).to_local()
        full_y = y.redistribute(placements=[Replicate()]).to_local()
        _, x8_t, sx, _, _ = fp8_linear(full_x, w, None, tp_group=group)
        out_y = fp8_linear(full_y, w, None, tp_group=group)[0]
        return x8_t, sx, out_y + full_y.sum()

    g = torch.Generator().manual_seed(SEED + rank)  # each rank its own shard
    shards = [torch.randn(2, 8, 32, generator=g).bfloat16() * (rank + 1) for _ in range(2)]
    x, y = (DTensor.from_local(s, mesh, [Shard(1)]) for s in shards)
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(SEED)).bfloat16()
    with tempfile.TemporaryDirectory() as tmp:
        be = backend(inner="aot_eager", dump_dir=Path(tmp), region="fp8_gather")
        x8_t, sx, out_y = torch.compile(gathered_fp8, backend=be, fullgraph=True)(x, y, w)
        notes = [n for ns in _notes(Path(tmp), "fp8_all_gather").values() for n in ns]
        chunked = [n for ns in _notes(Path(tmp)).values() for n in ns if "chunked into" in n]
        (graph,) = Path(tmp).glob("*/forward/*_fp8_all_gather.txt")
        gathers = [
            line
            for line in graph.read_text().splitlines()
            if "= torch.ops._c10d_functional.all_gather" in line
        ]
    full = x.full_tensor().reshape(-1, 32)  # gathered in bf16
    amax = torch.ops.graphtrain.fp8_amax(full)  # the global amax
    _, ref_t, ref_sx, _ = torch.ops.graphtrain.fp8_cast(
        full, amax, torch.float8_e4m3fn, False, True
    )
    y_full = y.full_tensor()
    ref_y = fp8_linear(y_full, w, None)[0] + y_full.sum()
    return {
        "x8_t": x8_t.view(torch.uint8), "ref_t": ref_t.view(torch.uint8), "sx": sx,
        "ref_sx": ref_sx, "out_y": out_y, "ref_y": ref_y, "notes": notes, "gathers": gathers,
        "chunked": chunked,
    }  # fmt: skip
