"""The order the graph passes run in, stated once: one line per pass on why it sits there.

Contract
    PASS_ORDER lists every registered pass as (stage, name, why), pre_grad first; the registry
    runs the passes of a stage in this order (registry.all_passes) and tests/passes/
    test_registry.py checks that every registered pass is listed and that a compile runs them
    in this order. A new pass is added here, at the place its dependencies give it.
"""

from __future__ import annotations

PASS_ORDER: tuple[tuple[str, str, str], ...] = (
    # pre_grad: the Dynamo graph (torch IR), fusions that bring their own backward
    ("pre_grad", "canonicalize", "first: the fusions read the one spelling it writes"),
    (
        "pre_grad",
        "gated_delta_rule",
        "after canonicalize; it reads only the marked recurrence region, no other fusion's ops",
    ),
    (
        "pre_grad",
        "fuse_linear_cross_entropy",
        "before any pass that rewrites linears: fp8_linear must not take the head",
    ),
    ("pre_grad", "fuse_moe_router", "after the loss fusion: a router holds no loss head"),
    ("pre_grad", "fuse_moe_dispatch", "after fuse_moe_router, whose indices the slot order sorts"),
    (
        "pre_grad",
        "fuse_sibling_grouped_mm",
        "after fuse_moe_dispatch, which gives w1 and w3 the same permuted input",
    ),
    (
        "pre_grad",
        "fold_routing_weights",
        "after fuse_moe_dispatch, whose moe_unpermute it reads; before fp8_linear casts w2's rows",
    ),
    (
        "pre_grad",
        "fp8_linear",
        "last: after the head is fused and w1/w3 merged (one wider FP8 GEMM, one cast of x)",
    ),
    # post_grad: forward and backward graphs after AOT autograd, collectives explicit
    (
        "post_grad",
        "fp8_all_gather",
        "before overlap_tp_comm, which would otherwise take the gathers it can chunk",
    ),
    ("post_grad", "overlap_tp_comm", "after fp8_all_gather: it chunks the gathers left bf16"),
    (
        "post_grad",
        "fp8_cast_once",
        "after fp8_all_gather and overlap_tp_comm, which take gathered inputs",
    ),
)


def position(name: str) -> int | None:
    """Index of pass `name` in PASS_ORDER; None when it is not listed."""
    for index, (_stage, listed, _why) in enumerate(PASS_ORDER):
        if listed == name:
            return index
    return None
