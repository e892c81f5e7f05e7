"""compile.lce_mode = "auto" under tensor parallelism: one decision for the whole tp group.

Fast and low-memory modes issue different numbers of collectives, so two ranks of a tp group
that chose differently would hang in the op. Each rank here compiles the same vocab-parallel
head (gloo, 2 ranks) with its own memory budget, as ranks with different free memory would
have; the pass must pick the same mode on both, from the group's smallest budget, and the
compiled loss and gradients must equal the eager unfused ones (fp32; reduction order only).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from parallel_dist import run_ranks

PASS = "fuse_linear_cross_entropy"
N, H, V = 12, 8, 2 * 11  # V split evenly over 2 ranks
BIG = 1 << 40  # fits fast mode's extra bytes at any size here
# (per-rank budgets, the mode every rank must choose): the first case is the hang of issue 26
# (rank 0 alone would pick fast, rank 1 low-memory); the second shows fast is still chosen.
CASES = [((BIG, 100), "low_memory"), ((BIG, BIG + 1), "fast")]


def _head(h, w, t):
    from torch.distributed.tensor import Replicate

    logits = F.linear(h, w).redistribute(placements=[Replicate()]).to_local()
    return F.cross_entropy(logits.float().view(-1, V), t)


def _rank(rank: int, world: int, dump_root: str) -> list[dict]:
    import torch.distributed as dist
    from conftest import pass_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from graphtrain.compile import backend

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    h_full = torch.randn(N, H, generator=g)
    w_full = torch.randn(V, H, generator=g) / H**0.5
    t = torch.randint(0, V, (N,), generator=g)
    results = []
    for i, (budgets, _) in enumerate(CASES):
        runs = {}
        for compiled in (True, False):
            h = distribute_tensor(h_full.clone(), mesh, [Replicate()]).requires_grad_(True)
            w = distribute_tensor(w_full.clone(), mesh, [Shard(0)]).requires_grad_(True)
            fn = _head
            dump = Path(dump_root) / f"rank{rank}" / f"case{i}"
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(
                    _head,
                    backend=backend(
                        inner="aot_eager",
                        dump_dir=dump,
                        pass_options={"lce_memory_budget": budgets[rank]},
                    ),
                    fullgraph=True,
                )
            loss = fn(h, w, t)
            loss.backward()
            runs[compiled] = (loss.detach(), h.grad.full_tensor(), w.grad.full_tensor())
        notes = pass_step(dump, PASS)["notes"]
        results.append({"notes": notes, "compiled": runs[True], "eager": runs[False]})
    dist.barrier()
    return results


def test_auto_mode_is_decided_once_for_the_tp_group(tmp_path):
    ranks = run_ranks(_rank, 2, str(tmp_path), timeout=300)
    for i, (budgets, mode) in enumerate(CASES):
        for rank, result in enumerate(ranks):
            (note,) = [n for n in result[i]["notes"] if "replaced" in n]
            assert f"mode={mode!r}" in note, (rank, budgets, note)
            smallest = min(budgets) / (1 << 30)
            assert f"budget of {smallest:.2f} GiB" in note, note
            assert "the smallest over the 2 ranks of tp group" in note, note
            for got, want in zip(result[i]["compiled"], result[i]["eager"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
