"""Graph passes: the registry, and one module per pass (imported here so each registers itself)."""

from graphtrain.passes.registry import (
    PassContext,
    PassSpec,
    all_passes,
    register_pass,
    resolve_passes,
)

__all__ = ["PassContext", "PassSpec", "all_passes", "register_pass", "resolve_passes"]
