"""Rank functions for tests/parallel/test_overlap_tp_comm.py (run with parallel_dist.run_ranks).

Each compiles a model (aot_eager) with the overlap_tp_comm pass switched off and on, trains it
the same few steps in both, and returns the losses, the gradients of every step and the pass's
notes (rank 0's graph dumps), so the test can assert bitwise equality and what was rewritten.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from parallel_scenarios import BATCH, SEED, SEQ
from torch.distributed.tensor import DTensor, Replicate, Shard

from graphtrain.compile import backend
from graphtrain.parallel import ParallelDims, build_mesh, dp_mesh, parallelize_model
from models import MODEL_PRESETS, build_model, tp_plan

STEPS = 2


def _notes(dump: Path) -> dict[str, list[str]]:
    """{"block-0/forward": [notes...], ...}: the overlap pass's notes of every AOT graph."""
    out: dict[str, list[str]] = {}
    for summary in sorted(dump.glob("*/*/summary.json")):
        graph = f"{summary.parent.parent.name}/{summary.parent.name}"
        for step in json.loads(summary.read_text()):
            if step["label"] == "overlap_tp_comm":
                out.setdefault(graph, []).extend(step["notes"])
    return out


def _train(rank: int, world: int, spec: dict[str, Any], overlap: bool, dump: Path) -> dict:
    torch._dynamo.reset()
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
            "passes": [] if overlap else ["-overlap_tp_comm"],
            "dump_dir": dump if rank == 0 else None,
            "pass_options": {
                "tp_overlap_chunks": spec.get("chunks", 0),
                "tp_overlap_variant": spec.get("variant", "auto"),
            },
        },
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
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
    return {"losses": losses, "grads": grads if rank == 0 else None}


def compare(rank: int, world: int, specs: list[dict[str, Any]]) -> dict[str, Any]:
    """For each spec: the off and on runs, and the pass's notes of the on run."""
    out = {}
    for spec in specs:
        if spec.get("variant") == "symm_mem" and spec.get("device", "cpu") == "cpu":
            _register_cpu_symm_mem()
        with tempfile.TemporaryDirectory() as tmp:
            # A spec that only checks what the pass notes needs no run without it.
            off = (
                _train(rank, world, spec, False, Path(tmp) / "off")
                if spec.get("compare", True)
                else None
            )
            on = _train(rank, world, spec, True, Path(tmp) / "on")
            out[spec["name"]] = {"off": off, "on": on, "notes": _notes(Path(tmp) / "on")}
    if all(spec.get("device", "cpu") == "cpu" for spec in specs):
        out["refusal"] = _gather_without_gemm(rank, world)
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
