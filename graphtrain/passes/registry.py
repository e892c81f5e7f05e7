"""The pass registry: every graph pass graphtrain knows, with its stage, default and numerics.

A pass is `<name>_pass(gm, example_inputs, *, ctx) -> gm`. It rewrites `gm` in place or returns
it untouched when nothing matches, ends with `gm.graph.lint(); gm.recompile()` when it changed
anything, and explains itself through `ctx.note(...)` (what it matched, or why it did not):
those notes land in the graph dumps and in `graphtrain inspect`.

Stages:
  pre_grad   the Dynamo graph (torch IR, before AOT autograd): fusions that bring their own
             backward, where F.cross_entropy or the router is still a handful of nodes;
  post_grad  the forward and backward graphs after AOT autograd (aten IR, DTensor desugared,
             collectives explicit): overlap and scheduling passes.

Order: the list in graphtrain/passes/order.py (PASS_ORDER), with the reason for each place.

Switches: `compile.passes` is a list like ["-fuse_linear_cross_entropy", "+some_pass"]; "+name"
turns a pass on, "-name" off, anything else is an error naming the known passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from graphtrain.passes.order import PASS_ORDER, position

PASS_STAGES = ("pre_grad", "post_grad")


@dataclass
class PassContext:
    """What a pass may know about where it runs, and where it writes its notes.

    `options` are the job's settings that passes read (graphtrain.config.pass_options: the
    cross-entropy mode, FP8 filters, ...); a pass takes its own default for a missing key, so
    `torch.compile(backend="graphtrain")` works without a job config.
    """

    region: str = "graph"
    notes: list[str] = field(default_factory=list)
    options: Mapping[str, Any] = field(default_factory=dict)

    def note(self, message: str) -> None:
        self.notes.append(message)


PassFn = Callable[..., torch.fx.GraphModule]


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    stage: str
    order: int  # the position in PASS_ORDER
    default_on: bool
    preserves_numerics: bool
    description: str

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext
    ) -> torch.fx.GraphModule:
        return self.fn(gm, example_inputs, ctx=ctx)


_REGISTRY: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    *,
    preserves_numerics: bool,
    default_on: bool = True,
    stage: str | None = None,
) -> Callable[[PassFn], PassFn]:
    """Decorator adding a pass to the registry; the docstring's first line is its description.

    The stage and run order come from PASS_ORDER (graphtrain/passes/order.py), where every pass
    is listed with the reason for its place; a `stage` given here must agree with it."""
    if stage is not None and stage not in PASS_STAGES:
        raise ValueError(f"pass {name!r}: stage must be one of {PASS_STAGES}, got {stage!r}")
    listed = position(name)
    if listed is None:
        raise ValueError(
            f"pass {name!r} is not listed in PASS_ORDER (graphtrain/passes/order.py): add it "
            "at the place its dependencies give it"
        )
    if stage is None:
        stage = PASS_ORDER[listed][0]
    elif PASS_ORDER[listed][0] != stage:
        raise ValueError(
            f"pass {name!r} is registered for stage {stage!r} but PASS_ORDER lists it under "
            f"{PASS_ORDER[listed][0]!r} (graphtrain/passes/order.py)"
        )

    def decorate(fn: PassFn) -> PassFn:
        if name in _REGISTRY:
            raise ValueError(f"pass {name!r} is registered twice")
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = PassSpec(
            name, fn, stage, listed, default_on, preserves_numerics, doc[0] if doc else ""
        )
        return fn

    return decorate


def all_passes() -> list[PassSpec]:
    """Every registered pass, in run order (stage, then PASS_ORDER)."""
    return sorted(_REGISTRY.values(), key=lambda p: (PASS_STAGES.index(p.stage), p.order))


def resolve_passes(switches: Sequence[str] = ()) -> list[PassSpec]:
    """The passes to run: the defaults, changed by "+name" / "-name" switches, in run order."""
    enabled = {p.name for p in all_passes() if p.default_on}
    for switch in switches:
        sign, name = switch[:1], switch[1:]
        if sign not in ("+", "-") or name not in _REGISTRY:
            known = ", ".join(sorted(_REGISTRY)) or "(none)"
            raise ValueError(
                f"compile.passes entry {switch!r} is not '+name' or '-name' of a known pass; "
                f"known passes: {known}"
            )
        if sign == "+":
            enabled.add(name)
        else:
            enabled.discard(name)
    return [p for p in all_passes() if p.name in enabled]


def trainer_runs(name: str, compile_cfg: Any) -> bool:
    """Whether the trainer runs pass `name` under a [compile] section (graphtrain.config's
    CompileConfig): compile.enable, and the pass among those compile.passes resolves to."""
    return compile_cfg.enable and name in {p.name for p in resolve_passes(compile_cfg.passes)}
