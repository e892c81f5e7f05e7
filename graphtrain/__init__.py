"""graphtrain: a compile-graph-centric trainer for GPT and Mixture-of-Experts language models.

`import graphtrain` imports no torch, so that `graphtrain --help` answers at once. It still
registers the "graphtrain" torch.compile backend before anything can compile with it:
graphtrain.compile (the backend, its Dynamo flags, the passes and their custom ops) is imported
at once when torch._dynamo already is, else right after torch._dynamo's own import finishes
(torch.compile imports torch._dynamo before it looks a backend name up). So
`import graphtrain; torch.compile(m, backend="graphtrain")` works as before, in either order of
imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

__version__ = "0.1.0"

_DYNAMO = "torch._dynamo"


def _register_backend() -> None:
    import graphtrain.compile  # noqa: F401  (registers the "graphtrain" backend)


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch._dynamo's loader so that graphtrain.compile is
    imported once torch._dynamo has run, then steps out of sys.meta_path."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the ordinary finders, this one gone
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: types.ModuleType) -> None:
            # Patched on this loader instance only (torch._dynamo keeps its own loader, so
            # tracebacks and source lookups are unchanged), and removed after its one use.
            del loader.exec_module
            exec_module(module)
            _register_backend()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if _DYNAMO in sys.modules:
    _register_backend()
elif not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterDynamoImport())
