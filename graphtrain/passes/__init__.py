"""Graph passes: the registry, and one module per pass (imported here so each registers itself)."""

import graphtrain.passes.linear_cross_entropy  # noqa: F401  (registers the pass)
from graphtrain.passes import (  # noqa: F401  (each registers its pass)
    canonicalize,
    fold_routing_weights,
    fp8_all_gather,
    fp8_cast_once,
    fp8_linear,
    fuse_moe_dispatch,
    fuse_sibling_grouped_mm,
    gated_delta_rule,
    moe_route,  # fuse_moe_router
    overlap_tp_comm,
)
from graphtrain.passes.registry import (
    PassContext,
    PassSpec,
    all_passes,
    register_pass,
    resolve_passes,
)

__all__ = ["PassContext", "PassSpec", "all_passes", "register_pass", "resolve_passes"]
